"""Rotary position embedding (RoPE) as config.json spells it, read into one typed
setting (no torch: the config layer). The frequencies and cos/sin tables that
transformers computes for a setting are :mod:`engram_trt.models.rope`'s.

Two spellings reach us in a checkpoint's ``config.json``:

* transformers 5 writes ``rope_parameters``: ``{"rope_type": ..., "rope_theta": ...,
  <the type's own keys>}``;
* transformers 4 wrote a top-level ``rope_theta`` and an optional ``rope_scaling`` dict
  (``null`` = plain RoPE) whose type is ``rope_type`` or, older, ``type``.

:func:`parse_rope` reads either (or both, when they agree) into a :class:`RopeSetting`;
every value it cannot honour exactly is refused with a one-line :class:`ConfigError`
naming the field, the value and what is accepted. The math functions reproduce
transformers 5.25's ``modeling_rope_utils`` (and ``LlamaRotaryEmbedding.forward``)
operation for operation in float32, so the tables match it bit for bit on a CPU.

Semantics worth knowing, all as transformers has them:

* ``dynamic`` (dynamic NTK) is *stateful* in transformers. At init the frequencies are
  plain RoPE's. Each forward takes ``seq_len = max(position_ids) + 1``; when it exceeds
  the largest length seen so far (initially ``max_position_embeddings``, *not*
  ``original_max_position_embeddings``) the frequencies are recomputed with the base
  ``theta * (factor * seq_len / max_pos - (factor - 1)) ** (d / (d - 2))`` and kept;
  they go back to plain RoPE only on a call with ``seq_len < max_pos`` (strictly: a call
  ending exactly at ``max_pos`` keeps the scaled ones). So the frequencies of a call
  depend on the longest call since the last reset, and keys already in a KV cache were
  rotated under older ones. :func:`dynamic_inv_freq` gives the frequencies after a call
  of ``seq_len`` on a fresh module.
* ``longrope`` is stateless: every call uses ``long_factor`` when ``max(position_ids) + 1
  > original_max_position_embeddings`` and ``short_factor`` otherwise, for all of the
  call's positions; the attention factor is the same either way (and applies to short
  sequences too).
* ``yarn``: an absent ``attention_factor`` is ``0.1 * ln(factor) + 1``, or, when *both*
  ``mscale`` and ``mscale_all_dim`` are set (non-zero), the ratio of the two mscales; a
  lone ``mscale`` is ignored. Folding ``mscale_all_dim`` into the softmax scale (the
  DeepSeek MLA models) is the attention's business, not RoPE's: Llama does not.
* ``partial_rotary_factor``: the rotated width is ``int(head_dim * factor)`` for every
  type in ``modeling_rope_utils`` and for architectures that rotate part of the head
  (Phi-3, GPT-NeoX, ...); Llama's own plain-RoPE init ignores it and its attention
  rotates the whole head, so :func:`parse_rope` refuses it unless the caller says the
  architecture rotates part of the head (``partial_rotary=True``).
* a top-level ``original_max_position_embeddings`` (Phi-3's spelling) overrides the one
  in the RoPE dict when transformers builds the rotary embedding; we refuse the two when
  they disagree, and refuse a scaled type that has neither (transformers would silently
  use ``max_position_embeddings``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Collection, Mapping

from engram_trt.errors import ConfigError

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")

DEFAULT_THETA = 10000.0
MAX_THETA = 1e12
MAX_FACTOR = 1e6
MAX_POSITIONS = 1 << 24
YARN_BETA_FAST = 32.0
YARN_BETA_SLOW = 1.0

# Keys every type takes, and each type's own (required, optional). A key outside these
# is refused: it is a typo, a parameter of a type we do not implement, or one that would
# change the math in a way the setting cannot carry.
_COMMON_KEYS = ("rope_type", "type", "rope_theta", "partial_rotary_factor")
_TYPE_KEYS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "default": ((), ()),
    "linear": (("factor",), ()),
    "dynamic": (("factor",), ()),
    "yarn": (
        ("factor", "original_max_position_embeddings"),
        ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"),
    ),
    "llama3": (("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"), ()),
    "longrope": (("short_factor", "long_factor", "original_max_position_embeddings"), ("factor", "attention_factor")),
}
_KNOWN_KEYS = set(_COMMON_KEYS).union(*(set(r) | set(o) for r, o in _TYPE_KEYS.values()))
# Types transformers (or older checkpoints) name that we refuse, with the reason.
_REFUSED_TYPES = {
    "su": "the old Phi-3 spelling of 'longrope' (rename it)",
    "mrope": "multimodal RoPE (Qwen2-VL); engram-trt serves text models",
    "proportional": "proportional RoPE (Gemma); not implemented",
    "axial": "axial 2-D RoPE (vision); not implemented",
}


def _where(source: str | None) -> str:
    return f"{source}: " if source else "config: "


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class RopeSetting:
    """One model's RoPE, every value resolved (defaults filled in, inferred values
    computed), so two spellings of one RoPE compare equal.

    ``max_position_embeddings`` is the config's own (``dynamic`` scales relative to it);
    it is not a RoPE parameter and :meth:`to_dict` leaves it out."""

    rope_type: str
    theta: float
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int | None = None
    factor: float | None = None  # linear, dynamic, yarn, llama3, longrope
    original_max_position_embeddings: int | None = None  # yarn, llama3, longrope
    attention_factor: float = 1.0  # what cos/sin are multiplied by (yarn, longrope: resolved)
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    beta_fast: float | None = None  # yarn (resolved: 32 when absent)
    beta_slow: float | None = None  # yarn (resolved: 1 when absent)
    mscale: float | None = None  # yarn, as given (already folded into attention_factor)
    mscale_all_dim: float | None = None  # yarn, as given (ditto; MLA softmax folding is not RoPE's)
    truncate: bool | None = None  # yarn (resolved: True when absent)
    short_factor: tuple[float, ...] | None = None  # longrope, one per rotated pair
    long_factor: tuple[float, ...] | None = None  # longrope

    def rotary_dim(self, head_dim: int) -> int:
        """How many of the head's channels are rotated (``int(head_dim * partial_rotary_factor)``)."""
        return int(head_dim * self.partial_rotary_factor)

    @property
    def length_dependent(self) -> bool:
        """Whether the frequencies change with the sequence length (``dynamic`` beyond
        ``max_position_embeddings``, ``longrope`` beyond ``original_max_position_embeddings``):
        one cos/sin table then does not serve every length."""
        return self.rope_type == "dynamic" or (self.rope_type == "longrope" and self.short_factor != self.long_factor)

    def to_dict(self) -> dict[str, Any]:
        """The setting as transformers 5 writes ``rope_parameters`` (for manifests):
        :func:`parse_rope` of it gives this setting back."""
        d: dict[str, Any] = {"rope_type": self.rope_type, "rope_theta": self.theta}
        if self.partial_rotary_factor != 1.0:
            d["partial_rotary_factor"] = self.partial_rotary_factor
        required, optional = _TYPE_KEYS[self.rope_type]
        for f in fields(self):
            if f.name in required or f.name in optional:
                v = getattr(self, f.name)
                if v is not None:
                    d[f.name] = list(v) if isinstance(v, tuple) else v
        return d


class _Reader:
    """Reads one RoPE dict's values, naming them ``<field>.<key>`` in errors."""

    def __init__(self, d: Mapping[str, Any], field: str | None, source: str | None) -> None:
        self.d, self.field, self.source = d, field, source
        self.rope_type = "default"

    def name(self, key: str) -> str:
        return f"{self.field}.{key}" if self.field else key

    def fail(self, text: str) -> ConfigError:
        return ConfigError(f"{_where(self.source)}{text}")

    def number(self, key: str, *, low: float, high: float, low_open: bool = False, default: Any = ...) -> Any:
        value = self.d.get(key)
        if value is None:
            if default is ...:
                raise self.fail(
                    f"missing field '{self.name(key)}' (rope_type {self.rope_type!r} needs a number "
                    f"{'>' if low_open else '>='} {low:g})"
                )
            return default
        ok = _is_number(value) and (value > low if low_open else value >= low) and value <= high
        if not ok:
            raise self.fail(
                f"field '{self.name(key)}' must be a number {'>' if low_open else '>='} {low:g} "
                f"and <= {high:g} (got {_short(value)})"
            )
        return float(value)


def _positive_int(value: Any, name: str, source: str | None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_POSITIONS:
        raise ConfigError(
            f"{_where(source)}field '{name}' must be an integer in [1, {MAX_POSITIONS}] (got {_short(value)})"
        )
    return value


def _factor_list(r: _Reader, key: str, pairs: int) -> tuple[float, ...]:
    value = r.d.get(key)
    if value is None:
        raise r.fail(
            f"missing field '{r.name(key)}' (rope_type 'longrope' needs a list of {pairs} positive "
            "numbers, one per rotated pair)"
        )
    if not isinstance(value, (list, tuple)) or not all(_is_number(v) and v > 0 for v in value):
        raise r.fail(f"field '{r.name(key)}' must be a list of positive numbers (got {_short(value)})")
    if len(value) != pairs:
        raise r.fail(
            f"field '{r.name(key)}' lists {len(value)} values but the rotary width needs {pairs} (rotary_dim / 2)"
        )
    return tuple(float(v) for v in value)


def _unnest(d: Mapping[str, Any], field: str, source: str | None) -> Mapping[str, Any]:
    """transformers 5 may key ``rope_parameters`` by layer type (``{"full_attention": {...},
    "sliding_attention": {...}}``). One RoPE for every layer is all we serve: identical
    entries collapse to one, anything else is refused."""
    if not d or any(k in _KNOWN_KEYS for k in d) or not all(v is None or isinstance(v, Mapping) for v in d.values()):
        return d
    entries = list(d.values())
    if all(isinstance(v, Mapping) for v in entries) and all(dict(v) == dict(entries[0]) for v in entries):
        return entries[0]
    raise ConfigError(
        f"{_where(source)}field '{field}' is keyed per layer type ({', '.join(map(str, d))}) with different "
        f"RoPE per layer (or none on some); engram-trt serves one RoPE for every layer"
    )


def _agree(name_a: str, a: Any, name_b: str, b: Any, source: str | None) -> Any:
    if a is not None and b is not None and a != b:
        raise ConfigError(
            f"{_where(source)}fields '{name_a}'={_short(a)} and '{name_b}'={_short(b)} disagree; keep one"
        )
    return a if a is not None else b


def _parse_one(
    d: Mapping[str, Any],
    field: str | None,
    top: Mapping[str, Any],
    *,
    source: str | None,
    max_position_embeddings: int,
    head_dim: int,
    supported: Collection[str],
    partial_rotary: bool,
) -> RopeSetting:
    if field is not None and not isinstance(d, Mapping):
        raise ConfigError(f"{_where(source)}field '{field}' must be a JSON object or null (got {_short(d)})")
    if field == "rope_parameters":
        d = _unnest(d, field, source)
    r = _Reader(d, field, source)

    # the type: 'rope_type', or 'type' as transformers 4 first wrote it
    rt, legacy = d.get("rope_type"), d.get("type")
    if rt is not None and legacy is not None and rt != legacy:
        raise r.fail(
            f"fields '{r.name('rope_type')}'={_short(rt)} and '{r.name('type')}'={_short(legacy)} disagree; keep one"
        )
    rope_type = rt if rt is not None else legacy if legacy is not None else "default"
    if not isinstance(rope_type, str):
        raise r.fail(f"field '{r.name('rope_type')}' must be a string such as \"llama3\" (got {_short(rope_type)})")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        why = f": {_REFUSED_TYPES[rope_type]}" if rope_type in _REFUSED_TYPES else ""
        raise r.fail(
            f"field '{r.name('rope_type')}'={rope_type!r} is not a RoPE type engram-trt implements{why} "
            f"(supported: {', '.join(s for s in SUPPORTED_ROPE_TYPES if s in supported)})"
        )
    if rope_type not in supported:
        raise r.fail(
            f"field '{r.name('rope_type')}'={rope_type!r} is not supported by this architecture "
            f"(supported: {', '.join(s for s in SUPPORTED_ROPE_TYPES if s in supported)})"
        )

    r.rope_type = rope_type
    required, optional = _TYPE_KEYS[rope_type]
    takes = (*required, *optional, "rope_theta", "partial_rotary_factor")
    for key in d:
        if key in _COMMON_KEYS or key in required or key in optional or d[key] is None:
            continue
        what = (
            "is not a RoPE parameter engram-trt knows"
            if key not in _KNOWN_KEYS
            else f"does not apply to rope_type {rope_type!r}"
        )
        raise r.fail(f"field '{r.name(key)}' {what} (rope_type {rope_type!r} takes: {', '.join(takes)}); remove it")

    # theta and the rotated width: in the dict (v5) or at the top level (v4); both must agree
    theta_top = _Reader(top, None, source).number("rope_theta", low=1.0, high=MAX_THETA, low_open=True, default=None)
    theta_here = r.number("rope_theta", low=1.0, high=MAX_THETA, low_open=True, default=None) if field else None
    theta = _agree(r.name("rope_theta"), theta_here, "rope_theta", theta_top, source)
    theta = DEFAULT_THETA if theta is None else theta
    prf_top = _Reader(top, None, source).number("partial_rotary_factor", low=0.0, high=1.0, low_open=True, default=None)
    prf_here = r.number("partial_rotary_factor", low=0.0, high=1.0, low_open=True, default=None) if field else None
    prf = _agree(r.name("partial_rotary_factor"), prf_here, "partial_rotary_factor", prf_top, source)
    prf = 1.0 if prf is None else prf
    prf_name = r.name("partial_rotary_factor") if prf_here is not None else "partial_rotary_factor"
    rotary_dim = int(head_dim * prf)
    if prf != 1.0 and not partial_rotary:
        raise r.fail(
            f"field '{prf_name}'={prf:g} asks to rotate part of the head, but this architecture rotates the "
            f"whole head (supported: 1.0)"
        )
    if rotary_dim < 2 or rotary_dim % 2:
        raise r.fail(
            f"field '{prf_name}'={prf:g} gives a rotary width of {rotary_dim} channels of head_dim={head_dim} "
            f"(expected an even width >= 2)"
        )

    kw: dict[str, Any] = {}
    if rope_type in ("yarn", "llama3", "longrope"):
        here = d.get("original_max_position_embeddings")
        here = None if here is None else _positive_int(here, r.name("original_max_position_embeddings"), source)
        above = top.get("original_max_position_embeddings")
        above = None if above is None else _positive_int(above, "original_max_position_embeddings", source)
        orig = _agree(
            r.name("original_max_position_embeddings"), here, "original_max_position_embeddings", above, source
        )
        if orig is None:
            raise r.fail(
                f"missing field '{r.name('original_max_position_embeddings')}' (rope_type {rope_type!r} needs the "
                f"pre-training context length, an integer)"
            )
        kw["original_max_position_embeddings"] = orig

    if rope_type in ("linear", "dynamic", "llama3"):
        kw["factor"] = r.number("factor", low=1.0, high=MAX_FACTOR)
    elif rope_type == "yarn":
        if "factor" not in d:
            raise r.fail(
                f"missing field '{r.name('factor')}' (rope_type 'yarn' needs a number >= 1, or null for "
                f"max_position_embeddings / original_max_position_embeddings)"
            )
        factor = r.number("factor", low=1.0, high=MAX_FACTOR, default=None)
        if factor is None:
            factor = max_position_embeddings / kw["original_max_position_embeddings"]
            if not 1.0 <= factor <= MAX_FACTOR:
                raise r.fail(
                    f"field '{r.name('factor')}' is null and max_position_embeddings / original_max_position_embeddings"
                    f" = {factor:g} (expected >= 1)"
                )
        kw["factor"] = factor
        mscale = r.number("mscale", low=0.0, high=MAX_FACTOR, default=None)
        mscale_all = r.number("mscale_all_dim", low=0.0, high=MAX_FACTOR, default=None)
        att = r.number("attention_factor", low=0.0, high=MAX_FACTOR, low_open=True, default=None)
        if att is None:
            att = (
                (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all))
                if (mscale and mscale_all)
                else _yarn_mscale(factor, 1.0)
            )
        beta_fast = r.number("beta_fast", low=0.0, high=MAX_FACTOR, low_open=True, default=YARN_BETA_FAST)
        beta_slow = r.number("beta_slow", low=0.0, high=MAX_FACTOR, low_open=True, default=YARN_BETA_SLOW)
        if beta_fast < beta_slow:
            raise r.fail(
                f"field '{r.name('beta_fast')}'={beta_fast:g} must be >= '{r.name('beta_slow')}'={beta_slow:g}"
            )
        truncate = d.get("truncate", True)
        truncate = True if truncate is None else truncate
        if not isinstance(truncate, bool):
            raise r.fail(f"field '{r.name('truncate')}' must be true or false (got {_short(truncate)})")
        kw.update(
            attention_factor=float(att),
            mscale=mscale,
            mscale_all_dim=mscale_all,
            beta_fast=beta_fast,
            beta_slow=beta_slow,
            truncate=truncate,
        )
    if rope_type == "llama3":
        low = r.number("low_freq_factor", low=0.0, high=MAX_FACTOR, low_open=True)
        high = r.number("high_freq_factor", low=0.0, high=MAX_FACTOR, low_open=True)
        if high <= low:
            raise r.fail(
                f"field '{r.name('high_freq_factor')}'={high:g} must be greater than "
                f"'{r.name('low_freq_factor')}'={low:g}"
            )
        kw.update(low_freq_factor=low, high_freq_factor=high)
    elif rope_type == "longrope":
        kw["short_factor"] = _factor_list(r, "short_factor", rotary_dim // 2)
        kw["long_factor"] = _factor_list(r, "long_factor", rotary_dim // 2)
        orig = kw["original_max_position_embeddings"]
        factor = r.number("factor", low=1.0, high=MAX_FACTOR, default=None)
        if factor is None:
            factor = max_position_embeddings / orig
            if factor < 1.0:
                raise r.fail(
                    f"field '{r.name('factor')}' is absent and max_position_embeddings={max_position_embeddings} is "
                    f"below original_max_position_embeddings={orig} (expected a factor >= 1)"
                )
        att = r.number("attention_factor", low=0.0, high=MAX_FACTOR, low_open=True, default=None)
        if att is None:
            att = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
        kw.update(factor=factor, attention_factor=float(att))

    return RopeSetting(
        rope_type=rope_type,
        theta=theta,
        partial_rotary_factor=prf,
        max_position_embeddings=max_position_embeddings,
        **kw,
    )


def parse_rope(
    config: Mapping[str, Any],
    *,
    source: str | None = None,
    max_position_embeddings: int,
    head_dim: int,
    supported: Collection[str] = SUPPORTED_ROPE_TYPES,
    partial_rotary: bool = False,
) -> RopeSetting:
    """The RoPE of a ``config.json`` mapping, in either transformers spelling.

    ``rope_parameters`` (v5) and ``rope_theta`` + ``rope_scaling`` (v4; ``rope_scaling:
    null`` = plain RoPE) may both be present only when they describe the same RoPE.
    ``supported`` names the types the architecture implements; ``partial_rotary`` says
    whether it rotates only ``partial_rotary_factor`` of the head (Llama does not).
    Every bad value raises :class:`ConfigError`, one line naming the field."""
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
        raise ValueError(f"head_dim must be an even integer >= 2 (got {head_dim!r})")
    unknown = set(supported) - set(SUPPORTED_ROPE_TYPES)
    if unknown:
        raise ValueError(f"supported names types rope.py does not implement: {sorted(unknown)}")
    spellings = [(k, config[k]) for k in ("rope_parameters", "rope_scaling") if config.get(k) not in (None, {})]
    if not spellings:
        spellings = [(None, {})]
    settings = [
        _parse_one(
            d,
            f,
            config,
            source=source,
            max_position_embeddings=max_position_embeddings,
            head_dim=head_dim,
            supported=supported,
            partial_rotary=partial_rotary,
        )
        for f, d in spellings
    ]
    if len(settings) == 2 and settings[0] != settings[1]:
        raise ConfigError(
            f"{_where(source)}fields 'rope_parameters' ({settings[0].rope_type}) and 'rope_scaling' "
            f"({settings[1].rope_type}) describe different RoPE: {_short(settings[0].to_dict(), 120)} vs "
            f"{_short(settings[1].to_dict(), 120)}; keep one"
        )
    return settings[0]


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
