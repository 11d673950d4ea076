"""engram-llama's config.json contract: what transformers' Llama implementation reads,
each field honoured (read into :class:`~engram_trt.config.model.ModelConfig`, RoPE into
its typed setting), pinned to the one value implemented, or without effect at inference.
Everything else in a config is what transformers ignores too, and is only logged."""

from __future__ import annotations

import logging
from typing import Any, Mapping

from engram_trt.config.model import ModelConfig
from engram_trt.models.contract import FieldContract, Pinned

log = logging.getLogger(__name__)

CONTRACT = FieldContract(
    architecture="engram-llama",
    honoured=frozenset({
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "vocab_size", "rms_norm_eps", "max_position_embeddings", "hc_mult", "tie_word_embeddings",
        "bos_token_id", "eos_token_id", "torch_dtype", "dtype", "rope_theta", "rope_scaling", "rope_parameters",
    }),
    honoured_prefixes=("engram_",),
    pinned={
        "hidden_act": Pinned(("silu",), "silu", "the MLP is SwiGLU"),
        "attention_bias": Pinned((False,), False, "q/k/v/o projections without bias"),
        "mlp_bias": Pinned((False,), False, "gate/up/down projections without bias"),
        "quantization_config": Pinned((None,), None, "weights are read as float tensors; dequantize the checkpoint first"),
    },
    # Read by transformers' Llama but without effect on a forward pass at inference:
    # dropout is off, padding_idx only stops gradients, pretraining_tp is not read by
    # transformers 5's modeling code.
    neutral=frozenset({"attention_dropout", "pad_token_id", "pretraining_tp"}),
)


def read_config(d: Mapping[str, Any], source: str | None = None, *, enforce_contract: bool = True) -> ModelConfig:
    """The typed config of a config.json dict; the first unsupported field refused
    (``enforce_contract=False``: left to the caller, which lists them all, as inspect does)."""
    if enforce_contract:
        CONTRACT.check(d, source)
    config = ModelConfig.from_dict(d, source)
    ignored = CONTRACT.ignored(d)
    if ignored:
        log.info("%s: fields the model does not read (transformers' Llama does not either): %s",
                 source or "config", ", ".join(ignored))
    return config
