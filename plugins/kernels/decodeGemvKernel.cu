// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * Several bf16 matrix-vector products of a decode step in ONE launch
 * (engram_gemv_segments_bf16; engramKernels.h states the contract): the projections a
 * layer applies to the same input (DeepSeek-V4's q_a / kv / compressor / indexer
 * projections of x; the router and the shared expert's gate / up), or to slices of one
 * (the grouped output projection o_a: group g of the heads against its own block of
 * rows). Each projection is a segment: its own x (with a row stride), weight [N, K] and
 * out (with a row stride). Warps own output rows across the segments in order.
 *
 * Per warp the product is gemvKernel.cu's (one row of W, 16-byte streaming loads, 4 a
 * lane before the first FMA, float32 sums per lane in k order then a warp butterfly,
 * rounded once to bf16), so a segment's output equals engram_gemv_bf16's on the same
 * operands. With ENGRAM_GEMV_WEIGHT_STATIC the first pass's weight loads go out before
 * the kernel waits for the one before it (dependentLaunch.cuh).
 */
#include "decodeKernels.h"
#include "dependentLaunch.cuh"
#include "engramKernelsInternal.h"
#include "gemvKernels.h"
#include "gemvPrologue.cuh"
#include "vecLoad.cuh"

#include <cuda_bf16.h>

#include <climits>
#include <cmath>
#include <cstdint>

namespace engram_trt
{
namespace kernels
{

namespace
{

constexpr int kSegThreads = 128;

struct Segments
{
    EngramGemvSegment seg[ENGRAM_GEMV_MAX_SEGMENTS];
    int32_t firstRow[ENGRAM_GEMV_MAX_SEGMENTS + 1]; // global row of each segment's row 0, then the total
    int32_t count;
};

//! x's 8 values at vector v of token m after the prologue (Pro), as bf16-rounded floats.
template <int Pro>
__device__ __forceinline__ void prologueX(
    uint4 raw, EngramGemvPrologue const& pro, float r, int64_t m, int32_t v, float (&xf)[8])
{
    unpack8Pairs<__nv_bfloat162>(raw, xf);
    float w[8] = {};
    if constexpr (Pro == kProNorm)
    {
        load8(pro.weight + 8 * static_cast<int64_t>(v), w);
    }
    applyPrologue<Pro, 8>(xf, w, pro, r, m, 8 * v);
}

template <int M, int Pro>
__global__ void __launch_bounds__(kSegThreads)
    gemvSegmentsKernel(Segments const segs, bool weightStatic, EngramGemvPrologue const pro)
{
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900 // no code for older GPUs (refused on the host)
    constexpr int U = 4;
    if (!weightStatic)
    {
        waitForPrimary();
        allowDependents();
    }
    int const lane = threadIdx.x & 31;
    int32_t const global = static_cast<int32_t>((static_cast<int64_t>(blockIdx.x) * kSegThreads + threadIdx.x) >> 5);
    if (global >= segs.firstRow[segs.count])
    {
        if (weightStatic)
        {
            waitForPrimary(); // keep the chain's discipline: no allow before the wait
            allowDependents();
        }
        return;
    }
    int s = 0;
    while (s + 1 < segs.count && global >= segs.firstRow[s + 1])
    {
        ++s;
    }
    EngramGemvSegment const& g = segs.seg[s];
    int64_t const row = global - segs.firstRow[s];
    int32_t const vectors = g.in_features / 8;
    auto const* const wv
        = reinterpret_cast<uint4 const*>(static_cast<__nv_bfloat16 const*>(g.weight) + row * g.in_features);
    auto const* const xv = reinterpret_cast<uint4 const*>(g.x);
    int64_t const xStrideVectors = g.x_stride / 8;
    float acc[M];
    float rms[M];
#pragma unroll
    for (int m = 0; m < M; ++m)
    {
        acc[m] = 0.0F;
        rms[m] = 1.0F;
    }
    for (int32_t base = 0; base < vectors; base += 32 * U)
    {
        uint4 wr[U];
#pragma unroll
        for (int u = 0; u < U; ++u)
        {
            int32_t const v = base + lane + 32 * u;
            wr[u] = v < vectors ? loadStreaming(wv + v) : make_uint4(0, 0, 0, 0);
        }
        if (weightStatic && base == 0)
        {
            waitForPrimary(); // x (and out) may come from the kernel before
            allowDependents();
        }
        if constexpr (Pro == kProNorm)
        {
            if (base == 0)
            {
#pragma unroll
                for (int m = 0; m < M; ++m)
                {
                    rms[m] = rowReciprocalRms(
                        static_cast<__nv_bfloat16 const*>(g.x) + m * g.x_stride, g.in_features, pro.eps, lane);
                }
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u)
        {
            int32_t const v = base + lane + 32 * u;
            if (v >= vectors)
            {
                break;
            }
            float wf[8];
            unpack8Pairs<__nv_bfloat162>(wr[u], wf);
#pragma unroll
            for (int m = 0; m < M; ++m)
            {
                float xf[8];
                prologueX<Pro>(__ldg(xv + m * xStrideVectors + v), pro, rms[m], m, v, xf);
#pragma unroll
                for (int i = 0; i < 8; ++i)
                {
                    acc[m] = fmaf(wf[i], xf[i], acc[m]);
                }
            }
        }
    }
#pragma unroll
    for (int m = 0; m < M; ++m)
    {
        acc[m] = warpSum(acc[m]);
    }
    if (lane == 0)
    {
        auto* const y = static_cast<__nv_bfloat16*>(g.out);
#pragma unroll
        for (int m = 0; m < M; ++m)
        {
            y[m * g.out_stride + row] = __float2bfloat16_rn(acc[m]);
        }
    }
#endif
}

template <int M, int Pro = kProNone>
void launchSegments(Segments const& segs, bool weightStatic, cudaStream_t stream, EngramGemvPrologue const& pro = {})
{
    int64_t const rows = segs.firstRow[segs.count];
    int64_t const blocks = (rows * 32 + kSegThreads - 1) / kSegThreads; // a warp per row
    launchDependent(gemvSegmentsKernel<M, Pro>, dim3(static_cast<unsigned>(blocks)), dim3(kSegThreads), 0, stream, segs,
        weightStatic, pro);
}

template <int Pro>
void launchSegmentsEx(
    Segments const& segs, int64_t numTokens, bool weightStatic, EngramGemvPrologue const& pro, cudaStream_t stream)
{
    switch (numTokens)
    {
    case 1: launchSegments<1, Pro>(segs, weightStatic, stream, pro); break;
    case 2: launchSegments<2, Pro>(segs, weightStatic, stream, pro); break;
    case 3: launchSegments<3, Pro>(segs, weightStatic, stream, pro); break;
    case 4: launchSegments<4, Pro>(segs, weightStatic, stream, pro); break;
    case 5: launchSegments<5, Pro>(segs, weightStatic, stream, pro); break;
    case 6: launchSegments<6, Pro>(segs, weightStatic, stream, pro); break;
    case 7: launchSegments<7, Pro>(segs, weightStatic, stream, pro); break;
    default: launchSegments<8, Pro>(segs, weightStatic, stream, pro); break;
    }
}

int checkSegment(EngramGemvSegment const& g, int32_t index, int64_t numTokens)
{
    char const* const fn = "engram_gemv_segments_bf16";
    if (g.out_features < 1 || g.in_features < 8 || g.in_features % 8 != 0)
    {
        return fail(cudaErrorInvalidValue,
            "%s: segment %d: need out_features >= 1 and in_features a positive multiple of 8 (got %d, %d)", fn, index,
            g.out_features, g.in_features);
    }
    if (g.x_stride < g.in_features || g.x_stride % 8 != 0 || g.out_stride < g.out_features)
    {
        return fail(cudaErrorInvalidValue,
            "%s: segment %d: x_stride must be a multiple of 8 and >= in_features, out_stride >= out_features (got "
            "%lld, %lld)",
            fn, index, ll(g.x_stride), ll(g.out_stride));
    }
    if (g.x == nullptr || g.weight == nullptr || g.out == nullptr || !isAligned(g.x, 16) || !isAligned(g.weight, 16)
        || !isAligned(g.out, 2))
    {
        return fail(cudaErrorInvalidValue,
            "%s: segment %d: x and weight must be 16-byte aligned device pointers, out a bf16 one", fn, index);
    }
    int64_t const outBytes = ((numTokens - 1) * g.out_stride + g.out_features) * 2;
    int64_t const xBytes = ((numTokens - 1) * g.x_stride + g.in_features) * 2;
    if (overlaps(g.out, outBytes, g.x, xBytes)
        || overlaps(g.out, outBytes, g.weight, static_cast<int64_t>(g.out_features) * g.in_features * 2))
    {
        return fail(cudaErrorInvalidValue, "%s: segment %d: out must not overlap x or weight", fn, index);
    }
    return 0;
}

} // namespace

} // namespace kernels
} // namespace engram_trt

using namespace engram_trt::kernels;

extern "C" ENGRAM_API int engram_gemv_segments_bf16(
    EngramGemvSegment const* segments, int32_t numSegments, int64_t numTokens, uint32_t flags, cudaStream_t stream)
{
    clearError();
    char const* const fn = "engram_gemv_segments_bf16";
    if (segments == nullptr || numSegments < 1 || numSegments > ENGRAM_GEMV_MAX_SEGMENTS)
    {
        return fail(cudaErrorInvalidValue, "%s: need 1 <= num_segments <= %d (got %d)", fn, ENGRAM_GEMV_MAX_SEGMENTS,
            numSegments);
    }
    if (numTokens < 0 || numTokens > ENGRAM_GEMV_MAX_TOKENS)
    {
        return fail(cudaErrorInvalidValue, "%s: num_tokens must be in [0, %d] (got %lld)", fn, ENGRAM_GEMV_MAX_TOKENS,
            ll(numTokens));
    }
    if ((flags & ~static_cast<uint32_t>(ENGRAM_GEMV_WEIGHT_STATIC)) != 0)
    {
        return fail(cudaErrorInvalidValue, "%s: unknown flags 0x%x (the one flag is ENGRAM_GEMV_WEIGHT_STATIC = 0x%x)",
            fn, flags, static_cast<unsigned>(ENGRAM_GEMV_WEIGHT_STATIC));
    }
    Segments segs{};
    segs.count = numSegments;
    int64_t rows = 0;
    for (int32_t i = 0; i < numSegments; ++i)
    {
        if (numTokens > 0)
        {
            int const status = checkSegment(segments[i], i, numTokens);
            if (status != 0)
            {
                return status;
            }
        }
        segs.seg[i] = segments[i];
        segs.firstRow[i] = static_cast<int32_t>(rows);
        rows += segments[i].out_features;
        if (rows > INT32_MAX / 32)
        {
            return fail(cudaErrorInvalidValue, "%s: the segments hold more than 2^26 output rows", fn);
        }
    }
    segs.firstRow[numSegments] = static_cast<int32_t>(rows);
    if (numTokens == 0)
    {
        return 0;
    }
    int const major = computeCapabilityMajor();
    if (major >= 0 && major < 9)
    {
        return fail(cudaErrorNotSupported,
            "%s: needs a GPU of compute capability 9.0 or later (this one is %d.x); use the GEMM library (F.linear)",
            fn, major);
    }
    bool const weightStatic = (flags & ENGRAM_GEMV_WEIGHT_STATIC) != 0;
    resetLaunchError();
    switch (numTokens)
    {
    case 1: launchSegments<1>(segs, weightStatic, stream); break;
    case 2: launchSegments<2>(segs, weightStatic, stream); break;
    case 3: launchSegments<3>(segs, weightStatic, stream); break;
    default: launchSegments<4>(segs, weightStatic, stream); break;
    }
    return checkLaunch(fn);
}

int engram_trt::kernels::checkGemvPrologue(
    char const* fn, EngramGemvPrologue const& pro, int32_t count, int32_t const* inFeatures)
{
    if (pro.kind == ENGRAM_GEMV_PROLOGUE_NONE)
    {
        return 0;
    }
    if (pro.kind == ENGRAM_GEMV_PROLOGUE_RMSNORM)
    {
        if (pro.weight == nullptr || !isAligned(pro.weight, 16) || !std::isfinite(pro.eps) || pro.eps < 0.0F
            || pro.dim < 2 || pro.dim % 2 != 0)
        {
            return fail(cudaErrorInvalidValue,
                "%s: the RMSNorm prologue needs a 16-byte aligned fp32 weight, a finite eps >= 0 and an even dim "
                "(got eps %g, dim %d)",
                fn, static_cast<double>(pro.eps), pro.dim);
        }
        if (pro.dim > 2048)
        {
            return fail(cudaErrorInvalidValue,
                "%s: the RMSNorm prologue sums rows of at most 2048 values (engram_norm_rope's register form; got "
                "dim %d)",
                fn, pro.dim);
        }
        for (int32_t i = 0; i < count; ++i)
        {
            if (inFeatures[i] != pro.dim)
            {
                return fail(cudaErrorInvalidValue,
                    "%s: segment %d: the RMSNorm prologue normalizes whole rows: in_features must be dim %d (got %d)",
                    fn, i, pro.dim, inFeatures[i]);
            }
        }
        return 0;
    }
    if (pro.kind == ENGRAM_GEMV_PROLOGUE_ROPE)
    {
        if (pro.dim < 8 || pro.dim % 8 != 0 || pro.rope_pairs < 0 || 2 * pro.rope_pairs > pro.dim
            || (pro.rope_sign != 1 && pro.rope_sign != -1))
        {
            return fail(cudaErrorInvalidValue,
                "%s: the RoPE prologue needs dim a positive multiple of 8, 0 <= 2 * rope_pairs <= dim and rope_sign "
                "+-1 (got dim %d, rope_pairs %d, rope_sign %d)",
                fn, pro.dim, pro.rope_pairs, pro.rope_sign);
        }
        if (pro.rope_pairs > 0 && (pro.cos == nullptr || pro.sin == nullptr || pro.cos_stride < pro.rope_pairs))
        {
            return fail(cudaErrorInvalidValue,
                "%s: the RoPE prologue needs cos / sin [tokens, >= rope_pairs] fp32 (got cos_stride %lld)", fn,
                ll(pro.cos_stride));
        }
        for (int32_t i = 0; i < count; ++i)
        {
            if (inFeatures[i] % pro.dim != 0)
            {
                return fail(cudaErrorInvalidValue,
                    "%s: segment %d: the RoPE prologue rotates whole heads: in_features must be a multiple of dim %d "
                    "(got %d)",
                    fn, i, pro.dim, inFeatures[i]);
            }
        }
        return 0;
    }
    return fail(cudaErrorInvalidValue, "%s: prologue kind %d is not NONE (0), RMSNORM (1) or ROPE (2)", fn, pro.kind);
}

extern "C" ENGRAM_API int engram_gemv_segments_bf16_ex(EngramGemvSegment const* segments, int32_t numSegments,
    int64_t numTokens, uint32_t flags, EngramGemvPrologue const* prologue, cudaStream_t stream)
{
    clearError();
    char const* const fn = "engram_gemv_segments_bf16_ex";
    if (segments == nullptr || numSegments < 1 || numSegments > ENGRAM_GEMV_MAX_SEGMENTS)
    {
        return fail(cudaErrorInvalidValue, "%s: need 1 <= num_segments <= %d (got %d)", fn, ENGRAM_GEMV_MAX_SEGMENTS,
            numSegments);
    }
    if (numTokens < 0 || numTokens > ENGRAM_GEMV_EX_MAX_TOKENS)
    {
        return fail(cudaErrorInvalidValue, "%s: num_tokens must be in [0, %d] (got %lld)", fn,
            ENGRAM_GEMV_EX_MAX_TOKENS, ll(numTokens));
    }
    if ((flags & ~static_cast<uint32_t>(ENGRAM_GEMV_WEIGHT_STATIC)) != 0)
    {
        return fail(cudaErrorInvalidValue, "%s: unknown flags 0x%x (the one flag is ENGRAM_GEMV_WEIGHT_STATIC = 0x%x)",
            fn, flags, static_cast<unsigned>(ENGRAM_GEMV_WEIGHT_STATIC));
    }
    Segments segs{};
    segs.count = numSegments;
    int64_t rows = 0;
    for (int32_t i = 0; i < numSegments; ++i)
    {
        if (numTokens > 0)
        {
            int const status = checkSegment(segments[i], i, numTokens);
            if (status != 0)
            {
                return status;
            }
        }
        segs.seg[i] = segments[i];
        segs.firstRow[i] = static_cast<int32_t>(rows);
        rows += segments[i].out_features;
        if (rows > INT32_MAX / 32)
        {
            return fail(cudaErrorInvalidValue, "%s: the segments hold more than 2^26 output rows", fn);
        }
    }
    segs.firstRow[numSegments] = static_cast<int32_t>(rows);
    EngramGemvPrologue const pro = prologue != nullptr ? *prologue : EngramGemvPrologue{};
    int32_t inFeatures[ENGRAM_GEMV_MAX_SEGMENTS] = {};
    for (int32_t i = 0; i < numSegments; ++i)
    {
        inFeatures[i] = segs.seg[i].in_features;
    }
    int const status = checkGemvPrologue(fn, pro, numSegments, inFeatures);
    if (status != 0 || numTokens == 0)
    {
        return status;
    }
    int const major = computeCapabilityMajor();
    if (major >= 0 && major < 9)
    {
        return fail(cudaErrorNotSupported,
            "%s: needs a GPU of compute capability 9.0 or later (this one is %d.x); use the GEMM library (F.linear)",
            fn, major);
    }
    bool const weightStatic = (flags & ENGRAM_GEMV_WEIGHT_STATIC) != 0;
    resetLaunchError();
    switch (pro.kind)
    {
    case ENGRAM_GEMV_PROLOGUE_RMSNORM: launchSegmentsEx<kProNorm>(segs, numTokens, weightStatic, pro, stream); break;
    case ENGRAM_GEMV_PROLOGUE_ROPE: launchSegmentsEx<kProRope>(segs, numTokens, weightStatic, pro, stream); break;
    default: launchSegmentsEx<kProNone>(segs, numTokens, weightStatic, pro, stream); break;
    }
    return checkLaunch(fn);
}
