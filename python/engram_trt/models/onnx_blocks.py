"""What the architectures' ONNX block builders share (models/qwen4_exp/onnx_blocks.py,
models/deepseek_v4/onnx_blocks.py): the graph under construction and its dtype, and the
few ops every block emits the same way (scalar constants, the casts to float32 and back,
SiLU, the unweighted RMS statistics), so the two exports cannot round differently where
their torch models do not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
from onnx import TensorProto

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
        return self.g.op("RMSNormalization", [xf, ones], "rms", axis=-1, epsilon=float(self.config.rms_norm_eps),
                         stash_type=1)
