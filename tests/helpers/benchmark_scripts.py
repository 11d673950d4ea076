"""The scripts under benchmarks/ as modules for the tests (not a test module itself).

The kernel microbenchmarks and probes that were ``engram-trt bench`` commands are scripts
now (benchmarks/README.md): each imports its folder's modules by their file names and
has ``OPTIONS`` (its flags' dataclass) and ``main(argv) -> int``. :func:`script` imports
one as the script itself does, with its folder on ``sys.path``, so a test calls its
``main`` with a command line, or its functions, as it called the command's.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any
from helpers.files import REPO

BENCHMARKS = REPO / "benchmarks"

# each former `engram-trt bench` command: its script now (docs/benchmarks.md's table of former commands)
SCRIPTS: dict[str, str] = {
    "gemv": "kernels/bench_gemv.py",
    "kernels": "kernels/bench_kernels.py",
    "attention": "kernels/bench_attention.py",
    "backbone": "kernels/bench_backbone.py",
    "gather": "lookup/bench_gather.py",
    "ple-gather": "lookup/bench_ple_gather.py",
    "gathersweep": "lookup/bench_gathersweep.py",
    "contention": "lookup/bench_contention.py",
    "cacheplan": "lookup/bench_cacheplan.py",
    "cache": "lookup/bench_cache.py",
    "idstream": "lookup/idstreams.py",
    "rowcounts": "lookup/rowcounts.py",
}


def module(folder: str, name: str) -> ModuleType:
    """``benchmarks/<folder>/<name>.py`` imported as its folder's scripts import it."""
    path = str(BENCHMARKS / folder)
    if path not in sys.path:
        sys.path.insert(0, path)
    return importlib.import_module(name)


def script(command: str) -> ModuleType:
    """The script of the former ``engram-trt bench <command>``."""
    folder, _, file = SCRIPTS[command].partition("/")
    return module(folder, file.removesuffix(".py"))


def zipf_stream(num_tokens: int, vocab: int, seed: int = 0) -> Any:
    """A synthetic ``idstreams.TokenStream`` of ``num_tokens`` Zipf(1.3) ids below ``vocab``
    (the lookup benchmarks' input, made without the real text)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ids = (rng.zipf(1.3, size=num_tokens) % vocab).astype(np.int32)
    return script("idstream").TokenStream(
        ids=ids,
        compressed_vocab_size=vocab,
        pad_id=1,
        text_bytes=4 * num_tokens,
        num_files=1,
        python="3.x",
        tokenizer_sha256="-",
        files_sha256="-",
    )
