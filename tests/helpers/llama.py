"""Tiny random Llama checkpoints that transformers 5.25 builds and saves, the supported
configurations, prompts, and transformers' greedy tokens as the reference (shared by the
Llama parity, serve, CLI and tensor-parallel tests).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.checkpoints import word_tokenizer

transformers = pytest.importorskip("transformers")

VOCAB = 256

PROMPTS = [[5, 17, 33, 2, 90, 41, 7], [200, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]

NEW_TOKENS = 12

BASE: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    initializer_range=0.08,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)

# name -> LlamaConfig overrides (transformers 5 spelling); every value here is one the
# model implements, so it must serve the transformers model token for token.
SUPPORTED: dict[str, dict[str, Any]] = {
    "default": {},
    "theta-1e5": {"rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}},
    "tied-head": {"tie_word_embeddings": True},
    "mha-wide-head": {"num_key_value_heads": 4, "head_dim": 32},
    "one-kv-head": {"num_key_value_heads": 1, "rms_norm_eps": 1e-6},
    "llama3": {
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
    },
    "linear": {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}},
    "dynamic": {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}},
    "yarn": {
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
        }
    },
    "yarn-attention-factor": {
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 2.0,
            "attention_factor": 0.8,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
            "original_max_position_embeddings": 64,
        }
    },
    "neutral-fields": {"attention_dropout": 0.1, "pad_token_id": 0, "pretraining_tp": 2},
}


def save_llama(folder: Path, seed: int = 0, **overrides: Any) -> Any:
    """A random transformers Llama saved into ``folder`` with a word tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**dict(BASE, **overrides))).eval()
    model.save_pretrained(folder)
    word_tokenizer(folder / "tokenizer.json", VOCAB)
    return model


def hf_greedy(model: Any, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()
