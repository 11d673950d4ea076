// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * engram-trt kernel library, DeepSeek-V4's attention core (dsv4AttentionKernel.cu).
 * Part of the C ABI of engramKernels.h (the umbrella header), whose conventions hold here.
 */
#ifndef ENGRAM_TRT_DSV4_ATTENTION_KERNELS_H
#define ENGRAM_TRT_DSV4_ATTENTION_KERNELS_H

#include "engramKernelsCore.h"

#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ======================================================================================
 * DeepSeek-V4 attention core (EngramDsv4Attention; dsv4AttentionKernel.cu; the float64
 * reference is engram_trt.builder.reference_dsv4_attention, tied to
 * models/deepseek_v4/attention.py; plugins/engramDsv4AttentionPlugin/README.md has the
 * I/O tables). Sequence s of the packed step owns tokens seq_starts[s]..seq_starts[s+1]
 * at positions past_lens[s] + i and slot seq_slots[s]; the state is read only at
 * positions < past_lens[s] (a fresh sequence reads nothing) and updated in place:
 *   compressor (CSA / HCA): each window j completed this step -> entries[slot, j] =
 *     RoPE_{j r}(norm * RMSNorm(sum softmax(gate + bias) * kv)) (CSA: 2r rows, Ca of window
 *     j-1 and Cb of window j; the indexer the same at index_dim); the rings keep the last
 *     R raw rows (position p at row p % R);
 *   query at p: window keys p-W < k <= p, entries e < (p+1)/r (CSA: the index_topk best by
 *     sum_h w_h relu(index_q_h . key_e) / sqrt(index_dim), ties to the lower index), a sink
 *     logit per head; probabilities rounded to io_type before the value product (K = V),
 *     fp32 sums, out rounded once; then the window ring keeps the last W keys.
 * A sequence with an out-of-range slot, a negative past or more than max_entries windows
 * writes nothing and gets zero rows. All io tensors one io_type; bias / norm / sinks /
 * inv_freq / index_w fp32. workspace: engram_dsv4_workspace_size (CSA layers whose
 * max_entries exceed index_topk: T x max_entries fp32 + T x index_topk int32).
 */
#define ENGRAM_DSV4_MAX_HEAD_DIM 512
#define ENGRAM_DSV4_MAX_INDEX_DIM 512
enum EngramDsv4LayerType
{
    ENGRAM_DSV4_SLIDING = 0,
    ENGRAM_DSV4_CSA = 1,
    ENGRAM_DSV4_HCA = 2
};

typedef struct EngramDsv4Shape
{
    int64_t num_tokens;  /* T */
    int64_t num_seqs;    /* S */
    int64_t num_slots;   /* N */
    int64_t max_entries; /* E = max_len / compress_rate (0 for sliding) */
    int32_t layer_type;  /* EngramDsv4LayerType */
    int32_t window;      /* W = sliding_window */
    int32_t compress_rate;
    int32_t index_topk;
    int32_t io_type; /* ENGRAM_FLOAT_* */
    int32_t num_heads;
    int32_t head_dim;
    int32_t rope_pairs; /* rope_dim / 2 = len(inv_freq) */
    int32_t index_heads;
    int32_t index_dim;
    float scaling;
    float eps;
    float rope_scale;
} EngramDsv4Shape;

typedef struct EngramDsv4Tensors
{
    const void* q;  /* [T, H, d] */
    const void* kv; /* [T, d] */
    const float* sinks;
    const int32_t* seq_starts;
    const int32_t* past_lens;
    const int32_t* seq_slots;
    void* window_kv; /* [N, W, d] */
    const void* comp_kv;
    const void* comp_gate;  /* [T, w] */
    const float* comp_bias; /* [r, w] */
    const float* comp_norm; /* [d] */
    const float* inv_freq;  /* [rope_pairs] */
    void* entries;          /* [N, E, d] */
    void* comp_ring_kv;
    void* comp_ring_gate; /* [N, R, w] */
    const void* index_q;  /* [T, NI, di] */
    const float* index_w; /* [T, NI] */
    const void* index_kv;
    const void* index_gate;  /* [T, 2 di] */
    const float* index_bias; /* [r, 2 di] */
    const float* index_norm; /* [di] */
    void* index_keys;        /* [N, E, di] */
    void* index_ring_kv;
    void* index_ring_gate; /* [N, 2r, 2 di] */
    void* out;             /* [T, H, d] */
} EngramDsv4Tensors;

/* Fields and shapes (no GPU); the workspace; the step. */
ENGRAM_API int engram_dsv4_check(const EngramDsv4Shape* shape);
ENGRAM_API int engram_dsv4_workspace_size(const EngramDsv4Shape* shape, size_t* bytes);
ENGRAM_API int engram_dsv4_attention(const EngramDsv4Shape* shape, const EngramDsv4Tensors* tensors, void* workspace,
    size_t workspace_bytes, cudaStream_t stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* ENGRAM_TRT_DSV4_ATTENTION_KERNELS_H */
