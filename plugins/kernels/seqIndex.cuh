// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * Which sequence of a packed step a token belongs to: the one binary search over
 * seq_starts (cu_seqlens) that every per-token kernel of a packed step makes. One home,
 * so the hash, the PLE hash, the PLE fusion and the linear-attention kernels cannot
 * disagree on the edge cases (empty sequences, tokens outside every sequence).
 */
#ifndef ENGRAM_TRT_SEQ_INDEX_CUH
#define ENGRAM_TRT_SEQ_INDEX_CUH

#include <cstdint>

namespace engram_trt
{
namespace kernels
{

//! The sequence holding token t (seqStarts[s] <= t < seqStarts[s + 1]; the last such s,
//! so empty sequences, equal starts, are skipped), or -1 for a token outside every
//! sequence (t < seqStarts[0], t >= seqStarts[numSeqs], or numSeqs <= 0).
__device__ __forceinline__ int64_t sequenceOf(int32_t const* seqStarts, int64_t numSeqs, int64_t t)
{
    if (numSeqs <= 0 || t < seqStarts[0] || t >= seqStarts[numSeqs])
    {
        return -1;
    }
    int64_t lo = 0;
    int64_t hi = numSeqs; // seqStarts[lo] <= t < seqStarts[hi]
    while (hi - lo > 1)
    {
        int64_t const mid = (lo + hi) / 2;
        if (seqStarts[mid] <= t)
        {
            lo = mid;
        }
        else
        {
            hi = mid;
        }
    }
    return lo;
}

} // namespace kernels
} // namespace engram_trt

#endif // ENGRAM_TRT_SEQ_INDEX_CUH
