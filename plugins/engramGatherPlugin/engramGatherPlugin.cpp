// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
#include "engramGatherPlugin.h"

#include "common/checkMacros.h"
#include "common/pluginTensors.h"
#include "kernels/engramKernelsCore.h"
#include "kernels/gatherKernels.h"

#include <climits>

namespace engram_trt
{
namespace plugin
{

using nvinfer1::DataType;

namespace gather_detail
{
constexpr char const* kName = "EngramGather";
constexpr int32_t kIds = 0;
constexpr int32_t kRowsAddr = 1;
constexpr int32_t kScalesAddr = 2;

//! A table address input: int64 holding one value ([] or [1]; [-1] at build time).
bool isAddressShape(nvinfer1::Dims const& dims)
{
    return dims.nbDims == 0 || (dims.nbDims == 1 && dimMatches(dims.d[0], 1));
}

//! column_end's default: every column.
int64_t allColumns(GatherConfig const& c)
{
    return c.numCols;
}

// The ranges that depend on other fields are checkConfig's. The last four fields are
// optional (engines and graphs without the counter input or a tensor-parallel share omit
// them): no counter, every column of the whole table.
constexpr Field<GatherConfig> kFieldList[] = {
    field<&GatherConfig::layerIndex>("layer_index", 0),
    field<&GatherConfig::numLayers>("n_layers", 1),
    field<&GatherConfig::numCols>("n_cols", 1),
    field<&GatherConfig::headDim>("head_dim", 1),
    field<&GatherConfig::tableDtype>("table_dtype", ENGRAM_TABLE_FP8_E4M3, ENGRAM_TABLE_F32),
    field<&GatherConfig::quantBlock>("quant_block"), // any int32: ignored for float tables
    field<&GatherConfig::numRows>("num_rows"),
    field<&GatherConfig::badRowsInput>("bad_rows_input").optional(),
    field<&GatherConfig::columnBegin>("column_begin").optional(),
    field<&GatherConfig::columnEnd>("column_end").optional(allColumns),
    field<&GatherConfig::rowOffset>("row_offset").optional(),
};
constexpr FieldTable<GatherConfig> kFields{kName, kFieldList};

// The names the checks across fields give, as the table spells them.
constexpr char const* kLayerIndexName = kFields.nameOf<&GatherConfig::layerIndex>();
constexpr char const* kNumLayersName = kFields.nameOf<&GatherConfig::numLayers>();
constexpr char const* kNumColsName = kFields.nameOf<&GatherConfig::numCols>();
constexpr char const* kNumRowsName = kFields.nameOf<&GatherConfig::numRows>();
constexpr char const* kColumnBeginName = kFields.nameOf<&GatherConfig::columnBegin>();
constexpr char const* kColumnEndName = kFields.nameOf<&GatherConfig::columnEnd>();
constexpr char const* kRowOffsetName = kFields.nameOf<&GatherConfig::rowOffset>();

//! The checks across fields (each field's own range is the table's).
void checkConfig(GatherConfig const& c)
{
    ENGRAM_PLUGIN_CHECK(c.layerIndex < c.numLayers,
        kLayerIndexName << " " << c.layerIndex << " outside [0, " << kNumLayersName << " " << c.numLayers << ")");
    // Row ids are int32, so a larger table could not be addressed past 2^31 - 1 anyway.
    ENGRAM_PLUGIN_CHECK(c.numRows >= 1 && c.numRows <= INT32_MAX,
        kNumRowsName << " must be in [1, 2^31 - 1] (row ids are int32), got " << c.numRows);
    ENGRAM_PLUGIN_CHECK(c.columnBegin >= 0 && c.columnBegin < c.numCols,
        kColumnBeginName << " must be in [0, " << kNumColsName << " " << c.numCols << "), got " << c.columnBegin);
    ENGRAM_PLUGIN_CHECK(c.columnEnd > c.columnBegin && c.columnEnd <= c.numCols,
        kColumnEndName << " must be in [" << kColumnBeginName << " + 1, " << kNumColsName << "] = ["
                       << c.columnBegin + 1 << ", " << c.numCols << "], got " << c.columnEnd);
    ENGRAM_PLUGIN_CHECK(c.rowOffset >= 0, kRowOffsetName << " must be >= 0, got " << c.rowOffset);
    // The slice's rows are rows of a table the unsharded plugin accepts (int32 row ids).
    ENGRAM_PLUGIN_CHECK(c.rowOffset <= INT32_MAX - c.numRows,
        kRowOffsetName << " " << c.rowOffset << " + " << kNumRowsName << " " << c.numRows
                       << " exceeds 2^31 - 1 (row ids are int32)");
    int const status = engram_gather_check_table(c.headDim, c.tableDtype, c.quantBlock);
    ENGRAM_PLUGIN_CHECK(status == 0, engram_last_error());
}

//! The one check of the I/O every method sees (PluginIo): counts, types, dims (T may be -1
//! at build time, an address input's length too).
void checkIo(GatherConfig const& c, PluginIo const& io)
{
    ENGRAM_PLUGIN_CHECK(io.counts(c.numInputs(), 1),
        "expects " << c.numInputs() << " inputs (ids, rows address" << (c.fp8() ? ", scales address" : "")
                   << (c.badRowsInput ? ", bad-row counter address" : "") << ") and 1 output, got " << io.nbInputs
                   << " and " << io.nbOutputs);
    if (io.hasInputTypes)
    {
        ENGRAM_PLUGIN_CHECK(
            io.inTypes[kIds] == DataType::kINT32, "ids must be int32, got " << dataTypeName(io.inTypes[kIds]));
        for (int32_t i = kRowsAddr; i < io.nbInputs; ++i)
        {
            ENGRAM_PLUGIN_CHECK(io.inTypes[i] == DataType::kINT64,
                "address input " << i << " must be int64, got " << dataTypeName(io.inTypes[i]));
        }
    }
    if (io.hasOutputTypes)
    {
        ENGRAM_PLUGIN_CHECK(io.outTypes[0] == c.outType(),
            "output must be " << dataTypeName(c.outType()) << ", got " << dataTypeName(io.outTypes[0]));
    }
    if (io.hasInputDims)
    {
        nvinfer1::Dims const& ids = io.inDims[kIds];
        ENGRAM_PLUGIN_CHECK(ids.nbDims == 3 && dimMatches(ids.d[1], c.numLayers) && dimMatches(ids.d[2], c.numCols),
            "ids must be [T, " << c.numLayers << ", " << c.numCols << "], got " << dimsToString(ids));
        for (int32_t i = kRowsAddr; i < io.nbInputs; ++i)
        {
            ENGRAM_PLUGIN_CHECK(isAddressShape(io.inDims[i]),
                "address input " << i << " must hold one int64, got " << dimsToString(io.inDims[i]));
        }
        if (io.hasOutputDims)
        {
            nvinfer1::Dims const& out = io.outDims[0];
            ENGRAM_PLUGIN_CHECK(out.nbDims == 3 && dimMatches(out.d[0], ids.d[0]) && dimMatches(out.d[1], c.outCols())
                    && dimMatches(out.d[2], c.headDim),
                "output must be [T, " << c.outCols() << ", " << c.headDim << "], got " << dimsToString(out));
        }
    }
}
} // namespace gather_detail

bool GatherConfig::fp8() const
{
    return tableDtype == ENGRAM_TABLE_FP8_E4M3;
}

DataType GatherConfig::outType() const
{
    switch (tableDtype)
    {
    case ENGRAM_TABLE_F16: return DataType::kHALF;
    case ENGRAM_TABLE_F32: return DataType::kFLOAT;
    default: return DataType::kBF16; // fp8 (dequantized) and bf16
    }
}

int32_t GatherConfig::outElemBytes() const
{
    return tableDtype == ENGRAM_TABLE_F32 ? 4 : 2;
}

EngramGatherPlugin::EngramGatherPlugin(GatherConfig const& config, nvinfer1::TensorRTPhase phase)
    : EngramPluginBaseT(gather_detail::kFields, config, phase)
{
    gather_detail::checkConfig(mConfig);
}

int32_t EngramGatherPlugin::getOutputDataTypes(
    DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes, int32_t nbInputs) const noexcept
{
    ENGRAM_PLUGIN_TRY
    {
        gather_detail::checkIo(mConfig, PluginIo::ofTypes(inputTypes, nbInputs, nbOutputs));
        outputTypes[0] = mConfig.outType();
        return 0;
    }
    ENGRAM_PLUGIN_CATCH(gather_detail::kName, -1);
}

int32_t EngramGatherPlugin::getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
    nvinfer1::DimsExprs const* /*shapeInputs*/, int32_t /*nbShapeInputs*/, nvinfer1::DimsExprs* outputs,
    int32_t nbOutputs, nvinfer1::IExprBuilder& exprBuilder) noexcept
{
    ENGRAM_PLUGIN_TRY
    {
        gather_detail::checkIo(mConfig, PluginIo::ofShapes(inputs, nbInputs, nbOutputs));
        outputs[0].nbDims = 3;
        outputs[0].d[0] = inputs[gather_detail::kIds].d[0];
        outputs[0].d[1] = exprBuilder.constant(mConfig.outCols());
        outputs[0].d[2] = exprBuilder.constant(mConfig.headDim);
        return 0;
    }
    ENGRAM_PLUGIN_CATCH(gather_detail::kName, -1);
}

bool EngramGatherPlugin::supportsFormatCombination(
    int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept
{
    if (!isLinearIoAt(pos, inOut, nbInputs, nbOutputs, mConfig.numInputs(), 1))
    {
        return false;
    }
    nvinfer1::PluginTensorDesc const& desc = inOut[pos].desc;
    if (pos == gather_detail::kIds)
    {
        return desc.type == DataType::kINT32;
    }
    if (pos < nbInputs)
    {
        return desc.type == DataType::kINT64;
    }
    return desc.type == mConfig.outType();
}

int32_t EngramGatherPlugin::configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
    nvinfer1::DynamicPluginTensorDesc const* /*out*/, int32_t nbOutputs) noexcept
{
    ENGRAM_PLUGIN_TRY
    {
        gather_detail::checkIo(mConfig, PluginIo::ofConfigure(in, nbInputs, nbOutputs));
        return 0;
    }
    ENGRAM_PLUGIN_CATCH(gather_detail::kName, -1);
}

int32_t EngramGatherPlugin::enqueue(nvinfer1::PluginTensorDesc const* inputDesc,
    nvinfer1::PluginTensorDesc const* outputDesc, void const* const* inputs, void* const* outputs, void* /*workspace*/,
    cudaStream_t stream) noexcept
{
    ENGRAM_PLUGIN_TRY
    {
        gather_detail::checkIo(mConfig, PluginIo::ofEnqueue(inputDesc, mConfig.numInputs(), outputDesc, 1));
        nvinfer1::Dims const& ids = inputDesc[gather_detail::kIds].dims;
        nvinfer1::Dims const& out = outputDesc[0].dims;
        if (mPhase == nvinfer1::TensorRTPhase::kBUILD)
        {
            // TensorRT runs this enqueue to time the plugin on inputs it made up: the
            // address inputs hold arbitrary values, so no table (and no counter) is read.
            size_t const bytes = static_cast<size_t>(volume(out)) * mConfig.outElemBytes();
            if (bytes > 0)
            {
                ENGRAM_PLUGIN_CHECK_CUDA(cudaMemsetAsync(outputs[0], 0, bytes, stream));
            }
            return 0;
        }
        // The rank's columns are a view of the hash output: from column column_begin of
        // the layer, outCols() per token, the token stride of the whole [T, L, cols].
        int64_t const tokenStride = static_cast<int64_t>(mConfig.numLayers) * mConfig.numCols;
        auto const* layerIds = static_cast<int32_t const*>(inputs[gather_detail::kIds])
            + static_cast<int64_t>(mConfig.layerIndex) * mConfig.numCols + mConfig.columnBegin;
        auto const* scalesAddr
            = mConfig.fp8() ? static_cast<int64_t const*>(inputs[gather_detail::kScalesAddr]) : nullptr;
        auto const* badRowsAddr
            = mConfig.badRowsInput ? static_cast<int64_t const*>(inputs[mConfig.badRowsIndex()]) : nullptr;
        int const status = engram_gather_indirect_ex(layerIds, ids.d[0], mConfig.outCols(), tokenStride,
            static_cast<int64_t const*>(inputs[gather_detail::kRowsAddr]), scalesAddr, mConfig.numRows,
            mConfig.rowOffset, mConfig.headDim, mConfig.tableDtype, mConfig.quantBlock, outputs[0], badRowsAddr,
            stream);
        ENGRAM_PLUGIN_CHECK(status == 0, engram_last_error());
        return 0;
    }
    ENGRAM_PLUGIN_CATCH(gather_detail::kName, -1);
}

EngramGatherPluginCreator::EngramGatherPluginCreator()
    : EngramCreator(gather_detail::kFields)
{
}

} // namespace plugin
} // namespace engram_trt
