/*
 * What the Engram plugins share: one object implements IPluginV3 and its three
 * capabilities (core, build, runtime), as the TensorRT OSS IPluginV3 plugins do; the
 * name, version "1", the empty namespace and the capability dispatch live here.
 * Plugins need no per-context resources, so attachToContext is a clone.
 * The build capability is a template parameter: IPluginV3OneBuild for most plugins,
 * IPluginV3OneBuildV2 for a plugin that updates an input in place (aliased I/O).
 */
#ifndef ENGRAM_TRT_PLUGIN_BASE_H
#define ENGRAM_TRT_PLUGIN_BASE_H

#include <NvInferRuntime.h>

#include <cstdint>
#include <string>

namespace engram_trt
{
namespace plugin
{

constexpr char const* kEngramPluginVersion = "1";
constexpr char const* kEngramPluginNamespace = "";

template <typename BuildCapability>
class EngramPluginBaseT : public nvinfer1::IPluginV3,
                          public nvinfer1::IPluginV3OneCore,
                          public BuildCapability,
                          public nvinfer1::IPluginV3OneRuntime
{
public:
    explicit EngramPluginBaseT(char const* pluginName)
        : mPluginName(pluginName)
    {
    }

    nvinfer1::IPluginCapability* getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept override
    {
        switch (type)
        {
        case nvinfer1::PluginCapabilityType::kCORE: return static_cast<nvinfer1::IPluginV3OneCore*>(this);
        case nvinfer1::PluginCapabilityType::kBUILD: return static_cast<BuildCapability*>(this);
        case nvinfer1::PluginCapabilityType::kRUNTIME: return static_cast<nvinfer1::IPluginV3OneRuntime*>(this);
        }
        return nullptr;
    }

    char const* getPluginName() const noexcept override
    {
        return mPluginName;
    }

    char const* getPluginVersion() const noexcept override
    {
        return kEngramPluginVersion;
    }

    char const* getPluginNamespace() const noexcept override
    {
        return kEngramPluginNamespace;
    }

    nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext* /*context*/) noexcept override
    {
        return clone();
    }

    int32_t getNbOutputs() const noexcept override
    {
        return 1;
    }

    int32_t onShapeChange(nvinfer1::PluginTensorDesc const* /*in*/, int32_t /*nbInputs*/,
        nvinfer1::PluginTensorDesc const* /*out*/, int32_t /*nbOutputs*/) noexcept override
    {
        return 0; // shapes are validated where they are used, in enqueue
    }

protected:
    char const* mPluginName;
};

//! The base of the plugins without aliased I/O.
using EngramPluginBase = EngramPluginBaseT<nvinfer1::IPluginV3OneBuild>;

//! The base of a plugin whose outputs alias inputs (getAliasedInput; TensorRT honours it
//! with PreviewFeature::kALIASED_PLUGIN_IO_10_03).
using EngramAliasingPluginBase = EngramPluginBaseT<nvinfer1::IPluginV3OneBuildV2>;

//! The creator half: name, version, namespace and the field list.
class EngramCreatorBase : public nvinfer1::IPluginCreatorV3One
{
public:
    explicit EngramCreatorBase(char const* pluginName)
        : mPluginName(pluginName)
    {
    }

    char const* getPluginName() const noexcept override
    {
        return mPluginName;
    }

    char const* getPluginVersion() const noexcept override
    {
        return kEngramPluginVersion;
    }

    char const* getPluginNamespace() const noexcept override
    {
        return kEngramPluginNamespace;
    }

protected:
    char const* mPluginName;
};

//! Product of dims (0 for an empty shape list is never asked for: callers check nbDims).
inline int64_t volume(nvinfer1::Dims const& dims)
{
    int64_t v = 1;
    for (int32_t i = 0; i < dims.nbDims; ++i)
    {
        v *= dims.d[i];
    }
    return v;
}

//! "[a, b, c]" for messages.
std::string dimsToString(nvinfer1::Dims const& dims);

} // namespace plugin
} // namespace engram_trt

#endif // ENGRAM_TRT_PLUGIN_BASE_H
