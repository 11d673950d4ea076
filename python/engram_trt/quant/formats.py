"""The stored number formats, decoded and encoded in PyTorch (and float64 for the
references): FP8 E4M3 values, E8M0 (ue8m0) power-of-two scales, FP4 E2M1 values packed two
a byte (low nibble first), block-scaled weights, and the dynamic activation quantization
the published FP8 inference applies (per token and group of columns).

These are the formats' definitions for the CPU path and the tests; the GPU computes
them in the kernel library (plugins/kernels/quantKernels.h), which the GPU tests hold to
these functions.
"""

from __future__ import annotations

import math

import torch

from engram_trt.errors import EngramError

FP8_MAX = 448.0
ACT_AMAX_FLOOR = 1e-4
# e2m1 code -> value: codes 0..7 = 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def e8m0_to_float(scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """ue8m0 bytes (uint8 or float8_e8m0fnu) -> 2^(byte - 127) (byte 255: NaN)."""
    b = scale.contiguous().view(torch.uint8).to(torch.int32)
    out = torch.exp2((b - 127).to(torch.float64)).to(dtype)
    return torch.where(b == 255, torch.full_like(out, float("nan")), out)


def scale_to_float(scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Block scales as floats: ue8m0 bytes decoded, float scales widened."""
    if scale.dtype in (torch.uint8, torch.float8_e8m0fnu):
        return e8m0_to_float(scale, dtype)
    return scale.to(dtype)


def e4m3_to_float(q: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """E4M3 bytes (uint8 or float8_e4m3fn) -> values (exact in float32)."""
    return q.contiguous().view(torch.uint8).view(torch.float8_e4m3fn).to(dtype)


def unpack_fp4(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed E2M1 ``[..., K/2]`` (int8 / uint8) -> values ``[..., K]``, element 2j from
    bits 0-3 and 2j+1 from bits 4-7."""
    u = packed.contiguous().view(torch.uint8)
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float64, device=u.device)
    low, high = (u & 0xF).long(), (u >> 4).long()
    return torch.stack([lut[low], lut[high]], dim=-1).reshape(*u.shape[:-1], 2 * u.shape[-1]).to(dtype)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes ``[..., K]`` (ints 0..15, K even) -> packed uint8 ``[..., K/2]``."""
    if codes.shape[-1] % 2:
        raise EngramError(f"FP4 rows need an even number of values (got {codes.shape[-1]})")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).contiguous()


def expand_blocks(scale: torch.Tensor, rows: int, cols: int, bn: int, bk: int) -> torch.Tensor:
    """Per-block values ``[..., ceil(rows/bn), ceil(cols/bk)]`` spread over ``[..., rows, cols]``
    (the last block of a dimension partial)."""
    s = scale.repeat_interleave(bn, dim=-2)[..., :rows, :]
    return s.repeat_interleave(bk, dim=-1)[..., :cols]


def scale_grid(rows: int, cols: int, bn: int, bk: int) -> tuple[int, int]:
    """The scale shape of a ``[rows, cols]`` weight in ``(bn, bk)`` blocks."""
    return -(-rows // bn), -(-cols // bk)


def dequantize_fp8(
    q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``W = e4m3(q) * scale[block]`` of an FP8 weight ``[..., N, K]`` (float32 math, float64
    when ``dtype`` is float64; exact there), cast to ``dtype``."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    rows, cols = q.shape[-2], q.shape[-1]
    w = e4m3_to_float(q, work) * expand_blocks(scale_to_float(scale, work), rows, cols, *block)
    return w.to(dtype)


def dequantize_fp4(
    packed: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (1, 32), dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``W = e2m1 * scale[block]`` of an FP4 weight stored ``[..., N, K/2]`` -> ``[..., N, K]``."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    v = unpack_fp4(packed, work)
    rows, cols = v.shape[-2], v.shape[-1]
    return (v * expand_blocks(scale_to_float(scale, work), rows, cols, *block)).to(dtype)


def _pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= x (x > 0), exactly: x itself when its mantissa is 1/2
    (``frexp``: x = m 2^e, m in [1/2, 1)), else 2^e. (``exp2(ceil(log2(x)))`` is not exact:
    a float32 log2 rounds x slightly above a power of two down to the integer, and the
    result falls below x.)"""
    m, e = torch.frexp(x)
    return torch.where(m == 0.5, x, torch.ldexp(torch.ones_like(x), e))


def act_quant(
    x: torch.Tensor, group: int = 128, ue8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dynamic activation quantization per row and ``group`` columns (quantKernels.h's
    engram_act_quant): ``(q float8_e4m3fn [M, K], scale float32 [M, ceil(K/group)],
    deq float32 [M, K])`` with ``s = max(amax, 1e-4) / 448`` (a power of two rounded up
    with ``ue8m0``) and ``q = e4m3(x * (1/s))``."""
    xf = x.to(torch.float32)
    K = xf.shape[-1]
    G = -(-K // group)
    pad = G * group - K
    xp = torch.nn.functional.pad(xf, (0, pad)) if pad else xf
    amax = xp.reshape(*xf.shape[:-1], G, group).abs().amax(dim=-1)
    s = torch.clamp(amax, min=ACT_AMAX_FLOOR) / FP8_MAX
    if ue8m0:
        s = _pow2_ceil(s)
    inv = (1.0 / s).to(torch.float32)
    scaled = xf * inv.repeat_interleave(group, dim=-1)[..., :K]
    q = torch.clamp(scaled, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    deq = q.to(torch.float32) * s.repeat_interleave(group, dim=-1)[..., :K]
    return q, s, deq


def quantize_fp8(
    w: torch.Tensor, block: tuple[int, int] = (128, 128), scale_fmt: str = "float"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a float weight ``[..., N, K]`` into (e4m3 ``float8_e4m3fn``, scales
    ``[..., ceil(N/bn), ceil(K/bk)]``): float32 ``amax / 448`` per block, or with ``ue8m0``
    the power of two at or above it (stored as ``float8_e8m0fnu``). Partial last blocks are
    scaled over the values they hold. For writing test and benchmark checkpoints."""
    bn, bk = block
    wf = w.to(torch.float32)
    N, K = wf.shape[-2], wf.shape[-1]
    gn, gk = scale_grid(N, K, bn, bk)
    padded = torch.nn.functional.pad(wf, (0, gk * bk - K, 0, gn * bn - N))
    tiles = padded.reshape(*wf.shape[:-2], gn, bn, gk, bk)
    amax = tiles.abs().amax(dim=(-3, -1))
    s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    if scale_fmt == "ue8m0":
        s = _pow2_ceil(s)
    q = torch.clamp(wf / expand_blocks(s, N, K, bn, bk), -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    if scale_fmt == "ue8m0":
        exp = torch.log2(s).round().to(torch.int32) + 127
        return q, exp.clamp(0, 254).to(torch.uint8).view(torch.float8_e8m0fnu)
    return q, s.to(torch.float32)


def quantize_fp4(w: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a float weight ``[..., N, K]`` (K a multiple of ``group``) into (packed e2m1
    ``int8 [..., N, K/2]``, ue8m0 scales ``float8_e8m0fnu [..., N, K/group]``): each group
    scaled by the power of two that brings its amax within 6, values rounded to the
    nearest e2m1 value (ties to the even code). For test and benchmark checkpoints."""
    wf = w.to(torch.float32)
    K = wf.shape[-1]
    if K % group:
        raise EngramError(f"FP4 rows of {K} values do not divide into groups of {group}")
    g = wf.reshape(*wf.shape[:-1], K // group, group)
    amax = g.abs().amax(dim=-1)
    s = torch.where(amax > 0, _pow2_ceil(amax / 6.0), torch.ones_like(amax))
    x = (g / s.unsqueeze(-1)).reshape(wf.shape)
    grid = torch.tensor(E2M1_VALUES[:8], dtype=torch.float32, device=wf.device)
    mag = x.abs().clamp(max=6.0)
    dist = (mag.unsqueeze(-1) - grid).abs()
    # nearest magnitude, a tie to the even code (round half to even on the 1-bit mantissa)
    code = torch.argmin(dist + (torch.arange(8, device=wf.device) % 2).to(torch.float32) * 1e-6, dim=-1)
    codes = code | ((x < 0) & (code > 0)).to(torch.int64) << 3
    exp = torch.log2(s).round().to(torch.int32) + 127
    return pack_fp4(codes).view(torch.int8), exp.clamp(0, 254).to(torch.uint8).view(torch.float8_e8m0fnu)


def fp8_rel_step() -> float:
    """The relative rounding step of E4M3 (3 mantissa bits): a value rounds within half of it."""
    return 2.0**-3


def log2_ceil(x: float) -> int:
    return int(math.ceil(math.log2(x)))


__all__ = [
    "ACT_AMAX_FLOOR",
    "E2M1_VALUES",
    "FP8_MAX",
    "act_quant",
    "dequantize_fp4",
    "dequantize_fp8",
    "e4m3_to_float",
    "e8m0_to_float",
    "expand_blocks",
    "pack_fp4",
    "quantize_fp4",
    "quantize_fp8",
    "scale_grid",
    "scale_to_float",
    "unpack_fp4",
]
