// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * The Engram gate's scalar math (engram-spec.md, "Fusion"), written once for the CUDA
 * kernel (gateKernel.cu) and for host programs: plugins/tests/gateMathTest.cpp runs it
 * on the CPU against the float64 reference (tests/kernels/test_gate_math.py), so the NaN and
 * sign semantics are checked without a GPU.
 *
 * NaN semantics follow numpy and torch: sign(NaN) = NaN, maximum / clamp_min propagate
 * NaN, so a NaN score gives a NaN gate and a NaN output. (fmaxf alone would drop the NaN
 * and turn it into the gate sigmoid(0) = 0.5: a finite, wrong row with no sign of it.)
 * The only intended difference from the reference: a masked (dead) token's output is a
 * bit copy of hidden, where the reference computes hidden + 0 * value (NaN when the
 * value is NaN). The kernel never reads a dead token's kv row.
 */
#ifndef ENGRAM_TRT_GATE_MATH_H
#define ENGRAM_TRT_GATE_MATH_H

#include <math.h>
#include <stdint.h>

#if defined(__CUDACC__)
#define ENGRAM_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define ENGRAM_HOST_DEVICE inline
#endif

namespace engram_trt
{
namespace kernels
{

//! NaN test that survives the same compiler flags on host and device.
ENGRAM_HOST_DEVICE bool gateIsNan(float x)
{
#if defined(__CUDA_ARCH__)
    return isnan(x);
#else
    return x != x;
#endif
}

//! 1 / sqrt(x) as the kernel computes it (rsqrtf on the device).
ENGRAM_HOST_DEVICE float gateRsqrt(float x)
{
#if defined(__CUDA_ARCH__)
    return rsqrtf(x);
#else
    return 1.0F / sqrtf(x);
#endif
}

//! Adds one element's terms to the three sums of a (token, stream): the keyed dot
//! product, h^2 and key^2.
ENGRAM_HOST_DEVICE void gateAccumulate(float h, float key, float q, float k, float& dot, float& hh, float& kk)
{
    dot += h * q * k * key;
    hh += h * h;
    kk += key * key;
}

//! The RMS-normalized score of a (token, stream) from its three sums:
//! dot * rsqrt(mean(h^2) + eps) * rsqrt(mean(key^2) + eps) / sqrt(D).
ENGRAM_HOST_DEVICE float gateScore(float dot, float hh, float kk, int32_t hiddenSize, float eps)
{
    float const invD = 1.0F / static_cast<float>(hiddenSize);
    return dot * gateRsqrt(hh * invD + eps) * gateRsqrt(kk * invD + eps) * gateRsqrt(static_cast<float>(hiddenSize));
}

//! g = sigmoid(sign(d) * sqrt(max(|d|, clamp))); NaN in, NaN out; sign(0) = 0 (g = 0.5).
ENGRAM_HOST_DEVICE float gateFromScore(float d, float clamp)
{
    if (gateIsNan(d))
    {
        return d;
    }
    float const magnitude = sqrtf(fmaxf(fabsf(d), clamp));
    float const signedMagnitude = d > 0.0F ? magnitude : (d < 0.0F ? -magnitude : 0.0F);
    return 1.0F / (1.0F + expf(-signedMagnitude));
}

//! One output element of a live token: h + g * value.
ENGRAM_HOST_DEVICE float gateUpdate(float h, float g, float value)
{
    return h + g * value;
}

} // namespace kernels
} // namespace engram_trt

#endif // ENGRAM_TRT_GATE_MATH_H
