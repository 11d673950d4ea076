"""engram-trt build: engine folder, manifest (every table, deterministic), engines with
the four plugins and no table bytes, both TensorRT flavours through one code path."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers.files import REPO, file_sha256
from engram_trt.native import trt_compat
from engram_trt.builder.build import build
from engram_trt.checkpoint.checkpoint import Checkpoint, engram_tensor_names, write_checkpoint
from engram_trt.config.model import ModelConfig
from engram_trt.models.engram_llama.demo import random_weights
from engram_trt.errors import EngramError
from engram_trt.engram.layout import EngramLayout
from engram_trt.engram.tokenizer import build_compressed_vocab

RTX = trt_compat.module_available("tensorrt_rtx_bindings") or trt_compat.module_available("tensorrt_rtx")
needs_rtx = pytest.mark.skipif(not RTX, reason="TensorRT-RTX is not installed")


def test_graph_only_build_manifest(demo_dir: Path, tmp_path: Path) -> None:
    a = build(demo_dir, tmp_path / "a", build_engine_if_possible=False, progress=False)
    b = build(demo_dir, tmp_path / "b", build_engine_if_possible=False, progress=False)
    assert a.engine_path is None and a.engine_skipped
    ma, mb = (r.manifest_path.read_bytes() for r in (a, b))
    assert ma == mb, "rebuilding with the same inputs must give the same manifest"
    m = json.loads(ma)
    ckpt = Checkpoint.open(demo_dir)
    spec = ckpt.config.engram
    want = sorted(n for lid in spec.layer_ids for k, n in engram_tensor_names(lid).items() if k in ("table", "scale"))
    assert sorted(t["tensor"] for t in m["tables"]) == want
    for t in m["tables"]:
        f, off, nb = ckpt.locate(t["tensor"])
        assert (t["file"], t["offset"], t["nbytes"]) == (str(f.resolve()), off, nb)
        assert t["sha256"] == file_sha256(t["file"], t["offset"], t["nbytes"])
    assert m["tables_bytes"] == sum(t["nbytes"] for t in m["tables"])
    assert m["layout"]["table_rows"] == EngramLayout.from_spec(spec, 0).table_rows.tolist()
    vocab = build_compressed_vocab(ckpt.tokenizer_json)
    assert np.array_equal(np.load(a.output_dir / "compressed_vocab.npy"), vocab.lookup)
    assert (a.output_dir / "model.onnx").read_bytes() == (b.output_dir / "model.onnx").read_bytes()
    report = json.loads((a.output_dir / "build_report.json").read_text())
    assert report["tables_bytes"] == m["tables_bytes"] and "build_seconds" in report


def test_engram_options_fail_before_work(tmp_path: Path, demo_dir: Path) -> None:
    cfg = {k: v for k, v in json.loads((demo_dir / "config.json").read_text()).items() if not k.startswith("engram")}
    plain = ModelConfig.from_dict(cfg)
    write_checkpoint(
        tmp_path / "plain", cfg, random_weights(plain, torch.Generator().manual_seed(0)), None, max_shard_bytes=1 << 30
    )
    out = tmp_path / "out"
    with pytest.raises(EngramError, match="no Engram layers"):
        build(tmp_path / "plain", out, '{"cpu_offload": false}', progress=False)
    assert not out.exists()
    with pytest.raises(EngramError, match="unknown field"):
        build(demo_dir, out, '{"cpu_offlaod": false}', progress=False)
    assert not out.exists()


def test_repack_bf16_tables_to_fp8(tmp_path: Path, demo_dir: Path) -> None:
    cfg = json.loads((demo_dir / "config.json").read_text())
    cfg.update(
        vocab_size=129280,
        hidden_size=32,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_hidden_layers=2,
        engram_layer_ids=[1],
        engram_num_embeddings=None,
        engram_table_dtype="bf16",
        engram_n_heads=4,
        engram_head_dim=64,
        engram_vocab_size=40000,
    )
    mc = ModelConfig.from_dict(cfg)
    rows = [int(r) for r in EngramLayout.from_spec(mc.engram, 0).table_rows]
    w = random_weights(mc, torch.Generator().manual_seed(0), table_rows=rows)
    write_checkpoint(tmp_path / "ck", cfg, w, demo_dir / "tokenizer.json", max_shard_bytes=1 << 30)
    r = build(
        tmp_path / "ck",
        tmp_path / "eng",
        repack_tables_dir=tmp_path / "packed",
        build_engine_if_possible=False,
        progress=False,
    )
    m = json.loads(r.manifest_path.read_text())
    assert m["table_dtype"] == "fp8" and m["repacked"] is True
    assert {t["role"] for t in m["tables"]} == {"rows", "scales"}
    assert all(Path(t["file"]).parent == (tmp_path / "packed").resolve() for t in m["tables"])
    from safetensors import safe_open

    from engram_trt.engram.quant import dequant_fp8_rows

    names = engram_tensor_names(1)
    with safe_open(m["tables"][0]["file"], framework="pt") as f:
        q = f.get_tensor(names["table"]).view(torch.uint8).numpy()
        s = f.get_tensor(names["scale"]).view(torch.uint8).numpy()
    orig = w[names["table"]].float().numpy()
    deq = dequant_fp8_rows(q, s)
    assert np.abs(deq - orig).max() <= np.abs(orig).max() / 8  # e4m3: 3 mantissa bits
    for t in m["tables"]:
        assert t["sha256"] == file_sha256(t["file"], t["offset"], t["nbytes"])


@pytest.mark.skipif(not trt_compat.module_available("tensorrt"), reason=trt_compat.NOT_INSTALLED_REASON)
def test_full_tensorrt_builds_demo(
    demo_dir: Path, plugin_lib: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ENGRAM_TRT_FLAVOUR", "tensorrt")
    r = build(demo_dir, tmp_path / "eng", plugin_library=plugin_lib, progress=False)
    assert r.trt["flavour"] == "tensorrt" and r.engine_path is not None


def _plugin_counts(layers: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for name in layers:
        key = name.split("/")[0]
        out[key] = out.get(key, 0) + 1
    return out


@needs_rtx
def test_demo_builds_rtx_engine_with_four_plugins(
    demo_dir: Path, plugin_lib: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The packed serving graph: one EngramAttention per layer (its KV caches aliased in
    place, which the builder accepts only with the preview feature build_engine enables),
    the Engram hash once and a gather and gate per Engram layer. Every plugin node names
    all its creator's fields, so the ONNX parser warns of no missing attribute."""
    with caplog.at_level(logging.WARNING, logger="engram_trt.tensorrt"):
        r = build(demo_dir, tmp_path / "eng", plugin_library=plugin_lib, progress=False)
    missing = [rec.getMessage() for rec in caplog.records if "not found in plugin node" in rec.getMessage()]
    assert missing == []
    assert r.engine_path is not None and r.engine_path.stat().st_size == r.engine_bytes
    assert r.trt["flavour"] == "tensorrt_rtx"
    ckpt = Checkpoint.open(demo_dir)
    layer_ids = ckpt.config.engram.layer_ids
    assert _plugin_counts(r.plugin_layers) == {
        "EngramHash": 1,
        "EngramGather": len(layer_ids),
        "EngramGate": len(layer_ids),
        "EngramAttention": ckpt.config.num_hidden_layers,
    }
    # The tables stay outside: the demo engine (backbone, kernels, the embedded plugin
    # library) is orders of magnitude smaller than the tables it leaves in the checkpoint.
    tables_on_disk = sum(
        ckpt.locate(n)[2] for lid in layer_ids for k, n in engram_tensor_names(lid).items() if k in ("table", "scale")
    )
    assert r.tables_bytes == tables_on_disk
    assert r.tables_bytes >= 100 * r.engine_bytes, (r.tables_bytes, r.engine_bytes)
    m = json.loads(r.manifest_path.read_text())
    assert m["plugins"]["embedded"] is True and m["tensorrt"]["flavour"] == "tensorrt_rtx"
    assert m["plugins"]["names"] == ["EngramAttention", "EngramGate", "EngramGather", "EngramHash"]
    layers = ckpt.config.num_hidden_layers
    assert m["graph"]["io"]["kv_cache"]["aliases"] == {
        f"{kind}_cache_out_{i}": f"{kind}_cache_{i}" for i in range(layers) for kind in ("key", "value")
    }
    assert m["graph"]["inputs"][:4] == ["input_ids", "seq_starts", "past_lens", "slots"]
    # A rebuild with the same inputs gives the same manifest.
    r2 = build(demo_dir, tmp_path / "eng2", plugin_library=plugin_lib, progress=False)
    assert r2.manifest_path.read_bytes() == r.manifest_path.read_bytes()
    # --target sm86, plugin library referenced rather than embedded: a smaller engine.
    r3 = build(
        demo_dir,
        tmp_path / "eng3",
        plugin_library=plugin_lib,
        targets="sm86",
        embed_plugin_library=False,
        progress=False,
    )
    m3 = json.loads(r3.manifest_path.read_text())
    assert m3["build_flags"]["targets"] == ["sm86"] and m3["plugins"]["library"]["path"] == str(plugin_lib)
    assert r3.engine_bytes < r.engine_bytes


def _word_tokenizer(path: Path, words: int) -> Path:
    """A tiny word-level tokenizer.json (ids 0..words-1), so a test model's embedding
    is small and the tables dominate, as in production."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


@needs_rtx
def test_engine_is_orders_of_magnitude_smaller_than_tables(plugin_lib: Path, tmp_path: Path) -> None:
    """The production shape (backbone small next to its tables): the engine stays at
    least 100x smaller than the tables, and its size does not depend on how many rows
    the tables have, i.e. it holds none of their bytes."""
    tok = _word_tokenizer(tmp_path / "tokenizer.json", 512)
    compressed = build_compressed_vocab(tok).size
    base = dict(
        architectures=["EngramLlamaForCausalLM"],
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        num_hidden_layers=2,
        vocab_size=512,
        hc_mult=2,
        tie_word_embeddings=True,
        max_position_embeddings=256,
        engram_layer_ids=[0, 1],
        engram_max_ngram_size=3,
        engram_n_heads=4,
        engram_head_dim=128,
        engram_compressed_vocab_size=compressed,
        engram_pad_token_id=0,
    )
    results = []
    for vocab in (20_000, 400_000):
        cfg = dict(base, engram_vocab_size=vocab)
        mc = ModelConfig.from_dict(cfg)
        rows = [int(r) for r in EngramLayout.from_spec(mc.engram, 0).table_rows]
        w = random_weights(mc, torch.Generator().manual_seed(0), table_rows=[16] * len(rows))
        for lid, n in zip(mc.engram.layer_ids, rows):  # full-size tables; their content does not matter here
            names = engram_tensor_names(lid)
            w[names["table"]] = torch.zeros((n, 128), dtype=torch.uint8).view(torch.float8_e4m3fn)
            w[names["scale"]] = torch.full((n, 4), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
        ck = write_checkpoint(tmp_path / f"ck{vocab}", cfg, w, tok, max_shard_bytes=1 << 30)
        del w
        results.append(
            build(
                ck,
                tmp_path / f"eng{vocab}",
                plugin_library=plugin_lib,
                embed_plugin_library=False,
                targets="sm86",
                max_seq_len=256,
                max_num_tokens=64,
                progress=False,
            )
        )
    small, large = results
    assert large.tables_bytes >= 15 * small.tables_bytes
    assert large.tables_bytes >= 100 * large.engine_bytes, (large.tables_bytes, large.engine_bytes)
    # Twenty times the table rows, the same engine (to within the layout constants' bytes).
    assert abs(large.engine_bytes - small.engine_bytes) < 64 * 1024, (small.engine_bytes, large.engine_bytes)


def test_rtx_parser_link_through_cache(tmp_path: Path) -> None:
    """Where the RTX libs folder cannot take the link, the cache-folder route still gives
    a working parser (checked in a fresh process on a copy of the package layout)."""
    if not RTX:
        pytest.skip("TensorRT-RTX is not installed")
    libs = trt_compat._rtx_libs_dir()
    bindings = Path(__import__("importlib").util.find_spec("tensorrt_rtx_bindings").origin).parent
    site = tmp_path / "site"
    (site / "tensorrt_rtx_libs").mkdir(parents=True)
    (site / "tensorrt_rtx_libs" / "__init__.py").write_text((libs / "__init__.py").read_text())
    for name in ("libtensorrt_rtx.so.1", "libtensorrt_onnxparser_rtx.so.1"):
        (site / "tensorrt_rtx_libs" / name).symlink_to(libs / name)
    (site / "tensorrt_rtx_bindings").symlink_to(bindings)
    code = (
        "from engram_trt.native import trt_compat as tc\n"
        "b = tc.create_builder(); n = tc.create_network(b); p = tc.onnx_parser(n)\n"
        "print('OK', tc.describe()['module'], tc.ensure_rtx_parser_link())\n"
    )
    env = dict(
        os.environ,
        PYTHONPATH=f"{site}{os.pathsep}{REPO / 'python'}",
        ENGRAM_TRT_RTX_LINK_IN_CACHE="1",
        ENGRAM_TRT_CACHE=str(tmp_path / "cache"),
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "OK tensorrt_rtx_bindings" in out.stdout
    assert (tmp_path / "cache" / "trt-rtx-libs" / "libtensorrt_rtx.so").is_symlink()


def test_targets_parse() -> None:
    assert trt_compat.parse_targets("sm80, sm86,86") == ("sm80", "sm86")
    with pytest.raises(EngramError, match="sm90"):
        trt_compat.parse_targets("sm90")
