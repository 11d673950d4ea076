"""``engram-trt import-gguf FILE.gguf OUT/``: a llama.cpp GGUF file of the Llama family
turned into a Hugging Face checkpoint folder that engram-trt (and transformers) serve.

What changes on the way:

* **Names.** llama.cpp's tensor names (``token_embd``, ``blk.N.attn_q``, ``output_norm``
  ...) become transformers' (``model.embed_tokens``, ``model.layers.N.self_attn.q_proj``,
  ``model.norm`` ...). A name this importer does not know is refused, never dropped.
* **Layout.** llama.cpp's converter reorders the rows of every head of ``q_proj`` and
  ``k_proj`` from the half-split RoPE layout transformers uses (the first half of a
  head's rows pairs with the second half) to interleaved pairs (rows 2i and 2i+1 pair).
  The importer puts them back: a head's rows ``[h, half, 2]`` become ``[h, 2, half]``.
* **Values.** F32, F16, BF16, Q8_0, Q4_0 and Q4_1 tensors are dequantized by the
  ``gguf`` package (``gguf.quants.dequantize``, the reference llama.cpp ships) to float32
  and stored as float32 (default) or rounded to bfloat16 / float16. Any other GGML type
  (the k-quants, i-quants ...) is refused, naming the tensor and its type.
* **Config.** ``config.json`` (``LlamaForCausalLM``) from the ``llama.*`` metadata, RoPE
  written as transformers 5 does (``rope_parameters``); RoPE scaling other than linear,
  partial rotary, mixture-of-experts metadata and per-layer head counts are refused by
  name. ``tie_word_embeddings`` holds exactly when the file has no ``output.weight``.
* **Tokenizer.** ``tokenizer.json`` and ``tokenizer_config.json`` (special tokens, BOS /
  EOS flags, the chat template(s)) are rebuilt from the ``tokenizer.ggml.*`` vocabulary by
  :mod:`engram_trt.checkpoint.gguf_tokenizer`; ``generation_config.json`` holds the token ids.

Everything is decided from the file's header before a byte is written, so a refused
import leaves OUT as it was. The folder is written as a temporary sibling and put in
place whole (engram_trt.storage.atomic): OUT holds either what was there before or the
complete import, never half of it. A non-empty OUT is refused unless ``force``; then
the checkpoint files this importer writes are replaced and every other file is kept.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from engram_trt.checkpoint.gguf_tokenizer import build_tokenizer
from engram_trt.checkpoint.gguf_tokenizer import where as _where
from engram_trt.errors import CheckpointError, EngramError, human_bytes
from engram_trt.storage import atomic

log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("llama",)
SUPPORTED_TYPES = ("Q4_0", "Q4_1", "Q8_0", "F16", "BF16", "F32")
OUT_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
_DTYPE_ALIASES = {
    "fp32": "float32",
    "f32": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "f16": "float16",
    "half": "float16",
}
_ITEMSIZE = {"F32": 4, "BF16": 2, "F16": 2}

CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
TOKENIZER_NAME = "tokenizer.json"
TOKENIZER_CONFIG_NAME = "tokenizer_config.json"
SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")

# llama.cpp name -> transformers name. Per-layer entries are keyed by the part after "blk.N.".
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Names llama.cpp writes for features this importer does not translate: refused with the reason.
_KNOWN_UNSUPPORTED = {
    "rope_freqs.weight": "per-frequency RoPE factors (Llama 3.1-style RoPE scaling)",
    "attn_rot_embd.weight": "precomputed rotary tables",
    "attn_q.bias": "a q_proj bias",
    "attn_k.bias": "a k_proj bias",
    "attn_v.bias": "a v_proj bias",
    "attn_output.bias": "an o_proj bias",
    "ffn_gate_inp.weight": "a mixture-of-experts router",
    "ffn_gate_exps.weight": "mixture-of-experts weights",
    "ffn_up_exps.weight": "mixture-of-experts weights",
    "ffn_down_exps.weight": "mixture-of-experts weights",
}
_BLK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class ImportResult:
    """What :func:`import_gguf` wrote."""

    out: Path
    architecture: str
    n_tensors: int
    tensor_types: dict[str, int]  # GGML type name -> how many of the file's tensors had it
    bytes_written: int  # all files written into OUT
    dtype: str = "float32"
    files: tuple[str, ...] = field(default=())


@dataclass(frozen=True)
class _TensorPlan:
    gguf_name: str
    hf_name: str
    ggml_type: str
    shape: tuple[int, ...]  # transformers' (row-major) shape
    permute_heads: int  # >0: undo llama.cpp's q/k row order over this many heads
    tensor: Any  # the ReaderTensor


# ---------------------------------------------------------------- reading the file
def _open_reader(path: Path) -> Any:
    try:
        import gguf
    except ImportError:
        raise EngramError("the package 'gguf' is not installed; run: pip install gguf") from None
    if not path.exists():
        raise CheckpointError(f"{_where(path)} does not exist (pass the path of a .gguf file)")
    if not path.is_file():
        raise CheckpointError(f"{_where(path)} is not a file (pass the path of a .gguf file, not a folder)")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise CheckpointError(
            f"'{path}' is not a GGUF file (it does not start with the GGUF magic bytes); pass a llama.cpp .gguf file"
        )
    try:
        return gguf.GGUFReader(str(path), "r")
    except Exception as exc:  # the reader's errors on a damaged file are ValueError, IndexError, struct.error ...
        raise CheckpointError(
            f"{_where(path)} is truncated or damaged ({type(exc).__name__}: "
            f"{' '.join(str(exc).split())[:160]}); re-download the file"
        ) from None


class _Meta:
    """The file's key/value metadata, read on demand."""

    def __init__(self, reader: Any, path: Path) -> None:
        self.reader = reader
        self.path = path
        self._cache: dict[str, Any] = {}

    def keys(self) -> list[str]:
        return list(self.reader.fields)

    def get(self, key: str, default: Any = None) -> Any:
        if key in self._cache:
            return self._cache[key]
        f = self.reader.get_field(key)
        if f is None:
            return default
        try:
            self._cache[key] = value = f.contents()
            return value
        except Exception as exc:
            raise CheckpointError(
                f"{_where(self.path)}: metadata '{key}' cannot be read ({type(exc).__name__}: {exc}); "
                f"the file is damaged, re-download it"
            ) from None

    def require(self, key: str) -> Any:
        v = self.get(key)
        if v is None:
            raise CheckpointError(
                f"{_where(self.path)} lacks metadata '{key}', which a Llama config needs; the file "
                f"is incomplete (re-convert it with llama.cpp's convert_hf_to_gguf.py)"
            )
        return v

    def integer(self, key: str, *, default: Any = None, low: int = 1) -> int:
        v = self.get(key, default) if default is not None else self.require(key)
        if isinstance(v, list):
            if v and all(x == v[0] for x in v):
                v = v[0]
            else:
                raise CheckpointError(
                    f"{_where(self.path)}: metadata '{key}' varies per layer ({v[:8]}...); this importer "
                    f"translates Llama models whose layers are all alike"
                )
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or int(v) < low:
            raise CheckpointError(f"{_where(self.path)}: metadata '{key}' must be an integer >= {low} (got {v!r:.60})")
        return int(v)

    def number(self, key: str, *, default: float | None = None) -> float:
        v = self.get(key, default) if default is not None else self.require(key)
        if (
            isinstance(v, bool)
            or not isinstance(v, (int, float, np.floating, np.integer))
            or not math.isfinite(float(v))
            or float(v) <= 0
        ):
            raise CheckpointError(f"{_where(self.path)}: metadata '{key}' must be a positive number (got {v!r:.60})")
        return _f32_value(float(v))


def _f32_value(v: float) -> float:
    """A float32 metadata value as its shortest decimal (9.999999747e-06 -> 1e-05): the
    number the model was saved with, and the same float32 when the runtime reads it."""
    return float(np.format_float_positional(np.float32(v), unique=True, trim="-")) if v else 0.0


# ---------------------------------------------------------------- config
def _config_from_meta(meta: _Meta, arch: str, tensors: Mapping[str, Any], out_dtype: str) -> dict[str, Any]:
    p = f"{arch}."
    path = meta.path
    for key in (f"{p}expert_count", f"{p}expert_used_count"):
        n = meta.get(key)
        if n not in (None, 0):
            raise CheckpointError(
                f"{_where(path)} is a mixture-of-experts model ('{key}' = {n}); this importer "
                f"translates dense Llama models only"
            )
    hidden = meta.integer(f"{p}embedding_length")
    layers = meta.integer(f"{p}block_count")
    inter = meta.integer(f"{p}feed_forward_length")
    heads = meta.integer(f"{p}attention.head_count")
    kv_heads = meta.integer(f"{p}attention.head_count_kv", default=heads)
    if heads % kv_heads:
        raise CheckpointError(
            f"{_where(path)}: {heads} attention heads are not a multiple of {kv_heads} key/value heads"
        )
    if meta.get(f"{p}attention.key_length") is None and hidden % heads:
        raise CheckpointError(
            f"{_where(path)}: hidden size {hidden} is not a multiple of {heads} heads and the file "
            f"has no '{p}attention.key_length' naming the head dimension; the file is inconsistent"
        )
    head_dim = meta.integer(f"{p}attention.key_length", default=hidden // heads)
    value_len = meta.integer(f"{p}attention.value_length", default=head_dim)
    if value_len != head_dim:
        raise CheckpointError(
            f"{_where(path)}: 'attention.value_length' {value_len} differs from 'attention.key_length' "
            f"{head_dim}; a Llama config has one head_dim"
        )
    if head_dim % 2:
        raise CheckpointError(f"{_where(path)}: head dimension {head_dim} is odd; RoPE needs an even head_dim")
    rot = meta.integer(f"{p}rope.dimension_count", default=head_dim)
    if rot != head_dim:
        raise CheckpointError(
            f"{_where(path)}: 'rope.dimension_count' {rot} is not the head dimension {head_dim} "
            f"(partial rotary embeddings); this importer translates full-head RoPE only"
        )
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": meta.number(f"{p}rope.freq_base", default=10000.0)}
    rope.update(_rope_scaling(meta, p))
    tokens = meta.get("tokenizer.ggml.tokens")
    if meta.get(f"{p}vocab_size") is not None:
        vocab = meta.integer(f"{p}vocab_size")
    elif tokens:
        vocab = len(tokens)
    else:
        raise CheckpointError(
            f"{_where(path)} has neither '{p}vocab_size' nor 'tokenizer.ggml.tokens'; the vocabulary "
            f"size cannot be known (use a GGUF converted with its vocabulary)"
        )
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "rms_norm_eps": meta.number(f"{p}attention.layer_norm_rms_epsilon"),
        "max_position_embeddings": meta.integer(f"{p}context_length"),
        "rope_parameters": rope,
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    for key, name in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
        tid = meta.get(f"tokenizer.ggml.{name}_token_id")
        if tid is not None:
            config[key] = _token_id(meta, f"tokenizer.ggml.{name}_token_id", tid, vocab)
    config["torch_dtype"] = out_dtype
    config["use_cache"] = True
    return config


def _token_id(meta: _Meta, key: str, tid: Any, vocab: int) -> int:
    if isinstance(tid, bool) or not isinstance(tid, (int, np.integer)) or not 0 <= int(tid) < vocab:
        raise CheckpointError(
            f"{_where(meta.path)}: metadata '{key}' = {tid!r:.40} is not a token id below the vocabulary size {vocab}"
        )
    return int(tid)


def _rope_scaling(meta: _Meta, p: str) -> dict[str, Any]:
    """The ``rope_parameters`` entries for the file's RoPE scaling (linear only)."""
    path = meta.path
    kind = meta.get(f"{p}rope.scaling.type")
    factor = meta.get(f"{p}rope.scaling.factor")
    legacy = meta.get(f"{p}rope.scale_linear")
    if kind is None and legacy is not None:
        kind, factor = "linear", legacy
    if kind in (None, "none"):
        others = [
            k
            for k in meta.keys()
            if k.startswith(f"{p}rope.scaling.")
            and k != f"{p}rope.scaling.type"
            and not (k == f"{p}rope.scaling.factor" and factor in (None, 1, 1.0))
        ]
        if others:
            raise CheckpointError(
                f"{_where(path)}: RoPE scaling metadata '{others[0]}' without a scaling type; this "
                f"importer translates linear RoPE scaling only"
            )
        return {}
    if kind != "linear":
        raise CheckpointError(
            f"{_where(path)}: RoPE scaling '{p}rope.scaling.type' = '{kind}' is not translated "
            f"(this importer translates linear RoPE scaling only)"
        )
    extra = [
        k
        for k in meta.keys()
        if k.startswith(f"{p}rope.scaling.") and k not in (f"{p}rope.scaling.type", f"{p}rope.scaling.factor")
    ]
    if extra:
        raise CheckpointError(
            f"{_where(path)}: RoPE scaling metadata '{extra[0]}' is not translated (linear scaling "
            f"takes only '{p}rope.scaling.factor')"
        )
    if factor is None or isinstance(factor, bool) or not isinstance(factor, (int, float)) or not float(factor) >= 1.0:
        raise CheckpointError(
            f"{_where(path)}: linear RoPE scaling needs '{p}rope.scaling.factor' >= 1 (got {factor!r:.40})"
        )
    if float(factor) == 1.0:
        return {}
    return {"rope_type": "linear", "factor": _f32_value(float(factor))}


# ---------------------------------------------------------------- tensors
def _hf_name(gguf_name: str, layers: int) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLK_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES and int(m.group(1)) < layers and str(int(m.group(1))) == m.group(1):
        return f"model.layers.{int(m.group(1))}.{_LAYER_NAMES[m.group(2)]}"
    return None


def _expected_shapes(cfg: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    D, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    H, KV, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (V, D)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (D,),
                p + "post_attention_layernorm.weight": (D,),
                p + "self_attn.q_proj.weight": (H * hd, D),
                p + "self_attn.k_proj.weight": (KV * hd, D),
                p + "self_attn.v_proj.weight": (KV * hd, D),
                p + "self_attn.o_proj.weight": (D, H * hd),
                p + "mlp.gate_proj.weight": (I, D),
                p + "mlp.up_proj.weight": (I, D),
                p + "mlp.down_proj.weight": (D, I),
            }
        )
    return shapes


def _plan_tensors(reader: Any, path: Path, cfg: Mapping[str, Any]) -> list[_TensorPlan]:
    layers = cfg["num_hidden_layers"]
    expected = _expected_shapes(cfg)
    plans: list[_TensorPlan] = []
    seen: set[str] = set()
    for t in reader.tensors:
        name = str(t.name)
        hf = _hf_name(name, layers)
        if hf is None:
            m = _BLK_RE.match(name)
            leaf = m.group(2) if m else name
            if leaf in _KNOWN_UNSUPPORTED:
                raise CheckpointError(
                    f"{_where(path)}: tensor '{name}' holds {_KNOWN_UNSUPPORTED[leaf]}, which this "
                    f"importer does not translate (it imports plain Llama models)"
                )
            if m and leaf in _LAYER_NAMES:
                raise CheckpointError(
                    f"{_where(path)}: tensor '{name}' is for layer {m.group(1)} but the file's "
                    f"'block_count' is {layers}; the file is inconsistent, re-convert it"
                )
            raise CheckpointError(
                f"{_where(path)}: unknown tensor '{name}' (this importer knows llama.cpp's Llama "
                f"names: token_embd, output_norm, output, blk.N.{{attn_norm, attn_q, attn_k, attn_v, "
                f"attn_output, ffn_norm, ffn_gate, ffn_up, ffn_down}}.weight)"
            )
        if hf in seen:
            raise CheckpointError(f"{_where(path)}: tensor '{name}' appears twice; the file is damaged")
        seen.add(hf)
        ggml = t.tensor_type.name
        if ggml not in SUPPORTED_TYPES:
            raise CheckpointError(
                f"{_where(path)}: tensor '{name}' is quantized as GGML type {ggml}, which this "
                f"importer does not dequantize (supported: {', '.join(SUPPORTED_TYPES)}); use the "
                f"model's GGUF of one of those types (its Q8_0 or F16 file, say)"
            )
        shape = tuple(int(x) for x in reversed(list(t.shape)))
        want = expected.get(hf)
        if shape != want:
            raise CheckpointError(
                f"{_where(path)}: tensor '{name}' has shape {list(shape)} but the file's metadata "
                f"makes {hf} {list(want or ())}; the file is inconsistent, re-convert it"
            )
        heads = 0
        if hf.endswith("self_attn.q_proj.weight"):
            heads = cfg["num_attention_heads"]
        elif hf.endswith("self_attn.k_proj.weight"):
            heads = cfg["num_key_value_heads"]
        plans.append(_TensorPlan(name, hf, ggml, shape, heads, t))
    missing = [n for n in expected if n not in seen]
    if missing:
        from engram_trt.checkpoint.checkpoint import natural_key

        missing.sort(key=natural_key)
        raise CheckpointError(
            f"{_where(path)} lacks the tensor for {missing[0]} ({len(missing)} missing); the file "
            f"is incomplete, re-download or re-convert it"
        )
    return plans


# Bytes per block and the float16 fields (scale, and min) at its start, of the block types
# read here: a NaN or Inf there makes the whole block's values NaN / Inf.
_BLOCK_SCALES = {"Q8_0": (34, 1), "Q4_0": (18, 1), "Q4_1": (20, 2)}


def _refuse_nonfinite(plans: list[_TensorPlan], path: Path) -> None:
    """Refuse a file holding NaN or Inf (in a float tensor's values, or a quantized
    block's scale), naming the tensor, before anything is written: a checkpoint made
    from it would make every logit NaN."""
    from engram_trt.checkpoint.nonfinite import count_nonfinite

    for p in plans:
        raw = np.ascontiguousarray(np.asarray(p.tensor.data)).view(np.uint8).reshape(-1)
        if p.ggml_type in _BLOCK_SCALES:
            size, fields = _BLOCK_SCALES[p.ggml_type]
            data, what = raw.reshape(-1, size)[:, : 2 * fields], "block scale(s)"
            st = "F16"
        else:
            data, what, st = raw, "value(s)", p.ggml_type
        found = count_nonfinite(np.ascontiguousarray(data), st, p.gguf_name)
        if found.nan or found.inf:
            kinds = " and ".join(f"{n} {k}" for n, k in ((found.nan, "NaN"), (found.inf, "Inf")) if n)
            raise CheckpointError(
                f"{_where(path)}: tensor '{p.gguf_name}' ({p.hf_name}) holds {kinds} {what}: "
                f"the model would compute NaN from it; re-convert or re-download the GGUF"
            )


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: within each head, rows ``(2i, 2i+1)`` (llama.cpp's
    interleaved RoPE pairs) go back to ``(i, i + head_dim/2)`` (transformers' halves)."""
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensor_values(plan: _TensorPlan) -> np.ndarray:
    """The tensor as float32, in transformers' layout."""
    from gguf import quants

    t = plan.tensor
    values = quants.dequantize(np.asarray(t.data), t.tensor_type)
    values = np.asarray(values, dtype=np.float32).reshape(plan.shape)
    if plan.permute_heads:
        values = unpermute_rope_rows(values, plan.permute_heads)
    return np.ascontiguousarray(values)


def _encode(values: np.ndarray, st_dtype: str) -> bytes | memoryview:
    if st_dtype == "F32":
        return memoryview(values.astype("<f4", copy=False)).cast("B")
    if st_dtype == "F16":
        return memoryview(np.ascontiguousarray(values.astype("<f2"))).cast("B")
    import torch  # round to nearest even, as torch (and transformers) cast

    bf = torch.from_numpy(values if values.flags.writeable else values.copy()).to(torch.bfloat16)
    return memoryview(bf.view(torch.int16).numpy().astype("<i2", copy=False)).cast("B")


def _write_safetensors(
    out: Path, plans: list[_TensorPlan], st_dtype: str, max_shard_bytes: int, bar: Any
) -> tuple[list[str], int]:
    """Stream the tensors into ``model.safetensors`` (or shards and an index when they
    exceed ``max_shard_bytes``): one tensor in memory at a time. Returns (files, bytes)."""
    from engram_trt.checkpoint.checkpoint import natural_key

    itemsize = _ITEMSIZE[st_dtype]
    order = sorted(plans, key=lambda p: natural_key(p.hf_name))

    def nbytes(p: _TensorPlan) -> int:
        return int(np.prod(p.shape, dtype=np.int64)) * itemsize

    groups: list[list[_TensorPlan]] = []
    size = 0
    for p in order:
        if not groups or (size + nbytes(p) > max_shard_bytes and groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += nbytes(p)
    n = len(groups)
    names = [SINGLE_NAME] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    written = 0
    weight_map: dict[str, str] = {}
    for fname, group in zip(names, groups):
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        off = 0
        for p in group:
            header[p.hf_name] = {"dtype": st_dtype, "shape": list(p.shape), "data_offsets": [off, off + nbytes(p)]}
            off += nbytes(p)
            weight_map[p.hf_name] = fname
        hjson = json.dumps(header, separators=(",", ":")).encode()
        hjson += b" " * (-len(hjson) % 8)
        with open(out / fname, "wb") as f:
            f.write(len(hjson).to_bytes(8, "little"))
            f.write(hjson)
            for p in group:
                data = _encode(_tensor_values(p), st_dtype)
                if len(data) != nbytes(p):  # cannot happen: shapes were checked against the header
                    raise CheckpointError(
                        f"tensor '{p.gguf_name}' dequantized to {len(data)} bytes, expected {nbytes(p)}"
                    )
                f.write(data)
                bar.update(1)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(out / fname, 0o644)
        written += 8 + len(hjson) + off
    if n > 1:
        total = sum(nbytes(p) for p in order)
        text = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
        written += _write_text(out / INDEX_NAME, text)
        names.append(INDEX_NAME)
    return names, written


# ---------------------------------------------------------------- writing
def _write_text(path: Path, text: str) -> int:
    data = text.encode("utf-8")
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(path, 0o644)
    return len(data)


def is_import_file_name(name: str) -> bool:
    """A name :func:`import_gguf` writes (with ``force`` these are replaced in OUT; every
    other file there is kept)."""
    return name in (
        CONFIG_NAME,
        GENERATION_CONFIG_NAME,
        TOKENIZER_NAME,
        TOKENIZER_CONFIG_NAME,
        SINGLE_NAME,
        INDEX_NAME,
    ) or bool(_SHARD_RE.match(name))


def _norm_dtype(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.").lower()
    name = _DTYPE_ALIASES.get(name, name)
    if name not in OUT_DTYPES:
        raise EngramError(
            f"--dtype '{dtype}' is not a dtype import-gguf writes (choose one of: {', '.join(OUT_DTYPES)})"
        )
    return name


def _generation_config(cfg: Mapping[str, Any], meta: _Meta) -> dict[str, Any]:
    gen: dict[str, Any] = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in cfg}
    stops = [cfg["eos_token_id"]] if "eos_token_id" in cfg else []
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        tid = meta.get(key)
        if (
            isinstance(tid, (int, np.integer))
            and not isinstance(tid, bool)
            and 0 <= int(tid) < cfg["vocab_size"]
            and int(tid) not in stops
        ):
            stops.append(int(tid))
    if len(stops) > 1:
        gen["eos_token_id"] = stops
    return gen


def import_gguf(
    gguf_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    force: bool = False,
    progress: bool = True,
    dtype: Any = "float32",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> ImportResult:
    """Turn the Llama-family GGUF ``gguf_path`` into the checkpoint folder ``out_dir``
    (see the module docstring). ``dtype``: ``float32`` (default: the dequantized values
    exactly), ``bfloat16`` or ``float16`` (rounded to nearest even). Weights over
    ``max_shard_bytes`` are split into ``model-NNNNN-of-NNNNN.safetensors`` shards with an
    index. Raises :class:`CheckpointError` (one line: the bad input and the fix) for a
    file it does not translate, before OUT is touched."""
    src = Path(gguf_path).expanduser()
    out_dtype = _norm_dtype(dtype)
    if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise EngramError(f"max_shard_bytes must be a positive integer (got {max_shard_bytes!r})")
    atomic.check_parents(Path(out_dir).expanduser().absolute(), "OUT")
    out = atomic.writable_output(out_dir, "OUT")  # a link written through; a mount point refused
    if out.exists() and not out.is_dir():
        raise EngramError(f"OUT '{out}' exists and is not a folder; choose a new folder")
    _refuse_non_empty(out, force)

    # Everything that can refuse the file happens here, before anything is written.
    reader = _open_reader(src)
    meta = _Meta(reader, src)
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            f"{_where(src)} is a '{arch}' model (general.architecture); import-gguf translates only "
            f"the llama architecture (Llama, Mistral-style and SmolLM models)"
        )
    tensor_infos = {str(t.name): t for t in reader.tensors}
    config = _config_from_meta(meta, arch, tensor_infos, out_dtype)
    plans = _plan_tensors(reader, src, config)
    _refuse_nonfinite(plans, src)
    tokenizer_json, tokenizer_config = build_tokenizer(meta, config["vocab_size"], config["max_position_embeddings"])
    try:  # refuse a config the model cannot read before writing (the registry's stricter check is the CLI's)
        from engram_trt.config.model import ModelConfig

        ModelConfig.from_dict(dict(config), source=f"config.json from {src.name}")
    except EngramError as exc:
        raise CheckpointError(f"{_where(src)}: the config it makes is not one engram-trt serves ({exc})") from None
    types = dict(sorted(Counter(p.ggml_type for p in plans).items()))
    log.info(
        "importing %s: %s, %d tensors (%s) -> %s",
        src,
        arch,
        len(plans),
        ", ".join(f"{n} {k}" for k, n in types.items()),
        out,
    )

    out.parent.mkdir(parents=True, exist_ok=True)
    from tqdm.auto import tqdm

    with atomic.locked(out, "another import-gguf"):
        atomic.clean_dead_temps(out)
        _refuse_non_empty(out, force)  # filled while we waited
        _check_free_space(out.parent, plans, OUT_DTYPES[out_dtype])
        tmp = atomic.temp_sibling(out, "tmp")
        try:
            atomic.pause_point("import-gguf:tmp-made")
            with tqdm(total=len(plans), desc="import-gguf", unit="tensor", disable=not progress, leave=False) as bar:
                files, written = _write_safetensors(tmp, plans, OUT_DTYPES[out_dtype], max_shard_bytes, bar)
            written += _write_text(tmp / CONFIG_NAME, json.dumps(config, indent=2) + "\n")
            written += _write_text(
                tmp / GENERATION_CONFIG_NAME, json.dumps(_generation_config(config, meta), indent=2) + "\n"
            )
            written += _write_text(tmp / TOKENIZER_NAME, tokenizer_json + "\n")
            written += _write_text(
                tmp / TOKENIZER_CONFIG_NAME, json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n"
            )
            files += [CONFIG_NAME, GENERATION_CONFIG_NAME, TOKENIZER_NAME, TOKENIZER_CONFIG_NAME]
            atomic.pause_point("import-gguf:written")
            if out.is_dir():
                atomic.carry_over(out, tmp, lambda n: not is_import_file_name(n))
            atomic.replace_dir(tmp, out)
        except BaseException:
            atomic.remove_temp(tmp)
            raise
    log.info("imported %s -> %s: %d tensors, %s", src.name, out, len(plans), human_bytes(written))
    return ImportResult(
        out=out,
        architecture=arch,
        n_tensors=len(plans),
        tensor_types=types,
        bytes_written=written,
        dtype=out_dtype,
        files=tuple(files),
    )


def _refuse_non_empty(out: Path, force: bool) -> None:
    if out.is_dir() and not force:
        entries = sorted(p.name for p in out.iterdir())
        if entries:
            raise EngramError(
                f"OUT '{out}' is not empty (it holds {entries[0]}{', ...' if len(entries) > 1 else ''}); "
                f"choose a new or empty folder, or pass --force to replace its checkpoint files (other "
                f"files are kept)"
            )


def _check_free_space(parent: Path, plans: Iterable[_TensorPlan], st_dtype: str) -> None:
    need = sum(int(np.prod(p.shape, dtype=np.int64)) for p in plans) * _ITEMSIZE[st_dtype]
    try:
        st = os.statvfs(parent)
    except OSError:
        return
    free = st.f_bavail * st.f_frsize
    if need > free:
        raise EngramError(
            f"the import needs {human_bytes(need)} beside OUT but '{parent}' has {human_bytes(free)} free; "
            f"free space or choose OUT on a larger disk (--dtype bfloat16 halves it)"
        )
