"""engram-llama in PyTorch: the reference model and the ``torch`` backend's model.

The architecture is the one in docs/engram-spec.md ("Reference architecture"; modules
in :mod:`.modules`). The model's one forward is :meth:`EngramLlama.forward_step` over a
:class:`~engram_trt.models.step.PackedStep` (the step every backend takes: tokens of
several sequences back to back, each with its KV-cache slot and past length); the
uniform-batch API (``forward``/``prefill``/``decode``/``generate``, sequences of one
length in slots 0..B-1) is a thin layer over it, kept for tests and scripts.

Design points, and why:

* Tables are not module parameters but a :class:`~engram_trt.tables.base.TableStore`.
  Tables are the one part that does not fit on a GPU for real models, so the runtime
  swaps their storage (GPU, pinned host, /dev/shm, the checkpoint's file map) without
  touching the model.
* The Engram step takes its rows either gathered here or staged by the caller
  (``engram_rows``): the prefetch placement, where the runtime hashes and gathers on a
  side stream before the step, then hands the staged rows to the model.
* The cache carries the Engram lookback (the last ``N-1`` compressed ids per slot), so
  a chunked prefill and decode steps hash exactly as one whole-sequence forward would.
* The model compresses raw ids itself (``compress_lookup``): callers hand it token
  ids, never compressed ids, unless they override them (``engram_ids``) e.g. to mark
  dead tokens.
* On a GPU the decoder layers run fused (``backbone_backend``): a decode step of a ~1B
  model is mostly launch latency, ~45 kernels per layer of which ~40 are tiny elementwise
  ops. At load the q / k / v weights (and gate / up) are stacked into one tensor whose
  row slices *are* the projections' parameters (names and memory unchanged), so one GEMM
  computes each group; the norms (with the residual add before them), RoPE + KV write
  and SiLU * up run as one kernel-library launch each (:class:`KernelBackboneOps`). The
  MLP's residual is carried to the next layer's norm (``StepState.pending``). The
  float32 / CPU reference path is the plain module code, untouched.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engram_trt.checkpoint.checkpoint import Checkpoint, engram_tensor_names
from engram_trt.models.engram_llama.checks import require_valid
from engram_trt.config.model import ModelConfig
from engram_trt.engram.hashing import DEAD, hash_ids_torch
from engram_trt.engram.layout import EngramLayout
from engram_trt.errors import CheckpointError, EngramError
from engram_trt.models.engram_llama.batch_api import UniformBatchAPI
from engram_trt.models.engram_llama.kernel_ops import KernelEngramOps, select_backbone_ops
from engram_trt.models.kv_cache import KVCache
from engram_trt.models.engram_llama.modules import AttentionPlan, Backbone
from engram_trt.models.engram_llama.weights import lazy_weights, load_weights, model_weight_shapes  # noqa: F401
from engram_trt.models.parallel import gather_vocab, reduce
from engram_trt.models.step import PackedStep, row_shapes
from engram_trt.quant.weight import QuantLinear
from engram_trt.tables.base import TableStore
from engram_trt.models.served import ServedModel

log = logging.getLogger(__name__)

ENGRAM_BACKENDS = ("auto", "torch", "kernels")


@dataclass
class StepState:
    """What one step carries between its stages (see EngramLlama.forward_step)."""

    hs: torch.Tensor  # [T, hc, D] residual copies
    rows: Any  # per Engram layer [T, cols, head_dim] (staged lazily or gathered), or None
    live: torch.Tensor | None  # [T] bool: tokens whose gate may open
    cids: torch.Tensor | None  # [T] compressed ids
    plan: AttentionPlan
    cos: torch.Tensor
    sin: torch.Tensor
    arrays: dict[str, torch.Tensor]
    # The fused path's last MLP output [T, D], not yet added to hs: the next norm adds it.
    pending: torch.Tensor | None = field(default=None)


class EngramLlama(UniformBatchAPI, ServedModel, nn.Module):
    """engram-llama: parameter names equal HF checkpoint names (``model.layers.1.engram.wkv.weight``...).

    Build with :meth:`from_checkpoint`, or directly from a config and a weight dict
    (``compress_lookup`` int64 ``[vocab]`` maps raw ids to compressed ids; tests pass a
    small one so they need no tokenizer). Tables come from ``tables`` or, when the
    weight dict holds them, from there. ``attention``: ``loop`` (the float32 reference,
    default on a CPU) or ``sdpa`` (fused kernels, default on a GPU).
    ``fuse_projections`` (default: on a CUDA device) stacks q / k / v and gate / up weights
    at load, the parameters becoming views of the stack; ``backbone_backend``: ``auto``
    runs the decoder layers' elementwise steps in the kernel library on a CUDA device in
    bf16 with fused projections when the library loads, else the PyTorch ops;
    ``kernels``: that or a clear error; ``torch``: the PyTorch ops.
    """

    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, torch.Tensor],
        *,
        tables: TableStore | None = None,
        compress_lookup: Any = None,
        layout: EngramLayout | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        engram_backend: str = "auto",
        attention: str | None = None,
        backbone_backend: str = "auto",
        fuse_projections: bool | None = None,
        parallel: Any = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.engram_ops: KernelEngramOps | None = None
        if engram_backend not in ENGRAM_BACKENDS:
            raise EngramError(f"engram_backend {engram_backend!r} is not one of {list(ENGRAM_BACKENDS)}")
        self.compute_dtype = dtype
        dev = torch.device(device)
        self.attention_impl = attention or ("sdpa" if dev.type == "cuda" else "loop")
        spec = config.require_model()
        with torch.device("meta"):
            self.model = Backbone(config)
            self.lm_head = (
                None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            )
        # Tensor parallelism (models.parallel): ``config`` is the rank's (local heads and
        # MLP channels), the vocabulary rows cut here; None: the whole model.
        self.tp = None if parallel is None else parallel.tp
        shapes = None
        if parallel is not None:
            from engram_trt.models.engram_llama.parallel import local_weight_shapes, shard_modules

            shard_modules(self, parallel)
            shapes = local_weight_shapes(parallel)
        fuse = dev.type == "cuda" if fuse_projections is None else bool(fuse_projections)
        # The decoder layers' elementwise steps (None: the modules' PyTorch ops). Any
        # object with KernelBackboneOps' methods will do (TorchBackboneOps: the same
        # steps in PyTorch ops, for checks).
        self.backbone_ops: Any = select_backbone_ops(backbone_backend, dev, dtype, fuse)
        load_weights(self, weights, dev, dtype, fuse, shapes)
        from engram_trt.models.rope import inv_freq_and_scale

        # RoPE as transformers' LlamaRotaryEmbedding computes it for config.rope (cos and
        # sin scaled by its attention factor: yarn's, 1 for the others).
        inv_freq, self.rope_scale = inv_freq_and_scale(config.rope, config.head_dim, device=dev)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.layout: EngramLayout | None = None
        self.tables: TableStore | None = None
        self._engram_layer_index = config.engram_layer_index
        # False runs the backbone alone (the Engram layers removed): the denominator of
        # the benchmarks' "cost of Engram" ratios. Not a serving mode.
        self.engram_enabled = True
        # One pinned buffer for each step's metadata on a GPU (models.step.StepUploader).
        self.uploader = None
        if dev.type == "cuda":
            from engram_trt.models.step import StepUploader

            self.uploader = StepUploader(dev)
        if spec is None:
            self.register_buffer("compress_lookup", None, persistent=False)
            return
        if compress_lookup is None:
            raise EngramError(
                "an Engram model needs the compressed-vocab lookup (raw id -> compressed id); "
                "build it from the checkpoint's tokenizer.json (EngramLlama.from_checkpoint does)"
            )
        lookup = torch.as_tensor(
            np.asarray(compress_lookup) if not isinstance(compress_lookup, torch.Tensor) else compress_lookup,
            dtype=torch.int64,
        ).reshape(-1)
        if lookup.numel() == 0 or int(lookup.max()) >= spec.compressed_vocab_size or int(lookup.min()) < DEAD:
            raise EngramError(
                f"the compressed-vocab lookup holds ids outside -1..{spec.compressed_vocab_size - 1} "
                f"({spec.field_name('compressed_vocab_size')}={spec.compressed_vocab_size}): "
                "the tokenizer does not belong to this config"
            )
        if lookup.numel() < config.vocab_size:
            # Ids the tokenizer does not know (vocab padding) have no text: dead for Engram.
            lookup = torch.cat([lookup, torch.full((config.vocab_size - lookup.numel(),), DEAD, dtype=torch.int64)])
        if spec.pad_token_id >= lookup.numel() or int(lookup[spec.pad_token_id]) < 0:
            raise EngramError(
                f"{spec.field_name('pad_token_id')}={spec.pad_token_id} has no compressed id in the tokenizer"
            )
        self.register_buffer("compress_lookup", lookup.to(dev), persistent=False)
        if layout is None:
            layout = EngramLayout.from_spec(spec, pad_id=int(lookup[spec.pad_token_id]))
        if tuple(layout.layer_ids) != tuple(spec.layer_ids):
            raise EngramError(f"layout layers {list(layout.layer_ids)} differ from the config's {list(spec.layer_ids)}")
        self.layout = layout
        self.engram_ops = self._select_engram_ops(engram_backend, layout, dev, dtype)
        if tables is None and any(engram_tensor_names(lid, spec.prefix)["table"] in weights for lid in spec.layer_ids):
            tables = self._tables_from_weights(weights, dev)
        if tables is not None:
            self.set_tables(tables)

    # -- construction helpers ------------------------------------------------------
    @staticmethod
    def _select_engram_ops(
        backend: str, layout: EngramLayout, device: torch.device, dtype: torch.dtype
    ) -> KernelEngramOps | None:
        """``auto``: the kernel library on a CUDA device in bf16 when it loads, else the
        PyTorch path; ``kernels``: the kernel library or a clear error; ``torch``: PyTorch."""
        if backend == "torch":
            return None
        usable = device.type == "cuda" and dtype == torch.bfloat16
        if not usable:
            if backend == "kernels":
                raise EngramError(
                    "engram_backend 'kernels' runs on a CUDA device in bfloat16 "
                    f"(got {device}, {dtype}); use 'torch' or 'auto'"
                )
            return None
        try:
            return KernelEngramOps(layout, device)
        except EngramError as exc:
            if backend == "kernels":
                raise
            log.warning("Engram CUDA kernels unavailable (%s); using the PyTorch path", exc)
            return None

    def _tables_from_weights(self, weights: Mapping[str, torch.Tensor], device: torch.device) -> TableStore:
        spec = self.config.require_engram("building Engram tables")
        tables, scales = [], []
        for lid in spec.layer_ids:
            names = engram_tensor_names(lid, spec.prefix)
            if names["table"] not in weights:
                raise CheckpointError(f"weights lack Engram table '{names['table']}'")
            t = weights[names["table"]]
            s = weights.get(names["scale"]) if t.element_size() == 1 else None
            tables.append(t.to(device))
            scales.append(None if s is None else s.to(device))
        return TableStore.from_tensors(tables, scales, spec.quant_block, spec.layer_ids)

    def set_tables(self, tables: TableStore) -> None:
        """Attach (or swap) the row storage; checked against the layout."""
        spec = self.config.engram
        if spec is None or self.layout is None:
            raise EngramError("this model has no Engram layers, so it takes no tables")
        if tables.num_layers != self.layout.num_layers:
            raise EngramError(f"{tables.num_layers} tables for {self.layout.num_layers} Engram layers")
        for li in range(tables.num_layers):
            need = int(self.layout.table_rows[li])
            if tables.num_rows(li) < need:
                raise EngramError(
                    f"Engram table of layer {self.layout.layer_ids[li]} has {tables.num_rows(li)} rows but the "
                    f"layout needs at least {need}: the checkpoint does not cover "
                    f"{spec.field_name('num_embeddings')}/primes"
                )
            if tables.head_dim(li) != spec.head_dim:
                raise EngramError(
                    f"Engram table of layer {self.layout.layer_ids[li]} has rows of width {tables.head_dim(li)} but "
                    f"{spec.field_name('head_dim')}={spec.head_dim}"
                )
        self.tables = tables

    @classmethod
    def from_checkpoint(
        cls,
        ckpt: Checkpoint | str,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        table_storage: str | None = "memory",
        compressed_vocab: Any = None,
        engram_backend: str = "auto",
        attention: str | None = None,
        progress: bool = False,
        backbone_backend: str = "auto",
    ) -> "EngramLlama":
        """Build from a checkpoint: config, validated tensors, compressed vocab from its
        tokenizer.json (size checked against the config), tables in a store of kind
        ``table_storage`` (:data:`engram_trt.tables.TABLE_KINDS`; ``None``: none attached,
        the caller stages rows or attaches a store)."""
        from engram_trt.checkpoint.vocab import engram_lookup_and_layout
        from engram_trt.tables.source import checkpoint_table_refs
        from engram_trt.tables.store import open_tables

        if not isinstance(ckpt, Checkpoint):
            from engram_trt.models.engram_llama.config import read_config

            ckpt = Checkpoint.open(ckpt, config_reader=read_config)
        cfg = ckpt.config
        spec = cfg.require_model()
        lookup, layout = engram_lookup_and_layout(ckpt, compressed_vocab)
        require_valid(ckpt, layout)
        t0 = time.perf_counter()
        weights = lazy_weights(ckpt)
        tables = None
        if spec is not None and table_storage is not None:
            tables = open_tables(
                checkpoint_table_refs(ckpt),
                table_storage,
                quant_block=spec.quant_block,
                device=device,
                progress=progress,
            )
        model = cls(
            cfg,
            weights,
            tables=tables,
            compress_lookup=lookup,
            layout=layout,
            device=device,
            dtype=dtype,
            engram_backend=engram_backend,
            attention=attention,
            backbone_backend=backbone_backend,
        )
        log.info(
            "loaded %s in %.1f s (device %s, %s, tables: %s)",
            ckpt.path,
            time.perf_counter() - t0,
            device,
            dtype,
            table_storage if spec is not None else "none",
        )
        return model

    # -- identity --------------------------------------------------------------------
    @property
    def backend_name(self) -> str:
        """What the CLI reports: the PyTorch reference, with the Engram steps in the
        CUDA kernel library when it runs them."""
        name = "torch" if self.engram_ops is None else f"torch + engram {self.engram_ops.name}"
        return name if self.backbone_ops is None else f"{name} + layers {self.backbone_ops.name}"

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def new_cache(self, num_slots: int = 1, max_len: int | None = None) -> KVCache:
        """A cache of ``num_slots`` sequences of up to ``max_len`` tokens (default:
        ``max_position_embeddings``)."""
        return KVCache.allocate(
            self.config, num_slots, max_len or self.config.max_position_embeddings, self.device, self.compute_dtype
        )

    # -- Engram pieces (also used by the runtime's prefetch placement) --------------
    def compress(self, input_ids: Any) -> torch.Tensor:
        """Compressed ids (int64, same shape) of raw token ids."""
        if self.compress_lookup is None:
            raise EngramError("this model has no Engram layers, so it has no compressed vocab")
        ids = torch.as_tensor(input_ids, dtype=torch.int64, device=self.device)
        return self.compress_lookup[ids]

    def engram_hash(self, cids: torch.Tensor, seq_starts: Sequence[int], lookback: torch.Tensor) -> torch.Tensor:
        """Row ids ``[T, L, cols]`` (int64 on the PyTorch path, int32 through the kernels)
        of packed compressed ids ``[T]`` (-1 = dead), each sequence continuing from its
        ``lookback [S, N-1]`` row."""
        if self.layout is None:
            raise EngramError("this model has no Engram layers")
        S = len(seq_starts) - 1
        if tuple(lookback.shape) != (S, self.layout.max_ngram_size - 1):
            raise EngramError(
                f"lookback must be [S={S}, N-1={self.layout.max_ngram_size - 1}] (got {tuple(lookback.shape)})"
            )
        if self.engram_ops is not None:
            return self.engram_ops.hash(cids, torch.tensor(seq_starts, dtype=torch.int32), lookback)
        return torch.cat(
            [hash_ids_torch(cids[seq_starts[s] : seq_starts[s + 1]], self.layout, lookback[s]) for s in range(S)]
        )

    def gather_engram_rows(self, hash_ids: torch.Tensor) -> list[torch.Tensor]:
        """Per Engram layer, bf16 rows ``[T, cols, head_dim]`` for ``hash_ids [T, L, cols]``."""
        if self.tables is None:
            raise EngramError("the model has no Engram tables attached (set_tables), and no engram_rows were given")
        if self.engram_ops is not None:
            return [self.engram_ops.rows(self.tables, li, hash_ids) for li in range(hash_ids.shape[1])]
        return [self.tables.rows(li, hash_ids[:, li, :]) for li in range(hash_ids.shape[1])]

    def step_compressed_ids(self, step: PackedStep) -> torch.Tensor:
        """``[T]`` compressed ids of a step on the model's device (the override, else the lookup)."""
        arrays = step.device_arrays(self.device, self.uploader)
        if step.engram_ids is not None:
            return arrays["engram_ids"]
        return self.compress_lookup[arrays["input_ids"]]

    def step_lookback(self, step: PackedStep, cache: KVCache | None) -> torch.Tensor:
        """``[S, N-1]`` lookback of a step: its own, else the cache's rows of its slots."""
        n = self.layout.max_ngram_size - 1 if self.layout is not None else 0
        if step.lookback is not None:
            lb = torch.as_tensor(step.lookback, dtype=torch.int64).to(self.device)
            if tuple(lb.shape) != (step.num_seqs, n):
                raise EngramError(f"the step's lookback must be [S={step.num_seqs}, N-1={n}] (got {tuple(lb.shape)})")
            return lb
        if cache is None:
            return torch.full((step.num_seqs, n), DEAD, dtype=torch.int64, device=self.device)
        return cache.lookback[torch.tensor(step.slots, dtype=torch.int64, device=cache.lookback.device)].to(self.device)

    def prepare_step(self, step: PackedStep, cache: KVCache | None = None) -> list[torch.Tensor]:
        """The rows :meth:`forward_step` on ``step`` needs (prefetch placement): hash with
        the lookback and gather. Pass the result as ``engram_rows``."""
        return self.gather_engram_rows(
            self.engram_hash(self.step_compressed_ids(step), step.seq_starts, self.step_lookback(step, cache))
        )

    # -- the forward -------------------------------------------------------------------
    def _check_step(self, step: PackedStep, cache: KVCache) -> None:
        """The host-side checks of a step (run per step, so cheap: one min/max pass over
        the host ids, one pass over the sequences' plain lists; no device read)."""
        cfg = self.config
        ids = step.input_ids
        # ids on a device are the scheduler's argmax over this model's logits (a step queued before the last
        # one's tokens were read): in range, and not read back
        if ids.numel() and ids.device.type == "cpu":
            lo, hi = torch.aminmax(ids)
            lo, hi = int(lo), int(hi)
            if lo < 0 or hi >= cfg.vocab_size:
                bad = lo if lo < 0 else hi
                raise EngramError(f"token id {bad} is outside the model's vocabulary 0..{cfg.vocab_size - 1}")
        lengths, num_slots, max_len, max_pos = (
            cache.lengths,
            cache.num_slots,
            cache.max_len,
            cfg.max_position_embeddings,
        )
        for s, (slot, past, n) in enumerate(zip(step.slots, step.past_lens, step.seq_lens)):
            if not 0 <= slot < num_slots:
                raise EngramError(
                    f"sequence {s} names KV-cache slot {slot}, but the cache has slots 0..{num_slots - 1}"
                )
            if lengths[slot] != past:
                raise EngramError(f"sequence {s} says slot {slot} holds {past} tokens, but it holds {lengths[slot]}")
            if past + n > max_len:
                raise EngramError(f"{past + n} tokens exceed the cache's max_len={max_len}; allocate a longer cache")
            if past + n > max_pos:
                raise EngramError(
                    f"positions up to {past + n - 1} exceed the model's max_position_embeddings={max_pos}; "
                    "shorten the prompt or the generation"
                )

    @torch.no_grad()
    def forward_step(
        self,
        step: PackedStep,
        cache: KVCache,
        *,
        engram_rows: Sequence[torch.Tensor] | None = None,
        all_logits: bool = False,
        capture: bool = False,
    ) -> torch.Tensor:
        """Logits (float32) of each sequence's last token ``[S, V]`` (``[T, V]`` with
        ``all_logits``). Writes the step's K/V into the cache slots in place and
        advances each slot's length and Engram lookback. ``engram_rows`` (per Engram
        layer ``[T, cols, head_dim]``) skips hashing and gathering. ``capture``: the
        step is being recorded into a CUDA graph (runtime.cuda_graphs): its device
        arrays are the graph's static buffers, the host bookkeeping is the caller's.

        The step runs in three stages (:meth:`step_begin`, :meth:`step_layers`,
        :meth:`step_end`) so a CUDA graph can be cut at the first Engram layer."""
        if not capture:
            self._check_step(step, cache)
        state = self.step_begin(step, cache, engram_rows, capture)
        self.step_layers(state, cache, 0, len(self.model.layers))
        return self.step_end(state, step, cache, all_logits, capture)

    @property
    def first_engram_layer(self) -> int | None:
        """The first decoder layer that reads Engram rows (where a step waits for them)."""
        layers = self.engram_layers
        return layers[0][0] if layers else None

    @property
    def engram_layers(self) -> list[tuple[int, int]]:
        """``(decoder layer, Engram layer index)`` of each layer that reads Engram rows, in
        the order a step reaches them (empty when Engram is off): where a step waits for
        each layer's rows."""
        if not self.engram_enabled:
            return []
        return sorted(self._engram_layer_index.items())

    def step_begin(self, step: PackedStep, cache: KVCache, engram_rows: Any, capture: bool) -> "StepState":
        """Embedding, the Engram inputs (rows staged or gathered here), RoPE and the
        attention plan: everything before the first decoder layer."""
        cfg = self.config
        dev = self.device
        T = step.num_tokens
        hc, D = cfg.hc_mult, cfg.hidden_size
        dtype = self.compute_dtype
        arrays = step.device_arrays(dev, self.uploader)
        x = self.model.embed_tokens(arrays["input_ids"]).to(dtype)
        hs = x.unsqueeze(1).expand(T, hc, D).contiguous()
        cids = live = None
        rows: Any = None
        if self.layout is not None and self.engram_enabled:
            cids = self.step_compressed_ids(step)
            if engram_rows is None:
                rows = self.gather_engram_rows(self.engram_hash(cids, step.seq_starts, self.step_lookback(step, cache)))
            else:
                # Staged rows (runtime.prefetch.StagedRows) are read lazily: the wait for
                # the prefetch sits at the first Engram layer, not here.
                rows = engram_rows
                shapes = row_shapes(engram_rows)
                want = (T, self.layout.n_hash_cols, int(cfg.engram.head_dim))  # type: ignore[union-attr]
                if len(shapes) != self.layout.num_layers or any(s != want for s in shapes):
                    raise EngramError(
                        f"engram_rows must hold {self.layout.num_layers} tensors of shape {want} (one per Engram layer)"
                    )
            live = cids >= 0
        plan = AttentionPlan.make(step, dev, self.attention_impl, self.uploader, graph_safe=capture)
        freqs = plan.positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.rope_scale, emb.sin() * self.rope_scale
        return StepState(hs, rows, live, cids, plan, cos.to(dtype), sin.to(dtype), arrays)

    def step_layers(self, state: "StepState", cache: KVCache, begin: int, end: int) -> None:
        """Decoder layers ``begin..end-1`` on ``state.hs`` (the Engram update first at an
        Engram layer, reading its rows there)."""
        if self.backbone_ops is not None:
            self._fused_layers(state, cache, begin, end)
            return
        for i in range(begin, end):
            layer = self.model.layers[i]
            li = self._engram_layer_index.get(i)
            hs = state.hs
            if li is not None and state.rows is not None:
                block = layer.engram_module
                assert block is not None
                hs = block(hs, state.rows[li].to(self.device), state.live, self.engram_ops)
            a = layer.self_attn(layer.input_layernorm(hs.mean(dim=1)), state.cos, state.sin, state.plan, cache, i)
            hs = hs + reduce(a, self.tp).unsqueeze(1)  # row-parallel o_proj: the ranks' partial sums
            m = layer.mlp(layer.post_attention_layernorm(hs.mean(dim=1)))
            state.hs = hs + reduce(m, self.tp).unsqueeze(1)

    def _fused_layers(self, state: "StepState", cache: KVCache, begin: int, end: int) -> None:
        """:meth:`step_layers` through ``backbone_ops``: each norm also adds the residual
        before it into ``hs`` in place (the attention output, or the last MLP output, which
        waits in ``state.pending`` for the next layer's norm or the final one)."""
        ops = self.backbone_ops
        for i in range(begin, end):
            layer = self.model.layers[i]
            li = self._engram_layer_index.get(i)
            hs = state.hs
            if li is not None and state.rows is not None:
                if state.pending is not None:
                    hs = hs + state.pending.unsqueeze(1)
                    state.pending = None
                block = layer.engram_module
                assert block is not None
                hs = block(hs, state.rows[li].to(self.device), state.live, self.engram_ops, ops.linear).contiguous()
            x = ops.norm(hs, state.pending, layer.input_layernorm)
            a = reduce(layer.self_attn(x, state.cos, state.sin, state.plan, cache, i, ops), self.tp)
            x = ops.norm(hs, a, layer.post_attention_layernorm)
            state.pending = reduce(layer.mlp(x, ops), self.tp)
            state.hs = hs

    def step_end(
        self, state: "StepState", step: PackedStep, cache: KVCache, all_logits: bool, capture: bool
    ) -> torch.Tensor:
        """Final norm and LM head (of each sequence's last token); the host bookkeeping."""
        if self.backbone_ops is not None:
            # The last MLP output is still pending: the norm adds it (every token; a row
            # norm commutes with picking the last tokens).
            out = self.backbone_ops.norm(state.hs, state.pending, self.model.norm)
            state.pending = None
            if not all_logits:
                out = out.index_select(0, state.arrays["last"])
        else:
            out = state.hs.mean(dim=1)
            if not all_logits:
                out = out.index_select(0, state.arrays["last"])
            out = self.model.norm(out)
        if isinstance(self.lm_head, QuantLinear):  # an FP8 head, in its stored form
            logits = self.lm_head(out).float()
        else:
            head = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            logits = F.linear(out, head).float()
        logits = gather_vocab(logits, self.tp, self.config.vocab_size)  # a TP rank's head holds its vocabulary rows
        if not capture:
            self._advance(step, cache, state.cids)
        return logits

    def _advance(self, step: PackedStep, cache: KVCache, cids: torch.Tensor | None) -> None:
        """Each slot's length, and its lookback: the last N-1 compressed ids of
        (old lookback ++ this step's ids of that sequence)."""
        n = cache.lookback.shape[1]
        for s, slot in enumerate(step.slots):
            cache.lengths[slot] = step.past_lens[s] + step.seq_lens[s]
        if cids is None or n == 0 or step.lookback is not None:
            return  # a step that brings its own lookback: the caller keeps lookbacks (the runtime does, on the host)
        starts = step.seq_starts
        for s, slot in enumerate(step.slots):
            ext = torch.cat([cache.lookback[slot], cids[starts[s] : starts[s + 1]].to(cache.lookback.device)])
            cache.lookback[slot] = ext[ext.shape[0] - n :]
