"""Tiny random DeepSeek-V4 / V4.1 checkpoints that transformers 5.25 builds and saves (every
parameter and buffer drawn at random), their configurations and prompts, and transformers'
greedy tokens as the reference (shared by the DeepSeek-V4 parity, build, serve, quant and
tensor-parallel tests).
"""

from __future__ import annotations

import json
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

NEW_TOKENS = 10

CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"

PROMPTS = [[5, 17, 33, 2, 90, 41, 7, 7, 60, 12, 13, 14, 15], [3, 44, 45, 9], [11 + i for i in range(21)]]

BASE: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=16,
    q_lora_rank=24,
    num_experts_per_tok=2,
    n_routed_experts=4,
    n_shared_experts=1,
    layer_types=[HCA, CSA, HCA],
    compress_rates={CSA: 2, HCA: 4},
    hc_mult=2,
    hc_sinkhorn_iters=5,
    mlp_layer_types=["hash_moe", "moe", "moe"],
    sliding_window=6,
    o_groups=2,
    o_lora_rank=8,
    index_n_heads=2,
    index_head_dim=8,
    index_topk=3,
    num_nextn_predict_layers=0,
    partial_rotary_factor=0.5,
    max_position_embeddings=256,
    eos_token_id=2,
    bos_token_id=1,
)

# name -> DeepseekV4Config overrides; each a configuration the published model runs.
CASES: dict[str, dict[str, Any]] = {
    "hc2-hca-csa-hash1": {},
    "hc4-csa-first-hash2-sigmoid": dict(
        hc_mult=4,
        num_hidden_layers=4,
        layer_types=[CSA, HCA, CSA, CSA],
        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
        compress_rates={CSA: 4, HCA: 3},
        scoring_func="sigmoid",
        sliding_window=5,
        index_topk=2,
        o_groups=4,
        n_routed_experts=6,
        num_experts_per_tok=3,
        routed_scaling_factor=2.5,
        swiglu_limit=0.7,
        hc_sinkhorn_iters=8,
        rope_theta=5000.0,
        compress_rope_theta=40000.0,
    ),
    "hc2-tied-all-moe-window3": dict(
        tie_word_embeddings=True,
        layer_types=[CSA, CSA, HCA],
        mlp_layer_types=["moe", "moe", "moe"],
        sliding_window=3,
        compress_rates={CSA: 3, HCA: 2},
        index_n_heads=3,
        index_topk=1,
        partial_rotary_factor=0.25,
        hc_eps=1e-3,
    ),
}


def save_v4(folder: Path, seed: int = 0, **overrides: Any) -> Any:
    """A random transformers DeepSeek-V4 saved into ``folder`` with a word tokenizer."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    kw = dict(BASE, **overrides)
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**kw)).eval()
    gen = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (1.0 if "embed" in name else 0.3))
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.randint(0, kw["n_routed_experts"], b.shape, generator=gen))
            elif name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.3)
    model.save_pretrained(folder)
    word_tokenizer(folder / "tokenizer.json", VOCAB)
    return model


def hf_greedy(model: Any, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    return transformers_greedy(model, prompt, n)


def save_v41(folder: Path, table: Any, seed: int = 3) -> Any:
    """A saved V4 turned V4.1: Engram fields, random wkv / q / k, and bf16 tables
    made by ``table(rows, width)``. Returns the transformers V4 model."""
    model = save_v4(folder, seed=seed)
    add_v41_engram(folder, lambda rows, width, gen: table(rows, width), seed)
    return model


def add_v41_engram(folder: Path, table: Any, seed: int) -> None:
    """The saved V4 folder turned V4.1 in place: the Engram fields in its config.json,
    random float32 wkv / q / k (a generator seeded ``seed + 7``) and bf16 tables made by
    ``table(rows, width, generator)`` (the same generator, drawn before each layer's wkv)."""
    from engram_trt.engram.layout import EngramLayout
    from engram_trt.models.deepseek_v4.config import read_config
    from safetensors.torch import load_file, save_file

    d = json.loads((folder / "config.json").read_text())
    d.update(
        architectures=["DeepseekV41ForCausalLM"],
        model_type="deepseek_v41",
        engram_layer_ids=[0, 2],
        engram_max_ngram_size=3,
        engram_n_heads=2,
        engram_head_dim=8,
        engram_vocab_size=37,
        engram_compressed_vocab_size=VOCAB,
        engram_pad_token_id=0,
        engram_table_dtype="bf16",
    )
    (folder / "config.json").write_text(json.dumps(d))
    cfg = read_config(d)
    layout = EngramLayout.from_spec(cfg.engram, pad_id=0)
    tensors = load_file(str(folder / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed + 7)
    D = d["hidden_size"]
    for li, lid in enumerate(cfg.engram.layer_ids):
        base = f"model.layers.{lid}.engram"
        tensors[f"{base}.embed.weight"] = table(int(layout.table_rows[li]), 8, gen).to(torch.bfloat16)
        tensors[f"{base}.wkv.weight"] = torch.randn(3 * D, layout.n_hash_cols * 8, generator=gen) * 0.3
        tensors[f"{base}.q_weight"] = torch.randn(2, D, generator=gen)
        tensors[f"{base}.k_weight"] = torch.randn(2, D, generator=gen)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
