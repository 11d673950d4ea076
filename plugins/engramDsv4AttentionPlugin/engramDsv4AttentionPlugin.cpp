// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
#include "engramDsv4AttentionPlugin.h"

#include "common/checkMacros.h"
#include "common/pluginTensors.h"
#include "kernels/dsv4AttentionKernels.h"
#include "kernels/engramKernelsCore.h"

#include <cuda_runtime_api.h>

#include <initializer_list>

namespace engram_trt
{
namespace plugin
{

using nvinfer1::DataType;

namespace dsv4_detail
{
constexpr char const* kName = "EngramDsv4Attention";
constexpr int32_t kMaxInputs = 24;
constexpr int32_t kWindowKv = 6;

constexpr Field<Dsv4AttentionConfig> kFieldList[] = {
    field<&Dsv4AttentionConfig::layerType>("layer_type", ENGRAM_DSV4_SLIDING, ENGRAM_DSV4_HCA),
    field<&Dsv4AttentionConfig::window>("window", 1, 65535),
    field<&Dsv4AttentionConfig::compressRate>("compress_rate", 0, 32768).optional(),
    field<&Dsv4AttentionConfig::indexTopk>("index_topk", 0).optional(),
    field<&Dsv4AttentionConfig::scaling>("scaling"),
    field<&Dsv4AttentionConfig::eps>("eps").optional(),
    field<&Dsv4AttentionConfig::ropeScale>("rope_scale").optional([](Dsv4AttentionConfig const&) -> int64_t {
        return 1;
    }),
};
constexpr FieldTable<Dsv4AttentionConfig> kFields{kName, kFieldList};

enum Kind
{
    kAct,
    kF32,
    kI32
};

struct InputSpec
{
    char const* name;
    Kind kind;
    int32_t rank;
    bool state; // updated in place, with an aliased output
};

constexpr InputSpec kInputs[kMaxInputs]
    = {{"q", kAct, 3, false}, {"kv", kAct, 2, false}, {"sinks", kF32, 1, false}, {"seq_starts", kI32, 1, false},
        {"past_lens", kI32, 1, false}, {"slots", kI32, 1, false}, {"window_kv", kAct, 3, true},
        {"c_kv", kAct, 2, false}, {"c_gate", kAct, 2, false}, {"c_bias", kF32, 2, false}, {"c_norm", kF32, 1, false},
        {"inv_freq", kF32, 1, false}, {"compressed_kv", kAct, 3, true}, {"compressor_kv", kAct, 3, true},
        {"compressor_gate", kAct, 3, true}, {"index_q", kAct, 3, false}, {"index_w", kF32, 2, false},
        {"i_kv", kAct, 2, false}, {"i_gate", kAct, 2, false}, {"i_bias", kF32, 2, false}, {"i_norm", kF32, 1, false},
        {"index_keys", kAct, 3, true}, {"indexer_kv", kAct, 3, true}, {"indexer_gate", kAct, 3, true}};

int32_t nbInputsOf(int32_t layerType)
{
    return layerType == ENGRAM_DSV4_SLIDING ? 7 : layerType == ENGRAM_DSV4_HCA ? 15 : kMaxInputs;
}

//! The state inputs of a layer type in order; output 1 + i aliases stateInput(i).
int32_t nbStates(int32_t layerType)
{
    return layerType == ENGRAM_DSV4_SLIDING ? 1 : layerType == ENGRAM_DSV4_HCA ? 4 : 7;
}

constexpr AliasedState kStates[] = {{1, 6, "window_kv"}, {2, 12, "compressed_kv"}, {3, 13, "compressor_kv"},
    {4, 14, "compressor_gate"}, {5, 21, "index_keys"}, {6, 22, "indexer_kv"}, {7, 23, "indexer_gate"}};

int32_t stateInput(int32_t i)
{
    return kStates[i].input;
}

int64_t times(int64_t a, int64_t k)
{
    return a == -1 ? -1 : a * k;
}

int64_t plus(int64_t a, int64_t k)
{
    return a == -1 ? -1 : a + k;
}

void expectDims(nvinfer1::Dims const* in, int32_t i, std::initializer_list<int64_t> want)
{
    nvinfer1::Dims const& got = in[i];
    bool ok = got.nbDims == static_cast<int32_t>(want.size());
    int32_t k = 0;
    for (int64_t w : want)
    {
        ok = ok && dimMatches(got.d[k], w);
        ++k;
    }
    if (!ok)
    {
        std::string text = "[";
        k = 0;
        for (int64_t w : want)
        {
            text += (k++ ? ", " : "") + (w == -1 ? std::string("?") : std::to_string(w));
        }
        ENGRAM_PLUGIN_CHECK(false, kInputs[i].name << " must be " << text << "], got " << dimsToString(got));
    }
}

//! A layer type's states: the first nbStates of the table.
AliasedStates statesOfLayer(int32_t layerType)
{
    return {kStates, nbStates(layerType)};
}

bool typeOk(int32_t pos, DataType type, DataType io)
{
    switch (kInputs[pos].kind)
    {
    case kAct: return pos == 0 ? isFloatIoType(type) : type == io;
    case kF32: return type == DataType::kFLOAT;
    default: return type == DataType::kINT32;
    }
}

//! The input dims every layer type shares and those of its compressor / indexer, each
//! against the others (dims may be -1 at build time: those match anything).
void checkDims(Dsv4AttentionConfig const& c, nvinfer1::Dims const* in, int32_t nbInputs)
{
    for (int32_t i = 0; i < nbInputs; ++i)
    {
        ENGRAM_PLUGIN_CHECK(in[i].nbDims == kInputs[i].rank,
            kInputs[i].name << " must be " << kInputs[i].rank << "-D, got " << dimsToString(in[i]));
    }
    bool const csa = c.layerType == ENGRAM_DSV4_CSA;
    int64_t const T = in[0].d[0];
    int64_t const H = in[0].d[1];
    int64_t const d = in[0].d[2];
    int64_t const S = in[4].d[0];
    int64_t const N = in[kWindowKv].d[0];
    expectDims(in, 1, {T, d});
    expectDims(in, 2, {H});
    expectDims(in, 3, {plus(S, 1)});
    expectDims(in, 5, {S});
    expectDims(in, kWindowKv, {N, c.window, d});
    if (c.layerType == ENGRAM_DSV4_SLIDING)
    {
        return;
    }
    int64_t const r = c.compressRate;
    int64_t const w = csa ? times(d, 2) : d;
    int64_t const R = csa ? 2 * r : r;
    int64_t const E = in[12].d[1];
    expectDims(in, 7, {T, w});
    expectDims(in, 8, {T, w});
    expectDims(in, 9, {r, w});
    expectDims(in, 10, {d});
    expectDims(in, 12, {N, E, d});
    expectDims(in, 13, {N, R, w});
    expectDims(in, 14, {N, R, w});
    if (!csa)
    {
        return;
    }
    int64_t const NI = in[15].d[1];
    int64_t const di = in[15].d[2];
    expectDims(in, 15, {T, NI, di});
    expectDims(in, 16, {T, NI});
    expectDims(in, 17, {T, times(di, 2)});
    expectDims(in, 18, {T, times(di, 2)});
    expectDims(in, 19, {r, times(di, 2)});
    expectDims(in, 20, {di});
    expectDims(in, 21, {N, E, di});
    expectDims(in, 22, {N, 2 * r, times(di, 2)});
    expectDims(in, 23, {N, 2 * r, times(di, 2)});
}

//! The one check of the I/O every method sees (PluginIo): the layer type's counts, the
//! types, the dims (T, S, N, E may be -1 at build time), the output q's shape and the
//! state outputs against their inputs (the aliasing base's checkAliasedStates over the
//! layer type's prefix of kStates).
void checkIo(Dsv4AttentionConfig const& c, PluginIo const& io)
{
    int32_t const nbInputs = nbInputsOf(c.layerType);
    int32_t const nbOutputs = 1 + nbStates(c.layerType);
    ENGRAM_PLUGIN_CHECK(io.counts(nbInputs, nbOutputs),
        "layer_type " << c.layerType << " takes " << nbInputs << " inputs and gives " << nbOutputs << " outputs, got "
                      << io.nbInputs << " and " << io.nbOutputs);
    if (io.hasInputTypes)
    {
        DataType const t = io.inTypes[0];
        ENGRAM_PLUGIN_CHECK(isFloatIoType(t), "q must be bfloat16, float16 or float32, got " << dataTypeName(t));
        for (int32_t i = 1; i < nbInputs; ++i)
        {
            ENGRAM_PLUGIN_CHECK(typeOk(i, io.inTypes[i], t),
                kInputs[i].name << " must be "
                                << (kInputs[i].kind == kAct          ? dataTypeName(t)
                                           : kInputs[i].kind == kF32 ? "float32"
                                                                     : "int32")
                                << ", got " << dataTypeName(io.inTypes[i]));
        }
    }
    if (io.hasOutputTypes)
    {
        ENGRAM_PLUGIN_CHECK(io.outTypes[0] == io.inTypes[0],
            "the output must be q's type " << dataTypeName(io.inTypes[0]) << ", got " << dataTypeName(io.outTypes[0]));
    }
    if (io.hasInputDims)
    {
        checkDims(c, io.inDims, nbInputs);
        if (io.hasOutputDims)
        {
            nvinfer1::Dims const& q = io.inDims[0];
            nvinfer1::Dims const& o = io.outDims[0];
            ENGRAM_PLUGIN_CHECK(
                dimsMatch(o, q), "the output must match q " << dimsToString(q) << ", got " << dimsToString(o));
        }
    }
    checkAliasedStates(statesOfLayer(c.layerType), io);
}

//! The kernel's shape from the input dims checkIo passed.
EngramDsv4Shape shapeOf(Dsv4AttentionConfig const& c, nvinfer1::Dims const* in, DataType io)
{
    EngramDsv4Shape s{};
    s.num_tokens = in[0].d[0];
    s.num_seqs = in[4].d[0];
    s.num_slots = in[kWindowKv].d[0];
    s.layer_type = c.layerType;
    s.window = c.window;
    s.compress_rate = c.compressRate;
    s.index_topk = c.indexTopk;
    s.io_type = floatTypeCode(io);
    s.num_heads = static_cast<int32_t>(in[0].d[1]);
    s.head_dim = static_cast<int32_t>(in[0].d[2]);
    s.scaling = c.scaling;
    s.eps = c.eps;
    s.rope_scale = c.ropeScale;
    if (c.layerType == ENGRAM_DSV4_SLIDING)
    {
        return s;
    }
    s.max_entries = in[12].d[1];
    s.rope_pairs = static_cast<int32_t>(in[11].d[0]);
    if (c.layerType == ENGRAM_DSV4_CSA)
    {
        s.index_heads = static_cast<int32_t>(in[15].d[1]);
        s.index_dim = static_cast<int32_t>(in[15].d[2]);
    }
    return s;
}

//! The kernel library's field checks on a small stand-in shape (no GPU): the plugin and
//! the ctypes path refuse the same.
void checkFields(Dsv4AttentionConfig const& c)
{
    EngramDsv4Shape s{};
    s.layer_type = c.layerType;
    s.window = c.window;
    s.compress_rate = c.compressRate;
    s.index_topk = c.indexTopk;
    s.io_type = ENGRAM_FLOAT_F32;
    s.num_heads = 1;
    s.head_dim = 2;
    s.rope_pairs = 1;
    s.index_heads = 1;
    s.index_dim = 2;
    s.scaling = c.scaling;
    s.eps = c.eps;
    s.rope_scale = c.ropeScale;
    int const status = engram_dsv4_check(&s);
    ENGRAM_PLUGIN_CHECK(status == 0, engram_last_error());
}
} // namespace dsv4_detail

EngramDsv4AttentionPlugin::EngramDsv4AttentionPlugin(Dsv4AttentionConfig const& config, nvinfer1::TensorRTPhase phase)
    : EngramAliasingPluginBase(dsv4_detail::kFields, config, phase)
{
    dsv4_detail::checkFields(mConfig);
}

int32_t EngramDsv4AttentionPlugin::getNbOutputs() const noexcept
{
    return 1 + dsv4_detail::nbStates(mConfig.layerType);
}

int32_t EngramDsv4AttentionPlugin::getOutputDataTypes(
    DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes, int32_t nbInputs) const noexcept
{
    ENGRAM_PLUGIN_TRY
    {
        using namespace dsv4_detail;
        checkIo(mConfig, PluginIo::ofTypes(inputTypes, nbInputs, nbOutputs));
        for (int32_t o = 0; o < nbOutputs; ++o)
        {
            outputTypes[o] = inputTypes[0]; // q's type: the output and every state
        }
        return 0;
    }
    ENGRAM_PLUGIN_CATCH(dsv4_detail::kName, -1);
}

int32_t EngramDsv4AttentionPlugin::getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
    nvinfer1::DimsExprs const* /*shapeInputs*/, int32_t /*nbShapeInputs*/, nvinfer1::DimsExprs* outputs,
    int32_t nbOutputs, nvinfer1::IExprBuilder& /*exprBuilder*/) noexcept
{
    ENGRAM_PLUGIN_TRY
    {
        using namespace dsv4_detail;
        checkIo(mConfig, PluginIo::ofShapes(inputs, nbInputs, nbOutputs));
        outputs[0] = inputs[0];
        for (int32_t i = 0; i + 1 < nbOutputs; ++i)
        {
            outputs[1 + i] = inputs[stateInput(i)];
        }
        return 0;
    }
    ENGRAM_PLUGIN_CATCH(dsv4_detail::kName, -1);
}

bool EngramDsv4AttentionPlugin::supportsFormatCombination(
    int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept
{
    using namespace dsv4_detail;
    if (!isLinearIoAt(pos, inOut, nbInputs, nbOutputs, nbInputsOf(mConfig.layerType), getNbOutputs()))
    {
        return false;
    }
    nvinfer1::PluginTensorDesc const& desc = inOut[pos].desc;
    DataType const io = inOut[0].desc.type;
    if (pos >= nbInputs)
    {
        return desc.type == io;
    }
    return typeOk(pos, desc.type, io);
}

int32_t EngramDsv4AttentionPlugin::configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
    nvinfer1::DynamicPluginTensorDesc const* /*out*/, int32_t nbOutputs) noexcept
{
    ENGRAM_PLUGIN_TRY
    {
        dsv4_detail::checkIo(mConfig, PluginIo::ofConfigure(in, nbInputs, nbOutputs));
        return 0;
    }
    ENGRAM_PLUGIN_CATCH(dsv4_detail::kName, -1);
}

size_t EngramDsv4AttentionPlugin::getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
    nvinfer1::DynamicPluginTensorDesc const* /*outputs*/, int32_t /*nbOutputs*/) const noexcept
{
    using namespace dsv4_detail;
    if (mConfig.layerType != ENGRAM_DSV4_CSA || nbInputs != kMaxInputs)
    {
        return 0;
    }
    // The largest step the profile allows: T and E at their maxima.
    int64_t const T = inputs[0].max.d[0];
    int64_t const E = inputs[12].max.d[1];
    if (T <= 0 || E <= mConfig.indexTopk)
    {
        return 0;
    }
    return static_cast<size_t>(T) * static_cast<size_t>(E) * sizeof(float) + 256
        + static_cast<size_t>(T) * static_cast<size_t>(mConfig.indexTopk) * sizeof(int32_t) + 256;
}

AliasedStates EngramDsv4AttentionPlugin::aliasedStates() const
{
    // Every state is read-modify-write: its output is its input's memory (the layer type's
    // first nbStates of the table).
    return dsv4_detail::statesOfLayer(mConfig.layerType);
}

int32_t EngramDsv4AttentionPlugin::enqueue(nvinfer1::PluginTensorDesc const* inputDesc,
    nvinfer1::PluginTensorDesc const* outputDesc, void const* const* inputs, void* const* outputs, void* workspace,
    cudaStream_t stream) noexcept
{
    ENGRAM_PLUGIN_TRY
    {
        using namespace dsv4_detail;
        int32_t const nbInputs = nbInputsOf(mConfig.layerType);
        checkIo(mConfig, PluginIo::ofEnqueue(inputDesc, nbInputs, outputDesc, getNbOutputs()));
        nvinfer1::Dims dims[kMaxInputs];
        copyDims(inputDesc, nbInputs, dims);
        DataType const io = inputDesc[0].type;
        EngramDsv4Shape const shape = shapeOf(mConfig, dims, io);
        void* state[kMaxInputs] = {};
        for (int32_t i = 0; i < nbStates(mConfig.layerType); ++i)
        {
            int32_t const in = stateInput(i);
            state[in] = volume(dims[in]) > 0 ? outputs[1 + i] : nullptr;
        }
        copyStatesUnlessAliased(inputDesc, inputs, outputs, stream);
        EngramDsv4Tensors t{};
        t.q = inputs[0];
        t.kv = inputs[1];
        t.sinks = static_cast<float const*>(inputs[2]);
        t.seq_starts = static_cast<int32_t const*>(inputs[3]);
        t.past_lens = static_cast<int32_t const*>(inputs[4]);
        t.seq_slots = static_cast<int32_t const*>(inputs[5]);
        t.window_kv = state[6];
        t.out = outputs[0];
        if (nbInputs > 7)
        {
            t.comp_kv = inputs[7];
            t.comp_gate = inputs[8];
            t.comp_bias = static_cast<float const*>(inputs[9]);
            t.comp_norm = static_cast<float const*>(inputs[10]);
            t.inv_freq = static_cast<float const*>(inputs[11]);
            t.entries = state[12];
            t.comp_ring_kv = state[13];
            t.comp_ring_gate = state[14];
        }
        if (nbInputs > 15)
        {
            t.index_q = inputs[15];
            t.index_w = static_cast<float const*>(inputs[16]);
            t.index_kv = inputs[17];
            t.index_gate = inputs[18];
            t.index_bias = static_cast<float const*>(inputs[19]);
            t.index_norm = static_cast<float const*>(inputs[20]);
            t.index_keys = state[21];
            t.index_ring_kv = state[22];
            t.index_ring_gate = state[23];
        }
        size_t need = 0;
        int status = engram_dsv4_workspace_size(&shape, &need);
        ENGRAM_PLUGIN_CHECK(status == 0, engram_last_error());
        status = engram_dsv4_attention(&shape, &t, workspace, need, stream);
        ENGRAM_PLUGIN_CHECK(status == 0, engram_last_error());
        return 0;
    }
    ENGRAM_PLUGIN_CATCH(dsv4_detail::kName, -1);
}

EngramDsv4AttentionPluginCreator::EngramDsv4AttentionPluginCreator()
    : EngramCreator(dsv4_detail::kFields)
{
}

} // namespace plugin
} // namespace engram_trt
