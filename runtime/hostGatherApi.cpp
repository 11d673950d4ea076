// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * The host gather's C ABI entry points (engramKernels.h): the CPU counts, the gatherer's
 * creation, teardown and options (their argument checks and locking; the state itself is
 * hostGatherer.cpp's), its pool's wake, the bf16-out and raw gathers (their own argument
 * checks, then hostGather: the pipeline, in hostGather.cpp) and the row copy alone on the
 * CPU (engram_host_gather_rows_cpu: tests, and timing the CPU side apart from the link).
 * No exception crosses the ABI (ENGRAM_ABI_TRY / ENGRAM_ABI_CATCH).
 */
#include "hostGatherInternal.h"

#include <algorithm>
#include <mutex>

using namespace engram_trt::kernels;

namespace
{
constexpr int kDefaultSlots = 4;
constexpr int kMaxSlots = 64;
} // namespace

extern "C" ENGRAM_API int engram_cpu_affinity_count(int32_t* count)
{
    clearError();
    if (count == nullptr)
    {
        return fail(cudaErrorInvalidValue, "engram_cpu_affinity_count: count is NULL");
    }
    *count = defaultThreadCount();
    return 0;
}

extern "C" ENGRAM_API int engram_host_gather_default_threads(int32_t* count)
{
    clearError();
    if (count == nullptr)
    {
        return fail(cudaErrorInvalidValue, "engram_host_gather_default_threads: count is NULL");
    }
    *count = defaultGatherThreads();
    return 0;
}

extern "C" ENGRAM_API int engram_host_gatherer_create_ex(
    int32_t numThreads, int64_t chunkRows, int32_t maxHeadDim, int32_t numSlots, EngramHostGatherer** gatherer)
{
    clearError();
    ENGRAM_ABI_TRY
    {
        if (gatherer == nullptr)
        {
            return fail(cudaErrorInvalidValue, "engram_host_gatherer_create: gatherer is NULL");
        }
        *gatherer = nullptr;
        if (chunkRows < 1 || maxHeadDim < 8 || maxHeadDim % 8 != 0)
        {
            return fail(cudaErrorInvalidValue,
                "engram_host_gatherer_create: need chunk_rows >= 1 and max_head_dim %% 8 == 0 (got %lld, %d)",
                static_cast<long long>(chunkRows), maxHeadDim);
        }
        if (numSlots < 2 || numSlots > kMaxSlots)
        {
            return fail(cudaErrorInvalidValue, "engram_host_gatherer_create: num_slots must be in [2, %d] (got %d)",
                kMaxSlots, numSlots);
        }
        if (numThreads <= 0)
        {
            numThreads = defaultGatherThreads();
        }

        return createGatherer(numThreads, chunkRows, maxHeadDim, numSlots, gatherer);
    }
    ENGRAM_ABI_CATCH("engram_host_gatherer_create")
}

extern "C" ENGRAM_API int engram_host_gatherer_create(
    int32_t numThreads, int64_t chunkRows, int32_t maxHeadDim, EngramHostGatherer** gatherer)
{
    return engram_host_gatherer_create_ex(numThreads, chunkRows, maxHeadDim, kDefaultSlots, gatherer);
}

extern "C" ENGRAM_API int engram_host_gatherer_destroy(EngramHostGatherer* gatherer)
{
    clearError();
    ENGRAM_ABI_TRY
    {
        if (gatherer != nullptr)
        {
            // Wait for a gather in progress on another thread: freeing the staging under it
            // would be a use-after-free. The mutex must be unlocked before it is destroyed.
            std::lock_guard<std::mutex> callLock(gatherer->callMutex);
        }
        delete gatherer;
        return 0;
    }
    ENGRAM_ABI_CATCH("engram_host_gatherer_destroy")
}

extern "C" ENGRAM_API int engram_host_gatherer_set_option(EngramHostGatherer* gatherer, int32_t option, int64_t value)
{
    clearError();
    ENGRAM_ABI_TRY
    {
        if (gatherer == nullptr)
        {
            return fail(cudaErrorInvalidValue, "engram_host_gatherer_set_option: gatherer is NULL");
        }
        EngramHostGatherer& g = *gatherer;
        std::lock_guard<std::mutex> callLock(g.callMutex);
        auto outOfRange = [&](char const* name, long long lo, long long hi) {
            return fail(cudaErrorInvalidValue, "engram_host_gatherer_set_option: %s must be in [%lld, %lld] (got %lld)",
                name, lo, hi, static_cast<long long>(value));
        };
        switch (option)
        {
        case ENGRAM_HOST_GATHER_CHUNK_ROWS:
            if (value < 1 || value > (int64_t{1} << 31))
            {
                return outOfRange("chunk_rows", 1, 1LL << 31);
            }
            g.chunkRows = value;
            return 0;
        case ENGRAM_HOST_GATHER_MIN_CHUNKS:
            if (value < 1 || value > 1024)
            {
                return outOfRange("min_chunks", 1, 1024);
            }
            g.minChunks = value;
            return 0;
        case ENGRAM_HOST_GATHER_TASK_ROWS:
            if (value < 0 || value > (int64_t{1} << 20))
            {
                return outOfRange("task_rows", 0, 1LL << 20);
            }
            g.taskRows = value;
            return 0;
        case ENGRAM_HOST_GATHER_PREFETCH_ROWS:
            if (value < 0 || value > kMaxPrefetchRows)
            {
                return outOfRange("prefetch_rows", 0, kMaxPrefetchRows);
            }
            g.tuning.prefetchRows = static_cast<int>(value);
            return 0;
        case ENGRAM_HOST_GATHER_STREAMING_STORES:
            if (value != 0 && value != 1)
            {
                return outOfRange("streaming_stores", 0, 1);
            }
            g.tuning.streamingStores = value == 1;
            return 0;
        case ENGRAM_HOST_GATHER_PREFETCH_FAR_ROWS:
            if (value < 0 || value > kMaxPrefetchRows)
            {
                return outOfRange("prefetch_far_rows", 0, kMaxPrefetchRows);
            }
            g.tuning.prefetchFarRows = static_cast<int>(value);
            return 0;
        case ENGRAM_HOST_GATHER_PREFETCH_LOCALITY:
            if (value < 0 || value > 3)
            {
                return outOfRange("prefetch_locality", 0, 3);
            }
            g.tuning.prefetchLocality = static_cast<int>(value);
            return 0;
        case ENGRAM_HOST_GATHER_SPIN_US:
            if (value < 0 || value > 1000000)
            {
                return outOfRange("spin_us", 0, 1000000);
            }
            g.pool->setSpinMicros(value);
            return 0;
        case ENGRAM_HOST_GATHER_JOB_STAGING_BYTES:
            if (value < 0 || value > (int64_t{1} << 40))
            {
                return outOfRange("job_staging_bytes", 0, 1LL << 40);
            }
            return setJobStaging(g, value);
        default:
            return fail(cudaErrorInvalidValue,
                "engram_host_gatherer_set_option: option %d is not a settable EngramHostGatherOption", option);
        }
    }
    ENGRAM_ABI_CATCH("engram_host_gatherer_set_option")
}

extern "C" ENGRAM_API int engram_host_gatherer_get_option(EngramHostGatherer* gatherer, int32_t option, int64_t* value)
{
    clearError();
    ENGRAM_ABI_TRY
    {
        if (gatherer == nullptr || value == nullptr)
        {
            return fail(cudaErrorInvalidValue, "engram_host_gatherer_get_option: gatherer and value are required");
        }
        EngramHostGatherer& g = *gatherer;
        std::lock_guard<std::mutex> callLock(g.callMutex);
        switch (option)
        {
        case ENGRAM_HOST_GATHER_CHUNK_ROWS: *value = g.chunkRows; return 0;
        case ENGRAM_HOST_GATHER_MIN_CHUNKS: *value = g.minChunks; return 0;
        case ENGRAM_HOST_GATHER_TASK_ROWS: *value = g.taskRows; return 0;
        case ENGRAM_HOST_GATHER_PREFETCH_ROWS: *value = g.tuning.prefetchRows; return 0;
        case ENGRAM_HOST_GATHER_STREAMING_STORES: *value = g.tuning.streamingStores ? 1 : 0; return 0;
        case ENGRAM_HOST_GATHER_SPIN_US: *value = g.pool->spinMicros(); return 0;
        case ENGRAM_HOST_GATHER_NUM_THREADS: *value = g.pool->numThreads(); return 0;
        case ENGRAM_HOST_GATHER_NUM_SLOTS: *value = g.numSlots; return 0;
        case ENGRAM_HOST_GATHER_SLOT_BYTES: *value = g.slotBytes; return 0;
        case ENGRAM_HOST_GATHER_PREFETCH_FAR_ROWS: *value = g.tuning.prefetchFarRows; return 0;
        case ENGRAM_HOST_GATHER_PREFETCH_LOCALITY: *value = g.tuning.prefetchLocality; return 0;
        case ENGRAM_HOST_GATHER_JOB_STAGING_BYTES: *value = g.jobStagingBytes; return 0;
        default:
            return fail(cudaErrorInvalidValue,
                "engram_host_gatherer_get_option: option %d is not an EngramHostGatherOption", option);
        }
    }
    ENGRAM_ABI_CATCH("engram_host_gatherer_get_option")
}

extern "C" ENGRAM_API int engram_host_gatherer_wake(EngramHostGatherer* gatherer)
{
    clearError();
    ENGRAM_ABI_TRY
    {
        if (gatherer == nullptr)
        {
            return fail(cudaErrorInvalidValue, "engram_host_gatherer_wake: gatherer is NULL");
        }
        gatherer->pool->wake(); // thread-safe: no lock, so a gather in progress is not waited for
        return 0;
    }
    ENGRAM_ABI_CATCH("engram_host_gatherer_wake")
}

extern "C" ENGRAM_API int engram_host_gather_dev(EngramHostGatherer* gatherer, int32_t const* idsHost,
    int32_t const* idsDev, int64_t numTokens, int32_t numCols, int64_t idTokenStride, void const* rowsHost,
    void const* scales, int64_t tableNumRows, int32_t headDim, int32_t tableDtype, int32_t quantBlock,
    int32_t tableLayout, void* out, cudaStream_t stream)
{
    clearError();
    ENGRAM_ABI_TRY
    {
        char const* fn = "engram_host_gather";
        if (int const status = checkIdShape(fn, numTokens, numCols, idTokenStride))
        {
            return status;
        }
        GatherSink sink;
        sink.kind = GatherSink::kBf16Out;
        sink.out = static_cast<uint8_t*>(out);
        sink.idsDev = idsDev;
        RowIds ids{idsHost, numCols, idTokenStride};
        return hostGather(fn, gatherer, ids, numTokens * numCols, rowsHost, scales, tableNumRows, headDim, tableDtype,
            quantBlock, tableLayout, sink, stream);
    }
    ENGRAM_ABI_CATCH("engram_host_gather")
}

extern "C" ENGRAM_API int engram_host_gather_ex(EngramHostGatherer* gatherer, int32_t const* idsHost, int64_t numTokens,
    int32_t numCols, int64_t idTokenStride, void const* rowsHost, void const* scalesHost, int64_t tableNumRows,
    int32_t headDim, int32_t tableDtype, int32_t quantBlock, int32_t tableLayout, void* out, cudaStream_t stream)
{
    return engram_host_gather_dev(gatherer, idsHost, nullptr, numTokens, numCols, idTokenStride, rowsHost, scalesHost,
        tableNumRows, headDim, tableDtype, quantBlock, tableLayout, out, stream);
}

extern "C" ENGRAM_API int engram_host_gather(EngramHostGatherer* gatherer, int32_t const* idsHost, int64_t numTokens,
    int32_t numCols, int64_t idTokenStride, void const* rowsHost, void const* scalesHost, int64_t tableNumRows,
    int32_t headDim, int32_t tableDtype, int32_t quantBlock, void* out, cudaStream_t stream)
{
    return engram_host_gather_ex(gatherer, idsHost, numTokens, numCols, idTokenStride, rowsHost, scalesHost,
        tableNumRows, headDim, tableDtype, quantBlock, ENGRAM_LAYOUT_SPLIT, out, stream);
}

namespace
{
//! Both raw entry points. The checks of the hbm_scales arguments come first (they need no
//! gatherer, so a caller's mistake is named before anything else is looked at).
int hostGatherRaw(char const* fn, EngramHostGatherer* gatherer, int32_t const* idsHost, int32_t const* idsDev,
    int64_t numIds, void const* rowsHost, void const* scales, int64_t tableNumRows, int32_t headDim, int32_t tableDtype,
    int32_t quantBlock, int32_t tableLayout, void* dstRows, void* dstScales, cudaStream_t stream)
{
    if (numIds < 0)
    {
        return fail(cudaErrorInvalidValue, "%s: num_ids must be >= 0 (got %lld)", fn, static_cast<long long>(numIds));
    }
    if (tableLayout == ENGRAM_LAYOUT_HBM_SCALES)
    {
        if (tableDtype != ENGRAM_TABLE_FP8_E4M3)
        {
            return fail(cudaErrorInvalidValue, "%s: hbm_scales (2) is a layout of fp8 tables only", fn);
        }
        if (tableNumRows > 0 && scales == nullptr)
        {
            return fail(cudaErrorInvalidValue,
                "%s: hbm_scales (2) needs the table's scales in device memory (scales is NULL)", fn);
        }
        if (numIds > 0 && idsDev == nullptr)
        {
            return fail(cudaErrorInvalidValue,
                "%s: hbm_scales (2) needs the ids in device memory too (engram_host_gather_raw_dev's ids_dev)", fn);
        }
        if (numIds > 0 && dstScales == nullptr)
        {
            return fail(cudaErrorInvalidValue,
                "%s: hbm_scales (2) gathers the rows' scale bytes into dst_scales (device memory): it is NULL", fn);
        }
    }
    GatherSink sink;
    sink.kind = GatherSink::kRaw;
    sink.dstRows = static_cast<uint8_t*>(dstRows);
    sink.dstScales = static_cast<uint8_t*>(dstScales);
    sink.idsDev = idsDev;
    RowIds ids{idsHost, 1, 1};
    return hostGather(fn, gatherer, ids, numIds, rowsHost, scales, tableNumRows, headDim, tableDtype, quantBlock,
        tableLayout, sink, stream);
}
} // namespace

extern "C" ENGRAM_API int engram_host_gather_raw_dev(EngramHostGatherer* gatherer, int32_t const* idsHost,
    int32_t const* idsDev, int64_t numIds, void const* rowsHost, void const* scales, int64_t tableNumRows,
    int32_t headDim, int32_t tableDtype, int32_t quantBlock, int32_t tableLayout, void* dstRows, void* dstScales,
    cudaStream_t stream)
{
    clearError();
    ENGRAM_ABI_TRY
    {
        return hostGatherRaw("engram_host_gather_raw_dev", gatherer, idsHost, idsDev, numIds, rowsHost, scales,
            tableNumRows, headDim, tableDtype, quantBlock, tableLayout, dstRows, dstScales, stream);
    }
    ENGRAM_ABI_CATCH("engram_host_gather_raw_dev")
}

extern "C" ENGRAM_API int engram_host_gather_raw(EngramHostGatherer* gatherer, int32_t const* idsHost, int64_t numIds,
    void const* rowsHost, void const* scalesHost, int64_t tableNumRows, int32_t headDim, int32_t tableDtype,
    int32_t quantBlock, int32_t tableLayout, void* dstRows, void* dstScales, cudaStream_t stream)
{
    clearError();
    ENGRAM_ABI_TRY
    {
        return hostGatherRaw("engram_host_gather_raw", gatherer, idsHost, nullptr, numIds, rowsHost, scalesHost,
            tableNumRows, headDim, tableDtype, quantBlock, tableLayout, dstRows, dstScales, stream);
    }
    ENGRAM_ABI_CATCH("engram_host_gather_raw")
}

extern "C" ENGRAM_API int engram_host_gather_rows_cpu(EngramHostGatherer* gatherer, int32_t numThreads,
    int32_t const* idsHost, int64_t numIds, void const* rowsHost, void const* scalesHost, int64_t tableNumRows,
    int32_t headDim, int32_t tableDtype, int32_t quantBlock, int32_t tableLayout, void* dstRowsHost,
    void* dstScalesHost, int32_t prefetchRows, int32_t streamingStores)
{
    clearError();
    ENGRAM_ABI_TRY
    {
        char const* fn = "engram_host_gather_rows_cpu";
        int64_t rowBytes = 0;
        int64_t scaleBytes = 0;
        if (numIds < 0)
        {
            return fail(
                cudaErrorInvalidValue, "%s: num_ids must be >= 0 (got %lld)", fn, static_cast<long long>(numIds));
        }
        if (int const status = validateGatherArgs(
                fn, 0, 1, 1, tableNumRows, headDim, tableDtype, quantBlock, nullptr, rowBytes, scaleBytes))
        {
            return status;
        }
        if (prefetchRows > kMaxPrefetchRows || streamingStores > 1)
        {
            return fail(cudaErrorInvalidValue,
                "%s: prefetch_rows must be <= %d and streaming_stores 0 or 1 (-1: the default) (got %d, %d)", fn,
                kMaxPrefetchRows, prefetchRows, streamingStores);
        }
        RowTable table;
        if (int const status
            = makeTable(fn, rowsHost, scalesHost, tableNumRows, rowBytes, scaleBytes, tableLayout, table))
        {
            return status;
        }
        scaleBytes = table.scaleBytes; // 0 for hbm_scales: the values alone are copied
        if (numIds == 0)
        {
            return 0;
        }
        if (idsHost == nullptr || dstRowsHost == nullptr || (scaleBytes > 0 && dstScalesHost == nullptr))
        {
            return fail(
                cudaErrorInvalidValue, "%s: ids_host, dst_rows_host (and dst_scales_host for fp8) are required", fn);
        }
        auto run = [&](ThreadPool& pool, GatherTuning tuning) {
            if (prefetchRows >= 0)
            {
                tuning.prefetchRows = prefetchRows;
            }
            if (streamingStores >= 0)
            {
                tuning.streamingStores = streamingStores == 1;
            }
            RowIds const ids{idsHost, 1, 1};
            int64_t const taskRows = autoTaskRows(numIds, pool.numThreads());
            auto* rowsOut = static_cast<uint8_t*>(dstRowsHost);
            auto* scalesOut = static_cast<uint8_t*>(dstScalesHost);
            pool.parallelFor(ceilDiv(numIds, taskRows), [&](int64_t task) {
                int64_t const begin = task * taskRows;
                int64_t const end = std::min(numIds, begin + taskRows);
                gatherRows(ids, begin, end, table, rowsOut + begin * rowBytes,
                    scalesOut == nullptr ? nullptr : scalesOut + begin * scaleBytes, tuning);
            });
        };
        if (gatherer != nullptr)
        {
            std::lock_guard<std::mutex> callLock(gatherer->callMutex);
            run(*gatherer->pool, gatherer->tuning);
        }
        else
        {
            ThreadPool pool(numThreads > 0 ? numThreads : defaultThreadCount());
            run(pool, GatherTuning{});
        }
        return 0;
    }
    ENGRAM_ABI_CATCH("engram_host_gather_rows_cpu")
}
