// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * Fused Engram gate: out[t, c] = hidden[t, c] + g(t, c) * value(t) over hc_mult streams.
 *
 * hidden / kv / out are bf16, fp16 or fp32 (one type per call, the I/O type); q / k
 * weights are bf16, fp32 or the I/O type; all math is fp32 (gateMath.h, shared with the
 * host tests). One block per (token, stream), the streams of a token adjacent in the
 * grid. Pass 1 loads h, key_c, value, q_c and k_c (up to four 8-element vectors per
 * thread, all loads issued before any math) and reduces three fp32 sums (h*q*k*key, h^2,
 * key^2) across the block; pass 2 writes h + g * value from the registers, rounded once
 * to the I/O type. So hidden, kv and out each cross HBM once (value: once per token, the
 * other streams hit L2), the bound that makes the gate a memory-bandwidth kernel. A NaN
 * score gives a NaN gate (as the reference), never 0.5. Masked tokens take the
 * block-uniform early path out = h (a bit copy), so a dead token's value can never leak
 * in (not even a NaN through 0 * value). `out` may alias `hidden` (an in-place update):
 * each thread reads h[j] before it writes out[j], and no other thread touches element j.
 */
#include "engramKernelsCore.h"
#include "engramKernelsInternal.h"
#include "gateKernels.h"
#include "gateMath.h"
#include "vecLoad.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace engram_trt
{
namespace kernels
{

constexpr int kGateMaxThreads = 256;

//! Eight consecutive elements of T as loaded: one 16-byte word for 16-bit types, two for fp32.
template <typename T>
struct Pack8
{
    uint4 words[sizeof(T) / 2];
};

template <typename T>
__device__ __forceinline__ Pack8<T> loadPack(T const* p)
{
    Pack8<T> pack;
#pragma unroll
    for (int i = 0; i < static_cast<int>(sizeof(T) / 2); ++i)
    {
        pack.words[i] = reinterpret_cast<uint4 const*>(p)[i];
    }
    return pack;
}

template <typename T>
__device__ __forceinline__ Pack8<T> zeroPack()
{
    Pack8<T> pack;
#pragma unroll
    for (int i = 0; i < static_cast<int>(sizeof(T) / 2); ++i)
    {
        pack.words[i] = make_uint4(0, 0, 0, 0);
    }
    return pack;
}

//! The 8 floats of a pack (exact conversions: bf16 and fp16 widen to fp32 without rounding).
__device__ __forceinline__ void unpack(Pack8<__nv_bfloat16> const& pack, float (&v)[8])
{
    uint32_t const w[4] = {pack.words[0].x, pack.words[0].y, pack.words[0].z, pack.words[0].w};
#pragma unroll
    for (int i = 0; i < 4; ++i)
    {
        v[2 * i] = __uint_as_float(w[i] << 16);
        v[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
    }
}

__device__ __forceinline__ void unpack(Pack8<__half> const& pack, float (&v)[8])
{
    uint32_t const w[4] = {pack.words[0].x, pack.words[0].y, pack.words[0].z, pack.words[0].w};
#pragma unroll
    for (int i = 0; i < 4; ++i)
    {
        v[2 * i] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[i] & 0xFFFFu)));
        v[2 * i + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[i] >> 16)));
    }
}

__device__ __forceinline__ void unpack(Pack8<float> const& pack, float (&v)[8])
{
    uint4 const a = pack.words[0];
    uint4 const b = pack.words[1];
    v[0] = __uint_as_float(a.x), v[1] = __uint_as_float(a.y), v[2] = __uint_as_float(a.z), v[3] = __uint_as_float(a.w);
    v[4] = __uint_as_float(b.x), v[5] = __uint_as_float(b.y), v[6] = __uint_as_float(b.z), v[7] = __uint_as_float(b.w);
}

/*
 * One block per (token, stream), blockIdx.x = t * hc_mult + c: the hc_mult blocks of a
 * token run side by side, so its value row (read by every stream) comes from L2 after
 * the first. Each thread owns kVecs 8-element vectors of the row (vector j = base +
 * k * blockDim.x + threadIdx.x, coalesced), issues all its loads (h, key, value, q, k)
 * before any math, and, when the row fits one pass (`resident`, the case the launcher
 * sizes for), keeps h and value in registers for the update: every byte of hidden and
 * kv crosses HBM once. Wider rows loop and re-read h and value in the second pass.
 */
template <typename IoT, typename WeightT, int kVecs>
__global__ void __launch_bounds__(kGateMaxThreads) engramGateKernel(IoT const* hidden, IoT const* __restrict__ kv,
    WeightT const* __restrict__ qWeight, WeightT const* __restrict__ kWeight, void const* __restrict__ mask,
    int32_t maskType, int32_t hcMult, int32_t hiddenSize, float eps, float clamp, IoT* out)
{
    int64_t const block = blockIdx.x;
    int64_t const t = block / hcMult;
    int32_t const c = static_cast<int32_t>(block - t * hcMult);
    int32_t const vectors = hiddenSize / 8;
    IoT const* h = hidden + (t * hcMult + c) * hiddenSize;
    IoT const* kvRow = kv + t * (hcMult + 1) * static_cast<int64_t>(hiddenSize);
    IoT const* key = kvRow + static_cast<int64_t>(c) * hiddenSize;
    IoT const* value = kvRow + static_cast<int64_t>(hcMult) * hiddenSize;
    WeightT const* q = qWeight + static_cast<int64_t>(c) * hiddenSize;
    WeightT const* k = kWeight + static_cast<int64_t>(c) * hiddenSize;
    IoT* o = out + (t * hcMult + c) * hiddenSize;

    bool live = true;
    if (maskType == ENGRAM_MASK_U8)
    {
        live = static_cast<uint8_t const*>(mask)[t] != 0;
    }
    else if (maskType == ENGRAM_MASK_I32)
    {
        live = static_cast<int32_t const*>(mask)[t] != 0;
    }
    if (!live)
    {
        // A bit copy in 16-byte words: D * sizeof(IoT) is a multiple of 16 (D % 8 == 0).
        int32_t const words = vectors * static_cast<int32_t>(sizeof(IoT) / 2);
        for (int32_t j = threadIdx.x; j < words; j += blockDim.x)
        {
            reinterpret_cast<uint4*>(o)[j] = reinterpret_cast<uint4 const*>(h)[j];
        }
        return;
    }

    int32_t const perPass = static_cast<int32_t>(blockDim.x) * kVecs;
    bool const resident = vectors <= perPass; // block-uniform
    Pack8<IoT> hKeep[kVecs];
    Pack8<IoT> vKeep[kVecs];
    float dot = 0.0F;
    float hh = 0.0F;
    float kk = 0.0F;
    for (int32_t base = 0; base < vectors; base += perPass)
    {
        Pack8<IoT> keyPack[kVecs];
        Pack8<WeightT> qPack[kVecs];
        Pack8<WeightT> kPack[kVecs];
        // Loads first (zeros past the row's end add nothing to the sums) ...
#pragma unroll
        for (int u = 0; u < kVecs; ++u)
        {
            int32_t const j = base + u * static_cast<int32_t>(blockDim.x) + static_cast<int32_t>(threadIdx.x);
            bool const inRow = j < vectors;
            hKeep[u] = inRow ? loadPack(h + 8 * j) : zeroPack<IoT>();
            keyPack[u] = inRow ? loadPack(key + 8 * j) : zeroPack<IoT>();
            qPack[u] = inRow ? loadPack(q + 8 * j) : zeroPack<WeightT>();
            kPack[u] = inRow ? loadPack(k + 8 * j) : zeroPack<WeightT>();
            if (resident)
            {
                vKeep[u] = inRow ? loadPack(value + 8 * j) : zeroPack<IoT>();
            }
        }
        // ... then the math.
#pragma unroll
        for (int u = 0; u < kVecs; ++u)
        {
            float hv[8], keyv[8], qv[8], kwv[8];
            unpack(hKeep[u], hv);
            unpack(keyPack[u], keyv);
            unpack(qPack[u], qv);
            unpack(kPack[u], kwv);
#pragma unroll
            for (int i = 0; i < 8; ++i)
            {
                gateAccumulate(hv[i], keyv[i], qv[i], kwv[i], dot, hh, kk);
            }
        }
    }

    __shared__ float partial[3][kGateMaxThreads / 32];
    __shared__ float gateShared;
    dot = warpSum(dot);
    hh = warpSum(hh);
    kk = warpSum(kk);
    int const warp = threadIdx.x / 32;
    int const lane = threadIdx.x % 32;
    int const warps = (blockDim.x + 31) / 32;
    if (warps > 1)
    {
        if (lane == 0)
        {
            partial[0][warp] = dot;
            partial[1][warp] = hh;
            partial[2][warp] = kk;
        }
        __syncthreads();
        if (warp == 0)
        {
            dot = warpSum(lane < warps ? partial[0][lane] : 0.0F);
            hh = warpSum(lane < warps ? partial[1][lane] : 0.0F);
            kk = warpSum(lane < warps ? partial[2][lane] : 0.0F);
        }
    }
    if (threadIdx.x == 0)
    {
        gateShared = gateFromScore(gateScore(dot, hh, kk, hiddenSize, eps), clamp);
    }
    __syncthreads();
    float const g = gateShared;

    if (resident)
    {
#pragma unroll
        for (int u = 0; u < kVecs; ++u)
        {
            int32_t const j = u * static_cast<int32_t>(blockDim.x) + static_cast<int32_t>(threadIdx.x);
            if (j < vectors)
            {
                float hv[8], vv[8];
                unpack(hKeep[u], hv);
                unpack(vKeep[u], vv);
#pragma unroll
                for (int i = 0; i < 8; ++i)
                {
                    hv[i] = gateUpdate(hv[i], g, vv[i]);
                }
                store8(o + 8 * j, hv);
            }
        }
        return;
    }
    for (int32_t j = threadIdx.x; j < vectors; j += blockDim.x)
    {
        float hv[8], vv[8];
        load8(h + 8 * j, hv);
        load8(value + 8 * j, vv);
#pragma unroll
        for (int i = 0; i < 8; ++i)
        {
            hv[i] = gateUpdate(hv[i], g, vv[i]);
        }
        store8(o + 8 * j, hv);
    }
}

//! Vectors per thread and threads per block for a row of `vectors` 8-element vectors:
//! as many vectors per thread as keep >= 64 threads (more bytes in flight per thread),
//! at most 4 (2 for fp32, whose vectors are twice the registers); one pass up to
//! 256 threads * kVecs vectors (D = 8192 for 16-bit types).
struct GateLaunchShape
{
    int vecsPerThread;
    int threads;
};

inline GateLaunchShape gateLaunchShape(int32_t vectors, int32_t ioBytes)
{
    int const maxVecs = ioBytes == 4 ? 2 : 4;
    int vecs = 1;
    while (vecs < maxVecs && vectors >= 64 * vecs * 2)
    {
        vecs *= 2;
    }
    int threads = ((vectors + vecs - 1) / vecs + 31) / 32 * 32;
    threads = threads > kGateMaxThreads ? kGateMaxThreads : threads;
    return {vecs, threads};
}

namespace
{

char const* typeName(int32_t type)
{
    switch (type)
    {
    case ENGRAM_FLOAT_BF16: return "bf16";
    case ENGRAM_FLOAT_F32: return "fp32";
    case ENGRAM_FLOAT_F16: return "fp16";
    default: return "unknown";
    }
}

template <typename IoT, typename WeightT>
void launchGate(int vecsPerThread, dim3 grid, int threads, cudaStream_t stream, void const* hidden, void const* kv,
    void const* qWeight, void const* kWeight, void const* mask, int32_t maskType, int32_t hcMult, int32_t hiddenSize,
    float eps, float clamp, void* out)
{
    auto const* hiddenT = static_cast<IoT const*>(hidden);
    auto const* kvT = static_cast<IoT const*>(kv);
    auto const* qT = static_cast<WeightT const*>(qWeight);
    auto const* kT = static_cast<WeightT const*>(kWeight);
    auto* outT = static_cast<IoT*>(out);
    switch (vecsPerThread)
    {
    case 4:
        if constexpr (sizeof(IoT) < 4)
        {
            engramGateKernel<IoT, WeightT, 4><<<grid, threads, 0, stream>>>(
                hiddenT, kvT, qT, kT, mask, maskType, hcMult, hiddenSize, eps, clamp, outT);
            break;
        }
        [[fallthrough]];
    case 2:
        engramGateKernel<IoT, WeightT, 2>
            <<<grid, threads, 0, stream>>>(hiddenT, kvT, qT, kT, mask, maskType, hcMult, hiddenSize, eps, clamp, outT);
        break;
    default:
        engramGateKernel<IoT, WeightT, 1>
            <<<grid, threads, 0, stream>>>(hiddenT, kvT, qT, kT, mask, maskType, hcMult, hiddenSize, eps, clamp, outT);
        break;
    }
}

template <typename IoT>
void launchGateFor(int32_t weightType, int vecsPerThread, dim3 grid, int threads, cudaStream_t stream,
    void const* hidden, void const* kv, void const* qWeight, void const* kWeight, void const* mask, int32_t maskType,
    int32_t hcMult, int32_t hiddenSize, float eps, float clamp, void* out)
{
    // Weights are bf16, fp32, or the I/O type (checked by the caller).
    if (weightType == ENGRAM_FLOAT_BF16)
    {
        launchGate<IoT, __nv_bfloat16>(vecsPerThread, grid, threads, stream, hidden, kv, qWeight, kWeight, mask,
            maskType, hcMult, hiddenSize, eps, clamp, out);
    }
    else if (weightType == ENGRAM_FLOAT_F32)
    {
        launchGate<IoT, float>(vecsPerThread, grid, threads, stream, hidden, kv, qWeight, kWeight, mask, maskType,
            hcMult, hiddenSize, eps, clamp, out);
    }
    else
    {
        launchGate<IoT, IoT>(vecsPerThread, grid, threads, stream, hidden, kv, qWeight, kWeight, mask, maskType, hcMult,
            hiddenSize, eps, clamp, out);
    }
}

} // namespace

} // namespace kernels
} // namespace engram_trt

using namespace engram_trt::kernels;

extern "C" ENGRAM_API int engram_gate_typed(void const* hidden, void const* kv, int32_t ioType, void const* qWeight,
    void const* kWeight, int32_t weightType, void const* mask, int32_t maskType, int64_t numTokens, int32_t hcMult,
    int32_t hiddenSize, float eps, float clamp, void* out, cudaStream_t stream)
{
    clearError();
    if (numTokens < 0 || hcMult < 1 || hiddenSize < 8 || hiddenSize % 8 != 0)
    {
        return fail(cudaErrorInvalidValue,
            "engram_gate: need num_tokens >= 0, hc_mult >= 1, hidden_size %% 8 == 0 (got %lld, %d, %d)",
            static_cast<long long>(numTokens), hcMult, hiddenSize);
    }
    if (ioType != ENGRAM_FLOAT_BF16 && ioType != ENGRAM_FLOAT_F32 && ioType != ENGRAM_FLOAT_F16)
    {
        return fail(cudaErrorInvalidValue, "engram_gate: io_type %d is not bf16 (0), fp32 (1) or fp16 (2)", ioType);
    }
    if (weightType != ENGRAM_FLOAT_BF16 && weightType != ENGRAM_FLOAT_F32 && weightType != ioType)
    {
        return fail(cudaErrorInvalidValue,
            "engram_gate: weight_type %d is neither bf16 (0), fp32 (1) nor the io_type (%d, %s)", weightType, ioType,
            typeName(ioType));
    }
    if (maskType != ENGRAM_MASK_NONE && maskType != ENGRAM_MASK_U8 && maskType != ENGRAM_MASK_I32)
    {
        return fail(cudaErrorInvalidValue, "engram_gate: mask_type %d is not none (0), u8 (1) or i32 (2)", maskType);
    }
    if (!(eps >= 0.0F) || !(clamp >= 0.0F))
    {
        return fail(cudaErrorInvalidValue, "engram_gate: eps and clamp must be >= 0");
    }
    if (numTokens == 0)
    {
        return 0;
    }
    if (hcMult > 65535 || numTokens > 0x7FFFFFFFLL / hcMult)
    {
        return fail(cudaErrorInvalidValue, "engram_gate: grid too large (%lld tokens x hc_mult %d >= 2^31)",
            static_cast<long long>(numTokens), hcMult);
    }
    void const* required[] = {hidden, kv, qWeight, kWeight, out};
    for (void const* p : required)
    {
        if (p == nullptr || !isAligned(p, 16))
        {
            return fail(cudaErrorInvalidValue,
                "engram_gate: hidden, kv, q_weight, k_weight and out must be "
                "16-byte aligned device pointers");
        }
    }
    if (maskType != ENGRAM_MASK_NONE && mask == nullptr)
    {
        return fail(cudaErrorInvalidValue, "engram_gate: mask_type says a mask but mask is NULL");
    }

    int32_t const ioBytes = ioType == ENGRAM_FLOAT_F32 ? 4 : 2;
    GateLaunchShape const shape = gateLaunchShape(hiddenSize / 8, ioBytes);
    dim3 const grid(static_cast<unsigned>(numTokens * hcMult));
    resetLaunchError();
    if (ioType == ENGRAM_FLOAT_BF16)
    {
        launchGateFor<__nv_bfloat16>(weightType, shape.vecsPerThread, grid, shape.threads, stream, hidden, kv, qWeight,
            kWeight, mask, maskType, hcMult, hiddenSize, eps, clamp, out);
    }
    else if (ioType == ENGRAM_FLOAT_F16)
    {
        launchGateFor<__half>(weightType, shape.vecsPerThread, grid, shape.threads, stream, hidden, kv, qWeight,
            kWeight, mask, maskType, hcMult, hiddenSize, eps, clamp, out);
    }
    else
    {
        launchGateFor<float>(weightType, shape.vecsPerThread, grid, shape.threads, stream, hidden, kv, qWeight, kWeight,
            mask, maskType, hcMult, hiddenSize, eps, clamp, out);
    }
    return checkLaunch("engram_gate");
}

extern "C" ENGRAM_API int engram_gate(void const* hidden, void const* kv, void const* qWeight, void const* kWeight,
    int32_t weightType, void const* mask, int32_t maskType, int64_t numTokens, int32_t hcMult, int32_t hiddenSize,
    float eps, float clamp, void* out, cudaStream_t stream)
{
    // The bf16-only form: bf16 or fp32 weights, as before the I/O type existed.
    if (weightType != ENGRAM_WEIGHT_BF16 && weightType != ENGRAM_WEIGHT_F32)
    {
        clearError();
        return fail(cudaErrorInvalidValue, "engram_gate: weight_type %d is neither bf16 (0) nor fp32 (1)", weightType);
    }
    return engram_gate_typed(hidden, kv, ENGRAM_FLOAT_BF16, qWeight, kWeight, weightType, mask, maskType, numTokens,
        hcMult, hiddenSize, eps, clamp, out, stream);
}
