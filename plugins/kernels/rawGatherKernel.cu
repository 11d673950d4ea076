// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * Raw row gather on the GPU (engram_gather_raw): dst[i] = table[ids[i]], row bytes as
 * stored (fp8 values or bf16), no dequant; the scale bytes beside them with
 * launchGatherScaleBytes. The table may sit in device memory or in pinned / registered
 * host memory read through UVA.
 *
 * Why: the hot-row cache keeps a step's misses raw in its work table (the admission
 * copies them into slots device to device). The host gather fetches them with the CPU
 * threads, bound by their random reads; the GPU's own reads of host memory are bound by
 * another limit (the host's address translations, ~5 GB/s on the H200 VM whatever the
 * page size), so a share of the misses read here, on a few multiprocessors, arrives
 * beside the host gather's instead of after it.
 *
 * Like the gather kernel, every thread owns kUnroll 16-byte vectors of (possibly
 * different) rows and issues all their loads before storing any: reads of host memory
 * take microseconds, so memory-level parallelism per thread is what sets the rate. An id
 * outside [0, table_num_rows) gives a zero row (the sentinel row of the cache's miss
 * list, as the host gather stages it).
 */
#include "engramKernels.h"
#include "engramKernelsInternal.h"

#include <algorithm>
#include <cstdint>

namespace engram_trt
{
namespace kernels
{
namespace
{

constexpr int kRawThreads = 256;
constexpr int kRawUnroll = 4;

__global__ void __launch_bounds__(kRawThreads) engramGatherRawRowsKernel(int32_t const* __restrict__ ids, int64_t count,
    uint4 const* rows, int64_t tableNumRows, int32_t vectorsPerRow, uint4* __restrict__ dst)
{
    int64_t const total = count * vectorsPerRow;
    int64_t const stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; base < total;
        base += stride * kRawUnroll)
    {
        uint4 data[kRawUnroll];
#pragma unroll
        for (int k = 0; k < kRawUnroll; ++k)
        {
            int64_t const v = base + k * stride;
            data[k] = make_uint4(0, 0, 0, 0);
            if (v < total)
            {
                int64_t const r = v / vectorsPerRow;
                int64_t const id = ids[r];
                if (static_cast<uint64_t>(id) < static_cast<uint64_t>(tableNumRows))
                {
                    data[k] = rows[id * vectorsPerRow + (v - r * vectorsPerRow)];
                }
            }
        }
#pragma unroll
        for (int k = 0; k < kRawUnroll; ++k)
        {
            int64_t const v = base + k * stride;
            if (v < total)
            {
                dst[v] = data[k];
            }
        }
    }
}

} // namespace

int launchGatherRawRows(int32_t const* ids, int64_t count, void const* rows, int64_t tableNumRows, int64_t rowBytes,
    void* dst, int32_t maxBlocks, cudaStream_t stream)
{
    if (count <= 0)
    {
        return 0;
    }
    int32_t const vpr = static_cast<int32_t>(rowBytes / 16);
    int64_t const total = count * vpr;
    int64_t const wanted = (total + kRawThreads * kRawUnroll - 1) / (kRawThreads * kRawUnroll);
    int64_t const wave = static_cast<int64_t>(std::max(1, smCount())) * 8;
    int64_t const cap = maxBlocks > 0 ? std::min<int64_t>(wave, maxBlocks) : wave;
    resetLaunchError();
    engramGatherRawRowsKernel<<<static_cast<unsigned>(std::min(wanted, cap)), kRawThreads, 0, stream>>>(
        ids, count, static_cast<uint4 const*>(rows), tableNumRows, vpr, static_cast<uint4*>(dst));
    return checkLaunch("engram_gather_raw");
}

} // namespace kernels
} // namespace engram_trt
