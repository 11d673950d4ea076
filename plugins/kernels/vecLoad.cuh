// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * Device helpers shared by the kernels: eight consecutive elements loaded as floats
 * (one 16-byte load for bf16 / fp16, two for fp32) and stored back rounded once, bf16
 * rows of any width in vectors of 8, 4 or 1, a warp-wide sum and max, and the sigmoid. One home, so the gate,
 * the attention and the decoder-layer kernels cannot drift apart in how they read and
 * round their inputs; toFloat / fromFloat / roundTo, the per-element conversions every
 * kernel with bf16 / fp16 / fp32 I/O makes.
 */
#ifndef ENGRAM_TRT_VEC_LOAD_CUH
#define ENGRAM_TRT_VEC_LOAD_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace engram_trt
{
namespace kernels
{

//! Two 16-bit values of a pair widened to floats.
__device__ __forceinline__ float2 unpackPair(__nv_bfloat162 pair)
{
    return __bfloat1622float2(pair);
}

__device__ __forceinline__ float2 unpackPair(__half2 pair)
{
    return __half22float2(pair);
}

//! The pair type of a 16-bit type (bf16 -> __nv_bfloat162, fp16 -> __half2).
template <typename T>
struct PairOf;

template <>
struct PairOf<__nv_bfloat16>
{
    using type = __nv_bfloat162;
};

template <>
struct PairOf<__half>
{
    using type = __half2;
};

//! The 8 16-bit values (pairs of type Pair) of one 16-byte word already in registers, as
//! floats.
template <typename Pair>
__device__ __forceinline__ void unpack8Pairs(uint4 raw, float (&v)[8])
{
    Pair const* pairs = reinterpret_cast<Pair const*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i)
    {
        float2 const f = unpackPair(pairs[i]);
        v[2 * i] = f.x;
        v[2 * i + 1] = f.y;
    }
}

//! 8 consecutive 16-bit values (pairs of type Pair) as floats, from one 16-byte load.
template <typename Pair, typename T>
__device__ __forceinline__ void load8Pairs(T const* p, float (&v)[8])
{
    unpack8Pairs<Pair>(*reinterpret_cast<uint4 const*>(p), v);
}

//! 8 consecutive values as floats (bf16 / fp16 from one 16-byte load, fp32 from two).
__device__ __forceinline__ void load8(__nv_bfloat16 const* p, float (&v)[8])
{
    load8Pairs<__nv_bfloat162>(p, v);
}

__device__ __forceinline__ void load8(__half const* p, float (&v)[8])
{
    load8Pairs<__half2>(p, v);
}

__device__ __forceinline__ void load8(float const* p, float (&v)[8])
{
    float4 const a = *reinterpret_cast<float4 const*>(p);
    float4 const b = *reinterpret_cast<float4 const*>(p + 4);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
    v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

//! Two floats rounded once (to nearest even) to a pair of the I/O type.
template <typename Pair>
__device__ __forceinline__ Pair packPair(float a, float b);

template <>
__device__ __forceinline__ __nv_bfloat162 packPair<__nv_bfloat162>(float a, float b)
{
    return __floats2bfloat162_rn(a, b);
}

template <>
__device__ __forceinline__ __half2 packPair<__half2>(float a, float b)
{
    return __floats2half2_rn(a, b);
}

//! 8 consecutive floats rounded once (to nearest even) to 16-bit pairs, one 16-byte store.
template <typename Pair, typename T>
__device__ __forceinline__ void store8Pairs(T* p, float const (&v)[8])
{
    uint4 packed;
    Pair* pairs = reinterpret_cast<Pair*>(&packed);
#pragma unroll
    for (int i = 0; i < 4; ++i)
    {
        pairs[i] = packPair<Pair>(v[2 * i], v[2 * i + 1]);
    }
    *reinterpret_cast<uint4*>(p) = packed;
}

//! 8 consecutive floats rounded once (to nearest even) to the I/O type and stored.
__device__ __forceinline__ void store8(__nv_bfloat16* p, float const (&v)[8])
{
    store8Pairs<__nv_bfloat162>(p, v);
}

__device__ __forceinline__ void store8(__half* p, float const (&v)[8])
{
    store8Pairs<__half2>(p, v);
}

__device__ __forceinline__ void store8(float* p, float const (&v)[8])
{
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
    *reinterpret_cast<float4*>(p + 4) = make_float4(v[4], v[5], v[6], v[7]);
}

//! V consecutive bf16 values as floats (V = 8: one 16-byte load, 4: one 8-byte load,
//! 1: one element), for kernels whose rows need not be multiples of 8 elements.
template <int V>
__device__ __forceinline__ void loadBf16(__nv_bfloat16 const* p, float (&v)[V])
{
    if constexpr (V == 8)
    {
        load8(p, v);
    }
    else if constexpr (V == 4)
    {
        uint2 const raw = *reinterpret_cast<uint2 const*>(p);
        __nv_bfloat162 const* pairs = reinterpret_cast<__nv_bfloat162 const*>(&raw);
        float2 const a = __bfloat1622float2(pairs[0]);
        float2 const b = __bfloat1622float2(pairs[1]);
        v[0] = a.x, v[1] = a.y, v[2] = b.x, v[3] = b.y;
    }
    else
    {
#pragma unroll
        for (int i = 0; i < V; ++i)
        {
            v[i] = __bfloat162float(p[i]);
        }
    }
}

//! V floats rounded once (to nearest even) to bf16 and stored (the widths of loadBf16).
template <int V>
__device__ __forceinline__ void storeBf16(__nv_bfloat16* p, float const (&v)[V])
{
    if constexpr (V == 8)
    {
        store8(p, v);
    }
    else if constexpr (V == 4)
    {
        uint2 packed;
        __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&packed);
        pairs[0] = __floats2bfloat162_rn(v[0], v[1]);
        pairs[1] = __floats2bfloat162_rn(v[2], v[3]);
        *reinterpret_cast<uint2*>(p) = packed;
    }
    else
    {
#pragma unroll
        for (int i = 0; i < V; ++i)
        {
            p[i] = __float2bfloat16_rn(v[i]);
        }
    }
}

//! One element of an I/O type widened to float (fp32, bf16, fp16 overloads).
__device__ __forceinline__ float toFloat(float x)
{
    return x;
}

__device__ __forceinline__ float toFloat(__nv_bfloat16 x)
{
    return __bfloat162float(x);
}

__device__ __forceinline__ float toFloat(__half x)
{
    return __half2float(x);
}

//! A float rounded once (to nearest even) to T, the kernels' one output rounding.
template <typename T>
__device__ __forceinline__ T fromFloat(float x);

template <>
__device__ __forceinline__ float fromFloat<float>(float x)
{
    return x;
}

template <>
__device__ __forceinline__ __nv_bfloat16 fromFloat<__nv_bfloat16>(float x)
{
    return __float2bfloat16_rn(x);
}

template <>
__device__ __forceinline__ __half fromFloat<__half>(float x)
{
    return __float2half_rn(x);
}

//! x rounded once to T (to nearest even) and widened back: the rounding a PyTorch op of
//! dtype T makes between two steps of a reference.
template <typename T>
__device__ __forceinline__ float roundTo(float x)
{
    return toFloat(fromFloat<T>(x));
}

//! x rounded to bf16 (to nearest even) and widened back: one rounding of a PyTorch bf16 op.
__device__ __forceinline__ float roundBf16(float x)
{
    return __bfloat162float(__float2bfloat16_rn(x));
}

//! The sum of v over the 32 lanes of a warp, in every lane.
__device__ __forceinline__ float warpSum(float v)
{
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1)
    {
        v += __shfl_xor_sync(0xFFFFFFFFu, v, offset);
    }
    return v;
}

//! The largest v over the 32 lanes of a warp, in every lane.
__device__ __forceinline__ float warpMax(float v)
{
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1)
    {
        v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, offset));
    }
    return v;
}

//! torch.sigmoid's float32 formula, 1 / (1 + exp(-x)) (the caller rounds to its I/O type).
__device__ __forceinline__ float sigmoidOf(float x)
{
    return 1.0F / (1.0F + expf(-x));
}

//! 16 bytes read once (weights streamed through): skip the L1 (ld.global.nc.L1::no_allocate).
__device__ __forceinline__ uint4 loadStreaming(uint4 const* p)
{
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

} // namespace kernels
} // namespace engram_trt

#endif // ENGRAM_TRT_VEC_LOAD_CUH
