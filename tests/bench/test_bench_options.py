"""`engram-trt bench`'s flags come from each subcommand's options dataclass
(engram_trt.bench.options.opt, derived in engram_trt.cli.bench): the parsed defaults are
the dataclass's own, argparse stays in cli/, and the derivation spells every form a
flag takes (typed values, lists, choices, store_true, nargs/const, positional, required,
a cli/argtypes validator, a mutually exclusive group). The scripts under benchmarks/ (the
former kernel and lookup commands) take their flags the same way (cli.bench.run_script)."""

from __future__ import annotations

import argparse
import ast
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest

from helpers.benchmark_scripts import SCRIPTS, script
from helpers.files import REPO
from engram_trt.bench.options import opt
from engram_trt.cli.bench import BENCH_COMMANDS, add_option_arguments, options_from, script_parser
from engram_trt.cli.main import build_parser

BENCH = REPO / "python" / "engram_trt" / "bench"
REQUIRED = {"rowcounts": ["--out", "counts.npz"], "serve": ["ENGINE"]}
GPU_ONLY_SCRIPTS = ["kernels", "attention", "backbone", "gathersweep", "contention", "cacheplan", "ple-gather"]
GPU_ONLY = ["qwen4-step", "dsv4-step"]  # with GPU_ONLY_SCRIPTS: the former H200 timings


def _parse(name: str, argv: list[str]):
    """A former bench command's command line through its script's parser: its options."""
    mod = script(name)
    return options_from(script_parser(mod.OPTIONS, mod.__doc__, Path(SCRIPTS[name]).name).parse_args(argv), mod.OPTIONS)


def test_every_subcommand_parses_to_its_options_defaults() -> None:
    parser = build_parser()
    assert [c.name for c in BENCH_COMMANDS] == ["step", "serve", "steady", *GPU_ONLY, "e2e"]
    for cmd in BENCH_COMMANDS:
        ns = parser.parse_args(["bench", cmd.name, *REQUIRED.get(cmd.name, [])])
        got = options_from(ns, cmd.options)
        assert isinstance(got, cmd.options) and callable(cmd.module.run)
        want = {"rowcounts": {"out": Path("counts.npz")}, "serve": {"path": "ENGINE"}}.get(cmd.name, {})
        assert asdict(got) == asdict(cmd.options(**want)), cmd.name


def test_every_benchmark_script_parses_to_its_options_defaults() -> None:
    """The former bench commands are scripts now, each parsing to its options' defaults as
    the command did; none was dropped (the commands and the scripts are the 18 of before)."""
    assert sorted([*SCRIPTS, *(c.name for c in BENCH_COMMANDS)]) == sorted(
        [
            "gather",
            "cache",
            "idstream",
            "rowcounts",
            "step",
            "serve",
            "steady",
            "gemv",
            *GPU_ONLY_SCRIPTS,
            *GPU_ONLY,
            "e2e",
        ]
    )
    for name in SCRIPTS:
        mod = script(name)
        got = _parse(name, REQUIRED.get(name, []))
        assert isinstance(got, mod.OPTIONS) and callable(mod.run) and callable(mod.main)
        want = {"rowcounts": {"out": Path("counts.npz")}}.get(name, {})
        assert asdict(got) == asdict(mod.OPTIONS(**want)), name


def test_bench_holds_no_argparse_and_no_cli_import() -> None:
    for path in sorted(BENCH.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            assert not any(n == "argparse" or n.startswith("engram_trt.cli") for n in names), (path.name, names)


def test_list_defaults_are_not_shared_between_instances() -> None:
    GatherOptions = script("gather").GatherOptions

    a, b = GatherOptions(), GatherOptions()
    a.threads.append(32)
    assert b.threads == [4, 8, 16]


@dataclass(kw_only=True)
class _Demo:
    src: str = opt(positional=True, metavar="SRC", help="a positional")
    count: int = opt(3, help="an int (default: %(default)s)")
    ratio: float | None = opt(None, help="a float or None")
    where: Path = opt(help="required path")
    sizes: list[int] = opt([1, 2], help="ints")
    parts: list[str] = opt(["a"], choices=("a", "b"), help="a subset")
    mode: str = opt("x", choices=("x", "y"), help="one of")
    no_thing: bool = opt(False, help="off switch")
    json: str | None = opt(None, nargs="?", const="-", metavar="PATH", help="json")
    seed: int = opt(0, argtype=("int_arg", 0, 9), help="strict")
    fast: bool = opt(False, exclusive="speed", help="fast")
    slow: bool = opt(False, exclusive="speed", help="slow")
    level: int = opt(1, flags=("-l", "--level"), help="short flag")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ValueError(message)


def test_the_derivation_spells_every_form_of_flag() -> None:
    p = _Parser(prog="demo")
    add_option_arguments(p, _Demo)
    o = options_from(p.parse_args(["in", "--where", "w"]), _Demo)
    assert o == _Demo(src="in", where=Path("w"))
    o = options_from(
        p.parse_args(
            [
                "in",
                "--where",
                "w",
                "--count",
                "5",
                "--ratio",
                "0.5",
                "--sizes",
                "4,8",
                "--parts",
                "b,a",
                "--mode",
                "y",
                "--no-thing",
                "--json",
                "--seed",
                "9",
                "--fast",
                "-l",
                "7",
            ]
        ),
        _Demo,
    )
    assert (o.count, o.ratio, o.sizes, o.parts, o.mode, o.no_thing, o.json, o.seed, o.fast, o.level) == (
        5,
        0.5,
        [4, 8],
        ["b", "a"],
        "y",
        True,
        "-",
        9,
        True,
        7,
    )
    for bad, why in (
        (["in"], "required: --where"),
        (["in", "--where", "w", "--sizes", "x"], "comma-separated integers"),
        (["in", "--where", "w", "--parts", "c"], "list of a, b"),
        (["in", "--where", "w", "--mode", "z"], "invalid choice"),
        (["in", "--where", "w", "--seed", "10"], "outside 0..9"),
        (["in", "--where", "w", "--fast", "--slow"], "not allowed with"),
    ):
        with pytest.raises(ValueError, match=why):
            p.parse_args(bad)
    text = p.format_help()
    assert "an int (default: 3)" in text and "--json [PATH]" in text and "-l LEVEL, --level LEVEL" in text


def test_a_true_default_flag_is_refused() -> None:
    @dataclass
    class Bad:
        on: bool = opt(True, help="?")

    with pytest.raises(TypeError, match="off by default"):
        add_option_arguments(argparse.ArgumentParser(), Bad)


@pytest.mark.parametrize(
    "argv,want",
    [
        (
            ["kernels", "--table-gib", "0.5", "--reps", "3", "--no-gathers", "--seed", "7", "--json", "k.json"],
            {"table_gib": 0.5, "reps": 3, "no_gathers": True, "seed": 7, "json": "k.json"},
        ),
        (
            ["attention", "--reps", "5", "--cases", "decode 64 x 256,prefill 1 x 8k chunk"],
            {"reps": 5, "cases": ["decode 64 x 256", "prefill 1 x 8k chunk"]},
        ),
        (
            ["backbone", "--iters", "4", "--batches", "1,8", "--context", "512"],
            {"iters": 4, "batches": [1, 8], "context": 512},
        ),
        (["gathersweep", "--table-gib", "2", "--reps", "9"], {"table_gib": 2.0, "reps": 9}),
        (["contention", "--table-gib", "1.5", "--reps", "4"], {"table_gib": 1.5, "reps": 4}),
        (
            ["cacheplan", "--plan-reps", "2", "--fetch-reps", "3", "--skip-fetch"],
            {"plan_reps": 2, "fetch_reps": 3, "skip_fetch": True, "skip_plans": False},
        ),
    ],
)
def test_the_gpu_timings_parse(argv: list[str], want: dict) -> None:
    options = script(argv[0]).OPTIONS
    got = asdict(_parse(argv[0], argv[1:]))
    assert {k: got[k] for k in want} == want
    assert {k: v for k, v in got.items() if k not in want} == {
        k: v for k, v in asdict(options()).items() if k not in want
    }


def test_an_unknown_attention_case_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        script("attention").main(["--cases", "decode 2 x 2"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "expected a comma-separated list of decode 1 x 4k" in err
    assert err.startswith("bench_attention.py: error: ") and err.count("\n") == 1


@pytest.mark.parametrize("name", GPU_ONLY + GPU_ONLY_SCRIPTS)
def test_without_cuda_each_gpu_timing_exits_with_one_line(
    name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    from engram_trt.cli.main import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    if name in GPU_ONLY:
        assert main(["bench", name]) == 2
        prog = "engram-trt"
    else:
        assert script(name).main([]) == 2
        prog = Path(SCRIPTS[name]).name
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith(f"{prog}: error: bench {name} needs a CUDA GPU") and "none is available here" in err


@pytest.mark.parametrize(
    "argv,why",
    [
        (["kernels", "--reps", "0"], "--reps must be >= 1"),
        (["attention", "--reps", "0"], "--reps must be >= 1"),
        (["backbone", "--batches", "0,4"], "must be >= 1"),
        (["gathersweep", "--reps", "2"], "--reps must be >= 3"),
        (["contention", "--table-gib", "0"], "--table-gib > 0"),
        (["cacheplan", "--skip-plans", "--skip-fetch"], "leave nothing to time"),
    ],
)
def test_bad_values_are_one_line_before_any_gpu_work(
    argv: list[str], why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert script(argv[0]).main(argv[1:]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and why in err, err
