"""The per-sequence state of a DeepSeek-V4 model, one slot per running sequence,
allocated once (the runtime's KV cache for this family).

What a slot holds per layer is the attention's to say (:meth:`DeepseekV4Attention.state_shapes`:
the sliding-window K=V entries, the compressors' pending tokens and emitted entries, the
indexer's keys...): this module only allocates ``[num_slots, *shape]`` per name, in
float32 or the compute dtype as asked. Beside them, per slot, the number of tokens held
and, for V4.1, the Engram lookback (the last N-1 compressed ids, so a chunked prefill or
a decode step hashes exactly as one whole-sequence forward would; the runtime's
prefetcher reads it as it reads engram-llama's :class:`~engram_trt.models.kv_cache.KVCache`).

Memory: :func:`state_bytes` is what :meth:`DeepseekV4State.allocate` will take, from the
config alone; on a GPU a state that does not fit the free memory is refused before any
tensor of it is allocated (one line naming the bytes needed and free, and the fix).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engram_trt.engram.hashing import DEAD
from engram_trt.errors import EngramError

_DTYPES = ("float32", "compute")


def _layer_dtypes(config: Any, layer: int, max_len: int, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], Any]]:
    """Layer ``layer``'s state: name -> (per-slot shape, dtype)."""
    from engram_trt.models.deepseek_v4.attention import DeepseekV4Attention

    out = {}
    for name, (shape, kind) in DeepseekV4Attention.state_shapes(config, layer, max_len).items():
        if kind not in _DTYPES:
            raise EngramError(f"layer {layer} state {name!r} asks for dtype {kind!r} (expected one of {_DTYPES})")
        out[name] = (shape, torch.promote_types(dtype, torch.float32) if kind == "float32" else dtype)
    return out


def state_bytes(config: Any, num_slots: int, max_len: int, dtype: torch.dtype = torch.float32) -> int:
    """Bytes a state of ``num_slots`` slots of ``max_len`` tokens takes (every layer's
    tensors and the Engram lookback), from the config alone."""
    total = 0
    for i in range(config.num_hidden_layers):
        for shape, dt in _layer_dtypes(config, i, max_len, dtype).values():
            n = num_slots
            for d in shape:
                n *= int(d)
            total += n * torch.empty((), dtype=dt).element_size()
    n_lookback = config.engram.max_ngram_size - 1 if config.engram is not None else 0
    return total + num_slots * n_lookback * 8


def check_state_fits(config: Any, num_slots: int, max_len: int, device: Any, dtype: torch.dtype) -> int:
    """The state's bytes; on a CUDA device, an EngramError (one line: the bytes needed, the
    bytes free, the fix) when they exceed the free memory. Nothing is allocated."""
    need = state_bytes(config, num_slots, max_len, dtype)
    dev = torch.device(device)
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
        if need > free:
            raise EngramError(
                f"a DeepSeek-V4 state of {num_slots} slots x {max_len} tokens needs {need} bytes "
                f"({need / 2**30:.2f} GiB) on {dev} but only {free} bytes ({free / 2**30:.2f} GiB of "
                f"{total / 2**30:.2f} GiB) are free; lower --max-batch-size or --max-seq-len"
            )
    return need


@dataclass
class DeepseekV4State:
    layers: list[dict[str, torch.Tensor]]  # per decoder layer: name -> [num_slots, *shape]
    lookback: torch.Tensor  # [num_slots, N-1] compressed ids (-1 = none); N-1 = 0 without Engram
    lengths: list[int]
    max_len: int

    @classmethod
    def allocate(
        cls, config: Any, num_slots: int, max_len: int, device: Any = "cpu", dtype: torch.dtype = torch.float32
    ) -> "DeepseekV4State":
        if num_slots < 1 or max_len < 1:
            raise EngramError(f"a DeepSeek-V4 state needs num_slots >= 1 and max_len >= 1 (got {num_slots}, {max_len})")
        check_state_fits(config, num_slots, max_len, device, dtype)  # refused before anything is allocated
        layers = [
            {
                name: torch.zeros((num_slots, *shape), device=device, dtype=dt)
                for name, (shape, dt) in _layer_dtypes(config, i, max_len, dtype).items()
            }
            for i in range(config.num_hidden_layers)
        ]
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
