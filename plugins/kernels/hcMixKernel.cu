// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * engram_hc_mix_bf16: the end of a Qwen4Exp hyper-connection's mix in one launch
 * (decodeKernels.h states the contract; python/engram_trt/native/decode.py binds it; the
 * reference is models/qwen4_exp/modules.py GatedResidual.mix). The PyTorch form runs the
 * low-rank gate's second product, its sigmoid, the product with the normed streams, their
 * mean and the injection weights as some eight launches of a few microseconds each; here:
 *
 *   every block: the token's activations a = bf(silu(bf(down_out / hc))) into shared
 *                memory (float32 holding bf16 values), all tokens of the step;
 *   a warp per output channel d: for each stream h the up row h * D + d, read once (16-byte
 *                streaming loads), against every token's a (float32 lane sums in k order,
 *                then a warp butterfly: gemvKernel.cu's product), the sigmoid, the product
 *                with the normed stream, each rounded to bf16 as the reference's ops are,
 *                summed over h in order and scaled by 1 / hc (torch's mean);
 *   block 0 also writes the injection weights 2 * bf(sigmoid(bf(inject_logits / hc))).
 */
#include "decodeKernels.h"
#include "dependentLaunch.cuh"
#include "engramKernelsCore.h"
#include "engramKernelsInternal.h"
#include "vecLoad.cuh"

#include <cuda_bf16.h>

#include <cstdint>
#include <cstdlib>

namespace engram_trt
{
namespace kernels
{

namespace
{

constexpr int kMixThreads = 256;
constexpr int kMixWarps = kMixThreads / 32;

//! Both forms' prologue over a block's Threads threads: act [T][rank] = bf(silu(bf(down_out / hc))) into shared
//! memory for every token of the step, and in block 0 the injection weights 2 * bf(sigmoid(bf(inject_logits / hc))).
template <int Threads>
__device__ __forceinline__ void mixPrologue(EngramHcMix const& a, float* act)
{
    int const T = static_cast<int>(a.num_tokens);
    int const r = a.rank;
    float const hc = static_cast<float>(a.hc);
    auto const* const down = static_cast<__nv_bfloat16 const*>(a.down_out);
    for (int t = 0; t < T; ++t)
    {
        for (int k = threadIdx.x; k < r; k += Threads)
        {
            float const s = roundBf16(__fdiv_rn(__bfloat162float(down[t * a.down_out_stride + k]), hc));
            act[t * r + k] = roundBf16(s / (1.0F + expf(-s)));
        }
    }
    if (blockIdx.x == 0 && a.inject_logits != nullptr)
    {
        auto const* const logits = static_cast<__nv_bfloat16 const*>(a.inject_logits);
        auto* const inject = static_cast<__nv_bfloat16*>(a.inject);
        for (int i = threadIdx.x; i < T * a.hc; i += Threads)
        {
            int64_t const at = static_cast<int64_t>(i / a.hc) * a.inject_stride + i % a.hc;
            float const q = roundBf16(__fdiv_rn(__bfloat162float(logits[at]), hc));
            inject[i] = __float2bfloat16_rn(2.0F * roundBf16(sigmoidOf(q)));
        }
    }
}

//! One 16-byte vector v of a row of up against every token's activations: acc[t] += w . act[t] (a lane's sums in k
//! order).
__device__ __forceinline__ void mixVector(
    uint4 raw, int v, float const* act, int T, int r, float (&acc)[ENGRAM_HC_MIX_MAX_TOKENS])
{
    float wf[8];
    unpack8Pairs<__nv_bfloat162>(raw, wf);
#pragma unroll
    for (int t = 0; t < ENGRAM_HC_MIX_MAX_TOKENS; ++t)
    {
        if (t < T)
        {
            float4 const x0 = *reinterpret_cast<float4 const*>(act + t * r + 8 * v);
            float4 const x1 = *reinterpret_cast<float4 const*>(act + t * r + 8 * v + 4);
            float const xf[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
            for (int i = 0; i < 8; ++i)
            {
                acc[t] = fmaf(wf[i], xf[i], acc[t]);
            }
        }
    }
}

//! A (token, stream) term of the mix from a warp's lane sums: bf(bf(sigmoid(bf(u))) * x), u their warp sum, x the
//! normed stream's value.
__device__ __forceinline__ float mixTerm(float laneSum, float x)
{
    float const u = roundBf16(warpSum(laneSum));
    float const g = roundBf16(sigmoidOf(u));
    return roundBf16(__fmul_rn(g, x));
}

__global__ void __launch_bounds__(kMixThreads) hcMixKernel(EngramHcMix a)
{
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
    extern __shared__ float act[]; // [T][rank]
    waitForPrimary();              // down_out, normed and the logits come from the kernels before
    allowDependents();
    int const T = static_cast<int>(a.num_tokens);
    int const r = a.rank;
    mixPrologue<kMixThreads>(a, act);
    __syncthreads();
    int const lane = threadIdx.x & 31;
    int const vectors = r / 8;
    auto const* const up = static_cast<__nv_bfloat16 const*>(a.up);
    auto const* const normed = static_cast<__nv_bfloat16 const*>(a.normed);
    auto* const mixed = static_cast<__nv_bfloat16*>(a.mixed);
    float const invHc = 1.0F / static_cast<float>(a.hc);
    for (int d = blockIdx.x * kMixWarps + (threadIdx.x >> 5); d < a.hidden; d += gridDim.x * kMixWarps)
    {
        float sum[ENGRAM_HC_MIX_MAX_TOKENS];
#pragma unroll
        for (int t = 0; t < ENGRAM_HC_MIX_MAX_TOKENS; ++t)
        {
            sum[t] = 0.0F;
        }
        for (int h = 0; h < a.hc; ++h)
        {
            int64_t const row = static_cast<int64_t>(h) * a.hidden + d;
            auto const* const w = reinterpret_cast<uint4 const*>(up + row * r);
            float acc[ENGRAM_HC_MIX_MAX_TOKENS];
#pragma unroll
            for (int t = 0; t < ENGRAM_HC_MIX_MAX_TOKENS; ++t)
            {
                acc[t] = 0.0F;
            }
            for (int v = lane; v < vectors; v += 32)
            {
                mixVector(loadStreaming(w + v), v, act, T, r, acc);
            }
#pragma unroll
            for (int t = 0; t < ENGRAM_HC_MIX_MAX_TOKENS; ++t)
            {
                if (t < T)
                {
                    sum[t] = __fadd_rn(sum[t], mixTerm(acc[t], __bfloat162float(normed[t * a.normed_stride + row])));
                }
            }
        }
        if (lane == 0)
        {
#pragma unroll
            for (int t = 0; t < ENGRAM_HC_MIX_MAX_TOKENS; ++t)
            {
                if (t < T)
                {
                    mixed[static_cast<int64_t>(t) * a.hidden + d] = __float2bfloat16_rn(__fmul_rn(sum[t], invHc));
                }
            }
        }
    }
#endif
}

// The split form (the default where it fits; ENGRAM_TRT_HC_MIX_SPLIT=0 takes the form above, an A/B switch): a warp
// per (channel d, stream h) instead of a warp per channel walking the hc streams one after the other, so a channel's
// hc rows of `up` are read by hc warps at once (hc times the loads in flight, and no warp waits on hc dependent
// reads). Each (t, h) product is the lanes' same sums in the same order, the same butterfly and roundings; the hc
// products of a channel land in shared memory and one thread sums them in h order: the bits of hcMixKernel.
constexpr int kSplitThreads = 256;
constexpr int kSplitWarps = kSplitThreads / 32;
constexpr int kSplitEarly = 2; // vectors of up a lane loads before the wait (rank <= 512: the whole row)

__global__ void __launch_bounds__(kSplitThreads) hcMixSplitKernel(EngramHcMix a)
{
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
    extern __shared__ float smem[]; // act [T][rank], then each warp's products [kSplitWarps][max tokens]
    int const T = static_cast<int>(a.num_tokens);
    int const r = a.rank;
    float* const act = smem;
    float* const prod = smem + T * r;
    int const warp = threadIdx.x >> 5;
    int const lane = threadIdx.x & 31;
    int const perBlock = kSplitWarps / a.hc; // channels a block serves (hc <= kSplitWarps)
    int const local = warp / a.hc;
    int const h = warp - local * a.hc;
    int const d = blockIdx.x * perBlock + local;
    bool const mine = local < perBlock && d < a.hidden; // the whole warp or none of it
    int const vectors = r / 8;
    int64_t const row = static_cast<int64_t>(h) * a.hidden + d;
    auto const* const w = reinterpret_cast<uint4 const*>(static_cast<__nv_bfloat16 const*>(a.up) + row * r);
    // up is a weight (nothing in the step writes it): the row's first vectors are loaded before the wait for the
    // kernel before (dependentLaunch.cuh), so their latency overlaps its tail and the prologue below
    uint4 early[kSplitEarly];
#pragma unroll
    for (int j = 0; j < kSplitEarly; ++j)
    {
        early[j] = mine && lane + 32 * j < vectors ? loadStreaming(w + lane + 32 * j) : make_uint4(0, 0, 0, 0);
    }
    waitForPrimary(); // down_out, normed and the logits come from the kernels before
    allowDependents();
    mixPrologue<kSplitThreads>(a, act);
    __syncthreads();
    if (mine)
    {
        auto const* const normed = static_cast<__nv_bfloat16 const*>(a.normed);
        float acc[ENGRAM_HC_MIX_MAX_TOKENS];
#pragma unroll
        for (int t = 0; t < ENGRAM_HC_MIX_MAX_TOKENS; ++t)
        {
            acc[t] = 0.0F;
        }
#pragma unroll
        for (int j = 0; j < kSplitEarly; ++j) // v = lane, lane + 32, ...: the default form's order
        {
            if (lane + 32 * j < vectors)
            {
                mixVector(early[j], lane + 32 * j, act, T, r, acc);
            }
        }
        for (int v = lane + 32 * kSplitEarly; v < vectors; v += 32)
        {
            mixVector(loadStreaming(w + v), v, act, T, r, acc);
        }
#pragma unroll
        for (int t = 0; t < ENGRAM_HC_MIX_MAX_TOKENS; ++t)
        {
            if (t < T)
            {
                float const term = mixTerm(acc[t], __bfloat162float(normed[t * a.normed_stride + row]));
                if (lane == 0)
                {
                    prod[warp * ENGRAM_HC_MIX_MAX_TOKENS + t] = term;
                }
            }
        }
    }
    __syncthreads();
    auto* const mixed = static_cast<__nv_bfloat16*>(a.mixed);
    float const invHc = 1.0F / static_cast<float>(a.hc);
    for (int i = threadIdx.x; i < perBlock * T; i += kSplitThreads) // a thread per (channel, token)
    {
        int const c = i / T;
        int const t = i - c * T;
        int const dd = blockIdx.x * perBlock + c;
        if (dd < a.hidden)
        {
            float sum = 0.0F;
            for (int s = 0; s < a.hc; ++s)
            {
                sum = __fadd_rn(sum, prod[(c * a.hc + s) * ENGRAM_HC_MIX_MAX_TOKENS + t]);
            }
            mixed[static_cast<int64_t>(t) * a.hidden + dd] = __float2bfloat16_rn(__fmul_rn(sum, invHc));
        }
    }
#endif
}

//! The split form unless ENGRAM_TRT_HC_MIX_SPLIT=0 (an A/B switch, read at each launch: a graph records the one its
//! capture took).
bool splitChosen()
{
    char const* const text = std::getenv("ENGRAM_TRT_HC_MIX_SPLIT");
    return text == nullptr || !(text[0] == '0' && text[1] == '\0');
}

} // namespace

} // namespace kernels
} // namespace engram_trt

using namespace engram_trt::kernels;

extern "C" ENGRAM_API int engram_hc_mix_bf16(EngramHcMix const* args, cudaStream_t stream)
{
    clearError();
    char const* const fn = "engram_hc_mix_bf16";
    if (args == nullptr)
    {
        return fail(cudaErrorInvalidValue, "%s: args must not be NULL", fn);
    }
    EngramHcMix const a = *args;
    if (a.num_tokens < 0 || a.num_tokens > ENGRAM_HC_MIX_MAX_TOKENS)
    {
        return fail(cudaErrorInvalidValue, "%s: num_tokens must be in [0, %d] (a decode step; got %lld)", fn,
            ENGRAM_HC_MIX_MAX_TOKENS, ll(a.num_tokens));
    }
    if (a.hidden < 1 || a.hc < 1 || a.hc > 16 || a.rank < 8 || a.rank % 8 != 0
        || a.num_tokens * a.rank > ENGRAM_HC_MIX_MAX_ELEMENTS)
    {
        return fail(cudaErrorInvalidValue,
            "%s: need hidden >= 1, 1 <= hc <= 16, rank a positive multiple of 8 and num_tokens * rank <= %d (got %d, "
            "%d, %d, %lld tokens)",
            fn, ENGRAM_HC_MIX_MAX_ELEMENTS, a.hidden, a.hc, a.rank, ll(a.num_tokens));
    }
    if ((a.inject_logits == nullptr) != (a.inject == nullptr))
    {
        return fail(cudaErrorInvalidValue, "%s: give both inject_logits and inject, or neither", fn);
    }
    int64_t const width = static_cast<int64_t>(a.hc) * a.hidden;
    if (a.down_out_stride < a.rank || a.down_out_stride % 8 != 0 || a.normed_stride < width
        || (a.inject != nullptr && a.inject_stride < a.hc))
    {
        return fail(cudaErrorInvalidValue,
            "%s: need down_out_stride >= rank and a multiple of 8, normed_stride >= hc * hidden, inject_stride >= hc "
            "(got %lld, %lld, %lld)",
            fn, ll(a.down_out_stride), ll(a.normed_stride), ll(a.inject_stride));
    }
    if (a.num_tokens == 0)
    {
        return 0;
    }
    if (a.down_out == nullptr || a.up == nullptr || !isAligned(a.down_out, 16) || !isAligned(a.up, 16))
    {
        return fail(cudaErrorInvalidValue, "%s: down_out and up must be 16-byte aligned device pointers", fn);
    }
    if (a.normed == nullptr || a.mixed == nullptr || !isAligned(a.normed, 2) || !isAligned(a.mixed, 2)
        || (a.inject != nullptr && (!isAligned(a.inject, 2) || !isAligned(a.inject_logits, 2))))
    {
        return fail(cudaErrorInvalidValue, "%s: normed, mixed, inject_logits and inject must be device pointers", fn);
    }
    int64_t const mixedBytes = a.num_tokens * a.hidden * 2;
    int64_t const normedBytes = ((a.num_tokens - 1) * a.normed_stride + width) * 2;
    int64_t const downBytes = ((a.num_tokens - 1) * a.down_out_stride + a.rank) * 2;
    int64_t const injectBytes = a.num_tokens * a.hc * 2;
    if (overlaps(a.mixed, mixedBytes, a.normed, normedBytes) || overlaps(a.mixed, mixedBytes, a.down_out, downBytes)
        || (a.inject != nullptr
            && (overlaps(a.inject, injectBytes, a.mixed, mixedBytes)
                || overlaps(
                    a.inject, injectBytes, a.inject_logits, ((a.num_tokens - 1) * a.inject_stride + a.hc) * 2))))
    {
        return fail(cudaErrorInvalidValue, "%s: mixed and inject must not overlap each other or the inputs", fn);
    }
    int const major = computeCapabilityMajor();
    if (major >= 0 && major < 9)
    {
        return fail(
            cudaErrorNotSupported, "%s: needs a GPU of compute capability 9.0 or later (this one is %d.x)", fn, major);
    }
    size_t const shared = static_cast<size_t>(a.num_tokens) * a.rank * sizeof(float);
    resetLaunchError();
    size_t const products = static_cast<size_t>(kSplitWarps) * ENGRAM_HC_MIX_MAX_TOKENS * sizeof(float);
    if (a.hc <= kSplitWarps && shared + products <= 48 * 1024 && splitChosen()) // (within the default shared limit)
    {
        int const perBlock = kSplitWarps / a.hc;
        unsigned const blocks = static_cast<unsigned>((a.hidden + perBlock - 1) / perBlock);
        launchDependent(hcMixSplitKernel, dim3(blocks), dim3(kSplitThreads), shared + products, stream, a);
        return checkLaunch(fn);
    }
    unsigned const blocks = static_cast<unsigned>((a.hidden + kMixWarps - 1) / kMixWarps);
    launchDependent(hcMixKernel, dim3(blocks), dim3(kMixThreads), shared, stream, a);
    return checkLaunch(fn);
}
