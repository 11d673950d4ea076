"""Rows of a table store's layers on the model's device, by the path the store's memory
allows: what a model that gathers its own rows in the step (Qwen4Exp's PLE) uses, so
its tables live in any of the five stores.

Paths, per layer (chosen once, at bind; :attr:`StoreGather.paths` says which):

* ``reference``: :meth:`TableStore.rows` (torch indexing). On a CPU always; on a GPU for
  rows no kernel reads (f16 / f32 rows, as a checkpoint saved in those dtypes holds, or
  a width that is not a multiple of 8), and for a device store's tables that are not
  bf16 / FP8.
* ``kernel``: :func:`engram_trt.native.gather.gather`, the GPU reading the rows in
  place: GPU memory (``device``) or registered host memory through UVA (``pinned``,
  ``shared`` registered).
* ``host``: :class:`~engram_trt.native.hostgather.HostGatherer`, CPU threads gathering
  into pinned staging and one copy per chunk: host memory the GPU cannot read
  (``file`` maps, ``memory``). A table in several regions in place (a file store over
  ``split_ngram_parts`` shards that are not one row-ordered byte range) is gathered
  region by region (a region: a file's run of back-to-back shards, whatever their
  order), each region's ids in one call, scattered into the output on the GPU.

Every path checks the ids against the table first (an id outside it is a hash / table
mismatch: one line naming the layer), so the kernels' zero rows for bad ids never
reach a model silently.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from engram_trt.errors import EngramError
from engram_trt.tables.base import TableStore

log = logging.getLogger(__name__)

GATHER_PATHS = ("reference", "kernel", "host")
_KERNEL_DTYPES = (torch.bfloat16, torch.uint8)


def gather_path(store: TableStore, layer_idx: int, device: torch.device) -> str:
    """The path (module docstring) for one layer of ``store`` read on ``device``."""
    if device.type != "cuda":
        return "reference"
    if store.row_dtype(layer_idx) not in _KERNEL_DTYPES or store.head_dim(layer_idx) % 8:
        return "reference"
    if store.gpu_readable and len(store.regions(layer_idx)) == 1:
        return "kernel"
    if not store.on_device:
        return "host"
    return "reference"


class StoreGather:
    """Gathers rows of ``store``'s layers onto ``device`` (see the module docstring)."""

    def __init__(self, store: TableStore, device: Any = "cpu") -> None:
        self.store = store
        self.device = torch.device(device)
        self.paths = [gather_path(store, i, self.device) for i in range(store.num_layers)]
        self._gatherer: Any = None
        self._bad: torch.Tensor | None = None  # kernel-path bad-id count on the GPU (check_bad_rows)
        log.debug("row gather over the %s store on %s: %s", store.kind, self.device, self.paths)

    def _check_ids(self, layer_idx: int, flat: torch.Tensor) -> None:
        n = self.store.num_rows(layer_idx)
        if flat.numel():
            lo, hi = int(flat.min()), int(flat.max())
            if lo < 0 or hi >= n:
                raise EngramError(
                    f"row id {lo if lo < 0 else hi} is outside table {layer_idx} (rows 0..{n - 1}): "
                    f"the table does not cover the hash layout"
                )

    def gather(
        self, layer_idx: int, ids: torch.Tensor, checked: bool = True, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Rows ``ids`` (int, any shape) of layer ``layer_idx``: ``[*ids.shape, head_dim]``
        on this gather's device, in the stored dtype (FP8 dequantized to bf16).

        ``checked=False`` (the kernel path only): the ids are not read on the host (that
        is a device sync per call for ids on the GPU); a bad id still gives a zero row and
        is counted on the GPU, which :meth:`check_bad_rows` reads. For ids a hash makes
        for this very table (in range by construction). ``out``: the kernel path writes
        the rows there (``[n, 1, head_dim]`` bf16: a CUDA graph's static buffer)."""
        path = self.paths[layer_idx]
        if path == "reference":
            return self.store.rows(layer_idx, ids.to(self.device))
        flat = ids.reshape(-1)
        hd = self.store.head_dim(layer_idx)
        if path == "kernel":
            from engram_trt.native import gather as gather_kernels

            if checked or not flat.is_cuda:
                self._check_ids(layer_idx, flat)
            rows, scales = self.store.tensors(layer_idx)
            got = gather_kernels.gather(
                flat.to(self.device, torch.int32).reshape(-1, 1),
                rows,
                scales,
                quant_block=self.store.quant_block,
                out=out,
                bad_rows=self._bad_counter(),
            )
            return got.reshape(*ids.shape, hd)
        self._check_ids(layer_idx, flat)
        return self._host(layer_idx, flat.cpu().to(torch.int32)).reshape(*ids.shape, hd)

    def _bad_counter(self) -> torch.Tensor:
        """The GPU's count of kernel-path rows whose id was outside their table."""
        if self._bad is None:
            self._bad = torch.zeros(1, dtype=torch.int64, device=self.device)
        return self._bad

    def stats(self) -> list[dict[str, Any] | None] | None:
        """Per layer, a hot-row cache's counters: None, this gather has no cache (the
        cached one, :class:`engram_trt.cache.storecache.CachedStoreGather`, has)."""
        return None

    def check_bad_rows(self) -> None:
        """Raise when any kernel-path gather met an id outside its table (one small
        device-to-host read: a sync, so callers do it every few hundred steps)."""
        bad = self._bad
        if bad is not None and int(bad.item()):
            raise EngramError(
                f"{int(bad.item())} gathered row id(s) were outside their table: the table does not "
                f"cover the hash layout (rows read as zeros)"
            )

    def _host(self, layer_idx: int, flat: torch.Tensor) -> torch.Tensor:
        """The host gather of checked CPU int32 ids, shard by shard for a table in parts."""
        g = self._host_gatherer(self.store.head_dim(layer_idx))
        regions = self.store.regions(layer_idx)
        if len(regions) == 1:
            rows, scales = self.store.tensors(layer_idx)
            return g.gather(flat.reshape(-1, 1), rows, scales, quant_block=self.store.quant_block)[:, 0]
        out = torch.empty((flat.numel(), self.store.head_dim(layer_idx)), dtype=torch.bfloat16, device=self.device)
        which, local = self.store.locate(layer_idx, flat.to(torch.int64))
        for r in torch.unique(which).tolist():  # one call per region (a file's run of shards)
            sel = (which == r).nonzero().flatten()
            ids = local[sel].to(torch.int32).reshape(-1, 1).contiguous()
            out[sel.to(self.device)] = g.gather(ids, regions[r])[:, 0]
        return out

    def _host_gatherer(self, head_dim: int) -> Any:
        if self._gatherer is None:
            from engram_trt.native.hostgather import HostGatherer

            widest = max(self.store.head_dim(i) for i in range(self.store.num_layers))
            self._gatherer = HostGatherer(max_head_dim=max(512, -(-widest // 8) * 8), device=self.device)
        return self._gatherer

    def close(self) -> None:
        """Release the host gatherer (the store is its owner's to close)."""
        if self._gatherer is not None:
            self._gatherer.close()
            self._gatherer = None
