// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * engram_fp8_gemm: the FP8 x FP8 block-scaled product of a prefill on the tensor cores
 * (quantKernels.h states the contract; quantGemm.cuh holds the tile GEMM and its layout).
 * The activations come quantized by engram_act_quant (group 128, float32 scales), the
 * weights as stored (e4m3 with 128 x 128 or bn x 128 block scales); one K tile of 128 is
 * one scale block, promoted into the float32 sum with its two scales.
 */
#include "engramKernelsInternal.h"
#include "quantGemm.cuh"
#include "quantInternal.h"
#include "quantKernels.h"

#include <climits>
#include <cstdint>

using namespace engram_trt::kernels;

extern "C" ENGRAM_API int engram_fp8_gemm(uint8_t const* aq, float const* aScale, int32_t const* rowIndex,
    int64_t numRows, uint8_t const* w, void const* wScale, int32_t scaleType, int32_t bn, int64_t outFeatures,
    int64_t inFeatures, int32_t numExperts, int32_t const* offsets, void* out, int32_t outType, int64_t ldo,
    cudaStream_t stream)
{
    clearError();
    char const* const fn = "engram_fp8_gemm";
    if (int const status = checkQuantWeight(
            fn, ENGRAM_QWEIGHT_FP8_E4M3, w, wScale, scaleType, bn, 128, outFeatures, inFeatures, numExperts))
    {
        return status;
    }
    if (inFeatures % 16 != 0)
    {
        return fail(cudaErrorInvalidValue, "%s: in_features must be a multiple of 16 (got %lld)", fn, ll(inFeatures));
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
    if (aq == nullptr || !isAligned(aq, 16) || aScale == nullptr || !isAligned(aScale, 4)
        || (rowIndex != nullptr && !isAligned(rowIndex, 4)))
    {
        return fail(cudaErrorInvalidValue,
            "%s: aq must be a 16-byte aligned device pointer and a_scale a float32 one (row_index int32 or NULL)", fn);
    }
    int const cc = computeCapability();
    if (cc >= 0 && cc < 89)
    {
        return fail(cudaErrorNotSupported,
            "%s: the FP8 tensor cores need compute capability 8.9 or later (this GPU is %d.%d); use the GEMV "
            "(engram_quant_gemv) or dequantize",
            fn, cc / 10, cc % 10);
    }
    int64_t const kBlocks = (inFeatures + 127) / 128;
    TileGemmParams p{};
    p.a = aq;
    p.aRowBytes = inFeatures;
    p.aValidBytes = inFeatures;
    p.aScale = aScale;
    p.aScaleBlocks = static_cast<int32_t>(kBlocks);
    p.rowIndex = rowIndex;
    p.rows = numRows;
    p.w = w;
    p.wRowBytes = inFeatures;
    p.expertBytes = outFeatures * inFeatures;
    p.wScale = wScale;
    p.expertScales = ((outFeatures + bn - 1) / bn) * kBlocks;
    p.kScaleBlocks = static_cast<int32_t>(kBlocks);
    p.ue8m0 = scaleType == ENGRAM_QSCALE_UE8M0 ? 1 : 0;
    p.bn = bn;
    p.bk = 128;
    p.n = static_cast<int32_t>(outFeatures);
    p.k = static_cast<int32_t>(inFeatures);
    p.kTiles = static_cast<int32_t>(kBlocks);
    p.experts = numExperts;
    p.offsets = offsets;
    p.out = out;
    p.outType = outType;
    p.ldo = ldo;
    if (bn % 128 == 0)
    {
        return launchTileGemm<ENGRAM_QWEIGHT_FP8_E4M3, false>(fn, p, stream);
    }
    return launchTileGemm<ENGRAM_QWEIGHT_FP8_E4M3, true>(fn, p, stream);
}
