"""Shared pieces of the lookup benchmarks (gather, cache): host tables, the link's limit, timing, output.

Host tables are anonymous mappings (4 KiB pages, transparent huge pages, reserved 1 GiB
pages, or ``auto``: what the runtime's stores ask for, :func:`engram_trt.tables.hostmem.allocate_anonymous`),
filled fast by repeating one random block, and registered with CUDA only where the GPU
reads them (the UVA kernel): torch's pinned allocator would round 24.75 GiB up to 32 GiB
and pin all of it, and the host gather needs no pinned table at all (the CPU reads it).
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from engram_trt.errors import EngramError

log = logging.getLogger(__name__)

GiB = 1 << 30
HEAD_DIM = 256
QUANT_BLOCK = 32
SCALE_BYTES = HEAD_DIM // QUANT_BLOCK
ROW_BYTES = HEAD_DIM + SCALE_BYTES  # 264: what a lookup moves, counted in every GB/s here
FILL_BLOCK_ROWS = 1 << 20


def anon_hugepages_kib() -> int:
    """AnonHugePages of the whole machine (/proc/meminfo), to confirm huge pages took."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    except OSError:
        pass
    return -1


PAGE_CHOICES = ("auto", "4k", "thp", "1g")  # --pages of the lookup benchmarks


def pages_mode(choice: str) -> bool | str:
    """:class:`HostBuffer`'s ``huge_pages`` for a ``--pages`` choice."""
    return {"4k": False, "thp": True, "1g": "1g", "auto": "auto"}[choice]


class HostBuffer:
    """An anonymous host mapping viewed as a uint8 tensor; ``huge_pages``: False (base
    pages), True / 'thp' (transparent huge pages, madvise), '1g' (reserved 1 GiB pages)
    or 'auto' (the runtime's choice: 1 GiB pages if enough are free, else reserved
    hugetlbfs pages, else transparent huge pages). ``pages`` says what it got, in words;
    ``register()`` makes it GPU-readable."""

    def __init__(self, nbytes: int, *, huge_pages: bool | str = False) -> None:
        import torch

        self.nbytes = int(nbytes)
        offset = 0
        if huge_pages == "auto":
            from engram_trt.tables.hostmem import allocate_anonymous

            buf = allocate_anonymous(self.nbytes, "auto")
            self._map, offset, self.pages = buf.mm, buf.base, buf.pages
        elif huge_pages == "1g":
            from engram_trt.tables.hostmem import map_giga_pages

            self._map = map_giga_pages(self.nbytes)
            self.pages = "hugetlbfs 1 GiB pages"
        else:
            self._map = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self.pages = f"{mmap.PAGESIZE // 1024} KiB pages"
        if huge_pages is True or huge_pages == "thp":
            if not hasattr(mmap, "MADV_HUGEPAGE"):
                raise EngramError("transparent huge pages need Linux (mmap.MADV_HUGEPAGE); drop --pages thp")
            self._map.madvise(mmap.MADV_HUGEPAGE)
            self.pages = "transparent huge pages (madvise)"
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8, count=self.nbytes, offset=offset)
        self.registered = False

    def register(self) -> None:
        from engram_trt.native import library as kernel_library

        kernel_library.register_host_memory(self.tensor)
        self.registered = True

    def close(self) -> None:
        if self.registered:
            from engram_trt.native import library as kernel_library

            kernel_library.unregister_host_memory(self.tensor)
            self.registered = False
        self.tensor = None


def random_block(rows: int, seed: int) -> Any:
    """[rows, 264] bytes: FP8 values without NaN codes (0x7F / 0xFF -> 0x3C) and ue8m0
    scales in [110, 140) (2^-17 .. 2^12: no NaN, no overflow to inf in bf16)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    block = torch.randint(0, 256, (rows, ROW_BYTES), dtype=torch.uint8, generator=g)
    values = block[:, :HEAD_DIM]
    values[(values & 0x7F) == 0x7F] = 0x3C
    block[:, HEAD_DIM:] = 110 + block[:, HEAD_DIM:] % 30
    return block


@dataclass
class Tables:
    """One table's content in the layouts asked for (views into HostBuffers)."""

    num_rows: int
    split_rows: Any = None  # [N, 256] uint8
    split_scales: Any = None  # [N, 8] uint8
    inline: Any = None  # [N, 264] uint8
    buffers: list[HostBuffer] = field(default_factory=list)
    huge_pages: bool | str = False

    def gib(self) -> float:
        return self.num_rows * ROW_BYTES / GiB

    def pages(self) -> list[str]:
        """How the buffers are paged, in words (distinct, sorted)."""
        return sorted({b.pages for b in self.buffers})

    def close(self) -> None:
        self.split_rows = self.split_scales = self.inline = None
        for b in self.buffers:
            b.close()
        self.buffers.clear()


def make_tables(
    num_rows: int,
    *,
    split: bool,
    inline: bool,
    huge_pages: bool | str,
    register_split: bool,
    seed: int = 0,
    block_rows: int = FILL_BLOCK_ROWS,
) -> Tables:
    """Fill a table of ``num_rows`` 264-byte rows in the layouts asked for, with the same
    content in each: one random block of ``block_rows`` rows repeated (the addresses a
    gather touches are as random as ever; only the bytes repeat)."""
    t0 = time.perf_counter()
    tables = Tables(num_rows=num_rows, huge_pages=huge_pages)
    if split:
        rows_buf = HostBuffer(num_rows * HEAD_DIM, huge_pages=huge_pages)
        scales_buf = HostBuffer(num_rows * SCALE_BYTES, huge_pages=huge_pages)
        tables.buffers += [rows_buf, scales_buf]
        tables.split_rows = rows_buf.tensor.view(num_rows, HEAD_DIM)
        tables.split_scales = scales_buf.tensor.view(num_rows, SCALE_BYTES)
    if inline:
        inline_buf = HostBuffer(num_rows * ROW_BYTES, huge_pages=huge_pages)
        tables.buffers.append(inline_buf)
        tables.inline = inline_buf.tensor.view(num_rows, ROW_BYTES)
    block = random_block(min(block_rows, max(1 << 16, num_rows // 16)), seed)
    values, scales = block[:, :HEAD_DIM], block[:, HEAD_DIM:]
    for start in range(0, num_rows, block.shape[0]):
        n = min(block.shape[0], num_rows - start)
        if split:
            tables.split_rows[start : start + n].copy_(values[:n])
            tables.split_scales[start : start + n].copy_(scales[:n])
        if inline:
            tables.inline[start : start + n].copy_(block[:n])
    fill_s = time.perf_counter() - t0
    if register_split and split:
        t1 = time.perf_counter()
        for b in tables.buffers[:2]:
            b.register()
        log.info("registered the split table with CUDA in %.1f s", time.perf_counter() - t1)
    log.info(
        "filled %.2f GiB of tables (%s) in %.1f s",
        tables.gib() * (int(split) + int(inline)),
        ", ".join(tables.pages()),
        fill_s,
    )
    return tables


def median_wall(
    fn: Callable[[int], Any],
    reps: int,
    sync: Callable[[], None],
    *,
    warmup: int = 1,
    gap_s: float = 0.0,
    before: Callable[[int], Any] | None = None,
) -> tuple[float, list[float]]:
    """Median (and all) wall seconds of fn(i) followed by sync(), over reps calls, after
    ``warmup`` untimed calls; ``gap_s`` sleeps before each call (idle pool threads
    block), then ``before(i)`` runs, untimed (e.g. waking the pool ahead of the call)."""
    for i in range(warmup):
        fn(i % max(reps, 1))
        sync()
    times = []
    for i in range(reps):
        if gap_s:
            time.sleep(gap_s)
        if before is not None:
            before(i)
        t0 = time.perf_counter()
        fn(i)
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def measure_h2d(src: Any, device: Any, nbytes: int, reps: int = 7) -> float:
    """GB/s of one sequential host-to-device copy of ``nbytes`` from pinned or
    registered ``src`` (CUDA events, median): the link's limit in this run."""
    import torch

    n = min(int(nbytes), src.numel())
    host = src.view(-1)[:n]
    dst = torch.empty(n, dtype=torch.uint8, device=device)
    times = []
    for i in range(reps + 1):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(host, non_blocking=True)
        b.record()
        torch.cuda.synchronize(device)
        if i:
            times.append(a.elapsed_time(b) / 1e3)
    del dst
    return n / statistics.median(times) / 1e9


def gbps(num_rows: int, seconds: float) -> float:
    return num_rows * ROW_BYTES / seconds / 1e9 if seconds > 0 else float("inf")


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], out: Any = None) -> None:
    """A plain aligned text table (markdown-compatible)."""
    out = out or sys.stdout
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for k, r in enumerate(cells):
        out.write("| " + " | ".join(c.ljust(widths[i]) for i, c in enumerate(r)) + " |\n")
        if k == 0:
            out.write("|" + "|".join("-" * (w + 2) for w in widths) + "|\n")


def write_json(obj: Any, path: str | None) -> None:
    """JSON to stdout (path '-') or to a file (via a temp name)."""
    text = json.dumps(obj, indent=1, default=float)
    if path in (None, "-"):
        print(text)
        return
    p = Path(path)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    tmp.write_text(text + "\n")
    os.replace(tmp, p)


def save_plot(fig: Any, path: str) -> None:
    p = Path(path)
    tmp = p.with_name(f".{p.stem}.{os.getpid()}.tmp{p.suffix}")
    fig.savefig(tmp, dpi=120, bbox_inches="tight")
    os.replace(tmp, p)


def require_matplotlib() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise EngramError("--plot needs matplotlib (pip install matplotlib), or drop --plot") from None
    return plt
