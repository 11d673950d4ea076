"""Qwen4-Exp PLE n-gram hash: raw token ids -> rows of each PLE layer's n-gram table.

The one Python home of the formula (transformers 5.25.0, ``Qwen4ExpTextNGramEmbedding``
is the published reference; ``tests/engram/test_ple_hash.py`` holds this module to it bit for
bit, and the CUDA kernel ``plugins/kernels/pleHashKernel.cu`` to this module).

How it differs from the Engram hash (``engram/hashing.py``), which is why it is a module
of its own rather than a mode of that one:

- it reads *raw* token ids (no compressed vocabulary), and the "pad" is the EOS id;
- n-grams do not cross an EOS: the token ``k`` back is used only if none of the ``k - 1``
  tokens between it and the current one, nor itself, is EOS (else the EOS id stands in);
  the current token is always itself, EOS or not;
- the multipliers come from SplitMix64 (seed + 10007 * PLE layer index), the primes are
  the successive primes ``>= ngram_vocab_size_base``, one global sequence over the PLE
  layers (layer ``l`` head ``h`` takes the ``l * H + h``-th), and each layer's table is
  padded to a multiple of ``make_ngram_vocab_size_divisible_by`` rows.

Per token, with ``w[k]`` the (EOS-substituted) token ``k`` back and ``m`` the layer's
multipliers: for order ``g`` in ``2..N`` (heads ``(g - 2) * heads_per_ngram ..``),
``mixed = w[0] * m[0] ^ ... ^ w[g-1] * m[g-1]`` (int64; the products stay below 2^63
because ``m < 2^63 / vocab_size``), and head ``j`` of that order reads row
``mixed mod prime[j] + offset[j]``.

Packed steps: ``input_ids [T]`` holds S sequences back to back, ``seq_starts [S+1]`` is
their cu_seqlens (0, ..., T) and ``context [S, N-1]`` the N-1 raw ids before each
sequence's first token (oldest first; all EOS for a sequence that starts in this step:
transformers pads a fresh history with EOS). :func:`next_context` gives the context a
per-sequence cache keeps for the next step. The functions take NumPy arrays or torch
tensors (then they compute with torch, on the tensors' device) and return the same kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from engram_trt.errors import ConfigError, EngramError

MASK64 = (1 << 64) - 1
INT64_MAX = (1 << 63) - 1
SPLITMIX_GAMMA = 0x9E3779B97F4A7C15
SPLITMIX_M1 = 0xBF58476D1CE4E5B9
SPLITMIX_M2 = 0x94D049BB133111EB
LAYER_SEED_STRIDE = 10007  # base seed of PLE layer l: seed + 10007 * l
MAX_NGRAM = 16  # the CUDA kernel's bound (a window of N ids per token in registers)


def splitmix64(value: int) -> int:
    """One SplitMix64 step on a 64-bit value (Python ints, masked to 64 bits)."""
    value = (value + SPLITMIX_GAMMA) & MASK64
    value = ((value ^ (value >> 30)) * SPLITMIX_M1) & MASK64
    value = ((value ^ (value >> 27)) * SPLITMIX_M2) & MASK64
    return (value ^ (value >> 31)) & MASK64


def layer_multipliers(vocab_size: int, ngram_size: int, ple_layer_index: int, seed: int) -> np.ndarray:
    """The odd multipliers ``int64 [ngram_size]`` of one PLE layer. Bounded by
    ``INT64_MAX // vocab_size`` so that ``id * multiplier`` never wraps for an id of the
    vocabulary: the same value in NumPy, torch and CUDA."""
    half_bound = max(1, (INT64_MAX // max(vocab_size, 1)) // 2)
    base_seed = seed + LAYER_SEED_STRIDE * ple_layer_index
    values = [
        2 * (splitmix64((base_seed + SPLITMIX_GAMMA * (i + 1)) & MASK64) % half_bound) + 1 for i in range(ngram_size)
    ]
    return np.array(values, dtype=np.int64)


def primes_from(start: int, count: int) -> np.ndarray:
    """The first ``count`` primes ``>= start``, ``int64 [count]``, by a sieve of windows
    of [start, ...): a real config (40 layers x 16 heads after 20,000,000) takes
    milliseconds, where trial division per candidate takes seconds."""
    start = max(int(start), 2)
    found: list[np.ndarray] = []
    have = 0
    lo = start
    span = max(1024, int(count * (np.log(start + 2) + 2) * 1.2))
    while have < count:
        hi = lo + span
        limit = int(np.sqrt(hi)) + 1
        small = np.ones(limit + 1, dtype=bool)
        small[:2] = False
        for p in range(2, int(np.sqrt(limit)) + 1):
            if small[p]:
                small[p * p :: p] = False
        window = np.ones(hi - lo, dtype=bool)
        for p in np.flatnonzero(small):
            p = int(p)
            first = max(p * p, (lo + p - 1) // p * p)
            window[first - lo :: p] = False
        if lo < 2:
            window[: 2 - lo] = False
        primes = lo + np.flatnonzero(window).astype(np.int64)
        found.append(primes[: count - have])
        have += min(primes.size, count - have)
        lo = hi
    return np.concatenate(found) if found else np.zeros(0, dtype=np.int64)


def _require_int(name: str, value: Any, lo: int, hi: int | None = None, fix: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ConfigError(f"{name} must be an integer (got {type(value).__name__} {value!r})")
    value = int(value)
    if value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ConfigError(f"{name}={value} must be {bound}{'; ' + fix if fix else ''}")
    return value


@dataclass(frozen=True, eq=False)
class PLEHashLayout:
    """Everything the hash and the tables need for one model (all its PLE layers)."""

    num_layers: int  # L, the PLE layers (index = position in ple_layer_ids)
    ngram_size: int  # N (orders 2..N)
    heads_per_ngram: int
    eos_id: int
    vocab_size: int
    multipliers: np.ndarray  # int64 [L, N]
    head_vocab_sizes: np.ndarray  # int64 [L, H], the primes
    head_offsets: np.ndarray  # int64 [L, H], first row of each head in its layer's table
    table_rows: np.ndarray  # int64 [L], padded to make_ngram_vocab_size_divisible_by

    @property
    def num_heads(self) -> int:
        """H = (N - 1) * heads_per_ngram: the row ids per token and layer."""
        return (self.ngram_size - 1) * self.heads_per_ngram

    @classmethod
    def from_config(
        cls,
        *,
        vocab_size: int,
        ngram_size: int,
        heads_per_ngram: int,
        ngram_vocab_size_base: int,
        make_ngram_vocab_size_divisible_by: int,
        seed: int,
        eos_token_id: int | Sequence[int],
        num_layers: int,
    ) -> "PLEHashLayout":
        """The layout of a Qwen4-Exp config's PLE layers (``num_layers`` =
        ``len(ple_layer_ids)``). ``eos_token_id`` may be a list: its first entry is the
        one the hash uses, as in transformers."""
        if isinstance(eos_token_id, (list, tuple)):
            if not eos_token_id:
                raise ConfigError("eos_token_id is an empty list; PLE needs one EOS id: set eos_token_id")
            eos_token_id = eos_token_id[0]
        if eos_token_id is None:
            raise ConfigError("eos_token_id is not set; PLE layers need it: set eos_token_id")
        vocab = _require_int("vocab_size", vocab_size, 1, INT64_MAX)
        n = _require_int("ngram_size", ngram_size, 2, MAX_NGRAM, "orders 2..N, at most 16 (the kernel's window)")
        hpn = _require_int("heads_per_ngram", heads_per_ngram, 1, 1 << 16)
        base = _require_int("ngram_vocab_size_base", ngram_vocab_size_base, 2, 1 << 40)
        divisor = _require_int("make_ngram_vocab_size_divisible_by", make_ngram_vocab_size_divisible_by, 1, 1 << 30)
        seed = _require_int("seed", seed, -(1 << 63), INT64_MAX)
        eos = _require_int("eos_token_id", eos_token_id, 0, vocab - 1, f"it must be a token of vocab_size={vocab}")
        L = _require_int("num_layers (len(ple_layer_ids))", num_layers, 1, 1 << 12)
        H = (n - 1) * hpn
        primes = primes_from(base, L * H).reshape(L, H)
        offsets = np.zeros_like(primes)
        offsets[:, 1:] = np.cumsum(primes, axis=1)[:, :-1]
        totals = primes.sum(axis=1)
        table_rows = (totals + divisor - 1) // divisor * divisor
        multipliers = np.stack([layer_multipliers(vocab, n, li, seed) for li in range(L)])
        return cls(
            num_layers=L,
            ngram_size=n,
            heads_per_ngram=hpn,
            eos_id=eos,
            vocab_size=vocab,
            multipliers=multipliers,
            head_vocab_sizes=primes,
            head_offsets=offsets,
            table_rows=table_rows.astype(np.int64),
        )


# --- the hash ---------------------------------------------------------------------------


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


def _check_packed(input_ids: Any, seq_starts: Any, context: Any, layout: PLEHashLayout) -> tuple[Any, Any, Any, Any]:
    """(ids int64 [T], starts int64 [S+1] numpy, context int64 [S, N-1], xp), checked."""
    if _is_torch(input_ids):
        import torch

        xp, ids = torch, input_ids.reshape(-1).long()
        ctx = torch.as_tensor(context, device=ids.device).long()
    else:
        xp, ids = np, np.asarray(input_ids, dtype=np.int64).reshape(-1)
        ctx = np.asarray(_to_numpy(context), dtype=np.int64)
    starts = np.asarray(_to_numpy(seq_starts), dtype=np.int64).reshape(-1)
    T = int(ids.shape[0])
    if starts.size < 1 or starts[0] != 0 or starts[-1] != T or np.any(np.diff(starts) < 0):
        raise EngramError(
            f"seq_starts must be cu_seqlens rising from 0 to len(input_ids)={T} "
            f"(got {starts.tolist()[:8]}{'...' if starts.size > 8 else ''})"
        )
    S, n = starts.size - 1, layout.ngram_size - 1
    if tuple(ctx.shape) != (S, n):
        raise EngramError(
            f"context must be [num_sequences={S}, ngram_size-1={n}] (got {tuple(ctx.shape)}); "
            f"use fresh_context(S, layout) for sequences that start in this step"
        )
    for name, a in (("input_ids", ids), ("context", ctx)):
        if a.numel() if xp is not np else a.size:
            lo, hi = int(a.min()), int(a.max())
            if lo < 0 or hi >= layout.vocab_size:
                raise EngramError(
                    f"{name} holds ids in [{lo}, {hi}], outside [0, vocab_size={layout.vocab_size}); "
                    f"pass raw token ids of the model's vocabulary"
                )
    return ids, starts, ctx, xp


def _to_numpy(x: Any) -> Any:
    return x.detach().cpu().numpy() if _is_torch(x) else x


def fresh_context(num_sequences: int, layout: PLEHashLayout, like: Any = None) -> Any:
    """The context of sequences that start in this step: ``[S, N-1]`` EOS ids (a torch
    tensor on ``like``'s device when ``like`` is one, else NumPy)."""
    shape = (int(num_sequences), layout.ngram_size - 1)
    if like is not None and _is_torch(like):
        import torch

        return torch.full(shape, layout.eos_id, dtype=torch.long, device=like.device)
    return np.full(shape, layout.eos_id, dtype=np.int64)


def _windows(ids: Any, starts: np.ndarray, ctx: Any, layout: PLEHashLayout, xp: Any) -> Any:
    """``[T, N]``: column k = the token k back (EOS where an EOS lies in between)."""
    n = layout.ngram_size - 1
    T, S = int(ids.shape[0]), starts.size - 1
    lens = np.diff(starts)
    seq = np.repeat(np.arange(S), lens)
    pos = np.arange(T) - starts[:-1][seq]
    # history: each sequence's context laid out just before its tokens, so the token k
    # back of token t is history[where[t] - k] and never reaches another sequence.
    block = starts[:-1] + np.arange(S) * n
    where = block[seq] + n + pos
    ctx_at = (block[:, None] + np.arange(n)[None, :]).reshape(-1)
    back = where[:, None] - np.arange(n + 1)[None, :]  # [T, N]
    if xp is np:
        history = np.empty(T + S * n, dtype=np.int64)
        history[ctx_at] = ctx.reshape(-1)
        history[where] = ids
        w = history[back]
    else:
        history = xp.empty(T + S * n, dtype=xp.long, device=ids.device)
        dev = lambda a: xp.as_tensor(a, device=ids.device)  # noqa: E731
        history[dev(ctx_at)] = ctx.reshape(-1)
        history[dev(where)] = ids
        w = history[dev(back)]
    # blocked[:, k]: an EOS among the tokens 1..k-1 back (the token k back, if EOS, stands
    # for itself: the same value).
    is_eos = w[:, 1:-1] == layout.eos_id
    if xp is np:
        blocked = np.concatenate([np.zeros((T, 2), dtype=bool), np.cumsum(is_eos, axis=1) > 0], axis=1)
        return np.where(blocked, np.int64(layout.eos_id), w)
    zeros = xp.zeros((T, 2), dtype=xp.bool, device=ids.device)
    blocked = xp.cat([zeros, xp.cumsum(is_eos.long(), dim=1) > 0], dim=1)[:, : n + 1]
    return xp.where(blocked, xp.full_like(w, layout.eos_id), w)


def _hash_layer(w: Any, layout: PLEHashLayout, layer: int, xp: Any) -> Any:
    mult = layout.multipliers[layer]
    primes = layout.head_vocab_sizes[layer]
    offsets = layout.head_offsets[layer]
    if xp is not np:
        mult = xp.as_tensor(mult, device=w.device)
        primes = xp.as_tensor(primes, device=w.device)
        offsets = xp.as_tensor(offsets, device=w.device)
    hpn = layout.heads_per_ngram
    mixed = w[:, 0] * mult[0]
    blocks = []
    for order in range(2, layout.ngram_size + 1):
        mixed = mixed ^ (w[:, order - 1] * mult[order - 1])
        heads = slice((order - 2) * hpn, (order - 1) * hpn)
        blocks.append(mixed[:, None] % primes[None, heads] + offsets[None, heads])
    return np.concatenate(blocks, axis=1) if xp is np else xp.cat(blocks, dim=1)


def _check_layer(layer: int, layout: PLEHashLayout) -> int:
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < layout.num_layers:
        raise EngramError(f"layer={layer!r} must be a PLE layer index in [0, {layout.num_layers})")
    return int(layer)


def ple_hash_packed(input_ids: Any, seq_starts: Any, context: Any, layout: PLEHashLayout, layer: int) -> Any:
    """Row ids ``int64 [T, H]`` of one PLE layer (head offsets added: rows of that
    layer's table) for a packed step; NumPy in, NumPy out, torch in, torch out."""
    layer = _check_layer(layer, layout)
    ids, starts, ctx, xp = _check_packed(input_ids, seq_starts, context, layout)
    return _hash_layer(_windows(ids, starts, ctx, layout, xp), layout, layer, xp)


def ple_hash_all_layers(input_ids: Any, seq_starts: Any, context: Any, layout: PLEHashLayout) -> Any:
    """Row ids ``int64 [T, L, H]`` of every PLE layer (the windows built once)."""
    ids, starts, ctx, xp = _check_packed(input_ids, seq_starts, context, layout)
    w = _windows(ids, starts, ctx, layout, xp)
    per_layer = [_hash_layer(w, layout, li, xp) for li in range(layout.num_layers)]
    return np.stack(per_layer, axis=1) if xp is np else xp.stack(per_layer, dim=1)


def next_context(context: Any, input_ids: Any, seq_starts: Any) -> Any:
    """Each sequence's context after this step, ``[S, N-1]``: the last N-1 ids of its
    context followed by its tokens (a sequence with no token keeps its context)."""
    torch_in = _is_torch(context)
    ctx = np.asarray(_to_numpy(context), dtype=np.int64)
    ids = np.asarray(_to_numpy(input_ids), dtype=np.int64).reshape(-1)
    starts = np.asarray(_to_numpy(seq_starts), dtype=np.int64).reshape(-1)
    if (
        ctx.ndim != 2
        or starts.size != ctx.shape[0] + 1
        or starts[0] != 0
        or starts[-1] != ids.size
        or np.any(np.diff(starts) < 0)
    ):
        raise EngramError(
            f"next_context needs context [S, N-1] and seq_starts [S+1] rising from 0 to "
            f"len(input_ids)={ids.size} (got {ctx.shape}, {starts.size} starts)"
        )
    n = ctx.shape[1]
    if ids.size == ctx.shape[0] and np.all(np.diff(starts) == 1):  # a decode step: one token a sequence
        out = np.concatenate([ctx[:, 1:], ids.reshape(-1, 1)], axis=1) if n else ctx.copy()
    else:
        out = np.empty_like(ctx)
        for s in range(ctx.shape[0]):
            joined = np.concatenate([ctx[s], ids[starts[s] : starts[s + 1]]])
            out[s] = joined[joined.size - n :]
    if torch_in:
        import torch

        return torch.as_tensor(out, device=context.device)
    return out
