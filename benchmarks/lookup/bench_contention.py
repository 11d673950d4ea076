#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""``python benchmarks/lookup/bench_contention.py``: why a host gather of 6,144 rows took ~1.1 ms inside the
GPU checks and the runtime's start-up calibration but ~140 us alone (docs/benchmarks.md):
the same gather, one process, timed after each suspect in turn. Each row is the median wall time of
(wake, gather, synchronize) over fresh id sets, and of the gather call's return alone
(its host part: the CPU threads, the last copy enqueued), each also as a ratio to the
first case (a fresh process's default pool) and to the link's floor (the gather's bytes
at the host-to-device copy rate measured in the same run).

Suspects: torch's own CPU threads spinning after a parallel CPU op (OpenMP keeps its
workers busy-waiting for a while after each parallel region, on the same cores as the
gather's pool); many live gatherer pools; a Python thread holding the GIL; the call made
from a worker thread (as the prefetcher does); a UVA read of the table just before;
registered (cudaHostRegister) instead of cudaHostAlloc'd memory; and, in a child process
with OMP_WAIT_POLICY=PASSIVE (``bench_contention.py --child REPS``), the
after-matmul cases again. One short GPU run.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# engram_trt from this checkout and this folder's modules, then tests/gpu/cases.py (the GPU cases tests/gpu checks):
sys.path[:0] = [p for p in (str(REPO / "python"), str(Path(__file__).resolve().parent)) if p not in sys.path]
if str(REPO / "tests" / "gpu") not in sys.path:
    sys.path.append(str(REPO / "tests" / "gpu"))

import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from engram_trt.bench.options import opt  # noqa: E402


@dataclass(kw_only=True)
class ContentionOptions:
    """``python benchmarks/lookup/bench_contention.py``'s flags."""

    table_gib: float = opt(4.0, help="GiB of fp8 rows in the pinned table (default: %(default)s)")
    reps: int = opt(12, help="timed id sets per case (median; default: %(default)s)")
    json: str | None = opt(None, metavar="FILE", help="write all figures as JSON to FILE")


CHILD_TABLE_GIB = 1.0  # the OMP_WAIT_POLICY=PASSIVE child's table


def measure_cases(table_gib: float, reps: int, child: bool) -> dict[str, dict[str, float]]:
    """Times the gather after each suspect (``child``: the child's cases only); prints one
    line per case and returns label -> {"<rows>_us", "<rows>_return_us"}."""
    import numpy as np
    import torch

    from cases import COLS, GATHER_ROWS, HEAD_DIM, QUANT_BLOCK, pinned_fp8_table
    from engram_trt.native import gather as gather_kernels
    from engram_trt.native import library as kernel_library
    from engram_trt.native.hostgather import HostGatherer

    HD, QB, SIZES = HEAD_DIM, QUANT_BLOCK, GATHER_ROWS
    dev = torch.device("cuda", torch.cuda.current_device())
    rows_n = int(table_gib * 2**30) // HD
    t0 = time.perf_counter()
    rows, scales = pinned_fp8_table(rows_n)
    print(
        f"table {rows_n:,} rows ready in {time.perf_counter() - t0:.1f} s; "
        f"torch threads {torch.get_num_threads()}, affinity {len(os.sched_getaffinity(0))} CPUs, "
        f"torch parallel info: {torch.__config__.parallel_info().splitlines()[:4]}",
        flush=True,
    )
    rng = np.random.default_rng(0)
    ids = {
        n: [torch.from_numpy(rng.integers(0, rows_n, size=(n // COLS, COLS)).astype(np.int32)) for _ in range(reps)]
        for n in SIZES
    }
    dev_ids = {n: [x.to(dev) for x in v] for n, v in ids.items()}
    outs = {n: torch.empty((n // COLS, COLS, HD), dtype=torch.bfloat16, device=dev) for n in SIZES}
    a64 = torch.randn(768, 768, dtype=torch.float64)
    results: dict[str, dict[str, float]] = {}

    def measure(label: str, g: HostGatherer, before=None, call=None, table=(rows, scales)) -> None:
        res = {}
        for n in SIZES:

            def one(i: int) -> float:
                if before is not None:
                    before(n, i)
                t = time.perf_counter()
                g.wake()
                if call is None:
                    g.gather(ids[n][i], table[0], table[1], quant_block=QB, out=outs[n])
                else:
                    call(lambda: g.gather(ids[n][i], table[0], table[1], quant_block=QB, out=outs[n]))
                ret = time.perf_counter() - t
                torch.cuda.synchronize(dev)
                return time.perf_counter() - t, ret

            for i in range(2):
                one(i)
            ts = [one(i) for i in range(reps)]
            res[f"{n}_us"] = statistics.median(t[0] for t in ts) * 1e6
            res[f"{n}_return_us"] = statistics.median(t[1] for t in ts) * 1e6
        results[label] = res
        print(
            f"{label:<58} {res['6144_us']:9.0f} us ({res['6144_return_us']:7.0f}) {res['196608_us']:9.0f} us "
            f"({res['196608_return_us']:7.0f})",
            flush=True,
        )

    print(f"{'case':<58} {'6144 rows (call returns)':>26} {'196608 rows (call returns)':>28}")
    g = HostGatherer(device=dev, max_head_dim=512)
    measure("fresh process, default pool", g)
    if child:
        measure("after a float64 CPU matmul before each call", g, before=lambda n, i: a64 @ a64)
        measure("  ... and 20 ms sleep after it", g, before=lambda n, i: (a64 @ a64, time.sleep(0.02)))
        g.close()
        return results
    measure("after a float64 CPU matmul before each call", g, before=lambda n, i: a64 @ a64)
    measure("  ... and 20 ms sleep after it", g, before=lambda n, i: (a64 @ a64, time.sleep(0.02)))
    nt = torch.get_num_threads()
    torch.set_num_threads(1)
    measure("torch.set_num_threads(1), matmul before each call", g, before=lambda n, i: a64 @ a64)
    torch.set_num_threads(nt)
    measure("threads restored, no matmul", g)
    extra = [HostGatherer(device=dev, max_head_dim=512) for _ in range(20)]
    for e in extra:
        e.gather(ids[6144][0], rows, scales, quant_block=QB, out=outs[6144])
    torch.cuda.synchronize(dev)
    measure("20 other pools alive (each used once)", g)
    for e in extra:
        e.close()
    stop = threading.Event()

    def spin() -> None:
        x = 0
        while not stop.is_set():
            x += 1

    th = threading.Thread(target=spin, daemon=True)
    th.start()
    measure("a Python thread busy (holding the GIL between switches)", g)
    stop.set()
    th.join()
    pool = ThreadPoolExecutor(1)
    measure("called from a worker thread (as the prefetcher)", g, call=lambda f: pool.submit(f).result())
    g.set_options(spin_us=5000)
    measure("  ... with the pool spinning 5 ms (no sleep across the hop)", g, call=lambda f: pool.submit(f).result())
    g.set_options(spin_us=50)
    pool.shutdown()
    # One non-main thread that runs the whole timed loop itself (as an engine thread
    # does): is it the thread, or the hop per call?

    def in_thread() -> None:
        measure("the whole loop on one non-main thread", g)

    th = threading.Thread(target=in_thread)
    th.start()
    th.join()
    measure(
        "a UVA gather of the table before each call",
        g,
        before=lambda n, i: (
            gather_kernels.gather(dev_ids[n][i], rows, scales, quant_block=QB, out=outs[n]),
            torch.cuda.synchronize(dev),
        ),
    )
    measure("GPU busy (a 2 ms kernel queued) before each call", g, before=lambda n, i: torch.cuda._sleep(2_000_000))
    reg_n = min(rows_n, (1 << 30) // HD)
    reg_rows = torch.empty((reg_n, HD), dtype=torch.uint8)
    reg_rows.copy_(rows[:reg_n])
    reg_scales = scales[:reg_n].clone()
    kernel_library.register_host_memory(reg_rows)
    kernel_library.register_host_memory(reg_scales)
    for n in SIZES:
        ids[n] = [x % reg_n for x in ids[n]]
    measure("registered 1 GiB table (cudaHostRegister), ids within it", g, table=(reg_rows, reg_scales))
    measure("the cudaHostAlloc table, the same ids", g)
    g.close()
    g = HostGatherer(device=dev, max_head_dim=512)
    measure("a new pool, again fresh (same ids)", g)
    g.close()
    return results


def child_cases(reps: int) -> dict[str, Any]:
    """The after-matmul cases again in a child process whose OpenMP workers sleep at once
    (OMP_WAIT_POLICY=PASSIVE, the CLI's default): does that remove the slowdown? Its
    cases, or {"failed": its exit status and output's tail}."""
    import engram_trt

    root = str(Path(engram_trt.__file__).resolve().parents[1])
    env = dict(
        os.environ,
        OMP_WAIT_POLICY="PASSIVE",
        PYTHONPATH=os.pathsep.join([root] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])),
    )
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--child", str(reps)], env=env, capture_output=True, text=True
    )
    print("OMP_WAIT_POLICY=PASSIVE child:\n" + out.stdout[-1500:] + out.stderr[-800:], flush=True)
    found = [line for line in out.stdout.splitlines() if line.startswith("CHILD ")]
    if out.returncode or not found:
        return {"failed": f"exit {out.returncode}: {(out.stdout + out.stderr)[-400:]}"}
    return json.loads(found[-1][6:])


def with_ratios(cases: dict[str, dict[str, float]], floor_us: dict[int, float]) -> dict[str, dict[str, float]]:
    """Each case's times with their ratios to the first case and to the link's floor."""
    first = next(iter(cases.values()))
    out = {}
    for label, res in cases.items():
        row = dict(res)
        for n, floor in floor_us.items():
            row[f"{n}_x_first"] = res[f"{n}_us"] / first[f"{n}_us"]
            row[f"{n}_x_floor"] = res[f"{n}_us"] / floor
        out[label] = row
    return out


def run(opts: ContentionOptions) -> int:
    """Times the gather after each suspect, then the child's cases; prints one line per
    case and a table of the ratios, and writes ``cases`` (label -> times and ratios),
    ``child`` and ``limits`` as JSON when ``opts.json`` is set; 1 when the child failed."""
    import torch

    from engram_trt.bench.common import dump, measure_limits
    from bench_gathersweep import link_floor_us
    from cases import GATHER_ROWS, require_cuda
    from engram_trt.errors import EngramError

    if opts.reps < 2 or opts.table_gib <= 0:
        raise EngramError(f"--reps must be >= 2 and --table-gib > 0 (got {opts.reps}, {opts.table_gib})")
    dev = require_cuda("contention")
    limits = measure_limits(dev)
    floor = {n: link_floor_us(n, limits["h2d_GBps"]) for n in GATHER_ROWS}
    cases = with_ratios(measure_cases(opts.table_gib, opts.reps, child=False), floor)
    child = child_cases(opts.reps)
    if "failed" not in child:
        child = with_ratios(child, floor)
    print(f"{'case':<58} " + " ".join(f"{f'{n} rows: x first, x floor':>28}" for n in GATHER_ROWS))
    for label, row in cases.items():
        print(
            f"{label:<58} " + " ".join(f"{row[f'{n}_x_first']:19.2f} {row[f'{n}_x_floor']:8.2f}" for n in GATHER_ROWS)
        )
    print(
        f"floor: the gather's bytes at the H2D copy rate measured in this run ({limits['h2d_GBps']:.1f} GB/s); "
        "x first: against the first case"
    )
    dump(
        {
            "device": torch.cuda.get_device_name(dev),
            "limits": limits,
            "floor_us": floor,
            "cases": cases,
            "child (OMP_WAIT_POLICY=PASSIVE, 1 GiB table)": child,
        },
        opts.json,
    )
    return 1 if "failed" in child else 0


OPTIONS = ContentionOptions  # the script's flags, derived as an `engram-trt bench` command's (engram_trt.cli.bench)


def main(argv: list[str] | None = None) -> int:
    from engram_trt.cli.bench import run_script

    return run_script(OPTIONS, run, __doc__ or "", argv, prog=Path(__file__).name)


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:  # the child: bench_contention.py --child REPS
    print("CHILD " + json.dumps(measure_cases(CHILD_TABLE_GIB, int(sys.argv[2]), child=True)), flush=True)
elif __name__ == "__main__":
    sys.exit(main())
