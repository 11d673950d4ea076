"""The host gather's job buffers (``job_staging_bytes``, runtime/hostGather.cpp) on a GPU
(formerly scripts/h200_jobstaging_check.py, run by h200_hostgather_check.py):

  - the option: set, read back, refused outside [0, 2^40] with its name, 0 frees it;
  - exactness with job buffers, in the split, inline and hbm-scales layouts, against the
    NumPy dequant reference, many chunks through 2 slots, out-of-range ids;
  - reuse ordering: three calls in a row on a stream held back by a 50 ms sleep kernel,
    so every dequant runs after all three calls were issued; the third call reuses the
    first call's buffer and must wait for the first call's dequants (if it did not, the
    first call's rows would be the third's); every output equals its reference;
  - a call larger than the buffers falls back to the ring of slots, exact;
  - the point of it, timed: a prefill-sized gather (196,608 rows) on a high-priority
    stream while another stream runs long GEMMs (every SM held for ~1.5 ms at a time),
    with the ring of device slots alone against job buffers, beside the same gather on
    an idle GPU.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

from .helpers import note


def check_jobstaging(dev: Any, timings: dict[str, float], table: Any) -> None:
    """``table``: the fp8 test table and its helpers (helpers.fp8_test_table)."""
    import torch

    from engram_trt.native import hostgather
    from engram_trt.errors import EngramError

    rng = np.random.default_rng(17)
    N, D, QB = table.N, table.D, table.QB
    rows_t, scales_t, inline_t = table.rows_t, table.scales_t, table.inline_t
    ref_fp8, same = table.ref_fp8, table.same
    scales_dev = scales_t.to(dev)
    per_row = D + D // QB

    g = hostgather.HostGatherer(num_threads=0, chunk_rows=1000, max_head_dim=D, num_slots=2)
    g.set_options(min_chunks=1)
    # 1. the option
    refusals = []
    for bad in (-1, 2**40 + 1):
        try:
            g.set_options(job_staging_bytes=bad)
            refusals.append(f"{bad}: accepted")
        except EngramError as exc:
            refusals.append("ok" if "job_staging_bytes must be in [0, 1099511627776]" in str(exc) else str(exc))
    T, cols = 3001, 8
    g.set_options(job_staging_bytes=T * cols * per_row)
    back = g.options()["job_staging_bytes"]
    assert back == T * cols * per_row and refusals == ["ok", "ok"], (
        f"job buffers: set and read back, refused outside [0, 2^40] by name: read {back}; refusals {refusals}"
    )

    # 2. exactness in each layout
    ids = rng.integers(-50, N + 50, size=(T, cols)).astype(np.int32)
    ids_t = torch.from_numpy(ids)
    ref = ref_fp8(ids.reshape(-1))
    side = torch.cuda.Stream(priority=-1)
    ok = {}
    for layout, rows, scales in (
        ("split", rows_t, scales_t),
        ("inline", inline_t, None),
        ("hbm-scales", rows_t, scales_dev),
    ):
        with torch.cuda.stream(side):
            out = torch.full((T, cols, D), float("nan"), dtype=torch.bfloat16, device=dev)
            got = g.gather(
                ids_t,
                rows,
                scales,
                quant_block=QB,
                layout=layout,
                out=out,
                ids_dev=ids_t.to(dev) if layout == "hbm-scales" else None,
            )
        side.synchronize()
        ok[layout] = same(got.reshape(-1, D), ref)
    assert all(ok.values()), (
        f"job buffers: {T * cols} rows in 24 chunks through 2 slots == NumPy, out-of-range ids, split / inline / "
        f"hbm-scales: {ok}"
    )

    # 3. reuse ordering behind a held-back stream
    sets = [rng.integers(0, N, size=(T, cols)).astype(np.int32) for _ in range(3)]
    outs = []
    with torch.cuda.stream(side):
        torch.cuda._sleep(int(50e-3 * 1.98e9))  # ~50 ms at the H200's clock: every dequant waits behind it
        t0 = time.perf_counter()
        for s in sets:
            out = torch.full((T, cols, D), float("nan"), dtype=torch.bfloat16, device=dev)
            outs.append(g.gather(torch.from_numpy(s), rows_t, scales_t, quant_block=QB, layout="split", out=out))
        issued_ms = (time.perf_counter() - t0) * 1e3
    side.synchronize()
    exact = [same(o.reshape(-1, D), ref_fp8(s.reshape(-1))) for o, s in zip(outs, sets)]
    assert all(exact), (
        f"job buffers: three calls behind a 50 ms kernel (the third reuses the first's buffer) each == NumPy: "
        f"exact {exact}; the three calls returned after {issued_ms:.1f} ms (the third waits for the first's dequants)"
    )

    # 4. a call larger than the buffers: the ring
    big = rng.integers(0, N, size=(T * 2, cols)).astype(np.int32)
    got = g.gather(torch.from_numpy(big), rows_t, scales_t, quant_block=QB, layout="split")
    torch.cuda.synchronize()
    g.set_options(job_staging_bytes=0)
    freed = g.options()["job_staging_bytes"] == 0
    assert same(got.reshape(-1, D), ref_fp8(big.reshape(-1))) and freed, (
        "job buffers: a call larger than them runs through the ring, exact; 0 frees them"
    )
    g.close()

    # 5. timed: a prefill chunk's gather beside long GEMMs, ring against job buffers
    rows_n, cols_p = 8192, 24
    gp = hostgather.HostGatherer(device=dev, max_head_dim=512)
    pids = [torch.from_numpy(rng.integers(0, N, size=(rows_n, cols_p)).astype(np.int32)) for _ in range(6)]
    pids_dev = [p.to(dev) for p in pids]
    out = torch.empty((rows_n, cols_p, D), dtype=torch.bfloat16, device=dev)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
    load = torch.cuda.Stream(priority=0)
    cases: dict[str, list[float]] = {}
    for staging in ("ring", "job"):
        gp.set_options(job_staging_bytes=0 if staging == "ring" else rows_n * cols_p * D)
        for loaded in (False, True):
            times = []
            for rep in range(6):
                torch.cuda.synchronize()
                if loaded:
                    with torch.cuda.stream(load):
                        for _ in range(40):
                            torch.mm(a, b)
                    time.sleep(2e-3)  # the GEMMs hold the SMs before the gather starts
                with torch.cuda.stream(side):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record(side)
                    gp.gather(
                        pids[rep],
                        rows_t,
                        scales_dev,
                        quant_block=QB,
                        layout="hbm-scales",
                        out=out,
                        ids_dev=pids_dev[rep],
                    )
                    end.record(side)
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
            torch.cuda.synchronize()
            cases[f"{staging}, {'beside GEMMs' if loaded else 'idle GPU'}"] = times
    gp.close()
    want = ref_fp8(pids[5].numpy().reshape(-1))
    exact = same(out.reshape(-1, D), want)
    med = {k: statistics.median(v) for k, v in cases.items()}
    for k, v in med.items():
        timings[f"host gather, 196,608 rows, hbm-scales, {k} (us)"] = v
    assert exact, (
        "job buffers: a 196,608-row gather beside long GEMMs (timed: ring against job buffers), last output "
        "== NumPy: " + "; ".join(f"{k} {v:,.0f} us" for k, v in med.items())
    )


def test_jobstaging(dev, tab) -> None:
    timings: dict[str, float] = {}
    try:
        check_jobstaging(dev, timings, tab)
    finally:
        note("timings", timings)
