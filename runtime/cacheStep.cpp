// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * engram_cache_step (engramKernels.h): a hot-row cache's whole step in one call, the
 * library's own entry points in the order python/engram_trt/hotcache.py calls them:
 * plan, wake, wait, fetch, deliver, admission; with an overlap the delivery of the
 * cached rows starts before the fetch, on a stream of its own, and so may a read of a
 * share of the misses through UVA (engram_gather_raw) beside the host gather's.
 *
 * Why in C++: on the H200 VM a prefill chunk's step holds ~100 us of GPU work beside the
 * host gather's fetch, and the Python between those calls (argument checks, views,
 * stream lookups, ctypes conversions) took ~150 us more, with the GPU waiting for it
 * (`benchmarks/lookup/bench_cache.py --host-trace`). Here the same calls follow each other with
 * nothing between them. Each entry point still checks its own arguments, so a bad
 * binding fails with the message that call would give.
 */
#include "kernels/cacheKernels.h"
#include "kernels/engramKernelsCore.h"
#include "kernels/engramKernelsInternal.h"
#include "kernels/gatherKernels.h"
#include "kernels/hostGatherKernels.h"

#include <cstdint>
#include <string>

using namespace engram_trt::kernels;

struct EngramCacheOverlap
{
    cudaStream_t stream = nullptr;
    cudaEvent_t done = nullptr;
};

namespace
{

//! Makes `stream` wait for the work on the overlap's stream (the hits' delivery, the UVA
//! read of misses), at every exit of a step that launched some: later work on `stream`
//! reads what it writes or moves what it reads.
int joinOverlap(char const* fn, EngramCacheOverlap const* overlap, cudaStream_t stream)
{
    cudaError_t status = cudaEventRecord(overlap->done, overlap->stream);
    if (status == cudaSuccess)
    {
        status = cudaStreamWaitEvent(stream, overlap->done, 0);
    }
    if (status != cudaSuccess)
    {
        return failCuda(status, "%s: joining the overlap's stream failed (%s:%d): %s", fn, sourceFileName(__FILE__),
            __LINE__, cudaGetErrorString(status));
    }
    return 0;
}

//! Ends a step whose fetch or delivery failed: an admission of nothing restores the
//! misses' slot map entries (as CachePolicy.abort does). Returns the first failure,
//! with its message.
int abortStep(EngramCacheStepArgs const& a, int64_t numMiss, int status, EngramCacheStepResult& r, cudaStream_t stream,
    bool overlapLaunched = false)
{
    std::string const why = engram_last_error();
    r.aborted = 1;
    if (overlapLaunched)
    {
        joinOverlap("engram_cache_step", a.overlap, stream); // best effort: the first failure is what is reported
    }
    int const undone = engram_cache_admit(a.plan + 2, numMiss, 0, a.filled, a.capacity, a.slot_of, a.row_of_slot,
        a.counts, 0, 0, 1, 0, 1, a.miss_base, nullptr, 0, nullptr, 0, nullptr, stream);
    return fail(static_cast<cudaError_t>(status), "%s%s", why.c_str(),
        undone != 0 ? "; the slot map could not be restored either" : "");
}

//! How many of a step's misses the GPU reads itself through UVA (engram_gather_raw): the
//! first floor(uva_share * numMiss) of a large miss list in a layout whose rows are an
//! array of their own (split, hbm-scales), with an overlap to run it on; else none.
//! Small lists stay with the host gather: a UVA read of a few rows is one round trip of
//! latency that the host gather's threads beat.
int64_t uvaMissesOf(EngramCacheStepArgs const& a, int64_t numMiss)
{
    bool const rowsApart = a.table_layout == ENGRAM_LAYOUT_SPLIT || a.table_layout == ENGRAM_LAYOUT_HBM_SCALES;
    if (a.overlap == nullptr || !rowsApart || !(a.uva_share > 0.0f) || numMiss < ENGRAM_CACHE_UVA_MIN_MISSES)
    {
        return 0;
    }
    return static_cast<int64_t>(static_cast<double>(a.uva_share) * static_cast<double>(numMiss));
}

int waitFor(char const* fn, char const* what, cudaStream_t stream)
{
    cudaError_t const status = cudaStreamSynchronize(stream);
    if (status != cudaSuccess)
    {
        return failCuda(status, "%s: waiting for %s failed (%s:%d): %s", fn, what, sourceFileName(__FILE__), __LINE__,
            cudaGetErrorString(status));
    }
    return 0;
}

int cacheStep(EngramCacheStepArgs const* args, EngramCacheStepResult* result, cudaStream_t stream)
{
    char const* fn = "engram_cache_step";
    if (args == nullptr || result == nullptr)
    {
        return fail(cudaErrorInvalidValue, "%s: args and result are required", fn);
    }
    EngramCacheStepArgs const& a = *args;
    EngramCacheStepResult& r = *result;
    r = EngramCacheStepResult{};
    if (a.num_ids < 0 || a.num_ids > a.max_ids || a.deliver_cols < 1 || a.deliver_tokens < 0
        || a.deliver_tokens * a.deliver_cols != a.num_ids)
    {
        return fail(cudaErrorInvalidValue,
            "%s: num_ids %lld must be deliver_tokens %lld x deliver_cols %d and at most max_ids %lld", fn,
            ll(a.num_ids), ll(a.deliver_tokens), a.deliver_cols, ll(a.max_ids));
    }
    if (a.plan_host == nullptr || a.host_ids < 0 || a.host_ids > a.max_host_ids)
    {
        return fail(cudaErrorInvalidValue, "%s: plan_host is required and host_ids must be in [0, %lld] (got %lld)", fn,
            ll(a.max_host_ids), ll(a.host_ids));
    }
    if (a.max_host_ids < a.num_ids)
    {
        // Every lookup of a step can miss: the miss list may need the whole buffer.
        return fail(cudaErrorInvalidValue, "%s: plan_host holds %lld miss ids, fewer than the step's %lld lookups", fn,
            ll(a.max_host_ids), ll(a.num_ids));
    }
    if (a.miss_base < a.capacity || a.miss_base + a.num_ids > a.work_num_rows)
    {
        return fail(cudaErrorInvalidValue,
            "%s: the work table's %lld rows must hold the %lld cache slots and a miss area of num_ids = %lld rows "
            "from miss_base %lld",
            fn, ll(a.work_num_rows), ll(a.capacity), ll(a.num_ids), ll(a.miss_base));
    }
    if (!(a.uva_share >= 0.0f && a.uva_share <= 1.0f) || a.uva_blocks < 0)
    {
        return fail(cudaErrorInvalidValue, "%s: uva_share must be in [0, 1] and uva_blocks >= 0 (got %g, %d)", fn,
            static_cast<double>(a.uva_share), a.uva_blocks);
    }
    if (a.gatherer == nullptr || a.work_rows == nullptr)
    {
        return fail(cudaErrorInvalidValue, "%s: the gatherer and the work table are required", fn);
    }
    int32_t const* ids = a.ids;
    if (a.ids_host != nullptr && a.num_ids > 0)
    {
        // The ids' upload here, not as a torch copy before the call: one CUDA call, and
        // ordered before the plan on the same stream.
        if (a.ids_staging == nullptr)
        {
            return fail(cudaErrorInvalidValue, "%s: ids_host needs ids_staging (device, max_ids int32)", fn);
        }
        cudaError_t const status = cudaMemcpyAsync(a.ids_staging, a.ids_host,
            static_cast<size_t>(a.num_ids) * sizeof(int32_t), cudaMemcpyHostToDevice, stream);
        if (status != cudaSuccess)
        {
            return failCuda(status, "%s: cudaMemcpyAsync of the ids failed (%s:%d): %s", fn, sourceFileName(__FILE__),
                __LINE__, cudaGetErrorString(status));
        }
        ids = a.ids_staging;
    }
    if (int const planned = engram_cache_plan(ids, a.num_ids, a.table_num_rows, a.slot_of, a.counts, a.miss_base,
            a.plan, a.positions, a.plan_host, a.host_ids, stream))
    {
        return planned; // nothing enqueued that marks the slot map, or a broken stream
    }
    // The pool wakes while the GPU plans; a wake that fails still ends the step below.
    int const woken = engram_host_gatherer_wake(a.gatherer);
    if (int const waited = waitFor(fn, "the plan", stream))
    {
        return waited; // the device failed: the slot map is beyond repair from here
    }
    int64_t const hits = a.plan_host[0];
    int64_t const numMiss = a.plan_host[1];
    r.hits = hits;
    r.num_miss = numMiss;
    if (woken != 0)
    {
        return abortStep(a, numMiss, woken, r, stream);
    }
    if (numMiss > a.host_ids)
    {
        // More misses than the first copy carried: the rest of the list, and a second wait.
        cudaError_t const copied = cudaMemcpyAsync(a.plan_host + 2 + a.host_ids, a.plan + 2 + a.host_ids,
            static_cast<size_t>(numMiss - a.host_ids) * sizeof(int32_t), cudaMemcpyDeviceToHost, stream);
        if (copied != cudaSuccess)
        {
            return abortStep(a, numMiss,
                failCuda(copied, "%s: cudaMemcpyAsync of the miss list failed (%s:%d): %s", fn,
                    sourceFileName(__FILE__), __LINE__, cudaGetErrorString(copied)),
                r, stream);
        }
        if (int const waited = waitFor(fn, "the miss list", stream))
        {
            return waited;
        }
    }
    auto* const workRows = static_cast<uint8_t*>(a.work_rows);
    auto* const workScales = static_cast<uint8_t*>(a.work_scales);
    // The hits' delivery, on the overlap's stream while the host gathers the misses: the
    // plan's wait above saw every earlier piece of work on `stream` done, so the kernel
    // reads finished positions and slots. It reads only the cache's slots [0, miss_base),
    // which nothing writes before the admission; the fetch writes the miss area.
    bool const splitDelivery = a.overlap != nullptr && hits > 0 && numMiss > 0;
    int64_t const uvaMisses = uvaMissesOf(a, numMiss);
    bool const side = splitDelivery || uvaMisses > 0; // work on the overlap's stream to join
    if (splitDelivery)
    {
        if (int const launched = engram_gather_part(a.positions, a.deliver_tokens, a.deliver_cols, a.deliver_cols,
                a.work_rows, a.work_scales, a.miss_base, 0, a.head_dim, a.table_dtype, a.quant_block, 1, 0, a.out,
                a.overlap->stream))
        {
            return abortStep(a, numMiss, launched, r, stream);
        }
    }
    uint8_t* const missRows = workRows + a.miss_base * a.row_bytes;
    uint8_t* const missScales = workScales != nullptr ? workScales + a.miss_base * a.scale_bytes : nullptr;
    if (uvaMisses > 0)
    {
        // The first misses through UVA on a few multiprocessors, the rest by the host gather.
        if (int const read
            = engram_gather_raw(a.plan + 2, uvaMisses, a.rows_host, a.scales, a.table_num_rows, a.row_bytes,
                static_cast<int32_t>(a.scale_bytes), missRows, missScales, a.uva_blocks, a.overlap->stream))
        {
            return abortStep(a, numMiss, read, r, stream, side);
        }
    }
    if (numMiss > uvaMisses)
    {
        bool const hbmScales = a.table_layout == ENGRAM_LAYOUT_HBM_SCALES;
        int const fetched = engram_host_gather_raw_dev(a.gatherer, a.plan_host + 2 + uvaMisses,
            hbmScales ? a.plan + 2 + uvaMisses : nullptr, numMiss - uvaMisses, a.rows_host, a.scales, a.table_num_rows,
            a.head_dim, a.table_dtype, a.quant_block, a.table_layout, missRows + uvaMisses * a.row_bytes,
            missScales != nullptr ? missScales + uvaMisses * a.scale_bytes : nullptr, stream);
        if (fetched != 0)
        {
            return abortStep(a, numMiss, fetched, r, stream, side);
        }
    }
    if (side)
    {
        // The delivery below reads the misses the UVA read wrote, and what follows on
        // `stream` (the admission) moves rows the hits' call reads.
        if (int const joined = joinOverlap(fn, a.overlap, stream))
        {
            return abortStep(a, numMiss, joined, r, stream);
        }
    }
    int delivered = 0;
    if (splitDelivery)
    {
        // The misses' lookups: work-table rows [miss_base, work_num_rows), the rows the
        // hits' call left as they were.
        delivered = engram_gather_part(a.positions, a.deliver_tokens, a.deliver_cols, a.deliver_cols, missRows,
            missScales, a.work_num_rows - a.miss_base, a.miss_base, a.head_dim, a.table_dtype, a.quant_block, 1, 0,
            a.out, stream);
    }
    else
    {
        delivered = engram_gather(a.positions, a.deliver_tokens, a.deliver_cols, a.deliver_cols, a.work_rows,
            a.work_scales, a.work_num_rows, a.head_dim, a.table_dtype, a.quant_block, a.out, nullptr, stream);
    }
    if (delivered != 0)
    {
        return abortStep(a, numMiss, delivered, r, stream);
    }
    if (numMiss == 0)
    {
        return 0; // nothing was marked that an admission would restore
    }
    EngramCacheAdmission adm{};
    if (int const decided = engram_cache_admission(
            numMiss, a.filled, a.capacity, a.admit_budget, a.sample_factor, a.replace, a.seed, a.step, &adm))
    {
        return abortStep(a, numMiss, decided, r, stream);
    }
    if (int const admitted = engram_cache_admit(a.plan + 2, numMiss, adm.num_free, a.filled, a.capacity, a.slot_of,
            a.row_of_slot, a.counts, adm.num_candidates, adm.candidate_start, adm.candidate_stride, adm.sample_first,
            adm.sample_factor, a.miss_base, a.work_rows, a.row_bytes, a.work_scales, a.scale_bytes, a.replaced, stream))
    {
        return abortStep(a, numMiss, admitted, r, stream);
    }
    r.num_free = adm.num_free;
    return 0;
}

} // namespace

extern "C" ENGRAM_API int engram_cache_step(
    EngramCacheStepArgs const* args, EngramCacheStepResult* result, cudaStream_t stream)
{
    clearError();
    ENGRAM_ABI_TRY
    {
        return cacheStep(args, result, stream);
    }
    ENGRAM_ABI_CATCH("engram_cache_step")
}

extern "C" ENGRAM_API int engram_cache_overlap_create(EngramCacheOverlap** overlap)
{
    clearError();
    if (overlap == nullptr)
    {
        return fail(cudaErrorInvalidValue, "engram_cache_overlap_create: overlap (the output) is required");
    }
    *overlap = nullptr;
    ENGRAM_ABI_TRY
    {
        auto* o = new EngramCacheOverlap{};
        cudaError_t status = cudaStreamCreateWithFlags(&o->stream, cudaStreamNonBlocking);
        if (status == cudaSuccess)
        {
            status = cudaEventCreateWithFlags(&o->done, cudaEventDisableTiming);
        }
        if (status != cudaSuccess)
        {
            if (o->stream != nullptr)
            {
                cudaStreamDestroy(o->stream);
            }
            delete o;
            return failCuda(status, "engram_cache_overlap_create: creating its stream and event failed (%s:%d): %s",
                sourceFileName(__FILE__), __LINE__, cudaGetErrorString(status));
        }
        *overlap = o;
        return 0;
    }
    ENGRAM_ABI_CATCH("engram_cache_overlap_create")
}

extern "C" ENGRAM_API int engram_cache_overlap_destroy(EngramCacheOverlap* overlap)
{
    clearError();
    if (overlap == nullptr)
    {
        return 0;
    }
    // Work still queued on the stream finishes first (cudaStreamDestroy does not wait, but
    // the stream's resources are released only once it has).
    cudaError_t const event = cudaEventDestroy(overlap->done);
    cudaError_t const stream = cudaStreamDestroy(overlap->stream);
    delete overlap;
    cudaError_t const status = event != cudaSuccess ? event : stream;
    if (status != cudaSuccess)
    {
        return failCuda(status, "engram_cache_overlap_destroy failed (%s:%d): %s", sourceFileName(__FILE__), __LINE__,
            cudaGetErrorString(status));
    }
    return 0;
}

extern "C" ENGRAM_API int engram_cache_step_sizes(int64_t* argsBytes, int64_t* resultBytes, int64_t* admissionBytes)
{
    clearError();
    if (argsBytes == nullptr || resultBytes == nullptr || admissionBytes == nullptr)
    {
        return fail(cudaErrorInvalidValue, "engram_cache_step_sizes: the three outputs are required");
    }
    *argsBytes = static_cast<int64_t>(sizeof(EngramCacheStepArgs));
    *resultBytes = static_cast<int64_t>(sizeof(EngramCacheStepResult));
    *admissionBytes = static_cast<int64_t>(sizeof(EngramCacheAdmission));
    return 0;
}
