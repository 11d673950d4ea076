// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
#include "engramGatedDeltaNetPlugin.h"

#include "common/checkMacros.h"
#include "common/pluginTensors.h"
#include "kernels/engramKernelsCore.h"
#include "kernels/linearAttentionKernels.h"

#include <cuda_runtime_api.h>

#include <climits>

namespace engram_trt
{
namespace plugin
{

using nvinfer1::DataType;

namespace gated_delta_detail
{
constexpr char const* kName = "EngramGatedDeltaNet";
constexpr int32_t kQ = 0;
constexpr int32_t kK = 1;
constexpr int32_t kV = 2;
constexpr int32_t kG = 3;
constexpr int32_t kBeta = 4;
constexpr int32_t kState = 5;
constexpr int32_t kSeqStarts = 6;
constexpr int32_t kPastLens = 7;
constexpr int32_t kSlots = 8;
constexpr int32_t kNbInputs = 9;
constexpr int32_t kOut = 0;
constexpr int32_t kStateOut = 1;
constexpr int32_t kNbOutputs = 2;

constexpr Field<GatedDeltaNetConfig> kFieldList[] = {
    field<&GatedDeltaNetConfig::l2normQk>("l2norm_qk", 0, 1),
    field<&GatedDeltaNetConfig::scale>("scale"), // finite: checkShape
};
constexpr FieldTable<GatedDeltaNetConfig> kFields{kName, kFieldList};

char const* const kInputNames[kNbInputs] = {"q", "k", "v", "g", "beta", "state", "seq_starts", "past_lens", "slots"};

//! The kernel library's checks (so the plugin and the ctypes path refuse the same);
//! dims still -1 at build time are checked at enqueue.
void checkShape(int64_t hk, int64_t hv, int64_t dk, int64_t dv, GatedDeltaNetConfig const& c)
{
    auto const known
        = [](int64_t d, int32_t fallback) { return d == -1 ? fallback : static_cast<int32_t>(d > INT32_MAX ? -1 : d); };
    int32_t const heads = known(hk, 1);
    int const status = engram_gated_delta_net_check_shape(
        heads, hv == -1 ? heads : known(hv, 1), known(dk, 1), known(dv, 1), c.l2normQk, c.scale);
    ENGRAM_PLUGIN_CHECK(status == 0, engram_last_error());
}

//! Shape checks at build time (dims may be -1) and at enqueue (concrete dims).
void checkDims(GatedDeltaNetConfig const& c, nvinfer1::Dims const* in)
{
    nvinfer1::Dims const& q = in[kQ];
    ENGRAM_PLUGIN_CHECK(q.nbDims == 3, "q must be [T, Hk, dk], got " << dimsToString(q));
    bool sameQk = in[kK].nbDims == 3;
    for (int32_t i = 0; sameQk && i < 3; ++i)
    {
        sameQk = dimMatches(in[kK].d[i], q.d[i]);
    }
    ENGRAM_PLUGIN_CHECK(sameQk, "k must be q's shape " << dimsToString(q) << ", got " << dimsToString(in[kK]));
    nvinfer1::Dims const& v = in[kV];
    ENGRAM_PLUGIN_CHECK(
        v.nbDims == 3 && dimMatches(v.d[0], q.d[0]), "v must be [T, Hv, dv] with q's T, got " << dimsToString(v));
    int64_t const hv = v.d[1];
    checkShape(q.d[1], hv, q.d[2], v.d[2], c);
    for (int32_t i : {kG, kBeta})
    {
        ENGRAM_PLUGIN_CHECK(in[i].nbDims == 2 && dimMatches(in[i].d[0], q.d[0]) && dimMatches(in[i].d[1], hv),
            kInputNames[i] << " must be [T, Hv = " << hv << "], got " << dimsToString(in[i]));
    }
    nvinfer1::Dims const& state = in[kState];
    ENGRAM_PLUGIN_CHECK(state.nbDims == 4 && dimMatches(state.d[1], hv) && dimMatches(state.d[2], q.d[2])
            && dimMatches(state.d[3], v.d[2]),
        "state must be [num_slots, Hv, dk, dv] = [num_slots, " << hv << ", " << q.d[2] << ", " << v.d[2] << "], got "
                                                               << dimsToString(state));
    for (int32_t i : {kSeqStarts, kPastLens, kSlots})
    {
        ENGRAM_PLUGIN_CHECK(in[i].nbDims == 1, kInputNames[i] << " must be 1-D, got " << dimsToString(in[i]));
    }
}

//! The recurrent state is read-modify-write: its output is its input's memory.
constexpr AliasedState kStates[] = {{kStateOut, kState, "state"}};

//! The one check of the I/O every method sees (PluginIo): counts, types, dims (T, S and
//! num_slots may be -1 at build time), the state output against its input (the aliasing
//! base's checkAliasedStates).
void checkIo(GatedDeltaNetConfig const& c, PluginIo const& io)
{
    ENGRAM_PLUGIN_CHECK(io.counts(kNbInputs, kNbOutputs),
        "expects 9 inputs (q, k, v, g, beta, state, seq_starts, past_lens, slots) and 2 outputs, got "
            << io.nbInputs << " and " << io.nbOutputs);
    if (io.hasInputTypes)
    {
        DataType const* in = io.inTypes;
        DataType const t = in[kQ];
        ENGRAM_PLUGIN_CHECK(isFloatIoType(t) && in[kK] == t && in[kV] == t,
            "q, k and v must share one type (bfloat16, float16 or float32), got "
                << dataTypeName(t) << ", " << dataTypeName(in[kK]) << " and " << dataTypeName(in[kV]));
        for (int32_t i : {kG, kBeta, kState})
        {
            ENGRAM_PLUGIN_CHECK(
                in[i] == DataType::kFLOAT, kInputNames[i] << " must be float32, got " << dataTypeName(in[i]));
        }
        for (int32_t i : {kSeqStarts, kPastLens, kSlots})
        {
            ENGRAM_PLUGIN_CHECK(
                in[i] == DataType::kINT32, kInputNames[i] << " must be int32, got " << dataTypeName(in[i]));
        }
    }
    if (io.hasOutputTypes)
    {
        ENGRAM_PLUGIN_CHECK(io.outTypes[kOut] == io.inTypes[kQ],
            "q, k, v and the output must share one type (bfloat16, float16 or float32), g, beta and the states "
            "float32; q is "
                << dataTypeName(io.inTypes[kQ]));
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
            ENGRAM_PLUGIN_CHECK(dimsMatch(o, in[kV]),
                "the output must match v " << dimsToString(in[kV]) << ", got " << dimsToString(o));
        }
    }
    checkAliasedStates(statesOf(kStates), io);
}
} // namespace gated_delta_detail

EngramGatedDeltaNetPlugin::EngramGatedDeltaNetPlugin(GatedDeltaNetConfig const& config, nvinfer1::TensorRTPhase phase)
    : EngramAliasingPluginBase(gated_delta_detail::kFields, config, phase)
{
    gated_delta_detail::checkShape(-1, -1, -1, -1, mConfig);
}

int32_t EngramGatedDeltaNetPlugin::getNbOutputs() const noexcept
{
    return gated_delta_detail::kNbOutputs;
}

int32_t EngramGatedDeltaNetPlugin::getOutputDataTypes(
    DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes, int32_t nbInputs) const noexcept
{
    ENGRAM_PLUGIN_TRY
    {
        using namespace gated_delta_detail;
        checkIo(mConfig, PluginIo::ofTypes(inputTypes, nbInputs, nbOutputs));
        DataType const io = inputTypes[kQ];
        outputTypes[kOut] = io;
        outputTypes[kStateOut] = DataType::kFLOAT;
        return 0;
    }
    ENGRAM_PLUGIN_CATCH(gated_delta_detail::kName, -1);
}

int32_t EngramGatedDeltaNetPlugin::getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
    nvinfer1::DimsExprs const* /*shapeInputs*/, int32_t /*nbShapeInputs*/, nvinfer1::DimsExprs* outputs,
    int32_t nbOutputs, nvinfer1::IExprBuilder& /*exprBuilder*/) noexcept
{
    ENGRAM_PLUGIN_TRY
    {
        using namespace gated_delta_detail;
        checkIo(mConfig, PluginIo::ofShapes(inputs, nbInputs, nbOutputs));
        outputs[kOut] = inputs[kV];
        outputs[kStateOut] = inputs[kState];
        return 0;
    }
    ENGRAM_PLUGIN_CATCH(gated_delta_detail::kName, -1);
}

bool EngramGatedDeltaNetPlugin::supportsFormatCombination(
    int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept
{
    using namespace gated_delta_detail;
    if (!isLinearIoAt(pos, inOut, nbInputs, nbOutputs, kNbInputs, kNbOutputs))
    {
        return false;
    }
    nvinfer1::PluginTensorDesc const& desc = inOut[pos].desc;
    DataType const io = inOut[kQ].desc.type;
    switch (pos)
    {
    case kQ: return isFloatIoType(desc.type);
    case kK:
    case kV: return desc.type == io;
    case kSeqStarts:
    case kPastLens:
    case kSlots: return desc.type == DataType::kINT32;
    case kNbInputs + kOut: return desc.type == io;
    default: return desc.type == DataType::kFLOAT; // g, beta, state, the state output
    }
}

int32_t EngramGatedDeltaNetPlugin::configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
    nvinfer1::DynamicPluginTensorDesc const* /*out*/, int32_t nbOutputs) noexcept
{
    ENGRAM_PLUGIN_TRY
    {
        using namespace gated_delta_detail;
        checkIo(mConfig, PluginIo::ofConfigure(in, nbInputs, nbOutputs));
        return 0;
    }
    ENGRAM_PLUGIN_CATCH(gated_delta_detail::kName, -1);
}

AliasedStates EngramGatedDeltaNetPlugin::aliasedStates() const
{
    return statesOf(gated_delta_detail::kStates);
}

int32_t EngramGatedDeltaNetPlugin::enqueue(nvinfer1::PluginTensorDesc const* inputDesc,
    nvinfer1::PluginTensorDesc const* outputDesc, void const* const* inputs, void* const* outputs, void* /*workspace*/,
    cudaStream_t stream) noexcept
{
    ENGRAM_PLUGIN_TRY
    {
        using namespace gated_delta_detail;
        checkIo(mConfig, PluginIo::ofEnqueue(inputDesc, kNbInputs, outputDesc, kNbOutputs));
        nvinfer1::Dims const& q = inputDesc[kQ].dims;
        nvinfer1::Dims const& v = inputDesc[kV].dims;
        int64_t const numTokens = q.d[0];
        int64_t const numSeqs = inputDesc[kPastLens].dims.d[0];
        nvinfer1::Dims const& state = inputDesc[kState].dims;
        DataType const io = inputDesc[kQ].type;
        int64_t const numSlots = state.d[0];
        size_t const stateBytes = static_cast<size_t>(volume(state)) * sizeof(float);
        void* memory = outputs[kStateOut];
        copyStatesUnlessAliased(inputDesc, inputs, outputs, stream);
        int const status = engram_gated_delta_net(inputs[kQ], inputs[kK], inputs[kV], floatTypeCode(io),
            static_cast<float const*>(inputs[kG]), static_cast<float const*>(inputs[kBeta]),
            stateBytes > 0 ? static_cast<float*>(memory) : nullptr, numSlots,
            static_cast<int32_t const*>(inputs[kSeqStarts]), static_cast<int32_t const*>(inputs[kPastLens]),
            static_cast<int32_t const*>(inputs[kSlots]), numSeqs, numTokens, static_cast<int32_t>(q.d[1]),
            static_cast<int32_t>(v.d[1]), static_cast<int32_t>(q.d[2]), static_cast<int32_t>(v.d[2]), mConfig.l2normQk,
            mConfig.scale, outputs[kOut], stream);
        ENGRAM_PLUGIN_CHECK(status == 0, engram_last_error());
        return 0;
    }
    ENGRAM_PLUGIN_CATCH(gated_delta_detail::kName, -1);
}

EngramGatedDeltaNetPluginCreator::EngramGatedDeltaNetPluginCreator()
    : EngramCreator(gated_delta_detail::kFields)
{
}

} // namespace plugin
} // namespace engram_trt
