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
        ENGRAM_PLUGIN_CHECK(nbInputs == gate_detail::kNbInputs && nbOutputs == 1,
            "expects 5 inputs (hidden, kv, q_weight, k_weight, mask) and 1 output, got " << nbInputs << " and "
                                                                                         << nbOutputs);
        DataType const io = inputTypes[gate_detail::kHidden];
        ENGRAM_PLUGIN_CHECK(isFloatIoType(io) && inputTypes[gate_detail::kKv] == io,
            "hidden and kv must be both bfloat16, both float16 or both float32, got "
                << dataTypeName(io) << " and " << dataTypeName(inputTypes[gate_detail::kKv]));
        ENGRAM_PLUGIN_CHECK(gate_detail::isWeightType(inputTypes[gate_detail::kQWeight], io)
                && inputTypes[gate_detail::kKWeight] == inputTypes[gate_detail::kQWeight],
            "q_weight and k_weight must both be bfloat16, both float32 or both hidden's type ("
                << dataTypeName(io) << "), got " << dataTypeName(inputTypes[gate_detail::kQWeight]) << " and "
                << dataTypeName(inputTypes[gate_detail::kKWeight]));
        ENGRAM_PLUGIN_CHECK(gate_detail::isMaskType(inputTypes[gate_detail::kMask]),
            "mask must be bool or int32, got " << dataTypeName(inputTypes[gate_detail::kMask]));
        outputTypes[0] = io; // the output is hidden's type (the update may be in place)
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
        ENGRAM_PLUGIN_CHECK(nbInputs == gate_detail::kNbInputs && nbOutputs == 1, "expects 5 inputs and 1 output");
        ENGRAM_PLUGIN_CHECK(
            inputs[gate_detail::kHidden].nbDims == 3, "hidden must be 3-D [T, " << gate_detail::kHcMultName << ", D]");
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
        ENGRAM_PLUGIN_CHECK(nbInputs == gate_detail::kNbInputs && nbOutputs == 1, "expects 5 inputs and 1 output");
        int32_t const hc = mConfig.hcMult;
        int32_t const d = mConfig.hiddenSize;
        nvinfer1::Dims const& hidden = in[gate_detail::kHidden].desc.dims;
        nvinfer1::Dims const& kv = in[gate_detail::kKv].desc.dims;
        ENGRAM_PLUGIN_CHECK(hidden.nbDims == 3 && dimMatches(hidden.d[1], hc) && dimMatches(hidden.d[2], d),
            "hidden must be [T, " << hc << ", " << d << "], got " << dimsToString(hidden));
        int64_t const kvWidth = (static_cast<int64_t>(hc) + 1) * d;
        ENGRAM_PLUGIN_CHECK(kv.nbDims == 2 && dimMatches(kv.d[1], kvWidth),
            "kv must be [T, " << kvWidth << "], got " << dimsToString(kv));
        for (int32_t i : {gate_detail::kQWeight, gate_detail::kKWeight})
        {
            nvinfer1::Dims const& w = in[i].desc.dims;
            ENGRAM_PLUGIN_CHECK(w.nbDims == 2 && dimMatches(w.d[0], hc) && dimMatches(w.d[1], d),
                "q_weight / k_weight must be [" << hc << ", " << d << "], got " << dimsToString(w));
        }
        ENGRAM_PLUGIN_CHECK(in[gate_detail::kMask].desc.dims.nbDims == 1, "mask must be 1-D [T]");
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
        int32_t const hc = mConfig.hcMult;
        int32_t const d = mConfig.hiddenSize;
        nvinfer1::Dims const& hidden = inputDesc[gate_detail::kHidden].dims;
        int64_t const numTokens = hidden.d[0];
        ENGRAM_PLUGIN_CHECK(hidden.nbDims == 3 && hidden.d[1] == hc && hidden.d[2] == d,
            "hidden must be [T, " << hc << ", " << d << "], got " << dimsToString(hidden));
        nvinfer1::Dims const& kv = inputDesc[gate_detail::kKv].dims;
        int64_t const kvWidth = (static_cast<int64_t>(hc) + 1) * d;
        ENGRAM_PLUGIN_CHECK(kv.nbDims == 2 && kv.d[0] == numTokens && kv.d[1] == kvWidth,
            "kv must be [" << numTokens << ", " << kvWidth << "], got " << dimsToString(kv));
        for (int32_t i : {gate_detail::kQWeight, gate_detail::kKWeight})
        {
            nvinfer1::Dims const& w = inputDesc[i].dims;
            ENGRAM_PLUGIN_CHECK(w.nbDims == 2 && w.d[0] == hc && w.d[1] == d,
                "q_weight / k_weight must be [" << hc << ", " << d << "], got " << dimsToString(w));
        }
        nvinfer1::Dims const& mask = inputDesc[gate_detail::kMask].dims;
        ENGRAM_PLUGIN_CHECK(mask.nbDims == 1 && mask.d[0] == numTokens,
            "mask must be [" << numTokens << "], got " << dimsToString(mask));
        nvinfer1::Dims const& out = outputDesc[0].dims;
        ENGRAM_PLUGIN_CHECK(out.nbDims == 3 && out.d[0] == numTokens && out.d[1] == hc && out.d[2] == d,
            "output must be [T, " << gate_detail::kHcMultName << ", D], got " << dimsToString(out));

        DataType const io = inputDesc[gate_detail::kHidden].type;
        ENGRAM_PLUGIN_CHECK(isFloatIoType(io) && inputDesc[gate_detail::kKv].type == io && outputDesc[0].type == io,
            "hidden, kv and output must share one type (bfloat16, float16 or float32), got "
                << dataTypeName(io) << ", " << dataTypeName(inputDesc[gate_detail::kKv].type) << " and "
                << dataTypeName(outputDesc[0].type));
        DataType const wt = inputDesc[gate_detail::kQWeight].type;
        ENGRAM_PLUGIN_CHECK(gate_detail::isWeightType(wt, io) && inputDesc[gate_detail::kKWeight].type == wt,
            "q_weight and k_weight must both be bfloat16, both float32 or both hidden's type");
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
