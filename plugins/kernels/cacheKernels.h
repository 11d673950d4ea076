// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * engram-trt kernel library, the HBM hot-row cache: plan, admission, a whole step (cacheKernel.cu, cacheApi.cpp,
 * runtime/cacheStep.cpp).
 * Part of the C ABI of engramKernels.h (the umbrella header), whose conventions hold here.
 */
#ifndef ENGRAM_TRT_CACHE_KERNELS_H
#define ENGRAM_TRT_CACHE_KERNELS_H

#include "engramKernelsCore.h"
#include "hostGatherKernels.h"

#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ======================================================================================
 * Hot-row cache: a step's plan and admission on the GPU (cacheKernel.cu), for a device
 * cache of a host table's rows in front of the host gather (python/engram_trt/hotcache.py).
 *
 * State, all int32 device arrays owned by the caller:
 *   slot_of      [table_num_rows + 1]: row -> cache slot, or -1 (not cached). The last
 *                entry is the sentinel row that every id outside [0, table_num_rows)
 *                maps to (fetched as a zero row, so it is cached like any row).
 *   row_of_slot  [capacity]: slot -> row (-1: empty).
 *   counts       [table_num_rows + 1]: lookups per row (the LFU's frequencies).
 * Work table (the gather's input): cache slots [0, capacity), then a miss area from row
 * miss_base (>= capacity) where the step's fetched rows go, miss j at miss_base + j.
 *
 * engram_cache_plan: for the step's ids [num_ids] (device int32, any values):
 *   counts[row] += 1 per lookup (counts NULL: not counted);
 *   plan[0] = distinct cached rows looked up (hits), plan[1] = M = distinct uncached rows
 *   (misses), plan[2 .. 2 + M) = the misses' rows, in no particular order (the order
 *   changes from run to run; each appears once);
 *   positions[i] = the work-table row of lookup i: its slot, or miss_base + j for miss j.
 * plan holds 2 + num_ids int32 (device). plan_host: NULL, or pinned host memory of
 * 2 + plan_host_ids int32: plan[0 .. 2 + min(plan_host_ids, num_ids)) is copied there on
 * `stream` after the kernels, so one synchronization gives the counts and (if M <=
 * plan_host_ids) every miss. Between a plan and its engram_cache_admit, slot_of holds
 * the misses' codes (values below -1): nothing but that admission may read or write it
 * (a cache serves one step at a time, in stream order). Limits: num_ids <= 2^30,
 * table_num_rows <= 2^31 - 2, miss_base < 2^30, miss_base + num_ids <= 2^31 - 1.
 *
 * engram_cache_admit: the step's end (call it after every plan, also when nothing is
 * admitted: it restores the misses' slot_of entries). miss_rows = plan + 2, num_miss = M.
 *   misses j < num_free take slots filled + j (slot_of, row_of_slot, and, with
 *   work_rows, their rows copied from the miss area); the other misses get slot_of -1;
 *   then num_candidates replacement tries: candidate c is miss pick = num_free +
 *   (candidate_start + c * candidate_stride) % (M - num_free), its victim the slot of
 *   lowest count (ties: the first) among (sample_first + c * sample_factor + k) %
 *   capacity, k < sample_factor; if counts[candidate] > counts[victim's row], the
 *   candidate takes the slot (the old row gets slot_of -1), its row copied from the miss
 *   area, and *replaced (if not NULL) gets + 1.
 * Replacements need a full cache (filled + num_free == capacity), distinct candidates
 * (num_candidates * candidate_stride <= M - num_free) and disjoint windows
 * (num_candidates * sample_factor <= capacity); then the result does not depend on the
 * order the GPU runs them in. work_rows: NULL (maps only), or the work table's rows
 * (row_bytes each, a multiple of 16, 16-byte aligned); work_scales: its scale bytes
 * (scale_bytes each), exactly when scale_bytes > 0.
 */
ENGRAM_API int engram_cache_plan(const int32_t* ids, int64_t num_ids, int64_t table_num_rows, int32_t* slot_of,
    int32_t* counts, int64_t miss_base, int32_t* plan, int32_t* positions, int32_t* plan_host, int64_t plan_host_ids,
    cudaStream_t stream);

ENGRAM_API int engram_cache_admit(const int32_t* miss_rows, int64_t num_miss, int64_t num_free, int64_t filled,
    int64_t capacity, int32_t* slot_of, int32_t* row_of_slot, const int32_t* counts, int64_t num_candidates,
    int64_t candidate_start, int64_t candidate_stride, int64_t sample_first, int32_t sample_factor, int64_t miss_base,
    void* work_rows, int64_t row_bytes, void* work_scales, int64_t scale_bytes, int64_t* replaced, cudaStream_t stream);

/* engram_cache_admission: a step's admission numbers (what engram_cache_admit takes)
 * from its miss count, the cache's fill and its tuning, the host's part of the
 * admission (cachepolicy.py's CachePolicy._admission is its reference; a test ties the
 * two). num_free = min(num_miss, capacity - filled). Replacements are tried only with
 * `replace`, a cache that the free slots fill and misses left over: budget = min(
 * admit_budget, num_miss - num_free, capacity) candidates, spread evenly (stride (num_miss
 * - num_free) / budget) from a start drawn in [0, num_miss - num_free), each against the
 * coldest of sample_factor' = max(1, min(sample_factor, capacity / budget)) slots of a
 * window from a first slot drawn in [0, capacity). The draws are counter-based, no
 * generator state: draw k of a step is splitmix64(seed + (2 * step + k) *
 * 0x9E3779B97F4A7C15) modulo the range, so a step's draws depend on (seed, step) alone
 * and any caller computes the same ones. */
typedef struct EngramCacheAdmission
{
    int64_t num_free;
    int64_t num_candidates;
    int64_t candidate_start;
    int64_t candidate_stride;
    int64_t sample_first;
    int32_t sample_factor;
} EngramCacheAdmission;

ENGRAM_API int engram_cache_admission(int64_t num_miss, int64_t filled, int64_t capacity, int64_t admit_budget,
    int32_t sample_factor, int32_t replace, uint64_t seed, int64_t step, EngramCacheAdmission* admission);

/* engram_cache_step: one whole step of a hot-row cache in front of the host gather, in one
 * call: engram_cache_plan (the miss list to plan_host), the gatherer's wake, one wait on
 * `stream` for the counts and misses (a second copy and wait if more misses than
 * host_ids), engram_host_gather_raw_dev of the misses into the work table's miss area
 * (their device list as ids_dev for ENGRAM_LAYOUT_HBM_SCALES), engram_gather of every
 * lookup from the work table into `out` [deliver_tokens, deliver_cols, head_dim] bf16,
 * then engram_cache_admission and engram_cache_admit. The same calls, arguments and
 * order as the Python cache's step (hotcache.py) without the interpreter between them.
 * With ids_host the step first copies the ids to ids_staging on `stream` and plans from
 * there.
 * A failed fetch or delivery ends the step with an admission of nothing (the slot map
 * restored; `aborted` set) and returns the failure, its reason in engram_last_error().
 * Returns hits (distinct cached rows looked up), num_miss and num_free (misses admitted
 * into free slots; replacements are counted in *replaced on the device).
 * With an overlap (engram_cache_overlap_create), a step with both hits and misses
 * delivers in two engram_gather_part calls: the lookups of cached rows on the overlap's
 * stream, launched before the fetch so the GPU copies them while the host gathers the
 * misses, then the misses' lookups on `stream` after the fetch; `stream` waits for the
 * first before the admission (which moves work-table rows) and before the call returns.
 * `out` holds the same bytes either way.
 * With an overlap and uva_share in (0, 1], a step of at least ENGRAM_CACHE_UVA_MIN_MISSES
 * misses in the split or hbm-scales layout reads the first floor(uva_share * num_miss)
 * of them with engram_gather_raw on the overlap's stream (rows_host must then be pinned
 * or registered: the GPU reads it) while the host gather fetches the rest; the misses'
 * delivery waits for both. uva_share 0: the host gather fetches every miss. */
#define ENGRAM_CACHE_UVA_MIN_MISSES 8192
typedef struct EngramCacheOverlap EngramCacheOverlap;
typedef struct EngramCacheStepArgs
{
    /* the cache, bound once */
    int64_t table_num_rows; /* the policy's and the host table's rows */
    int32_t* slot_of;
    int32_t* counts;
    int32_t* row_of_slot;
    int64_t capacity;
    int64_t admit_budget;
    int32_t sample_factor;
    uint64_t seed;
    int32_t* plan;      /* device [2 + max_ids] */
    int32_t* positions; /* device [max_ids] */
    int32_t* plan_host; /* pinned host [2 + max_host_ids], max_host_ids >= num_ids */
    int64_t max_ids;
    int64_t max_host_ids;
    void* work_rows;   /* [work_num_rows, row_bytes] */
    void* work_scales; /* [work_num_rows, scale_bytes] (fp8), or NULL */
    int64_t work_num_rows;
    int64_t row_bytes;
    int64_t scale_bytes;
    int64_t miss_base;
    int32_t head_dim;
    int32_t table_dtype;
    int32_t quant_block;
    int32_t table_layout;
    EngramHostGatherer* gatherer;
    const void* rows_host;
    const void* scales;          /* host (split), NULL (inline) or device (hbm_scales) */
    int64_t* replaced;           /* device, or NULL */
    EngramCacheOverlap* overlap; /* NULL: the delivery as one gather after the fetch */
    float uva_share;             /* with an overlap: the share of a large step's misses read through UVA */
    int32_t uva_blocks;          /* that read's grid cap (engram_gather_raw's max_blocks) */
    /* the step */
    const int32_t* ids;      /* device [num_ids]; or NULL with ids_host */
    const int32_t* ids_host; /* NULL, or host [num_ids] (pinned: the copy is asynchronous) */
    int32_t* ids_staging;    /* device [max_ids]: where ids_host is copied first, on `stream` */
    int64_t num_ids;
    int64_t deliver_tokens; /* deliver_tokens * deliver_cols == num_ids */
    int32_t deliver_cols;
    void* out;
    int64_t host_ids; /* misses copied with the counts (<= max_host_ids) */
    int64_t filled;
    int32_t replace;
    int64_t step; /* the admission's draw counter */
} EngramCacheStepArgs;

typedef struct EngramCacheStepResult
{
    int64_t hits;
    int64_t num_miss;
    int64_t num_free;
    int32_t aborted;
} EngramCacheStepResult;

ENGRAM_API int engram_cache_step(const EngramCacheStepArgs* args, EngramCacheStepResult* result, cudaStream_t stream);

/* A cache step's overlap: a stream of its own (non-blocking) and an event (no timing),
 * made on the current device, which must be the cache's. One overlap serves one cache
 * (its steps are never concurrent); destroy it after the cache's last step. */
ENGRAM_API int engram_cache_overlap_create(EngramCacheOverlap** overlap);
ENGRAM_API int engram_cache_overlap_destroy(EngramCacheOverlap* overlap);

/* sizeof the three structs above, for bindings that mirror them (ctypes). */
ENGRAM_API int engram_cache_step_sizes(int64_t* args_bytes, int64_t* result_bytes, int64_t* admission_bytes);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* ENGRAM_TRT_CACHE_KERNELS_H */
