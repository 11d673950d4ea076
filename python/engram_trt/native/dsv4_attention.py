"""ctypes binding of DeepSeek-V4's attention core in the kernel library
(``plugins/kernels/dsv4AttentionKernel.cu``, the math of the EngramDsv4Attention plugin):
the sliding window, the HCA / CSA compressors streaming into per-slot entries, the CSA
lightning indexer's top-k and the sink softmax over a packed step, the state updated in
place.

The inputs are the node's, in its order (plugins/engramDsv4AttentionPlugin/README.md):
``q, kv, sinks, seq_starts, past_lens, slots, window_kv``, then for CSA / HCA layers the
8 compressor inputs ``(kv, gate, bias, norm, inv_freq, entries, ring_kv, ring_gate)`` and
for CSA the 9 indexer inputs ``(q, w, kv, gate, bias, norm, keys, ring_kv, ring_gate)``.
models/deepseek_v4/reference_attention.py is the float64 reference of the same contract. The
function checks dtypes and shapes before anything reaches the library (an EngramError
names the bad argument); the library checks the fields (:func:`check_fields` asks it
without a GPU).
"""

from __future__ import annotations

import ctypes
from typing import Any, Sequence

from engram_trt.errors import EngramError
from engram_trt.native.library import (
    EntryPoints,
    check_dtype,
    device_guard,
    float_code,
    ptr,
    same_device,
    stream_of,
    torch_module,
)

SLIDING, CSA, HCA = 0, 1, 2
MAX_HEAD_DIM = 512  # engramKernels.h ENGRAM_DSV4_MAX_HEAD_DIM
N_INPUTS = {SLIDING: 7, HCA: 15, CSA: 24}
STATE_INPUTS = (6, 12, 13, 14, 21, 22, 23)
_NAMES = (
    "q",
    "kv",
    "sinks",
    "seq_starts",
    "past_lens",
    "slots",
    "window_kv",
    "c_kv",
    "c_gate",
    "c_bias",
    "c_norm",
    "inv_freq",
    "compressed_kv",
    "compressor_kv",
    "compressor_gate",
    "index_q",
    "index_w",
    "i_kv",
    "i_gate",
    "i_bias",
    "i_norm",
    "index_keys",
    "indexer_kv",
    "indexer_gate",
)
_F32 = {2, 9, 10, 11, 16, 19, 20}
_I32 = {3, 4, 5}


class Dsv4Shape(ctypes.Structure):
    """engramKernels.h ``EngramDsv4Shape``."""

    _fields_ = [
        ("num_tokens", ctypes.c_int64),
        ("num_seqs", ctypes.c_int64),
        ("num_slots", ctypes.c_int64),
        ("max_entries", ctypes.c_int64),
        ("layer_type", ctypes.c_int32),
        ("window", ctypes.c_int32),
        ("compress_rate", ctypes.c_int32),
        ("index_topk", ctypes.c_int32),
        ("io_type", ctypes.c_int32),
        ("num_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("rope_pairs", ctypes.c_int32),
        ("index_heads", ctypes.c_int32),
        ("index_dim", ctypes.c_int32),
        ("scaling", ctypes.c_float),
        ("eps", ctypes.c_float),
        ("rope_scale", ctypes.c_float),
    ]


class Dsv4Tensors(ctypes.Structure):
    """engramKernels.h ``EngramDsv4Tensors`` (pointers, in the node's input order, then out)."""

    _fields_ = [
        (name, ctypes.c_void_p)
        for name in (
            "q",
            "kv",
            "sinks",
            "seq_starts",
            "past_lens",
            "seq_slots",
            "window_kv",
            "comp_kv",
            "comp_gate",
            "comp_bias",
            "comp_norm",
            "inv_freq",
            "entries",
            "comp_ring_kv",
            "comp_ring_gate",
            "index_q",
            "index_w",
            "index_kv",
            "index_gate",
            "index_bias",
            "index_norm",
            "index_keys",
            "index_ring_kv",
            "index_ring_gate",
            "out",
        )
    ]


_P = ctypes.POINTER
_ENTRY = EntryPoints(
    {
        "engram_dsv4_check": [_P(Dsv4Shape)],
        "engram_dsv4_workspace_size": [_P(Dsv4Shape), _P(ctypes.c_size_t)],
        "engram_dsv4_attention": [_P(Dsv4Shape), _P(Dsv4Tensors), ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p],
    }
)
library = _ENTRY.library
unavailable = _ENTRY.unavailable
_call = _ENTRY.call


def _shape_struct(
    *,
    layer_type: int,
    window: int,
    compress_rate: int,
    index_topk: int,
    scaling: float,
    eps: float,
    rope_scale: float,
    io_type: int = 1,
    num_tokens: int = 0,
    num_seqs: int = 0,
    num_slots: int = 0,
    max_entries: int = 0,
    num_heads: int = 1,
    head_dim: int = 2,
    rope_pairs: int = 1,
    index_heads: int = 1,
    index_dim: int = 2,
) -> Dsv4Shape:
    return Dsv4Shape(
        num_tokens,
        num_seqs,
        num_slots,
        max_entries,
        int(layer_type),
        int(window),
        int(compress_rate),
        int(index_topk),
        io_type,
        num_heads,
        head_dim,
        rope_pairs,
        index_heads,
        index_dim,
        float(scaling),
        float(eps),
        float(rope_scale),
    )


def check_fields(
    *,
    layer_type: int,
    window: int,
    compress_rate: int = 0,
    index_topk: int = 0,
    scaling: float,
    eps: float = 1e-6,
    rope_scale: float = 1.0,
) -> None:
    """The library's field checks (the plugin's creation refuses the same); no GPU."""
    shape = _shape_struct(
        layer_type=layer_type,
        window=window,
        compress_rate=compress_rate,
        index_topk=index_topk,
        scaling=scaling,
        eps=eps,
        rope_scale=rope_scale,
    )
    _call("engram_dsv4_check", ctypes.byref(shape))


def _want(name: str, t: Any, shape: tuple) -> None:
    if tuple(t.shape) != tuple(shape):
        raise EngramError(f"{name} has shape {tuple(t.shape)}; pass {list(shape)}")


def dsv4_attention(
    *inputs: Any,
    layer_type: int,
    window: int,
    compress_rate: int = 0,
    index_topk: int = 0,
    scaling: float,
    eps: float = 1e-6,
    rope_scale: float = 1.0,
    out: Any = None,
    workspace: Any = None,
) -> Any:
    """The node's output ``[T, H, d]`` (before the inverse RoPE) for its inputs in op order
    (7 / 15 / 24 CUDA tensors by ``layer_type``; state tensors updated in place)."""
    torch = torch_module()
    layer_type = int(layer_type)
    want_n = N_INPUTS.get(layer_type)
    if want_n is None or len(inputs) != want_n:
        raise EngramError(
            f"layer_type {layer_type} takes {want_n} inputs (sliding 7, HCA 15, CSA 24), got {len(inputs)}"
        )
    acts = (torch.bfloat16, torch.float16, torch.float32)
    check_dtype("q", inputs[0], acts)
    io = inputs[0].dtype
    for i, t in enumerate(inputs):
        check_dtype(_NAMES[i], t, (torch.float32,) if i in _F32 else (torch.int32,) if i in _I32 else (io,))
    for i, t in enumerate(inputs):
        if not t.is_cuda:
            raise EngramError(f"{_NAMES[i]} must be a CUDA tensor (got device {t.device})")
        if not t.is_contiguous():
            raise EngramError(f"{_NAMES[i]} must be contiguous")
    q = inputs[0]
    if q.dim() != 3:
        raise EngramError(f"q has shape {tuple(q.shape)}; pass [tokens, heads, head_dim]")
    T, H, d = q.shape
    S = inputs[4].shape[0]
    win = inputs[6]
    if win.dim() != 3:
        raise EngramError(f"window_kv has shape {tuple(win.shape)}; pass [num_slots, {window}, {d}]")
    N = win.shape[0]
    for i, shape in ((1, (T, d)), (2, (H,)), (3, (S + 1,)), (4, (S,)), (5, (S,)), (6, (N, window, d))):
        _want(_NAMES[i], inputs[i], shape)
    E = P = NI = di = 0
    if layer_type != SLIDING:
        csa = layer_type == CSA
        r = int(compress_rate)
        w, R = (2 * d, 2 * r) if csa else (d, r)
        if inputs[12].dim() != 3:
            raise EngramError(f"compressed_kv has shape {tuple(inputs[12].shape)}; pass [{N}, max_len // rate, {d}]")
        E = inputs[12].shape[1]
        P = inputs[11].shape[0] if inputs[11].dim() == 1 else -1
        for i, shape in (
            (7, (T, w)),
            (8, (T, w)),
            (9, (r, w)),
            (10, (d,)),
            (11, (P,)),
            (12, (N, E, d)),
            (13, (N, R, w)),
            (14, (N, R, w)),
        ):
            _want(_NAMES[i], inputs[i], shape)
        if csa:
            if inputs[15].dim() != 3:
                raise EngramError(f"index_q has shape {tuple(inputs[15].shape)}; pass [{T}, heads, dim]")
            NI, di = inputs[15].shape[1], inputs[15].shape[2]
            for i, shape in (
                (15, (T, NI, di)),
                (16, (T, NI)),
                (17, (T, 2 * di)),
                (18, (T, 2 * di)),
                (19, (r, 2 * di)),
                (20, (di,)),
                (21, (N, E, di)),
                (22, (N, 2 * r, 2 * di)),
                (23, (N, 2 * r, 2 * di)),
            ):
                _want(_NAMES[i], inputs[i], shape)
    shape = _shape_struct(
        layer_type=layer_type,
        window=window,
        compress_rate=compress_rate,
        index_topk=index_topk,
        scaling=scaling,
        eps=eps,
        rope_scale=rope_scale,
        io_type=float_code(io),
        num_tokens=T,
        num_seqs=S,
        num_slots=N,
        max_entries=E,
        num_heads=H,
        head_dim=d,
        rope_pairs=max(P, 0),
        index_heads=NI,
        index_dim=di,
    )
    if out is None:
        out = torch.empty_like(q)
    check_dtype("out", out, (io,))
    _want("out", out, (T, H, d))
    same_device(q.device, out=out, **{_NAMES[i]: t for i, t in enumerate(inputs)})
    need = ctypes.c_size_t(0)
    _call("engram_dsv4_workspace_size", ctypes.byref(shape), ctypes.byref(need))
    if need.value and (workspace is None or workspace.numel() * workspace.element_size() < need.value):
        workspace = torch.empty(need.value, dtype=torch.uint8, device=q.device)
    ptrs = [ptr(t if t.numel() else None).value for t in inputs] + [None] * (24 - len(inputs))
    tensors = Dsv4Tensors(*ptrs, ptr(out).value)
    with device_guard(q.device.index):
        _call(
            "engram_dsv4_attention",
            ctypes.byref(shape),
            ctypes.byref(tensors),
            ptr(workspace if need.value else None),
            need.value,
            stream_of(q.device),
        )
    return out


def dsv4_attention_parts(
    q: Any,
    kv: Any,
    sinks: Any,
    seq_starts: Any,
    past_lens: Any,
    slots: Any,
    window_kv: Any,
    *,
    compressor: Sequence[Any] | None = None,
    indexer: Sequence[Any] | None = None,
    **fields: Any,
) -> Any:
    """:func:`dsv4_attention` with the compressor's 8 and the indexer's 9 inputs grouped."""
    inputs = [q, kv, sinks, seq_starts, past_lens, slots, window_kv]
    inputs += list(compressor or ()) + list(indexer or ())
    return dsv4_attention(*inputs, **fields)


__all__ = [
    "CSA",
    "HCA",
    "SLIDING",
    "MAX_HEAD_DIM",
    "N_INPUTS",
    "STATE_INPUTS",
    "check_fields",
    "dsv4_attention",
    "dsv4_attention_parts",
    "library",
]
