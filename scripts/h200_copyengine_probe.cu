// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * Probe: can the copy engines gather a lookup's rows on their own? cudaMemcpyBatchAsync
 * (CUDA 12.8+) takes one copy per row (a random 256-byte row of a pinned host table to
 * its place in a device buffer), so neither CPU threads nor SMs would touch the rows.
 * Timed against one contiguous copy of the same bytes in the same run (the link), for
 * 6,144 and 196,608 uniform random rows, with each source-order attribute and the
 * overlap-with-compute flag, on 1-8 streams; every row is checked against the table.
 * On the H200 it moved 0.1-0.5 GB/s: the driver spends 0.6-1.7 us of CPU per copy
 * (docs/benchmarks.md), so it is no gather path.
 *
 *   nvcc -O2 -std=c++17 -arch=sm_90 -o /tmp/probe scripts/h200_copyengine_probe.cu
 *   /tmp/probe [table GiB = 24] [row bytes = 256] [pages: thp | 4k | cuda] [reps = 11]
 */
#include <cuda_runtime.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#define CK(x)                                                                                                          \
    do                                                                                                                 \
    {                                                                                                                  \
        cudaError_t e_ = (x);                                                                                          \
        if (e_ != cudaSuccess)                                                                                         \
        {                                                                                                              \
            std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));                    \
            std::exit(1);                                                                                              \
        }                                                                                                              \
    } while (0)

static double now_us()
{
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

//! Microseconds from a to b, once b has completed.
static double elapsedUs(cudaEvent_t a, cudaEvent_t b)
{
    CK(cudaEventSynchronize(b));
    float ms = 0.f;
    CK(cudaEventElapsedTime(&ms, a, b));
    return ms * 1e3;
}

static double median(std::vector<double> v)
{
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

int main(int argc, char** argv)
{
    double gib = argc > 1 ? atof(argv[1]) : 24.0;
    size_t rowBytes = argc > 2 ? atoi(argv[2]) : 256;
    const char* pages = argc > 3 ? argv[3] : "thp";
    int reps = argc > 4 ? atoi(argv[4]) : 11;
    size_t bytes = (size_t) (gib * (1ull << 30)) / rowBytes * rowBytes;
    size_t rows = bytes / rowBytes;
    unsigned char* table = nullptr;
    double t0 = now_us();
    if (!strcmp(pages, "cuda"))
    {
        CK(cudaHostAlloc((void**) &table, bytes, cudaHostAllocDefault));
    }
    else
    {
        table = (unsigned char*) mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (table == MAP_FAILED)
        {
            perror("mmap");
            return 1;
        }
        if (!strcmp(pages, "thp"))
            madvise(table, bytes, MADV_HUGEPAGE);
    }
    {
        int nt = 16;
        std::vector<std::thread> th;
        for (int t = 0; t < nt; ++t)
            th.emplace_back([&, t] {
                size_t a = bytes / nt * t, b = t == nt - 1 ? bytes : bytes / nt * (t + 1);
                for (size_t i = a; i < b; i += 4096)
                    table[i] = (unsigned char) (i >> 12);
                for (size_t i = a; i < b; i += 8)
                    *(uint64_t*) (table + i) = i * 0x9E3779B97F4A7C15ull;
            });
        for (auto& x : th)
            x.join();
    }
    if (strcmp(pages, "cuda"))
        CK(cudaHostRegister(table, bytes, cudaHostRegisterDefault));
    std::printf("table %.2f GiB, %zu rows of %zu B, pages %s, ready in %.1f s\n", bytes / double(1ull << 30), rows,
        rowBytes, pages, (now_us() - t0) / 1e6);

    size_t maxN = 196608;
    unsigned char* out;
    CK(cudaMalloc(&out, maxN * rowBytes * 2));
    cudaStream_t st[8];
    for (auto& s : st)
        CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaEvent_t e0, e1, ej[8];
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    for (auto& e : ej)
        CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));

    // The link: one contiguous copy of maxN rows' bytes.
    {
        std::vector<double> t;
        for (int r = 0; r < reps; ++r)
        {
            CK(cudaEventRecord(e0, st[0]));
            CK(cudaMemcpyAsync(out, table + (size_t) r * (64 << 20), maxN * rowBytes, cudaMemcpyHostToDevice, st[0]));
            CK(cudaEventRecord(e1, st[0]));
            t.push_back(elapsedUs(e0, e1));
        }
        double us = median(t);
        std::printf("link: contiguous %zu B in %.1f us = %.1f GB/s\n", maxN * rowBytes, us, maxN * rowBytes / us / 1e3);
    }

    std::mt19937_64 rng(1);
    for (size_t N : {size_t(6144), size_t(196608)})
    {
        std::vector<size_t> ids(N);
        for (auto& i : ids)
            i = rng() % rows;
        std::vector<void*> dsts(N);
        std::vector<const void*> srcs(N);
        std::vector<size_t> sizes(N, rowBytes);
        for (size_t i = 0; i < N; ++i)
        {
            dsts[i] = out + i * rowBytes;
            srcs[i] = table + ids[i] * rowBytes;
        }
        for (int flags : {0, 1})
        {
            for (int order : {1, 3})
            {
                for (int K : {1, 2, 4, 8})
                {
                    cudaMemcpyAttributes attr{};
                    attr.srcAccessOrder = (cudaMemcpySrcAccessOrder) order;
                    attr.flags = flags;
                    size_t idx0 = 0;
                    std::vector<double> tg, th;
                    bool ok = true;
                    for (int r = 0; r < reps; ++r)
                    {
                        CK(cudaMemsetAsync(out, 0, N * rowBytes, st[0]));
                        CK(cudaStreamSynchronize(st[0]));
                        CK(cudaEventRecord(e0, st[0]));
                        for (int k = 1; k < K; ++k)
                            CK(cudaStreamWaitEvent(st[k], e0));
                        double h0 = now_us();
                        for (int k = 0; k < K; ++k)
                        {
                            size_t a = N * k / K, b = N * (k + 1) / K;
                            cudaError_t e = cudaMemcpyBatchAsync(
                                dsts.data() + a, srcs.data() + a, sizes.data() + a, b - a, &attr, &idx0, 1, st[k]);
                            if (e != cudaSuccess)
                            {
                                std::printf(
                                    "N=%zu flags=%d order=%d K=%d: %s\n", N, flags, order, K, cudaGetErrorString(e));
                                cudaGetLastError();
                                ok = false;
                                break;
                            }
                        }
                        double h1 = now_us();
                        if (!ok)
                            break;
                        for (int k = 1; k < K; ++k)
                        {
                            CK(cudaEventRecord(ej[k], st[k]));
                            CK(cudaStreamWaitEvent(st[0], ej[k]));
                        }
                        CK(cudaEventRecord(e1, st[0]));
                        tg.push_back(elapsedUs(e0, e1));
                        th.push_back(h1 - h0);
                    }
                    if (!ok)
                        continue;
                    // verify every row
                    std::vector<unsigned char> back(N * rowBytes);
                    CK(cudaMemcpy(back.data(), out, N * rowBytes, cudaMemcpyDeviceToHost));
                    size_t bad = 0;
                    for (size_t i = 0; i < N; ++i)
                        if (std::memcmp(back.data() + i * rowBytes, srcs[i], rowBytes))
                            ++bad;
                    double us = median(tg);
                    std::printf(
                        "N=%6zu flags=%d order=%d streams=%d: gpu %8.1f us (%.1f GB/s), api %8.1f us, bad rows %zu\n",
                        N, flags, order, K, us, N * rowBytes / us / 1e3, median(th), bad);
                    std::fflush(stdout);
                }
            }
        }
        // one cudaMemcpyAsync per row, for scale (small N only)
        if (N <= 6144)
        {
            std::vector<double> tg, th;
            for (int r = 0; r < reps; ++r)
            {
                CK(cudaEventRecord(e0, st[0]));
                double h0 = now_us();
                for (size_t i = 0; i < N; ++i)
                    CK(cudaMemcpyAsync(dsts[i], srcs[i], rowBytes, cudaMemcpyHostToDevice, st[0]));
                double h1 = now_us();
                CK(cudaEventRecord(e1, st[0]));
                tg.push_back(elapsedUs(e0, e1));
                th.push_back(h1 - h0);
            }
            std::printf("N=%6zu per-row cudaMemcpyAsync: gpu %.1f us, api %.1f us\n", N, median(tg), median(th));
        }
    }
    return 0;
}
