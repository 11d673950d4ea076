"""DeepSeek-V4's building blocks below the attention layer: its two RMSNorms, its
interleaved partial RoPE, and the KV compressors with their per-slot streaming state.

RoPE (transformers 5.25's ``DeepseekV4RotaryEmbedding`` + ``apply_rotary_pos_emb``):
the last ``rope_dim = int(head_dim * partial_rotary_factor)`` channels of a vector are
rotated in *interleaved* pairs ``(2i, 2i + 1)``; the leading channels pass. Two tables
exist: ``main`` (``rope_theta``, plain) for ``sliding_attention`` layers and ``compress``
(``compress_rope_theta``, YaRN in the real checkpoints) for CSA / HCA layers, which use it
for *everything* (queries, window keys, compressed entries, indexer). The indexer
rotates with the same ``rope_dim`` (it is derived from ``head_dim``, not
``index_head_dim``). cos / sin are rounded to the compute dtype, the rotation runs in
float32, as the reference does. (Everywhere "float32" means at least float32: a float64
layer computes in float64, which the tests' float64 oracle relies on.)

A compressor (``self_attn.compressor`` / ``self_attn.compressor.indexer``) turns every
complete window of ``rate`` source tokens into one entry: per channel, a softmax over
the window's tokens of ``gate_proj(x) + position_bias`` weights ``kv_proj(x)``; the sum
passes a weighted RMSNorm and is rotated at the window's first position ``w * rate``.
The overlapping kind (CSA, both its compressor and its indexer) projects twice the
width: channels ``[:d]`` ("Ca") of window ``w - 1`` and ``[d:]`` ("Cb") of window ``w``
join one softmax over ``2 * rate`` slots, so each entry sees ``2 * rate`` tokens with
stride ``rate``; window 0 has no predecessor (its Ca slots weigh 0).

Per slot the state is the emitted entries ``[max_len // rate, d]`` and a ring of the
last ``R`` tokens' raw projections (``R = rate``, or ``2 * rate`` with overlap: the
incomplete window plus, for Ca, the last complete one), indexed by ``position % R``.
That is exactly what transformers' cache carries across calls (its buffer, overlap
and running entries), so chunked prefill and decode equal one whole forward (up to
how the indexer's top-k breaks exact ties, see :meth:`LightningIndexer.select`).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engram_trt.config.rope import RopeSetting, parse_rope
from engram_trt.errors import ConfigError
from engram_trt.models.rope import inv_freq_and_scale

LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
CSA, HCA = LAYER_TYPES[1], LAYER_TYPES[2]
RopeFn = Callable[[Tensor], tuple[Tensor, Tensor]]


# ---- norms ----------------------------------------------------------------------


def wide(t: Tensor) -> Tensor:
    """``t`` in float32, or in its own dtype when that is wider (float64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


class RMSNorm(nn.Module):
    """Weighted RMSNorm (``DeepseekV4RMSNorm``): float32 math, ``weight * x_normed``,
    back to the input dtype. The published model keeps these weights in float32."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        xf = wide(x)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf).to(x.dtype)


def unweighted_rms_norm(x: Tensor, eps: float) -> Tensor:
    """``DeepseekV4UnweightedRMSNorm`` (the per-head query norm): the reciprocal RMS is
    taken in float32 and rounded to x's dtype before the product, as published."""
    return x * torch.rsqrt(wide(x).square().mean(-1, keepdim=True) + eps).to(x.dtype)


# ---- RoPE -----------------------------------------------------------------------


def rope_label(layer_type: str) -> str:
    """Which of the config's two RoPE settings a layer type uses."""
    return "main" if layer_type == "sliding_attention" else "compress"


def _rope_params(config: Any, label: str) -> Mapping[str, Any]:
    """The RoPE dict of ``label`` (``main`` / ``compress``): transformers' nested
    ``rope_parameters`` when present, else built from the flat fields the way
    ``DeepseekV4Config.__post_init__`` builds it (YaRN only on ``compress``, with its
    attention factor pinned to 1 unless given)."""
    rp = config.rope_parameters or {}
    if not isinstance(rp, Mapping):
        rp = dict(rp)
    if isinstance(rp.get(label), Mapping):
        return rp[label]
    prf = config.partial_rotary_factor
    if prf is None:
        raise ConfigError("partial_rotary_factor is missing; set it (qk_rope_head_dim / head_dim, 0.125 for V4)")
    if label == "main":
        theta = config.rope_theta
        return {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": prf}
    d = {k: v for k, v in rp.items() if k not in ("main", "compress")}
    d.update(rope_theta=config.compress_rope_theta, partial_rotary_factor=prf)
    d.setdefault("rope_type", d.pop("type", "default"))
    if d["rope_type"] == "yarn":
        d.setdefault("attention_factor", 1.0)
    return d


def rope_setting(config: Any, layer_type: str) -> RopeSetting:
    """The resolved :class:`RopeSetting` a layer of ``layer_type`` rotates with."""
    label = rope_label(layer_type)
    return parse_rope(
        {"rope_parameters": dict(_rope_params(config, label))},
        source=f"rope_parameters.{label}",
        max_position_embeddings=int(config.max_position_embeddings),
        head_dim=int(config.head_dim),
        partial_rotary=True,
    )


class RopeTable:
    """A layer type's inverse frequencies (float32, CPU) and attention scaling, computed
    once; :meth:`__call__` gives the per-pair ``(cos, sin)`` ``[n, rope_dim // 2]``."""

    def __init__(self, config: Any, layer_type: str) -> None:
        setting = rope_setting(config, layer_type)
        if setting.length_dependent:
            raise ConfigError(
                f"rope_parameters.{rope_label(layer_type)}.rope_type {setting.rope_type!r} depends on "
                "the sequence length; DeepSeek-V4 serves default or yarn RoPE"
            )
        self.rope_dim = setting.rotary_dim(int(config.head_dim))
        self.inv_freq, self.scale = inv_freq_and_scale(setting, int(config.head_dim))
        self._device_freq: dict[Any, Tensor] = {}

    def inv_freq_on(self, device: Any) -> Tensor:
        """The float32 inverse frequencies on ``device``, copied there once (the CUDA
        attention kernel takes them as an input)."""
        device = torch.device(device)
        inv = self._device_freq.get(device)
        if inv is None:
            inv = self._device_freq[device] = self.inv_freq.to(device)
        return inv

    def __call__(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        freqs = positions.reshape(-1, 1).float() * self.inv_freq_on(positions.device)
        return freqs.cos() * self.scale, freqs.sin() * self.scale


def rope_tables(config: Any, positions: Tensor, layer_type: str) -> tuple[Tensor, Tensor]:
    """``(cos, sin)`` ``[n, rope_dim // 2]`` float32 (one angle per interleaved pair,
    times the RoPE's attention scaling) of the table a ``layer_type`` layer uses."""
    return RopeTable(config, layer_type)(positions)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the trailing ``2 * cos.shape[-1]`` channels of ``x`` in interleaved pairs;
    cos / sin broadcast against ``x[..., :half]`` (``[n, 1, half]`` for ``x [n, h, d]``).
    Pass ``-sin`` for the inverse rotation."""
    half = cos.shape[-1]
    c, s = wide(cos.to(x.dtype)), wide(sin.to(x.dtype))
    rope = wide(x[..., x.shape[-1] - 2 * half :])
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat((x[..., : x.shape[-1] - 2 * half], rotated), dim=-1)


# ---- compressors ----------------------------------------------------------------


def compress_rate(config: Any, layer_type: str) -> int:
    rates = config.compress_rates or {}
    rate = rates.get(layer_type) if isinstance(rates, Mapping) else None
    if not isinstance(rate, int) or isinstance(rate, bool) or rate < 1:
        raise ConfigError(f"compress_rates[{layer_type!r}] is {rate!r}; a {layer_type} layer needs a positive integer")
    return rate


class PooledCompressor(nn.Module):
    """One compressor's weights and its streaming update (see the module docstring)."""

    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, eps: float) -> None:
        super().__init__()
        width = 2 * dim if overlap else dim
        self.dim, self.rate, self.overlap = dim, rate, overlap
        self.ring = 2 * rate if overlap else rate
        self.kv_proj = nn.Linear(hidden, width, bias=False)
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(rate, width))
        self.kv_norm = RMSNorm(dim, eps)

    def state_shapes(self, max_len: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(entries, ring)`` shapes per slot: ``(max_len // rate, dim)``, ``(R, width)``."""
        return (max_len // self.rate, self.dim), (self.ring, self.kv_proj.out_features)

    def pool(self, kv: Tensor, gate: Tensor, first: int, rope: RopeFn) -> Tensor:
        """Entries ``[nw, dim]`` of windows ``first..`` from their tokens' projections.

        ``kv`` / ``gate`` hold the tokens of positions ``start..`` up to the end of the
        last window, with ``start = (first - 1) * rate`` for the overlapping kind when
        ``first >= 1`` (the predecessor block supplies Ca) and ``first * rate`` otherwise."""
        r, d = self.rate, self.dim
        lead = 1 if self.overlap and first >= 1 else 0
        blocks_kv = kv.reshape(-1, r, kv.shape[-1])
        blocks_gate = gate.reshape(-1, r, gate.shape[-1]) + self.position_bias  # bias by place in the window
        nw = blocks_kv.shape[0] - lead
        cur_kv, cur_gate = blocks_kv[lead:], blocks_gate[lead:]
        if self.overlap:
            # window j's Ca slots come from block j - 1; window 0 of a sequence has none (weight 0)
            prev_kv = cur_kv.new_zeros(nw, r, d)
            prev_gate = cur_gate.new_full((nw, r, d), float("-inf"))
            skip = 1 - lead
            prev_kv[skip:] = blocks_kv[: nw - skip, :, :d]
            prev_gate[skip:] = blocks_gate[: nw - skip, :, :d]
            win_kv = torch.cat((prev_kv, cur_kv[..., d:]), dim=1)
            win_gate = torch.cat((prev_gate, cur_gate[..., d:]), dim=1)
        else:
            win_kv, win_gate = cur_kv, cur_gate
        weights = F.softmax(wide(win_gate), dim=1).to(win_kv.dtype)
        pooled = self.kv_norm((win_kv * weights).sum(dim=1))
        cos, sin = rope(torch.arange(first, first + nw, device=kv.device) * r)
        return apply_rope(pooled, cos, sin)

    def update(
        self,
        kv_new: Tensor,
        gate_new: Tensor,
        past: int,
        entries: Tensor,
        ring_kv: Tensor,
        ring_gate: Tensor,
        rope: RopeFn,
    ) -> int:
        """Stream one sequence's ``n`` new tokens (positions ``past..``) through: emit
        the windows they complete into ``entries`` (one slot's view, in place), store
        their projections in the ring, and return the entry count after the call."""
        r, big_r = self.rate, self.ring
        n = kv_new.shape[0]
        end = past + n
        n_old, n_tot = past // r, end // r
        if n_tot > n_old:
            lead = 1 if self.overlap and n_old >= 1 else 0
            start = (n_old - lead) * r
            ring_pos = torch.arange(start, past, device=kv_new.device) % big_r
            src_kv = torch.cat((ring_kv[ring_pos].to(kv_new.dtype), kv_new))[: n_tot * r - start]
            src_gate = torch.cat((ring_gate[ring_pos].to(gate_new.dtype), gate_new))[: n_tot * r - start]
            entries[n_old:n_tot] = self.pool(src_kv, src_gate, n_old, rope).to(entries.dtype)
        keep = min(n, big_r)
        slot_pos = torch.arange(end - keep, end, device=kv_new.device) % big_r
        ring_kv[slot_pos] = kv_new[n - keep :].to(ring_kv.dtype)
        ring_gate[slot_pos] = gate_new[n - keep :].to(ring_gate.dtype)
        return n_tot


class IndexerScorer(nn.Module):
    """``self_attn.compressor.indexer.scorer``: the per-head weights of the index score."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.weights_proj = nn.Linear(hidden, heads, bias=False)


class LightningIndexer(PooledCompressor):
    """CSA's lightning indexer (``self_attn.compressor.indexer``): an overlapping
    compressor at ``index_head_dim`` for the keys, queries ``q_b_proj(q_residual)``
    rotated at their positions, and the score ``sum_h w_h * relu(q_h . k) /
    sqrt(index_head_dim)`` with ``w = weights_proj(x) / sqrt(index_n_heads)``; each
    query keeps its top ``index_topk`` causally visible entries."""

    def __init__(self, config: Any, rate: int) -> None:
        super().__init__(config.hidden_size, config.index_head_dim, rate, True, config.rms_norm_eps)
        self.heads, self.topk = config.index_n_heads, config.index_topk
        self.q_b_proj = nn.Linear(config.q_lora_rank, self.heads * self.dim, bias=False)
        self.scorer = IndexerScorer(config.hidden_size, self.heads)
        # A tensor-parallel rank holds heads / tp of the heads (models.parallel): its
        # queries and weights are all-gathered, the weights scaled by the whole count.
        self.tp: Any = None
        self.score_heads = self.heads

    def queries(self, q_residual: Tensor, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """Rotated queries ``[T, heads, dim]`` and float32 head weights ``[T, heads]``
        (every head's: a tensor-parallel rank's gathered from the others)."""
        from engram_trt.models.parallel import gather_heads

        q = self.q_b_proj(q_residual).reshape(x.shape[0], self.heads, self.dim)
        weights = wide(self.scorer.weights_proj(x)) * self.score_heads**-0.5
        q = apply_rope(q, cos.unsqueeze(1), sin.unsqueeze(1))
        return gather_heads(q, self.tp, 1), gather_heads(weights, self.tp, 1)

    def select(self, q: Tensor, weights: Tensor, keys: Tensor, visible: Tensor) -> Tensor:
        """``[n, E]`` bool: the entries each query keeps. ``visible [n]`` is how many
        leading entries each query may see (``(pos + 1) // rate``); it keeps the
        ``index_topk`` best of them (all of them when it sees fewer). As published, the
        top-k runs over the row of all ``E`` entries with the unseen ones at -inf, and
        picks landing on unseen entries are dropped. Equal scores (common: ReLU scores
        an entry 0 when every head's q.k <= 0) are left to ``topk``, whose choice can
        depend on the row length, i.e. on how the sequence was chunked; transformers'
        cached decode and its full forward differ there the same way."""
        n, n_entries = q.shape[0], keys.shape[0]
        if n_entries == 0:
            return torch.zeros(n, 0, dtype=torch.bool, device=q.device)
        scores = torch.matmul(wide(q), wide(keys).t())  # [n, heads, E]
        scores = (F.relu(scores) * self.dim**-0.5 * weights.unsqueeze(-1)).sum(dim=1)
        index = torch.arange(n_entries, device=q.device)
        seen = index.unsqueeze(0) < visible.unsqueeze(1)
        picks = scores.masked_fill(~seen, float("-inf")).topk(min(self.topk, n_entries), dim=-1).indices
        keep = torch.zeros(n, n_entries, dtype=torch.bool, device=q.device)
        keep.scatter_(1, picks, True)
        return keep & seen


class CSACompressor(PooledCompressor):
    """``self_attn.compressor`` of a compressed_sparse_attention layer: an overlapping
    compressor at ``head_dim`` plus its :class:`LightningIndexer` (``indexer``: both
    layer compressors declare it, so the attention reads ``compressor.indexer`` directly)."""

    def __init__(self, config: Any, rate: int) -> None:
        super().__init__(config.hidden_size, config.head_dim, rate, True, config.rms_norm_eps)
        self.indexer: LightningIndexer | None = LightningIndexer(config, rate)


class HCACompressor(PooledCompressor):
    """``self_attn.compressor`` of a heavily_compressed_attention layer: windows of
    ``rate`` tokens without overlap; every visible entry is attended (``indexer`` None)."""

    def __init__(self, config: Any, rate: int) -> None:
        super().__init__(config.hidden_size, config.head_dim, rate, False, config.rms_norm_eps)
        self.indexer: LightningIndexer | None = None  # an instance attribute: no parameter, no state_dict entry


def check_rope_fits(config: Any, rope_dim: int, layer_type: str) -> None:
    """The rotated width must be even and fit every vector it rotates."""
    widths = {"head_dim": int(config.head_dim)}
    if layer_type == CSA:
        widths["index_head_dim"] = int(config.index_head_dim)
    if rope_dim < 2 or rope_dim % 2:
        raise ConfigError(
            f"head_dim {config.head_dim} x partial_rotary_factor gives {rope_dim} rotary channels; "
            "it must be even and at least 2"
        )
    for name, width in widths.items():
        if rope_dim > width:
            raise ConfigError(
                f"{name} {width} is smaller than the {rope_dim} rotary channels; raise {name} or "
                "lower partial_rotary_factor"
            )


__all__ = [
    "CSA",
    "HCA",
    "LAYER_TYPES",
    "CSACompressor",
    "HCACompressor",
    "LightningIndexer",
    "PooledCompressor",
    "RMSNorm",
    "RopeTable",
    "wide",
    "apply_rope",
    "check_rope_fits",
    "compress_rate",
    "rope_label",
    "rope_setting",
    "rope_tables",
    "unweighted_rms_norm",
]
