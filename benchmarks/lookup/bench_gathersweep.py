#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""``python benchmarks/lookup/bench_gathersweep.py``: why the host gather of a decode step is slow in some
callers. A pinned fp8 table (24 GiB by default, as ``bench kernels``'), uniform ids, the
gather timed as the runtime sees it (wall time from the call to the stream's completion,
median over fresh id sets) under several settings of the pool and of torch's own CPU
threads: back to back, after 1 ms idle, woken first, 8 and 4 threads, a 5 ms spin,
16,384-row chunks, torch.set_num_threads(1). Each time is reported as a ratio to the
link's floor (the gather's bytes at the host-to-device copy rate measured in the same
run) and to the first variant (the default pool, back to back).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# engram_trt from this checkout and this folder's modules, then tests/gpu/cases.py (the GPU cases tests/gpu checks):
sys.path[:0] = [p for p in (str(REPO / "python"), str(Path(__file__).resolve().parent)) if p not in sys.path]
if str(REPO / "tests" / "gpu") not in sys.path:
    sys.path.append(str(REPO / "tests" / "gpu"))

import statistics  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any  # noqa: E402

from engram_trt.bench.options import opt  # noqa: E402


@dataclass(kw_only=True)
class GathersweepOptions:
    """``python benchmarks/lookup/bench_gathersweep.py``'s flags."""

    table_gib: float = opt(24.0, help="GiB of fp8 rows in the pinned table (+ 1/32 of scales; default: %(default)s)")
    reps: int = opt(20, help="timed id sets per case (median; default: %(default)s)")
    json: str | None = opt(None, metavar="FILE", help="write all figures as JSON to FILE")


# (name, HostGatherer options, wake() before each call, idle seconds before each call, torch threads)
VARIANTS = [
    ("default, back to back", {}, False, 0.0, None),
    ("default, 1 ms idle before each", {}, False, 1e-3, None),
    ("default, 1 ms idle, wake()", {}, True, 1e-3, None),
    ("8 threads, 1 ms idle, wake()", {"num_threads": 8}, True, 1e-3, None),
    ("4 threads, 1 ms idle, wake()", {"num_threads": 4}, True, 1e-3, None),
    ("spin 5 ms, 1 ms idle", {"spin_us": 5000}, False, 1e-3, None),
    ("chunk 16384 rows, back to back", {"chunk_rows": 16384}, False, 0.0, None),
    ("torch.set_num_threads(1), 1 ms idle, wake()", {}, True, 1e-3, 1),
]


def link_floor_us(n_rows: int, h2d_GBps: float) -> float:
    """The link's floor of a gather of ``n_rows`` fp8 rows: its bytes at the H2D rate."""
    from cases import gather_bytes

    return gather_bytes(n_rows) / (h2d_GBps * 1e9) * 1e6


def run(opts: GathersweepOptions) -> int:
    """Times each variant at 6,144 and 196,608 rows; prints the table and writes
    ``variants`` (name -> {"<rows>_us", "<rows>_x_floor", "<rows>_x_default", "options"})
    and ``limits`` as JSON when ``opts.json`` is set."""
    import torch

    from engram_trt.bench.common import dump, measure_limits
    from cases import COLS, GATHER_ROWS, HEAD_DIM, QUANT_BLOCK, pinned_fp8_table, require_cuda
    from engram_trt.errors import EngramError
    from engram_trt.native.hostgather import HostGatherer

    if opts.reps < 3 or opts.table_gib <= 0:
        raise EngramError(f"--reps must be >= 3 and --table-gib > 0 (got {opts.reps}, {opts.table_gib})")
    dev = require_cuda("gathersweep")
    limits = measure_limits(dev)
    num_rows = int(opts.table_gib * 2**30) // HEAD_DIM
    t0 = time.perf_counter()
    rows, scales = pinned_fp8_table(num_rows)
    print(
        f"table of {num_rows:,} rows ready in {time.perf_counter() - t0:.1f} s; H2D copy {limits['h2d_GBps']:.1f} GB/s "
        f"(the floor's rate)",
        flush=True,
    )
    gen = torch.Generator().manual_seed(0)
    ids = {
        n: [torch.randint(0, num_rows, (n // COLS, COLS), generator=gen, dtype=torch.int32) for _ in range(opts.reps)]
        for n in GATHER_ROWS
    }
    outs = {n: torch.empty((n // COLS, COLS, HEAD_DIM), dtype=torch.bfloat16, device=dev) for n in ids}
    floor = {n: link_floor_us(n, limits["h2d_GBps"]) for n in GATHER_ROWS}

    def time_it(g: Any, n: int, wake: bool, pause: float) -> float:
        for i in range(3):
            g.gather(ids[n][i], rows, scales, quant_block=QUANT_BLOCK, out=outs[n])
        torch.cuda.synchronize(dev)
        ts = []
        for i in range(opts.reps):
            if pause:
                time.sleep(pause)  # as between decode steps: the pool goes idle
            if wake:
                g.wake()
            t = time.perf_counter()
            g.gather(ids[n][i], rows, scales, quant_block=QUANT_BLOCK, out=outs[n])
            torch.cuda.synchronize(dev)
            ts.append(time.perf_counter() - t)
        return statistics.median(ts) * 1e6

    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(dev),
        "table_rows": num_rows,
        "limits": limits,
        "floor_us": floor,
        "variants": {},
    }
    print(f"{'variant':48s} " + " ".join(f"{f'{n} rows: us, x floor, x default':>34s}" for n in GATHER_ROWS))
    threads_before = torch.get_num_threads()
    default: dict[int, float] = {}
    try:
        for name, options, wake, pause, torch_threads in VARIANTS:
            if torch_threads is not None:
                torch.set_num_threads(torch_threads)
            ctor = {k: v for k, v in options.items() if k in ("num_threads", "chunk_rows")}
            g = HostGatherer(device=dev, max_head_dim=512, **ctor)
            rest = {k: v for k, v in options.items() if k not in ctor}
            if rest:
                g.set_options(**rest)
            row: dict[str, Any] = {"options": g.options()}
            for n in GATHER_ROWS:
                us = time_it(g, n, wake, pause)
                default.setdefault(n, us)
                row.update({f"{n}_us": us, f"{n}_x_floor": us / floor[n], f"{n}_x_default": us / default[n]})
            result["variants"][name] = row
            print(
                f"{name:48s} "
                + " ".join(
                    f"{row[f'{n}_us']:14.0f} us {row[f'{n}_x_floor']:7.2f} {row[f'{n}_x_default']:9.2f}"
                    for n in GATHER_ROWS
                )
                + f"   options {row['options']}",
                flush=True,
            )
            g.close()
            torch.set_num_threads(threads_before)
    finally:
        torch.set_num_threads(threads_before)
    print(
        "floor: the gather's bytes (rows + scales) at the H2D copy rate measured in this run; "
        "x default: against the first variant"
    )
    dump(result, opts.json)
    return 0


OPTIONS = GathersweepOptions  # the script's flags, derived as an `engram-trt bench` command's (engram_trt.cli.bench)


def main(argv: list[str] | None = None) -> int:
    from engram_trt.cli.bench import run_script

    return run_script(OPTIONS, run, __doc__ or "", argv, prog=Path(__file__).name)


if __name__ == "__main__":
    sys.exit(main())
