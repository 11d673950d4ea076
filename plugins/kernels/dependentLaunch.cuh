// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * Programmatic dependent launch (sm_90+) for the decode step's chain of small kernels.
 *
 * Why: a decode step of a ~1B model is ~200 kernels of 2-15 us, and on the H200 a CUDA
 * graph leaves 1-2 us between two of them; the projections also wait for their first
 * weight bytes only once they start. A kernel launched with launchDependent() may be
 * scheduled while the kernel before it on the stream still runs: it first calls
 * waitForPrimary() (griddepcontrol.wait: the kernel before it has completed and its
 * writes are visible) and only then touches any buffer that kernel might write. Read-
 * only inputs that no earlier kernel writes (a model's weights) may be loaded before it.
 *
 * The discipline that keeps a chain of such kernels safe: each kernel calls
 * allowDependents() (griddepcontrol.launch_dependents) only after its own
 * waitForPrimary(), so when kernel N+1 starts, kernel N-1 has completed, and kernel N+1
 * writes nothing before its own wait. A kernel launched the ordinary way after one of
 * these waits for it to complete, as always, and one before that never triggers early.
 *
 * Off below sm_90 (the instructions compile to nothing, the attribute is not set) and
 * when ENGRAM_TRT_PDL=0 (read at each launch, so a graph captured after the change
 * records ordinary launches).
 */
#ifndef ENGRAM_TRT_DEPENDENT_LAUNCH_CUH
#define ENGRAM_TRT_DEPENDENT_LAUNCH_CUH

#include "engramKernelsInternal.h" // dependentLaunchEnabled()

#include <cuda_runtime.h>

namespace engram_trt
{
namespace kernels
{

//! Waits until the kernel before this one on the stream has completed (a no-op when
//! this kernel was launched the ordinary way, or below sm_90).
__device__ __forceinline__ void waitForPrimary()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

//! Lets the next kernel on the stream be scheduled (it still waits for this one to
//! complete before reading what this one writes). Call after waitForPrimary().
__device__ __forceinline__ void allowDependents()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;");
#endif
}

//! kernel<<<grid, block, sharedBytes, stream>>>(args...), with programmatic stream
//! serialization when dependentLaunchEnabled(). Returns the launch's status.
template <typename... Params, typename... Args>
cudaError_t launchDependent(
    void (*kernel)(Params...), dim3 grid, dim3 block, size_t sharedBytes, cudaStream_t stream, Args... args)
{
    cudaLaunchAttribute attribute[1];
    attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config = {};
    config.gridDim = grid;
    config.blockDim = block;
    config.dynamicSmemBytes = sharedBytes;
    config.stream = stream;
    config.attrs = attribute;
    config.numAttrs = dependentLaunchEnabled() ? 1 : 0;
    return cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...);
}

} // namespace kernels
} // namespace engram_trt

#endif // ENGRAM_TRT_DEPENDENT_LAUNCH_CUH
