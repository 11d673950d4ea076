// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * EngramGate (version "1", namespace "engram_trt"): the fused gated residual update over hc_mult streams with
 * the token mask, hidden / kv / output in bf16, fp16 or fp32. The math is
 * engram_gate_typed() of the kernel library. See README.md.
 */
#ifndef ENGRAM_TRT_GATE_PLUGIN_H
#define ENGRAM_TRT_GATE_PLUGIN_H

#include "common/engramPluginBase.h"

namespace engram_trt
{
namespace plugin
{

struct GateConfig
{
    int32_t hcMult{0};
    int32_t hiddenSize{0};
    float eps{0.0F};
};

class EngramGatePlugin : public EngramPluginBase<EngramGatePlugin, GateConfig>
{
public:
    EngramGatePlugin(GateConfig const& config, nvinfer1::TensorRTPhase phase);

    int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs, nvinfer1::DataType const* inputTypes,
        int32_t nbInputs) const noexcept override;
    int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs, nvinfer1::DimsExprs const* shapeInputs,
        int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
        nvinfer1::IExprBuilder& exprBuilder) noexcept override;
    bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
        int32_t nbOutputs) noexcept override;
    int32_t configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
        void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;
};

class EngramGatePluginCreator : public EngramCreator<EngramGatePlugin, GateConfig>
{
public:
    EngramGatePluginCreator();
};

} // namespace plugin
} // namespace engram_trt

#endif // ENGRAM_TRT_GATE_PLUGIN_H
