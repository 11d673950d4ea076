"""What a load of a checkpoint's weights takes: each weight's stored format, its bytes in
the checkpoint and on the GPU (``ModelArchitecture.weight_formats``; ``engram-trt
inspect`` sums it).

:func:`generic_weight_formats` is the default of an architecture that reads its weights
as float tensors in the serving dtype: ``float`` weights take ``numel x itemsize(dtype)``
on the GPU, integer tensors their stored bytes, an ``F8_E4M3`` weight (with the scale
beside it, :func:`engram_trt.quant.names.find_scale`) its stored bytes, the way a load
in the stored format takes it. An architecture that loads otherwise (DeepSeek-V4's
float32-kept norms and mHC, its FP4 experts: :meth:`DeepseekV4Architecture.weight_formats`)
answers itself.
"""

from __future__ import annotations

from typing import Any

from engram_trt.quant.names import FP8_WEIGHT_DTYPES, find_scale

FLOAT_ST_DTYPES = ("F64", "F32", "F16", "BF16")
_ITEMSIZE = {"bf16": 2, "fp16": 2, "fp32": 4}


def dtype_itemsize(dtype: Any) -> int:
    """Bytes per element of a serving dtype given as a short name (``bf16``) or a torch dtype."""
    if isinstance(dtype, str):
        return _ITEMSIZE[dtype]
    import torch

    return torch.empty((), dtype=dtype).element_size()


def stored_kind(st_dtype: str) -> str:
    """``fp8``, ``float`` or ``int`` (packed ``I8`` bytes are ``fp4`` only where an
    architecture says its experts are FP4: it answers itself)."""
    if st_dtype in FP8_WEIGHT_DTYPES:
        return "fp8"
    return "float" if st_dtype in FLOAT_ST_DTYPES else "int"


def generic_weight_formats(arch: Any, ckpt: Any, dtype: Any = "bf16") -> dict[str, tuple[str, int, int]]:
    """Stored name -> ``(kind, stored bytes, GPU bytes at dtype)`` of each weight
    ``arch.weight_shapes(ckpt.config)`` names that the checkpoint holds (module docstring)."""
    itemsize = dtype_itemsize(dtype or "bf16")
    out: dict[str, tuple[str, int, int]] = {}
    for name, shape in arch.weight_shapes(ckpt.config).items():
        if name not in ckpt:
            continue
        st = ckpt.st_dtype(name)
        kind = stored_kind(st)
        stored = int(ckpt.nbytes(name))
        if kind == "fp8":
            scale = find_scale(name, ckpt)
            stored += int(ckpt.nbytes(scale)) if scale is not None else 0
            out[name] = (kind, stored, stored)
        elif kind == "float":
            n = 1
            for d in shape:
                n *= int(d)
            out[name] = (kind, stored, n * itemsize)
        else:
            out[name] = (kind, stored, stored)
    return out


__all__ = ["dtype_itemsize", "generic_weight_formats", "stored_kind"]
