// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * engram_cache_step (engramKernels.h): a hot-row cache's whole step in one call, the
 * library's own entry points in the order python/engram_trt/hotcache.py calls them:
 * plan, wake, wait, fetch, deliver, admission.
 *
 * Why in C++: on the H200 VM a prefill chunk's step holds ~100 us of GPU work beside the
 * host gather's fetch, and the Python between those calls (argument checks, views,
 * stream lookups, ctypes conversions) took ~150 us more, with the GPU waiting for it
 * (`engram-trt bench cache --host-trace`). Here the same calls follow each other with
 * nothing between them. Each entry point still checks its own arguments, so a bad
 * binding fails with the message that call would give.
 */
#include "kernels/engramKernels.h"
#include "kernels/engramKernelsInternal.h"

#include <cstdint>
#include <string>

using namespace engram_trt::kernels;

namespace
{

//! Ends a step whose fetch or delivery failed: an admission of nothing restores the
//! misses' slot map entries (as CachePolicy.abort does). Returns the first failure,
//! with its message.
int abortStep(EngramCacheStepArgs const& a, int64_t numMiss, int status, EngramCacheStepResult& r, cudaStream_t stream)
{
    std::string const why = engram_last_error();
    r.aborted = 1;
    int const undone = engram_cache_admit(a.plan + 2, numMiss, 0, a.filled, a.capacity, a.slot_of, a.row_of_slot,
        a.counts, 0, 0, 1, 0, 1, a.miss_base, nullptr, 0, nullptr, 0, nullptr, stream);
    return fail(static_cast<cudaError_t>(status), "%s%s", why.c_str(),
        undone != 0 ? "; the slot map could not be restored either" : "");
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
    if (numMiss > 0)
    {
        bool const hbmScales = a.table_layout == ENGRAM_LAYOUT_HBM_SCALES;
        int const fetched = engram_host_gather_raw_dev(a.gatherer, a.plan_host + 2, hbmScales ? a.plan + 2 : nullptr,
            numMiss, a.rows_host, a.scales, a.table_num_rows, a.head_dim, a.table_dtype, a.quant_block, a.table_layout,
            workRows + a.miss_base * a.row_bytes,
            workScales != nullptr ? workScales + a.miss_base * a.scale_bytes : nullptr, stream);
        if (fetched != 0)
        {
            return abortStep(a, numMiss, fetched, r, stream);
        }
    }
    int const delivered = engram_gather(a.positions, a.deliver_tokens, a.deliver_cols, a.deliver_cols, a.work_rows,
        a.work_scales, a.work_num_rows, a.head_dim, a.table_dtype, a.quant_block, a.out, nullptr, stream);
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
