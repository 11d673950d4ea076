"""The RoPE frequencies and cos/sin tables of a :class:`~engram_trt.config.rope.RopeSetting`,
as transformers 5.25's ``modeling_rope_utils`` and ``LlamaRotaryEmbedding`` compute them,
operation for operation in float32 (bit for bit on a CPU). The semantics of each type
(dynamic's state, longrope's switch, yarn's attention factor) are in
:mod:`engram_trt.config.rope`."""

from __future__ import annotations

import math
from typing import Any

import torch

from engram_trt.config.rope import SUPPORTED_ROPE_TYPES, RopeSetting


def _exponents(dim: int) -> torch.Tensor:
    """``[0, 2, 4, ...] / dim`` in float32: the exponent of theta for each rotated pair."""
    return torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim


def _plain(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** _exponents(dim))


def _yarn(s: RopeSetting, dim: int) -> torch.Tensor:
    base, factor = s.theta, s.factor
    orig = s.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: keeps the ramp finite
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: extrapolate (high frequencies, kept), 0: interpolate (divided by factor)
    pos_freqs = base ** _exponents(dim)
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def _llama3(s: RopeSetting, dim: int) -> torch.Tensor:
    inv = _plain(s.theta, dim)
    factor, low, high = s.factor, s.low_freq_factor, s.high_freq_factor
    orig = s.original_max_position_embeddings
    low_wavelen, high_wavelen = orig / low, orig / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (orig / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _longrope(s: RopeSetting, dim: int, long: bool) -> torch.Tensor:
    ext = torch.tensor(s.long_factor if long else s.short_factor, dtype=torch.float32)
    return 1.0 / (ext * s.theta ** _exponents(dim))


def _dynamic(s: RopeSetting, dim: int, seq_len: int) -> torch.Tensor:
    # transformers computes the new base in float32 tensors from seq_len = max(position_ids) + 1
    n = torch.maximum(
        torch.tensor(seq_len, dtype=torch.int64), torch.tensor(s.max_position_embeddings, dtype=torch.int64)
    )
    base = s.theta * ((s.factor * n / s.max_position_embeddings) - (s.factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base ** _exponents(dim))


def inv_freq_and_scale(
    setting: RopeSetting,
    head_dim: int,
    device: Any = None,
    dtype: torch.dtype = torch.float32,
    *,
    seq_len: int | None = None,
) -> tuple[torch.Tensor, float]:
    """``(inv_freq [rotary_dim / 2], attention_scaling)`` as transformers computes them.

    ``seq_len=None``: the values a transformers rotary embedding holds after init (for
    ``dynamic`` plain RoPE's, for ``longrope`` the short factors). ``seq_len=n``: the
    values a freshly built one uses for a call whose largest position is ``n - 1``
    (``dynamic`` scaled once ``n > max_position_embeddings``, ``longrope`` long factors
    once ``n > original_max_position_embeddings``; other types do not depend on it).
    Computed in float32 on the CPU, then moved to ``device`` and cast to ``dtype``."""
    dim = setting.rotary_dim(head_dim)
    if setting.short_factor is not None and len(setting.short_factor) != dim // 2:
        raise ValueError(
            f"this setting's longrope factors are for a rotary width of {2 * len(setting.short_factor)}, "
            f"not {dim} (head_dim={head_dim})"
        )
    t = setting.rope_type
    if t == "default":
        inv = _plain(setting.theta, dim)
    elif t == "linear":
        inv = _plain(setting.theta, dim) / setting.factor
    elif t == "dynamic":
        big = seq_len is not None and seq_len > setting.max_position_embeddings
        inv = _dynamic(setting, dim, seq_len) if big else _plain(setting.theta, dim)
    elif t == "yarn":
        inv = _yarn(setting, dim)
    elif t == "llama3":
        inv = _llama3(setting, dim)
    elif t == "longrope":
        inv = _longrope(setting, dim, seq_len is not None and seq_len > setting.original_max_position_embeddings)
    else:
        raise ValueError(f"rope_type {t!r} is not one of {SUPPORTED_ROPE_TYPES}")
    return inv.to(device=device, dtype=dtype), float(setting.attention_factor)


def dynamic_inv_freq(setting: RopeSetting, head_dim: int, seq_len: int) -> torch.Tensor:
    """The inverse frequencies transformers' dynamic-NTK rotary embedding uses once a
    call's ``max(position_ids) + 1`` is ``seq_len`` (on a fresh module, or one whose
    longest call since its last reset was this one); plain RoPE's for ``seq_len <=
    max_position_embeddings``. See the module docstring for when transformers keeps or
    resets them."""
    if setting.rope_type != "dynamic":
        raise ValueError(f"dynamic_inv_freq is for rope_type 'dynamic' (this setting is {setting.rope_type!r})")
    return inv_freq_and_scale(setting, head_dim, seq_len=seq_len)[0]


def cos_sin(
    setting: RopeSetting, head_dim: int, positions: torch.Tensor, *, seq_len: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of shape ``positions.shape + (rotary_dim,)``, float32, on
    ``positions.device``, as transformers' ``LlamaRotaryEmbedding.forward`` returns them:
    the two halves repeat the per-pair angles (``rotate_half`` layout) and both are
    multiplied by the attention scaling. ``rotary_dim == head_dim`` unless the setting
    rotates part of the head.

    For the length-dependent types the frequencies follow from ``seq_len``, by default
    ``max(positions) + 1`` (what a fresh transformers module does for this call); pass
    it to build a table for a sequence longer than the positions given."""
    if seq_len is None and setting.length_dependent and positions.numel():
        seq_len = int(positions.max()) + 1
    inv, scale = inv_freq_and_scale(setting, head_dim, seq_len=seq_len)
    freqs = positions[..., None].float() * inv.to(positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scale, emb.sin() * scale
