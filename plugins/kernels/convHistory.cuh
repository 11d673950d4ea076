// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * The per-slot history of a causal convolution over a packed step: each sequence's row
 * of the history (the last H conv inputs of its slot, oldest first) becomes the last H of
 * [its old row (zeros for a fresh sequence), the sequence's inputs of this step]. Shared
 * by the PLE fusion (its history holds the normalized values) and the Gated DeltaNet's
 * causal conv (the raw q / k / v projections); one home, so both keep the same
 * conventions (a slot outside [0, num_slots) keeps nothing, past_lens <= 0 is fresh).
 */
#ifndef ENGRAM_TRT_CONV_HISTORY_CUH
#define ENGRAM_TRT_CONV_HISTORY_CUH

#include <cstdint>
#include <cstring>

namespace engram_trt
{
namespace kernels
{

constexpr int kConvHistoryThreads = 256;

//! A value of T whose bits are all zero (+0 in every float type).
template <typename T>
__device__ __forceinline__ T zeroBits()
{
    T z;
    memset(&z, 0, sizeof(T));
    return z;
}

/*
 * Thread index = seq * width + ch (kConvHistoryThreads per block). values [T, width],
 * history [numSlots, width, historyLen], in place: ascending, each old value read ahead
 * of the write that would clobber it. Launch it after every kernel reading the history.
 */
template <typename IoT>
__global__ void __launch_bounds__(kConvHistoryThreads) convHistoryKernel(IoT const* __restrict__ values, IoT* history,
    int64_t numSlots, int32_t const* __restrict__ seqStarts, int32_t const* __restrict__ pastLens,
    int32_t const* __restrict__ seqSlots, int64_t numSeqs, int64_t numTokens, int64_t width, int32_t historyLen)
{
    int64_t const index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (index >= numSeqs * width)
    {
        return;
    }
    int64_t const seq = index / width;
    int64_t const ch = index - seq * width;
    int64_t const slot = seqSlots[seq];
    if (slot < 0 || slot >= numSlots)
    {
        return; // a padding sequence keeps no history
    }
    int64_t const start = seqStarts[seq];
    int64_t const n = static_cast<int64_t>(seqStarts[seq + 1]) - start;
    if (n < 0)
    {
        return;
    }
    bool const fresh = pastLens[seq] <= 0;
    IoT* h = history + (slot * width + ch) * historyLen;
    for (int32_t i = 0; i < historyLen; ++i)
    {
        int64_t const src = n + i; // index into [old (H), new (n)]
        IoT value;
        if (src >= historyLen)
        {
            int64_t const token = start + src - historyLen;
            value = token >= 0 && token < numTokens ? values[token * width + ch] : zeroBits<IoT>();
        }
        else
        {
            value = fresh ? zeroBits<IoT>() : h[src]; // src > i: not yet overwritten
        }
        h[i] = value;
    }
}

} // namespace kernels
} // namespace engram_trt

#endif // ENGRAM_TRT_CONV_HISTORY_CUH
