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

import json
import logging
import shlex
import struct
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

from engram_trt.storage import atomic
from engram_trt.checkpoint.checkpoint import Checkpoint, engram_tensor_names, read_safetensors_header
from engram_trt.config.jsonfile import read_json_object
from engram_trt.errors import EngramError

# The table references and their hashing live with the stores that read them; the
# builder records what they check.
from engram_trt.tables.source import (
    TableRef,
    checkpoint_table_refs,
    hash_tables,  # noqa: F401
    sha256_file,  # noqa: F401
    sha256_file_region,  # noqa: F401
    verify_table_hashes,
)

log = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1
REPACK_PRODUCER = "engram-trt repack"


# -- re-packing ---------------------------------------------------------------------------
def _write_safetensors_streamed(
    path: Path, tensors: Sequence[tuple[str, str, tuple[int, ...], int, Any]]
) -> dict[str, tuple[int, int]]:
    """Write a safetensors file whose tensors are produced in chunks (at ``path``: the
    caller's temporary name, renamed into place once the whole build holds).

    ``tensors``: ``(name, st_dtype, shape, nbytes, chunks)`` with ``chunks`` an iterable of
    bytes-like pieces summing to ``nbytes``. Returns ``name -> (absolute offset, nbytes)``.
    The header is fixed before the data, so nothing is held in memory but one chunk.
    """
    header: dict[str, Any] = {}
    off = 0
    for name, st, shape, nb, _ in tensors:
        header[name] = {"dtype": st, "shape": list(shape), "data_offsets": [off, off + nb]}
        off += nb
    header["__metadata__"] = {"format": "pt", "producer": REPACK_PRODUCER}
    hb = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    hb += b" " * ((8 - len(hb) % 8) % 8)  # data aligned to 8 bytes
    base = 8 + len(hb)
    where: dict[str, tuple[int, int]] = {}
    with open(path, "wb") as f:
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
    assert all(where[n][0] == base + header[n]["data_offsets"][0] for n in where)
    return where


@dataclass
class RepackedTables:
    """Re-packed tables written under temporary names: ``refs`` point at the
    temporaries (hash those), :meth:`commit` renames them into place (the build does
    that only once everything else succeeded), :meth:`discard` removes them."""

    refs: list[TableRef]
    pending: list[tuple[Path, Path]] = field(default_factory=list)  # (temporary, final)

    def final(self, refs: Sequence[TableRef]) -> list[TableRef]:
        where = {tmp: final for tmp, final in self.pending}
        return [replace(r, file=where.get(r.file, r.file)) for r in refs]

    def commit(self) -> None:
        for tmp, final in self.pending:
            atomic.replace_file(tmp, final)
        self.pending = []

    def discard(self) -> None:
        for tmp, _ in self.pending:
            atomic.remove_temp(tmp)
        self.pending = []


def repacked_name(layer_id: int) -> str:
    return f"engram-layer{layer_id}.safetensors"


def foreign_repack_files(ckpt: Checkpoint, out_dir: Path) -> list[Path]:
    """Files in ``out_dir`` that a re-pack would replace but that no re-pack wrote (their
    header lacks our producer mark): replacing them needs ``--force``."""
    spec = ckpt.config.require_engram("re-packing Engram tables")
    out: list[Path] = []
    for lid in spec.layer_ids:
        f = out_dir / repacked_name(lid)
        if not f.exists():
            continue
        try:
            header, _ = read_safetensors_header(f)
            ours = (
                isinstance(header.get("__metadata__"), dict)
                and header["__metadata__"].get("producer") == REPACK_PRODUCER
            )
        except EngramError:
            ours = False
        if not ours:
            out.append(f)
    return out


def repack_tables(
    ckpt: Checkpoint,
    out_dir: str | Path,
    quant_block: int | None = None,
    chunk_rows: int = 1 << 16,
    progress: bool = True,
) -> RepackedTables:
    """Write each Engram layer's table for ``out_dir/engram-layer{L}.safetensors`` as FP8
    e4m3 rows + ue8m0 scales (quantizing bf16 tables, copying FP8 ones), streamed in
    chunks of ``chunk_rows`` rows, under temporary names (see :class:`RepackedTables`)."""
    import torch
    from tqdm.auto import tqdm

    from engram_trt.engram.quant import quantize_fp8_rows

    spec = ckpt.config.require_engram("re-packing Engram tables")
    block = int(quant_block or spec.quant_block)
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    result = RepackedTables([])
    src_refs = checkpoint_table_refs(ckpt)
    total = sum(r.nbytes for r in src_refs if r.role == "rows")
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="repack tables", disable=not progress, leave=False)
    try:
        for li, lid in enumerate(spec.layer_ids):
            names = engram_tensor_names(lid, spec.prefix)
            info = ckpt.info(names["table"])
            rows, hd = info.shape
            if hd % block:
                raise EngramError(
                    f"table {names['table']} rows of width {hd} are not a multiple of the FP8 block {block}"
                )
            view = ckpt.raw_rows_view(names["table"])
            fp8 = info.itemsize == 1
            scale_view = ckpt.raw_rows_view(names["scale"]) if fp8 else None

            def rows_chunks(view: Any = view, fp8: bool = fp8) -> Any:
                for a in range(0, rows, chunk_rows):
                    piece = view[a : a + chunk_rows]
                    bar.update(piece.nbytes)
                    if fp8:
                        yield piece
                    else:
                        q, _ = quantize_fp8_rows(torch.from_numpy(piece.copy()).view(torch.bfloat16).float(), block)
                        yield q.numpy()

            def scale_chunks(view: Any = view, scale_view: Any = scale_view, fp8: bool = fp8) -> Any:
                for a in range(0, rows, chunk_rows):
                    if fp8:
                        yield scale_view[a : a + chunk_rows]
                    else:
                        _, s = quantize_fp8_rows(
                            torch.from_numpy(view[a : a + chunk_rows].copy()).view(torch.bfloat16).float(), block
                        )
                        yield s.numpy()

            final = (out / repacked_name(lid)).resolve()
            atomic.clean_dead_temps(final)
            tmp = atomic.temp_sibling(final, "repack", make_dir=False)
            result.pending.append((tmp, final))
            specs = [
                (names["table"], "F8_E4M3", (rows, hd), rows * hd, rows_chunks()),
                (names["scale"], "F8_E8M0", (rows, hd // block), rows * (hd // block), scale_chunks()),
            ]
            # Scales of a bf16 table come from the same quantization as its rows: compute
            # them in a second pass (cheap next to the I/O) rather than hold them all.
            where = _write_safetensors_streamed(tmp, specs)
            for role, (name, st, shape, nb, _) in zip(("rows", "scales"), specs):
                result.refs.append(TableRef(lid, li, role, name, tmp, where[name][0], nb, shape, st))
    except BaseException:
        result.discard()
        raise
    finally:
        bar.close()
    log.info("re-packed %d Engram tables as FP8 for %s", len(spec.layer_ids), out)
    return result


def write_manifest(path: str | Path, manifest: dict[str, Any]) -> Path:
    p = Path(path)
    p.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return p


def read_manifest(engine_dir: str | Path) -> dict[str, Any]:
    p = Path(engine_dir) / MANIFEST_NAME
    if not p.is_file():
        raise EngramError(
            f"'{engine_dir}' has no {MANIFEST_NAME} (build it with `engram-trt build CHECKPOINT --output {shlex.quote(str(engine_dir))}`)"
        )
    try:
        data = read_json_object(p, MANIFEST_NAME)
    except EngramError as exc:
        raise EngramError(f"{exc} (the engine folder is damaged; rebuild it)") from None
    if data.get("manifest_version") != MANIFEST_VERSION:
        raise EngramError(
            f"{p}: manifest version {str(data.get('manifest_version'))[:20]} is not {MANIFEST_VERSION}; rebuild the engine folder"
        )
    return data


def is_engine_folder(path: Path) -> bool:
    """Whether ``path`` holds a manifest written by engram-trt (the folder is then ours
    to rebuild)."""
    try:
        data = read_json_object(Path(path) / MANIFEST_NAME, MANIFEST_NAME)
    except EngramError:
        return False
    return "manifest_version" in data and "engram_trt_version" in data


def manifest_table_refs(manifest: dict[str, Any], engine_dir: str | Path | None = None) -> list[TableRef]:
    """The manifest's tables as :class:`TableRef` (relative files taken from the engine folder)."""
    tables = manifest.get("tables", [])
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise EngramError("manifest 'tables' is not a list of table entries; rebuild the engine folder")
    base = None if engine_dir is None else Path(engine_dir)
    return [TableRef.from_json(t, base) for t in tables]


def verify_tables(manifest: dict[str, Any], progress: bool = False) -> list[str]:
    """Problems with the table files a manifest names (missing, short, changed bytes):
    the full check, every byte re-hashed."""
    from engram_trt.tables.source import table_file_problems

    refs = manifest_table_refs(manifest)
    problems = table_file_problems(refs)
    if problems:
        return problems
    return verify_table_hashes(refs, progress)
