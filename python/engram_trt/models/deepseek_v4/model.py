"""DeepSeek-V4 (and V4.1) in PyTorch over the packed step: the torch backend's model for
this family.

The token's embedding is copied into ``hc_mult`` residual streams ``[T, hc, D]``. Each
decoder layer: (V4.1, on an ``engram_layer_ids`` layer) the Engram update on every
stream first, exactly engram-llama's (:class:`~engram_trt.models.engram_llama.modules.EngramModule`,
docs/engram-spec.md "Fusion": each stream gated by its own key, the shared value added);
then the attention's mHC collapses the streams into the RMS-normalized input of the
attention (CSA / HCA, :mod:`.attention`, whose per-sequence caches live in the slots of
:class:`~.state.DeepseekV4State`) and spreads its output back; the MLP's mHC does the same
around the MoE (hash-routed layers read the step's raw token ids). After the last layer
the hyper head collapses the streams, the final norm and the head give the logits.

V4.1's Engram rows are found as engram-llama's are: hashed from the compressed ids and
the slot's lookback, gathered from tables outside the model (the runtime's table store,
prefetched on a side stream and handed in as ``engram_rows``), so the runtime's whole
Engram path (every store, the prefetch) serves this family unchanged.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engram_trt.engram.hashing import DEAD, hash_ids_torch
from engram_trt.errors import EngramError
from engram_trt.models.deepseek_v4.config import DeepseekV4Config
from engram_trt.models.deepseek_v4.modules import HyperConnection, HyperHead, RMSNorm
from engram_trt.models.deepseek_v4.moe import GroupedSparseMoE
from engram_trt.models.deepseek_v4.state import DeepseekV4State
from engram_trt.models.deepseek_v4.weights import load_into, named_tensors
from engram_trt.models.parallel import gather_vocab, reduce
from engram_trt.models.step import PackedStep, StepUploader, greedy_tokens, row_shapes
from engram_trt.models.served import ServedModel

log = logging.getLogger(__name__)

# Kept in float32 whatever the serving dtype (transformers' _keep_in_fp32_modules_strict).
KEEP_FLOAT32 = re.compile(
    r"(hc_attn_|hc_ffn_|hc_head\.|attn_sink$|\.ape$|\.gate\.bias$|q_norm\.|\.norm\.weight$|"
    r"attn_norm\.|ffn_norm\.)"
)


@dataclass
class StepState:
    """What one step carries between its stages (:meth:`DeepseekV4Model.forward_step`)."""

    streams: torch.Tensor  # [T, hc, D] the residual streams
    rows: Any  # per Engram layer [T, cols, head_dim] (staged lazily or gathered), or None
    live: torch.Tensor | None  # [T] bool: tokens whose Engram gate may open
    cids: torch.Tensor | None  # [T] compressed ids
    ids: torch.Tensor  # [T] raw token ids on the device (the hash MoE routes by them)
    positions: torch.Tensor  # [T] on the device
    last: torch.Tensor  # [S] each sequence's last token in the pack
    meta: torch.Tensor | None  # the attention kernel's int32 [seq_starts, past_lens, slots] (CUDA)
    seq_starts: list[int]
    past_lens: list[int]
    slots: list[int]
    decode: bool  # every sequence brings one token (the MoE takes a sync-free form on CUDA)
    static: bool  # a recording: the host lists give only the shape
    ropes: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # (cos, sin) per RoPE table
    # (out, post, comb) of the last sublayer not yet expanded into ``streams``: step_layers
    # leaves it after the model's last layer and step_end folds it into the hyper head
    # (read ``streams`` through :meth:`expanded` where it may be set)
    pending: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def expanded(self) -> torch.Tensor:
        """``streams`` with the pending expansion applied (and cleared)."""
        if self.pending is not None:
            self.streams = HyperConnection.expand(self.streams, *self.pending)
            self.pending = None
        return self.streams


class DecoderLayer(nn.Module):
    def __init__(self, config: DeepseekV4Config, index: int) -> None:
        super().__init__()
        from engram_trt.models.deepseek_v4.attention import DeepseekV4Attention

        self.index = index
        self.self_attn = DeepseekV4Attention(config, index)
        self.mlp = GroupedSparseMoE(config, index)  # SparseMoE with sync-free expert forms on CUDA
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn_hc = HyperConnection(config)
        self.ffn_hc = HyperConnection(config)
        self.engram: nn.Module | None = None
        if index in config.engram_layer_index:
            from engram_trt.models.engram_llama.modules import EngramModule

            self.engram = EngramModule(config)


class Backbone(nn.Module):
    def __init__(self, config: DeepseekV4Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hc_head = HyperHead(config)


class _Modules(nn.Module):
    """The parameter tree under transformers' module names (``model.``, ``lm_head``)."""

    def __init__(self, config: DeepseekV4Config) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = (
            None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )


def meta_modules(config: DeepseekV4Config) -> nn.Module:
    """The model's parameter tree on the meta device (names and logical shapes; nothing allocated)."""
    with torch.device("meta"):
        return _Modules(config)


def model_tensor_shapes(config: DeepseekV4Config) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape of every tensor the model reads (float weights and the
    hash-MoE ``tid2eid`` tables; no Engram tables)."""
    return {name: tuple(t.shape) for name, (_m, _a, t) in named_tensors(meta_modules(config)).items()}


class DeepseekV4Model(ServedModel, _Modules):
    """See the module docstring. Build with :meth:`from_checkpoint` (tensor by tensor,
    :func:`.weights.load_into`)."""

    # Every length of a decode step is read on the device (the attention kernel's metadata,
    # the RoPE positions), so one recorded graph per batch bucket serves every context
    # length (runtime.cuda_graphs.DecodeGraphs, graphs.py).
    decode_context_free = True

    def __init__(
        self,
        config: DeepseekV4Config,
        *,
        device: Any = "cpu",
        dtype: torch.dtype = torch.float32,
        compress_lookup: Any = None,
        layout: Any = None,
    ) -> None:
        with torch.device("meta"):
            super().__init__(config)
        self._rebuild_host_tables()
        self._device = torch.device(device)
        self.compute_dtype = dtype
        self.uploader = StepUploader(self._device) if self._device.type == "cuda" else None
        self.tables: Any = None
        self.layout = layout
        self.engram_enabled = True
        self.engram_ops = None  # the CUDA kernel path of engram-llama's gate (bf16 GPU) is not wired here yet
        self.compress_lookup: torch.Tensor | None = None
        self._graphs_why: str | None = None  # the last reason graphs_unavailable gave (logged once)
        self.tp: Any = None  # the TP group the backbone is split over (models.parallel; .parallel.shard_modules)
        if config.engram is not None:
            if compress_lookup is None or layout is None:
                raise EngramError(
                    "a DeepSeek-V4.1 model needs the compressed-vocab lookup and the Engram layout "
                    "(load it with DeepseekV4Model.from_checkpoint, which builds both from tokenizer.json)"
                )
            lookup = torch.as_tensor(np.asarray(compress_lookup), dtype=torch.int64).reshape(-1)
            if lookup.numel() < config.vocab_size:
                lookup = torch.cat([lookup, torch.full((config.vocab_size - lookup.numel(),), DEAD, dtype=torch.int64)])
            self.compress_lookup = lookup.to(self._device)

    def _rebuild_host_tables(self) -> None:
        """The attention's RoPE frequency tables are plain tensors (not parameters), made
        on the meta device with the rest; they are recomputed on the CPU (a few floats).
        Each attention layer holds one (``DeepseekV4Attention.rope``)."""
        from engram_trt.models.deepseek_v4.attention import DeepseekV4Attention
        from engram_trt.models.deepseek_v4.compressors import RopeTable

        for mod in self.modules():
            if isinstance(mod, DeepseekV4Attention) and mod.rope.inv_freq.is_meta:
                with torch.device("cpu"):
                    mod.rope = RopeTable(self.config, mod.layer_type)

    @classmethod
    def from_checkpoint(
        cls,
        ckpt: Any,
        *,
        device: Any = "cpu",
        dtype: torch.dtype | None = None,
        compressed_vocab: Any = None,
        parallel: Any = None,
    ) -> "DeepseekV4Model":
        """The model of an open checkpoint: built on the meta device, its FP8 / FP4
        projections swapped for their stored-format modules and its expert stacks
        allocated, then filled tensor by tensor (:mod:`.weights`); refused first when the
        stored formats contradict the config or the weights do not fit the GPU.
        ``parallel``: a tensor-parallel rank's plan: the modules at its sizes
        (:func:`.parallel.shard_modules`), only its slices read."""
        from engram_trt.checkpoint.vocab import engram_lookup_and_layout
        from engram_trt.errors import CheckpointError
        from engram_trt.models.deepseek_v4.weights import check_fits, model_formats, prepare_model

        cfg = ckpt.config
        dev = torch.device(device)
        dtype = dtype or torch.float32
        lookup, layout = engram_lookup_and_layout(ckpt, compressed_vocab) if cfg.engram is not None else (None, None)
        if parallel is not None:
            from engram_trt.models.deepseek_v4.parallel import shard_modules
            from engram_trt.models.parallel import ShardedCheckpoint

            model = cls(parallel.local_config, device=dev, dtype=dtype, compress_lookup=lookup, layout=layout)
            shard_modules(model, parallel)
            ckpt = ShardedCheckpoint(ckpt, parallel)
        else:
            model = cls(cfg, device=dev, dtype=dtype, compress_lookup=lookup, layout=layout)
        formats, problems, names = model_formats(model, cfg.quant, ckpt)
        if problems:
            raise CheckpointError(f"checkpoint '{ckpt.path}': {problems[0]}")
        check_fits(
            sum(f.gpu_bytes(dtype, KEEP_FLOAT32) for f in formats.values()),
            dev,
            f"the DeepSeek-V4 checkpoint {ckpt.path}",
        )
        prepare_model(model, formats, dev, dtype)
        load_into(model, ckpt, dev, dtype, KEEP_FLOAT32, names)
        model.eval()
        return model

    # -- what the runtime asks of a model ------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def backend_name(self) -> str:
        kind = "deepseek-v4.1" if self.config.engram is not None else "deepseek-v4"
        return f"torch ({kind}, {self.compute_dtype}, {self._device.type}, attention {self.attention_label()})"

    @property
    def attention_backend(self) -> str:
        """Every layer's attention backend (``auto`` / ``kernels`` / ``torch``, see
        :mod:`.attention_kernel`); set it here for the whole model."""
        got = {layer.self_attn.backend for layer in self.model.layers}
        return got.pop() if len(got) == 1 else "mixed"

    @attention_backend.setter
    def attention_backend(self, backend: str) -> None:
        from engram_trt.models.deepseek_v4.attention_kernel import check_backend

        check_backend(backend)
        for layer in self.model.layers:
            layer.self_attn.backend = backend

    @property
    def supports_decode_graphs(self) -> bool:
        """Whether the torch backend may record this model's decode steps as CUDA graphs
        (:func:`.graphs.graphs_unavailable` says why not; logged once)."""
        from engram_trt.models.deepseek_v4.graphs import graphs_unavailable

        why = graphs_unavailable(self)
        if why is not None and why != self._graphs_why:
            log.info("DeepSeek-V4 decode steps run eagerly, without CUDA graphs: %s", why)
        self._graphs_why = why
        return why is None

    def attention_label(self) -> str:
        """Which core the attention runs on for this model's device and dtype, and why
        not the kernel when it does not (a state-dependent refusal, such as a state in
        another dtype, shows at the step)."""
        from engram_trt.models.deepseek_v4.attention_kernel import check_backend, why_not_kernel

        probe = torch.empty(0, device=self._device, dtype=self.compute_dtype)
        used: dict[str, list[int]] = {}
        for layer in self.model.layers:
            attn = layer.self_attn
            why = "backend torch" if check_backend(attn.backend) == "torch" else why_not_kernel(attn, probe, None)
            used.setdefault("kernels" if why is None else f"torch: {why}", []).append(layer.index)
        if len(used) == 1:
            return next(iter(used))
        return "; ".join(f"{k} (layers {v})" for k, v in used.items())

    def set_tables(self, tables: Any) -> None:
        """Attach (or swap) the Engram row storage, checked against the layout."""
        spec = self.config.engram
        if spec is None or self.layout is None:
            raise EngramError("this DeepSeek-V4 model has no Engram layers, so it takes no tables")
        if tables.num_layers != self.layout.num_layers:
            raise EngramError(f"{tables.num_layers} tables for {self.layout.num_layers} Engram layers")
        for li in range(tables.num_layers):
            need = int(self.layout.table_rows[li])
            if tables.num_rows(li) < need:
                raise EngramError(
                    f"Engram table of layer {self.layout.layer_ids[li]} has {tables.num_rows(li)} rows but the "
                    f"layout needs at least {need}"
                )
            if tables.head_dim(li) != spec.head_dim:
                raise EngramError(
                    f"Engram table of layer {self.layout.layer_ids[li]} has rows of width {tables.head_dim(li)} "
                    f"but engram_head_dim={spec.head_dim}"
                )
        self.tables = tables

    def new_cache(self, num_slots: int = 1, max_len: int | None = None) -> DeepseekV4State:
        return DeepseekV4State.allocate(self.config, num_slots, max_len or 4096, self._device, self.compute_dtype)

    @property
    def engram_layers(self) -> list[tuple[int, int]]:
        """``(decoder layer, Engram layer index)`` in step order (empty without Engram)."""
        return sorted(self.config.engram_layer_index.items()) if self.engram_enabled else []

    @property
    def first_engram_layer(self) -> int | None:
        layers = self.engram_layers
        return layers[0][0] if layers else None

    # -- Engram (V4.1), as engram-llama finds its rows ---------------------------------------
    def step_compressed_ids(self, step: PackedStep) -> torch.Tensor:
        if self.uploader is not None:  # CUDA: from the step's one asynchronous upload (no pageable copy)
            arrays = step.device_arrays(self._device, self.uploader)
            return arrays["engram_ids"] if "engram_ids" in arrays else self.compress_lookup[arrays["input_ids"]]
        if step.engram_ids is not None:
            return step.engram_ids.to(self._device)
        return self.compress_lookup[step.input_ids.to(self._device)]

    def step_lookback(self, step: PackedStep, cache: DeepseekV4State | None) -> torch.Tensor:
        """``[S, N-1]`` lookback of a step: its own, else the cache's rows of its slots (on CUDA
        from the step's one upload: no pageable copy)."""
        n = self.layout.max_ngram_size - 1
        if step.lookback is not None:
            lb = torch.as_tensor(step.lookback, dtype=torch.int64)
            if tuple(lb.shape) != (step.num_seqs, n):
                raise EngramError(f"the step's lookback must be [S={step.num_seqs}, N-1={n}] (got {tuple(lb.shape)})")
            if self.uploader is not None:
                return step.device_arrays(self._device, self.uploader)["lookback"]
            return lb.to(self._device)
        if cache is None:
            return torch.full((step.num_seqs, n), DEAD, dtype=torch.int64, device=self._device)
        if self.uploader is not None and cache.lookback.device == self._device:
            return cache.lookback[step.device_arrays(self._device, self.uploader)["slots"]]
        return cache.lookback[torch.tensor(step.slots, dtype=torch.int64, device=cache.lookback.device)].to(
            self._device
        )

    def engram_hash(self, cids: torch.Tensor, seq_starts: Sequence[int], lookback: torch.Tensor) -> torch.Tensor:
        """Row ids ``[T, L, cols]`` of packed compressed ids, each sequence after its lookback row."""
        return torch.cat(
            [
                hash_ids_torch(cids[seq_starts[s] : seq_starts[s + 1]], self.layout, lookback[s])
                for s in range(len(seq_starts) - 1)
            ]
        )

    def gather_engram_rows(self, hash_ids: torch.Tensor) -> list[torch.Tensor]:
        if self.tables is None:
            raise EngramError("the model has no Engram tables attached (set_tables), and no engram_rows were given")
        return [self.tables.rows(li, hash_ids[:, li, :]) for li in range(hash_ids.shape[1])]

    def prepare_step(self, step: PackedStep, cache: DeepseekV4State | None = None) -> list[torch.Tensor]:
        """The rows :meth:`forward_step` needs (the prefetch placement): pass them as ``engram_rows``."""
        return self.gather_engram_rows(
            self.engram_hash(self.step_compressed_ids(step), step.seq_starts, self.step_lookback(step, cache))
        )

    # -- the step --------------------------------------------------------------------------
    def _check_step(self, step: PackedStep, state: DeepseekV4State) -> None:
        for s, slot in enumerate(step.slots):
            if not 0 <= slot < state.num_slots:
                raise EngramError(f"sequence {s} names slot {slot}, but the state has slots 0..{state.num_slots - 1}")
            if state.lengths[slot] != step.past_lens[s]:
                raise EngramError(
                    f"sequence {s} says {step.past_lens[s]} tokens are cached but slot {slot} holds "
                    f"{state.lengths[slot]}"
                )
            if step.total_lens[s] > state.max_len:
                raise EngramError(
                    f"sequence {s} would hold {step.total_lens[s]} tokens, more than the state's max_len "
                    f"{state.max_len}"
                )
            if step.total_lens[s] > self.config.max_position_embeddings:
                raise EngramError(
                    f"positions up to {step.total_lens[s] - 1} exceed the model's max_position_embeddings="
                    f"{self.config.max_position_embeddings}"
                )
        if step.input_ids.device.type != "cpu":
            return  # the scheduler's argmax over this model's logits, still on the device: in range, not read back
        lo, hi = int(step.input_ids.min()), int(step.input_ids.max())
        if lo < 0 or hi >= self.config.vocab_size:
            raise EngramError(
                f"token id {lo if lo < 0 else hi} is outside the model's vocabulary 0..{self.config.vocab_size - 1}"
            )

    def _engram_inputs(self, step: PackedStep, cache: DeepseekV4State, engram_rows: Any) -> tuple[Any, Any, Any]:
        """``(rows per Engram layer, live [T], compressed ids [T])``, or Nones without Engram."""
        if self.config.engram is None or not self.engram_enabled:
            if engram_rows is not None and self.config.engram is None:
                raise EngramError("this DeepSeek-V4 model has no Engram layers, so it takes no engram_rows")
            return None, None, None
        cids = self.step_compressed_ids(step)
        if engram_rows is None:
            rows = self.gather_engram_rows(self.engram_hash(cids, step.seq_starts, self.step_lookback(step, cache)))
        else:
            rows = engram_rows
            shapes = row_shapes(engram_rows)
            want = (step.num_tokens, self.layout.n_hash_cols, int(self.config.engram.head_dim))
            if len(shapes) != self.layout.num_layers or any(tuple(s) != want for s in shapes):
                raise EngramError(
                    f"engram_rows must hold {self.layout.num_layers} tensors of shape {want} (one per Engram layer)"
                )
        return rows, cids >= 0, cids

    @torch.no_grad()
    def forward_step(
        self,
        step: PackedStep,
        cache: DeepseekV4State,
        *,
        engram_rows: Any = None,
        all_logits: bool = False,
        capture: bool = False,
    ) -> torch.Tensor:
        """Logits (float32) ``[S, vocab]`` of each sequence's last token (``all_logits``:
        ``[T, vocab]``); the slots' per-layer state, lengths and lookback advance.

        The step runs in three stages (:meth:`step_begin`, :meth:`step_layers`,
        :meth:`step_end`) so a CUDA graph can be cut where an Engram layer waits for its
        rows (runtime.cuda_graphs.DecodeGraphs, :mod:`.graphs`). ``capture``: the step is
        being recorded: its device arrays are the graph's static buffers and its host
        lists only give its shape (every length is read on the device), so the host checks
        and the host bookkeeping (lengths, lookback) are the caller's."""
        if not capture:
            self._check_step(step, cache)
        state = self.step_begin(step, cache, engram_rows, capture)
        self.step_layers(state, cache, 0, len(self.model.layers))
        return self.step_end(state, step, cache, all_logits, capture)

    @torch.no_grad()
    def step_begin(self, step: PackedStep, cache: DeepseekV4State, engram_rows: Any, capture: bool) -> "StepState":
        """The step's device metadata (one upload on CUDA), the Engram inputs (rows staged
        or gathered here) and the embedding copied into the ``hc_mult`` streams: everything
        before the first decoder layer."""
        cfg = self.config
        dev = self._device
        meta = None
        if self.uploader is not None:
            # CUDA: the step's metadata in ONE asynchronous copy from pinned memory (a pageable
            # copy would make the host wait for the stream), the kernel's int32 view built once;
            # in a recording, views of the graph's static buffers (no copy)
            arrays = step.device_arrays(dev, self.uploader)
            ids, positions, last = arrays["input_ids"], arrays["positions"], arrays["last"]
            meta = torch.cat((arrays["seq_starts"], arrays["past_lens"], arrays["slots"])).to(torch.int32)
        else:
            ids, positions, last = step.input_ids.to(dev), step.positions(dev), step.last_token_index(dev)
        rows, live, cids = self._engram_inputs(step, cache, engram_rows)
        x = self.model.embed_tokens(ids).to(self.compute_dtype)
        streams = x.unsqueeze(1).expand(x.shape[0], cfg.hc_mult, x.shape[1]).contiguous()  # [T, hc, D]
        return StepState(
            streams=streams,
            rows=rows,
            live=live,
            cids=cids,
            ids=ids,
            positions=positions,
            last=last,
            meta=meta,
            seq_starts=step.seq_starts,
            past_lens=step.past_lens,
            slots=step.slots,
            decode=step.is_decode_only,
            static=capture,
        )

    @torch.no_grad()
    def step_layers(self, state: "StepState", cache: DeepseekV4State, begin: int, end: int) -> None:
        """Decoder layers ``begin..end-1`` on ``state.streams`` (the Engram update first on
        an Engram layer, reading its rows there). A decode step on CUDA runs its MoE in a
        sync-free form (:func:`.graphs.sync_free_moe`), eagerly and in a recording alike."""
        from engram_trt.models.deepseek_v4.graphs import sync_free_moe

        dev = self._device
        index = self.config.engram_layer_index
        layers = self.model.layers
        streams = state.expanded()
        pending = None  # (out, post, comb) of the sublayer before: folded into the next collapse
        for i in range(begin, end):
            layer = layers[i]
            if layer.engram is not None and state.rows is not None:
                if pending is not None:
                    streams, pending = HyperConnection.expand(streams, *pending), None
                streams = layer.engram(streams, state.rows[index[i]].to(dev), state.live)
            if pending is None:
                x, post, comb = layer.attn_hc.collapse_normed(streams, layer.input_layernorm)
            else:
                streams, x, post, comb = layer.attn_hc.expand_collapse_normed(streams, *pending, layer.input_layernorm)
            attn = layer.self_attn
            rope = state.ropes.get(attn.rope_label)
            if rope is None:
                rope = state.ropes[attn.rope_label] = attn.rope(state.positions)
            y = attn(
                x,
                state.positions,
                state.seq_starts,
                state.past_lens,
                state.slots,
                cache.layers[i],
                meta=state.meta,
                rope=rope,
                static=state.static,
            )
            y = reduce(y, self.tp)  # row-parallel wo_b: the ranks' partial sums
            streams, x, post, comb = layer.ffn_hc.expand_collapse_normed(
                streams, y, post, comb, layer.post_attention_layernorm
            )
            if state.decode:
                with sync_free_moe(layer.mlp, x):
                    y = layer.mlp(x, state.ids)
            else:
                y = layer.mlp(x, state.ids)
            y = reduce(y, self.tp)  # the ranks' experts and shared-expert channels combined
            pending = (y, post, comb)
        state.streams = streams
        if pending is not None and end == len(layers):
            state.pending = pending  # step_end folds it into the hyper head
        elif pending is not None:
            state.streams = HyperConnection.expand(streams, *pending)

    @torch.no_grad()
    def step_end(
        self, state: "StepState", step: PackedStep, cache: DeepseekV4State, all_logits: bool, capture: bool
    ) -> torch.Tensor:
        """The hyper head, the final norm and the LM head (of each sequence's last token),
        then the host bookkeeping (none in a recording: the caller's)."""
        if state.pending is not None:
            y, post, comb = state.pending
            state.pending = None
            hidden = self.model.hc_head.expand_forward_normed(
                state.streams, y, post, comb, self.model.norm, None if all_logits else state.last
            )
        else:
            streams = state.streams if all_logits else state.streams[state.last]
            hidden = self.model.hc_head.forward_normed(streams, self.model.norm)
        head = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = gather_vocab(F.linear(hidden, head.to(hidden.dtype)).float(), self.tp, self.config.vocab_size)
        if not capture:
            self._advance(step, cache, state.cids)
        return logits

    def _advance(self, step: PackedStep, cache: DeepseekV4State, cids: torch.Tensor | None) -> None:
        for s, slot in enumerate(step.slots):
            cache.lengths[slot] = step.total_lens[s]
        n = cache.lookback.shape[1]
        if cids is None or n == 0 or step.lookback is not None:
            return  # a step that brings its own lookback: the caller (the runtime's scheduler) keeps them
        starts = step.seq_starts
        if step.num_tokens == step.num_seqs:  # decode: one token per slot, all slots at once
            slots = (
                torch.as_tensor(step.slots, dtype=torch.int64)
                if self.uploader is None
                else step.device_arrays(self._device, self.uploader)["slots"]
            )
            slots = slots.to(cache.lookback.device)
            ext = torch.cat([cache.lookback[slots], cids.to(cache.lookback.device).unsqueeze(1)], dim=1)
            cache.lookback[slots] = ext[:, 1:]
            return
        for s, slot in enumerate(step.slots):
            ext = torch.cat([cache.lookback[slot], cids[starts[s] : starts[s + 1]].to(cache.lookback.device)])
            cache.lookback[slot] = ext[ext.shape[0] - n :]

    # -- the single-sequence helper tests and scripts use ---------------------------------------
    @torch.no_grad()
    def generate_greedy(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        *,
        chunk: int | None = None,
        max_len: int | None = None,
        ignore_eos: bool = False,
    ) -> list[int]:
        """Greedy tokens of one sequence (prefill in chunks of ``chunk`` tokens, then one
        token per step): the scheduler's oracle."""
        return greedy_tokens(self, prompt, max_new_tokens, chunk=chunk, max_len=max_len, ignore_eos=ignore_eos)
