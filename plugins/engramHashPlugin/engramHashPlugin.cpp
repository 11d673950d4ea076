// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
#include "engramHashPlugin.h"

#include "common/checkMacros.h"
#include "common/pluginTensors.h"
#include "kernels/engramKernelsCore.h"
#include "kernels/hashKernels.h"

#include <utility>

namespace engram_trt
{
namespace plugin
{

using nvinfer1::DataType;

namespace hash_detail
{
constexpr char const* kName = "EngramHash";
constexpr int32_t kIds = 0;
constexpr int32_t kSeqStarts = 1;
constexpr int32_t kLookback = 2;
constexpr int32_t kNbInputs = 3;

//! The (layer, column) slots of the layout, the length of primes and offsets (below the
//! table, whose names its check gives).
int64_t slots(HashLayout const& layout);

//! One multiplier per layer and n-gram position: L * N.
int64_t multiplierCount(HashLayout const& layout)
{
    return static_cast<int64_t>(layout.numLayers) * layout.maxNgram;
}

constexpr Field<HashLayout> kFieldList[] = {
    field<&HashLayout::numLayers>("n_layers", 1, ENGRAM_HASH_MAX_SLOTS),
    field<&HashLayout::maxNgram>("max_ngram_size", 2, ENGRAM_HASH_MAX_NGRAM),
    field<&HashLayout::numHeads>("n_heads", 1, ENGRAM_HASH_MAX_SLOTS),
    field<&HashLayout::padId>("pad_id"),
    field<&HashLayout::compressedVocabSize>("compressed_vocab_size"),
    arrayField<&HashLayout::primes>("primes", slots),
    arrayField<&HashLayout::offsets>("offsets", slots),
    // up to 2^63 / vocab: a narrower type may have been truncated by an exporter
    arrayField<&HashLayout::multipliers>("multipliers", multiplierCount, true),
};
constexpr FieldTable<HashLayout> kFields{kName, kFieldList};

// The names the checks across fields give, as the table spells them.
constexpr char const* kNumLayersName = kFields.nameOf<&HashLayout::numLayers>();
constexpr char const* kMaxNgramName = kFields.nameOf<&HashLayout::maxNgram>();
constexpr char const* kNumHeadsName = kFields.nameOf<&HashLayout::numHeads>();

//! The kernel's layout holds at most ENGRAM_HASH_MAX_SLOTS slots: the counts are each
//! bounded by it before they are narrowed or multiplied, and their product here.
int64_t slots(HashLayout const& layout)
{
    int64_t const count = layout.numLayers * layout.numCols();
    ENGRAM_PLUGIN_CHECK(count <= ENGRAM_HASH_MAX_SLOTS,
        kNumLayersName << " * (" << kMaxNgramName << " - 1) * " << kNumHeadsName << " = " << count << " exceeds "
                       << ENGRAM_HASH_MAX_SLOTS);
    return count;
}

//! Validates the layout and lays it out once (engram_hash_layout_create).
std::shared_ptr<EngramHashLayout const> prepareLayout(HashLayout const& layout)
{
    EngramHashLayout* prepared = nullptr;
    int const status = engram_hash_layout_create(layout.primes.data(), layout.offsets.data(), layout.multipliers.data(),
        layout.numLayers, layout.maxNgram, layout.numHeads, layout.padId, layout.compressedVocabSize, &prepared);
    ENGRAM_PLUGIN_CHECK(status == 0 && prepared != nullptr, engram_last_error());
    return std::shared_ptr<EngramHashLayout const>(
        prepared, [](EngramHashLayout const* p) { engram_hash_layout_destroy(const_cast<EngramHashLayout*>(p)); });
}

//! The one check of the I/O every method sees (PluginIo): counts, types, dims (T and S may
//! be -1 at build time; at enqueue S is seq_starts' length - 1 and lookback's rows are S).
void checkIo(HashLayout const& c, PluginIo const& io)
{
    ENGRAM_PLUGIN_CHECK(io.counts(kNbInputs, 1),
        "expects 3 inputs (ids, seq_starts, lookback) and 1 output, got " << io.nbInputs << " and " << io.nbOutputs);
    if (io.hasInputTypes)
    {
        for (int32_t i = 0; i < io.nbInputs; ++i)
        {
            ENGRAM_PLUGIN_CHECK(io.inTypes[i] == DataType::kINT32,
                "input " << i << " must be int32, got " << dataTypeName(io.inTypes[i]));
        }
    }
    if (io.hasOutputTypes)
    {
        ENGRAM_PLUGIN_CHECK(
            io.outTypes[0] == DataType::kINT32, "output must be int32, got " << dataTypeName(io.outTypes[0]));
    }
    if (io.hasInputDims)
    {
        nvinfer1::Dims const& ids = io.inDims[kIds];
        nvinfer1::Dims const& seqStarts = io.inDims[kSeqStarts];
        nvinfer1::Dims const& lookback = io.inDims[kLookback];
        ENGRAM_PLUGIN_CHECK(ids.nbDims == 1, "ids must be 1-D [T]");
        ENGRAM_PLUGIN_CHECK(seqStarts.nbDims == 1, "seq_starts must be 1-D [S+1]");
        ENGRAM_PLUGIN_CHECK(dimAtLeast(seqStarts.d[0], 1), "seq_starts must hold S+1 >= 1 entries");
        int64_t const numSeqs = seqStarts.d[0] == -1 ? -1 : seqStarts.d[0] - 1;
        ENGRAM_PLUGIN_CHECK(
            lookback.nbDims == 2 && dimMatches(lookback.d[0], numSeqs) && dimMatches(lookback.d[1], c.maxNgram - 1),
            "lookback must be [" << DimText(numSeqs, "S") << ", " << c.maxNgram - 1 << "], got "
                                 << dimsToString(lookback));
        if (io.hasOutputDims)
        {
            nvinfer1::Dims const& out = io.outDims[0];
            ENGRAM_PLUGIN_CHECK(out.nbDims == 3 && dimMatches(out.d[0], ids.d[0]) && dimMatches(out.d[1], c.numLayers)
                    && dimMatches(out.d[2], c.numCols()),
                "output must be [T, L, cols], got " << dimsToString(out));
        }
    }
}
} // namespace hash_detail

EngramHashPlugin::EngramHashPlugin(HashLayout layout, nvinfer1::TensorRTPhase phase)
    : EngramPluginBaseT(hash_detail::kFields, std::move(layout), phase)
    , mPrepared(hash_detail::prepareLayout(mConfig))
{
}

int32_t EngramHashPlugin::getOutputDataTypes(
    DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes, int32_t nbInputs) const noexcept
{
    ENGRAM_PLUGIN_TRY
    {
        hash_detail::checkIo(mConfig, PluginIo::ofTypes(inputTypes, nbInputs, nbOutputs));
        outputTypes[0] = DataType::kINT32;
        return 0;
    }
    ENGRAM_PLUGIN_CATCH(hash_detail::kName, -1);
}

int32_t EngramHashPlugin::getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
    nvinfer1::DimsExprs const* /*shapeInputs*/, int32_t /*nbShapeInputs*/, nvinfer1::DimsExprs* outputs,
    int32_t nbOutputs, nvinfer1::IExprBuilder& exprBuilder) noexcept
{
    ENGRAM_PLUGIN_TRY
    {
        hash_detail::checkIo(mConfig, PluginIo::ofShapes(inputs, nbInputs, nbOutputs));
        outputs[0].nbDims = 3;
        outputs[0].d[0] = inputs[hash_detail::kIds].d[0];
        outputs[0].d[1] = exprBuilder.constant(mConfig.numLayers);
        outputs[0].d[2] = exprBuilder.constant(mConfig.numCols());
        return 0;
    }
    ENGRAM_PLUGIN_CATCH(hash_detail::kName, -1);
}

bool EngramHashPlugin::supportsFormatCombination(
    int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept
{
    if (nbInputs != hash_detail::kNbInputs || nbOutputs != 1 || pos < 0 || pos >= nbInputs + nbOutputs)
    {
        return false;
    }
    return inOut[pos].desc.type == DataType::kINT32 && inOut[pos].desc.format == nvinfer1::TensorFormat::kLINEAR;
}

int32_t EngramHashPlugin::configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
    nvinfer1::DynamicPluginTensorDesc const* /*out*/, int32_t nbOutputs) noexcept
{
    ENGRAM_PLUGIN_TRY
    {
        hash_detail::checkIo(mConfig, PluginIo::ofConfigure(in, nbInputs, nbOutputs));
        return 0;
    }
    ENGRAM_PLUGIN_CATCH(hash_detail::kName, -1);
}

size_t EngramHashPlugin::getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* /*inputs*/, int32_t /*nbInputs*/,
    nvinfer1::DynamicPluginTensorDesc const* /*outputs*/, int32_t /*nbOutputs*/) const noexcept
{
    return 0; // the prepared layout travels as a kernel parameter
}

int32_t EngramHashPlugin::enqueue(nvinfer1::PluginTensorDesc const* inputDesc,
    nvinfer1::PluginTensorDesc const* outputDesc, void const* const* inputs, void* const* outputs, void* /*workspace*/,
    cudaStream_t stream) noexcept
{
    ENGRAM_PLUGIN_TRY
    {
        hash_detail::checkIo(mConfig, PluginIo::ofEnqueue(inputDesc, hash_detail::kNbInputs, outputDesc, 1));
        int64_t const numTokens = inputDesc[hash_detail::kIds].dims.d[0];
        int64_t const numSeqs = inputDesc[hash_detail::kSeqStarts].dims.d[0] - 1;
        int const status = engram_hash_prepared(mPrepared.get(), static_cast<int32_t const*>(inputs[hash_detail::kIds]),
            numTokens, static_cast<int32_t const*>(inputs[hash_detail::kSeqStarts]), numSeqs,
            static_cast<int32_t const*>(inputs[hash_detail::kLookback]), static_cast<int32_t*>(outputs[0]), stream);
        ENGRAM_PLUGIN_CHECK(status == 0, engram_last_error());
        return 0;
    }
    ENGRAM_PLUGIN_CATCH(hash_detail::kName, -1);
}

EngramHashPluginCreator::EngramHashPluginCreator()
    : EngramCreator(hash_detail::kFields)
{
}

} // namespace plugin
} // namespace engram_trt
