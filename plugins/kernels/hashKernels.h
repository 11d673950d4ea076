// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * engram-trt kernel library, the Engram n-gram hash (hashKernel.cu).
 * Part of the C ABI of engramKernels.h (the umbrella header), whose conventions hold here.
 */
#ifndef ENGRAM_TRT_HASH_KERNELS_H
#define ENGRAM_TRT_HASH_KERNELS_H

#include "engramKernelsCore.h"

#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Limits of the hash kernel: its layout constants travel as one kernel parameter
 * (layouts over 128 slots or 64 multipliers need a library built with CUDA 12.1+). */
#define ENGRAM_HASH_MAX_SLOTS 512       /* num_layers * n_hash_cols */
#define ENGRAM_HASH_MAX_MULTIPLIERS 256 /* num_layers * max_ngram_size */
#define ENGRAM_HASH_MAX_NGRAM 16

/*
 * N-gram hash of packed sequences (engram-spec.md, "Hash of position p").
 *
 * Dead tokens: there is no separate dead-token mask. A dead token is a negative id
 *   in `ids` (and -1 in `lookback`): its position holds no token, so every n-gram that
 *   reaches it is blocked (its ids are hashed as pad ids), like the start of a sequence.
 *
 * ids          [T] int32 device: compressed token ids of all sequences back to back;
 *              a negative id marks a dead token.
 * seq_starts   [S+1] int32 device: cu_seqlens (seq_starts[0] = 0, seq_starts[S] = T,
 *              non-decreasing). Tokens outside [seq_starts[0], seq_starts[S]) hash as
 *              fully blocked (every n-gram made of pad ids). Token indices below 0 (a
 *              negative seq_starts[0]) are never read: they count as no token.
 * lookback     [S, N-1] int32 device: the N-1 compressed ids before each sequence's
 *              first token, oldest first; -1 (or any negative) = no token / dead,
 *              which blocks like the start of a sequence. NULL = every sequence
 *              starts fresh (all -1).
 * primes_host       [L, N-1, H] int64, offsets_host [L, (N-1)*H] int64,
 * multipliers_host  [L, N] int64: the layout constants (host memory, validated and
 *              copied into the kernel's parameters at each call: prefer a prepared
 *              layout, engram_hash_layout_create + engram_hash_prepared, below).
 * pad_id, compressed_vocab_size: the pad id and the vocabulary bound; the call
 *              checks that every multiplier times (compressed_vocab_size - 1) fits int64
 *              and that every row id fits int32.
 * out          [T, L, (N-1)*H] int32 device: row ids (rolling % prime + offset).
 */
ENGRAM_API int engram_hash(const int32_t* ids, int64_t num_tokens, const int32_t* seq_starts, int64_t num_seqs,
    const int32_t* lookback, const int64_t* primes_host, const int64_t* offsets_host, const int64_t* multipliers_host,
    int32_t num_layers, int32_t max_ngram_size, int32_t num_heads, int64_t pad_id, int64_t compressed_vocab_size,
    int32_t* out, cudaStream_t stream);

/* The layout checks engram_hash makes, alone (the plugin runs them at creation). */
ENGRAM_API int engram_hash_check_layout(const int64_t* primes_host, const int64_t* offsets_host,
    const int64_t* multipliers_host, int32_t num_layers, int32_t max_ngram_size, int32_t num_heads, int64_t pad_id,
    int64_t compressed_vocab_size);

/*
 * A prepared hash layout: the layout constants validated once and laid out as the
 * kernel's parameter, so a call enqueues the kernel and does nothing else on the host.
 * It holds no device memory: one layout serves every device and stream, from any number
 * of threads at once (it is immutable), and needs no GPU to create. create takes the
 * arguments of engram_hash_check_layout and sets *layout (NULL on failure); destroy
 * frees it (NULL is a no-op) and must not race a call that uses it.
 */
typedef struct EngramHashLayout EngramHashLayout;
ENGRAM_API int engram_hash_layout_create(const int64_t* primes_host, const int64_t* offsets_host,
    const int64_t* multipliers_host, int32_t num_layers, int32_t max_ngram_size, int32_t num_heads, int64_t pad_id,
    int64_t compressed_vocab_size, EngramHashLayout** layout);
ENGRAM_API int engram_hash_layout_destroy(EngramHashLayout* layout);

/* engram_hash with a prepared layout: same ids / seq_starts / lookback / out contract.
 * Limit: num_tokens * L * (N-1) * H < 2^31 (the row ids of one call). */
ENGRAM_API int engram_hash_prepared(const EngramHashLayout* layout, const int32_t* ids, int64_t num_tokens,
    const int32_t* seq_starts, int64_t num_seqs, const int32_t* lookback, int32_t* out, cudaStream_t stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* ENGRAM_TRT_HASH_KERNELS_H */
