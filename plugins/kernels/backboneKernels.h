// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * engram-trt kernel library, the bf16 decoder layer's elementwise pieces (backboneKernel.cu).
 * Part of the C ABI of engramKernels.h (the umbrella header), whose conventions hold here.
 */
#ifndef ENGRAM_TRT_BACKBONE_KERNELS_H
#define ENGRAM_TRT_BACKBONE_KERNELS_H

#include "engramKernelsCore.h"

#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ======================================================================================
 * Decoder-layer pieces of the bf16 serving path (backboneKernel.cu): the elementwise work
 * around a layer's GEMMs in one launch each, rounded as the PyTorch reference
 * (python/engram_trt/reference/modules.py) rounds its bf16 ops, so the fused path and the
 * reference differ by the float32 sums' order alone.
 *
 * engram_hc_rms_norm: the norm in front of attention / the MLP of an engram-llama layer,
 * whose residual stream is hc_mult copies [T, hc_mult, D]:
 *   residual != NULL: hs[t, c, :] = bf16(hs[t, c, :] + residual[t, :]) IN PLACE first
 *                     (torch's hs + residual.unsqueeze(1): the layer's residual update);
 *   m   = bf16(sum_c hs[t, c, :] * (1 / hc_mult))     (torch's bf16 hs.mean(dim=1): a
 *         float32 sum in copy order, then one rounding);
 *   out[t, :] = bf16((m * rsqrt(mean(m^2) + eps)) * weight)   (float32: RMSNorm.forward).
 * hc_mult = 1 is a plain RMSNorm (the final norm). hs [T, hc_mult, D], residual [T, D],
 * weight [D] and out [T, D] are bf16; out must not overlap hs or residual, nor residual
 * hs. 16-byte loads when D % 8 == 0 and every pointer is 16-byte aligned, element loads
 * otherwise (any D, any alignment of 2 bytes).
 * Limits: 1 <= hidden_size <= ENGRAM_NORM_MAX_HIDDEN (the mean row is kept in shared
 * memory); hc_mult >= 1; eps finite and >= 0; num_tokens in [0, 2^31 - 1].
 */
#define ENGRAM_NORM_MAX_HIDDEN 16384
ENGRAM_API int engram_hc_rms_norm(void* hs, const void* residual, const void* weight, int64_t num_tokens,
    int32_t hc_mult, int32_t hidden_size, float eps, void* out, cudaStream_t stream);

/* The SwiGLU activation of a fused gate + up projection: gate_up [T, 2 * I] bf16 (gate in
 * columns 0..I-1, up in I..2I-1) -> out [T, I] bf16 with
 *   out[t, i] = bf16(bf16(g / (1 + exp(-g))) * up[t, i]),  g = gate_up[t, i]
 * (torch's bf16 F.silu(gate) * up: two roundings). 16-byte loads when I % 8 == 0 and both
 * pointers are 16-byte aligned, element loads otherwise. out must not overlap gate_up.
 * Limits: intermediate_size >= 1; num_tokens >= 0. */
ENGRAM_API int engram_silu_mul(
    const void* gate_up, int64_t num_tokens, int32_t intermediate_size, void* out, cudaStream_t stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* ENGRAM_TRT_BACKBONE_KERNELS_H */
