// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
#include "engramRoutedExpertsPlugin.h"

#include "common/checkMacros.h"
#include "common/pluginTensors.h"
#include "kernels/engramKernelsCore.h"
#include "kernels/quantKernels.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <climits>
#include <cmath>

namespace engram_trt
{
namespace plugin
{

using nvinfer1::DataType;

namespace routed_experts_detail
{
namespace
{ // the helpers: this file's own (internal linkage)
constexpr char const* kName = "EngramRoutedExperts";
constexpr int32_t kX = 0;
constexpr int32_t kIds = 1;
constexpr int32_t kRouteW = 2;
constexpr int32_t kGateW = 3;
constexpr int32_t kGateScale = 4;
constexpr int32_t kUpW = 5;
constexpr int32_t kUpScale = 6;
constexpr int32_t kDownW = 7;
constexpr int32_t kDownScale = 8;
constexpr int32_t kNbInputs = 9;
constexpr int32_t kNbOutputs = 1;

constexpr int32_t kMaxExperts = 4096;           // engram_moe_plan's E
constexpr int64_t kMaxPairs = int64_t{1} << 20; // engram_moe_plan's T * k
constexpr int64_t kGemvMaxTokens = 8;           // native/quant.py EXPERTS_GEMV_MAX_TOKENS
constexpr int32_t kFp8GemmBlockK = 128;         // engram_fp8_gemm's one K block
constexpr int32_t kFp8ActGroup = 128;           // ACT_QUANT["fp8"]: 128 columns, float32 scales
constexpr int32_t kFp4ActGroup = 32;            // ACT_QUANT["fp4"]: 32 columns, ue8m0 scales
constexpr size_t kAlign = 256;

constexpr Field<RoutedExpertsConfig> kFieldList[] = {
    field<&RoutedExpertsConfig::numExperts>("num_experts", 1, kMaxExperts),
    field<&RoutedExpertsConfig::topK>("top_k", 1, kMaxExperts),
    field<&RoutedExpertsConfig::hidden>("hidden", 1),
    field<&RoutedExpertsConfig::intermediate>("intermediate", 1),
    field<&RoutedExpertsConfig::weightType>("w_type", ENGRAM_QWEIGHT_FP8_E4M3, ENGRAM_QWEIGHT_FP4_E2M1),
    field<&RoutedExpertsConfig::scaleType>("scale_type", ENGRAM_QSCALE_F32, ENGRAM_QSCALE_UE8M0),
    field<&RoutedExpertsConfig::blockN>("block_n", 1),
    field<&RoutedExpertsConfig::blockK>("block_k", 1),
    field<&RoutedExpertsConfig::swigluLimit>("swiglu_limit"),
};
constexpr FieldTable<RoutedExpertsConfig> kFields{kName, kFieldList};

constexpr char const* kHiddenName = kFields.nameOf<&RoutedExpertsConfig::hidden>();
constexpr char const* kIntermediateName = kFields.nameOf<&RoutedExpertsConfig::intermediate>();
constexpr char const* kWeightTypeName = kFields.nameOf<&RoutedExpertsConfig::weightType>();
constexpr char const* kScaleTypeName = kFields.nameOf<&RoutedExpertsConfig::scaleType>();
constexpr char const* kBlockKName = kFields.nameOf<&RoutedExpertsConfig::blockK>();
constexpr char const* kLimitName = kFields.nameOf<&RoutedExpertsConfig::swigluLimit>();

char const* const kInputNames[kNbInputs]
    = {"x", "ids", "route_w", "gate_w", "gate_scale", "up_w", "up_scale", "down_w", "down_scale"};

bool isFp4(RoutedExpertsConfig const& c)
{
    return c.weightType == ENGRAM_QWEIGHT_FP4_E2M1;
}

//! The checks across fields: what the GEMV and the GEMMs take (rows of whole 16-byte
//! vectors, each vector inside one scale block), and FP4's ue8m0 scales.
void checkConfig(RoutedExpertsConfig const& c)
{
    int32_t const multiple = isFp4(c) ? 32 : 16; // values per 16-byte vector of the GEMV
    char const* const kind = isFp4(c) ? "fp4" : "fp8";
    ENGRAM_PLUGIN_CHECK(c.hidden % multiple == 0 && c.intermediate % multiple == 0,
        kHiddenName << " " << c.hidden << " and " << kIntermediateName << " " << c.intermediate
                    << " must be multiples of " << multiple << " for " << kind << " weights (" << kWeightTypeName << " "
                    << c.weightType << "): the kernels read rows in 16-byte vectors");
    ENGRAM_PLUGIN_CHECK(c.blockK % multiple == 0,
        kBlockKName << " " << c.blockK << " must be a multiple of " << multiple << " for " << kind
                    << " weights (each 16-byte vector inside one scale block)");
    ENGRAM_PLUGIN_CHECK(!isFp4(c) || c.scaleType == ENGRAM_QSCALE_UE8M0,
        kScaleTypeName << " must be 1 (ue8m0) for fp4 weights (got " << c.scaleType << ")");
    ENGRAM_PLUGIN_CHECK(std::isfinite(c.swigluLimit) && c.swigluLimit >= 0.0F,
        kLimitName << " " << c.swigluLimit << " must be a finite number >= 0 (0: no clamp)");
}

int64_t ceilDiv(int64_t a, int64_t b)
{
    return (a + b - 1) / b;
}

//! The stored bytes' inner size of a [rows, cols] weight (two fp4 values a byte).
int64_t storedCols(RoutedExpertsConfig const& c, int64_t cols)
{
    return isFp4(c) ? cols / 2 : cols;
}

//! Expected dims of input i (the weights and scales; -1 where the step decides).
void expectedDims(RoutedExpertsConfig const& c, int32_t i, int64_t* d)
{
    int64_t const e = c.numExperts;
    int64_t const hid = c.hidden;
    int64_t const inter = c.intermediate;
    switch (i)
    {
    case kGateW:
    case kUpW: d[0] = e, d[1] = inter, d[2] = storedCols(c, hid); break;
    case kGateScale:
    case kUpScale: d[0] = e, d[1] = ceilDiv(inter, c.blockN), d[2] = ceilDiv(hid, c.blockK); break;
    case kDownW: d[0] = e, d[1] = hid, d[2] = storedCols(c, inter); break;
    default: d[0] = e, d[1] = ceilDiv(hid, c.blockN), d[2] = ceilDiv(inter, c.blockK); break; // kDownScale
    }
}

//! Shape checks at build time (dims may be -1) and at enqueue (concrete dims).
void checkDims(RoutedExpertsConfig const& c, nvinfer1::Dims const* in)
{
    ENGRAM_PLUGIN_CHECK(in[kX].nbDims == 2 && dimMatches(in[kX].d[1], c.hidden),
        "x must be [T, " << kHiddenName << " = " << c.hidden << "], got " << dimsToString(in[kX]));
    for (int32_t i : {kIds, kRouteW})
    {
        ENGRAM_PLUGIN_CHECK(in[i].nbDims == 2 && dimMatches(in[i].d[0], in[kX].d[0]) && dimMatches(in[i].d[1], c.topK),
            kInputNames[i] << " must be [T, top_k = " << c.topK << "] with x's T, got " << dimsToString(in[i]));
    }
    for (int32_t i = kGateW; i <= kDownScale; ++i)
    {
        int64_t want[3];
        expectedDims(c, i, want);
        bool ok = in[i].nbDims == 3;
        for (int32_t k = 0; ok && k < 3; ++k)
        {
            ok = dimMatches(in[i].d[k], want[k]);
        }
        ENGRAM_PLUGIN_CHECK(ok,
            kInputNames[i] << " must be [" << want[0] << ", " << want[1] << ", " << want[2] << "], got "
                           << dimsToString(in[i]));
    }
}

//! The weights' element types: the stored bytes, one a value (fp8) or two values a byte
//! (fp4), as int8 (what an ONNX INT8 initializer becomes; the parser widens UINT8 ones to
//! int32) or uint8.
bool isWeightType(DataType type)
{
    return type == DataType::kINT8 || type == DataType::kUINT8;
}

bool isScaleType(DataType type, RoutedExpertsConfig const& c)
{
    if (c.scaleType == ENGRAM_QSCALE_F32)
    {
        return type == DataType::kFLOAT;
    }
    return type == DataType::kINT8 || type == DataType::kUINT8;
}

//! The one check of the I/O every method sees (PluginIo): counts, types (the weights as
//! stored bytes, the scales as scale_type says), dims (T may be -1 at build time; ids and
//! route_w take x's T wherever known), the step's (token, expert) pairs once T is known
//! and the output against x.
void checkIo(RoutedExpertsConfig const& c, PluginIo const& io)
{
    ENGRAM_PLUGIN_CHECK(io.counts(kNbInputs, kNbOutputs),
        "expects 9 inputs (x, ids, route_w, gate_w, gate_scale, up_w, up_scale, down_w, down_scale) and 1 "
        "output, got "
            << io.nbInputs << " and " << io.nbOutputs);
    if (io.hasInputTypes)
    {
        DataType const* in = io.inTypes;
        ENGRAM_PLUGIN_CHECK(
            isFloatIoType(in[kX]), "x must be bfloat16, float16 or float32, got " << dataTypeName(in[kX]));
        ENGRAM_PLUGIN_CHECK(in[kIds] == DataType::kINT32 || in[kIds] == DataType::kINT64,
            "ids must be int32 or int64, got " << dataTypeName(in[kIds]));
        ENGRAM_PLUGIN_CHECK(
            in[kRouteW] == DataType::kFLOAT, "route_w must be float32, got " << dataTypeName(in[kRouteW]));
        for (int32_t i : {kGateW, kUpW, kDownW})
        {
            ENGRAM_PLUGIN_CHECK(isWeightType(in[i]) && in[i] == in[kGateW],
                kInputNames[i] << " must be int8 or uint8 bytes (the stored weight), as gate_w, got "
                               << dataTypeName(in[i]));
        }
        for (int32_t i : {kGateScale, kUpScale, kDownScale})
        {
            ENGRAM_PLUGIN_CHECK(isScaleType(in[i], c),
                kInputNames[i] << " must be "
                               << (c.scaleType == ENGRAM_QSCALE_F32 ? "float32" : "int8 or uint8 (ue8m0 bytes)")
                               << " for " << kScaleTypeName << " " << c.scaleType << ", got " << dataTypeName(in[i]));
        }
    }
    if (io.hasOutputTypes)
    {
        ENGRAM_PLUGIN_CHECK(io.outTypes[0] == io.inTypes[kX],
            "x and the output must share one type (bfloat16, float16 or float32), x is "
                << dataTypeName(io.inTypes[kX]));
    }
    if (io.hasInputDims)
    {
        nvinfer1::Dims const* in = io.inDims;
        checkDims(c, in);
        int64_t const numTokens = in[kX].d[0];
        int64_t const pairs = numTokens * c.topK;
        ENGRAM_PLUGIN_CHECK(numTokens == -1 || pairs <= kMaxPairs,
            "a step of " << numTokens << " tokens makes " << pairs << " pairs (at most " << kMaxPairs << ")");
        if (io.hasOutputDims)
        {
            nvinfer1::Dims const& o = io.outDims[0];
            ENGRAM_PLUGIN_CHECK(dimsMatch(o, in[kX]),
                "the output must match x " << dimsToString(in[kX]) << ", got " << dimsToString(o));
        }
    }
}

//! Where each buffer of a step of `tokens` tokens lies in the workspace (byte offsets,
//! each kAlign-aligned) and its size.
struct Layout
{
    size_t offsets{0};
    size_t order{0};
    size_t rowToken{0};
    size_t pairRow{0};
    size_t slotExpert{0};
    size_t gateUp{0};
    size_t act{0};
    size_t actScale{0};
    size_t hid{0};
    size_t hidScale{0};
    size_t yRows{0};
    size_t total{0};
};

size_t alignUp(size_t v)
{
    return (v + kAlign - 1) / kAlign * kAlign;
}

Layout layoutFor(RoutedExpertsConfig const& c, int64_t tokens)
{
    auto const t = static_cast<size_t>(tokens);
    size_t const pairs = t * static_cast<size_t>(c.topK);
    size_t const slots = static_cast<size_t>(std::max<int64_t>(1, std::min<int64_t>(pairs, c.numExperts)));
    size_t const hid = static_cast<size_t>(c.hidden);
    size_t const inter = static_cast<size_t>(c.intermediate);
    // fp8: the GEMV's float32 activations, or the GEMM's e4m3 bytes + float32 scales (fewer);
    // fp4: bf16 activations for both (e4m3 * 2^k is exact in bf16).
    size_t const actBytes = isFp4(c) ? 2 : 4;
    size_t const groups = isFp4(c) ? 0 : static_cast<size_t>(ceilDiv(c.hidden, kFp8ActGroup));
    size_t const hidGroups = isFp4(c) ? 0 : static_cast<size_t>(ceilDiv(c.intermediate, kFp8ActGroup));
    Layout l;
    size_t at = 0;
    auto take = [&at](size_t bytes) {
        size_t const here = at;
        at += alignUp(bytes);
        return here;
    };
    l.offsets = take((static_cast<size_t>(c.numExperts) + 1) * 4);
    l.order = take(pairs * 4);
    l.rowToken = take(pairs * 4);
    l.pairRow = take(pairs * 4);
    l.slotExpert = take(slots * 4);
    l.gateUp = take(pairs * 2 * inter * 4);
    l.act = take(t * hid * actBytes);
    l.actScale = take(t * groups * 4);
    l.hid = take(pairs * inter * actBytes);
    l.hidScale = take(pairs * hidGroups * 4);
    l.yRows = take(pairs * hid * 4);
    l.total = at;
    return l;
}

//! Compute capability (major * 10 + minor) of the current device, 0 when it cannot be asked.
int32_t currentCapability()
{
    int device = 0;
    int major = 0;
    int minor = 0;
    if (cudaGetDevice(&device) != cudaSuccess
        || cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess
        || cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess)
    {
        cudaGetLastError();
        return 0;
    }
    return major * 10 + minor;
}

void checkStatus(int status)
{
    ENGRAM_PLUGIN_CHECK(status == 0, engram_last_error());
}
} // namespace
} // namespace routed_experts_detail

EngramRoutedExpertsPlugin::EngramRoutedExpertsPlugin(RoutedExpertsConfig const& config, nvinfer1::TensorRTPhase phase)
    : EngramPluginBaseT(routed_experts_detail::kFields, config, phase)
{
    routed_experts_detail::checkConfig(mConfig);
}

int32_t EngramRoutedExpertsPlugin::getOutputDataTypes(
    DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes, int32_t nbInputs) const noexcept
{
    ENGRAM_PLUGIN_TRY
    {
        using namespace routed_experts_detail;
        checkIo(mConfig, PluginIo::ofTypes(inputTypes, nbInputs, nbOutputs));
        outputTypes[0] = inputTypes[kX];
        return 0;
    }
    ENGRAM_PLUGIN_CATCH(routed_experts_detail::kName, -1);
}

int32_t EngramRoutedExpertsPlugin::getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
    nvinfer1::DimsExprs const* /*shapeInputs*/, int32_t /*nbShapeInputs*/, nvinfer1::DimsExprs* outputs,
    int32_t nbOutputs, nvinfer1::IExprBuilder& /*exprBuilder*/) noexcept
{
    ENGRAM_PLUGIN_TRY
    {
        using namespace routed_experts_detail;
        checkIo(mConfig, PluginIo::ofShapes(inputs, nbInputs, nbOutputs));
        outputs[0] = inputs[kX];
        return 0;
    }
    ENGRAM_PLUGIN_CATCH(routed_experts_detail::kName, -1);
}

bool EngramRoutedExpertsPlugin::supportsFormatCombination(
    int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept
{
    using namespace routed_experts_detail;
    if (!isLinearIoAt(pos, inOut, nbInputs, nbOutputs, kNbInputs, kNbOutputs))
    {
        return false;
    }
    DataType const type = inOut[pos].desc.type;
    switch (pos)
    {
    case kX: return isFloatIoType(type);
    case kIds: return type == DataType::kINT32 || type == DataType::kINT64;
    case kRouteW: return type == DataType::kFLOAT;
    case kGateW: return isWeightType(type);
    case kUpW:
    case kDownW: return type == inOut[kGateW].desc.type;
    case kGateScale:
    case kUpScale:
    case kDownScale: return isScaleType(type, mConfig);
    default: return type == inOut[kX].desc.type; // the output
    }
}

int32_t EngramRoutedExpertsPlugin::configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
    nvinfer1::DynamicPluginTensorDesc const* /*out*/, int32_t nbOutputs) noexcept
{
    ENGRAM_PLUGIN_TRY
    {
        using namespace routed_experts_detail;
        checkIo(mConfig, PluginIo::ofConfigure(in, nbInputs, nbOutputs));
        // The profile's largest step (not a dim of the I/O: TensorRT's max of T).
        int64_t const maxTokens = in[kX].max.d[0];
        ENGRAM_PLUGIN_CHECK(maxTokens < 0 || maxTokens * mConfig.topK <= kMaxPairs,
            "a step of up to " << maxTokens << " tokens makes " << maxTokens * mConfig.topK
                               << " (token, expert) pairs; the plan takes at most " << kMaxPairs);
        return 0;
    }
    ENGRAM_PLUGIN_CATCH(routed_experts_detail::kName, -1);
}

size_t EngramRoutedExpertsPlugin::getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
    nvinfer1::DynamicPluginTensorDesc const* /*outputs*/, int32_t /*nbOutputs*/) const noexcept
{
    ENGRAM_PLUGIN_TRY
    {
        using namespace routed_experts_detail;
        ENGRAM_PLUGIN_CHECK(nbInputs == kNbInputs, "expects 9 inputs");
        return layoutFor(mConfig, std::max<int64_t>(inputs[kX].max.d[0], 1)).total;
    }
    ENGRAM_PLUGIN_CATCH(routed_experts_detail::kName, 0);
}

int32_t EngramRoutedExpertsPlugin::enqueue(nvinfer1::PluginTensorDesc const* inputDesc,
    nvinfer1::PluginTensorDesc const* outputDesc, void const* const* inputs, void* const* outputs, void* workspace,
    cudaStream_t stream) noexcept
{
    ENGRAM_PLUGIN_TRY
    {
        using namespace routed_experts_detail;
        RoutedExpertsConfig const& c = mConfig;
        checkIo(c, PluginIo::ofEnqueue(inputDesc, kNbInputs, outputDesc, kNbOutputs));
        int64_t const numTokens = inputDesc[kX].dims.d[0];
        DataType const io = inputDesc[kX].type;
        DataType const idsType = inputDesc[kIds].type;
        int64_t const pairs = numTokens * c.topK;
        if (numTokens == 0)
        {
            return 0;
        }
        Layout const l = layoutFor(c, numTokens);
        auto* const base = static_cast<char*>(workspace);
        ENGRAM_PLUGIN_CHECK(
            base != nullptr, "no workspace was given (getWorkspaceSize asks for " << l.total << " bytes)");
        auto* const offsets = reinterpret_cast<int32_t*>(base + l.offsets);
        auto* const order = reinterpret_cast<int32_t*>(base + l.order);
        auto* const rowToken = reinterpret_cast<int32_t*>(base + l.rowToken);
        auto* const pairRow = reinterpret_cast<int32_t*>(base + l.pairRow);
        auto* const slotExpert = reinterpret_cast<int32_t*>(base + l.slotExpert);
        auto* const gateUp = reinterpret_cast<float*>(base + l.gateUp);
        void* const act = base + l.act;
        auto* const actScale = reinterpret_cast<float*>(base + l.actScale);
        void* const hid = base + l.hid;
        auto* const hidScale = reinterpret_cast<float*>(base + l.hidScale);
        auto* const yRows = reinterpret_cast<float*>(base + l.yRows);

        int32_t const e = c.numExperts;
        int64_t const hidden = c.hidden;
        int64_t const inter = c.intermediate;
        auto const numSlots = static_cast<int32_t>(std::max<int64_t>(1, std::min<int64_t>(pairs, e)));
        int32_t const idsInt64 = idsType == DataType::kINT64 ? 1 : 0;
        checkStatus(engram_moe_plan(inputs[kIds], idsInt64, numTokens, c.topK, e, offsets, order, rowToken, pairRow,
            slotExpert, numSlots, nullptr, stream));

        // The route, as native/quant.py experts() takes it: the grouped GEMV for a step of up
        // to kGemvMaxTokens tokens, else the GEMMs (FP8: its tensor cores need sm_89+ and
        // 128-column blocks; where it cannot run, the GEMV in passes).
        bool const fp4 = isFp4(c);
        bool gemv = numTokens <= kGemvMaxTokens;
        if (!gemv && !fp4 && (c.blockK != kFp8GemmBlockK || currentCapability() < 89))
        {
            gemv = true;
        }
        bool const fp8Gemm = !gemv && !fp4;
        // E = 1: every row is expert 0's (the kernels take no offsets then).
        int32_t const* const rowsOffsets = e > 1 ? offsets : nullptr;
        int32_t const* const rowsSlots = e > 1 ? slotExpert : nullptr;
        int32_t const gemvSlots = e > 1 ? numSlots : 1;
        int32_t const xType = floatTypeCode(io);
        int32_t const group = fp4 ? kFp4ActGroup : kFp8ActGroup;
        int32_t const ue8m0 = fp4 ? 1 : 0;
        // fp4: bf16 activations (exact with ue8m0 scales); fp8: float32 for the GEMV.
        int32_t const aType = fp4 ? ENGRAM_FLOAT_BF16 : ENGRAM_FLOAT_F32;

        // The activations, quantized as the product takes them.
        if (fp8Gemm)
        {
            checkStatus(engram_act_quant(
                inputs[kX], xType, numTokens, hidden, hidden, group, ue8m0, act, actScale, nullptr, 0, stream));
        }
        else
        {
            checkStatus(engram_act_quant(
                inputs[kX], xType, numTokens, hidden, hidden, group, ue8m0, nullptr, nullptr, act, aType, stream));
        }
        // gate and up into the two halves of one float32 [P, 2I] buffer.
        int64_t const ldGateUp = 2 * inter;
        for (int32_t half = 0; half < 2; ++half)
        {
            void const* w = inputs[half == 0 ? kGateW : kUpW];
            void const* s = inputs[half == 0 ? kGateScale : kUpScale];
            float* const outHalf = gateUp + half * inter;
            if (gemv)
            {
                checkStatus(engram_quant_gemv(act, aType, hidden, rowToken, pairs, w, c.weightType, s, c.scaleType,
                    c.blockN, c.blockK, inter, hidden, e, rowsOffsets, rowsSlots, gemvSlots, outHalf, ENGRAM_FLOAT_F32,
                    ldGateUp, 0, stream));
            }
            else if (fp8Gemm)
            {
                checkStatus(engram_fp8_gemm(static_cast<uint8_t const*>(act), actScale, rowToken, pairs,
                    static_cast<uint8_t const*>(w), s, c.scaleType, c.blockN, inter, hidden, e, rowsOffsets, outHalf,
                    ENGRAM_FLOAT_F32, ldGateUp, stream));
            }
            else
            {
                checkStatus(engram_quant_grouped_gemm(act, hidden, rowToken, pairs, w, c.weightType, s, c.scaleType,
                    c.blockN, c.blockK, inter, hidden, e, rowsOffsets, outHalf, ENGRAM_FLOAT_F32, ldGateUp, stream));
            }
        }
        // The clamped SwiGLU, quantized as the down projection takes it.
        if (fp8Gemm)
        {
            checkStatus(engram_swiglu_act_quant(
                gateUp, pairs, inter, ldGateUp, c.swigluLimit, group, ue8m0, hid, hidScale, nullptr, 0, stream));
            checkStatus(engram_fp8_gemm(static_cast<uint8_t const*>(hid), hidScale, nullptr, pairs,
                static_cast<uint8_t const*>(inputs[kDownW]), inputs[kDownScale], c.scaleType, c.blockN, hidden, inter,
                e, rowsOffsets, yRows, ENGRAM_FLOAT_F32, hidden, stream));
        }
        else
        {
            checkStatus(engram_swiglu_act_quant(
                gateUp, pairs, inter, ldGateUp, c.swigluLimit, group, ue8m0, nullptr, nullptr, hid, aType, stream));
            if (gemv)
            {
                checkStatus(engram_quant_gemv(hid, aType, inter, nullptr, pairs, inputs[kDownW], c.weightType,
                    inputs[kDownScale], c.scaleType, c.blockN, c.blockK, hidden, inter, e, rowsOffsets, rowsSlots,
                    gemvSlots, yRows, ENGRAM_FLOAT_F32, hidden, 0, stream));
            }
            else
            {
                checkStatus(engram_quant_grouped_gemm(hid, inter, nullptr, pairs, inputs[kDownW], c.weightType,
                    inputs[kDownScale], c.scaleType, c.blockN, c.blockK, hidden, inter, e, rowsOffsets, yRows,
                    ENGRAM_FLOAT_F32, hidden, stream));
            }
        }
        // Each pair's row back to its token, weighted, summed over the token's picks.
        checkStatus(engram_moe_combine(yRows, hidden, pairRow, inputs[kIds], idsInt64,
            static_cast<float const*>(inputs[kRouteW]), numTokens, c.topK, e, hidden, outputs[0], xType, hidden,
            stream));
        return 0;
    }
    ENGRAM_PLUGIN_CATCH(routed_experts_detail::kName, -1);
}

EngramRoutedExpertsPluginCreator::EngramRoutedExpertsPluginCreator()
    : EngramCreator(routed_experts_detail::kFields)
{
}

} // namespace plugin
} // namespace engram_trt
