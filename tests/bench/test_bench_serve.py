"""``engram-trt bench serve``'s sequences per step: the tokens the requests generated over
the scheduler's steps. It once divided every token a step computed (the prompt's
included) by the steps, so one stream read 2.0 (32 prompt + 31 decode tokens over 32
steps)."""

from __future__ import annotations

import json
from pathlib import Path

from engram_trt.cli.main import main


def _serve(capsys, tmp_path: Path, ckpt: Path, *extra: str) -> tuple[dict, str]:
    out = tmp_path / "serve.json"
    code = main(
        [
            "bench",
            "serve",
            str(ckpt),
            "--device",
            "cpu",
            "--prompt-tokens",
            "8",
            "--max-tokens",
            "5",
            "--json",
            str(out),
            *extra,
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0, printed
    return json.loads(out.read_text()), printed


def test_one_stream_serves_one_sequence_a_step(capsys, tmp_path, tiny_ckpt):
    res, printed = _serve(capsys, tmp_path, tiny_ckpt, "--concurrency", "1,3")
    one, three = res["levels"]["1"], res["levels"]["3"]
    # one stream: the prefill's step samples the first token, then one decode step per token
    assert one["steps"] == 5 and one["mean_seqs_per_step"] == 1.0
    # three streams: 15 tokens over the steps they took, between fully batched and one at a time
    assert 5 <= three["steps"] <= 15 and three["mean_seqs_per_step"] == 15 / three["steps"]
    # the overlapped decode (default): one stream's last three decode steps queued ahead (the
    # first follows the prefill, which is not a decode step), and some of three streams'
    assert one["chained_steps"] == 3 and three["chained_steps"] > 0
    row = next(line.split() for line in printed.splitlines() if line.split()[:1] == ["1"])
    assert row[-1] == "1.0", printed


def test_serial_decode_steps_are_not_counted_as_queued(capsys, tmp_path, tiny_ckpt, monkeypatch):
    """ENGRAM_TRT_OVERLAP=0: no decode step is queued before the step before's tokens are
    read; the step count is the overlapped loop's."""
    monkeypatch.setenv("ENGRAM_TRT_OVERLAP", "0")
    res, _ = _serve(capsys, tmp_path, tiny_ckpt, "--concurrency", "1")
    one = res["levels"]["1"]
    assert one["steps"] == 5 and one["chained_steps"] == 0


def test_a_prompt_in_chunks_samples_at_its_last_chunk(capsys, tmp_path, tiny_ckpt):
    """A step budget of 4 tokens cuts the 8-token prompt in two steps; only the second samples."""
    res, _ = _serve(capsys, tmp_path, tiny_ckpt, "--concurrency", "1", "--max-num-tokens", "4")
    one = res["levels"]["1"]
    assert one["steps"] == 6 and one["mean_seqs_per_step"] == 5 / 6
