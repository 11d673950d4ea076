// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * DeepSeek-V4's manifold-constrained hyper-connections (mHC) per token: the reference is
 * engram_trt.models.deepseek_v4.modules.HyperConnection / HyperHead (tied to transformers'
 * DeepseekV4HyperConnection / DeepseekV4HyperHead), the float64 one
 * engram_trt.builder.reference_mhc.
 *
 * With x = the token's hc streams flattened (K = hc * D values), n = (2 + hc) * hc rows of
 * fn [n, K], r = rsqrt(mean(x^2) + norm_eps) and m = r * (fn @ x):
 *   pre[c]   = sigmoid(m[c] scale[0] + base[c]) + hc_eps
 *   post[c]  = 2 sigmoid(m[hc + c] scale[1] + base[hc + c])
 *   comb     = softmax_j(m[2 hc + i hc + j] scale[2] + base[...]) + hc_eps, then Sinkhorn-Knopp:
 *              columns, then iters - 1 rounds of rows and columns (each sum + hc_eps)
 *   collapsed[d] = sum_c pre[c] x[c, d]                       (engram_mhc_pre)
 *   new[k, d]    = post[k] out[d] + sum_j comb[j, k] x[j, d]   (engram_mhc_post; comb^T)
 * The head (engram_mhc_head) is the pre alone over hc rows of fn with one scale.
 *
 * Launches (one stream, each reading what the one before wrote; each a programmatic
 * dependent launch on sm_90+, dependentLaunch.cuh):
 *   1. mix:      a block per (tile of TOK tokens, span of K): one pass over the span of
 *                x and of every fn row, the sum of squares and the n dot products in fp32
 *                registers, reduced over the block into workspace [splits, T, n + 1]
 *                (no atomics: the result does not depend on the schedule). The split of
 *                K depends only on T and K (a fixed target of blocks), so the workspace
 *                size needs no device and every GPU adds in the same order.
 *                A decode step (T <= kMhcSmallTokens) takes its own mix kernel: 256
 *                threads a block, a lane per 8 columns of a 256-column span and a warp per
 *                set of fn rows, fn's loads issued before the wait for the kernel before
 *                (the general plan gives one token 32 blocks of one warp each, every lane
 *                walking all fn rows; the collapse measured 34 us on the H100 with it).
 *   2. finalize: a block per token: the partials summed (a warp per row, its lanes over
 *                the splits), the coefficients (Sinkhorn by warp 0, the matrix in
 *                registers, sums through shuffles), post / comb written (fp32), then the
 *                collapse, rounded once to the io type; engram_mhc_pre_norm /
 *                engram_mhc_head_norm then RMS-normalize it in place (the layer's norm).
 *                ENGRAM_TRT_MHC_SPLIT_FINALIZE=1 (opt-in: tests/gpu/test_mhc.py passes
 *                with it, but its A/B on an H100 was not clearly faster): a layer's
 *                finalize in two blocks a token, post / comb (the ~40 dependent Sinkhorn
 *                rounds) beside the collapse instead of before it; the same bits.
 *   3. post:     a thread per (token, 8 channels): all hc streams of its channels read
 *                before any is written, so new_streams may be streams (in place). post
 *                and comb are rounded to the io type first, as the reference's
 *                post.to(dtype) / comb.to(dtype) do; the sum is fp32, rounded once.
 */
#include "dependentLaunch.cuh"
#include "engramKernelsCore.h"
#include "engramKernelsInternal.h"
#include "mhcKernels.h"
#include "vecLoad.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdlib>

namespace engram_trt
{
namespace kernels
{

namespace
{

constexpr int kMhcThreads = 256;
constexpr int kMhcWarps = kMhcThreads / 32;
constexpr int64_t kMhcTargetBlocks = 256; // mix blocks aimed at (independent of the device)
constexpr int64_t kMhcMinSpan = 32;       // vectors of 8 per mix block, at least
constexpr int64_t kMhcTileTokens = 256;   // from this many tokens on, 4 tokens share a block's fn loads
constexpr int64_t kMhcSmallTokens = 8;    // up to this many tokens: the decode mix (a warp per fn row set)
constexpr int kMhcMaxEntries = ENGRAM_MHC_MAX_HC * ENGRAM_MHC_MAX_HC;

/*
 * Kernel 1: blockIdx.x = token tile, blockIdx.y = split of K. MaxRows bounds rows (the
 * accumulators stay in registers); partial [splits, T, rows + 1]: rows dots, then sum x^2.
 */
template <typename IoT, int MaxRows, int Tok>
__global__ void __launch_bounds__(kMhcThreads) mhcMixKernel(IoT const* __restrict__ x, float const* __restrict__ fn,
    int32_t rows, int64_t numTokens, int64_t vectors, int64_t span, float* __restrict__ partial)
{
    constexpr int kAcc = MaxRows + 1;
    __shared__ float warpPartial[kMhcWarps][Tok * kAcc];
    waitForPrimary(); // x comes from the kernel before (dependentLaunch.cuh)
    allowDependents();
    int64_t const t0 = static_cast<int64_t>(blockIdx.x) * Tok;
    int64_t const split = blockIdx.y;
    int64_t const first = split * span;
    int64_t const last = first + span < vectors ? first + span : vectors;
    int64_t const width = vectors * 8;

    float acc[Tok][kAcc];
#pragma unroll
    for (int k = 0; k < Tok; ++k)
    {
#pragma unroll
        for (int r = 0; r < kAcc; ++r)
        {
            acc[k][r] = 0.0F;
        }
    }
    for (int64_t v = first + threadIdx.x; v < last; v += blockDim.x)
    {
        float xv[Tok][8];
#pragma unroll
        for (int k = 0; k < Tok; ++k)
        {
            if (t0 + k < numTokens)
            {
                load8(x + (t0 + k) * width + 8 * v, xv[k]);
            }
            else
            {
#pragma unroll
                for (int i = 0; i < 8; ++i)
                {
                    xv[k][i] = 0.0F;
                }
            }
#pragma unroll
            for (int i = 0; i < 8; ++i)
            {
                acc[k][MaxRows] += xv[k][i] * xv[k][i];
            }
        }
#pragma unroll
        for (int r = 0; r < MaxRows; ++r)
        {
            if (r < rows)
            {
                float w[8];
                load8(fn + r * width + 8 * v, w);
#pragma unroll
                for (int k = 0; k < Tok; ++k)
                {
#pragma unroll
                    for (int i = 0; i < 8; ++i)
                    {
                        acc[k][r] += w[i] * xv[k][i];
                    }
                }
            }
        }
    }
    int const warp = threadIdx.x / 32;
    int const lane = threadIdx.x % 32;
#pragma unroll
    for (int k = 0; k < Tok; ++k)
    {
#pragma unroll
        for (int r = 0; r < kAcc; ++r)
        {
            if (r < rows || r == MaxRows)
            {
                float const s = warpSum(acc[k][r]);
                if (lane == 0)
                {
                    warpPartial[warp][k * kAcc + r] = s;
                }
            }
        }
    }
    __syncthreads();
    int const warps = (static_cast<int>(blockDim.x) + 31) / 32;
    for (int e = threadIdx.x; e < Tok * (rows + 1); e += blockDim.x)
    {
        int const k = e / (rows + 1);
        int const j = e - k * (rows + 1);
        int const r = j == rows ? MaxRows : j; // the sum of squares sits last in both layouts
        if (t0 + k >= numTokens)
        {
            continue;
        }
        float s = 0.0F;
        for (int w = 0; w < warps; ++w)
        {
            s += warpPartial[w][k * kAcc + r];
        }
        partial[(split * numTokens + t0 + k) * (rows + 1) + j] = s;
    }
}

/*
 * Kernel 1 for a decode step (T <= kMhcSmallTokens): blockIdx.x = t, blockIdx.y = a span of
 * 32 vectors of 8 (one a lane); warp w owns fn rows w, w + 8, ... (RowsPerWarp of them), so
 * a block keeps 8 x RowsPerWarp rows' loads in flight where the general kernel's 32-thread
 * blocks kept one warp's. fn is a weight: its loads go out before the kernel waits for the
 * one before it (dependentLaunch.cuh); then x. partial as the general kernel's.
 */
template <typename IoT, int RowsPerWarp>
__global__ void __launch_bounds__(kMhcThreads) mhcMixSmallKernel(IoT const* __restrict__ x,
    float const* __restrict__ fn, int32_t rows, int64_t numTokens, int64_t vectors, float* __restrict__ partial)
{
    int const lane = threadIdx.x % 32;
    int const warp = threadIdx.x / 32;
    int64_t const t = blockIdx.x;
    int64_t const split = blockIdx.y;
    int64_t const v = split * 32 + lane;
    int64_t const width = vectors * 8;
    bool const inside = v < vectors;
    float w[RowsPerWarp][8];
#pragma unroll
    for (int j = 0; j < RowsPerWarp; ++j)
    {
        int const r = warp + kMhcWarps * j;
        if (inside && r < rows)
        {
            load8(fn + r * width + 8 * v, w[j]);
        }
        else
        {
#pragma unroll
            for (int i = 0; i < 8; ++i)
            {
                w[j][i] = 0.0F;
            }
        }
    }
    waitForPrimary();
    allowDependents();
    float xv[8];
    if (inside)
    {
        load8(x + t * width + 8 * v, xv);
    }
    else
    {
#pragma unroll
        for (int i = 0; i < 8; ++i)
        {
            xv[i] = 0.0F;
        }
    }
    float* const out = partial + (split * numTokens + t) * (rows + 1);
#pragma unroll
    for (int j = 0; j < RowsPerWarp; ++j)
    {
        int const r = warp + kMhcWarps * j;
        float acc = 0.0F;
#pragma unroll
        for (int i = 0; i < 8; ++i)
        {
            acc += w[j][i] * xv[i];
        }
        acc = warpSum(acc);
        if (lane == 0 && r < rows)
        {
            out[r] = acc;
        }
    }
    if (warp == 0)
    {
        float squares = 0.0F;
#pragma unroll
        for (int i = 0; i < 8; ++i)
        {
            squares += xv[i] * xv[i];
        }
        squares = warpSum(squares);
        if (lane == 0)
        {
            out[rows] = squares;
        }
    }
}

//! The entry q of the hc x hc matrix a warp holds in registers (entry q in lane q % 32 of v0
//! for q < 32, of v1 above); q may differ from lane to lane.
__device__ __forceinline__ float entryAt(float v0, float v1, int q)
{
    float const a = __shfl_sync(0xFFFFFFFFu, v0, q & 31);
    float const b = __shfl_sync(0xFFFFFFFFu, v1, q & 31);
    return q < 32 ? a : b;
}

//! Warp 0's Sinkhorn-Knopp on the shared row-major hc x hc matrix m: columns, then iters - 1
//! rounds of rows and columns, each divided by its sum + eps. The matrix lives in
//! registers (an entry a lane, two for hc > 5) and the sums come through shuffles, in the
//! order the shared-memory form added them (s = 0, then entry by entry), so the result is
//! that form's bit for bit; a round costs hc shuffles instead of two shared-memory trips
//! and two warp barriers.
__device__ void sinkhornWarp(float* m, int32_t hc, int32_t iters, float eps)
{
    int const lane = threadIdx.x % 32;
    int const entries = hc * hc;
    int const e0 = lane;
    int const e1 = lane + 32;
    float v0 = e0 < entries ? m[e0] : 0.0F;
    float v1 = e1 < entries ? m[e1] : 0.0F;
    int const row0 = e0 / hc;
    int const col0 = e0 - row0 * hc;
    int const row1 = e1 / hc;
    int const col1 = e1 - row1 * hc;
    for (int32_t round = 0; round < 2 * iters - 1; ++round)
    {
        bool const columns = round % 2 == 0;
        float s0 = 0.0F;
        float s1 = 0.0F;
        for (int32_t i = 0; i < hc; ++i)
        {
            s0 += entryAt(v0, v1, columns ? i * hc + col0 : row0 * hc + i);
            if (entries > 32)
            {
                s1 += entryAt(v0, v1, columns ? i * hc + col1 : row1 * hc + i);
            }
        }
        v0 = v0 / (s0 + eps);
        v1 = v1 / (s1 + eps);
    }
    if (e0 < entries)
    {
        m[e0] = v0;
    }
    if (e1 < entries)
    {
        m[e1] = v1;
    }
    __syncwarp();
}

//! sinkhornWarp for a compile-time hc <= 5 (hc * hc entries in one register a lane): the hc
//! shuffles of a round issued before its sum, which adds them in the same order (the same
//! bits as the general form).
template <int HC>
__device__ void sinkhornWarpFixed(float* m, int32_t iters, float eps)
{
    static_assert(HC * HC <= 32, "one register a lane");
    int const lane = threadIdx.x % 32;
    int const row = lane / HC;
    int const col = lane - row * HC;
    float v = lane < HC * HC ? m[lane] : 0.0F;
    for (int32_t round = 0; round < 2 * iters - 1; ++round)
    {
        bool const columns = round % 2 == 0;
        float vals[HC];
#pragma unroll
        for (int i = 0; i < HC; ++i)
        {
            vals[i] = __shfl_sync(0xFFFFFFFFu, v, (columns ? i * HC + col : row * HC + i) & 31);
        }
        float s = 0.0F;
#pragma unroll
        for (int i = 0; i < HC; ++i)
        {
            s += vals[i];
        }
        v = v / (s + eps);
    }
    if (lane < HC * HC)
    {
        m[lane] = v;
    }
    __syncwarp();
}

/*
 * Kernel 2: blockIdx.x = t. head != 0: pre only (rows = hc, one scale); else the layer's
 * pre / post / comb, post [T, hc] and comb [T, hc, hc] written in fp32. The partials of a
 * row are summed by one warp (its lanes over the splits, then a butterfly). normWeight
 * != NULL: the collapse rounded to the io type is then RMS-normalized in place (the
 * layer's RMSNorm: float32 weight * (c * rsqrt(mean(c^2) + rmsEps)), rounded once).
 */
template <typename IoT>
__global__ void __launch_bounds__(kMhcThreads)
    mhcFinalizeKernel(IoT const* __restrict__ x, float const* __restrict__ partial, int64_t splits,
        float const* __restrict__ base, float const* __restrict__ scale, int64_t numTokens, int32_t hc, int32_t hidden,
        int32_t iters, float hcEps, float normEps, int32_t head, float const* __restrict__ normWeight, float rmsEps,
        IoT* __restrict__ collapsed, float* __restrict__ post, float* __restrict__ comb)
{
    __shared__ float mix[(2 + ENGRAM_MHC_MAX_HC) * ENGRAM_MHC_MAX_HC + 1];
    __shared__ float pre[ENGRAM_MHC_MAX_HC];
    __shared__ float matrix[kMhcMaxEntries];
    __shared__ float stats[2 * ENGRAM_MHC_MAX_HC];
    __shared__ float squareParts[kMhcWarps];
    waitForPrimary(); // the partials come from the mix kernel (dependentLaunch.cuh)
    allowDependents();
    int64_t const t = blockIdx.x;
    int32_t const rows = head != 0 ? hc : (2 + hc) * hc;
    int const lane = threadIdx.x % 32;
    int const warp = threadIdx.x / 32;
    int const warps = (static_cast<int>(blockDim.x) + 31) / 32;
    for (int e = warp; e <= rows; e += warps)
    {
        float s = 0.0F;
        for (int64_t p = lane; p < splits; p += 32)
        {
            s += partial[(p * numTokens + t) * (rows + 1) + e];
        }
        s = warpSum(s);
        if (lane == 0)
        {
            mix[e] = s;
        }
    }
    __syncthreads();
    int64_t const width = static_cast<int64_t>(hc) * hidden;
    float const r = rsqrtf(mix[rows] / static_cast<float>(width) + normEps);
    // gridDim.y 2 (a layer's finalize with ENGRAM_TRT_MHC_SPLIT_FINALIZE=1): blockIdx.y 0 the pre weights, the
    // collapse and its norm (what the next kernel reads first), 1 post and comb, whose ~40 dependent Sinkhorn rounds
    // then run beside the collapse on another SM instead of before it (only the next sublayer's expansion reads
    // them). Both sum the same partials in the same order: every output keeps its bits. gridDim.y 1: one block both.
    bool const split = gridDim.y > 1;
    int const role = split ? static_cast<int>(blockIdx.y) : 0;
    if (threadIdx.x < 32)
    {
        float const s0 = scale[0];
        if (lane < hc && role == 0)
        {
            pre[lane] = sigmoidOf(mix[lane] * r * s0 + base[lane]) + hcEps;
        }
        if (head == 0 && (!split || role == 1))
        {
            float const s1 = scale[1];
            float const s2 = scale[2];
            if (lane < hc)
            {
                post[t * hc + lane] = 2.0F * sigmoidOf(mix[hc + lane] * r * s1 + base[hc + lane]);
            }
            int const entries = hc * hc;
            for (int e = lane; e < entries; e += 32)
            {
                matrix[e] = mix[2 * hc + e] * r * s2 + base[2 * hc + e];
            }
            __syncwarp();
            if (lane < hc) // row softmax: the row's max and sum of exponentials
            {
                float mx = matrix[lane * hc];
                for (int32_t j = 1; j < hc; ++j)
                {
                    mx = fmaxf(mx, matrix[lane * hc + j]);
                }
                float s = 0.0F;
                for (int32_t j = 0; j < hc; ++j)
                {
                    s += expf(matrix[lane * hc + j] - mx);
                }
                stats[lane] = mx;
                stats[ENGRAM_MHC_MAX_HC + lane] = s;
            }
            __syncwarp();
            for (int e = lane; e < entries; e += 32)
            {
                int const i = e / hc;
                matrix[e] = expf(matrix[e] - stats[i]) / stats[ENGRAM_MHC_MAX_HC + i] + hcEps;
            }
            __syncwarp();
            if (hc == 4)
            {
                sinkhornWarpFixed<4>(matrix, iters, hcEps);
            }
            else if (hc == 2)
            {
                sinkhornWarpFixed<2>(matrix, iters, hcEps);
            }
            else
            {
                sinkhornWarp(matrix, hc, iters, hcEps);
            }
            for (int e = lane; e < entries; e += 32)
            {
                comb[t * entries + e] = matrix[e];
            }
        }
    }
    if (role == 1)
    {
        return; // the whole block: no barrier follows for it
    }
    __syncthreads();
    IoT const* xt = x + t * width;
    IoT* ct = collapsed + t * hidden;
    float squares = 0.0F;
    for (int32_t v = threadIdx.x; v < hidden / 8; v += blockDim.x)
    {
        float acc[8] = {0.0F, 0.0F, 0.0F, 0.0F, 0.0F, 0.0F, 0.0F, 0.0F};
        for (int32_t c = 0; c < hc; ++c)
        {
            float xv[8];
            load8(xt + static_cast<int64_t>(c) * hidden + 8 * v, xv);
            float const p = pre[c];
#pragma unroll
            for (int i = 0; i < 8; ++i)
            {
                acc[i] += p * xv[i];
            }
        }
        if (normWeight != nullptr)
        {
#pragma unroll
            for (int i = 0; i < 8; ++i)
            {
                float const c = roundTo<IoT>(acc[i]);
                squares += c * c;
            }
        }
        store8(ct + 8 * v, acc);
    }
    if (normWeight == nullptr)
    {
        return;
    }
    squares = warpSum(squares);
    if (lane == 0)
    {
        squareParts[warp] = squares;
    }
    __syncthreads();
    float total = 0.0F;
    for (int w = 0; w < warps; ++w)
    {
        total += squareParts[w];
    }
    // RMSNorm: mean (sum / D) + eps, rsqrt; weight * (c * rsqrt), float32 products, one rounding
    float const rn = rsqrtf(__fadd_rn(__fdiv_rn(total, static_cast<float>(hidden)), rmsEps));
    for (int32_t v = threadIdx.x; v < hidden / 8; v += blockDim.x)
    {
        float c[8];
        float w[8];
        load8(ct + 8 * v, c); // this thread's own stores above
        load8(normWeight + 8 * v, w);
#pragma unroll
        for (int i = 0; i < 8; ++i)
        {
            c[i] = __fmul_rn(w[i], __fmul_rn(c[i], rn));
        }
        store8(ct + 8 * v, c);
    }
}

//! new[k] of one vector of 8 channels (engram_mhc_post's sum): post[k] rounded to the io
//! type times out, then each stream j times comb[j, k] rounded to the io type, in fp32
//! (stream order); the post kernel and the fold's first phase share it, so both give the
//! same bits: the product and the fused multiply-adds are explicit (__fmul_rn, __fmaf_rn),
//! so no kernel's contraction choice can make them differ.
template <typename IoT, int MaxHc>
__device__ __forceinline__ void expandVector(float const (&s)[MaxHc][8], float const (&o)[8],
    float const* __restrict__ pt, float const* __restrict__ ct, int32_t hc, int k, float (&acc)[8])
{
    float const p = roundTo<IoT>(pt[k]);
#pragma unroll
    for (int i = 0; i < 8; ++i)
    {
        acc[i] = __fmul_rn(p, o[i]);
    }
#pragma unroll
    for (int j = 0; j < MaxHc; ++j)
    {
        if (j < hc)
        {
            float const w = roundTo<IoT>(ct[j * hc + k]);
#pragma unroll
            for (int i = 0; i < 8; ++i)
            {
                acc[i] = __fmaf_rn(w, s[j][i], acc[i]);
            }
        }
    }
}

/*
 * Kernel 3: a thread per (token, vector of 8 channels).
 */
template <typename IoT>
__global__ void __launch_bounds__(kMhcThreads)
    mhcPostKernel(IoT const* streams, IoT const* __restrict__ out, float const* __restrict__ post,
        float const* __restrict__ comb, int64_t numTokens, int32_t hc, int32_t hidden, IoT* newStreams)
{
    waitForPrimary(); // streams and out come from the kernels before (dependentLaunch.cuh)
    allowDependents();
    int64_t const vectorsPerToken = hidden / 8;
    int64_t const idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (idx >= numTokens * vectorsPerToken)
    {
        return;
    }
    int64_t const t = idx / vectorsPerToken;
    int64_t const v = idx - t * vectorsPerToken;
    int64_t const width = static_cast<int64_t>(hc) * hidden;
    IoT const* st = streams + t * width + 8 * v;
    float s[ENGRAM_MHC_MAX_HC][8];
#pragma unroll
    for (int j = 0; j < ENGRAM_MHC_MAX_HC; ++j)
    {
        if (j < hc)
        {
            load8(st + static_cast<int64_t>(j) * hidden, s[j]);
        }
    }
    float o[8];
    load8(out + t * hidden + 8 * v, o);
    float const* pt = post + t * hc;
    float const* ct = comb + t * hc * hc;
    IoT* nt = newStreams + t * width + 8 * v;
#pragma unroll
    for (int k = 0; k < ENGRAM_MHC_MAX_HC; ++k)
    {
        if (k < hc)
        {
            float acc[8];
            expandVector<IoT, ENGRAM_MHC_MAX_HC>(s, o, pt, ct, hc, k, acc);
            store8(nt + static_cast<int64_t>(k) * hidden, acc);
        }
    }
}

/*
 * Kernel 1 of a fold (engram_mhc_fold: the expansion after one sublayer and the mix of the
 * collapse before the next, T <= kMhcSmallTokens): blockIdx.x = t, blockIdx.y = a span of
 * kFoldVectors vectors of 8 channels, taken in EVERY stream (a block owns its columns of
 * all hc streams, so the expansion may write the streams in place: the block reads its
 * columns of every stream before any thread writes one).
 *   phase 1: thread c * kFoldVectors + v makes stream c's vector v of the new streams
 *            (expandVector: the post kernel's sum, the same bits), rounded to the io type
 *            as stored, into the new streams and into shared memory;
 *   phase 2: the mix kernel's dot products over the block's hc * kFoldVectors vectors of
 *            the flattened new streams (flat index c * hidden + channel), warp w owning
 *            fn rows w, w + 8, ..., the lanes the (stream, vector) pairs; warp 0 the sum of
 *            squares; partial [splits, T, rows + 1] as the mix kernels write it (the
 *            finalize adds the splits whatever they cover).
 * fn is a weight: with few rows a warp its loads go out before the wait for the kernel
 * before (dependentLaunch.cuh); the streams and out only after it.
 */
constexpr int kFoldVectors = 8;

template <typename IoT, int RowsPerWarp, int MaxHc>
__global__ void __launch_bounds__(kMhcThreads) mhcFoldMixKernel(IoT const* streams, IoT const* __restrict__ out,
    float const* __restrict__ post, float const* __restrict__ comb, float const* __restrict__ fn, int32_t rows,
    int64_t numTokens, int32_t hc, int32_t hidden, IoT* newStreams, float* __restrict__ partial)
{
    constexpr int kSlots = MaxHc * kFoldVectors;      // (stream, vector) pairs a block can hold
    constexpr int kPairsPerLane = (kSlots + 31) / 32; // of them, a lane's in phase 2
    constexpr bool kPrefetch = RowsPerWarp * kPairsPerLane <= 4;
    static_assert(kSlots <= kMhcThreads, "a thread per (stream, vector) in phase 1");
    __shared__ __align__(16) float fresh[kSlots][8];
    int const lane = threadIdx.x % 32;
    int const warp = threadIdx.x / 32;
    int const tid = static_cast<int>(threadIdx.x);
    int64_t const t = blockIdx.x;
    int64_t const split = blockIdx.y;
    int32_t const vectors = hidden / 8; // of one stream
    int64_t const width = static_cast<int64_t>(hc) * hidden;
    int const pairs = hc * kFoldVectors;

    float w[kPrefetch ? RowsPerWarp : 1][kPrefetch ? kPairsPerLane : 1][8];
    if constexpr (kPrefetch)
    {
#pragma unroll
        for (int j = 0; j < RowsPerWarp; ++j)
        {
#pragma unroll
            for (int q = 0; q < kPairsPerLane; ++q)
            {
                int const p = lane + 32 * q;
                int const r = warp + kMhcWarps * j;
                int64_t const v = split * kFoldVectors + p % kFoldVectors;
                if (p < pairs && v < vectors && r < rows)
                {
                    load8(fn + r * width + static_cast<int64_t>(p / kFoldVectors) * hidden + 8 * v, w[j][q]);
                }
                else
                {
#pragma unroll
                    for (int i = 0; i < 8; ++i)
                    {
                        w[j][q][i] = 0.0F;
                    }
                }
            }
        }
    }
    waitForPrimary(); // the streams and out come from the kernels before (dependentLaunch.cuh)
    allowDependents();

    // phase 1: the expansion
    int const c1 = tid / kFoldVectors;
    int64_t const v1 = split * kFoldVectors + tid % kFoldVectors;
    bool const mine = tid < pairs && v1 < vectors;
    float acc[8] = {0.0F, 0.0F, 0.0F, 0.0F, 0.0F, 0.0F, 0.0F, 0.0F};
    if (mine)
    {
        IoT const* st = streams + t * width + 8 * v1;
        float s[MaxHc][8];
#pragma unroll
        for (int j = 0; j < MaxHc; ++j)
        {
            if (j < hc)
            {
                load8(st + static_cast<int64_t>(j) * hidden, s[j]);
            }
        }
        float o[8];
        load8(out + t * hidden + 8 * v1, o);
        expandVector<IoT, MaxHc>(s, o, post + t * hc, comb + t * hc * hc, hc, c1, acc);
#pragma unroll
        for (int i = 0; i < 8; ++i)
        {
            acc[i] = roundTo<IoT>(acc[i]); // as stored: the mix reads the stored streams
        }
    }
    __syncthreads(); // every stream's columns of this block read before any is written (in place)
    if (tid < kSlots)
    {
        if (mine)
        {
            store8(newStreams + t * width + static_cast<int64_t>(c1) * hidden + 8 * v1, acc);
        }
#pragma unroll
        for (int i = 0; i < 8; ++i)
        {
            fresh[tid][i] = acc[i]; // zeros outside the streams
        }
    }
    __syncthreads();

    // phase 2: the mix of the new streams
    float xv[kPairsPerLane][8];
#pragma unroll
    for (int q = 0; q < kPairsPerLane; ++q)
    {
        int const p = lane + 32 * q;
#pragma unroll
        for (int i = 0; i < 8; ++i)
        {
            xv[q][i] = p < kSlots ? fresh[p][i] : 0.0F;
        }
    }
    float* const dst = partial + (split * numTokens + t) * (rows + 1);
#pragma unroll
    for (int j = 0; j < RowsPerWarp; ++j)
    {
        int const r = warp + kMhcWarps * j;
        if (r >= rows) // warp-uniform
        {
            break;
        }
        float dot = 0.0F;
#pragma unroll
        for (int q = 0; q < kPairsPerLane; ++q)
        {
            float wr[8];
            if constexpr (kPrefetch)
            {
#pragma unroll
                for (int i = 0; i < 8; ++i)
                {
                    wr[i] = w[j][q][i];
                }
            }
            else
            {
                int const p = lane + 32 * q;
                int64_t const v = split * kFoldVectors + p % kFoldVectors;
                if (p < pairs && v < vectors)
                {
                    load8(fn + r * width + static_cast<int64_t>(p / kFoldVectors) * hidden + 8 * v, wr);
                }
                else
                {
#pragma unroll
                    for (int i = 0; i < 8; ++i)
                    {
                        wr[i] = 0.0F;
                    }
                }
            }
#pragma unroll
            for (int i = 0; i < 8; ++i)
            {
                dot += wr[i] * xv[q][i];
            }
        }
        dot = warpSum(dot);
        if (lane == 0)
        {
            dst[r] = dot;
        }
    }
    if (warp == 0)
    {
        float squares = 0.0F;
#pragma unroll
        for (int q = 0; q < kPairsPerLane; ++q)
        {
#pragma unroll
            for (int i = 0; i < 8; ++i)
            {
                squares += xv[q][i] * xv[q][i];
            }
        }
        squares = warpSum(squares);
        if (lane == 0)
        {
            dst[rows] = squares;
        }
    }
}

//! How the mix kernel splits the work for T tokens, `vectors` = K / 8 and `rows` fn rows.
struct MixPlan
{
    int tok;
    int64_t tiles;
    int64_t span;
    int64_t splits;
    int threads;
    bool small; // the decode kernel (mhcMixSmallKernel): a span of 32 vectors a block
};

MixPlan mixPlan(int64_t numTokens, int64_t vectors, int32_t rows)
{
    MixPlan p{};
    if (numTokens <= kMhcSmallTokens)
    {
        p.small = true;
        p.tok = 1;
        p.tiles = numTokens;
        p.span = 32;
        p.splits = (vectors + 31) / 32;
        p.threads = kMhcThreads;
        return p;
    }
    p.tok = (numTokens >= kMhcTileTokens && rows <= 24) ? 4 : 1;
    p.tiles = (numTokens + p.tok - 1) / p.tok;
    int64_t const maxSplits = (vectors + kMhcMinSpan - 1) / kMhcMinSpan;
    int64_t const tiles = p.tiles > 0 ? p.tiles : 1; // no tokens: any split, nothing launched
    int64_t want = (kMhcTargetBlocks + tiles - 1) / tiles;
    want = want < 1 ? 1 : (want > maxSplits ? maxSplits : want);
    int64_t span = (vectors + want - 1) / want;
    span = (span + kMhcMinSpan - 1) / kMhcMinSpan * kMhcMinSpan;
    p.span = span;
    p.splits = (vectors + span - 1) / span;
    p.threads = static_cast<int>(span < kMhcThreads ? span : kMhcThreads);
    return p;
}

int64_t partialFloats(int64_t numTokens, int32_t hc, int32_t hidden, int32_t rows)
{
    int64_t const vectors = static_cast<int64_t>(hc) * hidden / 8;
    return mixPlan(numTokens, vectors, rows).splits * numTokens * (rows + 1);
}

int64_t workspaceFloats(int64_t numTokens, int32_t hc, int32_t hidden)
{
    int64_t const layer = partialFloats(numTokens, hc, hidden, (2 + hc) * hc);
    int64_t const head = partialFloats(numTokens, hc, hidden, hc);
    return layer > head ? layer : head;
}

template <typename IoT, int MaxRows, int Tok>
void launchMixAs(MixPlan const& p, void const* x, float const* fn, int32_t rows, int64_t numTokens, int64_t vectors,
    float* partial, cudaStream_t stream)
{
    dim3 const grid(static_cast<unsigned>(p.tiles), static_cast<unsigned>(p.splits));
    launchDependent(mhcMixKernel<IoT, MaxRows, Tok>, grid, dim3(p.threads), 0, stream, static_cast<IoT const*>(x), fn,
        rows, numTokens, vectors, p.span, partial);
}

template <typename IoT, int RowsPerWarp>
void launchMixSmall(MixPlan const& p, void const* x, float const* fn, int32_t rows, int64_t numTokens, int64_t vectors,
    float* partial, cudaStream_t stream)
{
    dim3 const grid(static_cast<unsigned>(p.tiles), static_cast<unsigned>(p.splits));
    launchDependent(mhcMixSmallKernel<IoT, RowsPerWarp>, grid, dim3(p.threads), 0, stream, static_cast<IoT const*>(x),
        fn, rows, numTokens, vectors, partial);
}

template <typename IoT>
int launchMix(void const* x, float const* fn, int32_t rows, int64_t numTokens, int64_t vectors, float* partial,
    cudaStream_t stream, MixPlan& plan)
{
    plan = mixPlan(numTokens, vectors, rows);
    resetLaunchError();
    if (plan.small)
    {
        if (rows <= kMhcWarps)
        {
            launchMixSmall<IoT, 1>(plan, x, fn, rows, numTokens, vectors, partial, stream);
        }
        else if (rows <= 3 * kMhcWarps)
        {
            launchMixSmall<IoT, 3>(plan, x, fn, rows, numTokens, vectors, partial, stream);
        }
        else
        {
            launchMixSmall<IoT, ((2 + ENGRAM_MHC_MAX_HC) * ENGRAM_MHC_MAX_HC + kMhcWarps - 1) / kMhcWarps>(
                plan, x, fn, rows, numTokens, vectors, partial, stream);
        }
    }
    else if (rows <= 8)
    {
        plan.tok == 4 ? launchMixAs<IoT, 8, 4>(plan, x, fn, rows, numTokens, vectors, partial, stream)
                      : launchMixAs<IoT, 8, 1>(plan, x, fn, rows, numTokens, vectors, partial, stream);
    }
    else if (rows <= 24)
    {
        plan.tok == 4 ? launchMixAs<IoT, 24, 4>(plan, x, fn, rows, numTokens, vectors, partial, stream)
                      : launchMixAs<IoT, 24, 1>(plan, x, fn, rows, numTokens, vectors, partial, stream);
    }
    else
    {
        launchMixAs<IoT, (2 + ENGRAM_MHC_MAX_HC) * ENGRAM_MHC_MAX_HC, 1>(
            plan, x, fn, rows, numTokens, vectors, partial, stream);
    }
    return checkLaunch("engram_mhc (mix)");
}

struct CollapseLaunch
{
    void const* streams;
    float const* fn;
    float const* base;
    float const* scale;
    int64_t numTokens;
    int32_t hc;
    int32_t hidden;
    int32_t iters;
    float hcEps;
    float normEps;
    int32_t head;
    float* partial;
    void* collapsed;
    float* post;
    float* comb;
    cudaStream_t stream;
    float const* normWeight; // the fused RMSNorm's weight (NULL: none)
    float rmsEps;
};

template <typename IoT>
int launchFinalize(CollapseLaunch const& a, int64_t splits)
{
    int64_t const wanted = (a.hidden / 8 + 31) / 32 * 32;
    unsigned const threads = static_cast<unsigned>(wanted < kMhcThreads ? wanted : kMhcThreads);
    // (token, role): two roles for a layer's finalize with ENGRAM_TRT_MHC_SPLIT_FINALIZE=1 (the kernel's comment;
    // read at each launch: a graph records the grid its capture took), else one block a token does both
    char const* const env = std::getenv("ENGRAM_TRT_MHC_SPLIT_FINALIZE");
    bool const split = a.head == 0 && env != nullptr && env[0] == '1' && env[1] == '\0';
    dim3 const grid(static_cast<unsigned>(a.numTokens), split ? 2U : 1U);
    resetLaunchError();
    launchDependent(mhcFinalizeKernel<IoT>, grid, dim3(threads), 0, a.stream, static_cast<IoT const*>(a.streams),
        a.partial, splits, a.base, a.scale, a.numTokens, a.hc, a.hidden, a.iters, a.hcEps, a.normEps, a.head,
        a.normWeight, a.rmsEps, static_cast<IoT*>(a.collapsed), a.post, a.comb);
    return checkLaunch("engram_mhc (finalize)");
}

template <typename IoT>
int launchCollapse(CollapseLaunch const& a)
{
    int32_t const rows = a.head != 0 ? a.hc : (2 + a.hc) * a.hc;
    int64_t const vectors = static_cast<int64_t>(a.hc) * a.hidden / 8;
    MixPlan plan{};
    int status = launchMix<IoT>(a.streams, a.fn, rows, a.numTokens, vectors, a.partial, a.stream, plan);
    if (status != 0)
    {
        return status;
    }
    return launchFinalize<IoT>(a, plan.splits);
}

int launchCollapseFor(int32_t ioType, CollapseLaunch const& a)
{
    switch (ioType)
    {
    case ENGRAM_FLOAT_BF16: return launchCollapse<__nv_bfloat16>(a);
    case ENGRAM_FLOAT_F16: return launchCollapse<__half>(a);
    default: return launchCollapse<float>(a);
    }
}

template <typename IoT>
int launchPost(void const* streams, void const* out, float const* post, float const* comb, int64_t numTokens,
    int32_t hc, int32_t hidden, void* newStreams, cudaStream_t stream)
{
    int64_t const total = numTokens * (hidden / 8);
    resetLaunchError();
    launchDependent(mhcPostKernel<IoT>, dim3(static_cast<unsigned>((total + kMhcThreads - 1) / kMhcThreads)),
        dim3(kMhcThreads), 0, stream, static_cast<IoT const*>(streams), static_cast<IoT const*>(out), post, comb,
        numTokens, hc, hidden, static_cast<IoT*>(newStreams));
    return checkLaunch("engram_mhc_post");
}

//! Splits of a fold's mix: kFoldVectors vectors of every stream a block.
int64_t foldSplits(int32_t hidden)
{
    return (hidden / 8 + kFoldVectors - 1) / kFoldVectors;
}

//! Floats of workspace engram_mhc_fold needs: its own mix's partials for a decode step's
//! few tokens, the collapse's otherwise (more tokens run the post then the collapse).
int64_t foldWorkspaceFloats(int64_t numTokens, int32_t hc, int32_t hidden)
{
    int64_t const general = workspaceFloats(numTokens, hc, hidden);
    if (numTokens > kMhcSmallTokens)
    {
        return general;
    }
    int64_t const fold = foldSplits(hidden) * numTokens * ((2 + hc) * hc + 1);
    return fold > general ? fold : general;
}

struct FoldLaunch
{
    void const* streams; // before the expansion
    void const* out;     // the sublayer's output
    float const* post;
    float const* comb;
    CollapseLaunch next; // next.streams: the new streams (written by the expansion)
};

template <typename IoT, int RowsPerWarp, int MaxHc>
void launchFoldMixAs(FoldLaunch const& f, int32_t rows)
{
    CollapseLaunch const& a = f.next;
    dim3 const grid(static_cast<unsigned>(a.numTokens), static_cast<unsigned>(foldSplits(a.hidden)));
    launchDependent(mhcFoldMixKernel<IoT, RowsPerWarp, MaxHc>, grid, dim3(kMhcThreads), 0, a.stream,
        static_cast<IoT const*>(f.streams), static_cast<IoT const*>(f.out), f.post, f.comb, a.fn, rows, a.numTokens,
        a.hc, a.hidden, static_cast<IoT*>(const_cast<void*>(a.streams)), a.partial);
}

template <typename IoT>
int launchFold(FoldLaunch const& f)
{
    CollapseLaunch const& a = f.next;
    if (a.numTokens > kMhcSmallTokens) // a prefill chunk: the expansion, then the collapse
    {
        int const status = launchPost<IoT>(
            f.streams, f.out, f.post, f.comb, a.numTokens, a.hc, a.hidden, const_cast<void*>(a.streams), a.stream);
        return status != 0 ? status : launchCollapse<IoT>(a);
    }
    int32_t const rows = a.head != 0 ? a.hc : (2 + a.hc) * a.hc;
    resetLaunchError();
    // RowsPerWarp * kMhcWarps must cover rows (every row of fn summed: the reverted
    // overlapped finalize of e6a1f7f summed only kMhcRowsPerWarp * warps rows, fewer than
    // hc 4's 25 with one or two warps, and left the others' mix uninitialized: its NaN)
    if (a.hc <= 2 && rows <= kMhcWarps)
    {
        launchFoldMixAs<IoT, 1, 2>(f, rows);
    }
    else if (a.hc <= 4 && rows <= 3 * kMhcWarps)
    {
        launchFoldMixAs<IoT, 3, 4>(f, rows);
    }
    else if (rows <= kMhcWarps)
    {
        launchFoldMixAs<IoT, 1, ENGRAM_MHC_MAX_HC>(f, rows);
    }
    else
    {
        constexpr int kMaxRows = (2 + ENGRAM_MHC_MAX_HC) * ENGRAM_MHC_MAX_HC;
        launchFoldMixAs<IoT, (kMaxRows + kMhcWarps - 1) / kMhcWarps, ENGRAM_MHC_MAX_HC>(f, rows);
    }
    int const status = checkLaunch("engram_mhc_fold (expand + mix)");
    return status != 0 ? status : launchFinalize<IoT>(a, foldSplits(a.hidden));
}

int checkIoType(char const* fn, int32_t ioType)
{
    if (ioType != ENGRAM_FLOAT_BF16 && ioType != ENGRAM_FLOAT_F32 && ioType != ENGRAM_FLOAT_F16)
    {
        return fail(cudaErrorInvalidValue, "%s: io_type %d is not bf16 (0), fp32 (1) or fp16 (2)", fn, ioType);
    }
    return 0;
}

int64_t ioBytes(int32_t ioType)
{
    return ioType == ENGRAM_FLOAT_F32 ? 4 : 2;
}

//! The checks engram_mhc_pre and engram_mhc_head share, after the shape's.
int checkCollapseArgs(char const* name, void const* streams, int32_t ioType, float const* fn, float const* base,
    float const* scale, int64_t numTokens, int32_t hc, int32_t hidden, void const* workspace, size_t workspaceBytes,
    void const* collapsed)
{
    int status = checkIoType(name, ioType);
    if (status != 0)
    {
        return status;
    }
    if (numTokens < 0 || numTokens > INT32_MAX)
    {
        return fail(cudaErrorInvalidValue, "%s: num_tokens must be in [0, 2^31 - 1] (got %lld)", name, ll(numTokens));
    }
    if (numTokens == 0)
    {
        return 0;
    }
    void const* aligned[] = {streams, fn, collapsed};
    for (void const* p : aligned)
    {
        if (p == nullptr || !isAligned(p, 16))
        {
            return fail(
                cudaErrorInvalidValue, "%s: streams, fn and collapsed must be 16-byte aligned device pointers", name);
        }
    }
    if (base == nullptr || scale == nullptr || workspace == nullptr || !isAligned(workspace, 4))
    {
        return fail(cudaErrorInvalidValue, "%s: base, scale and a 4-byte aligned workspace must not be NULL", name);
    }
    size_t const need = static_cast<size_t>(workspaceFloats(numTokens, hc, hidden)) * sizeof(float);
    if (workspaceBytes < need)
    {
        return fail(cudaErrorInvalidValue, "%s: workspace holds %llu bytes, %llu needed for %lld tokens", name,
            static_cast<unsigned long long>(workspaceBytes), static_cast<unsigned long long>(need), ll(numTokens));
    }
    int64_t const streamBytes = numTokens * hc * hidden * ioBytes(ioType);
    if (overlaps(collapsed, numTokens * hidden * ioBytes(ioType), streams, streamBytes)
        || overlaps(workspace, static_cast<int64_t>(workspaceBytes), streams, streamBytes)
        || overlaps(workspace, static_cast<int64_t>(workspaceBytes), collapsed, numTokens * hidden * ioBytes(ioType)))
    {
        return fail(cudaErrorInvalidValue, "%s: collapsed, streams and workspace must not overlap", name);
    }
    return 0;
}

} // namespace

} // namespace kernels
} // namespace engram_trt

using namespace engram_trt::kernels;

extern "C" ENGRAM_API int engram_mhc_check_shape(
    int32_t hcMult, int32_t hidden, int32_t sinkhornIters, float hcEps, float normEps)
{
    clearError();
    if (hcMult < 1 || hcMult > ENGRAM_MHC_MAX_HC)
    {
        return fail(
            cudaErrorInvalidValue, "engram_mhc: hc_mult must be in [1, %d] (got %d)", ENGRAM_MHC_MAX_HC, hcMult);
    }
    if (hidden < 8 || hidden % 8 != 0)
    {
        return fail(cudaErrorInvalidValue, "engram_mhc: hidden must be a positive multiple of 8 (got %d)", hidden);
    }
    if (static_cast<int64_t>(hcMult) * hidden > INT32_MAX / 8)
    {
        return fail(cudaErrorInvalidValue, "engram_mhc: hc_mult * hidden = %lld exceeds 2^28 - 1",
            static_cast<long long>(hcMult) * hidden);
    }
    if (sinkhornIters < 1 || sinkhornIters > ENGRAM_MHC_MAX_SINKHORN_ITERS)
    {
        return fail(cudaErrorInvalidValue, "engram_mhc: sinkhorn_iters must be in [1, %d] (got %d)",
            ENGRAM_MHC_MAX_SINKHORN_ITERS, sinkhornIters);
    }
    if (!std::isfinite(hcEps) || hcEps < 0.0F || !std::isfinite(normEps) || normEps < 0.0F)
    {
        return fail(cudaErrorInvalidValue, "engram_mhc: hc_eps and norm_eps must be finite and >= 0 (got %g, %g)",
            static_cast<double>(hcEps), static_cast<double>(normEps));
    }
    return 0;
}

extern "C" ENGRAM_API int engram_mhc_workspace_size(int64_t numTokens, int32_t hcMult, int32_t hidden, size_t* bytes)
{
    int status = engram_mhc_check_shape(hcMult, hidden, 1, 0.0F, 0.0F);
    if (status != 0)
    {
        return status;
    }
    if (bytes == nullptr || numTokens < 0 || numTokens > INT32_MAX)
    {
        return fail(cudaErrorInvalidValue,
            "engram_mhc_workspace_size: need bytes != NULL and num_tokens in [0, 2^31 - 1] (got %lld)", ll(numTokens));
    }
    *bytes = static_cast<size_t>(workspaceFloats(numTokens, hcMult, hidden)) * sizeof(float);
    return 0;
}

extern "C" ENGRAM_API int engram_mhc_pre(void const* streams, int32_t ioType, float const* fn, float const* base,
    float const* scale, int64_t numTokens, int32_t hcMult, int32_t hidden, int32_t sinkhornIters, float hcEps,
    float normEps, void* workspace, size_t workspaceBytes, void* collapsed, float* post, float* comb,
    cudaStream_t stream)
{
    int status = engram_mhc_check_shape(hcMult, hidden, sinkhornIters, hcEps, normEps);
    if (status != 0)
    {
        return status;
    }
    status = checkCollapseArgs("engram_mhc_pre", streams, ioType, fn, base, scale, numTokens, hcMult, hidden, workspace,
        workspaceBytes, collapsed);
    if (status != 0 || numTokens == 0)
    {
        return status;
    }
    if (post == nullptr || comb == nullptr)
    {
        return fail(cudaErrorInvalidValue, "engram_mhc_pre: post and comb must not be NULL");
    }
    CollapseLaunch const a{streams, fn, base, scale, numTokens, hcMult, hidden, sinkhornIters, hcEps, normEps, 0,
        static_cast<float*>(workspace), collapsed, post, comb, stream, nullptr, 0.0F};
    return launchCollapseFor(ioType, a);
}

extern "C" ENGRAM_API int engram_mhc_head(void const* streams, int32_t ioType, float const* fn, float const* base,
    float const* scale, int64_t numTokens, int32_t hcMult, int32_t hidden, float hcEps, float normEps, void* workspace,
    size_t workspaceBytes, void* collapsed, cudaStream_t stream)
{
    int status = engram_mhc_check_shape(hcMult, hidden, 1, hcEps, normEps);
    if (status != 0)
    {
        return status;
    }
    status = checkCollapseArgs("engram_mhc_head", streams, ioType, fn, base, scale, numTokens, hcMult, hidden,
        workspace, workspaceBytes, collapsed);
    if (status != 0 || numTokens == 0)
    {
        return status;
    }
    CollapseLaunch const a{streams, fn, base, scale, numTokens, hcMult, hidden, 1, hcEps, normEps, 1,
        static_cast<float*>(workspace), collapsed, nullptr, nullptr, stream, nullptr, 0.0F};
    return launchCollapseFor(ioType, a);
}

namespace
{

//! The fused norm's own arguments (engram_mhc_pre_norm / engram_mhc_head_norm).
int checkNormArgs(char const* name, float const* normWeight, float rmsEps)
{
    if (normWeight == nullptr || !isAligned(normWeight, 16))
    {
        return fail(
            cudaErrorInvalidValue, "%s: norm_weight must be a 16-byte aligned device pointer (fp32 [hidden])", name);
    }
    if (!std::isfinite(rmsEps) || rmsEps < 0.0F)
    {
        return fail(
            cudaErrorInvalidValue, "%s: rms_eps must be finite and >= 0 (got %g)", name, static_cast<double>(rmsEps));
    }
    return 0;
}

} // namespace

extern "C" ENGRAM_API int engram_mhc_pre_norm(void const* streams, int32_t ioType, float const* fn, float const* base,
    float const* scale, int64_t numTokens, int32_t hcMult, int32_t hidden, int32_t sinkhornIters, float hcEps,
    float normEps, float const* normWeight, float rmsEps, void* workspace, size_t workspaceBytes, void* normed,
    float* post, float* comb, cudaStream_t stream)
{
    int status = engram_mhc_check_shape(hcMult, hidden, sinkhornIters, hcEps, normEps);
    if (status != 0)
    {
        return status;
    }
    status = checkCollapseArgs("engram_mhc_pre_norm", streams, ioType, fn, base, scale, numTokens, hcMult, hidden,
        workspace, workspaceBytes, normed);
    if (status != 0 || numTokens == 0)
    {
        return status;
    }
    status = checkNormArgs("engram_mhc_pre_norm", normWeight, rmsEps);
    if (status != 0)
    {
        return status;
    }
    if (post == nullptr || comb == nullptr)
    {
        return fail(cudaErrorInvalidValue, "engram_mhc_pre_norm: post and comb must not be NULL");
    }
    CollapseLaunch const a{streams, fn, base, scale, numTokens, hcMult, hidden, sinkhornIters, hcEps, normEps, 0,
        static_cast<float*>(workspace), normed, post, comb, stream, normWeight, rmsEps};
    return launchCollapseFor(ioType, a);
}

extern "C" ENGRAM_API int engram_mhc_head_norm(void const* streams, int32_t ioType, float const* fn, float const* base,
    float const* scale, int64_t numTokens, int32_t hcMult, int32_t hidden, float hcEps, float normEps,
    float const* normWeight, float rmsEps, void* workspace, size_t workspaceBytes, void* normed, cudaStream_t stream)
{
    int status = engram_mhc_check_shape(hcMult, hidden, 1, hcEps, normEps);
    if (status != 0)
    {
        return status;
    }
    status = checkCollapseArgs("engram_mhc_head_norm", streams, ioType, fn, base, scale, numTokens, hcMult, hidden,
        workspace, workspaceBytes, normed);
    if (status != 0 || numTokens == 0)
    {
        return status;
    }
    status = checkNormArgs("engram_mhc_head_norm", normWeight, rmsEps);
    if (status != 0)
    {
        return status;
    }
    CollapseLaunch const a{streams, fn, base, scale, numTokens, hcMult, hidden, 1, hcEps, normEps, 1,
        static_cast<float*>(workspace), normed, nullptr, nullptr, stream, normWeight, rmsEps};
    return launchCollapseFor(ioType, a);
}

extern "C" ENGRAM_API int engram_mhc_post(void const* streams, void const* out, int32_t ioType, float const* post,
    float const* comb, int64_t numTokens, int32_t hcMult, int32_t hidden, void* newStreams, cudaStream_t stream)
{
    int status = engram_mhc_check_shape(hcMult, hidden, 1, 0.0F, 0.0F);
    if (status != 0)
    {
        return status;
    }
    status = checkIoType("engram_mhc_post", ioType);
    if (status != 0)
    {
        return status;
    }
    if (numTokens < 0 || numTokens * (hidden / 8) > INT32_MAX)
    {
        return fail(cudaErrorInvalidValue,
            "engram_mhc_post: num_tokens * hidden / 8 must be in [0, 2^31 - 1] (got %lld tokens)", ll(numTokens));
    }
    if (numTokens == 0)
    {
        return 0;
    }
    void const* aligned[] = {streams, out, newStreams};
    for (void const* p : aligned)
    {
        if (p == nullptr || !isAligned(p, 16))
        {
            return fail(cudaErrorInvalidValue,
                "engram_mhc_post: streams, out and new_streams must be 16-byte aligned device pointers");
        }
    }
    if (post == nullptr || comb == nullptr)
    {
        return fail(cudaErrorInvalidValue, "engram_mhc_post: post and comb must not be NULL");
    }
    int64_t const streamBytes = numTokens * hcMult * hidden * ioBytes(ioType);
    if ((newStreams != streams && overlaps(newStreams, streamBytes, streams, streamBytes))
        || overlaps(newStreams, streamBytes, out, numTokens * hidden * ioBytes(ioType)))
    {
        return fail(cudaErrorInvalidValue,
            "engram_mhc_post: new_streams must be streams itself or apart from it, and apart from out");
    }
    switch (ioType)
    {
    case ENGRAM_FLOAT_BF16:
        return launchPost<__nv_bfloat16>(streams, out, post, comb, numTokens, hcMult, hidden, newStreams, stream);
    case ENGRAM_FLOAT_F16:
        return launchPost<__half>(streams, out, post, comb, numTokens, hcMult, hidden, newStreams, stream);
    default: return launchPost<float>(streams, out, post, comb, numTokens, hcMult, hidden, newStreams, stream);
    }
}

extern "C" ENGRAM_API int engram_mhc_fold_workspace_size(
    int64_t numTokens, int32_t hcMult, int32_t hidden, size_t* bytes)
{
    int status = engram_mhc_check_shape(hcMult, hidden, 1, 0.0F, 0.0F);
    if (status != 0)
    {
        return status;
    }
    if (bytes == nullptr || numTokens < 0 || numTokens > INT32_MAX)
    {
        return fail(cudaErrorInvalidValue,
            "engram_mhc_fold_workspace_size: need bytes != NULL and num_tokens in [0, 2^31 - 1] (got %lld)",
            ll(numTokens));
    }
    *bytes = static_cast<size_t>(foldWorkspaceFloats(numTokens, hcMult, hidden)) * sizeof(float);
    return 0;
}

extern "C" ENGRAM_API int engram_mhc_fold(void const* streams, void const* out, int32_t ioType, float const* post,
    float const* comb, float const* fn, float const* base, float const* scale, int64_t numTokens, int32_t hcMult,
    int32_t hidden, int32_t sinkhornIters, float hcEps, float normEps, int32_t head, float const* normWeight,
    float rmsEps, void* workspace, size_t workspaceBytes, void* newStreams, void* collapsed, float* nextPost,
    float* nextComb, cudaStream_t stream)
{
    char const* const name = "engram_mhc_fold";
    int status = engram_mhc_check_shape(hcMult, hidden, head != 0 ? 1 : sinkhornIters, hcEps, normEps);
    if (status != 0)
    {
        return status;
    }
    status = checkIoType(name, ioType);
    if (status != 0)
    {
        return status;
    }
    if (head != 0 && head != 1)
    {
        return fail(cudaErrorInvalidValue, "%s: head must be 0 (a layer's collapse) or 1 (the hyper head) (got %d)",
            name, head);
    }
    if (numTokens < 0 || numTokens > INT32_MAX || numTokens * (hidden / 8) > INT32_MAX)
    {
        return fail(cudaErrorInvalidValue, "%s: num_tokens * hidden / 8 must be in [0, 2^31 - 1] (got %lld tokens)",
            name, ll(numTokens));
    }
    if (numTokens == 0)
    {
        return 0;
    }
    void const* aligned[] = {streams, out, newStreams, fn, collapsed};
    for (void const* p : aligned)
    {
        if (p == nullptr || !isAligned(p, 16))
        {
            return fail(cudaErrorInvalidValue,
                "%s: streams, out, new_streams, fn and collapsed must be 16-byte aligned device pointers", name);
        }
    }
    if (post == nullptr || comb == nullptr || base == nullptr || scale == nullptr)
    {
        return fail(cudaErrorInvalidValue, "%s: post, comb, base and scale must not be NULL", name);
    }
    if (head == 0 && (nextPost == nullptr || nextComb == nullptr))
    {
        return fail(cudaErrorInvalidValue, "%s: next_post and next_comb must not be NULL for a layer's collapse", name);
    }
    if (normWeight != nullptr)
    {
        status = checkNormArgs(name, normWeight, rmsEps);
        if (status != 0)
        {
            return status;
        }
    }
    if (workspace == nullptr || !isAligned(workspace, 4))
    {
        return fail(cudaErrorInvalidValue, "%s: workspace must be a 4-byte aligned device pointer", name);
    }
    size_t const need = static_cast<size_t>(foldWorkspaceFloats(numTokens, hcMult, hidden)) * sizeof(float);
    if (workspaceBytes < need)
    {
        return fail(cudaErrorInvalidValue, "%s: workspace holds %llu bytes, %llu needed for %lld tokens", name,
            static_cast<unsigned long long>(workspaceBytes), static_cast<unsigned long long>(need), ll(numTokens));
    }
    int64_t const streamBytes = numTokens * hcMult * hidden * ioBytes(ioType);
    int64_t const rowBytes = numTokens * hidden * ioBytes(ioType);
    int64_t const wsBytes = static_cast<int64_t>(workspaceBytes);
    if ((newStreams != streams && overlaps(newStreams, streamBytes, streams, streamBytes))
        || overlaps(newStreams, streamBytes, out, rowBytes))
    {
        return fail(
            cudaErrorInvalidValue, "%s: new_streams must be streams itself or apart from it, and apart from out", name);
    }
    if (overlaps(collapsed, rowBytes, streams, streamBytes) || overlaps(collapsed, rowBytes, newStreams, streamBytes)
        || overlaps(workspace, wsBytes, streams, streamBytes) || overlaps(workspace, wsBytes, newStreams, streamBytes)
        || overlaps(workspace, wsBytes, out, rowBytes) || overlaps(workspace, wsBytes, collapsed, rowBytes))
    {
        return fail(
            cudaErrorInvalidValue, "%s: collapsed and workspace must not overlap the streams, out or each other", name);
    }
    CollapseLaunch const next{newStreams, fn, base, scale, numTokens, hcMult, hidden, head != 0 ? 1 : sinkhornIters,
        hcEps, normEps, head, static_cast<float*>(workspace), collapsed, head != 0 ? nullptr : nextPost,
        head != 0 ? nullptr : nextComb, stream, normWeight, rmsEps};
    FoldLaunch const f{streams, out, post, comb, next};
    switch (ioType)
    {
    case ENGRAM_FLOAT_BF16: return launchFold<__nv_bfloat16>(f);
    case ENGRAM_FLOAT_F16: return launchFold<__half>(f);
    default: return launchFold<float>(f);
    }
}
