// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * What the two bf16 decode MoE entry points share (decodeMoeKernel.cu's
 * engram_moe_experts_bf16 and decodeMoeGroupedKernel.cu's engram_moe_experts_grouped_bf16):
 * one contract (decodeKernels.h), so one copy of its host checks and of the arithmetic
 * after each product. The grouped kernel's outputs are the per-token kernel's bit for bit;
 * these functions are half of why (the other half: both take gemvKernel.cu's lane -> vector
 * mapping and float32 lane sums in k order, then warpSum).
 */
#ifndef ENGRAM_TRT_DECODE_MOE_COMMON_CUH
#define ENGRAM_TRT_DECODE_MOE_COMMON_CUH

#include "decodeKernels.h"
#include "vecLoad.cuh"

#include <cuda_bf16.h>

#include <cstdint>

namespace engram_trt
{
namespace kernels
{

//! torch's clamp of a bf16 value to [lo, hi] (NaN kept), the result rounded to bf16.
__device__ __forceinline__ float clampBf16(float v, float lo, float hi)
{
    return isnan(v) ? v : roundBf16(fminf(fmaxf(v, lo), hi));
}

//! h = bf(bf(silu(g)) * u) of the gate and up products' float32 sums, each rounded to bf16
//! first and clamped (g to <= limit, u to [-limit, limit]) when clamp is set.
__device__ __forceinline__ __nv_bfloat16 swigluBf16(float gateSum, float upSum, int32_t clamp, float limit)
{
    float g = roundBf16(gateSum);
    float u = roundBf16(upSum);
    if (clamp != 0)
    {
        g = clampBf16(g, -INFINITY, limit);
        u = clampBf16(u, -limit, limit);
    }
    float const silu = roundBf16(g / (1.0F + expf(-g)));
    return __float2bfloat16_rn(__fmul_rn(silu, u));
}

//! A routed pick's output: y = bf(bf(down . h) * weight).
__device__ __forceinline__ float routedOutput(float downSum, float weight)
{
    return roundBf16(__fmul_rn(roundBf16(downSum), weight));
}

//! The shared expert's output: s = bf(down . h), times bf(sigmoid(z)) (rounded) with a gate
//! logit z (hasScale).
__device__ __forceinline__ float sharedOutput(float downSum, bool hasScale, float z)
{
    float const shared = roundBf16(downSum);
    return hasScale ? roundBf16(__fmul_rn(shared, roundBf16(sigmoidOf(z)))) : shared;
}

//! The next pick of a token's routed sum in the reference's order (ascending expert id, ties
//! by pick; picks outside [0, numExperts) skipped) after (lastId, lastPick) (-1, -1 first):
//! its pick index, or -1 past the last; id is its expert.
__device__ __forceinline__ int32_t nextPick(
    int32_t const* tokenIds, int32_t topK, int32_t numExperts, int32_t lastId, int32_t lastPick, int32_t& id)
{
    int32_t pick = -1;
    id = 0;
    for (int32_t j = 0; j < topK; ++j)
    {
        int32_t const e = tokenIds[j];
        bool const after = e > lastId || (e == lastId && j > lastPick);
        if (e >= 0 && e < numExperts && after && (pick < 0 || e < id))
        {
            pick = j;
            id = e;
        }
    }
    return pick;
}

//! Elements of one h row in the workspace: the wider intermediate size.
inline int64_t moeHStride(int32_t intermediate, int32_t sharedIntermediate)
{
    return intermediate > sharedIntermediate ? intermediate : sharedIntermediate;
}

//! The host checks of an EngramMoeExperts call to `fn` that takes up to maxTokens tokens
//! and needs `need` workspace bytes (computed by the caller from the checked sizes: see
//! engram_moe_experts_bf16): 0 when the call may launch (or, with num_tokens 0, has
//! nothing to do), else the failure code with engram_last_error() naming the field. The
//! sizes are checked first; need is read only once they pass (sizeOf fills it: 0 or a
//! failure code).
int checkMoeExperts(char const* fn, EngramMoeExperts const& a, int64_t maxTokens,
    int (*sizeOf)(EngramMoeExperts const& a, size_t* bytes));

} // namespace kernels
} // namespace engram_trt

#endif // ENGRAM_TRT_DECODE_MOE_COMMON_CUH
