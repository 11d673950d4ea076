// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * The element-wise glue of a DeepSeek-V4 attention layer around its projections, one
 * launch for up to ENGRAM_NORM_ROPE_MAX_JOBS row sets (engramKernels.h states the
 * contract; python/engram_trt/native/decode.py binds it): the weighted RMSNorm of q_a and
 * of kv (float32 weight; a weight per head too: Qwen4Exp's grouped offset norms, the
 * weight 1 + w made once), the per-head unweighted RMSNorm of q, the interleaved partial
 * RoPE of q / kv / the indexer's queries, and the inverse RoPE of the attention output.
 * The PyTorch reference (models/deepseek_v4/compressors.py: RMSNorm, unweighted_rms_norm,
 * apply_rope) spends 7 to 15 element-wise kernels on each of these.
 *
 * Rounding: every product and sum the reference makes as a separate PyTorch op is made
 * here with the round-to-nearest intrinsics (__fmul_rn, __fadd_rn: never contracted into
 * an FMA), and values are rounded to the I/O type exactly where the reference casts. So
 * the two differ only by the order of the sum of squares (and rsqrtf is the function
 * PyTorch's CUDA rsqrt calls).
 *
 * Layout: one warp per row (a row = one head of one token), 4 rows a block, blockIdx.y =
 * the job. Rows are tiny (a few hundred elements): the kernel is latency, not bandwidth.
 *
 * The row in registers (rows of an even dim <= 64 * P, P the launch's pairs a lane): lane
 * l holds the pairs (2q, 2q + 1), q = l + 32 i, i < P; every load of the row (x, the norm
 * weight, the pair's cos / sin) is issued at once, unrolled, before the first sum, so a
 * row costs one memory round trip (the general form below walked the row in a loop whose
 * every iteration waited for its load: a 768-wide q_a row took 24 round trips, ~10 us on
 * the H100). The sum of squares runs pair by pair in a lane, then a warp butterfly;
 * each lane writes only the pairs it read, so out may be x itself.
 * The general form (odd dims, wider rows, ENGRAM_TRT_NORM_ROPE_REGS=0): pass 1 sums the
 * row's squares (lane-strided element loads, a warp butterfly); pass 2 writes the leading
 * channels, then the rotated pairs, each lane reading only the elements it writes.
 */
#include "decodeKernels.h"
#include "dependentLaunch.cuh"
#include "engramKernelsCore.h"
#include "engramKernelsInternal.h"
#include "vecLoad.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cmath>
#include <cstdint>

namespace engram_trt
{
namespace kernels
{

namespace
{

constexpr int kNormRopeThreads = 128;
constexpr int kNormRopeRowsPerBlock = kNormRopeThreads / 32;
constexpr int kNormRopeMaxPairs = 32; // rows of up to 2048 elements in registers

struct NormRopeJobs
{
    EngramNormRopeJob job[ENGRAM_NORM_ROPE_MAX_JOBS];
};

//! The row's value at channel c after the norm, rounded to the I/O type (as the reference's
//! norm output is); `r` the reciprocal RMS (its I/O-rounded form for the unweighted norm).
template <typename T>
__device__ __forceinline__ float normed(T const* x, int32_t c, EngramNormRopeJob const& j, float const* weight, float r)
{
    float const v = toFloat(x[c]);
    if (j.norm == ENGRAM_NORM_WEIGHTED)
    {
        return roundTo<T>(__fmul_rn(weight[c], __fmul_rn(v, r))); // weight * (x * rsqrt(...)), float32
    }
    if (j.norm == ENGRAM_NORM_UNWEIGHTED)
    {
        return roundTo<T>(__fmul_rn(v, r)); // x * rsqrt(...).to(x.dtype): an I/O-type product
    }
    return v;
}

//! The reciprocal RMS of a row from its sum of squares (the I/O-rounded one for the
//! unweighted norm), 1 without a norm.
template <typename T>
__device__ __forceinline__ float reciprocalRms(EngramNormRopeJob const& j, float squares)
{
    if (j.norm == ENGRAM_NORM_NONE)
    {
        return 1.0F;
    }
    // mean (sum / dim) + eps, then rsqrt: three float32 ops of the reference
    float const r = rsqrtf(__fadd_rn(__fdiv_rn(squares, static_cast<float>(j.dim)), j.eps));
    return j.norm == ENGRAM_NORM_UNWEIGHTED ? roundTo<T>(r) : r;
}

//! A normed value (normed() on a value already in a register; w the channel's weight).
template <typename T>
__device__ __forceinline__ float normedValue(float v, EngramNormRopeJob const& j, float w, float r)
{
    if (j.norm == ENGRAM_NORM_WEIGHTED)
    {
        return roundTo<T>(__fmul_rn(w, __fmul_rn(v, r)));
    }
    if (j.norm == ENGRAM_NORM_UNWEIGHTED)
    {
        return roundTo<T>(__fmul_rn(v, r));
    }
    return v;
}

//! The row in registers (file comment): dim even and <= 64 * P.
template <typename T, int P>
__device__ __forceinline__ void normRopeRowInRegisters(
    EngramNormRopeJob const& j, T const* x, T* out, float const* weight, int64_t token, int lane)
{
    int32_t const pairs = j.dim / 2;
    int32_t const leadPairs = pairs - j.rope_pairs;
    float const* const cosRow = j.rope_pairs > 0 ? j.cos + token * j.cos_stride : nullptr;
    float const* const sinRow = j.rope_pairs > 0 ? j.sin + token * j.cos_stride : nullptr;
    float even[P];
    float odd[P];
    float w0[P];
    float w1[P];
    float c[P];
    float s[P];
#pragma unroll
    for (int i = 0; i < P; ++i)
    {
        int32_t const q = lane + 32 * i;
        bool const inside = q < pairs;
        even[i] = inside ? toFloat(x[2 * q]) : 0.0F;
        odd[i] = inside ? toFloat(x[2 * q + 1]) : 0.0F;
        bool const weighted = inside && weight != nullptr;
        w0[i] = weighted ? weight[2 * q] : 0.0F;
        w1[i] = weighted ? weight[2 * q + 1] : 0.0F;
        bool const rotated = inside && q >= leadPairs;
        c[i] = rotated ? cosRow[q - leadPairs] : 0.0F;
        s[i] = rotated ? sinRow[q - leadPairs] : 0.0F;
    }
    float squares = 0.0F;
    if (j.norm != ENGRAM_NORM_NONE)
    {
#pragma unroll
        for (int i = 0; i < P; ++i)
        {
            squares = __fadd_rn(squares, __fmul_rn(even[i], even[i]));
            squares = __fadd_rn(squares, __fmul_rn(odd[i], odd[i]));
        }
        squares = warpSum(squares);
    }
    float const r = reciprocalRms<T>(j, squares);
#pragma unroll
    for (int i = 0; i < P; ++i)
    {
        int32_t const q = lane + 32 * i;
        if (q < pairs)
        {
            float const y0 = normedValue<T>(even[i], j, w0[i], r);
            float const y1 = normedValue<T>(odd[i], j, w1[i], r);
            if (q < leadPairs)
            {
                out[2 * q] = fromFloat<T>(y0);
                out[2 * q + 1] = fromFloat<T>(y1);
            }
            else
            {
                float const cr = roundTo<T>(c[i]); // cos.to(x.dtype), then widened
                float const sr = roundTo<T>(s[i]) * static_cast<float>(j.rope_sign);
                out[2 * q] = fromFloat<T>(__fsub_rn(__fmul_rn(y0, cr), __fmul_rn(y1, sr)));
                out[2 * q + 1] = fromFloat<T>(__fadd_rn(__fmul_rn(y1, cr), __fmul_rn(y0, sr)));
            }
        }
    }
}

//! P: pairs a lane holds in registers (0: the general form for every job).
template <typename T, int P>
__global__ void __launch_bounds__(kNormRopeThreads) normRopeKernel(NormRopeJobs jobs)
{
    waitForPrimary(); // x comes from the kernel before (dependentLaunch.cuh)
    allowDependents();
    EngramNormRopeJob const& j = jobs.job[blockIdx.y];
    int64_t const row = static_cast<int64_t>(blockIdx.x) * kNormRopeRowsPerBlock + threadIdx.x / 32;
    if (row >= j.rows)
    {
        return;
    }
    int const lane = threadIdx.x % 32;
    int64_t const token = row / j.heads;
    int64_t const head = row - token * j.heads;
    T const* const x = static_cast<T const*>(j.x) + token * j.x_stride + head * j.dim;
    T* const out = static_cast<T*>(j.out) + token * j.out_stride + head * j.dim;
    float const* const weight = j.weight == nullptr ? nullptr : j.weight + head * j.weight_stride;
    if (P > 0 && j.dim % 2 == 0 && j.dim <= 64 * P)
    {
        normRopeRowInRegisters<T, (P > 0 ? P : 1)>(j, x, out, weight, token, lane);
        return;
    }

    float r = 1.0F;
    if (j.norm != ENGRAM_NORM_NONE)
    {
        float squares = 0.0F;
        for (int32_t c = lane; c < j.dim; c += 32)
        {
            float const v = toFloat(x[c]);
            squares = __fadd_rn(squares, __fmul_rn(v, v));
        }
        squares = warpSum(squares);
        // mean (sum / dim) + eps, then rsqrt: three float32 ops of the reference
        r = rsqrtf(__fadd_rn(__fdiv_rn(squares, static_cast<float>(j.dim)), j.eps));
        if (j.norm == ENGRAM_NORM_UNWEIGHTED)
        {
            r = roundTo<T>(r);
        }
    }
    // every lane has read the whole row for its sum of squares before any lane writes
    __syncwarp();
    int32_t const lead = j.dim - 2 * j.rope_pairs;
    for (int32_t c = lane; c < lead; c += 32)
    {
        out[c] = fromFloat<T>(normed(x, c, j, weight, r));
    }
    if (j.rope_pairs > 0)
    {
        float const* const cosRow = j.cos + token * j.cos_stride;
        float const* const sinRow = j.sin + token * j.cos_stride;
        for (int32_t p = lane; p < j.rope_pairs; p += 32)
        {
            float const even = normed(x, lead + 2 * p, j, weight, r);
            float const odd = normed(x, lead + 2 * p + 1, j, weight, r);
            float const c = roundTo<T>(cosRow[p]); // cos.to(x.dtype), then widened
            float const s = roundTo<T>(sinRow[p]) * static_cast<float>(j.rope_sign);
            out[lead + 2 * p] = fromFloat<T>(__fsub_rn(__fmul_rn(even, c), __fmul_rn(odd, s)));
            out[lead + 2 * p + 1] = fromFloat<T>(__fadd_rn(__fmul_rn(odd, c), __fmul_rn(even, s)));
        }
    }
}

int64_t elementBytes(int32_t ioType)
{
    return ioType == ENGRAM_FLOAT_F32 ? 4 : 2;
}

//! Bytes a job's rows span from their first element: (tokens - 1) * stride + heads * dim.
int64_t spanBytes(int64_t rows, int32_t heads, int32_t dim, int64_t stride, int32_t ioType)
{
    int64_t const tokens = (rows + heads - 1) / heads;
    return ((tokens - 1) * stride + static_cast<int64_t>(heads) * dim) * elementBytes(ioType);
}

int checkJob(EngramNormRopeJob const& j, int32_t index, int32_t ioType)
{
    char const* const fn = "engram_norm_rope";
    if (j.rows < 0 || j.rows > INT32_MAX)
    {
        return fail(
            cudaErrorInvalidValue, "%s: job %d: rows must be in [0, 2^31 - 1] (got %lld)", fn, index, ll(j.rows));
    }
    if (j.dim < 1 || j.heads < 1 || j.rope_pairs < 0 || 2 * static_cast<int64_t>(j.rope_pairs) > j.dim)
    {
        return fail(cudaErrorInvalidValue,
            "%s: job %d: need dim >= 1, heads >= 1 and 0 <= 2 * rope_pairs <= dim (got dim %d, heads %d, "
            "rope_pairs %d)",
            fn, index, j.dim, j.heads, j.rope_pairs);
    }
    if (j.norm != ENGRAM_NORM_NONE && j.norm != ENGRAM_NORM_WEIGHTED && j.norm != ENGRAM_NORM_UNWEIGHTED)
    {
        return fail(cudaErrorInvalidValue, "%s: job %d: norm %d is not NONE (0), WEIGHTED (1) or UNWEIGHTED (2)", fn,
            index, j.norm);
    }
    if (j.norm != ENGRAM_NORM_NONE && (!std::isfinite(j.eps) || j.eps < 0.0F))
    {
        return fail(cudaErrorInvalidValue, "%s: job %d: eps must be finite and >= 0 (got %g)", fn, index,
            static_cast<double>(j.eps));
    }
    if (j.rows == 0)
    {
        return 0;
    }
    int64_t const rowWidth = static_cast<int64_t>(j.heads) * j.dim;
    if (j.x_stride < rowWidth || j.out_stride < rowWidth)
    {
        return fail(cudaErrorInvalidValue,
            "%s: job %d: x_stride and out_stride must be at least heads * dim = %lld elements (got %lld, %lld)", fn,
            index, ll(rowWidth), ll(j.x_stride), ll(j.out_stride));
    }
    if (j.x == nullptr || j.out == nullptr || !isAligned(j.x, elementBytes(ioType))
        || !isAligned(j.out, elementBytes(ioType)))
    {
        return fail(
            cudaErrorInvalidValue, "%s: job %d: x and out must be device pointers aligned to an element", fn, index);
    }
    if (j.weight_stride < 0)
    {
        return fail(
            cudaErrorInvalidValue, "%s: job %d: weight_stride must be >= 0 (got %lld)", fn, index, ll(j.weight_stride));
    }
    if ((j.norm == ENGRAM_NORM_WEIGHTED) != (j.weight != nullptr))
    {
        return fail(
            cudaErrorInvalidValue, "%s: job %d: weight must be given for the WEIGHTED norm and only then", fn, index);
    }
    if (j.rope_pairs > 0 && (j.cos == nullptr || j.sin == nullptr || j.cos_stride < j.rope_pairs))
    {
        return fail(cudaErrorInvalidValue,
            "%s: job %d: a RoPE job needs cos and sin [tokens, cos_stride >= rope_pairs] (got cos_stride %lld)", fn,
            index, ll(j.cos_stride));
    }
    if (j.rope_pairs > 0 && j.rope_sign != 1 && j.rope_sign != -1)
    {
        return fail(cudaErrorInvalidValue, "%s: job %d: rope_sign must be 1 or -1 (got %d)", fn, index, j.rope_sign);
    }
    bool const inPlace = j.x == j.out && j.x_stride == j.out_stride;
    if (!inPlace
        && overlaps(j.out, spanBytes(j.rows, j.heads, j.dim, j.out_stride, ioType), j.x,
            spanBytes(j.rows, j.heads, j.dim, j.x_stride, ioType)))
    {
        return fail(
            cudaErrorInvalidValue, "%s: job %d: out must be x itself (same stride) or apart from it", fn, index);
    }
    return 0;
}

//! The pairs a lane holds for the launch's widest even row of up to 64 * kNormRopeMaxPairs
//! elements (a power of two, at least 2), 0 when no job's rows fit in registers.
int pairsPerLane(NormRopeJobs const& jobs, int32_t numJobs)
{
    int32_t widest = 0;
    for (int32_t i = 0; i < numJobs; ++i)
    {
        int32_t const dim = jobs.job[i].dim;
        if (jobs.job[i].rows > 0 && dim % 2 == 0 && dim <= 64 * kNormRopeMaxPairs && dim > widest)
        {
            widest = dim;
        }
    }
    if (widest == 0)
    {
        return 0;
    }
    int pairs = 2;
    while (64 * pairs < widest)
    {
        pairs *= 2;
    }
    return pairs;
}

template <typename T>
void launchNormRope(int pairs, dim3 grid, cudaStream_t stream, NormRopeJobs const& packed)
{
    dim3 const block(kNormRopeThreads);
    switch (pairs)
    {
    case 2: launchDependent(normRopeKernel<T, 2>, grid, block, 0, stream, packed); break;
    case 4: launchDependent(normRopeKernel<T, 4>, grid, block, 0, stream, packed); break;
    case 8: launchDependent(normRopeKernel<T, 8>, grid, block, 0, stream, packed); break;
    case 16: launchDependent(normRopeKernel<T, 16>, grid, block, 0, stream, packed); break;
    case kNormRopeMaxPairs:
        launchDependent(normRopeKernel<T, kNormRopeMaxPairs>, grid, block, 0, stream, packed);
        break;
    default: launchDependent(normRopeKernel<T, 0>, grid, block, 0, stream, packed); break;
    }
}

} // namespace

} // namespace kernels
} // namespace engram_trt

using namespace engram_trt::kernels;

extern "C" ENGRAM_API int engram_norm_rope(
    EngramNormRopeJob const* jobs, int32_t numJobs, int32_t ioType, cudaStream_t stream)
{
    clearError();
    if (jobs == nullptr || numJobs < 1 || numJobs > ENGRAM_NORM_ROPE_MAX_JOBS)
    {
        return fail(cudaErrorInvalidValue, "engram_norm_rope: need 1 <= num_jobs <= %d jobs (got %d)",
            ENGRAM_NORM_ROPE_MAX_JOBS, numJobs);
    }
    if (ioType != ENGRAM_FLOAT_BF16 && ioType != ENGRAM_FLOAT_F32 && ioType != ENGRAM_FLOAT_F16)
    {
        return fail(
            cudaErrorInvalidValue, "engram_norm_rope: io_type %d is not bf16 (0), fp32 (1) or fp16 (2)", ioType);
    }
    NormRopeJobs packed{};
    int64_t maxRows = 0;
    for (int32_t i = 0; i < numJobs; ++i)
    {
        int const status = checkJob(jobs[i], i, ioType);
        if (status != 0)
        {
            return status;
        }
        packed.job[i] = jobs[i];
        maxRows = jobs[i].rows > maxRows ? jobs[i].rows : maxRows;
    }
    if (maxRows == 0)
    {
        return 0;
    }
    dim3 const grid(static_cast<unsigned>((maxRows + kNormRopeRowsPerBlock - 1) / kNormRopeRowsPerBlock),
        static_cast<unsigned>(numJobs));
    int const pairs = envSwitch("ENGRAM_TRT_NORM_ROPE_REGS", true) ? pairsPerLane(packed, numJobs) : 0;
    resetLaunchError();
    switch (ioType)
    {
    case ENGRAM_FLOAT_BF16: launchNormRope<__nv_bfloat16>(pairs, grid, stream, packed); break;
    case ENGRAM_FLOAT_F16: launchNormRope<__half>(pairs, grid, stream, packed); break;
    default: launchNormRope<float>(pairs, grid, stream, packed); break;
    }
    return checkLaunch("engram_norm_rope");
}
