"""Model configuration: the HF ``config.json`` of an Engram model, read and validated.

Two spellings of one mechanism are accepted: DeepSeek-V4.1-style ``engram_*`` fields
and Qwen4Exp-style ``ple_*`` fields (per-layer embeddings). Both become one
:class:`EngramSpec`. A config with neither has no Engram layers (``engram is None``).

Validation happens here, once, so every consumer (layout, model, builder, runtime,
CLI) can trust the values: each bad field is refused with a message that names the
field, the value found and the value expected.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from engram_trt.errors import ConfigError

ENGRAM_PREFIXES = ("engram", "ple")

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
        """The config.json spelling of a field (``engram_n_heads`` / ``ple_n_heads``)."""
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


def _where(source: str | None) -> str:
    return f"{source}: " if source else "config: "


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _int_field(d: Mapping[str, Any], key: str, source: str | None, *, minimum: int | None = None,
               default: Any = ..., expected: str | None = None) -> Any:
    if key not in d or d[key] is None:
        if default is ...:
            raise ConfigError(f"{_where(source)}missing field '{key}' (expected {expected or 'an integer'})")
        return default
    value = d[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{_where(source)}field '{key}' must be {expected or 'an integer'} (got {value!r})")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{_where(source)}field '{key}' must be an integer >= {minimum} (got {value})")
    return value


def _int_list(d: Mapping[str, Any], key: str, source: str | None, *, minimum: int = 0) -> tuple[int, ...]:
    value = d.get(key)
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, Sequence) or isinstance(value, str) or len(value) == 0:
        raise ConfigError(f"{_where(source)}field '{key}' must be a non-empty list of integers (got {value!r})")
    for v in value:
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise ConfigError(f"{_where(source)}field '{key}' must hold integers >= {minimum} (got {v!r} in {list(value)})")
    return tuple(value)


def engram_prefix(d: Mapping[str, Any]) -> str | None:
    """Which spelling a config uses: 'engram', 'ple', or None (no Engram layers)."""
    found = [p for p in ENGRAM_PREFIXES if f"{p}_layer_ids" in d and d[f"{p}_layer_ids"] not in (None, [])]
    if len(found) > 1:
        raise ConfigError("config: both 'engram_layer_ids' and 'ple_layer_ids' are set; a model declares one Engram mechanism, keep one")
    if found:
        return found[0]
    stray = sorted(k for k in d if any(k.startswith(p + "_") for p in ENGRAM_PREFIXES))
    if stray:
        p = stray[0].split("_", 1)[0]
        raise ConfigError(f"config: '{stray[0]}' is set but '{p}_layer_ids' is missing or empty (expected a non-empty list of layer indices)")
    return None


def parse_engram_spec(d: Mapping[str, Any], source: str | None = None) -> EngramSpec | None:
    """Read and validate the Engram fields of a config dict; None if it has none."""
    prefix = engram_prefix(d)
    if prefix is None:
        return None
    k = lambda name: f"{prefix}_{name}"  # noqa: E731
    layer_ids = _int_list(d, k("layer_ids"), source)
    if len(set(layer_ids)) != len(layer_ids):
        raise ConfigError(f"{_where(source)}field '{k('layer_ids')}' has repeated layers {list(layer_ids)} (expected distinct layer indices)")
    n = _int_field(d, k("max_ngram_size"), source, minimum=2, expected="an integer >= 2 (n-grams of order 2..N)")
    heads = _int_field(d, k("n_heads"), source, minimum=1)
    raw_vocab = d.get(k("vocab_size"))
    if isinstance(raw_vocab, (list, tuple)):
        vocab: int | tuple[int, ...] = _int_list(d, k("vocab_size"), source, minimum=2)
        if len(vocab) != n - 1:
            raise ConfigError(f"{_where(source)}field '{k('vocab_size')}' lists {len(vocab)} values but {k('max_ngram_size')}={n} needs {n - 1} (one per n-gram order 2..{n}) or a single integer")
    else:
        vocab = _int_field(d, k("vocab_size"), source, minimum=2)
    cvocab = _int_field(d, k("compressed_vocab_size"), source, minimum=1)
    pad = _int_field(d, k("pad_token_id"), source, minimum=0)
    head_dim = _int_field(d, k("head_dim"), source, minimum=1, default=None)
    quant_block = _int_field(d, k("quant_block"), source, minimum=1, default=32)
    num_emb: tuple[int, ...] | None = None
    if d.get(k("num_embeddings")) is not None:
        num_emb = _int_list(d, k("num_embeddings"), source, minimum=1)
        if len(num_emb) == 1 and len(layer_ids) > 1:
            num_emb = num_emb * len(layer_ids)
        if len(num_emb) != len(layer_ids):
            raise ConfigError(f"{_where(source)}field '{k('num_embeddings')}' lists {len(num_emb)} values for {len(layer_ids)} layers in '{k('layer_ids')}' (expected one per layer or a single integer)")
    table_dtype = d.get(k("table_dtype"), "fp8")
    if table_dtype not in TABLE_DTYPES:
        raise ConfigError(f"{_where(source)}field '{k('table_dtype')}' must be one of {list(TABLE_DTYPES)} (got {table_dtype!r})")
    if table_dtype == "fp8" and head_dim is not None and head_dim % quant_block:
        raise ConfigError(f"{_where(source)}field '{k('head_dim')}'={head_dim} must be a multiple of {k('quant_block')}={quant_block} for FP8 tables (one ue8m0 scale per block)")
    return EngramSpec(
        layer_ids=layer_ids, max_ngram_size=n, n_heads=heads, vocab_size=vocab,
        compressed_vocab_size=cvocab, pad_token_id=pad, head_dim=head_dim,
        num_embeddings=num_emb, quant_block=quant_block, table_dtype=table_dtype, prefix=prefix,
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
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    hc_mult: int = 1
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    torch_dtype: str = "bfloat16"
    engram: EngramSpec | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

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
        hidden = _int_field(d, "hidden_size", source, minimum=1)
        heads = _int_field(d, "num_attention_heads", source, minimum=1)
        kv_heads = _int_field(d, "num_key_value_heads", source, minimum=1, default=heads)
        if heads % kv_heads:
            raise ConfigError(f"{_where(source)}field 'num_key_value_heads'={kv_heads} must divide num_attention_heads={heads}")
        head_dim = _int_field(d, "head_dim", source, minimum=2, default=None)
        if head_dim is None:
            if hidden % heads:
                raise ConfigError(f"{_where(source)}hidden_size={hidden} is not a multiple of num_attention_heads={heads}; set 'head_dim'")
            head_dim = hidden // heads
        if head_dim % 2:
            raise ConfigError(f"{_where(source)}field 'head_dim'={head_dim} must be even (rotary embedding rotates pairs)")
        layers = _int_field(d, "num_hidden_layers", source, minimum=1)
        eps = d.get("rms_norm_eps", 1e-6)
        if not _is_number(eps) or not (0 < eps < 1):
            raise ConfigError(f"{_where(source)}field 'rms_norm_eps' must be a number in (0, 1) (got {eps!r})")
        theta = d.get("rope_theta", 10000.0)
        if not _is_number(theta) or theta <= 0:
            raise ConfigError(f"{_where(source)}field 'rope_theta' must be a finite positive number (got {theta!r})")
        tie = d.get("tie_word_embeddings", False)
        if not isinstance(tie, bool):
            raise ConfigError(f"{_where(source)}field 'tie_word_embeddings' must be true or false (got {tie!r})")
        torch_dtype = d.get("torch_dtype", "bfloat16")
        if not isinstance(torch_dtype, str):
            raise ConfigError(f"{_where(source)}field 'torch_dtype' must be a string such as \"bfloat16\" (got {torch_dtype!r})")
        bos = _int_field(d, "bos_token_id", source, minimum=0, default=None)
        eos = d.get("eos_token_id")
        if isinstance(eos, list):
            eos = _int_list(d, "eos_token_id", source) if eos else None
        else:
            eos = _int_field(d, "eos_token_id", source, minimum=0, default=None,
                             expected="a token id or a list of token ids")
        spec = parse_engram_spec(d, source)
        cfg = cls(
            hidden_size=hidden,
            intermediate_size=_int_field(d, "intermediate_size", source, minimum=1),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=_int_field(d, "vocab_size", source, minimum=1),
            rms_norm_eps=float(eps),
            rope_theta=float(theta),
            max_position_embeddings=_int_field(d, "max_position_embeddings", source, minimum=1, default=4096),
            hc_mult=_int_field(d, "hc_mult", source, minimum=1, default=1),
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
                raise ConfigError(f"{_where(source)}field '{spec.field_name('layer_ids')}' names layers {bad} but num_hidden_layers={layers} (expected ids in 0..{layers - 1})")
            if spec.pad_token_id >= cfg.vocab_size:
                raise ConfigError(f"{_where(source)}field '{spec.field_name('pad_token_id')}'={spec.pad_token_id} is not a token id (vocab_size={cfg.vocab_size})")
        return cfg

    def require_engram(self, what: str = "this operation") -> EngramSpec:
        """The spec, or a clear error for a model without Engram layers."""
        if self.engram is None:
            raise ConfigError(f"config has no Engram layers (no 'engram_layer_ids' or 'ple_layer_ids'), so {what} does not apply")
        return self.engram

    def require_model(self) -> EngramSpec | None:
        """Check the fields that reading tables needs (head_dim); returns the spec."""
        spec = self.engram
        if spec is not None and spec.head_dim is None:
            raise ConfigError(f"config: missing field '{spec.field_name('head_dim')}' (expected the table row width, a multiple of {spec.quant_block})")
        return spec

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.extra)
        base = asdict(self)
        for k in ("engram", "extra"):
            base.pop(k)
        d.update(base)
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
    p = config_path(path)
    try:
        d = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{p}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{p}: expected a JSON object at the top level")
    return d, str(p)


def load_config(path: str | Path) -> ModelConfig:
    """Read and validate a whole-model config (backbone and Engram fields)."""
    d, src = read_config_dict(path)
    return ModelConfig.from_dict(d, src)


def load_engram_spec(path: str | Path) -> EngramSpec:
    """Read only the Engram fields (enough for layout and hashing); refuse a config without them."""
    d, src = read_config_dict(path)
    spec = parse_engram_spec(d, src)
    if spec is None:
        raise ConfigError(f"{src}: no Engram fields (expected 'engram_layer_ids' with the other engram_* fields, or the ple_* twins)")
    return spec

