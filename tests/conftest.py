"""Shared fixtures: the golden vectors (``tests/data``), the demo checkpoint, the plugin library."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Tests run against the working tree's package when it is not installed.
if str(REPO / "python") not in sys.path:
    sys.path.insert(0, str(REPO / "python"))


def file_sha256(path: str | Path, offset: int = 0, nbytes: int | None = None) -> str:
    """sha256 of ``nbytes`` bytes of a file from ``offset`` (default: to its end), read
    in 16 MiB pieces (demo shards are over a GiB). The tests' own, independent of the
    package's manifest hashing."""
    p = Path(path)
    left = p.stat().st_size - offset if nbytes is None else nbytes
    h = hashlib.sha256()
    with open(p, "rb") as f:
        f.seek(offset)
        while left > 0:
            chunk = f.read(min(left, 1 << 24))
            assert chunk, f"{p} ends before offset {offset} + {nbytes} bytes"
            h.update(chunk)
            left -= len(chunk)
    return h.hexdigest()


def golden_dir() -> Path:
    """The golden vectors: the repository's own copy (``tests/data``, so a clone anywhere
    passes), or ``$ENGRAM_TRT_GOLDEN`` to test against another set."""
    env = os.environ.get("ENGRAM_TRT_GOLDEN")
    candidates = [Path(env)] if env else [REPO / "tests" / "data"]
    for c in candidates:
        if (c / "engram_hash_public.json").is_file():
            return c
    raise FileNotFoundError(
        f"golden vectors not found in {[str(c) for c in candidates]}; set ENGRAM_TRT_GOLDEN to the folder holding engram_hash_public.json")


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
    """libengram_trt_plugins.so: the one kernels.library_path() finds, else one built
    now (one architecture, to stay quick) and exported through ENGRAM_TRT_PLUGIN_LIB."""
    import shutil
    import subprocess

    from engram_trt.native import kernels
    from engram_trt.errors import EngramError

    try:
        yield kernels.library_path()
        return
    except EngramError:
        pass
    if shutil.which("cmake") is None or not (shutil.which("nvcc") or Path("/usr/local/cuda/bin/nvcc").exists()):
        pytest.skip("no built libengram_trt_plugins.so and no cmake / nvcc to build it")
    build = tmp_path_factory.mktemp("plugin-build")
    subprocess.run(["cmake", "-S", str(REPO), "-B", str(build), "-DCMAKE_CUDA_ARCHITECTURES=80"], check=True,
                   capture_output=True)
    subprocess.run(["cmake", "--build", str(build), "-j2"], check=True, capture_output=True)
    path = build / kernels.LIBRARY_NAME
    with pytest.MonkeyPatch.context() as mp:  # for the session: undone when the session ends
        mp.setenv("ENGRAM_TRT_PLUGIN_LIB", str(path))
        yield path


@pytest.fixture(scope="session")
def layout():
    """A small two-layer Engram layout (3-grams, 4 heads: 16 hash columns) for the plugin tests."""
    from engram_trt.config.model import EngramSpec
    from engram_trt.engram.layout import EngramLayout

    spec = EngramSpec(layer_ids=(1, 3), max_ngram_size=3, n_heads=4, vocab_size=1000, compressed_vocab_size=900,
                      pad_token_id=0, head_dim=64)
    return EngramLayout.from_spec(spec, pad_id=5)


HARNESS_NAME = "libengram_plugin_harness.so"


def harness_path() -> Path:
    """The plugin harness beside the library the tests use (installed package or source
    build), else the source tree's own build."""
    from engram_trt.native import kernels
    from engram_trt.errors import EngramError

    try:
        lib = kernels.library_path()
        for cand in (lib.parent / HARNESS_NAME, lib.parent / "plugins" / "tests" / HARNESS_NAME):
            if cand.is_file():
                return cand
    except EngramError:
        pass
    return REPO / "build" / "plugins" / "tests" / HARNESS_NAME


def harness_scripts(harness: Path, *modules: str) -> list:
    """The GPU tests' modules (tests/gpu: ``helpers``, ``test_attention``, ...), imported for
    their harness bindings and CPU checks, once the harness library is known to exist."""
    import importlib

    if not harness.is_file():
        pytest.skip(f"no CUDA compiler built the plugin harness ({harness}): nvcc / the CUDA toolkit is missing")
    return [importlib.import_module(f"gpu.{m}") for m in modules]


def transformers_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' ``generate`` greedy tokens of one prompt, EOS not special (so a run
    that ignores EOS sees the same); exactly ``n`` of them."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0, use_cache=True)
    got = out[0, len(prompt):].tolist()
    assert len(got) == n
    return got


def word_tokenizer(path: Path, words: int) -> Path:
    """A tiny word-level tokenizer.json (ids 0..words-1; every word its own compressed id)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


TINY_CONFIG = dict(
    architectures=["EngramLlamaForCausalLM"], hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
    num_hidden_layers=2, vocab_size=512, hc_mult=2, tie_word_embeddings=True, max_position_embeddings=256,
    engram_layer_ids=[1], engram_max_ngram_size=3, engram_n_heads=2, engram_head_dim=32,
    engram_vocab_size=3000, engram_compressed_vocab_size=512, engram_pad_token_id=0,
)


def make_tiny_checkpoint(path: Path, seed: int = 0, **overrides) -> Path:
    """A checkpoint that builds in about a second: a 512-word tokenizer, a two-layer
    backbone, one Engram layer of ~12k FP8 rows (384 KiB of table)."""
    import torch

    from engram_trt.checkpoint.checkpoint import write_checkpoint
    from engram_trt.models.engram_llama.demo import random_weights
    from engram_trt.config.model import ModelConfig
    from engram_trt.engram.layout import EngramLayout

    cfg = dict(TINY_CONFIG, **overrides)
    mc = ModelConfig.from_dict(cfg)
    rows = [int(r) for r in EngramLayout.from_spec(mc.engram, 0).table_rows]
    path.mkdir(parents=True, exist_ok=True)
    tok = word_tokenizer(path.parent / f".{path.name}-tokenizer.json", 512)
    weights = random_weights(mc, torch.Generator().manual_seed(seed), table_rows=rows)
    out = write_checkpoint(path, cfg, weights, tok, max_shard_bytes=1 << 30)
    tok.unlink()
    return out


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """One tiny checkpoint for the session (read-only: copy it before changing it)."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ck")


def tree_digest(folder: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under ``folder`` (links as their target text)."""
    out: dict[str, str] = {}
    for p in sorted(Path(folder).rglob("*")):
        rel = str(p.relative_to(folder))
        if p.is_symlink():
            out[rel] = "link:" + os.readlink(p)
        elif p.is_file():
            out[rel] = file_sha256(p)
    return out


# A small engram-llama with the DeepSeek-V4 tokenizer (real text in, real tokens out),
# Engram on two of three layers, small tables: quick to write, load and run on a CPU.
SMALL_CONFIG = {
    "architectures": ["EngramLlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 129280, "hc_mult": 2,
    "max_position_embeddings": 512, "tie_word_embeddings": True, "eos_token_id": 1,
    "engram_layer_ids": [0, 2], "engram_max_ngram_size": 3, "engram_n_heads": 2, "engram_head_dim": 32,
    "engram_vocab_size": 3000, "engram_compressed_vocab_size": 99092, "engram_pad_token_id": 1,
}


def write_small_checkpoint(path: Path, seed: int = 0) -> Path:
    import torch

    from engram_trt.checkpoint.checkpoint import write_checkpoint
    from engram_trt.models.engram_llama.demo import random_weights
    from engram_trt.config.model import ModelConfig
    from engram_trt.engram.layout import EngramLayout
    from engram_trt.engram.tokenizer import default_tokenizer_json

    cfg = ModelConfig.from_dict(SMALL_CONFIG)
    rows = [int(r) for r in EngramLayout.from_spec(cfg.engram, 0).table_rows]
    weights = random_weights(cfg, torch.Generator().manual_seed(seed), table_rows=rows)
    return write_checkpoint(path, SMALL_CONFIG, weights, default_tokenizer_json(), max_shard_bytes=8_000_000)


@pytest.fixture(scope="session")
def small_ckpt(tmp_path_factory) -> Path:
    return write_small_checkpoint(tmp_path_factory.mktemp("small") / "ckpt")


@pytest.fixture(scope="session")
def small_engine(small_ckpt, tmp_path_factory) -> Path:
    """An engine folder of the small checkpoint (manifest, graph, vocab; no TensorRT
    engine needed: the runtime reads the folder either way)."""
    from engram_trt.builder.build import build

    out = tmp_path_factory.mktemp("small-engine") / "engine"
    build(small_ckpt, out, build_engine_if_possible=False, progress=False, max_batch=8, max_seq_len=512,
          max_num_tokens=64)
    return out


def descendants(root: int) -> list[int]:
    """Live processes below ``root``."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out = []
    for pid in parent:
        p = pid
        while p in parent and p not in (0, 1, root):
            p = parent[p]
        if p == root and pid != root:
            out.append(pid)
    return out


def segments_mapped_by(root: int) -> set[str]:
    """The engram-trt /dev/shm segments that ``root`` or a process below it maps: this
    server's, not those of another test or server running beside it."""
    names: set[str] = set()
    for pid in [root, *descendants(root)]:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            fields = line.split(maxsplit=5)
            path = fields[5] if len(fields) == 6 else ""
            if path.startswith("/dev/shm/engram-trt-") and path.endswith(".tables"):
                names.add(Path(path).name)
    return names
