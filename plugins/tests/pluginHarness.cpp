// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * Plugin test harness: drives the Engram plugins the way TensorRT does, without
 * TensorRT (the H200 has none; TensorRT-RTX engines do not run on sm_90).
 *
 * libengram_plugin_harness.so exposes a small C API that tests/gpu (helpers.Harness) calls
 * through ctypes, so the Python references check the plugins' outputs:
 *   harness_create      getCreators() -> creator by name (version "1", namespace
 *                       "engram_trt") -> createPlugin(fields, phase); phase kBUILD is
 *                       what a network being built gets: its clones keep it, so
 *                       harness_run's enqueue is then a build's timing enqueue
 *   harness_roundtrip   getFieldsToSerialize() -> createPlugin(..., kRUNTIME)
 *   harness_serialized_int
 *                       one scalar integer field of getFieldsToSerialize() (what an
 *                       engine stores), so a check sees the value, not only its effect
 *   harness_serialized_field
 *                       one field of getFieldsToSerialize() as written: name, type,
 *                       length and bytes, so a check pins what an engine stores
 *   harness_output_shapes / harness_output_types
 *                       getOutputShapes through an IExprBuilder implemented here (the
 *                       batch dimension is a non-constant expression, as in an engine
 *                       with dynamic shapes) / getOutputDataTypes
 *   harness_run         supportsFormatCombination at every position, configurePlugin
 *                       (dynamic dims), getWorkspaceSize, attachToContext, onShapeChange
 *                       and enqueue on the given stream
 *   harness_aliased_input
 *                       getAliasedInput of a build capability of version 2
 *                       (IPluginV3OneBuildV2), -1 for a version-1 one
 * In TensorRT 10 headers IExprBuilder / IDimensionExpr forward to apiv::VExprBuilder /
 * apiv::VDimensionExpr implementations; the harness supplies those.
 */
#include <NvInferRuntime.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

extern "C" nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators);
extern "C" void setLoggerFinder(nvinfer1::ILoggerFinder* finder);

#define HARNESS_API extern "C" __attribute__((visibility("default")))

namespace engram_trt
{
namespace harness
{

thread_local std::string gError;

int failWith(std::string const& message)
{
    gError = message;
    return -1;
}

//! Collects the plugins' log messages so a failure can report them, and writes them to
//! stderr as TensorRT's logger would: once the harness has installed this logger, plugins
//! that a TensorRT registry creates later in the same process (which does not reinstall
//! its own for a library already loaded) still report where their callers look.
class CollectingLogger : public nvinfer1::ILogger
{
public:
    void log(Severity severity, nvinfer1::AsciiChar const* msg) noexcept override
    {
        if (severity <= Severity::kWARNING)
        {
            std::lock_guard<std::mutex> lock(mMutex);
            mMessages += (mMessages.empty() ? "" : " | ") + std::string(msg);
            std::fprintf(stderr, "%s\n", msg);
        }
    }
    std::string take()
    {
        std::lock_guard<std::mutex> lock(mMutex);
        std::string out;
        out.swap(mMessages);
        return out;
    }

private:
    std::mutex mMutex;
    std::string mMessages;
};

class HarnessLoggerFinder : public nvinfer1::ILoggerFinder
{
public:
    nvinfer1::ILogger* findLogger() override
    {
        return &logger;
    }
    CollectingLogger logger;
};

//! The harness's logger finder, (re)installed at every use: a TensorRT registry that loads
//! the same library in this process installs its own, and the plugins' messages must
//! reach the harness while it drives them.
HarnessLoggerFinder& loggerFinder()
{
    static HarnessLoggerFinder finder;
    setLoggerFinder(&finder);
    return finder;
}

int failWithLog(std::string const& message)
{
    std::string const logged = loggerFinder().logger.take();
    return failWith(logged.empty() ? message : message + ": " + logged);
}

// --- IExprBuilder ----------------------------------------------------------------------

class DimImpl : public nvinfer1::apiv::VDimensionExpr
{
public:
    DimImpl(int64_t value, bool constant)
        : mValue(value)
        , mConstant(constant)
    {
    }
    bool isConstant() const override
    {
        return mConstant;
    }
    int64_t getConstantValue() const override
    {
        return mConstant ? mValue : std::numeric_limits<int64_t>::min();
    }
    bool isSizeTensor() const override
    {
        return false;
    }
    int64_t value() const
    {
        return mValue;
    }

private:
    int64_t mValue;
    bool mConstant;
};

//! An expression with a known value; `constant` says whether TensorRT would see it as
//! a build-time constant (the harness evaluates non-constant ones too).
class DimExpr : public nvinfer1::IDimensionExpr
{
public:
    DimExpr(int64_t value, bool constant)
        : mDim(value, constant)
    {
        mImpl = &mDim;
    }
    ~DimExpr() noexcept override = default;
    int64_t value() const
    {
        return mDim.value();
    }

private:
    DimImpl mDim;
};

class ExprBuilderImpl : public nvinfer1::apiv::VExprBuilder
{
public:
    nvinfer1::IDimensionExpr const* constant(int64_t value) override
    {
        return make(value, true);
    }

    nvinfer1::IDimensionExpr const* operation(nvinfer1::DimensionOperation op, nvinfer1::IDimensionExpr const& first,
        nvinfer1::IDimensionExpr const& second) override
    {
        int64_t const a = static_cast<DimExpr const&>(first).value();
        int64_t const b = static_cast<DimExpr const&>(second).value();
        int64_t v = 0;
        switch (op)
        {
        case nvinfer1::DimensionOperation::kSUM: v = a + b; break;
        case nvinfer1::DimensionOperation::kPROD: v = a * b; break;
        case nvinfer1::DimensionOperation::kMAX: v = a > b ? a : b; break;
        case nvinfer1::DimensionOperation::kMIN: v = a < b ? a : b; break;
        case nvinfer1::DimensionOperation::kSUB: v = a - b; break;
        case nvinfer1::DimensionOperation::kEQUAL: v = a == b; break;
        case nvinfer1::DimensionOperation::kLESS: v = a < b; break;
        case nvinfer1::DimensionOperation::kFLOOR_DIV:
            v = b == 0 ? 0 : (a / b - ((a % b != 0) && ((a < 0) != (b < 0))));
            break;
        case nvinfer1::DimensionOperation::kCEIL_DIV: v = b == 0 ? 0 : (a + b - 1) / b; break;
        }
        return make(v, first.isConstant() && second.isConstant());
    }

    nvinfer1::IDimensionExpr const* declareSizeTensor(
        int32_t, nvinfer1::IDimensionExpr const&, nvinfer1::IDimensionExpr const&) override
    {
        return nullptr; // no Engram plugin has size-tensor outputs
    }

    DimExpr const* make(int64_t value, bool constant)
    {
        mExprs.push_back(std::make_unique<DimExpr>(value, constant));
        return mExprs.back().get();
    }

private:
    std::deque<std::unique_ptr<DimExpr>> mExprs;
};

class ExprBuilder : public nvinfer1::IExprBuilder
{
public:
    ExprBuilder()
    {
        mImpl = &mBuilder;
    }
    ~ExprBuilder() noexcept override = default;
    DimExpr const* make(int64_t value, bool constant)
    {
        return mBuilder.make(value, constant);
    }

private:
    ExprBuilderImpl mBuilder;
};

// --- plugins ---------------------------------------------------------------------------

constexpr char const* kNamespace = "engram_trt";

nvinfer1::IPluginCreatorV3One* findCreator(char const* name)
{
    int32_t count = 0;
    nvinfer1::IPluginCreatorInterface* const* creators = getCreators(count);
    for (int32_t i = 0; i < count; ++i)
    {
        auto* creator = static_cast<nvinfer1::IPluginCreatorV3One*>(creators[i]);
        if (std::strcmp(creators[i]->getInterfaceInfo().kind, "PLUGIN CREATOR_V3ONE") == 0
            && std::strcmp(creator->getPluginName(), name) == 0 && std::strcmp(creator->getPluginVersion(), "1") == 0
            && std::strcmp(creator->getPluginNamespace(), kNamespace) == 0)
        {
            return creator;
        }
    }
    return nullptr;
}

struct Plugin
{
    std::string name;
    nvinfer1::IPluginV3* plugin{nullptr};

    ~Plugin()
    {
        delete plugin;
    }
    nvinfer1::IPluginV3OneCore* core() const
    {
        return static_cast<nvinfer1::IPluginV3OneCore*>(
            plugin->getCapabilityInterface(nvinfer1::PluginCapabilityType::kCORE));
    }
    nvinfer1::IPluginV3OneBuild* build() const
    {
        return static_cast<nvinfer1::IPluginV3OneBuild*>(
            plugin->getCapabilityInterface(nvinfer1::PluginCapabilityType::kBUILD));
    }
};

Plugin* create(char const* name, nvinfer1::PluginFieldCollection const& fields, nvinfer1::TensorRTPhase phase)
{
    loggerFinder();
    nvinfer1::IPluginCreatorV3One* creator = findCreator(name);
    if (creator == nullptr)
    {
        failWith(std::string("no creator ") + name + " version 1, namespace " + kNamespace + " in getCreators()");
        return nullptr;
    }
    nvinfer1::IPluginV3* plugin = creator->createPlugin(name, &fields, phase);
    if (plugin == nullptr)
    {
        failWithLog(std::string("createPlugin(") + name + ") returned null");
        return nullptr;
    }
    auto* wrapped = new Plugin();
    wrapped->name = name;
    wrapped->plugin = plugin;
    auto* core = wrapped->core();
    if (core == nullptr || std::strcmp(core->getPluginName(), name) != 0
        || std::strcmp(core->getPluginVersion(), "1") != 0 || std::strcmp(core->getPluginNamespace(), kNamespace) != 0)
    {
        delete wrapped;
        failWith(std::string("plugin ") + name + " reports another name, version or namespace");
        return nullptr;
    }
    return wrapped;
}

//! Bytes of one element of a field of this type (what TensorRT copies into an engine).
size_t fieldElementBytes(nvinfer1::PluginFieldType type)
{
    switch (type)
    {
    case nvinfer1::PluginFieldType::kINT64:
    case nvinfer1::PluginFieldType::kFLOAT64: return 8;
    case nvinfer1::PluginFieldType::kINT32:
    case nvinfer1::PluginFieldType::kFLOAT32: return 4;
    case nvinfer1::PluginFieldType::kINT16:
    case nvinfer1::PluginFieldType::kFLOAT16:
    case nvinfer1::PluginFieldType::kBF16: return 2;
    default: return 1;
    }
}

nvinfer1::PluginFieldCollection const* serializedFields(Plugin* p)
{
    auto* runtime = static_cast<nvinfer1::IPluginV3OneRuntime*>(
        p->plugin->getCapabilityInterface(nvinfer1::PluginCapabilityType::kRUNTIME));
    nvinfer1::PluginFieldCollection const* fc = runtime->getFieldsToSerialize();
    if (fc == nullptr)
    {
        failWithLog("getFieldsToSerialize returned null");
    }
    return fc;
}

//! A handle of the C API, with the harness's logger installed for what the call logs.
Plugin* use(void* handle)
{
    loggerFinder();
    return static_cast<Plugin*>(handle);
}

nvinfer1::Dims makeDims(int32_t nbDims, int64_t const* dims)
{
    nvinfer1::Dims d{};
    d.nbDims = nbDims;
    for (int32_t i = 0; i < nbDims; ++i)
    {
        d.d[i] = dims[i];
    }
    return d;
}

} // namespace harness
} // namespace engram_trt

using namespace engram_trt::harness;

HARNESS_API char const* harness_last_error()
{
    return gError.c_str();
}

/*
 * fields: nb_fields entries of (name, PluginFieldType, length, data). phase: 0 build, 1 runtime.
 */
HARNESS_API void* harness_create(char const* pluginName, int32_t nbFields, char const* const* names,
    int32_t const* types, int32_t const* lengths, void const* const* data, int32_t phase)
{
    std::vector<nvinfer1::PluginField> fields;
    for (int32_t i = 0; i < nbFields; ++i)
    {
        fields.emplace_back(names[i], data[i], static_cast<nvinfer1::PluginFieldType>(types[i]), lengths[i]);
    }
    nvinfer1::PluginFieldCollection fc{nbFields, fields.data()};
    return create(pluginName, fc, phase == 0 ? nvinfer1::TensorRTPhase::kBUILD : nvinfer1::TensorRTPhase::kRUNTIME);
}

HARNESS_API void* harness_roundtrip(void* handle)
{
    auto* p = use(handle);
    nvinfer1::PluginFieldCollection const* fc = serializedFields(p);
    if (fc == nullptr)
    {
        return nullptr;
    }
    // Copy the fields (as TensorRT does when it writes the engine) before the plugin goes.
    std::vector<std::string> names;
    std::vector<std::vector<uint8_t>> data;
    std::vector<nvinfer1::PluginField> fields;
    names.reserve(fc->nbFields);
    data.reserve(fc->nbFields);
    for (int32_t i = 0; i < fc->nbFields; ++i)
    {
        nvinfer1::PluginField const& f = fc->fields[i];
        names.emplace_back(f.name);
        auto const* bytes = static_cast<uint8_t const*>(f.data);
        data.emplace_back(bytes, bytes + fieldElementBytes(f.type) * f.length);
    }
    for (int32_t i = 0; i < fc->nbFields; ++i)
    {
        fields.emplace_back(names[i].c_str(), data[i].data(), fc->fields[i].type, fc->fields[i].length);
    }
    nvinfer1::PluginFieldCollection copy{fc->nbFields, fields.data()};
    return create(p->name.c_str(), copy, nvinfer1::TensorRTPhase::kRUNTIME);
}

/* The value of the scalar integer field `fieldName` among the plugin's serialized fields. */
HARNESS_API int harness_serialized_int(void* handle, char const* fieldName, int64_t* value)
{
    nvinfer1::PluginFieldCollection const* fc = serializedFields(use(handle));
    if (fc == nullptr)
    {
        return -1;
    }
    for (int32_t i = 0; i < fc->nbFields; ++i)
    {
        nvinfer1::PluginField const& f = fc->fields[i];
        if (f.name == nullptr || std::strcmp(f.name, fieldName) != 0)
        {
            continue;
        }
        if (f.length != 1)
        {
            return failWith(std::string("serialized field ") + fieldName + " is not a scalar");
        }
        switch (f.type)
        {
        case nvinfer1::PluginFieldType::kINT8: *value = *static_cast<int8_t const*>(f.data); return 0;
        case nvinfer1::PluginFieldType::kINT16: *value = *static_cast<int16_t const*>(f.data); return 0;
        case nvinfer1::PluginFieldType::kINT32: *value = *static_cast<int32_t const*>(f.data); return 0;
        case nvinfer1::PluginFieldType::kINT64: *value = *static_cast<int64_t const*>(f.data); return 0;
        default: return failWith(std::string("serialized field ") + fieldName + " is not an integer");
        }
    }
    return failWith(std::string("no serialized field ") + fieldName);
}

/*
 * Field `index` of the plugin's serialized fields: *nbFields receives their count; for an
 * index below it *name, *type (PluginFieldType) and *length receive the field's, and its
 * bytes (*nbBytes of them) are copied into `bytes` when `capacity` holds them.
 */
HARNESS_API int harness_serialized_field(void* handle, int32_t index, int32_t* nbFields, char const** name,
    int32_t* type, int32_t* length, void* bytes, uint64_t capacity, uint64_t* nbBytes)
{
    nvinfer1::PluginFieldCollection const* fc = serializedFields(use(handle));
    if (fc == nullptr)
    {
        return -1;
    }
    *nbFields = fc->nbFields;
    if (index < 0 || index >= fc->nbFields)
    {
        return 0;
    }
    nvinfer1::PluginField const& f = fc->fields[index];
    *name = f.name;
    *type = static_cast<int32_t>(f.type);
    *length = f.length;
    *nbBytes = fieldElementBytes(f.type) * static_cast<uint64_t>(f.length);
    if (*nbBytes > capacity)
    {
        return failWith(std::string("serialized field ") + f.name + " holds more than the buffer");
    }
    if (*nbBytes > 0)
    {
        std::memcpy(bytes, f.data, *nbBytes);
    }
    return 0;
}

HARNESS_API void harness_destroy(void* handle)
{
    delete static_cast<Plugin*>(handle);
}

/* Output dtypes (nvinfer1::DataType values) for the given input dtypes. */
HARNESS_API int harness_output_types(
    void* handle, int32_t nbInputs, int32_t const* inputTypes, int32_t nbOutputs, int32_t* outputTypes)
{
    auto* p = use(handle);
    if (p->build()->getNbOutputs() != nbOutputs)
    {
        return failWith("getNbOutputs disagrees with the caller");
    }
    std::vector<nvinfer1::DataType> in(nbInputs);
    std::vector<nvinfer1::DataType> out(nbOutputs);
    for (int32_t i = 0; i < nbInputs; ++i)
    {
        in[i] = static_cast<nvinfer1::DataType>(inputTypes[i]);
    }
    if (p->build()->getOutputDataTypes(out.data(), nbOutputs, in.data(), nbInputs) != 0)
    {
        return failWithLog("getOutputDataTypes failed");
    }
    for (int32_t i = 0; i < nbOutputs; ++i)
    {
        outputTypes[i] = static_cast<int32_t>(out[i]);
    }
    return 0;
}

/*
 * Output shapes for inputs of the given shapes (8 slots per input / output). Dim 0 of
 * every input is passed as a non-constant expression (the dynamic T); outIsConstant
 * says which output dims the plugin made constant.
 */
HARNESS_API int harness_output_shapes(void* handle, int32_t nbInputs, int32_t const* inNbDims, int64_t const* inDims,
    int32_t nbOutputs, int32_t* outNbDims, int64_t* outDims, int32_t* outIsConstant)
{
    auto* p = use(handle);
    ExprBuilder builder;
    std::vector<nvinfer1::DimsExprs> inputs(nbInputs);
    for (int32_t i = 0; i < nbInputs; ++i)
    {
        inputs[i].nbDims = inNbDims[i];
        for (int32_t k = 0; k < inNbDims[i]; ++k)
        {
            inputs[i].d[k] = builder.make(inDims[i * 8 + k], k != 0);
        }
    }
    std::vector<nvinfer1::DimsExprs> outputs(nbOutputs);
    if (p->build()->getOutputShapes(inputs.data(), nbInputs, nullptr, 0, outputs.data(), nbOutputs, builder) != 0)
    {
        return failWithLog("getOutputShapes failed");
    }
    for (int32_t o = 0; o < nbOutputs; ++o)
    {
        outNbDims[o] = outputs[o].nbDims;
        for (int32_t k = 0; k < outputs[o].nbDims; ++k)
        {
            if (outputs[o].d[k] == nullptr)
            {
                return failWith("getOutputShapes left an output dimension unset");
            }
            outDims[o * 8 + k] = static_cast<DimExpr const*>(outputs[o].d[k])->value();
            outIsConstant[o * 8 + k] = outputs[o].d[k]->isConstant() ? 1 : 0;
        }
    }
    return 0;
}

/*
 * The build-then-run sequence on concrete tensors (8 dim slots per tensor; types are
 * nvinfer1::DataType values). The plugin is configured with dim 0 dynamic (-1, min 1,
 * max = the given size), then a runtime clone (attachToContext) enqueues on `stream`.
 * *workspaceBytes receives getWorkspaceSize; workspace is allocated here when needed.
 */
HARNESS_API int harness_run(void* handle, int32_t nbInputs, int32_t const* inTypes, int32_t const* inNbDims,
    int64_t const* inDims, void const* const* inPtrs, int32_t nbOutputs, int32_t const* outTypes,
    int32_t const* outNbDims, int64_t const* outDims, void* const* outPtrs, void* stream, uint64_t* workspaceBytes)
{
    auto* p = use(handle);
    int32_t const total = nbInputs + nbOutputs;
    std::vector<nvinfer1::DynamicPluginTensorDesc> dyn(total);
    std::vector<nvinfer1::PluginTensorDesc> concrete(total);
    for (int32_t i = 0; i < total; ++i)
    {
        bool const isIn = i < nbInputs;
        int32_t const j = isIn ? i : i - nbInputs;
        nvinfer1::Dims const dims = makeDims(isIn ? inNbDims[j] : outNbDims[j], (isIn ? inDims : outDims) + j * 8);
        nvinfer1::DataType const type = static_cast<nvinfer1::DataType>(isIn ? inTypes[j] : outTypes[j]);
        concrete[i].dims = dims;
        concrete[i].type = type;
        concrete[i].format = nvinfer1::TensorFormat::kLINEAR;
        concrete[i].scale = -1.0F;
        dyn[i].desc = concrete[i];
        dyn[i].min = dims;
        dyn[i].opt = dims;
        dyn[i].max = dims;
        if (dims.nbDims > 0)
        {
            dyn[i].desc.dims.d[0] = -1;
            dyn[i].min.d[0] = 1;
        }
    }
    nvinfer1::IPluginV3OneBuild* build = p->build();
    for (int32_t pos = 0; pos < total; ++pos)
    {
        if (!build->supportsFormatCombination(pos, dyn.data(), nbInputs, nbOutputs))
        {
            return failWithLog("supportsFormatCombination rejected position " + std::to_string(pos));
        }
    }
    if (build->configurePlugin(dyn.data(), nbInputs, dyn.data() + nbInputs, nbOutputs) != 0)
    {
        return failWithLog("configurePlugin failed");
    }
    size_t const workspace = build->getWorkspaceSize(dyn.data(), nbInputs, dyn.data() + nbInputs, nbOutputs);
    *workspaceBytes = workspace;

    auto* runtimeCore = static_cast<nvinfer1::IPluginV3OneRuntime*>(
        p->plugin->getCapabilityInterface(nvinfer1::PluginCapabilityType::kRUNTIME));
    std::unique_ptr<nvinfer1::IPluginV3> attached(runtimeCore->attachToContext(nullptr));
    if (!attached)
    {
        return failWithLog("attachToContext returned null");
    }
    auto* runtime = static_cast<nvinfer1::IPluginV3OneRuntime*>(
        attached->getCapabilityInterface(nvinfer1::PluginCapabilityType::kRUNTIME));
    if (runtime->onShapeChange(concrete.data(), nbInputs, concrete.data() + nbInputs, nbOutputs) != 0)
    {
        return failWithLog("onShapeChange failed");
    }
    void* workspacePtr = nullptr;
    if (workspace > 0 && cudaMalloc(&workspacePtr, workspace) != cudaSuccess)
    {
        return failWith("cudaMalloc of the workspace failed");
    }
    int const status = runtime->enqueue(
        concrete.data(), concrete.data() + nbInputs, inPtrs, outPtrs, workspacePtr, static_cast<cudaStream_t>(stream));
    if (workspacePtr != nullptr)
    {
        cudaStreamSynchronize(static_cast<cudaStream_t>(stream));
        cudaFree(workspacePtr);
    }
    if (status != 0)
    {
        return failWithLog("enqueue failed");
    }
    return 0;
}

/*
 * The input an output aliases (IPluginV3OneBuildV2::getAliasedInput), as TensorRT asks it
 * with PreviewFeature::kALIASED_PLUGIN_IO_10_03: -1 for none, and for a plugin whose build
 * capability is version 1 (which has no such method). *buildMajor receives that version.
 */
HARNESS_API int harness_aliased_input(void* handle, int32_t outputIndex, int32_t* aliased, int32_t* buildMajor)
{
    auto* p = use(handle);
    nvinfer1::IPluginV3OneBuild* build = p->build();
    nvinfer1::InterfaceInfo const info = build->getInterfaceInfo();
    *buildMajor = info.major;
    if (std::strcmp(info.kind, "PLUGIN_V3ONE_BUILD") != 0)
    {
        return failWith(std::string("the build capability reports kind ") + info.kind);
    }
    *aliased = info.major >= 2 ? static_cast<nvinfer1::IPluginV3OneBuildV2*>(build)->getAliasedInput(outputIndex) : -1;
    return 0;
}
