"""Qwen4Exp's two RMSNorms, shared by every module of the family.

* :class:`OffsetRMSNorm` scales by ``1 + weight`` (a zero weight is the identity; the
  checkpoint stores the offset), in float32, optionally per group of ``group_size``
  features: the hyper-connection and PLE norms normalize each of the ``hc_count``
  streams on its own while their weight spans all of them.
* :class:`GatedRMSNorm` (the linear attention's output norm) scales by ``weight`` and
  multiplies by an activation of the gate; like the published model it rounds the
  normalized value to the input dtype before the weight.
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
        return offset_rms_norm(x, self.weight, self.eps, self.group_size)


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
