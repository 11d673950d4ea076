"""The command line: JSON outputs against the golden vectors, and one-line errors."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engram_trt.cli.main import main
from engram_trt.engram.tokenizer import default_tokenizer_json
from engram_trt.errors import EngramError

from helpers.files import REPO


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_subprocess(*argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO / "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-m", "engram_trt", *argv], capture_output=True, text=True, env=env, timeout=300
    )


@pytest.fixture
def golden_config(tmp_path, golden_hash):
    case = golden_hash["cases"][0]
    (tmp_path / "config.json").write_text(json.dumps(case["config"]))
    return tmp_path / "config.json", case


def test_layout_json_matches_golden(capsys, golden_hash, tmp_path):
    for i, case in enumerate(golden_hash["cases"]):
        path = tmp_path / f"c{i}.json"
        path.write_text(json.dumps(case["config"]))
        code, out, _ = run_cli(capsys, "layout", str(path))
        assert code == 0
        got = json.loads(out)
        assert got["primes"] == case["primes"]
        assert got["offsets"] == case["offsets"]
        assert got["multipliers"] == case["multipliers"]
        assert got["layer_ids"] == case["config"]["engram_layer_ids"]
        assert got["n_hash_cols"] == (case["config"]["engram_max_ngram_size"] - 1) * case["config"]["engram_n_heads"]
        assert got["table_rows"] == [sum(sum(o) for o in layer) for layer in case["primes"]]


def test_hash_compressed_matches_golden(capsys, golden_config):
    path, case = golden_config
    for seq, expected in zip(case["sequences"], case["hash_ids"]):
        code, out, _ = run_cli(
            capsys,
            "hash",
            str(path),
            "--compressed",
            "--pad-id",
            str(case["pad_compressed_id"]),
            "--ids",
            ",".join(map(str, seq)),
        )
        assert code == 0
        assert json.loads(out) == {"hash_ids": expected}


def _deepseek_config_dir(tmp_path: Path, compressed: int) -> Path:
    d = tmp_path / f"ck{compressed}"
    d.mkdir()
    cfg = {
        "engram_layer_ids": [0],
        "engram_max_ngram_size": 3,
        "engram_n_heads": 2,
        "engram_vocab_size": 5000,
        "engram_compressed_vocab_size": compressed,
        "engram_pad_token_id": 1,
    }
    (d / "config.json").write_text(json.dumps(cfg))
    shutil.copy(default_tokenizer_json(), d / "tokenizer.json")
    return d


def test_hash_raw_ids_go_through_the_tokenizer(capsys, tmp_path, deepseek_vocab):
    from engram_trt.config.model import load_engram_spec
    from engram_trt.engram.hashing import hash_ids
    from engram_trt.engram.layout import EngramLayout

    d = _deepseek_config_dir(tmp_path, 99092)
    raw = [5, 17, -1, 3, 128000]
    code, out, err = run_cli(capsys, "hash", str(d), "--ids", ",".join(map(str, raw)))
    assert code == 0, err
    spec = load_engram_spec(d)
    lay = EngramLayout.from_spec(spec, int(deepseek_vocab.lookup[1]))
    comp = [-1 if r == -1 else int(deepseek_vocab.lookup[r]) for r in raw]
    assert json.loads(out)["hash_ids"] == hash_ids(comp, lay).tolist()


def test_compressed_vocab_mismatch_fails(capsys, tmp_path):
    d = _deepseek_config_dir(tmp_path, 99000)
    code, _, err = run_cli(capsys, "hash", str(d), "--ids", "1,2")
    assert code == 2
    assert "compresses to 99092" in err and "99000" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["hash", "{cfg}", "--compressed", "--pad-id", "426", "--ids", "5,x,3"], "'x' is not an integer"),
        (["hash", "{cfg}", "--compressed", "--pad-id", "426", "--ids", "5,700"], "compressed id 700"),
        (["hash", "{cfg}", "--compressed", "--ids", "5"], "--pad-id"),
        (["hash", "{cfg}", "--compressed", "--pad-id", "9999", "--ids", "5"], "pad id 9999"),
        (["layout", "{plain}"], "no Engram fields"),
        (["layout", "{missing}"], "no config file"),
        (["hash", "{cfg}", "--compressed", "--pad-id", "426", "--ids", "5,,3"], "empty item"),
        (["hash", "{cfg}", "--pad-id", "426", "--ids", "5"], "--pad-id only applies with --compressed"),
        (["hash", "{cfg}"], "the following arguments are required: --ids"),
        (["run", "{cfg}", "--max-new-tokens", "abc"], "argument --max-new-tokens: 'abc' is not an integer"),
        (["run", "{cfg}", "--temperature", "nan"], "--temperature must be a number >= 0"),
        (["demo-checkpoint", "{under_file}"], "is a file, not a folder"),
    ],
)
def test_bad_input_is_one_line_without_traceback(tmp_path, golden_config, argv, needle):
    path, _ = golden_config
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"hidden_size": 8}))
    subst = {
        "{cfg}": str(path),
        "{plain}": str(plain),
        "{missing}": str(tmp_path / "nope"),
        "{under_file}": str(path / "sub"),
    }
    proc = run_subprocess(*[subst.get(a, a) for a in argv])
    assert proc.returncode == 2
    assert needle in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("engram-trt: error: ") and proc.stderr.count("\n") == 1


def test_every_subcommand_has_help(capsys):
    for cmd in ("layout", "hash", "inspect", "run", "build", "demo", "demo-checkpoint"):
        with pytest.raises(SystemExit) as exc:
            main([cmd, "--help"])
        assert exc.value.code == 0
        out = capsys.readouterr().out
        assert "usage: engram-trt " + cmd in out


# ---------------------------------------------------------------- checkpoints
SMALL = {
    "architectures": ["EngramLlamaForCausalLM"],
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 129280,
    "hc_mult": 2,
    "tie_word_embeddings": True,
    "engram_layer_ids": [1],
    "engram_max_ngram_size": 3,
    "engram_n_heads": 2,
    "engram_head_dim": 32,
    "engram_vocab_size": 3000,
    "engram_compressed_vocab_size": 99092,
    "engram_pad_token_id": 1,
}


def _small_checkpoint(path: Path, table_rows_delta: int = 0) -> Path:
    import torch

    from engram_trt.checkpoint.checkpoint import write_checkpoint
    from engram_trt.config.model import ModelConfig
    from engram_trt.models.engram_llama.demo import random_weights
    from engram_trt.engram.layout import EngramLayout

    cfg = ModelConfig.from_dict(SMALL)
    rows = [int(r) + table_rows_delta for r in EngramLayout.from_spec(cfg.engram, 0).table_rows]
    weights = random_weights(cfg, torch.Generator().manual_seed(0), table_rows=rows)
    return write_checkpoint(path, SMALL, weights, default_tokenizer_json(), max_shard_bytes=2_000_000)


def test_inspect_reports_tables(capsys, tmp_path):
    ck = _small_checkpoint(tmp_path / "ck")
    code, out, err = run_cli(capsys, "inspect", str(ck), "--json")
    assert code == 0, err
    rep = json.loads(out)
    assert rep["problems"] == []
    assert rep["compressed_vocab"] == {"built": 99092, "declared": 99092}
    from engram_trt.checkpoint.checkpoint import Checkpoint

    c = Checkpoint.open(ck)
    (layer,) = rep["layers"]
    assert (
        layer["layer_id"] == 1
        and layer["table_rows"] == layer["layout_rows"] == c.shape("model.layers.1.engram.embed.weight")[0]
    )
    want = c.nbytes("model.layers.1.engram.embed.weight") + c.nbytes("model.layers.1.engram.embed.weight_scale_inv")
    assert layer["bytes"] == rep["total_engram_bytes"] == want == layer["table_rows"] * (32 + 1)


def test_table_not_covering_layout_is_reported(capsys, tmp_path):
    ck = _small_checkpoint(tmp_path / "short", table_rows_delta=-1)
    code, out, _ = run_cli(capsys, "inspect", str(ck), "--json")
    assert code == 1
    problems = json.loads(out)["problems"]
    assert any("model.layers.1.engram.embed.weight" in p and "layout needs" in p for p in problems)
    proc = run_subprocess("run", str(ck), "--max-new-tokens", "1")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "does not cover" in proc.stderr and proc.stderr.count("\n") == 1


def test_missing_shard_is_one_line(tmp_path):
    ck = _small_checkpoint(tmp_path / "ck")
    shards = sorted(ck.glob("model-*.safetensors"))
    assert len(shards) >= 2
    shards[-1].unlink()
    for cmd in ("inspect", "run"):
        proc = run_subprocess(cmd, str(ck))
        assert proc.returncode == 2, proc.stderr
        assert shards[-1].name in proc.stderr and "Traceback" not in proc.stderr
        assert proc.stderr.startswith("engram-trt: error: ") and proc.stderr.count("\n") == 1


def test_run_prints_text_speed_and_backend(capsys, demo_dir):
    code, out, err = run_cli(
        capsys, "run", str(demo_dir), "--prompt", "hello engram", "--max-new-tokens", "4", "--json"
    )
    assert code == 0, err
    res = json.loads(out)
    assert res["backend"] == "torch" and res["device"] == "cpu"
    assert res["new_tokens"] == 4 and len(res["token_ids"]) == 4 and res["timings"]["tokens_per_s"] > 0
    assert res["finish_reason"] == "length" and res["source"] == "checkpoint"
    assert res["storage"]["kind"] == "file" and res["storage"]["table_bytes"] > 0
    from engram_trt.engram.tokenizer import load_tokenizer

    assert res["text"] == load_tokenizer(demo_dir).decode(res["token_ids"], skip_special_tokens=True)
    code, out, _ = run_cli(capsys, "run", str(demo_dir), "--prompt", "hello engram", "--max-new-tokens", "4")
    assert code == 0 and "backend: torch" in out and "tokens/s" in out


def test_raw_id_out_of_range_is_one_line(tmp_path):
    d = _deepseek_config_dir(tmp_path, 99092)
    proc = run_subprocess("hash", str(d), "--ids", "5,129280")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "token id 129280" in proc.stderr and proc.stderr.count("\n") == 1


def test_declared_rows_must_match_tables(capsys, tmp_path):
    """engram_num_embeddings that disagree with the stored tables are a problem, even
    when the tables still cover the layout."""
    ck = _small_checkpoint(tmp_path / "ck")
    cfg = json.loads((ck / "config.json").read_text())
    from engram_trt.checkpoint.checkpoint import Checkpoint

    rows = Checkpoint.open(ck).shape("model.layers.1.engram.embed.weight")[0]
    cfg["engram_num_embeddings"] = [rows + 10]
    (ck / "config.json").write_text(json.dumps(cfg))
    code, out, _ = run_cli(capsys, "inspect", str(ck), "--json")
    assert code == 1
    assert any("engram_num_embeddings[0]" in p and str(rows + 10) in p for p in json.loads(out)["problems"])


def test_build_refuses_bad_sizes_before_work(tmp_path):
    ck = _small_checkpoint(tmp_path / "ck")
    for argv, needle in (
        (["--max-seq-len", "0"], "argument --max-seq-len: 0 is outside 1.."),
        (["--max-num-tokens", "0"], "argument --max-num-tokens: 0 is outside 1.."),
        (["--max-seq-len", "100000"], "exceeds the model's max_position_embeddings"),
        (["--plugin-lib", str(tmp_path / "nope.so")], "is not a file"),
        (["--engram-config.bogus", "1"], "unknown field 'bogus'"),
    ):
        out = tmp_path / "eng"
        proc = run_subprocess("build", str(ck), "--output", str(out), *argv)
        assert proc.returncode == 2 and needle in proc.stderr, (argv, proc.stderr)
        assert "Traceback" not in proc.stderr and not out.exists()


def test_demo_end_to_end_json(demo_dir):
    """`engram-trt demo`: the cached demo checkpoint, its engine (TensorRT-RTX where
    installed, else the exported graph only), a generation, and the backend named."""
    proc = run_subprocess("demo", "--json", "--max-new-tokens", "3")
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    assert res["backend"] == "torch" and res["new_tokens"] == 3
    eng = res["engine"]
    assert Path(eng["manifest_path"]).is_file()
    from engram_trt.native import trt_compat

    if trt_compat.module_available("tensorrt_rtx_bindings") or trt_compat.module_available("tensorrt"):
        assert eng["engine_bytes"] > 0 and sorted({p.split("/")[0] for p in eng["plugin_layers"]}) == [
            "EngramAttention",
            "EngramGate",
            "EngramGather",
            "EngramHash",
        ]
        assert eng["tables_to_engine_ratio"] == eng["tables_bytes"] / eng["engine_bytes"] >= 100
    else:
        assert "no TensorRT builder" in res["engine_note"]


def test_inspect_lists_a_missing_engram_head_dim(capsys, tmp_path):
    """inspect's contract is to list problems, not stop at the first: a config without
    engram_head_dim is one problem among the report (exit 1), not an error exit."""
    ck = _small_checkpoint(tmp_path / "ck")
    cfg = json.loads((ck / "config.json").read_text())
    del cfg["engram_head_dim"]
    (ck / "config.json").write_text(json.dumps(cfg))
    code, out, err = run_cli(capsys, "inspect", str(ck), "--json")
    assert code == 1, err
    rep = json.loads(out)
    assert any("engram_head_dim" in p for p in rep["problems"]), rep["problems"]
    assert rep["layers"] and rep["compressed_vocab"]["built"] == 99092  # the rest is still reported


def test_build_check_phase_times_the_validation(tmp_path, monkeypatch, tiny_ckpt):
    """The summary's "check" phase is where the checkpoint is validated (it used to run
    inside "vocab", leaving "check" timing nothing)."""
    import time

    from engram_trt.builder import build as build_mod

    real = build_mod.require_valid

    def slow(*a, **k):
        time.sleep(0.3)
        return real(*a, **k)

    monkeypatch.setattr(build_mod, "require_valid", slow)
    r = build_mod.build(tiny_ckpt, tmp_path / "eng", build_engine_if_possible=False, progress=False)
    assert r.phase_seconds["check"] >= 0.3 > r.phase_seconds["vocab"]


def test_one_dtype_vocabulary(capsys, tmp_path, tiny_ckpt):
    """Every subcommand takes every spelling: build bfloat16 / float16 and run bf16 / fp32."""
    from engram_trt.builder.build import build

    for spelling, want in (("bfloat16", "bf16"), ("float16", "fp16"), ("BF16", "bf16")):
        code, out, err = run_cli(
            capsys,
            "build",
            str(tiny_ckpt),
            "-o",
            str(tmp_path / f"e-{spelling}"),
            "--no-engine",
            "--dtype",
            spelling,
            "--json",
        )
        assert code == 0, err
        assert json.loads((tmp_path / f"e-{spelling}" / "manifest.json").read_text())["dtype"] == want
    for spelling, want in (("bf16", "bfloat16"), ("fp32", "float32"), ("float32", "float32")):
        code, out, err = run_cli(
            capsys, "run", str(tiny_ckpt), "--prompt", "w1 w2", "--max-new-tokens", "1", "--dtype", spelling, "--json"
        )
        assert code == 0, err
        assert json.loads(out)["dtype"] == want
    with pytest.raises(EngramError, match="--dtype fp32: an engine runs in bf16 or fp16"):
        build(tiny_ckpt, tmp_path / "x", dtype="float32", progress=False)


def _offered_dtypes(capsys, command: str) -> tuple[set[str], str]:
    """The dtypes ``COMMAND --help`` offers for --dtype (its ``{a,b}`` metavar), and the flag's help text."""
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    offered = re.findall(r"\[--dtype \{([\w,]+)\}\]", text)
    assert len(offered) == 1, text
    return set(offered[0].split(",")), text.split(" --dtype {", 2)[-1]


def test_help_offers_only_the_dtypes_a_command_accepts(capsys, tmp_path, tiny_ckpt):
    """`build --help` once offered `--dtype {bf16,fp16,fp32}` though build refuses fp32 (and `run` offered fp16,
    which it refuses): each command's --help offers exactly the dtypes it then takes, and its help's spellings
    name no other; every dtype it does not offer is refused in one line naming --dtype."""
    probes = {
        "build": lambda d: [
            "build",
            str(tiny_ckpt),
            "-o",
            str(tmp_path / f"e-{d}"),
            "--no-engine",
            "--json",
            "--dtype",
            d,
        ],
        "run": lambda d: ["run", str(tiny_ckpt), "--prompt", "w1 w2", "--max-new-tokens", "1", "--json", "--dtype", d],
    }
    for command, argv in probes.items():
        offered, help_text = _offered_dtypes(capsys, command)
        for dtype in ("bf16", "fp16", "fp32"):
            code, out, err = run_cli(capsys, *argv(dtype))
            if dtype in offered:
                assert code == 0, (command, dtype, err)
            else:
                assert code == 2 and err.count("\n") == 1 and f"--dtype {dtype}" in err, (command, dtype, err)
                assert f"{dtype}|" not in help_text.split(" --", 1)[0], (command, help_text)
    assert _offered_dtypes(capsys, "demo")[0] == _offered_dtypes(capsys, "run")[0]  # demo takes run's options


# ---------------------------------------------------------------- flags as --help shows them
def test_ids_may_start_with_a_dead_token(capsys, golden_config):
    """`--ids -1,5,...` (the form --help shows) is an id list, not an unknown option; the
    hashes equal those of `--ids=-1,5,...`."""
    path, case = golden_config
    seq = [-1] + list(case["sequences"][0][1:])
    ids = ",".join(map(str, seq))
    base = ["hash", str(path), "--compressed", "--pad-id", str(case["pad_compressed_id"])]
    code, spaced, err = run_cli(capsys, *base, "--ids", ids)
    assert code == 0, err
    code, joined, _ = run_cli(capsys, *base, f"--ids={ids}")
    assert code == 0 and json.loads(spaced) == json.loads(joined)
    assert len(json.loads(spaced)["hash_ids"]) == len(seq)
    with pytest.raises(SystemExit):
        main(["hash", "--help"])
    assert "--ids -1,5,17" in " ".join(capsys.readouterr().out.split())
    code, _, err = run_cli(capsys, *base, "--ids", "-5,1")  # still an id list, refused by its own check
    assert code == 2 and "-5 is not a token id" in err and err.count("\n") == 1
    with pytest.raises(SystemExit) as exc:  # a forgotten value stays argparse's usage error
        main([*base, "--ids", "--compressed"])
    assert exc.value.code == 2 and "expected one argument" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["", ",", " , "])
def test_empty_target_list_is_refused(capsys, tmp_path, value):
    with pytest.raises(SystemExit) as exc:  # argparse's usage error: one line, exit 2
        main(["build", str(tmp_path / "ck"), "--output", str(tmp_path / "e"), "--target", value])
    out, err = capsys.readouterr()
    assert exc.value.code == 2 and out == "" and err.count("\n") == 1
    assert "--target" in err and "names no compute capability" in err
    assert not (tmp_path / "e").exists()


def test_serve_allow_unused_weights_reaches_the_model(tmp_path):
    """`serve` / `triton-repo --allow-unused-weights`: the model repository's parameters
    carry it and the instance's LLM loads a checkpoint with a tensor the model does not
    read; without it the instance refuses that checkpoint naming the tensor."""
    pytest.importorskip("transformers")
    import torch
    from safetensors.torch import load_file, save_file

    from engram_trt.cli.main import build_parser
    from engram_trt.cli.serve import options_from_args
    from engram_trt.llmapi.llm import LLM
    from engram_trt.triton.model import ModelParams
    from engram_trt.triton.repo import model_parameters, resolve_options
    from helpers.llama import save_llama

    save_llama(tmp_path / "ck", seed=3)
    st = tmp_path / "ck" / "model.safetensors"
    tensors = load_file(st)
    tensors["model.mtp.0.proj.weight"] = torch.zeros(4, 4)
    save_file(tensors, st, metadata={"format": "pt"})

    def params(*extra: str) -> ModelParams:
        args = build_parser().parse_args(
            ["serve", str(tmp_path / "ck"), "--device", "cpu", "--backend", "torch", *extra]
        )
        opts = resolve_options(options_from_args(args))
        raw = model_parameters(opts)
        return ModelParams.from_model_config({"parameters": {k: {"string_value": v} for k, v in raw.items()}})

    refused = params()
    assert refused.allow_unused_weights is False and refused.llm_kwargs()["allow_unused_weights"] is False
    with pytest.raises(EngramError, match=r"model\.mtp\.0\.proj\.weight.*--allow-unused-weights"):
        LLM(refused.engine_dir, device="cpu", **refused.llm_kwargs())
    allowed = params("--allow-unused-weights")
    assert allowed.llm_kwargs()["allow_unused_weights"] is True
    with LLM(allowed.engine_dir, device="cpu", **allowed.llm_kwargs()) as llm:
        assert len(llm.generate("w5 w6", {"max_tokens": 2, "ignore_eos": True})[0].token_ids) == 2
    args = build_parser().parse_args(
        ["triton-repo", str(tmp_path / "ck"), "--out", str(tmp_path / "repo"), "--allow-unused-weights"]
    )
    assert args.allow_unused_weights is True


def test_run_reports_steady_decode_apart_from_warmup(capsys, tiny_ckpt):
    """`run --json`: prefill, warm-up steps, graph capture and the steady decode rate as
    separate fields (positive where something was timed; no graphs on a CPU)."""
    argv = [
        "run",
        str(tiny_ckpt),
        "--prompt",
        "w5 w6 w7",
        "--max-new-tokens",
        "8",
        "--ignore-eos",
        "--device",
        "cpu",
        "--backend",
        "torch",
    ]
    code, out, err = run_cli(capsys, *argv, "--json")
    assert code == 0, err
    tm = json.loads(out)["timings"]
    assert tm["prefill_s"] > 0 and tm["prefill_s"] == tm["time_to_first_token_s"]
    assert tm["decode_warmup_s"] > 0 and tm["steady_decode_steps"] == 8 - 1 - 2
    assert tm["steady_decode_tokens_per_s"] > 0 and tm["decode_tokens_per_s"] > 0
    assert tm["graph_captures"] == 0 and tm["graph_capture_s"] == 0.0
    code, out, err = run_cli(capsys, *argv)
    assert code == 0 and "tokens/s steady" in out and "prefill (first token)" in out and "CUDA graph capture" in out


def test_steady_decode_takes_the_median_after_warmup():
    from engram_trt.runtime.scheduler import steady_decode

    # token times: a 1 s first decode step (capture), then 0.1 s steps, one 0.5 s spike
    times = [0.0, 1.0, 1.2, 1.3, 1.4, 1.9, 2.0, 2.1]
    d = steady_decode(times, warmup=2)
    assert d["decode_warmup_s"] == pytest.approx(1.2) and d["steady_decode_steps"] == 5
    assert d["steady_decode_tokens_per_s"] == pytest.approx(10.0)
    assert steady_decode([0.0]) == {} and steady_decode([0.0, 0.5])["steady_decode_tokens_per_s"] == 2.0
    assert "steady_decode_p10_step_us" not in d  # too few steps for a spread

    # ten steady steps of 1..10 ms (shuffled): p10 / p90 by linear interpolation, 1.9 and 9.1 ms
    gaps = [0.005, 0.002, 0.009, 0.001, 0.010, 0.004, 0.007, 0.003, 0.008, 0.006]
    times = [0.0, 1.0, 1.5] + list(1.5 + np.cumsum(gaps))
    d = steady_decode(times, warmup=2)
    assert d["steady_decode_steps"] == 10
    assert d["steady_decode_p10_step_us"] == pytest.approx(1900.0) and d["steady_decode_p90_step_us"] == pytest.approx(
        9100.0
    )
    assert d["steady_decode_tokens_per_s"] == pytest.approx(1 / 0.0055, abs=0.01)


def test_chat_flags_checked_before_loading(capsys, tmp_path):
    code, _, err = run_cli(capsys, "run", str(tmp_path / "nothing"), "--system", "be brief")
    assert code == 2 and "--system" in err and "--chat" in err and err.count("\n") == 1


def test_inspect_reports_weights_by_stored_dtype_and_the_load(capsys, tiny_ckpt):
    """Every architecture's report (here engram-llama, the generic weight_formats): bytes
    per stored dtype as the shard headers say, no quantization, and a load at bf16 takes
    two bytes per float value the model reads (its F32 weights halved), the tables apart."""
    from engram_trt.checkpoint.checkpoint import Checkpoint
    from engram_trt.models.engram_llama.weights import model_weight_shapes

    code, out, err = run_cli(capsys, "inspect", str(tiny_ckpt), "--json")
    assert code == 0, err
    w = json.loads(out)["weights"]
    c = Checkpoint.open(tiny_ckpt)
    by_dtype: dict = {}
    for n in c.tensor_names():
        by_dtype[c.st_dtype(n)] = by_dtype.get(c.st_dtype(n), 0) + c.nbytes(n)
    assert w["stored_bytes"] == by_dtype and w["quantization"] is None
    shapes = model_weight_shapes(c.config)
    values = sum(int(np.prod(s)) for s in shapes.values())
    assert w["load"]["dtype"] == "bf16" and w["load"]["tensors"] == len(shapes)
    assert w["load"]["gpu_bytes"] == 2 * values and w["load"]["stored_bytes"] == sum(c.nbytes(n) for n in shapes)
    code, out, _ = run_cli(capsys, "inspect", str(tiny_ckpt), "--dtype", "fp32")
    assert code == 0 and "at --dtype fp32 (float " in out and "quantization none (float weights)" in out


def test_printed_next_step_commands_quote_paths_with_spaces(capsys, tmp_path):
    """The command a subcommand prints for the next step runs as printed: a path with a
    space (or a quote) is one argument when the shell splits the line."""
    import shlex

    src = tmp_path / "my model's folder"
    shutil.copytree(REPO / "tests" / "data" / "deepseek_v4_tiny", src)
    repo = tmp_path / "triton repo"
    code, out, err = run_cli(capsys, "triton-repo", str(src), "--out", str(repo))
    assert code == 0, err
    line = next(x for x in out.splitlines() if x.startswith("serve it:"))
    first, second = line[len("serve it:") :].split("(or:")
    assert shlex.split(first) == ["tritonserver", "--model-repository", str(repo)]
    assert shlex.split(second.rstrip(")")) == ["engram-trt", "serve", str(src)]
