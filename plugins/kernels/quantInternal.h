// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * Host helpers the stored-format kernels' entry points share (quantHost.cpp; not part of
 * the ABI): the argument checks of weights, experts and outputs, and the device facts the
 * GEMMs choose their variant by.
 */
#ifndef ENGRAM_TRT_QUANT_INTERNAL_H
#define ENGRAM_TRT_QUANT_INTERNAL_H

#include "quantKernels.h"

#include <cstdint>

namespace engram_trt
{
namespace kernels
{

//! The weight arguments of the GEMV and the GEMMs (type, shape, pointers, scales, blocks);
//! 0 or a failure naming the argument.
int checkQuantWeight(char const* fn, int32_t wType, void const* w, void const* wScale, int32_t scaleType, int32_t bn,
    int32_t bk, int64_t n, int64_t k, int32_t experts);

//! The expert arguments of the GEMV and the GEMMs: E = 1 takes offsets NULL, E > 1 needs them.
int checkExperts(char const* fn, int32_t experts, int32_t const* offsets);

//! The output arguments of the GEMV and the GEMMs: type, ldo >= cols, pointer.
int checkQuantOut(char const* fn, void const* out, int32_t outType, int64_t ldo, int64_t cols);

//! Compute capability of the current device as major * 10 + minor (cached per device);
//! -1 when no device can be asked (the CUDA error cleared).
int computeCapability();

//! The most dynamic shared memory a block may opt in to on the current device (cached per
//! device); 0 when it cannot be asked.
int maxSharedPerBlockOptin();

} // namespace kernels
} // namespace engram_trt

#endif // ENGRAM_TRT_QUANT_INTERNAL_H
