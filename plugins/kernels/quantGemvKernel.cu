// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * engram_quant_gemv: a decode step's products with weights in their stored format (FP8
 * e4m3 with block scales, FP4 e2m1 with block scales, BF16), for one weight or the routed
 * experts of a MoE step (quantKernels.h states the contract).
 *
 * Why: a decode step reads every weight byte once per token batch, so the stored FP8 /
 * FP4 bytes are both the memory and the time saved; nothing dequantized is written.
 *
 * Layout (as gemvKernel.cu): a warp owns R rows of W (R = 1, or 2 for 4+ rows of one
 * weight, where the activation loads through L1 would otherwise outweigh the weight's
 * HBM bytes); its lanes read each row in 16-byte vectors (lane j takes vectors j, j + 32,
 * ...), U = 4 / R vectors a lane per row per pass (2 / R for MR = 8), all issued before the first FMA, with
 * an L1-bypassing streaming load (read once). A vector holds 16 (FP8), 32 (FP4) or 8
 * (BF16) consecutive values of one scale block (bk is a multiple of the vector's values),
 * so each vector's dot product with up to MR activation rows is summed in float32 apart
 * and added times the block's scale (FP4's decode yields 2^-14 times the values: the
 * scale carries the 2^14). Activations (float32 or bf16, small) come through L1 with
 * __ldg. A butterfly over the warp finishes each sum; lane 0 writes it in out_type.
 *
 * Experts: blockIdx.y is a slot of engram_moe_plan's slot_expert (a slot of -1 exits);
 * its expert's rows offsets[e] .. offsets[e+1]-1 are taken MR at a time, each row p
 * reading activation row row_index[p]. MR is the smallest power of two >= min(8, rows per
 * slot): P for one weight, ceil(P / num_slots) for experts (the host knows no expert's
 * count without a synchronization; a decode step's experts mostly have one or two rows,
 * and an MR of 8 would cost them registers).
 */
#include "engramKernels.h"
#include "engramKernelsInternal.h"
#include "quantDevice.cuh"
#include "quantInternal.h"
#include "vecLoad.cuh"

#include <cuda_bf16.h>

#include <climits>
#include <cstdint>

namespace engram_trt
{
namespace kernels
{

namespace
{

constexpr int kQGemvThreads = 128;
constexpr int kQGemvWarps = kQGemvThreads / 32;

struct QGemvParams
{
    void const* a;
    int64_t lda;
    int32_t const* rowIndex;
    int64_t rows;
    uint8_t const* w;
    void const* scale;
    int32_t ue8m0;
    int32_t bn;
    int32_t bk;
    int32_t n;
    int32_t k;
    int32_t kBlocks;
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

//! 16 bytes of W, read once: skip the L1 (ld.global.nc.L1::no_allocate).
__device__ __forceinline__ uint4 loadWeightVector(uint4 const* p)
{
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

//! 8 consecutive activations as floats, through L1 (p 16-byte aligned).
__device__ __forceinline__ void loadAct8(float const* p, float (&v)[8])
{
    float4 const a = __ldg(reinterpret_cast<float4 const*>(p));
    float4 const b = __ldg(reinterpret_cast<float4 const*>(p) + 1);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
    v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

__device__ __forceinline__ void loadAct8(__nv_bfloat16 const* p, float (&v)[8])
{
    unpack8Pairs<__nv_bfloat162>(__ldg(reinterpret_cast<uint4 const*>(p)), v);
}

//! Values of one 16-byte vector of weight type WT.
template <int WT>
struct VectorValues
{
    static constexpr int value = WT == ENGRAM_QWEIGHT_FP8_E4M3 ? 16 : (WT == ENGRAM_QWEIGHT_FP4_E2M1 ? 32 : 8);
};

/*
 * Chunk c (8 consecutive values) of a weight vector as floats: FP8 bytes 8c .. 8c + 7;
 * FP4 word c (times 2^-14); BF16 the vector itself (c = 0).
 */
template <int WT>
__device__ __forceinline__ void decodeChunk(uint4 const& vec, int c, float (&wf)[8])
{
    uint32_t const words[4] = {vec.x, vec.y, vec.z, vec.w};
    if constexpr (WT == ENGRAM_QWEIGHT_FP8_E4M3)
    {
        e4m3x4ToFloat(words[2 * c], wf);
        e4m3x4ToFloat(words[2 * c + 1], wf + 4);
    }
    else if constexpr (WT == ENGRAM_QWEIGHT_FP4_E2M1)
    {
        e2m1x8ToFloatScaled(words[c], wf);
    }
    else
    {
        unpack8Pairs<__nv_bfloat162>(vec, wf);
    }
}

template <int WT, typename AT, int MR, int R>
__global__ void __launch_bounds__(kQGemvThreads) quantGemvKernel(QGemvParams const p)
{
    constexpr int VPV = VectorValues<WT>::value;
    constexpr int CHUNKS = VPV / 8;
    constexpr int U = (MR >= 8 ? 2 : 4) / R; // vectors a lane loads per row and pass
    int const lane = threadIdx.x & 31;
    int const warp = threadIdx.x >> 5;
    int64_t const row0 = (static_cast<int64_t>(blockIdx.x) * kQGemvWarps + warp) * R;
    if (row0 >= p.n)
    {
        return;
    }
    int32_t e = 0;
    int64_t pBegin = 0;
    int64_t pEnd = p.rows;
    if (p.experts > 1)
    {
        e = __ldg(p.slotExpert + blockIdx.y);
        if (e < 0 || e >= p.experts)
        {
            return;
        }
        pBegin = __ldg(p.offsets + e);
        pEnd = __ldg(p.offsets + e + 1);
        pEnd = pEnd < p.rows ? pEnd : p.rows;
    }
    int32_t const vectors = p.k / VPV;
    int64_t const rowBytes = static_cast<int64_t>(vectors) * 16;
    uint4 const* wrow[R];
    int64_t scaleRow[R];
#pragma unroll
    for (int r = 0; r < R; ++r)
    {
        int64_t const n = row0 + r < p.n ? row0 + r : row0; // a row past N reads row0 again and is not written
        wrow[r] = reinterpret_cast<uint4 const*>(p.w + e * p.expertBytes + n * rowBytes);
        scaleRow[r] = e * p.expertScales + (n / p.bn) * p.kBlocks;
    }
    AT const* const a = static_cast<AT const*>(p.a);
    for (int64_t p0 = pBegin; p0 < pEnd; p0 += MR)
    {
        int const mc = pEnd - p0 < MR ? static_cast<int>(pEnd - p0) : MR;
        AT const* arow[MR];
#pragma unroll
        for (int m = 0; m < MR; ++m)
        {
            int64_t const pr = p0 + (m < mc ? m : 0);
            int64_t const src = p.rowIndex != nullptr ? __ldg(p.rowIndex + pr) : pr;
            arow[m] = a + src * p.lda;
        }
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
                    wr[r][u] = v < vectors ? loadWeightVector(wrow[r] + v) : make_uint4(0, 0, 0, 0);
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
                int64_t const k0 = static_cast<int64_t>(v) * VPV;
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
                for (int c = 0; c < CHUNKS; ++c)
                {
                    float wf[R][8];
#pragma unroll
                    for (int r = 0; r < R; ++r)
                    {
                        decodeChunk<WT>(wr[r][u], c, wf[r]);
                    }
#pragma unroll
                    for (int m = 0; m < MR; ++m)
                    {
                        if (m < mc)
                        {
                            float af[8];
                            loadAct8(arow[m] + k0 + 8 * c, af);
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
                }
                if constexpr (WT == ENGRAM_QWEIGHT_BF16)
                {
#pragma unroll
                    for (int r = 0; r < R; ++r)
                    {
#pragma unroll
                        for (int m = 0; m < MR; ++m)
                        {
                            acc[r][m] += part[r][m];
                        }
                    }
                }
                else
                {
                    int64_t const kb = k0 / p.bk;
#pragma unroll
                    for (int r = 0; r < R; ++r)
                    {
                        float s = loadScale(p.scale, scaleRow[r] + kb, p.ue8m0 != 0);
                        if constexpr (WT == ENGRAM_QWEIGHT_FP4_E2M1)
                        {
                            s *= kE2m1HalfScale;
                        }
#pragma unroll
                        for (int m = 0; m < MR; ++m)
                        {
                            acc[r][m] = fmaf(part[r][m], s, acc[r][m]);
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
        if (lane == 0)
        {
#pragma unroll
            for (int r = 0; r < R; ++r)
            {
#pragma unroll
                for (int m = 0; m < MR; ++m)
                {
                    if (m < mc && row0 + r < p.n)
                    {
                        storeFloatAs(p.out, p.outType, (p0 + m) * p.ldo + p.oCol0 + row0 + r, acc[r][m]);
                    }
                }
            }
        }
    }
}

template <int WT, typename AT, int MR, int R>
void launchQGemvShape(QGemvParams const& p, unsigned slots, cudaStream_t stream)
{
    int64_t const rowsPerBlock = static_cast<int64_t>(kQGemvWarps) * R;
    auto const blocks = static_cast<unsigned>((p.n + rowsPerBlock - 1) / rowsPerBlock);
    quantGemvKernel<WT, AT, MR, R><<<dim3(blocks, slots), kQGemvThreads, 0, stream>>>(p);
}

template <int WT, typename AT>
void launchQGemvRows(QGemvParams const& p, int mr, bool twoRows, unsigned slots, cudaStream_t stream)
{
    switch (mr)
    {
    case 1: launchQGemvShape<WT, AT, 1, 1>(p, slots, stream); break;
    case 2: launchQGemvShape<WT, AT, 2, 1>(p, slots, stream); break;
    case 4:
        twoRows ? launchQGemvShape<WT, AT, 4, 2>(p, slots, stream) : launchQGemvShape<WT, AT, 4, 1>(p, slots, stream);
        break;
    default:
        twoRows ? launchQGemvShape<WT, AT, 8, 2>(p, slots, stream) : launchQGemvShape<WT, AT, 8, 1>(p, slots, stream);
        break;
    }
}

template <int WT>
void launchQGemvActs(QGemvParams const& p, bool aBf16, int mr, bool twoRows, unsigned slots, cudaStream_t stream)
{
    if (aBf16)
    {
        launchQGemvRows<WT, __nv_bfloat16>(p, mr, twoRows, slots, stream);
    }
    else
    {
        launchQGemvRows<WT, float>(p, mr, twoRows, slots, stream);
    }
}

} // namespace

} // namespace kernels
} // namespace engram_trt

using namespace engram_trt::kernels;

extern "C" ENGRAM_API int engram_quant_gemv(void const* a, int32_t aType, int64_t lda, int32_t const* rowIndex,
    int64_t numRows, void const* w, int32_t wType, void const* wScale, int32_t scaleType, int32_t bn, int32_t bk,
    int64_t outFeatures, int64_t inFeatures, int32_t numExperts, int32_t const* offsets, int32_t const* slotExpert,
    int32_t numSlots, void* out, int32_t outType, int64_t ldo, int64_t oCol0, cudaStream_t stream)
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
    QGemvParams p{};
    p.a = a;
    p.lda = lda;
    p.rowIndex = rowIndex;
    p.rows = numRows;
    p.w = static_cast<uint8_t const*>(w);
    p.scale = wScale;
    p.ue8m0 = scaleType == ENGRAM_QSCALE_UE8M0 ? 1 : 0;
    p.bn = wType == ENGRAM_QWEIGHT_BF16 ? 1 : bn;
    p.bk = wType == ENGRAM_QWEIGHT_BF16 ? 1 : bk;
    p.n = static_cast<int32_t>(outFeatures);
    p.k = static_cast<int32_t>(inFeatures);
    p.kBlocks = static_cast<int32_t>(kBlocks);
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
    int const mr = most <= 1 ? 1 : (most <= 2 ? 2 : (most <= 4 ? 4 : 8));
    bool const twoRows = numExperts == 1 && mr >= 4;
    bool const aBf16 = aType == ENGRAM_FLOAT_BF16;
    auto const slots = static_cast<unsigned>(numSlots);
    resetLaunchError();
    switch (wType)
    {
    case ENGRAM_QWEIGHT_FP8_E4M3: launchQGemvActs<ENGRAM_QWEIGHT_FP8_E4M3>(p, aBf16, mr, twoRows, slots, stream); break;
    case ENGRAM_QWEIGHT_FP4_E2M1: launchQGemvActs<ENGRAM_QWEIGHT_FP4_E2M1>(p, aBf16, mr, twoRows, slots, stream); break;
    default: launchQGemvActs<ENGRAM_QWEIGHT_BF16>(p, aBf16, mr, twoRows, slots, stream); break;
    }
    return checkLaunch(fn);
}
