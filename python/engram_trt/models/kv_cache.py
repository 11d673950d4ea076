"""The KV cache every backend writes in place: one slot per sequence.

Per decoder layer ``keys[i]`` / ``values[i]`` ``[num_slots, kv_heads, max_len,
head_dim]`` are allocated once (fixed addresses: a captured CUDA graph or a TensorRT
engine binds them), and a step writes each new token's K/V at ``[slot, :, position]``.
Beside them, per slot, the Engram lookback (the last N-1 compressed ids, so a chunked
prefill or a decode step hashes exactly as one whole-sequence forward would) and the
number of tokens held. Slots are handed out by the runtime's scheduler; the cache only
stores and checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engram_trt.config.model import ModelConfig
from engram_trt.engram.hashing import DEAD
from engram_trt.errors import EngramError


@dataclass
class KVCache:
    """K/V per layer ``[num_slots, kv_heads, max_len, head_dim]``, the Engram lookback
    ``[num_slots, N-1]`` (-1 = none) and ``lengths[slot]``, the tokens each slot holds."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    lookback: torch.Tensor
    lengths: list[int]

    @classmethod
    def allocate(
        cls, config: ModelConfig, num_slots: int, max_len: int, device: Any = "cpu", dtype: torch.dtype = torch.float32
    ) -> "KVCache":
        if num_slots < 1 or max_len < 1:
            raise EngramError(f"a KV cache needs num_slots >= 1 and max_len >= 1 (got {num_slots}, {max_len})")
        shape = (num_slots, config.num_key_value_heads, max_len, config.head_dim)
        keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_hidden_layers)]
        values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_hidden_layers)]
        n = config.engram.max_ngram_size - 1 if config.engram is not None else 0
        lookback = torch.full((num_slots, n), DEAD, dtype=torch.int64, device=device)
        return cls(keys, values, lookback, [0] * num_slots)

    @property
    def num_slots(self) -> int:
        return int(self.lookback.shape[0])

    @property
    def batch(self) -> int:
        """The slot count (the batch of the uniform-batch API)."""
        return self.num_slots

    @property
    def max_len(self) -> int:
        return int(self.keys[0].shape[2]) if self.keys else 0

    @property
    def seq_len(self) -> int:
        """Tokens per sequence when every slot holds the same number (the uniform-batch
        API's view); a ragged cache has no single length."""
        if len(set(self.lengths)) != 1:
            raise EngramError(f"the cache's slots hold different lengths {self.lengths}; use lengths[slot]")
        return self.lengths[0]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def reset(self, slot: int | None = None) -> None:
        """Free one slot (or all) for a new sequence; K/V entries are overwritten as they are reused."""
        slots = range(self.num_slots) if slot is None else [slot]
        for s in slots:
            self.lengths[s] = 0
            self.lookback[s].fill_(DEAD)
