"""The products the models run with weights in their stored format on a GPU (the kernel
library's ``quantKernels.h`` through :mod:`engram_trt.native.quant_kernels`):

* :func:`linear` ``(x [..., K], qw) -> [..., N]``: the activations quantized per token and
  group as the published inference does (``ACT_QUANT``: FP8 weights 128 columns with
  float32 scales, FP4 weights 32 columns with ue8m0 scales), then the GEMV for up to
  ``LINEAR_GEMV_MAX_ROWS`` rows (each weight byte read once) or the tensor-core GEMM for
  more (FP8: the e4m3 GEMM with its per-block promotion; FP4: the bf16 grouped GEMM with
  E = 1); :func:`unavailable_for` says why the kernels cannot take a call (None: they can).
  FP8 GEMM rows go to ``torch._scaled_mm`` with block-wise scales (activations 1x128,
  weights 128x128, float32; cuBLASLt's Hopper kernels, 4-5x the rate of ours at prefill
  sizes) where :func:`scaled_mm_reason` is None: compute capability 9.x, a weight of
  128x128 blocks with N and K multiples of 128, this torch taking the call (asked once per
  shape and dtype; a refusal keeps our GEMM for that shape), ``ENGRAM_TRT_FP8_GEMM`` not
  ``ours``. Both compute the same sum (per 128-column block the tensor cores' e4m3
  products, promoted into float32 times the two scales); the plugin (engine path) keeps
  ours.
* :func:`moe_plan` ``(ids [T, k], E) -> MoePlan``: a routed step's counting sort on the
  device.
* :func:`experts`: a MoE layer's routed experts, ``sum_j w[t, j] down_e(swiglu(gate_e x,
  up_e x))``: decode steps (up to ``EXPERTS_GEMV_MAX_TOKENS`` tokens) through the grouped
  GEMV, prefills through the grouped GEMMs; the combine gathers each pair's output row
  (``pair_row``) and sums over k with torch ops (deterministic, no atomics).

Nothing here reads a device value on the host (no ``.item()``, ``.tolist()``,
``.cpu()``, ``nonzero``): the calls can be captured in a CUDA graph. A weight is a
:class:`~engram_trt.quant.weight.QuantWeight` (read by its fields: this layer sits below
``quant/``) or, for experts, a bf16 tensor stack ``[E, N, K]``.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

from engram_trt.errors import EngramError
from engram_trt.native import quant_kernels as qk
from engram_trt.native.library import check, torch_module

# The activation quantization per weight kind: (group of columns, ue8m0 scales); the same
# table as engram_trt.quant.weight.ACT_QUANT (a test ties them; this layer cannot import it).
ACT_QUANT = {"fp8": (128, False), "fp4": (32, True)}
LINEAR_GEMV_MAX_ROWS = qk.GEMV_MAX_ROWS  # linear(): the GEMV up to this many rows, the GEMM above
GEMV_PASSES_MAX_ROWS = 64  # where the GEMM cannot take a weight, the GEMV (in passes) up to this many rows
EXPERTS_GEMV_MAX_TOKENS = 8  # experts(): the grouped GEMV up to this many tokens, the grouped GEMMs above
KERNELS = "the FP8 / FP4 kernels"
FP8_GEMM_ENV = "ENGRAM_TRT_FP8_GEMM"  # "ours": never torch._scaled_mm; unset / "auto": the rule above

log = logging.getLogger(__name__)
_SCALED_MM_REFUSED: dict[tuple, str] = {}  # (device index, N, K, out dtype) -> torch's refusal, asked once
_SCALED_MM_LOCK = threading.Lock()


@dataclass
class MoePlan:
    """A routed step's plan (device int32 tensors, engram_moe_plan): rows of expert e are
    ``offsets[e] .. offsets[e+1]-1`` of the pairs sorted by expert; ``order[r]`` the pair
    ``t * k + j`` at row r, ``row_token[r]`` its token, ``pair_row`` the inverse of order,
    ``slot_expert`` the active experts then -1; ``error [1]`` 1 when an id was outside
    ``[0, E)`` (such a pair contributes nothing)."""

    offsets: Any
    order: Any
    row_token: Any
    pair_row: Any
    slot_expert: Any
    error: Any
    num_experts: int
    num_tokens: int
    top_k: int


def moe_plan(ids: Any, num_experts: int) -> MoePlan:
    """The plan of ``ids [T, k]`` (int32 / int64, CUDA) over ``num_experts`` experts."""
    p = qk.plan(ids, num_experts)
    return MoePlan(
        p["offsets"],
        p["order"],
        p["row_token"],
        p["pair_row"],
        p["slot_expert"],
        p["error"],
        int(num_experts),
        int(ids.shape[0]),
        int(ids.shape[1]),
    )


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return tuple(torch_module().cuda.get_device_capability(index))  # type: ignore[return-value]


def _device_index(device: Any) -> int:
    return device.index if device.index is not None else torch_module().cuda.current_device()


def _weight(name: str, w: Any, stacked: bool) -> qk.Weight:
    """A QuantWeight (fields data / scale / kind / block) or, stacked, a bf16 tensor, as the
    kernels take it; EngramError naming what is wrong."""
    torch = torch_module()
    if isinstance(w, torch.Tensor):
        if not stacked:
            raise EngramError(f"{name} must be a QuantWeight (got a tensor: use F.linear)")
        if w.dtype != torch.bfloat16:
            raise EngramError(
                f"{name} is a {w.dtype} tensor stack; the expert kernels take bfloat16 stacks or "
                f"QuantWeights (fp8 / fp4)"
            )
        return qk.make_weight(name, w, None, "bf16", (1, 1), True)
    for field in ("data", "scale", "kind", "block"):
        if not hasattr(w, field):
            raise EngramError(f"{name} must be a QuantWeight (got {type(w).__name__})")
    return qk.make_weight(name, w.data, w.scale, w.kind, tuple(w.block), stacked)


def _gemv_reason(w: qk.Weight) -> str | None:
    vpv = qk.VALUES_PER_VECTOR[w.kind]
    if w.in_features % vpv:
        return f"the GEMV needs in_features a multiple of {vpv} for {w.kind} weights (got {w.in_features})"
    if w.kind != "bf16" and w.block[1] % vpv:
        return f"the GEMV needs the block's bk a multiple of {vpv} for {w.kind} weights (got {w.block[1]})"
    return None


def _gemm_reason(w: qk.Weight, device: Any) -> str | None:
    major, minor = _capability(_device_index(device))
    if w.kind == "fp8":
        if (major, minor) < (8, 9):
            return f"the FP8 tensor cores need compute capability 8.9+ (this GPU is {major}.{minor})"
        if w.block[1] != qk.GEMM_BLOCK_K:
            return f"the FP8 GEMM needs weight blocks of bk = 128 (got {w.block[0]}x{w.block[1]})"
        if w.in_features % 16:
            return f"the FP8 GEMM needs in_features a multiple of 16 (got {w.in_features})"
        return None
    if major < 8:
        return f"the bf16 tensor cores need compute capability 8.0+ (this GPU is {major}.{minor})"
    if w.kind == "fp4":
        if w.scale_type != qk.QSCALE_UE8M0:
            return "the FP4 GEMM needs ue8m0 scales (a float32 scale times e2m1 is not exact in bf16)"
        if w.in_features % 32 or w.block[1] % 32:
            return f"the FP4 GEMM needs in_features and bk multiples of 32 (got {w.in_features}, {w.block[1]})"
    elif w.in_features % 8:
        return f"the bf16 GEMM needs in_features a multiple of 8 (got {w.in_features})"
    return None


def _route(rows: int, w: qk.Weight, device: Any, gemv_max: int) -> str:
    """'gemv' or 'gemm' for ``rows`` rows of ``w``, or EngramError naming why neither."""
    gemv_why = _gemv_reason(w)
    if rows <= gemv_max and gemv_why is None:
        return "gemv"
    gemm_why = _gemm_reason(w, device)
    if gemm_why is None:
        return "gemm"
    if gemv_why is None and rows <= GEMV_PASSES_MAX_ROWS:
        return "gemv"
    raise EngramError(f"{KERNELS} cannot take {rows} rows: {gemm_why if gemv_why is None else gemv_why}")


def _check_placement(x: Any, w: qk.Weight, name: str) -> None:
    for what, t in ((f"{name} data", w.data), (f"{name} scale", w.scale)):
        if t is None:
            continue
        if t.device != x.device:
            raise EngramError(f"{what} is on {t.device} but x is on {x.device}")
        if not t.is_contiguous():
            raise EngramError(f"{what} must be contiguous")
    if w.data.data_ptr() % 16:
        raise EngramError(f"{name} data must be 16-byte aligned (a view at an odd offset: .clone() it)")


def unavailable_for(x: Any, qw: Any) -> str | None:
    """Why :func:`linear` cannot run ``x @ qw^T`` (one line), or None when it can."""
    torch = torch_module()
    if not isinstance(x, torch.Tensor):
        return f"x must be a torch.Tensor (got {type(x).__name__})"
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"x has dtype {x.dtype}; the kernels take bfloat16, float16 or float32 activations"
    try:
        w = _weight("weight", qw, stacked=False)
        if x.dim() == 0 or int(x.shape[-1]) != w.in_features:
            return f"x has shape {tuple(x.shape)} but the weight takes {w.in_features} features"
        if not x.is_cuda:
            return f"x is on {x.device}, not a CUDA device"
        why = qk.unavailable(KERNELS)
        if why is not None:
            return why
        _check_placement(x, w, "weight")
        _route(x.numel() // max(w.in_features, 1), w, x.device, LINEAR_GEMV_MAX_ROWS)
    except EngramError as exc:
        return str(exc)
    return None


def _quantized_input(x2: Any, kind: str, route: str) -> dict[str, Any]:
    """The activations of ``x2 [M, K]`` as a ``kind`` weight's product on ``route`` takes
    them: ``a`` (GEMV: float32, or bf16 when exact; bf16 GEMM) or ``q`` / ``scale`` (FP8
    GEMM)."""
    torch = torch_module()
    if kind == "bf16":
        if route == "gemv":
            return {"a": x2 if x2.dtype in (torch.float32, torch.bfloat16) else x2.float()}
        return {"a": x2.to(torch.bfloat16)}
    group, ue8m0 = ACT_QUANT[kind]
    if kind == "fp8" and route == "gemm":
        q, s, _ = qk.act_quant(x2, group, ue8m0)
        return {"q": q, "scale": s}
    deq = torch.bfloat16 if ue8m0 else torch.float32  # ue8m0: e4m3 * 2^k is exact in bf16
    return {"a": qk.act_quant(x2, group, ue8m0, q=False, scale=False, deq_dtype=deq)[2]}


def _gemv_quantizes(x2: Any, w: qk.Weight) -> bool:
    """True when the GEMV can quantize ``x2 [M, K]`` itself (ENGRAM_QGEMV_ACT_*: the same
    bits as act_quant's deq, one launch fewer): an fp8 / fp4 weight, float32 / bf16 rows
    16-byte aligned, K <= GEMV_ACT_QUANT_MAX_K."""
    torch = torch_module()
    if w.kind not in ACT_QUANT or ACT_QUANT[w.kind] not in qk.QGEMV_ACT_QUANT:
        return False
    if x2.dtype not in (torch.float32, torch.bfloat16) or w.in_features > qk.GEMV_ACT_QUANT_MAX_K:
        return False
    return x2.stride(1) == 1 and (x2.stride(0) * x2.element_size()) % 16 == 0 and x2.data_ptr() % 16 == 0


def _product(act: dict[str, Any], w: qk.Weight, route: str, out: Any, **rows: Any) -> None:
    if route == "gemv":
        qk.gemv(act["a"], w, out, **rows)
    elif w.kind == "fp8":
        rows.pop("slot_expert", None)
        qk.fp8_gemm(act["q"], act["scale"], w, out, **rows)
    else:
        rows.pop("slot_expert", None)
        qk.grouped_gemm(act["a"], w, out, **rows)


def scaled_mm_reason(w: qk.Weight, device: Any, out_dtype: Any = None) -> str | None:
    """Why ``torch._scaled_mm`` (block-wise FP8) cannot take the GEMM rows of ``w`` (None:
    :func:`linear` routes them there): the rule of the module docstring."""
    torch = torch_module()
    if os.environ.get(FP8_GEMM_ENV, "auto") == "ours":
        return f"{FP8_GEMM_ENV}=ours"
    if w.kind != "fp8" or w.experts != 1:
        return "torch._scaled_mm takes one fp8 weight"
    if tuple(w.block) != (128, 128):
        return f"torch._scaled_mm's block-wise scales are 128x128 (got {w.block[0]}x{w.block[1]})"
    if w.out_features % 128 or w.in_features % 128:
        return (
            f"torch._scaled_mm's block-wise route is taken for N and K multiples of 128 (got "
            f"{w.out_features}, {w.in_features})"
        )
    if not hasattr(torch, "_scaled_mm"):
        return "this torch has no _scaled_mm"
    major, minor = _capability(_device_index(device))
    if major != 9:
        return f"torch._scaled_mm's block-wise FP8 is taken on compute capability 9.x (this GPU is {major}.{minor})"
    key = (_device_index(device), w.out_features, w.in_features, str(out_dtype))
    return _SCALED_MM_REFUSED.get(key)


def _weight_scale_f32(w: qk.Weight) -> Any:
    """The weight's scales ``[N/128, K/128]`` as float32 (ue8m0 bytes exactly 2^(b - 127))."""
    torch = torch_module()
    s = w.scale.reshape(w.scale.shape[-2], w.scale.shape[-1])
    if s.dtype == torch.float32:
        return s
    return s.view(torch.float8_e8m0fnu).float()


def _scaled_mm(q: Any, a_scale: Any, w: qk.Weight, out_dtype: Any) -> Any | None:
    """``torch._scaled_mm`` of the quantized activations ``q [M, K]`` / ``a_scale [M, K/128]``
    and the FP8 weight, ``[M, N]`` of out_dtype; None when torch refuses the call (recorded:
    that shape keeps our GEMM). Scale layouts as torch's checks take them: the activations'
    ``[M, K/128]`` with stride ``(1, M)``, the weight's ``[K/128, N/128]`` with stride
    ``(1, K/128)`` (the stored ``[N/128, K/128]`` transposed; a torch that pads the K
    blocks to a multiple of 4 gets that layout instead)."""
    torch = torch_module()
    key = (_device_index(q.device), w.out_features, w.in_features, str(out_dtype))
    data = w.data if w.data.dtype == torch.float8_e4m3fn else w.data.view(torch.float8_e4m3fn)
    b = data.reshape(w.out_features, w.in_features).t()  # [K, N], column-major: the stored rows
    sa = a_scale.t().contiguous().t()
    ws = _weight_scale_f32(w)
    kb = ws.shape[1]
    layouts = [ws.t()]
    if kb % 4:
        padded = torch.zeros((ws.shape[0], -(-kb // 4) * 4), dtype=torch.float32, device=ws.device)
        padded[:, :kb] = ws
        layouts.append(padded[:, :kb].t())
    errors = []
    for sb in layouts:
        try:
            return torch._scaled_mm(q, b, sa, sb, out_dtype=out_dtype)
        except (RuntimeError, TypeError, ValueError) as exc:  # this torch / cuBLASLt does not take it
            errors.append(str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__)
    with _SCALED_MM_LOCK:
        if key not in _SCALED_MM_REFUSED:
            _SCALED_MM_REFUSED[key] = "torch._scaled_mm refused it: " + "; ".join(errors)
            log.info(
                "FP8 GEMM [%d, %d] %s: %s; using engram_fp8_gemm",
                w.out_features,
                w.in_features,
                out_dtype,
                _SCALED_MM_REFUSED[key],
            )
    return None


def linear(x: Any, qw: Any, *, weight_static: bool = False) -> Any:
    """``x @ W^T`` ``[..., N]`` in x's dtype for a stored weight ``qw`` (module docstring).
    ``weight_static``: nothing queued on the stream before this call writes ``qw`` (a
    model's weights): the GEMV may start loading it while the kernel before it runs."""
    torch = torch_module()
    why = unavailable_for(x, qw)
    if why is not None:
        raise EngramError(f"quantized linear cannot run on the kernels: {why}")
    w = _weight("weight", qw, stacked=False)
    K, N = w.in_features, w.out_features
    x2 = x.reshape(-1, K)
    if x2.stride(1) != 1 or x2.stride(0) < K:  # (an expanded x repeats its rows: stride 0)
        x2 = x2.contiguous()
    M = int(x2.shape[0])
    route = _route(M, w, x.device, LINEAR_GEMV_MAX_ROWS) if M else "gemv"
    if M and route == "gemm" and scaled_mm_reason(w, x.device, x.dtype) is None:
        act = _quantized_input(x2, w.kind, route)
        y = _scaled_mm(act["q"], act["scale"], w, x.dtype)
        if y is not None:
            return y.view(*x.shape[:-1], N)
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
        _product(act, w, route, out)
        return out.view(*x.shape[:-1], N)
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M:
        if route == "gemv" and _gemv_quantizes(x2, w):
            # the GEMV quantizes x itself: the same bits, one launch fewer
            qk.gemv(x2, w, out, weight_static=weight_static, act_quant=ACT_QUANT[w.kind])
        elif route == "gemv":
            qk.gemv(_quantized_input(x2, w.kind, route)["a"], w, out, weight_static=weight_static)
        else:
            _product(_quantized_input(x2, w.kind, route), w, route, out)
    return out.view(*x.shape[:-1], N)


def _expert_weights(gate: Any, up: Any, down: Any) -> tuple[qk.Weight, qk.Weight, qk.Weight]:
    g, u, d = _weight("gate", gate, True), _weight("up", up, True), _weight("down", down, True)
    if g.kind != u.kind or g.block != u.block:
        raise EngramError(
            f"gate and up must share a kind and block (got {g.kind} {list(g.block)}, {u.kind} {list(u.block)})"
        )
    if (u.experts, u.out_features, u.in_features) != (g.experts, g.out_features, g.in_features):
        raise EngramError(
            f"up is [{u.experts}, {u.out_features}, {u.in_features}] but gate is "
            f"[{g.experts}, {g.out_features}, {g.in_features}]"
        )
    if (d.experts, d.out_features, d.in_features) != (g.experts, g.in_features, g.out_features):
        raise EngramError(
            f"down must be [E, D, I] = [{g.experts}, {g.in_features}, {g.out_features}] (got "
            f"[{d.experts}, {d.out_features}, {d.in_features}])"
        )
    return g, u, d


def unavailable_for_experts(x: Any, ids: Any, gate: Any, up: Any, down: Any) -> str | None:
    """Why :func:`experts` cannot run these weights on ``x [T, D]`` (one line), or None."""
    torch = torch_module()
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return "x must be a bfloat16, float16 or float32 tensor"
    try:
        g, u, d = _expert_weights(gate, up, down)
        if x.dim() != 2 or int(x.shape[1]) != g.in_features:
            return f"x must be [T, {g.in_features}] (got shape {tuple(x.shape)})"
        if g.experts > qk.PLAN_MAX_EXPERTS:
            return f"{g.experts} experts; the plan takes at most {qk.PLAN_MAX_EXPERTS}"
        if not x.is_cuda:
            return f"x is on {x.device}, not a CUDA device"
        why = qk.unavailable(KERNELS)
        if why is not None:
            return why
        for name, w in (("gate", g), ("up", u), ("down", d)):
            _check_placement(x, w, name)
            rows = int(ids.numel()) if isinstance(ids, torch.Tensor) else 0
            _route(rows, w, x.device, _experts_gemv_rows(int(x.shape[0]), rows))
    except EngramError as exc:
        return str(exc)
    return None


def _experts_gemv_rows(tokens: int, pairs: int) -> int:
    """The GEMV's row bound for a routed step: all its pairs while the step has up to
    EXPERTS_GEMV_MAX_TOKENS tokens (each expert then has at most that many rows), else none."""
    return pairs if tokens <= EXPERTS_GEMV_MAX_TOKENS else 0


def experts(
    x: Any, ids: Any, route_w: Any, gate: Any, up: Any, down: Any, *, limit: float | None, plan: MoePlan | None = None
) -> Any:
    """The routed experts' output ``[T, D]`` in x's dtype: ``sum_j route_w[t, j] *
    down_e(silu(min(g, l)) * clamp(u, -l, l))`` with ``g, u = gate_e x, up_e x``, e = ids[t, j]
    (module docstring). ``gate`` / ``up`` ``[E, I, D]`` and ``down`` ``[E, D, I]``:
    QuantWeight stacks or bf16 tensors; ``limit`` None or 0: no clamp."""
    torch = torch_module()
    why = unavailable_for_experts(x, ids, gate, up, down)
    if why is not None:
        raise EngramError(f"experts cannot run on the kernels: {why}")
    g, u, d = _expert_weights(gate, up, down)
    E, I, D = g.experts, g.out_features, g.in_features
    check("ids", ids, (torch.int32, torch.int64), 2)
    check("route_w", route_w, (torch.float32,), 2)
    T, k = int(ids.shape[0]), int(ids.shape[1])
    if int(x.shape[0]) != T or tuple(route_w.shape) != (T, k):
        raise EngramError(
            f"x [T, D], ids [T, k] and route_w [T, k] disagree: {tuple(x.shape)}, {tuple(ids.shape)}, "
            f"{tuple(route_w.shape)}"
        )
    if plan is None:
        plan = moe_plan(ids, E)
    elif (plan.num_experts, plan.num_tokens, plan.top_k) != (E, T, k):
        raise EngramError(
            f"plan is for [{plan.num_tokens}, {plan.top_k}] ids over {plan.num_experts} experts, not "
            f"[{T}, {k}] over {E}"
        )
    P = T * k
    if P == 0:
        return torch.zeros((T, D), dtype=x.dtype, device=x.device)
    gemv_max = _experts_gemv_rows(T, P)
    # one expert: every row is its (the kernels take no offsets then)
    rows = {"offsets": plan.offsets, "slot_expert": plan.slot_expert} if E > 1 else {}
    # the GEMV / GEMM may read x itself (bf16 weights): rows 16-byte aligned
    x2 = x if x.stride(1) == 1 and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0 else x.contiguous()
    # gate and up into the two halves of one float32 buffer
    gate_up = torch.empty((P, 2 * I), dtype=torch.float32, device=x.device)
    route = _route(P, g, x.device, gemv_max)
    if route == "gemv" and _gemv_quantizes(x2, g):  # each GEMV quantizes x itself: the same bits, no act_quant
        for w_, cols in ((g, slice(None, I)), (u, slice(I, None))):
            qk.gemv(x2, w_, gate_up[:, cols], row_index=plan.row_token, act_quant=ACT_QUANT[g.kind], **rows)
    else:
        act = _quantized_input(x2, g.kind, route)
        _product(act, g, route, gate_up[:, :I], row_index=plan.row_token, **rows)
        _product(act, u, route, gate_up[:, I:], row_index=plan.row_token, **rows)
    # the clamped SwiGLU, quantized as the down projection takes it
    route = _route(P, d, x.device, gemv_max)
    group, ue8m0 = ACT_QUANT.get(d.kind, (0, False))
    if d.kind == "fp8" and route == "gemm":
        hq, hs, _ = qk.swiglu_act_quant(gate_up, limit, group, ue8m0)
        act = {"q": hq, "scale": hs}
    else:
        exact_bf16 = d.kind == "fp4" or (d.kind == "bf16" and route == "gemm")
        deq = torch.bfloat16 if exact_bf16 else torch.float32
        act = {"a": qk.swiglu_act_quant(gate_up, limit, group, ue8m0, q=False, scale=False, deq_dtype=deq)[2]}
    y_rows = torch.zeros((P, D), dtype=torch.float32, device=x.device)  # rows of no expert stay 0
    _product(act, d, route, y_rows, **rows)
    # combine: each pair's row gathered back, weighted, summed over its token's k picks
    valid = (ids >= 0) & (ids < E)
    weights = torch.where(valid, route_w, torch.zeros((), dtype=route_w.dtype, device=x.device))
    y_pair = y_rows.index_select(0, plan.pair_row.long()).view(T, k, D)
    return (y_pair * weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)
