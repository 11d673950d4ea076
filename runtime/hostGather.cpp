// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * Host gather: CPU threads gather table rows into pinned staging, one copy per chunk.
 *
 * Why: on the H200 VM (docs/platform.md) random GPU reads of pinned host memory reach
 * about a tenth of the PCIe link, because every 4 KiB page costs the GPU a translation,
 * while one contiguous cudaMemcpyAsync runs at the link's speed. So the CPU's cores pick
 * the rows (rowGather.h) and the copy engine moves contiguous chunks.
 *
 * Pipeline. A call's rows are split into chunks (at most chunk_rows rows; a small call
 * into at least min_chunks chunks, so that even a decode step overlaps its gather with
 * its copy), each chunk into tasks of task_rows rows. The pool's workers claim tasks in
 * order from one counter; the caller thread issues the copies and helps with the tasks
 * when it has nothing to issue. Staging is a ring of num_slots pinned slots (and as many
 * device slots): chunk c uses slot c % num_slots, and its tasks are released to the
 * workers only once that slot's previous copy has completed (an event query, never a
 * blocking wait), so a slot is never overwritten while the copy engine reads it. When
 * every task of chunk c is done, the caller enqueues its copy on the gatherer's own copy
 * stream and, for fp8 tables, the dequant (the gather kernel with identity ids) on the
 * caller's stream behind an event. Copies therefore run back to back on the copy engine
 * while dequant kernels run beside them, and the caller's stream waits only for what it
 * needs. All CUDA calls are made by the calling thread; the workers only copy bytes.
 *
 * Job buffers (ENGRAM_HOST_GATHER_JOB_STAGING_BYTES). With the ring alone a device slot is
 * reused only after the dequant that read it, so a dequant that cannot get a
 * multiprocessor (a prefill's GEMM or attention kernel holds them all until it ends) stops
 * the copies behind it, the pinned slots stay full and the CPU threads idle: the gather
 * then advances one ring of chunks per long kernel. A call whose staged bytes fit a job
 * buffer copies chunk c to its own offset there instead (values and scale bytes in two
 * regions), so the copy engine and the CPU threads never wait for the SMs, and one dequant
 * of the whole call follows the last copy: per-chunk kernels would run in stream order, each
 * waiting for the next long kernel to end. Two buffers, used in turn, let the next call
 * (the next Engram layer) start before the last one's dequant ran.
 *
 * Sinks: bf16 output (fp8 tables dequantized on the GPU, bf16 tables copied straight into
 * `out`), or raw bytes (rows and scale bytes copied into two device arrays, for a device
 * row cache that stores fp8). With the scales in HBM (ENGRAM_LAYOUT_HBM_SCALES) the raw
 * sink stages and copies the values alone (one copy per chunk instead of two) and one
 * kernel on the caller's stream gathers the rows' scale bytes from the device scale array
 * by the device ids, beside the pipeline (the copies do not wait for it).
 *
 * This file holds the pipeline and the body of the gather calls (hostGather); the C
 * entry points are in hostGatherApi.cpp, the gatherer's state (its creation, job buffers
 * and teardown) in hostGatherer.cpp, what they share in hostGatherInternal.h.
 */
#include "hostGatherInternal.h"

#include <algorithm>
#include <atomic>
#include <mutex>

namespace engram_trt
{
namespace kernels
{

namespace
{
constexpr int64_t kMinSplitRows = 256;   // min_chunks never makes chunks smaller than this
constexpr int64_t kCallerOnlyRows = 256; // a call of at most this many rows runs on the calling thread alone
} // namespace

//! One call's work, shared by the caller and the workers.
struct GatherJob
{
    RowIds ids;
    RowTable table;
    GatherTuning tuning;
    int64_t totalRows{0};
    int64_t chunkRows{0};
    int64_t numChunks{0};
    int64_t taskRows{0};
    int64_t tasksPerChunk{0};
    int64_t numTasks{0};
    uint8_t* const* slots{nullptr};
    int numSlots{0};
    std::atomic<int64_t>* chunkDone{nullptr};
    std::atomic<int64_t> next{0};     // next task to claim
    std::atomic<int64_t> released{0}; // tasks [0, released) may run (their slots are free)
    std::atomic<bool> abort{false};

    int64_t chunkCount(int64_t c) const
    {
        return std::min(chunkRows, totalRows - c * chunkRows);
    }
    int64_t tasksOf(int64_t c) const
    {
        return (chunkCount(c) + taskRows - 1) / taskRows;
    }
    int64_t firstTaskAfter(int64_t c) const
    {
        return c * tasksPerChunk + tasksOf(c);
    }

    void runTask(int64_t task)
    {
        int64_t const c = task / tasksPerChunk;
        int64_t const first = c * chunkRows;
        int64_t const count = chunkCount(c);
        int64_t const begin = first + (task - c * tasksPerChunk) * taskRows;
        int64_t const end = std::min(first + count, begin + taskRows);
        uint8_t* slot = slots[c % numSlots];
        gatherRows(ids, begin, end, table, slot + (begin - first) * table.rowBytes,
            slot + count * table.rowBytes + (begin - first) * table.scaleBytes, tuning);
        chunkDone[c].fetch_add(1, std::memory_order_release);
    }

    //! Claims a released task, if any, without waiting.
    bool tryClaim(int64_t& task)
    {
        int64_t current = next.load(std::memory_order_relaxed);
        while (current < released.load(std::memory_order_acquire))
        {
            if (next.compare_exchange_weak(current, current + 1, std::memory_order_relaxed))
            {
                task = current;
                return true;
            }
        }
        return false;
    }

    //! A worker's part: claim tasks in order; wait for a claimed task's release.
    void work()
    {
        while (true)
        {
            int64_t const task = next.fetch_add(1, std::memory_order_relaxed);
            if (task >= numTasks)
            {
                return;
            }
            for (int64_t spins = 0; task >= released.load(std::memory_order_acquire); ++spins)
            {
                if (abort.load(std::memory_order_relaxed))
                {
                    return;
                }
                backoff(spins);
            }
            if (abort.load(std::memory_order_relaxed))
            {
                return;
            }
            runTask(task);
        }
    }
};

//! Checks table_layout and the table pointers; fills `table` (rows, scales, pitch).
int makeTable(char const* fn, void const* rowsHost, void const* scalesHost, int64_t tableNumRows, int64_t rowBytes,
    int64_t scaleBytes, int32_t tableLayout, RowTable& table)
{
    if (tableLayout != ENGRAM_LAYOUT_SPLIT && tableLayout != ENGRAM_LAYOUT_INLINE
        && tableLayout != ENGRAM_LAYOUT_HBM_SCALES)
    {
        return fail(cudaErrorInvalidValue, "%s: table_layout %d is not split (0), inline (1) or hbm_scales (2)", fn,
            tableLayout);
    }
    if (tableLayout == ENGRAM_LAYOUT_HBM_SCALES)
    {
        // The CPU threads copy the values alone: to them it is a split table without scale
        // bytes, which stay in device memory (never read on the host) for the GPU's dequant.
        if (scaleBytes == 0)
        {
            return fail(cudaErrorInvalidValue, "%s: hbm_scales (2) is a layout of fp8 tables only", fn);
        }
        scalesHost = nullptr;
        scaleBytes = 0;
    }
    bool const inlineScales = tableLayout == ENGRAM_LAYOUT_INLINE && scaleBytes > 0;
    if (tableLayout == ENGRAM_LAYOUT_INLINE && scalesHost != nullptr)
    {
        return fail(cudaErrorInvalidValue,
            "%s: an inline table keeps its scale bytes in its rows: pass scales_host = NULL", fn);
    }
    if (tableNumRows > 0 && (rowsHost == nullptr || (!inlineScales && scaleBytes > 0 && scalesHost == nullptr)))
    {
        return fail(
            cudaErrorInvalidValue, "%s: the table rows (and, for a split fp8 table, its scales) are required", fn);
    }
    table.rows = static_cast<uint8_t const*>(rowsHost);
    table.scales = static_cast<uint8_t const*>(scalesHost);
    table.numRows = tableNumRows;
    table.rowBytes = rowBytes;
    table.scaleBytes = scaleBytes;
    table.inlineScales = inlineScales;
    return 0;
}

namespace
{

int recordError(char const* fn, char const* what, cudaError_t status)
{
    return failCuda(status, "%s: %s failed: %s", fn, what, cudaGetErrorString(status));
}

//! The dequant of `count` staged fp8 rows into rows [first, first + count) of the sink's
//! bf16 out, on `stream`: the values at `values`, their scale bytes at `scales` (split
//! form) or, with the scales in HBM, read there by the rows' device ids.
int dequantStaged(GatherJob const& job, GatherSink const& sink, uint8_t const* values, uint8_t const* scales,
    int64_t first, int64_t count, cudaStream_t stream)
{
    uint8_t* const out = sink.out + first * 2 * static_cast<int64_t>(sink.headDim);
    return sink.scalesDev != nullptr
        ? launchDequantStaged(values, sink.idsDev, first, count, static_cast<int32_t>(job.ids.numCols),
              job.ids.tokenStride, sink.scalesDev, job.table.numRows, sink.headDim, sink.quantBlock, out, stream)
        : launchGather(nullptr, count, 1, 1, values, scales, nullptr, nullptr, count, sink.headDim, sink.tableDtype,
              sink.quantBlock, out, stream);
}

//! Enqueues chunk c (all its tasks done): the copy on the copy stream, then the dequant
//! on the caller's stream for an fp8 table. `jobStaging` (or null: the ring of device
//! slots) is the device buffer that holds the whole call's staged bytes; its dequant is
//! one kernel after the last chunk (runPipeline).
int issueChunk(char const* fn, EngramHostGatherer& g, GatherJob const& job, GatherSink const& sink, int64_t c,
    uint8_t* jobStaging, cudaStream_t stream)
{
    int const slot = static_cast<int>(c % g.numSlots);
    int64_t const first = c * job.chunkRows;
    int64_t const count = job.chunkCount(c);
    int64_t const rowsBytes = count * job.table.rowBytes;
    int64_t const scalesBytes = count * job.table.scaleBytes;
    uint8_t const* staged = g.pinned[slot];
    cudaError_t status = cudaSuccess;
    if (sink.kind == GatherSink::kRaw)
    {
        status = cudaMemcpyAsync(
            sink.dstRows + first * job.table.rowBytes, staged, rowsBytes, cudaMemcpyHostToDevice, g.copyStream);
        if (status == cudaSuccess && scalesBytes > 0)
        {
            status = cudaMemcpyAsync(sink.dstScales + first * job.table.scaleBytes, staged + rowsBytes, scalesBytes,
                cudaMemcpyHostToDevice, g.copyStream);
        }
        if (status != cudaSuccess)
        {
            return recordError(fn, "cudaMemcpyAsync", status);
        }
    }
    else if (sink.tableDtype != ENGRAM_TABLE_FP8_E4M3)
    {
        status = cudaMemcpyAsync(sink.out + first * 2 * static_cast<int64_t>(sink.headDim), staged, rowsBytes,
            cudaMemcpyHostToDevice, g.copyStream);
        if (status != cudaSuccess)
        {
            return recordError(fn, "cudaMemcpyAsync", status);
        }
    }
    else if (jobStaging != nullptr)
    {
        // The call's own region of the job buffer (values of all its rows, then their
        // scale bytes): nothing else reads it during the call, so the copy waits for no
        // dequant (runPipeline ordered the buffer's reuse). One dequant reads it after the
        // last chunk.
        status = cudaMemcpyAsync(
            jobStaging + first * job.table.rowBytes, staged, rowsBytes, cudaMemcpyHostToDevice, g.copyStream);
        if (status == cudaSuccess && scalesBytes > 0)
        {
            status = cudaMemcpyAsync(jobStaging + job.totalRows * job.table.rowBytes + first * job.table.scaleBytes,
                staged + rowsBytes, scalesBytes, cudaMemcpyHostToDevice, g.copyStream);
        }
        if (status != cudaSuccess)
        {
            return recordError(fn, "cudaMemcpyAsync", status);
        }
    }
    else
    {
        // The device slot was last read by the dequant of chunk c - num_slots (or of an
        // earlier call): the copy into it waits for that kernel. (With scales in HBM the
        // chunk is its rows alone: scalesBytes is 0.)
        status = cudaStreamWaitEvent(g.copyStream, g.consumed[slot], 0);
        if (status == cudaSuccess)
        {
            status = cudaMemcpyAsync(
                g.deviceStaging[slot], staged, rowsBytes + scalesBytes, cudaMemcpyHostToDevice, g.copyStream);
        }
        if (status != cudaSuccess)
        {
            return recordError(fn, "cudaMemcpyAsync", status);
        }
    }
    status = cudaEventRecord(g.copied[slot], g.copyStream);
    if (status != cudaSuccess)
    {
        return recordError(fn, "cudaEventRecord", status);
    }
    if (sink.kind == GatherSink::kBf16Out && sink.tableDtype == ENGRAM_TABLE_FP8_E4M3 && jobStaging == nullptr)
    {
        status = cudaStreamWaitEvent(stream, g.copied[slot], 0);
        if (status != cudaSuccess)
        {
            return recordError(fn, "cudaStreamWaitEvent", status);
        }
        int const launched
            = dequantStaged(job, sink, g.deviceStaging[slot], g.deviceStaging[slot] + rowsBytes, first, count, stream);
        if (launched != 0)
        {
            return launched;
        }
        status = cudaEventRecord(g.consumed[slot], stream);
        if (status != cudaSuccess)
        {
            return recordError(fn, "cudaEventRecord", status);
        }
    }
    return 0;
}

//! The pipeline (see the file comment). Call with callMutex held and the gatherer's
//! device current.
int runPipeline(char const* fn, EngramHostGatherer& g, RowIds const& ids, int64_t totalRows, RowTable const& table,
    GatherSink const& sink, cudaStream_t stream)
{
    int64_t const perRow = table.rowBytes + table.scaleBytes;
    int64_t chunk = std::min(g.chunkRows, g.slotBytes / perRow);
    if (g.minChunks > 1)
    {
        chunk = std::min(chunk, std::max(kMinSplitRows, ceilDiv(totalRows, g.minChunks)));
    }
    chunk = std::max<int64_t>(1, chunk);

    GatherJob job;
    job.ids = ids;
    job.table = table;
    job.tuning = g.tuning;
    job.totalRows = totalRows;
    job.chunkRows = chunk;
    job.numChunks = ceilDiv(totalRows, chunk);
    job.taskRows = g.taskRows > 0 ? g.taskRows : autoTaskRows(chunk, g.pool->numThreads());
    job.tasksPerChunk = ceilDiv(chunk, job.taskRows);
    job.numTasks = job.firstTaskAfter(job.numChunks - 1);
    job.slots = g.pinned.data();
    job.numSlots = g.numSlots;
    if (job.numChunks > g.chunkDoneCapacity)
    {
        g.chunkDone.reset(new std::atomic<int64_t>[static_cast<size_t>(job.numChunks)]);
        g.chunkDoneCapacity = job.numChunks;
    }
    for (int64_t c = 0; c < job.numChunks; ++c)
    {
        g.chunkDone[c].store(0, std::memory_order_relaxed);
    }
    job.chunkDone = g.chunkDone.get();

    // Raw and bf16 chunks are copied into memory the caller's stream may still be using:
    // the copy stream starts after the work already enqueued there. (fp8 chunks go to the
    // gatherer's own device slots, ordered by the slots' events.)
    bool const copiesIntoCallerMemory = sink.kind == GatherSink::kRaw || sink.tableDtype != ENGRAM_TABLE_FP8_E4M3;
    if (copiesIntoCallerMemory)
    {
        cudaError_t status = cudaEventRecord(g.callStart, stream);
        if (status == cudaSuccess)
        {
            status = cudaStreamWaitEvent(g.copyStream, g.callStart, 0);
        }
        if (status != cudaSuccess)
        {
            return recordError(fn, "ordering the copy stream after the caller's stream", status);
        }
    }
    if (sink.kind == GatherSink::kRaw && sink.scalesDev != nullptr)
    {
        // Enqueued after callStart, so the copies do not wait for it: the scale bytes come
        // from HBM while the CPU gathers the values; the caller's stream runs it in order.
        if (int const launched = launchGatherScaleBytes(sink.idsDev, totalRows, sink.scalesDev, table.numRows,
                sink.headDim / sink.quantBlock, sink.dstScales, stream))
        {
            return launched;
        }
    }

    // An fp8 call that fits a job buffer stages all its chunks there (the option's comment
    // in engramKernels.h says why); its copies wait only for the last call that read the
    // same buffer, two calls back.
    uint8_t* jobStaging = nullptr;
    int jobBuffer = 0;
    bool const dequantSink = sink.kind == GatherSink::kBf16Out && sink.tableDtype == ENGRAM_TABLE_FP8_E4M3;
    if (dequantSink && g.jobStaging[0] != nullptr && totalRows * perRow <= g.jobStagingBytes)
    {
        jobBuffer = g.nextJobBuffer;
        g.nextJobBuffer ^= 1;
        jobStaging = g.jobStaging[jobBuffer];
        cudaError_t const status = cudaStreamWaitEvent(g.copyStream, g.jobConsumed[jobBuffer], 0);
        if (status != cudaSuccess)
        {
            return recordError(fn, "ordering the job buffer after its last reader", status);
        }
    }

    int result = 0;
    auto worker = [&job](int /*thread*/) { job.work(); };
    auto caller = [&] {
        int64_t releasedChunks = 0;
        int64_t issued = 0;
        for (int64_t spins = 0; issued < job.numChunks;)
        {
            bool progressed = false;
            // Release chunks whose slot is free, at most num_slots ahead of the copies.
            while (releasedChunks < job.numChunks && releasedChunks - issued < g.numSlots)
            {
                cudaError_t const query = cudaEventQuery(g.copied[releasedChunks % g.numSlots]);
                if (query == cudaErrorNotReady)
                {
                    break;
                }
                if (query != cudaSuccess)
                {
                    result = recordError(fn, "waiting for a staging slot", query);
                    job.abort.store(true);
                    return;
                }
                job.released.store(job.firstTaskAfter(releasedChunks), std::memory_order_release);
                ++releasedChunks;
                progressed = true;
            }
            if (issued < releasedChunks && job.chunkDone[issued].load(std::memory_order_acquire) == job.tasksOf(issued))
            {
                result = issueChunk(fn, g, job, sink, issued, jobStaging, stream);
                if (result != 0)
                {
                    job.abort.store(true);
                    return;
                }
                ++issued;
                spins = 0;
                continue;
            }
            int64_t task = 0;
            if (job.tryClaim(task))
            {
                job.runTask(task);
                progressed = true;
            }
            if (progressed)
            {
                spins = 0;
            }
            else
            {
                backoff(spins++);
            }
        }
    };
    if (totalRows <= kCallerOnlyRows)
    {
        // A decode step of a few sequences: the calling thread alone is done before a
        // sleeping pool would have woken (each wake is an IPI to a halted vCPU in a VM).
        caller();
    }
    else
    {
        g.pool->run(worker, caller);
    }
    if (jobStaging != nullptr)
    {
        // One dequant of the whole call once its last copy is done (copies complete in order
        // on the copy stream). One kernel, not one a chunk: the chunks' kernels run in
        // stream order, and beside kernels that hold every SM (a prefill's GEMMs) each would
        // wait for the next of them to end. The buffer's consumption is recorded even after
        // a failed chunk, on the copy stream then: the copies already enqueued still write it.
        cudaError_t status = cudaSuccess;
        if (result == 0)
        {
            status = cudaStreamWaitEvent(stream, g.copied[static_cast<size_t>((job.numChunks - 1) % g.numSlots)], 0);
            if (status != cudaSuccess)
            {
                result = recordError(fn, "cudaStreamWaitEvent", status);
            }
        }
        if (result == 0)
        {
            result
                = dequantStaged(job, sink, jobStaging, jobStaging + totalRows * table.rowBytes, 0, totalRows, stream);
        }
        status = cudaEventRecord(g.jobConsumed[jobBuffer], result == 0 ? stream : g.copyStream);
        if (result == 0 && status != cudaSuccess)
        {
            return recordError(fn, "cudaEventRecord", status);
        }
    }
    if (result != 0)
    {
        return result;
    }
    if (copiesIntoCallerMemory)
    {
        // Copies complete in order on the copy stream: the last chunk's event covers all.
        cudaError_t const status
            = cudaStreamWaitEvent(stream, g.copied[static_cast<size_t>((job.numChunks - 1) % g.numSlots)], 0);
        if (status != cudaSuccess)
        {
            return recordError(fn, "cudaStreamWaitEvent", status);
        }
    }
    return 0;
}

} // namespace

//! Shared by the bf16-out and raw entry points: argument checks, lock, device, pipeline.
int hostGather(char const* fn, EngramHostGatherer* gatherer, RowIds ids, int64_t totalRows, void const* rowsHost,
    void const* scalesHost, int64_t tableNumRows, int32_t headDim, int32_t tableDtype, int32_t quantBlock,
    int32_t tableLayout, GatherSink sink, cudaStream_t stream)
{
    if (gatherer == nullptr)
    {
        return fail(cudaErrorInvalidValue, "%s: gatherer is NULL", fn);
    }
    EngramHostGatherer& g = *gatherer;
    // Taken first: the gatherer's fields and staging belong to one call at a time, and
    // engram_host_gatherer_destroy waits on the same lock.
    std::lock_guard<std::mutex> callLock(g.callMutex);
    int64_t rowBytes = 0;
    int64_t scaleBytes = 0;
    void const* outCheck = sink.kind == GatherSink::kRaw ? static_cast<void const*>(sink.dstRows) : sink.out;
    if (int const status = validateGatherArgs(fn, totalRows > 0 ? 1 : 0, 1, 1, tableNumRows, headDim, tableDtype,
            quantBlock, outCheck, rowBytes, scaleBytes))
    {
        return status;
    }
    if (sink.kind == GatherSink::kRaw && totalRows > 0 && scaleBytes > 0 && sink.dstScales == nullptr)
    {
        return fail(cudaErrorInvalidValue, "%s: an fp8 table needs dst_scales", fn);
    }
    if (rowBytes + scaleBytes > g.slotBytes)
    {
        return fail(cudaErrorInvalidValue, "%s: head_dim %d is wider than the gatherer's max_head_dim %d", fn, headDim,
            g.maxHeadDim);
    }
    RowTable table;
    if (int const status = makeTable(fn, rowsHost, scalesHost, tableNumRows, rowBytes, scaleBytes, tableLayout, table))
    {
        return status;
    }
    if (tableLayout == ENGRAM_LAYOUT_HBM_SCALES)
    {
        if (tableNumRows > 0 && scalesHost == nullptr)
        {
            return fail(cudaErrorInvalidValue, "%s: hbm_scales (2) needs the table's scales in device memory", fn);
        }
        if (totalRows > 0 && sink.idsDev == nullptr)
        {
            return fail(cudaErrorInvalidValue, "%s: hbm_scales (2) needs the ids in device memory too (%s's ids_dev)",
                fn, sink.kind == GatherSink::kRaw ? "engram_host_gather_raw_dev" : "engram_host_gather_dev");
        }
        sink.scalesDev = static_cast<uint8_t const*>(scalesHost);
    }
    if (totalRows == 0)
    {
        return 0;
    }
    if (ids.ids == nullptr)
    {
        return fail(cudaErrorInvalidValue, "%s: ids_host is NULL", fn);
    }
    DeviceGuard deviceGuard(g.device);
    if (deviceGuard.status() != cudaSuccess)
    {
        return failCuda(deviceGuard.status(), "%s: cannot make the gatherer's device %d current: %s", fn, g.device,
            cudaGetErrorString(deviceGuard.status()));
    }
    sink.headDim = headDim;
    sink.tableDtype = tableDtype;
    sink.quantBlock = quantBlock;
    return runPipeline(fn, g, ids, totalRows, table, sink, stream);
}

} // namespace kernels
} // namespace engram_trt
