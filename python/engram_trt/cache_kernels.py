"""ctypes bindings to the hot-row cache's step on the GPU (``plugins/kernels/cacheKernel.cu``):
the fused plan and the admission that :class:`~engram_trt.cachepolicy.CachePolicy` runs on
CUDA devices instead of its torch reference.

Why kernels: the reference plan (sort-based ``torch.unique``, slot lookup, miss list) is
60-70 small torch operations and three host synchronizations per step, 0.44 ms on the
H200 VM for a prefill chunk, about the whole budget of the cache's target; these are
two kernels and one synchronization (plan) and one call of at most four enqueued
operations (admission). The functions check dtypes, shapes and devices before anything
reaches the library (an EngramError names the bad argument) and enqueue on the current
CUDA stream. The entry points are declared here, on first use, so this module owns its
part of the C ABI (as :mod:`engram_trt.attention_kernels` does).
"""

from __future__ import annotations

import ctypes
from typing import Any

from engram_trt.errors import EngramError
from engram_trt.kernels import EntryPoints, _check, _ptr, _same_device, _stream, _torch

_i32, _i64, _vp = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
_SIGS = {
    "engram_cache_plan": [_vp, _i64, _i64, _vp, _vp, _i64, _vp, _vp, _vp, _i64, _vp],
    "engram_cache_admit": [_vp, _i64, _i64, _i64, _i64, _vp, _vp, _vp, _i64, _i64, _i64, _i64, _i32, _i64, _vp, _i64,
                           _vp, _i64, _vp, _vp],
}
_ENTRY = EntryPoints(_SIGS)
_library = _ENTRY.library
_call = _ENTRY.call


def cache_plan(ids: Any, *, table_rows: int, slot_of: Any, counts: Any, miss_base: int, plan: Any, positions: Any,
               plan_host: Any = None, host_ids: int = 0) -> None:
    """Enqueue a step's plan (``engram_cache_plan``): ``ids`` CUDA int32 ``[n]``;
    ``slot_of`` / ``counts`` int32 ``[table_rows + 1]`` (counts may be None);
    ``plan`` int32 ``[>= 2 + n]``: hits, misses, then the miss rows; ``positions``
    int32 ``[>= n]``; ``plan_host``: None or a pinned CPU int32 tensor ``[>= 2 +
    host_ids]`` that receives the first ``2 + min(host_ids, n)`` entries of ``plan``."""
    torch = _torch()
    _check("ids", ids, (torch.int32,), 1)
    n = int(ids.shape[0])
    for name, t, size in (("slot_of", slot_of, table_rows + 1), ("counts", counts, table_rows + 1),
                          ("plan", plan, 2 + n), ("positions", positions, n)):
        if t is None and name == "counts":
            continue
        _check(name, t, (torch.int32,), 1)
        if (t.shape[0] < size) if name in ("plan", "positions") else (t.shape[0] != size):
            want = f">= {size}" if name in ("plan", "positions") else str(size)
            raise EngramError(f"{name} must hold {want} int32 entries (got {t.shape[0]})")
    _same_device(ids.device, slot_of=slot_of, counts=counts, plan=plan, positions=positions)
    if plan_host is not None:
        _check("plan_host", plan_host, (torch.int32,), 1, where="cpu")
        if plan_host.shape[0] < 2 + host_ids:
            raise EngramError(f"plan_host must hold >= {2 + host_ids} int32 entries (got {plan_host.shape[0]})")
    with torch.cuda.device(ids.device):
        _call("engram_cache_plan", _ptr(ids), n, int(table_rows), _ptr(slot_of), _ptr(counts), int(miss_base),
              _ptr(plan), _ptr(positions), _ptr(plan_host), int(host_ids), _stream(ids.device))


def cache_admit(miss_rows: Any, *, num_free: int, filled: int, capacity: int, slot_of: Any, row_of_slot: Any,
                counts: Any, num_candidates: int = 0, candidate_start: int = 0, candidate_stride: int = 1,
                sample_first: int = 0, sample_factor: int = 1, miss_base: int, work_rows: Any = None,
                work_scales: Any = None, replaced: Any = None) -> None:
    """Enqueue a step's admission (``engram_cache_admit``; the arguments' meaning is in
    ``engramKernels.h``): ``miss_rows`` CUDA int32 ``[M]`` (the plan's miss list);
    ``work_rows`` / ``work_scales``: the work table (2-D, rows copied whole) or None;
    ``replaced``: None or a CUDA int64 ``[1]`` counter of replacements."""
    torch = _torch()
    _check("miss_rows", miss_rows, (torch.int32,), 1)
    dev = miss_rows.device
    for name, t in (("slot_of", slot_of), ("row_of_slot", row_of_slot), ("counts", counts)):
        _check(name, t, (torch.int32,), 1)
    row_bytes = scale_bytes = 0
    if work_rows is not None:
        _check("work_rows", work_rows, (torch.uint8, torch.bfloat16), 2)
        row_bytes = work_rows.shape[1] * work_rows.element_size()
        if work_scales is not None:
            _check("work_scales", work_scales, (torch.uint8,), 2)
            if work_scales.shape[0] != work_rows.shape[0]:
                raise EngramError(f"work_scales must have work_rows' {work_rows.shape[0]} rows "
                                  f"(got {work_scales.shape[0]})")
            scale_bytes = work_scales.shape[1]
        if work_rows.shape[0] < miss_base + miss_rows.shape[0]:
            raise EngramError(f"work_rows must hold miss_base + num_miss = {miss_base + miss_rows.shape[0]} rows "
                              f"(got {work_rows.shape[0]})")
    if replaced is not None:
        _check("replaced", replaced, (torch.int64,), 1)
    _same_device(dev, slot_of=slot_of, row_of_slot=row_of_slot, counts=counts, work_rows=work_rows,
                 work_scales=work_scales, replaced=replaced)
    with torch.cuda.device(dev):
        _call("engram_cache_admit", _ptr(miss_rows), int(miss_rows.shape[0]), int(num_free), int(filled),
              int(capacity), _ptr(slot_of), _ptr(row_of_slot), _ptr(counts), int(num_candidates),
              int(candidate_start), int(candidate_stride), int(sample_first), int(sample_factor), int(miss_base),
              _ptr(work_rows), row_bytes, _ptr(work_scales), scale_bytes, _ptr(replaced), _stream(dev))
