// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * Qwen4-Exp's gated full attention's core with the QSA block indexer over a packed step
 * (engram_qsa_attention; engram_trt.builder.reference_qsa is the float64 reference, tied
 * to models/qwen4_exp/attention.GatedAttention).
 *
 * Launches on one stream, so every kernel sees what the one before it wrote:
 *   1. write:  a block per token stores its k, v and raw indexer key at (slot, pos).
 *   Then per chunk of tokens (the workspace holds one chunk's scores and flags):
 *   2. score:  a warp per (token, complete block) for a token that sees more blocks than
 *              block_topk: the block's pooled key (fp32 mean of its raw keys, rounded to
 *              the I/O type; offset RMSNorm, rounded; partial rotate-half RoPE at the
 *              block's first position with the cos / sin and each product rounded as
 *              torch does it in the I/O type), then sum_h relu(index_q_h . key) / sqrt(di).
 *   3. select: a block per such token keeps the block_topk best blocks, rank by rank
 *              (a block's rank counts the better blocks and the equal ones of lower
 *              index, so ties go to the lower block index).
 *   4. attend: a block per (token, query head), 8 warps: the visible positions are the kept
 *              blocks (ascending) then the tail after the last complete block (or all of
 *              0..pos when nothing is dropped); a warp per position scores q . K * scaling
 *              in fp32 into shared memory, the softmax probabilities are rounded to the
 *              I/O type (as GatedAttention rounds them before V), and a thread per
 *              feature sums them against V in fp32, rounded once.
 * A query attends at most (block_topk + 1) * compress_ratio - 1 positions, whatever the
 * context, which is what keeps the shared memory bounded and decode cheap.
 */
#include "engramKernelsCore.h"
#include "engramKernelsInternal.h"
#include "qsaKernels.h"
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

constexpr int kWriteThreads = 128;
constexpr int kScoreWarps = 8;
constexpr int kSelectThreads = 256;
constexpr int kAttendWarps = 8;
constexpr int kDotBatch = 4; // positions a warp scores at once
constexpr int kPerLane = ENGRAM_QSA_MAX_HEAD_DIM / 32;
constexpr size_t kWorkspaceChunkBytes = size_t{64} << 20; // the most one chunk's scores may take
constexpr int kDefaultSharedBytes = 48 * 1024;

//! The token's (slot, pos), or false for a token outside the caches.
__device__ __forceinline__ bool tokenPlace(int32_t const* tokenSlot, int32_t const* tokenPos, int64_t t,
    int64_t numSlots, int64_t maxLen, int64_t& slot, int64_t& pos)
{
    slot = tokenSlot[t];
    pos = tokenPos[t];
    return slot >= 0 && slot < numSlots && pos >= 0 && pos < maxLen;
}

struct QsaShape
{
    int64_t numTokens;
    int32_t numHeads;
    int32_t numKvHeads;
    int32_t headDim;
    int32_t indexHeads;
    int32_t indexDim;
    int64_t numSlots;
    int64_t maxLen;
    int32_t ratio;
    int32_t topk;
    int32_t rotDim;
    float ropeTheta;
    float eps;
    float scaling;
    int64_t maxBlocks; // maxLen / ratio: the most complete blocks a query can see
};

//! 1. The cache writes: token t's k, v [kvh, hd] and raw indexer key [di].
template <typename T>
__global__ void __launch_bounds__(kWriteThreads) qsaWriteKernel(T const* __restrict__ k, T const* __restrict__ v,
    T const* __restrict__ indexRaw, int32_t const* __restrict__ tokenSlot, int32_t const* __restrict__ tokenPos,
    QsaShape s, T* __restrict__ keyCache, T* __restrict__ valueCache, T* __restrict__ indexCache)
{
    int64_t const t = blockIdx.x;
    int64_t slot = 0;
    int64_t pos = 0;
    if (!tokenPlace(tokenSlot, tokenPos, t, s.numSlots, s.maxLen, slot, pos))
    {
        return;
    }
    int64_t const kvWidth = static_cast<int64_t>(s.numKvHeads) * s.headDim;
    for (int64_t i = threadIdx.x; i < kvWidth; i += blockDim.x)
    {
        int64_t const h = i / s.headDim;
        int64_t const d = i % s.headDim;
        int64_t const at = ((slot * s.numKvHeads + h) * s.maxLen + pos) * s.headDim + d;
        keyCache[at] = k[t * kvWidth + i];
        valueCache[at] = v[t * kvWidth + i];
    }
    for (int64_t d = threadIdx.x; d < s.indexDim; d += blockDim.x)
    {
        indexCache[(slot * s.maxLen + pos) * s.indexDim + d] = indexRaw[t * s.indexDim + d];
    }
}

//! 2. A warp per (token t0 + blockIdx.x, block b): the block's score, into scores[row, b].
//! Shared memory: a row of di floats per warp (the normed key, for the RoPE partners).
template <typename T, typename W>
__global__ void __launch_bounds__(kScoreWarps * 32) qsaScoreKernel(T const* __restrict__ indexQ,
    T const* __restrict__ indexCache, W const* __restrict__ normWeight, int32_t const* __restrict__ tokenSlot,
    int32_t const* __restrict__ tokenPos, QsaShape s, int64_t t0, float* __restrict__ scores)
{
    extern __shared__ float keyRows[];
    int const warp = threadIdx.x / 32;
    int const lane = threadIdx.x % 32;
    int64_t const row = blockIdx.x;
    int64_t const t = t0 + row;
    int64_t const b = static_cast<int64_t>(blockIdx.y) * kScoreWarps + warp;
    int64_t slot = 0;
    int64_t pos = 0;
    if (!tokenPlace(tokenSlot, tokenPos, t, s.numSlots, s.maxLen, slot, pos))
    {
        return;
    }
    int64_t const nb = (pos + 1) / s.ratio;
    if (nb <= s.topk || b >= nb)
    {
        return;
    }
    int const di = s.indexDim;
    float* key = keyRows + warp * di;
    T const* raw = indexCache + (slot * s.maxLen + b * s.ratio) * di;
    float x[kPerLane];
    float squares = 0.0F;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j)
    {
        int const d = lane + 32 * j;
        x[j] = 0.0F;
        if (d < di)
        {
            float sum = 0.0F;
            for (int32_t i = 0; i < s.ratio; ++i)
            {
                sum += toFloat(raw[static_cast<int64_t>(i) * di + d]);
            }
            x[j] = roundTo<T>(sum / static_cast<float>(s.ratio)); // the mean, in the keys' type
            squares += x[j] * x[j];
        }
    }
    float const inv = rsqrtf(warpSum(squares) / static_cast<float>(di) + s.eps);
#pragma unroll
    for (int j = 0; j < kPerLane; ++j)
    {
        int const d = lane + 32 * j;
        if (d < di)
        {
            key[d] = roundTo<T>((x[j] * inv) * (1.0F + toFloat(normWeight[d])));
        }
    }
    __syncwarp();
    int const half = s.rotDim / 2;
    float const start = static_cast<float>(b * s.ratio);
    float dots[kPerLane];
#pragma unroll
    for (int j = 0; j < kPerLane; ++j)
    {
        int const d = lane + 32 * j;
        float value = 0.0F;
        if (d < di)
        {
            value = key[d];
            if (d < s.rotDim)
            {
                // rope_cos_sin's table: inv_freq = 1 / theta^(2i / rot) in fp32, each
                // frequency twice; apply_partial_rope casts cos / sin to the keys' type and
                // rounds both products and their sum there.
                int const i = d % half;
                float const invFreq
                    = 1.0F / powf(s.ropeTheta, static_cast<float>(2 * i) / static_cast<float>(s.rotDim));
                float const angle = start * invFreq;
                float const c = roundTo<T>(cosf(angle));
                float const sn = roundTo<T>(sinf(angle));
                float const turned = d < half ? -key[d + half] : key[d - half];
                value = roundTo<T>(roundTo<T>(value * c) + roundTo<T>(turned * sn));
            }
        }
        dots[j] = value;
    }
    float total = 0.0F;
    for (int32_t h = 0; h < s.indexHeads; ++h)
    {
        T const* q = indexQ + (t * s.indexHeads + h) * di;
        float dot = 0.0F;
#pragma unroll
        for (int j = 0; j < kPerLane; ++j)
        {
            int const d = lane + 32 * j;
            if (d < di)
            {
                dot += toFloat(q[d]) * dots[j];
            }
        }
        total += fmaxf(warpSum(dot), 0.0F);
    }
    if (lane == 0)
    {
        scores[row * s.maxBlocks + b] = total / sqrtf(static_cast<float>(di));
    }
}

//! 3. A block per token t0 + blockIdx.x that sees more than topk blocks: keep[row, b] = 1
//! for its topk best blocks (ties to the lower index), 0 for the others.
__global__ void __launch_bounds__(kSelectThreads)
    qsaSelectKernel(float const* __restrict__ scores, int32_t const* __restrict__ tokenSlot,
        int32_t const* __restrict__ tokenPos, QsaShape s, int64_t t0, uint8_t* __restrict__ keep)
{
    int64_t const row = blockIdx.x;
    int64_t slot = 0;
    int64_t pos = 0;
    if (!tokenPlace(tokenSlot, tokenPos, t0 + row, s.numSlots, s.maxLen, slot, pos))
    {
        return;
    }
    int64_t const nb = (pos + 1) / s.ratio;
    if (nb <= s.topk)
    {
        return;
    }
    float const* sc = scores + row * s.maxBlocks;
    for (int64_t b = threadIdx.x; b < nb; b += blockDim.x)
    {
        float mine = sc[b];
        mine = isnan(mine) ? -INFINITY : mine;
        int64_t rank = 0;
        for (int64_t o = 0; o < nb; ++o)
        {
            float other = __ldg(sc + o);
            other = isnan(other) ? -INFINITY : other;
            rank += (other > mine || (other == mine && o < b)) ? 1 : 0;
        }
        keep[row * s.maxBlocks + b] = rank < s.topk ? 1 : 0;
    }
}

//! 4. A block per (token t0 + blockIdx.x, query head blockIdx.y). Shared memory: the
//! query (hd floats), the kept blocks (topk ints), the scores of the visible positions.
template <typename T>
__global__ void __launch_bounds__(kAttendWarps * 32)
    qsaAttendKernel(T const* __restrict__ q, T const* __restrict__ keyCache, T const* __restrict__ valueCache,
        uint8_t const* __restrict__ keep, int32_t const* __restrict__ tokenSlot, int32_t const* __restrict__ tokenPos,
        QsaShape s, int64_t t0, T* __restrict__ out)
{
    extern __shared__ float shared[];
    __shared__ float reduce[kAttendWarps];
    int const warp = threadIdx.x / 32;
    int const lane = threadIdx.x % 32;
    int64_t const row = blockIdx.x;
    int64_t const t = t0 + row;
    int64_t const h = blockIdx.y;
    int const hd = s.headDim;
    T* o = out + (t * s.numHeads + h) * hd;
    int64_t slot = 0;
    int64_t pos = 0;
    if (!tokenPlace(tokenSlot, tokenPos, t, s.numSlots, s.maxLen, slot, pos))
    {
        for (int d = threadIdx.x; d < hd; d += blockDim.x)
        {
            o[d] = fromFloat<T>(0.0F); // a padding token
        }
        return;
    }
    float* qs = shared;
    auto* kept = reinterpret_cast<int32_t*>(qs + hd);
    float* sc = reinterpret_cast<float*>(kept + s.topk);
    for (int d = threadIdx.x; d < hd; d += blockDim.x)
    {
        qs[d] = toFloat(q[(t * s.numHeads + h) * hd + d]);
    }
    int64_t const nb = (pos + 1) / s.ratio;
    bool const sparse = nb > s.topk;
    int64_t const keptSpan = static_cast<int64_t>(s.topk) * s.ratio;
    int64_t const visible = sparse ? keptSpan + (pos + 1 - nb * s.ratio) : pos + 1;
    if (sparse && warp == 0)
    {
        // The kept blocks in ascending order: a ballot per 32 blocks.
        uint8_t const* flags = keep + row * s.maxBlocks;
        int32_t base = 0;
        for (int64_t b0 = 0; b0 < nb; b0 += 32)
        {
            int64_t const b = b0 + lane;
            bool const flag = b < nb && flags[b] != 0;
            unsigned const ballot = __ballot_sync(0xFFFFFFFFu, flag);
            if (flag)
            {
                kept[base + __popc(ballot & ((1u << lane) - 1u))] = static_cast<int32_t>(b);
            }
            base += __popc(ballot);
        }
    }
    __syncthreads();
    auto positionOf = [&](int64_t j) -> int64_t {
        if (!sparse)
        {
            return j;
        }
        return j < keptSpan ? static_cast<int64_t>(kept[j / s.ratio]) * s.ratio + j % s.ratio
                            : nb * s.ratio + (j - keptSpan);
    };
    int64_t const kvHead = h / (s.numHeads / s.numKvHeads);
    T const* keys = keyCache + (slot * s.numKvHeads + kvHead) * s.maxLen * hd;
    T const* values = valueCache + (slot * s.numKvHeads + kvHead) * s.maxLen * hd;
    // A warp scores kDotBatch positions at once (their loads in flight together).
    float localMax = -INFINITY;
    for (int64_t j0 = static_cast<int64_t>(warp) * kDotBatch; j0 < visible; j0 += kAttendWarps * kDotBatch)
    {
        T const* kr[kDotBatch];
        float dot[kDotBatch];
#pragma unroll
        for (int u = 0; u < kDotBatch; ++u)
        {
            int64_t const j = j0 + u < visible ? j0 + u : j0; // past the end: a repeat, not stored
            kr[u] = keys + positionOf(j) * hd;
            dot[u] = 0.0F;
        }
        for (int d = lane; d < hd; d += 32)
        {
            float const qd = qs[d];
#pragma unroll
            for (int u = 0; u < kDotBatch; ++u)
            {
                dot[u] += qd * toFloat(kr[u][d]);
            }
        }
#pragma unroll
        for (int u = 0; u < kDotBatch; ++u)
        {
            float const score = warpSum(dot[u]) * s.scaling;
            if (j0 + u < visible)
            {
                if (lane == 0)
                {
                    sc[j0 + u] = score;
                }
                localMax = fmaxf(localMax, score);
            }
        }
    }
    if (lane == 0)
    {
        reduce[warp] = localMax;
    }
    __syncthreads();
    float maxScore = reduce[0];
    for (int w = 1; w < kAttendWarps; ++w)
    {
        maxScore = fmaxf(maxScore, reduce[w]);
    }
    __syncthreads();
    float localSum = 0.0F;
    for (int64_t j = threadIdx.x; j < visible; j += blockDim.x)
    {
        float const e = expf(sc[j] - maxScore);
        sc[j] = e;
        localSum += e;
    }
    localSum = warpSum(localSum);
    if (lane == 0)
    {
        reduce[warp] = localSum;
    }
    __syncthreads();
    float total = 0.0F;
    for (int w = 0; w < kAttendWarps; ++w)
    {
        total += reduce[w];
    }
    for (int64_t j = threadIdx.x; j < visible; j += blockDim.x)
    {
        sc[j] = roundTo<T>(sc[j] / total); // the probabilities in the I/O type, as before V
    }
    __syncthreads();
    for (int d = threadIdx.x; d < hd; d += blockDim.x)
    {
        float acc = 0.0F;
#pragma unroll 4
        for (int64_t j = 0; j < visible; ++j)
        {
            acc += sc[j] * toFloat(values[positionOf(j) * hd + d]);
        }
        o[d] = fromFloat<T>(acc);
    }
}

bool isFloatType(int32_t type)
{
    return type == ENGRAM_FLOAT_BF16 || type == ENGRAM_FLOAT_F32 || type == ENGRAM_FLOAT_F16;
}

int64_t ioBytesOf(int32_t ioType)
{
    return ioType == ENGRAM_FLOAT_F32 ? 4 : 2;
}

//! Workspace bytes one token's scores and flags take (0: no query can drop a block).
int64_t bytesPerToken(int64_t maxLen, int32_t ratio, int32_t topk)
{
    int64_t const maxBlocks = maxLen / ratio;
    return maxBlocks > topk ? maxBlocks * 5 : 0;
}

//! The chunk of tokens the workspace is sized for: as many as fit kWorkspaceChunkBytes
//! (at least one), never more than the step's.
int64_t chunkTokens(int64_t maxTokens, int64_t perToken)
{
    if (perToken == 0)
    {
        return maxTokens;
    }
    int64_t const fit = static_cast<int64_t>(kWorkspaceChunkBytes) / perToken;
    return fit < 1 ? 1 : (fit < maxTokens ? fit : maxTokens);
}

size_t alignUp(size_t bytes)
{
    return (bytes + 255) & ~size_t{255};
}

size_t attendSharedBytes(QsaShape const& s)
{
    return static_cast<size_t>(s.headDim) * 4 + static_cast<size_t>(s.topk) * 4
        + static_cast<size_t>(s.topk + 1) * s.ratio * 4;
}

struct QsaLaunch
{
    void const* q;
    void const* k;
    void const* v;
    void const* indexQ;
    void const* indexRaw;
    void* keyCache;
    void* valueCache;
    void* indexCache;
    void const* normWeight;
    int32_t const* tokenSlot;
    int32_t const* tokenPos;
    void* workspace;
    size_t workspaceBytes;
    void* out;
    cudaStream_t stream;
};

template <typename T, typename W>
int launchQsa(QsaShape const& s, QsaLaunch const& a)
{
    resetLaunchError();
    qsaWriteKernel<T><<<static_cast<unsigned>(s.numTokens), kWriteThreads, 0, a.stream>>>(static_cast<T const*>(a.k),
        static_cast<T const*>(a.v), static_cast<T const*>(a.indexRaw), a.tokenSlot, a.tokenPos, s,
        static_cast<T*>(a.keyCache), static_cast<T*>(a.valueCache), static_cast<T*>(a.indexCache));
    int status = checkLaunch("engram_qsa_attention (cache write)");
    if (status != 0)
    {
        return status;
    }
    size_t const attendShared = attendSharedBytes(s);
    if (attendShared > static_cast<size_t>(kDefaultSharedBytes))
    {
        cudaError_t const err = cudaFuncSetAttribute(
            qsaAttendKernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(attendShared));
        if (err != cudaSuccess)
        {
            return failCuda(err, "engram_qsa_attention: %zu bytes of shared memory per block: %s", attendShared,
                cudaGetErrorString(err));
        }
    }
    int64_t const perToken = bytesPerToken(s.maxLen, s.ratio, s.topk);
    int64_t const chunk = perToken == 0
        ? s.numTokens
        : static_cast<int64_t>(a.workspaceBytes > 256 ? a.workspaceBytes - 256 : 0) / perToken;
    if (chunk < 1)
    {
        return fail(cudaErrorInvalidValue,
            "engram_qsa_attention: the workspace (%zu bytes) is smaller than one token's block scores (%lld); size it "
            "with engram_qsa_workspace_size",
            a.workspaceBytes, ll(perToken + 256));
    }
    auto* base = static_cast<unsigned char*>(a.workspace);
    auto* scores = reinterpret_cast<float*>(base);
    uint8_t* keep = perToken == 0 ? nullptr : base + alignUp(static_cast<size_t>(chunk) * s.maxBlocks * 4);
    for (int64_t t0 = 0; t0 < s.numTokens; t0 += chunk)
    {
        int64_t const n = s.numTokens - t0 < chunk ? s.numTokens - t0 : chunk;
        if (perToken > 0)
        {
            dim3 const grid(
                static_cast<unsigned>(n), static_cast<unsigned>((s.maxBlocks + kScoreWarps - 1) / kScoreWarps));
            resetLaunchError();
            qsaScoreKernel<T, W>
                <<<grid, kScoreWarps * 32, static_cast<size_t>(kScoreWarps) * s.indexDim * 4, a.stream>>>(
                    static_cast<T const*>(a.indexQ), static_cast<T const*>(a.indexCache),
                    static_cast<W const*>(a.normWeight), a.tokenSlot, a.tokenPos, s, t0, scores);
            status = checkLaunch("engram_qsa_attention (block scores)");
            if (status != 0)
            {
                return status;
            }
            resetLaunchError();
            qsaSelectKernel<<<static_cast<unsigned>(n), kSelectThreads, 0, a.stream>>>(
                scores, a.tokenSlot, a.tokenPos, s, t0, keep);
            status = checkLaunch("engram_qsa_attention (block selection)");
            if (status != 0)
            {
                return status;
            }
        }
        dim3 const grid(static_cast<unsigned>(n), static_cast<unsigned>(s.numHeads));
        resetLaunchError();
        qsaAttendKernel<T><<<grid, kAttendWarps * 32, attendShared, a.stream>>>(static_cast<T const*>(a.q),
            static_cast<T const*>(a.keyCache), static_cast<T const*>(a.valueCache), keep, a.tokenSlot, a.tokenPos, s,
            t0, static_cast<T*>(a.out));
        status = checkLaunch("engram_qsa_attention (attention)");
        if (status != 0)
        {
            return status;
        }
    }
    return 0;
}

template <typename T>
int launchQsaFor(int32_t weightType, QsaShape const& s, QsaLaunch const& a)
{
    return weightType == ENGRAM_FLOAT_F32 ? launchQsa<T, float>(s, a) : launchQsa<T, T>(s, a);
}

} // namespace

} // namespace kernels
} // namespace engram_trt

using namespace engram_trt::kernels;

extern "C" ENGRAM_API int engram_qsa_check_fields(
    int32_t compress_ratio, int32_t block_topk, int32_t rot_dim, float rope_theta, float eps, float scaling)
{
    clearError();
    if (compress_ratio < 1 || block_topk < 1
        || static_cast<int64_t>(block_topk + 1) * compress_ratio > ENGRAM_QSA_MAX_VISIBLE)
    {
        return fail(cudaErrorInvalidValue,
            "engram_qsa_attention: need compress_ratio >= 1, block_topk >= 1 and (block_topk + 1) * compress_ratio <= "
            "%d (got %d, %d)",
            ENGRAM_QSA_MAX_VISIBLE, compress_ratio, block_topk);
    }
    if (rot_dim < 0 || rot_dim % 2 != 0 || rot_dim > ENGRAM_QSA_MAX_HEAD_DIM)
    {
        return fail(cudaErrorInvalidValue, "engram_qsa_attention: rot_dim must be even and in [0, %d] (got %d)",
            ENGRAM_QSA_MAX_HEAD_DIM, rot_dim);
    }
    if (!(std::isfinite(rope_theta) && rope_theta > 0.0F))
    {
        return fail(cudaErrorInvalidValue, "engram_qsa_attention: rope_theta must be finite and > 0 (got %g)",
            static_cast<double>(rope_theta));
    }
    if (!(std::isfinite(eps) && eps >= 0.0F))
    {
        return fail(cudaErrorInvalidValue, "engram_qsa_attention: eps must be finite and >= 0 (got %g)",
            static_cast<double>(eps));
    }
    if (!(std::isfinite(scaling) && scaling > 0.0F))
    {
        return fail(cudaErrorInvalidValue, "engram_qsa_attention: scaling must be finite and > 0 (got %g)",
            static_cast<double>(scaling));
    }
    return 0;
}

extern "C" ENGRAM_API int engram_qsa_check_shape(
    int32_t num_heads, int32_t num_kv_heads, int32_t head_dim, int32_t index_heads, int32_t index_dim, int32_t rot_dim)
{
    clearError();
    if (num_kv_heads < 1 || num_heads < 1 || num_heads % num_kv_heads != 0 || num_heads > 65535)
    {
        return fail(cudaErrorInvalidValue,
            "engram_qsa_attention: need num_heads in [1, 65535], a multiple of num_kv_heads >= 1 (got %d, %d)",
            num_heads, num_kv_heads);
    }
    if (head_dim < 1 || head_dim > ENGRAM_QSA_MAX_HEAD_DIM || index_dim < 1 || index_dim > ENGRAM_QSA_MAX_HEAD_DIM)
    {
        return fail(cudaErrorInvalidValue,
            "engram_qsa_attention: head_dim and index_dim must be in [1, %d] (got %d, %d)", ENGRAM_QSA_MAX_HEAD_DIM,
            head_dim, index_dim);
    }
    if (index_heads < 1 || index_heads > ENGRAM_QSA_MAX_INDEX_HEADS)
    {
        return fail(cudaErrorInvalidValue, "engram_qsa_attention: index_heads must be in [1, %d] (got %d)",
            ENGRAM_QSA_MAX_INDEX_HEADS, index_heads);
    }
    if (rot_dim > head_dim || rot_dim > index_dim)
    {
        return fail(cudaErrorInvalidValue,
            "engram_qsa_attention: rot_dim %d exceeds head_dim %d or index_dim %d (the indexer rotates with the "
            "attention's table)",
            rot_dim, head_dim, index_dim);
    }
    return 0;
}

extern "C" ENGRAM_API int engram_qsa_workspace_size(
    int64_t max_tokens, int64_t max_seq_len, int32_t compress_ratio, int32_t block_topk, size_t* bytes)
{
    clearError();
    if (bytes == nullptr || max_tokens < 0 || max_seq_len < 0 || compress_ratio < 1 || block_topk < 1)
    {
        return fail(cudaErrorInvalidValue,
            "engram_qsa_workspace_size: need bytes, max_tokens >= 0, max_seq_len >= 0, compress_ratio and block_topk "
            ">= 1");
    }
    int64_t const perToken = bytesPerToken(max_seq_len, compress_ratio, block_topk);
    int64_t const chunk = chunkTokens(max_tokens, perToken);
    *bytes = perToken == 0 || chunk == 0 ? 0 : static_cast<size_t>(chunk * perToken) + 256;
    return 0;
}

extern "C" ENGRAM_API int engram_qsa_attention(void const* q, void const* k, void const* v, void const* index_q,
    void const* index_raw, int32_t io_type, void* key_cache, void* value_cache, void* index_key_cache,
    void const* index_k_norm_weight, int32_t weight_type, int32_t const* token_slot, int32_t const* token_pos,
    int64_t num_tokens, int32_t num_heads, int32_t num_kv_heads, int32_t head_dim, int32_t index_heads,
    int32_t index_dim, int64_t num_slots, int64_t max_seq_len, int32_t compress_ratio, int32_t block_topk,
    int32_t rot_dim, float rope_theta, float eps, float scaling, void* workspace, size_t workspace_bytes, void* out,
    cudaStream_t stream)
{
    int status = engram_qsa_check_fields(compress_ratio, block_topk, rot_dim, rope_theta, eps, scaling);
    if (status == 0)
    {
        status = engram_qsa_check_shape(num_heads, num_kv_heads, head_dim, index_heads, index_dim, rot_dim);
    }
    if (status != 0)
    {
        return status;
    }
    if (!isFloatType(io_type))
    {
        return fail(
            cudaErrorInvalidValue, "engram_qsa_attention: io_type %d is not bf16 (0), fp32 (1) or fp16 (2)", io_type);
    }
    if (weight_type != ENGRAM_FLOAT_F32 && weight_type != io_type)
    {
        return fail(cudaErrorInvalidValue,
            "engram_qsa_attention: weight_type %d is neither fp32 (1) nor the io_type %d", weight_type, io_type);
    }
    if (num_tokens < 0 || num_slots < 0 || max_seq_len < 0)
    {
        return fail(cudaErrorInvalidValue,
            "engram_qsa_attention: need num_tokens, num_slots and max_seq_len >= 0 (got %lld, %lld, %lld)",
            ll(num_tokens), ll(num_slots), ll(max_seq_len));
    }
    if (num_tokens == 0)
    {
        return 0;
    }
    if (num_tokens > INT32_MAX || max_seq_len / compress_ratio > static_cast<int64_t>(65535) * kScoreWarps)
    {
        return fail(cudaErrorInvalidValue, "engram_qsa_attention: grid too large (%lld tokens, %lld blocks per slot)",
            ll(num_tokens), ll(max_seq_len / compress_ratio));
    }
    if (q == nullptr || k == nullptr || v == nullptr || index_q == nullptr || index_raw == nullptr
        || index_k_norm_weight == nullptr || token_slot == nullptr || token_pos == nullptr || out == nullptr)
    {
        return fail(cudaErrorInvalidValue,
            "engram_qsa_attention: q, k, v, index_q, index_raw, index_k_norm_weight, token_slot, token_pos and out "
            "must not be NULL");
    }
    if (num_slots > 0 && max_seq_len > 0
        && (key_cache == nullptr || value_cache == nullptr || index_key_cache == nullptr))
    {
        return fail(
            cudaErrorInvalidValue, "engram_qsa_attention: the caches must not be NULL (num_slots %lld)", ll(num_slots));
    }
    int64_t const io = ioBytesOf(io_type);
    int64_t const outBytes = num_tokens * num_heads * head_dim * io;
    int64_t const kvCacheBytes = num_slots * num_kv_heads * max_seq_len * head_dim * io;
    int64_t const indexCacheBytes = num_slots * max_seq_len * index_dim * io;
    if (overlaps(out, outBytes, q, outBytes) || overlaps(out, outBytes, key_cache, kvCacheBytes)
        || overlaps(out, outBytes, value_cache, kvCacheBytes)
        || overlaps(out, outBytes, index_key_cache, indexCacheBytes))
    {
        return fail(cudaErrorInvalidValue, "engram_qsa_attention: out must not overlap q or the caches");
    }
    QsaShape s{};
    s.numTokens = num_tokens;
    s.numHeads = num_heads;
    s.numKvHeads = num_kv_heads;
    s.headDim = head_dim;
    s.indexHeads = index_heads;
    s.indexDim = index_dim;
    s.numSlots = key_cache == nullptr ? 0 : num_slots;
    s.maxLen = max_seq_len;
    s.ratio = compress_ratio;
    s.topk = block_topk;
    s.rotDim = rot_dim;
    s.ropeTheta = rope_theta;
    s.eps = eps;
    s.scaling = scaling;
    s.maxBlocks = max_seq_len / compress_ratio;
    QsaLaunch a{};
    a.q = q;
    a.k = k;
    a.v = v;
    a.indexQ = index_q;
    a.indexRaw = index_raw;
    a.keyCache = key_cache;
    a.valueCache = value_cache;
    a.indexCache = index_key_cache;
    a.normWeight = index_k_norm_weight;
    a.tokenSlot = token_slot;
    a.tokenPos = token_pos;
    a.workspace = workspace;
    a.workspaceBytes = workspace == nullptr ? 0 : workspace_bytes;
    a.out = out;
    a.stream = stream;
    switch (io_type)
    {
    case ENGRAM_FLOAT_BF16: return launchQsaFor<__nv_bfloat16>(weight_type, s, a);
    case ENGRAM_FLOAT_F16: return launchQsaFor<__half>(weight_type, s, a);
    default: return launchQsa<float, float>(s, a);
    }
}
