/*
 * Host gather: CPU threads gather table rows into pinned staging, one copy per chunk.
 *
 * Why: on the H200 VM (docs/platform.md) random GPU reads of pinned host memory reach
 * about a tenth of the PCIe link, because every 4 KiB page costs the GPU a translation,
 * while one contiguous cudaMemcpyAsync runs at the link's speed. Measured there
 * (docs/benchmarks.md, 24.75 GiB fp8 table in pinned host memory): this path is
 * 3.3-3.5x faster than the UVA kernel for 196,608 rows (an 8k-token prefill chunk) and
 * 1.5-2x for 6,144 rows (a decode step), over two runs; the CPU side, not the link, is
 * its limit.
 *
 * Pipeline (two staging slots): gather chunk k into pinned slot k%2 (all pool threads),
 * enqueue its copy into device slot k%2 and the dequant kernel (the gather kernel with
 * identity ids) into `out`, record the slot's event; then gather chunk k+1 while the
 * copy of chunk k runs. Before a slot is refilled its event is waited for, so a pinned
 * slot is never overwritten while a copy still reads it; device slots are reused in
 * stream order. bf16 chunks are copied straight into `out`.
 */
#include "kernels/engramKernels.h"
#include "kernels/engramKernelsInternal.h"
#include "threadPool.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>

using namespace engram_trt::kernels;

struct EngramHostGatherer
{
    static constexpr int kSlots = 2;

    int device{0};
    int64_t chunkRows{0};
    int64_t slotBytes{0}; // bytes of one staging slot (rows + scales of chunkRows rows)
    uint8_t* pinned[kSlots]{};
    uint8_t* deviceStaging[kSlots]{};
    cudaEvent_t slotFree[kSlots]{};
    ThreadPool* pool{nullptr};
    std::mutex callMutex;

    ~EngramHostGatherer()
    {
        delete pool;
        for (int s = 0; s < kSlots; ++s)
        {
            if (slotFree[s] != nullptr)
            {
                cudaEventSynchronize(slotFree[s]);
                cudaEventDestroy(slotFree[s]);
            }
            if (pinned[s] != nullptr)
            {
                cudaFreeHost(pinned[s]);
            }
            if (deviceStaging[s] != nullptr)
            {
                cudaFree(deviceStaging[s]);
            }
        }
    }
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

//! Copies rows [begin, end) of the flattened (token, col) list into staging.
void gatherRange(int32_t const* idsHost, int32_t numCols, int64_t idTokenStride, int64_t rowOffset, int64_t begin,
    int64_t end, uint8_t const* rowsHost, uint8_t const* scalesHost, int64_t tableNumRows, int64_t rowBytes,
    int64_t scaleBytes, uint8_t* stagingRows, uint8_t* stagingScales)
{
    // Rows are random in a table of many GiB: each costs a TLB miss and a DRAM miss, and
    // so does its scale bytes (a separate array). Prefetching both a few rows ahead keeps
    // several misses in flight per thread.
    constexpr int64_t kPrefetchAhead = 16;
    auto idOf = [&](int64_t r) {
        int64_t const global = rowOffset + r;
        int64_t const t = global / numCols;
        return static_cast<int64_t>(idsHost[t * idTokenStride + (global - t * numCols)]);
    };
    for (int64_t r = begin; r < end; ++r)
    {
        if (r + kPrefetchAhead < end)
        {
            int64_t const ahead = idOf(r + kPrefetchAhead);
            if (ahead >= 0 && ahead < tableNumRows)
            {
                uint8_t const* src = rowsHost + ahead * rowBytes;
                for (int64_t line = 0; line < rowBytes; line += 64)
                {
                    __builtin_prefetch(src + line);
                }
                if (scaleBytes > 0)
                {
                    __builtin_prefetch(scalesHost + ahead * scaleBytes);
                }
            }
        }
        int64_t const id = idOf(r);
        uint8_t* dstRow = stagingRows + r * rowBytes;
        if (id >= 0 && id < tableNumRows)
        {
            std::memcpy(dstRow, rowsHost + id * rowBytes, rowBytes);
            if (scaleBytes > 0)
            {
                std::memcpy(stagingScales + r * scaleBytes, scalesHost + id * scaleBytes, scaleBytes);
            }
        }
        else
        {
            // Out-of-range ids read as zero rows, as in the GPU gather (fp8 zero * any scale = 0).
            std::memset(dstRow, 0, rowBytes);
            if (scaleBytes > 0)
            {
                std::memset(stagingScales + r * scaleBytes, 127, scaleBytes);
            }
        }
    }
}

} // namespace kernels
} // namespace engram_trt

extern "C" ENGRAM_API int engram_host_gatherer_create(
    int32_t numThreads, int64_t chunkRows, int32_t maxHeadDim, EngramHostGatherer** gatherer)
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
        if (numThreads <= 0)
        {
            numThreads = static_cast<int32_t>(std::max(1u, std::thread::hardware_concurrency()));
        }

        // Owned here until it is complete: every failure below (an exception too) frees it.
        std::unique_ptr<EngramHostGatherer> g(new EngramHostGatherer());
        cudaError_t const deviceStatus = cudaGetDevice(&g->device);
        if (deviceStatus != cudaSuccess)
        {
            return failCuda(deviceStatus, "engram_host_gatherer_create: cudaGetDevice failed: %s",
                cudaGetErrorString(deviceStatus));
        }
        g->chunkRows = chunkRows;
        // A bf16 row (2 bytes per element) is the widest form; an fp8 row plus its scale
        // bytes (head_dim + head_dim / 16 at most) fits in it.
        g->slotBytes = chunkRows * 2 * static_cast<int64_t>(maxHeadDim);
        for (int s = 0; s < EngramHostGatherer::kSlots; ++s)
        {
            cudaError_t status
                = cudaHostAlloc(reinterpret_cast<void**>(&g->pinned[s]), g->slotBytes, cudaHostAllocPortable);
            if (status == cudaSuccess)
            {
                status = cudaMalloc(reinterpret_cast<void**>(&g->deviceStaging[s]), g->slotBytes);
            }
            if (status == cudaSuccess)
            {
                status = cudaEventCreateWithFlags(&g->slotFree[s], cudaEventDisableTiming);
            }
            if (status != cudaSuccess)
            {
                return failCuda(status, "engram_host_gatherer_create: staging allocation failed: %s",
                    cudaGetErrorString(status));
            }
        }
        g->pool = new ThreadPool(numThreads - 1); // throws if a thread cannot start (caught below)
        *gatherer = g.release();
        return 0;
    }
    ENGRAM_ABI_CATCH("engram_host_gatherer_create")
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

extern "C" ENGRAM_API int engram_host_gather(EngramHostGatherer* gatherer, int32_t const* idsHost, int64_t numTokens,
    int32_t numCols, int64_t idTokenStride, void const* rowsHost, void const* scalesHost, int64_t tableNumRows,
    int32_t headDim, int32_t tableDtype, int32_t quantBlock, void* out, cudaStream_t stream)
{
    clearError();
    ENGRAM_ABI_TRY
    {
        if (gatherer == nullptr)
        {
            return fail(cudaErrorInvalidValue, "engram_host_gather: gatherer is NULL");
        }
        EngramHostGatherer& g = *gatherer;
        // Taken first: the gatherer's fields and staging belong to one call at a time, and
        // engram_host_gatherer_destroy waits on the same lock.
        std::lock_guard<std::mutex> callLock(g.callMutex);
        int64_t rowBytes = 0;
        int64_t scaleBytes = 0;
        if (int const status = validateGatherArgs("engram_host_gather", numTokens, numCols, idTokenStride, tableNumRows,
                headDim, tableDtype, quantBlock, out, rowBytes, scaleBytes))
        {
            return status;
        }
        if ((rowBytes + scaleBytes) * g.chunkRows > g.slotBytes)
        {
            return fail(cudaErrorInvalidValue,
                "engram_host_gather: head_dim %d is wider than the gatherer's max_head_dim", headDim);
        }
        int64_t const totalRows = numTokens * numCols;
        if (totalRows == 0)
        {
            return 0;
        }
        if (idsHost == nullptr || (tableNumRows > 0 && rowsHost == nullptr)
            || (tableNumRows > 0 && scaleBytes > 0 && scalesHost == nullptr))
        {
            return fail(cudaErrorInvalidValue, "engram_host_gather: ids, rows (and scales for fp8) are required");
        }

        DeviceGuard deviceGuard(g.device);
        if (deviceGuard.status() != cudaSuccess)
        {
            return failCuda(deviceGuard.status(),
                "engram_host_gather: cannot make the gatherer's device %d current: %s", g.device,
                cudaGetErrorString(deviceGuard.status()));
        }
        bool const fp8 = tableDtype == ENGRAM_TABLE_FP8_E4M3;
        auto const* rows = static_cast<uint8_t const*>(rowsHost);
        auto const* scales = static_cast<uint8_t const*>(scalesHost);
        auto* outBytes = static_cast<uint8_t*>(out);
        int64_t const outRowBytes = 2 * static_cast<int64_t>(headDim);

        // Device slots were last used by work on another stream, possibly: order after it.
        for (int s = 0; s < EngramHostGatherer::kSlots; ++s)
        {
            cudaError_t const status = cudaStreamWaitEvent(stream, g.slotFree[s], 0);
            if (status != cudaSuccess)
            {
                return failCuda(
                    status, "engram_host_gather: cudaStreamWaitEvent failed: %s", cudaGetErrorString(status));
            }
        }

        int64_t const numChunks = (totalRows + g.chunkRows - 1) / g.chunkRows;
        for (int64_t chunk = 0; chunk < numChunks; ++chunk)
        {
            int const slot = static_cast<int>(chunk % EngramHostGatherer::kSlots);
            int64_t const first = chunk * g.chunkRows;
            int64_t const count = std::min(g.chunkRows, totalRows - first);

            cudaError_t status = cudaEventSynchronize(g.slotFree[slot]);
            if (status != cudaSuccess)
            {
                return failCuda(status, "engram_host_gather: waiting for a staging slot failed: %s",
                    cudaGetErrorString(status));
            }
            uint8_t* stagingRows = g.pinned[slot];
            uint8_t* stagingScales = g.pinned[slot] + count * rowBytes;
            // About four tasks per thread balance the pool without making the counter hot.
            int64_t const rowsPerTask = std::max<int64_t>(64, count / (4 * g.pool->numThreads()) + 1);
            int64_t const tasks = (count + rowsPerTask - 1) / rowsPerTask;
            g.pool->parallelFor(tasks, [&](int64_t task) {
                int64_t const begin = task * rowsPerTask;
                int64_t const end = std::min(count, begin + rowsPerTask);
                gatherRange(idsHost, numCols, idTokenStride, first, begin, end, rows, scales, tableNumRows, rowBytes,
                    scaleBytes, stagingRows, stagingScales);
            });

            int64_t const chunkBytes = count * (rowBytes + scaleBytes);
            uint8_t* destination = fp8 ? g.deviceStaging[slot] : outBytes + first * outRowBytes;
            status = cudaMemcpyAsync(destination, stagingRows, chunkBytes, cudaMemcpyHostToDevice, stream);
            if (status != cudaSuccess)
            {
                return failCuda(status, "engram_host_gather: cudaMemcpyAsync failed: %s", cudaGetErrorString(status));
            }
            if (fp8)
            {
                int const launched = launchGather(nullptr, count, 1, 1, g.deviceStaging[slot],
                    g.deviceStaging[slot] + count * rowBytes, nullptr, nullptr, count, headDim, tableDtype, quantBlock,
                    outBytes + first * outRowBytes, stream);
                if (launched != 0)
                {
                    return launched;
                }
            }
            status = cudaEventRecord(g.slotFree[slot], stream);
            if (status != cudaSuccess)
            {
                return failCuda(status, "engram_host_gather: cudaEventRecord failed: %s", cudaGetErrorString(status));
            }
        }
        return 0;
    }
    ENGRAM_ABI_CATCH("engram_host_gather")
}
