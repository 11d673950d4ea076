"""ctypes bindings to the hot-row cache's step on the GPU (``plugins/kernels/cacheKernel.cu``):
the fused plan and the admission that :class:`~engram_trt.cache.policy.CachePolicy` runs on
CUDA devices instead of its torch reference.

Why kernels: the reference plan (sort-based ``torch.unique``, slot lookup, miss list) is
60-70 small torch operations and three host synchronizations per step, 0.44 ms on the
H200 VM for a prefill chunk, about the whole budget of the cache's target; these are
two kernels and one synchronization (plan) and one call of at most four enqueued
operations (admission). The functions check dtypes, shapes and devices before anything
reaches the library (an EngramError names the bad argument) and enqueue on the current
CUDA stream. The entry points are declared here, on first use, so this module owns its
part of the C ABI (as :mod:`engram_trt.native.attention` does).
"""

from __future__ import annotations

import ctypes
from typing import Any

from engram_trt.errors import EngramError
from engram_trt.native.gather import call as gather_call
from engram_trt.native.gather import gather_out, table_code
from engram_trt.native.library import EntryPoints, check, device_guard, ptr, same_device, stream_of, torch_module

_i32, _i64, _u64, _vp = ctypes.c_int32, ctypes.c_int64, ctypes.c_uint64, ctypes.c_void_p


class _Admission(ctypes.Structure):
    """EngramCacheAdmission (engramKernels.h), field for field."""

    _fields_ = [
        ("num_free", _i64),
        ("num_candidates", _i64),
        ("candidate_start", _i64),
        ("candidate_stride", _i64),
        ("sample_first", _i64),
        ("sample_factor", _i32),
    ]


class _StepArgs(ctypes.Structure):
    """EngramCacheStepArgs (engramKernels.h), field for field."""

    _fields_ = [
        ("table_num_rows", _i64),
        ("slot_of", _vp),
        ("counts", _vp),
        ("row_of_slot", _vp),
        ("capacity", _i64),
        ("admit_budget", _i64),
        ("sample_factor", _i32),
        ("seed", _u64),
        ("plan", _vp),
        ("positions", _vp),
        ("plan_host", _vp),
        ("max_ids", _i64),
        ("max_host_ids", _i64),
        ("work_rows", _vp),
        ("work_scales", _vp),
        ("work_num_rows", _i64),
        ("row_bytes", _i64),
        ("scale_bytes", _i64),
        ("miss_base", _i64),
        ("head_dim", _i32),
        ("table_dtype", _i32),
        ("quant_block", _i32),
        ("table_layout", _i32),
        ("gatherer", _vp),
        ("rows_host", _vp),
        ("scales", _vp),
        ("replaced", _vp),
        ("overlap", _vp),
        ("uva_share", ctypes.c_float),
        ("uva_blocks", _i32),
        ("ids", _vp),
        ("ids_host", _vp),
        ("ids_staging", _vp),
        ("num_ids", _i64),
        ("deliver_tokens", _i64),
        ("deliver_cols", _i32),
        ("out", _vp),
        ("host_ids", _i64),
        ("filled", _i64),
        ("replace", _i32),
        ("step", _i64),
    ]


class _StepResult(ctypes.Structure):
    """EngramCacheStepResult (engramKernels.h), field for field."""

    _fields_ = [("hits", _i64), ("num_miss", _i64), ("num_free", _i64), ("aborted", _i32)]


_SIGS = {
    "engram_cache_plan": [_vp, _i64, _i64, _vp, _vp, _i64, _vp, _vp, _vp, _i64, _vp],
    "engram_cache_admit": [
        _vp,
        _i64,
        _i64,
        _i64,
        _i64,
        _vp,
        _vp,
        _vp,
        _i64,
        _i64,
        _i64,
        _i64,
        _i32,
        _i64,
        _vp,
        _i64,
        _vp,
        _i64,
        _vp,
        _vp,
    ],
    "engram_cache_admission": [_i64, _i64, _i64, _i64, _i32, _i32, _u64, _i64, ctypes.POINTER(_Admission)],
    "engram_cache_step": [ctypes.POINTER(_StepArgs), ctypes.POINTER(_StepResult), _vp],
    "engram_cache_step_sizes": [ctypes.POINTER(_i64), ctypes.POINTER(_i64), ctypes.POINTER(_i64)],
    "engram_cache_overlap_create": [ctypes.POINTER(_vp)],
    "engram_cache_overlap_destroy": [_vp],
}
_ENTRY = EntryPoints(_SIGS)
library = _ENTRY.library
_call = _ENTRY.call


def _check_plan_buffers(
    n: int,
    table_rows: int,
    slot_of: Any,
    counts: Any,
    plan: Any,
    positions: Any,
    plan_host: Any,
    host_ids: int,
    device: Any,
) -> None:
    """The plan's buffers, for steps of up to ``n`` lookups on ``device``."""
    torch = torch_module()
    for name, t, size in (
        ("slot_of", slot_of, table_rows + 1),
        ("counts", counts, table_rows + 1),
        ("plan", plan, 2 + n),
        ("positions", positions, n),
    ):
        if t is None and name == "counts":
            continue
        check(name, t, (torch.int32,), 1)
        if (t.shape[0] < size) if name in ("plan", "positions") else (t.shape[0] != size):
            want = f">= {size}" if name in ("plan", "positions") else str(size)
            raise EngramError(f"{name} must hold {want} int32 entries (got {t.shape[0]})")
    same_device(device, slot_of=slot_of, counts=counts, plan=plan, positions=positions)
    if plan_host is not None:
        check("plan_host", plan_host, (torch.int32,), 1, where="cpu")
        if plan_host.shape[0] < 2 + host_ids:
            raise EngramError(f"plan_host must hold >= {2 + host_ids} int32 entries (got {plan_host.shape[0]})")


def cache_plan(
    ids: Any,
    *,
    table_rows: int,
    slot_of: Any,
    counts: Any,
    miss_base: int,
    plan: Any,
    positions: Any,
    plan_host: Any = None,
    host_ids: int = 0,
) -> None:
    """Enqueue a step's plan (``engram_cache_plan``): ``ids`` CUDA int32 ``[n]``;
    ``slot_of`` / ``counts`` int32 ``[table_rows + 1]`` (counts may be None);
    ``plan`` int32 ``[>= 2 + n]``: hits, misses, then the miss rows; ``positions``
    int32 ``[>= n]``; ``plan_host``: None or a pinned CPU int32 tensor ``[>= 2 +
    host_ids]`` that receives the first ``2 + min(host_ids, n)`` entries of ``plan``.
    (:class:`PlanCall`: the same, its buffers checked once for every step.)"""
    torch = torch_module()
    check("ids", ids, (torch.int32,), 1)
    n = int(ids.shape[0])
    _check_plan_buffers(n, table_rows, slot_of, counts, plan, positions, plan_host, host_ids, ids.device)
    with device_guard(ids.device.index):
        _call(
            "engram_cache_plan",
            ptr(ids),
            n,
            int(table_rows),
            ptr(slot_of),
            ptr(counts),
            int(miss_base),
            ptr(plan),
            ptr(positions),
            ptr(plan_host),
            int(host_ids),
            stream_of(ids.device),
        )


class PlanCall:
    """:func:`cache_plan` bound to one policy's persistent buffers, checked once here:
    each step passes its ids, the miss base and the ids wanted on the host alone.

    Why: on the H200 VM a prefill chunk's plan is ~40 us of GPU work, and the host's
    part of the call (the buffers' checks, the device guard, the stream lookup) cost tens
    of microseconds more on the cache's critical path, every step, for buffers that never
    change (``bench cache --breakdown``'s unsynced timeline; docs/benchmarks.md)."""

    def __init__(
        self, *, table_rows: int, slot_of: Any, counts: Any, plan: Any, positions: Any, plan_host: Any
    ) -> None:
        check("slot_of", slot_of, (torch_module().int32,), 1)
        self.device = slot_of.device
        self.max_ids = min(int(plan.shape[0]) - 2, int(positions.shape[0]))
        self.max_host_ids = int(plan_host.shape[0]) - 2 if plan_host is not None else 0
        _check_plan_buffers(
            self.max_ids, table_rows, slot_of, counts, plan, positions, plan_host, self.max_host_ids, self.device
        )
        self._keep = (slot_of, counts, plan, positions, plan_host)  # the pointers below stay valid
        self._table_rows = int(table_rows)
        self._ptrs = (ptr(slot_of), ptr(counts), ptr(plan), ptr(positions), ptr(plan_host))

    def __call__(self, ids: Any, *, miss_base: int, host_ids: int) -> None:
        torch = torch_module()
        check("ids", ids, (torch.int32,), 1)
        n = int(ids.shape[0])
        if n > self.max_ids or ids.device != self.device or not 0 <= host_ids <= self.max_host_ids:
            raise EngramError(
                f"a plan of {n} ids on {ids.device}, {host_ids} to the host: this call's buffers take "
                f"<= {self.max_ids} ids on {self.device}, <= {self.max_host_ids} to the host"
            )
        slot_of, counts, plan, positions, plan_host = self._ptrs
        with device_guard(self.device.index):
            _call(
                "engram_cache_plan",
                ptr(ids),
                n,
                self._table_rows,
                slot_of,
                counts,
                int(miss_base),
                plan,
                positions,
                plan_host,
                int(host_ids),
                stream_of(self.device),
            )


def _check_admit_buffers(
    device: Any, slot_of: Any, row_of_slot: Any, counts: Any, work_rows: Any, work_scales: Any, replaced: Any
) -> tuple[int, int]:
    """The admission's maps and work table; returns (row bytes, scale bytes) of its rows."""
    torch = torch_module()
    for name, t in (("slot_of", slot_of), ("row_of_slot", row_of_slot), ("counts", counts)):
        check(name, t, (torch.int32,), 1)
    row_bytes = scale_bytes = 0
    if work_rows is not None:
        check("work_rows", work_rows, (torch.uint8, torch.bfloat16), 2)
        row_bytes = work_rows.shape[1] * work_rows.element_size()
        if work_scales is not None:
            check("work_scales", work_scales, (torch.uint8,), 2)
            if work_scales.shape[0] != work_rows.shape[0]:
                raise EngramError(
                    f"work_scales must have work_rows' {work_rows.shape[0]} rows (got {work_scales.shape[0]})"
                )
            scale_bytes = work_scales.shape[1]
    if replaced is not None:
        check("replaced", replaced, (torch.int64,), 1)
    same_device(
        device,
        slot_of=slot_of,
        row_of_slot=row_of_slot,
        counts=counts,
        work_rows=work_rows,
        work_scales=work_scales,
        replaced=replaced,
    )
    return row_bytes, scale_bytes


def cache_admit(
    miss_rows: Any,
    *,
    num_free: int,
    filled: int,
    capacity: int,
    slot_of: Any,
    row_of_slot: Any,
    counts: Any,
    num_candidates: int = 0,
    candidate_start: int = 0,
    candidate_stride: int = 1,
    sample_first: int = 0,
    sample_factor: int = 1,
    miss_base: int,
    work_rows: Any = None,
    work_scales: Any = None,
    replaced: Any = None,
) -> None:
    """Enqueue a step's admission (``engram_cache_admit``; the arguments' meaning is in
    ``engramKernels.h``): ``miss_rows`` CUDA int32 ``[M]`` (the plan's miss list);
    ``work_rows`` / ``work_scales``: the work table (2-D, rows copied whole) or None;
    ``replaced``: None or a CUDA int64 ``[1]`` counter of replacements. (:class:`AdmitCall`:
    the same, its maps and work table checked once for every step.)"""
    check("miss_rows", miss_rows, (torch_module().int32,), 1)  # named first, before the maps
    AdmitCall(
        slot_of=slot_of,
        row_of_slot=row_of_slot,
        counts=counts,
        work_rows=work_rows,
        work_scales=work_scales,
        replaced=replaced,
        device=getattr(miss_rows, "device", None),
    )(
        miss_rows,
        num_free=num_free,
        filled=filled,
        capacity=capacity,
        num_candidates=num_candidates,
        candidate_start=candidate_start,
        candidate_stride=candidate_stride,
        sample_first=sample_first,
        sample_factor=sample_factor,
        miss_base=miss_base,
    )


class AdmitCall:
    """:func:`cache_admit` bound to one policy's maps and one work table, checked once
    here (as :class:`PlanCall`, and for the same reason): each step passes its miss list
    and the admission's numbers alone. ``device``: where the maps must be (default: the
    slot map's)."""

    def __init__(
        self,
        *,
        slot_of: Any,
        row_of_slot: Any,
        counts: Any,
        work_rows: Any = None,
        work_scales: Any = None,
        replaced: Any = None,
        device: Any = None,
    ) -> None:
        check("slot_of", slot_of, (torch_module().int32,), 1)
        self.device = slot_of.device if device is None else device
        self._row_bytes, self._scale_bytes = _check_admit_buffers(
            self.device, slot_of, row_of_slot, counts, work_rows, work_scales, replaced
        )
        self.work_rows_count = int(work_rows.shape[0]) if work_rows is not None else None
        self.key = table_key(work_rows, work_scales)  # the work table it is bound to
        self._keep = (slot_of, row_of_slot, counts, work_rows, work_scales, replaced)
        self._ptrs = (ptr(slot_of), ptr(row_of_slot), ptr(counts), ptr(work_rows), ptr(work_scales), ptr(replaced))

    def __call__(
        self,
        miss_rows: Any,
        *,
        num_free: int,
        filled: int,
        capacity: int,
        num_candidates: int = 0,
        candidate_start: int = 0,
        candidate_stride: int = 1,
        sample_first: int = 0,
        sample_factor: int = 1,
        miss_base: int,
    ) -> None:
        torch = torch_module()
        check("miss_rows", miss_rows, (torch.int32,), 1)
        if miss_rows.device != self.device:
            raise EngramError(f"miss_rows is on {miss_rows.device} but the operation runs on {self.device}")
        m = int(miss_rows.shape[0])
        if self.work_rows_count is not None and self.work_rows_count < miss_base + m:
            raise EngramError(
                f"work_rows must hold miss_base + num_miss = {miss_base + m} rows (got {self.work_rows_count})"
            )
        slot_of, row_of_slot, counts, work_rows, work_scales, replaced = self._ptrs
        with device_guard(self.device.index):
            _call(
                "engram_cache_admit",
                ptr(miss_rows),
                m,
                int(num_free),
                int(filled),
                int(capacity),
                slot_of,
                row_of_slot,
                counts,
                int(num_candidates),
                int(candidate_start),
                int(candidate_stride),
                int(sample_first),
                int(sample_factor),
                int(miss_base),
                work_rows,
                self._row_bytes,
                work_scales,
                self._scale_bytes,
                replaced,
                stream_of(self.device),
            )


class DeliverCall:
    """The gather kernel (``engram_gather``) bound to a cache's work table, checked once
    here: each step's delivery passes its positions ``[T, cols]`` (CUDA int32, rows of
    the work table) and ``out`` (bf16 ``[T, cols, head_dim]``, or None for a new one).
    The same kernel and output as :func:`engram_trt.native.gather.gather`; bound for the same
    reason as :class:`PlanCall` (the delivery is ~45 us of GPU work for a prefill chunk)."""

    def __init__(self, work_rows: Any, work_scales: Any, *, quant_block: int) -> None:
        self.dtype, self.num_rows, self.head_dim = table_code(work_rows, work_scales, quant_block)
        check("work_rows", work_rows, (work_rows.dtype,), 2)  # on the GPU, contiguous
        self.device = work_rows.device
        same_device(self.device, work_scales=work_scales)
        self.key = table_key(work_rows, work_scales)
        self._keep = (work_rows, work_scales)
        self._table = (ptr(work_rows), ptr(work_scales), self.num_rows, self.head_dim, self.dtype, int(quant_block))

    def __call__(self, positions: Any, out: Any = None) -> Any:
        torch = torch_module()
        check("positions", positions, (torch.int32,), 2)
        T, cols = (int(x) for x in positions.shape)
        if positions.device != self.device:
            raise EngramError(f"positions is on {positions.device} but the work table on {self.device}")
        out = gather_out(out, T, cols, self.head_dim, self.device)
        with device_guard(self.device.index):
            gather_call(
                "engram_gather", ptr(positions), T, cols, cols, *self._table, ptr(out), None, stream_of(self.device)
            )
        return out


def table_key(*tensors: Any) -> tuple:
    """What identifies a bound call's tensors: where each starts, its shape and dtype (a
    view of other memory, or of another size, is another table)."""
    return tuple(None if t is None else (t.data_ptr(), tuple(t.shape), t.dtype) for t in tensors)


def cache_admission(
    num_miss: int,
    *,
    filled: int,
    capacity: int,
    admit_budget: int,
    sample_factor: int,
    replace: bool,
    seed: int,
    step: int,
) -> dict[str, int]:
    """The library's admission numbers of a step (``engram_cache_admission``: what
    :meth:`engram_trt.cache.policy.CachePolicy._admission` computes in Python, and what
    :class:`StepCall` admits by), as a dict of the Admission's fields."""
    got = _Admission()
    _call(
        "engram_cache_admission",
        int(num_miss),
        int(filled),
        int(capacity),
        int(admit_budget),
        int(sample_factor),
        int(bool(replace)),
        int(seed),
        int(step),
        ctypes.byref(got),
    )
    return {name: int(getattr(got, name)) for name, _ in _Admission._fields_}


def _check_struct_sizes() -> None:
    """The ctypes mirrors of the step's structs against the library's own sizes: a field
    added on one side only would make the step read its arguments at wrong offsets."""
    sizes = [_i64(0), _i64(0), _i64(0)]
    _call("engram_cache_step_sizes", *(ctypes.byref(v) for v in sizes))
    mine = (ctypes.sizeof(_StepArgs), ctypes.sizeof(_StepResult), ctypes.sizeof(_Admission))
    theirs = tuple(int(v.value) for v in sizes)
    if mine != theirs:
        raise EngramError(
            f"the library's cache step structs are {theirs} bytes (args, result, admission), these "
            f"bindings' {mine}: the package and libengram_trt_plugins.so are of different versions"
        )


# A share of a large step's misses read through UVA beside the host gather (StepCall), and
# that read's grid: measured on the H200 VM (docs/benchmarks.md, "a share of the misses
# through UVA"); UVA_MIN_MISSES is the library's ENGRAM_CACHE_UVA_MIN_MISSES.
DEFAULT_UVA_SHARE = 0.15
DEFAULT_UVA_BLOCKS = 16
UVA_MIN_MISSES = 8192


def _uva_share_for(share: float | None, blocks: int, overlap: bool, rows_host: Any, scales: Any, layout: str) -> float:
    """The UVA share a step call binds: ``share`` checked, or the default where it can run."""
    from engram_trt.native.library import pointer_kind

    if type(blocks) is not int or blocks < 0:
        raise EngramError(f"uva_blocks must be an integer >= 0 (0: one full wave); got {blocks!r}")
    if share is not None and not (isinstance(share, (int, float)) and 0.0 <= share <= 1.0):
        raise EngramError(f"uva_share must be a number in [0, 1]; got {share!r}")
    if share == 0:
        return 0.0
    # the arrays the GPU would read: rows, and a split fp8 table's scales (a float table has none)
    tables = [rows_host] + ([scales] if layout == "split" and scales is not None else [])
    try:
        readable = all(t.device.type == "cpu" and pointer_kind(t) == "host" for t in tables)
    except EngramError:  # no CUDA driver to ask: nothing the GPU could read either
        readable = False
    why = (
        "it needs the overlap (overlap=True)"
        if not overlap
        else f"layout {layout!r} keeps rows and scales in one array"
        if layout not in ("split", "hbm-scales")
        else "the GPU cannot read the host table: pin it or register it (native.library.register_host_memory)"
        if not readable
        else ""
    )
    if share is None:
        return 0.0 if why else DEFAULT_UVA_SHARE
    if why:
        raise EngramError(f"uva_share={share} reads misses through UVA, but {why}")
    return float(share)


class StepCall:
    """A hot-row cache's whole step in one library call (``engram_cache_step``): plan,
    wake, wait, fetch, delivery and admission, bound to one cache's policy buffers, work
    table, host gatherer and host table, all checked once here. Each step passes its ids
    (int32, contiguous: on the cache's device, or in host memory, which the call copies
    into the policy's staging buffer itself, pinned for an asynchronous copy), the
    delivery's ``[T, cols]`` and ``out`` (bf16 ``[T, cols, head_dim]`` on the device,
    checked by the caller) and the policy's numbers.

    Why: the same calls made from Python (:class:`PlanCall`, the host gather,
    :class:`DeliverCall`, :class:`AdmitCall`) spend ~150 us of interpreter time between
    them on the H200 VM, with the GPU idle: more than the GPU work of the plan, the
    delivery and the admission together (``bench cache --host-trace``).

    ``overlap`` (default): the library's overlap stream and event for this cache
    (``engram_cache_overlap_create``), so a step delivers the lookups of cached rows
    while the host gathers the misses, and the misses' lookups after the fetch. Why: on
    the H200 VM a prefill chunk's delivery is ~45 us of GPU work that waited for a
    fetch of ~300 us in which the GPU only copies; ~80% of it is the hits'. False: the
    whole delivery after the fetch (A/B runs). Close the call (:meth:`close`) after the
    cache's last step; the overlap is released with it.

    ``uva_share`` (with the overlap; split and hbm-scales layouts): the share of a step's
    misses, once there are at least ``UVA_MIN_MISSES``, that the GPU reads itself through
    UVA on ``uva_blocks`` blocks while the host gather fetches the rest. Why: the host
    gather is bound by its threads' random reads, the GPU's reads of host memory by the
    host's address translations, two different limits (``bench gather --paths split``:
    a cold 196,608-row lookup 6-20% faster with 15-20% of it through UVA on 8 blocks on
    slower hosts, 5-36% slower on the fastest one seen; a cache step, whose misses are a
    fifth of that, 0-9% faster with 15% of them on 16 blocks and 20-27% slower with 30%,
    docs/benchmarks.md). The share is a constant, not calibrated per machine. None:
    ``DEFAULT_UVA_SHARE`` where the GPU can read the host table (pinned or registered),
    else 0; a share asked for explicitly on a table the GPU cannot read is refused."""

    def __init__(
        self,
        *,
        policy: Any,
        work_rows: Any,
        work_scales: Any,
        miss_base: int,
        gatherer: Any,
        rows_host: Any,
        scales: Any,
        quant_block: int,
        layout: str,
        overlap: bool = True,
        uva_share: float | None = None,
        uva_blocks: int = DEFAULT_UVA_BLOCKS,
    ) -> None:
        _check_struct_sizes()
        self.uva_share = _uva_share_for(uva_share, uva_blocks, overlap, rows_host, scales, layout)
        dtype, num_rows, head_dim, layout_code = gatherer._check_host_table(rows_host, scales, quant_block, layout)
        if num_rows != policy.table_rows:
            raise EngramError(f"the host table has {num_rows} rows, the cache's policy {policy.table_rows}")
        row_bytes, scale_bytes = _check_admit_buffers(
            policy.device, policy.slot_of, policy.row_of_slot, policy.counts, work_rows, work_scales, policy._replaced
        )
        self.device, self.gatherer = policy.device, gatherer
        self._keep = (
            policy.slot_of,
            policy.counts,
            policy.row_of_slot,
            policy._plan,
            policy._positions,
            policy._plan_host,
            work_rows,
            work_scales,
            rows_host,
            scales,
            policy._replaced,
        )
        a = self._args = _StepArgs()
        a.table_num_rows, a.capacity = policy.table_rows, policy.capacity
        a.slot_of, a.counts, a.row_of_slot = (t.data_ptr() for t in (policy.slot_of, policy.counts, policy.row_of_slot))
        a.admit_budget, a.sample_factor, a.seed = policy.admit_budget, policy.sample_factor, policy.seed
        a.plan, a.positions, a.plan_host = (t.data_ptr() for t in (policy._plan, policy._positions, policy._plan_host))
        a.max_ids = min(int(policy._plan.shape[0]) - 2, int(policy._positions.shape[0]))
        a.max_host_ids = int(policy._plan_host.shape[0]) - 2
        a.work_rows = work_rows.data_ptr()
        a.work_scales = work_scales.data_ptr() if work_scales is not None else None
        a.work_num_rows, a.row_bytes, a.scale_bytes = int(work_rows.shape[0]), row_bytes, scale_bytes
        a.miss_base, a.head_dim, a.table_dtype = int(miss_base), head_dim, dtype
        a.quant_block, a.table_layout = int(quant_block), layout_code
        a.rows_host = rows_host.data_ptr()
        a.scales = scales.data_ptr() if scales is not None else None
        a.replaced = policy._replaced.data_ptr()
        a.ids_staging = policy._ids.data_ptr()
        self._overlap: int | None = None
        self._closed = False
        if overlap:
            handle = ctypes.c_void_p()
            with device_guard(self.device.index):  # the overlap's stream lives on the cache's device
                _call("engram_cache_overlap_create", ctypes.byref(handle))
            self._overlap = a.overlap = handle.value
        a.uva_share, a.uva_blocks = self.uva_share, int(uva_blocks)
        self._result = _StepResult()
        self._refs = (ctypes.byref(self._args), ctypes.byref(self._result))

    @property
    def overlaps(self) -> bool:
        """Whether steps deliver their hits during the fetch (the overlap is bound)."""
        return self._overlap is not None

    def close(self) -> None:
        """Release the overlap's stream and event (idempotent); a later step raises."""
        handle, self._overlap = self._overlap, None
        self._args.overlap = None
        self._closed = True
        if handle is not None:
            with device_guard(self.device.index):
                _call("engram_cache_overlap_destroy", handle)

    def __del__(self) -> None:
        if not hasattr(self, "_closed"):  # __init__ failed before the overlap
            return
        try:
            self.close()
        except Exception:  # interpreter shutdown or a dead device: nothing left to order
            pass

    def __call__(
        self, ids: Any, tokens: int, cols: int, out: Any, *, host_ids: int, filled: int, replace: bool, step: int
    ) -> tuple[int, int, int, bool, str | None]:
        """Run one step; returns (hits, num_miss, num_free, aborted, error): ``error`` is
        the library's reason when the step failed (the caller raises it after its own
        bookkeeping; ``aborted``: the step was ended with nothing admitted)."""
        a = self._args
        if self._closed:
            raise EngramError("this cache's step call was closed (HotRowCache.close()); make a new cache")
        a.gatherer = self.gatherer._require_open()  # a closed gatherer is refused, never read
        if ids.is_cuda:
            a.ids, a.ids_host = ids.data_ptr(), None
        else:
            a.ids, a.ids_host = None, ids.data_ptr()
        a.num_ids, a.deliver_tokens, a.deliver_cols = tokens * cols, tokens, cols
        a.out, a.host_ids, a.filled, a.replace, a.step = out.data_ptr(), host_ids, filled, int(replace), step
        error = None
        try:
            with device_guard(self.device.index):
                _call("engram_cache_step", *self._refs, stream_of(self.device))
        except EngramError as e:  # the result still says how far the step got
            error = str(e)
        r = self._result
        return int(r.hits), int(r.num_miss), int(r.num_free), bool(r.aborted), error
