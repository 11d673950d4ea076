"""The Engram n-gram hash: compressed token ids -> table row ids.

This is the one Python statement of the formula (docs/engram-spec.md); the CUDA
kernel in ``plugins/kernels`` is the other, and tests hold them bit-identical.
One code path serves NumPy and PyTorch (``_hash`` only uses operators both share),
so the reference and the torch backend cannot drift apart.

Positions are per sequence. A chunk that does not start a sequence (chunked
prefill, a decode step) must be given the ``N-1`` compressed ids before its first
token as ``lookback``; ``-1`` there means "no token" (before the sequence start),
which blocks the n-gram exactly like a dead token does.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engram_trt.errors import EngramError
from engram_trt.engram.layout import EngramLayout

DEAD = -1


def _check_ids(ids: Any, layout: EngramLayout, what: str) -> None:
    if ids.ndim != 1:
        raise EngramError(f"{what} must be a 1-D sequence of compressed ids (got shape {tuple(ids.shape)})")
    if ids.numel() if hasattr(ids, "numel") else ids.size:
        hi = int(ids.max())
        lo = int(ids.min())
        if hi >= layout.compressed_vocab_size or lo < DEAD:
            bad = hi if hi >= layout.compressed_vocab_size else lo
            raise EngramError(
                f"{what} holds compressed id {bad}, outside -1..{layout.compressed_vocab_size - 1} "
                f"(-1 marks a dead token; compressed_vocab_size={layout.compressed_vocab_size})"
            )


def _hash(xp: Any, ext: Any, T: int, layout: EngramLayout, lead: int, like: Any, index: Any = None) -> Any:
    """Core formula over ``ext`` = lookback (``lead`` ids) followed by the ``T`` ids.

    Returns ``[T, L, cols]`` int64. ``xp`` is numpy or torch; ``like`` converts the
    layout constants to the same array type and device. ``index`` (packed form): the
    position in ``ext`` of each of the T tokens, whose lookback precedes it there; the
    token at shift s of token t is then ``ext[index[t] - s]``.
    """
    N, H, L = layout.max_ngram_size, layout.n_heads, layout.num_layers
    mult = like(layout.multipliers)  # [L, N]
    primes = like(layout.col_primes)  # [L, cols]
    offsets = like(layout.offsets)  # [L, cols]
    cols = []
    blocked = None
    rolling = None
    for s in range(N):
        if index is None:
            start = lead - s
            tok = ext[start : start + T]  # token at p - s, for every p
        else:
            tok = ext[index - s]
        dead = tok < 0
        blocked = dead if blocked is None else (blocked | dead)
        v = xp.where(blocked, like(np.int64(layout.pad_id)), tok)  # [T]
        term = v[:, None] * mult[None, :, s]  # [T, L]
        rolling = term if rolling is None else (rolling ^ term)
        if s >= 1:
            cols.append(
                rolling[:, :, None].expand(-1, -1, H)
                if xp is not np
                else np.broadcast_to(rolling[:, :, None], (T, L, H))
            )
    stacked = xp.concatenate(cols, axis=2) if xp is np else xp.cat(cols, dim=2)  # [T, L, cols]
    return stacked % primes[None] + offsets[None]


def _prepare_lookback(lookback: Any, n: int, xp: Any, like: Any) -> Any:
    if lookback is None:
        return like(np.full(n, DEAD, dtype=np.int64))
    lb = lookback if xp is not np else np.asarray(lookback, dtype=np.int64)
    if tuple(lb.shape) != (n,):
        raise EngramError(
            f"lookback must hold the N-1={n} compressed ids before the chunk (got shape {tuple(lb.shape)}); "
            "use -1 where there is no earlier token"
        )
    return lb


def hash_ids(ids: Any, layout: EngramLayout, lookback: Any = None) -> np.ndarray:
    """Row ids ``int64 [T, L, cols]`` for one sequence (or one chunk of it) in NumPy."""
    arr = np.asarray(ids, dtype=np.int64)
    _check_ids(arr, layout, "ids")
    lb = _prepare_lookback(lookback, layout.max_ngram_size - 1, np, np.asarray)
    _check_ids(lb, layout, "lookback")
    ext = np.concatenate([lb, arr])
    return _hash(np, ext, arr.shape[0], layout, layout.max_ngram_size - 1, lambda a: np.asarray(a, dtype=np.int64))


def hash_ids_torch(ids: Any, layout: EngramLayout, lookback: Any = None) -> Any:
    """Same as :func:`hash_ids` on torch tensors (any device); returns int64 ``[T, L, cols]``."""
    import torch

    ids = ids.to(torch.int64)
    _check_ids(ids, layout, "ids")
    like = lambda a: torch.as_tensor(a, dtype=torch.int64, device=ids.device)  # noqa: E731
    lb = _prepare_lookback(
        None if lookback is None else lookback.to(torch.int64, copy=False).to(ids.device),
        layout.max_ngram_size - 1,
        torch,
        like,
    )
    _check_ids(lb, layout, "lookback")
    ext = torch.cat([lb, ids])
    return _hash(torch, ext, ids.shape[0], layout, layout.max_ngram_size - 1, like)


def hash_batch_packed(ids: Any, seq_starts: Any, lookback: Any, layout: EngramLayout) -> np.ndarray:
    """Packed batch form (what the CUDA kernel implements).

    ``ids [T]`` holds the sequences back to back, ``seq_starts [S+1]`` their bounds
    (cu_seqlens), ``lookback [S, N-1]`` each sequence's earlier ids (or None: all start
    at position 0). Returns ``int64 [T, L, cols]``.
    """
    ids = np.asarray(ids, dtype=np.int64)
    starts = np.asarray(seq_starts, dtype=np.int64)
    if (
        starts.ndim != 1
        or starts.size < 1
        or starts[0] != 0
        or starts[-1] != ids.shape[0]
        or np.any(np.diff(starts) < 0)
    ):
        raise EngramError(f"seq_starts must rise from 0 to len(ids)={ids.shape[0]} (got {starts.tolist()})")
    S = starts.size - 1
    if lookback is not None:
        lookback = np.asarray(lookback, dtype=np.int64)
        if lookback.shape != (S, layout.max_ngram_size - 1):
            raise EngramError(
                f"lookback must be [num_sequences={S}, N-1={layout.max_ngram_size - 1}] (got {lookback.shape})"
            )
    n = layout.max_ngram_size - 1
    lb = np.full((S, n), DEAD, dtype=np.int64) if lookback is None else lookback
    _check_ids(ids, layout, "ids")
    _check_ids(lb.reshape(-1), layout, "lookback")
    # One vectorized pass over all sequences: each sequence's lookback is laid out just
    # before its tokens in one flat array, so the token at shift s is ext[index - s]
    # and never crosses into the previous sequence (decode steps of hundreds of
    # sequences hash in one go instead of a loop of small ones).
    T = ids.shape[0]
    lens = np.diff(starts)
    seq = np.repeat(np.arange(S), lens)
    block = starts[:-1] + np.arange(S) * n  # where sequence s's lookback begins in ext
    ext = np.empty(T + S * n, dtype=np.int64)
    ext[(block[:, None] + np.arange(n)[None, :]).reshape(-1)] = lb.reshape(-1)
    index = block[seq] + n + (np.arange(T) - starts[:-1][seq])
    ext[index] = ids
    return _hash(np, ext, T, layout, n, lambda a: np.asarray(a, dtype=np.int64), index=index)


def next_lookback(previous: Any, ids: Any, n: int) -> np.ndarray:
    """The last ``n`` compressed ids after appending ``ids`` to a sequence whose
    previous lookback was ``previous`` (None = sequence start): what the runtime
    keeps between chunks and decode steps."""
    prev = np.full(n, DEAD, dtype=np.int64) if previous is None else np.asarray(previous, dtype=np.int64)
    ext = np.concatenate([prev, np.asarray(ids, dtype=np.int64).reshape(-1)])
    return ext[ext.shape[0] - n :].copy()
