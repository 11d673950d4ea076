// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * EngramDsv4Attention (version "1", namespace "engram_trt"): DeepSeek-V4's attention core
 * (sliding window, HCA compressor, CSA compressor + lightning indexer top-k, sinks) over a
 * packed step, one node per decoder layer. Every per-slot state input has an output that
 * aliases it (IPluginV3OneBuildV2::getAliasedInput): the runtime owns the state and the
 * step updates it in place. The input count follows the field layer_type (sliding 7,
 * HCA 15, CSA 24). The math is engram_dsv4_attention() of the kernel library. README.md.
 */
#ifndef ENGRAM_TRT_DSV4_ATTENTION_PLUGIN_H
#define ENGRAM_TRT_DSV4_ATTENTION_PLUGIN_H

#include "common/engramPluginBase.h"

namespace engram_trt
{
namespace plugin
{

struct Dsv4AttentionConfig
{
    int32_t layerType{0};
    int32_t window{0};
    int32_t compressRate{0};
    int32_t indexTopk{0};
    float scaling{0.0F};
    float eps{0.0F};
    float ropeScale{1.0F};
};

class EngramDsv4AttentionPlugin : public EngramAliasingPluginBase<EngramDsv4AttentionPlugin, Dsv4AttentionConfig>
{
public:
    EngramDsv4AttentionPlugin(Dsv4AttentionConfig const& config, nvinfer1::TensorRTPhase phase);

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

class EngramDsv4AttentionPluginCreator : public EngramCreator<EngramDsv4AttentionPlugin, Dsv4AttentionConfig>
{
public:
    EngramDsv4AttentionPluginCreator();
};

} // namespace plugin
} // namespace engram_trt

#endif // ENGRAM_TRT_DSV4_ATTENTION_PLUGIN_H
