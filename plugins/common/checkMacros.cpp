// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
#include "checkMacros.h"

#include <atomic>
#include <cstdio>

namespace engram_trt
{
namespace plugin
{

namespace detail
{
std::atomic<nvinfer1::ILoggerFinder*> gLoggerFinder{nullptr};
} // namespace detail

void throwPluginError(std::string const& message, char const* file, int line)
{
    throw PluginError(message + " (" + file + ":" + std::to_string(line) + ")");
}

void setLoggerFinder(nvinfer1::ILoggerFinder* finder)
{
    detail::gLoggerFinder.store(finder);
}

void log(nvinfer1::ILogger::Severity severity, std::string const& message)
{
    nvinfer1::ILoggerFinder* finder = detail::gLoggerFinder.load();
    nvinfer1::ILogger* logger = finder != nullptr ? finder->findLogger() : nullptr;
    if (logger != nullptr)
    {
        logger->log(severity, message.c_str());
    }
    else if (severity <= nvinfer1::ILogger::Severity::kERROR)
    {
        std::fprintf(stderr, "[engram-trt plugin] %s\n", message.c_str());
    }
}

} // namespace plugin
} // namespace engram_trt
