// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * The gather's C ABI entry points (engramKernels.h): the argument checks shared by the
 * device, indirect and host gathers, and engram_gather[_indirect][_ex], engram_gather_part and
 * engram_gather_raw, in the style of kernelApi.cpp; the kernel and its launch are in
 * gatherKernel.cu.
 */
#include "engramKernelsInternal.h"
#include "gatherKernels.h"

#include <climits>
#include <cstdint>

namespace engram_trt
{
namespace kernels
{

namespace
{
//! The id and table shape checks every gather makes.
int checkGatherShape(char const* fn, int64_t numTokens, int32_t numCols, int64_t idTokenStride, int64_t tableNumRows)
{
    if (numTokens < 0 || numCols < 1 || idTokenStride < numCols || tableNumRows < 0)
    {
        return fail(cudaErrorInvalidValue,
            "%s: need num_tokens >= 0, num_cols >= 1, id_token_stride >= num_cols, table_num_rows >= 0 "
            "(got %lld, %d, %lld, %lld)",
            fn, static_cast<long long>(numTokens), numCols, static_cast<long long>(idTokenStride),
            static_cast<long long>(tableNumRows));
    }
    return 0;
}
} // namespace

int validateGatherArgs(char const* fn, int64_t numTokens, int32_t numCols, int64_t idTokenStride, int64_t tableNumRows,
    int32_t headDim, int32_t tableDtype, int32_t quantBlock, void const* out, int64_t& rowBytes, int64_t& scaleBytes)
{
    if (int const status = checkGatherShape(fn, numTokens, numCols, idTokenStride, tableNumRows))
    {
        return status;
    }
    if (tableDtype == ENGRAM_TABLE_FP8_E4M3)
    {
        if (headDim < 16 || headDim % 16 != 0 || quantBlock < 16 || quantBlock % 16 != 0 || headDim % quantBlock != 0)
        {
            return fail(cudaErrorInvalidValue,
                "%s: fp8 tables need head_dim %% 16 == 0, quant_block %% 16 == 0, head_dim %% quant_block == 0 "
                "(got head_dim %d, quant_block %d)",
                fn, headDim, quantBlock);
        }
        rowBytes = headDim;
        scaleBytes = headDim / quantBlock;
    }
    else if (tableDtype == ENGRAM_TABLE_BF16)
    {
        if (headDim < 8 || headDim % 8 != 0)
        {
            return fail(cudaErrorInvalidValue, "%s: bf16 tables need head_dim %% 8 == 0 (got %d)", fn, headDim);
        }
        rowBytes = 2 * static_cast<int64_t>(headDim);
        scaleBytes = 0;
    }
    else
    {
        return fail(cudaErrorInvalidValue, "%s: table_dtype %d is neither fp8_e4m3 (0) nor bf16 (1)", fn, tableDtype);
    }
    if (numTokens > 0 && (out == nullptr || !isAligned(out, 16)))
    {
        return fail(cudaErrorInvalidValue, "%s: out must be a 16-byte aligned device pointer", fn);
    }
    return 0;
}

} // namespace kernels
} // namespace engram_trt

using namespace engram_trt::kernels;

namespace
{

//! The table checks of the GPU gather (engram_gather[_ex|_part|_indirect], the plugin):
//! an fp8 table as validateGatherArgs (the host gather's contract, which stays bf16 / fp8
//! of 16-byte rows), a float table (bf16, f16, f32) of any head_dim >= 1 whose output
//! needs only its element's alignment. Sets rowBytes and scaleBytes as validateGatherArgs.
int validateDeviceGatherArgs(char const* fn, int64_t numTokens, int32_t numCols, int64_t idTokenStride,
    int64_t tableNumRows, int32_t headDim, int32_t tableDtype, int32_t quantBlock, void const* out, int64_t& rowBytes,
    int64_t& scaleBytes)
{
    if (tableDtype == ENGRAM_TABLE_FP8_E4M3)
    {
        return validateGatherArgs(fn, numTokens, numCols, idTokenStride, tableNumRows, headDim, tableDtype, quantBlock,
            out, rowBytes, scaleBytes);
    }
    int32_t const elemBytes = gatherElemBytes(tableDtype);
    if (elemBytes < 2)
    {
        return fail(cudaErrorInvalidValue, "%s: table_dtype %d is none of fp8_e4m3 (0), bf16 (1), f16 (2), f32 (3)", fn,
            tableDtype);
    }
    if (int const status = checkGatherShape(fn, numTokens, numCols, idTokenStride, tableNumRows))
    {
        return status;
    }
    if (headDim < 1)
    {
        return fail(cudaErrorInvalidValue, "%s: float tables need head_dim >= 1 (got %d)", fn, headDim);
    }
    if (numTokens > 0 && (out == nullptr || !isAligned(out, elemBytes)))
    {
        return fail(cudaErrorInvalidValue, "%s: out must be a device pointer aligned to the table's %d-byte element",
            fn, elemBytes);
    }
    rowBytes = static_cast<int64_t>(elemBytes) * headDim;
    scaleBytes = 0;
    return 0;
}

//! The row_offset checks of the _ex entry points: [0, 2^31 - 1] (ids are int32), and 0
//! for the identity gather (ids NULL), whose output row r reads table row r.
int checkRowOffset(char const* fn, int32_t const* ids, int64_t rowOffset)
{
    if (rowOffset < 0 || rowOffset > INT32_MAX)
    {
        return fail(cudaErrorInvalidValue, "%s: row_offset must be in [0, 2^31 - 1] (row ids are int32), got %lld", fn,
            static_cast<long long>(rowOffset));
    }
    if (ids == nullptr && rowOffset != 0)
    {
        return fail(cudaErrorInvalidValue, "%s: the identity gather (ids NULL) takes no row_offset, got %lld", fn,
            static_cast<long long>(rowOffset));
    }
    return 0;
}

int gatherDirect(char const* fn, int32_t const* ids, int64_t numTokens, int32_t numCols, int64_t idTokenStride,
    void const* tableRows, void const* tableScales, int64_t tableNumRows, int64_t rowOffset, int32_t headDim,
    int32_t tableDtype, int32_t quantBlock, void* out, int64_t* badRows, cudaStream_t stream, bool keepOutside = false,
    int32_t maxBlocks = 0)
{
    int64_t rowBytes = 0;
    int64_t scaleBytes = 0;
    if (int const status = validateDeviceGatherArgs(fn, numTokens, numCols, idTokenStride, tableNumRows, headDim,
            tableDtype, quantBlock, out, rowBytes, scaleBytes))
    {
        return status;
    }
    if (int const status = checkRowOffset(fn, ids, rowOffset))
    {
        return status;
    }
    if (numTokens > 0 && tableNumRows > 0)
    {
        if (tableRows == nullptr || !isAligned(tableRows, scaleBytes > 0 ? 16 : gatherElemBytes(tableDtype)))
        {
            return scaleBytes > 0
                ? fail(cudaErrorInvalidValue, "%s: table rows must be a 16-byte aligned pointer", fn)
                : fail(cudaErrorInvalidValue, "%s: table rows must be a pointer aligned to the table's %d-byte element",
                      fn, gatherElemBytes(tableDtype));
        }
        if (scaleBytes > 0 && tableScales == nullptr)
        {
            return fail(cudaErrorInvalidValue, "%s: an fp8 table needs its scales", fn);
        }
    }
    if (badRows != nullptr && !isAligned(badRows, 8))
    {
        return fail(cudaErrorInvalidValue, "%s: bad_rows must be an 8-byte aligned device pointer", fn);
    }
    return launchGather(ids, numTokens, numCols, idTokenStride, tableRows, tableScales, nullptr, nullptr, tableNumRows,
        headDim, tableDtype, quantBlock, out, stream, badRows, nullptr, rowOffset, keepOutside, maxBlocks);
}

int gatherIndirect(char const* fn, int32_t const* ids, int64_t numTokens, int32_t numCols, int64_t idTokenStride,
    int64_t const* tableRowsAddr, int64_t const* tableScalesAddr, int64_t tableNumRows, int64_t rowOffset,
    int32_t headDim, int32_t tableDtype, int32_t quantBlock, void* out, int64_t const* badRowsAddr, cudaStream_t stream)
{
    int64_t rowBytes = 0;
    int64_t scaleBytes = 0;
    if (int const status = validateDeviceGatherArgs(fn, numTokens, numCols, idTokenStride, tableNumRows, headDim,
            tableDtype, quantBlock, out, rowBytes, scaleBytes))
    {
        return status;
    }
    if (int const status = checkRowOffset(fn, ids, rowOffset))
    {
        return status;
    }
    if (tableRowsAddr == nullptr || (scaleBytes > 0 && tableScalesAddr == nullptr))
    {
        return fail(cudaErrorInvalidValue, "%s: the table address inputs are required", fn);
    }
    return launchGather(ids, numTokens, numCols, idTokenStride, nullptr, nullptr, tableRowsAddr, tableScalesAddr,
        tableNumRows, headDim, tableDtype, quantBlock, out, stream, nullptr, badRowsAddr, rowOffset);
}

} // namespace

extern "C" ENGRAM_API int engram_gather(int32_t const* ids, int64_t numTokens, int32_t numCols, int64_t idTokenStride,
    void const* tableRows, void const* tableScales, int64_t tableNumRows, int32_t headDim, int32_t tableDtype,
    int32_t quantBlock, void* out, int64_t* badRows, cudaStream_t stream)
{
    clearError();
    ENGRAM_ABI_TRY
    {
        return gatherDirect("engram_gather", ids, numTokens, numCols, idTokenStride, tableRows, tableScales,
            tableNumRows, 0, headDim, tableDtype, quantBlock, out, badRows, stream);
    }
    ENGRAM_ABI_CATCH("engram_gather")
}

extern "C" ENGRAM_API int engram_gather_ex(int32_t const* ids, int64_t numTokens, int32_t numCols,
    int64_t idTokenStride, void const* tableRows, void const* tableScales, int64_t tableNumRows, int64_t rowOffset,
    int32_t headDim, int32_t tableDtype, int32_t quantBlock, void* out, int64_t* badRows, cudaStream_t stream)
{
    clearError();
    ENGRAM_ABI_TRY
    {
        return gatherDirect("engram_gather_ex", ids, numTokens, numCols, idTokenStride, tableRows, tableScales,
            tableNumRows, rowOffset, headDim, tableDtype, quantBlock, out, badRows, stream);
    }
    ENGRAM_ABI_CATCH("engram_gather_ex")
}

extern "C" ENGRAM_API int engram_gather_part(int32_t const* ids, int64_t numTokens, int32_t numCols,
    int64_t idTokenStride, void const* tableRows, void const* tableScales, int64_t tableNumRows, int64_t rowOffset,
    int32_t headDim, int32_t tableDtype, int32_t quantBlock, int32_t keepOutside, int32_t maxBlocks, void* out,
    cudaStream_t stream)
{
    clearError();
    ENGRAM_ABI_TRY
    {
        if (ids == nullptr)
        {
            return fail(cudaErrorInvalidValue,
                "engram_gather_part: ids are required (the identity gather writes every row: use engram_gather)");
        }
        if (keepOutside != 0 && keepOutside != 1)
        {
            return fail(cudaErrorInvalidValue, "engram_gather_part: keep_outside must be 0 or 1, got %d", keepOutside);
        }
        if (maxBlocks < 0)
        {
            return fail(cudaErrorInvalidValue, "engram_gather_part: max_blocks must be >= 0 (0: one full wave), got %d",
                maxBlocks);
        }
        return gatherDirect("engram_gather_part", ids, numTokens, numCols, idTokenStride, tableRows, tableScales,
            tableNumRows, rowOffset, headDim, tableDtype, quantBlock, out, nullptr, stream, keepOutside != 0,
            maxBlocks);
    }
    ENGRAM_ABI_CATCH("engram_gather_part")
}

extern "C" ENGRAM_API int engram_gather_raw(int32_t const* ids, int64_t count, void const* tableRows,
    void const* tableScales, int64_t tableNumRows, int64_t rowBytes, int32_t scaleBytes, void* dstRows, void* dstScales,
    int32_t maxBlocks, cudaStream_t stream)
{
    clearError();
    ENGRAM_ABI_TRY
    {
        char const* fn = "engram_gather_raw";
        if (count < 0 || tableNumRows < 0 || rowBytes < 16 || rowBytes % 16 != 0 || scaleBytes < 0 || maxBlocks < 0)
        {
            return fail(cudaErrorInvalidValue,
                "%s: need count >= 0, table_num_rows >= 0, row_bytes a positive multiple of 16, scale_bytes >= 0, "
                "max_blocks >= 0 (got %lld, %lld, %lld, %d, %d)",
                fn, ll(count), ll(tableNumRows), ll(rowBytes), scaleBytes, maxBlocks);
        }
        if (count == 0)
        {
            return 0;
        }
        if (ids == nullptr || !isAligned(ids, 4) || tableRows == nullptr || !isAligned(tableRows, 16)
            || dstRows == nullptr || !isAligned(dstRows, 16))
        {
            return fail(cudaErrorInvalidValue,
                "%s: ids (4-byte aligned) and the table's and dst's rows (16-byte aligned) are required", fn);
        }
        if (scaleBytes > 0 && (tableScales == nullptr || dstScales == nullptr))
        {
            return fail(cudaErrorInvalidValue, "%s: scale_bytes %d needs table_scales and dst_scales", fn, scaleBytes);
        }
        // Raw bytes are what the gather kernel's bf16 form moves: a row of row_bytes is
        // row_bytes / 2 bf16 values, copied as they are, a zero row for an id outside.
        if (int const launched = launchGather(ids, count, 1, 1, tableRows, nullptr, nullptr, nullptr, tableNumRows,
                static_cast<int32_t>(rowBytes / 2), ENGRAM_TABLE_BF16, 1, dstRows, stream, nullptr, nullptr, 0, false,
                maxBlocks))
        {
            return launched;
        }
        return scaleBytes > 0 ? launchGatherScaleBytes(ids, count, static_cast<uint8_t const*>(tableScales),
                                    tableNumRows, scaleBytes, static_cast<uint8_t*>(dstScales), stream)
                              : 0;
    }
    ENGRAM_ABI_CATCH("engram_gather_raw")
}

extern "C" ENGRAM_API int engram_gather_check_table(int32_t headDim, int32_t tableDtype, int32_t quantBlock)
{
    clearError();
    int64_t rowBytes = 0;
    int64_t scaleBytes = 0;
    return validateDeviceGatherArgs(
        "engram_gather", 0, 1, 1, 0, headDim, tableDtype, quantBlock, nullptr, rowBytes, scaleBytes);
}

extern "C" ENGRAM_API int engram_gather_indirect(int32_t const* ids, int64_t numTokens, int32_t numCols,
    int64_t idTokenStride, int64_t const* tableRowsAddr, int64_t const* tableScalesAddr, int64_t tableNumRows,
    int32_t headDim, int32_t tableDtype, int32_t quantBlock, void* out, int64_t const* badRowsAddr, cudaStream_t stream)
{
    clearError();
    ENGRAM_ABI_TRY
    {
        return gatherIndirect("engram_gather_indirect", ids, numTokens, numCols, idTokenStride, tableRowsAddr,
            tableScalesAddr, tableNumRows, 0, headDim, tableDtype, quantBlock, out, badRowsAddr, stream);
    }
    ENGRAM_ABI_CATCH("engram_gather_indirect")
}

extern "C" ENGRAM_API int engram_gather_indirect_ex(int32_t const* ids, int64_t numTokens, int32_t numCols,
    int64_t idTokenStride, int64_t const* tableRowsAddr, int64_t const* tableScalesAddr, int64_t tableNumRows,
    int64_t rowOffset, int32_t headDim, int32_t tableDtype, int32_t quantBlock, void* out, int64_t const* badRowsAddr,
    cudaStream_t stream)
{
    clearError();
    ENGRAM_ABI_TRY
    {
        return gatherIndirect("engram_gather_indirect_ex", ids, numTokens, numCols, idTokenStride, tableRowsAddr,
            tableScalesAddr, tableNumRows, rowOffset, headDim, tableDtype, quantBlock, out, badRowsAddr, stream);
    }
    ENGRAM_ABI_CATCH("engram_gather_indirect_ex")
}
