"""Checkpoint folders: round trip, lazy metadata, row reads, refusals, the demo."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers.files import file_sha256
from engram_trt.checkpoint.checkpoint import (
    INDEX_NAME,
    Checkpoint,
    engram_tensor_names,
    write_checkpoint,
)
from engram_trt.config.model import ModelConfig
from engram_trt.models.engram_llama.checks import validate_checkpoint
from engram_trt.models.engram_llama.demo import (
    DEMO_CONFIG,
    DEMO_TABLE_CHUNK_ROWS,
    STAMP_NAME,
    demo_checkpoint_dir,
    ensure_demo_checkpoint,
    demo_fp8_table,
    demo_fp8_table_chunk,
    make_demo_checkpoint,
    random_weights,
)
from engram_trt.errors import CheckpointError, EngramError
from engram_trt.engram.layout import EngramLayout
from engram_trt.engram.quant import dequant_fp8_rows, quantize_fp8_rows

from helpers.checkpoints import SMALL_TABLES_CONFIG


def small_layout(cfg: dict | None = None) -> EngramLayout:
    spec = ModelConfig.from_dict(cfg or SMALL_TABLES_CONFIG).engram
    assert spec is not None
    return EngramLayout.from_spec(spec, pad_id=1)


def small_tensors(seed: int = 0, extra_rows: int = 5) -> dict[str, torch.Tensor]:
    config = ModelConfig.from_dict(SMALL_TABLES_CONFIG)
    gen = torch.Generator().manual_seed(seed)
    rows = [int(r) + extra_rows for r in small_layout().table_rows]
    return random_weights(config, gen, table_rows=rows)


@pytest.fixture()
def small_ckpt(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    tensors = small_tensors()
    # A small shard limit forces several shards, so the index is exercised.
    write_checkpoint(tmp_path / "ck", SMALL_TABLES_CONFIG, tensors, None, max_shard_bytes=8 * 1024)
    return tmp_path / "ck", tensors


def test_round_trip_sharded(small_ckpt: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, tensors = small_ckpt
    shards = sorted(p.name for p in path.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2
    index = json.loads((path / INDEX_NAME).read_text())
    assert set(index["weight_map"]) == set(tensors)
    assert set(index["weight_map"].values()) == set(shards)
    ck = Checkpoint.open(path)
    assert set(ck.tensor_names()) == set(tensors)
    assert ck.config.hidden_size == 32 and ck.config.engram is not None
    for name, t in tensors.items():
        assert ck.shape(name) == tuple(t.shape)
        assert ck.dtype(name) == t.dtype
        got = ck.get(name)
        assert got.dtype == t.dtype
        assert torch.equal(got.view(torch.uint8), t.view(torch.uint8))
    table = engram_tensor_names(0)["table"]
    scale = engram_tensor_names(0)["scale"]
    assert ck.st_dtype(table) == "F8_E4M3"
    assert ck.st_dtype(scale) == "F8_E8M0"
    assert validate_checkpoint(ck) == []


def test_metadata_is_lazy(small_ckpt: tuple[Path, dict[str, torch.Tensor]]) -> None:
    """shape/dtype/locate must come from headers: no tensor data may be loaded."""
    path, tensors = small_ckpt
    ck = Checkpoint.open(path)
    loads: list[str] = []

    class Spy:
        def __init__(self, inner: object) -> None:
            self.inner = inner

        def get_tensor(self, name: str) -> torch.Tensor:
            loads.append(name)
            return self.inner.get_tensor(name)  # type: ignore[attr-defined]

        def get_slice(self, name: str) -> object:
            return self.inner.get_slice(name)  # type: ignore[attr-defined]

    real_handle = ck._handle
    ck._handle = lambda f: Spy(real_handle(f))  # type: ignore[method-assign]
    for name in tensors:
        ck.shape(name)
        ck.dtype(name)
        ck.locate(name)
    assert validate_checkpoint(ck) == []
    assert loads == []
    ck.get("model.norm.weight")
    assert loads == ["model.norm.weight"]


def test_get_rows_equals_slicing(small_ckpt: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, tensors = small_ckpt
    ck = Checkpoint.open(path)
    names = engram_tensor_names(2)
    ids = torch.tensor([[0, 7, 3], [int(tensors[names["table"]].shape[0]) - 1, 7, 0]])
    for key in ("table", "scale"):
        full = tensors[names[key]]
        rows = ck.get_rows(names[key], ids)
        assert rows.dtype == full.dtype and rows.shape == (2, 3, full.shape[1])
        assert torch.equal(rows.view(torch.uint8), full.view(torch.uint8)[ids])
    # a bf16 2-D tensor and a plain list of ids
    name = "model.layers.1.mlp.up_proj.weight"
    assert torch.equal(ck.get_rows(name, [5, 1]), tensors[name][[5, 1]])
    with pytest.raises(EngramError, match="outside tensor"):
        ck.get_rows(names["table"], [10**6])


def test_locate_gives_the_tensor_bytes(small_ckpt: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, tensors = small_ckpt
    ck = Checkpoint.open(path)
    for name in (
        engram_tensor_names(0)["table"],
        engram_tensor_names(0)["scale"],
        "model.embed_tokens.weight",
        "lm_head.weight",
    ):
        file, offset, nbytes = ck.locate(name)
        t = tensors[name]
        assert nbytes == t.numel() * t.element_size()
        mm = np.memmap(file, dtype=np.uint8, mode="r", offset=offset, shape=(nbytes,))
        expect = t.contiguous().view(torch.uint8).reshape(-1).numpy()
        assert np.array_equal(np.asarray(mm), expect)
        del mm


def test_write_is_deterministic(tmp_path: Path) -> None:
    a = write_checkpoint(tmp_path / "a", SMALL_TABLES_CONFIG, small_tensors(), None, max_shard_bytes=8 * 1024)
    b = write_checkpoint(tmp_path / "b", SMALL_TABLES_CONFIG, small_tensors(), None, max_shard_bytes=8 * 1024)
    files_a = sorted(p.name for p in a.iterdir())
    assert files_a == sorted(p.name for p in b.iterdir())
    for f in files_a:
        assert file_sha256(a / f) == file_sha256(b / f), f


def test_rewrite_removes_stale_shards(tmp_path: Path) -> None:
    out = tmp_path / "ck"
    write_checkpoint(out, SMALL_TABLES_CONFIG, small_tensors(), None, max_shard_bytes=8 * 1024)
    before = {p.name: file_sha256(p) for p in out.iterdir()}
    # Without overwrite=True an existing checkpoint is never written into.
    with pytest.raises(CheckpointError, match="already holds a checkpoint"):
        write_checkpoint(out, SMALL_TABLES_CONFIG, small_tensors(seed=1), None, max_shard_bytes=10**9)
    assert {p.name: file_sha256(p) for p in out.iterdir()} == before
    write_checkpoint(out, SMALL_TABLES_CONFIG, small_tensors(), None, max_shard_bytes=10**9, overwrite=True)
    assert [p.name for p in out.glob("*.safetensors")] == ["model-00001-of-00001.safetensors"]
    Checkpoint.open(out)


def test_missing_shard_names_the_file(small_ckpt: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, _ = small_ckpt
    victim = sorted(path.glob("model-*-of-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(EngramError, match=victim.name) as err:
        Checkpoint.open(path)
    assert "\n" not in str(err.value)


def test_missing_config_and_missing_folder(small_ckpt: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    path, _ = small_ckpt
    (path / "config.json").unlink()
    with pytest.raises(EngramError, match="config.json"):
        Checkpoint.open(path)
    with pytest.raises(EngramError, match="does not exist"):
        Checkpoint.open(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(SMALL_TABLES_CONFIG))
    with pytest.raises(EngramError, match="no weights"):
        Checkpoint.open(empty)


def test_index_naming_absent_tensor(small_ckpt: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, _ = small_ckpt
    index = json.loads((path / INDEX_NAME).read_text())
    index["weight_map"]["model.layers.9.ghost"] = next(iter(index["weight_map"].values()))
    (path / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(EngramError, match="model.layers.9.ghost"):
        Checkpoint.open(path)


def test_tables_not_covering_layout_are_reported(tmp_path: Path) -> None:
    layout = small_layout()
    tensors = small_tensors(extra_rows=0)
    names = engram_tensor_names(2)
    need = int(layout.table_rows[1])
    short = need - 3
    q, s = quantize_fp8_rows(torch.randn(short, 64, generator=torch.Generator().manual_seed(1)))
    tensors[names["table"]] = q.view(torch.float8_e4m3fn)
    tensors[names["scale"]] = s.view(torch.float8_e8m0fnu)
    write_checkpoint(tmp_path / "ck", SMALL_TABLES_CONFIG, tensors, None)
    problems = validate_checkpoint(Checkpoint.open(tmp_path / "ck"), layout)
    assert len(problems) == 1, problems
    assert names["table"] in problems[0]
    assert f"has {short} rows but the layout needs at least {need}" in problems[0]
    assert "does not cover engram_num_embeddings/primes" in problems[0]


def test_shape_problems_are_reported(tmp_path: Path) -> None:
    tensors = small_tensors()
    n0, n2 = engram_tensor_names(0), engram_tensor_names(2)
    rows = tensors[n0["scale"]].shape[0]
    tensors[n0["scale"]] = tensors[n0["scale"]][: rows - 1].clone()
    tensors[n0["wkv"]] = tensors[n0["wkv"]][:, :-8].clone()
    tensors[n2["q_weight"]] = tensors[n2["q_weight"]][:1].clone()
    del tensors[n2["k_weight"]]
    q, s = quantize_fp8_rows(torch.randn(tensors[n2["table"]].shape[0], 32))
    tensors[n2["table"]] = q.view(torch.float8_e4m3fn)  # head_dim 32, config says 64
    del tensors["model.layers.1.mlp.down_proj.weight"]
    write_checkpoint(tmp_path / "ck", SMALL_TABLES_CONFIG, tensors, None)
    problems = validate_checkpoint(Checkpoint.open(tmp_path / "ck"))
    text = "\n".join(problems)
    assert f"scale {n0['scale']} has shape [{rows - 1}, 2]" in text
    assert f"tensor {n0['wkv']} has shape" in text and "[96, 256]" in text
    assert f"tensor {n2['q_weight']} has shape [1, 32] but needs [hc_mult, hidden] = [2, 32]" in text
    assert f"tensor {n2['k_weight']} is missing" in text
    assert f"table {n2['table']} has rows of width 32 but engram_head_dim=64" in text
    assert "tensor model.layers.1.mlp.down_proj.weight is missing" in text
    assert len(problems) == 7, problems  # the width-32 table also mismatches its [rows, 2] scale


def test_backbone_weights_must_be_floats(tmp_path: Path) -> None:
    """A backbone weight stored as integers (a quantized checkpoint) is listed, not cast."""
    tensors = small_tensors()
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = torch.zeros(tensors[name].shape, dtype=torch.int8)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.bfloat16)  # a float dtype reads
    write_checkpoint(tmp_path / "ck", SMALL_TABLES_CONFIG, tensors, None)
    problems = validate_checkpoint(Checkpoint.open(tmp_path / "ck"))
    assert problems == [
        f"tensor {name} is I8, not a float weight (expected one of F32, BF16, F16, F64); "
        f"dequantize the checkpoint first"
    ]


def test_demo_config_matches_layout() -> None:
    config = ModelConfig.from_dict(DEMO_CONFIG)
    spec = config.engram
    assert spec is not None
    layout = EngramLayout.from_spec(spec, pad_id=1)
    assert list(spec.num_embeddings or ()) == layout.table_rows.tolist()
    assert layout.n_hash_cols == (spec.max_ngram_size - 1) * spec.n_heads == 4
    assert len(spec.layer_ids) == 2 and spec.table_dtype == "fp8"
    assert all(2e5 < r < 1e6 for r in layout.table_rows)  # "a few hundred thousand rows"


def test_demo_checkpoint_is_deterministic(tmp_path: Path, demo_dir: Path) -> None:
    """A fresh seed-0 demo is byte-identical to the suite's (seed 0, made earlier in
    this process, or by another); seed 1 draws other weights and other tables."""
    a = make_demo_checkpoint(tmp_path / "a", seed=0)
    shards = sorted(p.name for p in a.glob("*.safetensors"))
    assert len(shards) > 1
    assert shards == sorted(p.name for p in demo_dir.glob("*.safetensors"))
    for f in shards + [INDEX_NAME, "config.json", "tokenizer.json", STAMP_NAME]:
        assert file_sha256(a / f) == file_sha256(demo_dir / f), f
    ca = Checkpoint.open(a)
    assert validate_checkpoint(ca) == []
    assert json.loads((a / STAMP_NAME).read_text())["seed"] == 0
    spec = ca.config.engram
    assert spec is not None and spec.head_dim is not None
    # Each table chunk is its own stream: re-derive two (the first and the ragged
    # last) and find them in the written table; seed 1 gives other bytes.
    step = DEMO_TABLE_CHUNK_ROWS
    for li, lid in enumerate(spec.layer_ids):
        names = engram_tensor_names(lid)
        table, scale = ca.get(names["table"]).view(torch.uint8), ca.get(names["scale"]).view(torch.uint8)
        rows = table.shape[0]
        last = (rows - 1) // step
        for chunk in (0, last):
            n = min(step, rows - chunk * step)
            q, s = demo_fp8_table_chunk(0, li, chunk, n, spec.head_dim, spec.quant_block)
            assert np.array_equal(table[chunk * step : chunk * step + n].numpy(), q)
            assert np.array_equal(scale[chunk * step : chunk * step + n].numpy(), s)
            q1, s1 = demo_fp8_table_chunk(1, li, chunk, n, spec.head_dim, spec.quant_block)
            assert (q1 != q).mean() > 0.9 and (s1 != s).mean() > 0.5
    # Rows decode to O(1) values with all three block scales in use, no NaN.
    q, s = demo_fp8_table_chunk(0, 0, 0, 256, spec.head_dim, spec.quant_block)
    rows = dequant_fp8_rows(q, s)
    assert np.isfinite(rows).all() and 1.0 < rows.std() < 1.6 and abs(rows.mean()) < 0.02
    assert sorted(np.unique(s).tolist()) == [119, 120, 121]
    # The backbone of seed 1 differs too.
    w0 = random_weights(ca.config, torch.Generator().manual_seed(0), tables=False)
    w1 = random_weights(ca.config, torch.Generator().manual_seed(1), tables=False)
    assert torch.equal(w0["model.embed_tokens.weight"], ca.get("model.embed_tokens.weight"))
    assert not torch.equal(w0["model.embed_tokens.weight"], w1["model.embed_tokens.weight"])


def test_demo_table_bytes_do_not_depend_on_threads() -> None:
    """Chunks are keyed streams: any thread count, and any chunk drawn alone, give the
    same table (three chunks here, the last one ragged)."""
    rows = 2 * DEMO_TABLE_CHUNK_ROWS + 123
    q1, s1 = demo_fp8_table(7, 1, rows, 64, threads=1)
    q3, s3 = demo_fp8_table(7, 1, rows, 64, threads=3)
    assert torch.equal(q1.view(torch.uint8), q3.view(torch.uint8)) and torch.equal(
        s1.view(torch.uint8), s3.view(torch.uint8)
    )
    q, s = demo_fp8_table_chunk(7, 1, 2, 123, 64)
    assert np.array_equal(q1.view(torch.uint8)[-123:].numpy(), q) and np.array_equal(
        s1.view(torch.uint8)[-123:].numpy(), s
    )
    assert not np.array_equal(demo_fp8_table_chunk(7, 0, 2, 123, 64)[0], q)  # layers draw apart


def test_ensure_demo_checkpoint_reuses_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, demo_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import os
    import shutil

    monkeypatch.setenv("ENGRAM_TRT_CACHE", str(tmp_path / "cache"))
    target = demo_checkpoint_dir()
    assert target == tmp_path / "cache" / "demo-checkpoint"
    # A cache holding a good demo (hard links to the suite's: no second 2.4 GiB) is
    # reused as it is.
    shutil.copytree(demo_dir, target, copy_function=os.link)
    stamp_mtime = (target / STAMP_NAME).stat().st_mtime_ns
    shard = sorted(target.glob("*.safetensors"))[0]
    shard_mtime = shard.stat().st_mtime_ns
    assert ensure_demo_checkpoint() == target
    assert (target / STAMP_NAME).stat().st_mtime_ns == stamp_mtime
    assert shard.stat().st_mtime_ns == shard_mtime
    # A damaged cache (a missing shard, and a truncated tokenizer.json, which made every
    # later demo fail) is remade with a warning rather than trusted; the remade one is
    # byte-identical, and the suite's own copy is untouched. (Each kind of damage alone
    # is found by tests/checkpoint/test_damage.py; this is the one full remake.)
    shard.unlink()
    tok_bytes = (target / "tokenizer.json").read_bytes()
    (target / "tokenizer.json").unlink()  # break the hard link before writing
    (target / "tokenizer.json").write_bytes(tok_bytes[:1000])
    with caplog.at_level(logging.WARNING, logger="engram_trt"):
        assert ensure_demo_checkpoint() == target
    assert any(
        "is damaged" in r.getMessage() and shard.name in r.getMessage() and "rebuilding" in r.getMessage()
        for r in caplog.records
    ), [r.getMessage() for r in caplog.records]
    Checkpoint.open(target)
    for name in (shard.name, "tokenizer.json", "config.json"):
        assert file_sha256(target / name) == file_sha256(demo_dir / name), name
    assert not [p for p in target.parent.iterdir() if p.name.startswith(".demo-checkpoint.")]  # no lock file either
    assert (demo_dir / shard.name).is_file() and (demo_dir / "tokenizer.json").read_bytes() == tok_bytes
    # A stamp for another generator version is not trusted either.
    stamp = json.loads((target / STAMP_NAME).read_text())
    (target / STAMP_NAME).write_text(json.dumps(dict(stamp, generator_version=stamp["generator_version"] - 1)))
    ensure_demo_checkpoint()
    assert json.loads((target / STAMP_NAME).read_text()) == stamp


def test_damaged_header_entries_are_refused(tmp_path: Path) -> None:
    """A header whose shape disagrees with its byte span, or that lacks offsets, is
    refused with the file and tensor named (never a library traceback)."""
    import struct

    from engram_trt.checkpoint.checkpoint import _tensor_infos

    def write(path: Path, header: dict) -> Path:
        body = json.dumps(header).encode()
        path.write_bytes(struct.pack("<Q", len(body)) + body + bytes(64))
        return path

    ok = write(tmp_path / "ok.safetensors", {"t": {"dtype": "U8", "shape": [4, 16], "data_offsets": [0, 64]}})
    assert _tensor_infos(ok)["t"].nbytes == 64
    bad_span = write(tmp_path / "span.safetensors", {"t": {"dtype": "U8", "shape": [4, 32], "data_offsets": [0, 64]}})
    with pytest.raises(CheckpointError, match="declares shape"):
        _tensor_infos(bad_span)
    no_offsets = write(tmp_path / "nooff.safetensors", {"t": {"dtype": "U8", "shape": [4, 16]}})
    with pytest.raises(CheckpointError, match="malformed"):
        _tensor_infos(no_offsets)
