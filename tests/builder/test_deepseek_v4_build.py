"""``engram-trt build`` of DeepSeek-V4 / V4.1 (issue 31 items 2 and 4): transformers-saved
tiny random checkpoints (tests/helpers/deepseek_v4.py's ``save_v4`` / ``save_v41``,
every parameter and buffer drawn at random) become one ONNX serving step and an engine
folder.

* the exported graph, run by ONNX's ReferenceEvaluator (EngramDsv4Attention bound to
  models/deepseek_v4/reference_attention.py, the Engram nodes to their NumPy references), over
  a packed prefill of three prompts (slots out of order) and two decode steps equals
  transformers' fp32 logits within 1e-4 relative: CSA / HCA / sliding layers mixed, hash
  and top-k MoE, hc 2 and 4, tied and untied heads, the CSA indexer dropping entries
  (the cases raise ``index_n_heads`` so that no two entries tie at a top-k cut, where
  transformers' topk and the op's lower-index rule may pick differently);
* V4.1 with real (random bf16) tables, both placements (EngramHash -> EngramGather in the
  graph, or the staged rows), equals the torch model in float64 with the same tables
  (that model is tied to the spec's float64 pieces in tests/models/deepseek_v4/test_deepseek_v41_engram.py);
* TensorRT-RTX builds the engine on the CPU with every plugin in the network and the
  Engram tables outside it (recorded in the manifest with sha256 and block hashes);
* the engine folder, through ``LLM``, ``engram-trt run`` and ``engram-trt serve`` (torch
  backend over the source checkpoint: no GPU here), gives transformers' greedy tokens;
* what the kernel cannot take is refused in one line, exit 2, nothing written.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from helpers.cli import run_json  # noqa: E402
from helpers.plugins import engine_skip_reason  # noqa: E402
from helpers.serving import assert_served_tokens, require_tritonserver, start_serve, stop_serve  # noqa: E402
import helpers.deepseek_v4 as parity  # noqa: E402

from helpers.deepseek_v4 import CASES, NEW_TOKENS, PROMPTS, hf_greedy, save_v4, save_v41  # noqa: E402

from engram_trt.cli.main import main  # noqa: E402

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
V41_PLUGINS = ("EngramDsv4Attention", "EngramGate", "EngramGather", "EngramHash")
# Eight indexer heads: an entry scores exactly 0 (a tie) only when all eight q.k are <= 0.
GRAPH_CASES: dict[str, dict[str, Any]] = {
    "hc2-hca-csa-hash1": dict(CASES["hc2-hca-csa-hash1"], index_n_heads=8),
    "hc4-csa-first-hash2-sigmoid": dict(CASES["hc4-csa-first-hash2-sigmoid"], index_n_heads=8),
    "hc2-tied-sliding-csa-hca": dict(
        CASES["hc2-tied-all-moe-window3"], layer_types=[SLIDING, CSA, HCA], index_n_heads=8, index_topk=2
    ),
}
EXTRA = [[7, 8], [9, 2], [2, 12]]  # the two decode steps' tokens of each prompt
MAX_LEN = 64
V41_LAYERS = (0, 2)  # save_v41's engram_layer_ids


def _export(ckpt: Any, layout: Any = None, **options: Any) -> Any:
    from engram_trt.models.export import ExportOptions

    return ckpt.architecture.export_onnx(
        ckpt.config, ckpt.get, layout, ExportOptions(dtype="fp32", max_position=MAX_LEN, **options)
    )


def _schedule() -> list[tuple[list[int], list[int], list[int], list[int]]]:
    """(ids, seq_starts, past_lens, slots) of a packed prefill and two decode steps."""
    slots = [3, 0, 2]
    lens = [len(p) for p in PROMPTS]
    steps = [(sum(PROMPTS, []), [int(v) for v in np.cumsum([0, *lens])], [0, 0, 0], slots)]
    for d in range(2):
        steps.append(([e[d] for e in EXTRA], [0, 1, 2, 3], list(lens), slots))
        lens = [n + 1 for n in lens]
    return steps


@pytest.fixture(scope="module", params=sorted(GRAPH_CASES))
def graph_case(request: Any, tmp_path_factory: Any) -> tuple[str, Path, Any]:
    name = request.param
    folder = tmp_path_factory.mktemp(name) / "ck"
    return name, folder, save_v4(folder, seed=len(name) + 7, **GRAPH_CASES[name])


def test_exported_graph_equals_transformers(graph_case: tuple[str, Path, Any]) -> None:
    from engram_trt.models.deepseek_v4.reference_runner import DeepseekV4ReferenceRunner
    from engram_trt.models.registry import open_checkpoint

    name, folder, model = graph_case
    ckpt = open_checkpoint(folder)
    cfg = ckpt.config
    assert ckpt.architecture.engine_problems(ckpt) == []
    exported = _export(ckpt)
    nodes = [n for n in exported.model.graph.node if n.op_type == "EngramDsv4Attention"]
    assert exported.io["plugins"] == ["EngramDsv4Attention"] and len(nodes) == cfg.num_hidden_layers
    assert [len(n.input) for n in nodes] == [{SLIDING: 7, HCA: 15, CSA: 24}[t] for t in cfg.layer_types]
    assert [len(n.output) for n in nodes] == [{SLIDING: 2, HCA: 5, CSA: 8}[t] for t in cfg.layer_types]
    # every case mixes both compressed layer kinds; the CSA indexer drops entries
    assert {CSA, HCA} <= set(cfg.layer_types)
    assert max(len(p) for p in PROMPTS) // cfg.compress_rates[CSA] > cfg.index_topk
    runner = DeepseekV4ReferenceRunner(exported, cfg, num_slots=4, max_seq_len=MAX_LEN)
    with torch.no_grad():
        refs = [model(torch.tensor([p + e])).logits[0].double().numpy() for p, e in zip(PROMPTS, EXTRA)]
    for k, (ids, starts, past, slots) in enumerate(_schedule()):
        logits = runner.step(np.array(ids), starts, past, slots)
        assert logits.shape == (3, cfg.vocab_size) and logits.dtype == np.float32
        for s in range(3):
            pos = starts[s + 1] - 1 - starts[s] + past[s]
            ref = refs[s][pos]
            err = np.abs(logits[s] - ref).max()
            assert err <= 1e-4 * np.abs(ref).max(), (name, k, s, pos, err)
    ckpt.close()


@pytest.fixture(scope="module")
def v41(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A V4.1 checkpoint (random bf16 tables; eight indexer heads, see GRAPH_CASES)."""
    folder = tmp_path_factory.mktemp("v41graph") / "ck"
    gen = torch.Generator().manual_seed(23)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(parity.BASE, "index_n_heads", 8)
        save_v41(folder, lambda rows, width: torch.randn(rows, width, generator=gen), seed=5)
    return folder


def _v41_tables(ckpt: Any) -> list[tuple[np.ndarray, None]]:
    import ml_dtypes

    return [
        (ckpt.get(f"model.layers.{lid}.engram.embed.weight").view(torch.int16).numpy().view(ml_dtypes.bfloat16), None)
        for lid in V41_LAYERS
    ]


def _torch_model(ckpt: Any, dtype: torch.dtype) -> Any:
    from engram_trt.tables.base import TableStore

    model = ckpt.architecture.load_model(ckpt, device="cpu", dtype=dtype)
    model.set_tables(
        TableStore.from_tensors(
            [ckpt.get(f"model.layers.{lid}.engram.embed.weight") for lid in V41_LAYERS],
            [None] * len(V41_LAYERS),
            32,
            V41_LAYERS,
        )
    )
    return model


@pytest.mark.parametrize("placement", ["in_engine", "prefetch"])
def test_v41_graph_with_real_tables_equals_the_float64_model(v41: Path, placement: str) -> None:
    from engram_trt.models.deepseek_v4.reference_runner import DeepseekV4ReferenceRunner
    from engram_trt.checkpoint.vocab import engram_lookup_and_layout
    from engram_trt.models.registry import open_checkpoint
    from engram_trt.models.step import PackedStep

    ckpt = open_checkpoint(v41)
    lookup, layout = engram_lookup_and_layout(ckpt)
    exported = _export(ckpt, layout, placement=placement)
    want = {"in_engine": set(V41_PLUGINS), "prefetch": {"EngramDsv4Attention", "EngramGate"}}[placement]
    assert set(exported.io["plugins"]) == want
    gates = [n for n in exported.model.graph.node if n.op_type == "EngramGate"]
    assert len(gates) == len(V41_LAYERS)
    assert not [i.name for i in exported.model.graph.initializer if ".engram.embed" in i.name]  # tables stay out
    runner = DeepseekV4ReferenceRunner(
        exported, ckpt.config, _v41_tables(ckpt), lookup, num_slots=4, max_seq_len=MAX_LEN
    )
    m64, m32 = _torch_model(ckpt, torch.float64), _torch_model(ckpt, torch.float32)
    s64 = m64.new_cache(4, MAX_LEN)
    for ids, starts, past, slots in _schedule():
        step = PackedStep(torch.tensor(ids), [int(n) for n in np.diff(starts)], past, slots)
        rows = [r.float() for r in m32.prepare_step(step, s64)] if placement == "prefetch" else None
        ref = m64.forward_step(step, s64).numpy()
        got = runner.run(step, engram_rows=rows)
        assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()
    # the lookback the runner carried is the model's
    assert np.array_equal(runner.lookback[[3, 0, 2]], s64.lookback[[3, 0, 2]].numpy())
    ckpt.close()


def test_exported_graph_is_deterministic(v41: Path) -> None:
    from engram_trt.checkpoint.vocab import engram_lookup_and_layout
    from engram_trt.models.export import ExportOptions
    from engram_trt.models.registry import open_checkpoint

    ckpt = open_checkpoint(v41)
    _lookup, layout = engram_lookup_and_layout(ckpt)
    a, b = (
        ckpt.architecture.export_onnx(ckpt.config, ckpt.get, layout, ExportOptions(dtype="bf16", max_position=MAX_LEN))
        for _ in range(2)
    )
    assert a.model.SerializeToString(deterministic=True) == b.model.SerializeToString(deterministic=True)
    states = a.io["states"]
    assert states["compressed_kv_0"]["shape"] == ["num_slots", "max_seq_len//4", 16]  # HCA rate 4
    assert states["index_keys_1"]["shape"] == ["num_slots", "max_seq_len//2", 8]  # CSA rate 2
    assert states["window_kv_2"]["alias"] == "window_kv_out_2"
    ckpt.close()


# -- the engine folder ---------------------------------------------------------------------


def _build(ck: Path, out: Path, *extra: str) -> dict[str, Any]:
    buf = io.StringIO()
    argv = [
        "build",
        str(ck),
        "--output",
        str(out),
        "--json",
        "--max-batch",
        "4",
        "--max-seq-len",
        str(MAX_LEN),
        "--max-num-tokens",
        str(MAX_LEN),
        *extra,
    ]
    with contextlib.redirect_stdout(buf):
        assert main(argv) == 0
    return json.loads(buf.getvalue())


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, v41: Path) -> dict[str, Any]:
    """V4 (transformers' greedy tokens) and V4.1 (the torch model's own gather) engine folders."""
    root = tmp_path_factory.mktemp("dsv4build")
    why = engine_skip_reason(V41_PLUGINS)
    no_engine = ["--no-engine"] if why else []
    model = save_v4(root / "v4", seed=41, **GRAPH_CASES["hc2-hca-csa-hash1"])
    from engram_trt.models.registry import open_checkpoint

    ckpt = open_checkpoint(v41)
    ours = _torch_model(ckpt, torch.float32)
    want41 = [ours.generate_greedy(p, NEW_TOKENS, ignore_eos=True) for p in PROMPTS]
    ckpt.close()
    return {
        "why": why,
        "v4": root / "v4",
        "v41": v41,
        "want": [hf_greedy(model, p) for p in PROMPTS],
        "want41": want41,
        "report": _build(root / "v4", root / "engine", *no_engine),
        "report41": _build(v41, root / "engine41", *no_engine),
        "engine": root / "engine",
        "engine41": root / "engine41",
    }


def test_manifest_records_the_engram_tables_with_their_checksums(built: dict[str, Any]) -> None:
    manifest = json.loads((built["engine41"] / "manifest.json").read_text())
    tables = manifest["tables"]
    assert [t["tensor"] for t in tables] == [f"model.layers.{lid}.engram.embed.weight" for lid in V41_LAYERS]
    data = (built["v41"] / "model.safetensors").read_bytes()
    for t in tables:
        region = data[t["offset"] : t["offset"] + t["nbytes"]]
        assert t["dtype"] == "BF16" and len(region) == t["nbytes"]
        assert t["sha256"] == hashlib.sha256(region).hexdigest()
        assert t["block_hashes"] == [
            hashlib.sha256(region[i : i + t["block_bytes"]]).hexdigest()
            for i in range(0, t["nbytes"], t["block_bytes"])
        ]
    assert manifest["table_dtype"] == "bf16" and built["report41"]["tables_bytes"] == sum(t["nbytes"] for t in tables)
    io_ = manifest["graph"]["io"]
    assert io_["placement"] == "in_engine" and io_["table_rows"] == [t["shape"][0] for t in tables]
    assert manifest["compressed_vocab"] is not None and manifest["layout"] is not None
    assert sorted(io_["states"]) == sorted(
        f"{n}_{i}"
        for i, names in enumerate(
            [
                ("window_kv", "compressed_kv", "compressor_kv", "compressor_gate"),
                (
                    "window_kv",
                    "compressed_kv",
                    "compressor_kv",
                    "compressor_gate",
                    "index_keys",
                    "indexer_kv",
                    "indexer_gate",
                ),
                ("window_kv", "compressed_kv", "compressor_kv", "compressor_gate"),
            ]
        )
        for n in names
    )
    v4 = json.loads((built["engine"] / "manifest.json").read_text())
    assert v4["tables"] == [] and v4["graph"]["io"]["plugins"] == ["EngramDsv4Attention"]


def test_tensorrt_rtx_builds_the_engines_with_the_plugins(built: dict[str, Any]) -> None:
    if built["why"]:
        pytest.skip(built["why"])
    for key, folder, plugins, count in (
        ("report", built["engine"], ["EngramDsv4Attention"], 3),
        ("report41", built["engine41"], sorted(V41_PLUGINS), 3 + 1 + 2 + 2),
    ):
        report = built[key]
        assert report["engine_skipped"] is None
        blob = (folder / "model.engine").read_bytes()
        assert len(blob) == report["engine_bytes"] > 0
        assert sorted({p.split("/")[0] for p in report["plugin_layers"]}) == plugins
        assert len(report["plugin_layers"]) == count  # attention per layer (+ hash, a gather and gate per Engram layer)
    manifest = json.loads((built["engine41"] / "manifest.json").read_text())
    data = (built["v41"] / "model.safetensors").read_bytes()
    blob = (built["engine41"] / "model.engine").read_bytes()
    for t in manifest["tables"]:  # the tables stay outside the engine
        assert data[t["offset"] : t["offset"] + t["nbytes"]] not in blob


def test_engine_folders_give_the_reference_tokens(built: dict[str, Any], capsys: Any) -> None:
    from engram_trt import LLM, SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for folder, want in ((built["engine"], built["want"]), (built["engine41"], built["want41"])):
        with LLM(str(folder), device="cpu", dtype="fp32", progress=False) as llm:
            assert llm.source.kind == "engine" and "torch" in llm.backend_label
            outs = llm.generate(PROMPTS, params)
        assert [list(o.outputs[0].token_ids) for o in outs] == want
    res = run_json(built["engine"], PROMPTS[2], NEW_TOKENS, capsys)
    assert res["token_ids"] == built["want"][2] and res["source"] == "engine"


def test_served_engine_folder_gives_transformers_tokens(built: dict[str, Any]) -> None:
    require_tritonserver()
    engine = built["engine"]
    proc, info = start_serve(
        engine,
        engine.parent / "tritonserver.log",
        "--device",
        "cpu",
        "--max-batch-size",
        "4",
        "--max-num-tokens",
        str(MAX_LEN),
    )
    try:
        assert_served_tokens(info["http"], PROMPTS[:1], built["want"][:1], NEW_TOKENS)
    finally:
        if proc.poll() is None:
            stop_serve(proc)


# -- bad input: one line, exit 2, nothing written -------------------------------------------


@pytest.mark.parametrize("bad", ["head-dim", "max-seq-len"])
def test_what_the_kernel_cannot_take_is_refused_in_one_line(tmp_path: Path, capsys: Any, bad: str) -> None:
    ck = tmp_path / "ck"
    save_v4(ck, seed=2)  # HCA rate 4, CSA rate 2, index_topk 3
    argv = ["build", str(ck), "--output", str(tmp_path / "engine"), "--no-engine", "--json"]
    if bad == "head-dim":  # the config alone: refused before any work (engine_problems)
        d = json.loads((ck / "config.json").read_text())
        (ck / "config.json").write_text(json.dumps(dict(d, head_dim=520, index_head_dim=300)))  # RoPE 260 fits
        needle = "head_dim=520: the EngramDsv4Attention kernel takes head_dim <= 512"
    else:  # 5 tokens hold 2 CSA entries, fewer than index_topk's 3
        argv += ["--max-seq-len", "5", "--max-num-tokens", "5"]
        needle = (
            "index_topk=3 exceeds the 2 compressed entries --max-seq-len 5 holds (rate 2); "
            "build with --max-seq-len >= 6"
        )
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert needle in err, err
    assert not (tmp_path / "engine").exists()
