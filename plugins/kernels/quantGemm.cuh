// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * The tensor-core tile GEMM of the stored-format products (quantKernels.h), one template
 * for its three weight kinds:
 *   FP8   e4m3 activations x e4m3 weights on mma.m16n8k32.e4m3 (sm_89+): a K tile is one
 *         128-column scale block; its partial sums start from zero in a float32 fragment
 *         of their own and are then added times a_scale[row, kb] * w_scale[col / bn, kb]
 *         to the float32 accumulator ("promotion": the tensor core's own accumulation
 *         never spans two blocks);
 *   FP4   bf16 activations x e2m1 weights: each K tile's packed bytes are decoded in shared
 *         memory to bf16 (a 256-entry byte -> two values table), times the block scale
 *         (float32 product rounded once to bf16: exact for ue8m0 scales), then
 *         mma.m16n8k16.bf16 with float32 accumulation (sm_80+);
 *   BF16  bf16 x bf16 on the same mma.
 *
 * Block: 256 threads (8 warps as 2 x 4), a 128 x 128 output tile, warp tiles of 64 x 32
 * (4 x 4 mma tiles); K tiles of 128 bytes per row (128 e4m3 or 64 bf16 values) through a
 * STAGES-deep cp.async pipeline (3 or 4 by the device's shared memory). Shared tiles are
 * rows of 128 bytes = 8 chunks of 16; chunk c of row r sits at chunk c ^ (r % 8), so the
 * 8 row addresses of each ldmatrix phase (8 consecutive rows, one logical chunk) fall in
 * 8 distinct bank groups, and so do the cp.async writes. Rows past the tile's rows, the
 * weight's N or the K end are zero-filled (cp.async with 0 source bytes).
 *
 * Experts: with E > 1, row tile t belongs to the expert e = max{e : offsets[e] / 128 + e
 * <= t} (strictly increasing in e; counted by the block over the experts), and covers
 * rows [max(offsets[e], 128 (t - e)), min(offsets[e+1], 128 (t - e) + 128)): expert e's
 * rows cut at multiples of 128, so no tile mixes experts and ceil(P / 128) + E tiles
 * cover every row (an empty range exits).
 */
#ifndef ENGRAM_TRT_QUANT_GEMM_CUH
#define ENGRAM_TRT_QUANT_GEMM_CUH

#include "engramKernelsInternal.h"
#include "quantDevice.cuh"
#include "quantInternal.h"
#include "quantKernels.h"

#include <cuda_bf16.h>

#include <cstdint>
#include <mutex>

namespace engram_trt
{
namespace kernels
{

constexpr int kGemmThreads = 256;
constexpr int kGemmTile = 128;              // rows and columns of an output tile
constexpr int kGemmRowBytes = 128;          // bytes of K per tile row and stage
constexpr int kGemmTileBytes = 128 * 128;   // an A or a W tile of one stage
constexpr int kGemmFp4RawBytes = 128 * 32;  // FP4: a W tile's packed bytes (64 values a row)
constexpr int kGemmFp4ScaleBytes = 256 * 4; // FP4: a float scale per (row, half of the 64 values)
constexpr int kGemmStaticShared = 256;      // the kernel's static shared memory, at most

//! Bytes of one pipeline stage, and of what follows the stages, per weight kind.
template <int WT>
struct GemmLayout
{
    static constexpr bool kFp8 = WT == ENGRAM_QWEIGHT_FP8_E4M3;
    static constexpr bool kFp4 = WT == ENGRAM_QWEIGHT_FP4_E2M1;
    // FP8: A, W, a_scale [128] float; FP4: A, packed W, W scales; BF16: A, W.
    static constexpr int kStage = kFp8
        ? 2 * kGemmTileBytes + 512
        : (kFp4 ? kGemmTileBytes + kGemmFp4RawBytes + kGemmFp4ScaleBytes : 2 * kGemmTileBytes);
    // FP4: the decoded bf16 W tile and the byte table after the stages.
    static constexpr int kExtra = kFp4 ? kGemmTileBytes + 256 * 4 : 0;
    static constexpr int kValuesPerTile = kFp8 ? 128 : 64; // K values per stage
    static int bytes(int stages)
    {
        return stages * kStage + kExtra;
    }
};

struct TileGemmParams
{
    uint8_t const* a;     // FP8: e4m3 [*, K]; else bf16 [*, lda]
    int64_t aRowBytes;    // bytes between activation rows
    int64_t aValidBytes;  // bytes of a row that hold K values
    float const* aScale;  // FP8: [*, aScaleBlocks]
    int32_t aScaleBlocks; // ceil(K / 128)
    int32_t const* rowIndex;
    int64_t rows;     // P
    uint8_t const* w; // [E, N, wRowBytes]
    int64_t wRowBytes;
    int64_t expertBytes;
    void const* wScale;
    int64_t expertScales; // scale elements of one expert
    int32_t kScaleBlocks; // ceil(K / bk)
    int32_t ue8m0;
    int32_t bn;
    int32_t bk;
    int32_t n;
    int32_t k;
    int32_t kTiles;
    int32_t experts;
    int32_t const* offsets;
    void* out;
    int32_t outType;
    int64_t ldo;
};

//! Offset of (row, logical 16-byte chunk) in a 128-byte-row shared tile (the XOR swizzle).
__device__ __forceinline__ uint32_t tileOffset(int row, int chunk)
{
    return static_cast<uint32_t>(row * kGemmRowBytes + ((chunk ^ (row & 7)) << 4));
}

/*
 * The tile GEMM (file comment). COLSCALE (FP8): the weight scale read per column (bn not
 * a multiple of 128); else one per tile and K block. STAGES: the pipeline's depth.
 */
template <int WT, int STAGES, bool COLSCALE>
__global__ void __launch_bounds__(kGemmThreads, 1) tileGemmKernel(TileGemmParams const p)
{
    using L = GemmLayout<WT>;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800 // (mmaE4m3 is empty before sm_89: the host refuses FP8 there)
    extern __shared__ __align__(128) uint8_t gemmShared[];
    __shared__ int32_t tileInfo[4]; // expert, first row, end row, row base
    int const tid = threadIdx.x;
    int const lane = tid & 31;
    int const warp = tid >> 5;
    int const wm = warp >> 2; // 0..1: rows wm * 64
    int const wn = warp & 3;  // 0..3: columns wn * 32
    int const g = lane >> 2;
    int const t4 = lane & 3;
    int const n0 = static_cast<int>(blockIdx.x) * kGemmTile;
    int const tile = static_cast<int>(blockIdx.y);

    // --- the tile's expert and rows ---------------------------------------------------
    if (p.experts > 1)
    {
        if (tid == 0)
        {
            tileInfo[0] = 0;
        }
        __syncthreads();
        int local = 0;
        for (int e = 1 + tid; e < p.experts; e += kGemmThreads)
        {
            local += (__ldg(p.offsets + e) / kGemmTile + e <= tile) ? 1 : 0;
        }
        if (local != 0)
        {
            atomicAdd(&tileInfo[0], local);
        }
        __syncthreads();
        if (tid == 0)
        {
            int const e = tileInfo[0];
            int64_t const rowBase = static_cast<int64_t>(tile - e) * kGemmTile;
            int64_t const begin = __ldg(p.offsets + e);
            int64_t const end = __ldg(p.offsets + e + 1);
            int64_t r0 = begin > rowBase ? begin : rowBase;
            int64_t r1 = end < rowBase + kGemmTile ? end : rowBase + kGemmTile;
            r1 = r1 < p.rows ? r1 : p.rows;
            r0 = r0 > 0 ? r0 : 0;
            tileInfo[1] = static_cast<int32_t>(r0);
            tileInfo[2] = static_cast<int32_t>(r1 > r0 ? r1 : r0);
            tileInfo[3] = static_cast<int32_t>(rowBase);
        }
        __syncthreads();
    }
    else if (tid == 0)
    {
        int64_t const rowBase = static_cast<int64_t>(tile) * kGemmTile;
        tileInfo[0] = 0;
        tileInfo[1] = static_cast<int32_t>(rowBase);
        tileInfo[2] = static_cast<int32_t>(rowBase + kGemmTile < p.rows ? rowBase + kGemmTile : p.rows);
        tileInfo[3] = static_cast<int32_t>(rowBase);
    }
    __syncthreads();
    int const expert = tileInfo[0];
    int const r0 = tileInfo[1];
    int const r1 = tileInfo[2];
    int const rowBase = tileInfo[3];
    if (r0 >= r1)
    {
        return;
    }

    // --- what this thread copies ------------------------------------------------------
    int const chunk = tid & 7;   // A / W tiles: 16-byte chunk of a 128-byte row
    int const rowSel = tid >> 3; // rows rowSel + 32 j
    uint8_t const* aSrc[4];
    bool aOk[4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
    {
        int const pr = rowBase + rowSel + 32 * j;
        aOk[j] = pr >= r0 && pr < r1;
        int64_t const src = aOk[j] ? (p.rowIndex != nullptr ? __ldg(p.rowIndex + pr) : pr) : 0;
        aSrc[j] = p.a + src * p.aRowBytes;
    }
    uint8_t const* const wExpert = p.w + expert * p.expertBytes;
    float const* aScaleSrc = nullptr; // FP8: row tid's scales
    bool aScaleOk = false;
    if constexpr (L::kFp8)
    {
        if (tid < kGemmTile)
        {
            int const pr = rowBase + tid;
            aScaleOk = pr >= r0 && pr < r1;
            int64_t const src = aScaleOk ? (p.rowIndex != nullptr ? __ldg(p.rowIndex + pr) : pr) : 0;
            aScaleSrc = p.aScale + src * p.aScaleBlocks;
        }
    }
    int64_t const scaleBase = expert * p.expertScales;

    uint32_t const sharedBase = smemAddress(gemmShared);
    auto loadStage = [&](int stage, int kt) {
        uint32_t const st = sharedBase + stage * L::kStage;
        int64_t const kByte = static_cast<int64_t>(kt) * kGemmRowBytes + chunk * 16;
#pragma unroll
        for (int j = 0; j < 4; ++j)
        {
            int const row = rowSel + 32 * j;
            bool const ok = aOk[j] && kByte < p.aValidBytes;
            cpAsync16(st + tileOffset(row, chunk), ok ? aSrc[j] + kByte : p.a, ok ? 16U : 0U);
        }
        if constexpr (L::kFp4)
        {
            int const row = tid >> 1;
            int const n = n0 + row;
            int64_t const byte = static_cast<int64_t>(kt) * 32 + (tid & 1) * 16;
            bool const ok = n < p.n && byte < p.wRowBytes;
            cpAsync16(st + kGemmTileBytes + row * 32 + (tid & 1) * 16, ok ? wExpert + n * p.wRowBytes + byte : p.w,
                ok ? 16U : 0U);
        }
        else
        {
#pragma unroll
            for (int j = 0; j < 4; ++j)
            {
                int const row = rowSel + 32 * j;
                int const n = n0 + row;
                bool const ok = n < p.n && kByte < p.wRowBytes;
                cpAsync16(st + kGemmTileBytes + tileOffset(row, chunk), ok ? wExpert + n * p.wRowBytes + kByte : p.w,
                    ok ? 16U : 0U);
            }
        }
        if constexpr (L::kFp8)
        {
            if (tid < kGemmTile)
            {
                cpAsync4(st + 2 * kGemmTileBytes + tid * 4, aScaleOk ? aScaleSrc + kt : p.aScale, aScaleOk ? 4U : 0U);
            }
        }
    };
    // FP4: the scale of (row tid / 2, half tid % 2) of K tile kt (0 outside the weight).
    auto fp4Scale = [&](int kt) -> float {
        int const n = n0 + (tid >> 1);
        int64_t const kv = static_cast<int64_t>(kt) * 64 + (tid & 1) * 32;
        if (n >= p.n || kv >= p.k)
        {
            return 0.0F;
        }
        return loadScale(
            p.wScale, scaleBase + static_cast<int64_t>(n / p.bn) * p.kScaleBlocks + kv / p.bk, p.ue8m0 != 0);
    };
    auto fp4ScaleSlot = [&](int stage) -> float* {
        return reinterpret_cast<float*>(gemmShared + stage * L::kStage + kGemmTileBytes + kGemmFp4RawBytes) + tid;
    };
    uint32_t* const fp4Table = reinterpret_cast<uint32_t*>(gemmShared + STAGES * L::kStage + kGemmTileBytes);
    if constexpr (L::kFp4)
    {
        // byte -> (e2m1 of the low nibble, e2m1 of the high nibble) as a bf16 pair
        fp4Table[tid] = e2m1Bf16Bits(tid & 15) | (e2m1Bf16Bits(tid >> 4) << 16);
    }

    float acc[4][4][4];
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
    {
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
        {
#pragma unroll
            for (int i = 0; i < 4; ++i)
            {
                acc[mt][nt][i] = 0.0F;
            }
        }
    }

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s)
    {
        if (s < p.kTiles)
        {
            loadStage(s, s);
            if constexpr (L::kFp4)
            {
                *fp4ScaleSlot(s) = fp4Scale(s);
            }
        }
        cpAsyncCommit();
    }

    for (int kt = 0; kt < p.kTiles; ++kt)
    {
        int const stage = kt % STAGES;
        cpAsyncWait<STAGES - 2>();
        __syncthreads();
        uint32_t const aTile = sharedBase + stage * L::kStage;
        uint32_t wTile = aTile + kGemmTileBytes;
        if constexpr (L::kFp4)
        {
            // decode (row tid / 2, values 32 (tid % 2) ..) of the packed tile into bf16
            int const row = tid >> 1;
            int const half = tid & 1;
            uint8_t const* const st = gemmShared + stage * L::kStage;
            uint4 const raw = *reinterpret_cast<uint4 const*>(st + kGemmTileBytes + row * 32 + half * 16);
            float const s = *fp4ScaleSlot(stage);
            uint32_t const words[4] = {raw.x, raw.y, raw.z, raw.w};
            uint8_t* const decoded = gemmShared + STAGES * L::kStage;
#pragma unroll
            for (int q = 0; q < 4; ++q)
            {
                uint32_t out[4];
#pragma unroll
                for (int b = 0; b < 4; ++b)
                {
                    uint32_t const pair = fp4Table[(words[q] >> (8 * b)) & 0xFFU];
                    __nv_bfloat162 v;
                    *reinterpret_cast<uint32_t*>(&v) = pair;
                    float2 const f = __bfloat1622float2(v);
                    __nv_bfloat162 const scaled = __floats2bfloat162_rn(f.x * s, f.y * s);
                    out[b] = *reinterpret_cast<uint32_t const*>(&scaled);
                }
                *reinterpret_cast<uint4*>(decoded + tileOffset(row, half * 4 + q))
                    = make_uint4(out[0], out[1], out[2], out[3]);
            }
            __syncthreads();
            wTile = smemAddress(decoded);
        }
        int const next = kt + STAGES - 1;
        float nextScale = 0.0F;
        if (next < p.kTiles)
        {
            loadStage(next % STAGES, next);
            if constexpr (L::kFp4)
            {
                nextScale = fp4Scale(next);
            }
        }
        cpAsyncCommit();

        if constexpr (L::kFp8)
        {
            // this K block's weight scales (loads in flight during the mma)
            float cs[4][2];
            if constexpr (COLSCALE)
            {
#pragma unroll
                for (int nt = 0; nt < 4; ++nt)
                {
#pragma unroll
                    for (int j = 0; j < 2; ++j)
                    {
                        int n = n0 + wn * 32 + nt * 8 + 2 * t4 + j;
                        n = n < p.n ? n : p.n - 1;
                        cs[nt][j] = loadScale(
                            p.wScale, scaleBase + static_cast<int64_t>(n / p.bn) * p.kScaleBlocks + kt, p.ue8m0 != 0);
                    }
                }
            }
            else
            {
                float const s = loadScale(
                    p.wScale, scaleBase + static_cast<int64_t>(n0 / p.bn) * p.kScaleBlocks + kt, p.ue8m0 != 0);
#pragma unroll
                for (int nt = 0; nt < 4; ++nt)
                {
                    cs[nt][0] = s;
                    cs[nt][1] = s;
                }
            }
            float part[4][4][4];
#pragma unroll
            for (int mt = 0; mt < 4; ++mt)
            {
#pragma unroll
                for (int nt = 0; nt < 4; ++nt)
                {
#pragma unroll
                    for (int i = 0; i < 4; ++i)
                    {
                        part[mt][nt][i] = 0.0F;
                    }
                }
            }
#pragma unroll
            for (int ks = 0; ks < 4; ++ks)
            {
                uint32_t af[4][4];
#pragma unroll
                for (int mt = 0; mt < 4; ++mt)
                {
                    int const row = wm * 64 + mt * 16 + (lane & 15);
                    ldmatrixX4(af[mt], aTile + tileOffset(row, 2 * ks + (lane >> 4)));
                }
                uint32_t bf[4][2];
#pragma unroll
                for (int np = 0; np < 2; ++np)
                {
                    int const row = wn * 32 + np * 16 + (lane & 7) + ((lane >> 4) << 3);
                    uint32_t d[4];
                    ldmatrixX4(d, wTile + tileOffset(row, 2 * ks + ((lane >> 3) & 1)));
                    bf[2 * np][0] = d[0];
                    bf[2 * np][1] = d[1];
                    bf[2 * np + 1][0] = d[2];
                    bf[2 * np + 1][1] = d[3];
                }
#pragma unroll
                for (int mt = 0; mt < 4; ++mt)
                {
#pragma unroll
                    for (int nt = 0; nt < 4; ++nt)
                    {
                        mmaE4m3(part[mt][nt], af[mt], bf[nt][0], bf[nt][1]);
                    }
                }
            }
            // promotion: acc += part * a_scale[row, kt] * w_scale[col, kt]
            float const* const rowScale
                = reinterpret_cast<float const*>(gemmShared + stage * L::kStage + 2 * kGemmTileBytes);
#pragma unroll
            for (int mt = 0; mt < 4; ++mt)
            {
#pragma unroll
                for (int h = 0; h < 2; ++h)
                {
                    float const rs = rowScale[wm * 64 + mt * 16 + g + 8 * h];
#pragma unroll
                    for (int nt = 0; nt < 4; ++nt)
                    {
#pragma unroll
                        for (int j = 0; j < 2; ++j)
                        {
                            acc[mt][nt][2 * h + j]
                                = fmaf(part[mt][nt][2 * h + j] * rs, cs[nt][j], acc[mt][nt][2 * h + j]);
                        }
                    }
                }
            }
        }
        else
        {
#pragma unroll
            for (int ks = 0; ks < 4; ++ks)
            {
                uint32_t af[4][4];
#pragma unroll
                for (int mt = 0; mt < 4; ++mt)
                {
                    int const row = wm * 64 + mt * 16 + (lane & 15);
                    ldmatrixX4(af[mt], aTile + tileOffset(row, 2 * ks + (lane >> 4)));
                }
                uint32_t bf[4][2];
#pragma unroll
                for (int np = 0; np < 2; ++np)
                {
                    int const row = wn * 32 + np * 16 + (lane & 7) + ((lane >> 4) << 3);
                    uint32_t d[4];
                    ldmatrixX4(d, wTile + tileOffset(row, 2 * ks + ((lane >> 3) & 1)));
                    bf[2 * np][0] = d[0];
                    bf[2 * np][1] = d[1];
                    bf[2 * np + 1][0] = d[2];
                    bf[2 * np + 1][1] = d[3];
                }
#pragma unroll
                for (int mt = 0; mt < 4; ++mt)
                {
#pragma unroll
                    for (int nt = 0; nt < 4; ++nt)
                    {
                        mmaBf16(acc[mt][nt], af[mt], bf[nt][0], bf[nt][1]);
                    }
                }
            }
        }
        if constexpr (L::kFp4)
        {
            if (next < p.kTiles)
            {
                *fp4ScaleSlot(next % STAGES) = nextScale;
            }
        }
    }
    cpAsyncWait<0>();

    // --- epilogue: c0, c1 at (g, 2 t4 + 0 / 1), c2, c3 at (g + 8, ...) of each mma tile --
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
    {
#pragma unroll
        for (int i = 0; i < 4; ++i)
        {
            int const pr = rowBase + wm * 64 + mt * 16 + g + 8 * (i >> 1);
            if (pr < r0 || pr >= r1)
            {
                continue;
            }
#pragma unroll
            for (int nt = 0; nt < 4; ++nt)
            {
                int const n = n0 + wn * 32 + nt * 8 + 2 * t4 + (i & 1);
                if (n < p.n)
                {
                    storeFloatAs(p.out, p.outType, static_cast<int64_t>(pr) * p.ldo + n, acc[mt][nt][i]);
                }
            }
        }
    }
#endif
}

/*
 * Launches the variant for the current device: STAGES 4 where its shared memory holds
 * them, else 3; the kernel's shared-memory opt-in set once per device. Returns 0 or a
 * failure (the launch's status is the caller's checkLaunch).
 */
template <int WT, bool COLSCALE>
int launchTileGemm(char const* fn, TileGemmParams const& p, cudaStream_t stream)
{
    using L = GemmLayout<WT>;
    int const optin = maxSharedPerBlockOptin();
    int const stages = optin >= L::bytes(4) + kGemmStaticShared ? 4 : 3;
    if (optin < L::bytes(3) + kGemmStaticShared)
    {
        return fail(cudaErrorNotSupported, "%s: needs %d bytes of shared memory per block; this GPU allows %d", fn,
            L::bytes(3), optin);
    }
    int device = 0;
    if (cudaError_t const status = cudaGetDevice(&device); status != cudaSuccess)
    {
        return failCuda(status, "%s: cudaGetDevice failed: %s", fn, cudaGetErrorString(status));
    }
    auto kernel = stages == 4 ? tileGemmKernel<WT, 4, COLSCALE> : tileGemmKernel<WT, 3, COLSCALE>;
    static std::mutex mutex;
    static uint64_t configured[2] = {0, 0}; // per stage count, a bit per device (64 devices)
    {
        std::lock_guard<std::mutex> lock(mutex);
        uint64_t& mask = configured[stages - 3];
        uint64_t const bit = device < 64 ? (uint64_t{1} << device) : 0;
        if (bit == 0 || (mask & bit) == 0)
        {
            cudaError_t const status
                = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, L::bytes(stages));
            if (status != cudaSuccess)
            {
                return failCuda(status, "%s: cannot opt in to %d bytes of shared memory: %s", fn, L::bytes(stages),
                    cudaGetErrorString(status));
            }
            mask |= bit;
        }
    }
    int64_t const rowTiles = (p.rows + kGemmTile - 1) / kGemmTile + (p.experts > 1 ? p.experts : 0);
    if (rowTiles > 65535)
    {
        return fail(cudaErrorInvalidValue, "%s: %lld rows and %d experts need %lld row tiles (at most 65535)", fn,
            ll(p.rows), p.experts, ll(rowTiles));
    }
    dim3 const grid(static_cast<unsigned>((p.n + kGemmTile - 1) / kGemmTile), static_cast<unsigned>(rowTiles));
    resetLaunchError();
    kernel<<<grid, kGemmThreads, L::bytes(stages), stream>>>(p);
    return checkLaunch(fn);
}

} // namespace kernels
} // namespace engram_trt

#endif // ENGRAM_TRT_QUANT_GEMM_CUH
