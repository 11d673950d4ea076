"""Writing without losing anything: temporaries, atomic swaps, locks, and the cleanup
of what a killed process left behind.

The rules every command that writes follows (docs/reliability.md):

* A result is written under a temporary sibling name that is unique per process
  (``.NAME.KIND-PID-TOKEN``), announced by a marker file beside it
  (``.NAME.KIND-PID-TOKEN.owner``: the pid and its start time) that is written
  *before* the temporary, and renamed into place only when complete. A failed or killed
  command therefore never leaves a half-written result under the real name.
* A folder that already exists is replaced by one atomic exchange (Linux
  ``renameat2(RENAME_EXCHANGE)``), so the real name always holds either the old whole
  folder or the new whole folder; where the filesystem cannot exchange, the old folder
  is first moved to a marked ``.NAME.old-PID-TOKEN`` and put back by the next start if
  the process died between the two renames.
* Writers of one target take an exclusive ``flock`` on ``.NAME.engram-trt.lock`` beside
  it (created with ``O_EXCL``, removed by its holder: none is left behind; a user's
  file of that name is refused, never written); a second writer waits (and says so)
  rather than racing the first.
* At the next start, temporaries whose marker names a dead process are removed (and a
  moved-away old folder whose target is missing is restored). Nothing without our
  marker is ever removed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import json
import logging
import os
import re
import secrets
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from engram_trt.errors import EngramError

log = logging.getLogger(__name__)

OWNER_SUFFIX = ".owner"
LOCK_SUFFIX = ".engram-trt.lock"
_TEMP_RE = re.compile(r"^\.(?P<name>.+)\.(?P<kind>[a-z]+)-(?P<pid>\d+)-(?P<token>[0-9a-f]{8})$")

# Test-only: ENGRAM_TRT_TEST_PAUSE_AT=<point> makes the process stop at that named
# point (after writing its pid to ENGRAM_TRT_TEST_PAUSE_FLAG), so a test can kill -9 it
# exactly there. Unset (always, outside the tests) it costs one dict lookup.
PAUSE_ENV = "ENGRAM_TRT_TEST_PAUSE_AT"
PAUSE_FLAG_ENV = "ENGRAM_TRT_TEST_PAUSE_FLAG"


def pause_point(name: str) -> None:
    """A named point where a test may freeze this process (see :data:`PAUSE_ENV`)."""
    if os.environ.get(PAUSE_ENV) != name:
        return
    flag = os.environ.get(PAUSE_FLAG_ENV)
    if flag:
        Path(flag).write_text(str(os.getpid()))
    while True:  # until the test kills us
        time.sleep(60)


# ---------------------------------------------------------------- processes
def _proc_stat(pid: int) -> list[str] | None:
    """Fields of ``/proc/PID/stat`` after the command name (state first), None if unknown."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_start_time(pid: int) -> int | None:
    """The kernel's start time of ``pid`` (clock ticks since boot), None if unknown:
    with the pid it identifies a process even after the pid is reused."""
    fields = _proc_stat(pid)
    try:
        return int(fields[19]) if fields else None
    except (IndexError, ValueError):
        return None


def pid_alive(pid: int, start_time: int | None = None) -> bool:
    """Whether the process that wrote a marker still runs (a reused pid does not count
    when the start time was recorded)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    fields = _proc_stat(pid)
    if fields and fields[0] in ("Z", "X"):
        return False  # exited, not yet reaped by its parent: its files (and locks) are closed
    if start_time is not None:
        now = process_start_time(pid)
        if now is not None and now != start_time:
            return False
    return True


# ---------------------------------------------------------------- temporaries
def _owner_record() -> dict[str, int | None]:
    return {"pid": os.getpid(), "start_time": process_start_time(os.getpid())}


def temp_sibling(target: Path, kind: str, *, make_dir: bool = True) -> Path:
    """A fresh temporary beside ``target`` (``.NAME.KIND-PID-TOKEN``), its owner marker
    written first. A folder when ``make_dir``, else only the name (a file to write)."""
    if not re.fullmatch(r"[a-z]+", kind):
        raise ValueError(f"temp kind {kind!r}")
    target = Path(target)
    path = target.parent / f".{target.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}"
    owner = path.with_name(path.name + OWNER_SUFFIX)
    owner.write_text(json.dumps(_owner_record() | {"kind": kind, "target": target.name}) + "\n")
    if make_dir:
        os.mkdir(path)
    return path


def remove_temp(path: Path) -> None:
    """Remove a temporary this process made (folder or file), then its marker."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
    Path(str(path) + OWNER_SUFFIX).unlink(missing_ok=True)


def _read_owner(path: Path) -> dict | None:
    try:
        d = json.loads(Path(str(path) + OWNER_SUFFIX).read_text())
    except (OSError, ValueError, RecursionError):
        return None
    return d if isinstance(d, dict) and isinstance(d.get("pid"), int) else None


def clean_dead_temps(target: Path) -> list[Path]:
    """Remove the temporaries of ``target`` left by dead processes (only those with our
    owner marker); an old folder moved away by a process that died before putting the
    new one in place is renamed back when ``target`` is missing. Returns what was
    removed or restored."""
    target = Path(target)
    parent = target.parent
    done: list[Path] = []
    try:
        entries = list(parent.iterdir())
    except OSError:
        return done
    for entry in entries:
        m = _TEMP_RE.match(entry.name)
        if m is None or m.group("name") != target.name:
            continue
        owner = _read_owner(entry)
        if owner is None or owner["pid"] != int(m.group("pid")):
            continue  # not ours: never touched
        if pid_alive(owner["pid"], owner.get("start_time")):
            continue
        if m.group("kind") == "old" and not target.exists() and entry.is_dir():
            os.rename(entry, target)
            Path(str(entry) + OWNER_SUFFIX).unlink(missing_ok=True)
            log.warning(
                "restored %s from %s, left by process %d that died while replacing it", target, entry.name, owner["pid"]
            )
        else:
            remove_temp(entry)
            log.warning("removed %s, left by process %d that died before finishing", entry, owner["pid"])
        done.append(entry)
    # Markers whose temporary is already gone (a process died between the two removals).
    for entry in entries:
        if entry.name.endswith(OWNER_SUFFIX):
            stem = entry.with_name(entry.name[: -len(OWNER_SUFFIX)])
            m = _TEMP_RE.match(stem.name)
            if m and m.group("name") == target.name and not stem.exists() and entry.exists():
                owner = _read_owner(stem)
                if owner is not None and not pid_alive(owner["pid"], owner.get("start_time")):
                    entry.unlink(missing_ok=True)
    return done


# ---------------------------------------------------------------- swapping into place
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _renameat2() -> Callable[..., int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def exchange(a: Path, b: Path) -> bool:
    """Atomically swap two existing paths; False where the system cannot (then nothing
    changed)."""
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(str(a)), _AT_FDCWD, os.fsencode(str(b)), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), str(b))


def replace_dir(new: Path, target: Path) -> None:
    """Put the complete folder ``new`` (a :func:`temp_sibling`) at ``target``: at every
    instant ``target`` is the old whole folder or the new whole folder."""
    new, target = Path(new), Path(target)
    if target.exists() and not target.is_dir():
        raise EngramError(f"'{target}' exists and is not a folder; remove it or choose another path")
    if target.is_dir():
        try:
            os.chmod(new, os.stat(target).st_mode & 0o7777)
        except OSError:
            pass
    if not target.exists() or (target.is_dir() and not any(target.iterdir())):
        os.rename(new, target)  # onto nothing, or onto an empty folder: one rename
        Path(str(new) + OWNER_SUFFIX).unlink(missing_ok=True)
        return
    if exchange(new, target):
        pause_point("swap:exchanged")
        remove_temp(new)  # now holds the old folder
        return
    old = temp_sibling(target, "old", make_dir=False)
    os.rename(target, old)
    pause_point("swap:moved-old")
    os.rename(new, target)
    Path(str(new) + OWNER_SUFFIX).unlink(missing_ok=True)
    remove_temp(old)


def replace_file(new: Path, target: Path) -> None:
    """Rename a complete temporary file into place and drop its marker."""
    os.replace(new, target)
    Path(str(new) + OWNER_SUFFIX).unlink(missing_ok=True)


def carry_over(old: Path, new: Path, keep: Callable[[str], bool]) -> list[str]:
    """Hard-link (or copy, across filesystems) every entry of folder ``old`` for which
    ``keep(name)`` holds into ``new``, so replacing ``old`` by ``new`` loses none of
    them; returns the names carried. Links, not moves: if the process dies before the
    swap, ``old`` still holds every file."""

    def link_or_copy(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    carried: list[str] = []
    if not old.is_dir():
        return carried
    for entry in sorted(old.iterdir()):
        if not keep(entry.name) or (new / entry.name).exists():
            continue
        dst = new / entry.name
        if entry.is_symlink():
            os.symlink(os.readlink(entry), dst)
        elif entry.is_dir():
            shutil.copytree(entry, dst, symlinks=True, copy_function=link_or_copy)
        else:
            link_or_copy(str(entry), str(dst))
        carried.append(entry.name)
    return carried


# ---------------------------------------------------------------- locks
LOCK_MARK = b"engram-trt lock"  # the first bytes of every lock file of ours


def lock_path(target: Path) -> Path:
    """Where the lock of ``target`` lives: ``.NAME.engram-trt.lock`` beside it (the same
    for every process and user writing there, whatever their cache)."""
    target = Path(target)
    return target.parent / f".{target.name}{LOCK_SUFFIX}"


def _is_our_lock(fd: int) -> bool:
    """An empty file (a lock another writer created this instant, its mark not yet
    written) or one starting with our mark."""
    head = os.pread(fd, len(LOCK_MARK), 0)
    return head == b"" or head == LOCK_MARK


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


@contextmanager
def locked(target: Path, what: str) -> Iterator[None]:
    """Hold the exclusive lock of ``target`` for a write; a second writer waits for the
    first, and says whom it waits for.

    The lock is ``flock`` on :func:`lock_path`, a file of ours (its first bytes
    :data:`LOCK_MARK`), created with ``O_EXCL`` and removed by its holder before the lock
    is released, so nothing is left after a finished or failed command. A waiter that
    wakes on a file already removed (or replaced) starts over. A file of that name that
    is not ours (a user's) is refused, never written. What a killed holder left is taken
    over by the next writer and removed by it."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    path = lock_path(target)
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        except FileExistsError:
            try:
                fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
            except FileNotFoundError:
                continue  # its holder removed it between our two opens
            except OSError as exc:
                if exc.errno == errno.ELOOP:  # a symlink there: not ours
                    fd = -1
                else:
                    raise
            if fd < 0 or not _is_our_lock(fd):
                if fd >= 0:
                    os.close(fd)
                raise EngramError(
                    f"'{path}' exists and is not an engram-trt lock (engram-trt locks {target} "
                    f"with a file of that name); move it away, then run again"
                )
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 64, len(LOCK_MARK)).decode(errors="replace").strip() or "another process"
                log.warning("waiting for %s (%s) to finish writing %s", what, holder, target)
                fcntl.flock(fd, fcntl.LOCK_EX)
            if not _same_file(fd, path):  # its holder removed it while we waited: lock the next one
                os.close(fd)
                continue
            if not _is_our_lock(fd):  # the file changed under us (not ours): leave it
                raise EngramError(f"'{path}' is not an engram-trt lock any more; move it away, then run again")
        except BaseException:
            os.close(fd)
            raise
        break
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, LOCK_MARK + f" pid {os.getpid()}\n".encode(), 0)
        yield
    finally:
        if _same_file(fd, path):
            path.unlink(missing_ok=True)  # removed while held: a waiter then starts over
        os.close(fd)  # releases the lock


def writable_output(path: str | os.PathLike[str], flag: str) -> Path:
    """The absolute folder a command will write and swap in whole (``flag`` names it in
    messages), checked before any work so that nothing fails after it:

    * a symbolic link is written through: the folder it names is the one replaced (the
      link stays as it was); a link to nothing is refused;
    * a mount point is refused (a new folder cannot be swapped in for it): the fix is a
      folder inside it;
    * the folder that will hold the temporary beside it (and the lock) must be writable
      by this user."""
    p = Path(os.path.abspath(Path(path).expanduser()))
    if p.is_symlink():
        dest = p.resolve()
        if not dest.exists():
            raise EngramError(
                f"{flag} '{p}' is a symbolic link to '{dest}', which does not exist; create that folder, "
                f"or pass a real folder"
            )
        log.info("%s %s is a symbolic link: writing the folder it names, %s", flag, p, dest)
        p = dest
    if p.is_dir() and os.path.ismount(p):
        raise EngramError(
            f"{flag} '{p}' is a mount point: engram-trt writes a new folder beside it and swaps it in "
            f"whole, which a mount point cannot be; pass a folder inside it, e.g. '{p / 'model'}'"
        )
    holder = p.parent
    while not holder.exists() and holder != holder.parent:
        holder = holder.parent
    if holder.is_dir() and not os.access(holder, os.W_OK | os.X_OK):
        raise EngramError(
            f"{flag} '{p}': this user cannot write in '{holder}' (engram-trt writes a new folder beside "
            f"{p.name} and swaps it in); choose a folder you can write to, or fix the permissions"
        )
    return p


def check_parents(path: Path, flag: str) -> None:
    """Refuse a path under a file (``config.json/sub``) before anything is written."""
    for anc in Path(path).parents:
        if anc.exists():
            if not anc.is_dir():
                raise EngramError(f"{flag} '{path}': '{anc}' is a file, not a folder; choose a path under a folder")
            return


def is_within(path: Path, folder: Path) -> bool:
    """``path`` is ``folder`` or lies inside it (both resolved)."""
    p, f = Path(path).resolve(), Path(folder).resolve()
    return p == f or f in p.parents
