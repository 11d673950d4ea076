"""The per-sequence state of a Qwen4Exp model, one slot per running sequence, allocated
once (the runtime's KV cache for this family).

Beside the K/V of the full-attention layers a slot carries what makes a chunked prefill
and its decode steps equal one whole forward: each linear-attention layer's short
convolution history and delta-rule state, the QSA indexer's raw keys, each PLE layer's
dilated-convolution history, and the last ``ngram_size - 1`` token ids (the PLE hash's
context, EOS before a sequence's first token). A slot handed to a new sequence is reset
(:meth:`reset`); the modules also ignore what a slot holds when its past length is 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engram_trt.errors import EngramError

# A decode step attends over a power-of-two cache prefix at least this long (the same
# shapes eager and in the CUDA graphs, which record one graph per prefix length).
MIN_DECODE_CONTEXT = 64


def decode_context(longest: int, max_len: int) -> int:
    """The cache prefix a decode step attends over: ``longest`` (the longest sequence
    after the step) rounded up to a power of two >= MIN_DECODE_CONTEXT, at most ``max_len``."""
    n = MIN_DECODE_CONTEXT
    while n < longest:
        n *= 2
    return min(n, max_len)


@dataclass
class Qwen4ExpState:
    keys: dict[int, torch.Tensor]  # attention layer -> [slots, kv_heads, max_len, head_dim]
    values: dict[int, torch.Tensor]
    index_keys: dict[int, torch.Tensor]  # attention layer -> [slots, max_len, indexer_head_dim]
    conv: dict[int, torch.Tensor]  # linear layer -> [slots, *conv shape]
    recurrent: dict[int, torch.Tensor]  # linear layer -> [slots, Hv, dk, dv] float32
    ple_conv: dict[int, torch.Tensor]  # PLE layer -> [slots, hc * hidden, history]
    context: torch.Tensor  # [slots, ngram_size - 1] int64 raw ids on the host (EOS = none yet)
    lengths: list[int]
    max_len: int
    eos_id: int

    @classmethod
    def allocate(
        cls, config: Any, num_slots: int, max_len: int, device: Any = "cpu", dtype: torch.dtype = torch.float32
    ) -> "Qwen4ExpState":
        from engram_trt.models.qwen4_exp.attention import GatedAttention
        from engram_trt.models.qwen4_exp.linear_attention import GatedDeltaNet
        from engram_trt.models.qwen4_exp.modules import PLEFusion

        if num_slots < 1 or max_len < 1:
            raise EngramError(f"a Qwen4Exp state needs num_slots >= 1 and max_len >= 1 (got {num_slots}, {max_len})")
        keys, values, index_keys, conv, rec, ple_conv = {}, {}, {}, {}, {}, {}
        for i in config.attention_layers:
            shapes = GatedAttention.cache_shapes(config, max_len)
            keys[i] = torch.zeros((num_slots, *shapes["key"]), device=device, dtype=dtype)
            values[i] = torch.zeros((num_slots, *shapes["value"]), device=device, dtype=dtype)
            index_keys[i] = torch.zeros((num_slots, *shapes["index_key"]), device=device, dtype=dtype)
        for i in config.linear_layers:
            shapes = GatedDeltaNet.state_shapes(config)
            conv[i] = torch.zeros((num_slots, *shapes["conv"]), device=device, dtype=dtype)
            rec[i] = torch.zeros((num_slots, *shapes["recurrent"]), device=device, dtype=torch.float32)
        n_ctx = 0
        eos = config.first_eos if config.first_eos is not None else 0
        if config.ple is not None:
            n_ctx = config.ple.ngram_size - 1
            for i in config.ple.layers:
                ple_conv[i] = torch.zeros((num_slots, *PLEFusion.state_shape(config)), device=device, dtype=dtype)
        context = torch.full((num_slots, n_ctx), eos, dtype=torch.int64)  # host: see Qwen4ExpModel.ple_rows
        return cls(keys, values, index_keys, conv, rec, ple_conv, context, [0] * num_slots, max_len, eos)

    @property
    def num_slots(self) -> int:
        return int(self.context.shape[0])

    @property
    def batch(self) -> int:
        return self.num_slots

    def nbytes(self) -> int:
        tensors = [
            *self.keys.values(),
            *self.values.values(),
            *self.index_keys.values(),
            *self.conv.values(),
            *self.recurrent.values(),
            *self.ple_conv.values(),
            self.context,
        ]
        return sum(t.numel() * t.element_size() for t in tensors)

    def reset(self, slot: int | None = None) -> None:
        """Free one slot (or all) for a new sequence."""
        slots = range(self.num_slots) if slot is None else [slot]
        for s in slots:
            self.lengths[s] = 0
            self.context[s].fill_(self.eos_id)
            for t in (*self.conv.values(), *self.recurrent.values(), *self.ple_conv.values()):
                t[s].zero_()
