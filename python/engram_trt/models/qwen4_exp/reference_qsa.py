"""Float64 NumPy reference of the EngramQsaAttention plugin op (plugins/engramQsaAttentionPlugin
states the same contract): Qwen4Exp's gated full attention's core with the QSA block indexer,
over a packed step whose tokens write into per-slot caches in place.

It is what the ONNX ReferenceEvaluator runs for that node (reference_ops.py)
and the independent side of the kernel tests: the per-query definition written out
plainly (no batching of queries, no padded top-k), in float64, with the few roundings to
the activation dtype that the torch layer (models/qwen4_exp/attention.GatedAttention)
and the kernel both make, so a bf16 kernel is compared against the same arithmetic and
not against an unrounded ideal:

* a block's pooled key is the mean of its raw keys rounded to the activation dtype,
  its offset RMSNorm rounded again, its partial RoPE rounded again;
* the softmax probabilities are rounded to the activation dtype before the V product.

The activation dtype is q's (float16, float32, ml_dtypes bfloat16; float64 input means
no rounding at all). Selection ties (two blocks with the same score: relu scores tie at
0 whenever no indexer head points toward a block) go to the LOWER block index; torch's
CPU top-k has no such rule, so tests against the torch layer use inputs without a tie
at the top-k boundary.

A token whose slot is outside ``[0, num_slots)`` or whose position is outside
``[0, max_len)`` writes nothing and gets a zero output row (the kernel's convention).
Each (slot, position) should be written by at most one token of a step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from engram_trt.errors import EngramError

_OP = "EngramQsaAttention"


@dataclass(frozen=True)
class QsaFields:
    """The op's scalar fields (the plugin's field names), checked once."""

    compress_ratio: int
    block_topk: int
    rot_dim: int
    rope_theta: float
    eps: float
    scaling: float

    def check(self, head_dim: int, index_dim: int) -> None:
        """One-line errors for fields the op cannot run with."""
        if self.compress_ratio < 1:
            raise EngramError(f"{_OP}: compress_ratio {self.compress_ratio} must be >= 1")
        if self.block_topk < 1:
            raise EngramError(f"{_OP}: block_topk {self.block_topk} must be >= 1 (indexer_budget // compress_ratio)")
        if self.rot_dim < 0 or self.rot_dim % 2 or self.rot_dim > index_dim or self.rot_dim > head_dim:
            raise EngramError(
                f"{_OP}: rot_dim {self.rot_dim} must be even and at most head_dim {head_dim} "
                f"and the indexer head dim {index_dim}"
            )
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise EngramError(f"{_OP}: rope_theta {self.rope_theta} must be a positive finite number")
        if not (self.eps >= 0 and math.isfinite(self.eps)):
            raise EngramError(f"{_OP}: eps {self.eps} must be a finite number >= 0")
        if not (self.scaling > 0 and math.isfinite(self.scaling)):
            raise EngramError(f"{_OP}: scaling {self.scaling} must be a positive finite number (head_dim ** -0.5)")


def _act_dtype(x: Any) -> np.dtype | None:
    """The dtype the op rounds to (None: float64, no rounding)."""
    if hasattr(x, "detach"):  # a torch tensor, without importing torch here
        name = str(x.dtype).replace("torch.", "")
        if name == "bfloat16":
            import ml_dtypes

            return np.dtype(ml_dtypes.bfloat16)
        dt = np.dtype(name)
    else:
        dt = np.asarray(x).dtype
    return None if dt == np.float64 else dt


def _array(x: Any) -> np.ndarray:
    """A NumPy copy in its own dtype (torch tensors included, bf16 as ml_dtypes)."""
    if hasattr(x, "detach"):
        t = x.detach().to("cpu")
        if str(t.dtype) == "torch.bfloat16":
            import ml_dtypes

            return t.float().numpy().astype(ml_dtypes.bfloat16)
        return t.numpy().copy()
    return np.array(x)


def _round(x: np.ndarray, act: np.dtype | None) -> np.ndarray:
    """``x`` rounded to the activation dtype, back in float64."""
    return x if act is None else x.astype(act).astype(np.float64)


def rope_table(positions: np.ndarray, rot_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos / sin ``[n, rot_dim]`` of rotate-half RoPE at ``positions`` (each frequency
    written twice), as models/qwen4_exp/attention.rope_cos_sin, in float64."""
    inv_freq = 1.0 / (theta ** (np.arange(0, rot_dim, 2, dtype=np.float64) / rot_dim))
    ang = np.asarray(positions, dtype=np.float64).reshape(-1, 1) * inv_freq
    emb = np.concatenate([ang, ang], axis=-1)
    return np.cos(emb), np.sin(emb)


def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Partial rotate-half RoPE of ``x [n, d]``: the first ``cos.shape[-1]`` features
    rotated, the rest passed through."""
    rot = cos.shape[-1]
    half = rot // 2
    xr = x[:, :rot]
    turned = np.concatenate([-xr[:, half:], xr[:, :half]], axis=-1)
    return np.concatenate([xr * cos + turned * sin, x[:, rot:]], axis=-1)


def block_keys(raw: np.ndarray, norm_weight: np.ndarray, fields: QsaFields, act: np.dtype | None) -> np.ndarray:
    """Pooled key ``[n_blocks, di]`` of every complete block of ``raw [L, di]``: mean
    (rounded), offset RMSNorm with scale ``1 + w`` (rounded), RoPE at the block's first
    position (rounded)."""
    r = fields.compress_ratio
    nb = raw.shape[0] // r
    di = raw.shape[1]
    pooled = _round(raw[: nb * r].reshape(nb, r, di).mean(axis=1), act)
    normed = pooled / np.sqrt((pooled * pooled).mean(axis=-1, keepdims=True) + fields.eps)
    normed = _round(normed * (1.0 + norm_weight), act)
    cos, sin = rope_table(np.arange(nb) * r, fields.rot_dim, fields.rope_theta)
    return _round(rotate(normed, cos, sin), act)


def block_scores(index_q: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """``[n_blocks]``: sum over indexer heads of relu(q_h . key_b) / sqrt(di)."""
    return np.maximum(index_q @ keys.T, 0.0).sum(axis=0) / math.sqrt(index_q.shape[-1])


def select_blocks(scores: np.ndarray, block_topk: int) -> np.ndarray:
    """Bool ``[n_blocks]``: every block when they fit the budget, else the ``block_topk``
    best scored, equal scores going to the lower block index."""
    nb = scores.shape[0]
    keep = np.ones(nb, dtype=bool)
    if nb > block_topk:
        order = np.lexsort((np.arange(nb), -scores))  # by score descending, then index ascending
        keep[:] = False
        keep[order[:block_topk]] = True
    return keep


def visible_positions(
    pos: int, raw: np.ndarray, index_q: np.ndarray, norm_weight: np.ndarray, fields: QsaFields, act: np.dtype | None
) -> np.ndarray:
    """Bool ``[pos + 1]``: which of positions ``0..pos`` of its slot a query at ``pos``
    attends (its slot's raw keys ``raw [>= pos + 1, di]``, its indexer heads
    ``index_q [NI, di]``): the kept complete blocks plus the tail after them."""
    r = fields.compress_ratio
    nb = (pos + 1) // r
    mask = np.ones(pos + 1, dtype=bool)
    if nb > fields.block_topk:
        keys = block_keys(raw[: pos + 1], norm_weight, fields, act)
        keep = select_blocks(block_scores(index_q, keys), fields.block_topk)
        mask[: nb * r] = np.repeat(keep, r)
    return mask


def qsa_attention_reference(
    q: Any,
    k: Any,
    v: Any,
    index_q: Any,
    index_raw: Any,
    key_cache: Any,
    value_cache: Any,
    index_key_cache: Any,
    index_k_norm_weight: Any,
    token_slot: Any,
    token_pos: Any,
    *,
    compress_ratio: int,
    block_topk: int,
    rot_dim: int,
    rope_theta: float,
    eps: float,
    scaling: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """EngramQsaAttention over one packed step.

    ``q [T, H, hd]``, ``k / v [T, KVH, hd]``, ``index_q [T, NI, di]`` (normed and rotated
    by the graph), ``index_raw [T, di]``; caches ``key_cache / value_cache [num_slots, KVH,
    max_len, hd]`` and ``index_key_cache [num_slots, max_len, di]``; ``index_k_norm_weight
    [di]`` (the offset); ``token_slot / token_pos [T]``. Every token's k, v, index_raw is
    first stored at ``(token_slot, token_pos)`` (in the caches' dtype), then token t
    attends positions ``0..token_pos[t]`` of its slot restricted to
    :func:`visible_positions`; query head h reads KV head ``h // (H / KVH)``; scores
    ``q . K * scaling``. Returns ``(out [T, H * hd] float64, key_cache, value_cache,
    index_key_cache)``, the caches new arrays in their own dtype.
    """
    act = _act_dtype(q)
    qa = _array(q).astype(np.float64)
    ka, va = _array(k), _array(v)
    iq = _array(index_q).astype(np.float64)
    ir = _array(index_raw)
    kc, vc, ikc = _array(key_cache), _array(value_cache), _array(index_key_cache)
    w = _array(index_k_norm_weight).astype(np.float64).reshape(-1)
    slots = np.asarray(_array(token_slot), dtype=np.int64).reshape(-1)
    pos = np.asarray(_array(token_pos), dtype=np.int64).reshape(-1)

    if qa.ndim != 3:
        raise EngramError(f"{_OP}: q has shape {qa.shape}; pass [tokens, heads, head_dim]")
    T, H, hd = qa.shape
    if kc.ndim != 4 or kc.shape[3] != hd:
        raise EngramError(f"{_OP}: key_cache has shape {kc.shape}; pass [num_slots, kv_heads, max_len, {hd}]")
    num_slots, kvh, max_len, _ = kc.shape
    if vc.shape != kc.shape:
        raise EngramError(f"{_OP}: value_cache has shape {vc.shape}; it must equal key_cache's {kc.shape}")
    if kvh < 1 or H % kvh:
        raise EngramError(f"{_OP}: {H} query heads are not a multiple of {kvh} key heads")
    if ka.shape != (T, kvh, hd) or va.shape != (T, kvh, hd):
        raise EngramError(f"{_OP}: k {ka.shape} / v {va.shape} must both be [{T}, {kvh}, {hd}]")
    if iq.ndim != 3 or iq.shape[0] != T:
        raise EngramError(f"{_OP}: index_q has shape {iq.shape}; pass [{T}, indexer_heads, indexer_head_dim]")
    di = iq.shape[2]
    if ir.shape != (T, di):
        raise EngramError(f"{_OP}: index_raw has shape {ir.shape}; pass [{T}, {di}]")
    if ikc.shape != (num_slots, max_len, di):
        raise EngramError(f"{_OP}: index_key_cache has shape {ikc.shape}; pass [{num_slots}, {max_len}, {di}]")
    if w.shape != (di,):
        raise EngramError(f"{_OP}: index_k_norm_weight has {w.size} entries; pass [{di}]")
    if slots.shape != (T,) or pos.shape != (T,):
        raise EngramError(f"{_OP}: token_slot {slots.shape} / token_pos {pos.shape} must both be [{T}]")
    fields = QsaFields(
        int(compress_ratio), int(block_topk), int(rot_dim), float(rope_theta), float(eps), float(scaling)
    )
    fields.check(hd, di)

    valid = (slots >= 0) & (slots < num_slots) & (pos >= 0) & (pos < max_len)
    live = np.nonzero(valid)[0]
    kc[slots[live], :, pos[live]] = ka[live].astype(kc.dtype)
    vc[slots[live], :, pos[live]] = va[live].astype(vc.dtype)
    ikc[slots[live], pos[live]] = ir[live].astype(ikc.dtype)

    group = H // kvh
    out = np.zeros((T, H, hd), dtype=np.float64)
    for t in live:
        s, p = int(slots[t]), int(pos[t])
        raw = ikc[s, : p + 1].astype(np.float64)
        mask = visible_positions(p, raw, iq[t], w, fields, act)
        keys = kc[s, :, : p + 1].astype(np.float64)  # [kvh, p+1, hd]
        values = vc[s, :, : p + 1].astype(np.float64)
        qt = qa[t].reshape(kvh, group, hd)
        scores = np.einsum("kgd,kpd->kgp", qt, keys) * fields.scaling
        scores = np.where(mask, scores, -np.inf)
        scores -= scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs = _round(probs / probs.sum(axis=-1, keepdims=True), act)
        out[t] = np.einsum("kgp,kpd->kgd", probs, values).reshape(H, hd)
    return out.reshape(T, H * hd), kc, vc, ikc
