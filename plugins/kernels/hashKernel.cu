// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * N-gram hash of packed sequences: compressed token ids -> table row ids.
 *
 * Bit-identical to engram_trt.hashing.hash_batch_packed (engram-spec.md, "Hash of
 * position p"). One thread computes one row id, (token, layer, column): column
 * col = (s - 1) * H + h hashes the n-gram of order s + 1 ending at the token, so the
 * thread walks the shifts 0..s over the token and its predecessors (inside the packed
 * sequence, then in the sequence's lookback), XORs v * m[shift] into an int64 rolling
 * value and writes rolling mod prime + offset. Neighbouring threads write neighbouring
 * ids (coalesced) and read the same few ids (L1 hits).
 *
 * The layout constants are validated and laid out once, in an EngramHashLayout
 * (engram_hash_layout_create), then travel as one __grid_constant__ kernel parameter
 * that each block copies into shared memory (a warp's threads index different slots,
 * which constant memory would serialize). Layouts of up to kSmallSlots (layer, column)
 * slots use a 2.6 KiB parameter, under the 4 KiB limit of every CUDA version; larger
 * ones (up to ENGRAM_HASH_MAX_SLOTS) a 10 KiB one, which needs CUDA 12.1 or newer (the
 * toolkit and the driver): built only with such a toolkit. No device buffer: a layout
 * serves every device and stream, and an engine build needs no GPU.
 */
#include "engramKernelsInternal.h"
#include "hashKernels.h"
#include "seqIndex.cuh"

#include <climits>
#include <cstdint>
#include <new>

namespace engram_trt
{
namespace kernels
{

constexpr int32_t kSmallSlots = 128;      // num_layers * n_hash_cols of the small parameter
constexpr int32_t kSmallMultipliers = 64; // num_layers * max_ngram_size of the small parameter

template <int32_t kSlots, int32_t kMultipliers>
struct HashConstants
{
    int64_t primes[kSlots];            // [L, cols]: prime of (layer, column)
    int64_t offsets[kSlots];           // [L, cols]
    int64_t multipliers[kMultipliers]; // [L, N]
    int64_t padId;
    int32_t numLayers;
    int32_t maxNgram; // N
    int32_t numHeads; // H
    int32_t numCols;  // (N-1) * H
};

using SmallHashConstants = HashConstants<kSmallSlots, kSmallMultipliers>;
using LargeHashConstants = HashConstants<ENGRAM_HASH_MAX_SLOTS, ENGRAM_HASH_MAX_MULTIPLIERS>;
static_assert(sizeof(SmallHashConstants) + 64 <= 4096, "the small hash parameter must stay under 4 KiB");

#if CUDART_VERSION >= 12010
constexpr bool kLargeHashParameters = true; // kernel parameters up to 32,764 bytes
#else
constexpr bool kLargeHashParameters = false;
#endif

constexpr int kHashThreads = 256;

template <int32_t kSlots, int32_t kMultipliers>
__global__ void __launch_bounds__(kHashThreads) engramHashKernel(int32_t const* __restrict__ ids, int64_t numTokens,
    int32_t const* __restrict__ seqStarts, int64_t numSeqs, int32_t const* __restrict__ lookback, uint32_t total,
    int32_t* __restrict__ out, __grid_constant__ HashConstants<kSlots, kMultipliers> const p)
{
    __shared__ int64_t primes[kSlots];
    __shared__ int64_t offsets[kSlots];
    __shared__ int64_t multipliers[kMultipliers];
    int32_t const slots = p.numLayers * p.numCols;
    int32_t const mults = p.numLayers * p.maxNgram;
    for (int32_t i = threadIdx.x; i < slots; i += blockDim.x)
    {
        primes[i] = p.primes[i];
        offsets[i] = p.offsets[i];
    }
    for (int32_t i = threadIdx.x; i < mults; i += blockDim.x)
    {
        multipliers[i] = p.multipliers[i];
    }
    __syncthreads();

    uint32_t const index = blockIdx.x * blockDim.x + threadIdx.x;
    if (index >= total)
    {
        return;
    }
    // index = (t * L + layer) * cols + col; 32-bit divisions (total < 2^31).
    uint32_t const numCols = static_cast<uint32_t>(p.numCols);
    uint32_t const row = index / numCols;
    int32_t const col = static_cast<int32_t>(index - row * numCols);
    uint32_t const numLayers = static_cast<uint32_t>(p.numLayers);
    int64_t const t = row / numLayers;
    int32_t const layer = static_cast<int32_t>(row - static_cast<uint32_t>(t) * numLayers);
    int32_t const lastShift = col / p.numHeads + 1; // the n-gram's order is lastShift + 1

    // The sequence holding token t (seqIndex.cuh); outside every sequence: blocked.
    int64_t const found = sequenceOf(seqStarts, numSeqs, t);
    bool blocked = found < 0; // also set by a dead token below
    int64_t const seq = blocked ? 0 : found;
    int64_t const start = blocked ? 0 : seqStarts[found];
    int64_t const position = t - start;
    int32_t const lookbackLen = p.maxNgram - 1;
    int64_t const* layerMultipliers = multipliers + layer * p.maxNgram;

    int64_t rolling = 0;
    for (int32_t s = 0; s <= lastShift; ++s)
    {
        int64_t value = p.padId;
        if (!blocked)
        {
            int64_t const pos = position - s;
            int32_t id;
            if (pos >= 0)
            {
                // seq_starts is an engine input nobody validated: with a negative start the
                // token index t - s can fall before ids[0]. Such a position holds no token
                // (it blocks, as a dead one) and is never read.
                int64_t const tokenIndex = start + pos;
                id = tokenIndex >= 0 ? ids[tokenIndex] : -1;
            }
            else
            {
                // pos in [-(N-1), -1]; lookback is oldest first, so pos = -1 is its last entry.
                id = lookback != nullptr ? lookback[seq * lookbackLen + lookbackLen + pos] : -1;
            }
            if (id < 0)
            {
                blocked = true; // a dead or missing token blocks this and every longer n-gram
            }
            else
            {
                value = id;
            }
        }
        // Wrapping product, as NumPy's int64 (it cannot wrap for ids < compressed vocab:
        // the host checks multiplier * (vocab - 1) <= INT64_MAX).
        rolling ^= static_cast<int64_t>(static_cast<uint64_t>(value) * static_cast<uint64_t>(layerMultipliers[s]));
    }
    int32_t const slot = layer * p.numCols + col;
    int64_t const prime = primes[slot];
    int64_t r = rolling % prime;
    r += (r < 0) ? prime : 0; // floor modulo, as Python's %
    out[index] = static_cast<int32_t>(r + offsets[slot]);
}

} // namespace kernels
} // namespace engram_trt

//! A validated hash layout, laid out as the kernel parameter it is launched with.
struct EngramHashLayout
{
    bool small{true};
    engram_trt::kernels::SmallHashConstants smallConstants{};
    engram_trt::kernels::LargeHashConstants largeConstants{};
};

namespace engram_trt
{
namespace kernels
{

template <int32_t kSlots, int32_t kMultipliers>
void fillConstants(HashConstants<kSlots, kMultipliers>& c, int64_t const* primesHost, int64_t const* offsetsHost,
    int64_t const* multipliersHost, int32_t numLayers, int32_t maxNgram, int32_t numHeads, int64_t padId)
{
    int64_t const numCols = static_cast<int64_t>(maxNgram - 1) * numHeads;
    c.padId = padId;
    c.numLayers = numLayers;
    c.maxNgram = maxNgram;
    c.numHeads = numHeads;
    c.numCols = static_cast<int32_t>(numCols);
    for (int64_t i = 0; i < numLayers * static_cast<int64_t>(maxNgram); ++i)
    {
        c.multipliers[i] = multipliersHost[i];
    }
    for (int64_t i = 0; i < numLayers * numCols; ++i)
    {
        c.primes[i] = primesHost[i];
        c.offsets[i] = offsetsHost[i];
    }
}

//! Validates the layout and, when `layout` is non-null, fills it.
int buildHashLayout(char const* fn, int64_t const* primesHost, int64_t const* offsetsHost,
    int64_t const* multipliersHost, int32_t numLayers, int32_t maxNgram, int32_t numHeads, int64_t padId,
    int64_t compressedVocabSize, EngramHashLayout* layout)
{
    if (numLayers < 1 || maxNgram < 2 || maxNgram > ENGRAM_HASH_MAX_NGRAM || numHeads < 1)
    {
        return fail(cudaErrorInvalidValue,
            "%s: need num_layers >= 1, 2 <= max_ngram_size <= %d, num_heads >= 1 (got %d, %d, %d)", fn,
            ENGRAM_HASH_MAX_NGRAM, numLayers, maxNgram, numHeads);
    }
    int64_t const numCols = static_cast<int64_t>(maxNgram - 1) * numHeads;
    int64_t const slots = numLayers * numCols;
    int64_t const mults = static_cast<int64_t>(numLayers) * maxNgram;
    if (slots > ENGRAM_HASH_MAX_SLOTS || mults > ENGRAM_HASH_MAX_MULTIPLIERS)
    {
        return fail(cudaErrorInvalidValue,
            "%s: num_layers * n_hash_cols = %lld exceeds %d (or num_layers * N exceeds %d)", fn,
            static_cast<long long>(slots), ENGRAM_HASH_MAX_SLOTS, ENGRAM_HASH_MAX_MULTIPLIERS);
    }
    if (primesHost == nullptr || offsetsHost == nullptr || multipliersHost == nullptr)
    {
        return fail(cudaErrorInvalidValue, "%s: primes, offsets and multipliers are required", fn);
    }
    if (compressedVocabSize < 1 || padId < 0 || padId >= compressedVocabSize)
    {
        return fail(cudaErrorInvalidValue, "%s: pad_id %lld outside [0, compressed_vocab_size %lld)", fn,
            static_cast<long long>(padId), static_cast<long long>(compressedVocabSize));
    }
    int64_t const maxId = compressedVocabSize - 1;
    for (int64_t i = 0; i < mults; ++i)
    {
        int64_t const m = multipliersHost[i];
        if (m <= 0 || (maxId > 0 && m > INT64_MAX / maxId))
        {
            return fail(cudaErrorInvalidValue,
                "%s: multiplier[%lld] = %lld is not in (0, INT64_MAX / (compressed_vocab_size - 1)]", fn,
                static_cast<long long>(i), static_cast<long long>(m));
        }
    }
    for (int64_t i = 0; i < slots; ++i)
    {
        int64_t const prime = primesHost[i];
        int64_t const offset = offsetsHost[i];
        if (prime < 2 || offset < 0 || offset > INT32_MAX - (prime - 1))
        {
            return fail(cudaErrorInvalidValue, "%s: slot %lld has prime %lld, offset %lld: row ids must fit int32", fn,
                static_cast<long long>(i), static_cast<long long>(prime), static_cast<long long>(offset));
        }
    }
    bool const small = slots <= kSmallSlots && mults <= kSmallMultipliers;
    if (!small && !kLargeHashParameters)
    {
        return fail(cudaErrorInvalidValue,
            "%s: a layout of %lld (layer, column) slots or %lld multipliers needs a library built with CUDA 12.1 or "
            "newer (kernel parameters over 4 KiB); this one holds at most %d slots and %d multipliers",
            fn, static_cast<long long>(slots), static_cast<long long>(mults), kSmallSlots, kSmallMultipliers);
    }
    if (layout != nullptr)
    {
        layout->small = small;
        if (small)
        {
            fillConstants(
                layout->smallConstants, primesHost, offsetsHost, multipliersHost, numLayers, maxNgram, numHeads, padId);
        }
        else
        {
            fillConstants(
                layout->largeConstants, primesHost, offsetsHost, multipliersHost, numLayers, maxNgram, numHeads, padId);
        }
    }
    return 0;
}

int launchHash(char const* fn, EngramHashLayout const& layout, int32_t const* ids, int64_t numTokens,
    int32_t const* seqStarts, int64_t numSeqs, int32_t const* lookback, int32_t* out, cudaStream_t stream)
{
    if (numTokens < 0 || numSeqs < 0)
    {
        return fail(cudaErrorInvalidValue, "%s: negative num_tokens or num_seqs", fn);
    }
    if (numTokens == 0)
    {
        return 0;
    }
    if (ids == nullptr || out == nullptr || (numSeqs > 0 && seqStarts == nullptr))
    {
        return fail(cudaErrorInvalidValue, "%s: ids, seq_starts and out are required", fn);
    }
    int64_t const perToken = layout.small
        ? static_cast<int64_t>(layout.smallConstants.numLayers) * layout.smallConstants.numCols
        : static_cast<int64_t>(layout.largeConstants.numLayers) * layout.largeConstants.numCols;
    if (numTokens > INT32_MAX / perToken)
    {
        return fail(cudaErrorInvalidValue, "%s: %lld tokens x %lld ids per token exceeds 2^31 - 1 row ids", fn,
            static_cast<long long>(numTokens), static_cast<long long>(perToken));
    }
    uint32_t const total = static_cast<uint32_t>(numTokens * perToken);
    unsigned const blocks = (total + kHashThreads - 1) / kHashThreads;
    resetLaunchError();
    if (layout.small)
    {
        engramHashKernel<kSmallSlots, kSmallMultipliers><<<blocks, kHashThreads, 0, stream>>>(
            ids, numTokens, seqStarts, numSeqs, lookback, total, out, layout.smallConstants);
    }
    else if constexpr (kLargeHashParameters)
    {
        engramHashKernel<ENGRAM_HASH_MAX_SLOTS, ENGRAM_HASH_MAX_MULTIPLIERS><<<blocks, kHashThreads, 0, stream>>>(
            ids, numTokens, seqStarts, numSeqs, lookback, total, out, layout.largeConstants);
    }
    return checkLaunch(fn);
}

int preloadHashKernels()
{
    cudaFuncAttributes attributes{};
    cudaError_t status = cudaFuncGetAttributes(&attributes, engramHashKernel<kSmallSlots, kSmallMultipliers>);
    if (status == cudaSuccess && kLargeHashParameters)
    {
        status
            = cudaFuncGetAttributes(&attributes, engramHashKernel<ENGRAM_HASH_MAX_SLOTS, ENGRAM_HASH_MAX_MULTIPLIERS>);
    }
    if (status != cudaSuccess)
    {
        return failCuda(status, "loading the hash kernel failed: %s", cudaGetErrorString(status));
    }
    return 0;
}

} // namespace kernels
} // namespace engram_trt

using namespace engram_trt::kernels;

extern "C" ENGRAM_API int engram_hash_check_layout(int64_t const* primesHost, int64_t const* offsetsHost,
    int64_t const* multipliersHost, int32_t numLayers, int32_t maxNgram, int32_t numHeads, int64_t padId,
    int64_t compressedVocabSize)
{
    clearError();
    return buildHashLayout("engram_hash", primesHost, offsetsHost, multipliersHost, numLayers, maxNgram, numHeads,
        padId, compressedVocabSize, nullptr);
}

extern "C" ENGRAM_API int engram_hash_layout_create(int64_t const* primesHost, int64_t const* offsetsHost,
    int64_t const* multipliersHost, int32_t numLayers, int32_t maxNgram, int32_t numHeads, int64_t padId,
    int64_t compressedVocabSize, EngramHashLayout** layout)
{
    clearError();
    if (layout == nullptr)
    {
        return fail(cudaErrorInvalidValue, "engram_hash_layout_create: layout is NULL");
    }
    *layout = nullptr;
    if (int const status = buildHashLayout("engram_hash_layout_create", primesHost, offsetsHost, multipliersHost,
            numLayers, maxNgram, numHeads, padId, compressedVocabSize, nullptr))
    {
        return status;
    }
    auto* created = new (std::nothrow) EngramHashLayout();
    if (created == nullptr)
    {
        return fail(cudaErrorMemoryAllocation, "engram_hash_layout_create: out of host memory");
    }
    buildHashLayout("engram_hash_layout_create", primesHost, offsetsHost, multipliersHost, numLayers, maxNgram,
        numHeads, padId, compressedVocabSize, created);
    *layout = created;
    return 0;
}

extern "C" ENGRAM_API int engram_hash_layout_destroy(EngramHashLayout* layout)
{
    clearError();
    delete layout;
    return 0;
}

extern "C" ENGRAM_API int engram_hash_prepared(EngramHashLayout const* layout, int32_t const* ids, int64_t numTokens,
    int32_t const* seqStarts, int64_t numSeqs, int32_t const* lookback, int32_t* out, cudaStream_t stream)
{
    clearError();
    if (layout == nullptr)
    {
        return fail(cudaErrorInvalidValue, "engram_hash_prepared: layout is NULL");
    }
    return launchHash("engram_hash_prepared", *layout, ids, numTokens, seqStarts, numSeqs, lookback, out, stream);
}

extern "C" ENGRAM_API int engram_hash(int32_t const* ids, int64_t numTokens, int32_t const* seqStarts, int64_t numSeqs,
    int32_t const* lookback, int64_t const* primesHost, int64_t const* offsetsHost, int64_t const* multipliersHost,
    int32_t numLayers, int32_t maxNgram, int32_t numHeads, int64_t padId, int64_t compressedVocabSize, int32_t* out,
    cudaStream_t stream)
{
    clearError();
    // The one-shot form: validates and lays out the constants at every call (on the
    // stack); engram_hash_layout_create + engram_hash_prepared do that once.
    EngramHashLayout layout;
    if (int const status = buildHashLayout("engram_hash", primesHost, offsetsHost, multipliersHost, numLayers, maxNgram,
            numHeads, padId, compressedVocabSize, &layout))
    {
        return status;
    }
    return launchHash("engram_hash", layout, ids, numTokens, seqStarts, numSeqs, lookback, out, stream);
}
