// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * EngramAttention (version "1"): one serving step of attention over a slot-indexed KV
 * cache: the packed tokens' K/V are written into the caches in place, then every token
 * attends (causal, grouped-query) to its slot's keys 0 .. its position. The cache
 * outputs alias the cache inputs (IPluginV3OneBuildV2::getAliasedInput). The math is
 * engram_attention_step() of the kernel library. See README.md.
 */
#ifndef ENGRAM_TRT_ATTENTION_PLUGIN_H
#define ENGRAM_TRT_ATTENTION_PLUGIN_H

#include "common/engramPluginBase.h"

namespace engram_trt
{
namespace plugin
{

struct AttentionConfig
{
    int32_t numHeads{0};
    int32_t numKvHeads{0};
    int32_t headDim{0};
    float scale{0.0F};
};

class EngramAttentionPlugin : public EngramAliasingPluginBase<EngramAttentionPlugin, AttentionConfig>
{
public:
    EngramAttentionPlugin(AttentionConfig const& config, nvinfer1::TensorRTPhase phase);

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

class EngramAttentionPluginCreator : public EngramCreator<EngramAttentionPlugin, AttentionConfig>
{
public:
    EngramAttentionPluginCreator();
};

} // namespace plugin
} // namespace engram_trt

#endif // ENGRAM_TRT_ATTENTION_PLUGIN_H
