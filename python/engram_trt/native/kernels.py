"""ctypes bindings to the kernel library's C ABI (``libengram_trt_plugins.so``).

The PyTorch runtime path on a GPU calls the same kernels as the TensorRT plugins
(``plugins/kernels/engramKernels.h`` is the contract): the n-gram hash, the row
gather from device or UVA-mapped host tables, the host gather (CPU threads into
pinned staging, then one copy per chunk; its bindings are in :mod:`engram_trt.native.hostgather`
and reachable from here), and the fused gate (the serving step's attention over the slot
KV cache: :mod:`engram_trt.native.attention`); Qwen4-Exp's PLE hash and fusion are bound in
:mod:`engram_trt.native.ple`. Every function takes
torch tensors, checks device, dtype, contiguity and shape before anything reaches
the library, and raises :class:`~engram_trt.errors.EngramError` with one line naming
the bad argument. Work is enqueued on the current CUDA stream of the output's device.

Choosing a gather per table: :func:`gather` reads the table on the GPU (device
memory, or pinned / registered host memory through UVA); :func:`host_gather` gathers
on the CPU's threads and sends contiguous chunks. On the H200 VM, for a pinned host
table, the second was measured 3.3-3.5x faster than the UVA kernel for 196,608 rows and
1.5-2x for 6,144 rows (two runs, ``docs/benchmarks.md``), so it is the path for host
tables.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import threading
import weakref
from importlib import metadata
from pathlib import Path
from typing import Any

from engram_trt.errors import EngramError

log = logging.getLogger(__name__)

LIBRARY_NAME = "libengram_trt_plugins.so"

# enum values of engramKernels.h
TABLE_FP8_E4M3 = 0
TABLE_BF16 = 1
TABLE_F16 = 2  # f16 / f32 rows: the GPU gather (gather, EngramGather) only, not the host gather
TABLE_F32 = 3
MASK_NONE, MASK_U8, MASK_I32 = 0, 1, 2
FLOAT_BF16, FLOAT_F32, FLOAT_F16 = 0, 1, 2  # EngramFloatType: the gate's io_type / weight_type
WEIGHT_BF16, WEIGHT_F32, WEIGHT_F16 = FLOAT_BF16, FLOAT_F32, FLOAT_F16
POINTER_KINDS = {0: "unregistered", 1: "host", 2: "device", 3: "managed"}
GATE_CLAMP = 1e-6

_lib: ctypes.CDLL | None = None
_lib_lock = threading.Lock()


def library_path() -> Path:
    """Where the library is: ``$ENGRAM_TRT_PLUGIN_LIB``, then this package's ``lib/``,
    then ``<repo>/build/`` (a source tree's own, freshest build), then the installed
    ``engram-trt`` distribution's ``engram_trt/lib/`` (when the tests import a source
    tree that was never built in place). Raises EngramError if none exists."""
    env = os.environ.get("ENGRAM_TRT_PLUGIN_LIB")
    if env:
        p = Path(env)
        if not p.is_file():
            raise EngramError(f"ENGRAM_TRT_PLUGIN_LIB='{env}' is not a file; point it at {LIBRARY_NAME} or unset it")
        return p.resolve()
    package = Path(__file__).resolve().parents[1]  # engram_trt/
    candidates = [package / "lib" / LIBRARY_NAME, package.parents[1] / "build" / LIBRARY_NAME]
    try:
        located = metadata.distribution("engram-trt").locate_file(f"engram_trt/lib/{LIBRARY_NAME}")
        candidates.append(Path(str(located)))
    except metadata.PackageNotFoundError:
        pass
    for c in candidates:
        if c.is_file():
            return c.resolve()
    raise EngramError(
        f"{LIBRARY_NAME} not found (looked in {', '.join(str(c) for c in candidates)}); "
        f"build it with `cmake -S . -B build && cmake --build build -j2` or set ENGRAM_TRT_PLUGIN_LIB")


def _declare(lib: ctypes.CDLL) -> None:
    i32, i64, f32, vp, sz = ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_size_t
    sigs = {
        "engram_trt_plugin_version": (ctypes.c_char_p, []),
        "engram_last_error": (ctypes.c_char_p, []),
        "engram_hash_check_layout": (ctypes.c_int, [vp, vp, vp, i32, i32, i32, i64, i64]),
        "engram_hash": (ctypes.c_int, [vp, i64, vp, i64, vp, vp, vp, vp, i32, i32, i32, i64, i64, vp, vp]),
        "engram_hash_layout_create": (ctypes.c_int, [vp, vp, vp, i32, i32, i32, i64, i64, ctypes.POINTER(vp)]),
        "engram_hash_layout_destroy": (ctypes.c_int, [vp]),
        "engram_hash_prepared": (ctypes.c_int, [vp, vp, i64, vp, i64, vp, vp, vp]),
        "engram_gather_check_table": (ctypes.c_int, [i32, i32, i32]),
        "engram_gather": (ctypes.c_int, [vp, i64, i32, i64, vp, vp, i64, i32, i32, i32, vp, vp, vp]),
        "engram_gather_ex": (ctypes.c_int, [vp, i64, i32, i64, vp, vp, i64, i64, i32, i32, i32, vp, vp, vp]),
        "engram_gather_part": (ctypes.c_int, [vp, i64, i32, i64, vp, vp, i64, i64, i32, i32, i32, i32, i32, vp, vp]),
        "engram_gather_raw": (ctypes.c_int, [vp, i64, vp, vp, i64, i64, i32, vp, vp, i32, vp]),
        "engram_host_gatherer_create": (ctypes.c_int, [i32, i64, i32, ctypes.POINTER(vp)]),
        "engram_host_gatherer_destroy": (ctypes.c_int, [vp]),
        "engram_host_gather": (ctypes.c_int, [vp, vp, i64, i32, i64, vp, vp, i64, i32, i32, i32, vp, vp]),
        "engram_cpu_affinity_count": (ctypes.c_int, [ctypes.POINTER(i32)]),
        "engram_host_gather_default_threads": (ctypes.c_int, [ctypes.POINTER(i32)]),
        "engram_host_gatherer_create_ex": (ctypes.c_int, [i32, i64, i32, i32, ctypes.POINTER(vp)]),
        "engram_host_gatherer_set_option": (ctypes.c_int, [vp, i32, i64]),
        "engram_host_gatherer_get_option": (ctypes.c_int, [vp, i32, ctypes.POINTER(i64)]),
        "engram_host_gatherer_wake": (ctypes.c_int, [vp]),
        "engram_host_gather_ex": (ctypes.c_int, [vp, vp, i64, i32, i64, vp, vp, i64, i32, i32, i32, i32, vp, vp]),
        "engram_host_gather_dev": (ctypes.c_int, [vp, vp, vp, i64, i32, i64, vp, vp, i64, i32, i32, i32, i32, vp, vp]),
        "engram_host_gather_raw": (ctypes.c_int, [vp, vp, i64, vp, vp, i64, i32, i32, i32, i32, vp, vp, vp]),
        "engram_host_gather_raw_dev": (ctypes.c_int, [vp, vp, vp, i64, vp, vp, i64, i32, i32, i32, i32, vp, vp, vp]),
        "engram_host_gather_rows_cpu": (ctypes.c_int, [vp, i32, vp, i64, vp, vp, i64, i32, i32, i32, i32, vp, vp,
                                                       i32, i32]),
        "engram_gate": (ctypes.c_int, [vp, vp, vp, vp, i32, vp, i32, i64, i32, i32, f32, f32, vp, vp]),
        "engram_gate_typed": (ctypes.c_int, [vp, vp, i32, vp, vp, i32, vp, i32, i64, i32, i32, f32, f32, vp, vp]),
        "engram_pointer_kind": (ctypes.c_int, [vp, ctypes.POINTER(i32)]),
        "engram_host_register": (ctypes.c_int, [vp, sz]),
        "engram_host_unregister": (ctypes.c_int, [vp]),
    }
    for name, (restype, argtypes) in sigs.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes


def load_library() -> ctypes.CDLL:
    """The loaded library (once per process)."""
    global _lib
    with _lib_lock:
        if _lib is None:
            path = library_path()
            try:
                lib = ctypes.CDLL(str(path))
                _declare(lib)
            except (OSError, AttributeError) as exc:
                raise EngramError(f"cannot load {path}: {exc}; rebuild it (cmake --build build)") from None
            _lib = lib
        return _lib


def version() -> str:
    """The library's version string (``ENGRAM_TRT_PLUGIN_VERSION``)."""
    return load_library().engram_trt_plugin_version().decode()


def _call(fn_name: str, *args: Any) -> None:
    lib = load_library()
    status = getattr(lib, fn_name)(*args)
    if status != 0:
        reason = lib.engram_last_error().decode() or f"CUDA error {status}"
        raise EngramError(f"{fn_name} failed: {reason}")


class EntryPoints:
    """A family of the library's entry points declared on first use (each binding module
    of the C ABI: attention, backbone, cache kernels): ``library()`` loads and declares
    them once; ``call(name, *args)`` raises EngramError with the library's last error."""

    def __init__(self, signatures: dict[str, list[Any]]) -> None:
        self.signatures = signatures
        self._declared = False
        self._lock = threading.Lock()
        self._unavailable: list[str | None] = []  # [] not asked yet; [None] loaded; [reason] unavailable

    def library(self) -> ctypes.CDLL:
        lib = load_library()
        with self._lock:
            if not self._declared:
                for name, argtypes in self.signatures.items():
                    fn = getattr(lib, name)
                    fn.restype = ctypes.c_int
                    fn.argtypes = argtypes
                self._declared = True
        return lib

    def call(self, fn_name: str, *args: Any) -> None:
        self.library()
        _call(fn_name, *args)

    def unavailable(self, what: str) -> str | None:
        """Why this family cannot serve (None: it can), asked once and logged once: a
        model layer's ``auto`` backend then takes its PyTorch path and ``kernels`` raises
        the reason. ``what`` names the kernels in the log line."""
        if not self._unavailable:
            try:
                self.library()
                self._unavailable.append(None)
            except (EngramError, OSError, AttributeError) as exc:
                self._unavailable.append(str(exc))
                log.warning("%s unavailable (%s); using the PyTorch path", what, exc)
        return self._unavailable[0]


class NativeHandle:
    """Owns one handle of the C ABI (a host gatherer, a gather driver): :meth:`close`
    destroys it once through ``_destroy``; a context manager, and closed when collected."""

    _handle: Any = None

    def _destroy(self, handle: Any) -> None:
        raise NotImplementedError

    def close(self) -> None:
        if self._handle is not None:
            self._destroy(self._handle)
            self._handle = None

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may be gone
            pass


# --- argument checks ------------------------------------------------------------------

def _torch() -> Any:
    import torch

    return torch


@functools.lru_cache(maxsize=None)
def capability_major(index: int | None) -> int:
    """The compute capability major of CUDA device ``index``, asked once: the kernel
    choices that depend on it (the GEMV, the warp attention kernel) are made per call."""
    return _torch().cuda.get_device_capability(index)[0]


def _check_dtype(name: str, t: Any, dtypes: tuple) -> None:
    """The type and dtype parts of :func:`_check` alone (before any device check)."""
    torch = _torch()
    if not isinstance(t, torch.Tensor):
        raise EngramError(f"{name} must be a torch.Tensor (got {type(t).__name__})")
    if t.dtype not in dtypes:
        raise EngramError(f"{name} must have dtype {' or '.join(str(d) for d in dtypes)} (got {t.dtype})")


def _check(name: str, t: Any, dtypes: tuple, ndim: int | None = None, where: str = "cuda") -> None:
    _check_dtype(name, t, dtypes)
    if ndim is not None and t.dim() != ndim:
        raise EngramError(f"{name} must be {ndim}-D (got shape {tuple(t.shape)})")
    if where == "cuda" and not t.is_cuda:
        raise EngramError(f"{name} must be a CUDA tensor (got device {t.device})")
    if where == "cpu" and t.device.type != "cpu":
        raise EngramError(f"{name} must be a CPU tensor (got device {t.device})")
    if not t.is_contiguous():
        raise EngramError(f"{name} must be contiguous (call .contiguous())")


def _same_device(device: Any, **tensors: Any) -> None:
    for name, t in tensors.items():
        if t is not None and t.is_cuda and t.device != device:
            raise EngramError(f"{name} is on {t.device} but the operation runs on {device}")


def _stream(device: Any) -> ctypes.c_void_p:
    """The current CUDA stream of ``device`` (a torch.device or an index) as the C ABI
    takes it. Through torch's raw-stream query where it has one: it skips building a
    Stream object and parsing the device, about 5 us a call on the H200 VM, where a
    cache step makes several of these calls."""
    torch = _torch()
    index = device if isinstance(device, int) else device.index
    if index is None:
        index = torch.cuda.current_device()
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return ctypes.c_void_p(raw(index) if raw is not None else torch.cuda.current_stream(index).cuda_stream)


def _device_guard(index: int) -> Any:
    """``torch.cuda.device(index)``, or no context at all where ``index`` is already the
    current device (the usual case: entering the guard costs more than the check)."""
    torch = _torch()
    return contextlib.nullcontext() if torch.cuda.current_device() == index else torch.cuda.device(index)


def _ptr(t: Any) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr() if t is not None else 0)


def pointer_kind(t: Any) -> str:
    """``'device'``, ``'host'`` (pinned / registered: the GPU can read it), ``'managed'``
    or ``'unregistered'`` (plain host memory) for a tensor's memory."""
    kind = ctypes.c_int32(-1)
    _call("engram_pointer_kind", _ptr(t), ctypes.byref(kind))
    return POINTER_KINDS.get(kind.value, "unregistered")


def register_host_memory(t: Any) -> None:
    """cudaHostRegister a CPU tensor's memory (portable, mapped), so :func:`gather` can
    read it through UVA. Undo with :func:`unregister_host_memory` before freeing it."""
    if not hasattr(t, "dtype"):
        raise EngramError(f"tensor must be a torch.Tensor (got {type(t).__name__})")
    _check("tensor", t, (t.dtype,), where="cpu")
    _call("engram_host_register", _ptr(t), ctypes.c_size_t(t.numel() * t.element_size()))


def unregister_host_memory(t: Any) -> None:
    _call("engram_host_unregister", _ptr(t))


def _layout_args(layout: Any) -> tuple:
    import numpy as np

    primes = np.ascontiguousarray(layout.primes, dtype=np.int64)
    offsets = np.ascontiguousarray(layout.offsets, dtype=np.int64)
    mult = np.ascontiguousarray(layout.multipliers, dtype=np.int64)
    L, N, H = int(layout.num_layers), int(layout.max_ngram_size), int(layout.n_heads)
    if primes.shape != (L, N - 1, H) or offsets.shape != (L, (N - 1) * H) or mult.shape != (L, N):
        raise EngramError(
            f"layout arrays must be primes [L, N-1, H], offsets [L, cols], multipliers [L, N] = "
            f"{(L, N - 1, H)}, {(L, (N - 1) * H)}, {(L, N)} (got {primes.shape}, {offsets.shape}, {mult.shape})")
    keep = (primes, offsets, mult)  # the caller holds these while the C call reads them
    args = (primes.ctypes.data_as(ctypes.c_void_p), offsets.ctypes.data_as(ctypes.c_void_p),
            mult.ctypes.data_as(ctypes.c_void_p), L, N, H, int(layout.pad_id), int(layout.compressed_vocab_size))
    return keep, args


def check_layout(layout: Any) -> None:
    """Run the kernel library's layout checks (multiplier overflow bound, int32 row ids,
    kernel limits) on an :class:`~engram_trt.layout.EngramLayout`; needs no GPU."""
    keep, args = _layout_args(layout)
    _call("engram_hash_check_layout", *args)
    del keep


# --- hash ------------------------------------------------------------------------------

class PreparedHashLayout:
    """A layout validated once and laid out as the hash kernel's parameter
    (``engram_hash_layout_create``), so each :func:`hash_packed` call only enqueues the
    kernel. It holds no device memory: one serves every device and stream, and needs no
    GPU to create. :func:`prepared_layout` keeps one per :class:`EngramLayout`."""

    def __init__(self, layout: Any) -> None:
        keep, args = _layout_args(layout)
        handle = ctypes.c_void_p()
        _call("engram_hash_layout_create", *args, ctypes.byref(handle))
        del keep  # copied into the prepared layout
        self._handle: ctypes.c_void_p | None = handle
        self.num_layers, self.max_ngram_size = int(layout.num_layers), int(layout.max_ngram_size)
        self.n_hash_cols = int(layout.n_hash_cols)

    @property
    def handle(self) -> ctypes.c_void_p:
        if self._handle is None:
            raise EngramError("this PreparedHashLayout is closed")
        return self._handle

    def close(self) -> None:
        if self._handle is not None:
            _call("engram_hash_layout_destroy", self._handle)
            self._handle = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may be gone
            pass


# One prepared layout per EngramLayout object (frozen: its arrays are not to change),
# dropped with the layout.
_prepared: "weakref.WeakKeyDictionary[Any, PreparedHashLayout]" = weakref.WeakKeyDictionary()
_prepared_lock = threading.Lock()


def prepared_layout(layout: Any) -> PreparedHashLayout:
    """The cached :class:`PreparedHashLayout` of ``layout`` (made on first use). A
    PreparedHashLayout passes through."""
    if isinstance(layout, PreparedHashLayout):
        return layout
    with _prepared_lock:
        try:
            found = _prepared.get(layout)
        except TypeError:  # not weak-referenceable / hashable: prepare per call
            return PreparedHashLayout(layout)
        if found is None:
            found = _prepared[layout] = PreparedHashLayout(layout)
        return found


def hash_packed(ids: Any, seq_starts: Any, lookback: Any, layout: Any, *, out: Any = None) -> Any:
    """Row ids ``int32 [T, L, cols]`` of packed sequences, bit-identical to
    :func:`engram_trt.hashing.hash_batch_packed`.

    ``ids [T]`` int32 compressed ids (negative = dead), ``seq_starts [S+1]`` int32
    cu_seqlens, ``lookback [S, N-1]`` int32 (the ids before each sequence, oldest
    first, -1 = none) or None (every sequence starts fresh); all on one CUDA device.
    ``layout``: an :class:`~engram_trt.layout.EngramLayout` (its prepared form is made
    once and cached, :func:`prepared_layout`) or a :class:`PreparedHashLayout`.
    """
    torch = _torch()
    _check("ids", ids, (torch.int32,), 1)
    _check("seq_starts", seq_starts, (torch.int32,), 1)
    n = int(layout.max_ngram_size) - 1
    S = seq_starts.shape[0] - 1
    if S < 0:
        raise EngramError("seq_starts must hold S+1 >= 1 entries (cu_seqlens starting at 0)")
    if lookback is not None:
        _check("lookback", lookback, (torch.int32,), 2)
        if tuple(lookback.shape) != (S, n):
            raise EngramError(f"lookback must be [S, N-1] = {(S, n)} (got {tuple(lookback.shape)})")
    T, L, cols = ids.shape[0], int(layout.num_layers), int(layout.n_hash_cols)
    if out is None:
        out = torch.empty((T, L, cols), dtype=torch.int32, device=ids.device)
    _check("out", out, (torch.int32,), 3)
    if tuple(out.shape) != (T, L, cols):
        raise EngramError(f"out must be [T, L, cols] = {(T, L, cols)} (got {tuple(out.shape)})")
    _same_device(ids.device, seq_starts=seq_starts, lookback=lookback, out=out)
    prepared = prepared_layout(layout)
    with _device_guard(ids.device.index):
        _call("engram_hash_prepared", prepared.handle, _ptr(ids), T, _ptr(seq_starts), S, _ptr(lookback),
              _ptr(out), _stream(ids.device))
    return out


# --- gather ----------------------------------------------------------------------------

def _table(rows: Any, scales: Any, quant_block: int, float_rows: bool = False) -> tuple[int, int, int]:
    """(table dtype code, num_rows, head_dim) after checking rows / scales. ``float_rows``:
    f16 and f32 tables are taken too (the GPU gather reads them; the host gather and the
    hot-row cache's work table take fp8 / bf16 only)."""
    torch = _torch()
    fp8_types = (torch.uint8,) + ((torch.float8_e4m3fn,) if hasattr(torch, "float8_e4m3fn") else ())
    floats = {torch.bfloat16: TABLE_BF16}
    if float_rows:
        floats.update({torch.float16: TABLE_F16, torch.float32: TABLE_F32})
    _check("rows", rows, fp8_types + tuple(floats), 2, where="any")
    num_rows, head_dim = rows.shape
    if rows.dtype in floats:
        if scales is not None:
            raise EngramError(f"scales must be None for a {rows.dtype} table (only fp8 tables have scales)")
        return floats[rows.dtype], num_rows, head_dim
    scale_types = (torch.uint8,) + ((torch.float8_e8m0fnu,) if hasattr(torch, "float8_e8m0fnu") else ())
    if scales is None:
        raise EngramError("an fp8 table needs scales [rows, head_dim / quant_block] (ue8m0 bytes)")
    _check("scales", scales, scale_types, 2, where="any")
    if quant_block <= 0 or head_dim % quant_block or tuple(scales.shape) != (num_rows, head_dim // quant_block):
        raise EngramError(f"scales must be [rows, head_dim / quant_block] = {(num_rows, head_dim // max(quant_block, 1))} "
                          f"(got {tuple(scales.shape)}, quant_block {quant_block})")
    return TABLE_FP8_E4M3, num_rows, head_dim


def _column_range(columns: Any, cols: int) -> int:
    """The first column of a ``columns = (begin, end)`` argument, checked against ``cols``."""
    if not (isinstance(columns, (tuple, list)) and len(columns) == 2 and all(type(c) is int for c in columns)
            and 0 <= columns[0] < columns[1] <= cols):
        raise EngramError(f"columns must be (begin, end) with 0 <= begin < end <= {cols} (the ids' columns); "
                          f"got {columns!r}")
    return columns[0]


def _ids_view(ids: Any, layer: int | None, where: str, columns: Any = None) -> tuple[int, int, int, int]:
    """(num_tokens, num_cols, token stride, byte offset of the first id) of [T, cols] or
    [T, L, cols] ids; ``columns = (begin, end)``: only those, read in place (no copy)."""
    torch = _torch()
    if columns is not None and isinstance(ids, torch.Tensor) and ids.dim() in (2, 3):
        _column_range(columns, ids.shape[-1])  # a bad range is named before any device check
    _check("ids", ids, (torch.int32,), None, where=where)
    if ids.dim() == 2:
        if layer not in (None, 0):
            raise EngramError(f"layer={layer} given for 2-D ids [T, cols]; pass [T, L, cols] ids to pick a layer")
        T, cols, stride, offset = ids.shape[0], ids.shape[1], ids.shape[1], 0
    elif ids.dim() == 3:
        T, L, cols = ids.shape
        if layer is None or not 0 <= layer < L:
            raise EngramError(f"layer must be in [0, {L}) for ids [T, L, cols] (got {layer})")
        stride, offset = L * cols, layer * cols * 4
    else:
        raise EngramError(f"ids must be [T, cols] or [T, L, cols] (got shape {tuple(ids.shape)})")
    if columns is None:
        return T, cols, stride, offset
    begin = _column_range(columns, cols)
    return T, columns[1] - begin, stride, offset + begin * 4


def _gather_out(out: Any, T: int, cols: int, head_dim: int, device: Any, dtype: Any = None) -> Any:
    """The gather's output ``[T, cols, head_dim]``: ``out`` checked, or a new tensor;
    ``dtype`` (default bf16) is the rows' type: bf16 for fp8 and bf16 tables, else the table's."""
    torch = _torch()
    dtype = torch.bfloat16 if dtype is None else dtype
    if out is None:
        return torch.empty((T, cols, head_dim), dtype=dtype, device=device)
    _check("out", out, (dtype,), 3)
    if tuple(out.shape) != (T, cols, head_dim) or out.device != device:
        raise EngramError(f"out must be {dtype} [T, cols, head_dim] = {(T, cols, head_dim)} on {device} "
                          f"(got {tuple(out.shape)} on {out.device})")
    return out


def gather(ids: Any, rows: Any, scales: Any = None, *, layer: int | None = None, quant_block: int = 32,
           out: Any = None, bad_rows: Any = None, row_offset: int = 0,
           columns: tuple[int, int] | None = None, keep_outside: bool = False, max_blocks: int = 0) -> Any:
    """Rows ``[T, cols, head_dim]`` read on the GPU: bf16 for an fp8 table (dequantized),
    the table's dtype for a bf16 / f16 / f32 table (its rows as they are, any head_dim).

    ``ids``: CUDA int32 ``[T, cols]``, or ``[T, L, cols]`` (hash output) with ``layer``.
    ``rows``: ``[num_rows, head_dim]`` fp8 bytes (uint8 / float8_e4m3fn, with ``scales``
    ``[num_rows, head_dim/quant_block]`` ue8m0 bytes) or bf16 / float16 / float32; a CUDA
    tensor, or a CPU tensor in pinned / registered memory (read through UVA). Ids outside
    the table give zero rows.

    A tensor-parallel rank's share (``distributed/sharding.py``): ``columns = (begin,
    end)`` gathers only those columns of the ids (out ``[T, end - begin, head_dim]``,
    read in place from the ids), and ``rows`` / ``scales`` may be a row slice of the
    table, global rows ``[row_offset, row_offset + num_rows)``, gathered with the global
    ids: an id outside the slice (below ``row_offset`` included) gives a zero row and is
    counted, and nothing outside the slice is read. ``row_offset`` 0 calls
    ``engram_gather`` (as before), another ``engram_gather_ex``.

    ``bad_rows``: None, or a CUDA int64 tensor of one element on ids' device: each output
    row whose id is outside ``[row_offset, row_offset + num_rows)`` adds 1 to it on the
    GPU (atomically; it is never reset here). A runtime zeroes it once, passes it to every
    gather, and reads it every N steps or in a debug mode (one small device-to-host copy,
    no sync per gather), raising on a nonzero count: a zero row from a wrong id or an
    unbound table is otherwise indistinguishable from data.

    ``keep_outside``: an output row whose id is outside the table (slice) is left as it
    is in ``out`` (required) instead of zeroed, so two gathers with disjoint slices fill
    one output (the hot-row cache's hits and misses). ``max_blocks`` > 0 caps the grid
    below one wave: a UVA gather of host rows keeps its reads in flight on a few
    multiprocessors and leaves the rest to other work. Either calls
    ``engram_gather_part``, which counts nothing (``bad_rows`` must be None).
    """
    partial = bool(keep_outside) or max_blocks != 0
    if type(max_blocks) is not int or max_blocks < 0:
        raise EngramError(f"max_blocks must be an integer >= 0 (0: one full wave of blocks); got {max_blocks!r}")
    if partial and bad_rows is not None:
        raise EngramError("keep_outside / max_blocks count no bad rows: pass bad_rows=None")
    if keep_outside and out is None:
        raise EngramError("keep_outside leaves rows of out as they are: pass the out tensor the other gather fills")
    if type(row_offset) is not int or not 0 <= row_offset <= 2**31 - 1:
        raise EngramError(f"row_offset must be an integer in [0, 2^31 - 1] (the global row id of the table's first "
                          f"row; row ids are int32); got {row_offset!r}")
    T, cols, stride, byte_offset = _ids_view(ids, layer, "cuda", columns)
    dtype, num_rows, head_dim = _table(rows, scales, quant_block, float_rows=True)
    device = ids.device
    for name, t in (("rows", rows), ("scales", scales)):
        if t is None:
            continue
        if t.is_cuda:
            _same_device(device, **{name: t})
        elif pointer_kind(t) != "host":
            raise EngramError(f"{name} is in plain host memory the GPU cannot read; pin it "
                              f"(tensor.pin_memory()) or register it (kernels.register_host_memory)")
    out = _gather_out(out, T, cols, head_dim, device, None if dtype == TABLE_FP8_E4M3 else rows.dtype)
    if bad_rows is not None:
        torch = _torch()
        _check("bad_rows", bad_rows, (torch.int64,))
        if bad_rows.numel() != 1:
            raise EngramError(f"bad_rows must hold one int64 (got shape {tuple(bad_rows.shape)})")
        _same_device(device, bad_rows=bad_rows)
    ids_ptr = ctypes.c_void_p(ids.data_ptr() + byte_offset)
    with _device_guard(device.index):
        if partial:
            _call("engram_gather_part", ids_ptr, T, cols, stride, _ptr(rows), _ptr(scales), num_rows, row_offset,
                  head_dim, dtype, quant_block, int(bool(keep_outside)), max_blocks, _ptr(out), _stream(device))
        elif row_offset == 0:  # the form every library version has
            _call("engram_gather", ids_ptr, T, cols, stride, _ptr(rows), _ptr(scales), num_rows, head_dim, dtype,
                  quant_block, _ptr(out), _ptr(bad_rows), _stream(device))
        else:
            _call("engram_gather_ex", ids_ptr, T, cols, stride, _ptr(rows), _ptr(scales), num_rows, row_offset,
                  head_dim, dtype, quant_block, _ptr(out), _ptr(bad_rows), _stream(device))
    return out


def new_bad_row_counter(device: Any = None) -> Any:
    """A zeroed int64 ``[1]`` CUDA tensor to pass as :func:`gather`'s ``bad_rows``."""
    torch = _torch()
    return torch.zeros(1, dtype=torch.int64, device="cuda" if device is None else device)


def check_bad_rows(counter: Any, *, what: str = "Engram gather", reset: bool = True) -> None:
    """Raise EngramError if the bad-row counter is nonzero (else, with ``reset``, keep it
    at 0). Reading it waits for the work queued before it (one 8-byte copy): call it every
    N steps or in a debug mode, not after every gather."""
    n = int(counter.item())
    if n:
        if reset:
            counter.zero_()
        raise EngramError(f"{what}: {n} row(s) read no table (ids outside [0, num_rows), or a table address that is "
                          f"0 / misaligned / an fp8 table without scales) and came back as zero rows; check the table "
                          f"bindings and that the tables match the engine's layout")


# --- gate ------------------------------------------------------------------------------

def _float_code(dtype: Any) -> int:
    torch = _torch()
    return {torch.bfloat16: FLOAT_BF16, torch.float16: FLOAT_F16, torch.float32: FLOAT_F32}[dtype]


def gate(hidden: Any, kv: Any, q_weight: Any, k_weight: Any, mask: Any = None, *, eps: float,
         clamp: float = GATE_CLAMP, out: Any = None) -> Any:
    """The fused Engram gate (engram-spec.md "Fusion"): ``[T, hc, D]`` in hidden's dtype.

    ``hidden [T, hc, D]``, ``kv [T, (hc+1)*D]`` and ``out`` share one dtype: bf16,
    fp16 or float32 (fp32 math inside, the output rounded once to that dtype);
    ``q_weight`` / ``k_weight`` ``[hc, D]`` both bf16, both float32 or both hidden's
    dtype; ``mask [T]`` bool / uint8 / int8 / int32 (0 = dead token: gate 0, out =
    hidden bit for bit) or None. ``out`` may be ``hidden`` (in place).
    """
    torch = _torch()
    io_dtypes = (torch.bfloat16, torch.float16, torch.float32)
    _check_dtype("hidden", hidden, io_dtypes)
    # one I/O dtype per call: refuse a mix before anything else (no silent conversion)
    io = {name: t.dtype for name, t in (("hidden", hidden), ("kv", kv), ("out", out)) if isinstance(t, torch.Tensor)}
    if len(set(io.values())) > 1:
        raise EngramError("hidden, kv and out must share one dtype (bfloat16, float16 or float32); got "
                          + ", ".join(f"{name} {dtype}" for name, dtype in io.items()))
    weight_dtypes = tuple(dict.fromkeys((torch.bfloat16, torch.float32, hidden.dtype)))
    _check_dtype("q_weight", q_weight, weight_dtypes)
    _check_dtype("k_weight", k_weight, (q_weight.dtype,))
    _check("hidden", hidden, io_dtypes, 3)
    T, hc, D = hidden.shape
    _check("kv", kv, (hidden.dtype,), 2)
    if tuple(kv.shape) != (T, (hc + 1) * D):
        raise EngramError(f"kv must be [T, (hc_mult+1)*D] = {(T, (hc + 1) * D)} (got {tuple(kv.shape)})")
    _check("q_weight", q_weight, weight_dtypes, 2)
    _check("k_weight", k_weight, (q_weight.dtype,), 2)
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if tuple(w.shape) != (hc, D):
            raise EngramError(f"{name} must be [hc_mult, D] = {(hc, D)} (got {tuple(w.shape)})")
    mask_type = MASK_NONE
    if mask is not None:
        _check("mask", mask, (torch.bool, torch.uint8, torch.int8, torch.int32), 1)
        if mask.shape[0] != T:
            raise EngramError(f"mask must be [T] = ({T},) (got {tuple(mask.shape)})")
        mask_type = MASK_I32 if mask.dtype == torch.int32 else MASK_U8
    if out is None:
        out = torch.empty_like(hidden)
    _check("out", out, (hidden.dtype,), 3)
    if out.shape != hidden.shape:
        raise EngramError(f"out must be [T, hc_mult, D] = {tuple(hidden.shape)} (got {tuple(out.shape)})")
    _same_device(hidden.device, kv=kv, q_weight=q_weight, k_weight=k_weight, mask=mask, out=out)
    with _device_guard(hidden.device.index):
        _call("engram_gate_typed", _ptr(hidden), _ptr(kv), _float_code(hidden.dtype), _ptr(q_weight), _ptr(k_weight),
              _float_code(q_weight.dtype), _ptr(mask), mask_type, T, hc, D, ctypes.c_float(eps), ctypes.c_float(clamp),
              _ptr(out), _stream(hidden.device))
    return out
