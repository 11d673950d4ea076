"""ctypes bindings to Qwen4-Exp's Gated DeltaNet kernels in the kernel library
(``plugins/kernels/linearAttentionKernel.cu``, the math of the EngramCausalConv1d and
EngramGatedDeltaNet plugins): the causal depthwise short conv over each slot's conv state,
and the gated delta rule over each slot's fp32 memory, both over a packed step and both
updating their state in place.

:func:`causal_conv1d` is ``GatedDeltaNet._conv`` (models/qwen4_exp/linear_attention.py)
for every sequence of a step at once; :func:`gated_delta_net` is its recurrence
(``recurrent_delta_step`` / ``chunked_delta_rule``) with the q / k L2 normalization and
q's scale inside. models/qwen4_exp/reference_linear_attention.py is the float64 reference of both.
The functions check dtypes, then shapes, then devices before anything reaches the
library (an EngramError names the bad argument); the entry points are declared here, on
first use, as :mod:`engram_trt.native.ple` declares its own (a library built before these
kernels still serves the rest).
"""

from __future__ import annotations

import ctypes
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

# engramKernels.h: ENGRAM_CAUSAL_CONV_MAX_KERNEL, ENGRAM_GATED_DELTA_MAX_HEAD_DIM, EngramConvActivation
MAX_KERNEL = 32
MAX_HEAD_DIM = 256
ACTIVATIONS = {"identity": 0, "silu": 1}

_i32, _i64, _vp, _f32 = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
_ENTRY = EntryPoints(
    {
        "engram_causal_conv1d_check_shape": [_i64, _i32, _i32],
        "engram_gated_delta_net_check_shape": [_i32, _i32, _i32, _i32, _i32, _f32],
        "engram_causal_conv1d": [
            _vp,
            _i32,
            _vp,
            _i32,
            _vp,
            _i64,
            _vp,
            _vp,
            _vp,
            _i64,
            _i64,
            _i64,
            _i32,
            _i32,
            _vp,
            _vp,
        ],
        "engram_gated_delta_net": [
            _vp,
            _vp,
            _vp,
            _i32,
            _vp,
            _vp,
            _vp,
            _i64,
            _vp,
            _vp,
            _vp,
            _i64,
            _i64,
            _i32,
            _i32,
            _i32,
            _i32,
            _i32,
            _f32,
            _vp,
            _vp,
        ],
    }
)
library = _ENTRY.library
_call = _ENTRY.call
unavailable = _ENTRY.unavailable


def _activation_code(activation: int | str) -> int:
    if isinstance(activation, str):
        if activation not in ACTIVATIONS:
            raise EngramError(f"activation {activation!r} is not one of {sorted(ACTIVATIONS)}")
        return ACTIVATIONS[activation]
    return int(activation)


def check_conv_shape(channels: int, kernel: int, activation: int | str) -> None:
    """The conv kernel's limits (channels, kernel in [1, MAX_KERNEL], activation 0 / 1); no GPU."""
    _call("engram_causal_conv1d_check_shape", int(channels), int(kernel), _activation_code(activation))


def check_delta_shape(
    num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int, l2norm_qk: bool, scale: float
) -> None:
    """The recurrence's limits (Hv % Hk, dk / dv in [1, MAX_HEAD_DIM], scale finite); no GPU."""
    _call(
        "engram_gated_delta_net_check_shape",
        int(num_k_heads),
        int(num_v_heads),
        int(head_k_dim),
        int(head_v_dim),
        int(bool(l2norm_qk)),
        ctypes.c_float(scale),
    )


def _step(seq_starts: Any, past_lens: Any, slots: Any) -> int:
    torch = torch_module()
    for name, t in (("seq_starts", seq_starts), ("past_lens", past_lens), ("slots", slots)):
        check(name, t, (torch.int32,), 1, where="any")
    S = past_lens.shape[0]
    if seq_starts.shape[0] != S + 1 or slots.shape[0] != S:
        raise EngramError(
            f"seq_starts must be [S+1] and slots [S] with past_lens' S = {S} "
            f"(got {tuple(seq_starts.shape)}, {tuple(slots.shape)})"
        )
    return S


def _on_cuda(device: Any, **tensors: Any) -> None:
    for name, t in tensors.items():
        if not t.is_cuda:
            raise EngramError(f"{name} must be a CUDA tensor (got device {t.device})")
    same_device(device, **tensors)


def causal_conv1d(
    x: Any,
    weight: Any,
    conv_state: Any,
    seq_starts: Any,
    past_lens: Any,
    slots: Any,
    *,
    activation: int | str = "silu",
    out: Any = None,
) -> Any:
    """The causal depthwise conv ``[T, C]`` of a packed step (fp32 sums, rounded once).

    ``x [T, C]`` and ``conv_state [num_slots, C, K-1]`` share one dtype (bf16, fp16,
    float32); ``weight [C, K]`` or ``[C, 1, K]`` is float32 or that dtype. ``seq_starts
    [S+1]`` (cu_seqlens), ``past_lens [S]``, ``slots [S]`` int32 on the same CUDA device: a
    sequence continues from its slot's state when its past length is > 0 (zeros
    otherwise), and the slot's row becomes its last K-1 inputs (in place).
    ``activation``: ``"identity"`` / 0 or ``"silu"`` / 1.
    """
    torch = torch_module()
    io_dtypes = (torch.bfloat16, torch.float16, torch.float32)
    check_dtype("x", x, io_dtypes)
    io = x.dtype
    check_dtype("conv_state", conv_state, (io,))
    check_dtype("weight", weight, tuple(dict.fromkeys((torch.float32, io))))
    S = _step(seq_starts, past_lens, slots)
    check("x", x, io_dtypes, 2, where="any")
    T, C = x.shape
    check("weight", weight, (weight.dtype,), where="any")
    if weight.dim() == 3 and weight.shape[1] == 1:
        weight = weight.reshape(weight.shape[0], weight.shape[2])
    if weight.dim() != 2 or weight.shape[0] != C:
        raise EngramError(f"weight must be [C, K] or [C, 1, K] with C = {C} (got {tuple(weight.shape)})")
    K = int(weight.shape[1])
    code = _activation_code(activation)
    check_conv_shape(C, K, code)
    check("conv_state", conv_state, (io,), 3, where="any")
    if tuple(conv_state.shape[1:]) != (C, K - 1):
        raise EngramError(
            f"conv_state must be [num_slots, C, K-1] = [num_slots, {C}, {K - 1}] (got {tuple(conv_state.shape)})"
        )
    if out is None:
        out = torch.empty_like(x)
    check("out", out, (io,), 2, where="any")
    if tuple(out.shape) != (T, C):
        raise EngramError(f"out must be [T, C] = {(T, C)} (got {tuple(out.shape)})")
    _on_cuda(
        x.device,
        x=x,
        weight=weight,
        conv_state=conv_state,
        seq_starts=seq_starts,
        past_lens=past_lens,
        slots=slots,
        out=out,
    )
    with device_guard(x.device.index):
        _call(
            "engram_causal_conv1d",
            ptr(x),
            float_code(io),
            ptr(weight),
            float_code(weight.dtype),
            ptr(conv_state if conv_state.numel() else None),
            int(conv_state.shape[0]),
            ptr(seq_starts),
            ptr(past_lens),
            ptr(slots),
            S,
            T,
            C,
            K,
            code,
            ptr(out),
            stream_of(x.device),
        )
    return out


def gated_delta_net(
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    beta: Any,
    state: Any,
    seq_starts: Any,
    past_lens: Any,
    slots: Any,
    *,
    l2norm_qk: bool = True,
    scale: float | None = None,
    out: Any = None,
) -> Any:
    """The gated delta rule's output ``o [T, Hv, dv]`` of a packed step (fp32 inside,
    rounded once); ``state`` updated in place.

    ``q, k [T, Hk, dk]`` and ``v [T, Hv, dv]`` share one dtype (bf16, fp16, float32);
    ``g`` (log decay) and ``beta`` ``[T, Hv]`` and ``state [num_slots, Hv, dk, dv]`` are
    float32. ``l2norm_qk``: q and k L2-normalized inside (eps linear_attention.L2_EPS);
    ``scale`` multiplies q after that (None: ``dk ** -0.5``, the model's). The step
    arguments as :func:`causal_conv1d`'s.
    """
    torch = torch_module()
    io_dtypes = (torch.bfloat16, torch.float16, torch.float32)
    check_dtype("q", q, io_dtypes)
    io = q.dtype
    for name, t in (("k", k), ("v", v)):
        check_dtype(name, t, (io,))
    for name, t in (("g", g), ("beta", beta), ("state", state)):
        check_dtype(name, t, (torch.float32,))
    S = _step(seq_starts, past_lens, slots)
    check("q", q, io_dtypes, 3, where="any")
    T, Hk, dk = q.shape
    check("k", k, (io,), 3, where="any")
    if tuple(k.shape) != (T, Hk, dk):
        raise EngramError(f"k must be q's shape {(T, Hk, dk)} (got {tuple(k.shape)})")
    check("v", v, (io,), 3, where="any")
    if v.shape[0] != T:
        raise EngramError(f"v must be [T, Hv, dv] with T = {T} (got {tuple(v.shape)})")
    Hv, dv = int(v.shape[1]), int(v.shape[2])
    scale = float(dk) ** -0.5 if scale is None else float(scale)
    check_delta_shape(Hk, Hv, dk, dv, l2norm_qk, scale)
    for name, t in (("g", g), ("beta", beta)):
        check(name, t, (torch.float32,), 2, where="any")
        if tuple(t.shape) != (T, Hv):
            raise EngramError(f"{name} must be [T, Hv] = {(T, Hv)} (got {tuple(t.shape)})")
    check("state", state, (torch.float32,), 4, where="any")
    if tuple(state.shape[1:]) != (Hv, dk, dv):
        raise EngramError(
            f"state must be [num_slots, Hv, dk, dv] = [num_slots, {Hv}, {dk}, {dv}] (got {tuple(state.shape)})"
        )
    if out is None:
        out = torch.empty_like(v)
    check("out", out, (io,), 3, where="any")
    if tuple(out.shape) != (T, Hv, dv):
        raise EngramError(f"out must be [T, Hv, dv] = {(T, Hv, dv)} (got {tuple(out.shape)})")
    _on_cuda(
        q.device,
        q=q,
        k=k,
        v=v,
        g=g,
        beta=beta,
        state=state,
        seq_starts=seq_starts,
        past_lens=past_lens,
        slots=slots,
        out=out,
    )
    with device_guard(q.device.index):
        _call(
            "engram_gated_delta_net",
            ptr(q),
            ptr(k),
            ptr(v),
            float_code(io),
            ptr(g),
            ptr(beta),
            ptr(state if state.numel() else None),
            int(state.shape[0]),
            ptr(seq_starts),
            ptr(past_lens),
            ptr(slots),
            S,
            T,
            Hk,
            Hv,
            dk,
            dv,
            int(bool(l2norm_qk)),
            ctypes.c_float(scale),
            ptr(out),
            stream_of(q.device),
        )
    return out
