// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * What the hot-row cache's entry points (cacheApi.cpp: argument checks) and its kernels
 * (cacheKernel.cu) share: the slot map's codes and the launch functions. Not part of the
 * ABI.
 */
#ifndef ENGRAM_TRT_CACHE_INTERNAL_H
#define ENGRAM_TRT_CACHE_INTERNAL_H

#include "cacheKernels.h"

#include <cstdint>
#include <cuda_runtime_api.h>

namespace engram_trt
{
namespace kernels
{

//! Slot map codes (engramKernels.h, "Hot-row cache"): >= 0 a cache slot, kCacheNoSlot
//! not cached; within a step also a slot with kCacheHitFlag (first lookup seen),
//! kCachePending (a miss being listed) and kCacheMissCode - j (miss j of the step).
constexpr int32_t kCacheNoSlot = -1;
constexpr int32_t kCacheMissCode = -2;
constexpr int32_t kCachePending = INT32_MIN;
constexpr int32_t kCacheHitFlag = 1 << 30;
constexpr int64_t kCacheMaxSlots = int64_t{1} << 30; // slots (and the miss base) below the hit flag
constexpr int64_t kCacheMaxStepIds = int64_t{1} << 30;

//! Enqueues the plan's two kernels (arguments checked by the caller; numIds > 0).
int launchCachePlan(int32_t const* ids, int64_t numIds, int32_t tableNumRows, int32_t* slotOf, int32_t* counts,
    int32_t missBase, int32_t* plan, int32_t* positions, cudaStream_t stream);

//! What one admission does (engram_cache_admit's arguments, checked by the caller).
struct CacheAdmitParams
{
    int32_t const* missRows;
    int64_t numMiss;
    int64_t numFree;
    int64_t filled;
    int64_t capacity;
    int32_t* slotOf;
    int32_t* rowOfSlot;
    int32_t const* counts;
    int64_t numCandidates;
    int64_t candidateStart;
    int64_t candidateStride;
    int64_t sampleFirst;
    int32_t sampleFactor;
    int64_t missBase;
    uint8_t* workRows; // nullptr: no row copies
    int64_t rowBytes;
    uint8_t* workScales; // nullptr: no scale bytes
    int64_t scaleBytes;
    unsigned long long* replaced; // nullptr: not counted
};

//! Enqueues the admission: the map updates of every miss, the free-slot copies and the
//! replacement kernel.
int launchCacheAdmit(CacheAdmitParams const& p, cudaStream_t stream);

} // namespace kernels
} // namespace engram_trt

#endif // ENGRAM_TRT_CACHE_INTERNAL_H
