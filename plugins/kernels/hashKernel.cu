/*
 * N-gram hash of packed sequences: compressed token ids -> table row ids.
 *
 * Bit-identical to engram_trt.hashing.hash_batch_packed (engram-spec.md, "Hash of
 * position p"). One thread computes one (token, layer) pair: it walks the shifts
 * s = 0..N-1 over the token and its predecessors (inside the packed sequence, then in
 * the sequence's lookback), XORs v * m[s] into an int64 rolling value and, for every
 * order s >= 1 and head h, writes rolling mod prime + offset. The layout constants
 * (a few KiB) travel as one __grid_constant__ kernel parameter, so the kernel needs no
 * device buffer of its own and the plugin none at build time.
 */
#include "engramKernels.h"
#include "engramKernelsInternal.h"

#include <climits>
#include <cstdint>

namespace engram_trt
{
namespace kernels
{

struct HashParams
{
    int64_t primes[ENGRAM_HASH_MAX_SLOTS];  // [L, cols]: prime of (layer, column)
    int64_t offsets[ENGRAM_HASH_MAX_SLOTS]; // [L, cols]
    int64_t multipliers[ENGRAM_HASH_MAX_MULTIPLIERS]; // [L, N]
    int64_t padId;
    int32_t numLayers;
    int32_t maxNgram; // N
    int32_t numHeads; // H
    int32_t numCols;  // (N-1) * H
};

__global__ void engramHashKernel(int32_t const* __restrict__ ids, int64_t numTokens,
    int32_t const* __restrict__ seqStarts, int64_t numSeqs, int32_t const* __restrict__ lookback,
    int32_t* __restrict__ out, __grid_constant__ HashParams const p)
{
    int64_t const index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (index >= numTokens * p.numLayers)
    {
        return;
    }
    int64_t const t = index / p.numLayers;
    int32_t const layer = static_cast<int32_t>(index - t * p.numLayers);

    // The sequence holding token t: seqStarts[seq] <= t < seqStarts[seq + 1]. Empty
    // sequences (equal starts) are skipped because the search keeps the last such start.
    bool blocked = true;
    int64_t seq = 0;
    int64_t start = 0;
    if (numSeqs > 0 && seqStarts[0] <= t && t < seqStarts[numSeqs])
    {
        int64_t lo = 0;
        int64_t hi = numSeqs;
        while (hi - lo > 1)
        {
            int64_t const mid = (lo + hi) / 2;
            if (seqStarts[mid] <= t)
            {
                lo = mid;
            }
            else
            {
                hi = mid;
            }
        }
        seq = lo;
        start = seqStarts[lo];
        blocked = false;
    }
    int64_t const position = t - start;
    int32_t const lookbackLen = p.maxNgram - 1;

    int64_t const* multipliers = p.multipliers + layer * p.maxNgram;
    int64_t const* primes = p.primes + layer * p.numCols;
    int64_t const* offsets = p.offsets + layer * p.numCols;
    int32_t* outRow = out + (t * p.numLayers + layer) * p.numCols;

    int64_t rolling = 0;
    for (int32_t s = 0; s < p.maxNgram; ++s)
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
                int64_t const index = start + pos;
                id = index >= 0 ? ids[index] : -1;
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
        rolling ^= static_cast<int64_t>(static_cast<uint64_t>(value) * static_cast<uint64_t>(multipliers[s]));
        if (s >= 1)
        {
            for (int32_t h = 0; h < p.numHeads; ++h)
            {
                int32_t const col = (s - 1) * p.numHeads + h;
                int64_t const prime = primes[col];
                int64_t r = rolling % prime;
                r += (r < 0) ? prime : 0; // floor modulo, as Python's %
                outRow[col] = static_cast<int32_t>(r + offsets[col]);
            }
        }
    }
}

} // namespace kernels
} // namespace engram_trt

namespace engram_trt
{
namespace kernels
{

//! Validates the layout and fills `params` (when non-null).
int buildHashParams(int64_t const* primesHost, int64_t const* offsetsHost, int64_t const* multipliersHost,
    int32_t numLayers, int32_t maxNgram, int32_t numHeads, int64_t padId, int64_t compressedVocabSize,
    HashParams* params)
{
    if (numLayers < 1 || maxNgram < 2 || maxNgram > ENGRAM_HASH_MAX_NGRAM || numHeads < 1)
    {
        return fail(cudaErrorInvalidValue,
            "engram_hash: need num_layers >= 1, 2 <= max_ngram_size <= %d, num_heads >= 1 (got %d, %d, %d)",
            ENGRAM_HASH_MAX_NGRAM, numLayers, maxNgram, numHeads);
    }
    int64_t const numCols = static_cast<int64_t>(maxNgram - 1) * numHeads;
    if (numLayers * numCols > ENGRAM_HASH_MAX_SLOTS
        || static_cast<int64_t>(numLayers) * maxNgram > ENGRAM_HASH_MAX_MULTIPLIERS)
    {
        return fail(cudaErrorInvalidValue,
            "engram_hash: num_layers * n_hash_cols = %lld exceeds %d (or num_layers * N exceeds %d)",
            static_cast<long long>(numLayers * numCols), ENGRAM_HASH_MAX_SLOTS, ENGRAM_HASH_MAX_MULTIPLIERS);
    }
    if (primesHost == nullptr || offsetsHost == nullptr || multipliersHost == nullptr)
    {
        return fail(cudaErrorInvalidValue, "engram_hash: primes, offsets and multipliers are required");
    }
    if (compressedVocabSize < 1 || padId < 0 || padId >= compressedVocabSize)
    {
        return fail(cudaErrorInvalidValue, "engram_hash: pad_id %lld outside [0, compressed_vocab_size %lld)",
            static_cast<long long>(padId), static_cast<long long>(compressedVocabSize));
    }
    int64_t const maxId = compressedVocabSize - 1;
    for (int64_t i = 0; i < numLayers * static_cast<int64_t>(maxNgram); ++i)
    {
        int64_t const m = multipliersHost[i];
        if (m <= 0 || (maxId > 0 && m > INT64_MAX / maxId))
        {
            return fail(cudaErrorInvalidValue,
                "engram_hash: multiplier[%lld] = %lld is not in (0, INT64_MAX / (compressed_vocab_size - 1)]",
                static_cast<long long>(i), static_cast<long long>(m));
        }
    }
    for (int64_t i = 0; i < numLayers * numCols; ++i)
    {
        int64_t const prime = primesHost[i];
        int64_t const offset = offsetsHost[i];
        if (prime < 2 || offset < 0 || offset > INT32_MAX - (prime - 1))
        {
            return fail(cudaErrorInvalidValue,
                "engram_hash: slot %lld has prime %lld, offset %lld: row ids must fit int32",
                static_cast<long long>(i), static_cast<long long>(prime), static_cast<long long>(offset));
        }
    }
    if (params != nullptr)
    {
        *params = HashParams{};
        params->padId = padId;
        params->numLayers = numLayers;
        params->maxNgram = maxNgram;
        params->numHeads = numHeads;
        params->numCols = static_cast<int32_t>(numCols);
        for (int64_t i = 0; i < numLayers * static_cast<int64_t>(maxNgram); ++i)
        {
            params->multipliers[i] = multipliersHost[i];
        }
        for (int64_t i = 0; i < numLayers * numCols; ++i)
        {
            params->primes[i] = primesHost[i];
            params->offsets[i] = offsetsHost[i];
        }
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
    return buildHashParams(primesHost, offsetsHost, multipliersHost, numLayers, maxNgram, numHeads, padId,
        compressedVocabSize, nullptr);
}

extern "C" ENGRAM_API int engram_hash(int32_t const* ids, int64_t numTokens, int32_t const* seqStarts, int64_t numSeqs,
    int32_t const* lookback, int64_t const* primesHost, int64_t const* offsetsHost, int64_t const* multipliersHost,
    int32_t numLayers, int32_t maxNgram, int32_t numHeads, int64_t padId, int64_t compressedVocabSize, int32_t* out,
    cudaStream_t stream)
{
    clearError();
    HashParams params;
    if (int const status = buildHashParams(primesHost, offsetsHost, multipliersHost, numLayers, maxNgram, numHeads,
            padId, compressedVocabSize, &params))
    {
        return status;
    }
    if (numTokens < 0 || numSeqs < 0)
    {
        return fail(cudaErrorInvalidValue, "engram_hash: negative num_tokens or num_seqs");
    }
    if (numTokens == 0)
    {
        return 0;
    }
    if (ids == nullptr || out == nullptr || (numSeqs > 0 && seqStarts == nullptr))
    {
        return fail(cudaErrorInvalidValue, "engram_hash: ids, seq_starts and out are required");
    }

    constexpr int kThreads = 128;
    int64_t const work = numTokens * numLayers;
    int64_t const blocks = (work + kThreads - 1) / kThreads;
    if (blocks > INT32_MAX)
    {
        return fail(cudaErrorInvalidValue, "engram_hash: %lld tokens is too many", static_cast<long long>(numTokens));
    }
    resetLaunchError();
    engramHashKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        ids, numTokens, seqStarts, numSeqs, lookback, out, params);
    return checkLaunch("engram_hash");
}
