"""Qwen4Exp's config.json, read into :class:`Qwen4ExpConfig`: the text model of
``Qwen4ExpForCausalLM`` (``model_type`` ``qwen4_exp_text``) or the ``text_config`` of
``Qwen4ExpForConditionalGeneration`` (``qwen4_exp``; text-only serving, the vision
tower's tensors are the checkpoint's unused ones).

Every field transformers' Qwen4Exp reads is honoured (with the published model's
validation: PLE only on linear-attention layers, one-indexed ``ple_layer_ids``, an EOS
id when PLE is on, the QSA fields all or none), pinned to the value implemented
(``hidden_act: silu``, ``attention_bias: false``, RoPE type ``default``), or without
effect at inference (:data:`CONTRACT`). Its field names are transformers' own, so the
modules (and tests handing them a transformers config) read one spelling.

``quantization_config`` (at the top level, also for a ForConditionalGeneration config)
is read by :func:`engram_trt.quant.spec.read_quant_spec` into :attr:`Qwen4ExpConfig.quant`:
fine-grained FP8 weights and FP8 experts are served as stored (docs/quantization.md);
FP4 experts (``expert_dtype: "fp4"``) and any other method are refused in one line.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

from engram_trt.config.model import RETIRED_PLE_TWINS
from engram_trt.errors import ConfigError
from engram_trt.models.contract import FieldContract, Pinned
from engram_trt.quant.spec import QuantSpec, read_quant_spec

log = logging.getLogger(__name__)

LAYER_TYPES = ("linear_attention", "indexed_attention")
QSA_FIELDS = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")
# What a sane config stays below; past it a value is a typo or a hostile file.
_MAX = {
    "vocab_size": 1 << 24,
    "hidden_size": 1 << 16,
    "num_hidden_layers": 1024,
    "heads": 4096,
    "head_dim": 4096,
    "experts": 1 << 14,
    "intermediate": 1 << 20,
    "hc_count": 64,
    "kernel": 64,
    "ngram_size": 16,
    "heads_per_ngram": 256,
    "ngram_vocab_size_base": 1 << 40,
    "split_ngram_parts": 1 << 16,
    "max_position_embeddings": 1 << 24,
}

_TEXT_FIELDS = frozenset(
    {
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
        "rope_parameters",
        "rope_theta",
        "partial_rotary_factor",
        "linear_conv_kernel_dim",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "linear_num_key_heads",
        "linear_num_value_heads",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "num_experts_per_tok",
        "num_experts",
        "norm_topk_prob",
        "layer_types",
        "full_attention_interval",
        "bos_token_id",
        "eos_token_id",
        "hc_count",
        "hc_lowrank",
        "ple_layer_ids",
        "ple_embed_dim",
        "ple_conv_kernel_size",
        "ngram_size",
        "heads_per_ngram",
        "ngram_vocab_size_base",
        "make_ngram_vocab_size_divisible_by",
        "seed",
        "split_ngram_parts",
        *QSA_FIELDS,
        "output_gate_type",
        "dtype",
        "torch_dtype",
    }
)

CONTRACT = FieldContract(
    architecture="qwen4-exp",
    honoured=_TEXT_FIELDS | {"text_config", "vision_config", "quantization_config"},
    pinned={
        "hidden_act": Pinned(("silu",), "silu", "SwiGLU experts and the SiLU short convolutions"),
        "attention_bias": Pinned((False,), False, "q/k/v/o projections without bias"),
    },
    # Read by transformers' Qwen4Exp without effect on a forward pass at inference.
    neutral=frozenset(
        {
            "attention_dropout",
            "pad_token_id",
            "output_router_logits",
            "router_aux_loss_coef",
            "number_of_conv_states",
            "image_token_id",
            "video_token_id",
            "vision_start_token_id",
            "vision_end_token_id",
        }
    ),
)


@dataclass(frozen=True)
class PLESpec:
    """PLE (hashed n-gram embeddings) of a Qwen4Exp model. ``layer_ids`` are the
    config's one-indexed ids; ``layers`` the zero-indexed decoder layers."""

    layer_ids: tuple[int, ...]
    embed_dim: int
    conv_kernel_size: int
    ngram_size: int
    heads_per_ngram: int
    vocab_size_base: int
    divisible_by: int
    seed: int
    split_parts: int

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(i - 1 for i in self.layer_ids)

    @property
    def n_heads(self) -> int:
        """Hashed heads per token and layer: ``heads_per_ngram`` for each order 2..N."""
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.n_heads


@dataclass(frozen=True)
class QSASpec:
    n_heads: int
    kv_heads: int
    head_dim: int
    budget: int
    compress_ratio: int


@dataclass
class Qwen4ExpConfig:
    """The text model's fields under transformers' names (the modules read them as a
    transformers config), plus the parsed :class:`PLESpec` / :class:`QSASpec`."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    rope_theta: float
    partial_rotary_factor: float
    linear_conv_kernel_dim: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool
    layer_types: tuple[str, ...]
    hc_count: int
    hc_lowrank: int
    eos_token_id: int | tuple[int, ...] | None
    bos_token_id: int | None = None
    output_gate_type: str = "silu"
    ple: PLESpec | None = None
    qsa: QSASpec | None = None
    hidden_act: str = "silu"
    attention_bias: bool = False
    # The stored weight formats (quantization_config; None: float weights).
    quant: QuantSpec | None = None
    # ForConditionalGeneration keeps the text model under model.language_model.
    weight_prefix: str = "model."
    architecture_name: str = "Qwen4ExpForCausalLM"
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    # The runtime's Engram mechanism (engram_* tables) is not this model's: PLE is.
    engram: None = None

    # -- the transformers-config view the modules read ---------------------------------
    @property
    def rope_parameters(self) -> dict[str, Any]:
        return {
            "rope_type": "default",
            "rope_theta": self.rope_theta,
            "partial_rotary_factor": self.partial_rotary_factor,
        }

    def __getattr__(self, name: str) -> Any:
        # indexer_* and the PLE fields under their config.json names
        qsa = self.__dict__.get("qsa")
        if name.startswith("indexer_") and name[8:] in ("n_heads", "kv_heads", "head_dim", "budget", "compress_ratio"):
            return None if qsa is None else getattr(qsa, name[8:])
        raise AttributeError(name)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        e = self.eos_token_id
        return () if e is None else (e,) if isinstance(e, int) else tuple(e)

    @property
    def first_eos(self) -> int | None:
        """The EOS id PLE pads its n-gram history with (the first one when a list)."""
        ids = self.eos_token_ids
        return ids[0] if ids else None

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "indexed_attention"]

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def require_model(self) -> None:
        """The runtime's Engram spec (none: PLE is the model's own; see :attr:`ple`)."""
        return None

    def to_dict(self) -> dict[str, Any]:
        """The text config as a config.json dict (the manifest's and the backend's record)."""
        d = dict(self.extra)
        base = asdict(self)
        for k in (
            "ple",
            "qsa",
            "extra",
            "engram",
            "weight_prefix",
            "architecture_name",
            "rope_theta",
            "partial_rotary_factor",
            "quant",
        ):
            base.pop(k)
        d.update(base)
        d["layer_types"] = list(self.layer_types)
        if isinstance(self.eos_token_id, tuple):
            d["eos_token_id"] = list(self.eos_token_id)
        d["rope_parameters"] = self.rope_parameters
        d["architectures"] = [self.architecture_name]
        d["model_type"] = "qwen4_exp_text"
        if self.ple is not None:
            p = self.ple
            d.update(
                ple_layer_ids=list(p.layer_ids),
                ple_embed_dim=p.embed_dim,
                ple_conv_kernel_size=p.conv_kernel_size,
                ngram_size=p.ngram_size,
                heads_per_ngram=p.heads_per_ngram,
                ngram_vocab_size_base=p.vocab_size_base,
                make_ngram_vocab_size_divisible_by=p.divisible_by,
                seed=p.seed,
                split_ngram_parts=p.split_parts,
            )
        if self.qsa is not None:
            q = self.qsa
            d.update(
                indexer_n_heads=q.n_heads,
                indexer_kv_heads=q.kv_heads,
                indexer_head_dim=q.head_dim,
                indexer_budget=q.budget,
                indexer_compress_ratio=q.compress_ratio,
            )
        if self.quant is not None:
            qd = self.quant.to_dict()
            if self.quant.modules_to_convert:
                qd["modules_to_convert"] = list(self.quant.modules_to_convert)
            d["quantization_config"] = qd
        return d


def _where(source: str | None) -> str:
    return f"{source}: " if source else "config: "


def _int(
    d: Mapping[str, Any],
    key: str,
    source: str | None,
    default: Any = ...,
    *,
    minimum: int = 1,
    maximum: int | None = None,
) -> int:
    if key not in d or d[key] is None:
        if default is ...:
            raise ConfigError(f"{_where(source)}missing field '{key}' (a Qwen4Exp config needs it)")
        return default
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"{_where(source)}field '{key}' must be an integer (got {v!r:.60})")
    if v < minimum or (maximum is not None and v > maximum):
        hi = f" and <= {maximum}" if maximum is not None else ""
        raise ConfigError(f"{_where(source)}field '{key}'={v} is out of range (expected >= {minimum}{hi})")
    return v


def _float(d: Mapping[str, Any], key: str, source: str | None, default: float) -> float:
    v = d.get(key, default)
    if v is None:
        v = default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ConfigError(f"{_where(source)}field '{key}' must be a positive number (got {v!r:.60})")
    return float(v)


def _rope(d: Mapping[str, Any], source: str | None) -> tuple[float, float]:
    """``(rope_theta, partial_rotary_factor)``. Text-only serving feeds the three mrope
    position components the same ids, so ``mrope_section`` changes nothing; any RoPE
    type but ``default`` is refused by name."""
    rp = d.get("rope_parameters")
    if rp is None:
        rp = {}
    if not isinstance(rp, Mapping):
        raise ConfigError(f"{_where(source)}field 'rope_parameters' must be an object (got {rp!r:.60})")
    scaling = d.get("rope_scaling")
    if scaling not in (None, {}):
        raise ConfigError(
            f"{_where(source)}field 'rope_scaling'={scaling!r:.60} is not implemented by engram-trt's qwen4-exp "
            f"(supported: RoPE type \"default\"); serving it would give a different model than the checkpoint declares"
        )
    rtype = rp.get("rope_type", rp.get("type", "default"))
    if rtype != "default":
        raise ConfigError(
            f"{_where(source)}rope_parameters.rope_type={rtype!r} is not implemented by engram-trt's qwen4-exp "
            f"(supported: \"default\"); serving it would give a different model than the checkpoint declares"
        )
    known = {"rope_type", "type", "rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved"}
    unknown = sorted(set(rp) - known)
    if unknown:
        raise ConfigError(
            f"{_where(source)}rope_parameters.{unknown[0]} is not implemented by engram-trt's qwen4-exp "
            f"(supported keys: {', '.join(sorted(known))})"
        )
    theta = _float(rp, "rope_theta", source, _float(d, "rope_theta", source, 10000.0))
    factor = rp.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise ConfigError(f"{_where(source)}partial_rotary_factor={factor!r:.60} must be in (0, 1]")
    return theta, float(factor)


def _layer_types(d: Mapping[str, Any], n_layers: int, source: str | None) -> tuple[str, ...]:
    types = d.get("layer_types")
    if types is None:
        interval = _int(d, "full_attention_interval", source, 4, maximum=n_layers + 1)
        return tuple("linear_attention" if (i + 1) % interval else "indexed_attention" for i in range(n_layers))
    if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
        raise ConfigError(f"{_where(source)}field 'layer_types' must be a list of layer type names (got {types!r:.60})")
    # Published checkpoints write "full_attention" for the indexed layers.
    types = ["indexed_attention" if t == "full_attention" else t for t in types]
    bad = sorted(set(types) - set(LAYER_TYPES))
    if bad:
        raise ConfigError(
            f"{_where(source)}layer_types holds {bad[0]!r}, not a Qwen4Exp layer type "
            f"(supported: linear_attention, full_attention / indexed_attention)"
        )
    if len(types) != n_layers:
        raise ConfigError(f"{_where(source)}layer_types has {len(types)} entries but num_hidden_layers={n_layers}")
    return tuple(types)


def _ple(
    d: Mapping[str, Any], types: tuple[str, ...], hidden: int, vocab: int, eos: Any, source: str | None
) -> PLESpec | None:
    ids = d.get("ple_layer_ids")
    if ids in (None, []):
        return None
    if not isinstance(ids, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        raise ConfigError(
            f"{_where(source)}field 'ple_layer_ids' must be a list of one-indexed layer ids (got {ids!r:.60})"
        )
    ids = sorted(set(ids))
    bad = [i for i in ids if not 1 <= i <= len(types)]
    if bad:
        raise ConfigError(
            f"{_where(source)}ple_layer_ids holds {bad[0]}, outside the one-indexed layers 1..{len(types)}"
        )
    full = [i for i in ids if types[i - 1] != "linear_attention"]
    if full:
        raise ConfigError(
            f"{_where(source)}ple_layer_ids holds {full[0]}, a {types[full[0] - 1]} layer; Qwen4Exp puts PLE "
            f"only on linear_attention layers (ids are one-indexed: layer {full[0]} is layer_types[{full[0] - 1}])"
        )
    if eos is None or eos == []:
        raise ConfigError(
            f"{_where(source)}PLE layers need 'eos_token_id' (the n-gram history restarts after each EOS)"
        )
    n = _int(d, "ngram_size", source, 3, minimum=2, maximum=_MAX["ngram_size"])
    hpn = _int(d, "heads_per_ngram", source, 8, maximum=_MAX["heads_per_ngram"])
    embed = _int(d, "ple_embed_dim", source, hidden, maximum=_MAX["hidden_size"] * 16)
    heads = (n - 1) * hpn
    if embed % heads:
        raise ConfigError(
            f"{_where(source)}ple_embed_dim={embed} is not divisible by the {heads} n-gram heads "
            f"((ngram_size-1) x heads_per_ngram = {n - 1} x {hpn})"
        )
    base = _int(d, "ngram_vocab_size_base", source, 20_000_000, minimum=2, maximum=_MAX["ngram_vocab_size_base"])
    return PLESpec(
        layer_ids=tuple(ids),
        embed_dim=embed,
        conv_kernel_size=_int(d, "ple_conv_kernel_size", source, 4, maximum=_MAX["kernel"]),
        ngram_size=n,
        heads_per_ngram=hpn,
        vocab_size_base=base,
        divisible_by=_int(d, "make_ngram_vocab_size_divisible_by", source, 128, maximum=1 << 20),
        seed=_int(d, "seed", source, 1234, minimum=0, maximum=(1 << 63) - 1),
        split_parts=_int(d, "split_ngram_parts", source, 512, maximum=_MAX["split_ngram_parts"]),
    )


def _qsa(d: Mapping[str, Any], head_dim: int, rotary_dim: int, source: str | None) -> QSASpec | None:
    given = {k: d.get(k) for k in QSA_FIELDS}
    if all(v is None for v in given.values()):
        return None
    missing = [k for k, v in given.items() if v is None]
    if missing:
        raise ConfigError(f"{_where(source)}the QSA indexer fields are all or none; '{missing[0]}' is missing")
    vals = {k: _int(d, k, source, maximum=1 << 20) for k in QSA_FIELDS}
    if vals["indexer_kv_heads"] != 1:
        raise ConfigError(
            f"{_where(source)}indexer_kv_heads={vals['indexer_kv_heads']}: Qwen4Exp's QSA has one key head"
        )
    if vals["indexer_budget"] % vals["indexer_compress_ratio"]:
        raise ConfigError(
            f"{_where(source)}indexer_budget={vals['indexer_budget']} is not a multiple of "
            f"indexer_compress_ratio={vals['indexer_compress_ratio']}"
        )
    if rotary_dim > vals["indexer_head_dim"]:
        raise ConfigError(
            f"{_where(source)}the rotary dims ({rotary_dim} = head_dim x partial_rotary_factor) do not fit "
            f"indexer_head_dim={vals['indexer_head_dim']}"
        )
    return QSASpec(
        vals["indexer_n_heads"],
        vals["indexer_kv_heads"],
        vals["indexer_head_dim"],
        vals["indexer_budget"],
        vals["indexer_compress_ratio"],
    )


def _quant(d: Mapping[str, Any], source: str | None) -> QuantSpec | None:
    """The checkpoint's stored formats (the top-level quantization_config; a
    ForConditionalGeneration config carries it there too). Qwen4Exp's experts are served
    FP8 (transformers' FP8Experts); FP4 experts are refused in one line."""
    quant = read_quant_spec(d, source)
    if quant is not None and quant.expert_dtype != "fp8":
        raise ConfigError(
            f"{_where(source)}field 'quantization_config.expert_dtype'={quant.expert_dtype!r} is not "
            f"served for qwen4-exp (supported: \"fp8\": the experts stored F8_E4M3 with block scales, as "
            f"transformers' FP8 save writes them); FP4 experts are served for deepseek-v4 only"
        )
    return quant


def text_config_of(d: Mapping[str, Any], source: str | None = None) -> tuple[Mapping[str, Any], str, str]:
    """``(text config dict, weight prefix, architecture name)``: a ForConditionalGeneration
    config's ``text_config`` (weights under ``model.language_model.``), else the dict."""
    archs = d.get("architectures") or []
    if d.get("model_type") == "qwen4_exp" or "Qwen4ExpForConditionalGeneration" in archs:
        text = d.get("text_config")
        if not isinstance(text, Mapping):
            raise ConfigError(
                f"{_where(source)}a Qwen4ExpForConditionalGeneration config needs a 'text_config' object "
                f"(engram-trt serves its text model)"
            )
        merged = dict(text)
        if "tie_word_embeddings" in d and "tie_word_embeddings" not in text:
            merged["tie_word_embeddings"] = d["tie_word_embeddings"]
        return merged, "model.language_model.", "Qwen4ExpForConditionalGeneration"
    return d, "model.", "Qwen4ExpForCausalLM"


def read_config(d: Mapping[str, Any], source: str | None = None, *, enforce_contract: bool = True) -> Qwen4ExpConfig:
    """The typed config of a config.json dict (see the module docstring)."""
    text, prefix, arch_name = text_config_of(d, source)
    twins = [k for k in RETIRED_PLE_TWINS if k in text]
    if twins:
        raise ConfigError(
            f"{_where(source)}field '{twins[0]}' is not a Qwen4Exp field (an engram_* twin engram-trt once "
            f"invented): PLE is declared by ple_layer_ids, ple_embed_dim, ple_conv_kernel_size, ngram_size, "
            f"heads_per_ngram, ngram_vocab_size_base, make_ngram_vocab_size_divisible_by, seed and "
            f"split_ngram_parts; drop it"
        )
    if enforce_contract:
        CONTRACT.check(d, source)
        if text is not d:
            CONTRACT.check(text, f"{source or 'config'} text_config")
    src = source if text is d else f"{source or 'config'} text_config"
    quant = _quant(d, source)
    n_layers = _int(text, "num_hidden_layers", src, maximum=_MAX["num_hidden_layers"])
    hidden = _int(text, "hidden_size", src, maximum=_MAX["hidden_size"])
    heads = _int(text, "num_attention_heads", src, maximum=_MAX["heads"])
    kv = _int(text, "num_key_value_heads", src, maximum=_MAX["heads"])
    if heads % kv:
        raise ConfigError(f"{_where(src)}num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
    head_dim = _int(text, "head_dim", src, 256, maximum=_MAX["head_dim"])
    vocab = _int(text, "vocab_size", src, maximum=_MAX["vocab_size"])
    theta, factor = _rope(text, src)
    types = _layer_types(text, n_layers, src)
    eos = text.get("eos_token_id", d.get("eos_token_id"))
    if isinstance(eos, list):
        if not all(isinstance(e, int) and not isinstance(e, bool) and 0 <= e < vocab for e in eos):
            raise ConfigError(f"{_where(src)}eos_token_id {eos!r:.60} must hold token ids below vocab_size={vocab}")
        eos = tuple(eos)
    elif eos is not None and (isinstance(eos, bool) or not isinstance(eos, int) or not 0 <= eos < vocab):
        raise ConfigError(f"{_where(src)}eos_token_id={eos!r:.60} must be a token id below vocab_size={vocab}")
    hc = _int(text, "hc_count", src, 4, minimum=2, maximum=_MAX["hc_count"])
    experts = _int(text, "num_experts", src, 512, maximum=_MAX["experts"])
    topk = _int(text, "num_experts_per_tok", src, 10, maximum=experts)
    gate = text.get("output_gate_type") or text.get("hidden_act", "silu")
    if gate not in ("silu", "sigmoid"):
        raise ConfigError(f"{_where(src)}output_gate_type={gate!r} is not one Qwen4Exp implements (silu or sigmoid)")
    rotary = int(head_dim * factor)
    if rotary % 2:
        raise ConfigError(f"{_where(src)}the rotary dims head_dim x partial_rotary_factor = {rotary} must be even")
    qsa = _qsa(text, head_dim, rotary, src)
    if qsa is None and "indexed_attention" in types:
        raise ConfigError(
            f"{_where(src)}layer_types has full-attention layers but the QSA indexer fields ({', '.join(QSA_FIELDS)}) "
            f"are unset; the published Qwen4Exp builds an indexer on every full-attention layer, so set them"
        )
    tie = text.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise ConfigError(f"{_where(src)}field 'tie_word_embeddings' must be true or false (got {tie!r:.60})")
    ntp = text.get("norm_topk_prob", True)
    if not isinstance(ntp, bool):
        raise ConfigError(f"{_where(src)}field 'norm_topk_prob' must be true or false (got {ntp!r:.60})")
    cfg = Qwen4ExpConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        max_position_embeddings=_int(
            text, "max_position_embeddings", src, 32768, maximum=_MAX["max_position_embeddings"]
        ),
        rms_norm_eps=_float(text, "rms_norm_eps", src, 1e-6),
        tie_word_embeddings=tie,
        rope_theta=theta,
        partial_rotary_factor=factor,
        linear_conv_kernel_dim=_int(text, "linear_conv_kernel_dim", src, 4, maximum=_MAX["kernel"]),
        linear_key_head_dim=_int(text, "linear_key_head_dim", src, 128, maximum=_MAX["head_dim"]),
        linear_value_head_dim=_int(text, "linear_value_head_dim", src, 128, maximum=_MAX["head_dim"]),
        linear_num_key_heads=_int(text, "linear_num_key_heads", src, 16, maximum=_MAX["heads"]),
        linear_num_value_heads=_int(text, "linear_num_value_heads", src, 32, maximum=_MAX["heads"]),
        moe_intermediate_size=_int(text, "moe_intermediate_size", src, 512, maximum=_MAX["intermediate"]),
        shared_expert_intermediate_size=_int(
            text, "shared_expert_intermediate_size", src, 512, maximum=_MAX["intermediate"]
        ),
        num_experts=experts,
        num_experts_per_tok=topk,
        norm_topk_prob=ntp,
        layer_types=types,
        hc_count=hc,
        hc_lowrank=_int(text, "hc_lowrank", src, 320, maximum=1 << 16),
        eos_token_id=eos,
        bos_token_id=text.get("bos_token_id"),
        output_gate_type=gate,
        ple=_ple(text, types, hidden, vocab, eos, src),
        qsa=qsa,
        quant=quant,
        weight_prefix=prefix,
        architecture_name=arch_name,
    )
    if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
        raise ConfigError(
            f"{_where(src)}linear_num_value_heads={cfg.linear_num_value_heads} is not a multiple of "
            f"linear_num_key_heads={cfg.linear_num_key_heads}"
        )
    ignored = CONTRACT.ignored(text)
    if ignored:
        log.info(
            "%s: fields the model does not read (transformers' Qwen4Exp does not either): %s",
            src or "config",
            ", ".join(ignored),
        )
    return cfg
