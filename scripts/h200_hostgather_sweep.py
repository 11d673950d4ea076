#!/usr/bin/env python3
"""Why the host gather of a decode step is slow in some callers: the same 24.75 GiB
pinned table and uniform ids as scripts/h200_timing.py, the gather timed the same way
(wall time from the call to the stream's completion, median of 20 fresh id sets), under
several settings of the pool and of torch's own CPU threads. One short GPU run; a table
at the end."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python"))

import torch  # noqa: E402

from engram_trt.native.hostgather import HostGatherer  # noqa: E402

ROWS, HD, QB = 100_663_296, 256, 32


def pinned_fp8_table(num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A split fp8 table in pinned (cudaHostAlloc) memory: a random 64 MiB block tiled
    over the rows (no NaN codes: bytes < 120), every scale 2^0."""
    rows = torch.empty((num_rows, HD), dtype=torch.uint8, pin_memory=True)
    scales = torch.empty((num_rows, HD // QB), dtype=torch.uint8, pin_memory=True)
    block = torch.randint(0, 120, (1 << 26,), dtype=torch.uint8)
    flat = rows.view(-1)
    for a in range(0, flat.numel(), block.numel()):
        n = min(block.numel(), flat.numel() - a)
        flat[a:a + n].copy_(block[:n])
    scales.fill_(127)
    return rows, scales


def main() -> int:
    dev = torch.device("cuda", 0)
    t0 = time.perf_counter()
    rows, scales = pinned_fp8_table(ROWS)
    print(f"table ready in {time.perf_counter() - t0:.1f} s", flush=True)
    gen = torch.Generator().manual_seed(0)
    ids = {n: [torch.randint(0, ROWS, (n // 24, 24), generator=gen, dtype=torch.int32) for _ in range(20)]
           for n in (6144, 196608)}
    outs = {n: torch.empty((n // 24, 24, HD), dtype=torch.bfloat16, device=dev) for n in ids}

    def time_it(g: HostGatherer, n: int, wake: bool, pause: float) -> float:
        for i in range(3):
            g.gather(ids[n][i], rows, scales, quant_block=QB, out=outs[n])
        torch.cuda.synchronize(dev)
        ts = []
        for i in range(20):
            if pause:
                time.sleep(pause)  # as between decode steps: the pool goes idle
            if wake:
                g.wake()
            t = time.perf_counter()
            g.gather(ids[n][i], rows, scales, quant_block=QB, out=outs[n])
            torch.cuda.synchronize(dev)
            ts.append(time.perf_counter() - t)
        return statistics.median(ts) * 1e6

    variants = [
        ("default, back to back", {}, False, 0.0, None),
        ("default, 1 ms idle before each", {}, False, 1e-3, None),
        ("default, 1 ms idle, wake()", {}, True, 1e-3, None),
        ("8 threads, 1 ms idle, wake()", {"num_threads": 8}, True, 1e-3, None),
        ("4 threads, 1 ms idle, wake()", {"num_threads": 4}, True, 1e-3, None),
        ("spin 5 ms, 1 ms idle", {"spin_us": 5000}, False, 1e-3, None),
        ("chunk 16384 rows, back to back", {"chunk_rows": 16384}, False, 0.0, None),
        ("torch.set_num_threads(1), 1 ms idle, wake()", {}, True, 1e-3, 1),
    ]
    print(f"{'variant':48s} {'6144 rows':>12s} {'196608 rows':>12s}")
    for name, opts, wake, pause, torch_threads in variants:
        if torch_threads is not None:
            torch.set_num_threads(torch_threads)
        ctor = {k: v for k, v in opts.items() if k in ("num_threads", "chunk_rows")}
        g = HostGatherer(device=dev, max_head_dim=512, **ctor)
        rest = {k: v for k, v in opts.items() if k not in ctor}
        if rest:
            g.set_options(**rest)
        r = [time_it(g, n, wake, pause) for n in (6144, 196608)]
        print(f"{name:48s} {r[0]:10.0f} us {r[1]:10.0f} us   options {g.options()}", flush=True)
        g.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
