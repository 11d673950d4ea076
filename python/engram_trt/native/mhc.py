"""ctypes binding to DeepSeek-V4's mHC kernels in the kernel library
(``plugins/kernels/mhcKernel.cu``): the hyper-connection around each sublayer in two
calls and the hyper head in one, each a fixed two or one launches whatever ``hc_mult`` and
``hc_sinkhorn_iters`` are (the PyTorch path spends dozens of tiny launches on the
Sinkhorn-Knopp loop alone).

* :func:`mhc_pre`: :meth:`~engram_trt.models.deepseek_v4.modules.HyperConnection.collapse`
  — ``(collapsed [T, D], post [T, hc] fp32, comb [T, hc, hc] fp32)`` of ``streams [T, hc, D]``;
* :func:`mhc_post`: :meth:`~engram_trt.models.deepseek_v4.modules.HyperConnection.expand`
  — ``post * out + comb^T @ streams`` (may write into ``streams``);
* :func:`mhc_head`: :class:`~engram_trt.models.deepseek_v4.modules.HyperHead`;
* :func:`mhc_pre_norm` / :func:`mhc_head_norm`: the same collapses with the RMSNorm that
  follows them in the model (the layer's ``input_layernorm`` / ``post_attention_layernorm``,
  the final ``norm``) fused into their last launch: the normed input instead of the collapse.
* :func:`mhc_fold`: a sublayer boundary, :func:`mhc_post` then the next collapse (a layer's
  ``mhc_pre`` / ``mhc_pre_norm`` or the head's) over the new streams, in two launches for a
  decode step's few tokens (the expansion and the collapse's mix in one).

fp32 math inside, activations bf16 / fp16 / float32 (one dtype per call), the mHC
parameters float32 (the model keeps them so, as transformers does). The functions check
dtypes, then shapes, then devices before anything reaches the library (an EngramError
names the bad argument); the entry points are declared here on first use.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

from engram_trt.errors import EngramError
from engram_trt.native.library import (
    EntryPoints,
    check,
    check_dtype,
    device_guard,
    float_code,
    ptr,
    same_device,
    stream_of,
    torch_module,
)

# engramKernels.h: ENGRAM_MHC_MAX_HC / ENGRAM_MHC_MAX_SINKHORN_ITERS
MAX_HC = 8
MAX_SINKHORN_ITERS = 1000

_i32, _i64, _vp, _f32 = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
_ENTRY = EntryPoints(
    {
        "engram_mhc_check_shape": [_i32, _i32, _i32, _f32, _f32],
        "engram_mhc_workspace_size": [_i64, _i32, _i32, ctypes.POINTER(ctypes.c_size_t)],
        "engram_mhc_pre": [
            _vp,
            _i32,
            _vp,
            _vp,
            _vp,
            _i64,
            _i32,
            _i32,
            _i32,
            _f32,
            _f32,
            _vp,
            ctypes.c_size_t,
            _vp,
            _vp,
            _vp,
            _vp,
        ],
        "engram_mhc_post": [_vp, _vp, _i32, _vp, _vp, _i64, _i32, _i32, _vp, _vp],
        "engram_mhc_head": [_vp, _i32, _vp, _vp, _vp, _i64, _i32, _i32, _f32, _f32, _vp, ctypes.c_size_t, _vp, _vp],
        "engram_mhc_pre_norm": [
            _vp,
            _i32,
            _vp,
            _vp,
            _vp,
            _i64,
            _i32,
            _i32,
            _i32,
            _f32,
            _f32,
            _vp,
            _f32,
            _vp,
            ctypes.c_size_t,
            _vp,
            _vp,
            _vp,
            _vp,
        ],
        "engram_mhc_head_norm": [
            _vp,
            _i32,
            _vp,
            _vp,
            _vp,
            _i64,
            _i32,
            _i32,
            _f32,
            _f32,
            _vp,
            _f32,
            _vp,
            ctypes.c_size_t,
            _vp,
            _vp,
        ],
        "engram_mhc_fold_workspace_size": [_i64, _i32, _i32, ctypes.POINTER(ctypes.c_size_t)],
        "engram_mhc_fold": [
            _vp,
            _vp,
            _i32,
            _vp,
            _vp,
            _vp,
            _vp,
            _vp,
            _i64,
            _i32,
            _i32,
            _i32,
            _f32,
            _f32,
            _i32,
            _vp,
            _f32,
            _vp,
            ctypes.c_size_t,
            _vp,
            _vp,
            _vp,
            _vp,
            _vp,
        ],
    }
)
library = _ENTRY.library
unavailable = _ENTRY.unavailable
_call = _ENTRY.call


def check_shape(hc_mult: int, hidden: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float) -> None:
    """The kernel's limits (hc_mult in [1, 8], hidden % 8, iterations, eps); needs no GPU."""
    _call("engram_mhc_check_shape", int(hc_mult), int(hidden), int(sinkhorn_iters), _f32(hc_eps), _f32(norm_eps))


@functools.lru_cache(maxsize=256)
def workspace_size(num_tokens: int, hc_mult: int, hidden: int) -> int:
    """Bytes of fp32 partial sums a :func:`mhc_pre` / :func:`mhc_head` call of
    ``num_tokens`` tokens needs (the split of the ``hc * hidden`` dot products depends on
    the token count and width alone, so no GPU is asked; cached: a decode step asks it
    for every sublayer)."""
    out = ctypes.c_size_t(0)
    _call("engram_mhc_workspace_size", int(num_tokens), int(hc_mult), int(hidden), ctypes.byref(out))
    return int(out.value)


def _check_streams(streams: Any) -> tuple[int, int, int]:
    """``(T, hc, D)`` of ``streams [T, hc, D]`` (bf16 / fp16 / float32)."""
    torch = torch_module()
    check_dtype("streams", streams, (torch.bfloat16, torch.float16, torch.float32))
    if streams.dim() != 3:
        raise EngramError(f"streams must be [T, hc_mult, hidden] (got shape {tuple(streams.shape)})")
    return int(streams.shape[0]), int(streams.shape[1]), int(streams.shape[2])


def _check_params(fn: Any, base: Any, scale: Any, rows: int, width: int, scales: int) -> None:
    torch = torch_module()
    for name, t in (("fn", fn), ("base", base), ("scale", scale)):
        check_dtype(name, t, (torch.float32,))
    if tuple(fn.shape) != (rows, width):
        raise EngramError(f"fn must be [{rows}, {width}] (got {tuple(fn.shape)})")
    if tuple(base.shape) != (rows,):
        raise EngramError(f"base must be [{rows}] (got {tuple(base.shape)})")
    if tuple(scale.shape) != (scales,):
        raise EngramError(f"scale must be [{scales}] (got {tuple(scale.shape)})")


def _check_devices(streams: Any, **tensors: Any) -> None:
    """Every tensor contiguous and on streams' CUDA device (streams first)."""
    for name, t in (("streams", streams), *tensors.items()):
        if t is not None:
            check(name, t, (t.dtype,))
    same_device(streams.device, **tensors)


def _workspace(workspace: Any, T: int, hc: int, D: int, device: Any) -> Any:
    torch = torch_module()
    need = workspace_size(int(T), int(hc), int(D))
    if workspace is None:
        return torch.empty(max(need // 4, 4), dtype=torch.float32, device=device)
    check_dtype("workspace", workspace, (torch.float32, torch.uint8))
    if workspace.numel() * workspace.element_size() < need:
        raise EngramError(
            f"workspace holds {workspace.numel() * workspace.element_size()} bytes, {need} needed for "
            f"{T} tokens (workspace_size)"
        )
    return workspace


def mhc_pre(
    streams: Any,
    fn: Any,
    base: Any,
    scale: Any,
    *,
    sinkhorn_iters: int,
    hc_eps: float,
    norm_eps: float,
    collapsed: Any = None,
    workspace: Any = None,
) -> tuple[Any, Any, Any]:
    """``(collapsed [T, D] in streams' dtype, post [T, hc] fp32, comb [T, hc, hc] fp32)``:
    HyperConnection.collapse of ``streams [T, hc, D]`` with ``fn [(2+hc)*hc, hc*D]``,
    ``base [(2+hc)*hc]``, ``scale [3]`` (float32, on streams' CUDA device)."""
    torch = torch_module()
    T, hc, D = _check_streams(streams)
    rows = (2 + hc) * hc
    _check_params(fn, base, scale, rows, hc * D, 3)
    check_shape(hc, D, sinkhorn_iters, hc_eps, norm_eps)
    if collapsed is None:
        collapsed = torch.empty((T, D), dtype=streams.dtype, device=streams.device)
    check_dtype("collapsed", collapsed, (streams.dtype,))
    if tuple(collapsed.shape) != (T, D):
        raise EngramError(f"collapsed must be [T, hidden] = {(T, D)} (got {tuple(collapsed.shape)})")
    _check_devices(streams, fn=fn, base=base, scale=scale, collapsed=collapsed)
    # post and comb share one allocation (one allocator call fewer per sublayer)
    coef = torch.empty(T * hc * (1 + hc), dtype=torch.float32, device=streams.device)
    post, comb = coef[: T * hc].view(T, hc), coef[T * hc :].view(T, hc, hc)
    workspace = _workspace(workspace, T, hc, D, streams.device)
    check("workspace", workspace, (workspace.dtype,))
    same_device(streams.device, workspace=workspace)
    with device_guard(streams.device.index):
        _call(
            "engram_mhc_pre",
            ptr(streams),
            float_code(streams.dtype),
            ptr(fn),
            ptr(base),
            ptr(scale),
            T,
            hc,
            D,
            int(sinkhorn_iters),
            _f32(hc_eps),
            _f32(norm_eps),
            ptr(workspace),
            workspace.numel() * workspace.element_size(),
            ptr(collapsed),
            ptr(post),
            ptr(comb),
            stream_of(streams.device),
        )
    return collapsed, post, comb


def mhc_post(streams: Any, out: Any, post: Any, comb: Any, *, new_streams: Any = None) -> Any:
    """``post * out + comb^T @ streams`` ``[T, hc, D]`` in streams' dtype (HyperConnection.expand):
    ``out [T, D]`` the sublayer's output in streams' dtype, ``post [T, hc]`` / ``comb [T, hc, hc]``
    float32 (what :func:`mhc_pre` returned). ``new_streams`` may be ``streams`` (in place)."""
    torch = torch_module()
    T, hc, D = _check_streams(streams)
    check_dtype("out", out, (streams.dtype,))
    check_dtype("post", post, (torch.float32,))
    check_dtype("comb", comb, (torch.float32,))
    if tuple(out.shape) != (T, D):
        raise EngramError(f"out must be [T, hidden] = {(T, D)} (got {tuple(out.shape)})")
    if tuple(post.shape) != (T, hc):
        raise EngramError(f"post must be [T, hc] = {(T, hc)} (got {tuple(post.shape)})")
    if tuple(comb.shape) != (T, hc, hc):
        raise EngramError(f"comb must be [T, hc, hc] = {(T, hc, hc)} (got {tuple(comb.shape)})")
    check_shape(hc, D, 1, 0.0, 0.0)
    if new_streams is None:
        new_streams = torch.empty_like(streams)
    check_dtype("new_streams", new_streams, (streams.dtype,))
    if tuple(new_streams.shape) != (T, hc, D):
        raise EngramError(f"new_streams must be [T, hc, hidden] = {(T, hc, D)} (got {tuple(new_streams.shape)})")
    _check_devices(streams, out=out, post=post, comb=comb, new_streams=new_streams)
    with device_guard(streams.device.index):
        _call(
            "engram_mhc_post",
            ptr(streams),
            ptr(out),
            float_code(streams.dtype),
            ptr(post),
            ptr(comb),
            T,
            hc,
            D,
            ptr(new_streams),
            stream_of(streams.device),
        )
    return new_streams


def mhc_head(
    streams: Any,
    fn: Any,
    base: Any,
    scale: Any,
    *,
    hc_eps: float,
    norm_eps: float,
    collapsed: Any = None,
    workspace: Any = None,
) -> Any:
    """HyperHead: ``collapsed [T, D]`` in streams' dtype of ``streams [T, hc, D]`` with
    ``fn [hc, hc*D]``, ``base [hc]``, ``scale [1]`` (float32)."""
    torch = torch_module()
    T, hc, D = _check_streams(streams)
    _check_params(fn, base, scale, hc, hc * D, 1)
    check_shape(hc, D, 1, hc_eps, norm_eps)
    if collapsed is None:
        collapsed = torch.empty((T, D), dtype=streams.dtype, device=streams.device)
    check_dtype("collapsed", collapsed, (streams.dtype,))
    if tuple(collapsed.shape) != (T, D):
        raise EngramError(f"collapsed must be [T, hidden] = {(T, D)} (got {tuple(collapsed.shape)})")
    _check_devices(streams, fn=fn, base=base, scale=scale, collapsed=collapsed)
    workspace = _workspace(workspace, T, hc, D, streams.device)
    check("workspace", workspace, (workspace.dtype,))
    same_device(streams.device, workspace=workspace)
    with device_guard(streams.device.index):
        _call(
            "engram_mhc_head",
            ptr(streams),
            float_code(streams.dtype),
            ptr(fn),
            ptr(base),
            ptr(scale),
            T,
            hc,
            D,
            _f32(hc_eps),
            _f32(norm_eps),
            ptr(workspace),
            workspace.numel() * workspace.element_size(),
            ptr(collapsed),
            stream_of(streams.device),
        )
    return collapsed


def _check_norm_weight(norm_weight: Any, D: int, device: Any) -> None:
    torch = torch_module()
    check_dtype("norm_weight", norm_weight, (torch.float32,))
    if tuple(norm_weight.shape) != (D,):
        raise EngramError(f"norm_weight must be [{D}] (got {tuple(norm_weight.shape)})")
    check("norm_weight", norm_weight, (torch.float32,))
    same_device(device, norm_weight=norm_weight)


def mhc_pre_norm(
    streams: Any,
    fn: Any,
    base: Any,
    scale: Any,
    norm_weight: Any,
    *,
    sinkhorn_iters: int,
    hc_eps: float,
    norm_eps: float,
    rms_eps: float,
    workspace: Any = None,
) -> tuple[Any, Any, Any]:
    """``(normed [T, D], post, comb)``: :func:`mhc_pre` whose collapse (rounded to streams'
    dtype) then takes the RMSNorm of ``norm_weight [D]`` (float32, ``rms_eps``), in the same
    launches (engram_mhc_pre_norm)."""
    torch = torch_module()
    T, hc, D = _check_streams(streams)
    _check_params(fn, base, scale, (2 + hc) * hc, hc * D, 3)
    check_shape(hc, D, sinkhorn_iters, hc_eps, norm_eps)
    _check_devices(streams, fn=fn, base=base, scale=scale)
    _check_norm_weight(norm_weight, D, streams.device)
    normed = torch.empty((T, D), dtype=streams.dtype, device=streams.device)
    coef = torch.empty(T * hc * (1 + hc), dtype=torch.float32, device=streams.device)
    post, comb = coef[: T * hc].view(T, hc), coef[T * hc :].view(T, hc, hc)
    workspace = _workspace(workspace, T, hc, D, streams.device)
    with device_guard(streams.device.index):
        _call(
            "engram_mhc_pre_norm",
            ptr(streams),
            float_code(streams.dtype),
            ptr(fn),
            ptr(base),
            ptr(scale),
            T,
            hc,
            D,
            int(sinkhorn_iters),
            _f32(hc_eps),
            _f32(norm_eps),
            ptr(norm_weight),
            _f32(rms_eps),
            ptr(workspace),
            workspace.numel() * workspace.element_size(),
            ptr(normed),
            ptr(post),
            ptr(comb),
            stream_of(streams.device),
        )
    return normed, post, comb


def mhc_head_norm(
    streams: Any,
    fn: Any,
    base: Any,
    scale: Any,
    norm_weight: Any,
    *,
    hc_eps: float,
    norm_eps: float,
    rms_eps: float,
    workspace: Any = None,
) -> Any:
    """:func:`mhc_head` followed by the final RMSNorm of ``norm_weight [D]`` (float32), fused
    (engram_mhc_head_norm): ``normed [T, D]`` in streams' dtype."""
    torch = torch_module()
    T, hc, D = _check_streams(streams)
    _check_params(fn, base, scale, hc, hc * D, 1)
    check_shape(hc, D, 1, hc_eps, norm_eps)
    _check_devices(streams, fn=fn, base=base, scale=scale)
    _check_norm_weight(norm_weight, D, streams.device)
    normed = torch.empty((T, D), dtype=streams.dtype, device=streams.device)
    workspace = _workspace(workspace, T, hc, D, streams.device)
    with device_guard(streams.device.index):
        _call(
            "engram_mhc_head_norm",
            ptr(streams),
            float_code(streams.dtype),
            ptr(fn),
            ptr(base),
            ptr(scale),
            T,
            hc,
            D,
            _f32(hc_eps),
            _f32(norm_eps),
            ptr(norm_weight),
            _f32(rms_eps),
            ptr(workspace),
            workspace.numel() * workspace.element_size(),
            ptr(normed),
            stream_of(streams.device),
        )
    return normed


@functools.lru_cache(maxsize=256)
def fold_workspace_size(num_tokens: int, hc_mult: int, hidden: int) -> int:
    """Bytes of fp32 partial sums a :func:`mhc_fold` call of ``num_tokens`` tokens needs (no GPU asked)."""
    out = ctypes.c_size_t(0)
    _call("engram_mhc_fold_workspace_size", int(num_tokens), int(hc_mult), int(hidden), ctypes.byref(out))
    return int(out.value)


def mhc_fold(
    streams: Any,
    out: Any,
    post: Any,
    comb: Any,
    fn: Any,
    base: Any,
    scale: Any,
    norm_weight: Any = None,
    *,
    head: bool = False,
    sinkhorn_iters: int = 1,
    hc_eps: float,
    norm_eps: float,
    rms_eps: float = 0.0,
    new_streams: Any = None,
    workspace: Any = None,
) -> tuple[Any, Any, Any, Any]:
    """A sublayer boundary (engram_mhc_fold): ``(new_streams, collapsed, next_post, next_comb)``
    where ``new_streams`` = :func:`mhc_post` ``(streams, out, post, comb)`` (``new_streams``
    may be ``streams``: in place) and ``collapsed`` the next collapse of them: a layer's
    (``fn [(2+hc)*hc, hc*D]``, ``base``, ``scale [3]``; next_post / next_comb as
    :func:`mhc_pre`'s) or, with ``head``, the hyper head's (``fn [hc, hc*D]``, ``scale [1]``;
    next_post / next_comb None), RMS-normalized by ``norm_weight [D]`` (float32, ``rms_eps``)
    when given."""
    torch = torch_module()
    T, hc, D = _check_streams(streams)
    check_dtype("out", out, (streams.dtype,))
    check_dtype("post", post, (torch.float32,))
    check_dtype("comb", comb, (torch.float32,))
    if tuple(out.shape) != (T, D):
        raise EngramError(f"out must be [T, hidden] = {(T, D)} (got {tuple(out.shape)})")
    if tuple(post.shape) != (T, hc):
        raise EngramError(f"post must be [T, hc] = {(T, hc)} (got {tuple(post.shape)})")
    if tuple(comb.shape) != (T, hc, hc):
        raise EngramError(f"comb must be [T, hc, hc] = {(T, hc, hc)} (got {tuple(comb.shape)})")
    rows = hc if head else (2 + hc) * hc
    _check_params(fn, base, scale, rows, hc * D, 1 if head else 3)
    check_shape(hc, D, 1 if head else sinkhorn_iters, hc_eps, norm_eps)
    if new_streams is None:
        new_streams = torch.empty_like(streams)
    check_dtype("new_streams", new_streams, (streams.dtype,))
    if tuple(new_streams.shape) != (T, hc, D):
        raise EngramError(f"new_streams must be [T, hc, hidden] = {(T, hc, D)} (got {tuple(new_streams.shape)})")
    if norm_weight is not None:  # dtype and shape before the devices (the house order)
        check_dtype("norm_weight", norm_weight, (torch.float32,))
        if tuple(norm_weight.shape) != (D,):
            raise EngramError(f"norm_weight must be [{D}] (got {tuple(norm_weight.shape)})")
    _check_devices(streams, out=out, post=post, comb=comb, fn=fn, base=base, scale=scale, new_streams=new_streams)
    if norm_weight is not None:
        _check_norm_weight(norm_weight, D, streams.device)
    collapsed = torch.empty((T, D), dtype=streams.dtype, device=streams.device)
    next_post = next_comb = None
    if not head:
        coef = torch.empty(T * hc * (1 + hc), dtype=torch.float32, device=streams.device)
        next_post, next_comb = coef[: T * hc].view(T, hc), coef[T * hc :].view(T, hc, hc)
    need = fold_workspace_size(T, hc, D)
    if workspace is None:
        workspace = torch.empty(max(need // 4, 4), dtype=torch.float32, device=streams.device)
    check_dtype("workspace", workspace, (torch.float32, torch.uint8))
    if workspace.numel() * workspace.element_size() < need:
        raise EngramError(
            f"workspace holds {workspace.numel() * workspace.element_size()} bytes, {need} needed for "
            f"{T} tokens (fold_workspace_size)"
        )
    check("workspace", workspace, (workspace.dtype,))
    same_device(streams.device, workspace=workspace)
    with device_guard(streams.device.index):
        _call(
            "engram_mhc_fold",
            ptr(streams),
            ptr(out),
            float_code(streams.dtype),
            ptr(post),
            ptr(comb),
            ptr(fn),
            ptr(base),
            ptr(scale),
            T,
            hc,
            D,
            int(sinkhorn_iters) if not head else 1,
            _f32(hc_eps),
            _f32(norm_eps),
            1 if head else 0,
            ptr(norm_weight),
            _f32(rms_eps),
            ptr(workspace),
            workspace.numel() * workspace.element_size(),
            ptr(new_streams),
            ptr(collapsed),
            ptr(next_post),
            ptr(next_comb),
            stream_of(streams.device),
        )
    return new_streams, collapsed, next_post, next_comb
