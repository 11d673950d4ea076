// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * engram_quant_gemv: a decode step's products with weights in their stored format (FP8
 * e4m3 with block scales, FP4 e2m1 with block scales, BF16), for one weight or the routed
 * experts of a MoE step (quantKernels.h states the contract).
 *
 * Why: a decode step reads every weight byte once per token batch, so the stored FP8 /
 * FP4 bytes are both the memory and the time saved; nothing dequantized is written. The
 * kernel must therefore run at the HBM rate, whatever the format: the work per weight byte
 * (decode, one float32 FMA per value and row) has to fit beside the bytes.
 *
 * Layout. A block of 8 warps; a warp owns a group of R weight rows (R = 2 for up to 2
 * activation rows a pass, 4 for 4 or 8: the activation values a lane reads serve R rows);
 * its lanes read each row in 16-byte vectors (lane j takes vectors j, j + 32, ...), U
 * vectors a lane per row per step (RowsPerWarp: R * U = 8 for FP8 / BF16 up to 4 rows, 4
 * for 8 rows and for FP4), all issued with an L1-bypassing streaming load, and the next
 * step's (of this group or the warp's next group) issued before this step's FMAs (software
 * pipelining: each warp always has its next step's vectors in flight). A vector holds
 * 16 (FP8), 32 (FP4) or 8 (BF16) consecutive values of one scale block (bk is a multiple of
 * the vector's values), so each vector's dot product with up to MR activation rows is summed
 * in float32 apart and added times the block's scale (FP4's decode yields 2^-6 times the
 * values: the scale carries the 2^6). Warps take groups blockIdx.x * 8 + warp + i * 8 *
 * gridDim.x (the grid is at most the blocks resident at once, times ENGRAM_TRT_QGEMV_WAVES).
 *
 * Activations. The MR activation rows of a pass are staged once per block in shared memory
 * as float32 (bf16 widened), permuted so that lane j's 16-byte chunk c of vector v sits at
 * chunk ((v / 32) * (VPV / 4) + c) * 32 + v % 32: a warp's read of one chunk is 512
 * consecutive bytes, 4 wavefronts, free of bank conflicts. (Read from global memory, a
 * lane's VPV values are 64 / 128 bytes apart from its neighbour's: each 16-byte load of the
 * warp touched 16 lines, 4 times the activation traffic, which bounded the previous
 * kernel.) Rows past the pass's count and values past K are staged as zeros. With
 * ENGRAM_QGEMV_ACT_Q128_F32 / _Q32_UE8M0 the staging quantizes the raw rows on the way,
 * bit for bit engram_act_quant's float32 deq (stageQuantized). Where MR rows
 * do not fit the shared memory, passes take fewer rows; where one row does not, or
 * ENGRAM_TRT_QGEMV_STAGE=0 with one row a pass, the activations are read from global memory
 * (the unstaged variant).
 *
 * Sums. Per (weight row, activation row): a lane's VPV products in one float32 FMA chain,
 * times the block scale into the lane's accumulator (one FMA), over its ceil(K / (32 VPV))
 * vectors; then a reduction over the warp's 32 lanes of depth 5 (a transposing reduction:
 * the R * MR sums halve per level, so each lane ends holding one sum of all 32 lanes, and
 * lanes store their own). Every product passes at most VPV + 1 + ceil(K / (32 VPV)) + 5
 * float32 roundings: the bound tests/gpu/test_quant_kernels.py holds the kernel to.
 *
 * Launch. Programmatic dependent launch (dependentLaunch.cuh): the kernel waits for the one
 * before it before it reads the activations, row_index, offsets or slot_expert or writes
 * out; with ENGRAM_QGEMV_WEIGHT_STATIC (engram_quant_gemv_ex, one weight) its first weight
 * vectors are loaded before that wait.
 *
 * Experts: blockIdx.y is a slot of engram_moe_plan's slot_expert (a slot of -1 exits);
 * its expert's rows offsets[e] .. offsets[e+1]-1 are taken MR at a time, each row p
 * reading activation row row_index[p]. MR is the smallest power of two >= min(8, rows per
 * slot): P for one weight, ceil(P / num_slots) for experts (the host knows no expert's
 * count without a synchronization).
 */
#include "dependentLaunch.cuh"
#include "engramKernelsCore.h"
#include "engramKernelsInternal.h"
#include "quantDevice.cuh"
#include "quantInternal.h"
#include "quantKernels.h"
#include "vecLoad.cuh"

#include <cuda_bf16.h>

#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

namespace engram_trt
{
namespace kernels
{

namespace
{

constexpr int kQGemvThreads = 256;
constexpr int kQGemvWarps = kQGemvThreads / 32;
constexpr int kQGemvStaticShared = 64; // the kernel's static shared memory (row sources), at most

/*
 * Division of a uint32 by a divisor d >= 1 fixed per launch, without a division
 * instruction (the branch-free form of Granlund and Montgomery's method): with
 * l = ceil(log2 d) and m = floor(2^32 (2^l - d) / d) + 1, t = umulhi(m, n),
 * n / d = (t + ((n - t) >> s1)) >> s2, s1 = min(l, 1), s2 = max(l - 1, 0); exact for every
 * uint32 n. Five instructions.
 */
struct FastDivisor
{
    uint32_t magic;
    uint32_t shift1;
    uint32_t shift2;

    static FastDivisor of(uint32_t d)
    {
        uint32_t l = 0;
        while ((uint64_t{1} << l) < d)
        {
            ++l;
        }
        uint64_t const m = ((uint64_t{1} << 32) * ((uint64_t{1} << l) - d)) / d + 1;
        return {static_cast<uint32_t>(m), l < 1 ? l : 1U, l > 1 ? l - 1 : 0U};
    }

    __device__ __forceinline__ uint32_t divide(uint32_t n) const
    {
        uint32_t const t = __umulhi(magic, n);
        return (t + ((n - t) >> shift1)) >> shift2;
    }
};

struct QGemvParams
{
    void const* a;
    int64_t lda;
    int32_t const* rowIndex;
    int64_t rows;
    uint8_t const* w;
    void const* scale;
    int32_t ue8m0;
    int32_t aBf16;
    int32_t bn;
    FastDivisor bnDiv;  // n / bn
    FastDivisor vecDiv; // v / (bk / VPV): the scale block of vector v
    int32_t n;
    int32_t k;
    int32_t vectors; // K / VPV
    int32_t kBlocks;
    int32_t chunksPerRow; // staged 16-byte float chunks of one activation row (K padded to 32 vectors)
    int32_t groups;       // ceil(N / R)
    int32_t weightStatic;
    int32_t actGroup; // 0: a as given; 128 / 32: a quantized per group at staging (engram_act_quant's deq)
    int32_t actUe8m0;
    int64_t expertBytes;  // bytes of one expert's weight
    int64_t expertScales; // scale elements of one expert
    int32_t experts;
    int32_t const* offsets;
    int32_t const* slotExpert;
    void* out;
    int32_t outType;
    int64_t ldo;
    int64_t oCol0;
};

//! Values of one 16-byte vector of weight type WT.
template <int WT>
struct VectorValues
{
    static constexpr int value = WT == ENGRAM_QWEIGHT_FP8_E4M3 ? 16 : (WT == ENGRAM_QWEIGHT_FP4_E2M1 ? 32 : 8);
};

//! 4 consecutive activations as floats from global memory (fp32 or bf16 by `bf16`).
__device__ __forceinline__ float4 loadAct4Global(void const* a, int64_t i, bool bf16)
{
    if (bf16)
    {
        uint2 const raw = __ldg(reinterpret_cast<uint2 const*>(static_cast<__nv_bfloat16 const*>(a) + i));
        float2 const lo = __bfloat1622float2(*reinterpret_cast<__nv_bfloat162 const*>(&raw.x));
        float2 const hi = __bfloat1622float2(*reinterpret_cast<__nv_bfloat162 const*>(&raw.y));
        return make_float4(lo.x, lo.y, hi.x, hi.y);
    }
    return __ldg(reinterpret_cast<float4 const*>(static_cast<float const*>(a) + i));
}

/*
 * The sums x[0 .. NV-1] of each lane (NV = 2^B <= 32) summed over the warp's 32 lanes: at
 * level s (lane offset 16 >> s, s < B) a lane keeps one half of its values and receives
 * its partner's share of that half, so after B levels lane l holds value l >> (5 - B); the
 * remaining 5 - B levels are a butterfly. Every sum takes 5 additions, as a butterfly's
 * would, in NV - 1 + (5 - B) shuffles instead of 5 NV. Returns the lane's value; its index
 * is lane >> (5 - B).
 */
//! One level of warpSumTransposed: lanes with `offset` set keep the upper half.
template <int HALF, int NV>
__device__ __forceinline__ void halveAcrossLanes(float (&x)[NV], int lane, int offset)
{
    bool const upper = (lane & offset) != 0;
#pragma unroll
    for (int i = 0; i < HALF; ++i)
    {
        float const send = upper ? x[i] : x[i + HALF];
        float const keep = upper ? x[i + HALF] : x[i];
        x[i] = keep + __shfl_xor_sync(0xFFFFFFFFu, send, offset);
    }
}

template <int NV>
__device__ __forceinline__ float warpSumTransposed(float (&x)[NV], int lane)
{
    static_assert(NV >= 1 && NV <= 32 && (NV & (NV - 1)) == 0, "NV must be a power of two <= 32");
    if constexpr (NV >= 32)
    {
        halveAcrossLanes<16>(x, lane, 16);
    }
    if constexpr (NV >= 16)
    {
        halveAcrossLanes<8>(x, lane, NV >= 32 ? 8 : 16);
    }
    if constexpr (NV >= 8)
    {
        halveAcrossLanes<4>(x, lane, 32 / NV * 4);
    }
    if constexpr (NV >= 4)
    {
        halveAcrossLanes<2>(x, lane, 32 / NV * 2);
    }
    if constexpr (NV >= 2)
    {
        halveAcrossLanes<1>(x, lane, 32 / NV);
    }
    float v = x[0];
#pragma unroll
    for (int offset = 32 / NV / 2; offset >= 1; offset /= 2)
    {
        v += __shfl_xor_sync(0xFFFFFFFFu, v, offset);
    }
    return v;
}

//! The U vectors of each of R rows a lane loads in one step (vector v0 + 32 u of each row;
//! zeros past the row's `vectors`).
template <int R, int U>
__device__ __forceinline__ void issueWeights(
    uint4 const* const (&rows)[R], int32_t v0, int32_t vectors, uint4 (&wv)[R][U])
{
#pragma unroll
    for (int r = 0; r < R; ++r)
    {
#pragma unroll
        for (int u = 0; u < U; ++u)
        {
            int32_t const v = v0 + 32 * u;
            wv[r][u] = v < vectors ? loadStreaming(rows[r] + v) : make_uint4(0, 0, 0, 0);
        }
    }
}

//! The block scale of each of the U vectors of R rows a step loads: ue8m0 bytes or
//! float32 (UE8M0); 0 past the row (a zero vector times 0, never a NaN scale). Loads
//! without branches: a lane past the row reads the row's last scale.
template <int R, int U, bool UE8M0, typename Params>
__device__ __forceinline__ void issueScales(
    int64_t const (&scaleRows)[R], int32_t v0, Params const& p, float (&sv)[R][U])
{
#pragma unroll
    for (int u = 0; u < U; ++u)
    {
        int32_t const v0u = v0 + 32 * u;
        bool const ok = v0u < p.vectors;
        int32_t const v = ok ? v0u : p.vectors - 1;
        auto const kb = static_cast<int32_t>(p.vecDiv.divide(static_cast<uint32_t>(v)));
#pragma unroll
        for (int r = 0; r < R; ++r)
        {
            float s;
            if constexpr (UE8M0)
            {
                s = ue8m0ToFloatSelect(__ldg(static_cast<uint8_t const*>(p.scale) + scaleRows[r] + kb));
            }
            else
            {
                s = __ldg(static_cast<float const*>(p.scale) + scaleRows[r] + kb);
            }
            sv[r][u] = ok ? s : 0.0F;
        }
    }
}

//! Chunk q (16 bytes of floats) of a staged row holds values 4 c .. 4 c + 3 of vector v,
//! v = (q / (32 CH)) * 32 + q % 32, c = (q / 32) % CH; its index for value k of the row.
template <int VPV>
__device__ __forceinline__ int32_t stagedChunk(int32_t k)
{
    constexpr int CH = VPV / 4;
    int32_t const v = k / VPV;
    int32_t const c = (k % VPV) / 4;
    return ((v >> 5) * CH + c) * 32 + (v & 31);
}

//! The pass's activation rows (sSrc[m] >= 0) as float32 into the staged layout; rows past
//! the pass's count (sSrc -1) and values past K as zeros.
template <int VPV, int MR, typename Params>
__device__ __forceinline__ void stagePlain(Params const& p, int32_t const* sSrc, float4* sAct)
{
    constexpr int CH = VPV / 4;
#pragma unroll
    for (int m = 0; m < MR; ++m)
    {
        int32_t const src = sSrc[m];
        for (int32_t q = threadIdx.x; q < p.chunksPerRow; q += blockDim.x)
        {
            int32_t const v = (q / (32 * CH)) * 32 + (q & 31);
            int32_t const c = (q >> 5) % CH;
            float4 val = make_float4(0.0F, 0.0F, 0.0F, 0.0F);
            if (src >= 0 && v < p.vectors)
            {
                val = loadAct4Global(p.a, src * p.lda + static_cast<int64_t>(v) * VPV + 4 * c, p.aBf16 != 0);
            }
            sAct[m * p.chunksPerRow + q] = val;
        }
    }
}

/*
 * stagePlain with the activations quantized on the way, bit for bit engram_act_quant's deq
 * in float32 (quantActKernel.cu, quant/formats.py act_quant): per row and group of
 * p.actGroup columns (128 or 32; a partial last group over the columns it has) amax, s =
 * max(amax, 1e-4) / 448 (float32 division; ue8m0: the next power of two), q = e4m3 of
 * x * (1 / s) (1 / s rounded first), deq = e4m3(q) * s. A group of G columns is G / 4 lanes
 * of one warp, 4 consecutive values a lane (one 16-byte chunk of the staged row); its amax
 * a max over those lanes (max is exact in any order). Rows past the pass's count and the
 * padding past K are zeros.
 */
template <int VPV, int MR, typename Params>
__device__ __forceinline__ void stageQuantized(Params const& p, int32_t const* sSrc, float4* sAct, int warp, int lane)
{
    int32_t const group = p.actGroup;
    int const lanesPerGroup = group / 4; // 32 or 8
    int const groupsPerWarp = 32 / lanesPerGroup;
    int32_t const groups = (p.k + group - 1) / group;
    int32_t const items = (groups + groupsPerWarp - 1) / groupsPerWarp; // warp items per row
    int const sub = lane / lanesPerGroup;
    int const part = lane % lanesPerGroup;
    float* const sFloat = reinterpret_cast<float*>(sAct);
    for (int32_t it = warp; it < MR * items; it += kQGemvWarps)
    {
        int const m = it / items;
        int32_t const gi = (it - m * items) * groupsPerWarp + sub;
        int32_t const src = sSrc[m];
        int32_t const k = gi * group + 4 * part; // this lane's 4 values
        bool const ok = src >= 0 && gi < groups && k < p.k;
        float4 x = make_float4(0.0F, 0.0F, 0.0F, 0.0F);
        if (ok)
        {
            x = loadAct4Global(p.a, src * p.lda + k, p.aBf16 != 0);
        }
        float amax = fmaxf(fmaxf(fabsf(x.x), fabsf(x.y)), fmaxf(fabsf(x.z), fabsf(x.w)));
        for (int offset = lanesPerGroup / 2; offset > 0; offset >>= 1)
        {
            amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFU, amax, offset));
        }
        float s = __fdiv_rn(fmaxf(amax, kActAmaxFloor), kFp8Max);
        if (p.actUe8m0 != 0)
        {
            s = pow2Ceil(s);
        }
        float const inv = __fdiv_rn(1.0F, s);
        float const in[4] = {x.x, x.y, x.z, x.w};
        float out[4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
        {
            out[i] = __fmul_rn(e4m3ToFloat(floatToE4m3(__fmul_rn(in[i], inv))), s);
        }
        if (gi < groups && k < p.k)
        {
            // (a row past the pass's count stores the zeros it loaded: ok is false there)
            float4 const val = src >= 0 ? make_float4(out[0], out[1], out[2], out[3]) : make_float4(0.F, 0.F, 0.F, 0.F);
            sAct[m * p.chunksPerRow + stagedChunk<VPV>(k)] = val;
        }
    }
    // the padding past K (the staged layout holds whole 32-vector groups)
    int32_t const kPad = p.chunksPerRow * 4;
    for (int32_t i = p.k + threadIdx.x; i < kPad; i += blockDim.x)
    {
#pragma unroll
        for (int m = 0; m < MR; ++m)
        {
            int32_t const c = stagedChunk<VPV>(i & ~3);
            sFloat[(m * p.chunksPerRow + c) * 4 + (i & 3)] = 0.0F;
        }
    }
}

//! Weight rows a warp (R) and 16-byte vectors a lane loads per row and step (U) for weight
//! type WT and MR activation rows a pass: R * U * 16 bytes in flight per lane, twice (the
//! next step's). FP4 vectors hold twice FP8's values (twice the FMAs per byte): half the
//! vectors a step, so a step's registers stay within two blocks of 256 threads an SM.
template <int WT, int MR>
struct RowsPerWarp
{
    static constexpr int value = MR <= 2 ? 2 : 4;
    static constexpr int full = MR <= 2 ? 4 : (MR == 4 ? 2 : 1);
    static constexpr int vectors = WT == ENGRAM_QWEIGHT_FP4_E2M1 && full > 1 ? full / 2 : full;
};

/*
 * The kernel (file comment): weight type WT, MR activation rows a pass, R = RowsPerWarp
 * weight rows a warp, STAGED: activations staged in shared memory (else read from global
 * memory; built for MR = 1 only).
 */
template <int WT, int MR, bool STAGED>
__global__ void __launch_bounds__(kQGemvThreads) quantGemvKernel(QGemvParams const p)
{
    constexpr int VPV = VectorValues<WT>::value;
    constexpr int CH = VPV / 4; // 16-byte float chunks of the activations of one vector
    constexpr int C8 = VPV / 8; // decode chunks of 8 values
    constexpr int R = RowsPerWarp<WT, MR>::value;
    constexpr int U = RowsPerWarp<WT, MR>::vectors;
    constexpr bool kScaled = WT != ENGRAM_QWEIGHT_BF16;
    extern __shared__ float4 sAct[];
    __shared__ int32_t sSrc[8];
    int const lane = threadIdx.x & 31;
    int const warp = threadIdx.x >> 5;
    bool const experts = p.experts > 1;
    bool const early = p.weightStatic != 0 && !experts; // weights loaded before the wait
    if (!early)
    {
        waitForPrimary(); // dependentLaunch.cuh
        allowDependents();
    }
    int32_t e = 0;
    int64_t pBegin = 0;
    int64_t pEnd = p.rows;
    if (experts)
    {
        e = __ldg(p.slotExpert + blockIdx.y);
        if (e < 0 || e >= p.experts)
        {
            return; // the whole block: no barrier is skipped by part of it
        }
        pBegin = __ldg(p.offsets + e);
        pEnd = __ldg(p.offsets + e + 1);
        pEnd = pEnd < p.rows ? pEnd : p.rows;
    }
    int32_t const vectors = p.vectors;
    int32_t const vGroups = (vectors + 31) / 32; // 32-vector groups along K (the staged layout's)
    int32_t const steps = (vectors + 32 * U - 1) / (32 * U);
    int64_t const rowBytes = static_cast<int64_t>(vectors) * 16;
    uint8_t const* const wExpert = p.w + e * p.expertBytes;
    int32_t const gFirst = static_cast<int32_t>(blockIdx.x) * kQGemvWarps + warp;
    int32_t const gStride = static_cast<int32_t>(gridDim.x) * kQGemvWarps;

    // the rows of the group whose vectors are loaded next, and their scale rows
    uint4 const* rowNext[R];
    int64_t scaleNext[R];
    auto setGroup = [&](int32_t g) {
#pragma unroll
        for (int r = 0; r < R; ++r)
        {
            int32_t const n0 = g * R + r;
            int32_t const n = n0 < p.n ? n0 : p.n - 1; // a row past N reads the last again and is not written
            rowNext[r] = reinterpret_cast<uint4 const*>(wExpert + n * rowBytes);
            scaleNext[r] = 0;
            if constexpr (kScaled)
            {
                auto const nb = static_cast<int32_t>(p.bnDiv.divide(static_cast<uint32_t>(n)));
                scaleNext[r] = e * p.expertScales + static_cast<int64_t>(nb) * p.kBlocks;
            }
        }
    };
    // one step's loads: U vectors of each of the group's R rows, and their scales (one
    // uniform branch on the scale format per step)
    auto issue = [&](int32_t step, uint4(&wv)[R][U], float (&sv)[R][U]) {
        int32_t const v0 = step * 32 * U + lane;
        issueWeights<R, U>(rowNext, v0, p.vectors, wv);
        if constexpr (kScaled)
        {
            if (p.ue8m0 != 0)
            {
                issueScales<R, U, true>(scaleNext, v0, p, sv);
            }
            else
            {
                issueScales<R, U, false>(scaleNext, v0, p, sv);
            }
        }
        else
        {
#pragma unroll
            for (int r = 0; r < R; ++r)
            {
#pragma unroll
                for (int u = 0; u < U; ++u)
                {
                    sv[r][u] = 1.0F;
                }
            }
        }
    };

    bool waited = !early;
    for (int64_t p0 = pBegin; p0 < pEnd; p0 += MR)
    {
        int const mc = pEnd - p0 < MR ? static_cast<int>(pEnd - p0) : MR;
        int32_t g = gFirst;
        int32_t step = 0;
        bool have = g < p.groups;
        uint4 wNext[R][U];
        float sNext[R][U];
        if (have)
        {
            setGroup(g);
            issue(0, wNext, sNext);
        }
        if (!waited)
        {
            // The first weight vectors are in flight; the activations, row_index and out
            // wait for the kernel before, which may still be running (dependentLaunch.cuh).
            waitForPrimary();
            allowDependents();
            waited = true;
        }
        if (threadIdx.x < MR)
        {
            int64_t const pr = p0 + threadIdx.x;
            sSrc[threadIdx.x] = static_cast<int>(threadIdx.x) < mc
                ? (p.rowIndex != nullptr ? __ldg(p.rowIndex + pr) : static_cast<int32_t>(pr))
                : -1;
        }
        __syncthreads();
        if constexpr (STAGED)
        {
            if (p.actGroup != 0)
            {
                stageQuantized<VPV, MR>(p, sSrc, sAct, warp, lane);
            }
            else
            {
                stagePlain<VPV, MR>(p, sSrc, sAct);
            }
            __syncthreads();
        }
        int32_t const src0 = sSrc[0];

        float acc[R][MR];
#pragma unroll
        for (int r = 0; r < R; ++r)
        {
#pragma unroll
            for (int m = 0; m < MR; ++m)
            {
                acc[r][m] = 0.0F;
            }
        }
        while (have)
        {
            uint4 wCur[R][U];
            float sCur[R][U];
#pragma unroll
            for (int r = 0; r < R; ++r)
            {
#pragma unroll
                for (int u = 0; u < U; ++u)
                {
                    wCur[r][u] = wNext[r][u];
                    sCur[r][u] = sNext[r][u];
                }
            }
            int32_t const gc = g;
            int32_t const sc = step;
            if (++step == steps)
            {
                step = 0;
                g += gStride;
                if (g < p.groups)
                {
                    setGroup(g);
                }
            }
            have = g < p.groups;
            if (have)
            {
                issue(step, wNext, sNext); // in flight during this step's FMAs
            }
#pragma unroll
            for (int u = 0; u < U; ++u)
            {
                int32_t const vg = sc * U + u; // this vector's 32-vector group (warp-uniform)
                if (vg >= vGroups)
                {
                    break;
                }
                float part[R][MR];
#pragma unroll
                for (int r = 0; r < R; ++r)
                {
#pragma unroll
                    for (int m = 0; m < MR; ++m)
                    {
                        part[r][m] = 0.0F;
                    }
                }
#pragma unroll
                for (int c = 0; c < C8; ++c)
                {
                    float wf[R][8];
#pragma unroll
                    for (int r = 0; r < R; ++r)
                    {
                        decodeChunk<WT>(wCur[r][u], c, wf[r]);
                    }
#pragma unroll
                    for (int m = 0; m < MR; ++m)
                    {
                        float4 lo;
                        float4 hi;
                        if constexpr (STAGED)
                        {
                            float4 const* const base = sAct + m * p.chunksPerRow + (vg * CH + 2 * c) * 32 + lane;
                            lo = base[0];
                            hi = base[32];
                        }
                        else
                        {
                            // (a lane past the row's vectors reads nothing: its weights are zeros)
                            int32_t const v = vg * 32 + lane;
                            int64_t const i = src0 * p.lda + static_cast<int64_t>(v) * VPV + 8 * c;
                            lo = v < vectors ? loadAct4Global(p.a, i, p.aBf16 != 0) : make_float4(0.F, 0.F, 0.F, 0.F);
                            hi = v < vectors ? loadAct4Global(p.a, i + 4, p.aBf16 != 0)
                                             : make_float4(0.F, 0.F, 0.F, 0.F);
                        }
                        float const af[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
                        for (int r = 0; r < R; ++r)
                        {
#pragma unroll
                            for (int i = 0; i < 8; ++i)
                            {
                                part[r][m] = fmaf(wf[r][i], af[i], part[r][m]);
                            }
                        }
                    }
                }
#pragma unroll
                for (int r = 0; r < R; ++r)
                {
                    float s = sCur[r][u];
                    if constexpr (WT == ENGRAM_QWEIGHT_FP4_E2M1)
                    {
                        s *= kE2m1DecodeScale;
                    }
#pragma unroll
                    for (int m = 0; m < MR; ++m)
                    {
                        if constexpr (kScaled)
                        {
                            acc[r][m] = fmaf(part[r][m], s, acc[r][m]);
                        }
                        else
                        {
                            acc[r][m] += part[r][m];
                        }
                    }
                }
            }
            if (sc == steps - 1)
            {
                // the group's sums: reduce over the warp, each lane storing the one it holds
                constexpr int NV = R * MR;
                constexpr int B = NV >= 32 ? 5 : (NV >= 16 ? 4 : (NV >= 8 ? 3 : (NV >= 4 ? 2 : (NV >= 2 ? 1 : 0))));
                float x[NV];
#pragma unroll
                for (int r = 0; r < R; ++r)
                {
#pragma unroll
                    for (int m = 0; m < MR; ++m)
                    {
                        x[r * MR + m] = acc[r][m];
                        acc[r][m] = 0.0F;
                    }
                }
                float const sum = warpSumTransposed<NV>(x, lane);
                int const idx = lane >> (5 - B);
                int const r = idx / MR;
                int const m = idx % MR;
                int32_t const n = gc * R + r;
                if ((lane & ((1 << (5 - B)) - 1)) == 0 && m < mc && n < p.n)
                {
                    storeFloatAs(p.out, p.outType, (p0 + m) * p.ldo + p.oCol0 + n, sum);
                }
            }
        }
        __syncthreads(); // the next pass restages the activations
    }
}

using QGemvKernelFn = void (*)(QGemvParams);

//! Sets the kernel's dynamic shared memory opt-in (once per kernel and device) and returns
//! the blocks of it one multiprocessor holds with `shared` bytes (0 when it cannot be asked).
int residentBlocks(QGemvKernelFn kernel, int shared)
{
    struct Entry
    {
        QGemvKernelFn kernel;
        int device;
        int shared;
        int blocks;
    };
    static std::mutex mutex;
    static std::vector<Entry> cache;
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess)
    {
        return 0;
    }
    std::lock_guard<std::mutex> lock(mutex);
    for (Entry const& entry : cache)
    {
        if (entry.kernel == kernel && entry.device == device && entry.shared == shared)
        {
            return entry.blocks;
        }
    }
    int const optin = maxSharedPerBlockOptin();
    if (optin > 48 * 1024
        && cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, optin - kQGemvStaticShared)
            != cudaSuccess)
    {
        return 0;
    }
    int blocks = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kQGemvThreads, shared) != cudaSuccess)
    {
        return 0;
    }
    cache.push_back({kernel, device, shared, blocks});
    return blocks;
}

//! An integer environment variable, or `fallback` when unset or not a number.
int envInt(char const* name, int fallback)
{
    char const* const text = std::getenv(name);
    if (text == nullptr || *text == '\0')
    {
        return fallback;
    }
    char* end = nullptr;
    long const value = std::strtol(text, &end, 10);
    return (*end == '\0' && value >= 0 && value <= 1000) ? static_cast<int>(value) : fallback;
}

template <int WT>
QGemvKernelFn pickKernel(int mr, bool staged)
{
    if (!staged)
    {
        return quantGemvKernel<WT, 1, false>;
    }
    switch (mr)
    {
    case 1: return quantGemvKernel<WT, 1, true>;
    case 2: return quantGemvKernel<WT, 2, true>;
    case 4: return quantGemvKernel<WT, 4, true>;
    default: return quantGemvKernel<WT, 8, true>;
    }
}

} // namespace

} // namespace kernels
} // namespace engram_trt

using namespace engram_trt::kernels;

extern "C" ENGRAM_API int engram_quant_gemv_ex(void const* a, int32_t aType, int64_t lda, int32_t const* rowIndex,
    int64_t numRows, void const* w, int32_t wType, void const* wScale, int32_t scaleType, int32_t bn, int32_t bk,
    int64_t outFeatures, int64_t inFeatures, int32_t numExperts, int32_t const* offsets, int32_t const* slotExpert,
    int32_t numSlots, void* out, int32_t outType, int64_t ldo, int64_t oCol0, uint32_t flags, cudaStream_t stream)
{
    clearError();
    char const* const fn = "engram_quant_gemv";
    if (int const status
        = checkQuantWeight(fn, wType, w, wScale, scaleType, bn, bk, outFeatures, inFeatures, numExperts))
    {
        return status;
    }
    int const vpv = wType == ENGRAM_QWEIGHT_FP8_E4M3 ? 16 : (wType == ENGRAM_QWEIGHT_FP4_E2M1 ? 32 : 8);
    if (inFeatures % vpv != 0)
    {
        return fail(cudaErrorInvalidValue,
            "%s: in_features must be a multiple of %d for %s weights (rows of whole 16-byte vectors; got %lld)", fn,
            vpv, wType == ENGRAM_QWEIGHT_FP8_E4M3 ? "fp8" : (wType == ENGRAM_QWEIGHT_FP4_E2M1 ? "fp4" : "bf16"),
            ll(inFeatures));
    }
    if (wType != ENGRAM_QWEIGHT_BF16 && bk % vpv != 0)
    {
        return fail(cudaErrorInvalidValue,
            "%s: bk must be a multiple of %d for %s weights (a 16-byte vector in one block; got %d)", fn, vpv,
            wType == ENGRAM_QWEIGHT_FP8_E4M3 ? "fp8" : "fp4", bk);
    }
    if (aType != ENGRAM_FLOAT_F32 && aType != ENGRAM_FLOAT_BF16)
    {
        return fail(cudaErrorInvalidValue, "%s: a_type must be 1 (float32) or 0 (bf16) (got %d)", fn, aType);
    }
    int64_t const aElems = 16 / (aType == ENGRAM_FLOAT_F32 ? 4 : 2);
    if (lda < inFeatures || lda % aElems != 0)
    {
        return fail(cudaErrorInvalidValue, "%s: lda must be >= in_features and a multiple of %lld (16 bytes; got %lld)",
            fn, ll(aElems), ll(lda));
    }
    if (numRows < 0 || numRows > INT32_MAX)
    {
        return fail(cudaErrorInvalidValue, "%s: num_rows must be in [0, 2^31 - 1] (got %lld)", fn, ll(numRows));
    }
    if (int const status = checkExperts(fn, numExperts, offsets))
    {
        return status;
    }
    if (numExperts == 1 && (slotExpert != nullptr || numSlots != 1))
    {
        return fail(cudaErrorInvalidValue, "%s: one weight (num_experts 1) takes slot_expert NULL and num_slots 1", fn);
    }
    if (numExperts > 1 && (slotExpert == nullptr || !isAligned(slotExpert, 4) || numSlots < 1 || numSlots > 65535))
    {
        return fail(cudaErrorInvalidValue,
            "%s: num_experts > 1 needs slot_expert [num_slots] (int32 device) and 1 <= num_slots <= 65535 (got %d)", fn,
            numSlots);
    }
    if (oCol0 < 0)
    {
        return fail(cudaErrorInvalidValue, "%s: o_col0 must be >= 0 (got %lld)", fn, ll(oCol0));
    }
    if (int const status = checkQuantOut(fn, out, outType, ldo, oCol0 + outFeatures))
    {
        return status;
    }
    uint32_t const known = ENGRAM_QGEMV_WEIGHT_STATIC | ENGRAM_QGEMV_ACT_Q128_F32 | ENGRAM_QGEMV_ACT_Q32_UE8M0;
    if ((flags & ~known) != 0)
    {
        return fail(cudaErrorInvalidValue,
            "%s: unknown flags 0x%x (known: ENGRAM_QGEMV_WEIGHT_STATIC 0x%x, ENGRAM_QGEMV_ACT_Q128_F32 0x%x, "
            "ENGRAM_QGEMV_ACT_Q32_UE8M0 0x%x)",
            fn, flags, static_cast<unsigned>(ENGRAM_QGEMV_WEIGHT_STATIC),
            static_cast<unsigned>(ENGRAM_QGEMV_ACT_Q128_F32), static_cast<unsigned>(ENGRAM_QGEMV_ACT_Q32_UE8M0));
    }
    bool const q128 = (flags & ENGRAM_QGEMV_ACT_Q128_F32) != 0;
    bool const q32 = (flags & ENGRAM_QGEMV_ACT_Q32_UE8M0) != 0;
    if (q128 && q32)
    {
        return fail(cudaErrorInvalidValue,
            "%s: flags ENGRAM_QGEMV_ACT_Q128_F32 and ENGRAM_QGEMV_ACT_Q32_UE8M0 exclude each other (one "
            "quantization of the activations)",
            fn);
    }
    if (numRows == 0)
    {
        return 0;
    }
    if (a == nullptr || !isAligned(a, 16) || (rowIndex != nullptr && !isAligned(rowIndex, 4)))
    {
        return fail(
            cudaErrorInvalidValue, "%s: a must be a 16-byte aligned device pointer (row_index int32 or NULL)", fn);
    }
    int64_t const bytesPerRow = wType == ENGRAM_QWEIGHT_FP8_E4M3
        ? inFeatures
        : (wType == ENGRAM_QWEIGHT_FP4_E2M1 ? inFeatures / 2 : inFeatures * 2);
    int64_t const nBlocks = wType == ENGRAM_QWEIGHT_BF16 ? 0 : (outFeatures + bn - 1) / bn;
    int64_t const kBlocks = wType == ENGRAM_QWEIGHT_BF16 ? 0 : (inFeatures + bk - 1) / bk;
    int64_t const vectors = inFeatures / vpv;
    int64_t const chunksPerRow = (vectors + 31) / 32 * 32 * (vpv / 4);
    if (chunksPerRow > INT32_MAX / 8)
    {
        return fail(cudaErrorInvalidValue, "%s: in_features %lld is too large", fn, ll(inFeatures));
    }
    QGemvParams p{};
    p.a = a;
    p.lda = lda;
    p.rowIndex = rowIndex;
    p.rows = numRows;
    p.w = static_cast<uint8_t const*>(w);
    p.scale = wScale;
    p.ue8m0 = scaleType == ENGRAM_QSCALE_UE8M0 ? 1 : 0;
    p.aBf16 = aType == ENGRAM_FLOAT_BF16 ? 1 : 0;
    p.bn = wType == ENGRAM_QWEIGHT_BF16 ? 1 : bn;
    p.vecDiv = FastDivisor::of(static_cast<uint32_t>(wType == ENGRAM_QWEIGHT_BF16 ? 1 : bk / vpv));
    p.bnDiv = FastDivisor::of(static_cast<uint32_t>(p.bn));
    p.n = static_cast<int32_t>(outFeatures);
    p.k = static_cast<int32_t>(inFeatures);
    p.vectors = static_cast<int32_t>(vectors);
    p.kBlocks = static_cast<int32_t>(kBlocks);
    p.chunksPerRow = static_cast<int32_t>(chunksPerRow);
    p.weightStatic = (flags & ENGRAM_QGEMV_WEIGHT_STATIC) != 0 ? 1 : 0;
    p.actGroup = q128 ? 128 : (q32 ? 32 : 0);
    p.actUe8m0 = q32 ? 1 : 0;
    p.expertBytes = outFeatures * bytesPerRow;
    p.expertScales = nBlocks * kBlocks;
    p.experts = numExperts;
    p.offsets = offsets;
    p.slotExpert = slotExpert;
    p.out = out;
    p.outType = outType;
    p.ldo = ldo;
    p.oCol0 = oCol0;
    // rows per pass: P for one weight; the average rows per slot for experts (most of a
    // decode step's experts have one or two rows; more are taken in further passes)
    int64_t const perSlot = numExperts == 1 ? numRows : (numRows + numSlots - 1) / numSlots;
    int64_t const most = perSlot < ENGRAM_QGEMV_MAX_ROWS ? perSlot : ENGRAM_QGEMV_MAX_ROWS;
    int mr = most <= 1 ? 1 : (most <= 2 ? 2 : (most <= 4 ? 4 : 8));
    // the staged rows must fit the block's shared memory: fewer rows a pass, or unstaged
    int64_t const rowShared = chunksPerRow * 16;
    int64_t const optin = maxSharedPerBlockOptin() - kQGemvStaticShared;
    while (mr > 1 && mr * rowShared > optin)
    {
        mr /= 2;
    }
    bool const quantize = q128 || q32;
    if (quantize && rowShared > optin)
    {
        return fail(cudaErrorNotSupported,
            "%s: quantizing the activations in the GEMV stages a row of %lld floats in shared memory, more than this "
            "GPU allows a block (%lld bytes): quantize them first (engram_act_quant) and pass the result",
            fn, ll(inFeatures), ll(optin));
    }
    bool const staged = rowShared <= optin && (quantize || !(mr == 1 && envInt("ENGRAM_TRT_QGEMV_STAGE", 1) == 0));
    int const shared = staged ? static_cast<int>(mr * rowShared) : 0;
    int const rowsPerWarp = mr <= 2 ? 2 : 4;
    p.groups = static_cast<int32_t>((outFeatures + rowsPerWarp - 1) / rowsPerWarp);
    QGemvKernelFn kernel = nullptr;
    switch (wType)
    {
    case ENGRAM_QWEIGHT_FP8_E4M3: kernel = pickKernel<ENGRAM_QWEIGHT_FP8_E4M3>(mr, staged); break;
    case ENGRAM_QWEIGHT_FP4_E2M1: kernel = pickKernel<ENGRAM_QWEIGHT_FP4_E2M1>(mr, staged); break;
    default: kernel = pickKernel<ENGRAM_QWEIGHT_BF16>(mr, staged); break;
    }
    // grid: a warp per group, at most the blocks resident at once times
    // ENGRAM_TRT_QGEMV_WAVES (default 1; 0: no cap), shared by the slots
    int64_t const needed = (p.groups + kQGemvWarps - 1) / kQGemvWarps;
    int64_t gridX = needed;
    int const waves = envInt("ENGRAM_TRT_QGEMV_WAVES", 1);
    int const perSm = residentBlocks(kernel, shared);
    if (waves > 0 && perSm > 0 && smCount() > 0)
    {
        int64_t const cap = (static_cast<int64_t>(perSm) * smCount() * waves + numSlots - 1) / numSlots;
        gridX = gridX < cap ? gridX : cap;
    }
    gridX = gridX < 1 ? 1 : (gridX > INT32_MAX ? INT32_MAX : gridX);
    resetLaunchError();
    launchDependent(kernel, dim3(static_cast<unsigned>(gridX), static_cast<unsigned>(numSlots)), dim3(kQGemvThreads),
        static_cast<size_t>(shared), stream, p);
    return checkLaunch(fn);
}

extern "C" ENGRAM_API int engram_quant_gemv(void const* a, int32_t aType, int64_t lda, int32_t const* rowIndex,
    int64_t numRows, void const* w, int32_t wType, void const* wScale, int32_t scaleType, int32_t bn, int32_t bk,
    int64_t outFeatures, int64_t inFeatures, int32_t numExperts, int32_t const* offsets, int32_t const* slotExpert,
    int32_t numSlots, void* out, int32_t outType, int64_t ldo, int64_t oCol0, cudaStream_t stream)
{
    return engram_quant_gemv_ex(a, aType, lda, rowIndex, numRows, w, wType, wScale, scaleType, bn, bk, outFeatures,
        inFeatures, numExperts, offsets, slotExpert, numSlots, out, outType, ldo, oCol0, 0U, stream);
}
