// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * EngramGather (version "1", namespace "engram_trt"): row ids of one layer -> rows
 * (bf16 for an fp8 table, dequantized; the table's dtype for a bf16 / f16 / f32 table of
 * any width), read from a table whose addresses are engine inputs (int64), so tables never
 * enter an engine. An optional last input holds the address of a device int64 that
 * counts the rows that read nothing. A plugin created for a build (TensorRTPhase::kBUILD,
 * and every clone of it) never dereferences an address: TensorRT times it on made-up
 * inputs, so its enqueue writes zero rows. A tensor-parallel rank's engine gathers only
 * its columns [column_begin, column_end) from its row slice (global rows [row_offset,
 * row_offset + num_rows)); the defaults are every column of the whole table. The math is
 * engram_gather_indirect_ex() of the kernel library. See README.md.
 */
#ifndef ENGRAM_TRT_GATHER_PLUGIN_H
#define ENGRAM_TRT_GATHER_PLUGIN_H

#include "common/engramPluginBase.h"

namespace engram_trt
{
namespace plugin
{

struct GatherConfig
{
    int32_t layerIndex{0}; // which layer of the [T, L, cols] hash output
    int32_t numLayers{0};  // L
    int32_t numCols{0};    // n_hash_cols
    int32_t headDim{0};
    int32_t tableDtype{0}; // EngramTableDtype
    int32_t quantBlock{0};
    int64_t numRows{0};     // rows of this layer's table (sum of its primes), or of the rank's slice of it
    int32_t columnBegin{0}; // the columns [columnBegin, columnEnd) of the layer that are gathered
    int32_t columnEnd{0};   // (the creator's default: numCols)
    int64_t rowOffset{0};   // global row id of the bound table's first row (a rank's slice; 0: the whole table)

    bool badRowsInput{false}; // the node's last input holds the bad-row counter's address

    bool fp8() const;
    //! The output's type: bf16 for fp8 and bf16 tables, else the table's dtype.
    nvinfer1::DataType outType() const;
    int32_t outElemBytes() const;
    //! Columns of the output, columnEnd - columnBegin.
    int32_t outCols() const
    {
        return columnEnd - columnBegin;
    }
    //! ids, rows address (, scales address) (, bad-row counter address).
    int32_t numInputs() const
    {
        return (fp8() ? 3 : 2) + (badRowsInput ? 1 : 0);
    }
    //! Index of the counter-address input (valid when badRowsInput).
    int32_t badRowsIndex() const
    {
        return fp8() ? 3 : 2;
    }
};

class EngramGatherPlugin : public EngramPluginBase<EngramGatherPlugin, GatherConfig>
{
public:
    EngramGatherPlugin(GatherConfig const& config, nvinfer1::TensorRTPhase phase);

    int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs, nvinfer1::DataType const* inputTypes,
        int32_t nbInputs) const noexcept override;
    int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs, nvinfer1::DimsExprs const* shapeInputs,
        int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
        nvinfer1::IExprBuilder& exprBuilder) noexcept override;
    bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
        int32_t nbOutputs) noexcept override;
    int32_t configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
        void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;
};

class EngramGatherPluginCreator : public EngramCreator<EngramGatherPlugin, GatherConfig>
{
public:
    EngramGatherPluginCreator();
};

} // namespace plugin
} // namespace engram_trt

#endif // ENGRAM_TRT_GATHER_PLUGIN_H
