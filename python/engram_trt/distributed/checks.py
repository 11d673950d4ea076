"""Jobs that check a deployment's ranks (the CPU tests run them under gloo, the
several-GPU script under NCCL): the sharded lookup's rows, step by step, and several
prompt-serving jobs on one set of ranks.

The lookup check returns the rows the ranks gathered, as raw bf16 bits, so the caller
compares them with its own reference (the unsharded store's ``TableStore.rows``) bit
for bit; nothing here decides pass or fail.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class LookupCase:
    """One lookup group layout and its steps: ``steps[k][replica]`` is that replica's
    sequences in step k (lists of raw token ids; an empty list: the replica idles)."""

    tp: int
    dp: int
    scope: str  # 'tp' | 'world'
    steps: tuple[tuple[tuple[tuple[int, ...], ...], ...], ...]
    lookback_seed: int = 0


def case_lookback(case: LookupCase, step: int, replica: int, num_seqs: int, n: int, vocab: int) -> np.ndarray:
    """The lookback a replica's sequences carry in one step (some -1 = none): a function
    of the case alone, so the caller rebuilds it for its reference."""
    rng = np.random.default_rng((case.lookback_seed, step, replica))
    lb = rng.integers(0, vocab, size=(num_seqs, n), dtype=np.int64)
    lb[rng.random((num_seqs, n)) < 0.3] = -1
    return lb


def lookup_check(world_ctx: Any, path: str, cases: list[LookupCase], max_num_tokens: int = 64) -> list[Any]:
    """Per case, per rank: ``steps`` (per step the staged rows as uint16 bits ``[L, T,
    cols, D]``, or None where the rank idled), its ``shard``, lookup ``stats`` and the
    multicast variables it ran with (``env``). Rank 0 returns everything; the others None."""
    import torch
    import torch.distributed as dist

    from engram_trt.config.engram import EngramConfig
    from engram_trt.distributed.groups import NO_MULTICAST_ENV, RankContext
    from engram_trt.distributed.lookup import ShardedLookup
    from engram_trt.distributed.sharding import Topology
    from engram_trt.runtime.engine_folder import open_model_source
    from engram_trt.models.step import PackedStep

    src = open_model_source(path, progress=False)
    lookup_map = src.compress_lookup
    n = src.layout.max_ngram_size - 1
    results = []
    for case in cases:
        ctx = RankContext.create(world_ctx, Topology(case.tp, case.dp))
        lk = ShardedLookup.open(
            ctx,
            case.scope,
            src,
            device=ctx.device,
            max_num_tokens=max_num_tokens,
            engram_config=EngramConfig(),
            progress=False,
        )
        per_step = []
        try:
            for k, step_seqs in enumerate(case.steps):
                seqs = step_seqs[ctx.dp_rank]
                if not seqs:
                    lk.idle()
                    per_step.append(None)
                    continue
                step = PackedStep.from_sequences([list(s) for s in seqs])
                ids = step.input_ids.numpy()
                cids = lookup_map[ids]
                lb = case_lookback(case, k, ctx.dp_rank, len(seqs), n, src.layout.compressed_vocab_size)
                staged = lk.submit(step, cids, lb)
                rows = torch.stack([staged[i] for i in range(len(staged))]).cpu()
                per_step.append(rows.view(torch.int16).numpy().view(np.uint16).copy())
            shard = lk.shard.to_json()
        finally:
            lk.close()
        box: list[Any] = [None] * ctx.world if ctx.rank == 0 else []
        env = {k: os.environ.get(k) for k in NO_MULTICAST_ENV}
        dist.gather_object(
            {"steps": per_step, "shard": shard, "stats": dict(lk.stats), "env": env},
            box if ctx.rank == 0 else None,
            dst=0,
            group=world_ctx.side_group,
        )
        results.append(box)
    return results if world_ctx.rank == 0 else None  # type: ignore[return-value]


def replica_jobs(world_ctx: Any, jobs: list[Any]) -> list[Any]:
    """Several :class:`~engram_trt.distributed.launch.ReplicaJob`s on one set of ranks,
    one after another (the process group is made once)."""
    from engram_trt.distributed.launch import generate_replicas

    return [generate_replicas(world_ctx, job) for job in jobs]


def run_sequence(world_ctx: Any, calls: list[tuple[Any, tuple]]) -> list[Any]:
    """``fn(world_ctx, *args)`` for each ``(fn, args)`` in order, on one set of ranks
    (module-level functions: the spawned ranks import them)."""
    return [fn(world_ctx, *args) for fn, args in calls]
