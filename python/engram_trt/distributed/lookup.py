"""The sharded Engram lookup: the Prefetcher's contract (``submit(step, cids,
lookback) -> StagedRows``) over a rank's column slice of the tables, so
:class:`~engram_trt.runtime.runner.ModelRunner` uses it unchanged.

Each step, in one lookup group (a replica's TP ranks, or every rank with
``embedding_across_dp``):

1. The rank hashes its step's tokens (row ids ``[T, L, cols]``, global per table).
2. TP scope (every member holds the same tokens): nothing to exchange yet.
   World scope (replicas hold different tokens): the token counts are all-gathered,
   every replica pads to the common count P (:func:`~.sharding.pad_token_count`: a
   power of two, so shapes take few values), and the padded row ids are all-gathered
   on the CPU group. A replica with no work this step sends zero tokens, padded: it
   still takes part, so every rank calls the same collectives.
3. The rank gathers its own columns (rows of its slice: ``global - row_begin[l]``) for
   the tokens of every replica in the group.
4. The rows go to the ranks that need them: all-gathered (TP scope) or all-to-all
   (world scope: chunk d of the input holds the rows for member d's replica), as
   bytes, on the data group (NCCL on GPUs, gloo on CPU).
5. Received chunk s fills columns ``col_ranges[s]`` of the staging buffers
   ``[L, max_tokens, cols, head_dim]`` bf16 (fixed addresses); ``StagedRows`` hands
   out per layer ``[T, cols, head_dim]`` views, exactly what the unsharded lookup gives.

The lookup runs synchronously on the calling thread: its collectives then come in the
one order every rank shares (the scheduler's step order). On a GPU the gather and the
exchange are enqueued on the current stream, so the host does not wait for them
(except the host gather's own copies).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import numpy as np
import torch

from engram_trt.distributed.groups import RankContext, all_gather_flat, all_to_all_flat
from engram_trt.distributed.sharding import (
    ExchangePlan,
    exchange_plan,
    local_row_ids,
    pad_row_ids,
    pad_token_count,
    shard_columns,
    slice_table_refs,
)
from engram_trt.engram.hashing import hash_batch_packed
from engram_trt.engram.layout import EngramLayout
from engram_trt.errors import EngramError
from engram_trt.runtime.staged_rows import StagedRows
from engram_trt.tables.base import TableStore

log = logging.getLogger(__name__)


def usable_table_kind(kind: str) -> str:
    """``kind``, or plain host memory where its store is not part of this installation
    (the pinned store is written separately; the host gather reads any host memory)."""
    import importlib.util

    module = {"pinned": "engram_trt.tables.pinned", "shared": "engram_trt.tables.shared"}.get(kind)
    if module is not None and importlib.util.find_spec(module) is None:
        log.warning(
            "the %s table store (%s) is not part of this installation: "
            "this rank's table slice goes to private host memory",
            kind,
            module,
        )
        return "memory"
    return kind


class ShardedLookup:
    """See the module docstring. ``tables`` holds only this rank's slice (None when the
    rank owns no columns); ``control_group`` carries counts and row ids (gloo, CPU
    tensors), ``data_group`` the rows (on ``device``)."""

    def __init__(
        self,
        layout: EngramLayout,
        plan: ExchangePlan,
        tables: TableStore | None,
        *,
        device: Any,
        max_tokens: int,
        head_dim: int,
        control_group: Any,
        data_group: Any,
        full_table_bytes: int = 0,
    ) -> None:
        self.layout = layout
        self.plan = plan
        self.shard = shard_columns(layout, plan.me, plan.size)
        self.tables = tables
        self.device = torch.device(device)
        self.max_tokens = int(max_tokens)
        self.head_dim = int(head_dim)
        self.cols = layout.n_hash_cols
        self.control_group = control_group
        self.data_group = data_group
        self.full_table_bytes = int(full_table_bytes)
        self.cuda = self.device.type == "cuda"
        if (tables is None) != self.shard.is_empty:
            raise EngramError(
                f"internal: rank {plan.me} owns columns {self.shard.col_begin}..{self.shard.col_end} "
                f"but its table slice is {tables!r}"
            )
        if tables is not None:
            for li in range(layout.num_layers):
                if tables.num_rows(li) != self.shard.num_rows(li) or tables.head_dim(li) != self.head_dim:
                    raise EngramError(
                        f"internal: the table slice of layer {li} is {tables.num_rows(li)} x {tables.head_dim(li)}, "
                        f"the shard needs {self.shard.num_rows(li)} x {self.head_dim}"
                    )
        L = layout.num_layers
        self.staging = torch.empty(
            (L, self.max_tokens, self.cols, self.head_dim), dtype=torch.bfloat16, device=self.device
        )
        self.path = self._gather_path()
        self.table_kind = "none" if tables is None else tables.kind
        self.timing = False  # the Prefetcher's flag; no side-stream events here
        self.stats: dict[str, Any] = {
            "steps": 0,
            "idle_steps": 0,
            "rows": 0,
            "bytes_from_host": 0,
            "lookup_s": 0.0,
            "exchange_s": 0.0,
            "exchange_bytes": 0,
            "pad_tokens": 0,
            "paths": {},
        }
        self._kernels = None
        self._hostgather = None
        if self.cuda and tables is not None:
            from engram_trt.native import gather as gather_kernels
            from engram_trt.native import hostgather

            self._kernels = gather_kernels
            self._hostgather = hostgather

    # -- construction ------------------------------------------------------------------
    @classmethod
    def factory(cls, ctx: RankContext, scope: str) -> Callable[..., "ShardedLookup"]:
        """What :class:`~engram_trt.runtime.runner.ModelRunner` takes as ``engram_lookup``:
        opens this rank's slice of the source's tables (only its byte range of each file)
        in the store ``--engram-config`` picks, and builds the lookup over it."""

        def make(
            *,
            source: Any,
            device: Any,
            max_num_tokens: int,
            engram_config: Any,
            progress: bool = True,
            table_options: dict[str, Any] | None = None,
        ) -> "ShardedLookup":
            return cls.open(
                ctx,
                scope,
                source,
                device=device,
                max_num_tokens=max_num_tokens,
                engram_config=engram_config,
                progress=progress,
                table_options=table_options,
            )

        return make

    @classmethod
    def open(
        cls,
        ctx: RankContext,
        scope: str,
        source: Any,
        *,
        device: Any,
        max_num_tokens: int,
        engram_config: Any,
        progress: bool = True,
        table_options: dict[str, Any] | None = None,
    ) -> "ShardedLookup":
        from engram_trt.tables.store import open_tables, table_kind_for

        layout = source.layout
        spec = source.config.require_engram("sharding the Engram lookup")
        plan = exchange_plan(ctx.topology, ctx.rank, scope, layout.n_hash_cols)
        shard = shard_columns(layout, plan.me, plan.size)
        device = torch.device(device)
        kind = usable_table_kind(table_kind_for(engram_config, device))
        tables = None
        if not shard.is_empty:
            refs = slice_table_refs(source.table_refs, shard)
            tables = open_tables(
                refs, kind, quant_block=spec.quant_block, device=device, progress=progress, **(table_options or {})
            )
        else:
            log.warning(
                "rank %d owns no hash columns (%d columns over %d ranks): it holds no table rows",
                ctx.rank,
                layout.n_hash_cols,
                plan.size,
            )
        control, data = ctx.groups(scope)
        full = sum(r.nbytes for r in source.table_refs)
        lookup = cls(
            layout,
            plan,
            tables,
            device=device,
            max_tokens=max_num_tokens,
            head_dim=spec.head_dim,
            control_group=control,
            data_group=data,
            full_table_bytes=full,
        )
        log.info(
            "rank %d: Engram columns %d..%d of %d (%s scope, %d ranks), %.1f MiB of %.1f MiB of tables in %s",
            ctx.rank,
            shard.col_begin,
            shard.col_end,
            layout.n_hash_cols,
            scope,
            plan.size,
            (0 if tables is None else tables.table_bytes()) / 2**20,
            full / 2**20,
            lookup.table_kind,
        )
        return lookup

    def _gather_path(self) -> str:
        if not self.cuda:
            return "reference"
        if self.tables is not None and self.tables.on_device:
            return "device"
        return "host"

    # -- the Prefetcher's contract ------------------------------------------------------
    def submit(self, step: Any, cids: np.ndarray, lookback: np.ndarray) -> StagedRows:
        """Rows of ``step`` (``[T, cols, head_dim]`` per Engram layer), gathered by the
        group; every member must call this (or :meth:`idle`) for the same step."""
        T = step.num_tokens
        if T > self.max_tokens:
            raise EngramError(
                f"a step of {T} tokens exceeds the staging buffers' {self.max_tokens} tokens (max_num_tokens)"
            )
        ids = hash_batch_packed(cids, step.seq_starts, lookback, self.layout)
        info = self._exchange(ids, T)
        return StagedRows([self.staging[li, :T] for li in range(self.layout.num_layers)], info=info)

    def idle(self) -> None:
        """Take part in a step of the group with no tokens of this rank's own (a replica
        with no work still serves its columns to the others)."""
        if not self.plan.exchanges_ids:
            raise EngramError("internal: TP peers hold the same tokens, so none of them idles while another steps")
        self._exchange(None, 0)
        self.stats["idle_steps"] += 1

    # -- the exchange ----------------------------------------------------------------------
    def _exchange(self, ids: np.ndarray | None, T: int) -> dict[str, Any]:
        plan, L = self.plan, self.layout.num_layers
        t0 = time.perf_counter()
        if plan.exchanges_ids:
            counts = torch.empty(plan.size, dtype=torch.int64)
            all_gather_flat(counts, torch.tensor([T], dtype=torch.int64), self.control_group)
            P = pad_token_count(int(counts[list(plan.requesters)].max()), self.max_tokens)
            if P == 0:
                return {"path": self.path, "rows": 0, "pad_tokens": 0}
            mine = torch.from_numpy(pad_row_ids(ids, P, self.layout)).reshape(-1)
            everyone = torch.empty(plan.size * mine.numel(), dtype=torch.int32)
            all_gather_flat(everyone, mine, self.control_group)
            req = everyone.view(plan.size, P, L, self.cols).numpy()[list(plan.requesters)]  # [R, P, L, cols]
        else:
            P = T
            if T == 0:
                return {"path": self.path, "rows": 0, "pad_tokens": 0}
            req = np.asarray(ids, dtype=np.int32)[None]
        t1 = time.perf_counter()
        rows = self._gather(local_row_ids(req, self.shard), P)  # [R, L, P, chunk, D] bf16 on the device
        t2 = time.perf_counter()
        chunk = plan.chunk_cols
        if plan.exchanges_ids:
            send = rows.index_select(0, torch.tensor(plan.send_order(), dtype=torch.int64, device=rows.device))
            recv = torch.empty_like(send)
            all_to_all_flat(recv.view(-1).view(torch.uint8), send.view(-1).view(torch.uint8), self.data_group)
        else:
            send = rows[0]
            recv = torch.empty((plan.size, *send.shape), dtype=send.dtype, device=send.device)
            all_gather_flat(recv.view(-1).view(torch.uint8), send.reshape(-1).view(torch.uint8), self.data_group)
        recv = recv.view(plan.size, L, P, chunk, self.head_dim)
        for s, b, e in plan.assemble_order():
            self.staging[:, :T, b:e].copy_(recv[s, :, :T, : e - b])
        t3 = time.perf_counter()
        gathered = int(req.shape[0]) * P * self.shard.num_cols * L
        info = {
            "path": self.path,
            "rows": gathered,
            "pad_tokens": P - T,
            "exchange": "all_to_all" if plan.exchanges_ids else "all_gather",
        }
        st = self.stats
        st["steps"] += 1
        st["rows"] += gathered
        st["pad_tokens"] += P - T
        st["lookup_s"] += t2 - t1
        st["exchange_s"] += (t1 - t0) + (t3 - t2)
        st["exchange_bytes"] += send.numel() * send.element_size()
        if self.path == "host" and self.tables is not None:
            st["bytes_from_host"] += gathered * self._row_bytes()
        st["paths"][self.path] = st["paths"].get(self.path, 0) + 1
        return info

    def _gather(self, local: np.ndarray, P: int) -> torch.Tensor:
        """This rank's columns for the requesters' tokens: ``local [R, P, L, ncols]``
        (rows of the slice) -> bf16 ``[R, L, P, chunk, D]`` on the device; columns past
        ``ncols`` (a narrower rank's padding) are left unwritten and never read."""
        R, L, nc = local.shape[0], self.layout.num_layers, self.shard.num_cols
        out = torch.empty((R, L, P, self.plan.chunk_cols, self.head_dim), dtype=torch.bfloat16, device=self.device)
        if self.tables is None:
            return out
        for li in range(L):
            ids = torch.from_numpy(np.ascontiguousarray(local[:, :, li, :]).reshape(R * P, nc))
            if self.path == "reference":
                got = self.tables.rows(li, ids)
            else:
                rows, scales = self.tables.tensors(li)
                qb = self.tables.quant_block
                assert self._kernels is not None
                if self.path == "device":
                    got = self._kernels.gather(
                        ids.to(torch.int32).to(self.device, non_blocking=True), rows, scales, quant_block=qb
                    )
                else:
                    got = self._hostgather.host_gather(
                        ids.to(torch.int32), rows, scales, quant_block=qb, device=self.device
                    )
            out[:, li, :, :nc].copy_(got.view(R, P, nc, self.head_dim))
        return out

    def _row_bytes(self) -> int:
        assert self.tables is not None
        rows, scales = self.tables.tensors(0)
        return rows.shape[1] * rows.element_size() + (0 if scales is None else scales.shape[1])

    # -- what it is ---------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """Where this rank's slice lives (the runner's ``storage()``)."""
        t = self.tables
        base = (
            t.describe()
            if t is not None
            else {
                "kind": "none",
                "where": "no rows (this rank owns no columns)",
                "gpu_readable": False,
                "table_bytes": 0,
                "resident_bytes": 0,
            }
        )
        base.pop("layers", None)
        base["where"] = (
            f"{base['where']}; columns {self.shard.col_begin}..{self.shard.col_end} of {self.cols} "
            f"(rank {self.plan.me} of {self.plan.size})"
        )
        base.update(
            sharded=True,
            scope="world" if self.plan.exchanges_ids else "tp",
            shard=self.shard.to_json(),
            full_table_bytes=self.full_table_bytes,
            gather_path=self.path,
        )
        return base

    def close(self) -> None:
        if self.tables is not None:
            self.tables.close()
            self.tables = None
