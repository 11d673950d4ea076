// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * The attention's C ABI entry points (engramKernels.h): argument checks, in the style of
 * kernelApi.cpp, and the split plan; the kernels are in attentionKernel.cu and attentionWarpKernel.cu.
 *
 * The split plan (flash-decoding for small steps): a step of fewer than kAttnSplitTarget
 * blocks splits each token's keys into chunks of at least kAttnMinKeysPerSplit positions
 * (at most kAttnMaxSplits), so a decode step of few sequences still fills the GPU. It is
 * a function of (num_tokens, num_kv_heads, group, max_seq_len) only, so the workspace an
 * engine builder sizes on one machine is right on every GPU.
 */
#include "attentionInternal.h"
#include "attentionKernels.h"
#include "engramKernelsCore.h"
#include "engramKernelsInternal.h"

#include <climits>
#include <cmath>
#include <cstdint>

namespace engram_trt
{
namespace kernels
{

AttentionPlan planAttention(int64_t numTokens, int32_t numHeads, int32_t numKvHeads, int64_t maxSeqLen)
{
    AttentionPlan plan{};
    int32_t const group = numHeads / numKvHeads;
    plan.headsPerBlock = group < kAttnHeadsPerBlock ? group : kAttnHeadsPerBlock;
    plan.headBlocks = (group + plan.headsPerBlock - 1) / plan.headsPerBlock;
    int64_t const blocks = numTokens * numKvHeads * plan.headBlocks;
    int64_t splits = 1;
    if (blocks > 0 && blocks < kAttnSplitTarget)
    {
        int64_t const wanted = (kAttnSplitTarget + blocks - 1) / blocks;
        int64_t const bySize = (maxSeqLen + kAttnMinKeysPerSplit - 1) / kAttnMinKeysPerSplit;
        splits = wanted < bySize ? wanted : bySize;
        splits = splits > kAttnMaxSplits ? kAttnMaxSplits : (splits < 1 ? 1 : splits);
    }
    int64_t keys = (maxSeqLen + splits - 1) / splits;
    keys = (keys + kAttnTile - 1) / kAttnTile * kAttnTile;
    plan.keysPerSplit = keys;
    plan.splits = static_cast<int32_t>((maxSeqLen + keys - 1) / keys);
    return plan;
}

size_t planWorkspaceBytes(AttentionPlan const& plan, int64_t numTokens, int32_t numHeads, int32_t headDim)
{
    if (plan.splits <= 1)
    {
        return 0;
    }
    return static_cast<size_t>(numTokens) * numHeads * plan.splits * (headDim + 2) * sizeof(float);
}

namespace
{

bool isIoType(int32_t type)
{
    return type == ENGRAM_FLOAT_BF16 || type == ENGRAM_FLOAT_F16 || type == ENGRAM_FLOAT_F32;
}

int checkShape(char const* fn, int32_t numHeads, int32_t numKvHeads, int32_t headDim, float scale)
{
    if (numHeads < 1 || numKvHeads < 1 || numHeads % numKvHeads != 0)
    {
        return fail(cudaErrorInvalidValue,
            "%s: num_heads must be a positive multiple of num_kv_heads (got num_heads %d, num_kv_heads %d)", fn,
            numHeads, numKvHeads);
    }
    if (headDim < 8 || headDim > ENGRAM_ATTENTION_MAX_HEAD_DIM || headDim % 8 != 0)
    {
        return fail(cudaErrorInvalidValue, "%s: head_dim must be a multiple of 8 in [8, %d] (got %d)", fn,
            ENGRAM_ATTENTION_MAX_HEAD_DIM, headDim);
    }
    int32_t const group = numHeads / numKvHeads;
    int64_t const gridY = static_cast<int64_t>(numKvHeads) * ((group + kAttnHeadsPerBlock - 1) / kAttnHeadsPerBlock);
    if (gridY > 65535)
    {
        return fail(cudaErrorInvalidValue,
            "%s: num_kv_heads * ceil(num_heads / num_kv_heads / 8) = %lld exceeds 65535 (the grid)", fn,
            static_cast<long long>(gridY));
    }
    if (!std::isfinite(scale) || !(scale > 0.0F))
    {
        return fail(cudaErrorInvalidValue, "%s: scale must be finite and > 0 (got %g)", fn, static_cast<double>(scale));
    }
    return 0;
}

//! The checks every entry point shares: counts, cache extent, types, pointers.
int checkCall(char const* fn, int32_t ioType, int64_t numTokens, int32_t numHeads, int32_t numKvHeads, int32_t headDim,
    int64_t numSlots, int64_t maxSeqLen, float scale, int32_t const* tokenSlot, int32_t const* tokenPos,
    void const* const* tensors, char const* tensorNames)
{
    if (int const status = checkShape(fn, numHeads, numKvHeads, headDim, scale))
    {
        return status;
    }
    if (!isIoType(ioType))
    {
        return fail(cudaErrorInvalidValue, "%s: io_type %d is not bf16 (0), fp32 (1) or fp16 (2)", fn, ioType);
    }
    if (numTokens < 0 || numTokens > INT32_MAX)
    {
        return fail(cudaErrorInvalidValue, "%s: num_tokens must be in [0, 2^31 - 1] (got %lld)", fn,
            static_cast<long long>(numTokens));
    }
    if (numSlots < 1 || maxSeqLen < 1 || numSlots > INT32_MAX || maxSeqLen > INT32_MAX)
    {
        return fail(cudaErrorInvalidValue, "%s: num_slots and max_seq_len must be in [1, 2^31 - 1] (got %lld, %lld)",
            fn, static_cast<long long>(numSlots), static_cast<long long>(maxSeqLen));
    }
    // The cache's element count must fit int64 with room to spare (offsets are int64).
    double const cacheElements = static_cast<double>(numSlots) * numKvHeads * static_cast<double>(maxSeqLen) * headDim;
    if (cacheElements > 4.0e18)
    {
        return fail(cudaErrorInvalidValue, "%s: the cache [%lld, %d, %lld, %d] is too large", fn,
            static_cast<long long>(numSlots), numKvHeads, static_cast<long long>(maxSeqLen), headDim);
    }
    if (numTokens == 0)
    {
        return 0;
    }
    if (tokenSlot == nullptr || tokenPos == nullptr || !isAligned(tokenSlot, 4) || !isAligned(tokenPos, 4))
    {
        return fail(cudaErrorInvalidValue, "%s: token_slot and token_pos must be int32 device arrays", fn);
    }
    for (int i = 0; tensors[i] != reinterpret_cast<void const*>(-1); ++i)
    {
        if (tensors[i] == nullptr || !isAligned(tensors[i], 16))
        {
            return fail(cudaErrorInvalidValue, "%s: %s must be 16-byte aligned device pointers", fn, tensorNames);
        }
    }
    return 0;
}

//! The attention for a checked call: the plan, fewer splits (none) when the workspace
//! is too small for them, then the launch.
int attend(void const* q, int32_t ioType, void const* keyCache, void const* valueCache, int32_t const* tokenSlot,
    int32_t const* tokenPos, int64_t numTokens, int32_t numHeads, int32_t numKvHeads, int32_t headDim, int64_t numSlots,
    int64_t maxSeqLen, float scale, void* workspace, size_t workspaceBytes, void* out, cudaStream_t stream)
{
    AttentionPlan plan = planAttention(numTokens, numHeads, numKvHeads, maxSeqLen);
    size_t const needed = planWorkspaceBytes(plan, numTokens, numHeads, headDim);
    if (plan.splits > 1 && (workspace == nullptr || workspaceBytes < needed || !isAligned(workspace, 16)))
    {
        // Not enough workspace for the split: one block per token streams all its keys.
        plan.splits = 1;
        plan.keysPerSplit = maxSeqLen;
    }
    return launchAttention(q, ioType, keyCache, valueCache, tokenSlot, tokenPos, numTokens, numHeads, numKvHeads,
        headDim, numSlots, maxSeqLen, scale, plan, workspace, out, stream);
}

void const* const kEnd = reinterpret_cast<void const*>(-1);

} // namespace

} // namespace kernels
} // namespace engram_trt

using namespace engram_trt::kernels;

extern "C" ENGRAM_API int engram_attention_check_shape(
    int32_t numHeads, int32_t numKvHeads, int32_t headDim, float scale)
{
    clearError();
    return checkShape("engram_attention", numHeads, numKvHeads, headDim, scale);
}

extern "C" ENGRAM_API int engram_attention_workspace_size(
    int64_t maxTokens, int32_t numHeads, int32_t numKvHeads, int32_t headDim, int64_t maxSeqLen, size_t* bytes)
{
    clearError();
    if (bytes == nullptr)
    {
        return fail(cudaErrorInvalidValue, "engram_attention_workspace_size: bytes is NULL");
    }
    *bytes = 0;
    if (int const status = checkShape("engram_attention_workspace_size", numHeads, numKvHeads, headDim, 1.0F))
    {
        return status;
    }
    if (maxTokens < 0 || maxSeqLen < 1)
    {
        return fail(cudaErrorInvalidValue,
            "engram_attention_workspace_size: need max_tokens >= 0 and max_seq_len >= 1 (got %lld, %lld)",
            static_cast<long long>(maxTokens), static_cast<long long>(maxSeqLen));
    }
    // Splits happen only below kAttnSplitTarget blocks, i.e. for at most that many tokens.
    size_t most = 0;
    int64_t const last = maxTokens < kAttnSplitTarget ? maxTokens : kAttnSplitTarget;
    for (int64_t tokens = 1; tokens <= last; ++tokens)
    {
        size_t const need
            = planWorkspaceBytes(planAttention(tokens, numHeads, numKvHeads, maxSeqLen), tokens, numHeads, headDim);
        most = need > most ? need : most;
    }
    *bytes = most;
    return 0;
}

extern "C" ENGRAM_API int engram_kv_cache_write(void const* k, void const* v, int32_t ioType, int32_t const* tokenSlot,
    int32_t const* tokenPos, int64_t numTokens, int32_t numKvHeads, int32_t headDim, void* keyCache, void* valueCache,
    int64_t numSlots, int64_t maxSeqLen, cudaStream_t stream)
{
    clearError();
    void const* tensors[] = {k, v, keyCache, valueCache, kEnd};
    if (int const status = checkCall("engram_kv_cache_write", ioType, numTokens, numKvHeads, numKvHeads, headDim,
            numSlots, maxSeqLen, 1.0F, tokenSlot, tokenPos, tensors, "k, v, key_cache and value_cache"))
    {
        return status;
    }
    if (numTokens == 0)
    {
        return 0;
    }
    return launchKvCacheWrite(k, v, ioType, tokenSlot, tokenPos, numTokens, numKvHeads, headDim, keyCache, valueCache,
        numSlots, maxSeqLen, stream);
}

extern "C" ENGRAM_API int engram_rope_kv_cache_write(void const* qkv, void const* cosTable, void const* sinTable,
    int32_t const* tokenSlot, int32_t const* tokenPos, int64_t numTokens, int32_t numHeads, int32_t numKvHeads,
    int32_t headDim, void* keyCache, void* valueCache, int64_t numSlots, int64_t maxSeqLen, void* qOut,
    cudaStream_t stream)
{
    clearError();
    void const* tensors[] = {qkv, cosTable, sinTable, keyCache, valueCache, qOut, kEnd};
    if (int const status
        = checkCall("engram_rope_kv_cache_write", ENGRAM_FLOAT_BF16, numTokens, numHeads, numKvHeads, headDim, numSlots,
            maxSeqLen, 1.0F, tokenSlot, tokenPos, tensors, "qkv, cos, sin, key_cache, value_cache and q_out"))
    {
        return status;
    }
    if (numTokens == 0)
    {
        return 0;
    }
    // q_out is written while other blocks still read their qkv rows: the two must not share a byte.
    auto const qkvBegin = reinterpret_cast<uintptr_t>(qkv);
    auto const qBegin = reinterpret_cast<uintptr_t>(qOut);
    uintptr_t const qkvBytes = static_cast<uintptr_t>(numTokens) * (numHeads + 2 * numKvHeads) * headDim * 2;
    uintptr_t const qBytes = static_cast<uintptr_t>(numTokens) * numHeads * headDim * 2;
    if (qBegin < qkvBegin + qkvBytes && qkvBegin < qBegin + qBytes)
    {
        return fail(cudaErrorInvalidValue, "engram_rope_kv_cache_write: q_out must not overlap qkv");
    }
    return launchRopeKvCacheWrite(qkv, cosTable, sinTable, tokenSlot, tokenPos, numTokens, numHeads, numKvHeads,
        headDim, keyCache, valueCache, numSlots, maxSeqLen, qOut, stream);
}

extern "C" ENGRAM_API int engram_attention_packed(void const* q, int32_t ioType, void const* keyCache,
    void const* valueCache, int32_t const* tokenSlot, int32_t const* tokenPos, int64_t numTokens, int32_t numHeads,
    int32_t numKvHeads, int32_t headDim, int64_t numSlots, int64_t maxSeqLen, float scale, void* workspace,
    size_t workspaceBytes, void* out, cudaStream_t stream)
{
    clearError();
    void const* tensors[] = {q, keyCache, valueCache, out, kEnd};
    if (int const status = checkCall("engram_attention_packed", ioType, numTokens, numHeads, numKvHeads, headDim,
            numSlots, maxSeqLen, scale, tokenSlot, tokenPos, tensors, "q, key_cache, value_cache and out"))
    {
        return status;
    }
    if (numTokens == 0)
    {
        return 0;
    }
    return attend(q, ioType, keyCache, valueCache, tokenSlot, tokenPos, numTokens, numHeads, numKvHeads, headDim,
        numSlots, maxSeqLen, scale, workspace, workspaceBytes, out, stream);
}

extern "C" ENGRAM_API int engram_attention_step(void const* q, void const* k, void const* v, int32_t ioType,
    int32_t const* tokenSlot, int32_t const* tokenPos, int64_t numTokens, int32_t numHeads, int32_t numKvHeads,
    int32_t headDim, void* keyCache, void* valueCache, int64_t numSlots, int64_t maxSeqLen, float scale,
    void* workspace, size_t workspaceBytes, void* out, cudaStream_t stream)
{
    clearError();
    void const* tensors[] = {q, k, v, keyCache, valueCache, out, kEnd};
    if (int const status = checkCall("engram_attention_step", ioType, numTokens, numHeads, numKvHeads, headDim,
            numSlots, maxSeqLen, scale, tokenSlot, tokenPos, tensors, "q, k, v, key_cache, value_cache and out"))
    {
        return status;
    }
    if (numTokens == 0)
    {
        return 0;
    }
    if (int const status = launchKvCacheWrite(k, v, ioType, tokenSlot, tokenPos, numTokens, numKvHeads, headDim,
            keyCache, valueCache, numSlots, maxSeqLen, stream))
    {
        return status;
    }
    return attend(q, ioType, keyCache, valueCache, tokenSlot, tokenPos, numTokens, numHeads, numKvHeads, headDim,
        numSlots, maxSeqLen, scale, workspace, workspaceBytes, out, stream);
}
