"""The hot-row cache in front of a table store's layers: :class:`CachedStoreGather`,
the interface of :class:`~engram_trt.tables.rowgather.StoreGather` (``paths``,
``gather``, ``check_bad_rows``, ``close``) with one :class:`~.hotcache.HotRowCache`
per layer whose rows live in host memory.

Why: a model that gathers its own rows in the step (Qwen4Exp's PLE) reads them from
the store through :class:`StoreGather` (the host gather, or UVA), every lookup crossing
the link. Its n-gram lookups are skewed as Engram's are, so the same cache serves them:
each step's distinct rows once, the frequent ones from HBM, only the misses from the
host. ``--engram-config.hot_cache_fraction`` turns it on for the PLE tables
(:mod:`engram_trt.models.qwen4_exp.ple_tables`).

Which layers (``paths[i] == "cache"``): a table in host memory (memory, pinned, shared,
file stores; a device store's rows are in HBM already and keep their path) of bf16 /
f16 / f32 rows (or FP8 rows with scales). On a CUDA device the rows must be whole
16-byte vectors (the host gather and the gather kernel copy those), else the layer
keeps its store path (logged). A table in several regions in place (a file store over
shards that are not one byte range) is fetched by :class:`PartsTransfer` (torch reads
per region) instead of the host gather.

The checks are :class:`StoreGather`'s: ``checked`` gathers refuse an id outside the
table before the step (one line naming the layer); unchecked ones (ids a hash made for
this table, on the GPU: no host read) send such an id to the cache's sentinel row, a
zero row, and :meth:`check_bad_rows` reads the sentinel's lookup count (the policy
counts every lookup, so no counter of its own; ``decay_every`` is refused, as halving
the counts could lose that signal).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from engram_trt.cache.hotcache import DEFAULT_CAPACITY_FRACTION, HotRowCache, as_words, float_row_dtypes
from engram_trt.errors import EngramError
from engram_trt.tables.base import TableStore
from engram_trt.tables.rowgather import StoreGather

log = logging.getLogger(__name__)

# Lookups one cache step takes: a larger step is served in several (rows are the same).
# Why not the cache's MAX_STEP_ROWS (196,608): the work table's miss area and the fused
# plan's buffers are sized by it per layer, and a PLE step is tokens x heads lookups.
DEFAULT_STEP_ROWS = 65536


def cache_skip_reason(store: TableStore, layer_idx: int, device: torch.device) -> str | None:
    """Why layer ``layer_idx`` of ``store`` is not cached on ``device`` (None: it is)."""
    if store.on_device:
        return "its rows are in GPU memory already"
    dtype = store.row_dtype(layer_idx)
    fp8 = store.is_fp8(layer_idx)
    if not fp8 and dtype not in float_row_dtypes():
        return f"its rows are {dtype} (the cache serves bf16 / f16 / f32 rows, or FP8 with scales)"
    row_bytes = store.head_dim(layer_idx) * (1 if fp8 else dtype.itemsize)
    if device.type == "cuda" and row_bytes % 16:
        return (
            f"its {row_bytes}-byte rows are not whole 16-byte vectors (what the host gather and the gather kernel copy)"
        )
    return None


class PartsTransfer:
    """A cache's transfer for a table in several regions in place (the file store over
    shards that are not one byte range): misses read per region by torch indexing on the
    host (:meth:`TableStore.rows`), then copied to the work table; delivery by torch
    indexing of the work table. Out-of-range ids (the sentinel row) are zero rows."""

    def __init__(self, store: TableStore, layer_idx: int) -> None:
        self.store, self.layer_idx = store, layer_idx
        self.num_rows = store.num_rows(layer_idx)

    def prepare(self) -> None:
        pass

    def fetch(self, ids_cpu: Any, dst_rows: Any, dst_scales: Any, ids_dev: Any = None) -> None:
        ids = ids_cpu.to(torch.int64)
        valid = (ids >= 0) & (ids < self.num_rows)
        rows = self.store.rows(self.layer_idx, ids.clamp(0, max(self.num_rows - 1, 0)))
        rows = torch.where(valid[:, None], rows, torch.zeros_like(rows))
        dst_rows[: ids.shape[0]].copy_(as_words(rows))

    def deliver(self, positions: Any, work_rows: Any, work_scales: Any, out: Any) -> Any:
        rows = work_rows.index_select(0, positions.reshape(-1).to(torch.int64)).view(*positions.shape, -1)
        if out is None:
            return rows
        out.copy_(rows)
        return out


class CachedStoreGather:
    """Rows of ``store``'s layers on ``device``, cached layers through a
    :class:`HotRowCache` each (module docstring), the others by :class:`StoreGather`.

    ``capacity_fraction``: cached rows / table rows per layer; ``max_step_rows``: the
    lookups of one cache step (larger gathers are served in several steps);
    ``cache_options``: further :class:`HotRowCache` arguments (``admit_budget``,
    ``sample_factor``, ``admit_every``, ``seed``, ``fused``, ``whole_step``, ...)."""

    def __init__(
        self,
        store: TableStore,
        device: Any = "cpu",
        *,
        capacity_fraction: float = DEFAULT_CAPACITY_FRACTION,
        max_step_rows: int = DEFAULT_STEP_ROWS,
        **cache_options: Any,
    ) -> None:
        if not 0.0 <= capacity_fraction <= 1.0:
            raise EngramError(f"capacity_fraction must be in [0, 1] (got {capacity_fraction})")
        if cache_options.get("decay_every"):
            raise EngramError(
                "decay_every is not offered for a store's cache: halving the counts could hide the "
                "bad-id count check_bad_rows reads; leave it 0"
            )
        for key in ("transfer", "gatherer", "layout", "quant_block", "device", "capacity_rows"):
            if key in cache_options:
                raise EngramError(f"{key} is set by the store's cache itself; drop it from the cache options")
        self.store = store
        self.device = torch.device(device)
        self.plain = StoreGather(store, self.device)  # the layers that are not cached
        self.max_step_rows = int(max_step_rows)
        if self.max_step_rows < 1:
            raise EngramError(f"max_step_rows must be >= 1 (got {max_step_rows})")
        self._gatherer: Any = None
        self.caches: list[HotRowCache | None] = []
        self.paths: list[str] = []
        for i in range(store.num_layers):
            why = cache_skip_reason(store, i, self.device)
            if why is not None:
                log.info("hot-row cache: layer %d keeps the %s path: %s", i, self.plain.paths[i], why)
                self.caches.append(None)
                self.paths.append(self.plain.paths[i])
                continue
            self.caches.append(self._cache_for(i, capacity_fraction, cache_options))
            self.paths.append("cache")

    def _cache_for(self, layer_idx: int, fraction: float, options: dict[str, Any]) -> HotRowCache:
        store = self.store
        common = dict(
            device=self.device,
            capacity_rows=int(fraction * store.num_rows(layer_idx)),
            quant_block=store.quant_block,
            max_step_rows=self.max_step_rows,
            **options,
        )
        if len(store.regions(layer_idx)) > 1:
            return self._parted_cache(layer_idx, common)
        rows, scales = store.tensors(layer_idx)
        gatherer = self._host_gatherer() if self.device.type == "cuda" else None
        return HotRowCache(rows, scales, gatherer=gatherer, **common)

    def _parted_cache(self, layer_idx: int, common: dict[str, Any]) -> HotRowCache:
        """A cache over a table in several regions: its shape and dtype from a meta
        tensor (no memory; the cache reads ``rows_host`` only for them when a transfer
        is given), its rows by :class:`PartsTransfer`."""
        store = self.store
        shape = (store.num_rows(layer_idx), store.head_dim(layer_idx))
        stand_in = torch.empty(shape, dtype=store.row_dtype(layer_idx), device="meta")
        return HotRowCache(stand_in, None, transfer=PartsTransfer(store, layer_idx), **common)

    def _host_gatherer(self) -> Any:
        if self._gatherer is None:
            from engram_trt.native.hostgather import HostGatherer

            widest = 0
            for i in range(self.store.num_layers):
                item = 1 if self.store.is_fp8(i) else self.store.row_dtype(i).itemsize
                widest = max(widest, self.store.head_dim(i) * item // (1 if self.store.is_fp8(i) else 2))
            self._gatherer = HostGatherer(max_head_dim=max(512, -(-widest // 8) * 8), device=self.device)
        return self._gatherer

    # -- the StoreGather interface ---------------------------------------------------
    def gather(
        self, layer_idx: int, ids: torch.Tensor, checked: bool = True, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Rows ``ids`` (int, any shape) of layer ``layer_idx``: ``[*ids.shape, head_dim]``
        on this gather's device, in the stored dtype (FP8 dequantized to bf16), the same
        bytes as :meth:`StoreGather.gather`. ``checked`` as there (False: a bad id reads
        a zero row and is counted for :meth:`check_bad_rows`); ``out``: rows written
        there (``[n, ..., head_dim]`` in the rows' dtype)."""
        cache = self.caches[layer_idx]
        if cache is None:
            return self.plain.gather(layer_idx, ids, checked=checked, out=out)
        flat = ids.reshape(-1)
        if checked or not flat.is_cuda:
            self.plain._check_ids(layer_idx, flat)
        flat = flat.to(torch.int32)
        n, width = int(flat.numel()), cache.width
        if out is None:
            out = torch.empty((n, width), dtype=cache.row_dtype, device=self.device)
        elif out.numel() != n * width or out.dtype != cache.row_dtype or out.device != self.device:
            raise EngramError(
                f"out must hold {n} x {width} {cache.row_dtype} on {self.device} "
                f"(got {out.dtype} {tuple(out.shape)} on {out.device})"
            )
        rows = out.view(n, width)
        for a in range(0, n, self.max_step_rows):
            b = min(n, a + self.max_step_rows)
            cache.gather(flat[a:b], out=rows[a:b])
        return out.view(*ids.shape, width)

    def check_bad_rows(self) -> None:
        """Raise when a gather met an id outside its table: the plain path's GPU count,
        and each cache's sentinel-row lookups (a small device read: a sync)."""
        self.plain.check_bad_rows()
        for i, cache in enumerate(self.caches):
            if cache is None:
                continue
            bad = int(cache.policy.counts[cache.policy.sentinel])
            if bad:
                raise EngramError(
                    f"{bad} gathered row id(s) were outside table {i}: the table does not cover the "
                    f"hash layout (rows read as zeros)"
                )

    def stats(self) -> list[dict[str, Any] | None]:
        """Per layer, its cache's counters (:class:`~.hotcache.CacheStats` as a dict), or None."""
        return [None if c is None else c.stats().to_dict() for c in self.caches]

    def device_bytes(self) -> int:
        """Device memory the caches hold (work tables, maps, plan buffers)."""
        return sum(c.device_bytes() for c in self.caches if c is not None)

    def close(self) -> None:
        """Release the caches' step calls, the host gatherer and the plain path's (the
        store is its owner's to close)."""
        for cache in self.caches:
            if cache is not None:
                cache.close()
        self.plain.close()
        if self._gatherer is not None:
            self._gatherer.close()
            self._gatherer = None
