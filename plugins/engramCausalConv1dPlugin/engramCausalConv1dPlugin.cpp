// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
#include "engramCausalConv1dPlugin.h"

#include "common/checkMacros.h"
#include "common/pluginTensors.h"
#include "kernels/engramKernelsCore.h"
#include "kernels/linearAttentionKernels.h"

#include <cuda_runtime_api.h>

namespace engram_trt
{
namespace plugin
{

using nvinfer1::DataType;

namespace causal_conv_detail
{
constexpr char const* kName = "EngramCausalConv1d";
constexpr int32_t kX = 0;
constexpr int32_t kWeight = 1;
constexpr int32_t kConvState = 2;
constexpr int32_t kSeqStarts = 3;
constexpr int32_t kPastLens = 4;
constexpr int32_t kSlots = 5;
constexpr int32_t kNbInputs = 6;
constexpr int32_t kOut = 0;
constexpr int32_t kConvStateOut = 1;
constexpr int32_t kNbOutputs = 2;

constexpr Field<CausalConv1dConfig> kFieldList[] = {
    field<&CausalConv1dConfig::kernel>("kernel", 1, ENGRAM_CAUSAL_CONV_MAX_KERNEL),
    field<&CausalConv1dConfig::activation>("activation", ENGRAM_CONV_ACTIVATION_IDENTITY, ENGRAM_CONV_ACTIVATION_SILU),
};
constexpr FieldTable<CausalConv1dConfig> kFields{kName, kFieldList};

char const* const kInputNames[kNbInputs] = {"x", "weight", "conv_state", "seq_starts", "past_lens", "slots"};

//! The kernel library's checks (so the plugin and the ctypes path refuse the same).
void checkShape(int64_t channels, CausalConv1dConfig const& c)
{
    int const status = engram_causal_conv1d_check_shape(channels, c.kernel, c.activation);
    ENGRAM_PLUGIN_CHECK(status == 0, engram_last_error());
}

bool isWeightType(DataType type, DataType io)
{
    return type == DataType::kFLOAT || type == io;
}

//! weight is [C, K] or the checkpoint's [C, 1, K].
bool isWeightShape(nvinfer1::Dims const& w, int64_t channels, int64_t kernel)
{
    if (w.nbDims == 2)
    {
        return dimMatches(w.d[0], channels) && dimMatches(w.d[1], kernel);
    }
    return w.nbDims == 3 && dimMatches(w.d[0], channels) && dimMatches(w.d[1], 1) && dimMatches(w.d[2], kernel);
}

//! Shape checks at build time (dims may be -1) and at enqueue (concrete dims).
void checkDims(CausalConv1dConfig const& c, nvinfer1::Dims const* in)
{
    ENGRAM_PLUGIN_CHECK(in[kX].nbDims == 2, "x must be [T, C], got " << dimsToString(in[kX]));
    int64_t const channels = in[kX].d[1];
    if (channels != -1)
    {
        checkShape(channels, c);
    }
    ENGRAM_PLUGIN_CHECK(isWeightShape(in[kWeight], channels, c.kernel),
        "weight must be [C, kernel] or [C, 1, kernel] with x's C = " << channels << " and kernel " << c.kernel
                                                                     << ", got " << dimsToString(in[kWeight]));
    nvinfer1::Dims const& state = in[kConvState];
    ENGRAM_PLUGIN_CHECK(state.nbDims == 3 && dimMatches(state.d[1], channels) && dimMatches(state.d[2], c.kernel - 1),
        "conv_state must be [num_slots, " << channels << ", kernel - 1 = " << c.kernel - 1 << "], got "
                                          << dimsToString(state));
    for (int32_t i : {kSeqStarts, kPastLens, kSlots})
    {
        ENGRAM_PLUGIN_CHECK(in[i].nbDims == 1, kInputNames[i] << " must be 1-D, got " << dimsToString(in[i]));
    }
}

//! The conv state is read-modify-write: its output is its input's memory.
constexpr AliasedState kStates[] = {{kConvStateOut, kConvState, "conv_state"}};

//! The one check of the I/O every method sees (PluginIo): counts, types, dims (T, S and
//! num_slots may be -1 at build time), the state output against its input (the aliasing
//! base's checkAliasedStates).
void checkIo(CausalConv1dConfig const& c, PluginIo const& io)
{
    ENGRAM_PLUGIN_CHECK(io.counts(kNbInputs, kNbOutputs),
        "expects 6 inputs (x, weight, conv_state, seq_starts, past_lens, slots) and 2 outputs, got "
            << io.nbInputs << " and " << io.nbOutputs);
    if (io.hasInputTypes)
    {
        DataType const* in = io.inTypes;
        DataType const t = in[kX];
        ENGRAM_PLUGIN_CHECK(isFloatIoType(t) && in[kConvState] == t,
            "x and conv_state must share one type (bfloat16, float16 or float32), got "
                << dataTypeName(t) << " and " << dataTypeName(in[kConvState]));
        ENGRAM_PLUGIN_CHECK(isWeightType(in[kWeight], t),
            "weight must be float32 or x's type (" << dataTypeName(t) << "), got " << dataTypeName(in[kWeight]));
        for (int32_t i : {kSeqStarts, kPastLens, kSlots})
        {
            ENGRAM_PLUGIN_CHECK(
                in[i] == DataType::kINT32, kInputNames[i] << " must be int32, got " << dataTypeName(in[i]));
        }
    }
    if (io.hasOutputTypes)
    {
        ENGRAM_PLUGIN_CHECK(io.outTypes[kOut] == io.inTypes[kX],
            "x, conv_state and the outputs must share one type (bfloat16, float16 or float32), x is "
                << dataTypeName(io.inTypes[kX]));
    }
    if (io.hasInputDims)
    {
        nvinfer1::Dims const* in = io.inDims;
        checkDims(c, in);
        int64_t const numSeqs = in[kPastLens].d[0];
        ENGRAM_PLUGIN_CHECK(
            dimMatches(in[kSeqStarts].d[0], numSeqs == -1 ? -1 : numSeqs + 1) && dimMatches(in[kSlots].d[0], numSeqs),
            "seq_starts must be [S + 1] and slots [S] with past_lens' S = " << DimText(numSeqs,
                "S") << ", got " << dimsToString(in[kSeqStarts]) << " and " << dimsToString(in[kSlots]));
        if (io.hasOutputDims)
        {
            nvinfer1::Dims const& o = io.outDims[kOut];
            ENGRAM_PLUGIN_CHECK(dimsMatch(o, in[kX]),
                "the output must match x " << dimsToString(in[kX]) << ", got " << dimsToString(o));
        }
    }
    checkAliasedStates(statesOf(kStates), io);
}
} // namespace causal_conv_detail

EngramCausalConv1dPlugin::EngramCausalConv1dPlugin(CausalConv1dConfig const& config, nvinfer1::TensorRTPhase phase)
    : EngramAliasingPluginBase(causal_conv_detail::kFields, config, phase)
{
    causal_conv_detail::checkShape(1, mConfig);
}

int32_t EngramCausalConv1dPlugin::getNbOutputs() const noexcept
{
    return causal_conv_detail::kNbOutputs;
}

int32_t EngramCausalConv1dPlugin::getOutputDataTypes(
    DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes, int32_t nbInputs) const noexcept
{
    ENGRAM_PLUGIN_TRY
    {
        using namespace causal_conv_detail;
        checkIo(mConfig, PluginIo::ofTypes(inputTypes, nbInputs, nbOutputs));
        DataType const io = inputTypes[kX];
        outputTypes[kOut] = io;
        outputTypes[kConvStateOut] = io;
        return 0;
    }
    ENGRAM_PLUGIN_CATCH(causal_conv_detail::kName, -1);
}

int32_t EngramCausalConv1dPlugin::getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
    nvinfer1::DimsExprs const* /*shapeInputs*/, int32_t /*nbShapeInputs*/, nvinfer1::DimsExprs* outputs,
    int32_t nbOutputs, nvinfer1::IExprBuilder& /*exprBuilder*/) noexcept
{
    ENGRAM_PLUGIN_TRY
    {
        using namespace causal_conv_detail;
        checkIo(mConfig, PluginIo::ofShapes(inputs, nbInputs, nbOutputs));
        outputs[kOut] = inputs[kX];
        outputs[kConvStateOut] = inputs[kConvState];
        return 0;
    }
    ENGRAM_PLUGIN_CATCH(causal_conv_detail::kName, -1);
}

bool EngramCausalConv1dPlugin::supportsFormatCombination(
    int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept
{
    using namespace causal_conv_detail;
    if (!isLinearIoAt(pos, inOut, nbInputs, nbOutputs, kNbInputs, kNbOutputs))
    {
        return false;
    }
    nvinfer1::PluginTensorDesc const& desc = inOut[pos].desc;
    DataType const io = inOut[kX].desc.type;
    switch (pos)
    {
    case kX: return isFloatIoType(desc.type);
    case kWeight: return isWeightType(desc.type, io);
    case kSeqStarts:
    case kPastLens:
    case kSlots: return desc.type == DataType::kINT32;
    default: return desc.type == io; // conv_state, both outputs
    }
}

int32_t EngramCausalConv1dPlugin::configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
    nvinfer1::DynamicPluginTensorDesc const* /*out*/, int32_t nbOutputs) noexcept
{
    ENGRAM_PLUGIN_TRY
    {
        using namespace causal_conv_detail;
        checkIo(mConfig, PluginIo::ofConfigure(in, nbInputs, nbOutputs));
        return 0;
    }
    ENGRAM_PLUGIN_CATCH(causal_conv_detail::kName, -1);
}

AliasedStates EngramCausalConv1dPlugin::aliasedStates() const
{
    return statesOf(causal_conv_detail::kStates);
}

int32_t EngramCausalConv1dPlugin::enqueue(nvinfer1::PluginTensorDesc const* inputDesc,
    nvinfer1::PluginTensorDesc const* outputDesc, void const* const* inputs, void* const* outputs, void* /*workspace*/,
    cudaStream_t stream) noexcept
{
    ENGRAM_PLUGIN_TRY
    {
        using namespace causal_conv_detail;
        checkIo(mConfig, PluginIo::ofEnqueue(inputDesc, kNbInputs, outputDesc, kNbOutputs));
        nvinfer1::Dims const& x = inputDesc[kX].dims;
        int64_t const numTokens = x.d[0];
        int64_t const channels = x.d[1];
        int64_t const numSeqs = inputDesc[kPastLens].dims.d[0];
        nvinfer1::Dims const& state = inputDesc[kConvState].dims;
        DataType const io = inputDesc[kX].type;
        DataType const wt = inputDesc[kWeight].type;
        int64_t const numSlots = state.d[0];
        size_t const stateBytes = static_cast<size_t>(volume(state)) * floatElementBytes(io);
        void* history = outputs[kConvStateOut];
        copyStatesUnlessAliased(inputDesc, inputs, outputs, stream);
        int const status = engram_causal_conv1d(inputs[kX], floatTypeCode(io), inputs[kWeight], floatTypeCode(wt),
            stateBytes > 0 ? history : nullptr, numSlots, static_cast<int32_t const*>(inputs[kSeqStarts]),
            static_cast<int32_t const*>(inputs[kPastLens]), static_cast<int32_t const*>(inputs[kSlots]), numSeqs,
            numTokens, channels, mConfig.kernel, mConfig.activation, outputs[kOut], stream);
        ENGRAM_PLUGIN_CHECK(status == 0, engram_last_error());
        return 0;
    }
    ENGRAM_PLUGIN_CATCH(causal_conv_detail::kName, -1);
}

EngramCausalConv1dPluginCreator::EngramCausalConv1dPluginCreator()
    : EngramCreator(causal_conv_detail::kFields)
{
}

} // namespace plugin
} // namespace engram_trt
