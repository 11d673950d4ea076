// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * engram-trt kernel library, Qwen4-Exp's PLE hash and PLE fusion (pleHashKernel.cu, pleFusionKernel.cu).
 * Part of the C ABI of engramKernels.h (the umbrella header), whose conventions hold here.
 */
#ifndef ENGRAM_TRT_PLE_KERNELS_H
#define ENGRAM_TRT_PLE_KERNELS_H

#include "engramKernelsCore.h"

#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/*
 * Qwen4-Exp PLE n-gram hash of packed sequences, one PLE layer (pleHashKernel.cu;
 * bit-identical to engram_trt.engram.ple_hash.ple_hash_packed, which transformers'
 * Qwen4ExpTextNGramEmbedding is the reference of).
 *
 * Per token and head j (order g = j / heads_per_ngram + 2): w[0] = the token, w[k] =
 *   the token k back, or eos_id once an EOS lies among the tokens 1..k back (n-grams
 *   do not cross an EOS); mixed = XOR of w[k] * multipliers[k] for k < g (int64);
 *   out = mixed mod primes[j] + offsets[j].
 *
 * ids          [T] int32 device: raw token ids of all sequences back to back.
 * seq_starts   [S+1] int32 device: cu_seqlens (0, ..., T, non-decreasing). A token
 *              outside [seq_starts[0], seq_starts[S]) has no context (reads EOS before it).
 * context      [S, N-1] int32 device: the N-1 raw ids before each sequence's first token,
 *              oldest first (all eos_id for a sequence that starts in this step); NULL =
 *              every sequence starts fresh.
 * multipliers_host [N], primes_host [H], offsets_host [H] int64 (H = (N-1) *
 *              heads_per_ngram): the layer's constants (host memory, copied).
 * eos_id, vocab_size, table_rows: the checks: eos_id in [0, vocab_size), every
 *              multiplier * (vocab_size - 1) fits int64, every head's rows inside
 *              [0, table_rows), table_rows < 2^31 (int32 row ids).
 * out          [T, H] int32 device: rows of the layer's table.
 * Limits: 2 <= N <= ENGRAM_PLE_HASH_MAX_NGRAM, H <= ENGRAM_PLE_HASH_MAX_HEADS,
 * T * H < 2^31. Ids outside [0, vocab_size) are a caller bug (they wrap as torch's int64).
 */
#define ENGRAM_PLE_HASH_MAX_NGRAM 16
#define ENGRAM_PLE_HASH_MAX_HEADS 128
ENGRAM_API int engram_ple_hash(const int32_t* ids, int64_t num_tokens, const int32_t* seq_starts, int64_t num_seqs,
    const int32_t* context, const int64_t* multipliers_host, const int64_t* primes_host, const int64_t* offsets_host,
    int32_t ngram_size, int32_t heads_per_ngram, int64_t eos_id, int64_t vocab_size, int64_t table_rows, int32_t* out,
    cudaStream_t stream);

/* The layout checks engram_ple_hash makes, alone (the plugin runs them at creation). */
ENGRAM_API int engram_ple_hash_check_layout(const int64_t* multipliers_host, const int64_t* primes_host,
    const int64_t* offsets_host, int32_t ngram_size, int32_t heads_per_ngram, int64_t eos_id, int64_t vocab_size,
    int64_t table_rows);

/* A prepared PLE hash layout of one layer (as EngramHashLayout: no device memory,
 * immutable, needs no GPU to create; destroy must not race a call that uses it). */
typedef struct EngramPleHashLayout EngramPleHashLayout;
ENGRAM_API int engram_ple_hash_layout_create(const int64_t* multipliers_host, const int64_t* primes_host,
    const int64_t* offsets_host, int32_t ngram_size, int32_t heads_per_ngram, int64_t eos_id, int64_t vocab_size,
    int64_t table_rows, EngramPleHashLayout** layout);
ENGRAM_API int engram_ple_hash_layout_destroy(EngramPleHashLayout* layout);

/* engram_ple_hash with a prepared layout: same ids / seq_starts / context / out contract. */
ENGRAM_API int engram_ple_hash_prepared(const EngramPleHashLayout* layout, const int32_t* ids, int64_t num_tokens,
    const int32_t* seq_starts, int64_t num_seqs, const int32_t* context, int32_t* out, cudaStream_t stream);

/*
 * Qwen4-Exp PLE fusion of a packed step, one PLE layer (pleFusionKernel.cu; the reference
 * is engram_trt.models.qwen4_exp.modules.PLEFusion, tied to transformers'
 * Qwen4ExpTextPLELayer). The two projections stay GEMMs outside: key = key_proj(rows),
 * value = value_proj(rows). With D = hidden, W = hc_count * D, per token t and stream c
 * (offset RMSNorms: x * rsqrt(mean(x^2) + eps) * (1 + w), per stream of D):
 *   score  = <norm_key(key[t, c]), norm_query(streams[t, c])> / sqrt(D)
 *   g      = sigmoid(sign(score) * sqrt(max(|score|, 1e-6)))      (NaN in, NaN out)
 *   gated  = g * value[t];  normed = norm_conv(gated), rounded to io_type
 *   out[t, ch] = gated + silu(sum_j conv_weight[ch, j] * normed(pos - (K-1-j) * dilation))
 *                (+ streams[t, ch] with add_streams)
 * normed of an earlier position comes from this step's tokens of the same sequence or
 * from conv_state (zero before the sequence's first token); fp32 math, out rounded once.
 *
 * streams, key  [T, W]; value [T, D]; out [T, W]: one io_type (bf16, fp16, fp32).
 * norm_*_weight [W] and conv_weight [W, K] (the checkpoint's [W, 1, K]): weight_type,
 *               fp32 or the io_type.
 * conv_state    [num_slots, W, H] io_type, H = (K-1) * dilation, updated in place: row
 *               (slot, ch) holds the normed values of positions past - H .. past - 1.
 *               After the call it holds the last H values of [its old row (zeros when
 *               past_lens = 0), the sequence's normed values of this step]. May be NULL
 *               when H = 0 or num_slots = 0.
 * seq_starts    [S+1] int32 device: cu_seqlens in [0, T], non-decreasing; a sequence's
 *               tokens are consecutive, in order. past_lens [S], seq_slots [S] int32 device:
 *               the sequence's cached length (its first token's position) and its slot.
 *               A token outside [seq_starts[0], seq_starts[S]) gets a zero update (or
 *               streams); a slot outside [0, num_slots) reads zeros and keeps nothing.
 *               Two sequences of one step must not share a slot.
 * workspace     engram_ple_fusion_workspace_size(T, ...) bytes, 16-byte aligned.
 * out may be streams (in place, with add_streams: streams += update); it must not overlap
 * key or value. Limits: D % 8 == 0; 1 <= K <= ENGRAM_PLE_FUSION_MAX_KERNEL,
 * 1 <= dilation <= ENGRAM_PLE_FUSION_MAX_DILATION; T * hc_count < 2^31; streams, key,
 * value, norm weights, workspace and out 16-byte aligned.
 */
#define ENGRAM_PLE_FUSION_MAX_KERNEL 32
#define ENGRAM_PLE_FUSION_MAX_DILATION 256

/* The shape checks engram_ple_fusion makes (the plugin runs them at creation). */
ENGRAM_API int engram_ple_fusion_check_shape(
    int32_t hc_count, int32_t hidden, int32_t kernel, int32_t dilation, float eps);

/* Bytes of workspace engram_ple_fusion needs for up to max_tokens tokens; needs no GPU. */
ENGRAM_API int engram_ple_fusion_workspace_size(
    int64_t max_tokens, int32_t hc_count, int32_t hidden, int32_t io_type, size_t* bytes);

ENGRAM_API int engram_ple_fusion(const void* streams, const void* key, const void* value, int32_t io_type,
    const void* norm_key_weight, const void* norm_query_weight, const void* norm_conv_weight, const void* conv_weight,
    int32_t weight_type, void* conv_state, int64_t num_slots, const int32_t* seq_starts, const int32_t* past_lens,
    const int32_t* seq_slots, int64_t num_seqs, int64_t num_tokens, int32_t hc_count, int32_t hidden, int32_t kernel,
    int32_t dilation, float eps, int32_t add_streams, void* workspace, size_t workspace_bytes, void* out,
    cudaStream_t stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* ENGRAM_TRT_PLE_KERNELS_H */
