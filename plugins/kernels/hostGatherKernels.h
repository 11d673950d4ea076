// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * engram-trt kernel library, the host gather and the gather driver (defined in runtime/: hostGatherApi.cpp,
 * gatherDriver.cpp).
 * Part of the C ABI of engramKernels.h (the umbrella header), whose conventions hold here.
 */
#ifndef ENGRAM_TRT_HOST_GATHER_KERNELS_H
#define ENGRAM_TRT_HOST_GATHER_KERNELS_H

#include "engramKernelsCore.h"
#include "gatherKernels.h" // the table dtypes (EngramTableDtype) and engram_gather's contract
#include "hashKernels.h"   // a step job's prepared layout

#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/*
 * Host gather: rows are gathered by CPU threads from a host table (any host memory,
 * e.g. a file mapping) into pinned staging slots, and each chunk goes to the GPU in
 * one cudaMemcpyAsync on the gatherer's own copy stream, pipelined (the copy of a chunk
 * overlaps the gather of the next ones); fp8 chunks are dequantized on the GPU by the
 * gather kernel on `stream`. Same ids / table / out contract as engram_gather, except
 * that ids_host, rows_host and scales_host are CPU pointers. Returns when every chunk
 * has been gathered and its copy (and dequant) enqueued; `out` is ready when `stream`
 * reaches that point. A gatherer serves one call at a time (calls are serialized by a
 * lock); its staging slots are reused only after the copies that read them completed.
 * runtime/README.md describes the pipeline and its tuning.
 */
typedef struct EngramHostGatherer EngramHostGatherer;

/* Layout of a host table (engram_host_gather_ex / _raw / _rows_cpu `table_layout`). */
enum EngramTableLayout
{
    ENGRAM_LAYOUT_SPLIT = 0,  /* rows [N, head_dim] and scales [N, head_dim / quant_block]: two arrays (engram_gather's
                                 form) */
    ENGRAM_LAYOUT_INLINE = 1, /* one array [N, head_dim + head_dim / quant_block] bytes: each row's scale bytes right
                                after its values (fp8), so a random row costs the CPU one miss instead of two;
                                scales_host must be NULL. For bf16 tables it is the split layout. */
    ENGRAM_LAYOUT_HBM_SCALES = 2 /* fp8 only: rows [N, head_dim] in host memory, scales [N, head_dim / quant_block] in
                                device memory (the `scales` pointer is a device pointer). The CPU threads copy only
                                the values (a 256-byte row is 4 cache lines; with its scale bytes beside it, 5), and
                                the dequant reads each row's scale bytes from HBM by its id, so the call needs the ids
                                in device memory too (engram_host_gather_dev, engram_host_gather_raw_dev, or a step
                                job's row ids). */
};

/* Tuning knobs of a host gatherer (engram_host_gatherer_set_option / get_option). */
enum EngramHostGatherOption
{
    ENGRAM_HOST_GATHER_CHUNK_ROWS = 0,         /* most rows per copy (default: the chunk_rows it was created with;
                                                  capped by what a staging slot holds) */
    ENGRAM_HOST_GATHER_MIN_CHUNKS = 1,         /* a call is cut into at least this many chunks (not below 256 rows
                                                  each) so a small call overlaps gather and copy (default 4) */
    ENGRAM_HOST_GATHER_TASK_ROWS = 2,          /* rows per work item of a thread (0 = automatic, default) */
    ENGRAM_HOST_GATHER_PREFETCH_ROWS = 3,      /* software prefetch distance in rows, 0..64 (0 = off; default 16) */
    ENGRAM_HOST_GATHER_STREAMING_STORES = 4,   /* 1: non-temporal stores into staging, 0: plain stores (default) */
    ENGRAM_HOST_GATHER_SPIN_US = 5,            /* idle pool threads spin this long, then block (default 50) */
    ENGRAM_HOST_GATHER_NUM_THREADS = 6,        /* read-only: threads of the pool, the caller included */
    ENGRAM_HOST_GATHER_NUM_SLOTS = 7,          /* read-only: staging slots */
    ENGRAM_HOST_GATHER_SLOT_BYTES = 8,         /* read-only: bytes of one pinned (and one device) staging slot */
    ENGRAM_HOST_GATHER_PREFETCH_FAR_ROWS = 9,  /* prefetch the first line of the row this far ahead, 0..64, to start
                                                  its page walk early (0 = off, default) */
    ENGRAM_HOST_GATHER_PREFETCH_LOCALITY = 10, /* cache level prefetched into: 3 = L1 (default) .. 1 = L2/L3,
                                                  0 = non-temporal */
    ENGRAM_HOST_GATHER_JOB_STAGING_BYTES = 11  /* bytes of each of two device buffers that hold a whole fp8
                                                  call's staged rows (and scale bytes), 0..2^40 (0 = off, default).
                                                  A call that fits copies its chunks there instead of into the
                                                  ring of device slots, so no copy waits for an earlier chunk's
                                                  dequant: with the ring, a dequant queued behind a long kernel
                                                  (a prefill's GEMM holds every SM) stalls the copies and with
                                                  them the CPU threads. Calls alternate between the two buffers;
                                                  setting it reallocates them (cudaMalloc) and waits for the
                                                  dequants that read them */
};

/* CPUs in the calling thread's affinity mask (sched_getaffinity; threads it starts inherit
 * it). On a node shared by several ranks, give each rank its own CPU list (taskset,
 * numactl, the scheduler) and the host gather's pool follows. */
ENGRAM_API int engram_cpu_affinity_count(int32_t* count);

/* The default thread count of a host gatherer: one less than engram_cpu_affinity_count()
 * (at least 1), leaving a CPU to the thread that launches the model and to the OS (one
 * preempted worker stalls a round of the pool). */
ENGRAM_API int engram_host_gather_default_threads(int32_t* count);

/* num_threads <= 0: engram_host_gather_default_threads() (the caller is one of the threads).
 * chunk_rows: rows per pipelined chunk, and with max_head_dim (the widest table row, in
 * elements) the size of a staging slot: chunk_rows * 2 * max_head_dim bytes, pinned and
 * on the device, num_slots of each (create: 4 slots; create_ex: 2..64).
 * destroy waits for a gather in progress on another thread, then frees the gatherer; a
 * gather that starts after destroy has begun uses freed memory (a caller bug). */
ENGRAM_API int engram_host_gatherer_create(
    int32_t num_threads, int64_t chunk_rows, int32_t max_head_dim, EngramHostGatherer** gatherer);
ENGRAM_API int engram_host_gatherer_create_ex(
    int32_t num_threads, int64_t chunk_rows, int32_t max_head_dim, int32_t num_slots, EngramHostGatherer** gatherer);
ENGRAM_API int engram_host_gatherer_destroy(EngramHostGatherer* gatherer);

/* Set / read an EngramHostGatherOption; set waits for a gather in progress. */
ENGRAM_API int engram_host_gatherer_set_option(EngramHostGatherer* gatherer, int32_t option, int64_t value);
ENGRAM_API int engram_host_gatherer_get_option(EngramHostGatherer* gatherer, int32_t option, int64_t* value);

/* Wakes the gatherer's sleeping threads (they spin again for SPIN_US) and restarts the
 * spin of spinning ones (SPIN_US from now): call it when a gather is about to come (a
 * step's ids are being computed) to hide the wake-up. */
ENGRAM_API int engram_host_gatherer_wake(EngramHostGatherer* gatherer);

/* The host gather into bf16 `out` [num_tokens, num_cols, head_dim] from a split table. */
ENGRAM_API int engram_host_gather(EngramHostGatherer* gatherer, const int32_t* ids_host, int64_t num_tokens,
    int32_t num_cols, int64_t id_token_stride, const void* rows_host, const void* scales_host, int64_t table_num_rows,
    int32_t head_dim, int32_t table_dtype, int32_t quant_block, void* out, cudaStream_t stream);

/* engram_host_gather from a split or inline table (EngramTableLayout; hbm_scales needs
 * engram_host_gather_dev). */
ENGRAM_API int engram_host_gather_ex(EngramHostGatherer* gatherer, const int32_t* ids_host, int64_t num_tokens,
    int32_t num_cols, int64_t id_token_stride, const void* rows_host, const void* scales_host, int64_t table_num_rows,
    int32_t head_dim, int32_t table_dtype, int32_t quant_block, int32_t table_layout, void* out, cudaStream_t stream);
/* engram_host_gather_ex with the ids also in device memory: ids_dev has the layout of
 * ids_host ([num_tokens, id_token_stride], the same values) and must be ready on `stream`.
 * Only ENGRAM_LAYOUT_HBM_SCALES reads it (its dequant looks up each row's scale bytes by
 * id); other layouts ignore it (NULL is fine). */
ENGRAM_API int engram_host_gather_dev(EngramHostGatherer* gatherer, const int32_t* ids_host, const int32_t* ids_dev,
    int64_t num_tokens, int32_t num_cols, int64_t id_token_stride, const void* rows_host, const void* scales,
    int64_t table_num_rows, int32_t head_dim, int32_t table_dtype, int32_t quant_block, int32_t table_layout, void* out,
    cudaStream_t stream);

/*
 * The host gather of raw table bytes (no dequant), for a device row cache that keeps
 * rows in their stored form: row ids_host[i] (flat, [num_ids]) of the table goes to
 * dst_rows + i * row_bytes and its scale bytes to dst_scales + i * scale_bytes, where
 * row_bytes = head_dim (fp8) or 2 * head_dim (bf16) and scale_bytes = head_dim /
 * quant_block (fp8; dst_scales unused for bf16): the split form engram_gather reads, for
 * every table layout. dst_rows / dst_scales are device memory (dst_rows 16-byte
 * aligned). Ids outside the table give zero rows with scale bytes 127. The copies start
 * after the work enqueued on `stream` before the call, and `stream` waits for them.
 * engram_host_gather_raw takes the split and inline layouts; engram_host_gather_raw_dev
 * takes all three: with ENGRAM_LAYOUT_HBM_SCALES `scales` is the table's scale array in
 * device memory and ids_dev the ids in device memory too (ids_host's [num_ids] values,
 * ready on `stream`; other layouts ignore it). The CPU threads then stage and copy the
 * values alone (one copy per chunk), and one kernel on `stream` gathers the scale bytes
 * from `scales` by ids_dev into dst_scales.
 */
ENGRAM_API int engram_host_gather_raw(EngramHostGatherer* gatherer, const int32_t* ids_host, int64_t num_ids,
    const void* rows_host, const void* scales_host, int64_t table_num_rows, int32_t head_dim, int32_t table_dtype,
    int32_t quant_block, int32_t table_layout, void* dst_rows, void* dst_scales, cudaStream_t stream);
ENGRAM_API int engram_host_gather_raw_dev(EngramHostGatherer* gatherer, const int32_t* ids_host, const int32_t* ids_dev,
    int64_t num_ids, const void* rows_host, const void* scales, int64_t table_num_rows, int32_t head_dim,
    int32_t table_dtype, int32_t quant_block, int32_t table_layout, void* dst_rows, void* dst_scales,
    cudaStream_t stream);

/*
 * The CPU part of the host gather alone (no GPU, no CUDA call): the raw rows of
 * ids_host [num_ids] into host memory dst_rows_host [num_ids, row_bytes] and
 * dst_scales_host [num_ids, scale_bytes] (the engram_host_gather_raw contract), on the
 * threads of `gatherer` with its tuning, or, with gatherer NULL, on a pool of
 * num_threads made for the call (<= 0: engram_cpu_affinity_count()). prefetch_rows and
 * streaming_stores override the tuning (-1: keep it). For tests and for measuring the
 * gather's CPU side apart from the link. hbm_scales: the values alone (what its CPU
 * threads copy); scales_host and dst_scales_host are not read or written.
 */
ENGRAM_API int engram_host_gather_rows_cpu(EngramHostGatherer* gatherer, int32_t num_threads, const int32_t* ids_host,
    int64_t num_ids, const void* rows_host, const void* scales_host, int64_t table_num_rows, int32_t head_dim,
    int32_t table_dtype, int32_t quant_block, int32_t table_layout, void* dst_rows_host, void* dst_scales_host,
    int32_t prefetch_rows, int32_t streaming_stores);

/*
 * The gather driver (runtime/gatherDriver.cpp): a thread that runs a host gatherer's
 * calls queued by the caller, so the caller never waits for their CPU part. submit
 * queues one engram_host_gather_ex call (same arguments; with ids_ready non-NULL the
 * driver first waits for that event: ids copied back from the hash kernel) and returns
 * at once with its ticket (1, 2, ...). ids_host must stay valid, and `out` unread, until
 * the ticket is finished. wait_stream enqueues on `stream` a wait (no SM, no host wait)
 * until the ticket's rows are ready on the job's stream; it may come before the job has
 * run. finish waits on the host until every job up to the ticket has run and returns the
 * first failure among them with its message (a failed job still releases its waiters; its
 * rows are then undefined). Jobs of one driver run in order. destroy runs the queued
 * jobs first; destroy the driver before its gatherer. supported: whether `device` has
 * the 64-bit stream memory operations the driver needs (create fails without them).
 */
typedef struct EngramGatherDriver EngramGatherDriver;
ENGRAM_API int engram_gather_driver_supported(int32_t device, int32_t* supported);
ENGRAM_API int engram_gather_driver_create(EngramHostGatherer* gatherer, EngramGatherDriver** driver);
ENGRAM_API int engram_gather_driver_destroy(EngramGatherDriver* driver);
ENGRAM_API int engram_gather_driver_submit(EngramGatherDriver* driver, const int32_t* ids_host, int64_t num_tokens,
    int32_t num_cols, int64_t id_token_stride, const void* rows_host, const void* scales_host, int64_t table_num_rows,
    int32_t head_dim, int32_t table_dtype, int32_t quant_block, int32_t table_layout, void* out, cudaStream_t stream,
    cudaEvent_t ids_ready, uint64_t* ticket);
/* A step's lookup as one job: the driver copies its compressed ids [num_tokens],
 * seq_starts [num_seqs + 1] and lookback [num_seqs, lookback_width] (NULL: every sequence
 * starts fresh) from pinned host memory into the device buffers given, hashes them on
 * `stream` (engram_hash_prepared into row_ids_dev [T, L, num_cols]), copies the row ids
 * back into row_ids_host (pinned), waits for them, then gathers layer l (l < num_layers
 * = L) from tables[l] into outs[l] (bf16 [T, num_cols, head_dim]) and releases its ticket
 * *first_ticket + l. The host buffers must stay unchanged until the last ticket is
 * finished. A table in ENGRAM_LAYOUT_HBM_SCALES has its scales in device memory
 * (`scales_host` then holds a device pointer); its dequant reads the layer's row ids from
 * row_ids_dev. engram_gather_driver_submit refuses that layout: it has no device ids. */
typedef struct EngramDriverTable
{
    const void* rows_host;
    const void* scales_host;
    int64_t num_rows;
    int32_t head_dim;
    int32_t table_dtype;
    int32_t quant_block;
    int32_t table_layout;
} EngramDriverTable;
ENGRAM_API int engram_gather_driver_submit_step(EngramGatherDriver* driver, const EngramHashLayout* layout,
    const int32_t* cids_host, int64_t num_tokens, const int32_t* seq_starts_host, int64_t num_seqs,
    const int32_t* lookback_host, int32_t lookback_width, int32_t num_cols, int32_t* cids_dev, int32_t* seq_starts_dev,
    int32_t* lookback_dev, int32_t* row_ids_dev, int32_t* row_ids_host, int32_t num_layers,
    const EngramDriverTable* tables, void* const* outs, cudaStream_t stream, uint64_t* first_ticket);
ENGRAM_API int engram_gather_driver_wait_stream(EngramGatherDriver* driver, uint64_t ticket, cudaStream_t stream);
ENGRAM_API int engram_gather_driver_finish(EngramGatherDriver* driver, uint64_t ticket);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* ENGRAM_TRT_HOST_GATHER_KERNELS_H */
