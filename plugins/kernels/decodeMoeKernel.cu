// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * A decode step's MoE layer in three launches after its router's logits (engramKernels.h
 * states the contract; python/engram_trt/native/decode.py binds it; the references are
 * models/deepseek_v4/modules.py's SparseMoE, transformers' DeepseekV4SparseMoeBlock, and
 * Qwen4Exp's SparseMoE: a softmax router, a sigmoid-gated shared expert, the routed
 * experts' down weights side by side in one [D, E * I] stack):
 *
 *   engram_moe_route:  per token, the score function of the logits, the top-k by score
 *                      + correction bias (or the hash table's picks), the picked scores
 *                      renormalized and scaled, rounded where the reference's I/O-dtype
 *                      ops round (a block per token; one warp's arg-max rounds).
 *   engram_moe_experts_bf16, launch 1: the clamped SwiGLU of each (token, pick) and of the
 *                      shared expert: one warp per intermediate row reads the gate and up
 *                      rows of its expert, rounds both to bf16 as the projections do,
 *                      clamps, and writes bf16(bf16(silu(gate)) * up) to the workspace.
 *   launch 2:          one warp per (token, output channel): each pick's down row against
 *                      its activations, bf16-rounded and weighted as the reference's
 *                      expert output is, added in the reference's order (experts in
 *                      ascending id, each sum rounded to bf16: its index_add_), then the
 *                      shared expert's output added and rounded once more.
 *
 * The products are gemvKernel.cu's (16-byte loads, float32 lane sums in k order, a warp
 * butterfly), so the MoE differs from the reference by those sums' order alone. Each
 * expert's rows are read once per (token, pick); a decode step's few tokens mostly pick
 * different experts, and a repeat is served from L2.
 */
#include "decodeKernels.h"
#include "decodeMoeCommon.cuh"
#include "dependentLaunch.cuh"
#include "engramKernelsCore.h"
#include "engramKernelsInternal.h"
#include "vecLoad.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cmath>
#include <cstdint>

namespace engram_trt
{
namespace kernels
{

namespace
{

constexpr int kRouteThreads = 32;
constexpr int kExpertThreads = 128;

//! True when (a, ia) ranks before (b, ib) in torch.topk's order: larger first, NaN above
//! every number, equal values by the lower index.
__device__ __forceinline__ bool ranksBefore(float a, int ia, float b, int ib)
{
    bool const na = isnan(a);
    bool const nb = isnan(b);
    if (na != nb)
    {
        return na;
    }
    if (!na && a != b)
    {
        return a > b;
    }
    return ia < ib;
}

template <typename T>
__device__ __forceinline__ float scoreOf(float z, int32_t scoreFn)
{
    if (scoreFn == ENGRAM_MOE_SIGMOID)
    {
        return roundTo<T>(sigmoidOf(z));
    }
    // F.softplus (beta 1, threshold 20), rounded to the I/O type, then its square root
    float const softplus = roundTo<T>(z > 20.0F ? z : log1pf(expf(z)));
    return roundTo<T>(sqrtf(softplus));
}

/*
 * A warp per token. scores[e] in shared memory (I/O-rounded), keys = score + bias (top-k)
 * or the hash table's row; k rounds of a warp arg-max over the keys not yet picked.
 */
template <typename T>
__global__ void __launch_bounds__(kRouteThreads)
    moeRouteKernel(T const* __restrict__ logits, int64_t logitsStride, float const* __restrict__ bias,
        int64_t const* __restrict__ tid2eid, int64_t const* __restrict__ inputIds, int64_t vocab, int32_t numExperts,
        int32_t topK, int32_t scoreFn, float scaling, int32_t* __restrict__ ids, float* __restrict__ weights)
{
    __shared__ float scores[ENGRAM_MOE_MAX_EXPERTS];
    __shared__ float keys[ENGRAM_MOE_MAX_EXPERTS];
    __shared__ int32_t picked[ENGRAM_MOE_MAX_TOP_K];
    waitForPrimary(); // the logits come from the kernel before
    allowDependents();
    int64_t const t = blockIdx.x;
    int const lane = threadIdx.x;
    T const* const row = logits + t * logitsStride;
    bool const softmax = scoreFn == ENGRAM_MOE_SOFTMAX || scoreFn == ENGRAM_MOE_SOFTMAX_TOPK;
    float rowMax = -INFINITY;
    float rowSum = 0.0F;
    if (softmax)
    {
        // torch.softmax(logits, dtype=float32): exp(z - max) / sum, the sum in float32
        for (int32_t e = lane; e < numExperts; e += 32)
        {
            rowMax = fmaxf(rowMax, toFloat(row[e]));
        }
        rowMax = warpMax(rowMax);
        for (int32_t e = lane; e < numExperts; e += 32)
        {
            float const x = expf(toFloat(row[e]) - rowMax);
            scores[e] = x; // this lane's own experts: the loop below reads them back, no sync needed
            rowSum += x;
        }
        rowSum = warpSum(rowSum);
    }
    for (int32_t e = lane; e < numExperts; e += 32)
    {
        float const s = softmax ? __fdiv_rn(scores[e], rowSum) : scoreOf<T>(toFloat(row[e]), scoreFn);
        scores[e] = s;
        keys[e] = bias != nullptr ? __fadd_rn(s, bias[e]) : s;
    }
    __syncwarp();
    if (tid2eid != nullptr)
    {
        if (lane < topK)
        {
            int64_t const token = inputIds[t];
            int64_t const e = token >= 0 && token < vocab ? tid2eid[token * topK + lane] : -1;
            picked[lane] = e >= 0 && e < numExperts ? static_cast<int32_t>(e) : -1;
        }
    }
    else
    {
        for (int32_t j = 0; j < topK; ++j)
        {
            float best = 0.0F;
            int bestIndex = -1;
            for (int32_t e = lane; e < numExperts; e += 32)
            {
                float const k = keys[e];
                bool taken = false;
                for (int32_t q = 0; q < j; ++q)
                {
                    taken = taken || picked[q] == e;
                }
                if (!taken && (bestIndex < 0 || ranksBefore(k, e, best, bestIndex)))
                {
                    best = k;
                    bestIndex = e;
                }
            }
#pragma unroll
            for (int offset = 16; offset > 0; offset >>= 1)
            {
                float const other = __shfl_xor_sync(0xFFFFFFFFu, best, offset);
                int const otherIndex = __shfl_xor_sync(0xFFFFFFFFu, bestIndex, offset);
                if (otherIndex >= 0 && (bestIndex < 0 || ranksBefore(other, otherIndex, best, bestIndex)))
                {
                    best = other;
                    bestIndex = otherIndex;
                }
            }
            if (lane == 0)
            {
                picked[j] = bestIndex;
            }
            __syncwarp();
        }
    }
    __syncwarp();
    if (lane == 0)
    {
        // weights = scores.gather(ids); w / (w.sum() + 1e-20) * scaling, each op rounded to T
        float sum = 0.0F;
        for (int32_t j = 0; j < topK; ++j)
        {
            sum = __fadd_rn(sum, picked[j] >= 0 ? scores[picked[j]] : 0.0F);
        }
        float const denom = softmax ? sum : roundTo<T>(__fadd_rn(roundTo<T>(sum), 1e-20F));
        for (int32_t j = 0; j < topK; ++j)
        {
            int32_t const e = picked[j];
            float const w = e >= 0 ? scores[e] : 0.0F;
            ids[t * topK + j] = e;
            float weight = 0.0F;
            if (scoreFn == ENGRAM_MOE_SOFTMAX)
            {
                weight = __fmul_rn(__fdiv_rn(w, denom), scaling); // the picks renormalized in float32
            }
            else if (scoreFn == ENGRAM_MOE_SOFTMAX_TOPK)
            {
                weight = __fmul_rn(w, scaling);
            }
            else
            {
                weight = __fmul_rn(roundTo<T>(__fdiv_rn(w, denom)), scaling);
            }
            weights[t * topK + j] = roundTo<T>(weight);
        }
    }
}

//! sum_k w[k] x[k] over one row of `vectors` 16-byte vectors, float32 lane sums in k
//! order then a warp butterfly (gemvKernel.cu's product), in every lane.
__device__ __forceinline__ float rowDot(uint4 const* w, uint4 const* x, int32_t vectors)
{
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
    constexpr int U = 4;
    int const lane = threadIdx.x & 31;
    float acc = 0.0F;
    for (int32_t base = 0; base < vectors; base += 32 * U)
    {
        uint4 wr[U];
#pragma unroll
        for (int u = 0; u < U; ++u)
        {
            int32_t const v = base + lane + 32 * u;
            wr[u] = v < vectors ? loadStreaming(w + v) : make_uint4(0, 0, 0, 0);
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
            float xf[8];
            unpack8Pairs<__nv_bfloat162>(wr[u], wf);
            unpack8Pairs<__nv_bfloat162>(__ldg(x + v), xf);
#pragma unroll
            for (int i = 0; i < 8; ++i)
            {
                acc = fmaf(wf[i], xf[i], acc);
            }
        }
    }
    return warpSum(acc);
#else
    return 0.0F;
#endif
}

/*
 * Launch 1: a warp per (token, pick or shared, intermediate row). h[t, j, i] (bf16 in the
 * workspace, row stride hStride) = bf16(bf16(silu(g)) * u), g / u the clamped bf16 gate
 * and up products.
 */
__global__ void __launch_bounds__(kExpertThreads) moeGateUpKernel(EngramMoeExperts a, int64_t hStride)
{
    waitForPrimary(); // ids and x come from the kernels before
    allowDependents();
    int64_t const warp = (static_cast<int64_t>(blockIdx.x) * kExpertThreads + threadIdx.x) >> 5;
    int64_t const routedRows = static_cast<int64_t>(a.top_k) * a.intermediate;
    int64_t const perToken = routedRows + a.shared_intermediate;
    if (warp >= a.num_tokens * perToken)
    {
        return;
    }
    int64_t const t = warp / perToken;
    int64_t const r = warp - t * perToken;
    int32_t const j = r < routedRows ? static_cast<int32_t>(r / a.intermediate) : a.top_k;
    int64_t const i = r < routedRows ? r - static_cast<int64_t>(j) * a.intermediate : r - routedRows;
    auto* const h = static_cast<__nv_bfloat16*>(a.workspace) + (t * (a.top_k + 1) + j) * hStride;
    __nv_bfloat16 const* gateRow = nullptr;
    __nv_bfloat16 const* upRow = nullptr;
    if (j < a.top_k)
    {
        int32_t const e = a.ids[t * a.top_k + j];
        if (e < 0 || e >= a.num_experts)
        {
            if ((threadIdx.x & 31) == 0)
            {
                h[i] = __float2bfloat16_rn(0.0F);
            }
            return;
        }
        int64_t const offset = (static_cast<int64_t>(e) * a.intermediate + i) * a.hidden;
        gateRow = static_cast<__nv_bfloat16 const*>(a.gate) + offset;
        upRow = static_cast<__nv_bfloat16 const*>(a.up) + offset;
    }
    else
    {
        gateRow = static_cast<__nv_bfloat16 const*>(a.shared_gate) + i * a.hidden;
        upRow = static_cast<__nv_bfloat16 const*>(a.shared_up) + i * a.hidden;
    }
    auto const* const x = reinterpret_cast<uint4 const*>(static_cast<__nv_bfloat16 const*>(a.x) + t * a.hidden);
    int32_t const vectors = a.hidden / 8;
    float const g = rowDot(reinterpret_cast<uint4 const*>(gateRow), x, vectors);
    float const u = rowDot(reinterpret_cast<uint4 const*>(upRow), x, vectors);
    if ((threadIdx.x & 31) == 0)
    {
        h[i] = swigluBf16(g, u, a.clamp, a.limit);
    }
}

/*
 * Launch 2: a warp per (token, output channel d).
 */
__global__ void __launch_bounds__(kExpertThreads)
    moeDownKernel(EngramMoeExperts a, int64_t hStride, int64_t downExpertStride, int64_t downRowStride)
{
    waitForPrimary(); // the activations come from launch 1
    allowDependents();
    int64_t const warp = (static_cast<int64_t>(blockIdx.x) * kExpertThreads + threadIdx.x) >> 5;
    if (warp >= a.num_tokens * a.hidden)
    {
        return;
    }
    int64_t const t = warp / a.hidden;
    int64_t const d = warp - t * a.hidden;
    int32_t const* const tokenIds = a.ids + t * a.top_k;
    auto const* const hToken = static_cast<__nv_bfloat16 const*>(a.workspace) + t * (a.top_k + 1) * hStride;
    int32_t const vectors = a.intermediate / 8;
    float routed = 0.0F;
    // picks in ascending expert id (ties by pick), as the reference's loop over experts adds them
    int32_t lastId = -1;
    int32_t lastPick = -1;
    for (int32_t n = 0; n < a.top_k; ++n)
    {
        int32_t id = 0;
        int32_t const pick = nextPick(tokenIds, a.top_k, a.num_experts, lastId, lastPick, id);
        if (pick < 0)
        {
            break;
        }
        lastId = id;
        lastPick = pick;
        auto const* const w = static_cast<__nv_bfloat16 const*>(a.down) + static_cast<int64_t>(id) * downExpertStride
            + d * downRowStride;
        float const y = rowDot(reinterpret_cast<uint4 const*>(w),
            reinterpret_cast<uint4 const*>(hToken + static_cast<int64_t>(pick) * hStride), vectors);
        routed = roundBf16(__fadd_rn(routed, routedOutput(y, a.weights[t * a.top_k + pick])));
    }
    float out = routed;
    if (a.shared_intermediate > 0)
    {
        auto const* const w = static_cast<__nv_bfloat16 const*>(a.shared_down) + d * a.shared_intermediate;
        float const sum = rowDot(reinterpret_cast<uint4 const*>(w),
            reinterpret_cast<uint4 const*>(hToken + static_cast<int64_t>(a.top_k) * hStride),
            a.shared_intermediate / 8);
        // shared_expert(x) * sigmoid(shared_expert_gate(x)), each op rounded to bf16
        bool const scaled = a.shared_scale != nullptr;
        float const z = scaled
            ? __bfloat162float(static_cast<__nv_bfloat16 const*>(a.shared_scale)[t * a.shared_scale_stride])
            : 0.0F;
        out = __fadd_rn(routed, sharedOutput(sum, scaled, z));
    }
    if ((threadIdx.x & 31) == 0)
    {
        static_cast<__nv_bfloat16*>(a.out)[t * a.hidden + d] = __float2bfloat16_rn(out);
    }
}

} // namespace

} // namespace kernels
} // namespace engram_trt

using namespace engram_trt::kernels;

extern "C" ENGRAM_API int engram_moe_route(void const* logits, int32_t ioType, int64_t logitsStride, float const* bias,
    int64_t const* tid2eid, int64_t const* inputIds, int64_t vocabSize, int64_t numTokens, int32_t numExperts,
    int32_t topK, int32_t scoreFn, float scaling, int32_t* ids, float* weights, cudaStream_t stream)
{
    clearError();
    char const* const fn = "engram_moe_route";
    if (ioType != ENGRAM_FLOAT_BF16 && ioType != ENGRAM_FLOAT_F32 && ioType != ENGRAM_FLOAT_F16)
    {
        return fail(cudaErrorInvalidValue, "%s: io_type %d is not bf16 (0), fp32 (1) or fp16 (2)", fn, ioType);
    }
    if (numExperts < 1 || numExperts > ENGRAM_MOE_MAX_EXPERTS || topK < 1 || topK > ENGRAM_MOE_MAX_TOP_K
        || topK > numExperts)
    {
        return fail(cudaErrorInvalidValue,
            "%s: need 1 <= num_experts <= %d and 1 <= top_k <= min(num_experts, %d) (got %d, %d)", fn,
            ENGRAM_MOE_MAX_EXPERTS, ENGRAM_MOE_MAX_TOP_K, numExperts, topK);
    }
    if (scoreFn != ENGRAM_MOE_SQRT_SOFTPLUS && scoreFn != ENGRAM_MOE_SIGMOID && scoreFn != ENGRAM_MOE_SOFTMAX
        && scoreFn != ENGRAM_MOE_SOFTMAX_TOPK)
    {
        return fail(cudaErrorInvalidValue,
            "%s: score_fn %d is not sqrtsoftplus (0), sigmoid (1), softmax (2) or softmax_topk (3)", fn, scoreFn);
    }
    bool const softmaxFn = scoreFn == ENGRAM_MOE_SOFTMAX || scoreFn == ENGRAM_MOE_SOFTMAX_TOPK;
    bool const neither = bias == nullptr && tid2eid == nullptr; // a softmax router's plain top-k
    if ((bias != nullptr && tid2eid != nullptr) || (neither && !softmaxFn)
        || (tid2eid != nullptr && (inputIds == nullptr || vocabSize < 1)))
    {
        return fail(cudaErrorInvalidValue,
            "%s: give exactly one of bias (top-k routing) and tid2eid (hash routing, with input_ids and vocab_size)",
            fn);
    }
    if (numTokens < 0 || numTokens > INT32_MAX || logitsStride < numExperts)
    {
        return fail(cudaErrorInvalidValue,
            "%s: need num_tokens in [0, 2^31 - 1] and logits_stride >= num_experts "
            "(got %lld, %lld)",
            fn, ll(numTokens), ll(logitsStride));
    }
    if (!std::isfinite(scaling))
    {
        return fail(cudaErrorInvalidValue, "%s: scaling must be finite (got %g)", fn, static_cast<double>(scaling));
    }
    if (numTokens == 0)
    {
        return 0;
    }
    if (logits == nullptr || ids == nullptr || weights == nullptr)
    {
        return fail(cudaErrorInvalidValue, "%s: logits, ids and weights must be device pointers", fn);
    }
    dim3 const grid(static_cast<unsigned>(numTokens));
    resetLaunchError();
    switch (ioType)
    {
    case ENGRAM_FLOAT_BF16:
        launchDependent(moeRouteKernel<__nv_bfloat16>, grid, dim3(kRouteThreads), 0, stream,
            static_cast<__nv_bfloat16 const*>(logits), logitsStride, bias, tid2eid, inputIds, vocabSize, numExperts,
            topK, scoreFn, scaling, ids, weights);
        break;
    case ENGRAM_FLOAT_F16:
        launchDependent(moeRouteKernel<__half>, grid, dim3(kRouteThreads), 0, stream,
            static_cast<__half const*>(logits), logitsStride, bias, tid2eid, inputIds, vocabSize, numExperts, topK,
            scoreFn, scaling, ids, weights);
        break;
    default:
        launchDependent(moeRouteKernel<float>, grid, dim3(kRouteThreads), 0, stream, static_cast<float const*>(logits),
            logitsStride, bias, tid2eid, inputIds, vocabSize, numExperts, topK, scoreFn, scaling, ids, weights);
        break;
    }
    return checkLaunch(fn);
}

extern "C" ENGRAM_API int engram_moe_experts_workspace_size(
    int64_t numTokens, int32_t topK, int32_t intermediate, int32_t sharedIntermediate, size_t* bytes)
{
    clearError();
    if (bytes == nullptr || numTokens < 0 || numTokens > ENGRAM_MOE_DECODE_MAX_TOKENS || topK < 1
        || topK > ENGRAM_MOE_MAX_TOP_K || intermediate < 8 || sharedIntermediate < 0)
    {
        return fail(cudaErrorInvalidValue,
            "engram_moe_experts_workspace_size: need bytes != NULL, 0 <= num_tokens <= %d, 1 <= top_k <= %d, "
            "intermediate >= 8 and shared_intermediate >= 0 (got %lld, %d, %d, %d)",
            ENGRAM_MOE_DECODE_MAX_TOKENS, ENGRAM_MOE_MAX_TOP_K, ll(numTokens), topK, intermediate, sharedIntermediate);
    }
    *bytes = static_cast<size_t>(numTokens) * static_cast<size_t>(topK + 1)
        * static_cast<size_t>(moeHStride(intermediate, sharedIntermediate)) * 2;
    return 0;
}

int engram_trt::kernels::checkMoeExperts(char const* fn, EngramMoeExperts const& a, int64_t maxTokens,
    int (*sizeOf)(EngramMoeExperts const& a, size_t* bytes))
{
    if (a.num_tokens < 0 || a.num_tokens > maxTokens)
    {
        return fail(cudaErrorInvalidValue, "%s: num_tokens must be in [0, %lld] (a decode step; got %lld)", fn,
            ll(maxTokens), ll(a.num_tokens));
    }
    if (a.hidden < 8 || a.hidden % 8 != 0 || a.intermediate < 8 || a.intermediate % 8 != 0 || a.shared_intermediate < 0
        || a.shared_intermediate % 8 != 0)
    {
        return fail(cudaErrorInvalidValue,
            "%s: hidden and intermediate must be positive multiples of 8, shared_intermediate a multiple of 8 (got "
            "%d, %d, %d)",
            fn, a.hidden, a.intermediate, a.shared_intermediate);
    }
    if (a.num_experts < 1 || a.num_experts > ENGRAM_MOE_MAX_EXPERTS || a.top_k < 1 || a.top_k > ENGRAM_MOE_MAX_TOP_K)
    {
        return fail(cudaErrorInvalidValue, "%s: need 1 <= num_experts <= %d and 1 <= top_k <= %d (got %d, %d)", fn,
            ENGRAM_MOE_MAX_EXPERTS, ENGRAM_MOE_MAX_TOP_K, a.num_experts, a.top_k);
    }
    if (a.clamp != 0 && !(a.limit >= 0.0F))
    {
        return fail(cudaErrorInvalidValue, "%s: limit must be >= 0 when clamp is set (got %g)", fn,
            static_cast<double>(a.limit));
    }
    size_t need = 0;
    int const status = sizeOf(a, &need);
    if (status != 0)
    {
        return status;
    }
    if (a.num_tokens == 0)
    {
        return 0;
    }
    bool const shared = a.shared_intermediate > 0;
    void const* aligned[] = {a.x, a.gate, a.up, a.down, a.workspace};
    for (void const* p : aligned)
    {
        if (p == nullptr || !isAligned(p, 16))
        {
            return fail(cudaErrorInvalidValue,
                "%s: x, gate, up, down and workspace must be 16-byte aligned device "
                "pointers",
                fn);
        }
    }
    if (shared
        && (a.shared_gate == nullptr || a.shared_up == nullptr || a.shared_down == nullptr
            || !isAligned(a.shared_gate, 16) || !isAligned(a.shared_up, 16) || !isAligned(a.shared_down, 16)))
    {
        return fail(cudaErrorInvalidValue,
            "%s: shared_gate, shared_up and shared_down must be 16-byte aligned device "
            "pointers when shared_intermediate > 0",
            fn);
    }
    if (a.ids == nullptr || a.weights == nullptr || a.out == nullptr || !isAligned(a.out, 2))
    {
        return fail(cudaErrorInvalidValue, "%s: ids, weights and out must be device pointers", fn);
    }
    if (a.workspace_bytes < static_cast<int64_t>(need))
    {
        return fail(cudaErrorInvalidValue, "%s: workspace holds %lld bytes, %llu needed", fn, ll(a.workspace_bytes),
            static_cast<unsigned long long>(need));
    }
    if ((a.down_expert_stride == 0) != (a.down_row_stride == 0) || a.down_expert_stride < 0 || a.down_row_stride < 0
        || a.down_expert_stride % 8 != 0 || a.down_row_stride % 8 != 0
        || (a.down_row_stride != 0 && a.down_row_stride < a.intermediate))
    {
        return fail(cudaErrorInvalidValue,
            "%s: down_expert_stride and down_row_stride must both be 0 (a packed [E, D, I]) or both multiples of 8, "
            "down_row_stride >= intermediate (got %lld, %lld)",
            fn, ll(a.down_expert_stride), ll(a.down_row_stride));
    }
    if (a.shared_scale != nullptr && (!shared || a.shared_scale_stride < 1 || !isAligned(a.shared_scale, 2)))
    {
        return fail(cudaErrorInvalidValue,
            "%s: shared_scale needs a shared expert (shared_intermediate > 0), shared_scale_stride >= 1 and a "
            "2-byte aligned device pointer (got stride %lld)",
            fn, ll(a.shared_scale_stride));
    }
    int64_t const outBytes = a.num_tokens * a.hidden * 2;
    if (overlaps(a.out, outBytes, a.x, outBytes) || overlaps(a.out, outBytes, a.workspace, a.workspace_bytes)
        || overlaps(a.workspace, a.workspace_bytes, a.x, outBytes))
    {
        return fail(cudaErrorInvalidValue, "%s: out, x and workspace must not overlap", fn);
    }
    int const major = computeCapabilityMajor();
    if (major >= 0 && major < 9)
    {
        return fail(
            cudaErrorNotSupported, "%s: needs a GPU of compute capability 9.0 or later (this one is %d.x)", fn, major);
    }
    return 0;
}

extern "C" ENGRAM_API int engram_moe_experts_bf16(EngramMoeExperts const* args, cudaStream_t stream)
{
    clearError();
    char const* const fn = "engram_moe_experts_bf16";
    if (args == nullptr)
    {
        return fail(cudaErrorInvalidValue, "%s: args must not be NULL", fn);
    }
    EngramMoeExperts const a = *args;
    int status = checkMoeExperts(fn, a, ENGRAM_MOE_DECODE_MAX_TOKENS, [](EngramMoeExperts const& e, size_t* bytes) {
        return engram_moe_experts_workspace_size(e.num_tokens, e.top_k, e.intermediate, e.shared_intermediate, bytes);
    });
    if (status != 0 || a.num_tokens == 0)
    {
        return status;
    }
    int64_t const hStride = moeHStride(a.intermediate, a.shared_intermediate);
    int64_t const gateUpWarps = a.num_tokens * (static_cast<int64_t>(a.top_k) * a.intermediate + a.shared_intermediate);
    int64_t const downWarps = a.num_tokens * a.hidden;
    int64_t const warpsPerBlock = kExpertThreads / 32;
    resetLaunchError();
    launchDependent(moeGateUpKernel, dim3(static_cast<unsigned>((gateUpWarps + warpsPerBlock - 1) / warpsPerBlock)),
        dim3(kExpertThreads), 0, stream, a, hStride);
    status = checkLaunch("engram_moe_experts_bf16 (gate / up)");
    if (status != 0)
    {
        return status;
    }
    resetLaunchError();
    bool const packed = a.down_expert_stride == 0;
    int64_t const downExpertStride = packed ? static_cast<int64_t>(a.hidden) * a.intermediate : a.down_expert_stride;
    int64_t const downRowStride = packed ? static_cast<int64_t>(a.intermediate) : a.down_row_stride;
    launchDependent(moeDownKernel, dim3(static_cast<unsigned>((downWarps + warpsPerBlock - 1) / warpsPerBlock)),
        dim3(kExpertThreads), 0, stream, a, hStride, downExpertStride, downRowStride);
    return checkLaunch("engram_moe_experts_bf16 (down)");
}
