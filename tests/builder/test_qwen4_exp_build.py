"""``engram-trt build`` of Qwen4Exp (issue 30 items 3, 5, 6): transformers-saved tiny
random checkpoints (tests/helpers/qwen4_exp.py's configs, every parameter drawn at
random; the PLE shards as save_pretrained writes them, F32, or converted to BF16 / F16:
the engine's EngramGather reads each, rows of any width) become one ONNX serving step
and an engine folder.

* the exported graph, run by ONNX's ReferenceEvaluator (the plugin nodes bound to their
  NumPy / PyTorch references), over a packed prefill of three prompts (slots out of
  order, QSA dropping blocks) and two decode steps equals transformers' fp32 logits within
  1e-4 relative, for hc 2 / 3 / 4, PLE on 1 and 2 layers, with and without PLE, PLE
  tables of F32 / BF16 / F16 shards with rows 4 and 8 wide (the parity configs);
* TensorRT-RTX builds the engine on the CPU with every plugin in the network and the PLE
  tables outside it (their shards in the manifest with sha256 and block hashes);
* the engine folder, served by ``engram-trt run``, ``LLM`` and ``engram-trt serve``
  (torch backend over the source checkpoint: no GPU here), gives transformers' greedy tokens;
* a tampered PLE shard is refused by the manifest check in one line, exit 2, and so are
  PLE shards the gather cannot read (F64) or of mixed dtypes, before any work.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from helpers.cli import run_json  # noqa: E402
from helpers.plugins import engine_skip_reason  # noqa: E402
from helpers.serving import assert_served_tokens, require_tritonserver, start_serve, stop_serve  # noqa: E402
from helpers.qwen4_exp import CASES, EOS, NEW_TOKENS, PROMPTS, hf_greedy, save_qwen4  # noqa: E402

from engram_trt.cli.main import main  # noqa: E402

QWEN4_PLUGINS = (
    "EngramCausalConv1d",
    "EngramGatedDeltaNet",
    "EngramGather",
    "EngramPleFusion",
    "EngramPleHash",
    "EngramQsaAttention",
)
# (config, PLE shard storage): F32 is what save_pretrained writes. Rows: 16 / 4 heads = 4
# wide, 24 / 3 = 8, 12 / 3 = 4.
GRAPH_CASES = (
    ("hc2-ple1-qsa", "F32"),
    ("hc4-ple2-interval2", "BF16"),
    ("no-ple-tied-sigmoid", "F32"),
    ("ngram4-three-layers", "F16"),
    ("ngram4-chunk13", "F32"),
)
EXTRA = [[7, 8], [9, EOS], [EOS, 12]]  # the two decode steps' tokens of each prompt
# The parity config as transformers saves it: F32 PLE shards, rows 4 wide (16 / 4 heads).
BUILD_CASE = CASES["hc2-ple1-qsa"]
SHARD_TYPES = {"BF16": torch.bfloat16, "F16": torch.float16}


def save_qwen4_ple_as(folder: Path, seed: int, storage: str, **overrides: Any) -> Any:
    """:func:`save_qwen4` (F32 PLE shards, as transformers saves them) or, for ``storage``
    BF16 / F16, with the PLE tables rounded to that type in the model and saved so."""
    from safetensors.torch import load_file, save_file

    model = save_qwen4(folder, seed=seed, **overrides)
    if storage == "F32":
        return model
    dt = SHARD_TYPES[storage]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ngram_embedding" in name:
                p.copy_(p.to(dt).float())
    f = folder / "model.safetensors"
    tensors = load_file(str(f))
    for k in tensors:
        if ".ngram_embedding.shard_" in k:
            tensors[k] = tensors[k].to(dt)
    save_file(tensors, str(f), metadata={"format": "pt"})
    return model


def _shard_dtypes(folder: Path) -> set[str]:
    """The safetensors dtypes of the PLE shards in a saved checkpoint (read from its header)."""
    import struct

    raw = (folder / "model.safetensors").read_bytes()
    header = json.loads(raw[8 : 8 + struct.unpack("<Q", raw[:8])[0]])
    return {v["dtype"] for k, v in header.items() if ".ngram_embedding.shard_" in k}


@pytest.fixture(scope="module", params=GRAPH_CASES, ids=["-".join(c) for c in GRAPH_CASES])
def graph_case(request: Any, tmp_path_factory: Any) -> tuple[str, Path, Any]:
    name, storage = request.param
    folder = tmp_path_factory.mktemp(name) / "ck"
    return name, folder, save_qwen4_ple_as(folder, len(name) + 40, storage, **CASES[name])


def test_exported_graph_equals_transformers(graph_case: tuple[str, Path, Any]) -> None:
    from engram_trt.models.qwen4_exp.reference_runner import Qwen4ExpReferenceRunner, ple_tables_of
    from engram_trt.models.export import ExportOptions
    from engram_trt.models.registry import open_checkpoint

    name, folder, model = graph_case
    ckpt = open_checkpoint(folder)
    cfg = ckpt.config
    assert ckpt.architecture.engine_problems(ckpt) == []
    table_dtype = ckpt.architecture.table_dtype(list(ckpt.architecture.table_refs(ckpt))) if cfg.ple else None
    exported = ckpt.architecture.export_onnx(
        cfg, ckpt.get, None, ExportOptions(dtype="fp32", max_position=64, table_dtype=table_dtype)
    )
    plugins = set(exported.io["plugins"])
    want_plugins = {"EngramQsaAttention", "EngramCausalConv1d", "EngramGatedDeltaNet"}
    if cfg.ple is not None:
        want_plugins |= {"EngramPleHash", "EngramGather", "EngramPleFusion"}
        # the gather reads the shards' own dtype, rows narrower than 8, and its output is cast
        storage = _shard_dtypes(folder)
        assert (
            len(storage) == 1
            and exported.io["ple"]["table_dtype"] == {"F32": "fp32", "BF16": "bf16", "F16": "fp16"}[storage.pop()]
        )
        assert (
            cfg.ple.head_dim
            == {"hc2-ple1-qsa": 4, "hc4-ple2-interval2": 8, "ngram4-three-layers": 4, "ngram4-chunk13": 4}[name]
        )
        gathers = [n for n in exported.model.graph.node if n.op_type == "EngramGather"]
        codes = {a.i for n in gathers for a in n.attribute if a.name == "table_dtype"}
        assert codes == {{"bf16": 1, "fp16": 2, "fp32": 3}[table_dtype]}
    assert plugins == want_plugins
    # the QSA drop is active: a prompt sees more complete blocks than the budget keeps
    r = cfg.qsa.compress_ratio
    assert max(len(p) for p in PROMPTS) // r > cfg.qsa.budget // r
    runner = Qwen4ExpReferenceRunner(exported, cfg, ple_tables_of(ckpt), num_slots=4, max_seq_len=64)
    with torch.no_grad():
        refs = [model(torch.tensor([p + e])).logits[0].double().numpy() for p, e in zip(PROMPTS, EXTRA)]
    slots = [3, 0, 2]
    lens = [len(p) for p in PROMPTS]
    got = [runner.step(np.array(sum(PROMPTS, [])), np.cumsum([0, *lens]), [0, 0, 0], slots)]
    at = [[n - 1 for n in lens]]
    for d in range(2):
        got.append(runner.step(np.array([e[d] for e in EXTRA]), np.arange(4), lens, slots))
        at.append(list(lens))
        lens = [n + 1 for n in lens]
    for logits, positions in zip(got, at):
        assert logits.shape == (3, cfg.vocab_size) and logits.dtype == np.float32
        for s, pos in enumerate(positions):
            ref = refs[s][pos]
            assert np.abs(logits[s] - ref).max() <= 1e-4 * np.abs(ref).max(), (name, s, pos)
    ckpt.close()


def test_exported_graph_is_deterministic(tmp_path: Path) -> None:
    from engram_trt.models.export import ExportOptions
    from engram_trt.models.registry import open_checkpoint

    save_qwen4(tmp_path / "ck", seed=5, **CASES["hc2-ple1-qsa"])
    ckpt = open_checkpoint(tmp_path / "ck")
    a, b = (
        ckpt.architecture.export_onnx(ckpt.config, ckpt.get, None, ExportOptions(dtype="bf16", max_position=64))
        for _ in range(2)
    )
    assert a.model.SerializeToString(deterministic=True) == b.model.SerializeToString(deterministic=True)
    names = {i.name for i in a.model.graph.initializer}
    assert not [n for n in names if "ngram_embedding" in n]  # tables never enter the graph
    ckpt.close()


# -- the engine folder ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[list[int]], dict[str, Any], str | None]:
    """(checkpoint, engine folder, transformers' greedy tokens, build report, why no engine)."""
    root = tmp_path_factory.mktemp("qwen4build")
    model = save_qwen4(root / "ck", seed=31, **BUILD_CASE)  # F32 PLE shards, 4-wide rows
    want = [hf_greedy(model, p) for p in PROMPTS]
    why = engine_skip_reason(QWEN4_PLUGINS)
    out = io.StringIO()
    argv = [
        "build",
        str(root / "ck"),
        "--output",
        str(root / "engine"),
        "--json",
        "--max-batch",
        "4",
        "--max-seq-len",
        "64",
        "--max-num-tokens",
        "64",
    ]
    with contextlib.redirect_stdout(out):
        code = main(argv + (["--no-engine"] if why else []))
    assert code == 0
    return root / "ck", root / "engine", want, json.loads(out.getvalue()), why


def test_manifest_records_the_ple_shards_with_their_checksums(built: tuple) -> None:
    ck, engine, _want, report, _why = built
    manifest = json.loads((engine / "manifest.json").read_text())
    tables = manifest["tables"]
    spec = BUILD_CASE
    assert [t["tensor"] for t in tables] == [
        f"model.layers.0.ple.ple_embedding.ngram_embedding.shard_{i}.weight" for i in range(spec["split_ngram_parts"])
    ]
    assert [t.get("part", 0) for t in tables] == list(range(spec["split_ngram_parts"]))
    data = (ck / "model.safetensors").read_bytes()
    for t in tables:
        region = data[t["offset"] : t["offset"] + t["nbytes"]]
        assert t["dtype"] == "F32" and len(region) == t["nbytes"]
        assert t["sha256"] == hashlib.sha256(region).hexdigest()
        assert t["block_hashes"] == [
            hashlib.sha256(region[i : i + t["block_bytes"]]).hexdigest()
            for i in range(0, t["nbytes"], t["block_bytes"])
        ]
    assert report["tables_bytes"] == sum(t["nbytes"] for t in tables) and manifest["table_dtype"] == "fp32"
    io_ = manifest["graph"]["io"]
    assert io_["ple"]["table_dtype"] == "fp32" and io_["ple"]["head_dim"] == 4  # F32 rows 4 wide, as saved
    assert io_["ple"]["table_rows"] == [sum(t["shape"][0] for t in tables)]
    assert sorted(io_["states"]) == sorted(
        [
            "conv_state_0",
            "conv_state_1",
            "conv_state_2",
            "recurrent_state_0",
            "recurrent_state_1",
            "recurrent_state_2",
            "key_cache_3",
            "value_cache_3",
            "index_key_cache_3",
            "ple_conv_state_0",
        ]
    )


def test_the_architecture_names_the_engine_inputs_the_tensorrt_backend_refuses(built: tuple) -> None:
    """ArchitectureBase.engine_state_inputs (what the tensorrt backend refuses at load besides
    the manifest's io.states): every per-slot state and PLE input of the built graph, and
    nothing else of it (the step's own inputs stay bound)."""
    import onnx

    from engram_trt.models.registry import read_model_config

    _ck, engine, _want, _report, _why = built
    manifest = json.loads((engine / "manifest.json").read_text())
    arch, cfg = read_model_config(manifest["model"])
    inputs = {v.name for v in onnx.load(str(engine / "model.onnx"), load_external_data=False).graph.input}
    named = arch.engine_state_inputs(cfg)
    states = set(manifest["graph"]["io"]["states"])
    ple_inputs = {n for n in inputs if n.startswith("ple_")}
    assert states and ple_inputs - states  # the case has both (ple_context, ple_table_ptrs)
    assert named == states | ple_inputs and named <= inputs
    assert "input_ids" in inputs - named


def test_tensorrt_rtx_builds_the_engine_with_the_plugins(built: tuple) -> None:
    ck, engine, _want, report, why = built
    if why:
        pytest.skip(why)
    assert report["engine_skipped"] is None
    blob = (engine / "model.engine").read_bytes()
    assert len(blob) == report["engine_bytes"] > 0
    names = sorted({p.split("/")[0] for p in report["plugin_layers"]})
    assert names == sorted(QWEN4_PLUGINS)
    # 3 linear layers x 2 + 1 attention layer + PLE hash, gather, fusion
    assert len(report["plugin_layers"]) == 10
    manifest = json.loads((engine / "manifest.json").read_text())
    data = (ck / "model.safetensors").read_bytes()
    for t in manifest["tables"]:  # the tables stay outside the engine
        assert data[t["offset"] : t["offset"] + t["nbytes"]] not in blob


def test_engine_folder_gives_transformers_tokens(built: tuple, capsys: Any) -> None:
    from engram_trt import LLM, SamplingParams

    _ck, engine, want, _report, _why = built
    with LLM(str(engine), device="cpu", dtype="fp32", progress=False) as llm:
        assert llm.source.kind == "engine" and all(r.sha256 for r in llm.source.table_refs)
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    res = run_json(engine, PROMPTS[2], NEW_TOKENS, capsys)
    assert res["token_ids"] == want[2] and res["source"] == "engine"


def test_served_engine_folder_gives_transformers_tokens(built: tuple) -> None:
    require_tritonserver()
    _ck, engine, want, _report, _why = built
    log = engine.parent / "tritonserver.log"
    proc, info = start_serve(engine, log, "--device", "cpu", "--max-batch-size", "4", "--max-num-tokens", "64")
    try:
        assert_served_tokens(info["http"], PROMPTS[:2], want, NEW_TOKENS)
    finally:
        if proc.poll() is None:
            stop_serve(proc)


# -- PLE rows that do not divide by split_ngram_parts ---------------------------------------


@pytest.fixture(scope="module")
def built_uneven(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[list[int]], str | None]:
    """hc4-ple2-chunk64 as transformers saves it: 224 and 272 PLE rows in 64 parts, so 56
    shards of 4 rows and 55 of 5 (the last 2): (checkpoint, engine folder, transformers'
    greedy tokens, why no engine)."""
    root = tmp_path_factory.mktemp("qwen4uneven")
    model = save_qwen4(root / "ck", seed=33, **CASES["hc4-ple2-chunk64"])
    want = [hf_greedy(model, p) for p in PROMPTS]
    why = engine_skip_reason(QWEN4_PLUGINS)
    argv = [
        "build",
        str(root / "ck"),
        "--output",
        str(root / "engine"),
        "--json",
        "--max-batch",
        "4",
        "--max-seq-len",
        "64",
        "--max-num-tokens",
        "64",
    ]
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(argv + (["--no-engine"] if why else [])) == 0
    return root / "ck", root / "engine", want, why


def test_uneven_ple_shards_build_and_serve_transformers_tokens(built_uneven: tuple, capsys: Any) -> None:
    """The manifest records each shard torch.chunk wrote (row counts 4 / 5 and the last 2,
    in part order, with checksums); TensorRT-RTX builds the engine; the engine folder
    through LLM and run gives transformers' greedy tokens."""
    from engram_trt import LLM, SamplingParams

    ck, engine, want, why = built_uneven
    manifest = json.loads((engine / "manifest.json").read_text())
    data = (ck / "model.safetensors").read_bytes()
    for layer, (n, rows, last) in ((0, (56, 4, 4)), (2, (55, 5, 2))):
        mine = [t for t in manifest["tables"] if t["tensor"].startswith(f"model.layers.{layer}.")]
        stem = f"model.layers.{layer}.ple.ple_embedding.ngram_embedding"
        assert [t["tensor"] for t in mine] == [f"{stem}.shard_{i}.weight" for i in range(n)]
        assert [t.get("part", 0) for t in mine] == list(range(n))
        assert [t["shape"][0] for t in mine] == [rows] * (n - 1) + [last]
        for t in mine:
            assert t["sha256"] == hashlib.sha256(data[t["offset"] : t["offset"] + t["nbytes"]]).hexdigest()
    assert manifest["graph"]["io"]["ple"]["table_rows"] == [224, 272]
    if not why:
        assert (engine / "model.engine").stat().st_size > 0
    with LLM(str(engine), device="cpu", dtype="fp32", progress=False) as llm:
        assert llm.source.kind == "engine" and len(llm.source.table_refs) == 56 + 55
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    assert run_json(engine, PROMPTS[1], NEW_TOKENS, capsys)["token_ids"] == want[1]


# -- bad input ---------------------------------------------------------------------------------


def test_tampered_ple_shard_refused_in_one_line(tmp_path: Path, capsys: Any) -> None:
    ck = tmp_path / "ck"
    save_qwen4(ck, seed=7, **BUILD_CASE)
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["build", str(ck), "--output", str(tmp_path / "engine"), "--no-engine", "--json"]) == 0
    shard = json.loads((tmp_path / "engine" / "manifest.json").read_text())["tables"][1]
    with open(ck / "model.safetensors", "r+b") as f:  # one bit of the second shard
        f.seek(shard["offset"] + 5)
        byte = f.read(1)[0]
        f.seek(shard["offset"] + 5)
        f.write(bytes([byte ^ 1]))
    capsys.readouterr()
    code = main(["run", str(tmp_path / "engine"), "--prompt", "w5 w6", "--max-new-tokens", "2", "--device", "cpu"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert shard["tensor"] in err and "changed since they were recorded" in err


def _restore_ple_shards(ck: Path, convert: Any) -> None:
    """Rewrite the checkpoint's PLE shards through ``convert(name, tensor)``."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(ck / "model.safetensors"))
    for k in tensors:
        if ".ngram_embedding.shard_" in k:
            tensors[k] = convert(k, tensors[k])
    save_file(tensors, str(ck / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("kind", ["f64", "mixed"])
def test_ple_shards_the_gather_cannot_read_refused_before_any_work(tmp_path: Path, capsys: Any, kind: str) -> None:
    """F64 shards (no gather reads them) and shards of two dtypes (one table dtype per
    engine) are refused in one line, exit 2, nothing written; F32 / BF16 / F16 of any
    width build (the tests above)."""
    ck = tmp_path / "ck"
    save_qwen4(ck, seed=8, **BUILD_CASE)
    _restore_ple_shards(
        ck,
        (lambda k, t: t.double()) if kind == "f64" else (lambda k, t: t.half() if k.endswith("shard_1.weight") else t),
    )
    capsys.readouterr()
    code = main(["build", str(ck), "--output", str(tmp_path / "engine"), "--no-engine"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    if kind == "f64":
        assert "is F64" in err and "reads BF16 / F16 / F32 rows" in err
    else:
        assert "PLE table shards mix dtypes" in err and "shard_1.weight is F16" in err and "is F32" in err
    assert not (tmp_path / "engine").exists()
    shutil.rmtree(ck)
