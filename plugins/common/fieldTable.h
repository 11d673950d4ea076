// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * A plugin's fields as one table.
 *
 * Each plugin lists its fields once, as Field descriptors of its Config struct (the
 * member, the name, bounds, and for arrays the length the fields before them imply); the
 * creator's getFieldNames, the parsing in createPlugin and getFieldsToSerialize all
 * come from that table, so a field cannot be declared with one type, parsed with
 * another and serialized with a third, or be forgotten by one of the three.
 *
 *   constexpr Field<GateConfig> kFieldList[] = {
 *       field<&GateConfig::hcMult>("hc_mult", 1, kMaxHcMult),
 *       field<&GateConfig::hiddenSize>("hidden_size", 8),
 *       field<&GateConfig::eps>("eps"),
 *   };
 *   constexpr FieldTable<GateConfig> kFields{"EngramGate", kFieldList};
 *
 * Fields are parsed in table order, so a length or default may use the fields before
 * it, and they are serialized in that order, in their declared type. Every check of a
 * single field (missing, wrong type or length, out of range, unknown, given twice) is
 * FieldReader's (pluginFields.h) and names the field; checks across fields stay with
 * the plugin, which sees the parsed Config, and name the fields they refer to through
 * the table (nameOf), so a field's name is spelled in its table alone:
 *
 *   constexpr char const* kHiddenSize = kFields.nameOf<&GateConfig::hiddenSize>();
 */
#ifndef ENGRAM_TRT_FIELD_TABLE_H
#define ENGRAM_TRT_FIELD_TABLE_H

#include "pluginFields.h"

#include <NvInferRuntime.h>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <type_traits>
#include <vector>

namespace engram_trt
{
namespace plugin
{

//! One field of a plugin whose parameters are a Config struct. Made by field() and
//! arrayField() below, which bind it to a member of the Config at compile time.
template <typename Config>
struct Field
{
    //! A value computed from the fields parsed before this one.
    using FromEarlier = int64_t (*)(Config const&);
    using Read = void (*)(Field const&, FieldReader&, Config&);
    using Write = void (*)(Field const&, Config const&, FieldWriter&);

    char const* name;
    nvinfer1::PluginFieldType type; //!< as declared in getFieldNames and serialized
    int32_t length;                 //!< 1 for scalars; 0 for arrays (the length follows from other fields)
    int64_t lo;                     //!< integer scalars: the accepted range, checked before narrowing
    int64_t hi;
    FromEarlier count;    //!< arrays: the number of values
    bool needs64Bits;     //!< arrays: only kINT64 or decimal text (FieldReader::getInts)
    FromEarlier fallback; //!< optional scalars: the value when absent; nullptr: required
    Read read;
    Write write;

    //! This scalar field, optional: when absent it takes `defaultValue` of the fields
    //! before it (an engine or graph made before the field existed omits it).
    constexpr Field optional(FromEarlier defaultValue) const
    {
        Field copy = *this;
        copy.fallback = defaultValue;
        return copy;
    }

    //! This scalar field, optional: when absent it is 0 (false).
    constexpr Field optional() const
    {
        return optional(&zero);
    }

private:
    static int64_t zero(Config const& /*config*/)
    {
        return 0;
    }
};

namespace detail
{

template <typename MemberPointer>
struct MemberOf;

template <typename C, typename V>
struct MemberOf<V C::*>
{
    using Config = C;
    using Value = V;
};

template <auto Member>
using ConfigOf = typename MemberOf<decltype(Member)>::Config;

template <auto Member>
using ValueOf = typename MemberOf<decltype(Member)>::Value;

//! An integer scalar: its default when optional and absent, else the field in [lo, hi].
template <typename Config>
int64_t readInteger(Field<Config> const& f, FieldReader& reader, Config const& config)
{
    return f.fallback != nullptr && !reader.has(f.name) ? f.fallback(config) : reader.getInt(f.name, f.lo, f.hi);
}

//! How a member type is declared, read and written.
template <typename Value>
struct Codec;

//! An integer scalar, range-checked before it is narrowed: int64 (a kINT64 field), int32
//! or bool (a kINT32 field; a flag is 0 or 1, false or true).
template <typename Int>
struct IntegerCodec
{
    static constexpr nvinfer1::PluginFieldType kType
        = sizeof(Int) == 8 ? nvinfer1::PluginFieldType::kINT64 : nvinfer1::PluginFieldType::kINT32;
    static constexpr int64_t kLo = std::numeric_limits<Int>::min();
    static constexpr int64_t kHi = std::numeric_limits<Int>::max();
    template <typename Config>
    static Int read(Field<Config> const& f, FieldReader& reader, Config const& config)
    {
        return static_cast<Int>(readInteger(f, reader, config)); // in [lo, hi], within Int
    }
    static void write(char const* name, Int value, FieldWriter& writer)
    {
        if constexpr (sizeof(Int) == 8)
        {
            writer.addInt64(name, value);
        }
        else
        {
            writer.addInt32(name, static_cast<int32_t>(value));
        }
    }
};

template <>
struct Codec<int32_t> : IntegerCodec<int32_t>
{
};

template <>
struct Codec<int64_t> : IntegerCodec<int64_t>
{
};

template <>
struct Codec<bool> : IntegerCodec<bool>
{
};

//! A float32 field (read from float32 or float64; its range is the plugin's to check).
template <>
struct Codec<float>
{
    static constexpr nvinfer1::PluginFieldType kType = nvinfer1::PluginFieldType::kFLOAT32;
    static constexpr int64_t kLo = 0;
    static constexpr int64_t kHi = 0;
    template <typename Config>
    static float read(Field<Config> const& f, FieldReader& reader, Config const& config)
    {
        bool const absent = f.fallback != nullptr && !reader.has(f.name);
        return static_cast<float>(absent ? static_cast<double>(f.fallback(config)) : reader.getFloat(f.name));
    }
    static void write(char const* name, float value, FieldWriter& writer)
    {
        writer.addFloat32(name, value);
    }
};

//! An int64 array of `count(the fields before it)` values.
template <>
struct Codec<std::vector<int64_t>>
{
    static constexpr nvinfer1::PluginFieldType kType = nvinfer1::PluginFieldType::kINT64;
    template <typename Config>
    static std::vector<int64_t> read(Field<Config> const& f, FieldReader& reader, Config const& config)
    {
        // The count is computed before the field is looked up: it may refuse the fields
        // before it, and that is then the reason given.
        int64_t const count = f.count(config);
        return reader.getInts(f.name, count, f.needs64Bits);
    }
    static void write(char const* name, std::vector<int64_t> const& values, FieldWriter& writer)
    {
        writer.addInt64s(name, values);
    }
};

template <auto Member>
void readMember(Field<ConfigOf<Member>> const& f, FieldReader& reader, ConfigOf<Member>& config)
{
    config.*Member = Codec<ValueOf<Member>>::read(f, reader, config);
}

template <auto Member>
void writeMember(Field<ConfigOf<Member>> const& f, ConfigOf<Member> const& config, FieldWriter& writer)
{
    Codec<ValueOf<Member>>::write(f.name, config.*Member, writer);
}

} // namespace detail

//! A scalar field stored in `Member` (int32_t, int64_t, bool or float), integers in
//! [lo, hi] (by default the member type's range; a bool's is [0, 1]).
template <auto Member>
constexpr Field<detail::ConfigOf<Member>> field(char const* name,
    int64_t lo = detail::Codec<detail::ValueOf<Member>>::kLo, int64_t hi = detail::Codec<detail::ValueOf<Member>>::kHi)
{
    using Codec = detail::Codec<detail::ValueOf<Member>>;
    static_assert(!std::is_same<detail::ValueOf<Member>, std::vector<int64_t>>::value, "an array: arrayField()");
    if (lo > hi || lo < Codec::kLo || hi > Codec::kHi)
    {
        // bounds the member cannot hold would be narrowed; in a constexpr table, a compile error
        throw std::logic_error("field bounds outside the member type's range");
    }
    return {name, Codec::kType, 1, lo, hi, nullptr, false, nullptr, &detail::readMember<Member>,
        &detail::writeMember<Member>};
}

//! An int64 array field stored in `Member` (std::vector<int64_t>) of `count(the fields
//! before it)` values; `needs64Bits`: see FieldReader::getInts.
template <auto Member>
constexpr Field<detail::ConfigOf<Member>> arrayField(
    char const* name, typename Field<detail::ConfigOf<Member>>::FromEarlier count, bool needs64Bits = false)
{
    static_assert(std::is_same<detail::ValueOf<Member>, std::vector<int64_t>>::value, "a scalar: field()");
    return {name, nvinfer1::PluginFieldType::kINT64, 0, 0, 0, count, needs64Bits, nullptr, &detail::readMember<Member>,
        &detail::writeMember<Member>};
}

//! The fields of one plugin, in the order they are declared, parsed and serialized.
template <typename Config>
class FieldTable
{
public:
    template <size_t N>
    constexpr FieldTable(char const* pluginName, Field<Config> const (&fields)[N])
        : mPluginName(pluginName)
        , mFields(fields)
        , mCount(N)
    {
    }

    char const* pluginName() const
    {
        return mPluginName;
    }

    //! The name of the field stored in `Member`, as the table declares it, for the checks
    //! across fields to name it. Meant for a constant expression (constexpr char const*
    //! kHeadDim = kFields.nameOf<&Config::headDim>()), where a member that no field of
    //! the table stores is a compile error.
    template <auto Member>
    constexpr char const* nameOf() const
    {
        static_assert(std::is_same<detail::ConfigOf<Member>, Config>::value, "a member of another Config");
        for (size_t i = 0; i < mCount; ++i)
        {
            if (mFields[i].read == &detail::readMember<Member>) // one reader per member
            {
                return mFields[i].name;
            }
        }
        throw std::logic_error("no field of the table stores this member");
    }

    //! The creator's getFieldNames entries: each field's name, type and length.
    std::vector<FieldSpec> specs() const
    {
        std::vector<FieldSpec> specs;
        for (size_t i = 0; i < mCount; ++i)
        {
            specs.push_back({mFields[i].name, mFields[i].type, mFields[i].length});
        }
        return specs;
    }

    //! createPlugin's Config: every field read in table order, then none may be left.
    Config parse(nvinfer1::PluginFieldCollection const* collection) const
    {
        FieldReader reader(mPluginName, collection);
        Config config{};
        for (size_t i = 0; i < mCount; ++i)
        {
            mFields[i].read(mFields[i], reader, config);
        }
        reader.finish();
        return config;
    }

    //! getFieldsToSerialize: every field in table order and declared type, held by `writer`.
    nvinfer1::PluginFieldCollection const* serialize(Config const& config, FieldWriter& writer) const
    {
        writer.clear();
        for (size_t i = 0; i < mCount; ++i)
        {
            mFields[i].write(mFields[i], config, writer);
        }
        return writer.collection();
    }

private:
    char const* mPluginName;
    Field<Config> const* mFields;
    size_t mCount;
};

} // namespace plugin
} // namespace engram_trt

#endif // ENGRAM_TRT_FIELD_TABLE_H
