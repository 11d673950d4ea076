"""ctypes bindings of the host gather (``runtime/hostGatherApi.cpp``, same C ABI as the kernels).

CPU threads gather a host table's rows into pinned staging and each chunk goes to the
GPU in one contiguous copy, pipelined; fp8 chunks are dequantized on the GPU. Why it
exists: on the H200 VM random GPU reads of host memory (the UVA kernel) reach a tenth of
the PCIe link, while CPU gather + one copy per chunk approaches it (docs/benchmarks.md).
Which path is faster is machine- and size-dependent: :mod:`engram_trt.runtime.gatherpath`
measures it at start-up.

Host tables come in three layouts: ``split`` (rows ``[N, head_dim]`` + scales
``[N, head_dim / quant_block]``, what :func:`engram_trt.native.gather.gather` reads),
``inline`` (one ``[N, head_dim + head_dim / quant_block]`` byte array, each row's scale
bytes after it: one CPU cache and TLB miss per random row instead of two) and
``hbm-scales`` (fp8: the split rows in host memory, the scales on the gatherer's GPU).
Why the third: the CPU part is bound by the DRAM lines the threads fetch. A 256-byte row
is 4 lines; with its 8 scale bytes, inline or in the split scale array, it is 5. With the
scales in HBM (3% of the table: 0.75 GiB per 24 GiB) the CPU copies 4 lines a row and the
GPU's dequant reads each row's scale bytes by id (which is why the call needs the ids on
the GPU too). The raw gather (:meth:`HostGatherer.gather_raw`, a device row cache's fetch)
takes it as well: the values cross the link in one copy per chunk and a kernel gathers
the scale bytes from HBM into the destination's scale array.
"""

from __future__ import annotations

import ctypes
import logging
import os
from typing import Any

from engram_trt.errors import EngramError
from engram_trt.native.gather import TABLE_BF16, TABLE_FP8_E4M3, gather_out, ids_view, table_code
from engram_trt.native.library import EntryPoints, NativeHandle, check, device_guard, ptr, stream_of, torch_module

log = logging.getLogger(__name__)

_i32, _i64, _vp = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
_ENTRY = EntryPoints(
    {
        "engram_host_gatherer_create": [_i32, _i64, _i32, ctypes.POINTER(_vp)],
        "engram_host_gatherer_destroy": [_vp],
        "engram_host_gather": [_vp, _vp, _i64, _i32, _i64, _vp, _vp, _i64, _i32, _i32, _i32, _vp, _vp],
        "engram_cpu_affinity_count": [ctypes.POINTER(_i32)],
        "engram_host_gather_default_threads": [ctypes.POINTER(_i32)],
        "engram_host_gatherer_create_ex": [_i32, _i64, _i32, _i32, ctypes.POINTER(_vp)],
        "engram_host_gatherer_set_option": [_vp, _i32, _i64],
        "engram_host_gatherer_get_option": [_vp, _i32, ctypes.POINTER(_i64)],
        "engram_host_gatherer_wake": [_vp],
        "engram_host_gather_ex": [_vp, _vp, _i64, _i32, _i64, _vp, _vp, _i64, _i32, _i32, _i32, _i32, _vp, _vp],
        "engram_host_gather_dev": [_vp, _vp, _vp, _i64, _i32, _i64, _vp, _vp, _i64, _i32, _i32, _i32, _i32, _vp, _vp],
        "engram_host_gather_raw": [_vp, _vp, _i64, _vp, _vp, _i64, _i32, _i32, _i32, _i32, _vp, _vp, _vp],
        "engram_host_gather_raw_dev": [_vp, _vp, _vp, _i64, _vp, _vp, _i64, _i32, _i32, _i32, _i32, _vp, _vp, _vp],
        "engram_host_gather_rows_cpu": [
            _vp,
            _i32,
            _vp,
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
            _i32,
            _i32,
        ],
    }
)
library = _ENTRY.library
_call = _ENTRY.call

TABLE_LAYOUTS = {"split": 0, "inline": 1, "hbm-scales": 2}  # EngramTableLayout of the host gather
# EngramHostGatherOption: the host gatherer's knobs (see HOST_GATHER_READ_ONLY)
HOST_GATHER_OPTIONS = {
    "chunk_rows": 0,
    "min_chunks": 1,
    "task_rows": 2,
    "prefetch_rows": 3,
    "streaming_stores": 4,
    "spin_us": 5,
    "num_threads": 6,
    "num_slots": 7,
    "slot_bytes": 8,
    "prefetch_far_rows": 9,
    "prefetch_locality": 10,
    "job_staging_bytes": 11,
}
HOST_GATHER_READ_ONLY = ("num_threads", "num_slots", "slot_bytes")
# Defaults from the H200 VM (docs/benchmarks.md, `engram-trt bench gather` sweeps): with
# 2048-row chunks and 8 slots an 8k-token prefill chunk overlapped its copies best and a
# decode step was fastest; the staging is 8 x 2 MiB pinned + 8 x 2 MiB on the device.
DEFAULT_CHUNK_ROWS = 2048
DEFAULT_SLOTS = 8


def host_table(rows: Any, scales: Any, quant_block: int, layout: str) -> tuple[int, int, int, int]:
    """(table dtype code, num_rows, head_dim, layout code) of a split or inline host table.

    An inline table is fp8 ``[num_rows, head_dim + head_dim / quant_block]`` bytes (each
    row's ue8m0 scale bytes after its values) with ``scales=None``."""
    if layout not in TABLE_LAYOUTS:
        raise EngramError(f"layout must be one of {', '.join(map(repr, TABLE_LAYOUTS))} (got {layout!r})")
    if layout in ("split", "hbm-scales"):
        table = table_code(rows, scales, quant_block)
        if layout == "hbm-scales" and table[0] != TABLE_FP8_E4M3:
            raise EngramError("layout 'hbm-scales' is for fp8 tables (a bf16 table has no scales): use 'split'")
        return (*table, TABLE_LAYOUTS[layout])
    torch = torch_module()
    if scales is not None:
        raise EngramError("an inline table keeps its scale bytes in its rows: pass scales=None with layout='inline'")
    check("rows", rows, (torch.uint8,), 2, where="any")
    num_rows, width = rows.shape
    head_dim = width * quant_block // (quant_block + 1) if quant_block > 0 else 0
    if quant_block <= 0 or head_dim + head_dim // max(quant_block, 1) != width or head_dim % quant_block:
        raise EngramError(
            f"an inline fp8 table is [rows, head_dim + head_dim / quant_block] bytes; width {width} "
            f"fits no head_dim for quant_block {quant_block}"
        )
    return TABLE_FP8_E4M3, num_rows, head_dim, TABLE_LAYOUTS["inline"]


def _flat_ids_cpu(ids: Any) -> int:
    torch = torch_module()
    check("ids", ids, (torch.int32,), 1, where="cpu")
    return int(ids.shape[0])


def default_gather_threads() -> int:
    """Threads a host gatherer uses by default: one less than the CPUs in this thread's
    affinity mask (``sched_getaffinity``, not the machine's CPU count, so ranks sharing a
    node with their own CPU lists do not oversubscribe it), at least 1. The CPU left free
    is for the thread that launches the model: one preempted worker stalls a whole round
    of the pool (runtime/threadPool.h)."""
    count = ctypes.c_int32(0)
    _call("engram_host_gather_default_threads", ctypes.byref(count))
    return int(count.value)


def gather_rows_cpu(
    ids: Any,
    rows: Any,
    scales: Any = None,
    *,
    quant_block: int = 32,
    layout: str = "split",
    num_threads: int = 0,
    prefetch_rows: int = -1,
    streaming_stores: int = -1,
    gatherer: "HostGatherer | None" = None,
    out_rows: Any = None,
    out_scales: Any = None,
) -> tuple[Any, Any]:
    """The host gather's CPU part alone (no GPU): ``(rows, scales)`` of ``ids`` (CPU int32
    ``[n]``) in the split form, as CPU tensors (fp8: uint8 ``[n, head_dim]`` and
    ``[n, head_dim / quant_block]``; bf16: bf16 ``[n, head_dim]`` and None), written into
    ``out_rows`` / ``out_scales`` when given (e.g. pinned buffers, to time the gather
    apart from first-touch page faults). Runs on ``gatherer``'s threads and tuning, else
    on ``num_threads`` threads (0: the affinity count); ``prefetch_rows`` /
    ``streaming_stores`` >= 0 override the tuning. Ids outside the table give zero rows
    with scale bytes 127. ``layout='hbm-scales'``: the values alone (what its CPU threads
    copy; ``scales`` may be on the GPU and is not read), so the scales returned are None."""
    torch = torch_module()
    n = _flat_ids_cpu(ids)
    dtype, num_rows, head_dim, layout_code = host_table(rows, scales, quant_block, layout)
    hbm = layout == "hbm-scales"
    for name, t in (("rows", rows), ("scales", None if hbm else scales)):
        if t is not None and t.device.type != "cpu":
            raise EngramError(f"{name} must be a CPU tensor for the host gather (got {t.device})")
    want = [("out_rows", out_rows, torch.bfloat16 if dtype == TABLE_BF16 else torch.uint8, head_dim)]
    if dtype == TABLE_BF16 or hbm:
        out_scales = None
    else:
        want.append(("out_scales", out_scales, torch.uint8, head_dim // quant_block))
    made = []
    for name, t, dt, width in want:
        if t is None:
            t = torch.empty((n, width), dtype=dt)
        else:
            check(name, t, (dt,), 2, where="cpu")
            if t.shape[0] < n or t.shape[1] != width:
                raise EngramError(f"{name} must be [>= {n}, {width}] (got {tuple(t.shape)})")
        made.append(t)
    out_rows = made[0]
    out_scales = made[1] if len(made) > 1 else None
    handle = None
    if gatherer is not None:
        handle = gatherer._require_open()
    _call(
        "engram_host_gather_rows_cpu",
        handle,
        int(num_threads),
        ptr(ids),
        n,
        ptr(rows),
        ptr(None if hbm else scales),
        num_rows,
        head_dim,
        dtype,
        quant_block,
        layout_code,
        ptr(out_rows),
        ptr(out_scales),
        int(prefetch_rows),
        int(streaming_stores),
    )
    return out_rows[:n], (None if out_scales is None else out_scales[:n])


_OPENMP_WARNED = False


def _warn_openmp_policy() -> None:
    """Once per process: say so when torch's OpenMP workers may spin on the gather's
    cores (torch was imported before engram_trt without OMP_WAIT_POLICY set)."""
    global _OPENMP_WARNED
    if _OPENMP_WARNED or os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE":
        return
    _OPENMP_WARNED = True
    log.warning(
        "OMP_WAIT_POLICY is %r: torch's OpenMP workers busy-wait after each parallel CPU operation and slow "
        "the host gather up to 50x (docs/benchmarks.md); set OMP_WAIT_POLICY=PASSIVE before torch is imported, "
        "or import engram_trt first",
        os.environ.get("OMP_WAIT_POLICY", "unset"),
    )


class HostGatherer(NativeHandle):
    """Gathers rows of host tables on CPU threads into pinned staging and sends each
    chunk in one copy (pipelined: the copies of chunks overlap the gather of the next).

    One gatherer owns ``num_slots`` pinned and as many device staging slots of
    ``chunk_rows`` rows of up to ``max_head_dim`` bf16 elements, a copy stream and a
    thread pool of ``num_threads`` (0 = :func:`default_gather_threads`, one less than the CPUs of this
    process's affinity mask; the calling thread is one of them). Calls are serialized.
    Create it once per device and keep it; :meth:`set_options` tunes it
    (``HOST_GATHER_OPTIONS``; runtime/README.md says what each knob does).
    """

    def __init__(
        self,
        num_threads: int = 0,
        chunk_rows: int = DEFAULT_CHUNK_ROWS,
        max_head_dim: int = 512,
        device: Any = None,
        num_slots: int = DEFAULT_SLOTS,
    ) -> None:
        torch = torch_module()
        self.device = torch.device("cuda") if device is None else torch.device(device)
        if self.device.type != "cuda":
            raise EngramError(f"device must be a CUDA device (got {self.device})")
        if self.device.index is None:  # "cuda" means the current device: name it, so device checks compare equal
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.max_head_dim = int(max_head_dim)
        handle = ctypes.c_void_p()
        with torch.cuda.device(self.device):
            _call(
                "engram_host_gatherer_create_ex",
                int(num_threads),
                int(chunk_rows),
                self.max_head_dim,
                int(num_slots),
                ctypes.byref(handle),
            )
        self._handle: ctypes.c_void_p | None = handle
        _warn_openmp_policy()

    def _require_open(self) -> ctypes.c_void_p:
        if self._handle is None:
            raise EngramError("this HostGatherer is closed")
        return self._handle

    def set_options(self, **options: int) -> None:
        """Set tuning knobs by name, e.g. ``set_options(prefetch_rows=16, streaming_stores=0)``."""
        handle = self._require_open()
        for name, value in options.items():
            if name not in HOST_GATHER_OPTIONS or name in HOST_GATHER_READ_ONLY:
                settable = [k for k in HOST_GATHER_OPTIONS if k not in HOST_GATHER_READ_ONLY]
                raise EngramError(f"unknown or read-only host gather option {name!r}; settable: {', '.join(settable)}")
            _call("engram_host_gatherer_set_option", handle, HOST_GATHER_OPTIONS[name], int(value))

    def options(self) -> dict[str, int]:
        """Every knob's current value (``HOST_GATHER_OPTIONS``)."""
        handle = self._require_open()
        value = ctypes.c_int64(0)
        out = {}
        for name, code in HOST_GATHER_OPTIONS.items():
            _call("engram_host_gatherer_get_option", handle, code, ctypes.byref(value))
            out[name] = int(value.value)
        return out

    def wake(self) -> None:
        """Make the pool's sleeping threads spin again, and its spinning ones spin ``spin_us``
        from now: call it when a gather is imminent."""
        _call("engram_host_gatherer_wake", self._require_open())

    def _check_host_table(self, rows: Any, scales: Any, quant_block: int, layout: str) -> tuple[int, int, int, int]:
        table = host_table(rows, scales, quant_block, layout)
        hbm = layout == "hbm-scales"
        for name, t in (("rows", rows), ("scales", None if hbm else scales)):
            if t is not None and t.device.type != "cpu":
                raise EngramError(
                    f"{name} must be a CPU tensor for the host gather (got {t.device}); "
                    f"use engram_trt.native.gather.gather"
                )
        if hbm and scales.device != self.device:
            raise EngramError(
                f"layout 'hbm-scales' reads the scales on the gatherer's device {self.device} (got them "
                f"on {scales.device}): copy them there once, e.g. scales.to('{self.device}')"
            )
        if table[2] > self.max_head_dim:
            raise EngramError(f"head_dim {table[2]} exceeds this gatherer's max_head_dim {self.max_head_dim}")
        return table

    def gather(
        self,
        ids: Any,
        rows: Any,
        scales: Any = None,
        *,
        layer: int | None = None,
        quant_block: int = 32,
        out: Any = None,
        layout: str = "split",
        ids_dev: Any = None,
    ) -> Any:
        """Same contract as :func:`engram_trt.native.gather.gather`, but ``ids``, ``rows`` and ``scales`` are CPU
        tensors (any host memory: pinned, registered, heap or a file mapping) and ``out``
        is on the gatherer's device. ``layout='inline'``: ``rows`` is an inline fp8 table
        ``[num_rows, head_dim + head_dim / quant_block]`` and ``scales`` None.
        ``layout='hbm-scales'``: ``scales`` is on the gatherer's device, and so is
        ``ids_dev``, a copy of ``ids`` (same shape; ready on the current stream, as the hash
        kernel's output is); without it ``ids`` is copied up first. Returns once every chunk
        is gathered and its copy enqueued on the device's current stream."""
        torch = torch_module()
        handle = self._require_open()
        T, cols, stride, byte_offset = ids_view(ids, layer, "cpu")
        dtype, num_rows, head_dim, layout_code = self._check_host_table(rows, scales, quant_block, layout)
        out = gather_out(out, T, cols, head_dim, self.device)
        dev_ptr = None
        if layout == "hbm-scales":
            if ids_dev is None:
                ids_dev = ids.to(self.device)
            check("ids_dev", ids_dev, (torch.int32,), ids.dim())
            if (
                tuple(ids_dev.shape) != tuple(ids.shape)
                or ids_dev.stride() != ids.stride()
                or ids_dev.device != self.device
            ):
                raise EngramError(
                    f"ids_dev must be ids {tuple(ids.shape)} with the same strides on {self.device} "
                    f"(got {tuple(ids_dev.shape)}, strides {ids_dev.stride()}, on {ids_dev.device})"
                )
            dev_ptr = ctypes.c_void_p(ids_dev.data_ptr() + byte_offset)
        with device_guard(self.device.index):
            _call(
                "engram_host_gather_dev",
                handle,
                ctypes.c_void_p(ids.data_ptr() + byte_offset),
                dev_ptr,
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
                stream_of(self.device),
            )
        return out

    def bind(self, rows: Any, scales: Any = None, *, quant_block: int = 32, layout: str = "split") -> "BoundHostGather":
        """:meth:`gather` from one host table, the table checked once here
        (:class:`BoundHostGather`)."""
        return BoundHostGather(self, rows, scales, quant_block=quant_block, layout=layout)

    def gather_raw(
        self,
        ids: Any,
        rows: Any,
        scales: Any = None,
        *,
        dst_rows: Any,
        dst_scales: Any = None,
        quant_block: int = 32,
        layout: str = "split",
        ids_dev: Any = None,
    ) -> None:
        """Rows ``ids`` (CPU int32 ``[n]``) of a host table in their stored form into device
        arrays: ``dst_rows`` uint8 ``[>= n, head_dim]`` (bf16 tables: bf16) and, for fp8,
        ``dst_scales`` uint8 ``[>= n, head_dim / quant_block]`` (the split form
        :func:`gather` reads, whatever the host layout). For a device row cache: no
        dequant, the copies ordered after the current stream's earlier work, and the
        stream waits for them. ``layout='hbm-scales'``: ``scales`` is the table's scale
        array on the gatherer's device and ``ids_dev`` the same ids there (int32 ``[n]``,
        ready on the current stream; without it ``ids`` is copied up first): the CPU
        threads copy the values alone and a kernel gathers the scale bytes in HBM."""
        torch = torch_module()
        handle = self._require_open()
        n = _flat_ids_cpu(ids)
        dtype, num_rows, head_dim, layout_code = self._check_host_table(rows, scales, quant_block, layout)
        want = (torch.bfloat16,) if dtype == TABLE_BF16 else (torch.uint8,)
        check("dst_rows", dst_rows, want, 2)
        if dst_rows.shape[0] < n or dst_rows.shape[1] != head_dim or dst_rows.device != self.device:
            raise EngramError(
                f"dst_rows must be [>= {n}, {head_dim}] on {self.device} "
                f"(got {tuple(dst_rows.shape)} on {dst_rows.device})"
            )
        if dtype == TABLE_FP8_E4M3:
            if dst_scales is None:
                raise EngramError("an fp8 table needs dst_scales [>= n, head_dim / quant_block] uint8")
            check("dst_scales", dst_scales, (torch.uint8,), 2)
            if (
                dst_scales.shape[0] < n
                or dst_scales.shape[1] != head_dim // quant_block
                or dst_scales.device != self.device
            ):
                raise EngramError(
                    f"dst_scales must be [>= {n}, {head_dim // quant_block}] on {self.device} "
                    f"(got {tuple(dst_scales.shape)} on {dst_scales.device})"
                )
        if layout == "hbm-scales":
            if ids_dev is None:
                ids_dev = ids.to(self.device)
            check("ids_dev", ids_dev, (torch.int32,), 1)
            if ids_dev.shape[0] != n or ids_dev.device != self.device:
                raise EngramError(
                    f"ids_dev must be the {n} ids on {self.device} (got {ids_dev.shape[0]} on {ids_dev.device})"
                )
        else:
            ids_dev = None
        with device_guard(self.device.index):
            _call(
                "engram_host_gather_raw_dev",
                handle,
                ptr(ids),
                ptr(ids_dev),
                n,
                ptr(rows),
                ptr(scales),
                num_rows,
                head_dim,
                dtype,
                quant_block,
                layout_code,
                ptr(dst_rows),
                ptr(dst_scales if dtype == TABLE_FP8_E4M3 else None),
                stream_of(self.device),
            )

    def _destroy(self, handle: Any) -> None:
        _call("engram_host_gatherer_destroy", handle)


class BoundHostGather:
    """:meth:`HostGatherer.gather` bound to one host table (rows, scales, quant block and
    layout checked once): each call passes 2-D ids ``[T, cols]`` (CPU int32), ``out``
    (bf16 ``[T, cols, head_dim]`` on the gatherer's device; checked when it is another
    tensor or shape than the last call's) and, for ``hbm-scales``, ``ids_dev`` (the same
    ids on the device). Same output, bit for bit.

    Why: a caller that gathers from the same table every step (a benchmark, a decode
    loop) pays the table's checks on every call otherwise; on the H200 VM the Python
    around the library call is ~25-35 us, a third of a 6,144-row decode step's gather
    (``bench gather --call``). The runtime's own host path makes the library call from the
    gather driver's thread, with no Python per step."""

    def __init__(
        self, gatherer: HostGatherer, rows: Any, scales: Any = None, *, quant_block: int = 32, layout: str = "split"
    ) -> None:
        dtype, num_rows, head_dim, layout_code = gatherer._check_host_table(rows, scales, quant_block, layout)
        self.gatherer, self.head_dim, self.layout = gatherer, head_dim, layout
        self.device = gatherer.device
        self._keep = (rows, scales)
        self._table = (ptr(rows), ptr(scales), num_rows, head_dim, dtype, quant_block, layout_code)
        self._out: tuple[Any, Any] = (None, None)  # (out, its shape) last checked

    def __call__(self, ids: Any, out: Any, ids_dev: Any = None) -> Any:
        torch = torch_module()
        check("ids", ids, (torch.int32,), 2, where="cpu")
        T, cols = int(ids.shape[0]), int(ids.shape[1])
        if self._out[0] is not out or self._out[1] != out.shape:
            gather_out(out, T, cols, self.head_dim, self.device)
            self._out = (out, out.shape)
        elif out.shape[0] != T or out.shape[1] != cols:
            raise EngramError(
                f"out must be bf16 [T, cols, head_dim] = {(T, cols, self.head_dim)} (got {tuple(out.shape)})"
            )
        dev_ptr = None
        if self.layout == "hbm-scales":
            if (
                ids_dev is None
                or ids_dev.device != self.device
                or ids_dev.shape != ids.shape
                or ids_dev.dtype != torch.int32
                or not ids_dev.is_contiguous()
            ):
                raise EngramError(
                    f"layout 'hbm-scales' needs ids_dev: the ids {tuple(ids.shape)} as contiguous int32 "
                    f"on {self.device}"
                )
            dev_ptr = ptr(ids_dev)
        with device_guard(self.device.index):
            _call(
                "engram_host_gather_dev",
                self.gatherer._require_open(),
                ptr(ids),
                dev_ptr,
                T,
                cols,
                cols,
                *self._table,
                ptr(out),
                stream_of(self.device),
            )
        return out


_default_gatherers: dict[tuple[Any, int], HostGatherer] = {}
# Staging bytes per slot of a default gatherer: 2048 rows of 512 bf16 values (2 MiB, eight
# slots pinned and eight on the device); wider rows get fewer rows per chunk, so the
# staging stays that size.
_DEFAULT_SLOT_ELEMS = DEFAULT_CHUNK_ROWS * 512


def _default_gatherer(device: Any, head_dim: int) -> HostGatherer:
    """The device's default gatherer for rows of ``head_dim`` elements: one per width
    class (512, then powers of two above), made on first use and kept (a gatherer's
    staging may still feed an enqueued copy, so none is replaced)."""
    width = 512
    while width < head_dim:
        width *= 2
    key = (device, width)
    g = _default_gatherers.get(key)
    if g is None:
        g = _default_gatherers[key] = HostGatherer(
            device=device, max_head_dim=width, chunk_rows=max(256, _DEFAULT_SLOT_ELEMS // width)
        )
    return g


def host_gather(
    ids: Any,
    rows: Any,
    scales: Any = None,
    *,
    layer: int | None = None,
    quant_block: int = 32,
    out: Any = None,
    device: Any = None,
    gatherer: HostGatherer | None = None,
    layout: str = "split",
) -> Any:
    """:meth:`HostGatherer.gather` through ``gatherer`` or the device's default one for
    the table's row width."""
    torch = torch_module()
    if gatherer is None:
        dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        _, _, head_dim, _ = host_table(rows, scales, quant_block, layout)  # bad tables fail here, named
        gatherer = _default_gatherer(dev, head_dim)
    return gatherer.gather(ids, rows, scales, layer=layer, quant_block=quant_block, out=out, layout=layout)
