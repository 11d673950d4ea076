"""Per-step de-duplication and an HBM cache of hot rows in front of the host gather.

Why: real n-gram lookups are skewed. On Python sources an 8k-token prefill chunk holds
only 37-66% distinct rows per order, and a few percent of a table's rows take most of
the lookups (notes/platform.md). So a step fetches each distinct row once (expanding it
to every position that asked for it is one GPU gather), and rows looked up often stay in
a device-resident cache, so that only the misses cross the PCIe link.

Structure: :class:`~engram_trt.cache.policy.CachePolicy` makes every decision (the slot
map, the frequency counts, admission, eviction) without touching row data: on CUDA
devices with the fused kernels (one synchronization per step), elsewhere with its
torch reference, which the tests and the GPU checks compare the kernels with.
:class:`HotRowCache` adds the row storage, a device "work table" (the cache's slots,
then a miss area for the step's fetched rows, both in the table's stored form: fp8
bytes + scale bytes), and a transfer backend: :class:`CudaTransfer` (the host gather of
raw rows into the miss area; the gather kernel dequantizes and expands from the work
table in one launch) or :class:`TorchTransfer` (the same with torch ops on CPU tensors,
for tests and dry runs). Rows reach the output unchanged (raw bytes, one dequant), so
the cache is exact: the same bf16 rows as a plain gather of the same ids.

Float rows (bf16, f16, f32: Qwen4Exp's PLE tables keep the dtype their checkpoint
saved): no scales, a row is ``width * itemsize`` bytes, and the cache moves them as
bytes. An f16 / f32 table is viewed as bf16 "words" (``[N, width * itemsize / 2]``, the
same memory) so that the host gather's raw copy, the work table, the admission's row
copies and the gather kernel's bf16 path (a 16-byte load and store, no conversion) all
carry its bits unchanged; the delivered words are viewed back as the table's dtype.
Why a view and not a dtype in the library: every step of the cache is already a byte
copy for unquantized rows, so the view is exact and needs no new kernel.

Host layouts: ``split`` and ``inline`` (values and scale bytes in host memory) and
``hbm-scales`` (the fp8 values in host memory, the table's scale array on the cache's
device, as the runtime keeps them for its host gather). Why the third: a miss's 256
value bytes are 4 cache lines for the CPU threads, 5 with its scale bytes, and the
threads are bound by the lines they fetch (docs/benchmarks.md); with the scales in HBM
the fetch stages and copies the values alone (one copy per chunk instead of two) and a
kernel gathers the misses' scale bytes on the device by the miss ids, which the plan
left there.

A step: plan (every lookup's work-table row, the misses), fetch (the misses into the
miss area), deliver (one gather from the work table), admit (misses fill free slots;
every ``admit_every`` steps up to ``admit_budget`` replacements, each copied from the
miss area where the step just fetched it, device to device, never from the host
again). A warm start (``initial_counts``: offline per-row frequencies) seeds the counts
and loads the most frequent rows before the first step. Out-of-range ids all map to one
sentinel row (``table_rows``), which the host gather returns as a zero row, so they
stay zero rows through the cache as in a plain gather (in the hbm-scales layout the
scale gather writes byte 127 for the sentinel, as the host side does in the others).

On CUDA with the host gather, a step is one library call (``engram_cache_step``,
:class:`~engram_trt.native.cache.StepCall`): the same plan, wake, wait, fetch,
delivery and admission as the phases above, without the interpreter between them (on
the H200 VM ~150 us of a prefill chunk's step, with the GPU idle meanwhile). The phases
run one by one from Python where a caller marks them (``phase=``), in a step that
halves the counts (``decay_every``), and with ``whole_step=False`` (A/B runs). The
whole step delivers the lookups of cached rows on a stream of its own while the host
gathers the misses, and the misses' lookups after the fetch (``overlap=False``: all of
them after the fetch).

The host gather's threads sleep after ``spin_us`` (50 us by default) without work, and a
step's plan (its one synchronization) takes longer than that, so the transfer is told
when a plan has been enqueued (:meth:`Transfer.prepare`): the CUDA transfer wakes the
threads then, and with a ``spin_us`` above the plan's time (``bench_cache.py --spin-us``)
they are still spinning when the fetch starts instead of paying their wake-up in it.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from engram_trt.cache.policy import (
    DEFAULT_ADMIT_BUDGET,
    MAX_STEP_ROWS,
    Admission,
    CachePolicy,
    RowCopy,
    StepPlan,
    top_rows,
)
from engram_trt.errors import EngramError

# The policy's names stay importable from here, where they were defined before.
__all__ = [
    "DEFAULT_ADMIT_BUDGET",
    "DEFAULT_CAPACITY_FRACTION",
    "MAX_STEP_ROWS",
    "Admission",
    "CachePolicy",
    "CacheStats",
    "CudaTransfer",
    "HotRowCache",
    "RowCopy",
    "StepPlan",
    "TorchTransfer",
    "Transfer",
    "top_rows",
]

log = logging.getLogger(__name__)

DEFAULT_CAPACITY_FRACTION = 0.05


def float_row_dtypes() -> tuple[Any, ...]:
    """The unquantized row dtypes a cache serves (module docstring: float rows)."""
    import torch

    return (torch.bfloat16, torch.float16, torch.float32)


def as_words(rows: Any) -> Any:
    """``rows`` (bf16 / f16 / f32 ``[N, width]``, last dim contiguous) viewed as bf16
    words ``[N, width * itemsize / 2]``: the same memory, the cache's byte carrier."""
    import torch

    if rows.dtype == torch.bfloat16:
        return rows
    if rows.dtype not in float_row_dtypes() or rows.dim() != 2 or rows.stride(-1) != 1:
        raise EngramError(
            f"float cache rows must be 2-D bf16 / f16 / f32 with contiguous rows "
            f"(got {rows.dtype} {tuple(rows.shape)} with strides {rows.stride()})"
        )
    return rows.view(torch.bfloat16)


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
    preloaded: int = 0  # rows a warm start loaded before the first step
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
        d.update(
            hit_rate=self.hit_rate,
            unique_fraction=self.unique_fraction,
            fetch_fraction=self.fetch_fraction,
            bytes_looked_up=self.bytes_looked_up,
            bytes_fetched=self.bytes_fetched,
        )
        return d


class Transfer(Protocol):
    """Moves row data for :class:`HotRowCache`."""

    def prepare(self) -> None:
        """A step's plan has been enqueued: a fetch may follow shortly (every transfer has
        it; one with nothing to get ready does nothing)."""

    def fetch(self, ids_cpu: Any, dst_rows: Any, dst_scales: Any, ids_dev: Any = None) -> None:
        """Raw rows ``ids_cpu`` (CPU int32 [n]) of the host table into dst_rows[:n] /
        dst_scales[:n] (out-of-range ids: zero rows, scale bytes 127). ``ids_dev``: the
        same ids on the cache's device, ready on its current stream, passed (by keyword)
        for the hbm-scales layout only, which gathers the scale bytes there by them."""

    def deliver(self, positions: Any, work_rows: Any, work_scales: Any, out: Any) -> Any:
        """bf16 rows ``[*positions.shape, head_dim]``: work-table rows dequantized."""


class CudaTransfer:
    """The host gather (raw rows into the device miss area) and the gather kernel."""

    def __init__(self, gatherer: Any, rows_host: Any, scales_host: Any, *, quant_block: int, layout: str) -> None:
        self.gatherer, self.rows, self.scales = gatherer, rows_host, scales_host
        self.quant_block, self.layout = quant_block, layout
        self._deliver: Any = None  # cache_kernels.DeliverCall of the work table last delivered from

    def prepare(self) -> None:
        self.gatherer.wake()  # the plan's wait follows: the pool wakes beside it, not in the fetch

    def fetch(self, ids_cpu: Any, dst_rows: Any, dst_scales: Any, ids_dev: Any = None) -> None:
        self.gatherer.gather_raw(
            ids_cpu,
            self.rows,
            self.scales,
            dst_rows=dst_rows,
            dst_scales=dst_scales,
            quant_block=self.quant_block,
            layout=self.layout,
            ids_dev=ids_dev if self.layout == "hbm-scales" else None,
        )

    def deliver(self, positions: Any, work_rows: Any, work_scales: Any, out: Any) -> Any:
        from engram_trt.native.cache import DeliverCall, table_key

        if self._deliver is None or self._deliver.key != table_key(work_rows, work_scales):
            self._deliver = DeliverCall(work_rows, work_scales, quant_block=self.quant_block)  # checked once
        return self._deliver(positions, out)


class TorchTransfer:
    """The same data path with torch ops on CPU tensors (tests, dry runs)."""

    def __init__(self, rows_host: Any, scales_host: Any, *, quant_block: int, layout: str, head_dim: int) -> None:
        self.rows, self.scales = rows_host, scales_host
        self.quant_block, self.layout, self.head_dim = quant_block, layout, head_dim

    def prepare(self) -> None:
        pass

    def fetch(self, ids_cpu: Any, dst_rows: Any, dst_scales: Any, ids_dev: Any = None) -> None:
        import torch

        ids = ids_cpu.to(torch.int64)
        n, num_rows = ids.shape[0], self.rows.shape[0]
        valid = (ids >= 0) & (ids < num_rows)
        safe = ids.clamp(0, max(num_rows - 1, 0))
        scales = None
        if self.layout == "inline":
            picked = self.rows[safe]
            values, scales = picked[:, : self.head_dim], picked[:, self.head_dim :]
        else:
            values = self.rows[safe]
            if self.layout == "split" and self.scales is not None:
                scales = self.scales[safe]
        values = torch.where(valid[:, None], values, torch.zeros_like(values))
        dst_rows[:n].copy_(values)
        if scales is not None:
            dst_scales[:n].copy_(torch.where(valid[:, None], scales, torch.full_like(scales, 127)))
        elif self.layout == "hbm-scales":
            # As the CUDA path does: the scale bytes gathered where the scales live, by the
            # ids on that device (the plan's miss list), not by the host copy of them.
            dev_ids = (ids_cpu if ids_dev is None else ids_dev).to(device=self.scales.device, dtype=torch.int64)
            ok = (dev_ids >= 0) & (dev_ids < num_rows)
            picked = self.scales[dev_ids.clamp(0, max(num_rows - 1, 0))]
            dst_scales[:n].copy_(torch.where(ok[:, None], picked, torch.full_like(picked, 127)))

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


def delivery_shape(ids: Any) -> tuple[int, int]:
    """The ``[T, cols]`` shape a step's positions are delivered in: 2-D ids as they are,
    any other shape as one column of its ``numel`` ids (the gather kernel's two dims)."""
    return (int(ids.shape[0]), int(ids.shape[1])) if ids.dim() == 2 else (int(ids.numel()), 1)


class HotRowCache:
    """De-duplicating, frequency-admitted device cache of a host table's rows.

    ``rows_host`` / ``scales_host``: the host table (split: fp8 rows + scales, or float
    rows, bf16 / f16 / f32, with no scales, delivered in their own dtype; inline: fp8
    ``[N, head_dim + head_dim / quant_block]`` with scales None; hbm-scales: fp8 rows in
    host memory, their scales ``[N, head_dim / quant_block]`` on ``device``).
    ``capacity_rows`` (default ``capacity_fraction`` of the table, 5%) cached rows live
    on ``device`` in the stored form, beside a miss area of ``max_step_rows`` rows.
    ``gather(ids)`` returns the rows of a step's ids (bf16 for fp8, else the table's
    dtype), exactly what a plain gather of the same ids gives. Once the cache is full,
    replacements are tried every ``admit_every`` steps (counting runs every step). ``initial_counts``: offline lookup
    counts per row (``[N]`` integers) to warm the cache from: its most frequent rows are
    loaded at construction (one host gather) and the counts seed the LFU. The host
    gather (``gatherer``) serves CUDA devices, where the policy runs fused kernels
    (``fused=False``: its torch reference); on the CPU the :class:`TorchTransfer` path
    runs the same logic. ``whole_step`` (CUDA, fused, the host gather): each step in one
    library call (the module's docstring); False: phase by phase from Python.
    ``overlap`` (the whole step): deliver the hits while the misses are fetched
    (:class:`~engram_trt.native.cache.StepCall`); False: the whole delivery after the
    fetch. ``uva_share`` / ``uva_blocks``: the share of a large step's misses the GPU
    reads through UVA beside the host gather, and its grid (None: the defaults of
    :class:`~engram_trt.native.cache.StepCall`). Either gives the same bytes.
    """

    def __init__(
        self,
        rows_host: Any,
        scales_host: Any = None,
        *,
        device: Any,
        capacity_rows: int | None = None,
        capacity_fraction: float = DEFAULT_CAPACITY_FRACTION,
        quant_block: int = 32,
        gatherer: Any = None,
        layout: str = "split",
        max_step_rows: int = MAX_STEP_ROWS,
        admit_budget: int | None = None,
        sample_factor: int = 4,
        decay_every: int = 0,
        admit_every: int = 1,
        transfer: Transfer | None = None,
        seed: int = 0,
        initial_counts: Any = None,
        fused: bool | None = None,
        whole_step: bool = True,
        overlap: bool = True,
        uva_share: float | None = None,
        uva_blocks: int | None = None,
    ) -> None:
        import torch

        from engram_trt.native.gather import TABLE_FP8_E4M3
        from engram_trt.native.hostgather import host_table

        # float rows: the table's dtype for the output, its bytes carried as bf16 words
        self.row_dtype = rows_host.dtype if rows_host.dtype in float_row_dtypes() else torch.bfloat16
        if rows_host.dtype in (torch.float16, torch.float32):
            if scales_host is not None or layout != "split":
                raise EngramError(
                    f"{rows_host.dtype} rows have no scales: pass scales_host=None and layout='split' "
                    f"(got scales {'given' if scales_host is not None else 'None'}, layout {layout!r})"
                )
            rows_host = as_words(rows_host)
        dtype, num_rows, head_dim, _ = host_table(rows_host, scales_host, quant_block, layout)
        self.width = head_dim * 2 // self.row_dtype.itemsize if dtype != TABLE_FP8_E4M3 else head_dim
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
        if layout == "hbm-scales" and (rows_host.device.type != "cpu" or scales_host.device != self.device):
            raise EngramError(
                f"layout 'hbm-scales' keeps the rows in host memory and the scales on the cache's device "
                f"{self.device} (got rows on {rows_host.device}, scales on {scales_host.device}): copy "
                f"the scales there once, e.g. scales.to('{self.device}')"
            )
        self.head_dim, self.quant_block, self.layout = head_dim, quant_block, layout
        self.fp8 = dtype == TABLE_FP8_E4M3
        self.max_step_rows = int(max_step_rows)
        self.policy = CachePolicy(
            num_rows,
            int(capacity_rows),
            device=self.device,
            admit_budget=admit_budget,
            sample_factor=sample_factor,
            decay_every=decay_every,
            seed=seed,
            fused=fused,
            max_step_rows=self.max_step_rows,
        )
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
                transfer = TorchTransfer(
                    rows_host, scales_host, quant_block=quant_block, layout=layout, head_dim=head_dim
                )
        self.transfer = transfer
        self._whole_step: Any = None  # cache_kernels.StepCall
        if whole_step and self.policy.fused and isinstance(transfer, CudaTransfer):
            from engram_trt.native.cache import StepCall

            self._whole_step = StepCall(
                policy=self.policy,
                work_rows=self.work_rows,
                work_scales=self.work_scales,
                miss_base=self.miss_base,
                gatherer=transfer.gatherer,
                rows_host=rows_host,
                scales=scales_host,
                quant_block=quant_block,
                layout=layout,
                overlap=overlap,
                uva_share=uva_share,
                **({} if uva_blocks is None else {"uva_blocks": uva_blocks}),
            )
        self._out_checked: tuple[Any, Any] = (None, None)  # (out, its shape) last checked by the whole step
        row_bytes = head_dim + head_dim // quant_block if self.fp8 else 2 * head_dim
        self._stats = CacheStats(row_bytes=row_bytes)
        if initial_counts is not None:
            self.warm_start(initial_counts)

    def warm_start(self, counts: Any) -> int:
        """Seed the counts with ``counts`` (``[table_rows]``) and load the most frequent
        rows into the slots (:meth:`CachePolicy.warm_start`); returns how many."""
        rows = self.policy.warm_start(counts)
        k = int(rows.numel())
        if k:
            extra = {"ids_dev": rows.to(self.device)} if self.layout == "hbm-scales" else {}
            self.transfer.fetch(
                rows, self.work_rows[:k], None if self.work_scales is None else self.work_scales[:k], **extra
            )
        self._stats.preloaded = k
        return k

    def device_bytes(self) -> int:
        """Device memory the cache holds: work table (slots + miss area), policy maps and buffers."""
        tensors = [self.work_rows, self.work_scales]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None) + self.policy.device_bytes()

    def gather(self, ids: Any, out: Any = None, *, phase: Any = None) -> Any:
        """Rows ``[*ids.shape, width]`` of int32 ids (CPU or on the cache's device), in
        :attr:`row_dtype` (bf16 for fp8 tables); ``out`` (optional) in that dtype too.

        ``phase``: an optional callable, called with "plan", "fetch", "deliver" and
        "admit" as each phase has been enqueued (a benchmark's timer that syncs)."""
        import torch

        if self.row_dtype == torch.bfloat16:
            return self._gather_words(ids, out, phase)
        if out is not None:
            if out.dtype != self.row_dtype or out.dim() == 0 or out.stride(-1) != 1:
                raise EngramError(
                    f"out must be {self.row_dtype} with contiguous rows, as the table "
                    f"(got {out.dtype} {tuple(out.shape)})"
                )
            out = out.view(torch.bfloat16)
        return self._gather_words(ids, out, phase).view(self.row_dtype)

    def _gather_words(self, ids: Any, out: Any, phase: Any) -> Any:
        """:meth:`gather` in the cache's carrier form: bf16 ``[*ids.shape, head_dim]``
        (fp8 rows dequantized; float rows as their bf16 words)."""
        import torch

        n = int(ids.numel())
        if n > self.max_step_rows:
            raise EngramError(
                f"a step of {n} lookups exceeds this cache's max_step_rows={self.max_step_rows}; "
                f"create it with a larger max_step_rows or split the step"
            )
        if ids.dtype != torch.int32:
            raise EngramError(f"ids must be int32 (got {ids.dtype})")
        policy = self.policy
        if self._whole_step is not None and phase is None and not policy.decay_due():
            return self._gather_whole(ids, n, out)
        mark = phase or (lambda name: None)
        plan = policy.plan(ids, self.miss_base, on_enqueued=self.transfer.prepare)
        mark("plan")
        try:
            if plan.num_miss:
                end = self.miss_base + plan.num_miss
                # hbm-scales: the miss ids on the device too (the plan's list, ready on the stream)
                extra = {"ids_dev": plan.miss_rows} if self.layout == "hbm-scales" else {}
                self.transfer.fetch(
                    plan.miss_rows_host,
                    self.work_rows[self.miss_base : end],
                    None if self.work_scales is None else self.work_scales[self.miss_base : end],
                    **extra,
                )
            mark("fetch")
            shape = delivery_shape(ids)
            positions = plan.positions.view(shape)
            out_view = None if out is None else out.view(*shape, self.head_dim)
            result = self.transfer.deliver(positions, self.work_rows, self.work_scales, out_view)
            mark("deliver")
        except BaseException:
            try:
                policy.abort(plan)  # the misses' rows may not be in the miss area: admit none of them
            except Exception:  # the device may be unusable; the original error is the one to see
                log.exception("could not end the failed cache step")
            raise
        replace = (policy.steps + 1) % self.admit_every == 0
        policy.finish(plan, replace=replace, work_rows=self.work_rows, work_scales=self.work_scales)
        mark("admit")
        self._count(n, plan.num_unique - plan.num_miss, plan.num_miss)
        return result.view(*ids.shape, self.head_dim)

    def _count(self, lookups: int, hits: int, misses: int) -> None:
        """A served step's counters (hits and misses are distinct rows)."""
        s = self._stats
        s.steps += 1
        s.lookups += lookups
        s.unique += hits + misses
        s.hits += hits
        s.fetched += misses

    def _gather_whole(self, ids: Any, n: int, out: Any) -> Any:
        """A step in one library call (:class:`~engram_trt.native.cache.StepCall`)."""
        import torch

        policy = self.policy
        policy.require_no_open_plan()
        # host ids: the library copies them up itself (one CUDA call instead of a torch copy)
        flat = ids.reshape(-1)
        if not flat.is_contiguous() or (flat.is_cuda and flat.device != self.device):
            flat, _ = policy.staged_ids(ids)
        tokens, cols = delivery_shape(ids)
        if out is None:
            out = torch.empty((tokens, cols, self.head_dim), dtype=torch.bfloat16, device=self.device)
        elif self._out_checked[0] is not out or self._out_checked[1] != out.shape:
            from engram_trt.native.library import check

            check("out", out, (torch.bfloat16,), None)
            if out.numel() != n * self.head_dim or out.device != self.device:
                raise EngramError(
                    f"out must be bf16 with {n} x {self.head_dim} elements on {self.device} "
                    f"(got {tuple(out.shape)} on {out.device})"
                )
            self._out_checked = (out, out.shape)
        hits, num_miss, num_free, aborted, error = self._whole_step(
            flat,
            tokens,
            cols,
            out,
            host_ids=policy.host_ids_wanted(n),
            filled=policy.filled,
            replace=(policy.steps + 1) % self.admit_every == 0,
            step=policy.steps + 1,
        )
        if error is not None:
            if aborted:
                policy.end_whole_step(num_miss, 0, aborted=True)  # as abort(): counted, nothing admitted
            raise EngramError(error)
        policy.end_whole_step(num_miss, num_free, aborted=False)
        self._count(n, hits, num_miss)
        return out.view(*ids.shape, self.head_dim)

    def stats(self) -> CacheStats:
        """Counters so far (reading the evictions waits for the device)."""
        s = self._stats
        s.evicted = self.policy.evicted
        s.admitted = self.policy.admitted + s.evicted  # a replacement admits one row and evicts one
        return CacheStats(**asdict(s))

    def close(self) -> None:
        """Release the whole step's stream and event now rather than when the cache is
        collected (idempotent); the cache then serves its steps phase by phase, from
        Python, with the same results."""
        step, self._whole_step = self._whole_step, None
        if step is not None:
            step.close()

    def reset_stats(self) -> None:
        """Start counting afresh (e.g. after a warm-up), keeping the cache's contents."""
        self.policy.admitted = 0
        self.policy._replaced.zero_()
        self._stats = CacheStats(row_bytes=self._stats.row_bytes, preloaded=self._stats.preloaded)
