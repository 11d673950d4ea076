/*
 * A small fork-join pool for the host gather.
 *
 * The host gather calls parallelFor once per chunk (tens of microseconds of work), so
 * wake-up latency matters more than idle CPU: workers spin for a short while
 * (kSpinMicros) watching an atomic generation counter before they sleep on a condition
 * variable, and the caller waits for the chunk's tasks by spinning, not by sleeping.
 * The caller takes part in the work, so a pool of n workers runs n + 1 threads.
 *
 * Correctness of reuse: a worker captures (task, task count) under the lock and counts
 * itself active; parallelFor sets up a new round only under the lock with no worker
 * active, and resets the task count to 0 when a round ends, so a worker that wakes late
 * never runs a finished round's task.
 */
#ifndef ENGRAM_TRT_THREAD_POOL_H
#define ENGRAM_TRT_THREAD_POOL_H

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define ENGRAM_CPU_RELAX() _mm_pause()
#else
#define ENGRAM_CPU_RELAX() std::this_thread::yield()
#endif

namespace engram_trt
{
namespace kernels
{

class ThreadPool
{
public:
    static constexpr int64_t kSpinMicros = 200;

    //! Throws (std::system_error, std::bad_alloc) if a worker cannot be started; the
    //! workers started before that are stopped and joined first, since destroying a
    //! joinable std::thread would terminate the process.
    explicit ThreadPool(int numWorkers)
    {
        mWorkers.reserve(static_cast<size_t>(numWorkers > 0 ? numWorkers : 0));
        try
        {
            for (int i = 0; i < numWorkers; ++i)
            {
                mWorkers.emplace_back([this] { workerLoop(); });
            }
        }
        catch (...)
        {
            stopAndJoin();
            throw;
        }
    }

    ~ThreadPool()
    {
        stopAndJoin();
    }

    ThreadPool(ThreadPool const&) = delete;
    ThreadPool& operator=(ThreadPool const&) = delete;

    int numThreads() const
    {
        return static_cast<int>(mWorkers.size()) + 1;
    }

    //! Runs task(i) for every i in [0, numTasks) on the pool and the calling thread;
    //! returns when all have finished. One caller at a time.
    void parallelFor(int64_t numTasks, std::function<void(int64_t)> const& task)
    {
        while (true)
        {
            std::unique_lock<std::mutex> lock(mMutex);
            if (mActive.load(std::memory_order_acquire) == 0)
            {
                mTask = &task;
                mNumTasks = numTasks;
                mNext.store(0, std::memory_order_relaxed);
                mDone.store(0, std::memory_order_relaxed);
                mGeneration.fetch_add(1, std::memory_order_release);
                break;
            }
            lock.unlock();
            ENGRAM_CPU_RELAX();
        }
        mStart.notify_all();
        runTasks(task, numTasks);
        while (mDone.load(std::memory_order_acquire) < numTasks)
        {
            ENGRAM_CPU_RELAX();
        }
        std::lock_guard<std::mutex> lock(mMutex);
        mTask = nullptr;
        mNumTasks = 0;
    }

private:
    void stopAndJoin()
    {
        {
            std::lock_guard<std::mutex> lock(mMutex);
            mStop = true;
            mGeneration.fetch_add(1, std::memory_order_release);
        }
        mStart.notify_all();
        for (std::thread& worker : mWorkers)
        {
            worker.join();
        }
    }

    void runTasks(std::function<void(int64_t)> const& task, int64_t numTasks)
    {
        for (int64_t i = mNext.fetch_add(1, std::memory_order_relaxed); i < numTasks;
             i = mNext.fetch_add(1, std::memory_order_relaxed))
        {
            task(i);
            mDone.fetch_add(1, std::memory_order_release);
        }
    }

    void workerLoop()
    {
        uint64_t seen = 0;
        while (true)
        {
            auto const spinUntil = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinMicros);
            for (int i = 0; mGeneration.load(std::memory_order_acquire) == seen; ++i)
            {
                ENGRAM_CPU_RELAX();
                if ((i & 63) == 0 && std::chrono::steady_clock::now() > spinUntil)
                {
                    break;
                }
            }
            std::function<void(int64_t)> const* task = nullptr;
            int64_t numTasks = 0;
            {
                std::unique_lock<std::mutex> lock(mMutex);
                mStart.wait(lock, [&] { return mGeneration.load(std::memory_order_acquire) != seen; });
                if (mStop)
                {
                    return;
                }
                seen = mGeneration.load(std::memory_order_acquire);
                task = mTask;
                numTasks = mNumTasks;
                mActive.fetch_add(1, std::memory_order_acq_rel);
            }
            if (task != nullptr)
            {
                runTasks(*task, numTasks);
            }
            mActive.fetch_sub(1, std::memory_order_acq_rel);
        }
    }

    std::vector<std::thread> mWorkers;
    std::mutex mMutex;
    std::condition_variable mStart;
    std::function<void(int64_t)> const* mTask{nullptr};
    int64_t mNumTasks{0};
    std::atomic<uint64_t> mGeneration{0};
    std::atomic<int64_t> mNext{0};
    std::atomic<int64_t> mDone{0};
    std::atomic<int> mActive{0};
    bool mStop{false};
};

} // namespace kernels
} // namespace engram_trt

#endif // ENGRAM_TRT_THREAD_POOL_H
