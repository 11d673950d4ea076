"""``manifest.json``: what an engine folder needs besides the engine, tables first.

The engine holds the backbone and the layout constants, never a table: the manifest
says where each table's bytes are (file, tensor name, byte offset, length), what they
must hash to (sha256 of exactly that byte range, streamed), and everything the engine
was built from (layout, dtype, shapes, TensorRT flavour/version, plugin library
version and hash, build flags, ``--engram-config``). A runtime checks the files
against it before binding the tables' addresses.

The manifest is deterministic: the same inputs give the same bytes (sorted keys, no
timestamps, no timings; those go to ``build_report.json``), so "did anything change?"
is a file comparison.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from engram_trt.checkpoint.checkpoint import Checkpoint, engram_tensor_names
from engram_trt.errors import EngramError

log = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1
HASH_CHUNK = 16 * 1024 * 1024


def sha256_file_region(path: str | Path, offset: int, nbytes: int, progress: Any = None) -> str:
    """sha256 of ``nbytes`` bytes at ``offset`` of a file, read in chunks (a table may be
    hundreds of GB: it is never loaded whole). ``progress`` (a tqdm) is advanced by bytes."""
    h = hashlib.sha256()
    left = int(nbytes)
    with open(path, "rb") as f:
        f.seek(int(offset))
        while left > 0:
            chunk = f.read(min(HASH_CHUNK, left))
            if not chunk:
                raise EngramError(f"{path}: ended {left} bytes before the tensor's end (the file is truncated; re-copy it)")
            h.update(chunk)
            left -= len(chunk)
            if progress is not None:
                progress.update(len(chunk))
    return h.hexdigest()


def sha256_file(path: str | Path) -> str:
    p = Path(path)
    return sha256_file_region(p, 0, p.stat().st_size)


@dataclass(frozen=True)
class TableRef:
    """One tensor of one Engram layer's table, located in a file."""

    layer_id: int
    layer_index: int
    role: str  # 'rows' | 'scales'
    tensor: str
    file: Path
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype string

    def to_json(self, sha256: str) -> dict[str, Any]:
        return {
            "layer_id": self.layer_id,
            "layer_index": self.layer_index,
            "role": self.role,
            "tensor": self.tensor,
            "file": str(self.file),
            "offset": self.offset,
            "nbytes": self.nbytes,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "sha256": sha256,
        }


def checkpoint_table_refs(ckpt: Checkpoint) -> list[TableRef]:
    """Every table tensor (rows, and scales for FP8) of a checkpoint, in layer order."""
    spec = ckpt.config.require_engram("describing Engram tables")
    refs: list[TableRef] = []
    for li, lid in enumerate(spec.layer_ids):
        names = engram_tensor_names(lid, spec.prefix)
        roles = [("rows", names["table"])]
        if ckpt.info(names["table"]).itemsize == 1:
            roles.append(("scales", names["scale"]))
        for role, name in roles:
            info = ckpt.info(name)
            refs.append(TableRef(lid, li, role, name, info.file.resolve(), info.data_offset, info.nbytes, info.shape, info.st_dtype))
    return refs


def hash_tables(refs: Sequence[TableRef], progress: bool = True) -> list[str]:
    """sha256 of every table region, with one byte-counting progress bar."""
    from tqdm.auto import tqdm

    total = sum(r.nbytes for r in refs)
    with tqdm(total=total, unit="B", unit_scale=True, desc="hash tables", disable=not progress, leave=False) as bar:
        return [sha256_file_region(r.file, r.offset, r.nbytes, bar) for r in refs]


# -- re-packing ---------------------------------------------------------------------------
def _write_safetensors_streamed(path: Path, tensors: Sequence[tuple[str, str, tuple[int, ...], int, Any]]) -> dict[str, tuple[int, int]]:
    """Write a safetensors file whose tensors are produced in chunks.

    ``tensors``: ``(name, st_dtype, shape, nbytes, chunks)`` with ``chunks`` an iterable of
    bytes-like pieces summing to ``nbytes``. Returns ``name -> (absolute offset, nbytes)``.
    The header is fixed before the data, so nothing is held in memory but one chunk.
    """
    header: dict[str, Any] = {}
    off = 0
    for name, st, shape, nb, _ in tensors:
        header[name] = {"dtype": st, "shape": list(shape), "data_offsets": [off, off + nb]}
        off += nb
    header["__metadata__"] = {"format": "pt", "producer": "engram-trt repack"}
    hb = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    hb += b" " * ((8 - len(hb) % 8) % 8)  # data aligned to 8 bytes
    base = 8 + len(hb)
    where: dict[str, tuple[int, int]] = {}
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for name, _, _, nb, chunks in tensors:
            start = f.tell()
            written = 0
            for piece in chunks:
                mv = memoryview(piece).cast("B")
                f.write(mv)
                written += len(mv)
            if written != nb:
                raise EngramError(f"internal: repacking {name} wrote {written} bytes, expected {nb}")
            where[name] = (start, nb)
    tmp.replace(path)
    assert all(where[n][0] == base + header[n]["data_offsets"][0] for n in where)
    return where


def repack_tables(ckpt: Checkpoint, out_dir: str | Path, quant_block: int | None = None, chunk_rows: int = 1 << 16,
                  progress: bool = True) -> list[TableRef]:
    """Write each Engram layer's table to ``out_dir/engram-layer{L}.safetensors`` as FP8
    e4m3 rows + ue8m0 scales (quantizing bf16 tables, copying FP8 ones), streamed in
    chunks of ``chunk_rows`` rows. Returns the new table references."""
    import torch
    from tqdm.auto import tqdm

    from engram_trt.engram.quant import quantize_fp8_rows

    spec = ckpt.config.require_engram("re-packing Engram tables")
    block = int(quant_block or spec.quant_block)
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    refs: list[TableRef] = []
    src_refs = checkpoint_table_refs(ckpt)
    total = sum(r.nbytes for r in src_refs if r.role == "rows")
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="repack tables", disable=not progress, leave=False)
    try:
        for li, lid in enumerate(spec.layer_ids):
            names = engram_tensor_names(lid, spec.prefix)
            info = ckpt.info(names["table"])
            rows, hd = info.shape
            if hd % block:
                raise EngramError(f"table {names['table']} rows of width {hd} are not a multiple of the FP8 block {block}")
            view = ckpt.raw_rows_view(names["table"])
            fp8 = info.itemsize == 1
            scale_view = ckpt.raw_rows_view(names["scale"]) if fp8 else None

            def rows_chunks(view: Any = view, fp8: bool = fp8) -> Any:
                for a in range(0, rows, chunk_rows):
                    piece = view[a:a + chunk_rows]
                    bar.update(piece.nbytes)
                    if fp8:
                        yield piece
                    else:
                        q, _ = quantize_fp8_rows(torch.from_numpy(piece.copy()).view(torch.bfloat16).float(), block)
                        yield q.numpy()

            def scale_chunks(view: Any = view, scale_view: Any = scale_view, fp8: bool = fp8) -> Any:
                for a in range(0, rows, chunk_rows):
                    if fp8:
                        yield scale_view[a:a + chunk_rows]
                    else:
                        _, s = quantize_fp8_rows(torch.from_numpy(view[a:a + chunk_rows].copy()).view(torch.bfloat16).float(), block)
                        yield s.numpy()

            path = (out / f"engram-layer{lid}.safetensors").resolve()
            specs = [(names["table"], "F8_E4M3", (rows, hd), rows * hd, rows_chunks()),
                     (names["scale"], "F8_E8M0", (rows, hd // block), rows * (hd // block), scale_chunks())]
            # Scales of a bf16 table come from the same quantization as its rows: compute
            # them in a second pass (cheap next to the I/O) rather than hold them all.
            where = _write_safetensors_streamed(path, specs)
            for role, (name, st, shape, nb, _) in zip(("rows", "scales"), specs):
                refs.append(TableRef(lid, li, role, name, path, where[name][0], nb, shape, st))
    finally:
        bar.close()
    log.info("re-packed %d Engram tables as FP8 into %s", len(spec.layer_ids), out)
    return refs


def write_manifest(path: str | Path, manifest: dict[str, Any]) -> Path:
    p = Path(path)
    p.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return p


def read_manifest(engine_dir: str | Path) -> dict[str, Any]:
    p = Path(engine_dir) / MANIFEST_NAME
    if not p.is_file():
        raise EngramError(f"'{engine_dir}' has no {MANIFEST_NAME} (build it with `engram-trt build CHECKPOINT --output {engine_dir}`)")
    data = json.loads(p.read_text())
    if data.get("manifest_version") != MANIFEST_VERSION:
        raise EngramError(f"{p}: manifest version {data.get('manifest_version')} is not {MANIFEST_VERSION}; rebuild the engine folder")
    return data


def verify_tables(manifest: dict[str, Any], progress: bool = False) -> list[str]:
    """Problems with the table files a manifest names (missing, short, changed bytes)."""
    problems: list[str] = []
    for t in manifest.get("tables", []):
        f = Path(t["file"])
        if not f.is_file():
            problems.append(f"table {t['tensor']}: file {f} is missing")
            continue
        if f.stat().st_size < t["offset"] + t["nbytes"]:
            problems.append(f"table {t['tensor']}: file {f} is shorter than the table's end ({t['offset'] + t['nbytes']} bytes)")
            continue
        if sha256_file_region(f, t["offset"], t["nbytes"]) != t["sha256"]:
            problems.append(f"table {t['tensor']}: the bytes in {f} changed since the build (sha256 differs)")
    return problems
