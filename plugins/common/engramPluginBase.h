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
 * IPluginV3OneBuildV2 for a plugin that updates an input in place (aliased I/O), whose
 * base, EngramAliasingPluginBase, holds the aliasing once.
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
#include "pluginTensors.h"

#include <NvInferRuntime.h>

#include <cstdint>
#include <string>
#include <utility>

namespace engram_trt
{
namespace plugin
{

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

//! One read-modify-write state of an aliasing plugin (a KV cache, a conv or recurrent
//! state): output `output` is input `input`'s memory; `name` is the input's, as the
//! messages give it.
struct AliasedState
{
    int32_t output;
    int32_t input;
    char const* name;
};

//! A plugin's states: a view of its table (a prefix of it where a field decides how many).
struct AliasedStates
{
    AliasedState const* first;
    int32_t count;

    AliasedState const* begin() const
    {
        return first;
    }
    AliasedState const* end() const
    {
        return first + count;
    }
};

//! The view of a plugin's whole table of states.
template <int32_t N>
constexpr AliasedStates statesOf(AliasedState const (&states)[N])
{
    return {states, N};
}

//! Whether two build-time shapes can be the same: the same rank, every dim dimMatches.
inline bool dimsMatch(nvinfer1::Dims const& a, nvinfer1::Dims const& b)
{
    if (a.nbDims != b.nbDims)
    {
        return false;
    }
    for (int32_t k = 0; k < a.nbDims; ++k)
    {
        if (!dimMatches(a.d[k], b.d[k]))
        {
            return false;
        }
    }
    return true;
}

//! The part of every aliasing plugin's I/O check (its checkIo) that is the same for all:
//! each state output has its state input's type and shape (what getOutputDataTypes and
//! getOutputShapes give it), where the method sees them (PluginIo). The state inputs
//! themselves are the plugin's to check, before this.
inline void checkAliasedStates(AliasedStates states, PluginIo const& io)
{
    for (AliasedState const& state : states)
    {
        if (io.hasOutputTypes)
        {
            nvinfer1::DataType const want = io.inTypes[state.input];
            nvinfer1::DataType const got = io.outTypes[state.output];
            ENGRAM_PLUGIN_CHECK(got == want,
                "the " << state.name << " output must be " << state.name << "'s type " << dataTypeName(want) << ", got "
                       << dataTypeName(got));
        }
        if (io.hasOutputDims)
        {
            nvinfer1::Dims const& want = io.inDims[state.input];
            nvinfer1::Dims const& got = io.outDims[state.output];
            ENGRAM_PLUGIN_CHECK(dimsMatch(got, want),
                "the " << state.name << " output must match " << state.name << " " << dimsToString(want) << ", got "
                       << dimsToString(got));
        }
    }
}

//! The base of a plugin whose outputs alias inputs: the runtime owns the states and each
//! step updates them in place. `Derived::aliasedStates()` lists them (its checkIo checks
//! the state outputs against them with checkAliasedStates); this base answers
//! getAliasedInput from that list (TensorRT honours it with
//! PreviewFeature::kALIASED_PLUGIN_IO_10_03) and copies the states where TensorRT did not
//! alias them (copyStatesUnlessAliased), the same way for every such plugin.
template <typename Derived, typename Config>
class EngramAliasingPluginBase : public EngramPluginBaseT<Derived, Config, nvinfer1::IPluginV3OneBuildV2>
{
public:
    using EngramPluginBaseT<Derived, Config, nvinfer1::IPluginV3OneBuildV2>::EngramPluginBaseT;

    //! The input whose memory output `outputIndex` is, -1 for an output of its own.
    int32_t getAliasedInput(int32_t outputIndex) noexcept override
    {
        for (AliasedState const& state : static_cast<Derived const&>(*this).aliasedStates())
        {
            if (state.output == outputIndex)
            {
                return state.input;
            }
        }
        return -1;
    }

protected:
    //! Called by enqueue after its I/O check, before the kernel. With the aliasing honoured
    //! each state output is its input's memory and nothing moves; without it TensorRT hands
    //! separate buffers, and the step stays correct by copying each state input over its
    //! output first (a whole-state copy per step, which the aliasing exists to avoid). The
    //! bytes are the input's, from its descriptor (dims and type, checked before).
    void copyStatesUnlessAliased(nvinfer1::PluginTensorDesc const* inputDesc, void const* const* inputs,
        void* const* outputs, cudaStream_t stream) const
    {
        for (AliasedState const& state : static_cast<Derived const&>(*this).aliasedStates())
        {
            nvinfer1::PluginTensorDesc const& in = inputDesc[state.input];
            size_t const bytes = static_cast<size_t>(volume(in.dims)) * elementBytes(in.type);
            ENGRAM_PLUGIN_CHECK_CUDA(copyUnlessAliased(outputs[state.output], inputs[state.input], bytes, stream));
        }
    }
};

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

} // namespace plugin
} // namespace engram_trt

#endif // ENGRAM_TRT_PLUGIN_BASE_H
