// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * engram-trt kernel library, the bf16 decode GEMV (gemvKernel.cu).
 * Part of the C ABI of engramKernels.h (the umbrella header), whose conventions hold here.
 */
#ifndef ENGRAM_TRT_GEMV_KERNELS_H
#define ENGRAM_TRT_GEMV_KERNELS_H

#include "engramKernelsCore.h"

#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The decode step's projections for a few tokens (gemvKernel.cu):
 *   out[m, n] = bf16(sum_k x[m, k] * weight[n, k])     (torch's F.linear(x, weight), no bias)
 * x [M, K], weight [N, K] (row-major, as nn.Linear stores it) and out [M, N] are bf16,
 * contiguous and 16-byte aligned; the sum is float32 (per lane in k order, then a warp
 * butterfly), rounded once, so it differs from the GEMM library's by the sums' order.
 * One warp per row of weight, 16-byte streaming loads. Bound by reading weight: meant for
 * decode steps of 1..ENGRAM_GEMV_MAX_TOKENS tokens, where a GEMM tiles for many more.
 * flags: ENGRAM_GEMV_WEIGHT_STATIC promises that no work queued on the stream before
 * this call writes weight (a model's weights); the kernel may then load it before the
 * kernel before it completes (programmatic dependent launch, off with ENGRAM_TRT_PDL=0).
 * Without it the kernel reads nothing before that kernel completes.
 * Limits: compute capability 9.0 or later (cudaErrorNotSupported before: the kernel was
 * measured there only); 0 <= num_tokens <= ENGRAM_GEMV_MAX_TOKENS (0 launches nothing);
 * in_features a multiple of 8; out must not overlap x or weight; no flag but
 * ENGRAM_GEMV_WEIGHT_STATIC. */
#define ENGRAM_GEMV_MAX_TOKENS 4
#define ENGRAM_GEMV_WEIGHT_STATIC 1u
ENGRAM_API int engram_gemv_bf16(const void* x, const void* weight, int64_t num_tokens, int64_t out_features,
    int64_t in_features, uint32_t flags, void* out, cudaStream_t stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* ENGRAM_TRT_GEMV_KERNELS_H */
