"""The engram-llama modules (docs/engram-spec.md, "Reference architecture"): a
Llama-style decoder (RMSNorm, RoPE attention with grouped KV heads, SwiGLU MLP) whose
residual stream is ``hc_mult`` copies ``[T, hc, D]``, with the Engram update at the
start of the listed layers. Every module works on a packed step (T tokens of several
sequences back to back; :class:`AttentionPlan` says which is which).

Attention reads the slot KV cache (:mod:`.kv_cache`) in place. Two implementations of
one function: ``loop`` (explicit float32 scores per sequence, the CPU reference) and
``sdpa`` (``scaled_dot_product_attention``: fused kernels, no materialized causal mask
for a prefill chunk, decode tokens of all sequences batched in one call), chosen per
device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engram_trt.config.model import ModelConfig
from engram_trt.engram.fusion import engram_gate
from engram_trt.models.kv_cache import KVCache
from engram_trt.models.step import PackedStep
from engram_trt.quant.weight import QuantLinear, QuantWeight, linear_weight

ATTENTION_IMPLS = ("loop", "sdpa")
# Above this many bytes of keys per layer, a recorded decode graph reads the KV cache in
# place (the attention kernel) rather than copying it out for SDPA.
IN_PLACE_DECODE_BYTES = 8 << 20
# Where the warp attention kernel serves the shape (attention_kernels.warp_kernel_serves),
# a recorded decode graph reads the cache in place at every context. On the H200, decode
# of one sequence at context 256 (1.15B model): the kernel and its merge took 7.2 + 2.0 us
# a layer, against SDPA's 7.5 us plus 2 x 4.1 us of copies of the slot's K and V (the
# copies are what SDPA needs in a graph, where the slots are data). The tiled kernel,
# which serves the other shapes, took 23.7 us a layer there, so those keep the threshold.
IN_PLACE_WITH_WARP_KERNEL = True


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """HF Llama convention: the head dim's halves are the pairs that rotate."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_and_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    plan: "AttentionPlan",
    keys: torch.Tensor,
    values: torch.Tensor,
) -> torch.Tensor:
    """RoPE of ``q [T, H, hd]`` and ``k [T, kvh, hd]``, then the step's K/V into the cache
    at (slot, position); returns the rotated q. (The kernel library's
    ``engram_rope_kv_cache_write`` does this in one launch, rounding as these bf16 ops do.)"""
    c, s = cos[:, None, :], sin[:, None, :]
    q = q * c + rotate_half(q) * s
    k = k * c + rotate_half(k) * s
    keys[plan.token_slots, :, plan.positions] = k.to(keys.dtype)
    values[plan.token_slots, :, plan.positions] = v.to(values.dtype)
    return q


def fused_weight_of(
    stacked: torch.Tensor | QuantWeight | None, linears: Sequence[nn.Module]
) -> torch.Tensor | QuantWeight | None:
    """The stack of ``linears``' weights (a tensor, or an FP8 :class:`QuantWeight` whose
    bytes and scales are each stacked) while their weights are still its row slices, else
    None (not fused, or a weight was replaced since: run them apart)."""
    if isinstance(stacked, QuantWeight):
        if not all(isinstance(m, QuantLinear) for m in linears):
            return None
        data = fused_rows(stacked.data, [m.weight for m in linears])
        scale = fused_rows(stacked.scale, [m.weight_scale_inv for m in linears])
        return stacked if data is not None and scale is not None else None
    if stacked is None or any(isinstance(m, QuantLinear) for m in linears):
        return None
    return fused_rows(stacked, [m.weight for m in linears])


def fused_rows(stacked: torch.Tensor | None, parts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """``stacked`` when ``parts`` are still its consecutive row slices (the weights as
    loaded: fused projections), else None (a weight was replaced since: run them apart)."""
    if stacked is None:
        return None
    row = stacked.stride(0) * stacked.element_size()
    at, offset = stacked.data_ptr(), 0
    for p in parts:
        if p.data_ptr() != at + offset * row or p.shape[1:] != stacked.shape[1:]:
            return None
        offset += p.shape[0]
    return stacked if offset == stacked.shape[0] else None


@dataclass
class AttentionPlan:
    """How one step's tokens map onto the cache, prepared once per step for every layer.

    ``token_slots`` / ``positions`` ``[T]`` on the device; the per-sequence lists on the
    host (no device reads inside the step). Decode sequences (one token) are batched:
    ``decode`` lists their indices, with their slots and lengths as device tensors.
    """

    step: PackedStep
    token_slots: torch.Tensor
    positions: torch.Tensor
    impl: str
    decode: list[int]
    prefill: list[int]
    decode_slots: torch.Tensor | None
    decode_rows: torch.Tensor | None  # pack index of each decode token
    decode_mask: torch.Tensor | None  # [G, 1, 1, Lmax] bool: key allowed
    decode_max_len: int
    decode_slot_range: tuple[int, int] | None = None  # contiguous decode slots: read the cache in place
    graph_safe: bool = False
    _index32: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False, compare=False)

    _decode32: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False, compare=False)
    _decode_bias: dict[torch.dtype, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)

    @property
    def decode_only(self) -> bool:
        """Every token is a decode token (token i is sequence i): no index copies needed."""
        return bool(self.decode) and not self.prefill

    def decode_index32(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode tokens' slots and positions as int32, once per step (every layer's
        in-place decode attention reads the same)."""
        if self._decode32 is None:
            assert self.decode_slots is not None and self.decode_rows is not None
            pos = self.positions if self.decode_only else self.positions.index_select(0, self.decode_rows)
            self._decode32 = (self.decode_slots.to(torch.int32), pos.to(torch.int32))
        return self._decode32

    def decode_bias(self, dtype: torch.dtype) -> torch.Tensor:
        """``decode_mask`` as the additive mask SDPA makes of a bool mask (0 where a key
        is allowed, -inf elsewhere) in ``dtype``, made once per step. Why: given the bool
        mask, every layer's SDPA call converts it again (small kernels per layer, which a
        decode step of one sequence is made of); given this, none, with the same values
        and so the same output."""
        bias = self._decode_bias.get(dtype)
        if bias is None:
            assert self.decode_mask is not None
            bias = torch.zeros(self.decode_mask.shape, dtype=dtype, device=self.decode_mask.device)
            bias.masked_fill_(self.decode_mask.logical_not(), float("-inf"))
            self._decode_bias[dtype] = bias
        return bias

    def index32(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``token_slots`` and ``positions`` as int32 (the kernel library's index type),
        converted once per step, at the first layer that asks."""
        if self._index32 is None:
            self._index32 = (self.token_slots.to(torch.int32), self.positions.to(torch.int32))
        return self._index32

    @classmethod
    def make(
        cls, step: PackedStep, device: torch.device, impl: str, uploader: Any = None, graph_safe: bool = False
    ) -> "AttentionPlan":
        """``graph_safe``: every data-dependent choice is read from device tensors (no
        in-place slot-range shortcut), so a captured CUDA graph replays it for any slots."""
        if impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention impl {impl!r} not in {ATTENTION_IMPLS}")
        arrays = step.device_arrays(device, uploader)
        decode = [s for s, n in enumerate(step.seq_lens) if n == 1] if impl == "sdpa" else []
        prefill = [s for s, n in enumerate(step.seq_lens) if n != 1] if decode else list(range(step.num_seqs))
        d_slots = d_rows = d_mask = None
        lmax = 0
        slot_range = None
        if decode:
            total = step.total_lens
            lmax = max(total[s] for s in decode)
            d_slots, d_rows = arrays["decode_slots"], arrays["decode_rows"]
            d_mask = (torch.arange(lmax, device=device)[None, :] < arrays["decode_lens"][:, None])[:, None, None, :]
            ds = [step.slots[s] for s in decode]
            if not graph_safe and ds == list(range(ds[0], ds[0] + len(ds))):
                slot_range = (ds[0], ds[0] + len(ds))
        return cls(
            step,
            arrays["token_slots"],
            arrays["positions"],
            impl,
            decode,
            prefill,
            d_slots,
            d_rows,
            d_mask,
            lmax,
            slot_range,
            graph_safe,
        )


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        D, hd = config.hidden_size, config.head_dim
        self.n_heads, self.n_kv, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        self.q_proj = nn.Linear(D, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(D, self.n_kv * hd, bias=False)
        self.v_proj = nn.Linear(D, self.n_kv * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, D, bias=False)
        # [(H + 2 kvh) * hd, D]: q, k and v weights stacked by rows, the three projections'
        # weights being views of it (EngramLlama fuses them at load on a GPU), so one GEMM
        # computes all three without a second copy of the weights. None: not fused. FP8
        # projections: a QuantWeight whose bytes and scales are the stacks.
        self.qkv_weight: torch.Tensor | QuantWeight | None = None

    def fused_weight(self) -> torch.Tensor | QuantWeight | None:
        """The stacked q / k / v weight, while the projections' weights are its views."""
        return fused_weight_of(self.qkv_weight, (self.q_proj, self.k_proj, self.v_proj))

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        plan: AttentionPlan,
        cache: KVCache,
        layer: int,
        ops: Any = None,
    ) -> torch.Tensor:
        """``x [T, D]`` -> ``[T, D]``; writes the step's K/V into the cache first, so the
        tokens of one chunk see each other. With ``ops`` (reference.kernel_ops) and fused
        weights: one GEMM for q / k / v, then RoPE and the KV write in ``ops``."""
        T = x.shape[0]
        keys, values = cache.keys[layer], cache.values[layer]
        qkv_weight = None if ops is None else self.fused_weight()
        if qkv_weight is not None:
            q = ops.rope_kv_write(
                ops.linear(x, qkv_weight), cos, sin, plan, keys, values, self.n_heads, self.n_kv, self.head_dim
            )
        else:
            q = self.q_proj(x).view(T, self.n_heads, self.head_dim)
            k = self.k_proj(x).view(T, self.n_kv, self.head_dim)
            v = self.v_proj(x).view(T, self.n_kv, self.head_dim)
            q = rope_and_write(q, k, v, cos, sin, plan, keys, values)
        if plan.decode_only:  # a pure decode step: token i is sequence i, no index copies
            out = self._attend_decode(q, keys, values, plan)
        else:
            out = torch.empty_like(q)
            step = plan.step
            for si in plan.prefill:
                a, b = step.seq_starts[si], step.seq_starts[si + 1]
                slot, L = step.slots[si], step.total_lens[si]
                out[a:b] = self._attend_one(q[a:b], keys[slot, :, :L], values[slot, :, :L], plan.impl)
            if plan.decode:
                out[plan.decode_rows] = self._attend_decode(q[plan.decode_rows], keys, values, plan)
        out = out.reshape(T, self.n_heads * self.head_dim)
        return self.o_proj(out) if ops is None else ops.linear(out, linear_weight(self.o_proj))

    def _attend_one(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, impl: str) -> torch.Tensor:
        """One sequence: ``q [n, H, hd]`` (its last n positions), ``k/v [kvh, L, hd]``
        (the cache up to its end); causal, aligned to the end (lower right)."""
        n, L = q.shape[0], k.shape[1]
        groups = self.n_heads // self.n_kv
        qh = q.transpose(0, 1)  # [H, n, hd]
        if impl == "sdpa":
            from torch.nn.attention.bias import causal_lower_right

            mask = causal_lower_right(n, L) if n > 1 else None
            o = F.scaled_dot_product_attention(
                qh[None], k[None].to(q.dtype), v[None].to(q.dtype), attn_mask=mask, enable_gqa=groups > 1
            )[0]
            return o.transpose(0, 1)
        kh = k.repeat_interleave(groups, dim=0)  # head h reads kv head h // groups
        vh = v.repeat_interleave(groups, dim=0)
        scores = torch.matmul(qh.float(), kh.float().transpose(-1, -2)) / math.sqrt(self.head_dim)
        q_pos = torch.arange(L - n, L, device=q.device)
        allowed = torch.arange(L, device=q.device)[None, :] <= q_pos[:, None]
        scores = scores.masked_fill(~allowed, float("-inf"))
        o = torch.matmul(torch.softmax(scores, dim=-1), vh.float()).to(q.dtype)
        return o.transpose(0, 1)

    def _attend_decode(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, plan: AttentionPlan
    ) -> torch.Tensor:
        """All one-token sequences at once: ``q [G, H, hd]``; each reads its slot's keys
        up to its length (a key-padding mask over the longest)."""
        L = plan.decode_max_len
        G = q.shape[0]
        if plan.graph_safe and q.is_cuda:
            # In a recorded graph the slots are data, so the SDPA path below would copy
            # every sequence's keys; read them in place instead, with the kernel the
            # EngramAttention plugin runs, where its warp kernel serves or past a few MB
            # per layer.
            from engram_trt.native import attention as attention_kernels

            if (
                IN_PLACE_WITH_WARP_KERNEL and attention_kernels.warp_kernel_serves(q, self.n_heads, self.n_kv)
            ) or G * self.n_kv * L * self.head_dim * keys.element_size() > IN_PLACE_DECODE_BYTES:
                return attention_kernels.attention_packed(q.contiguous(), keys, values, *plan.decode_index32())
        if plan.decode_slot_range is not None:  # the usual case: slots handed out lowest first
            a, b = plan.decode_slot_range
            k, v = keys[a:b, :, :L], values[a:b, :, :L]  # views: the cache is read in place
        else:
            k, v = keys[plan.decode_slots, :, :L], values[plan.decode_slots, :, :L]  # [G, kvh, L, hd] copies
        k, v = k.to(q.dtype), v.to(q.dtype)
        o = F.scaled_dot_product_attention(
            q[:, :, None, :], k, v, attn_mask=plan.decode_bias(q.dtype), enable_gqa=self.n_heads != self.n_kv
        )
        return o[:, :, 0, :]


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        D, I = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(D, I, bias=False)
        self.up_proj = nn.Linear(D, I, bias=False)
        self.down_proj = nn.Linear(I, D, bias=False)
        # [2I, D]: gate and up weights stacked by rows, theirs being views of it (as
        # Attention.qkv_weight). None: not fused.
        self.gate_up_weight: torch.Tensor | QuantWeight | None = None

    def fused_weight(self) -> torch.Tensor | QuantWeight | None:
        """The stacked gate / up weight, while the projections' weights are its views."""
        return fused_weight_of(self.gate_up_weight, (self.gate_proj, self.up_proj))

    def forward(self, x: torch.Tensor, ops: Any = None) -> torch.Tensor:
        """With ``ops`` and fused weights: one GEMM for gate and up, the activation in ``ops``."""
        gate_up_weight = None if ops is None else self.fused_weight()
        if gate_up_weight is not None:
            return ops.linear(ops.silu_mul(ops.linear(x, gate_up_weight)), linear_weight(self.down_proj))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class EngramModule(nn.Module):
    """``wkv`` and the gate weights of one Engram layer (its table lives outside)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        spec = config.require_model()
        assert spec is not None and spec.head_dim is not None
        D, hc = config.hidden_size, config.hc_mult
        self.hc, self.eps = hc, config.rms_norm_eps
        self.wkv = nn.Linear(spec.n_hash_cols * spec.head_dim, (hc + 1) * D, bias=False)
        self.q_weight = nn.Parameter(torch.empty(hc, D), requires_grad=False)
        self.k_weight = nn.Parameter(torch.empty(hc, D), requires_grad=False)

    def forward(
        self, hidden: torch.Tensor, rows: torch.Tensor, live: torch.Tensor, ops: Any = None, linear: Any = None
    ) -> torch.Tensor:
        """hidden ``[T, hc, D]``, rows ``[T, cols, head_dim]``, live ``[T]`` bool; the gate
        runs in the kernel library when ``ops`` is given (bf16 only); ``linear(x, weight)``
        computes the wkv projection when given (the fused path's backbone ops)."""
        T = hidden.shape[0]
        # the compute dtype: the float weight's, or the residual's for an FP8 wkv
        x = rows.reshape(T, -1).to(hidden.dtype if isinstance(self.wkv, QuantLinear) else self.wkv.weight.dtype)
        kv = self.wkv(x) if linear is None else linear(x, linear_weight(self.wkv))
        args = (hidden, kv, self.q_weight, self.k_weight, live)
        return engram_gate(*args, self.eps) if ops is None else ops.gate(*args, self.eps)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, engram_attr: str | None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)
        self.engram_attr = engram_attr
        if engram_attr is not None:
            # Registered under the checkpoint's prefix ('engram') so that
            # parameter names equal checkpoint names.
            setattr(self, engram_attr, EngramModule(config))

    @property
    def engram_module(self) -> EngramModule | None:
        """The Engram submodule (named after the checkpoint's prefix), if any."""
        return None if self.engram_attr is None else getattr(self, self.engram_attr)


class Backbone(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        index = config.engram_layer_index
        prefix = config.engram.prefix if config.engram is not None else None
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, prefix if i in index else None) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
