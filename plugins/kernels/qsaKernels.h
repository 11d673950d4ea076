// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * engram-trt kernel library, Qwen4-Exp's QSA attention core (qsaAttentionKernel.cu).
 * Part of the C ABI of engramKernels.h (the umbrella header), whose conventions hold here.
 */
#ifndef ENGRAM_TRT_QSA_KERNELS_H
#define ENGRAM_TRT_QSA_KERNELS_H

#include "engramKernelsCore.h"

#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ======================================================================================
 * QSA attention: Qwen4-Exp's gated full attention's core with the block indexer, over a
 * packed step and slot caches (qsaAttentionKernel.cu; the float64 reference is
 * engram_trt.builder.reference_qsa, tied to models/qwen4_exp/attention.GatedAttention).
 *
 * q, out [T, num_heads, head_dim]; k, v [T, num_kv_heads, head_dim]; index_q [T,
 * index_heads, index_dim] (q, k and index_q already normed and rotated); index_raw
 * [T, index_dim] (raw indexer keys); key_cache / value_cache [num_slots, num_kv_heads,
 * max_seq_len, head_dim] and index_key_cache [num_slots, max_seq_len, index_dim], in
 * place; all of one io_type. index_k_norm_weight [index_dim] (offset RMSNorm: scale
 * 1 + w) fp32 or io_type. token_slot / token_pos int32 [T].
 *   write   every token's k, v, index_raw at (token_slot[t], token_pos[t]) first;
 *   attend  token t at position p reads positions 0..p of its slot: with nb = (p + 1) /
 *           compress_ratio complete blocks and nb > block_topk, only the block_topk best
 *           blocks by sum_h relu(index_q_h . key_b) / sqrt(index_dim) plus the tail after
 *           block nb - 1, key_b = RoPE(RMSNorm(mean of block b's raw keys, rounded),
 *           rounded) at position b * compress_ratio (rot_dim features, rope_theta);
 *           equal scores go to the LOWER block index. Scores q . K * scaling in fp32,
 *           the softmax probabilities rounded to io_type before V, fp32 sums, out
 *           rounded once. Query head h reads KV head h / (num_heads / num_kv_heads).
 * A token outside the caches (slot or position out of range) writes nothing and gets a
 * zero row; two tokens must not name the same (slot, position).
 * workspace: engram_qsa_workspace_size bytes (0 when max_seq_len / compress_ratio <=
 * block_topk: nothing can be dropped); a smaller one runs the tokens in smaller chunks.
 * Limits: head_dim, index_dim <= ENGRAM_QSA_MAX_HEAD_DIM; index_heads <=
 * ENGRAM_QSA_MAX_INDEX_HEADS; rot_dim even, <= head_dim and index_dim;
 * (block_topk + 1) * compress_ratio <= ENGRAM_QSA_MAX_VISIBLE (the most positions a query
 * attends, in shared memory); out must not overlap q or the caches.
 */
#define ENGRAM_QSA_MAX_HEAD_DIM 256
#define ENGRAM_QSA_MAX_INDEX_HEADS 64
#define ENGRAM_QSA_MAX_VISIBLE 16384

/* The checks of the plugin's fields, and of the shapes across them (need no GPU). */
ENGRAM_API int engram_qsa_check_fields(
    int32_t compress_ratio, int32_t block_topk, int32_t rot_dim, float rope_theta, float eps, float scaling);
ENGRAM_API int engram_qsa_check_shape(
    int32_t num_heads, int32_t num_kv_heads, int32_t head_dim, int32_t index_heads, int32_t index_dim, int32_t rot_dim);
ENGRAM_API int engram_qsa_workspace_size(
    int64_t max_tokens, int64_t max_seq_len, int32_t compress_ratio, int32_t block_topk, size_t* bytes);
ENGRAM_API int engram_qsa_attention(const void* q, const void* k, const void* v, const void* index_q,
    const void* index_raw, int32_t io_type, void* key_cache, void* value_cache, void* index_key_cache,
    const void* index_k_norm_weight, int32_t weight_type, const int32_t* token_slot, const int32_t* token_pos,
    int64_t num_tokens, int32_t num_heads, int32_t num_kv_heads, int32_t head_dim, int32_t index_heads,
    int32_t index_dim, int64_t num_slots, int64_t max_seq_len, int32_t compress_ratio, int32_t block_topk,
    int32_t rot_dim, float rope_theta, float eps, float scaling, void* workspace, size_t workspace_bytes, void* out,
    cudaStream_t stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* ENGRAM_TRT_QSA_KERNELS_H */
