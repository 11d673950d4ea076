// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * engram-trt kernel library: the C ABI.
 *
 * Every CUDA kernel of the project lives once behind this ABI. The TensorRT plugins
 * (plugins/engram*Plugin) validate their tensors and call these functions; the
 * PyTorch path calls them through ctypes (python/engram_trt/kernels.py).
 *
 * Conventions
 *   - Every function returns int: 0 on success, otherwise a cudaError_t value
 *     (cudaErrorInvalidValue = 1 for a rejected argument). The reason of the last
 *     failure on the calling thread is kept in engram_last_error(). No C++ exception
 *     leaves a function, and a failed call leaves no stale error behind that a later
 *     call would report.
 *   - Pointers named *_host are CPU pointers read before the function returns; all
 *     other tensor pointers are device-accessible (device memory, or host memory that
 *     is pinned / cudaHostRegister'ed and therefore addressable by the GPU through
 *     unified virtual addressing) unless stated otherwise.
 *   - Work is enqueued on `stream`; nothing synchronizes the stream unless stated.
 *   - Tensors are dense, row-major, and 16-byte aligned where a function says so.
 */
#ifndef ENGRAM_TRT_KERNELS_H
#define ENGRAM_TRT_KERNELS_H

#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#if defined(__GNUC__)
#define ENGRAM_API __attribute__((visibility("default")))
#else
#define ENGRAM_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Version of the kernel + plugin library; the builder records it with each engine. */
#define ENGRAM_TRT_PLUGIN_VERSION "0.13.0"

/* Limits of the hash kernel: its layout constants travel as one kernel parameter
 * (layouts over 128 slots or 64 multipliers need a library built with CUDA 12.1+). */
#define ENGRAM_HASH_MAX_SLOTS 512       /* num_layers * n_hash_cols */
#define ENGRAM_HASH_MAX_MULTIPLIERS 256 /* num_layers * max_ngram_size */
#define ENGRAM_HASH_MAX_NGRAM 16

/* Table element types (EngramGather field `table_dtype`). */
enum EngramTableDtype
{
    ENGRAM_TABLE_FP8_E4M3 = 0, /* fp8 e4m3 rows + ue8m0 scale bytes, one per quant_block */
    ENGRAM_TABLE_BF16 = 1,     /* bf16 rows, no scales */
    ENGRAM_TABLE_F16 = 2,      /* f16 rows, no scales (GPU gather only: engram_gather*, EngramGather) */
    ENGRAM_TABLE_F32 = 3       /* f32 rows, no scales (GPU gather only) */
};

/* Element type of the gate's token mask (0 = dead token: gate forced to 0). */
enum EngramMaskType
{
    ENGRAM_MASK_NONE = 0, /* no mask: every token live */
    ENGRAM_MASK_U8 = 1,   /* one byte per token (bool / uint8 / int8), nonzero = live */
    ENGRAM_MASK_I32 = 2   /* int32 per token, nonzero = live */
};

/* Floating-point element types of the gate's tensors (engram_gate_typed's io_type and
 * weight_type). */
enum EngramFloatType
{
    ENGRAM_FLOAT_BF16 = 0,
    ENGRAM_FLOAT_F32 = 1,
    ENGRAM_FLOAT_F16 = 2
};

/* Element type of the gate's q_weight / k_weight (the EngramFloatType codes; engram_gate
 * takes the first two). */
enum EngramWeightType
{
    ENGRAM_WEIGHT_BF16 = 0,
    ENGRAM_WEIGHT_F32 = 1,
    ENGRAM_WEIGHT_F16 = 2
};

/* Kind of memory behind a pointer, from engram_pointer_kind(). */
enum EngramPointerKind
{
    ENGRAM_POINTER_UNREGISTERED = 0, /* plain host memory: the GPU cannot read it */
    ENGRAM_POINTER_HOST = 1,         /* pinned or registered host memory (UVA-readable) */
    ENGRAM_POINTER_DEVICE = 2,       /* device memory */
    ENGRAM_POINTER_MANAGED = 3       /* managed memory */
};

/* Library version string, ENGRAM_TRT_PLUGIN_VERSION. */
ENGRAM_API const char* engram_trt_plugin_version(void);

/* One-line reason of the last failed call on this thread ("" if none). */
ENGRAM_API const char* engram_last_error(void);

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

/*
 * Row gather + dequantization, GPU side (device table or UVA host table).
 *
 * ids          int32 device, token t's column c at ids[t * id_token_stride + c]
 *              (for hash output [T, L, cols] of layer l: pass ids + l * cols and
 *              id_token_stride = L * cols). NULL = identity (row t * num_cols + c).
 *              Ids outside [0, table_num_rows) produce zero rows (never an
 *              out-of-bounds read).
 * table_rows   [table_num_rows, head_dim] fp8 e4m3 bytes (16-byte aligned) or bf16 /
 *              f16 / f32 (aligned to the element): device memory or pinned /
 *              registered host memory.
 * table_scales [table_num_rows, head_dim / quant_block] ue8m0 bytes (value
 *              2^(b-127); 255 is NaN), for ENGRAM_TABLE_FP8_E4M3; ignored for bf16.
 * out          [num_tokens, num_cols, head_dim] device: bf16 for fp8 (16-byte aligned),
 *              the table's dtype for a float table (its rows copied; element-aligned).
 * bad_rows     NULL, or one int64 in device memory (8-byte aligned): every output row
 *              that read nothing (its id outside [0, table_num_rows)) adds 1 to it,
 *              atomically, when the kernel runs. It is never reset here: zero it, run
 *              any number of gathers, read it when convenient (a runtime checks it every
 *              N steps or in a debug mode and raises on a nonzero count).
 * Limits: fp8 needs head_dim % 16 == 0, quant_block % 16 == 0 and
 *         head_dim % quant_block == 0; float tables take any head_dim >= 1 (16-byte
 *         loads where the row bytes and addresses allow, narrower words otherwise).
 *         The host gather (engram_host_gather*) still takes fp8 and bf16 of
 *         head_dim % 8 == 0 only.
 */
ENGRAM_API int engram_gather(const int32_t* ids, int64_t num_tokens, int32_t num_cols, int64_t id_token_stride,
    const void* table_rows, const void* table_scales, int64_t table_num_rows, int32_t head_dim, int32_t table_dtype,
    int32_t quant_block, void* out, int64_t* bad_rows, cudaStream_t stream);

/*
 * engram_gather from a row slice of a table: table_rows / table_scales hold global rows
 * [row_offset, row_offset + table_num_rows) (a tensor-parallel rank's slice, its first
 * row at table_rows), and ids are global row ids, so token t's column c reads slice row
 * ids[...] - row_offset. An id outside the slice, below row_offset included, gives a
 * zero row and counts as a bad row: nothing before or after the slice is read.
 * row_offset in [0, 2^31 - 1] (ids are int32); the identity gather (ids NULL) needs
 * row_offset 0. A column range of a layer is a view of the ids: pass ids + l * cols +
 * column_begin, num_cols = column_end - column_begin and the full id_token_stride.
 * With row_offset 0 it is engram_gather, bit for bit.
 */
ENGRAM_API int engram_gather_ex(const int32_t* ids, int64_t num_tokens, int32_t num_cols, int64_t id_token_stride,
    const void* table_rows, const void* table_scales, int64_t table_num_rows, int64_t row_offset, int32_t head_dim,
    int32_t table_dtype, int32_t quant_block, void* out, int64_t* bad_rows, cudaStream_t stream);

/*
 * engram_gather_ex for part of the output or on part of the GPU; nothing is counted.
 * keep_outside 1: only the output rows whose id falls in the slice [row_offset,
 * row_offset + table_num_rows) are written, every other row of out is left as it was
 * (0: zero rows there, as engram_gather_ex). Two such calls over one id list, with
 * disjoint slices that cover every id, write each output row once, and they may run on
 * two streams: the hot-row cache delivers its hits (the cache's slots) while its misses
 * (the miss area after them) are still being fetched.
 * max_blocks > 0 caps the grid below one full wave (0: the wave): a gather of host rows
 * through UVA is bound by the host's address translations, not by the multiprocessors,
 * so a few of them may keep as many reads in flight while the rest stay free for other
 * work (a host gather's dequant kernels, the layers before an Engram layer).
 * ids are required.
 */
ENGRAM_API int engram_gather_part(const int32_t* ids, int64_t num_tokens, int32_t num_cols, int64_t id_token_stride,
    const void* table_rows, const void* table_scales, int64_t table_num_rows, int64_t row_offset, int32_t head_dim,
    int32_t table_dtype, int32_t quant_block, int32_t keep_outside, int32_t max_blocks, void* out, cudaStream_t stream);

/*
 * Raw rows, no dequant: dst_rows row i = table_rows row ids[i] (row_bytes, a multiple of
 * 16; rows and dst 16-byte aligned) and, with scale_bytes > 0, dst_scales row i =
 * table_scales row ids[i]; an id outside [0, table_num_rows) gives a zero row and scale
 * bytes 127 (2^0), as the host gather stages it. The table in device memory or in pinned
 * / registered host memory (UVA); ids and dst on the device. max_blocks as in
 * engram_gather_part. The hot-row cache reads a share of a step's misses this way, beside
 * the host gather (engram_cache_step's uva_share).
 */
ENGRAM_API int engram_gather_raw(const int32_t* ids, int64_t count, const void* table_rows, const void* table_scales,
    int64_t table_num_rows, int64_t row_bytes, int32_t scale_bytes, void* dst_rows, void* dst_scales,
    int32_t max_blocks, cudaStream_t stream);

/* The table-format checks engram_gather makes (head_dim, dtype, quant_block), alone. */
ENGRAM_API int engram_gather_check_table(int32_t head_dim, int32_t table_dtype, int32_t quant_block);

/*
 * engram_gather with the table addresses read on the device: table_rows_addr and
 * table_scales_addr point to one int64 each (in device memory) holding the address.
 * This is the plugin's form, where the addresses are engine inputs, so enqueue needs
 * no host synchronization. table_scales_addr may be NULL for bf16 tables.
 * Since no host code sees the addresses, the kernel checks them: a row address of 0 or
 * not 16-byte aligned (fp8; a float table: not aligned to its element), or a scales
 * address of 0 for an fp8 table, yields zero rows for
 * the whole output (no read, no fault). table_num_rows bounds the ids; the table behind
 * the address must hold at least that many rows, which only the caller can check.
 * bad_rows_addr: NULL, or one int64 in device memory holding the address of a bad-row
 * counter as engram_gather's bad_rows (0, or an address not 8-byte aligned: no count);
 * with unusable table addresses every row counts.
 */
ENGRAM_API int engram_gather_indirect(const int32_t* ids, int64_t num_tokens, int32_t num_cols, int64_t id_token_stride,
    const int64_t* table_rows_addr, const int64_t* table_scales_addr, int64_t table_num_rows, int32_t head_dim,
    int32_t table_dtype, int32_t quant_block, void* out, const int64_t* bad_rows_addr, cudaStream_t stream);

/* engram_gather_indirect from a row slice (row_offset as in engram_gather_ex): the
 * addresses point at the slice's first row, table_num_rows is the slice's row count.
 * The EngramGather plugin's form (fields column_begin, column_end, row_offset). */
ENGRAM_API int engram_gather_indirect_ex(const int32_t* ids, int64_t num_tokens, int32_t num_cols,
    int64_t id_token_stride, const int64_t* table_rows_addr, const int64_t* table_scales_addr, int64_t table_num_rows,
    int64_t row_offset, int32_t head_dim, int32_t table_dtype, int32_t quant_block, void* out,
    const int64_t* bad_rows_addr, cudaStream_t stream);

/*
 * Host gather: rows are gathered by CPU threads from a host table (any host memory,
 * e.g. a file mapping) into pinned staging slots, and each chunk goes to the GPU in
 * one cudaMemcpyAsync on the gatherer's own copy stream, pipelined (the copy of a chunk
 * overlaps the gather of the next ones); fp8 chunks are dequantized on the GPU by the
 * gather kernel on `stream`. Same ids / table / out contract as engram_gather, except
 * that ids_host, rows_host and scales_host are CPU pointers. Returns when every chunk
 * has been gathered and its copy (and dequant) enqueued; `out` is ready when `stream`
 * reaches that point. A gatherer serves one call at a time (calls are serialized by a
 * lock); its staging slots are reused only after the copies that read them completed.
 * runtime/README.md describes the pipeline and its tuning.
 */
typedef struct EngramHostGatherer EngramHostGatherer;

/* Layout of a host table (engram_host_gather_ex / _raw / _rows_cpu `table_layout`). */
enum EngramTableLayout
{
    ENGRAM_LAYOUT_SPLIT = 0,  /* rows [N, head_dim] and scales [N, head_dim / quant_block]: two arrays (engram_gather's
                                 form) */
    ENGRAM_LAYOUT_INLINE = 1, /* one array [N, head_dim + head_dim / quant_block] bytes: each row's scale bytes right
                                after its values (fp8), so a random row costs the CPU one miss instead of two;
                                scales_host must be NULL. For bf16 tables it is the split layout. */
    ENGRAM_LAYOUT_HBM_SCALES = 2 /* fp8 only: rows [N, head_dim] in host memory, scales [N, head_dim / quant_block] in
                                device memory (the `scales` pointer is a device pointer). The CPU threads copy only
                                the values (a 256-byte row is 4 cache lines; with its scale bytes beside it, 5), and
                                the dequant reads each row's scale bytes from HBM by its id, so the call needs the ids
                                in device memory too (engram_host_gather_dev, engram_host_gather_raw_dev, or a step
                                job's row ids). */
};

/* Tuning knobs of a host gatherer (engram_host_gatherer_set_option / get_option). */
enum EngramHostGatherOption
{
    ENGRAM_HOST_GATHER_CHUNK_ROWS = 0,         /* most rows per copy (default: the chunk_rows it was created with;
                                                  capped by what a staging slot holds) */
    ENGRAM_HOST_GATHER_MIN_CHUNKS = 1,         /* a call is cut into at least this many chunks (not below 256 rows
                                                  each) so a small call overlaps gather and copy (default 4) */
    ENGRAM_HOST_GATHER_TASK_ROWS = 2,          /* rows per work item of a thread (0 = automatic, default) */
    ENGRAM_HOST_GATHER_PREFETCH_ROWS = 3,      /* software prefetch distance in rows, 0..64 (0 = off; default 16) */
    ENGRAM_HOST_GATHER_STREAMING_STORES = 4,   /* 1: non-temporal stores into staging, 0: plain stores (default) */
    ENGRAM_HOST_GATHER_SPIN_US = 5,            /* idle pool threads spin this long, then block (default 50) */
    ENGRAM_HOST_GATHER_NUM_THREADS = 6,        /* read-only: threads of the pool, the caller included */
    ENGRAM_HOST_GATHER_NUM_SLOTS = 7,          /* read-only: staging slots */
    ENGRAM_HOST_GATHER_SLOT_BYTES = 8,         /* read-only: bytes of one pinned (and one device) staging slot */
    ENGRAM_HOST_GATHER_PREFETCH_FAR_ROWS = 9,  /* prefetch the first line of the row this far ahead, 0..64, to start
                                                  its page walk early (0 = off, default) */
    ENGRAM_HOST_GATHER_PREFETCH_LOCALITY = 10, /* cache level prefetched into: 3 = L1 (default) .. 1 = L2/L3,
                                                  0 = non-temporal */
    ENGRAM_HOST_GATHER_JOB_STAGING_BYTES = 11  /* bytes of each of two device buffers that hold a whole fp8
                                                  call's staged rows (and scale bytes), 0..2^40 (0 = off, default).
                                                  A call that fits copies its chunks there instead of into the
                                                  ring of device slots, so no copy waits for an earlier chunk's
                                                  dequant: with the ring, a dequant queued behind a long kernel
                                                  (a prefill's GEMM holds every SM) stalls the copies and with
                                                  them the CPU threads. Calls alternate between the two buffers;
                                                  setting it reallocates them (cudaMalloc) and waits for the
                                                  dequants that read them */
};

/* CPUs in the calling thread's affinity mask (sched_getaffinity; threads it starts inherit
 * it). On a node shared by several ranks, give each rank its own CPU list (taskset,
 * numactl, the scheduler) and the host gather's pool follows. */
ENGRAM_API int engram_cpu_affinity_count(int32_t* count);

/* The default thread count of a host gatherer: one less than engram_cpu_affinity_count()
 * (at least 1), leaving a CPU to the thread that launches the model and to the OS (one
 * preempted worker stalls a round of the pool). */
ENGRAM_API int engram_host_gather_default_threads(int32_t* count);

/* num_threads <= 0: engram_host_gather_default_threads() (the caller is one of the threads).
 * chunk_rows: rows per pipelined chunk, and with max_head_dim (the widest table row, in
 * elements) the size of a staging slot: chunk_rows * 2 * max_head_dim bytes, pinned and
 * on the device, num_slots of each (create: 4 slots; create_ex: 2..64).
 * destroy waits for a gather in progress on another thread, then frees the gatherer; a
 * gather that starts after destroy has begun uses freed memory (a caller bug). */
ENGRAM_API int engram_host_gatherer_create(
    int32_t num_threads, int64_t chunk_rows, int32_t max_head_dim, EngramHostGatherer** gatherer);
ENGRAM_API int engram_host_gatherer_create_ex(
    int32_t num_threads, int64_t chunk_rows, int32_t max_head_dim, int32_t num_slots, EngramHostGatherer** gatherer);
ENGRAM_API int engram_host_gatherer_destroy(EngramHostGatherer* gatherer);

/* Set / read an EngramHostGatherOption; set waits for a gather in progress. */
ENGRAM_API int engram_host_gatherer_set_option(EngramHostGatherer* gatherer, int32_t option, int64_t value);
ENGRAM_API int engram_host_gatherer_get_option(EngramHostGatherer* gatherer, int32_t option, int64_t* value);

/* Wakes the gatherer's sleeping threads (they spin again for SPIN_US) and restarts the
 * spin of spinning ones (SPIN_US from now): call it when a gather is about to come (a
 * step's ids are being computed) to hide the wake-up. */
ENGRAM_API int engram_host_gatherer_wake(EngramHostGatherer* gatherer);

/* The host gather into bf16 `out` [num_tokens, num_cols, head_dim] from a split table. */
ENGRAM_API int engram_host_gather(EngramHostGatherer* gatherer, const int32_t* ids_host, int64_t num_tokens,
    int32_t num_cols, int64_t id_token_stride, const void* rows_host, const void* scales_host, int64_t table_num_rows,
    int32_t head_dim, int32_t table_dtype, int32_t quant_block, void* out, cudaStream_t stream);

/* engram_host_gather from a split or inline table (EngramTableLayout; hbm_scales needs
 * engram_host_gather_dev). */
ENGRAM_API int engram_host_gather_ex(EngramHostGatherer* gatherer, const int32_t* ids_host, int64_t num_tokens,
    int32_t num_cols, int64_t id_token_stride, const void* rows_host, const void* scales_host, int64_t table_num_rows,
    int32_t head_dim, int32_t table_dtype, int32_t quant_block, int32_t table_layout, void* out, cudaStream_t stream);
/* engram_host_gather_ex with the ids also in device memory: ids_dev has the layout of
 * ids_host ([num_tokens, id_token_stride], the same values) and must be ready on `stream`.
 * Only ENGRAM_LAYOUT_HBM_SCALES reads it (its dequant looks up each row's scale bytes by
 * id); other layouts ignore it (NULL is fine). */
ENGRAM_API int engram_host_gather_dev(EngramHostGatherer* gatherer, const int32_t* ids_host, const int32_t* ids_dev,
    int64_t num_tokens, int32_t num_cols, int64_t id_token_stride, const void* rows_host, const void* scales,
    int64_t table_num_rows, int32_t head_dim, int32_t table_dtype, int32_t quant_block, int32_t table_layout, void* out,
    cudaStream_t stream);

/*
 * The host gather of raw table bytes (no dequant), for a device row cache that keeps
 * rows in their stored form: row ids_host[i] (flat, [num_ids]) of the table goes to
 * dst_rows + i * row_bytes and its scale bytes to dst_scales + i * scale_bytes, where
 * row_bytes = head_dim (fp8) or 2 * head_dim (bf16) and scale_bytes = head_dim /
 * quant_block (fp8; dst_scales unused for bf16): the split form engram_gather reads, for
 * every table layout. dst_rows / dst_scales are device memory (dst_rows 16-byte
 * aligned). Ids outside the table give zero rows with scale bytes 127. The copies start
 * after the work enqueued on `stream` before the call, and `stream` waits for them.
 * engram_host_gather_raw takes the split and inline layouts; engram_host_gather_raw_dev
 * takes all three: with ENGRAM_LAYOUT_HBM_SCALES `scales` is the table's scale array in
 * device memory and ids_dev the ids in device memory too (ids_host's [num_ids] values,
 * ready on `stream`; other layouts ignore it). The CPU threads then stage and copy the
 * values alone (one copy per chunk), and one kernel on `stream` gathers the scale bytes
 * from `scales` by ids_dev into dst_scales.
 */
ENGRAM_API int engram_host_gather_raw(EngramHostGatherer* gatherer, const int32_t* ids_host, int64_t num_ids,
    const void* rows_host, const void* scales_host, int64_t table_num_rows, int32_t head_dim, int32_t table_dtype,
    int32_t quant_block, int32_t table_layout, void* dst_rows, void* dst_scales, cudaStream_t stream);
ENGRAM_API int engram_host_gather_raw_dev(EngramHostGatherer* gatherer, const int32_t* ids_host, const int32_t* ids_dev,
    int64_t num_ids, const void* rows_host, const void* scales, int64_t table_num_rows, int32_t head_dim,
    int32_t table_dtype, int32_t quant_block, int32_t table_layout, void* dst_rows, void* dst_scales,
    cudaStream_t stream);

/*
 * The CPU part of the host gather alone (no GPU, no CUDA call): the raw rows of
 * ids_host [num_ids] into host memory dst_rows_host [num_ids, row_bytes] and
 * dst_scales_host [num_ids, scale_bytes] (the engram_host_gather_raw contract), on the
 * threads of `gatherer` with its tuning, or, with gatherer NULL, on a pool of
 * num_threads made for the call (<= 0: engram_cpu_affinity_count()). prefetch_rows and
 * streaming_stores override the tuning (-1: keep it). For tests and for measuring the
 * gather's CPU side apart from the link. hbm_scales: the values alone (what its CPU
 * threads copy); scales_host and dst_scales_host are not read or written.
 */
ENGRAM_API int engram_host_gather_rows_cpu(EngramHostGatherer* gatherer, int32_t num_threads, const int32_t* ids_host,
    int64_t num_ids, const void* rows_host, const void* scales_host, int64_t table_num_rows, int32_t head_dim,
    int32_t table_dtype, int32_t quant_block, int32_t table_layout, void* dst_rows_host, void* dst_scales_host,
    int32_t prefetch_rows, int32_t streaming_stores);

/*
 * The gather driver (runtime/gatherDriver.cpp): a thread that runs a host gatherer's
 * calls queued by the caller, so the caller never waits for their CPU part. submit
 * queues one engram_host_gather_ex call (same arguments; with ids_ready non-NULL the
 * driver first waits for that event: ids copied back from the hash kernel) and returns
 * at once with its ticket (1, 2, ...). ids_host must stay valid, and `out` unread, until
 * the ticket is finished. wait_stream enqueues on `stream` a wait (no SM, no host wait)
 * until the ticket's rows are ready on the job's stream; it may come before the job has
 * run. finish waits on the host until every job up to the ticket has run and returns the
 * first failure among them with its message (a failed job still releases its waiters; its
 * rows are then undefined). Jobs of one driver run in order. destroy runs the queued
 * jobs first; destroy the driver before its gatherer. supported: whether `device` has
 * the 64-bit stream memory operations the driver needs (create fails without them).
 */
typedef struct EngramGatherDriver EngramGatherDriver;
ENGRAM_API int engram_gather_driver_supported(int32_t device, int32_t* supported);
ENGRAM_API int engram_gather_driver_create(EngramHostGatherer* gatherer, EngramGatherDriver** driver);
ENGRAM_API int engram_gather_driver_destroy(EngramGatherDriver* driver);
ENGRAM_API int engram_gather_driver_submit(EngramGatherDriver* driver, const int32_t* ids_host, int64_t num_tokens,
    int32_t num_cols, int64_t id_token_stride, const void* rows_host, const void* scales_host, int64_t table_num_rows,
    int32_t head_dim, int32_t table_dtype, int32_t quant_block, int32_t table_layout, void* out, cudaStream_t stream,
    cudaEvent_t ids_ready, uint64_t* ticket);
/* A step's lookup as one job: the driver copies its compressed ids [num_tokens],
 * seq_starts [num_seqs + 1] and lookback [num_seqs, lookback_width] (NULL: every sequence
 * starts fresh) from pinned host memory into the device buffers given, hashes them on
 * `stream` (engram_hash_prepared into row_ids_dev [T, L, num_cols]), copies the row ids
 * back into row_ids_host (pinned), waits for them, then gathers layer l (l < num_layers
 * = L) from tables[l] into outs[l] (bf16 [T, num_cols, head_dim]) and releases its ticket
 * *first_ticket + l. The host buffers must stay unchanged until the last ticket is
 * finished. A table in ENGRAM_LAYOUT_HBM_SCALES has its scales in device memory
 * (`scales_host` then holds a device pointer); its dequant reads the layer's row ids from
 * row_ids_dev. engram_gather_driver_submit refuses that layout: it has no device ids. */
typedef struct EngramDriverTable
{
    const void* rows_host;
    const void* scales_host;
    int64_t num_rows;
    int32_t head_dim;
    int32_t table_dtype;
    int32_t quant_block;
    int32_t table_layout;
} EngramDriverTable;
ENGRAM_API int engram_gather_driver_submit_step(EngramGatherDriver* driver, const EngramHashLayout* layout,
    const int32_t* cids_host, int64_t num_tokens, const int32_t* seq_starts_host, int64_t num_seqs,
    const int32_t* lookback_host, int32_t lookback_width, int32_t num_cols, int32_t* cids_dev, int32_t* seq_starts_dev,
    int32_t* lookback_dev, int32_t* row_ids_dev, int32_t* row_ids_host, int32_t num_layers,
    const EngramDriverTable* tables, void* const* outs, cudaStream_t stream, uint64_t* first_ticket);
ENGRAM_API int engram_gather_driver_wait_stream(EngramGatherDriver* driver, uint64_t ticket, cudaStream_t stream);
ENGRAM_API int engram_gather_driver_finish(EngramGatherDriver* driver, uint64_t ticket);

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

/* The decode step's projections for a few tokens (gemvKernel.cu):
 *   out[m, n] = bf16(sum_k x[m, k] * weight[n, k])     (torch's F.linear(x, weight), no bias)
 * x [M, K], weight [N, K] (row-major, as nn.Linear stores it) and out [M, N] are bf16,
 * contiguous and 16-byte aligned; the sum is float32 (per lane in k order, then a warp
 * butterfly), rounded once, so it differs from the GEMM library's by the sums' order.
 * One warp per row of weight, 16-byte streaming loads. Bound by reading weight: meant for
 * decode steps of 1..ENGRAM_GEMV_MAX_TOKENS tokens, where a GEMM tiles for many more.
 * flags: ENGRAM_GEMV_WEIGHT_STATIC promises that no work queued on the stream before
 * this call writes weight (a model's weights); the kernel may then load it before the
 * kernel before it completes (programmatic dependent launch, off with ENGRAM_TRT_PDL=0).
 * Without it the kernel reads nothing before that kernel completes.
 * Limits: compute capability 9.0 or later (cudaErrorNotSupported before: the kernel was
 * measured there only); 0 <= num_tokens <= ENGRAM_GEMV_MAX_TOKENS (0 launches nothing);
 * in_features a multiple of 8; out must not overlap x or weight; no flag but
 * ENGRAM_GEMV_WEIGHT_STATIC. */
#define ENGRAM_GEMV_MAX_TOKENS 4
#define ENGRAM_GEMV_WEIGHT_STATIC 1u
ENGRAM_API int engram_gemv_bf16(const void* x, const void* weight, int64_t num_tokens, int64_t out_features,
    int64_t in_features, uint32_t flags, void* out, cudaStream_t stream);

/* Kind of memory behind ptr (EngramPointerKind) in *kind. */
ENGRAM_API int engram_pointer_kind(const void* ptr, int32_t* kind);

/* cudaHostRegister(ptr, bytes, portable | mapped) / cudaHostUnregister, so that the
 * GPU can read an existing host allocation (e.g. a table loaded by NumPy). */
ENGRAM_API int engram_host_register(void* ptr, size_t bytes);
ENGRAM_API int engram_host_unregister(void* ptr);

/* ======================================================================================
 * Hot-row cache: a step's plan and admission on the GPU (cacheKernel.cu), for a device
 * cache of a host table's rows in front of the host gather (python/engram_trt/hotcache.py).
 *
 * State, all int32 device arrays owned by the caller:
 *   slot_of      [table_num_rows + 1]: row -> cache slot, or -1 (not cached). The last
 *                entry is the sentinel row that every id outside [0, table_num_rows)
 *                maps to (fetched as a zero row, so it is cached like any row).
 *   row_of_slot  [capacity]: slot -> row (-1: empty).
 *   counts       [table_num_rows + 1]: lookups per row (the LFU's frequencies).
 * Work table (the gather's input): cache slots [0, capacity), then a miss area from row
 * miss_base (>= capacity) where the step's fetched rows go, miss j at miss_base + j.
 *
 * engram_cache_plan: for the step's ids [num_ids] (device int32, any values):
 *   counts[row] += 1 per lookup (counts NULL: not counted);
 *   plan[0] = distinct cached rows looked up (hits), plan[1] = M = distinct uncached rows
 *   (misses), plan[2 .. 2 + M) = the misses' rows, in no particular order (the order
 *   changes from run to run; each appears once);
 *   positions[i] = the work-table row of lookup i: its slot, or miss_base + j for miss j.
 * plan holds 2 + num_ids int32 (device). plan_host: NULL, or pinned host memory of
 * 2 + plan_host_ids int32: plan[0 .. 2 + min(plan_host_ids, num_ids)) is copied there on
 * `stream` after the kernels, so one synchronization gives the counts and (if M <=
 * plan_host_ids) every miss. Between a plan and its engram_cache_admit, slot_of holds
 * the misses' codes (values below -1): nothing but that admission may read or write it
 * (a cache serves one step at a time, in stream order). Limits: num_ids <= 2^30,
 * table_num_rows <= 2^31 - 2, miss_base < 2^30, miss_base + num_ids <= 2^31 - 1.
 *
 * engram_cache_admit: the step's end (call it after every plan, also when nothing is
 * admitted: it restores the misses' slot_of entries). miss_rows = plan + 2, num_miss = M.
 *   misses j < num_free take slots filled + j (slot_of, row_of_slot, and, with
 *   work_rows, their rows copied from the miss area); the other misses get slot_of -1;
 *   then num_candidates replacement tries: candidate c is miss pick = num_free +
 *   (candidate_start + c * candidate_stride) % (M - num_free), its victim the slot of
 *   lowest count (ties: the first) among (sample_first + c * sample_factor + k) %
 *   capacity, k < sample_factor; if counts[candidate] > counts[victim's row], the
 *   candidate takes the slot (the old row gets slot_of -1), its row copied from the miss
 *   area, and *replaced (if not NULL) gets + 1.
 * Replacements need a full cache (filled + num_free == capacity), distinct candidates
 * (num_candidates * candidate_stride <= M - num_free) and disjoint windows
 * (num_candidates * sample_factor <= capacity); then the result does not depend on the
 * order the GPU runs them in. work_rows: NULL (maps only), or the work table's rows
 * (row_bytes each, a multiple of 16, 16-byte aligned); work_scales: its scale bytes
 * (scale_bytes each), exactly when scale_bytes > 0.
 */
ENGRAM_API int engram_cache_plan(const int32_t* ids, int64_t num_ids, int64_t table_num_rows, int32_t* slot_of,
    int32_t* counts, int64_t miss_base, int32_t* plan, int32_t* positions, int32_t* plan_host, int64_t plan_host_ids,
    cudaStream_t stream);

ENGRAM_API int engram_cache_admit(const int32_t* miss_rows, int64_t num_miss, int64_t num_free, int64_t filled,
    int64_t capacity, int32_t* slot_of, int32_t* row_of_slot, const int32_t* counts, int64_t num_candidates,
    int64_t candidate_start, int64_t candidate_stride, int64_t sample_first, int32_t sample_factor, int64_t miss_base,
    void* work_rows, int64_t row_bytes, void* work_scales, int64_t scale_bytes, int64_t* replaced, cudaStream_t stream);

/* engram_cache_admission: a step's admission numbers (what engram_cache_admit takes)
 * from its miss count, the cache's fill and its tuning, the host's part of the
 * admission (cachepolicy.py's CachePolicy._admission is its reference; a test ties the
 * two). num_free = min(num_miss, capacity - filled). Replacements are tried only with
 * `replace`, a cache that the free slots fill and misses left over: budget = min(
 * admit_budget, num_miss - num_free, capacity) candidates, spread evenly (stride (num_miss
 * - num_free) / budget) from a start drawn in [0, num_miss - num_free), each against the
 * coldest of sample_factor' = max(1, min(sample_factor, capacity / budget)) slots of a
 * window from a first slot drawn in [0, capacity). The draws are counter-based, no
 * generator state: draw k of a step is splitmix64(seed + (2 * step + k) *
 * 0x9E3779B97F4A7C15) modulo the range, so a step's draws depend on (seed, step) alone
 * and any caller computes the same ones. */
typedef struct EngramCacheAdmission
{
    int64_t num_free;
    int64_t num_candidates;
    int64_t candidate_start;
    int64_t candidate_stride;
    int64_t sample_first;
    int32_t sample_factor;
} EngramCacheAdmission;

ENGRAM_API int engram_cache_admission(int64_t num_miss, int64_t filled, int64_t capacity, int64_t admit_budget,
    int32_t sample_factor, int32_t replace, uint64_t seed, int64_t step, EngramCacheAdmission* admission);

/* engram_cache_step: one whole step of a hot-row cache in front of the host gather, in one
 * call: engram_cache_plan (the miss list to plan_host), the gatherer's wake, one wait on
 * `stream` for the counts and misses (a second copy and wait if more misses than
 * host_ids), engram_host_gather_raw_dev of the misses into the work table's miss area
 * (their device list as ids_dev for ENGRAM_LAYOUT_HBM_SCALES), engram_gather of every
 * lookup from the work table into `out` [deliver_tokens, deliver_cols, head_dim] bf16,
 * then engram_cache_admission and engram_cache_admit. The same calls, arguments and
 * order as the Python cache's step (hotcache.py) without the interpreter between them.
 * With ids_host the step first copies the ids to ids_staging on `stream` and plans from
 * there.
 * A failed fetch or delivery ends the step with an admission of nothing (the slot map
 * restored; `aborted` set) and returns the failure, its reason in engram_last_error().
 * Returns hits (distinct cached rows looked up), num_miss and num_free (misses admitted
 * into free slots; replacements are counted in *replaced on the device).
 * With an overlap (engram_cache_overlap_create), a step with both hits and misses
 * delivers in two engram_gather_part calls: the lookups of cached rows on the overlap's
 * stream, launched before the fetch so the GPU copies them while the host gathers the
 * misses, then the misses' lookups on `stream` after the fetch; `stream` waits for the
 * first before the admission (which moves work-table rows) and before the call returns.
 * `out` holds the same bytes either way.
 * With an overlap and uva_share in (0, 1], a step of at least ENGRAM_CACHE_UVA_MIN_MISSES
 * misses in the split or hbm-scales layout reads the first floor(uva_share * num_miss)
 * of them with engram_gather_raw on the overlap's stream (rows_host must then be pinned
 * or registered: the GPU reads it) while the host gather fetches the rest; the misses'
 * delivery waits for both. uva_share 0: the host gather fetches every miss. */
#define ENGRAM_CACHE_UVA_MIN_MISSES 8192
typedef struct EngramCacheOverlap EngramCacheOverlap;
typedef struct EngramCacheStepArgs
{
    /* the cache, bound once */
    int64_t table_num_rows; /* the policy's and the host table's rows */
    int32_t* slot_of;
    int32_t* counts;
    int32_t* row_of_slot;
    int64_t capacity;
    int64_t admit_budget;
    int32_t sample_factor;
    uint64_t seed;
    int32_t* plan;      /* device [2 + max_ids] */
    int32_t* positions; /* device [max_ids] */
    int32_t* plan_host; /* pinned host [2 + max_host_ids], max_host_ids >= num_ids */
    int64_t max_ids;
    int64_t max_host_ids;
    void* work_rows;   /* [work_num_rows, row_bytes] */
    void* work_scales; /* [work_num_rows, scale_bytes] (fp8), or NULL */
    int64_t work_num_rows;
    int64_t row_bytes;
    int64_t scale_bytes;
    int64_t miss_base;
    int32_t head_dim;
    int32_t table_dtype;
    int32_t quant_block;
    int32_t table_layout;
    EngramHostGatherer* gatherer;
    const void* rows_host;
    const void* scales;          /* host (split), NULL (inline) or device (hbm_scales) */
    int64_t* replaced;           /* device, or NULL */
    EngramCacheOverlap* overlap; /* NULL: the delivery as one gather after the fetch */
    float uva_share;             /* with an overlap: the share of a large step's misses read through UVA */
    int32_t uva_blocks;          /* that read's grid cap (engram_gather_raw's max_blocks) */
    /* the step */
    const int32_t* ids;      /* device [num_ids]; or NULL with ids_host */
    const int32_t* ids_host; /* NULL, or host [num_ids] (pinned: the copy is asynchronous) */
    int32_t* ids_staging;    /* device [max_ids]: where ids_host is copied first, on `stream` */
    int64_t num_ids;
    int64_t deliver_tokens; /* deliver_tokens * deliver_cols == num_ids */
    int32_t deliver_cols;
    void* out;
    int64_t host_ids; /* misses copied with the counts (<= max_host_ids) */
    int64_t filled;
    int32_t replace;
    int64_t step; /* the admission's draw counter */
} EngramCacheStepArgs;

typedef struct EngramCacheStepResult
{
    int64_t hits;
    int64_t num_miss;
    int64_t num_free;
    int32_t aborted;
} EngramCacheStepResult;

ENGRAM_API int engram_cache_step(const EngramCacheStepArgs* args, EngramCacheStepResult* result, cudaStream_t stream);

/* A cache step's overlap: a stream of its own (non-blocking) and an event (no timing),
 * made on the current device, which must be the cache's. One overlap serves one cache
 * (its steps are never concurrent); destroy it after the cache's last step. */
ENGRAM_API int engram_cache_overlap_create(EngramCacheOverlap** overlap);
ENGRAM_API int engram_cache_overlap_destroy(EngramCacheOverlap* overlap);

/* sizeof the three structs above, for bindings that mirror them (ctypes). */
ENGRAM_API int engram_cache_step_sizes(int64_t* args_bytes, int64_t* result_bytes, int64_t* admission_bytes);

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

/*
 * DeepSeek-V4's mHC hyper-connections per token (mhcKernel.cu; the reference is
 * engram_trt.models.deepseek_v4.modules.HyperConnection / HyperHead, the float64 one
 * engram_trt.builder.reference_mhc). streams [T, hc, D] io_type (bf16, fp16, fp32); the
 * parameters fp32: fn [(2 + hc) hc, hc D] (head: [hc, hc D]), base [(2 + hc) hc] (head:
 * [hc]), scale [3] (head: [1]). With r = rsqrt(mean(x^2) + norm_eps) over the token's hc D
 * values x and m = r (fn @ x): pre = sigmoid(m scale[0] + base) + hc_eps; post =
 * 2 sigmoid(...scale[1]...); comb = row softmax(...scale[2]...) + hc_eps, then Sinkhorn-Knopp
 * (columns, then sinkhorn_iters - 1 rounds of rows and columns, each sum + hc_eps).
 *   engram_mhc_pre:  collapsed [T, D] = sum_c pre[c] x[c] (io_type, rounded once); post
 *                    [T, hc] and comb [T, hc, hc] fp32 out.
 *   engram_mhc_post: new_streams [T, hc, D] = post[k] out[d] + sum_j comb[j, k] x[j, d],
 *                    post / comb rounded to io_type first (as the reference casts them),
 *                    fp32 sum rounded once; new_streams may be streams (in place).
 *   engram_mhc_head: the pre alone (fn [hc, hc D], one scale): collapsed [T, D].
 * fp32 math; deterministic (no atomics, the K split depends on T and hc D only). Limits:
 * 1 <= hc <= ENGRAM_MHC_MAX_HC, D % 8 == 0, 1 <= sinkhorn_iters <=
 * ENGRAM_MHC_MAX_SINKHORN_ITERS; streams, fn, collapsed, out, new_streams 16-byte aligned;
 * workspace engram_mhc_workspace_size(T, ...) bytes (fp32 partials), apart from the rest.
 */
#define ENGRAM_MHC_MAX_HC 8
#define ENGRAM_MHC_MAX_SINKHORN_ITERS 1000

ENGRAM_API int engram_mhc_check_shape(
    int32_t hc_mult, int32_t hidden, int32_t sinkhorn_iters, float hc_eps, float norm_eps);
/* Bytes of workspace engram_mhc_pre / engram_mhc_head need for num_tokens tokens; needs no GPU. */
ENGRAM_API int engram_mhc_workspace_size(int64_t num_tokens, int32_t hc_mult, int32_t hidden, size_t* bytes);
ENGRAM_API int engram_mhc_pre(const void* streams, int32_t io_type, const float* fn, const float* base,
    const float* scale, int64_t num_tokens, int32_t hc_mult, int32_t hidden, int32_t sinkhorn_iters, float hc_eps,
    float norm_eps, void* workspace, size_t workspace_bytes, void* collapsed, float* post, float* comb,
    cudaStream_t stream);
ENGRAM_API int engram_mhc_post(const void* streams, const void* out, int32_t io_type, const float* post,
    const float* comb, int64_t num_tokens, int32_t hc_mult, int32_t hidden, void* new_streams, cudaStream_t stream);
ENGRAM_API int engram_mhc_head(const void* streams, int32_t io_type, const float* fn, const float* base,
    const float* scale, int64_t num_tokens, int32_t hc_mult, int32_t hidden, float hc_eps, float norm_eps,
    void* workspace, size_t workspace_bytes, void* collapsed, cudaStream_t stream);

/* engram_mhc_pre followed by the layer's weighted RMSNorm of the collapse (the norm in
 * front of the attention or the MoE, fused into the collapse's last launch): normed [T, D]
 * io_type = bf16(norm_weight * (c * rsqrt(mean(c^2) + rms_eps))) with c = the collapse
 * rounded to io_type (what engram_mhc_pre writes), float32 products, norm_weight [D] fp32.
 * post / comb as engram_mhc_pre's. */
ENGRAM_API int engram_mhc_pre_norm(const void* streams, int32_t io_type, const float* fn, const float* base,
    const float* scale, int64_t num_tokens, int32_t hc_mult, int32_t hidden, int32_t sinkhorn_iters, float hc_eps,
    float norm_eps, const float* norm_weight, float rms_eps, void* workspace, size_t workspace_bytes, void* normed,
    float* post, float* comb, cudaStream_t stream);
/* engram_mhc_head followed by the final weighted RMSNorm (as engram_mhc_pre_norm). */
ENGRAM_API int engram_mhc_head_norm(const void* streams, int32_t io_type, const float* fn, const float* base,
    const float* scale, int64_t num_tokens, int32_t hc_mult, int32_t hidden, float hc_eps, float norm_eps,
    const float* norm_weight, float rms_eps, void* workspace, size_t workspace_bytes, void* normed,
    cudaStream_t stream);

/* The expansion after one sublayer folded into the collapse before the next (the decode
 * step's sublayer boundary in two launches instead of three): new_streams =
 * engram_mhc_post(streams, out, post, comb) (may be streams itself; the same bits), then
 * over new_streams engram_mhc_pre (head 0: fn / base / scale of a layer, next_post /
 * next_comb written) or engram_mhc_head (head 1), with the RMSNorm of norm_weight (fp32
 * [D], rms_eps) when norm_weight is not NULL: collapsed [T, D] io_type. For up to 8 tokens
 * the expansion and the collapse's mix are one launch (a block owns a span of channels of
 * every stream; the mix's partial sums split by channel span, so the collapse differs from
 * engram_mhc_pre's by the order of fp32 sums only); more tokens take the three launches.
 * workspace engram_mhc_fold_workspace_size(T, ...) bytes, apart from the rest; collapsed
 * apart from streams and new_streams. */
ENGRAM_API int engram_mhc_fold_workspace_size(int64_t num_tokens, int32_t hc_mult, int32_t hidden, size_t* bytes);
ENGRAM_API int engram_mhc_fold(const void* streams, const void* out, int32_t io_type, const float* post,
    const float* comb, const float* fn, const float* base, const float* scale, int64_t num_tokens, int32_t hc_mult,
    int32_t hidden, int32_t sinkhorn_iters, float hc_eps, float norm_eps, int32_t head, const float* norm_weight,
    float rms_eps, void* workspace, size_t workspace_bytes, void* new_streams, void* collapsed, float* next_post,
    float* next_comb, cudaStream_t stream);

/* ======================================================================================
 * The decode step's glue around DeepSeek-V4's attention kernel and MoE (decodeNormKernel.cu,
 * decodeGemvKernel.cu, decodeMoeKernel.cu; python/engram_trt/native/decode.py): the
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
 * Products and limits otherwise engram_gemv_segments_bf16's. */
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
 * ENGRAM_MOE_SQRT_SOFTPLUS; softplus(z) = z above 20, else log1p(exp(z))) or io(sigmoid(z)).
 * Top-k routing (bias [E] fp32): ids = the top_k e by s[e] + bias[e] (float32), larger
 * first, NaN above every number, equal keys by the lower e. Hash routing (tid2eid
 * [vocab, top_k] int64 with input_ids [T] int64): ids = tid2eid[input_ids[t]]; an id
 * outside [0, E) (or a token outside the vocabulary) becomes -1 with weight 0.
 * weights[t, j] = io(io(s[ids_j] / io(io(sum_j s[ids_j]) + 1e-20)) * scaling), float32
 * [T, top_k]; ids int32 [T, top_k].
 * Limits: 1 <= top_k <= min(E, ENGRAM_MOE_MAX_TOP_K), E <= ENGRAM_MOE_MAX_EXPERTS. */
#define ENGRAM_MOE_MAX_EXPERTS 1024
#define ENGRAM_MOE_MAX_TOP_K 16
enum EngramMoeScore
{
    ENGRAM_MOE_SQRT_SOFTPLUS = 0,
    ENGRAM_MOE_SIGMOID = 1
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
 *   the picks in ascending e (ties by j);  out[t] = bf(routed + bf(shared_down h_shared)).
 * gate / up [E, I, D], down [E, D, I], shared_gate / shared_up [I_s, D], shared_down [D, I_s]
 * (I_s = shared_intermediate, 0: no shared expert), x / out [T, D], all bf16 row-major.
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
} EngramMoeExperts;
ENGRAM_API int engram_moe_experts_workspace_size(
    int64_t num_tokens, int32_t top_k, int32_t intermediate, int32_t shared_intermediate, size_t* bytes);
ENGRAM_API int engram_moe_experts_bf16(const EngramMoeExperts* args, cudaStream_t stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

/* Weights in their stored formats (FP8 / FP4 / BF16 products): quantKernels.h. */
#include "quantKernels.h"

#endif /* ENGRAM_TRT_KERNELS_H */
