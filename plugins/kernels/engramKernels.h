// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * engram-trt kernel library: the C ABI, the umbrella header.
 *
 * Every CUDA kernel of the project lives once behind this ABI. The TensorRT plugins
 * (plugins/engram*Plugin) validate their tensors and call these functions; the
 * PyTorch path calls them through ctypes (python/engram_trt/native/: library.py loads
 * the library, one binding module per family).
 *
 * The ABI is declared one family per header, each included below (engramKernelsCore.h:
 * what they all share); a translation unit includes the family headers it uses, a
 * client of the whole ABI this one. The library's version is defined here: a change in
 * any family's ABI bumps it.
 *
 * Conventions
 *   - Every function returns int: 0 on success, otherwise a cudaError_t value
 *     (cudaErrorInvalidValue = 1 for a rejected argument). The reason of the last
 *     failure on the calling thread is kept in engram_last_error(). No C++ exception
 *     leaves a function, and a failed call leaves no stale error behind that a later
 *     call would report.
 *   - Pointers named *_host are CPU pointers read before the function returns; all
 *     other tensor pointers are device-accessible (device memory, or host memory that
 *     is pinned / cudaHostRegister'ed and therefore addressable by the GPU through
 *     unified virtual addressing) unless stated otherwise.
 *   - Work is enqueued on `stream`; nothing synchronizes the stream unless stated.
 *   - Tensors are dense, row-major, and 16-byte aligned where a function says so.
 */
#ifndef ENGRAM_TRT_KERNELS_H
#define ENGRAM_TRT_KERNELS_H

/* Version of the kernel + plugin library; the builder records it with each engine. */
#define ENGRAM_TRT_PLUGIN_VERSION "0.19.0"

/* The families, one header each (plugins/kernels/README.md). */
#include "attentionKernels.h"
#include "backboneKernels.h"
#include "cacheKernels.h"
#include "decodeKernels.h"
#include "dsv4AttentionKernels.h"
#include "engramKernelsCore.h"
#include "gateKernels.h"
#include "gatherKernels.h"
#include "gemvKernels.h"
#include "hashKernels.h"
#include "hostGatherKernels.h"
#include "linearAttentionKernels.h"
#include "mhcKernels.h"
#include "pleKernels.h"
#include "qsaKernels.h"
#include "quantKernels.h"

#endif /* ENGRAM_TRT_KERNELS_H */
