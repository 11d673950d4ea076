"""DeepSeek-V4's attention layer (transformers 5.25's ``DeepseekV4Attention``) over a
packed step with per-slot state.

What one layer computes for a token at position ``p`` (every parameter named as the
checkpoint's ``model.layers.{i}.self_attn.*``):

* low-rank queries: ``q_residual = q_a_norm(q_a_proj(x))``, ``q = q_b_proj(q_residual)``
  per head, an unweighted RMSNorm per head, then RoPE on the trailing ``rope_dim``
  channels (interleaved pairs; see :mod:`.compressors`);
* one shared KV head: ``kv = rope(kv_norm(kv_proj(x)))`` is both key and value;
* keys = the sliding window (positions ``p - sliding_window < k <= p``) plus, on CSA /
  HCA layers, the compressor's entries: HCA attends every entry whose window is
  complete by ``p`` (``w < (p + 1) // rate``), CSA only the ``index_topk`` of those its
  lightning indexer picks;
* softmax over ``scale * q.k`` with one learned sink logit per head in the denominator
  (its probability is dropped), then the output's rope channels rotated back by ``-p``
  (keys carried their rotation into the values, K = V);
* grouped output: heads split into ``o_groups``, each projected by its own block of
  ``o_a_proj`` (:class:`GroupedLinear`) to ``o_lora_rank``, then ``o_b_proj``.

``sliding_attention`` layers use the ``main`` RoPE and no compressor; CSA / HCA layers
use the ``compress`` RoPE for everything. transformers' cached decode and chunked
prefill equal its no-cache full forward (checked in the tests) except where the CSA
indexer has equal scores at its top-k cut: ``topk`` breaks those by the row length, so
the picks depend on how the sequence was split. We run the same ``topk`` over the same
row as transformers' cached path (the one ``generate`` takes), so for the same split we
pick what it picks on the CPU; across splits, ties may go either way (in both).

Per slot the layer carries (:meth:`DeepseekV4Attention.state_shapes`) the last
``sliding_window`` keys in a ring (``position % sliding_window``), and per compressor
its entries and a ring of its last raw projections. The torch path handles the
sequences of a step one at a time, all queries of one sequence at once; on CUDA the
core (everything between the projections and the inverse RoPE) runs as one kernel call
over the packed step instead (:mod:`.attention_kernel`, the same state layout).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engram_trt.errors import ConfigError, EngramError
from engram_trt.models.deepseek_v4.compressors import (
    CSA,
    HCA,
    LAYER_TYPES,
    CSACompressor,
    HCACompressor,
    RMSNorm,
    RopeTable,
    apply_rope,
    check_rope_fits,
    compress_rate,
    rope_label,
    rope_tables,
    unweighted_rms_norm,
    wide,
)

# Parameters the published model keeps in float32 whatever the compute dtype
# (``_keep_in_fp32_modules_strict``); names relative to ``self_attn``.
FP32_PARAMETERS = (
    "sinks",
    "q_a_norm.weight",
    "kv_norm.weight",
    "compressor.position_bias",
    "compressor.kv_norm.weight",
    "compressor.indexer.position_bias",
    "compressor.indexer.kv_norm.weight",
)

_INT_FIELDS = (
    "hidden_size",
    "num_attention_heads",
    "head_dim",
    "q_lora_rank",
    "sliding_window",
    "o_groups",
    "o_lora_rank",
)
_CSA_FIELDS = ("index_n_heads", "index_head_dim", "index_topk")


def _require_int(config: Any, name: str, layer_type: str) -> int:
    value = getattr(config, name, None)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{name} is {value!r}; a DeepSeek-V4 {layer_type} layer needs a positive integer there")
    return value


def layer_type_of(config: Any, layer_idx: int) -> str:
    types = getattr(config, "layer_types", None)
    if not types or not 0 <= layer_idx < len(types):
        raise ConfigError(f"layer_types has no entry for layer {layer_idx}; list one attention type per layer")
    layer_type = types[layer_idx]
    if layer_type not in LAYER_TYPES:
        raise ConfigError(f"layer_types[{layer_idx}] is {layer_type!r}; use one of {', '.join(LAYER_TYPES)}")
    return layer_type


class GroupedLinear(nn.Module):
    """``DeepseekV4GroupedLinear``: a block-diagonal linear. ``weight`` is
    ``[groups * out_per_group, in_per_group]``; group ``g`` of the input meets rows
    ``g * out_per_group ..`` only, which keeps the huge ``heads * head_dim`` output from
    meeting one dense matrix. ``stored_format`` False: a float weight (QuantGroupedLinear,
    its stored-FP8 twin, declares True)."""

    stored_format: ClassVar[bool] = False

    def __init__(self, in_per_group: int, out_features: int, groups: int) -> None:
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(out_features, in_per_group))

    def forward(self, x: Tensor) -> Tensor:
        """``x [n, groups, in_per_group]`` -> ``[n, groups, out_per_group]``."""
        w = self.weight.reshape(self.groups, -1, self.weight.shape[-1])
        return torch.einsum("ngi,goi->ngo", x, w)


class DeepseekV4Attention(nn.Module):
    """One attention layer (``model.layers.{i}.self_attn``) of any of the three types.

    ``backend``: ``auto`` (the CUDA kernel where it can serve, else torch), ``kernels``
    or ``torch`` (:mod:`.attention_kernel`); a class default, settable per layer."""

    backend: str = "auto"

    # False on a tensor-parallel rank (models/deepseek_v4/parallel.py): the fused glue computes
    # the indexer's queries itself, without the ranks' gather the module path does.
    fused_decode: bool = True

    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.layer_type = layer_type_of(config, layer_idx)
        for name in _INT_FIELDS + (_CSA_FIELDS if self.layer_type == CSA else ()):
            _require_int(config, name, self.layer_type)
        h, d = config.num_attention_heads, config.head_dim
        if (h * d) % config.o_groups:
            raise ConfigError(
                f"o_groups {config.o_groups} does not divide num_attention_heads x head_dim = {h * d}; "
                "the grouped output projection splits the heads evenly"
            )
        self.rope = RopeTable(config, self.layer_type)
        self.rope_label = rope_label(self.layer_type)  # layers of one label share (cos, sin) within a step
        check_rope_fits(config, self.rope.rope_dim, self.layer_type)
        self.num_heads, self.head_dim = h, d
        self.window = config.sliding_window
        self.scaling = d**-0.5
        self.eps = config.rms_norm_eps

        self.q_a_proj = nn.Linear(config.hidden_size, config.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, h * d, bias=False)
        self.kv_proj = nn.Linear(config.hidden_size, d, bias=False)
        self.kv_norm = RMSNorm(d, config.rms_norm_eps)
        self.o_a_proj = GroupedLinear(h * d // config.o_groups, config.o_groups * config.o_lora_rank, config.o_groups)
        self.o_b_proj = nn.Linear(config.o_groups * config.o_lora_rank, config.hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.zeros(h))
        self.compressor: CSACompressor | HCACompressor | None = None
        if self.layer_type == CSA:
            self.compressor = CSACompressor(config, compress_rate(config, CSA))
        elif self.layer_type == HCA:
            self.compressor = HCACompressor(config, compress_rate(config, HCA))

    # ---- state ----------------------------------------------------------------

    @staticmethod
    def state_shapes(config: Any, layer_idx: int, max_len: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """Each slot's state for this layer: name -> (shape, dtype kind); the caller
        stacks ``num_slots`` in front. ``max_len`` bounds the compressed entries
        (``max_len // rate``); the window and the rings do not grow."""
        layer_type = layer_type_of(config, layer_idx)
        shapes: dict[str, tuple[tuple[int, ...], str]] = {
            "window_kv": ((_require_int(config, "sliding_window", layer_type), config.head_dim), "compute"),
        }
        if layer_type == "sliding_attention":
            return shapes
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
            raise EngramError(f"max_len is {max_len!r}; pass the longest sequence a slot holds (a positive integer)")
        rate = compress_rate(config, layer_type)
        overlap = layer_type == CSA
        ring = 2 * rate if overlap else rate
        width = 2 * config.head_dim if overlap else config.head_dim
        shapes["compressed_kv"] = ((max_len // rate, config.head_dim), "compute")
        shapes["compressor_kv"] = ((ring, width), "compute")
        shapes["compressor_gate"] = ((ring, width), "compute")
        if overlap:
            shapes["index_keys"] = ((max_len // rate, config.index_head_dim), "compute")
            shapes["indexer_kv"] = ((ring, 2 * config.index_head_dim), "compute")
            shapes["indexer_gate"] = ((ring, 2 * config.index_head_dim), "compute")
        return shapes

    def _check_step(
        self,
        x: Tensor,
        positions: Tensor,
        seq_starts: list[int],
        past_lens: list[int],
        slots: list[int],
        state: dict[str, Tensor],
    ) -> int:
        """Validate the step; returns the entry capacity of a slot (0 without compressor)."""
        t = x.shape[0]
        n_seq = len(seq_starts) - 1
        if x.dim() != 2 or x.shape[1] != self.config.hidden_size:
            raise EngramError(f"x has shape {tuple(x.shape)}; pass [tokens, {self.config.hidden_size}]")
        if positions.shape != (t,):
            raise EngramError(f"positions has shape {tuple(positions.shape)}; pass one position per token ({t})")
        falling = any(b < a for a, b in zip(seq_starts, seq_starts[1:]))
        if n_seq < 0 or seq_starts[0] != 0 or seq_starts[-1] != t or falling:
            raise EngramError(f"seq_starts {seq_starts} must rise from 0 to the token count {t}")
        if len(past_lens) != n_seq or len(slots) != n_seq:
            raise EngramError(
                f"{n_seq} sequences but {len(past_lens)} past_lens and {len(slots)} slots; "
                "pass one of each per sequence"
            )
        if len(set(slots)) != n_seq:
            raise EngramError(f"slots {slots} repeat; each sequence of a step owns its own slot")
        capacity = state["compressed_kv"].shape[1] if "compressed_kv" in state else 0
        rate = self.compressor.rate if self.compressor is not None else 1
        want = self.state_shapes(self.config, self.layer_idx, max(capacity * rate, 1))
        n_slots = state["window_kv"].shape[0] if "window_kv" in state else 0
        for name, (shape, _) in want.items():
            got = state.get(name)
            if got is None or tuple(got.shape[1:]) != shape or got.shape[0] != n_slots:
                raise EngramError(
                    f"state[{name!r}] has shape {None if got is None else tuple(got.shape)}; allocate "
                    f"[num_slots, *{shape}] (DeepseekV4Attention.state_shapes)"
                )
        for s in range(n_seq):
            if not 0 <= slots[s] < n_slots:
                raise EngramError(f"slot {slots[s]} is outside the state's {n_slots} slots")
            end = past_lens[s] + seq_starts[s + 1] - seq_starts[s]
            if past_lens[s] < 0:
                raise EngramError(f"past_lens[{s}] is {past_lens[s]}; a past length is >= 0")
            if self.compressor is not None and end // self.compressor.rate > capacity:
                raise EngramError(
                    f"sequence {s} would reach length {end} (past_len {past_lens[s]}); the state holds "
                    f"{capacity} compressed entries: allocate it with a larger max_len"
                )
        return capacity

    # ---- forward --------------------------------------------------------------

    def forward(
        self,
        x: Tensor,
        positions: Tensor,
        seq_starts: list[int],
        past_lens: list[int],
        slots: list[int],
        state: dict[str, Tensor],
        *,
        meta: Tensor | None = None,
        rope: tuple[Tensor, Tensor] | None = None,
        static: bool = False,
    ) -> Tensor:
        """Attend the step's tokens ``x [T, hidden]`` over their slots' state.

        Sequence ``s`` owns tokens ``seq_starts[s]:seq_starts[s + 1]`` at positions
        ``past_lens[s] + i`` (``positions`` gives them for RoPE; masks follow
        ``past_lens``) and slot ``slots[s]``; ``past_lens[s] == 0`` starts fresh (nothing
        of the slot is read). The slots' state is updated in place. Returns
        ``[T, hidden]``. The core runs on the CUDA kernel or the torch path by
        ``backend`` (:mod:`.attention_kernel`); ``meta`` (the kernel's int32
        ``[seq_starts, past_lens, slots]`` on the device) and ``rope`` (this layer's
        ``self.rope(positions)``) let the model build them once per step. bf16 activations
        on a GPU that serves the fused decode glue take :func:`.fused.attention` around the
        same kernel core (the same math in a few launches). ``static``: a
        CUDA graph's recording (:mod:`.graphs`): the host lists give only the step's shape,
        every length is in ``meta``, so they are not checked and the kernel must serve."""
        from engram_trt.models.deepseek_v4 import attention_kernel, fused

        if not static:
            self._check_step(x, positions, seq_starts, past_lens, slots, state)
        t, h, d = x.shape[0], self.num_heads, self.head_dim
        cos, sin = rope if rope is not None else self.rope(positions)
        if self.fused_decode and fused.unavailable(x) is None and attention_kernel.kernel_serves(self, x, state):
            if meta is None:
                if static:
                    raise EngramError("a recorded decode step needs the step's device metadata (meta)")
                meta = attention_kernel.step_meta(seq_starts, past_lens, slots, x.device)
            return fused.attention(self, x, cos, sin, len(slots), meta, state)
        q_residual = self.q_a_norm(self.q_a_proj(x))
        q = unweighted_rms_norm(self.q_b_proj(q_residual).reshape(t, h, d), self.eps)
        q = apply_rope(q, cos.unsqueeze(1), sin.unsqueeze(1))
        kv = apply_rope(self.kv_norm(self.kv_proj(x)), cos, sin)
        if attention_kernel.kernel_serves(self, x, state):
            if meta is None:
                if static:
                    raise EngramError("a recorded decode step needs the step's device metadata (meta)")
                meta = attention_kernel.step_meta(seq_starts, past_lens, slots, x.device)
            out = attention_kernel.core(self, x, q, kv, q_residual, cos, sin, len(slots), meta, state)
        elif static:
            raise EngramError(
                f"layer {self.layer_idx}'s attention core is not on the CUDA kernel "
                f"({attention_kernel.why_not_kernel(self, x, state) or 'backend torch'}); a recorded "
                "decode step cannot take the torch core, whose loop reads the lengths on the host"
            )
        else:
            out = self._core_torch(x, q, kv, q_residual, cos, sin, seq_starts, past_lens, slots, state)
        out = apply_rope(out, cos.unsqueeze(1), -sin.unsqueeze(1))
        grouped = self.o_a_proj(out.reshape(t, self.config.o_groups, -1)).flatten(1)
        return self.o_b_proj(grouped)

    def _core_torch(
        self,
        x: Tensor,
        q: Tensor,
        kv: Tensor,
        q_residual: Tensor,
        cos: Tensor,
        sin: Tensor,
        seq_starts: list[int],
        past_lens: list[int],
        slots: list[int],
        state: dict[str, Tensor],
    ) -> Tensor:
        """The torch path of the core (the CPU's, and the kernel's reference): one
        sequence at a time, all its queries at once. ``[T, H, d]`` before the inverse RoPE."""
        t, h, d = x.shape[0], self.num_heads, self.head_dim
        comp = self.compressor
        if comp is not None:
            c_kv, c_gate = comp.kv_proj(x), comp.gate_proj(x)
        if isinstance(comp, CSACompressor):
            ix = comp.indexer
            i_kv, i_gate = ix.kv_proj(x), ix.gate_proj(x)
            i_q, i_w = ix.queries(q_residual, x, cos, sin)

        out = x.new_zeros(t, h, d)
        window = state["window_kv"]
        for s, slot in enumerate(slots):
            a, b = seq_starts[s], seq_starts[s + 1]
            n, past = b - a, past_lens[s]
            if n == 0:
                continue
            dev = x.device
            q_pos = torch.arange(past, past + n, device=dev)
            first = max(0, past - (self.window - 1))
            old = window[slot][torch.arange(first, past, device=dev) % self.window].to(kv.dtype)
            keys = torch.cat((old, kv[a:b]))
            k_pos = torch.arange(first, past + n, device=dev)
            delta = q_pos.unsqueeze(1) - k_pos.unsqueeze(0)
            mask = (delta >= 0) & (delta < self.window)
            if comp is not None:
                n_entries = comp.update(
                    c_kv[a:b],
                    c_gate[a:b],
                    past,
                    state["compressed_kv"][slot],
                    state["compressor_kv"][slot],
                    state["compressor_gate"][slot],
                    self.rope,
                )
                entries = state["compressed_kv"][slot, :n_entries].to(kv.dtype)
                visible = (q_pos + 1) // comp.rate
                if isinstance(comp, CSACompressor):
                    ix.update(
                        i_kv[a:b],
                        i_gate[a:b],
                        past,
                        state["index_keys"][slot],
                        state["indexer_kv"][slot],
                        state["indexer_gate"][slot],
                        self.rope,
                    )
                    index_keys = state["index_keys"][slot, :n_entries].to(i_q.dtype)
                    entry_mask = ix.select(i_q[a:b], i_w[a:b], index_keys, visible)
                else:
                    entry_mask = torch.arange(n_entries, device=dev).unsqueeze(0) < visible.unsqueeze(1)
                keys = torch.cat((keys, entries))
                mask = torch.cat((mask, entry_mask), dim=1)
            keep = min(n, self.window)
            window[slot][torch.arange(past + n - keep, past + n, device=dev) % self.window] = kv[b - keep : b].to(
                window.dtype
            )
            out[a:b] = self._attend(q[a:b], keys, mask)
        return out

    def _attend(self, q: Tensor, kv: Tensor, mask: Tensor) -> Tensor:
        """``[n, h, d]`` outputs of queries ``q [n, h, d]`` over the shared key/value
        rows ``kv [L, d]`` where ``mask [n, L]``, with each head's sink logit joining the
        softmax's denominator (float32 scores and softmax)."""
        n, h = q.shape[0], q.shape[1]
        scores = torch.einsum("nhd,ld->hnl", wide(q), wide(kv)) * self.scaling
        scores = scores.masked_fill(~mask.unsqueeze(0), float("-inf"))
        sinks = wide(self.sinks).to(scores.dtype).reshape(h, 1, 1).expand(h, n, 1)
        probs = F.softmax(torch.cat((scores, sinks), dim=-1), dim=-1)[..., :-1]
        return torch.einsum("hnl,ld->nhd", probs.to(kv.dtype), kv)


__all__ = ["DeepseekV4Attention", "FP32_PARAMETERS", "GroupedLinear", "layer_type_of", "rope_tables"]
