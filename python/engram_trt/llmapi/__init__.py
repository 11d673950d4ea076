"""The user-facing API: :class:`LLM`, :class:`SamplingParams`, :class:`RequestOutput`."""

from engram_trt.llmapi.llm import LLM  # noqa: F401
from engram_trt.runtime.outputs import CompletionOutput, RequestOutput  # noqa: F401
from engram_trt.runtime.sampling_params import SamplingParams  # noqa: F401
