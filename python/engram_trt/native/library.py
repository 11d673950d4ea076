"""The kernel library's loader (``libengram_trt_plugins.so``) and the ctypes helpers every
binding module of :mod:`engram_trt.native` shares.

:func:`library_path` finds the library, :func:`load_library` loads it once per process and
declares the entry points every family shares (``engramKernelsCore.h``: the version, the
last error, pointer queries, host memory registration); each family's binding module
(:mod:`~engram_trt.native.hash`, :mod:`~engram_trt.native.gather`,
:mod:`~engram_trt.native.gate`, :mod:`~engram_trt.native.attention`, ...) declares its own
entry points on first use through an :class:`EntryPoints`. The helpers check a tensor's
type, dtype, device, rank and contiguity before anything reaches the library and raise
:class:`~engram_trt.errors.EngramError` with one line naming the bad argument
(:func:`check`, :func:`check_dtype`, :func:`same_device`), and give the C ABI its
arguments (:func:`ptr`, :func:`stream_of`, :func:`float_code`); :func:`call`
raises the library's own reason of a failed call. Importing this module loads nothing
(torch and the library on first use).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import threading
from importlib import metadata
from pathlib import Path
from typing import Any

from engram_trt.errors import EngramError

log = logging.getLogger(__name__)

LIBRARY_NAME = "libengram_trt_plugins.so"

# enum values of engramKernelsCore.h
FLOAT_BF16, FLOAT_F32, FLOAT_F16 = 0, 1, 2  # EngramFloatType: the float kernels' io_type / weight_type
POINTER_KINDS = {0: "unregistered", 1: "host", 2: "device", 3: "managed"}

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
        f"build it with `cmake -S . -B build && cmake --build build -j2` or set ENGRAM_TRT_PLUGIN_LIB"
    )


def _declare(lib: ctypes.CDLL) -> None:
    """The entry points of engramKernelsCore.h (the families declare theirs: EntryPoints)."""
    i32, vp, sz = ctypes.c_int32, ctypes.c_void_p, ctypes.c_size_t
    sigs = {
        "engram_trt_plugin_version": (ctypes.c_char_p, []),
        "engram_last_error": (ctypes.c_char_p, []),
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


def call(fn_name: str, *args: Any) -> None:
    """Call ``fn_name`` of the library; EngramError with the library's reason unless it returns 0."""
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
        call(fn_name, *args)

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


def torch_module() -> Any:
    """torch, imported on first use (importing a binding module stays light)."""
    import torch

    return torch


@functools.lru_cache(maxsize=None)
def capability_major(index: int | None) -> int:
    """The compute capability major of CUDA device ``index``, asked once: the kernel
    choices that depend on it (the GEMV, the warp attention kernel) are made per call."""
    return torch_module().cuda.get_device_capability(index)[0]


def check_dtype(name: str, t: Any, dtypes: tuple) -> None:
    """The type and dtype parts of :func:`check` alone (before any device check)."""
    torch = torch_module()
    if not isinstance(t, torch.Tensor):
        raise EngramError(f"{name} must be a torch.Tensor (got {type(t).__name__})")
    if t.dtype not in dtypes:
        raise EngramError(f"{name} must have dtype {' or '.join(str(d) for d in dtypes)} (got {t.dtype})")


def check(name: str, t: Any, dtypes: tuple, ndim: int | None = None, where: str = "cuda") -> None:
    """EngramError naming ``name`` unless ``t`` is a contiguous tensor of one of ``dtypes``, of rank
    ``ndim`` (None: any), on a CUDA device (``where`` "cuda"), the CPU ("cpu") or either ("any")."""
    check_dtype(name, t, dtypes)
    if ndim is not None and t.dim() != ndim:
        raise EngramError(f"{name} must be {ndim}-D (got shape {tuple(t.shape)})")
    if where == "cuda" and not t.is_cuda:
        raise EngramError(f"{name} must be a CUDA tensor (got device {t.device})")
    if where == "cpu" and t.device.type != "cpu":
        raise EngramError(f"{name} must be a CPU tensor (got device {t.device})")
    if not t.is_contiguous():
        raise EngramError(f"{name} must be contiguous (call .contiguous())")


def same_device(device: Any, **tensors: Any) -> None:
    """EngramError naming the first CUDA tensor that is not on ``device`` (None skipped)."""
    for name, t in tensors.items():
        if t is not None and t.is_cuda and t.device != device:
            raise EngramError(f"{name} is on {t.device} but the operation runs on {device}")


def stream_of(device: Any) -> ctypes.c_void_p:
    """The current CUDA stream of ``device`` (a torch.device or an index) as the C ABI
    takes it. Through torch's raw-stream query where it has one: it skips building a
    Stream object and parsing the device, about 5 us a call on the H200 VM, where a
    cache step makes several of these calls."""
    torch = torch_module()
    index = device if isinstance(device, int) else device.index
    if index is None:
        index = torch.cuda.current_device()
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return ctypes.c_void_p(raw(index) if raw is not None else torch.cuda.current_stream(index).cuda_stream)


def device_guard(index: int) -> Any:
    """``torch.cuda.device(index)``, or no context at all where ``index`` is already the
    current device (the usual case: entering the guard costs more than the check)."""
    torch = torch_module()
    return contextlib.nullcontext() if torch.cuda.current_device() == index else torch.cuda.device(index)


def ptr(t: Any) -> ctypes.c_void_p:
    """A tensor's data pointer as the C ABI takes it (None: NULL)."""
    return ctypes.c_void_p(t.data_ptr() if t is not None else 0)


def float_code(dtype: Any) -> int:
    """The EngramFloatType code of a torch float dtype (bf16, fp16, fp32)."""
    torch = torch_module()
    return {torch.bfloat16: FLOAT_BF16, torch.float16: FLOAT_F16, torch.float32: FLOAT_F32}[dtype]


def pointer_kind(t: Any) -> str:
    """``'device'``, ``'host'`` (pinned / registered: the GPU can read it), ``'managed'``
    or ``'unregistered'`` (plain host memory) for a tensor's memory."""
    kind = ctypes.c_int32(-1)
    call("engram_pointer_kind", ptr(t), ctypes.byref(kind))
    return POINTER_KINDS.get(kind.value, "unregistered")


def register_host_memory(t: Any) -> None:
    """cudaHostRegister a CPU tensor's memory (portable, mapped), so :func:`gather` can
    read it through UVA. Undo with :func:`unregister_host_memory` before freeing it."""
    if not hasattr(t, "dtype"):
        raise EngramError(f"tensor must be a torch.Tensor (got {type(t).__name__})")
    check("tensor", t, (t.dtype,), where="cpu")
    call("engram_host_register", ptr(t), ctypes.c_size_t(t.numel() * t.element_size()))


def unregister_host_memory(t: Any) -> None:
    call("engram_host_unregister", ptr(t))
