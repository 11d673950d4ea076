// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * Library-wide entry points: version, error messages, pointer queries, host memory
 * registration.
 */
#include "engramKernels.h"
#include "engramKernelsCore.h"
#include "engramKernelsInternal.h"

#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

namespace engram_trt
{
namespace kernels
{

namespace detail
{
thread_local char gLastError[512] = "";
} // namespace detail

int fail(cudaError_t code, char const* format, ...)
{
    va_list args;
    va_start(args, format);
    std::vsnprintf(detail::gLastError, sizeof(detail::gLastError), format, args);
    va_end(args);
    return static_cast<int>(code == cudaSuccess ? cudaErrorInvalidValue : code);
}

int failCuda(cudaError_t code, char const* format, ...)
{
    cudaGetLastError(); // consume the runtime's copy of `code`
    va_list args;
    va_start(args, format);
    std::vsnprintf(detail::gLastError, sizeof(detail::gLastError), format, args);
    va_end(args);
    return static_cast<int>(code == cudaSuccess ? cudaErrorUnknown : code);
}

void clearError()
{
    detail::gLastError[0] = '\0';
}

void resetLaunchError()
{
    cudaGetLastError();
}

int checkLaunch(char const* kernelName)
{
    // cudaGetLastError (not Peek): it also clears a non-sticky launch error, so it does
    // not outlive this call.
    cudaError_t const status = cudaGetLastError();
    if (status != cudaSuccess)
    {
        return fail(status, "%s launch failed: %s", kernelName, cudaGetErrorString(status));
    }
    return 0;
}

namespace
{

//! `attribute` of the current device, cached per device in `cache` (each caller keeps its
//! own); -1 when it cannot be asked, the CUDA error cleared (a launch that follows reports
//! a missing device itself).
int cachedDeviceAttribute(cudaDeviceAttr attribute, std::mutex& mutex, std::vector<int>& cache)
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

int smCount()
{
    static std::mutex mutex;
    static std::vector<int> counts;
    int const n = cachedDeviceAttribute(cudaDevAttrMultiProcessorCount, mutex, counts);
    return n > 0 ? n : 0;
}

int computeCapabilityMajor()
{
    static std::mutex mutex;
    static std::vector<int> majors;
    return cachedDeviceAttribute(cudaDevAttrComputeCapabilityMajor, mutex, majors);
}

bool dependentLaunchEnabled()
{
    char const* const env = std::getenv("ENGRAM_TRT_PDL");
    if (env != nullptr && std::strcmp(env, "0") == 0)
    {
        return false;
    }
    return computeCapabilityMajor() >= 9;
}

bool envSwitch(char const* name, bool fallback)
{
    char const* const env = std::getenv(name);
    if (env != nullptr && std::strcmp(env, "0") == 0)
    {
        return false;
    }
    if (env != nullptr && std::strcmp(env, "1") == 0)
    {
        return true;
    }
    return fallback;
}

} // namespace kernels
} // namespace engram_trt

using namespace engram_trt::kernels;

extern "C" ENGRAM_API char const* engram_trt_plugin_version(void)
{
    return ENGRAM_TRT_PLUGIN_VERSION;
}

extern "C" ENGRAM_API char const* engram_last_error(void)
{
    return engram_trt::kernels::detail::gLastError;
}

extern "C" ENGRAM_API int engram_pointer_kind(void const* ptr, int32_t* kind)
{
    clearError();
    if (kind == nullptr)
    {
        return fail(cudaErrorInvalidValue, "engram_pointer_kind: kind is NULL");
    }
    cudaPointerAttributes attributes{};
    cudaError_t const status = cudaPointerGetAttributes(&attributes, ptr);
    if (status != cudaSuccess)
    {
        return failCuda(status, "engram_pointer_kind: cudaPointerGetAttributes failed: %s", cudaGetErrorString(status));
    }
    switch (attributes.type)
    {
    case cudaMemoryTypeHost: *kind = ENGRAM_POINTER_HOST; break;
    case cudaMemoryTypeDevice: *kind = ENGRAM_POINTER_DEVICE; break;
    case cudaMemoryTypeManaged: *kind = ENGRAM_POINTER_MANAGED; break;
    default: *kind = ENGRAM_POINTER_UNREGISTERED; break;
    }
    return 0;
}

extern "C" ENGRAM_API int engram_host_register(void* ptr, size_t bytes)
{
    clearError();
    if (ptr == nullptr || bytes == 0)
    {
        return fail(cudaErrorInvalidValue, "engram_host_register: empty range");
    }
    cudaError_t const status = cudaHostRegister(ptr, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped);
    if (status != cudaSuccess)
    {
        return failCuda(
            status, "engram_host_register: cudaHostRegister(%zu bytes) failed: %s", bytes, cudaGetErrorString(status));
    }
    return 0;
}

extern "C" ENGRAM_API int engram_host_unregister(void* ptr)
{
    clearError();
    cudaError_t const status = cudaHostUnregister(ptr);
    if (status != cudaSuccess)
    {
        return failCuda(status, "engram_host_unregister failed: %s", cudaGetErrorString(status));
    }
    return 0;
}
