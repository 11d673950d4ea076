// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * Device helpers of the stored-format kernels (quantKernels.h): the scale formats, the
 * e4m3 / e2m1 decodes, the e4m3 encode of the activation quantization, stores of any
 * EngramFloatType, and the warp-level primitives of the tensor-core GEMMs (cp.async,
 * ldmatrix, mma) with the fragment layouts they rely on.
 */
#ifndef ENGRAM_TRT_QUANT_DEVICE_CUH
#define ENGRAM_TRT_QUANT_DEVICE_CUH

#include "engramKernelsCore.h"
#include "quantKernels.h"
#include "vecLoad.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace engram_trt
{
namespace kernels
{

constexpr float kFp8Max = 448.0F;
constexpr float kActAmaxFloor = 1e-4F;

//! A ue8m0 scale byte as a float: 2^(b - 127), exactly (b = 0 is the subnormal 2^-127);
//! b = 255 is NaN.
__device__ __forceinline__ float ue8m0ToFloat(uint32_t b)
{
    if (b == 0U)
    {
        return __uint_as_float(0x00400000U);
    }
    return b == 255U ? __uint_as_float(0x7FC00000U) : __uint_as_float(b << 23);
}

//! ue8m0ToFloat with selects instead of branches (for loops that load many scales).
__device__ __forceinline__ float ue8m0ToFloatSelect(uint32_t b)
{
    uint32_t bits = b << 23;
    bits = b == 0U ? 0x00400000U : bits;
    bits = b == 255U ? 0x7FC00000U : bits;
    return __uint_as_float(bits);
}

//! Element i of a scale array: float32, or ue8m0 bytes when `ue8m0`.
__device__ __forceinline__ float loadScale(void const* scale, int64_t i, bool ue8m0)
{
    if (ue8m0)
    {
        return ue8m0ToFloat(__ldg(static_cast<uint8_t const*>(scale) + i));
    }
    return __ldg(static_cast<float const*>(scale) + i);
}

//! The smallest power of two >= s (s > 0 and finite), exactly: s itself when its mantissa
//! is zero, else the next binade's first value. (A subnormal s gives 2^-126 or below
//! correctly too: its mantissa bits are the value.)
__device__ __forceinline__ float pow2Ceil(float s)
{
    uint32_t const bits = __float_as_uint(s);
    uint32_t const exponent = bits & 0x7F800000U;
    if ((bits & 0x007FFFFFU) == 0U)
    {
        return s;
    }
    if (exponent == 0U) // subnormal: the next power of two of the mantissa's leading bit
    {
        uint32_t const lead = 0x80000000U >> __clz(bits);
        return __uint_as_float(lead == (bits & 0x007FFFFFU) ? bits : lead << 1);
    }
    return __uint_as_float(exponent + 0x00800000U);
}

//! x rounded to e4m3 (round to nearest even, saturating to +-448; NaN stays NaN): the byte.
__device__ __forceinline__ uint8_t floatToE4m3(float x)
{
    return static_cast<uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
}

//! An e4m3 byte as a float (exact).
__device__ __forceinline__ float e4m3ToFloat(uint8_t b)
{
    __half_raw const h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(b), __NV_E4M3);
    return __half2float(__half(h));
}

//! Bytes 0..3 of `word` (e4m3) as floats v[0..3] (exact): two cvt.rn.f16x2.e4m3x2 on sm_89+
//! reading the word's 16-bit halves in place (F2FP .H0 / .H1: no shift), each half widened.
__device__ __forceinline__ void e4m3x4ToFloat(uint32_t word, float* v)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    uint32_t lo;
    uint32_t hi;
    asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n cvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
        : "=r"(lo), "=r"(hi)
        : "r"(word));
    float2 const a = __half22float2(*reinterpret_cast<__half2 const*>(&lo));
    float2 const b = __half22float2(*reinterpret_cast<__half2 const*>(&hi));
#else
    __half2_raw const lo = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(word & 0xFFFFU), __NV_E4M3);
    __half2_raw const hi = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(word >> 16), __NV_E4M3);
    float2 const a = __half22float2(__half2(lo));
    float2 const b = __half22float2(__half2(hi));
#endif
    v[0] = a.x;
    v[1] = a.y;
    v[2] = b.x;
    v[3] = b.y;
}

/*
 * The 8 e2m1 values of one 32-bit word (element 2j in bits 0-3 of byte j, 2j+1 in bits
 * 4-7), each times 2^-6, as floats v[0..7] in element order (exact). A nibble s e1 e0 m
 * becomes the e4m3 byte s 0 0 e1 e0 m 0 0: for e > 0 that is 2^(e - 7) (1 + m/2), for e = 0
 * the subnormal m/2 2^-6 -- both 2^-6 times the e2m1 value. The low nibbles of the 4 bytes
 * and the high ones give two words of 4 such bytes (5 logic / shift instructions), then
 * cvt.rn.f16x2.e4m3x2 widens 2 values an instruction (sm_89+) and each half widens to float.
 */
__device__ __forceinline__ void e2m1x8ToFloatScaled(uint32_t x, float* v)
{
    uint32_t const even = ((x << 2) & 0x1C1C1C1CU) | ((x << 4) & 0x80808080U); // elements 0, 2, 4, 6
    uint32_t const odd = ((x >> 2) & 0x1C1C1C1CU) | (x & 0x80808080U);         // elements 1, 3, 5, 7
    float e[4];
    float o[4];
    e4m3x4ToFloat(even, e);
    e4m3x4ToFloat(odd, o);
#pragma unroll
    for (int i = 0; i < 4; ++i)
    {
        v[2 * i] = e[i];
        v[2 * i + 1] = o[i];
    }
}

//! 2^6: what e2m1x8ToFloatScaled's values are short of (folded into the block scale).
constexpr float kE2m1DecodeScale = 64.0F;

//! The e2m1 value of a 4-bit code as bf16 bits (exact: 0, 0.5, 1, 1.5, 2, 3, 4, 6, signed).
__device__ __forceinline__ uint32_t e2m1Bf16Bits(uint32_t code)
{
    uint32_t const m = code & 7U;
    uint32_t bits = 0U;
    switch (m)
    {
    case 0: bits = 0x0000U; break;
    case 1: bits = 0x3F00U; break;
    case 2: bits = 0x3F80U; break;
    case 3: bits = 0x3FC0U; break;
    case 4: bits = 0x4000U; break;
    case 5: bits = 0x4040U; break;
    case 6: bits = 0x4080U; break;
    default: bits = 0x40C0U; break;
    }
    return bits | ((code & 8U) << 12);
}

//! v rounded once (to nearest even) to the EngramFloatType `type` and stored at out[i].
__device__ __forceinline__ void storeFloatAs(void* out, int32_t type, int64_t i, float v)
{
    if (type == ENGRAM_FLOAT_BF16)
    {
        static_cast<__nv_bfloat16*>(out)[i] = __float2bfloat16_rn(v);
    }
    else if (type == ENGRAM_FLOAT_F16)
    {
        static_cast<__half*>(out)[i] = __float2half_rn(v);
    }
    else
    {
        static_cast<float*>(out)[i] = v;
    }
}

//! in[i] of the EngramFloatType `type`, widened to float.
__device__ __forceinline__ float loadFloatAs(void const* in, int32_t type, int64_t i)
{
    if (type == ENGRAM_FLOAT_BF16)
    {
        return __bfloat162float(static_cast<__nv_bfloat16 const*>(in)[i]);
    }
    if (type == ENGRAM_FLOAT_F16)
    {
        return __half2float(static_cast<__half const*>(in)[i]);
    }
    return static_cast<float const*>(in)[i];
}

/*
 * Tensor-core primitives (sm_80+; the e4m3 mma sm_89+). The fragment layouts, PTX ISA
 * 9.7.14.5 ("Matrix Fragments for mma.m16n8k16" with .bf16 and "mma.m16n8k32" with
 * .e4m3), with g = lane / 4 (groupID) and t = lane % 4 (threadID_in_group):
 *   A (16 x K, row major), four .b32 registers a0..a3:
 *     a0 = A[g][c0 .. c0+3 bytes], a1 = A[g + 8][same], a2 = A[g][16 + c0 ..], a3 = A[g + 8][16 + c0 ..]
 *     with c0 = 4 t bytes (bf16 k16: elements 2t, 2t+1 and 8 + 2t, 8 + 2t + 1; e4m3 k32:
 *     elements 4t .. 4t+3 and 16 + 4t ..): the same bytes for both, 16 rows of 32 bytes.
 *   B (K x 8, "col": element (k, n) read from W[n][k]), two .b32 registers b0, b1:
 *     b0 = W[g][4t .. 4t+3 bytes], b1 = W[g][16 + 4t .. 16 + 4t + 3 bytes].
 *   C / D (16 x 8 float32): c0, c1 = D[g][2t, 2t+1], c2, c3 = D[g + 8][2t, 2t+1].
 * ldmatrix.m8n8.x4.b16 (9.7.9.25) gives lane l, of matrix i, the 4 bytes 4 (l % 4) ..
 * of row l / 4 of that 8 x 16-byte matrix, the row addresses of matrix i coming from
 * lanes 8 i .. 8 i + 7: with matrices (rows 0-7, bytes 0-15), (rows 8-15, bytes 0-15),
 * (rows 0-7, bytes 16-31), (rows 8-15, bytes 16-31) of a 16 x 32-byte tile it yields
 * a0..a3 above; with (n 0-7, bytes 0-15), (n 0-7, bytes 16-31), (n 8-15, bytes 0-15),
 * (n 8-15, bytes 16-31) of W it yields b0, b1 of two n8 tiles. (8-bit operands load with
 * the b16 form: only the bytes matter.)
 */

//! Shared-memory address of a generic pointer into shared memory.
__device__ __forceinline__ uint32_t smemAddress(void const* p)
{
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

//! 16 bytes global -> shared, asynchronously (L2 only); `bytes` 0 writes zeros and reads nothing.
__device__ __forceinline__ void cpAsync16(uint32_t dst, void const* src, uint32_t bytes)
{
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
#endif
}

//! 4 bytes global -> shared, asynchronously; `bytes` 0 writes zeros and reads nothing.
__device__ __forceinline__ void cpAsync4(uint32_t dst, void const* src, uint32_t bytes)
{
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
#endif
}

__device__ __forceinline__ void cpAsyncCommit()
{
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}

//! Waits until at most N committed groups of this thread are still in flight.
template <int N>
__device__ __forceinline__ void cpAsyncWait()
{
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

__device__ __forceinline__ void ldmatrixX4(uint32_t (&d)[4], uint32_t address)
{
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(address));
#endif
}

//! D = A B + D, 16 x 8 x 16 bf16 with float32 accumulation (sm_80+).
__device__ __forceinline__ void mmaBf16(float (&d)[4], uint32_t const (&a)[4], uint32_t b0, uint32_t b1)
{
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

//! D = A B + D, 16 x 8 x 32 e4m3 with float32 accumulation (sm_89+; nothing before).
__device__ __forceinline__ void mmaE4m3(float (&d)[4], uint32_t const (&a)[4], uint32_t b0, uint32_t b1)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

/*
 * Chunk c (8 consecutive values) of a weight vector as floats: FP8 bytes 8c .. 8c + 7
 * (cvt.rn.f16x2.e4m3x2 on sm_89+, then widened); FP4 word c (times 2^-6); BF16 the
 * vector itself (c = 0).
 */
template <int WT>
__device__ __forceinline__ void decodeChunk(uint4 const& vec, int c, float (&wf)[8])
{
    uint32_t const words[4] = {vec.x, vec.y, vec.z, vec.w};
    if constexpr (WT == ENGRAM_QWEIGHT_FP8_E4M3)
    {
        e4m3x4ToFloat(words[2 * c], wf);
        e4m3x4ToFloat(words[2 * c + 1], wf + 4);
    }
    else if constexpr (WT == ENGRAM_QWEIGHT_FP4_E2M1)
    {
        e2m1x8ToFloatScaled(words[c], wf);
    }
    else
    {
        unpack8Pairs<__nv_bfloat162>(vec, wf);
    }
}

} // namespace kernels
} // namespace engram_trt

#endif // ENGRAM_TRT_QUANT_DEVICE_CUH
