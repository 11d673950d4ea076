"""The hot-row cache's policy: which rows are cached, in which slot, and what a step
fetches; no row data (that is :class:`engram_trt.cache.hotcache.HotRowCache`).

Two implementations of one step, with the same state (int32 tensors on the policy's
device: ``slot_of [table_rows + 1]``, ``row_of_slot [capacity]``, ``counts [table_rows
+ 1]``) and the same decisions:

- the reference (:mod:`engram_trt.cache.reference`): torch operations on any device,
  sort-based ``torch.unique``; the CPU path, the tests, and the reference the GPU checks
  compare the kernels with;
- the fused one (CUDA devices, ``fused=True``, the default there): the kernels of
  :mod:`engram_trt.native.cache`, one synchronization per step (the miss count read
  with the miss ids in one copy) instead of three, and about four launches instead of
  60-70 torch operations.

Only the order of a step's misses differs: the reference lists them by ascending row,
the kernels in whatever order their atomics ran. Every decision downstream is a
function of that order (which miss takes which free slot, which misses are replacement
candidates), so :meth:`CachePolicy.plan` takes ``miss_order=`` on the reference path:
given the kernels' order it reproduces their positions and, after :meth:`finish`,
their whole state bit for bit (``tests/gpu/test_cache.py`` runs that
comparison). Delivered rows never depend on it: every lookup's position names a
work-table row that holds its row.

A step is :meth:`plan` (de-duplicate, count the lookups, resolve slots, list the misses
and give every lookup its work-table row: a slot, or ``miss_base + j`` for miss ``j``)
then, after the caller fetched the misses into the miss area and delivered the rows,
:meth:`finish` (age the counts, admit). Between the two the fused path's slot map holds
the misses' codes, so every plan must be finished (or :meth:`abort`-ed) before the next.

Admission, bounded and free of host syncs: misses take free slots as they come; once
the cache is full, up to ``admit_budget`` misses (spread evenly over them from a random
offset) each meet the coldest of ``sample_factor`` cached slots (a sampled LFU, in the
manner of TinyLFU's admission) and replace it only if their count is strictly higher.
The two random offsets of a step are counter-based draws (:func:`admission_draw`: a
function of the seed and the step's number, no generator state), so the library's
whole-step call (``engram_cache_step``) draws the same ones as this module's reference.
A warm start (:meth:`warm_start`) seeds the counts with offline frequencies and loads
the most frequent rows, so the cache serves rows the online LFU has not seen yet.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import numpy as np

from engram_trt.cache.plan import Admission, RowCopy, StepPlan  # noqa: F401  (the policy's API)
from engram_trt.errors import EngramError

log = logging.getLogger(__name__)

MAX_STEP_ROWS = 196608  # an 8k-token prefill chunk of 24 columns
# Replacements tried per step once the cache is full. More raise the online hit rate (on
# 8k-token chunks of real text, a 5% cache of a 50M-row layer: 39.9% at 8192 every 4th
# step, 48.7% at 32768 every step; scripts/cache_policy_sweep.py), but on the H200 the
# larger admission cost about as much GPU time as its fewer misses saved in the fetch
# (docs/benchmarks.md), so the default stays.
DEFAULT_ADMIT_BUDGET = 8192
MAX_SLOTS = (1 << 30) - 1  # the kernels' slot codes keep bit 30 for the hit mark
INT32_MAX = (1 << 31) - 1


_U64 = (1 << 64) - 1


def admission_draw(seed: int, step: int, k: int) -> int:
    """Draw ``k`` (0: the candidates' start, 1: the victims' first slot) of step number
    ``step``: splitmix64's output function over the counter ``seed + (2 step + k) x
    0x9E3779B97F4A7C15`` (mod 2^64), as ``engram_cache_admission`` computes it. Why a
    counter and not a generator: the step's draws must be the same whichever side
    admits (this module's reference, the Python step, the library's whole-step call),
    and a generator's state would have to travel between them."""
    z = (seed + (2 * step + k) * 0x9E3779B97F4A7C15) & _U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    return z ^ (z >> 31)


def top_rows(counts: np.ndarray, k: int) -> np.ndarray:
    """The ``k`` most frequent rows with a nonzero count (int32, by count descending,
    ties to the lower row id): what a warm start loads, in slot order. An
    ``argpartition``, not a sort of the whole table (50M rows per layer here)."""
    counts = np.asarray(counts)
    k = min(int(k), int(np.count_nonzero(counts)))
    if k <= 0:
        return np.zeros(0, dtype=np.int32)
    wide = counts.astype(np.int64, copy=False)
    kth = int(wide[np.argpartition(-wide, k - 1)[:k]].min()) if k < wide.size else int(wide.min())
    above = np.flatnonzero(wide > kth)
    tied = np.flatnonzero(wide == kth)[: k - above.size]
    rows = np.concatenate([above, tied])
    return rows[np.lexsort((rows, -wide[rows]))].astype(np.int32)


class CachePolicy:
    """Which rows are cached, in which slot, and which to fetch; no row data.

    Memory on the device: 8 bytes per table row (int32 slot map and int32 counts) plus 4
    per cache slot (and, fused, 16 bytes per lookup of a step for the plan's buffers);
    for a 50M-row table layer that is 400 MB beside a 5% cache of 664 MB. The plan needs
    no stamp array: its per-step marks live in the slot map (``cacheKernel.cu``).
    """

    def __init__(
        self,
        table_rows: int,
        capacity_rows: int,
        *,
        device: Any = "cpu",
        admit_budget: int | None = None,
        sample_factor: int = 4,
        decay_every: int = 0,
        seed: int = 0,
        fused: bool | None = None,
        max_step_rows: int = MAX_STEP_ROWS,
        initial_counts: Any = None,
    ) -> None:
        import torch

        if table_rows < 1 or not 0 <= capacity_rows <= table_rows:
            raise EngramError(f"cache capacity must be in [0, table_rows={table_rows}] rows (got {capacity_rows})")
        if table_rows >= INT32_MAX or capacity_rows > MAX_SLOTS:
            raise EngramError(
                f"table_rows must be below 2^31 - 1 and the capacity at most 2^30 - 1 rows "
                f"(got {table_rows}, {capacity_rows})"
            )
        if sample_factor < 1 or decay_every < 0:
            raise EngramError(f"sample_factor must be >= 1 and decay_every >= 0 (got {sample_factor}, {decay_every})")
        if max_step_rows < 1:
            raise EngramError(f"max_step_rows must be >= 1 (got {max_step_rows})")
        if not 0 <= seed <= _U64:
            raise EngramError(f"seed must be in [0, 2^64) (got {seed})")
        self.table_rows = int(table_rows)
        self.capacity = int(capacity_rows)
        self.sentinel = self.table_rows
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.fused = self.device.type == "cuda" if fused is None else bool(fused)
        if self.fused and self.device.type != "cuda":
            raise EngramError(f"the fused cache plan runs on CUDA devices (got {self.device}); pass fused=False")
        self.max_step_rows = int(max_step_rows)
        self.slot_of = torch.full((self.table_rows + 1,), -1, dtype=torch.int32, device=self.device)
        self.row_of_slot = torch.full((max(self.capacity, 1),), -1, dtype=torch.int32, device=self.device)
        self.counts = torch.zeros(self.table_rows + 1, dtype=torch.int32, device=self.device)
        if admit_budget is None:
            admit_budget = min(self.capacity, DEFAULT_ADMIT_BUDGET)
        if admit_budget < 0:
            raise EngramError(f"admit_budget must be >= 0 (got {admit_budget})")
        self.admit_budget = int(admit_budget)
        self.sample_factor = int(sample_factor)
        self.decay_every = int(decay_every)
        self.filled = 0
        self.steps = 0
        self.admitted = 0  # rows admitted into free slots (replacements are counted on the device)
        self.preloaded = 0  # rows a warm start loaded
        self._replaced = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.seed = int(seed)
        self._pending: StepPlan | None = None
        if self.fused:
            n = self.max_step_rows
            self._ids = torch.empty(n, dtype=torch.int32, device=self.device)
            self._plan = torch.zeros(2 + n, dtype=torch.int32, device=self.device)
            self._positions = torch.empty(n, dtype=torch.int32, device=self.device)
            self._plan_host = torch.zeros(2 + n, dtype=torch.int32, pin_memory=True)
            self._plan_host_np = self._plan_host.numpy()
            self._expect_misses = n  # misses copied with the counts; then 1.5x the last step's
            from engram_trt.native.cache import PlanCall

            # The plan and admission calls bound to these buffers: checked once, not every step.
            self._plan_call = PlanCall(
                table_rows=self.table_rows,
                slot_of=self.slot_of,
                counts=self.counts,
                plan=self._plan,
                positions=self._positions,
                plan_host=self._plan_host,
            )
            self._admit_call: Any = None
            self._views: dict[int, tuple[Any, Any]] = {}  # step size -> (staged ids, positions): views made once
        if initial_counts is not None:
            self.warm_start(initial_counts)

    @property
    def evicted(self) -> int:
        """Rows replaced so far (reading it waits for the device)."""
        return int(self._replaced.sum())

    def device_bytes(self) -> int:
        """Device memory of the maps (and the fused plan's buffers)."""
        tensors = [self.slot_of, self.row_of_slot, self.counts, self._replaced]
        if self.fused:
            tensors += [self._ids, self._plan, self._positions]
        return sum(t.numel() * t.element_size() for t in tensors)

    # --- warm start ------------------------------------------------------------------

    def warm_start(self, counts: Any) -> Any:
        """Seed the LFU with offline lookup counts (``[table_rows]`` non-negative
        integers, e.g. over a corpus: ``benchmarks/lookup/rowcounts.py``) and place the most
        frequent rows (:func:`top_rows`) in slots 0, 1, ... Returns those rows (CPU int32,
        in slot order): the caller loads their data into the slots. Needs a fresh policy."""
        import torch

        if self.steps or self.filled:
            raise EngramError("warm_start needs a fresh cache (no step served, no slot filled)")
        c = counts.cpu().numpy() if isinstance(counts, torch.Tensor) else np.asarray(counts)
        if c.shape != (self.table_rows,) or c.dtype.kind not in "iu":
            raise EngramError(
                f"initial counts must be integers [table_rows] = [{self.table_rows}] (got {c.dtype} {c.shape})"
            )
        if c.size and int(c.min()) < 0:
            raise EngramError("initial counts must be >= 0")
        c32 = np.minimum(c, INT32_MAX).astype(np.int32)
        rows = top_rows(c32, self.capacity)
        self.counts[: self.table_rows].copy_(torch.from_numpy(c32))
        k = int(rows.size)
        if k:
            dev_rows = torch.from_numpy(rows).to(self.device)
            self.slot_of[dev_rows.long()] = torch.arange(k, dtype=torch.int32, device=self.device)
            self.row_of_slot[:k] = dev_rows
        self.filled = self.preloaded = k
        return torch.from_numpy(rows)

    # --- a step ----------------------------------------------------------------------

    def plan(
        self,
        ids: Any,
        miss_base: int | None = None,
        *,
        miss_order: Any = None,
        on_enqueued: Callable[[], Any] | None = None,
    ) -> StepPlan:
        """De-duplicate a step's int32 ids (any shape; CPU or the policy's device), count
        their lookups, resolve the distinct rows against the slot map and place the
        misses at work-table rows ``miss_base`` (default: the capacity) onward.
        ``miss_order`` (reference path only): list the misses in this order (a
        permutation of them, e.g. the kernels' order) instead of by ascending row.
        ``on_enqueued``: called once the fused plan's kernels are enqueued, before the
        step's wait for them (the reference calls it first), so that the caller can get
        the fetch ready meanwhile (the cache wakes the host gather's threads)."""
        import torch

        self.require_no_open_plan()
        if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int32:
            raise EngramError(f"ids must be an int32 tensor (got {getattr(ids, 'dtype', type(ids).__name__)})")
        miss_base = self.capacity if miss_base is None else int(miss_base)
        n = int(ids.numel())
        if miss_base < self.capacity or miss_base + n > INT32_MAX:
            raise EngramError(f"miss_base must be in [capacity={self.capacity}, 2^31 - 1 - lookups] (got {miss_base})")
        if self.fused:
            if miss_order is not None:
                raise EngramError("miss_order is for the reference plan (fused=False)")
            plan = self._plan_fused(ids, miss_base, on_enqueued)
        else:
            if on_enqueued is not None:
                on_enqueued()
            from engram_trt.cache.reference import plan_reference

            plan = plan_reference(self, ids, miss_base, miss_order)
        self._pending = plan
        return plan

    def require_no_open_plan(self) -> None:
        """Refuse a new step while the last plan is neither finished nor aborted (its
        misses' codes are still in the fused path's slot map)."""
        if self._pending is not None:
            raise EngramError("the previous step's plan is not finished: call finish() (or abort()) first")

    def finish(
        self,
        plan: StepPlan,
        *,
        replace: bool = True,
        work_rows: Any = None,
        work_scales: Any = None,
        admit: bool = True,
    ) -> list[RowCopy]:
        """End a step (after its rows were delivered from the work table): age the counts
        every ``decay_every`` steps, then admit: misses fill free slots, and with
        ``replace`` up to ``admit_budget`` of them try to replace colder rows. With
        ``work_rows`` / ``work_scales`` (the work table) the admitted rows are copied from
        the miss area into their slots. ``admit=False``: nothing enters the cache (a step
        whose fetch failed). Returns the row copies (reference path; the fused one copies
        on the device and returns [])."""
        if plan is not self._pending:
            raise EngramError("finish() takes the plan of the current step (from the last plan() call)")
        self._pending = None
        self.steps += 1
        if self.decay_every and self.steps % self.decay_every == 0:
            self.counts >>= 1
        adm = self._admission(plan.num_miss, replace) if admit else Admission(num_free=0)
        if self.fused:
            self._finish_fused(plan, adm, work_rows, work_scales)
            copies: list[RowCopy] = []
        else:
            from engram_trt.cache.reference import apply_copy, finish_reference

            copies = finish_reference(self, plan, adm)
            if work_rows is not None:
                for copy in copies:
                    apply_copy(copy, work_rows, work_scales)
        self.filled += adm.num_free
        self.admitted += adm.num_free
        return copies

    def abort(self, plan: StepPlan) -> None:
        """End a step whose rows were not fetched: nothing is admitted (its counts stay)."""
        self.finish(plan, admit=False)

    def _admission(self, num_miss: int, replace: bool) -> Admission:
        if self.capacity == 0 or num_miss == 0:
            return Admission(num_free=0)
        free = min(num_miss, self.capacity - self.filled)
        left = num_miss - free
        budget = min(self.admit_budget, left, self.capacity)
        if not replace or budget <= 0 or self.filled + free < self.capacity:
            return Admission(num_free=free)
        # Candidates: `budget` of the other misses, spread evenly from a random offset. A
        # hot row not picked in this step recurs and gets its chance in a later one.
        start = admission_draw(self.seed, self.steps, 0) % left
        # Victims: for each candidate the coldest of `factor` distinct cached slots (a
        # window of budget * factor slots from a random offset).
        factor = max(1, min(self.sample_factor, self.capacity // budget))
        first = admission_draw(self.seed, self.steps, 1) % self.capacity
        return Admission(
            num_free=free,
            num_candidates=budget,
            candidate_start=start,
            candidate_stride=left // budget,
            sample_first=first,
            sample_factor=factor,
        )

    # --- fused (CUDA kernels) ----------------------------------------------------------

    def staged_ids(self, ids: Any) -> tuple[Any, Any]:
        """(the step's ids as a contiguous int32 ``[n]`` on the policy's device, the
        positions' view ``[n]``): ids already there as they are, others copied into the
        policy's staging buffer (fused path)."""
        n = int(ids.numel())
        if n > self.max_step_rows:
            raise EngramError(f"a step of {n} lookups exceeds this policy's max_step_rows={self.max_step_rows}")
        views = self._views.get(n)
        if views is None:
            views = self._views[n] = (self._ids[:n], self._positions[:n])
        flat = ids.reshape(-1)
        if flat.device != self.device or not flat.is_contiguous():
            views[0].copy_(flat, non_blocking=True)
            flat = views[0]
        return flat, views[1]

    def decay_due(self) -> bool:
        """Whether the next step ends by halving the counts (``decay_every``)."""
        return bool(self.decay_every) and (self.steps + 1) % self.decay_every == 0

    def host_ids_wanted(self, n: int) -> int:
        """Miss ids to copy back with a plan's counts: 1.5 x the last step's misses (all
        of them, usually, in the plan's one wait), at most the step's lookups."""
        return min(n, self._expect_misses)

    def _expect(self, num_miss: int) -> None:
        self._expect_misses = min(self.max_step_rows, max(1024, num_miss + num_miss // 2))

    def end_whole_step(self, num_miss: int, num_free: int, aborted: bool) -> None:
        """The bookkeeping of a step that the library ran whole (``engram_cache_step``):
        what :meth:`finish` (or, if ``aborted``, :meth:`abort`) does on the host after
        the admission's launch. Only for steps without a decay (:meth:`decay_due`)."""
        self.require_no_open_plan()
        self.steps += 1
        if not aborted:
            self.filled += num_free
            self.admitted += num_free
        self._expect(num_miss)

    def _plan_fused(self, ids: Any, miss_base: int, on_enqueued: Callable[[], Any] | None = None) -> StepPlan:
        import torch

        n = int(ids.numel())
        flat, positions = self.staged_ids(ids)
        want = self.host_ids_wanted(n)
        self._plan_call(flat, miss_base=miss_base, host_ids=want)
        if on_enqueued is not None:
            on_enqueued()
        stream = torch.cuda.current_stream(self.device.index)
        stream.synchronize()  # the step's one wait: hit and miss counts, and (usually) every miss id
        hits, num_miss = int(self._plan_host_np[0]), int(self._plan_host_np[1])
        if num_miss > want:  # more misses than expected: fetch the rest of the list
            self._plan_host[2 + want : 2 + num_miss].copy_(self._plan[2 + want : 2 + num_miss], non_blocking=True)
            stream.synchronize()
        self._expect(num_miss)
        return StepPlan(
            positions=positions,
            miss_rows=self._plan[2 : 2 + num_miss],
            miss_rows_host=self._plan_host[2 : 2 + num_miss],
            miss_base=miss_base,
            num_lookups=n,
            num_unique=hits + num_miss,
            num_miss=num_miss,
        )

    def _finish_fused(self, plan: StepPlan, adm: Admission, work_rows: Any, work_scales: Any) -> None:
        from engram_trt.native.cache import AdmitCall, table_key

        if plan.num_miss == 0:
            return  # nothing was marked that the admission would restore
        if self._admit_call is None or self._admit_call.key != table_key(work_rows, work_scales):  # once per table
            self._admit_call = AdmitCall(
                slot_of=self.slot_of,
                row_of_slot=self.row_of_slot,
                counts=self.counts,
                work_rows=work_rows,
                work_scales=work_scales,
                replaced=self._replaced,
            )
        self._admit_call(
            plan.miss_rows,
            num_free=adm.num_free,
            filled=self.filled,
            capacity=self.capacity,
            num_candidates=adm.num_candidates,
            candidate_start=adm.candidate_start,
            candidate_stride=adm.candidate_stride,
            sample_first=adm.sample_first,
            sample_factor=adm.sample_factor,
            miss_base=plan.miss_base,
        )

    # --- checks ------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """The policy's state on the CPU (for comparisons; syncs)."""
        return {
            "slot_of": self.slot_of.cpu(),
            "row_of_slot": self.row_of_slot.cpu(),
            "counts": self.counts.cpu(),
            "filled": self.filled,
            "evicted": self.evicted,
            "steps": self.steps,
        }

    def check_invariants(self) -> None:
        """Slot map and slot table agree, and no step is half done (for tests; syncs)."""
        import torch

        if self._pending is not None:
            raise AssertionError("a plan is not finished")
        s = self.slot_of
        if not bool(((s == -1) | ((s >= 0) & (s < max(self.capacity, 1)))).all()):
            raise AssertionError("slot_of holds values that are neither -1 nor a slot")
        filled = self.row_of_slot[: self.filled].to(torch.int64)
        if self.filled and not bool((filled >= 0).all()):
            raise AssertionError("a filled slot holds no row")
        if self.filled and not torch.equal(
            self.slot_of[filled].to(torch.int64), torch.arange(self.filled, device=self.device)
        ):
            raise AssertionError("slot_of[row_of_slot[s]] != s")
        if int((self.slot_of >= 0).sum()) != self.filled:
            raise AssertionError("rows mapped to slots != filled slots")
