"""ctypes binding of the fused Engram gate (``plugins/kernels/gateKernels.h``,
``gateKernel.cu``): the gated residual update over hc_mult streams with the token mask,
bf16 / fp16 / fp32 I/O, fp32 math."""

from __future__ import annotations

import ctypes
from typing import Any

from engram_trt.errors import EngramError
from engram_trt.native.library import (
    FLOAT_BF16,
    FLOAT_F16,
    FLOAT_F32,
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

# enum values of gateKernels.h
MASK_NONE, MASK_U8, MASK_I32 = 0, 1, 2
WEIGHT_BF16, WEIGHT_F32, WEIGHT_F16 = FLOAT_BF16, FLOAT_F32, FLOAT_F16  # EngramWeightType: the EngramFloatType codes
GATE_CLAMP = 1e-6

_i32, _i64, _f32, _vp = ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
_ENTRY = EntryPoints(
    {
        "engram_gate": [_vp, _vp, _vp, _vp, _i32, _vp, _i32, _i64, _i32, _i32, _f32, _f32, _vp, _vp],
        "engram_gate_typed": [_vp, _vp, _i32, _vp, _vp, _i32, _vp, _i32, _i64, _i32, _i32, _f32, _f32, _vp, _vp],
    }
)
library = _ENTRY.library
_call = _ENTRY.call


def gate(
    hidden: Any,
    kv: Any,
    q_weight: Any,
    k_weight: Any,
    mask: Any = None,
    *,
    eps: float,
    clamp: float = GATE_CLAMP,
    out: Any = None,
) -> Any:
    """The fused Engram gate (engram-spec.md "Fusion"): ``[T, hc, D]`` in hidden's dtype.

    ``hidden [T, hc, D]``, ``kv [T, (hc+1)*D]`` and ``out`` share one dtype: bf16,
    fp16 or float32 (fp32 math inside, the output rounded once to that dtype);
    ``q_weight`` / ``k_weight`` ``[hc, D]`` both bf16, both float32 or both hidden's
    dtype; ``mask [T]`` bool / uint8 / int8 / int32 (0 = dead token: gate 0, out =
    hidden bit for bit) or None. ``out`` may be ``hidden`` (in place).
    """
    torch = torch_module()
    io_dtypes = (torch.bfloat16, torch.float16, torch.float32)
    check_dtype("hidden", hidden, io_dtypes)
    # one I/O dtype per call: refuse a mix before anything else (no silent conversion)
    io = {name: t.dtype for name, t in (("hidden", hidden), ("kv", kv), ("out", out)) if isinstance(t, torch.Tensor)}
    if len(set(io.values())) > 1:
        raise EngramError(
            "hidden, kv and out must share one dtype (bfloat16, float16 or float32); got "
            + ", ".join(f"{name} {dtype}" for name, dtype in io.items())
        )
    weight_dtypes = tuple(dict.fromkeys((torch.bfloat16, torch.float32, hidden.dtype)))
    check_dtype("q_weight", q_weight, weight_dtypes)
    check_dtype("k_weight", k_weight, (q_weight.dtype,))
    check("hidden", hidden, io_dtypes, 3)
    T, hc, D = hidden.shape
    check("kv", kv, (hidden.dtype,), 2)
    if tuple(kv.shape) != (T, (hc + 1) * D):
        raise EngramError(f"kv must be [T, (hc_mult+1)*D] = {(T, (hc + 1) * D)} (got {tuple(kv.shape)})")
    check("q_weight", q_weight, weight_dtypes, 2)
    check("k_weight", k_weight, (q_weight.dtype,), 2)
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if tuple(w.shape) != (hc, D):
            raise EngramError(f"{name} must be [hc_mult, D] = {(hc, D)} (got {tuple(w.shape)})")
    mask_type = MASK_NONE
    if mask is not None:
        check("mask", mask, (torch.bool, torch.uint8, torch.int8, torch.int32), 1)
        if mask.shape[0] != T:
            raise EngramError(f"mask must be [T] = ({T},) (got {tuple(mask.shape)})")
        mask_type = MASK_I32 if mask.dtype == torch.int32 else MASK_U8
    if out is None:
        out = torch.empty_like(hidden)
    check("out", out, (hidden.dtype,), 3)
    if out.shape != hidden.shape:
        raise EngramError(f"out must be [T, hc_mult, D] = {tuple(hidden.shape)} (got {tuple(out.shape)})")
    same_device(hidden.device, kv=kv, q_weight=q_weight, k_weight=k_weight, mask=mask, out=out)
    with device_guard(hidden.device.index):
        _call(
            "engram_gate_typed",
            ptr(hidden),
            ptr(kv),
            float_code(hidden.dtype),
            ptr(q_weight),
            ptr(k_weight),
            float_code(q_weight.dtype),
            ptr(mask),
            mask_type,
            T,
            hc,
            D,
            ctypes.c_float(eps),
            ctypes.c_float(clamp),
            ptr(out),
            stream_of(hidden.device),
        )
    return out
