"""ctypes binding to the QSA attention kernel of the kernel library
(``plugins/kernels/qsaAttentionKernel.cu``, the math of the EngramQsaAttention plugin):
Qwen4-Exp's gated full attention's core with the QSA block indexer over a packed step,
writing the step's k / v / raw indexer keys into the slot caches in place first.

:func:`qsa_attention` is what ``GatedAttention.forward`` (models/qwen4_exp/attention.py)
computes between the projections and ``* sigmoid(gate)``: its inputs are the normed and
rotated q, k, the indexer's normed and rotated queries and its raw keys.
models/qwen4_exp/reference_qsa.py is the float64 reference. Arguments are checked (dtypes, then
shapes, then devices; an EngramError names the bad one) before anything reaches the
library; the entry points are declared here on first use, as native/linear_attention.py
declares its own, so a library built before this kernel still serves the rest.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
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

# engramKernels.h: ENGRAM_QSA_MAX_HEAD_DIM, ENGRAM_QSA_MAX_INDEX_HEADS, ENGRAM_QSA_MAX_VISIBLE
MAX_HEAD_DIM = 256
MAX_INDEX_HEADS = 64
MAX_VISIBLE = 16384

_i32, _i64, _vp, _f32 = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
_ENTRY = EntryPoints(
    {
        "engram_qsa_check_fields": [_i32, _i32, _i32, _f32, _f32, _f32],
        "engram_qsa_check_shape": [_i32, _i32, _i32, _i32, _i32, _i32],
        "engram_qsa_workspace_size": [_i64, _i64, _i32, _i32, ctypes.POINTER(ctypes.c_size_t)],
        "engram_qsa_attention": [
            _vp,
            _vp,
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
            _vp,
            _i64,
            _i32,
            _i32,
            _i32,
            _i32,
            _i32,
            _i64,
            _i64,
            _i32,
            _i32,
            _i32,
            _f32,
            _f32,
            _f32,
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


@dataclass(frozen=True)
class QsaFields:
    """The EngramQsaAttention plugin's fields (same names, same meaning)."""

    compress_ratio: int
    block_topk: int
    rot_dim: int
    rope_theta: float
    eps: float
    scaling: float


def check_fields(fields: QsaFields) -> None:
    """The kernel's limits of the fields alone ((block_topk + 1) * compress_ratio <=
    MAX_VISIBLE, rot_dim even, the floats finite and positive); no GPU."""
    _call(
        "engram_qsa_check_fields",
        int(fields.compress_ratio),
        int(fields.block_topk),
        int(fields.rot_dim),
        ctypes.c_float(fields.rope_theta),
        ctypes.c_float(fields.eps),
        ctypes.c_float(fields.scaling),
    )


def check_shape(
    num_heads: int, num_kv_heads: int, head_dim: int, index_heads: int, index_dim: int, rot_dim: int
) -> None:
    """The kernel's limits of the head shapes (GQA, dims <= MAX_HEAD_DIM, rot_dim within
    both head dims); no GPU."""
    _call(
        "engram_qsa_check_shape",
        int(num_heads),
        int(num_kv_heads),
        int(head_dim),
        int(index_heads),
        int(index_dim),
        int(rot_dim),
    )


def workspace_size(max_tokens: int, max_seq_len: int, compress_ratio: int, block_topk: int) -> int:
    """Bytes of workspace a step of up to ``max_tokens`` needs (0 when no query can see
    more than ``block_topk`` blocks)."""
    out = ctypes.c_size_t(0)
    _call(
        "engram_qsa_workspace_size",
        int(max_tokens),
        int(max_seq_len),
        int(compress_ratio),
        int(block_topk),
        ctypes.byref(out),
    )
    return int(out.value)


def qsa_attention(
    q: Any,
    k: Any,
    v: Any,
    index_q: Any,
    index_raw: Any,
    key_cache: Any,
    value_cache: Any,
    index_key_cache: Any,
    index_k_norm_weight: Any,
    token_slot: Any,
    token_pos: Any,
    fields: QsaFields,
    *,
    out: Any = None,
) -> Any:
    """The attention core ``[T, H * hd]`` of a packed step; the three caches updated in place.

    ``q [T, H, hd]``, ``k / v [T, KVH, hd]``, ``index_q [T, NI, di]``, ``index_raw [T, di]``,
    ``key_cache / value_cache [num_slots, KVH, max_len, hd]``, ``index_key_cache
    [num_slots, max_len, di]`` share one dtype (bf16, fp16, float32);
    ``index_k_norm_weight [di]`` float32 or that dtype; ``token_slot / token_pos [T]``
    int32; all contiguous on one CUDA device. A token outside the caches writes nothing
    and gets a zero row.
    """
    torch = torch_module()
    io_dtypes = (torch.bfloat16, torch.float16, torch.float32)
    check_dtype("q", q, io_dtypes)
    io = q.dtype
    named = (
        ("k", k),
        ("v", v),
        ("index_q", index_q),
        ("index_raw", index_raw),
        ("key_cache", key_cache),
        ("value_cache", value_cache),
        ("index_key_cache", index_key_cache),
    )
    for name, t in named:
        check_dtype(name, t, (io,))
    check_dtype("index_k_norm_weight", index_k_norm_weight, tuple(dict.fromkeys((torch.float32, io))))
    for name, t in (("token_slot", token_slot), ("token_pos", token_pos)):
        check_dtype(name, t, (torch.int32,))
    ranks = {
        "q": 3,
        "k": 3,
        "v": 3,
        "index_q": 3,
        "index_raw": 2,
        "key_cache": 4,
        "value_cache": 4,
        "index_key_cache": 3,
    }
    for name, t in (("q", q), *named):
        check(name, t, (io,), ranks[name], where="any")
    check("index_k_norm_weight", index_k_norm_weight, (index_k_norm_weight.dtype,), 1, where="any")
    T, H, hd = q.shape
    num_slots, kvh, max_len, _ = key_cache.shape
    _, ni, di = index_q.shape
    want = {
        "k": (T, kvh, hd),
        "v": (T, kvh, hd),
        "index_q": (T, ni, di),
        "index_raw": (T, di),
        "key_cache": (num_slots, kvh, max_len, hd),
        "value_cache": (num_slots, kvh, max_len, hd),
        "index_key_cache": (num_slots, max_len, di),
    }
    for name, t in named:
        if tuple(t.shape) != want[name]:
            raise EngramError(
                f"{name} must be {list(want[name])} (q {tuple(q.shape)}, key_cache "
                f"{tuple(key_cache.shape)}, index_q {tuple(index_q.shape)}); got {tuple(t.shape)}"
            )
    if tuple(index_k_norm_weight.shape) != (di,):
        raise EngramError(f"index_k_norm_weight must be [{di}] (got {tuple(index_k_norm_weight.shape)})")
    for name, t in (("token_slot", token_slot), ("token_pos", token_pos)):
        check(name, t, (torch.int32,), 1, where="any")
        if t.shape[0] != T:
            raise EngramError(f"{name} must be [{T}] (got {tuple(t.shape)})")
    check_fields(fields)
    check_shape(H, kvh, hd, ni, di, fields.rot_dim)
    if out is None:
        out = torch.empty(T, H * hd, dtype=io, device=q.device)
    check("out", out, (io,), 2, where="any")
    if tuple(out.shape) != (T, H * hd):
        raise EngramError(f"out must be [{T}, {H * hd}] (got {tuple(out.shape)})")
    tensors = dict(
        q=q,
        k=k,
        v=v,
        index_q=index_q,
        index_raw=index_raw,
        key_cache=key_cache,
        value_cache=value_cache,
        index_key_cache=index_key_cache,
        index_k_norm_weight=index_k_norm_weight,
        token_slot=token_slot,
        token_pos=token_pos,
        out=out,
    )
    for name, t in tensors.items():
        if not t.is_cuda:
            raise EngramError(f"{name} must be a CUDA tensor (got device {t.device})")
    same_device(q.device, **tensors)
    ws_bytes = workspace_size(T, max_len, fields.compress_ratio, fields.block_topk)
    workspace = torch.empty(ws_bytes, dtype=torch.uint8, device=q.device) if ws_bytes else None
    with device_guard(q.device.index):
        _call(
            "engram_qsa_attention",
            ptr(q),
            ptr(k),
            ptr(v),
            ptr(index_q),
            ptr(index_raw),
            float_code(io),
            ptr(key_cache),
            ptr(value_cache),
            ptr(index_key_cache),
            ptr(index_k_norm_weight),
            float_code(index_k_norm_weight.dtype),
            ptr(token_slot),
            ptr(token_pos),
            T,
            H,
            kvh,
            hd,
            ni,
            di,
            num_slots,
            max_len,
            int(fields.compress_ratio),
            int(fields.block_topk),
            int(fields.rot_dim),
            ctypes.c_float(fields.rope_theta),
            ctypes.c_float(fields.eps),
            ctypes.c_float(fields.scaling),
            ptr(workspace),
            ws_bytes,
            ptr(out),
            stream_of(q.device),
        )
    return out
