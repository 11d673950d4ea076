"""Qwen4Exp's two RMSNorms, shared by every module of the family.

* :class:`OffsetRMSNorm` scales by ``1 + weight`` (a zero weight is the identity; the
  checkpoint stores the offset), in float32, optionally per group of ``group_size``
  features: the hyper-connection and PLE norms normalize each of the ``hc_count``
  streams on its own while their weight spans all of them.
* :class:`GatedRMSNorm` (the linear attention's output norm) scales by ``weight`` and
  multiplies by an activation of the gate; like the published model it rounds the
  normalized value to the input dtype before the weight.

On a GPU of compute capability 9.0+, bf16 activations take :class:`OffsetRMSNorm` in one
launch (the kernel library's ``engram_norm_rope``, :mod:`engram_trt.native.decode`: the
same float32 products, ``(x * rsqrt(mean(x^2) + eps)) * (1 + w)`` rounded once, a weight
per group) where the PyTorch form takes about nine; ``1 + w`` is made once per weight.
A Gated DeltaNet decode step takes :class:`GatedRMSNorm` in one launch the same way
(:func:`.fused.gated_norm`, the kernel library's ``engram_gated_rms_norm_bf16``).
``ENGRAM_TRT_QWEN4_FUSED=0`` keeps the PyTorch form (an A/B switch for timing).
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

_ACTIVATIONS = {"silu": F.silu, "sigmoid": torch.sigmoid}


def offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int | None = None) -> torch.Tensor:
    xf = x.float()
    if group_size is not None:
        xf = xf.reshape(*xf.shape[:-1], -1, group_size)
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if group_size is not None:
        out = out.flatten(-2)
    return (out * (1.0 + weight.float())).to(x.dtype)


class OffsetRMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, group_size: int | None = None) -> None:
        super().__init__()
        if group_size is not None and size % group_size:
            raise ValueError(f"an RMSNorm over {size} features cannot be grouped by {group_size}")
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps
        self.group_size = group_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from engram_trt.models.qwen4_exp.fused import FUSED_ENV
        from engram_trt.native import decode

        if decode.glue_unavailable(x, FUSED_ENV, "Qwen4Exp fused norms") is None:  # bf16 on an sm_90+ GPU
            return self.forward_kernel(x)
        return offset_rms_norm(x, self.weight, self.eps, self.group_size)

    def forward_kernel(self, x: torch.Tensor) -> torch.Tensor:
        """The norm as one ``engram_norm_rope`` launch (module docstring)."""
        from engram_trt.native import decode

        size = self.weight.shape[0]
        key = (self.weight.data_ptr(), self.weight._version, x.device)
        cached = getattr(self, "_offset_weight", None)
        if cached is None or cached[0] != key:
            cached = (key, (1.0 + self.weight.float()).to(x.device).contiguous())
            self._offset_weight = cached
        group = self.group_size or size
        flat = x.reshape(-1, size)
        out = torch.empty_like(flat)
        decode.norm_rope(
            decode.NormRopeJob(
                flat,
                out,
                dim=group,
                heads=size // group,
                norm=decode.NORM_WEIGHTED,
                weight=cached[1],
                eps=self.eps,
                weight_stride=group if group < size else 0,
            )
        )
        return out.view(x.shape)


class GatedRMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, activation: str) -> None:
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(f"gate activation {activation!r} is not one of {sorted(_ACTIVATIONS)}")
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.activation = activation

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * xf.to(dtype)
        return (out * _ACTIVATIONS[self.activation](gate.float())).to(dtype)
