"""The per-sequence state of a DeepSeek-V4 model, one slot per running sequence,
allocated once (the runtime's KV cache for this family).

What a slot holds per layer is the attention's to say (:meth:`DeepseekV4Attention.state_shapes`:
the sliding-window K=V entries, the compressors' pending tokens and emitted entries, the
indexer's keys...): this module only allocates ``[num_slots, *shape]`` per name, in
float32 or the compute dtype as asked. Beside them, per slot, the number of tokens held
and, for V4.1, the Engram lookback (the last N-1 compressed ids, so a chunked prefill or
a decode step hashes exactly as one whole-sequence forward would; the runtime's
prefetcher reads it as it reads engram-llama's :class:`~engram_trt.models.kv_cache.KVCache`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engram_trt.engram.hashing import DEAD
from engram_trt.errors import EngramError

_DTYPES = ("float32", "compute")


@dataclass
class DeepseekV4State:
    layers: list[dict[str, torch.Tensor]]  # per decoder layer: name -> [num_slots, *shape]
    lookback: torch.Tensor  # [num_slots, N-1] compressed ids (-1 = none); N-1 = 0 without Engram
    lengths: list[int]
    max_len: int

    @classmethod
    def allocate(cls, config: Any, num_slots: int, max_len: int, device: Any = "cpu",
                 dtype: torch.dtype = torch.float32) -> "DeepseekV4State":
        from engram_trt.models.deepseek_v4.attention import DeepseekV4Attention

        if num_slots < 1 or max_len < 1:
            raise EngramError(f"a DeepSeek-V4 state needs num_slots >= 1 and max_len >= 1 (got {num_slots}, {max_len})")
        layers = []
        for i in range(config.num_hidden_layers):
            tensors = {}
            for name, (shape, kind) in DeepseekV4Attention.state_shapes(config, i, max_len).items():
                if kind not in _DTYPES:
                    raise EngramError(f"layer {i} state {name!r} asks for dtype {kind!r} (expected one of {_DTYPES})")
                tensors[name] = torch.zeros((num_slots, *shape), device=device,
                                            dtype=torch.promote_types(dtype, torch.float32) if kind == "float32" else dtype)
            layers.append(tensors)
        n = config.engram.max_ngram_size - 1 if config.engram is not None else 0
        lookback = torch.full((num_slots, n), DEAD, dtype=torch.int64, device=device)
        return cls(layers, lookback, [0] * num_slots, max_len)

    @property
    def num_slots(self) -> int:
        return int(self.lookback.shape[0])

    @property
    def batch(self) -> int:
        return self.num_slots

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer.values())

    def reset(self, slot: int | None = None) -> None:
        """Free one slot (or all) for a new sequence: its length, lookback and every
        per-layer tensor (the attention may also ignore a slot whose past length is 0)."""
        slots = range(self.num_slots) if slot is None else [slot]
        for s in slots:
            self.lengths[s] = 0
            self.lookback[s].fill_(DEAD)
            for layer in self.layers:
                for t in layer.values():
                    t[s].zero_()
