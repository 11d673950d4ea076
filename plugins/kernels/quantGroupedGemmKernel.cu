// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * engram_quant_grouped_gemm: a prefill's expert products with FP4 (e2m1, block scales) or
 * BF16 weights on the bf16 tensor cores (quantKernels.h states the contract; quantGemm.cuh
 * holds the tile GEMM and its layout). FP4 bytes are decoded in shared memory, a K tile
 * at a time, to bf16 times their block scale: exact for ue8m0 scales (a power of two
 * times an e2m1 value), so the products are the dequantized weight's.
 */
#include "engramKernelsInternal.h"
#include "quantGemm.cuh"
#include "quantInternal.h"
#include "quantKernels.h"

#include <climits>
#include <cstdint>

using namespace engram_trt::kernels;

extern "C" ENGRAM_API int engram_quant_grouped_gemm(void const* a, int64_t lda, int32_t const* rowIndex,
    int64_t numRows, void const* w, int32_t wType, void const* wScale, int32_t scaleType, int32_t bn, int32_t bk,
    int64_t outFeatures, int64_t inFeatures, int32_t numExperts, int32_t const* offsets, void* out, int32_t outType,
    int64_t ldo, cudaStream_t stream)
{
    clearError();
    char const* const fn = "engram_quant_grouped_gemm";
    if (wType == ENGRAM_QWEIGHT_FP8_E4M3)
    {
        return fail(cudaErrorInvalidValue, "%s: fp8 weights take engram_fp8_gemm (w_type must be 1 fp4 or 2 bf16)", fn);
    }
    if (int const status
        = checkQuantWeight(fn, wType, w, wScale, scaleType, bn, bk, outFeatures, inFeatures, numExperts))
    {
        return status;
    }
    bool const fp4 = wType == ENGRAM_QWEIGHT_FP4_E2M1;
    if (inFeatures % (fp4 ? 32 : 8) != 0)
    {
        return fail(cudaErrorInvalidValue, "%s: in_features must be a multiple of %d for %s weights (got %lld)", fn,
            fp4 ? 32 : 8, fp4 ? "fp4" : "bf16", ll(inFeatures));
    }
    if (fp4 && bk % 32 != 0)
    {
        return fail(cudaErrorInvalidValue, "%s: bk must be a multiple of 32 for fp4 weights (got %d)", fn, bk);
    }
    if (lda < inFeatures || lda % 8 != 0)
    {
        return fail(cudaErrorInvalidValue, "%s: lda must be >= in_features and a multiple of 8 (16 bytes; got %lld)",
            fn, ll(lda));
    }
    if (numRows < 0 || numRows > INT32_MAX - 2 * 128)
    {
        return fail(cudaErrorInvalidValue, "%s: num_rows must be in [0, 2^31 - 257] (got %lld)", fn, ll(numRows));
    }
    if (int const status = checkExperts(fn, numExperts, offsets))
    {
        return status;
    }
    if (int const status = checkQuantOut(fn, out, outType, ldo, outFeatures))
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
    int const cc = computeCapability();
    if (cc >= 0 && cc < 80)
    {
        return fail(cudaErrorNotSupported,
            "%s: the bf16 tensor cores need compute capability 8.0 or later (this GPU is %d.%d)", fn, cc / 10, cc % 10);
    }
    int64_t const kBlocks = fp4 ? (inFeatures + bk - 1) / bk : 0;
    TileGemmParams p{};
    p.a = static_cast<uint8_t const*>(a);
    p.aRowBytes = lda * 2;
    p.aValidBytes = inFeatures * 2;
    p.rowIndex = rowIndex;
    p.rows = numRows;
    p.w = static_cast<uint8_t const*>(w);
    p.wRowBytes = fp4 ? inFeatures / 2 : inFeatures * 2;
    p.expertBytes = outFeatures * p.wRowBytes;
    p.wScale = wScale;
    p.expertScales = fp4 ? ((outFeatures + bn - 1) / bn) * kBlocks : 0;
    p.kScaleBlocks = static_cast<int32_t>(kBlocks);
    p.ue8m0 = scaleType == ENGRAM_QSCALE_UE8M0 ? 1 : 0;
    p.bn = fp4 ? bn : 1;
    p.bk = fp4 ? bk : 1;
    p.n = static_cast<int32_t>(outFeatures);
    p.k = static_cast<int32_t>(inFeatures);
    p.kTiles = static_cast<int32_t>((inFeatures + 63) / 64);
    p.experts = numExperts;
    p.offsets = offsets;
    p.out = out;
    p.outType = outType;
    p.ldo = ldo;
    if (fp4)
    {
        return launchTileGemm<ENGRAM_QWEIGHT_FP4_E2M1, false>(fn, p, stream);
    }
    return launchTileGemm<ENGRAM_QWEIGHT_BF16, false>(fn, p, stream);
}
