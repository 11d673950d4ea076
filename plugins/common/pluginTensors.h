// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * The tensor questions every Engram plugin asks the same way: which float types its
 * activations may take and their code in the kernel library, whether a build-time dim
 * (-1 while unknown) can be the one expected, the dims of a descriptor list, the common
 * part of supportsFormatCombination, the copy a state output needs when TensorRT did
 * not alias it to its input, and PluginIo: what one plugin method sees of the I/O, the one
 * argument of each plugin's checkIo. One definition each, so the plugins refuse alike.
 */
#ifndef ENGRAM_TRT_PLUGIN_TENSORS_H
#define ENGRAM_TRT_PLUGIN_TENSORS_H

#include "kernels/engramKernelsCore.h"

#include <NvInferRuntime.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <ostream>
#include <type_traits>

namespace engram_trt
{
namespace plugin
{

//! The activation types the float kernels take: bfloat16, float16, float32.
inline bool isFloatIoType(nvinfer1::DataType type)
{
    return type == nvinfer1::DataType::kBF16 || type == nvinfer1::DataType::kHALF || type == nvinfer1::DataType::kFLOAT;
}

//! The kernel library's code of a float type (ENGRAM_FLOAT_*), -1 for any other type
//! (which the library's checks refuse by name).
inline int32_t floatTypeCode(nvinfer1::DataType type)
{
    switch (type)
    {
    case nvinfer1::DataType::kBF16: return ENGRAM_FLOAT_BF16;
    case nvinfer1::DataType::kHALF: return ENGRAM_FLOAT_F16;
    case nvinfer1::DataType::kFLOAT: return ENGRAM_FLOAT_F32;
    default: return -1;
    }
}

//! Bytes per element of a tensor type (the types the plugins take: float, int, fp8, bool).
inline size_t elementBytes(nvinfer1::DataType type)
{
    switch (type)
    {
    case nvinfer1::DataType::kINT64: return 8;
    case nvinfer1::DataType::kFLOAT:
    case nvinfer1::DataType::kINT32: return 4;
    case nvinfer1::DataType::kHALF:
    case nvinfer1::DataType::kBF16: return 2;
    default: return 1; // kINT8, kUINT8, kBOOL, kFP8
    }
}

//! Bytes per element of a float activation type (4 for float32, else 2).
inline size_t floatElementBytes(nvinfer1::DataType type)
{
    return type == nvinfer1::DataType::kFLOAT ? 4 : 2;
}

//! Whether `dim` can be `expected`: at build time either may still be -1 (unknown); at
//! enqueue both are concrete and this is equality.
inline bool dimMatches(int64_t dim, int64_t expected)
{
    return dim == -1 || expected == -1 || dim == expected;
}

//! Whether `dim` can be at least `least`: -1 (unknown at build time) can.
inline bool dimAtLeast(int64_t dim, int64_t least)
{
    return dim == -1 || dim >= least;
}

//! A dim in a message: its value, or its symbol ("T", "S") while it is -1 (unknown at
//! build time). configurePlugin's "k must be [T, 2, 64]" and enqueue's "k must be [5, 2,
//! 64]" are one check's one message.
struct DimText
{
    DimText(int64_t dimValue, char const* dimSymbol)
        : value(dimValue)
        , symbol(dimSymbol)
    {
    }

    int64_t value;
    char const* symbol;
};

inline std::ostream& operator<<(std::ostream& os, DimText const& dim)
{
    if (dim.value == -1)
    {
        return os << dim.symbol;
    }
    return os << dim.value;
}

//! Whether two shapes are the same (rank and every dim).
inline bool sameDims(nvinfer1::Dims const& a, nvinfer1::Dims const& b)
{
    if (a.nbDims != b.nbDims)
    {
        return false;
    }
    for (int32_t k = 0; k < a.nbDims; ++k)
    {
        if (a.d[k] != b.d[k])
        {
            return false;
        }
    }
    return true;
}

//! The dims of the first `count` descriptors (PluginTensorDesc at enqueue,
//! DynamicPluginTensorDesc at configurePlugin) into `dims`.
template <typename Desc>
void copyDims(Desc const* desc, int32_t count, nvinfer1::Dims* dims)
{
    for (int32_t i = 0; i < count; ++i)
    {
        if constexpr (std::is_same_v<Desc, nvinfer1::DynamicPluginTensorDesc>)
        {
            dims[i] = desc[i].desc.dims;
        }
        else
        {
            dims[i] = desc[i].dims;
        }
    }
}

//! The part of supportsFormatCombination every plugin shares: the I/O counts are the
//! plugin's, `pos` names one of them and that tensor is linear (the only format the
//! kernels read). The type questions at `pos` are the plugin's own.
inline bool isLinearIoAt(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
    int32_t nbOutputs, int32_t expectedInputs, int32_t expectedOutputs)
{
    return nbInputs == expectedInputs && nbOutputs == expectedOutputs && pos >= 0 && pos < nbInputs + nbOutputs
        && inOut[pos].desc.format == nvinfer1::TensorFormat::kLINEAR;
}

//! What one plugin method sees of its I/O, for the plugin's one I/O check (checkIo): the
//! counts always; the input types (getOutputDataTypes, configurePlugin, enqueue); the
//! input dims (getOutputShapes: its constant expressions, -1 for the others;
//! configurePlugin: -1 where dynamic; enqueue: concrete); the output types and dims at
//! enqueue only (at build time they are what getOutputDataTypes / getOutputShapes made
//! them). dimMatches, dimAtLeast and DimText take the -1 of a build-time dim. The arrays
//! are filled only when the counts fit them: a count past kMaxIo is refused by the
//! plugin's count check before anything else is read.
struct PluginIo
{
    static constexpr int32_t kMaxIo = 24;

    int32_t nbInputs{0};
    int32_t nbOutputs{0};
    bool hasInputTypes{false};
    bool hasOutputTypes{false};
    bool hasInputDims{false};
    bool hasOutputDims{false};
    nvinfer1::DataType inTypes[kMaxIo]{};
    nvinfer1::DataType outTypes[kMaxIo]{};
    nvinfer1::Dims inDims[kMaxIo]{};
    nvinfer1::Dims outDims[kMaxIo]{};

    //! Whether the counts are `inputs` and `outputs` (the first question of every checkIo).
    bool counts(int32_t inputs, int32_t outputs) const
    {
        return nbInputs == inputs && nbOutputs == outputs;
    }

    //! getOutputDataTypes: the input types.
    static PluginIo ofTypes(nvinfer1::DataType const* inputTypes, int32_t nbInputs, int32_t nbOutputs)
    {
        PluginIo io = counted(nbInputs, nbOutputs);
        if (io.fits())
        {
            io.hasInputTypes = true;
            for (int32_t i = 0; i < nbInputs; ++i)
            {
                io.inTypes[i] = inputTypes[i];
            }
        }
        return io;
    }

    //! getOutputShapes: the input dims, a constant expression's value, -1 for the others.
    static PluginIo ofShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs, int32_t nbOutputs)
    {
        PluginIo io = counted(nbInputs, nbOutputs);
        if (io.fits())
        {
            io.hasInputDims = true;
            for (int32_t i = 0; i < nbInputs; ++i)
            {
                io.inDims[i].nbDims = inputs[i].nbDims;
                for (int32_t k = 0; k < inputs[i].nbDims && k < nvinfer1::Dims::MAX_DIMS; ++k)
                {
                    nvinfer1::IDimensionExpr const* d = inputs[i].d[k];
                    io.inDims[i].d[k] = d != nullptr && d->isConstant() ? d->getConstantValue() : -1;
                }
            }
        }
        return io;
    }

    //! configurePlugin: the input types and build-time dims (-1 where dynamic).
    static PluginIo ofConfigure(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs, int32_t nbOutputs)
    {
        PluginIo io = counted(nbInputs, nbOutputs);
        if (io.fits())
        {
            io.hasInputTypes = io.hasInputDims = true;
            copyDims(in, nbInputs, io.inDims);
            for (int32_t i = 0; i < nbInputs; ++i)
            {
                io.inTypes[i] = in[i].desc.type;
            }
        }
        return io;
    }

    //! enqueue: the types and concrete dims of every input and output.
    static PluginIo ofEnqueue(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs,
        nvinfer1::PluginTensorDesc const* out, int32_t nbOutputs)
    {
        PluginIo io = counted(nbInputs, nbOutputs);
        if (io.fits())
        {
            io.hasInputTypes = io.hasOutputTypes = io.hasInputDims = io.hasOutputDims = true;
            copyDims(in, nbInputs, io.inDims);
            copyDims(out, nbOutputs, io.outDims);
            for (int32_t i = 0; i < nbInputs; ++i)
            {
                io.inTypes[i] = in[i].type;
            }
            for (int32_t i = 0; i < nbOutputs; ++i)
            {
                io.outTypes[i] = out[i].type;
            }
        }
        return io;
    }

private:
    static PluginIo counted(int32_t nbInputs, int32_t nbOutputs)
    {
        PluginIo io;
        io.nbInputs = nbInputs;
        io.nbOutputs = nbOutputs;
        return io;
    }

    bool fits() const
    {
        return nbInputs >= 0 && nbOutputs >= 0 && nbInputs <= kMaxIo && nbOutputs <= kMaxIo;
    }
};

//! A state output (KV cache, conv or recurrent state) is read-modify-write. With the
//! aliasing honoured (PreviewFeature::kALIASED_PLUGIN_IO_10_03) it is its input's memory
//! and nothing moves; without it the step copies the input's `bytes` over first.
inline cudaError_t copyUnlessAliased(void* out, void const* in, size_t bytes, cudaStream_t stream)
{
    if (out == in || bytes == 0)
    {
        return cudaSuccess;
    }
    return cudaMemcpyAsync(out, in, bytes, cudaMemcpyDeviceToDevice, stream);
}

} // namespace plugin
} // namespace engram_trt

#endif // ENGRAM_TRT_PLUGIN_TENSORS_H
