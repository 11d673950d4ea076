"""The host gather's pipeline and the hot-row cache on a GPU (formerly
scripts/h200_hostgather_check.py; its cache, driver and job-buffer parts are
test_cache.py, test_driver.py and test_jobstaging.py).

Exactness on small tables (seconds), every case against an independent reference (the
float32 NumPy dequant, or the table's own rows for bf16 and raw bytes):
  - fp8 to bf16, split, inline and hbm-scales layouts (hbm-scales: the scale bytes read on
    the GPU by id), many chunks through 2 slots (slot reuse), out-of-range ids, the ids of
    one layer of [T, L, cols] (strided), a side stream; hbm-scales' refusals; a gather
    bound to its table;
  - bf16 tables (copied straight into the output);
  - raw rows into device arrays (fp8 and bf16), ordered after the stream's earlier work,
    and with the scales in HBM (the values copied alone, the scale bytes gathered on the
    GPU by the device ids; out-of-range ids: zero rows, scale byte 127);
  - tuning knobs round-trip; a pool sized 1 (the caller alone);
  - the hot-row cache on CUDA against the plain host gather, and calibrate_gather.

The tests run in file order on one gatherer (num_threads 0, chunks of 1000 rows, 2 slots),
as the script did: the knobs set by test_knobs stay set for the tests after it.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest


@pytest.fixture(scope="module")
def hg(tab, gpu_seed: int):
    """The gatherer the first tests share, and their ids: [3001, 8] with out-of-range ids."""
    import torch

    from engram_trt.native import hostgather

    dev = torch.device("cuda", torch.cuda.current_device())
    rng = np.random.default_rng([gpu_seed, 11])
    g = hostgather.HostGatherer(num_threads=0, chunk_rows=1000, max_head_dim=tab.D, num_slots=2)
    g.set_options(min_chunks=1)
    T, cols = 3001, 8
    ids = rng.integers(-50, tab.N + 50, size=(T, cols)).astype(np.int32)
    side = torch.cuda.Stream()
    scales_dev = tab.scales_t.to(dev)
    ids_t = torch.from_numpy(ids)
    with torch.cuda.stream(side):
        ids_up = ids_t.to(dev)
    side.synchronize()
    yield SimpleNamespace(g=g, T=T, cols=cols, ids=ids, side=side, scales_dev=scales_dev, ids_t=ids_t, ids_up=ids_up)
    g.close()


def test_fp8_layouts(tab, hg, dev) -> None:
    """fp8 -> bf16: many chunks through 2 slots, out-of-range ids, both layouts, a side stream."""
    import torch

    rows_t, scales_t, inline_t = tab.rows_t, tab.scales_t, tab.inline_t
    D, QB, ref_fp8, same = tab.D, tab.QB, tab.ref_fp8, tab.same
    g, T, cols, ids, side = hg.g, hg.T, hg.cols, hg.ids, hg.side

    for layout, table in (("split", (rows_t, scales_t)), ("inline", (inline_t, None))):
        with torch.cuda.stream(side):
            out = torch.full((T, cols, D), float("nan"), dtype=torch.bfloat16, device=dev)
            got = g.gather(torch.from_numpy(ids), *table, quant_block=QB, layout=layout, out=out)
        side.synchronize()
        assert same(got.reshape(-1, D), ref_fp8(ids.reshape(-1))), (
            f"fp8 {layout}: {T * cols} rows in 24 chunks of 1000 through 2 slots, out-of-range ids, side stream"
        )


def test_hbm_scales(tab, hg, dev, rng) -> None:
    """Scales in HBM (layout hbm-scales): the CPU copies the values alone, the dequant reads
    each row's scale bytes on the GPU by its id (the same 24 chunks through 2 slots); its
    refusals."""
    import torch

    from engram_trt.errors import EngramError

    rows_t, scales_t = tab.rows_t, tab.scales_t
    N, D, QB, ref_fp8, same = tab.N, tab.D, tab.QB, tab.ref_fp8, tab.same
    g, T, cols, ids, side = hg.g, hg.T, hg.cols, hg.ids, hg.side
    scales_dev, ids_t, ids_up = hg.scales_dev, hg.ids_t, hg.ids_up
    with torch.cuda.stream(side):
        out = torch.full((T, cols, D), float("nan"), dtype=torch.bfloat16, device=dev)
        got = g.gather(ids_t, rows_t, scales_dev, quant_block=QB, layout="hbm-scales", out=out, ids_dev=ids_up)
    side.synchronize()
    assert same(got.reshape(-1, D), ref_fp8(ids.reshape(-1))), (
        f"fp8 hbm-scales: {T * cols} rows in 24 chunks through 2 slots, out-of-range ids, side stream"
    )
    ids3h = rng.integers(-9, N + 9, size=(400, 3, cols)).astype(np.int32)
    got = g.gather(torch.from_numpy(ids3h), rows_t, scales_dev, layer=2, quant_block=QB, layout="hbm-scales")
    torch.cuda.synchronize()
    assert same(got.reshape(-1, D), ref_fp8(ids3h[:, 2, :].reshape(-1))), (
        "fp8 hbm-scales, layer 2 of [T, L, cols] ids, the device ids copied up by the call"
    )
    refusals = []
    for what, call in (
        ("scales on the CPU", lambda: g.gather(ids_t, rows_t, scales_t, quant_block=QB, layout="hbm-scales")),
        (
            "gather_raw, scales on the CPU",
            lambda: g.gather_raw(
                ids_t.reshape(-1),
                rows_t,
                scales_t,
                quant_block=QB,
                layout="hbm-scales",
                dst_rows=torch.empty((T * cols, D), dtype=torch.uint8, device=dev),
                dst_scales=torch.empty((T * cols, D // QB), dtype=torch.uint8, device=dev),
            ),
        ),
        (
            "gather_raw, ids_dev of other ids",
            lambda: g.gather_raw(
                ids_t.reshape(-1),
                rows_t,
                scales_dev,
                quant_block=QB,
                layout="hbm-scales",
                ids_dev=ids_up.reshape(-1)[:5],
                dst_rows=torch.empty((T * cols, D), dtype=torch.uint8, device=dev),
                dst_scales=torch.empty((T * cols, D // QB), dtype=torch.uint8, device=dev),
            ),
        ),
        (
            "a bf16 table",
            lambda: g.gather(ids_t, torch.zeros((10, 128), dtype=torch.bfloat16), None, layout="hbm-scales"),
        ),
    ):
        try:
            call()
            refusals.append(f"{what}: ACCEPTED")
        except EngramError as e:
            refusals.append(f"{what}: {e}")
    assert all("ACCEPTED" not in r for r in refusals), (
        "hbm-scales refused, each with its reason: scales on the CPU (gather, gather_raw), ids_dev of other "
        "ids, a bf16 table" + f': {" | ".join(refusals)}'
    )


def test_bound_gather(tab, hg, dev, rng) -> None:
    """A gather bound to its table (HostGatherer.bind) == the NumPy dequant in every layout,
    over steps of two shapes into reused outputs; and its refusals."""
    import torch

    from engram_trt.errors import EngramError

    rows_t, scales_t, inline_t = tab.rows_t, tab.scales_t, tab.inline_t
    N, D, QB, ref_fp8, same = tab.N, tab.D, tab.QB, tab.ref_fp8, tab.same
    g, cols, ids = hg.g, hg.cols, hg.ids
    scales_dev = hg.scales_dev

    ok_bound, kinds = True, []
    for layout, table in (
        ("split", (rows_t, scales_t)),
        ("inline", (inline_t, None)),
        ("hbm-scales", (rows_t, scales_dev)),
    ):
        bound = g.bind(*table, quant_block=QB, layout=layout)
        outs = {n: torch.empty((n, cols, D), dtype=torch.bfloat16, device=dev) for n in (256, 777)}
        for step in range(6):
            n = 256 if step % 2 else 777
            sid = rng.integers(-9, N + 9, size=(n, cols)).astype(np.int32)
            sid_t = torch.from_numpy(sid)
            got = bound(sid_t, outs[n], sid_t.to(dev) if layout == "hbm-scales" else None)
            torch.cuda.synchronize()
            ok_bound &= got is outs[n] and same(got.reshape(-1, D), ref_fp8(sid.reshape(-1)))
        kinds.append(layout)
    bound = g.bind(rows_t, scales_dev, quant_block=QB, layout="hbm-scales")
    small = torch.from_numpy(ids[:16])
    refused = []

    def empty(n: int) -> torch.Tensor:
        return torch.empty((n, cols, D), dtype=torch.bfloat16, device=dev)

    for what, call in (
        ("hbm-scales without ids_dev", lambda: bound(small, empty(16))),
        ("an out of another shape", lambda: bound(small, empty(17), small.to(dev))),
        ("ids on the GPU", lambda: bound(small.to(dev), empty(16), small.to(dev))),
    ):
        try:
            call()
            refused.append(f"{what}: ACCEPTED")
        except EngramError as e:
            refused.append(f"{what}: {e}")
    assert ok_bound and all("ACCEPTED" not in r for r in refused), (
        "a gather bound to its table == NumPy (" + ", ".join(kinds) + "; 6 steps, two shapes, reused outputs); "
        "refused: hbm-scales without ids_dev, an out of another shape, ids on the GPU" + f': {" | ".join(refused)}'
    )


def test_strided_ids(tab, hg, rng) -> None:
    """Layer 1 of [T, L, cols] ids."""
    import torch

    inline_t = tab.inline_t
    N, D, QB, ref_fp8, same = tab.N, tab.D, tab.QB, tab.ref_fp8, tab.same
    g, cols = hg.g, hg.cols

    L = 3
    ids3 = rng.integers(0, N, size=(500, L, cols)).astype(np.int32)
    got = g.gather(torch.from_numpy(ids3), inline_t, None, layer=1, quant_block=QB, layout="inline")
    torch.cuda.synchronize()
    assert same(got.reshape(-1, D), ref_fp8(ids3[:, 1, :].reshape(-1))), "fp8 inline, layer 1 of [T, L, cols] ids"


def test_knobs(tab, hg) -> None:
    """Knobs round-trip, every combination still exact (they stay set for the tests below)."""
    import torch

    inline_t = tab.inline_t
    D, QB, ref_fp8, same = tab.D, tab.QB, tab.ref_fp8, tab.same
    g, ids = hg.g, hg.ids

    ok_all = True
    for knobs in (
        {"prefetch_rows": 0, "streaming_stores": 1},
        {"prefetch_rows": 64, "prefetch_far_rows": 48, "prefetch_locality": 1, "task_rows": 7},
        {"chunk_rows": 257, "min_chunks": 16, "spin_us": 0},
    ):
        g.set_options(**knobs)
        opts = g.options()
        ok_all &= all(opts[k] == v for k, v in knobs.items())
        got = g.gather(torch.from_numpy(ids), inline_t, None, quant_block=QB, layout="inline")
        torch.cuda.synchronize()
        ok_all &= same(got.reshape(-1, D), ref_fp8(ids.reshape(-1)))
    assert ok_all, f"tuning knobs set and read back; outputs stay exact under each: {g.options()}"


def test_bf16_table_and_raw_rows(tab, hg, dev, rng) -> None:
    """A bf16 table (direct copy sink); raw rows into device arrays, ordered after earlier
    work on the stream; the same with the scales in HBM; raw bf16 rows."""
    import torch

    values, scales, rows_t, inline_t = tab.values, tab.scales, tab.rows_t, tab.inline_t
    N, D, QB, same = tab.N, tab.D, tab.QB, tab.same
    g = hg.g
    scales_dev = hg.scales_dev

    bf = torch.randn(50_000, 128, dtype=torch.bfloat16)
    bid = rng.integers(-3, 50_003, size=(777, 5)).astype(np.int32)
    got = g.gather(torch.from_numpy(bid), bf)
    torch.cuda.synchronize()
    want = bf[torch.from_numpy(np.clip(bid, 0, 49_999)).long()]
    want[torch.from_numpy((bid < 0) | (bid >= 50_000))] = 0
    assert same(got, want), "bf16 table copied into out (out-of-range ids: zero rows)"

    # raw rows into device arrays, ordered after earlier work on the stream
    flat = torch.from_numpy(rng.integers(-5, N + 5, size=20_000).astype(np.int32))
    dst_r = torch.zeros((20_000, D), dtype=torch.uint8, device=dev)
    dst_s = torch.zeros((20_000, D // QB), dtype=torch.uint8, device=dev)
    busy = torch.empty(1 << 26, device=dev)
    for _ in range(20):
        busy.mul_(1.0001)  # work queued before the call: the copies must wait for it
    dst_r.fill_(0xAB)  # ... and come after this fill
    g.gather_raw(flat, inline_t, None, dst_rows=dst_r, dst_scales=dst_s, quant_block=QB, layout="inline")
    torch.cuda.synchronize()
    idx = flat.numpy()
    ok = (idx >= 0) & (idx < N)
    want_r = np.where(ok[:, None], values[np.where(ok, idx, 0)], 0)
    want_s = np.where(ok[:, None], scales[np.where(ok, idx, 0)], 127)
    assert np.array_equal(dst_r.cpu().numpy(), want_r) and np.array_equal(dst_s.cpu().numpy(), want_s), (
        "raw fp8 rows + scales into device arrays, after the stream's earlier work"
    )
    # the same with the scales in HBM: many chunks of values through 2 slots, the scale
    # bytes gathered on the GPU by the device ids (given, then copied up by the call)
    for given in (True, False):
        for _ in range(20):
            busy.mul_(1.0001)
        dst_r.fill_(0xAB)
        dst_s.fill_(0xCD)
        g.gather_raw(
            flat,
            rows_t,
            scales_dev,
            dst_rows=dst_r,
            dst_scales=dst_s,
            quant_block=QB,
            layout="hbm-scales",
            ids_dev=flat.to(dev) if given else None,
        )
        torch.cuda.synchronize()
        assert np.array_equal(dst_r.cpu().numpy(), want_r) and np.array_equal(dst_s.cpu().numpy(), want_s), (
            "raw fp8 rows, scales in HBM: values copied alone, scale bytes gathered on the GPU by the device ids "
            f"({'given' if given else 'copied up by the call'}), out-of-range ids, after the stream's earlier work"
        )
    dst_b = torch.zeros((777 * 5, 128), dtype=torch.bfloat16, device=dev)
    g.gather_raw(torch.from_numpy(bid.reshape(-1).copy()), bf, dst_rows=dst_b)
    torch.cuda.synchronize()
    assert same(dst_b, want.reshape(-1, 128)), "raw bf16 rows into a device array"


def test_pool_of_one(tab, hg) -> None:
    """A pool of one thread (the caller alone)."""
    import torch

    from engram_trt.native import hostgather

    rows_t, scales_t = tab.rows_t, tab.scales_t
    D, QB, ref_fp8, same = tab.D, tab.QB, tab.ref_fp8, tab.same
    ids = hg.ids

    with hostgather.HostGatherer(num_threads=1, chunk_rows=512, max_head_dim=D) as g1:
        got = g1.gather(torch.from_numpy(ids[:300]), rows_t, scales_t, quant_block=QB)
        torch.cuda.synchronize()
        assert same(got.reshape(-1, D), ref_fp8(ids[:300].reshape(-1))) and g1.options()["num_threads"] == 1, (
            "a pool of 1 thread"
        )


def test_hot_row_cache(tab, dev, rng) -> None:
    """The hot-row cache on CUDA == the plain host gather, over Zipf-skewed steps."""
    import torch

    from engram_trt.native import hostgather
    from engram_trt.cache.hotcache import HotRowCache

    N, D, ref_fp8, same, inline_t = tab.N, tab.D, tab.ref_fp8, tab.same, tab.inline_t
    g = hostgather.HostGatherer(device=dev)
    cache = HotRowCache(
        inline_t,
        None,
        device=dev,
        gatherer=g,
        layout="inline",
        capacity_rows=5_000,
        max_step_rows=40_000,
        admit_budget=2_000,
        admit_every=2,
    )
    ok_all = True
    for step in range(12):
        sid = ((rng.zipf(1.2, size=(1000, 24)) * 7919) % N).astype(np.int32)
        sid[0, :2] = [-1, N]
        got = cache.gather(torch.from_numpy(sid))
        torch.cuda.synchronize()
        ok_all &= same(got.reshape(-1, D), ref_fp8(sid.reshape(-1)))
    cache.policy.check_invariants()
    s = cache.stats()
    assert ok_all and s.hits > 0 and s.evicted > 0, (
        f"hot-row cache on CUDA: 12 skewed steps exact, maps consistent: hit rate {s.hit_rate:.1%}, fetched / lookups "
        f"{s.fetch_fraction:.1%}, evicted {s.evicted}"
    )
    g.close()


def test_calibrate_gather(tab, dev) -> None:
    """Calibration picks a path per size and says so."""
    from engram_trt.native import hostgather
    from engram_trt.runtime.gatherpath import calibrate_gather

    rows_t, scales_t = tab.rows_t, tab.scales_t
    g = hostgather.HostGatherer(device=dev)
    pinned_rows, pinned_scales = rows_t.pin_memory(), scales_t.pin_memory()
    t0 = time.perf_counter()
    choice = calibrate_gather(pinned_rows, pinned_scales, gatherer=g, sizes=(6144, 98304), reps=3)
    assert set(choice.seconds) == {"host", "uva"} and set(choice.chosen.values()) <= {"host", "uva"}, (
        f"calibrate_gather times both paths and chooses one per size: {choice.describe()} "
        f"in {time.perf_counter() - t0:.1f} s"
    )
    g.close()
