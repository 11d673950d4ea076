// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * Decoder-layer kernels of the bf16 serving path: the hc-mean RMSNorm (with the residual
 * update before it) and the SwiGLU activation of a fused gate + up GEMM. A decode step of
 * a ~1B model is a few hundred tiny launches around its GEMMs; each of these replaces
 * the eight to ten PyTorch elementwise kernels of its reference (modules.py: RMSNorm,
 * MLP, the residual adds) with one, rounding where the reference rounds (engramKernels.h
 * states the exact formulas).
 *
 * Norm: one block per token. Pass 1 reads the token's hc_mult copies once (adding the
 * residual in place when given), forms the bf16 mean and keeps it in shared memory, and
 * sums its squares; after a block reduction pass 2 scales the kept mean by the weight.
 * So hs crosses HBM once (twice with the residual: read and write), out once.
 *
 * SiLU * up: a grid-stride loop over 8-element vectors (elements for odd widths).
 */
#include "backboneKernels.h"
#include "dependentLaunch.cuh"
#include "engramKernelsInternal.h"
#include "vecLoad.cuh"

#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>

namespace engram_trt
{
namespace kernels
{

constexpr int kNormMaxThreads = 256;
constexpr int kSiluThreads = 256;

namespace
{

template <int V>
__global__ void __launch_bounds__(kNormMaxThreads) hcRmsNormKernel(__nv_bfloat16* hs,
    __nv_bfloat16 const* __restrict__ residual, __nv_bfloat16 const* __restrict__ weight, int32_t hcMult,
    int32_t hiddenSize, float invHc, float invD, float eps, __nv_bfloat16* __restrict__ out)
{
    extern __shared__ uint4 meanVectors[]; // the token's bf16 mean row, 16-byte aligned
    __nv_bfloat16* const meanS = reinterpret_cast<__nv_bfloat16*>(meanVectors);
    __shared__ float partial[kNormMaxThreads / 32];
    __shared__ float scaleShared;

    waitForPrimary(); // hs and residual come from the kernel before (dependentLaunch.cuh)
    allowDependents();
    int64_t const t = blockIdx.x;
    int32_t const vectors = hiddenSize / V;
    __nv_bfloat16* const h = hs + t * hcMult * static_cast<int64_t>(hiddenSize);
    __nv_bfloat16 const* const r = residual == nullptr ? nullptr : residual + t * hiddenSize;

    float squares = 0.0F;
    for (int32_t j = threadIdx.x; j < vectors; j += blockDim.x)
    {
        float add[V] = {};
        if (r != nullptr)
        {
            loadBf16<V>(r + j * V, add);
        }
        float sum[V];
#pragma unroll
        for (int i = 0; i < V; ++i)
        {
            sum[i] = 0.0F;
        }
        for (int32_t c = 0; c < hcMult; ++c)
        {
            __nv_bfloat16* const p = h + static_cast<int64_t>(c) * hiddenSize + j * V;
            float x[V];
            loadBf16<V>(p, x);
            if (r != nullptr)
            {
#pragma unroll
                for (int i = 0; i < V; ++i)
                {
                    x[i] = roundBf16(x[i] + add[i]);
                }
                storeBf16<V>(p, x);
            }
#pragma unroll
            for (int i = 0; i < V; ++i)
            {
                sum[i] += x[i];
            }
        }
        float mean[V];
#pragma unroll
        for (int i = 0; i < V; ++i)
        {
            mean[i] = roundBf16(sum[i] * invHc);
            squares += mean[i] * mean[i];
        }
        storeBf16<V>(meanS + j * V, mean); // exact: the values are bf16 already
    }

    squares = warpSum(squares);
    int const warp = threadIdx.x / 32;
    int const lane = threadIdx.x % 32;
    int const warps = (blockDim.x + 31) / 32;
    if (lane == 0)
    {
        partial[warp] = squares;
    }
    __syncthreads();
    if (warp == 0)
    {
        float const total = warpSum(lane < warps ? partial[lane] : 0.0F);
        if (lane == 0)
        {
            scaleShared = rsqrtf(total * invD + eps);
        }
    }
    __syncthreads();
    float const scale = scaleShared;

    __nv_bfloat16* const o = out + t * hiddenSize;
    for (int32_t j = threadIdx.x; j < vectors; j += blockDim.x)
    {
        float mean[V];
        float w[V];
        loadBf16<V>(meanS + j * V, mean);
        loadBf16<V>(weight + j * V, w);
#pragma unroll
        for (int i = 0; i < V; ++i)
        {
            mean[i] = (mean[i] * scale) * w[i]; // RMSNorm.forward: (x * rsqrt(...)) * weight
        }
        storeBf16<V>(o + j * V, mean);
    }
}

template <int V>
__global__ void __launch_bounds__(kSiluThreads) siluMulKernel(__nv_bfloat16 const* __restrict__ gateUp,
    int64_t numTokens, int32_t intermediateSize, __nv_bfloat16* __restrict__ out)
{
    waitForPrimary();
    allowDependents();
    int64_t const vectorsPerRow = intermediateSize / V;
    int64_t const total = numTokens * vectorsPerRow;
    for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
        e += static_cast<int64_t>(gridDim.x) * blockDim.x)
    {
        int64_t const t = e / vectorsPerRow;
        int64_t const j = (e - t * vectorsPerRow) * V;
        __nv_bfloat16 const* const row = gateUp + t * 2 * static_cast<int64_t>(intermediateSize);
        float g[V];
        float u[V];
        loadBf16<V>(row + j, g);
        loadBf16<V>(row + intermediateSize + j, u);
#pragma unroll
        for (int i = 0; i < V; ++i)
        {
            // F.silu in bf16 (x / (1 + exp(-x)) in float32, rounded), then the bf16 product.
            float const silu = roundBf16(g[i] / (1.0F + expf(-g[i])));
            g[i] = silu * u[i];
        }
        storeBf16<V>(out + t * static_cast<int64_t>(intermediateSize) + j, g);
    }
}

} // namespace

} // namespace kernels
} // namespace engram_trt

using namespace engram_trt::kernels;

extern "C" ENGRAM_API int engram_hc_rms_norm(void* hs, void const* residual, void const* weight, int64_t numTokens,
    int32_t hcMult, int32_t hiddenSize, float eps, void* out, cudaStream_t stream)
{
    clearError();
    if (numTokens < 0 || numTokens > INT32_MAX)
    {
        return fail(cudaErrorInvalidValue, "engram_hc_rms_norm: num_tokens must be in [0, 2^31 - 1] (got %lld)",
            static_cast<long long>(numTokens));
    }
    if (hcMult < 1 || hiddenSize < 1 || hiddenSize > ENGRAM_NORM_MAX_HIDDEN)
    {
        return fail(cudaErrorInvalidValue,
            "engram_hc_rms_norm: need hc_mult >= 1 and 1 <= hidden_size <= %d (got %d, %d)", ENGRAM_NORM_MAX_HIDDEN,
            hcMult, hiddenSize);
    }
    if (static_cast<double>(numTokens) * hcMult * hiddenSize > 4.0e18)
    {
        return fail(cudaErrorInvalidValue, "engram_hc_rms_norm: hs [%lld, %d, %d] is too large",
            static_cast<long long>(numTokens), hcMult, hiddenSize);
    }
    if (!std::isfinite(eps) || eps < 0.0F)
    {
        return fail(cudaErrorInvalidValue, "engram_hc_rms_norm: eps must be finite and >= 0 (got %g)",
            static_cast<double>(eps));
    }
    if (numTokens == 0)
    {
        return 0;
    }
    void const* required[] = {hs, weight, out};
    for (void const* p : required)
    {
        if (p == nullptr || !isAligned(p, 2))
        {
            return fail(cudaErrorInvalidValue, "engram_hc_rms_norm: hs, weight and out must be bf16 device pointers");
        }
    }
    if (residual != nullptr && !isAligned(residual, 2))
    {
        return fail(cudaErrorInvalidValue, "engram_hc_rms_norm: residual must be NULL or a bf16 device pointer");
    }
    int64_t const rowBytes = static_cast<int64_t>(hiddenSize) * 2;
    int64_t const hsBytes = numTokens * hcMult * rowBytes;
    int64_t const outBytes = numTokens * rowBytes;
    if (overlaps(out, outBytes, hs, hsBytes) || (residual != nullptr && overlaps(out, outBytes, residual, outBytes))
        || (residual != nullptr && overlaps(residual, outBytes, hs, hsBytes)))
    {
        return fail(cudaErrorInvalidValue, "engram_hc_rms_norm: out, hs and residual must not overlap");
    }
    bool const vectorized = hiddenSize % 8 == 0 && isAligned(hs, 16) && isAligned(weight, 16) && isAligned(out, 16)
        && (residual == nullptr || isAligned(residual, 16));
    int32_t const width = vectorized ? 8 : 1;
    int32_t const vectors = hiddenSize / width;
    int32_t threads = (vectors + 31) / 32 * 32;
    threads = threads > kNormMaxThreads ? kNormMaxThreads : threads;
    // The mean row in shared memory, rounded up to whole 16-byte words.
    size_t const sharedBytes = (static_cast<size_t>(hiddenSize) * 2 + 15) / 16 * 16;
    auto* const hsT = static_cast<__nv_bfloat16*>(hs);
    auto const* const residualT = static_cast<__nv_bfloat16 const*>(residual);
    auto const* const weightT = static_cast<__nv_bfloat16 const*>(weight);
    auto* const outT = static_cast<__nv_bfloat16*>(out);
    float const invHc = 1.0F / static_cast<float>(hcMult);
    float const invD = 1.0F / static_cast<float>(hiddenSize);
    dim3 const grid(static_cast<unsigned>(numTokens));
    resetLaunchError();
    if (vectorized)
    {
        launchDependent(hcRmsNormKernel<8>, grid, threads, sharedBytes, stream, hsT, residualT, weightT, hcMult,
            hiddenSize, invHc, invD, eps, outT);
    }
    else
    {
        launchDependent(hcRmsNormKernel<1>, grid, threads, sharedBytes, stream, hsT, residualT, weightT, hcMult,
            hiddenSize, invHc, invD, eps, outT);
    }
    return checkLaunch("engram_hc_rms_norm");
}

extern "C" ENGRAM_API int engram_silu_mul(
    void const* gateUp, int64_t numTokens, int32_t intermediateSize, void* out, cudaStream_t stream)
{
    clearError();
    if (numTokens < 0 || intermediateSize < 1)
    {
        return fail(cudaErrorInvalidValue,
            "engram_silu_mul: need num_tokens >= 0 and intermediate_size >= 1 (got %lld, %d)",
            static_cast<long long>(numTokens), intermediateSize);
    }
    if (numTokens > INT64_MAX / 4 / intermediateSize)
    {
        return fail(cudaErrorInvalidValue, "engram_silu_mul: [%lld, 2 * %d] is too large",
            static_cast<long long>(numTokens), intermediateSize);
    }
    if (numTokens == 0)
    {
        return 0;
    }
    if (gateUp == nullptr || out == nullptr || !isAligned(gateUp, 2) || !isAligned(out, 2))
    {
        return fail(cudaErrorInvalidValue, "engram_silu_mul: gate_up and out must be bf16 device pointers");
    }
    int64_t const outBytes = numTokens * static_cast<int64_t>(intermediateSize) * 2;
    if (overlaps(out, outBytes, gateUp, 2 * outBytes))
    {
        return fail(cudaErrorInvalidValue, "engram_silu_mul: out must not overlap gate_up");
    }
    bool const vectorized = intermediateSize % 8 == 0 && isAligned(gateUp, 16) && isAligned(out, 16);
    int64_t const vectors = numTokens * (intermediateSize / (vectorized ? 8 : 1));
    int const sms = smCount();
    int64_t const most = static_cast<int64_t>(sms > 0 ? sms : 132) * 16; // a grid-stride loop past that
    int64_t const wanted = (vectors + kSiluThreads - 1) / kSiluThreads;
    dim3 const grid(static_cast<unsigned>(wanted < most ? wanted : most));
    auto const* const in = static_cast<__nv_bfloat16 const*>(gateUp);
    auto* const o = static_cast<__nv_bfloat16*>(out);
    resetLaunchError();
    if (vectorized)
    {
        launchDependent(siluMulKernel<8>, grid, kSiluThreads, 0, stream, in, numTokens, intermediateSize, o);
    }
    else
    {
        launchDependent(siluMulKernel<1>, grid, kSiluThreads, 0, stream, in, numTokens, intermediateSize, o);
    }
    return checkLaunch("engram_silu_mul");
}
