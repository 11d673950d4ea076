"""The command line as the tests run it in-process: ``engram-trt run`` of a checkpoint, its
JSON or its one-line refusal."""

from __future__ import annotations

from pathlib import Path

from helpers.checkpoints import words


def run_json(folder: Path, prompt: list[int], n: int, capsys) -> dict:
    """``engram-trt run --json`` of a word-tokenizer prompt (fp32 on the CPU, EOS ignored,
    ``n`` tokens): its JSON; asserts exit 0."""
    import json

    from engram_trt.cli.main import main

    capsys.readouterr()
    code = main(
        [
            "run",
            str(folder),
            "--prompt",
            words(prompt),
            "--max-new-tokens",
            str(n),
            "--ignore-eos",
            "--device",
            "cpu",
            "--dtype",
            "fp32",
            "--json",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    return json.loads(out)


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
