"""DeepSeek-V4 / V4.1 checkpoints as they are published (FP8 E4M3 linears with ue8m0 128x128
block scales, FP4 routed experts, the upstream names): the float folders, their quantized
and dequantized twins, transformers' load of a float folder (shared by the DeepSeek-V4
quant, quant build and tensor-parallel tests).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from engram_trt.quant.formats import dequantize_fp4, dequantize_fp8, quantize_fp4, quantize_fp8
from helpers.deepseek_v4 import BASE, CSA, HCA, VOCAB, add_v41_engram

from helpers.checkpoints import (
    word_tokenizer,
)

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 17, 33, 2, 90, 41, 7, 7, 60, 12, 13, 14, 15], [3, 44, 45, 9], [11 + i for i in range(19)]]

QUANT_CONFIG = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "scale_fmt": "ue8m0",
    "weight_block_size": [128, 128],
}

FP8_LINEAR = re.compile(
    r"\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b)\.weight$|\.indexer\.wq_b\.weight$|"
    r"\.shared_experts\.w[123]\.weight$"
)

ROUTED = re.compile(r"\.experts\.\d+\.w[123]\.weight$")

BF16_2D = re.compile(
    r"\.(compressor\.wkv|compressor\.wgate|indexer\.weights_proj|gate)\.weight$|"
    r"^(embed|head)\.weight$"
)

_ROOT = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "model.hc_head.hc_fn": "hc_head_fn",
    "model.hc_head.hc_base": "hc_head_base",
    "model.hc_head.hc_scale": "hc_head_scale",
}

# name -> (transformers DeepseekV4Config overrides, V4.1?, partial blocks?)
CASES: dict[str, tuple[dict[str, Any], bool, bool]] = {
    # every FP8 dim 128 (one block each); three layers HCA / CSA / HCA, one hash layer
    "v4-128-hash1": (
        dict(
            hidden_size=128,
            num_attention_heads=2,
            head_dim=128,
            q_lora_rank=128,
            o_groups=2,
            o_lora_rank=128,
            moe_intermediate_size=128,
            index_n_heads=2,
            index_head_dim=64,
        ),
        False,
        False,
    ),
    # grids of 2x2 blocks (256 = two blocks), hc 4, CSA first, two hash layers, sigmoid, 6 experts top 3
    "v4-256-hc4-hash2": (
        dict(
            hidden_size=256,
            num_attention_heads=2,
            head_dim=128,
            q_lora_rank=256,
            o_groups=2,
            o_lora_rank=128,
            moe_intermediate_size=64,
            index_n_heads=4,
            index_head_dim=64,
            hc_mult=4,
            num_hidden_layers=4,
            layer_types=[CSA, HCA, CSA, CSA],
            mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
            compress_rates={CSA: 4, HCA: 3},
            scoring_func="sigmoid",
            n_routed_experts=6,
            num_experts_per_tok=3,
            swiglu_limit=0.7,
            sliding_window=5,
            index_topk=2,
        ),
        False,
        False,
    ),
    # partial blocks everywhere: 160 = 128 + 32, 200 = 128 + 72, 144, 192 ...; tied off, all top-k
    "v4-partial-160": (
        dict(
            hidden_size=160,
            num_attention_heads=2,
            head_dim=96,
            q_lora_rank=200,
            o_groups=2,
            o_lora_rank=72,
            moe_intermediate_size=96,
            index_n_heads=3,
            index_head_dim=48,
            layer_types=[CSA, CSA, HCA],
            mlp_layer_types=["moe", "moe", "moe"],
            compress_rates={CSA: 3, HCA: 2},
            index_topk=1,
        ),
        False,
        True,
    ),
    # V4.1: Engram on layers 0 and 2, partial blocks, one hash layer
    "v41-partial-160": (
        dict(
            hidden_size=160,
            num_attention_heads=2,
            head_dim=96,
            q_lora_rank=200,
            o_groups=2,
            o_lora_rank=72,
            moe_intermediate_size=96,
            index_n_heads=3,
            index_head_dim=48,
        ),
        True,
        True,
    ),
    # V4.1 with 128-aligned dims
    "v41-128": (
        dict(
            hidden_size=128,
            num_attention_heads=2,
            head_dim=128,
            q_lora_rank=128,
            o_groups=2,
            o_lora_rank=128,
            moe_intermediate_size=128,
            index_n_heads=2,
            index_head_dim=64,
        ),
        True,
        False,
    ),
}


# ------------------------------------------------------------------------------ writers
def save_float_v4(folder: Path, seed: int, **overrides: Any) -> None:
    """A random transformers DeepSeek-V4 saved into ``folder`` (float32, transformers'
    names) with a word tokenizer."""
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


def add_engram(folder: Path, seed: int) -> None:
    """The saved V4 folder turned V4.1 (tests/helpers/deepseek_v4.add_v41_engram, as
    save_v41 does): Engram fields, random float32 wkv / q / k, random bf16 tables."""
    add_v41_engram(folder, lambda rows, width, gen: torch.randn(rows, width, generator=gen), seed)


def hub_name(name: str) -> str:
    """DeepSeek's root spelling of a transformers-saved name (Engram tensors keep theirs)."""
    if ".engram." in name:
        return name
    if name in _ROOT:
        return _ROOT[name]
    return name[len("model.") :] if name.startswith("model.") else name


def quantize_folder(src: Path, out: Path, *, hub: bool = True, scale_suffix: str = ".scale", mtp: bool = True) -> None:
    """``src`` (a float transformers save) laid out as the hub ships DeepSeek-V4 (module
    docstring); ``hub=False`` keeps transformers' names (``model.`` prefix), and
    ``scale_suffix`` ``.weight_scale_inv`` transformers' in-memory scale name."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        n = hub_name(name) if hub else name
        if FP8_LINEAR.search(n) or ROUTED.search(n):
            q, s = quantize_fp8(t, (128, 128), "ue8m0") if FP8_LINEAR.search(n) else quantize_fp4(t)
            tensors[n] = q
            tensors[n[: -len(".weight")] + scale_suffix] = s
        elif n.endswith("tid2eid"):
            tensors[n] = t.to(torch.int32)
        elif BF16_2D.search(hub_name(name)):
            tensors[n] = t.to(torch.bfloat16)
        else:
            tensors[n] = t
    if mtp:  # DeepSeek's multi-token-prediction layer: not served, accepted
        first = next(n for n in tensors if FP8_LINEAR.search(n))
        tensors["mtp.0.norm.weight"] = torch.ones(8)
        tensors["mtp.0.attn.wq_a.weight"] = tensors[first].clone()
        tensors["mtp.0.attn.wq_a" + scale_suffix] = tensors[first[: -len(".weight")] + scale_suffix].clone()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    d = json.loads((src / "config.json").read_text())
    d["quantization_config"] = dict(QUANT_CONFIG)
    d["expert_dtype"] = "fp4"
    (out / "config.json").write_text(json.dumps(d, indent=1))
    shutil.copy(src / "tokenizer.json", out / "tokenizer.json")


def dequantized_folder(qfolder: Path, out: Path) -> None:
    """The float32 folder (transformers' names, no quantization_config) of a quantized
    one, every FP8 / FP4 weight dequantized in float64 exactly per the format (blocks of
    128 / groups of 32, the last one partial) and rounded to float32 (exact: e4m3 and e2m1
    values times a power of two); BF16 weights widened (V4.1's Engram tables kept bf16)."""
    from engram_trt.models.deepseek_v4.weights import checkpoint_names
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True)
    stored = load_file(str(qfolder / "model.safetensors"))
    upstream_to_canonical = {}
    for name in stored:
        if name.startswith("mtp.") or name.endswith(".scale"):
            continue
        canonical = (
            "model." + name if name.startswith("layers.") else next((k for k, v in _ROOT.items() if v == name), name)
        )
        assert name in checkpoint_names(canonical)
        upstream_to_canonical[name] = canonical
    tensors = {}
    for name, canonical in upstream_to_canonical.items():
        t = stored[name]
        scale = stored.get(name[: -len(".weight")] + ".scale")
        if t.dtype == torch.float8_e4m3fn:
            t = dequantize_fp8(t, scale, (128, 128), torch.float64).to(torch.float32)
        elif t.dtype == torch.int8:
            t = dequantize_fp4(t, scale, (1, 32), torch.float64).to(torch.float32)
        elif t.is_floating_point() and not name.endswith(".engram.embed.weight"):  # V4.1's tables stay bf16
            t = t.to(torch.float32)
        tensors[canonical] = t
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    d = json.loads((qfolder / "config.json").read_text())
    d.pop("quantization_config")
    d.pop("expert_dtype")
    (out / "config.json").write_text(json.dumps(d, indent=1))
    shutil.copy(qfolder / "tokenizer.json", out / "tokenizer.json")


def hf_load(folder: Path) -> Any:
    """transformers 5.25 ``from_pretrained`` on the CPU in float32 (``use_kernels=False``:
    the hub ``kernels`` package it would ask for is not installed; on a CPU it takes no
    part in an FP8 folder's load, which dequantizes)."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, use_kernels=False, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    return model.eval()
