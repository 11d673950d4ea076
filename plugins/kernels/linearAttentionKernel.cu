// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * Qwen4-Exp's Gated DeltaNet over a packed step, the two pieces between the projections:
 * the causal depthwise short conv with a per-slot history, and the gated delta rule with
 * a per-slot fp32 memory (engram_trt.builder.reference_linear_attention is the float64
 * reference, tied to models/qwen4_exp/linear_attention.GatedDeltaNet).
 *
 * Causal conv, two launches on one stream (no kernel reads what a concurrent block writes):
 *   1. conv:    a block per (token, 256 channels), a thread per channel: finds its
 *               sequence (seqIndex.cuh), sums the K taps from this step's x or the slot's
 *               history in fp32, the activation, rounded once.
 *   2. history: convHistory.cuh (the PLE fusion's): the slot's row becomes the last K-1
 *               of [old row (zeros when fresh), the sequence's x].
 *
 * Gated delta rule: the columns of the memory S [dk, dv] evolve independently (column j
 * reads only v[j]), so a block owns one (sequence, value head, tile of 32 columns): each
 * of its 8 warps holds 4 columns in registers, a lane the rows lane + 32 i (dk <= 256).
 * The tile is read once from the state through shared memory (coalesced rows, padded
 * against bank conflicts), the sequence's tokens run in order, and it is written back
 * once. Per token (g the log decay, q / k L2-normalized and q scaled when asked):
 *   S = exp(g) S;  u = beta (v - S^T k);  S = S + k u^T;  o = S^T q   (fp32, o rounded once)
 * A third launch zeroes the output rows of tokens outside every sequence.
 */
#include "convHistory.cuh"
#include "engramKernelsCore.h"
#include "engramKernelsInternal.h"
#include "linearAttentionKernels.h"
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

constexpr int kConvThreads = 256;
constexpr int kDeltaWarps = 8;
constexpr int kDeltaColsPerWarp = 4;
constexpr int kDeltaTile = kDeltaWarps * kDeltaColsPerWarp; // columns of dv per block
constexpr int kDeltaRowsPerLane = ENGRAM_GATED_DELTA_MAX_HEAD_DIM / 32;
constexpr int kPadThreads = 256;
constexpr float kL2Eps = 1e-6F; // linear_attention.L2_EPS (inside the root, as FLA's)

/*
 * Causal conv: blockIdx.x = t, blockIdx.y * blockDim.x + threadIdx.x = channel.
 * x, out [T, C]; weight [C, K]; history [numSlots, C, K-1].
 */
template <typename IoT, typename WeightT>
__global__ void __launch_bounds__(kConvThreads) causalConvKernel(IoT const* __restrict__ x,
    WeightT const* __restrict__ weight, IoT const* __restrict__ history, int64_t numSlots,
    int32_t const* __restrict__ seqStarts, int32_t const* __restrict__ pastLens, int32_t const* __restrict__ seqSlots,
    int64_t numSeqs, int64_t channels, int32_t kernel, int32_t activation, IoT* __restrict__ out)
{
    int64_t const t = blockIdx.x;
    int64_t const c = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
    if (c >= channels)
    {
        return;
    }
    int64_t const seq = sequenceOf(seqStarts, numSeqs, t);
    if (seq < 0)
    {
        out[t * channels + c] = fromFloat<IoT>(0.0F); // a padding token
        return;
    }
    int64_t const offset = t - seqStarts[seq]; // the token's index in this step's part of the sequence
    int64_t const slot = seqSlots[seq];
    int32_t const historyLen = kernel - 1;
    bool const carry = pastLens[seq] > 0 && slot >= 0 && slot < numSlots && historyLen > 0;
    IoT const* h = carry ? history + (slot * channels + c) * historyLen : nullptr;
    float acc = 0.0F;
    for (int32_t tap = 0; tap < kernel; ++tap)
    {
        int32_t const back = kernel - 1 - tap;
        int64_t const m = offset - back; // < 0: before this step, history index historyLen + m
        float value;
        if (m >= 0)
        {
            value = toFloat(x[(t - back) * channels + c]);
        }
        else if (carry)
        {
            value = toFloat(h[historyLen + m]);
        }
        else
        {
            continue; // before the sequence's first token: zero
        }
        acc += toFloat(weight[c * kernel + tap]) * value;
    }
    if (activation == ENGRAM_CONV_ACTIVATION_SILU)
    {
        acc = acc / (1.0F + expf(-acc));
    }
    out[t * channels + c] = fromFloat<IoT>(acc);
}

/*
 * Gated delta rule: blockIdx.x = (seq * numVHeads + head) * tiles + tile; kDeltaWarps
 * warps. q, k [T, Hk, dk]; v, out [T, Hv, dv]; g, beta [T, Hv]; state [numSlots, Hv, dk, dv].
 */
template <typename IoT>
__global__ void __launch_bounds__(kDeltaWarps * 32) gatedDeltaKernel(IoT const* __restrict__ q,
    IoT const* __restrict__ k, IoT const* __restrict__ v, float const* __restrict__ g, float const* __restrict__ beta,
    float* __restrict__ state, int64_t numSlots, int32_t const* __restrict__ seqStarts,
    int32_t const* __restrict__ pastLens, int32_t const* __restrict__ seqSlots, int32_t numKHeads, int32_t numVHeads,
    int32_t dk, int32_t dv, int32_t tiles, int32_t l2norm, float scale, IoT* __restrict__ out)
{
    __shared__ float tile[ENGRAM_GATED_DELTA_MAX_HEAD_DIM][kDeltaTile + 1]; // +1: lanes of a column hit distinct banks

    int64_t block = blockIdx.x;
    int32_t const tileIndex = static_cast<int32_t>(block % tiles);
    block /= tiles;
    int32_t const head = static_cast<int32_t>(block % numVHeads);
    int64_t const seq = block / numVHeads;
    int32_t const keyHead = head / (numVHeads / numKHeads);
    int32_t const col0 = tileIndex * kDeltaTile;
    int64_t const start = seqStarts[seq];
    int64_t const end = seqStarts[seq + 1];
    int64_t const slot = seqSlots[seq];
    bool const keeps = slot >= 0 && slot < numSlots;
    bool const carry = keeps && pastLens[seq] > 0;
    float* memory = keeps ? state + (slot * numVHeads + head) * static_cast<int64_t>(dk) * dv : nullptr;

    for (int32_t i = threadIdx.x; i < dk * kDeltaTile; i += blockDim.x)
    {
        int32_t const r = i / kDeltaTile;
        int32_t const c = i - r * kDeltaTile;
        tile[r][c] = carry && col0 + c < dv ? memory[static_cast<int64_t>(r) * dv + col0 + c] : 0.0F;
    }
    __syncthreads();

    int32_t const warp = threadIdx.x / 32;
    int32_t const lane = threadIdx.x % 32;
    int32_t const firstCol = warp * kDeltaColsPerWarp; // within the tile
    float s[kDeltaColsPerWarp][kDeltaRowsPerLane];
#pragma unroll
    for (int j = 0; j < kDeltaColsPerWarp; ++j)
    {
#pragma unroll
        for (int i = 0; i < kDeltaRowsPerLane; ++i)
        {
            int32_t const r = lane + 32 * i;
            s[j][i] = r < dk ? tile[r][firstCol + j] : 0.0F;
        }
    }

    for (int64_t t = start; t < end; ++t)
    {
        IoT const* kp = k + (t * numKHeads + keyHead) * dk;
        IoT const* qp = q + (t * numKHeads + keyHead) * dk;
        float kv[kDeltaRowsPerLane];
        float qv[kDeltaRowsPerLane];
        float kk = 0.0F;
        float qq = 0.0F;
#pragma unroll
        for (int i = 0; i < kDeltaRowsPerLane; ++i)
        {
            int32_t const r = lane + 32 * i;
            kv[i] = r < dk ? toFloat(kp[r]) : 0.0F;
            qv[i] = r < dk ? toFloat(qp[r]) : 0.0F;
            kk += kv[i] * kv[i];
            qq += qv[i] * qv[i];
        }
        float kScale = 1.0F;
        float qScale = scale;
        if (l2norm != 0)
        {
            kScale = 1.0F / sqrtf(warpSum(kk) + kL2Eps);
            qScale = scale / sqrtf(warpSum(qq) + kL2Eps);
        }
#pragma unroll
        for (int i = 0; i < kDeltaRowsPerLane; ++i)
        {
            kv[i] *= kScale;
            qv[i] *= qScale;
        }
        int64_t const row = t * numVHeads + head;
        float const decay = expf(g[row]);
        float const b = beta[row];
        float o[kDeltaColsPerWarp];
#pragma unroll
        for (int j = 0; j < kDeltaColsPerWarp; ++j)
        {
            int32_t const col = col0 + firstCol + j;
            float predicted = 0.0F;
#pragma unroll
            for (int i = 0; i < kDeltaRowsPerLane; ++i)
            {
                s[j][i] *= decay;
                predicted += s[j][i] * kv[i];
            }
            predicted = warpSum(predicted);
            float const vj = col < dv ? toFloat(v[row * dv + col]) : 0.0F;
            float const u = b * (vj - predicted);
            float read = 0.0F;
#pragma unroll
            for (int i = 0; i < kDeltaRowsPerLane; ++i)
            {
                s[j][i] += kv[i] * u;
                read += s[j][i] * qv[i];
            }
            o[j] = warpSum(read);
        }
#pragma unroll
        for (int j = 0; j < kDeltaColsPerWarp; ++j)
        {
            int32_t const col = col0 + firstCol + j;
            if (lane == j && col < dv)
            {
                out[row * dv + col] = fromFloat<IoT>(o[j]);
            }
        }
    }

    if (!keeps)
    {
        return; // a padding sequence keeps nothing (uniform per block: no barrier skipped by part of it)
    }
    __syncthreads(); // every thread has read its part of the tile
#pragma unroll
    for (int j = 0; j < kDeltaColsPerWarp; ++j)
    {
#pragma unroll
        for (int i = 0; i < kDeltaRowsPerLane; ++i)
        {
            int32_t const r = lane + 32 * i;
            if (r < dk)
            {
                tile[r][firstCol + j] = s[j][i];
            }
        }
    }
    __syncthreads();
    for (int32_t i = threadIdx.x; i < dk * kDeltaTile; i += blockDim.x)
    {
        int32_t const r = i / kDeltaTile;
        int32_t const c = i - r * kDeltaTile;
        if (col0 + c < dv)
        {
            memory[static_cast<int64_t>(r) * dv + col0 + c] = tile[r][c];
        }
    }
}

//! Zeroes out[t, :] (rowWidth elements) of a token t outside every sequence.
template <typename IoT>
__global__ void __launch_bounds__(kPadThreads) zeroPaddingRowsKernel(
    int32_t const* __restrict__ seqStarts, int64_t numSeqs, int64_t rowWidth, IoT* __restrict__ out)
{
    int64_t const t = blockIdx.x;
    if (sequenceOf(seqStarts, numSeqs, t) >= 0)
    {
        return;
    }
    for (int64_t i = threadIdx.x; i < rowWidth; i += blockDim.x)
    {
        out[t * rowWidth + i] = fromFloat<IoT>(0.0F);
    }
}

bool isFloatType(int32_t type)
{
    return type == ENGRAM_FLOAT_BF16 || type == ENGRAM_FLOAT_F32 || type == ENGRAM_FLOAT_F16;
}

int64_t ioBytesOf(int32_t ioType)
{
    return ioType == ENGRAM_FLOAT_F32 ? 4 : 2;
}

struct CausalConvLaunch
{
    void const* x;
    void const* weight;
    void* history;
    int64_t numSlots;
    int32_t const* seqStarts;
    int32_t const* pastLens;
    int32_t const* seqSlots;
    int64_t numSeqs;
    int64_t numTokens;
    int64_t channels;
    int32_t kernel;
    int32_t activation;
    void* out;
    cudaStream_t stream;
};

template <typename IoT, typename WeightT>
int launchCausalConv(CausalConvLaunch const& a)
{
    auto* history = static_cast<IoT*>(a.history);
    dim3 const grid(
        static_cast<unsigned>(a.numTokens), static_cast<unsigned>((a.channels + kConvThreads - 1) / kConvThreads));
    resetLaunchError();
    causalConvKernel<IoT, WeightT><<<grid, kConvThreads, 0, a.stream>>>(static_cast<IoT const*>(a.x),
        static_cast<WeightT const*>(a.weight), history, a.numSlots, a.seqStarts, a.pastLens, a.seqSlots, a.numSeqs,
        a.channels, a.kernel, a.activation, static_cast<IoT*>(a.out));
    int const status = checkLaunch("engram_causal_conv1d (conv)");
    int32_t const historyLen = a.kernel - 1;
    if (status != 0 || historyLen == 0 || a.numSeqs == 0 || a.numSlots == 0)
    {
        return status;
    }
    int64_t const threads = a.numSeqs * a.channels;
    resetLaunchError();
    convHistoryKernel<IoT><<<static_cast<unsigned>((threads + kConvHistoryThreads - 1) / kConvHistoryThreads),
        kConvHistoryThreads, 0, a.stream>>>(static_cast<IoT const*>(a.x), history, a.numSlots, a.seqStarts, a.pastLens,
        a.seqSlots, a.numSeqs, a.numTokens, a.channels, historyLen);
    return checkLaunch("engram_causal_conv1d (history)");
}

template <typename IoT>
int launchCausalConvFor(int32_t weightType, CausalConvLaunch const& a)
{
    return weightType == ENGRAM_FLOAT_F32 ? launchCausalConv<IoT, float>(a) : launchCausalConv<IoT, IoT>(a);
}

struct GatedDeltaLaunch
{
    void const* q;
    void const* k;
    void const* v;
    float const* g;
    float const* beta;
    float* state;
    int64_t numSlots;
    int32_t const* seqStarts;
    int32_t const* pastLens;
    int32_t const* seqSlots;
    int64_t numSeqs;
    int64_t numTokens;
    int32_t numKHeads;
    int32_t numVHeads;
    int32_t dk;
    int32_t dv;
    int32_t l2norm;
    float scale;
    void* out;
    cudaStream_t stream;
};

int32_t deltaTiles(int32_t dv)
{
    return (dv + kDeltaTile - 1) / kDeltaTile;
}

template <typename IoT>
int launchGatedDelta(GatedDeltaLaunch const& a)
{
    auto* out = static_cast<IoT*>(a.out);
    int32_t const tiles = deltaTiles(a.dv);
    int64_t const blocks = a.numSeqs * a.numVHeads * tiles;
    if (blocks > 0)
    {
        resetLaunchError();
        gatedDeltaKernel<IoT><<<static_cast<unsigned>(blocks), kDeltaWarps * 32, 0, a.stream>>>(
            static_cast<IoT const*>(a.q), static_cast<IoT const*>(a.k), static_cast<IoT const*>(a.v), a.g, a.beta,
            a.state, a.numSlots, a.seqStarts, a.pastLens, a.seqSlots, a.numKHeads, a.numVHeads, a.dk, a.dv, tiles,
            a.l2norm, a.scale, out);
        int const status = checkLaunch("engram_gated_delta_net (recurrence)");
        if (status != 0)
        {
            return status;
        }
    }
    resetLaunchError();
    zeroPaddingRowsKernel<IoT><<<static_cast<unsigned>(a.numTokens), kPadThreads, 0, a.stream>>>(
        a.seqStarts, a.numSeqs, static_cast<int64_t>(a.numVHeads) * a.dv, out);
    return checkLaunch("engram_gated_delta_net (padding)");
}

} // namespace

} // namespace kernels
} // namespace engram_trt

using namespace engram_trt::kernels;

extern "C" ENGRAM_API int engram_causal_conv1d_check_shape(int64_t channels, int32_t kernel, int32_t activation)
{
    clearError();
    if (channels < 1 || channels > static_cast<int64_t>(kConvThreads) * 65535)
    {
        return fail(cudaErrorInvalidValue, "engram_causal_conv1d: channels must be in [1, %lld] (got %lld)",
            ll(static_cast<int64_t>(kConvThreads) * 65535), ll(channels));
    }
    if (kernel < 1 || kernel > ENGRAM_CAUSAL_CONV_MAX_KERNEL)
    {
        return fail(cudaErrorInvalidValue, "engram_causal_conv1d: kernel must be in [1, %d] (got %d)",
            ENGRAM_CAUSAL_CONV_MAX_KERNEL, kernel);
    }
    if (activation != ENGRAM_CONV_ACTIVATION_IDENTITY && activation != ENGRAM_CONV_ACTIVATION_SILU)
    {
        return fail(cudaErrorInvalidValue, "engram_causal_conv1d: activation must be 0 (identity) or 1 (silu) (got %d)",
            activation);
    }
    return 0;
}

extern "C" ENGRAM_API int engram_causal_conv1d(void const* x, int32_t ioType, void const* weight, int32_t weightType,
    void* convState, int64_t numSlots, int32_t const* seqStarts, int32_t const* pastLens, int32_t const* seqSlots,
    int64_t numSeqs, int64_t numTokens, int64_t channels, int32_t kernel, int32_t activation, void* out,
    cudaStream_t stream)
{
    int status = engram_causal_conv1d_check_shape(channels, kernel, activation);
    if (status != 0)
    {
        return status;
    }
    if (!isFloatType(ioType))
    {
        return fail(
            cudaErrorInvalidValue, "engram_causal_conv1d: io_type %d is not bf16 (0), fp32 (1) or fp16 (2)", ioType);
    }
    if (weightType != ENGRAM_FLOAT_F32 && weightType != ioType)
    {
        return fail(cudaErrorInvalidValue,
            "engram_causal_conv1d: weight_type %d is neither fp32 (1) nor the io_type %d", weightType, ioType);
    }
    if (numTokens < 0 || numSeqs < 0 || numSlots < 0)
    {
        return fail(cudaErrorInvalidValue,
            "engram_causal_conv1d: need num_tokens, num_seqs and num_slots >= 0 (got %lld, %lld, %lld)", ll(numTokens),
            ll(numSeqs), ll(numSlots));
    }
    if (numTokens == 0)
    {
        return 0;
    }
    if (numTokens > INT32_MAX || numSeqs > INT32_MAX / channels * kConvHistoryThreads)
    {
        return fail(cudaErrorInvalidValue,
            "engram_causal_conv1d: grid too large (%lld tokens, %lld sequences x %lld channels)", ll(numTokens),
            ll(numSeqs), ll(channels));
    }
    if (x == nullptr || weight == nullptr || out == nullptr || seqStarts == nullptr || pastLens == nullptr
        || seqSlots == nullptr)
    {
        return fail(cudaErrorInvalidValue,
            "engram_causal_conv1d: x, weight, out, seq_starts, past_lens and seq_slots must not be NULL");
    }
    if (kernel > 1 && numSlots > 0 && convState == nullptr)
    {
        return fail(
            cudaErrorInvalidValue, "engram_causal_conv1d: conv_state is NULL but num_slots is %lld", ll(numSlots));
    }
    int64_t const ioBytes = ioBytesOf(ioType);
    int64_t const xBytes = numTokens * channels * ioBytes;
    int64_t const stateBytes = numSlots * channels * (kernel - 1) * ioBytes;
    if (overlaps(out, xBytes, x, xBytes) || overlaps(out, xBytes, convState, stateBytes))
    {
        return fail(cudaErrorInvalidValue, "engram_causal_conv1d: out must not overlap x or conv_state");
    }
    CausalConvLaunch launch{};
    launch.x = x;
    launch.weight = weight;
    launch.history = convState;
    launch.numSlots = convState == nullptr || kernel == 1 ? 0 : numSlots;
    launch.seqStarts = seqStarts;
    launch.pastLens = pastLens;
    launch.seqSlots = seqSlots;
    launch.numSeqs = numSeqs;
    launch.numTokens = numTokens;
    launch.channels = channels;
    launch.kernel = kernel;
    launch.activation = activation;
    launch.out = out;
    launch.stream = stream;
    switch (ioType)
    {
    case ENGRAM_FLOAT_BF16: return launchCausalConvFor<__nv_bfloat16>(weightType, launch);
    case ENGRAM_FLOAT_F16: return launchCausalConvFor<__half>(weightType, launch);
    default: return launchCausalConv<float, float>(launch);
    }
}

extern "C" ENGRAM_API int engram_gated_delta_net_check_shape(
    int32_t numKHeads, int32_t numVHeads, int32_t headKDim, int32_t headVDim, int32_t l2normQk, float scale)
{
    clearError();
    if (numKHeads < 1 || numVHeads < 1 || numVHeads % numKHeads != 0)
    {
        return fail(cudaErrorInvalidValue,
            "engram_gated_delta_net: need num_k_heads >= 1 and num_v_heads a multiple of it (got %d, %d)", numKHeads,
            numVHeads);
    }
    if (headKDim < 1 || headKDim > ENGRAM_GATED_DELTA_MAX_HEAD_DIM || headVDim < 1
        || headVDim > ENGRAM_GATED_DELTA_MAX_HEAD_DIM)
    {
        return fail(cudaErrorInvalidValue,
            "engram_gated_delta_net: head_k_dim and head_v_dim must be in [1, %d] (got %d, %d)",
            ENGRAM_GATED_DELTA_MAX_HEAD_DIM, headKDim, headVDim);
    }
    if (l2normQk != 0 && l2normQk != 1)
    {
        return fail(cudaErrorInvalidValue, "engram_gated_delta_net: l2norm_qk must be 0 or 1 (got %d)", l2normQk);
    }
    if (!std::isfinite(scale))
    {
        return fail(cudaErrorInvalidValue, "engram_gated_delta_net: scale must be finite");
    }
    return 0;
}

extern "C" ENGRAM_API int engram_gated_delta_net(void const* q, void const* k, void const* v, int32_t ioType,
    float const* g, float const* beta, float* state, int64_t numSlots, int32_t const* seqStarts,
    int32_t const* pastLens, int32_t const* seqSlots, int64_t numSeqs, int64_t numTokens, int32_t numKHeads,
    int32_t numVHeads, int32_t headKDim, int32_t headVDim, int32_t l2normQk, float scale, void* out,
    cudaStream_t stream)
{
    int status = engram_gated_delta_net_check_shape(numKHeads, numVHeads, headKDim, headVDim, l2normQk, scale);
    if (status != 0)
    {
        return status;
    }
    if (!isFloatType(ioType))
    {
        return fail(
            cudaErrorInvalidValue, "engram_gated_delta_net: io_type %d is not bf16 (0), fp32 (1) or fp16 (2)", ioType);
    }
    if (numTokens < 0 || numSeqs < 0 || numSlots < 0)
    {
        return fail(cudaErrorInvalidValue,
            "engram_gated_delta_net: need num_tokens, num_seqs and num_slots >= 0 (got %lld, %lld, %lld)",
            ll(numTokens), ll(numSeqs), ll(numSlots));
    }
    if (numTokens == 0)
    {
        return 0;
    }
    int64_t const tiles = deltaTiles(headVDim);
    if (numTokens > INT32_MAX || numSeqs > INT32_MAX / (numVHeads * tiles))
    {
        return fail(cudaErrorInvalidValue,
            "engram_gated_delta_net: grid too large (%lld tokens, %lld sequences x %d value heads)", ll(numTokens),
            ll(numSeqs), numVHeads);
    }
    if (q == nullptr || k == nullptr || v == nullptr || g == nullptr || beta == nullptr || out == nullptr
        || seqStarts == nullptr || pastLens == nullptr || seqSlots == nullptr)
    {
        return fail(cudaErrorInvalidValue,
            "engram_gated_delta_net: q, k, v, g, beta, out, seq_starts, past_lens and seq_slots must not be NULL");
    }
    if (numSlots > 0 && state == nullptr)
    {
        return fail(cudaErrorInvalidValue, "engram_gated_delta_net: state is NULL but num_slots is %lld", ll(numSlots));
    }
    int64_t const outBytes = numTokens * numVHeads * headVDim * ioBytesOf(ioType);
    int64_t const qkBytes = numTokens * numKHeads * headKDim * ioBytesOf(ioType);
    int64_t const stateBytes = numSlots * numVHeads * static_cast<int64_t>(headKDim) * headVDim * 4;
    if (overlaps(out, outBytes, q, qkBytes) || overlaps(out, outBytes, k, qkBytes)
        || overlaps(out, outBytes, v, outBytes) || overlaps(out, outBytes, state, stateBytes))
    {
        return fail(cudaErrorInvalidValue, "engram_gated_delta_net: out must not overlap q, k, v or state");
    }
    GatedDeltaLaunch launch{};
    launch.q = q;
    launch.k = k;
    launch.v = v;
    launch.g = g;
    launch.beta = beta;
    launch.state = state;
    launch.numSlots = state == nullptr ? 0 : numSlots;
    launch.seqStarts = seqStarts;
    launch.pastLens = pastLens;
    launch.seqSlots = seqSlots;
    launch.numSeqs = numSeqs;
    launch.numTokens = numTokens;
    launch.numKHeads = numKHeads;
    launch.numVHeads = numVHeads;
    launch.dk = headKDim;
    launch.dv = headVDim;
    launch.l2norm = l2normQk;
    launch.scale = scale;
    launch.out = out;
    launch.stream = stream;
    switch (ioType)
    {
    case ENGRAM_FLOAT_BF16: return launchGatedDelta<__nv_bfloat16>(launch);
    case ENGRAM_FLOAT_F16: return launchGatedDelta<__half>(launch);
    default: return launchGatedDelta<float>(launch);
    }
}
