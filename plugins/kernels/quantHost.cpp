// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * Host helpers of the stored-format kernels (quantInternal.h): the argument checks their
 * entry points share, and the device facts the GEMMs choose their variant by.
 */
#include "engramKernelsInternal.h"
#include "quantInternal.h"

#include <climits>
#include <cstdint>
#include <mutex>
#include <vector>

namespace engram_trt
{
namespace kernels
{

//! The weight arguments the GEMV, the GEMMs and the dequantize share; 0 or a failure.
int checkQuantWeight(char const* fn, int32_t wType, void const* w, void const* wScale, int32_t scaleType, int32_t bn,
    int32_t bk, int64_t n, int64_t k, int32_t experts)
{
    if (wType != ENGRAM_QWEIGHT_FP8_E4M3 && wType != ENGRAM_QWEIGHT_FP4_E2M1 && wType != ENGRAM_QWEIGHT_BF16)
    {
        return fail(
            cudaErrorInvalidValue, "%s: w_type must be 0 (fp8 e4m3), 1 (fp4 e2m1) or 2 (bf16) (got %d)", fn, wType);
    }
    if (n < 1 || n > INT32_MAX || k < 1 || k > INT32_MAX)
    {
        return fail(cudaErrorInvalidValue, "%s: out_features and in_features must be in [1, 2^31 - 1] (got %lld, %lld)",
            fn, ll(n), ll(k));
    }
    if (experts < 1)
    {
        return fail(cudaErrorInvalidValue, "%s: num_experts must be >= 1 (got %d)", fn, experts);
    }
    if (static_cast<double>(experts) * static_cast<double>(n) * static_cast<double>(k) > 4.0e18)
    {
        return fail(cudaErrorInvalidValue, "%s: weights [%d, %lld, %lld] are too large", fn, experts, ll(n), ll(k));
    }
    if (w == nullptr || !isAligned(w, 16))
    {
        return fail(cudaErrorInvalidValue, "%s: w must be a 16-byte aligned device pointer", fn);
    }
    if (wType == ENGRAM_QWEIGHT_BF16)
    {
        if (wScale != nullptr)
        {
            return fail(cudaErrorInvalidValue, "%s: a bf16 weight has no scales: pass w_scale NULL", fn);
        }
        return 0;
    }
    if (scaleType != ENGRAM_QSCALE_F32 && scaleType != ENGRAM_QSCALE_UE8M0)
    {
        return fail(cudaErrorInvalidValue, "%s: scale_type must be 0 (float32) or 1 (ue8m0) (got %d)", fn, scaleType);
    }
    if (bn < 1 || bk < 1)
    {
        return fail(cudaErrorInvalidValue, "%s: block sizes bn, bk must be >= 1 (got %d, %d)", fn, bn, bk);
    }
    if (wScale == nullptr || (scaleType == ENGRAM_QSCALE_F32 && !isAligned(wScale, 4)))
    {
        return fail(
            cudaErrorInvalidValue, "%s: w_scale must be a device pointer (4-byte aligned for float32 scales)", fn);
    }
    return 0;
}

//! The expert arguments of the GEMV and the GEMMs: E = 1 takes offsets (and slots) NULL.
int checkExperts(char const* fn, int32_t experts, int32_t const* offsets)
{
    if (experts == 1 && offsets != nullptr)
    {
        return fail(cudaErrorInvalidValue, "%s: one weight (num_experts 1) takes offsets NULL", fn);
    }
    if (experts > 1 && (offsets == nullptr || !isAligned(offsets, 4)))
    {
        return fail(cudaErrorInvalidValue, "%s: num_experts %d > 1 needs offsets [E + 1] (int32 device)", fn, experts);
    }
    return 0;
}

//! The output arguments of the GEMV and the GEMMs.
int checkQuantOut(char const* fn, void const* out, int32_t outType, int64_t ldo, int64_t cols)
{
    if (outType != ENGRAM_FLOAT_BF16 && outType != ENGRAM_FLOAT_F32 && outType != ENGRAM_FLOAT_F16)
    {
        return fail(cudaErrorInvalidValue, "%s: out_type must be an EngramFloatType (0 bf16, 1 f32, 2 f16; got %d)", fn,
            outType);
    }
    if (ldo < cols)
    {
        return fail(
            cudaErrorInvalidValue, "%s: ldo must be >= %lld, the columns written (got %lld)", fn, ll(cols), ll(ldo));
    }
    if (out == nullptr || !isAligned(out, outType == ENGRAM_FLOAT_F32 ? 4 : 2))
    {
        return fail(cudaErrorInvalidValue, "%s: out must be a device pointer aligned to its element size", fn);
    }
    return 0;
}

namespace
{

//! `attribute` of the current device, cached per device; -1 when it cannot be asked.
int cachedAttribute(cudaDeviceAttr attribute, std::mutex& mutex, std::vector<int>& cache)
{
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess)
    {
        cudaGetLastError();
        return -1;
    }
    std::lock_guard<std::mutex> lock(mutex);
    if (static_cast<size_t>(device) >= cache.size())
    {
        cache.resize(device + 1, -1);
    }
    if (cache[device] < 0)
    {
        int value = 0;
        if (cudaDeviceGetAttribute(&value, attribute, device) != cudaSuccess)
        {
            cudaGetLastError();
            return -1;
        }
        cache[device] = value;
    }
    return cache[device];
}

} // namespace

int computeCapability()
{
    static std::mutex mutex;
    static std::vector<int> minors;
    int const major = computeCapabilityMajor();
    if (major < 0)
    {
        return -1;
    }
    int const minor = cachedAttribute(cudaDevAttrComputeCapabilityMinor, mutex, minors);
    return minor < 0 ? -1 : major * 10 + minor;
}

int maxSharedPerBlockOptin()
{
    static std::mutex mutex;
    static std::vector<int> bytes;
    int const value = cachedAttribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, mutex, bytes);
    return value > 0 ? value : 0;
}

} // namespace kernels
} // namespace engram_trt
