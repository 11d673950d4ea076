// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * The stored-format kernels' small companions (quantKernels.h states the contracts):
 *
 *   engram_act_quant         the dynamic activation quantization per row and group of
 *                            columns, bit for bit quant/formats.py act_quant: one warp per
 *                            (row, group): the group's amax by a butterfly max, the scale
 *                            (float32 division, the ue8m0 power of two exactly from the
 *                            bits), then each lane's elements cast with cvt.rn.satfinite.
 *   engram_swiglu_act_quant  the same on silu(min(g, l)) * clamp(u, -l, l) of a fused
 *                            gate / up product (float32), or that product alone (group 0).
 *   engram_moe_plan          a routed step's counting sort by expert, in one block: W
 *                            segments of the pairs, a histogram per segment (shared-memory
 *                            atomics: counts do not depend on their order), one scan over
 *                            the experts giving each (segment, expert) its first row, then
 *                            each segment's warp places its pairs in pair order (a
 *                            __match_any_sync rank within each 32 pairs), so the plan is
 *                            the same on every run. W = as many segments as 48 KiB of
 *                            shared counts hold (32 for 256 experts, 1 for 4096).
 *   engram_quant_dequantize  the weight formats decoded, one thread per value.
 */
#include "engramKernelsCore.h"
#include "engramKernelsInternal.h"
#include "quantDevice.cuh"
#include "quantKernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cstdint>

namespace engram_trt
{
namespace kernels
{

namespace
{

constexpr int kQuantThreads = 256;
constexpr int kPlanThreads = 1024;
constexpr int kPlanSharedInts = 12288; // 48 KiB of int32
constexpr int kPlanMaxExperts = 4096;
constexpr int64_t kPlanMaxPairs = int64_t{1} << 20;

bool isFloatType(int32_t t)
{
    return t == ENGRAM_FLOAT_BF16 || t == ENGRAM_FLOAT_F32 || t == ENGRAM_FLOAT_F16;
}

int32_t floatTypeBytes(int32_t t)
{
    return t == ENGRAM_FLOAT_F32 ? 4 : 2;
}

//! The source of the activation quantization: a float tensor, or the clamped SwiGLU of
//! a fused gate / up product.
struct ActSource
{
    void const* x;
    int32_t xType;
    int64_t ldx;
    // SwiGLU: x is float32 [P, 2I] of row stride ldx, cols = I
    bool swiglu;
    float limit;
};

__device__ __forceinline__ float actValue(ActSource const& src, int64_t row, int64_t col, int64_t cols)
{
    if (!src.swiglu)
    {
        return loadFloatAs(src.x, src.xType, row * src.ldx + col);
    }
    float const* gu = static_cast<float const*>(src.x) + row * src.ldx;
    float g = gu[col];
    float u = gu[cols + col];
    if (src.limit > 0.0F)
    {
        g = fminf(g, src.limit);
        u = fminf(fmaxf(u, -src.limit), src.limit);
    }
    return g / (1.0F + expf(-g)) * u;
}

/*
 * One warp per (row, group) (group 0: per (row, 32 columns), no quantization). Reads
 * the group twice (the second time from L1 / L2) rather than holding it in registers, so
 * any group size takes the same code.
 */
__global__ void __launch_bounds__(kQuantThreads)
    actQuantKernel(ActSource src, int64_t rows, int64_t cols, int32_t group, int32_t ue8m0, uint8_t* __restrict__ q,
        float* __restrict__ scale, void* __restrict__ deq, int32_t deqType)
{
    int const lane = threadIdx.x & 31;
    int32_t const span = group > 0 ? group : 32;
    int64_t const groups = (cols + span - 1) / span;
    int64_t const item = (static_cast<int64_t>(blockIdx.x) * kQuantThreads + threadIdx.x) >> 5;
    if (item >= rows * groups)
    {
        return;
    }
    int64_t const row = item / groups;
    int64_t const g = item - row * groups;
    int64_t const c0 = g * span;
    int64_t const c1 = c0 + span < cols ? c0 + span : cols;
    if (group == 0)
    {
        for (int64_t c = c0 + lane; c < c1; c += 32)
        {
            storeFloatAs(deq, deqType, row * cols + c, actValue(src, row, c, cols));
        }
        return;
    }
    float amax = 0.0F;
    for (int64_t c = c0 + lane; c < c1; c += 32)
    {
        amax = fmaxf(amax, fabsf(actValue(src, row, c, cols)));
    }
    amax = warpMax(amax);
    float s = __fdiv_rn(fmaxf(amax, kActAmaxFloor), kFp8Max);
    if (ue8m0 != 0)
    {
        s = pow2Ceil(s);
    }
    float const inv = __fdiv_rn(1.0F, s);
    if (scale != nullptr && lane == 0)
    {
        scale[row * groups + g] = s;
    }
    for (int64_t c = c0 + lane; c < c1; c += 32)
    {
        uint8_t const b = floatToE4m3(__fmul_rn(actValue(src, row, c, cols), inv));
        if (q != nullptr)
        {
            q[row * cols + c] = b;
        }
        if (deq != nullptr)
        {
            storeFloatAs(deq, deqType, row * cols + c, __fmul_rn(e4m3ToFloat(b), s));
        }
    }
}

int launchActQuant(char const* fn, ActSource const& src, int64_t rows, int64_t cols, int32_t group, int32_t ue8m0,
    void* q, float* scale, void* deq, int32_t deqType, cudaStream_t stream)
{
    int32_t const span = group > 0 ? group : 32;
    int64_t const warps = rows * ((cols + span - 1) / span);
    int64_t const blocks = (warps * 32 + kQuantThreads - 1) / kQuantThreads;
    if (blocks > INT32_MAX)
    {
        return fail(cudaErrorInvalidValue, "%s: [%lld, %lld] in groups of %d needs more than 2^31 - 1 blocks", fn,
            ll(rows), ll(cols), span);
    }
    resetLaunchError();
    actQuantKernel<<<static_cast<unsigned>(blocks), kQuantThreads, 0, stream>>>(
        src, rows, cols, group, ue8m0, static_cast<uint8_t*>(q), scale, deq, deqType);
    return checkLaunch(fn);
}

//! The checks engram_act_quant and engram_swiglu_act_quant share (outputs and group).
int checkActOutputs(char const* fn, int64_t rows, int64_t cols, int32_t group, int32_t ue8m0, void const* q,
    float const* scale, void const* deq, int32_t deqType)
{
    if (rows < 0 || cols < 1 || cols > INT32_MAX || rows > INT32_MAX)
    {
        return fail(cudaErrorInvalidValue,
            "%s: need 0 <= num_rows <= 2^31 - 1 and 1 <= cols <= 2^31 - 1 (got %lld, %lld)", fn, ll(rows), ll(cols));
    }
    if (ue8m0 != 0 && ue8m0 != 1)
    {
        return fail(cudaErrorInvalidValue, "%s: ue8m0 must be 0 or 1 (got %d)", fn, ue8m0);
    }
    if (q == nullptr && scale == nullptr && deq == nullptr)
    {
        return fail(cudaErrorInvalidValue, "%s: q, scale and deq are all NULL: give at least one output", fn);
    }
    if (deq != nullptr && !isFloatType(deqType))
    {
        return fail(cudaErrorInvalidValue, "%s: deq_type must be an EngramFloatType (0 bf16, 1 f32, 2 f16; got %d)", fn,
            deqType);
    }
    if (scale != nullptr && !isAligned(scale, 4))
    {
        return fail(cudaErrorInvalidValue, "%s: scale must be 4-byte aligned", fn);
    }
    if (deq != nullptr && !isAligned(deq, floatTypeBytes(deqType)))
    {
        return fail(cudaErrorInvalidValue, "%s: deq must be aligned to its element size", fn);
    }
    return 0;
}

//! Segments of the plan's pairs for E experts: as many (segment, bucket) int32 counts as
//! the shared budget holds beside the scan's arrays, 1..32.
__host__ __device__ __forceinline__ int planSegments(int32_t experts)
{
    int const buckets = experts + 1;
    int const w = (kPlanSharedInts - 66) / buckets;
    return w < 1 ? 1 : (w > 32 ? 32 : w);
}

__device__ __forceinline__ int32_t planBucket(void const* ids, int32_t idsIs64, int64_t i, int32_t experts, bool& bad)
{
    int64_t const id
        = idsIs64 != 0 ? __ldg(static_cast<int64_t const*>(ids) + i) : __ldg(static_cast<int32_t const*>(ids) + i);
    if (id < 0 || id >= experts)
    {
        bad = true;
        return experts; // the bucket of pairs of no expert, after every expert's
    }
    return static_cast<int32_t>(id);
}

//! Shared int32s before the scan's 32 warp totals (8-byte aligned): hist [W][E + 1].
__host__ __device__ __forceinline__ int planTotalsOffset(int32_t experts)
{
    int const ints = planSegments(experts) * (experts + 1);
    return (ints + 1) & ~1;
}

/*
 * One block of kPlanThreads. Shared: hist [W][E + 1] (counts, then each segment's first
 * row per bucket), then warpTotals [32] (the scan). Pairs [0, P) in W segments of span.
 */
__global__ void __launch_bounds__(kPlanThreads) moePlanKernel(void const* __restrict__ ids, int32_t idsIs64,
    int32_t pairs, int32_t topK, int32_t experts, int32_t* __restrict__ offsets, int32_t* __restrict__ order,
    int32_t* __restrict__ rowToken, int32_t* __restrict__ pairRow, int32_t* __restrict__ slotExpert, int32_t numSlots,
    int32_t* __restrict__ errorFlag)
{
    extern __shared__ int32_t planShared[];
    int const buckets = experts + 1;
    int const segments = planSegments(experts);
    int32_t* const hist = planShared; // [segments][buckets]
    auto* const warpTotals = reinterpret_cast<unsigned long long*>(planShared + planTotalsOffset(experts)); // [32]
    int const tid = threadIdx.x;
    int const lane = tid & 31;
    int const warp = tid >> 5;
    int32_t const span = pairs > 0 ? (pairs + segments - 1) / segments : 1;

    for (int i = tid; i < segments * buckets; i += kPlanThreads)
    {
        hist[i] = 0;
    }
    __syncthreads();
    bool bad = false;
    for (int32_t i = tid; i < pairs; i += kPlanThreads)
    {
        int32_t const b = planBucket(ids, idsIs64, i, experts, bad);
        atomicAdd(&hist[(i / span) * buckets + b], 1);
    }
    if (bad && errorFlag != nullptr)
    {
        *errorFlag = 1;
    }
    __syncthreads();

    // Scan over the buckets: each thread a run of `per` buckets; the value scanned packs
    // the bucket's pairs (low 32 bits) and whether an expert is active (high 32 bits).
    int const per = (buckets + kPlanThreads - 1) / kPlanThreads;
    int const b0 = tid * per;
    unsigned long long local = 0;
    for (int b = b0; b < b0 + per && b < buckets; ++b)
    {
        unsigned long long total = 0;
        for (int w = 0; w < segments; ++w)
        {
            total += static_cast<unsigned long long>(hist[w * buckets + b]);
        }
        local += total + (b < experts && total > 0 ? (1ULL << 32) : 0ULL);
    }
    unsigned long long inclusive = local;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1)
    {
        unsigned long long const up = __shfl_up_sync(0xFFFFFFFFU, inclusive, offset);
        if (lane >= offset)
        {
            inclusive += up;
        }
    }
    if (lane == 31)
    {
        warpTotals[warp] = inclusive;
    }
    __syncthreads();
    if (warp == 0)
    {
        unsigned long long v = warpTotals[lane];
#pragma unroll
        for (int offset = 1; offset < 32; offset <<= 1)
        {
            unsigned long long const up = __shfl_up_sync(0xFFFFFFFFU, v, offset);
            if (lane >= offset)
            {
                v += up;
            }
        }
        warpTotals[lane] = v; // inclusive over warps
    }
    __syncthreads();
    unsigned long long running = inclusive - local + (warp > 0 ? warpTotals[warp - 1] : 0ULL);
    for (int b = b0; b < b0 + per && b < buckets; ++b)
    {
        int32_t const start = static_cast<int32_t>(running & 0xFFFFFFFFULL);
        int32_t const slot = static_cast<int32_t>(running >> 32);
        offsets[b] = start; // b == experts: the pairs with an id in range
        int32_t total = 0;
        for (int w = 0; w < segments; ++w)
        {
            int32_t const count = hist[w * buckets + b];
            hist[w * buckets + b] = start + total; // the segment's first row in the bucket
            total += count;
        }
        bool const active = b < experts && total > 0;
        if (active && slot < numSlots)
        {
            slotExpert[slot] = b;
        }
        running += static_cast<unsigned long long>(total) + (active ? (1ULL << 32) : 0ULL);
    }
    int32_t const activeExperts = static_cast<int32_t>(warpTotals[31] >> 32);
    for (int32_t s = activeExperts + tid; s < numSlots; s += kPlanThreads)
    {
        slotExpert[s] = -1;
    }
    __syncthreads();

    // Placement: warp w walks segment w in pair order, 32 pairs at a time.
    if (warp < segments)
    {
        int32_t const first = warp * span;
        int32_t const last = first + span < pairs ? first + span : pairs;
        int32_t* const cursor = hist + warp * buckets;
        bool ignored = false;
        for (int32_t i0 = first; i0 < last; i0 += 32)
        {
            int32_t const i = i0 + lane;
            bool const valid = i < last;
            int32_t const b = valid ? planBucket(ids, idsIs64, i, experts, ignored) : -1;
            unsigned const peers = __match_any_sync(0xFFFFFFFFU, b);
            int const rank = __popc(peers & ((1U << lane) - 1U));
            int32_t const row = valid ? cursor[b] + rank : 0;
            __syncwarp();
            if (valid && rank == 0)
            {
                cursor[b] += __popc(peers);
            }
            __syncwarp();
            if (valid)
            {
                order[row] = i;
                rowToken[row] = i / topK;
                if (pairRow != nullptr)
                {
                    pairRow[i] = row;
                }
            }
        }
    }
}

__constant__ float kE2m1Values[16]
    = {0.0F, 0.5F, 1.0F, 1.5F, 2.0F, 3.0F, 4.0F, 6.0F, -0.0F, -0.5F, -1.0F, -1.5F, -2.0F, -3.0F, -4.0F, -6.0F};

__global__ void __launch_bounds__(kQuantThreads)
    dequantizeKernel(uint8_t const* __restrict__ w, int32_t wType, void const* __restrict__ wScale, int32_t ue8m0,
        int32_t bn, int32_t bk, int64_t n, int64_t k, int64_t total, void* __restrict__ out, int32_t outType)
{
    int64_t const nb = (n + bn - 1) / bn;
    int64_t const kb = (k + bk - 1) / bk;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * kQuantThreads + threadIdx.x; i < total;
        i += static_cast<int64_t>(gridDim.x) * kQuantThreads)
    {
        int64_t const col = i % k;
        int64_t const rest = i / k;
        int64_t const row = rest % n;
        int64_t const e = rest / n;
        float v;
        if (wType == ENGRAM_QWEIGHT_BF16)
        {
            v = __bfloat162float(reinterpret_cast<__nv_bfloat16 const*>(w)[i]);
        }
        else
        {
            if (wType == ENGRAM_QWEIGHT_FP8_E4M3)
            {
                v = e4m3ToFloat(w[i]);
            }
            else
            {
                uint8_t const byte = w[(e * n + row) * (k / 2) + col / 2];
                v = kE2m1Values[(col & 1) != 0 ? byte >> 4 : byte & 0xF];
            }
            v = __fmul_rn(v, loadScale(wScale, (e * nb + row / bn) * kb + col / bk, ue8m0 != 0));
        }
        storeFloatAs(out, outType, i, v);
    }
}

} // namespace

} // namespace kernels
} // namespace engram_trt

using namespace engram_trt::kernels;

extern "C" ENGRAM_API int engram_act_quant(void const* x, int32_t xType, int64_t numRows, int64_t cols, int64_t ldx,
    int32_t group, int32_t ue8m0, void* q, float* scale, void* deq, int32_t deqType, cudaStream_t stream)
{
    clearError();
    char const* const fn = "engram_act_quant";
    if (!isFloatType(xType))
    {
        return fail(
            cudaErrorInvalidValue, "%s: x_type must be an EngramFloatType (0 bf16, 1 f32, 2 f16; got %d)", fn, xType);
    }
    if (group < 1)
    {
        return fail(cudaErrorInvalidValue, "%s: group must be >= 1 (got %d)", fn, group);
    }
    if (int const status = checkActOutputs(fn, numRows, cols, group, ue8m0, q, scale, deq, deqType))
    {
        return status;
    }
    if (ldx < cols)
    {
        return fail(cudaErrorInvalidValue, "%s: ldx must be >= cols (got %lld < %lld)", fn, ll(ldx), ll(cols));
    }
    if (numRows == 0)
    {
        return 0;
    }
    if (x == nullptr || !isAligned(x, floatTypeBytes(xType)))
    {
        return fail(cudaErrorInvalidValue, "%s: x must be a device pointer aligned to its element size", fn);
    }
    ActSource const src{x, xType, ldx, false, 0.0F};
    return launchActQuant(fn, src, numRows, cols, group, ue8m0, q, scale, deq, deqType, stream);
}

extern "C" ENGRAM_API int engram_swiglu_act_quant(float const* gateUp, int64_t numRows, int64_t intermediate,
    int64_t ld, float limit, int32_t group, int32_t ue8m0, void* q, float* scale, void* deq, int32_t deqType,
    cudaStream_t stream)
{
    clearError();
    char const* const fn = "engram_swiglu_act_quant";
    if (group < 0)
    {
        return fail(cudaErrorInvalidValue, "%s: group must be >= 0 (0: no quantization; got %d)", fn, group);
    }
    if (group == 0 && (q != nullptr || scale != nullptr || deq == nullptr))
    {
        return fail(
            cudaErrorInvalidValue, "%s: group 0 (no quantization) writes deq alone: q and scale NULL, deq given", fn);
    }
    if (int const status = checkActOutputs(fn, numRows, intermediate, group, ue8m0, q, scale, deq, deqType))
    {
        return status;
    }
    if (ld < 2 * intermediate)
    {
        return fail(cudaErrorInvalidValue, "%s: ld must be >= 2 * intermediate = %lld (got %lld)", fn,
            ll(2 * intermediate), ll(ld));
    }
    if (!(limit >= 0.0F) || limit == INFINITY)
    {
        return fail(cudaErrorInvalidValue, "%s: limit must be finite and >= 0 (0: no clamp)", fn);
    }
    if (numRows == 0)
    {
        return 0;
    }
    if (gateUp == nullptr || !isAligned(gateUp, 4))
    {
        return fail(cudaErrorInvalidValue, "%s: gate_up must be a 4-byte aligned device pointer", fn);
    }
    ActSource const src{gateUp, ENGRAM_FLOAT_F32, ld, true, limit};
    return launchActQuant(fn, src, numRows, intermediate, group, ue8m0, q, scale, deq, deqType, stream);
}

extern "C" ENGRAM_API int engram_moe_plan(void const* ids, int32_t idsIsInt64, int64_t numTokens, int32_t topK,
    int32_t numExperts, int32_t* offsets, int32_t* order, int32_t* rowToken, int32_t* pairRow, int32_t* slotExpert,
    int32_t numSlots, int32_t* errorFlag, cudaStream_t stream)
{
    clearError();
    char const* const fn = "engram_moe_plan";
    if (idsIsInt64 != 0 && idsIsInt64 != 1)
    {
        return fail(cudaErrorInvalidValue, "%s: ids_is_int64 must be 0 or 1 (got %d)", fn, idsIsInt64);
    }
    if (numExperts < 1 || numExperts > kPlanMaxExperts)
    {
        return fail(
            cudaErrorInvalidValue, "%s: num_experts must be in [1, %d] (got %d)", fn, kPlanMaxExperts, numExperts);
    }
    if (topK < 1 || numTokens < 0 || numTokens * topK > kPlanMaxPairs)
    {
        return fail(cudaErrorInvalidValue,
            "%s: need top_k >= 1, num_tokens >= 0 and num_tokens * top_k <= 2^20 (got %lld, %d)", fn, ll(numTokens),
            topK);
    }
    int64_t const pairs = numTokens * topK;
    int64_t const needSlots = pairs < numExperts ? pairs : numExperts;
    if (numSlots < needSlots || numSlots < 1 || numSlots > 65535)
    {
        return fail(cudaErrorInvalidValue,
            "%s: num_slots must be in [max(1, min(T * k, E)) = %lld, 65535] to name every active expert (got %d)", fn,
            ll(needSlots > 1 ? needSlots : 1), numSlots);
    }
    if (offsets == nullptr || slotExpert == nullptr
        || (pairs > 0 && (ids == nullptr || order == nullptr || rowToken == nullptr)))
    {
        return fail(
            cudaErrorInvalidValue, "%s: ids, offsets, order, row_token and slot_expert must be device pointers", fn);
    }
    if (!isAligned(offsets, 4) || !isAligned(order, 4) || !isAligned(rowToken, 4) || !isAligned(slotExpert, 4)
        || !isAligned(pairRow, 4) || !isAligned(errorFlag, 4) || !isAligned(ids, idsIsInt64 != 0 ? 8 : 4))
    {
        return fail(cudaErrorInvalidValue, "%s: ids and the int32 outputs must be aligned to their element size", fn);
    }
    size_t const shared = static_cast<size_t>(planTotalsOffset(numExperts)) * sizeof(int32_t) + 32 * 8;
    resetLaunchError();
    moePlanKernel<<<1, kPlanThreads, shared, stream>>>(ids, idsIsInt64, static_cast<int32_t>(pairs), topK, numExperts,
        offsets, order, rowToken, pairRow, slotExpert, numSlots, errorFlag);
    return checkLaunch(fn);
}

extern "C" ENGRAM_API int engram_quant_dequantize(void const* w, int32_t wType, void const* wScale, int32_t scaleType,
    int32_t bn, int32_t bk, int64_t outFeatures, int64_t inFeatures, int32_t numExperts, void* out, int32_t outType,
    cudaStream_t stream)
{
    clearError();
    char const* const fn = "engram_quant_dequantize";
    if (wType != ENGRAM_QWEIGHT_FP8_E4M3 && wType != ENGRAM_QWEIGHT_FP4_E2M1 && wType != ENGRAM_QWEIGHT_BF16)
    {
        return fail(
            cudaErrorInvalidValue, "%s: w_type must be 0 (fp8 e4m3), 1 (fp4 e2m1) or 2 (bf16) (got %d)", fn, wType);
    }
    if (wType != ENGRAM_QWEIGHT_BF16 && scaleType != ENGRAM_QSCALE_F32 && scaleType != ENGRAM_QSCALE_UE8M0)
    {
        return fail(cudaErrorInvalidValue, "%s: scale_type must be 0 (float32) or 1 (ue8m0) (got %d)", fn, scaleType);
    }
    if (wType != ENGRAM_QWEIGHT_BF16 && (bn < 1 || bk < 1))
    {
        return fail(cudaErrorInvalidValue, "%s: block sizes bn, bk must be >= 1 (got %d, %d)", fn, bn, bk);
    }
    if (outFeatures < 1 || inFeatures < 1 || numExperts < 1 || outFeatures > INT32_MAX || inFeatures > INT32_MAX)
    {
        return fail(cudaErrorInvalidValue,
            "%s: need out_features, in_features in [1, 2^31 - 1] and num_experts >= 1 (got %lld, %lld, %d)", fn,
            ll(outFeatures), ll(inFeatures), numExperts);
    }
    if (wType == ENGRAM_QWEIGHT_FP4_E2M1 && inFeatures % 2 != 0)
    {
        return fail(
            cudaErrorInvalidValue, "%s: an FP4 weight needs an even in_features (got %lld)", fn, ll(inFeatures));
    }
    if (!isFloatType(outType))
    {
        return fail(cudaErrorInvalidValue, "%s: out_type must be an EngramFloatType (0 bf16, 1 f32, 2 f16; got %d)", fn,
            outType);
    }
    double const total
        = static_cast<double>(numExperts) * static_cast<double>(outFeatures) * static_cast<double>(inFeatures);
    if (total > 4.0e18)
    {
        return fail(cudaErrorInvalidValue, "%s: [%d, %lld, %lld] is too large", fn, numExperts, ll(outFeatures),
            ll(inFeatures));
    }
    if (w == nullptr || out == nullptr || (wType != ENGRAM_QWEIGHT_BF16 && wScale == nullptr))
    {
        return fail(cudaErrorInvalidValue, "%s: w, out (and w_scale for fp8 / fp4) must be device pointers", fn);
    }
    if (!isAligned(out, floatTypeBytes(outType)) || (wType == ENGRAM_QWEIGHT_BF16 && !isAligned(w, 2))
        || (wType != ENGRAM_QWEIGHT_BF16 && scaleType == ENGRAM_QSCALE_F32 && !isAligned(wScale, 4)))
    {
        return fail(cudaErrorInvalidValue, "%s: w, w_scale and out must be aligned to their element sizes", fn);
    }
    int64_t const count = static_cast<int64_t>(numExperts) * outFeatures * inFeatures;
    int64_t const want = (count + kQuantThreads - 1) / kQuantThreads;
    int const cap = smCount() > 0 ? smCount() * 16 : 2048;
    unsigned const blocks = static_cast<unsigned>(want < cap ? want : cap);
    resetLaunchError();
    dequantizeKernel<<<blocks, kQuantThreads, 0, stream>>>(static_cast<uint8_t const*>(w), wType, wScale,
        scaleType == ENGRAM_QSCALE_UE8M0 ? 1 : 0, bn, bk, outFeatures, inFeatures, count, out, outType);
    return checkLaunch(fn);
}
