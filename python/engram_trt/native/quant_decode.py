"""ctypes bindings of a decode step's stored-format kernels (``plugins/kernels/quantDecodeKernel.cu``;
``quantKernels.h`` states each contract): what the DeepSeek-V4 fused decode glue
(:mod:`engram_trt.models.deepseek_v4.fused`) runs for FP8 / FP4 weights.

* :func:`gemv_segments`: up to :data:`MAX_SEGMENTS` products of the step's 1-8 rows in ONE
  launch, each weight FP8 / FP4 (a ``QuantWeight``) or bf16 (a ``[N, K]`` tensor), the
  activations quantized per the weight's kind exactly as ``quant.formats.act_quant``
  (:data:`engram_trt.native.quant.ACT_QUANT`: fp8 per 128 columns with float32 scales, fp4
  per 32 with ue8m0; bf16 as given): what :func:`engram_trt.native.quant.linear` computes
  for each, in one launch instead of one each; with a ``prologue``
  (:class:`engram_trt.native.decode.GemvPrologue`, the bf16 GEMV's) each x first
  RMS-normalized (``q_a_norm`` before ``q_b``) or its heads rotated back (the inverse RoPE
  before ``o_a``) inside the launch, the bits of :func:`engram_trt.native.decode.norm_rope`
  into a bf16 buffer then the product (``engram_quant_gemv_segments_ex``).
* :func:`moe`: the routed experts (stacks ``[E, I, D]`` / ``[E, D, I]``) and the shared
  expert in two launches: :func:`engram_trt.native.quant.experts` followed by the shared
  expert's products and clamped SwiGLU in the module's dtype, rounded where they round.

Shapes, dtypes and devices are checked here (an EngramError names the argument), the
library checks the rest. Nothing is read back on the host: a CUDA graph can record them.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from typing import Any

from engram_trt.errors import EngramError
from engram_trt.native import decode
from engram_trt.native import quant_kernels as qk
from engram_trt.native.library import (
    EntryPoints,
    check,
    device_guard,
    float_code,
    ptr,
    stream_of,
    torch_module,
)

MAX_SEGMENTS = 8  # ENGRAM_QSEG_MAX_SEGMENTS
MAX_TOKENS = 8  # ENGRAM_QSEG_MAX_TOKENS
MOE_MAX_TOP_K = 16
MIN_CAPABILITY = 9  # the fused decode glue's GPUs (sm_90+)
# the most shared memory the bindings let a block's staged activations take (every sm_90 GPU
# gives a block 227 KiB; the kernels refuse more than the GPU gives)
STAGED_MAX_BYTES = 160 * 1024
NORM_PROLOGUE_MAX_DIM = 2048  # the RMSNorm prologue's rows: norm_rope's register form (its sum order)
ACT_QUANT = {"fp8": (128, False), "fp4": (32, True)}  # = native.quant.ACT_QUANT (tests tie them)

_i32, _i64, _vp = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p


class _Segment(ctypes.Structure):
    _fields_ = [
        ("x", _vp),
        ("w", _vp),
        ("w_scale", _vp),
        ("out", _vp),
        ("x_stride", _i64),
        ("out_stride", _i64),
        ("x_type", _i32),
        ("out_type", _i32),
        ("w_type", _i32),
        ("scale_type", _i32),
        ("bn", _i32),
        ("bk", _i32),
        ("out_features", _i32),
        ("in_features", _i32),
        ("act_group", _i32),
        ("act_ue8m0", _i32),
    ]


class _MoeWeight(ctypes.Structure):
    _fields_ = [
        ("w", _vp),
        ("scale", _vp),
        ("w_type", _i32),
        ("scale_type", _i32),
        ("bn", _i32),
        ("bk", _i32),
        ("act_group", _i32),
        ("act_ue8m0", _i32),
    ]


class _Moe(ctypes.Structure):
    _fields_ = [
        ("x", _vp),
        ("ids", _vp),
        ("route_w", _vp),
        ("gate", _MoeWeight),
        ("up", _MoeWeight),
        ("down", _MoeWeight),
        ("shared_gate", _MoeWeight),
        ("shared_up", _MoeWeight),
        ("shared_down", _MoeWeight),
        ("workspace", _vp),
        ("out", _vp),
        ("num_tokens", _i64),
        ("workspace_bytes", _i64),
        ("hidden", _i32),
        ("top_k", _i32),
        ("num_experts", _i32),
        ("intermediate", _i32),
        ("shared_intermediate", _i32),
        ("clamp", _i32),
        ("limit", ctypes.c_float),
        ("reserved", _i32),
    ]


SIGNATURES: dict[str, list[Any]] = {
    "engram_quant_gemv_segments": [_vp, _i32, _i64, ctypes.c_uint32, _vp],
    "engram_quant_gemv_segments_ex": [_vp, _i32, _i64, ctypes.c_uint32, _vp, _vp],
    "engram_quant_moe_workspace_size": [_i64, _i32, _i32, _i32, _vp],
    "engram_quant_moe": [_vp, _vp],
}
STRUCTS = {"EngramQuantSegment": _Segment, "EngramQuantMoeWeight": _MoeWeight, "EngramQuantMoe": _Moe}
_ENTRY = EntryPoints(SIGNATURES)
library = _ENTRY.library
_call = _ENTRY.call


def unavailable(what: str = "stored-format decode kernels") -> str | None:
    """Why the library cannot serve these kernels (None: it can), asked once and logged once."""
    return _ENTRY.unavailable(what)


def _as_weight(name: str, w: Any, stacked: bool) -> qk.Weight:
    """A QuantWeight (fields data / scale / kind / block) or a bf16 tensor as the kernels take it."""
    torch = torch_module()
    if isinstance(w, torch.Tensor):
        if w.dtype != torch.bfloat16:
            raise EngramError(f"{name} is a {w.dtype} tensor; the kernels take bfloat16 tensors or QuantWeights")
        return qk.make_weight(name, w, None, "bf16", (1, 1), stacked)
    for field in ("data", "scale", "kind", "block"):
        if not hasattr(w, field):
            raise EngramError(f"{name} must be a QuantWeight or a bfloat16 tensor (got {type(w).__name__})")
    return qk.make_weight(name, w.data, w.scale, w.kind, tuple(w.block), stacked)


def _staged_bytes(K: int, kind: str, rows: int) -> int:
    vpv = qk.VALUES_PER_VECTOR[kind]
    return -(-(K // vpv) // 32) * 32 * vpv * 4 * rows


def _weight_reason(name: str, w: qk.Weight, device: Any) -> str | None:
    vpv = qk.VALUES_PER_VECTOR[w.kind]
    if w.in_features % vpv:
        return f"{name}'s in_features {w.in_features} is not a multiple of {vpv} ({w.kind} 16-byte vectors)"
    if w.kind != "bf16" and w.block[1] % vpv:
        return f"{name}'s block {list(w.block)}: bk must be a multiple of {vpv}"
    for what, t in ((f"{name} data", w.data), (f"{name} scale", w.scale)):
        if t is None:
            continue
        if t.device != device:
            return f"{what} is on {t.device}, not {device}"
        if not t.is_contiguous():
            return f"{what} is not contiguous"
    if w.data.data_ptr() % 16:
        return f"{name} data is not 16-byte aligned"
    return None


def _x_reason(x: Any, max_tokens: int = MAX_TOKENS) -> str | None:
    torch = torch_module()
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        return "x must be a 2-D tensor"
    if x.dtype != torch.bfloat16 or not x.is_cuda:
        return f"x must be a bfloat16 CUDA tensor (got {x.dtype} on {x.device})"
    if not 1 <= x.shape[0] <= max_tokens:
        return f"x has {x.shape[0]} rows; these kernels take 1..{max_tokens}"
    if x.stride(1) != 1 or (x.shape[0] > 1 and x.stride(0) % 8) or x.data_ptr() % 16:
        return "x's rows must be unit-stride and 16-byte aligned"
    from engram_trt.native.library import capability_major

    if capability_major(x.device.index) < MIN_CAPABILITY:
        return "the GPU's compute capability is below 9.0"
    return unavailable()


def segment_reason(x: Any, weight: Any) -> str | None:
    """Why :func:`gemv_segments` cannot take ``x [T, K] @ weight^T`` as it is (None: it can)."""
    why = _x_reason(x)
    if why is not None:
        return why
    try:
        w = _as_weight("weight", weight, False)
    except EngramError as exc:
        return str(exc)
    if w.in_features != int(x.shape[1]):
        return f"x has {x.shape[1]} features, the weight takes {w.in_features}"
    if _staged_bytes(w.in_features, w.kind, int(x.shape[0])) > STAGED_MAX_BYTES:
        return f"{x.shape[0]} rows of {w.in_features} staged floats exceed {STAGED_MAX_BYTES} bytes"
    return _weight_reason("weight", w, x.device)


def _rows(name: str, t: Any, dtype: Any, width: int) -> tuple[int, int]:
    if t.dim() != 2 or t.shape[1] < width or t.stride(1) != 1:
        raise EngramError(
            f"{name} must be [tokens, >= {width}] with unit stride in a row (got shape "
            f"{tuple(t.shape)}, strides {t.stride()})"
        )
    if t.dtype != dtype:
        raise EngramError(f"{name} must have dtype {dtype} (got {t.dtype})")
    return int(t.shape[0]), int(t.stride(0)) if t.shape[0] > 1 else max(int(t.stride(0)), width)


def _prologue_fields(pro: decode.GemvPrologue, widths: list[int]) -> None:
    """The scalar fields of ``pro`` against the segments' widths, as the library checks them."""
    if pro.kind == decode.PROLOGUE_RMSNORM:
        if not (math.isfinite(pro.eps) and pro.eps >= 0):
            raise EngramError(f"prologue.eps must be finite and >= 0 (got {pro.eps})")
        if pro.dim < 2 or pro.dim % 2 or pro.dim > NORM_PROLOGUE_MAX_DIM:
            raise EngramError(
                f"prologue.dim must be even and in [2, {NORM_PROLOGUE_MAX_DIM}] for the RMSNorm prologue "
                f"(got {pro.dim})"
            )
        bad = [i for i, k in enumerate(widths) if k != pro.dim]
        if bad:
            raise EngramError(
                f"segments[{bad[0]}].x has {widths[bad[0]]} features; the RMSNorm prologue normalizes whole rows of "
                f"prologue.dim {pro.dim}"
            )
    elif pro.kind == decode.PROLOGUE_ROPE:
        if pro.dim < 8 or pro.dim % 8 or not 0 <= 2 * pro.rope_pairs <= pro.dim or pro.rope_sign not in (1, -1):
            raise EngramError(
                f"the RoPE prologue needs prologue.dim a positive multiple of 8, 0 <= 2 * rope_pairs <= dim and "
                f"rope_sign +-1 (got dim {pro.dim}, rope_pairs {pro.rope_pairs}, rope_sign {pro.rope_sign})"
            )
        if pro.rope_pairs and (pro.cos is None or pro.sin is None):
            raise EngramError("prologue.cos and prologue.sin must be given for a RoPE prologue with rope_pairs > 0")
        bad = [i for i, k in enumerate(widths) if k % pro.dim]
        if bad:
            raise EngramError(
                f"segments[{bad[0]}].x has {widths[bad[0]]} features; the RoPE prologue rotates whole heads of "
                f"prologue.dim {pro.dim}"
            )


def _pack_prologue(pro: decode.GemvPrologue, widths: list[int], T: int) -> Any:
    """``pro`` as the library takes it (decode's ctypes structure), checked first: its kind,
    its fields against the segments' widths, then its tensors' dtypes, shapes and alignment."""
    if pro.kind == decode.PROLOGUE_RMSNORM and pro.weight is None:
        raise EngramError("prologue.weight must be given for the RMSNorm prologue (float32 [dim])")
    if pro.kind not in (decode.PROLOGUE_RMSNORM, decode.PROLOGUE_ROPE, decode.PROLOGUE_NONE):
        raise EngramError(f"prologue.kind {pro.kind} is not PROLOGUE_NONE, PROLOGUE_RMSNORM or PROLOGUE_ROPE")
    _prologue_fields(pro, widths)
    packed = decode._pack_prologue(pro, T)
    if pro.kind == decode.PROLOGUE_RMSNORM and pro.weight.data_ptr() % 16:
        raise EngramError("prologue.weight must be 16-byte aligned")
    return packed


def gemv_segments(
    segments: Sequence[tuple[Any, Any, Any]],
    *,
    weight_static: bool = True,
    prologue: decode.GemvPrologue | None = None,
) -> None:
    """``out = x @ W^T`` for each ``(x [T, K] bf16, weight, out [T, N] bf16)`` of ``segments``
    (weight a ``QuantWeight`` [N, K] or a bf16 ``[N, K]`` tensor; x and out may be slices with
    a row stride), in one launch; the activations quantized per the weight's kind.
    ``weight_static``: the weights are a model's (loaded before the wait for the kernel before).
    ``prologue``: each x taken through it first (:class:`engram_trt.native.decode.GemvPrologue`:
    the RMSNorm of every segment's whole row, each segment ``prologue.dim`` wide; or the
    RoPE of heads of ``prologue.dim`` channels, each segment's x starting at a head), as
    :func:`engram_trt.native.decode.norm_rope` would have written it to a bf16 buffer."""
    torch = torch_module()
    if not 1 <= len(segments) <= MAX_SEGMENTS:
        raise EngramError(f"gemv_segments takes 1..{MAX_SEGMENTS} segments (got {len(segments)})")
    T = int(segments[0][0].shape[0]) if segments[0][0].dim() == 2 else -1
    if not 1 <= T <= MAX_TOKENS:
        raise EngramError(
            f"segments[0].x must be [T, K] with 1 <= T <= {MAX_TOKENS} (got shape {tuple(segments[0][0].shape)})"
        )
    device = segments[0][0].device
    packed = (_Segment * len(segments))()
    checked = []
    for i, (x, weight, out) in enumerate(segments):  # dtypes and shapes of every segment first
        w = _as_weight(f"segments[{i}].weight", weight, False)
        rows, xs = _rows(f"segments[{i}].x", x, torch.bfloat16, w.in_features)
        out_rows, os_ = _rows(f"segments[{i}].out", out, torch.bfloat16, w.out_features)
        if rows != T or out_rows != T:
            raise EngramError(f"segments[{i}]: x and out must have {T} rows (got {rows}, {out_rows})")
        if int(x.shape[1]) != w.in_features:
            raise EngramError(f"segments[{i}].x has {x.shape[1]} features, the weight takes {w.in_features}")
        checked.append((w, xs, os_))
    pro = None if prologue is None else _pack_prologue(prologue, [w.in_features for w, _xs, _os in checked], T)
    for i, ((x, _weight, out), (w, xs, os_)) in enumerate(zip(segments, checked)):  # then devices
        for name, t in ((f"segments[{i}].x", x), (f"segments[{i}].out", out)):
            if not t.is_cuda:
                raise EngramError(f"{name} must be a CUDA tensor (got device {t.device})")
            if t.device != device:
                raise EngramError(f"{name} is on {t.device}, not {device}")
        why = _weight_reason(f"segments[{i}].weight", w, device)
        if why is not None:
            raise EngramError(why)
        group, ue8m0 = ACT_QUANT.get(w.kind, (0, False))
        packed[i] = _Segment(
            ptr(x),
            ptr(w.data),
            ptr(w.scale),
            ptr(out),
            xs,
            os_,
            float_code(x.dtype),
            float_code(out.dtype),
            w.w_type,
            w.scale_type,
            w.block[0],
            w.block[1],
            w.out_features,
            w.in_features,
            group,
            int(ue8m0),
        )
    flags = qk.QGEMV_WEIGHT_STATIC if weight_static else 0
    if prologue is None:
        with device_guard(device.index):
            _call("engram_quant_gemv_segments", ctypes.addressof(packed), len(segments), T, flags, stream_of(device))
        return
    decode._on_device(
        device, **{"prologue.weight": prologue.weight, "prologue.cos": prologue.cos, "prologue.sin": prologue.sin}
    )
    with device_guard(device.index):
        _call(
            "engram_quant_gemv_segments_ex",
            ctypes.addressof(packed),
            len(segments),
            T,
            flags,
            ctypes.addressof(pro),
            stream_of(device),
        )


def _moe_weight(w: qk.Weight) -> _MoeWeight:
    group, ue8m0 = ACT_QUANT.get(w.kind, (0, False))
    return _MoeWeight(ptr(w.data), ptr(w.scale), w.w_type, w.scale_type, w.block[0], w.block[1], group, int(ue8m0))


def _moe_weights(
    gate: Any, up: Any, down: Any, shared: tuple[Any, Any, Any] | None
) -> tuple[list[qk.Weight], list[qk.Weight] | None]:
    routed = [_as_weight("gate", gate, True), _as_weight("up", up, True), _as_weight("down", down, True)]
    g, u, d = routed
    if (g.kind, g.block, g.scale_type) != (u.kind, u.block, u.scale_type):
        raise EngramError(
            f"gate and up must share a kind, block and scale format (got {g.kind} {list(g.block)}, "
            f"{u.kind} {list(u.block)})"
        )
    E, I, D = g.experts, g.out_features, g.in_features
    if (u.experts, u.out_features, u.in_features) != (E, I, D) or (d.experts, d.out_features, d.in_features) != (
        E,
        D,
        I,
    ):
        raise EngramError(
            f"gate / up must be [E, I, D] and down [E, D, I] = {[E, I, D]}, {[E, D, I]} (got up "
            f"{[u.experts, u.out_features, u.in_features]}, down "
            f"{[d.experts, d.out_features, d.in_features]})"
        )
    if shared is None:
        return routed, None
    sw = [
        _as_weight("shared gate", shared[0], False),
        _as_weight("shared up", shared[1], False),
        _as_weight("shared down", shared[2], False),
    ]
    sg, su, sd = sw
    Is = sg.out_features
    if (sg.kind, sg.block, sg.scale_type) != (su.kind, su.block, su.scale_type):
        raise EngramError("shared gate and shared up must share a kind, block and scale format")
    if (sg.in_features, su.out_features, su.in_features, sd.out_features, sd.in_features) != (D, Is, D, D, Is):
        raise EngramError(
            f"the shared expert must be gate / up [I_s, {D}] and down [{D}, I_s] (got "
            f"{[sg.out_features, sg.in_features]}, {[su.out_features, su.in_features]}, "
            f"{[sd.out_features, sd.in_features]})"
        )
    return routed, sw


def moe_reason(x: Any, top_k: int, gate: Any, up: Any, down: Any, shared: tuple[Any, Any, Any] | None) -> str | None:
    """Why :func:`moe` cannot take this step (None: it can)."""
    why = _x_reason(x)
    if why is not None:
        return why
    if not 1 <= top_k <= MOE_MAX_TOP_K:
        return f"top_k {top_k} is outside 1..{MOE_MAX_TOP_K}"
    try:
        routed, sw = _moe_weights(gate, up, down, shared)
    except EngramError as exc:
        return str(exc)
    g, _u, d = routed
    if g.in_features != int(x.shape[1]):
        return f"x has {x.shape[1]} features, the experts take {g.in_features}"
    if g.experts > qk.PLAN_MAX_EXPERTS:
        return f"{g.experts} experts (at most {qk.PLAN_MAX_EXPERTS})"
    for i, w in enumerate(routed + (sw or [])):
        why = _weight_reason(("gate", "up", "down", "shared gate", "shared up", "shared down")[i], w, x.device)
        if why is not None:
            return why
    T = int(x.shape[0])
    first = max(_staged_bytes(g.in_features, g.kind, 1), _staged_bytes(g.in_features, sw[0].kind, T) if sw else 0)
    second = top_k * _staged_bytes(d.in_features, d.kind, 1) + (
        _staged_bytes(sw[2].in_features, sw[2].kind, 1) if sw else 0
    )
    if max(first, second) > STAGED_MAX_BYTES:
        return f"the staged activations take {max(first, second)} bytes (at most {STAGED_MAX_BYTES})"
    return None


def moe(
    x: Any,
    ids: Any,
    route_w: Any,
    gate: Any,
    up: Any,
    down: Any,
    *,
    shared: tuple[Any, Any, Any] | None,
    limit: float | None,
) -> Any:
    """A decode step's MoE output ``[T, D]`` bf16 (engram_quant_moe): ``x [T, D]`` bf16,
    ``ids`` int32 / ``route_w`` float32 ``[T, k]``, the routed stacks (QuantWeights or bf16
    tensors) ``gate`` / ``up [E, I, D]``, ``down [E, D, I]``, ``shared = (gate [I_s, D], up,
    down [D, I_s])`` or None; ``limit`` the SwiGLU clamp (None or 0: none, as experts())."""
    torch = torch_module()
    if x.dim() != 2 or x.dtype != torch.bfloat16 or not x.is_contiguous():
        raise EngramError(f"x must be a contiguous bfloat16 [T, D] (got {x.dtype} {tuple(x.shape)})")
    check("ids", ids, (torch.int32,), 2, where="")  # (devices after the shapes)
    check("route_w", route_w, (torch.float32,), 2, where="")
    T, k = int(ids.shape[0]), int(ids.shape[1])
    if int(x.shape[0]) != T or tuple(route_w.shape) != (T, k):
        raise EngramError(
            f"x [T, D], ids [T, k] and route_w [T, k] disagree: {tuple(x.shape)}, {tuple(ids.shape)}, "
            f"{tuple(route_w.shape)}"
        )
    routed, sw = _moe_weights(gate, up, down, shared)
    g, u, d = routed
    E, I, D = g.experts, g.out_features, g.in_features
    if int(x.shape[1]) != D:
        raise EngramError(f"x has {x.shape[1]} features, the experts take {D}")
    for name, t in (("x", x), ("ids", ids), ("route_w", route_w)):
        if t.device != x.device or not t.is_cuda:
            raise EngramError(f"{name} must be on {x.device} (got {t.device})")
    for i, w in enumerate(routed + (sw or [])):
        why = _weight_reason(("gate", "up", "down", "shared gate", "shared up", "shared down")[i], w, x.device)
        if why is not None:
            raise EngramError(why)
    Is = sw[0].out_features if sw else 0
    need = ctypes.c_size_t(0)
    _call("engram_quant_moe_workspace_size", T, k, I, Is, ctypes.addressof(need))
    workspace = torch.empty(max(int(need.value) // 4, 4), dtype=torch.float32, device=x.device)
    out = torch.empty((T, D), dtype=torch.bfloat16, device=x.device)
    none = _MoeWeight()
    clamp = limit is not None and limit != 0
    args = _Moe(
        ptr(x),
        ptr(ids),
        ptr(route_w),
        _moe_weight(g),
        _moe_weight(u),
        _moe_weight(d),
        _moe_weight(sw[0]) if sw else none,
        _moe_weight(sw[1]) if sw else none,
        _moe_weight(sw[2]) if sw else none,
        ptr(workspace),
        ptr(out),
        T,
        workspace.numel() * 4,
        D,
        k,
        E,
        I,
        Is,
        int(clamp),
        float(limit) if clamp else 0.0,
        0,
    )
    with device_guard(x.device.index):
        _call("engram_quant_moe", ctypes.addressof(args), stream_of(x.device))
    return out


__all__ = [
    "ACT_QUANT",
    "MAX_SEGMENTS",
    "MAX_TOKENS",
    "SIGNATURES",
    "STRUCTS",
    "gemv_segments",
    "moe",
    "moe_reason",
    "segment_reason",
    "unavailable",
]
