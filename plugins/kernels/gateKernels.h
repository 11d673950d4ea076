// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * engram-trt kernel library, the fused Engram gate (gateKernel.cu).
 * Part of the C ABI of engramKernels.h (the umbrella header), whose conventions hold here.
 */
#ifndef ENGRAM_TRT_GATE_KERNELS_H
#define ENGRAM_TRT_GATE_KERNELS_H

#include "engramKernelsCore.h"

#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Element type of the gate's token mask (0 = dead token: gate forced to 0). */
enum EngramMaskType
{
    ENGRAM_MASK_NONE = 0, /* no mask: every token live */
    ENGRAM_MASK_U8 = 1,   /* one byte per token (bool / uint8 / int8), nonzero = live */
    ENGRAM_MASK_I32 = 2   /* int32 per token, nonzero = live */
};

/* Element type of the gate's q_weight / k_weight (the EngramFloatType codes; engram_gate
 * takes the first two). */
enum EngramWeightType
{
    ENGRAM_WEIGHT_BF16 = 0,
    ENGRAM_WEIGHT_F32 = 1,
    ENGRAM_WEIGHT_F16 = 2
};

/*
 * Fused Engram gate over hc_mult streams (engram-spec.md, "Fusion"):
 *   key_c = kv[t, c*D:(c+1)*D], value = kv[t, hc*D:(hc+1)*D], h = hidden[t, c]
 *   dot = sum(h*q[c]*k[c]*key_c) * rsqrt(mean(h^2)+eps) * rsqrt(mean(key_c^2)+eps) / sqrt(D)
 *   g = sigmoid(sign(dot) * sqrt(max(|dot|, clamp)))   (g = 0 where the mask is 0)
 *   out[t, c] = h + g * value          (out = h exactly where the mask is 0)
 * hidden [T, hc, D], kv [T, (hc+1)*D] and out [T, hc, D] all of io_type (bf16, fp16 or
 * fp32: EngramFloatType); q_weight / k_weight [hc, D] both of weight_type: bf16, fp32 or
 * io_type; mask [T] (mask_type; NULL with ENGRAM_MASK_NONE). out may alias hidden (in
 * place). fp32 math; out is rounded once (to nearest even) to io_type; masked rows are
 * a bit copy of hidden. NaN propagates as in the float64 reference: a NaN in a live
 * token's h, key or score makes its stream's gate and output NaN (never gate 0.5).
 * Limits: D % 8 == 0; tensors 16-byte aligned; num_tokens * hc_mult < 2^31.
 */
ENGRAM_API int engram_gate_typed(const void* hidden, const void* kv, int32_t io_type, const void* q_weight,
    const void* k_weight, int32_t weight_type, const void* mask, int32_t mask_type, int64_t num_tokens, int32_t hc_mult,
    int32_t hidden_size, float eps, float clamp, void* out, cudaStream_t stream);

/* engram_gate_typed with io_type bf16 and weight_type bf16 or fp32 (the original form). */
ENGRAM_API int engram_gate(const void* hidden, const void* kv, const void* q_weight, const void* k_weight,
    int32_t weight_type, const void* mask, int32_t mask_type, int64_t num_tokens, int32_t hc_mult, int32_t hidden_size,
    float eps, float clamp, void* out, cudaStream_t stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* ENGRAM_TRT_GATE_KERNELS_H */
