"""Qwen4ExpDecodeGraphs' host side of a replay: ``fill_host`` / ``advance_context`` (NumPy
writes into the pinned buffer) against the torch form they replace, field by field, and
the context's advance against ``engram.ple_hash.next_context`` (the reference of the
PLE hash's n-gram context)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engram_trt.engram.ple_hash import next_context
from engram_trt.models.qwen4_exp.graphs import advance_context, fill_host


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


@pytest.mark.parametrize("n_ctx", [0, 1, 3])
def test_advance_context_is_next_context_of_a_one_token_step(n_ctx: int) -> None:
    rng = np.random.default_rng(7 + n_ctx)
    context = rng.integers(0, 500, size=(9, n_ctx)).astype(np.int64)
    slots = [4, 0, 7]
    ids = np.array([901, 902, 903], dtype=np.int64)
    ctx = context[slots].copy()
    want = context.copy()
    want[slots] = next_context(ctx, ids, [0, 1, 2, 3])
    untouched = [s for s in range(9) if s not in slots]
    before = context[untouched].copy()
    advance_context(context, slots, ctx, ids)
    np.testing.assert_array_equal(context, want)
    np.testing.assert_array_equal(context[untouched], before)
    if n_ctx:
        assert context[slots, -1].tolist() == ids.tolist()
