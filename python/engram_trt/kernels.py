"""ctypes bindings to the kernel library's C ABI (``libengram_trt_plugins.so``).

The PyTorch runtime path on a GPU calls the same kernels as the TensorRT plugins
(``plugins/kernels/engramKernels.h`` is the contract): the n-gram hash, the row
gather from device or UVA-mapped host tables, the host gather (CPU threads into
pinned staging, then one copy per chunk), and the fused gate. Every function takes
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

import ctypes
import os
import threading
from importlib import metadata
from pathlib import Path
from typing import Any

from engram_trt.errors import EngramError

LIBRARY_NAME = "libengram_trt_plugins.so"

# enum values of engramKernels.h
TABLE_FP8_E4M3 = 0
TABLE_BF16 = 1
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
    candidates = [Path(__file__).resolve().parent / "lib" / LIBRARY_NAME,
                  Path(__file__).resolve().parents[2] / "build" / LIBRARY_NAME]
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
        "engram_gather_check_table": (ctypes.c_int, [i32, i32, i32]),
        "engram_gather": (ctypes.c_int, [vp, i64, i32, i64, vp, vp, i64, i32, i32, i32, vp, vp]),
        "engram_host_gatherer_create": (ctypes.c_int, [i32, i64, i32, ctypes.POINTER(vp)]),
        "engram_host_gatherer_destroy": (ctypes.c_int, [vp]),
        "engram_host_gather": (ctypes.c_int, [vp, vp, i64, i32, i64, vp, vp, i64, i32, i32, i32, vp, vp]),
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


# --- argument checks ------------------------------------------------------------------

def _torch() -> Any:
    import torch

    return torch


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
    return ctypes.c_void_p(_torch().cuda.current_stream(device).cuda_stream)


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

def hash_packed(ids: Any, seq_starts: Any, lookback: Any, layout: Any, *, out: Any = None) -> Any:
    """Row ids ``int32 [T, L, cols]`` of packed sequences, bit-identical to
    :func:`engram_trt.hashing.hash_batch_packed`.

    ``ids [T]`` int32 compressed ids (negative = dead), ``seq_starts [S+1]`` int32
    cu_seqlens, ``lookback [S, N-1]`` int32 (the ids before each sequence, oldest
    first, -1 = none) or None (every sequence starts fresh); all on one CUDA device.
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
    keep, args = _layout_args(layout)
    with torch.cuda.device(ids.device):
        _call("engram_hash", _ptr(ids), T, _ptr(seq_starts), S, _ptr(lookback), *args,
              _ptr(out), _stream(ids.device))
    del keep
    return out


# --- gather ----------------------------------------------------------------------------

def _table(rows: Any, scales: Any, quant_block: int) -> tuple[int, int, int]:
    """(table dtype code, num_rows, head_dim) after checking rows / scales."""
    torch = _torch()
    fp8_types = (torch.uint8,) + ((torch.float8_e4m3fn,) if hasattr(torch, "float8_e4m3fn") else ())
    _check("rows", rows, fp8_types + (torch.bfloat16,), 2, where="any")
    num_rows, head_dim = rows.shape
    if rows.dtype == torch.bfloat16:
        if scales is not None:
            raise EngramError("scales must be None for a bf16 table")
        return TABLE_BF16, num_rows, head_dim
    scale_types = (torch.uint8,) + ((torch.float8_e8m0fnu,) if hasattr(torch, "float8_e8m0fnu") else ())
    if scales is None:
        raise EngramError("an fp8 table needs scales [rows, head_dim / quant_block] (ue8m0 bytes)")
    _check("scales", scales, scale_types, 2, where="any")
    if quant_block <= 0 or head_dim % quant_block or tuple(scales.shape) != (num_rows, head_dim // quant_block):
        raise EngramError(f"scales must be [rows, head_dim / quant_block] = {(num_rows, head_dim // max(quant_block, 1))} "
                          f"(got {tuple(scales.shape)}, quant_block {quant_block})")
    return TABLE_FP8_E4M3, num_rows, head_dim


def _ids_view(ids: Any, layer: int | None, where: str) -> tuple[int, int, int, int]:
    """(num_tokens, num_cols, token stride, byte offset of the layer) of [T, cols] or [T, L, cols] ids."""
    torch = _torch()
    _check("ids", ids, (torch.int32,), None, where=where)
    if ids.dim() == 2:
        if layer not in (None, 0):
            raise EngramError(f"layer={layer} given for 2-D ids [T, cols]; pass [T, L, cols] ids to pick a layer")
        return ids.shape[0], ids.shape[1], ids.shape[1], 0
    if ids.dim() == 3:
        T, L, cols = ids.shape
        if layer is None or not 0 <= layer < L:
            raise EngramError(f"layer must be in [0, {L}) for ids [T, L, cols] (got {layer})")
        return T, cols, L * cols, layer * cols * 4
    raise EngramError(f"ids must be [T, cols] or [T, L, cols] (got shape {tuple(ids.shape)})")


def _gather_out(out: Any, T: int, cols: int, head_dim: int, device: Any) -> Any:
    torch = _torch()
    if out is None:
        return torch.empty((T, cols, head_dim), dtype=torch.bfloat16, device=device)
    _check("out", out, (torch.bfloat16,), 3)
    if tuple(out.shape) != (T, cols, head_dim) or out.device != device:
        raise EngramError(f"out must be bf16 [T, cols, head_dim] = {(T, cols, head_dim)} on {device} "
                          f"(got {tuple(out.shape)} on {out.device})")
    return out


def gather(ids: Any, rows: Any, scales: Any = None, *, layer: int | None = None, quant_block: int = 32,
           out: Any = None) -> Any:
    """bf16 rows ``[T, cols, head_dim]`` read on the GPU.

    ``ids``: CUDA int32 ``[T, cols]``, or ``[T, L, cols]`` (hash output) with ``layer``.
    ``rows``: ``[num_rows, head_dim]`` fp8 bytes (uint8 / float8_e4m3fn, with ``scales``
    ``[num_rows, head_dim/quant_block]`` ue8m0 bytes) or bf16; a CUDA tensor, or a CPU
    tensor in pinned / registered memory (read through UVA). Ids outside the table give
    zero rows.
    """
    T, cols, stride, byte_offset = _ids_view(ids, layer, "cuda")
    dtype, num_rows, head_dim = _table(rows, scales, quant_block)
    device = ids.device
    for name, t in (("rows", rows), ("scales", scales)):
        if t is None:
            continue
        if t.is_cuda:
            _same_device(device, **{name: t})
        elif pointer_kind(t) != "host":
            raise EngramError(f"{name} is in plain host memory the GPU cannot read; pin it "
                              f"(tensor.pin_memory()) or register it (kernels.register_host_memory)")
    out = _gather_out(out, T, cols, head_dim, device)
    with _torch().cuda.device(device):
        _call("engram_gather", ctypes.c_void_p(ids.data_ptr() + byte_offset), T, cols, stride, _ptr(rows),
              _ptr(scales), num_rows, head_dim, dtype, quant_block, _ptr(out), _stream(device))
    return out


class HostGatherer:
    """Gathers rows of host tables on CPU threads into pinned staging and sends each
    chunk in one copy (pipelined: the copy of a chunk overlaps the gather of the next).

    One gatherer owns two pinned and two device staging slots of ``chunk_rows`` rows of
    up to ``max_head_dim`` elements, and a thread pool (``num_threads``; 0 = all CPUs).
    Calls are serialized. Create it once per device and keep it.
    """

    def __init__(self, num_threads: int = 0, chunk_rows: int = 16384, max_head_dim: int = 512,
                 device: Any = None) -> None:
        torch = _torch()
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if self.device.type != "cuda":
            raise EngramError(f"device must be a CUDA device (got {self.device})")
        self.max_head_dim = int(max_head_dim)
        handle = ctypes.c_void_p()
        with torch.cuda.device(self.device):
            _call("engram_host_gatherer_create", int(num_threads), int(chunk_rows), self.max_head_dim,
                  ctypes.byref(handle))
        self._handle: ctypes.c_void_p | None = handle

    def gather(self, ids: Any, rows: Any, scales: Any = None, *, layer: int | None = None, quant_block: int = 32,
               out: Any = None) -> Any:
        """Same contract as :func:`gather`, but ``ids``, ``rows`` and ``scales`` are CPU
        tensors (any host memory: pinned, registered, heap or a file mapping) and ``out``
        is on the gatherer's device. Returns once every chunk is gathered and its copy
        enqueued on the device's current stream."""
        if self._handle is None:
            raise EngramError("this HostGatherer is closed")
        T, cols, stride, byte_offset = _ids_view(ids, layer, "cpu")
        dtype, num_rows, head_dim = _table(rows, scales, quant_block)
        for name, t in (("rows", rows), ("scales", scales)):
            if t is not None and t.device.type != "cpu":
                raise EngramError(f"{name} must be a CPU tensor for the host gather (got {t.device}); use kernels.gather")
        if head_dim > self.max_head_dim:
            raise EngramError(f"head_dim {head_dim} exceeds this gatherer's max_head_dim {self.max_head_dim}")
        out = _gather_out(out, T, cols, head_dim, self.device)
        with _torch().cuda.device(self.device):
            _call("engram_host_gather", self._handle, ctypes.c_void_p(ids.data_ptr() + byte_offset), T, cols, stride,
                  _ptr(rows), _ptr(scales), num_rows, head_dim, dtype, quant_block, _ptr(out),
                  _stream(self.device))
        return out

    def close(self) -> None:
        if self._handle is not None:
            _call("engram_host_gatherer_destroy", self._handle)
            self._handle = None

    def __enter__(self) -> "HostGatherer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may be gone
            pass


_default_gatherers: dict[tuple[Any, int], HostGatherer] = {}
# Staging bytes per slot of a default gatherer: 16384 rows of 512 bf16 values (16 MiB);
# wider rows get fewer rows per chunk, so the pinned and device staging stay that size.
_DEFAULT_SLOT_ELEMS = 16384 * 512


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
        g = _default_gatherers[key] = HostGatherer(device=device, max_head_dim=width,
                                                   chunk_rows=max(1024, _DEFAULT_SLOT_ELEMS // width))
    return g


def host_gather(ids: Any, rows: Any, scales: Any = None, *, layer: int | None = None, quant_block: int = 32,
                out: Any = None, device: Any = None, gatherer: HostGatherer | None = None) -> Any:
    """:meth:`HostGatherer.gather` through ``gatherer`` or the device's default one for
    the table's row width."""
    torch = _torch()
    if gatherer is None:
        dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        _, _, head_dim = _table(rows, scales, quant_block)  # bad tables fail here, named
        gatherer = _default_gatherer(dev, head_dim)
    return gatherer.gather(ids, rows, scales, layer=layer, quant_block=quant_block, out=out)


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
    with torch.cuda.device(hidden.device):
        _call("engram_gate_typed", _ptr(hidden), _ptr(kv), _float_code(hidden.dtype), _ptr(q_weight), _ptr(k_weight),
              _float_code(q_weight.dtype), _ptr(mask), mask_type, T, hc, D, ctypes.c_float(eps), ctypes.c_float(clamp),
              _ptr(out), _stream(hidden.device))
    return out
