// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
#include "engramPleHashPlugin.h"

#include "common/checkMacros.h"
#include "common/pluginTensors.h"
#include "kernels/engramKernelsCore.h"
#include "kernels/pleKernels.h"

#include <cstdint>
#include <limits>
#include <utility>

namespace engram_trt
{
namespace plugin
{

using nvinfer1::DataType;

namespace ple_hash_detail
{
constexpr char const* kName = "EngramPleHash";
constexpr int32_t kIds = 0;
constexpr int32_t kSeqStarts = 1;
constexpr int32_t kContext = 2;
constexpr int32_t kNbInputs = 3;
constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

//! The heads of the layer, the length of primes and offsets (below the table, whose
//! names its check gives).
int64_t pleHeadCount(PleHashLayout const& layout);

//! One multiplier per n-gram position: N.
int64_t pleMultiplierCount(PleHashLayout const& layout)
{
    return layout.ngramSize;
}

constexpr Field<PleHashLayout> kFieldList[] = {
    field<&PleHashLayout::ngramSize>("ngram_size", 2, ENGRAM_PLE_HASH_MAX_NGRAM),
    field<&PleHashLayout::headsPerNgram>("heads_per_ngram", 1, ENGRAM_PLE_HASH_MAX_HEADS),
    // token ids and row ids are int32 on the device
    field<&PleHashLayout::eosId>("eos_id", 0, kInt32Max),
    field<&PleHashLayout::vocabSize>("vocab_size", 1, kInt32Max + 1),
    field<&PleHashLayout::tableRows>("table_rows", 1, kInt32Max),
    // up to 2^63 / vocab: a narrower type may have been truncated by an exporter
    arrayField<&PleHashLayout::multipliers>("multipliers", pleMultiplierCount, true),
    arrayField<&PleHashLayout::primes>("primes", pleHeadCount),
    arrayField<&PleHashLayout::offsets>("offsets", pleHeadCount),
};
constexpr FieldTable<PleHashLayout> kFields{kName, kFieldList};

// The names the checks across fields give, as the table spells them.
constexpr char const* kNgramSizeName = kFields.nameOf<&PleHashLayout::ngramSize>();
constexpr char const* kHeadsPerNgramName = kFields.nameOf<&PleHashLayout::headsPerNgram>();

//! The kernel's layout holds at most ENGRAM_PLE_HASH_MAX_HEADS heads: the product is
//! checked here, before primes and offsets of that length are read.
int64_t pleHeadCount(PleHashLayout const& layout)
{
    int64_t const count = layout.numHeads();
    ENGRAM_PLUGIN_CHECK(count <= ENGRAM_PLE_HASH_MAX_HEADS,
        "(" << kNgramSizeName << " - 1) * " << kHeadsPerNgramName << " = " << count << " exceeds "
            << ENGRAM_PLE_HASH_MAX_HEADS);
    return count;
}

//! Validates the layout (eos_id < vocab_size, multiplier overflow, every head's rows
//! inside the table) and lays it out once (engram_ple_hash_layout_create).
std::shared_ptr<EngramPleHashLayout const> prepareLayout(PleHashLayout const& layout)
{
    EngramPleHashLayout* prepared = nullptr;
    int const status
        = engram_ple_hash_layout_create(layout.multipliers.data(), layout.primes.data(), layout.offsets.data(),
            layout.ngramSize, layout.headsPerNgram, layout.eosId, layout.vocabSize, layout.tableRows, &prepared);
    ENGRAM_PLUGIN_CHECK(status == 0 && prepared != nullptr, engram_last_error());
    return std::shared_ptr<EngramPleHashLayout const>(prepared,
        [](EngramPleHashLayout const* p) { engram_ple_hash_layout_destroy(const_cast<EngramPleHashLayout*>(p)); });
}

//! The one check of the I/O every method sees (PluginIo): counts, types, dims (T and S may
//! be -1 at build time; at enqueue S is seq_starts' length - 1 and context's rows are S).
void checkIo(PleHashLayout const& c, PluginIo const& io)
{
    ENGRAM_PLUGIN_CHECK(io.counts(kNbInputs, 1),
        "expects 3 inputs (ids, seq_starts, context) and 1 output, got " << io.nbInputs << " and " << io.nbOutputs);
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
        nvinfer1::Dims const& context = io.inDims[kContext];
        ENGRAM_PLUGIN_CHECK(ids.nbDims == 1, "ids must be 1-D [T]");
        ENGRAM_PLUGIN_CHECK(seqStarts.nbDims == 1, "seq_starts must be 1-D [S+1]");
        ENGRAM_PLUGIN_CHECK(dimAtLeast(seqStarts.d[0], 1), "seq_starts must hold S+1 >= 1 entries");
        int64_t const numSeqs = seqStarts.d[0] == -1 ? -1 : seqStarts.d[0] - 1;
        ENGRAM_PLUGIN_CHECK(
            context.nbDims == 2 && dimMatches(context.d[0], numSeqs) && dimMatches(context.d[1], c.ngramSize - 1),
            "context must be [" << DimText(numSeqs, "S") << ", " << c.ngramSize - 1 << "], got "
                                << dimsToString(context));
        if (io.hasOutputDims)
        {
            nvinfer1::Dims const& out = io.outDims[0];
            ENGRAM_PLUGIN_CHECK(out.nbDims == 2 && dimMatches(out.d[0], ids.d[0]) && dimMatches(out.d[1], c.numHeads()),
                "output must be [T, H] = [" << DimText(ids.d[0], "T") << ", " << c.numHeads() << "], got "
                                            << dimsToString(out));
        }
    }
}
} // namespace ple_hash_detail

EngramPleHashPlugin::EngramPleHashPlugin(PleHashLayout layout, nvinfer1::TensorRTPhase phase)
    : EngramPluginBaseT(ple_hash_detail::kFields, std::move(layout), phase)
    , mPrepared(ple_hash_detail::prepareLayout(mConfig))
{
}

int32_t EngramPleHashPlugin::getOutputDataTypes(
    DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes, int32_t nbInputs) const noexcept
{
    ENGRAM_PLUGIN_TRY
    {
        ple_hash_detail::checkIo(mConfig, PluginIo::ofTypes(inputTypes, nbInputs, nbOutputs));
        outputTypes[0] = DataType::kINT32;
        return 0;
    }
    ENGRAM_PLUGIN_CATCH(ple_hash_detail::kName, -1);
}

int32_t EngramPleHashPlugin::getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
    nvinfer1::DimsExprs const* /*shapeInputs*/, int32_t /*nbShapeInputs*/, nvinfer1::DimsExprs* outputs,
    int32_t nbOutputs, nvinfer1::IExprBuilder& exprBuilder) noexcept
{
    ENGRAM_PLUGIN_TRY
    {
        ple_hash_detail::checkIo(mConfig, PluginIo::ofShapes(inputs, nbInputs, nbOutputs));
        outputs[0].nbDims = 2;
        outputs[0].d[0] = inputs[ple_hash_detail::kIds].d[0];
        outputs[0].d[1] = exprBuilder.constant(mConfig.numHeads());
        return 0;
    }
    ENGRAM_PLUGIN_CATCH(ple_hash_detail::kName, -1);
}

bool EngramPleHashPlugin::supportsFormatCombination(
    int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept
{
    if (nbInputs != ple_hash_detail::kNbInputs || nbOutputs != 1 || pos < 0 || pos >= nbInputs + nbOutputs)
    {
        return false;
    }
    return inOut[pos].desc.type == DataType::kINT32 && inOut[pos].desc.format == nvinfer1::TensorFormat::kLINEAR;
}

int32_t EngramPleHashPlugin::configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
    nvinfer1::DynamicPluginTensorDesc const* /*out*/, int32_t nbOutputs) noexcept
{
    ENGRAM_PLUGIN_TRY
    {
        ple_hash_detail::checkIo(mConfig, PluginIo::ofConfigure(in, nbInputs, nbOutputs));
        return 0;
    }
    ENGRAM_PLUGIN_CATCH(ple_hash_detail::kName, -1);
}

size_t EngramPleHashPlugin::getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* /*inputs*/, int32_t /*nbInputs*/,
    nvinfer1::DynamicPluginTensorDesc const* /*outputs*/, int32_t /*nbOutputs*/) const noexcept
{
    return 0; // the prepared layout travels as a kernel parameter
}

int32_t EngramPleHashPlugin::enqueue(nvinfer1::PluginTensorDesc const* inputDesc,
    nvinfer1::PluginTensorDesc const* outputDesc, void const* const* inputs, void* const* outputs, void* /*workspace*/,
    cudaStream_t stream) noexcept
{
    ENGRAM_PLUGIN_TRY
    {
        ple_hash_detail::checkIo(mConfig, PluginIo::ofEnqueue(inputDesc, ple_hash_detail::kNbInputs, outputDesc, 1));
        int64_t const numTokens = inputDesc[ple_hash_detail::kIds].dims.d[0];
        int64_t const numSeqs = inputDesc[ple_hash_detail::kSeqStarts].dims.d[0] - 1;
        int const status = engram_ple_hash_prepared(mPrepared.get(),
            static_cast<int32_t const*>(inputs[ple_hash_detail::kIds]), numTokens,
            static_cast<int32_t const*>(inputs[ple_hash_detail::kSeqStarts]), numSeqs,
            static_cast<int32_t const*>(inputs[ple_hash_detail::kContext]), static_cast<int32_t*>(outputs[0]), stream);
        ENGRAM_PLUGIN_CHECK(status == 0, engram_last_error());
        return 0;
    }
    ENGRAM_PLUGIN_CATCH(ple_hash_detail::kName, -1);
}

EngramPleHashPluginCreator::EngramPleHashPluginCreator()
    : EngramCreator(ple_hash_detail::kFields)
{
}

} // namespace plugin
} // namespace engram_trt
