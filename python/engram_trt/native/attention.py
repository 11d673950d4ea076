"""ctypes bindings to the serving step's attention in the kernel library
(``plugins/kernels/attentionKernel.cu`` and ``attentionWarpKernel.cu``, the EngramAttention
plugin's math).

A step's packed tokens write their K/V into the slot caches ``[slots, kv_heads,
max_seq_len, head_dim]`` in place, then each token attends (causal, grouped-query) to its
slot's keys ``0 .. its position``; :func:`rope_kv_cache_write` rotates a fused q / k / v
projection and writes its K/V in one launch. The functions take torch tensors and check dtypes,
then shapes, then devices before anything reaches the library (an EngramError names the
bad argument); work is enqueued on the current CUDA stream. The entry points are
declared here, on first use, so this module and :mod:`engram_trt.native.hash`,
:mod:`~engram_trt.native.gather` and :mod:`~engram_trt.native.gate` each own their part of the C ABI.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

from engram_trt.errors import EngramError
from engram_trt.native.library import (
    EntryPoints,
    capability_major,
    check,
    check_dtype,
    device_guard,
    float_code,
    ptr,
    same_device,
    stream_of,
    torch_module,
)

# The shapes the warp attention kernel serves (warpKernel() in attentionWarpKernel.cu, which
# this mirrors): 16-bit I/O, head_dim 128, at most this many query heads per KV head, a
# GPU of compute capability 9.0 or later; ENGRAM_TRT_ATTENTION_KERNEL=tiled turns it off.
WARP_KERNEL_HEAD_DIM = 128
WARP_KERNEL_MAX_GROUP = 4
WARP_KERNEL_MIN_CAPABILITY = 9


_SIGS = {
    "engram_attention_check_shape": [ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.c_float],
    "engram_attention_workspace_size": [
        ctypes.c_int64,
        ctypes.c_int32,
        ctypes.c_int32,
        ctypes.c_int32,
        ctypes.c_int64,
        ctypes.POINTER(ctypes.c_size_t),
    ],
    "engram_kv_cache_write": [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int32,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int32,
        ctypes.c_int32,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_void_p,
    ],
    "engram_attention_packed": [
        ctypes.c_void_p,
        ctypes.c_int32,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int32,
        ctypes.c_int32,
        ctypes.c_int32,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_float,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_void_p,
        ctypes.c_void_p,
    ],
    "engram_rope_kv_cache_write": [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int32,
        ctypes.c_int32,
        ctypes.c_int32,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_void_p,
    ],
    "engram_attention_step": [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int32,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int32,
        ctypes.c_int32,
        ctypes.c_int32,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_float,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_void_p,
        ctypes.c_void_p,
    ],
}
_ENTRY = EntryPoints(_SIGS)
library = _ENTRY.library
_call = _ENTRY.call


def check_attention_shape(num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
    """The attention kernel's shape limits (GQA ratio, head_dim, scale); needs no GPU."""
    _call("engram_attention_check_shape", int(num_heads), int(num_kv_heads), int(head_dim), ctypes.c_float(scale))


def attention_workspace_size(
    max_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, max_seq_len: int
) -> int:
    """Bytes of workspace the attention may use for steps of up to ``max_tokens`` tokens
    (the key splits of small decode steps); needs no GPU."""
    out = ctypes.c_size_t(0)
    _call(
        "engram_attention_workspace_size",
        int(max_tokens),
        int(num_heads),
        int(num_kv_heads),
        int(head_dim),
        int(max_seq_len),
        ctypes.byref(out),
    )
    return int(out.value)


def _cache_shape(key_cache: Any, value_cache: Any, token_slot: Any, token_pos: Any) -> tuple[int, int, int, int]:
    """(num_slots, kv_heads, max_seq_len, head_dim) of a KV cache pair, after the int32
    check of the step's slots and positions (dtypes are named before shapes)."""
    torch = torch_module()
    for name, t in (("token_slot", token_slot), ("token_pos", token_pos)):
        check_dtype(name, t, (torch.int32,))
    if key_cache.dim() != 4 or value_cache.shape != key_cache.shape:
        raise EngramError(
            f"key_cache and value_cache must be one shape [slots, kv_heads, max_seq_len, head_dim] "
            f"(got {tuple(key_cache.shape)} and {tuple(value_cache.shape)})"
        )
    num_slots, kvh, max_seq_len, hd = key_cache.shape
    return num_slots, kvh, max_seq_len, hd


def _check_slot_shapes(token_slot: Any, token_pos: Any, T: int) -> None:
    for name, t in (("token_slot", token_slot), ("token_pos", token_pos)):
        if tuple(t.shape) != (T,):
            raise EngramError(f"{name} must be [T] = ({T},) (got {tuple(t.shape)})")


def _attention_args(
    q: Any, k: Any, v: Any, key_cache: Any, value_cache: Any, token_slot: Any, token_pos: Any
) -> tuple[int, int, int, int, int, int]:
    """(T, num_heads, num_kv_heads, head_dim, num_slots, max_seq_len) after the checks:
    dtypes, then shapes, then devices (so a shape error is named on any device)."""
    torch = torch_module()
    io_dtypes = (torch.bfloat16, torch.float16, torch.float32)
    check_dtype("key_cache", key_cache, io_dtypes)
    dtype = key_cache.dtype
    floats = [(name, t) for name, t in (("q", q), ("k", k), ("v", v), ("value_cache", value_cache)) if t is not None]
    for name, t in floats:
        check_dtype(name, t, (dtype,))
    num_slots, kvh, max_seq_len, hd = _cache_shape(key_cache, value_cache, token_slot, token_pos)
    T = (q if q is not None else k).shape[0]
    H = kvh if q is None else q.shape[1]
    if q is not None and (q.dim() != 3 or q.shape[2] != hd):
        raise EngramError(f"q must be [T, num_heads, head_dim={hd}] (got {tuple(q.shape)})")
    for name, t in (("k", k), ("v", v)):
        if t is not None and tuple(t.shape) != (T, kvh, hd):
            raise EngramError(f"{name} must be [T, num_kv_heads, head_dim] = {(T, kvh, hd)} (got {tuple(t.shape)})")
    _check_slot_shapes(token_slot, token_pos, T)
    for name, t in floats + [("key_cache", key_cache), ("token_slot", token_slot), ("token_pos", token_pos)]:
        check(name, t, (t.dtype,))
    same_device(key_cache.device, q=q, k=k, v=v, value_cache=value_cache, token_slot=token_slot, token_pos=token_pos)
    return T, H, kvh, hd, num_slots, max_seq_len


def _attention_out(out: Any, q: Any) -> Any:
    torch = torch_module()
    if out is None:
        return torch.empty_like(q)
    check("out", out, (q.dtype,), 3)
    if out.shape != q.shape or out.device != q.device:
        raise EngramError(
            f"out must be [T, num_heads, head_dim] = {tuple(q.shape)} on {q.device} "
            f"(got {tuple(out.shape)} on {out.device})"
        )
    return out


def _workspace(T: int, H: int, kvh: int, hd: int, max_seq_len: int, device: Any) -> Any:
    nbytes = attention_workspace_size(T, H, kvh, hd, max_seq_len)
    return None if nbytes == 0 else torch_module().empty(nbytes, dtype=torch_module().uint8, device=device)


def kv_cache_write(k: Any, v: Any, key_cache: Any, value_cache: Any, token_slot: Any, token_pos: Any) -> None:
    """Token t's ``k / v [T, kv_heads, head_dim]`` rows into ``key_cache / value_cache
    [slots, kv_heads, max_seq_len, head_dim]`` at ``(token_slot[t], :, token_pos[t])``,
    in place; a slot or position outside the cache writes nothing."""
    T, _, kvh, hd, num_slots, max_seq_len = _attention_args(None, k, v, key_cache, value_cache, token_slot, token_pos)
    with torch_module().cuda.device(key_cache.device):
        _call(
            "engram_kv_cache_write",
            ptr(k),
            ptr(v),
            float_code(key_cache.dtype),
            ptr(token_slot),
            ptr(token_pos),
            T,
            kvh,
            hd,
            ptr(key_cache),
            ptr(value_cache),
            num_slots,
            max_seq_len,
            stream_of(key_cache.device),
        )


def attention_packed(
    q: Any,
    key_cache: Any,
    value_cache: Any,
    token_slot: Any,
    token_pos: Any,
    *,
    scale: float | None = None,
    out: Any = None,
) -> Any:
    """Causal GQA attention of packed queries ``q [T, heads, head_dim]`` over their slots'
    keys ``0 .. token_pos[t]`` (inclusive); ``[T, heads, head_dim]`` in q's dtype, zero
    rows for tokens outside the cache. ``scale`` defaults to ``1/sqrt(head_dim)``."""
    T, H, kvh, hd, num_slots, max_seq_len = _attention_args(
        q, None, None, key_cache, value_cache, token_slot, token_pos
    )
    out = _attention_out(out, q)
    ws = _workspace(T, H, kvh, hd, max_seq_len, q.device)
    with torch_module().cuda.device(q.device):
        _call(
            "engram_attention_packed",
            ptr(q),
            float_code(q.dtype),
            ptr(key_cache),
            ptr(value_cache),
            ptr(token_slot),
            ptr(token_pos),
            T,
            H,
            kvh,
            hd,
            num_slots,
            max_seq_len,
            ctypes.c_float(hd**-0.5 if scale is None else scale),
            ptr(ws),
            0 if ws is None else ws.numel(),
            ptr(out),
            stream_of(q.device),
        )
    return out


def attention_step(
    q: Any,
    k: Any,
    v: Any,
    key_cache: Any,
    value_cache: Any,
    token_slot: Any,
    token_pos: Any,
    *,
    scale: float | None = None,
    out: Any = None,
) -> Any:
    """One serving step: :func:`kv_cache_write` then :func:`attention_packed`, so the
    tokens of a prefill chunk see each other's keys (the EngramAttention plugin's math)."""
    T, H, kvh, hd, num_slots, max_seq_len = _attention_args(q, k, v, key_cache, value_cache, token_slot, token_pos)
    out = _attention_out(out, q)
    ws = _workspace(T, H, kvh, hd, max_seq_len, q.device)
    with torch_module().cuda.device(q.device):
        _call(
            "engram_attention_step",
            ptr(q),
            ptr(k),
            ptr(v),
            float_code(q.dtype),
            ptr(token_slot),
            ptr(token_pos),
            T,
            H,
            kvh,
            hd,
            ptr(key_cache),
            ptr(value_cache),
            num_slots,
            max_seq_len,
            ctypes.c_float(hd**-0.5 if scale is None else scale),
            ptr(ws),
            0 if ws is None else ws.numel(),
            ptr(out),
            stream_of(q.device),
        )
    return out


def rope_kv_cache_write(
    qkv: Any,
    cos: Any,
    sin: Any,
    key_cache: Any,
    value_cache: Any,
    token_slot: Any,
    token_pos: Any,
    num_heads: int,
    *,
    q_out: Any = None,
) -> Any:
    """RoPE of a fused projection and the KV write in one launch (bf16): ``qkv [T,
    (num_heads + 2 * kv_heads) * head_dim]`` (q heads, k heads, v heads per token),
    ``cos / sin [T, head_dim]`` -> rotated q ``[T, num_heads, head_dim]``; the rotated k
    and the v rows go into the caches at ``(token_slot[t], :, token_pos[t])`` as
    :func:`kv_cache_write` writes them. Rounds as the reference's bf16
    ``q * cos + rotate_half(q) * sin`` (engramKernels.h)."""
    torch = torch_module()
    for name, t in (("qkv", qkv), ("cos", cos), ("sin", sin), ("key_cache", key_cache), ("value_cache", value_cache)):
        check_dtype(name, t, (torch.bfloat16,))
    num_slots, kvh, max_seq_len, hd = _cache_shape(key_cache, value_cache, token_slot, token_pos)
    H = int(num_heads)
    if qkv.dim() != 2 or qkv.shape[1] != (H + 2 * kvh) * hd:
        raise EngramError(
            f"qkv must be [T, (num_heads + 2 * kv_heads) * head_dim] = [T, {(H + 2 * kvh) * hd}] "
            f"(got {tuple(qkv.shape)})"
        )
    T = qkv.shape[0]
    for name, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) != (T, hd):
            raise EngramError(f"{name} must be [T, head_dim] = {(T, hd)} (got {tuple(t.shape)})")
    _check_slot_shapes(token_slot, token_pos, T)
    for name, t in (
        ("qkv", qkv),
        ("cos", cos),
        ("sin", sin),
        ("key_cache", key_cache),
        ("value_cache", value_cache),
        ("token_slot", token_slot),
        ("token_pos", token_pos),
    ):
        check(name, t, (t.dtype,))
    same_device(
        key_cache.device, qkv=qkv, cos=cos, sin=sin, value_cache=value_cache, token_slot=token_slot, token_pos=token_pos
    )
    if q_out is None:
        q_out = torch.empty((T, H, hd), dtype=qkv.dtype, device=qkv.device)
    else:
        check("q_out", q_out, (torch.bfloat16,), 3)
        if tuple(q_out.shape) != (T, H, hd) or q_out.device != qkv.device:
            raise EngramError(
                f"q_out must be [T, num_heads, head_dim] = {(T, H, hd)} on {qkv.device} "
                f"(got {tuple(q_out.shape)} on {q_out.device})"
            )
    with device_guard(qkv.device.index):
        _call(
            "engram_rope_kv_cache_write",
            ptr(qkv),
            ptr(cos),
            ptr(sin),
            ptr(token_slot),
            ptr(token_pos),
            T,
            H,
            kvh,
            hd,
            ptr(key_cache),
            ptr(value_cache),
            num_slots,
            max_seq_len,
            ptr(q_out),
            stream_of(qkv.device),
        )
    return q_out


def warp_kernel_serves(q: Any, num_heads: int, num_kv_heads: int) -> bool:
    """True when :func:`attention_packed` on queries like ``q [T, H, head_dim]`` runs the
    warp attention kernel (else the tiled one): the same test as the library's, made in
    Python so that a caller can pick a path by it (the decode graphs read small caches in
    place only where this kernel serves)."""
    torch = torch_module()
    return (
        q.is_cuda
        and q.dtype in (torch.bfloat16, torch.float16)
        and q.shape[-1] == WARP_KERNEL_HEAD_DIM
        and num_kv_heads > 0
        and num_heads // num_kv_heads <= WARP_KERNEL_MAX_GROUP
        and os.environ.get("ENGRAM_TRT_ATTENTION_KERNEL") != "tiled"
        and capability_major(q.device.index) >= WARP_KERNEL_MIN_CAPABILITY
    )
