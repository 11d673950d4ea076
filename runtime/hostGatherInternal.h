// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * What the host gather's C entry points (hostGatherApi.cpp: argument checks, locking,
 * options) and its pipeline (hostGather.cpp) share: the gatherer's state, made, resized
 * and torn down by hostGatherer.cpp, where a call's chunks go (GatherSink), the task size,
 * the table check (makeTable) and hostGather, the body of every gather call. The gather
 * driver (gatherDriver.cpp) shares the ids' shape check. Not part of the ABI.
 *
 * The files' dependencies go one way: hostGatherer.cpp (the state) uses neither of the
 * others, hostGather.cpp (the pipeline) uses the state, hostGatherApi.cpp uses both, and
 * the gather driver and the cache step call the entry points.
 */
#ifndef ENGRAM_TRT_HOST_GATHER_INTERNAL_H
#define ENGRAM_TRT_HOST_GATHER_INTERNAL_H

#include "kernels/engramKernelsInternal.h"
#include "kernels/hostGatherKernels.h"
#include "rowGather.h"
#include "threadPool.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cuda_runtime_api.h>
#include <memory>
#include <mutex>
#include <vector>

namespace engram_trt
{
namespace kernels
{
constexpr int64_t kDefaultMinChunks = 4;
} // namespace kernels
} // namespace engram_trt

struct EngramHostGatherer
{
    int device{0};
    int32_t maxHeadDim{0};
    int64_t capacityRows{0}; // rows of max_head_dim bf16 values one slot holds
    int64_t slotBytes{0};
    int numSlots{0};
    std::vector<uint8_t*> pinned;
    std::vector<uint8_t*> deviceStaging;
    std::vector<cudaEvent_t> copied;   // on copyStream after a slot's copy: the pinned slot is free again
    std::vector<cudaEvent_t> consumed; // on the caller's stream after the dequant read a device slot
    // ENGRAM_HOST_GATHER_JOB_STAGING_BYTES: two device buffers, each holding a whole fp8
    // call's staged bytes, used in turn; jobConsumed[b] is recorded on the caller's stream
    // after the last dequant that read buffer b, and the next call into b waits for it.
    int64_t jobStagingBytes{0};
    uint8_t* jobStaging[2]{nullptr, nullptr};
    cudaEvent_t jobConsumed[2]{nullptr, nullptr};
    int nextJobBuffer{0};
    cudaStream_t copyStream{nullptr};
    cudaEvent_t callStart{nullptr};
    std::unique_ptr<engram_trt::kernels::ThreadPool> pool;

    // Tuning (engram_host_gatherer_set_option).
    int64_t chunkRows{0};
    int64_t minChunks{engram_trt::kernels::kDefaultMinChunks};
    int64_t taskRows{0}; // 0: automatic
    engram_trt::kernels::GatherTuning tuning{};

    std::unique_ptr<std::atomic<int64_t>[]> chunkDone;
    int64_t chunkDoneCapacity{0};
    std::mutex callMutex;

    ~EngramHostGatherer(); // hostGatherer.cpp, beside createGatherer
};

namespace engram_trt
{
namespace kernels
{

//! Makes `device` current and restores the previous device on scope exit; status()
//! says whether the switch worked.
class DeviceGuard
{
public:
    explicit DeviceGuard(int device)
    {
        mStatus = cudaGetDevice(&mPrevious);
        if (mStatus == cudaSuccess && mPrevious != device)
        {
            mStatus = cudaSetDevice(device);
            mRestore = mStatus == cudaSuccess;
        }
    }
    ~DeviceGuard()
    {
        if (mRestore && cudaSetDevice(mPrevious) != cudaSuccess)
        {
            cudaGetLastError(); // leave no stale error for a later launch check
        }
    }
    cudaError_t status() const
    {
        return mStatus;
    }

private:
    int mPrevious{0};
    bool mRestore{false};
    cudaError_t mStatus{cudaSuccess};
};

//! Where a call's chunks go.
struct GatherSink
{
    enum Kind
    {
        kBf16Out, // fp8: dequant into out; bf16: copy into out
        kRaw      // raw rows into dstRows, raw scale bytes into dstScales
    };
    Kind kind{kBf16Out};
    uint8_t* out{nullptr};
    uint8_t* dstRows{nullptr};
    uint8_t* dstScales{nullptr};
    int32_t headDim{0};
    int32_t tableDtype{0};
    int32_t quantBlock{0};
    // ENGRAM_LAYOUT_HBM_SCALES: the dequant (bf16 sink) or the scale-byte gather (raw sink)
    // reads scale bytes by id from device memory (the ids laid out as the call's host ids,
    // RowIds).
    uint8_t const* scalesDev{nullptr};
    int32_t const* idsDev{nullptr};
};

inline int64_t ceilDiv(int64_t a, int64_t b)
{
    return (a + b - 1) / b;
}

//! Rows per task when the option is 0: about two tasks per thread and chunk, so the
//! threads finish a chunk together, within [16, 512] rows (a task's first rows are
//! prefetched together; a claim is one atomic on a shared line).
inline int64_t autoTaskRows(int64_t chunkRows, int numThreads)
{
    return std::max<int64_t>(16, std::min<int64_t>(512, ceilDiv(chunkRows, 2 * static_cast<int64_t>(numThreads))));
}

//! The ids' shape of a bf16-out call (num_tokens tokens of num_cols ids each, a token's
//! ids id_token_stride apart), checked alike by engram_host_gather_dev and the driver's
//! engram_gather_driver_submit.
inline int checkIdShape(char const* fn, int64_t numTokens, int32_t numCols, int64_t idTokenStride)
{
    if (numTokens < 0 || numCols < 1 || idTokenStride < numCols)
    {
        return fail(cudaErrorInvalidValue,
            "%s: need num_tokens >= 0, num_cols >= 1, id_token_stride >= num_cols (got %lld, %d, %lld)", fn,
            static_cast<long long>(numTokens), numCols, static_cast<long long>(idTokenStride));
    }
    return 0;
}

//! engram_host_gatherer_create_ex once its arguments are checked (hostGatherer.cpp): a
//! gatherer on the current device with `numSlots` staging slots of `chunkRows` rows of
//! `maxHeadDim` bf16 values, their events, the copy stream and a pool of `numThreads`
//! threads. On failure nothing is left allocated (a thread that cannot start throws).
int createGatherer(
    int32_t numThreads, int64_t chunkRows, int32_t maxHeadDim, int32_t numSlots, EngramHostGatherer** gatherer);

//! ENGRAM_HOST_GATHER_JOB_STAGING_BYTES (hostGatherer.cpp): frees the two job buffers once
//! the dequants that read them are done, then allocates `bytes` for each (none for 0).
//! Call with callMutex held. On a failed allocation the option is off (0) and the error
//! is returned.
int setJobStaging(EngramHostGatherer& g, int64_t bytes);

//! Checks table_layout and the table pointers; fills `table` (rows, scales, pitch).
int makeTable(char const* fn, void const* rowsHost, void const* scalesHost, int64_t tableNumRows, int64_t rowBytes,
    int64_t scaleBytes, int32_t tableLayout, RowTable& table);

//! Shared by the bf16-out and raw entry points: argument checks, lock, device, pipeline.
int hostGather(char const* fn, EngramHostGatherer* gatherer, RowIds ids, int64_t totalRows, void const* rowsHost,
    void const* scalesHost, int64_t tableNumRows, int32_t headDim, int32_t tableDtype, int32_t quantBlock,
    int32_t tableLayout, GatherSink sink, cudaStream_t stream);

} // namespace kernels
} // namespace engram_trt

#endif // ENGRAM_TRT_HOST_GATHER_INTERNAL_H
