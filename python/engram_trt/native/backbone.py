"""ctypes bindings to the kernel library's decoder-layer kernels
(``plugins/kernels/backboneKernel.cu``, ``gemvKernel.cu``): the hc-mean RMSNorm with the
residual update before it, the SwiGLU activation of a fused gate + up projection, and the
projections of a decode step of a few tokens, bf16 only.

They exist for the decode step's launch count: around its GEMMs a layer of the PyTorch
reference runs ~40 tiny elementwise kernels, which at ~3 us each cost a 1B model's
decode step more than its weight reads. Each function here is one launch that rounds
where the reference's bf16 ops round (``engramKernels.h`` gives the formulas). Arguments
are checked (dtypes, then shapes, then devices) before anything reaches the library; an
EngramError names the bad one. Work is enqueued on the current CUDA stream. The RoPE +
KV write of a fused projection is :func:`engram_trt.native.attention.rope_kv_cache_write`.
"""

from __future__ import annotations

import ctypes
from typing import Any

from engram_trt.errors import EngramError
from engram_trt.native.library import (
    EntryPoints,
    capability_major,
    check,
    check_dtype,
    device_guard,
    ptr,
    same_device,
    stream_of,
    torch_module,
)

NORM_MAX_HIDDEN = 16384  # ENGRAM_NORM_MAX_HIDDEN
GEMV_MAX_TOKENS = 4  # ENGRAM_GEMV_MAX_TOKENS
GEMV_MIN_CAPABILITY = 9  # compute capability major the GEMV is built for (and measured at)
GEMV_WEIGHT_STATIC = 1  # ENGRAM_GEMV_WEIGHT_STATIC

_SIGS = {
    "engram_hc_rms_norm": [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int32,
        ctypes.c_int32,
        ctypes.c_float,
        ctypes.c_void_p,
        ctypes.c_void_p,
    ],
    "engram_silu_mul": [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p],
    "engram_gemv_bf16": [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_uint32,
        ctypes.c_void_p,
        ctypes.c_void_p,
    ],
}
_ENTRY = EntryPoints(_SIGS)
library = _ENTRY.library
_call = _ENTRY.call


def _bf16_out(out: Any, what: str, shape: tuple, device: Any) -> Any:
    """``out``, checked as a contiguous bf16 ``shape`` tensor (``what`` names its dims in
    the message), or a new one on ``device``."""
    torch = torch_module()
    if out is None:
        return torch.empty(shape, dtype=torch.bfloat16, device=device)
    check("out", out, (torch.bfloat16,), 2)
    if tuple(out.shape) != shape:
        raise EngramError(f"out must be {what} = {shape} (got {tuple(out.shape)})")
    return out


def load() -> None:
    """Loads the library and declares these entry points (EngramError when it is missing)."""
    library()


def hc_rms_norm(hs: Any, weight: Any, eps: float, residual: Any = None, *, out: Any = None) -> Any:
    """``RMSNorm(hs.mean(dim=1)) * weight`` ``[T, D]`` of ``hs [T, hc, D]``; with ``residual
    [T, D]``, first ``hs += residual.unsqueeze(1)`` in place (the layer's residual update).
    bf16 in and out, float32 math, rounded as the reference's bf16 ops."""
    torch = torch_module()
    check_dtype("hs", hs, (torch.bfloat16,))
    check_dtype("weight", weight, (torch.bfloat16,))
    if residual is not None:
        check_dtype("residual", residual, (torch.bfloat16,))
    if hs.dim() != 3:
        raise EngramError(f"hs must be [T, hc_mult, D] (got shape {tuple(hs.shape)})")
    T, hc, D = hs.shape
    if not 1 <= D <= NORM_MAX_HIDDEN:
        raise EngramError(f"hidden size {D} is outside the norm kernel's 1..{NORM_MAX_HIDDEN}")
    if tuple(weight.shape) != (D,):
        raise EngramError(f"weight must be [D] = ({D},) (got {tuple(weight.shape)})")
    if residual is not None and tuple(residual.shape) != (T, D):
        raise EngramError(f"residual must be [T, D] = {(T, D)} (got {tuple(residual.shape)})")
    check("hs", hs, (torch.bfloat16,))
    check("weight", weight, (torch.bfloat16,))
    if residual is not None:
        check("residual", residual, (torch.bfloat16,))
    same_device(hs.device, weight=weight, residual=residual, out=out)
    out = _bf16_out(out, "[T, D]", (T, D), hs.device)
    with device_guard(hs.device.index):
        _call(
            "engram_hc_rms_norm",
            ptr(hs),
            ptr(residual),
            ptr(weight),
            T,
            hc,
            D,
            ctypes.c_float(eps),
            ptr(out),
            stream_of(hs.device),
        )
    return out


def silu_mul(gate_up: Any, *, out: Any = None) -> Any:
    """``silu(gate) * up`` ``[T, I]`` of a fused projection ``gate_up [T, 2I]`` (gate
    first), bf16, rounded as the reference's bf16 ``F.silu(gate) * up``."""
    torch = torch_module()
    check_dtype("gate_up", gate_up, (torch.bfloat16,))
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 != 0 or gate_up.shape[1] == 0:
        raise EngramError(f"gate_up must be [T, 2 * intermediate_size] (got shape {tuple(gate_up.shape)})")
    check("gate_up", gate_up, (torch.bfloat16,))
    T, I = gate_up.shape[0], gate_up.shape[1] // 2
    if out is None:
        out = torch.empty((T, I), dtype=gate_up.dtype, device=gate_up.device)
    else:
        check("out", out, (torch.bfloat16,), 2)
        if tuple(out.shape) != (T, I) or out.device != gate_up.device:
            raise EngramError(
                f"out must be [T, intermediate_size] = {(T, I)} on {gate_up.device} "
                f"(got {tuple(out.shape)} on {out.device})"
            )
    with device_guard(gate_up.device.index):
        _call("engram_silu_mul", ptr(gate_up), T, I, ptr(out), stream_of(gate_up.device))
    return out


def gemv_fits(x: Any, weight: Any) -> bool:
    """True when :func:`gemv` takes ``F.linear(x, weight)`` as it is: bf16 tensors on a GPU
    of compute capability 9.0 or later, x ``[T, K]`` with 1 <= T <= GEMV_MAX_TOKENS, weight
    ``[N, K]``, K a multiple of 8, both contiguous and 16-byte aligned. Anything else is
    the GEMM library's."""
    torch = torch_module()
    return (
        x.dim() == 2
        and weight.dim() == 2
        and 1 <= x.shape[0] <= GEMV_MAX_TOKENS
        and x.shape[1] == weight.shape[1]
        and x.shape[1] % 8 == 0
        and x.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and x.is_cuda
        and weight.device == x.device
        and x.is_contiguous()
        and weight.is_contiguous()
        and x.data_ptr() % 16 == 0
        and weight.data_ptr() % 16 == 0
        and capability_major(x.device.index) >= GEMV_MIN_CAPABILITY
    )


def gemv(x: Any, weight: Any, *, out: Any = None, weight_static: bool = False) -> Any:
    """``F.linear(x, weight)`` ``[T, N]`` for a decode step of ``T <= GEMV_MAX_TOKENS``
    tokens: x ``[T, K]``, weight ``[N, K]``, bf16; float32 sums rounded once (the GEMM
    library's differ by their order). ``weight_static``: nothing queued on the stream
    before this call writes ``weight`` (a model's weights), so on sm_90+ the kernel may
    start loading it while the kernel before it still runs (ENGRAM_TRT_PDL=0: never).
    Needs a GPU of compute capability 9.0 or later (the library refuses older ones)."""
    torch = torch_module()
    check_dtype("x", x, (torch.bfloat16,))
    check_dtype("weight", weight, (torch.bfloat16,))
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise EngramError(f"x must be [T, K] and weight [N, K] (got shapes {tuple(x.shape)} and {tuple(weight.shape)})")
    T, K = x.shape
    N = weight.shape[0]
    if not 0 <= T <= GEMV_MAX_TOKENS:
        raise EngramError(f"gemv takes at most {GEMV_MAX_TOKENS} tokens (got {T}); use F.linear")
    if K % 8 != 0 or K == 0:
        raise EngramError(f"in_features must be a positive multiple of 8 (got {K}); use F.linear")
    check("x", x, (torch.bfloat16,), 2)
    check("weight", weight, (torch.bfloat16,), 2)
    same_device(x.device, weight=weight, out=out)
    out = _bf16_out(out, "[T, N]", (T, N), x.device)
    for name, t in (("x", x), ("weight", weight), ("out", out)):
        if t.data_ptr() % 16:
            raise EngramError(
                f"{name} must start on a 16-byte boundary (got address {t.data_ptr():#x}); "
                "pass a .clone() or use F.linear"
            )
    with device_guard(x.device.index):
        _call(
            "engram_gemv_bf16",
            ptr(x),
            ptr(weight),
            T,
            N,
            K,
            GEMV_WEIGHT_STATIC if weight_static else 0,
            ptr(out),
            stream_of(x.device),
        )
    return out
