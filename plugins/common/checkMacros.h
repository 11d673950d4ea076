/*
 * Validation, logging and CUDA status helpers shared by the Engram plugins.
 *
 * TensorRT calls plugin methods through noexcept virtuals, so a plugin validates by
 * throwing PluginError inside the method and converting it at the method's boundary
 * (ENGRAM_PLUGIN_TRY / ENGRAM_PLUGIN_CATCH) into a logged error and the method's
 * failure value.
 */
#ifndef ENGRAM_TRT_PLUGIN_CHECK_MACROS_H
#define ENGRAM_TRT_PLUGIN_CHECK_MACROS_H

#include <NvInferRuntime.h>

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

//! Installs the logger finder handed over by TensorRT (setLoggerFinder).
void setLoggerFinder(nvinfer1::ILoggerFinder* finder);

//! Logs through TensorRT's logger when one is known, else to stderr (errors only).
void log(nvinfer1::ILogger::Severity severity, std::string const& message);

} // namespace plugin
} // namespace engram_trt

//! Throws PluginError with `message` (a stream expression) unless `condition` holds.
#define ENGRAM_PLUGIN_CHECK(condition, message)                                                                        \
    do                                                                                                                 \
    {                                                                                                                  \
        if (!(condition))                                                                                              \
        {                                                                                                              \
            std::ostringstream engramCheckStream_;                                                                     \
            engramCheckStream_ << message;                                                                             \
            throw ::engram_trt::plugin::PluginError(engramCheckStream_.str());                                          \
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
