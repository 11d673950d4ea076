// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
#include "pluginFields.h"
#include "checkMacros.h"

#include <cstring>

namespace engram_trt
{
namespace plugin
{

using nvinfer1::PluginField;
using nvinfer1::PluginFieldType;

namespace detail
{

bool isIntegerType(PluginFieldType type)
{
    return type == PluginFieldType::kINT8 || type == PluginFieldType::kINT16 || type == PluginFieldType::kINT32
        || type == PluginFieldType::kINT64;
}

int64_t readInteger(PluginField const& field, int32_t index)
{
    switch (field.type)
    {
    case PluginFieldType::kINT8: return static_cast<int8_t const*>(field.data)[index];
    case PluginFieldType::kINT16: return static_cast<int16_t const*>(field.data)[index];
    case PluginFieldType::kINT32: return static_cast<int32_t const*>(field.data)[index];
    case PluginFieldType::kINT64: return static_cast<int64_t const*>(field.data)[index];
    default: break;
    }
    ENGRAM_PLUGIN_FAIL("field '" << field.name << "' is not an integer field");
}

//! Integers written as decimal text, separated by commas and/or spaces.
std::vector<int64_t> parseIntegerText(PluginField const& field)
{
    char const* const separators = ", \t\n";
    std::string const text(static_cast<char const*>(field.data), static_cast<size_t>(field.length));
    std::vector<int64_t> values;
    size_t pos = 0;
    while (true)
    {
        pos = text.find_first_not_of(separators, pos);
        if (pos == std::string::npos || text[pos] == '\0')
        {
            break;
        }
        // A value must be followed by a separator or the end: otherwise "12-3" would
        // read as 12 and -3, and "12x" as 12.
        ENGRAM_PLUGIN_CHECK(values.empty() || std::strchr(separators, text[pos - 1]) != nullptr,
            "field '" << field.name << "' holds text that is not a list of integers (no separator before '"
                      << text.substr(pos, 16) << "')");
        size_t used = 0;
        long long value = 0;
        try
        {
            value = std::stoll(text.substr(pos), &used, 10);
        }
        catch (std::exception const&)
        {
            used = 0;
        }
        ENGRAM_PLUGIN_CHECK(used > 0, "field '" << field.name << "' holds text that is not a list of integers");
        values.push_back(value);
        pos += used;
    }
    return values;
}

} // namespace detail

FieldReader::FieldReader(char const* pluginName, nvinfer1::PluginFieldCollection const* fields)
    : mPluginName(pluginName)
    , mFields(fields)
{
    ENGRAM_PLUGIN_CHECK(fields != nullptr, "no field collection");
    ENGRAM_PLUGIN_CHECK(fields->nbFields == 0 || fields->fields != nullptr, "field collection without fields");
    mUsed.assign(static_cast<size_t>(fields->nbFields), false);
}

PluginField const& FieldReader::take(char const* name)
{
    int32_t found = -1;
    for (int32_t i = 0; i < mFields->nbFields; ++i)
    {
        char const* fieldName = mFields->fields[i].name;
        if (fieldName != nullptr && std::strcmp(fieldName, name) == 0)
        {
            ENGRAM_PLUGIN_CHECK(found < 0, "field '" << name << "' given twice");
            found = i;
        }
    }
    ENGRAM_PLUGIN_CHECK(found >= 0, "missing field '" << name << "'");
    PluginField const& field = mFields->fields[found];
    ENGRAM_PLUGIN_CHECK(field.data != nullptr && field.length >= 1, "field '" << name << "' is empty");
    mUsed[found] = true;
    return field;
}

int64_t FieldReader::getInt(char const* name, int64_t lo, int64_t hi)
{
    int64_t const value = getInt(name);
    ENGRAM_PLUGIN_CHECK(
        lo <= value && value <= hi, "field '" << name << "' = " << value << " is outside [" << lo << ", " << hi << "]");
    return value;
}

int64_t FieldReader::getInt(char const* name)
{
    PluginField const& field = take(name);
    if (field.type == PluginFieldType::kCHAR)
    {
        std::vector<int64_t> const values = detail::parseIntegerText(field);
        ENGRAM_PLUGIN_CHECK(values.size() == 1, "field '" << name << "' must hold 1 integer");
        return values[0];
    }
    ENGRAM_PLUGIN_CHECK(detail::isIntegerType(field.type), "field '" << name << "' must be an integer");
    ENGRAM_PLUGIN_CHECK(field.length == 1, "field '" << name << "' must hold 1 value, not " << field.length);
    return detail::readInteger(field, 0);
}

double FieldReader::getFloat(char const* name)
{
    PluginField const& field = take(name);
    ENGRAM_PLUGIN_CHECK(field.length == 1, "field '" << name << "' must hold 1 value, not " << field.length);
    if (field.type == PluginFieldType::kFLOAT32)
    {
        return *static_cast<float const*>(field.data);
    }
    ENGRAM_PLUGIN_CHECK(field.type == PluginFieldType::kFLOAT64, "field '" << name << "' must be a float");
    return *static_cast<double const*>(field.data);
}

std::vector<int64_t> FieldReader::getInts(char const* name, int64_t expectedLength, bool needs64Bits)
{
    PluginField const& field = take(name);
    if (field.type == PluginFieldType::kCHAR)
    {
        std::vector<int64_t> values = detail::parseIntegerText(field);
        ENGRAM_PLUGIN_CHECK(static_cast<int64_t>(values.size()) == expectedLength,
            "field '" << name << "' must hold " << expectedLength << " values, not " << values.size());
        return values;
    }
    ENGRAM_PLUGIN_CHECK(detail::isIntegerType(field.type),
        "field '" << name << "' must be integers (got PluginFieldType " << static_cast<int>(field.type) << ", length "
                  << field.length << ")");
    ENGRAM_PLUGIN_CHECK(!needs64Bits || field.type == PluginFieldType::kINT64,
        "field '" << name << "' needs 64-bit integers but came as a narrower type (an ONNX INTS attribute is "
                  << "narrowed to int32 by the parser: export it as a STRING attribute of comma-separated decimals)");
    ENGRAM_PLUGIN_CHECK(field.length == expectedLength,
        "field '" << name << "' must hold " << expectedLength << " values, not " << field.length);
    std::vector<int64_t> values(static_cast<size_t>(field.length));
    for (int32_t i = 0; i < field.length; ++i)
    {
        values[i] = detail::readInteger(field, i);
    }
    return values;
}

bool FieldReader::has(char const* name) const
{
    for (int32_t i = 0; i < mFields->nbFields; ++i)
    {
        char const* fieldName = mFields->fields[i].name;
        if (fieldName != nullptr && std::strcmp(fieldName, name) == 0)
        {
            return true;
        }
    }
    return false;
}

void FieldReader::finish() const
{
    std::string unknown;
    for (int32_t i = 0; i < mFields->nbFields; ++i)
    {
        if (!mUsed[i])
        {
            char const* name = mFields->fields[i].name;
            unknown += (unknown.empty() ? "" : ", ") + std::string(name != nullptr ? name : "<unnamed>");
        }
    }
    ENGRAM_PLUGIN_CHECK(unknown.empty(), "unknown field(s) " << unknown << " for plugin " << mPluginName);
}

void FieldWriter::add(char const* name, void const* data, size_t bytes, PluginFieldType type, int32_t length)
{
    std::vector<uint8_t> storage(bytes);
    std::memcpy(storage.data(), data, bytes);
    mStorage.push_back(std::move(storage)); // moving keeps the heap buffer, so earlier fields stay valid
    mFields.emplace_back(name, mStorage.back().data(), type, length);
}

void FieldWriter::addInt32(char const* name, int32_t value)
{
    add(name, &value, sizeof(value), PluginFieldType::kINT32, 1);
}

void FieldWriter::addInt64(char const* name, int64_t value)
{
    add(name, &value, sizeof(value), PluginFieldType::kINT64, 1);
}

void FieldWriter::addFloat32(char const* name, float value)
{
    add(name, &value, sizeof(value), PluginFieldType::kFLOAT32, 1);
}

void FieldWriter::addInt64s(char const* name, std::vector<int64_t> const& values)
{
    add(name, values.data(), values.size() * sizeof(int64_t), PluginFieldType::kINT64,
        static_cast<int32_t>(values.size()));
}

nvinfer1::PluginFieldCollection const* FieldWriter::collection()
{
    mCollection.nbFields = static_cast<int32_t>(mFields.size());
    mCollection.fields = mFields.data();
    return &mCollection;
}

void FieldWriter::clear()
{
    mFields.clear();
    mStorage.clear();
    mCollection = nvinfer1::PluginFieldCollection{};
}

FieldNames::FieldNames(std::vector<FieldSpec> const& specs)
{
    for (FieldSpec const& spec : specs)
    {
        mFields.emplace_back(spec.name, nullptr, spec.type, spec.length);
    }
    mCollection.nbFields = static_cast<int32_t>(mFields.size());
    mCollection.fields = mFields.data();
}

char const* dataTypeName(nvinfer1::DataType type)
{
    switch (type)
    {
    case nvinfer1::DataType::kFLOAT: return "float32";
    case nvinfer1::DataType::kHALF: return "float16";
    case nvinfer1::DataType::kINT8: return "int8";
    case nvinfer1::DataType::kINT32: return "int32";
    case nvinfer1::DataType::kBOOL: return "bool";
    case nvinfer1::DataType::kUINT8: return "uint8";
    case nvinfer1::DataType::kFP8: return "fp8";
    case nvinfer1::DataType::kBF16: return "bfloat16";
    case nvinfer1::DataType::kINT64: return "int64";
    default: return "other";
    }
}

} // namespace plugin
} // namespace engram_trt
