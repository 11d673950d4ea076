"""Checkpoints the tests write and read against transformers: the word tokenizer, the tiny
and small engram-llama checkpoints, transformers' greedy tokens and logits as references,
and fine-grained FP8 folders as transformers writes them (tests/quant/test_llama_fp8.py,
tests/quant/test_qwen4_exp_fp8.py, tests/quant/test_quant_build.py)."""

from __future__ import annotations

import json
from pathlib import Path


def word_tokenizer(path: Path, words: int) -> Path:
    """A tiny word-level tokenizer.json (ids 0..words-1; every word its own compressed id)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


def words(ids: list[int]) -> str:
    """The word tokenizer's text of token ids (``w5 w17 ...``; see word_tokenizer)."""
    return " ".join(f"w{i}" for i in ids)


TINY_CONFIG = dict(
    architectures=["EngramLlamaForCausalLM"],
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    num_hidden_layers=2,
    vocab_size=512,
    hc_mult=2,
    tie_word_embeddings=True,
    max_position_embeddings=256,
    engram_layer_ids=[1],
    engram_max_ngram_size=3,
    engram_n_heads=2,
    engram_head_dim=32,
    engram_vocab_size=3000,
    engram_compressed_vocab_size=512,
    engram_pad_token_id=0,
)


def make_tiny_checkpoint(path: Path, seed: int = 0, **overrides) -> Path:
    """A checkpoint that builds in about a second: a 512-word tokenizer, a two-layer
    backbone, one Engram layer of ~12k FP8 rows (384 KiB of table)."""
    import torch

    from engram_trt.checkpoint.checkpoint import write_checkpoint
    from engram_trt.models.engram_llama.demo import random_weights
    from engram_trt.config.model import ModelConfig
    from engram_trt.engram.layout import EngramLayout

    cfg = dict(TINY_CONFIG, **overrides)
    mc = ModelConfig.from_dict(cfg)
    rows = [int(r) for r in EngramLayout.from_spec(mc.engram, 0).table_rows]
    path.mkdir(parents=True, exist_ok=True)
    tok = word_tokenizer(path.parent / f".{path.name}-tokenizer.json", 512)
    weights = random_weights(mc, torch.Generator().manual_seed(seed), table_rows=rows)
    out = write_checkpoint(path, cfg, weights, tok, max_shard_bytes=1 << 30)
    tok.unlink()
    return out


# A small engram-llama with the DeepSeek-V4 tokenizer (real text in, real tokens out),
# Engram on two of three layers, small tables: quick to write, load and run on a CPU.
SMALL_CONFIG = {
    "architectures": ["EngramLlamaForCausalLM"],
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 129280,
    "hc_mult": 2,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
    "eos_token_id": 1,
    "engram_layer_ids": [0, 2],
    "engram_max_ngram_size": 3,
    "engram_n_heads": 2,
    "engram_head_dim": 32,
    "engram_vocab_size": 3000,
    "engram_compressed_vocab_size": 99092,
    "engram_pad_token_id": 1,
}


# The checkpoint and table tests' small engram-llama: Engram on layers 0 and 2 (FP8 tables),
# a 97-word vocabulary; written with write_checkpoint directly.
SMALL_TABLES_CONFIG = {
    "architectures": ["EngramLlamaForCausalLM"],
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": 97,
    "hc_mult": 2,
    "tie_word_embeddings": False,
    "engram_layer_ids": [0, 2],
    "engram_max_ngram_size": 3,
    "engram_n_heads": 2,
    "engram_head_dim": 64,
    "engram_vocab_size": 40,
    "engram_compressed_vocab_size": 60,
    "engram_pad_token_id": 1,
}


def write_small_checkpoint(path: Path, seed: int = 0) -> Path:
    import torch

    from engram_trt.checkpoint.checkpoint import write_checkpoint
    from engram_trt.models.engram_llama.demo import random_weights
    from engram_trt.config.model import ModelConfig
    from engram_trt.engram.layout import EngramLayout
    from engram_trt.engram.tokenizer import default_tokenizer_json

    cfg = ModelConfig.from_dict(SMALL_CONFIG)
    rows = [int(r) for r in EngramLayout.from_spec(cfg.engram, 0).table_rows]
    weights = random_weights(cfg, torch.Generator().manual_seed(seed), table_rows=rows)
    return write_checkpoint(path, SMALL_CONFIG, weights, default_tokenizer_json(), max_shard_bytes=8_000_000)


def transformers_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' ``generate`` greedy tokens of one prompt, EOS not special (so a run
    that ignores EOS sees the same); exactly ``n`` of them."""
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0, use_cache=True
        )
    got = out[0, len(prompt) :].tolist()
    assert len(got) == n
    return got


def llm_greedy(folder: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    """``engram_trt.LLM``'s greedy tokens (torch backend, fp32 on the CPU, EOS ignored)
    for each prompt: ``n`` each."""
    from engram_trt import LLM, SamplingParams

    with LLM(str(folder), backend="torch", device="cpu", dtype="fp32") as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs]


def assert_fp32_logits_match(model, ours, prompts: list[list[int]]) -> None:
    """Our model's fp32 prefill logits of each prompt within 1e-4 (relative to the
    largest) of transformers' ``model``."""
    import torch

    from engram_trt.models.step import PackedStep

    for prompt in prompts:
        with torch.no_grad():
            ref = model(torch.tensor([prompt])).logits[0].double()
        state = ours.new_cache(1, 64)
        got = ours.forward_step(
            PackedStep(torch.tensor(prompt), [len(prompt)], [0], [0]), state, all_logits=True
        ).double()
        assert got.shape == ref.shape
        assert (got - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()


def packed_greedy(ours, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy tokens of all prompts prefilled in one packed step (slots out of order),
    then decoded together: ``n`` each."""
    import torch

    from engram_trt.models.step import PackedStep

    state = ours.new_cache(4, 64)
    slots = [3, 0, 2]
    step = PackedStep(torch.tensor(sum(prompts, [])), [len(p) for p in prompts], [0, 0, 0], slots)
    logits = ours.forward_step(step, state)
    got: list[list[int]] = [[] for _ in prompts]
    lens = [len(p) for p in prompts]
    for _ in range(n):
        toks = [int(t) for t in torch.argmax(logits, dim=-1)]
        for g, t in zip(got, toks):
            g.append(t)
        logits = ours.forward_step(PackedStep(torch.tensor(toks), [1, 1, 1], lens, slots), state)
        lens = [k + 1 for k in lens]
    return got


def edit_config(folder: Path, **changes) -> None:
    """``changes`` written over the checkpoint's config.json."""
    import json

    p = folder / "config.json"
    d = json.loads(p.read_text())
    d.update(changes)
    p.write_text(json.dumps(d))


def assert_bf16_logits_match(folder: Path, model, hf16, want: dict) -> None:
    """A committed tiny checkpoint (tests/data, ``want`` its expected.json): our bf16
    prefill logits within 1e-2 relative L2 of transformers' bf16 ones (``hf16``), and
    transformers' bf16-vs-fp32 (``model``) distance the recorded one."""
    import torch

    from engram_trt.models.registry import open_checkpoint
    from engram_trt.models.step import PackedStep

    ckpt = open_checkpoint(folder)
    ours16 = ckpt.architecture.load_model(ckpt, device="cpu", dtype=torch.bfloat16)
    for i, p in enumerate(want["prompts"]):
        with torch.no_grad():
            r32 = model(torch.tensor([p])).logits[0].double()
            r16 = hf16(torch.tensor([p])).logits[0].double()
        g16 = ours16.forward_step(
            PackedStep(torch.tensor(p), [len(p)], [0], [0]), ours16.new_cache(1, 64), all_logits=True
        ).double()
        assert float((g16 - r16).norm() / r16.norm()) < 1e-2
        assert abs(float((r16 - r32).norm() / r32.norm()) - want["transformers_bf16_rel_l2"][i]) < 1e-4
    ckpt.close()


# --- fine-grained FP8 folders as transformers writes them ---


def transformers_fp8_save(model_cls, float_folder: Path, out: Path, **fp8_config) -> Path:
    """transformers' own FP8 save of a float folder it saved: ``from_pretrained`` with a
    ``FineGrainedFP8Config(**fp8_config)`` (its quantizer and ``Fp8Quantize`` op quantize
    each linear whose dims divide by the block; the rest stays float), then
    ``save_pretrained``: transformers' layout and names, not ours. transformers 5.25
    refuses to quantize without a GPU ("No GPU or XPU found"); only that check (and the
    compute capability it then asks for) is patched for the duration, the quantization
    itself runs on the CPU tensors. The tokenizer is copied over."""
    import shutil
    from unittest import mock

    import torch
    from transformers import FineGrainedFP8Config

    with (
        mock.patch("torch.cuda.is_available", return_value=True),
        mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)),
    ):
        model = model_cls.from_pretrained(
            float_folder, quantization_config=FineGrainedFP8Config(**fp8_config), dtype=torch.float32, use_kernels=False
        )
        model.save_pretrained(out)
    tok = Path(float_folder) / "tokenizer.json"
    if tok.is_file():
        shutil.copyfile(tok, out / "tokenizer.json")
    return out


def folder_tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def save_folder_as(src: Path, out: Path, tensors: dict, config: dict | None = None) -> Path:
    """``src``'s config (or ``config``) and tokenizer with ``tensors`` as one safetensors file."""
    import shutil

    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "tokenizer.json", "generation_config.json"):
        if (Path(src) / name).is_file() and Path(src).resolve() != out.resolve():
            shutil.copyfile(Path(src) / name, out / name)
    if config is not None:
        (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"}
    )
    return out


def without_stale_scales(folder: Path, out: Path) -> Path:
    """A copy of an FP8 folder without the scales transformers' save writes beside the
    weights it left in 16 bits (uninitialized memory: its CPU load would multiply those
    weights by them), so transformers' own dequantizing load is the reference."""
    import torch

    t = folder_tensors(folder)
    keep = {
        k: v
        for k, v in t.items()
        if not (
            k.endswith(".weight_scale_inv")
            and k[: -len("_scale_inv")] in t
            and t[k[: -len("_scale_inv")]].dtype != torch.float8_e4m3fn
        )
        and not (k == "lm_head.weight_scale_inv" and "lm_head.weight" not in t)
    }
    return save_folder_as(folder, out, keep)


def dequantized_folder(folder: Path, out: Path, moe_intermediate: int | None = None) -> Path:
    """A float32 copy of an FP8 folder: each F8_E4M3 weight times its block scales as the
    format defines them (blocks of ``weight_block_size``, the last one partial; the routed
    experts' merged ``gate_up_proj_scale_inv`` split into its gate rows then its up rows,
    row by row; an FP8 PLE table's shards times its one ``weight_scale``), its
    quantization_config removed: what transformers loads as the reference where its own
    CPU load cannot (the merged expert scales, partial blocks)."""
    import torch

    from engram_trt.quant.formats import dequantize_fp8

    cfg = json.loads((Path(folder) / "config.json").read_text())
    block = tuple(cfg["quantization_config"]["weight_block_size"])
    t = folder_tensors(folder)
    out_t = {}
    for k, v in t.items():
        if "_scale_inv" in k or k.endswith((".scale", ".ngram_embedding.weight_scale")):
            continue
        if v.dtype != torch.float8_e4m3fn:
            out_t[k] = v
            continue
        if ".ngram_embedding.shard_" in k:  # an FP8Embedding's shard: one float32 scale per table
            scale = t[k.split(".shard_")[0] + ".weight_scale"].double()
            out_t[k] = (v.double() * scale).float()
            continue
        base = k[: -len(".weight")]
        own = next((base + s for s in (".weight_scale_inv", ".scale") if base + s in t), None)
        if own is not None:
            out_t[k] = dequantize_fp8(v, t[own], block, torch.float64).float()
            continue
        experts, e, proj = base.rsplit(".", 2)
        merged = t[f"{experts}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}_scale_inv"][int(e)]
        if proj != "down_proj":  # the fused gate_up weight's block rows, row by row
            lo = 0 if proj == "gate_proj" else moe_intermediate
            rows = (torch.arange(v.shape[0]) + lo) // block[0]
            merged = merged[rows]
            out_t[k] = dequantize_fp8(v, merged, (1, block[1]), torch.float64).float()
        else:
            out_t[k] = dequantize_fp8(v, merged, block, torch.float64).float()
    cfg.pop("quantization_config")
    return save_folder_as(folder, out, out_t, cfg)


def fp8_ple_folder(folder: Path, out: Path) -> Path:
    """A Qwen4Exp folder whose PLE tables are stored as transformers' ``FP8Embedding``
    holds them (quantization_config.modules_to_convert naming ``ngram_embedding``): each
    layer's table quantized to E4M3 with one float32 scale (amax / 448), written as the
    shards ``torch.chunk`` makes of it (the save's Chunk) beside ``...ngram_embedding.
    weight_scale [1]``. transformers 5.25 loads this layout (on a CPU too) but cannot
    write it (its save of a pre-quantized Qwen4Exp fails in the shard Chunk), so the
    layout is laid out here, under transformers' names."""
    import torch

    t = folder_tensors(folder)
    cfg = json.loads((Path(folder) / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    stems = sorted({k.split(".shard_")[0] for k in t if ".ngram_embedding.shard_" in k})
    for stem in stems:
        names = sorted(
            (k for k in t if k.startswith(stem + ".shard_")),
            key=lambda k: int(k.rsplit("shard_", 1)[1][: -len(".weight")]),
        )
        table = torch.cat([t[k] for k in names]).float()
        scale = (table.abs().max() / 448.0).reshape(1)
        q = (table / scale).to(torch.float8_e4m3fn)
        for k in names:
            t.pop(k)
        for i, part in enumerate(torch.chunk(q, text["split_ngram_parts"])):
            t[f"{stem}.shard_{i}.weight"] = part.contiguous()
        t[f"{stem}.weight_scale"] = scale.float()
    qc = cfg.get("quantization_config") or {
        "activation_scheme": "dynamic",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
        "scale_fmt": "float",
    }
    qc["modules_to_convert"] = ["ngram_embedding"]
    cfg["quantization_config"] = qc
    return save_folder_as(folder, out, t, cfg)
