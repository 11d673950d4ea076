// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
#include "engramPluginBase.h"

namespace engram_trt
{
namespace plugin
{

std::string dimsToString(nvinfer1::Dims const& dims)
{
    std::string text = "[";
    for (int32_t i = 0; i < dims.nbDims; ++i)
    {
        text += (i > 0 ? ", " : "") + std::to_string(dims.d[i]);
    }
    return text + "]";
}

} // namespace plugin
} // namespace engram_trt
