"""Fine-grained FP8 Llama checkpoints: the configurations, prompts and the partial-block FP8
folder writer (shared by the Llama FP8, quant build and tensor-parallel tests).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from helpers.checkpoints import (
    folder_tensors,
    save_folder_as,
)

transformers = pytest.importorskip("transformers")

VOCAB = 256

PROMPTS = [[5, 17, 33, 2, 90, 41, 7], [200, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]

BASE: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=256,
    intermediate_size=384,
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

# name -> (LlamaConfig overrides, FineGrainedFP8Config arguments; None: laid out by the
# formats note with partial blocks)
CASES: dict[str, tuple[dict[str, Any], dict[str, Any] | None]] = {
    # every projection FP8 (dims 256 / 128 / 384), float32 scales, the head float
    "all-fp8-float-scales": ({}, dict(weight_block_size=[128, 128])),
    # tied head, ue8m0 scales; k / v (one 64-wide head) and the MLP (200) left float
    "tied-ue8m0-partly-float": (
        dict(tie_word_embeddings=True, intermediate_size=200, num_key_value_heads=1),
        dict(weight_block_size=[128, 128], scale_fmt="ue8m0"),
    ),
    # hidden 384 in 6 heads; o_proj and the head kept in 16 bits by modules_to_not_convert
    "not-converted-o-proj": (
        dict(hidden_size=384, num_attention_heads=6, intermediate_size=512),
        dict(weight_block_size=[128, 128], modules_to_not_convert=["o_proj", "lm_head"]),
    ),
    # dims 320 / 64 / 200 in 128x128 blocks, the last ones partial; every projection FP8
    "partial-blocks": (
        dict(hidden_size=320, num_attention_heads=5, num_key_value_heads=1, intermediate_size=200),
        None,
    ),
}


def partial_block_folder(float_folder: Path, out: Path) -> Path:
    """Every projection of a float folder quantized per the formats note (128x128 blocks,
    the last partial, float32 scales as ``weight_scale_inv``), transformers' config keys."""
    from engram_trt.quant.formats import quantize_fp8

    tensors = folder_tensors(float_folder)
    for k in list(tensors):
        if k.endswith("_proj.weight"):
            q, s = quantize_fp8(tensors[k], (128, 128), "float")
            tensors[k] = q
            tensors[k[: -len(".weight")] + ".weight_scale_inv"] = s
    cfg = json.loads((float_folder / "config.json").read_text())
    cfg["quantization_config"] = {
        "activation_scheme": "dynamic",
        "dequantize": False,
        "expert_dtype": "fp8",
        "modules_to_convert": None,
        "modules_to_not_convert": None,
        "quant_method": "fp8",
        "scale_fmt": "float",
        "weight_block_size": [128, 128],
    }
    return save_folder_as(float_folder, out, tensors, cfg)
