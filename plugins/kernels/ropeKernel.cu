// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * RoPE of a fused qkv projection and the in-place KV write (engram_rope_kv_cache_write):
 * what the PyTorch reference does in about a dozen launches (two rotations of five ops
 * each, two index_put writes) in one.
 *
 * One block per token. A work item is either a rotating pair of V-element vectors of one
 * q or k head (elements d .. d+V-1 of the first half and of the second half of the head
 * dim, read from the token's qkv row; each output rounded as torch rounds
 * q * c + rotate_half(q) * s: the two products, then their sum), or one V-element vector
 * of a v head (a bit copy). Rotated q heads go to q_out, rotated k heads and the v heads
 * to the caches at (slot, position), with the bounds of kvCacheWriteKernel: a token
 * outside the cache writes no K/V. V = 8 (16-byte loads) when head_dim % 16 == 0, else 4
 * (head_dim % 8 == 0 is the attention's limit, so half a head is whole 4-vectors).
 */
#include "attentionInternal.h"
#include "attentionKernels.h"
#include "dependentLaunch.cuh"
#include "engramKernelsInternal.h"
#include "vecLoad.cuh"

#include <cuda_bf16.h>

#include <cstdint>

namespace engram_trt
{
namespace kernels
{

constexpr int kRopeMaxThreads = 256;

namespace
{

template <int V>
__global__ void __launch_bounds__(kRopeMaxThreads)
    ropeKvCacheWriteKernel(__nv_bfloat16 const* __restrict__ qkv, __nv_bfloat16 const* __restrict__ cosTable,
        __nv_bfloat16 const* __restrict__ sinTable, int32_t const* __restrict__ tokenSlot,
        int32_t const* __restrict__ tokenPos, int32_t numHeads, int32_t numKvHeads, int32_t headDim, int64_t numSlots,
        int64_t maxSeqLen, __nv_bfloat16* keyCache, __nv_bfloat16* valueCache, __nv_bfloat16* __restrict__ qOut)
{
    waitForPrimary(); // qkv comes from the kernel before; the cache may be read after (dependentLaunch.cuh)
    allowDependents();
    int64_t const t = blockIdx.x;
    int32_t const slot = tokenSlot[t];
    int32_t const pos = tokenPos[t];
    bool const write = slot >= 0 && slot < numSlots && pos >= 0 && pos < maxSeqLen;
    int32_t const half = headDim / 2;
    int32_t const pairVectors = half / V;
    int32_t const rotItems = (numHeads + numKvHeads) * pairVectors;
    int32_t const valueItems = numKvHeads * (headDim / V);
    int64_t const rowElements = static_cast<int64_t>(numHeads + 2 * numKvHeads) * headDim;
    __nv_bfloat16 const* const row = qkv + t * rowElements;
    __nv_bfloat16 const* const cosRow = cosTable + t * headDim;
    __nv_bfloat16 const* const sinRow = sinTable + t * headDim;
    // Where token t's row of KV head h starts in either cache.
    auto cacheRow
        = [&](int32_t h) { return ((static_cast<int64_t>(slot) * numKvHeads + h) * maxSeqLen + pos) * headDim; };

    for (int32_t e = threadIdx.x; e < rotItems + valueItems; e += blockDim.x)
    {
        if (e < rotItems)
        {
            int32_t const head = e / pairVectors; // q heads, then k heads
            int32_t const d = (e - head * pairVectors) * V;
            bool const isQ = head < numHeads;
            if (!isQ && !write)
            {
                continue;
            }
            __nv_bfloat16 const* const src = row + static_cast<int64_t>(head) * headDim;
            float x1[V], x2[V], c1[V], c2[V], s1[V], s2[V];
            loadBf16<V>(src + d, x1);
            loadBf16<V>(src + half + d, x2);
            loadBf16<V>(cosRow + d, c1);
            loadBf16<V>(cosRow + half + d, c2);
            loadBf16<V>(sinRow + d, s1);
            loadBf16<V>(sinRow + half + d, s2);
            float o1[V], o2[V];
#pragma unroll
            for (int i = 0; i < V; ++i)
            {
                // rotate_half(x) = cat(-x2, x1); each product and the sum rounded to bf16.
                o1[i] = roundBf16(roundBf16(x1[i] * c1[i]) + roundBf16(-x2[i] * s1[i]));
                o2[i] = roundBf16(roundBf16(x2[i] * c2[i]) + roundBf16(x1[i] * s2[i]));
            }
            __nv_bfloat16* const dst
                = isQ ? qOut + (t * numHeads + head) * headDim : keyCache + cacheRow(head - numHeads);
            storeBf16<V>(dst + d, o1);
            storeBf16<V>(dst + half + d, o2);
        }
        else if (write)
        {
            int32_t const item = e - rotItems;
            int32_t const h = item / (headDim / V);
            int32_t const d = (item - h * (headDim / V)) * V;
            __nv_bfloat16 const* const src = row + static_cast<int64_t>(numHeads + numKvHeads + h) * headDim + d;
            __nv_bfloat16* const dst = valueCache + cacheRow(h) + d;
            if constexpr (V == 8)
            {
                *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<uint4 const*>(src);
            }
            else
            {
                *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<uint2 const*>(src);
            }
        }
    }
}

} // namespace

int launchRopeKvCacheWrite(void const* qkv, void const* cosTable, void const* sinTable, int32_t const* tokenSlot,
    int32_t const* tokenPos, int64_t numTokens, int32_t numHeads, int32_t numKvHeads, int32_t headDim, void* keyCache,
    void* valueCache, int64_t numSlots, int64_t maxSeqLen, void* qOut, cudaStream_t stream)
{
    int const width = headDim % 16 == 0 ? 8 : 4;
    int64_t const items
        = static_cast<int64_t>(numHeads + numKvHeads) * (headDim / 2 / width) + numKvHeads * (headDim / width);
    int threads = static_cast<int>((items + 31) / 32 * 32);
    threads = threads > kRopeMaxThreads ? kRopeMaxThreads : threads;
    auto const* const in = static_cast<__nv_bfloat16 const*>(qkv);
    auto const* const c = static_cast<__nv_bfloat16 const*>(cosTable);
    auto const* const s = static_cast<__nv_bfloat16 const*>(sinTable);
    auto* const k = static_cast<__nv_bfloat16*>(keyCache);
    auto* const v = static_cast<__nv_bfloat16*>(valueCache);
    auto* const q = static_cast<__nv_bfloat16*>(qOut);
    dim3 const grid(static_cast<unsigned>(numTokens));
    resetLaunchError();
    if (width == 8)
    {
        launchDependent(ropeKvCacheWriteKernel<8>, grid, threads, 0, stream, in, c, s, tokenSlot, tokenPos, numHeads,
            numKvHeads, headDim, numSlots, maxSeqLen, k, v, q);
    }
    else
    {
        launchDependent(ropeKvCacheWriteKernel<4>, grid, threads, 0, stream, in, c, s, tokenSlot, tokenPos, numHeads,
            numKvHeads, headDim, numSlots, maxSeqLen, k, v, q);
    }
    return checkLaunch("engram_rope_kv_cache_write");
}

} // namespace kernels
} // namespace engram_trt
