// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * The host gatherer's state (EngramHostGatherer, hostGatherInternal.h): its creation (the
 * staging ring of pinned and device slots with their events, the copy stream, the thread
 * pool), the job buffers' resizing and its teardown. The C entry points (hostGatherApi.cpp)
 * check their arguments and call these; the pipeline (hostGather.cpp) runs on the state.
 * Neither is used from here, so the gatherer's state is the bottom of the runtime's host
 * side: hostGather.cpp and hostGatherApi.cpp depend on it, and the gather driver on them.
 */
#include "hostGatherInternal.h"

#include <memory>

namespace engram_trt
{
namespace kernels
{

int createGatherer(
    int32_t numThreads, int64_t chunkRows, int32_t maxHeadDim, int32_t numSlots, EngramHostGatherer** gatherer)
{
    // Owned here until it is complete: every failure below (an exception too) frees it.
    std::unique_ptr<EngramHostGatherer> g(new EngramHostGatherer());
    cudaError_t status = cudaGetDevice(&g->device);
    if (status != cudaSuccess)
    {
        return failCuda(status, "engram_host_gatherer_create: cudaGetDevice failed: %s", cudaGetErrorString(status));
    }
    g->maxHeadDim = maxHeadDim;
    g->capacityRows = chunkRows;
    g->chunkRows = chunkRows;
    // A bf16 row (2 bytes per element) is the widest form; an fp8 row plus its scale
    // bytes (head_dim + head_dim / 16 at most) fits in it.
    g->slotBytes = chunkRows * 2 * static_cast<int64_t>(maxHeadDim);
    g->numSlots = numSlots;
    g->pinned.assign(static_cast<size_t>(numSlots), nullptr);
    g->deviceStaging.assign(static_cast<size_t>(numSlots), nullptr);
    g->copied.assign(static_cast<size_t>(numSlots), nullptr);
    g->consumed.assign(static_cast<size_t>(numSlots), nullptr);
    status = cudaStreamCreateWithFlags(&g->copyStream, cudaStreamNonBlocking);
    if (status == cudaSuccess)
    {
        status = cudaEventCreateWithFlags(&g->callStart, cudaEventDisableTiming);
    }
    for (int b = 0; b < 2 && status == cudaSuccess; ++b)
    {
        status = cudaEventCreateWithFlags(&g->jobConsumed[b], cudaEventDisableTiming);
    }
    for (int s = 0; s < numSlots && status == cudaSuccess; ++s)
    {
        status = cudaHostAlloc(reinterpret_cast<void**>(&g->pinned[s]), g->slotBytes, cudaHostAllocPortable);
        if (status == cudaSuccess)
        {
            status = cudaMalloc(reinterpret_cast<void**>(&g->deviceStaging[s]), g->slotBytes);
        }
        if (status == cudaSuccess)
        {
            status = cudaEventCreateWithFlags(&g->copied[s], cudaEventDisableTiming);
        }
        if (status == cudaSuccess)
        {
            status = cudaEventCreateWithFlags(&g->consumed[s], cudaEventDisableTiming);
        }
    }
    if (status != cudaSuccess)
    {
        return failCuda(
            status, "engram_host_gatherer_create: staging allocation failed: %s", cudaGetErrorString(status));
    }
    g->pool.reset(new ThreadPool(numThreads)); // throws if a thread cannot start (the entry point catches it)
    *gatherer = g.release();
    return 0;
}

int setJobStaging(EngramHostGatherer& g, int64_t bytes)
{
    DeviceGuard deviceGuard(g.device);
    if (deviceGuard.status() != cudaSuccess)
    {
        return failCuda(deviceGuard.status(),
            "engram_host_gatherer_set_option: cannot make the gatherer's device %d "
            "current: %s",
            g.device, cudaGetErrorString(deviceGuard.status()));
    }
    for (int b = 0; b < 2; ++b)
    {
        cudaError_t const status = cudaEventSynchronize(g.jobConsumed[b]);
        if (status != cudaSuccess)
        {
            return failCuda(status, "engram_host_gatherer_set_option: waiting for the job buffers' readers: %s",
                cudaGetErrorString(status));
        }
        cudaFree(g.jobStaging[b]);
        g.jobStaging[b] = nullptr;
    }
    g.jobStagingBytes = 0;
    g.nextJobBuffer = 0;
    for (int b = 0; b < 2 && bytes > 0; ++b)
    {
        cudaError_t const status = cudaMalloc(reinterpret_cast<void**>(&g.jobStaging[b]), static_cast<size_t>(bytes));
        if (status != cudaSuccess)
        {
            cudaFree(g.jobStaging[0]);
            g.jobStaging[0] = nullptr;
            g.jobStaging[1] = nullptr;
            cudaGetLastError();
            return failCuda(status,
                "engram_host_gatherer_set_option: job_staging_bytes: two device buffers of %lld "
                "bytes could not be allocated: %s (set a smaller value, or 0 for the ring of slots alone)",
                static_cast<long long>(bytes), cudaGetErrorString(status));
        }
    }
    g.jobStagingBytes = bytes;
    return 0;
}

} // namespace kernels
} // namespace engram_trt

EngramHostGatherer::~EngramHostGatherer()
{
    pool.reset(); // joins the workers
    if (copyStream != nullptr)
    {
        cudaStreamSynchronize(copyStream);
    }
    for (cudaEvent_t e : copied)
    {
        if (e != nullptr)
        {
            cudaEventSynchronize(e);
            cudaEventDestroy(e);
        }
    }
    for (cudaEvent_t e : consumed)
    {
        if (e != nullptr)
        {
            cudaEventSynchronize(e);
            cudaEventDestroy(e);
        }
    }
    for (int b = 0; b < 2; ++b)
    {
        if (jobConsumed[b] != nullptr)
        {
            cudaEventSynchronize(jobConsumed[b]);
            cudaEventDestroy(jobConsumed[b]);
        }
        if (jobStaging[b] != nullptr)
        {
            cudaFree(jobStaging[b]);
        }
    }
    if (callStart != nullptr)
    {
        cudaEventDestroy(callStart);
    }
    if (copyStream != nullptr)
    {
        cudaStreamDestroy(copyStream);
    }
    for (uint8_t* p : pinned)
    {
        if (p != nullptr)
        {
            cudaFreeHost(p);
        }
    }
    for (uint8_t* p : deviceStaging)
    {
        if (p != nullptr)
        {
            cudaFree(p);
        }
    }
    cudaGetLastError(); // teardown errors (e.g. no device left) must not reach a later call
}
