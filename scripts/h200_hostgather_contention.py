#!/usr/bin/env python3
"""Why a host gather of 6,144 rows takes ~1.1 ms inside scripts/h200_verify.py and the
runtime's start-up calibration but ~140 us alone (docs/benchmarks.md): the same gather,
one process, timed after each suspect in turn. Each row is the median wall time of
(wake, gather, synchronize) over fresh id sets, and of the gather call's return alone
(its host part: the CPU threads, the last copy enqueued).

Suspects: torch's own CPU threads spinning after a parallel CPU op (OpenMP keeps its
workers busy-waiting for a while after each parallel region, on the same cores as the
gather's pool); many live gatherer pools; a Python thread holding the GIL; the call made
from a worker thread (as the prefetcher does); a UVA read of the table just before;
registered (cudaHostRegister) instead of cudaHostAlloc'd memory. One short GPU run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from engram_trt.native import kernels  # noqa: E402
from engram_trt.native.hostgather import HostGatherer  # noqa: E402
from h200_hostgather_sweep import HD, QB, pinned_fp8_table  # noqa: E402  (the same table as the sweep)

COLS = 24
SIZES = (6144, 196608)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--table-gib", type=float, default=4.0)
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # internal: the OMP_WAIT_POLICY run
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp")))
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    rows_n = int(args.table_gib * 2**30) // HD
    t0 = time.perf_counter()
    rows, scales = pinned_fp8_table(rows_n)
    print(f"table {rows_n:,} rows ready in {time.perf_counter() - t0:.1f} s; torch threads {torch.get_num_threads()}, "
          f"affinity {len(os.sched_getaffinity(0))} CPUs, torch parallel info: {torch.__config__.parallel_info().splitlines()[:4]}",
          flush=True)
    rng = np.random.default_rng(0)
    ids = {n: [torch.from_numpy(rng.integers(0, rows_n, size=(n // COLS, COLS)).astype(np.int32)) for _ in range(args.reps)]
           for n in SIZES}
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
            ts = [one(i) for i in range(args.reps)]
            res[f"{n}_us"] = statistics.median(t[0] for t in ts) * 1e6
            res[f"{n}_return_us"] = statistics.median(t[1] for t in ts) * 1e6
        results[label] = res
        print(f"{label:<58} {res['6144_us']:9.0f} us ({res['6144_return_us']:7.0f}) {res['196608_us']:9.0f} us "
              f"({res['196608_return_us']:7.0f})", flush=True)

    print(f"{'case':<58} {'6144 rows (call returns)':>26} {'196608 rows (call returns)':>28}")
    g = HostGatherer(device=dev, max_head_dim=512)
    measure("fresh process, default pool", g)
    if args.child:
        measure("after a float64 CPU matmul before each call", g, before=lambda n, i: a64 @ a64)
        measure("  ... and 20 ms sleep after it", g, before=lambda n, i: (a64 @ a64, time.sleep(0.02)))
        g.close()
        return 0
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
    measure("a UVA gather of the table before each call", g,
            before=lambda n, i: (kernels.gather(dev_ids[n][i], rows, scales, quant_block=QB, out=outs[n]),
                                 torch.cuda.synchronize(dev)))
    measure("GPU busy (a 2 ms kernel queued) before each call", g,
            before=lambda n, i: torch.cuda._sleep(2_000_000))
    reg_n = min(rows_n, (1 << 30) // HD)
    reg_rows = torch.empty((reg_n, HD), dtype=torch.uint8)
    reg_rows.copy_(rows[:reg_n])
    reg_scales = scales[:reg_n].clone()
    kernels.register_host_memory(reg_rows)
    kernels.register_host_memory(reg_scales)
    for n in SIZES:
        ids[n] = [x % reg_n for x in ids[n]]
    measure("registered 1 GiB table (cudaHostRegister), ids within it", g, table=(reg_rows, reg_scales))
    measure("the cudaHostAlloc table, the same ids", g)
    g.close()
    g = HostGatherer(device=dev, max_head_dim=512)
    measure("a new pool, again fresh (same ids)", g)
    g.close()
    if not args.child:
        import subprocess

        # The same after-matmul case in a process whose OpenMP workers sleep at once
        # (the CLI sets this default): does it remove the slowdown?
        env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
        out = subprocess.run([sys.executable, __file__, "--child", "--table-gib", "1", "--reps", str(args.reps),
                              "--out", str(args.out)], env=env, capture_output=True, text=True)
        print("OMP_WAIT_POLICY=PASSIVE child:\n" + out.stdout[-1500:] + out.stderr[-800:], flush=True)
        (args.out / "hostgather_contention.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
