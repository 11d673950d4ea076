// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
#include "engramAttentionPlugin.h"

#include "common/checkMacros.h"
#include "common/pluginTensors.h"
#include "kernels/attentionKernels.h"
#include "kernels/engramKernelsCore.h"

#include <cuda_runtime_api.h>

#include <climits>
#include <cmath>

namespace engram_trt
{
namespace plugin
{

using nvinfer1::DataType;

namespace attention_detail
{
constexpr char const* kName = "EngramAttention";
constexpr int32_t kQ = 0;
constexpr int32_t kK = 1;
constexpr int32_t kV = 2;
constexpr int32_t kKeyCache = 3;
constexpr int32_t kValueCache = 4;
constexpr int32_t kTokenSlot = 5;
constexpr int32_t kTokenPos = 6;
constexpr int32_t kNbInputs = 7;
constexpr int32_t kOut = 0;
constexpr int32_t kKeyCacheOut = 1;
constexpr int32_t kValueCacheOut = 2;
constexpr int32_t kNbOutputs = 3;

void checkConfig(AttentionConfig const& c)
{
    int const status = engram_attention_check_shape(c.numHeads, c.numKvHeads, c.headDim, c.scale);
    ENGRAM_PLUGIN_CHECK(status == 0, engram_last_error());
}

// The shape across fields (num_heads a multiple of num_kv_heads, head_dim a multiple of
// 8) and the scale are checkConfig's.
constexpr Field<AttentionConfig> kFieldList[] = {
    field<&AttentionConfig::numHeads>("num_heads", 1),
    field<&AttentionConfig::numKvHeads>("num_kv_heads", 1),
    field<&AttentionConfig::headDim>("head_dim", 8, ENGRAM_ATTENTION_MAX_HEAD_DIM),
    field<&AttentionConfig::scale>("scale"),
};
constexpr FieldTable<AttentionConfig> kFields{kName, kFieldList};

// The names the shape messages give, as the table spells them.
constexpr char const* kNumHeadsName = kFields.nameOf<&AttentionConfig::numHeads>();
constexpr char const* kNumKvHeadsName = kFields.nameOf<&AttentionConfig::numKvHeads>();
constexpr char const* kHeadDimName = kFields.nameOf<&AttentionConfig::headDim>();

//! Build-time shape checks (dims may be -1 = dynamic).
void checkDims(AttentionConfig const& c, nvinfer1::Dims const* in, nvinfer1::Dims const* out, int32_t nbOutputs)
{
    nvinfer1::Dims const& q = in[kQ];
    ENGRAM_PLUGIN_CHECK(q.nbDims == 3 && dimMatches(q.d[1], c.numHeads) && dimMatches(q.d[2], c.headDim),
        "q must be [T, " << c.numHeads << ", " << c.headDim << "], got " << dimsToString(q));
    for (int32_t i : {kK, kV})
    {
        nvinfer1::Dims const& x = in[i];
        ENGRAM_PLUGIN_CHECK(x.nbDims == 3 && dimMatches(x.d[1], c.numKvHeads) && dimMatches(x.d[2], c.headDim),
            (i == kK ? "k" : "v") << " must be [T, " << c.numKvHeads << ", " << c.headDim << "], got "
                                  << dimsToString(x));
    }
    for (int32_t i : {kKeyCache, kValueCache})
    {
        nvinfer1::Dims const& x = in[i];
        ENGRAM_PLUGIN_CHECK(x.nbDims == 4 && dimMatches(x.d[1], c.numKvHeads) && dimMatches(x.d[3], c.headDim),
            (i == kKeyCache ? "key_cache" : "value_cache")
                << " must be [num_slots, " << c.numKvHeads << ", max_seq_len, " << c.headDim << "], got "
                << dimsToString(x));
    }
    for (int32_t i : {kTokenSlot, kTokenPos})
    {
        ENGRAM_PLUGIN_CHECK(in[i].nbDims == 1, (i == kTokenSlot ? "token_slot" : "token_pos") << " must be 1-D [T]");
    }
    if (out != nullptr && nbOutputs == kNbOutputs)
    {
        ENGRAM_PLUGIN_CHECK(
            out[kOut].nbDims == 3, "the attention output must be [T, " << kNumHeadsName << ", " << kHeadDimName << "]");
        ENGRAM_PLUGIN_CHECK(out[kKeyCacheOut].nbDims == 4 && out[kValueCacheOut].nbDims == 4,
            "the cache outputs must be 4-D like the caches");
    }
}
} // namespace attention_detail

EngramAttentionPlugin::EngramAttentionPlugin(AttentionConfig const& config, nvinfer1::TensorRTPhase phase)
    : EngramAliasingPluginBase(attention_detail::kFields, config, phase)
{
    attention_detail::checkConfig(mConfig);
}

int32_t EngramAttentionPlugin::getNbOutputs() const noexcept
{
    return attention_detail::kNbOutputs;
}

int32_t EngramAttentionPlugin::getOutputDataTypes(
    DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes, int32_t nbInputs) const noexcept
{
    ENGRAM_PLUGIN_TRY
    {
        using namespace attention_detail;
        ENGRAM_PLUGIN_CHECK(nbInputs == kNbInputs && nbOutputs == kNbOutputs,
            "expects 7 inputs (q, k, v, key_cache, value_cache, token_slot, token_pos) and 3 outputs, got "
                << nbInputs << " and " << nbOutputs);
        DataType const io = inputTypes[kQ];
        ENGRAM_PLUGIN_CHECK(isFloatIoType(io) && inputTypes[kK] == io && inputTypes[kV] == io
                && inputTypes[kKeyCache] == io && inputTypes[kValueCache] == io,
            "q, k, v, key_cache and value_cache must share one type (bfloat16, float16 or float32), got "
                << dataTypeName(io) << ", " << dataTypeName(inputTypes[kK]) << ", " << dataTypeName(inputTypes[kV])
                << ", " << dataTypeName(inputTypes[kKeyCache]) << " and " << dataTypeName(inputTypes[kValueCache]));
        ENGRAM_PLUGIN_CHECK(inputTypes[kTokenSlot] == DataType::kINT32 && inputTypes[kTokenPos] == DataType::kINT32,
            "token_slot and token_pos must be int32, got " << dataTypeName(inputTypes[kTokenSlot]) << " and "
                                                           << dataTypeName(inputTypes[kTokenPos]));
        outputTypes[kOut] = io;
        outputTypes[kKeyCacheOut] = io;
        outputTypes[kValueCacheOut] = io;
        return 0;
    }
    ENGRAM_PLUGIN_CATCH(attention_detail::kName, -1);
}

int32_t EngramAttentionPlugin::getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
    nvinfer1::DimsExprs const* /*shapeInputs*/, int32_t /*nbShapeInputs*/, nvinfer1::DimsExprs* outputs,
    int32_t nbOutputs, nvinfer1::IExprBuilder& /*exprBuilder*/) noexcept
{
    ENGRAM_PLUGIN_TRY
    {
        using namespace attention_detail;
        ENGRAM_PLUGIN_CHECK(nbInputs == kNbInputs && nbOutputs == kNbOutputs, "expects 7 inputs and 3 outputs");
        ENGRAM_PLUGIN_CHECK(
            inputs[kQ].nbDims == 3, "q must be 3-D [T, " << kNumHeadsName << ", " << kHeadDimName << "]");
        ENGRAM_PLUGIN_CHECK(inputs[kKeyCache].nbDims == 4 && inputs[kValueCache].nbDims == 4,
            "key_cache and value_cache must be 4-D [num_slots, " << kNumKvHeadsName << ", max_seq_len, " << kHeadDimName
                                                                 << "]");
        outputs[kOut] = inputs[kQ];
        outputs[kKeyCacheOut] = inputs[kKeyCache];
        outputs[kValueCacheOut] = inputs[kValueCache];
        return 0;
    }
    ENGRAM_PLUGIN_CATCH(attention_detail::kName, -1);
}

bool EngramAttentionPlugin::supportsFormatCombination(
    int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept
{
    using namespace attention_detail;
    if (!isLinearIoAt(pos, inOut, nbInputs, nbOutputs, kNbInputs, kNbOutputs))
    {
        return false;
    }
    nvinfer1::PluginTensorDesc const& desc = inOut[pos].desc;
    switch (pos)
    {
    case kQ: return isFloatIoType(desc.type);
    case kTokenSlot:
    case kTokenPos: return desc.type == DataType::kINT32;
    default: return desc.type == inOut[kQ].desc.type; // k, v, the caches and every output: q's type
    }
}

int32_t EngramAttentionPlugin::configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
    nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept
{
    ENGRAM_PLUGIN_TRY
    {
        using namespace attention_detail;
        ENGRAM_PLUGIN_CHECK(nbInputs == kNbInputs && nbOutputs == kNbOutputs, "expects 7 inputs and 3 outputs");
        nvinfer1::Dims inDims[kNbInputs];
        nvinfer1::Dims outDims[kNbOutputs];
        for (int32_t i = 0; i < kNbInputs; ++i)
        {
            inDims[i] = in[i].desc.dims;
        }
        for (int32_t i = 0; i < kNbOutputs; ++i)
        {
            outDims[i] = out[i].desc.dims;
        }
        checkDims(mConfig, inDims, outDims, nbOutputs);
        return 0;
    }
    ENGRAM_PLUGIN_CATCH(attention_detail::kName, -1);
}

size_t EngramAttentionPlugin::getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
    nvinfer1::DynamicPluginTensorDesc const* /*outputs*/, int32_t /*nbOutputs*/) const noexcept
{
    ENGRAM_PLUGIN_TRY
    {
        using namespace attention_detail;
        ENGRAM_PLUGIN_CHECK(nbInputs == kNbInputs, "expects 7 inputs");
        // The split workspace for the largest step of the profile: its most tokens and the
        // cache's sequence length (static in a serving profile).
        int64_t const maxTokens = inputs[kQ].max.d[0];
        int64_t const maxSeqLen = inputs[kKeyCache].max.d[2];
        size_t bytes = 0;
        int const status = engram_attention_workspace_size(
            maxTokens, mConfig.numHeads, mConfig.numKvHeads, mConfig.headDim, maxSeqLen, &bytes);
        ENGRAM_PLUGIN_CHECK(status == 0, engram_last_error());
        return bytes;
    }
    ENGRAM_PLUGIN_CATCH(attention_detail::kName, 0);
}

AliasedStates EngramAttentionPlugin::aliasedStates() const
{
    // The caches are read-modify-write: each cache output is its cache input's memory.
    using namespace attention_detail;
    static constexpr AliasedState kStates[] = {{kKeyCacheOut, kKeyCache}, {kValueCacheOut, kValueCache}};
    return {kStates, 2};
}

int32_t EngramAttentionPlugin::enqueue(nvinfer1::PluginTensorDesc const* inputDesc,
    nvinfer1::PluginTensorDesc const* outputDesc, void const* const* inputs, void* const* outputs, void* workspace,
    cudaStream_t stream) noexcept
{
    ENGRAM_PLUGIN_TRY
    {
        using namespace attention_detail;
        int32_t const h = mConfig.numHeads;
        int32_t const kvh = mConfig.numKvHeads;
        int32_t const hd = mConfig.headDim;
        nvinfer1::Dims const& q = inputDesc[kQ].dims;
        ENGRAM_PLUGIN_CHECK(q.nbDims == 3 && q.d[1] == h && q.d[2] == hd,
            "q must be [T, " << h << ", " << hd << "], got " << dimsToString(q));
        int64_t const numTokens = q.d[0];
        for (int32_t i : {kK, kV})
        {
            nvinfer1::Dims const& x = inputDesc[i].dims;
            ENGRAM_PLUGIN_CHECK(x.nbDims == 3 && x.d[0] == numTokens && x.d[1] == kvh && x.d[2] == hd,
                (i == kK ? "k" : "v") << " must be [" << numTokens << ", " << kvh << ", " << hd << "], got "
                                      << dimsToString(x));
        }
        nvinfer1::Dims const& cache = inputDesc[kKeyCache].dims;
        ENGRAM_PLUGIN_CHECK(
            cache.nbDims == 4 && cache.d[1] == kvh && cache.d[3] == hd && cache.d[0] >= 1 && cache.d[2] >= 1,
            "key_cache must be [num_slots, " << kvh << ", max_seq_len, " << hd << "], got " << dimsToString(cache));
        int64_t const numSlots = cache.d[0];
        int64_t const maxSeqLen = cache.d[2];
        nvinfer1::Dims const* sameAsCache[]
            = {&inputDesc[kValueCache].dims, &outputDesc[kKeyCacheOut].dims, &outputDesc[kValueCacheOut].dims};
        for (nvinfer1::Dims const* x : sameAsCache)
        {
            ENGRAM_PLUGIN_CHECK(sameDims(*x, cache),
                "value_cache and both cache outputs must match key_cache " << dimsToString(cache) << ", got "
                                                                           << dimsToString(*x));
        }
        for (int32_t i : {kTokenSlot, kTokenPos})
        {
            nvinfer1::Dims const& x = inputDesc[i].dims;
            ENGRAM_PLUGIN_CHECK(x.nbDims == 1 && x.d[0] == numTokens,
                (i == kTokenSlot ? "token_slot" : "token_pos")
                    << " must be [" << numTokens << "], got " << dimsToString(x));
        }
        nvinfer1::Dims const& o = outputDesc[kOut].dims;
        ENGRAM_PLUGIN_CHECK(o.nbDims == 3 && o.d[0] == numTokens && o.d[1] == h && o.d[2] == hd,
            "the attention output must be [" << numTokens << ", " << h << ", " << hd << "], got " << dimsToString(o));
        DataType const io = inputDesc[kQ].type;
        bool sameType = isFloatIoType(io);
        for (int32_t i : {kK, kV, kKeyCache, kValueCache})
        {
            sameType = sameType && inputDesc[i].type == io;
        }
        for (int32_t i = 0; i < kNbOutputs; ++i)
        {
            sameType = sameType && outputDesc[i].type == io;
        }
        ENGRAM_PLUGIN_CHECK(sameType,
            "q, k, v, the caches and the outputs must share one type (bfloat16, float16 "
            "or float32), q is "
                << dataTypeName(io));
        ENGRAM_PLUGIN_CHECK(
            inputDesc[kTokenSlot].type == DataType::kINT32 && inputDesc[kTokenPos].type == DataType::kINT32,
            "token_slot and token_pos must be int32");

        copyStatesUnlessAliased(inputDesc, inputs, outputs, stream);
        size_t workspaceBytes = 0;
        int status = engram_attention_workspace_size(numTokens, h, kvh, hd, maxSeqLen, &workspaceBytes);
        ENGRAM_PLUGIN_CHECK(status == 0, engram_last_error());
        status = engram_attention_step(inputs[kQ], inputs[kK], inputs[kV], floatTypeCode(io),
            static_cast<int32_t const*>(inputs[kTokenSlot]), static_cast<int32_t const*>(inputs[kTokenPos]), numTokens,
            h, kvh, hd, outputs[kKeyCacheOut], outputs[kValueCacheOut], numSlots, maxSeqLen, mConfig.scale, workspace,
            workspace != nullptr ? workspaceBytes : 0, outputs[kOut], stream);
        ENGRAM_PLUGIN_CHECK(status == 0, engram_last_error());
        return 0;
    }
    ENGRAM_PLUGIN_CATCH(attention_detail::kName, -1);
}

EngramAttentionPluginCreator::EngramAttentionPluginCreator()
    : EngramCreator(attention_detail::kFields)
{
}

} // namespace plugin
} // namespace engram_trt
