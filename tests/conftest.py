"""pytest's hooks and the shared fixtures: the golden vectors (``tests/data``), the demo
checkpoint, the plugin library, the tiny / small checkpoints, the TensorRT flavours. The
helpers the tests import live in tests/helpers/ (``from helpers.<module> import ...``)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Tests run against the working tree's package when it is not installed; tests/ itself is on
# the path for every test folder (``helpers`` and ``gpu`` import from any subfolder).
for _path in (REPO / "tests", REPO / "python"):  # python/ ends up first
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from helpers.checkpoints import make_tiny_checkpoint, write_small_checkpoint  # noqa: E402
from helpers.files import golden_dir  # noqa: E402
from helpers.plugins import require_trt_module  # noqa: E402


@pytest.fixture(scope="session")
def golden_hash() -> dict:
    return json.loads((golden_dir() / "engram_hash_public.json").read_text())


@pytest.fixture(scope="session")
def golden_fusion() -> dict:
    return json.loads((golden_dir() / "engram_fusion_public.json").read_text())


@pytest.fixture(scope="session")
def deepseek_vocab():
    """The DeepSeek-V4 tokenizer's compressed vocab (built once: ~3 s)."""
    from engram_trt.engram.tokenizer import build_compressed_vocab, default_tokenizer_json

    return build_compressed_vocab(default_tokenizer_json())


_OWN_CACHE: str | None = None


def pytest_configure(config):
    """Keep the suite's demo checkpoint and engines out of the user's cache."""
    global _OWN_CACHE
    if "ENGRAM_TRT_CACHE" not in os.environ:
        import tempfile

        _OWN_CACHE = os.environ["ENGRAM_TRT_CACHE"] = tempfile.mkdtemp(prefix="engram-trt-test-cache-")


def pytest_unconfigure(config):
    """The suite's own cache holds a 2.4 GiB demo checkpoint: never leave it behind."""
    if _OWN_CACHE is not None:
        import shutil

        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def demo_dir():
    """The demo checkpoint (seed 0) in the suite's cache, written once per session."""
    from engram_trt.models.engram_llama.demo import ensure_demo_checkpoint

    return ensure_demo_checkpoint()


@pytest.fixture(scope="session")
def plugin_lib(tmp_path_factory):
    """libengram_trt_plugins.so: the one kernel_library.library_path() finds, else one built
    now (one architecture, to stay quick) and exported through ENGRAM_TRT_PLUGIN_LIB."""
    import shutil
    import subprocess

    from engram_trt.native import library as kernel_library
    from engram_trt.errors import EngramError

    try:
        yield kernel_library.library_path()
        return
    except EngramError:
        pass
    if shutil.which("cmake") is None or not (shutil.which("nvcc") or Path("/usr/local/cuda/bin/nvcc").exists()):
        pytest.skip("no built libengram_trt_plugins.so and no cmake / nvcc to build it")
    build = tmp_path_factory.mktemp("plugin-build")
    subprocess.run(
        ["cmake", "-S", str(REPO), "-B", str(build), "-DCMAKE_CUDA_ARCHITECTURES=80"], check=True, capture_output=True
    )
    subprocess.run(["cmake", "--build", str(build), "-j2"], check=True, capture_output=True)
    path = build / kernel_library.LIBRARY_NAME
    with pytest.MonkeyPatch.context() as mp:  # for the session: undone when the session ends
        mp.setenv("ENGRAM_TRT_PLUGIN_LIB", str(path))
        yield path


@pytest.fixture(scope="session")
def layout():
    """A small two-layer Engram layout (3-grams, 4 heads: 16 hash columns) for the plugin tests."""
    from engram_trt.config.model import EngramSpec
    from engram_trt.engram.layout import EngramLayout

    spec = EngramSpec(
        layer_ids=(1, 3),
        max_ngram_size=3,
        n_heads=4,
        vocab_size=1000,
        compressed_vocab_size=900,
        pad_token_id=0,
        head_dim=64,
    )
    return EngramLayout.from_spec(spec, pad_id=5)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """One tiny checkpoint for the session (read-only: copy it before changing it)."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ck")


@pytest.fixture(scope="session")
def small_ckpt(tmp_path_factory) -> Path:
    return write_small_checkpoint(tmp_path_factory.mktemp("small") / "ckpt")


@pytest.fixture(scope="session")
def small_engine(small_ckpt, tmp_path_factory) -> Path:
    """An engine folder of the small checkpoint (manifest, graph, vocab; no TensorRT
    engine needed: the runtime reads the folder either way)."""
    from engram_trt.builder.build import build

    out = tmp_path_factory.mktemp("small-engine") / "engine"
    build(
        small_ckpt, out, build_engine_if_possible=False, progress=False, max_batch=8, max_seq_len=512, max_num_tokens=64
    )
    return out


@pytest.fixture(params=["tensorrt_rtx", "tensorrt"])
def trt(request, plugin_lib: Path, monkeypatch: pytest.MonkeyPatch):
    """Each TensorRT flavour in turn (skipped where it is not installed), with the plugin
    library loaded into its registry: the plugin tests' creators and engine builds."""
    from engram_trt.native import trt_compat

    require_trt_module(request.param)
    monkeypatch.setenv("ENGRAM_TRT_FLAVOUR", request.param)
    t = trt_compat.load(request.param)
    trt_compat.load_plugin_library(plugin_lib)
    return t
