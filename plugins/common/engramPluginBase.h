// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * What the Engram plugins share: one object implements IPluginV3 and its three
 * capabilities (core, build, runtime), as the TensorRT OSS IPluginV3 plugins do; the
 * name, version "1", the namespace "engram_trt" (so the creators cannot collide with
 * another library's plugins of the same names), the TensorRT phase the plugin was
 * created in, and the capability dispatch live here. Plugins need no per-context
 * resources, so attachToContext is a clone; a clone keeps the phase, so every object
 * TensorRT derives from a build-phase plugin (for timing enqueues during the build)
 * knows it serves a build.
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
constexpr char const* kEngramPluginNamespace = "engram_trt";

template <typename BuildCapability>
class EngramPluginBaseT : public nvinfer1::IPluginV3,
                          public nvinfer1::IPluginV3OneCore,
                          public BuildCapability,
                          public nvinfer1::IPluginV3OneRuntime
{
public:
    EngramPluginBaseT(char const* pluginName, nvinfer1::TensorRTPhase phase)
        : mPluginName(pluginName)
        , mPhase(phase)
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

    //! The phase given to the creator's createPlugin (kBUILD: made for a network being
    //! built, whose enqueues TensorRT runs on made-up inputs; kRUNTIME: deserialized).
    nvinfer1::TensorRTPhase phase() const
    {
        return mPhase;
    }

protected:
    char const* mPluginName;
    nvinfer1::TensorRTPhase mPhase;
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
