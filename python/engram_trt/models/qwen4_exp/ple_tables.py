"""Qwen4Exp's PLE tables, kept out of the module's parameters: each PLE layer's
``ngram_embedding`` is stored as ``split_ngram_parts`` checkpoint shards
(``...ngram_embedding.shard_{i}.weight``, split along the rows), bound here as one table
without concatenating them in RAM.

Where the rows live (``kind``): ``file`` reads them in place from the checkpoint's file
maps (only the pages of the rows asked for are read; nothing is copied at load), or
``device`` holds each layer as one tensor on the GPU (filled shard by shard, so host
memory never holds a second copy). The checks at open name the first problem: a shard
missing or short, a width other than ``ple_embed_dim / heads``, a row count other than
the one the config's primes give, or checkpoint buffers (multipliers, head sizes,
offsets) that disagree with the config.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Sequence

import numpy as np
import torch

from engram_trt.errors import CheckpointError, EngramError

log = logging.getLogger(__name__)

PLE_TABLE_KINDS = ("file", "device", "memory")
_ROW_DTYPES = ("BF16", "F16", "F32")


def shard_names(prefix: str, layer: int, parts: int) -> list[str]:
    return [f"{prefix}layers.{layer}.ple.ple_embedding.ngram_embedding.shard_{i}.weight" for i in range(parts)]


def buffer_names(prefix: str, layer: int) -> dict[str, str]:
    base = f"{prefix}layers.{layer}.ple.ple_embedding."
    return {"multipliers": base + "layer_multipliers", "vocab_sizes": base + "ngram_heads_vocab_sizes",
            "offsets": base + "ngram_heads_offsets"}


def table_problems(ckpt: Any, config: Any, layout: Any) -> list[str]:
    """One line per problem of the checkpoint's PLE tables and buffers (empty = fine)."""
    ple = config.ple
    out: list[str] = []
    for li, layer in enumerate(ple.layers):
        names = shard_names(config.weight_prefix, layer, ple.split_parts)
        want_rows = int(layout.table_rows[li])
        rows = 0
        for name in names:
            if name not in ckpt:
                out.append(f"PLE table shard {name} is missing (split_ngram_parts={ple.split_parts} shards of "
                           f"[rows, {ple.head_dim}] make layer {layer + 1}'s {want_rows}-row table)")
                rows = -1
                break
            shape = ckpt.shape(name)
            if len(shape) != 2 or shape[1] != ple.head_dim:
                out.append(f"PLE table shard {name} has shape {list(shape)} but rows of width ple_embed_dim / heads = "
                           f"{ple.head_dim}")
                rows = -1
                break
            if ckpt.st_dtype(name) not in _ROW_DTYPES:
                out.append(f"PLE table shard {name} is {ckpt.st_dtype(name)} (expected BF16, F16 or F32 rows)")
            rows += shape[0]
        if rows >= 0 and rows != want_rows:
            out.append(f"PLE table of layer {layer + 1} has {rows} rows in its {ple.split_parts} shards but the config's "
                       f"primes (ngram_vocab_size_base={ple.vocab_size_base}, heads_per_ngram={ple.heads_per_ngram}, "
                       f"make_ngram_vocab_size_divisible_by={ple.divisible_by}) give {want_rows}: the table and the config disagree")
        extra = f"{names[0].rsplit('.shard_', 1)[0]}.shard_{ple.split_parts}.weight"
        if extra in ckpt:
            out.append(f"PLE table of layer {layer + 1} has more shards than split_ngram_parts={ple.split_parts} ({extra})")
        for key, name in buffer_names(config.weight_prefix, layer).items():
            if name not in ckpt:
                continue
            got = ckpt.get(name).to(torch.int64).numpy()
            want = {"multipliers": layout.multipliers[li], "vocab_sizes": layout.head_vocab_sizes[li],
                    "offsets": layout.head_offsets[li]}[key]
            if got.shape != np.shape(want) or not np.array_equal(got, want):
                out.append(f"checkpoint buffer {name} = {got.tolist()[:6]} differs from the {key.replace('_', ' ')} the "
                           f"config gives ({np.asarray(want).tolist()[:6]}): the table was hashed with other settings")
    return out


class PLETables:
    """Per PLE layer, its shards bound as one table (see the module docstring)."""

    def __init__(self, layers: Sequence[Sequence[torch.Tensor]], kind: str, head_dim: int) -> None:
        if kind not in PLE_TABLE_KINDS:
            raise EngramError(f"PLE table kind {kind!r} is not one of {list(PLE_TABLE_KINDS)}")
        self.kind = kind
        self.head_dim = head_dim
        self._shards = [list(s) for s in layers]
        self._starts = [torch.tensor(np.cumsum([0] + [int(t.shape[0]) for t in s]), dtype=torch.int64) for s in layers]

    @classmethod
    def from_checkpoint(cls, ckpt: Any, config: Any, layout: Any, kind: str = "file",
                        device: Any = "cpu", dtype: torch.dtype | None = None) -> "PLETables":
        problems = table_problems(ckpt, config, layout)
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise CheckpointError(f"checkpoint '{ckpt.path}': {problems[0]}{more}")
        ple = config.ple
        layers = []
        for layer in ple.layers:
            names = shard_names(config.weight_prefix, layer, ple.split_parts)
            if kind == "file":
                shards = []
                for name in names:
                    view = ckpt.raw_rows_view(name)  # read-only file map: rows read on demand
                    with warnings.catch_warnings():  # torch cannot mark a tensor read-only; nothing here writes it
                        warnings.simplefilter("ignore", UserWarning)
                        t = torch.frombuffer(memoryview(view).cast("B"), dtype=torch.uint8) if view.size else torch.empty(0, dtype=torch.uint8)
                    shards.append(t.view(ckpt.dtype(name)).reshape(view.shape[0], ple.head_dim))
                layers.append(shards)
            else:
                rows = sum(ckpt.shape(n)[0] for n in names)
                target = torch.device(device) if kind == "device" else torch.device("cpu")
                out = torch.empty((rows, ple.head_dim), dtype=dtype or ckpt.dtype(names[0]), device=target)
                at = 0
                for name in names:  # one shard at a time: no second whole copy on the host
                    t = ckpt.get(name)
                    out[at:at + t.shape[0]].copy_(t)
                    at += t.shape[0]
                    del t
                layers.append([out])
        log.info("PLE tables: %d layer(s), %s", len(layers), kind)
        return cls(layers, kind, ple.head_dim)

    @classmethod
    def from_tensors(cls, tables: Sequence[torch.Tensor], kind: str = "memory") -> "PLETables":
        return cls([[t] for t in tables], kind, int(tables[0].shape[1]))

    @property
    def num_layers(self) -> int:
        return len(self._shards)

    def num_rows(self, layer_idx: int) -> int:
        return int(self._starts[layer_idx][-1])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self._shards for t in s)

    def gather(self, layer_idx: int, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (int64, any shape) of one layer's table: ``[*ids.shape, head_dim]``
        on ``ids``' device, in the table's dtype."""
        shards = self._shards[layer_idx]
        n = self.num_rows(layer_idx)
        if ids.numel():
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= n:
                raise EngramError(f"PLE row id {lo if lo < 0 else hi} is outside layer {layer_idx}'s table (rows 0..{n - 1})")
        if len(shards) == 1:
            t = shards[0]
            return t[ids.to(t.device)].to(ids.device)
        flat = ids.reshape(-1).cpu()
        starts = self._starts[layer_idx]
        which = torch.searchsorted(starts, flat, right=True) - 1
        out = torch.empty((flat.numel(), self.head_dim), dtype=shards[0].dtype)
        for s in torch.unique(which).tolist():
            sel = (which == s).nonzero().flatten()
            out[sel] = shards[s][flat[sel] - starts[s]]
        return out.reshape(*ids.shape, self.head_dim).to(ids.device)
