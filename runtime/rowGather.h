// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * The CPU part of the host gather: copy table rows (and their scale bytes) picked by ids
 * into a contiguous staging buffer. Pure C++ (no CUDA), so it is unit-tested on machines
 * without a GPU (runtime/tests/hostGatherTest.cpp and, through the C ABI's
 * engram_host_gather_rows_cpu, from Python).
 *
 * Rows are random in a table of many GiB: each costs a DRAM miss and, with 4 KiB pages,
 * a TLB miss (a page walk that itself misses the caches). What the loop does about it:
 *   - the inline layout keeps a row's scale bytes right after it, so a row is one miss
 *     (5 cache lines for 256 + 8 bytes) instead of two (the row and its scale line in
 *     another array, another page);
 *   - software prefetch `prefetchRows` rows ahead keeps several rows' misses in flight
 *     per thread (the first rows of a range are prefetched together up front), and
 *     optionally the first line of the row `prefetchFarRows` ahead, which starts its page
 *     walk early (a TLB miss on 4 KiB pages in a VM is a nested walk: the longest part of
 *     a random row's latency); `prefetchLocality` picks the cache level prefetched into;
 *   - streaming (non-temporal) stores (a knob, off by default) write staging without
 *     first reading each line; but on the H200 host (300 MB L3) plain stores measured
 *     faster: staging written with them stays in the caches, where the copy engine reads
 *     it, while streaming stores send it to DRAM and back.
 * The staging is written in the split form whatever the table layout (a chunk's rows,
 * then its scale bytes), which is what the GPU-side dequant reads.
 *
 * Ids outside [0, numRows) give zero rows with scale bytes 127 (2^0): they dequantize to
 * zeros, as the GPU gather's out-of-range rows do.
 */
#ifndef ENGRAM_TRT_ROW_GATHER_H
#define ENGRAM_TRT_ROW_GATHER_H

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <emmintrin.h>
#define ENGRAM_HAVE_SSE2_STREAM 1
#else
#define ENGRAM_HAVE_SSE2_STREAM 0
#endif

namespace engram_trt
{
namespace kernels
{

//! Scale byte written for an out-of-range id (ue8m0 127 = 2^0).
constexpr uint8_t kZeroRowScale = 127;
//! Largest software prefetch distance accepted (rows).
constexpr int kMaxPrefetchRows = 64;

//! A host table: split (rows and scales in two arrays) or inline (one array whose rows
//! are rowBytes + scaleBytes long, scales after the values).
struct RowTable
{
    uint8_t const* rows{nullptr};
    uint8_t const* scales{nullptr}; // split layout only; unused when scaleBytes == 0
    int64_t numRows{0};
    int64_t rowBytes{0};   // value bytes of a row (fp8: head_dim; bf16: 2 * head_dim)
    int64_t scaleBytes{0}; // scale bytes of a row (fp8: head_dim / quant_block; bf16: 0)
    bool inlineScales{false};

    int64_t pitch() const
    {
        return inlineScales ? rowBytes + scaleBytes : rowBytes;
    }
};

//! The flattened (token, column) list of ids: element r is token r / numCols, column
//! r % numCols, at ids[token * tokenStride + column].
struct RowIds
{
    int32_t const* ids{nullptr};
    int64_t numCols{1};
    int64_t tokenStride{1};

    int64_t at(int64_t r) const
    {
        if (tokenStride == numCols)
        {
            return ids[r];
        }
        int64_t const t = r / numCols;
        return ids[t * tokenStride + (r - t * numCols)];
    }
};

struct GatherTuning
{
    int prefetchRows{16};    // rows ahead whose lines are prefetched (0: none)
    int prefetchFarRows{0};  // rows ahead whose first line is prefetched, to start the page walk early (0: none)
    int prefetchLocality{3}; // __builtin_prefetch locality: 3 = into L1 (prefetcht0) .. 1 = into L2/L3 (prefetcht2)
    bool streamingStores{false};
};

namespace detail
{

template <int kLocality>
inline void prefetchRow(RowTable const& t, int64_t id)
{
    if (id < 0 || id >= t.numRows)
    {
        return;
    }
    int64_t const pitch = t.pitch();
    uint8_t const* src = t.rows + id * pitch;
    int64_t const head = static_cast<int64_t>(reinterpret_cast<uintptr_t>(src) & 63u);
    uint8_t const* line = src - head;
    int64_t const span = t.inlineScales ? pitch : t.rowBytes;
    for (int64_t off = 0; off < head + span; off += 64)
    {
        __builtin_prefetch(line + off, 0, kLocality);
    }
    if (!t.inlineScales && t.scaleBytes > 0)
    {
        __builtin_prefetch(t.scales + id * t.scaleBytes, 0, kLocality);
    }
}

//! The first line of a row (and of its scales): touching it early starts the row's page
//! walk, so the full prefetch later finds the translation cached.
template <int kLocality>
inline void prefetchFirstLine(RowTable const& t, int64_t id)
{
    if (id < 0 || id >= t.numRows)
    {
        return;
    }
    __builtin_prefetch(t.rows + id * t.pitch(), 0, kLocality);
    if (!t.inlineScales && t.scaleBytes > 0)
    {
        __builtin_prefetch(t.scales + id * t.scaleBytes, 0, kLocality);
    }
}

template <bool kStream>
inline void copyValues(uint8_t* dst, uint8_t const* src, int64_t bytes)
{
#if ENGRAM_HAVE_SSE2_STREAM
    if (kStream)
    {
        // bytes is a multiple of 16 and dst 16-byte aligned (checked by the caller).
        for (int64_t k = 0; k < bytes; k += 16)
        {
            _mm_stream_si128(
                reinterpret_cast<__m128i*>(dst + k), _mm_loadu_si128(reinterpret_cast<__m128i const*>(src + k)));
        }
        return;
    }
#endif
    std::memcpy(dst, src, static_cast<size_t>(bytes));
}

inline void copyScales(uint8_t* dst, uint8_t const* src, int64_t bytes)
{
    if (bytes == 8)
    {
        uint64_t v;
        std::memcpy(&v, src, 8);
        std::memcpy(dst, &v, 8);
    }
    else
    {
        std::memcpy(dst, src, static_cast<size_t>(bytes));
    }
}

template <bool kStream, int kLocality>
void gatherRowsImpl(RowIds const& ids, int64_t begin, int64_t end, RowTable const& t, uint8_t* dstRows,
    uint8_t* dstScales, GatherTuning const& tuning)
{
    int64_t const pitch = t.pitch();
    int64_t const ahead = std::max(0, std::min(tuning.prefetchRows, kMaxPrefetchRows));
    int64_t const far = std::max(0, std::min(tuning.prefetchFarRows, kMaxPrefetchRows));
    if (far > ahead)
    {
        int64_t const warm = std::min(end, begin + far);
        for (int64_t r = begin + ahead; r < warm; ++r)
        {
            prefetchFirstLine<kLocality>(t, ids.at(r));
        }
    }
    if (ahead > 0)
    {
        // The first rows' misses overlap each other instead of being taken one by one.
        int64_t const warm = std::min(end, begin + ahead);
        for (int64_t r = begin; r < warm; ++r)
        {
            prefetchRow<kLocality>(t, ids.at(r));
        }
    }
    for (int64_t r = begin; r < end; ++r)
    {
        if (far > ahead && r + far < end)
        {
            prefetchFirstLine<kLocality>(t, ids.at(r + far));
        }
        if (ahead > 0 && r + ahead < end)
        {
            prefetchRow<kLocality>(t, ids.at(r + ahead));
        }
        int64_t const id = ids.at(r);
        uint8_t* dst = dstRows + (r - begin) * t.rowBytes;
        uint8_t* dstScale = dstScales + (r - begin) * t.scaleBytes;
        if (id >= 0 && id < t.numRows)
        {
            uint8_t const* src = t.rows + id * pitch;
            copyValues<kStream>(dst, src, t.rowBytes);
            if (t.scaleBytes > 0)
            {
                copyScales(dstScale, t.inlineScales ? src + t.rowBytes : t.scales + id * t.scaleBytes, t.scaleBytes);
            }
        }
        else
        {
            std::memset(dst, 0, static_cast<size_t>(t.rowBytes));
            if (t.scaleBytes > 0)
            {
                std::memset(dstScale, kZeroRowScale, static_cast<size_t>(t.scaleBytes));
            }
        }
    }
#if ENGRAM_HAVE_SSE2_STREAM
    if (kStream)
    {
        _mm_sfence(); // streaming stores are weakly ordered: drain them before the range is reported done
    }
#endif
}

} // namespace detail

//! True when streaming stores can be used for rows written at dstRows (16-byte aligned,
//! rows a multiple of 16 bytes, and an x86 CPU).
inline bool canStream(uint8_t const* dstRows, int64_t rowBytes)
{
    return ENGRAM_HAVE_SSE2_STREAM && (reinterpret_cast<uintptr_t>(dstRows) & 15u) == 0 && rowBytes % 16 == 0;
}

namespace detail
{
template <bool kStream>
inline void gatherRowsStore(RowIds const& ids, int64_t begin, int64_t end, RowTable const& t, uint8_t* dstRows,
    uint8_t* dstScales, GatherTuning const& tuning)
{
    switch (tuning.prefetchLocality)
    {
    case 0: gatherRowsImpl<kStream, 0>(ids, begin, end, t, dstRows, dstScales, tuning); break;
    case 1: gatherRowsImpl<kStream, 1>(ids, begin, end, t, dstRows, dstScales, tuning); break;
    case 2: gatherRowsImpl<kStream, 2>(ids, begin, end, t, dstRows, dstScales, tuning); break;
    default: gatherRowsImpl<kStream, 3>(ids, begin, end, t, dstRows, dstScales, tuning); break;
    }
}
} // namespace detail

//! Copies rows [begin, end) of `ids` from `t`: row r's values to dstRows + (r - begin) *
//! rowBytes and its scale bytes to dstScales + (r - begin) * scaleBytes.
inline void gatherRows(RowIds const& ids, int64_t begin, int64_t end, RowTable const& t, uint8_t* dstRows,
    uint8_t* dstScales, GatherTuning const& tuning)
{
    if (tuning.streamingStores && canStream(dstRows, t.rowBytes))
    {
        detail::gatherRowsStore<true>(ids, begin, end, t, dstRows, dstScales, tuning);
    }
    else
    {
        detail::gatherRowsStore<false>(ids, begin, end, t, dstRows, dstScales, tuning);
    }
}

} // namespace kernels
} // namespace engram_trt

#endif // ENGRAM_TRT_ROW_GATHER_H
