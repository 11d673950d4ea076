"""Qwen4Exp's hyper-connections, sparse MoE and PLE fusion over a packed step
(``[T, ...]``: the tokens of several sequences back to back).

Parameter names equal the checkpoint's (``attn_hyper_connection.input_mix_weight_down``,
``mlp.experts.3.gate_proj``, ``ple.norm_key``...), so a state dict loads as saved.

* Hyper-connections (:class:`GatedResidual`): the residual is ``hc_count`` streams
  ``[T, hc * hidden]``. Before a sublayer the streams, normalized one by one, are mixed
  into its input by a low-rank sigmoid gate; its output is injected back into every
  stream with a per-stream weight in (0, 2). Without ``block_inject_weight`` (the final
  mixer) only the mix is returned.
* MoE (:class:`SparseMoE`): softmax router in float32, top-k (renormalized when
  ``norm_topk_prob``), SwiGLU experts, plus a shared expert scaled by a sigmoid gate.
  Experts stored FP8 (QuantLinear) run in their stored form: one expert at a time
  (each dequantized for its product) on the per-expert path, and through the kernel
  library's grouped expert product (:func:`engram_trt.native.quant.experts`) on the
  sync-free path of a CUDA decode step. A bf16 decode step on a GPU runs the MoE on the
  kernel library's fused decode kernels (:mod:`.fused`).
* PLE (:class:`PLEFusion`): the token's hashed n-gram rows (``[T, ple_embed_dim]``,
  gathered by the caller from tables outside the module) give a shared value and one
  key per stream; each stream's normalized activations gate the value through a
  sqrt-sign of their scaled dot product; a dilated depthwise causal convolution
  (dilation ``ngram_size``) over the normalized gated values adds local context. The
  convolution's history is per sequence (:class:`~.state.Qwen4ExpState`), so chunked
  prefill and decode equal one whole forward. On a CUDA device the fusion after the two
  projections runs as one call of the kernel library (``engram_ple_fusion``, the
  EngramPleFusion plugin's math, :mod:`engram_trt.native.ple`) when it loads; the PyTorch
  path (:meth:`PLEFusion.forward_torch`) serves the CPU and is the kernel's reference.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engram_trt.errors import EngramError
from engram_trt.models.qwen4_exp.norms import OffsetRMSNorm
from engram_trt.quant.weight import QuantLinear, QuantWeight

log = logging.getLogger(__name__)

PLE_BACKENDS = ("auto", "kernels", "torch")


def _ple_library_unavailable() -> str | None:
    """Why the kernel library cannot serve the PLE fusion (None: it can), asked once."""
    from engram_trt.native import ple as native_ple

    return native_ple.unavailable("PLE fusion CUDA kernel")


def _native_experts_unavailable(x: torch.Tensor, gate: QuantWeight) -> str | None:
    """Why the kernel library's FP8 expert product cannot take this call (None: it can)."""
    try:
        from engram_trt.native import quant as native_quant
    except ImportError as exc:
        return f"this build has no engram_trt.native.quant ({exc})"
    return native_quant.unavailable_for(x, gate)


class GatedResidual(nn.Module):
    def __init__(self, config, inject: bool = True) -> None:
        super().__init__()
        self.hc = config.hc_count
        self.hidden = config.hidden_size
        width = self.hc * self.hidden
        self.hc_norm = OffsetRMSNorm(width, config.rms_norm_eps, group_size=self.hidden)
        self.input_mix_weight_down = nn.Linear(width, config.hc_lowrank, bias=False)
        self.input_mix_weight_up = nn.Linear(config.hc_lowrank, width, bias=False)
        self.block_inject_weight = nn.Linear(width, self.hc, bias=False) if inject else None

    def mix(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(sublayer input [T, hidden], injection weights [T, hc] or None)``; a bf16 decode
        step on a GPU takes the kernel library's fused mix (:func:`.fused.mix`) where it serves."""
        if streams.is_cuda:
            from engram_trt.models.qwen4_exp import fused

            out = fused.mix(self, streams)
            if out is not None:
                return out
        normed = self.hc_norm(streams)
        w = torch.sigmoid(self.input_mix_weight_up(F.silu(self.input_mix_weight_down(normed) / self.hc)))
        mixed = (w.unflatten(-1, (self.hc, self.hidden)) * normed.unflatten(-1, (self.hc, self.hidden))).mean(dim=-2)
        if self.block_inject_weight is None:
            return mixed, None
        return mixed, 2 * torch.sigmoid(self.block_inject_weight(normed) / self.hc)

    @staticmethod
    def inject(streams: torch.Tensor, out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The streams after a sublayer's output ``out [T, hidden]`` is added to each with its weight."""
        return streams + (out.unsqueeze(-2) * weights.unsqueeze(-1)).flatten(-2)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoE(nn.Module):
    # A tensor-parallel rank's routed experts: (first global id, count) of the experts it
    # holds (.parallel.shard_modules); None: all of them.
    expert_range: tuple[int, int] | None = None

    def __init__(self, config) -> None:
        super().__init__()
        D = config.hidden_size
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = nn.Linear(D, config.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(D, config.moe_intermediate_size) for _ in range(config.num_experts))
        self.shared_expert = MLP(D, config.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(D, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, k] in x's dtype, expert ids [T, k])`` (a tensor-parallel rank: the
        ids of its own experts, the other pairs weighted 0)."""
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.expert_range is not None:
            from engram_trt.models.parallel import localize_experts

            ids, weights = localize_experts(ids, weights, *self.expert_range)
        return weights.to(logits.dtype), ids

    def forward(self, x: torch.Tensor, sync_free: bool = False) -> torch.Tensor:
        """``sync_free``: no host sync and fixed shapes (what a decode CUDA graph records):
        the experts through :meth:`experts_dense` or :meth:`experts_gathered`, whichever
        reads fewer weight bytes; else one GEMM pair per expert some token picked (its
        token counts read on the host: a sync). A bf16 decode step on a GPU takes the
        kernel library's fused MoE (:func:`.fused.moe`) where it serves."""
        if sync_free:
            from engram_trt.models.qwen4_exp import fused

            out = fused.moe(self, x)
            if out is not None:
                return out
        weights, ids = self.route(x)
        shared = self.shared_expert(x) * torch.sigmoid(self.shared_expert_gate(x))
        if sync_free:
            pairs = ids.numel()
            routed = (
                self.experts_gathered(x, weights, ids)
                if 2 * pairs < len(self.experts)
                else self.experts_dense(x, weights, ids)
            )
            return routed + shared
        out = torch.zeros_like(x)
        # Tokens grouped by expert: one GEMM pair per expert that any token picked.
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        token_of = order // self.top_k
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            sel = order[start : start + n]
            tok = token_of[start : start + n]
            start += n
            y = self.experts[e](x[tok]) * weights.reshape(-1)[sel].unsqueeze(-1)
            out.index_add_(0, tok, y.to(out.dtype))
        return out + shared

    def stack_experts(self) -> None:
        """Put the experts' weights into three stacked tensors (gate and up ``[E*I, D]``,
        down ``[D, E*I]``) and make each expert's parameters views of them: no second
        copy, the per-expert path reads the very same values, and the sync-free forms
        read every expert in one GEMM or one gather. FP8 experts: three
        :class:`QuantWeight` stacks (bytes ``[E, I, D]`` / ``[E, D, I]`` and their block
        scales), each expert's QuantLinear buffers views of them."""
        if getattr(self, "_stacked", None) is not None:
            return
        kinds = ("gate_proj", "up_proj", "down_proj")
        if any(isinstance(getattr(e, k), QuantLinear) for e in self.experts for k in kinds):
            self._stacked = self._stack_quant()
            return
        E = len(self.experts)
        gate = torch.cat([e.gate_proj.weight for e in self.experts], dim=0)
        up = torch.cat([e.up_proj.weight for e in self.experts], dim=0)
        down = torch.cat([e.down_proj.weight for e in self.experts], dim=1)
        inter = gate.shape[0] // E
        for i, e in enumerate(self.experts):
            rows = slice(i * inter, (i + 1) * inter)
            e.gate_proj.weight = nn.Parameter(gate[rows], requires_grad=False)
            e.up_proj.weight = nn.Parameter(up[rows], requires_grad=False)
            e.down_proj.weight = nn.Parameter(down[:, rows], requires_grad=False)
        self._stacked = (gate, up, down, inter)

    def _stack_quant(self) -> tuple[Any, Any, Any, int]:
        """Per projection kind, the experts' weights stacked ``[E, N, K]``: a QuantWeight
        (bytes and scales) where they are FP8, a float tensor where transformers left them
        in 16 bits (e.g. ``down_proj`` when ``I`` does not divide by the block); each
        expert's buffers / parameters views of the stacks."""
        stacks: list[Any] = []
        for kind in ("gate_proj", "up_proj", "down_proj"):
            mods = [getattr(e, kind) for e in self.experts]
            fp8 = {isinstance(m, QuantLinear) for m in mods}
            if len(fp8) > 1:
                raise EngramError(
                    f"the routed experts' {kind} weights are partly FP8 and partly float: one projection "
                    f"of a layer's experts is FP8 for all of them or for none"
                )
            if fp8 == {True}:
                data = torch.stack([m.weight for m in mods])
                scale = torch.stack([m.weight_scale_inv for m in mods])
                for i, m in enumerate(mods):
                    m.weight, m.weight_scale_inv = data[i], scale[i]
                stacks.append(QuantWeight(data, scale, "fp8", mods[0].block))
            else:
                w = torch.stack([m.weight for m in mods])
                for i, m in enumerate(mods):
                    m.weight = nn.Parameter(w[i], requires_grad=False)
                stacks.append(w)
        return (
            stacks[0],
            stacks[1],
            stacks[2],
            int(stacks[0].shape[1] if isinstance(stacks[0], torch.Tensor) else stacks[0].data.shape[1]),
        )

    def _stacks(self) -> tuple[Any, Any, Any, int]:
        self.stack_experts()
        return self._stacked

    def experts_quant(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The routed experts stored FP8, every (token, pick) pair at once: on a CUDA
        device the kernel library's grouped expert product over the stored bytes
        (sync-free, graph-capturable); elsewhere, or where the library cannot serve the
        call, this layer's stacks dequantized for the call and the dense form's math."""
        gate, up, down, inter = self._stacks()
        if x.is_cuda:
            why = _native_experts_unavailable(x, next(w for w in (gate, up, down) if isinstance(w, QuantWeight)))
            if why is None:
                from engram_trt.native import quant as native_quant

                return native_quant.experts(x, ids, weights.float(), gate, up, down, limit=None)
            if not getattr(SparseMoE, "_warned", False):
                SparseMoE._warned = True  # type: ignore[attr-defined]
                log.warning(
                    "FP8 experts: the kernel library cannot serve them (%s); dequantizing each layer's experts "
                    "for its step",
                    why,
                )
        E, T, D = len(self.experts), x.shape[0], x.shape[1]
        g, u, d = (
            w.dequantize(torch.float32).to(x.dtype) if isinstance(w, QuantWeight) else w for w in (gate, up, down)
        )
        h = F.silu(F.linear(x, g.reshape(E * inter, D))) * F.linear(x, u.reshape(E * inter, D))
        h = (h.reshape(T, E, inter) * self._routing_matrix(weights, ids).unsqueeze(-1)).reshape(T, E * inter)
        return F.linear(h, d.permute(1, 0, 2).reshape(D, E * inter))

    def _routing_matrix(self, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``[T, E]``: each token's routing weight per expert (0 where not picked)."""
        dense = torch.zeros(ids.shape[0], len(self.experts), dtype=weights.dtype, device=weights.device)
        return dense.scatter_(1, ids, weights)

    def experts_dense(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Every expert on every token, each expert's activations scaled by its routing
        weight (0 where the token did not pick it) before one down GEMM over all of them:
        every expert's weights read once, ``E / top_k`` times the picked experts'
        arithmetic. The sum over a token's experts runs inside the GEMM (float32
        accumulation) instead of the per-expert path's additions in x's dtype."""
        gate, up, down, inter = self._stacks()
        if any(isinstance(w, QuantWeight) for w in (gate, up, down)):
            return self.experts_quant(x, weights, ids)
        T, E = x.shape[0], len(self.experts)
        h = F.silu(F.linear(x, gate)) * F.linear(x, up)  # [T, E*I]
        h = (h.reshape(T, E, inter) * self._routing_matrix(weights, ids).unsqueeze(-1)).reshape(T, E * inter)
        return F.linear(h, down)

    def experts_gathered(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each (token, pick) pair's expert weights gathered and applied by batched
        matrix-vector products: the picked experts' weights alone are read (a few tokens
        against many experts), then each token's ``top_k`` outputs, scaled, summed."""
        gate, up, down, inter = self._stacks()
        if any(isinstance(w, QuantWeight) for w in (gate, up, down)):
            return self.experts_quant(x, weights, ids)
        T, k = ids.shape
        E, D = len(self.experts), x.shape[1]
        flat = ids.reshape(-1)
        xs = x.repeat_interleave(k, dim=0).unsqueeze(-1)  # [P, D, 1]
        g = torch.bmm(gate.reshape(E, inter, D).index_select(0, flat), xs)
        u = torch.bmm(up.reshape(E, inter, D).index_select(0, flat), xs)
        h = F.silu(g) * u  # [P, I, 1]
        w_down = down.reshape(D, E, inter).transpose(0, 1).index_select(0, flat)  # [P, D, I]
        y = torch.bmm(w_down, h).squeeze(-1) * weights.reshape(-1, 1)
        return y.reshape(T, k, D).sum(dim=1)


class PLEFusion(nn.Module):
    """See the module docstring; ``forward`` returns the streams' update ``[T, hc * hidden]``.

    ``backend``: ``auto`` (the kernel library on CUDA tensors it takes: bf16 / fp16 /
    float32 activations, the conv state in their dtype, weights float32 or theirs; else
    PyTorch), ``kernels`` (the kernel library or an EngramError saying why not) or
    ``torch``. A class default, settable per module."""

    backend: str = "auto"

    def __init__(self, config) -> None:
        super().__init__()
        ple = config.ple
        self.hc = config.hc_count
        self.hidden = config.hidden_size
        width = self.hc * self.hidden
        self.dilation = ple.ngram_size
        self.kernel = ple.conv_kernel_size
        self.history = (self.kernel - 1) * self.dilation
        eps = config.rms_norm_eps
        self.key_proj = nn.Linear(ple.embed_dim, width, bias=False)
        self.value_proj = nn.Linear(ple.embed_dim, self.hidden, bias=False)
        self.norm_key = OffsetRMSNorm(width, eps, group_size=self.hidden)
        self.norm_query = OffsetRMSNorm(width, eps, group_size=self.hidden)
        self.norm_conv = OffsetRMSNorm(width, eps, group_size=self.hidden)
        # Depthwise: weight [width, 1, kernel] as the checkpoint's conv1d.
        self.conv1d = nn.Conv1d(width, width, kernel_size=self.kernel, groups=width, dilation=self.dilation, bias=False)

    @staticmethod
    def state_shape(config) -> tuple[int, int]:
        """Per slot: the last ``(kernel-1) * dilation`` normalized gated values."""
        return (config.hc_count * config.hidden_size, (config.ple.conv_kernel_size - 1) * config.ple.ngram_size)

    def forward(
        self,
        streams: torch.Tensor,
        rows: torch.Tensor,
        seq_starts: Sequence[int],
        past_lens: Sequence[int],
        slots: Sequence[int],
        conv_state: torch.Tensor,
    ) -> torch.Tensor:
        if self._kernel_serves(streams, conv_state):
            return self.forward_kernel(streams, rows, seq_starts, past_lens, slots, conv_state)
        return self.forward_torch(streams, rows, seq_starts, past_lens, slots, conv_state)

    def _kernel_serves(self, streams: torch.Tensor, conv_state: torch.Tensor) -> bool:
        """Whether ``forward`` takes the kernel path (see ``backend``)."""
        if self.backend not in PLE_BACKENDS:
            raise EngramError(f"PLEFusion.backend {self.backend!r} is not one of {list(PLE_BACKENDS)}")
        if self.backend == "torch":
            return False
        io = streams.dtype
        weights = {
            p.dtype for p in (self.norm_key.weight, self.norm_query.weight, self.norm_conv.weight, self.conv1d.weight)
        }
        why = None
        if not streams.is_cuda:
            why = f"the activations are on {streams.device}, not a CUDA device"
        elif io not in (torch.bfloat16, torch.float16, torch.float32):
            why = f"the activations are {io}, not bfloat16, float16 or float32"
        elif conv_state.dtype != io:
            why = f"the conv state is {conv_state.dtype} but the activations are {io}; allocate the state in {io}"
        elif len(weights) != 1 or not weights <= {torch.float32, io}:
            why = f"the PLE weights are {sorted(map(str, weights))}, not all float32 or all {io}"
        elif self.hidden % 8:
            why = f"hidden_size {self.hidden} is not a multiple of 8"
        else:
            why = _ple_library_unavailable()
        if why is None:
            return True
        if self.backend == "kernels":
            raise EngramError(f"PLEFusion backend 'kernels' cannot run: {why}; use backend 'auto' or 'torch'")
        return False

    def forward_kernel(
        self,
        streams: torch.Tensor,
        rows: torch.Tensor,
        seq_starts: Sequence[int],
        past_lens: Sequence[int],
        slots: Sequence[int],
        conv_state: torch.Tensor,
    ) -> torch.Tensor:
        """The update through ``engram_ple_fusion``: the two projections here, the rest in
        one library call (three launches), the conv state updated in place."""
        from engram_trt.native import ple as native_ple

        S = len(slots)
        meta = torch.tensor([*seq_starts, *past_lens, *slots], dtype=torch.int32).to(streams.device)
        key = self.key_proj(rows).contiguous()
        value = self.value_proj(rows).contiguous()
        return native_ple.ple_fusion(
            streams.contiguous(),
            key,
            value,
            self.norm_key.weight,
            self.norm_query.weight,
            self.norm_conv.weight,
            self.conv1d.weight,
            conv_state,
            meta[: S + 1],
            meta[S + 1 : 2 * S + 1],
            meta[2 * S + 1 :],
            hc_count=self.hc,
            dilation=self.dilation,
            eps=self.norm_conv.eps,
        )

    def forward_torch(
        self,
        streams: torch.Tensor,
        rows: torch.Tensor,
        seq_starts: Sequence[int],
        past_lens: Sequence[int],
        slots: Sequence[int],
        conv_state: torch.Tensor,
    ) -> torch.Tensor:
        """The PyTorch path (the CPU's, and the kernel's reference)."""
        gated, normed = self._gated(streams, rows)
        return gated + F.silu(self._conv(normed, seq_starts, past_lens, slots, conv_state))

    def forward_decode(
        self,
        streams: torch.Tensor,
        rows: torch.Tensor,
        slot_ids: torch.Tensor,
        meta: torch.Tensor,
        conv_state: torch.Tensor,
    ) -> torch.Tensor:
        """A decode-only step (one token per slot ``slot_ids``, each with a past): the
        update with no host lists. ``meta``: the kernel's int32 ``[seq_starts (G+1),
        past_lens (G), slots (G)]`` on the device (built once per step, shared by every
        PLE layer); the PyTorch path convolves all slots' histories in one call."""
        if self._kernel_serves(streams, conv_state):
            from engram_trt.native import ple as native_ple

            G = slot_ids.shape[0]
            key = self.key_proj(rows).contiguous()
            value = self.value_proj(rows).contiguous()
            return native_ple.ple_fusion(
                streams.contiguous(),
                key,
                value,
                self.norm_key.weight,
                self.norm_query.weight,
                self.norm_conv.weight,
                self.conv1d.weight,
                conv_state,
                meta[: G + 1],
                meta[G + 1 : 2 * G + 1],
                meta[2 * G + 1 :],
                hc_count=self.hc,
                dilation=self.dilation,
                eps=self.norm_conv.eps,
            )
        gated, normed = self._gated(streams, rows)
        w = self.conv1d.weight
        seq = torch.cat([conv_state[slot_ids].to(normed.dtype), normed.unsqueeze(-1)], dim=-1)  # [G, width, H + 1]
        out = F.conv1d(seq, w, groups=w.shape[0], dilation=self.dilation)[..., 0]
        conv_state[slot_ids] = seq[..., 1:].to(conv_state.dtype)
        return gated + F.silu(out)

    def _gated(self, streams: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The gated values ``[T, width]`` and their normalized form (the conv's input)."""
        keys = self.norm_key(self.key_proj(rows)).unflatten(-1, (self.hc, self.hidden))
        value = self.value_proj(rows)
        query = self.norm_query(streams).unflatten(-1, (self.hc, self.hidden))
        score = (keys * query).sum(dim=-1, keepdim=True) / math.sqrt(self.hidden)
        score = score.abs().clamp_min(1e-6).sqrt() * score.sign()
        gated = (torch.sigmoid(score) * value.unsqueeze(-2)).flatten(-2)  # [T, width]
        return gated, self.norm_conv(gated)

    def _conv(
        self,
        x: torch.Tensor,
        seq_starts: Sequence[int],
        past_lens: Sequence[int],
        slots: Sequence[int],
        conv_state: torch.Tensor,
    ) -> torch.Tensor:
        """The dilated causal convolution of each sequence's tokens after its stored
        history (zeros for a new sequence); the slots keep the new history."""
        w = self.conv1d.weight  # [width, 1, K]
        H = self.history
        outs = []
        for s, slot in enumerate(slots):
            a, b = seq_starts[s], seq_starts[s + 1]
            past = conv_state[slot].to(x.dtype) if past_lens[s] > 0 else x.new_zeros(x.shape[1], H)
            seq = torch.cat([past, x[a:b].transpose(0, 1)], dim=1)  # [width, H + n]
            outs.append(F.conv1d(seq.unsqueeze(0), w, groups=w.shape[0], dilation=self.dilation)[0].transpose(0, 1))
            conv_state[slot] = seq[:, seq.shape[1] - H :].to(conv_state.dtype)
        return torch.cat(outs, dim=0)
