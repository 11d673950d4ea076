// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * engram_moe_experts_grouped_bf16: engram_moe_experts_bf16's contract (decodeKernels.h) for
 * a step of up to ENGRAM_MOE_GROUPED_MAX_TOKENS tokens (a batch of decode streams), with the
 * (token, pick) pairs grouped by expert so that each active expert's gate / up / down rows
 * are read from HBM once a step, and the shared expert's once for all tokens.
 *
 * Why: decodeMoeKernel.cu reads an expert's rows once per (token, pick). At 32 tokens x 2
 * picks over 8 experts of 12.6 MB (the DeepSeek-V4 bench shape: 100 MB a layer, above the
 * L2) that re-reads the weights from HBM about 8 times, and the 9-64-token path before this
 * one ran the routed experts through the generic tile GEMMs (issue 41).
 *
 * Three launches after the router's picks:
 *   gate / up:  block (row range, slot): slot 0 the shared expert (all tokens; launched
 *               first, the most work, its rows prefetched to the L2 before the wait since
 *               weights are static), slot e + 1 routed expert e, whose pairs the block
 *               collects from ids in shared memory (ascending t * top_k + j). One warp per
 *               intermediate row: it sums its gate and up rows against up to kChunk pairs'
 *               x at once and writes h[t, j, i] = bf(bf(silu(g)) * u) (the per-token
 *               kernel's workspace layout).
 *   down:       the same grid over the hidden rows: one warp per down row d of an expert,
 *               y[t, j, d] = bf(bf(down_e h) * weights[t, j]) (shared: bf(down_s h), with
 *               shared_scale bf(. * bf(sigmoid(z)))) into the workspace after h.
 *   combine:    a thread per (token, 8 channels): the picks' y in ascending expert id (ties
 *               by pick), each sum rounded to bf16, then the shared expert's added and
 *               rounded: the contract's order.
 * A routed expert's rows are read only where some pair picked it (its blocks wait for the
 * picks first). A warp re-reads its own row from the L1 / L2 for each further chunk of
 * kChunk pairs (the load then caches in the L1; a single chunk streams past it).
 *
 * Bit-equality with engram_moe_experts_bf16: each (row, pair) sum is gemvKernel.cu's (lane
 * L takes 16-byte vectors L, L + 32, ... in k order, float32 fmaf over the 8 values, then
 * warpSum), whatever the grouping; the roundings after each product and the combine's
 * order are decodeMoeCommon.cuh's, which the per-token kernel uses too.
 */
#include "decodeKernels.h"
#include "decodeMoeCommon.cuh"
#include "dependentLaunch.cuh"
#include "engramKernelsCore.h"
#include "engramKernelsInternal.h"
#include "vecLoad.cuh"

#include <cuda_bf16.h>

#include <cstdint>

namespace engram_trt
{
namespace kernels
{

namespace
{

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kChunk = 8;     // (token, pick) pairs a warp sums at once
constexpr int kMinBlocks = 5; // blocks an SM holds: <= 96 registers a thread (ptxas: no spills)
constexpr int kCombineThreads = 128;
constexpr int64_t kTargetBlocks = 8192; // above it a warp takes several rows (many experts: most blocks idle)
constexpr int32_t kMaxPairs = ENGRAM_MOE_GROUPED_MAX_TOKENS * ENGRAM_MOE_MAX_TOP_K;

/*
 * The block's pairs p = t * top_k + j with ids[p] == e, ascending, into pairs (shared
 * memory); returns their count. Every thread of the block calls it.
 */
__device__ int32_t collectPairs(int32_t const* ids, int32_t numPairs, int32_t e, int32_t* pairs, int32_t* warpCounts)
{
    int const lane = threadIdx.x & 31;
    int const warp = threadIdx.x >> 5;
    int32_t total = 0;
    for (int32_t base = 0; base < numPairs; base += kThreads)
    {
        int32_t const p = base + static_cast<int32_t>(threadIdx.x);
        bool const hit = p < numPairs && ids[p] == e;
        unsigned const mask = __ballot_sync(0xFFFFFFFFu, hit);
        if (lane == 0)
        {
            warpCounts[warp] = __popc(mask);
        }
        __syncthreads();
        int32_t offset = total;
        for (int w = 0; w < kWarps; ++w)
        {
            offset += w < warp ? warpCounts[w] : 0;
            total += warpCounts[w];
        }
        if (hit)
        {
            pairs[offset + __popc(mask & ((1u << lane) - 1u))] = p;
        }
        __syncthreads(); // warpCounts is rewritten next round; pairs complete after the last
    }
    return total;
}

//! The warp's L2 prefetch of one row of `bytes` bytes (a line a lane per 128 bytes).
__device__ __forceinline__ void prefetchRow(void const* row, int64_t bytes)
{
    for (int64_t offset = static_cast<int64_t>(threadIdx.x & 31) * 128; offset < bytes; offset += 32 * 128)
    {
        asm volatile("prefetch.global.L2 [%0];" ::"l"(static_cast<char const*>(row) + offset));
    }
}

/*
 * acc[r][m] = rows w[r] (R rows of `vectors` 16-byte vectors) . x[m] for the chunk's n <= kChunk
 * pairs (acc[r][m] for m >= n unspecified), in every lane: per (row, pair) rowDot's sum in
 * decodeMoeKernel.cu (gemvKernel.cu's lane order, float32 fmaf, warpSum). streaming: read w
 * past the L1 (one chunk); else through it (the next chunks re-read it there).
 */
template <int R>
__device__ __forceinline__ void chunkDot(uint4 const* const (&w)[R], uint4 const* const (&x)[kChunk], int n,
    int32_t vectors, bool streaming, float (&acc)[R][kChunk])
{
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
    constexpr int U = 4 / R; // 16-byte vectors of each row a lane loads before its first FMA (64 bytes in all)
    int const lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < R; ++r)
    {
#pragma unroll
        for (int m = 0; m < kChunk; ++m)
        {
            acc[r][m] = 0.0F;
        }
    }
    for (int32_t base = 0; base < vectors; base += 32 * U)
    {
        uint4 wr[R][U];
#pragma unroll
        for (int u = 0; u < U; ++u)
        {
            int32_t const v = base + lane + 32 * u;
#pragma unroll
            for (int r = 0; r < R; ++r)
            {
                wr[r][u] = v >= vectors ? make_uint4(0, 0, 0, 0)
                    : streaming         ? loadStreaming(w[r] + v)
                                        : __ldg(w[r] + v);
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u)
        {
            int32_t const v = base + lane + 32 * u;
            if (v >= vectors)
            {
                break;
            }
            float wf[R][8];
#pragma unroll
            for (int r = 0; r < R; ++r)
            {
                unpack8Pairs<__nv_bfloat162>(wr[r][u], wf[r]);
            }
#pragma unroll
            for (int m = 0; m < kChunk; ++m)
            {
                if (m < n)
                {
                    float xf[8];
                    unpack8Pairs<__nv_bfloat162>(__ldg(x[m] + v), xf);
#pragma unroll
                    for (int r = 0; r < R; ++r)
                    {
#pragma unroll
                        for (int i = 0; i < 8; ++i)
                        {
                            acc[r][m] = fmaf(wf[r][i], xf[i], acc[r][m]);
                        }
                    }
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
    {
#pragma unroll
        for (int m = 0; m < kChunk; ++m)
        {
            if (m < n)
            {
                acc[r][m] = warpSum(acc[r][m]);
            }
        }
    }
#endif
}

//! The block's expert and rows: slot 0 (blockIdx.y) the shared expert, slot e + 1 routed
//! expert e; rows [begin, end) of `rows` (empty past them).
struct BlockRows
{
    bool shared;
    int32_t expert;
    int32_t begin;
    int32_t end;
};

__device__ __forceinline__ BlockRows blockRows(int32_t rows, int32_t rowsPerBlock)
{
    BlockRows b;
    b.shared = blockIdx.y == 0;
    b.expert = static_cast<int32_t>(blockIdx.y) - 1;
    b.begin = static_cast<int32_t>(blockIdx.x) * rowsPerBlock;
    b.end = min(rows, b.begin + rowsPerBlock);
    return b;
}

//! The h / y row (t * (top_k + 1) + j) of pair index q of the block's list: the shared
//! expert's pairs are the tokens (j = top_k), a routed one's p = t * top_k + j.
__device__ __forceinline__ int64_t rowOfPair(int32_t p, bool shared, int32_t topK)
{
    return shared ? static_cast<int64_t>(p) * (topK + 1) + topK : p + p / topK;
}

/*
 * Launch 1: a warp per intermediate row of the block's expert, every pair of it.
 */
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    moeGroupedGateUpKernel(EngramMoeExperts a, int64_t hStride, int32_t rowsPerBlock)
{
    __shared__ int32_t pairs[kMaxPairs];
    __shared__ int32_t warpCounts[kWarps];
    int32_t const hidden = a.hidden;
    BlockRows const b = blockRows(blockIdx.y == 0 ? a.shared_intermediate : a.intermediate, rowsPerBlock);
    int const warp = threadIdx.x >> 5;
    int const lane = threadIdx.x & 31;
    int64_t const expertOffset = b.shared ? 0 : static_cast<int64_t>(b.expert) * a.intermediate * hidden;
    auto const* const gate = static_cast<__nv_bfloat16 const*>(b.shared ? a.shared_gate : a.gate) + expertOffset;
    auto const* const up = static_cast<__nv_bfloat16 const*>(b.shared ? a.shared_up : a.up) + expertOffset;
    if (b.shared)
    {
        // the shared expert's rows serve every token: to the L2 while the kernel before runs
        for (int32_t i = b.begin + warp; i < b.end; i += kWarps)
        {
            prefetchRow(gate + static_cast<int64_t>(i) * hidden, static_cast<int64_t>(hidden) * 2);
            prefetchRow(up + static_cast<int64_t>(i) * hidden, static_cast<int64_t>(hidden) * 2);
        }
    }
    waitForPrimary(); // ids, weights and x come from the kernels before
    allowDependents();
    if (b.begin >= b.end)
    {
        return;
    }
    int32_t const count = b.shared
        ? static_cast<int32_t>(a.num_tokens)
        : collectPairs(a.ids, static_cast<int32_t>(a.num_tokens) * a.top_k, b.expert, pairs, warpCounts);
    auto const* const x = static_cast<__nv_bfloat16 const*>(a.x);
    auto* const h = static_cast<__nv_bfloat16*>(a.workspace);
    int32_t const vectors = hidden / 8;
    bool const streaming = count <= kChunk;
    for (int32_t i = b.begin + warp; i < b.end; i += kWarps)
    {
        uint4 const* const w[2] = {reinterpret_cast<uint4 const*>(gate + static_cast<int64_t>(i) * hidden),
            reinterpret_cast<uint4 const*>(up + static_cast<int64_t>(i) * hidden)};
        for (int32_t c0 = 0; c0 < count; c0 += kChunk)
        {
            int const n = min(kChunk, count - c0);
            uint4 const* xs[kChunk];
#pragma unroll
            for (int m = 0; m < kChunk; ++m)
            {
                int32_t const q = c0 + min(m, n - 1);
                int32_t const t = b.shared ? q : pairs[q] / a.top_k;
                xs[m] = reinterpret_cast<uint4 const*>(x + static_cast<int64_t>(t) * hidden);
            }
            float acc[2][kChunk];
            chunkDot<2>(w, xs, n, vectors, streaming, acc);
#pragma unroll
            for (int m = 0; m < kChunk; ++m)
            {
                if (m < n && lane == m)
                {
                    int32_t const p = b.shared ? c0 + m : pairs[c0 + m];
                    h[rowOfPair(p, b.shared, a.top_k) * hStride + i]
                        = swigluBf16(acc[0][m], acc[1][m], a.clamp, a.limit);
                }
            }
        }
    }
}

/*
 * Launch 2: a warp per down row d of the block's expert, every pair of it; y after h in
 * the workspace.
 */
__global__ void __launch_bounds__(kThreads, kMinBlocks) moeGroupedDownKernel(EngramMoeExperts a, int64_t hStride,
    int64_t yOffset, int64_t downExpertStride, int64_t downRowStride, int32_t rowsPerBlock)
{
    __shared__ int32_t pairs[kMaxPairs];
    __shared__ int32_t warpCounts[kWarps];
    int32_t const hidden = a.hidden;
    BlockRows const b = blockRows(blockIdx.y == 0 && a.shared_intermediate == 0 ? 0 : hidden, rowsPerBlock);
    int const warp = threadIdx.x >> 5;
    int const lane = threadIdx.x & 31;
    int32_t const inner = b.shared ? a.shared_intermediate : a.intermediate;
    auto const* const down = b.shared ? static_cast<__nv_bfloat16 const*>(a.shared_down)
                                      : static_cast<__nv_bfloat16 const*>(a.down) + b.expert * downExpertStride;
    int64_t const rowStride = b.shared ? inner : downRowStride;
    if (b.shared)
    {
        for (int32_t d = b.begin + warp; d < b.end; d += kWarps)
        {
            prefetchRow(down + d * rowStride, static_cast<int64_t>(inner) * 2);
        }
    }
    waitForPrimary(); // h comes from launch 1
    allowDependents();
    if (b.begin >= b.end)
    {
        return;
    }
    int32_t const count = b.shared
        ? static_cast<int32_t>(a.num_tokens)
        : collectPairs(a.ids, static_cast<int32_t>(a.num_tokens) * a.top_k, b.expert, pairs, warpCounts);
    auto* const ws = static_cast<__nv_bfloat16*>(a.workspace);
    __nv_bfloat16 const* const h = ws;
    __nv_bfloat16* const y = ws + yOffset;
    auto const* const scale = static_cast<__nv_bfloat16 const*>(a.shared_scale);
    int32_t const vectors = inner / 8;
    bool const streaming = count <= kChunk;
    for (int32_t d = b.begin + warp; d < b.end; d += kWarps)
    {
        uint4 const* const w[1] = {reinterpret_cast<uint4 const*>(down + d * rowStride)};
        for (int32_t c0 = 0; c0 < count; c0 += kChunk)
        {
            int const n = min(kChunk, count - c0);
            uint4 const* xs[kChunk];
#pragma unroll
            for (int m = 0; m < kChunk; ++m)
            {
                int32_t const q = c0 + min(m, n - 1);
                int32_t const p = b.shared ? q : pairs[q];
                xs[m] = reinterpret_cast<uint4 const*>(h + rowOfPair(p, b.shared, a.top_k) * hStride);
            }
            float acc[1][kChunk];
            chunkDot<1>(w, xs, n, vectors, streaming, acc);
#pragma unroll
            for (int m = 0; m < kChunk; ++m)
            {
                if (m < n && lane == m)
                {
                    int32_t const p = b.shared ? c0 + m : pairs[c0 + m];
                    float out = 0.0F;
                    if (b.shared)
                    {
                        // shared_expert(x) * sigmoid(shared_expert_gate(x)), each op rounded to bf16
                        float const z = scale != nullptr ? __bfloat162float(scale[p * a.shared_scale_stride]) : 0.0F;
                        out = sharedOutput(acc[0][m], scale != nullptr, z);
                    }
                    else
                    {
                        out = routedOutput(acc[0][m], a.weights[p]);
                    }
                    y[rowOfPair(p, b.shared, a.top_k) * hidden + d] = __float2bfloat16_rn(out); // exact: out is bf16
                }
            }
        }
    }
}

/*
 * Launch 3: a thread per (token, 8 output channels): the contract's sums in its order.
 */
__global__ void __launch_bounds__(kCombineThreads) moeGroupedCombineKernel(EngramMoeExperts a, int64_t yOffset)
{
    waitForPrimary(); // y comes from launch 2
    allowDependents();
    int64_t const groups = a.hidden / 8;
    int64_t const item = static_cast<int64_t>(blockIdx.x) * kCombineThreads + threadIdx.x;
    if (item >= a.num_tokens * groups)
    {
        return;
    }
    int64_t const t = item / groups;
    int64_t const d0 = (item - t * groups) * 8;
    auto const* const y = static_cast<__nv_bfloat16 const*>(a.workspace) + yOffset;
    int64_t const tokenRow = t * (a.top_k + 1);
    int32_t const* const tokenIds = a.ids + t * a.top_k;
    float routed[8];
#pragma unroll
    for (int i = 0; i < 8; ++i)
    {
        routed[i] = 0.0F;
    }
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
        float v[8];
        unpack8Pairs<__nv_bfloat162>(*reinterpret_cast<uint4 const*>(y + (tokenRow + pick) * a.hidden + d0), v);
#pragma unroll
        for (int i = 0; i < 8; ++i)
        {
            routed[i] = roundBf16(__fadd_rn(routed[i], v[i]));
        }
    }
    float s[8];
#pragma unroll
    for (int i = 0; i < 8; ++i)
    {
        s[i] = 0.0F;
    }
    bool const shared = a.shared_intermediate > 0;
    if (shared)
    {
        unpack8Pairs<__nv_bfloat162>(*reinterpret_cast<uint4 const*>(y + (tokenRow + a.top_k) * a.hidden + d0), s);
    }
    auto* const out = static_cast<__nv_bfloat16*>(a.out) + t * a.hidden + d0;
#pragma unroll
    for (int i = 0; i < 8; ++i)
    {
        out[i] = __float2bfloat16_rn(shared ? __fadd_rn(routed[i], s[i]) : routed[i]);
    }
}

//! Rows per block of a launch over `slots` experts of `rows` rows: a warp a row up to
//! about kTargetBlocks blocks, then more rows a warp (a layer of many experts, most idle).
int32_t rowsPerBlockOf(int64_t slots, int64_t rows)
{
    int64_t const oneRow = slots * ((rows + kWarps - 1) / kWarps);
    int64_t perWarp = (oneRow + kTargetBlocks - 1) / kTargetBlocks;
    perWarp = perWarp < 1 ? 1 : perWarp > 64 ? 64 : perWarp;
    return static_cast<int32_t>(perWarp * kWarps);
}

int groupedSize(EngramMoeExperts const& a, size_t* bytes)
{
    return engram_moe_experts_grouped_workspace_size(
        a.num_tokens, a.top_k, a.hidden, a.intermediate, a.shared_intermediate, bytes);
}

} // namespace

} // namespace kernels
} // namespace engram_trt

using namespace engram_trt::kernels;

extern "C" ENGRAM_API int engram_moe_experts_grouped_workspace_size(
    int64_t numTokens, int32_t topK, int32_t hidden, int32_t intermediate, int32_t sharedIntermediate, size_t* bytes)
{
    clearError();
    if (bytes == nullptr || numTokens < 0 || numTokens > ENGRAM_MOE_GROUPED_MAX_TOKENS || topK < 1
        || topK > ENGRAM_MOE_MAX_TOP_K || hidden < 8 || intermediate < 8 || sharedIntermediate < 0)
    {
        return fail(cudaErrorInvalidValue,
            "engram_moe_experts_grouped_workspace_size: need bytes != NULL, 0 <= num_tokens <= %d, 1 <= top_k <= %d, "
            "hidden >= 8, intermediate >= 8 and shared_intermediate >= 0 (got %lld, %d, %d, %d, %d)",
            ENGRAM_MOE_GROUPED_MAX_TOKENS, ENGRAM_MOE_MAX_TOP_K, ll(numTokens), topK, hidden, intermediate,
            sharedIntermediate);
    }
    // h [T, top_k + 1, max(I, I_s)] then y [T, top_k + 1, D], bf16
    *bytes = static_cast<size_t>(numTokens) * static_cast<size_t>(topK + 1)
        * static_cast<size_t>(moeHStride(intermediate, sharedIntermediate) + hidden) * 2;
    return 0;
}

extern "C" ENGRAM_API int engram_moe_experts_grouped_bf16(EngramMoeExperts const* args, cudaStream_t stream)
{
    clearError();
    char const* const fn = "engram_moe_experts_grouped_bf16";
    if (args == nullptr)
    {
        return fail(cudaErrorInvalidValue, "%s: args must not be NULL", fn);
    }
    EngramMoeExperts const a = *args;
    int status = checkMoeExperts(fn, a, ENGRAM_MOE_GROUPED_MAX_TOKENS, groupedSize);
    if (status != 0 || a.num_tokens == 0)
    {
        return status;
    }
    int64_t const hStride = moeHStride(a.intermediate, a.shared_intermediate);
    int64_t const yOffset = a.num_tokens * (a.top_k + 1) * hStride; // elements: y after h
    int64_t const slots = static_cast<int64_t>(a.num_experts) + 1;  // slot 0 the shared expert (it may have no rows)
    bool const packed = a.down_expert_stride == 0;
    int64_t const downExpertStride = packed ? static_cast<int64_t>(a.hidden) * a.intermediate : a.down_expert_stride;
    int64_t const downRowStride = packed ? static_cast<int64_t>(a.intermediate) : a.down_row_stride;

    int64_t const innerRows = moeHStride(a.intermediate, a.shared_intermediate);
    int32_t const gateUpRows = rowsPerBlockOf(slots, innerRows);
    resetLaunchError();
    launchDependent(moeGroupedGateUpKernel,
        dim3(static_cast<unsigned>((innerRows + gateUpRows - 1) / gateUpRows), static_cast<unsigned>(slots)),
        dim3(kThreads), 0, stream, a, hStride, gateUpRows);
    status = checkLaunch("engram_moe_experts_grouped_bf16 (gate / up)");
    if (status != 0)
    {
        return status;
    }
    int32_t const downRows = rowsPerBlockOf(slots, a.hidden);
    resetLaunchError();
    launchDependent(moeGroupedDownKernel,
        dim3(static_cast<unsigned>((a.hidden + downRows - 1) / downRows), static_cast<unsigned>(slots)), dim3(kThreads),
        0, stream, a, hStride, yOffset, downExpertStride, downRowStride, downRows);
    status = checkLaunch("engram_moe_experts_grouped_bf16 (down)");
    if (status != 0)
    {
        return status;
    }
    int64_t const items = a.num_tokens * (a.hidden / 8);
    resetLaunchError();
    launchDependent(moeGroupedCombineKernel,
        dim3(static_cast<unsigned>((items + kCombineThreads - 1) / kCombineThreads)), dim3(kCombineThreads), 0, stream,
        a, yOffset);
    return checkLaunch("engram_moe_experts_grouped_bf16 (combine)");
}
