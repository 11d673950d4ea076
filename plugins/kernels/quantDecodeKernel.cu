// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * A decode step's stored-format products in few launches (quantKernels.h states the
 * contracts; python/engram_trt/native/quant_decode.py binds them):
 *
 *   engram_quant_gemv_segments: up to 8 products of the step's 1-8 rows, FP8 / FP4 / BF16
 *     weights mixed, in one launch (the projections a DeepSeek-V4 layer applies to one
 *     input, or the groups of its grouped output projection); its _ex form takes the bf16
 *     GEMV's prologues (gemvPrologue.cuh: q_a_norm before q_b, the inverse RoPE before the
 *     grouped o_a), applied to each value as the block stages it, before its quantization
 *     (the norm's reciprocal RMS once a block per token, a warp per token, before staging);
 *   engram_quant_moe: the routed experts and the shared expert in two launches (gate / up
 *     with the clamped SwiGLU; down with the combine), where native/quant.py's experts()
 *     takes a plan, two grouped GEMVs, the SwiGLU, a third GEMV and the combine, and the
 *     shared expert three products and the element-wise ops between.
 *
 * Why: a decode step of a ~2B model reads ~1-2 MB per projection; at the HBM rate that is
 * a microsecond, so the step is bound by its launches (each ~5 us in a graph chain), not
 * by its bytes. The bf16 glue already groups its products (decodeGemvKernel.cu,
 * decodeMoeKernel.cu); these kernels do it for the stored formats, so FP8 / FP4 weights'
 * fewer bytes show in the step time.
 *
 * Layout (both kernels). A block of 4 warps; a warp owns 2 weight rows (gate and up rows
 * of 2 intermediate channels in the MoE's first launch: 4) and reads each row in 16-byte
 * vectors (lane j takes vectors j, j + 32, ...; U of them a row in flight, the next U
 * issued before this U's FMAs), streaming past the L1. The activation rows the block needs
 * are staged once per block in shared memory as float32, quantized on the way exactly as
 * engram_act_quant (quantGemvKernel.cu's stageQuantized: a group's amax over the lanes
 * holding it, s = max(amax, 1e-4) / 448, ue8m0 rounding up to a power of two, q =
 * e4m3(x * (1 / s)), deq = q * s), in the permuted layout of quantGemvKernel.cu (a warp's
 * read of one 16-byte chunk of each lane's vector is 512 consecutive bytes). Values past K
 * and rows past the step's are zeros.
 *
 * Sums (the bound the GPU tests hold the kernels to): per (weight row, activation row) a
 * lane's VPV products in one float32 FMA chain, times the block scale into the lane's
 * accumulator (one FMA), over its ceil(K / (32 VPV)) vectors; a 5-level warp butterfly.
 *
 * Launch: programmatic dependent launch (dependentLaunch.cuh). A segment's weights and the
 * shared expert's are a model's (static), so their first vectors are loaded before the
 * wait for the kernel before; routed experts wait first (their ids come from the router).
 */
#include "dependentLaunch.cuh"
#include "engramKernelsCore.h"
#include "engramKernelsInternal.h"
#include "gemvPrologue.cuh"
#include "quantDevice.cuh"
#include "quantInternal.h"
#include "quantKernels.h"
#include "vecLoad.cuh"

#include <cuda_bf16.h>

#include <climits>
#include <cstdint>
#include <cstdio>

namespace engram_trt
{
namespace kernels
{

namespace
{

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kRowsPerWarp = 2;
constexpr int kRowsPerBlock = kWarps * kRowsPerWarp;

template <int WT>
struct Vpv
{
    static constexpr int value = WT == ENGRAM_QWEIGHT_FP8_E4M3 ? 16 : (WT == ENGRAM_QWEIGHT_FP4_E2M1 ? 32 : 8);
};

//! Vectors a lane loads per row per step (R rows in flight: R * U 16-byte loads).
template <int WT, int R>
struct StepVectors
{
    static constexpr int value = WT == ENGRAM_QWEIGHT_FP4_E2M1 ? (R > 2 ? 1 : 2) : (R > 2 ? 2 : 4);
};

int vpvOf(int32_t wType)
{
    return wType == ENGRAM_QWEIGHT_FP8_E4M3 ? 16 : (wType == ENGRAM_QWEIGHT_FP4_E2M1 ? 32 : 8);
}

//! 16-byte float chunks of one staged row of K values for vectors of VPV values (K padded
//! to whole 32-vector groups).
int64_t chunksPerRow(int64_t k, int vpv)
{
    int64_t const vectors = k / vpv;
    return (vectors + 31) / 32 * 32 * (vpv / 4);
}

//! 4 consecutive activations as floats (float32 or bf16 by `bf16`; 8 / 16-byte aligned).
__device__ __forceinline__ float4 loadAct4(void const* a, int64_t i, bool bf16)
{
    if (bf16)
    {
        uint2 const raw = *reinterpret_cast<uint2 const*>(static_cast<__nv_bfloat16 const*>(a) + i);
        float2 const lo = __bfloat1622float2(*reinterpret_cast<__nv_bfloat162 const*>(&raw.x));
        float2 const hi = __bfloat1622float2(*reinterpret_cast<__nv_bfloat162 const*>(&raw.y));
        return make_float4(lo.x, lo.y, hi.x, hi.y);
    }
    return *reinterpret_cast<float4 const*>(static_cast<float const*>(a) + i);
}

//! The staged chunk holding values k .. k + 3 (k a multiple of 4) of a row (quantGemvKernel.cu's layout).
template <int VPV>
__device__ __forceinline__ int32_t stagedChunk(int32_t k)
{
    constexpr int CH = VPV / 4;
    int32_t const v = k / VPV;
    int32_t const c = (k % VPV) / 4;
    return ((v >> 5) * CH + c) * 32 + (v & 31);
}

//! One activation row to stage: `row` (NULL: zeros) of K values, bf16 or float32,
//! quantized per `group` columns (0: as given).
struct StageRow
{
    void const* row;
    int32_t bf16;
    int32_t k;
    int32_t group;
    int32_t ue8m0;
};

//! A row's 4 values at column kk (a multiple of 4) as floats, taken through the prologue
//! Pro first (a bf16 row; pro and r, the row's reciprocal RMS, read with kProNorm only):
//! the values engram_norm_rope would have written for token m, bit for bit.
template <int Pro>
__device__ __forceinline__ float4 loadRow4(
    StageRow const& src, int32_t kk, EngramGemvPrologue const* pro, float r, int32_t m)
{
    float4 const x = loadAct4(src.row, kk, src.bf16 != 0);
    if constexpr (Pro == kProNone)
    {
        return x;
    }
    else
    {
        float v[4] = {x.x, x.y, x.z, x.w};
        float w[4] = {};
        if constexpr (Pro == kProNorm)
        {
            float4 const w4 = __ldg(reinterpret_cast<float4 const*>(pro->weight + kk));
            w[0] = w4.x, w[1] = w4.y, w[2] = w4.z, w[3] = w4.w;
        }
        applyPrologue<Pro, 4>(v, w, *pro, r, m, kk);
        return make_float4(v[0], v[1], v[2], v[3]);
    }
}

/*
 * Stages one row into sRow (chunks of the layout for vectors of VPV values, cpr of them),
 * by the block's threads: plain, or quantized bit for bit as engram_act_quant's float32
 * deq (a group of G columns is G / 4 lanes of one warp, 4 values a lane); with a prologue
 * (Pro, token m of a bf16 row, r its reciprocal RMS for kProNorm) the values go through it
 * before either, as if engram_norm_rope had written them to a bf16 row first.
 */
template <int VPV, int Pro = kProNone>
__device__ __forceinline__ void stageRow(StageRow const& src, float4* sRow, int32_t cpr,
    EngramGemvPrologue const* pro = nullptr, float r = 1.0F, int32_t m = 0)
{
    int const lane = threadIdx.x & 31;
    int const warp = threadIdx.x >> 5;
    int const nWarps = blockDim.x >> 5;
    int32_t const k = src.k;
    if (src.row == nullptr || src.group == 0)
    {
        for (int32_t kk = 4 * static_cast<int32_t>(threadIdx.x); kk < k; kk += 4 * static_cast<int32_t>(blockDim.x))
        {
            sRow[stagedChunk<VPV>(kk)]
                = src.row != nullptr ? loadRow4<Pro>(src, kk, pro, r, m) : make_float4(0.F, 0.F, 0.F, 0.F);
        }
    }
    else
    {
        int32_t const group = src.group;
        int const lanesPerGroup = group / 4; // 32 or 8
        int const groupsPerWarp = 32 / lanesPerGroup;
        int32_t const groups = (k + group - 1) / group;
        int32_t const items = (groups + groupsPerWarp - 1) / groupsPerWarp;
        int const sub = lane / lanesPerGroup;
        int const part = lane % lanesPerGroup;
        for (int32_t it = warp; it < items; it += nWarps)
        {
            int32_t const gi = it * groupsPerWarp + sub;
            int32_t const kk = gi * group + 4 * part;
            bool const ok = gi < groups && kk < k;
            float4 x = make_float4(0.F, 0.F, 0.F, 0.F);
            if (ok)
            {
                x = loadRow4<Pro>(src, kk, pro, r, m);
            }
            float amax = fmaxf(fmaxf(fabsf(x.x), fabsf(x.y)), fmaxf(fabsf(x.z), fabsf(x.w)));
            for (int offset = lanesPerGroup / 2; offset > 0; offset >>= 1)
            {
                amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFU, amax, offset));
            }
            float s = __fdiv_rn(fmaxf(amax, kActAmaxFloor), kFp8Max);
            if (src.ue8m0 != 0)
            {
                s = pow2Ceil(s);
            }
            float const inv = __fdiv_rn(1.0F, s);
            float const in[4] = {x.x, x.y, x.z, x.w};
            float q[4];
#pragma unroll
            for (int i = 0; i < 4; ++i)
            {
                q[i] = __fmul_rn(e4m3ToFloat(floatToE4m3(__fmul_rn(in[i], inv))), s);
            }
            if (ok)
            {
                sRow[stagedChunk<VPV>(kk)] = make_float4(q[0], q[1], q[2], q[3]);
            }
        }
    }
    // the padding past K (whole 32-vector groups)
    for (int32_t kk = k + 4 * static_cast<int32_t>(threadIdx.x); kk < cpr * 4;
        kk += 4 * static_cast<int32_t>(blockDim.x))
    {
        sRow[stagedChunk<VPV>(kk)] = make_float4(0.F, 0.F, 0.F, 0.F);
    }
}

//! R weight rows a warp reads: each row's 16-byte vectors and its scale row.
template <int R>
struct WeightRows
{
    uint4 const* w[R];
    void const* s[R]; // the row's first scale (its block row), NULL for BF16
};

//! Where row n of a weight of `vectors` 16-byte vectors a row starts, with its scales.
__device__ __forceinline__ void weightRow(void const* base, void const* scale, int32_t n, int32_t vectors, int32_t bn,
    int32_t kBlocks, bool ue8m0, uint4 const*& w, void const*& s)
{
    w = static_cast<uint4 const*>(base) + static_cast<int64_t>(n) * vectors;
    s = nullptr;
    if (scale != nullptr)
    {
        int64_t const off = static_cast<int64_t>(n / bn) * kBlocks;
        s = ue8m0 ? static_cast<void const*>(static_cast<uint8_t const*>(scale) + off)
                  : static_cast<void const*>(static_cast<float const*>(scale) + off);
    }
}

//! One step's loads: U vectors (v0 + 32 u) of each row and their block scales (0 past the row).
template <int WT, int R, int U>
__device__ __forceinline__ void issueStep(WeightRows<R> const& rows, int32_t v0, int32_t vectors, int32_t vpb,
    bool ue8m0, uint4 (&wv)[R][U], float (&sv)[R][U])
{
#pragma unroll
    for (int u = 0; u < U; ++u)
    {
        int32_t const v = v0 + 32 * u;
        bool const ok = v < vectors;
        int32_t const kb = (ok ? v : 0) / vpb;
#pragma unroll
        for (int r = 0; r < R; ++r)
        {
            wv[r][u] = ok ? loadStreaming(rows.w[r] + v) : make_uint4(0, 0, 0, 0);
            if constexpr (WT != ENGRAM_QWEIGHT_BF16)
            {
                float s = 0.0F;
                if (ok)
                {
                    s = ue8m0 ? ue8m0ToFloatSelect(__ldg(static_cast<uint8_t const*>(rows.s[r]) + kb))
                              : __ldg(static_cast<float const*>(rows.s[r]) + kb);
                }
                sv[r][u] = WT == ENGRAM_QWEIGHT_FP4_E2M1 ? s * kE2m1DecodeScale : s;
            }
            else
            {
                sv[r][u] = 1.0F;
            }
        }
    }
}

/*
 * The R x MR dot products of a warp's R weight rows with MR staged rows (row m at
 * sAct + m * rowChunks), summed over the warp: every lane returns every sum. The first
 * step's loads (wv, sv) were issued by the caller (before its wait, for static weights).
 */
template <int WT, int R, int MR>
__device__ __forceinline__ void dotRows(WeightRows<R> const& rows, int32_t vectors, int32_t vpb, bool ue8m0,
    float4 const* sAct, int32_t rowChunks, uint4 (&wv)[R][StepVectors<WT, R>::value],
    float (&sv)[R][StepVectors<WT, R>::value], float (&acc)[R][MR])
{
    constexpr int VPV = Vpv<WT>::value;
    constexpr int U = StepVectors<WT, R>::value;
    constexpr int CH = VPV / 4;
    constexpr int C8 = VPV / 8;
    int const lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < R; ++r)
    {
#pragma unroll
        for (int m = 0; m < MR; ++m)
        {
            acc[r][m] = 0.0F;
        }
    }
    for (int32_t base = 0; base < vectors; base += 32 * U)
    {
        uint4 wc[R][U];
        float sc[R][U];
#pragma unroll
        for (int r = 0; r < R; ++r)
        {
#pragma unroll
            for (int u = 0; u < U; ++u)
            {
                wc[r][u] = wv[r][u];
                sc[r][u] = sv[r][u];
            }
        }
        if (base + 32 * U < vectors)
        {
            issueStep<WT, R, U>(rows, base + 32 * U + lane, vectors, vpb, ue8m0, wv, sv);
        }
#pragma unroll
        for (int u = 0; u < U; ++u)
        {
            int32_t const vg = base / 32 + u; // warp-uniform 32-vector group
            if (vg * 32 >= vectors)
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
                    decodeChunk<WT>(wc[r][u], c, wf[r]);
                }
#pragma unroll
                for (int m = 0; m < MR; ++m)
                {
                    float4 const* const at = sAct + m * rowChunks + (vg * CH + 2 * c) * 32 + lane;
                    float4 const lo = at[0];
                    float4 const hi = at[32];
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
#pragma unroll
                for (int m = 0; m < MR; ++m)
                {
                    if constexpr (WT != ENGRAM_QWEIGHT_BF16)
                    {
                        acc[r][m] = fmaf(part[r][m], sc[r][u], acc[r][m]);
                    }
                    else
                    {
                        acc[r][m] += part[r][m];
                    }
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
    {
#pragma unroll
        for (int m = 0; m < MR; ++m)
        {
            acc[r][m] = warpSum(acc[r][m]);
        }
    }
}

// ------------------------------------------------------------------------- segments
struct SegParams
{
    EngramQuantSegment seg[ENGRAM_QSEG_MAX_SEGMENTS];
    int32_t firstBlock[ENGRAM_QSEG_MAX_SEGMENTS + 1];
    int32_t rowChunks[ENGRAM_QSEG_MAX_SEGMENTS]; // staged chunks of one row of each segment
    EngramGemvPrologue pro;                      // kind NONE: none
    int32_t count;
    int32_t tokens;
    int32_t weightStatic;
};

template <int WT, int MR, int Pro>
__device__ __forceinline__ void segmentBody(SegParams const& p, int s, int32_t local, float4* sAct, float* sRms)
{
    constexpr int R = kRowsPerWarp;
    constexpr int U = StepVectors<WT, R>::value;
    constexpr int VPV = Vpv<WT>::value;
    EngramQuantSegment const& g = p.seg[s];
    int const lane = threadIdx.x & 31;
    int const warp = threadIdx.x >> 5;
    int32_t const vectors = g.in_features / VPV;
    int32_t const kBlocks = WT == ENGRAM_QWEIGHT_BF16 ? 0 : (g.in_features + g.bk - 1) / g.bk;
    int32_t const vpb = WT == ENGRAM_QWEIGHT_BF16 ? 1 : g.bk / VPV;
    bool const ue8m0 = g.scale_type == ENGRAM_QSCALE_UE8M0;
    int32_t const n0 = local * kRowsPerBlock + warp * R;
    WeightRows<R> rows;
#pragma unroll
    for (int r = 0; r < R; ++r)
    {
        int32_t const n = n0 + r < g.out_features ? n0 + r : g.out_features - 1;
        weightRow(g.w, WT == ENGRAM_QWEIGHT_BF16 ? nullptr : g.w_scale, n, vectors, g.bn, kBlocks, ue8m0, rows.w[r],
            rows.s[r]);
    }
    uint4 wv[R][U];
    float sv[R][U];
    bool const early = p.weightStatic != 0;
    if (early)
    {
        issueStep<WT, R, U>(rows, lane, vectors, vpb, ue8m0, wv, sv);
    }
    waitForPrimary(); // x (and out) may come from the kernel before
    allowDependents();
    if (!early)
    {
        issueStep<WT, R, U>(rows, lane, vectors, vpb, ue8m0, wv, sv);
    }
    if constexpr (Pro == kProNorm)
    {
        // each token's reciprocal RMS once a block (warp w: tokens w, w + 4), as engram_norm_rope sums it
        for (int m = warp; m < p.tokens; m += kWarps)
        {
            float const r
                = rowReciprocalRms(static_cast<__nv_bfloat16 const*>(g.x) + static_cast<int64_t>(m) * g.x_stride,
                    g.in_features, p.pro.eps, lane);
            if (lane == 0)
            {
                sRms[m] = r;
            }
        }
        __syncthreads();
    }
    int32_t const cpr = p.rowChunks[s];
    for (int m = 0; m < MR; ++m)
    {
        StageRow src{m < p.tokens ? static_cast<char const*>(g.x)
                    + static_cast<int64_t>(m) * g.x_stride * (g.x_type == ENGRAM_FLOAT_BF16 ? 2 : 4)
                                  : nullptr,
            g.x_type == ENGRAM_FLOAT_BF16 ? 1 : 0, g.in_features, g.act_group, g.act_ue8m0};
        float r = 1.0F;
        if constexpr (Pro == kProNorm)
        {
            r = m < p.tokens ? sRms[m] : 1.0F;
        }
        stageRow<VPV, Pro>(src, sAct + m * cpr, cpr, &p.pro, r, m);
    }
    __syncthreads();
    float acc[R][MR];
    dotRows<WT, R, MR>(rows, vectors, vpb, ue8m0, sAct, cpr, wv, sv, acc);
    // lane r * MR + m stores sum (r, m)
    float mine = 0.0F;
#pragma unroll
    for (int r = 0; r < R; ++r)
    {
#pragma unroll
        for (int m = 0; m < MR; ++m)
        {
            mine = lane == r * MR + m ? acc[r][m] : mine;
        }
    }
    int const r = lane / MR;
    int const m = lane % MR;
    int32_t const n = n0 + r;
    if (r < R && m < p.tokens && n < g.out_features)
    {
        storeFloatAs(g.out, g.out_type, static_cast<int64_t>(m) * g.out_stride + n, mine);
    }
}

template <int MR, int Pro>
__global__ void __launch_bounds__(kThreads) quantSegmentsKernel(SegParams const p)
{
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900 // no code for older GPUs (refused on the host)
    extern __shared__ float4 sAct[];
    __shared__ float sRms[Pro == kProNorm ? ENGRAM_QSEG_MAX_TOKENS : 1]; // the tokens' reciprocal RMS (kProNorm)
    int s = 0;
    auto const b = static_cast<int32_t>(blockIdx.x);
    while (s + 1 < p.count && b >= p.firstBlock[s + 1])
    {
        ++s;
    }
    int32_t const local = b - p.firstBlock[s];
    switch (p.seg[s].w_type)
    {
    case ENGRAM_QWEIGHT_FP8_E4M3: segmentBody<ENGRAM_QWEIGHT_FP8_E4M3, MR, Pro>(p, s, local, sAct, sRms); break;
    case ENGRAM_QWEIGHT_FP4_E2M1: segmentBody<ENGRAM_QWEIGHT_FP4_E2M1, MR, Pro>(p, s, local, sAct, sRms); break;
    default: segmentBody<ENGRAM_QWEIGHT_BF16, MR, Pro>(p, s, local, sAct, sRms); break;
    }
#endif
}

// ------------------------------------------------------------------------------ MoE
struct MoeParams
{
    EngramQuantMoe a;
    int64_t hStride;      // floats between two h rows of the workspace
    int32_t routedBlocks; // launch 1: T * k * ceil(I / 4) blocks, then the shared expert's
    int32_t rowChunksX;   // launch 1: staged chunks of x for the routed gate's vectors
    int32_t rowChunksXs;  // ... for the shared gate's
    int32_t rowChunksH;   // launch 2: staged chunks of a routed h row (down's vectors)
    int32_t rowChunksHs;  // ... of the shared h row
};

constexpr int kGateUpChannels = 2;                                // intermediate channels a warp (gate + up rows: 4)
constexpr int kGateUpChannelsPerBlock = kWarps * kGateUpChannels; // 8

//! Rows n0, n0 + 1 of gate then of up (an expert's: base offset e) as 4 weight rows.
template <int WT>
__device__ __forceinline__ void gateUpRows(EngramQuantMoeWeight const& gate, EngramQuantMoeWeight const& up, int64_t e,
    int32_t n0, int32_t nRows, int32_t k, WeightRows<4>& rows)
{
    constexpr int VPV = Vpv<WT>::value;
    int32_t const vectors = k / VPV;
    int32_t const kBlocks = WT == ENGRAM_QWEIGHT_BF16 ? 0 : (k + gate.bk - 1) / gate.bk;
    int64_t const expertVectors = static_cast<int64_t>(nRows) * vectors;
    int64_t const expertScales
        = WT == ENGRAM_QWEIGHT_BF16 ? 0 : static_cast<int64_t>((nRows + gate.bn - 1) / gate.bn) * kBlocks;
    bool const ue8m0 = gate.scale_type == ENGRAM_QSCALE_UE8M0;
    size_t const scaleBytes = ue8m0 ? 1 : 4;
#pragma unroll
    for (int r = 0; r < 4; ++r)
    {
        EngramQuantMoeWeight const& w = r < 2 ? gate : up;
        int32_t const n = n0 + (r & 1) < nRows ? n0 + (r & 1) : nRows - 1;
        void const* base = static_cast<uint4 const*>(w.w) + e * expertVectors;
        void const* scale = WT == ENGRAM_QWEIGHT_BF16
            ? nullptr
            : static_cast<void const*>(static_cast<uint8_t const*>(w.scale) + e * expertScales * scaleBytes);
        weightRow(base, scale, n, vectors, w.bn, kBlocks, ue8m0, rows.w[r], rows.s[r]);
    }
}

//! Launch 1 for one routed (token, pick): 8 intermediate channels of the block.
template <int WT>
__device__ __forceinline__ void routedGateUp(MoeParams const& p, int32_t job, int32_t chunk, float4* sAct)
{
    constexpr int U = StepVectors<WT, 4>::value;
    constexpr int VPV = Vpv<WT>::value;
    EngramQuantMoe const& a = p.a;
    int const lane = threadIdx.x & 31;
    int const warp = threadIdx.x >> 5;
    waitForPrimary(); // ids and x come from the kernels before
    allowDependents();
    int32_t const t = job / a.top_k;
    int32_t const e = a.ids[job];
    if (e < 0 || e >= a.num_experts)
    {
        return; // the whole block (launch 2 skips this pick)
    }
    int32_t const i0 = chunk * kGateUpChannelsPerBlock + warp * kGateUpChannels;
    WeightRows<4> rows;
    gateUpRows<WT>(a.gate, a.up, e, i0, a.intermediate, a.hidden, rows);
    int32_t const vectors = a.hidden / VPV;
    int32_t const vpb = WT == ENGRAM_QWEIGHT_BF16 ? 1 : a.gate.bk / VPV;
    bool const ue8m0 = a.gate.scale_type == ENGRAM_QSCALE_UE8M0;
    uint4 wv[4][U];
    float sv[4][U];
    issueStep<WT, 4, U>(rows, lane, vectors, vpb, ue8m0, wv, sv);
    StageRow const src{static_cast<__nv_bfloat16 const*>(a.x) + static_cast<int64_t>(t) * a.hidden, 1, a.hidden,
        a.gate.act_group, a.gate.act_ue8m0};
    stageRow<VPV>(src, sAct, p.rowChunksX);
    __syncthreads();
    float acc[4][1];
    dotRows<WT, 4, 1>(rows, vectors, vpb, ue8m0, sAct, p.rowChunksX, wv, sv, acc);
    if (lane < kGateUpChannels)
    {
        int32_t const i = i0 + lane;
        float g = lane == 0 ? acc[0][0] : acc[1][0];
        float u = lane == 0 ? acc[2][0] : acc[3][0];
        if (a.clamp != 0)
        {
            // engram_swiglu_act_quant's float32 SwiGLU (quantActKernel.cu)
            g = fminf(g, a.limit);
            u = fminf(fmaxf(u, -a.limit), a.limit);
        }
        if (i < a.intermediate)
        {
            a.workspace[static_cast<int64_t>(job + t) * p.hStride + i] = g / (1.0F + expf(-g)) * u;
        }
    }
}

//! torch's clamp of a bf16 value to [lo, hi] (NaN kept), rounded to bf16.
__device__ __forceinline__ float clampRound(float v, float lo, float hi)
{
    return isnan(v) ? v : roundBf16(fminf(fmaxf(v, lo), hi));
}

//! Launch 1 for the shared expert: 8 of its intermediate channels for all MR tokens.
template <int WT, int MR>
__device__ __forceinline__ void sharedGateUp(MoeParams const& p, int32_t chunk, float4* sAct)
{
    constexpr int U = StepVectors<WT, 4>::value;
    constexpr int VPV = Vpv<WT>::value;
    EngramQuantMoe const& a = p.a;
    int const lane = threadIdx.x & 31;
    int const warp = threadIdx.x >> 5;
    int32_t const i0 = chunk * kGateUpChannelsPerBlock + warp * kGateUpChannels;
    WeightRows<4> rows;
    gateUpRows<WT>(a.shared_gate, a.shared_up, 0, i0, a.shared_intermediate, a.hidden, rows);
    int32_t const vectors = a.hidden / VPV;
    int32_t const vpb = WT == ENGRAM_QWEIGHT_BF16 ? 1 : a.shared_gate.bk / VPV;
    bool const ue8m0 = a.shared_gate.scale_type == ENGRAM_QSCALE_UE8M0;
    uint4 wv[4][U];
    float sv[4][U];
    issueStep<WT, 4, U>(rows, lane, vectors, vpb, ue8m0, wv, sv); // a model's weights: before the wait
    waitForPrimary();
    allowDependents();
    for (int m = 0; m < MR; ++m)
    {
        StageRow const src{
            m < a.num_tokens ? static_cast<__nv_bfloat16 const*>(a.x) + static_cast<int64_t>(m) * a.hidden : nullptr, 1,
            a.hidden, a.shared_gate.act_group, a.shared_gate.act_ue8m0};
        stageRow<VPV>(src, sAct + m * p.rowChunksXs, p.rowChunksXs);
    }
    __syncthreads();
    float acc[4][MR];
    dotRows<WT, 4, MR>(rows, vectors, vpb, ue8m0, sAct, p.rowChunksXs, wv, sv, acc);
    // lane c * MR + m: channel i0 + c of token m
    float g = 0.0F;
    float u = 0.0F;
#pragma unroll
    for (int c = 0; c < kGateUpChannels; ++c)
    {
#pragma unroll
        for (int m = 0; m < MR; ++m)
        {
            bool const mine = lane == c * MR + m;
            g = mine ? acc[c][m] : g;
            u = mine ? acc[2 + c][m] : u;
        }
    }
    int const c = lane / MR;
    int const m = lane % MR;
    int32_t const i = i0 + c;
    if (c < kGateUpChannels && m < a.num_tokens && i < a.shared_intermediate)
    {
        // the products' bf16 outputs; F.silu(g.clamp(max=l)) * u.clamp(-l, l) in bf16
        g = roundBf16(g);
        u = roundBf16(u);
        if (a.clamp != 0)
        {
            g = clampRound(g, -INFINITY, a.limit);
            u = clampRound(u, -a.limit, a.limit);
        }
        float const silu = roundBf16(g / (1.0F + expf(-g)));
        a.workspace[(static_cast<int64_t>(m) * (a.top_k + 1) + a.top_k) * p.hStride + i]
            = roundBf16(__fmul_rn(silu, u));
    }
}

template <int MR>
__global__ void __launch_bounds__(kThreads) quantMoeGateUpKernel(MoeParams const p)
{
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900 // no code for older GPUs (refused on the host)
    extern __shared__ float4 sAct[];
    auto const b = static_cast<int32_t>(blockIdx.x);
    if (b < p.routedBlocks)
    {
        int32_t const chunks = (p.a.intermediate + kGateUpChannelsPerBlock - 1) / kGateUpChannelsPerBlock;
        int32_t const job = b / chunks;
        int32_t const chunk = b - job * chunks;
        switch (p.a.gate.w_type)
        {
        case ENGRAM_QWEIGHT_FP8_E4M3: routedGateUp<ENGRAM_QWEIGHT_FP8_E4M3>(p, job, chunk, sAct); break;
        case ENGRAM_QWEIGHT_FP4_E2M1: routedGateUp<ENGRAM_QWEIGHT_FP4_E2M1>(p, job, chunk, sAct); break;
        default: routedGateUp<ENGRAM_QWEIGHT_BF16>(p, job, chunk, sAct); break;
        }
        return;
    }
    int32_t const chunk = b - p.routedBlocks;
    switch (p.a.shared_gate.w_type)
    {
    case ENGRAM_QWEIGHT_FP8_E4M3: sharedGateUp<ENGRAM_QWEIGHT_FP8_E4M3, MR>(p, chunk, sAct); break;
    case ENGRAM_QWEIGHT_FP4_E2M1: sharedGateUp<ENGRAM_QWEIGHT_FP4_E2M1, MR>(p, chunk, sAct); break;
    default: sharedGateUp<ENGRAM_QWEIGHT_BF16, MR>(p, chunk, sAct); break;
    }
#endif
}

//! Launch 2's product of a warp's 2 output channels d0, d0 + 1 of weight w (expert e)
//! with the staged row at sRow: y[0], y[1] in every lane.
template <int WT>
__device__ __forceinline__ void downDot(EngramQuantMoeWeight const& w, int64_t e, int32_t d0, int32_t nRows, int32_t k,
    float4 const* sRow, int32_t cpr, float (&y)[2])
{
    constexpr int VPV = Vpv<WT>::value;
    constexpr int U = StepVectors<WT, 2>::value;
    int const lane = threadIdx.x & 31;
    int32_t const vectors = k / VPV;
    int32_t const kBlocks = WT == ENGRAM_QWEIGHT_BF16 ? 0 : (k + w.bk - 1) / w.bk;
    int32_t const vpb = WT == ENGRAM_QWEIGHT_BF16 ? 1 : w.bk / VPV;
    bool const ue8m0 = w.scale_type == ENGRAM_QSCALE_UE8M0;
    int64_t const expertVectors = static_cast<int64_t>(nRows) * vectors;
    int64_t const expertScales
        = WT == ENGRAM_QWEIGHT_BF16 ? 0 : static_cast<int64_t>((nRows + w.bn - 1) / w.bn) * kBlocks;
    void const* base = static_cast<uint4 const*>(w.w) + e * expertVectors;
    void const* scale = WT == ENGRAM_QWEIGHT_BF16
        ? nullptr
        : static_cast<void const*>(static_cast<uint8_t const*>(w.scale) + e * expertScales * (ue8m0 ? 1 : 4));
    WeightRows<2> rows;
#pragma unroll
    for (int r = 0; r < 2; ++r)
    {
        int32_t const n = d0 + r < nRows ? d0 + r : nRows - 1;
        weightRow(base, scale, n, vectors, w.bn, kBlocks, ue8m0, rows.w[r], rows.s[r]);
    }
    uint4 wv[2][U];
    float sv[2][U];
    issueStep<WT, 2, U>(rows, lane, vectors, vpb, ue8m0, wv, sv);
    float acc[2][1];
    dotRows<WT, 2, 1>(rows, vectors, vpb, ue8m0, sRow, cpr, wv, sv, acc);
    y[0] = acc[0][0];
    y[1] = acc[1][0];
}

template <int WT>
__device__ __forceinline__ void stageH(StageRow const& src, float4* sRow, int32_t cpr)
{
    stageRow<Vpv<WT>::value>(src, sRow, cpr);
}

__device__ __forceinline__ void stageHAny(int32_t wType, StageRow const& src, float4* sRow, int32_t cpr)
{
    switch (wType)
    {
    case ENGRAM_QWEIGHT_FP8_E4M3: stageH<ENGRAM_QWEIGHT_FP8_E4M3>(src, sRow, cpr); break;
    case ENGRAM_QWEIGHT_FP4_E2M1: stageH<ENGRAM_QWEIGHT_FP4_E2M1>(src, sRow, cpr); break;
    default: stageH<ENGRAM_QWEIGHT_BF16>(src, sRow, cpr); break;
    }
}

__device__ __forceinline__ void downDotAny(EngramQuantMoeWeight const& w, int64_t e, int32_t d0, int32_t nRows,
    int32_t k, float4 const* sRow, int32_t cpr, float (&y)[2])
{
    switch (w.w_type)
    {
    case ENGRAM_QWEIGHT_FP8_E4M3: downDot<ENGRAM_QWEIGHT_FP8_E4M3>(w, e, d0, nRows, k, sRow, cpr, y); break;
    case ENGRAM_QWEIGHT_FP4_E2M1: downDot<ENGRAM_QWEIGHT_FP4_E2M1>(w, e, d0, nRows, k, sRow, cpr, y); break;
    default: downDot<ENGRAM_QWEIGHT_BF16>(w, e, d0, nRows, k, sRow, cpr, y); break;
    }
}

/*
 * Launch 2: a warp per 2 output channels; per token the block stages its k + 1 h rows
 * quantized per the down weights, then each warp adds its picks' weighted outputs in pick
 * order and the shared expert's.
 */
__global__ void __launch_bounds__(kThreads) quantMoeDownKernel(MoeParams const p)
{
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900 // no code for older GPUs (refused on the host)
    extern __shared__ float4 sAct[];
    EngramQuantMoe const& a = p.a;
    int const lane = threadIdx.x & 31;
    int const warp = threadIdx.x >> 5;
    waitForPrimary(); // h comes from launch 1
    allowDependents();
    int32_t const d0 = static_cast<int32_t>(blockIdx.x) * kRowsPerBlock + warp * kRowsPerWarp;
    bool const shared = a.shared_intermediate > 0;
    float4* const sShared = sAct + static_cast<int64_t>(a.top_k) * p.rowChunksH;
    for (int64_t t = 0; t < a.num_tokens; ++t)
    {
        float const* const hToken = a.workspace + t * (a.top_k + 1) * p.hStride;
        for (int32_t j = 0; j < a.top_k; ++j)
        {
            int32_t const e = a.ids[t * a.top_k + j];
            bool const valid = e >= 0 && e < a.num_experts;
            StageRow const src{
                valid ? hToken + j * p.hStride : nullptr, 0, a.intermediate, a.down.act_group, a.down.act_ue8m0};
            stageHAny(a.down.w_type, src, sAct + static_cast<int64_t>(j) * p.rowChunksH, p.rowChunksH);
        }
        if (shared)
        {
            StageRow const src{hToken + static_cast<int64_t>(a.top_k) * p.hStride, 0, a.shared_intermediate,
                a.shared_down.act_group, a.shared_down.act_ue8m0};
            stageHAny(a.shared_down.w_type, src, sShared, p.rowChunksHs);
        }
        __syncthreads();
        float routed[2] = {0.0F, 0.0F};
        for (int32_t j = 0; j < a.top_k; ++j)
        {
            int32_t const e = a.ids[t * a.top_k + j];
            if (e < 0 || e >= a.num_experts)
            {
                continue; // adds nothing (warp-uniform)
            }
            float y[2];
            downDotAny(a.down, e, d0, a.hidden, a.intermediate, sAct + static_cast<int64_t>(j) * p.rowChunksH,
                p.rowChunksH, y);
            float const w = a.route_w[t * a.top_k + j];
            routed[0] = __fadd_rn(routed[0], __fmul_rn(y[0], w));
            routed[1] = __fadd_rn(routed[1], __fmul_rn(y[1], w));
        }
        float out[2] = {roundBf16(routed[0]), roundBf16(routed[1])};
        if (shared)
        {
            float y[2];
            downDotAny(a.shared_down, 0, d0, a.hidden, a.shared_intermediate, sShared, p.rowChunksHs, y);
            out[0] = __fadd_rn(out[0], roundBf16(y[0]));
            out[1] = __fadd_rn(out[1], roundBf16(y[1]));
        }
        if (lane < kRowsPerWarp && d0 + lane < a.hidden)
        {
            static_cast<__nv_bfloat16*>(a.out)[t * a.hidden + d0 + lane]
                = __float2bfloat16_rn(lane == 0 ? out[0] : out[1]);
        }
        __syncthreads(); // the next token restages
    }
#endif
}

//! Sets a kernel's dynamic shared memory opt-in when it needs more than the default 48 KiB.
template <typename Kernel>
int allowShared(Kernel kernel, int64_t bytes, char const* fn)
{
    int const optin = maxSharedPerBlockOptin();
    if (bytes > (optin > 0 ? optin - 64 : 48 * 1024))
    {
        return fail(cudaErrorNotSupported,
            "%s: the staged activations take %lld bytes of shared memory, more than this GPU gives a block (%d)", fn,
            ll(bytes), optin);
    }
    if (bytes > 48 * 1024
        && cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes))
            != cudaSuccess)
    {
        return failCuda(cudaGetLastError(), "%s: cudaFuncSetAttribute(max dynamic shared memory %lld)", fn, ll(bytes));
    }
    return 0;
}

//! The checks of one weight of the experts' call: type, pointers, blocks, act quantization.
int checkMoeWeight(char const* fn, char const* name, EngramQuantMoeWeight const& w, int32_t k)
{
    if (w.w_type != ENGRAM_QWEIGHT_FP8_E4M3 && w.w_type != ENGRAM_QWEIGHT_FP4_E2M1 && w.w_type != ENGRAM_QWEIGHT_BF16)
    {
        return fail(cudaErrorInvalidValue, "%s: %s.w_type %d is not FP8 (0), FP4 (1) or BF16 (2)", fn, name, w.w_type);
    }
    int const vpv = vpvOf(w.w_type);
    if (w.w == nullptr || !isAligned(w.w, 16))
    {
        return fail(cudaErrorInvalidValue, "%s: %s.w must be a 16-byte aligned device pointer", fn, name);
    }
    if (k % vpv != 0)
    {
        return fail(cudaErrorInvalidValue, "%s: %s's in_features %d must be a multiple of %d (16-byte vectors)", fn,
            name, k, vpv);
    }
    if (w.w_type != ENGRAM_QWEIGHT_BF16
        && (w.scale == nullptr || w.bn < 1 || w.bk < vpv || w.bk % vpv != 0
            || (w.scale_type != ENGRAM_QSCALE_F32 && w.scale_type != ENGRAM_QSCALE_UE8M0)
            || (w.scale_type == ENGRAM_QSCALE_F32 && !isAligned(w.scale, 4))))
    {
        return fail(cudaErrorInvalidValue,
            "%s: %s needs scales (float32 4-byte aligned or ue8m0), bn >= 1 and bk a multiple of %d (got bn %d, bk "
            "%d, scale_type %d)",
            fn, name, vpv, w.bn, w.bk, w.scale_type);
    }
    if ((w.act_group != 0 && w.act_group != 32 && w.act_group != 128) || (w.act_group == 0 && w.act_ue8m0 != 0))
    {
        return fail(cudaErrorInvalidValue, "%s: %s.act_group must be 0, 32 or 128 (got %d, act_ue8m0 %d)", fn, name,
            w.act_group, w.act_ue8m0);
    }
    return 0;
}

/*
 * The prologue's checks (checkGemvPrologue, shared with engram_gemv_segments_bf16_ex) and
 * this kernel's own: a prologue takes bf16 x (what engram_norm_rope would have read).
 */
int checkSegmentsPrologue(
    char const* fn, EngramGemvPrologue const& pro, EngramQuantSegment const* segments, int32_t numSegments)
{
    int32_t inFeatures[ENGRAM_QSEG_MAX_SEGMENTS] = {};
    for (int32_t i = 0; i < numSegments; ++i)
    {
        inFeatures[i] = segments[i].in_features;
    }
    if (int const status = checkGemvPrologue(fn, pro, numSegments, inFeatures))
    {
        return status;
    }
    for (int32_t i = 0; i < numSegments && pro.kind != ENGRAM_GEMV_PROLOGUE_NONE; ++i)
    {
        if (segments[i].x_type != ENGRAM_FLOAT_BF16)
        {
            return fail(cudaErrorInvalidValue, "%s: segment %d: a prologue takes bf16 x (x_type 0; got %d)", fn, i,
                segments[i].x_type);
        }
    }
    return 0;
}

//! The segments kernel for MR staged rows (1, 2, 4 or 8) and the prologue Pro.
template <int Pro>
auto segmentsKernel(int mr) -> void (*)(SegParams)
{
    switch (mr)
    {
    case 1: return quantSegmentsKernel<1, Pro>;
    case 2: return quantSegmentsKernel<2, Pro>;
    case 4: return quantSegmentsKernel<4, Pro>;
    default: return quantSegmentsKernel<8, Pro>;
    }
}

//! engram_quant_gemv_segments(_ex) for the entry point fn (its name in the errors).
int quantGemvSegments(char const* fn, EngramQuantSegment const* segments, int32_t numSegments, int64_t numTokens,
    uint32_t flags, EngramGemvPrologue const* prologue, cudaStream_t stream)
{
    if (segments == nullptr || numSegments < 1 || numSegments > ENGRAM_QSEG_MAX_SEGMENTS)
    {
        return fail(cudaErrorInvalidValue, "%s: need 1 <= num_segments <= %d (got %d)", fn, ENGRAM_QSEG_MAX_SEGMENTS,
            numSegments);
    }
    if (numTokens < 0 || numTokens > ENGRAM_QSEG_MAX_TOKENS)
    {
        return fail(cudaErrorInvalidValue, "%s: num_tokens must be in [0, %d] (got %lld)", fn, ENGRAM_QSEG_MAX_TOKENS,
            ll(numTokens));
    }
    if ((flags & ~static_cast<uint32_t>(ENGRAM_QGEMV_WEIGHT_STATIC)) != 0)
    {
        return fail(cudaErrorInvalidValue, "%s: unknown flags 0x%x (the one flag is ENGRAM_QGEMV_WEIGHT_STATIC 0x%x)",
            fn, flags, static_cast<unsigned>(ENGRAM_QGEMV_WEIGHT_STATIC));
    }
    SegParams p{};
    p.count = numSegments;
    p.tokens = static_cast<int32_t>(numTokens);
    p.weightStatic = (flags & ENGRAM_QGEMV_WEIGHT_STATIC) != 0 ? 1 : 0;
    int64_t blocks = 0;
    int64_t mostChunks = 0;
    for (int32_t i = 0; i < numSegments; ++i)
    {
        EngramQuantSegment const& g = segments[i];
        if (g.w_type != ENGRAM_QWEIGHT_FP8_E4M3 && g.w_type != ENGRAM_QWEIGHT_FP4_E2M1
            && g.w_type != ENGRAM_QWEIGHT_BF16)
        {
            return fail(cudaErrorInvalidValue, "%s: segment %d: w_type %d is not FP8 (0), FP4 (1) or BF16 (2)", fn, i,
                g.w_type);
        }
        int const vpv = vpvOf(g.w_type);
        if (g.out_features < 1 || g.in_features < vpv || g.in_features % vpv != 0)
        {
            return fail(cudaErrorInvalidValue,
                "%s: segment %d: need out_features >= 1 and in_features a positive multiple of %d (got %d, %d)", fn, i,
                vpv, g.out_features, g.in_features);
        }
        if (g.x_type != ENGRAM_FLOAT_BF16 && g.x_type != ENGRAM_FLOAT_F32)
        {
            return fail(cudaErrorInvalidValue, "%s: segment %d: x_type must be bf16 (0) or float32 (1) (got %d)", fn, i,
                g.x_type);
        }
        if (g.out_type != ENGRAM_FLOAT_BF16 && g.out_type != ENGRAM_FLOAT_F32 && g.out_type != ENGRAM_FLOAT_F16)
        {
            return fail(cudaErrorInvalidValue, "%s: segment %d: out_type %d is not bf16, float32 or float16", fn, i,
                g.out_type);
        }
        int64_t const xAlign = g.x_type == ENGRAM_FLOAT_BF16 ? 8 : 4;
        if (g.x_stride < g.in_features || g.x_stride % xAlign != 0 || g.out_stride < g.out_features)
        {
            return fail(cudaErrorInvalidValue,
                "%s: segment %d: x_stride must be >= in_features and a multiple of %lld (16 bytes), out_stride >= "
                "out_features (got %lld, %lld)",
                fn, i, ll(xAlign), ll(g.x_stride), ll(g.out_stride));
        }
        if (g.act_group != 0 && g.act_group != 32 && g.act_group != 128)
        {
            return fail(
                cudaErrorInvalidValue, "%s: segment %d: act_group must be 0, 32 or 128 (got %d)", fn, i, g.act_group);
        }
        EngramQuantMoeWeight const w{g.w, g.w_scale, g.w_type, g.scale_type, g.bn, g.bk, g.act_group, g.act_ue8m0};
        char name[32];
        std::snprintf(name, sizeof(name), "segment %d", i);
        if (int const status = checkMoeWeight(fn, name, w, g.in_features))
        {
            return status;
        }
        if (numTokens > 0 && (g.x == nullptr || g.out == nullptr || !isAligned(g.x, 16)))
        {
            return fail(cudaErrorInvalidValue,
                "%s: segment %d: x must be a 16-byte aligned device pointer, out a "
                "device pointer",
                fn, i);
        }
        p.seg[i] = g;
        p.firstBlock[i] = static_cast<int32_t>(blocks);
        blocks += (g.out_features + kRowsPerBlock - 1) / kRowsPerBlock;
        int64_t const cpr = chunksPerRow(g.in_features, vpv);
        p.rowChunks[i] = static_cast<int32_t>(cpr);
        mostChunks = cpr > mostChunks ? cpr : mostChunks;
        if (blocks > INT32_MAX / 2 || cpr > INT32_MAX / 64)
        {
            return fail(cudaErrorInvalidValue, "%s: segment %d is too large", fn, i);
        }
    }
    p.firstBlock[numSegments] = static_cast<int32_t>(blocks);
    p.pro = prologue != nullptr ? *prologue : EngramGemvPrologue{};
    if (int const status = checkSegmentsPrologue(fn, p.pro, segments, numSegments))
    {
        return status;
    }
    if (numTokens == 0)
    {
        return 0;
    }
    int const major = computeCapabilityMajor();
    if (major >= 0 && major < 9)
    {
        return fail(cudaErrorNotSupported,
            "%s: needs a GPU of compute capability 9.0 or later (this one is %d.x); use native.quant's kernels", fn,
            major);
    }
    int const mr = numTokens <= 1 ? 1 : (numTokens <= 2 ? 2 : (numTokens <= 4 ? 4 : 8));
    int64_t const shared = mostChunks * 16 * mr;
    void (*kernel)(SegParams) = nullptr;
    switch (p.pro.kind)
    {
    case ENGRAM_GEMV_PROLOGUE_RMSNORM: kernel = segmentsKernel<kProNorm>(mr); break;
    case ENGRAM_GEMV_PROLOGUE_ROPE: kernel = segmentsKernel<kProRope>(mr); break;
    default: kernel = segmentsKernel<kProNone>(mr); break;
    }
    if (int const status = allowShared(kernel, shared, fn))
    {
        return status;
    }
    resetLaunchError();
    launchDependent(
        kernel, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), static_cast<size_t>(shared), stream, p);
    return checkLaunch(fn);
}

} // namespace

} // namespace kernels
} // namespace engram_trt

using namespace engram_trt::kernels;

extern "C" ENGRAM_API int engram_quant_gemv_segments(
    EngramQuantSegment const* segments, int32_t numSegments, int64_t numTokens, uint32_t flags, cudaStream_t stream)
{
    clearError();
    return quantGemvSegments("engram_quant_gemv_segments", segments, numSegments, numTokens, flags, nullptr, stream);
}

extern "C" ENGRAM_API int engram_quant_gemv_segments_ex(EngramQuantSegment const* segments, int32_t numSegments,
    int64_t numTokens, uint32_t flags, EngramGemvPrologue const* prologue, cudaStream_t stream)
{
    clearError();
    return quantGemvSegments(
        "engram_quant_gemv_segments_ex", segments, numSegments, numTokens, flags, prologue, stream);
}

extern "C" ENGRAM_API int engram_quant_moe_workspace_size(
    int64_t numTokens, int32_t topK, int32_t intermediate, int32_t sharedIntermediate, size_t* bytes)
{
    clearError();
    if (bytes == nullptr || numTokens < 0 || numTokens > ENGRAM_QSEG_MAX_TOKENS || topK < 1 || topK > 16
        || intermediate < 1 || sharedIntermediate < 0)
    {
        return fail(cudaErrorInvalidValue,
            "engram_quant_moe_workspace_size: need bytes != NULL, 0 <= num_tokens <= %d, 1 <= top_k <= 16, "
            "intermediate >= 1 and shared_intermediate >= 0 (got %lld, %d, %d, %d)",
            ENGRAM_QSEG_MAX_TOKENS, ll(numTokens), topK, intermediate, sharedIntermediate);
    }
    int64_t const widest = intermediate > sharedIntermediate ? intermediate : sharedIntermediate;
    int64_t const stride = (widest + 3) / 4 * 4;
    *bytes = static_cast<size_t>(numTokens * (topK + 1) * stride * 4);
    return 0;
}

extern "C" ENGRAM_API int engram_quant_moe(EngramQuantMoe const* args, cudaStream_t stream)
{
    clearError();
    char const* const fn = "engram_quant_moe";
    if (args == nullptr)
    {
        return fail(cudaErrorInvalidValue, "%s: args must not be NULL", fn);
    }
    EngramQuantMoe const a = *args;
    size_t need = 0;
    if (int const status
        = engram_quant_moe_workspace_size(a.num_tokens, a.top_k, a.intermediate, a.shared_intermediate, &need))
    {
        return status;
    }
    if (a.hidden < 1 || a.num_experts < 1 || a.num_experts > 4096)
    {
        return fail(cudaErrorInvalidValue, "%s: need hidden >= 1 and 1 <= num_experts <= 4096 (got %d, %d)", fn,
            a.hidden, a.num_experts);
    }
    if (a.clamp != 0 && !(a.limit >= 0.0F))
    {
        return fail(cudaErrorInvalidValue, "%s: limit must be >= 0 when clamp is set (got %g)", fn,
            static_cast<double>(a.limit));
    }
    struct Named
    {
        char const* name;
        EngramQuantMoeWeight const* w;
        int32_t k;
    };
    bool const shared = a.shared_intermediate > 0;
    Named const weights[] = {{"gate", &a.gate, a.hidden}, {"up", &a.up, a.hidden}, {"down", &a.down, a.intermediate},
        {"shared_gate", &a.shared_gate, a.hidden}, {"shared_up", &a.shared_up, a.hidden},
        {"shared_down", &a.shared_down, a.shared_intermediate}};
    for (int i = 0; i < (shared ? 6 : 3); ++i)
    {
        if (int const status = checkMoeWeight(fn, weights[i].name, *weights[i].w, weights[i].k))
        {
            return status;
        }
    }
    auto const sameKind = [](EngramQuantMoeWeight const& g, EngramQuantMoeWeight const& u) {
        return g.w_type == u.w_type && g.scale_type == u.scale_type && g.bn == u.bn && g.bk == u.bk
            && g.act_group == u.act_group && g.act_ue8m0 == u.act_ue8m0;
    };
    if (!sameKind(a.gate, a.up) || (shared && !sameKind(a.shared_gate, a.shared_up)))
    {
        return fail(cudaErrorInvalidValue,
            "%s: gate and up (and shared_gate and shared_up) must share a weight type, scales, blocks and act "
            "quantization",
            fn);
    }
    if (a.workspace_bytes < static_cast<int64_t>(need))
    {
        return fail(cudaErrorInvalidValue, "%s: workspace holds %lld bytes, %llu needed", fn, ll(a.workspace_bytes),
            static_cast<unsigned long long>(need));
    }
    if (a.num_tokens == 0)
    {
        return 0;
    }
    int const major = computeCapabilityMajor();
    if (major >= 0 && major < 9)
    {
        return fail(cudaErrorNotSupported,
            "%s: needs a GPU of compute capability 9.0 or later (this one is %d.x); use native.quant's kernels", fn,
            major);
    }
    if (a.x == nullptr || !isAligned(a.x, 16) || a.ids == nullptr || a.route_w == nullptr || a.out == nullptr
        || a.workspace == nullptr || !isAligned(a.workspace, 16) || !isAligned(a.out, 2))
    {
        return fail(cudaErrorInvalidValue,
            "%s: x and workspace must be 16-byte aligned device pointers; ids, route_w and out device pointers", fn);
    }
    if (a.hidden % 8 != 0)
    {
        return fail(cudaErrorInvalidValue, "%s: hidden must be a multiple of 8 (got %d)", fn, a.hidden);
    }
    MoeParams p{};
    p.a = a;
    int64_t const widest = a.intermediate > a.shared_intermediate ? a.intermediate : a.shared_intermediate;
    p.hStride = (widest + 3) / 4 * 4;
    int64_t const chunks = (a.intermediate + kGateUpChannelsPerBlock - 1) / kGateUpChannelsPerBlock;
    int64_t const routedBlocks = a.num_tokens * a.top_k * chunks;
    int64_t const sharedBlocks
        = shared ? (a.shared_intermediate + kGateUpChannelsPerBlock - 1) / kGateUpChannelsPerBlock : 0;
    p.routedBlocks = static_cast<int32_t>(routedBlocks);
    p.rowChunksX = static_cast<int32_t>(chunksPerRow(a.hidden, vpvOf(a.gate.w_type)));
    p.rowChunksXs = shared ? static_cast<int32_t>(chunksPerRow(a.hidden, vpvOf(a.shared_gate.w_type))) : 0;
    p.rowChunksH = static_cast<int32_t>(chunksPerRow(a.intermediate, vpvOf(a.down.w_type)));
    p.rowChunksHs = shared ? static_cast<int32_t>(chunksPerRow(a.shared_intermediate, vpvOf(a.shared_down.w_type))) : 0;
    int const mr = a.num_tokens <= 1 ? 1 : (a.num_tokens <= 2 ? 2 : (a.num_tokens <= 4 ? 4 : 8));
    int64_t const shared1 = 16 * (p.rowChunksX > mr * p.rowChunksXs ? p.rowChunksX : mr * int64_t{p.rowChunksXs});
    int64_t const shared2 = 16 * (static_cast<int64_t>(a.top_k) * p.rowChunksH + p.rowChunksHs);
    void (*gateUp)(MoeParams) = nullptr;
    switch (mr)
    {
    case 1: gateUp = quantMoeGateUpKernel<1>; break;
    case 2: gateUp = quantMoeGateUpKernel<2>; break;
    case 4: gateUp = quantMoeGateUpKernel<4>; break;
    default: gateUp = quantMoeGateUpKernel<8>; break;
    }
    if (int const status = allowShared(gateUp, shared1, fn))
    {
        return status;
    }
    if (int const status = allowShared(quantMoeDownKernel, shared2, fn))
    {
        return status;
    }
    resetLaunchError();
    launchDependent(gateUp, dim3(static_cast<unsigned>(routedBlocks + sharedBlocks)), dim3(kThreads),
        static_cast<size_t>(shared1), stream, p);
    if (int const status = checkLaunch("engram_quant_moe (gate / up)"))
    {
        return status;
    }
    resetLaunchError();
    launchDependent(quantMoeDownKernel, dim3(static_cast<unsigned>((a.hidden + kRowsPerBlock - 1) / kRowsPerBlock)),
        dim3(kThreads), static_cast<size_t>(shared2), stream, p);
    return checkLaunch("engram_quant_moe (down)");
}
