// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * engram-trt kernel library, the GPU row gather from device or UVA host tables (gatherKernel.cu, gatherApi.cpp).
 * Part of the C ABI of engramKernels.h (the umbrella header), whose conventions hold here.
 */
#ifndef ENGRAM_TRT_GATHER_KERNELS_H
#define ENGRAM_TRT_GATHER_KERNELS_H

#include "engramKernelsCore.h"

#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Table element types (EngramGather field `table_dtype`). */
enum EngramTableDtype
{
    ENGRAM_TABLE_FP8_E4M3 = 0, /* fp8 e4m3 rows + ue8m0 scale bytes, one per quant_block */
    ENGRAM_TABLE_BF16 = 1,     /* bf16 rows, no scales */
    ENGRAM_TABLE_F16 = 2,      /* f16 rows, no scales (GPU gather only: engram_gather*, EngramGather) */
    ENGRAM_TABLE_F32 = 3       /* f32 rows, no scales (GPU gather only) */
};

/*
 * Row gather + dequantization, GPU side (device table or UVA host table).
 *
 * ids          int32 device, token t's column c at ids[t * id_token_stride + c]
 *              (for hash output [T, L, cols] of layer l: pass ids + l * cols and
 *              id_token_stride = L * cols). NULL = identity (row t * num_cols + c).
 *              Ids outside [0, table_num_rows) produce zero rows (never an
 *              out-of-bounds read).
 * table_rows   [table_num_rows, head_dim] fp8 e4m3 bytes (16-byte aligned) or bf16 /
 *              f16 / f32 (aligned to the element): device memory or pinned /
 *              registered host memory.
 * table_scales [table_num_rows, head_dim / quant_block] ue8m0 bytes (value
 *              2^(b-127); 255 is NaN), for ENGRAM_TABLE_FP8_E4M3; ignored for bf16.
 * out          [num_tokens, num_cols, head_dim] device: bf16 for fp8 (16-byte aligned),
 *              the table's dtype for a float table (its rows copied; element-aligned).
 * bad_rows     NULL, or one int64 in device memory (8-byte aligned): every output row
 *              that read nothing (its id outside [0, table_num_rows)) adds 1 to it,
 *              atomically, when the kernel runs. It is never reset here: zero it, run
 *              any number of gathers, read it when convenient (a runtime checks it every
 *              N steps or in a debug mode and raises on a nonzero count).
 * Limits: fp8 needs head_dim % 16 == 0, quant_block % 16 == 0 and
 *         head_dim % quant_block == 0; float tables take any head_dim >= 1 (16-byte
 *         loads where the row bytes and addresses allow, narrower words otherwise).
 *         The host gather (engram_host_gather*) still takes fp8 and bf16 of
 *         head_dim % 8 == 0 only.
 */
ENGRAM_API int engram_gather(const int32_t* ids, int64_t num_tokens, int32_t num_cols, int64_t id_token_stride,
    const void* table_rows, const void* table_scales, int64_t table_num_rows, int32_t head_dim, int32_t table_dtype,
    int32_t quant_block, void* out, int64_t* bad_rows, cudaStream_t stream);

/*
 * engram_gather from a row slice of a table: table_rows / table_scales hold global rows
 * [row_offset, row_offset + table_num_rows) (a tensor-parallel rank's slice, its first
 * row at table_rows), and ids are global row ids, so token t's column c reads slice row
 * ids[...] - row_offset. An id outside the slice, below row_offset included, gives a
 * zero row and counts as a bad row: nothing before or after the slice is read.
 * row_offset in [0, 2^31 - 1] (ids are int32); the identity gather (ids NULL) needs
 * row_offset 0. A column range of a layer is a view of the ids: pass ids + l * cols +
 * column_begin, num_cols = column_end - column_begin and the full id_token_stride.
 * With row_offset 0 it is engram_gather, bit for bit.
 */
ENGRAM_API int engram_gather_ex(const int32_t* ids, int64_t num_tokens, int32_t num_cols, int64_t id_token_stride,
    const void* table_rows, const void* table_scales, int64_t table_num_rows, int64_t row_offset, int32_t head_dim,
    int32_t table_dtype, int32_t quant_block, void* out, int64_t* bad_rows, cudaStream_t stream);

/*
 * engram_gather_ex for part of the output or on part of the GPU; nothing is counted.
 * keep_outside 1: only the output rows whose id falls in the slice [row_offset,
 * row_offset + table_num_rows) are written, every other row of out is left as it was
 * (0: zero rows there, as engram_gather_ex). Two such calls over one id list, with
 * disjoint slices that cover every id, write each output row once, and they may run on
 * two streams: the hot-row cache delivers its hits (the cache's slots) while its misses
 * (the miss area after them) are still being fetched.
 * max_blocks > 0 caps the grid below one full wave (0: the wave): a gather of host rows
 * through UVA is bound by the host's address translations, not by the multiprocessors,
 * so a few of them may keep as many reads in flight while the rest stay free for other
 * work (a host gather's dequant kernels, the layers before an Engram layer).
 * ids are required.
 */
ENGRAM_API int engram_gather_part(const int32_t* ids, int64_t num_tokens, int32_t num_cols, int64_t id_token_stride,
    const void* table_rows, const void* table_scales, int64_t table_num_rows, int64_t row_offset, int32_t head_dim,
    int32_t table_dtype, int32_t quant_block, int32_t keep_outside, int32_t max_blocks, void* out, cudaStream_t stream);

/*
 * Raw rows, no dequant: dst_rows row i = table_rows row ids[i] (row_bytes, a multiple of
 * 16; rows and dst 16-byte aligned) and, with scale_bytes > 0, dst_scales row i =
 * table_scales row ids[i]; an id outside [0, table_num_rows) gives a zero row and scale
 * bytes 127 (2^0), as the host gather stages it. The table in device memory or in pinned
 * / registered host memory (UVA); ids and dst on the device. max_blocks as in
 * engram_gather_part. The hot-row cache reads a share of a step's misses this way, beside
 * the host gather (engram_cache_step's uva_share).
 */
ENGRAM_API int engram_gather_raw(const int32_t* ids, int64_t count, const void* table_rows, const void* table_scales,
    int64_t table_num_rows, int64_t row_bytes, int32_t scale_bytes, void* dst_rows, void* dst_scales,
    int32_t max_blocks, cudaStream_t stream);

/* The table-format checks engram_gather makes (head_dim, dtype, quant_block), alone. */
ENGRAM_API int engram_gather_check_table(int32_t head_dim, int32_t table_dtype, int32_t quant_block);

/*
 * engram_gather with the table addresses read on the device: table_rows_addr and
 * table_scales_addr point to one int64 each (in device memory) holding the address.
 * This is the plugin's form, where the addresses are engine inputs, so enqueue needs
 * no host synchronization. table_scales_addr may be NULL for bf16 tables.
 * Since no host code sees the addresses, the kernel checks them: a row address of 0 or
 * not 16-byte aligned (fp8; a float table: not aligned to its element), or a scales
 * address of 0 for an fp8 table, yields zero rows for
 * the whole output (no read, no fault). table_num_rows bounds the ids; the table behind
 * the address must hold at least that many rows, which only the caller can check.
 * bad_rows_addr: NULL, or one int64 in device memory holding the address of a bad-row
 * counter as engram_gather's bad_rows (0, or an address not 8-byte aligned: no count);
 * with unusable table addresses every row counts.
 */
ENGRAM_API int engram_gather_indirect(const int32_t* ids, int64_t num_tokens, int32_t num_cols, int64_t id_token_stride,
    const int64_t* table_rows_addr, const int64_t* table_scales_addr, int64_t table_num_rows, int32_t head_dim,
    int32_t table_dtype, int32_t quant_block, void* out, const int64_t* bad_rows_addr, cudaStream_t stream);

/* engram_gather_indirect from a row slice (row_offset as in engram_gather_ex): the
 * addresses point at the slice's first row, table_num_rows is the slice's row count.
 * The EngramGather plugin's form (fields column_begin, column_end, row_offset). */
ENGRAM_API int engram_gather_indirect_ex(const int32_t* ids, int64_t num_tokens, int32_t num_cols,
    int64_t id_token_stride, const int64_t* table_rows_addr, const int64_t* table_scales_addr, int64_t table_num_rows,
    int64_t row_offset, int32_t head_dim, int32_t table_dtype, int32_t quant_block, void* out,
    const int64_t* bad_rows_addr, cudaStream_t stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* ENGRAM_TRT_GATHER_KERNELS_H */
