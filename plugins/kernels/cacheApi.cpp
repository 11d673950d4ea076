// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * The hot-row cache's C ABI entry points (engramKernels.h): argument checks, in the
 * style of kernelApi.cpp, then the launches of cacheKernel.cu. Every bound that makes
 * the kernels' codes unambiguous (slots below the hit flag, miss indices and work-table
 * rows in int32) and every precondition the admission's race freedom rests on (distinct
 * candidates, disjoint victim windows, a full cache before replacements) is checked
 * here, on the host, before anything is enqueued.
 */
#include "cacheInternal.h"
#include "cacheKernels.h"
#include "engramKernelsInternal.h"

#include <algorithm>
#include <climits>
#include <cstdint>

using namespace engram_trt::kernels;

namespace
{

int cachePlan(int32_t const* ids, int64_t numIds, int64_t tableNumRows, int32_t* slotOf, int32_t* counts,
    int64_t missBase, int32_t* plan, int32_t* positions, int32_t* planHost, int64_t planHostIds, cudaStream_t stream)
{
    char const* fn = "engram_cache_plan";
    if (numIds < 0 || numIds > kCacheMaxStepIds)
    {
        return fail(cudaErrorInvalidValue, "%s: num_ids must be in [0, 2^30] (got %lld)", fn, ll(numIds));
    }
    if (tableNumRows < 1 || tableNumRows >= INT32_MAX)
    {
        return fail(cudaErrorInvalidValue,
            "%s: table_num_rows must be in [1, 2^31 - 2] (its sentinel row must be an int32; got %lld)", fn,
            ll(tableNumRows));
    }
    if (missBase < 0 || missBase >= kCacheMaxSlots || missBase + numIds > INT32_MAX)
    {
        return fail(cudaErrorInvalidValue,
            "%s: miss_base must be in [0, 2^30) and miss_base + num_ids <= 2^31 - 1 (got %lld, %lld)", fn, ll(missBase),
            ll(numIds));
    }
    if (plan == nullptr || !isAligned(plan, 4))
    {
        return fail(cudaErrorInvalidValue, "%s: plan must be a 4-byte aligned device pointer", fn);
    }
    if (planHost != nullptr && (planHostIds < 0 || !isAligned(planHost, 4)))
    {
        return fail(cudaErrorInvalidValue, "%s: plan_host must be 4-byte aligned and plan_host_ids >= 0 (got %lld)", fn,
            ll(planHostIds));
    }
    if (numIds > 0)
    {
        if (ids == nullptr || slotOf == nullptr || positions == nullptr || !isAligned(ids, 4) || !isAligned(slotOf, 4)
            || !isAligned(positions, 4) || (counts != nullptr && !isAligned(counts, 4)))
        {
            return fail(cudaErrorInvalidValue,
                "%s: ids, slot_of and positions (and counts, if given) must be 4-byte aligned device pointers", fn);
        }
    }
    cudaError_t status = cudaMemsetAsync(plan, 0, 2 * sizeof(int32_t), stream);
    if (status != cudaSuccess)
    {
        return failCuda(status, "%s: cudaMemsetAsync of the plan's counters failed (%s:%d): %s", fn,
            sourceFileName(__FILE__), __LINE__, cudaGetErrorString(status));
    }
    if (numIds > 0)
    {
        if (int const launched = launchCachePlan(ids, numIds, static_cast<int32_t>(tableNumRows), slotOf, counts,
                static_cast<int32_t>(missBase), plan, positions, stream))
        {
            return launched;
        }
    }
    if (planHost != nullptr)
    {
        int64_t const copied = 2 + (planHostIds < numIds ? planHostIds : numIds);
        status = cudaMemcpyAsync(planHost, plan, copied * sizeof(int32_t), cudaMemcpyDeviceToHost, stream);
        if (status != cudaSuccess)
        {
            return failCuda(status, "%s: cudaMemcpyAsync of the plan to the host failed (%s:%d): %s", fn,
                sourceFileName(__FILE__), __LINE__, cudaGetErrorString(status));
        }
    }
    return 0;
}

int cacheAdmit(CacheAdmitParams const& p, cudaStream_t stream)
{
    char const* fn = "engram_cache_admit";
    if (p.capacity < 0 || p.capacity >= kCacheMaxSlots || p.filled < 0 || p.numFree < 0 || p.numMiss < p.numFree
        || p.filled + p.numFree > p.capacity)
    {
        return fail(cudaErrorInvalidValue,
            "%s: need 0 <= capacity < 2^30, 0 <= num_free <= num_miss and filled + num_free <= capacity (got capacity "
            "%lld, filled %lld, num_free %lld, num_miss %lld)",
            fn, ll(p.capacity), ll(p.filled), ll(p.numFree), ll(p.numMiss));
    }
    if (p.numMiss > kCacheMaxStepIds || p.missBase < p.capacity || p.missBase + p.numMiss > INT32_MAX)
    {
        return fail(cudaErrorInvalidValue,
            "%s: need num_miss <= 2^30 and capacity <= miss_base <= 2^31 - 1 - num_miss (got num_miss %lld, miss_base "
            "%lld, capacity %lld)",
            fn, ll(p.numMiss), ll(p.missBase), ll(p.capacity));
    }
    if (p.numMiss > 0 && (p.missRows == nullptr || p.slotOf == nullptr || !isAligned(p.missRows, 4)))
    {
        return fail(cudaErrorInvalidValue, "%s: miss_rows and slot_of must be 4-byte aligned device pointers", fn);
    }
    if (p.numFree > 0 && p.rowOfSlot == nullptr)
    {
        return fail(cudaErrorInvalidValue, "%s: free slots need row_of_slot", fn);
    }
    if (p.numCandidates < 0)
    {
        return fail(cudaErrorInvalidValue, "%s: num_candidates must be >= 0 (got %lld)", fn, ll(p.numCandidates));
    }
    if (p.numCandidates > 0)
    {
        int64_t const left = p.numMiss - p.numFree;
        if (p.filled + p.numFree != p.capacity)
        {
            return fail(cudaErrorInvalidValue,
                "%s: replacements need a full cache (filled %lld + num_free %lld != capacity %lld)", fn, ll(p.filled),
                ll(p.numFree), ll(p.capacity));
        }
        if (p.candidateStride < 1 || p.candidateStart < 0 || p.candidateStart >= left
            || p.numCandidates > left / p.candidateStride)
        {
            return fail(cudaErrorInvalidValue,
                "%s: candidates must be distinct misses: need candidate_stride >= 1, 0 <= candidate_start < num_miss - "
                "num_free and num_candidates * candidate_stride <= num_miss - num_free (got %lld, %lld, %lld, %lld)",
                fn, ll(p.candidateStride), ll(p.candidateStart), ll(p.numCandidates), ll(left));
        }
        if (p.sampleFactor < 1 || p.numCandidates > p.capacity / p.sampleFactor || p.sampleFirst < 0
            || p.sampleFirst >= p.capacity)
        {
            return fail(cudaErrorInvalidValue,
                "%s: victim windows must be disjoint slots: need sample_factor >= 1, num_candidates * sample_factor <= "
                "capacity and 0 <= sample_first < capacity (got %d, %lld, %lld, %lld)",
                fn, p.sampleFactor, ll(p.numCandidates), ll(p.capacity), ll(p.sampleFirst));
        }
        if (p.counts == nullptr || p.rowOfSlot == nullptr || !isAligned(p.counts, 4) || !isAligned(p.rowOfSlot, 4))
        {
            return fail(cudaErrorInvalidValue, "%s: replacements need counts and row_of_slot (4-byte aligned)", fn);
        }
    }
    if (p.workRows != nullptr)
    {
        if (p.rowBytes < 16 || p.rowBytes % 16 != 0 || !isAligned(p.workRows, 16) || p.scaleBytes < 0
            || (p.scaleBytes > 0) != (p.workScales != nullptr))
        {
            return fail(cudaErrorInvalidValue,
                "%s: work_rows must be 16-byte aligned with row_bytes a positive multiple of 16, and work_scales given "
                "exactly when scale_bytes > 0 (got row_bytes %lld, scale_bytes %lld)",
                fn, ll(p.rowBytes), ll(p.scaleBytes));
        }
    }
    if (p.replaced != nullptr && !isAligned(p.replaced, 8))
    {
        return fail(cudaErrorInvalidValue, "%s: replaced must be an 8-byte aligned device pointer", fn);
    }
    return launchCacheAdmit(p, stream);
}

//! Draw k of a step: splitmix64's output function over a counter (engramKernels.h).
uint64_t admissionDraw(uint64_t seed, int64_t step, int k)
{
    uint64_t z = seed + (2 * static_cast<uint64_t>(step) + static_cast<uint64_t>(k)) * 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

int cacheAdmission(int64_t numMiss, int64_t filled, int64_t capacity, int64_t admitBudget, int32_t sampleFactor,
    int32_t replace, uint64_t seed, int64_t step, EngramCacheAdmission* a)
{
    char const* fn = "engram_cache_admission";
    if (a == nullptr)
    {
        return fail(cudaErrorInvalidValue, "%s: admission is NULL", fn);
    }
    if (numMiss < 0 || capacity < 0 || filled < 0 || filled > capacity || admitBudget < 0 || sampleFactor < 1)
    {
        return fail(cudaErrorInvalidValue,
            "%s: need num_miss >= 0, 0 <= filled <= capacity, admit_budget >= 0 and sample_factor >= 1 (got %lld, "
            "%lld, %lld, %lld, %d)",
            fn, ll(numMiss), ll(filled), ll(capacity), ll(admitBudget), sampleFactor);
    }
    *a = EngramCacheAdmission{};
    a->candidate_stride = 1;
    a->sample_factor = 1;
    if (capacity == 0 || numMiss == 0)
    {
        return 0;
    }
    int64_t const numFree = std::min(numMiss, capacity - filled);
    a->num_free = numFree;
    int64_t const left = numMiss - numFree;
    int64_t const budget = std::min(std::min(admitBudget, left), capacity);
    if (replace == 0 || budget <= 0 || filled + numFree < capacity)
    {
        return 0;
    }
    a->num_candidates = budget;
    a->candidate_start = static_cast<int64_t>(admissionDraw(seed, step, 0) % static_cast<uint64_t>(left));
    a->candidate_stride = left / budget;
    a->sample_factor = static_cast<int32_t>(std::max<int64_t>(1, std::min<int64_t>(sampleFactor, capacity / budget)));
    a->sample_first = static_cast<int64_t>(admissionDraw(seed, step, 1) % static_cast<uint64_t>(capacity));
    return 0;
}

} // namespace

extern "C" ENGRAM_API int engram_cache_admission(int64_t numMiss, int64_t filled, int64_t capacity, int64_t admitBudget,
    int32_t sampleFactor, int32_t replace, uint64_t seed, int64_t step, EngramCacheAdmission* admission)
{
    clearError();
    ENGRAM_ABI_TRY
    {
        return cacheAdmission(numMiss, filled, capacity, admitBudget, sampleFactor, replace, seed, step, admission);
    }
    ENGRAM_ABI_CATCH("engram_cache_admission")
}

extern "C" ENGRAM_API int engram_cache_plan(int32_t const* ids, int64_t numIds, int64_t tableNumRows, int32_t* slotOf,
    int32_t* counts, int64_t missBase, int32_t* plan, int32_t* positions, int32_t* planHost, int64_t planHostIds,
    cudaStream_t stream)
{
    clearError();
    ENGRAM_ABI_TRY
    {
        return cachePlan(
            ids, numIds, tableNumRows, slotOf, counts, missBase, plan, positions, planHost, planHostIds, stream);
    }
    ENGRAM_ABI_CATCH("engram_cache_plan")
}

extern "C" ENGRAM_API int engram_cache_admit(int32_t const* missRows, int64_t numMiss, int64_t numFree, int64_t filled,
    int64_t capacity, int32_t* slotOf, int32_t* rowOfSlot, int32_t const* counts, int64_t numCandidates,
    int64_t candidateStart, int64_t candidateStride, int64_t sampleFirst, int32_t sampleFactor, int64_t missBase,
    void* workRows, int64_t rowBytes, void* workScales, int64_t scaleBytes, int64_t* replaced, cudaStream_t stream)
{
    clearError();
    ENGRAM_ABI_TRY
    {
        CacheAdmitParams p{};
        p.missRows = missRows;
        p.numMiss = numMiss;
        p.numFree = numFree;
        p.filled = filled;
        p.capacity = capacity;
        p.slotOf = slotOf;
        p.rowOfSlot = rowOfSlot;
        p.counts = counts;
        p.numCandidates = numCandidates;
        p.candidateStart = candidateStart;
        p.candidateStride = candidateStride;
        p.sampleFirst = sampleFirst;
        p.sampleFactor = sampleFactor;
        p.missBase = missBase;
        p.workRows = static_cast<uint8_t*>(workRows);
        p.rowBytes = rowBytes;
        p.workScales = static_cast<uint8_t*>(workScales);
        p.scaleBytes = scaleBytes;
        p.replaced = reinterpret_cast<unsigned long long*>(replaced);
        return cacheAdmit(p, stream);
    }
    ENGRAM_ABI_CATCH("engram_cache_admit")
}
