// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * Helpers shared by the kernel library's translation units (not part of the ABI).
 */
#ifndef ENGRAM_TRT_KERNELS_INTERNAL_H
#define ENGRAM_TRT_KERNELS_INTERNAL_H

#include "engramKernelsCore.h"
#include "sourceFileName.h"

#include <cstdint>
#include <cuda_runtime_api.h>
#include <exception>
#include <new>

namespace engram_trt
{
namespace kernels
{

//! Records a one-line reason for engram_last_error() and returns `code` as int.
int fail(cudaError_t code, char const* format, ...) __attribute__((format(printf, 2, 3)));

//! fail() for a CUDA runtime call that returned `code`. It also takes the error out of
//! the runtime's last-error slot: a non-sticky error left there would otherwise be
//! reported by the next launch check, of this or another call.
int failCuda(cudaError_t code, char const* format, ...) __attribute__((format(printf, 2, 3)));

//! Clears the thread's last error message; every ABI entry point calls it first.
void clearError();

//! An int64 as fail()'s %lld takes it.
inline long long ll(int64_t v)
{
    return static_cast<long long>(v);
}

//! Discards a stale non-sticky error of an earlier runtime call, so that the
//! checkLaunch() after the next launch reports that launch alone. Call it right before
//! every kernel launch. (A sticky error cannot be discarded: the launch fails with it.)
void resetLaunchError();

//! Returns the launch status of the kernel just enqueued (0 or a cudaError_t), with
//! a message naming `kernelName` on failure. Pair it with resetLaunchError().
int checkLaunch(char const* kernelName);

//! Multiprocessor count of the current device (cached per device); 0 when it cannot be asked.
int smCount();

//! Compute capability major of the current device (cached per device); -1 when no device
//! can be asked (the CUDA error is cleared: the next launch reports it).
int computeCapabilityMajor();

//! True when the current device has compute capability 9.0 or later and ENGRAM_TRT_PDL
//! is not "0" (read at each call): dependentLaunch.cuh's launches may then overlap.
bool dependentLaunchEnabled();

//! An A/B switch of a kernel's form: false when the environment variable `name` is "0",
//! true when it is "1", else `fallback` (read at each call: a graph captured after the
//! change records the other form).
bool envSwitch(char const* name, bool fallback);

using ::engram_trt::sourceFileName;

//! True when `p` is aligned to `bytes`.
inline bool isAligned(void const* p, uintptr_t bytes)
{
    return (reinterpret_cast<uintptr_t>(p) % bytes) == 0;
}

//! True when [a, a + aBytes) and [b, b + bBytes) share a byte.
inline bool overlaps(void const* a, int64_t aBytes, void const* b, int64_t bBytes)
{
    auto const x = reinterpret_cast<uintptr_t>(a);
    auto const y = reinterpret_cast<uintptr_t>(b);
    return aBytes > 0 && bBytes > 0 && x < y + static_cast<uintptr_t>(bBytes) && y < x + static_cast<uintptr_t>(aBytes);
}

//! Checks the table arguments shared by the device and host gathers; returns 0 or
//! fails with cudaErrorInvalidValue. Sets rowBytes (input bytes of one row) and
//! scaleBytes (scale bytes of one row, 0 for bf16).
int validateGatherArgs(char const* fn, int64_t numTokens, int32_t numCols, int64_t idTokenStride, int64_t tableNumRows,
    int32_t headDim, int32_t tableDtype, int32_t quantBlock, void const* out, int64_t& rowBytes, int64_t& scaleBytes);

//! Bytes of one element of an EngramTableDtype (fp8 1, bf16 / f16 2, f32 4; 0 for any
//! other value).
int32_t gatherElemBytes(int32_t tableDtype);

//! Enqueues the gather kernel. Exactly one of (rows, rowsAddr) is used: a non-null
//! rowsAddr means the addresses are read on the device. badRows (a device int64) or
//! badRowsAddr (a device int64 holding such a counter's address, 0 = none) counts the
//! rows that read nothing; both default to no count. rowOffset (checked by the caller:
//! [0, 2^31 - 1], and 0 when ids is NULL) is the global id of the table's first row.
//! keepOutside: an output row whose id is outside the table is not written (and not
//! counted). maxBlocks > 0 caps the grid below its one wave.
int launchGather(int32_t const* ids, int64_t numTokens, int32_t numCols, int64_t idTokenStride, void const* rows,
    void const* scales, int64_t const* rowsAddr, int64_t const* scalesAddr, int64_t tableNumRows, int32_t headDim,
    int32_t tableDtype, int32_t quantBlock, void* out, cudaStream_t stream, int64_t* badRows = nullptr,
    int64_t const* badRowsAddr = nullptr, int64_t rowOffset = 0, bool keepOutside = false, int32_t maxBlocks = 0);

//! The host gather's dequant for a table whose scale bytes live in device memory
//! (ENGRAM_LAYOUT_HBM_SCALES): staged holds `count` fp8 rows of headDim bytes, flat rows
//! [firstRow, firstRow + count) of the call; flat row r is token r / numCols, column
//! r % numCols, whose id is idsDev[token * idTokenStride + column]. Its scale bytes are
//! scales[id * headDim / quantBlock ...] (byte 127, 2^0, for an id outside
//! [0, tableNumRows): the host gather staged a zero row there). Writes bf16 rows
//! out[0, count), the same values engram_gather gives for those ids.
int launchDequantStaged(uint8_t const* staged, int32_t const* idsDev, int64_t firstRow, int64_t count, int32_t numCols,
    int64_t idTokenStride, uint8_t const* scales, int64_t tableNumRows, int32_t headDim, int32_t quantBlock, void* out,
    cudaStream_t stream);

//! The raw host gather's scale bytes for a table whose scales live in device memory
//! (ENGRAM_LAYOUT_HBM_SCALES): dst[r * scaleBytes ...] = scales[idsDev[r] * scaleBytes ...]
//! for r in [0, count), byte 127 (2^0) for an id outside [0, tableNumRows) (a zero row).
int launchGatherScaleBytes(int32_t const* idsDev, int64_t count, uint8_t const* scales, int64_t tableNumRows,
    int32_t scaleBytes, uint8_t* dst, cudaStream_t stream);

//! Load the gather kernel's variants (the host gather's dequant and scale-byte gather
//! among them) and the hash kernel on the current device now. With lazy loading (CUDA's
//! default) a kernel loads at its first launch, which may need the whole context to
//! synchronize: from a thread that launches while another stream waits on that very
//! thread's work (the gather driver's readers), it would never return. The driver calls
//! these before it takes any job.
int preloadGatherKernels();
int preloadHashKernels();

} // namespace kernels
} // namespace engram_trt

//! Wrap the body of every extern "C" entry point that can throw (std::thread,
//! std::function, containers, std::mutex): a C++ exception must not cross the C ABI, so
//! each becomes a failure code with its reason in engram_last_error().
#define ENGRAM_ABI_TRY try
#define ENGRAM_ABI_CATCH(fn)                                                                                           \
    catch (std::bad_alloc const&)                                                                                      \
    {                                                                                                                  \
        return ::engram_trt::kernels::fail(cudaErrorMemoryAllocation, "%s: out of host memory", fn);                   \
    }                                                                                                                  \
    catch (std::exception const& error)                                                                                \
    {                                                                                                                  \
        return ::engram_trt::kernels::fail(cudaErrorUnknown, "%s: %s", fn, error.what());                              \
    }                                                                                                                  \
    catch (...)                                                                                                        \
    {                                                                                                                  \
        return ::engram_trt::kernels::fail(cudaErrorUnknown, "%s: unknown C++ exception", fn);                         \
    }

#endif // ENGRAM_TRT_KERNELS_INTERNAL_H
