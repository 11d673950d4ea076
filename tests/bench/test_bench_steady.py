"""``engram-trt bench steady`` end to end on a tiny checkpoint (CPU): ``run``'s steady
decode rate beside ``bench serve``'s one-stream figure, each from its own command, and
their ratio; a failing stage ends in one line naming the command."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from helpers.checkpoints import make_tiny_checkpoint

from engram_trt.bench.steady import TARGET, ratio_report
from engram_trt.cli.main import main


def test_steady_rate_beside_bench_serve_on_a_tiny_checkpoint(tmp_path: Path, monkeypatch: Any, capsys: Any) -> None:
    monkeypatch.setenv("ENGRAM_TRT_CACHE", str(tmp_path / "cache"))
    ck = make_tiny_checkpoint(tmp_path / "ck")
    n = 14  # 11 steady steps: enough for the p10 / p90 spread
    code = main(
        [
            "bench",
            "steady",
            "--path",
            str(ck),
            "--max-tokens",
            str(n),
            "--repeat",
            "1",
            "--rounds",
            "2",
            "--device",
            "cpu",
            "--json",
            str(tmp_path / "s.json"),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    res = json.loads((tmp_path / "s.json").read_text())
    rounds = res["rounds"]
    assert "demo" not in res and res["path"] == str(ck) and len(rounds) == 2
    for rnd in rounds:  # each round: run, then bench serve, each a fresh process with its own figures
        run, serve = rnd["run"], rnd["bench_serve"]
        # run: n tokens, n-1 decode gaps, the first two are warm-up, the rest steady
        assert run["new_tokens"] == n and run["finish_reason"] == "length"
        assert run["steady_decode_steps"] == n - 1 - 2 and run["steady_decode_tokens_per_s"] > 0
        assert 0 < run["steady_decode_p10_step_us"] <= run["steady_decode_p90_step_us"]
        assert serve["steps"] == n and serve["one_stream_tokens_per_s"] > 0  # one prefill step, n-1 decode steps
        r = serve["one_stream_tokens_per_s"] / run["steady_decode_tokens_per_s"]
        assert rnd["ratios"]["run"]["serve_over_steady"] == round(r, 4)
    # the verdict: the median figures over the rounds (the lower of two), each command's own median
    rates = [rnd["run"]["steady_decode_tokens_per_s"] for rnd in rounds]
    serves = [rnd["bench_serve"]["one_stream_tokens_per_s"] for rnd in rounds]
    run, serve = res["run"], res["bench_serve"]
    assert run["steady_decode_tokens_per_s"] == min(rates) and serve["one_stream_tokens_per_s"] == min(serves)
    r = serve["one_stream_tokens_per_s"] / run["steady_decode_tokens_per_s"]
    q = serve["one_stream_steady_decode_tokens_per_s"] / run["steady_decode_tokens_per_s"]
    assert res["ratios"]["run"] == {
        "serve_over_steady": round(r, 4),
        "within_target": max(r, 1 / r) <= TARGET,
        "serve_steady_over_steady": round(q, 4),
    }
    assert res["rounds_within_target"]["run"] == sum(rnd["ratios"]["run"]["within_target"] for rnd in rounds)
    assert [c.split()[1] for c in res["commands"]] == ["run", "bench"]
    assert f"bench serve / run = {round(r, 4)}" in out and "round 2: run " in out


def test_ratio_report_either_way() -> None:
    assert ratio_report(100.0, 119.0)["within_target"] and ratio_report(119.0, 100.0)["within_target"]
    assert not ratio_report(100.0, 121.0)["within_target"] and not ratio_report(121.0, 100.0)["within_target"]
    assert ratio_report(None, 5.0) == {"serve_over_steady": None, "within_target": None}


def test_a_failing_stage_is_one_line(tmp_path: Path, capsys: Any) -> None:
    code = main(["bench", "steady", "--path", str(tmp_path / "nothing"), "--max-tokens", "4", "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0].startswith("engram-trt: error: bench steady: `engram-trt run ")
    assert "(run) exited 2: engram-trt: error: " in err[0] and "nothing" in err[0]  # the stage's own line
    with pytest.raises(SystemExit):
        main(["bench", "steady", "--max-tokens", "2"])  # fewer than 4: no steady steps
