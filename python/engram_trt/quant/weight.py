"""One weight in the format its checkpoint stores it (:class:`QuantWeight`), and
:class:`QuantLinear`, the ``nn.Linear`` of a model whose weight is stored FP8 or FP4.

A QuantLinear holds the stored bytes as its ``weight`` (``float8_e4m3fn [N, K]``, or
``int8 [N, K/2]`` for packed FP4) and the block scales as ``weight_scale_inv``
(``float32`` or ``float8_e8m0fnu``), the names transformers' FP8 modules use, so a
loader fills them straight from the checkpoint's tensors (``<name>.weight`` and
``<name>.weight_scale_inv`` or ``<name>.scale``) without a conversion. Nothing is
dequantized for storage: host and GPU memory hold the stored bytes.

``forward`` on a CUDA device runs the kernel library's products in the stored format
(:func:`engram_trt.native.quant.linear`: activations quantized per token and 128
columns as the reference's FP8 inference does, then an FP8 GEMV for a few rows or the
FP8 tensor-core GEMM); elsewhere (the CPU path, the parity tests) it dequantizes the
one weight it needs, exactly, and runs ``F.linear``: what transformers does when it
loads such a checkpoint on a CPU (it dequantizes at load).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engram_trt.errors import EngramError
from engram_trt.quant.formats import dequantize_fp4, dequantize_fp8, scale_grid
from engram_trt.quant.spec import FP4_GROUP

KINDS = ("fp8", "fp4")
# How activations are quantized before a product with each kind of weight on the GPU
# (group of columns, power-of-two scales): FP8 linears as the Hopper FP8 inference does
# (1x128 groups, float32 scales); FP4 experts as the published FP8 x FP4 expert kernels
# do (1x32 groups, ue8m0 scales). docs/quantization.md says where each comes from.
ACT_QUANT = {"fp8": (128, False), "fp4": (FP4_GROUP, True)}
QUANT_BACKENDS = ("auto", "kernels", "torch")


@dataclass
class QuantWeight:
    """A stored weight ``[..., N, K]`` (leading dims: stacked experts): ``data`` the bytes
    (``float8_e4m3fn [..., N, K]`` or packed ``int8 [..., N, K/2]``), ``scale`` the block
    scales ``[..., ceil(N/bn), ceil(K/bk)]`` (``float32`` or ``float8_e8m0fnu``)."""

    data: torch.Tensor
    scale: torch.Tensor
    kind: str
    block: tuple[int, int]

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise EngramError(f"QuantWeight kind {self.kind!r} is not one of {list(KINDS)}")

    @property
    def out_features(self) -> int:
        return int(self.data.shape[-2])

    @property
    def in_features(self) -> int:
        return int(self.data.shape[-1]) * (2 if self.kind == "fp4" else 1)

    @property
    def scale_fmt(self) -> str:
        return "ue8m0" if self.scale.dtype in (torch.uint8, torch.float8_e8m0fnu) else "float"

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scale.numel() * self.scale.element_size()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight ``[..., N, K]`` (exact in float32 / float64), for the CPU path,
        the export's checks and the tests; serving on a GPU never makes it."""
        if self.kind == "fp8":
            return dequantize_fp8(self.data, self.scale, self.block, dtype)
        return dequantize_fp4(self.data, self.scale, self.block, dtype)


def check_quant_tensors(
    name: str,
    kind: str,
    shape: tuple[int, ...],
    data_shape: tuple[int, ...],
    scale_shape: tuple[int, ...] | None,
    block: tuple[int, int],
) -> str | None:
    """The problem (one line, None if none) of a stored weight ``name`` whose logical shape
    is ``shape`` ``[..., N, K]``: its bytes' shape and its scale's."""
    N, K = shape[-2], shape[-1]
    lead = tuple(shape[:-2])
    if kind == "fp4":
        if K % 2:
            return f"tensor {name} is FP4 with an odd inner size {K}: two e2m1 values share a byte, so K must be even"
        want = lead + (N, K // 2)
    else:
        want = lead + (N, K)
    if tuple(data_shape) != want:
        what = "FP4 (two values a byte)" if kind == "fp4" else "FP8"
        return f"tensor {name} is {what} of shape {list(data_shape)} but the config needs {list(want)}"
    if scale_shape is None:
        return (
            f"scale of {name} is missing: an {kind.upper()} weight needs its block scales "
            "(<name>.weight_scale_inv or <name>.scale)"
        )
    want_s = lead + scale_grid(N, K, *block)
    if tuple(scale_shape) != want_s:
        return (
            f"scale of {name} has shape {list(scale_shape)} but a [{N}, {K}] {kind.upper()} weight in "
            f"{block[0]}x{block[1]} blocks needs {list(want_s)}"
        )
    return None


def quant_linear(
    x: torch.Tensor, qw: QuantWeight, bias: torch.Tensor | None = None, backend: str = "auto"
) -> torch.Tensor:
    """``x @ W^T (+ bias)`` for a stored weight (module docstring); ``backend``: ``auto``
    (the kernels on a CUDA device when the library serves the call, else the CPU path),
    ``kernels`` (or an EngramError naming why not) or ``torch`` (dequantize + F.linear)."""
    if backend not in QUANT_BACKENDS:
        raise EngramError(f"quant backend {backend!r} is not one of {list(QUANT_BACKENDS)}")
    if backend != "torch" and x.is_cuda:
        from engram_trt.native import quant as native_quant

        why = native_quant.unavailable_for(x, qw)
        if why is None:
            y = native_quant.linear(x, qw)
            return y if bias is None else y + bias.to(y.dtype)
        if backend == "kernels":
            raise EngramError(f"quantized linear backend 'kernels' cannot run: {why}; use 'auto' or 'torch'")
    elif backend == "kernels":
        raise EngramError(f"quantized linear backend 'kernels' needs a CUDA device (the activations are on {x.device})")
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    return F.linear(x, qw.dequantize(work).to(x.dtype), None if bias is None else bias.to(x.dtype))


class QuantLinear(nn.Module):
    """``nn.Linear`` over a stored FP8 / FP4 weight (module docstring). ``backend`` is a
    class default, settable per module."""

    backend: str = "auto"

    def __init__(
        self,
        in_features: int,
        out_features: int,
        kind: str,
        block: tuple[int, int],
        scale_fmt: str = "float",
        bias: bool = False,
        device: Any = None,
    ) -> None:
        super().__init__()
        if kind not in KINDS:
            raise EngramError(f"QuantLinear kind {kind!r} is not one of {list(KINDS)}")
        if kind == "fp4" and in_features % 2:
            raise EngramError(f"an FP4 weight needs an even in_features (got {in_features})")
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.kind, self.block = kind, (int(block[0]), int(block[1]))
        data_shape = (out_features, in_features // 2) if kind == "fp4" else (out_features, in_features)
        data_dtype = torch.int8 if kind == "fp4" else torch.float8_e4m3fn
        scale_dtype = torch.float8_e8m0fnu if scale_fmt == "ue8m0" else torch.float32
        self.register_buffer("weight", torch.empty(data_shape, dtype=data_dtype, device=device))
        self.register_buffer(
            "weight_scale_inv",
            torch.empty(scale_grid(out_features, in_features, *self.block), dtype=scale_dtype, device=device),
        )
        self.bias = nn.Parameter(torch.empty(out_features, device=device), requires_grad=False) if bias else None

    @classmethod
    def like(cls, linear: nn.Linear, kind: str, block: tuple[int, int], scale_fmt: str) -> "QuantLinear":
        """A QuantLinear of ``linear``'s shape (built on ``linear``'s device, e.g. meta)."""
        return cls(
            linear.in_features,
            linear.out_features,
            kind,
            block,
            scale_fmt,
            bias=linear.bias is not None,
            device=linear.weight.device,
        )

    @property
    def qweight(self) -> QuantWeight:
        return QuantWeight(self.weight, self.weight_scale_inv, self.kind, self.block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quant_linear(x, self.qweight, self.bias, self.backend)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, {self.kind}, "
            f"block={self.block[0]}x{self.block[1]}, scales={self.qweight.scale_fmt}"
        )


def linear_weight(module: nn.Module) -> torch.Tensor | QuantWeight:
    """The weight of an ``nn.Linear`` or a :class:`QuantLinear` (code that reads weights
    directly, such as the ONNX export and fused projections, asks here)."""
    if isinstance(module, QuantLinear):
        return module.qweight
    return module.weight


__all__ = [
    "ACT_QUANT",
    "KINDS",
    "QUANT_BACKENDS",
    "QuantLinear",
    "QuantWeight",
    "check_quant_tensors",
    "linear_weight",
    "quant_linear",
]
