"""Qwen4Exp in PyTorch over the packed step: the torch backend's model for this family.

One decoder layer: PLE (on its layers) adds hashed n-gram features to the
``hc_count`` residual streams; the attention hyper-connection mixes the streams into the
token mixer's input (Gated DeltaNet on linear-attention layers, gated attention with the
QSA indexer on the others) and injects its output back; the MLP hyper-connection does
the same around the sparse MoE. After the last layer a hyper-connection mixer (no
injection) gives the head's input; there is no separate final norm.

Why the PLE rows are gathered here and not in the module: the tables are the one part
that does not fit on a GPU for real models (~95 GiB for the published one), so they stay
in :class:`~.ple_tables.PLETables` (any of the five table stores, chosen by
``--engram-config`` as for Engram tables), indexed by the
hash of :mod:`engram_trt.engram.ple_hash`, whose per-sequence context lives in the state.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from engram_trt.errors import CheckpointError, EngramError
from engram_trt.models.qwen4_exp.config import Qwen4ExpConfig
from engram_trt.models.qwen4_exp.modules import GatedResidual, PLEFusion, SparseMoE
from engram_trt.models.parallel import gather_vocab, reduce
from engram_trt.models.qwen4_exp.state import MIN_DECODE_CONTEXT, Qwen4ExpState, decode_context  # noqa: F401
from engram_trt.models.step import PackedStep, StepUploader, greedy_tokens
from engram_trt.models.served import ServedModel

log = logging.getLogger(__name__)

# Unchecked PLE gathers count bad ids on the GPU; read every this many steps.
BAD_ROW_CHECK_EVERY = 256


class DecoderLayer(nn.Module):
    def __init__(self, config: Qwen4ExpConfig, index: int) -> None:
        super().__init__()
        from engram_trt.models.qwen4_exp.attention import GatedAttention
        from engram_trt.models.qwen4_exp.linear_attention import GatedDeltaNet

        self.index = index
        self.kind = config.layer_types[index]
        if self.kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(config, index)
        else:
            self.self_attn = GatedAttention(config, index)
        self.mlp = SparseMoE(config)
        self.has_ple = config.ple is not None and index in config.ple.layers
        if self.has_ple:
            self.ple = PLEFusion(config)
        self.attn_hyper_connection = GatedResidual(config)
        self.mlp_hyper_connection = GatedResidual(config)


class TextModel(nn.Module):
    def __init__(self, config: Qwen4ExpConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.hyper_connection_mixer = GatedResidual(config, inject=False)


def model_weight_shapes(config: Qwen4ExpConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape of every weight the model reads (no PLE tables)."""
    with torch.device("meta"):
        m = _Modules(config)
    return {name: tuple(p.shape) for name, p in m.checkpoint_params().items()}


def linear_weight_shapes(config: Qwen4ExpConfig) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """``(checkpoint name -> shape of every weight, linear weight name -> its module
    path)``: the linears are what a fine-grained FP8 checkpoint may store as F8_E4M3."""
    from engram_trt.models.qwen4_exp.weights import linear_weight_names

    with torch.device("meta"):
        m = _Modules(config)
    shapes = {name: tuple(p.shape) for name, p in m.checkpoint_params().items()}
    return shapes, linear_weight_names(m, config.weight_prefix)


class _Modules(nn.Module):
    """The parameter tree under checkpoint names (``prefix`` + ``layers...``, ``lm_head``)."""

    def __init__(self, config: Qwen4ExpConfig) -> None:
        super().__init__()
        self.config = config
        self.model = TextModel(config)
        self.lm_head = (
            None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    def checkpoint_params(self) -> dict[str, nn.Parameter]:
        prefix = self.config.weight_prefix
        out = {}
        for name, p in self.named_parameters():
            out[prefix + name[len("model.") :] if name.startswith("model.") else name] = p
        return out


class Qwen4ExpModel(ServedModel, _Modules):
    """See the module docstring. ``weights``: checkpoint name -> tensor (every name of
    :func:`model_weight_shapes`); ``ple_tables``: the PLE tables (None for a model
    without PLE)."""

    supports_decode_graphs = True  # decode steps through graphs.Qwen4ExpDecodeGraphs (decode_graphs)

    def __init__(
        self,
        config: Qwen4ExpConfig,
        weights: Mapping[str, torch.Tensor],
        *,
        ple_tables: Any = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        parallel: Any = None,
        **_: Any,
    ) -> None:
        with torch.device("meta"):
            super().__init__(config)
        # Tensor parallelism (models.parallel): ``config`` is the rank's (local heads, experts,
        # shared-expert channels), the routers and the vocabulary rows made the rank's here.
        self.tp: Any = None
        if parallel is not None:
            from engram_trt.models.qwen4_exp.parallel import shard_modules

            shard_modules(self, parallel)
        dev = torch.device(device)
        self.compute_dtype = dtype
        params = self.checkpoint_params()
        missing = [n for n in params if n not in weights]
        if missing:
            raise EngramError(
                f"Qwen4Exp weights lack {missing[0]} (and {len(missing) - 1} more)"
                if len(missing) > 1
                else f"Qwen4Exp weights lack {missing[0]}"
            )
        # One tensor at a time (``weights`` may be a checkpoint's lazy mapping): each read,
        # put where it lives, dropped; linears stored FP8 kept so (QuantLinear).
        from engram_trt.models.engram_llama.weights import is_fp8, set_linear
        from engram_trt.models.qwen4_exp.weights import ExpertScales, expert_weight_scale, linear_weight_names

        prefix, quant = config.weight_prefix, config.quant
        linears = linear_weight_names(self, prefix)
        scales = ExpertScales(weights)
        for name, _p in list(self.named_parameters()):
            ck = prefix + name[len("model.") :] if name.startswith("model.") else name
            shape = tuple(params[ck].shape)
            if ck in linears:

                def merged(ck: str = ck, shape: tuple[int, ...] = shape) -> Any:
                    return expert_weight_scale(weights, ck, shape, quant, config, scales)

                set_linear(self, linears[ck], weights, ck, shape, dev, dtype, quant, merged)
                continue
            if is_fp8(weights, ck):
                raise CheckpointError(
                    f"tensor {ck} is F8_E4M3, but only linear weights are served in FP8 (embeddings, "
                    f"norms, convolutions and the router are read as floats)"
                )
            t = weights[ck]
            if tuple(t.shape) != shape:
                raise EngramError(f"tensor {ck} has shape {list(t.shape)} but the config needs {list(shape)}")
            # A_log / dt_bias and the norms' offsets stay float32 as the published model keeps them in math.
            owner, _, leaf = name.rpartition(".")
            setattr(self.get_submodule(owner), leaf, nn.Parameter(t.to(device=dev, dtype=dtype), requires_grad=False))
        self.eval()
        self.ple_tables = ple_tables
        self.ple_layout = None
        if config.ple is not None:
            from engram_trt.engram.ple_hash import PLEHashLayout

            p = config.ple
            self.ple_layout = PLEHashLayout.from_config(
                vocab_size=config.vocab_size,
                ngram_size=p.ngram_size,
                heads_per_ngram=p.heads_per_ngram,
                ngram_vocab_size_base=p.vocab_size_base,
                make_ngram_vocab_size_divisible_by=p.divisible_by,
                seed=p.seed,
                eos_token_id=config.first_eos,
                num_layers=len(p.layers),
            )
            if ple_tables is None:
                raise EngramError("a Qwen4Exp model with PLE layers needs its PLE tables (ple_tables=)")
            short = [li for li in range(len(p.layers)) if ple_tables.num_rows(li) < int(self.ple_layout.table_rows[li])]
            if short:
                li = short[0]
                raise EngramError(
                    f"PLE table {li} has {ple_tables.num_rows(li)} rows but the hash layout needs "
                    f"{int(self.ple_layout.table_rows[li])}: the tables do not match the config"
                )
        self.ple_index = {layer: i for i, layer in enumerate(config.ple.layers)} if config.ple else {}
        if dev.type == "cuda":
            for layer in self.model.layers:
                layer.mlp.stack_experts()  # one tensor per weight kind: the sync-free MoE forms read them
        self._steps = 0
        self.uploader = StepUploader(dev) if dev.type == "cuda" else None
        self._device = dev

    # -- what the runtime asks of a model ------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def backend_name(self) -> str:
        return (
            f"torch (qwen4-exp, {self.compute_dtype}, {self._device.type}{self._linear_attention_label()}"
            f"{self._qsa_label()})"
        )

    def _qsa_layers(self) -> list[Any]:
        return [layer.self_attn for layer in self.model.layers if layer.kind != "linear_attention"]

    def _qsa_label(self) -> str:
        """Where the QSA layers' decode core runs (empty without full-attention layers)."""
        layers = self._qsa_layers()
        if not layers:
            return ""
        probe = torch.empty(0, device=self._device, dtype=self.compute_dtype)
        why = layers[0].why_not_kernel(probe)
        return f", QSA decode {'cuda-kernel' if why is None else 'torch'}"

    @property
    def decode_context_free(self) -> bool:
        """Whether a decode step reads no padded context: every full-attention layer's
        decode core on the QSA kernel (it reads each query's positions from the step's
        metadata), so one recorded graph per batch bucket serves every length."""
        probe = torch.empty(0, device=self._device, dtype=self.compute_dtype)
        return all(attn.why_not_kernel(probe) is None for attn in self._qsa_layers())

    def _linear_attention_label(self) -> str:
        """Where the Gated DeltaNet layers' core runs (``GatedDeltaNet.backend`` on this
        device and dtype); empty for a model without linear-attention layers."""
        from engram_trt.models.qwen4_exp.linear_attention import GatedDeltaNet

        layer = next((m for m in self.modules() if isinstance(m, GatedDeltaNet)), None)
        if layer is None:
            return ""
        probe = torch.empty(0, device=self._device, dtype=self.compute_dtype)
        try:
            on = layer._kernel_serves(probe, probe, probe.float())
        except EngramError:  # backend 'kernels' where they cannot run: the step raises why
            on = False
        return f", linear attention {'cuda-kernels' if on else 'torch'}"

    @property
    def tables(self) -> Any:
        return None  # no runtime-staged Engram tables: PLE rows are gathered in the step

    def set_tables(self, tables: Any) -> None:
        if tables is not None:
            raise EngramError("Qwen4Exp has no engram_* tables; its PLE tables come from the checkpoint")

    def new_cache(self, num_slots: int = 1, max_len: int | None = None) -> Qwen4ExpState:
        return Qwen4ExpState.allocate(self.config, num_slots, max_len or 4096, self._device, self.compute_dtype)

    # -- the step --------------------------------------------------------------------------
    def ple_rows(self, step: PackedStep, state: Qwen4ExpState) -> list[torch.Tensor]:
        """Each PLE layer's rows for the step's tokens ``[T, ple_embed_dim]``; the slots'
        n-gram context advances past the step's tokens. On a GPU the hash runs in the
        kernel library (the plugin's kernel, bit-identical to the reference), on the
        step's device arrays; elsewhere the reference hash."""
        from engram_trt.engram.ple_hash import ple_hash_packed

        # The context (a few ids per slot) lives on the host: the scheduler's tokens are
        # there, so advancing it costs no device round trip.
        slots = torch.tensor(step.slots, dtype=torch.int64)
        ctx = state.context[slots]
        ctx[torch.tensor([p == 0 for p in step.past_lens])] = state.eos_id
        ids = step.input_ids.cpu()
        kernel = self._ple_kernel_layers()
        on_gpu = self._native_ple_hash() if any(kernel) else None
        if on_gpu is not None:
            dev = self._device
            ids_dev = step.input_ids.to(dev, torch.int32)
            starts = torch.tensor(step.seq_starts, dtype=torch.int32).to(dev)
            ctx_dev = ctx.to(torch.int32).to(dev)
        out = []
        for li in range(len(self.config.ple.layers)):
            if on_gpu is not None and kernel[li]:
                # the hash's ids are in the table by construction (checked once at init):
                # the gather reads none on the host, bad ones are counted on the GPU
                rows = self.ple_tables.gather(li, on_gpu(ids_dev, starts, ctx_dev, self.ple_layout, li), checked=False)
            else:  # the host gather / reference read the ids on the host: hash them there (no device round trip)
                rows_ids = torch.as_tensor(
                    ple_hash_packed(ids, step.seq_starts, ctx, self.ple_layout, li), dtype=torch.int64
                )
                rows = self.ple_tables.gather(li, rows_ids)
            out.append(rows.reshape(rows.shape[0], -1).to(self._device, self.compute_dtype))
        self._advance_context(step, state, ctx, ids)
        return out

    def _ple_kernel_layers(self) -> list[bool]:
        """Per PLE layer, whether its rows come from the GPU gather kernel (then the hash
        runs on the GPU too and the step's lookup is device work only)."""
        paths = self.ple_tables.paths if self.ple_tables is not None else []
        n = len(self.config.ple.layers) if self.config.ple is not None else 0
        return [bool(paths) and paths[li] == "kernel" for li in range(n)]

    def _advance_context(self, step: PackedStep, state: Qwen4ExpState, ctx: torch.Tensor, ids: torch.Tensor) -> None:
        from engram_trt.engram.ple_hash import next_context

        slots = torch.tensor(step.slots, dtype=torch.int64)
        state.context[slots] = torch.as_tensor(next_context(ctx, ids, step.seq_starts), dtype=torch.int64)

    def _maybe_check_bad_rows(self) -> None:
        """Every BAD_ROW_CHECK_EVERY steps: did an unchecked gather meet an id outside its table?"""
        self._steps += 1
        if self._steps % BAD_ROW_CHECK_EVERY == 0 and self.ple_tables is not None:
            self.ple_tables.check_bad_rows()

    def _native_ple_hash(self) -> Any:
        """The kernel library's PLE hash when the model runs on a CUDA device and the
        library loads (None: the reference hash)."""
        if self._device.type != "cuda":
            return None
        if not hasattr(self, "_ple_hash_fn"):
            try:
                from engram_trt.native import library as kernel_library
                from engram_trt.native.ple import ple_hash_packed as native_ple_hash

                kernel_library.load_library()
                self._ple_hash_fn = native_ple_hash
            except Exception as exc:  # no library here: the reference hash, said once
                log.warning("PLE hash: the kernel library does not load (%s); using the reference hash", exc)
                self._ple_hash_fn = None
        return self._ple_hash_fn

    def _check_step(self, step: PackedStep, state: Qwen4ExpState) -> None:
        for s, slot in enumerate(step.slots):
            if not 0 <= slot < state.num_slots:
                raise EngramError(f"step slot {slot} is outside the state's {state.num_slots} slots")
            if step.past_lens[s] != state.lengths[slot]:
                raise EngramError(
                    f"sequence {s} says {step.past_lens[s]} tokens are cached but slot "
                    f"{slot} holds {state.lengths[slot]}"
                )
            if step.total_lens[s] > state.max_len:
                raise EngramError(
                    f"sequence {s} would hold {step.total_lens[s]} tokens, "
                    f"more than the state's max_len {state.max_len}"
                )
        if int(step.input_ids.min()) < 0 or int(step.input_ids.max()) >= self.config.vocab_size:
            raise EngramError(f"token ids must be in [0, {self.config.vocab_size}) (vocab_size)")

    @torch.no_grad()
    def forward_step(
        self, step: PackedStep, cache: Qwen4ExpState, *, engram_rows: Any = None, all_logits: bool = False
    ) -> torch.Tensor:
        """Logits ``[S, vocab]`` of each sequence's last token (``all_logits``: ``[T, vocab]``)."""
        if engram_rows is not None:
            raise EngramError("Qwen4Exp takes no staged Engram rows (its PLE rows are gathered in the step)")
        cfg = self.config
        self._check_step(step, cache)
        if cfg.ple is not None:
            self._maybe_check_bad_rows()
        if (
            not all_logits
            and step.is_decode_only
            and step.input_ids.numel() == step.num_seqs
            and min(step.past_lens) > 0
        ):
            return self._forward_decode(step, cache)
        dev = self._device
        ids = step.input_ids.to(dev)
        positions = step.positions(dev)
        starts, past, slots = step.seq_starts, step.past_lens, step.slots
        ple_rows = self.ple_rows(step, cache) if cfg.ple is not None else []
        streams = self.model.embed_tokens(ids).repeat(1, cfg.hc_count)  # [T, hc * hidden]
        for layer in self.model.layers:
            i = layer.index
            if layer.has_ple:
                streams = streams + layer.ple(
                    streams, ple_rows[self.ple_index[i]], starts, past, slots, cache.ple_conv[i]
                )
            x, w = layer.attn_hyper_connection.mix(streams)
            if layer.kind == "linear_attention":
                y = layer.linear_attn(x, starts, past, slots, cache.conv[i], cache.recurrent[i])
            else:
                y = layer.self_attn(
                    x, positions, starts, past, slots, cache.keys[i], cache.values[i], cache.index_keys[i]
                )
            streams = GatedResidual.inject(streams, reduce(y, self.tp), w)  # row-parallel o_proj / out_proj
            x, w = layer.mlp_hyper_connection.mix(streams)
            streams = GatedResidual.inject(streams, reduce(layer.mlp(x), self.tp), w)
        if not all_logits:
            streams = streams[step.last_token_index(dev)]
        hidden, _ = self.model.hyper_connection_mixer.mix(streams)
        logits = self.head_logits(hidden)
        for s, slot in enumerate(slots):
            cache.lengths[slot] = step.total_lens[s]
        return logits

    # -- decode-only steps -------------------------------------------------------------------
    def decode_inputs(self, step: PackedStep) -> dict[str, torch.Tensor]:
        """A decode step's device arrays in one copy: ``ids``, ``positions`` (= past
        lengths), ``slots`` (int64 ``[G]``) and ``meta`` (the PLE kernel's int32
        ``[seq_starts, past_lens, slots]``)."""
        G = step.num_seqs
        host = torch.empty((3, G), dtype=torch.int64)
        host[0] = step.input_ids.reshape(-1).cpu()
        host[1] = torch.tensor(step.past_lens, dtype=torch.int64)
        host[2] = torch.tensor(step.slots, dtype=torch.int64)
        d = host.to(self._device)
        return self.decode_views(d[0], d[1], d[2])

    def decode_views(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        G = ids.shape[0]
        starts = torch.arange(G + 1, dtype=torch.int32, device=ids.device)
        meta = torch.cat([starts, positions.to(torch.int32), slots.to(torch.int32)])
        return {"ids": ids, "positions": positions, "slots": slots, "meta": meta}

    def _forward_decode(self, step: PackedStep, cache: Qwen4ExpState) -> torch.Tensor:
        """A decode-only step eagerly: the very function the decode graphs record."""
        d = self.decode_inputs(step)
        rows = self.ple_rows(step, cache) if self.config.ple is not None else []
        L = cache.max_len if self.decode_context_free else decode_context(max(step.total_lens), cache.max_len)
        seen = None
        if self._device.type != "cuda":  # the per-query top-k (see QSAIndexer.decode_mask)
            r = self.config.indexer_compress_ratio
            seen = [(p + 1) // r for p in step.past_lens]
        logits = self.decode_core(d, cache, L, rows, seen)
        for s, slot in enumerate(step.slots):
            cache.lengths[slot] = step.total_lens[s]
        return logits

    def decode_core(
        self,
        d: dict[str, torch.Tensor],
        cache: Qwen4ExpState,
        context: int,
        ple_rows: Sequence[torch.Tensor],
        seen_host: list[int] | None = None,
    ) -> torch.Tensor:
        """Logits ``[G, vocab]`` of a decode-only step from its device arrays
        (:meth:`decode_inputs`) and PLE rows: every module's decode form, the slots
        vectorized, no host value read (``context`` and ``seen_host`` aside), so a CUDA
        graph can record it. The caches are updated; ``cache.lengths`` is the caller's."""
        cfg = self.config
        ids, positions, slots, meta = d["ids"], d["positions"], d["slots"], d["meta"]
        streams = self.model.embed_tokens(ids).repeat(1, cfg.hc_count)
        sync_free = ids.is_cuda
        for layer in self.model.layers:
            i = layer.index
            if layer.has_ple:
                streams = streams + layer.ple.forward_decode(
                    streams, ple_rows[self.ple_index[i]], slots, meta, cache.ple_conv[i]
                )
            x, w = layer.attn_hyper_connection.mix(streams)
            if layer.kind == "linear_attention":
                y = layer.linear_attn.forward_decode(x, slots, cache.conv[i], cache.recurrent[i], meta=meta)
            else:
                y = layer.self_attn.forward_decode(
                    x,
                    positions,
                    slots,
                    context,
                    cache.keys[i],
                    cache.values[i],
                    cache.index_keys[i],
                    seen_host,
                    meta=meta,
                )
            streams = GatedResidual.inject(streams, reduce(y, self.tp), w)
            x, w = layer.mlp_hyper_connection.mix(streams)
            streams = GatedResidual.inject(streams, reduce(layer.mlp(x, sync_free=sync_free), self.tp), w)
        hidden, _ = self.model.hyper_connection_mixer.mix(streams)
        return self.head_logits(hidden)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of the head's input (the tied embeddings, the head, or an FP8
        head in its stored form)."""
        if self.lm_head is not None and not isinstance(self.lm_head, nn.Linear):
            logits = self.lm_head(hidden).float()
        else:
            head = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            logits = torch.nn.functional.linear(hidden, head).float()
        return gather_vocab(logits, self.tp, self.config.vocab_size)  # a TP rank's head holds its vocabulary rows

    def decode_graphs(self, cache: Qwen4ExpState, max_batch: int, scratch_slot: int) -> Any:
        """The torch backend's recorded decode steps over ``cache`` (see :mod:`.graphs`)."""
        from engram_trt.models.qwen4_exp.graphs import Qwen4ExpDecodeGraphs

        return Qwen4ExpDecodeGraphs(self, cache, max_batch, scratch_slot)

    # -- the uniform-batch helpers tests and scripts use --------------------------------------
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
