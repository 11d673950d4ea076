// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * EngramRoutedExperts (version "1", namespace "engram_trt"): a MoE layer's routed experts
 * over a packed step, their weights in the format the checkpoint stores them (FP4 E2M1
 * with ue8m0 scales per 32 inputs, or FP8 E4M3 with block scales): the step's plan on the
 * device, the activations quantized as the published FP8 inference does, the grouped
 * GEMV (decode) or grouped GEMM (prefill) over the stacked experts, the clamped SwiGLU
 * between, and the weighted combine. The same calls engram_trt.native.quant.experts makes,
 * through quantKernels.h. See README.md.
 */
#ifndef ENGRAM_TRT_ROUTED_EXPERTS_PLUGIN_H
#define ENGRAM_TRT_ROUTED_EXPERTS_PLUGIN_H

#include "common/engramPluginBase.h"

namespace engram_trt
{
namespace plugin
{

struct RoutedExpertsConfig
{
    int32_t numExperts{0};
    int32_t topK{0};
    int32_t hidden{0};
    int32_t intermediate{0};
    int32_t weightType{0};
    int32_t scaleType{0};
    int32_t blockN{0};
    int32_t blockK{0};
    float swigluLimit{0.0F};
};

class EngramRoutedExpertsPlugin : public EngramPluginBase<EngramRoutedExpertsPlugin, RoutedExpertsConfig>
{
public:
    EngramRoutedExpertsPlugin(RoutedExpertsConfig const& config, nvinfer1::TensorRTPhase phase);

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
    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
        void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;
};

class EngramRoutedExpertsPluginCreator : public EngramCreator<EngramRoutedExpertsPlugin, RoutedExpertsConfig>
{
public:
    EngramRoutedExpertsPluginCreator();
};

} // namespace plugin
} // namespace engram_trt

#endif // ENGRAM_TRT_ROUTED_EXPERTS_PLUGIN_H
