"""ctypes bindings of the gather driver (``runtime/gatherDriver.cpp``): a C++ thread that
runs a :class:`~engram_trt.native.hostgather.HostGatherer`'s gathers queued by the caller.

Why: the host gather's CPU part (2-3 ms for an 8k-token prefill chunk's rows per Engram
layer on the H200) used to run on the thread that launches the model's layers, so no
later layer was launched while it ran and the GPU idled once its queue ran dry. With the
driver the engine thread queues every Engram layer's gather when the step is submitted
and goes on launching; each layer's reader waits on the GPU (a stream memory operation,
no SM and no host wait) for exactly that layer's rows. Why a C++ thread and not a Python
one: a Python thread must win the GIL from the engine thread for every line it runs
(docs/benchmarks.md: a gather called from a Python worker took 6x longer, 100x with the
engine thread busy); the driver thread holds no GIL.

Lifetimes: the ids a job reads (pinned host memory) must not change, and its output must
not be read, until :meth:`GatherDriver.finish` covered its ticket or a stream waited with
:meth:`GatherDriver.wait_stream`; the output is then ready on that stream only.
"""

from __future__ import annotations

import ctypes
from typing import Any

from engram_trt.errors import EngramError
from engram_trt.native.gather import gather_out, ids_view
from engram_trt.native.hostgather import HostGatherer
from engram_trt.native.library import EntryPoints, NativeHandle, ptr, torch_module

_vp, _i32, _i64, _u64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_uint64
_ENTRY = EntryPoints(
    {
        "engram_gather_driver_supported": [_i32, ctypes.POINTER(_i32)],
        "engram_gather_driver_create": [_vp, ctypes.POINTER(_vp)],
        "engram_gather_driver_destroy": [_vp],
        "engram_gather_driver_submit": [
            _vp,
            _vp,
            _i64,
            _i32,
            _i64,
            _vp,
            _vp,
            _i64,
            _i32,
            _i32,
            _i32,
            _i32,
            _vp,
            _vp,
            _vp,
            ctypes.POINTER(_u64),
        ],
        "engram_gather_driver_submit_step": [
            _vp,
            _vp,
            _vp,
            _i64,
            _vp,
            _i64,
            _vp,
            _i32,
            _i32,
            _vp,
            _vp,
            _vp,
            _vp,
            _vp,
            _i32,
            _vp,
            _vp,
            _vp,
            ctypes.POINTER(_u64),
        ],
        "engram_gather_driver_wait_stream": [_vp, _u64, _vp],
        "engram_gather_driver_finish": [_vp, _u64],
    }
)


class DriverTable(ctypes.Structure):
    """EngramDriverTable: one layer's host table for a step job."""

    _fields_ = [
        ("rows_host", _vp),
        ("scales_host", _vp),
        ("num_rows", _i64),
        ("head_dim", _i32),
        ("table_dtype", _i32),
        ("quant_block", _i32),
        ("table_layout", _i32),
    ]


class StepBuffers:
    """The fixed buffers of a step job for up to ``max_tokens`` tokens: the step's
    compressed ids, seq_starts and lookback in pinned host memory (the engine thread
    fills them) and on the device, and the row ids ``[max_tokens, L, cols]`` on the device
    and, pinned, on the host (the driver copies them back there for the gather)."""

    def __init__(self, max_tokens: int, num_layers: int, num_cols: int, lookback_width: int, device: Any) -> None:
        torch = torch_module()
        i32 = torch.int32
        self.lookback_width = int(lookback_width)
        self.cids_host = torch.empty(max_tokens, dtype=i32, pin_memory=True)
        self.starts_host = torch.empty(max_tokens + 1, dtype=i32, pin_memory=True)
        self.lookback_host = torch.empty((max_tokens, max(1, lookback_width)), dtype=i32, pin_memory=True)
        self.row_ids_host = torch.empty((max_tokens, num_layers, num_cols), dtype=i32, pin_memory=True)
        self.cids_dev = torch.empty(max_tokens, dtype=i32, device=device)
        self.starts_dev = torch.empty(max_tokens + 1, dtype=i32, device=device)
        self.lookback_dev = torch.empty_like(self.lookback_host, device=device)
        self.row_ids_dev = torch.empty_like(self.row_ids_host, device=device)
        # NumPy views of the pinned buffers: the engine thread writes them without torch ops
        self.cids_np = self.cids_host.numpy()
        self.starts_np = self.starts_host.numpy()
        self.lookback_np = self.lookback_host.numpy()


def driver_supported(device: Any) -> bool:
    """Whether ``device`` has the 64-bit stream memory operations the driver needs."""
    torch = torch_module()
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return False
    index = torch.cuda.current_device() if dev.index is None else dev.index
    value = _i32(0)
    _ENTRY.call("engram_gather_driver_supported", index, ctypes.byref(value))
    return bool(value.value)


class GatherDriver(NativeHandle):
    """The driver thread of one :class:`HostGatherer` (see the module docstring). Jobs
    run in the order submitted; a failed job still releases its waiting streams, and
    :meth:`finish` raises its message."""

    def __init__(self, gatherer: HostGatherer) -> None:
        torch = torch_module()
        self.gatherer = gatherer
        self.device = gatherer.device
        self.last_ticket = 0
        handle = _vp()
        with torch.cuda.device(self.device):
            _ENTRY.call("engram_gather_driver_create", gatherer._require_open(), ctypes.byref(handle))
        self._handle = handle

    def _require_open(self) -> _vp:
        if self._handle is None:
            raise EngramError("this GatherDriver is closed")
        return self._handle

    def submit(
        self,
        ids: Any,
        rows: Any,
        scales: Any = None,
        *,
        layer: int | None = None,
        quant_block: int = 32,
        out: Any,
        stream: Any,
        ids_ready: Any = None,
        layout: str = "split",
    ) -> int:
        """Queue :meth:`HostGatherer.gather` of ``ids`` (pinned CPU int32 ``[T, cols]`` or
        ``[T, L, cols]`` with ``layer``) into ``out`` on ``stream`` (a torch CUDA stream);
        ``ids_ready``: a torch CUDA event after which ``ids`` hold their values (ids
        copied back from the hash kernel). Returns the job's ticket at once; the
        arguments are checked here, the table's contents on the driver thread."""
        torch = torch_module()
        handle = self._require_open()
        T, cols, stride, byte_offset = ids_view(ids, layer, "cpu")
        if T and not ids.is_pinned():
            raise EngramError(
                "ids for the gather driver must be in pinned memory (the driver reads them after "
                "submit returns; pageable memory may be reused)"
            )
        dtype, num_rows, head_dim, layout_code = self.gatherer._check_host_table(rows, scales, quant_block, layout)
        out = gather_out(out, T, cols, head_dim, self.device)
        ticket = _u64(0)
        with torch.cuda.device(self.device):
            _ENTRY.call(
                "engram_gather_driver_submit",
                handle,
                _vp(ids.data_ptr() + byte_offset),
                T,
                cols,
                stride,
                ptr(rows),
                ptr(scales),
                num_rows,
                head_dim,
                dtype,
                quant_block,
                layout_code,
                ptr(out),
                _vp(stream.cuda_stream),
                _vp(0 if ids_ready is None else ids_ready.cuda_event),
                ctypes.byref(ticket),
            )
        self.last_ticket = int(ticket.value)
        return self.last_ticket

    def submit_step(
        self,
        layout: Any,
        cids: Any,
        seq_starts: Any,
        lookback: Any,
        buffers: StepBuffers,
        tables: list[tuple[Any, Any, int, str]],
        outs: list[Any],
        *,
        stream: Any,
    ) -> list[int]:
        """Queue a whole step's lookup as one job (see the module docstring): ``cids [T]``,
        ``seq_starts [S+1]`` and ``lookback [S, N-1]`` (or None) as integer NumPy arrays
        are copied into ``buffers`` here; the driver hashes them on ``stream`` with the
        prepared ``layout`` and gathers layer ``l`` from ``tables[l] = (rows, scales,
        quant_block, layout)`` into ``outs[l]`` (``[T, cols, head_dim]``). Returns one
        ticket per layer, at once. A runtime that submits every step into the same
        outputs makes a :class:`StepJob` once instead (this checks the tables and outputs
        on every call)."""
        return StepJob(self, layout, buffers, tables, outs).submit(cids, seq_starts, lookback, stream=stream)

    def wait_stream(self, ticket: int, stream: Any = None) -> None:
        """Make ``stream`` (default: the device's current stream) wait on the GPU until
        job ``ticket``'s rows are ready; returns at once."""
        torch = torch_module()
        s = torch.cuda.current_stream(self.device) if stream is None else stream
        _ENTRY.call("engram_gather_driver_wait_stream", self._require_open(), int(ticket), _vp(s.cuda_stream))

    def finish(self, ticket: int | None = None) -> None:
        """Wait on the host until jobs up to ``ticket`` (default: the last) have run; raise
        the first failure among them. Their ids may be reused after this."""
        t = self.last_ticket if ticket is None else int(ticket)
        if t:
            _ENTRY.call("engram_gather_driver_finish", self._require_open(), t)

    def _destroy(self, handle: Any) -> None:
        _ENTRY.call("engram_gather_driver_destroy", handle)


class StepJob:
    """The fixed part of a runtime's step jobs, checked and packed once: the driver, the
    prepared hash layout, the step buffers, each Engram layer's host table and its
    staging output (``[max_tokens, cols, head_dim]``, whose first ``T`` tokens a step of
    ``T`` tokens fills). Why: the engine thread submits a step before it launches the
    step's first layer, so each microsecond here delays the whole step; the checks and
    ctypes packing of the tables and outputs took most of the ~200 us a submit took on
    the H200 (docs/benchmarks.md), and none of it changes between steps (the staging
    buffers are persistent: stable addresses)."""

    def __init__(
        self,
        driver: GatherDriver,
        layout: Any,
        buffers: StepBuffers,
        tables: list[tuple[Any, Any, int, str]],
        outs: list[Any],
    ) -> None:
        from engram_trt.native.hash import prepared_layout

        L, cols = int(layout.num_layers), int(layout.n_hash_cols)
        if len(tables) != L or len(outs) != L:
            raise EngramError(
                f"a step job needs one table and one output per Engram layer ({L}); got {len(tables)} and {len(outs)}"
            )
        self.driver, self.buffers, self.num_layers, self.cols = driver, buffers, L, cols
        self.max_tokens = min(buffers.cids_np.shape[0], *(int(o.shape[0]) for o in outs))
        self.structs = (DriverTable * L)()
        self.ptrs = (_vp * L)()
        for li, ((rows, scales, quant_block, table_layout), out) in enumerate(zip(tables, outs)):
            dtype, num_rows, head_dim, layout_code = driver.gatherer._check_host_table(
                rows, scales, quant_block, table_layout
            )
            gather_out(out, int(out.shape[0]), cols, head_dim, driver.device)
            self.structs[li] = DriverTable(
                rows.data_ptr(),
                0 if scales is None else scales.data_ptr(),
                num_rows,
                head_dim,
                dtype,
                quant_block,
                layout_code,
            )
            self.ptrs[li] = out.data_ptr()
        # The tables and outputs must outlive the jobs that read and write them.
        self._keep = (tables, outs)
        self._prepared = prepared_layout(layout)  # kept: its handle is passed with every job
        b = buffers
        self._dev = (ptr(b.cids_dev), ptr(b.starts_dev), ptr(b.lookback_dev), ptr(b.row_ids_dev), ptr(b.row_ids_host))
        self._host = (ptr(b.cids_host), ptr(b.starts_host), ptr(b.lookback_host))

    def submit(self, cids: Any, seq_starts: Any, lookback: Any, *, stream: Any) -> list[int]:
        """Queue one step (``T = len(cids)`` tokens, ``len(seq_starts) - 1`` sequences) on
        ``stream``: its ids are copied into the step buffers here, the rest runs on the
        driver thread. The job's GPU work comes after the work already on ``stream`` (the
        caller orders ``stream`` after the last step's readers of the outputs). Returns one
        ticket per layer, at once."""
        drv, b = self.driver, self.buffers
        handle = drv._require_open()
        T, S = int(cids.shape[0]), int(len(seq_starts)) - 1
        if T > self.max_tokens or S > b.lookback_np.shape[0]:
            raise EngramError(
                f"a step of {T} tokens / {S} sequences exceeds the step job's {self.max_tokens} "
                f"tokens (its step buffers and outputs)"
            )
        n = b.lookback_width
        if lookback is not None and tuple(lookback.shape) != (S, n):
            raise EngramError(f"lookback must be [num_sequences={S}, N-1={n}] (got {tuple(lookback.shape)})")
        b.cids_np[:T] = cids
        b.starts_np[: S + 1] = seq_starts
        with_lookback = lookback is not None and n > 0
        if with_lookback:
            b.lookback_np[:S, :n] = lookback
        first = _u64(0)
        _ENTRY.call(
            "engram_gather_driver_submit_step",
            handle,
            self._prepared.handle,
            self._host[0],
            T,
            self._host[1],
            S,
            self._host[2] if with_lookback else None,
            n,
            self.cols,
            *self._dev,
            self.num_layers,
            self.structs,
            self.ptrs,
            _vp(stream.cuda_stream),
            ctypes.byref(first),
        )
        tickets = [int(first.value) + li for li in range(self.num_layers)]
        drv.last_ticket = tickets[-1]
        return tickets
