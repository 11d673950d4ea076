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
    subprocess.run(["cmake", "-S", str(REPO), "-B", str(build), "-DCMAKE_CUDA_ARCHITECTURES=80"], check=True,
                   capture_output=True)
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

    spec = EngramSpec(layer_ids=(1, 3), max_ngram_size=3, n_heads=4, vocab_size=1000, compressed_vocab_size=900,
                      pad_token_id=0, head_dim=64)
    return EngramLayout.from_spec(spec, pad_id=5)


HARNESS_NAME = "libengram_plugin_harness.so"


def harness_path() -> Path:
    """The plugin harness beside the library the tests use (installed package or source
    build), else the source tree's own build."""
    from engram_trt.native import library as kernel_library
    from engram_trt.errors import EngramError

    try:
        lib = kernel_library.library_path()
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


# --- TensorRT plugin tests: the flavours, createPlugin, one-plugin ONNX graphs -------------

PLUGIN_NAMESPACE = "engram_trt"  # the creators' plugin namespace (plugins/common/engramPluginBase.h)


def require_trt_module(module: str) -> None:
    """Skip unless the TensorRT flavour ``module`` (``tensorrt_rtx`` or ``tensorrt``) is
    installed; the skip names which one is missing."""
    from engram_trt.native import trt_compat

    if not trt_compat.module_available(module if module != "tensorrt_rtx" else "tensorrt_rtx_bindings") \
            and not trt_compat.module_available(module):
        pytest.skip(trt_compat.NOT_INSTALLED_REASON if module == "tensorrt" else "tensorrt_rtx not installed")


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


def plugin_fields(trt, fields: dict[str, tuple[str, object]]):
    """A PluginFieldCollection from {name: (kind, value)}; kind int32 / int64 / float32 /
    text (comma-separated decimals, the ONNX form of int64 arrays). Also returns the
    PluginFields and their arrays: the collection points into them without owning them,
    so the caller holds them until createPlugin has read the fields."""
    import numpy as np

    m = trt.module
    out, arrays = [], []
    for name, (kind, value) in fields.items():
        if kind == "text":
            data = np.frombuffer(str(value).encode(), dtype=np.int8).copy()
            ftype = m.PluginFieldType.CHAR
        else:
            ftype = {"int32": m.PluginFieldType.INT32, "int64": m.PluginFieldType.INT64,
                     "float32": m.PluginFieldType.FLOAT32}[kind]
            data = np.atleast_1d(np.asarray(value, dtype=kind))
        arrays.append(data)
        out.append(m.PluginField(name, data, ftype))
    return m.PluginFieldCollection(out), (out, arrays)


def create_plugin(trt, name: str, fields: dict[str, tuple[str, object]]):
    """The registry creator of plugin ``name`` (version 1, our namespace) called in the
    build phase with ``fields`` (see plugin_fields): the plugin, or None if refused."""
    creator = trt.module.get_plugin_registry().get_creator(name, "1", PLUGIN_NAMESPACE)
    assert creator is not None, f"{name} creator is not registered"
    collection, keep = plugin_fields(trt, fields)
    plugin = creator.create_plugin(name, collection, trt.module.TensorRTPhase.BUILD)
    del keep  # read: the plugin holds its own copy of every field
    return plugin


def parse_plugin_graph(trt, path: Path):
    """A builder and the network parsed from the ONNX file ``path``, and the network's one
    IPluginV3 layer: (builder, network, layer)."""
    from engram_trt.native import trt_compat

    builder = trt_compat.create_builder()
    network = trt_compat.create_network(builder)
    trt_compat.parse_onnx_file(trt_compat.onnx_parser(network), path)
    (layer,) = [network.get_layer(i) for i in range(network.num_layers)
                if network.get_layer(i).type == trt.module.LayerType.PLUGIN_V3]
    return builder, network, layer


def plugin_builder_config(trt, builder, aliased: bool):
    """A builder config for the plugin tests' engines: the aliased plugin I/O preview
    feature when ``aliased`` (what build_engine enables), sm80 targets on TensorRT-RTX."""
    from engram_trt.native import trt_compat

    config = builder.create_builder_config()
    if aliased:
        trt_compat.enable_aliased_plugin_io(config)
    if trt.is_rtx:
        trt_compat.set_targets(config, ("sm80",))
    return config


def serialized_twice(harness, name: str, fields: list) -> tuple[list, list]:
    """Through the plugin harness: getFieldsToSerialize of plugin ``name`` made from
    ``fields``, and the same of the plugin rebuilt from those (the round trip an engine's
    deserialization takes); both plugins destroyed."""
    p = harness.create(name, fields)
    try:
        first = harness.serialized_fields(p)
        p2 = harness.roundtrip(p)
        try:
            again = harness.serialized_fields(p2)
        finally:
            harness.lib.harness_destroy(p2)
    finally:
        harness.lib.harness_destroy(p)
    return first, again


# --- engram-trt serve behind a real tritonserver ------------------------------------------

def require_tritonserver() -> None:
    """Skip unless what the serve tests need is here: tritonclient and a tritonserver
    (nvidia-pytriton's or one on PATH); the skip names the missing one."""
    pytest.importorskip("tritonclient.grpc", reason="tritonclient is not installed (pip install 'tritonclient[http,grpc]')")
    from engram_trt.errors import EngramError
    from engram_trt.triton.server import find_tritonserver

    try:
        find_tritonserver()
    except EngramError as exc:
        pytest.skip(f"nvidia-pytriton is not installed and no tritonserver is on PATH: {exc}")


def start_serve(folder: Path, log: Path, *flags: str):
    """``engram-trt serve folder`` on loopback (free ports, ``--json``, the log in
    ``log``, the working tree's package) with ``flags``: (the process, its ready line's
    dict). Fails with the server's stderr and log tail if it is not ready in 240 s."""
    import json
    import select
    import subprocess

    cmd = [sys.executable, "-m", "engram_trt", "serve", str(folder), "--address", "127.0.0.1", "--http-port", "0",
           "--grpc-port", "0", "--metrics-port", "0", "--json", "--log-file", str(log), "--exit-timeout", "10", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO / "python")})
    ready, _, _ = select.select([proc.stdout], [], [], 240)
    line = proc.stdout.readline() if ready else ""
    if not line:
        proc.kill()
        _out, err = proc.communicate()
        tail = log.read_text()[-3000:] if log.exists() else ""
        pytest.fail(f"engram-trt serve did not get ready: {err[-2000:]}\n{tail}")
    return proc, json.loads(line)


def stop_serve(proc) -> None:
    """SIGTERM to a server start_serve started: it must exit 0 within 90 s."""
    import signal

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(90) == 0, proc.stderr.read()[-2000:]


def words(ids: list[int]) -> str:
    """The word tokenizer's text of token ids (``w5 w17 ...``; see word_tokenizer)."""
    return " ".join(f"w{i}" for i in ids)


def assert_served_tokens(http: str, prompts: list[list[int]], want: list[list[int]], max_tokens: int) -> None:
    """HTTP ``generate`` of each word-tokenizer prompt (EOS ignored) gives ``want``'s tokens."""
    from engram_trt.triton import client as hc

    for prompt, ids in zip(prompts, want):
        status, body = hc.generate(http, {"text_input": words(prompt), "max_tokens": max_tokens, "ignore_eos": True})
        assert status == 200, body
        assert hc.ids(body["output_ids"]) == ids


# --- checkpoints against transformers (tests/test_*_parity.py, *_folder.py, *_build.py) ----

def llm_greedy(folder: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    """``engram_trt.LLM``'s greedy tokens (torch backend, fp32 on the CPU, EOS ignored)
    for each prompt: ``n`` each."""
    from engram_trt import LLM, SamplingParams

    with LLM(str(folder), backend="torch", device="cpu", dtype="fp32") as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs]


def assert_fp32_logits_match(model, ours, prompts: list[list[int]]) -> None:
    """Our model's fp32 prefill logits of each prompt within 1e-4 (relative to the
    largest) of transformers' ``model``."""
    import torch

    from engram_trt.models.step import PackedStep

    for prompt in prompts:
        with torch.no_grad():
            ref = model(torch.tensor([prompt])).logits[0].double()
        state = ours.new_cache(1, 64)
        got = ours.forward_step(PackedStep(torch.tensor(prompt), [len(prompt)], [0], [0]), state, all_logits=True).double()
        assert got.shape == ref.shape
        assert (got - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()


def packed_greedy(ours, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy tokens of all prompts prefilled in one packed step (slots out of order),
    then decoded together: ``n`` each."""
    import torch

    from engram_trt.models.step import PackedStep

    state = ours.new_cache(4, 64)
    slots = [3, 0, 2]
    step = PackedStep(torch.tensor(sum(prompts, [])), [len(p) for p in prompts], [0, 0, 0], slots)
    logits = ours.forward_step(step, state)
    got: list[list[int]] = [[] for _ in prompts]
    lens = [len(p) for p in prompts]
    for _ in range(n):
        toks = [int(t) for t in torch.argmax(logits, dim=-1)]
        for g, t in zip(got, toks):
            g.append(t)
        logits = ours.forward_step(PackedStep(torch.tensor(toks), [1, 1, 1], lens, slots), state)
        lens = [k + 1 for k in lens]
    return got


def run_json(folder: Path, prompt: list[int], n: int, capsys) -> dict:
    """``engram-trt run --json`` of a word-tokenizer prompt (fp32 on the CPU, EOS ignored,
    ``n`` tokens): its JSON; asserts exit 0."""
    import json

    from engram_trt.cli.main import main

    capsys.readouterr()
    code = main(["run", str(folder), "--prompt", words(prompt), "--max-new-tokens", str(n), "--ignore-eos",
                 "--device", "cpu", "--dtype", "fp32", "--json"])
    out = capsys.readouterr().out
    assert code == 0
    return json.loads(out)


def edit_config(folder: Path, **changes) -> None:
    """``changes`` written over the checkpoint's config.json."""
    import json

    p = folder / "config.json"
    d = json.loads(p.read_text())
    d.update(changes)
    p.write_text(json.dumps(d))


def assert_run_refused(folder: Path, needle: str, capsys) -> None:
    """``engram-trt run`` of a bad checkpoint: exit 2, one line of stderr matching the
    regex ``needle``, nothing written into the folder."""
    import re

    from engram_trt.cli.main import main

    before = sorted(p.name for p in folder.iterdir())
    capsys.readouterr()  # e.g. transformers' own progress output while saving
    code = main(["run", str(folder), "--prompt", "w5 w6", "--max-new-tokens", "2", "--device", "cpu"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1, err
    assert re.search(needle, err), err
    assert sorted(p.name for p in folder.iterdir()) == before  # nothing written


def assert_bf16_logits_match(folder: Path, model, hf16, want: dict) -> None:
    """A committed tiny checkpoint (tests/data, ``want`` its expected.json): our bf16
    prefill logits within 1e-2 relative L2 of transformers' bf16 ones (``hf16``), and
    transformers' bf16-vs-fp32 (``model``) distance the recorded one."""
    import torch

    from engram_trt.models.registry import open_checkpoint
    from engram_trt.models.step import PackedStep

    ckpt = open_checkpoint(folder)
    ours16 = ckpt.architecture.load_model(ckpt, device="cpu", dtype=torch.bfloat16)
    for i, p in enumerate(want["prompts"]):
        with torch.no_grad():
            r32 = model(torch.tensor([p])).logits[0].double()
            r16 = hf16(torch.tensor([p])).logits[0].double()
        g16 = ours16.forward_step(PackedStep(torch.tensor(p), [len(p)], [0], [0]), ours16.new_cache(1, 64),
                                  all_logits=True).double()
        assert float((g16 - r16).norm() / r16.norm()) < 1e-2
        assert abs(float((r16 - r32).norm() / r32.norm()) - want["transformers_bf16_rel_l2"][i]) < 1e-4
    ckpt.close()


def engine_skip_reason(plugins: tuple[str, ...]) -> str | None:
    """Why no TensorRT-RTX engine holding ``plugins`` can be built here (None: it can)."""
    from engram_trt.errors import EngramError
    from engram_trt.native import library as kernel_library
    from engram_trt.native import trt_compat as tc

    if not tc.available():
        return "no TensorRT builder is installed (tensorrt_rtx / tensorrt_rtx_bindings, or tensorrt)"
    try:
        lib = kernel_library.library_path()
    except EngramError as exc:
        return f"the plugin library is missing: {exc}"
    tc.load_plugin_library(lib)
    have = {n for n, _ in tc.plugin_creator_names()}
    missing = [n for n in plugins if n not in have]
    if missing:
        return f"the plugin library {lib} lacks {', '.join(missing)} (rebuild it from this tree; ENGRAM_TRT_PLUGIN_LIB points at one)"
    return None


# --- plugin fields as the plugin harness takes them: (name, nvinfer1 type code, array) -----

# nvinfer1::PluginFieldType values
PF_FLOAT32, PF_FLOAT64, PF_INT8, PF_INT16, PF_INT32, PF_CHAR, PF_INT64 = 1, 2, 3, 4, 5, 6, 10


def pf_scalar(ftype: int, value):
    """``value`` as a one-element array of field type ``ftype``'s numpy type."""
    import numpy as np

    dtype = {PF_FLOAT32: np.float32, PF_FLOAT64: np.float64, PF_INT8: np.int8, PF_INT16: np.int16,
             PF_INT32: np.int32, PF_INT64: np.int64}[ftype]
    return np.array([value], dtype)


def pf_text(values):
    """Integers as comma-separated decimal text (the ONNX form of an int64 array), in bytes."""
    import numpy as np

    return np.frombuffer(",".join(str(int(v)) for v in np.asarray(values).reshape(-1)).encode(), np.uint8)


def pf_written(name: str, ftype: int, values) -> tuple[str, int, int, bytes]:
    """A field as getFieldsToSerialize must write it: the declared type, its bytes."""
    import numpy as np

    dtype = {PF_INT32: np.int32, PF_INT64: np.int64, PF_FLOAT32: np.float32}[ftype]
    data = np.atleast_1d(np.asarray(values, dtype))
    return name, ftype, int(data.size), data.tobytes()


def drop_field(name: str):
    """A change of a field list: field ``name`` left out."""
    return lambda fields: [f for f in fields if f[0] != name]


def set_field(name: str, ftype: int, data):
    """A change of a field list: field ``name`` given as ``ftype`` / ``data`` instead."""
    return lambda fields: [(n, ftype, data) if n == name else (n, t, d) for n, t, d in fields]


def add_field(name: str, ftype: int, data):
    """A change of a field list: field ``name`` appended."""
    return lambda fields: fields + [(name, ftype, data)]


# --- fine-grained FP8 folders as transformers writes them (tests/test_llama_fp8.py, -----
# --- tests/test_qwen4_exp_fp8.py) ------------------------------------------------------

def transformers_fp8_save(model_cls, float_folder: Path, out: Path, **fp8_config) -> Path:
    """transformers' own FP8 save of a float folder it saved: ``from_pretrained`` with a
    ``FineGrainedFP8Config(**fp8_config)`` (its quantizer and ``Fp8Quantize`` op quantize
    each linear whose dims divide by the block; the rest stays float), then
    ``save_pretrained``: transformers' layout and names, not ours. transformers 5.25
    refuses to quantize without a GPU ("No GPU or XPU found"); only that check (and the
    compute capability it then asks for) is patched for the duration, the quantization
    itself runs on the CPU tensors. The tokenizer is copied over."""
    import shutil
    from unittest import mock

    import torch
    from transformers import FineGrainedFP8Config

    with mock.patch("torch.cuda.is_available", return_value=True), \
            mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)):
        model = model_cls.from_pretrained(float_folder, quantization_config=FineGrainedFP8Config(**fp8_config),
                                          dtype=torch.float32, use_kernels=False)
        model.save_pretrained(out)
    tok = Path(float_folder) / "tokenizer.json"
    if tok.is_file():
        shutil.copyfile(tok, out / "tokenizer.json")
    return out


def _folder_tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _save_folder_as(src: Path, out: Path, tensors: dict, config: dict | None = None) -> Path:
    """``src``'s config (or ``config``) and tokenizer with ``tensors`` as one safetensors file."""
    import shutil

    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "tokenizer.json", "generation_config.json"):
        if (Path(src) / name).is_file() and Path(src).resolve() != out.resolve():
            shutil.copyfile(Path(src) / name, out / name)
    if config is not None:
        (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out


def without_stale_scales(folder: Path, out: Path) -> Path:
    """A copy of an FP8 folder without the scales transformers' save writes beside the
    weights it left in 16 bits (uninitialized memory: its CPU load would multiply those
    weights by them), so transformers' own dequantizing load is the reference."""
    import torch

    t = _folder_tensors(folder)
    keep = {k: v for k, v in t.items()
            if not (k.endswith(".weight_scale_inv") and k[: -len("_scale_inv")] in t
                    and t[k[: -len("_scale_inv")]].dtype != torch.float8_e4m3fn)
            and not (k == "lm_head.weight_scale_inv" and "lm_head.weight" not in t)}
    return _save_folder_as(folder, out, keep)


def dequantized_folder(folder: Path, out: Path, moe_intermediate: int | None = None) -> Path:
    """A float32 copy of an FP8 folder: each F8_E4M3 weight times its block scales as the
    format defines them (blocks of ``weight_block_size``, the last one partial; the routed
    experts' merged ``gate_up_proj_scale_inv`` split into its gate rows then its up rows,
    row by row; an FP8 PLE table's shards times its one ``weight_scale``), its
    quantization_config removed: what transformers loads as the reference where its own
    CPU load cannot (the merged expert scales, partial blocks)."""
    import torch

    from engram_trt.quant.formats import dequantize_fp8

    cfg = json.loads((Path(folder) / "config.json").read_text())
    block = tuple(cfg["quantization_config"]["weight_block_size"])
    t = _folder_tensors(folder)
    out_t = {}
    for k, v in t.items():
        if "_scale_inv" in k or k.endswith((".scale", ".ngram_embedding.weight_scale")):
            continue
        if v.dtype != torch.float8_e4m3fn:
            out_t[k] = v
            continue
        if ".ngram_embedding.shard_" in k:  # an FP8Embedding's shard: one float32 scale per table
            scale = t[k.split(".shard_")[0] + ".weight_scale"].double()
            out_t[k] = (v.double() * scale).float()
            continue
        base = k[: -len(".weight")]
        own = next((base + s for s in (".weight_scale_inv", ".scale") if base + s in t), None)
        if own is not None:
            out_t[k] = dequantize_fp8(v, t[own], block, torch.float64).float()
            continue
        experts, e, proj = base.rsplit(".", 2)
        merged = t[f"{experts}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}_scale_inv"][int(e)]
        if proj != "down_proj":  # the fused gate_up weight's block rows, row by row
            lo = 0 if proj == "gate_proj" else moe_intermediate
            rows = (torch.arange(v.shape[0]) + lo) // block[0]
            merged = merged[rows]
            out_t[k] = dequantize_fp8(v, merged, (1, block[1]), torch.float64).float()
        else:
            out_t[k] = dequantize_fp8(v, merged, block, torch.float64).float()
    cfg.pop("quantization_config")
    return _save_folder_as(folder, out, out_t, cfg)


def fp8_ple_folder(folder: Path, out: Path) -> Path:
    """A Qwen4Exp folder whose PLE tables are stored as transformers' ``FP8Embedding``
    holds them (quantization_config.modules_to_convert naming ``ngram_embedding``): each
    layer's table quantized to E4M3 with one float32 scale (amax / 448), written as the
    shards ``torch.chunk`` makes of it (the save's Chunk) beside ``...ngram_embedding.
    weight_scale [1]``. transformers 5.25 loads this layout (on a CPU too) but cannot
    write it (its save of a pre-quantized Qwen4Exp fails in the shard Chunk), so the
    layout is laid out here, under transformers' names."""
    import torch

    t = _folder_tensors(folder)
    cfg = json.loads((Path(folder) / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    stems = sorted({k.split(".shard_")[0] for k in t if ".ngram_embedding.shard_" in k})
    for stem in stems:
        names = sorted((k for k in t if k.startswith(stem + ".shard_")),
                       key=lambda k: int(k.rsplit("shard_", 1)[1][: -len(".weight")]))
        table = torch.cat([t[k] for k in names]).float()
        scale = (table.abs().max() / 448.0).reshape(1)
        q = (table / scale).to(torch.float8_e4m3fn)
        for k in names:
            t.pop(k)
        for i, part in enumerate(torch.chunk(q, text["split_ngram_parts"])):
            t[f"{stem}.shard_{i}.weight"] = part.contiguous()
        t[f"{stem}.weight_scale"] = scale.float()
    qc = cfg.get("quantization_config") or {"activation_scheme": "dynamic", "quant_method": "fp8",
                                             "weight_block_size": [128, 128], "scale_fmt": "float"}
    qc["modules_to_convert"] = ["ngram_embedding"]
    cfg["quantization_config"] = qc
    return _save_folder_as(folder, out, t, cfg)
