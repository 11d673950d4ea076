// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
#include "engramQsaAttentionPlugin.h"

#include "common/checkMacros.h"
#include "common/pluginTensors.h"
#include "kernels/engramKernelsCore.h"
#include "kernels/qsaKernels.h"

#include <cuda_runtime_api.h>

#include <climits>

namespace engram_trt
{
namespace plugin
{

using nvinfer1::DataType;

namespace qsa_detail
{
constexpr char const* kName = "EngramQsaAttention";
constexpr int32_t kQ = 0;
constexpr int32_t kK = 1;
constexpr int32_t kV = 2;
constexpr int32_t kIndexQ = 3;
constexpr int32_t kIndexRaw = 4;
constexpr int32_t kKeyCache = 5;
constexpr int32_t kValueCache = 6;
constexpr int32_t kIndexKeyCache = 7;
constexpr int32_t kNormWeight = 8;
constexpr int32_t kTokenSlot = 9;
constexpr int32_t kTokenPos = 10;
constexpr int32_t kNbInputs = 11;
constexpr int32_t kOut = 0;
constexpr int32_t kKeyCacheOut = 1;
constexpr int32_t kValueCacheOut = 2;
constexpr int32_t kIndexKeyCacheOut = 3;
constexpr int32_t kNbOutputs = 4;

// Bounds of single fields; the checks across fields ((block_topk + 1) * compress_ratio,
// rot_dim even, the float fields) are the kernel library's (checkConfig).
constexpr Field<QsaAttentionConfig> kFieldList[] = {
    field<&QsaAttentionConfig::compressRatio>("compress_ratio", 1, ENGRAM_QSA_MAX_VISIBLE),
    field<&QsaAttentionConfig::blockTopk>("block_topk", 1, ENGRAM_QSA_MAX_VISIBLE),
    field<&QsaAttentionConfig::rotDim>("rot_dim", 0, ENGRAM_QSA_MAX_HEAD_DIM),
    field<&QsaAttentionConfig::ropeTheta>("rope_theta"),
    field<&QsaAttentionConfig::eps>("eps"),
    field<&QsaAttentionConfig::scaling>("scaling"),
};
constexpr FieldTable<QsaAttentionConfig> kFields{kName, kFieldList};

constexpr char const* kRotDimName = kFields.nameOf<&QsaAttentionConfig::rotDim>();

void checkConfig(QsaAttentionConfig const& c)
{
    int const status = engram_qsa_check_fields(c.compressRatio, c.blockTopk, c.rotDim, c.ropeTheta, c.eps, c.scaling);
    ENGRAM_PLUGIN_CHECK(status == 0, engram_last_error());
}

char const* const kInputNames[kNbInputs] = {"q", "k", "v", "index_q", "index_raw", "key_cache", "value_cache",
    "index_key_cache", "index_k_norm_weight", "token_slot", "token_pos"};

//! Shape checks at build time (dims may be -1) and at enqueue (concrete dims): ranks,
//! the dims the inputs share, and the kernel library's limits once the dims are known.
void checkDims(QsaAttentionConfig const& c, nvinfer1::Dims const* in)
{
    nvinfer1::Dims const& q = in[kQ];
    nvinfer1::Dims const& kc = in[kKeyCache];
    nvinfer1::Dims const& iq = in[kIndexQ];
    ENGRAM_PLUGIN_CHECK(q.nbDims == 3, "q must be [T, num_heads, head_dim], got " << dimsToString(q));
    ENGRAM_PLUGIN_CHECK(kc.nbDims == 4 && dimMatches(kc.d[3], q.d[2]),
        "key_cache must be [num_slots, num_kv_heads, max_len, head_dim = " << q.d[2] << "], got " << dimsToString(kc));
    ENGRAM_PLUGIN_CHECK(iq.nbDims == 3, "index_q must be [T, index_heads, index_dim], got " << dimsToString(iq));
    int64_t const t = q.d[0];
    for (int32_t i : {kK, kV})
    {
        nvinfer1::Dims const& x = in[i];
        ENGRAM_PLUGIN_CHECK(
            x.nbDims == 3 && dimMatches(x.d[0], t) && dimMatches(x.d[1], kc.d[1]) && dimMatches(x.d[2], q.d[2]),
            kInputNames[i] << " must be [T, num_kv_heads = " << kc.d[1] << ", head_dim = " << q.d[2] << "], got "
                           << dimsToString(x));
    }
    nvinfer1::Dims const& vc = in[kValueCache];
    bool sameCache = vc.nbDims == 4;
    for (int32_t k = 0; sameCache && k < 4; ++k)
    {
        sameCache = dimMatches(vc.d[k], kc.d[k]);
    }
    ENGRAM_PLUGIN_CHECK(
        sameCache, "value_cache must match key_cache " << dimsToString(kc) << ", got " << dimsToString(vc));
    int64_t const di = iq.d[2];
    ENGRAM_PLUGIN_CHECK(dimMatches(iq.d[0], t), "index_q must have q's T tokens, got " << dimsToString(iq));
    nvinfer1::Dims const& raw = in[kIndexRaw];
    ENGRAM_PLUGIN_CHECK(raw.nbDims == 2 && dimMatches(raw.d[0], t) && dimMatches(raw.d[1], di),
        "index_raw must be [T, index_dim = " << di << "], got " << dimsToString(raw));
    nvinfer1::Dims const& ic = in[kIndexKeyCache];
    ENGRAM_PLUGIN_CHECK(
        ic.nbDims == 3 && dimMatches(ic.d[0], kc.d[0]) && dimMatches(ic.d[1], kc.d[2]) && dimMatches(ic.d[2], di),
        "index_key_cache must be [num_slots = " << kc.d[0] << ", max_len = " << kc.d[2] << ", index_dim = " << di
                                                << "], got " << dimsToString(ic));
    nvinfer1::Dims const& w = in[kNormWeight];
    ENGRAM_PLUGIN_CHECK(w.nbDims == 1 && dimMatches(w.d[0], di),
        "index_k_norm_weight must be [index_dim = " << di << "], got " << dimsToString(w));
    for (int32_t i : {kTokenSlot, kTokenPos})
    {
        ENGRAM_PLUGIN_CHECK(in[i].nbDims == 1 && dimMatches(in[i].d[0], t),
            kInputNames[i] << " must be [T], got " << dimsToString(in[i]));
    }
    if (q.d[1] != -1 && q.d[2] != -1 && kc.d[1] != -1 && iq.d[1] != -1 && di != -1)
    {
        ENGRAM_PLUGIN_CHECK(q.d[1] <= INT32_MAX && q.d[2] <= INT32_MAX && kc.d[1] <= INT32_MAX && iq.d[1] <= INT32_MAX
                && di <= INT32_MAX,
            "head counts and dims must fit int32");
        int const status = engram_qsa_check_shape(static_cast<int32_t>(q.d[1]), static_cast<int32_t>(kc.d[1]),
            static_cast<int32_t>(q.d[2]), static_cast<int32_t>(iq.d[1]), static_cast<int32_t>(di), c.rotDim);
        ENGRAM_PLUGIN_CHECK(status == 0, engram_last_error() << " (" << kRotDimName << " " << c.rotDim << ")");
    }
}

//! The caches are read-modify-write: each cache output is its cache input's memory.
constexpr AliasedState kStates[] = {{kKeyCacheOut, kKeyCache, "key_cache"},
    {kValueCacheOut, kValueCache, "value_cache"}, {kIndexKeyCacheOut, kIndexKeyCache, "index_key_cache"}};

//! The one check of the I/O every method sees (PluginIo): counts, types, dims (T, the
//! head counts and the cache's dims may be -1 at build time), the output's shape and the
//! cache outputs against the caches (the aliasing base's checkAliasedStates).
void checkIo(QsaAttentionConfig const& c, PluginIo const& io)
{
    ENGRAM_PLUGIN_CHECK(io.counts(kNbInputs, kNbOutputs),
        "expects 11 inputs (q, k, v, index_q, index_raw, key_cache, value_cache, index_key_cache, "
        "index_k_norm_weight, token_slot, token_pos) and 4 outputs, got "
            << io.nbInputs << " and " << io.nbOutputs);
    if (io.hasInputTypes)
    {
        DataType const* in = io.inTypes;
        DataType const t = in[kQ];
        ENGRAM_PLUGIN_CHECK(isFloatIoType(t), "q must be bfloat16, float16 or float32, got " << dataTypeName(t));
        for (int32_t i : {kK, kV, kIndexQ, kIndexRaw, kKeyCache, kValueCache, kIndexKeyCache})
        {
            ENGRAM_PLUGIN_CHECK(in[i] == t,
                kInputNames[i] << " must be q's type " << dataTypeName(t) << ", got " << dataTypeName(in[i]));
        }
        DataType const wt = in[kNormWeight];
        ENGRAM_PLUGIN_CHECK(wt == DataType::kFLOAT || wt == t,
            "index_k_norm_weight must be float32 or q's type " << dataTypeName(t) << ", got " << dataTypeName(wt));
        for (int32_t i : {kTokenSlot, kTokenPos})
        {
            ENGRAM_PLUGIN_CHECK(
                in[i] == DataType::kINT32, kInputNames[i] << " must be int32, got " << dataTypeName(in[i]));
        }
    }
    if (io.hasOutputTypes)
    {
        ENGRAM_PLUGIN_CHECK(io.outTypes[kOut] == io.inTypes[kQ],
            "the activations, the caches and the outputs must share one type (bfloat16, float16 or float32), q is "
                << dataTypeName(io.inTypes[kQ]));
    }
    if (io.hasInputDims)
    {
        nvinfer1::Dims const* in = io.inDims;
        checkDims(c, in);
        if (io.hasOutputDims)
        {
            nvinfer1::Dims const& q = in[kQ];
            int64_t const width = q.d[1] == -1 || q.d[2] == -1 ? -1 : q.d[1] * q.d[2];
            nvinfer1::Dims const& o = io.outDims[kOut];
            ENGRAM_PLUGIN_CHECK(o.nbDims == 2 && dimMatches(o.d[0], q.d[0]) && dimMatches(o.d[1], width),
                "the output must be [" << DimText(q.d[0], "T") << ", " << DimText(width, "num_heads * head_dim")
                                       << "], got " << dimsToString(o));
        }
    }
    checkAliasedStates(statesOf(kStates), io);
}

} // namespace qsa_detail

EngramQsaAttentionPlugin::EngramQsaAttentionPlugin(QsaAttentionConfig const& config, nvinfer1::TensorRTPhase phase)
    : EngramAliasingPluginBase(qsa_detail::kFields, config, phase)
{
    qsa_detail::checkConfig(mConfig);
}

int32_t EngramQsaAttentionPlugin::getNbOutputs() const noexcept
{
    return qsa_detail::kNbOutputs;
}

int32_t EngramQsaAttentionPlugin::getOutputDataTypes(
    DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes, int32_t nbInputs) const noexcept
{
    ENGRAM_PLUGIN_TRY
    {
        using namespace qsa_detail;
        checkIo(mConfig, PluginIo::ofTypes(inputTypes, nbInputs, nbOutputs));
        DataType const io = inputTypes[kQ];
        for (int32_t i = 0; i < kNbOutputs; ++i)
        {
            outputTypes[i] = io;
        }
        return 0;
    }
    ENGRAM_PLUGIN_CATCH(qsa_detail::kName, -1);
}

int32_t EngramQsaAttentionPlugin::getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
    nvinfer1::DimsExprs const* /*shapeInputs*/, int32_t /*nbShapeInputs*/, nvinfer1::DimsExprs* outputs,
    int32_t nbOutputs, nvinfer1::IExprBuilder& exprBuilder) noexcept
{
    ENGRAM_PLUGIN_TRY
    {
        using namespace qsa_detail;
        checkIo(mConfig, PluginIo::ofShapes(inputs, nbInputs, nbOutputs));
        outputs[kOut].nbDims = 2;
        outputs[kOut].d[0] = inputs[kQ].d[0];
        outputs[kOut].d[1]
            = exprBuilder.operation(nvinfer1::DimensionOperation::kPROD, *inputs[kQ].d[1], *inputs[kQ].d[2]);
        outputs[kKeyCacheOut] = inputs[kKeyCache];
        outputs[kValueCacheOut] = inputs[kValueCache];
        outputs[kIndexKeyCacheOut] = inputs[kIndexKeyCache];
        return 0;
    }
    ENGRAM_PLUGIN_CATCH(qsa_detail::kName, -1);
}

bool EngramQsaAttentionPlugin::supportsFormatCombination(
    int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept
{
    using namespace qsa_detail;
    if (!isLinearIoAt(pos, inOut, nbInputs, nbOutputs, kNbInputs, kNbOutputs))
    {
        return false;
    }
    nvinfer1::PluginTensorDesc const& desc = inOut[pos].desc;
    DataType const io = inOut[kQ].desc.type;
    switch (pos)
    {
    case kQ: return isFloatIoType(desc.type);
    case kNormWeight: return desc.type == DataType::kFLOAT || desc.type == io;
    case kTokenSlot:
    case kTokenPos: return desc.type == DataType::kINT32;
    default: return desc.type == io; // the activations, the caches and every output
    }
}

int32_t EngramQsaAttentionPlugin::configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
    nvinfer1::DynamicPluginTensorDesc const* /*out*/, int32_t nbOutputs) noexcept
{
    ENGRAM_PLUGIN_TRY
    {
        qsa_detail::checkIo(mConfig, PluginIo::ofConfigure(in, nbInputs, nbOutputs));
        return 0;
    }
    ENGRAM_PLUGIN_CATCH(qsa_detail::kName, -1);
}

size_t EngramQsaAttentionPlugin::getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
    nvinfer1::DynamicPluginTensorDesc const* /*outputs*/, int32_t /*nbOutputs*/) const noexcept
{
    ENGRAM_PLUGIN_TRY
    {
        using namespace qsa_detail;
        ENGRAM_PLUGIN_CHECK(nbInputs == kNbInputs, "expects 11 inputs");
        // The block scores of the profile's largest step (its most tokens, the cache's
        // length: static in a serving profile).
        size_t bytes = 0;
        int const status = engram_qsa_workspace_size(
            inputs[kQ].max.d[0], inputs[kKeyCache].max.d[2], mConfig.compressRatio, mConfig.blockTopk, &bytes);
        ENGRAM_PLUGIN_CHECK(status == 0, engram_last_error());
        return bytes;
    }
    ENGRAM_PLUGIN_CATCH(qsa_detail::kName, 0);
}

AliasedStates EngramQsaAttentionPlugin::aliasedStates() const
{
    return statesOf(qsa_detail::kStates);
}

int32_t EngramQsaAttentionPlugin::enqueue(nvinfer1::PluginTensorDesc const* inputDesc,
    nvinfer1::PluginTensorDesc const* outputDesc, void const* const* inputs, void* const* outputs, void* workspace,
    cudaStream_t stream) noexcept
{
    ENGRAM_PLUGIN_TRY
    {
        using namespace qsa_detail;
        checkIo(mConfig, PluginIo::ofEnqueue(inputDesc, kNbInputs, outputDesc, kNbOutputs));
        nvinfer1::Dims dims[kNbInputs];
        copyDims(inputDesc, kNbInputs, dims);
        nvinfer1::Dims const& q = dims[kQ];
        nvinfer1::Dims const& kc = dims[kKeyCache];
        int64_t const numTokens = q.d[0];
        DataType const io = inputDesc[kQ].type;
        DataType const wt = inputDesc[kNormWeight].type;

        copyStatesUnlessAliased(inputDesc, inputs, outputs, stream);
        size_t workspaceBytes = 0;
        int status
            = engram_qsa_workspace_size(numTokens, kc.d[2], mConfig.compressRatio, mConfig.blockTopk, &workspaceBytes);
        ENGRAM_PLUGIN_CHECK(status == 0, engram_last_error());
        status = engram_qsa_attention(inputs[kQ], inputs[kK], inputs[kV], inputs[kIndexQ], inputs[kIndexRaw],
            floatTypeCode(io), outputs[kKeyCacheOut], outputs[kValueCacheOut], outputs[kIndexKeyCacheOut],
            inputs[kNormWeight], floatTypeCode(wt), static_cast<int32_t const*>(inputs[kTokenSlot]),
            static_cast<int32_t const*>(inputs[kTokenPos]), numTokens, static_cast<int32_t>(q.d[1]),
            static_cast<int32_t>(kc.d[1]), static_cast<int32_t>(q.d[2]), static_cast<int32_t>(dims[kIndexQ].d[1]),
            static_cast<int32_t>(dims[kIndexQ].d[2]), kc.d[0], kc.d[2], mConfig.compressRatio, mConfig.blockTopk,
            mConfig.rotDim, mConfig.ropeTheta, mConfig.eps, mConfig.scaling, workspace,
            workspace != nullptr ? workspaceBytes : 0, outputs[kOut], stream);
        ENGRAM_PLUGIN_CHECK(status == 0, engram_last_error());
        return 0;
    }
    ENGRAM_PLUGIN_CATCH(qsa_detail::kName, -1);
}

EngramQsaAttentionPluginCreator::EngramQsaAttentionPluginCreator()
    : EngramCreator(qsa_detail::kFields)
{
}

} // namespace plugin
} // namespace engram_trt
