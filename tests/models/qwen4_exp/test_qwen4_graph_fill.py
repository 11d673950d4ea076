"""Qwen4ExpDecodeGraphs' host side of a replay: ``fill_host`` (NumPy writes into the pinned
buffer) against the torch form it replaces, field by field, and the context's advance
(``engram.ple_hash.next_context``'s one-token form) against the per-sequence rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engram_trt.engram.ple_hash import next_context
from engram_trt.models.qwen4_exp.graphs import fill_host


def torch_fill(
    host: torch.Tensor,
    ids: torch.Tensor,
    past: list[int],
    slots: list[int],
    context: torch.Tensor,
    scratch: int,
    eos: int,
) -> torch.Tensor:
    """The replay's former fill: the same layout written with torch CPU tensor ops."""
    S = ids.numel()
    host[:, S:] = 0
    host[2, S:] = scratch
    host[3:, S:] = eos
    host[0, :S] = ids
    host[1, :S] = torch.tensor(past, dtype=torch.int64)
    host[2, :S] = torch.tensor(slots, dtype=torch.int64)
    ctx = context[torch.tensor(slots, dtype=torch.int64)]
    if host.shape[0] > 3:
        host[3:, :S] = ctx.t()
    return ctx


@pytest.mark.parametrize("n_ctx", [0, 1, 2, 3])
@pytest.mark.parametrize(("S", "G"), [(1, 1), (3, 4), (5, 8), (8, 8)])
def test_fill_host_writes_what_the_torch_fill_wrote(n_ctx: int, S: int, G: int) -> None:
    rng = np.random.default_rng(100 * n_ctx + 10 * S + G)
    slots_n, scratch, eos = 11, 10, 2
    context = torch.from_numpy(rng.integers(0, 500, size=(slots_n, n_ctx)).astype(np.int64))
    slots = [int(s) for s in rng.choice(scratch, size=S, replace=False)]
    past = [int(p) for p in rng.integers(1, 900, size=S)]
    ids = torch.from_numpy(rng.integers(0, 1000, size=S).astype(np.int64))
    # both buffers start from the same stale step (a wider one before), as a reused bucket does
    stale = rng.integers(0, 7, size=(3 + n_ctx, G)).astype(np.int64)
    want, got = torch.from_numpy(stale.copy()), stale.copy()
    ctx_want = torch_fill(want, ids, past, slots, context.clone(), scratch, eos)
    ctx_got = fill_host(got, ids.numpy(), past, slots, context.numpy().copy(), scratch, eos)
    np.testing.assert_array_equal(got, want.numpy())
    np.testing.assert_array_equal(ctx_got, ctx_want.numpy())
    assert got[2, S:].tolist() == [scratch] * (G - S) and got[0, :S].tolist() == ids.tolist()


def _loop_context(ctx: np.ndarray, ids: np.ndarray, starts: list[int]) -> np.ndarray:
    """next_context's rule spelled per sequence: its last N-1 ids after its tokens."""
    n = ctx.shape[1]
    out = np.empty_like(ctx)
    for s in range(ctx.shape[0]):
        joined = np.concatenate([ctx[s], ids[starts[s] : starts[s + 1]]])
        out[s] = joined[joined.size - n :]
    return out


@pytest.mark.parametrize("n_ctx", [0, 1, 3])
def test_next_context_of_a_one_token_step(n_ctx: int) -> None:
    """The decode step's advance (next_context's one-token form, which the graphs' replay
    takes) equals the per-sequence rule; a step with a longer chunk takes the loop."""
    rng = np.random.default_rng(7 + n_ctx)
    context = rng.integers(0, 500, size=(9, n_ctx)).astype(np.int64)
    slots = [4, 0, 7]
    ids = np.array([901, 902, 903], dtype=np.int64)
    ctx = context[slots].copy()
    got = next_context(ctx, ids, [0, 1, 2, 3])
    np.testing.assert_array_equal(got, _loop_context(ctx, ids, [0, 1, 2, 3]))
    assert got.shape == (3, n_ctx)
    if n_ctx:
        assert got[:, -1].tolist() == ids.tolist()
    chunk = np.array([901, 905, 906, 902, 903], dtype=np.int64)
    np.testing.assert_array_equal(next_context(ctx, chunk, [0, 3, 4, 5]), _loop_context(ctx, chunk, [0, 3, 4, 5]))
    torch_in = next_context(torch.from_numpy(ctx), torch.from_numpy(ids), [0, 1, 2, 3])
    assert isinstance(torch_in, torch.Tensor) and torch_in.numpy().tolist() == got.tolist()
