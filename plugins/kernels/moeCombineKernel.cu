// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * engram_moe_combine (quantKernels.h states the contract): a routed step's sorted expert
 * rows gathered back per token through engram_moe_plan's pair_row and summed with their
 * routing weights, one thread per output value (the k picks of a token summed in order,
 * so the result does not depend on the launch).
 */
#include "engramKernelsCore.h"
#include "engramKernelsInternal.h"
#include "quantDevice.cuh"
#include "quantKernels.h"

#include <climits>
#include <cstdint>

namespace engram_trt
{
namespace kernels
{

namespace
{

constexpr int kCombineThreads = 256;

__global__ void moeCombineKernel(float const* __restrict__ y, int64_t ldy, int32_t const* __restrict__ pairRow,
    void const* __restrict__ ids, int32_t idsIsInt64, float const* __restrict__ routeW, int64_t numTokens, int32_t topK,
    int32_t numExperts, int64_t cols, void* __restrict__ out, int32_t outType, int64_t ldo)
{
    int64_t const total = numTokens * cols;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
        i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    {
        int64_t const t = i / cols;
        int64_t const d = i - t * cols;
        float acc = 0.0F;
        for (int32_t j = 0; j < topK; ++j)
        {
            int64_t const pair = t * topK + j;
            int64_t const e = idsIsInt64 != 0 ? static_cast<int64_t const*>(ids)[pair]
                                              : static_cast<int64_t>(static_cast<int32_t const*>(ids)[pair]);
            if (e < 0 || e >= numExperts)
            {
                continue;
            }
            // each product rounded, then added (no FMA contraction): the torch path's
            // (y * w).sum(dim=1) bit for bit where the sum's order is the same (k <= 2)
            acc = __fadd_rn(acc, __fmul_rn(routeW[pair], y[static_cast<int64_t>(pairRow[pair]) * ldy + d]));
        }
        storeFloatAs(out, outType, t * ldo + d, acc);
    }
}

bool isFloatType(int32_t t)
{
    return t == ENGRAM_FLOAT_BF16 || t == ENGRAM_FLOAT_F32 || t == ENGRAM_FLOAT_F16;
}

} // namespace

} // namespace kernels
} // namespace engram_trt

using namespace engram_trt::kernels;

extern "C" ENGRAM_API int engram_moe_combine(float const* y, int64_t ldy, int32_t const* pairRow, void const* ids,
    int32_t idsIsInt64, float const* routeW, int64_t numTokens, int32_t topK, int32_t numExperts, int64_t cols,
    void* out, int32_t outType, int64_t ldo, cudaStream_t stream)
{
    clearError();
    char const* const fn = "engram_moe_combine";
    if (numTokens < 0 || topK < 1 || numExperts < 1 || cols < 1 || cols > INT32_MAX)
    {
        return fail(cudaErrorInvalidValue,
            "%s: need num_tokens >= 0, top_k >= 1, num_experts >= 1 and 1 <= cols <= 2^31 - 1 (got %lld, %d, %d, %lld)",
            fn, ll(numTokens), topK, numExperts, ll(cols));
    }
    if (static_cast<double>(numTokens) * topK > static_cast<double>(INT32_MAX))
    {
        return fail(
            cudaErrorInvalidValue, "%s: num_tokens * top_k = %lld pairs exceed 2^31 - 1", fn, ll(numTokens * topK));
    }
    if (idsIsInt64 != 0 && idsIsInt64 != 1)
    {
        return fail(cudaErrorInvalidValue, "%s: ids_is_int64 must be 0 or 1 (got %d)", fn, idsIsInt64);
    }
    if (!isFloatType(outType))
    {
        return fail(cudaErrorInvalidValue, "%s: out_type must be an EngramFloatType (0 bf16, 1 f32, 2 f16; got %d)", fn,
            outType);
    }
    if (ldy < cols || ldo < cols)
    {
        return fail(cudaErrorInvalidValue, "%s: ldy and ldo must be >= cols %lld (got %lld, %lld)", fn, ll(cols),
            ll(ldy), ll(ldo));
    }
    if (numTokens == 0)
    {
        return 0;
    }
    if (y == nullptr || pairRow == nullptr || ids == nullptr || routeW == nullptr || out == nullptr)
    {
        return fail(cudaErrorInvalidValue, "%s: y, pair_row, ids, route_w and out must be device pointers", fn);
    }
    int64_t const total = numTokens * cols;
    int64_t blocks = (total + kCombineThreads - 1) / kCombineThreads;
    int const sms = smCount();
    int64_t const cap = sms > 0 ? int64_t{sms} * 16 : 4096;
    if (blocks > cap)
    {
        blocks = cap;
    }
    resetLaunchError();
    moeCombineKernel<<<static_cast<unsigned>(blocks), kCombineThreads, 0, stream>>>(
        y, ldy, pairRow, ids, idsIsInt64, routeW, numTokens, topK, numExperts, cols, out, outType, ldo);
    return checkLaunch(fn);
}
