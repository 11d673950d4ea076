"""Prefetch: each step's Engram rows hashed and gathered before the layers that need
them, on a side CUDA stream, into persistent staging buffers.

Why this works: the lookup indices depend only on token ids, and the runtime knows a
step's ids before the step (the prompt chunk, or the tokens it just sampled). So the
runtime hands the step to :meth:`Prefetcher.submit` first, then launches the model; the
main stream waits for each Engram layer's rows only where that layer reads them
(:class:`StagedRows <engram_trt.runtime.staged_rows.StagedRows>` waits lazily, at the
first ``rows[i]``). The layers before it hide the lookup.

Why no worker thread: the lookup's host work runs on the thread that runs the step.
A GPU gather is launched at once on the side stream (a few asynchronous launches). A
host gather runs when each Engram layer first asks for its rows, that is after the
layers before it have been enqueued, so the CPU threads gather while the GPU runs those
layers. A Python worker thread would have to win the GIL from the engine thread for
every Python line of the lookup: on the H200 a gather of 6,144 rows took 693 us called
from a worker thread against 115 us on a thread that runs its own loop, and 15.8 ms with
another Python thread busy (``benchmarks/lookup/bench_contention.py``, docs/benchmarks.md).

Why staging buffers are persistent: fixed addresses. A captured CUDA graph or a
TensorRT engine binds the rows' address once; every step writes the same buffers
(``[max_tokens, cols, head_dim]`` bf16 per Engram layer, the first T rows used).

Which gather (per step, by row count): tables in GPU memory go through the gather
kernel at HBM speed; host tables through the host gather (CPU threads into pinned
staging, one copy per chunk: measured 2-3.5x faster than GPU reads of host memory on
the H200, docs/benchmarks.md) or the UVA kernel, whichever the start-up calibration
found faster for that many rows (``gather_policy``). With no GPU, the rows come from
the reference gather, synchronously.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable

import numpy as np
import torch

from engram_trt.engram.hashing import hash_batch_packed
from engram_trt.engram.layout import EngramLayout
from engram_trt.errors import EngramError
from engram_trt.runtime.staged_rows import StagedRows
from engram_trt.models.step import PackedStep
from engram_trt.tables.base import TableStore

log = logging.getLogger(__name__)

GATHER_PATHS = ("device", "uva", "host", "reference")
# Every this many steps the runtime reads the GPU gathers' bad-row counter (rows that read
# no table: an unbound or misaligned address, or ids past a table's end) and fails the
# step with a clear error if it moved; 1 = every step (a debug mode). One 8-byte read.
BAD_ROW_CHECK_EVERY = int(os.environ.get("ENGRAM_TRT_CHECK_ROWS_EVERY", "256") or 256)
# From this many tokens a host gather's row ids come from the hash kernel (and one copy
# back) rather than from NumPy on the engine thread.
GPU_HASH_MIN_TOKENS = 256
# 1 (the default): queue each step's host gathers as one step job on the gather driver's
# thread (engram_trt.native.gatherdriver) where the device has 64-bit stream memory operations,
# so the engine thread goes on launching layers while the CPUs gather; 0: the host gather
# runs at each Engram layer's first read, on the engine thread.
GATHER_DRIVER = os.environ.get("ENGRAM_TRT_GATHER_DRIVER", "1") != "0"
# 1 (the default): with the gather driver, fp8 host tables keep a copy of their scale
# bytes in GPU memory (3% of a table of 256-byte rows: 0.75 GiB per 24 GiB) so the host
# gather's CPU threads copy 4 cache lines a row instead of 5 (engram_trt.native.hostgather,
# layout 'hbm-scales'); used only while that copy takes at most HBM_SCALES_MAX_FRACTION of
# the GPU's free memory. 0: the scales stay in host memory.
HBM_SCALES = os.environ.get("ENGRAM_TRT_HBM_SCALES", "1") != "0"
HBM_SCALES_MAX_FRACTION = 0.1
# 1 (the default): the host gatherer of fp8 tables stages a whole step's rows of a layer in
# one of two device buffers (``job_staging_bytes``: max_tokens x cols rows each, 52 MB for
# 8,192 tokens of 24 columns of 264-byte rows), so its copies never wait for a dequant: with
# the ring of device slots alone, a dequant queued behind a prefill's GEMM (which holds
# every SM until it ends) stalled the copies and the CPU threads behind it, and a prefill
# chunk's lookup took up to 20x its time alone (docs/benchmarks.md). 0: the ring alone.
JOB_STAGING = os.environ.get("ENGRAM_TRT_JOB_STAGING", "1") != "0"


def _driver_supported(device: Any) -> bool:
    from engram_trt.native.gatherdriver import driver_supported

    try:
        return driver_supported(device)
    except EngramError as exc:
        log.warning("gather driver unavailable (%s); the host gather runs on the engine thread", exc)
        return False


def bad_row_checker(device: Any) -> Any:
    """A device int64 counter for the gather kernels and a function that checks it every
    BAD_ROW_CHECK_EVERY calls (each call counts one step)."""
    from engram_trt.native import gather as gather_kernels

    counter = gather_kernels.new_bad_row_counter(device)
    state = {"steps": 0}

    def check() -> None:
        state["steps"] += 1
        if state["steps"] % max(1, BAD_ROW_CHECK_EVERY) == 0:
            gather_kernels.check_bad_rows(counter, what="Engram lookup")

    return counter, check


class Prefetcher:
    """Stages each step's Engram rows (see the module docstring).

    ``compress_lookup`` int64 ``[vocab]`` (raw -> compressed id, -1 = none) stays on the
    host: the runtime compresses and hashes there for the host gather, and uploads the
    compressed ids for the kernels otherwise. ``gather_policy(num_rows) -> path``
    picks the gather per step for host tables (default: the host gather).
    ``gather_driver``: queue host gathers on the gather driver's thread where the device
    supports it (default: on, unless ``ENGRAM_TRT_GATHER_DRIVER=0``). ``hbm_scales``: with
    the driver, read fp8 host tables' scale bytes from a copy in GPU memory (default: on,
    unless ``ENGRAM_TRT_HBM_SCALES=0``; see ``HBM_SCALES``). ``job_staging``: stage a
    step's fp8 rows of a layer in a device buffer of their own (default: on, unless
    ``ENGRAM_TRT_JOB_STAGING=0``; see ``JOB_STAGING``).
    """

    def __init__(
        self,
        layout: EngramLayout,
        tables: TableStore,
        device: Any,
        max_tokens: int,
        gather_policy: Callable[[int], str] | None = None,
        gather_driver: bool | None = None,
        hbm_scales: bool | None = None,
        job_staging: bool | None = None,
    ) -> None:
        self.layout = layout
        self.tables = tables
        self.device = torch.device(device)
        self.max_tokens = int(max_tokens)
        self.cols = layout.n_hash_cols
        self.head_dim = tables.head_dim(0)
        self.gather_policy = gather_policy
        self.cuda = self.device.type == "cuda"
        # True: each step's StagedRows.info carries CUDA events (lookup start and end on
        # the side stream, the main stream's wait point) for timelines; off when serving.
        self.timing = False
        self.staging = [
            torch.empty((self.max_tokens, self.cols, tables.head_dim(i)), dtype=torch.bfloat16, device=self.device)
            for i in range(layout.num_layers)
        ]
        self._ops = None
        self._stream = None
        self._driver: Any = None
        self._step_job: Any = None
        self._hbm_scales: list[torch.Tensor] | None = None  # per layer, when the host gather reads them there
        self._last_event: Any = None
        self._lock = threading.Lock()
        self.stats = {"steps": 0, "rows": 0, "bytes_from_host": 0, "lookup_s": 0.0, "paths": {}}
        if self.cuda:
            from engram_trt.models.engram_llama.kernel_ops import KernelEngramOps

            self._ops = KernelEngramOps(layout, self.device)
            self._bad_rows, self._check_bad_rows = bad_row_checker(self.device)
            # High priority: the lookup's kernels (the host gather's dequant per chunk, whose
            # slots the next chunks wait for; the GPU gathers) are scheduled ahead of the
            # layers' queued blocks instead of behind a prefill's GEMMs.
            self._stream = torch.cuda.Stream(self.device, priority=-1)
            self._ids_dev = torch.empty(self.max_tokens, dtype=torch.int32, device=self.device)
            self._ids_host = torch.empty(self.max_tokens, dtype=torch.int32, pin_memory=True)
            self._gatherer = None
            self._hash_host: torch.Tensor | None = None
            if not tables.on_device:
                from engram_trt.native.hostgather import HostGatherer

                width = max(tables.head_dim(i) for i in range(tables.num_layers))
                driver = (GATHER_DRIVER if gather_driver is None else gather_driver) and _driver_supported(self.device)
                # The default pool leaves a CPU to the engine thread, which keeps launching
                # layers while the driver's pool gathers.
                self._gatherer = HostGatherer(device=self.device, max_head_dim=max(512, width))
                if JOB_STAGING if job_staging is None else job_staging:
                    self._set_job_staging()
                if driver:
                    from engram_trt.native.gatherdriver import GatherDriver

                    self._driver = GatherDriver(self._gatherer)
                    self._order = torch.cuda.Event()  # re-recorded each step: no event made per step
                    if HBM_SCALES if hbm_scales is None else hbm_scales:
                        self._hbm_scales = self._scales_to_hbm()
                log.info(
                    "host gather: %s",
                    "queued on its driver thread at submit (the engine thread never waits for it)"
                    if driver
                    else "run at each Engram layer's first read, on the engine thread",
                )

    def _set_job_staging(self) -> None:
        """Size the gatherer's two job buffers for a step of max_tokens (fp8 tables only:
        bf16 rows are copied straight into the staging outputs, with no dequant)."""
        fp8 = [li for li in range(self.tables.num_layers) if self.tables.tensors(li)[0].dtype == torch.uint8]
        if not fp8:
            return
        per_row = max(self.tables.head_dim(li) + self.tables.head_dim(li) // self.tables.quant_block for li in fp8)
        need = self.max_tokens * self.cols * per_row
        self._gatherer.set_options(job_staging_bytes=need)
        log.info(
            "host gather: a step's fp8 rows staged in 2 device buffers of %.1f MB (copies never wait for a dequant)",
            need / 1e6,
        )

    def _scales_to_hbm(self) -> list[torch.Tensor] | None:
        """Each layer's scale bytes copied to the GPU, or None (bf16 tables, or the copy
        would take more than HBM_SCALES_MAX_FRACTION of the free memory; logged)."""
        scales = [self.tables.tensors(li)[1] for li in range(self.tables.num_layers)]
        if any(s is None for s in scales):
            return None
        need = sum(int(s.numel()) for s in scales)
        free, _ = torch.cuda.mem_get_info(self.device)
        if need > HBM_SCALES_MAX_FRACTION * free:
            log.info(
                "host gather: scale bytes stay in host memory (%.2f GiB would be over %.0f%% of the GPU's "
                "%.1f GiB free)",
                need / 2**30,
                100 * HBM_SCALES_MAX_FRACTION,
                free / 2**30,
            )
            return None
        out = [s.to(self.device) for s in scales]
        log.info(
            "host gather: the tables' scale bytes copied to the GPU (%.2f GiB): the CPU threads copy the values alone",
            need / 2**30,
        )
        return out

    @property
    def host_layout(self) -> str:
        """The host gather's table layout on the driver's path: 'hbm-scales' or 'split'."""
        return "split" if self._hbm_scales is None else "hbm-scales"

    def _host_table(self, li: int) -> tuple[Any, Any, int, str]:
        """(rows, scales, quant_block, layout) of layer ``li`` as the driver's step job reads it."""
        rows, scales = self.tables.tensors(li)
        if self._hbm_scales is not None:
            scales = self._hbm_scales[li]
        return rows, scales, self.tables.quant_block, self.host_layout

    def calibrate(self) -> Any:
        """Time the host gather and the UVA kernel on this store at a decode step's and a
        prefill chunk's row counts, and take the faster per size from then on (logged).
        Host tables only: GPU-memory tables always use the HBM gather."""
        if not self.cuda or self.tables.on_device or self._gatherer is None:
            return None
        from engram_trt.runtime.gatherpath import calibrate_gather

        # The host gather timed as the step job runs it; the UVA kernel reads the stored
        # split table (the host scales, when the host gather's are in HBM).
        rows, scales, quant_block, layout = self._host_table(0)
        uva = {} if layout == "split" else {"uva_rows": rows, "uva_scales": self.tables.tensors(0)[1]}
        choice = (
            calibrate_gather(
                rows, scales, gatherer=self._gatherer, quant_block=quant_block, layout=layout, num_cols=self.cols, **uva
            )
            if self.tables.gpu_readable
            else None
        )
        if choice is not None:
            self.gather_policy = choice.path_for
            log.info("gather path by size (start-up calibration): %s", choice.describe())
        return choice

    @property
    def row_bytes(self) -> int:
        """Bytes a row brings from host memory (its scale bytes too, unless they are in HBM)."""
        rows, scales = self.tables.tensors(0)
        return rows.shape[1] * rows.element_size() + (0 if scales is None or self._hbm_scales else scales.shape[1])

    def path_for(self, num_rows: int) -> str:
        if not self.cuda:
            return "reference"
        if self.tables.on_device:
            return "device"
        if self.gather_policy is not None:
            return self.gather_policy(num_rows)
        return "host"

    def submit(self, step: PackedStep, cids: np.ndarray, lookback: np.ndarray) -> StagedRows:
        """Start staging the rows of ``step``: ``cids [T]`` compressed ids and ``lookback
        [S, N-1]`` (host int64 arrays). Returns at once on a GPU (a GPU gather is
        enqueued on the side stream; a host gather runs at the first ``rows[i]``); on a
        CPU, when the rows are ready."""
        T = step.num_tokens
        if T > self.max_tokens:
            raise EngramError(
                f"a step of {T} tokens exceeds the staging buffers' {self.max_tokens} tokens (max_num_tokens)"
            )
        views = [s[:T] for s in self.staging]
        path = self.path_for(T * self.cols)
        info = {"path": path, "rows": T * self.cols * self.layout.num_layers}
        if path == "reference":
            t0 = time.perf_counter()
            ids = torch.from_numpy(hash_batch_packed(cids, step.seq_starts, lookback, self.layout))
            for li, v in enumerate(views):
                v.copy_(self.tables.rows(li, ids[:, li, :]))
            self._account(info, time.perf_counter() - t0)
            return StagedRows(views, info=info, staging=self.staging)
        if path != "host":
            self._check_bad_rows()
        if path == "host" and self._gatherer is not None:
            self._gatherer.wake()  # the pool's threads spin again before the ids arrive
        event = torch.cuda.Event(enable_timing=self.timing)
        if self.timing:
            info["wait_event"] = torch.cuda.Event(enable_timing=True)
            info["start_event"] = torch.cuda.Event(enable_timing=True)
            info["done_event"] = event
            # per layer of a host gather: the main stream's read point, the layer's rows
            # ready on the side stream, and the host thread's gather call (perf_counter)
            info.update(layer_waits=[], layer_done=[], layer_host=[], submit_t=time.perf_counter())

        if path == "host" and self._driver is not None:
            return self._host_queued(step, cids, lookback, views, info)
        if path == "host":
            return StagedRows(
                views,
                None,
                info,
                staging=self.staging,
                deferred=self._host_stager(step, cids, lookback, views, event, info),
            )
        self._stage(step, cids, lookback, views, path, event, info)
        return StagedRows(views, event, info, staging=self.staging)

    def _host_stager(
        self,
        step: PackedStep,
        cids: np.ndarray,
        lookback: np.ndarray,
        views: list[torch.Tensor],
        last_event: Any,
        info: dict[str, Any],
    ) -> Callable[[int], Any]:
        """The host gather of one layer at a time, on the reader's thread: the ids are
        hashed at the first call; each layer's copies and dequant go on the side stream,
        ending in that layer's event (the last layer's is ``last_event``, the timeline's
        end)."""
        state: dict[str, Any] = {"ids": None, "t": 0.0, "done": 0}
        n = len(views)

        def stage(li: int) -> Any:
            t0 = time.perf_counter()
            assert self._stream is not None and self._gatherer is not None
            with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
                if state["ids"] is None:
                    if "start_event" in info:
                        info["start_event"].record(self._stream)
                    state["ids"] = self._host_row_ids(step, cids, lookback)
                ids = state["ids"]
                rows, scales = self.tables.tensors(li)
                g0 = time.perf_counter()
                self._gatherer.gather(ids, rows, scales, layer=li, quant_block=self.tables.quant_block, out=views[li])
                state["done"] += 1
                ev = last_event if state["done"] == n else torch.cuda.Event(enable_timing="layer_done" in info)
                ev.record(self._stream)
                if "layer_done" in info:
                    info["layer_done"].append(ev)
                    info["layer_host"].append((g0 - info["submit_t"], time.perf_counter() - info["submit_t"]))
            state["t"] += time.perf_counter() - t0
            if state["done"] == n:
                info["bytes_from_host"] = int(ids.numel()) * self.row_bytes
                self._account(info, state["t"])
            return ev

        return stage

    def _host_queued(
        self, step: PackedStep, cids: np.ndarray, lookback: np.ndarray, views: list[torch.Tensor], info: dict[str, Any]
    ) -> StagedRows:
        """The whole step's host lookup queued on the gather driver as one job (see
        engram_trt.native.gatherdriver): the engine thread only copies the step's compressed ids,
        bounds and lookback into pinned buffers; the driver thread hashes them on the GPU,
        copies the row ids back and gathers each Engram layer in turn, and each layer's
        reader waits on the GPU for its rows. Nothing here waits for the lookup."""
        t0 = time.perf_counter()
        drv = self._driver
        assert drv is not None and self._stream is not None
        drv.finish()  # the last step's job has run (its buffers are free); raises its failure
        t_finish = time.perf_counter()
        if self._step_job is None:
            self._step_job = self._make_step_job()
        # The new rows land in the staging buffers only after the work already queued on
        # the main stream (the last step's readers of those buffers).
        self._order.record(torch.cuda.current_stream(self.device))
        self._stream.wait_event(self._order)
        if "start_event" in info:
            info["start_event"].record(self._stream)
        t_order = time.perf_counter()
        tickets = self._step_job.submit(cids, step.seq_starts, lookback, stream=self._stream)
        t_end = time.perf_counter()
        info["bytes_from_host"] = step.num_tokens * self.cols * len(views) * self.row_bytes
        if self.timing:  # the engine thread's time in submit, by part
            # finish: the last job's; order: the streams ordered (and the timeline's start
            # event); queue: the ids into the step buffers and the C call
            info["submit_us"] = {
                "finish": (t_finish - t0) * 1e6,
                "order": (t_order - t_finish) * 1e6,
                "queue": (t_end - t_order) * 1e6,
            }
        self._account(info, t_end - t0)

        def wait(li: int, stream: Any) -> None:
            drv.wait_stream(tickets[li], stream)

        return StagedRows(views, None, info, staging=self.staging, waiter=wait, finish=lambda: drv.finish(tickets[-1]))

    def _make_step_job(self) -> Any:
        """The step job's fixed part (engram_trt.native.gatherdriver.StepJob), made at the first
        host step: the step buffers, each layer's table and its whole staging buffer."""
        from engram_trt.native.gatherdriver import StepBuffers, StepJob

        buffers = StepBuffers(
            self.max_tokens, self.layout.num_layers, self.cols, self.layout.max_ngram_size - 1, self.device
        )
        tables = [self._host_table(li) for li in range(self.layout.num_layers)]
        return StepJob(self._driver, self.layout, buffers, tables, self.staging)

    def _hash_on_gpu(self, step: PackedStep, cids: np.ndarray, lookback: np.ndarray) -> torch.Tensor:
        """Row ids ``[T, L, cols]`` int32 on the device: the compressed ids through the
        pinned buffer, the hash kernel on the current (side) stream."""
        T = step.num_tokens
        assert self._ops is not None
        if self._last_event is not None:
            self._last_event.synchronize()  # the pinned ids buffer may still feed the last copy
        self._ids_host[:T].copy_(torch.from_numpy(cids.astype(np.int32)))
        self._ids_dev[:T].copy_(self._ids_host[:T], non_blocking=True)
        lb = torch.from_numpy(np.ascontiguousarray(lookback, dtype=np.int32)).to(self.device, non_blocking=True)
        starts = torch.tensor(step.seq_starts, dtype=torch.int32).to(self.device, non_blocking=True)
        return self._ops.hash_kernels.hash_packed(self._ids_dev[:T], starts, lb, self.layout)

    def _host_row_ids(self, step: PackedStep, cids: np.ndarray, lookback: np.ndarray) -> torch.Tensor:
        """Row ids ``[T, L, cols]`` int32 on the host, for the host gather. A long step is
        hashed by the hash kernel on the side stream and its ids copied back (an 8k-token
        prefill chunk: ~2.7 ms in NumPy, tens of microseconds this way); a short one in
        NumPy (no round trip to wait for)."""
        T = step.num_tokens
        if T < GPU_HASH_MIN_TOKENS or self._ops is None:
            return torch.from_numpy(hash_batch_packed(cids, step.seq_starts, lookback, self.layout).astype(np.int32))
        if self._hash_host is None:
            self._hash_host = torch.empty(
                (self.max_tokens, self.layout.num_layers, self.cols), dtype=torch.int32, pin_memory=True
            )
        ids = self._hash_on_gpu(step, cids, lookback)
        out = self._hash_host[:T]
        out.copy_(ids, non_blocking=True)
        done = torch.cuda.Event()
        done.record(self._stream)
        done.synchronize()
        return out

    def _stage(
        self,
        step: PackedStep,
        cids: np.ndarray,
        lookback: np.ndarray,
        views: list[torch.Tensor],
        path: str,
        event: Any,
        info: dict[str, Any],
    ) -> None:
        """The GPU lookup: everything enqueued on the side stream, then the event."""
        t0 = time.perf_counter()
        T = step.num_tokens
        assert self._ops is not None and self._stream is not None
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            if "start_event" in info:
                info["start_event"].record(self._stream)
            # Kernels all the way: upload the compressed ids, hash and gather on the GPU.
            ids = self._hash_on_gpu(step, cids, lookback)
            for li, v in enumerate(views):
                rows, scales = self.tables.tensors(li)
                self._ops.gather_kernels.gather(
                    ids, rows, scales, layer=li, quant_block=self.tables.quant_block, out=v, bad_rows=self._bad_rows
                )
            info["bytes_from_host"] = 0 if path == "device" else T * self.cols * self.layout.num_layers * self.row_bytes
            event.record(self._stream)
            self._last_event = event
        self._account(info, time.perf_counter() - t0)

    def _account(self, info: dict[str, Any], seconds: float) -> None:
        with self._lock:
            st = self.stats
            st["steps"] += 1
            st["rows"] += info["rows"]
            st["bytes_from_host"] += info.get("bytes_from_host", 0)
            st["lookup_s"] += seconds
            st["paths"][info["path"]] = st["paths"].get(info["path"], 0) + 1

    def close(self) -> None:
        if getattr(self, "_driver", None) is not None:
            try:
                self._driver.finish()
            finally:
                self._driver.close()
                self._driver = None
        self._step_job = None
        self._hbm_scales = None  # the GPU copy of the scales goes with the last job that read it
        if self._stream is not None:
            self._stream.synchronize()
        if getattr(self, "_gatherer", None) is not None:
            self._gatherer.close()
            self._gatherer = None
