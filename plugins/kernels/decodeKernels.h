// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * engram-trt kernel library, the DeepSeek-V4 decode step's glue: norms + RoPE, grouped GEMVs, MoE routing and
 * experts (decodeNormKernel.cu, decodeGemvKernel.cu, decodeMoeKernel.cu, decodeMoeGroupedKernel.cu).
 * Part of the C ABI of engramKernels.h (the umbrella header), whose conventions hold here.
 */
#ifndef ENGRAM_TRT_DECODE_KERNELS_H
#define ENGRAM_TRT_DECODE_KERNELS_H

#include "engramKernelsCore.h"

#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ======================================================================================
 * The decode step's glue around DeepSeek-V4's attention kernel and MoE (decodeNormKernel.cu,
 * decodeGemvKernel.cu, decodeMoeKernel.cu, decodeMoeGroupedKernel.cu; python/engram_trt/native/decode.py): the
 * element-wise chains and the small products the PyTorch reference spends dozens of
 * launches on, a few launches a layer, each rounding where the reference rounds. Each is
 * enqueued as a programmatic dependent launch on sm_90+ (dependentLaunch.cuh): it reads
 * nothing an earlier kernel writes before that kernel completes.
 */

/* engram_norm_rope: up to ENGRAM_NORM_ROPE_MAX_JOBS row sets in one launch. Job row r
 * (0 <= r < rows) is head h = r % heads of token t = r / heads: x + t * x_stride + h * dim
 * (dim elements, io_type), written to out + t * out_stride + h * dim:
 *   norm WEIGHTED:   y = io(w * (x * rsqrt(sum(x^2) / dim + eps)))   (RMSNorm; fp32 w = weight + h * weight_stride)
 *   norm UNWEIGHTED: y = io(x * io(rsqrt(sum(x^2) / dim + eps)))         (the per-head q norm)
 *   norm NONE:       y = x
 * then, with rope_pairs > 0, the trailing 2 * rope_pairs channels rotated in interleaved
 * pairs (2p, 2p + 1) by c = io(cos[t, p]), s = rope_sign * io(sin[t, p]) (float32 tables
 * [T, cos_stride]): (io(y0 c - y1 s), io(y1 c + y0 s)); the leading channels are y.
 * io() rounds to io_type (to nearest even); each float32 product and sum is rounded on its
 * own (no FMA), as the reference's separate ops are. out may be x itself (same stride:
 * in place) or apart from it; no job may write what another reads.
 * Limits: rows in [0, 2^31 - 1]; dim >= 1; 0 <= 2 * rope_pairs <= dim; strides >= heads * dim. */
#define ENGRAM_NORM_ROPE_MAX_JOBS 4
enum EngramNormKind
{
    ENGRAM_NORM_NONE = 0,
    ENGRAM_NORM_WEIGHTED = 1,
    ENGRAM_NORM_UNWEIGHTED = 2
};
typedef struct EngramNormRopeJob
{
    const void* x;
    void* out;
    const float* weight; /* [dim] fp32, WEIGHTED only (else NULL) */
    const float* cos;    /* [tokens, cos_stride] fp32, with rope_pairs > 0 */
    const float* sin;
    int64_t rows;
    int64_t x_stride;   /* elements between two tokens' rows of x */
    int64_t out_stride; /* elements between two tokens' rows of out */
    int64_t cos_stride;
    int64_t weight_stride; /* elements between two heads' weights (0: one [dim] weight for every head) */
    int32_t dim;
    int32_t heads;
    int32_t norm; /* EngramNormKind */
    int32_t rope_pairs;
    int32_t rope_sign; /* 1, or -1 for the inverse rotation */
    float eps;
} EngramNormRopeJob;
ENGRAM_API int engram_norm_rope(const EngramNormRopeJob* jobs, int32_t num_jobs, int32_t io_type, cudaStream_t stream);

/* engram_gemv_segments_bf16: up to ENGRAM_GEMV_MAX_SEGMENTS bf16 products of a decode step
 * in one launch, segment s: out_s[m, n] = bf16(sum_k x_s[m, k] * weight_s[n, k]) for the
 * num_tokens (<= ENGRAM_GEMV_MAX_TOKENS) rows m of x_s (x_stride elements apart, a multiple
 * of 8) into out_s (out_stride elements apart); weight_s [out_features, in_features]
 * row-major. Each segment's sums are engram_gemv_bf16's (equal to it bit for bit). flags:
 * ENGRAM_GEMV_WEIGHT_STATIC as engram_gemv_bf16's. Limits: compute capability 9.0 or later;
 * in_features a positive multiple of 8; x / weight 16-byte aligned; out must not overlap its
 * segment's x or weight (nor another segment's anything); at most 2^26 rows in all. */
#define ENGRAM_GEMV_MAX_SEGMENTS 8
typedef struct EngramGemvSegment
{
    const void* x;
    const void* weight;
    void* out;
    int64_t x_stride;
    int64_t out_stride;
    int32_t out_features;
    int32_t in_features;
} EngramGemvSegment;
ENGRAM_API int engram_gemv_segments_bf16(
    const EngramGemvSegment* segments, int32_t num_segments, int64_t num_tokens, uint32_t flags, cudaStream_t stream);

/* engram_gemv_segments_bf16_ex: engram_gemv_segments_bf16 for up to ENGRAM_GEMV_EX_MAX_TOKENS
 * rows, each segment's x first taken through *prologue (NULL or kind NONE: none), the
 * element-wise launch before the product folded into it, rounded as that launch rounds:
 *   ENGRAM_GEMV_PROLOGUE_RMSNORM: x's rows RMS-normalized as engram_norm_rope's NORM_WEIGHTED
 *     job of dim = in_features (weight [dim] fp32 16-byte aligned, eps; the same sum of
 *     squares in the same order as its register form, dim <= 2048): every segment's
 *     in_features must be dim (several projections of one normalized input);
 *   ENGRAM_GEMV_PROLOGUE_ROPE: x's heads of dim channels (dim % 8 == 0; a segment's x must
 *     start at a head, its in_features a multiple of dim) rotated as engram_norm_rope's
 *     NORM_NONE job with rope_pairs / rope_sign and cos / sin [tokens, >= rope_pairs] fp32
 *     (cos_stride apart): a grouped projection of the attention's output after its inverse
 *     RoPE.
 * Products and limits otherwise engram_gemv_segments_bf16's. The stored-format segments
 * take the same prologues (quantKernels.h engram_quant_gemv_segments_ex). */
#define ENGRAM_GEMV_EX_MAX_TOKENS 8
#define ENGRAM_GEMV_PROLOGUE_NONE 0
#define ENGRAM_GEMV_PROLOGUE_RMSNORM 1
#define ENGRAM_GEMV_PROLOGUE_ROPE 2
typedef struct EngramGemvPrologue
{
    int32_t kind;
    int32_t dim;
    int32_t rope_pairs;
    int32_t rope_sign;
    float eps;
    int32_t reserved;
    const float* weight;
    const float* cos;
    const float* sin;
    int64_t cos_stride;
} EngramGemvPrologue;
ENGRAM_API int engram_gemv_segments_bf16_ex(const EngramGemvSegment* segments, int32_t num_segments, int64_t num_tokens,
    uint32_t flags, const EngramGemvPrologue* prologue, cudaStream_t stream);

/* engram_moe_route: a MoE router's picks from its logits [T, E] (io_type, rows
 * logits_stride apart; transformers' DeepseekV4TopKRouter / HashRouter after F.linear).
 * Per token, with io() rounding to io_type: s[e] = io(sqrt(io(softplus(z)))) (score_fn
 * ENGRAM_MOE_SQRT_SOFTPLUS; softplus(z) = z above 20, else log1p(exp(z))) or io(sigmoid(z)),
 * or the float32 softmax over the row, unrounded (ENGRAM_MOE_SOFTMAX and
 * ENGRAM_MOE_SOFTMAX_TOPK: transformers' Qwen MoE routers, softmax in float32).
 * Top-k routing (bias [E] fp32): ids = the top_k e by s[e] + bias[e] (float32), larger
 * first, NaN above every number, equal keys by the lower e (the softmax functions may
 * give neither bias nor tid2eid: by s[e] alone). Hash routing (tid2eid
 * [vocab, top_k] int64 with input_ids [T] int64): ids = tid2eid[input_ids[t]]; an id
 * outside [0, E) (or a token outside the vocabulary) becomes -1 with weight 0.
 * weights[t, j] = io(io(s[ids_j] / io(io(sum_j s[ids_j]) + 1e-20)) * scaling) for the
 * first two; io((s[ids_j] / sum_j s[ids_j]) * scaling) for ENGRAM_MOE_SOFTMAX (the picks
 * renormalized in float32, norm_topk_prob) and io(s[ids_j] * scaling) for
 * ENGRAM_MOE_SOFTMAX_TOPK; float32 [T, top_k]; ids int32 [T, top_k].
 * Limits: 1 <= top_k <= min(E, ENGRAM_MOE_MAX_TOP_K), E <= ENGRAM_MOE_MAX_EXPERTS. */
#define ENGRAM_MOE_MAX_EXPERTS 1024
#define ENGRAM_MOE_MAX_TOP_K 16
enum EngramMoeScore
{
    ENGRAM_MOE_SQRT_SOFTPLUS = 0,
    ENGRAM_MOE_SIGMOID = 1,
    ENGRAM_MOE_SOFTMAX = 2,
    ENGRAM_MOE_SOFTMAX_TOPK = 3
};
ENGRAM_API int engram_moe_route(const void* logits, int32_t io_type, int64_t logits_stride, const float* bias,
    const int64_t* tid2eid, const int64_t* input_ids, int64_t vocab_size, int64_t num_tokens, int32_t num_experts,
    int32_t top_k, int32_t score_fn, float scaling, int32_t* ids, float* weights, cudaStream_t stream);

/* engram_moe_experts_bf16: a decode step's routed experts plus the shared expert, bf16, in
 * two launches (the reference: SparseMoE's loop over experts, transformers'
 * DeepseekV4Experts + DeepseekV4MLP). With bf() rounding to bf16, for each token t and pick
 * j of expert e = ids[t, j] (and the shared expert):
 *   g = bf(gate_e x), u = bf(up_e x) (float32 sums); with clamp: g = bf(min(g, limit)),
 *   u = bf(clamp(u, -limit, limit)); h = bf(bf(g / (1 + exp(-g))) * u);
 *   y_j = bf(bf(down_e h) * weights[t, j]);  routed = 0, then routed = bf(routed + y_j) over
 *   the picks in ascending e (ties by j);  out[t] = bf(routed + s) with the shared expert's
 *   s = bf(shared_down h_shared), or with shared_scale (the shared expert's gate logits, bf16,
 *   row t at shared_scale + t * shared_scale_stride: transformers' Qwen MoE
 *   shared_expert_gate) s = bf(bf(shared_down h_shared) * bf(sigmoid(shared_scale[t]))).
 * gate / up [E, I, D], shared_gate / shared_up [I_s, D], shared_down [D, I_s] (I_s =
 * shared_intermediate, 0: no shared expert), x / out [T, D], all bf16 row-major; down's row
 * d of expert e at down + e * down_expert_stride + d * down_row_stride elements (both 0:
 * [E, D, I] packed, I and D * I; a [D, E * I] stack, the experts side by side: I and E * I).
 * A pick outside [0, E) adds nothing. workspace: engram_moe_experts_workspace_size bytes.
 * Limits: compute capability 9.0 or later; 0 <= T <= ENGRAM_MOE_DECODE_MAX_TOKENS; D, I,
 * I_s multiples of 8; x, weights' stacks and workspace 16-byte aligned; out apart from x
 * and workspace. */
#define ENGRAM_MOE_DECODE_MAX_TOKENS 16
typedef struct EngramMoeExperts
{
    const void* x;
    const int32_t* ids;
    const float* weights;
    const void* gate;
    const void* up;
    const void* down;
    const void* shared_gate;
    const void* shared_up;
    const void* shared_down;
    void* workspace;
    void* out;
    int64_t num_tokens;
    int64_t workspace_bytes;
    int32_t hidden;
    int32_t top_k;
    int32_t num_experts;
    int32_t intermediate;
    int32_t shared_intermediate;
    int32_t clamp; /* 1: clamp with limit; 0: no clamp */
    float limit;
    int32_t reserved;
    const void* shared_scale;    /* bf16 gate logits of the shared expert, or NULL: unscaled */
    int64_t shared_scale_stride; /* elements between tokens' shared_scale */
    int64_t down_expert_stride;  /* elements; 0 (with down_row_stride 0): D * I */
    int64_t down_row_stride;     /* elements; 0 (with down_expert_stride 0): I */
} EngramMoeExperts;
ENGRAM_API int engram_moe_experts_workspace_size(
    int64_t num_tokens, int32_t top_k, int32_t intermediate, int32_t shared_intermediate, size_t* bytes);
ENGRAM_API int engram_moe_experts_bf16(const EngramMoeExperts* args, cudaStream_t stream);

/* engram_moe_experts_grouped_bf16: engram_moe_experts_bf16's contract (the same struct, the
 * same roundings and the same sums' order per token, pick and row: each output equals
 * engram_moe_experts_bf16's bit for bit on the same tokens) for a batch of decode streams,
 * 0 <= T <= ENGRAM_MOE_GROUPED_MAX_TOKENS, in three launches (decodeMoeGroupedKernel.cu):
 * the (token, pick) pairs grouped by expert on the device, so that each picked expert's
 * gate / up / down rows are read from HBM once a step and the shared expert's once for all
 * tokens (engram_moe_experts_bf16 reads them once per pair); then the picks combined per
 * token in the contract's order. No host synchronization (a CUDA graph records it).
 * workspace: engram_moe_experts_grouped_workspace_size bytes (h [T, top_k + 1, max(I, I_s)]
 * and y [T, top_k + 1, D], bf16). Limits otherwise engram_moe_experts_bf16's. */
#define ENGRAM_MOE_GROUPED_MAX_TOKENS 64
ENGRAM_API int engram_moe_experts_grouped_workspace_size(int64_t num_tokens, int32_t top_k, int32_t hidden,
    int32_t intermediate, int32_t shared_intermediate, size_t* bytes);
ENGRAM_API int engram_moe_experts_grouped_bf16(const EngramMoeExperts* args, cudaStream_t stream);

/* engram_hc_mix_bf16: the end of a Qwen4Exp hyper-connection's mix in one launch (the
 * reference: models/qwen4_exp/modules.py GatedResidual.mix after its norm and its two
 * products of the normed streams), bf16, with bf() rounding to bf16 and hc streams of
 * hidden D. Per token t:
 *   a = bf(silu(bf(down_out[t] / hc)))                        [rank]
 *   w[h, d] = bf(sigmoid(bf(up[h * D + d] . a)))              (float32 sums)
 *   mixed[t, d] = bf((sum_h bf(w[h, d] * normed[t, h * D + d])) * (1 / hc))  (h in order)
 *   inject[t, h] = 2 * bf(sigmoid(bf(inject_logits[t, h] / hc)))   (when inject_logits)
 * down_out [T, rank] (rows down_out_stride apart), up [hc * D, rank] row-major, normed
 * [T, hc * D] (rows normed_stride apart), mixed [T, D] contiguous; inject_logits [T, hc]
 * (rows inject_stride apart) and inject [T, hc] contiguous (both NULL: no injection).
 * Limits: compute capability 9.0 or later; 0 <= T <= ENGRAM_HC_MIX_MAX_TOKENS; rank a
 * positive multiple of 8 with T * rank <= ENGRAM_HC_MIX_MAX_ELEMENTS; 1 <= hc <= 16; up
 * and down_out 16-byte aligned (down_out_stride a multiple of 8); mixed apart from the
 * inputs. */
#define ENGRAM_HC_MIX_MAX_TOKENS 16
#define ENGRAM_HC_MIX_MAX_ELEMENTS 12288
typedef struct EngramHcMix
{
    const void* down_out;
    const void* up;
    const void* normed;
    const void* inject_logits;
    void* mixed;
    void* inject;
    int64_t num_tokens;
    int64_t down_out_stride;
    int64_t normed_stride;
    int64_t inject_stride;
    int32_t hidden;
    int32_t hc;
    int32_t rank;
    int32_t reserved;
} EngramHcMix;
ENGRAM_API int engram_hc_mix_bf16(const EngramHcMix* args, cudaStream_t stream);

/* engram_gdn_gates_bf16 and engram_gated_rms_norm_bf16: a Qwen4Exp Gated DeltaNet decode
 * step's glue around its core kernels (gdnGlueKernel.cu; the references: GatedDeltaNet.
 * forward_decode's gates and models/qwen4_exp/norms.py GatedRMSNorm.forward), bf() rounding
 * to bf16, float32 arithmetic in the reference's order.
 * Gates, per token t and value head h (T tokens, heads H):
 *   beta[t, h] = float(bf(sigmoid(b[t, h])))                       float32 [T, H] contiguous
 *   g[t, h] = neg_decay[h] * softplus(float(a[t, h]) + float(dt_bias[h]))    float32 [T, H]
 *   softplus(x) = x > 20 ? x : log1p(exp(x)) (torch's, beta 1, threshold 20)
 * b and a bf16 [T, H] (rows b_stride / a_stride apart), dt_bias [H] bf16 or float32
 * (dt_bias_float), neg_decay float32 [H] (-exp(A_log)).
 * Norm, per token t and head h, x_h = x[t, h * dim : (h + 1) * dim] (float32 x rounded to
 * bf16 first):
 *   y = bf(x_h * rsqrt(sum(x_h^2) * (1 / dim) + eps))
 *   out[t, h * dim + c] = bf(bf(weight[c] * y[c]) * act(gate[t, h * dim + c]))
 *   act: silu (ENGRAM_GATE_ACT_SILU) or sigmoid (ENGRAM_GATE_ACT_SIGMOID), in float32
 * x [T, H * dim] bf16 or float32 (x_float; rows x_stride apart), gate bf16 [T, H * dim] (rows
 * gate_stride apart), weight bf16 [dim], out bf16 [T, H * dim] contiguous, apart from the
 * inputs. The sum of squares' order is the kernel's own (the only difference from torch).
 * Limits (both): compute capability 9.0 or later; 0 <= T <= ENGRAM_GDN_GLUE_MAX_TOKENS;
 * 1 <= H <= ENGRAM_GDN_GLUE_MAX_HEADS. */
#define ENGRAM_GDN_GLUE_MAX_TOKENS 16
#define ENGRAM_GDN_GLUE_MAX_HEADS 4096
#define ENGRAM_GATE_ACT_SILU 0
#define ENGRAM_GATE_ACT_SIGMOID 1
typedef struct EngramGdnGates
{
    const void* b;
    const void* a;
    const void* dt_bias;
    const float* neg_decay;
    float* beta;
    float* g;
    int64_t num_tokens;
    int64_t b_stride;
    int64_t a_stride;
    int32_t heads;
    int32_t dt_bias_float; /* 1: dt_bias float32; 0: bf16 */
} EngramGdnGates;
ENGRAM_API int engram_gdn_gates_bf16(const EngramGdnGates* args, cudaStream_t stream);

typedef struct EngramGatedNorm
{
    const void* x;
    const void* gate;
    const void* weight;
    void* out;
    int64_t num_tokens;
    int64_t x_stride;
    int64_t gate_stride;
    int32_t heads;
    int32_t dim;
    int32_t activation; /* ENGRAM_GATE_ACT_* */
    int32_t x_float;    /* 1: x float32; 0: bf16 */
    float eps;
    int32_t reserved;
} EngramGatedNorm;
ENGRAM_API int engram_gated_rms_norm_bf16(const EngramGatedNorm* args, cudaStream_t stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* ENGRAM_TRT_DECODE_KERNELS_H */
