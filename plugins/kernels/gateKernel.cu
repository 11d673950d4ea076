/*
 * Fused Engram gate: out[t, c] = hidden[t, c] + g(t, c) * value(t) over hc_mult streams.
 *
 * hidden / kv / out are bf16, fp16 or fp32 (one type per call, the I/O type); q / k
 * weights are bf16, fp32 or the I/O type; all math is fp32. One block per (token,
 * stream). Pass 1 reads h, key_c, q_c and k_c eight elements at a time (one 16-byte
 * load for 16-bit types, two for fp32) and reduces three fp32 sums (h*q*k*key, h^2,
 * key^2) across the block; pass 2 re-reads h and value (now in L1/L2) and writes
 * h + g * value rounded once to the I/O type. Masked tokens take the block-uniform
 * early path out = h (a bit copy), so a dead token's value can never leak in (not even
 * a NaN through 0 * value). `out` may alias `hidden` (an in-place update): each thread
 * reads h[j] before it writes out[j], and no other thread touches element j.
 */
#include "engramKernels.h"
#include "engramKernelsInternal.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace engram_trt
{
namespace kernels
{

constexpr int kGateMaxThreads = 256;

//! 8 consecutive weights as floats (bf16 from one 16-byte load, fp32 from two).
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

//! 8 consecutive floats rounded once (to nearest even) to the I/O type and stored.
__device__ __forceinline__ void store8(__nv_bfloat16* p, float const (&v)[8])
{
    uint4 packed;
    __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&packed);
#pragma unroll
    for (int i = 0; i < 4; ++i)
    {
        pairs[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
    }
    *reinterpret_cast<uint4*>(p) = packed;
}

__device__ __forceinline__ void store8(__half* p, float const (&v)[8])
{
    uint4 packed;
    __half2* pairs = reinterpret_cast<__half2*>(&packed);
#pragma unroll
    for (int i = 0; i < 4; ++i)
    {
        pairs[i] = __floats2half2_rn(v[2 * i], v[2 * i + 1]);
    }
    *reinterpret_cast<uint4*>(p) = packed;
}

__device__ __forceinline__ void store8(float* p, float const (&v)[8])
{
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
    *reinterpret_cast<float4*>(p + 4) = make_float4(v[4], v[5], v[6], v[7]);
}

__device__ __forceinline__ float warpSum(float v)
{
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1)
    {
        v += __shfl_xor_sync(0xFFFFFFFFu, v, offset);
    }
    return v;
}

template <typename IoT, typename WeightT>
__global__ void __launch_bounds__(kGateMaxThreads) engramGateKernel(IoT const* hidden, IoT const* __restrict__ kv,
    WeightT const* __restrict__ qWeight, WeightT const* __restrict__ kWeight, void const* __restrict__ mask,
    int32_t maskType, int32_t hcMult, int32_t hiddenSize, float eps, float clamp, IoT* out)
{
    int64_t const t = blockIdx.x;
    int32_t const c = blockIdx.y;
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

    float dot = 0.0F;
    float hh = 0.0F;
    float kk = 0.0F;
    for (int32_t j = threadIdx.x; j < vectors; j += blockDim.x)
    {
        float hv[8], keyv[8], qv[8], kwv[8];
        load8(h + 8 * j, hv);
        load8(key + 8 * j, keyv);
        load8(q + 8 * j, qv);
        load8(k + 8 * j, kwv);
#pragma unroll
        for (int i = 0; i < 8; ++i)
        {
            dot += hv[i] * qv[i] * kwv[i] * keyv[i];
            hh += hv[i] * hv[i];
            kk += keyv[i] * keyv[i];
        }
    }

    __shared__ float partial[3][kGateMaxThreads / 32];
    __shared__ float gateShared;
    dot = warpSum(dot);
    hh = warpSum(hh);
    kk = warpSum(kk);
    int const warp = threadIdx.x / 32;
    int const lane = threadIdx.x % 32;
    if (lane == 0)
    {
        partial[0][warp] = dot;
        partial[1][warp] = hh;
        partial[2][warp] = kk;
    }
    __syncthreads();
    if (threadIdx.x == 0)
    {
        int const warps = (blockDim.x + 31) / 32;
        float sums[3] = {0.0F, 0.0F, 0.0F};
        for (int w = 0; w < warps; ++w)
        {
            sums[0] += partial[0][w];
            sums[1] += partial[1][w];
            sums[2] += partial[2][w];
        }
        float const invD = 1.0F / static_cast<float>(hiddenSize);
        float const d = sums[0] * rsqrtf(sums[1] * invD + eps) * rsqrtf(sums[2] * invD + eps)
            * rsqrtf(static_cast<float>(hiddenSize));
        float const magnitude = sqrtf(fmaxf(fabsf(d), clamp));
        float const signedMagnitude = d > 0.0F ? magnitude : (d < 0.0F ? -magnitude : 0.0F); // numpy.sign(0) = 0
        gateShared = 1.0F / (1.0F + expf(-signedMagnitude));
    }
    __syncthreads();
    float const g = gateShared;

    for (int32_t j = threadIdx.x; j < vectors; j += blockDim.x)
    {
        float hv[8], vv[8];
        load8(h + 8 * j, hv);
        load8(value + 8 * j, vv);
#pragma unroll
        for (int i = 0; i < 8; ++i)
        {
            hv[i] += g * vv[i];
        }
        store8(o + 8 * j, hv);
    }
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
void launchGate(dim3 grid, int threads, cudaStream_t stream, void const* hidden, void const* kv, void const* qWeight,
    void const* kWeight, void const* mask, int32_t maskType, int32_t hcMult, int32_t hiddenSize, float eps,
    float clamp, void* out)
{
    engramGateKernel<IoT, WeightT><<<grid, threads, 0, stream>>>(static_cast<IoT const*>(hidden),
        static_cast<IoT const*>(kv), static_cast<WeightT const*>(qWeight), static_cast<WeightT const*>(kWeight), mask,
        maskType, hcMult, hiddenSize, eps, clamp, static_cast<IoT*>(out));
}

template <typename IoT>
void launchGateFor(int32_t weightType, dim3 grid, int threads, cudaStream_t stream, void const* hidden,
    void const* kv, void const* qWeight, void const* kWeight, void const* mask, int32_t maskType, int32_t hcMult,
    int32_t hiddenSize, float eps, float clamp, void* out)
{
    // Weights are bf16, fp32, or the I/O type (checked by the caller).
    if (weightType == ENGRAM_FLOAT_BF16)
    {
        launchGate<IoT, __nv_bfloat16>(
            grid, threads, stream, hidden, kv, qWeight, kWeight, mask, maskType, hcMult, hiddenSize, eps, clamp, out);
    }
    else if (weightType == ENGRAM_FLOAT_F32)
    {
        launchGate<IoT, float>(
            grid, threads, stream, hidden, kv, qWeight, kWeight, mask, maskType, hcMult, hiddenSize, eps, clamp, out);
    }
    else
    {
        launchGate<IoT, IoT>(
            grid, threads, stream, hidden, kv, qWeight, kWeight, mask, maskType, hcMult, hiddenSize, eps, clamp, out);
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
    if (numTokens > 0x7FFFFFFFLL || hcMult > 65535)
    {
        return fail(cudaErrorInvalidValue, "engram_gate: grid too large (%lld tokens, hc_mult %d)",
            static_cast<long long>(numTokens), hcMult);
    }
    void const* required[] = {hidden, kv, qWeight, kWeight, out};
    for (void const* p : required)
    {
        if (p == nullptr || !isAligned(p, 16))
        {
            return fail(cudaErrorInvalidValue, "engram_gate: hidden, kv, q_weight, k_weight and out must be "
                                               "16-byte aligned device pointers");
        }
    }
    if (maskType != ENGRAM_MASK_NONE && mask == nullptr)
    {
        return fail(cudaErrorInvalidValue, "engram_gate: mask_type says a mask but mask is NULL");
    }

    int const vectors = hiddenSize / 8;
    int threads = ((vectors + 31) / 32) * 32;
    threads = threads > kGateMaxThreads ? kGateMaxThreads : threads;
    dim3 const grid(static_cast<unsigned>(numTokens), static_cast<unsigned>(hcMult));
    resetLaunchError();
    if (ioType == ENGRAM_FLOAT_BF16)
    {
        launchGateFor<__nv_bfloat16>(weightType, grid, threads, stream, hidden, kv, qWeight, kWeight, mask, maskType,
            hcMult, hiddenSize, eps, clamp, out);
    }
    else if (ioType == ENGRAM_FLOAT_F16)
    {
        launchGateFor<__half>(weightType, grid, threads, stream, hidden, kv, qWeight, kWeight, mask, maskType, hcMult,
            hiddenSize, eps, clamp, out);
    }
    else
    {
        launchGateFor<float>(weightType, grid, threads, stream, hidden, kv, qWeight, kWeight, mask, maskType, hcMult,
            hiddenSize, eps, clamp, out);
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
