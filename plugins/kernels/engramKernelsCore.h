// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * engram-trt kernel library, what every family shares: the export macro, the float and pointer-kind codes,
 * the library's version and last-error queries, pointer queries and host memory registration
 * (kernelApi.cpp).
 * Part of the C ABI of engramKernels.h (the umbrella header), whose conventions hold here.
 */
#ifndef ENGRAM_TRT_CORE_KERNELS_H
#define ENGRAM_TRT_CORE_KERNELS_H

#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#if defined(__GNUC__)
#define ENGRAM_API __attribute__((visibility("default")))
#else
#define ENGRAM_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Floating-point element types of the gate's tensors (engram_gate_typed's io_type and
 * weight_type). */
enum EngramFloatType
{
    ENGRAM_FLOAT_BF16 = 0,
    ENGRAM_FLOAT_F32 = 1,
    ENGRAM_FLOAT_F16 = 2
};

/* Kind of memory behind a pointer, from engram_pointer_kind(). */
enum EngramPointerKind
{
    ENGRAM_POINTER_UNREGISTERED = 0, /* plain host memory: the GPU cannot read it */
    ENGRAM_POINTER_HOST = 1,         /* pinned or registered host memory (UVA-readable) */
    ENGRAM_POINTER_DEVICE = 2,       /* device memory */
    ENGRAM_POINTER_MANAGED = 3       /* managed memory */
};

/* Library version string, ENGRAM_TRT_PLUGIN_VERSION (engramKernels.h). */
ENGRAM_API const char* engram_trt_plugin_version(void);

/* One-line reason of the last failed call on this thread ("" if none). */
ENGRAM_API const char* engram_last_error(void);

/* Kind of memory behind ptr (EngramPointerKind) in *kind. */
ENGRAM_API int engram_pointer_kind(const void* ptr, int32_t* kind);

/* cudaHostRegister(ptr, bytes, portable | mapped) / cudaHostUnregister, so that the
 * GPU can read an existing host allocation (e.g. a table loaded by NumPy). */
ENGRAM_API int engram_host_register(void* ptr, size_t bytes);
ENGRAM_API int engram_host_unregister(void* ptr);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* ENGRAM_TRT_CORE_KERNELS_H */
