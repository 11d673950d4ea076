"""The hot-row cache's fused kernels (plugins/kernels/cacheKernel.cu) on a GPU against the
policy's torch reference on the CPU, and the cache's delivered rows against the plain
host gather (formerly scripts/h200_cache_check.py, run by h200_hostgather_check.py; its
timing is ``benchmarks/lookup/bench_cacheplan.py``).

Policy, per case, step by step: the fused plan on the GPU and the reference plan on the
CPU of the same ids, the reference given the kernels' miss order (which must be a
permutation of its own misses); then positions, distinct and miss counts, and the miss
list on the host must be equal, and after both admissions the whole state (slot map,
slot table, counts, filled slots, replacements). Cases: uniform ids while the cache
fills, Zipf-skewed ids against a full cache (replacements every step), few rows repeated
thousands of times within a step, one row and out-of-range ids only, an empty step, a
step with more misses than the plan's first copy carries (the second copy), a cache of 0
rows, budget = capacity with aging counts, a warm start, ids already on the device.
The whole step (``engram_cache_step``, one library call a step): rows and state against
the host gather and the CPU reference in every layout, and a failed delivery inside it.

Data: HotRowCache on CUDA (fused) against the host gather of the same ids, bit for bit:
inline, split and hbm-scales fp8 tables (hbm-scales: the values in host memory, the scale
array on the GPU, the misses' scale bytes gathered there by the plan's device miss list),
a bf16 table, warm starts, replacements every 2nd step; a fetch that fails (nothing
admitted, the slot map restored, the next step exact). Then real skewed ids: both layers
of n-gram hashed chunks (the token file of `benchmarks/lookup/idstreams.py` where present,
else a Zipf token stream) with out-of-range ids mixed in, through an hbm-scales cache
with and without a warm start, several steps with admission, each step against the
plain host gather in the hbm-scales and the split layout and the NumPy dequant.

The id streams' CPU part (``check_id_streams_cpu``: the hbm-scales cache on CPU tensors
against the NumPy dequant) runs here too.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

import numpy as np
import pytest

from .helpers import fp8_table


def _ids(rng, kind: str, n: int, rows: int) -> np.ndarray:
    if kind == "zipf":
        ids = (rng.zipf(1.2, size=n) * 7919) % rows
    elif kind == "repeat":
        ids = rng.choice(rng.integers(0, rows, size=50), size=n)
    elif kind == "one":
        ids = np.full(n, 17)
        ids[::3] = -5
        ids[1::3] = rows + 9
    else:
        ids = rng.integers(-20, rows + 20, size=n)
    return ids.astype(np.int32)


# (name, rows, capacity, budget, factor, decay, admit_every, [(kind, lookups), ...] per step)
POLICY_CASES = [
    ("uniform ids, the cache filling over steps", 200_000, 20_000, 2_000, 4, 0, 1, [("uniform", 8_000)] * 6),
    ("zipf ids, a full cache, replacements every step", 200_000, 3_000, 1_500, 2, 0, 1, [("zipf", 40_000)] * 10),
    ("few rows repeated thousands of times within a step", 50_000, 1_000, 200, 4, 0, 1, [("repeat", 60_000)] * 4),
    (
        "one row and out-of-range ids only; an empty step",
        1_000,
        10,
        10,
        1,
        0,
        1,
        [("one", 30_000), ("one", 0), ("uniform", 5_000), ("one", 9)],
    ),
    (
        "more misses than the first copy carries (second copy)",
        500_000,
        100,
        100,
        1,
        0,
        1,
        [("one", 1_000), ("uniform", 150_000), ("zipf", 196_608)],
    ),
    ("a cache of 0 rows (de-duplication alone)", 100_000, 0, 0, 4, 0, 1, [("zipf", 50_000)] * 3),
    ("budget = capacity, aging counts, replacements every 2nd step", 20_000, 500, 500, 3, 2, 2, [("zipf", 20_000)] * 8),
]


def compare_policy(dev: Any, ci: int, *, fused: bool = True, seed: int = 3) -> tuple[bool, str]:
    """POLICY_CASES[ci] through a policy on ``dev`` (fused kernels, or the reference with
    ``fused=False``: the harness alone) against the CPU reference, state by state: (ok,
    detail)."""
    import torch

    from engram_trt.cache.policy import CachePolicy

    rng = np.random.default_rng([seed, ci])
    name, rows, cap, budget, factor, decay, every, steps = POLICY_CASES[ci]
    warm = ci == 1  # the full-cache case starts warm: offline counts, top rows preloaded
    counts = np.bincount(_ids(rng, "zipf", 100_000, rows), minlength=rows) if warm else None
    kw = dict(
        admit_budget=budget,
        sample_factor=factor,
        decay_every=decay,
        seed=seed,
        max_step_rows=196_608,
        initial_counts=counts,
    )
    gpu = CachePolicy(rows, cap, device=dev, fused=fused, **kw)
    ref = CachePolicy(rows, cap, device="cpu", **kw)
    ok, why, misses = True, "", 0
    try:
        for k, (kind, n) in enumerate(steps):
            ids = torch.from_numpy(_ids(rng, kind, n, rows))
            on_dev = k % 2 == 1 and n > 0
            gp = gpu.plan(ids.to(dev) if on_dev else ids.pin_memory() if dev.type == "cuda" and n else ids)
            rp = ref.plan(ids, miss_order=gp.miss_rows.cpu())
            same = (
                torch.equal(gp.positions.cpu(), rp.positions)
                and gp.num_unique == rp.num_unique
                and gp.num_miss == rp.num_miss
                and torch.equal(gp.miss_rows_host.clone(), rp.miss_rows_host)
            )
            replace = (gpu.steps + 1) % every == 0
            gpu.finish(gp, replace=replace)
            ref.finish(rp, replace=replace)
            gs, rs = gpu.state(), ref.state()
            diff = [
                key
                for key in gs
                if not (torch.equal(gs[key], rs[key]) if isinstance(gs[key], torch.Tensor) else gs[key] == rs[key])
            ]
            misses += rp.num_miss
            if not same or diff:
                ok, why = False, f"step {k}: plan equal {same}, state differs in {diff}"
                break
        gpu.check_invariants()
    except Exception as exc:  # a miss order that is no permutation of the misses, an invariant
        ok, why = False, f"{type(exc).__name__}: {exc}"
    detail = why or (
        f"{len(steps)} steps, {misses} misses, filled {ref.filled}/{cap}, "
        f"replaced {ref.evicted}" + (f", warm start of {ref.preloaded} rows" if warm else "")
    )
    return ok, f"cache policy {'fused kernels' if fused else 'reference'} == CPU reference: {name}: {detail}"


def test_cache_data(dev) -> None:
    """HotRowCache (fused) on CUDA against the plain host gather, bit for bit."""
    import torch

    from engram_trt.native import hostgather
    from engram_trt.engram.quant import dequant_fp8_rows
    from engram_trt.runtime.gatherpath import inline_table
    from engram_trt.cache.hotcache import HotRowCache, TorchTransfer

    rng = np.random.default_rng(12)
    N, D, QB = 100_000, 256, 32
    values, scales, rows_t, scales_t = fp8_table(rng, N, D, QB)
    bf = torch.randn(N, 128, dtype=torch.bfloat16)
    g = hostgather.HostGatherer(device=dev)
    warm_counts = np.bincount(((rng.zipf(1.2, size=200_000) * 7919) % N), minlength=N)
    scales_dev = scales_t.to(dev)
    configs = [
        ("inline fp8", (inline_table(rows_t, scales_t), None), "inline", {}),
        ("split fp8", (rows_t, scales_t), "split", {}),
        ("hbm-scales fp8", (rows_t, scales_dev), "hbm-scales", {}),
        ("bf16", (bf, None), "split", {}),
        ("inline fp8, warm start", (inline_table(rows_t, scales_t), None), "inline", {"initial_counts": warm_counts}),
        ("hbm-scales fp8, warm start", (rows_t, scales_dev), "hbm-scales", {"initial_counts": warm_counts}),
    ]
    for name, table, layout, extra in configs:
        cache = HotRowCache(
            *table,
            device=dev,
            gatherer=g,
            layout=layout,
            capacity_rows=4_000,
            max_step_rows=40_000,
            admit_budget=1_500,
            admit_every=2,
            **extra,
        )
        ok = True
        for _ in range(10):
            sid = ((rng.zipf(1.2, size=(1_000, 24)) * 7919) % N).astype(np.int32)
            sid[0, :3] = [-1, N, N + 7]
            got = cache.gather(torch.from_numpy(sid))
            want = g.gather(torch.from_numpy(sid), *table, quant_block=QB, layout=layout)
            torch.cuda.synchronize(dev)
            ok &= torch.equal(
                got.reshape(-1, got.shape[-1]).view(torch.int16).cpu(),
                want.reshape(-1, want.shape[-1]).view(torch.int16).cpu(),
            )
        cache.policy.check_invariants()
        s = cache.stats()
        assert ok and s.hits > 0 and s.evicted > 0, (
            f"hot-row cache on CUDA (fused) == host gather: {name}, 10 skewed steps: "
            f"hit rate {s.hit_rate:.1%}, fetched / lookups {s.fetch_fraction:.1%}, evicted {s.evicted}, "
            f"preloaded {s.preloaded}"
        )

    class Flaky(TorchTransfer):
        """The CUDA transfer whose first fetch fails."""

        def __init__(self, inner: Any) -> None:
            self.inner, self.failed = inner, False

        def fetch(self, ids_cpu: Any, dst_rows: Any, dst_scales: Any, **kw: Any) -> None:
            if not self.failed:
                self.failed = True
                raise OSError("injected fetch failure")
            self.inner.fetch(ids_cpu, dst_rows, dst_scales, **kw)

        def deliver(self, *args: Any) -> Any:
            return self.inner.deliver(*args)

    from engram_trt.cache.hotcache import CudaTransfer

    inner = CudaTransfer(g, rows_t, scales_t, quant_block=QB, layout="split")
    cache = HotRowCache(rows_t, scales_t, device=dev, capacity_rows=2_000, max_step_rows=30_000, transfer=Flaky(inner))
    sid = rng.integers(0, N, size=(1_000, 24)).astype(np.int32)
    try:
        cache.gather(torch.from_numpy(sid))
        raised = False
    except OSError:
        raised = True
    try:
        cache.policy.check_invariants()
        restored = cache.policy.filled == 0
    except AssertionError:
        restored = False
    got = cache.gather(torch.from_numpy(sid))
    torch.cuda.synchronize(dev)
    idx = sid.reshape(-1)
    want = torch.from_numpy(dequant_fp8_rows(values[idx], scales[idx], QB)).to(torch.bfloat16)
    exact = torch.equal(got.reshape(-1, D).view(torch.int16).cpu(), want.view(torch.int16))
    assert raised and restored and exact, (
        "a failed fetch admits nothing, restores the slot map, and the next step is exact: "
        f"raised {raised}, restored {restored}, exact {exact}"
    )
    g.close()


def compare_steps(
    dev: Any,
    cache: Any,
    ref: Any,
    g: Any,
    table: tuple[Any, Any],
    layout: str,
    make_ids: Callable[[], Any],
    steps: int,
    qb: int,
) -> tuple[bool, str, int, list[int]]:
    """``steps`` steps of ``cache`` (ids from ``make_ids``, with three out-of-range ids,
    on the host and on the device in turns), each against the plain host gather's rows
    and the CPU reference policy's whole state given the step's miss order; returns (ok,
    why not, whole steps, misses per step)."""
    import torch

    n = cache.policy.table_rows
    whole, misses = 0, []
    for k in range(steps):
        sid = make_ids()
        sid[0, :3] = [-1, n, n + 7]
        ids = torch.from_numpy(sid)
        decay = cache.policy.decay_due()
        before = cache.stats()
        got = cache.gather(ids.to(dev) if k % 2 else ids.pin_memory())
        want = g.gather(ids, *table, quant_block=qb, layout=layout)
        torch.cuda.synchronize(dev)
        m = cache.stats().fetched - before.fetched
        misses.append(m)
        whole += not decay
        order = cache.policy._plan[2 : 2 + m].cpu()
        rp = ref.plan(ids, miss_order=order)
        ref.finish(rp, replace=True)
        gs, rs = cache.policy.state(), ref.state()
        diff = [
            key
            for key in gs
            if not (torch.equal(gs[key], rs[key]) if isinstance(gs[key], torch.Tensor) else gs[key] == rs[key])
        ]
        exact = torch.equal(
            got.reshape(-1, got.shape[-1]).view(torch.int16).cpu(),
            want.reshape(-1, want.shape[-1]).view(torch.int16).cpu(),
        )
        if not exact or diff or rp.num_miss != m:
            return (
                False,
                f"step {k}: rows exact {exact}, misses {m} vs {rp.num_miss}, state differs in {diff}",
                whole,
                misses,
            )
    return True, "", whole, misses


def test_uva_misses(dev) -> None:
    """The whole step reading a share of its misses through UVA (``uva_share``) beside the
    host gather: steps of more than ENGRAM_CACHE_UVA_MIN_MISSES misses from a pinned
    table, split (scales pinned too) and hbm-scales, each step's rows bit-equal to the
    plain host gather and the policy's state equal to the CPU reference's; a share of 1
    (every miss through UVA) too; a share asked for on a table the GPU cannot read is
    refused."""
    from engram_trt.native import hostgather
    from engram_trt.native.cache import UVA_MIN_MISSES
    from engram_trt.cache.policy import CachePolicy
    from engram_trt.cache.hotcache import HotRowCache

    rng = np.random.default_rng(29)
    N, D, QB = 400_000, 256, 32
    _, _, rows_t, scales_t = fp8_table(rng, N, D, QB)
    rows_p, scales_p = rows_t.pin_memory(), scales_t.pin_memory()
    g = hostgather.HostGatherer(device=dev)
    kw = dict(capacity_rows=5_000, max_step_rows=48_000, admit_budget=2_000, sample_factor=2, seed=4)
    uniform = lambda: rng.integers(0, N, size=(2_000, 24)).astype(np.int32)  # noqa: E731
    for (name, table, layout), share in itertools.product(
        [("split", (rows_p, scales_p), "split"), ("hbm-scales", (rows_p, scales_t.to(dev)), "hbm-scales")], (0.3, 1.0)
    ):
        cache = HotRowCache(*table, device=dev, gatherer=g, layout=layout, uva_share=share, uva_blocks=4, **kw)
        ref = CachePolicy(
            N,
            kw["capacity_rows"],
            device="cpu",
            admit_budget=kw["admit_budget"],
            sample_factor=kw["sample_factor"],
            seed=kw["seed"],
        )
        ok, why, whole, misses = compare_steps(dev, cache, ref, g, table, layout, uniform, 4, QB)
        ok = ok and whole == 4 and min(misses) >= UVA_MIN_MISSES and cache._whole_step.uva_share == share
        assert ok, (
            f"whole step with {share:.0%} of its misses through UVA == host gather, state == CPU reference: {name}: "
            f"{why or f'misses per step {misses}'}"
        )
    try:
        HotRowCache(rows_t, scales_t, device=dev, gatherer=g, layout="split", uva_share=0.2, **kw)
        said = ""
    except Exception as exc:  # noqa: BLE001
        said = str(exc)
    plain = HotRowCache(rows_t, scales_t, device=dev, gatherer=g, layout="split", **kw)
    assert "the GPU cannot read the host table" in said and plain._whole_step.uva_share == 0.0, (
        f"a UVA share on a table the GPU cannot read is refused; by default such a table gets none: {said[:100]}"
    )
    g.close()


def test_whole_step(dev) -> None:
    """HotRowCache's whole step (``engram_cache_step``, one library call) on CUDA, step by
    step: the rows bit-equal to the plain host gather, and the policy's whole state equal
    to the CPU reference's given the step's miss order (the plan's list, which the step
    leaves in the policy's buffer); per table layout, a full cache with replacements,
    aging counts every 3rd step (those steps run phase by phase, between whole ones) and
    ids on the host and on the device in turns. Then a step whose delivery fails in the
    library (a misaligned ``out``): the error is raised, nothing admitted, the slot map
    restored, and the next step exact."""
    import torch

    from engram_trt.native import hostgather
    from engram_trt.cache.policy import CachePolicy
    from engram_trt.runtime.gatherpath import inline_table
    from engram_trt.cache.hotcache import HotRowCache

    rng = np.random.default_rng(17)
    N, D, QB = 60_000, 256, 32
    _, _, rows_t, scales_t = fp8_table(rng, N, D, QB)
    bf = torch.randn(N, 128, dtype=torch.bfloat16)
    g = hostgather.HostGatherer(device=dev)
    configs = [
        ("inline fp8", (inline_table(rows_t, scales_t), None), "inline"),
        ("split fp8", (rows_t, scales_t), "split"),
        ("hbm-scales fp8", (rows_t, scales_t.to(dev)), "hbm-scales"),
        ("bf16", (bf, None), "split"),
    ]
    kw = dict(capacity_rows=3_000, max_step_rows=30_000, admit_budget=1_000, sample_factor=2, decay_every=3, seed=9)
    for (name, table, layout), overlap in itertools.product(configs, (True, False)):
        cache = HotRowCache(*table, device=dev, gatherer=g, layout=layout, admit_every=1, overlap=overlap, **kw)
        assert cache._whole_step.overlaps == overlap, (
            f"whole-step cache binds its overlap as asked: {name}, overlap {overlap}: "
            f"overlaps {cache._whole_step.overlaps}"
        )
        ref = CachePolicy(
            N,
            kw["capacity_rows"],
            device="cpu",
            admit_budget=kw["admit_budget"],
            sample_factor=kw["sample_factor"],
            decay_every=kw["decay_every"],
            seed=kw["seed"],
        )
        zipf = lambda: ((rng.zipf(1.2, size=(1_000, 24)) * 7919) % N).astype(np.int32)  # noqa: E731
        ok, why, whole, _ = compare_steps(dev, cache, ref, g, table, layout, zipf, 12, QB)
        cache.policy.check_invariants()
        s = cache.stats()
        ok = ok and s.evicted > 0 and whole >= 8
        assert ok, (
            f"whole-step cache (engram_cache_step) == host gather, state == CPU reference: {name}, "
            f"{'hits delivered during the fetch' if overlap else 'one delivery after the fetch'}: "
            + (
                why
                or f"{whole} whole steps of 12 (the others aged the counts), hit rate {s.hit_rate:.1%}, "
                f"evicted {s.evicted}"
            )
        )

    cache = HotRowCache(
        rows_t, scales_t, device=dev, gatherer=g, layout="split", capacity_rows=2_000, max_step_rows=30_000
    )
    sid = rng.integers(0, N, size=(1_000, 24)).astype(np.int32)
    buf = torch.empty(1_000 * 24 * D + 1, dtype=torch.bfloat16, device=dev)
    misaligned = buf[1:].view(1_000, 24, D)  # contiguous, 2 bytes past a 16-byte boundary: the gather refuses it
    try:
        cache.gather(torch.from_numpy(sid), misaligned)
        raised = ""
    except Exception as exc:  # noqa: BLE001 - what the library said is the detail
        raised = str(exc)
    try:
        cache.policy.check_invariants()
        restored = cache.policy.filled == 0 and cache.policy.steps == 1
    except AssertionError:
        restored = False
    got = cache.gather(torch.from_numpy(sid))
    want = g.gather(torch.from_numpy(sid), rows_t, scales_t, quant_block=QB, layout="split")
    torch.cuda.synchronize(dev)
    exact = torch.equal(got.view(torch.int16).cpu(), want.view(torch.int16).cpu())
    assert bool(raised) and "engram_cache_step failed" in raised and restored and exact, (
        "a whole step whose delivery fails raises, admits nothing, restores the slot map; the next step is exact: "
        f"raised {raised[:90]!r}, restored {restored}, exact {exact}"
    )
    # The same with hits in the step: the hits' call on the overlap's stream refuses out first.
    try:
        cache.gather(torch.from_numpy(sid), misaligned)
        raised = ""
    except Exception as exc:  # noqa: BLE001
        raised = str(exc)
    filled = cache.policy.filled
    try:
        cache.policy.check_invariants()
        intact = True
    except AssertionError:
        intact = False
    got = cache.gather(torch.from_numpy(sid))
    torch.cuda.synchronize(dev)
    exact = torch.equal(got.view(torch.int16).cpu(), want.view(torch.int16).cpu())
    assert "engram_gather_part" in raised and filled == 2_000 and intact and exact, (
        "a whole step with hits whose delivery fails (the overlap's call) raises and admits nothing; next exact: "
        f"raised {raised[:110]!r}, filled {filled}, invariants {intact}, exact {exact}"
    )
    # An empty step (0 lookups) and a step of out-of-range ids alone, in one call each.
    empty = cache.gather(torch.empty((0, 24), dtype=torch.int32))
    bad = cache.gather(torch.full((4, 24), -5, dtype=torch.int32))
    torch.cuda.synchronize(dev)
    assert tuple(empty.shape) == (0, 24, D) and not bool(bad.ne(0).any()), (
        "a whole step of 0 lookups, and one of out-of-range ids alone (zero rows): "
        f"shapes {tuple(empty.shape)} / {tuple(bad.shape)}"
    )
    step_call = cache._whole_step
    cache.close()
    cache.close()  # idempotent
    try:
        step_call(torch.from_numpy(sid).reshape(-1), 1_000, 24, got, host_ids=0, filled=0, replace=False, step=99)
        closed = ""
    except Exception as exc:  # noqa: BLE001
        closed = str(exc)
    after = cache.gather(torch.from_numpy(sid))  # phase by phase now
    torch.cuda.synchronize(dev)
    same = torch.equal(after.view(torch.int16).cpu(), want.view(torch.int16).cpu())
    assert "was closed" in closed and cache._whole_step is None and same, (
        "a closed cache's step call refuses a step; the cache serves phase by phase after close(), exact: "
        f"{closed[:80]!r}, exact {same}"
    )
    g.close()


def test_gather_part(dev) -> None:
    """``gather_kernels.gather(keep_outside=True)`` (``engram_gather_part``): two gathers with
    disjoint row slices of one table fill one output bit-equal to a single gather, rows
    outside a slice keep the sentinel they held, ids outside the table stay untouched by
    both; ``max_blocks`` 1 and 5 equal a full wave, from device memory and through UVA."""
    import torch

    from engram_trt.native import gather as gather_kernels

    rng = np.random.default_rng(23)
    N, D, QB = 50_000, 256, 32
    _, _, rows_t, scales_t = fp8_table(rng, N, D, QB)
    bf = torch.randn(N, 128, dtype=torch.bfloat16)
    ids = torch.from_numpy(rng.integers(-3, N + 3, size=(3_000, 24)).astype(np.int32)).to(dev)
    cut = 20_011
    for name, rows, scales in (("fp8", rows_t, scales_t), ("bf16", bf, None)):
        d_rows, d_scales = rows.to(dev), None if scales is None else scales.to(dev)
        want = gather_kernels.gather(ids, d_rows, d_scales, quant_block=QB)
        sentinel = torch.full_like(want, 7.0)
        out = sentinel.clone()
        gather_kernels.gather(
            ids, d_rows[:cut], None if d_scales is None else d_scales[:cut], quant_block=QB, out=out, keep_outside=True
        )
        first = out.clone()
        gather_kernels.gather(
            ids,
            d_rows[cut:],
            None if d_scales is None else d_scales[cut:],
            quant_block=QB,
            out=out,
            keep_outside=True,
            row_offset=cut,
        )
        torch.cuda.synchronize(dev)
        inside = (ids >= 0) & (ids < N)
        low = (ids >= 0) & (ids < cut)
        v = lambda t: t.view(torch.int16)  # noqa: E731
        ok_first = torch.equal(v(first[low]), v(want[low])) and torch.equal(v(first[~low]), v(sentinel[~low]))
        ok_both = torch.equal(v(out[inside]), v(want[inside])) and torch.equal(v(out[~inside]), v(sentinel[~inside]))
        capped = [
            gather_kernels.gather(ids, src_rows, src_scales, quant_block=QB, max_blocks=b)
            for b in (1, 5)
            for src_rows, src_scales in (
                (d_rows, d_scales),
                (rows.pin_memory(), None if scales is None else scales.pin_memory()),
            )
        ]
        torch.cuda.synchronize(dev)
        ok_capped = all(torch.equal(v(c), v(want)) for c in capped)
        assert ok_first and ok_both and ok_capped, (
            f"engram_gather_part: two slices == one gather, outside rows untouched, capped grids exact: {name}: "
            f"first slice {ok_first}, both {ok_both}, max_blocks 1/5 (HBM, UVA) {ok_capped}"
        )
    for kwargs, words in (
        ({"keep_outside": True}, "pass the out tensor"),
        ({"max_blocks": -1}, "max_blocks must be an integer >= 0"),
        ({"max_blocks": 2, "bad_rows": gather_kernels.new_bad_row_counter(dev)}, "count no bad rows"),
    ):
        try:
            gather_kernels.gather(ids, rows_t.to(dev), scales_t.to(dev), quant_block=QB, **kwargs)
            said = ""
        except Exception as exc:  # noqa: BLE001
            said = str(exc)
        assert words in said, f"gather_kernels.gather refuses {sorted(kwargs)} as documented: {said[:90]}"


def id_stream_chunks(num_chunks: int = 8, chunk_tokens: int = 2048, column_rows: int = 4096) -> tuple[Any, Any, str]:
    """(layout, [chunk_tokens, 2, 24] row-id chunks, where the tokens came from): n-gram
    hashed chunks of the bench's token file where it exists, else of a Zipf stream."""
    import sys

    from .helpers import REPO

    if str(REPO / "benchmarks" / "lookup") not in sys.path:  # idstreams.py: benchmarks/lookup's own module
        sys.path.insert(0, str(REPO / "benchmarks" / "lookup"))
    import idstreams

    path = idstreams.default_tokens_path()
    if path.is_file():
        stream, source = idstreams.load_tokens(path), f"token file {path}"
    else:
        vocab = 50_000
        tok = (np.random.default_rng(21).zipf(1.3, size=chunk_tokens * num_chunks + 5) % vocab).astype(np.int32)
        stream = idstreams.TokenStream(
            ids=tok,
            compressed_vocab_size=vocab,
            pad_id=1,
            text_bytes=4 * tok.size,
            num_files=1,
            python="-",
            tokenizer_sha256="-",
            files_sha256="-",
        )
        source = "a Zipf(1.3) token stream (no token file)"
    layout = idstreams.make_layout(column_rows, stream.compressed_vocab_size, stream.pad_id)
    chunks = list(idstreams.chunk_row_ids(stream, layout, chunk_tokens=chunk_tokens, num_chunks=num_chunks))
    return layout, chunks, source


def test_hbm_scales_streams(dev) -> None:
    """Both layers of real skewed ids through an hbm-scales cache (history and warm start),
    each step bit-equal to the plain host gather (hbm-scales and split) and the NumPy
    dequant, out-of-range ids included."""
    import torch

    from engram_trt.native import hostgather
    from engram_trt.engram.quant import dequant_fp8_rows
    from engram_trt.cache.hotcache import HotRowCache

    layout, chunks, source = id_stream_chunks()
    rng = np.random.default_rng(31)
    g = hostgather.HostGatherer(device=dev)
    QB, D, warm = 32, 256, 4
    for li in range(layout.num_layers):
        N = int(layout.table_rows[li])
        values, scales, rows_t, scales_t = fp8_table(rng, N, D, QB)
        scales_dev = scales_t.to(dev)
        counts = np.bincount(np.concatenate([c[:, li, :].reshape(-1) for c in chunks[:warm]]), minlength=N)
        for name, extra in (("history", {}), ("warm start", {"initial_counts": counts})):
            cache = HotRowCache(
                rows_t,
                scales_dev,
                device=dev,
                gatherer=g,
                layout="hbm-scales",
                capacity_rows=N // 20,
                max_step_rows=chunks[0].shape[0] * chunks[0].shape[2],
                admit_budget=2_000,
                admit_every=2,
                **extra,
            )
            ok, why = True, ""
            for k, chunk in enumerate(chunks if name == "history" else chunks[warm:]):
                sid = chunk[:, li, :].copy()
                sid[k, :4] = [-1, N, N + 5, -(2**31)]  # out of range: zero rows through the cache
                ids = torch.from_numpy(sid)
                got = cache.gather(ids)
                want = g.gather(ids, rows_t, scales_dev, quant_block=QB, layout="hbm-scales")
                want_split = g.gather(ids, rows_t, scales_t, quant_block=QB, layout="split")
                torch.cuda.synchronize(dev)
                flat = sid.reshape(-1)
                good = (flat >= 0) & (flat < N)
                ref = dequant_fp8_rows(values[np.where(good, flat, 0)], scales[np.where(good, flat, 0)], QB)
                ref[~good] = 0
                ref_t = torch.from_numpy(ref).to(torch.bfloat16).view(torch.int16)
                g16 = got.reshape(-1, D).view(torch.int16).cpu()
                if not (
                    torch.equal(g16, want.reshape(-1, D).view(torch.int16).cpu())
                    and torch.equal(g16, want_split.reshape(-1, D).view(torch.int16).cpu())
                    and torch.equal(g16, ref_t)
                ):
                    ok, why = False, f"step {k} differs"
                    break
            cache.policy.check_invariants()
            s = cache.stats()
            ok = ok and s.hits > 0 and s.fetched > 0 and (s.evicted > 0 or s.preloaded > 0)
            assert ok, (
                f"hbm-scales cache == plain host gather (hbm-scales, split) == NumPy: layer {li}, {name}, "
                "real skewed ids: "
                + (
                    why
                    or f"{s.steps} steps of {chunks[0].shape[0] * 24:,} lookups from {source}; hit rate "
                    f"{s.hit_rate:.1%}, fetched / lookups {s.fetch_fraction:.1%}, evicted {s.evicted}, "
                    f"preloaded {s.preloaded}"
                )
            )
            del cache
    g.close()


def test_id_streams_cpu() -> None:
    """The id streams' CPU part (no GPU): both layers of hashed chunks, through the
    hbm-scales cache on CPU tensors, against the NumPy dequant."""
    import torch

    from engram_trt.engram.quant import dequant_fp8_rows
    from engram_trt.cache.hotcache import HotRowCache

    layout, chunks, source = id_stream_chunks(num_chunks=3)
    rng = np.random.default_rng(2)
    for li in range(layout.num_layers):
        N = int(layout.table_rows[li])
        values = rng.integers(0, 0x70, size=(N, 256), dtype=np.uint8)
        scales = rng.integers(110, 140, size=(N, 8), dtype=np.uint8)
        cache = HotRowCache(
            torch.from_numpy(values),
            torch.from_numpy(scales),
            device="cpu",
            layout="hbm-scales",
            capacity_rows=N // 20,
            max_step_rows=chunks[0].shape[0] * 24,
            admit_budget=500,
        )
        ok = True
        for chunk in chunks:
            sid = chunk[:, li, :].copy()
            sid[0, :2] = [-1, N]
            got = cache.gather(torch.from_numpy(sid)).reshape(-1, 256)
            flat = sid.reshape(-1)
            good = (flat >= 0) & (flat < N)
            ref = dequant_fp8_rows(values[np.where(good, flat, 0)], scales[np.where(good, flat, 0)], 32)
            ref[~good] = 0
            ok &= torch.equal(got.view(torch.int16), torch.from_numpy(ref).to(torch.bfloat16).view(torch.int16))
        s = cache.stats()
        assert ok and s.hits > 0, (
            f"hbm-scales cache (CPU, torch path) == NumPy: layer {li}, hashed ids: "
            f"{len(chunks)} chunks from {source}; hit rate {s.hit_rate:.1%}"
        )


# --- the tests ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("ci", range(len(POLICY_CASES)), ids=[c[0] for c in POLICY_CASES])
def test_policies(dev, ci: int) -> None:
    ok, detail = compare_policy(dev, ci)
    assert ok, detail
