"""``SamplingParams``: how one request is generated, checked once at submission."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from engram_trt.errors import EngramError

MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class SamplingParams:
    """``max_tokens`` new tokens at most; greedy when ``temperature == 0``, else
    temperature + nucleus (``top_p``) sampling from a generator seeded with ``seed``
    (None: 0), so a seeded request gives the same tokens alone or in a crowd. Generation
    stops early at one of ``stop`` (strings, excluded from the text), one of
    ``stop_token_ids``, or an end-of-sequence id of the model (unless ``ignore_eos``)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default=())
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        def bad(msg: str) -> EngramError:
            return EngramError(f"SamplingParams: {msg}")

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad(f"max_tokens must be an integer >= 1 (got {self.max_tokens!r})")
        for name in ("temperature", "top_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)):
                raise bad(f"{name} must be a finite number (got {v!r})")
            object.__setattr__(self, name, float(v))
        if self.temperature < 0:
            raise bad(f"temperature must be >= 0 (got {self.temperature}); 0 is greedy")
        if not 0 < self.top_p <= 1:
            raise bad(f"top_p must be in (0, 1] (got {self.top_p})")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED
        ):
            raise bad(f"seed must be an integer in 0..2^63-1 or None (got {self.seed!r})")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not isinstance(s, str) or not s for s in stop):
            raise bad(f"stop must be non-empty strings (got {list(stop)!r})")
        object.__setattr__(self, "stop", stop)
        ids = tuple(self.stop_token_ids or ())
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
            raise bad(f"stop_token_ids must be non-negative integers (got {list(ids)!r})")
        object.__setattr__(self, "stop_token_ids", ids)
        if not isinstance(self.skip_special_tokens, bool):
            raise bad(f"skip_special_tokens must be True or False (got {self.skip_special_tokens!r})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "stop": list(self.stop),
            "stop_token_ids": list(self.stop_token_ids),
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
        }

    @classmethod
    def coerce(cls, value: "SamplingParams | dict | None") -> "SamplingParams":
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            try:
                return cls(**value)
            except TypeError as exc:
                raise EngramError(f"SamplingParams: {exc}") from None
        raise EngramError(f"sampling params must be a SamplingParams or a dict (got {type(value).__name__})")


def as_param_list(params: Any, n: int) -> list[SamplingParams]:
    """One SamplingParams per prompt: one for all, or a list of n."""
    if isinstance(params, Sequence) and not isinstance(params, (str, bytes, dict)):
        if len(params) != n:
            raise EngramError(f"{len(params)} sampling params for {n} prompts; give one, or one per prompt")
        return [SamplingParams.coerce(p) for p in params]
    return [SamplingParams.coerce(params)] * n
