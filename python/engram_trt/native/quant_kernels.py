"""ctypes bindings of the stored-format kernels (``plugins/kernels/quantKernels.h``), one
function per entry point, torch tensors in: the activation quantization
(:func:`act_quant`, :func:`swiglu_act_quant`), the routed step's plan (:func:`plan`),
the GEMV (:func:`gemv`), the FP8 tensor-core GEMM (:func:`fp8_gemm`), the FP4 / BF16
grouped GEMM (:func:`grouped_gemm`) and :func:`dequantize`.

A weight travels as a :class:`Weight`: the stored bytes ``[E, N, K]`` (``[E, N, K/2]`` for
FP4; a 2-D weight is ``E = 1``), its scales and block. :mod:`engram_trt.native.quant` builds
them from :class:`~engram_trt.quant.weight.QuantWeight` objects and runs the products the
models call. Each function checks dtypes, then shapes, then devices before anything reaches
the library (an EngramError names the bad argument); the library checks the rest (limits,
alignment) and its refusal comes back as one line. Work is enqueued on the current CUDA
stream; nothing here reads a device value on the host.
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

# quantKernels.h
QWEIGHT_FP8, QWEIGHT_FP4, QWEIGHT_BF16 = 0, 1, 2
QSCALE_F32, QSCALE_UE8M0 = 0, 1
GEMV_MAX_ROWS = 8  # ENGRAM_QGEMV_MAX_ROWS
GEMM_BLOCK_K = 128  # engram_fp8_gemm's one K block (activation group and weight bk)
PLAN_MAX_EXPERTS = 4096
PLAN_MAX_PAIRS = 1 << 20
KIND_CODES = {"fp8": QWEIGHT_FP8, "fp4": QWEIGHT_FP4, "bf16": QWEIGHT_BF16}
VALUES_PER_VECTOR = {"fp8": 16, "fp4": 32, "bf16": 8}  # the GEMV's 16-byte vectors

_i32, _i64, _f32, _vp = ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
SIGNATURES: dict[str, list[Any]] = {
    "engram_act_quant": [_vp, _i32, _i64, _i64, _i64, _i32, _i32, _vp, _vp, _vp, _i32, _vp],
    "engram_swiglu_act_quant": [_vp, _i64, _i64, _i64, _f32, _i32, _i32, _vp, _vp, _vp, _i32, _vp],
    "engram_moe_plan": [_vp, _i32, _i64, _i32, _i32, _vp, _vp, _vp, _vp, _vp, _i32, _vp, _vp],
    "engram_quant_gemv": [
        _vp,
        _i32,
        _i64,
        _vp,
        _i64,
        _vp,
        _i32,
        _vp,
        _i32,
        _i32,
        _i32,
        _i64,
        _i64,
        _i32,
        _vp,
        _vp,
        _i32,
        _vp,
        _i32,
        _i64,
        _i64,
        _vp,
    ],
    "engram_quant_gemv_ex": [
        _vp,
        _i32,
        _i64,
        _vp,
        _i64,
        _vp,
        _i32,
        _vp,
        _i32,
        _i32,
        _i32,
        _i64,
        _i64,
        _i32,
        _vp,
        _vp,
        _i32,
        _vp,
        _i32,
        _i64,
        _i64,
        ctypes.c_uint32,
        _vp,
    ],
    "engram_fp8_gemm": [_vp, _vp, _vp, _i64, _vp, _vp, _i32, _i32, _i64, _i64, _i32, _vp, _vp, _i32, _i64, _vp],
    "engram_quant_grouped_gemm": [
        _vp,
        _i64,
        _vp,
        _i64,
        _vp,
        _i32,
        _vp,
        _i32,
        _i32,
        _i32,
        _i64,
        _i64,
        _i32,
        _vp,
        _vp,
        _i32,
        _i64,
        _vp,
    ],
    "engram_quant_dequantize": [_vp, _i32, _vp, _i32, _i32, _i32, _i64, _i64, _i32, _vp, _i32, _vp],
    # the EngramRoutedExperts plugin's combine (declared for the ABI check; the torch path sums with torch ops)
    "engram_moe_combine": [_vp, _i64, _vp, _vp, _i32, _vp, _i64, _i32, _i32, _i64, _vp, _i32, _i64, _vp],
}
_ENTRY = EntryPoints(SIGNATURES)
library = _ENTRY.library
unavailable = _ENTRY.unavailable
_call = _ENTRY.call
QGEMV_WEIGHT_STATIC = 1  # ENGRAM_QGEMV_WEIGHT_STATIC
# ENGRAM_QGEMV_ACT_Q128_F32 / ENGRAM_QGEMV_ACT_Q32_UE8M0: the GEMV quantizes its activations
# as act_quant (group, ue8m0) would; keyed by (group, ue8m0)
QGEMV_ACT_QUANT = {(128, False): 2, (32, True): 4}
GEMV_ACT_QUANT_MAX_K = 16384  # a row of K floats in a block's shared memory on every GPU of sm_80+


@dataclass(frozen=True)
class Weight:
    """A weight (or a stack of experts) as the kernels take it: ``data`` the stored bytes
    ``[E, N, K]`` (FP8 ``float8_e4m3fn``, BF16 ``bfloat16``) or ``[E, N, K/2]`` (FP4,
    ``int8`` / ``uint8``), contiguous; ``scale`` ``[E, ceil(N/bn), ceil(K/bk)]`` float32 or
    ue8m0 bytes (``float8_e8m0fnu`` / ``uint8``), None for BF16."""

    data: Any
    scale: Any
    kind: str
    block: tuple[int, int]
    experts: int
    out_features: int
    in_features: int

    @property
    def w_type(self) -> int:
        return KIND_CODES[self.kind]

    @property
    def scale_type(self) -> int:
        if self.scale is None or self.scale.dtype == torch_module().float32:
            return QSCALE_F32
        return QSCALE_UE8M0

    @property
    def device(self) -> Any:
        return self.data.device


def make_weight(name: str, data: Any, scale: Any, kind: str, block: tuple[int, int], stacked: bool) -> Weight:
    """A :class:`Weight` from stored tensors, checked: ``stacked`` takes ``[E, N, K(/2)]``,
    else ``[N, K(/2)]`` (E = 1). ``name`` names the weight in the one-line refusals."""
    torch = torch_module()
    if kind not in KIND_CODES:
        raise EngramError(f"{name}: weight kind {kind!r} is not one of {sorted(KIND_CODES)}")
    dtypes = {"fp8": (torch.float8_e4m3fn, torch.uint8), "fp4": (torch.int8, torch.uint8), "bf16": (torch.bfloat16,)}
    check_dtype(f"{name} data", data, dtypes[kind])
    want_dim = 3 if stacked else 2
    if data.dim() != want_dim:
        raise EngramError(f"{name} must be {'[E, N, K]' if stacked else '[N, K]'} (got shape {tuple(data.shape)})")
    E = int(data.shape[0]) if stacked else 1
    N = int(data.shape[-2])
    K = int(data.shape[-1]) * (2 if kind == "fp4" else 1)
    if kind == "bf16":
        return Weight(data, None, kind, (1, 1), E, N, K)
    bn, bk = int(block[0]), int(block[1])
    if bn < 1 or bk < 1:
        raise EngramError(f"{name}: block {list(block)} must be two positive sizes")
    check_dtype(f"{name} scale", scale, (torch.float32, torch.float8_e8m0fnu, torch.uint8))
    grid = (-(-N // bn), -(-K // bk))
    want = ((E,) if stacked else ()) + grid
    if tuple(scale.shape) != want:
        raise EngramError(
            f"{name} scale has shape {list(scale.shape)} but a [{N}, {K}] {kind} weight in {bn}x{bk} "
            f"blocks needs {list(want)}"
        )
    return Weight(data, scale, kind, (bn, bk), E, N, K)


def _scale_arg(w: Weight) -> Any:
    return None if w.scale is None else w.scale


def _check_weight_device(w: Weight, name: str, device: Any) -> None:
    check(f"{name} data", w.data, (w.data.dtype,))
    if w.scale is not None:
        check(f"{name} scale", w.scale, (w.scale.dtype,))
    same_device(device, **{f"{name} data": w.data, f"{name} scale": w.scale})


def act_quant(
    x: Any, group: int, ue8m0: bool, *, q: bool = True, scale: bool = True, deq_dtype: Any = None
) -> tuple[Any, Any, Any]:
    """engram_act_quant of ``x [M, K]`` (bf16 / f16 / float32, rows of stride ``x.stride(0)``):
    ``(q float8_e4m3fn [M, K] | None, scale float32 [M, ceil(K/group)] | None, deq [M, K] of
    deq_dtype | None)``, the outputs asked for."""
    torch = torch_module()
    check_dtype("x", x, (torch.bfloat16, torch.float16, torch.float32))
    if x.dim() != 2:
        raise EngramError(f"x must be [M, K] (got shape {tuple(x.shape)})")
    M, K = int(x.shape[0]), int(x.shape[1])
    if x.stride(1) != 1 or (M > 1 and x.stride(0) < K):
        raise EngramError("x must have contiguous rows (call .contiguous())")
    if not x.is_cuda:
        raise EngramError(f"x must be a CUDA tensor (got device {x.device})")
    qt = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device) if q else None
    st = torch.empty((M, -(-K // max(int(group), 1))), dtype=torch.float32, device=x.device) if scale else None
    dt = torch.empty((M, K), dtype=deq_dtype, device=x.device) if deq_dtype is not None else None
    with device_guard(x.device.index):
        _call(
            "engram_act_quant",
            ptr(x),
            float_code(x.dtype),
            M,
            K,
            max(int(x.stride(0)), K),
            int(group),
            int(ue8m0),
            ptr(qt),
            ptr(st),
            ptr(dt),
            float_code(deq_dtype) if dt is not None else 0,
            stream_of(x.device),
        )
    return qt, st, dt


def swiglu_act_quant(
    gate_up: Any,
    limit: float | None,
    group: int,
    ue8m0: bool,
    *,
    q: bool = True,
    scale: bool = True,
    deq_dtype: Any = None,
) -> tuple[Any, Any, Any]:
    """engram_swiglu_act_quant of ``gate_up float32 [P, 2I]``: the clamped SwiGLU ``[P, I]``
    quantized per ``group`` columns (group 0: ``deq`` alone, unquantized)."""
    torch = torch_module()
    check("gate_up", gate_up, (torch.float32,), 2)
    P, I2 = int(gate_up.shape[0]), int(gate_up.shape[1])
    if I2 % 2:
        raise EngramError(f"gate_up must be [P, 2I] (got an odd width {I2})")
    I = I2 // 2
    if group == 0:
        q = scale = False
    dev = gate_up.device
    qt = torch.empty((P, I), dtype=torch.float8_e4m3fn, device=dev) if q else None
    st = torch.empty((P, -(-I // max(int(group), 1))), dtype=torch.float32, device=dev) if scale else None
    dt = torch.empty((P, I), dtype=deq_dtype, device=dev) if deq_dtype is not None else None
    with device_guard(dev.index):
        _call(
            "engram_swiglu_act_quant",
            ptr(gate_up),
            P,
            I,
            I2,
            _f32(float(limit or 0.0)),
            int(group),
            int(ue8m0),
            ptr(qt),
            ptr(st),
            ptr(dt),
            float_code(deq_dtype) if dt is not None else 0,
            stream_of(dev),
        )
    return qt, st, dt


def plan(ids: Any, num_experts: int, num_slots: int | None = None) -> dict[str, Any]:
    """engram_moe_plan of ``ids [T, k]`` (int32 / int64): the device tensors ``offsets [E+1]``,
    ``order``, ``row_token``, ``pair_row [T*k]``, ``slot_expert [num_slots]`` (default
    ``max(1, min(T*k, E))``) and ``error [1]`` (1 when an id is outside ``[0, E)``)."""
    torch = torch_module()
    check_dtype("ids", ids, (torch.int32, torch.int64))
    if ids.dim() != 2:
        raise EngramError(f"ids must be [T, k] (got shape {tuple(ids.shape)})")
    T, k = int(ids.shape[0]), int(ids.shape[1])
    E = int(num_experts)
    if not 1 <= E <= PLAN_MAX_EXPERTS:
        raise EngramError(f"num_experts must be in [1, {PLAN_MAX_EXPERTS}] (got {E})")
    if k < 1 or T * k > PLAN_MAX_PAIRS:
        raise EngramError(f"ids [T, k] = {[T, k]} needs k >= 1 and T * k <= {PLAN_MAX_PAIRS}")
    check("ids", ids, (ids.dtype,), 2)
    slots = max(1, min(T * k, E)) if num_slots is None else int(num_slots)
    dev = ids.device
    ints = torch.empty(E + 1 + 3 * T * k + slots, dtype=torch.int32, device=dev)  # one allocation
    out = {
        "offsets": ints[: E + 1],
        "order": ints[E + 1 : E + 1 + T * k],
        "row_token": ints[E + 1 + T * k : E + 1 + 2 * T * k],
        "pair_row": ints[E + 1 + 2 * T * k : E + 1 + 3 * T * k],
        "slot_expert": ints[E + 1 + 3 * T * k :],
        "error": torch.zeros(1, dtype=torch.int32, device=dev),
    }
    with device_guard(dev.index):
        _call(
            "engram_moe_plan",
            ptr(ids),
            int(ids.dtype == torch.int64),
            T,
            k,
            E,
            ptr(out["offsets"]),
            ptr(out["order"]),
            ptr(out["row_token"]),
            ptr(out["pair_row"]),
            ptr(out["slot_expert"]),
            slots,
            ptr(out["error"]),
            stream_of(dev),
        )
    return out


def _out_check(out: Any, rows: int, cols: int) -> None:
    torch = torch_module()
    check_dtype("out", out, (torch.bfloat16, torch.float16, torch.float32))
    if out.dim() != 2 or out.stride(1) != 1 or int(out.shape[0]) != rows or int(out.shape[1]) < cols:
        raise EngramError(f"out must be [{rows}, >= {cols}] with contiguous rows (got shape {tuple(out.shape)})")


def gemv(
    a: Any,
    w: Weight,
    out: Any,
    *,
    row_index: Any = None,
    offsets: Any = None,
    slot_expert: Any = None,
    o_col0: int = 0,
    weight_static: bool = False,
    act_quant: tuple[int, bool] | None = None,
) -> Any:
    """engram_quant_gemv: ``out[p, o_col0 + n] = a[row_index[p]] . W_e[n]`` (``a`` float32 /
    bf16 ``[*, K]`` with contiguous rows; ``out [P, ldo]`` bf16 / f16 / float32, P its rows;
    experts: ``offsets`` / ``slot_expert`` of :func:`plan`). ``weight_static``: nothing queued
    on the stream before this call writes the weight (a model's weights), so one weight's
    first vectors may be loaded while the kernel before it still runs (engram_quant_gemv_ex
    with ENGRAM_QGEMV_WEIGHT_STATIC). ``act_quant`` ``(group, ue8m0)`` in QGEMV_ACT_QUANT:
    ``a`` is the raw activations, quantized inside the GEMV as :func:`act_quant` would (the
    same bits as act_quant's float32 deq passed as ``a``; K <= GEMV_ACT_QUANT_MAX_K)."""
    torch = torch_module()
    flags = QGEMV_WEIGHT_STATIC if weight_static else 0
    if act_quant is not None:
        key = (int(act_quant[0]), bool(act_quant[1]))
        if key not in QGEMV_ACT_QUANT:
            raise EngramError(f"act_quant {act_quant!r}: the GEMV quantizes per (128, float32) or (32, ue8m0) only")
        flags |= QGEMV_ACT_QUANT[key]
    check_dtype("a", a, (torch.float32, torch.bfloat16))
    if a.dim() != 2 or a.stride(1) != 1 or int(a.shape[1]) != w.in_features:
        raise EngramError(f"a must be [*, {w.in_features}] with contiguous rows (got shape {tuple(a.shape)})")
    P = int(out.shape[0])
    _out_check(out, P, int(o_col0) + w.out_features)
    same_device(a.device, out=out, row_index=row_index, offsets=offsets, slot_expert=slot_expert)
    _check_weight_device(w, "w", a.device)
    slots = 1 if slot_expert is None else int(slot_expert.shape[0])
    args = (
        ptr(a),
        float_code(a.dtype),
        int(a.stride(0)),
        ptr(row_index),
        P,
        ptr(w.data),
        w.w_type,
        ptr(_scale_arg(w)),
        w.scale_type,
        w.block[0],
        w.block[1],
        w.out_features,
        w.in_features,
        w.experts,
        ptr(offsets),
        ptr(slot_expert),
        slots,
        ptr(out),
        float_code(out.dtype),
        int(out.stride(0)),
        int(o_col0),
    )
    with device_guard(a.device.index):
        _call("engram_quant_gemv_ex", *args, flags, stream_of(a.device))
    return out


def fp8_gemm(aq: Any, a_scale: Any, w: Weight, out: Any, *, row_index: Any = None, offsets: Any = None) -> Any:
    """engram_fp8_gemm: ``aq float8_e4m3fn [*, K]`` and ``a_scale float32 [*, ceil(K/128)]``
    (act_quant with group 128) times the FP8 weight(s), into ``out [P, >= N]``."""
    torch = torch_module()
    check("aq", aq, (torch.float8_e4m3fn,), 2)
    check("a_scale", a_scale, (torch.float32,), 2)
    if w.kind != "fp8" or w.block[1] != GEMM_BLOCK_K:
        raise EngramError(
            f"fp8_gemm takes an fp8 weight in blocks of bk = {GEMM_BLOCK_K} (got {w.kind} {w.block[0]}x{w.block[1]})"
        )
    P = int(out.shape[0])
    _out_check(out, P, w.out_features)
    same_device(aq.device, a_scale=a_scale, out=out, row_index=row_index, offsets=offsets)
    _check_weight_device(w, "w", aq.device)
    with device_guard(aq.device.index):
        _call(
            "engram_fp8_gemm",
            ptr(aq),
            ptr(a_scale),
            ptr(row_index),
            P,
            ptr(w.data),
            ptr(w.scale),
            w.scale_type,
            w.block[0],
            w.out_features,
            w.in_features,
            w.experts,
            ptr(offsets),
            ptr(out),
            float_code(out.dtype),
            int(out.stride(0)),
            stream_of(aq.device),
        )
    return out


def grouped_gemm(a: Any, w: Weight, out: Any, *, row_index: Any = None, offsets: Any = None) -> Any:
    """engram_quant_grouped_gemm: ``a bf16 [*, K]`` (contiguous rows) times FP4 / BF16
    weight(s), into ``out [P, >= N]``."""
    torch = torch_module()
    check_dtype("a", a, (torch.bfloat16,))
    if a.dim() != 2 or a.stride(1) != 1 or int(a.shape[1]) != w.in_features:
        raise EngramError(f"a must be [*, {w.in_features}] with contiguous rows (got shape {tuple(a.shape)})")
    P = int(out.shape[0])
    _out_check(out, P, w.out_features)
    same_device(a.device, out=out, row_index=row_index, offsets=offsets)
    _check_weight_device(w, "w", a.device)
    with device_guard(a.device.index):
        _call(
            "engram_quant_grouped_gemm",
            ptr(a),
            int(a.stride(0)),
            ptr(row_index),
            P,
            ptr(w.data),
            w.w_type,
            ptr(_scale_arg(w)),
            w.scale_type,
            w.block[0],
            w.block[1],
            w.out_features,
            w.in_features,
            w.experts,
            ptr(offsets),
            ptr(out),
            float_code(out.dtype),
            int(out.stride(0)),
            stream_of(a.device),
        )
    return out


def dequantize(w: Weight, dtype: Any = None) -> Any:
    """engram_quant_dequantize: the float weight ``[E, N, K]`` (``dtype`` float32 default,
    bf16 or f16) on the weight's device."""
    torch = torch_module()
    dtype = torch.float32 if dtype is None else dtype
    _check_weight_device(w, "w", w.device)
    out = torch.empty((w.experts, w.out_features, w.in_features), dtype=dtype, device=w.device)
    with device_guard(w.device.index):
        _call(
            "engram_quant_dequantize",
            ptr(w.data),
            w.w_type,
            ptr(_scale_arg(w)),
            w.scale_type,
            w.block[0],
            w.block[1],
            w.out_features,
            w.in_features,
            w.experts,
            ptr(out),
            float_code(dtype),
            stream_of(w.device),
        )
    return out
