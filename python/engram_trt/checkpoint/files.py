"""Safetensors files as the checkpoint reads them: the header held to the safetensors
library's own rules, and every file confined to its checkpoint folder.

Why here and not in :mod:`.checkpoint`: these are the checks on bytes and paths a user
hands us (a damaged or hostile header, an index entry climbing out of the folder, a
shard that links elsewhere), each refused in one line naming the file; the checkpoint
module builds on them.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import torch

from engram_trt.errors import CheckpointError

# The safetensors library refuses headers over 100 MB (MAX_HEADER_SIZE); so do we,
# before reading one into memory.
MAX_HEADER_BYTES = 100_000_000
_U64 = 2**64

FP8_TABLE_DTYPES = ("F8_E4M3", "U8")
FP8_SCALE_DTYPES = ("F8_E8M0", "U8")
BF16_TABLE_DTYPES = ("BF16",)

# safetensors dtype string -> (torch dtype, bytes per element)
ST_DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F64": (torch.float64, 8),
    "F32": (torch.float32, 4),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "F8_E4M3": (torch.float8_e4m3fn, 1),
    "F8_E5M2": (torch.float8_e5m2, 1),
    "F8_E8M0": (torch.float8_e8m0fnu, 1),
    "I64": (torch.int64, 8),
    "I32": (torch.int32, 4),
    "I16": (torch.int16, 2),
    "I8": (torch.int8, 1),
    "U64": (torch.uint64, 8),
    "U32": (torch.uint32, 4),
    "U16": (torch.uint16, 2),
    "U8": (torch.uint8, 1),
    "BOOL": (torch.bool, 1),
}


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives, read from its shard's header (no data touched)."""

    name: str
    file: Path
    st_dtype: str
    shape: tuple[int, ...]
    data_offset: int  # absolute offset of the first byte in the file
    nbytes: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return ST_DTYPES[self.st_dtype][0]

    @property
    def itemsize(self) -> int:
        return ST_DTYPES[self.st_dtype][1]


def read_safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """The JSON header of a safetensors file and the absolute offset of its data area.

    The format is: u64 little-endian header length N, N bytes of UTF-8 JSON (an
    object), then the data; each tensor's ``data_offsets`` are relative to byte
    ``8 + N``. Refused as the library refuses them: N over 100 MB, N past the file's
    end, bytes that are not UTF-8, text not starting with ``{``, invalid JSON; and,
    stricter than the library, a key given twice.
    """
    damaged = f"{path}: the safetensors header is not valid JSON (the file is damaged; re-copy it)"
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise CheckpointError(f"{path}: too short to be a safetensors file (re-write the checkpoint)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise CheckpointError(
                    f"{path}: header length {n} exceeds the file size {size}: "
                    "the file is truncated or not safetensors (re-copy it)"
                )
            if n > MAX_HEADER_BYTES:
                raise CheckpointError(
                    f"{path}: header of {n} bytes is larger than safetensors allows ({MAX_HEADER_BYTES}); "
                    "the file is damaged or not safetensors (re-copy it)"
                )
            raw = f.read(n)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror}); check the file's permissions") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise CheckpointError(
            f"{path}: the safetensors header is not UTF-8 (the file is damaged; re-copy it)"
        ) from None
    if not text.startswith("{"):
        raise CheckpointError(damaged)

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(pairs)
        if len(out) != len(pairs):
            raise CheckpointError(f"{path}: the safetensors header names a key twice (the file is damaged; re-copy it)")
        return out

    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")  # NaN / Infinity: the library refuses them

    try:
        header = json.loads(text, object_pairs_hook=no_duplicates, parse_constant=no_constants)
    except (ValueError, RecursionError):
        raise CheckpointError(damaged) from None
    if not isinstance(header, dict):
        raise CheckpointError(damaged)
    return header, 8 + n


def _is_u64(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < _U64


def _tensor_infos(path: Path) -> dict[str, TensorInfo]:
    """Every tensor's place in a shard, checked as the safetensors library checks it:
    known dtypes, shape x itemsize equal to the byte span, the spans in offset order
    tiling the data area from 0 to the file's end with no gap or overlap."""
    header, base = read_safetensors_header(path)
    size = path.stat().st_size
    meta = header.get("__metadata__")
    if meta is not None and (not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values())):
        raise CheckpointError(
            f"{path}: the header's __metadata__ must map names to strings (the file is damaged; re-copy it)"
        )
    out: dict[str, TensorInfo] = {}
    spans: list[tuple[int, int, str]] = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        shown = name if len(name) <= 120 else name[:117] + "..."
        damaged = f"{path}: the header entry of tensor '{shown}' is malformed (the file is damaged; re-copy it)"
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            raise CheckpointError(
                f"{path}: a tensor name in the header is not valid UTF-8 (the file is damaged; re-copy it)"
            ) from None
        if not isinstance(meta, dict) or set(meta) != {"dtype", "shape", "data_offsets"}:
            raise CheckpointError(damaged)
        st_dtype = meta.get("dtype")
        if st_dtype not in ST_DTYPES:
            raise CheckpointError(
                f"{path}: tensor '{shown}' has dtype {str(st_dtype)[:40]!r}, "
                f"which engram-trt does not read (expected one of {sorted(ST_DTYPES)})"
            )
        offsets, shape_list = meta.get("data_offsets"), meta.get("shape")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not isinstance(shape_list, list)
            or not all(_is_u64(x) for x in offsets + shape_list)
        ):
            raise CheckpointError(damaged)
        begin, end = offsets
        shape = tuple(shape_list)
        # As the library counts: elements dim by dim, then bits, each step within u64
        # (a shape [2^62, 2^62, 0] holds no bytes but overflows on the way).
        count, overflow = 1, False
        for dim in shape:
            count *= dim
            overflow |= count >= _U64
        overflow |= count * ST_DTYPES[st_dtype][1] * 8 >= _U64
        want = count * ST_DTYPES[st_dtype][1]
        if overflow:
            raise CheckpointError(
                f"{path}: tensor '{shown}' declares shape {list(shape)}, "
                "more bytes than a file can hold (the file is damaged; re-copy it)"
            )
        if end < begin or end - begin != want:
            raise CheckpointError(
                f"{path}: tensor '{shown}' declares shape {list(shape)} ({want} bytes as {st_dtype}) "
                f"but spans {end - begin} bytes (the file is damaged; re-copy it)"
            )
        if base + end > size:
            raise CheckpointError(
                f"{path}: tensor '{shown}' ends at byte {base + end} but the file has {size} bytes: "
                "the file is truncated (re-copy it)"
            )
        out[name] = TensorInfo(name, path, st_dtype, shape, base + begin, end - begin)
        spans.append((begin, end, shown))
    at = 0
    for begin, end, shown in sorted(spans):
        if begin != at:
            raise CheckpointError(
                f"{path}: tensor '{shown}' starts at data byte {begin}, not {at} where the previous tensor ends "
                f"(safetensors tensors tile the data with no gap or overlap; the file is damaged, re-copy it)"
            )
        at = end
    if base + at != size:
        raise CheckpointError(
            f"{path}: the tensors end at byte {base + at} but the file has {size} bytes (safetensors files end with "
            f"their last tensor; the file is damaged or was appended to, re-copy it)"
        )
    return out


def checkpoint_boundary(root: Path) -> Path:
    """The folder a checkpoint's files must resolve into: the folder itself or, for a
    Hugging Face hub snapshot (``models--ORG--NAME/snapshots/REV``, whose files are
    links to ``../../blobs/``), the repository folder that holds the blobs."""
    real = Path(root).resolve()
    if real.parent.name == "snapshots" and (real.parent.parent / "blobs").is_dir():
        return real.parent.parent
    return real


def confined_file(root: Path, rel: Any, what: str) -> Path:
    """``root / rel`` for a file name a checkpoint names, refused when the name is
    absolute, climbs out (``..``), or the file is a link that leads out of the folder:
    a checkpoint reads only its own files."""
    if not isinstance(rel, str) or not rel or "\x00" in rel or "\\" in rel:
        raise CheckpointError(
            f"{what}: {str(rel)[:80]!r} is not a file name inside the checkpoint folder (fix the entry)"
        )
    pr = PurePosixPath(rel)
    if pr.is_absolute() or ".." in pr.parts or rel.startswith("~"):
        raise CheckpointError(
            f"{what}: '{rel[:120]}' points outside the checkpoint folder '{root}' "
            "(entries must be file names inside it; fix the entry)"
        )
    p = Path(root) / rel
    boundary = checkpoint_boundary(root)
    try:
        real = p.resolve()
    except (OSError, RuntimeError):  # a link loop
        raise CheckpointError(
            f"{what}: '{p}' is a link that cannot be resolved (a loop?); replace it with the file"
        ) from None
    if real != boundary and boundary not in real.parents:
        raise CheckpointError(
            f"{what}: '{p}' is a link that leads out of the checkpoint folder (to '{real}'); "
            "copy the file into the folder, or open the folder it lives in"
        )
    return p
