"""engram-trt: serve LLMs with Engram layers through TensorRT, the tables outside the engine.

``from engram_trt import LLM, SamplingParams`` is the API; the names load on first use,
so importing the package (and the CLI's ``--help``) costs no torch import.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

from engram_trt.errors import CheckpointError, ConfigError, EngramError  # noqa: E402

_LAZY = {"LLM": "engram_trt.llmapi.llm", "SamplingParams": "engram_trt.llmapi.params",
         "RequestOutput": "engram_trt.llmapi.outputs", "CompletionOutput": "engram_trt.llmapi.outputs",
         "EngramConfig": "engram_trt.config.engram"}

__all__ = ["__version__", "EngramError", "ConfigError", "CheckpointError", *_LAZY]


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'engram_trt' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(mod), name)
