// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * CPU unit test of the host gather's CUDA-free parts: the thread pool (threadPool.h) and
 * the row copy loop (rowGather.h). Built by CMake with -DENGRAM_TRT_BUILD_TESTS=ON
 * (ctest), and by tests/kernels/test_host_gather_cpu.py with ThreadSanitizer where the compiler
 * has it, which is what catches a pool that lets a worker touch a finished round.
 * Prints one line per check; exits 1 if any failed.
 */
#include "rowGather.h"
#include "threadPool.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <thread>
#include <vector>

using namespace engram_trt::kernels;

namespace
{
int gFailures = 0;

void check(bool ok, char const* what)
{
    std::printf("[%s] %s\n", ok ? "PASS" : "FAIL", what);
    if (!ok)
    {
        ++gFailures;
    }
}

void testParallelForCoversEveryTaskOnce()
{
    for (int threads : {1, 2, 5})
    {
        ThreadPool pool(threads);
        bool ok = true;
        for (int64_t n : {0, 1, 7, 1000, 100000})
        {
            std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
            for (auto& h : hits)
            {
                h.store(0);
            }
            pool.parallelFor(n, [&](int64_t i) { hits[static_cast<size_t>(i)].fetch_add(1); });
            for (auto& h : hits)
            {
                ok = ok && h.load() == 1;
            }
        }
        char what[96];
        std::snprintf(what, sizeof(what), "parallelFor runs every task exactly once (%d threads)", threads);
        check(ok, what);
    }
}

void testTaskObjectMayDieRightAfterReturn()
{
    // Each round's task lives on the heap and is freed the moment parallelFor returns; a
    // worker still holding it would be a use-after-free (ThreadSanitizer / ASan see it).
    ThreadPool pool(4, /*spinMicros=*/0);
    int64_t total = 0;
    for (int round = 0; round < 2000; ++round)
    {
        auto counter = std::make_unique<std::atomic<int64_t>>(0);
        auto task = std::make_unique<std::function<void(int64_t)>>([c = counter.get()](int64_t) { c->fetch_add(1); });
        pool.parallelFor(round % 3, *task);
        task.reset();
        total += counter->load();
    }
    int64_t expected = 0;
    for (int round = 0; round < 2000; ++round)
    {
        expected += round % 3;
    }
    check(total == expected, "2000 short rounds: every task ran, none after its round");
}

void testWorkersBlockAfterSpinning()
{
    ThreadPool pool(4, /*spinMicros=*/100);
    std::atomic<int> n{0};
    pool.parallelFor(64, [&](int64_t) { n.fetch_add(1); });
    bool slept = false;
    for (int i = 0; i < 500 && !slept; ++i)
    {
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
        slept = pool.sleepingWorkers() == pool.numThreads() - 1;
    }
    check(slept, "idle workers stop spinning and block after spin_us");
    pool.parallelFor(64, [&](int64_t) { n.fetch_add(1); });
    check(n.load() == 128, "blocked workers wake for the next round");
    slept = false;
    for (int i = 0; i < 500 && !slept; ++i)
    {
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
        slept = pool.sleepingWorkers() == pool.numThreads() - 1;
    }
    // A long spin after the wake, so that a loaded machine cannot hide it between polls.
    pool.setSpinMicros(5000000);
    pool.wake();
    bool spinning = false;
    for (int i = 0; i < 5000 && !spinning; ++i)
    {
        spinning = pool.sleepingWorkers() < pool.numThreads() - 1;
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    check(slept && spinning, "wake() makes sleeping workers spin again");
    pool.setSpinMicros(0);
}

void testWakeRestartsASpin()
{
    // Workers spin 1.5 s after a round; a wake() 1 s in restarts their spin, so at 2 s
    // (past the round's deadline, before the wake's) none sleeps; then they block.
    ThreadPool pool(4, /*spinMicros=*/1500000);
    std::atomic<int> n{0};
    pool.parallelFor(64, [&](int64_t) { n.fetch_add(1); });
    std::this_thread::sleep_for(std::chrono::milliseconds(1000));
    pool.wake();
    std::this_thread::sleep_for(std::chrono::milliseconds(1000));
    bool const spinning = pool.sleepingWorkers() == 0;
    bool slept = false;
    for (int i = 0; i < 2500 && !slept; ++i)
    {
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
        slept = pool.sleepingWorkers() == pool.numThreads() - 1;
    }
    check(n.load() == 64 && spinning && slept, "wake() restarts the spin of spinning workers, which then block");
    pool.setSpinMicros(0);
}

void testRunWaitsForWorkersToLeave()
{
    ThreadPool pool(6, 1000);
    bool ok = true;
    for (int round = 0; round < 200; ++round)
    {
        std::atomic<int> inside{0};
        std::atomic<int64_t> next{0};
        auto body = [&](int) {
            inside.fetch_add(1);
            while (next.fetch_add(1) < 64)
            {
            }
            inside.fetch_sub(1);
        };
        pool.run(body, [&] { body(0); });
        ok = ok && inside.load() == 0;
    }
    check(ok, "run() returns only when no worker is inside the body");
}

void testSpinSetting()
{
    ThreadPool pool(2, 7);
    bool ok = pool.spinMicros() == 7;
    pool.setSpinMicros(-5);
    ok = ok && pool.spinMicros() == 0;
    check(ok && pool.numThreads() == 2, "spin setting and thread count");
    check(defaultThreadCount() >= 1, "defaultThreadCount() >= 1");
}

//! The naive reference: row ids[i] of a split or inline table, or a zero row.
void referenceGather(
    std::vector<int32_t> const& ids, RowTable const& t, std::vector<uint8_t>& rows, std::vector<uint8_t>& scales)
{
    rows.assign(ids.size() * static_cast<size_t>(t.rowBytes), 0);
    scales.assign(ids.size() * static_cast<size_t>(t.scaleBytes), kZeroRowScale);
    for (size_t i = 0; i < ids.size(); ++i)
    {
        int64_t const id = ids[i];
        if (id < 0 || id >= t.numRows)
        {
            continue;
        }
        for (int64_t b = 0; b < t.rowBytes; ++b)
        {
            rows[i * t.rowBytes + b] = t.rows[id * t.pitch() + b];
        }
        for (int64_t b = 0; b < t.scaleBytes; ++b)
        {
            scales[i * t.scaleBytes + b]
                = t.inlineScales ? t.rows[id * t.pitch() + t.rowBytes + b] : t.scales[id * t.scaleBytes + b];
        }
    }
}

void testRowGather()
{
    std::mt19937_64 rng(12345);
    int64_t const numRows = 5000;
    bool allOk = true;
    for (int64_t rowBytes : {256, 64, 128 * 2})
    {
        for (int64_t scaleBytes : {int64_t{0}, rowBytes / 32, rowBytes / 16})
        {
            for (bool inlineLayout : {false, true})
            {
                std::vector<uint8_t> split(static_cast<size_t>(numRows * rowBytes));
                std::vector<uint8_t> splitScales(static_cast<size_t>(numRows * scaleBytes));
                for (auto& b : split)
                {
                    b = static_cast<uint8_t>(rng());
                }
                for (auto& b : splitScales)
                {
                    b = static_cast<uint8_t>(rng());
                }
                std::vector<uint8_t> inl(static_cast<size_t>(numRows * (rowBytes + scaleBytes)));
                for (int64_t r = 0; r < numRows; ++r)
                {
                    std::memcpy(&inl[r * (rowBytes + scaleBytes)], &split[r * rowBytes], rowBytes);
                    std::memcpy(&inl[r * (rowBytes + scaleBytes) + rowBytes], &splitScales[r * scaleBytes], scaleBytes);
                }
                RowTable t;
                t.numRows = numRows;
                t.rowBytes = rowBytes;
                t.scaleBytes = scaleBytes;
                t.inlineScales = inlineLayout && scaleBytes > 0;
                t.rows = t.inlineScales ? inl.data() : split.data();
                t.scales = splitScales.data();
                std::vector<int32_t> ids(3001);
                for (auto& id : ids)
                {
                    id = static_cast<int32_t>(rng() % (numRows + 40)) - 20; // some out of range both sides
                }
                std::vector<uint8_t> refRows;
                std::vector<uint8_t> refScales;
                referenceGather(ids, t, refRows, refScales);
                for (int prefetch : {0, 3, 8, 64})
                {
                    for (bool stream : {false, true})
                    {
                        // 64-byte aligned destination (the staging slots' alignment), and an
                        // odd one, where streaming stores must fall back to plain ones.
                        for (int misalign : {0, 8})
                        {
                            std::vector<uint8_t> buf(refRows.size() + 64 + 16);
                            auto base = reinterpret_cast<uintptr_t>(buf.data());
                            uint8_t* dst = buf.data() + ((64 - base % 64) % 64) + misalign;
                            std::vector<uint8_t> dstScales(refScales.size() + 1, 0xEE);
                            ThreadPool pool(3);
                            RowIds rowIds{ids.data(), 1, 1};
                            GatherTuning tuning;
                            tuning.prefetchRows = prefetch;
                            tuning.prefetchFarRows = prefetch == 8 ? 24 : 0;
                            tuning.prefetchLocality = prefetch % 4;
                            tuning.streamingStores = stream;
                            int64_t const taskRows = 97;
                            int64_t const n = static_cast<int64_t>(ids.size());
                            pool.parallelFor((n + taskRows - 1) / taskRows, [&](int64_t task) {
                                int64_t const b = task * taskRows;
                                int64_t const e = std::min(n, b + taskRows);
                                gatherRows(
                                    rowIds, b, e, t, dst + b * rowBytes, dstScales.data() + b * scaleBytes, tuning);
                            });
                            bool const ok = std::memcmp(dst, refRows.data(), refRows.size()) == 0
                                && std::memcmp(dstScales.data(), refScales.data(), refScales.size()) == 0
                                && dstScales.back() == 0xEE;
                            allOk = allOk && ok;
                            if (!ok)
                            {
                                std::printf(
                                    "  mismatch: row %lld B scales %lld B inline %d prefetch %d stream %d misalign "
                                    "%d\n",
                                    static_cast<long long>(rowBytes), static_cast<long long>(scaleBytes),
                                    inlineLayout ? 1 : 0, prefetch, stream ? 1 : 0, misalign);
                            }
                        }
                    }
                }
            }
        }
    }
    check(allOk,
        "row gather == reference (split / inline, prefetch 0-64 near / far, localities, plain / streaming stores, "
        "out-of-range ids)");
}

void testStridedIds()
{
    // ids of one layer inside [T, L, cols] hash output: token stride L * cols.
    int64_t const numRows = 100;
    int64_t const rowBytes = 32;
    std::vector<uint8_t> table(static_cast<size_t>(numRows * rowBytes));
    for (size_t i = 0; i < table.size(); ++i)
    {
        table[i] = static_cast<uint8_t>(i * 7 + 3);
    }
    RowTable t;
    t.rows = table.data();
    t.numRows = numRows;
    t.rowBytes = rowBytes;
    int64_t const T = 9;
    int64_t const L = 2;
    int64_t const cols = 3;
    std::vector<int32_t> ids(static_cast<size_t>(T * L * cols));
    for (size_t i = 0; i < ids.size(); ++i)
    {
        ids[i] = static_cast<int32_t>((i * 37) % numRows);
    }
    RowIds layer1{ids.data() + cols, cols, L * cols};
    std::vector<uint8_t> out(static_cast<size_t>(T * cols * rowBytes));
    GatherTuning tuning;
    tuning.prefetchRows = 4;
    tuning.streamingStores = false;
    gatherRows(layer1, 0, T * cols, t, out.data(), nullptr, tuning);
    bool ok = true;
    for (int64_t tok = 0; tok < T; ++tok)
    {
        for (int64_t c = 0; c < cols; ++c)
        {
            int64_t const id = ids[tok * L * cols + cols + c];
            ok = ok && std::memcmp(&out[(tok * cols + c) * rowBytes], &table[id * rowBytes], rowBytes) == 0;
        }
    }
    check(ok, "strided ids (one layer of [T, L, cols]) pick the right rows");
}

} // namespace

int main()
{
    testParallelForCoversEveryTaskOnce();
    testTaskObjectMayDieRightAfterReturn();
    testWorkersBlockAfterSpinning();
    testWakeRestartsASpin();
    testRunWaitsForWorkersToLeave();
    testSpinSetting();
    testRowGather();
    testStridedIds();
    std::printf("%d failed\n", gFailures);
    return gFailures == 0 ? 0 : 1;
}
