// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * EngramCausalConv1d (version "1", namespace "engram_trt"): the Gated DeltaNet's causal
 * depthwise short conv over a packed step, continuing each sequence from its slot's conv
 * state. The conv-state output aliases the conv-state input
 * (IPluginV3OneBuildV2::getAliasedInput): the runtime owns the state and the step updates
 * it in place. The math is engram_causal_conv1d() of the kernel library. See README.md.
 */
#ifndef ENGRAM_TRT_CAUSAL_CONV1D_PLUGIN_H
#define ENGRAM_TRT_CAUSAL_CONV1D_PLUGIN_H

#include "common/engramPluginBase.h"

namespace engram_trt
{
namespace plugin
{

struct CausalConv1dConfig
{
    int32_t kernel{0};
    int32_t activation{0};
};

class EngramCausalConv1dPlugin : public EngramAliasingPluginBase<EngramCausalConv1dPlugin, CausalConv1dConfig>
{
public:
    EngramCausalConv1dPlugin(CausalConv1dConfig const& config, nvinfer1::TensorRTPhase phase);

    int32_t getNbOutputs() const noexcept override;
    int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs, nvinfer1::DataType const* inputTypes,
        int32_t nbInputs) const noexcept override;
    int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs, nvinfer1::DimsExprs const* shapeInputs,
        int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
        nvinfer1::IExprBuilder& exprBuilder) noexcept override;
    bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
        int32_t nbOutputs) noexcept override;
    int32_t configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
    //! The states (EngramAliasingPluginBase answers getAliasedInput from them).
    AliasedStates aliasedStates() const;
    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
        void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;
};

class EngramCausalConv1dPluginCreator : public EngramCreator<EngramCausalConv1dPlugin, CausalConv1dConfig>
{
public:
    EngramCausalConv1dPluginCreator();
};

} // namespace plugin
} // namespace engram_trt

#endif // ENGRAM_TRT_CAUSAL_CONV1D_PLUGIN_H
