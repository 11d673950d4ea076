#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""`python benchmarks/lookup/bench_gather.py`: cold row lookups from a host table, every path, one run.

What it measures (issue 11, target 1): uniform random ids over a host table of >= 24
GiB (264-byte rows: 256 FP8 values + 8 ue8m0 scale bytes), 6,144 rows (a decode step of
256 tokens x 24 columns) and 196,608 rows (an 8k-token prefill chunk), through
  - ``uva``: the project's gather kernel reading the pinned split table through UVA;
  - ``host``: the host gather (CPU threads + pinned staging + one copy per chunk + the
    GPU dequant), split, inline and hbm-scales layouts (hbm-scales: the split rows on the
    host, the scale bytes on the GPU; its CPU threads and the link move 256 of a row's
    264 bytes), at each thread count and tuning given, each through ``--call``: the
    plain call (``HostGatherer.gather``, every argument checked each time) and/or the
    call bound to its table (``HostGatherer.bind``: the table checked once, as a decode
    loop calls it; the runtime's own host path calls the library from its gather
    driver's thread, with no Python per step);
  - ``split``: one lookup shared by the UVA kernel (``--uva-share`` of its tokens, the
    grid capped at ``--uva-blocks``) and the host gather at once (bench.gathersplit);
  - ``torch``: torch.index_select into pinned staging + one copy (raw bytes, no dequant:
    the plain-library baseline);
each as the median wall time from the call to the stream's completion over fresh ids.
Limits measured in the same run: a sequential 2 GiB pinned host-to-device copy (the
link), the copy of one step's bytes alone, and the host gather's CPU part alone (into
pinned memory): max(copy alone, CPU part alone) is the host gather's bound, and the
report says how far each host configuration is from it. Every output is checked bit for
bit against the dequant reference (quant.dequant_fp8_rows_torch on the CPU).

``--dry-run`` runs what needs no GPU (the CPU part of the host gather and torch's
index_select on a small table, checked for exactness) so the command is exercised on CPU
machines; its figures are no measurement of the target machine.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# engram_trt from this checkout and this folder's modules:
sys.path[:0] = [p for p in (str(REPO / "python"), str(Path(__file__).resolve().parent)) if p not in sys.path]

import itertools  # noqa: E402
import logging  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from typing import Any  # noqa: E402

from gathersplit import plot_split, time_split  # noqa: E402
from lookuputil import (  # noqa: E402
    GiB,
    HEAD_DIM,
    QUANT_BLOCK,
    ROW_BYTES,
    SCALE_BYTES,
    anon_hugepages_kib,
    gbps,
    make_tables,
    measure_h2d,
    median_wall,
    print_table,
    require_matplotlib,
    save_plot,
    write_json,
)
from engram_trt.bench.options import opt  # noqa: E402
from engram_trt.errors import EngramError  # noqa: E402

log = logging.getLogger(__name__)

TARGET_PREFILL_GBPS = 40.0
TARGET_PREFILL_LINK_RATIO = 0.72
TARGET_DECODE_US = 100.0
PREFILL_ROWS = 196608
DECODE_ROWS = 6144


@dataclass
class Result:
    rows: int
    path: str
    layout: str
    threads: int
    chunk_rows: int = 0
    min_chunks: int = 0
    prefetch: int = 0
    prefetch_far: int = 0
    locality: int = 3
    stores: str = ""
    task_rows: int = 0
    slots: int = 0
    pool: str = ""
    call: str = ""  # host gather: "bound" (HostGatherer.bind), "" the plain call (every argument checked)
    seconds: float = 0.0
    gbps: float = 0.0
    x_link: float = 0.0
    cpu_part_seconds: float = 0.0  # host gather: its CPU part alone (dry run: the measurement)
    exact: bool = False
    uva_share: float = 0.0  # split: the UVA kernel's share of the tokens
    uva_blocks: int = 0  # split: its grid cap (0: one full wave)

    def knobs(self) -> str:
        if self.path == "split":
            return f"uva {self.uva_share:.0%}, {self.uva_blocks or 'all'} blocks"
        if not self.path.startswith("host"):
            return "-"
        if self.path != "host":  # the CPU part alone takes only these two
            return f"pf {self.prefetch}, {self.stores}"
        return (
            f"chunk {self.chunk_rows}, min {self.min_chunks}, pf {self.prefetch}"
            + (f"/far {self.prefetch_far}" if self.prefetch_far else "")
            + (f", loc {self.locality}" if self.locality != 3 else "")
            + f", {self.stores}"
            + (f", task {self.task_rows}" if self.task_rows else "")
            + (f", {self.slots} slots" if self.slots else "")
            + (f", {self.pool}" if self.pool else "")
            + (f", {self.call} call" if self.call else "")
        )


@dataclass(kw_only=True)
class GatherOptions:
    """``python benchmarks/lookup/bench_gather.py``'s flags."""

    table_gib: float | None = opt(
        None, help="host table size in GiB of 264-byte rows (default: 24.75; --dry-run: 0.25)"
    )
    rows: list[int] = opt([DECODE_ROWS, PREFILL_ROWS], help="rows per lookup, comma-separated (default: 6144,196608)")
    cols: int = opt(24, help="columns per token (ids are [rows / cols, cols]; default 24)")
    paths: list[str] = opt(
        ["uva", "host", "torch"],
        choices=("uva", "host", "split", "torch"),
        help="paths to time: uva, host, split (the UVA kernel and the host gather at once, each on "
        "its share of the rows), torch (default: uva,host,torch)",
    )
    uva_share: list[float] = opt(
        [0.1], help="split: the UVA kernel's share of a lookup's tokens, comma-separated (default 0.1)"
    )
    uva_blocks: list[int] = opt(
        [16], help="split: the UVA kernel's grid cap in blocks of 256 threads, 0 = one full wave (default 16)"
    )
    layouts: list[str] = opt(
        ["split", "inline"],
        choices=("split", "inline", "hbm-scales"),
        help="host gather table layouts: split, inline, hbm-scales (the split rows in host memory, "
        "the scale bytes on the GPU) (default: split,inline)",
    )
    threads: list[int] = opt([4, 8, 16], help="CPU threads (default: 4,8,16)")
    chunk_rows: list[int] = opt([2048], help="host gather: rows per copy (default 2048)")
    min_chunks: list[int] = opt([4], help="host gather: min chunks per call (default 4)")
    prefetch: list[int] = opt([16], help="host gather: prefetch distance in rows (default 16)")
    prefetch_far: list[int] = opt(
        [0], help="host gather: first-line prefetch distance in rows, to start page walks early (default 0: off)"
    )
    locality: list[int] = opt(
        [3], help="host gather: prefetch locality, 3 = into L1 .. 1 = into L2/L3, 0 = non-temporal (default 3)"
    )
    stores: list[str] = opt(
        ["plain"], choices=("streaming", "plain"), help="host gather: stores into staging (default: plain)"
    )
    task_rows: list[int] = opt([0], help="host gather: rows per work item (0 = auto)")
    slots: list[int] = opt([8], help="host gather: staging slots (default 8)")
    call: list[str] = opt(
        ["checked"],
        choices=("checked", "bound"),
        help="host gather: 'checked' (HostGatherer.gather, every argument checked on every call; "
        "default) and/or 'bound' (HostGatherer.bind: the table checked once, then the library "
        "call per step, as a decode loop makes it)",
    )
    spin_us: int = opt(
        200, help="host gather: pool spin before blocking (default 200: calls back to back find it spinning)"
    )
    pool: list[str] = opt(
        ["hot"],
        choices=("hot", "idle", "woken"),
        help="host gather pool state at each call: hot (calls back to back), idle (2 ms of sleep "
        "before each call: the threads have blocked), woken (idle, then wake() --wake-us before "
        "the call, as a runtime does when a step starts) (default: hot)",
    )
    wake_us: float = opt(100.0, help="--pool woken: wake() this long before the call")
    pages: str = opt(
        "4k",
        choices=("4k", "thp", "1g"),
        help="host table pages: 4k, transparent huge pages (madvise), or reserved 1 GiB huge pages "
        "(hugetlbfs; reserve them first in /sys/kernel/mm/hugepages/hugepages-1048576kB/nr_hugepages) "
        "(default 4k)",
    )
    reps: int = opt(15, help="timed calls per measurement, fresh ids each (default 15)")
    seed: int = opt(0)
    json: str | None = opt(
        None, nargs="?", const="-", metavar="PATH", help="write all results as JSON (to stdout without PATH)"
    )
    plot: str | None = opt(None, metavar="PNG", help="write a plot of throughput vs threads")
    dry_run: bool = opt(
        False, help="no GPU: time the CPU parts on a small table and check them; figures are not the target's"
    )


def _reference(tables: Any, ids_flat: Any) -> Any:
    """bf16 rows of ids (all on the table: the benchmark draws them so) by the dequant
    reference (CPU)."""
    from engram_trt.engram.quant import dequant_fp8_rows_torch

    return dequant_fp8_rows_torch(*_raw_reference(tables, ids_flat), QUANT_BLOCK)


def _raw_reference(tables: Any, ids_flat: Any) -> tuple[Any, Any]:
    """(values, scales) of ids, from the split table, or the inline one where only it was built."""
    idx = ids_flat.long()
    if tables.split_rows is not None:
        return tables.split_rows[idx], tables.split_scales[idx]
    rows = tables.inline[idx]
    return rows[:, :HEAD_DIM], rows[:, HEAD_DIM:]


IDLE_GAP_S = 2e-3


def _host_configs(opts: GatherOptions) -> list[dict[str, Any]]:
    return [
        dict(chunk_rows=c, min_chunks=m, prefetch=pf, prefetch_far=far, locality=loc, stores=st, task_rows=tr)
        for c, m, pf, far, loc, st, tr in itertools.product(
            opts.chunk_rows,
            opts.min_chunks,
            opts.prefetch,
            opts.prefetch_far,
            opts.locality,
            opts.stores,
            opts.task_rows,
        )
    ]


def _set_tuning(g: Any, cfg: dict[str, Any]) -> None:
    g.set_options(
        chunk_rows=cfg["chunk_rows"],
        min_chunks=cfg["min_chunks"],
        prefetch_rows=cfg["prefetch"],
        prefetch_far_rows=cfg["prefetch_far"],
        prefetch_locality=cfg["locality"],
        task_rows=cfg["task_rows"],
        streaming_stores=int(cfg["stores"] == "streaming"),
    )


def run(opts: GatherOptions) -> int:
    import torch

    if any(n % opts.cols for n in opts.rows):
        raise EngramError(f"--rows must be multiples of --cols {opts.cols} (got {opts.rows})")
    if opts.reps < 1:
        raise EngramError("--reps must be >= 1")
    gib = opts.table_gib if opts.table_gib is not None else (0.25 if opts.dry_run else 24.75)
    num_rows = int(gib * GiB) // ROW_BYTES
    if num_rows < max(opts.rows):
        raise EngramError(f"--table-gib {gib} holds {num_rows} rows, fewer than a lookup of {max(opts.rows)}")
    if "split" in opts.paths and not ({"split", "hbm-scales"} & set(opts.layouts)):
        raise EngramError("--paths split gathers the split rows on the host too: add split or hbm-scales to --layouts")
    if "split" in opts.paths and opts.dry_run:
        raise EngramError("--paths split runs the UVA kernel beside the host gather: the dry run has no GPU")
    if any(not 0.0 <= f <= 1.0 for f in opts.uva_share) or any(b < 0 for b in opts.uva_blocks):
        raise EngramError(
            f"--uva-share must be in [0, 1] and --uva-blocks >= 0 (got {opts.uva_share}, {opts.uva_blocks})"
        )
    if not opts.dry_run and not torch.cuda.is_available():
        raise EngramError("bench gather needs a CUDA GPU; run with --dry-run to exercise the CPU parts")
    # Only the layouts timed are built (the reference reads either): a 24.75 GiB table in
    # 1 GiB pages takes 25 of the pages reserved, both layouts 50.
    uva = "uva" in opts.paths or "split" in opts.paths
    need_split = "split" in opts.layouts or "hbm-scales" in opts.layouts or uva
    need_inline = "inline" in opts.layouts or "torch" in opts.paths
    t0 = time.perf_counter()
    thp_before = anon_hugepages_kib()
    tables = make_tables(
        num_rows,
        split=need_split,
        inline=need_inline,
        huge_pages={"thp": True, "1g": "1g"}.get(opts.pages, False),
        register_split=not opts.dry_run and uva,
        seed=opts.seed,
    )
    setup_s = time.perf_counter() - t0
    thp_gib = (anon_hugepages_kib() - thp_before) / 2**20 if thp_before >= 0 else -1.0
    gen = torch.Generator().manual_seed(opts.seed + 1)
    id_sets = {
        n: [
            torch.randint(0, num_rows, (n // opts.cols, opts.cols), generator=gen, dtype=torch.int32)
            for _ in range(opts.reps)
        ]
        for n in opts.rows
    }
    try:
        if opts.dry_run:
            report = _run_cpu(opts, tables, id_sets)
        else:
            report = _run_gpu(opts, tables, id_sets)
    finally:
        tables.close()
    report.update(
        table_gib=tables.gib(),
        table_rows=num_rows,
        pages=opts.pages,
        huge_pages_gib=thp_gib,
        setup_seconds=setup_s,
        dry_run=opts.dry_run,
    )
    _print_report(opts, report)
    if opts.json is not None:
        write_json(report, opts.json)
    if opts.plot:
        _plot(report, opts.plot)
    return 0


def _run_cpu(opts: GatherOptions, tables: Any, id_sets: dict[int, list[Any]]) -> dict[str, Any]:
    """The CPU parts alone: host gather's row copy (gather_rows_cpu) and index_select."""
    import torch

    from engram_trt.native import hostgather

    results: list[Result] = []
    for n, sets in id_sets.items():
        flat = [s.reshape(-1) for s in sets]
        ref_rows, ref_scales = _raw_reference(tables, flat[0])
        out_rows = torch.empty((n, HEAD_DIM), dtype=torch.uint8)
        out_scales = torch.empty((n, SCALE_BYTES), dtype=torch.uint8)
        # The CPU entry point takes the prefetch distance and the store kind (the other
        # knobs shape the GPU pipeline or need a gatherer).
        for layout, threads, prefetch, stores in itertools.product(
            opts.layouts, opts.threads, opts.prefetch, opts.stores
        ):
            table = (tables.inline, None) if layout == "inline" else (tables.split_rows, tables.split_scales)
            hbm = layout == "hbm-scales"  # the CPU part copies the values alone

            def run(i: int) -> None:
                hostgather.gather_rows_cpu(
                    flat[i],
                    *table,
                    layout=layout,
                    num_threads=threads,
                    prefetch_rows=prefetch,
                    streaming_stores=int(stores == "streaming"),
                    out_rows=out_rows,
                    out_scales=out_scales,
                )

            sec, _ = median_wall(run, opts.reps, lambda: None)
            run(0)
            exact = torch.equal(out_rows, ref_rows) and (hbm or torch.equal(out_scales, ref_scales))
            results.append(
                Result(
                    rows=n,
                    path="host (CPU part)",
                    layout=layout,
                    threads=threads,
                    seconds=sec,
                    gbps=gbps(n, sec),
                    cpu_part_seconds=sec,
                    exact=exact,
                    prefetch=prefetch,
                    stores=stores,
                )
            )
        if "torch" in opts.paths:
            stage = torch.empty((n, ROW_BYTES), dtype=torch.uint8)
            longs = [f.long() for f in flat]
            for threads in opts.threads:
                torch.set_num_threads(threads)
                sec, _ = median_wall(
                    lambda i: torch.index_select(tables.inline, 0, longs[i], out=stage), opts.reps, lambda: None
                )
                torch.index_select(tables.inline, 0, longs[0], out=stage)
                exact = torch.equal(stage[:, :HEAD_DIM], ref_rows) and torch.equal(stage[:, HEAD_DIM:], ref_scales)
                results.append(
                    Result(
                        rows=n,
                        path="torch (gather only)",
                        layout="inline",
                        threads=threads,
                        seconds=sec,
                        gbps=gbps(n, sec),
                        exact=exact,
                    )
                )
    return {"results": [asdict(r) | {"knobs": r.knobs()} for r in results], "link_GBps": None}


def _run_gpu(opts: GatherOptions, tables: Any, id_sets: dict[int, list[Any]]) -> dict[str, Any]:
    import torch

    from engram_trt.native import hostgather
    from engram_trt.native import gather as gather_kernels

    dev = torch.device("cuda", torch.cuda.current_device())
    sync = lambda: torch.cuda.synchronize(dev)  # noqa: E731
    pinned_src = tables.split_rows if tables.buffers and tables.buffers[0].registered else None
    if pinned_src is None:
        pinned_src = torch.empty(2 * GiB, dtype=torch.uint8, pin_memory=True)
    link = measure_h2d(pinned_src, dev, 2 * GiB)
    log.info("sequential H2D copy, 2 GiB: %.1f GB/s", link)
    # References first, compared on the GPU later: CPU work between timings would leave
    # torch's OpenMP threads spinning beside the gather's own threads.
    refs = {n: _reference(tables, sets[0].reshape(-1)).to(dev) for n, sets in id_sets.items()}
    raw_refs = {n: tuple(t.to(dev) for t in _raw_reference(tables, sets[0].reshape(-1))) for n, sets in id_sets.items()}
    time.sleep(0.5)
    results: list[Result] = []
    copy_alone: dict[int, float] = {}

    # hbm-scales: the scale bytes copied to the GPU once, as a runtime does at load.
    scales_dev = (
        tables.split_scales.to(dev)
        if "hbm-scales" in opts.layouts and ("host" in opts.paths or "split" in opts.paths)
        else None
    )
    for n, sets in id_sets.items():
        flat = [s.reshape(-1).contiguous() for s in sets]
        out = torch.empty((n // opts.cols, opts.cols, HEAD_DIM), dtype=torch.bfloat16, device=dev)
        stage = torch.empty((n, ROW_BYTES), dtype=torch.uint8, pin_memory=True)
        dev_stage = torch.empty((n, ROW_BYTES), dtype=torch.uint8, device=dev)
        copy_alone[n], _ = median_wall(lambda i: dev_stage.copy_(stage, non_blocking=True), opts.reps, sync)

        def exact_out() -> bool:
            return torch.equal(out.view(-1, HEAD_DIM).view(torch.int16), refs[n].view(torch.int16))

        if "uva" in opts.paths:
            dev_sets = [s.to(dev) for s in sets]
            sec, _ = median_wall(
                lambda i: gather_kernels.gather(
                    dev_sets[i], tables.split_rows, tables.split_scales, quant_block=QUANT_BLOCK, out=out
                ),
                opts.reps,
                sync,
            )
            gather_kernels.gather(dev_sets[0], tables.split_rows, tables.split_scales, quant_block=QUANT_BLOCK, out=out)
            sync()
            results.append(
                Result(
                    rows=n,
                    path="uva",
                    layout="split",
                    threads=0,
                    seconds=sec,
                    gbps=gbps(n, sec),
                    x_link=gbps(n, sec) / link,
                    exact=exact_out(),
                )
            )
            del dev_sets

        if "host" in opts.paths:
            cfgs = _host_configs(opts)
            cap = max(c["chunk_rows"] for c in cfgs)
            cpu_rows = torch.empty((n, HEAD_DIM), dtype=torch.uint8, pin_memory=True)
            cpu_scales = torch.empty((n, SCALE_BYTES), dtype=torch.uint8, pin_memory=True)
            # The ids on the GPU too, for hbm-scales' dequant (a step's hash kernel leaves them there).
            id_sets_dev = [s.to(dev) for s in sets] if scales_dev is not None else None
            for threads, slots in itertools.product(opts.threads, opts.slots):
                g = hostgather.HostGatherer(
                    num_threads=threads, chunk_rows=cap, max_head_dim=HEAD_DIM, device=dev, num_slots=slots
                )
                g.set_options(spin_us=opts.spin_us)
                try:
                    for layout, cfg, pool, call in itertools.product(opts.layouts, cfgs, opts.pool, opts.call):
                        table = {
                            "inline": (tables.inline, None),
                            "split": (tables.split_rows, tables.split_scales),
                            "hbm-scales": (tables.split_rows, scales_dev),
                        }[layout]
                        on_gpu = (lambda i: id_sets_dev[i]) if layout == "hbm-scales" else (lambda i: None)
                        _set_tuning(g, cfg)

                        def wake(i: int) -> None:  # as a runtime does when a step starts: untimed
                            g.wake()
                            time.sleep(opts.wake_us / 1e6)

                        if call == "bound":
                            bound = g.bind(*table, quant_block=QUANT_BLOCK, layout=layout)

                            def one(i: int) -> Any:
                                return bound(sets[i], out, on_gpu(i))
                        else:

                            def one(i: int) -> Any:
                                return g.gather(
                                    sets[i], *table, quant_block=QUANT_BLOCK, out=out, layout=layout, ids_dev=on_gpu(i)
                                )

                        sec, _ = median_wall(
                            one,
                            opts.reps,
                            sync,
                            gap_s=IDLE_GAP_S if pool != "hot" else 0.0,
                            before=wake if pool == "woken" else None,
                        )
                        out.zero_()  # the check below sees this call's rows alone
                        one(0)
                        sync()
                        exact = exact_out()
                        cpu_sec, _ = median_wall(
                            lambda i: hostgather.gather_rows_cpu(
                                flat[i],
                                *table,
                                quant_block=QUANT_BLOCK,
                                layout=layout,
                                gatherer=g,
                                out_rows=cpu_rows,
                                out_scales=cpu_scales,
                            ),
                            opts.reps,
                            lambda: None,
                        )
                        results.append(
                            Result(
                                rows=n,
                                path="host",
                                layout=layout,
                                threads=threads,
                                seconds=sec,
                                gbps=gbps(n, sec),
                                x_link=gbps(n, sec) / link,
                                cpu_part_seconds=cpu_sec,
                                exact=exact,
                                slots=slots if len(opts.slots) > 1 else 0,
                                pool=pool if len(opts.pool) > 1 or pool != "hot" else "",
                                call="bound" if call == "bound" else "",
                                **cfg,
                            )
                        )
                finally:
                    g.close()
            del cpu_rows, cpu_scales, id_sets_dev

        if "split" in opts.paths:
            results += time_split(
                tables,
                sets,
                [s.to(dev) for s in sets],
                out,
                scales_dev,
                link,
                sync,
                exact_out,
                Result,
                layouts=opts.layouts,
                threads=opts.threads[0],
                chunk_rows=opts.chunk_rows[0],
                slots=opts.slots[0],
                spin_us=opts.spin_us,
                uva_shares=opts.uva_share,
                uva_blocks=opts.uva_blocks,
                reps=opts.reps,
            )

        if "torch" in opts.paths:
            longs = [f.long() for f in flat]
            saved = torch.get_num_threads()
            for threads in opts.threads:
                torch.set_num_threads(threads)

                def call_torch(i: int) -> None:
                    torch.index_select(tables.inline, 0, longs[i], out=stage)
                    dev_stage.copy_(stage, non_blocking=True)

                sec, _ = median_wall(call_torch, opts.reps, sync)
                gather_sec, _ = median_wall(
                    lambda i: torch.index_select(tables.inline, 0, longs[i], out=stage), opts.reps, lambda: None
                )
                call_torch(0)
                sync()
                ref_rows, ref_scales = raw_refs[n]
                exact = torch.equal(dev_stage[:, :HEAD_DIM], ref_rows) and torch.equal(
                    dev_stage[:, HEAD_DIM:], ref_scales
                )
                results.append(
                    Result(
                        rows=n,
                        path="torch",
                        layout="inline",
                        threads=threads,
                        seconds=sec,
                        gbps=gbps(n, sec),
                        x_link=gbps(n, sec) / link,
                        cpu_part_seconds=gather_sec,
                        exact=exact,
                    )
                )
            torch.set_num_threads(saved)
            time.sleep(0.5)  # let torch's OpenMP threads go idle before the next size's host gathers
    return {
        "results": [asdict(r) | {"knobs": r.knobs()} for r in results],
        "link_GBps": link,
        "copy_alone_seconds": {str(k): v for k, v in copy_alone.items()},
        "device": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
    }


def _targets(report: dict[str, Any]) -> list[str]:
    """Target 1's verdicts from the best host gather per size (empty on a dry run)."""
    link = report.get("link_GBps")
    if not link:
        return []
    host = [r for r in report["results"] if r["path"] in ("host", "split") and r["exact"]]
    lines = []
    pre = [r for r in host if r["rows"] == PREFILL_ROWS]
    if pre:
        best = max(pre, key=lambda r: r["gbps"])
        need = max(TARGET_PREFILL_GBPS, TARGET_PREFILL_LINK_RATIO * link)
        ok = best["gbps"] >= need
        lines.append(
            f"target 1, {PREFILL_ROWS:,} rows: best {best['path']} gather {best['gbps']:.1f} GB/s = "
            f"{best['gbps'] / link:.2f} x link ({best['layout']}, {best['threads']} threads, {best['knobs']}); "
            f"need >= {need:.1f} GB/s: " + ("MET" if ok else f"MISSED by {need / best['gbps']:.2f}x")
        )
    dec = [r for r in host if r["rows"] == DECODE_ROWS]
    if dec:
        best = min(dec, key=lambda r: r["seconds"])
        us = best["seconds"] * 1e6
        ok = us <= TARGET_DECODE_US
        lines.append(
            f"target 1, {DECODE_ROWS:,} rows: best {best['path']} gather {us:.0f} us ({best['layout']}, "
            f"{best['threads']} threads, {best['knobs']}); need <= {TARGET_DECODE_US:.0f} us: "
            + ("MET" if ok else f"MISSED by {us / TARGET_DECODE_US:.2f}x")
        )
    return lines


def _print_report(opts: GatherOptions, report: dict[str, Any]) -> None:
    link = report.get("link_GBps")
    print(
        f"host table: {report['table_rows']:,} rows x {ROW_BYTES} B = {report['table_gib']:.2f} GiB, "
        f"{report['pages']} pages"
        + (f" ({report['huge_pages_gib']:.1f} GiB in huge pages)" if report['pages'] == 'thp' else "")
        + f"; set up in {report['setup_seconds']:.1f} s"
    )
    if opts.dry_run:
        print("DRY RUN (no GPU): CPU parts only, on a small table; these figures say nothing about the target machine")
    else:
        print(f"{report['device']}, torch {report['torch']}; link (sequential 2 GiB pinned H2D copy): {link:.1f} GB/s")
        for n, s in report["copy_alone_seconds"].items():
            print(
                f"  one copy of {int(n):,} rows ({int(n) * ROW_BYTES / 1e6:.1f} MB) alone: {s * 1e6:.0f} us, "
                f"{gbps(int(n), s):.1f} GB/s"
            )
    headers = [
        "rows",
        "path",
        "layout",
        "threads",
        "knobs",
        "time us",
        "GB/s",
        "x link",
        "CPU part us",
        "x bound",
        "exact",
    ]
    table = []
    for r in report["results"]:
        bound = ""
        if r["path"] == "host" and link:
            b = max(r["cpu_part_seconds"], report["copy_alone_seconds"][str(r["rows"])])
            bound = f"{r['seconds'] / b:.2f}"
        table.append(
            [
                f"{r['rows']:,}",
                r["path"],
                r["layout"],
                r["threads"] or "-",
                r["knobs"],
                f"{r['seconds'] * 1e6:.0f}",
                f"{r['gbps']:.1f}",
                f"{r['x_link']:.2f}" if link else "-",
                f"{r['cpu_part_seconds'] * 1e6:.0f}" if r["cpu_part_seconds"] else "-",
                bound or "-",
                "yes" if r["exact"] else "NO",
            ]
        )
    print_table(headers, table)
    if link:
        print("x bound: time / max(copy alone, CPU part alone), 1.00 = copies and gather fully overlapped")
        print(
            f"GB/s and x link count {ROW_BYTES} B a row (values and scales, what the output needs); hbm-scales "
            f"moves {HEAD_DIM} B of them over the link (its scale bytes are read in GPU memory): by the bytes "
            f"that cross the link its GB/s is {HEAD_DIM / ROW_BYTES:.3f} x the one printed"
        )
    for line in _targets(report):
        print(line)
    bad = [r for r in report["results"] if not r["exact"]]
    if bad:
        print(f"{len(bad)} result(s) NOT bit-exact against the reference")


def _plot(report: dict[str, Any], path: str) -> None:
    if any(r["path"] == "split" for r in report["results"]):
        return plot_split(report, path, {PREFILL_ROWS: TARGET_PREFILL_GBPS})
    plt = require_matplotlib()
    sizes = sorted({r["rows"] for r in report["results"]})
    fig, axes = plt.subplots(1, len(sizes), figsize=(6 * len(sizes), 4.5), squeeze=False)
    link = report.get("link_GBps")
    for ax, n in zip(axes[0], sizes):
        rows = [r for r in report["results"] if r["rows"] == n]
        series: dict[str, list[tuple[int, float]]] = {}
        for r in rows:
            key = f"{r['path']} {r['layout']}" + (f" ({r['knobs']})" if r["path"] == "host" else "")
            series.setdefault(key, []).append((r["threads"], r["gbps"]))
        for key, pts in series.items():
            pts.sort()
            if len(pts) == 1 and pts[0][0] == 0:
                ax.axhline(pts[0][1], linestyle=":", label=key)
            else:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=key)
        if link:
            ax.axhline(link, color="k", linestyle="--", label=f"link {link:.1f} GB/s")
        if n == PREFILL_ROWS:
            ax.axhline(TARGET_PREFILL_GBPS, color="r", linestyle="-.", label="target 40 GB/s")
        ax.set_title(f"{n:,} rows x {ROW_BYTES} B")
        ax.set_xlabel("CPU threads")
        ax.set_ylabel("GB/s of row bytes delivered")
        ax.legend(fontsize=6)
    save_plot(fig, path)


OPTIONS = GatherOptions  # the script's flags, derived as an `engram-trt bench` command's (engram_trt.cli.bench)


def main(argv: list[str] | None = None) -> int:
    from engram_trt.cli.bench import run_script

    return run_script(OPTIONS, run, __doc__ or "", argv, prog=Path(__file__).name)


if __name__ == "__main__":
    sys.exit(main())
