// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * What the attention kernels' two files share: attentionKernel.cu (the KV write, the tiled
 * kernel, the split merge and the launch) and attentionWarpKernel.cu (the warp kernel and
 * warpKernel(), the launch's choice of it). The kernels' parameters, the work of one block,
 * the device helpers both kernels call, and warpKernel()'s declaration. Not part of the ABI;
 * CUDA sources only (attentionInternal.h is what the host-compiled attentionApi.cpp shares).
 */
#ifndef ENGRAM_TRT_ATTENTION_DEVICE_CUH
#define ENGRAM_TRT_ATTENTION_DEVICE_CUH

#include "attentionInternal.h"
#include "vecLoad.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace engram_trt
{
namespace kernels
{

__device__ __forceinline__ bool inCache(int32_t slot, int32_t pos, int64_t numSlots, int64_t maxSeqLen)
{
    return slot >= 0 && slot < numSlots && pos >= 0 && pos < maxSeqLen;
}

//! The arguments of both attention kernels, passed by value (launchAttention fills them).
struct AttentionParams
{
    void const* q;
    void const* keyCache;
    void const* valueCache;
    int32_t const* tokenSlot;
    int32_t const* tokenPos;
    void* out;           // splits == 1: the output [T, H, hd]
    float* partialAcc;   // splits > 1: [T, H, splits, hd] unnormalized outputs
    float* partialStats; // splits > 1: [T, H, splits, 2] (running max in log2 units, sum)
    int64_t numSlots;
    int64_t maxSeqLen;
    int64_t keysPerSplit;
    float scaleLog2; // scale * log2(e)
    int32_t numHeads;
    int32_t numKvHeads;
    int32_t headDim;
    int32_t headsPerBlock;
    int32_t headBlocks;
    int32_t splits;
};

//! What one attention block works on: its token, KV head, query heads and key range.
struct BlockWork
{
    int64_t t;        // the token
    int32_t kvHead;   // its KV head
    int32_t split;    // the key split
    int32_t nh;       // query heads of the block
    int32_t head0;    // the block's first query head
    int32_t slot;     // the token's cache slot
    int64_t keyBegin; // keys keyBegin .. keyEnd - 1 of the slot
    int64_t keyEnd;
    bool hasKeys; // block-uniform; false for an out-of-cache token (or an empty split)
};

__device__ __forceinline__ BlockWork blockWork(AttentionParams const& p)
{
    BlockWork w{};
    w.t = blockIdx.x;
    w.kvHead = blockIdx.y / p.headBlocks;
    int32_t const headBlock = blockIdx.y % p.headBlocks;
    w.split = blockIdx.z;
    int32_t const group = p.numHeads / p.numKvHeads;
    int32_t const firstInGroup = headBlock * p.headsPerBlock;
    w.nh = min(p.headsPerBlock, group - firstInGroup);
    w.head0 = w.kvHead * group + firstInGroup;
    w.slot = p.tokenSlot[w.t];
    int32_t const pos = p.tokenPos[w.t];
    bool const valid = inCache(w.slot, pos, p.numSlots, p.maxSeqLen);
    w.keyBegin = static_cast<int64_t>(w.split) * p.keysPerSplit;
    w.keyEnd = valid ? min(static_cast<int64_t>(pos) + 1, w.keyBegin + p.keysPerSplit) : 0;
    w.hasKeys = w.keyBegin < w.keyEnd;
    return w;
}

using AttentionKernel = void (*)(AttentionParams);

//! The warp kernel that serves a step of I/O type T, or null: the tiled kernel's turn
//! (attentionWarpKernel.cu; instantiated for bf16, fp16 and fp32).
template <typename T>
AttentionKernel warpKernel(int32_t headDim, int32_t headsPerBlock);

} // namespace kernels
} // namespace engram_trt

#endif // ENGRAM_TRT_ATTENTION_DEVICE_CUH
