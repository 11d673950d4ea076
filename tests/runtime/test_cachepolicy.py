"""The hot-row cache's policy: its torch reference (the CPU path, and what the GPU checks
compare the fused kernels with) against a plain-Python implementation of the
specification in engramKernels.h ("Hot-row cache"), step by step and state by state;
the warm start from offline counts; the step protocol; and the kernels' C ABI argument
checks, which run on the host (no GPU needed).

The kernels themselves run on the H200 (tests/gpu/test_cache.py), where each
step's state is compared with this reference given the kernels' miss order.
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engram_trt.cache.policy import CachePolicy, top_rows
from engram_trt.errors import EngramError

from helpers.files import REPO


def _draw(seed: int, step: int, k: int) -> int:
    """A step's admission draw as engramKernels.h specifies it, in NumPy uint64
    arithmetic (wrapping): splitmix64's output function over seed + (2 step + k) x the
    golden-ratio increment."""
    u = np.uint64
    with np.errstate(over="ignore"):
        z = u(seed) + u(2 * step + k) * u(0x9E3779B97F4A7C15)
        z = (z ^ (z >> u(30))) * u(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> u(27))) * u(0x94D049BB133111EB)
        return int(z ^ (z >> u(31)))


class PyPolicy:
    """The policy from its specification, in plain Python (dicts and lists)."""

    def __init__(self, rows: int, capacity: int, budget: int, factor: int, seed: int, decay_every: int = 0) -> None:
        self.rows, self.cap, self.budget, self.factor, self.decay_every = rows, capacity, budget, factor, decay_every
        self.slot_of: dict[int, int] = {}
        self.row_of_slot = [-1] * max(capacity, 1)
        self.counts = [0] * (rows + 1)
        self.filled = self.steps = self.evicted = 0
        self.seed = seed

    def step(self, ids: list[int], replace: bool = True, order: list[int] | None = None):
        miss_base = self.cap
        mapped = [i if 0 <= i < self.rows else self.rows for i in ids]
        for r in mapped:
            self.counts[r] += 1
        distinct = set(mapped)
        misses = sorted(r for r in distinct if r not in self.slot_of) if order is None else list(order)
        where = {r: self.slot_of[r] for r in distinct if r in self.slot_of}
        where.update({r: miss_base + j for j, r in enumerate(misses)})
        positions = [where[r] for r in mapped]
        self.steps += 1
        if self.decay_every and self.steps % self.decay_every == 0:
            self.counts = [c >> 1 for c in self.counts]
        m = len(misses)
        free = min(m, self.cap - self.filled) if self.cap and m else 0
        for j in range(free):
            self.slot_of[misses[j]] = self.filled + j
            self.row_of_slot[self.filled + j] = misses[j]
        self.filled += free
        left = m - free
        budget = min(self.budget, left, self.cap)
        if self.cap and m and replace and budget > 0 and self.filled == self.cap:
            start = _draw(self.seed, self.steps, 0) % left
            factor = max(1, min(self.factor, self.cap // budget))
            first = _draw(self.seed, self.steps, 1) % self.cap
            stride = left // budget
            for c in range(budget):
                cand = misses[free + (start + c * stride) % left]
                window = [(first + c * factor + k) % self.cap for k in range(factor)]
                victim = min(range(factor), key=lambda k: (self.counts[self.row_of_slot[window[k]]], k))
                slot = window[victim]
                old = self.row_of_slot[slot]
                if self.counts[cand] > self.counts[old]:
                    del self.slot_of[old]
                    self.slot_of[cand] = slot
                    self.row_of_slot[slot] = cand
                    self.evicted += 1
        return positions, misses, len(distinct)

    def dense_slot_of(self) -> np.ndarray:
        s = np.full(self.rows + 1, -1, dtype=np.int32)
        for r, slot in self.slot_of.items():
            s[r] = slot
        return s


def _same_state(policy: CachePolicy, py: PyPolicy) -> None:
    st = policy.state()
    assert np.array_equal(st["slot_of"].numpy(), py.dense_slot_of())
    assert np.array_equal(st["row_of_slot"].numpy(), np.asarray(py.row_of_slot, dtype=np.int32))
    assert np.array_equal(st["counts"].numpy(), np.asarray(py.counts, dtype=np.int32))
    assert st["filled"] == py.filled and st["evicted"] == py.evicted
    policy.check_invariants()


def _steps(rng, rows: int, kind: str, n: int) -> list[int]:
    if kind == "skewed":
        ids = (rng.zipf(1.3, size=n) * 7919) % rows
    elif kind == "repeating":
        ids = rng.choice(rng.integers(0, rows, size=7), size=n)  # a handful of rows, each many times
    else:
        ids = rng.integers(0, rows, size=n)
    ids = ids.astype(np.int64)
    ids[rng.random(n) < 0.02] = rows + 3  # out of range: the sentinel row
    if n > 2:
        ids[:2] = [-1, rows]
    return [int(v) for v in ids]


@pytest.mark.parametrize(
    "capacity,budget,factor,decay,kind",
    [
        (0, 0, 4, 0, "skewed"),  # de-duplication alone
        (40, 8, 1, 0, "skewed"),  # small cache: fills in step 1, then replacements every step
        (40, 8, 4, 3, "skewed"),  # sampled victims and aging counts
        (25, 25, 2, 0, "uniform"),  # budget = capacity: factor falls to 1
        (60, 5, 3, 0, "repeating"),  # rows repeated within a step
        (300, 50, 4, 0, "skewed"),  # a cache that takes several steps to fill
    ],
)
def test_reference_policy_equals_the_specification(capacity, budget, factor, decay, kind) -> None:
    import torch

    rows = 500
    policy = CachePolicy(rows, capacity, admit_budget=budget, sample_factor=factor, decay_every=decay, seed=5)
    py = PyPolicy(rows, capacity, budget, factor, seed=5, decay_every=decay)
    rng = np.random.default_rng(3)
    for step in range(30):
        ids = _steps(rng, rows, kind, int(rng.integers(0, 400)) if step != 4 else 0)  # step 4: no lookups
        replace = step % 3 != 1
        plan = policy.plan(
            torch.tensor(ids, dtype=torch.int32).view(-1, 1) if ids else torch.zeros(0, dtype=torch.int32)
        )
        positions, misses, distinct = py.step(ids, replace=replace)
        assert plan.positions.tolist() == positions, step
        assert plan.miss_rows.tolist() == misses and plan.miss_rows_host.tolist() == misses
        assert plan.num_unique == distinct and plan.num_miss == len(misses) and plan.num_lookups == len(ids)
        policy.finish(plan, replace=replace)
        _same_state(policy, py)
    if capacity:
        assert py.evicted > 0 or kind == "repeating"  # the sequences exercise replacement


def test_a_given_miss_order_drives_positions_and_admission() -> None:
    """The kernels list misses in any order; given that order the reference reproduces
    their positions and their admission (free slots, candidates) exactly."""
    import torch

    rows, capacity = 400, 30
    policy = CachePolicy(rows, capacity, admit_budget=6, sample_factor=2, seed=9)
    py = PyPolicy(rows, capacity, 6, 2, seed=9)
    rng = np.random.default_rng(4)
    for step in range(20):
        ids = _steps(rng, rows, "skewed", 300)
        mapped = {i if 0 <= i < rows else rows for i in ids}
        uncached = [r for r in sorted(mapped) if int(policy.slot_of[r]) < 0]
        order = [uncached[k] for k in rng.permutation(len(uncached))]
        plan = policy.plan(torch.tensor(ids, dtype=torch.int32), miss_order=torch.tensor(order, dtype=torch.int32))
        positions, misses, _ = py.step(ids, order=order)
        assert plan.miss_rows.tolist() == order == misses
        assert plan.positions.tolist() == positions, step
        policy.finish(plan)
        _same_state(policy, py)
    assert py.evicted > 0


def test_a_miss_order_must_be_a_permutation_of_the_misses() -> None:
    import torch

    policy = CachePolicy(100, 10)
    ids = torch.tensor([5, 6, 7, 5], dtype=torch.int32)
    for bad in ([5, 6], [5, 6, 8], [5, 6, 6], [5, 6, 7, 9]):
        with pytest.raises(EngramError, match="^miss_order must be a permutation of the step's 3 misses"):
            policy.plan(ids, miss_order=torch.tensor(bad, dtype=torch.int32))
    plan = policy.plan(ids, miss_order=torch.tensor([7, 5, 6], dtype=torch.int32))
    assert plan.positions.tolist() == [11, 12, 10, 11]
    policy.finish(plan)
    assert policy.slot_of[[7, 5, 6]].tolist() == [0, 1, 2]  # free slots in the given order


def test_a_step_is_plan_then_finish() -> None:
    import torch

    policy = CachePolicy(100, 10)
    plan = policy.plan(torch.tensor([1, 2], dtype=torch.int32))
    with pytest.raises(EngramError, match=r"^the previous step's plan is not finished: call finish\(\)"):
        policy.plan(torch.tensor([1], dtype=torch.int32))
    with pytest.raises(AssertionError, match="a plan is not finished"):
        policy.check_invariants()
    other = type(plan)(**{**plan.__dict__})
    with pytest.raises(EngramError, match="^finish\\(\\) takes the plan of the current step"):
        policy.finish(other)
    policy.abort(plan)  # nothing admitted, the counts kept
    assert policy.filled == 0 and policy.counts[[1, 2]].tolist() == [1, 1]
    policy.check_invariants()
    with pytest.raises(EngramError, match=r"^ids must be an int32 tensor \(got torch.int64\)$"):
        policy.plan(torch.tensor([1]))
    with pytest.raises(EngramError, match=r"^miss_base must be in \[capacity=10, "):
        policy.plan(torch.tensor([1], dtype=torch.int32), miss_base=3)
    with pytest.raises(EngramError, match=r"^the fused cache plan runs on CUDA devices \(got cpu\); pass fused=False$"):
        CachePolicy(100, 10, fused=True)
    with pytest.raises(EngramError, match=r"^table_rows must be below 2\^31 - 1 and the capacity at most 2\^30 - 1"):
        CachePolicy(2**31, 10)


def test_top_rows_takes_the_most_frequent_ties_to_the_lower_row() -> None:
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 6, size=2000).astype(np.int32)  # many ties
    for k in (0, 1, 17, 500, 1999, 5000):
        got = top_rows(counts, k)
        ranked = sorted((-int(c), r) for r, c in enumerate(counts) if c > 0)  # independent: a full sort
        want = [r for _, r in ranked[:k]]
        assert got.dtype == np.int32 and got.tolist() == want, k
    assert top_rows(np.zeros(10, dtype=np.int32), 5).size == 0


def test_warm_start_seeds_counts_and_loads_the_top_rows() -> None:
    import torch

    counts = np.zeros(300, dtype=np.int64)
    counts[[10, 20, 30, 40, 50]] = [5, 9, 9, 1, 2**40]  # one count past int32: saturated
    policy = CachePolicy(300, 3, initial_counts=counts)
    assert policy.filled == policy.preloaded == 3
    assert policy.row_of_slot.tolist() == [50, 20, 30] and policy.slot_of[[50, 20, 30]].tolist() == [0, 1, 2]
    assert int(policy.counts[50]) == 2**31 - 1 and int(policy.counts[40]) == 1 and int(policy.counts[300]) == 0
    policy.check_invariants()
    plan = policy.plan(torch.tensor([20, 40, 50], dtype=torch.int32))
    assert plan.num_miss == 1 and plan.positions.tolist() == [1, 3, 0]
    policy.finish(plan)
    with pytest.raises(EngramError, match="^warm_start needs a fresh cache"):
        policy.warm_start(counts)
    with pytest.raises(EngramError, match=r"^initial counts must be integers \[table_rows\] = \[300\]"):
        CachePolicy(300, 3, initial_counts=np.zeros(299, dtype=np.int32))
    with pytest.raises(EngramError, match="^initial counts must be >= 0$"):
        CachePolicy(300, 3, initial_counts=np.full(300, -1))


def test_a_warm_cache_serves_exact_rows_from_its_first_step() -> None:
    import torch

    from engram_trt.engram.quant import dequant_fp8_rows
    from engram_trt.cache.hotcache import HotRowCache

    rng = np.random.default_rng(8)
    values = rng.integers(0, 256, size=(1000, 64), dtype=np.uint8)
    values[(values & 0x7F) == 0x7F] = 0x3C
    scales = rng.integers(110, 140, size=(1000, 2), dtype=np.uint8)
    ids = ((rng.zipf(1.2, size=(50, 24)) * 7919) % 1000).astype(np.int32)
    counts = np.bincount(ids.reshape(-1), minlength=1000)
    cache = HotRowCache(
        torch.from_numpy(values),
        torch.from_numpy(scales),
        device="cpu",
        capacity_rows=100,
        quant_block=32,
        max_step_rows=2000,
        initial_counts=counts,
    )
    got = cache.gather(torch.from_numpy(ids))
    want = torch.from_numpy(dequant_fp8_rows(values[ids.reshape(-1)], scales[ids.reshape(-1)], 32)).to(torch.bfloat16)
    assert torch.equal(got.reshape(-1, 64).view(torch.int16), want.view(torch.int16))
    s = cache.stats()
    distinct = np.unique(ids).size
    assert s.preloaded == 100 and s.unique == distinct and s.hits == min(100, distinct)  # the top rows were there


def test_a_failed_fetch_admits_nothing_and_the_next_step_is_exact() -> None:
    import torch

    from engram_trt.engram.quant import dequant_fp8_rows
    from engram_trt.cache.hotcache import HotRowCache, TorchTransfer

    rng = np.random.default_rng(2)
    values = rng.integers(0, 0x70, size=(200, 32), dtype=np.uint8)
    scales = np.full((200, 1), 127, dtype=np.uint8)
    rows_t, scales_t = torch.from_numpy(values), torch.from_numpy(scales)

    class Flaky(TorchTransfer):
        fail = True

        def fetch(self, ids_cpu, dst_rows, dst_scales) -> None:
            if Flaky.fail:
                Flaky.fail = False
                raise OSError("host gather failed")
            super().fetch(ids_cpu, dst_rows, dst_scales)

    cache = HotRowCache(
        rows_t,
        scales_t,
        device="cpu",
        capacity_rows=20,
        quant_block=32,
        max_step_rows=100,
        transfer=Flaky(rows_t, scales_t, quant_block=32, layout="split", head_dim=32),
    )
    ids = torch.arange(0, 30, dtype=torch.int32)
    with pytest.raises(OSError, match="host gather failed"):
        cache.gather(ids)
    assert cache.policy.filled == 0
    cache.policy.check_invariants()
    got = cache.gather(ids)
    want = torch.from_numpy(dequant_fp8_rows(values[:30], scales[:30], 32)).to(torch.bfloat16)
    assert torch.equal(got.reshape(-1, 32).view(torch.int16), want.view(torch.int16))
    assert cache.policy.filled == 20


def test_cache_abi_refuses_bad_arguments_before_any_cuda_call(plugin_lib: Path) -> None:
    """engram_cache_plan / engram_cache_admit check every bound and precondition on the
    host, with one-line reasons (no GPU needed: nothing is enqueued)."""
    from engram_trt.native import cache as cache_kernels

    lib = cache_kernels.library()
    p = ctypes.c_void_p(64)  # never read: the calls fail on their arguments first

    def plan(n=10, rows=100, base=5, plan_ptr=p, host=None, host_ids=0, ids=p):
        status = lib.engram_cache_plan(ids, n, rows, p, p, base, plan_ptr, p, host, host_ids, None)
        return status, lib.engram_last_error().decode()

    assert plan(n=-1) == (1, "engram_cache_plan: num_ids must be in [0, 2^30] (got -1)")
    assert plan(rows=0)[1].startswith("engram_cache_plan: table_num_rows must be in [1, 2^31 - 2]")
    assert plan(rows=2**31 - 1)[0] == 1
    assert plan(base=2**30) == (
        1,
        "engram_cache_plan: miss_base must be in [0, 2^30) and miss_base + num_ids <= 2^31 - 1 (got 1073741824, 10)",
    )
    assert plan(plan_ptr=None) == (1, "engram_cache_plan: plan must be a 4-byte aligned device pointer")
    assert plan(host=ctypes.c_void_p(66))[0] == 1
    assert plan(ids=ctypes.c_void_p(65))[1] == (
        "engram_cache_plan: ids, slot_of and positions (and counts, if given) must be 4-byte aligned device pointers"
    )

    def admit(
        m=10,
        free=0,
        filled=4,
        cap=4,
        cand=2,
        start=0,
        stride=3,
        first=0,
        factor=2,
        base=4,
        rows=p,
        row_bytes=0,
        scales=None,
        scale_bytes=0,
        replaced=None,
    ):
        status = lib.engram_cache_admit(
            p,
            m,
            free,
            filled,
            cap,
            p,
            p,
            p,
            cand,
            start,
            stride,
            first,
            factor,
            base,
            rows,
            row_bytes,
            scales,
            scale_bytes,
            replaced,
            None,
        )
        return status, lib.engram_last_error().decode()

    ok = dict(rows=None)
    assert admit(free=11, **ok)[1].startswith(
        "engram_cache_admit: need 0 <= capacity < 2^30, 0 <= num_free <= num_miss"
    )
    assert admit(filled=3, **ok) == (
        1,
        "engram_cache_admit: replacements need a full cache (filled 3 + num_free 0 != capacity 4)",
    )
    assert admit(stride=6, **ok)[1].startswith("engram_cache_admit: candidates must be distinct misses")
    assert admit(start=10, **ok)[1].startswith("engram_cache_admit: candidates must be distinct misses")
    assert admit(factor=3, **ok)[1].startswith("engram_cache_admit: victim windows must be disjoint slots")
    assert admit(first=4, **ok)[1].startswith("engram_cache_admit: victim windows must be disjoint slots")
    assert admit(base=3, **ok)[1].startswith("engram_cache_admit: need num_miss <= 2^30 and capacity <= miss_base")
    assert admit(row_bytes=24)[1].startswith("engram_cache_admit: work_rows must be 16-byte aligned with row_bytes")
    assert admit(row_bytes=256, scale_bytes=8)[0] == 1  # scale bytes without work_scales
    assert admit(replaced=ctypes.c_void_p(68), **ok) == (
        1,
        "engram_cache_admit: replaced must be an 8-byte aligned device pointer",
    )
    assert admit(cand=-1, **ok) == (1, "engram_cache_admit: num_candidates must be >= 0 (got -1)")


def test_admission_draws_are_splitmix64_of_the_step_counter() -> None:
    """The draws over seed 0 run through splitmix64's published sequence for seed 0 (its
    1st..4th outputs), and the package's draw is the specification's (NumPy) draw."""
    from engram_trt.cache.policy import admission_draw

    published = [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F, 0xF88BB8A8724C81EC]
    assert [admission_draw(0, i // 2, i % 2) for i in range(1, 5)] == published
    rng = np.random.default_rng(11)
    for _ in range(200):
        seed, step, k = int(rng.integers(0, 2**63)) * 2 + 1, int(rng.integers(0, 2**40)), int(rng.integers(0, 2))
        assert admission_draw(seed, step, k) == _draw(seed, step, k)


def test_the_library_admission_equals_the_policy_reference(plugin_lib: Path) -> None:
    """engram_cache_admission (the whole-step call's admission, host code: no GPU) gives
    the numbers CachePolicy._admission gives, over fills, budgets, factors, seeds and
    steps, the boundary cases (empty, no misses, not full, no replace) among them."""
    from engram_trt.native import cache as cache_kernels
    from engram_trt.cache.policy import Admission

    rng = np.random.default_rng(12)
    cases = [
        (0, 0, 0, 5, 4, True),
        (7, 0, 10, 5, 4, True),
        (7, 3, 10, 5, 4, True),
        (30, 10, 10, 5, 4, True),
        (30, 10, 10, 5, 4, False),
        (30, 10, 10, 0, 4, True),
        (13, 9, 10, 100, 3, True),
        (1, 10, 10, 5, 2, True),
    ]
    cases += [
        (
            int(rng.integers(0, 5000)),
            None,
            int(rng.integers(1, 3000)),
            int(rng.integers(0, 4000)),
            int(rng.integers(1, 9)),
            bool(rng.integers(0, 2)),
        )
        for _ in range(300)
    ]
    for m, filled, cap, budget, factor, replace in cases:
        filled = int(rng.integers(0, cap + 1)) if filled is None else filled
        seed, step = int(rng.integers(0, 2**62)), int(rng.integers(1, 10**6))
        policy = CachePolicy(max(cap, 1) * 2, cap, admit_budget=budget, sample_factor=factor, seed=seed)
        policy.filled, policy.steps = filled, step
        want = policy._admission(m, replace)
        got = cache_kernels.cache_admission(
            m,
            filled=filled,
            capacity=cap,
            admit_budget=budget,
            sample_factor=factor,
            replace=replace,
            seed=seed,
            step=step,
        )
        assert Admission(**got) == want, (m, filled, cap, budget, factor, replace)
    with pytest.raises(EngramError, match="engram_cache_admission: need num_miss >= 0, 0 <= filled <= capacity"):
        cache_kernels.cache_admission(
            5, filled=11, capacity=10, admit_budget=1, sample_factor=1, replace=True, seed=0, step=1
        )


def test_the_whole_step_call_reads_its_arguments_where_the_library_puts_them(plugin_lib: Path) -> None:
    """engram_cache_step's structs as ctypes mirrors them: the library's sizes equal the
    mirrors', and the step's first checks (host code, before anything is enqueued) name
    the values set in the mirror's fields, so every field they name sits where the
    library reads it."""
    import ctypes as c

    from engram_trt.native import cache as ck

    ck._check_struct_sizes()
    lib = ck.library()

    def step(**fields) -> tuple[int, str, Any]:
        a = ck._StepArgs(
            max_ids=100,
            max_host_ids=50,
            plan_host=64,
            capacity=10,
            miss_base=10,
            work_num_rows=200,
            deliver_tokens=4,
            deliver_cols=3,
            num_ids=12,
            gatherer=64,
            work_rows=64,
        )
        for k, v in fields.items():
            setattr(a, k, v)
        r = ck._StepResult(hits=-7, num_miss=-7, num_free=-7, aborted=3)
        status = lib.engram_cache_step(c.byref(a), c.byref(r), None)
        return status, lib.engram_last_error().decode(), r

    status, why, r = step(num_ids=13)
    assert status == 1 and why == (
        "engram_cache_step: num_ids 13 must be deliver_tokens 4 x deliver_cols 3 and at most max_ids 100"
    )
    assert (r.hits, r.num_miss, r.num_free, r.aborted) == (0, 0, 0, 0)  # cleared before any check
    assert step(num_ids=120, deliver_tokens=40)[1].endswith("and at most max_ids 100")
    assert step(host_ids=51)[1] == "engram_cache_step: plan_host is required and host_ids must be in [0, 50] (got 51)"
    assert step(plan_host=None)[1].startswith("engram_cache_step: plan_host is required")
    assert step(max_host_ids=11, host_ids=5)[1] == (
        "engram_cache_step: plan_host holds 11 miss ids, fewer than the step's 12 lookups"
    )
    assert step(work_num_rows=21)[1] == (
        "engram_cache_step: the work table's 21 rows must hold the 10 cache slots and "
        "a miss area of num_ids = 12 rows from miss_base 10"
    )
    assert step(miss_base=9)[1].startswith("engram_cache_step: the work table's 200 rows must hold the 10 cache slots")
    assert step(ids_host=64)[1] == "engram_cache_step: ids_host needs ids_staging (device, max_ids int32)"
    assert step(gatherer=None)[1] == "engram_cache_step: the gatherer and the work table are required"
    assert step(work_rows=None)[1] == "engram_cache_step: the gatherer and the work table are required"
    for share in (1.5, -0.1, float("nan")):
        assert step(uva_share=share)[1].startswith("engram_cache_step: uva_share must be in [0, 1] and uva_blocks >= 0")
    assert step(uva_blocks=-1)[1] == "engram_cache_step: uva_share must be in [0, 1] and uva_blocks >= 0 (got 0, -1)"
    # past its own checks the step's first call is engram_cache_plan, which checks its own
    assert step(table_num_rows=0)[1].startswith("engram_cache_plan: table_num_rows must be in [1, 2^31 - 2]")
    assert lib.engram_cache_step(None, None, None) == 1


def test_cache_bindings_name_the_bad_argument() -> None:
    import torch

    from engram_trt.native import cache as cache_kernels

    with pytest.raises(EngramError, match="^ids must be a CUDA tensor"):
        cache_kernels.cache_plan(
            torch.zeros(4, dtype=torch.int32),
            table_rows=10,
            slot_of=None,
            counts=None,
            miss_base=0,
            plan=None,
            positions=None,
        )
    with pytest.raises(EngramError, match="^miss_rows must have dtype torch.int32"):
        cache_kernels.cache_admit(
            torch.zeros(4, dtype=torch.int64),
            num_free=0,
            filled=0,
            capacity=0,
            slot_of=None,
            row_of_slot=None,
            counts=None,
            miss_base=0,
        )


def test_the_gpu_check_harness_runs_here_with_the_reference_for_the_kernels() -> None:
    """tests/gpu/test_cache.py's policy comparison, its CPU part: every case through the
    reference standing in for the kernels (the GPU run swaps in the fused path)."""
    import importlib

    import torch

    mod = importlib.import_module("gpu.test_cache")
    results = [mod.compare_policy(torch.device("cpu"), ci, fused=False) for ci in range(len(mod.POLICY_CASES))]
    assert len(results) == len(mod.POLICY_CASES)
    assert all(ok for ok, _ in results), [detail for ok, detail in results if not ok]
    assert callable(mod.test_policies) and callable(mod.test_id_streams_cpu)


def test_bound_cache_calls_check_their_buffers_once_and_name_the_bad_one() -> None:
    """The plan, admission and delivery bound to a policy's buffers (cache_kernels.PlanCall,
    AdmitCall, DeliverCall) check them when bound, with the same messages as the plain
    calls, before anything reaches CUDA; table_key tells a work table from a view of it."""
    import torch

    from engram_trt.native import cache as cache_kernels

    cpu32 = torch.zeros(11, dtype=torch.int32)
    with pytest.raises(EngramError, match="^slot_of must be a CUDA tensor"):
        cache_kernels.PlanCall(table_rows=10, slot_of=cpu32, counts=cpu32, plan=cpu32, positions=cpu32, plan_host=None)
    with pytest.raises(EngramError, match="^slot_of must have dtype torch.int32"):
        cache_kernels.PlanCall(
            table_rows=10, slot_of=cpu32.long(), counts=None, plan=cpu32, positions=cpu32, plan_host=None
        )
    with pytest.raises(EngramError, match="^slot_of must be a CUDA tensor"):
        cache_kernels.AdmitCall(slot_of=cpu32, row_of_slot=cpu32, counts=cpu32)
    with pytest.raises(EngramError, match="^miss_rows must be a CUDA tensor"):
        cache_kernels.cache_admit(
            cpu32, num_free=0, filled=0, capacity=0, slot_of=cpu32, row_of_slot=cpu32, counts=cpu32, miss_base=0
        )
    rows = torch.zeros((8, 64), dtype=torch.uint8)
    with pytest.raises(EngramError, match="^an fp8 table needs scales"):
        cache_kernels.DeliverCall(rows, None, quant_block=32)
    with pytest.raises(EngramError, match=r"^scales must be \[rows, head_dim / quant_block\]"):
        cache_kernels.DeliverCall(rows, torch.zeros((8, 3), dtype=torch.uint8), quant_block=32)
    with pytest.raises(EngramError, match="^work_rows must be a CUDA tensor"):
        cache_kernels.DeliverCall(rows, torch.zeros((8, 2), dtype=torch.uint8), quant_block=32)
    key = cache_kernels.table_key(rows, None)
    assert key == cache_kernels.table_key(rows, None)
    assert key != cache_kernels.table_key(rows[:4], None)  # another size: bound anew
    assert key != cache_kernels.table_key(rows[1:], None)  # another start
    assert key != cache_kernels.table_key(rows.view(torch.int8), None)  # another dtype


def test_the_uva_share_a_step_call_binds(plugin_lib: Path) -> None:
    """StepCall's uva_share: the default only where it can run (an overlap, rows in an
    array of their own, a host table the GPU can read), an explicit share refused where
    it cannot, with the reason; bad numbers refused."""
    import torch

    from engram_trt.native import cache as ck

    rows, scales = torch.zeros(64, 256, dtype=torch.uint8), torch.zeros(64, 8, dtype=torch.uint8)
    assert ck._uva_share_for(None, 8, True, rows, scales, "split") == 0.0  # plain memory: no UVA by default
    assert ck._uva_share_for(0.0, 8, True, rows, scales, "split") == 0.0
    for args, words in (
        ((0.2, 8, True, rows, scales, "split"), "the GPU cannot read the host table: pin it"),
        ((0.2, 8, False, rows, scales, "split"), "it needs the overlap (overlap=True)"),
        ((0.2, 8, True, rows, None, "inline"), "layout 'inline' keeps rows and scales in one array"),
        ((1.5, 8, True, rows, scales, "split"), "uva_share must be a number in [0, 1]; got 1.5"),
        ((0.2, -1, True, rows, scales, "split"), "uva_blocks must be an integer >= 0"),
    ):
        with pytest.raises(EngramError, match=re.escape(words)):
            ck._uva_share_for(*args)
    header = (REPO / "plugins" / "kernels" / "cacheKernels.h").read_text()
    assert re.search(rf"#define ENGRAM_CACHE_UVA_MIN_MISSES {ck.UVA_MIN_MISSES}\b", header)  # the library's own
    assert 0.0 < ck.DEFAULT_UVA_SHARE <= 1.0 and ck.DEFAULT_UVA_BLOCKS > 0
