"""Damage is noticed: table bytes changed after a build (full and sampled checks), files
cut short, a damaged demo cache (config, tokenizer, tables, shards)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers.checkpoints import make_tiny_checkpoint
from helpers.files import file_sha256
from engram_trt.builder.build import build
from engram_trt.builder.manifest import manifest_table_refs, read_manifest, verify_tables
from engram_trt.cli.main import main
from engram_trt.errors import EngramError
from engram_trt.tables import source
from engram_trt.tables.source import TableRef, check_table_files, sampled_check, verify_table_hashes

BLOCK = 4096


@pytest.fixture
def built(tmp_path: Path) -> tuple[Path, Path]:
    """(checkpoint, engine folder) with 4 KiB hash blocks, so the tiny table has ~100 of them."""
    ck = make_tiny_checkpoint(tmp_path / "ck")
    eng = tmp_path / "eng"
    build(ck, eng, build_engine_if_possible=False, progress=False, table_block_bytes=BLOCK)
    return ck, eng


def _rows_ref(eng: Path) -> TableRef:
    refs = manifest_table_refs(read_manifest(eng), eng)
    return next(r for r in refs if r.role == "rows")


def _damage(ref: TableRef, block: int, nbytes: int = 100) -> None:
    """Overwrite ``nbytes`` bytes inside one block of a table, in place."""
    with open(ref.file, "r+b") as f:
        f.seek(ref.offset + block * BLOCK + 17)
        old = f.read(nbytes)
        f.seek(ref.offset + block * BLOCK + 17)
        f.write(bytes(b ^ 0xFF for b in old))


def test_manifest_records_block_hashes(built: tuple[Path, Path]) -> None:
    _, eng = built
    m = json.loads((eng / "manifest.json").read_text())
    for t in m["tables"]:
        assert t["block_bytes"] == BLOCK and len(t["block_hashes"]) == -(-t["nbytes"] // BLOCK)
        for i, h in enumerate(t["block_hashes"]):  # each against the tests' own hashing
            n = min(BLOCK, t["nbytes"] - i * BLOCK)
            assert h == file_sha256(t["file"], t["offset"] + i * BLOCK, n)
        assert t["sha256"] == file_sha256(t["file"], t["offset"], t["nbytes"])
        assert TableRef.from_json(t).to_json() == t  # round trip
    bad = dict(m["tables"][0], block_hashes=m["tables"][0]["block_hashes"][:-1])
    with pytest.raises(EngramError, match="block hashes do not cover"):
        TableRef.from_json(bad)
    with pytest.raises(EngramError, match="malformed"):
        TableRef.from_json(dict(m["tables"][0], block_hashes=["zz"] * len(m["tables"][0]["block_hashes"])))


def test_damaged_table_found_by_full_and_sampled_checks(
    built: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    _, eng = built
    ref = _rows_ref(eng)
    refs = manifest_table_refs(read_manifest(eng), eng)
    assert verify_table_hashes(refs) == [] and sampled_check(refs, 1 << 30) == []
    n_blocks = len(ref.block_hashes)
    victim = n_blocks // 2
    _damage(ref, victim)
    # The full check finds it, and so does inspect --verify-tables (exit 1, listed).
    (problem,) = verify_table_hashes(refs)
    assert ref.tensor in problem and "sha256 differs" in problem
    assert verify_tables(read_manifest(eng)) == [problem]
    assert main(["inspect", str(eng), "--verify-tables", "--json"]) == 1
    rep = json.loads(capsys.readouterr().out)
    assert rep["table_check"] == "full" and rep["problems"] == [problem]
    # The sampled check finds it exactly when it draws the damaged block: over many
    # draws of 8 blocks, every draw that includes the victim reports it, no other does.
    reads: list[tuple[int, int]] = []
    real = source.sha256_file_region
    monkeypatch.setattr(
        source, "sha256_file_region", lambda f, off, n, p=None: reads.append((off, n)) or real(f, off, n)
    )
    found = missed = 0
    for seed in range(40):
        reads.clear()
        problems = sampled_check([ref], 8 * BLOCK, seed=seed)
        drawn = {(off - ref.offset) // BLOCK for off, _ in reads}
        assert sum(n for _, n in reads) <= 8 * BLOCK and len(drawn) == 8  # the budget holds
        if victim in drawn:
            assert len(problems) == 1 and f"sampled block {victim} of {n_blocks}" in problems[0]
            found += 1
        else:
            assert problems == []
            missed += 1
    assert found and missed  # 8 of ~100 blocks: both happen in 40 draws
    monkeypatch.undo()
    # The default (inspect without flags) samples 256 MiB, more than this table: found.
    assert main(["inspect", str(eng), "--json"]) == 1
    rep = json.loads(capsys.readouterr().out)
    assert rep["table_check"] == "sampled" and len(rep["problems"]) == 1 and ref.tensor in rep["problems"][0]


def test_short_or_missing_table_file_is_found_at_load(
    built: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    ck, eng = built
    refs = manifest_table_refs(read_manifest(eng), eng)
    shard = refs[0].file
    keep = tmp_path / "keep.safetensors"
    shutil.copyfile(shard, keep)
    with open(shard, "r+b") as f:
        f.truncate(refs[0].offset + refs[0].nbytes // 2)
    with pytest.raises(EngramError, match="fewer than the table's end") as err:
        check_table_files(refs)
    assert "\n" not in str(err.value) and "rebuild the engine folder" in str(err.value)
    assert main(["inspect", str(eng), "--json"]) == 1
    assert any("fewer than the table's end" in p for p in json.loads(capsys.readouterr().out)["problems"])
    shard.unlink()
    assert main(["inspect", str(eng), "--json"]) == 1
    assert any("is missing" in p for p in json.loads(capsys.readouterr().out)["problems"])
    # And the checkpoint itself: a truncated shard is refused when it is opened.
    shutil.copyfile(keep, shard)
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 10)
    assert main(["inspect", str(ck)]) == 2
    assert "truncated" in capsys.readouterr().err


def test_damaged_manifest_is_one_line(built: tuple[Path, Path], capsys: pytest.CaptureFixture) -> None:
    _, eng = built
    text = (eng / "manifest.json").read_text()
    for damaged, needle in (
        (text[: len(text) // 2], "not valid JSON"),
        ("\xff\xfe" + text, "not valid JSON"),
        (text.replace('"manifest_version": 1', '"manifest_version": 7'), "manifest version 7"),
    ):
        (eng / "manifest.json").write_text(damaged, encoding="utf-8", errors="surrogateescape")
        assert main(["inspect", str(eng)]) == 2
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1 and "Traceback" not in err


# ---------------------------------------------------------------- the demo's cache
def _fake_demo(folder: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A tiny checkpoint stamped as a demo, its table shard hashed in 4 KiB blocks (so it
    takes the sampled path, as the demo's 1.2 GB shards do)."""
    from engram_trt.models.engram_llama import demo
    from engram_trt.engram.tokenizer import default_tokenizer_json

    monkeypatch.setattr(demo, "STAMP_BLOCK_BYTES", BLOCK)
    monkeypatch.setattr(demo, "STAMP_SAMPLE_BYTES", 1 << 30)  # sample everything: deterministic here
    ck = make_tiny_checkpoint(folder)
    stamp = demo._stamp(demo.DEMO_CONFIG, 0, default_tokenizer_json()) | {"files": demo._file_hashes(ck)}
    (ck / demo.STAMP_NAME).write_text(json.dumps(stamp))
    assert demo.demo_checkpoint_problem(ck, 0) is None
    return ck


@pytest.mark.parametrize(
    "damage, needle",
    [
        ("config", "config.json changed since it was written"),
        ("tokenizer", "tokenizer.json holds"),
        ("table", "sampled block"),
        ("shard", "is missing"),
        ("stamp", "stamp is unreadable"),
    ],
)
def test_damaged_demo_cache_is_noticed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str, needle: str
) -> None:
    from engram_trt.models.engram_llama import demo

    ck = _fake_demo(tmp_path / "demo", monkeypatch)
    shard = next(ck.glob("model-*.safetensors"))
    if damage == "config":  # an edit that keeps the JSON valid and the size the same
        text = (ck / "config.json").read_text()
        (ck / "config.json").write_text(text.replace('"hidden_size": 32', '"hidden_size": 64'))
    elif damage == "tokenizer":
        data = (ck / "tokenizer.json").read_bytes()
        (ck / "tokenizer.json").write_bytes(data[: len(data) // 3])
    elif damage == "table":
        with open(shard, "r+b") as f:
            f.seek(shard.stat().st_size - 3 * BLOCK)
            f.write(b"\x00" * 64)
    elif damage == "shard":
        shard.unlink()
    else:
        (ck / demo.STAMP_NAME).write_text('{"files": ')
    problem = demo.demo_checkpoint_problem(ck, 0)
    assert problem is not None and problem[1] is True, problem  # damage, not staleness: warned about
    assert needle in problem[0], problem
