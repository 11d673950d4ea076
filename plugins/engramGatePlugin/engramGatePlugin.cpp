// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
#include "engramGatePlugin.h"

#include "common/checkMacros.h"
#include "common/pluginTensors.h"
#include "kernels/engramKernelsCore.h"
#include "kernels/gateKernels.h"

#include <climits>
#include <cmath>

namespace engram_trt
{
namespace plugin
{

using nvinfer1::DataType;

namespace gate_detail
{
constexpr char const* kName = "EngramGate";
constexpr int32_t kHidden = 0;
constexpr int32_t kKv = 1;
constexpr int32_t kQWeight = 2;
constexpr int32_t kKWeight = 3;
constexpr int32_t kMask = 4;
constexpr int32_t kNbInputs = 5;
constexpr float kClamp = 1e-6F; // engram-spec.md: sqrt(max(|dot|, 1e-6))

constexpr int32_t kMaxHcMult = 65535; // the kernel's grid is (T, hc_mult): gridDim.y <= 65535

//! q_weight / k_weight: bf16, fp32, or the I/O type (hidden's).
bool isWeightType(DataType type, DataType ioType)
{
    return type == DataType::kBF16 || type == DataType::kFLOAT || type == ioType;
}

bool isMaskType(DataType type)
{
    return type == DataType::kBOOL || type == DataType::kINT32;
}

constexpr Field<GateConfig> kFieldList[] = {
    field<&GateConfig::hcMult>("hc_mult", 1, kMaxHcMult),
    field<&GateConfig::hiddenSize>("hidden_size", 8), // a multiple of 8: checkConfig
    field<&GateConfig::eps>("eps"),
};
constexpr FieldTable<GateConfig> kFields{kName, kFieldList};

// The names the checks across fields and the shape messages give, as the table spells them.
constexpr char const* kHcMultName = kFields.nameOf<&GateConfig::hcMult>();
constexpr char const* kHiddenSizeName = kFields.nameOf<&GateConfig::hiddenSize>();
constexpr char const* kEpsName = kFields.nameOf<&GateConfig::eps>();

//! The checks the table's ranges cannot make (hc_mult's and hidden_size's bounds are its).
void checkConfig(GateConfig const& c)
{
    ENGRAM_PLUGIN_CHECK(
        c.hiddenSize % 8 == 0, kHiddenSizeName << " must be a positive multiple of 8, got " << c.hiddenSize);
    // kv's row width is an int32 dimension of the engine: refuse it here, not at every enqueue.
    int64_t const kvWidth = (static_cast<int64_t>(c.hcMult) + 1) * c.hiddenSize;
    ENGRAM_PLUGIN_CHECK(kvWidth <= INT32_MAX,
        "(" << kHcMultName << " + 1) * " << kHiddenSizeName << " = " << kvWidth << " exceeds 2^31 - 1 (" << kHcMultName
            << " " << c.hcMult << ", " << kHiddenSizeName << " " << c.hiddenSize << ")");
    ENGRAM_PLUGIN_CHECK(std::isfinite(c.eps) && c.eps >= 0.0F, kEpsName << " must be finite and >= 0");
}

//! The one check of the I/O every method sees (PluginIo): counts, types, dims (T may be -1
//! at build time; at enqueue it is hidden's and every other T must equal it).
void checkIo(GateConfig const& c, PluginIo const& io)
{
    ENGRAM_PLUGIN_CHECK(io.counts(kNbInputs, 1),
        "expects 5 inputs (hidden, kv, q_weight, k_weight, mask) and 1 output, got " << io.nbInputs << " and "
                                                                                     << io.nbOutputs);
    if (io.hasInputTypes)
    {
        DataType const* in = io.inTypes;
        DataType const t = in[kHidden];
        ENGRAM_PLUGIN_CHECK(isFloatIoType(t) && in[kKv] == t,
            "hidden and kv must be both bfloat16, both float16 or both float32, got " << dataTypeName(t) << " and "
                                                                                      << dataTypeName(in[kKv]));
        ENGRAM_PLUGIN_CHECK(isWeightType(in[kQWeight], t) && in[kKWeight] == in[kQWeight],
            "q_weight and k_weight must both be bfloat16, both float32 or both hidden's type ("
                << dataTypeName(t) << "), got " << dataTypeName(in[kQWeight]) << " and " << dataTypeName(in[kKWeight]));
        ENGRAM_PLUGIN_CHECK(isMaskType(in[kMask]), "mask must be bool or int32, got " << dataTypeName(in[kMask]));
    }
    if (io.hasOutputTypes)
    {
        ENGRAM_PLUGIN_CHECK(io.outTypes[0] == io.inTypes[kHidden],
            "hidden, kv and output must share one type (bfloat16, float16 or float32), got "
                << dataTypeName(io.inTypes[kHidden]) << ", " << dataTypeName(io.inTypes[kKv]) << " and "
                << dataTypeName(io.outTypes[0]));
    }
    if (io.hasInputDims)
    {
        int32_t const hc = c.hcMult;
        int32_t const d = c.hiddenSize;
        nvinfer1::Dims const& hidden = io.inDims[kHidden];
        ENGRAM_PLUGIN_CHECK(hidden.nbDims == 3 && dimMatches(hidden.d[1], hc) && dimMatches(hidden.d[2], d),
            "hidden must be [T, " << hc << ", " << d << "], got " << dimsToString(hidden));
        DimText const t{hidden.d[0], "T"};
        nvinfer1::Dims const& kv = io.inDims[kKv];
        int64_t const kvWidth = (static_cast<int64_t>(hc) + 1) * d;
        ENGRAM_PLUGIN_CHECK(kv.nbDims == 2 && dimMatches(kv.d[0], t.value) && dimMatches(kv.d[1], kvWidth),
            "kv must be [" << t << ", " << kvWidth << "], got " << dimsToString(kv));
        for (int32_t i : {kQWeight, kKWeight})
        {
            nvinfer1::Dims const& w = io.inDims[i];
            ENGRAM_PLUGIN_CHECK(w.nbDims == 2 && dimMatches(w.d[0], hc) && dimMatches(w.d[1], d),
                "q_weight / k_weight must be [" << hc << ", " << d << "], got " << dimsToString(w));
        }
        nvinfer1::Dims const& mask = io.inDims[kMask];
        ENGRAM_PLUGIN_CHECK(mask.nbDims == 1 && dimMatches(mask.d[0], t.value),
            "mask must be [" << t << "], got " << dimsToString(mask));
        if (io.hasOutputDims)
        {
            nvinfer1::Dims const& out = io.outDims[0];
            ENGRAM_PLUGIN_CHECK(
                out.nbDims == 3 && dimMatches(out.d[0], t.value) && dimMatches(out.d[1], hc) && dimMatches(out.d[2], d),
                "output must be [T, " << kHcMultName << ", D], got " << dimsToString(out));
        }
    }
}
} // namespace gate_detail

EngramGatePlugin::EngramGatePlugin(GateConfig const& config, nvinfer1::TensorRTPhase phase)
    : EngramPluginBaseT(gate_detail::kFields, config, phase)
{
    gate_detail::checkConfig(mConfig);
}

int32_t EngramGatePlugin::getOutputDataTypes(
    DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes, int32_t nbInputs) const noexcept
{
    ENGRAM_PLUGIN_TRY
    {
        gate_detail::checkIo(mConfig, PluginIo::ofTypes(inputTypes, nbInputs, nbOutputs));
        outputTypes[0] = inputTypes[gate_detail::kHidden]; // hidden's type (the update may be in place)
        return 0;
    }
    ENGRAM_PLUGIN_CATCH(gate_detail::kName, -1);
}

int32_t EngramGatePlugin::getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
    nvinfer1::DimsExprs const* /*shapeInputs*/, int32_t /*nbShapeInputs*/, nvinfer1::DimsExprs* outputs,
    int32_t nbOutputs, nvinfer1::IExprBuilder& /*exprBuilder*/) noexcept
{
    ENGRAM_PLUGIN_TRY
    {
        gate_detail::checkIo(mConfig, PluginIo::ofShapes(inputs, nbInputs, nbOutputs));
        outputs[0] = inputs[gate_detail::kHidden];
        return 0;
    }
    ENGRAM_PLUGIN_CATCH(gate_detail::kName, -1);
}

bool EngramGatePlugin::supportsFormatCombination(
    int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept
{
    if (!isLinearIoAt(pos, inOut, nbInputs, nbOutputs, gate_detail::kNbInputs, 1))
    {
        return false;
    }
    nvinfer1::PluginTensorDesc const& desc = inOut[pos].desc;
    DataType const io = inOut[gate_detail::kHidden].desc.type;
    switch (pos)
    {
    case gate_detail::kHidden: return isFloatIoType(desc.type);
    case gate_detail::kQWeight: return gate_detail::isWeightType(desc.type, io);
    case gate_detail::kKWeight: return desc.type == inOut[gate_detail::kQWeight].desc.type;
    case gate_detail::kMask: return gate_detail::isMaskType(desc.type);
    default: return desc.type == io; // kv, output: hidden's type
    }
}

int32_t EngramGatePlugin::configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
    nvinfer1::DynamicPluginTensorDesc const* /*out*/, int32_t nbOutputs) noexcept
{
    ENGRAM_PLUGIN_TRY
    {
        gate_detail::checkIo(mConfig, PluginIo::ofConfigure(in, nbInputs, nbOutputs));
        return 0;
    }
    ENGRAM_PLUGIN_CATCH(gate_detail::kName, -1);
}

int32_t EngramGatePlugin::enqueue(nvinfer1::PluginTensorDesc const* inputDesc,
    nvinfer1::PluginTensorDesc const* outputDesc, void const* const* inputs, void* const* outputs, void* /*workspace*/,
    cudaStream_t stream) noexcept
{
    ENGRAM_PLUGIN_TRY
    {
        gate_detail::checkIo(mConfig, PluginIo::ofEnqueue(inputDesc, gate_detail::kNbInputs, outputDesc, 1));
        int32_t const hc = mConfig.hcMult;
        int32_t const d = mConfig.hiddenSize;
        int64_t const numTokens = inputDesc[gate_detail::kHidden].dims.d[0];
        DataType const io = inputDesc[gate_detail::kHidden].type;
        DataType const wt = inputDesc[gate_detail::kQWeight].type;
        int32_t const maskType
            = inputDesc[gate_detail::kMask].type == DataType::kINT32 ? ENGRAM_MASK_I32 : ENGRAM_MASK_U8;
        int const status = engram_gate_typed(inputs[gate_detail::kHidden], inputs[gate_detail::kKv], floatTypeCode(io),
            inputs[gate_detail::kQWeight], inputs[gate_detail::kKWeight], floatTypeCode(wt), inputs[gate_detail::kMask],
            maskType, numTokens, hc, d, mConfig.eps, gate_detail::kClamp, outputs[0], stream);
        ENGRAM_PLUGIN_CHECK(status == 0, engram_last_error());
        return 0;
    }
    ENGRAM_PLUGIN_CATCH(gate_detail::kName, -1);
}

EngramGatePluginCreator::EngramGatePluginCreator()
    : EngramCreator(gate_detail::kFields)
{
}

} // namespace plugin
} // namespace engram_trt
