"""Offline row counts (`benchmarks/lookup/rowcounts.py`, formerly `bench rowcounts`) and the
cache warmed from them in `bench_cache.py`: counts equal np.unique's, the file round-trips, and counts that overlap
the measured chunks are refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from helpers.benchmark_scripts import script, zipf_stream
from engram_trt.errors import EngramError

idstreams, rowcounts, bench_cache = script("idstream"), script("rowcounts"), script("cache")
VOCAB = 5000


def _stream(num_tokens: int, seed: int = 0) -> idstreams.TokenStream:
    return zipf_stream(num_tokens, VOCAB, seed)


def test_counts_are_the_lookups_per_row(monkeypatch) -> None:
    rng = np.random.default_rng(1)
    chunks = [rng.integers(0, 700, size=(50, 2, 6)).astype(np.int32) for _ in range(5)]
    monkeypatch.setattr(rowcounts, "_BATCH_IDS", 700)  # several batches
    got = rowcounts.count_rows(chunks, [700, 800], [1])
    assert set(got) == {1} and got[1].dtype == np.int32 and got[1].shape == (800,)
    rows, n = np.unique(np.concatenate([c[:, 1, :].reshape(-1) for c in chunks]), return_counts=True)
    want = np.zeros(800, dtype=np.int64)
    want[rows] = n
    assert np.array_equal(got[1], want)
    with pytest.raises(EngramError, match="row ids of layer 0 fall outside its 10 rows"):
        rowcounts.count_rows(chunks, [10, 800], [0])


def test_counts_file_round_trips_and_refuses_overlap(tmp_path: Path) -> None:
    stream = _stream(8192 * 3)
    layout = idstreams.make_layout(1024, VOCAB, 1)
    rows = [int(r) for r in layout.table_rows]
    c = np.zeros(rows[0], dtype=np.int32)
    c[[3, 9, 100]] = [7, 2, 7]
    rc = rowcounts.RowCounts(
        counts={0: c},
        column_rows=1024,
        table_rows=rows,
        first_chunk=2,
        num_chunks=3,
        chunk_tokens=8192,
        stream=rowcounts.stream_fingerprint(stream),
    )
    path = rowcounts.save_row_counts(rc, tmp_path / "c.npz")
    with np.load(path) as z:
        assert z["rows_0"].tolist() == [3, 100, 9] and z["counts_0"].tolist() == [7, 7, 2]  # sparse, by count
    back = rowcounts.load_row_counts(path)
    assert np.array_equal(back.counts[0], c) and back.chunk_range == (2, 5) and back.table_rows == rows
    assert "disjoint from the measured chunks 5..7" in rowcounts.check_disjoint(back, stream, (5, 8), layout, [0])
    with pytest.raises(EngramError, match=r"counts over chunks 2\.\.4 overlap the measured chunks 4\.\.5"):
        rowcounts.check_disjoint(back, stream, (4, 6), layout, [0])
    with pytest.raises(EngramError, match=r"no counts for layer\(s\) \[1\]"):
        rowcounts.check_disjoint(back, stream, (5, 8), layout, [0, 1])
    other_text = idstreams.TokenStream(**{**stream.__dict__, "files_sha256": "x"})
    assert "another token stream" in rowcounts.check_disjoint(back, other_text, (0, 8), layout, [0])
    other = idstreams.make_layout(2048, VOCAB, 1)
    with pytest.raises(EngramError, match="make them with the same --column-rows"):
        rowcounts.check_disjoint(back, stream, (5, 8), other, [0])


def test_bench_cache_warms_from_a_disjoint_counts_file(plugin_lib: Path, capsys, tmp_path: Path) -> None:
    tokens = idstreams.save_tokens(_stream(8192 * 6 + 5), tmp_path / "t.npz")
    counts = tmp_path / "counts.npz"
    assert (
        rowcounts.main(
            [
                "--tokens",
                str(tokens),
                "--column-rows",
                "1024",
                "--first-chunk",
                "4",
                "--chunks",
                "2",
                "--layers",
                "1",
                "--out",
                str(counts),
            ]
        )
        == 0
    )
    assert "counts over chunks 4..5 of the token stream" in capsys.readouterr().out
    out = tmp_path / "c.json"
    rc = bench_cache.main(
        [
            "--dry-run",
            "--tokens",
            str(tokens),
            "--column-rows",
            "1024",
            "--layers",
            "1",
            "--warm",
            "2",
            "--measure",
            "2",
            "--offline-counts",
            str(counts),
            "--json",
            str(out),
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "warming 'offline': the most frequent rows loaded at start-up from counts over chunks 4..5" in text
    assert "disjoint from the measured chunks 2..3" in text
    (layer,) = json.loads(out.read_text())["layers"]
    off = layer["offline"]
    assert off["exact"] is True and layer["exact"] is True
    assert off["stats"]["steps"] == 2 and off["stats"]["preloaded"] > 0 and 0.0 < off["stats"]["hit_rate"] < 1.0
    assert (
        bench_cache.main(
            [
                "--dry-run",
                "--tokens",
                str(tokens),
                "--column-rows",
                "1024",
                "--layers",
                "1",
                "--warm",
                "4",
                "--measure",
                "1",
                "--offline-counts",
                str(counts),
            ]
        )
        != 0
    )
    err = capsys.readouterr().err
    assert "counts over chunks 4..5 overlap the measured chunks 4..4; count a disjoint range" in err


def test_bench_cache_without_offline_warming(plugin_lib: Path, capsys, tmp_path: Path) -> None:
    tokens = idstreams.save_tokens(_stream(8192 * 2 + 5), tmp_path / "t.npz")
    out = tmp_path / "c.json"
    assert (
        bench_cache.main(
            [
                "--dry-run",
                "--tokens",
                str(tokens),
                "--column-rows",
                "1024",
                "--layers",
                "0",
                "--warm",
                "1",
                "--measure",
                "1",
                "--offline-counts",
                "none",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    assert "warming 'offline'" not in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["offline_counts"] is None and "offline" not in report["layers"][0]
