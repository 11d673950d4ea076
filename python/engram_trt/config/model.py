"""Model configuration: the HF ``config.json`` of an Engram model, read and validated.

The Engram fields are DeepSeek-V4.1's ``engram_*`` spelling, read into one
:class:`EngramSpec`; a config without them has no Engram layers (``engram is None``).
Qwen4Exp's PLE is another mechanism with its own fields (``ple_layer_ids``,
``ngram_size``, ...: ``models/qwen4_exp/config.py``); the ``ple_*`` twins of the
``engram_*`` fields this module once read are refused with a line naming the real ones.

Validation happens here, once, so every consumer (layout, model, builder, runtime,
CLI) can trust the values: each bad field is refused with a message that names the
field, the value found and the value expected. Every integer field has an upper bound
as well as a lower one (:data:`LIMITS`): a value past what the kernels, the int32 ids
on the GPU or any real model need is a typo or a hostile file, and refusing it here
keeps it from becoming a 30-second prime search, an overflow or an allocation of
terabytes later.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Mapping, Protocol, Sequence

from engram_trt.config.jsonfile import read_json_object
from engram_trt.config.rope import RopeSetting, parse_rope
from engram_trt.errors import ConfigError

ENGRAM_PREFIXES = ("engram",)
# The engram_* twins once read under a ple_ prefix; no published model writes them.
RETIRED_PLE_TWINS = (
    "ple_max_ngram_size",
    "ple_n_heads",
    "ple_head_dim",
    "ple_vocab_size",
    "ple_compressed_vocab_size",
    "ple_pad_token_id",
    "ple_num_embeddings",
    "ple_quant_block",
    "ple_table_dtype",
)
# The RoPE types the engram-llama model computes exactly as transformers' Llama: its
# positions stop at max_position_embeddings, where dynamic NTK is still plain RoPE.
# longrope switches its factors with each call's length (keys already cached were
# rotated with the other set), which a KV-cached step cannot reproduce.
LLAMA_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
ROPE_FIELDS = ("rope_theta", "rope_scaling", "rope_parameters")

INT32_MAX = 2**31 - 1
# The hash kernel's limits (plugins/kernels/engramKernels.h): its layout constants
# travel as one kernel parameter of fixed size.
HASH_MAX_NGRAM = 16  # ENGRAM_HASH_MAX_NGRAM
HASH_MAX_SLOTS = 512  # ENGRAM_HASH_MAX_SLOTS = num_layers * n_hash_cols
HASH_MAX_MULTIPLIERS = 256  # ENGRAM_HASH_MAX_MULTIPLIERS = num_layers * max_ngram_size

# Upper bounds of the integer fields (inclusive). Generous next to any real model
# (DeepSeek-V3: hidden 7168, 61 layers, 128 heads, 129280 ids) but finite.
LIMITS: dict[str, int] = {
    "hidden_size": 1 << 17,
    "intermediate_size": 1 << 20,
    "num_hidden_layers": 1024,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "head_dim": 4096,
    "vocab_size": INT32_MAX,  # token ids are int32 on the GPU
    "max_position_embeddings": 1 << 24,
    "hc_mult": 64,
    "bos_token_id": INT32_MAX,
    "eos_token_id": INT32_MAX,
    # Engram fields, without their prefix
    "layer_ids": 1023,
    "max_ngram_size": HASH_MAX_NGRAM,
    "n_heads": HASH_MAX_SLOTS,
    "engram_head_dim": 1 << 16,
    "engram_vocab_size": INT32_MAX,
    "compressed_vocab_size": INT32_MAX,
    "pad_token_id": INT32_MAX,
    "quant_block": 1 << 16,
    "num_embeddings": INT32_MAX,
}
MAX_LIST_LEN = 4096

# The fields that make up the mechanism, without their prefix.
_SPEC_FIELDS = (
    "layer_ids",
    "num_embeddings",
    "max_ngram_size",
    "n_heads",
    "head_dim",
    "vocab_size",
    "compressed_vocab_size",
    "pad_token_id",
    "quant_block",
    "table_dtype",
)
TABLE_DTYPES = ("fp8", "bf16")


@dataclass(frozen=True)
class EngramSpec:
    """The Engram fields of a config, prefix removed.

    ``head_dim`` and ``num_embeddings`` are optional here because hashing needs
    neither: a config that only describes the hash (as the golden vectors do) is
    valid for ``engram-trt layout`` / ``hash``; :meth:`ModelConfig.require_model`
    insists on them where tables are read.
    """

    layer_ids: tuple[int, ...]
    max_ngram_size: int
    n_heads: int
    vocab_size: int | tuple[int, ...]
    compressed_vocab_size: int
    pad_token_id: int
    head_dim: int | None = None
    num_embeddings: tuple[int, ...] | None = None
    quant_block: int = 32
    table_dtype: str = "fp8"
    prefix: str = "engram"

    @property
    def n_hash_cols(self) -> int:
        return (self.max_ngram_size - 1) * self.n_heads

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    def field_name(self, name: str) -> str:
        """The config.json spelling of a field (``engram_n_heads``)."""
        return f"{self.prefix}_{name}"

    def prime_search_starts(self) -> tuple[int, ...]:
        """Per n-gram order (2..N), the value the prime search starts above."""
        if isinstance(self.vocab_size, tuple):
            return self.vocab_size
        return (self.vocab_size,) * (self.max_ngram_size - 1)

    def to_config_fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in _SPEC_FIELDS:
            value = getattr(self, name)
            if value is None:
                continue
            out[self.field_name(name)] = list(value) if isinstance(value, tuple) else value
        return out


class ArchitectureConfig(Protocol):
    """What every architecture's typed config declares (engram-llama's :class:`ModelConfig`,
    ``models/deepseek_v4/config.py``'s ``DeepseekV4Config``, ``models/qwen4_exp/config.py``'s
    ``Qwen4ExpConfig``): the fields the layers below the model registry (the checkpoint,
    the tables, :meth:`engram_trt.config.engram.EngramConfig.validate_for`) and the runtime
    read, directly. ``engram``: the Engram spec (None: no Engram layers); ``ple``: the spec
    of tables the architecture holds of its own (Qwen4Exp's PLE; None for the others);
    ``quant``: the checkpoint's stored weight formats (an ``engram_trt.quant.QuantSpec``;
    None: float weights, or a config read without an architecture's reader)."""

    vocab_size: int
    max_position_embeddings: int
    engram: EngramSpec | None
    ple: Any
    quant: Any

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation."""

    def require_model(self) -> EngramSpec | None:
        """The Engram spec with the fields reading tables needs checked (None: no Engram layers)."""

    def to_dict(self) -> dict[str, Any]:
        """The config.json fields it was read from, normalized."""


def _where(source: str | None) -> str:
    return f"{source}: " if source else "config: "


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _short(value: Any, limit: int = 80) -> str:
    """``repr`` cut to ``limit`` characters: a hostile value must not flood the one line."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _int_field(
    d: Mapping[str, Any],
    key: str,
    source: str | None,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    default: Any = ...,
    expected: str | None = None,
) -> Any:
    if key not in d or d[key] is None:
        if default is ...:
            raise ConfigError(f"{_where(source)}missing field '{key}' (expected {expected or 'an integer'})")
        return default
    value = d[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{_where(source)}field '{key}' must be {expected or 'an integer'} (got {_short(value)})")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{_where(source)}field '{key}' must be an integer >= {minimum} (got {_short(value)})")
    if maximum is not None and value > maximum:
        raise ConfigError(
            f"{_where(source)}field '{key}'={_short(value)} is larger than engram-trt supports "
            f"(at most {maximum}); check the value"
        )
    return value


def _int_list(
    d: Mapping[str, Any], key: str, source: str | None, *, minimum: int = 0, maximum: int = INT32_MAX
) -> tuple[int, ...]:
    value = d.get(key)
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, Sequence) or isinstance(value, str) or len(value) == 0:
        raise ConfigError(f"{_where(source)}field '{key}' must be a non-empty list of integers (got {_short(value)})")
    if len(value) > MAX_LIST_LEN:
        raise ConfigError(
            f"{_where(source)}field '{key}' lists {len(value)} values, more than engram-trt supports ({MAX_LIST_LEN})"
        )
    for v in value:
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise ConfigError(
                f"{_where(source)}field '{key}' must hold integers >= {minimum} "
                f"(got {_short(v)} in {_short(list(value))})"
            )
        if v > maximum:
            raise ConfigError(
                f"{_where(source)}field '{key}' holds {_short(v)}, "
                f"larger than engram-trt supports (at most {maximum}); check the value"
            )
    return tuple(value)


def engram_prefix(d: Mapping[str, Any], source: str | None = None) -> str | None:
    """'engram' when the config declares Engram layers, None when it has none."""
    twins = [k for k in RETIRED_PLE_TWINS if k in d]
    if twins:
        raise ConfigError(
            f"{_where(source)}field '{twins[0]}' is not a Qwen4Exp field: PLE is declared by 'ple_layer_ids' "
            f"(one-indexed, on linear-attention layers) with 'ple_embed_dim', 'ple_conv_kernel_size', 'ngram_size', "
            f"'heads_per_ngram', 'ngram_vocab_size_base', 'make_ngram_vocab_size_divisible_by', 'seed' and "
            f"'split_ngram_parts' under architectures [\"Qwen4ExpForCausalLM\"]; an Engram model spells its "
            f"fields engram_* (engram_max_ngram_size, engram_n_heads, ...)"
        )
    ple = sorted(k for k in d if k.startswith("ple_") and d[k] not in (None, []))
    if ple:
        raise ConfigError(
            f"{_where(source)}field '{ple[0]}' declares Qwen4Exp's PLE, which the engram-llama architecture does "
            f"not have; a Qwen4Exp checkpoint names architectures [\"Qwen4ExpForCausalLM\"] (model_type "
            f"\"qwen4_exp_text\"), and engram-trt serves it as that model"
        )
    found = [p for p in ENGRAM_PREFIXES if f"{p}_layer_ids" in d and d[f"{p}_layer_ids"] not in (None, [])]
    if found:
        return found[0]
    stray = sorted(k for k in d if any(k.startswith(p + "_") for p in ENGRAM_PREFIXES))
    if stray:
        p = stray[0].split("_", 1)[0]
        raise ConfigError(
            f"{_where(source)}'{stray[0]}' is set but '{p}_layer_ids' is missing or empty "
            "(expected a non-empty list of layer indices)"
        )
    return None


def parse_engram_spec(d: Mapping[str, Any], source: str | None = None) -> EngramSpec | None:
    """Read and validate the Engram fields of a config dict; None if it has none."""
    prefix = engram_prefix(d, source)
    if prefix is None:
        return None
    k = lambda name: f"{prefix}_{name}"  # noqa: E731
    layer_ids = _int_list(d, k("layer_ids"), source, maximum=LIMITS["layer_ids"])
    if len(set(layer_ids)) != len(layer_ids):
        raise ConfigError(
            f"{_where(source)}field '{k('layer_ids')}' has repeated layers {_short(list(layer_ids))} "
            "(expected distinct layer indices)"
        )
    n = _int_field(
        d,
        k("max_ngram_size"),
        source,
        minimum=2,
        maximum=HASH_MAX_NGRAM,
        expected="an integer >= 2 (n-grams of order 2..N)",
    )
    heads = _int_field(d, k("n_heads"), source, minimum=1, maximum=LIMITS["n_heads"])
    slots = len(layer_ids) * (n - 1) * heads
    if slots > HASH_MAX_SLOTS:
        raise ConfigError(
            f"{_where(source)}{len(layer_ids)} Engram layers x {n - 1} n-gram orders x {heads} heads = {slots} hash "
            f"columns, more than the hash kernel's {HASH_MAX_SLOTS} (ENGRAM_HASH_MAX_SLOTS); "
            f"lower {k('n_heads')} or {k('max_ngram_size')}"
        )
    if len(layer_ids) * n > HASH_MAX_MULTIPLIERS:
        raise ConfigError(
            f"{_where(source)}{len(layer_ids)} Engram layers x {k('max_ngram_size')}={n} = {len(layer_ids) * n} "
            f"multipliers, more than the hash kernel's {HASH_MAX_MULTIPLIERS} (ENGRAM_HASH_MAX_MULTIPLIERS); "
            "use fewer layers or a smaller N"
        )
    raw_vocab = d.get(k("vocab_size"))
    if isinstance(raw_vocab, (list, tuple)):
        vocab: int | tuple[int, ...] = _int_list(
            d, k("vocab_size"), source, minimum=2, maximum=LIMITS["engram_vocab_size"]
        )
        if len(vocab) != n - 1:
            raise ConfigError(
                f"{_where(source)}field '{k('vocab_size')}' lists {len(vocab)} values but {k('max_ngram_size')}={n} "
                f"needs {n - 1} (one per n-gram order 2..{n}) or a single integer"
            )
    else:
        vocab = _int_field(d, k("vocab_size"), source, minimum=2, maximum=LIMITS["engram_vocab_size"])
    # Each head's prime is at least its order's vocab size, so a layer's table has at
    # least this many rows: refuse before the prime search what cannot fit int32 row ids.
    least_rows = heads * (sum(vocab) if isinstance(vocab, tuple) else vocab * (n - 1))
    if least_rows > INT32_MAX:
        raise ConfigError(
            f"{_where(source)}field '{k('vocab_size')}' with {k('n_heads')}={heads} and {k('max_ngram_size')}={n} "
            f"needs tables of at least {least_rows} rows, over 2^31-1 (row ids are int32 on the GPU); "
            f"lower {k('vocab_size')} or {k('n_heads')}"
        )
    cvocab = _int_field(d, k("compressed_vocab_size"), source, minimum=1, maximum=LIMITS["compressed_vocab_size"])
    pad = _int_field(d, k("pad_token_id"), source, minimum=0, maximum=LIMITS["pad_token_id"])
    head_dim = _int_field(d, k("head_dim"), source, minimum=1, maximum=LIMITS["engram_head_dim"], default=None)
    quant_block = _int_field(d, k("quant_block"), source, minimum=1, maximum=LIMITS["quant_block"], default=32)
    num_emb: tuple[int, ...] | None = None
    if d.get(k("num_embeddings")) is not None:
        num_emb = _int_list(d, k("num_embeddings"), source, minimum=1, maximum=LIMITS["num_embeddings"])
        if len(num_emb) == 1 and len(layer_ids) > 1:
            num_emb = num_emb * len(layer_ids)
        if len(num_emb) != len(layer_ids):
            raise ConfigError(
                f"{_where(source)}field '{k('num_embeddings')}' lists {len(num_emb)} values for {len(layer_ids)} "
                f"layers in '{k('layer_ids')}' (expected one per layer or a single integer)"
            )
    table_dtype = d.get(k("table_dtype"), "fp8")
    if not isinstance(table_dtype, str) or table_dtype not in TABLE_DTYPES:
        raise ConfigError(
            f"{_where(source)}field '{k('table_dtype')}' must be one of "
            f"{list(TABLE_DTYPES)} (got {_short(table_dtype)})"
        )
    if table_dtype == "fp8" and head_dim is not None and head_dim % quant_block:
        raise ConfigError(
            f"{_where(source)}field '{k('head_dim')}'={head_dim} must be a multiple of "
            f"{k('quant_block')}={quant_block} for FP8 tables (one ue8m0 scale per block)"
        )
    return EngramSpec(
        layer_ids=layer_ids,
        max_ngram_size=n,
        n_heads=heads,
        vocab_size=vocab,
        compressed_vocab_size=cvocab,
        pad_token_id=pad,
        head_dim=head_dim,
        num_embeddings=num_emb,
        quant_block=quant_block,
        table_dtype=table_dtype,
        prefix=prefix,
    )


@dataclass(frozen=True)
class ModelConfig:
    """The engram-llama backbone plus its Engram spec (see docs/engram-spec.md)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope: RopeSetting = field(default_factory=lambda: RopeSetting(rope_type="default", theta=10000.0))
    max_position_embeddings: int = 4096
    hc_mult: int = 1
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    torch_dtype: str = "bfloat16"
    engram: EngramSpec | None = None
    # The checkpoint's stored weight formats (an engram_trt.quant.QuantSpec from its
    # quantization_config), set by the architecture's reader (models/engram_llama/config.py);
    # None: float weights. Typed loosely: config/ sits below quant/ in the layer order.
    quant: Any = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    ple: ClassVar[None] = None  # no tables of its own beside the Engram tables (ArchitectureConfig)

    @property
    def rope_theta(self) -> float:
        return self.rope.theta

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation (``eos_token_id`` may be one id or a list)."""
        if self.eos_token_id is None:
            return ()
        return self.eos_token_id if isinstance(self.eos_token_id, tuple) else (self.eos_token_id,)

    @property
    def engram_layer_index(self) -> dict[int, int]:
        """Map decoder layer id -> Engram layer index (position in layer_ids)."""
        if self.engram is None:
            return {}
        return {lid: i for i, lid in enumerate(self.engram.layer_ids)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str | None = None) -> "ModelConfig":
        if not isinstance(d, Mapping):
            raise ConfigError(f"{_where(source)}expected a JSON object (got {type(d).__name__})")
        hidden = _int_field(d, "hidden_size", source, minimum=1, maximum=LIMITS["hidden_size"])
        heads = _int_field(d, "num_attention_heads", source, minimum=1, maximum=LIMITS["num_attention_heads"])
        kv_heads = _int_field(
            d, "num_key_value_heads", source, minimum=1, maximum=LIMITS["num_key_value_heads"], default=heads
        )
        if heads % kv_heads:
            raise ConfigError(
                f"{_where(source)}field 'num_key_value_heads'={kv_heads} must divide num_attention_heads={heads}"
            )
        head_dim = _int_field(d, "head_dim", source, minimum=2, maximum=LIMITS["head_dim"], default=None)
        if head_dim is None:
            if hidden % heads:
                raise ConfigError(
                    f"{_where(source)}hidden_size={hidden} is not a multiple of "
                    f"num_attention_heads={heads}; set 'head_dim'"
                )
            head_dim = hidden // heads
        if head_dim % 2:
            raise ConfigError(
                f"{_where(source)}field 'head_dim'={head_dim} must be even (rotary embedding rotates pairs)"
            )
        layers = _int_field(d, "num_hidden_layers", source, minimum=1, maximum=LIMITS["num_hidden_layers"])
        eps = d.get("rms_norm_eps", 1e-6)
        if not _is_number(eps) or not (0 < eps < 1):
            raise ConfigError(f"{_where(source)}field 'rms_norm_eps' must be a number in (0, 1) (got {_short(eps)})")
        tie = d.get("tie_word_embeddings", False)
        if not isinstance(tie, bool):
            raise ConfigError(f"{_where(source)}field 'tie_word_embeddings' must be true or false (got {_short(tie)})")
        torch_dtype = d.get("torch_dtype", "bfloat16")
        if not isinstance(torch_dtype, str) or len(torch_dtype) > 64:
            raise ConfigError(
                f"{_where(source)}field 'torch_dtype' must be a string such as \"bfloat16\" (got {_short(torch_dtype)})"
            )
        bos = _int_field(d, "bos_token_id", source, minimum=0, maximum=LIMITS["bos_token_id"], default=None)
        eos = d.get("eos_token_id")
        if isinstance(eos, list):
            eos = _int_list(d, "eos_token_id", source, maximum=LIMITS["eos_token_id"]) if eos else None
        else:
            eos = _int_field(
                d,
                "eos_token_id",
                source,
                minimum=0,
                maximum=LIMITS["eos_token_id"],
                default=None,
                expected="a token id or a list of token ids",
            )
        spec = parse_engram_spec(d, source)
        max_pos = _int_field(
            d, "max_position_embeddings", source, minimum=1, maximum=LIMITS["max_position_embeddings"], default=4096
        )
        rope = parse_rope(
            d, source=source, max_position_embeddings=max_pos, head_dim=head_dim, supported=LLAMA_ROPE_TYPES
        )
        cfg = cls(
            hidden_size=hidden,
            intermediate_size=_int_field(
                d, "intermediate_size", source, minimum=1, maximum=LIMITS["intermediate_size"]
            ),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=_int_field(d, "vocab_size", source, minimum=1, maximum=LIMITS["vocab_size"]),
            rms_norm_eps=float(eps),
            rope=rope,
            max_position_embeddings=max_pos,
            hc_mult=_int_field(d, "hc_mult", source, minimum=1, maximum=LIMITS["hc_mult"], default=1),
            tie_word_embeddings=tie,
            bos_token_id=bos,
            eos_token_id=eos,
            torch_dtype=torch_dtype,
            engram=spec,
            extra={k: v for k, v in d.items()},
        )
        if spec is not None:
            bad = [lid for lid in spec.layer_ids if lid >= layers]
            if bad:
                raise ConfigError(
                    f"{_where(source)}field '{spec.field_name('layer_ids')}' names layers {_short(bad)} but "
                    f"num_hidden_layers={layers} (expected ids in 0..{layers - 1})"
                )
            if spec.pad_token_id >= cfg.vocab_size:
                raise ConfigError(
                    f"{_where(source)}field '{spec.field_name('pad_token_id')}'={spec.pad_token_id} is not a token "
                    f"id (vocab_size={cfg.vocab_size})"
                )
        return cfg

    def require_engram(self, what: str = "this operation") -> EngramSpec:
        """The spec, or a clear error for a model without Engram layers."""
        if self.engram is None:
            raise ConfigError(f"config has no Engram layers (no 'engram_layer_ids'), so {what} does not apply")
        return self.engram

    def require_model(self) -> EngramSpec | None:
        """Check the fields that reading tables needs (head_dim); returns the spec."""
        spec = self.engram
        if spec is not None and spec.head_dim is None:
            raise ConfigError(
                f"config: missing field '{spec.field_name('head_dim')}' "
                f"(expected the table row width, a multiple of {spec.quant_block})"
            )
        return spec

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.extra)
        base = asdict(self)
        for k in ("engram", "extra", "rope", "quant"):
            base.pop(k)
        d.update(base)
        for k in ROPE_FIELDS:
            d.pop(k, None)
        d["rope_parameters"] = self.rope.to_dict()
        if isinstance(self.eos_token_id, tuple):
            d["eos_token_id"] = list(self.eos_token_id)
        for p in ENGRAM_PREFIXES:
            for name in _SPEC_FIELDS:
                d.pop(f"{p}_{name}", None)
        if self.engram is not None:
            d.update(self.engram.to_config_fields())
        return d


def file_in_checkpoint(path: str | Path, name: str, what: str) -> Path:
    """``path`` itself, or ``path/name`` when ``path`` is a checkpoint folder; an error
    naming the place and the expectation when that file does not exist."""
    p = Path(path)
    if p.is_dir():
        p = p / name
    if not p.is_file():
        raise ConfigError(f"no {what} at '{p}' (expected a {name} path or a checkpoint folder holding one)")
    return p


def config_path(path: str | Path) -> Path:
    """A config.json path from a file or checkpoint-folder path."""
    return file_in_checkpoint(path, "config.json", "config file")


def read_config_dict(path: str | Path) -> tuple[dict[str, Any], str]:
    """A config.json as a dict, and its path for messages (see config/jsonfile.py for
    what is refused)."""
    p = config_path(path)
    return read_json_object(p, "config.json"), str(p)


def load_config(path: str | Path) -> ModelConfig:
    """Read and validate a whole-model config (backbone and Engram fields)."""
    d, src = read_config_dict(path)
    return ModelConfig.from_dict(d, src)


def load_engram_spec(path: str | Path) -> EngramSpec:
    """Read only the Engram fields (enough for layout and hashing); refuse a config without them."""
    d, src = read_config_dict(path)
    spec = parse_engram_spec(d, src)
    if spec is None:
        raise ConfigError(f"{src}: no Engram fields (expected 'engram_layer_ids' with the other engram_* fields)")
    return spec
