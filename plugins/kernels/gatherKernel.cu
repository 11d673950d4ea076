// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * Row gather + dequantization: table row ids -> rows [T, cols, head_dim]: bf16 for an
 * fp8 table (dequantized), the table's own dtype for a float table (bf16, f16 or f32
 * rows of any width, copied as they are).
 *
 * The table may live in device memory or in pinned / registered host memory read
 * through UVA. Reads of host memory cross PCIe with microseconds of latency, so the
 * kernel is written for memory-level parallelism: every thread owns kUnroll 16-byte
 * vectors of (possibly different) rows and issues all their loads before it converts
 * and stores any of them; a grid-stride loop keeps the grid at one wave of as many
 * blocks as the occupancy calculator lets each multiprocessor hold. A 256-byte FP8 row
 * is 16 vectors, so one warp reads two rows per load instruction and holds 2 * kUnroll
 * rows in flight.
 *
 * Scale bytes: where a row's vectors fall in one warp (16 * 32 % row bytes == 0, e.g. 128,
 * 256 or 512-byte rows) each scale byte is loaded once per row, by one lane, and handed
 * to the lanes of its quant block with a shuffle after all loads are in flight; other
 * row widths load the scale byte per vector.
 *
 * Rows that read nothing (an id outside [row_offset, row_offset + table_num_rows), or,
 * for the indirect form, a table address of 0 / misaligned / an fp8 table without
 * scales) are written as zero rows; when the caller passes a counter, each such row adds
 * 1 to it (one atomic per warp), so a runtime can tell a forgotten binding from a real
 * table.
 *
 * A partial gather (engram_gather_part) leaves the output rows whose id falls outside
 * the table as they are instead of zeroing them: two calls over one id list, each with
 * its own row range, then write every row once (the hot-row cache delivers its hits
 * while the misses are still being fetched). Its grid may be capped, so a gather of
 * host rows through UVA can share the GPU with other work.
 *
 * Row slices: a tensor-parallel rank holds rows [row_offset, row_offset + num_rows) of a
 * layer's table and passes that slice (its first row at table_rows) with the global ids.
 * The id's table row is computed in 32 bits, uint32(id) - row_offset: an id below
 * row_offset, negative ones included, wraps to at least 2^31 - row_offset, which the
 * launch makes the bound of the row count (ids are int32, so no row at or past global
 * id 2^31 can be asked for). One unsigned compare then rejects ids on both sides of the
 * slice, as many instructions as the signed test of an offset-free gather.
 *
 * FP8 decode: e4m3 -> half (exact) -> float, times the ue8m0 scale 2^(b-127) (exact in
 * float32, denormals kept), rounded once to bf16 (round-to-nearest-even), which is
 * what dequant_fp8_rows(...) followed by a bf16 cast gives.
 *
 * Float rows (bf16 / f16 / f32) are moved as words of the widest size, 16, 8, 4 or 2
 * bytes, that divides the row's bytes, the table address and the output address: a
 * 64-wide bf16 row is 8 16-byte vectors as before, a 4-wide bf16 row (8 bytes) one 8-byte
 * word, a 3-wide one three 2-byte words. The choice is made on the device, once per
 * thread, since the indirect form's table address is only known there; every thread
 * takes the same branch. A float table address must be aligned to its element (2 or 4
 * bytes): an address that is not is unusable, as a 0 is.
 *
 * The argument checks and the C ABI entry points live in gatherApi.cpp.
 */
#include "engramKernelsInternal.h"
#include "gatherKernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <mutex>
#include <vector>

namespace engram_trt
{
namespace kernels
{

struct GatherParams
{
    int32_t const* ids; // nullptr: identity (row r reads table row r)
    uint8_t const* rows;
    uint8_t const* scales;
    int64_t const* rowsAddr;     // non-null: read rows from *rowsAddr on the device
    int64_t const* scalesAddr;   // non-null: read scales from *scalesAddr on the device
    unsigned long long* badRows; // non-null: count of rows that read nothing
    int64_t const* badRowsAddr;  // non-null: read the counter's address from *badRowsAddr (0 = none)
    uint4* out;
    int64_t numRowsOut; // num_tokens * num_cols
    int64_t idTokenStride;
    int64_t tableNumRows;
    int64_t rowBytes;  // input bytes of one table row
    int32_t elemBytes; // bytes of one table element: 1 (fp8), 2 (bf16 / f16) or 4 (f32)
    int32_t numCols;
    int32_t vectorsPerRow; // rowBytes / 16 (fp8; float rows pick their word on the device)
    int32_t scalesPerRow;  // head_dim / quant_block (fp8)
    int32_t quantBlock;
    uint32_t rowOffset; // global id of the table's first row (with ids; the launch caps tableNumRows at 2^31 - it)
    bool keepOutside;   // an output row whose id is outside the table is left as it is (no store, no count)
};

__device__ __forceinline__ float ue8m0ToFloat(uint32_t b)
{
    if (b == 0xFFu)
    {
        return __int_as_float(0x7FC00000); // e8m0 NaN
    }
    if (b == 0u)
    {
        return __int_as_float(0x00400000); // 2^-127: a float32 denormal
    }
    return __int_as_float(static_cast<int>(b << 23));
}

__device__ __forceinline__ uint32_t packBf16x2(float lo, float hi)
{
    __nv_bfloat162 const v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t const*>(&v);
}

//! Decodes 4 fp8 e4m3 bytes (one 32-bit word) times `scale` into 4 bf16 (two words).
__device__ __forceinline__ uint2 decodeFp8x4(uint32_t word, float scale)
{
    __half2_raw const lo = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(word & 0xFFFFu), __NV_E4M3);
    __half2_raw const hi = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(word >> 16), __NV_E4M3);
    float2 const a = __half22float2(*reinterpret_cast<__half2 const*>(&lo));
    float2 const b = __half22float2(*reinterpret_cast<__half2 const*>(&hi));
    return make_uint2(packBf16x2(a.x * scale, a.y * scale), packBf16x2(b.x * scale, b.y * scale));
}

//! The widest word, 16, 8, 4 or 2 bytes (1 for an odd address), that divides rowBytes
//! and both addresses: the lowest set bit of their OR, capped at 16.
__device__ __forceinline__ int32_t floatWordBytes(int64_t rowBytes, uintptr_t a, uintptr_t b)
{
    uintptr_t const bits = static_cast<uintptr_t>(rowBytes) | a | b | uintptr_t{16};
    return static_cast<int32_t>(bits & (~bits + 1));
}

//! Float rows moved as `Word`s (rowBytes, rows and p.out are multiples of its size): the
//! fp8 kernel's loop without the decode, every load issued before any store. Output word
//! v of the flat [rows, words per row] output is row v / wpr's word v % wpr, so the store
//! index is the loop index itself.
template <typename Word, bool kCount, int kUnroll>
__device__ __forceinline__ void copyFloatRows(
    GatherParams const& p, uint8_t const* rows, int64_t tableNumRows, uint32_t& bad)
{
    int64_t const wpr = p.rowBytes / static_cast<int64_t>(sizeof(Word));
    int64_t const total = p.numRowsOut * wpr;
    int64_t const stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    Word* out = reinterpret_cast<Word*>(p.out);
    for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; base < total;
        base += stride * kUnroll)
    {
        Word data[kUnroll];
        int64_t dst[kUnroll];
#pragma unroll
        for (int k = 0; k < kUnroll; ++k)
        {
            int64_t const v = base + k * stride;
            data[k] = Word{};
            dst[k] = -1;
            if (v < total)
            {
                int64_t const r = v / wpr;
                int64_t const j = v - r * wpr;
                dst[k] = v;
                int64_t id = r;
                if (p.ids != nullptr)
                {
                    int64_t const t = r / p.numCols;
                    id = static_cast<uint32_t>(p.ids[t * p.idTokenStride + (r - t * p.numCols)]) - p.rowOffset;
                }
                if (static_cast<uint64_t>(id) < static_cast<uint64_t>(tableNumRows))
                {
                    data[k] = *reinterpret_cast<Word const*>(
                        rows + id * p.rowBytes + j * static_cast<int64_t>(sizeof(Word)));
                }
                else if (p.keepOutside)
                {
                    dst[k] = -1;
                }
                else if (kCount && j == 0)
                {
                    ++bad;
                }
            }
        }
#pragma unroll
        for (int k = 0; k < kUnroll; ++k)
        {
            if (dst[k] >= 0)
            {
                out[dst[k]] = data[k];
            }
        }
    }
}

//! kCount: count the rows that read nothing into p.badRows / *p.badRowsAddr (a separate
//! instantiation: the count's registers would otherwise cost the plain gather occupancy).
//! kRowScales (fp8, rows of 16 * 2^k bytes <= 512 whose vectors share a warp): each scale
//! byte is loaded by one lane of its row and shuffled to the others.
template <bool kFp8, bool kCount, bool kRowScales, int kUnroll>
__global__ void __launch_bounds__(256) engramGatherKernel(GatherParams const p)
{
    uint8_t const* rows = p.rows;
    uint8_t const* scales = p.scales;
    unsigned long long* badRows = p.badRows;
    int64_t tableNumRows = p.tableNumRows;
    if (kCount && p.badRowsAddr != nullptr)
    {
        // An engine input too: 0 means no count, and a misaligned address is not followed.
        int64_t const address = *p.badRowsAddr;
        badRows = (address & 7) == 0 ? reinterpret_cast<unsigned long long*>(address) : nullptr;
    }
    if (p.rowsAddr != nullptr)
    {
        rows = reinterpret_cast<uint8_t const*>(*p.rowsAddr);
        scales = (kFp8 && p.scalesAddr != nullptr) ? reinterpret_cast<uint8_t const*>(*p.scalesAddr) : nullptr;
        // These addresses are engine inputs that no host code sees before this kernel
        // runs. An unbound (0) or misaligned row address, or an fp8 table without scales,
        // would fault and take the whole CUDA context down; read no table instead, so
        // every id is out of range and the output is all zero rows (fp8 zero * scale 0).
        // A float table needs its element's alignment only (its word follows below).
        uintptr_t const alignMask = kFp8 ? 15u : static_cast<uintptr_t>(p.elemBytes - 1);
        bool const usable
            = rows != nullptr && (reinterpret_cast<uintptr_t>(rows) & alignMask) == 0 && (!kFp8 || scales != nullptr);
        if (!usable)
        {
            tableNumRows = 0;
        }
    }

    int32_t const lane = static_cast<int32_t>(threadIdx.x) & 31;
    uint32_t bad = 0;
    if constexpr (!kFp8)
    {
        // The direct form's table address was checked at the launch, the indirect one's
        // above: both are element-aligned when rows are read, so the word is >= 2 bytes.
        uintptr_t const rowsBits = tableNumRows > 0 ? reinterpret_cast<uintptr_t>(rows) : 0;
        int32_t const word = floatWordBytes(p.rowBytes, rowsBits, reinterpret_cast<uintptr_t>(p.out));
        if (word >= 16)
        {
            copyFloatRows<uint4, kCount, kUnroll>(p, rows, tableNumRows, bad);
        }
        else if (word == 8)
        {
            copyFloatRows<uint2, kCount, kUnroll>(p, rows, tableNumRows, bad);
        }
        else if (word == 4)
        {
            copyFloatRows<uint32_t, kCount, kUnroll>(p, rows, tableNumRows, bad);
        }
        else
        {
            copyFloatRows<uint16_t, kCount, kUnroll>(p, rows, tableNumRows, bad);
        }
    }
    else
    {
        int32_t const vpr = p.vectorsPerRow;
        int64_t const totalVectors = p.numRowsOut * vpr;
        int64_t const stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
        // With kRowScales the loop runs on the warp's first vector, so all 32 lanes take the
        // same iterations (the shuffles need every lane); a row's vectors then share a warp
        // because vpr divides 32 and every vector index v is lane (mod 32) (blockDim.x and
        // the grid stride are multiples of 32). Otherwise each lane loops on its own vector.
        int64_t const first
            = static_cast<int64_t>(blockIdx.x) * blockDim.x + (kRowScales ? threadIdx.x & ~31u : threadIdx.x);
        for (int64_t loopBase = first; loopBase < totalVectors; loopBase += stride * kUnroll)
        {
            int64_t const base = kRowScales ? loopBase + lane : loopBase;
            uint4 data[kUnroll];
            uint32_t scaleByte[kUnroll];
            int64_t outRow[kUnroll];
            int32_t vec[kUnroll];
            // Phase 1: resolve ids and issue every load before using any of them.
#pragma unroll
            for (int k = 0; k < kUnroll; ++k)
            {
                int64_t const v = base + k * stride;
                data[k] = make_uint4(0, 0, 0, 0);
                scaleByte[k] = 0; // 2^-127 * 0 = 0 for the zero rows
                outRow[k] = -1;
                vec[k] = 0;
                if (v < totalVectors)
                {
                    int64_t const r = v / vpr;
                    int32_t const j = static_cast<int32_t>(v - r * vpr);
                    outRow[k] = r;
                    vec[k] = j;
                    int64_t id = r; // the table row: output row r (identity), or the id less rowOffset
                    if (p.ids != nullptr)
                    {
                        // 32-bit wrap: an id below rowOffset becomes >= 2^31 - rowOffset >= tableNumRows.
                        int64_t const t = r / p.numCols;
                        id = static_cast<uint32_t>(p.ids[t * p.idTokenStride + (r - t * p.numCols)]) - p.rowOffset;
                    }
                    if (static_cast<uint64_t>(id) < static_cast<uint64_t>(tableNumRows))
                    {
                        data[k]
                            = *reinterpret_cast<uint4 const*>(rows + id * p.rowBytes + static_cast<int64_t>(j) * 16);
                        if (kFp8)
                        {
                            if (kRowScales)
                            {
                                if (j < p.scalesPerRow) // lane j of the row loads the row's scale byte j
                                {
                                    scaleByte[k] = scales[id * p.scalesPerRow + j];
                                }
                            }
                            else
                            {
                                scaleByte[k] = scales[id * p.scalesPerRow + (j * 16) / p.quantBlock];
                            }
                        }
                    }
                    else if (p.keepOutside)
                    {
                        outRow[k] = -1; // another call writes this row (engram_gather_part)
                    }
                    else if (kCount && j == 0)
                    {
                        ++bad; // one count per row, by its first vector's lane
                    }
                }
            }
            // Phase 2: convert and store.
#pragma unroll
            for (int k = 0; k < kUnroll; ++k)
            {
                if (kRowScales)
                {
                    // The byte of this vector's quant block, from the row's lane that loaded it.
                    int32_t const leader = lane - vec[k];
                    scaleByte[k] = __shfl_sync(0xFFFFFFFFu, scaleByte[k], leader + (vec[k] * 16) / p.quantBlock);
                }
                if (outRow[k] < 0)
                {
                    continue;
                }
                if (kFp8)
                {
                    // 16 fp8 in -> 16 bf16 out = two 16-byte stores; out row is 2 * vectorsPerRow vectors.
                    // A row that read nothing holds zero bytes and scale byte 0 (2^-127): +0.
                    float const scale = ue8m0ToFloat(scaleByte[k]);
                    uint2 const a = decodeFp8x4(data[k].x, scale);
                    uint2 const b = decodeFp8x4(data[k].y, scale);
                    uint2 const c = decodeFp8x4(data[k].z, scale);
                    uint2 const d = decodeFp8x4(data[k].w, scale);
                    uint4* dst = p.out + outRow[k] * (2 * vpr) + 2 * vec[k];
                    dst[0] = make_uint4(a.x, a.y, b.x, b.y);
                    dst[1] = make_uint4(c.x, c.y, d.x, d.y);
                }
                else
                {
                    p.out[outRow[k] * vpr + vec[k]] = data[k];
                }
            }
        }
    }
    if (kCount && badRows != nullptr)
    {
#if __CUDA_ARCH__ >= 800
        uint32_t const warpBad = __reduce_add_sync(0xFFFFFFFFu, bad);
#else
        uint32_t warpBad = bad;
        for (int offset = 16; offset > 0; offset >>= 1)
        {
            warpBad += __shfl_xor_sync(0xFFFFFFFFu, warpBad, offset);
        }
#endif
        if (lane == 0 && warpBad != 0)
        {
            atomicAdd(badRows, static_cast<unsigned long long>(warpBad));
        }
    }
}

namespace
{

constexpr int kGatherThreads = 256;
constexpr int kGatherUnroll = 4;

template <bool kFp8, bool kCount, bool kRowScales>
void launchVariant(unsigned blocks, cudaStream_t stream, GatherParams const& p)
{
    engramGatherKernel<kFp8, kCount, kRowScales, kGatherUnroll><<<blocks, kGatherThreads, 0, stream>>>(p);
}

template <bool kFp8, bool kCount, bool kRowScales>
int queryBlocksPerSm()
{
    int blocks = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(
            &blocks, engramGatherKernel<kFp8, kCount, kRowScales, kGatherUnroll>, kGatherThreads, 0)
        != cudaSuccess)
    {
        cudaGetLastError(); // leave no error behind; the launch reports a real problem
        blocks = 0;
    }
    return blocks;
}

//! The kernel variant of a call: (fp8, count, rowScales) as an index 0..7.
using VariantLauncher = void (*)(unsigned, cudaStream_t, GatherParams const&);
using VariantQuery = int (*)();
template <int kIndex>
constexpr bool bit(int b)
{
    return ((kIndex >> b) & 1) != 0;
}
template <int kIndex>
void launchIndexed(unsigned blocks, cudaStream_t stream, GatherParams const& p)
{
    launchVariant<bit<kIndex>(2), bit<kIndex>(1), bit<kIndex>(2) && bit<kIndex>(0)>(blocks, stream, p);
}
template <int kIndex>
int queryIndexed()
{
    return queryBlocksPerSm<bit<kIndex>(2), bit<kIndex>(1), bit<kIndex>(2) && bit<kIndex>(0)>();
}
constexpr VariantLauncher kLaunchers[8] = {launchIndexed<0>, launchIndexed<1>, launchIndexed<2>, launchIndexed<3>,
    launchIndexed<4>, launchIndexed<5>, launchIndexed<6>, launchIndexed<7>};
constexpr VariantQuery kQueries[8] = {queryIndexed<0>, queryIndexed<1>, queryIndexed<2>, queryIndexed<3>,
    queryIndexed<4>, queryIndexed<5>, queryIndexed<6>, queryIndexed<7>};

//! Resident blocks per multiprocessor of a gather kernel variant on the current device,
//! from the occupancy calculator (registers decide, e.g. 5 blocks of 256 threads for the
//! plain fp8 kernel on sm_90, not the 8 that 2048 threads would suggest); cached per
//! device. At least 1.
int gatherBlocksPerSm(int variant)
{
    static std::mutex mutex;
    static std::vector<int> cache; // [device * 8 + variant]: 0 = not asked yet
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess)
    {
        cudaGetLastError();
        return 1;
    }
    std::lock_guard<std::mutex> lock(mutex);
    size_t const slot = static_cast<size_t>(device) * 8 + static_cast<size_t>(variant);
    if (slot >= cache.size())
    {
        cache.resize(slot + 1, 0);
    }
    if (cache[slot] == 0)
    {
        cache[slot] = std::max(1, kQueries[variant]());
    }
    return cache[slot];
}

} // namespace

struct DequantStagedParams
{
    uint8_t const* staged; // count rows of vectorsPerRow * 16 bytes
    int32_t const* ids;    // the call's ids in device memory
    uint8_t const* scales; // the table's scale bytes in device memory [tableNumRows, scalesPerRow]
    uint4* out;
    int64_t firstRow; // the chunk's first flat row of the call
    int64_t count;
    int64_t idTokenStride;
    int64_t tableNumRows;
    int32_t numCols;
    int32_t vectorsPerRow;
    int32_t scalesPerRow;
    int32_t quantBlock;
};

//! The host gather's dequant when a table's scale bytes live in HBM: one thread per
//! 16-byte vector of a staged row, its scale byte read by the row's id (launchDequantStaged).
//! Every read is of device memory (the staged chunk, the ids, a row's few scale bytes), so
//! one vector per thread and iteration hides the latency well enough.
__global__ void __launch_bounds__(256) engramDequantStagedKernel(DequantStagedParams const p)
{
    int32_t const vpr = p.vectorsPerRow;
    int64_t const total = p.count * vpr;
    int64_t const stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < total; v += stride)
    {
        int64_t const r = v / vpr;
        int32_t const j = static_cast<int32_t>(v - r * vpr);
        int64_t const flat = p.firstRow + r;
        int64_t const t = flat / p.numCols;
        int64_t const id = p.ids[t * p.idTokenStride + (flat - t * p.numCols)];
        uint4 const data = *reinterpret_cast<uint4 const*>(p.staged + (r * vpr + j) * 16);
        // An id outside the table was staged as a zero row: scale byte 127 (2^0) keeps it +0.
        uint32_t const scaleByte = static_cast<uint64_t>(id) < static_cast<uint64_t>(p.tableNumRows)
            ? p.scales[id * p.scalesPerRow + (j * 16) / p.quantBlock]
            : 127u;
        float const scale = ue8m0ToFloat(scaleByte);
        uint2 const a = decodeFp8x4(data.x, scale);
        uint2 const b = decodeFp8x4(data.y, scale);
        uint2 const c = decodeFp8x4(data.z, scale);
        uint2 const d = decodeFp8x4(data.w, scale);
        uint4* dst = p.out + r * (2 * vpr) + 2 * j;
        dst[0] = make_uint4(a.x, a.y, b.x, b.y);
        dst[1] = make_uint4(c.x, c.y, d.x, d.y);
    }
}

int launchDequantStaged(uint8_t const* staged, int32_t const* idsDev, int64_t firstRow, int64_t count, int32_t numCols,
    int64_t idTokenStride, uint8_t const* scales, int64_t tableNumRows, int32_t headDim, int32_t quantBlock, void* out,
    cudaStream_t stream)
{
    if (count <= 0)
    {
        return 0;
    }
    DequantStagedParams p{};
    p.staged = staged;
    p.ids = idsDev;
    p.scales = scales;
    p.out = static_cast<uint4*>(out);
    p.firstRow = firstRow;
    p.count = count;
    p.idTokenStride = idTokenStride;
    p.tableNumRows = tableNumRows;
    p.numCols = numCols;
    p.vectorsPerRow = headDim / 16;
    p.scalesPerRow = headDim / quantBlock;
    p.quantBlock = quantBlock;
    int64_t const total = count * p.vectorsPerRow;
    int64_t const wanted = (total + kGatherThreads - 1) / kGatherThreads;
    int64_t const cap = static_cast<int64_t>(std::max(1, smCount())) * 8;
    resetLaunchError();
    engramDequantStagedKernel<<<static_cast<unsigned>(std::min(wanted, cap)), kGatherThreads, 0, stream>>>(p);
    return checkLaunch("engram_host_gather (dequant, scales in HBM)");
}

//! The raw host gather's scale bytes when a table's scales live in HBM (launchGatherScaleBytes):
//! one thread per output byte, dst[r * scaleBytes + j] = scales[ids[r] * scaleBytes + j]. A
//! row's few bytes share a sector, so a warp's random reads are one sector per row.
__global__ void __launch_bounds__(256) engramGatherScaleBytesKernel(int32_t const* __restrict__ ids, int64_t count,
    uint8_t const* __restrict__ scales, int64_t tableNumRows, int32_t scaleBytes, uint8_t* __restrict__ dst)
{
    int64_t const total = count * scaleBytes;
    int64_t const stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < total; v += stride)
    {
        int64_t const r = v / scaleBytes;
        int64_t const id = ids[r];
        // An id outside the table is a zero row (the host side stages zeros): scale byte 127
        // (2^0), what the host gather writes for it in the other layouts.
        dst[v] = static_cast<uint64_t>(id) < static_cast<uint64_t>(tableNumRows)
            ? scales[id * scaleBytes + (v - r * scaleBytes)]
            : static_cast<uint8_t>(127);
    }
}

int launchGatherScaleBytes(int32_t const* idsDev, int64_t count, uint8_t const* scales, int64_t tableNumRows,
    int32_t scaleBytes, uint8_t* dst, cudaStream_t stream)
{
    if (count <= 0 || scaleBytes <= 0)
    {
        return 0;
    }
    int64_t const total = count * scaleBytes;
    int64_t const wanted = (total + kGatherThreads - 1) / kGatherThreads;
    int64_t const cap = static_cast<int64_t>(std::max(1, smCount())) * 8;
    resetLaunchError();
    engramGatherScaleBytesKernel<<<static_cast<unsigned>(std::min(wanted, cap)), kGatherThreads, 0, stream>>>(
        idsDev, count, scales, tableNumRows, scaleBytes, dst);
    return checkLaunch("engram_host_gather_raw (scale bytes, scales in HBM)");
}

int preloadGatherKernels()
{
    for (int variant = 0; variant < 8; ++variant)
    {
        // The occupancy query needs the kernel's resources: it loads the kernel (lazy
        // loading), once per device (gatherBlocksPerSm caches it).
        gatherBlocksPerSm(variant);
    }
    cudaFuncAttributes attributes{};
    for (void const* kernel : {reinterpret_cast<void const*>(engramDequantStagedKernel),
             reinterpret_cast<void const*>(engramGatherScaleBytesKernel)})
    {
        if (cudaFuncGetAttributes(&attributes, kernel) != cudaSuccess)
        {
            cudaGetLastError(); // the launch reports a real problem
        }
    }
    return 0;
}

int32_t gatherElemBytes(int32_t tableDtype)
{
    switch (tableDtype)
    {
    case ENGRAM_TABLE_FP8_E4M3: return 1;
    case ENGRAM_TABLE_BF16:
    case ENGRAM_TABLE_F16: return 2;
    case ENGRAM_TABLE_F32: return 4;
    default: return 0;
    }
}

namespace
{
//! floatWordBytes on the host, for the grid's size: rows may be null (indirect form).
int64_t hostFloatWordBytes(int64_t rowBytes, void const* rows, void const* out)
{
    uintptr_t const bits = static_cast<uintptr_t>(rowBytes) | reinterpret_cast<uintptr_t>(rows)
        | reinterpret_cast<uintptr_t>(out) | uintptr_t{16};
    return static_cast<int64_t>(bits & (~bits + 1));
}
} // namespace

int launchGather(int32_t const* ids, int64_t numTokens, int32_t numCols, int64_t idTokenStride, void const* rows,
    void const* scales, int64_t const* rowsAddr, int64_t const* scalesAddr, int64_t tableNumRows, int32_t headDim,
    int32_t tableDtype, int32_t quantBlock, void* out, cudaStream_t stream, int64_t* badRows,
    int64_t const* badRowsAddr, int64_t rowOffset, bool keepOutside, int32_t maxBlocks)
{
    bool const fp8 = tableDtype == ENGRAM_TABLE_FP8_E4M3;
    int32_t const elemBytes = gatherElemBytes(tableDtype);
    GatherParams p{};
    p.ids = ids;
    p.rows = static_cast<uint8_t const*>(rows);
    p.scales = static_cast<uint8_t const*>(scales);
    p.rowsAddr = rowsAddr;
    p.scalesAddr = scalesAddr;
    p.badRows = reinterpret_cast<unsigned long long*>(badRows);
    p.badRowsAddr = badRowsAddr;
    p.out = static_cast<uint4*>(out);
    p.numRowsOut = numTokens * numCols;
    p.idTokenStride = idTokenStride;
    // With ids, rows at or past global id 2^31 cannot be asked for (ids are int32); the
    // cap is also what makes the kernel's 32-bit wrap reject every id below rowOffset.
    int64_t const idRowLimit = (int64_t{1} << 31) - rowOffset;
    p.tableNumRows = ids != nullptr ? std::min(tableNumRows, idRowLimit) : tableNumRows;
    p.rowOffset = static_cast<uint32_t>(rowOffset);
    p.rowBytes = static_cast<int64_t>(elemBytes) * headDim;
    p.elemBytes = elemBytes;
    p.numCols = numCols;
    p.vectorsPerRow = fp8 ? static_cast<int32_t>(p.rowBytes / 16) : 0;
    p.scalesPerRow = fp8 ? headDim / quantBlock : 0;
    p.quantBlock = fp8 ? quantBlock : 1;
    p.keepOutside = keepOutside;
    if (p.numRowsOut == 0)
    {
        return 0;
    }

    // Float rows: the words the kernel will move, as far as the host can tell (the
    // indirect form's table address may narrow them on the device; the wave caps the grid).
    int64_t const hostWord = fp8 ? 16 : hostFloatWordBytes(p.rowBytes, rows, out);
    int64_t const totalVectors = p.numRowsOut * (fp8 ? p.vectorsPerRow : p.rowBytes / hostWord);
    int64_t const wanted = (totalVectors + kGatherThreads * kGatherUnroll - 1) / (kGatherThreads * kGatherUnroll);
    // One wave of resident blocks, no more: the grid-stride loop covers the rest.
    bool const count = badRows != nullptr || badRowsAddr != nullptr;
    bool const rowScales = fp8 && (32 % p.vectorsPerRow) == 0;
    int const variant = (fp8 ? 4 : 0) + (count ? 2 : 0) + (rowScales ? 1 : 0);
    int64_t const wave = static_cast<int64_t>(std::max(1, smCount())) * gatherBlocksPerSm(variant);
    int64_t const cap = maxBlocks > 0 ? std::min<int64_t>(wave, maxBlocks) : wave;
    unsigned const blocks = static_cast<unsigned>(std::min(wanted, cap));
    resetLaunchError();
    kLaunchers[variant](blocks, stream, p);
    return checkLaunch("engram_gather");
}

} // namespace kernels
} // namespace engram_trt
