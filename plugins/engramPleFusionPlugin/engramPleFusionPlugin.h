// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * EngramPleFusion (version "1", namespace "engram_trt"): Qwen4-Exp's PLE fusion of a
 * packed step (the sqrt-sign gate of the PLE value by each stream, the grouped norms and
 * the dilated causal convolution over the per-slot history). The conv-history output
 * aliases the conv-history input (IPluginV3OneBuildV2::getAliasedInput): the runtime
 * owns the history and the step updates it in place. The math is engram_ple_fusion() of
 * the kernel library. See README.md.
 */
#ifndef ENGRAM_TRT_PLE_FUSION_PLUGIN_H
#define ENGRAM_TRT_PLE_FUSION_PLUGIN_H

#include "common/engramPluginBase.h"

namespace engram_trt
{
namespace plugin
{

struct PleFusionConfig
{
    int32_t hcCount{0};
    int32_t hidden{0};
    int32_t kernel{0};
    int32_t dilation{0};
    float eps{0.0F};
};

class EngramPleFusionPlugin : public EngramAliasingPluginBase<EngramPleFusionPlugin, PleFusionConfig>
{
public:
    EngramPleFusionPlugin(PleFusionConfig const& config, nvinfer1::TensorRTPhase phase);

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
    size_t getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* outputs, int32_t nbOutputs) const noexcept override;
    //! The states (EngramAliasingPluginBase answers getAliasedInput from them).
    AliasedStates aliasedStates() const;
    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
        void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;
};

class EngramPleFusionPluginCreator : public EngramCreator<EngramPleFusionPlugin, PleFusionConfig>
{
public:
    EngramPleFusionPluginCreator();
};

} // namespace plugin
} // namespace engram_trt

#endif // ENGRAM_TRT_PLE_FUSION_PLUGIN_H
