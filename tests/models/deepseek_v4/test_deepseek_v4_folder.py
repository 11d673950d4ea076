"""DeepSeek-V4 / V4.1 checkpoint folders through the CLI's other commands, and the tiny
transformers-saved checkpoint committed for the GPU tests.

* ``engram-trt build``: the graph written (tests/builder/test_deepseek_v4_build.py checks its
  numbers and the engine), V4.1's tables recorded with their hashes, the checkpoint
  folder untouched.
* ``engram-trt inspect``: a good V4 and V4.1 folder exit 0, name the architecture and
  list no problems; a damaged one lists every problem (exit 1).
* tests/data/deepseek_v4_tiny: its recorded greedy tokens are transformers' own today and
  ours through ``LLM``; our bf16 logits are near transformers' bf16 ones and transformers'
  bf16 round-off is the recorded one (tests/gpu/test_deepseek_v4.py scales its bound by it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from helpers.checkpoints import assert_bf16_logits_match, llm_greedy  # noqa: E402
from helpers.deepseek_v4 import hf_greedy, save_v41  # noqa: E402
from helpers.files import DATA  # noqa: E402

from engram_trt.cli.main import main  # noqa: E402

TINY = DATA / "deepseek_v4_tiny"


@pytest.fixture(scope="module")
def v41_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("v41folder") / "ck"
    gen = torch.Generator().manual_seed(5)
    save_v41(folder, lambda rows, width: torch.randn(rows, width, generator=gen))
    return folder


@pytest.mark.parametrize("which", ["v4", "v41"])
def test_build_writes_the_graph_and_leaves_the_checkpoint_alone(
    which: str, v41_folder: Path, tmp_path: Path, capsys: Any
) -> None:
    """The build exports the serving step (tests/builder/test_deepseek_v4_build.py checks its
    numbers): exit 0, the graph's io names the architecture and every attention
    layer's state, V4.1's two tables are recorded with their hashes, the checkpoint
    folder is untouched."""
    folder = TINY if which == "v4" else v41_folder
    before = sorted(p.name for p in folder.iterdir())
    capsys.readouterr()
    code = main(
        [
            "build",
            str(folder),
            "--output",
            str(tmp_path / "engine"),
            "--no-engine",
            "--max-seq-len",
            "64",
            "--max-num-tokens",
            "64",
            "--json",
        ]
    )
    assert code == 0, capsys.readouterr().err
    manifest = json.loads((tmp_path / "engine" / "manifest.json").read_text())
    io = manifest["graph"]["io"]
    assert io["architecture"] == "deepseek-v4" and (tmp_path / "engine" / "model.onnx").is_file()
    assert "EngramDsv4Attention" in io["plugins"] and ("EngramGate" in io["plugins"]) == (which == "v41")
    assert {n.rsplit("_", 1)[0] for n in io["states"]} >= {"window_kv", "compressed_kv"}
    tables = manifest["tables"]
    assert [t["tensor"] for t in tables] == (
        [] if which == "v4" else [f"model.layers.{i}.engram.embed.weight" for i in (0, 2)]
    )
    assert all(t["sha256"] and t["block_hashes"] for t in tables)
    assert sorted(p.name for p in folder.iterdir()) == before


def _inspect(folder: Path, capsys: Any) -> tuple[int, dict[str, Any], str]:
    capsys.readouterr()
    code = main(["inspect", str(folder), "--json"])
    report = json.loads(capsys.readouterr().out)
    text_code = main(["inspect", str(folder)])
    return code, report, capsys.readouterr().out if text_code == code else f"text exit {text_code} != json {code}"


@pytest.mark.parametrize("which", ["v4", "v41"])
def test_inspect_of_a_good_folder(which: str, v41_folder: Path, capsys: Any) -> None:
    folder = TINY if which == "v4" else v41_folder
    code, report, text = _inspect(folder, capsys)
    assert code == 0, report["problems"]
    assert report["architecture"] == "deepseek-v4" and report["problems"] == []
    assert report["engram"] == (which == "v41") and report["hc_mult"] == 2
    assert "architecture deepseek-v4" in text and "problems     none" in text
    if which == "v41":
        assert [e["layer_id"] for e in report["layers"]] == [0, 2]
        assert all(e["table_rows"] == e["layout_rows"] for e in report["layers"])


def test_inspect_lists_every_problem_of_a_bad_folder(v41_folder: Path, tmp_path: Path, capsys: Any) -> None:
    """A V4.1 folder with a float32 table, a short table and a missing expert weight: all
    three listed, in the architecture's own words (not engram-llama's tensor names)."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "bad"
    shutil.copytree(v41_folder, folder)
    f = folder / "model.safetensors"
    t = load_file(str(f))
    t["model.layers.0.engram.embed.weight"] = t["model.layers.0.engram.embed.weight"].float()
    t["model.layers.2.engram.embed.weight"] = t["model.layers.2.engram.embed.weight"][:-5]
    del t["model.layers.1.ffn.experts.0.w2.weight"]
    save_file(t, str(f), metadata={"format": "pt"})
    code, report, text = _inspect(folder, capsys)
    problems = report["problems"]
    assert code == 1 and len(problems) == 3, problems
    assert any("model.layers.1.ffn.experts.0.w2.weight is missing" in p for p in problems)
    assert any("model.layers.0.engram.embed.weight is F32 but engram_table_dtype='bf16'" in p for p in problems)
    assert any("model.layers.2.engram.embed.weight has" in p and "rows but the layout needs" in p for p in problems)
    assert not any("self_attn.q_proj" in p or "mlp.gate_proj" in p for p in problems)
    assert "problems (3):" in text


def test_committed_tiny_checkpoint_is_transformers_and_ours() -> None:
    """tests/data/deepseek_v4_tiny (saved by transformers 5.25, word tokenizer): the
    recorded greedy tokens are transformers' own and ours through LLM; ours in bf16
    within 1e-2 relative L2 of transformers' bf16 logits; transformers' bf16-vs-fp32
    distance is the recorded one."""
    from transformers import DeepseekV4ForCausalLM

    want = json.loads((TINY / "expected.json").read_text())
    assert sum(p.stat().st_size for p in TINY.iterdir()) < 1 << 20
    assert all(0 not in p for p in want["prompts"])  # hf_greedy's pad_token_id=0 would mask those out
    model = DeepseekV4ForCausalLM.from_pretrained(TINY, use_kernels=False).eval()
    assert [hf_greedy(model, p, want["new_tokens"]) for p in want["prompts"]] == want["greedy"]
    assert llm_greedy(TINY, want["prompts"], want["new_tokens"]) == want["greedy"]
    hf16 = DeepseekV4ForCausalLM.from_pretrained(TINY, use_kernels=False, dtype=torch.bfloat16).eval()
    assert_bf16_logits_match(TINY, model, hf16, want)
