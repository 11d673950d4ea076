// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * The gather driver: a thread that runs a host gatherer's calls queued by the engine
 * thread, so that thread never waits for a lookup's CPU part.
 *
 * Why: a step's Engram ids are known before its first layer, but the host gather's CPU
 * part (2-3 ms of an 8k-token prefill chunk's 196,608 rows per layer on the H200) ran on
 * the thread that launches the layers. While it gathered one layer's rows no later layer
 * was launched, and the GPU went idle once it ran out of queued work (the step timeline
 * in docs/benchmarks.md). Here the engine thread queues every Engram layer's gather when
 * the step is submitted and goes on launching layers; the driver gathers them in order;
 * each layer's reader waits on the GPU, not on the host, for that layer's rows.
 *
 * How a reader waits: when job k's copies and dequant are enqueued on the job's stream,
 * the driver enqueues there a write of k into a device word (cuStreamWriteValue64), and
 * engram_gather_driver_wait_stream enqueues on the reader's stream a wait until the word
 * is >= k (cuStreamWaitValue64). Stream memory operations take no SM, and the wait may be
 * enqueued before the job has even started (a cudaStreamWaitEvent on an event not yet
 * recorded would wait for nothing). Jobs run and complete in order, so the word only grows.
 *
 * Failure: a job that fails still releases its readers (the write is enqueued anyway, or,
 * when even that fails, stored from the host after the stream drained) and keeps its
 * message: engram_gather_driver_finish returns it. A reader's stream never waits forever,
 * and the caller learns of the failure before it uses the step's output.
 *
 * The driver thread's CUDA calls use the relaxed stream-capture mode, so a CUDA graph
 * that another thread captures in the global mode does not make them fail.
 */
#include "hostGatherInternal.h"
#include "kernels/engramKernelsCore.h"
#include "kernels/engramKernelsInternal.h"
#include "kernels/hashKernels.h"
#include "kernels/hostGatherKernels.h"

#include <condition_variable>
#include <cuda.h>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

using namespace engram_trt::kernels;

namespace
{

using WaitValue64Fn = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
using WriteValue64Fn = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
using DeviceGetFn = CUresult (*)(CUdevice*, int);
using DeviceGetAttributeFn = CUresult (*)(int*, CUdevice_attribute, CUdevice);

//! A driver API function (its CUDA 12.0 form) through the runtime, with no link against
//! libcuda; nullptr when the driver lacks it or the library was built with a CUDA older
//! than 12.5 (no cudaGetDriverEntryPointByVersion: the driver then reports itself
//! unsupported and the runtime gathers on the engine thread).
template <typename Fn>
Fn driverEntry(char const* name)
{
#if CUDART_VERSION >= 12050
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found) != cudaSuccess
        || found != cudaDriverEntryPointSuccess)
    {
        cudaGetLastError();
        return nullptr;
    }
    return reinterpret_cast<Fn>(fn);
#else
    (void) name;
    return nullptr;
#endif
}

struct MemOps
{
    WaitValue64Fn wait{nullptr};
    WriteValue64Fn write{nullptr};
    DeviceGetFn deviceGet{nullptr};
    DeviceGetAttributeFn attribute{nullptr};
};

MemOps const& memOps()
{
    static MemOps const ops = [] {
        MemOps m;
        m.wait = driverEntry<WaitValue64Fn>("cuStreamWaitValue64");
        m.write = driverEntry<WriteValue64Fn>("cuStreamWriteValue64");
        m.deviceGet = driverEntry<DeviceGetFn>("cuDeviceGet");
        m.attribute = driverEntry<DeviceGetAttributeFn>("cuDeviceGetAttribute");
        return m;
    }();
    return ops;
}

//! 1 when `device` runs 64-bit stream wait / write operations, 0 when not, -1 when the
//! driver could not be asked.
int memOpsSupported(int device)
{
    MemOps const& m = memOps();
    if (m.wait == nullptr || m.write == nullptr || m.deviceGet == nullptr || m.attribute == nullptr)
    {
        return -1;
    }
    CUdevice dev = 0;
    int value = 0;
    if (m.deviceGet(&dev, device) != CUDA_SUCCESS
        || m.attribute(&value, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, dev) != CUDA_SUCCESS)
    {
        return -1;
    }
    return value != 0 ? 1 : 0;
}

struct DriverJob
{
    // A gather job (one engram_host_gather_ex call, ticket `ticket`) or, with `step`, a
    // step job: its ids hashed on the GPU and copied back, then one gather per layer,
    // tickets ticket - numLayers + 1 .. ticket.
    bool step{false};
    uint64_t ticket{0};
    int32_t const* ids{nullptr};
    int64_t numTokens{0};
    int32_t numCols{0};
    int64_t idTokenStride{0};
    void const* rows{nullptr};
    void const* scales{nullptr};
    int64_t tableNumRows{0};
    int32_t headDim{0};
    int32_t tableDtype{0};
    int32_t quantBlock{0};
    int32_t tableLayout{0};
    void* out{nullptr};
    cudaStream_t stream{nullptr};
    cudaEvent_t idsReady{nullptr};
    // step jobs
    EngramHashLayout const* layout{nullptr};
    int32_t const* cidsHost{nullptr};
    int32_t const* startsHost{nullptr};
    int32_t const* lookbackHost{nullptr};
    int64_t numSeqs{0};
    int32_t lookbackWidth{0};
    int32_t* cidsDev{nullptr};
    int32_t* startsDev{nullptr};
    int32_t* lookbackDev{nullptr};
    int32_t* rowIdsDev{nullptr};
    int32_t* rowIdsHost{nullptr};
    std::vector<EngramDriverTable> tables;
    std::vector<void*> outs;
};

} // namespace

struct EngramGatherDriver
{
    EngramHostGatherer* gatherer{nullptr};
    int device{0};
    uint64_t* word{nullptr}; // device memory: the last ticket whose rows are ready on its stream
    std::thread thread;
    std::mutex mutex;
    std::condition_variable work;
    std::condition_variable done;
    std::deque<DriverJob> queue;
    uint64_t submitted{0};
    uint64_t finished{0}; // every job up to this ticket has run (its CPU part and its enqueues)
    bool stop{false};
    int error{0};
    uint64_t errorTicket{0};
    std::string errorMessage;

    cudaEvent_t hashed{nullptr}; // a step job's row ids are back on the host

    void loop();
    int runJob(DriverJob const& job);
    int runStep(DriverJob const& job, uint64_t& released);
    void release(cudaStream_t stream, uint64_t ticket, bool failed);
    void keepError(int status, uint64_t ticket);
};

void EngramGatherDriver::keepError(int status, uint64_t ticket)
{
    std::lock_guard<std::mutex> lock(mutex);
    if (error == 0)
    {
        error = status;
        errorTicket = ticket;
        errorMessage = engram_last_error();
    }
}

int EngramGatherDriver::runStep(DriverJob const& job, uint64_t& released)
{
    char const* fn = "engram_gather_driver (step)";
    auto const L = static_cast<int64_t>(job.tables.size());
    uint64_t const first = job.ticket - static_cast<uint64_t>(L) + 1;
    int64_t const T = job.numTokens;
    if (T > 0)
    {
        // The step's ids: up, hashed, and the row ids back down, all on the job's stream.
        cudaError_t status = cudaMemcpyAsync(
            job.cidsDev, job.cidsHost, static_cast<size_t>(T) * sizeof(int32_t), cudaMemcpyHostToDevice, job.stream);
        if (status == cudaSuccess)
        {
            status = cudaMemcpyAsync(job.startsDev, job.startsHost,
                static_cast<size_t>(job.numSeqs + 1) * sizeof(int32_t), cudaMemcpyHostToDevice, job.stream);
        }
        if (status == cudaSuccess && job.lookbackHost != nullptr)
        {
            status = cudaMemcpyAsync(job.lookbackDev, job.lookbackHost,
                static_cast<size_t>(job.numSeqs * job.lookbackWidth) * sizeof(int32_t), cudaMemcpyHostToDevice,
                job.stream);
        }
        if (status != cudaSuccess)
        {
            return failCuda(status, "%s: copying the step's ids up failed: %s", fn, cudaGetErrorString(status));
        }
        if (int const hashStatus = engram_hash_prepared(job.layout, job.cidsDev, T, job.startsDev, job.numSeqs,
                job.lookbackHost != nullptr ? job.lookbackDev : nullptr, job.rowIdsDev, job.stream))
        {
            return hashStatus;
        }
        size_t const rowIdBytes = static_cast<size_t>(T * L * job.numCols) * sizeof(int32_t);
        status = cudaMemcpyAsync(job.rowIdsHost, job.rowIdsDev, rowIdBytes, cudaMemcpyDeviceToHost, job.stream);
        if (status == cudaSuccess)
        {
            status = cudaEventRecord(hashed, job.stream);
        }
        if (status == cudaSuccess)
        {
            status = cudaEventSynchronize(hashed);
        }
        if (status != cudaSuccess)
        {
            return failCuda(status, "%s: copying the row ids back failed: %s", fn, cudaGetErrorString(status));
        }
    }
    for (int64_t l = 0; l < L; ++l)
    {
        EngramDriverTable const& t = job.tables[static_cast<size_t>(l)];
        // The device row ids feed a table whose scales are in HBM (its dequant reads them).
        if (int const status
            = engram_host_gather_dev(gatherer, job.rowIdsHost + l * job.numCols, job.rowIdsDev + l * job.numCols, T,
                job.numCols, L * job.numCols, t.rows_host, t.scales_host, t.num_rows, t.head_dim, t.table_dtype,
                t.quant_block, t.table_layout, job.outs[static_cast<size_t>(l)], job.stream))
        {
            return status;
        }
        release(job.stream, first + static_cast<uint64_t>(l), false); // this layer's readers go on
        released = first + static_cast<uint64_t>(l);
    }
    return 0;
}

int EngramGatherDriver::runJob(DriverJob const& job)
{
    if (job.idsReady != nullptr)
    {
        // The ids come from the hash kernel and one copy back (a long step): their event.
        cudaError_t const status = cudaEventSynchronize(job.idsReady);
        if (status != cudaSuccess)
        {
            return failCuda(
                status, "engram_gather_driver: waiting for the step's ids failed: %s", cudaGetErrorString(status));
        }
    }
    return engram_host_gather_ex(gatherer, job.ids, job.numTokens, job.numCols, job.idTokenStride, job.rows, job.scales,
        job.tableNumRows, job.headDim, job.tableDtype, job.quantBlock, job.tableLayout, job.out, job.stream);
}

void EngramGatherDriver::release(cudaStream_t stream, uint64_t ticket, bool failed)
{
    CUresult const written
        = memOps().write(stream, reinterpret_cast<CUdeviceptr>(word), ticket, CU_STREAM_WRITE_VALUE_DEFAULT);
    if (written != CUDA_SUCCESS)
    {
        // Store the ticket once the stream's earlier writes of the word have landed (a
        // later GPU write of an older ticket would otherwise undo it).
        cudaStreamSynchronize(stream);
        cudaMemcpy(word, &ticket, sizeof(ticket), cudaMemcpyHostToDevice);
        cudaGetLastError();
        if (!failed)
        {
            keepError(fail(cudaErrorUnknown, "engram_gather_driver: cuStreamWriteValue64 failed (CUresult %d)",
                          static_cast<int>(written)),
                ticket);
        }
    }
}

void EngramGatherDriver::loop()
{
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    cudaThreadExchangeStreamCaptureMode(&mode);
    cudaSetDevice(device);
    while (true)
    {
        DriverJob job;
        {
            std::unique_lock<std::mutex> lock(mutex);
            work.wait(lock, [&] { return stop || !queue.empty(); });
            if (queue.empty())
            {
                return; // stop, and every queued job has run
            }
            job = queue.front();
            queue.pop_front();
        }
        clearError();
        uint64_t released = 0;
        int const status = job.step ? runStep(job, released) : runJob(job);
        if (status != 0)
        {
            keepError(status, job.step ? job.ticket - job.tables.size() + 1 : job.ticket);
        }
        if (released != job.ticket)
        {
            release(job.stream, job.ticket, status != 0); // a failed job releases all its readers too
        }
        {
            std::lock_guard<std::mutex> lock(mutex);
            finished = job.ticket;
        }
        done.notify_all();
    }
}

//! 0, or a failure naming `fn` when `ticket` was never handed out (0 passes where
//! `zeroPasses`: no job). The caller holds d.mutex.
static int checkTicket(char const* fn, EngramGatherDriver const& d, uint64_t ticket, bool zeroPasses)
{
    if ((ticket == 0 && !zeroPasses) || ticket > d.submitted)
    {
        return fail(cudaErrorInvalidValue, "%s: ticket %llu was never submitted (last %llu)", fn,
            static_cast<unsigned long long>(ticket), static_cast<unsigned long long>(d.submitted));
    }
    return 0;
}

extern "C" ENGRAM_API int engram_gather_driver_supported(int32_t device, int32_t* supported)
{
    clearError();
    ENGRAM_ABI_TRY
    {
        if (supported == nullptr)
        {
            return fail(cudaErrorInvalidValue, "engram_gather_driver_supported: supported is NULL");
        }
        *supported = memOpsSupported(device) == 1 ? 1 : 0;
        return 0;
    }
    ENGRAM_ABI_CATCH("engram_gather_driver_supported")
}

extern "C" ENGRAM_API int engram_gather_driver_create(EngramHostGatherer* gatherer, EngramGatherDriver** driver)
{
    clearError();
    ENGRAM_ABI_TRY
    {
        char const* fn = "engram_gather_driver_create";
        if (gatherer == nullptr || driver == nullptr)
        {
            return fail(cudaErrorInvalidValue, "%s: gatherer and driver are required", fn);
        }
        *driver = nullptr;
        int device = 0;
        cudaError_t status = cudaGetDevice(&device);
        if (status != cudaSuccess)
        {
            return failCuda(status, "%s: cudaGetDevice failed: %s", fn, cudaGetErrorString(status));
        }
        int const support = memOpsSupported(device);
        if (support != 1)
        {
            return fail(cudaErrorNotSupported,
                "%s: device %d %s 64-bit stream memory operations (cuStreamWaitValue64); use the synchronous host "
                "gather",
                fn, device, support == 0 ? "does not support" : "cannot be asked about");
        }
        // Every kernel a job launches, loaded before any reader can wait on a job (see
        // preloadGatherKernels: a lazy load under a waiting stream would never finish).
        if (int const preload = preloadHashKernels())
        {
            return preload;
        }
        preloadGatherKernels();
        auto d = std::make_unique<EngramGatherDriver>();
        d->gatherer = gatherer;
        d->device = device;
        status = cudaMalloc(reinterpret_cast<void**>(&d->word), sizeof(uint64_t));
        if (status == cudaSuccess)
        {
            status = cudaMemset(d->word, 0, sizeof(uint64_t));
        }
        if (status == cudaSuccess)
        {
            status = cudaEventCreateWithFlags(&d->hashed, cudaEventDisableTiming);
        }
        if (status == cudaSuccess)
        {
            status = cudaDeviceSynchronize();
        }
        if (status != cudaSuccess)
        {
            if (d->word != nullptr)
            {
                cudaFree(d->word);
            }
            if (d->hashed != nullptr)
            {
                cudaEventDestroy(d->hashed);
            }
            return failCuda(status, "%s: the driver's device word: %s", fn, cudaGetErrorString(status));
        }
        EngramGatherDriver* raw = d.get();
        d->thread = std::thread([raw] { raw->loop(); });
        *driver = d.release();
        return 0;
    }
    ENGRAM_ABI_CATCH("engram_gather_driver_create")
}

extern "C" ENGRAM_API int engram_gather_driver_destroy(EngramGatherDriver* driver)
{
    clearError();
    ENGRAM_ABI_TRY
    {
        if (driver == nullptr)
        {
            return 0;
        }
        {
            std::lock_guard<std::mutex> lock(driver->mutex);
            driver->stop = true;
        }
        driver->work.notify_all();
        if (driver->thread.joinable())
        {
            driver->thread.join(); // runs every queued job first: their readers are released
        }
        cudaDeviceSynchronize(); // no stream may still wait on the word or write it
        cudaFree(driver->word);
        cudaEventDestroy(driver->hashed);
        cudaGetLastError();
        delete driver;
        return 0;
    }
    ENGRAM_ABI_CATCH("engram_gather_driver_destroy")
}

extern "C" ENGRAM_API int engram_gather_driver_submit(EngramGatherDriver* driver, int32_t const* idsHost,
    int64_t numTokens, int32_t numCols, int64_t idTokenStride, void const* rowsHost, void const* scalesHost,
    int64_t tableNumRows, int32_t headDim, int32_t tableDtype, int32_t quantBlock, int32_t tableLayout, void* out,
    cudaStream_t stream, cudaEvent_t idsReady, uint64_t* ticket)
{
    clearError();
    ENGRAM_ABI_TRY
    {
        char const* fn = "engram_gather_driver_submit";
        if (driver == nullptr || ticket == nullptr)
        {
            return fail(cudaErrorInvalidValue, "%s: driver and ticket are required", fn);
        }
        if (int const status = checkIdShape(fn, numTokens, numCols, idTokenStride))
        {
            return status;
        }
        if (numTokens > 0 && (idsHost == nullptr || out == nullptr || rowsHost == nullptr))
        {
            return fail(cudaErrorInvalidValue, "%s: ids_host, rows_host and out are required", fn);
        }
        if (tableLayout == ENGRAM_LAYOUT_HBM_SCALES)
        {
            return fail(cudaErrorInvalidValue,
                "%s: hbm_scales (2) needs device ids, which a plain job has not: submit a step job "
                "(engram_gather_driver_submit_step) or pass the split layout",
                fn);
        }
        DriverJob job;
        job.ids = idsHost;
        job.numTokens = numTokens;
        job.numCols = numCols;
        job.idTokenStride = idTokenStride;
        job.rows = rowsHost;
        job.scales = scalesHost;
        job.tableNumRows = tableNumRows;
        job.headDim = headDim;
        job.tableDtype = tableDtype;
        job.quantBlock = quantBlock;
        job.tableLayout = tableLayout;
        job.out = out;
        job.stream = stream;
        job.idsReady = idsReady;
        {
            std::lock_guard<std::mutex> lock(driver->mutex);
            if (driver->stop)
            {
                return fail(cudaErrorInvalidValue, "%s: the driver is being destroyed", fn);
            }
            job.ticket = ++driver->submitted;
            driver->queue.push_back(job);
        }
        driver->work.notify_one();
        *ticket = job.ticket;
        return 0;
    }
    ENGRAM_ABI_CATCH("engram_gather_driver_submit")
}

extern "C" ENGRAM_API int engram_gather_driver_submit_step(EngramGatherDriver* driver, EngramHashLayout const* layout,
    int32_t const* cidsHost, int64_t numTokens, int32_t const* seqStartsHost, int64_t numSeqs,
    int32_t const* lookbackHost, int32_t lookbackWidth, int32_t numCols, int32_t* cidsDev, int32_t* seqStartsDev,
    int32_t* lookbackDev, int32_t* rowIdsDev, int32_t* rowIdsHost, int32_t numLayers, EngramDriverTable const* tables,
    void* const* outs, cudaStream_t stream, uint64_t* firstTicket)
{
    clearError();
    ENGRAM_ABI_TRY
    {
        char const* fn = "engram_gather_driver_submit_step";
        if (driver == nullptr || firstTicket == nullptr)
        {
            return fail(cudaErrorInvalidValue, "%s: driver and first_ticket are required", fn);
        }
        if (numTokens < 0 || numSeqs < 0 || numLayers < 1 || numCols < 1 || lookbackWidth < 0)
        {
            return fail(cudaErrorInvalidValue,
                "%s: need num_tokens >= 0, num_seqs >= 0, num_layers >= 1, num_cols >= 1, lookback_width >= 0 (got "
                "%lld, %lld, %d, %d, %d)",
                fn, static_cast<long long>(numTokens), static_cast<long long>(numSeqs), numLayers, numCols,
                lookbackWidth);
        }
        if (tables == nullptr || outs == nullptr)
        {
            return fail(cudaErrorInvalidValue, "%s: tables and outs (one per layer) are required", fn);
        }
        if (numTokens > 0
            && (layout == nullptr || cidsHost == nullptr || seqStartsHost == nullptr || cidsDev == nullptr
                || seqStartsDev == nullptr || rowIdsDev == nullptr || rowIdsHost == nullptr
                || (lookbackHost != nullptr && lookbackDev == nullptr)))
        {
            return fail(cudaErrorInvalidValue,
                "%s: layout, the host ids and seq_starts, their device copies, and both row-id buffers are required "
                "(and lookback_dev with lookback_host)",
                fn);
        }
        DriverJob job;
        job.step = true;
        job.layout = layout;
        job.cidsHost = cidsHost;
        job.numTokens = numTokens;
        job.startsHost = seqStartsHost;
        job.numSeqs = numSeqs;
        job.lookbackHost = lookbackHost;
        job.lookbackWidth = lookbackWidth;
        job.numCols = numCols;
        job.cidsDev = cidsDev;
        job.startsDev = seqStartsDev;
        job.lookbackDev = lookbackDev;
        job.rowIdsDev = rowIdsDev;
        job.rowIdsHost = rowIdsHost;
        job.tables.assign(tables, tables + numLayers);
        job.outs.assign(outs, outs + numLayers);
        job.stream = stream;
        {
            std::lock_guard<std::mutex> lock(driver->mutex);
            if (driver->stop)
            {
                return fail(cudaErrorInvalidValue, "%s: the driver is being destroyed", fn);
            }
            *firstTicket = driver->submitted + 1;
            driver->submitted += static_cast<uint64_t>(numLayers);
            job.ticket = driver->submitted;
            driver->queue.push_back(std::move(job));
        }
        driver->work.notify_one();
        return 0;
    }
    ENGRAM_ABI_CATCH("engram_gather_driver_submit_step")
}

extern "C" ENGRAM_API int engram_gather_driver_wait_stream(
    EngramGatherDriver* driver, uint64_t ticket, cudaStream_t stream)
{
    clearError();
    ENGRAM_ABI_TRY
    {
        char const* fn = "engram_gather_driver_wait_stream";
        if (driver == nullptr)
        {
            return fail(cudaErrorInvalidValue, "%s: driver is NULL", fn);
        }
        {
            std::lock_guard<std::mutex> lock(driver->mutex);
            if (int const bad = checkTicket(fn, *driver, ticket, false))
            {
                return bad;
            }
        }
        CUresult const status
            = memOps().wait(stream, reinterpret_cast<CUdeviceptr>(driver->word), ticket, CU_STREAM_WAIT_VALUE_GEQ);
        if (status != CUDA_SUCCESS)
        {
            return fail(cudaErrorUnknown, "%s: cuStreamWaitValue64 failed (CUresult %d)", fn, static_cast<int>(status));
        }
        return 0;
    }
    ENGRAM_ABI_CATCH("engram_gather_driver_wait_stream")
}

extern "C" ENGRAM_API int engram_gather_driver_finish(EngramGatherDriver* driver, uint64_t ticket)
{
    clearError();
    ENGRAM_ABI_TRY
    {
        char const* fn = "engram_gather_driver_finish";
        if (driver == nullptr)
        {
            return fail(cudaErrorInvalidValue, "%s: driver is NULL", fn);
        }
        std::unique_lock<std::mutex> lock(driver->mutex);
        if (int const bad = checkTicket(fn, *driver, ticket, true))
        {
            return bad;
        }
        driver->done.wait(lock, [&] { return driver->finished >= ticket; });
        if (driver->error != 0 && driver->errorTicket <= ticket)
        {
            int const code = driver->error;
            std::string const message = driver->errorMessage;
            uint64_t const failed = driver->errorTicket;
            driver->error = 0;
            driver->errorTicket = 0;
            driver->errorMessage.clear();
            return fail(static_cast<cudaError_t>(code), "host gather job %llu failed: %s",
                static_cast<unsigned long long>(failed), message.c_str());
        }
        return 0;
    }
    ENGRAM_ABI_CATCH("engram_gather_driver_finish")
}
