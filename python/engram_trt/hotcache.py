"""Per-step de-duplication and an HBM cache of hot rows in front of the host gather.

Why: real n-gram lookups are skewed. On Python sources an 8k-token prefill chunk holds
only 37-66% distinct rows per order, and a few percent of a table's rows take most of
the lookups (notes/platform.md). So a step fetches each distinct row once (expanding it
to every position that asked for it is one GPU gather), and rows looked up often stay in
a device-resident cache, so that only the misses cross the PCIe link.

Structure: :class:`CachePolicy` makes every decision (the slot map, the frequency
counts, admission, eviction) on torch tensors on the cache's device, without touching
row data, so the logic runs, and is tested, on CPU tensors. :class:`HotRowCache` adds
the row storage, a device "work table" (the cache's slots, then a miss area for the
step's fetched rows, both in the table's stored form: fp8 bytes + scale bytes), and a
transfer backend: :class:`CudaTransfer` (the host gather of raw rows into the miss
area; the gather kernel dequantizes and expands from the work table in one launch) or
:class:`TorchTransfer` (the same with torch ops on CPU tensors, for tests and dry runs).
Rows reach the output unchanged (raw bytes, one dequant), so the cache is exact: the
same bf16 rows as a plain gather of the same ids.

Admission, bounded and free of extra host syncs: lookups are counted per row
(``counts[row] += lookups this step``; halved every ``decay_every`` steps when set).
While the cache has free slots, a step's misses fill them. Once it is full, up to
``admit_budget`` of a step's misses (spread evenly over them from a random offset) each
meet the coldest of ``sample_factor`` cached slots (a sampled LFU, in the manner of
TinyLFU's admission) and replace it only if their count is strictly higher. No sort: a
hot row not picked in one step recurs and is picked in a later one. An admitted row's
bytes are copied from the miss area, where the step just fetched it (device to device),
never from the host again.
Out-of-range ids all map to one sentinel row (``table_rows``), which the host gather
returns as a zero row, so they stay zero rows through the cache as in a plain gather.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import numpy as np

from engram_trt.errors import EngramError

log = logging.getLogger(__name__)

DEFAULT_CAPACITY_FRACTION = 0.05
MAX_STEP_ROWS = 196608  # an 8k-token prefill chunk of 24 columns
DEFAULT_ADMIT_BUDGET = 8192  # replacements tried per step once the cache is full


@dataclass
class CacheStats:
    """Counters over the steps served (``rows`` are row lookups; bytes count a stored
    row: values + scale bytes)."""

    steps: int = 0
    lookups: int = 0  # row lookups asked for
    unique: int = 0  # distinct rows among them, summed per step
    hits: int = 0  # distinct rows served from the cache
    fetched: int = 0  # rows fetched from the host table (the misses)
    admitted: int = 0  # rows that entered the cache
    evicted: int = 0  # rows that left it
    row_bytes: int = 0

    @property
    def hit_rate(self) -> float:
        """Share of a step's distinct rows found in the cache."""
        return self.hits / self.unique if self.unique else 0.0

    @property
    def unique_fraction(self) -> float:
        """Distinct rows per lookup: what de-duplication alone leaves to fetch."""
        return self.unique / self.lookups if self.lookups else 0.0

    @property
    def fetch_fraction(self) -> float:
        """Rows fetched from the host per lookup (de-duplication and cache together)."""
        return self.fetched / self.lookups if self.lookups else 0.0

    @property
    def bytes_looked_up(self) -> int:
        return self.lookups * self.row_bytes

    @property
    def bytes_fetched(self) -> int:
        return self.fetched * self.row_bytes

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(hit_rate=self.hit_rate, unique_fraction=self.unique_fraction, fetch_fraction=self.fetch_fraction,
                 bytes_looked_up=self.bytes_looked_up, bytes_fetched=self.bytes_fetched)
        return d


@dataclass
class StepPlan:
    """One step's lookups, de-duplicated and resolved against the cache."""

    uniq: Any  # [U] int64 distinct rows (out-of-range ids as the sentinel row)
    inverse: Any  # [n] int64: position -> index in uniq
    lookups: Any  # [U] int64 lookups of each distinct row this step
    slot: Any  # [U] int32 work-table row of each distinct row (misses: set by place_misses)
    miss_index: Any  # [M] int64 indices in uniq of the rows not cached
    num_unique: int
    num_miss: int

    def miss_rows(self) -> Any:
        return self.uniq[self.miss_index]


@dataclass
class RowCopy:
    """Copy work-table rows ``src`` to cache slots ``dst`` (where ``mask``, if given)."""

    dst: Any
    src: Any
    mask: Any = None


class CachePolicy:
    """Which rows are cached, in which slot, and which to fetch; no row data.

    Memory on the device: 8 bytes per table row (int32 slot map and int32 counts) plus 8
    per cache slot; for a 50M-row table layer that is 400 MB beside a 5% cache of 664 MB.
    """

    def __init__(self, table_rows: int, capacity_rows: int, *, device: Any = "cpu", admit_budget: int | None = None,
                 sample_factor: int = 4, decay_every: int = 0, seed: int = 0) -> None:
        import torch

        if table_rows < 1 or not 0 <= capacity_rows <= table_rows:
            raise EngramError(f"cache capacity must be in [0, table_rows={table_rows}] rows (got {capacity_rows})")
        if sample_factor < 1 or decay_every < 0:
            raise EngramError(f"sample_factor must be >= 1 and decay_every >= 0 (got {sample_factor}, {decay_every})")
        self.table_rows = int(table_rows)
        self.capacity = int(capacity_rows)
        self.sentinel = self.table_rows
        self.device = torch.device(device)
        self.slot_of = torch.full((self.table_rows + 1,), -1, dtype=torch.int32, device=self.device)
        self.row_of_slot = torch.full((max(self.capacity, 1),), -1, dtype=torch.int64, device=self.device)
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
        self._replaced = torch.zeros((), dtype=torch.int64, device=self.device)
        self._rng = np.random.default_rng(seed)

    @property
    def evicted(self) -> int:
        """Rows replaced so far (reading it waits for the device)."""
        return int(self._replaced)

    def plan(self, ids: Any) -> StepPlan:
        """De-duplicate a step's ids (any shape, on the policy's device) and look the
        distinct rows up in the slot map."""
        import torch

        flat = ids.reshape(-1).to(torch.int64)
        valid = (flat >= 0) & (flat < self.table_rows)
        mapped = torch.where(valid, flat, torch.full_like(flat, self.sentinel))
        uniq, inverse, lookups = torch.unique(mapped, return_inverse=True, return_counts=True)
        slot = self.slot_of[uniq]
        miss_index = torch.nonzero(slot < 0).squeeze(1)
        return StepPlan(uniq=uniq, inverse=inverse, lookups=lookups, slot=slot, miss_index=miss_index,
                        num_unique=int(uniq.numel()), num_miss=int(miss_index.numel()))

    def place_misses(self, plan: StepPlan, miss_base: int) -> None:
        """The step's misses go to work-table rows miss_base, miss_base + 1, ... in
        miss_index order (where the fetch puts them)."""
        import torch

        if plan.num_miss:
            plan.slot[plan.miss_index] = torch.arange(miss_base, miss_base + plan.num_miss, dtype=torch.int32,
                                                      device=self.device)

    def record(self, plan: StepPlan) -> None:
        """Count the step's lookups (and age the counts every decay_every steps)."""
        import torch

        self.counts.index_add_(0, plan.uniq, plan.lookups.to(torch.int32))
        self.steps += 1
        if self.decay_every and self.steps % self.decay_every == 0:
            self.counts >>= 1

    def admit(self, plan: StepPlan, miss_base: int) -> list[RowCopy]:
        """Update the maps for this step's admissions; return the row copies that make
        the cache's storage match them (to apply in order, after the step's output was
        produced from the work table). No sort and no host sync: a few gathers and
        compares over at most ``admit_budget * sample_factor`` elements."""
        import torch

        copies: list[RowCopy] = []
        if plan.num_miss == 0 or self.capacity == 0:
            return copies
        miss_rows = plan.miss_rows()
        free = min(plan.num_miss, self.capacity - self.filled)
        if free > 0:
            # Free slots take the step's misses as they come (all of them, while room lasts).
            slots = torch.arange(self.filled, self.filled + free, device=self.device)
            rows = miss_rows[:free]
            self.slot_of[rows] = slots.to(torch.int32)
            self.row_of_slot[slots] = rows
            copies.append(RowCopy(dst=slots, src=miss_base + slots - self.filled))
            self.filled += free
            self.admitted += free
        left = plan.num_miss - free
        budget = min(self.admit_budget, left, self.capacity)
        if budget <= 0 or self.filled < self.capacity:
            return copies
        # Candidates: `budget` of the other misses, spread evenly from a random offset. A
        # hot row not picked in this step recurs and gets its chance in a later one.
        stride = left // budget
        start = int(self._rng.integers(0, left))
        pick = free + (start + torch.arange(budget, device=self.device) * stride) % left
        cand_rows = miss_rows[pick]
        cand_counts = self.counts[cand_rows]
        # Victims: for each candidate the coldest of `factor` distinct cached slots (a
        # window of budget * factor slots from a random offset).
        factor = max(1, min(self.sample_factor, self.capacity // budget))
        first = int(self._rng.integers(0, self.capacity))
        sample = ((first + torch.arange(budget * factor, device=self.device)) % self.capacity).view(budget, factor)
        victim_counts, which = self.counts[self.row_of_slot[sample]].min(dim=1)
        victims = sample.gather(1, which[:, None]).squeeze(1)
        replace = cand_counts > victim_counts  # strictly hotter than what it would evict
        old_rows = self.row_of_slot[victims]
        minus_one = torch.full_like(victims, -1)
        self.slot_of[old_rows] = torch.where(replace, minus_one, victims).to(torch.int32)
        self.slot_of[cand_rows] = torch.where(replace, victims, minus_one).to(torch.int32)
        self.row_of_slot[victims] = torch.where(replace, cand_rows, old_rows)
        self._replaced += replace.sum()
        copies.append(RowCopy(dst=victims, src=miss_base + pick, mask=replace))
        return copies

    def check_invariants(self) -> None:
        """Slot map and slot table agree (for tests; syncs)."""
        import torch

        filled = self.row_of_slot[: self.filled]
        if self.filled and not bool((filled >= 0).all()):
            raise AssertionError("a filled slot holds no row")
        if self.filled and not torch.equal(self.slot_of[filled].to(torch.int64),
                                           torch.arange(self.filled, device=self.device)):
            raise AssertionError("slot_of[row_of_slot[s]] != s")
        if int((self.slot_of >= 0).sum()) != self.filled:
            raise AssertionError("rows mapped to slots != filled slots")


class Transfer(Protocol):
    """Moves row data for :class:`HotRowCache`."""

    def fetch(self, ids_cpu: Any, dst_rows: Any, dst_scales: Any) -> None:
        """Raw rows ``ids_cpu`` (CPU int32 [n]) of the host table into dst_rows[:n] /
        dst_scales[:n] (out-of-range ids: zero rows, scale bytes 127)."""

    def deliver(self, positions: Any, work_rows: Any, work_scales: Any, out: Any) -> Any:
        """bf16 rows ``[*positions.shape, head_dim]``: work-table rows dequantized."""


class CudaTransfer:
    """The host gather (raw rows into the device miss area) and the gather kernel."""

    def __init__(self, gatherer: Any, rows_host: Any, scales_host: Any, *, quant_block: int, layout: str) -> None:
        self.gatherer, self.rows, self.scales = gatherer, rows_host, scales_host
        self.quant_block, self.layout = quant_block, layout

    def fetch(self, ids_cpu: Any, dst_rows: Any, dst_scales: Any) -> None:
        self.gatherer.gather_raw(ids_cpu, self.rows, self.scales, dst_rows=dst_rows, dst_scales=dst_scales,
                                 quant_block=self.quant_block, layout=self.layout)

    def deliver(self, positions: Any, work_rows: Any, work_scales: Any, out: Any) -> Any:
        from engram_trt import kernels

        return kernels.gather(positions, work_rows, work_scales, quant_block=self.quant_block, out=out)


class TorchTransfer:
    """The same data path with torch ops on CPU tensors (tests, dry runs)."""

    def __init__(self, rows_host: Any, scales_host: Any, *, quant_block: int, layout: str, head_dim: int) -> None:
        self.rows, self.scales = rows_host, scales_host
        self.quant_block, self.layout, self.head_dim = quant_block, layout, head_dim

    def fetch(self, ids_cpu: Any, dst_rows: Any, dst_scales: Any) -> None:
        import torch

        ids = ids_cpu.to(torch.int64)
        n, num_rows = ids.shape[0], self.rows.shape[0]
        valid = (ids >= 0) & (ids < num_rows)
        safe = ids.clamp(0, max(num_rows - 1, 0))
        if self.layout == "inline":
            picked = self.rows[safe]
            values, scales = picked[:, : self.head_dim], picked[:, self.head_dim:]
        else:
            values = self.rows[safe]
            scales = self.scales[safe] if self.scales is not None else None
        values = torch.where(valid[:, None], values, torch.zeros_like(values))
        dst_rows[:n].copy_(values)
        if scales is not None:
            dst_scales[:n].copy_(torch.where(valid[:, None], scales, torch.full_like(scales, 127)))

    def deliver(self, positions: Any, work_rows: Any, work_scales: Any, out: Any) -> Any:
        import torch

        from engram_trt.engram.quant import dequant_fp8_rows_torch

        p = positions.reshape(-1).to(torch.int64)
        if work_scales is None:
            rows = work_rows[p]
        else:
            rows = dequant_fp8_rows_torch(work_rows[p], work_scales[p], self.quant_block)
        rows = rows.view(*positions.shape, self.head_dim)
        if out is None:
            return rows
        out.copy_(rows)
        return out


class HotRowCache:
    """De-duplicating, frequency-admitted device cache of a host table's rows.

    ``rows_host`` / ``scales_host``: the host table (split: fp8 rows + scales, or bf16
    rows; inline: fp8 ``[N, head_dim + head_dim / quant_block]`` with scales None).
    ``capacity_rows`` (default ``capacity_fraction`` of the table, 5%) cached rows live
    on ``device`` in the stored form, beside a miss area of ``max_step_rows`` rows.
    ``gather(ids)`` returns the bf16 rows of a step's ids, exactly what a plain gather of
    the same ids gives. Once the cache is full, replacements are tried every
    ``admit_every`` steps (each try costs about 30 small GPU operations, ~0.7 ms of host
    time on the H200 VM; counting runs every step). The host gather (``gatherer``) serves CUDA devices; on the CPU
    the :class:`TorchTransfer` path runs the same logic.
    """

    def __init__(self, rows_host: Any, scales_host: Any = None, *, device: Any, capacity_rows: int | None = None,
                 capacity_fraction: float = DEFAULT_CAPACITY_FRACTION, quant_block: int = 32, gatherer: Any = None,
                 layout: str = "split", max_step_rows: int = MAX_STEP_ROWS, admit_budget: int | None = None,
                 sample_factor: int = 4, decay_every: int = 0, admit_every: int = 1, transfer: Transfer | None = None,
                 seed: int = 0) -> None:
        import torch

        from engram_trt.hostgather import _host_table
        from engram_trt.kernels import TABLE_FP8_E4M3

        dtype, num_rows, head_dim, _ = _host_table(rows_host, scales_host, quant_block, layout)
        if capacity_rows is None:
            if not 0.0 <= capacity_fraction <= 1.0:
                raise EngramError(f"capacity_fraction must be in [0, 1] (got {capacity_fraction})")
            capacity_rows = int(capacity_fraction * num_rows)
        if max_step_rows < 1 or admit_every < 1:
            raise EngramError(f"max_step_rows and admit_every must be >= 1 (got {max_step_rows}, {admit_every})")
        self.admit_every = int(admit_every)
        self.device = torch.device(device)
        if transfer is None and self.device.type == "cuda" and gatherer is None:
            raise EngramError("a CUDA HotRowCache needs gatherer= (a hostgather.HostGatherer on its device)")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.head_dim, self.quant_block, self.layout = head_dim, quant_block, layout
        self.fp8 = dtype == TABLE_FP8_E4M3
        self.max_step_rows = int(max_step_rows)
        self.policy = CachePolicy(num_rows, int(capacity_rows), device=self.device, admit_budget=admit_budget,
                                  sample_factor=sample_factor, decay_every=decay_every, seed=seed)
        capacity = self.policy.capacity
        work = capacity + self.max_step_rows
        self.miss_base = capacity
        if self.fp8:
            self.work_rows = torch.empty((work, head_dim), dtype=torch.uint8, device=self.device)
            self.work_scales = torch.empty((work, head_dim // quant_block), dtype=torch.uint8, device=self.device)
        else:
            self.work_rows = torch.empty((work, head_dim), dtype=torch.bfloat16, device=self.device)
            self.work_scales = None
        if transfer is None:
            if self.device.type == "cuda":
                transfer = CudaTransfer(gatherer, rows_host, scales_host, quant_block=quant_block, layout=layout)
            else:
                transfer = TorchTransfer(rows_host, scales_host, quant_block=quant_block, layout=layout,
                                         head_dim=head_dim)
        self.transfer = transfer
        row_bytes = head_dim + head_dim // quant_block if self.fp8 else 2 * head_dim
        self._stats = CacheStats(row_bytes=row_bytes)

    def device_bytes(self) -> int:
        """Device memory the cache holds: work table (slots + miss area) and policy maps."""
        p = self.policy
        tensors = [self.work_rows, self.work_scales, p.slot_of, p.row_of_slot, p.counts]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def gather(self, ids: Any, out: Any = None, *, phase: Any = None) -> Any:
        """bf16 rows ``[*ids.shape, head_dim]`` of int32 ids (CPU or on the cache's device).

        ``phase``: an optional callable, called with "plan", "fetch", "deliver" and
        "admit" as each phase has been enqueued (a benchmark's timer that syncs)."""
        import torch

        n = int(ids.numel())
        if n > self.max_step_rows:
            raise EngramError(f"a step of {n} lookups exceeds this cache's max_step_rows={self.max_step_rows}; "
                              f"create it with a larger max_step_rows or split the step")
        if ids.dtype != torch.int32:
            raise EngramError(f"ids must be int32 (got {ids.dtype})")
        mark = phase or (lambda name: None)
        ids_dev = ids.to(self.device, non_blocking=True)
        plan = self.policy.plan(ids_dev)
        self.policy.place_misses(plan, self.miss_base)
        mark("plan")
        if plan.num_miss:
            misses = plan.miss_rows().to(torch.int32).cpu()
            end = self.miss_base + plan.num_miss
            self.transfer.fetch(misses, self.work_rows[self.miss_base:end],
                                None if self.work_scales is None else self.work_scales[self.miss_base:end])
        mark("fetch")
        shape = tuple(ids.shape) if ids.dim() == 2 else (n, 1)
        positions = plan.slot[plan.inverse].view(shape)
        out_view = None if out is None else out.view(*shape, self.head_dim)
        result = self.transfer.deliver(positions, self.work_rows, self.work_scales, out_view)
        mark("deliver")
        self.policy.record(plan)
        if self.policy.filled < self.policy.capacity or (self._stats.steps + 1) % self.admit_every == 0:
            for copy in self.policy.admit(plan, self.miss_base):
                self._apply(copy)
        mark("admit")
        s = self._stats
        s.steps += 1
        s.lookups += n
        s.unique += plan.num_unique
        s.hits += plan.num_unique - plan.num_miss
        s.fetched += plan.num_miss
        return result.view(*ids.shape, self.head_dim)

    def _apply(self, copy: RowCopy) -> None:
        import torch

        for store in (self.work_rows, self.work_scales):
            if store is None:
                continue
            src = store[copy.src]
            if copy.mask is not None:
                src = torch.where(copy.mask[:, None], src, store[copy.dst])
            store[copy.dst] = src

    def stats(self) -> CacheStats:
        """Counters so far (reading the evictions waits for the device)."""
        s = self._stats
        s.evicted = self.policy.evicted
        s.admitted = self.policy.admitted + s.evicted  # a replacement admits one row and evicts one
        return CacheStats(**asdict(s))

    def reset_stats(self) -> None:
        """Start counting afresh (e.g. after a warm-up), keeping the cache's contents."""
        self.policy.admitted = 0
        self.policy._replaced.zero_()
        self._stats = CacheStats(row_bytes=self._stats.row_bytes)
