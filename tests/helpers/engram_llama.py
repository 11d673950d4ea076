"""The engram-llama reference model's test configurations, a model built from them, and its
float64 NumPy forward (shared by the model and fused backbone tests).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from engram_trt.checkpoint.checkpoint import engram_tensor_names
from engram_trt.config.model import ModelConfig
from engram_trt.engram.fusion import engram_gate_reference
from engram_trt.engram.hashing import hash_ids
from engram_trt.engram.layout import EngramLayout
from engram_trt.engram.quant import dequant_fp8_rows
from engram_trt.models.engram_llama.demo import random_weights
from engram_trt.models.engram_llama.model import EngramLlama

CVOCAB = 120

MODEL_CONFIG: dict[str, Any] = {
    "architectures": ["EngramLlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 300,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 64,
    "hc_mult": 2,
    "tie_word_embeddings": False,
    "eos_token_id": 2,
    "engram_layer_ids": [0, 2],
    "engram_max_ngram_size": 3,
    "engram_n_heads": 2,
    "engram_head_dim": 32,
    "engram_vocab_size": 50,
    "engram_compressed_vocab_size": CVOCAB,
    "engram_pad_token_id": 1,
}

PLAIN_CONFIG = {k: v for k, v in MODEL_CONFIG.items() if not k.startswith("engram_")} | {
    "hc_mult": 1,
    "tie_word_embeddings": True,
}

IDS = [5, 17, 250, 3, 17, 250, 3, 99, 42, 7, 7, 180, 64]


def make_lookup(seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, CVOCAB, (MODEL_CONFIG["vocab_size"],), generator=gen, dtype=torch.int64)


def build(
    cfg_dict: dict[str, Any], seed: int = 0, dtype: torch.dtype = torch.float32
) -> tuple[EngramLlama, ModelConfig, dict[str, torch.Tensor], torch.Tensor | None]:
    cfg = ModelConfig.from_dict(cfg_dict)
    lookup = make_lookup() if cfg.engram is not None else None
    rows = None
    if cfg.engram is not None:
        layout = EngramLayout.from_spec(cfg.engram, pad_id=int(lookup[cfg.engram.pad_token_id]))  # type: ignore[index]
        rows = [int(r) + 3 for r in layout.table_rows]
    weights = random_weights(cfg, torch.Generator().manual_seed(seed), table_rows=rows)
    return EngramLlama(cfg, weights, compress_lookup=lookup, dtype=dtype), cfg, weights, lookup


def close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-4) -> None:
    scale = float(b.abs().max())
    torch.testing.assert_close(a, b, rtol=rel, atol=rel * scale)


# --------------------------------------------------------------------------------------
# An independent float64 NumPy forward (the spec's reference architecture)
# --------------------------------------------------------------------------------------
def f64(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float64).numpy()


def np_table_rows(weights: dict[str, torch.Tensor], name: dict[str, str], ids: np.ndarray, block: int) -> np.ndarray:
    table = weights[name["table"]]
    if table.element_size() == 1:
        q = table.view(torch.uint8).numpy()[ids]
        s = weights[name["scale"]].view(torch.uint8).numpy()[ids]
        return dequant_fp8_rows(q, s, block).astype(np.float64)
    return f64(table)[ids]


def np_engram(
    cfg: ModelConfig,
    weights: dict[str, torch.Tensor],
    layout: EngramLayout,
    li: int,
    hidden: np.ndarray,
    cids: np.ndarray,
    lookback: np.ndarray | None,
) -> np.ndarray:
    spec = cfg.engram
    assert spec is not None
    names = engram_tensor_names(layout.layer_ids[li], spec.prefix)
    hid = hash_ids(cids, layout, lookback)[:, li, :]  # [T, cols]
    rows = np_table_rows(weights, names, hid, spec.quant_block)  # [T, cols, hd]
    kv = rows.reshape(rows.shape[0], -1) @ f64(weights[names["wkv"]]).T
    return engram_gate_reference(
        hidden, kv, f64(weights[names["q_weight"]]), f64(weights[names["k_weight"]]), cids >= 0, cfg.rms_norm_eps
    )


def np_rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def np_rope(x: np.ndarray, pos: np.ndarray, theta: float) -> np.ndarray:
    hd = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
    ang = pos[:, None] * inv[None]
    emb = np.concatenate([ang, ang], -1)[:, None, :]
    rot = np.concatenate([-x[..., hd // 2 :], x[..., : hd // 2]], -1)
    return x * np.cos(emb) + rot * np.sin(emb)


def np_forward(
    cfg: ModelConfig,
    weights: dict[str, torch.Tensor],
    lookup: torch.Tensor | None,
    ids: list[int],
    engram_ids: np.ndarray | None = None,
) -> np.ndarray:
    W = lambda n: f64(weights[n])  # noqa: E731
    T, hc = len(ids), cfg.hc_mult
    nh, kvh, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    eps = cfg.rms_norm_eps
    pos = np.arange(T, dtype=np.float64)
    hs = np.repeat(W("model.embed_tokens.weight")[ids][:, None, :], hc, axis=1)
    layout = None
    cids = None
    if cfg.engram is not None:
        assert lookup is not None
        layout = EngramLayout.from_spec(cfg.engram, pad_id=int(lookup[cfg.engram.pad_token_id]))
        cids = lookup.numpy()[ids] if engram_ids is None else np.asarray(engram_ids)
    index = cfg.engram_layer_index
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        if i in index:
            assert layout is not None and cids is not None
            hs = np_engram(cfg, weights, layout, index[i], hs, cids, None)
        x = np_rms(hs.mean(1), W(f"{p}.input_layernorm.weight"), eps)
        q = np_rope((x @ W(f"{p}.self_attn.q_proj.weight").T).reshape(T, nh, hd), pos, cfg.rope_theta)
        k = np_rope((x @ W(f"{p}.self_attn.k_proj.weight").T).reshape(T, kvh, hd), pos, cfg.rope_theta)
        v = (x @ W(f"{p}.self_attn.v_proj.weight").T).reshape(T, kvh, hd)
        out = np.zeros((T, nh, hd))
        for h in range(nh):
            g = h // (nh // kvh)
            s = q[:, h] @ k[:, g].T / np.sqrt(hd)
            s[np.triu_indices(T, 1)] = -np.inf
            pr = np.exp(s - s.max(-1, keepdims=True))
            pr /= pr.sum(-1, keepdims=True)
            out[:, h] = pr @ v[:, g]
        hs = hs + (out.reshape(T, nh * hd) @ W(f"{p}.self_attn.o_proj.weight").T)[:, None]
        x = np_rms(hs.mean(1), W(f"{p}.post_attention_layernorm.weight"), eps)
        gate = x @ W(f"{p}.mlp.gate_proj.weight").T
        mlp = (gate / (1 + np.exp(-gate)) * (x @ W(f"{p}.mlp.up_proj.weight").T)) @ W(f"{p}.mlp.down_proj.weight").T
        hs = hs + mlp[:, None]
    x = np_rms(hs.mean(1), W("model.norm.weight"), eps)
    head = W("model.embed_tokens.weight") if cfg.tie_word_embeddings else W("lm_head.weight")
    return x @ head.T
