"""What the architectures' ONNX block builders share (models/qwen4_exp/onnx_blocks.py,
models/deepseek_v4/onnx_blocks.py): the graph under construction and its dtype, and the
few ops every block emits the same way (scalar constants, the casts to float32 and back,
SiLU, the unweighted RMS statistics), so the two exports cannot round differently where
their torch models do not; and the stored-format weights (:mod:`.onnx_quant`): an FP8
linear through DequantizeLinear of its bytes, a MoE layer's experts through the
EngramRoutedExperts plugin or, where it cannot take them, dense stacks (dequantized
ones for FP8).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np
from onnx import TensorProto

from engram_trt.errors import EngramError
from engram_trt.models.export import PLUGIN_NAMESPACE, PLUGIN_VERSION

F32 = TensorProto.FLOAT


def plugin_fields(**fields: Any) -> dict[str, Any]:
    """A plugin node's attributes: the project's plugin version and namespace, then ``fields``."""
    return {"plugin_version": PLUGIN_VERSION, "plugin_namespace": PLUGIN_NAMESPACE, **fields}


@dataclass
class GraphBlocks:
    """The graph under construction plus what every block reads: ``g`` (the node
    accumulator of :mod:`engram_trt.models.engram_llama.onnx_export`), ``get``
    (checkpoint name -> tensor) and the graph's ONNX element type / NumPy dtype."""

    g: Any
    config: Any
    get: Callable[[str], Any]
    elem: int
    np_dt: Any

    def act_scalar(self, value: float) -> str:
        key = f"c_act_{value!r}".replace(".", "p").replace("-", "m")
        return self.g.const(key, np.asarray(value, dtype=self.np_dt))

    def f32_scalar(self, value: float) -> str:
        key = f"c_f32_{value!r}".replace(".", "p").replace("-", "m")
        return self.g.const(key, np.asarray(value, dtype=np.float32))

    def f32(self, x: str) -> str:
        return x if self.elem == F32 else self.g.op("Cast", [x], "to_f32", to=F32)

    def act(self, x: str) -> str:
        return x if self.elem == F32 else self.g.op("Cast", [x], "to_act", to=self.elem)

    def silu(self, x: str) -> str:
        return self.g.op("Mul", [x, self.g.op("Sigmoid", [x])], "silu")

    def rms(self, xf: str, size: int) -> str:
        """``x * rsqrt(mean(x^2) + eps)`` over the last axis, float32 in and out."""
        ones = self.g.const(f"c_ones_{size}", np.ones(size, dtype=np.float32))
        return self.g.op(
            "RMSNormalization", [xf, ones], "rms", axis=-1, epsilon=float(self.config.rms_norm_eps), stash_type=1
        )

    # -- weights in their stored format (models/onnx_quant.py) -------------------------
    def source(self) -> Mapping[str, Any]:
        """The checkpoint's tensors as a mapping (``in``, item access): what the
        stored-format readers take."""
        from engram_trt.models.onnx_quant import export_source

        return export_source(self.get)

    def stored_fp8(self, name: str, *, scale: Any = None, block: Any = None) -> Any:
        """Checkpoint tensor ``name`` as a QuantWeight when it is stored FP8, else None."""
        from engram_trt.models.onnx_quant import fp8_weight

        return fp8_weight(self.source(), name, self.config.quant, scale=scale, block=block)

    def fp8_linear(self, x: str, name: str, hint: str) -> str | None:
        """``x @ W^T`` through DequantizeLinear when ``name`` is stored FP8 (None: it is not)."""
        from engram_trt.models.onnx_quant import quant_matmul

        qw = self.stored_fp8(name)
        return None if qw is None else quant_matmul(self.g, x, name, qw, self.elem, hint)

    def expert_stack(
        self, key: str, parts: Sequence[Any], floats: Callable[[], np.ndarray], along: str
    ) -> tuple[str, int]:
        """One projection of every expert as the dense MoE's right operand: ``(tensor, its
        rows K)``. ``parts``: each expert's stored weight (QuantWeight) or None (float);
        ``along`` ``rows`` (gate / up: experts' outputs side by side, ``[Dp, E*I]``) or
        ``cols`` (down: ``[E*Ip, D]``, each expert's inputs padded to whole blocks);
        ``floats()`` the float stack ``[K, N]`` when no expert is stored FP8."""
        from engram_trt.models.onnx_quant import dequantized_t, fp8_matrix

        stored = [p is not None for p in parts]
        if all(stored):
            data, scale, bk = fp8_matrix(parts, along)
            return dequantized_t(self.g, key, data, scale, bk, self.elem), int(data.shape[1])
        if any(stored):
            raise EngramError(f"internal: {key} mixes FP8 and float experts (the checkpoint check refuses that)")
        arr = np.ascontiguousarray(floats())
        return self.g.const(key, arr), int(arr.shape[0])

    def dense_experts(
        self,
        x: str,
        routing: str,
        key: str,
        gate: tuple[Sequence[Any], Callable[[], np.ndarray]],
        up: tuple[Sequence[Any], Callable[[], np.ndarray]],
        down: tuple[Sequence[Any], Callable[[], np.ndarray]],
        hidden_fn: Callable[[str, str], str],
        experts: int,
        intermediate: int,
    ) -> str:
        """Every expert on every token (``x [T, D]``), weighted by the dense ``routing [T, E]``
        (0 where a token did not pick the expert): one stacked gate / up GEMM, each
        expert's activations ``hidden_fn(gate, up)`` scaled by its routing weight, one down
        GEMM. Stored FP8 stacks are dequantized in the graph (their activations padded with
        zero columns to whole blocks)."""
        from engram_trt.models.onnx_quant import pad_columns

        g, E, I = self.g, int(experts), int(intermediate)
        D = int(self.config.hidden_size)
        gw, gk = self.expert_stack(f"{key}.gate_stack", gate[0], gate[1], "rows")
        uw, uk = self.expert_stack(f"{key}.up_stack", up[0], up[1], "rows")
        dw, dk = self.expert_stack(f"{key}.down_stack", down[0], down[1], "cols")
        h = hidden_fn(
            g.op("MatMul", [pad_columns(g, x, gk - D), gw], "experts_gate"),
            g.op("MatMul", [pad_columns(g, x, uk - D), uw], "experts_up"),
        )
        h = g.op(
            "Mul",
            [g.op("Reshape", [h, g.ints([0, E, I])]), g.op("Unsqueeze", [routing, g.ints([2])])],
            "experts_routed",
        )  # [T, E, I]
        h = pad_columns(g, h, dk // E - I, "pad_experts_k", rank=3)
        return g.op("MatMul", [g.op("Reshape", [h, g.ints([0, dk])]), dw], "experts_down")
