// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * The warp attention kernel (warpAttentionKernel; bf16 / fp16, head_dim 128, up to 4 query
 * heads per KV head, sm_90 and later: the shapes measured on the H200) and warpKernel(), by
 * which the launch (enqueueAttention, attentionKernel.cu) picks it. The same blocks as the
 * tiled kernel of attentionKernel.cu, but each warp owns 32-key chunks of the block's keys
 * and nothing waits on a block barrier until the warps' partial results meet at the end.
 * The tiled kernel's three barriers and shared-memory passes per 32-key tile held its decode
 * steps to 0.35-0.42 TB/s on the H200; the warp kernel reads them at 2.7-3.4 TB/s. The tiled
 * kernel stays for every other case (and ENGRAM_TRT_ATTENTION_KERNEL=tiled). The key splits,
 * their workspace and the merge are the tiled kernel's (attentionKernel.cu).
 */
#include "attentionDevice.cuh"
#include "attentionKernels.h"
#include "engramKernelsInternal.h"
#include "vecLoad.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace engram_trt
{
namespace kernels
{

namespace
{

//! The 4 16-bit values of one 8-byte word (already in registers) as floats.
template <typename T>
__device__ __forceinline__ void unpack4(uint2 raw, float (&v)[4])
{
    using Pair = typename PairOf<T>::type;
    float2 const a = unpackPair(*reinterpret_cast<Pair const*>(&raw.x));
    float2 const b = unpackPair(*reinterpret_cast<Pair const*>(&raw.y));
    v[0] = a.x, v[1] = a.y, v[2] = b.x, v[3] = b.y;
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900 // used by the sm_90+ kernels only
//! 16 bytes global -> shared without a register (cp.async, sm_80+; a plain copy below).
__device__ __forceinline__ void copy16ToShared(uint4* dst, uint4 const* src)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    auto const address = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(address), "l"(src));
#else
    *dst = *src;
#endif
}

//! Waits for this thread's copy16ToShared() calls.
__device__ __forceinline__ void waitCopiesToShared()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;" ::: "memory");
#endif
}

#endif

} // namespace

//! The same attention with warps that own keys (16-bit I/O, head_dim 128): no block
//! barrier per tile. Warp w takes the 32-key chunks w, w + 4, ... of the block's key range;
//! lane j scores key j of a chunk against the G query heads (its K row staged in the
//! warp's shared tile, the scaled queries a broadcast read of shared memory), the warp's
//! online softmax follows from warp reductions, and for the values lane j owns output
//! columns 4 j .. 4 j + 3, each key's probability broadcast by a shuffle while the warp
//! reads the key's V row in one coalesced pass. The four warps' (max, sum, output)
//! meet once in shared memory at the end. Writes what packedAttentionKernel writes (the
//! output, or the split partials the merge kernel reads).
template <typename T, int G>
__global__ void __launch_bounds__(kAttnThreads) warpAttentionKernel(AttentionParams const p)
{
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900 // no code for older GPUs (never chosen there)
    constexpr int DPL = 4;                          // output columns per lane
    constexpr int kHd = 32 * DPL;
    constexpr int kRowVectors = kHd / 8; // 16-byte vectors of a K row
    constexpr int kBatch = 8;            // K vectors loaded before their FMAs
    // Each warp stages its chunk's K rows in shared memory with coalesced copies (rows
    // padded by one vector: lane j's reads of row j are conflict-free), where lane j
    // reading row j from global memory would touch 32 lines per load.
    constexpr int kTileStride = kRowVectors + 1;
    constexpr int kTileVectors = kAttnWarps * 32 * kTileStride;
    constexpr int kAccVectors = kAttnWarps * G * kHd / 4;
    static_assert(sizeof(T) == 2, "16-bit I/O");
    static_assert(kRowVectors % kBatch == 0, "whole batches of K vectors");
    __shared__ float4 qVectors[G * kHd / 4];
    __shared__ float statS[kAttnWarps][G][2];
    // the K tiles during the key loop, then the warps' outputs [kAttnWarps][G][kHd]
    __shared__ uint4 work[kTileVectors > kAccVectors ? kTileVectors : kAccVectors];
    float* const qS = reinterpret_cast<float*>(qVectors);
    auto* const accS = reinterpret_cast<float (*)[G][kHd]>(work);

    BlockWork const block = blockWork(p);
    int64_t const t = block.t;
    int32_t const split = block.split;
    int32_t const nh = block.nh;
    int32_t const head0 = block.head0;
    int32_t const slot = block.slot;
    int64_t const keyBegin = block.keyBegin;
    int64_t const keyEnd = block.keyEnd;
    bool const hasKeys = block.hasKeys;
    int32_t const kvHead = block.kvHead;
    int32_t const warp = threadIdx.x / 32;
    int32_t const lane = threadIdx.x % 32;

    T const* q = static_cast<T const*>(p.q);
    for (int32_t e = threadIdx.x; e < G * kRowVectors; e += kAttnThreads)
    {
        int32_t const g = e / kRowVectors;
        int32_t const c = (e % kRowVectors) * 8;
        float v[8] = {};
        if (g < nh && hasKeys)
        {
            load8(q + (t * p.numHeads + head0 + g) * kHd + c, v);
        }
#pragma unroll
        for (int i = 0; i < 8; ++i)
        {
            qS[g * kHd + c + i] = v[i] * p.scaleLog2;
        }
    }
    __syncthreads();

    float runMax[G];
    float runSum[G];
    float acc[G][DPL];
#pragma unroll
    for (int g = 0; g < G; ++g)
    {
        runMax[g] = -INFINITY;
        runSum[g] = 0.0F;
#pragma unroll
        for (int c = 0; c < DPL; ++c)
        {
            acc[g][c] = 0.0F;
        }
    }
    if (hasKeys)
    {
        int64_t const rowBase = (static_cast<int64_t>(slot) * p.numKvHeads + kvHead) * p.maxSeqLen;
        T const* keys = static_cast<T const*>(p.keyCache) + rowBase * kHd;
        T const* values = static_cast<T const*>(p.valueCache) + rowBase * kHd;
        for (int64_t k0 = keyBegin + 32 * warp; k0 < keyEnd; k0 += 32 * kAttnWarps)
        {
            int64_t const key = k0 + lane;
            bool const live = key < keyEnd;
            int32_t const n = static_cast<int32_t>(min(static_cast<int64_t>(32), keyEnd - k0));
            float score[G];
#pragma unroll
            for (int g = 0; g < G; ++g)
            {
                score[g] = 0.0F;
            }
            uint4* const tile = work + warp * 32 * kTileStride;
            auto const* src = reinterpret_cast<uint4 const*>(keys + k0 * kHd);
            __syncwarp(); // the last chunk's reads of the tile are done
#pragma unroll
            for (int i = 0; i < kRowVectors; ++i)
            {
                int32_t const e = lane + 32 * i;
                if (e / kRowVectors < n)
                {
                    copy16ToShared(tile + (e / kRowVectors) * kTileStride + e % kRowVectors, src + e);
                }
            }
            waitCopiesToShared();
            __syncwarp();
            uint4 const* const row = tile + lane * kTileStride;
            if (live)
            {
#pragma unroll
                for (int b = 0; b < kRowVectors; b += kBatch)
                {
                    uint4 kv[kBatch];
#pragma unroll
                    for (int i = 0; i < kBatch; ++i)
                    {
                        kv[i] = row[b + i];
                    }
#pragma unroll
                    for (int i = 0; i < kBatch; ++i)
                    {
                        float kf[8];
                        unpack8Pairs<typename PairOf<T>::type>(kv[i], kf);
#pragma unroll
                        for (int g = 0; g < G; ++g)
                        {
                            float4 const qa = qVectors[(g * kHd + (b + i) * 8) / 4];
                            float4 const qb = qVectors[(g * kHd + (b + i) * 8) / 4 + 1];
                            score[g] += qa.x * kf[0] + qa.y * kf[1] + qa.z * kf[2] + qa.w * kf[3] + qb.x * kf[4]
                                + qb.y * kf[5] + qb.z * kf[6] + qb.w * kf[7];
                        }
                    }
                }
            }
            // A full chunk's V rows (lane: its DPL columns of each) are loaded before the
            // softmax's reductions, so their latency overlaps them.
            bool const full = n == 32;
            T const* vRows = values + k0 * kHd + lane * DPL;
            uint2 vr[32];
            if (full)
            {
#pragma unroll
                for (int j = 0; j < 32; ++j)
                {
                    vr[j] = *reinterpret_cast<uint2 const*>(vRows + j * kHd);
                }
            }
#pragma unroll
            for (int g = 0; g < G; ++g)
            {
                float const s = live ? score[g] : -INFINITY;
                float const newMax = fmaxf(runMax[g], warpMax(s));
                // as packedAttentionKernel: -inf - -inf must not reach exp2f
                float const corr = runMax[g] == -INFINITY ? 0.0F : exp2f(runMax[g] - newMax);
                float const prob = s == -INFINITY ? 0.0F : exp2f(s - newMax);
                runSum[g] = runSum[g] * corr + warpSum(prob);
                runMax[g] = newMax;
                score[g] = prob;
#pragma unroll
                for (int c = 0; c < DPL; ++c)
                {
                    acc[g][c] *= corr;
                }
            }
            // out[g, lane's columns] += p[j, g] * V[j, lane's columns]
            auto const addRow = [&](uint2 raw, int32_t j) {
                float vf[DPL];
                unpack4<T>(raw, vf);
#pragma unroll
                for (int g = 0; g < G; ++g)
                {
                    float const pj = __shfl_sync(0xFFFFFFFFu, score[g], j);
#pragma unroll
                    for (int c = 0; c < DPL; ++c)
                    {
                        acc[g][c] = fmaf(pj, vf[c], acc[g][c]);
                    }
                }
            };
            if (full)
            {
#pragma unroll
                for (int j = 0; j < 32; ++j)
                {
                    addRow(vr[j], j);
                }
            }
            else
            {
                for (int32_t j = 0; j < n; ++j)
                {
                    addRow(*reinterpret_cast<uint2 const*>(vRows + static_cast<int64_t>(j) * kHd), j);
                }
            }
        }
    }
    __syncthreads(); // every warp is past its K tiles: accS overwrites them
    if (lane == 0)
    {
#pragma unroll
        for (int g = 0; g < G; ++g)
        {
            statS[warp][g][0] = runMax[g];
            statS[warp][g][1] = runSum[g];
        }
    }
#pragma unroll
    for (int g = 0; g < G; ++g)
    {
#pragma unroll
        for (int c = 0; c < DPL; ++c)
        {
            accS[warp][g][lane * DPL + c] = acc[g][c];
        }
    }
    __syncthreads();
    for (int32_t e = threadIdx.x; e < nh * kHd; e += kAttnThreads)
    {
        int32_t const g = e / kHd;
        int32_t const d = e % kHd;
        float m = -INFINITY;
#pragma unroll
        for (int w = 0; w < kAttnWarps; ++w)
        {
            m = fmaxf(m, statS[w][g][0]);
        }
        float sum = 0.0F;
        float value = 0.0F;
#pragma unroll
        for (int w = 0; w < kAttnWarps; ++w)
        {
            float const mw = statS[w][g][0];
            if (mw != -INFINITY)
            {
                float const weight = exp2f(mw - m);
                sum += weight * statS[w][g][1];
                value += weight * accS[w][g][d];
            }
        }
        int64_t const th = t * p.numHeads + head0 + g;
        if (p.splits == 1)
        {
            // no keys only for an out-of-cache token: its row is zero
            static_cast<T*>(p.out)[th * kHd + d] = fromFloat<T>(hasKeys ? value / sum : 0.0F);
        }
        else
        {
            int64_t const part = th * p.splits + split;
            p.partialAcc[part * kHd + d] = value;
            if (d == 0)
            {
                p.partialStats[2 * part] = hasKeys ? m : -INFINITY;
                p.partialStats[2 * part + 1] = hasKeys ? sum : 0.0F;
            }
        }
    }
#endif
}

//! warpAttentionKernel for 16-bit I/O, head_dim 128 and at most 4 query heads per KV head
//! on sm_90 and later (the shapes it was measured at, on the H200) unless
//! ENGRAM_TRT_ATTENTION_KERNEL=tiled (read at each launch); else null: the tiled kernel.
//! engram_trt.native.attention.warp_kernel_serves mirrors this test in Python (the decode
//! graphs pick their attention path by it); tests/gpu/test_attention.py ties the two.
template <typename T>
AttentionKernel warpKernel(int32_t headDim, int32_t headsPerBlock)
{
    if constexpr (sizeof(T) != 2)
    {
        return nullptr;
    }
    else
    {
        char const* const choice = std::getenv("ENGRAM_TRT_ATTENTION_KERNEL");
        if ((choice != nullptr && std::strcmp(choice, "tiled") == 0) || headDim != 128 || headsPerBlock > 4
            || computeCapabilityMajor() < 9)
        {
            return nullptr;
        }
        return headsPerBlock <= 2 ? warpAttentionKernel<T, 2> : warpAttentionKernel<T, 4>;
    }
}

template AttentionKernel warpKernel<__nv_bfloat16>(int32_t headDim, int32_t headsPerBlock);
template AttentionKernel warpKernel<__half>(int32_t headDim, int32_t headsPerBlock);
template AttentionKernel warpKernel<float>(int32_t headDim, int32_t headsPerBlock);

} // namespace kernels
} // namespace engram_trt
