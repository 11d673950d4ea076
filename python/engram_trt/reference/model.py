"""engram-llama in PyTorch: the reference model and the ``torch`` backend.

The architecture is the one in notes/engram-spec.md ("Reference architecture"): a
Llama-style decoder (RMSNorm, RoPE attention with grouped KV heads, SwiGLU MLP)
whose residual stream is ``hc_mult`` copies ``[B, T, hc, D]``. Each sublayer reads the
mean of the copies and adds its output to every copy; at the start of an Engram
layer the n-gram rows are hashed, gathered, projected by ``wkv`` and gated into each
copy (:func:`engram_trt.fusion.engram_gate`); the final norm reads the mean.

Design points, and why:

* Tables are not module parameters but an :class:`EngramTables` object with one
  method, ``rows(layer_idx, ids)``. Tables are the one part that does not fit on a
  GPU for real models, so the runtime swaps their storage (GPU, pinned host, the
  checkpoint's file-backed mmap) without touching the model.
* The Engram step takes its rows either gathered here or precomputed by the caller
  (``engram_rows``): the prefetch placement, where the runtime hashes and gathers
  on a side stream before the step, then hands the staged rows to the model.
* :class:`KVCache` carries the Engram lookback (the last ``N-1`` compressed ids per
  sequence) next to the K/V tensors, so a chunked prefill and decode steps hash
  exactly as one whole-sequence forward would.
* The model compresses raw ids itself (``compress_lookup``): callers hand it token
  ids, never compressed ids, unless they override them (``engram_ids``) e.g. to
  mark dead tokens.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engram_trt.checkpoint.checkpoint import Checkpoint, backbone_tensor_shapes, engram_tensor_names, require_valid
from engram_trt.config.model import ModelConfig
from engram_trt.errors import CheckpointError, EngramError
from engram_trt.engram.fusion import engram_gate
from engram_trt.engram.hashing import DEAD, hash_ids_torch
from engram_trt.engram.layout import EngramLayout
from engram_trt.engram.quant import dequant_fp8_rows_torch

log = logging.getLogger(__name__)

TABLE_STORAGES = ("memory", "pinned", "mmap")
ENGRAM_BACKENDS = ("auto", "torch", "kernels")


def model_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter :class:`EngramLlama` needs (checkpoint names and shapes), tables
    excluded: the backbone plus each Engram layer's ``wkv``, ``q_weight``, ``k_weight``."""
    out = dict(backbone_tensor_shapes(config))
    spec = config.require_model()
    if spec is not None:
        assert spec.head_dim is not None
        D, hc = config.hidden_size, config.hc_mult
        for lid in spec.layer_ids:
            names = engram_tensor_names(lid, spec.prefix)
            out[names["wkv"]] = ((hc + 1) * D, spec.n_hash_cols * spec.head_dim)
            out[names["q_weight"]] = (hc, D)
            out[names["k_weight"]] = (hc, D)
    return out


# --------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------
class EngramTables:
    """Row storage of every Engram layer, held as tensors (CPU or GPU).

    ``tables[i]`` is layer i's ``[rows, head_dim]`` table: FP8 e4m3 (viewed as uint8)
    with ``scales[i]`` ``[rows, head_dim/quant_block]`` ue8m0 bytes, or bf16 with
    ``scales[i] = None``. :meth:`rows` returns dequantized bf16 rows, as the GPU gather
    kernel does (FP8 times a power of two is exact in bf16).
    """

    def __init__(self, tables: Sequence[torch.Tensor], scales: Sequence[torch.Tensor | None],
                 quant_block: int = 32) -> None:
        if len(tables) != len(scales):
            raise EngramError(f"{len(tables)} tables but {len(scales)} scale entries (one per Engram layer, None for bf16)")
        self.quant_block = int(quant_block)
        self.tables: list[torch.Tensor] = []
        self.scales: list[torch.Tensor | None] = []
        for i, (t, s) in enumerate(zip(tables, scales)):
            if t.ndim != 2:
                raise EngramError(f"Engram table {i} must be 2-D [rows, head_dim] (got {tuple(t.shape)})")
            if s is None:
                if t.element_size() == 1:
                    raise EngramError(f"Engram table {i} is one byte per value (FP8) but has no scales")
                self.tables.append(t)
            else:
                want = (t.shape[0], t.shape[1] // self.quant_block)
                if tuple(s.shape) != want or t.shape[1] % self.quant_block:
                    raise EngramError(f"Engram table {i} {tuple(t.shape)} needs scales {want} (got {tuple(s.shape)})")
                self.tables.append(t.view(torch.uint8))
                s = s.view(torch.uint8)
            self.scales.append(s)

    @property
    def num_layers(self) -> int:
        return len(self.tables)

    def head_dim(self, layer_idx: int) -> int:
        return int(self.tables[layer_idx].shape[1])

    def num_rows(self, layer_idx: int) -> int:
        return int(self.tables[layer_idx].shape[0])

    def is_fp8(self, layer_idx: int) -> bool:
        return self.scales[layer_idx] is not None

    def _raw_rows(self, layer_idx: int, flat_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Stored bytes of rows ``flat_ids`` (storage-specific; subclasses override)."""
        t = self.tables[layer_idx]
        idx = flat_ids.to(t.device)
        s = self.scales[layer_idx]
        return t.index_select(0, idx), None if s is None else s.index_select(0, idx)

    def rows(self, layer_idx: int, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (any int shape) of layer ``layer_idx``: bf16 ``[*ids.shape, head_dim]``
        on ``ids``'s device."""
        flat = ids.reshape(-1).to(torch.int64)
        n = self.num_rows(layer_idx)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= n):
            bad = int(flat.min()) if int(flat.min()) < 0 else int(flat.max())
            raise EngramError(f"row id {bad} is outside Engram table {layer_idx} (rows 0..{n - 1}): the table does not cover the layout")
        raw, scale = self._raw_rows(layer_idx, flat)
        if scale is None:
            out = raw.to(torch.bfloat16)
        else:
            out = dequant_fp8_rows_torch(raw, scale, self.quant_block, dtype=torch.bfloat16)
        return out.to(ids.device).reshape(*ids.shape, self.head_dim(layer_idx))

    def nbytes(self) -> int:
        total = 0
        for t, s in zip(self.tables, self.scales):
            total += t.numel() * t.element_size() + (0 if s is None else s.numel())
        return total

    @classmethod
    def from_weights(cls, config: ModelConfig, weights: Mapping[str, torch.Tensor],
                     device: str | torch.device = "cpu") -> "EngramTables":
        """Tables taken from a weight dict holding the checkpoint names."""
        spec = config.require_engram("building Engram tables")
        tables, scales = [], []
        for lid in spec.layer_ids:
            names = engram_tensor_names(lid, spec.prefix)
            if names["table"] not in weights:
                raise CheckpointError(f"weights lack Engram table '{names['table']}'")
            t = weights[names["table"]]
            s = weights.get(names["scale"]) if t.element_size() == 1 else None
            tables.append(t.to(device))
            scales.append(None if s is None else s.to(device))
        return cls(tables, scales, spec.quant_block)

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint, device: str | torch.device = "cpu",
                        storage: str = "memory") -> "EngramTables":
        """``storage='memory'`` copies each table to ``device``; ``'mmap'`` reads rows
        from the checkpoint's files on demand (no copy; see :class:`MmapEngramTables`)."""
        spec = ckpt.config.require_engram("reading Engram tables")
        if storage == "mmap":
            return MmapEngramTables(ckpt)
        if storage not in TABLE_STORAGES:
            raise EngramError(f"table storage {storage!r} is not one of {list(TABLE_STORAGES)}")
        if storage == "pinned" and not torch.cuda.is_available():
            raise EngramError("table storage 'pinned' (host memory the GPU reads through UVA) needs a CUDA device; use 'memory' or 'mmap' here")
        tables, scales = [], []

        def place(t: torch.Tensor) -> torch.Tensor:
            return t.pin_memory() if storage == "pinned" else t.to(device)

        for lid in spec.layer_ids:
            names = engram_tensor_names(lid, spec.prefix)
            t = ckpt.get(names["table"])
            tables.append(place(t))
            scales.append(place(ckpt.get(names["scale"])) if t.element_size() == 1 else None)
        return cls(tables, scales, spec.quant_block)

    def host_views(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layer ``layer_idx``'s stored bytes as CPU tensors (for the host gather)."""
        return self.tables[layer_idx], self.scales[layer_idx]


class MmapEngramTables(EngramTables):
    """Tables read straight from the checkpoint's safetensors files (file-backed mmap).

    Nothing is copied up front: each step reads only its rows' pages through the page
    cache (:meth:`Checkpoint.get_rows`). The files must not be truncated while in use
    (a read of a vanished page kills the process with SIGBUS); an in-place overwrite
    serves the new bytes.
    """

    def __init__(self, ckpt: Checkpoint) -> None:
        spec = ckpt.config.require_engram("reading Engram tables")
        self.ckpt = ckpt
        self.quant_block = spec.quant_block
        self._names = [engram_tensor_names(lid, spec.prefix) for lid in spec.layer_ids]
        self._shapes = [ckpt.shape(n["table"]) for n in self._names]
        self._fp8 = [ckpt.info(n["table"]).itemsize == 1 for n in self._names]
        self.tables = []  # no resident tensors: rows come from the files
        self.scales = []

    @property
    def num_layers(self) -> int:
        return len(self._names)

    def head_dim(self, layer_idx: int) -> int:
        return int(self._shapes[layer_idx][1])

    def num_rows(self, layer_idx: int) -> int:
        return int(self._shapes[layer_idx][0])

    def is_fp8(self, layer_idx: int) -> bool:
        return self._fp8[layer_idx]

    def nbytes(self) -> int:
        """Resident bytes: none (the page cache holds what was read)."""
        return 0

    def host_views(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Zero-copy CPU tensors over the file-backed map: the host gather reads the
        rows it needs straight from the page cache (no table copy at all)."""
        import warnings

        names = self._names[layer_idx]
        with warnings.catch_warnings():  # the map is read-only; nothing writes through these views
            warnings.simplefilter("ignore", UserWarning)
            rows = torch.from_numpy(self.ckpt.raw_rows_view(names["table"]))
            scale = torch.from_numpy(self.ckpt.raw_rows_view(names["scale"])) if self._fp8[layer_idx] else None
        if not self._fp8[layer_idx]:
            rows = rows.view(torch.bfloat16)
        return rows, scale

    def _raw_rows(self, layer_idx: int, flat_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        names = self._names[layer_idx]
        ids = flat_ids.cpu()
        rows = self.ckpt.get_rows(names["table"], ids)
        if not self._fp8[layer_idx]:
            return rows, None
        return rows.view(torch.uint8), self.ckpt.get_rows(names["scale"], ids).view(torch.uint8)


# --------------------------------------------------------------------------------------
# The Engram steps through the CUDA kernel library
# --------------------------------------------------------------------------------------
class KernelEngramOps:
    """Hash, gather and gate through the kernel library the TensorRT plugins call
    (``libengram_trt_plugins.so``, via :mod:`engram_trt.kernels`): one kernel library,
    two callers, so the GPU path without TensorRT runs the plugins' very kernels.

    Tables on the GPU or in pinned host memory are read by the gather kernel (device
    memory or UVA); tables in ordinary host memory or file-backed maps go through the
    host gather (CPU threads into pinned staging, then one copy per chunk).
    """

    name = "cuda-kernels"

    def __init__(self, layout: EngramLayout, device: torch.device) -> None:
        from engram_trt import kernels

        kernels.load_library()
        kernels.check_layout(layout)
        self.kernels = kernels
        self.layout = layout
        self.device = device

    def hash(self, cids: torch.Tensor, lookback: torch.Tensor | None) -> torch.Tensor:
        """int32 ``[B, T, L, cols]`` row ids of compressed ids ``[B, T]`` (one packed launch)."""
        B, T = cids.shape
        starts = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=self.device)
        lb = None if lookback is None else lookback.to(device=self.device, dtype=torch.int32).contiguous()
        out = self.kernels.hash_packed(cids.reshape(-1).to(torch.int32).contiguous(), starts, lb, self.layout)
        return out.reshape(B, T, self.layout.num_layers, self.layout.n_hash_cols)

    def rows(self, tables: EngramTables, layer_idx: int, hash_ids: torch.Tensor) -> torch.Tensor:
        """bf16 ``[B, T, cols, head_dim]`` rows of one layer."""
        B, T, L, cols = hash_ids.shape
        flat = hash_ids.reshape(B * T, L, cols).to(torch.int32).contiguous()
        rows, scales = tables.host_views(layer_idx) if isinstance(tables, MmapEngramTables) else \
            (tables.tables[layer_idx], tables.scales[layer_idx])
        if rows.is_cuda or rows.is_pinned():
            out = self.kernels.gather(flat.to(self.device), rows, scales, layer=layer_idx, quant_block=tables.quant_block)
        else:
            out = self.kernels.host_gather(flat.cpu(), rows, scales, layer=layer_idx, quant_block=tables.quant_block,
                                           device=self.device)
        return out.reshape(B, T, cols, rows.shape[1])

    def gate(self, hidden: torch.Tensor, kv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
             live: torch.Tensor, eps: float) -> torch.Tensor:
        return self.kernels.gate(hidden.contiguous(), kv.contiguous(), q_weight, k_weight, live.contiguous(), eps=eps)


# --------------------------------------------------------------------------------------
# Cache
# --------------------------------------------------------------------------------------
@dataclass
class KVCache:
    """Per-layer K/V ``[B, kv_heads, max_len, head_dim]`` preallocated, plus the Engram
    lookback ``[B, N-1]`` (the last N-1 compressed ids of each sequence, -1 = none)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    lookback: torch.Tensor
    seq_len: int = 0

    @classmethod
    def allocate(cls, config: ModelConfig, batch: int, max_len: int, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32) -> "KVCache":
        if batch < 1 or max_len < 1:
            raise EngramError(f"a KV cache needs batch >= 1 and max_len >= 1 (got batch={batch}, max_len={max_len})")
        shape = (batch, config.num_key_value_heads, max_len, config.head_dim)
        keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_hidden_layers)]
        values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_hidden_layers)]
        n = config.engram.max_ngram_size - 1 if config.engram is not None else 0
        lookback = torch.full((batch, n), DEAD, dtype=torch.int64, device=device)
        return cls(keys, values, lookback, 0)

    @property
    def batch(self) -> int:
        return int(self.lookback.shape[0])

    @property
    def max_len(self) -> int:
        return int(self.keys[0].shape[2]) if self.keys else 0

    def reset(self) -> None:
        """Start new sequences (K/V slots are overwritten as they are reused)."""
        self.seq_len = 0
        self.lookback.fill_(DEAD)


# --------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------
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


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        D, hd = config.hidden_size, config.head_dim
        self.n_heads, self.n_kv, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        self.q_proj = nn.Linear(D, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(D, self.n_kv * hd, bias=False)
        self.v_proj = nn.Linear(D, self.n_kv * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, D, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: int,
                cache: KVCache | None, layer: int) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if cache is not None:
            cache.keys[layer][:, :, start:start + T] = k
            cache.values[layer][:, :, start:start + T] = v
            k = cache.keys[layer][:, :, :start + T]
            v = cache.values[layer][:, :, :start + T]
            key_pos0 = 0
        else:
            key_pos0 = start
        groups = self.n_heads // self.n_kv
        k = k.repeat_interleave(groups, dim=1)  # head h reads kv head h // groups
        v = v.repeat_interleave(groups, dim=1)
        S = k.shape[2]
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) / math.sqrt(self.head_dim)
        q_pos = torch.arange(start, start + T, device=x.device)
        k_pos = torch.arange(key_pos0, key_pos0 + S, device=x.device)
        allowed = k_pos[None, :] <= q_pos[:, None]
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs, v.float()).to(x.dtype)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        D, I = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(D, I, bias=False)
        self.up_proj = nn.Linear(D, I, bias=False)
        self.down_proj = nn.Linear(I, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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

    def forward(self, hidden: torch.Tensor, rows: torch.Tensor, live: torch.Tensor,
                ops: KernelEngramOps | None = None) -> torch.Tensor:
        """hidden ``[B, T, hc, D]``, rows ``[B, T, cols, head_dim]``, live ``[B, T]`` bool;
        the gate runs in the kernel library when ``ops`` is given (bf16 only)."""
        B, T, hc, D = hidden.shape
        e = rows.reshape(B, T, -1).to(self.wkv.weight.dtype)
        kv = self.wkv(e)
        args = (hidden.reshape(B * T, hc, D), kv.reshape(B * T, -1), self.q_weight, self.k_weight, live.reshape(B * T))
        out = engram_gate(*args, self.eps) if ops is None else ops.gate(*args, self.eps)
        return out.reshape(B, T, hc, D)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, engram_attr: str | None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)
        self.engram_attr = engram_attr
        if engram_attr is not None:
            # Registered under the checkpoint's prefix ('engram' or 'ple') so that
            # parameter names equal checkpoint names.
            setattr(self, engram_attr, EngramModule(config))

    @property
    def engram_module(self) -> EngramModule | None:
        """The Engram submodule (named 'engram' or 'ple' after the checkpoint), if any."""
        return None if self.engram_attr is None else getattr(self, self.engram_attr)


class Backbone(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        index = config.engram_layer_index
        prefix = config.engram.prefix if config.engram is not None else None
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, prefix if i in index else None) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


# --------------------------------------------------------------------------------------
# Generation result
# --------------------------------------------------------------------------------------
@dataclass
class GenerateResult:
    """Tokens and timings of one :meth:`EngramLlama.generate` call."""

    prompt_ids: list[int]
    new_ids: list[int]
    prefill_s: float
    decode_s: float
    stopped_at_eos: bool
    decode_steps: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.new_ids

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second over the whole call (prefill included)."""
        return len(self.new_ids) / self.total_s if self.total_s > 0 else float("inf")

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_steps / self.decode_s if self.decode_s > 0 else float("inf")

    @property
    def prefill_tokens_per_s(self) -> float:
        return len(self.prompt_ids) / self.prefill_s if self.prefill_s > 0 else float("inf")


def sample_next(logits: torch.Tensor, temperature: float, top_p: float,
                generator: torch.Generator | None) -> int:
    """One token from ``logits [V]``: greedy when ``temperature == 0``, else
    temperature-scaled nucleus sampling (the smallest set of most likely tokens whose
    probability reaches ``top_p``; the most likely token is always kept, so a tiny
    ``top_p`` is greedy). Sampling runs on the CPU so a seed gives the same tokens on
    any device."""
    logits = logits.detach().float().cpu()
    if temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True, stable=True)
        keep = (torch.cumsum(sorted_p, dim=-1) - sorted_p) < top_p
        keep[0] = True
        sorted_p = sorted_p * keep
        choice = torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=generator)
        return int(order[choice])
    return int(torch.multinomial(probs, 1, generator=generator))


# --------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------
class EngramLlama(nn.Module):
    """engram-llama: parameter names equal HF checkpoint names (``model.layers.1.engram.wkv.weight``...).

    Build with :meth:`from_checkpoint`, or directly from a config and a weight dict
    (``compress_lookup`` int64 ``[vocab]`` maps raw ids to compressed ids; tests pass a
    small one so they need no tokenizer). Tables come from ``tables`` or, when the
    weight dict holds them, from there.
    """

    def __init__(self, config: ModelConfig, weights: Mapping[str, torch.Tensor], *,
                 tables: EngramTables | None = None, compress_lookup: Any = None,
                 layout: EngramLayout | None = None, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, engram_backend: str = "auto") -> None:
        super().__init__()
        self.config = config
        self.engram_ops: KernelEngramOps | None = None
        if engram_backend not in ENGRAM_BACKENDS:
            raise EngramError(f"engram_backend {engram_backend!r} is not one of {list(ENGRAM_BACKENDS)}")
        self.compute_dtype = dtype
        spec = config.require_model()
        with torch.device("meta"):
            self.model = Backbone(config)
            self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._load_weights(weights, torch.device(device), dtype)
        hd = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=device) / hd))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.layout: EngramLayout | None = None
        self.tables: EngramTables | None = None
        self._engram_layer_index = config.engram_layer_index
        if spec is None:
            self.register_buffer("compress_lookup", None, persistent=False)
            return
        if compress_lookup is None:
            raise EngramError("an Engram model needs the compressed-vocab lookup (raw id -> compressed id); build it from the checkpoint's tokenizer.json (EngramLlama.from_checkpoint does)")
        lookup = torch.as_tensor(np.asarray(compress_lookup) if not isinstance(compress_lookup, torch.Tensor) else compress_lookup,
                                 dtype=torch.int64).reshape(-1)
        if lookup.numel() == 0 or int(lookup.max()) >= spec.compressed_vocab_size or int(lookup.min()) < DEAD:
            raise EngramError(f"the compressed-vocab lookup holds ids outside -1..{spec.compressed_vocab_size - 1} ({spec.field_name('compressed_vocab_size')}={spec.compressed_vocab_size}): the tokenizer does not belong to this config")
        if lookup.numel() < config.vocab_size:
            # Ids the tokenizer does not know (vocab padding) have no text: dead for Engram.
            lookup = torch.cat([lookup, torch.full((config.vocab_size - lookup.numel(),), DEAD, dtype=torch.int64)])
        if spec.pad_token_id >= lookup.numel() or int(lookup[spec.pad_token_id]) < 0:
            raise EngramError(f"{spec.field_name('pad_token_id')}={spec.pad_token_id} has no compressed id in the tokenizer")
        self.register_buffer("compress_lookup", lookup.to(device), persistent=False)
        if layout is None:
            layout = EngramLayout.from_spec(spec, pad_id=int(lookup[spec.pad_token_id]))
        if tuple(layout.layer_ids) != tuple(spec.layer_ids):
            raise EngramError(f"layout layers {list(layout.layer_ids)} differ from the config's {list(spec.layer_ids)}")
        self.layout = layout
        self.engram_ops = self._select_engram_ops(engram_backend, layout, torch.device(device), dtype)
        if tables is None and any(engram_tensor_names(l, spec.prefix)["table"] in weights for l in spec.layer_ids):
            tables = EngramTables.from_weights(config, weights, device)
        if tables is not None:
            self.set_tables(tables)

    # -- construction helpers ------------------------------------------------------
    @staticmethod
    def _select_engram_ops(backend: str, layout: EngramLayout, device: torch.device,
                           dtype: torch.dtype) -> KernelEngramOps | None:
        """``auto``: the kernel library on a CUDA device in bf16 when it loads, else the
        PyTorch path; ``kernels``: the kernel library or a clear error; ``torch``: PyTorch."""
        if backend == "torch":
            return None
        usable = device.type == "cuda" and dtype == torch.bfloat16
        if not usable:
            if backend == "kernels":
                raise EngramError(f"engram_backend 'kernels' runs on a CUDA device in bfloat16 (got {device}, {dtype}); use 'torch' or 'auto'")
            return None
        try:
            return KernelEngramOps(layout, device)
        except EngramError as exc:
            if backend == "kernels":
                raise
            log.warning("Engram CUDA kernels unavailable (%s); using the PyTorch path", exc)
            return None

    def _load_weights(self, weights: Mapping[str, torch.Tensor], device: torch.device, dtype: torch.dtype) -> None:
        expected = model_weight_shapes(self.config)
        params = dict(self.named_parameters())
        for name, want in expected.items():
            if name not in weights:
                raise CheckpointError(f"weights lack tensor '{name}' (expected shape {list(want)})")
            t = weights[name]
            if tuple(t.shape) != want:
                raise CheckpointError(f"tensor '{name}' has shape {list(t.shape)} but the config needs {list(want)}")
            if name not in params:
                raise EngramError(f"internal: parameter '{name}' is not part of the module")
            owner_name, _, leaf = name.rpartition(".")
            owner = self.get_submodule(owner_name)
            setattr(owner, leaf, nn.Parameter(t.to(device=device, dtype=dtype), requires_grad=False))
        leftover = [n for n, p in self.named_parameters() if p.is_meta]
        if leftover:
            raise EngramError(f"internal: parameters {leftover[:3]} were not loaded")

    def set_tables(self, tables: EngramTables) -> None:
        """Attach (or swap) the row storage; checked against the layout."""
        spec = self.config.engram
        if spec is None or self.layout is None:
            raise EngramError("this model has no Engram layers, so it takes no tables")
        if tables.num_layers != self.layout.num_layers:
            raise EngramError(f"{tables.num_layers} tables for {self.layout.num_layers} Engram layers")
        for li in range(tables.num_layers):
            need = int(self.layout.table_rows[li])
            if tables.num_rows(li) < need:
                raise EngramError(f"Engram table of layer {self.layout.layer_ids[li]} has {tables.num_rows(li)} rows but the layout needs at least {need}: the checkpoint does not cover {spec.field_name('num_embeddings')}/primes")
            if tables.head_dim(li) != spec.head_dim:
                raise EngramError(f"Engram table of layer {self.layout.layer_ids[li]} has rows of width {tables.head_dim(li)} but {spec.field_name('head_dim')}={spec.head_dim}")
        self.tables = tables

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint | str, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32, table_storage: str = "memory",
                        compressed_vocab: Any = None, engram_backend: str = "auto") -> "EngramLlama":
        """Build from a checkpoint: config, validated tensors, compressed vocab from its
        tokenizer.json (size checked against the config), tables in ``table_storage``."""
        from engram_trt.engram.tokenizer import build_compressed_vocab, check_compressed_size

        if not isinstance(ckpt, Checkpoint):
            ckpt = Checkpoint.open(ckpt)
        cfg = ckpt.config
        spec = cfg.require_model()
        lookup = None
        layout = None
        if spec is not None:
            if compressed_vocab is None:
                if ckpt.tokenizer_json is None:
                    raise CheckpointError(f"checkpoint '{ckpt.path}' has no tokenizer.json, which Engram needs to compress token ids (copy the model's tokenizer.json into the folder)")
                compressed_vocab = build_compressed_vocab(ckpt.tokenizer_json)
            check_compressed_size(compressed_vocab, spec.compressed_vocab_size, spec.field_name("compressed_vocab_size"))
            lookup = np.asarray(compressed_vocab.lookup, dtype=np.int64)
            if spec.pad_token_id >= lookup.shape[0]:
                raise CheckpointError(f"{spec.field_name('pad_token_id')}={spec.pad_token_id} is not in the tokenizer (vocab {lookup.shape[0]})")
            layout = EngramLayout.from_spec(spec, pad_id=int(lookup[spec.pad_token_id]))
        require_valid(ckpt, layout)
        t0 = time.perf_counter()
        weights = {name: ckpt.get(name) for name in model_weight_shapes(cfg)}
        tables = EngramTables.from_checkpoint(ckpt, device, table_storage) if spec is not None else None
        model = cls(cfg, weights, tables=tables, compress_lookup=lookup, layout=layout, device=device, dtype=dtype,
                    engram_backend=engram_backend)
        log.info("loaded %s in %.1f s (device %s, %s, tables: %s)", ckpt.path, time.perf_counter() - t0,
                 device, dtype, table_storage if spec is not None else "none")
        return model

    # -- cache -----------------------------------------------------------------------
    @property
    def backend_name(self) -> str:
        """What the CLI reports: the PyTorch reference, with the Engram steps in the
        CUDA kernel library when it runs them."""
        return "torch" if self.engram_ops is None else f"torch + engram {self.engram_ops.name}"

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def new_cache(self, batch: int = 1, max_len: int | None = None) -> KVCache:
        """A cache for ``batch`` sequences of up to ``max_len`` tokens (default:
        ``max_position_embeddings``)."""
        return KVCache.allocate(self.config, batch, max_len or self.config.max_position_embeddings,
                                self.device, self.compute_dtype)

    # -- Engram pieces (also used by the runtime's prefetch placement) --------------
    def _as_batch(self, input_ids: Any) -> tuple[torch.Tensor, bool]:
        ids = torch.as_tensor(input_ids, dtype=torch.int64, device=self.device)
        squeeze = ids.ndim == 1
        if ids.ndim == 0:
            ids = ids.reshape(1, 1)
        elif ids.ndim == 1:
            ids = ids[None]
        elif ids.ndim != 2:
            raise EngramError(f"input_ids must be [T] or [B, T] (got shape {tuple(ids.shape)})")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size):
            bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
            raise EngramError(f"token id {bad} is outside the model's vocabulary 0..{self.config.vocab_size - 1}")
        return ids, squeeze

    def compress(self, input_ids: Any) -> torch.Tensor:
        """Compressed ids (int64, same shape) of raw token ids."""
        if self.compress_lookup is None:
            raise EngramError("this model has no Engram layers, so it has no compressed vocab")
        ids = torch.as_tensor(input_ids, dtype=torch.int64, device=self.device)
        return self.compress_lookup[ids]

    def engram_hash(self, compressed_ids: torch.Tensor, lookback: torch.Tensor | None = None) -> torch.Tensor:
        """Row ids ``int64 [B, T, L, cols]`` of compressed ids ``[B, T]`` (-1 = dead),
        each sequence continuing from its ``lookback [B, N-1]`` (None: sequence start)."""
        if self.layout is None:
            raise EngramError("this model has no Engram layers")
        B = compressed_ids.shape[0]
        if lookback is not None and tuple(lookback.shape) != (B, self.layout.max_ngram_size - 1):
            raise EngramError(f"lookback must be [B={B}, N-1={self.layout.max_ngram_size - 1}] (got {tuple(lookback.shape)})")
        if self.engram_ops is not None:
            return self.engram_ops.hash(compressed_ids, lookback)
        return torch.stack([hash_ids_torch(compressed_ids[b], self.layout, None if lookback is None else lookback[b])
                            for b in range(B)])

    def gather_engram_rows(self, hash_ids: torch.Tensor) -> list[torch.Tensor]:
        """Per Engram layer, bf16 rows ``[B, T, cols, head_dim]`` for ``hash_ids [B, T, L, cols]``."""
        if self.tables is None:
            raise EngramError("the model has no Engram tables attached (set_tables), and no engram_rows were given")
        if self.engram_ops is not None:
            return [self.engram_ops.rows(self.tables, li, hash_ids) for li in range(hash_ids.shape[2])]
        return [self.tables.rows(li, hash_ids[:, :, li, :]) for li in range(hash_ids.shape[2])]

    def _engram_inputs(self, ids: torch.Tensor, engram_ids: Any) -> torch.Tensor:
        """Compressed ids ``[B, T]``: the caller's override, else the lookup of ``ids``."""
        if engram_ids is None:
            return self.compress_lookup[ids]
        cids = torch.as_tensor(engram_ids, dtype=torch.int64, device=self.device)
        if cids.numel() != ids.numel():
            raise EngramError(f"engram_ids has {cids.numel()} ids for {ids.numel()} tokens (expected one compressed id per token)")
        return cids.reshape(ids.shape)

    def prepare_engram(self, input_ids: Any, cache: KVCache | None = None, *, engram_ids: Any = None,
                       lookback: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The rows the next :meth:`forward` on ``input_ids`` needs (prefetch placement):
        hash with the cache's lookback and gather. Pass the result as ``engram_rows``."""
        ids, _ = self._as_batch(input_ids)
        cids = self._engram_inputs(ids, engram_ids)
        lb = cache.lookback if cache is not None else lookback
        return self.gather_engram_rows(self.engram_hash(cids, lb))

    # -- forward -----------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, input_ids: Any, cache: KVCache | None = None, start_pos: int | None = None, *,
                engram_ids: Any = None, engram_rows: Sequence[torch.Tensor] | None = None,
                lookback: torch.Tensor | None = None, last_only: bool = False) -> torch.Tensor:
        """Logits (float32) ``[B, T, V]`` (``[T, V]`` for 1-D input; ``T`` dropped when
        ``last_only``).

        With a cache the tokens continue its sequences at ``cache.seq_len`` (the only
        valid ``start_pos``), K/V and lookback are appended. Without one the tokens
        attend only to each other, at positions from ``start_pos`` (default 0), after
        ``lookback [B, N-1]`` compressed ids (default none). ``engram_ids`` overrides
        the compressed ids (-1 marks a dead token: its gate is 0); ``engram_rows``
        (per Engram layer ``[B, T, cols, head_dim]``) skips hashing and gathering.
        """
        cfg = self.config
        ids, squeeze = self._as_batch(input_ids)
        B, T = ids.shape
        if T == 0:
            raise EngramError("input_ids is empty: give at least one token")
        if cache is not None:
            if start_pos is not None and start_pos != cache.seq_len:
                raise EngramError(f"start_pos={start_pos} but the cache holds {cache.seq_len} tokens; a cached forward continues at the cache's end")
            start = cache.seq_len
            if cache.batch != B:
                raise EngramError(f"the cache holds {cache.batch} sequences but input_ids has {B}")
            if start + T > cache.max_len:
                raise EngramError(f"{start + T} tokens exceed the cache's max_len={cache.max_len}; allocate a longer cache")
            if lookback is not None:
                raise EngramError("lookback comes from the cache when one is given; pass one or the other")
            lookback = cache.lookback
        else:
            start = 0 if start_pos is None else int(start_pos)
        if start < 0 or start + T > cfg.max_position_embeddings:
            raise EngramError(f"positions {start}..{start + T - 1} exceed the model's max_position_embeddings={cfg.max_position_embeddings}; shorten the prompt or the generation")
        hc, D = cfg.hc_mult, cfg.hidden_size
        dtype = self.compute_dtype
        x = self.model.embed_tokens(ids).to(dtype)
        hs = x.unsqueeze(2).expand(B, T, hc, D).contiguous()
        cids = None
        rows: Sequence[torch.Tensor] | None = None
        if self.layout is not None:
            cids = self._engram_inputs(ids, engram_ids)
            if engram_rows is None:
                rows = self.gather_engram_rows(self.engram_hash(cids, lookback))
            else:
                rows = list(engram_rows)
                want = (B, T, self.layout.n_hash_cols, int(cfg.engram.head_dim))  # type: ignore[union-attr]
                if len(rows) != self.layout.num_layers or any(tuple(r.shape) != want for r in rows):
                    raise EngramError(f"engram_rows must hold {self.layout.num_layers} tensors of shape {want} (one per Engram layer)")
            live = cids >= 0
        positions = torch.arange(start, start + T, device=self.device, dtype=torch.float32)
        freqs = positions[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        for i, layer in enumerate(self.model.layers):
            li = self._engram_layer_index.get(i)
            if li is not None:
                block = layer.engram_module
                assert rows is not None and block is not None
                hs = block(hs, rows[li].to(hs.device), live, self.engram_ops)
            a = layer.self_attn(layer.input_layernorm(hs.mean(dim=2)), cos, sin, start, cache, i)
            hs = hs + a.unsqueeze(2)
            m = layer.mlp(layer.post_attention_layernorm(hs.mean(dim=2)))
            hs = hs + m.unsqueeze(2)
        out = self.model.norm(hs.mean(dim=2))
        if last_only:
            out = out[:, -1:]
        head = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(out, head).float()
        if cache is not None:
            cache.seq_len = start + T
            if cids is not None and cache.lookback.shape[1] > 0:
                n = cache.lookback.shape[1]
                cache.lookback = torch.cat([cache.lookback, cids], dim=1)[:, -n:].contiguous()
        if last_only:
            logits = logits[:, 0]
        return logits[0] if squeeze else logits

    def prefill(self, input_ids: Any, cache: KVCache, *, chunk_size: int | None = None,
                engram_ids: Any = None, last_only: bool = True) -> torch.Tensor:
        """Run a prompt into the cache, in chunks of ``chunk_size`` tokens if given.
        Returns the last position's logits (``[B, V]``) or, with ``last_only=False``, all."""
        ids, squeeze = self._as_batch(input_ids)
        T = ids.shape[1]
        step = T if not chunk_size else int(chunk_size)
        if step < 1:
            raise EngramError(f"chunk_size must be >= 1 (got {chunk_size})")
        cids = None if engram_ids is None else torch.as_tensor(engram_ids, dtype=torch.int64, device=self.device).reshape(ids.shape)
        outs = []
        for a in range(0, T, step):
            outs.append(self.forward(ids[:, a:a + step], cache,
                                     engram_ids=None if cids is None else cids[:, a:a + step], last_only=last_only))
        logits = outs[-1] if last_only else torch.cat(outs, dim=1)
        return logits[0] if squeeze else logits

    def decode(self, token_ids: Any, cache: KVCache) -> torch.Tensor:
        """One step: ``token_ids`` (an int, ``[B]`` or ``[B, 1]``) -> logits ``[B, V]``
        (``[V]`` for an int)."""
        ids = torch.as_tensor(token_ids, dtype=torch.int64, device=self.device)
        scalar = ids.ndim == 0
        ids = ids.reshape(-1, 1)
        logits = self.forward(ids, cache, last_only=True)
        return logits[0] if scalar else logits

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def generate(self, prompt_ids: Any, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int | None = None, eos: int | Sequence[int] | None = None,
                 prefill_chunk: int | None = None) -> GenerateResult:
        """Generate for one sequence: greedy when ``temperature == 0``, else
        temperature + top-p sampling from a CPU ``torch.Generator`` seeded with ``seed``.
        Stops after ``max_new_tokens`` or at an ``eos`` id (default: the config's
        ``eos_token_id``; pass ``[]`` to never stop early)."""
        prompt = torch.as_tensor(prompt_ids, dtype=torch.int64).reshape(-1)
        if prompt.numel() == 0:
            raise EngramError("the prompt is empty: give at least one token")
        if max_new_tokens < 0:
            raise EngramError(f"max_new_tokens must be >= 0 (got {max_new_tokens})")
        if not (math.isfinite(temperature) and temperature >= 0) or not (0 < top_p <= 1):
            raise EngramError(f"need temperature >= 0 and 0 < top_p <= 1 (got temperature={temperature}, top_p={top_p})")
        if eos is None:
            stops = set(self.config.eos_token_ids)
        else:
            stops = {int(eos)} if isinstance(eos, int) else {int(e) for e in eos}
        limit = self.config.max_position_embeddings
        if prompt.numel() + max_new_tokens > limit:
            raise EngramError(f"{prompt.numel()} prompt tokens + {max_new_tokens} new tokens exceed the model's max_position_embeddings={limit}")
        gen = torch.Generator(device="cpu")
        gen.manual_seed(0 if seed is None else int(seed))
        cache = self.new_cache(1, prompt.numel() + max(1, max_new_tokens))
        new: list[int] = []
        stopped = False
        self._sync()
        t0 = time.perf_counter()
        logits = self.prefill(prompt, cache, chunk_size=prefill_chunk)
        tok = sample_next(logits, temperature, top_p, gen) if max_new_tokens else None
        self._sync()
        t1 = time.perf_counter()
        steps = 0
        while tok is not None:
            new.append(tok)
            if tok in stops:
                stopped = True
                break
            if len(new) >= max_new_tokens:
                break
            logits = self.decode(tok, cache)
            steps += 1
            tok = sample_next(logits, temperature, top_p, gen)
        self._sync()
        t2 = time.perf_counter()
        return GenerateResult(prompt.tolist(), new, t1 - t0, t2 - t1, stopped, steps)
