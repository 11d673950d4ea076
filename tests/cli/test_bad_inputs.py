"""One line and exit 2 for every bad input: a table of hostile inputs across every
subcommand. Each case checks: exit status 2, exactly one line on stderr in the CLI's
form, naming the input (and the fix), no traceback, and nothing written (the workspace
and the cache are byte-for-byte as before)."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from helpers.files import REPO
from engram_trt.cli.main import main

HASH_CONFIG = {
    "engram_layer_ids": [0],
    "engram_max_ngram_size": 3,
    "engram_n_heads": 2,
    "engram_vocab_size": 5000,
    "engram_compressed_vocab_size": 512,
    "engram_pad_token_id": 1,
}


def snapshot(folder: Path) -> dict[str, tuple[int, int, int]]:
    """(size, mtime_ns, inode) of everything under ``folder``: any write shows."""
    return {
        str(p.relative_to(folder)): (st.st_size, st.st_mtime_ns, st.st_ino)
        for p in sorted(folder.rglob("*"))
        for st in [p.lstat()]
    }


def _header_file(path: Path, header: Any, data: bytes = b"", raw: bytes | None = None) -> None:
    body = raw if raw is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)


def _with_shard(ws: Path, name: str, make: Any) -> str:
    """A copy of the tiny checkpoint whose weights are one model.safetensors made by ``make``."""
    ck = ws / name
    shutil.copytree(ws / "ck", ck)
    for f in ck.glob("model*.safetensors*"):
        f.unlink()
    make(ck / "model.safetensors")
    return str(ck)


def _edited(ws: Path, name: str, edit: Any) -> str:
    ck = ws / name
    shutil.copytree(ws / "ck", ck, symlinks=True)
    edit(ck)
    return str(ck)


def _config(ws: Path, name: str, text: bytes | str) -> str:
    p = ws / name
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(p)


def _cfg(**patch: Any) -> str:
    return json.dumps(HASH_CONFIG | patch)


def _index_edit(entry: str):
    def edit(ck: Path) -> None:
        idx = json.loads((ck / "model.safetensors.index.json").read_text())
        name = next(iter(idx["weight_map"]))
        idx["weight_map"][name] = entry
        (ck / "model.safetensors.index.json").write_text(json.dumps(idx))

    return edit


def _symlinked_shard(ws: Path):
    def edit(ck: Path) -> None:
        shard = next(ck.glob("model-*.safetensors"))
        outside = ws / "elsewhere.safetensors"
        shutil.move(shard, outside)
        shard.symlink_to(outside)

    return edit


def _tensor(off: int, n: int) -> dict:
    return {"dtype": "U8", "shape": [n], "data_offsets": [off, off + n]}


def _foreign(ws: Path) -> str:
    (ws / "foreign").mkdir()
    (ws / "foreign" / "model.onnx.data").write_bytes(b"theirs")
    return str(ws / "foreign")


def _sparse_big(path: Path) -> None:
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", 200_000_000))
        f.truncate(200_000_100)  # sparse: no disk used


# Each case: (id, argv with {placeholders}, needles that must appear in the one line).
# Placeholders are made by SETUP on first use.
SETUP = {
    "cfg": lambda ws: _config(ws, "hash.json", _cfg()),
    "cfg_utf8": lambda ws: _config(ws, "bad-utf8.json", b'{"engram_layer_ids": [0], "x": "\xff\xfe"}'),
    "cfg_nested": lambda ws: _config(ws, "nested.json", "[" * 100_000),
    "cfg_nested_obj": lambda ws: _config(ws, "nested2.json", '{"a": ' * 200 + "1" + "}" * 200),
    "cfg_n800": lambda ws: _config(ws, "n800.json", _cfg(engram_max_ngram_size=800)),
    "cfg_n5000": lambda ws: _config(ws, "n5000.json", _cfg(engram_max_ngram_size=5000)),
    "cfg_vocab_huge": lambda ws: _config(ws, "vocab.json", _cfg(engram_vocab_size=10**30)),
    "cfg_vocab_rows": lambda ws: _config(ws, "rows.json", _cfg(engram_vocab_size=2**30)),
    "cfg_heads": lambda ws: _config(ws, "heads.json", _cfg(engram_n_heads=10**6)),
    "cfg_layer_huge": lambda ws: _config(ws, "layer.json", _cfg(engram_layer_ids=[10**20])),
    "cfg_cvocab": lambda ws: _config(ws, "cvocab.json", _cfg(engram_compressed_vocab_size=2**40)),
    "cfg_dup": lambda ws: _config(ws, "dup.json", _cfg()[:-1] + ', "engram_n_heads": 4}'),
    "cfg_digits": lambda ws: _config(ws, "digits.json", _cfg()[:-1] + ', "engram_n_heads": ' + "9" * 5000 + "}"),
    "cfg_nan": lambda ws: _config(ws, "nan.json", _cfg()[:-1] + ', "rope_theta": NaN}'),
    "cfg_slots": lambda ws: _config(ws, "slots.json", _cfg(engram_layer_ids=list(range(20)), engram_n_heads=16)),
    "ck": lambda ws: str(ws / "ck"),
    "ck_cfg_utf8": lambda ws: _edited(
        ws,
        "ck-cfg-utf8",
        lambda ck: (ck / "config.json").write_bytes(
            (ck / "config.json").read_bytes().replace(b'"hidden_size"', b'"hidden\xc3\x28size"')
        ),
    ),
    "ck_hidden_huge": lambda ws: _edited(
        ws,
        "ck-hidden",
        lambda ck: (ck / "config.json").write_text(
            (ck / "config.json").read_text().replace('"hidden_size": 32', '"hidden_size": 100000000000')
        ),
    ),
    "ck_index_utf8": lambda ws: _edited(
        ws,
        "ck-index-utf8",
        lambda ck: (ck / "model.safetensors.index.json").write_bytes(
            b"\xff" + (ck / "model.safetensors.index.json").read_bytes()
        ),
    ),
    "ck_index_up": lambda ws: _edited(ws, "ck-index-up", _index_edit("../elsewhere.safetensors")),
    "ck_index_abs": lambda ws: _edited(ws, "ck-index-abs", _index_edit("/etc/passwd")),
    "ck_symlink": lambda ws: _edited(ws, "ck-symlink", _symlinked_shard(ws)),
    "ck_tok_cut": lambda ws: _edited(
        ws, "ck-tok", lambda ck: (ck / "tokenizer.json").write_bytes((ck / "tokenizer.json").read_bytes()[:200])
    ),
    "st_gap": lambda ws: _with_shard(
        ws, "st-gap", lambda p: _header_file(p, {"a": _tensor(0, 8), "b": _tensor(16, 8)}, bytes(24))
    ),
    "st_tail": lambda ws: _with_shard(ws, "st-tail", lambda p: _header_file(p, {"a": _tensor(0, 8)}, bytes(8 + 5))),
    "st_surrogate": lambda ws: _with_shard(
        ws,
        "st-sur",
        lambda p: _header_file(
            p, None, bytes(8), raw=b'{"\\ud800": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]}}'
        ),
    ),
    "st_overflow": lambda ws: _with_shard(
        ws, "st-ovf", lambda p: _header_file(p, {"a": {"dtype": "U8", "shape": [2**40, 2**40], "data_offsets": [0, 0]}})
    ),
    "st_bigheader": lambda ws: _with_shard(ws, "st-big", _sparse_big),
    "st_extra_key": lambda ws: _with_shard(
        ws, "st-key", lambda p: _header_file(p, {"a": dict(_tensor(0, 8), extra=[[[1]]])}, bytes(8))
    ),
    "st_utf16": lambda ws: _with_shard(
        ws, "st-u16", lambda p: _header_file(p, None, bytes(8), raw=json.dumps({"a": _tensor(0, 8)}).encode("utf-16"))
    ),
    "file": lambda ws: _config(ws, "plain-file.bin", b"x"),
    "foreign": lambda ws: _foreign(ws),
    "ec_utf8": lambda ws: _config(ws, "ec.json", b'{"cpu_offload": "\xff"}'),
    "under_file": lambda ws: str(ws / "plain-file.bin" / "sub"),
    "new_out": lambda ws: str(ws / "new-out"),
}

# fmt: off
CASES: list[tuple[str, list[str], tuple[str, ...]]] = [
    # -- layout
    ("layout-config-not-utf8", ["layout", "{cfg_utf8}"], ("bad-utf8.json", "not UTF-8", "save the file as UTF-8")),
    ("layout-config-nested-list", ["layout", "{cfg_nested}"], ("nested.json", "nested too deeply")),
    ("layout-config-nested-object", ["layout", "{cfg_nested_obj}"], ("nested2.json", "nested too deeply")),
    ("layout-ngram-800", ["layout", "{cfg_n800}"], ("engram_max_ngram_size", "at most 16")),
    ("layout-ngram-5000", ["layout", "{cfg_n5000}"], ("engram_max_ngram_size", "at most 16")),
    ("layout-vocab-1e30", ["layout", "{cfg_vocab_huge}"], ("engram_vocab_size", "at most")),
    ("layout-vocab-rows-past-int32", ["layout", "{cfg_vocab_rows}"], ("engram_vocab_size", "2^31-1", "lower")),
    ("layout-heads-1e6", ["layout", "{cfg_heads}"], ("engram_n_heads", "at most")),
    ("layout-layer-id-1e20", ["layout", "{cfg_layer_huge}"], ("engram_layer_ids", "at most")),
    ("layout-compressed-vocab-2^40", ["layout", "{cfg_cvocab}"], ("engram_compressed_vocab_size", "at most")),
    ("layout-slots-past-kernel", ["layout", "{cfg_slots}"], ("hash columns", "ENGRAM_HASH_MAX_SLOTS")),
    ("layout-duplicate-key", ["layout", "{cfg_dup}"], ("engram_n_heads", "appears twice")),
    ("layout-5000-digit-int", ["layout", "{cfg_digits}"], ("digits.json", "not valid JSON")),
    ("layout-nan", ["layout", "{cfg_nan}"], ("nan.json", "NaN")),
    ("layout-pad-id-huge", ["layout", "{cfg}", "--pad-id", "99999999999999999999"], ("--pad-id", "outside")),
    ("layout-a-folder-without-config", ["layout", "{new_out}"], ("no config file", "new-out")),
    # -- hash
    ("hash-id-past-int64", ["hash", "{cfg}", "--compressed", "--pad-id", "1", "--ids", "5,99999999999999999999"],
     ("--ids", "larger than any token id")),
    ("hash-id-arabic-digit", ["hash", "{cfg}", "--compressed", "--pad-id", "1", "--ids", "5,\u0663"],
     ("--ids", "is not an integer")),
    ("hash-id-underscore", ["hash", "{cfg}", "--compressed", "--pad-id", "1", "--ids", "1_000"],
     ("--ids", "'1_000' is not an integer")),
    ("hash-id-minus-5", ["hash", "{cfg}", "--compressed", "--pad-id", "1", "--ids", "3,-5"],
     ("--ids", "-5 is not a token id")),
    ("hash-id-undecodable-byte", ["hash", "{cfg}", "--compressed", "--pad-id", "1", "--ids", "3,\udcff"],
     ("--ids", "is not an integer")),
    ("hash-truncated-tokenizer", ["hash", "{ck_tok_cut}", "--ids", "1,2"],
     ("tokenizer.json", "not a readable tokenizer.json")),
    # -- inspect
    ("inspect-config-not-utf8", ["inspect", "{ck_cfg_utf8}"], ("config.json", "not UTF-8")),
    ("inspect-hidden-size-1e11", ["inspect", "{ck_hidden_huge}"], ("hidden_size", "at most")),
    ("inspect-index-not-utf8", ["inspect", "{ck_index_utf8}"], ("model.safetensors.index.json", "not UTF-8")),
    ("inspect-index-dotdot", ["inspect", "{ck_index_up}"],
     ("../elsewhere.safetensors", "outside the checkpoint folder")),
    ("inspect-index-absolute", ["inspect", "{ck_index_abs}"], ("/etc/passwd", "outside the checkpoint folder")),
    ("inspect-shard-symlink-out", ["inspect", "{ck_symlink}"],
     ("leads out of the checkpoint folder", "copy the file into the folder")),
    ("inspect-header-gap", ["inspect", "{st_gap}"], ("model.safetensors", "no gap or overlap", "re-copy")),
    ("inspect-header-trailing-bytes", ["inspect", "{st_tail}"], ("model.safetensors", "end with their last tensor")),
    ("inspect-header-lone-surrogate", ["inspect", "{st_surrogate}"], ("model.safetensors", "not valid UTF-8")),
    ("inspect-header-shape-overflow", ["inspect", "{st_overflow}"],
     ("model.safetensors", "more bytes than a file can hold")),
    ("inspect-header-over-100MB", ["inspect", "{st_bigheader}"],
     ("model.safetensors", "larger than safetensors allows")),
    ("inspect-header-extra-key", ["inspect", "{st_extra_key}"], ("model.safetensors", "malformed")),
    ("inspect-header-utf16", ["inspect", "{st_utf16}"], ("model.safetensors", "not UTF-8")),
    # (--verify-tables on a checkpoint is no longer refused: it scans every byte for NaN / Inf)
    ("inspect-a-file-not-a-folder", ["inspect", "{file}"], ("plain-file.bin", "is a file, not a checkpoint folder")),
    # -- run
    ("run-prompt-undecodable", ["run", "{ck}", "--prompt", "caf\udce9"], ("--prompt", "not UTF-8")),
    ("run-prompt-empty", ["run", "{ck}", "--prompt", ""], ("--prompt is empty",)),
    ("run-temperature-nan", ["run", "{ck}", "--temperature", "nan"], ("--temperature must be a number >= 0", "nan")),
    ("run-temperature-inf", ["run", "{ck}", "--temperature", "inf"], ("--temperature must be a number >= 0",)),
    ("run-temperature-1e400", ["run", "{ck}", "--temperature", "1e400"],
     ("--temperature must be a number >= 0", "inf")),
    ("run-temperature-1e5", ["run", "{ck}", "--temperature", "1e5"], ("--temperature", "at most")),
    ("run-temperature-negative", ["run", "{ck}", "--temperature", "-1"], ("--temperature must be a number >= 0",)),
    ("run-top-p-nan", ["run", "{ck}", "--top-p", "nan"], ("--top-p must be in (0, 1]",)),
    ("run-top-p-zero", ["run", "{ck}", "--top-p", "0"], ("--top-p must be in (0, 1]",)),
    ("run-top-p-minus-zero", ["run", "{ck}", "--top-p", "-0.0"], ("--top-p must be in (0, 1]",)),
    ("run-top-p-1e400", ["run", "{ck}", "--top-p", "1e400"], ("--top-p must be in (0, 1]",)),
    ("run-seed-2^64", ["run", "{ck}", "--seed", str(2**64)], ("argument --seed", "outside 0..")),
    ("run-seed-negative", ["run", "{ck}", "--seed", "-1"], ("argument --seed", "outside 0..")),
    ("run-max-new-tokens-1e12", ["run", "{ck}", "--max-new-tokens", "1000000000000"],
     ("argument --max-new-tokens", "outside")),
    ("run-max-new-tokens-zero", ["run", "{ck}", "--max-new-tokens", "0"], ("argument --max-new-tokens", "outside")),
    ("run-max-new-tokens-past-positions", ["run", "{ck}", "--max-new-tokens", "100000"], ("max_position_embeddings",)),
    ("run-device-meta", ["run", "{ck}", "--device", "meta"], ("--device: 'meta' is not a device", "cpu, cuda")),
    ("run-device-cuda-abc", ["run", "{ck}", "--device", "cuda:abc"], ("--device: 'cuda:abc'",)),
    ("run-device-space", ["run", "{ck}", "--device", " cpu"], ("--device: ' cpu'",)),
    ("run-device-cuda-here", ["run", "{ck}", "--device", "cuda"], ("--device cuda", "use --device cpu")),
    ("run-dtype-fp16", ["run", "{ck}", "--dtype", "fp16"], ("--dtype fp16", "fp32 or bf16")),
    ("run-dtype-int8", ["run", "{ck}", "--dtype", "int8"], ("argument --dtype", "not a dtype")),
    ("run-missing-folder", ["run", "{new_out}"], ("does not exist", "demo-checkpoint")),
    # -- build
    ("build-repack-tables-is-a-file", ["build", "{ck}", "-o", "{new_out}", "--repack-tables", "{file}"],
     ("--repack-tables", "is not a folder")),
    ("build-output-is-the-checkpoint", ["build", "{ck}", "-o", "{ck}"],
     ("inside the checkpoint folder", "choose a folder outside it")),
    ("build-output-inside-the-checkpoint", ["build", "{ck}", "-o", "{ck}/engine"], ("inside the checkpoint folder",)),
    ("build-output-foreign-folder", ["build", "{ck}", "-o", "{foreign}"], ("did not write", "--force")),
    ("build-output-is-a-file", ["build", "{ck}", "-o", "{file}"], ("is not a folder",)),
    ("build-output-under-a-file", ["build", "{ck}", "-o", "{under_file}"], ("is a file, not a folder",)),
    ("build-max-batch-1e20", ["build", "{ck}", "-o", "{new_out}", "--max-batch", "100000000000000000000"],
     ("argument --max-batch", "outside")),
    # A step may hold more tokens than one sequence (prefill chunks and decode tokens of
    # several sequences), so --max-num-tokens is bounded on its own.
    ("build-max-num-tokens-1e9", ["build", "{ck}", "-o", "{new_out}", "--max-num-tokens", "1000000000"],
     ("argument --max-num-tokens", "outside")),
    ("build-max-seq-len-over-positions", ["build", "{ck}", "-o", "{new_out}", "--max-seq-len", "4096"],
     ("max_position_embeddings=256",)),
    ("build-dtype-fp32", ["build", "{ck}", "-o", "{new_out}", "--dtype", "fp32"], ("--dtype fp32", "bf16 or fp16")),
    ("build-dtype-float64", ["build", "{ck}", "-o", "{new_out}", "--dtype", "float64"],
     ("argument --dtype", "bf16|bfloat16")),
    ("build-engram-config-not-utf8", ["build", "{ck}", "-o", "{new_out}", "--engram-config", "{ec_utf8}"],
     ("ec.json", "not UTF-8")),
    ("build-engram-config-nested", ["build", "{ck}", "-o", "{new_out}", "--engram-config", "[" * 50_000],
     ("--engram-config", "nested too deeply")),
    ("build-engram-config-dotted-nested", ["build", "{ck}", "-o", "{new_out}", "--engram-config.cpu_offload",
      "[" * 5000],
     ("--engram-config.cpu_offload", "nested too deeply")),
    ("build-engram-config-long-path", ["build", "{ck}", "-o", "{new_out}", "--engram-config", "x" * 5000],
     ("--engram-config", "neither a JSON object nor an existing file")),
    ("build-target-sm90", ["build", "{ck}", "-o", "{new_out}", "--target", "sm90"], ("sm90",)),
    ("build-plugin-lib-missing", ["build", "{ck}", "-o", "{new_out}", "--plugin-lib", "{new_out}/lib.so"],
     ("--plugin-lib", "is not a file")),
    # -- demo-checkpoint
    ("demo-checkpoint-into-a-checkpoint", ["demo-checkpoint", "{ck}"], ("is not empty", "--force")),
    ("demo-checkpoint-under-a-file", ["demo-checkpoint", "{under_file}"], ("is a file, not a folder",)),
    ("demo-checkpoint-seed-negative", ["demo-checkpoint", "{new_out}", "--seed", "-1"], ("argument --seed", "outside")),
    ("demo-checkpoint-seed-2^63", ["demo-checkpoint", "{new_out}", "--seed", str(2**63)],
     ("argument --seed", "outside")),
    # -- demo: sampling options checked before any checkpoint or engine is made
    ("demo-temperature-nan", ["demo", "--temperature", "nan"], ("--temperature must be a number >= 0",)),
    ("demo-top-p-2", ["demo", "--top-p", "2"], ("--top-p must be in (0, 1]",)),
    ("demo-device-meta", ["demo", "--device", "meta"], ("--device: 'meta'",)),
    ("demo-prompt-undecodable", ["demo", "--prompt", "\udcff"], ("--prompt", "not UTF-8")),
    ("demo-weights-seed-negative", ["demo", "--weights-seed", "-3"], ("argument --weights-seed", "outside")),
    ("demo-dtype-fp16", ["demo", "--dtype", "half"], ("--dtype fp16", "fp32 or bf16")),
    # -- the parser
    ("unknown-flag", ["layout", "{cfg}", "--bogus"], ("unrecognized arguments: --bogus",)),
    ("unknown-engram-config-field", ["build", "{ck}", "-o", "{new_out}", "--engram-config.cpu_ofload", "1"],
     ("unknown field 'cpu_ofload'", "cpu_offload")),
]
# fmt: on


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory, tiny_ckpt: Path) -> Path:
    ws = tmp_path_factory.mktemp("bad-inputs")
    shutil.copytree(tiny_ckpt, ws / "ck")
    return ws


def _fill(argv: list[str], ws: Path, made: dict[str, str]) -> list[str]:
    out = []
    for a in argv:
        for key in SETUP:
            token = "{" + key + "}"
            if token in a:
                if key not in made:
                    made[key] = SETUP[key](ws)
                a = a.replace(token, made[key])
        out.append(a)
    return out


_made: dict[str, str] = {}


def test_there_are_enough_cases() -> None:
    assert len(CASES) >= 40 and len({c[0] for c in CASES}) == len(CASES)
    assert {c[1][0] for c in CASES} >= {"layout", "hash", "inspect", "run", "build", "demo-checkpoint", "demo"}


@pytest.mark.parametrize("case_id, argv, needles", CASES, ids=[c[0] for c in CASES])
def test_bad_input(
    case_id: str,
    argv: list[str],
    needles: tuple[str, ...],
    workspace: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("ENGRAM_TRT_CACHE", str(cache))
    args = _fill(argv, workspace, _made)
    before = snapshot(workspace)
    try:
        code = main(args)
    except SystemExit as exc:  # argparse's own exit: still must be 2 and one line
        code = exc.code
    out, err = capsys.readouterr()
    assert code == 2, (case_id, code, err)
    assert err.startswith("engram-trt: error: ") and err.count("\n") == 1, (case_id, err)
    assert "Traceback" not in err and len(err) < 2500, (case_id, err)
    for needle in needles:
        assert needle in err, (case_id, needle, err)
    assert snapshot(workspace) == before, f"{case_id}: the workspace changed"
    assert not any(cache.iterdir()), f"{case_id}: the cache was written"
    assert not (workspace / "new-out").exists(), f"{case_id}: an output folder was created"


def _run_bytes(*argv: bytes | str, cache: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"), ENGRAM_TRT_CACHE=str(cache))
    return subprocess.run([sys.executable, "-m", "engram_trt", *argv], capture_output=True, env=env, timeout=300)


def test_undecodable_argv_bytes_through_a_real_process(workspace: Path, tmp_path: Path) -> None:
    """The same refusals from a real process, where the bytes come from the OS (Python
    hands them over as surrogate escapes): a prompt, --ids and a config path."""
    ck = str(workspace / "ck").encode()
    cfg = _fill(["{cfg}"], workspace, _made)[0].encode()
    odd = workspace / "conf\udcff.json"
    odd.write_text(_cfg(engram_max_ngram_size=99))
    cases = [
        ([b"run", ck, b"--prompt", b"caf\xe9 au lait"], b"--prompt: not UTF-8"),
        ([b"hash", cfg, b"--compressed", b"--pad-id", b"1", b"--ids", b"1,\xff"], b"is not an integer"),
        ([b"layout", os.fsencode(str(odd))], b"engram_max_ngram_size"),
    ]
    for argv, needle in cases:
        proc = _run_bytes(*argv, cache=tmp_path)
        assert proc.returncode == 2, proc.stderr
        assert needle in proc.stderr and proc.stderr.count(b"\n") == 1 and b"Traceback" not in proc.stderr, proc.stderr
    odd.unlink()


def test_the_guard_turns_any_error_into_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """What no check anticipated still ends in one line naming the subcommand and the
    error (exit 2); -vv logs the traceback for a developer."""
    from engram_trt.cli import mechanism

    cfg = tmp_path / "c.json"
    cfg.write_text(_cfg())

    def boom(args: Any) -> int:
        raise ZeroDivisionError("an unforeseen bug")

    import engram_trt.cli.main as cli_main

    monkeypatch.setattr(mechanism, "cmd_layout", boom)
    monkeypatch.setattr(cli_main, "cmd_layout", boom)
    assert main(["layout", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1
        and "layout failed unexpectedly (ZeroDivisionError: an unforeseen bug)" in err
        and "-vv" in err
    )
    caplog.clear()
    with caplog.at_level("DEBUG", logger="engram_trt"):
        assert main(["-vv", "layout", str(cfg)]) == 2
    assert any(r.exc_info and r.exc_info[0] is ZeroDivisionError for r in caplog.records)
    capsys.readouterr()
    for exc, needle in (
        (MemoryError(), "ran out of memory"),
        (RecursionError(), "nested too deeply"),
        (OSError(28, "No space left on device", "/data/x"), "/data/x: No space left on device (the disk is full"),
    ):

        def raise_it(args: Any, exc: BaseException = exc) -> int:
            raise exc

        monkeypatch.setattr(cli_main, "cmd_layout", raise_it)
        assert main(["layout", str(cfg)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and needle in err, err


def test_unusual_but_valid_values_work(
    capsys: pytest.CaptureFixture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """-0.0 and subnormal temperatures are greedy; dtype spellings are one vocabulary."""
    import argparse

    from engram_trt.cli.argtypes import check_generation_args
    from engram_trt.config.dtypes import normalize_dtype

    for t in (-0.0, 5e-324, 1e-6):
        ns = argparse.Namespace(
            max_new_tokens=1, temperature=t, top_p=1.0, seed=0, prompt="x", device="cpu", dtype="bfloat16"
        )
        check_generation_args(ns)
        assert ns.temperature == 0.0 and str(ns.temperature) == "0.0" and ns.dtype == "bf16"
    assert [
        normalize_dtype(s) for s in ("BF16", "bfloat16", "fp16", "Float16", "half", "fp32", "float32", "float")
    ] == ["bf16", "bf16", "fp16", "fp16", "fp16", "fp32", "fp32", "fp32"]
