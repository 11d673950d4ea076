"""engram-llama's declaration in the model registry: a Llama-family decoder (RMSNorm,
RoPE attention with grouped KV heads, SwiGLU MLP) whose residual stream may be
``hc_mult`` copies, with optional Engram layers (docs/engram-spec.md). A plain HF
``LlamaForCausalLM`` is this model with ``hc_mult`` = 1 and no Engram layers, so both
names resolve here.

Its config fields' contract is :mod:`.config`'s.
"""

from __future__ import annotations

from typing import Any, Mapping

from engram_trt.config.model import ModelConfig
from engram_trt.models.engram_llama.config import CONTRACT, read_config
from engram_trt.models.base import ArchitectureBase


class EngramLlamaArchitecture(ArchitectureBase):
    name = "engram-llama"
    architectures = ("EngramLlamaForCausalLM", "LlamaForCausalLM")
    model_types = ("engram_llama", "llama")
    contract = CONTRACT
    title = "engram-llama"  # the family in messages
    tensor_parallel = True  # --tp N: the backbone's heads / MLP / vocab split (parallel_plan), the Engram columns too

    def parallel_plan(self, config: ModelConfig, tp: int, rank: int = 0) -> Any:
        """TP rank ``rank`` of ``tp``'s share (:mod:`.parallel`): heads, MLP channels and
        vocabulary rows split; refused in one line when the heads do not divide."""
        from engram_trt.models.engram_llama.parallel import parallel_plan

        return parallel_plan(config, tp, rank)

    def read_config(
        self, d: Mapping[str, Any], source: str | None = None, *, enforce_contract: bool = True
    ) -> ModelConfig:
        return read_config(d, source, enforce_contract=enforce_contract)

    def weight_shapes(self, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        from engram_trt.models.engram_llama.weights import model_weight_shapes

        return model_weight_shapes(config)

    def tensor_names(self, config: ModelConfig) -> set[str]:
        """Every tensor name the model reads from a checkpoint: its weights and, per Engram
        layer, the table and (FP8) its scales."""
        from engram_trt.checkpoint.checkpoint import engram_tensor_names

        names = set(self.weight_shapes(config))
        # An FP8 checkpoint's block scales (transformers' FP8 save also writes a stale one
        # beside each weight it leaves in 16 bits, the tied head's included: not read).
        # Known whatever the config says, so that an FP8 weight whose config lost its
        # quantization_config is refused for that, by name (validate_checkpoint).
        from engram_trt.models.engram_llama.checks import is_linear_weight
        from engram_trt.quant.names import scale_candidates

        for n in [n for n in names if is_linear_weight(n)] + ["lm_head.weight"]:
            names.update(scale_candidates(n))
        if config.engram is not None:
            for lid in config.engram.layer_ids:
                t = engram_tensor_names(lid, config.engram.prefix)
                names.add(t["table"])
                if config.engram.table_dtype == "fp8":
                    names.add(t["scale"])
        return names

    def checkpoint_problems(self, ckpt: Any, layout: Any = None) -> list[str]:
        """One line per missing / misshapen tensor (backbone and Engram tables against
        ``layout``, else the config's)."""
        from engram_trt.models.engram_llama.checks import validate_checkpoint

        return validate_checkpoint(ckpt, layout)

    def load_model(
        self,
        ckpt: Any,
        *,
        device: Any = "cpu",
        dtype: Any = None,
        tables: Any = None,
        compress_lookup: Any = None,
        layout: Any = None,
        parallel: Any = None,
        **_: Any,
    ) -> Any:
        """The torch module of an open checkpoint, its weights read tensor by tensor from
        their shards (FP8 linears kept in their stored form); ``tables``: a store the
        runtime opened (attached), else none (the runtime stages rows). The compressed
        vocab and layout are the checkpoint's unless given. ``parallel``: a sharded
        :class:`~engram_trt.models.parallel.ParallelPlan` (with its group): the modules
        built at the rank's sizes, only the rank's slices read."""
        import torch

        from engram_trt.models.engram_llama.checks import require_valid
        from engram_trt.checkpoint.vocab import engram_lookup_and_layout
        from engram_trt.models.engram_llama.model import EngramLlama
        from engram_trt.models.engram_llama.weights import lazy_weights

        if compress_lookup is None and ckpt.config.engram is not None:
            compress_lookup, layout = engram_lookup_and_layout(ckpt)
        require_valid(ckpt, layout)
        config, source = ckpt.config, ckpt
        if parallel is not None and parallel.sharded:
            from engram_trt.models.parallel import ShardedCheckpoint

            config, source = parallel.local_config, ShardedCheckpoint(ckpt, parallel)
        else:
            parallel = None
        model = EngramLlama(
            config,
            lazy_weights(source),
            compress_lookup=compress_lookup,
            layout=layout,
            device=device,
            dtype=dtype or torch.float32,
            parallel=parallel,
        )
        if tables is not None:
            model.set_tables(tables)
        return model

    def build_model(self, config: ModelConfig, weights: Mapping[str, Any], **options: Any) -> Any:
        from engram_trt.models.engram_llama.model import EngramLlama

        return EngramLlama(config, weights, **options)

    def allocate_state(self, config: ModelConfig, num_slots: int, max_len: int, device: Any, dtype: Any) -> Any:
        from engram_trt.models.kv_cache import KVCache

        return KVCache.allocate(config, num_slots, max_len, device, dtype)

    def export_onnx(self, config: ModelConfig, weights: Any, layout: Any, options: Any) -> Any:
        from engram_trt.models.engram_llama.onnx_export import export_model

        return export_model(config, weights, layout, options)

    def reference_ops(self) -> list[type]:
        """The ``onnx.reference`` OpRuns of this family's own plugin nodes (:mod:`.reference_ops`)."""
        from engram_trt.models.engram_llama.reference_ops import reference_ops

        return reference_ops()


ARCHITECTURE = EngramLlamaArchitecture()
