"""Where a weight's scale lives in a checkpoint, and which stored dtype means what.

An FP8 weight ``X.weight`` has its block scales beside it as ``X.weight_scale_inv``
(transformers' name, and the FP8 releases of Qwen / Llama models) or ``X.scale``
(DeepSeek's upstream name); transformers' own FP8 save of MoE experts keeps one merged
scale per projection kind (``...experts.gate_up_proj_scale_inv [E, 2I/bn, H/bk]``,
``...experts.down_proj_scale_inv``), resolved by the architectures that have experts.
"""

from __future__ import annotations

from typing import Iterable

SCALE_SUFFIXES = (".weight_scale_inv", ".scale")
FP8_WEIGHT_DTYPES = ("F8_E4M3",)
FP4_WEIGHT_DTYPES = ("I8", "U8")
SCALE_DTYPES = ("F32", "F8_E8M0", "U8", "BF16", "F16")
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")


def scale_candidates(weight_name: str) -> tuple[str, ...]:
    """The names a weight's scale may have, in order of preference."""
    base = weight_name[: -len(".weight")] if weight_name.endswith(".weight") else weight_name
    return tuple(base + s for s in SCALE_SUFFIXES)


def find_scale(weight_name: str, present: Iterable[str] | object) -> str | None:
    """The stored name of ``weight_name``'s scale (None: none is stored). ``present``
    supports ``in`` (a set, or a Checkpoint)."""
    for cand in scale_candidates(weight_name):
        if cand in present:  # type: ignore[operator]
            return cand
    return None


def stored_kind(st_dtype: str, expert: bool, expert_dtype: str) -> str | None:
    """What a weight stored as ``st_dtype`` is: ``"fp8"``, ``"fp4"`` (a packed byte weight
    where the config declares FP4 experts) or None (a float weight)."""
    if st_dtype in FP8_WEIGHT_DTYPES:
        return "fp8"
    if st_dtype in FP4_WEIGHT_DTYPES and expert and expert_dtype == "fp4":
        return "fp4"
    return None


__all__ = [
    "FLOAT_DTYPES",
    "FP4_WEIGHT_DTYPES",
    "FP8_WEIGHT_DTYPES",
    "SCALE_DTYPES",
    "SCALE_SUFFIXES",
    "find_scale",
    "scale_candidates",
    "stored_kind",
]
