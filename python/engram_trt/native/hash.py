"""ctypes bindings of the Engram n-gram hash (``plugins/kernels/hashKernels.h``,
``hashKernel.cu``): the layout checks, the prepared layout (validated once, laid out as the
kernel's parameter) and the hash of packed sequences, bit-identical to
:func:`engram_trt.engram.hashing.hash_batch_packed`."""

from __future__ import annotations

import ctypes
import threading
import weakref
from typing import Any

from engram_trt.errors import EngramError
from engram_trt.native.library import EntryPoints, check, device_guard, ptr, same_device, stream_of, torch_module

_i32, _i64, _vp = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
_ENTRY = EntryPoints(
    {
        "engram_hash_check_layout": [_vp, _vp, _vp, _i32, _i32, _i32, _i64, _i64],
        "engram_hash": [_vp, _i64, _vp, _i64, _vp, _vp, _vp, _vp, _i32, _i32, _i32, _i64, _i64, _vp, _vp],
        "engram_hash_layout_create": [_vp, _vp, _vp, _i32, _i32, _i32, _i64, _i64, ctypes.POINTER(_vp)],
        "engram_hash_layout_destroy": [_vp],
        "engram_hash_prepared": [_vp, _vp, _i64, _vp, _i64, _vp, _vp, _vp],
    }
)
library = _ENTRY.library
_call = _ENTRY.call


def _layout_args(layout: Any) -> tuple:
    import numpy as np

    primes = np.ascontiguousarray(layout.primes, dtype=np.int64)
    offsets = np.ascontiguousarray(layout.offsets, dtype=np.int64)
    mult = np.ascontiguousarray(layout.multipliers, dtype=np.int64)
    L, N, H = int(layout.num_layers), int(layout.max_ngram_size), int(layout.n_heads)
    if primes.shape != (L, N - 1, H) or offsets.shape != (L, (N - 1) * H) or mult.shape != (L, N):
        raise EngramError(
            f"layout arrays must be primes [L, N-1, H], offsets [L, cols], multipliers [L, N] = "
            f"{(L, N - 1, H)}, {(L, (N - 1) * H)}, {(L, N)} (got {primes.shape}, {offsets.shape}, {mult.shape})"
        )
    keep = (primes, offsets, mult)  # the caller holds these while the C call reads them
    args = (
        primes.ctypes.data_as(ctypes.c_void_p),
        offsets.ctypes.data_as(ctypes.c_void_p),
        mult.ctypes.data_as(ctypes.c_void_p),
        L,
        N,
        H,
        int(layout.pad_id),
        int(layout.compressed_vocab_size),
    )
    return keep, args


def check_layout(layout: Any) -> None:
    """Run the kernel library's layout checks (multiplier overflow bound, int32 row ids,
    kernel limits) on an :class:`~engram_trt.layout.EngramLayout`; needs no GPU."""
    keep, args = _layout_args(layout)
    _call("engram_hash_check_layout", *args)
    del keep


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
    torch = torch_module()
    check("ids", ids, (torch.int32,), 1)
    check("seq_starts", seq_starts, (torch.int32,), 1)
    n = int(layout.max_ngram_size) - 1
    S = seq_starts.shape[0] - 1
    if S < 0:
        raise EngramError("seq_starts must hold S+1 >= 1 entries (cu_seqlens starting at 0)")
    if lookback is not None:
        check("lookback", lookback, (torch.int32,), 2)
        if tuple(lookback.shape) != (S, n):
            raise EngramError(f"lookback must be [S, N-1] = {(S, n)} (got {tuple(lookback.shape)})")
    T, L, cols = ids.shape[0], int(layout.num_layers), int(layout.n_hash_cols)
    if out is None:
        out = torch.empty((T, L, cols), dtype=torch.int32, device=ids.device)
    check("out", out, (torch.int32,), 3)
    if tuple(out.shape) != (T, L, cols):
        raise EngramError(f"out must be [T, L, cols] = {(T, L, cols)} (got {tuple(out.shape)})")
    same_device(ids.device, seq_starts=seq_starts, lookback=lookback, out=out)
    prepared = prepared_layout(layout)
    with device_guard(ids.device.index):
        _call(
            "engram_hash_prepared",
            prepared.handle,
            ptr(ids),
            T,
            ptr(seq_starts),
            S,
            ptr(lookback),
            ptr(out),
            stream_of(ids.device),
        )
    return out
