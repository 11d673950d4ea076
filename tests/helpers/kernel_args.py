"""Argument structs of the kernel library's C entry points, built for the binding tests'
refusal checks (no GPU: nothing is launched, the addresses are never dereferenced)."""

from __future__ import annotations

from typing import Any


def gemv_prologue(**change: Any) -> Any:
    """An ``EngramGemvPrologue`` (``native.decode._GemvPrologue``): a weighted RMSNorm, every
    field given by ``change`` taking the default's place (``dim`` and ``weight``, a
    stand-in address, among them)."""
    from engram_trt.native import decode

    fields: dict[str, Any] = dict(
        kind=decode.PROLOGUE_RMSNORM,
        dim=0,
        rope_pairs=0,
        rope_sign=1,
        eps=1e-6,
        reserved=0,
        weight=None,
        cos=None,
        sin=None,
        cos_stride=0,
    )
    fields.update(change)
    return decode._GemvPrologue(**fields)
