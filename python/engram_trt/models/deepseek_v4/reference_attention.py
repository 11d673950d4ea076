"""Float64 NumPy reference of the EngramDsv4Attention plugin op
(plugins/engramDsv4AttentionPlugin/README.md states the same contract): the core of
DeepSeek-V4's attention layer (sliding window, HCA compressor, CSA compressor with its
lightning indexer's top-k, sinks) over a packed step whose sequences stream into per-slot
state in place.

It is what the ONNX ReferenceEvaluator runs for that node and the independent side of
the kernel tests: each sequence's compressor windows and each query's key set written
out plainly in float64, with the roundings to the activation dtype that the torch layer
(models/deepseek_v4/attention.py, compressors.py) and the kernel both make, so a bf16
kernel meets the same arithmetic and not an unrounded ideal:

* a compressor's softmax weights are rounded, each ``weight * value`` product is
  rounded, their sum is rounded, the weighted RMSNorm is rounded, the RoPE'd entry is
  rounded (cos / sin of a float32 angle rounded first);
* the attention's probabilities are rounded before the value product, and the output.

The activation dtype is q's (float16, float32, ml_dtypes bfloat16; float64 input means
no rounding). Indexer ties (equal scores at the top-k cut; relu makes an entry score 0
whenever no head points toward it) go to the LOWER entry index; torch's CPU top-k has
no such rule, so tests against the torch layer use inputs without a tie at the cut.

What the graph computes around the node (projections, norms, RoPE of q / kv / the
indexer queries, the inverse rotation of the output, the grouped output projection) is
not here: see the op contract.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from engram_trt.errors import EngramError

_OP = "EngramDsv4Attention"
SLIDING, CSA, HCA = 0, 1, 2
LAYER_TYPE_NAMES = {
    SLIDING: "sliding_attention",
    CSA: "compressed_sparse_attention",
    HCA: "heavily_compressed_attention",
}
N_INPUTS = {SLIDING: 7, HCA: 15, CSA: 24}


@dataclass
class Dsv4CompressorInputs:
    """The node's inputs 7-14 (HCA and CSA): raw projections ``kv / gate [T, w]``,
    float32 ``bias [r, w]`` and ``norm [d]``, the compress table's ``inv_freq
    [rope_dim / 2]``, and the slot state ``entries [N, E, d]``, ``ring_kv / ring_gate
    [N, R, w]`` (w = d, R = r for HCA; w = 2d, R = 2r for CSA)."""

    kv: Any
    gate: Any
    bias: Any
    norm: Any
    inv_freq: Any
    entries: Any
    ring_kv: Any
    ring_gate: Any


@dataclass
class Dsv4IndexerInputs:
    """The node's inputs 15-23 (CSA): rotated ``q [T, NI, di]``, float32 head weights
    ``w [T, NI]`` (already ``* NI ** -0.5``), raw ``kv / gate [T, 2 di]``, float32
    ``bias [r, 2 di]`` and ``norm [di]``, state ``keys [N, E, di]``, ``ring_kv /
    ring_gate [N, 2r, 2 di]``."""

    q: Any
    w: Any
    kv: Any
    gate: Any
    bias: Any
    norm: Any
    keys: Any
    ring_kv: Any
    ring_gate: Any


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


def _f64(x: Any) -> np.ndarray:
    return _array(x).astype(np.float64)


def _round(x: np.ndarray, act: np.dtype | None) -> np.ndarray:
    """``x`` rounded to the activation dtype, back in float64."""
    return x if act is None else x.astype(act).astype(np.float64)


def rope_cos_sin(
    positions: np.ndarray, inv_freq: np.ndarray, rope_scale: float, act: np.dtype | None
) -> tuple[np.ndarray, np.ndarray]:
    """cos / sin ``[n, rope_dim / 2]`` (one per interleaved pair) at ``positions``: the
    angle is a float32 product as in the table, the values rounded to act."""
    ang = (np.asarray(positions, dtype=np.float32).reshape(-1, 1) * inv_freq.astype(np.float32)).astype(np.float64)
    return _round(np.cos(ang) * rope_scale, act), _round(np.sin(ang) * rope_scale, act)


def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Interleaved partial RoPE of ``x [n, d]``: the trailing ``2 * cos.shape[-1]``
    channels in pairs ``(2i, 2i + 1)``; the leading ones pass."""
    half = cos.shape[-1]
    out = x.copy()
    start = x.shape[-1] - 2 * half
    even, odd = x[:, start::2], x[:, start + 1 :: 2]
    out[:, start::2] = even * cos - odd * sin
    out[:, start + 1 :: 2] = odd * cos + even * sin
    return out


def pool_window(
    kv: np.ndarray,
    gate: np.ndarray,
    dim: int,
    overlap: bool,
    norm: np.ndarray,
    eps: float,
    cos: np.ndarray,
    sin: np.ndarray,
    act: np.dtype | None,
) -> np.ndarray:
    """One entry ``[dim]`` from a window's rows (gate already biased): ``kv / gate
    [2r, 2 dim]`` with overlap (rows ``:r`` the predecessor window, whose ``[:dim]``
    channels are used; rows ``r:`` this window's ``[dim:]``; a missing predecessor has
    gate -inf), else ``[r, dim]``."""
    if overlap:
        r = kv.shape[0] // 2
        v = np.concatenate([kv[:r, :dim], kv[r:, dim:]])
        g = np.concatenate([gate[:r, :dim], gate[r:, dim:]])
    else:
        v, g = kv, gate
    with np.errstate(invalid="ignore"):
        g = g - g.max(axis=0, keepdims=True)
    e = np.exp(g)
    weights = _round(e / e.sum(axis=0, keepdims=True), act)
    pooled = _round(_round(v * weights, act).sum(axis=0), act)
    normed = _round(norm * pooled / math.sqrt(float((pooled * pooled).mean()) + eps), act)
    return _round(rotate(normed[None], cos, sin)[0], act)


def _stream(
    kv_new: np.ndarray,
    gate_new: np.ndarray,
    bias: np.ndarray,
    past: int,
    dim: int,
    rate: int,
    overlap: bool,
    entries: np.ndarray,
    ring_kv: np.ndarray,
    ring_gate: np.ndarray,
    norm: np.ndarray,
    eps: float,
    inv_freq: np.ndarray,
    rope_scale: float,
    act: np.dtype | None,
) -> int:
    """One sequence's compressor step on one slot's state views (in place): emit the
    windows its tokens complete, then store the last R raw rows; returns the entry count."""
    n = kv_new.shape[0]
    end = past + n
    big_r = ring_kv.shape[0]

    def row(pos: int) -> tuple[np.ndarray, np.ndarray]:
        if pos >= past:
            kv_r, g_r = kv_new[pos - past], gate_new[pos - past]
        else:
            kv_r, g_r = ring_kv[pos % big_r], ring_gate[pos % big_r]
        return kv_r.astype(np.float64), g_r.astype(np.float64) + bias[pos % rate]

    for j in range(past // rate, end // rate):
        first = (j - 1) * rate if overlap else j * rate
        rows_kv, rows_gate = [], []
        for pos in range(first, (j + 1) * rate):
            if pos < 0:
                rows_kv.append(np.zeros(2 * dim))
                rows_gate.append(np.full(2 * dim, -np.inf))
            else:
                kv_r, g_r = row(pos)
                rows_kv.append(kv_r)
                rows_gate.append(g_r)
        cos, sin = rope_cos_sin(np.array([j * rate]), inv_freq, rope_scale, act)
        entries[j] = pool_window(np.stack(rows_kv), np.stack(rows_gate), dim, overlap, norm, eps, cos, sin, act).astype(
            entries.dtype
        )
    keep = min(n, big_r)
    for pos in range(end - keep, end):
        ring_kv[pos % big_r] = kv_new[pos - past].astype(ring_kv.dtype)
        ring_gate[pos % big_r] = gate_new[pos - past].astype(ring_gate.dtype)
    return end // rate


def select_entries(scores: np.ndarray, topk: int) -> np.ndarray:
    """Bool ``[n]``: all entries when at most ``topk``, else the ``topk`` best scored,
    equal scores going to the lower index."""
    n = scores.shape[0]
    keep = np.ones(n, dtype=bool)
    if n > topk:
        order = np.lexsort((np.arange(n), -scores))
        keep[:] = False
        keep[order[:topk]] = True
    return keep


def _check_fields(
    layer_type: int, window: int, compress_rate: int, index_topk: int, scaling: float, eps: float, rope_scale: float
) -> None:
    if layer_type not in N_INPUTS:
        raise EngramError(f"{_OP}: layer_type {layer_type} must be 0 (sliding), 1 (CSA) or 2 (HCA)")
    if window < 1:
        raise EngramError(f"{_OP}: window {window} must be >= 1 (sliding_window)")
    if layer_type != SLIDING and compress_rate < 1:
        raise EngramError(f"{_OP}: compress_rate {compress_rate} must be >= 1 on a CSA / HCA layer")
    if layer_type == CSA and index_topk < 1:
        raise EngramError(f"{_OP}: index_topk {index_topk} must be >= 1 on a CSA layer")
    if not (scaling > 0 and math.isfinite(scaling)):
        raise EngramError(f"{_OP}: scaling {scaling} must be a positive finite number (head_dim ** -0.5)")
    if not (eps >= 0 and math.isfinite(eps)):
        raise EngramError(f"{_OP}: eps {eps} must be a finite number >= 0 (rms_norm_eps)")
    if not (rope_scale > 0 and math.isfinite(rope_scale)):
        raise EngramError(f"{_OP}: rope_scale {rope_scale} must be a positive finite number (1.0 without YaRN)")


def _shape(name: str, got: tuple[int, ...], want: tuple[int, ...]) -> None:
    if tuple(got) != tuple(want):
        raise EngramError(f"{_OP}: {name} has shape {tuple(got)}; pass {list(want)}")


def dsv4_attention_reference(
    q: Any,
    kv: Any,
    sinks: Any,
    seq_starts: Any,
    past_lens: Any,
    slots: Any,
    window_kv: Any,
    *,
    compressor: Dsv4CompressorInputs | None = None,
    indexer: Dsv4IndexerInputs | None = None,
    layer_type: int,
    window: int,
    compress_rate: int = 0,
    index_topk: int = 0,
    scaling: float,
    eps: float = 1e-6,
    rope_scale: float = 1.0,
) -> tuple[np.ndarray, ...]:
    """EngramDsv4Attention over one packed step.

    Returns ``(out [T, H, d] float64, window_kv, [entries, ring_kv, ring_gate, [keys,
    indexer ring_kv, indexer ring_gate]])`` (the node's outputs in order), the states new
    arrays in their own dtype. ``out`` is before the inverse RoPE."""
    layer_type, window, compress_rate, index_topk = int(layer_type), int(window), int(compress_rate), int(index_topk)
    scaling, eps, rope_scale = float(scaling), float(eps), float(rope_scale)
    _check_fields(layer_type, window, compress_rate, index_topk, scaling, eps, rope_scale)
    act = _act_dtype(q)
    qa, kva, sk = _f64(q), _f64(kv), _f64(sinks).reshape(-1)
    starts = [int(v) for v in _array(seq_starts).reshape(-1)]
    pasts = [int(v) for v in _array(past_lens).reshape(-1)]
    slot_ids = [int(v) for v in _array(slots).reshape(-1)]
    win = _array(window_kv)
    if qa.ndim != 3:
        raise EngramError(f"{_OP}: q has shape {qa.shape}; pass [tokens, heads, head_dim]")
    t_count, heads, d = qa.shape
    _shape("kv", kva.shape, (t_count, d))
    _shape("sinks", sk.shape, (heads,))
    if win.ndim != 3 or win.shape[1] != window or win.shape[2] != d:
        raise EngramError(f"{_OP}: window_kv has shape {win.shape}; pass [num_slots, {window}, {d}]")
    n_slots = win.shape[0]
    n_seq = len(starts) - 1
    if n_seq < 0 or starts[0] != 0 or starts[-1] != t_count or any(b < a for a, b in zip(starts, starts[1:])):
        raise EngramError(f"{_OP}: seq_starts {starts} must rise from 0 to the token count {t_count}")
    if len(pasts) != n_seq or len(slot_ids) != n_seq:
        raise EngramError(f"{_OP}: {n_seq} sequences but {len(pasts)} past_lens and {len(slot_ids)} slots")
    if layer_type != SLIDING and compressor is None:
        raise EngramError(f"{_OP}: a {LAYER_TYPE_NAMES[layer_type]} layer needs the compressor inputs")
    if layer_type == CSA and indexer is None:
        raise EngramError(f"{_OP}: a compressed_sparse_attention layer needs the indexer inputs")

    overlap = layer_type == CSA
    rate = compress_rate
    if compressor is not None and layer_type != SLIDING:
        c = compressor
        width, big_r = (2 * d, 2 * rate) if overlap else (d, rate)
        c_kv, c_gate = _array(c.kv), _array(c.gate)
        c_bias, c_norm, inv_freq = _f64(c.bias), _f64(c.norm).reshape(-1), _f64(c.inv_freq).reshape(-1)
        entries, c_ring_kv, c_ring_gate = _array(c.entries), _array(c.ring_kv), _array(c.ring_gate)
        _shape("c_kv", c_kv.shape, (t_count, width))
        _shape("c_gate", c_gate.shape, (t_count, width))
        _shape("c_bias", c_bias.shape, (rate, width))
        _shape("c_norm", c_norm.shape, (d,))
        if entries.ndim != 3 or entries.shape[0] != n_slots or entries.shape[2] != d:
            raise EngramError(f"{_OP}: compressed_kv has shape {entries.shape}; pass [{n_slots}, max_len // rate, {d}]")
        _shape("compressor_kv", c_ring_kv.shape, (n_slots, big_r, width))
        _shape("compressor_gate", c_ring_gate.shape, (n_slots, big_r, width))
        if 2 * inv_freq.shape[0] > d or inv_freq.shape[0] < 1:
            raise EngramError(
                f"{_OP}: inv_freq has {inv_freq.shape[0]} pairs; rope_dim = 2 x that must fit head_dim {d}"
            )
        capacity = entries.shape[1]
    if layer_type == CSA:
        ix = indexer
        iq, iw = _f64(ix.q), _f64(ix.w)
        if iq.ndim != 3 or iq.shape[0] != t_count:
            raise EngramError(f"{_OP}: index_q has shape {iq.shape}; pass [{t_count}, index_n_heads, index_head_dim]")
        n_ih, di = iq.shape[1], iq.shape[2]
        i_kv, i_gate = _array(ix.kv), _array(ix.gate)
        i_bias, i_norm = _f64(ix.bias), _f64(ix.norm).reshape(-1)
        i_keys, i_ring_kv, i_ring_gate = _array(ix.keys), _array(ix.ring_kv), _array(ix.ring_gate)
        _shape("index_w", iw.shape, (t_count, n_ih))
        _shape("i_kv", i_kv.shape, (t_count, 2 * di))
        _shape("i_gate", i_gate.shape, (t_count, 2 * di))
        _shape("i_bias", i_bias.shape, (rate, 2 * di))
        _shape("i_norm", i_norm.shape, (di,))
        _shape("index_keys", i_keys.shape, (n_slots, capacity, di))
        _shape("indexer_kv", i_ring_kv.shape, (n_slots, 2 * rate, 2 * di))
        _shape("indexer_gate", i_ring_gate.shape, (n_slots, 2 * rate, 2 * di))
        if 2 * inv_freq.shape[0] > di:
            raise EngramError(f"{_OP}: rope_dim {2 * inv_freq.shape[0]} exceeds index_head_dim {di}")
    if len(set(slot_ids)) != n_seq:
        raise EngramError(f"{_OP}: slots {slot_ids} repeat; each sequence of a step owns its own slot")
    for s in range(n_seq):
        if not 0 <= slot_ids[s] < n_slots:
            raise EngramError(f"{_OP}: slot {slot_ids[s]} is outside the state's {n_slots} slots")
        if pasts[s] < 0:
            raise EngramError(f"{_OP}: past_lens[{s}] is {pasts[s]}; a past length is >= 0")
        end = pasts[s] + starts[s + 1] - starts[s]
        if layer_type != SLIDING and end // rate > capacity:
            raise EngramError(
                f"{_OP}: sequence {s} reaches length {end}; the state holds {capacity} compressed "
                "entries: allocate it with a larger max_len"
            )

    out = np.zeros((t_count, heads, d), dtype=np.float64)
    for s in range(n_seq):
        a, b = starts[s], starts[s + 1]
        n, past, slot = b - a, pasts[s], slot_ids[s]
        if n == 0:
            continue
        n_entries = 0
        if layer_type != SLIDING:
            n_entries = _stream(
                c_kv[a:b],
                c_gate[a:b],
                c_bias,
                past,
                d,
                rate,
                overlap,
                entries[slot],
                c_ring_kv[slot],
                c_ring_gate[slot],
                c_norm,
                eps,
                inv_freq,
                rope_scale,
                act,
            )
            ent = entries[slot, :n_entries].astype(np.float64)
        if layer_type == CSA:
            _stream(
                i_kv[a:b],
                i_gate[a:b],
                i_bias,
                past,
                di,
                rate,
                True,
                i_keys[slot],
                i_ring_kv[slot],
                i_ring_gate[slot],
                i_norm,
                eps,
                inv_freq,
                rope_scale,
                act,
            )
            keys_i = i_keys[slot, :n_entries].astype(np.float64)
        for i in range(n):
            t, p = a + i, past + i
            lo = max(0, p - window + 1)
            rows = [
                win[slot, k % window].astype(np.float64) if k < past else kva[a + k - past] for k in range(lo, p + 1)
            ]
            keys = np.stack(rows)
            visible = (p + 1) // rate if layer_type != SLIDING else 0
            if visible:
                chosen = ent[:visible]
                if layer_type == CSA:
                    score = (iw[t][:, None] * np.maximum(iq[t] @ keys_i[:visible].T, 0.0)).sum(0) / math.sqrt(di)
                    chosen = chosen[select_entries(score, index_topk)]
                keys = np.concatenate([keys, chosen])
            logits = qa[t] @ keys.T * scaling  # [H, L]
            top = np.maximum(logits.max(axis=1), sk)
            e = np.exp(logits - top[:, None])
            denom = e.sum(axis=1) + np.exp(sk - top)
            probs = _round(e / denom[:, None], act)
            out[t] = _round(probs @ keys, act)
        keep = min(n, window)
        for pos in range(past + n - keep, past + n):
            win[slot, pos % window] = kva[a + pos - past].astype(win.dtype)
    result: list[np.ndarray] = [out, win]
    if layer_type != SLIDING:
        result += [entries, c_ring_kv, c_ring_gate]
    if layer_type == CSA:
        result += [i_keys, i_ring_kv, i_ring_gate]
    return tuple(result)


def dsv4_attention_reference_flat(
    *inputs: Any,
    layer_type: int,
    window: int,
    compress_rate: int = 0,
    index_topk: int = 0,
    scaling: float,
    eps: float = 1e-6,
    rope_scale: float = 1.0,
) -> tuple[np.ndarray, ...]:
    """The same over the node's inputs in op order (7 / 15 / 24 of them by layer type),
    as the ReferenceEvaluator's OpRun receives them."""
    want = N_INPUTS.get(int(layer_type))
    if want is None or len(inputs) != want:
        raise EngramError(f"{_OP}: layer_type {layer_type} takes {want} inputs, got {len(inputs)}")
    comp = Dsv4CompressorInputs(*inputs[7:15]) if want > 7 else None
    index = Dsv4IndexerInputs(*inputs[15:24]) if want > 15 else None
    return dsv4_attention_reference(
        *inputs[:7],
        compressor=comp,
        indexer=index,
        layer_type=layer_type,
        window=window,
        compress_rate=compress_rate,
        index_topk=index_topk,
        scaling=scaling,
        eps=eps,
        rope_scale=rope_scale,
    )


__all__ = [
    "CSA",
    "HCA",
    "SLIDING",
    "N_INPUTS",
    "Dsv4CompressorInputs",
    "Dsv4IndexerInputs",
    "dsv4_attention_reference",
    "dsv4_attention_reference_flat",
    "pool_window",
    "rope_cos_sin",
    "rotate",
    "select_entries",
]
