// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
#include "engramHashPlugin.h"

#include "common/checkMacros.h"
#include "kernels/engramKernels.h"

#include <utility>

namespace engram_trt
{
namespace plugin
{

using nvinfer1::DataType;
using nvinfer1::PluginFieldType;

namespace hash_detail
{
constexpr char const* kName = "EngramHash";
constexpr int32_t kIds = 0;
constexpr int32_t kSeqStarts = 1;
constexpr int32_t kLookback = 2;
constexpr int32_t kNbInputs = 3;

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
} // namespace hash_detail

EngramHashPlugin::EngramHashPlugin(HashLayout layout, nvinfer1::TensorRTPhase phase)
    : EngramHashPlugin(layout, phase, hash_detail::prepareLayout(layout))
{
}

EngramHashPlugin::EngramHashPlugin(
    HashLayout layout, nvinfer1::TensorRTPhase phase, std::shared_ptr<EngramHashLayout const> prepared)
    : EngramPluginBase(hash_detail::kName, phase)
    , mLayout(std::move(layout))
    , mPrepared(std::move(prepared))
{
}

nvinfer1::IPluginV3* EngramHashPlugin::clone() noexcept
{
    ENGRAM_PLUGIN_TRY
    {
        return new EngramHashPlugin(mLayout, mPhase, mPrepared);
    }
    ENGRAM_PLUGIN_CATCH(hash_detail::kName, nullptr);
}

int32_t EngramHashPlugin::getOutputDataTypes(
    DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes, int32_t nbInputs) const noexcept
{
    ENGRAM_PLUGIN_TRY
    {
        ENGRAM_PLUGIN_CHECK(nbInputs == hash_detail::kNbInputs && nbOutputs == 1,
            "expects 3 inputs (ids, seq_starts, lookback) and 1 output, got " << nbInputs << " and " << nbOutputs);
        for (int32_t i = 0; i < nbInputs; ++i)
        {
            ENGRAM_PLUGIN_CHECK(inputTypes[i] == DataType::kINT32,
                "input " << i << " must be int32, got " << dataTypeName(inputTypes[i]));
        }
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
        ENGRAM_PLUGIN_CHECK(nbInputs == hash_detail::kNbInputs && nbOutputs == 1, "expects 3 inputs and 1 output");
        ENGRAM_PLUGIN_CHECK(inputs[hash_detail::kIds].nbDims == 1, "ids must be 1-D [T]");
        outputs[0].nbDims = 3;
        outputs[0].d[0] = inputs[hash_detail::kIds].d[0];
        outputs[0].d[1] = exprBuilder.constant(mLayout.numLayers);
        outputs[0].d[2] = exprBuilder.constant(mLayout.numCols());
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
        ENGRAM_PLUGIN_CHECK(nbInputs == hash_detail::kNbInputs && nbOutputs == 1, "expects 3 inputs and 1 output");
        ENGRAM_PLUGIN_CHECK(in[hash_detail::kIds].desc.dims.nbDims == 1, "ids must be 1-D [T]");
        ENGRAM_PLUGIN_CHECK(in[hash_detail::kSeqStarts].desc.dims.nbDims == 1, "seq_starts must be 1-D [S+1]");
        nvinfer1::Dims const& lookback = in[hash_detail::kLookback].desc.dims;
        ENGRAM_PLUGIN_CHECK(lookback.nbDims == 2 && (lookback.d[1] == -1 || lookback.d[1] == mLayout.maxNgram - 1),
            "lookback must be [S, " << mLayout.maxNgram - 1 << "], got " << dimsToString(lookback));
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
        nvinfer1::Dims const& ids = inputDesc[hash_detail::kIds].dims;
        nvinfer1::Dims const& seqStarts = inputDesc[hash_detail::kSeqStarts].dims;
        nvinfer1::Dims const& lookback = inputDesc[hash_detail::kLookback].dims;
        nvinfer1::Dims const& out = outputDesc[0].dims;
        int64_t const numTokens = ids.d[0];
        int64_t const numSeqs = seqStarts.d[0] - 1;
        ENGRAM_PLUGIN_CHECK(numSeqs >= 0, "seq_starts must hold S+1 >= 1 entries");
        ENGRAM_PLUGIN_CHECK(lookback.d[0] == numSeqs && lookback.d[1] == mLayout.maxNgram - 1,
            "lookback must be [" << numSeqs << ", " << mLayout.maxNgram - 1 << "], got " << dimsToString(lookback));
        ENGRAM_PLUGIN_CHECK(
            out.nbDims == 3 && out.d[0] == numTokens && out.d[1] == mLayout.numLayers && out.d[2] == mLayout.numCols(),
            "output must be [T, L, cols], got " << dimsToString(out));
        int const status = engram_hash_prepared(mPrepared.get(), static_cast<int32_t const*>(inputs[hash_detail::kIds]),
            numTokens, static_cast<int32_t const*>(inputs[hash_detail::kSeqStarts]), numSeqs,
            static_cast<int32_t const*>(inputs[hash_detail::kLookback]), static_cast<int32_t*>(outputs[0]), stream);
        ENGRAM_PLUGIN_CHECK(status == 0, engram_last_error());
        return 0;
    }
    ENGRAM_PLUGIN_CATCH(hash_detail::kName, -1);
}

nvinfer1::PluginFieldCollection const* EngramHashPlugin::getFieldsToSerialize() noexcept
{
    ENGRAM_PLUGIN_TRY
    {
        mSerialized.clear();
        mSerialized.addInt32("n_layers", mLayout.numLayers);
        mSerialized.addInt32("max_ngram_size", mLayout.maxNgram);
        mSerialized.addInt32("n_heads", mLayout.numHeads);
        mSerialized.addInt64("pad_id", mLayout.padId);
        mSerialized.addInt64("compressed_vocab_size", mLayout.compressedVocabSize);
        mSerialized.addInt64s("primes", mLayout.primes);
        mSerialized.addInt64s("offsets", mLayout.offsets);
        mSerialized.addInt64s("multipliers", mLayout.multipliers);
        return mSerialized.collection();
    }
    ENGRAM_PLUGIN_CATCH(hash_detail::kName, nullptr);
}

EngramHashPluginCreator::EngramHashPluginCreator()
    : EngramCreatorBase(hash_detail::kName)
    , mFieldNames({
          {"n_layers", PluginFieldType::kINT32, 1},
          {"max_ngram_size", PluginFieldType::kINT32, 1},
          {"n_heads", PluginFieldType::kINT32, 1},
          {"pad_id", PluginFieldType::kINT64, 1},
          {"compressed_vocab_size", PluginFieldType::kINT64, 1},
          {"primes", PluginFieldType::kINT64, 0},
          {"offsets", PluginFieldType::kINT64, 0},
          {"multipliers", PluginFieldType::kINT64, 0},
      })
{
}

nvinfer1::PluginFieldCollection const* EngramHashPluginCreator::getFieldNames() noexcept
{
    return mFieldNames.collection();
}

nvinfer1::IPluginV3* EngramHashPluginCreator::createPlugin(
    char const* /*name*/, nvinfer1::PluginFieldCollection const* fc, nvinfer1::TensorRTPhase phase) noexcept
{
    ENGRAM_PLUGIN_TRY
    {
        FieldReader reader(hash_detail::kName, fc);
        HashLayout layout;
        // The kernel's layout holds at most ENGRAM_HASH_MAX_SLOTS (layer, column) slots:
        // bound each count by it before it is narrowed or multiplied.
        layout.numLayers = reader.getInt32("n_layers", 1, ENGRAM_HASH_MAX_SLOTS);
        layout.maxNgram = reader.getInt32("max_ngram_size", 2, ENGRAM_HASH_MAX_NGRAM);
        layout.numHeads = reader.getInt32("n_heads", 1, ENGRAM_HASH_MAX_SLOTS);
        layout.padId = reader.getInt("pad_id");
        layout.compressedVocabSize = reader.getInt("compressed_vocab_size");
        int64_t const slots = layout.numLayers * layout.numCols();
        ENGRAM_PLUGIN_CHECK(slots <= ENGRAM_HASH_MAX_SLOTS,
            "n_layers * (max_ngram_size - 1) * n_heads = " << slots << " exceeds " << ENGRAM_HASH_MAX_SLOTS);
        layout.primes = reader.getInts("primes", slots);
        layout.offsets = reader.getInts("offsets", slots);
        layout.multipliers
            = reader.getInts("multipliers", static_cast<int64_t>(layout.numLayers) * layout.maxNgram, true);
        reader.finish();
        return new EngramHashPlugin(std::move(layout), phase);
    }
    ENGRAM_PLUGIN_CATCH(hash_detail::kName, nullptr);
}

} // namespace plugin
} // namespace engram_trt
