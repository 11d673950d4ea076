// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * engram-trt kernel library: weights computed in the format a checkpoint stores them
 * (FP8 E4M3 with block scales, FP4 E2M1 experts with per-32 scales, BF16), the C ABI.
 * Included by engramKernels.h; its conventions (return codes, engram_last_error, device
 * pointers, streams) hold here. docs/quantization.md states the formats and which
 * reference each computation follows.
 *
 * Formats (checkpoint-formats facts):
 *   FP8 weight W [N, K]: e4m3 bytes w [N, K]; scales s [ceil(N/bn), ceil(K/bk)], float32
 *     or ue8m0 bytes (value 2^(byte-127)); W[n, k] = e4m3(w[n, k]) * s[n / bn, k / bk]
 *     (the last block of a dimension that is not a multiple of the block is partial).
 *   FP4 weight W [N, K]: bytes w [N, K/2], element 2j in bits 0-3 and 2j+1 in bits 4-7;
 *     e2m1 codes 0..7 = 0, 0.5, 1, 1.5, 2, 3, 4, 6, bit 3 the sign; scales as above with
 *     (bn, bk) = (1, 32) in the published checkpoints (any bn >= 1, bk even).
 *   BF16 weight W [N, K]: no scales.
 *   Experts: E weights of one kind stacked [E, N, K(/2)] with scales [E, ...], expert e at
 *     e * (its bytes).
 *
 * Rows and experts. The GEMV and GEMM take P output rows; row p reads activation row
 * row_index[p] (NULL: row p) and, with E > 1, the expert whose range of the expert
 * offsets holds p: rows offsets[e] .. offsets[e+1]-1 belong to expert e (offsets [E+1]
 * int32 device, non-decreasing, offsets[0] = 0, offsets[E] = P). E = 1 takes offsets
 * NULL (every row expert 0). engram_moe_plan makes order, row_index, offsets and the
 * active-expert slots of a routed step on the device (no host synchronization), so a
 * MoE step can be captured in a CUDA graph.
 */
#ifndef ENGRAM_TRT_QUANT_KERNELS_H
#define ENGRAM_TRT_QUANT_KERNELS_H

#include "decodeKernels.h" /* EngramGemvPrologue (engram_quant_gemv_segments_ex) */

#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#ifndef ENGRAM_API
#if defined(__GNUC__)
#define ENGRAM_API __attribute__((visibility("default")))
#else
#define ENGRAM_API
#endif
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Weight element formats. */
enum EngramQuantWeightType
{
    ENGRAM_QWEIGHT_FP8_E4M3 = 0, /* one byte per value, block scales */
    ENGRAM_QWEIGHT_FP4_E2M1 = 1, /* two values per byte (low nibble first), block scales */
    ENGRAM_QWEIGHT_BF16 = 2      /* bf16, no scales (w_scale NULL) */
};

/* Scale element formats. */
enum EngramQuantScaleType
{
    ENGRAM_QSCALE_F32 = 0,  /* float32 */
    ENGRAM_QSCALE_UE8M0 = 1 /* one byte b: 2^(b - 127); b = 255 is NaN */
};

/* Float I/O element types: the EngramFloatType codes of engramKernels.h
 * (ENGRAM_FLOAT_BF16 = 0, ENGRAM_FLOAT_F32 = 1, ENGRAM_FLOAT_F16 = 2). */

/* Most output rows one GEMV block keeps in registers at a time; more rows of one expert
 * are taken in passes of this many (the weight read again from L2). */
#define ENGRAM_QGEMV_MAX_ROWS 8

/*
 * Dynamic activation quantization, per row and group of `group` columns (the published
 * FP8 inference's per-token-group cast):
 *   amax = max |x[m, k]| over the group (a partial last group over the columns it has)
 *   s    = max(amax, 1e-4) / 448   (float32 division);   with ue8m0: s = 2^ceil(log2(s)),
 *          exactly (the exponent of s, plus one unless s already is a power of two)
 *   q    = e4m3_rn_satfinite(x * (1 / s))          (1 / s rounded to float32 first)
 * x [M, K] of x_type (EngramFloatType; row stride ldx elements, ldx >= K). Outputs, each
 * optional (NULL), at least one given:
 *   q      [M, K] e4m3 bytes (row stride K);
 *   scale  [M, ceil(K / group)] float32: s;
 *   deq    [M, K] of deq_type (EngramFloatType, row stride K): e4m3(q) * s in float32,
 *          rounded once to deq_type: what the reference's matrix product multiplies (exact
 *          in bf16 only when s is a power of two, i.e. with ue8m0).
 * group >= 1 (16, 32, 64, 128 are used); M >= 0 (0 launches nothing); K >= 1.
 * quant/formats.py act_quant is the statement the GPU tests hold this to, bit for bit.
 */
ENGRAM_API int engram_act_quant(const void* x, int32_t x_type, int64_t num_rows, int64_t cols, int64_t ldx,
    int32_t group, int32_t ue8m0, void* q, float* scale, void* deq, int32_t deq_type, cudaStream_t stream);

/*
 * The expert MLP's activation between the two projections, then the activation
 * quantization of engram_act_quant on its result:
 *   g = gate_up[p, i], u = gate_up[p, I + i]          (float32 [P, 2I], row stride ld >= 2I)
 *   limit > 0: g = min(g, limit), u = clamp(u, -limit, limit)   (DeepSeek-V4's clamped SwiGLU)
 *   h = g / (1 + exp(-g)) * u  (float32), then quantized per `group` columns as
 *   engram_act_quant (group 0: no quantization, q and scale must be NULL, deq = h rounded
 *   once to deq_type). Outputs as engram_act_quant's (q, scale, deq), [P, I].
 */
ENGRAM_API int engram_swiglu_act_quant(const float* gate_up, int64_t num_rows, int64_t intermediate, int64_t ld,
    float limit, int32_t group, int32_t ue8m0, void* q, float* scale, void* deq, int32_t deq_type, cudaStream_t stream);

/*
 * A routed step's plan, on the device: ids [T, k] (int32 or int64 by ids_is_int64) are
 * each token's picked experts (0 <= id < E; an id outside is an error reported through
 * error_flag: *error_flag set to 1, and the pair belongs to no expert). Outputs (int32
 * device):
 *   offsets   [E + 1]: rows of expert e are offsets[e] .. offsets[e+1]-1 of the sorted pairs
 *             (offsets[E] = the pairs with an id in range);
 *   order     [T * k]: order[r] = the pair (t * k + j) at sorted row r (pairs of one expert
 *             in increasing pair order: the plan is deterministic); the pairs of no expert
 *             follow offsets[E] in increasing order, so order is always a permutation;
 *   row_token [T * k]: row_token[r] = order[r] / k, the activation row of sorted row r;
 *   pair_row  [T * k] (may be NULL): the inverse of order, pair_row[order[r]] = r: where
 *             pair (t, j)'s output row is (the combine gathers by it, no scatter);
 *   slot_expert [num_slots]: the experts with at least one row in increasing order, -1
 *             after the last (num_slots >= min(T * k, E) covers every active expert);
 *   error_flag [1] (may be NULL): set to 1 when an id is out of range, else left as it was
 *             (the caller zeroes it once).
 * One block (sync-free: nothing is read back on the host). Limits: T * k <= 1 << 20,
 * 1 <= E <= 4096, 1 <= k; T = 0 still writes offsets (zeros) and slot_expert (-1).
 */
ENGRAM_API int engram_moe_plan(const void* ids, int32_t ids_is_int64, int64_t num_tokens, int32_t top_k,
    int32_t num_experts, int32_t* offsets, int32_t* order, int32_t* row_token, int32_t* pair_row, int32_t* slot_expert,
    int32_t num_slots, int32_t* error_flag, cudaStream_t stream);

/*
 * Matrix-vector products for a few rows per weight, reading each weight's bytes once per
 * pass (decode steps; the MoE's routed experts):
 *   out[p, o_col0 + n] = sum_k a[row_index[p], k] * W_e[n, k]     (float32 sums)
 * a      float32 or bf16 (a_type: EngramFloatType F32 or BF16) [*, K], row stride lda: the
 *        activations as the reference's product sees them (engram_act_quant's deq, or
 *        unquantized); 16-byte aligned, lda a multiple of 16 bytes' worth of elements;
 * W_e    expert e's weight (w_type, w_scale, scale_type, bn, bk as the formats above;
 *        experts stacked, E >= 1); 16-byte aligned; bk a multiple of 16 (FP8) or 32 (FP4)
 *        (each 16-byte vector of a row lies in one scale block), bn >= 1;
 * rows   P; with E > 1, offsets [E + 1] and slot_expert [num_slots] (engram_moe_plan's:
 *        one block row of the grid per slot, a slot of -1 exits); with E = 1 both NULL and
 *        num_slots = 1;
 * out    out_type [P, ldo] (EngramFloatType; ldo >= o_col0 + N): columns o_col0 ..
 *        o_col0 + N - 1 written, so a gate and an up projection can fill the two halves of
 *        one buffer.
 * K: a multiple of 16 for FP8, of 32 for FP4, of 8 for BF16 (rows of whole 16-byte
 * vectors); P >= 0 (0 launches nothing). Any GPU the library is built for (sm_80+).
 * Sums: per output, each lane of a warp sums the VPV products of each of its 16-byte
 * vectors (VPV = 16 FP8, 32 FP4, 8 BF16 values) in a float32 FMA chain, adds it times the
 * vector's block scale (one FMA) over its ceil(K / (32 VPV)) vectors, and the 32 lanes'
 * sums are added in 5 levels: every product passes at most VPV + ceil(K / (32 VPV)) + 6
 * float32 roundings, then the output's one.
 * Layout (quantGemvKernel.cu): warps of 2 weight rows (4 for 3+ rows a pass), 16-byte
 * streaming loads, the activations of a pass staged once per block in shared memory; rows
 * of an expert per pass: the smallest power of two >= min(ENGRAM_QGEMV_MAX_ROWS, P /
 * num_slots rounded up), fewer where the staged rows would not fit the shared memory, more
 * rows in further passes (the weight read again, from L2). Launched as a programmatic
 * dependent launch on sm_90+ (it waits for the kernel before it before it reads a, row_index,
 * offsets or slot_expert, or writes out). Tuning knobs, read at each call (a CUDA graph
 * keeps what its capture saw): ENGRAM_TRT_QGEMV_WAVES = the grid's cap in waves of resident
 * blocks (default 1; 0: a warp per weight-row group), ENGRAM_TRT_QGEMV_STAGE=0: one-row
 * passes read the activations from global memory.
 */
ENGRAM_API int engram_quant_gemv(const void* a, int32_t a_type, int64_t lda, const int32_t* row_index, int64_t num_rows,
    const void* w, int32_t w_type, const void* w_scale, int32_t scale_type, int32_t bn, int32_t bk,
    int64_t out_features, int64_t in_features, int32_t num_experts, const int32_t* offsets, const int32_t* slot_expert,
    int32_t num_slots, void* out, int32_t out_type, int64_t ldo, int64_t o_col0, cudaStream_t stream);

/*
 * engram_quant_gemv with flags (engram_quant_gemv is this with flags 0):
 *   ENGRAM_QGEMV_WEIGHT_STATIC promises that no work queued on the stream before this call
 *   writes w or w_scale (a model's weights): with one weight (E = 1) the kernel then loads
 *   its first weight vectors before it waits for the kernel before it (programmatic
 *   dependent launch, sm_90+, off with ENGRAM_TRT_PDL=0). Without it nothing is read
 *   before that kernel completes. Experts ignore it (their weight depends on slot_expert).
 *   ENGRAM_QGEMV_ACT_Q128_F32 / ENGRAM_QGEMV_ACT_Q32_UE8M0 (at most one): a is the raw
 *   activations (float32 or bf16), quantized inside the GEMV exactly as engram_act_quant
 *   with group 128 and float32 scales / group 32 and ue8m0 scales, the product taking its
 *   deq in float32: the same bits as engram_act_quant (deq float32) then the GEMV, one
 *   launch instead of two (each block quantizes the rows it stages). Needs a row of K
 *   floats to fit a block's shared memory (K <= 16384 fits every GPU of sm_80+):
 *   cudaErrorNotSupported otherwise.
 * Other bits: cudaErrorInvalidValue.
 */
#define ENGRAM_QGEMV_WEIGHT_STATIC 1u
#define ENGRAM_QGEMV_ACT_Q128_F32 2u
#define ENGRAM_QGEMV_ACT_Q32_UE8M0 4u
ENGRAM_API int engram_quant_gemv_ex(const void* a, int32_t a_type, int64_t lda, const int32_t* row_index,
    int64_t num_rows, const void* w, int32_t w_type, const void* w_scale, int32_t scale_type, int32_t bn, int32_t bk,
    int64_t out_features, int64_t in_features, int32_t num_experts, const int32_t* offsets, const int32_t* slot_expert,
    int32_t num_slots, void* out, int32_t out_type, int64_t ldo, int64_t o_col0, uint32_t flags, cudaStream_t stream);

/*
 * FP8 x FP8 block-scaled matrix product on the tensor cores (mma e4m3, float32
 * accumulation of each 128-column block, promoted into a float32 sum with its scales;
 * sm_89 or later), for prefill:
 *   out[p, n] = sum_kb a_scale[r, kb] * s_e[n / bn, kb] * sum_{k in block kb} aq[r, k] * w_e[n, k]
 *   with r = row_index[p] (NULL: p), e the expert of row p (as engram_quant_gemv).
 * aq [*, K] e4m3 bytes (row stride K) and a_scale [*, ceil(K/128)] float32 from
 * engram_act_quant with group 128; w [E, N, K] e4m3, w_scale float32 or ue8m0
 * [E, ceil(N/bn), ceil(K/128)]: bk must be 128, bn >= 1 (any; read per column).
 * K % 16 == 0, aq and w 16-byte aligned. out out_type [P, ldo] (ldo >= N), columns
 * 0..N-1 (pass out + c for a column offset). With E > 1 the grid covers
 * ceil(P / 128) + E row tiles (an expert's rows never share a tile with another's);
 * offsets as engram_quant_gemv's. cudaErrorNotSupported before sm_89.
 */
ENGRAM_API int engram_fp8_gemm(const uint8_t* aq, const float* a_scale, const int32_t* row_index, int64_t num_rows,
    const uint8_t* w, const void* w_scale, int32_t scale_type, int32_t bn, int64_t out_features, int64_t in_features,
    int32_t num_experts, const int32_t* offsets, void* out, int32_t out_type, int64_t ldo, cudaStream_t stream);

/*
 * Grouped matrix product with FP4 (or BF16) expert weights dequantized in shared memory
 * to bf16, on bf16 tensor cores (mma bf16, float32 accumulation; Hopper has no FP4
 * tensor cores), for prefill:
 *   out[p, n] = sum_k a[row_index[p], k] * W_e[n, k]
 * a bf16 [*, K] (row stride lda, a multiple of 8): the activations as the reference's
 * product sees them (engram_act_quant's deq in bf16 with ue8m0 scales is exact); w_type
 * FP4_E2M1 (scales as the formats above, bk a multiple of 32; a weight value is
 * e2m1 * scale rounded once to bf16: exact with ue8m0 scales) or BF16 (w_scale NULL);
 * offsets / E / out as engram_fp8_gemm's. K % 32 == 0 for FP4 (% 8 for BF16), a and w
 * 16-byte aligned. sm_80 or later.
 */
ENGRAM_API int engram_quant_grouped_gemm(const void* a, int64_t lda, const int32_t* row_index, int64_t num_rows,
    const void* w, int32_t w_type, const void* w_scale, int32_t scale_type, int32_t bn, int32_t bk,
    int64_t out_features, int64_t in_features, int32_t num_experts, const int32_t* offsets, void* out, int32_t out_type,
    int64_t ldo, cudaStream_t stream);

/*
 * A routed step's expert outputs back in token order, weighted by their routing weights
 * (the combine after the down projection of engram_quant_gemv / the grouped GEMMs over
 * engram_moe_plan's sorted rows):
 *   out[t, d] = sum_{j < k, 0 <= ids[t, j] < E} route_w[t, j] * y[pair_row[t * k + j], d]
 * float32 products summed in j order, rounded once to out_type. y float32 [T * k, ldy >= D]
 * (the sorted rows), pair_row [T * k] int32 (engram_moe_plan's), ids [T, k] int32 or int64
 * (ids_is_int64; a pair whose id is outside [0, E) adds nothing, its row never read),
 * route_w float32 [T, k], out out_type [T, ldo >= D] (EngramFloatType). T = 0 launches
 * nothing. Added for the EngramRoutedExperts plugin (the torch path sums with torch ops).
 */
ENGRAM_API int engram_moe_combine(const float* y, int64_t ldy, const int32_t* pair_row, const void* ids,
    int32_t ids_is_int64, const float* route_w, int64_t num_tokens, int32_t top_k, int32_t num_experts, int64_t cols,
    void* out, int32_t out_type, int64_t ldo, cudaStream_t stream);

/*
 * Dequantize a weight into a float buffer (out_type EngramFloatType) [E, N, K]: e4m3 /
 * e2m1 value times its block scale in float32, rounded once to out_type (BF16 weights are
 * copied). The export, the tests and a fallback read it; serving never materializes it.
 * K even for FP4; any bn, bk >= 1.
 */
ENGRAM_API int engram_quant_dequantize(const void* w, int32_t w_type, const void* w_scale, int32_t scale_type,
    int32_t bn, int32_t bk, int64_t out_features, int64_t in_features, int32_t num_experts, void* out, int32_t out_type,
    cudaStream_t stream);

/*
 * A decode step's stored-format products in one launch (quantDecodeKernel.cu; the
 * DeepSeek-V4 fused decode glue, python/engram_trt/models/deepseek_v4/fused.py):
 * up to ENGRAM_QSEG_MAX_SEGMENTS segments, each
 *   out_s[m, n] = sum_k a_s[m, k] * W_s[n, k]      m < num_tokens (<= ENGRAM_QSEG_MAX_TOKENS)
 * with a_s = x_s[m, :] as given (act_group 0) or quantized per act_group (128 / 32) columns
 * exactly as engram_act_quant (float32 scales, or ue8m0 with act_ue8m0) and taken as its
 * float32 deq; W_s FP8 / FP4 / BF16 as the formats above (bk a multiple of the 16-byte
 * vector's values; partial last blocks). x_s bf16 or float32 (x_type), row stride x_stride
 * (16-byte aligned rows); out_s out_type (EngramFloatType), row stride out_stride. Segments
 * may share x (several projections of one input: each block quantizes the rows it stages,
 * so every segment sees the same bits) or read slices of one buffer (a grouped projection).
 * Each weight byte is read once, in 16-byte vectors; a warp owns 2 weight rows of one
 * segment, a block 4 warps. Sums as engram_quant_gemv's (a lane's VPV products in a
 * float32 chain, times the block scale into its accumulator, a 5-level warp butterfly):
 * every product passes at most VPV + ceil(K / (32 VPV)) + 6 float32 roundings, then the
 * output's. in_features a multiple of 16 (FP8) / 32 (FP4) / 8 (BF16). The staged rows
 * (num_tokens x K rounded up to 32 vectors, float32) must fit a block's shared memory:
 * cudaErrorNotSupported otherwise. flags: ENGRAM_QGEMV_WEIGHT_STATIC (the weights are a
 * model's: each warp's first weight vectors load before the wait for the kernel before;
 * programmatic dependent launch on sm_90+). Nothing read back on the host (CUDA-graph
 * capturable). sm_80 or later.
 */
#define ENGRAM_QSEG_MAX_SEGMENTS 8
#define ENGRAM_QSEG_MAX_TOKENS 8
typedef struct EngramQuantSegment
{
    const void* x;       /* [num_tokens, >= in_features] of x_type, row stride x_stride */
    const void* w;       /* [out_features, in_features(/2 FP4)] of w_type */
    const void* w_scale; /* [ceil(N / bn), ceil(K / bk)] of scale_type; NULL for BF16 */
    void* out;           /* [num_tokens, >= out_features] of out_type, row stride out_stride */
    int64_t x_stride;
    int64_t out_stride;
    int32_t x_type; /* EngramFloatType: BF16 or F32 */
    int32_t out_type;
    int32_t w_type;
    int32_t scale_type;
    int32_t bn;
    int32_t bk;
    int32_t out_features;
    int32_t in_features;
    int32_t act_group; /* 0, 32 or 128 */
    int32_t act_ue8m0;
} EngramQuantSegment;
ENGRAM_API int engram_quant_gemv_segments(
    const EngramQuantSegment* segments, int32_t num_segments, int64_t num_tokens, uint32_t flags, cudaStream_t stream);

/*
 * engram_quant_gemv_segments with each segment's x first taken through *prologue
 * (decodeKernels.h EngramGemvPrologue, engram_gemv_segments_bf16_ex's; NULL or kind NONE:
 * none, engram_quant_gemv_segments itself): the element-wise launch before the product
 * folded into it. Every segment's x is then bf16 (x_type 0), and each value the product
 * sees is what that launch would have written to a bf16 row, quantized after it per the
 * segment's act_group as above, so the outputs equal engram_norm_rope into a bf16 buffer
 * then engram_quant_gemv_segments on it, bit for bit:
 *   ENGRAM_GEMV_PROLOGUE_RMSNORM: x's rows RMS-normalized as engram_norm_rope's
 *     NORM_WEIGHTED job of dim = in_features (every segment's; even, <= 2048): the row's
 *     reciprocal RMS summed as that launch's register form sums it (once a block a token),
 *     y = bf16(weight * (x * r)) (weight [dim] fp32, 16-byte aligned; eps);
 *   ENGRAM_GEMV_PROLOGUE_ROPE: x's heads of dim channels (dim % 8 == 0; a segment's x
 *     starting at a head, its in_features a multiple of dim) rotated as engram_norm_rope's
 *     NORM_NONE job with rope_pairs / rope_sign and cos / sin [tokens, >= rope_pairs] fp32
 *     (cos_stride apart; each rounded to bf16 first), each result rounded to bf16.
 * The prologue's fields are checked as engram_gemv_segments_bf16_ex checks them (with any
 * num_tokens, 0 included); x is read only after the wait for the kernel before, the
 * weights' first vectors before it (ENGRAM_QGEMV_WEIGHT_STATIC) as without a prologue.
 */
ENGRAM_API int engram_quant_gemv_segments_ex(const EngramQuantSegment* segments, int32_t num_segments,
    int64_t num_tokens, uint32_t flags, const EngramGemvPrologue* prologue, cudaStream_t stream);

/*
 * A decode step's routed experts and shared expert with stored-format weights in two
 * launches (quantDecodeKernel.cu): what native/quant.py's experts() followed by the shared
 * expert's QuantLinear products computes, rounded where they round:
 *   launch 1, per token t and pick j (e = ids[t, j]) and per intermediate row i:
 *     g, u = gate_e a(x_t), up_e a(x_t)       (float32; a() the gate's act quantization)
 *     h[t, j, i] = silu(min(g, l)) * clamp(u, -l, l)  (float32, as engram_swiglu_act_quant)
 *   and for the shared expert (all tokens at once, its weight read once):
 *     g, u rounded to bf16 (its products' outputs), clamped, silu rounded to bf16, the
 *     product rounded to bf16 (F.silu(g.clamp(max=l)) * u.clamp(-l, l) in bf16);
 *   launch 2, per token t and output channel d: each h row quantized per its down weight's
 *     act quantization (engram_act_quant's deq in float32), then
 *     routed = bf16(sum_j (route_w[t, j] * y_j))  (float32 products, summed in j order;
 *              a pick outside [0, E) adds nothing), y_j = down_e[d] . a(h[t, j]) float32;
 *     shared = bf16(down_s[d] . a(h_s[t]));  out[t, d] = bf16(routed + shared).
 * x bf16 [T, D] contiguous, out bf16 [T, D]; ids int32 / route_w float32 [T, k]; the routed
 * stacks gate / up [E, I, D], down [E, D, I], the shared gate / up [I_s, D], down [D, I_s]
 * (shared_intermediate 0: none); each weight FP8 / FP4 / BF16 with its own scales and act
 * quantization (quant/weight.py ACT_QUANT: fp8 128 float32, fp4 32 ue8m0, bf16 none).
 * workspace float32 of engram_quant_moe_workspace_size bytes. 1 <= num_tokens <=
 * ENGRAM_QSEG_MAX_TOKENS, top_k <= 16. D, I, I_s multiples of the 16-byte vector's values
 * of the weights that read them. Sums as engram_quant_gemv_segments'. No host
 * synchronization (CUDA-graph capturable).
 */
typedef struct EngramQuantMoeWeight
{
    const void* w; /* stacked [E, N, K(/2)] (routed) or [N, K(/2)] (shared) */
    const void* scale;
    int32_t w_type;
    int32_t scale_type;
    int32_t bn;
    int32_t bk;
    int32_t act_group; /* the activations this weight reads: 0, 32 or 128 */
    int32_t act_ue8m0;
} EngramQuantMoeWeight;
typedef struct EngramQuantMoe
{
    const void* x;
    const int32_t* ids;
    const float* route_w;
    EngramQuantMoeWeight gate;
    EngramQuantMoeWeight up;
    EngramQuantMoeWeight down;
    EngramQuantMoeWeight shared_gate;
    EngramQuantMoeWeight shared_up;
    EngramQuantMoeWeight shared_down;
    float* workspace;
    void* out;
    int64_t num_tokens;
    int64_t workspace_bytes;
    int32_t hidden;
    int32_t top_k;
    int32_t num_experts;
    int32_t intermediate;
    int32_t shared_intermediate;
    int32_t clamp;
    float limit;
    int32_t reserved;
} EngramQuantMoe;
ENGRAM_API int engram_quant_moe_workspace_size(
    int64_t num_tokens, int32_t top_k, int32_t intermediate, int32_t shared_intermediate, size_t* bytes);
ENGRAM_API int engram_quant_moe(const EngramQuantMoe* args, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* ENGRAM_TRT_QUANT_KERNELS_H */
