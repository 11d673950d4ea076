// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
#include "engramPleFusionPlugin.h"

#include "common/checkMacros.h"
#include "common/pluginTensors.h"
#include "kernels/engramKernelsCore.h"
#include "kernels/pleKernels.h"

#include <cuda_runtime_api.h>

#include <climits>

namespace engram_trt
{
namespace plugin
{

using nvinfer1::DataType;

namespace ple_fusion_detail
{
constexpr char const* kName = "EngramPleFusion";
constexpr int32_t kStreams = 0;
constexpr int32_t kKey = 1;
constexpr int32_t kValue = 2;
constexpr int32_t kNormKeyWeight = 3;
constexpr int32_t kNormQueryWeight = 4;
constexpr int32_t kNormConvWeight = 5;
constexpr int32_t kConvWeight = 6;
constexpr int32_t kConvState = 7;
constexpr int32_t kSeqStarts = 8;
constexpr int32_t kPastLens = 9;
constexpr int32_t kSlots = 10;
constexpr int32_t kNbInputs = 11;
constexpr int32_t kOut = 0;
constexpr int32_t kConvStateOut = 1;
constexpr int32_t kNbOutputs = 2;

constexpr Field<PleFusionConfig> kFieldList[] = {
    field<&PleFusionConfig::hcCount>("hc_count", 1),
    field<&PleFusionConfig::hidden>("hidden", 8), // a multiple of 8: checkConfig
    field<&PleFusionConfig::kernel>("kernel", 1, ENGRAM_PLE_FUSION_MAX_KERNEL),
    field<&PleFusionConfig::dilation>("dilation", 1, ENGRAM_PLE_FUSION_MAX_DILATION),
    field<&PleFusionConfig::eps>("eps"),
};
constexpr FieldTable<PleFusionConfig> kFields{kName, kFieldList};

constexpr char const* kHcCountName = kFields.nameOf<&PleFusionConfig::hcCount>();
constexpr char const* kHiddenName = kFields.nameOf<&PleFusionConfig::hidden>();

//! The checks across fields (hidden % 8, hc_count * hidden < 2^31, eps) are the kernel
//! library's, so the plugin and the ctypes path refuse the same configurations.
void checkConfig(PleFusionConfig const& c)
{
    int const status = engram_ple_fusion_check_shape(c.hcCount, c.hidden, c.kernel, c.dilation, c.eps);
    ENGRAM_PLUGIN_CHECK(status == 0, engram_last_error());
}

//! The four weights: float32, or the I/O type (all four the same).
bool isWeightType(DataType type, DataType io)
{
    return type == DataType::kFLOAT || type == io;
}

char const* const kInputNames[kNbInputs] = {"streams", "key", "value", "norm_key_weight", "norm_query_weight",
    "norm_conv_weight", "conv_weight", "conv_state", "seq_starts", "past_lens", "slots"};

//! conv_weight is [W, K] or the checkpoint's [W, 1, K].
bool isConvWeightShape(nvinfer1::Dims const& w, int64_t width, int64_t kernel)
{
    if (w.nbDims == 2)
    {
        return dimMatches(w.d[0], width) && dimMatches(w.d[1], kernel);
    }
    return w.nbDims == 3 && dimMatches(w.d[0], width) && dimMatches(w.d[1], 1) && dimMatches(w.d[2], kernel);
}

//! Shape checks at build time (dims may be -1) and at enqueue (concrete dims).
void checkDims(PleFusionConfig const& c, nvinfer1::Dims const* in)
{
    int64_t const d = c.hidden;
    int64_t const width = static_cast<int64_t>(c.hcCount) * d;
    int64_t const history = static_cast<int64_t>(c.kernel - 1) * c.dilation;
    for (int32_t i : {kStreams, kKey})
    {
        ENGRAM_PLUGIN_CHECK(in[i].nbDims == 2 && dimMatches(in[i].d[1], width),
            kInputNames[i] << " must be [T, " << kHcCountName << " * " << kHiddenName << " = " << width << "], got "
                           << dimsToString(in[i]));
    }
    ENGRAM_PLUGIN_CHECK(in[kValue].nbDims == 2 && dimMatches(in[kValue].d[1], d),
        "value must be [T, " << d << "], got " << dimsToString(in[kValue]));
    for (int32_t i : {kNormKeyWeight, kNormQueryWeight, kNormConvWeight})
    {
        ENGRAM_PLUGIN_CHECK(in[i].nbDims == 1 && dimMatches(in[i].d[0], width),
            kInputNames[i] << " must be [" << width << "], got " << dimsToString(in[i]));
    }
    ENGRAM_PLUGIN_CHECK(isConvWeightShape(in[kConvWeight], width, c.kernel),
        "conv_weight must be [" << width << ", " << c.kernel << "] or [" << width << ", 1, " << c.kernel << "], got "
                                << dimsToString(in[kConvWeight]));
    nvinfer1::Dims const& state = in[kConvState];
    ENGRAM_PLUGIN_CHECK(state.nbDims == 3 && dimMatches(state.d[1], width) && dimMatches(state.d[2], history),
        "conv_state must be [num_slots, " << width << ", (kernel - 1) * dilation = " << history << "], got "
                                          << dimsToString(state));
    for (int32_t i : {kSeqStarts, kPastLens, kSlots})
    {
        ENGRAM_PLUGIN_CHECK(in[i].nbDims == 1, kInputNames[i] << " must be 1-D, got " << dimsToString(in[i]));
    }
}

//! The history is read-modify-write: its output is its input's memory.
constexpr AliasedState kStates[] = {{kConvStateOut, kConvState, "conv_state"}};

//! The one check of the I/O every method sees (PluginIo): counts, types, dims (T, S and
//! num_slots may be -1 at build time; key and value take streams' T, seq_starts and slots
//! past_lens' S wherever known), the output against streams and the conv_state output
//! against conv_state (the aliasing base's checkAliasedStates).
void checkIo(PleFusionConfig const& c, PluginIo const& io)
{
    ENGRAM_PLUGIN_CHECK(io.counts(kNbInputs, kNbOutputs),
        "expects 11 inputs (streams, key, value, norm_key_weight, norm_query_weight, norm_conv_weight, "
        "conv_weight, conv_state, seq_starts, past_lens, slots) and 2 outputs, got "
            << io.nbInputs << " and " << io.nbOutputs);
    if (io.hasInputTypes)
    {
        DataType const* in = io.inTypes;
        DataType const t = in[kStreams];
        ENGRAM_PLUGIN_CHECK(isFloatIoType(t) && in[kKey] == t && in[kValue] == t && in[kConvState] == t,
            "streams, key, value and conv_state must share one type (bfloat16, float16 or float32), got "
                << dataTypeName(t) << ", " << dataTypeName(in[kKey]) << ", " << dataTypeName(in[kValue]) << " and "
                << dataTypeName(in[kConvState]));
        DataType const wt = in[kNormKeyWeight];
        ENGRAM_PLUGIN_CHECK(
            isWeightType(wt, t) && in[kNormQueryWeight] == wt && in[kNormConvWeight] == wt && in[kConvWeight] == wt,
            "the norm and conv weights must all be float32 or all streams' type (" << dataTypeName(t) << "), got "
                                                                                   << dataTypeName(wt) << " first");
        for (int32_t i : {kSeqStarts, kPastLens, kSlots})
        {
            ENGRAM_PLUGIN_CHECK(
                in[i] == DataType::kINT32, kInputNames[i] << " must be int32, got " << dataTypeName(in[i]));
        }
    }
    if (io.hasOutputTypes)
    {
        ENGRAM_PLUGIN_CHECK(io.outTypes[kOut] == io.inTypes[kStreams],
            "streams, key, value, conv_state and the outputs must share one type (bfloat16, float16 or float32), "
            "streams is "
                << dataTypeName(io.inTypes[kStreams]));
    }
    if (io.hasInputDims)
    {
        nvinfer1::Dims const* in = io.inDims;
        checkDims(c, in);
        DimText const t(in[kStreams].d[0], "T");
        for (int32_t i : {kKey, kValue})
        {
            ENGRAM_PLUGIN_CHECK(dimMatches(in[i].d[0], t.value),
                kInputNames[i] << " must have streams' " << t << " tokens, got " << dimsToString(in[i]));
        }
        int64_t const numSeqs = in[kPastLens].d[0];
        ENGRAM_PLUGIN_CHECK(
            dimMatches(in[kSeqStarts].d[0], numSeqs == -1 ? -1 : numSeqs + 1) && dimMatches(in[kSlots].d[0], numSeqs),
            "seq_starts must be [S + 1] and slots [S] with past_lens' S = " << DimText(numSeqs,
                "S") << ", got " << dimsToString(in[kSeqStarts]) << " and " << dimsToString(in[kSlots]));
        if (io.hasOutputDims)
        {
            nvinfer1::Dims const& o = io.outDims[kOut];
            ENGRAM_PLUGIN_CHECK(dimsMatch(o, in[kStreams]),
                "the output must match streams " << dimsToString(in[kStreams]) << ", got " << dimsToString(o));
        }
    }
    checkAliasedStates(statesOf(kStates), io);
}
} // namespace ple_fusion_detail

EngramPleFusionPlugin::EngramPleFusionPlugin(PleFusionConfig const& config, nvinfer1::TensorRTPhase phase)
    : EngramAliasingPluginBase(ple_fusion_detail::kFields, config, phase)
{
    ple_fusion_detail::checkConfig(mConfig);
}

int32_t EngramPleFusionPlugin::getNbOutputs() const noexcept
{
    return ple_fusion_detail::kNbOutputs;
}

int32_t EngramPleFusionPlugin::getOutputDataTypes(
    DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes, int32_t nbInputs) const noexcept
{
    ENGRAM_PLUGIN_TRY
    {
        using namespace ple_fusion_detail;
        checkIo(mConfig, PluginIo::ofTypes(inputTypes, nbInputs, nbOutputs));
        DataType const io = inputTypes[kStreams];
        outputTypes[kOut] = io;
        outputTypes[kConvStateOut] = io;
        return 0;
    }
    ENGRAM_PLUGIN_CATCH(ple_fusion_detail::kName, -1);
}

int32_t EngramPleFusionPlugin::getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
    nvinfer1::DimsExprs const* /*shapeInputs*/, int32_t /*nbShapeInputs*/, nvinfer1::DimsExprs* outputs,
    int32_t nbOutputs, nvinfer1::IExprBuilder& /*exprBuilder*/) noexcept
{
    ENGRAM_PLUGIN_TRY
    {
        using namespace ple_fusion_detail;
        checkIo(mConfig, PluginIo::ofShapes(inputs, nbInputs, nbOutputs));
        outputs[kOut] = inputs[kStreams];
        outputs[kConvStateOut] = inputs[kConvState];
        return 0;
    }
    ENGRAM_PLUGIN_CATCH(ple_fusion_detail::kName, -1);
}

bool EngramPleFusionPlugin::supportsFormatCombination(
    int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept
{
    using namespace ple_fusion_detail;
    if (!isLinearIoAt(pos, inOut, nbInputs, nbOutputs, kNbInputs, kNbOutputs))
    {
        return false;
    }
    nvinfer1::PluginTensorDesc const& desc = inOut[pos].desc;
    DataType const io = inOut[kStreams].desc.type;
    switch (pos)
    {
    case kStreams: return isFloatIoType(desc.type);
    case kNormKeyWeight: return isWeightType(desc.type, io);
    case kNormQueryWeight:
    case kNormConvWeight:
    case kConvWeight: return desc.type == inOut[kNormKeyWeight].desc.type;
    case kSeqStarts:
    case kPastLens:
    case kSlots: return desc.type == DataType::kINT32;
    default: return desc.type == io; // key, value, conv_state, both outputs
    }
}

int32_t EngramPleFusionPlugin::configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
    nvinfer1::DynamicPluginTensorDesc const* /*out*/, int32_t nbOutputs) noexcept
{
    ENGRAM_PLUGIN_TRY
    {
        ple_fusion_detail::checkIo(mConfig, PluginIo::ofConfigure(in, nbInputs, nbOutputs));
        return 0;
    }
    ENGRAM_PLUGIN_CATCH(ple_fusion_detail::kName, -1);
}

size_t EngramPleFusionPlugin::getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
    nvinfer1::DynamicPluginTensorDesc const* /*outputs*/, int32_t /*nbOutputs*/) const noexcept
{
    ENGRAM_PLUGIN_TRY
    {
        using namespace ple_fusion_detail;
        ENGRAM_PLUGIN_CHECK(nbInputs == kNbInputs, "expects 11 inputs");
        size_t bytes = 0;
        int const status = engram_ple_fusion_workspace_size(inputs[kStreams].max.d[0], mConfig.hcCount, mConfig.hidden,
            floatTypeCode(inputs[kStreams].desc.type), &bytes);
        ENGRAM_PLUGIN_CHECK(status == 0, engram_last_error());
        return bytes;
    }
    ENGRAM_PLUGIN_CATCH(ple_fusion_detail::kName, 0);
}

AliasedStates EngramPleFusionPlugin::aliasedStates() const
{
    return statesOf(ple_fusion_detail::kStates);
}

int32_t EngramPleFusionPlugin::enqueue(nvinfer1::PluginTensorDesc const* inputDesc,
    nvinfer1::PluginTensorDesc const* outputDesc, void const* const* inputs, void* const* outputs, void* workspace,
    cudaStream_t stream) noexcept
{
    ENGRAM_PLUGIN_TRY
    {
        using namespace ple_fusion_detail;
        checkIo(mConfig, PluginIo::ofEnqueue(inputDesc, kNbInputs, outputDesc, kNbOutputs));
        int64_t const numTokens = inputDesc[kStreams].dims.d[0];
        int64_t const numSeqs = inputDesc[kPastLens].dims.d[0];
        nvinfer1::Dims const& state = inputDesc[kConvState].dims;
        DataType const io = inputDesc[kStreams].type;
        DataType const wt = inputDesc[kNormKeyWeight].type;

        int64_t const numSlots = state.d[0];
        size_t const stateBytes = static_cast<size_t>(volume(state)) * floatElementBytes(io);
        void* history = outputs[kConvStateOut];
        copyStatesUnlessAliased(inputDesc, inputs, outputs, stream);
        size_t workspaceBytes = 0;
        int status = engram_ple_fusion_workspace_size(
            numTokens, mConfig.hcCount, mConfig.hidden, floatTypeCode(io), &workspaceBytes);
        ENGRAM_PLUGIN_CHECK(status == 0, engram_last_error());
        status = engram_ple_fusion(inputs[kStreams], inputs[kKey], inputs[kValue], floatTypeCode(io),
            inputs[kNormKeyWeight], inputs[kNormQueryWeight], inputs[kNormConvWeight], inputs[kConvWeight],
            floatTypeCode(wt), stateBytes > 0 ? history : nullptr, numSlots,
            static_cast<int32_t const*>(inputs[kSeqStarts]), static_cast<int32_t const*>(inputs[kPastLens]),
            static_cast<int32_t const*>(inputs[kSlots]), numSeqs, numTokens, mConfig.hcCount, mConfig.hidden,
            mConfig.kernel, mConfig.dilation, mConfig.eps, 0, workspace, workspaceBytes, outputs[kOut], stream);
        ENGRAM_PLUGIN_CHECK(status == 0, engram_last_error());
        return 0;
    }
    ENGRAM_PLUGIN_CATCH(ple_fusion_detail::kName, -1);
}

EngramPleFusionPluginCreator::EngramPleFusionPluginCreator()
    : EngramCreator(ple_fusion_detail::kFields)
{
}

} // namespace plugin
} // namespace engram_trt
