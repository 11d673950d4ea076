"""ctypes bindings of the decode step's glue kernels (``plugins/kernels/decodeNormKernel.cu``,
``decodeGemvKernel.cu``, ``decodeMoeKernel.cu``, ``decodeMoeGroupedKernel.cu``; ``engramKernels.h``
states each contract):
what a DeepSeek-V4 layer does around its attention kernel and its MoE, in a few launches
instead of the dozens of small PyTorch kernels of its reference.

* :func:`norm_rope`: up to :data:`MAX_JOBS` row sets in one launch, each an optional RMSNorm
  (weighted with a float32 weight, or the per-head unweighted one) then an optional
  interleaved partial RoPE (or its inverse); rounded as the reference's ops round.
* :func:`gemv_segments`: up to :data:`MAX_SEGMENTS` bf16 products of a decode step's few
  rows (``<= GEMV_EX_MAX_TOKENS``) in one launch (each segment its own x, weight and out, with
  row strides: several projections of one input, or the groups of a grouped projection);
  with a :class:`GemvPrologue`, x first RMS-normalized (``q_a_norm`` before ``q_b``) or
  its heads rotated back (the inverse RoPE before ``o_a``) inside the product's launch,
  rounded as :func:`norm_rope` rounds (``engram_gemv_segments_bf16_ex``).
* :func:`moe_route`: a router's top-k / hash picks and weights from its logits.
* :func:`moe_experts`: the routed experts of a decode step plus the shared expert, bf16,
  in two launches, combined in the reference's order; :func:`moe_experts_grouped` the same
  outputs bit for bit for up to :data:`MOE_GROUPED_MAX_TOKENS` tokens (a batch of decode
  streams), the pairs grouped by expert so that each picked expert's weights are read once
  a step (``decodeMoeGroupedKernel.cu``, three launches).
* :func:`hc_mix`, :func:`gdn_gates`, :func:`gated_norm`: Qwen4Exp's hyper-connection mix
  and a Gated DeltaNet layer's gates and gated output norm, one launch each
  (``hcMixKernel.cu``, ``gdnGlueKernel.cu``).

The functions check dtypes, shapes and devices (an EngramError names the bad argument),
then the library checks the rest; work is enqueued on the current CUDA stream. They read
nothing back on the host, so a CUDA graph can record them.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Sequence

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

MAX_JOBS = 4  # ENGRAM_NORM_ROPE_MAX_JOBS
MAX_SEGMENTS = 8  # ENGRAM_GEMV_MAX_SEGMENTS
GEMV_MAX_TOKENS = 4  # ENGRAM_GEMV_MAX_TOKENS
GEMV_EX_MAX_TOKENS = 8  # ENGRAM_GEMV_EX_MAX_TOKENS: engram_gemv_segments_bf16_ex (gemv_segments above 4 rows)
PROLOGUE_NONE, PROLOGUE_RMSNORM, PROLOGUE_ROPE = 0, 1, 2  # ENGRAM_GEMV_PROLOGUE_*
MOE_MAX_EXPERTS = 1024  # ENGRAM_MOE_MAX_EXPERTS
MOE_MAX_TOP_K = 16  # ENGRAM_MOE_MAX_TOP_K
MOE_MAX_TOKENS = 16  # ENGRAM_MOE_DECODE_MAX_TOKENS
MOE_GROUPED_MAX_TOKENS = 64  # ENGRAM_MOE_GROUPED_MAX_TOKENS: moe_experts_grouped
HC_MIX_MAX_TOKENS = 16  # ENGRAM_HC_MIX_MAX_TOKENS
HC_MIX_MAX_ELEMENTS = 12288  # ENGRAM_HC_MIX_MAX_ELEMENTS: tokens x rank
GDN_GLUE_MAX_TOKENS = 16  # ENGRAM_GDN_GLUE_MAX_TOKENS: gdn_gates / gated_norm
GDN_GLUE_MAX_HEADS = 4096  # ENGRAM_GDN_GLUE_MAX_HEADS
GATE_ACTIVATIONS = {"silu": 0, "sigmoid": 1}  # ENGRAM_GATE_ACT_*
MIN_CAPABILITY = 9  # the GEMV and the experts' products are built for sm_90+ (as engram_gemv_bf16)
NORM_NONE, NORM_WEIGHTED, NORM_UNWEIGHTED = 0, 1, 2  # EngramNormKind
SCORE_FNS = {"sqrtsoftplus": 0, "sigmoid": 1, "softmax": 2, "softmax_topk": 3}  # EngramMoeScore
GEMV_WEIGHT_STATIC = 1


class _NormRopeJob(ctypes.Structure):
    _fields_ = [
        ("x", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("weight", ctypes.c_void_p),
        ("cos", ctypes.c_void_p),
        ("sin", ctypes.c_void_p),
        ("rows", ctypes.c_int64),
        ("x_stride", ctypes.c_int64),
        ("out_stride", ctypes.c_int64),
        ("cos_stride", ctypes.c_int64),
        ("weight_stride", ctypes.c_int64),
        ("dim", ctypes.c_int32),
        ("heads", ctypes.c_int32),
        ("norm", ctypes.c_int32),
        ("rope_pairs", ctypes.c_int32),
        ("rope_sign", ctypes.c_int32),
        ("eps", ctypes.c_float),
    ]


class _GemvSegment(ctypes.Structure):
    _fields_ = [
        ("x", ctypes.c_void_p),
        ("weight", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("x_stride", ctypes.c_int64),
        ("out_stride", ctypes.c_int64),
        ("out_features", ctypes.c_int32),
        ("in_features", ctypes.c_int32),
    ]


class _MoeExperts(ctypes.Structure):
    _fields_ = [
        ("x", ctypes.c_void_p),
        ("ids", ctypes.c_void_p),
        ("weights", ctypes.c_void_p),
        ("gate", ctypes.c_void_p),
        ("up", ctypes.c_void_p),
        ("down", ctypes.c_void_p),
        ("shared_gate", ctypes.c_void_p),
        ("shared_up", ctypes.c_void_p),
        ("shared_down", ctypes.c_void_p),
        ("workspace", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("num_tokens", ctypes.c_int64),
        ("workspace_bytes", ctypes.c_int64),
        ("hidden", ctypes.c_int32),
        ("top_k", ctypes.c_int32),
        ("num_experts", ctypes.c_int32),
        ("intermediate", ctypes.c_int32),
        ("shared_intermediate", ctypes.c_int32),
        ("clamp", ctypes.c_int32),
        ("limit", ctypes.c_float),
        ("reserved", ctypes.c_int32),
        ("shared_scale", ctypes.c_void_p),
        ("shared_scale_stride", ctypes.c_int64),
        ("down_expert_stride", ctypes.c_int64),
        ("down_row_stride", ctypes.c_int64),
    ]


class _GemvPrologue(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int32),
        ("dim", ctypes.c_int32),
        ("rope_pairs", ctypes.c_int32),
        ("rope_sign", ctypes.c_int32),
        ("eps", ctypes.c_float),
        ("reserved", ctypes.c_int32),
        ("weight", ctypes.c_void_p),
        ("cos", ctypes.c_void_p),
        ("sin", ctypes.c_void_p),
        ("cos_stride", ctypes.c_int64),
    ]


class _HcMix(ctypes.Structure):
    _fields_ = [
        ("down_out", ctypes.c_void_p),
        ("up", ctypes.c_void_p),
        ("normed", ctypes.c_void_p),
        ("inject_logits", ctypes.c_void_p),
        ("mixed", ctypes.c_void_p),
        ("inject", ctypes.c_void_p),
        ("num_tokens", ctypes.c_int64),
        ("down_out_stride", ctypes.c_int64),
        ("normed_stride", ctypes.c_int64),
        ("inject_stride", ctypes.c_int64),
        ("hidden", ctypes.c_int32),
        ("hc", ctypes.c_int32),
        ("rank", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
    ]


class _GdnGates(ctypes.Structure):
    _fields_ = [
        ("b", ctypes.c_void_p),
        ("a", ctypes.c_void_p),
        ("dt_bias", ctypes.c_void_p),
        ("neg_decay", ctypes.c_void_p),
        ("beta", ctypes.c_void_p),
        ("g", ctypes.c_void_p),
        ("num_tokens", ctypes.c_int64),
        ("b_stride", ctypes.c_int64),
        ("a_stride", ctypes.c_int64),
        ("heads", ctypes.c_int32),
        ("dt_bias_float", ctypes.c_int32),
    ]


class _GatedNorm(ctypes.Structure):
    _fields_ = [
        ("x", ctypes.c_void_p),
        ("gate", ctypes.c_void_p),
        ("weight", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("num_tokens", ctypes.c_int64),
        ("x_stride", ctypes.c_int64),
        ("gate_stride", ctypes.c_int64),
        ("heads", ctypes.c_int32),
        ("dim", ctypes.c_int32),
        ("activation", ctypes.c_int32),
        ("x_float", ctypes.c_int32),
        ("eps", ctypes.c_float),
        ("reserved", ctypes.c_int32),
    ]


_i32, _i64, _vp, _f32 = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
_ENTRY = EntryPoints(
    {
        "engram_norm_rope": [ctypes.POINTER(_NormRopeJob), _i32, _i32, _vp],
        "engram_gemv_segments_bf16": [ctypes.POINTER(_GemvSegment), _i32, _i64, ctypes.c_uint32, _vp],
        "engram_gemv_segments_bf16_ex": [
            ctypes.POINTER(_GemvSegment),
            _i32,
            _i64,
            ctypes.c_uint32,
            ctypes.POINTER(_GemvPrologue),
            _vp,
        ],
        "engram_moe_route": [_vp, _i32, _i64, _vp, _vp, _vp, _i64, _i64, _i32, _i32, _i32, _f32, _vp, _vp, _vp],
        "engram_moe_experts_workspace_size": [_i64, _i32, _i32, _i32, ctypes.POINTER(ctypes.c_size_t)],
        "engram_moe_experts_bf16": [ctypes.POINTER(_MoeExperts), _vp],
        "engram_moe_experts_grouped_workspace_size": [_i64, _i32, _i32, _i32, _i32, ctypes.POINTER(ctypes.c_size_t)],
        "engram_moe_experts_grouped_bf16": [ctypes.POINTER(_MoeExperts), _vp],
        "engram_hc_mix_bf16": [ctypes.POINTER(_HcMix), _vp],
        "engram_gdn_gates_bf16": [ctypes.POINTER(_GdnGates), _vp],
        "engram_gated_rms_norm_bf16": [ctypes.POINTER(_GatedNorm), _vp],
    }
)
library = _ENTRY.library
_call = _ENTRY.call


def unavailable(what: str = "decode glue CUDA kernels") -> str | None:
    """Why the library cannot serve these kernels (None: it can), asked once and logged once."""
    return _ENTRY.unavailable(what)


def glue_unavailable(x: Any, switch: str, what: str = "decode glue CUDA kernels") -> str | None:
    """Why a model family's fused decode glue does not take activations like ``x`` (None: it
    does): its A/B switch ``switch`` (an environment variable) set to ``0``, ``x`` not a
    bf16 CUDA tensor, a library without these kernels, a GPU below compute capability 9.0."""
    import os

    if os.environ.get(switch, "1") == "0":
        return f"{switch}=0"
    if not x.is_cuda:
        return f"the activations are on {x.device}, not a CUDA device"
    torch = torch_module()
    if x.dtype != torch.bfloat16:
        return f"the activations are {x.dtype}, not bfloat16"
    why = unavailable(what)
    if why is not None:
        return why
    if not gemv_capable(x.device):
        return "the GPU's compute capability is below 9.0"
    return None


def gemv_capable(device: Any) -> bool:
    """Whether the GEMV / experts kernels run on ``device`` (compute capability 9.0 or later)."""
    return capability_major(device.index) >= MIN_CAPABILITY


def _rows2d(name: str, t: Any, dtype: Any, width: int) -> tuple[int, int]:
    """``(rows, row stride)`` of a 2-D tensor whose rows hold at least ``width`` elements
    with unit stride inside a row (a slice of a wider buffer is fine)."""
    if t.dim() != 2 or t.shape[1] < width or (t.shape[0] > 1 and t.stride(0) < width):
        raise EngramError(f"{name} must be [tokens, >= {width}] (got shape {tuple(t.shape)})")
    if t.stride(1) != 1 and t.shape[1] > 1:
        raise EngramError(f"{name} must have unit stride inside a row (got strides {t.stride()})")
    if t.dtype != dtype:
        raise EngramError(f"{name} must have dtype {dtype} (got {t.dtype})")
    return int(t.shape[0]), int(t.stride(0)) if t.shape[0] > 1 else max(int(t.stride(0)), width)


def _on_device(device: Any, **tensors: Any) -> None:
    """Every tensor given (None skipped) on one CUDA device, ``device`` (checked after the
    dtypes and shapes: the house order)."""
    for name, t in tensors.items():
        if t is not None and not t.is_cuda:
            raise EngramError(f"{name} must be a CUDA tensor (got device {t.device})")
    same_device(device, **tensors)


@dataclass
class NormRopeJob:
    """One row set of :func:`norm_rope`: rows ``x [T, >= heads * dim]`` (a token's heads side
    by side) into ``out`` (same shape rules, may be ``x`` itself); ``norm`` NORM_NONE /
    NORM_WEIGHTED (``weight [dim]`` float32, or head h's at ``h * weight_stride``) /
    NORM_UNWEIGHTED; ``rope_pairs`` trailing pairs rotated by ``cos`` / ``sin [T, >= rope_pairs]``
    float32 (``rope_sign`` -1: the inverse rotation)."""

    x: Any
    out: Any
    dim: int
    heads: int = 1
    norm: int = NORM_NONE
    weight: Any = None
    eps: float = 0.0
    rope_pairs: int = 0
    cos: Any = None
    sin: Any = None
    rope_sign: int = 1
    weight_stride: int = 0  # elements between two heads' weights (0: one [dim] weight for every head)


def norm_rope(*jobs: NormRopeJob) -> None:
    """One launch of ``engram_norm_rope`` over ``jobs`` (engramKernels.h): all in one dtype
    (bf16 / fp16 / float32), on one CUDA device."""
    torch = torch_module()
    if not 1 <= len(jobs) <= MAX_JOBS:
        raise EngramError(f"norm_rope takes 1..{MAX_JOBS} jobs (got {len(jobs)})")
    dtype, device = jobs[0].x.dtype, jobs[0].x.device
    check_dtype("x", jobs[0].x, (torch.bfloat16, torch.float16, torch.float32))
    packed = (_NormRopeJob * len(jobs))()
    for i, j in enumerate(jobs):
        width = j.heads * j.dim
        rows, xs = _rows2d(f"jobs[{i}].x", j.x, dtype, width)
        out_rows, os_ = _rows2d(f"jobs[{i}].out", j.out, dtype, width)
        if out_rows != rows:
            raise EngramError(f"jobs[{i}].out has {out_rows} rows, x has {rows}")
        cs = 0
        if j.rope_pairs:
            c_rows, cs = _rows2d(f"jobs[{i}].cos", j.cos, torch.float32, j.rope_pairs)
            s_rows, ss = _rows2d(f"jobs[{i}].sin", j.sin, torch.float32, j.rope_pairs)
            if c_rows != rows or s_rows != rows or ss != cs:
                raise EngramError(
                    f"jobs[{i}].cos / sin must be [{rows}, >= {j.rope_pairs}] with one row stride "
                    f"(got {tuple(j.cos.shape)}, {tuple(j.sin.shape)})"
                )
        if j.weight is not None:
            check_dtype(f"jobs[{i}].weight", j.weight, (torch.float32,))
            need = j.dim + (j.heads - 1) * j.weight_stride
            if j.weight.dim() != 1 or j.weight.numel() < need or not j.weight.is_contiguous():
                raise EngramError(
                    f"jobs[{i}].weight must be a contiguous 1-D tensor of at least {need} values "
                    f"(dim {j.dim}, weight_stride {j.weight_stride}; got {tuple(j.weight.shape)})"
                )
        _on_device(
            device,
            **{
                f"jobs[{i}].x": j.x,
                f"jobs[{i}].out": j.out,
                f"jobs[{i}].weight": j.weight,
                f"jobs[{i}].cos": j.cos,
                f"jobs[{i}].sin": j.sin,
            },
        )
        packed[i] = _NormRopeJob(
            ptr(j.x),
            ptr(j.out),
            ptr(j.weight),
            ptr(j.cos),
            ptr(j.sin),
            rows * j.heads,
            xs,
            os_,
            cs,
            j.weight_stride,
            j.dim,
            j.heads,
            j.norm,
            j.rope_pairs,
            j.rope_sign,
            j.eps,
        )
    with device_guard(device.index):
        _call("engram_norm_rope", packed, len(jobs), float_code(dtype), stream_of(device))


def gemv_fits(x: Any, weight: Any) -> bool:
    """Whether :func:`gemv_segments` takes ``F.linear(x, weight)`` as it is: bf16, x ``[T, K]``
    with ``1 <= T <= GEMV_EX_MAX_TOKENS`` (unit stride in a row, rows 16-byte aligned), weight a
    contiguous 16-byte aligned ``[N, K]``, K a multiple of 8, one CUDA device of compute
    capability 9.0 or later."""
    torch = torch_module()
    return (
        isinstance(weight, torch.Tensor)
        and x.dim() == 2
        and weight.dim() == 2
        and 1 <= x.shape[0] <= GEMV_EX_MAX_TOKENS
        and x.shape[1] == weight.shape[1]
        and x.shape[1] % 8 == 0
        and x.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and x.is_cuda
        and weight.device == x.device
        and (x.stride(1) == 1)
        and (x.shape[0] == 1 or x.stride(0) % 8 == 0)
        and x.data_ptr() % 16 == 0
        and weight.is_contiguous()
        and weight.data_ptr() % 16 == 0
        and gemv_capable(x.device)
    )


@dataclass
class GemvPrologue:
    """What :func:`gemv_segments` does to every segment's x before the product (engramKernels.h
    EngramGemvPrologue): ``PROLOGUE_RMSNORM``: the weighted RMSNorm of each row (``weight
    [dim]`` float32, ``eps``; every segment's K must be ``dim``), :func:`norm_rope`'s
    NORM_WEIGHTED job; ``PROLOGUE_ROPE``: each head of ``dim`` channels (a segment's x starting
    at a head) rotated on its trailing ``rope_pairs`` pairs by ``cos`` / ``sin [T, >=
    rope_pairs]`` float32, ``rope_sign`` -1 the inverse, :func:`norm_rope`'s NORM_NONE job."""

    kind: int
    dim: int
    weight: Any = None
    eps: float = 0.0
    rope_pairs: int = 0
    cos: Any = None
    sin: Any = None
    rope_sign: int = 1


def _pack_prologue(pro: GemvPrologue, T: int) -> _GemvPrologue:
    torch = torch_module()
    cs = 0
    if pro.kind == PROLOGUE_RMSNORM:
        check_dtype("prologue.weight", pro.weight, (torch.float32,))
        if pro.weight.dim() != 1 or pro.weight.numel() != pro.dim or not pro.weight.is_contiguous():
            raise EngramError(f"prologue.weight must be a contiguous [{pro.dim}] (got {tuple(pro.weight.shape)})")
    elif pro.kind == PROLOGUE_ROPE and pro.rope_pairs:
        c_rows, cs = _rows2d("prologue.cos", pro.cos, torch.float32, pro.rope_pairs)
        s_rows, ss = _rows2d("prologue.sin", pro.sin, torch.float32, pro.rope_pairs)
        if c_rows != T or s_rows != T or ss != cs:
            raise EngramError(
                f"prologue.cos / sin must be [{T}, >= {pro.rope_pairs}] with one row stride "
                f"(got {tuple(pro.cos.shape)}, {tuple(pro.sin.shape)})"
            )
    elif pro.kind not in (PROLOGUE_NONE, PROLOGUE_ROPE):
        raise EngramError(f"prologue.kind {pro.kind} is not PROLOGUE_NONE, PROLOGUE_RMSNORM or PROLOGUE_ROPE")
    return _GemvPrologue(
        pro.kind, pro.dim, pro.rope_pairs, pro.rope_sign, pro.eps, 0, ptr(pro.weight), ptr(pro.cos), ptr(pro.sin), cs
    )


def gemv_segments(
    segments: Sequence[tuple[Any, Any, Any]], *, weight_static: bool = True, prologue: GemvPrologue | None = None
) -> None:
    """``out = F.linear(x, weight)`` for each ``(x [T, K], weight [N, K], out [T, N])`` of
    ``segments`` (bf16; x and out may be slices with a row stride), one launch. ``weight_static``:
    the weights are a model's (nothing on the stream writes them), so the kernel may start
    reading them before the kernel before it completes. ``prologue``: x taken through it
    first (:class:`GemvPrologue`). Up to 4 rows without a prologue: ``engram_gemv_segments_bf16``;
    otherwise (up to 8) ``engram_gemv_segments_bf16_ex``."""
    torch = torch_module()
    if not 1 <= len(segments) <= MAX_SEGMENTS:
        raise EngramError(f"gemv_segments takes 1..{MAX_SEGMENTS} segments (got {len(segments)})")
    T = int(segments[0][0].shape[0])
    device = segments[0][0].device
    packed = (_GemvSegment * len(segments))()
    for i, (x, w, out) in enumerate(segments):
        check_dtype(f"segments[{i}].weight", w, (torch.bfloat16,))
        if w.dim() != 2 or not w.is_contiguous():
            raise EngramError(f"segments[{i}].weight must be a contiguous [N, K] (got shape {tuple(w.shape)})")
        N, K = int(w.shape[0]), int(w.shape[1])
        rows, xs = _rows2d(f"segments[{i}].x", x, torch.bfloat16, K)
        out_rows, os_ = _rows2d(f"segments[{i}].out", out, torch.bfloat16, N)
        if rows != T or out_rows != T:
            raise EngramError(f"segments[{i}]: x and out must have {T} rows (got {rows}, {out_rows})")
        packed[i] = _GemvSegment(ptr(x), ptr(w), ptr(out), xs, os_, N, K)
    pro = None if prologue is None else _pack_prologue(prologue, T)  # dtypes and shapes before the devices
    for i, (x, w, out) in enumerate(segments):
        _on_device(device, **{f"segments[{i}].x": x, f"segments[{i}].weight": w, f"segments[{i}].out": out})
    if prologue is not None:
        _on_device(
            device, **{"prologue.weight": prologue.weight, "prologue.cos": prologue.cos, "prologue.sin": prologue.sin}
        )
    flags = GEMV_WEIGHT_STATIC if weight_static else 0
    if pro is None and T <= GEMV_MAX_TOKENS:
        with device_guard(device.index):
            _call("engram_gemv_segments_bf16", packed, len(segments), T, flags, stream_of(device))
        return
    pro = pro or _GemvPrologue(PROLOGUE_NONE, 0, 0, 1, 0.0, 0, None, None, None, 0)
    with device_guard(device.index):
        _call("engram_gemv_segments_bf16_ex", packed, len(segments), T, flags, ctypes.byref(pro), stream_of(device))


def moe_route(
    logits: Any,
    *,
    top_k: int,
    score_fn: str,
    scaling: float,
    bias: Any = None,
    tid2eid: Any = None,
    input_ids: Any = None,
) -> tuple[Any, Any]:
    """``(ids int32 [T, top_k], weights float32 [T, top_k])`` of a router's ``logits [T, E]``
    (bf16 / fp16 / float32, unit stride in a row): top-k by score + ``bias [E]`` (float32),
    or hash routing by ``tid2eid [vocab, top_k]`` int64 at ``input_ids [T]`` int64.
    ``score_fn``: DeepSeek-V4's ``sqrtsoftplus`` / ``sigmoid`` (the picks renormalized, then
    scaled), or the float32 softmax of Qwen's routers: ``softmax`` (the picks renormalized,
    ``norm_topk_prob``) or ``softmax_topk`` (the picked probabilities as they are)."""
    torch = torch_module()
    check_dtype("logits", logits, (torch.bfloat16, torch.float16, torch.float32))
    T, E = int(logits.shape[0]), int(logits.shape[1]) if logits.dim() == 2 else -1
    _rows, stride = _rows2d("logits", logits, logits.dtype, max(E, 1))
    if score_fn not in SCORE_FNS:
        raise EngramError(f"score_fn {score_fn!r} is not one of {sorted(SCORE_FNS)}")
    softmax = score_fn in ("softmax", "softmax_topk")
    if (bias is not None and tid2eid is not None) or (bias is None and tid2eid is None and not softmax):
        raise EngramError("give exactly one of bias (top-k routing) and tid2eid (hash routing)")
    vocab = 0  # neither bias nor tid2eid: a softmax router's top-k by the probabilities alone
    if bias is not None:
        check_dtype("bias", bias, (torch.float32,))
        if tuple(bias.shape) != (E,) or not bias.is_contiguous():
            raise EngramError(f"bias must be a contiguous [{E}] (got {tuple(bias.shape)})")
    elif tid2eid is not None:
        check_dtype("tid2eid", tid2eid, (torch.int64,))
        check_dtype("input_ids", input_ids, (torch.int64,))
        if (
            tid2eid.dim() != 2
            or int(tid2eid.shape[1]) != top_k
            or tuple(input_ids.shape) != (T,)
            or not tid2eid.is_contiguous()
            or not input_ids.is_contiguous()
        ):
            raise EngramError(
                f"tid2eid must be a contiguous [vocab, {top_k}] and input_ids [{T}] (got "
                f"{tuple(tid2eid.shape)}, {tuple(input_ids.shape)})"
            )
        vocab = int(tid2eid.shape[0])
    _on_device(logits.device, logits=logits, bias=bias, tid2eid=tid2eid, input_ids=input_ids)
    ids = torch.empty((T, top_k), dtype=torch.int32, device=logits.device)
    weights = torch.empty((T, top_k), dtype=torch.float32, device=logits.device)
    with device_guard(logits.device.index):
        _call(
            "engram_moe_route",
            ptr(logits),
            float_code(logits.dtype),
            stride,
            ptr(bias),
            ptr(tid2eid),
            ptr(input_ids),
            vocab,
            T,
            E,
            int(top_k),
            SCORE_FNS[score_fn],
            _f32(scaling),
            ptr(ids),
            ptr(weights),
            stream_of(logits.device),
        )
    return ids, weights


def experts_workspace_size(tokens: int, top_k: int, intermediate: int, shared_intermediate: int) -> int:
    out = ctypes.c_size_t(0)
    _call(
        "engram_moe_experts_workspace_size",
        int(tokens),
        int(top_k),
        int(intermediate),
        int(shared_intermediate),
        ctypes.byref(out),
    )
    return int(out.value)


def experts_grouped_workspace_size(
    tokens: int, top_k: int, hidden: int, intermediate: int, shared_intermediate: int
) -> int:
    out = ctypes.c_size_t(0)
    _call(
        "engram_moe_experts_grouped_workspace_size",
        int(tokens),
        int(top_k),
        int(hidden),
        int(intermediate),
        int(shared_intermediate),
        ctypes.byref(out),
    )
    return int(out.value)


def _moe_args(
    name: str,
    max_tokens: int,
    x: Any,
    ids: Any,
    weights: Any,
    gate: Any,
    up: Any,
    down: Any,
    shared: tuple[Any, Any, Any] | None,
    limit: float | None,
    shared_scale: Any,
) -> tuple[_MoeExperts, Any]:
    """The checked ``EngramMoeExperts`` of a :func:`moe_experts` / :func:`moe_experts_grouped`
    call (``name``, up to ``max_tokens`` tokens) with its workspace and ``out`` allocated:
    ``(args, out)``; the workspace stays alive in ``args``."""
    torch = torch_module()
    for arg, t in (("x", x), ("gate", gate), ("up", up), ("down", down)):
        check(arg, t, (torch.bfloat16,))
    check("ids", ids, (torch.int32,), 2)
    check("weights", weights, (torch.float32,), 2)
    if x.dim() != 2 or gate.dim() != 3:
        raise EngramError(f"x must be [T, D] and gate [E, I, D] (got {tuple(x.shape)}, {tuple(gate.shape)})")
    T, D = int(x.shape[0]), int(x.shape[1])
    if T > max_tokens:
        raise EngramError(f"{name} takes at most {max_tokens} tokens (x has {T} rows)")
    E, I = int(gate.shape[0]), int(gate.shape[1])
    k = int(ids.shape[1])
    side_by_side = down.dim() == 2 and tuple(down.shape) == (D, E * I)
    if tuple(up.shape) != (E, I, D) or (tuple(down.shape) != (E, D, I) and not side_by_side):
        raise EngramError(
            f"gate / up must be [E, I, D] and down [E, D, I] or [D, E * I] = {(E, I, D)}, {(E, D, I)} / "
            f"{(D, E * I)} (got {tuple(gate.shape)}, {tuple(up.shape)}, {tuple(down.shape)})"
        )
    if tuple(ids.shape) != (T, k) or tuple(weights.shape) != (T, k):
        raise EngramError(
            f"ids and weights must be [T, k] = [{T}, {k}] (got {tuple(ids.shape)}, {tuple(weights.shape)})"
        )
    Is = 0
    sg = su = sd = None
    if shared is not None:
        sg, su, sd = shared
        for arg, t in (("shared gate", sg), ("shared up", su), ("shared down", sd)):
            check(arg, t, (torch.bfloat16,), 2)
        Is = int(sg.shape[0])
        if tuple(sg.shape) != (Is, D) or tuple(su.shape) != (Is, D) or tuple(sd.shape) != (D, Is):
            raise EngramError(
                f"the shared expert must be gate / up [I_s, {D}] and down [{D}, I_s] (got "
                f"{tuple(sg.shape)}, {tuple(su.shape)}, {tuple(sd.shape)})"
            )
    scale_stride = 0
    if shared_scale is not None:
        if shared is None:
            raise EngramError("shared_scale scales the shared expert: give shared as well")
        check_dtype("shared_scale", shared_scale, (torch.bfloat16,))
        if not shared_scale.is_cuda:
            raise EngramError(f"shared_scale must be a CUDA tensor (got device {shared_scale.device})")
        if shared_scale.dim() != 2 or tuple(shared_scale.shape) != (T, 1):
            raise EngramError(f"shared_scale must be [{T}, 1] (got {tuple(shared_scale.shape)})")
        scale_stride = int(shared_scale.stride(0))
    same_device(
        x.device, ids=ids, weights=weights, gate=gate, up=up, down=down, sg=sg, su=su, sd=sd, shared_scale=shared_scale
    )
    if max_tokens == MOE_MAX_TOKENS:
        need = experts_workspace_size(T, k, I, Is)
    else:
        need = experts_grouped_workspace_size(T, k, D, I, Is)
    workspace = torch.empty(max(need // 2, 8), dtype=torch.bfloat16, device=x.device)
    out = torch.empty((T, D), dtype=torch.bfloat16, device=x.device)
    args = _MoeExperts(
        ptr(x),
        ptr(ids),
        ptr(weights),
        ptr(gate),
        ptr(up),
        ptr(down),
        ptr(sg),
        ptr(su),
        ptr(sd),
        ptr(workspace),
        ptr(out),
        T,
        workspace.numel() * 2,
        D,
        k,
        E,
        I,
        Is,
        0 if limit is None else 1,
        0.0 if limit is None else float(limit),
        0,
        ptr(shared_scale),
        scale_stride,
        I if side_by_side else 0,
        E * I if side_by_side else 0,
    )
    args._workspace = workspace  # type: ignore[attr-defined]  # alive until the call is enqueued
    return args, out


def moe_experts(
    x: Any,
    ids: Any,
    weights: Any,
    gate: Any,
    up: Any,
    down: Any,
    *,
    shared: tuple[Any, Any, Any] | None,
    limit: float | None,
    shared_scale: Any = None,
) -> Any:
    """A decode step's MoE output ``[T, D]`` bf16 (engram_moe_experts_bf16, ``T <=``
    :data:`MOE_MAX_TOKENS`): ``x [T, D]``, ``ids`` int32 / ``weights`` float32 ``[T, k]``
    (:func:`moe_route`), the routed stacks ``gate`` / ``up [E, I, D]``, ``down [E, D, I]``
    (or ``[D, E * I]``: the experts side by side, Qwen4Exp's stack) and ``shared = (gate
    [I_s, D], up, down [D, I_s])`` (or None), all bf16 and contiguous; ``limit`` the SwiGLU
    clamp (None: none); ``shared_scale [T, 1]`` bf16: the shared expert's gate logits (its
    output times their sigmoid; None: unscaled)."""
    args, out = _moe_args("moe_experts", MOE_MAX_TOKENS, x, ids, weights, gate, up, down, shared, limit, shared_scale)
    with device_guard(x.device.index):
        _call("engram_moe_experts_bf16", ctypes.byref(args), stream_of(x.device))
    return out


def moe_experts_grouped(
    x: Any,
    ids: Any,
    weights: Any,
    gate: Any,
    up: Any,
    down: Any,
    *,
    shared: tuple[Any, Any, Any] | None,
    limit: float | None,
    shared_scale: Any = None,
) -> Any:
    """:func:`moe_experts` for up to :data:`MOE_GROUPED_MAX_TOKENS` tokens (a batch of decode
    streams; engram_moe_experts_grouped_bf16): the same arguments and the same outputs bit for
    bit (each token's as :func:`moe_experts` gives it), the (token, pick) pairs grouped by
    expert on the device so that each picked expert's weights, and the shared expert's, are
    read once a step; three launches, no host synchronization."""
    args, out = _moe_args(
        "moe_experts_grouped", MOE_GROUPED_MAX_TOKENS, x, ids, weights, gate, up, down, shared, limit, shared_scale
    )
    with device_guard(x.device.index):
        _call("engram_moe_experts_grouped_bf16", ctypes.byref(args), stream_of(x.device))
    return out


def hc_mix(down_out: Any, up: Any, normed: Any, inject_logits: Any, *, hc: int) -> tuple[Any, Any]:
    """``(mixed [T, D], inject [T, hc] or None)`` bf16 (engram_hc_mix_bf16): the end of a
    Qwen4Exp hyper-connection's mix from its normed streams ``normed [T, hc * D]``, their
    low-rank product ``down_out [T, rank]`` and the gate's up weight ``up [hc * D, rank]``;
    ``inject_logits [T, hc]`` (the block-inject product, or None) give the injection weights."""
    torch = torch_module()
    check_dtype("up", up, (torch.bfloat16,))
    if up.dim() != 2 or not up.is_contiguous():
        raise EngramError(f"up must be a contiguous [hc * hidden, rank] (got shape {tuple(up.shape)})")
    width, rank = int(up.shape[0]), int(up.shape[1])
    if hc < 1 or width % hc:
        raise EngramError(f"up's {width} rows are not hc = {hc} streams of one width")
    T, ds = _rows2d("down_out", down_out, torch.bfloat16, rank)
    rows, ns = _rows2d("normed", normed, torch.bfloat16, width)
    inject = None
    inj_stride = 0
    if inject_logits is not None:
        lrows, inj_stride = _rows2d("inject_logits", inject_logits, torch.bfloat16, hc)
        if lrows != T:
            raise EngramError(f"inject_logits must have {T} rows (got {lrows})")
        inject = torch.empty((T, hc), dtype=torch.bfloat16, device=up.device)
    if rows != T:
        raise EngramError(f"normed must have {T} rows like down_out (got {rows})")
    _on_device(up.device, up=up, down_out=down_out, normed=normed, inject_logits=inject_logits)
    mixed = torch.empty((T, width // hc), dtype=torch.bfloat16, device=up.device)
    args = _HcMix(
        ptr(down_out),
        ptr(up),
        ptr(normed),
        ptr(inject_logits),
        ptr(mixed),
        ptr(inject),
        T,
        ds,
        ns,
        inj_stride,
        width // hc,
        int(hc),
        rank,
        0,
    )
    with device_guard(up.device.index):
        _call("engram_hc_mix_bf16", ctypes.byref(args), stream_of(up.device))
    return mixed, inject


def _glue_rows(name: str, t: Any, dtypes: tuple, width: int) -> tuple[int, int]:
    """``(rows, row stride)`` of a decode step's ``[T, >= width]`` operand of the Gated
    DeltaNet glue: 1 to ``GDN_GLUE_MAX_TOKENS`` rows, unit stride inside a row."""
    check_dtype(name, t, dtypes)
    if t.dim() != 2 or t.shape[1] < width or (t.shape[0] > 1 and t.stride(0) < width):
        raise EngramError(f"{name} must be [tokens, >= {width}] (got shape {tuple(t.shape)})")
    if t.stride(1) != 1 and t.shape[1] > 1:
        raise EngramError(f"{name} must have unit stride inside a row (got strides {t.stride()})")
    rows = int(t.shape[0])
    if not 1 <= rows <= GDN_GLUE_MAX_TOKENS:
        raise EngramError(f"{name} must have 1 to {GDN_GLUE_MAX_TOKENS} rows, a decode step (got {rows})")
    return rows, int(t.stride(0)) if rows > 1 else max(int(t.stride(0)), width)


def gdn_gates(b: Any, a: Any, dt_bias: Any, neg_decay: Any) -> tuple[Any, Any]:
    """``(beta, g)`` float32 ``[T, H]`` (engram_gdn_gates_bf16): a Gated DeltaNet decode
    step's gates from its bf16 projections ``b`` and ``a`` ``[T, H]`` (rows may be strided),
    ``dt_bias [H]`` (bf16 or float32) and ``neg_decay [H]`` float32 (``-exp(A_log)``):
    ``beta = sigmoid(b).float()``, ``g = neg_decay * softplus(a.float() + dt_bias.float())``
    with torch's roundings (decodeKernels.h)."""
    torch = torch_module()
    check("neg_decay", neg_decay, (torch.float32,), 1, where="any")
    H = int(neg_decay.shape[0])
    if not 1 <= H <= GDN_GLUE_MAX_HEADS:
        raise EngramError(f"neg_decay must have 1 to {GDN_GLUE_MAX_HEADS} heads (got {H})")
    check("dt_bias", dt_bias, (torch.bfloat16, torch.float32), 1, where="any")
    if int(dt_bias.shape[0]) != H:
        raise EngramError(f"dt_bias must be [{H}] like neg_decay (got {tuple(dt_bias.shape)})")
    T, bs = _glue_rows("b", b, (torch.bfloat16,), H)
    rows, as_ = _glue_rows("a", a, (torch.bfloat16,), H)
    if rows != T:
        raise EngramError(f"a must have {T} rows like b (got {rows})")
    _on_device(b.device, b=b, a=a, dt_bias=dt_bias, neg_decay=neg_decay)
    beta = torch.empty((T, H), dtype=torch.float32, device=b.device)
    g = torch.empty((T, H), dtype=torch.float32, device=b.device)
    args = _GdnGates(
        ptr(b),
        ptr(a),
        ptr(dt_bias),
        ptr(neg_decay),
        ptr(beta),
        ptr(g),
        T,
        bs,
        as_,
        H,
        int(dt_bias.dtype == torch.float32),
    )
    with device_guard(b.device.index):
        _call("engram_gdn_gates_bf16", ctypes.byref(args), stream_of(b.device))
    return beta, g


def gated_norm(x: Any, gate: Any, weight: Any, *, heads: int, eps: float, activation: str) -> Any:
    """bf16 ``[T, heads * dim]`` (engram_gated_rms_norm_bf16): a Gated DeltaNet decode step's
    output norm (``GatedRMSNorm.forward`` on ``x.to(bf16)`` and ``gate`` viewed as ``[T *
    heads, dim]``) from ``x [T, heads * dim]`` (bf16 or float32), ``gate`` bf16 ``[T, heads *
    dim]`` (rows of both may be strided), ``weight`` bf16 ``[dim]``; ``activation`` "silu" or
    "sigmoid" (the gate's)."""
    torch = torch_module()
    if activation not in GATE_ACTIVATIONS:
        raise EngramError(f"activation must be one of {sorted(GATE_ACTIVATIONS)} (got {activation!r})")
    check("weight", weight, (torch.bfloat16,), 1, where="any")
    dim = int(weight.shape[0])
    if not 1 <= heads <= GDN_GLUE_MAX_HEADS:
        raise EngramError(f"heads must be in [1, {GDN_GLUE_MAX_HEADS}] (got {heads})")
    width = heads * dim
    T, xs = _glue_rows("x", x, (torch.bfloat16, torch.float32), width)
    rows, gs = _glue_rows("gate", gate, (torch.bfloat16,), width)
    if rows != T:
        raise EngramError(f"gate must have {T} rows like x (got {rows})")
    _on_device(weight.device, x=x, gate=gate, weight=weight)
    out = torch.empty((T, width), dtype=torch.bfloat16, device=weight.device)
    args = _GatedNorm(
        ptr(x),
        ptr(gate),
        ptr(weight),
        ptr(out),
        T,
        xs,
        gs,
        int(heads),
        dim,
        GATE_ACTIVATIONS[activation],
        int(x.dtype == torch.float32),
        float(eps),
        0,
    )
    with device_guard(weight.device.index):
        _call("engram_gated_rms_norm_bf16", ctypes.byref(args), stream_of(weight.device))
    return out


__all__ = [
    "GATE_ACTIVATIONS",
    "GDN_GLUE_MAX_HEADS",
    "GDN_GLUE_MAX_TOKENS",
    "GEMV_EX_MAX_TOKENS",
    "GEMV_MAX_TOKENS",
    "GemvPrologue",
    "MAX_JOBS",
    "PROLOGUE_NONE",
    "PROLOGUE_RMSNORM",
    "PROLOGUE_ROPE",
    "MAX_SEGMENTS",
    "MOE_GROUPED_MAX_TOKENS",
    "NORM_NONE",
    "NORM_UNWEIGHTED",
    "NORM_WEIGHTED",
    "NormRopeJob",
    "SCORE_FNS",
    "gemv_fits",
    "gated_norm",
    "gdn_gates",
    "gemv_segments",
    "hc_mix",
    "moe_experts",
    "moe_experts_grouped",
    "moe_route",
    "norm_rope",
    "unavailable",
]
