// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * engram-trt kernel library, packed-token attention over a slot-indexed KV cache and the RoPE + KV write
 * (attentionKernel.cu, attentionWarpKernel.cu, attentionApi.cpp, ropeKernel.cu).
 * Part of the C ABI of engramKernels.h (the umbrella header), whose conventions hold here.
 */
#ifndef ENGRAM_TRT_ATTENTION_KERNELS_H
#define ENGRAM_TRT_ATTENTION_KERNELS_H

#include "engramKernelsCore.h"

#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ======================================================================================
 * Packed-token attention over a slot-indexed KV cache (attentionKernel.cu and
 * attentionWarpKernel.cu).
 *
 * A step packs the tokens of several sequences back to back ([T] tokens); token t
 * belongs to KV-cache slot token_slot[t] and sits at position token_pos[t] of its
 * sequence. The caches are [num_slots, num_kv_heads, max_seq_len, head_dim], row-major,
 * updated in place:
 *   write   key_cache[token_slot[t], h, token_pos[t], :] = k[t, h, :]   (value alike)
 *   attend  out[t, h] = softmax_j(scale * q[t, h] . K[j]) V[j] over the keys
 *           j = 0 .. token_pos[t] (inclusive, causal) of slot token_slot[t], KV head
 *           h / (num_heads / num_kv_heads) (grouped-query attention).
 * Every key a token reads is in the cache: the tokens of a prefill chunk first write
 * their own K/V, then read them back (engram_attention_step orders the two on `stream`).
 * q, out [T, num_heads, head_dim]; k, v [T, num_kv_heads, head_dim]; all of one
 * io_type (EngramFloatType: bf16, fp16 or fp32), 16-byte aligned; fp32 math with an
 * online softmax, the output rounded once to io_type. token_slot / token_pos: int32 [T]
 * device arrays.
 * Bounds: a token whose slot is outside [0, num_slots) or whose position is outside
 * [0, max_seq_len) writes nothing and its output row is zero (a padding token); nothing
 * is ever read or written outside the caches. Two tokens of one step must not name the
 * same (slot, position) (distinct slots per sequence): which write wins is undefined.
 * Keys below a token's position that were never written hold whatever the slot held
 * before (the caller keeps past lengths right).
 * Limits: head_dim % 8 == 0 and 8 <= head_dim <= ENGRAM_ATTENTION_MAX_HEAD_DIM;
 * num_heads % num_kv_heads == 0; num_kv_heads * ceil(group / 8) <= 65535 (the grid);
 * scale finite and > 0.
 */
#define ENGRAM_ATTENTION_MAX_HEAD_DIM 256

/* The shape checks the attention functions make (the plugin runs them at creation). */
ENGRAM_API int engram_attention_check_shape(int32_t num_heads, int32_t num_kv_heads, int32_t head_dim, float scale);

/* Bytes of workspace that engram_attention_packed / _step may use for up to max_tokens
 * tokens (0 when they never split the keys). Decode steps with few tokens split each
 * token's keys over several blocks and merge the partial softmaxes in the workspace;
 * the split count is a pure function of (num_tokens, num_kv_heads, group, max_seq_len),
 * never of the GPU, so an engine built on one machine sizes its workspace right for all. */
ENGRAM_API int engram_attention_workspace_size(
    int64_t max_tokens, int32_t num_heads, int32_t num_kv_heads, int32_t head_dim, int64_t max_seq_len, size_t* bytes);

/* The KV write alone: token t's k / v rows into the caches at (token_slot[t], token_pos[t]). */
ENGRAM_API int engram_kv_cache_write(const void* k, const void* v, int32_t io_type, const int32_t* token_slot,
    const int32_t* token_pos, int64_t num_tokens, int32_t num_kv_heads, int32_t head_dim, void* key_cache,
    void* value_cache, int64_t num_slots, int64_t max_seq_len, cudaStream_t stream);

/*
 * RoPE of a fused q / k / v projection and the KV write, in one launch (ropeKernel.cu):
 * qkv [T, (num_heads + 2 * num_kv_heads) * head_dim] bf16 holds per token its q heads,
 * then its k heads, then its v heads (one GEMM with the three weights stacked by rows);
 * cos / sin [T, head_dim] bf16 are the token's rotary factors (the model's cos / sin of
 * position * inv_freq, each half repeated). With rotate_half(x) = cat(-x2, x1) (the HF
 * Llama convention: the halves of the head dim are the rotating pairs), every q and k
 * head becomes
 *   x' = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin))
 * (torch's bf16 q * c + rotate_half(q) * s, rounding for rounding); q' goes to
 * q_out [T, num_heads, head_dim], k' to key_cache and v (unrotated) to value_cache at
 * (token_slot[t], :, token_pos[t]), as engram_kv_cache_write. A token outside the cache
 * (slot or position out of range) writes no K/V but still gets its q'. The shape limits,
 * the cache layout and the int32 token_slot / token_pos arrays are the attention's
 * (above); all tensors are 16-byte aligned; q_out must not overlap qkv.
 */
ENGRAM_API int engram_rope_kv_cache_write(const void* qkv, const void* cos, const void* sin, const int32_t* token_slot,
    const int32_t* token_pos, int64_t num_tokens, int32_t num_heads, int32_t num_kv_heads, int32_t head_dim,
    void* key_cache, void* value_cache, int64_t num_slots, int64_t max_seq_len, void* q_out, cudaStream_t stream);

/* The attention alone (reads the caches, writes out). workspace may be NULL (then no
 * split); with workspace_bytes below what the split needs, fewer splits are used. */
ENGRAM_API int engram_attention_packed(const void* q, int32_t io_type, const void* key_cache, const void* value_cache,
    const int32_t* token_slot, const int32_t* token_pos, int64_t num_tokens, int32_t num_heads, int32_t num_kv_heads,
    int32_t head_dim, int64_t num_slots, int64_t max_seq_len, float scale, void* workspace, size_t workspace_bytes,
    void* out, cudaStream_t stream);

/* One serving step: engram_kv_cache_write, then engram_attention_packed, on `stream`. */
ENGRAM_API int engram_attention_step(const void* q, const void* k, const void* v, int32_t io_type,
    const int32_t* token_slot, const int32_t* token_pos, int64_t num_tokens, int32_t num_heads, int32_t num_kv_heads,
    int32_t head_dim, void* key_cache, void* value_cache, int64_t num_slots, int64_t max_seq_len, float scale,
    void* workspace, size_t workspace_bytes, void* out, cudaStream_t stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* ENGRAM_TRT_ATTENTION_KERNELS_H */
