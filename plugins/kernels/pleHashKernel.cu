// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * Qwen4-Exp PLE n-gram hash of packed sequences: raw token ids -> rows of one PLE
 * layer's n-gram table.
 *
 * Bit-identical to engram_trt.engram.ple_hash.ple_hash_packed (which holds the formula
 * and is itself tied to transformers' Qwen4ExpTextNGramEmbedding). One thread computes
 * one row id, (token, head): head j belongs to order g = j / heads_per_ngram + 2, so the
 * thread walks the g ids ending at its token (inside its packed sequence, then in the
 * sequence's context), replaces every id past the first EOS it meets (going back) by the
 * EOS id, XORs id * multiplier[k] into an int64 and writes mixed mod prime[j] +
 * offset[j]. Neighbouring threads write neighbouring ids (coalesced) and read the same
 * few token ids (L1 hits).
 *
 * As the Engram hash kernel (hashKernel.cu) does, the layer's constants are validated
 * and laid out once (engram_ple_hash_layout_create) and travel as one __grid_constant__
 * kernel parameter (at most 2.2 KiB: under the 4 KiB every CUDA version allows) that
 * each block copies into shared memory. No device buffer: a layout serves every device
 * and stream, and an engine build needs no GPU.
 */
#include "engramKernelsInternal.h"
#include "pleKernels.h"
#include "seqIndex.cuh"

#include <climits>
#include <cstdint>
#include <new>

namespace engram_trt
{
namespace kernels
{

struct PleHashConstants
{
    int64_t primes[ENGRAM_PLE_HASH_MAX_HEADS];  // [H]: prime of each head
    int64_t offsets[ENGRAM_PLE_HASH_MAX_HEADS]; // [H]: first row of each head in the table
    int64_t multipliers[ENGRAM_PLE_HASH_MAX_NGRAM];
    int64_t eosId;
    int32_t ngramSize;     // N
    int32_t headsPerNgram; // heads of each order
    int32_t numHeads;      // H = (N-1) * headsPerNgram
};
static_assert(sizeof(PleHashConstants) + 64 <= 4096, "the PLE hash parameter must stay under 4 KiB");

constexpr int kPleHashThreads = 256;

__global__ void __launch_bounds__(kPleHashThreads) plePackedHashKernel(int32_t const* __restrict__ ids,
    int32_t const* __restrict__ seqStarts, int64_t numSeqs, int32_t const* __restrict__ context, uint32_t total,
    int32_t* __restrict__ out, __grid_constant__ PleHashConstants const p)
{
    __shared__ int64_t primes[ENGRAM_PLE_HASH_MAX_HEADS];
    __shared__ int64_t offsets[ENGRAM_PLE_HASH_MAX_HEADS];
    __shared__ int64_t multipliers[ENGRAM_PLE_HASH_MAX_NGRAM];
    for (int32_t i = threadIdx.x; i < p.numHeads; i += blockDim.x)
    {
        primes[i] = p.primes[i];
        offsets[i] = p.offsets[i];
    }
    for (int32_t i = threadIdx.x; i < p.ngramSize; i += blockDim.x)
    {
        multipliers[i] = p.multipliers[i];
    }
    __syncthreads();

    uint32_t const index = blockIdx.x * blockDim.x + threadIdx.x;
    if (index >= total)
    {
        return;
    }
    // index = t * H + head; 32-bit divisions (total < 2^31).
    uint32_t const numHeads = static_cast<uint32_t>(p.numHeads);
    int64_t const t = index / numHeads;
    int32_t const head = static_cast<int32_t>(index - static_cast<uint32_t>(t) * numHeads);
    int32_t const order = head / p.headsPerNgram + 2; // the ids t, t-1, ..., t-order+1

    // The sequence holding token t (seqIndex.cuh). A token outside every sequence has no
    // context: its predecessors read as EOS.
    int64_t const found = sequenceOf(seqStarts, numSeqs, t);
    bool const inSequence = found >= 0;
    int64_t const seq = inSequence ? found : 0;
    int64_t const start = inSequence ? seqStarts[found] : t;
    int64_t const position = t - start;
    int32_t const contextLen = p.ngramSize - 1;

    int64_t mixed = 0;
    bool afterEos = false; // an EOS lies between the token and the ones further back
    for (int32_t k = 0; k < order; ++k)
    {
        int64_t value = p.eosId;
        if (!afterEos)
        {
            int64_t const pos = position - k;
            if (k == 0)
            {
                value = ids[t];
            }
            else if (pos >= 0)
            {
                // seq_starts is an engine input nobody validated: with a negative start the
                // index can fall before ids[0]; such a position reads as EOS.
                int64_t const tokenIndex = start + pos;
                value = tokenIndex >= 0 ? ids[tokenIndex] : p.eosId;
            }
            else if (inSequence && context != nullptr)
            {
                // pos in [-(N-1), -1]; the context is oldest first, so pos = -1 is its last entry.
                value = context[seq * contextLen + contextLen + pos];
            }
            // k = 0 is the token itself, EOS or not; from k = 1 on an EOS ends the walk.
            afterEos = k > 0 && value == p.eosId;
        }
        // Wrapping product, as torch's int64 (it cannot wrap for ids < vocab_size: the
        // host checks multiplier * (vocab_size - 1) <= INT64_MAX).
        mixed ^= static_cast<int64_t>(static_cast<uint64_t>(value) * static_cast<uint64_t>(multipliers[k]));
    }
    int64_t const prime = primes[head];
    int64_t r = mixed % prime;
    r += (r < 0) ? prime : 0; // floor modulo, as torch.remainder
    out[index] = static_cast<int32_t>(r + offsets[head]);
}

} // namespace kernels
} // namespace engram_trt

//! A validated PLE hash layout (one PLE layer), laid out as the kernel parameter.
struct EngramPleHashLayout
{
    engram_trt::kernels::PleHashConstants constants{};
};

namespace engram_trt
{
namespace kernels
{

//! Validates one layer's layout and, when `layout` is non-null, fills it.
int buildPleHashLayout(char const* fn, int64_t const* multipliersHost, int64_t const* primesHost,
    int64_t const* offsetsHost, int32_t ngramSize, int32_t headsPerNgram, int64_t eosId, int64_t vocabSize,
    int64_t tableRows, EngramPleHashLayout* layout)
{
    if (ngramSize < 2 || ngramSize > ENGRAM_PLE_HASH_MAX_NGRAM || headsPerNgram < 1
        || static_cast<int64_t>(ngramSize - 1) * headsPerNgram > ENGRAM_PLE_HASH_MAX_HEADS)
    {
        return fail(cudaErrorInvalidValue,
            "%s: need 2 <= ngram_size <= %d, heads_per_ngram >= 1 and (ngram_size - 1) * heads_per_ngram <= %d "
            "(got %d, %d)",
            fn, ENGRAM_PLE_HASH_MAX_NGRAM, ENGRAM_PLE_HASH_MAX_HEADS, ngramSize, headsPerNgram);
    }
    if (multipliersHost == nullptr || primesHost == nullptr || offsetsHost == nullptr)
    {
        return fail(cudaErrorInvalidValue, "%s: multipliers, primes and offsets are required", fn);
    }
    if (vocabSize < 1 || eosId < 0 || eosId >= vocabSize)
    {
        return fail(
            cudaErrorInvalidValue, "%s: eos_id %lld outside [0, vocab_size %lld)", fn, ll(eosId), ll(vocabSize));
    }
    if (vocabSize - 1 > INT32_MAX)
    {
        return fail(cudaErrorInvalidValue, "%s: vocab_size %lld: token ids must fit int32", fn, ll(vocabSize));
    }
    if (tableRows < 1 || tableRows > INT32_MAX)
    {
        return fail(
            cudaErrorInvalidValue, "%s: table_rows %lld outside [1, 2^31 - 1]: row ids are int32", fn, ll(tableRows));
    }
    int64_t const maxId = vocabSize - 1;
    for (int32_t i = 0; i < ngramSize; ++i)
    {
        int64_t const m = multipliersHost[i];
        if (m <= 0 || (maxId > 0 && m > INT64_MAX / maxId))
        {
            return fail(cudaErrorInvalidValue, "%s: multiplier[%d] = %lld is not in (0, INT64_MAX / (vocab_size - 1)]",
                fn, i, ll(m));
        }
    }
    int32_t const numHeads = (ngramSize - 1) * headsPerNgram;
    for (int32_t i = 0; i < numHeads; ++i)
    {
        int64_t const prime = primesHost[i];
        int64_t const offset = offsetsHost[i];
        if (prime < 2 || offset < 0 || offset > tableRows - prime)
        {
            return fail(cudaErrorInvalidValue,
                "%s: head %d has prime %lld, offset %lld: its rows must lie in the table's %lld", fn, i, ll(prime),
                ll(offset), ll(tableRows));
        }
    }
    if (layout != nullptr)
    {
        PleHashConstants& c = layout->constants;
        c.eosId = eosId;
        c.ngramSize = ngramSize;
        c.headsPerNgram = headsPerNgram;
        c.numHeads = numHeads;
        for (int32_t i = 0; i < ngramSize; ++i)
        {
            c.multipliers[i] = multipliersHost[i];
        }
        for (int32_t i = 0; i < numHeads; ++i)
        {
            c.primes[i] = primesHost[i];
            c.offsets[i] = offsetsHost[i];
        }
    }
    return 0;
}

int launchPleHash(char const* fn, EngramPleHashLayout const& layout, int32_t const* ids, int64_t numTokens,
    int32_t const* seqStarts, int64_t numSeqs, int32_t const* context, int32_t* out, cudaStream_t stream)
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
    int64_t const perToken = layout.constants.numHeads;
    if (numTokens > INT32_MAX / perToken)
    {
        return fail(cudaErrorInvalidValue, "%s: %lld tokens x %lld heads exceeds 2^31 - 1 row ids", fn, ll(numTokens),
            ll(perToken));
    }
    uint32_t const total = static_cast<uint32_t>(numTokens * perToken);
    unsigned const blocks = (total + kPleHashThreads - 1) / kPleHashThreads;
    resetLaunchError();
    plePackedHashKernel<<<blocks, kPleHashThreads, 0, stream>>>(
        ids, seqStarts, numSeqs, context, total, out, layout.constants);
    return checkLaunch(fn);
}

} // namespace kernels
} // namespace engram_trt

using namespace engram_trt::kernels;

extern "C" ENGRAM_API int engram_ple_hash_check_layout(int64_t const* multipliersHost, int64_t const* primesHost,
    int64_t const* offsetsHost, int32_t ngramSize, int32_t headsPerNgram, int64_t eosId, int64_t vocabSize,
    int64_t tableRows)
{
    clearError();
    return buildPleHashLayout("engram_ple_hash", multipliersHost, primesHost, offsetsHost, ngramSize, headsPerNgram,
        eosId, vocabSize, tableRows, nullptr);
}

extern "C" ENGRAM_API int engram_ple_hash_layout_create(int64_t const* multipliersHost, int64_t const* primesHost,
    int64_t const* offsetsHost, int32_t ngramSize, int32_t headsPerNgram, int64_t eosId, int64_t vocabSize,
    int64_t tableRows, EngramPleHashLayout** layout)
{
    clearError();
    if (layout == nullptr)
    {
        return fail(cudaErrorInvalidValue, "engram_ple_hash_layout_create: layout is NULL");
    }
    *layout = nullptr;
    if (int const status = buildPleHashLayout("engram_ple_hash_layout_create", multipliersHost, primesHost, offsetsHost,
            ngramSize, headsPerNgram, eosId, vocabSize, tableRows, nullptr))
    {
        return status;
    }
    auto* created = new (std::nothrow) EngramPleHashLayout();
    if (created == nullptr)
    {
        return fail(cudaErrorMemoryAllocation, "engram_ple_hash_layout_create: out of host memory");
    }
    buildPleHashLayout("engram_ple_hash_layout_create", multipliersHost, primesHost, offsetsHost, ngramSize,
        headsPerNgram, eosId, vocabSize, tableRows, created);
    *layout = created;
    return 0;
}

extern "C" ENGRAM_API int engram_ple_hash_layout_destroy(EngramPleHashLayout* layout)
{
    clearError();
    delete layout;
    return 0;
}

extern "C" ENGRAM_API int engram_ple_hash_prepared(EngramPleHashLayout const* layout, int32_t const* ids,
    int64_t numTokens, int32_t const* seqStarts, int64_t numSeqs, int32_t const* context, int32_t* out,
    cudaStream_t stream)
{
    clearError();
    if (layout == nullptr)
    {
        return fail(cudaErrorInvalidValue, "engram_ple_hash_prepared: layout is NULL");
    }
    return launchPleHash("engram_ple_hash_prepared", *layout, ids, numTokens, seqStarts, numSeqs, context, out, stream);
}

extern "C" ENGRAM_API int engram_ple_hash(int32_t const* ids, int64_t numTokens, int32_t const* seqStarts,
    int64_t numSeqs, int32_t const* context, int64_t const* multipliersHost, int64_t const* primesHost,
    int64_t const* offsetsHost, int32_t ngramSize, int32_t headsPerNgram, int64_t eosId, int64_t vocabSize,
    int64_t tableRows, int32_t* out, cudaStream_t stream)
{
    clearError();
    // The one-shot form: validates and lays out the constants at every call (on the
    // stack); engram_ple_hash_layout_create + engram_ple_hash_prepared do that once.
    EngramPleHashLayout layout;
    if (int const status = buildPleHashLayout("engram_ple_hash", multipliersHost, primesHost, offsetsHost, ngramSize,
            headsPerNgram, eosId, vocabSize, tableRows, &layout))
    {
        return status;
    }
    return launchPleHash("engram_ple_hash", layout, ids, numTokens, seqStarts, numSeqs, context, out, stream);
}
