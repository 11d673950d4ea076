// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * A small fork-join pool for the host gather.
 *
 * The host gather runs one round per call (tens of microseconds to a few milliseconds
 * of work), so wake-up latency matters; but the pool must not take a node's CPUs from
 * other ranks while idle. So a worker spins for a bounded time (spinMicros, 50 us by
 * default, settable) watching an atomic generation counter, then blocks on a condition
 * variable; the caller only touches the mutex when a worker sleeps. The caller takes part
 * in the work: a pool of n threads runs n - 1 workers. wake() (a round is coming) makes
 * sleeping workers spin again and restarts the spin of spinning ones, so a wake issued
 * while they still spin after the last round keeps them spinning spinMicros from then.
 *
 * Size: defaultThreadCount() is the number of CPUs in the calling thread's affinity mask
 * (sched_getaffinity), which is what a rank launched with a CPU list (taskset, numactl,
 * a job scheduler) may use; std::thread::hardware_concurrency() would count the whole
 * machine and oversubscribe a node shared by several ranks.
 *
 * Round protocol (why parallelFor never returns while a worker can still reach the
 * caller's body): the caller publishes the body, marks the round open (mOpenRound = g)
 * and bumps the generation to g. A worker that sees generation g counts itself active
 * and only then checks that round g is still open; the caller closes the round
 * (mOpenRound = 0) and waits until no worker is active. Both sides use sequentially
 * consistent operations, so either the worker sees the round closed (and never touches
 * the body) or the caller sees it active (and waits for it to leave). The body is
 * published for the next round only after that wait, so a late worker can never read a
 * half-written or destroyed body.
 */
#ifndef ENGRAM_TRT_THREAD_POOL_H
#define ENGRAM_TRT_THREAD_POOL_H

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <sched.h>
#endif

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

//! CPUs in the calling thread's affinity mask (threads it starts inherit the mask), at
//! least 1; std::thread::hardware_concurrency() where the mask cannot be read.
inline int defaultThreadCount()
{
#if defined(__linux__)
    // Masks wider than CPU_SETSIZE (1024 CPUs) need a dynamically sized set.
    for (int cpus = CPU_SETSIZE; cpus <= (1 << 16); cpus *= 2)
    {
        cpu_set_t* set = CPU_ALLOC(cpus);
        if (set == nullptr)
        {
            break;
        }
        size_t const bytes = CPU_ALLOC_SIZE(cpus);
        CPU_ZERO_S(bytes, set);
        int const status = sched_getaffinity(0, bytes, set);
        int const count = status == 0 ? CPU_COUNT_S(bytes, set) : 0;
        CPU_FREE(set);
        if (count > 0)
        {
            return count;
        }
        if (status == 0)
        {
            break; // an empty mask: fall back below
        }
    }
#endif
    unsigned const n = std::thread::hardware_concurrency();
    return n > 0 ? static_cast<int>(n) : 1;
}

//! Waits politely: pause instructions first, then yields the CPU once `spins` is large.
//! A host gatherer's default pool size: one less than defaultThreadCount(), at least 1.
//! Why not all of them: the pool's rounds are fork-join, so one worker preempted by any
//! other runnable thread (the engine thread launching the model, the CUDA driver's own
//! threads, the OS) stalls its whole round. On the H200 VM a 15-thread pool beat the
//! 16-thread one on a prefill chunk's 196,608 rows in each of six machine starts (by
//! 0.3-9%, and 3.4x on a start with run-queue waits: docs/benchmarks.md).
inline int defaultGatherThreads()
{
    int const cpus = defaultThreadCount();
    return cpus > 1 ? cpus - 1 : 1;
}

inline void backoff(int64_t spins)
{
    if (spins < 4096)
    {
        ENGRAM_CPU_RELAX();
    }
    else
    {
        std::this_thread::yield();
    }
}

class ThreadPool
{
public:
    static constexpr int64_t kDefaultSpinMicros = 50;

    //! numThreads counts the caller: numThreads - 1 workers are started (none for 1).
    //! Throws (std::system_error, std::bad_alloc) if a worker cannot be started; the
    //! workers started before that are stopped and joined first, since destroying a
    //! joinable std::thread would terminate the process.
    explicit ThreadPool(int numThreads, int64_t spinMicros = kDefaultSpinMicros)
        : mSpinMicros(spinMicros < 0 ? 0 : spinMicros)
    {
        int const workers = numThreads > 1 ? numThreads - 1 : 0;
        mWorkers.reserve(static_cast<size_t>(workers));
        try
        {
            for (int i = 0; i < workers; ++i)
            {
                mWorkers.emplace_back([this, i] { workerLoop(i + 1); });
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

    //! Threads that run a round's work, the caller included.
    int numThreads() const
    {
        return static_cast<int>(mWorkers.size()) + 1;
    }

    //! How long an idle worker spins before it blocks (0: block at once).
    void setSpinMicros(int64_t micros)
    {
        mSpinMicros.store(micros < 0 ? 0 : micros, std::memory_order_relaxed);
    }

    int64_t spinMicros() const
    {
        return mSpinMicros.load(std::memory_order_relaxed);
    }

    //! Workers asleep right now (for tests and diagnostics).
    int sleepingWorkers() const
    {
        return mSleepers.load(std::memory_order_relaxed);
    }

    //! Makes sleeping workers spin again for spinMicros, and spinning ones spin spinMicros
    //! from now, so that a round expected soon (the ids of a step are on their way) does
    //! not pay their wake-up.
    void wake()
    {
        mWakeSeq.fetch_add(1, std::memory_order_seq_cst);
        if (mSleepers.load(std::memory_order_seq_cst) > 0)
        {
            std::lock_guard<std::mutex> lock(mMutex);
        }
        mStart.notify_all();
    }

    //! Runs workerBody(thread) on each worker that joins the round (thread = 1 ..
    //! numThreads() - 1) while the calling thread runs callerBody(). Returns after
    //! callerBody has returned and every worker has left workerBody. A worker that has
    //! not joined by then skips the round, so workerBody must only take work from a
    //! shared queue, and callerBody must itself wait for the work it needs finished.
    //! workerBody must not throw; callerBody may (the round is closed first). One
    //! caller at a time (calls are serialized).
    template <typename WorkerBody, typename CallerBody>
    void run(WorkerBody& workerBody, CallerBody&& callerBody)
    {
        std::lock_guard<std::mutex> callLock(mCallMutex);
        if (mWorkers.empty())
        {
            callerBody();
            return;
        }
        mBody = &workerBody;
        mInvoke = [](void* body, int thread) { (*static_cast<WorkerBody*>(body))(thread); };
        uint64_t const generation = mGeneration.load(std::memory_order_relaxed) + 1;
        mOpenRound.store(generation, std::memory_order_seq_cst);
        mGeneration.store(generation, std::memory_order_seq_cst);
        if (mSleepers.load(std::memory_order_seq_cst) > 0)
        {
            // A sleeper is in mStart.wait() or about to re-check the generation under the
            // lock: taking the lock once orders this notify after its check.
            std::lock_guard<std::mutex> lock(mMutex);
        }
        mStart.notify_all();

        struct RoundCloser
        {
            ThreadPool& pool;
            ~RoundCloser()
            {
                pool.mOpenRound.store(0, std::memory_order_seq_cst);
                for (int64_t spins = 0; pool.mActive.load(std::memory_order_seq_cst) != 0; ++spins)
                {
                    backoff(spins);
                }
            }
        } closer{*this};
        callerBody();
    }

    //! Runs task(i) for every i in [0, numTasks) on the pool and the calling thread
    //! (dynamically claimed); returns when all have finished and no worker can touch
    //! `task` any more. task must not throw.
    template <typename Task>
    void parallelFor(int64_t numTasks, Task&& task)
    {
        if (numTasks <= 0)
        {
            return;
        }
        std::atomic<int64_t> next{0};
        std::atomic<int64_t> done{0};
        auto body = [&](int /*thread*/) {
            for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < numTasks;
                i = next.fetch_add(1, std::memory_order_relaxed))
            {
                task(i);
                done.fetch_add(1, std::memory_order_release);
            }
        };
        run(body, [&] {
            body(0);
            for (int64_t spins = 0; done.load(std::memory_order_acquire) < numTasks; ++spins)
            {
                backoff(spins);
            }
        });
    }

private:
    void stopAndJoin()
    {
        {
            std::lock_guard<std::mutex> lock(mMutex);
            mStop.store(true, std::memory_order_seq_cst);
            mGeneration.fetch_add(1, std::memory_order_seq_cst);
        }
        mStart.notify_all();
        for (std::thread& worker : mWorkers)
        {
            worker.join();
        }
        mWorkers.clear();
    }

    void workerLoop(int thread)
    {
        uint64_t seen = 0;
        while (true)
        {
            // Spin for a bounded time (restarted by a wake()), then block until a new round
            // (or a wake()).
            auto spinUntil = std::chrono::steady_clock::now()
                + std::chrono::microseconds(mSpinMicros.load(std::memory_order_relaxed));
            uint64_t wakeSeq = mWakeSeq.load(std::memory_order_seq_cst);
            bool idle = true;
            for (int64_t i = 0;; ++i)
            {
                if (mGeneration.load(std::memory_order_acquire) != seen)
                {
                    idle = false;
                    break;
                }
                ENGRAM_CPU_RELAX();
                if ((i & 63) == 0)
                {
                    auto const now = std::chrono::steady_clock::now();
                    uint64_t const woken = mWakeSeq.load(std::memory_order_relaxed);
                    if (woken != wakeSeq)
                    {
                        wakeSeq = woken;
                        spinUntil = now + std::chrono::microseconds(mSpinMicros.load(std::memory_order_relaxed));
                    }
                    else if (now >= spinUntil)
                    {
                        break;
                    }
                }
            }
            if (idle)
            {
                // A wake() since the spin last looked (wakeSeq) ends the wait at once: the
                // worker spins again instead of sleeping through it.
                std::unique_lock<std::mutex> lock(mMutex);
                mSleepers.fetch_add(1, std::memory_order_seq_cst);
                mStart.wait(lock, [&] {
                    return mGeneration.load(std::memory_order_seq_cst) != seen
                        || mWakeSeq.load(std::memory_order_seq_cst) != wakeSeq;
                });
                mSleepers.fetch_sub(1, std::memory_order_seq_cst);
                if (mGeneration.load(std::memory_order_seq_cst) == seen)
                {
                    continue; // woken by wake(): spin again
                }
            }
            if (mStop.load(std::memory_order_seq_cst))
            {
                return;
            }
            uint64_t const generation = mGeneration.load(std::memory_order_seq_cst);
            seen = generation;
            mActive.fetch_add(1, std::memory_order_seq_cst);
            if (mOpenRound.load(std::memory_order_seq_cst) == generation)
            {
                mInvoke(mBody, thread);
            }
            mActive.fetch_sub(1, std::memory_order_seq_cst);
        }
    }

    std::vector<std::thread> mWorkers;
    std::mutex mCallMutex; // one caller at a time
    std::mutex mMutex;     // sleeping workers
    std::condition_variable mStart;
    void* mBody{nullptr};
    void (*mInvoke)(void*, int){nullptr};
    std::atomic<uint64_t> mGeneration{0};
    std::atomic<uint64_t> mOpenRound{0};
    std::atomic<uint64_t> mWakeSeq{0};
    std::atomic<int> mActive{0};
    std::atomic<int> mSleepers{0};
    std::atomic<int64_t> mSpinMicros;
    std::atomic<bool> mStop{false};
};

} // namespace kernels
} // namespace engram_trt

#endif // ENGRAM_TRT_THREAD_POOL_H
