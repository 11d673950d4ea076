#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""``python benchmarks/lookup/bench_cacheplan.py``: the hot-row cache's step on the GPU, timed against a
baseline and a bound of the same run (the cache is checked by tests/gpu/test_cache.py).

- plan: a prefill chunk of 196,608 Zipf(1.15) lookups on a 50M-row table with a warm 5%
  cache; the fused plan + admission kernels against the policy's torch reference on the
  GPU (plan alone, plan + admission, misses per step);
- fetch: the raw fetch of a cache's misses (gather_raw into device arrays), uniform rows of
  a 1 GiB table on the runtime's pages ('auto'), fresh rows each call: inline against
  hbm-scales in turns, the pool woken at a plan's start (spin 300 us, then 150 us of
  waiting, as the plan's sync) against asleep (spin 50 us, 1 ms idle); 2,048 and 40,960
  rows, so the call's fixed cost and its cost per row can be told apart.

Ratios: a fused plan's time over the torch reference's (the baseline), a fetch's over
the link's floor (its rows' and scales' bytes at the host-to-device copy rate measured in
the same run).
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
class CacheplanOptions:
    """``python benchmarks/lookup/bench_cacheplan.py``'s flags."""

    plan_reps: int = opt(20, help="timed prefill chunks per policy (median; default: %(default)s)")
    fetch_reps: int = opt(15, help="timed fetches per case (median; default: %(default)s)")
    skip_plans: bool = opt(False, help="time the fetch only")
    skip_fetch: bool = opt(False, help="time the plans only")
    json: str | None = opt(None, metavar="FILE", help="write all figures as JSON to FILE")


def time_fetch(dev: Any, timings: dict[str, float], reps: int = 15) -> None:
    """The raw fetch of a cache's misses (gather_raw into device arrays), uniform rows of
    a 1 GiB table on the runtime's pages ('auto'), fresh rows each call: inline against
    hbm-scales in turns, the pool woken at a plan's start (spin 300 us, then 150 us of
    waiting, as the plan's sync) against asleep (spin 50 us, 1 ms idle). Two sizes, so the
    call's fixed cost and its cost per row can be told apart."""
    import numpy as np
    import torch

    from engram_trt.native import hostgather
    from lookuputil import make_tables

    rows = 4 << 20
    tables = make_tables(rows, split=True, inline=True, huge_pages="auto", register_split=False, seed=4)
    scales_dev = tables.split_scales.to(dev)
    g = hostgather.HostGatherer(device=dev, max_head_dim=256)
    rng = np.random.default_rng(8)
    forms = {"inline": (tables.inline, None), "hbm-scales": (tables.split_rows, scales_dev)}
    try:
        for n in (2_048, 40_960):
            dst_r = torch.empty((n, 256), dtype=torch.uint8, device=dev)
            dst_s = torch.empty((n, 8), dtype=torch.uint8, device=dev)
            got: dict[str, list[float]] = {}
            for i in range(reps + 1):
                for pool in ("woken", "asleep"):
                    for layout, table in forms.items() if i % 2 else reversed(forms.items()):
                        # fresh rows each call: a repeat would find them in the host's L3
                        ids = torch.from_numpy(rng.integers(0, rows, size=n).astype(np.int32)).pin_memory()
                        ids_dev = ids.to(dev)
                        torch.cuda.synchronize(dev)
                        if pool == "woken":
                            g.set_options(spin_us=300)
                            g.wake()
                            time.sleep(150e-6)
                        else:
                            g.set_options(spin_us=50)
                            time.sleep(1e-3)
                        t0 = time.perf_counter()
                        g.gather_raw(
                            ids,
                            *table,
                            dst_rows=dst_r,
                            dst_scales=dst_s,
                            layout=layout,
                            ids_dev=ids_dev if layout == "hbm-scales" else None,
                        )
                        torch.cuda.synchronize(dev)
                        if i:
                            got.setdefault(f"raw fetch {n:,} rows, {layout}, pool {pool} (us)", []).append(
                                (time.perf_counter() - t0) * 1e6
                            )
            timings.update({k: statistics.median(v) for k, v in got.items()})
    finally:
        g.close()
        tables.close()


def time_plans(dev: Any, timings: dict[str, float], reps: int = 20) -> None:
    """A prefill chunk's plan + admission: fused kernels against the torch reference on the GPU."""
    import numpy as np
    import torch

    from engram_trt.cache.policy import CachePolicy

    rng = np.random.default_rng(5)
    rows, n = 50_331_648, 196_608
    counts = np.bincount(((rng.zipf(1.15, size=8_000_000) * 7919) % rows), minlength=rows)
    steps = [
        torch.from_numpy(((rng.zipf(1.15, size=n) * 7919) % rows).astype(np.int32)).pin_memory()
        for _ in range(reps + 3)
    ]
    for fused in (True, False):
        policy = CachePolicy(rows, rows // 20, device=dev, fused=fused, initial_counts=counts)
        plan_t, all_t = [], []
        for k, ids in enumerate(steps):
            torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            plan = policy.plan(ids)
            t1 = time.perf_counter()
            policy.finish(plan, replace=k % 4 == 3)
            torch.cuda.synchronize(dev)
            if k >= 3:
                plan_t.append(t1 - t0)
                all_t.append(time.perf_counter() - t0)
        key = "fused" if fused else "reference"
        timings[f"plan {key} (us)"] = statistics.median(plan_t) * 1e6
        timings[f"plan + admission {key} (us)"] = statistics.median(all_t) * 1e6
        timings[f"misses per step {key}"] = float(plan.num_miss)
        del policy
        torch.cuda.empty_cache()


def ratios(timings: dict[str, float], h2d_GBps: float) -> dict[str, float]:
    """The fused plans over the reference's, each fetch over the link's floor (its bytes:
    256-byte rows + 8 scale bytes each, at the H2D rate)."""
    import re

    out: dict[str, float] = {}
    for what in ("plan", "plan + admission"):
        fused, ref = timings.get(f"{what} fused (us)"), timings.get(f"{what} reference (us)")
        if fused and ref:
            out[f"{what}: fused / reference"] = fused / ref
    for key, us in timings.items():
        m = re.match(r"raw fetch ([\d,]+) rows", key)
        if m:
            floor_us = int(m.group(1).replace(",", "")) * (256 + 8) / (h2d_GBps * 1e9) * 1e6
            out[key.replace(" (us)", "") + ": x link floor"] = us / floor_us
    return out


def run(opts: CacheplanOptions) -> int:
    """Times the plans, then the fetches; prints one line per figure and its ratios, and
    writes them (``timings``: name -> value, microseconds where the name says us;
    ``ratios``; ``limits``) as JSON when ``opts.json`` is set."""
    import torch

    from engram_trt.bench.common import dump, measure_limits
    from cases import require_cuda
    from engram_trt.errors import EngramError

    if opts.plan_reps < 1 or opts.fetch_reps < 1:
        raise EngramError(f"--plan-reps and --fetch-reps must be >= 1 (got {opts.plan_reps}, {opts.fetch_reps})")
    if opts.skip_plans and opts.skip_fetch:
        raise EngramError("--skip-plans and --skip-fetch together leave nothing to time: give at most one")
    dev = require_cuda("cacheplan")
    limits = measure_limits(dev)
    timings: dict[str, float] = {}
    if not opts.skip_plans:
        time_plans(dev, timings, opts.plan_reps)
    if not opts.skip_fetch:
        time_fetch(dev, timings, opts.fetch_reps)
    got = ratios(timings, limits["h2d_GBps"])
    print("| timing (medians) | value |")
    print("| --- | --- |")
    for k, v in timings.items():
        print(f"| {k} | {v:,.0f} |")
    print(f"| ratio (H2D copy {limits['h2d_GBps']:.1f} GB/s measured now) | value |")
    print("| --- | --- |")
    for k, v in got.items():
        print(f"| {k} | {v:.2f} |")
    dump({"device": torch.cuda.get_device_name(dev), "limits": limits, "timings": timings, "ratios": got}, opts.json)
    return 0


OPTIONS = CacheplanOptions  # the script's flags, derived as an `engram-trt bench` command's (engram_trt.cli.bench)


def main(argv: list[str] | None = None) -> int:
    from engram_trt.cli.bench import run_script

    return run_script(OPTIONS, run, __doc__ or "", argv, prog=Path(__file__).name)


if __name__ == "__main__":
    sys.exit(main())
