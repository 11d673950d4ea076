"""The shared store (``kind='shared'``, ``--engram-config dp_shared_memory``): one copy
of the tables in ``/dev/shm`` for every process on the node.

Why: data-parallel ranks, several engines on one host and restarted servers all need
the same hundreds of GiB of tables; a private copy each multiplies RAM by the process
count and makes every start re-read the tables from disk. A segment (a tmpfs file, see
:mod:`.segment` for the format) is made once and mapped ``MAP_SHARED`` by every
process; with a GPU each process registers its own mapping for UVA, in chunks.

How a process gets its segment (:meth:`SharedTables.open`):

1. The name derives from the layout hash. If the segment exists and its header is
   ready and matches, attach (seconds, whatever the table size).
2. Otherwise take the segment's flock'ed lock (a second process starting at the same
   time waits here, then attaches to what the first made). Under the lock, leftovers of
   a creator that died are removed with a warning naming them: temp files (nobody
   holds the lock, so their writer is gone) and a final file without the ready flag.
3. Check the directory's free space (``statvfs``; then ``posix_fallocate`` reserves
   it, so a full tmpfs fails here rather than with SIGBUS mid-copy). Too little falls
   back to private pinned memory (GPU) or plain host memory (CPU), with a warning.
4. Write the header (not ready), every table's bytes, flush, then the ready flag,
   flush, and rename the owner-only (0600) temp file into place.

A segment with another format version, layout hash or size under our name is refused
with a one-line error naming it and ``engram-trt shm clean``. Segments outlive every
process (that is the point: a crash or restart re-attaches instead of re-loading)
until ``engram-trt shm clean`` removes them or the machine reboots.

Test hook: ``ENGRAM_TRT_TEST_SHM_PAUSE=BYTES[:SECONDS]`` makes a creator stop once it has
written at least BYTES table bytes, print one line on stderr, and wait SECONDS (default:
for ever) or until it receives SIGUSR1, still holding the lock. The tests use it to
SIGKILL a creator mid-write and to start a second process while the first is still
creating. Never set it in production.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import shlex
import sys
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Sequence

from engram_trt.errors import human_bytes
from engram_trt.errors import EngramError
from engram_trt.tables import segment as seg
from engram_trt.tables.hostmem import (
    DEFAULT_CHUNK_BYTES,
    HostRegistration,
    PlacedTable,
    Registrar,
    mapping_address,
    plan_layout,
    round_up,
    tensors_over,
)
from engram_trt.tables.pinned import HostResources, PinnedTables, fill_tables
from engram_trt.tables.source import TableRef, layer_refs
from engram_trt.tables.base import TableStore, _load_progress, load_memory_tables, read_region_into

log = logging.getLogger(__name__)

TEST_PAUSE_ENV = "ENGRAM_TRT_TEST_SHM_PAUSE"
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)


def statvfs_free(directory: Path) -> int:
    """Bytes an unprivileged process may still write in ``directory``'s filesystem."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def expected_header(refs: Sequence[TableRef], layout: str) -> tuple[seg.SegmentHeader, list[PlacedTable], int]:
    """The header this process would write for ``refs`` (creator fields left zero), the
    placements and the total size: the data starts on the first 2 MiB boundary after
    the header."""
    placed, _ = plan_layout(refs)
    tables = [_table_entry(p) for p in placed]
    hdr = seg.SegmentHeader(seg.FORMAT_VERSION, False, 0, 0, 0, layout, tables)
    start = hdr.header_bytes
    placed, total = plan_layout(refs, start=start)
    hdr.tables = [_table_entry(p) for p in placed]
    if hdr.header_bytes > placed[0].offset:  # offsets grew the JSON past the boundary: place again
        placed, total = plan_layout(refs, start=hdr.header_bytes)
        hdr.tables = [_table_entry(p) for p in placed]
    hdr.total_size = total
    return hdr, placed, total


def _table_entry(p: PlacedTable) -> dict[str, Any]:
    r = p.ref
    return {
        "tensor": r.tensor,
        "layer_id": r.layer_id,
        "layer_index": r.layer_index,
        "role": r.role,
        "shape": list(r.shape),
        "dtype": r.dtype,
        "nbytes": r.nbytes,
        "offset": p.offset,
        "sha256": r.sha256,
        "file": str(r.file),
    }


class _PauseHook:
    """The test hook (module docstring): wraps the progress bar, counts bytes."""

    def __init__(self, bar: Any, spec: str, where: Path) -> None:
        after, _, seconds = spec.partition(":")
        self.bar, self.after, self.where = bar, int(after), where
        self.seconds = float(seconds) if seconds else None
        self.done = 0
        self.fired = False

    def update(self, n: int) -> None:
        self.bar.update(n)
        self.done += n
        if not self.fired and self.done >= self.after:
            self.fired = True
            import signal

            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
            sys.stderr.write(f"engram-trt test hook: paused after {self.done} bytes writing {self.where}\n")
            sys.stderr.flush()
            signal.sigtimedwait({signal.SIGUSR1}, self.seconds if self.seconds is not None else 10**8)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})


class SharedTables(TableStore):
    """Tables in a ``/dev/shm`` segment that every process on the node maps."""

    kind = "shared"

    def __init__(
        self,
        layers: Sequence[tuple[Any, Any]],
        quant_block: int,
        layer_ids: Sequence[int],
        resources: HostResources,
        path: Path,
        header: seg.SegmentHeader,
        created: bool,
    ) -> None:
        super().__init__(layers, quant_block, layer_ids)
        self._resources = resources
        self._finalizer = weakref.finalize(self, resources.release)
        self.path = path
        self.header = header
        self.created = created
        reg = resources.registration
        self.chunks = list(reg.chunks) if reg is not None else []
        self.registrar_name = reg.registrar.name if reg is not None else None
        self.gpu_readable = reg is not None  # type: ignore[misc]

    # -- opening -------------------------------------------------------------------
    @classmethod
    def open(
        cls,
        refs: Sequence[TableRef],
        quant_block: int = 32,
        *,
        progress: bool = True,
        register: bool = False,
        directory: str | Path = seg.DEFAULT_DIR,
        free_space: Callable[[Path], int] | None = None,
        registrar: Registrar | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        reader: Callable[[TableRef, Any, Any], None] | None = None,
    ) -> TableStore:
        """Attach to (or create) the segment holding ``refs``; see the module docstring.

        ``register``: register the mapping for UVA (with a GPU). ``directory``: where
        segments live (default ``/dev/shm``). ``free_space(dir) -> bytes``: the space
        check (default ``statvfs``; injectable for tests). Returns a
        :class:`SharedTables`, or a :class:`~engram_trt.tables.pinned.PinnedTables` /
        memory store when the directory lacks room (a warning says so)."""
        d = Path(directory)
        if not d.is_dir():
            raise EngramError(
                f"shared-memory directory {d} does not exist; create it or choose another "
                "directory for the shared tables"
            )
        pairs = layer_refs(refs)
        layer_ids = [r.layer_id for r, _ in pairs]
        layout = seg.layout_hash(refs)
        want, placed, total = expected_header(refs, layout)
        name = seg.segment_name(layout)
        path = d / name

        def attach(hdr: seg.SegmentHeader) -> "SharedTables":
            return cls._attach(
                path, hdr, placed, quant_block, layer_ids, register, registrar, chunk_bytes, created=False
            )

        hdr = cls._check_existing(path, want)
        if hdr is not None and hdr.ready:
            return attach(hdr)

        def waiting(pid: int | None) -> None:
            log.info(
                "waiting for %s to finish creating the shared tables %s",
                f"pid {pid}" if pid else "another process",
                path,
            )

        with seg.segment_lock(d, name, on_wait=waiting):
            hdr = cls._check_existing(path, want)
            if hdr is not None and hdr.ready:
                return attach(hdr)
            cls._remove_leftovers(d, name, path, hdr)
            free = (free_space or statvfs_free)(d)
            if free < total:
                return cls._fallback(
                    refs,
                    quant_block,
                    progress,
                    register,
                    registrar,
                    chunk_bytes,
                    d,
                    f"{d} has {human_bytes(free)} free but the tables need {human_bytes(total)}",
                )
            try:
                mm, hdr = cls._create(d, name, want, placed, refs, progress, reader or read_region_into)
            except _NoSpace as exc:
                return cls._fallback(refs, quant_block, progress, register, registrar, chunk_bytes, d, str(exc))
        return cls._attach(
            path, hdr, placed, quant_block, layer_ids, register, registrar, chunk_bytes, created=True, mm=mm
        )

    @staticmethod
    def _check_existing(path: Path, want: seg.SegmentHeader) -> seg.SegmentHeader | None:
        """The existing segment's header: None if there is no file; refuses one that is
        not ours or holds something else. A not-ready header is returned (the caller
        rebuilds it under the lock)."""
        try:
            st = path.stat()
        except FileNotFoundError:
            return None
        fix = (
            f"run `engram-trt shm clean {shlex.quote(path.name)} --dir {shlex.quote(str(path.parent))}` "
            "(after stopping the processes using it), then start again"
        )
        hdr = seg.read_header(path)
        if hdr is None:
            if not os.access(path, os.R_OK):
                raise EngramError(
                    f"shared tables {path} exist but cannot be read (mode {st.st_mode & 0o777:o}, "
                    f"owner uid {st.st_uid}): run as that user or choose another directory for the shared tables"
                )
            raise EngramError(
                f"{path} does not start with an engram-trt segment header, so it is not ours and is left alone; "
                "remove or move it yourself, or choose another directory for the shared tables"
            )
        if not hdr.ready:
            return hdr
        if hdr.version != want.version:
            raise EngramError(
                f"shared tables {path} use segment format version {hdr.version}, "
                f"this engram-trt reads version {want.version}: {fix}"
            )
        if hdr.layout_hash != want.layout_hash:
            raise EngramError(
                f"shared tables {path} hold other tables (layout hash {hdr.layout_hash[:16]}... differs from "
                f"{want.layout_hash[:16]}...): {fix}"
            )
        if hdr.problem or hdr.total_size != want.total_size or st.st_size != want.total_size:
            why = (
                hdr.problem or f"{st.st_size} bytes on disk, {hdr.total_size} in its header, {want.total_size} expected"
            )
            raise EngramError(f"shared tables {path} are damaged ({why}): {fix}")
        if [(t["tensor"], t["offset"], t["nbytes"]) for t in hdr.tables] != [
            (t["tensor"], t["offset"], t["nbytes"]) for t in want.tables
        ]:
            raise EngramError(f"shared tables {path} place the tables differently than this engram-trt expects: {fix}")
        return hdr

    @staticmethod
    def _remove_leftovers(d: Path, name: str, path: Path, hdr: seg.SegmentHeader | None) -> None:
        """Under the lock: whatever a killed creator left is stale; remove it, loudly."""
        if hdr is not None and not hdr.ready:
            log.warning(
                "shared tables %s were left without their ready flag by pid %d (%s): rebuilding them",
                path,
                hdr.creator_pid,
                "still running" if seg.pid_alive(hdr.creator_pid) else "gone",
            )
            path.unlink()
        for f in sorted(d.glob(f"{name}.*.tmp")):
            parsed = seg.parse_name(f.name)
            if parsed is None or parsed[1] != "temp":
                continue
            if seg.read_header(f) is None and not seg.is_blank_start(f):
                log.warning("leaving %s alone: it has the name of a half-written segment but not our header", f)
                continue
            pid = parsed[2]
            log.warning(
                "removing half-written shared tables %s: their creator (pid %s, %s) "
                "stopped before finishing; rebuilding them",
                f,
                pid,
                "still running but no longer holding the lock" if seg.pid_alive(pid) else "gone",
            )
            f.unlink()

    @staticmethod
    def _create(
        d: Path,
        name: str,
        want: seg.SegmentHeader,
        placed: Sequence[PlacedTable],
        refs: Sequence[TableRef],
        progress: bool,
        read: Callable[[TableRef, Any, Any], None],
    ) -> tuple[mmap.mmap, seg.SegmentHeader]:
        """Write the segment under a temp name and rename it into place (lock held)."""
        pid = os.getpid()
        tmp = d / seg.temp_name(name, pid)
        hdr = seg.SegmentHeader(
            want.version, False, want.total_size, pid, time.time_ns(), want.layout_hash, want.tables
        )
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        mm: mmap.mmap | None = None
        views: list[Any] = []
        try:
            os.fchmod(fd, 0o600)
            os.pwrite(fd, hdr.pack(), 0)  # the magic first: from here on the file is recognizably ours
            os.ftruncate(fd, hdr.total_size)
            try:
                os.posix_fallocate(fd, 0, hdr.total_size)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise _NoSpace(
                        f"{d} ran out of space reserving {human_bytes(hdr.total_size)} ({exc.strerror})"
                    ) from None
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
            mm = mmap.mmap(fd, hdr.total_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            _advise_huge(mm)
            views = tensors_over(mm, placed)
            log.info("creating shared tables %s (%s)", d / name, human_bytes(hdr.total_size))
            with _load_progress(refs, "shared", progress) as bar:
                hook = os.environ.get(TEST_PAUSE_ENV)
                fill_tables(views, placed, read, _PauseHook(bar, hook, tmp) if hook else bar, drop_cache=True)
            views.clear()
            mm.flush()
            mm[seg.READY_OFFSET : seg.READY_OFFSET + 4] = seg.READY.to_bytes(4, "little")  # last: the data is complete
            mm.flush()
            hdr.ready = True
            os.rename(tmp, d / name)
        except BaseException:
            views.clear()
            if mm is not None:
                try:
                    mm.close()
                except BufferError:
                    pass
            try:
                tmp.unlink()
            except FileNotFoundError:
                pass
            raise
        finally:
            os.close(fd)
        return mm, hdr

    @classmethod
    def _attach(
        cls,
        path: Path,
        hdr: seg.SegmentHeader,
        placed: Sequence[PlacedTable],
        quant_block: int,
        layer_ids: Sequence[int],
        register: bool,
        registrar: Registrar | None,
        chunk_bytes: int,
        created: bool,
        mm: mmap.mmap | None = None,
    ) -> "SharedTables":
        if mm is None:
            try:
                fd = os.open(path, os.O_RDWR)
            except PermissionError:
                raise EngramError(
                    f"shared tables {path} belong to another user (mode 0600): "
                    "run as that user or choose another directory for the shared tables"
                ) from None
            try:
                mm = mmap.mmap(fd, hdr.total_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
            _advise_huge(mm)
            log.info(
                "attached to shared tables %s (%s, created by pid %d)",
                path,
                human_bytes(hdr.total_size),
                hdr.creator_pid,
            )
        resources = HostResources(mm)
        views: list[Any] = []
        try:
            views = tensors_over(mm, placed)
            if register:
                from engram_trt.tables.hostmem import CudaRegistrar

                resources.registration = HostRegistration.register(
                    registrar or CudaRegistrar(),
                    mapping_address(mm),
                    round_up(hdr.total_size, mmap.PAGESIZE),
                    chunk_bytes,
                    what="shared tables",
                )
        except BaseException:
            views.clear()
            resources.release()
            raise
        return cls(views, quant_block, layer_ids, resources, path, hdr, created)

    @staticmethod
    def _fallback(
        refs: Sequence[TableRef],
        quant_block: int,
        progress: bool,
        register: bool,
        registrar: Registrar | None,
        chunk_bytes: int,
        d: Path,
        why: str,
    ) -> TableStore:
        where = "private pinned memory" if register else "private host memory"
        log.warning(
            "%s: the shared tables go to %s instead (one copy per process); free space there "
            "(engram-trt shm list / shm clean --dir %s) or enlarge it (mount -o remount,size=...)",
            why,
            where,
            d,
        )
        if register:
            return PinnedTables.load(refs, quant_block, progress=progress, registrar=registrar, chunk_bytes=chunk_bytes)
        return load_memory_tables(refs, quant_block, progress)

    # -- accounting ----------------------------------------------------------------
    def nbytes(self) -> int:
        return 0 if self._closed else self.header.total_size

    def where(self) -> str:
        origin = "created by this process" if self.created else f"attached; created by pid {self.header.creator_pid}"
        reg = (
            f"; registered for UVA in {len(self.chunks)} chunk{'s' if len(self.chunks) != 1 else ''} through "
            f"{self.registrar_name}"
            if self.chunks
            else ""
        )
        return f"shared memory segment {self.path} ({human_bytes(self.header.total_size)}, {origin}{reg})"

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d.update(
            segment=str(self.path),
            created=self.created,
            creator_pid=self.header.creator_pid,
            layout_hash=self.header.layout_hash,
            registered_chunks=len(self.chunks),
        )
        return d

    def close(self) -> None:
        """Unregister and unmap this process's view; the segment stays for the others
        (and for the next start) until ``engram-trt shm clean`` removes it."""
        super().close()
        self._finalizer()
        self.chunks = []


class _NoSpace(Exception):
    pass


def _advise_huge(mm: mmap.mmap) -> None:
    """Ask for huge pages on the shared mapping (tmpfs honours it when its
    ``shmem_enabled`` policy is ``advise``; elsewhere a no-op)."""
    try:
        mm.madvise(_MADV_HUGEPAGE, 0, len(mm))
    except (OSError, ValueError):
        pass
