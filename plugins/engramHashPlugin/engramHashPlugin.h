// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * EngramHash (version "1", namespace "engram_trt"): compressed token ids of packed
 * sequences -> table row ids. The layout (primes, offsets, multipliers) is carried in
 * plugin fields and prepared once per plugin (engram_hash_layout_create: validated and
 * laid out as the kernel's parameter), so enqueue only launches engram_hash_prepared().
 * See README.md.
 */
#ifndef ENGRAM_TRT_HASH_PLUGIN_H
#define ENGRAM_TRT_HASH_PLUGIN_H

#include "common/engramPluginBase.h"
#include "kernels/hashKernels.h"

#include <memory>
#include <vector>

namespace engram_trt
{
namespace plugin
{

struct HashLayout
{
    int32_t numLayers{0};
    int32_t maxNgram{0}; // N
    int32_t numHeads{0};
    int64_t padId{0};
    int64_t compressedVocabSize{0};
    std::vector<int64_t> primes;      // [L, N-1, H]
    std::vector<int64_t> offsets;     // [L, (N-1)*H]
    std::vector<int64_t> multipliers; // [L, N]

    //! (N-1) * H, in int64 so that no field values can overflow it; the creator bounds
    //! numLayers * numCols() by ENGRAM_HASH_MAX_SLOTS.
    int64_t numCols() const
    {
        return static_cast<int64_t>(maxNgram - 1) * numHeads;
    }
};

class EngramHashPlugin : public EngramPluginBase<EngramHashPlugin, HashLayout>
{
public:
    EngramHashPlugin(HashLayout layout, nvinfer1::TensorRTPhase phase);

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

private:
    //! The prepared layout: immutable, so clones (one per execution context) share it.
    std::shared_ptr<EngramHashLayout const> mPrepared;
};

class EngramHashPluginCreator : public EngramCreator<EngramHashPlugin, HashLayout>
{
public:
    EngramHashPluginCreator();
};

} // namespace plugin
} // namespace engram_trt

#endif // ENGRAM_TRT_HASH_PLUGIN_H
