"""The ``kernels`` backend of :class:`~.attention.DeepseekV4Attention`: the attention core
(compressors streaming into per-slot entries, the CSA indexer's top-k, the sliding
window and the sink softmax, every state updated in place) as ONE call of the kernel
library's ``engram_dsv4_attention`` (plugins/kernels/dsv4AttentionKernel.cu, the math of
the EngramDsv4Attention plugin; binding :mod:`engram_trt.native.dsv4_attention`).

Why: the torch path runs each sequence of a step through some forty small launches per
layer (masks, rings, pooled windows, top-k, softmax); on a GPU that is host-bound. The
kernel takes the step's packed tokens and its int32 ``seq_starts / past_lens / slots``
on the device, so a decode step costs the projections plus one library call per layer
and no host synchronization. The per-slot state is the torch path's own
(:meth:`DeepseekV4Attention.state_shapes` is exactly the node's layout), so the two
backends share one :class:`~.state.DeepseekV4State` and can be swapped between steps.

Backends, as Qwen4Exp's PLE fusion chooses them (``DeepseekV4Attention.backend``, a class
default settable per layer or through ``DeepseekV4Model.attention_backend``): ``auto``
(the kernel on the CUDA tensors it takes, else the torch path), ``kernels`` (the kernel
or an EngramError saying why not), ``torch``.

What the kernel does differently (plugins/engramDsv4AttentionPlugin/README.md): exact
ties at the CSA indexer's top-k cut go to the LOWER entry index (torch's ``topk``
has no rule); otherwise it equals the torch path within float32 round-off (fp32 state)
or bf16 round-off.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from engram_trt.errors import EngramError

ATTENTION_BACKENDS = ("auto", "kernels", "torch")
_TYPE_CODE = {"sliding_attention": 0, "compressed_sparse_attention": 1, "heavily_compressed_attention": 2}
_ACTS = (torch.bfloat16, torch.float16, torch.float32)
_MAX_HEAD_DIM = 512  # engramKernels.h ENGRAM_DSV4_MAX_HEAD_DIM
_MAX_INDEX_DIM = 256


def library_unavailable() -> str | None:
    """Why the kernel library cannot serve the attention (None: it can), asked once."""
    from engram_trt.native import dsv4_attention as native

    return native.unavailable("DeepSeek-V4 attention CUDA kernel")


def check_backend(backend: str) -> str:
    if backend not in ATTENTION_BACKENDS:
        raise EngramError(
            f"attention backend {backend!r} is not one of {list(ATTENTION_BACKENDS)}; use auto, kernels or torch"
        )
    return backend


def why_not_kernel(layer: Any, x: Tensor, state: dict[str, Tensor] | None) -> str | None:
    """Why ``layer`` cannot run on the kernel for activations like ``x`` and ``state``
    (None: it can). ``state`` None asks only what the layer and ``x`` decide."""
    if not x.is_cuda:
        return f"the activations are on {x.device}, not a CUDA device"
    if x.dtype not in _ACTS:
        return f"the activations are {x.dtype}, not bfloat16, float16 or float32"
    if layer.head_dim > _MAX_HEAD_DIM:
        return f"head_dim {layer.head_dim} exceeds the kernel's {_MAX_HEAD_DIM}"
    comp = layer.compressor
    indexer = comp.indexer if comp is not None else None
    if indexer is not None and indexer.dim > _MAX_INDEX_DIM:
        return f"index_head_dim {indexer.dim} exceeds the kernel's {_MAX_INDEX_DIM}"
    if state is not None:
        bad = [k for k, t in state.items() if t.dtype != x.dtype or not t.is_cuda or not t.is_contiguous()]
        if bad:
            t = state[bad[0]]
            return (
                f"state[{bad[0]!r}] is {t.dtype} on {t.device}; the kernel wants contiguous CUDA state in the "
                f"activations' dtype {x.dtype}"
            )
    return library_unavailable()


def kernel_serves(layer: Any, x: Tensor, state: dict[str, Tensor] | None) -> bool:
    """Whether the layer's ``forward`` takes the kernel (see the module docstring)."""
    backend = check_backend(layer.backend)
    if backend == "torch":
        return False
    why = why_not_kernel(layer, x, state)
    if why is not None and backend == "kernels":
        raise EngramError(
            f"attention backend 'kernels' cannot run layer {layer.layer_idx}: {why}; use backend 'auto' or 'torch'"
        )
    return why is None


def step_meta(seq_starts: Sequence[int], past_lens: Sequence[int], slots: Sequence[int], device: Any) -> Tensor:
    """``[seq_starts (S+1), past_lens (S), slots (S)]`` int32 on ``device``: the kernel's
    step description (the model builds it once per step from its uploaded arrays)."""
    return torch.tensor([*seq_starts, *past_lens, *slots], dtype=torch.int32).to(device)


def core(
    layer: Any,
    x: Tensor,
    q: Tensor,
    kv: Tensor,
    q_residual: Tensor | None,
    cos: Tensor,
    sin: Tensor,
    n_seqs: int,
    meta: Tensor,
    state: dict[str, Tensor],
    *,
    pre: dict[str, Tensor] | None = None,
) -> Tensor:
    """The attention core's output ``[T, H, d]`` (before the inverse RoPE) through one
    library call, ``state`` updated in place. ``meta`` as :func:`step_meta`. ``pre``: the
    compressor's / indexer's inputs already made (:mod:`.fused`: ``c_kv``, ``c_gate``,
    ``i_q``, ``i_w``, ``i_kv``, ``i_gate``); the rest are made here. ``q_residual`` (the
    normalized q_a) is read only for the indexer's queries, so None where ``pre`` holds them."""
    from engram_trt.native.dsv4_attention import dsv4_attention

    pre = pre or {}
    S = n_seqs
    inputs = [
        q.contiguous(),
        kv.contiguous(),
        layer.sinks.float().contiguous(),
        meta[: S + 1],
        meta[S + 1 : 2 * S + 1],
        meta[2 * S + 1 : 3 * S + 1],
        state["window_kv"],
    ]
    comp = layer.compressor
    if comp is not None:
        c_kv = pre["c_kv"] if "c_kv" in pre else comp.kv_proj(x)
        c_gate = pre["c_gate"] if "c_gate" in pre else comp.gate_proj(x)
        inputs += [
            c_kv,
            c_gate,
            comp.position_bias.float().contiguous(),
            comp.kv_norm.weight.float().contiguous(),
            layer.rope.inv_freq_on(x.device),
            state["compressed_kv"],
            state["compressor_kv"],
            state["compressor_gate"],
        ]
        ix = comp.indexer
        if ix is not None:
            i_q, i_w = (pre["i_q"], pre["i_w"]) if "i_q" in pre else ix.queries(q_residual, x, cos, sin)
            i_kv = pre["i_kv"] if "i_kv" in pre else ix.kv_proj(x)
            i_gate = pre["i_gate"] if "i_gate" in pre else ix.gate_proj(x)
            inputs += [
                i_q.contiguous(),
                i_w.float().contiguous(),
                i_kv,
                i_gate,
                ix.position_bias.float().contiguous(),
                ix.kv_norm.weight.float().contiguous(),
                state["index_keys"],
                state["indexer_kv"],
                state["indexer_gate"],
            ]
    return dsv4_attention(
        *inputs,
        layer_type=_TYPE_CODE[layer.layer_type],
        window=layer.window,
        compress_rate=comp.rate if comp is not None else 0,
        index_topk=comp.indexer.topk if comp is not None and comp.indexer is not None else 0,
        scaling=layer.scaling,
        eps=layer.eps,
        rope_scale=float(layer.rope.scale),
    )


__all__ = [
    "ATTENTION_BACKENDS",
    "check_backend",
    "core",
    "kernel_serves",
    "library_unavailable",
    "step_meta",
    "why_not_kernel",
]
