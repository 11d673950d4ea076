"""Host memory a process holds, for the one-copy checks: its PSS (pages shared with
other processes count a share each, so the PSS of all ranks adds up to what the node
really holds), and how much of it maps the tables (a ``/dev/shm`` segment or the
checkpoint files), from ``/proc/PID/smaps``.

Why PSS and not RSS: every rank attached to one shared segment shows the whole
segment in its RSS; summed, RSS would count the one copy once per rank.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable


def smaps_rollup_pss(pid: int | None = None) -> int:
    """Bytes of ``Pss:`` in ``/proc/PID/smaps_rollup`` (0 where the file is missing)."""
    p = Path(f"/proc/{pid or os.getpid()}/smaps_rollup")
    try:
        text = p.read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return 0


def mapped_pss(prefixes: Iterable[str], pid: int | None = None) -> int:
    """Bytes of PSS in the mappings whose path starts with one of ``prefixes``
    (``/dev/shm/`` for segments, a table file's path for file maps)."""
    prefixes = tuple(str(p) for p in prefixes)
    if not prefixes:
        return 0
    p = Path(f"/proc/{pid or os.getpid()}/smaps")
    try:
        text = p.read_text()
    except OSError:
        return 0
    total, take = 0, False
    for line in text.splitlines():
        head = line.split(None, 5)
        if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            path = head[5].strip() if len(head) == 6 else ""
            take = path.startswith(prefixes)
        elif take and line.startswith("Pss:"):
            total += int(line.split()[1]) * 1024
    return total


def shm_used(directory: str | Path = "/dev/shm") -> int:
    """Bytes in use in a shared-memory filesystem (``statvfs``)."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return 0
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def process_memory(table_files: Iterable[str] = (), shm_dir: str = "/dev/shm") -> dict[str, Any]:
    """This process's PSS, the PSS of its table mappings, and ``/dev/shm`` in use."""
    files = sorted({str(f) for f in table_files})
    return {
        "pid": os.getpid(),
        "pss_bytes": smaps_rollup_pss(),
        "shm_pss_bytes": mapped_pss([shm_dir.rstrip("/") + "/"]),
        "table_file_pss_bytes": mapped_pss(files),
        "shm_used_bytes": shm_used(shm_dir),
    }
