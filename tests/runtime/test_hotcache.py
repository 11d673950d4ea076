"""The hot-row cache's logic on CPU tensors: exact rows, de-duplication counts, the slot
map, admission into free slots, frequency-based replacement, and its bounds.

The data path here is the torch one (TorchTransfer) with the policy's torch reference,
for every host layout (hbm-scales: the values in host memory, the scales a tensor of the
cache's device, gathered there by the plan's device miss list); the CUDA path (host
gather of raw rows, the fused plan / admission kernels, the gather kernel) makes the
same decisions and runs on the H200 through
tests/gpu/test_cache.py and `benchmarks/lookup/bench_cache.py`, which check it against the
reference and its output against the plain host gather (tests/runtime/test_cachepolicy.py
checks the reference against the policy's specification).
"""

from __future__ import annotations

import numpy as np
import pytest

from engram_trt.engram.quant import dequant_fp8_rows
from engram_trt.errors import EngramError
from engram_trt.runtime.gatherpath import inline_table
from engram_trt.cache.hotcache import CachePolicy, HotRowCache

N, HEAD_DIM, QB = 4000, 64, 32


@pytest.fixture(scope="module")
def table():
    import torch

    rng = np.random.default_rng(7)
    values = rng.integers(0, 256, size=(N, HEAD_DIM), dtype=np.uint8)
    values[(values & 0x7F) == 0x7F] = 0x3C  # no NaN codes: bitwise comparison stays meaningful
    scales = rng.integers(110, 140, size=(N, HEAD_DIM // QB), dtype=np.uint8)
    return torch.from_numpy(values), torch.from_numpy(scales)


def _reference(values, scales, ids: np.ndarray):
    """bf16 rows by the float32 NumPy dequant, zero rows out of range."""
    import torch

    ok = (ids >= 0) & (ids < N)
    safe = np.where(ok, ids, 0)
    ref = dequant_fp8_rows(values.numpy()[safe], scales.numpy()[safe], QB)
    ref[~ok] = 0
    return torch.from_numpy(ref).to(torch.bfloat16)


def _e4m3_f64(b: np.ndarray) -> np.ndarray:
    """FP8 e4m3 bytes decoded by the format's definition in float64 (no NaN codes here)."""
    b = b.astype(np.int64)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp, man = (b >> 3) & 0xF, (b & 7).astype(np.float64)
    mag = np.where(exp == 0, man / 8.0 * 2.0**-6, (1.0 + man / 8.0) * np.exp2(exp - 7.0))
    return sign * mag


def _reference_f64(values, scales, ids: np.ndarray):
    """bf16 rows of ``ids`` by a float64 dequant (value x 2^(scale - 127), rounded once to
    bf16), zero rows out of range: independent of the package's dequant helpers."""
    import torch

    ok = (ids >= 0) & (ids < N)
    safe = np.where(ok, ids, 0).reshape(-1)
    vals = _e4m3_f64(values.numpy()[safe])
    scale = np.exp2(scales.numpy()[safe].astype(np.float64) - 127.0)
    rows = vals * np.repeat(scale, QB, axis=1)
    rows[~ok.reshape(-1)] = 0.0
    return torch.from_numpy(rows).to(torch.bfloat16).reshape(*ids.shape, HEAD_DIM)


def _host(table, layout: str):
    """(rows, scales) of the host table in ``layout``; hbm-scales' scales are a copy of
    their own (the cache's device here is the CPU), so they cannot alias the split table."""
    values, scales = table
    if layout == "inline":
        return inline_table(values, scales), None
    if layout == "hbm-scales":
        return values, scales.clone()
    return values, scales


def _zipf_ids(rng, shape) -> np.ndarray:
    return ((rng.zipf(1.2, size=shape) * 7919) % N).astype(np.int32)


@pytest.mark.parametrize("layout", ["split", "inline", "hbm-scales"])
def test_cache_output_equals_a_plain_gather(table, layout: str) -> None:
    import torch

    values, scales = table
    host = _host(table, layout)
    cache = HotRowCache(
        *host, device="cpu", capacity_rows=200, quant_block=QB, layout=layout, max_step_rows=3000, admit_budget=50
    )
    rng = np.random.default_rng(1)
    for step in range(25):
        ids = _zipf_ids(rng, (120, 24))
        ids[0, :3] = [-5, N, N + 100]  # out of range: zero rows, through the cache too
        got = cache.gather(torch.from_numpy(ids))
        assert got.shape == (120, 24, HEAD_DIM) and got.dtype == torch.bfloat16
        assert torch.equal(got.view(torch.int16), _reference(values, scales, ids).view(torch.int16)), step
        assert torch.equal(got.view(torch.int16), _reference_f64(values, scales, ids).view(torch.int16)), step
        cache.policy.check_invariants()
    s = cache.stats()
    assert s.steps == 25 and s.lookups == 25 * 120 * 24
    assert s.hits > 0 and s.hits + s.fetched == s.unique  # every distinct row is a hit or a fetch
    assert 0 < s.evicted <= s.admitted and cache.policy.filled == 200


def test_deduplication_counts_distinct_rows(table) -> None:
    import torch

    values, scales = table
    cache = HotRowCache(values, scales, device="cpu", capacity_rows=0, quant_block=QB, max_step_rows=5000)
    rng = np.random.default_rng(2)
    want_unique = 0
    for _ in range(4):
        ids = _zipf_ids(rng, (200, 24))
        flat = np.where((ids >= 0) & (ids < N), ids, N)
        want_unique += np.unique(flat).size
        out = cache.gather(torch.from_numpy(ids))
        assert torch.equal(out.view(torch.int16), _reference(values, scales, ids).view(torch.int16))
    s = cache.stats()
    assert s.unique == want_unique and s.fetched == want_unique and s.hits == 0 and s.admitted == 0
    assert s.bytes_fetched == want_unique * (HEAD_DIM + HEAD_DIM // QB)
    assert s.unique_fraction == pytest.approx(want_unique / (4 * 200 * 24))


def test_free_slots_take_misses_and_hits_follow(table) -> None:
    import torch

    values, scales = table
    cache = HotRowCache(values, scales, device="cpu", capacity_rows=100, quant_block=QB, max_step_rows=500)
    hot = torch.arange(10, 40, dtype=torch.int32)
    cache.gather(hot)
    assert cache.stats().fetched == 30 and cache.policy.filled == 30
    cache.gather(hot)
    s = cache.stats()
    assert s.hits == 30 and s.fetched == 30  # the second step needs no host fetch
    assert torch.equal(cache.policy.slot_of[hot.long()].sort().values, torch.arange(30, dtype=torch.int32))


def test_a_full_cache_replaces_only_colder_rows() -> None:
    import torch

    policy = CachePolicy(table_rows=1000, capacity_rows=8, admit_budget=8, sample_factor=1)

    def step(ids: list[int]) -> None:
        plan = policy.plan(torch.tensor(ids, dtype=torch.int32), miss_base=policy.capacity)
        policy.finish(plan)
        policy.check_invariants()

    warm = list(range(8))
    for _ in range(3):
        step(warm)  # rows 0..7 fill the cache, counts 3 each
    assert policy.filled == 8 and policy.evicted == 0
    step([100, 101])  # seen once: colder than every cached row, never admitted
    assert policy.evicted == 0 and int((policy.slot_of[torch.tensor([100, 101])] >= 0).sum()) == 0
    for _ in range(4):
        step([100] * 5)  # row 100 now has count 1 + 4 * 5 = 21 > 3: it replaces one cached row
    assert int(policy.slot_of[100]) >= 0 and policy.evicted == 1
    assert int((policy.slot_of[torch.arange(8)] >= 0).sum()) == 7


def test_replacements_per_step_are_bounded_by_the_budget() -> None:
    import torch

    policy = CachePolicy(table_rows=10_000, capacity_rows=100, admit_budget=5, sample_factor=2)
    policy.finish(policy.plan(torch.arange(100, dtype=torch.int32), 100))
    hot = torch.arange(5000, 5400, dtype=torch.int32).repeat(3)  # 400 hotter rows at once
    copies = policy.finish(policy.plan(hot, 100))
    assert policy.evicted <= 5 and sum(int(c.dst.numel()) for c in copies) <= 5
    policy.check_invariants()


def test_decay_halves_the_counts() -> None:
    import torch

    policy = CachePolicy(table_rows=50, capacity_rows=0, decay_every=2)
    for _ in range(2):
        policy.finish(policy.plan(torch.tensor([3, 3, 3, 3], dtype=torch.int32)))
    assert int(policy.counts[3]) == 4  # 8 lookups, halved at step 2


def test_bounds_are_named(table) -> None:
    import torch

    values, scales = table
    with pytest.raises(EngramError, match=r"^cache capacity must be in \[0, table_rows=4000\] rows \(got 5000\)$"):
        HotRowCache(values, scales, device="cpu", capacity_rows=5000, quant_block=QB)
    cache = HotRowCache(values, scales, device="cpu", capacity_fraction=0.05, quant_block=QB, max_step_rows=10)
    assert cache.policy.capacity == 200
    with pytest.raises(EngramError, match="^a step of 11 lookups exceeds this cache's max_step_rows=10"):
        cache.gather(torch.zeros(11, dtype=torch.int32))
    with pytest.raises(EngramError, match=r"^ids must be int32 \(got torch.int64\)$"):
        cache.gather(torch.zeros(3, dtype=torch.int64))
    with pytest.raises(EngramError, match="^a CUDA HotRowCache needs gatherer="):
        HotRowCache(values, scales, device="cuda", capacity_rows=10, quant_block=QB)


def test_replacements_wait_for_admit_every(table) -> None:
    import torch

    values, scales = table
    cache = HotRowCache(
        values,
        scales,
        device="cpu",
        capacity_rows=10,
        quant_block=QB,
        max_step_rows=100,
        admit_every=3,
        admit_budget=10,
        sample_factor=1,
    )
    cache.gather(torch.arange(10, dtype=torch.int32))  # step 1 fills the cache (free slots: every step)
    hot = torch.arange(500, 510, dtype=torch.int32).repeat(5)
    cache.gather(hot)  # step 2: no replacement try (2 % 3 != 0)
    assert cache.stats().evicted == 0
    cache.gather(hot)  # step 3: replacements tried; these rows (count 10) beat the cached ones (count 1)
    assert cache.stats().evicted > 0
    cache.policy.check_invariants()


@pytest.mark.parametrize("layout", ["inline", "hbm-scales"])
def test_a_warm_start_serves_its_rows_exactly(table, layout: str) -> None:
    """Offline counts load the hottest rows before the first step (one fetch of the
    slots; hbm-scales gathers their scale bytes by the ids copied to the device), and the
    first step finds them: its hits are those rows, its output the float64 dequant's."""
    import torch

    values, scales = table
    rng = np.random.default_rng(5)
    counts = np.bincount(_zipf_ids(rng, 20_000), minlength=N)
    cache = HotRowCache(
        *_host(table, layout),
        device="cpu",
        capacity_rows=150,
        quant_block=QB,
        layout=layout,
        max_step_rows=3000,
        admit_budget=40,
        initial_counts=counts,
    )
    assert cache.stats().preloaded == 150
    hot = np.argsort(-counts, kind="stable")[:150]
    assert torch.equal(cache.work_rows[:150], values[torch.from_numpy(hot).long()])  # the slots hold the raw bytes
    assert torch.equal(cache.work_scales[:150], scales[torch.from_numpy(hot).long()])
    for step in range(16):  # replacements of warm rows are rare: 12 steps pass before the first one here
        ids = _zipf_ids(rng, (100, 24))
        ids[1, :3] = [N, -7, N + 1]
        got = cache.gather(torch.from_numpy(ids))
        assert torch.equal(got.view(torch.int16), _reference_f64(values, scales, ids).view(torch.int16)), step
        if step == 0:
            first = cache.stats()
            want_hits = np.intersect1d(np.unique(ids[(ids >= 0) & (ids < N)]), hot).size
            assert first.hits == want_hits > 0
        cache.policy.check_invariants()
    assert cache.stats().evicted > 0  # admission ran after the warm start


def test_hbm_scales_fetch_reads_the_scales_by_the_device_ids(table) -> None:
    """TorchTransfer in the hbm-scales layout: values from the host rows by the host ids,
    scale bytes from the scales tensor by ``ids_dev`` (what the CUDA path's kernel reads),
    zero rows and scale byte 127 for ids outside the table."""
    import torch

    from engram_trt.cache.hotcache import TorchTransfer

    values, scales = table
    t = TorchTransfer(values, scales, quant_block=QB, layout="hbm-scales", head_dim=HEAD_DIM)
    ids = torch.tensor([5, N, -1, 3999, 0, N + 50], dtype=torch.int32)
    rows = torch.full((8, HEAD_DIM), 0xAA, dtype=torch.uint8)
    sc = torch.full((8, HEAD_DIM // QB), 0xAA, dtype=torch.uint8)
    t.fetch(ids, rows, sc, ids_dev=ids.clone())
    idx = ids.numpy()
    ok = (idx >= 0) & (idx < N)
    safe = np.where(ok, idx, 0)
    np.testing.assert_array_equal(rows[:6].numpy(), np.where(ok[:, None], values.numpy()[safe], 0))
    np.testing.assert_array_equal(sc[:6].numpy(), np.where(ok[:, None], scales.numpy()[safe], 127))
    assert (rows[6:] == 0xAA).all() and (sc[6:] == 0xAA).all()  # rows past n untouched
    other = torch.tensor([7, 7, 7, 7, 7, 7], dtype=torch.int32)
    t.fetch(ids, rows, sc, ids_dev=other)  # the scale bytes follow ids_dev, the values the host ids
    assert (sc[:6] == scales[7]).all()
    np.testing.assert_array_equal(rows[:6].numpy(), np.where(ok[:, None], values.numpy()[safe], 0))


def test_hbm_scales_needs_host_rows_and_scales_on_the_cache_device(table) -> None:
    import torch

    values, scales = table
    with pytest.raises(
        EngramError,
        match=r"^layout 'hbm-scales' keeps the rows in host memory and the scales on the "
        r"cache's device cpu \(got rows on cpu, scales on meta\)",
    ):
        HotRowCache(
            values,
            torch.empty(scales.shape, dtype=torch.uint8, device="meta"),
            device="cpu",
            capacity_rows=10,
            quant_block=QB,
            layout="hbm-scales",
        )
    with pytest.raises(EngramError, match=r"^layout 'hbm-scales' keeps the rows in host memory .*\(got rows on meta"):
        HotRowCache(
            torch.empty(values.shape, dtype=torch.uint8, device="meta"),
            scales,
            device="cpu",
            capacity_rows=10,
            quant_block=QB,
            layout="hbm-scales",
        )
    with pytest.raises(EngramError, match=r"^layout 'hbm-scales' is for fp8 tables"):
        HotRowCache(torch.zeros(10, 64, dtype=torch.bfloat16), None, device="cpu", capacity_rows=1, layout="hbm-scales")


def test_delivery_shape_keeps_2d_ids_and_flattens_the_others() -> None:
    """The [T, cols] the cache delivers in (and bench cache's call timing reuses)."""
    import torch

    from engram_trt.cache.hotcache import delivery_shape

    assert delivery_shape(torch.zeros((7, 24), dtype=torch.int32)) == (7, 24)
    assert delivery_shape(torch.zeros(5, dtype=torch.int32)) == (5, 1)
    assert delivery_shape(torch.zeros((2, 3, 4), dtype=torch.int32)) == (24, 1)
