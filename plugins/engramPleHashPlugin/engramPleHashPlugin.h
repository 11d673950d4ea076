// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * EngramPleHash (version "1", namespace "engram_trt"): raw token ids of packed
 * sequences -> rows of one Qwen4-Exp PLE layer's n-gram table. One plugin instance
 * hashes one PLE layer (the kernel's unit, and each PLE layer's rows feed that layer's
 * own table gather); its constants (multipliers, primes, offsets) are plugin fields,
 * validated and laid out once per plugin (engram_ple_hash_layout_create; clones share
 * it), so enqueue only launches engram_ple_hash_prepared(). See README.md.
 */
#ifndef ENGRAM_TRT_PLE_HASH_PLUGIN_H
#define ENGRAM_TRT_PLE_HASH_PLUGIN_H

#include "common/engramPluginBase.h"
#include "kernels/pleKernels.h"

#include <memory>
#include <vector>

namespace engram_trt
{
namespace plugin
{

struct PleHashLayout
{
    int32_t ngramSize{0}; // N (orders 2..N)
    int32_t headsPerNgram{0};
    int64_t eosId{0};
    int64_t vocabSize{0};
    int64_t tableRows{0};
    std::vector<int64_t> multipliers; // [N]
    std::vector<int64_t> primes;      // [H]
    std::vector<int64_t> offsets;     // [H]: first row of each head in the layer's table

    //! H = (N-1) * heads_per_ngram, in int64 so that no field values can overflow it;
    //! the creator bounds it by ENGRAM_PLE_HASH_MAX_HEADS before the arrays are read.
    int64_t numHeads() const
    {
        return static_cast<int64_t>(ngramSize - 1) * headsPerNgram;
    }
};

class EngramPleHashPlugin : public EngramPluginBase<EngramPleHashPlugin, PleHashLayout>
{
public:
    EngramPleHashPlugin(PleHashLayout layout, nvinfer1::TensorRTPhase phase);

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
    std::shared_ptr<EngramPleHashLayout const> mPrepared;
};

class EngramPleHashPluginCreator : public EngramCreator<EngramPleHashPlugin, PleHashLayout>
{
public:
    EngramPleHashPluginCreator();
};

} // namespace plugin
} // namespace engram_trt

#endif // ENGRAM_TRT_PLE_HASH_PLUGIN_H
