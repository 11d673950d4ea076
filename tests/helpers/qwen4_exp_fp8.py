"""Fine-grained FP8 Qwen4Exp checkpoints: the configurations and prompts (shared by the
Qwen4Exp FP8 and quant build tests).
"""

from __future__ import annotations

from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

VOCAB = 96

EOS = 2

PROMPTS = [[5, 17, 33, EOS, 90, 41, 7, 7, 60], [EOS, EOS, 3, 44], [11, 12, 13, 14, EOS, 16, 17, 18, 19, 20, 21]]

BASE: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_conv_kernel_dim=4,
    moe_intermediate_size=128,
    shared_expert_intermediate_size=128,
    num_experts=4,
    num_experts_per_tok=2,
    hc_count=2,
    hc_lowrank=128,
    max_position_embeddings=256,
    eos_token_id=EOS,
    bos_token_id=1,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    indexer_n_heads=2,
    indexer_kv_heads=1,
    indexer_head_dim=64,
    indexer_budget=4,
    indexer_compress_ratio=2,
)

# name -> (Qwen4ExpTextConfig overrides, FineGrainedFP8Config arguments)
CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    # PLE (key / value projections FP8) with 240 rows in 100 parts: 80 shards of 3
    "ple-fp8-float-scales": (
        dict(
            ple_layer_ids=[1],
            ple_embed_dim=128,
            ngram_size=3,
            heads_per_ngram=2,
            ngram_vocab_size_base=50,
            make_ngram_vocab_size_divisible_by=8,
            split_ngram_parts=100,
        ),
        dict(weight_block_size=[128, 128]),
    ),
    "tied-ue8m0-shared-expert-float": (
        dict(
            tie_word_embeddings=True,
            output_gate_type="sigmoid",
            norm_topk_prob=False,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        ),
        # transformers' rule: a regex from the name's start, or a suffix
        dict(
            weight_block_size=[128, 128],
            scale_fmt="ue8m0",
            modules_to_not_convert=["model.layers.*.mlp.shared_expert", "lm_head"],
        ),
    ),
    # I = 64: the experts' gate_up [128, 128] quantized as one block row over both halves
    "experts-i64-straddle": (
        dict(
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
            num_experts=6,
            ple_layer_ids=[2],
            ple_embed_dim=64,
            ngram_size=2,
            heads_per_ngram=4,
            ngram_vocab_size_base=40,
            make_ngram_vocab_size_divisible_by=4,
            split_ngram_parts=7,
        ),
        dict(weight_block_size=[128, 128]),
    ),
}
