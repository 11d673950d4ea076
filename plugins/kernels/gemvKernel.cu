// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * The decode step's projections for a few tokens: y[M, N] = x[M, K] W[N, K]^T, bf16 in
 * and out, float32 sums (engramKernels.h states the contract).
 *
 * Why a kernel of our own: a decode step of one sequence is a matrix-vector product per
 * projection, bound by reading W once. The GEMM library's small-M kernels read a 1B
 * model's 8-46 MB per-layer matrices at 40-80% of the HBM copy rate on the H200 (and add
 * a split-K reduction kernel to some), which made the projections half of the step.
 *
 * Layout: one warp owns a row of W; its lanes read it in 16-byte vectors (lane j takes
 * vectors j, j + 32, ...), 4 vectors a lane per pass, all issued before the first FMA.
 * W is read with an L1-bypassing streaming load (read once); x (at most 4 tokens) comes
 * through the L1, which every warp of a block shares. Each lane keeps M float32 partial
 * sums; a butterfly over the warp finishes them and lane 0 writes the rounded outputs.
 * (Two and four rows a warp, and 8 vectors a pass, were measured no faster on the H200:
 * docs/benchmarks.md.) Built for sm_90 and later only, where it was measured: the entry
 * point refuses older GPUs, whose callers keep the GEMM library.
 *
 * With ENGRAM_GEMV_WEIGHT_STATIC the kernel is scheduled while the kernel before it still
 * runs (dependentLaunch.cuh) and its first pass's weight loads go out before it waits for
 * that kernel: a layer's weights never depend on the step.
 */
#include "dependentLaunch.cuh"
#include "engramKernelsInternal.h"
#include "gemvKernels.h"
#include "vecLoad.cuh"

#include <cuda_bf16.h>

#include <cstdint>

namespace engram_trt
{
namespace kernels
{

constexpr int kGemvThreads = 128;

namespace
{

//! M tokens; one row of W per warp, U = 4 16-byte vectors of it per lane per pass.
template <int M>
__global__ void __launch_bounds__(kGemvThreads) gemvBf16Kernel(__nv_bfloat16 const* __restrict__ x,
    __nv_bfloat16 const* __restrict__ w, int32_t n, int32_t k, bool weightStatic, __nv_bfloat16* __restrict__ y)
{
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900 // no code for older GPUs (refused on the host)
    constexpr int U = 4;                            // 16-byte vectors of the row a lane loads before its first FMA
    if (!weightStatic)
    {
        waitForPrimary(); // dependentLaunch.cuh
        allowDependents();
    }
    int const lane = threadIdx.x & 31;
    int64_t const row = (static_cast<int64_t>(blockIdx.x) * kGemvThreads + threadIdx.x) >> 5; // the warp's
    if (row >= n)
    {
        return;
    }
    int32_t const vectors = k / 8;
    auto const* const xv = reinterpret_cast<uint4 const*>(x);
    auto const* const wv = reinterpret_cast<uint4 const*>(w + row * k);
    float acc[M];
#pragma unroll
    for (int m = 0; m < M; ++m)
    {
        acc[m] = 0.0F;
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
            // The first pass's weight loads are in flight; x (and y) wait for the kernel
            // before, which may still be running (dependentLaunch.cuh).
            waitForPrimary();
            allowDependents();
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
                unpack8Pairs<__nv_bfloat162>(__ldg(xv + static_cast<int64_t>(m) * vectors + v), xf);
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
#pragma unroll
        for (int m = 0; m < M; ++m)
        {
            y[static_cast<int64_t>(m) * n + row] = __float2bfloat16_rn(acc[m]);
        }
    }
#endif
}

template <int M>
void launchGemv(__nv_bfloat16 const* x, __nv_bfloat16 const* w, int32_t n, int32_t k, bool weightStatic,
    __nv_bfloat16* y, cudaStream_t stream)
{
    int64_t const blocks = (static_cast<int64_t>(n) * 32 + kGemvThreads - 1) / kGemvThreads; // a warp per row
    launchDependent(gemvBf16Kernel<M>, dim3(static_cast<unsigned>(blocks)), dim3(kGemvThreads), 0, stream, x, w, n, k,
        weightStatic, y);
}

} // namespace

} // namespace kernels
} // namespace engram_trt

using namespace engram_trt::kernels;

extern "C" ENGRAM_API int engram_gemv_bf16(void const* x, void const* weight, int64_t numTokens, int64_t outFeatures,
    int64_t inFeatures, uint32_t flags, void* out, cudaStream_t stream)
{
    clearError();
    if (numTokens < 0 || numTokens > ENGRAM_GEMV_MAX_TOKENS)
    {
        return fail(cudaErrorInvalidValue, "engram_gemv_bf16: num_tokens must be in [0, %d] (got %lld)",
            ENGRAM_GEMV_MAX_TOKENS, static_cast<long long>(numTokens));
    }
    if (outFeatures < 1 || outFeatures > INT32_MAX || inFeatures < 8 || inFeatures > INT32_MAX || inFeatures % 8 != 0)
    {
        return fail(cudaErrorInvalidValue,
            "engram_gemv_bf16: need 1 <= out_features <= 2^31 - 1 and in_features a multiple of 8 in "
            "[8, 2^31 - 1] (got %lld, %lld)",
            static_cast<long long>(outFeatures), static_cast<long long>(inFeatures));
    }
    if ((flags & ~static_cast<uint32_t>(ENGRAM_GEMV_WEIGHT_STATIC)) != 0)
    {
        return fail(cudaErrorInvalidValue,
            "engram_gemv_bf16: unknown flags 0x%x (the one flag is ENGRAM_GEMV_WEIGHT_STATIC = 0x%x)", flags,
            static_cast<unsigned>(ENGRAM_GEMV_WEIGHT_STATIC));
    }
    if (static_cast<double>(outFeatures) * static_cast<double>(inFeatures) > 4.0e18)
    {
        return fail(cudaErrorInvalidValue, "engram_gemv_bf16: weight [%lld, %lld] is too large",
            static_cast<long long>(outFeatures), static_cast<long long>(inFeatures));
    }
    if (numTokens == 0)
    {
        return 0;
    }
    void const* required[] = {x, weight, out};
    for (void const* p : required)
    {
        if (p == nullptr || !isAligned(p, 16))
        {
            return fail(
                cudaErrorInvalidValue, "engram_gemv_bf16: x, weight and out must be 16-byte aligned device pointers");
        }
    }
    int64_t const outBytes = numTokens * outFeatures * 2;
    if (overlaps(out, outBytes, x, numTokens * inFeatures * 2)
        || overlaps(out, outBytes, weight, outFeatures * inFeatures * 2))
    {
        return fail(cudaErrorInvalidValue, "engram_gemv_bf16: out must not overlap x or weight");
    }
    auto const* const xT = static_cast<__nv_bfloat16 const*>(x);
    auto const* const wT = static_cast<__nv_bfloat16 const*>(weight);
    auto* const yT = static_cast<__nv_bfloat16*>(out);
    auto const n = static_cast<int32_t>(outFeatures);
    auto const k = static_cast<int32_t>(inFeatures);
    int const major = computeCapabilityMajor();
    if (major >= 0 && major < 9)
    {
        return fail(cudaErrorNotSupported,
            "engram_gemv_bf16: needs a GPU of compute capability 9.0 or later (this one is %d.x); use the GEMM "
            "library (F.linear)",
            major);
    }
    bool const weightStatic = (flags & ENGRAM_GEMV_WEIGHT_STATIC) != 0;
    resetLaunchError();
    switch (numTokens)
    {
    case 1: launchGemv<1>(xT, wT, n, k, weightStatic, yT, stream); break;
    case 2: launchGemv<2>(xT, wT, n, k, weightStatic, yT, stream); break;
    case 3: launchGemv<3>(xT, wT, n, k, weightStatic, yT, stream); break;
    default: launchGemv<4>(xT, wT, n, k, weightStatic, yT, stream); break;
    }
    return checkLaunch("engram_gemv_bf16");
}
