// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * Qwen4-Exp PLE fusion of a packed step: the streams' update from the token's PLE key /
 * value projections (engram_trt.models.qwen4_exp.modules.PLEFusion is the reference,
 * itself tied to transformers' Qwen4ExpTextPLELayer).
 *
 * Per token t and stream c (D = hidden, W = hc * D):
 *   kn = offset_rms(key[t, c]) (1 + wk), qn = offset_rms(streams[t, c]) (1 + wq)
 *   score = <kn, qn> / sqrt(D), g = sigmoid(sign(score) sqrt(max(|score|, 1e-6)))
 *   gated = g * value[t], normed = offset_rms(gated) (1 + wc)
 *   out[t, c] = gated + silu(sum_j conv[ch, j] * normed(position - (K-1-j) * dilation))
 * where normed of an earlier position comes from this step (the same sequence's earlier
 * tokens) or from the slot's history (the last (K-1) * dilation normed values), zero
 * before a sequence's first token.
 *
 * Three launches on one stream, so no kernel reads what a concurrent block writes:
 *   1. norm:    a block per (token, stream): one pass of four fp32 sums (key^2,
 *               streams^2, key (1+wk) streams (1+wq), value^2), then normed (rounded
 *               to the activation type, as the reference rounds it, so a value read back
 *               from the history equals the one computed in the step) into the
 *               workspace, and g (fp32) beside it. rms(g * value) = |g| rms(value), so
 *               gated is never stored.
 *   2. conv:    a block per token, a thread per 8 channels: finds its sequence
 *               (seqIndex.cuh), gathers the K taps from the workspace or the
 *               history, writes g * value + silu(conv) (+ streams with add_streams)
 *               rounded once.
 *   3. history: a thread per (sequence, channel) (convHistory.cuh): the new last H values of
 *               [old history (zeros for a fresh sequence), this step's normed], in place
 *               (ascending, each read ahead of the write that would clobber it).
 */
#include "convHistory.cuh"
#include "engramKernelsCore.h"
#include "engramKernelsInternal.h"
#include "gateMath.h"
#include "pleKernels.h"
#include "seqIndex.cuh"
#include "vecLoad.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cmath>
#include <cstdint>

namespace engram_trt
{
namespace kernels
{

namespace
{

constexpr int kPleNormMaxThreads = 256;
constexpr int kPleConvMaxThreads = 256;
constexpr float kPleGateClamp = 1e-6F; // sqrt(max(|score|, 1e-6)), the reference's clamp

//! Block-wide sums of four values (every thread gets them); blockDim.x a multiple of 32.
__device__ __forceinline__ void blockSum4(float (&v)[4])
{
    __shared__ float partial[4][kPleNormMaxThreads / 32];
#pragma unroll
    for (int i = 0; i < 4; ++i)
    {
        v[i] = warpSum(v[i]);
    }
    int const warps = static_cast<int>(blockDim.x) / 32;
    if (warps == 1)
    {
        return;
    }
    int const warp = threadIdx.x / 32;
    int const lane = threadIdx.x % 32;
    if (lane == 0)
    {
#pragma unroll
        for (int i = 0; i < 4; ++i)
        {
            partial[i][warp] = v[i];
        }
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < 4; ++i)
    {
        v[i] = warpSum(lane < warps ? partial[i][lane] : 0.0F);
    }
}

/*
 * Kernel 1: blockIdx.x = t * hc + c. normed [T, W] in IoT, gate [T, hc] fp32.
 */
template <typename IoT, typename WeightT>
__global__ void __launch_bounds__(kPleNormMaxThreads) pleFusionNormKernel(IoT const* __restrict__ streams,
    IoT const* __restrict__ key, IoT const* __restrict__ value, WeightT const* __restrict__ keyWeight,
    WeightT const* __restrict__ queryWeight, WeightT const* __restrict__ convNormWeight, int32_t hc, int32_t hidden,
    float eps, IoT* __restrict__ normed, float* __restrict__ gate)
{
    int64_t const block = blockIdx.x;
    int64_t const t = block / hc;
    int32_t const c = static_cast<int32_t>(block - t * hc);
    int64_t const width = static_cast<int64_t>(hc) * hidden;
    int64_t const rowOffset = t * width + static_cast<int64_t>(c) * hidden;
    IoT const* s = streams + rowOffset;
    IoT const* k = key + rowOffset;
    IoT const* v = value + t * hidden;
    WeightT const* wk = keyWeight + static_cast<int64_t>(c) * hidden;
    WeightT const* wq = queryWeight + static_cast<int64_t>(c) * hidden;
    WeightT const* wc = convNormWeight + static_cast<int64_t>(c) * hidden;
    int32_t const vectors = hidden / 8;

    // sums: [0] key^2, [1] streams^2, [2] key (1+wk) streams (1+wq), [3] value^2
    float sums[4] = {0.0F, 0.0F, 0.0F, 0.0F};
    for (int32_t j = threadIdx.x; j < vectors; j += blockDim.x)
    {
        float kv[8], sv[8], vv[8], wkv[8], wqv[8];
        load8(k + 8 * j, kv);
        load8(s + 8 * j, sv);
        load8(v + 8 * j, vv);
        load8(wk + 8 * j, wkv);
        load8(wq + 8 * j, wqv);
#pragma unroll
        for (int i = 0; i < 8; ++i)
        {
            sums[0] += kv[i] * kv[i];
            sums[1] += sv[i] * sv[i];
            sums[2] += (kv[i] * (1.0F + wkv[i])) * (sv[i] * (1.0F + wqv[i]));
            sums[3] += vv[i] * vv[i];
        }
    }
    blockSum4(sums);
    float const invD = 1.0F / static_cast<float>(hidden);
    float const score = sums[2] * gateRsqrt(sums[0] * invD + eps) * gateRsqrt(sums[1] * invD + eps)
        * gateRsqrt(static_cast<float>(hidden));
    float const g = gateFromScore(score, kPleGateClamp);
    // offset_rms(g * value): mean((g v)^2) = g^2 mean(v^2).
    float const scale = g * gateRsqrt(g * g * (sums[3] * invD) + eps);
    if (threadIdx.x == 0)
    {
        gate[block] = g;
    }
    IoT* n = normed + rowOffset;
    for (int32_t j = threadIdx.x; j < vectors; j += blockDim.x)
    {
        float vv[8], wcv[8];
        load8(v + 8 * j, vv);
        load8(wc + 8 * j, wcv);
#pragma unroll
        for (int i = 0; i < 8; ++i)
        {
            vv[i] = vv[i] * scale * (1.0F + wcv[i]);
        }
        store8(n + 8 * j, vv);
    }
}

/*
 * Kernel 2: blockIdx.x = t; thread j owns channels [8 j, 8 j + 8) of the W.
 */
template <typename IoT, typename WeightT>
__global__ void __launch_bounds__(kPleConvMaxThreads) pleFusionConvKernel(IoT const* __restrict__ normed,
    float const* __restrict__ gate, IoT const* __restrict__ value, IoT const* streams,
    WeightT const* __restrict__ convWeight, IoT const* __restrict__ history, int64_t numSlots,
    int32_t const* __restrict__ seqStarts, int32_t const* __restrict__ pastLens, int32_t const* __restrict__ seqSlots,
    int64_t numSeqs, int32_t hc, int32_t hidden, int32_t kernel, int32_t dilation, int32_t addStreams, IoT* out)
{
    int64_t const t = blockIdx.x;
    int64_t const width = static_cast<int64_t>(hc) * hidden;
    int32_t const vectors = static_cast<int32_t>(width / 8);
    int64_t const seq = sequenceOf(seqStarts, numSeqs, t);
    if (seq < 0)
    {
        // A token outside every sequence (padding): a zero update.
        float zeros[8] = {0.0F, 0.0F, 0.0F, 0.0F, 0.0F, 0.0F, 0.0F, 0.0F};
        for (int32_t j = threadIdx.x; j < vectors; j += blockDim.x)
        {
            if (addStreams != 0)
            {
                float sv[8];
                load8(streams + t * width + 8 * j, sv);
                store8(out + t * width + 8 * j, sv);
            }
            else
            {
                store8(out + t * width + 8 * j, zeros);
            }
        }
        return;
    }
    int64_t const start = seqStarts[seq];
    int64_t const past = pastLens[seq] > 0 ? pastLens[seq] : 0;
    int64_t const slot = seqSlots[seq];
    int64_t const historyLen = static_cast<int64_t>(kernel - 1) * dilation;
    bool const hasHistory = past > 0 && slot >= 0 && slot < numSlots && historyLen > 0;
    int64_t const position = past + (t - start);

    for (int32_t j = threadIdx.x; j < vectors; j += blockDim.x)
    {
        int64_t const ch0 = 8 * static_cast<int64_t>(j);
        int32_t const c = static_cast<int32_t>(ch0 / hidden);
        int64_t const d0 = ch0 - static_cast<int64_t>(c) * hidden;
        float acc[8] = {0.0F, 0.0F, 0.0F, 0.0F, 0.0F, 0.0F, 0.0F, 0.0F};
        for (int32_t tap = 0; tap < kernel; ++tap)
        {
            int64_t const back = static_cast<int64_t>(kernel - 1 - tap) * dilation;
            int64_t const q = position - back; // the position this tap reads
            float x[8];
            if (q >= past && t - back >= 0)
            {
                load8(normed + (t - back) * width + ch0, x); // a token of this step
            }
            else if (q >= 0 && q < past && hasHistory)
            {
                // history[slot, ch, H - past + q]: position past - 1 sits at index H - 1.
                IoT const* h = history + (slot * width + ch0) * historyLen + (historyLen - past + q);
#pragma unroll
                for (int i = 0; i < 8; ++i)
                {
                    x[i] = toFloat(h[i * historyLen]);
                }
            }
            else
            {
                continue; // before the sequence's first token: zero
            }
#pragma unroll
            for (int i = 0; i < 8; ++i)
            {
                acc[i] += toFloat(convWeight[(ch0 + i) * kernel + tap]) * x[i];
            }
        }
        float const g = gate[t * hc + c];
        float vv[8];
        load8(value + t * hidden + d0, vv);
        float o[8];
#pragma unroll
        for (int i = 0; i < 8; ++i)
        {
            float const silu = acc[i] / (1.0F + expf(-acc[i]));
            o[i] = g * vv[i] + silu;
        }
        if (addStreams != 0)
        {
            float sv[8];
            load8(streams + t * width + ch0, sv);
#pragma unroll
            for (int i = 0; i < 8; ++i)
            {
                o[i] += sv[i];
            }
        }
        store8(out + t * width + ch0, o);
    }
}

char const* typeName(int32_t type)
{
    switch (type)
    {
    case ENGRAM_FLOAT_BF16: return "bf16";
    case ENGRAM_FLOAT_F32: return "fp32";
    case ENGRAM_FLOAT_F16: return "fp16";
    default: return "unknown";
    }
}

int64_t alignUp16(int64_t bytes)
{
    return (bytes + 15) / 16 * 16;
}

int32_t ioBytesOf(int32_t ioType)
{
    return ioType == ENGRAM_FLOAT_F32 ? 4 : 2;
}

//! Threads for a row of `vectors` 8-element vectors: a multiple of 32, at most `cap`.
int threadsFor(int64_t vectors, int cap)
{
    int64_t threads = (vectors + 31) / 32 * 32;
    return static_cast<int>(threads > cap ? cap : threads);
}

struct PleFusionLaunch
{
    void const* streams;
    void const* key;
    void const* value;
    void const* keyWeight;
    void const* queryWeight;
    void const* convNormWeight;
    void const* convWeight;
    void* history;
    int64_t numSlots;
    int32_t const* seqStarts;
    int32_t const* pastLens;
    int32_t const* seqSlots;
    int64_t numSeqs;
    int64_t numTokens;
    int32_t hc;
    int32_t hidden;
    int32_t kernel;
    int32_t dilation;
    float eps;
    int32_t addStreams;
    void* normed;
    float* gate;
    void* out;
    cudaStream_t stream;
};

template <typename IoT, typename WeightT>
int launchPleFusion(PleFusionLaunch const& a)
{
    auto const* streams = static_cast<IoT const*>(a.streams);
    auto const* key = static_cast<IoT const*>(a.key);
    auto const* value = static_cast<IoT const*>(a.value);
    auto* normed = static_cast<IoT*>(a.normed);
    auto* history = static_cast<IoT*>(a.history);
    auto* out = static_cast<IoT*>(a.out);
    int64_t const width = static_cast<int64_t>(a.hc) * a.hidden;
    int32_t const historyLen = (a.kernel - 1) * a.dilation;

    resetLaunchError();
    pleFusionNormKernel<IoT, WeightT>
        <<<static_cast<unsigned>(a.numTokens * a.hc), threadsFor(a.hidden / 8, kPleNormMaxThreads), 0, a.stream>>>(
            streams, key, value, static_cast<WeightT const*>(a.keyWeight), static_cast<WeightT const*>(a.queryWeight),
            static_cast<WeightT const*>(a.convNormWeight), a.hc, a.hidden, a.eps, normed, a.gate);
    int status = checkLaunch("engram_ple_fusion (norm)");
    if (status != 0)
    {
        return status;
    }
    resetLaunchError();
    pleFusionConvKernel<IoT, WeightT>
        <<<static_cast<unsigned>(a.numTokens), threadsFor(width / 8, kPleConvMaxThreads), 0, a.stream>>>(normed, a.gate,
            value, streams, static_cast<WeightT const*>(a.convWeight), history, a.numSlots, a.seqStarts, a.pastLens,
            a.seqSlots, a.numSeqs, a.hc, a.hidden, a.kernel, a.dilation, a.addStreams, out);
    status = checkLaunch("engram_ple_fusion (conv)");
    if (status != 0 || historyLen == 0 || a.numSeqs == 0)
    {
        return status;
    }
    int64_t const threads = a.numSeqs * width;
    resetLaunchError();
    convHistoryKernel<IoT><<<static_cast<unsigned>((threads + kConvHistoryThreads - 1) / kConvHistoryThreads),
        kConvHistoryThreads, 0, a.stream>>>(
        normed, history, a.numSlots, a.seqStarts, a.pastLens, a.seqSlots, a.numSeqs, a.numTokens, width, historyLen);
    return checkLaunch("engram_ple_fusion (history)");
}

template <typename IoT>
int launchPleFusionFor(int32_t weightType, PleFusionLaunch const& a)
{
    return weightType == ENGRAM_FLOAT_F32 ? launchPleFusion<IoT, float>(a) : launchPleFusion<IoT, IoT>(a);
}

} // namespace

} // namespace kernels
} // namespace engram_trt

using namespace engram_trt::kernels;

extern "C" ENGRAM_API int engram_ple_fusion_check_shape(
    int32_t hcCount, int32_t hidden, int32_t kernel, int32_t dilation, float eps)
{
    clearError();
    if (hcCount < 1 || hidden < 8 || hidden % 8 != 0)
    {
        return fail(cudaErrorInvalidValue,
            "engram_ple_fusion: need hc_count >= 1 and hidden a positive multiple of 8 (got %d, %d)", hcCount, hidden);
    }
    if (static_cast<int64_t>(hcCount) * hidden > INT32_MAX)
    {
        return fail(cudaErrorInvalidValue, "engram_ple_fusion: hc_count * hidden = %lld exceeds 2^31 - 1",
            static_cast<long long>(hcCount) * hidden);
    }
    if (kernel < 1 || kernel > ENGRAM_PLE_FUSION_MAX_KERNEL || dilation < 1
        || dilation > ENGRAM_PLE_FUSION_MAX_DILATION)
    {
        return fail(cudaErrorInvalidValue,
            "engram_ple_fusion: kernel must be in [1, %d] and dilation in [1, %d] (got %d, %d)",
            ENGRAM_PLE_FUSION_MAX_KERNEL, ENGRAM_PLE_FUSION_MAX_DILATION, kernel, dilation);
    }
    if (!std::isfinite(eps) || eps < 0.0F)
    {
        return fail(cudaErrorInvalidValue, "engram_ple_fusion: eps must be finite and >= 0");
    }
    return 0;
}

extern "C" ENGRAM_API int engram_ple_fusion_workspace_size(
    int64_t maxTokens, int32_t hcCount, int32_t hidden, int32_t ioType, size_t* bytes)
{
    clearError();
    if (bytes == nullptr || maxTokens < 0 || hcCount < 1 || hidden < 1)
    {
        return fail(cudaErrorInvalidValue,
            "engram_ple_fusion_workspace_size: need bytes != NULL, max_tokens >= 0, hc_count >= 1, hidden >= 1");
    }
    if (ioType != ENGRAM_FLOAT_BF16 && ioType != ENGRAM_FLOAT_F32 && ioType != ENGRAM_FLOAT_F16)
    {
        return fail(cudaErrorInvalidValue,
            "engram_ple_fusion_workspace_size: io_type %d is not bf16 (0), fp32 (1) or fp16 (2)", ioType);
    }
    int64_t const width = static_cast<int64_t>(hcCount) * hidden;
    *bytes = static_cast<size_t>(alignUp16(maxTokens * width * ioBytesOf(ioType)) + alignUp16(maxTokens * hcCount * 4));
    return 0;
}

extern "C" ENGRAM_API int engram_ple_fusion(void const* streams, void const* key, void const* value, int32_t ioType,
    void const* normKeyWeight, void const* normQueryWeight, void const* normConvWeight, void const* convWeight,
    int32_t weightType, void* convState, int64_t numSlots, int32_t const* seqStarts, int32_t const* pastLens,
    int32_t const* seqSlots, int64_t numSeqs, int64_t numTokens, int32_t hcCount, int32_t hidden, int32_t kernel,
    int32_t dilation, float eps, int32_t addStreams, void* workspace, size_t workspaceBytes, void* out,
    cudaStream_t stream)
{
    int status = engram_ple_fusion_check_shape(hcCount, hidden, kernel, dilation, eps);
    if (status != 0)
    {
        return status;
    }
    if (ioType != ENGRAM_FLOAT_BF16 && ioType != ENGRAM_FLOAT_F32 && ioType != ENGRAM_FLOAT_F16)
    {
        return fail(
            cudaErrorInvalidValue, "engram_ple_fusion: io_type %d is not bf16 (0), fp32 (1) or fp16 (2)", ioType);
    }
    if (weightType != ENGRAM_FLOAT_F32 && weightType != ioType)
    {
        return fail(cudaErrorInvalidValue,
            "engram_ple_fusion: weight_type %d is neither fp32 (1) nor the io_type (%d, %s)", weightType, ioType,
            typeName(ioType));
    }
    if (numTokens < 0 || numSeqs < 0 || numSlots < 0)
    {
        return fail(cudaErrorInvalidValue,
            "engram_ple_fusion: need num_tokens, num_seqs and num_slots >= 0 (got %lld, %lld, %lld)", ll(numTokens),
            ll(numSeqs), ll(numSlots));
    }
    if (numTokens == 0)
    {
        return 0;
    }
    int64_t const width = static_cast<int64_t>(hcCount) * hidden;
    if (numTokens > INT32_MAX / hcCount)
    {
        return fail(cudaErrorInvalidValue, "engram_ple_fusion: grid too large (%lld tokens x hc_count %d >= 2^31)",
            ll(numTokens), hcCount);
    }
    if (numSeqs > INT32_MAX / width * kConvHistoryThreads)
    {
        return fail(cudaErrorInvalidValue, "engram_ple_fusion: grid too large (%lld sequences x width %lld)",
            ll(numSeqs), ll(width));
    }
    void const* aligned[] = {streams, key, value, normKeyWeight, normQueryWeight, normConvWeight, workspace, out};
    for (void const* p : aligned)
    {
        if (p == nullptr || !isAligned(p, 16))
        {
            return fail(cudaErrorInvalidValue,
                "engram_ple_fusion: streams, key, value, the three norm weights, workspace and out must be 16-byte "
                "aligned device pointers");
        }
    }
    if (convWeight == nullptr || seqStarts == nullptr || pastLens == nullptr || seqSlots == nullptr)
    {
        return fail(cudaErrorInvalidValue,
            "engram_ple_fusion: conv_weight, seq_starts, past_lens and seq_slots must not be NULL");
    }
    int32_t const historyLen = (kernel - 1) * dilation;
    if (historyLen > 0 && numSlots > 0 && convState == nullptr)
    {
        return fail(cudaErrorInvalidValue, "engram_ple_fusion: conv_state is NULL but num_slots is %lld", ll(numSlots));
    }
    size_t need = 0;
    status = engram_ple_fusion_workspace_size(numTokens, hcCount, hidden, ioType, &need);
    if (status != 0)
    {
        return status;
    }
    if (workspaceBytes < need)
    {
        return fail(cudaErrorInvalidValue, "engram_ple_fusion: workspace holds %llu bytes, %llu needed for %lld tokens",
            static_cast<unsigned long long>(workspaceBytes), static_cast<unsigned long long>(need), ll(numTokens));
    }
    if (overlaps(out, numTokens * width * ioBytesOf(ioType), key, numTokens * width * ioBytesOf(ioType))
        || overlaps(out, numTokens * width * ioBytesOf(ioType), value, numTokens * hidden * ioBytesOf(ioType)))
    {
        return fail(cudaErrorInvalidValue, "engram_ple_fusion: out must not overlap key or value");
    }

    PleFusionLaunch launch{};
    launch.streams = streams;
    launch.key = key;
    launch.value = value;
    launch.keyWeight = normKeyWeight;
    launch.queryWeight = normQueryWeight;
    launch.convNormWeight = normConvWeight;
    launch.convWeight = convWeight;
    launch.history = convState;
    launch.numSlots = convState == nullptr ? 0 : numSlots;
    launch.seqStarts = seqStarts;
    launch.pastLens = pastLens;
    launch.seqSlots = seqSlots;
    launch.numSeqs = numSeqs;
    launch.numTokens = numTokens;
    launch.hc = hcCount;
    launch.hidden = hidden;
    launch.kernel = kernel;
    launch.dilation = dilation;
    launch.eps = eps;
    launch.addStreams = addStreams != 0 ? 1 : 0;
    launch.normed = workspace;
    launch.gate
        = reinterpret_cast<float*>(static_cast<char*>(workspace) + alignUp16(numTokens * width * ioBytesOf(ioType)));
    launch.out = out;
    launch.stream = stream;
    if (ioType == ENGRAM_FLOAT_BF16)
    {
        return launchPleFusionFor<__nv_bfloat16>(weightType, launch);
    }
    if (ioType == ENGRAM_FLOAT_F16)
    {
        return launchPleFusionFor<__half>(weightType, launch);
    }
    return launchPleFusion<float, float>(launch);
}
