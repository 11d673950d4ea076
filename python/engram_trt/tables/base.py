"""The table-store interface and the stores that need no special memory: plain host
memory (``memory``), GPU memory (``device``) and the checkpoint files themselves
(``file``). Pinned (UVA) and ``/dev/shm``-shared stores live in :mod:`.pinned` and
:mod:`.shared`; :func:`open_tables` chooses among all five.

Every store hands out, per Engram layer, the stored bytes as torch tensors: FP8 e4m3
rows viewed as ``uint8 [rows, head_dim]`` with ue8m0 scales ``uint8 [rows,
head_dim/quant_block]``, or bf16 rows ``[rows, head_dim]`` with no scales. Consumers
(the reference gather, the kernel library's gathers, the prefetcher) pick their path
from :attr:`TableStore.gpu_readable`: a GPU kernel may read device and pinned/registered
memory directly; anything else goes through the host gather.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import numpy as np
import torch

from engram_trt.errors import EngramError
from engram_trt.tables.source import TableRef, layer_refs

log = logging.getLogger(__name__)

TABLE_KINDS = ("memory", "device", "pinned", "shared", "file")
LOAD_CHUNK = 64 * 1024 * 1024
_TORCH_DTYPES = {"BF16": torch.bfloat16}


class TableStore:
    """Per-layer Engram tables held as tensors; see the module docstring for the form.

    ``layer_ids`` are the model's Engram layer ids (for messages); ``kind`` names the
    memory; ``gpu_readable`` says whether GPU kernels may read the tensors in place.
    """

    kind = "memory"
    gpu_readable = False

    def __init__(self, layers: Sequence[tuple[torch.Tensor, torch.Tensor | None]], quant_block: int = 32,
                 layer_ids: Sequence[int] | None = None) -> None:
        self.quant_block = int(quant_block)
        self.layer_ids = list(layer_ids) if layer_ids is not None else list(range(len(layers)))
        self._rows: list[torch.Tensor] = []
        self._scales: list[torch.Tensor | None] = []
        for i, (t, s) in enumerate(layers):
            if t.ndim != 2:
                raise EngramError(f"Engram table {i} must be 2-D [rows, head_dim] (got {tuple(t.shape)})")
            if s is None:
                if t.element_size() == 1:
                    raise EngramError(f"Engram table {i} is one byte per value (FP8) but has no scales")
            else:
                want = (t.shape[0], t.shape[1] // self.quant_block)
                if tuple(s.shape) != want or t.shape[1] % self.quant_block:
                    raise EngramError(f"Engram table {i} {tuple(t.shape)} needs scales {want} (got {tuple(s.shape)})")
                t, s = t.view(torch.uint8), s.view(torch.uint8)
            self._rows.append(t)
            self._scales.append(s)
        self._closed = False

    # -- shape ---------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self._rows)

    def head_dim(self, layer_idx: int) -> int:
        return int(self._rows[layer_idx].shape[1])

    def num_rows(self, layer_idx: int) -> int:
        return int(self._rows[layer_idx].shape[0])

    def is_fp8(self, layer_idx: int) -> bool:
        return self._scales[layer_idx] is not None

    def tensors(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layer ``layer_idx``'s stored bytes (rows, scales or None), in place."""
        self._check_open()
        return self._rows[layer_idx], self._scales[layer_idx]

    @property
    def on_device(self) -> bool:
        return bool(self._rows) and self._rows[0].is_cuda

    # -- reference gather ------------------------------------------------------------
    def rows(self, layer_idx: int, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (any int shape) of layer ``layer_idx``: bf16 ``[*ids.shape,
        head_dim]`` on ``ids``'s device, dequantized as the GPU gather kernel does (FP8
        times a power of two is exact in bf16). The reference path: ids are checked."""
        from engram_trt.engram.quant import dequant_fp8_rows_torch

        rows, scales = self.tensors(layer_idx)
        flat = ids.reshape(-1).to(torch.int64)
        n = rows.shape[0]
        if flat.numel():
            lo, hi = int(flat.min()), int(flat.max())
            if lo < 0 or hi >= n:
                bad = lo if lo < 0 else hi
                raise EngramError(f"row id {bad} is outside Engram table {layer_idx} (rows 0..{n - 1}): the table does not cover the layout")
        idx = flat.to(rows.device)
        raw = rows.index_select(0, idx)
        if scales is None:
            out = raw.to(torch.bfloat16)
        else:
            out = dequant_fp8_rows_torch(raw, scales.index_select(0, idx), self.quant_block, dtype=torch.bfloat16)
        return out.to(ids.device).reshape(*ids.shape, rows.shape[1])

    # -- accounting ------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes this store holds resident (a file store holds none: the page cache does)."""
        return sum(t.numel() * t.element_size() + (0 if s is None else s.numel()) for t, s in zip(self._rows, self._scales))

    def table_bytes(self) -> int:
        """Bytes of the tables themselves, wherever they are."""
        return sum(t.numel() * t.element_size() + (0 if s is None else s.numel()) for t, s in zip(self._rows, self._scales))

    def where(self) -> str:
        """Where the tables live, in words (logged at load)."""
        return "host memory" if not self.on_device else f"GPU memory ({self._rows[0].device})"

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "where": self.where(), "gpu_readable": self.gpu_readable,
                "table_bytes": self.table_bytes(), "resident_bytes": self.nbytes(),
                "layers": [{"layer_id": lid, "rows": self.num_rows(i), "head_dim": self.head_dim(i),
                            "dtype": "fp8" if self.is_fp8(i) else "bf16"} for i, lid in enumerate(self.layer_ids)]}

    # -- lifetime ----------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise EngramError(f"the {self.kind} table store was closed; open the tables again")

    def close(self) -> None:
        """Drop the tensors (and, in subclasses, unregister / unmap / detach)."""
        self._rows, self._scales = [], []
        self._closed = True

    def __enter__(self) -> "TableStore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(kind={self.kind}, layers={self.num_layers}, bytes={self.table_bytes()})"

    # -- construction -------------------------------------------------------------------
    @classmethod
    def from_tensors(cls, tables: Sequence[torch.Tensor], scales: Sequence[torch.Tensor | None], quant_block: int = 32,
                     layer_ids: Sequence[int] | None = None) -> "TableStore":
        """A store over tensors already in memory (tests, or weights loaded whole)."""
        if len(tables) != len(scales):
            raise EngramError(f"{len(tables)} tables but {len(scales)} scale entries (one per Engram layer, None for bf16)")
        store = MemoryTables(list(zip(tables, scales)), quant_block, layer_ids)
        if store.on_device:
            store.kind, store.gpu_readable = "device", True  # type: ignore[misc]
        return store


class MemoryTables(TableStore):
    """Tables copied into ordinary host memory (the CPU reference's store)."""

    kind = "memory"


class DeviceTables(TableStore):
    """Tables in GPU memory (``cpu_offload: false``): read by the gather kernel at HBM speed."""

    kind = "device"
    gpu_readable = True


class FileTables(TableStore):
    """Tables read straight from their files through the page cache (``host_file_gather``).

    Nothing is copied up front: each tensor is a read-only file-backed ``np.memmap`` of
    the table's byte range, so a step reads only its rows' pages. The files must not be
    truncated while in use (a read of a vanished page kills the process with SIGBUS); an
    in-place overwrite serves the new bytes (replace tables by writing new files and
    renaming them into place, then reloading).
    """

    kind = "file"

    def __init__(self, refs: Sequence[TableRef], quant_block: int = 32) -> None:
        import warnings

        pairs = layer_refs(refs)
        self._maps: list[np.memmap] = []
        layers = []
        with warnings.catch_warnings():  # the maps are read-only; nothing writes through these views
            warnings.simplefilter("ignore", UserWarning)
            for rows_ref, scales_ref in pairs:
                rows = torch.from_numpy(self._map(rows_ref))
                if rows_ref.itemsize == 2:
                    rows = rows.view(_TORCH_DTYPES.get(rows_ref.dtype, torch.bfloat16))
                scales = None if scales_ref is None else torch.from_numpy(self._map(scales_ref))
                layers.append((rows, scales))
        super().__init__(layers, quant_block, [r.layer_id for r, _ in pairs])

    def _map(self, ref: TableRef) -> np.ndarray:
        m = np.memmap(ref.file, dtype=np.uint8, mode="r", offset=ref.offset, shape=(ref.nbytes,))
        self._maps.append(m)
        return m.reshape(ref.shape[0], ref.row_bytes)

    def nbytes(self) -> int:
        return 0

    def where(self) -> str:
        files = sorted({str(m.filename) for m in self._maps})
        return f"the checkpoint files through the page cache ({len(files)} file{'s' if len(files) != 1 else ''})"

    def close(self) -> None:
        super().close()
        for m in self._maps:
            mm = getattr(m, "_mmap", None)
            if mm is not None:
                try:
                    mm.close()
                except BufferError:
                    log.debug("a view of %s is still referenced; its map is left to the garbage collector", m.filename)
        self._maps = []


def read_region_into(ref: TableRef, out: torch.Tensor, progress: Any = None) -> None:
    """Read a table's byte range into ``out`` (a flat uint8 CPU tensor of ``ref.nbytes``
    bytes), in chunks, so that loading never holds a second copy in memory."""
    view = out.view(torch.uint8).reshape(-1).numpy()
    if view.shape[0] != ref.nbytes:
        raise EngramError(f"internal: buffer of {view.shape[0]} bytes for table {ref.tensor} of {ref.nbytes}")
    with open(ref.file, "rb", buffering=0) as f:
        f.seek(ref.offset)
        pos = 0
        while pos < ref.nbytes:
            n = f.readinto(memoryview(view[pos:pos + LOAD_CHUNK]))
            if not n:
                raise EngramError(f"{ref.file}: ended {ref.nbytes - pos} bytes before table {ref.tensor}'s end (the file is truncated; restore it or rebuild)")
            pos += n
            if progress is not None:
                progress.update(n)


def _load_progress(refs: Sequence[TableRef], kind: str, progress: bool) -> Any:
    from tqdm.auto import tqdm

    total = sum(r.nbytes for r in refs)
    # Only multi-GiB loads are worth a bar; small test tables stay quiet.
    return tqdm(total=total, unit="B", unit_scale=True, desc=f"load tables ({kind})", leave=False,
                disable=not progress or total < (1 << 30))


def _shape_tensor(buf: torch.Tensor, ref: TableRef) -> torch.Tensor:
    t = buf.view(torch.uint8).reshape(ref.shape[0], ref.row_bytes)
    return t.view(_TORCH_DTYPES.get(ref.dtype, torch.bfloat16)) if ref.itemsize == 2 else t


def _load_layers(refs: Sequence[TableRef], kind: str, progress: bool,
                 load_one: Callable[[TableRef, Any], torch.Tensor]) -> tuple[list, list[int]]:
    """Per layer (rows, scales or None) loaded by ``load_one(ref, bar)`` (one flat
    uint8 tensor of the ref's bytes), with one byte-counting progress bar."""
    pairs = layer_refs(refs)
    layers = []
    with _load_progress(refs, kind, progress) as bar:
        for rows_ref, scales_ref in pairs:
            layers.append(tuple(None if ref is None else _shape_tensor(load_one(ref, bar), ref)
                                for ref in (rows_ref, scales_ref)))
    return layers, [r.layer_id for r, _ in pairs]


def load_memory_tables(refs: Sequence[TableRef], quant_block: int, progress: bool = True) -> MemoryTables:
    def load_one(ref: TableRef, bar: Any) -> torch.Tensor:
        buf = torch.empty(ref.nbytes, dtype=torch.uint8)
        read_region_into(ref, buf, bar)
        return buf

    layers, ids = _load_layers(refs, "memory", progress, load_one)
    return MemoryTables(layers, quant_block, ids)


def load_device_tables(refs: Sequence[TableRef], quant_block: int, device: torch.device,
                       progress: bool = True) -> DeviceTables:
    """Tables copied to GPU memory through one reused pinned staging buffer: the host
    never holds a whole table (no OOM while loading a table larger than free RAM)."""
    staging = torch.empty(LOAD_CHUNK, dtype=torch.uint8, pin_memory=True)

    def load_one(ref: TableRef, bar: Any) -> torch.Tensor:
        dst = torch.empty(ref.nbytes, dtype=torch.uint8, device=device)
        with open(ref.file, "rb", buffering=0) as f:
            f.seek(ref.offset)
            pos = 0
            while pos < ref.nbytes:
                n = f.readinto(memoryview(staging.numpy()[:min(LOAD_CHUNK, ref.nbytes - pos)]))
                if not n:
                    raise EngramError(f"{ref.file}: ended {ref.nbytes - pos} bytes before table {ref.tensor}'s end (the file is truncated)")
                dst[pos:pos + n].copy_(staging[:n], non_blocking=False)
                pos += n
                bar.update(n)
        return dst

    layers, ids = _load_layers(refs, "device", progress, load_one)
    return DeviceTables(layers, quant_block, ids)
