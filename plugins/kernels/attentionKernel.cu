// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * Packed-token attention over a slot-indexed KV cache, and the in-place KV write.
 *
 * Write: one block per token copies its num_kv_heads k / v rows (16-byte vectors) to
 * key_cache[slot, h, pos, :] / value_cache[slot, h, pos, :].
 *
 * Attention: one block of 128 threads per (token, KV head, group of up to 8 query heads
 * of that KV head, key split). The block streams the token's keys, 32 positions per tile,
 * through shared memory: the cache rows of one (slot, KV head) are contiguous, so a tile
 * is one coalesced 32 * head_dim run of K and one of V, converted to float once and read
 * by every query head of the group (GQA costs no extra traffic). Per tile:
 *   scores  warp w owns query heads w and w + 4; lane j computes key j's dot products
 *           with both (K rows padded to head_dim + 4 floats: float4 reads without bank
 *           conflicts; the query is a broadcast read);
 *   softmax the owning warp takes the tile maximum, rescales its running sum (online
 *           softmax, base 2: the scale is folded into the query with log2(e)) and writes
 *           the probabilities;
 *   values  thread d accumulates column d (and d + 128) of every head's output in
 *           registers, after rescaling them by the tile's correction.
 * All math is fp32; the output is rounded once to the I/O type.
 *
 * bf16 / fp16 steps of head_dim 128 with up to 4 query heads per KV head run the warp
 * kernel instead on sm_90 and later (attentionWarpKernel.cu; warpKernel() there chooses
 * it); it writes what the tiled kernel writes, the output or the split partials.
 *
 * Key splits (flash-decoding): a step of few tokens would give the GPU only
 * tokens * KV heads blocks, each streaming a whole context. Such steps split each token's
 * keys into chunks of at least kAttnMinKeysPerSplit positions, one block each; the blocks
 * write their partial (max, sum, unnormalized output) to the workspace and a second
 * kernel merges them. The split count depends only on the step's shape (planAttention),
 * never on the device, so a workspace sized at engine build time always suffices.
 *
 * The checks and the split plan live in attentionApi.cpp; the parameters, the block's
 * work and the device helpers both kernel files use in attentionDevice.cuh.
 *
 * Bounds: the kernels read token_slot / token_pos once per block; an out-of-range slot or
 * position writes nothing and gives a zero output row; the key range of a valid token is
 * 0 .. pos within its own slot, inside the cache by construction.
 */
#include "attentionDevice.cuh"
#include "attentionInternal.h"
#include "attentionKernels.h"
#include "engramKernelsCore.h"
#include "engramKernelsInternal.h"
#include "vecLoad.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

namespace engram_trt
{
namespace kernels
{

constexpr int kAttnColsPerThread = ENGRAM_ATTENTION_MAX_HEAD_DIM / kAttnThreads;
constexpr int kAttnDefaultSharedBytes = 48 * 1024;
constexpr float kLog2e = 1.4426950408889634F;

static_assert(kAttnHeadsPerBlock == 2 * kAttnWarps, "each warp owns two query heads of the block");
static_assert(kAttnColsPerThread * kAttnThreads == ENGRAM_ATTENTION_MAX_HEAD_DIM, "head_dim columns per thread");

// --- KV write ---------------------------------------------------------------------------

__global__ void __launch_bounds__(kAttnThreads) kvCacheWriteKernel(uint4 const* __restrict__ k,
    uint4 const* __restrict__ v, int32_t const* __restrict__ tokenSlot, int32_t const* __restrict__ tokenPos,
    int32_t numKvHeads, int32_t vectorsPerRow, int64_t numSlots, int64_t maxSeqLen, uint4* keyCache, uint4* valueCache)
{
    int64_t const t = blockIdx.x;
    int32_t const slot = tokenSlot[t];
    int32_t const pos = tokenPos[t];
    if (!inCache(slot, pos, numSlots, maxSeqLen))
    {
        return; // a padding token (or a caller bug): nothing is written
    }
    int32_t const vectors = numKvHeads * vectorsPerRow;
    for (int32_t e = threadIdx.x; e < vectors; e += blockDim.x)
    {
        int32_t const h = e / vectorsPerRow;
        int32_t const c = e % vectorsPerRow;
        int64_t const src = (t * numKvHeads + h) * vectorsPerRow + c;
        int64_t const dst = ((static_cast<int64_t>(slot) * numKvHeads + h) * maxSeqLen + pos) * vectorsPerRow + c;
        keyCache[dst] = k[src];
        valueCache[dst] = v[src];
    }
}

// --- attention ----------------------------------------------------------------------------

//! Shared memory of one attention block, in floats: the scaled queries, a K tile (rows
//! padded to head_dim + 4), a V tile, the tile's probabilities [kAttnTile][8] and the
//! per-head correction, sum and max.
__host__ __device__ constexpr int64_t attentionSharedFloats(int32_t headsPerBlock, int32_t headDim)
{
    return static_cast<int64_t>(headsPerBlock) * headDim + static_cast<int64_t>(kAttnTile) * (headDim + 4)
        + static_cast<int64_t>(kAttnTile) * headDim + kAttnTile * kAttnHeadsPerBlock + 3 * kAttnHeadsPerBlock;
}

template <typename T>
__global__ void __launch_bounds__(kAttnThreads) packedAttentionKernel(AttentionParams const p)
{
    extern __shared__ float4 sharedVectors[];
    float* const shared = reinterpret_cast<float*>(sharedVectors);

    BlockWork const work = blockWork(p);
    int64_t const t = work.t;
    int32_t const kvHead = work.kvHead;
    int32_t const split = work.split;
    int32_t const nh = work.nh;
    int32_t const head0 = work.head0; // the block's first query head
    int32_t const hd = p.headDim;
    int32_t const kStride = hd + 4;
    int32_t const warp = threadIdx.x / 32;
    int32_t const lane = threadIdx.x % 32;

    float* const qS = shared;                                 // [headsPerBlock][hd]
    float* const kS = qS + p.headsPerBlock * hd;              // [kAttnTile][hd + 4]
    float* const vS = kS + kAttnTile * kStride;               // [kAttnTile][hd]
    float* const pS = vS + kAttnTile * hd;                    // [kAttnTile][kAttnHeadsPerBlock]
    float* const corrS = pS + kAttnTile * kAttnHeadsPerBlock; // [kAttnHeadsPerBlock]
    float* const sumS = corrS + kAttnHeadsPerBlock;
    float* const maxS = sumS + kAttnHeadsPerBlock;

    int32_t const slot = work.slot;
    int64_t const keyBegin = work.keyBegin;
    int64_t const keyEnd = work.keyEnd;
    bool const hasKeys = work.hasKeys;

    float acc[kAttnColsPerThread][kAttnHeadsPerBlock];
#pragma unroll
    for (int c = 0; c < kAttnColsPerThread; ++c)
    {
#pragma unroll
        for (int g = 0; g < kAttnHeadsPerBlock; ++g)
        {
            acc[c][g] = 0.0F;
        }
    }

    if (hasKeys)
    {
        T const* q = static_cast<T const*>(p.q);
        int32_t const vectorsPerRow = hd / 8;
        for (int32_t e = threadIdx.x; e < nh * vectorsPerRow; e += kAttnThreads)
        {
            int32_t const g = e / vectorsPerRow;
            int32_t const c = (e % vectorsPerRow) * 8;
            float v[8];
            load8(q + (t * p.numHeads + head0 + g) * hd + c, v);
#pragma unroll
            for (int i = 0; i < 8; ++i)
            {
                qS[g * hd + c + i] = v[i] * p.scaleLog2;
            }
        }
        // Running max (log2 units) and sum of the two heads this warp owns; every lane
        // holds the same values (they come out of warp reductions).
        int32_t const g0 = warp;
        int32_t const g1 = warp + kAttnWarps;
        float runMax[2] = {-INFINITY, -INFINITY};
        float runSum[2] = {0.0F, 0.0F};

        int64_t const rowBase = (static_cast<int64_t>(slot) * p.numKvHeads + kvHead) * p.maxSeqLen;
        T const* keys = static_cast<T const*>(p.keyCache) + rowBase * hd;
        T const* values = static_cast<T const*>(p.valueCache) + rowBase * hd;
        for (int64_t k0 = keyBegin; k0 < keyEnd; k0 += kAttnTile)
        {
            int32_t const n = static_cast<int32_t>(min(static_cast<int64_t>(kAttnTile), keyEnd - k0));
            __syncthreads(); // the previous tile's readers are done (and qS is written)
            for (int32_t e = threadIdx.x; e < n * vectorsPerRow; e += kAttnThreads)
            {
                int32_t const j = e / vectorsPerRow;
                int32_t const c = (e % vectorsPerRow) * 8;
                int64_t const offset = (k0 + j) * hd + c;
                float kv[8], vv[8];
                load8(keys + offset, kv);
                load8(values + offset, vv);
                float4* kDst = reinterpret_cast<float4*>(kS + j * kStride + c);
                float4* vDst = reinterpret_cast<float4*>(vS + j * hd + c);
                kDst[0] = make_float4(kv[0], kv[1], kv[2], kv[3]);
                kDst[1] = make_float4(kv[4], kv[5], kv[6], kv[7]);
                vDst[0] = make_float4(vv[0], vv[1], vv[2], vv[3]);
                vDst[1] = make_float4(vv[4], vv[5], vv[6], vv[7]);
            }
            __syncthreads();

            // scores of key `lane` for heads g0 and g1 (both read the K row once)
            bool const two = g1 < nh;
            if (g0 < nh)
            {
                float s0 = -INFINITY;
                float s1 = -INFINITY;
                if (lane < n)
                {
                    float const* kRow = kS + lane * kStride;
                    float const* q0 = qS + g0 * hd;
                    float const* q1 = qS + (two ? g1 : g0) * hd;
                    float a0 = 0.0F, a1 = 0.0F, b0 = 0.0F, b1 = 0.0F;
                    for (int32_t d = 0; d < hd; d += 8)
                    {
                        float4 const ka = *reinterpret_cast<float4 const*>(kRow + d);
                        float4 const kb = *reinterpret_cast<float4 const*>(kRow + d + 4);
                        float4 const qa = *reinterpret_cast<float4 const*>(q0 + d);
                        float4 const qb = *reinterpret_cast<float4 const*>(q0 + d + 4);
                        a0 += qa.x * ka.x + qa.y * ka.y + qa.z * ka.z + qa.w * ka.w;
                        a1 += qb.x * kb.x + qb.y * kb.y + qb.z * kb.z + qb.w * kb.w;
                        if (two)
                        {
                            float4 const ra = *reinterpret_cast<float4 const*>(q1 + d);
                            float4 const rb = *reinterpret_cast<float4 const*>(q1 + d + 4);
                            b0 += ra.x * ka.x + ra.y * ka.y + ra.z * ka.z + ra.w * ka.w;
                            b1 += rb.x * kb.x + rb.y * kb.y + rb.z * kb.z + rb.w * kb.w;
                        }
                    }
                    s0 = a0 + a1;
                    s1 = b0 + b1;
                }
#pragma unroll
                for (int i = 0; i < 2; ++i)
                {
                    if (i == 1 && !two)
                    {
                        break;
                    }
                    float const s = i == 0 ? s0 : s1;
                    int32_t const g = i == 0 ? g0 : g1;
                    float const newMax = fmaxf(runMax[i], warpMax(s));
                    // exp2(-inf - x) is 0, but -inf - -inf is NaN: the first tile (and a tile
                    // of -inf scores, from infinite inputs) must not take that path.
                    float const corr = runMax[i] == -INFINITY ? 0.0F : exp2f(runMax[i] - newMax);
                    float const prob = s == -INFINITY ? 0.0F : exp2f(s - newMax);
                    runSum[i] = runSum[i] * corr + warpSum(prob);
                    runMax[i] = newMax;
                    pS[lane * kAttnHeadsPerBlock + g] = prob;
                    if (lane == 0)
                    {
                        corrS[g] = corr;
                    }
                }
            }
            __syncthreads();

            // out[g, d] = out[g, d] * corr[g] + sum_j p[j, g] * V[j, d]. The tile's terms are
            // summed apart and added to the running output once per tile: one running sum over
            // a whole context (4,095 keys: 4,095 roundings of a growing sum) put fp32 outputs
            // past 2e-6 of max|out| on some inputs, where the split kernel's shorter sums did not.
#pragma unroll
            for (int c = 0; c < kAttnColsPerThread; ++c)
            {
                int32_t const d = threadIdx.x + c * kAttnThreads;
                if (d < hd)
                {
                    float tile[kAttnHeadsPerBlock];
#pragma unroll
                    for (int g = 0; g < kAttnHeadsPerBlock; ++g)
                    {
                        tile[g] = 0.0F;
                    }
                    for (int32_t j = 0; j < n; ++j)
                    {
                        float const v = vS[j * hd + d];
                        float4 const pa = *reinterpret_cast<float4 const*>(pS + j * kAttnHeadsPerBlock);
                        float4 const pb = *reinterpret_cast<float4 const*>(pS + j * kAttnHeadsPerBlock + 4);
                        float const prob[kAttnHeadsPerBlock] = {pa.x, pa.y, pa.z, pa.w, pb.x, pb.y, pb.z, pb.w};
#pragma unroll
                        for (int g = 0; g < kAttnHeadsPerBlock; ++g)
                        {
                            if (g < nh)
                            {
                                tile[g] += prob[g] * v;
                            }
                        }
                    }
#pragma unroll
                    for (int g = 0; g < kAttnHeadsPerBlock; ++g)
                    {
                        if (g < nh)
                        {
                            acc[c][g] = acc[c][g] * corrS[g] + tile[g];
                        }
                    }
                }
            }
        }
        if (lane == 0)
        {
            if (g0 < nh)
            {
                sumS[g0] = runSum[0];
                maxS[g0] = runMax[0];
            }
            if (g1 < nh)
            {
                sumS[g1] = runSum[1];
                maxS[g1] = runMax[1];
            }
        }
    }
    __syncthreads();

#pragma unroll
    for (int c = 0; c < kAttnColsPerThread; ++c)
    {
        int32_t const d = threadIdx.x + c * kAttnThreads;
        if (d >= hd)
        {
            continue;
        }
#pragma unroll
        for (int g = 0; g < kAttnHeadsPerBlock; ++g)
        {
            if (g >= nh)
            {
                continue;
            }
            int64_t const th = t * p.numHeads + head0 + g;
            if (p.splits == 1)
            {
                // hasKeys is false only for an out-of-cache token: its row is zero
                float const value = hasKeys ? acc[c][g] / sumS[g] : 0.0F;
                static_cast<T*>(p.out)[th * hd + d] = fromFloat<T>(value);
            }
            else
            {
                int64_t const part = th * p.splits + split;
                p.partialAcc[part * hd + d] = acc[c][g];
                if (d == 0)
                {
                    p.partialStats[2 * part] = hasKeys ? maxS[g] : -INFINITY;
                    p.partialStats[2 * part + 1] = hasKeys ? sumS[g] : 0.0F;
                }
            }
        }
    }
}

//! Merges the key splits of every (token, head): out = sum_z w_z acc_z / sum_z w_z l_z
//! with w_z = 2^(m_z - max_z m_z); a row with no keys in any split (an out-of-cache
//! token) is zero.
template <typename T>
__global__ void __launch_bounds__(kAttnThreads) attentionMergeKernel(float const* __restrict__ partialAcc,
    float const* __restrict__ partialStats, int32_t splits, int32_t headDim, T* out)
{
    int64_t const th = blockIdx.x; // token * num_heads + head
    float const* stats = partialStats + th * splits * 2;
    float maxAll = -INFINITY;
    for (int32_t z = 0; z < splits; ++z)
    {
        maxAll = fmaxf(maxAll, stats[2 * z]);
    }
    float sum = 0.0F;
    for (int32_t z = 0; z < splits; ++z)
    {
        float const m = stats[2 * z];
        sum += m == -INFINITY ? 0.0F : exp2f(m - maxAll) * stats[2 * z + 1];
    }
    bool const hasKeys = maxAll != -INFINITY;
    for (int32_t d = threadIdx.x; d < headDim; d += blockDim.x)
    {
        float value = 0.0F;
        if (hasKeys)
        {
            for (int32_t z = 0; z < splits; ++z)
            {
                float const m = stats[2 * z];
                if (m != -INFINITY)
                {
                    value += exp2f(m - maxAll) * partialAcc[(th * splits + z) * headDim + d];
                }
            }
            value /= sum;
        }
        out[th * headDim + d] = fromFloat<T>(value);
    }
}

namespace
{

template <typename T>
int enqueueAttention(AttentionParams const& params, int64_t numTokens, size_t sharedBytes, cudaStream_t stream)
{
    if (sharedBytes > static_cast<size_t>(kAttnDefaultSharedBytes))
    {
        cudaError_t const status = cudaFuncSetAttribute(
            packedAttentionKernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(sharedBytes));
        if (status != cudaSuccess)
        {
            return failCuda(status, "engram_attention: %zu bytes of shared memory per block are not available: %s",
                sharedBytes, cudaGetErrorString(status));
        }
    }
    dim3 const grid(static_cast<unsigned>(numTokens), static_cast<unsigned>(params.numKvHeads * params.headBlocks),
        static_cast<unsigned>(params.splits));
    resetLaunchError();
    if (auto const kernel = warpKernel<T>(params.headDim, params.headsPerBlock))
    {
        kernel<<<grid, kAttnThreads, 0, stream>>>(params);
    }
    else
    {
        packedAttentionKernel<T><<<grid, kAttnThreads, sharedBytes, stream>>>(params);
    }
    if (int const status = checkLaunch("engram_attention"))
    {
        return status;
    }
    if (params.splits > 1)
    {
        dim3 const mergeGrid(static_cast<unsigned>(numTokens * params.numHeads));
        attentionMergeKernel<T><<<mergeGrid, kAttnThreads, 0, stream>>>(
            params.partialAcc, params.partialStats, params.splits, params.headDim, static_cast<T*>(params.out));
        return checkLaunch("engram_attention merge");
    }
    return 0;
}

} // namespace

int launchAttention(void const* q, int32_t ioType, void const* keyCache, void const* valueCache,
    int32_t const* tokenSlot, int32_t const* tokenPos, int64_t numTokens, int32_t numHeads, int32_t numKvHeads,
    int32_t headDim, int64_t numSlots, int64_t maxSeqLen, float scale, AttentionPlan const& plan, void* workspace,
    void* out, cudaStream_t stream)
{
    AttentionParams params{};
    params.q = q;
    params.keyCache = keyCache;
    params.valueCache = valueCache;
    params.tokenSlot = tokenSlot;
    params.tokenPos = tokenPos;
    params.out = out;
    if (plan.splits > 1)
    {
        params.partialAcc = static_cast<float*>(workspace);
        params.partialStats = params.partialAcc + numTokens * numHeads * plan.splits * headDim;
    }
    params.numSlots = numSlots;
    params.maxSeqLen = maxSeqLen;
    params.keysPerSplit = plan.keysPerSplit;
    params.scaleLog2 = scale * kLog2e;
    params.numHeads = numHeads;
    params.numKvHeads = numKvHeads;
    params.headDim = headDim;
    params.headsPerBlock = plan.headsPerBlock;
    params.headBlocks = plan.headBlocks;
    params.splits = plan.splits;
    size_t const sharedBytes = static_cast<size_t>(attentionSharedFloats(plan.headsPerBlock, headDim)) * sizeof(float);
    switch (ioType)
    {
    case ENGRAM_FLOAT_BF16: return enqueueAttention<__nv_bfloat16>(params, numTokens, sharedBytes, stream);
    case ENGRAM_FLOAT_F16: return enqueueAttention<__half>(params, numTokens, sharedBytes, stream);
    default: return enqueueAttention<float>(params, numTokens, sharedBytes, stream);
    }
}

int launchKvCacheWrite(void const* k, void const* v, int32_t ioType, int32_t const* tokenSlot, int32_t const* tokenPos,
    int64_t numTokens, int32_t numKvHeads, int32_t headDim, void* keyCache, void* valueCache, int64_t numSlots,
    int64_t maxSeqLen, cudaStream_t stream)
{
    int32_t const elementBytes = ioType == ENGRAM_FLOAT_F32 ? 4 : 2;
    int32_t const vectorsPerRow = headDim * elementBytes / 16; // head_dim % 8 == 0: whole vectors
    resetLaunchError();
    kvCacheWriteKernel<<<static_cast<unsigned>(numTokens), kAttnThreads, 0, stream>>>(static_cast<uint4 const*>(k),
        static_cast<uint4 const*>(v), tokenSlot, tokenPos, numKvHeads, vectorsPerRow, numSlots, maxSeqLen,
        static_cast<uint4*>(keyCache), static_cast<uint4*>(valueCache));
    return checkLaunch("engram_kv_cache_write");
}

} // namespace kernels
} // namespace engram_trt
