"""engram-trt: serve LLMs with Engram layers (n-gram hash lookups into large static
tables, gated into the hidden state) with TensorRT, keeping the tables outside the engine.
"""

from __future__ import annotations

__version__ = "0.1.0"

from engram_trt.errors import ConfigError, CheckpointError, EngramError  # noqa: E402

__all__ = ["__version__", "EngramError", "ConfigError", "CheckpointError"]
