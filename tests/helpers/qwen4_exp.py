"""Tiny random Qwen4Exp checkpoints that transformers 5.25 builds and saves (every parameter
drawn at random), their configurations and prompts, and transformers' greedy tokens as the
reference (shared by the Qwen4Exp parity, build, serve, tables, FP8 and tensor-parallel tests).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.checkpoints import (
    transformers_greedy,
    word_tokenizer,
)

transformers = pytest.importorskip("transformers")

VOCAB = 96

EOS = 2

NEW_TOKENS = 10

PROMPTS = [
    [5, 17, 33, EOS, 90, 41, 7, 7, 60],
    [EOS, EOS, 3, 44],
    [11, 12, 13, 14, EOS, 16, 17, 18, 19, 20, 21, 22, 23, 24],
]

BASE: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_conv_kernel_dim=4,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=24,
    num_experts=6,
    num_experts_per_tok=2,
    hc_count=2,
    hc_lowrank=8,
    max_position_embeddings=256,
    eos_token_id=EOS,
    bos_token_id=1,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    indexer_n_heads=2,
    indexer_kv_heads=1,
    indexer_head_dim=16,
    indexer_budget=4,
    indexer_compress_ratio=2,
)

# name -> Qwen4ExpTextConfig overrides; each is a configuration the published model runs.
CASES: dict[str, dict[str, Any]] = {
    "hc2-ple1-qsa": dict(
        ple_layer_ids=[1],
        ple_embed_dim=16,
        ngram_size=3,
        heads_per_ngram=2,
        ngram_vocab_size_base=50,
        make_ngram_vocab_size_divisible_by=8,
        split_ngram_parts=2,
    ),
    "hc4-ple2-interval2": dict(
        hc_count=4,
        full_attention_interval=2,
        ple_layer_ids=[1, 3],
        ple_embed_dim=24,
        ngram_size=2,
        heads_per_ngram=3,
        ngram_vocab_size_base=70,
        make_ngram_vocab_size_divisible_by=16,
        split_ngram_parts=3,
        indexer_budget=8,
        indexer_compress_ratio=4,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 1.0},
    ),
    "no-ple-tied-sigmoid": dict(
        tie_word_embeddings=True,
        output_gate_type="sigmoid",
        norm_topk_prob=False,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    ),
    # (an all-linear model does not generate in transformers 5.25: its cache has no attention layer to size masks by)
    "ngram4-three-layers": dict(
        layer_types=["linear_attention", "linear_attention", "full_attention"],
        num_hidden_layers=3,
        ple_layer_ids=[2],
        ple_embed_dim=12,
        ngram_size=4,
        heads_per_ngram=1,
        ngram_vocab_size_base=40,
        make_ngram_vocab_size_divisible_by=4,
        split_ngram_parts=1,
        eos_token_id=[EOS, 3],
        ple_conv_kernel_size=3,
        hc_count=3,
    ),
    # PLE rows that do not divide by split_ngram_parts: transformers' save writes what
    # torch.chunk gives, ceil(rows / chunk) shards of chunk = ceil(rows / parts) rows, fewer
    # than split_ngram_parts. 224 rows in 64 parts: 56 shards of 4; 272 rows: 55 shards of 5,
    # the last of 2.
    "hc4-ple2-chunk64": dict(
        hc_count=4,
        full_attention_interval=2,
        ple_layer_ids=[1, 3],
        ple_embed_dim=24,
        ngram_size=2,
        heads_per_ngram=3,
        ngram_vocab_size_base=70,
        make_ngram_vocab_size_divisible_by=16,
        split_ngram_parts=64,
        indexer_budget=8,
        indexer_compress_ratio=4,
    ),
    # 132 rows in 13 parts: 12 shards of 11 rows.
    "ngram4-chunk13": dict(
        layer_types=["linear_attention", "linear_attention", "full_attention"],
        num_hidden_layers=3,
        ple_layer_ids=[2],
        ple_embed_dim=12,
        ngram_size=4,
        heads_per_ngram=1,
        ngram_vocab_size_base=40,
        make_ngram_vocab_size_divisible_by=4,
        split_ngram_parts=13,
        eos_token_id=[EOS, 3],
        ple_conv_kernel_size=3,
        hc_count=3,
    ),
}


def randomized(model: Any, seed: int) -> Any:
    """Every parameter drawn at random (PLE tables included)."""
    gen = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 1.0 if "embed" in name else 0.3
            p.copy_(torch.randn(p.shape, generator=gen) * scale)
            if name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=gen) * 2 - 1)
    return model


def save_qwen4(folder: Path, seed: int = 0, **overrides: Any) -> Any:
    """A random transformers Qwen4Exp saved into ``folder`` with a word tokenizer."""
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    kw = dict(BASE, **overrides)
    torch.manual_seed(seed)
    model = randomized(Qwen4ExpForCausalLM(Qwen4ExpTextConfig(**kw)).eval(), seed)
    model.save_pretrained(folder)
    word_tokenizer(folder / "tokenizer.json", VOCAB)
    return model


def hf_greedy(model: Any, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    return transformers_greedy(model, prompt, n)


# A Qwen4Exp whose heads and experts divide by 4 (the tensor-parallel tests' case overrides).
QWEN_TP4 = dict(num_attention_heads=4, indexer_n_heads=4, num_experts=8)  # kv 1, linear k heads 2 / v heads 4


def gdn_config(**overrides: Any) -> Any:
    """transformers' Qwen4ExpTextConfig of one Gated DeltaNet layer (hidden 32, 2 key heads and
    4 value heads of 8, a 4-tap convolution) with ``overrides``."""
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig

    fields: dict[str, Any] = dict(
        hidden_size=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        rms_norm_eps=1e-6,
    )
    fields.update(overrides)
    return Qwen4ExpTextConfig(**fields)
