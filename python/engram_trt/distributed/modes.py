"""Which way the ranks hold the Engram tables, chosen once before anything loads.

Two questions, answered separately:

* Within a replica (``--tp N``): the lookup is always sharded over the TP ranks
  (each holds its column range's rows, the rows are all-gathered each step).
* Across replicas (``--dp M``): ``embedding_across_dp`` shards the columns over all
  TP x DP ranks (one copy in total; per step, the replicas' row ids are all-gathered
  and the rows come back all-to-all), ``dp_shared_memory`` gives every replica's TP
  rank t the same ``/dev/shm`` segment of slice t (one copy per node, no per-step
  collective), otherwise each replica holds a private copy.

What the user asked for is honoured where it can run; where it cannot, a warning says
why and what runs instead, preferring whatever still keeps one copy: a shared store
that is missing or has no directory falls back to ``embedding_across_dp``; a backend
that gathers inside the engine (it cannot take a sharded lookup's rows) falls back to
``dp_shared_memory``, then private copies; one rank has nothing to shard.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from engram_trt.config.engram import EngramConfig
from engram_trt.distributed.sharding import Topology
from engram_trt.errors import EngramError

log = logging.getLogger(__name__)

DP_MODES = ("single", "embedding_across_dp", "dp_shared_memory", "private")
SHM_DIR = Path("/dev/shm")


@dataclass(frozen=True)
class TableSharing:
    """The choice: ``scope`` of the sharded lookup (None: each rank holds whole tables,
    ``'tp'``: the replica's TP ranks, ``'world'``: every rank), how replicas share
    (``dp_mode``), the ``engram_config`` each rank's runner gets, why, and the
    warnings of any fallback."""

    scope: str | None
    dp_mode: str
    engram_config: EngramConfig
    reason: str
    warnings: tuple[str, ...] = ()

    @property
    def lockstep(self) -> bool:
        """Ranks must step together (a per-step collective): any sharded lookup."""
        return self.scope is not None

    def copies(self, topology: Topology) -> int:
        """Table copies in host (or GPU) memory across the ranks of one node."""
        return topology.dp if self.dp_mode == "private" else 1

    def to_json(self) -> dict[str, Any]:
        return {"scope": self.scope, "dp_mode": self.dp_mode, "reason": self.reason, "warnings": list(self.warnings)}


def shared_store_problem(directory: str | Path | None = None) -> str | None:
    """Why the shared store cannot be used here, or None."""
    if importlib.util.find_spec("engram_trt.tables.shared") is None:
        return "the shared table store (engram_trt.tables.shared) is not part of this installation"
    d = Path(directory) if directory is not None else SHM_DIR
    if not d.is_dir():
        return f"{d} does not exist (no shared memory filesystem here)"
    if not os.access(d, os.W_OK | os.X_OK):
        return f"{d} is not writable by this user"
    return None


def choose_table_sharing(
    cfg: EngramConfig, topology: Topology, *, staged_rows_ok: bool = True, shared_problem: str | None = None
) -> TableSharing:
    """See the module docstring. ``staged_rows_ok``: the backend takes rows staged by
    the runtime (torch, or an engine built with ``table_placement prefetch``);
    ``shared_problem``: :func:`shared_store_problem`'s answer."""
    tp, dp, world = topology.tp, topology.dp, topology.world
    warns: list[str] = []
    if tp > 1 and not staged_rows_ok:
        raise EngramError(
            f"--tp {tp} shards the Engram lookup over the TP ranks, but this engine gathers the rows inside itself "
            "from whole tables (table_placement in_engine); use --backend torch, or build the engine with "
            "--engram-config.table_placement prefetch"
        )
    if world == 1:
        if cfg.embedding_across_dp:
            warns.append(
                "embedding_across_dp: a single rank has no other rank to shard the tables with; it holds them whole"
            )
        return _finish(TableSharing(None, "single", replace(cfg, embedding_across_dp=False), "one rank", tuple(warns)))

    want = (
        "embedding_across_dp" if cfg.embedding_across_dp else "dp_shared_memory" if cfg.dp_shared_memory else "private"
    )
    mode = want
    if mode == "embedding_across_dp" and not staged_rows_ok:
        shared_ok = shared_problem is None and cfg.cpu_offload  # a shared copy lives in host memory
        alt = "dp_shared_memory" if shared_ok else "private copies"
        warns.append(
            "embedding_across_dp: this engine gathers the rows inside itself from whole tables (table_placement "
            f"in_engine), so the columns cannot be sharded across ranks; using {alt} instead (build the engine "
            "with --engram-config.table_placement prefetch to shard)"
        )
        mode = "dp_shared_memory" if shared_ok else "private"
    if mode == "dp_shared_memory" and shared_problem is not None:
        if staged_rows_ok:
            warns.append(
                f"dp_shared_memory: {shared_problem}; sharding the columns across all {world} ranks instead "
                "(embedding_across_dp: still one table copy, at one exchange per step)"
            )
            mode = "embedding_across_dp"
        else:
            warns.append(f"dp_shared_memory: {shared_problem}; each of the {dp} replicas holds a private copy instead")
            mode = "private"

    if mode == "embedding_across_dp":
        ecfg = replace(cfg, embedding_across_dp=True, dp_shared_memory=False)
        scope = "world" if dp > 1 else "tp"
        reason = (
            f"hash columns sharded over all {world} ranks (tp {tp} x dp {dp}): one table copy in total, row ids "
            "all-gathered and rows sent back all-to-all each step"
            if dp > 1
            else f"hash columns sharded over the {tp} TP ranks: one table copy in total"
        )
        mode_out = "embedding_across_dp" if dp > 1 else "single"
    elif mode == "dp_shared_memory":
        ecfg = replace(cfg, dp_shared_memory=True, embedding_across_dp=False)
        scope = "tp" if tp > 1 else None
        reason = (
            f"the {dp} replicas attach one /dev/shm copy per node"
            + (f" (one segment per TP column slice, {tp} slices)" if tp > 1 else "")
            + "; no per-step collective across replicas"
        )
        mode_out = "dp_shared_memory" if dp > 1 else "single"
    else:
        ecfg = replace(cfg, dp_shared_memory=False, embedding_across_dp=False)
        scope = "tp" if tp > 1 else None
        reason = (
            f"each of the {dp} replicas holds a private copy ({dp} copies); --engram-config.embedding_across_dp true "
            "or dp_shared_memory true keeps one"
            if dp > 1
            else "one replica"
        )
        mode_out = "private" if dp > 1 else "single"
    if tp > 1 and mode != "embedding_across_dp":
        reason = f"hash columns sharded over the {tp} TP ranks of each replica; " + reason
    return _finish(TableSharing(scope, mode_out, ecfg, reason, tuple(warns)))


def _finish(sharing: TableSharing) -> TableSharing:
    sharing.engram_config.validate()
    return sharing


def log_choice(sharing: TableSharing, topology: Topology, rank: int) -> None:
    """Rank 0 says what runs (and every fallback); other ranks stay quiet."""
    if rank != 0:
        return
    for w in sharing.warnings:
        log.warning("%s", w)
    log.info("Engram tables over tp %d x dp %d: %s (%s)", topology.tp, topology.dp, sharing.dp_mode, sharing.reason)
