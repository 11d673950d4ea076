"""Float64 NumPy references of the two Gated DeltaNet plugin ops of the Qwen4Exp engine,
EngramCausalConv1d and EngramGatedDeltaNet (plugins/engramCausalConv1dPlugin and
plugins/engramGatedDeltaNetPlugin state the same contracts).

They are what the ONNX ReferenceEvaluator runs for those nodes
(reference_ops.py), and the independent side of the kernel tests: written
as the plain token-by-token definitions (no chunking, no tricks), in float64, so a
kernel or the torch layer (models/qwen4_exp/linear_attention.py) is compared against the
math itself rather than against another fast form of it.

A packed step: ``seq_starts [S+1]`` (cu_seqlens), ``past_lens [S]`` (tokens the slot
already holds), ``slots [S]`` (the per-slot state row). A sequence with ``past_lens == 0``
ignores what its slot held (zeros). The kernels' out-of-range conventions are kept, so
the reference specifies them too: a token outside every sequence gets a zero output, a
sequence whose slot is outside ``[0, num_slots)`` reads zeros and keeps nothing, a step
of no tokens changes nothing (even a fresh empty sequence's slot). Both functions return
new arrays (outputs and whole new states); the caller decides what
"in place" means.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engram_trt.errors import EngramError

# The q / k L2 normalization's epsilon (linear_attention.L2_EPS; repeated here so this
# NumPy reference imports no torch module, a test ties the two).
L2_EPS = 1e-6

ACTIVATION_IDENTITY = 0
ACTIVATION_SILU = 1


def _f64(x: Any) -> np.ndarray:
    """A float64 copy of a NumPy array (ml_dtypes bfloat16 included), torch tensor or list."""
    if hasattr(x, "detach"):  # a torch tensor, without importing torch here
        x = x.detach().to("cpu").float().numpy()
    return np.array(x, dtype=np.float64)


def _step(seq_starts: Any, past_lens: Any, slots: Any, num_tokens: int, op: str) -> tuple[np.ndarray, ...]:
    """The step's three int arrays, checked for consistency (one-line errors)."""
    starts = np.asarray(seq_starts, dtype=np.int64).reshape(-1)
    past = np.asarray(past_lens, dtype=np.int64).reshape(-1)
    slot = np.asarray(slots, dtype=np.int64).reshape(-1)
    S = starts.size - 1
    if S < 0 or past.size != S or slot.size != S:
        raise EngramError(
            f"{op}: seq_starts has {starts.size} entries, past_lens {past.size}, slots {slot.size}; pass S + 1, S and S"
        )
    if S > 0 and (np.any(np.diff(starts) < 0) or starts[0] < 0 or starts[-1] > num_tokens):
        raise EngramError(f"{op}: seq_starts {starts.tolist()} must be non-decreasing within [0, {num_tokens}]")
    return starts, past, slot


def causal_conv1d_reference(
    x: Any, weight: Any, conv_state: Any, seq_starts: Any, past_lens: Any, slots: Any, activation: int
) -> tuple[np.ndarray, np.ndarray]:
    """EngramCausalConv1d: the depthwise causal convolution of a packed step.

    ``x [T, C]``, ``weight [C, K]`` or ``[C, 1, K]``, ``conv_state [num_slots, C, K-1]``
    (the slot's last K-1 pre-conv inputs, oldest first). For token t of sequence s at
    step offset i::

        y[t, c] = act(sum_j weight[c, j] * x_s(i - (K-1-j)))

    where ``x_s(m)`` is this step's input for ``m >= 0``, the slot's state column
    ``K-1+m`` for ``-(K-1) <= m < 0`` when the sequence continues (``past_lens > 0``) and
    zero otherwise. ``act``: 0 identity, 1 silu. Returns ``(y [T, C] float64, new state
    float64)``, the new state's row of each step slot being the last K-1 columns of
    ``[old row (zeros when fresh), the sequence's inputs]``.
    """
    xs = _f64(x)
    if xs.ndim != 2:
        raise EngramError(f"EngramCausalConv1d: x has shape {xs.shape}; pass [tokens, channels]")
    T, C = xs.shape
    w = _f64(weight)
    if w.ndim == 3 and w.shape[1] == 1:
        w = w[:, 0, :]
    if w.ndim != 2 or w.shape[0] != C or w.shape[1] < 1:
        raise EngramError(f"EngramCausalConv1d: weight has shape {w.shape}; pass [{C}, K] or [{C}, 1, K]")
    K = w.shape[1]
    state = _f64(conv_state)
    if state.ndim != 3 or state.shape[1:] != (C, K - 1):
        raise EngramError(f"EngramCausalConv1d: conv_state has shape {state.shape}; allocate [num_slots, {C}, {K - 1}]")
    if activation not in (ACTIVATION_IDENTITY, ACTIVATION_SILU):
        raise EngramError(f"EngramCausalConv1d: activation {activation!r} is not 0 (identity) or 1 (silu)")
    starts, past, slot = _step(seq_starts, past_lens, slots, T, "EngramCausalConv1d")
    num_slots = state.shape[0]
    new_state = state.copy()
    y = np.zeros((T, C), dtype=np.float64)
    for s in range(starts.size - 1 if T else 0):
        a, b = int(starts[s]), int(starts[s + 1])
        valid = 0 <= slot[s] < num_slots
        old = state[slot[s]] if valid and past[s] > 0 else np.zeros((C, K - 1))
        full = np.concatenate([old, xs[a:b].T], axis=1)  # [C, K-1 + n]
        for i in range(b - a):
            y[a + i] = (full[:, i : i + K] * w).sum(axis=1)
        if valid:
            new_state[slot[s]] = full[:, full.shape[1] - (K - 1) :]
    if activation == ACTIVATION_SILU:
        y = y / (1.0 + np.exp(-y))
    return y, new_state


def gated_delta_net_reference(
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    beta: Any,
    state: Any,
    seq_starts: Any,
    past_lens: Any,
    slots: Any,
    l2norm_qk: int,
    scale: float,
) -> tuple[np.ndarray, np.ndarray]:
    """EngramGatedDeltaNet: the gated delta rule of a packed step, token by token.

    ``q, k [T, Hk, dk]``, ``v [T, Hv, dv]``, ``g`` (log decay) and ``beta [T, Hv]``,
    ``state [num_slots, Hv, dk, dv]``. Value head h reads key head ``h // (Hv // Hk)``.
    With ``l2norm_qk`` q and k become ``x / sqrt(|x|^2 + L2_EPS)``; q is then scaled by
    ``scale``. Per sequence and value head, from the slot's state (zeros when fresh)::

        S = exp(g) S;  u = beta (v - S^T k);  S = S + k u^T;  o = S^T q

    Returns ``(o [T, Hv, dv] float64, new state float64)``.
    """
    qs, ks, vs, gs, bs = (_f64(t) for t in (q, k, v, g, beta))
    if qs.ndim != 3 or ks.shape != qs.shape:
        raise EngramError(f"EngramGatedDeltaNet: q {qs.shape} and k {ks.shape} must be one shape [tokens, Hk, dk]")
    T, Hk, dk = qs.shape
    if vs.ndim != 3 or vs.shape[0] != T:
        raise EngramError(f"EngramGatedDeltaNet: v has shape {vs.shape}; pass [{T}, Hv, dv]")
    Hv, dv = vs.shape[1:]
    if Hv % Hk:
        raise EngramError(f"EngramGatedDeltaNet: {Hv} value heads are not a multiple of {Hk} key heads")
    if gs.shape != (T, Hv) or bs.shape != (T, Hv):
        raise EngramError(f"EngramGatedDeltaNet: g {gs.shape} and beta {bs.shape} must be [{T}, {Hv}]")
    st = _f64(state)
    if st.ndim != 4 or st.shape[1:] != (Hv, dk, dv):
        raise EngramError(f"EngramGatedDeltaNet: state has shape {st.shape}; allocate [num_slots, {Hv}, {dk}, {dv}]")
    starts, past, slot = _step(seq_starts, past_lens, slots, T, "EngramGatedDeltaNet")
    if int(l2norm_qk):
        qs = qs / np.sqrt((qs * qs).sum(-1, keepdims=True) + L2_EPS)
        ks = ks / np.sqrt((ks * ks).sum(-1, keepdims=True) + L2_EPS)
    qs = qs * float(scale)
    rep = Hv // Hk
    qs, ks = np.repeat(qs, rep, axis=1), np.repeat(ks, rep, axis=1)  # [T, Hv, dk]
    num_slots = st.shape[0]
    new_state = st.copy()
    o = np.zeros((T, Hv, dv), dtype=np.float64)
    for s in range(starts.size - 1 if T else 0):
        valid = 0 <= slot[s] < num_slots
        S = st[slot[s]].copy() if valid and past[s] > 0 else np.zeros((Hv, dk, dv))
        for t in range(int(starts[s]), int(starts[s + 1])):
            S *= np.exp(gs[t])[:, None, None]
            predicted = np.einsum("hkv,hk->hv", S, ks[t])
            u = bs[t][:, None] * (vs[t] - predicted)
            S += ks[t][:, :, None] * u[:, None, :]
            o[t] = np.einsum("hkv,hk->hv", S, qs[t])
        if valid:
            new_state[slot[s]] = S
    return o, new_state
