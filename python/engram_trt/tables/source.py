"""Where each Engram table's bytes are: :class:`TableRef` (file, byte offset, length,
shape, dtype, sha256), read from a checkpoint's safetensors headers or an engine
folder's manifest, and the checks a runtime makes before it binds a table.

Why a byte range and not a tensor: a table may be hundreds of GB, so nothing here
loads it; the stores map, copy or register exactly that range. Three checks, from
cheap to thorough:

* :func:`check_table_files` at every load: each file exists and is long enough (a
  ``stat``);
* :func:`sampled_check` by default: the builder records the sha256 of every
  ``block_bytes`` block of each table (64 MiB), so a loader re-hashes a few random
  blocks within a byte budget and notices damage in proportion to what it samples, in
  a fraction of a second, on every start;
* :func:`verify_table_hashes` on request (``--verify-tables``): every byte re-hashed
  against the table's sha256.

A table may be several regions: Qwen4Exp's PLE table of a layer is the row shards
``torch.chunk(table, split_ngram_parts)`` writes (``ceil(rows / chunk)`` of them),
possibly in different safetensors files. Each shard is then its own ref (``part`` 0,
1, ... in row order, each with its own sha256 and block hashes, so the checks above
cover it unchanged), and :func:`layer_refs` joins a layer's parts into one ref whose
``regions`` lists them: the stores fill one buffer per layer region by region
(:func:`~engram_trt.tables.base.read_region_into`), the file store maps each region.

FP8 rows come with per-row ue8m0 scales (an Engram table: a ``scales`` ref), or, for a
Qwen4Exp PLE table transformers stores as an ``FP8Embedding``, with one float32 scale for
the whole table: the ref's ``table_scale`` (recorded in the manifest), no scales ref; the
stores hand such rows out as ``float8_e4m3fn`` and the consumer multiplies the rows it
gathered by the scale.
"""

from __future__ import annotations

import hashlib
import logging
import random
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from engram_trt.errors import EngramError

log = logging.getLogger(__name__)

HASH_CHUNK = 16 * 1024 * 1024
BLOCK_BYTES = 64 * 1024 * 1024  # one sampled-check unit: sha256 of each such block is recorded
DEFAULT_SAMPLE_BYTES = 256 * 1024 * 1024  # what the default sampled check reads per load
ROLES = ("rows", "scales")
_ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4}  # other table dtypes (FP8 values, ue8m0 scales) are one byte
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


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
                raise EngramError(
                    f"{path}: ended {left} bytes before the tensor's end (the file is truncated; re-copy it)"
                )
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
    # sha256 of each block_bytes block of the region (the last one may be shorter), for
    # the sampled check; None in manifests written before it existed.
    block_bytes: int | None = None
    block_hashes: tuple[str, ...] | None = None
    # Position of this region among its layer table's row shards (0 for a one-region table).
    part: int = 0
    # Set only on a joined ref (layer_refs): the layer's parts in row order; shape and
    # nbytes are the whole table's, file and offset the first part's.
    regions: tuple["TableRef", ...] = ()
    # FP8 rows scaled by this one float for the whole table (module docstring); None:
    # float rows, or FP8 rows with a scales ref.
    table_scale: float | None = None

    @property
    def parts(self) -> tuple["TableRef", ...]:
        """The byte regions holding this table, in row order (itself when it is one)."""
        return self.regions or (self,)

    def to_json(self, sha256: str | None = None) -> dict[str, Any]:
        if self.regions:
            raise EngramError(f"internal: the joined ref of {self.tensor} is not a manifest entry (write its parts)")
        d = {
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
        if self.block_hashes is not None:
            d["block_bytes"] = self.block_bytes
            d["block_hashes"] = list(self.block_hashes)
        if self.part:
            d["part"] = self.part
        if self.table_scale is not None:
            d["table_scale"] = self.table_scale
        return d

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
            block_bytes = None if d.get("block_bytes") is None else int(d["block_bytes"])
            blocks = d.get("block_hashes")
            if blocks is not None:
                if not isinstance(blocks, list) or not all(isinstance(b, str) and _HEX64.match(b) for b in blocks):
                    raise ValueError("block_hashes must be a list of sha256 hex digests")
                blocks = tuple(blocks)
            ref = cls(
                int(d["layer_id"]),
                int(d["layer_index"]),
                role,
                str(d["tensor"]),
                f,
                int(d["offset"]),
                int(d["nbytes"]),
                shape,
                str(d["dtype"]),
                None if d.get("sha256") is None else str(d["sha256"]),
                block_bytes,
                blocks,
                int(d.get("part", 0)),
                table_scale=None if d.get("table_scale") is None else float(d["table_scale"]),
            )
            if ref.part < 0:
                raise ValueError(f"part {ref.part}")
            if ref.table_scale is not None and not (ref.table_scale > 0 and ref.table_scale < float("inf")):
                raise ValueError(f"table_scale {ref.table_scale}")
        except (KeyError, TypeError, ValueError) as exc:
            raise EngramError(
                f"manifest table entry {str(dict(d))[:200]} is malformed ({exc}); rebuild the engine folder"
            ) from None
        if ref.offset < 0 or ref.nbytes <= 0 or len(shape) != 2 or shape[0] * shape[1] * ref.itemsize != ref.nbytes:
            raise EngramError(
                f"manifest table entry for {ref.tensor}: shape {list(shape)} x {ref.itemsize} bytes does not match "
                f"nbytes={ref.nbytes}; rebuild the engine folder"
            )
        if ref.block_hashes is not None:
            if (
                ref.block_bytes is None
                or ref.block_bytes < 1
                or len(ref.block_hashes) != -(-ref.nbytes // ref.block_bytes)
            ):
                raise EngramError(
                    f"manifest table entry for {ref.tensor}: {len(ref.block_hashes)} block hashes do not cover "
                    f"{ref.nbytes} bytes in blocks of {ref.block_bytes}; rebuild the engine folder"
                )
        return ref

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE.get(self.dtype, 1)

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
            refs.append(
                TableRef(
                    lid, li, role, name, info.file.resolve(), info.data_offset, info.nbytes, info.shape, info.st_dtype
                )
            )
    return refs


def hash_region(
    path: str | Path, offset: int, nbytes: int, block_bytes: int = BLOCK_BYTES, progress: Any = None, whole: bool = True
) -> tuple[str | None, tuple[str, ...]]:
    """``(sha256 of the region, sha256 of each block_bytes block)`` in one read: the block
    hasher runs on a second thread (hashlib releases the GIL), so recording the sampled
    check's hashes costs no extra pass over a table. ``whole=False``: blocks only (the
    first item is None)."""
    if block_bytes < 1:
        raise ValueError(f"block_bytes must be positive (got {block_bytes})")
    full = hashlib.sha256() if whole else None
    blocks: list[str] = []
    left = int(nbytes)
    with open(path, "rb") as f, ThreadPoolExecutor(max_workers=1) as pool:
        f.seek(int(offset))
        while left > 0:
            block = hashlib.sha256()
            in_block = min(block_bytes, left)
            while in_block > 0:
                chunk = f.read(min(HASH_CHUNK, in_block))
                if not chunk:
                    raise EngramError(
                        f"{path}: ended {left} bytes before the tensor's end (the file is truncated; re-copy it)"
                    )
                if full is None:
                    block.update(chunk)
                else:
                    pending = pool.submit(block.update, chunk)
                    full.update(chunk)
                    pending.result()
                in_block -= len(chunk)
                left -= len(chunk)
                if progress is not None:
                    progress.update(len(chunk))
            blocks.append(block.hexdigest())
    return (None if full is None else full.hexdigest()), tuple(blocks)


def hash_tables(refs: Sequence[TableRef], progress: bool = True, block_bytes: int = BLOCK_BYTES) -> list[TableRef]:
    """Each ref with its sha256 and block hashes filled in (one byte-counting bar)."""
    from tqdm.auto import tqdm

    total = sum(r.nbytes for r in refs)
    out: list[TableRef] = []
    with tqdm(total=total, unit="B", unit_scale=True, desc="hash tables", disable=not progress, leave=False) as bar:
        for r in refs:
            sha, blocks = hash_region(r.file, r.offset, r.nbytes, block_bytes, bar)
            out.append(replace(r, sha256=sha, block_bytes=block_bytes, block_hashes=blocks))
    return out


def join_parts(parts: Sequence[TableRef]) -> TableRef:
    """One ref for a table held in several regions (``parts``: the same layer and role):
    checked to be parts 0..n-1 of one width and dtype; a single part is returned as is."""
    parts = sorted(parts, key=lambda r: r.part)
    first = parts[0]
    if [r.part for r in parts] != list(range(len(parts))):
        raise EngramError(
            f"table {first.tensor}: the listed parts are {[r.part for r in parts]}, not 0..{len(parts) - 1}; "
            f"rebuild the table list (a shard is missing)"
        )
    if len(parts) == 1:
        return first
    for r in parts[1:]:
        if r.table_scale != first.table_scale:
            raise EngramError(
                f"table part {r.tensor} has table_scale {r.table_scale} but part 0 ({first.tensor}) has "
                f"{first.table_scale}: one FP8 table has one scale"
            )
        if r.dtype != first.dtype or r.shape[1:] != first.shape[1:]:
            raise EngramError(
                f"table part {r.tensor} is {r.dtype} {list(r.shape)} but part 0 ({first.tensor}) is "
                f"{first.dtype} {list(first.shape)}: the shards of one table must share width and dtype"
            )
    rows = sum(r.shape[0] for r in parts)
    return replace(
        first,
        nbytes=sum(r.nbytes for r in parts),
        shape=(rows, *first.shape[1:]),
        sha256=None,
        block_bytes=None,
        block_hashes=None,
        part=0,
        regions=tuple(parts),
    )


def layer_refs(refs: Sequence[TableRef]) -> list[tuple[TableRef, TableRef | None]]:
    """``(rows, scales or None)`` per layer, in layer order (a table in several parts
    joined by :func:`join_parts`); refuses a list that lacks a layer's rows or pairs
    scales with a bf16 table."""
    by_layer: dict[int, dict[str, list[TableRef]]] = {}
    for r in refs:
        by_layer.setdefault(r.layer_index, {}).setdefault(r.role, []).append(r)
    out: list[tuple[TableRef, TableRef | None]] = []
    for li in range(len(by_layer)):
        entry = by_layer.get(li)
        if entry is None or "rows" not in entry:
            raise EngramError(f"the table list has no rows for Engram layer index {li}; rebuild the engine folder")
        rows = join_parts(entry["rows"])
        scales = join_parts(entry["scales"]) if "scales" in entry else None
        fp8 = rows.itemsize == 1
        if rows.table_scale is not None:
            if not fp8 or scales is not None:
                raise EngramError(
                    f"table {rows.tensor} has a table_scale but is {rows.dtype}"
                    f"{' with a scale table' if scales is not None else ''}: a table_scale scales FP8 "
                    f"rows that have no per-row scales; rebuild the engine folder"
                )
            out.append((rows, None))
            continue
        if fp8 and scales is None:
            raise EngramError(
                f"table {rows.tensor} is FP8 but no scale table is listed for it; rebuild the engine folder"
            )
        if scales is not None and scales.shape[0] != rows.shape[0]:
            raise EngramError(
                f"scale table {scales.tensor} has {scales.shape[0]} rows but {rows.tensor} has {rows.shape[0]}"
            )
        out.append((rows, scales if fp8 else None))
    return out


def table_file_problems(refs: Sequence[TableRef]) -> list[str]:
    """What :func:`check_table_files` refuses, as a list (for reports such as ``inspect``)."""
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
            problems.append(
                f"{r.tensor}: file {r.file} holds {size} bytes, fewer than the table's end at {r.offset + r.nbytes}"
            )
    return problems


def check_table_files(refs: Sequence[TableRef]) -> None:
    """The check made at every load: each file exists and holds the table's whole byte
    range. One error names every table that fails, and the fix."""
    problems = table_file_problems(refs)
    if problems:
        raise EngramError(
            "Engram tables do not match the manifest: "
            + "; ".join(problems)
            + " (restore the files, or rebuild the engine folder from the checkpoint)"
        )


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


@dataclass(frozen=True)
class HashedRegion:
    """A byte range of a file with the sha256 of each of its ``block_bytes`` blocks."""

    label: str
    file: Path
    offset: int
    nbytes: int
    block_bytes: int
    block_hashes: tuple[str, ...]


def sample_blocks(regions: Sequence[HashedRegion], budget_bytes: int, seed: int | None = None) -> list[str]:
    """Re-hash random blocks of ``regions``, at most ``budget_bytes`` read (at least one
    block when the budget is positive); one problem line per block that differs."""
    pool = [(r, i) for r in regions for i in range(len(r.block_hashes))]
    if budget_bytes <= 0 or not pool:
        return []
    rng = random.Random(seed if seed is not None else random.SystemRandom().getrandbits(64))
    rng.shuffle(pool)
    problems: list[str] = []
    spent = 0
    for reg, i in pool:
        start = i * reg.block_bytes
        length = min(reg.block_bytes, reg.nbytes - start)
        if spent and spent + length > budget_bytes:
            continue  # a smaller (last) block may still fit
        spent += length
        try:
            got = sha256_file_region(reg.file, reg.offset + start, length)
        except (OSError, EngramError) as exc:
            problems.append(f"{reg.label}: {getattr(exc, 'strerror', None) or exc}")
            continue
        if got != reg.block_hashes[i]:
            problems.append(
                f"{reg.label}: bytes {start}..{start + length} in {reg.file} changed since they were recorded "
                f"(sampled block {i} of {len(reg.block_hashes)}: sha256 differs)"
            )
        if spent >= budget_bytes:
            break
    log.debug("sampled check: %d bytes of %d regions re-hashed, %d problem(s)", spent, len(regions), len(problems))
    return problems


def sampled_check(
    refs: Sequence[TableRef], budget_bytes: int = DEFAULT_SAMPLE_BYTES, seed: int | None = None
) -> list[str]:
    """Problems found by re-hashing random recorded blocks of the tables, at most
    ``budget_bytes`` read. Cheap enough for every load: the default reads 256 MiB, a
    fraction of a second from the page cache; damage is found with the probability
    that a damaged block is drawn, so repeated loads (each a fresh draw) find it ever
    more surely, and :func:`verify_table_hashes` (``--verify-tables``) always. Refs
    without block hashes (manifests written before they existed) are skipped; sizes
    are :func:`check_table_files`' job. ``seed`` fixes the draw (tests); None draws
    from the OS."""
    regions = [
        HashedRegion(r.tensor, r.file, r.offset, r.nbytes, r.block_bytes, r.block_hashes)
        for r in refs
        if r.block_hashes and r.block_bytes
    ]
    return sample_blocks(regions, budget_bytes, seed)
