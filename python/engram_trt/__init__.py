"""engram-trt: serve LLMs with Engram layers through TensorRT, the tables outside the engine.

``from engram_trt import LLM, SamplingParams`` is the API; the names load on first use,
so importing the package (and the CLI's ``--help``) costs no torch import.
"""

from __future__ import annotations

import os
import sys
from typing import Any

# torch's OpenMP workers busy-wait after each parallel CPU operation, on the cores the
# host gather's threads need (a 6,144-row gather: 5.5 ms right after a parallel CPU
# matmul, 0.13 ms without; docs/benchmarks.md). The wait policy is read once, when
# torch loads: set it here if torch is not loaded yet, and never over a user's setting.
# hostgather.HostGatherer warns when torch came first with the default policy.
if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"

from engram_trt.errors import CheckpointError, ConfigError, EngramError  # noqa: E402

# LLM: llmapi's, which with tp=N leads its tensor-parallel group (engram_trt.distributed.llm)
_LAZY = {
    "LLM": "engram_trt.distributed.llm",
    "SamplingParams": "engram_trt.runtime.sampling_params",
    "RequestOutput": "engram_trt.runtime.outputs",
    "CompletionOutput": "engram_trt.runtime.outputs",
    "EngramConfig": "engram_trt.config.engram",
}

__all__ = ["__version__", "EngramError", "ConfigError", "CheckpointError", *_LAZY]


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'engram_trt' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(mod), name)
