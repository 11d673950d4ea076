"""``engram-trt bench e2e`` on the CPU (tiny shapes) and its arithmetic.

- end to end (``--shapes dsv4-tiny,qwen4-tiny --device cpu --dtype fp32``): transformers
  makes both checkpoints, its greedy tokens equal ``engram-trt run``'s (float32, the same
  folder and prompt), ``bench serve`` reports every level, the ratios are ours / theirs;
- the floor's weight bytes per decode step (``decode_bytes``, from our checkpoint names)
  equal a count over transformers' own modules of the same config (its fused expert
  tensors, its names), for the benchmark shapes and the tiny ones; the shapes are the
  issue's: ~1.63B DeepSeek-V4 parameters, ~1.15B Qwen4Exp parameters read a step;
- the ratio arithmetic, and the refusals (no CUDA for --device cuda, a bad --path).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from engram_trt.bench.e2e import decode_bytes, ratios, transformers_config  # noqa: E402
from engram_trt.errors import EngramError  # noqa: E402

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from engram_trt.cli.main import main

    root = tmp_path_factory.mktemp("e2e")
    out = root / "e2e.json"
    code = main(
        [
            "bench",
            "e2e",
            "--shapes",
            "dsv4-tiny,qwen4-tiny",
            "--device",
            "cpu",
            "--dtype",
            "fp32",
            "--max-tokens",
            str(MAX_TOKENS),
            "--prompt-tokens",
            "5",
            "--concurrency",
            "1,2",
            "--breakdown",
            "--breakdown-kernels",
            "--work-dir",
            str(root / "work"),
            "--json",
            str(out),
            "--plot",
            str(root / "serve.svg"),
        ]
    )
    assert code == 0
    got = json.loads(out.read_text())
    got["svg"] = (root / "serve.svg").read_text()
    return got


def test_every_run_reports_and_the_tokens_equal_transformers(report: dict[str, Any]) -> None:
    assert [r["shape"] for r in report["results"]] == ["dsv4-tiny", "qwen4-tiny"]
    assert [r["family"] for r in report["results"]] == ["deepseek-v4", "qwen4-exp"]
    for r in report["results"]:
        hf, run = r["transformers"], r["run"]
        assert len(hf["token_ids"]) == MAX_TOKENS and run["token_ids"] == hf["token_ids"], r["shape"]
        assert r["tokens_equal_until"] == MAX_TOKENS
        assert run["steady_decode_tokens_per_s"] > 0 and hf["steady_decode_tokens_per_s"] > 0
        assert r["ratios"]["run"]["over_transformers"] == pytest.approx(
            run["steady_decode_tokens_per_s"] / hf["steady_decode_tokens_per_s"], rel=1e-2
        )
        assert r["ratios"]["run"]["over_floor"] is None  # no HBM rate on a CPU
        levels = r["serve"]["levels"]
        assert sorted(int(n) for n in levels) == [1, 2] and all(v["tokens_per_s"] > 0 for v in levels.values())
        assert levels["1"]["ratio_to_one"] == pytest.approx(1.0)
        assert r["breakdown"] == {"skipped": "no CUDA device (the breakdown times CUDA events)"}
        assert r["kernel_profile"] == {"skipped": "no CUDA device (the kernel profile reads the GPU's kernel records)"}
        assert Path(r["folder"], "tokenizer.json").is_file()


def test_the_report_says_when_decode_steps_were_queued_ahead(report: dict[str, Any]) -> None:
    """bench serve's chained_steps per level (the overlapped decode, on by default): some at
    each level here, the printed line of a level says how many, and nothing when there were none."""
    import copy

    from engram_trt.bench.e2e import report as report_lines

    res = copy.deepcopy(report["results"][0])
    queued = [v["chained_steps"] for v in res["serve"]["levels"].values()]
    assert len(queued) == 2 and all(q > 0 for q in queued), queued
    one = next(line for line in report_lines(res) if line.split()[:2] == ["1", "streams"])
    assert one.endswith(f"one stream  ({queued[0]} decode steps queued ahead)"), one
    res["serve"]["levels"]["2"]["chained_steps"] = 0
    two = next(line for line in report_lines(res) if line.split()[:2] == ["2", "streams"])
    assert "queued ahead" not in two, two


def test_the_plot_draws_one_line_per_model(report: dict[str, Any]) -> None:
    import xml.etree.ElementTree as ET

    root = ET.fromstring(report["svg"])
    ns = "{http://www.w3.org/2000/svg}"
    lines = root.findall(f"{ns}polyline")
    assert len(lines) == 2 and all(len(p.get("points").split()) == 2 for p in lines)  # 2 models x 2 stream counts
    assert {t.text for t in root.findall(f"{ns}text")} >= {"dsv4-tiny", "qwen4-tiny", "streams", "tokens/s"}


def _transformers_read(shape: str) -> tuple[int, int]:
    """(parameters, parameters a one-token decode step reads) counted over transformers' model: its
    parameters and the routers' buffers (bias read, tid2eid by row), the PLE tables left out."""
    model_cls, cfg_cls, kw = transformers_config(shape)
    with torch.device("meta"):
        model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**kw))
    E = kw.get("n_routed_experts") or kw.get("num_experts")
    k = kw["num_experts_per_tok"]
    total = read = 0
    for name, p in model.named_parameters():
        total += p.numel()
        if "ngram_embedding" in name:  # Qwen4Exp's PLE tables: rows gathered, not weights (our tables)
            total -= p.numel()
            continue
        if name.endswith("embed_tokens.weight"):
            read += p.shape[1]
        elif re.search(r"\.experts\.(gate_up_proj|down_proj)$", name):
            read += p.numel() * k / E
        else:
            read += p.numel()
    for name, b in model.named_buffers():  # ours are tensors of the checkpoint, transformers' buffers
        if name.endswith("e_score_correction_bias"):
            total += b.numel()
            read += b.numel()
        elif name.endswith("tid2eid"):  # a routing table: read by row, not counted in the floor
            total += b.numel()
    return total, round(read)


@pytest.mark.parametrize("shape", ["dsv4", "qwen4", "dsv4-tiny", "qwen4-tiny"])
def test_the_floors_bytes_equal_a_count_over_transformers_modules(shape: str) -> None:
    from engram_trt.models.registry import read_model_config

    _, _, kw = transformers_config(shape)
    d = dict(kw, architectures=["DeepseekV4ForCausalLM" if shape.startswith("dsv4") else "Qwen4ExpForCausalLM"])
    if shape.startswith("qwen4"):
        d["model_type"] = "qwen4_exp_text"
    arch, cfg = read_model_config(d)
    got = decode_bytes(SimpleNamespace(config=cfg, architecture=arch), 2)
    total, read = _transformers_read(shape)
    assert got["params_read"] == read and got["weight_bytes"] == 2 * read
    assert got["params"] == total
    if shape == "dsv4":
        assert 1.62e9 < total < 1.64e9  # the 1.63B shape
    if shape == "qwen4":
        assert 1.14e9 < read < 1.16e9  # the "reads 1.15B weights a step"


def test_ratios() -> None:
    r = ratios(0.5, 100.0, 20.0)
    assert r == {"ms_per_step": 10.0, "over_floor": 20.0, "over_transformers": 5.0}
    assert ratios(None, None, 20.0) == {"ms_per_step": None, "over_floor": None, "over_transformers": None}


def test_refusals(tmp_path: Path, capsys: Any, monkeypatch: Any) -> None:
    from engram_trt.cli.main import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "e2e", "--device", "cuda"]) == 2
    assert "no CUDA device is available here; use --device cpu" in capsys.readouterr().err
    assert main(["bench", "e2e", "--device", "cpu", "--path", str(tmp_path / "nope")]) == 2
    assert "--path" in capsys.readouterr().err
    with pytest.raises(EngramError, match="transformers makes only"):
        transformers_config("demo")
