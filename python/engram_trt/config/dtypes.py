"""One ``--dtype`` vocabulary for every subcommand.

``build`` used to say ``bf16|fp16`` and ``run``/``demo`` ``float32|bfloat16``. Every
subcommand now accepts every spelling (``bf16``/``bfloat16``, ``fp16``/``float16``/
``half``, ``fp32``/``float32``/``float``, any case) and normalizes it to the short name;
what each subcommand can compute in is checked after, with a message that names the
subcommand's set. Importable without torch (the CLI builds its parsers first).
"""

from __future__ import annotations

import argparse

from engram_trt.errors import EngramError

CANONICAL = ("bf16", "fp16", "fp32")
ALIASES = {
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
}
TORCH_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
METAVAR = "{bf16,fp16,fp32}"
SPELLINGS = "bf16|bfloat16, fp16|float16|half, fp32|float32|float"
REFERENCE_DTYPES = ("fp32", "bf16")  # run / demo: the reference model computes in these


def metavar(allowed: tuple[str, ...]) -> str:
    """``--dtype``'s metavar offering only ``allowed`` (what the subcommand accepts): ``{bf16,fp16}``."""
    return "{" + ",".join(allowed) + "}"


def spellings(allowed: tuple[str, ...]) -> str:
    """Every spelling of ``allowed``: ``bf16|bfloat16, fp16|float16|half``."""
    return ", ".join("|".join(s for s, c in ALIASES.items() if c == d) for d in allowed)


def normalize_dtype(text: str, flag: str = "--dtype") -> str:
    """The canonical short name of a dtype spelling; an :class:`EngramError` otherwise."""
    d = ALIASES.get(str(text).strip().lower())
    if d is None:
        shown = str(text)[:40]
        raise EngramError(f"{flag} '{shown}' is not a dtype (expected one of {SPELLINGS})")
    return d


def dtype_arg(text: str) -> str:
    """argparse ``type=`` for ``--dtype``: any spelling, normalized."""
    try:
        return normalize_dtype(text)
    except EngramError:
        raise argparse.ArgumentTypeError(f"'{str(text)[:40]}' is not a dtype (expected one of {SPELLINGS})") from None


def require_dtype(dtype: str, allowed: tuple[str, ...], what: str, flag: str = "--dtype") -> str:
    """``dtype`` normalized, refused unless ``what`` computes in it."""
    d = normalize_dtype(dtype, flag)
    if d not in allowed:
        raise EngramError(f"{flag} {d}: {what} runs in {' or '.join(allowed)} only (pass one of those)")
    return d
