"""FP8 table rows: e4m3 values with one ue8m0 scale per block of 32.

The decoding goes through real dtypes (``ml_dtypes`` in NumPy,
``torch.float8_e4m3fn`` / ``torch.float8_e8m0fnu`` in PyTorch) rather than bit
tricks, so the reference inherits their NaN and subnormal handling. Tables live
as raw bytes (uint8) everywhere we move them (host memory, UVA, the kernels) and
are only viewed as FP8 here.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from engram_trt.errors import EngramError

FP8_E4M3_MAX = 448.0


def _check_shapes(fp8: Any, scale: Any, block: int) -> None:
    if fp8.shape[-1] % block:
        raise EngramError(f"FP8 row width {fp8.shape[-1]} is not a multiple of the quant block {block}")
    want = tuple(fp8.shape[:-1]) + (fp8.shape[-1] // block,)
    if tuple(scale.shape) != want:
        raise EngramError(
            f"scale shape {tuple(scale.shape)} does not match rows {tuple(fp8.shape)}: "
            f"expected {want} (one ue8m0 byte per {block} values)"
        )


def dequant_fp8_rows(fp8: Any, scale: Any, block: int = 32) -> np.ndarray:
    """NumPy float32 rows from FP8 e4m3 bytes ``[..., D]`` and ue8m0 bytes ``[..., D/block]``."""
    q = np.ascontiguousarray(fp8, dtype=np.uint8)
    s = np.ascontiguousarray(scale, dtype=np.uint8)
    _check_shapes(q, s, block)
    values = q.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    scales = s.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    return values * np.repeat(scales, block, axis=-1)


def dequant_fp8_rows_torch(fp8: Any, scale: Any, block: int = 32, dtype: Any = None) -> Any:
    """Torch rows (default bfloat16, as the GPU kernel produces) from FP8 + ue8m0 bytes."""
    import torch

    _check_shapes(fp8, scale, block)
    dtype = torch.bfloat16 if dtype is None else dtype
    values = fp8.contiguous().view(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
    scales = scale.contiguous().view(torch.uint8).view(torch.float8_e8m0fnu).to(torch.float32)
    return (values * scales.repeat_interleave(block, dim=-1)).to(dtype)


def quantize_fp8_rows(x: Any, block: int = 32) -> tuple[Any, Any]:
    """Quantize float rows ``[R, D]`` to (e4m3 bytes ``[R, D]``, ue8m0 bytes ``[R, D/block]``),
    both uint8 torch tensors.

    Each block's scale is the smallest power of two that brings its absolute max
    within e4m3's range (448), the ue8m0 convention of DeepSeek's FP8 checkpoints.
    """
    import torch

    x = torch.as_tensor(x, dtype=torch.float32)
    if x.ndim != 2 or x.shape[1] % block:
        raise EngramError(f"rows to quantize must be [R, D] with D a multiple of {block} (got {tuple(x.shape)})")
    blocks = x.reshape(x.shape[0], -1, block)
    amax = blocks.abs().amax(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)
    exponent = torch.ceil(torch.log2(amax / FP8_E4M3_MAX)).clamp(-127, 127)
    scale = torch.exp2(exponent)
    q = (blocks / scale[..., None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    scale_bytes = (exponent + 127).to(torch.uint8)
    return q.reshape(x.shape).view(torch.uint8), scale_bytes
