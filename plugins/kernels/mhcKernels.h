// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * engram-trt kernel library, DeepSeek-V4's mHC hyper-connections (mhcKernel.cu).
 * Part of the C ABI of engramKernels.h (the umbrella header), whose conventions hold here.
 */
#ifndef ENGRAM_TRT_MHC_KERNELS_H
#define ENGRAM_TRT_MHC_KERNELS_H

#include "engramKernelsCore.h"

#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

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

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* ENGRAM_TRT_MHC_KERNELS_H */
