// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * The GEMV prologues (EngramGemvPrologue, decodeKernels.h) both segment GEMVs share: the
 * bf16 one (decodeGemvKernel.cu, engram_gemv_segments_bf16_ex) applies them to the x
 * values it reads, the stored-format one (quantDecodeKernel.cu,
 * engram_quant_gemv_segments_ex) to the rows it stages. One home for the arithmetic, so
 * both give engram_norm_rope's bits (decodeNormKernel.cu's register form: the same sum of
 * squares in the same order, the same float32 ops each rounded alone, the same bf16
 * roundings), and one for the host checks, so both refuse alike.
 */
#ifndef ENGRAM_TRT_GEMV_PROLOGUE_CUH
#define ENGRAM_TRT_GEMV_PROLOGUE_CUH

#include "decodeKernels.h"
#include "vecLoad.cuh"

#include <cuda_bf16.h>

#include <cstdint>

namespace engram_trt
{
namespace kernels
{

constexpr int kProNone = 0; // ENGRAM_GEMV_PROLOGUE_NONE, as a template argument
constexpr int kProNorm = 1; // ENGRAM_GEMV_PROLOGUE_RMSNORM
constexpr int kProRope = 2; // ENGRAM_GEMV_PROLOGUE_ROPE

//! The reciprocal RMS of token m's row x (dim values, bf16, 4-byte aligned) as
//! engram_norm_rope's register form makes it: lane l adds pairs l, l + 32, ... (squares
//! rounded, sums rounded), a butterfly, then rsqrt(sum / dim + eps). Every lane of the
//! warp calls it and gets the value.
__device__ __forceinline__ float rowReciprocalRms(__nv_bfloat16 const* x, int32_t dim, float eps, int lane)
{
    int32_t const pairs = dim / 2;
    float squares = 0.0F;
    for (int32_t base = 0; base < pairs; base += 32 * 4)
    {
        float2 pr[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) // the loads of four pairs before their sums
        {
            int32_t const q = base + lane + 32 * u;
            pr[u] = q < pairs ? unpackPair(reinterpret_cast<__nv_bfloat162 const*>(x)[q]) : make_float2(0.0F, 0.0F);
        }
#pragma unroll
        for (int u = 0; u < 4; ++u)
        {
            squares = __fadd_rn(squares, __fmul_rn(pr[u].x, pr[u].x));
            squares = __fadd_rn(squares, __fmul_rn(pr[u].y, pr[u].y));
        }
    }
    squares = warpSum(squares);
    return rsqrtf(__fadd_rn(__fdiv_rn(squares, static_cast<float>(dim)), eps));
}

/*
 * N consecutive values xf (N even, bf16 values as floats) of token m starting at channel
 * c0 of its row (c0 a multiple of N) through the prologue Pro, rounded to bf16 as
 * engram_norm_rope writes them: kProNorm y = bf16(w * (x * r)) (w the norm weight's N
 * values at c0, r the row's reciprocal RMS); kProRope the pairs of each head of pro.dim
 * channels at or past its leading pairs rotated by bf16(cos), rope_sign * bf16(sin).
 */
template <int Pro, int N>
__device__ __forceinline__ void applyPrologue(
    float (&xf)[N], float const (&w)[N], EngramGemvPrologue const& pro, float r, int64_t m, int32_t c0)
{
    if constexpr (Pro == kProNorm)
    {
#pragma unroll
        for (int i = 0; i < N; ++i)
        {
            xf[i] = roundTo<__nv_bfloat16>(__fmul_rn(w[i], __fmul_rn(xf[i], r)));
        }
    }
    else if constexpr (Pro == kProRope)
    {
        int32_t const pairs = pro.dim / 2;
        int32_t const lead = pairs - pro.rope_pairs;
        int32_t const q0 = (c0 % pro.dim) / 2; // head-local pair of xf[0]
        if (q0 + N / 2 - 1 >= lead)
        {
            float const* const cosRow = pro.cos + m * pro.cos_stride;
            float const* const sinRow = pro.sin + m * pro.cos_stride;
#pragma unroll
            for (int k = 0; k < N / 2; ++k)
            {
                int32_t const q = q0 + k;
                if (q >= lead)
                {
                    float const cr = roundTo<__nv_bfloat16>(cosRow[q - lead]);
                    float const sr = roundTo<__nv_bfloat16>(sinRow[q - lead]) * static_cast<float>(pro.rope_sign);
                    float const y0 = xf[2 * k];
                    float const y1 = xf[2 * k + 1];
                    xf[2 * k] = roundTo<__nv_bfloat16>(__fsub_rn(__fmul_rn(y0, cr), __fmul_rn(y1, sr)));
                    xf[2 * k + 1] = roundTo<__nv_bfloat16>(__fadd_rn(__fmul_rn(y1, cr), __fmul_rn(y0, sr)));
                }
            }
        }
    }
}

/*
 * The host checks of a prologue against the segments' in_features (count of them), for
 * the entry point fn: 0, or a failure (cudaErrorInvalidValue) naming the field, the value
 * and, for a segment's width, the segment. Kind NONE passes. RMSNORM: a 16-byte aligned
 * fp32 weight, a finite eps >= 0, an even dim of at most 2048 (the register form's rows,
 * whose sum order the prologue's is) equal to every segment's in_features. ROPE: dim a
 * positive multiple of 8, 0 <= 2 * rope_pairs <= dim, rope_sign +-1, cos / sin with
 * cos_stride >= rope_pairs when rope_pairs > 0, every in_features a multiple of dim
 * (decodeGemvKernel.cu).
 */
int checkGemvPrologue(char const* fn, EngramGemvPrologue const& pro, int32_t count, int32_t const* inFeatures);

} // namespace kernels
} // namespace engram_trt

#endif // ENGRAM_TRT_GEMV_PROLOGUE_CUH
