// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * What the attention's entry points (attentionApi.cpp: checks and the split plan) and
 * its kernels (attentionKernel.cu, attentionWarpKernel.cu) share. Not part of the ABI.
 */
#ifndef ENGRAM_TRT_ATTENTION_INTERNAL_H
#define ENGRAM_TRT_ATTENTION_INTERNAL_H

#include "attentionKernels.h"

#include <cstddef>
#include <cstdint>
#include <cuda_runtime_api.h>

namespace engram_trt
{
namespace kernels
{

constexpr int kAttnThreads = 128;
constexpr int kAttnWarps = kAttnThreads / 32;
constexpr int kAttnTile = 32;             // keys per tile: one per lane in the score phase
constexpr int kAttnHeadsPerBlock = 8;     // query heads of one KV head in one block (2 per warp)
constexpr int kAttnSplitTarget = 1024;    // blocks a step should have before keys are split
constexpr int kAttnMinKeysPerSplit = 256; // shortest key chunk of a split
constexpr int kAttnMaxSplits = 32;

//! How a step is cut into blocks: query heads per block, head blocks per KV head, key
//! splits and keys per split. A function of the step's shape alone, never of the device.
struct AttentionPlan
{
    int32_t headsPerBlock;
    int32_t headBlocks;
    int32_t splits;
    int64_t keysPerSplit;
};

//! The plan of a step of numTokens tokens (attentionApi.cpp).
AttentionPlan planAttention(int64_t numTokens, int32_t numHeads, int32_t numKvHeads, int64_t maxSeqLen);

//! Workspace bytes of a plan: the split partials, 0 without a split.
size_t planWorkspaceBytes(AttentionPlan const& plan, int64_t numTokens, int32_t numHeads, int32_t headDim);

//! Enqueues the KV write (arguments checked by the caller).
int launchKvCacheWrite(void const* k, void const* v, int32_t ioType, int32_t const* tokenSlot, int32_t const* tokenPos,
    int64_t numTokens, int32_t numKvHeads, int32_t headDim, void* keyCache, void* valueCache, int64_t numSlots,
    int64_t maxSeqLen, cudaStream_t stream);

//! Enqueues the RoPE + KV write of a fused qkv row (ropeKernel.cu; bf16, arguments
//! checked by the caller).
int launchRopeKvCacheWrite(void const* qkv, void const* cosTable, void const* sinTable, int32_t const* tokenSlot,
    int32_t const* tokenPos, int64_t numTokens, int32_t numHeads, int32_t numKvHeads, int32_t headDim, void* keyCache,
    void* valueCache, int64_t numSlots, int64_t maxSeqLen, void* qOut, cudaStream_t stream);

//! Enqueues the attention (and the merge of its splits) for `plan`; with plan.splits > 1
//! the workspace holds planWorkspaceBytes(plan, ...) bytes (arguments checked by the caller).
int launchAttention(void const* q, int32_t ioType, void const* keyCache, void const* valueCache,
    int32_t const* tokenSlot, int32_t const* tokenPos, int64_t numTokens, int32_t numHeads, int32_t numKvHeads,
    int32_t headDim, int64_t numSlots, int64_t maxSeqLen, float scale, AttentionPlan const& plan, void* workspace,
    void* out, cudaStream_t stream);

} // namespace kernels
} // namespace engram_trt

#endif // ENGRAM_TRT_ATTENTION_INTERNAL_H
