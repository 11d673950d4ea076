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

//! The caches are read-modify-write: each cache output is its cache input's memory.
constexpr AliasedState kStates[]
    = {{kKeyCacheOut, kKeyCache, "key_cache"}, {kValueCacheOut, kValueCache, "value_cache"}};

//! The one check of the I/O every method sees (PluginIo): counts, types, dims (T, num_slots
//! and max_seq_len may be -1 at build time; at enqueue T is q's and every other T equals
//! it), the cache outputs against the caches (the aliasing base's checkAliasedStates).
void checkIo(AttentionConfig const& c, PluginIo const& io)
{
    ENGRAM_PLUGIN_CHECK(io.counts(kNbInputs, kNbOutputs),
        "expects 7 inputs (q, k, v, key_cache, value_cache, token_slot, token_pos) and 3 outputs, got "
            << io.nbInputs << " and " << io.nbOutputs);
    if (io.hasInputTypes)
    {
        DataType const* in = io.inTypes;
        DataType const t = in[kQ];
        ENGRAM_PLUGIN_CHECK(
            isFloatIoType(t) && in[kK] == t && in[kV] == t && in[kKeyCache] == t && in[kValueCache] == t,
            "q, k, v, key_cache and value_cache must share one type (bfloat16, float16 or float32), got "
                << dataTypeName(t) << ", " << dataTypeName(in[kK]) << ", " << dataTypeName(in[kV]) << ", "
                << dataTypeName(in[kKeyCache]) << " and " << dataTypeName(in[kValueCache]));
        ENGRAM_PLUGIN_CHECK(in[kTokenSlot] == DataType::kINT32 && in[kTokenPos] == DataType::kINT32,
            "token_slot and token_pos must be int32, got " << dataTypeName(in[kTokenSlot]) << " and "
                                                           << dataTypeName(in[kTokenPos]));
    }
    if (io.hasOutputTypes)
    {
        ENGRAM_PLUGIN_CHECK(io.outTypes[kOut] == io.inTypes[kQ],
            "q, k, v, the caches and the outputs must share one type (bfloat16, float16 or float32), q is "
                << dataTypeName(io.inTypes[kQ]));
    }
    if (io.hasInputDims)
    {
        nvinfer1::Dims const* in = io.inDims;
        nvinfer1::Dims const& q = in[kQ];
        ENGRAM_PLUGIN_CHECK(q.nbDims == 3 && dimMatches(q.d[1], c.numHeads) && dimMatches(q.d[2], c.headDim),
            "q must be [T, " << c.numHeads << ", " << c.headDim << "], got " << dimsToString(q));
        DimText const t(q.d[0], "T");
        for (int32_t i : {kK, kV})
        {
            nvinfer1::Dims const& x = in[i];
            ENGRAM_PLUGIN_CHECK(x.nbDims == 3 && dimMatches(x.d[0], t.value) && dimMatches(x.d[1], c.numKvHeads)
                    && dimMatches(x.d[2], c.headDim),
                (i == kK ? "k" : "v") << " must be [" << t << ", " << c.numKvHeads << ", " << c.headDim << "], got "
                                      << dimsToString(x));
        }
        nvinfer1::Dims const& cache = in[kKeyCache];
        ENGRAM_PLUGIN_CHECK(cache.nbDims == 4 && dimMatches(cache.d[1], c.numKvHeads)
                && dimMatches(cache.d[3], c.headDim) && dimAtLeast(cache.d[0], 1) && dimAtLeast(cache.d[2], 1),
            "key_cache must be [num_slots, " << c.numKvHeads << ", max_seq_len, " << c.headDim << "], got "
                                             << dimsToString(cache));
        ENGRAM_PLUGIN_CHECK(dimsMatch(in[kValueCache], cache),
            "value_cache and both cache outputs must match key_cache " << dimsToString(cache) << ", got "
                                                                       << dimsToString(in[kValueCache]));
        for (int32_t i : {kTokenSlot, kTokenPos})
        {
            nvinfer1::Dims const& x = in[i];
            ENGRAM_PLUGIN_CHECK(x.nbDims == 1 && dimMatches(x.d[0], t.value),
                (i == kTokenSlot ? "token_slot" : "token_pos") << " must be [" << t << "], got " << dimsToString(x));
        }
        if (io.hasOutputDims)
        {
            nvinfer1::Dims const& o = io.outDims[kOut];
            ENGRAM_PLUGIN_CHECK(o.nbDims == 3 && dimMatches(o.d[0], t.value) && dimMatches(o.d[1], c.numHeads)
                    && dimMatches(o.d[2], c.headDim),
                "the attention output must be [" << t << ", " << c.numHeads << ", " << c.headDim << "], got "
                                                 << dimsToString(o));
        }
    }
    checkAliasedStates(statesOf(kStates), io);
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
        checkIo(mConfig, PluginIo::ofTypes(inputTypes, nbInputs, nbOutputs));
        DataType const io = inputTypes[kQ];
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
        checkIo(mConfig, PluginIo::ofShapes(inputs, nbInputs, nbOutputs));
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
    nvinfer1::DynamicPluginTensorDesc const* /*out*/, int32_t nbOutputs) noexcept
{
    ENGRAM_PLUGIN_TRY
    {
        using namespace attention_detail;
        checkIo(mConfig, PluginIo::ofConfigure(in, nbInputs, nbOutputs));
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
    return statesOf(attention_detail::kStates);
}

int32_t EngramAttentionPlugin::enqueue(nvinfer1::PluginTensorDesc const* inputDesc,
    nvinfer1::PluginTensorDesc const* outputDesc, void const* const* inputs, void* const* outputs, void* workspace,
    cudaStream_t stream) noexcept
{
    ENGRAM_PLUGIN_TRY
    {
        using namespace attention_detail;
        checkIo(mConfig, PluginIo::ofEnqueue(inputDesc, kNbInputs, outputDesc, kNbOutputs));
        int32_t const h = mConfig.numHeads;
        int32_t const kvh = mConfig.numKvHeads;
        int32_t const hd = mConfig.headDim;
        int64_t const numTokens = inputDesc[kQ].dims.d[0];
        int64_t const numSlots = inputDesc[kKeyCache].dims.d[0];
        int64_t const maxSeqLen = inputDesc[kKeyCache].dims.d[2];
        DataType const io = inputDesc[kQ].type;

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
