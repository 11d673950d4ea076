"""Issue 32 item 5: what ``run`` / ``demo`` call their steady decode rate, on the CPU.

The steady window leaves out the warm-up decode steps (graph capture lives there) and
is defined once (:func:`steady_decode`) for ``run``, ``demo`` and ``bench serve``'s
one-stream request; ``run`` and ``bench serve`` do the same host work per token (one
scheduler step, no per-token detokenization or output when nobody streams, one decode
of the text at the end), so a gap between their figures is not ``run``'s own code."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from helpers.checkpoints import make_tiny_checkpoint

from engram_trt.bench.steady import median_of
from engram_trt.cli.main import main
from engram_trt.runtime import detokenize, scheduler
from engram_trt.runtime.scheduler import WARMUP_DECODE_STEPS, steady_decode


def test_the_window_leaves_out_warm_up_and_capture() -> None:
    rng = np.random.default_rng(3)
    gaps = np.concatenate([[0.40, 0.25], rng.uniform(0.001, 0.002, 60), [0.30], rng.uniform(0.0005, 0.001, 61)])
    times = np.concatenate([[10.0], 10.0 + np.cumsum(gaps)]).tolist()
    got = steady_decode(times)
    steady = gaps[WARMUP_DECODE_STEPS:]
    assert got["steady_decode_steps"] == gaps.size - 2 == 122
    assert abs(got["decode_warmup_s"] - 0.65) < 1e-9  # the two warm-up gaps alone
    assert got["steady_decode_tokens_per_s"] == round(1 / float(np.median(steady)), 2)
    first, second = steady[:61], steady[61:]
    assert got["steady_decode_first_half_tokens_per_s"] == round(1 / float(np.median(first)), 2)
    assert got["steady_decode_second_half_tokens_per_s"] == round(1 / float(np.median(second)), 2)
    assert got["steady_decode_second_half_tokens_per_s"] > 1.3 * got["steady_decode_first_half_tokens_per_s"]
    assert "steady_decode_first_half_tokens_per_s" not in steady_decode([0.0, 1.0, 2.0, 3.0, 4.0])  # 2 steady gaps


def test_median_of_takes_the_middle_round() -> None:
    runs = [{"steady_decode_tokens_per_s": r, "i": i} for i, r in enumerate([2194.0, 3333.0, 2900.0])]
    key = "steady_decode_tokens_per_s"
    assert median_of(runs, key)["i"] == 2
    assert median_of(runs[:1], key) == runs[0]
    assert median_of(runs[:2], key)["i"] == 0  # the lower middle of an even count
    assert median_of([{"i": 0}, *runs[:2]], key)["i"] == 0  # a missing figure ranks lowest
    assert median_of([{"i": 9}, *runs], key)["i"] == 0  # 0, 2194, 2900, 3333: the lower middle


def _counting(monkeypatch: Any) -> dict[str, int]:
    """Count scheduler steps, incremental detokenizer updates and whole-text decodes."""
    counts = {"steps": 0, "updates": 0, "decodes": 0}
    complete, update = scheduler.Scheduler._complete, detokenize.IncrementalText.update
    finish = scheduler.Scheduler._finish

    def counted_complete(self: Any, launched: Any) -> Any:  # every step's tokens are handed out here
        counts["steps"] += 1
        return complete(self, launched)

    def counted_update(self: Any) -> Any:
        counts["updates"] += 1
        return update(self)

    def counted_finish(self: Any, req: Any, reason: str, emit: bool) -> None:
        counts["decodes"] += int(req.text_stale)
        finish(self, req, reason, emit)

    monkeypatch.setattr(scheduler.Scheduler, "_complete", counted_complete)
    monkeypatch.setattr(detokenize.IncrementalText, "update", counted_update)
    monkeypatch.setattr(scheduler.Scheduler, "_finish", counted_finish)
    return counts


def test_run_does_the_host_work_per_token_bench_serve_does(tmp_path: Path, monkeypatch: Any, capsys: Any) -> None:
    monkeypatch.setenv("ENGRAM_TRT_CACHE", str(tmp_path / "cache"))
    ck = make_tiny_checkpoint(tmp_path / "ck")
    n = 10
    counts = _counting(monkeypatch)
    assert main(["run", str(ck), "--max-new-tokens", str(n), "--ignore-eos", "--json", "--device", "cpu"]) == 0
    res = json.loads(capsys.readouterr().out)
    run_counts = dict(counts)
    # one step per token (the prompt's prefill gives the first), nothing decoded per token, the text once
    assert run_counts == {"steps": n, "updates": 0, "decodes": 1}
    tm = res["timings"]
    assert tm["steady_decode_steps"] == n - 1 - WARMUP_DECODE_STEPS
    assert tm["graph_captures"] == 0 and "graph_shapes" not in tm  # no decode graphs on a CPU
    for k in counts:
        counts[k] = 0
    out = tmp_path / "serve.json"
    assert (
        main(
            [
                "bench",
                "serve",
                str(ck),
                "--concurrency",
                "1",
                "--max-tokens",
                str(n),
                "--repeat",
                "2",
                "--device",
                "cpu",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    one = json.loads(out.read_text())["levels"]["1"]
    # a warm-up request and two timed ones: the same per request as run's one
    assert counts == {k: 3 * v for k, v in run_counts.items()}
    assert one["steps"] == n and one["steady_decode_tokens_per_s"] > 0
