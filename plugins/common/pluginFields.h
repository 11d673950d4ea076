// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * Plugin field parsing and serialization.
 *
 * An IPluginV3 plugin is serialized as a PluginFieldCollection (getFieldsToSerialize)
 * and rebuilt from one (IPluginCreatorV3One::createPlugin); the build-time fields come
 * from the ONNX parser, which converts each node attribute to the type the creator
 * declares in getFieldNames. FieldReader is strict in both directions: a required
 * field that is missing or given twice, an array of the wrong length, or a field left
 * unread (an attribute this plugin does not know, or a stale engine) are errors, so
 * whatever was serialized is consumed exactly. A plugin's fields are read and written
 * through its FieldTable (fieldTable.h), not field by field. Integer fields accept any integer width, floats any
 * float width, because exporters differ in what they emit; integers may also come as
 * decimal text (kCHAR, comma separated). That is how int64 arrays (the hash
 * multipliers, up to 2^63 / vocab) must travel through ONNX: the TensorRT ONNX parser
 * passes INTS attributes as int32 (truncating) and TENSOR attributes with a wrong
 * field type, whatever type getFieldNames declares; a STRING attribute arrives intact.
 */
#ifndef ENGRAM_TRT_PLUGIN_FIELDS_H
#define ENGRAM_TRT_PLUGIN_FIELDS_H

#include <NvInferRuntime.h>

#include <cstdint>
#include <string>
#include <vector>

namespace engram_trt
{
namespace plugin
{

class FieldReader
{
public:
    FieldReader(char const* pluginName, nvinfer1::PluginFieldCollection const* fields);

    //! A scalar integer field (any integer type, length 1).
    int64_t getInt(char const* name);

    //! A scalar integer field in [lo, hi]; a value outside is refused with the field's
    //! name and range.
    int64_t getInt(char const* name, int64_t lo, int64_t hi);

    //! A scalar float field (float32 or float64, length 1).
    double getFloat(char const* name);

    //! An integer array field of exactly `expectedLength` elements. With `needs64Bits`
    //! only kINT64 or decimal text is accepted: a narrower field may hold values that an
    //! exporter truncated, which no range check can detect.
    std::vector<int64_t> getInts(char const* name, int64_t expectedLength, bool needs64Bits = false);

    //! True when the collection holds a field of this name (for optional fields).
    bool has(char const* name) const;

    //! Throws unless every field of the collection has been read.
    void finish() const;

private:
    nvinfer1::PluginField const& take(char const* name);

    std::string mPluginName;
    nvinfer1::PluginFieldCollection const* mFields;
    std::vector<bool> mUsed;
};

//! Owns the data of the fields a plugin serializes. Names must be string literals.
class FieldWriter
{
public:
    FieldWriter() = default;
    //! A copy starts empty (a cloned plugin writes its fields anew): copied fields would
    //! point into the original's storage.
    FieldWriter(FieldWriter const& /*other*/) {}
    FieldWriter& operator=(FieldWriter const& other)
    {
        if (this != &other)
        {
            clear();
        }
        return *this;
    }

    void addInt32(char const* name, int32_t value);
    void addInt64(char const* name, int64_t value);
    void addFloat32(char const* name, float value);
    void addInt64s(char const* name, std::vector<int64_t> const& values);

    //! The collection; valid until the writer is cleared or destroyed.
    nvinfer1::PluginFieldCollection const* collection();

    void clear();

private:
    void add(char const* name, void const* data, size_t bytes, nvinfer1::PluginFieldType type, int32_t length);

    std::vector<std::vector<uint8_t>> mStorage;
    std::vector<nvinfer1::PluginField> mFields;
    nvinfer1::PluginFieldCollection mCollection{};
};

//! One entry of a creator's getFieldNames().
struct FieldSpec
{
    char const* name;
    nvinfer1::PluginFieldType type;
    int32_t length; // 1 for scalars; 0 for arrays whose length depends on other fields
};

//! Builds the static collection a creator returns from getFieldNames().
class FieldNames
{
public:
    explicit FieldNames(std::vector<FieldSpec> const& specs);
    nvinfer1::PluginFieldCollection const* collection() const
    {
        return &mCollection;
    }

private:
    std::vector<nvinfer1::PluginField> mFields;
    nvinfer1::PluginFieldCollection mCollection{};
};

//! Short name of a DataType for messages.
char const* dataTypeName(nvinfer1::DataType type);

} // namespace plugin
} // namespace engram_trt

#endif // ENGRAM_TRT_PLUGIN_FIELDS_H
