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
 * A plugin's parameters are one Config struct whose fields are a FieldTable
 * (fieldTable.h): the base holds the Config, serializes it through the table, and
 * clones the plugin by copy; EngramCreator lists the table's fields and parses them
 * into the Config the plugin is constructed from.
 */
#ifndef ENGRAM_TRT_PLUGIN_BASE_H
#define ENGRAM_TRT_PLUGIN_BASE_H

#include "checkMacros.h"
#include "fieldTable.h"
#include "pluginFields.h"

#include <NvInferRuntime.h>

#include <cstdint>
#include <string>
#include <utility>

namespace engram_trt
{
namespace plugin
{

constexpr char const* kEngramPluginVersion = "1";
constexpr char const* kEngramPluginNamespace = "engram_trt";

//! `Derived`: the plugin (clone copies it); `Config`: its parameters, the fields of the
//! table it is constructed with.
template <typename Derived, typename Config, typename BuildCapability>
class EngramPluginBaseT : public nvinfer1::IPluginV3,
                          public nvinfer1::IPluginV3OneCore,
                          public BuildCapability,
                          public nvinfer1::IPluginV3OneRuntime
{
public:
    EngramPluginBaseT(FieldTable<Config> const& fields, Config config, nvinfer1::TensorRTPhase phase)
        : mPluginName(fields.pluginName())
        , mPhase(phase)
        , mFields(fields)
        , mConfig(std::move(config))
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

    //! A copy: the same Config, the same phase, and whatever the plugin shares between
    //! its copies (a prepared layout).
    nvinfer1::IPluginV3* clone() noexcept override
    {
        ENGRAM_PLUGIN_TRY
        {
            return new Derived(static_cast<Derived const&>(*this));
        }
        ENGRAM_PLUGIN_CATCH(mPluginName, nullptr);
    }

    nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext* /*context*/) noexcept override
    {
        return clone();
    }

    //! The Config's fields, as the table declares them (what an engine stores).
    nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override
    {
        ENGRAM_PLUGIN_TRY
        {
            return mFields.serialize(mConfig, mSerialized);
        }
        ENGRAM_PLUGIN_CATCH(mPluginName, nullptr);
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
    FieldTable<Config> mFields;
    Config mConfig;

private:
    FieldWriter mSerialized; // what the last getFieldsToSerialize returned points into it
};

//! The base of the plugins without aliased I/O.
template <typename Derived, typename Config>
using EngramPluginBase = EngramPluginBaseT<Derived, Config, nvinfer1::IPluginV3OneBuild>;

//! The base of a plugin whose outputs alias inputs (getAliasedInput; TensorRT honours it
//! with PreviewFeature::kALIASED_PLUGIN_IO_10_03).
template <typename Derived, typename Config>
using EngramAliasingPluginBase = EngramPluginBaseT<Derived, Config, nvinfer1::IPluginV3OneBuildV2>;

//! The creator of `Plugin`, constructed as Plugin(Config, phase) from the fields of a
//! FieldTable<Config>: name, version, namespace, the field list and createPlugin.
template <typename Plugin, typename Config>
class EngramCreator : public nvinfer1::IPluginCreatorV3One
{
public:
    explicit EngramCreator(FieldTable<Config> const& fields)
        : mFields(fields)
        , mFieldNames(fields.specs())
    {
    }

    char const* getPluginName() const noexcept override
    {
        return mFields.pluginName();
    }

    char const* getPluginVersion() const noexcept override
    {
        return kEngramPluginVersion;
    }

    char const* getPluginNamespace() const noexcept override
    {
        return kEngramPluginNamespace;
    }

    nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override
    {
        return mFieldNames.collection();
    }

    nvinfer1::IPluginV3* createPlugin(char const* /*name*/, nvinfer1::PluginFieldCollection const* fc,
        nvinfer1::TensorRTPhase phase) noexcept override
    {
        ENGRAM_PLUGIN_TRY
        {
            return new Plugin(mFields.parse(fc), phase);
        }
        ENGRAM_PLUGIN_CATCH(mFields.pluginName(), nullptr);
    }

private:
    FieldTable<Config> mFields;
    FieldNames mFieldNames;
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
