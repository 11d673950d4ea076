"""Where each Engram table's bytes are: :class:`TableRef` (file, byte offset, length,
shape, dtype, sha256), read from a checkpoint's safetensors headers or an engine
folder's manifest, and the checks a runtime makes before it binds a table.

Why a byte range and not a tensor: a table may be hundreds of GB, so nothing here
loads it; the stores map, copy or register exactly that range. The size check runs at
every load (cheap: a ``stat``); the full sha256 check streams the bytes and runs on
request (``verify_tables=True`` / ``--verify-tables``).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from engram_trt.errors import EngramError

log = logging.getLogger(__name__)

HASH_CHUNK = 16 * 1024 * 1024
ROLES = ("rows", "scales")


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
    sha256: str | None = None

    def to_json(self, sha256: str | None = None) -> dict[str, Any]:
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
            "sha256": sha256 if sha256 is not None else self.sha256,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any], base: Path | None = None) -> "TableRef":
        """From a manifest entry; a relative ``file`` is taken relative to ``base``."""
        try:
            f = Path(str(d["file"]))
            if not f.is_absolute() and base is not None:
                f = base / f
            role = str(d["role"])
            if role not in ROLES:
                raise ValueError(f"role {role!r}")
            shape = tuple(int(x) for x in d["shape"])
            ref = cls(int(d["layer_id"]), int(d["layer_index"]), role, str(d["tensor"]), f, int(d["offset"]),
                      int(d["nbytes"]), shape, str(d["dtype"]), None if d.get("sha256") is None else str(d["sha256"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise EngramError(f"manifest table entry {dict(d)!r} is malformed ({exc}); rebuild the engine folder") from None
        if ref.offset < 0 or ref.nbytes <= 0 or len(shape) != 2 or shape[0] * shape[1] * ref.itemsize != ref.nbytes:
            raise EngramError(f"manifest table entry for {ref.tensor}: shape {list(shape)} x {ref.itemsize} bytes does not match nbytes={ref.nbytes}; rebuild the engine folder")
        return ref

    @property
    def itemsize(self) -> int:
        return 2 if self.dtype in ("BF16", "F16") else 1

    @property
    def row_bytes(self) -> int:
        return self.nbytes // self.shape[0]


def checkpoint_table_refs(ckpt: Any) -> list[TableRef]:
    """Every table tensor (rows, and scales for FP8) of a checkpoint, in layer order."""
    from engram_trt.checkpoint.checkpoint import engram_tensor_names

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


def layer_refs(refs: Sequence[TableRef]) -> list[tuple[TableRef, TableRef | None]]:
    """``(rows, scales or None)`` per Engram layer, in layer order; refuses a list that
    lacks a layer's rows or pairs scales with a bf16 table."""
    by_layer: dict[int, dict[str, TableRef]] = {}
    for r in refs:
        by_layer.setdefault(r.layer_index, {})[r.role] = r
    out: list[tuple[TableRef, TableRef | None]] = []
    for li in range(len(by_layer)):
        entry = by_layer.get(li)
        if entry is None or "rows" not in entry:
            raise EngramError(f"the table list has no rows for Engram layer index {li}; rebuild the engine folder")
        rows, scales = entry["rows"], entry.get("scales")
        fp8 = rows.itemsize == 1
        if fp8 and scales is None:
            raise EngramError(f"table {rows.tensor} is FP8 but no scale table is listed for it; rebuild the engine folder")
        if scales is not None and scales.shape[0] != rows.shape[0]:
            raise EngramError(f"scale table {scales.tensor} has {scales.shape[0]} rows but {rows.tensor} has {rows.shape[0]}")
        out.append((rows, scales if fp8 else None))
    return out


def check_table_files(refs: Sequence[TableRef]) -> None:
    """The check made at every load: each file exists and holds the table's whole byte
    range. One error names every table that fails, and the fix."""
    problems: list[str] = []
    for r in refs:
        try:
            size = r.file.stat().st_size
        except FileNotFoundError:
            problems.append(f"{r.tensor}: file {r.file} is missing")
            continue
        except OSError as exc:
            problems.append(f"{r.tensor}: file {r.file} cannot be read ({exc.strerror})")
            continue
        if size < r.offset + r.nbytes:
            problems.append(f"{r.tensor}: file {r.file} holds {size} bytes, fewer than the table's end at {r.offset + r.nbytes}")
    if problems:
        raise EngramError("Engram tables do not match the manifest: " + "; ".join(problems)
                          + " (restore the files, or rebuild the engine folder from the checkpoint)")


def verify_table_hashes(refs: Sequence[TableRef], progress: bool = False) -> list[str]:
    """Problems found by the full sha256 check (every byte of every table is read)."""
    from tqdm.auto import tqdm

    problems: list[str] = []
    total = sum(r.nbytes for r in refs if r.sha256)
    with tqdm(total=total, unit="B", unit_scale=True, desc="verify tables", disable=not progress, leave=False) as bar:
        for r in refs:
            if not r.sha256:
                problems.append(f"{r.tensor}: the manifest records no sha256 to check against")
                continue
            try:
                got = sha256_file_region(r.file, r.offset, r.nbytes, bar)
            except (OSError, EngramError) as exc:
                problems.append(f"{r.tensor}: {exc}")
                continue
            if got != r.sha256:
                problems.append(f"{r.tensor}: the bytes in {r.file} changed since the build (sha256 differs)")
    return problems
