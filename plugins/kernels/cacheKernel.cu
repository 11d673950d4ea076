// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * The hot-row cache's step on the GPU: the plan (de-duplication, lookup counts, slot
 * resolution, miss list, every lookup's work-table row) and the admission.
 *
 * Plan, two kernels over the step's lookups, one thread each:
 *   mark     row = id, or the sentinel row for an id outside the table; counts[row] += 1;
 *            the first lookup of a row this step claims it in the slot map itself: a
 *            cached row's slot gets kCacheHitFlag (atomicOr), an uncached row goes from
 *            kCacheNoSlot to kCachePending (atomicCAS), so exactly one lookup per distinct
 *            row wins. The winners of uncached rows take miss indices (one atomicAdd per
 *            block: ballots, then a block prefix of the warps' counts), write their row
 *            to the miss list and leave kCacheMissCode - index in the slot map.
 *   resolve  every lookup reads its row's entry: a slot (the hit flag cleared in place)
 *            or a miss code, i.e. work-table row missBase + index.
 * The marks live in the slot map, so the plan needs no stamp array (4 bytes per table
 * row) and nothing is cleared per step: resolve clears the hit flags as it reads them,
 * and the admission rewrites every miss's entry. Entries only move forward within mark
 * (-1 -> pending -> code, slot -> slot | flag), so a stale plain load only sends a thread
 * to the atomic that tells it it lost.
 *
 * Admission (after the step's rows were delivered): misses [0, numFree) take the free
 * slots filled.. in miss-list order, the others get kCacheNoSlot back; the free slots'
 * rows are one contiguous device-to-device copy from the miss area; then one warp per
 * replacement candidate: the coldest of its window of sampleFactor slots (ties: the
 * first), replaced if the candidate's count is strictly higher. Windows are disjoint and
 * candidates distinct (the caller's arguments guarantee it), so no two warps touch one
 * entry and the result does not depend on their order.
 */
#include "cacheInternal.h"
#include "cacheKernels.h"
#include "engramKernelsInternal.h"

#include <cstdint>

namespace engram_trt
{
namespace kernels
{

namespace
{

constexpr int kPlanThreads = 256;
constexpr int kPlanWarps = kPlanThreads / 32;
constexpr int kReplaceThreads = 256; // 8 candidates (warps) per block

__device__ __forceinline__ int32_t tableRow(int32_t id, int32_t tableNumRows)
{
    return (id >= 0 && id < tableNumRows) ? id : tableNumRows;
}

__global__ void __launch_bounds__(kPlanThreads) cachePlanMarkKernel(int32_t const* __restrict__ ids, int64_t numIds,
    int32_t tableNumRows, int32_t* slotOf, int32_t* counts, int32_t* plan)
{
    __shared__ int32_t warpMisses[kPlanWarps];
    __shared__ int32_t warpHits[kPlanWarps];
    __shared__ int32_t blockMissBase;
    int64_t const i = static_cast<int64_t>(blockIdx.x) * kPlanThreads + threadIdx.x;
    int32_t row = 0;
    bool ownMiss = false;
    bool ownHit = false;
    if (i < numIds)
    {
        row = tableRow(ids[i], tableNumRows);
        if (counts != nullptr)
        {
            atomicAdd(&counts[row], 1);
        }
        int32_t const v = slotOf[row];
        if (v == kCacheNoSlot)
        {
            ownMiss = atomicCAS(&slotOf[row], kCacheNoSlot, kCachePending) == kCacheNoSlot;
        }
        else if (v >= 0 && (v & kCacheHitFlag) == 0)
        {
            ownHit = (atomicOr(&slotOf[row], kCacheHitFlag) & kCacheHitFlag) == 0;
        }
    }
    unsigned const missBallot = __ballot_sync(0xffffffffu, ownMiss);
    unsigned const hitBallot = __ballot_sync(0xffffffffu, ownHit);
    int const lane = threadIdx.x & 31;
    int const warp = threadIdx.x >> 5;
    if (lane == 0)
    {
        warpMisses[warp] = __popc(missBallot);
        warpHits[warp] = __popc(hitBallot);
    }
    __syncthreads();
    if (threadIdx.x == 0)
    {
        int32_t misses = 0;
        int32_t hits = 0;
        for (int w = 0; w < kPlanWarps; ++w)
        {
            int32_t const c = warpMisses[w];
            warpMisses[w] = misses; // exclusive prefix: the warp's first index in the block
            misses += c;
            hits += warpHits[w];
        }
        blockMissBase = misses > 0 ? atomicAdd(&plan[1], misses) : 0;
        if (hits > 0)
        {
            atomicAdd(&plan[0], hits);
        }
    }
    __syncthreads();
    if (ownMiss)
    {
        int32_t const index = blockMissBase + warpMisses[warp] + __popc(missBallot & ((1u << lane) - 1u));
        plan[2 + index] = row;
        slotOf[row] = kCacheMissCode - index;
    }
}

__global__ void __launch_bounds__(kPlanThreads) cachePlanResolveKernel(int32_t const* __restrict__ ids, int64_t numIds,
    int32_t tableNumRows, int32_t* slotOf, int32_t missBase, int32_t* __restrict__ positions)
{
    int64_t const i = static_cast<int64_t>(blockIdx.x) * kPlanThreads + threadIdx.x;
    if (i >= numIds)
    {
        return;
    }
    int32_t const row = tableRow(ids[i], tableNumRows);
    int32_t const v = slotOf[row];
    if (v >= 0)
    {
        int32_t const slot = v & ~kCacheHitFlag;
        if (v != slot)
        {
            slotOf[row] = slot; // every lookup of the row resolves to `slot`, flag or not
        }
        positions[i] = slot;
    }
    else
    {
        positions[i] = missBase + (kCacheMissCode - v);
    }
}

__global__ void __launch_bounds__(kPlanThreads) cacheAdmitMissesKernel(int32_t const* __restrict__ missRows,
    int64_t numMiss, int64_t numFree, int64_t filled, int32_t* slotOf, int32_t* rowOfSlot)
{
    int64_t const j = static_cast<int64_t>(blockIdx.x) * kPlanThreads + threadIdx.x;
    if (j >= numMiss)
    {
        return;
    }
    int32_t const row = missRows[j];
    if (j < numFree)
    {
        int32_t const slot = static_cast<int32_t>(filled + j);
        slotOf[row] = slot;
        rowOfSlot[slot] = row;
    }
    else
    {
        slotOf[row] = kCacheNoSlot;
    }
}

__global__ void __launch_bounds__(kReplaceThreads) cacheReplaceKernel(CacheAdmitParams p)
{
    int64_t const c = (static_cast<int64_t>(blockIdx.x) * kReplaceThreads + threadIdx.x) >> 5;
    int const lane = threadIdx.x & 31;
    if (c >= p.numCandidates)
    {
        return; // whole warps: numCandidates is a warp count
    }
    int32_t replace = 0;
    int64_t pick = 0;
    int64_t victim = 0;
    if (lane == 0)
    {
        int64_t const left = p.numMiss - p.numFree;
        pick = p.numFree + (p.candidateStart + c * p.candidateStride) % left;
        int32_t const candidate = p.missRows[pick];
        int32_t best = 0;
        for (int32_t k = 0; k < p.sampleFactor; ++k)
        {
            int64_t const slot = (p.sampleFirst + c * p.sampleFactor + k) % p.capacity;
            int32_t const count = p.counts[p.rowOfSlot[slot]];
            if (k == 0 || count < best)
            {
                best = count;
                victim = slot;
            }
        }
        if (p.counts[candidate] > best)
        {
            replace = 1;
            int32_t const old = p.rowOfSlot[victim];
            p.slotOf[old] = kCacheNoSlot;
            p.slotOf[candidate] = static_cast<int32_t>(victim);
            p.rowOfSlot[victim] = candidate;
            if (p.replaced != nullptr)
            {
                atomicAdd(p.replaced, 1ull);
            }
        }
    }
    replace = __shfl_sync(0xffffffffu, replace, 0);
    if (!replace || p.workRows == nullptr)
    {
        return;
    }
    pick = __shfl_sync(0xffffffffu, pick, 0);
    victim = __shfl_sync(0xffffffffu, victim, 0);
    uint4 const* src = reinterpret_cast<uint4 const*>(p.workRows + (p.missBase + pick) * p.rowBytes);
    uint4* dst = reinterpret_cast<uint4*>(p.workRows + victim * p.rowBytes);
    for (int64_t v = lane; v < p.rowBytes / 16; v += 32)
    {
        dst[v] = src[v];
    }
    if (p.workScales != nullptr)
    {
        uint8_t const* srcScales = p.workScales + (p.missBase + pick) * p.scaleBytes;
        uint8_t* dstScales = p.workScales + victim * p.scaleBytes;
        for (int64_t b = lane; b < p.scaleBytes; b += 32)
        {
            dstScales[b] = srcScales[b];
        }
    }
}

unsigned blocksFor(int64_t threads, int blockThreads)
{
    return static_cast<unsigned>((threads + blockThreads - 1) / blockThreads);
}

} // namespace

int launchCachePlan(int32_t const* ids, int64_t numIds, int32_t tableNumRows, int32_t* slotOf, int32_t* counts,
    int32_t missBase, int32_t* plan, int32_t* positions, cudaStream_t stream)
{
    unsigned const blocks = blocksFor(numIds, kPlanThreads);
    resetLaunchError();
    cachePlanMarkKernel<<<blocks, kPlanThreads, 0, stream>>>(ids, numIds, tableNumRows, slotOf, counts, plan);
    if (int const status = checkLaunch("engram_cache_plan (mark)"))
    {
        return status;
    }
    resetLaunchError();
    cachePlanResolveKernel<<<blocks, kPlanThreads, 0, stream>>>(ids, numIds, tableNumRows, slotOf, missBase, positions);
    return checkLaunch("engram_cache_plan (resolve)");
}

int launchCacheAdmit(CacheAdmitParams const& p, cudaStream_t stream)
{
    if (p.numMiss > 0)
    {
        resetLaunchError();
        cacheAdmitMissesKernel<<<blocksFor(p.numMiss, kPlanThreads), kPlanThreads, 0, stream>>>(
            p.missRows, p.numMiss, p.numFree, p.filled, p.slotOf, p.rowOfSlot);
        if (int const status = checkLaunch("engram_cache_admit (misses)"))
        {
            return status;
        }
    }
    if (p.numFree > 0 && p.workRows != nullptr)
    {
        cudaError_t status = cudaMemcpyAsync(p.workRows + p.filled * p.rowBytes, p.workRows + p.missBase * p.rowBytes,
            p.numFree * p.rowBytes, cudaMemcpyDeviceToDevice, stream);
        if (status == cudaSuccess && p.workScales != nullptr)
        {
            status = cudaMemcpyAsync(p.workScales + p.filled * p.scaleBytes, p.workScales + p.missBase * p.scaleBytes,
                p.numFree * p.scaleBytes, cudaMemcpyDeviceToDevice, stream);
        }
        if (status != cudaSuccess)
        {
            return failCuda(status, "engram_cache_admit: cudaMemcpyAsync of the free slots' rows failed (%s:%d): %s",
                sourceFileName(__FILE__), __LINE__, cudaGetErrorString(status));
        }
    }
    if (p.numCandidates > 0)
    {
        resetLaunchError();
        cacheReplaceKernel<<<blocksFor(p.numCandidates * 32, kReplaceThreads), kReplaceThreads, 0, stream>>>(p);
        return checkLaunch("engram_cache_admit (replace)");
    }
    return 0;
}

} // namespace kernels
} // namespace engram_trt
