"""`engram-trt bench dsv4-step` end to end on the CPU (``--device cpu --model tiny``):
the runtime's prefetched step equals the model's own gather and is the same in both
table placements; the floors' bytes equal sums written here from the config's fields
(the tensors' shapes, the attention state a decode step attends, the Engram rows); the
per-module-class breakdown counts each class's calls as the model's layer types imply
and adds up to the step; its wrappers change no logit and are all put back."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch

from engram_trt.bench.dsv4model import CSA, HCA, PRESETS, bench_config, build_model

CONTEXT, PREFILL, TABLE_GIB = 40, 12, 0.005
ARGS = [
    "bench",
    "dsv4-step",
    "--device",
    "cpu",
    "--model",
    "tiny",
    "--batches",
    "1,2",
    "--context",
    str(CONTEXT),
    "--prefill",
    str(PREFILL),
    "--reps",
    "1",
    "--profile-reps",
    "1",
    "--kernel-reps",
    "2",
    "--table-gib",
    str(TABLE_GIB),
]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from engram_trt.cli.main import main

    out = tmp_path_factory.mktemp("dsv4") / "r.json"
    assert main([*ARGS, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def _cfg() -> Any:
    from engram_trt.models.deepseek_v4.config import read_config

    return read_config(bench_config("tiny", table_gib=TABLE_GIB, max_len=CONTEXT + 2))


def test_every_case_and_placement_ran_and_the_logits_agree(report: dict[str, Any]) -> None:
    assert list(report["cases"]) == ["decode 1", "decode 2", f"prefill {PREFILL}"]
    for name, row in report["cases"].items():
        for where in ("hbm", "pinned"):
            e = row[where]
            assert e["step_ms"] > 0 and e["lookup_ms"] > 0 and e["lookup_path"] == "reference", (name, where)
            assert e["check"]["finite"]
            # the staged rows (Prefetcher) give the logits of the model's own gather, exactly (fp32, CPU)
            assert e["check"]["vs_own_gather_rel"] == 0.0, (name, where)
        assert row["pinned"]["check"]["vs_first_placement_rel"] == 0.0
        assert row["pinned_over_hbm"] == pytest.approx(row["pinned"]["step_ms"] / row["hbm"]["step_ms"])
    assert report["limits"] == {} and "floor_ms" not in report["cases"]["decode 1"]["hbm"]["floor"]


def test_the_floor_bytes_equal_the_configs_sums(report: dict[str, Any]) -> None:
    from engram_trt.models.deepseek_v4.model import model_tensor_shapes

    cfg, p = _cfg(), PRESETS["tiny"]
    shapes = model_tensor_shapes(cfg)
    E, k = p["n_routed_experts"], p["num_experts_per_tok"]
    D, hd, W = p["hidden_size"], p["head_dim"], p["sliding_window"]
    cols = (p["engram_max_ngram_size"] - 1) * p["engram_n_heads"]
    ehd = p["engram_head_dim"]
    assert report["model"]["weight_bytes"] == 4 * sum(
        math.prod(s) for n, s in shapes.items() if not n.endswith("tid2eid")
    )
    for name, row in report["cases"].items():
        T, S = row["tokens"], row["seqs"]
        touched = 1 - (1 - k / E) ** T
        experts = sum(math.prod(s) for n, s in shapes.items() if ".experts." in n)
        other = sum(
            math.prod(s)
            for n, s in shapes.items()
            if ".experts." not in n and not n.endswith(("tid2eid", "embed_tokens.weight"))
        )
        want_weights = 4 * (other + experts * touched + T * D)
        decode = name.startswith("decode")
        L = CONTEXT + 1
        per_seq = 0
        for kind in cfg.layer_types:  # window K=V, CSA indexer keys + top-k entries, HCA entries
            per_seq += min(L, W) * hd
            if kind == CSA:
                n = L // p["compress_rates"][CSA]
                per_seq += n * p["index_head_dim"] + min(p["index_topk"], n) * hd
            elif kind == HCA:
                per_seq += L // p["compress_rates"][HCA] * hd
        for where in ("hbm", "pinned"):
            f = row[where]["floor"]
            assert f["weight_bytes"] == pytest.approx(want_weights, abs=1), (name, where)
            assert f["state_bytes"] == (4 * S * per_seq if decode else 0)
            assert f["engram_table_bytes"] == T * cols * 2 * (ehd + ehd // 32)
            assert f["engram_staged_bytes"] == T * cols * 2 * ehd * 2
            tables = f["engram_table_bytes"] if where == "hbm" else 0  # host tables' rows cross the link instead
            assert f["hbm_bytes"] == f["weight_bytes"] + f["state_bytes"] + f["engram_staged_bytes"] + tables


def test_the_breakdown_counts_each_class_and_adds_up_to_the_step(report: dict[str, Any]) -> None:
    cfg = _cfg()
    n = cfg.num_hidden_layers
    want = {
        "attention.sliding": cfg.layer_types.count("sliding_attention"),
        "attention.csa": 1,
        "attention.hca": 1,
        "moe": n,
        "mhc": 4 * n + 1,
        "engram": 2,
        "engram.wait": 2,
        "norm": 2 * n + 1,
        "embed": 1,
        "other": 0,
    }
    for name, row in report["cases"].items():
        for where in ("hbm", "pinned"):
            b = row[where]["breakdown"]
            assert b["steps"] == 1 and b["clock"] == "wall clock (CPU)"
            assert {c: v["calls"] for c, v in b["classes"].items()} == want, (name, where)
            assert all(v["gpu_ms"] >= 0 for v in b["classes"].values())
            assert sum(v["gpu_ms"] for v in b["classes"].values()) == pytest.approx(b["total_gpu_ms"], rel=1e-9)
            assert sum(v["host_ms"] for v in b["classes"].values()) == pytest.approx(b["total_host_ms"], rel=1e-9)
            assert sorted(b["order"]) == sorted(want)


def test_the_kernel_profile_is_asked_of_decode_cases_only_and_says_why_it_skipped(report: dict[str, Any]) -> None:
    """``--kernel-reps``: each decode case's kernel profile (GPU kernel records: none on a
    CPU, so each says so); a prefill chunk is not profiled."""
    for name, row in report["cases"].items():
        for where in ("hbm", "pinned"):
            got = row[where].get("kernel_profile")
            if name.startswith("decode"):
                assert got == {"skipped": "no CUDA device (the kernel profile reads the GPU's kernel records)"}, name
            else:
                assert got is None, name


def test_the_clock_changes_no_logit_and_puts_every_wrapper_back() -> None:
    from engram_trt.bench.dsv4model import build_tables, table_store
    from engram_trt.bench.dsv4profile import ModuleClock
    from engram_trt.bench.dsv4step import _make_step
    from engram_trt.models.deepseek_v4 import modules

    bm = build_model(bench_config("tiny", table_gib=TABLE_GIB, max_len=CONTEXT + 2), torch.device("cpu"), torch.float32)
    bm.model.set_tables(
        table_store(
            build_tables(bm.layout, bm.config.engram.head_dim, "pinned", "cpu"),
            "pinned",
            list(bm.config.engram.layer_ids),
        )
    )
    cache = bm.model.new_cache(2, CONTEXT + 2)
    step, _cids, _lb = _make_step(bm, [1, 1], CONTEXT, seed=3)

    def once() -> torch.Tensor:
        cache.lengths[0] = cache.lengths[1] = CONTEXT
        return bm.model.forward_step(step, cache)

    plain = once()
    expand = modules.HyperConnection.__dict__["expand"]
    got: list[torch.Tensor] = []
    with ModuleClock(bm.model) as clock:
        clock.step(lambda: got.append(once()))
        assert modules.HyperConnection.__dict__["expand"] is not expand
    assert torch.equal(got[0], plain) and float(plain.abs().max()) > 0
    assert modules.HyperConnection.__dict__["expand"] is expand
    for mod in bm.model.modules():
        assert not {"forward", "collapse"} & set(mod.__dict__), type(mod).__name__
    assert torch.equal(once(), plain)


@pytest.mark.parametrize(
    "argv,why",
    [
        (["--prefill", "-1"], "--prefill must be >= 0"),
        (["--batches", "0"], "--batches must be >= 1"),
        (["--table-gib", "0"], "--table-gib must be > 0"),
    ],
)
def test_bad_values_are_one_line(argv: list[str], why: str, capsys: pytest.CaptureFixture[str]) -> None:
    from engram_trt.cli.main import main

    assert main([*ARGS, *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and why in err, err


def test_help_names_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    from dataclasses import fields

    from engram_trt.bench.dsv4step import Dsv4StepOptions
    from engram_trt.cli.main import main

    with pytest.raises(SystemExit):
        main(["bench", "dsv4-step", "--help"])
    text = capsys.readouterr().out
    for f in fields(Dsv4StepOptions):
        assert f"--{f.name.replace('_', '-')}" in text and f.metadata["help"], f.name


@pytest.fixture(scope="module")
def both_weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from engram_trt.cli.main import main

    out = tmp_path_factory.mktemp("dsv4w") / "r.json"
    argv = list(ARGS)
    argv[argv.index("--profile-reps") + 1] = "0"  # the breakdown is checked above
    assert main([*argv, "--placements", "hbm", "--weights", "bf16,fp8", "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_fp8_weights_floor_counts_the_stored_bytes(both_weights: dict[str, Any]) -> None:
    """``--weights bf16,fp8``: both formats built and timed in one process; the fp8 model
    (FP8 E4M3 linears with ue8m0 128x128 scales, FP4 routed experts with a ue8m0 scale per
    32 inputs, DeepSeek-V4.1-Flash's recipe) holds and its floor reads the bytes of that
    format, summed here from the config's shapes; the comparison holds the two floors'
    ratio beside the step times' (logits finite in both)."""
    import re

    from engram_trt.models.deepseek_v4.model import model_tensor_shapes

    r = both_weights
    assert list(r["runs"]) == ["bf16", "fp8"] and r["cases"] == r["runs"]["bf16"]["cases"]
    fp8 = re.compile(
        r"\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b)\.weight$|\.indexer\.wq_b\.weight$|"
        r"\.shared_experts\.w[123]\.weight$"
    )
    fp4 = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
    cfg = _cfg()
    p = PRESETS["tiny"]
    E, k, D = p["n_routed_experts"], p["num_experts_per_tok"], p["hidden_size"]

    def stored(name: str, shape: tuple[int, ...]) -> int:
        n, kk = shape
        if fp8.search(name):
            return n * kk + -(-n // 128) * -(-kk // 128)
        if fp4.search(name):
            return n * kk // 2 + n * kk // 32
        return 4 * math.prod(shape)

    shapes = {n: s for n, s in model_tensor_shapes(cfg).items() if not n.endswith("tid2eid")}
    assert any(fp8.search(n) for n in shapes) and any(fp4.search(n) for n in shapes)
    assert r["runs"]["fp8"]["model"]["weight_bytes"] == sum(
        stored(n, s) if len(s) == 2 else 4 * math.prod(s) for n, s in shapes.items()
    )
    assert (
        r["runs"]["fp8"]["model"]["quantization"]
        == "fp8 e4m3 (128x128 blocks, ue8m0 scales, dynamic activations), experts fp4"
    )
    experts = sum(stored(n, s) for n, s in shapes.items() if ".experts." in n and ".shared_experts." not in n)
    other = sum(
        stored(n, s) if len(s) == 2 else 4 * math.prod(s)
        for n, s in shapes.items()
        if (".experts." not in n or ".shared_experts." in n) and n != "model.embed_tokens.weight"
    )
    for name, row in r["runs"]["fp8"]["cases"].items():
        T = row["tokens"]
        touched = 1 - (1 - k / E) ** T
        f = row["hbm"]["floor"]
        assert f["weight_bytes"] == pytest.approx(other + experts * touched + 4 * T * D, abs=1), name
        assert row["hbm"]["check"]["finite"] and r["runs"]["bf16"]["cases"][name]["hbm"]["check"]["finite"]
        c = r["weights_comparison"][name]
        assert c["floor_ratio"] == pytest.approx(
            r["runs"]["bf16"]["cases"][name]["hbm"]["floor"]["hbm_bytes"] / f["hbm_bytes"]
        )
        assert c["speedup"] == pytest.approx(c["bf16_step_ms"] / c["fp8_step_ms"]) and c["floor_ratio"] > 1
