// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * The library's registration entry points, looked up by
 * IPluginRegistry::loadLibrary (TensorRT and TensorRT-RTX): getCreators hands out the
 * IPluginCreatorV3One creators, one per plugin (namespace "engram_trt"), setLoggerFinder
 * gives the plugins TensorRT's logger. These two and the kernels' C ABI are the only exported symbols.
 */
#include "common/checkMacros.h"
#include "engramAttentionPlugin/engramAttentionPlugin.h"
#include "engramCausalConv1dPlugin/engramCausalConv1dPlugin.h"
#include "engramDsv4AttentionPlugin/engramDsv4AttentionPlugin.h"
#include "engramGatePlugin/engramGatePlugin.h"
#include "engramGatedDeltaNetPlugin/engramGatedDeltaNetPlugin.h"
#include "engramGatherPlugin/engramGatherPlugin.h"
#include "engramHashPlugin/engramHashPlugin.h"
#include "engramPleFusionPlugin/engramPleFusionPlugin.h"
#include "engramPleHashPlugin/engramPleHashPlugin.h"
#include "engramQsaAttentionPlugin/engramQsaAttentionPlugin.h"
#include "engramRoutedExpertsPlugin/engramRoutedExpertsPlugin.h"
#include "kernels/engramKernelsCore.h"

extern "C" ENGRAM_API void setLoggerFinder(nvinfer1::ILoggerFinder* finder)
{
    engram_trt::plugin::setLoggerFinder(finder);
}

extern "C" ENGRAM_API nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators)
{
    static engram_trt::plugin::EngramHashPluginCreator hashCreator;
    static engram_trt::plugin::EngramGatherPluginCreator gatherCreator;
    static engram_trt::plugin::EngramGatePluginCreator gateCreator;
    static engram_trt::plugin::EngramAttentionPluginCreator attentionCreator;
    static engram_trt::plugin::EngramPleHashPluginCreator pleHashCreator;
    static engram_trt::plugin::EngramPleFusionPluginCreator pleFusionCreator;
    static engram_trt::plugin::EngramCausalConv1dPluginCreator causalConv1dCreator;
    static engram_trt::plugin::EngramGatedDeltaNetPluginCreator gatedDeltaNetCreator;
    static engram_trt::plugin::EngramQsaAttentionPluginCreator qsaAttentionCreator;
    static engram_trt::plugin::EngramDsv4AttentionPluginCreator dsv4AttentionCreator;
    static engram_trt::plugin::EngramRoutedExpertsPluginCreator routedExpertsCreator;
    static nvinfer1::IPluginCreatorInterface* const creators[] = {&hashCreator, &gatherCreator, &gateCreator,
        &attentionCreator, &pleHashCreator, &pleFusionCreator, &causalConv1dCreator, &gatedDeltaNetCreator,
        &qsaAttentionCreator, &dsv4AttentionCreator, &routedExpertsCreator};
    nbCreators = static_cast<int32_t>(sizeof(creators) / sizeof(creators[0]));
    return creators;
}
