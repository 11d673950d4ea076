"""The shared-table segment: its on-disk format, its names, its lock, and the
inspection and removal behind ``engram-trt shm list`` / ``shm clean``. Imports no
torch, so the CLI answers at once; the store that creates and attaches segments is
:mod:`.shared`.

Format (little-endian), version 1::

    0   8   magic  b"ENGRMTBL"
    8   4   format version
    12  4   ready flag: READY (0x59444552) once every byte is written and flushed, else 0
    16  8   total size of the file in bytes
    24  8   creator pid
    32  8   creation time (ns since the epoch)
    40  8   length of the JSON description that follows
    48  64  layout hash (hex sha256)
    112 ..  JSON: {"tables": [{tensor, layer_id, layer_index, role, shape, dtype, nbytes,
                offset, sha256, file}], "created_by": ...}
    then each table's bytes at its offset, every offset a multiple of 2 MiB.

Why each part: the magic tells our files from anything else in ``/dev/shm`` (nothing
here ever removes a file without it); the version and layout hash refuse a segment
this code cannot read or that holds other tables; the ready flag, written last, and
the rename of a finished temp file into place mean no reader ever maps half a table;
the creator pid tells ``shm list`` and a re-opener whether a half-written file's
writer is still alive.

Names: ``engram-trt-<hash16>.tables`` (the segment), ``...tables.<pid>.tmp`` (being
written by that pid), ``...tables.lock`` (flock'ed while a segment is created, so
concurrent starters make one segment). The name derives from the layout hash, so new
tables get a new segment and never overwrite one in use.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shlex
import struct
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from engram_trt.errors import EngramError
from engram_trt.tables.source import TableRef

log = logging.getLogger(__name__)

DEFAULT_DIR = Path("/dev/shm")
MAGIC = b"ENGRMTBL"
FORMAT_VERSION = 1
READY = 0x59444552  # "REDY": a zeroed or torn header never reads as ready
HEADER = struct.Struct("<8sIIQQQQ64s")
READY_OFFSET = 12
MAX_DESCRIPTION = 1 << 20  # the JSON fits well within the first 2 MiB
LOCK_TAG = b"engram-trt-lock"
_NAME = re.compile(r"^engram-trt-(?P<hash>[0-9a-f]{16})\.tables(?:\.(?P<pid>\d+)\.tmp|(?P<lock>\.lock))?$")


# ------------------------------------------------------------------ names and hash
def layout_hash(refs: Sequence[TableRef]) -> str:
    """What a segment holds, as one hex sha256: per table its tensor name, layer,
    role, shape, dtype and size, and its content's sha256 when the manifest records it,
    else the source file's identity (device, inode, size, mtime, offset). So the same
    tables from an engine folder share one segment wherever the folder lies, while a
    checkpoint rewritten in place (or replaced by a rename) gets a new segment."""
    from engram_trt.tables.hostmem import DATA_ALIGN, ordered_refs

    items: list[dict[str, Any]] = []
    for r in ordered_refs(refs):
        item: dict[str, Any] = {
            "tensor": r.tensor,
            "layer_id": r.layer_id,
            "role": r.role,
            "shape": list(r.shape),
            "dtype": r.dtype,
            "nbytes": r.nbytes,
        }
        if r.regions:  # a table in several shards: each shard's content (or file identity)
            item["parts"] = [_content_key(p) for p in r.regions]
        else:
            item.update(_content_key(r))
        items.append(item)
    blob = json.dumps({"align": DATA_ALIGN, "tables": items}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def _content_key(r: TableRef) -> dict[str, Any]:
    """A region's content: its recorded sha256, else its file's identity."""
    if r.sha256:
        return {"sha256": r.sha256}
    st = os.stat(r.file)
    return {
        "file": {"dev": st.st_dev, "ino": st.st_ino, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "offset": r.offset}
    }


def segment_name(layout: str) -> str:
    return f"engram-trt-{layout[:16]}.tables"


def temp_name(name: str, pid: int) -> str:
    return f"{name}.{pid}.tmp"


def lock_name(name: str) -> str:
    return f"{name}.lock"


def parse_name(filename: str) -> tuple[str, str, int | None] | None:
    """``(segment name, 'segment' | 'temp' | 'lock', writer pid or None)`` for one of
    our file names, else None."""
    m = _NAME.match(filename)
    if m is None:
        return None
    seg = f"engram-trt-{m.group('hash')}.tables"
    if m.group("pid"):
        return seg, "temp", int(m.group("pid"))
    return seg, ("lock" if m.group("lock") else "segment"), None


# ------------------------------------------------------------------ header
@dataclass
class SegmentHeader:
    version: int
    ready: bool
    total_size: int
    creator_pid: int
    created_ns: int
    layout_hash: str
    tables: list[dict[str, Any]] = field(default_factory=list)
    problem: str | None = None  # set when the description cannot be read

    def pack(self) -> bytes:
        desc = json.dumps({"tables": self.tables, "created_by": "engram-trt"}, separators=(",", ":")).encode()
        if len(desc) > MAX_DESCRIPTION:
            raise EngramError(f"internal: segment description of {len(desc)} bytes")
        return (
            HEADER.pack(
                MAGIC,
                self.version,
                READY if self.ready else 0,
                self.total_size,
                self.creator_pid,
                self.created_ns,
                len(desc),
                self.layout_hash.encode(),
            )
            + desc
        )

    @property
    def header_bytes(self) -> int:
        return len(self.pack())


def read_header(path: str | Path) -> SegmentHeader | None:
    """The header of ``path``, or None when the file does not start with our magic
    (not ours: never touched). A torn description is reported in ``problem``."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER.size)
            if len(head) < HEADER.size or head[:8] != MAGIC:
                return None
            magic, version, ready, total, pid, created, desc_len, lhash = HEADER.unpack(head)
            hdr = SegmentHeader(version, ready == READY, total, pid, created, lhash.decode("ascii", "replace"))
            if desc_len > MAX_DESCRIPTION:
                hdr.problem = f"description length {desc_len} is impossible"
                return hdr
            try:
                hdr.tables = list(json.loads(f.read(desc_len))["tables"])
            except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
                hdr.problem = f"unreadable description ({exc})"
            return hdr
    except OSError:
        return None


def is_blank_start(path: str | Path) -> bool:
    """True for a file that is empty or starts with zeros: a temp file whose creator died
    before it wrote the header (the only moment one of our files lacks the magic)."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER.size)
    except OSError:
        return False
    return not head.strip(b"\0")


# ------------------------------------------------------------------ processes
def pid_alive(pid: int | None) -> bool:
    if not pid or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, another user's
    return True


def mapped_by(paths: Sequence[Path]) -> dict[Path, list[int]]:
    """For each file, the pids that have it mapped (from every readable
    ``/proc/<pid>/maps``, matched by device and inode, so a renamed file still counts)."""
    keys: dict[tuple[int, int], Path] = {}
    for p in paths:
        try:
            st = os.stat(p)
        except OSError:
            continue
        keys[(st.st_dev, st.st_ino)] = p
    out: dict[Path, list[int]] = {p: [] for p in paths}
    if not keys:
        return out
    inodes = {ino for _, ino in keys}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            with open(f"/proc/{pid}/maps") as f:
                lines = f.readlines()
        except OSError:
            continue
        seen: set[Path] = set()
        for line in lines:
            parts = line.split(None, 5)
            if len(parts) < 6:
                continue
            try:
                ino = int(parts[4])
            except ValueError:
                continue
            if ino not in inodes:
                continue
            major, _, minor = parts[3].partition(":")
            try:
                dev = os.makedev(int(major, 16), int(minor, 16))
            except ValueError:
                continue
            p = keys.get((dev, ino))
            if p is not None and p not in seen:
                seen.add(p)
                out[p].append(pid)
    return out


# ------------------------------------------------------------------ lock
def _lock_fd(path: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    return fd


def lock_holder(path: Path) -> int | None:
    """The pid written in a lock file by its last holder."""
    try:
        text = path.read_bytes()
    except OSError:
        return None
    m = re.match(rb"engram-trt-lock pid=(\d+)", text)
    return int(m.group(1)) if m else None


@contextmanager
def segment_lock(
    directory: Path, name: str, blocking: bool = True, on_wait: Callable[[int | None], None] | None = None
) -> Iterator[bool]:
    """Hold the segment's creation lock (flock on ``<name>.lock``). Yields True once
    held; with ``blocking=False`` yields False at once when another process holds it.
    After each acquisition the lock file is checked to be the one at the path (a
    concurrent ``shm clean`` may have removed it), so two holders never coexist."""
    path = directory / lock_name(name)
    while True:
        fd = _lock_fd(path)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not blocking:
                    os.close(fd)
                    yield False
                    return
                if on_wait is not None:
                    on_wait(lock_holder(path))
                fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.pwrite(fd, LOCK_TAG + f" pid={os.getpid()}\n".encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        return


def lock_is_free(directory: Path, name: str) -> bool:
    """Whether nobody holds the segment's lock now (taken and dropped at once)."""
    path = directory / lock_name(name)
    if not path.exists():
        return True
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


# ------------------------------------------------------------------ inspection
@dataclass
class SegmentFile:
    """One of our files in the directory, as ``shm list`` reports it."""

    name: str
    path: Path
    role: str  # 'segment' | 'temp' | 'lock'
    segment: str  # the segment name it belongs to
    size: int
    state: str  # 'ready' | 'half-written' | 'being written' | 'lock' | 'not ours'
    layout_hash: str | None = None
    version: int | None = None
    creator_pid: int | None = None
    creator_alive: bool | None = None
    mapped_by: list[int] = field(default_factory=list)
    created: str | None = None

    @property
    def ours(self) -> bool:
        return self.state != "not ours"

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["path"] = str(self.path)
        return d


def scan(directory: str | Path = DEFAULT_DIR) -> list[SegmentFile]:
    """Every file in ``directory`` with one of our names, with its state and mappers.
    A file with our name but not our magic is listed as 'not ours' (and never removed)."""
    d = Path(directory)
    if not d.is_dir():
        raise EngramError(
            f"shared-memory directory {d} does not exist or is not a directory; pass an existing one with --dir"
        )
    found: list[SegmentFile] = []
    for entry in sorted(os.scandir(d), key=lambda e: e.name):
        parsed = parse_name(entry.name)
        if parsed is None or not entry.is_file(follow_symlinks=False):
            continue
        seg, role, pid = parsed
        path = Path(entry.path)
        size = entry.stat(follow_symlinks=False).st_size
        if role == "lock":
            holder = lock_holder(path)
            ours = path.read_bytes()[: len(LOCK_TAG)] == LOCK_TAG if size else True
            found.append(
                SegmentFile(
                    entry.name,
                    path,
                    role,
                    seg,
                    size,
                    "lock" if ours else "not ours",
                    creator_pid=holder,
                    creator_alive=pid_alive(holder) if holder else None,
                )
            )
            continue
        hdr = read_header(path)
        if hdr is None:
            # Our name without our magic: a temp file whose writer died before the
            # header (blank start), else someone else's file.
            if role == "temp" and is_blank_start(path):
                state = "half-written" if lock_is_free(d, seg) else "being written"
            else:
                state = "not ours"
            found.append(
                SegmentFile(
                    entry.name,
                    path,
                    role,
                    seg,
                    size,
                    state,
                    creator_pid=pid,
                    creator_alive=pid_alive(pid) if pid else None,
                )
            )
            continue
        if role == "temp":
            state = "half-written" if lock_is_free(d, seg) else "being written"
        else:
            state = "ready" if hdr.ready and hdr.total_size == size and hdr.problem is None else "half-written"
        found.append(
            SegmentFile(
                entry.name,
                path,
                role,
                seg,
                size,
                state,
                hdr.layout_hash,
                hdr.version,
                hdr.creator_pid,
                pid_alive(hdr.creator_pid),
                created=time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(hdr.created_ns / 1e9)),
            )
        )
    maps = mapped_by([f.path for f in found if f.role != "lock"])
    for f in found:
        f.mapped_by = maps.get(f.path, [])
    return found


# ------------------------------------------------------------------ removal
@dataclass
class CleanResult:
    removed: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # ours, left in place (with the reason)


def clean(
    directory: str | Path = DEFAULT_DIR, names: Sequence[str] = (), all_: bool = False, force: bool = False
) -> CleanResult:
    """Remove our segments and leftovers from ``directory``.

    ``names``: those segments (their temp and lock files go with them); ``all_``: every
    file of ours; neither: only leftovers (half-written segments and temp files whose
    writer is gone, and locks of segments that no longer exist). A segment mapped by a
    live process, or a temp file being written, is refused unless ``force`` (those
    processes keep their mapping; the memory is freed when the last one unmaps). Files
    without our magic are never touched: naming one is an error."""
    d = Path(directory)
    files = scan(d)
    by_name = {f.name: f for f in files}
    if names:
        targets: list[SegmentFile] = []
        for n in names:
            base = Path(n).name
            f = by_name.get(base)
            if f is None:
                if parse_name(base) is None:
                    raise EngramError(
                        f"{n!r} is not an engram-trt segment name (they look like engram-trt-<16 hex>.tables; "
                        f"`engram-trt shm list --dir {shlex.quote(str(d))}` shows them)"
                    )
                raise EngramError(
                    f"no segment {base} in {d} (`engram-trt shm list --dir {shlex.quote(str(d))}` shows what is there)"
                )
            if not f.ours:
                raise EngramError(
                    f"{f.path} has an engram-trt name but not its header: it is not ours, so shm clean leaves it; "
                    "remove it yourself if nobody needs it"
                )
            group = [g for g in files if g.segment == f.segment and g.ours] if f.role == "segment" else [f]
            targets.extend(g for g in group if g not in targets)
    elif all_:
        targets = [f for f in files if f.ours]
    else:
        live_segments = {f.segment for f in files if f.role != "lock" and f.state != "half-written"}
        targets = [
            f
            for f in files
            if f.ours and (f.state == "half-written" or (f.role == "lock" and f.segment not in live_segments))
        ]
    busy = []
    for f in targets:
        live = [p for p in f.mapped_by if pid_alive(p)]
        if f.role != "lock" and live:
            busy.append(f"{f.name} is mapped by pid{'s' if len(live) > 1 else ''} {', '.join(map(str, live))}")
        elif f.state == "being written":
            busy.append(f"{f.name} is being written by pid {f.creator_pid}")
    if busy and not force:
        raise EngramError(
            f"not removed: {'; '.join(busy)} (stop those processes first, or pass --force: "
            "they keep their mapping until they exit)"
        )
    result = CleanResult()
    for f in targets:
        if f.role == "lock":
            continue
        with segment_lock(d, f.segment, blocking=False) as held:
            if not held and not force:
                result.kept.append(f"{f.name} (a process is creating this segment now)")
                continue
            if read_header(f.path) is None and not (f.role == "temp" and is_blank_start(f.path)):
                result.kept.append(f"{f.name} (its header changed: not ours any more)")
                continue
            _unlink(f.path, result)
    # A segment's lock goes once none of its files remain and nobody holds it (taking
    # the lock above may have created one: it goes too).
    for seg in sorted({f.segment for f in targets}):
        lock = d / lock_name(seg)
        if not lock.exists():
            continue
        if any(g.segment == seg and g.role != "lock" for g in scan(d)) or not lock_is_free(d, seg):
            if any(f.role == "lock" and f.segment == seg for f in targets):
                result.kept.append(f"{lock.name} (its segment's files remain or a process holds it)")
            continue
        if lock.read_bytes()[: len(LOCK_TAG)] in (LOCK_TAG, b""):
            _unlink(lock, result)
    return result


def _unlink(path: Path, result: CleanResult) -> None:
    try:
        path.unlink()
        result.removed.append(path.name)
    except FileNotFoundError:
        pass
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM):
            raise EngramError(
                f"cannot remove {path}: {exc.strerror} (it belongs to another user; run shm clean as that user)"
            ) from None
        raise
