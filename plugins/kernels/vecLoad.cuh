// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * Device helpers shared by the kernels: eight consecutive elements loaded as floats
 * (one 16-byte load for bf16 / fp16, two for fp32) and a warp-wide sum. One home, so the
 * gate and the attention kernels cannot drift apart in how they read their inputs.
 */
#ifndef ENGRAM_TRT_VEC_LOAD_CUH
#define ENGRAM_TRT_VEC_LOAD_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace engram_trt
{
namespace kernels
{

//! 8 consecutive values as floats (bf16 / fp16 from one 16-byte load, fp32 from two).
__device__ __forceinline__ void load8(__nv_bfloat16 const* p, float (&v)[8])
{
    uint4 const raw = *reinterpret_cast<uint4 const*>(p);
    __nv_bfloat162 const* pairs = reinterpret_cast<__nv_bfloat162 const*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i)
    {
        float2 const f = __bfloat1622float2(pairs[i]);
        v[2 * i] = f.x;
        v[2 * i + 1] = f.y;
    }
}

__device__ __forceinline__ void load8(__half const* p, float (&v)[8])
{
    uint4 const raw = *reinterpret_cast<uint4 const*>(p);
    __half2 const* pairs = reinterpret_cast<__half2 const*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i)
    {
        float2 const f = __half22float2(pairs[i]);
        v[2 * i] = f.x;
        v[2 * i + 1] = f.y;
    }
}

__device__ __forceinline__ void load8(float const* p, float (&v)[8])
{
    float4 const a = *reinterpret_cast<float4 const*>(p);
    float4 const b = *reinterpret_cast<float4 const*>(p + 4);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
    v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
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

} // namespace kernels
} // namespace engram_trt

#endif // ENGRAM_TRT_VEC_LOAD_CUH
