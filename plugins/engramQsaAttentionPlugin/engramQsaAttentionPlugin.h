// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * EngramQsaAttention (version "1", namespace "engram_trt"): Qwen4-Exp's gated full
 * attention's core with the QSA block indexer over a packed step (the output before the
 * sigmoid(gate) product and o_proj). The three cache outputs alias the cache inputs
 * (IPluginV3OneBuildV2::getAliasedInput): the runtime owns the caches and every step
 * writes its tokens' k, v and raw indexer keys into them in place before attending. The
 * math is engram_qsa_attention() of the kernel library. See README.md.
 */
#ifndef ENGRAM_TRT_QSA_ATTENTION_PLUGIN_H
#define ENGRAM_TRT_QSA_ATTENTION_PLUGIN_H

#include "common/engramPluginBase.h"

namespace engram_trt
{
namespace plugin
{

struct QsaAttentionConfig
{
    int32_t compressRatio{0};
    int32_t blockTopk{0};
    int32_t rotDim{0};
    float ropeTheta{0.0F};
    float eps{0.0F};
    float scaling{0.0F};
};

class EngramQsaAttentionPlugin : public EngramAliasingPluginBase<EngramQsaAttentionPlugin, QsaAttentionConfig>
{
public:
    EngramQsaAttentionPlugin(QsaAttentionConfig const& config, nvinfer1::TensorRTPhase phase);

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

class EngramQsaAttentionPluginCreator : public EngramCreator<EngramQsaAttentionPlugin, QsaAttentionConfig>
{
public:
    EngramQsaAttentionPluginCreator();
};

} // namespace plugin
} // namespace engram_trt

#endif // ENGRAM_TRT_QSA_ATTENTION_PLUGIN_H
