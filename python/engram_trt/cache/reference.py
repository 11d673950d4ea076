"""The hot-row cache policy's torch reference: one step (:func:`plan_reference`, then
:func:`finish_reference`) as torch operations on any device, over a
:class:`~engram_trt.cache.policy.CachePolicy`'s state.

Why it exists beside the fused kernels: it is the CPU path (tests, dry runs), and the
specification the GPU checks hold the kernels to, step by step and state by state
(``tests/gpu/test_cache.py``); sort-based ``torch.unique`` and plain indexing, so
each decision can be read off the code. Its decisions are the kernels': only the order
of a step's misses differs, and ``miss_order`` takes the kernels' order to reproduce
their state bit for bit.
"""

from __future__ import annotations

from typing import Any

from engram_trt.cache.plan import Admission, RowCopy, StepPlan
from engram_trt.errors import EngramError


def plan_reference(policy: Any, ids: Any, miss_base: int, miss_order: Any = None) -> StepPlan:
    """:meth:`CachePolicy.plan`'s reference: de-duplicate the ids (out-of-range ones as the
    sentinel row), count the lookups, resolve the distinct rows against the slot map and
    place the misses at ``miss_base`` onward, by ascending row or in ``miss_order``."""
    import torch

    flat = ids.reshape(-1).to(device=policy.device, dtype=torch.int64)
    n = int(flat.numel())
    valid = (flat >= 0) & (flat < policy.table_rows)
    mapped = torch.where(valid, flat, torch.full_like(flat, policy.sentinel))
    uniq, inverse, lookups = torch.unique(mapped, return_inverse=True, return_counts=True)
    policy.counts.index_add_(0, uniq, lookups.to(torch.int32))
    slot = policy.slot_of[uniq]
    miss_index = torch.nonzero(slot < 0).squeeze(1)
    num_miss = int(miss_index.numel())
    if miss_order is not None:
        miss_index = order_misses(policy, uniq, slot, num_miss, miss_order)
    slot[miss_index] = torch.arange(miss_base, miss_base + num_miss, dtype=torch.int32, device=policy.device)
    miss_rows = uniq[miss_index].to(torch.int32)
    return StepPlan(
        positions=slot[inverse].to(torch.int32),
        miss_rows=miss_rows,
        miss_rows_host=miss_rows.cpu(),
        miss_base=miss_base,
        num_lookups=n,
        num_unique=int(uniq.numel()),
        num_miss=num_miss,
    )


def order_misses(policy: Any, uniq: Any, slot: Any, num_miss: int, miss_order: Any) -> Any:
    """The misses' indices in ``uniq``, in the order of ``miss_order`` (which must be a
    permutation of the step's misses: an EngramError names it otherwise)."""
    import torch

    order = torch.as_tensor(miss_order).reshape(-1).to(device=policy.device, dtype=torch.int64)
    at = torch.searchsorted(uniq, order).clamp(max=max(int(uniq.numel()) - 1, 0))
    ok = int(order.numel()) == num_miss and (
        num_miss == 0
        or (
            bool((uniq[at] == order).all())
            and bool((slot[at] < 0).all())
            and int(torch.unique(order).numel()) == num_miss
        )
    )
    if not ok:
        raise EngramError(
            f"miss_order must be a permutation of the step's {num_miss} misses "
            f"(got {int(order.numel())} rows that are not)"
        )
    return at


def finish_reference(policy: Any, plan: StepPlan, adm: Admission) -> list[RowCopy]:
    """:meth:`CachePolicy.finish`'s reference admission on the policy's maps: misses take
    free slots, then each candidate replaces the coldest slot of its window if strictly
    hotter. Returns the row copies the work table needs (:func:`apply_copy`)."""
    import torch

    dev = policy.device
    copies: list[RowCopy] = []
    miss = plan.miss_rows.to(torch.int64)
    free = adm.num_free
    if free:
        slots = torch.arange(policy.filled, policy.filled + free, device=dev)
        rows = miss[:free]
        policy.slot_of[rows] = slots.to(torch.int32)
        policy.row_of_slot[slots] = rows.to(torch.int32)
        copies.append(RowCopy(dst=slots, src=plan.miss_base + torch.arange(free, device=dev)))
    budget = adm.num_candidates
    if budget:
        left = plan.num_miss - free
        pick = free + (adm.candidate_start + torch.arange(budget, device=dev) * adm.candidate_stride) % left
        cand_rows = miss[pick]
        factor = adm.sample_factor
        sample = ((adm.sample_first + torch.arange(budget * factor, device=dev)) % policy.capacity).view(budget, factor)
        sample_counts = policy.counts[policy.row_of_slot[sample].to(torch.int64)].to(torch.int64)
        # the coldest slot of each window, ties to the first (keys are distinct per window)
        which = (sample_counts * factor + torch.arange(factor, device=dev)).argmin(dim=1, keepdim=True)
        victims = sample.gather(1, which).squeeze(1)
        victim_counts = sample_counts.gather(1, which).squeeze(1)
        replace = policy.counts[cand_rows].to(torch.int64) > victim_counts  # strictly hotter than what it evicts
        old_rows = policy.row_of_slot[victims].to(torch.int64)
        policy.slot_of[old_rows[replace]] = -1
        policy.slot_of[cand_rows[replace]] = victims[replace].to(torch.int32)
        policy.row_of_slot[victims[replace]] = cand_rows[replace].to(torch.int32)
        policy._replaced += replace.sum()
        copies.append(RowCopy(dst=victims, src=plan.miss_base + pick, mask=replace))
    return copies


def apply_copy(copy: RowCopy, work_rows: Any, work_scales: Any) -> None:
    """Carry out a :class:`RowCopy` on the work table (rows and, if any, scale bytes)."""
    import torch

    for store in (work_rows, work_scales):
        if store is None:
            continue
        src = store[copy.src]
        if copy.mask is not None:
            src = torch.where(copy.mask[:, None], src, store[copy.dst])
        store[copy.dst] = src
