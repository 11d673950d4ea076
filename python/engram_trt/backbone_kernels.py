"""ctypes bindings to the kernel library's decoder-layer kernels
(``plugins/kernels/backboneKernel.cu``): the hc-mean RMSNorm with the residual update
before it, and the SwiGLU activation of a fused gate + up projection, bf16 only.

They exist for the decode step's launch count: around its GEMMs a layer of the PyTorch
reference runs ~40 tiny elementwise kernels, which at ~3 us each cost a 1B model's
decode step more than its weight reads. Each function here is one launch that rounds
where the reference's bf16 ops round (``engramKernels.h`` gives the formulas). Arguments
are checked (dtypes, then shapes, then devices) before anything reaches the library; an
EngramError names the bad one. Work is enqueued on the current CUDA stream. The RoPE +
KV write of a fused projection is :func:`engram_trt.attention_kernels.rope_kv_cache_write`.
"""

from __future__ import annotations

import ctypes
from typing import Any

from engram_trt.errors import EngramError
from engram_trt.kernels import EntryPoints, _check, _check_dtype, _ptr, _same_device, _stream, _torch

NORM_MAX_HIDDEN = 16384  # ENGRAM_NORM_MAX_HIDDEN

_SIGS = {
    "engram_hc_rms_norm": [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32,
                           ctypes.c_int32, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p],
    "engram_silu_mul": [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p],
}
_ENTRY = EntryPoints(_SIGS)
_library = _ENTRY.library
_call = _ENTRY.call


def load() -> None:
    """Loads the library and declares these entry points (EngramError when it is missing)."""
    _library()


def hc_rms_norm(hs: Any, weight: Any, eps: float, residual: Any = None, *, out: Any = None) -> Any:
    """``RMSNorm(hs.mean(dim=1)) * weight`` ``[T, D]`` of ``hs [T, hc, D]``; with ``residual
    [T, D]``, first ``hs += residual.unsqueeze(1)`` in place (the layer's residual update).
    bf16 in and out, float32 math, rounded as the reference's bf16 ops."""
    torch = _torch()
    _check_dtype("hs", hs, (torch.bfloat16,))
    _check_dtype("weight", weight, (torch.bfloat16,))
    if residual is not None:
        _check_dtype("residual", residual, (torch.bfloat16,))
    if hs.dim() != 3:
        raise EngramError(f"hs must be [T, hc_mult, D] (got shape {tuple(hs.shape)})")
    T, hc, D = hs.shape
    if not 1 <= D <= NORM_MAX_HIDDEN:
        raise EngramError(f"hidden size {D} is outside the norm kernel's 1..{NORM_MAX_HIDDEN}")
    if tuple(weight.shape) != (D,):
        raise EngramError(f"weight must be [D] = ({D},) (got {tuple(weight.shape)})")
    if residual is not None and tuple(residual.shape) != (T, D):
        raise EngramError(f"residual must be [T, D] = {(T, D)} (got {tuple(residual.shape)})")
    _check("hs", hs, (torch.bfloat16,))
    _check("weight", weight, (torch.bfloat16,))
    if residual is not None:
        _check("residual", residual, (torch.bfloat16,))
    _same_device(hs.device, weight=weight, residual=residual, out=out)
    if out is None:
        out = torch.empty((T, D), dtype=hs.dtype, device=hs.device)
    else:
        _check("out", out, (torch.bfloat16,), 2)
        if tuple(out.shape) != (T, D):
            raise EngramError(f"out must be [T, D] = {(T, D)} (got {tuple(out.shape)})")
    with torch.cuda.device(hs.device):
        _call("engram_hc_rms_norm", _ptr(hs), _ptr(residual), _ptr(weight), T, hc, D, ctypes.c_float(eps), _ptr(out),
              _stream(hs.device))
    return out


def silu_mul(gate_up: Any, *, out: Any = None) -> Any:
    """``silu(gate) * up`` ``[T, I]`` of a fused projection ``gate_up [T, 2I]`` (gate
    first), bf16, rounded as the reference's bf16 ``F.silu(gate) * up``."""
    torch = _torch()
    _check_dtype("gate_up", gate_up, (torch.bfloat16,))
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 != 0 or gate_up.shape[1] == 0:
        raise EngramError(f"gate_up must be [T, 2 * intermediate_size] (got shape {tuple(gate_up.shape)})")
    _check("gate_up", gate_up, (torch.bfloat16,))
    T, I = gate_up.shape[0], gate_up.shape[1] // 2
    if out is None:
        out = torch.empty((T, I), dtype=gate_up.dtype, device=gate_up.device)
    else:
        _check("out", out, (torch.bfloat16,), 2)
        if tuple(out.shape) != (T, I) or out.device != gate_up.device:
            raise EngramError(f"out must be [T, intermediate_size] = {(T, I)} on {gate_up.device} "
                              f"(got {tuple(out.shape)} on {out.device})")
    with torch.cuda.device(gate_up.device):
        _call("engram_silu_mul", _ptr(gate_up), T, I, _ptr(out), _stream(gate_up.device))
    return out
