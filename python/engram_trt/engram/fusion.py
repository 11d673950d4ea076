"""The Engram fusion: project the gathered rows and gate them into each stream.

``kv = wkv(e)`` holds one key per hyper-connection stream and one shared value.
Each stream ``c`` scores its hidden state against its own key (RMS-normalized dot
product with learned ``q_weight[c] * k_weight[c]``), and the gate
``sigmoid(sign(dot) * sqrt(|dot|))`` scales the shared value into that stream's
residual. The square root compresses large scores so one confident lookup cannot
saturate the gate; the clamp keeps its derivative finite at 0. Dead (masked)
tokens take no memory at all: their gate is forced to 0.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engram_trt.errors import EngramError

GATE_CLAMP = 1e-6


def _check(
    hidden_shape: tuple[int, ...],
    kv_shape: tuple[int, ...],
    qw_shape: tuple[int, ...],
    kw_shape: tuple[int, ...],
    mask_shape: tuple[int, ...] | None,
) -> tuple[int, int, int]:
    if len(hidden_shape) != 3:
        raise EngramError(f"hidden must be [T, hc_mult, D] (got {hidden_shape})")
    T, hc, D = hidden_shape
    if tuple(kv_shape) != (T, (hc + 1) * D):
        raise EngramError(f"kv must be [T, (hc_mult+1)*D] = {(T, (hc + 1) * D)} (got {tuple(kv_shape)})")
    for name, shp in (("q_weight", qw_shape), ("k_weight", kw_shape)):
        if tuple(shp) != (hc, D):
            raise EngramError(f"{name} must be [hc_mult, D] = {(hc, D)} (got {tuple(shp)})")
    if mask_shape is not None and tuple(mask_shape) != (T,):
        raise EngramError(f"token_mask must be [T] = {(T,)} (got {tuple(mask_shape)})")
    return T, hc, D


def engram_gate_reference(
    hidden: Any,
    kv: Any,
    q_weight: Any,
    k_weight: Any,
    token_mask: Any = None,
    eps: float = 1e-6,
    clamp: float = GATE_CLAMP,
) -> np.ndarray:
    """Float64 NumPy oracle of the gated update; returns ``[T, hc, D]`` float64."""
    h = np.asarray(hidden, dtype=np.float64)
    kv = np.asarray(kv, dtype=np.float64)
    qw = np.asarray(q_weight, dtype=np.float64)
    kw = np.asarray(k_weight, dtype=np.float64)
    T, hc, D = _check(h.shape, kv.shape, qw.shape, kw.shape, None if token_mask is None else np.shape(token_mask))
    keys = kv[:, : hc * D].reshape(T, hc, D)
    value = kv[:, hc * D :]
    dot = (h * qw[None] * kw[None] * keys).sum(-1)
    dot = dot / np.sqrt((h * h).mean(-1) + eps) / np.sqrt((keys * keys).mean(-1) + eps) / np.sqrt(D)
    gate = 1.0 / (1.0 + np.exp(-np.sign(dot) * np.sqrt(np.maximum(np.abs(dot), clamp))))
    if token_mask is not None:
        gate = np.where(np.asarray(token_mask, dtype=bool)[:, None], gate, 0.0)
    return h + gate[..., None] * value[:, None, :]


def engram_gate(
    hidden: Any,
    kv: Any,
    q_weight: Any,
    k_weight: Any,
    token_mask: Any = None,
    eps: float = 1e-6,
    clamp: float = GATE_CLAMP,
) -> Any:
    """Torch version (float32 math, output in ``hidden``'s dtype): the CPU backend's path."""
    import torch

    T, hc, D = _check(
        tuple(hidden.shape),
        tuple(kv.shape),
        tuple(q_weight.shape),
        tuple(k_weight.shape),
        None if token_mask is None else tuple(token_mask.shape),
    )
    h = hidden.float()
    kvf = kv.float()
    keys = kvf[:, : hc * D].reshape(T, hc, D)
    value = kvf[:, hc * D :]
    dot = (h * (q_weight.float() * k_weight.float())[None] * keys).sum(-1)
    dot = dot * torch.rsqrt(h.pow(2).mean(-1) + eps) * torch.rsqrt(keys.pow(2).mean(-1) + eps) / (D**0.5)
    gate = torch.sigmoid(torch.sign(dot) * torch.sqrt(dot.abs().clamp_min(clamp)))
    if token_mask is not None:
        gate = gate * token_mask.to(device=gate.device, dtype=torch.bool)[:, None].to(gate.dtype)
    return (h + gate[..., None] * value[:, None, :]).to(hidden.dtype)
