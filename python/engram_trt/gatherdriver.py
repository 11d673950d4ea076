"""ctypes bindings of the gather driver (``runtime/gatherDriver.cpp``): a C++ thread that
runs a :class:`~engram_trt.hostgather.HostGatherer`'s gathers queued by the caller.

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
from engram_trt.hostgather import HostGatherer
from engram_trt.kernels import EntryPoints, NativeHandle, _gather_out, _ids_view, _ptr, _torch

_vp, _i32, _i64, _u64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_uint64
_ENTRY = EntryPoints({
    "engram_gather_driver_supported": [_i32, ctypes.POINTER(_i32)],
    "engram_gather_driver_create": [_vp, ctypes.POINTER(_vp)],
    "engram_gather_driver_destroy": [_vp],
    "engram_gather_driver_submit": [_vp, _vp, _i64, _i32, _i64, _vp, _vp, _i64, _i32, _i32, _i32, _i32, _vp, _vp, _vp,
                                    ctypes.POINTER(_u64)],
    "engram_gather_driver_wait_stream": [_vp, _u64, _vp],
    "engram_gather_driver_finish": [_vp, _u64],
})


def driver_supported(device: Any) -> bool:
    """Whether ``device`` has the 64-bit stream memory operations the driver needs."""
    torch = _torch()
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
        torch = _torch()
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

    def submit(self, ids: Any, rows: Any, scales: Any = None, *, layer: int | None = None, quant_block: int = 32,
               out: Any, stream: Any, ids_ready: Any = None, layout: str = "split") -> int:
        """Queue :meth:`HostGatherer.gather` of ``ids`` (pinned CPU int32 ``[T, cols]`` or
        ``[T, L, cols]`` with ``layer``) into ``out`` on ``stream`` (a torch CUDA stream);
        ``ids_ready``: a torch CUDA event after which ``ids`` hold their values (ids
        copied back from the hash kernel). Returns the job's ticket at once; the
        arguments are checked here, the table's contents on the driver thread."""
        torch = _torch()
        handle = self._require_open()
        T, cols, stride, byte_offset = _ids_view(ids, layer, "cpu")
        if T and not ids.is_pinned():
            raise EngramError("ids for the gather driver must be in pinned memory (the driver reads them after "
                              "submit returns; pageable memory may be reused)")
        dtype, num_rows, head_dim, layout_code = self.gatherer._check_host_table(rows, scales, quant_block, layout)
        out = _gather_out(out, T, cols, head_dim, self.device)
        ticket = _u64(0)
        with torch.cuda.device(self.device):
            _ENTRY.call("engram_gather_driver_submit", handle, _vp(ids.data_ptr() + byte_offset), T, cols, stride,
                        _ptr(rows), _ptr(scales), num_rows, head_dim, dtype, quant_block, layout_code, _ptr(out),
                        _vp(stream.cuda_stream), _vp(0 if ids_ready is None else ids_ready.cuda_event),
                        ctypes.byref(ticket))
        self.last_ticket = int(ticket.value)
        return self.last_ticket

    def wait_stream(self, ticket: int, stream: Any = None) -> None:
        """Make ``stream`` (default: the device's current stream) wait on the GPU until
        job ``ticket``'s rows are ready; returns at once."""
        torch = _torch()
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
