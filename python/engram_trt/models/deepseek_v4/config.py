"""DeepSeek-V4's config.json, read into :class:`DeepseekV4Config` (transformers'
``DeepseekV4ForCausalLM``, ``model_type`` ``deepseek_v4``), and DeepSeek-V4.1's: the same
backbone plus this project's Engram layers (``engram_layer_ids`` ...; parsed by
:func:`engram_trt.config.model.parse_engram_spec`, the one reader of those fields) under
``DeepseekV41ForCausalLM`` (``model_type`` ``deepseek_v41``).

Every field transformers' DeepSeek-V4 reads is honoured (with the published model's own
folding of its legacy spellings: ``compress_ratios``, ``compress_rate_csa`` /
``compress_rate_hca``, ``num_hash_layers``, ``qk_rope_head_dim``), pinned to the value
implemented (``hidden_act: silu``, one KV head, one shared expert, no biases), or
without effect at inference (:data:`CONTRACT`). ``quantization_config`` and the top-level
``expert_dtype`` (DeepSeek's published layout: FP8 linears, FP4 routed experts) are read
by :func:`engram_trt.quant.spec.read_quant_spec`, the one reader of those fields, into
``config.quant`` (None: float weights); unserved methods are refused there in one line.
Field names are transformers' own, so the modules (and tests handing them a transformers
config) read one spelling. Multi-token-prediction layers (``num_nextn_predict_layers``) are not
served: transformers does not build them either; their ``mtp.*`` tensors are the
checkpoint's unused ones, accepted with a log note.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Mapping

from engram_trt.config.model import EngramSpec, parse_engram_spec
from engram_trt.errors import ConfigError
from engram_trt.models.contract import FieldContract, Pinned
from engram_trt.quant.spec import QuantSpec, read_quant_spec

log = logging.getLogger(__name__)

CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
SLIDING = "sliding_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_LAYER_TYPES = ("hash_moe", "moe")
# The legacy per-layer ints of ``compress_ratios`` (transformers' own table).
_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}
DEFAULT_COMPRESS_RATES = {CSA: 4, HCA: 128}
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid")
ROPE_LABELS = ("main", "compress")
V4_ARCH = "DeepseekV4ForCausalLM"
V41_ARCH = "DeepseekV41ForCausalLM"
V4_TYPE = "deepseek_v4"
V41_TYPE = "deepseek_v41"

_MAX = {
    "vocab_size": 1 << 24,
    "hidden_size": 1 << 16,
    "num_hidden_layers": 1024,
    "heads": 4096,
    "head_dim": 4096,
    "experts": 1 << 14,
    "intermediate": 1 << 20,
    "hc_mult": 64,
    "rank": 1 << 16,
    "iters": 1000,
    "max_position_embeddings": 1 << 24,
    "window": 1 << 24,
    "rate": 1 << 16,
}

_FIELDS = frozenset(
    {
        "vocab_size",
        "hidden_size",
        "moe_intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "head_dim",
        "q_lora_rank",
        "num_experts_per_tok",
        "n_routed_experts",
        "scoring_func",
        "routed_scaling_factor",
        "max_position_embeddings",
        "rope_theta",
        "layer_types",
        "compress_rates",
        "compress_rope_theta",
        "hc_mult",
        "hc_sinkhorn_iters",
        "hc_eps",
        "mlp_layer_types",
        "swiglu_limit",
        "sliding_window",
        "o_groups",
        "o_lora_rank",
        "index_n_heads",
        "index_head_dim",
        "index_topk",
        "num_nextn_predict_layers",
        "rms_norm_eps",
        "bos_token_id",
        "eos_token_id",
        "tie_word_embeddings",
        "rope_parameters",
        "rope_scaling",
        "partial_rotary_factor",
        "dtype",
        "torch_dtype",
        "quantization_config",
        "expert_dtype",
        # legacy spellings transformers folds in at __post_init__
        "compress_ratios",
        "compress_rate_csa",
        "compress_rate_hca",
        "num_hash_layers",
        "qk_rope_head_dim",
    }
)

CONTRACT = FieldContract(
    architecture="deepseek-v4",
    honoured=_FIELDS,
    pinned={
        "hidden_act": Pinned(("silu",), "silu", "SwiGLU experts"),
        "num_key_value_heads": Pinned((1,), 1, "shared-KV multi-query attention: one K=V head"),
        "n_shared_experts": Pinned(
            (1,), 1, "transformers' DeepSeek-V4 builds one shared expert of moe_intermediate_size"
        ),
        "norm_topk_prob": Pinned(
            (True,), True, "transformers' DeepSeek-V4 router always renormalizes the top-k weights"
        ),
        "attention_bias": Pinned((False,), False, "projections without bias"),
        "mlp_bias": Pinned((False,), False, "shared-expert projections without bias"),
    },
    # Read by transformers' DeepSeek-V4 without effect on a forward pass at inference.
    neutral=frozenset(
        {"attention_dropout", "pad_token_id", "output_router_logits", "router_aux_loss_coef", "router_jitter_noise"}
    ),
    honoured_prefixes=("engram_",),
)


@dataclass
class DeepseekV4Config:
    """The fields under transformers' names (the modules read them as a transformers
    config would be read), ``engram`` the V4.1 Engram spec (None for V4)."""

    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    q_lora_rank: int
    num_experts_per_tok: int
    n_routed_experts: int
    scoring_func: str
    routed_scaling_factor: float
    max_position_embeddings: int
    rope_theta: float
    layer_types: tuple[str, ...]
    compress_rates: dict[str, int]
    compress_rope_theta: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    mlp_layer_types: tuple[str, ...]
    swiglu_limit: float
    sliding_window: int
    o_groups: int
    o_lora_rank: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    num_nextn_predict_layers: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    partial_rotary_factor: float
    rope_parameters: dict[str, dict[str, Any]]
    eos_token_id: int | tuple[int, ...] | None
    bos_token_id: int | None = None
    engram: EngramSpec | None = None
    quant: QuantSpec | None = None  # the stored weight formats (None: float weights)
    architecture_name: str = V4_ARCH
    # pinned values, readable as transformers' attributes
    num_key_value_heads: int = 1
    n_shared_experts: int = 1
    norm_topk_prob: bool = True
    hidden_act: str = "silu"
    attention_bias: bool = False
    mlp_bias: bool = False
    attention_dropout: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict, repr=False)
    ple: ClassVar[None] = None  # no tables of its own beside the Engram tables (config.model.ArchitectureConfig)

    # -- the transformers-config view the modules read ---------------------------------
    @property
    def num_local_experts(self) -> int:
        return self.n_routed_experts

    @property
    def intermediate_size(self) -> int:
        """transformers' attribute map: the shared expert's width is moe_intermediate_size."""
        return self.moe_intermediate_size

    @property
    def qk_rope_head_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        e = self.eos_token_id
        return () if e is None else (e,) if isinstance(e, int) else tuple(e)

    @property
    def engram_layer_index(self) -> dict[int, int]:
        """Decoder layer -> Engram layer index (V4.1; empty for V4)."""
        return {} if self.engram is None else {lid: i for i, lid in enumerate(self.engram.layer_ids)}

    def require_model(self) -> EngramSpec | None:
        """The Engram spec the runtime's tables follow (None for V4), its row width required."""
        spec = self.engram
        if spec is not None and spec.head_dim is None:
            raise ConfigError(
                f"config: missing field '{spec.field_name('head_dim')}' (expected the table row width, "
                f"a multiple of {spec.quant_block})"
            )
        return spec

    def require_engram(self, what: str = "this operation") -> EngramSpec:
        if self.engram is None:
            raise ConfigError(f"config has no Engram layers (no 'engram_layer_ids'), so {what} does not apply")
        return self.engram

    def to_dict(self) -> dict[str, Any]:
        """The config as a config.json dict (the manifest's and the backend's record)."""
        d = dict(self.extra)
        for k in (
            "compress_ratios",
            "compress_rate_csa",
            "compress_rate_hca",
            "num_hash_layers",
            "qk_rope_head_dim",
            "rope_scaling",
        ):
            d.pop(k, None)
        base = asdict(self)
        for k in ("engram", "extra", "architecture_name", "quant"):
            base.pop(k)
        d.update(base)
        d["layer_types"] = list(self.layer_types)
        d["mlp_layer_types"] = list(self.mlp_layer_types)
        if isinstance(self.eos_token_id, tuple):
            d["eos_token_id"] = list(self.eos_token_id)
        d["architectures"] = [self.architecture_name]
        d["model_type"] = V41_TYPE if self.architecture_name == V41_ARCH else V4_TYPE
        for k in [k for k in d if k.startswith("engram_")]:
            d.pop(k)
        if self.engram is not None:
            d.update(self.engram.to_config_fields())
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
            raise ConfigError(f"{_where(source)}missing field '{key}' (a DeepSeek-V4 config needs it)")
        return default
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"{_where(source)}field '{key}' must be an integer (got {v!r:.60})")
    if v < minimum or (maximum is not None and v > maximum):
        hi = f" and <= {maximum}" if maximum is not None else ""
        raise ConfigError(f"{_where(source)}field '{key}'={v} is out of range (expected >= {minimum}{hi})")
    return v


def _float(d: Mapping[str, Any], key: str, source: str | None, default: float, *, positive: bool = True) -> float:
    v = d.get(key, default)
    if v is None:
        v = default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (positive and v <= 0):
        raise ConfigError(
            f"{_where(source)}field '{key}' must be a {'positive ' if positive else ''}number (got {v!r:.60})"
        )
    return float(v)


def _compress_rates(d: Mapping[str, Any], source: str | None) -> dict[str, int]:
    rates = d.get("compress_rates")
    if rates is None:
        rates = dict(DEFAULT_COMPRESS_RATES)
    if not isinstance(rates, Mapping):
        raise ConfigError(
            f"{_where(source)}field 'compress_rates' must be an object such as "
            f"{{\"{CSA}\": 4, \"{HCA}\": 128}} (got {rates!r:.60})"
        )
    rates = dict(rates)
    for legacy, kind in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
        if d.get(legacy) is not None:
            rates[kind] = d[legacy]
    bad = sorted(set(rates) - {CSA, HCA})
    if bad:
        raise ConfigError(
            f"{_where(source)}compress_rates names {bad[0]!r}, not a compressed layer type (supported: {CSA}, {HCA})"
        )
    for kind in (CSA, HCA):
        v = rates.get(kind, DEFAULT_COMPRESS_RATES[kind])
        if isinstance(v, bool) or not isinstance(v, int) or v < 1 or v > _MAX["rate"]:
            raise ConfigError(
                f"{_where(source)}compress_rates[{kind!r}]={v!r:.40} must be a positive integer "
                f"(a compressed entry every that many tokens; 0 would compress nothing)"
            )
        rates[kind] = v
    return rates


def _types(
    d: Mapping[str, Any], key: str, allowed: tuple[str, ...], default: list[str], n: int, source: str | None
) -> tuple[str, ...]:
    types = d.get(key)
    if types is None:
        types = default
    if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
        raise ConfigError(f"{_where(source)}field '{key}' must be a list of type names (got {types!r:.60})")
    bad = [t for t in types if t not in allowed]
    if bad:
        raise ConfigError(
            f"{_where(source)}{key} holds {bad[0]!r}, not a DeepSeek-V4 type (supported: {', '.join(allowed)})"
        )
    if len(types) != n and d.get(key) is not None:
        raise ConfigError(f"{_where(source)}{key} has {len(types)} entries but num_hidden_layers={n}")
    return tuple(types[:n])


def _layer_types(d: Mapping[str, Any], n: int, source: str | None) -> tuple[str, ...]:
    legacy = d.get("compress_ratios")
    if d.get("layer_types") is None and legacy is not None:
        if not isinstance(legacy, list) or any(r not in _RATIO_TO_TYPE or isinstance(r, bool) for r in legacy):
            raise ConfigError(
                f"{_where(source)}field 'compress_ratios' must list 0, 4 or 128 per layer (got {legacy!r:.60})"
            )
        return _types({"layer_types": [_RATIO_TO_TYPE[r] for r in legacy]}, "layer_types", LAYER_TYPES, [], n, source)
    # transformers' default: two HCA layers, then CSA / HCA interleaved
    default = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    return _types(d, "layer_types", LAYER_TYPES, default, n, source)


def _rope(d: Mapping[str, Any], head_dim: int, source: str | None) -> tuple[float, dict[str, dict[str, Any]]]:
    """``(partial_rotary_factor, rope_parameters {"main": ..., "compress": ...})`` as
    transformers' ``__post_init__`` builds them: a flat ``rope_parameters`` (or
    ``rope_scaling``) describes the compressed layers' RoPE (YaRN there, with its
    attention factor forced to 1), the sliding branch keeps plain RoPE."""
    factor = d.get("partial_rotary_factor")
    if factor is None:
        legacy = d.get("qk_rope_head_dim")
        if legacy is not None:
            if isinstance(legacy, bool) or not isinstance(legacy, int) or not 0 < legacy <= head_dim:
                raise ConfigError(
                    f"{_where(source)}field 'qk_rope_head_dim'={legacy!r:.40} must be in 1..head_dim={head_dim}"
                )
            factor = legacy / head_dim
        else:
            factor = 64 / 512
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise ConfigError(f"{_where(source)}partial_rotary_factor={factor!r:.60} must be in (0, 1]")
    factor = float(factor)
    rope_dim = int(head_dim * factor)
    if rope_dim < 2 or rope_dim % 2:
        raise ConfigError(
            f"{_where(source)}the rotary dims head_dim x partial_rotary_factor = {rope_dim} must be even and >= 2"
        )
    rp = d.get("rope_parameters")
    if rp is None:
        rp = d.get("rope_scaling") or {}
    if not isinstance(rp, Mapping):
        raise ConfigError(f"{_where(source)}field 'rope_parameters' must be an object (got {rp!r:.60})")
    theta = _float(d, "rope_theta", source, 10000.0)
    ctheta = _float(d, "compress_rope_theta", source, 160000.0)
    if isinstance(rp.get("main"), Mapping) and isinstance(rp.get("compress"), Mapping):
        nested = {k: dict(rp[k]) for k in ROPE_LABELS}
    else:
        flat = {k: v for k, v in rp.items() if k not in ROPE_LABELS}
        main = {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": factor}
        compress = {**flat, "rope_theta": ctheta, "partial_rotary_factor": factor}
        compress.setdefault("rope_type", compress.pop("type", "default"))
        if compress["rope_type"] == "yarn":
            compress.setdefault("attention_factor", 1.0)
        nested = {"main": main, "compress": compress}
    for label in ROPE_LABELS:
        p = nested[label]
        rtype = p.get("rope_type", p.get("type", "default"))
        p["rope_type"] = rtype
        if rtype not in ("default", "yarn"):
            raise ConfigError(
                f"{_where(source)}rope_parameters.{label}.rope_type={rtype!r} is not implemented by engram-trt's "
                f"deepseek-v4 (supported: \"default\", \"yarn\"); serving it would give a different model than "
                f"the checkpoint declares"
            )
        p["rope_theta"] = _float(
            p,
            "rope_theta",
            f"{_where(source)}rope_parameters.{label}".rstrip(": "),
            theta if label == "main" else ctheta,
        )
        p.setdefault("partial_rotary_factor", factor)
        if rtype == "yarn":
            _float(p, "factor", f"{_where(source)}rope_parameters.{label}".rstrip(": "), 1.0)
    return factor, nested


def _eos(d: Mapping[str, Any], vocab: int, source: str | None) -> int | tuple[int, ...] | None:
    eos = d.get("eos_token_id", 1)
    if isinstance(eos, list):
        if not all(isinstance(e, int) and not isinstance(e, bool) and 0 <= e < vocab for e in eos):
            raise ConfigError(f"{_where(source)}eos_token_id {eos!r:.60} must hold token ids below vocab_size={vocab}")
        return tuple(eos) or None
    if eos is not None and (isinstance(eos, bool) or not isinstance(eos, int) or not 0 <= eos < vocab):
        raise ConfigError(f"{_where(source)}eos_token_id={eos!r:.60} must be a token id below vocab_size={vocab}")
    return eos


def _engram(d: Mapping[str, Any], n_layers: int, vocab: int, arch: str, source: str | None) -> EngramSpec | None:
    declared = d.get("engram_layer_ids") not in (None, [])
    spec = None if arch == V4_ARCH and declared else parse_engram_spec(d, source)
    if arch == V4_ARCH and declared:
        raise ConfigError(
            f"{_where(source)}engram_layer_ids is set but architectures names {V4_ARCH}, which has no Engram "
            f"layers; a DeepSeek-V4.1 checkpoint names architectures [\"{V41_ARCH}\"] (model_type \"{V41_TYPE}\")"
        )
    if arch == V41_ARCH and spec is None:
        raise ConfigError(
            f"{_where(source)}a {V41_ARCH} config needs its Engram fields (engram_layer_ids, engram_n_heads, ...); "
            f"without them it is DeepSeek-V4: name architectures [\"{V4_ARCH}\"]"
        )
    if spec is None:
        return None
    bad = [lid for lid in spec.layer_ids if lid >= n_layers]
    if bad:
        raise ConfigError(
            f"{_where(source)}field 'engram_layer_ids' names layer {bad[0]} but num_hidden_layers={n_layers} "
            f"(expected ids in 0..{n_layers - 1})"
        )
    if spec.pad_token_id >= vocab:
        raise ConfigError(
            f"{_where(source)}field 'engram_pad_token_id'={spec.pad_token_id} is not a token id (vocab_size={vocab})"
        )
    if spec.head_dim is None:
        raise ConfigError(
            f"{_where(source)}missing field 'engram_head_dim' (expected the table row width, a multiple of "
            f"{spec.quant_block})"
        )
    return spec


def architecture_of(d: Mapping[str, Any]) -> str:
    archs = d.get("architectures") or []
    if V41_ARCH in archs or (not archs and d.get("model_type") == V41_TYPE):
        return V41_ARCH
    return V4_ARCH


def read_config(d: Mapping[str, Any], source: str | None = None, *, enforce_contract: bool = True) -> DeepseekV4Config:
    """The typed config of a config.json dict (see the module docstring)."""
    if enforce_contract:
        CONTRACT.check(d, source)
    arch = architecture_of(d)
    n = _int(d, "num_hidden_layers", source, 43, maximum=_MAX["num_hidden_layers"])
    hidden = _int(d, "hidden_size", source, 4096, maximum=_MAX["hidden_size"])
    heads = _int(d, "num_attention_heads", source, 64, maximum=_MAX["heads"])
    head_dim = _int(d, "head_dim", source, 512, maximum=_MAX["head_dim"])
    vocab = _int(d, "vocab_size", source, 129280, maximum=_MAX["vocab_size"])
    experts = _int(d, "n_routed_experts", source, 256, maximum=_MAX["experts"])
    topk = _int(d, "num_experts_per_tok", source, 6, maximum=experts)
    o_groups = _int(d, "o_groups", source, 8, maximum=_MAX["heads"])
    if (heads * head_dim) % o_groups:
        raise ConfigError(
            f"{_where(source)}o_groups={o_groups} does not divide num_attention_heads x head_dim = "
            f"{heads * head_dim} (the grouped output projection splits the heads into o_groups groups)"
        )
    if heads % o_groups:
        raise ConfigError(f"{_where(source)}o_groups={o_groups} does not divide num_attention_heads={heads}")
    scoring = d.get("scoring_func", "sqrtsoftplus")
    if scoring not in SCORING_FUNCS:
        raise ConfigError(
            f"{_where(source)}scoring_func={scoring!r:.40} is not implemented by engram-trt's deepseek-v4 "
            f"(supported: {', '.join(SCORING_FUNCS)}, the router activations transformers' DeepSeek-V4 runs)"
        )
    tie = d.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise ConfigError(f"{_where(source)}field 'tie_word_embeddings' must be true or false (got {tie!r:.60})")
    layer_types = _layer_types(d, n, source)
    legacy_hash = d.get("num_hash_layers")
    n_hash = 3 if legacy_hash is None else _int(d, "num_hash_layers", source, minimum=0, maximum=1 << 16)
    mlp_types = _types(
        d, "mlp_layer_types", MLP_LAYER_TYPES, ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash), n, source
    )
    factor, rope = _rope(d, head_dim, source)
    index_head_dim = _int(d, "index_head_dim", source, 128, maximum=_MAX["head_dim"])
    if CSA in layer_types and int(head_dim * factor) > index_head_dim:
        raise ConfigError(
            f"{_where(source)}the rotary dims ({int(head_dim * factor)} = head_dim x partial_rotary_factor) do "
            f"not fit index_head_dim={index_head_dim} (the indexer's keys carry RoPE too)"
        )
    mtp = _int(d, "num_nextn_predict_layers", source, 1, minimum=0, maximum=64)
    cfg = DeepseekV4Config(
        vocab_size=vocab,
        hidden_size=hidden,
        moe_intermediate_size=_int(d, "moe_intermediate_size", source, 2048, maximum=_MAX["intermediate"]),
        num_hidden_layers=n,
        num_attention_heads=heads,
        head_dim=head_dim,
        q_lora_rank=_int(d, "q_lora_rank", source, 1024, maximum=_MAX["rank"]),
        num_experts_per_tok=topk,
        n_routed_experts=experts,
        scoring_func=scoring,
        routed_scaling_factor=_float(d, "routed_scaling_factor", source, 1.5),
        max_position_embeddings=_int(
            d, "max_position_embeddings", source, 1048576, maximum=_MAX["max_position_embeddings"]
        ),
        rope_theta=_float(d, "rope_theta", source, 10000.0),
        layer_types=layer_types,
        compress_rates=_compress_rates(d, source),
        compress_rope_theta=_float(d, "compress_rope_theta", source, 160000.0),
        hc_mult=_int(d, "hc_mult", source, 4, maximum=_MAX["hc_mult"]),
        hc_sinkhorn_iters=_int(d, "hc_sinkhorn_iters", source, 20, maximum=_MAX["iters"]),
        hc_eps=_float(d, "hc_eps", source, 1e-6),
        mlp_layer_types=mlp_types,
        swiglu_limit=_float(d, "swiglu_limit", source, 10.0),
        sliding_window=_int(d, "sliding_window", source, 128, maximum=_MAX["window"]),
        o_groups=o_groups,
        o_lora_rank=_int(d, "o_lora_rank", source, 1024, maximum=_MAX["rank"]),
        index_n_heads=_int(d, "index_n_heads", source, 64, maximum=_MAX["heads"]),
        index_head_dim=index_head_dim,
        index_topk=_int(d, "index_topk", source, 512, maximum=1 << 24),
        num_nextn_predict_layers=mtp,
        rms_norm_eps=_float(d, "rms_norm_eps", source, 1e-6),
        tie_word_embeddings=tie,
        partial_rotary_factor=factor,
        rope_parameters=rope,
        eos_token_id=_eos(d, vocab, source),
        bos_token_id=_int(d, "bos_token_id", source, None, minimum=0, maximum=vocab - 1),
        engram=_engram(d, n, vocab, arch, source),
        quant=read_quant_spec(d, source),
        architecture_name=arch,
        extra=dict(d),
    )
    if mtp:
        log.info(
            "%s: %d multi-token-prediction layer(s) (num_nextn_predict_layers) are not served (transformers does not "
            "build them either); their mtp.* tensors are unused",
            source or "config",
            mtp,
        )
    ignored = CONTRACT.ignored(d)
    if ignored:
        log.info(
            "%s: fields the model does not read (transformers' DeepSeek-V4 does not either): %s",
            source or "config",
            ", ".join(ignored),
        )
    return cfg
