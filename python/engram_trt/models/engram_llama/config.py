"""engram-llama's config.json contract: what transformers' Llama implementation reads,
each field honoured (read into :class:`~engram_trt.config.model.ModelConfig`, RoPE into
its typed setting), pinned to the one value implemented, or without effect at inference.
Everything else in a config is what transformers ignores too, and is only logged.

``quantization_config`` is read by :func:`engram_trt.quant.spec.read_quant_spec` into
``ModelConfig.quant`` (fine-grained FP8: the weights stored F8_E4M3 are served in that
form, docs/quantization.md); a method it does not serve is refused in one line."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Mapping

from engram_trt.config.model import ModelConfig
from engram_trt.models.contract import FieldContract, Pinned
from engram_trt.quant.spec import read_quant_spec

log = logging.getLogger(__name__)

CONTRACT = FieldContract(
    architecture="engram-llama",
    honoured=frozenset(
        {
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "vocab_size",
            "rms_norm_eps",
            "max_position_embeddings",
            "hc_mult",
            "tie_word_embeddings",
            "bos_token_id",
            "eos_token_id",
            "torch_dtype",
            "dtype",
            "rope_theta",
            "rope_scaling",
            "rope_parameters",
            "quantization_config",
        }
    ),
    honoured_prefixes=("engram_",),
    pinned={
        "hidden_act": Pinned(("silu",), "silu", "the MLP is SwiGLU"),
        "attention_bias": Pinned((False,), False, "q/k/v/o projections without bias"),
        "mlp_bias": Pinned((False,), False, "gate/up/down projections without bias"),
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
    quant = read_quant_spec(d, source)  # an unserved method or value: refused here, in one line
    config = ModelConfig.from_dict(d, source)
    if quant is not None:
        config = replace(config, quant=quant)
    ignored = CONTRACT.ignored(d)
    if ignored:
        log.info(
            "%s: fields the model does not read (transformers' Llama does not either): %s",
            source or "config",
            ", ".join(ignored),
        )
    return config
