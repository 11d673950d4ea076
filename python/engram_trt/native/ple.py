"""ctypes bindings to Qwen4-Exp's PLE kernels in the kernel library: the PLE n-gram hash
(``plugins/kernels/pleHashKernel.cu``) and the PLE fusion
(``plugins/kernels/pleFusionKernel.cu``, the EngramPleFusion plugin's math).

:func:`ple_hash_packed` is :func:`engram_trt.engram.ple_hash.ple_hash_packed` on the GPU,
bit for bit: each PLE layer of a ``PLEHashLayout`` is validated once and cached as the
kernel's parameter (:func:`prepared_ple_layout`).
:func:`ple_fusion` is :class:`~engram_trt.models.qwen4_exp.modules.PLEFusion` after its two
projections: the sqrt-sign gate of the PLE value by each stream, the three grouped offset
RMSNorms and the dilated causal convolution over each slot's history (updated in place),
three launches on the current stream in one call. The functions check dtypes, then
shapes, then devices before anything reaches the library (an EngramError names the bad
argument). The entry points are declared here, on first use, as
:mod:`engram_trt.native.attention` declares its own.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from typing import Any

from engram_trt.errors import EngramError
from engram_trt.native.library import (
    EntryPoints,
    NativeHandle,
    check,
    check_dtype,
    device_guard,
    float_code,
    ptr,
    same_device,
    stream_of,
    torch_module,
)

# engramKernels.h: ENGRAM_PLE_FUSION_MAX_KERNEL / _MAX_DILATION
MAX_KERNEL = 32
MAX_DILATION = 256

_i32, _i64, _vp = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
_ENTRY = EntryPoints(
    {
        "engram_ple_fusion_check_shape": [_i32, _i32, _i32, _i32, ctypes.c_float],
        "engram_ple_fusion_workspace_size": [_i64, _i32, _i32, _i32, ctypes.POINTER(ctypes.c_size_t)],
        "engram_ple_fusion": [
            _vp,
            _vp,
            _vp,
            _i32,
            _vp,
            _vp,
            _vp,
            _vp,
            _i32,
            _vp,
            _i64,
            _vp,
            _vp,
            _vp,
            _i64,
            _i64,
            _i32,
            _i32,
            _i32,
            _i32,
            ctypes.c_float,
            _i32,
            _vp,
            ctypes.c_size_t,
            _vp,
            _vp,
        ],
    }
)
library = _ENTRY.library
unavailable = _ENTRY.unavailable
_call = _ENTRY.call


# --- PLE hash (Qwen4-Exp) ------------------------------------------------------------

# Declared apart from the fusion's entry points: a library built before the fusion
# kernels still serves the hash.
_HASH_ENTRY = EntryPoints(
    {
        "engram_ple_hash_check_layout": [_vp, _vp, _vp, ctypes.c_int32, ctypes.c_int32, _i64, _i64, _i64],
        "engram_ple_hash_layout_create": [
            _vp,
            _vp,
            _vp,
            ctypes.c_int32,
            ctypes.c_int32,
            _i64,
            _i64,
            _i64,
            ctypes.POINTER(_vp),
        ],
        "engram_ple_hash_layout_destroy": [_vp],
        "engram_ple_hash_prepared": [_vp, _vp, _i64, _vp, _i64, _vp, _vp, _vp],
    }
)


class PreparedPleHashLayout(NativeHandle):
    """One PLE layer of a :class:`~engram_trt.engram.ple_hash.PLEHashLayout`, validated
    once and laid out as the kernel's parameter (``engram_ple_hash_layout_create``): no
    device memory, so one serves every device and stream."""

    def __init__(self, layout: Any, layer: int) -> None:
        import numpy as np

        if not 0 <= int(layer) < int(layout.num_layers):
            raise EngramError(f"layer={layer} must be a PLE layer index in [0, {layout.num_layers})")
        arrays = [
            np.ascontiguousarray(a[int(layer)], dtype=np.int64)
            for a in (layout.multipliers, layout.head_vocab_sizes, layout.head_offsets)
        ]
        handle = ctypes.c_void_p()
        _HASH_ENTRY.call(
            "engram_ple_hash_layout_create",
            *(a.ctypes.data_as(ctypes.c_void_p) for a in arrays),
            int(layout.ngram_size),
            int(layout.heads_per_ngram),
            int(layout.eos_id),
            int(layout.vocab_size),
            int(layout.table_rows[int(layer)]),
            ctypes.byref(handle),
        )
        self._handle = handle
        self.ngram_size, self.num_heads = int(layout.ngram_size), int(layout.num_heads)

    def _destroy(self, handle: Any) -> None:
        _HASH_ENTRY.call("engram_ple_hash_layout_destroy", handle)

    @property
    def handle(self) -> ctypes.c_void_p:
        if self._handle is None:
            raise EngramError("this PreparedPleHashLayout is closed")
        return self._handle


# The prepared layers of each PLEHashLayout object (frozen), dropped with the layout.
_ple_prepared: "weakref.WeakKeyDictionary[Any, dict[int, PreparedPleHashLayout]]" = weakref.WeakKeyDictionary()
_ple_prepared_lock = threading.Lock()


def prepared_ple_layout(layout: Any, layer: int) -> PreparedPleHashLayout:
    """The cached :class:`PreparedPleHashLayout` of ``layout``'s PLE layer ``layer``."""
    with _ple_prepared_lock:
        layers = _ple_prepared.setdefault(layout, {})
        if int(layer) not in layers:
            layers[int(layer)] = PreparedPleHashLayout(layout, layer)
        return layers[int(layer)]


def ple_hash_packed(ids: Any, seq_starts: Any, context: Any, layout: Any, layer: int, *, out: Any = None) -> Any:
    """Row ids ``int32 [T, H]`` of PLE layer ``layer`` for a packed step, bit-identical
    to :func:`engram_trt.engram.ple_hash.ple_hash_packed`.

    ``ids [T]`` int32 raw token ids, ``seq_starts [S+1]`` int32 cu_seqlens, ``context
    [S, N-1]`` int32 (each sequence's previous ids, oldest first; EOS ids for a fresh
    one) or None (every sequence fresh); all on one CUDA device. ``layout``: a
    ``PLEHashLayout`` (each layer prepared once and cached, :func:`prepared_ple_layout`).
    """
    torch = torch_module()
    check("ids", ids, (torch.int32,), 1)
    check("seq_starts", seq_starts, (torch.int32,), 1)
    prepared = prepared_ple_layout(layout, layer)
    S, n = seq_starts.shape[0] - 1, prepared.ngram_size - 1
    if S < 0:
        raise EngramError("seq_starts must hold S+1 >= 1 entries (cu_seqlens starting at 0)")
    if context is not None:
        check("context", context, (torch.int32,), 2)
        if tuple(context.shape) != (S, n):
            raise EngramError(f"context must be [S, ngram_size-1] = {(S, n)} (got {tuple(context.shape)})")
    T, H = ids.shape[0], prepared.num_heads
    if out is None:
        out = torch.empty((T, H), dtype=torch.int32, device=ids.device)
    check("out", out, (torch.int32,), 2)
    if tuple(out.shape) != (T, H):
        raise EngramError(f"out must be [T, H] = {(T, H)} (got {tuple(out.shape)})")
    same_device(ids.device, seq_starts=seq_starts, context=context, out=out)
    with device_guard(ids.device.index):
        _HASH_ENTRY.call(
            "engram_ple_hash_prepared",
            prepared.handle,
            ptr(ids),
            T,
            ptr(seq_starts),
            S,
            ptr(context),
            ptr(out),
            stream_of(ids.device),
        )
    return out


# --- PLE fusion --------------------------------------------------------------------


def check_shape(hc_count: int, hidden: int, kernel: int, dilation: int, eps: float) -> None:
    """The kernel's limits (hidden % 8, kernel / dilation ranges, eps); needs no GPU."""
    _call("engram_ple_fusion_check_shape", int(hc_count), int(hidden), int(kernel), int(dilation), ctypes.c_float(eps))


def workspace_size(max_tokens: int, hc_count: int, hidden: int, dtype: Any) -> int:
    """Bytes of workspace a call of up to ``max_tokens`` tokens needs (the normalized
    gated values in ``dtype`` and one fp32 gate per token and stream); needs no GPU."""
    out = ctypes.c_size_t(0)
    _call(
        "engram_ple_fusion_workspace_size",
        int(max_tokens),
        int(hc_count),
        int(hidden),
        float_code(dtype),
        ctypes.byref(out),
    )
    return int(out.value)


def ple_fusion(
    streams: Any,
    key: Any,
    value: Any,
    norm_key_weight: Any,
    norm_query_weight: Any,
    norm_conv_weight: Any,
    conv_weight: Any,
    conv_state: Any,
    seq_starts: Any,
    past_lens: Any,
    slots: Any,
    *,
    hc_count: int,
    dilation: int,
    eps: float,
    add_streams: bool = False,
    out: Any = None,
    workspace: Any = None,
) -> Any:
    """PLEFusion's update ``[T, hc * D]`` (``add_streams``: ``streams + update``; ``out``
    may then be ``streams``, an in-place residual add).

    ``streams``, ``key`` (key_proj's output) ``[T, W]``, ``value`` (value_proj's) ``[T, D]``
    and ``conv_state [num_slots, W, (K-1) * dilation]`` share one dtype (bf16, fp16,
    float32; fp32 math inside, the output rounded once); the three norm weights ``[W]``
    and ``conv_weight [W, K]`` or ``[W, 1, K]`` are float32 or that dtype.
    ``seq_starts [S+1]`` (cu_seqlens), ``past_lens [S]``, ``slots [S]`` int32, on the same
    CUDA device: each sequence's tokens are consecutive; its history is read when its
    past length is > 0 (zeros otherwise) and replaced by the last ``(K-1) * dilation``
    normalized values. ``workspace``: None (allocated) or a uint8 CUDA tensor of
    :func:`workspace_size` bytes.
    """
    torch = torch_module()
    io_dtypes = (torch.bfloat16, torch.float16, torch.float32)
    check_dtype("streams", streams, io_dtypes)
    io = streams.dtype
    for name, t in (("key", key), ("value", value), ("conv_state", conv_state)):
        check_dtype(name, t, (io,))
    weight_dtypes = tuple(dict.fromkeys((torch.float32, io)))
    check_dtype("norm_key_weight", norm_key_weight, weight_dtypes)
    wt = norm_key_weight.dtype
    for name, t in (
        ("norm_query_weight", norm_query_weight),
        ("norm_conv_weight", norm_conv_weight),
        ("conv_weight", conv_weight),
    ):
        check_dtype(name, t, (wt,))
    for name, t in (("seq_starts", seq_starts), ("past_lens", past_lens), ("slots", slots)):
        check(name, t, (torch.int32,), 1, where="any")
    check("streams", streams, io_dtypes, 2, where="any")
    T, W = streams.shape
    hc = int(hc_count)
    if hc < 1 or W % hc:
        raise EngramError(f"hc_count={hc_count} must divide streams' width {W}")
    D = W // hc
    check("key", key, (io,), 2, where="any")
    check("value", value, (io,), 2, where="any")
    if tuple(key.shape) != (T, W):
        raise EngramError(f"key must be [T, W] = {(T, W)} (got {tuple(key.shape)})")
    if tuple(value.shape) != (T, D):
        raise EngramError(f"value must be [T, hidden] = {(T, D)} (got {tuple(value.shape)})")
    for name, t in (
        ("norm_key_weight", norm_key_weight),
        ("norm_query_weight", norm_query_weight),
        ("norm_conv_weight", norm_conv_weight),
    ):
        check(name, t, (wt,), 1, where="any")
        if t.shape[0] != W:
            raise EngramError(f"{name} must be [W] = ({W},) (got {tuple(t.shape)})")
    check("conv_weight", conv_weight, (wt,), where="any")
    if conv_weight.dim() == 3 and conv_weight.shape[1] == 1:
        conv_weight = conv_weight.reshape(conv_weight.shape[0], conv_weight.shape[2])
    if conv_weight.dim() != 2 or conv_weight.shape[0] != W:
        raise EngramError(f"conv_weight must be [W, K] or [W, 1, K] with W = {W} (got {tuple(conv_weight.shape)})")
    K = int(conv_weight.shape[1])
    H = (K - 1) * int(dilation)
    check("conv_state", conv_state, (io,), 3, where="any")
    if tuple(conv_state.shape[1:]) != (W, H):
        raise EngramError(
            f"conv_state must be [num_slots, W, (K-1)*dilation] = [num_slots, {W}, {H}] (got {tuple(conv_state.shape)})"
        )
    S = past_lens.shape[0]
    if seq_starts.shape[0] != S + 1 or slots.shape[0] != S:
        raise EngramError(
            f"seq_starts must be [S+1] and slots [S] with past_lens' S = {S} "
            f"(got {tuple(seq_starts.shape)}, {tuple(slots.shape)})"
        )
    if out is None:
        out = torch.empty_like(streams)
    check("out", out, (io,), 2, where="any")
    if tuple(out.shape) != (T, W):
        raise EngramError(f"out must be [T, W] = {(T, W)} (got {tuple(out.shape)})")
    need = workspace_size(T, hc, D, io)
    if workspace is None:
        workspace = torch.empty(max(need, 16), dtype=torch.uint8, device=streams.device)
    check("workspace", workspace, (torch.uint8,), 1, where="any")
    if workspace.numel() < need:
        raise EngramError(f"workspace holds {workspace.numel()} bytes, {need} needed for {T} tokens")
    for name, t in (("streams", streams), ("seq_starts", seq_starts), ("past_lens", past_lens), ("slots", slots)):
        if not t.is_cuda:
            raise EngramError(f"{name} must be a CUDA tensor (got device {t.device})")
    same_device(
        streams.device,
        key=key,
        value=value,
        norm_key_weight=norm_key_weight,
        norm_query_weight=norm_query_weight,
        norm_conv_weight=norm_conv_weight,
        conv_weight=conv_weight,
        conv_state=conv_state,
        seq_starts=seq_starts,
        past_lens=past_lens,
        slots=slots,
        out=out,
        workspace=workspace,
    )
    for name, t in (
        ("key", key),
        ("value", value),
        ("norm_key_weight", norm_key_weight),
        ("norm_query_weight", norm_query_weight),
        ("norm_conv_weight", norm_conv_weight),
        ("conv_weight", conv_weight),
        ("conv_state", conv_state),
        ("out", out),
    ):
        if not t.is_cuda:
            raise EngramError(f"{name} must be a CUDA tensor (got device {t.device})")
    with device_guard(streams.device.index):
        _call(
            "engram_ple_fusion",
            ptr(streams),
            ptr(key),
            ptr(value),
            float_code(io),
            ptr(norm_key_weight),
            ptr(norm_query_weight),
            ptr(norm_conv_weight),
            ptr(conv_weight),
            float_code(wt),
            ptr(conv_state if conv_state.numel() else None),
            int(conv_state.shape[0]),
            ptr(seq_starts),
            ptr(past_lens),
            ptr(slots),
            S,
            T,
            hc,
            D,
            K,
            int(dilation),
            ctypes.c_float(eps),
            int(bool(add_streams)),
            ptr(workspace),
            workspace.numel(),
            ptr(out),
            stream_of(streams.device),
        )
    return out
