"""Where engram-trt keeps what it can rebuild: ``$ENGRAM_TRT_CACHE``, else
``~/.cache/engram-trt`` (the demo checkpoint and engine, compressed vocabularies, the
TensorRT-RTX parser link)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    root = os.environ.get("ENGRAM_TRT_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "engram-trt"
