// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * DeepSeek-V4's attention core over a packed step (the EngramDsv4Attention plugin's math;
 * the float64 reference is engram_trt.builder.reference_dsv4_attention, tied to
 * models/deepseek_v4/attention.py). engramKernels.h states the contract; here, how:
 *
 *   1. compress   a block per (sequence, window completed this step), for the compressor
 *                 and, on CSA layers, the indexer (blockIdx.z): the softmax-pooled entry,
 *                 weighted RMSNorm, RoPE at the window's first position -> entries.
 *                 Reads the ring (positions < past) before step 2 overwrites it.
 *   2. ring       the last R raw rows of each sequence into its slot's ring.
 *   3. score      (CSA, only when some query sees more than index_topk entries) a block per
 *                 token: every visible entry's index score into the workspace.
 *   4. select     a block per such token: the index_topk best (radix select on the float
 *                 bits, ties to the lower index, kept in index order) into the workspace.
 *   5. attend     a block per (token, head), a warp per key stride: pass 1 the softmax's
 *                 max and denominator (with the sink), pass 2 the probabilities rounded to
 *                 the I/O type times the keys (K = V), fp32 sums, out rounded once.
 *                 Reads the window ring (positions < past) before step 6 overwrites it.
 *                 bf16 / fp16 with head_dim % 8 == 0 (ENGRAM_TRT_DSV4_ATTEND_VEC, on unless
 *                 "0"): 8 warps, each key a 16-byte vector a lane, each warp's loads of
 *                 kAttendBatch keys issued at once before their dot products (the scalar
 *                 form waited a memory round trip per key and pass: a 128-key window took
 *                 ~21 us a layer on the H100, one warp's 32 keys twice in series).
 *                 A programmatic dependent launch (dependentLaunch.cuh), as is step 6.
 *   6. window     the last W keys of each sequence into its slot's window ring.
 * A sequence whose slot is outside the state, whose past length is negative or which would
 * outgrow the entries writes nothing and gets zero rows.
 */
#include "dependentLaunch.cuh"
#include "dsv4AttentionKernels.h"
#include "engramKernelsCore.h"
#include "engramKernelsInternal.h"
#include "seqIndex.cuh"
#include "vecLoad.cuh"

#include <cub/block/block_scan.cuh>
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

constexpr int kAttendThreads = 128;
constexpr int kAttendWarps = kAttendThreads / 32;
constexpr int kMaxPerLane = ENGRAM_DSV4_MAX_HEAD_DIM / 32;
constexpr int kCompressThreads = 128;
constexpr int kScoreThreads = 256;
constexpr int kSelectThreads = 256;
constexpr size_t kAlign = 256;

size_t alignUp(size_t n)
{
    return (n + kAlign - 1) / kAlign * kAlign;
}

//! The step's view of sequence s: its tokens, past length and slot; valid = may run.
struct SeqView
{
    int64_t start;
    int64_t count;
    int64_t past;
    int64_t slot;
    bool valid;
};

__device__ __forceinline__ SeqView seqView(EngramDsv4Shape const& sh, EngramDsv4Tensors const& t, int64_t s)
{
    SeqView v;
    v.start = t.seq_starts[s];
    v.count = t.seq_starts[s + 1] - v.start;
    v.past = t.past_lens[s];
    v.slot = t.seq_slots[s];
    v.valid = v.count > 0 && v.past >= 0 && v.slot >= 0 && v.slot < sh.num_slots;
    if (v.valid && sh.layer_type != ENGRAM_DSV4_SLIDING)
    {
        v.valid = (v.past + v.count) / sh.compress_rate <= sh.max_entries;
    }
    return v;
}

//! One compressor (the main one or the indexer) as the compress / ring kernels see it.
struct PoolArgs
{
    void const* kv;
    void const* gate;
    float const* bias;
    float const* norm;
    void* entries;
    void* ringKv;
    void* ringGate;
    int32_t dim;
    int32_t width; // dim, or 2 * dim with overlap
    int32_t ring;  // r, or 2r with overlap
    bool overlap;
};

template <typename T>
__global__ void compressKernel(EngramDsv4Shape sh, EngramDsv4Tensors t, PoolArgs a0, PoolArgs a1)
{
    extern __shared__ float pooled[]; // [dim]
    __shared__ float partial[kCompressThreads / 32];
    PoolArgs const& a = blockIdx.z == 0 ? a0 : a1;
    SeqView const v = seqView(sh, t, blockIdx.y);
    int64_t const r = sh.compress_rate;
    int64_t const j = v.past / r + blockIdx.x;
    if (!v.valid || j >= (v.past + v.count) / r)
    {
        return;
    }
    T const* kvIn = static_cast<T const*>(a.kv);
    T const* gateIn = static_cast<T const*>(a.gate);
    T const* ringKv = static_cast<T const*>(a.ringKv) + v.slot * a.ring * a.width;
    T const* ringGate = static_cast<T const*>(a.ringGate) + v.slot * a.ring * a.width;
    int64_t const first = a.overlap ? (j - 1) * r : j * r;
    int64_t const rows = a.overlap ? 2 * r : r;
    float sq = 0.0F;
    for (int32_t c = threadIdx.x; c < a.dim; c += blockDim.x)
    {
        // The softmax over the window's rows, per channel: rows of the predecessor window
        // read the Ca channels [0, dim), this window's rows the Cb channels [dim, 2 dim).
        float m = -INFINITY;
        for (int64_t i = 0; i < rows; ++i)
        {
            int64_t const pos = first + i;
            if (pos < 0)
            {
                continue;
            }
            int64_t const ch = (a.overlap && i >= r) ? a.dim + c : c;
            float const g = toFloat(pos >= v.past ? gateIn[(v.start + pos - v.past) * a.width + ch]
                                                  : ringGate[(pos % a.ring) * a.width + ch])
                + a.bias[(pos % r) * a.width + ch];
            m = fmaxf(m, g);
        }
        float denom = 0.0F;
        for (int64_t i = 0; i < rows; ++i)
        {
            int64_t const pos = first + i;
            if (pos < 0)
            {
                continue;
            }
            int64_t const ch = (a.overlap && i >= r) ? a.dim + c : c;
            float const g = toFloat(pos >= v.past ? gateIn[(v.start + pos - v.past) * a.width + ch]
                                                  : ringGate[(pos % a.ring) * a.width + ch])
                + a.bias[(pos % r) * a.width + ch];
            denom += expf(g - m);
        }
        float sum = 0.0F;
        for (int64_t i = 0; i < rows; ++i)
        {
            int64_t const pos = first + i;
            if (pos < 0)
            {
                continue;
            }
            int64_t const ch = (a.overlap && i >= r) ? a.dim + c : c;
            bool const fresh = pos >= v.past;
            int64_t const inRow = (v.start + pos - v.past) * a.width + ch;
            int64_t const ringRow = (pos % a.ring) * a.width + ch;
            float const g = toFloat(fresh ? gateIn[inRow] : ringGate[ringRow]) + a.bias[(pos % r) * a.width + ch];
            float const w = roundTo<T>(expf(g - m) / denom);
            sum += roundTo<T>(w * toFloat(fresh ? kvIn[inRow] : ringKv[ringRow]));
        }
        float const p = roundTo<T>(sum);
        pooled[c] = p;
        sq += p * p;
    }
    for (int off = 16; off > 0; off >>= 1)
    {
        sq += __shfl_xor_sync(0xffffffffU, sq, off);
    }
    if ((threadIdx.x & 31) == 0)
    {
        partial[threadIdx.x / 32] = sq;
    }
    __syncthreads();
    float total = 0.0F;
    for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w)
    {
        total += partial[w];
    }
    float const inv = rsqrtf(total / static_cast<float>(a.dim) + sh.eps);
    for (int32_t c = threadIdx.x; c < a.dim; c += blockDim.x)
    {
        pooled[c] = roundTo<T>(a.norm[c] * (pooled[c] * inv));
    }
    __syncthreads();
    T* out = static_cast<T*>(a.entries) + (v.slot * sh.max_entries + j) * a.dim;
    int32_t const ropeStart = a.dim - 2 * sh.rope_pairs;
    float const angle0 = static_cast<float>(j * r);
    for (int32_t c = threadIdx.x; c < a.dim; c += blockDim.x)
    {
        float value = pooled[c];
        if (c >= ropeStart)
        {
            int32_t const pair = (c - ropeStart) / 2;
            float const ang = angle0 * t.inv_freq[pair];
            float const co = roundTo<T>(cosf(ang) * sh.rope_scale);
            float const si = roundTo<T>(sinf(ang) * sh.rope_scale);
            bool const even = ((c - ropeStart) & 1) == 0;
            float const e = pooled[even ? c : c - 1];
            float const o = pooled[even ? c + 1 : c];
            value = even ? e * co - o * si : o * co + e * si;
        }
        out[c] = fromFloat<T>(value);
    }
}

//! The last R raw rows of each sequence into the ring (after compressKernel read it).
template <typename T>
__global__ void ringKernel(EngramDsv4Shape sh, EngramDsv4Tensors t, PoolArgs a0, PoolArgs a1)
{
    PoolArgs const& a = blockIdx.z == 0 ? a0 : a1;
    SeqView const v = seqView(sh, t, blockIdx.y);
    int64_t const keep = v.count < a.ring ? v.count : a.ring;
    if (!v.valid || blockIdx.x >= keep)
    {
        return;
    }
    int64_t const pos = v.past + v.count - keep + blockIdx.x;
    int64_t const src = (v.start + pos - v.past) * a.width;
    int64_t const dst = (v.slot * a.ring + pos % a.ring) * a.width;
    for (int32_t c = threadIdx.x; c < a.width; c += blockDim.x)
    {
        static_cast<T*>(a.ringKv)[dst + c] = static_cast<T const*>(a.kv)[src + c];
        static_cast<T*>(a.ringGate)[dst + c] = static_cast<T const*>(a.gate)[src + c];
    }
}

struct TokenView
{
    int64_t seq;
    int64_t pos;
    int64_t slot;
    int64_t past;
    int64_t start;
    bool valid;
};

__device__ __forceinline__ TokenView tokenView(EngramDsv4Shape const& sh, EngramDsv4Tensors const& t, int64_t tok)
{
    TokenView tv{};
    tv.seq = sequenceOf(t.seq_starts, sh.num_seqs, tok);
    tv.valid = tv.seq >= 0;
    if (tv.valid)
    {
        SeqView const v = seqView(sh, t, tv.seq);
        tv.valid = v.valid;
        tv.pos = v.past + tok - v.start;
        tv.slot = v.slot;
        tv.past = v.past;
        tv.start = v.start;
    }
    return tv;
}

//! Index scores of token blockIdx.x's visible entries (only for tokens that drop some).
template <typename T>
__global__ void scoreKernel(EngramDsv4Shape sh, EngramDsv4Tensors t, float* scores)
{
    extern __shared__ float sq[]; // [index_heads * index_dim] then [index_heads]
    int64_t const tok = blockIdx.x;
    TokenView const tv = tokenView(sh, t, tok);
    int64_t const visible = tv.valid ? (tv.pos + 1) / sh.compress_rate : 0;
    if (visible <= sh.index_topk)
    {
        return;
    }
    int32_t const nh = sh.index_heads;
    int32_t const di = sh.index_dim;
    T const* q = static_cast<T const*>(t.index_q) + tok * nh * di;
    for (int32_t i = threadIdx.x; i < nh * di; i += blockDim.x)
    {
        sq[i] = toFloat(q[i]);
    }
    for (int32_t i = threadIdx.x; i < nh; i += blockDim.x)
    {
        sq[nh * di + i] = t.index_w[tok * nh + i];
    }
    __syncthreads();
    T const* keys = static_cast<T const*>(t.index_keys) + tv.slot * sh.max_entries * di;
    int const lane = threadIdx.x & 31;
    float const dimScale = rsqrtf(static_cast<float>(di));
    for (int64_t e = threadIdx.x / 32; e < visible; e += blockDim.x / 32)
    {
        T const* k = keys + e * di;
        float score = 0.0F;
        for (int32_t h = 0; h < nh; ++h)
        {
            float dot = 0.0F;
            for (int32_t c = lane; c < di; c += 32)
            {
                dot += sq[h * di + c] * toFloat(k[c]);
            }
            for (int off = 16; off > 0; off >>= 1)
            {
                dot += __shfl_xor_sync(0xffffffffU, dot, off);
            }
            score += fmaxf(dot, 0.0F) * dimScale * sq[nh * di + h];
        }
        if (lane == 0)
        {
            scores[tok * sh.max_entries + e] = score;
        }
    }
}

//! Float bits in an unsigned order that follows the float order (-0 below +0).
__device__ __forceinline__ uint32_t orderedBits(float f)
{
    uint32_t const b = __float_as_uint(f);
    return (b & 0x80000000U) ? ~b : (b | 0x80000000U);
}

//! The index_topk best entries of each token that drops some, in index order.
__global__ void selectKernel(EngramDsv4Shape sh, EngramDsv4Tensors t, float const* scores, int32_t* picks)
{
    using Scan = cub::BlockScan<int32_t, kSelectThreads>;
    __shared__ typename Scan::TempStorage scanStorage;
    __shared__ uint32_t hist[256];
    __shared__ uint32_t prefix;
    __shared__ int64_t remaining;
    __shared__ int32_t base[2];
    int64_t const tok = blockIdx.x;
    TokenView const tv = tokenView(sh, t, tok);
    int64_t const visible = tv.valid ? (tv.pos + 1) / sh.compress_rate : 0;
    int64_t const k = sh.index_topk;
    if (visible <= k)
    {
        return;
    }
    float const* row = scores + tok * sh.max_entries;
    if (threadIdx.x == 0)
    {
        prefix = 0;
        remaining = k;
    }
    // Radix select: the k-th largest ordered key, 8 bits at a time from the top.
    for (int shift = 24; shift >= 0; shift -= 8)
    {
        for (int i = threadIdx.x; i < 256; i += blockDim.x)
        {
            hist[i] = 0;
        }
        __syncthreads();
        uint32_t const mask = shift == 24 ? 0U : (0xFFFFFFFFU << (shift + 8));
        for (int64_t e = threadIdx.x; e < visible; e += blockDim.x)
        {
            uint32_t const u = orderedBits(row[e]);
            if ((u & mask) == (prefix & mask))
            {
                atomicAdd(&hist[(u >> shift) & 0xFFU], 1U);
            }
        }
        __syncthreads();
        if (threadIdx.x == 0)
        {
            int64_t need = remaining;
            int digit = 255;
            for (; digit > 0; --digit)
            {
                if (static_cast<int64_t>(hist[digit]) >= need)
                {
                    break;
                }
                need -= hist[digit];
            }
            prefix |= static_cast<uint32_t>(digit) << shift;
            remaining = need; // how many of the keys equal to the prefix so far are still wanted
        }
        __syncthreads();
    }
    uint32_t const threshold = prefix;
    int64_t const wantEqual = remaining;
    if (threadIdx.x == 0)
    {
        base[0] = 0; // picks written so far
        base[1] = 0; // equal keys met so far
    }
    __syncthreads();
    int32_t* out = picks + tok * k;
    for (int64_t chunk = 0; chunk < visible; chunk += blockDim.x)
    {
        int64_t const e = chunk + threadIdx.x;
        uint32_t const u = e < visible ? orderedBits(row[e]) : 0U;
        int32_t const eq = (e < visible && u == threshold) ? 1 : 0;
        int32_t eqRank = 0;
        int32_t eqTotal = 0;
        Scan(scanStorage).ExclusiveSum(eq, eqRank, eqTotal);
        __syncthreads();
        bool const take = e < visible && (u > threshold || (eq && base[1] + eqRank < wantEqual));
        int32_t slot = 0;
        int32_t taken = 0;
        Scan(scanStorage).ExclusiveSum(take ? 1 : 0, slot, taken);
        if (take)
        {
            out[base[0] + slot] = static_cast<int32_t>(e);
        }
        __syncthreads();
        if (threadIdx.x == 0)
        {
            base[0] += taken;
            base[1] += eqTotal;
        }
        __syncthreads();
    }
}

//! Key i of a query: the window (positions lo..p) first, then its compressed entries.
template <typename T>
struct KeySource
{
    T const* window;  // the slot's window ring
    T const* fresh;   // kv of this step
    T const* entries; // the slot's entries
    int32_t const* picks;
    int64_t lo;
    int64_t past;
    int64_t start;
    int64_t nWindow;
    int64_t window_len;
    int32_t d;

    __device__ __forceinline__ T const* key(int64_t i) const
    {
        if (i < nWindow)
        {
            int64_t const pos = lo + i;
            return pos < past ? window + (pos % window_len) * d : fresh + (start + pos - past) * d;
        }
        int64_t const e = picks != nullptr ? picks[i - nWindow] : i - nWindow;
        return entries + e * d;
    }
};

template <typename T>
__global__ void __launch_bounds__(kAttendThreads)
    attendKernel(EngramDsv4Shape sh, EngramDsv4Tensors t, int32_t const* picks)
{
    __shared__ float qs[ENGRAM_DSV4_MAX_HEAD_DIM];
    __shared__ float warpMax[kAttendWarps];
    __shared__ float warpSum[kAttendWarps];
    __shared__ float acc[kAttendWarps][ENGRAM_DSV4_MAX_HEAD_DIM];
    int64_t const tok = blockIdx.x;
    int32_t const h = blockIdx.y;
    int32_t const d = sh.head_dim;
    T* out = static_cast<T*>(t.out) + (tok * sh.num_heads + h) * d;
    TokenView const tv = tokenView(sh, t, tok);
    if (!tv.valid)
    {
        for (int32_t c = threadIdx.x; c < d; c += blockDim.x)
        {
            out[c] = fromFloat<T>(0.0F);
        }
        return;
    }
    T const* q = static_cast<T const*>(t.q) + (tok * sh.num_heads + h) * d;
    for (int32_t c = threadIdx.x; c < d; c += blockDim.x)
    {
        qs[c] = toFloat(q[c]);
    }
    __syncthreads();
    KeySource<T> src;
    src.window = static_cast<T const*>(t.window_kv) + tv.slot * sh.window * d;
    src.fresh = static_cast<T const*>(t.kv);
    src.entries = static_cast<T const*>(t.entries) + tv.slot * sh.max_entries * d;
    src.lo = tv.pos - sh.window + 1 > 0 ? tv.pos - sh.window + 1 : 0;
    src.past = tv.past;
    src.start = tv.start;
    src.nWindow = tv.pos - src.lo + 1;
    src.window_len = sh.window;
    src.d = d;
    src.picks = nullptr;
    int64_t nEntries = 0;
    if (sh.layer_type != ENGRAM_DSV4_SLIDING)
    {
        nEntries = (tv.pos + 1) / sh.compress_rate;
        if (sh.layer_type == ENGRAM_DSV4_CSA && nEntries > sh.index_topk)
        {
            src.picks = picks + tok * sh.index_topk;
            nEntries = sh.index_topk;
        }
    }
    int64_t const total = src.nWindow + nEntries;
    int const lane = threadIdx.x & 31;
    int const warp = threadIdx.x / 32;
    // pass 1: the max and the denominator (online, per warp)
    float m = -INFINITY;
    float l = 0.0F;
    for (int64_t i = warp; i < total; i += kAttendWarps)
    {
        T const* k = src.key(i);
        float dot = 0.0F;
        for (int32_t c = lane; c < d; c += 32)
        {
            dot += qs[c] * toFloat(k[c]);
        }
        for (int off = 16; off > 0; off >>= 1)
        {
            dot += __shfl_xor_sync(0xffffffffU, dot, off);
        }
        float const s = dot * sh.scaling;
        float const mNew = fmaxf(m, s);
        l = l * expf(m - mNew) + expf(s - mNew);
        m = mNew;
    }
    if (lane == 0)
    {
        warpMax[warp] = m;
        warpSum[warp] = l;
    }
    __syncthreads();
    float const sink = t.sinks[h];
    float top = sink;
    for (int w = 0; w < kAttendWarps; ++w)
    {
        top = fmaxf(top, warpMax[w]);
    }
    float denom = expf(sink - top);
    for (int w = 0; w < kAttendWarps; ++w)
    {
        denom += warpMax[w] == -INFINITY ? 0.0F : warpSum[w] * expf(warpMax[w] - top);
    }
    // pass 2: probabilities rounded to the I/O type, times the keys
    float part[kMaxPerLane];
#pragma unroll
    for (int k = 0; k < kMaxPerLane; ++k)
    {
        part[k] = 0.0F;
    }
    for (int64_t i = warp; i < total; i += kAttendWarps)
    {
        T const* k = src.key(i);
        float dot = 0.0F;
        for (int32_t c = lane; c < d; c += 32)
        {
            dot += qs[c] * toFloat(k[c]);
        }
        for (int off = 16; off > 0; off >>= 1)
        {
            dot += __shfl_xor_sync(0xffffffffU, dot, off);
        }
        float const p = roundTo<T>(expf(dot * sh.scaling - top) / denom);
#pragma unroll
        for (int j = 0; j < kMaxPerLane; ++j)
        {
            int32_t const c = lane + 32 * j;
            if (c < d)
            {
                part[j] += p * toFloat(k[c]);
            }
        }
    }
#pragma unroll
    for (int j = 0; j < kMaxPerLane; ++j)
    {
        int32_t const c = lane + 32 * j;
        if (c < d)
        {
            acc[warp][c] = part[j];
        }
    }
    __syncthreads();
    for (int32_t c = threadIdx.x; c < d; c += blockDim.x)
    {
        float sum = 0.0F;
        for (int w = 0; w < kAttendWarps; ++w)
        {
            sum += acc[w][c];
        }
        out[c] = fromFloat<T>(sum);
    }
}

constexpr int kAttendVecWarps = 8;
constexpr int kAttendVecThreads = kAttendVecWarps * 32;
constexpr int kAttendBatch = 8; // keys a warp loads at once

template <typename T>
struct PairType;
template <>
struct PairType<__nv_bfloat16>
{
    using type = __nv_bfloat162;
};
template <>
struct PairType<__half>
{
    using type = __half2;
};

//! Raw 16-byte vectors of the batch's keys first + b * kAttendVecWarps (b < kAttendBatch),
//! the lane's vectors lane + 32 j (j < NV); keys past the last read the last (masked later).
template <typename T, int NV>
__device__ __forceinline__ void loadKeyBatch(
    KeySource<T> const& src, int64_t first, int64_t total, int32_t vectors, int lane, uint4 (&raw)[kAttendBatch][NV])
{
#pragma unroll
    for (int b = 0; b < kAttendBatch; ++b)
    {
        int64_t const i = first + b * kAttendVecWarps;
        T const* const k = src.key(i < total ? i : total - 1);
#pragma unroll
        for (int j = 0; j < NV; ++j)
        {
            int32_t const v = lane + 32 * j;
            raw[b][j] = v < vectors ? *reinterpret_cast<uint4 const*>(k + 8 * v) : make_uint4(0, 0, 0, 0);
        }
    }
}

//! The batch's dot products with q (the lane's channels, then a warp butterfly per key).
template <typename T, int NV>
__device__ __forceinline__ void batchDots(
    uint4 const (&raw)[kAttendBatch][NV], float const (&q)[NV][8], float (&dot)[kAttendBatch])
{
#pragma unroll
    for (int b = 0; b < kAttendBatch; ++b)
    {
        float acc = 0.0F;
#pragma unroll
        for (int j = 0; j < NV; ++j)
        {
            float k[8];
            unpack8Pairs<typename PairType<T>::type>(raw[b][j], k);
#pragma unroll
            for (int e = 0; e < 8; ++e)
            {
                acc += q[j][e] * k[e];
            }
        }
        dot[b] = acc;
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1)
    {
#pragma unroll
        for (int b = 0; b < kAttendBatch; ++b)
        {
            dot[b] += __shfl_xor_sync(0xffffffffU, dot[b], off);
        }
    }
}

//! attendKernel's math for bf16 / fp16 and head_dim % 8 == 0 (file comment, step 5): NV
//! 16-byte vectors of a key a lane (head_dim <= 256 * NV).
template <typename T, int NV>
__global__ void __launch_bounds__(kAttendVecThreads)
    attendVecKernel(EngramDsv4Shape sh, EngramDsv4Tensors t, int32_t const* picks)
{
    __shared__ float warpMax[kAttendVecWarps];
    __shared__ float warpSum[kAttendVecWarps];
    __shared__ float acc[kAttendVecWarps][ENGRAM_DSV4_MAX_HEAD_DIM];
    waitForPrimary(); // q and kv come from the kernels before (dependentLaunch.cuh)
    allowDependents();
    int64_t const tok = blockIdx.x;
    int32_t const h = blockIdx.y;
    int32_t const d = sh.head_dim;
    int32_t const vectors = d / 8;
    T* out = static_cast<T*>(t.out) + (tok * sh.num_heads + h) * d;
    TokenView const tv = tokenView(sh, t, tok);
    if (!tv.valid)
    {
        for (int32_t c = threadIdx.x; c < d; c += blockDim.x)
        {
            out[c] = fromFloat<T>(0.0F);
        }
        return;
    }
    int const lane = threadIdx.x & 31;
    int const warp = threadIdx.x / 32;
    T const* q = static_cast<T const*>(t.q) + (tok * sh.num_heads + h) * d;
    float qv[NV][8];
#pragma unroll
    for (int j = 0; j < NV; ++j)
    {
        int32_t const v = lane + 32 * j;
        if (v < vectors)
        {
            load8(q + 8 * v, qv[j]);
        }
        else
        {
#pragma unroll
            for (int e = 0; e < 8; ++e)
            {
                qv[j][e] = 0.0F;
            }
        }
    }
    KeySource<T> src;
    src.window = static_cast<T const*>(t.window_kv) + tv.slot * sh.window * d;
    src.fresh = static_cast<T const*>(t.kv);
    src.entries = static_cast<T const*>(t.entries) + tv.slot * sh.max_entries * d;
    src.lo = tv.pos - sh.window + 1 > 0 ? tv.pos - sh.window + 1 : 0;
    src.past = tv.past;
    src.start = tv.start;
    src.nWindow = tv.pos - src.lo + 1;
    src.window_len = sh.window;
    src.d = d;
    src.picks = nullptr;
    int64_t nEntries = 0;
    if (sh.layer_type != ENGRAM_DSV4_SLIDING)
    {
        nEntries = (tv.pos + 1) / sh.compress_rate;
        if (sh.layer_type == ENGRAM_DSV4_CSA && nEntries > sh.index_topk)
        {
            src.picks = picks + tok * sh.index_topk;
            nEntries = sh.index_topk;
        }
    }
    int64_t const total = src.nWindow + nEntries;
    constexpr int64_t kStride = static_cast<int64_t>(kAttendVecWarps) * kAttendBatch;
    // pass 1: the max and the denominator (online, per warp, keys in the scalar form's order)
    float m = -INFINITY;
    float l = 0.0F;
    for (int64_t first = warp; first < total; first += kStride)
    {
        uint4 raw[kAttendBatch][NV];
        loadKeyBatch<T, NV>(src, first, total, vectors, lane, raw);
        float dot[kAttendBatch];
        batchDots<T, NV>(raw, qv, dot);
#pragma unroll
        for (int b = 0; b < kAttendBatch; ++b)
        {
            if (first + b * kAttendVecWarps < total)
            {
                float const s = dot[b] * sh.scaling;
                float const mNew = fmaxf(m, s);
                l = l * expf(m - mNew) + expf(s - mNew);
                m = mNew;
            }
        }
    }
    if (lane == 0)
    {
        warpMax[warp] = m;
        warpSum[warp] = l;
    }
    __syncthreads();
    float const sink = t.sinks[h];
    float top = sink;
    for (int w = 0; w < kAttendVecWarps; ++w)
    {
        top = fmaxf(top, warpMax[w]);
    }
    float denom = expf(sink - top);
    for (int w = 0; w < kAttendVecWarps; ++w)
    {
        denom += warpMax[w] == -INFINITY ? 0.0F : warpSum[w] * expf(warpMax[w] - top);
    }
    // pass 2: probabilities rounded to the I/O type, times the keys
    float part[NV][8];
#pragma unroll
    for (int j = 0; j < NV; ++j)
    {
#pragma unroll
        for (int e = 0; e < 8; ++e)
        {
            part[j][e] = 0.0F;
        }
    }
    for (int64_t first = warp; first < total; first += kStride)
    {
        uint4 raw[kAttendBatch][NV];
        loadKeyBatch<T, NV>(src, first, total, vectors, lane, raw);
        float dot[kAttendBatch];
        batchDots<T, NV>(raw, qv, dot);
#pragma unroll
        for (int b = 0; b < kAttendBatch; ++b)
        {
            if (first + b * kAttendVecWarps < total)
            {
                float const p = roundTo<T>(expf(dot[b] * sh.scaling - top) / denom);
#pragma unroll
                for (int j = 0; j < NV; ++j)
                {
                    float k[8];
                    unpack8Pairs<typename PairType<T>::type>(raw[b][j], k);
#pragma unroll
                    for (int e = 0; e < 8; ++e)
                    {
                        part[j][e] += p * k[e];
                    }
                }
            }
        }
    }
#pragma unroll
    for (int j = 0; j < NV; ++j)
    {
        int32_t const v = lane + 32 * j;
        if (v < vectors)
        {
#pragma unroll
            for (int e = 0; e < 8; ++e)
            {
                acc[warp][8 * v + e] = part[j][e];
            }
        }
    }
    __syncthreads();
    for (int32_t c = threadIdx.x; c < d; c += blockDim.x)
    {
        float sum = 0.0F;
        for (int w = 0; w < kAttendVecWarps; ++w)
        {
            sum += acc[w][c];
        }
        out[c] = fromFloat<T>(sum);
    }
}

//! Whether attendVecKernel takes the step (file comment, step 5).
template <typename T>
bool attendVecServes(EngramDsv4Shape const& sh, EngramDsv4Tensors const& t)
{
    if (sizeof(T) != 2 || sh.head_dim % 8 != 0 || !envSwitch("ENGRAM_TRT_DSV4_ATTEND_VEC", true))
    {
        return false;
    }
    void const* used[] = {t.q, t.kv, t.window_kv, t.out, sh.layer_type != ENGRAM_DSV4_SLIDING ? t.entries : t.q};
    for (void const* p : used)
    {
        if (!isAligned(p, 16))
        {
            return false;
        }
    }
    return true;
}

template <typename T>
void launchAttend(EngramDsv4Shape const& sh, EngramDsv4Tensors const& t, int32_t const* picks, cudaStream_t stream)
{
    dim3 const grid(static_cast<unsigned>(sh.num_tokens), static_cast<unsigned>(sh.num_heads));
    if constexpr (sizeof(T) == 2)
    {
        if (attendVecServes<T>(sh, t))
        {
            if (sh.head_dim <= 256)
            {
                launchDependent(attendVecKernel<T, 1>, grid, dim3(kAttendVecThreads), 0, stream, sh, t, picks);
            }
            else
            {
                launchDependent(attendVecKernel<T, 2>, grid, dim3(kAttendVecThreads), 0, stream, sh, t, picks);
            }
            return;
        }
    }
    attendKernel<T><<<grid, kAttendThreads, 0, stream>>>(sh, t, picks);
}

//! The last W keys of each sequence into its window ring (after attendKernel read it).
template <typename T>
__global__ void windowKernel(EngramDsv4Shape sh, EngramDsv4Tensors t)
{
    waitForPrimary(); // the attend kernel reads the ring first (dependentLaunch.cuh)
    allowDependents();
    SeqView const v = seqView(sh, t, blockIdx.y);
    int64_t const keep = v.count < sh.window ? v.count : sh.window;
    if (!v.valid || blockIdx.x >= keep)
    {
        return;
    }
    int64_t const pos = v.past + v.count - keep + blockIdx.x;
    T const* src = static_cast<T const*>(t.kv) + (v.start + pos - v.past) * sh.head_dim;
    T* dst = static_cast<T*>(t.window_kv) + (v.slot * sh.window + pos % sh.window) * sh.head_dim;
    for (int32_t c = threadIdx.x; c < sh.head_dim; c += blockDim.x)
    {
        dst[c] = src[c];
    }
}

struct Layout
{
    size_t scoresOffset;
    size_t picksOffset;
    size_t bytes;
};

//! The workspace: scores [T, E] fp32 then picks [T, index_topk] int32 (CSA layers that can drop).
Layout layoutOf(EngramDsv4Shape const& sh)
{
    Layout l{0, 0, 0};
    if (sh.layer_type != ENGRAM_DSV4_CSA || sh.max_entries <= sh.index_topk || sh.num_tokens == 0)
    {
        return l;
    }
    l.picksOffset = alignUp(static_cast<size_t>(sh.num_tokens) * static_cast<size_t>(sh.max_entries) * sizeof(float));
    l.bytes = l.picksOffset + alignUp(static_cast<size_t>(sh.num_tokens) * sh.index_topk * sizeof(int32_t));
    return l;
}

int64_t ioBytes(int32_t ioType)
{
    return ioType == ENGRAM_FLOAT_F32 ? 4 : 2;
}

template <typename T>
int launchAll(EngramDsv4Shape const& sh, EngramDsv4Tensors const& t, void* workspace, cudaStream_t stream)
{
    if (sh.num_tokens == 0 || sh.num_seqs == 0)
    {
        return 0;
    }
    dim3 const seqGrid(1, static_cast<unsigned>(sh.num_seqs), 1);
    if (sh.layer_type != ENGRAM_DSV4_SLIDING)
    {
        bool const csa = sh.layer_type == ENGRAM_DSV4_CSA;
        int32_t const r = sh.compress_rate;
        PoolArgs c{t.comp_kv, t.comp_gate, t.comp_bias, t.comp_norm, t.entries, t.comp_ring_kv, t.comp_ring_gate,
            sh.head_dim, csa ? 2 * sh.head_dim : sh.head_dim, csa ? 2 * r : r, csa};
        PoolArgs ix = c;
        if (csa)
        {
            ix = PoolArgs{t.index_kv, t.index_gate, t.index_bias, t.index_norm, t.index_keys, t.index_ring_kv,
                t.index_ring_gate, sh.index_dim, 2 * sh.index_dim, 2 * r, true};
        }
        int32_t const maxDim = csa && sh.index_dim > sh.head_dim ? sh.index_dim : sh.head_dim;
        dim3 const grid(static_cast<unsigned>(sh.num_tokens / r + 1), static_cast<unsigned>(sh.num_seqs), csa ? 2 : 1);
        resetLaunchError();
        compressKernel<T><<<grid, kCompressThreads, maxDim * sizeof(float), stream>>>(sh, t, c, ix);
        int status = checkLaunch("engram_dsv4_attention (compress)");
        if (status != 0)
        {
            return status;
        }
        dim3 const ringGrid(static_cast<unsigned>(2 * r), static_cast<unsigned>(sh.num_seqs), csa ? 2 : 1);
        resetLaunchError();
        ringKernel<T><<<ringGrid, 128, 0, stream>>>(sh, t, c, ix);
        status = checkLaunch("engram_dsv4_attention (ring)");
        if (status != 0)
        {
            return status;
        }
    }
    Layout const l = layoutOf(sh);
    int32_t* picks = nullptr;
    if (l.bytes > 0)
    {
        auto* scores = reinterpret_cast<float*>(static_cast<char*>(workspace) + l.scoresOffset);
        picks = reinterpret_cast<int32_t*>(static_cast<char*>(workspace) + l.picksOffset);
        size_t const shared = (static_cast<size_t>(sh.index_heads) * sh.index_dim + sh.index_heads) * sizeof(float);
        resetLaunchError();
        scoreKernel<T><<<static_cast<unsigned>(sh.num_tokens), kScoreThreads, shared, stream>>>(sh, t, scores);
        int status = checkLaunch("engram_dsv4_attention (score)");
        if (status != 0)
        {
            return status;
        }
        resetLaunchError();
        selectKernel<<<static_cast<unsigned>(sh.num_tokens), kSelectThreads, 0, stream>>>(sh, t, scores, picks);
        status = checkLaunch("engram_dsv4_attention (select)");
        if (status != 0)
        {
            return status;
        }
    }
    resetLaunchError();
    launchAttend<T>(sh, t, picks, stream);
    int status = checkLaunch("engram_dsv4_attention (attend)");
    if (status != 0)
    {
        return status;
    }
    resetLaunchError();
    launchDependent(windowKernel<T>, dim3(static_cast<unsigned>(sh.window), static_cast<unsigned>(sh.num_seqs)),
        dim3(128), 0, stream, sh, t);
    (void) seqGrid;
    return checkLaunch("engram_dsv4_attention (window)");
}

} // namespace
} // namespace kernels
} // namespace engram_trt

using namespace engram_trt::kernels;

extern "C" ENGRAM_API int engram_dsv4_check(const EngramDsv4Shape* shape)
{
    clearError();
    if (shape == nullptr)
    {
        return fail(cudaErrorInvalidValue, "engram_dsv4_check: shape is NULL");
    }
    EngramDsv4Shape const& s = *shape;
    char const* fn = "EngramDsv4Attention";
    if (s.layer_type < ENGRAM_DSV4_SLIDING || s.layer_type > ENGRAM_DSV4_HCA)
    {
        return fail(
            cudaErrorInvalidValue, "%s: layer_type %d must be 0 (sliding), 1 (CSA) or 2 (HCA)", fn, s.layer_type);
    }
    if (s.window < 1)
    {
        return fail(cudaErrorInvalidValue, "%s: window %d must be >= 1 (sliding_window)", fn, s.window);
    }
    bool const compressed = s.layer_type != ENGRAM_DSV4_SLIDING;
    if (compressed && s.compress_rate < 1)
    {
        return fail(
            cudaErrorInvalidValue, "%s: compress_rate %d must be >= 1 on a CSA / HCA layer", fn, s.compress_rate);
    }
    if (s.layer_type == ENGRAM_DSV4_CSA && s.index_topk < 1)
    {
        return fail(cudaErrorInvalidValue, "%s: index_topk %d must be >= 1 on a CSA layer", fn, s.index_topk);
    }
    if (!(s.scaling > 0.0F) || !std::isfinite(s.scaling))
    {
        return fail(cudaErrorInvalidValue, "%s: scaling %g must be a positive finite number (head_dim ** -0.5)", fn,
            static_cast<double>(s.scaling));
    }
    if (!(s.eps >= 0.0F) || !std::isfinite(s.eps))
    {
        return fail(cudaErrorInvalidValue, "%s: eps %g must be a finite number >= 0 (rms_norm_eps)", fn,
            static_cast<double>(s.eps));
    }
    if (!(s.rope_scale > 0.0F) || !std::isfinite(s.rope_scale))
    {
        return fail(cudaErrorInvalidValue, "%s: rope_scale %g must be a positive finite number (1 without YaRN)", fn,
            static_cast<double>(s.rope_scale));
    }
    if (s.io_type != ENGRAM_FLOAT_BF16 && s.io_type != ENGRAM_FLOAT_F16 && s.io_type != ENGRAM_FLOAT_F32)
    {
        return fail(cudaErrorInvalidValue, "%s: io_type %d is not bf16 (0), fp32 (1) or fp16 (2)", fn, s.io_type);
    }
    if (s.num_heads < 1 || s.num_heads > 65535 || s.head_dim < 1 || s.head_dim > ENGRAM_DSV4_MAX_HEAD_DIM)
    {
        return fail(cudaErrorInvalidValue, "%s: need 1 <= heads <= 65535 and 1 <= head_dim <= %d (got %d, %d)", fn,
            s.num_heads, ENGRAM_DSV4_MAX_HEAD_DIM, s.head_dim);
    }
    if (s.num_tokens < 0 || s.num_tokens > INT32_MAX || s.num_seqs < 0 || s.num_seqs > 65535 || s.num_slots < 0)
    {
        return fail(cudaErrorInvalidValue,
            "%s: need 0 <= tokens < 2^31, 0 <= sequences <= 65535, slots >= 0 (got "
            "%lld, %lld, %lld)",
            fn, ll(s.num_tokens), ll(s.num_seqs), ll(s.num_slots));
    }
    if (compressed)
    {
        if (s.rope_pairs < 1 || 2 * s.rope_pairs > s.head_dim)
        {
            return fail(cudaErrorInvalidValue, "%s: inv_freq has %d pairs; 2 x that must be in [2, head_dim %d]", fn,
                s.rope_pairs, s.head_dim);
        }
        if (s.max_entries < 0 || s.num_tokens / s.compress_rate + 1 > 65535 || 2LL * s.compress_rate > 65535)
        {
            return fail(cudaErrorInvalidValue, "%s: too many windows in one step (%lld tokens, compress_rate %d)", fn,
                ll(s.num_tokens), s.compress_rate);
        }
    }
    if (s.layer_type == ENGRAM_DSV4_CSA)
    {
        if (s.index_heads < 1 || s.index_dim < 1 || s.index_dim > ENGRAM_DSV4_MAX_INDEX_DIM
            || static_cast<int64_t>(s.index_heads) * (s.index_dim + 1) * 4 > 48 * 1024)
        {
            return fail(cudaErrorInvalidValue,
                "%s: need index_head_dim in [1, %d] and index_n_heads x "
                "(index_head_dim + 1) x 4 bytes <= 48 KiB (got %d heads of %d)",
                fn, ENGRAM_DSV4_MAX_INDEX_DIM, s.index_heads, s.index_dim);
        }
        if (2 * s.rope_pairs > s.index_dim)
        {
            return fail(
                cudaErrorInvalidValue, "%s: rope_dim %d exceeds index_head_dim %d", fn, 2 * s.rope_pairs, s.index_dim);
        }
    }
    if (s.window > 65535)
    {
        return fail(cudaErrorInvalidValue, "%s: window %d must be <= 65535", fn, s.window);
    }
    return 0;
}

extern "C" ENGRAM_API int engram_dsv4_workspace_size(const EngramDsv4Shape* shape, size_t* bytes)
{
    int const status = engram_dsv4_check(shape);
    if (status != 0)
    {
        return status;
    }
    if (bytes == nullptr)
    {
        return fail(cudaErrorInvalidValue, "engram_dsv4_workspace_size: bytes is NULL");
    }
    *bytes = layoutOf(*shape).bytes;
    return 0;
}

extern "C" ENGRAM_API int engram_dsv4_attention(const EngramDsv4Shape* shape, const EngramDsv4Tensors* tensors,
    void* workspace, size_t workspace_bytes, cudaStream_t stream)
{
    int const status = engram_dsv4_check(shape);
    if (status != 0)
    {
        return status;
    }
    char const* fn = "engram_dsv4_attention";
    if (tensors == nullptr)
    {
        return fail(cudaErrorInvalidValue, "%s: tensors is NULL", fn);
    }
    EngramDsv4Shape const& s = *shape;
    EngramDsv4Tensors const& t = *tensors;
    if (t.q == nullptr || t.kv == nullptr || t.sinks == nullptr || t.seq_starts == nullptr || t.past_lens == nullptr
        || t.seq_slots == nullptr || t.out == nullptr || (s.num_slots > 0 && t.window_kv == nullptr))
    {
        return fail(cudaErrorInvalidValue,
            "%s: q, kv, sinks, seq_starts, past_lens, slots, window_kv and out must not be NULL", fn);
    }
    if (s.layer_type != ENGRAM_DSV4_SLIDING
        && (t.comp_kv == nullptr || t.comp_gate == nullptr || t.comp_bias == nullptr || t.comp_norm == nullptr
            || t.inv_freq == nullptr || (s.num_slots > 0 && s.max_entries > 0 && t.entries == nullptr)
            || (s.num_slots > 0 && (t.comp_ring_kv == nullptr || t.comp_ring_gate == nullptr))))
    {
        return fail(cudaErrorInvalidValue, "%s: a CSA / HCA layer needs every compressor input (NULL given)", fn);
    }
    if (s.layer_type == ENGRAM_DSV4_CSA
        && (t.index_q == nullptr || t.index_w == nullptr || t.index_kv == nullptr || t.index_gate == nullptr
            || t.index_bias == nullptr || t.index_norm == nullptr
            || (s.num_slots > 0
                && (t.index_ring_kv == nullptr || t.index_ring_gate == nullptr
                    || (s.max_entries > 0 && t.index_keys == nullptr)))))
    {
        return fail(cudaErrorInvalidValue, "%s: a CSA layer needs every indexer input (NULL given)", fn);
    }
    size_t const need = layoutOf(s).bytes;
    if (need > 0 && (workspace == nullptr || workspace_bytes < need))
    {
        return fail(cudaErrorInvalidValue, "%s: the workspace needs %zu bytes (got %zu)", fn, need,
            workspace == nullptr ? static_cast<size_t>(0) : workspace_bytes);
    }
    int64_t const outBytes = s.num_tokens * s.num_heads * s.head_dim * ioBytes(s.io_type);
    if (overlaps(t.out, outBytes, t.q, outBytes) || overlaps(t.out, outBytes, t.kv, s.num_tokens * s.head_dim * 2))
    {
        return fail(cudaErrorInvalidValue, "%s: out must not overlap q or kv", fn);
    }
    if (s.num_slots == 0)
    {
        // no state: every sequence is outside it and gets zero rows
        if (outBytes > 0)
        {
            cudaError_t const e = cudaMemsetAsync(t.out, 0, static_cast<size_t>(outBytes), stream);
            if (e != cudaSuccess)
            {
                return failCuda(e, "%s: cudaMemsetAsync: %s", fn, cudaGetErrorString(e));
            }
        }
        return 0;
    }
    switch (s.io_type)
    {
    case ENGRAM_FLOAT_BF16: return launchAll<__nv_bfloat16>(s, t, workspace, stream);
    case ENGRAM_FLOAT_F16: return launchAll<__half>(s, t, workspace, stream);
    default: return launchAll<float>(s, t, workspace, stream);
    }
}
