// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * engram-trt kernel library, Qwen4-Exp's Gated DeltaNet pieces: the causal conv and the gated delta rule
 * (linearAttentionKernel.cu).
 * Part of the C ABI of engramKernels.h (the umbrella header), whose conventions hold here.
 */
#ifndef ENGRAM_TRT_LINEAR_ATTENTION_KERNELS_H
#define ENGRAM_TRT_LINEAR_ATTENTION_KERNELS_H

#include "engramKernelsCore.h"

#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/*
 * Qwen4-Exp's Gated DeltaNet over a packed step, the two pieces between its projections
 * (linearAttentionKernel.cu; the float64 reference is
 * engram_trt.builder.reference_linear_attention, tied to
 * engram_trt.models.qwen4_exp.linear_attention.GatedDeltaNet). Both take the packed step
 * as engram_ple_fusion does: seq_starts [S+1] int32 (cu_seqlens in [0, T], non-decreasing,
 * a sequence's tokens consecutive and in order), past_lens [S] (<= 0: a fresh sequence,
 * its slot's old state ignored, read as zeros), seq_slots [S] (the state row; one outside
 * [0, num_slots) reads zeros and keeps nothing; two sequences of a step must not share a
 * slot); a token outside [seq_starts[0], seq_starts[S]) gets a zero output; T = 0 is a
 * no-op. fp32 math, each output rounded once to io_type (bf16, fp16 or fp32).
 *
 * engram_causal_conv1d: the depthwise causal conv (dilation 1, no bias)
 *   out[t, c] = act(sum_j weight[c, j] * x_seq(pos - (K-1-j)))
 * x, out [T, C] io_type; weight [C, K] (the checkpoint's [C, 1, K]) fp32 or io_type;
 * conv_state [num_slots, C, K-1] io_type, in place: row (slot, c) holds the slot's last
 * K-1 pre-conv inputs (oldest first) and after the call the last K-1 of [old row (zeros
 * when fresh), the sequence's x of this step]. act: ENGRAM_CONV_ACTIVATION_*. out must not
 * overlap x or conv_state. Limits: 1 <= K <= ENGRAM_CAUSAL_CONV_MAX_KERNEL,
 * 1 <= C <= 256 * 65535, T < 2^31.
 *
 * engram_gated_delta_net: the gated delta rule, per sequence and value head h (key head
 * h / (Hv / Hk)), token by token from the slot's state S [dk, dv]:
 *   (l2norm_qk: q, k = x / sqrt(|x|^2 + 1e-6)); q *= scale
 *   S = exp(g) S;  u = beta (v - S^T k);  S = S + k u^T;  o = S^T q
 * q, k [T, Hk, dk], v, out [T, Hv, dv] io_type; g (log decay), beta [T, Hv] fp32;
 * state [num_slots, Hv, dk, dv] fp32, in place (the state after the sequence's last
 * token). out must not overlap q, k, v or state. Limits: Hv % Hk == 0;
 * 1 <= dk, dv <= ENGRAM_GATED_DELTA_MAX_HEAD_DIM; scale finite; S * Hv * ceil(dv / 32) < 2^31.
 */
#define ENGRAM_CAUSAL_CONV_MAX_KERNEL 32
#define ENGRAM_GATED_DELTA_MAX_HEAD_DIM 256

/* engram_causal_conv1d's activation (the EngramCausalConv1d field `activation`). */
enum EngramConvActivation
{
    ENGRAM_CONV_ACTIVATION_IDENTITY = 0,
    ENGRAM_CONV_ACTIVATION_SILU = 1
};

/* The shape checks of the two calls (the plugins run them at creation); need no GPU. */
ENGRAM_API int engram_causal_conv1d_check_shape(int64_t channels, int32_t kernel, int32_t activation);
ENGRAM_API int engram_gated_delta_net_check_shape(
    int32_t num_k_heads, int32_t num_v_heads, int32_t head_k_dim, int32_t head_v_dim, int32_t l2norm_qk, float scale);

ENGRAM_API int engram_causal_conv1d(const void* x, int32_t io_type, const void* weight, int32_t weight_type,
    void* conv_state, int64_t num_slots, const int32_t* seq_starts, const int32_t* past_lens, const int32_t* seq_slots,
    int64_t num_seqs, int64_t num_tokens, int64_t channels, int32_t kernel, int32_t activation, void* out,
    cudaStream_t stream);

ENGRAM_API int engram_gated_delta_net(const void* q, const void* k, const void* v, int32_t io_type, const float* g,
    const float* beta, float* state, int64_t num_slots, const int32_t* seq_starts, const int32_t* past_lens,
    const int32_t* seq_slots, int64_t num_seqs, int64_t num_tokens, int32_t num_k_heads, int32_t num_v_heads,
    int32_t head_k_dim, int32_t head_v_dim, int32_t l2norm_qk, float scale, void* out, cudaStream_t stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* ENGRAM_TRT_LINEAR_ATTENTION_KERNELS_H */
