"""DeepSeek-V4's declaration in the model registry: transformers' ``DeepseekV4ForCausalLM``
(``deepseek_v4``) and DeepSeek-V4.1, the same backbone with Engram layers
(``DeepseekV41ForCausalLM``, ``deepseek_v41``).

Its config fields' contract is :mod:`.config`'s; its tensor names and stored formats
:mod:`.weights`' (one resolver: transformers' save spelling or DeepSeek's root names,
scales under ``.scale`` or ``.weight_scale_inv``). The checks a checkpoint must pass
before a byte of it is loaded: every tensor the config implies, at its shape, float where
a weight or FP8 / FP4 where ``quantization_config`` allows it with a scale of the right
shape and dtype (:func:`.weights.stored_formats`), the ``tid2eid`` tables integer with
their expert ids in range, and as many experts per layer as ``n_routed_experts`` says.
The upstream multi-token-prediction tensors (``mtp.*``) are unused ones the registry
accepts with a log note: the published implementation skips them too. V4.1's Engram
tables are the runtime's (``engram_trt.tables``), checked as engram-llama's are.
:meth:`DeepseekV4Architecture.weight_formats` tells ``engram-trt inspect`` each weight's
stored format and the bytes a load takes.

``engram-trt build`` exports the model as one ONNX serving step (:mod:`.onnx_export`),
its weights in their stored formats from either layout, and refuses, before any work,
what the attention kernel or the routed-experts plugin cannot take
(:meth:`DeepseekV4Architecture.engine_problems`).
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Mapping

from engram_trt.models.base import ArchitectureBase
from engram_trt.models.deepseek_v4.config import (
    CONTRACT,
    V4_ARCH,
    V4_TYPE,
    V41_ARCH,
    V41_TYPE,
    DeepseekV4Config,
    read_config,
)

log = logging.getLogger(__name__)


class DeepseekV4Architecture(ArchitectureBase):
    name = "deepseek-v4"
    architectures = (V4_ARCH, V41_ARCH)
    model_types = (V4_TYPE, V41_TYPE)
    contract = CONTRACT
    title = "DeepSeek-V4"  # the family in messages
    tensor_parallel = True  # --tp N: heads, output groups, indexer heads, experts, vocabulary split (.parallel)

    def parallel_plan(self, config: DeepseekV4Config, tp: int, rank: int = 0) -> Any:
        """TP rank ``rank`` of ``tp``'s share (:mod:`.parallel`); refused in one line when the
        heads, output groups, indexer heads or experts do not divide."""
        from engram_trt.models.deepseek_v4.parallel import parallel_plan

        return parallel_plan(config, tp, rank)

    def read_config(
        self, d: Mapping[str, Any], source: str | None = None, *, enforce_contract: bool = True
    ) -> DeepseekV4Config:
        return read_config(d, source, enforce_contract=enforce_contract)

    def weight_shapes(self, config: DeepseekV4Config) -> dict[str, tuple[int, ...]]:
        """Every tensor the model reads, by checkpoint name (the ``tid2eid`` tables included)."""
        from engram_trt.models.deepseek_v4.model import model_tensor_shapes

        return model_tensor_shapes(config)

    def tensor_names(self, config: DeepseekV4Config) -> set[str]:
        names = set(self.weight_shapes(config))
        if config.engram is not None:
            from engram_trt.checkpoint.checkpoint import engram_tensor_names

            for lid in config.engram.layer_ids:
                t = engram_tensor_names(lid, config.engram.prefix)
                names.update(v for k, v in t.items() if k in ("table", "scale"))
        return names

    def unused_tensors(self, config: DeepseekV4Config, present: Iterable[str]) -> list[str]:
        """Tensors the model does not read (a weight's block scale is read with it), the
        multi-token-prediction layers' excepted (accepted with a note: transformers does
        not build them either)."""
        from engram_trt.checkpoint.checkpoint import natural_key
        from engram_trt.models.deepseek_v4.weights import MTP_TENSOR, resolve_names

        present = list(present)
        used = set(resolve_names(self.tensor_names(config), set(present)).stored.values())
        unused, mtp = [], 0
        for n in present:
            if n in used:
                continue
            if MTP_TENSOR.search(n):
                mtp += 1
            else:
                unused.append(n)
        if mtp:
            log.info(
                "%d multi-token-prediction tensor(s) (mtp.*) are not served (num_nextn_predict_layers=%d)",
                mtp,
                config.num_nextn_predict_layers,
            )
        return sorted(unused, key=natural_key)

    def stored_formats(self, config: DeepseekV4Config, ckpt: Any) -> tuple[dict[str, Any], list[str], Any]:
        """``(canonical name -> StoredFormat, problems, resolved names)`` of the weights a
        checkpoint (or a :class:`~.weights.TensorDict`) holds for ``config``."""
        from engram_trt.models.deepseek_v4.model import meta_modules
        from engram_trt.models.deepseek_v4.weights import model_formats

        return model_formats(meta_modules(config), config.quant, ckpt)

    def checkpoint_problems(self, ckpt: Any, layout: Any = None) -> list[str]:
        """One line per problem (module docstring), the expert count first; with ``layout``
        V4.1's Engram tables against it (:meth:`table_problems`)."""
        from engram_trt.models.deepseek_v4.weights import ROUTED_EXPERT

        cfg = ckpt.config
        out = []
        experts: dict[int, set[int]] = {}
        for name in ckpt.tensor_names():
            m = ROUTED_EXPERT.match(name)
            if m:
                experts.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
        for layer, found in sorted(experts.items()):
            if layer < cfg.num_hidden_layers and len(found) != cfg.n_routed_experts:
                out.append(
                    f"layer {layer} holds {len(found)} routed experts (ids {min(found)}..{max(found)}) but the "
                    f"config's n_routed_experts={cfg.n_routed_experts}; the config does not describe these weights"
                )
                break
        formats, problems, _names = self.stored_formats(cfg, ckpt)
        out.extend(problems)
        for f in formats.values():
            if f.kind != "int":
                continue
            t = ckpt.get(f.name)
            if t.numel() and (int(t.min()) < 0 or int(t.max()) >= cfg.n_routed_experts):
                out.append(
                    f"tensor {f.name} routes to expert {int(t.max()) if int(t.min()) >= 0 else int(t.min())}, "
                    f"outside 0..{cfg.n_routed_experts - 1} (n_routed_experts={cfg.n_routed_experts})"
                )
        return out + self.table_problems(ckpt, layout)

    def weight_formats(self, ckpt: Any, dtype: Any = None) -> dict[str, tuple[str, int, int]]:
        """Stored name -> ``(kind, stored bytes, GPU bytes at dtype)`` of every weight the
        model reads that the checkpoint holds: ``fp8`` / ``fp4`` as stored (scales
        included), ``float`` in ``dtype`` (bf16 unless given; the float32-kept tensors in
        float32), ``int`` (``tid2eid``) as int64. ``engram-trt inspect`` sums it."""
        import torch

        from engram_trt.config.dtypes import TORCH_NAMES, normalize_dtype
        from engram_trt.models.deepseek_v4.model import KEEP_FLOAT32

        dtype = dtype or torch.bfloat16
        if isinstance(dtype, str):
            dtype = getattr(torch, TORCH_NAMES[normalize_dtype(dtype)])
        formats, _problems, _names = self.stored_formats(ckpt.config, ckpt)
        return {f.name: (f.kind, f.stored_bytes, f.gpu_bytes(dtype, KEEP_FLOAT32)) for f in formats.values()}

    def table_problems(self, ckpt: Any, layout: Any) -> list[str]:
        """V4.1: one line per Engram table that is missing, of the wrong width, dtype or
        scale shape, or shorter than the layout's rows (the tables stay the runtime's);
        none without a layout (the weights' check alone)."""
        from engram_trt.checkpoint.checkpoint import engram_tensor_names
        from engram_trt.checkpoint.files import BF16_TABLE_DTYPES, FP8_SCALE_DTYPES, FP8_TABLE_DTYPES

        spec = ckpt.config.engram
        if spec is None or layout is None:
            return []
        out = []
        for li, lid in enumerate(layout.layer_ids):
            names = engram_tensor_names(lid, spec.prefix)
            need, table = int(layout.table_rows[li]), names["table"]
            if table not in ckpt:
                out.append(f"table {table} is missing (Engram layer {lid} needs [{need}, {spec.head_dim}])")
                continue
            shape, st = tuple(ckpt.shape(table)), ckpt.st_dtype(table)
            if len(shape) != 2 or shape[1] != spec.head_dim:
                out.append(
                    f"table {table} has shape {list(shape)} but engram_head_dim={spec.head_dim} needs "
                    f"[rows, {spec.head_dim}]"
                )
            elif shape[0] < need:
                out.append(
                    f"table {table} has {shape[0]} rows but the layout needs at least "
                    f"{need} (engram_vocab_size / primes)"
                )
            elif spec.table_dtype == "bf16" and st not in BF16_TABLE_DTYPES:
                out.append(f"table {table} is {st} but engram_table_dtype='bf16' (expected BF16)")
            elif spec.table_dtype == "fp8":
                want = (shape[0], shape[1] // spec.quant_block)
                if st not in FP8_TABLE_DTYPES:
                    out.append(
                        f"table {table} is {st} but engram_table_dtype='fp8' (expected F8_E4M3 with ue8m0 scales)"
                    )
                elif (
                    names["scale"] not in ckpt
                    or tuple(ckpt.shape(names["scale"])) != want
                    or ckpt.st_dtype(names["scale"]) not in FP8_SCALE_DTYPES
                ):
                    out.append(f"scale {names['scale']} must be F8_E8M0 of shape {list(want)} beside its FP8 table")
        return out

    def build_model(self, config: DeepseekV4Config, weights: Mapping[str, Any], **options: Any) -> Any:
        """A model from a name -> tensor dict (tests, the benchmark; serving loads with
        :meth:`load_model`): canonical names, quantized weights with their
        ``.weight_scale_inv`` scales where ``config.quant`` declares them."""
        import torch

        from engram_trt.errors import CheckpointError
        from engram_trt.models.deepseek_v4.model import KEEP_FLOAT32, DeepseekV4Model
        from engram_trt.models.deepseek_v4.weights import TensorDict, load_into, model_formats, prepare_model

        dev = torch.device(options.get("device", "cpu"))
        dtype = options.get("dtype") or torch.float32
        model = DeepseekV4Model(
            config,
            device=dev,
            dtype=dtype,
            compress_lookup=options.get("compress_lookup"),
            layout=options.get("layout"),
        )
        source = TensorDict(weights)
        formats, problems, names = model_formats(model, config.quant, source)
        if problems:
            raise CheckpointError(f"weights: {problems[0]}")
        prepare_model(model, formats, dev, dtype)
        load_into(model, source, dev, dtype, KEEP_FLOAT32, names)
        return model.eval()

    def load_model(
        self, ckpt: Any, *, device: Any = "cpu", dtype: Any = None, tables: Any = None, parallel: Any = None, **_: Any
    ) -> Any:
        """The model of an open checkpoint, loaded tensor by tensor (refused first when its
        weights do not fit the GPU); V4.1's table store bound when given (the runtime's:
        decode graphs then gather GPU-readable rows inside the graph, the prefetcher
        stages the others). ``parallel``: a tensor-parallel rank's plan (its slices only)."""
        from engram_trt.models.deepseek_v4.model import DeepseekV4Model

        sharded = parallel if parallel is not None and parallel.sharded else None
        model = DeepseekV4Model.from_checkpoint(ckpt, device=device, dtype=dtype, parallel=sharded)
        if tables is not None and ckpt.config.engram is not None:
            model.set_tables(tables)
        return model

    def allocate_state(self, config: DeepseekV4Config, num_slots: int, max_len: int, device: Any, dtype: Any) -> Any:
        from engram_trt.models.deepseek_v4.state import DeepseekV4State

        return DeepseekV4State.allocate(config, num_slots, max_len, device, dtype)

    def engine_problems(self, ckpt: Any) -> list[str]:
        """What `engram-trt build` refuses before any work beyond :meth:`checkpoint_problems`:
        shapes the EngramDsv4Attention kernel cannot take (one line each; the
        length-dependent ones, a compressed entry count below ``index_topk``, are
        checked by the export against ``--max-seq-len``), and FP4 routed experts the
        EngramRoutedExperts plugin cannot take (FP4 has no dense form in the graph: their
        dims must be multiples of 32). Quantized weights and DeepSeek's root names are
        exported as stored (models/onnx_quant.py)."""
        from engram_trt.models.deepseek_v4.onnx_export import engine_limits
        from engram_trt.models.onnx_quant import PLUGIN_MULTIPLE

        cfg = ckpt.config
        out = []
        quant = cfg.quant
        if quant is not None and quant.expert_dtype == "fp4":
            m = PLUGIN_MULTIPLE["fp4"]
            D, I = cfg.hidden_size, cfg.moe_intermediate_size
            if (D % m or I % m) and any(f.kind == "fp4" for f in self.stored_formats(cfg, ckpt)[0].values()):
                out.append(
                    f"FP4 routed experts with hidden_size={D} and moe_intermediate_size={I}: the engine's "
                    f"EngramRoutedExperts plugin takes FP4 experts whose two dims are multiples of {m}; serve "
                    f"this checkpoint with the torch backend (engram-trt run / serve)"
                )
        return out + engine_limits(cfg, int(cfg.max_position_embeddings))

    def engine_fp8_weights(self, ckpt: Any) -> list[str]:
        """The weights an engine takes as FP8 (DequantizeLinear of their bytes, or the
        EngramRoutedExperts plugin's for FP8 experts): the ones the checkpoint stores
        F8_E4M3, by stored name."""
        formats = self.stored_formats(ckpt.config, ckpt)[0]
        return [f.name for f in formats.values() if f.kind == "fp8"]

    def engine_state_inputs(self, config: DeepseekV4Config) -> set[str]:
        """The exported step's per-slot attention states (``onnx_export.state_shapes``:
        window, compressor and indexer states per layer)."""
        from engram_trt.models.deepseek_v4.onnx_export import state_shapes

        return set(state_shapes(config))

    def export_onnx(self, config: DeepseekV4Config, weights: Any, layout: Any, options: Any) -> Any:
        """The ONNX serving step (:mod:`.onnx_export`); ``layout`` is V4.1's Engram layout
        (None for V4)."""
        from engram_trt.models.deepseek_v4.onnx_export import export_model

        return export_model(config, weights, layout, options)

    def reference_ops(self) -> list[type]:
        """The ``onnx.reference`` OpRuns of this family's own plugin nodes (:mod:`.reference_ops`)."""
        from engram_trt.models.deepseek_v4.reference_ops import reference_ops

        return reference_ops()


ARCHITECTURE = DeepseekV4Architecture()
