// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * The glue of a Qwen4Exp Gated DeltaNet decode step around its two core kernels
 * (decodeKernels.h states the contracts; python/engram_trt/native/decode.py binds them; the
 * references are models/qwen4_exp/linear_attention.py GatedDeltaNet.forward_decode and
 * models/qwen4_exp/norms.py GatedRMSNorm.forward). The PyTorch forms run the gates as some
 * seven launches and the output norm as some twelve, each a few microseconds; here:
 *
 * engram_gdn_gates_bf16: a thread per (token, head):
 *   beta = float(bf(sigmoid(b)))               torch's bf16 sigmoid: 1 / (1 + expf(-b)) in
 *                                              float32, rounded to bf16 (sigmoidOf)
 *   g = neg_decay * softplus(float(a) + float(dt_bias))
 *                                              torch's softplus (beta 1, threshold 20): x > 20
 *                                              ? x : log1pf(expf(x)), in float32
 *   The same float32 operations in the same order as torch's CUDA kernels, so the same bits
 *   where expf and log1pf are the same functions as torch's (CUDA's libdevice, no fast math,
 *   as both are built). Which bits may differ: beta none (torch's sigmoid is this expf
 *   formula); g only through expf (max 2 ulp in CUDA's table) and log1pf (1 ulp) if a torch
 *   build's differ: expf's relative error passes through log1p at most as is (the slope
 *   sigmoid(x) <= softplus(x)), so each side is within 2 + 1 ulp of the exact softplus of the
 *   same float32 input, then the multiply's half ulp: |g - g_torch| <= 2 * 3.5 eps32 |g|;
 *   tests/gpu/test_qwen4_fused.py allows 8 eps32 |g| and notes whether the bits are equal.
 *
 * engram_gated_rms_norm_bf16: a warp per (token, head) row of dim features:
 *   v = float(bf(x))                           (x.to(bf16): the module's input; a bf16 x is
 *                                              read as is)
 *   r = rsqrtf(sum(v * v) * (1 / dim) + eps)   (torch's mean is sum * (1 / n); rsqrtf is what
 *                                              torch's CUDA rsqrt calls)
 *   out = bf(float(bf(w * bf(v * r))) * act(float(gate)))
 *   act: silu g / (1 + expf(-g)) or sigmoid 1 / (1 + expf(-g)), torch's float32 formulas.
 *   Which bits differ: only the sum of squares' order (lane-strided float32 sums, then a warp
 *   butterfly; torch's reduction tree is another), (dim - 1) eps32 of the sum on each side,
 *   which may flip the bf16 roundings after it by one ulp each (the GPU test's bound).
 */
#include "decodeKernels.h"
#include "dependentLaunch.cuh"
#include "engramKernelsCore.h"
#include "engramKernelsInternal.h"
#include "vecLoad.cuh"

#include <cuda_bf16.h>

#include <cstdint>

namespace engram_trt
{
namespace kernels
{

namespace
{

constexpr int kGatesThreads = 128;
constexpr int kNormThreads = 256;
constexpr int kNormWarps = kNormThreads / 32;

__global__ void __launch_bounds__(kGatesThreads) gdnGatesKernel(EngramGdnGates a)
{
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
    waitForPrimary(); // b and a come from the projections' launch before
    allowDependents();
    int const H = a.heads;
    int const i = blockIdx.x * kGatesThreads + threadIdx.x;
    if (i >= static_cast<int>(a.num_tokens) * H)
    {
        return;
    }
    int const t = i / H;
    int const h = i - t * H;
    auto const* const b = static_cast<__nv_bfloat16 const*>(a.b);
    auto const* const av = static_cast<__nv_bfloat16 const*>(a.a);
    float const bias = a.dt_bias_float != 0 ? static_cast<float const*>(a.dt_bias)[h]
                                            : __bfloat162float(static_cast<__nv_bfloat16 const*>(a.dt_bias)[h]);
    float const x = __fadd_rn(__bfloat162float(av[t * a.a_stride + h]), bias);
    float const softplus = x > 20.0F ? x : log1pf(expf(x));
    a.beta[i] = roundBf16(sigmoidOf(__bfloat162float(b[t * a.b_stride + h])));
    a.g[i] = __fmul_rn(a.neg_decay[h], softplus);
#endif
}

__device__ __forceinline__ float gatedInput(void const* x, bool isFloat, int64_t at)
{
    return isFloat ? roundBf16(static_cast<float const*>(x)[at])
                   : __bfloat162float(static_cast<__nv_bfloat16 const*>(x)[at]);
}

__global__ void __launch_bounds__(kNormThreads) gatedRmsNormKernel(EngramGatedNorm a)
{
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
    waitForPrimary(); // x (the core's output) and the gate come from the launches before
    allowDependents();
    int const lane = threadIdx.x & 31;
    int const row = blockIdx.x * kNormWarps + (threadIdx.x >> 5);
    int const H = a.heads;
    int const n = a.dim;
    if (row >= static_cast<int>(a.num_tokens) * H)
    {
        return;
    }
    int const t = row / H;
    int const h = row - t * H;
    bool const isFloat = a.x_float != 0;
    int64_t const xAt = t * a.x_stride + static_cast<int64_t>(h) * n;
    float squares = 0.0F;
    for (int c = lane; c < n; c += 32)
    {
        float const v = gatedInput(a.x, isFloat, xAt + c);
        squares = __fadd_rn(squares, __fmul_rn(v, v));
    }
    squares = warpSum(squares);
    float const r = rsqrtf(__fadd_rn(__fmul_rn(squares, __fdiv_rn(1.0F, static_cast<float>(n))), a.eps));
    auto const* const w = static_cast<__nv_bfloat16 const*>(a.weight);
    auto const* const gate = static_cast<__nv_bfloat16 const*>(a.gate);
    auto* const out = static_cast<__nv_bfloat16*>(a.out) + static_cast<int64_t>(row) * n;
    int64_t const gateAt = t * a.gate_stride + static_cast<int64_t>(h) * n;
    for (int c = lane; c < n; c += 32)
    {
        float const v = gatedInput(a.x, isFloat, xAt + c);
        float const y = roundBf16(__fmul_rn(v, r));                      // (x * rsqrt(...)).to(bf16)
        float const o = roundBf16(__fmul_rn(__bfloat162float(w[c]), y)); // weight * that, bf16
        float const z = __bfloat162float(gate[gateAt + c]);
        float const act = a.activation == ENGRAM_GATE_ACT_SILU ? __fdiv_rn(z, __fadd_rn(1.0F, expf(-z))) : sigmoidOf(z);
        out[c] = __float2bfloat16_rn(__fmul_rn(o, act));
    }
#endif
}

} // namespace

} // namespace kernels
} // namespace engram_trt

using namespace engram_trt::kernels;

extern "C" ENGRAM_API int engram_gdn_gates_bf16(EngramGdnGates const* args, cudaStream_t stream)
{
    clearError();
    char const* const fn = "engram_gdn_gates_bf16";
    if (args == nullptr)
    {
        return fail(cudaErrorInvalidValue, "%s: args must not be NULL", fn);
    }
    EngramGdnGates const a = *args;
    if (a.num_tokens < 0 || a.num_tokens > ENGRAM_GDN_GLUE_MAX_TOKENS)
    {
        return fail(cudaErrorInvalidValue, "%s: num_tokens must be in [0, %d] (a decode step; got %lld)", fn,
            ENGRAM_GDN_GLUE_MAX_TOKENS, ll(a.num_tokens));
    }
    if (a.heads < 1 || a.heads > ENGRAM_GDN_GLUE_MAX_HEADS || a.b_stride < a.heads || a.a_stride < a.heads)
    {
        return fail(cudaErrorInvalidValue,
            "%s: need 1 <= heads <= %d and b_stride, a_stride >= heads (got %d, %lld, %lld)", fn,
            ENGRAM_GDN_GLUE_MAX_HEADS, a.heads, ll(a.b_stride), ll(a.a_stride));
    }
    if (a.dt_bias_float != 0 && a.dt_bias_float != 1)
    {
        return fail(
            cudaErrorInvalidValue, "%s: dt_bias_float must be 0 (bf16) or 1 (float32) (got %d)", fn, a.dt_bias_float);
    }
    if (a.num_tokens == 0)
    {
        return 0;
    }
    if (a.b == nullptr || a.a == nullptr || a.dt_bias == nullptr || a.neg_decay == nullptr || !isAligned(a.b, 2)
        || !isAligned(a.a, 2) || !isAligned(a.dt_bias, a.dt_bias_float != 0 ? 4 : 2) || !isAligned(a.neg_decay, 4))
    {
        return fail(cudaErrorInvalidValue, "%s: b, a, dt_bias and neg_decay must be device pointers", fn);
    }
    if (a.beta == nullptr || a.g == nullptr || !isAligned(a.beta, 4) || !isAligned(a.g, 4))
    {
        return fail(cudaErrorInvalidValue, "%s: beta and g must be float32 device pointers", fn);
    }
    int64_t const outBytes = a.num_tokens * a.heads * 4;
    int64_t const bBytes = ((a.num_tokens - 1) * a.b_stride + a.heads) * 2;
    int64_t const aBytes = ((a.num_tokens - 1) * a.a_stride + a.heads) * 2;
    if (overlaps(a.beta, outBytes, a.g, outBytes) || overlaps(a.beta, outBytes, a.b, bBytes)
        || overlaps(a.beta, outBytes, a.a, aBytes) || overlaps(a.g, outBytes, a.b, bBytes)
        || overlaps(a.g, outBytes, a.a, aBytes))
    {
        return fail(cudaErrorInvalidValue, "%s: beta and g must not overlap each other or b and a", fn);
    }
    int const major = computeCapabilityMajor();
    if (major >= 0 && major < 9)
    {
        return fail(
            cudaErrorNotSupported, "%s: needs a GPU of compute capability 9.0 or later (this one is %d.x)", fn, major);
    }
    int64_t const items = a.num_tokens * a.heads;
    unsigned const blocks = static_cast<unsigned>((items + kGatesThreads - 1) / kGatesThreads);
    resetLaunchError();
    launchDependent(gdnGatesKernel, dim3(blocks), dim3(kGatesThreads), 0, stream, a);
    return checkLaunch(fn);
}

extern "C" ENGRAM_API int engram_gated_rms_norm_bf16(EngramGatedNorm const* args, cudaStream_t stream)
{
    clearError();
    char const* const fn = "engram_gated_rms_norm_bf16";
    if (args == nullptr)
    {
        return fail(cudaErrorInvalidValue, "%s: args must not be NULL", fn);
    }
    EngramGatedNorm const a = *args;
    if (a.num_tokens < 0 || a.num_tokens > ENGRAM_GDN_GLUE_MAX_TOKENS)
    {
        return fail(cudaErrorInvalidValue, "%s: num_tokens must be in [0, %d] (a decode step; got %lld)", fn,
            ENGRAM_GDN_GLUE_MAX_TOKENS, ll(a.num_tokens));
    }
    int64_t const width = static_cast<int64_t>(a.heads) * a.dim;
    if (a.heads < 1 || a.heads > ENGRAM_GDN_GLUE_MAX_HEADS || a.dim < 1 || a.x_stride < width || a.gate_stride < width)
    {
        return fail(cudaErrorInvalidValue,
            "%s: need 1 <= heads <= %d, dim >= 1 and x_stride, gate_stride >= heads * dim (got %d, %d, %lld, %lld)", fn,
            ENGRAM_GDN_GLUE_MAX_HEADS, a.heads, a.dim, ll(a.x_stride), ll(a.gate_stride));
    }
    if ((a.activation != ENGRAM_GATE_ACT_SILU && a.activation != ENGRAM_GATE_ACT_SIGMOID)
        || (a.x_float != 0 && a.x_float != 1) || !(a.eps >= 0.0F))
    {
        return fail(cudaErrorInvalidValue,
            "%s: need activation %d (silu) or %d (sigmoid), x_float 0 (bf16) or 1 (float32), eps >= 0 (got %d, %d, "
            "%g)",
            fn, ENGRAM_GATE_ACT_SILU, ENGRAM_GATE_ACT_SIGMOID, a.activation, a.x_float, static_cast<double>(a.eps));
    }
    if (a.num_tokens == 0)
    {
        return 0;
    }
    int const xBytes = a.x_float != 0 ? 4 : 2;
    if (a.x == nullptr || a.gate == nullptr || a.weight == nullptr || a.out == nullptr || !isAligned(a.x, xBytes)
        || !isAligned(a.gate, 2) || !isAligned(a.weight, 2) || !isAligned(a.out, 2))
    {
        return fail(cudaErrorInvalidValue, "%s: x, gate, weight and out must be device pointers", fn);
    }
    int64_t const outBytes = a.num_tokens * width * 2;
    if (overlaps(a.out, outBytes, a.x, ((a.num_tokens - 1) * a.x_stride + width) * xBytes)
        || overlaps(a.out, outBytes, a.gate, ((a.num_tokens - 1) * a.gate_stride + width) * 2)
        || overlaps(a.out, outBytes, a.weight, static_cast<int64_t>(a.dim) * 2))
    {
        return fail(cudaErrorInvalidValue, "%s: out must not overlap x, gate or weight", fn);
    }
    int const major = computeCapabilityMajor();
    if (major >= 0 && major < 9)
    {
        return fail(
            cudaErrorNotSupported, "%s: needs a GPU of compute capability 9.0 or later (this one is %d.x)", fn, major);
    }
    int64_t const rows = a.num_tokens * a.heads;
    unsigned const blocks = static_cast<unsigned>((rows + kNormWarps - 1) / kNormWarps);
    resetLaunchError();
    launchDependent(gatedRmsNormKernel, dim3(blocks), dim3(kNormThreads), 0, stream, a);
    return checkLaunch(fn);
}
