"""benchmarks/kernels/bench_moe_grouped.py (the grouped decode MoE against the 9-64-token path
before it and moe_experts in 16-token slices) on a CPU: it imports as the script does, its
flags parse to its options' defaults, ``--help`` prints them, and without CUDA (or with a bad
value, before any GPU work) it exits 2 with one line. The timing itself needs a GPU."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from helpers.benchmark_scripts import BENCHMARKS, module
from engram_trt.cli.bench import options_from, script_parser

SCRIPT = BENCHMARKS / "kernels" / "bench_moe_grouped.py"


def _mod():
    return module("kernels", "bench_moe_grouped")


def test_flags_parse_to_the_defaults_and_help_prints_them() -> None:
    mod = _mod()
    got = options_from(script_parser(mod.OPTIONS, mod.__doc__, SCRIPT.name).parse_args([]), mod.OPTIONS)
    assert asdict(got) == asdict(mod.OPTIONS()) and callable(mod.run) and callable(mod.main)
    assert got.tokens == [8, 16, 32, 64] and (got.hidden, got.experts, got.top_k, got.intermediate) == (
        2048,
        8,
        2,
        1024,
    )
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, check=True).stdout
    for flag in ("--tokens", "--ways", "--copies", "--json"):
        assert flag in out, out


def test_without_cuda_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _mod().main([]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith(f"{Path(SCRIPT).name}: error: bench moe-grouped needs a CUDA GPU"), err


@pytest.mark.parametrize(
    "argv,why",
    [
        (["--tokens", "8,65"], "--tokens: each must be in 1..64 (got [8, 65])"),
        (["--hidden", "2047"], "--hidden and --intermediate must be positive multiples of 8"),
        (["--top-k", "9"], "--top-k must be in 1..min(--experts, 16) (got 9)"),
        (["--calls", "0"], "--copies, --calls and --iters must be >= 1 and --limit > 0"),
        (["--ways", "fastest"], "expected a comma-separated list of grouped, current, slices"),
    ],
)
def test_bad_values_are_one_line(argv: list[str], why: str, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = _mod().main(argv)
    except SystemExit as exc:  # argparse's own refusal (a bad choice)
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and why in err, err
