// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
/*
 * Validation, logging and CUDA status helpers shared by the Engram plugins.
 *
 * TensorRT calls plugin methods through noexcept virtuals, so a plugin validates by
 * throwing PluginError inside the method and converting it at the method's boundary
 * (ENGRAM_PLUGIN_TRY / ENGRAM_PLUGIN_CATCH) into a logged error and the method's
 * failure value. Every message thrown through the macros below ends with the source
 * file and line that raised it, "... (engramGatherPlugin.cpp:123)", as TensorRT's own
 * plugin checks do.
 */
#ifndef ENGRAM_TRT_PLUGIN_CHECK_MACROS_H
#define ENGRAM_TRT_PLUGIN_CHECK_MACROS_H

#include "kernels/sourceFileName.h"
#include <NvInferRuntime.h>
#include <cuda_runtime_api.h>

#include <sstream>
#include <stdexcept>
#include <string>

namespace engram_trt
{
namespace plugin
{

//! A plugin argument or state that cannot be served; its what() is one line.
class PluginError : public std::runtime_error
{
public:
    using std::runtime_error::runtime_error;
};

using ::engram_trt::sourceFileName;

//! Throws PluginError("<message> (<file>:<line>)").
[[noreturn]] void throwPluginError(std::string const& message, char const* file, int line);

//! Installs the logger finder handed over by TensorRT (setLoggerFinder).
void setLoggerFinder(nvinfer1::ILoggerFinder* finder);

//! Logs through TensorRT's logger when one is known, else to stderr (errors only).
void log(nvinfer1::ILogger::Severity severity, std::string const& message);

} // namespace plugin
} // namespace engram_trt

//! Throws PluginError with `message` (a stream expression), the file and the line.
#define ENGRAM_PLUGIN_FAIL(message)                                                                                    \
    do                                                                                                                 \
    {                                                                                                                  \
        std::ostringstream engramFailStream_;                                                                          \
        engramFailStream_ << message;                                                                                  \
        ::engram_trt::plugin::throwPluginError(                                                                        \
            engramFailStream_.str(), ::engram_trt::plugin::sourceFileName(__FILE__), __LINE__);                        \
    } while (0)

//! ENGRAM_PLUGIN_FAIL(message) unless `condition` holds.
#define ENGRAM_PLUGIN_CHECK(condition, message)                                                                        \
    do                                                                                                                 \
    {                                                                                                                  \
        if (!(condition))                                                                                              \
        {                                                                                                              \
            ENGRAM_PLUGIN_FAIL(message);                                                                               \
        }                                                                                                              \
    } while (0)

//! ENGRAM_PLUGIN_FAIL naming the CUDA runtime call and its error unless it succeeded;
//! the error is taken out of the runtime's last-error slot so no later call reports it.
#define ENGRAM_PLUGIN_CHECK_CUDA(call)                                                                                 \
    do                                                                                                                 \
    {                                                                                                                  \
        cudaError_t const engramCudaStatus_ = (call);                                                                  \
        if (engramCudaStatus_ != cudaSuccess)                                                                          \
        {                                                                                                              \
            cudaGetLastError();                                                                                        \
            ENGRAM_PLUGIN_FAIL(#call << " failed: " << cudaGetErrorString(engramCudaStatus_));                         \
        }                                                                                                              \
    } while (0)

//! Wraps a noexcept plugin method body: exceptions become a logged error and `failure`.
#define ENGRAM_PLUGIN_TRY try
#define ENGRAM_PLUGIN_CATCH(pluginName, failure)                                                                       \
    catch (std::exception const& error)                                                                                \
    {                                                                                                                  \
        ::engram_trt::plugin::log(nvinfer1::ILogger::Severity::kERROR, std::string(pluginName) + ": " + error.what()); \
    }                                                                                                                  \
    catch (...)                                                                                                        \
    {                                                                                                                  \
        ::engram_trt::plugin::log(nvinfer1::ILogger::Severity::kERROR, std::string(pluginName) + ": unknown error");   \
    }                                                                                                                  \
    return failure

#endif // ENGRAM_TRT_PLUGIN_CHECK_MACROS_H
