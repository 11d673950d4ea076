"""The table-store interface and the stores that need no special memory: plain host
memory (``memory``), GPU memory (``device``) and the checkpoint files themselves
(``file``). Pinned (UVA) and ``/dev/shm``-shared stores live in :mod:`.pinned` and
:mod:`.shared`; :func:`open_tables` chooses among all five.

Every store hands out, per Engram layer, the stored bytes as torch tensors: FP8 e4m3
rows viewed as ``uint8 [rows, head_dim]`` with ue8m0 scales ``uint8 [rows,
head_dim/quant_block]``, or bf16 rows ``[rows, head_dim]`` with no scales (Qwen4Exp's
PLE tables may also be f16 / f32 rows, as a checkpoint saved them, or FP8 rows scaled per
table, handed out as ``float8_e4m3fn`` without scales: the consumer applies the table's
scale, :attr:`~engram_trt.tables.source.TableRef.table_scale`). Consumers
(the reference gather, the kernel library's gathers, the prefetcher) pick their path
from :attr:`TableStore.gpu_readable`: a GPU kernel may read device and pinned/registered
memory directly; anything else goes through the host gather.

A layer's table may be several row shards (Qwen4Exp's ``split_ngram_parts``): every
store but ``file`` fills one buffer per layer shard by shard; the file store maps each
shard where it lies (one map when the shards are adjacent in one file, in order), so
such a layer has :meth:`TableStore.parts` but no single :meth:`TableStore.tensors`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from engram_trt.errors import EngramError
from engram_trt.tables.source import TableRef, layer_refs

log = logging.getLogger(__name__)

TABLE_KINDS = ("memory", "device", "pinned", "shared", "file")
LOAD_CHUNK = 64 * 1024 * 1024
_TORCH_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
_DTYPE_NAMES = {
    torch.bfloat16: "bf16",
    torch.float16: "f16",
    torch.float32: "f32",
    torch.float8_e4m3fn: "fp8-table-scaled",
}


def _typed_rows(t: torch.Tensor, ref: TableRef) -> torch.Tensor:
    """A table's ``uint8 [rows, row_bytes]`` bytes in the dtype the stores hand out:
    float rows as their dtype, FP8 rows with a table scale as ``float8_e4m3fn``, FP8
    rows with per-row scales (and the scales) as ``uint8``."""
    if ref.itemsize > 1:
        return t.view(_TORCH_DTYPES.get(ref.dtype, torch.bfloat16))
    return t.view(torch.float8_e4m3fn) if ref.table_scale is not None else t


@dataclass
class PartedTable:
    """A table whose rows are several tensors in place (the file store over shards that
    are not one byte range): part ``i`` is table rows ``[starts[i], starts[i] +
    counts[i])``, held at rows ``[local[i], local[i] + counts[i])`` of
    ``regions[region[i]]``. A region is one map of back-to-back shards, in file order
    (safetensors writes ``shard_10`` before ``shard_2``), so 512 shards in one file are
    one region and a gather is one call per region."""

    regions: list[torch.Tensor]
    region: list[int]
    local: list[int]
    counts: list[int]

    def __post_init__(self) -> None:
        self._starts = torch.tensor(np.cumsum([0] + self.counts), dtype=torch.int64)
        self._region = torch.tensor(self.region, dtype=torch.int64)
        self._shift = torch.tensor(self.local, dtype=torch.int64) - self._starts[:-1]

    @classmethod
    def of_parts(cls, parts: Sequence[torch.Tensor]) -> "PartedTable":
        """Each tensor one part (and its own region), in row order."""
        return cls(list(parts), list(range(len(parts))), [0] * len(parts), [int(t.shape[0]) for t in parts])

    @property
    def num_rows(self) -> int:
        return int(self._starts[-1])

    def locate(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(region index, row in that region)`` of checked table row ids (CPU int64)."""
        part = torch.searchsorted(self._starts, flat, right=True) - 1
        return self._region[part], flat + self._shift[part]


class TableStore:
    """Per-layer Engram tables held as tensors; see the module docstring for the form.

    ``layer_ids`` are the model's Engram layer ids (for messages); ``kind`` names the
    memory; ``gpu_readable`` says whether GPU kernels may read the tensors in place.
    """

    kind = "memory"
    gpu_readable = False

    def __init__(
        self,
        layers: Sequence[tuple[Any, torch.Tensor | None]],
        quant_block: int = 32,
        layer_ids: Sequence[int] | None = None,
    ) -> None:
        self.quant_block = int(quant_block)
        self.layer_ids = list(layer_ids) if layer_ids is not None else list(range(len(layers)))
        self._rows: list[torch.Tensor | None] = []
        self._scales: list[torch.Tensor | None] = []
        # Per layer, its parts when the table is several tensors in place (file store), else None.
        self._parts: list[PartedTable | None] = []
        for i, (t, s) in enumerate(layers):
            if isinstance(t, (list, tuple)):
                t = t[0] if len(t) == 1 else PartedTable.of_parts(t)
            if isinstance(t, PartedTable):
                if len(t.regions) == 1 and t.local == [sum(t.counts[:k]) for k in range(len(t.counts))]:
                    t = t.regions[0]  # the parts are one tensor in row order
                else:
                    r0 = t.regions[0]
                    if s is not None or any(
                        r.ndim != 2 or r.dtype == torch.uint8 or r.shape[1] != r0.shape[1] or r.dtype != r0.dtype
                        for r in t.regions
                    ):
                        raise EngramError(
                            f"table {i}: a table in several parts must be 2-D rows of one width and one "
                            f"float (or table-scaled FP8) dtype, without scales"
                        )
                    self._rows.append(None)
                    self._scales.append(None)
                    self._parts.append(t)
                    continue
            self._parts.append(None)
            if t.ndim != 2:
                raise EngramError(f"Engram table {i} must be 2-D [rows, head_dim] (got {tuple(t.shape)})")
            if s is None:
                if t.element_size() == 1 and t.dtype != torch.float8_e4m3fn:
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
        return int(self._first(layer_idx).shape[1])

    def num_rows(self, layer_idx: int) -> int:
        parts = self._parts[layer_idx]
        return parts.num_rows if parts is not None else int(self._rows[layer_idx].shape[0])  # type: ignore[union-attr]

    def is_fp8(self, layer_idx: int) -> bool:
        return self._scales[layer_idx] is not None

    def row_dtype(self, layer_idx: int) -> torch.dtype:
        """The stored rows' dtype (uint8 for FP8 bytes)."""
        return self._first(layer_idx).dtype

    def tensors(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layer ``layer_idx``'s stored bytes (rows, scales or None), in place."""
        self._check_open()
        rows = self._rows[layer_idx]
        if rows is None:
            raise EngramError(
                f"table {layer_idx} of the {self.kind} store is {len(self._parts[layer_idx].counts)} parts in "  # type: ignore[union-attr]
                f"separate regions (shards in place), not one tensor: gather with rows(), or read regions()"
            )
        return rows, self._scales[layer_idx]

    def parts(self, layer_idx: int) -> list[tuple[int, torch.Tensor]]:
        """Layer ``layer_idx``'s rows as ``(first row, tensor view)`` per part, in row
        order (one entry unless the table is several shards in place)."""
        self._check_open()
        pt = self._parts[layer_idx]
        if pt is None:
            return [(0, self._rows[layer_idx])]  # type: ignore[list-item]
        out, at = [], 0
        for r, lo, n in zip(pt.region, pt.local, pt.counts):
            out.append((at, pt.regions[r][lo : lo + n]))
            at += n
        return out

    def regions(self, layer_idx: int) -> list[torch.Tensor]:
        """The tensors holding layer ``layer_idx``'s rows (one unless in parts)."""
        self._check_open()
        return self._tensors_of(layer_idx)

    def locate(self, layer_idx: int, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(region index, row in that region)`` of checked row ids (CPU int64)."""
        pt = self._parts[layer_idx]
        if pt is None:
            return torch.zeros_like(flat), flat
        return pt.locate(flat)

    def _tensors_of(self, layer_idx: int) -> list[torch.Tensor]:
        parts = self._parts[layer_idx]
        return parts.regions if parts is not None else [self._rows[layer_idx]]  # type: ignore[list-item]

    def _first(self, layer_idx: int) -> torch.Tensor:
        return self._tensors_of(layer_idx)[0]

    @property
    def on_device(self) -> bool:
        return bool(self._parts) and self._first(0).is_cuda

    # -- reference gather ------------------------------------------------------------
    def rows(self, layer_idx: int, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (any int shape) of layer ``layer_idx``: ``[*ids.shape, head_dim]``
        on ``ids``'s device, in the stored dtype (bf16 for Engram tables), FP8
        dequantized to bf16 as the GPU gather kernel does (FP8 times a power of two is
        exact in bf16); FP8 rows scaled per table as stored (``float8_e4m3fn``: the
        consumer applies the scale). The reference path: ids are checked."""
        from engram_trt.engram.quant import dequant_fp8_rows_torch

        self._check_open()
        flat = ids.reshape(-1).to(torch.int64)
        n = self.num_rows(layer_idx)
        if flat.numel():
            lo, hi = int(flat.min()), int(flat.max())
            if lo < 0 or hi >= n:
                bad = lo if lo < 0 else hi
                raise EngramError(
                    f"row id {bad} is outside table {layer_idx} (rows 0..{n - 1}): the table does not cover the layout"
                )
        if self._parts[layer_idx] is not None:
            return self._rows_of_parts(layer_idx, flat).to(ids.device).reshape(*ids.shape, self.head_dim(layer_idx))
        rows, scales = self.tensors(layer_idx)
        idx = flat.to(rows.device)
        raw = rows.index_select(0, idx)
        if scales is None:
            out = raw  # bf16 rows stay bf16; f16 / f32 PLE rows keep their dtype
        else:
            out = dequant_fp8_rows_torch(raw, scales.index_select(0, idx), self.quant_block, dtype=torch.bfloat16)
        return out.to(ids.device).reshape(*ids.shape, rows.shape[1])

    def _rows_of_parts(self, layer_idx: int, flat: torch.Tensor) -> torch.Tensor:
        """Checked ids ``flat`` (int64) of a table in several parts: each part serves its rows."""
        regions = self._tensors_of(layer_idx)
        which, local = self.locate(layer_idx, flat.cpu())
        out = torch.empty((flat.numel(), self.head_dim(layer_idx)), dtype=regions[0].dtype)
        # FP8 bytes copied as bytes (index_put has no float8 kernels)
        raw = out.view(torch.uint8) if out.element_size() == 1 else out
        for r in torch.unique(which).tolist():
            sel = (which == r).nonzero().flatten()
            region = regions[r].view(torch.uint8) if out.element_size() == 1 else regions[r]
            raw[sel] = region[local[sel]]
        return out

    # -- accounting ------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes this store holds resident (a file store holds none: the page cache does)."""
        return self.table_bytes()

    def table_bytes(self) -> int:
        """Bytes of the tables themselves, wherever they are."""
        return sum(
            sum(t.numel() * t.element_size() for t in self._tensors_of(i)) + (0 if s is None else s.numel())
            for i, s in enumerate(self._scales)
        )

    def where(self) -> str:
        """Where the tables live, in words (logged at load)."""
        return "host memory" if not self.on_device else f"GPU memory ({self._first(0).device})"

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "where": self.where(),
            "gpu_readable": self.gpu_readable,
            "table_bytes": self.table_bytes(),
            "resident_bytes": self.nbytes(),
            "layers": [
                {
                    "layer_id": lid,
                    "rows": self.num_rows(i),
                    "head_dim": self.head_dim(i),
                    "dtype": "fp8" if self.is_fp8(i) else _DTYPE_NAMES.get(self.row_dtype(i), str(self.row_dtype(i))),
                }
                for i, lid in enumerate(self.layer_ids)
            ],
        }

    # -- lifetime ----------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise EngramError(f"the {self.kind} table store was closed; open the tables again")

    def close(self) -> None:
        """Drop the tensors (and, in subclasses, unregister / unmap / detach)."""
        self._rows, self._scales, self._parts = [], [], []
        self._closed = True

    def __enter__(self) -> "TableStore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(kind={self.kind}, layers={self.num_layers}, bytes={self.table_bytes()})"

    # -- construction -------------------------------------------------------------------
    @classmethod
    def from_tensors(
        cls,
        tables: Sequence[torch.Tensor],
        scales: Sequence[torch.Tensor | None],
        quant_block: int = 32,
        layer_ids: Sequence[int] | None = None,
    ) -> "TableStore":
        """A store over tensors already in memory (tests, or weights loaded whole)."""
        if len(tables) != len(scales):
            raise EngramError(
                f"{len(tables)} tables but {len(scales)} scale entries (one per Engram layer, None for bf16)"
            )
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
                spans, where = _map_regions(rows_ref)
                regions = [self._typed(rows_ref, torch.from_numpy(self._map(r))) for r in spans]
                rows = PartedTable(
                    regions, [w[0] for w in where], [w[1] for w in where], [p.shape[0] for p in rows_ref.parts]
                )
                scales = None if scales_ref is None else torch.from_numpy(self._map(scales_ref))
                layers.append((rows, scales))
        super().__init__(layers, quant_block, [r.layer_id for r, _ in pairs])

    @staticmethod
    def _typed(ref: TableRef, t: torch.Tensor) -> torch.Tensor:
        return _typed_rows(t, ref)

    def _map(self, ref: TableRef) -> np.ndarray:
        if len(ref.parts) > 1:
            raise EngramError(f"internal: {ref.tensor} is {len(ref.parts)} regions; map them one by one")
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


def _map_regions(ref: TableRef) -> tuple[list[TableRef], list[tuple[int, int]]]:
    """A table's parts as few maps need them: per file, parts that lie back to back
    (safetensors writes a layer's shards together, in name order) become one span.
    Returns the spans and, per part in row order, ``(span index, first row in it)``."""
    spans: list[TableRef] = []
    where: dict[int, tuple[int, int]] = {}
    by_file: dict[Path, list[tuple[int, TableRef]]] = {}
    for i, p in enumerate(ref.parts):
        by_file.setdefault(p.file, []).append((i, p))
    for f, items in by_file.items():
        items.sort(key=lambda e: e[1].offset)
        start = end = -1
        for i, p in items:
            if spans and start >= 0 and p.offset == end and p.row_bytes == ref.row_bytes:
                last = spans[-1]
                spans[-1] = TableRef(
                    last.layer_id,
                    last.layer_index,
                    last.role,
                    last.tensor,
                    f,
                    last.offset,
                    last.nbytes + p.nbytes,
                    (last.shape[0] + p.shape[0], *last.shape[1:]),
                    last.dtype,
                )
            else:
                spans.append(
                    TableRef(p.layer_id, p.layer_index, p.role, p.tensor, f, p.offset, p.nbytes, p.shape, p.dtype)
                )
                start = p.offset
            where[i] = (len(spans) - 1, (p.offset - spans[-1].offset) // ref.row_bytes)
            end = p.offset + p.nbytes
    return spans, [where[i] for i in range(len(ref.parts))]


def read_region_into(ref: TableRef, out: torch.Tensor, progress: Any = None) -> None:
    """Read a table's byte range (each of its regions in turn) into ``out`` (a flat uint8
    CPU tensor of ``ref.nbytes`` bytes), in chunks, so that loading never holds a second
    copy in memory."""
    view = out.view(torch.uint8).reshape(-1).numpy()
    if view.shape[0] != ref.nbytes:
        raise EngramError(f"internal: buffer of {view.shape[0]} bytes for table {ref.tensor} of {ref.nbytes}")
    at = 0
    for part in ref.parts:
        _read_one(part, view[at : at + part.nbytes], progress)
        at += part.nbytes


def _read_one(ref: TableRef, view: np.ndarray, progress: Any) -> None:
    with open(ref.file, "rb", buffering=0) as f:
        f.seek(ref.offset)
        pos = 0
        while pos < ref.nbytes:
            n = f.readinto(memoryview(view[pos : pos + LOAD_CHUNK]))
            if not n:
                raise EngramError(
                    f"{ref.file}: ended {ref.nbytes - pos} bytes before table {ref.tensor}'s end "
                    "(the file is truncated; restore it or rebuild)"
                )
            pos += n
            if progress is not None:
                progress.update(n)


def _load_progress(refs: Sequence[TableRef], kind: str, progress: bool) -> Any:
    from tqdm.auto import tqdm

    total = sum(r.nbytes for r in refs)
    # Only multi-GiB loads are worth a bar; small test tables stay quiet.
    return tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc=f"load tables ({kind})",
        leave=False,
        disable=not progress or total < (1 << 30),
    )


def _shape_tensor(buf: torch.Tensor, ref: TableRef) -> torch.Tensor:
    return _typed_rows(buf.view(torch.uint8).reshape(ref.shape[0], ref.row_bytes), ref)


def _load_layers(
    refs: Sequence[TableRef], kind: str, progress: bool, load_one: Callable[[TableRef, Any], torch.Tensor]
) -> tuple[list, list[int]]:
    """Per layer (rows, scales or None) loaded by ``load_one(ref, bar)`` (one flat
    uint8 tensor of the ref's bytes), with one byte-counting progress bar."""
    pairs = layer_refs(refs)
    layers = []
    with _load_progress(refs, kind, progress) as bar:
        for rows_ref, scales_ref in pairs:
            layers.append(
                tuple(None if ref is None else _shape_tensor(load_one(ref, bar), ref) for ref in (rows_ref, scales_ref))
            )
    return layers, [r.layer_id for r, _ in pairs]


def load_memory_tables(refs: Sequence[TableRef], quant_block: int, progress: bool = True) -> MemoryTables:
    def load_one(ref: TableRef, bar: Any) -> torch.Tensor:
        buf = torch.empty(ref.nbytes, dtype=torch.uint8)
        read_region_into(ref, buf, bar)
        return buf

    layers, ids = _load_layers(refs, "memory", progress, load_one)
    return MemoryTables(layers, quant_block, ids)


def load_device_tables(
    refs: Sequence[TableRef], quant_block: int, device: torch.device, progress: bool = True
) -> DeviceTables:
    """Tables copied to GPU memory through one reused pinned staging buffer: the host
    never holds a whole table (no OOM while loading a table larger than free RAM)."""
    staging = torch.empty(LOAD_CHUNK, dtype=torch.uint8, pin_memory=True)

    def load_one(ref: TableRef, bar: Any) -> torch.Tensor:
        dst = torch.empty(ref.nbytes, dtype=torch.uint8, device=device)
        at = 0
        for part in ref.parts:  # a table in several shards: one GPU buffer, filled shard by shard
            with open(part.file, "rb", buffering=0) as f:
                f.seek(part.offset)
                pos = 0
                while pos < part.nbytes:
                    n = f.readinto(memoryview(staging.numpy()[: min(LOAD_CHUNK, part.nbytes - pos)]))
                    if not n:
                        raise EngramError(
                            f"{part.file}: ended {part.nbytes - pos} bytes before table "
                            f"{part.tensor}'s end (the file is truncated)"
                        )
                    dst[at + pos : at + pos + n].copy_(staging[:n], non_blocking=False)
                    pos += n
                    bar.update(n)
            at += part.nbytes
        return dst

    layers, ids = _load_layers(refs, "device", progress, load_one)
    return DeviceTables(layers, quant_block, ids)
