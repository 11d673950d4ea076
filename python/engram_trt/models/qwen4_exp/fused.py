"""The bf16 CUDA path of a Qwen4Exp decode step's glue: the MoE and the hyper-connections'
mix in a few launches of the kernel library (:mod:`engram_trt.native.decode`) instead of
the PyTorch forms' dozens of small kernels, which left a graphed decode step at 7.6x its
weight-read floor (issue 41: the MoE 120 us a layer, a mix 43 us).

* MoE (:func:`moe`, :class:`~.modules.SparseMoE`): ONE GEMV launch for the router's logits
  and the shared expert's gate logit side by side, one for the picks and weights
  (``moe_route``: the float32 softmax, top-k, renormalized when ``norm_topk_prob``), two
  for the routed experts with the sigmoid-gated shared expert (``moe_experts``; the
  experts' down weights read where :meth:`~.modules.SparseMoE.stack_experts` put them, the
  ``[D, E * I]`` stack). The kernels round where the module's per-expert form rounds
  (each expert's output weighted in bf16 and added in ascending expert id, then the
  shared expert's), so this path differs from it by float32 sums' order only
  (tests/gpu/test_qwen4_fused.py holds it to the module).

* Hyper-connection mix (:func:`mix`, :class:`~.modules.GatedResidual`): the grouped norm
  (one launch, :class:`~.norms.OffsetRMSNorm`), ONE GEMV launch for the low-rank gate's
  down product and the block-inject product of the normed streams, and ONE launch
  (``hc_mix``) for the gate's up product with its sigmoid, the streams' weighted mean and
  the injection weights: three launches where the PyTorch form takes about twelve.

* Projections (:func:`project`): the bias-free bf16 linears of one input in one GEMV launch
  (a Gated DeltaNet layer's four input projections, its output projection).

* Gated DeltaNet gates and output norm (:func:`gdn_gates`, :func:`gated_norm`): ``beta =
  sigmoid(b).float()`` and ``g = -exp(A_log) * softplus(a.float() + dt_bias.float())`` in
  ONE launch (``gdn_gates``) where the PyTorch ops take about seven, and the gated RMSNorm
  of the core's output (:class:`~.norms.GatedRMSNorm`) in ONE launch (``gated_norm``)
  where they take about twelve; both with the module's float32 ops and bf16 roundings
  (decodeKernels.h; the norm's sum of squares in its own order; tests/gpu/test_qwen4_fused.py
  holds them to the ops they replace). ``ENGRAM_TRT_QWEN4_GDN_GLUE=0`` (:data:`GDN_GLUE_ENV`)
  runs the PyTorch ops instead (an A/B switch).

Served: bf16 activations and weights (plain ``nn.Linear`` and the stacked experts) of 1 to
``GEMV_EX_MAX_TOKENS`` tokens (the Gated DeltaNet gates and norm: ``GDN_GLUE_MAX_TOKENS``,
16) on a GPU of compute capability 9.0+, all experts on this rank. Otherwise (a prefill
chunk, FP8 experts, a tensor-parallel rank, float32 models, CPUs,
``ENGRAM_TRT_QWEN4_FUSED=0``: the A/B switch) the module's own forms run.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor, nn

FUSED_ENV = "ENGRAM_TRT_QWEN4_FUSED"
GDN_GLUE_ENV = "ENGRAM_TRT_QWEN4_GDN_GLUE"  # "0": the Gated DeltaNet gates / norm as PyTorch ops (A/B)


def gdn_glue_on() -> bool:
    """Whether :func:`gdn_gates` / :func:`gated_norm` may serve (``ENGRAM_TRT_QWEN4_GDN_GLUE`` not ``0``)."""
    return os.environ.get(GDN_GLUE_ENV, "1") != "0"


def unavailable(x: Tensor) -> str | None:
    """Why the fused glue does not take activations like ``x`` (None: it does;
    :func:`engram_trt.native.decode.glue_unavailable` with ``ENGRAM_TRT_QWEN4_FUSED``)."""
    from engram_trt.native import decode

    return decode.glue_unavailable(x, FUSED_ENV)


def _plain(mod: Any, x: Tensor) -> bool:
    """A bias-free ``nn.Linear`` with a contiguous weight of ``x``'s dtype."""
    return type(mod) is nn.Linear and mod.bias is None and mod.weight.dtype == x.dtype and mod.weight.is_contiguous()


def project(x: Tensor, mods: list[Any]) -> list[Tensor] | None:
    """``[m(x) for m in mods]`` (bias-free bf16 ``nn.Linear``s of one input) in one GEMV
    launch, or None where the GEMV does not serve them (the caller runs the modules)."""
    if unavailable(x) is not None or x.dim() != 2:
        return None
    from engram_trt.native import decode

    if len(mods) > decode.MAX_SEGMENTS or not all(_plain(m, x) and decode.gemv_fits(x, m.weight) for m in mods):
        return None
    outs = [torch.empty((x.shape[0], m.weight.shape[0]), dtype=x.dtype, device=x.device) for m in mods]
    decode.gemv_segments([(x, m.weight, o) for m, o in zip(mods, outs)])
    return outs


def gdn_gates(b: Tensor, a: Tensor, dt_bias: Tensor, neg_decay: Tensor) -> tuple[Tensor, Tensor] | None:
    """``(beta, g)`` float32 ``[T, Hv]`` of a Gated DeltaNet decode step (``sigmoid(b).float()``,
    ``neg_decay * softplus(a.float() + dt_bias.float())``) in one launch, or None where the
    kernel does not serve them (the caller runs the PyTorch ops; off unless :func:`gdn_glue_on`)."""
    if not gdn_glue_on() or unavailable(b) is not None or b.dim() != 2 or a.dim() != 2 or a.dtype != b.dtype:
        return None
    from engram_trt.native import decode

    T, H = int(b.shape[0]), int(b.shape[1])
    if not 1 <= T <= decode.GDN_GLUE_MAX_TOKENS or H > decode.GDN_GLUE_MAX_HEADS or tuple(a.shape) != (T, H):
        return None
    if b.stride(1) != 1 or a.stride(1) != 1 or dt_bias.dtype not in (b.dtype, torch.float32):
        return None
    if neg_decay.dtype != torch.float32 or neg_decay.device != b.device or dt_bias.device != b.device:
        return None
    if not (dt_bias.is_contiguous() and neg_decay.is_contiguous()):
        return None
    if tuple(dt_bias.shape) != (H,) or tuple(neg_decay.shape) != (H,):
        return None
    return decode.gdn_gates(b, a, dt_bias, neg_decay)


def gated_norm(norm: Any, x: Tensor, gate: Tensor, heads: int) -> Tensor | None:
    """``norm(x.to(gate.dtype).reshape(-1, dim), gate.reshape(-1, dim))`` reshaped to ``[T,
    heads * dim]`` (a :class:`~.norms.GatedRMSNorm`, ``x`` the core's ``[T, heads, dim]`` in
    bf16 or float32, ``gate [T, heads * dim]``) in one launch, or None where the kernel does
    not serve it (the caller runs the module; off unless :func:`gdn_glue_on`)."""
    if not gdn_glue_on() or unavailable(gate) is not None or gate.dim() != 2 or gate.stride(1) != 1:
        return None
    from engram_trt.native import decode

    T, dim = int(gate.shape[0]), int(norm.weight.shape[0])
    weight = norm.weight
    if (
        not 1 <= T <= decode.GDN_GLUE_MAX_TOKENS
        or not 1 <= heads <= decode.GDN_GLUE_MAX_HEADS
        or norm.activation not in decode.GATE_ACTIVATIONS
        or weight.dtype != gate.dtype
        or not weight.is_contiguous()
        or weight.device != gate.device
        or x.dtype not in (gate.dtype, torch.float32)
        or x.device != gate.device
        or x.numel() != T * heads * dim
        or int(gate.shape[1]) != heads * dim
    ):
        return None
    rows = x.reshape(T, heads * dim)
    if rows.stride(1) != 1:
        return None
    return decode.gated_norm(rows, gate, weight, heads=heads, eps=norm.eps, activation=norm.activation)


def moe(mlp: Any, x: Tensor) -> Tensor | None:
    """``mlp(x)`` (a :class:`~.modules.SparseMoE`, routed experts plus the gated shared
    expert) on the fused kernels, or None where they do not serve it (the caller takes the
    module's forms)."""
    if unavailable(x) is not None or mlp.expert_range is not None:
        return None
    from engram_trt.native import decode

    T = int(x.shape[0]) if x.dim() == 2 else 0
    if not 1 <= T <= min(decode.GEMV_EX_MAX_TOKENS, decode.MOE_MAX_TOKENS) or not x.is_contiguous():
        return None
    E, k = len(mlp.experts), int(mlp.top_k)
    if E > decode.MOE_MAX_EXPERTS or k > decode.MOE_MAX_TOP_K:
        return None
    gate, up, down, inter = mlp._stacks()
    if not all(
        isinstance(w, Tensor) and w.dtype == x.dtype and w.is_contiguous() and w.data_ptr() % 16 == 0
        for w in (gate, up, down)
    ):
        return None  # FP8 experts: native.quant.experts, the module's sync-free form
    shared = mlp.shared_expert
    projections = (mlp.gate, mlp.shared_expert_gate, shared.gate_proj, shared.up_proj, shared.down_proj)
    if not all(_plain(m, x) for m in projections):
        return None
    D = int(x.shape[1])
    shared_inter = int(shared.gate_proj.weight.shape[0])
    if inter % 8 or shared_inter % 8 or not decode.gemv_fits(x, mlp.gate.weight):
        return None  # the experts kernel reads 16-byte vectors of D, I and I_s
    if int(mlp.shared_expert_gate.weight.shape[0]) != 1:
        return None
    # the router's E logits and the shared expert's gate logit, one GEMV launch
    logits = torch.empty((T, E + 1), dtype=x.dtype, device=x.device)
    decode.gemv_segments(
        [(x, mlp.gate.weight, logits[:, :E]), (x, mlp.shared_expert_gate.weight, logits[:, E:])],
    )
    ids, weights = decode.moe_route(
        logits[:, :E], top_k=k, score_fn="softmax" if mlp.norm_topk_prob else "softmax_topk", scaling=1.0
    )
    return decode.moe_experts(
        x,
        ids,
        weights,
        gate.view(E, inter, D),
        up.view(E, inter, D),
        down,
        shared=(shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight),
        limit=None,
        shared_scale=logits[:, E:],
    )


def mix(conn: Any, streams: Tensor) -> tuple[Tensor, Tensor | None] | None:
    """``conn.mix(streams)`` (a :class:`~.modules.GatedResidual`: the sublayer input
    ``[T, hidden]`` and the injection weights ``[T, hc]`` or None) on the fused kernels, or
    None where they do not serve it."""
    if unavailable(streams) is not None or streams.dim() != 2 or not streams.is_contiguous():
        return None
    from engram_trt.native import decode

    T = int(streams.shape[0])
    down, up, inject = conn.input_mix_weight_down, conn.input_mix_weight_up, conn.block_inject_weight
    rank, hc = int(down.weight.shape[0]), int(conn.hc)
    if (
        not 1 <= T <= min(decode.GEMV_EX_MAX_TOKENS, decode.HC_MIX_MAX_TOKENS)
        or T * rank > decode.HC_MIX_MAX_ELEMENTS
        or rank % 8
        or hc > 16
        or not all(_plain(m, streams) for m in (down, up) + ((inject,) if inject is not None else ()))
        or not decode.gemv_fits(streams, down.weight)
    ):
        return None
    normed = conn.hc_norm(streams)  # the grouped norm's one launch (OffsetRMSNorm.forward_kernel)
    z = torch.empty((T, rank), dtype=streams.dtype, device=streams.device)
    segments = [(normed, down.weight, z)]
    logits = None
    if inject is not None:
        logits = torch.empty((T, hc), dtype=streams.dtype, device=streams.device)
        segments.append((normed, inject.weight, logits))
    decode.gemv_segments(segments)
    return decode.hc_mix(z, up.weight, normed, logits, hc=hc)


__all__ = [
    "FUSED_ENV",
    "GDN_GLUE_ENV",
    "gated_norm",
    "gdn_gates",
    "gdn_glue_on",
    "mix",
    "moe",
    "project",
    "unavailable",
]
