"""`engram-trt bench dsv4-step` on CUDA with the tiny shape (``--model tiny``): the path
the 1.8B benchmark takes, checked before its figures are read.

  1. Every case and placement ran: finite bf16 logits; the runtime's prefetched rows
     (gather kernel for HBM tables, the calibrated host gather / UVA kernel for pinned
     ones) give the logits of the model's own reference gather, and the two placements
     the same logits, within bf16 round-off of the MoE's unordered index_add (relative
     to the largest logit).
  2. The floors carry the limits measured in the run: no step beats its floor, no
     lookup from pinned tables beats its rows' bytes over the measured link.
  3. The breakdown, timed by CUDA events: each class called as the layer types and the
     bf16 CUDA path's kernels imply (the norms inside the mHC collapses, the mHC fold),
     the classes adding up to the step's span on the stream.
"""

from __future__ import annotations

import json

import pytest

from .helpers import note

ARGS = [
    "bench",
    "dsv4-step",
    "--device",
    "cuda",
    "--model",
    "tiny",
    "--batches",
    "1,4",
    "--context",
    "300",
    "--prefill",
    "64",
    "--reps",
    "3",
    "--profile-reps",
    "2",
    "--kernel-reps",
    "2",
    "--table-gib",
    "0.05",
]
REL = 2e-2  # bf16 logits: the MoE's index_add sums two experts per token in no fixed order


@pytest.fixture(scope="module")
def report(build_dir, tmp_path_factory):
    from engram_trt.cli.main import main

    out = tmp_path_factory.mktemp("dsv4") / "r.json"
    rc = main([*ARGS, "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    note("report", data)
    return data


def test_prefetched_rows_give_the_models_own_logits(report) -> None:
    for name, row in report["cases"].items():
        for where, paths in (("hbm", ("device",)), ("pinned", ("host", "uva"))):
            e = row[where]
            c = e["check"]
            assert c["finite"], f"{name} {where}: finite logits"
            assert e["lookup_path"] in paths, f"{name} {where}: lookup path: expected one of {paths}"
            assert c["vs_own_gather_rel"] <= REL, (
                f"{name} {where}: prefetched rows = own gather: max |diff| / max |logit| = {c['vs_own_gather_rel']:.2e}"
            )
        rel = row["pinned"]["check"]["vs_first_placement_rel"]
        assert rel <= REL, f"{name}: pinned tables = HBM tables: max |diff| / max |logit| = {rel:.2e}"


def test_floors_carry_the_measured_limits(report) -> None:
    lim = report["limits"]
    assert all(lim.get(k, 0) > 0 for k in ("hbm_GBps", "h2d_GBps", "bf16_TFLOPs")), f"limits measured: {str(lim)}"
    for name, row in report["cases"].items():
        for where in ("hbm", "pinned"):
            e, f = row[where], row[where]["floor"]
            assert e["step_over_floor"] >= 1.0, (
                f"{name} {where}: step >= floor: step {e['step_ms']:.3f} ms, floor {f['floor_ms']:.4f} ms"
            )
        p = row["pinned"]
        assert p["floor"]["link_ms"] > 0 and p["lookup_over_link"] >= 1.0, (
            f"{name}: pinned lookup no faster than its rows over the link: lookup alone {p['lookup_ms']:.3f} ms, link "
            f"floor {p['floor']['link_ms']:.5f} ms"
        )


def test_breakdown_by_cuda_events_adds_up(report) -> None:
    import os

    from engram_trt.models.deepseek_v4.modules import MHC_FOLD_ENV

    types = report["model"]["layer_types"]
    n = len(types)
    engram = report["model"]["engram_layers"]
    # the bf16 CUDA path: each RMSNorm runs inside its collapse's kernel (the final one in the
    # hyper head's), so no norm call of its own. With the mHC fold (default) a sublayer boundary
    # is one call (expansion + next collapse), the first collapse and the head one each, and an
    # Engram layer after the first takes the expansion before its update apart (2n + 1 + those
    # layers); without it each of the 2n collapses, the 2n - 1 expansions and the head apart
    fold = os.environ.get(MHC_FOLD_ENV, "1") != "0"
    mhc = 2 * n + 1 + sum(1 for i in engram if i > 0) if fold else 4 * n
    want = {
        "attention.sliding": types.count("sliding_attention"),
        "attention.csa": 1,
        "attention.hca": 1,
        "moe": n,
        "mhc": mhc,
        "engram": len(engram),
        "engram.wait": len(engram),
        "norm": 0,
        "embed": 1,
        "other": 0,
    }
    for name, row in report["cases"].items():
        for where in ("hbm", "pinned"):
            b = row[where]["breakdown"]
            calls = {c: v["calls"] for c, v in b["classes"].items()}
            assert calls == want and b["clock"] == "cuda events", f"{name} {where}: calls per class: {calls}"
            # medians of 2 steps per class need not add up exactly: 5% of the step
            total = sum(v["gpu_ms"] for v in b["classes"].values())
            assert abs(total - b["total_gpu_ms"]) <= 0.05 * b["total_gpu_ms"], (
                f"{name} {where}: classes add up to the step: {total:.3f} vs {b['total_gpu_ms']:.3f} ms"
            )
            assert min(v["gpu_ms"] for v in b["classes"].values()) > -1e-3, (
                f"{name} {where}: no class below zero: { {c: round(v['gpu_ms'], 4) for c, v in b['classes'].items()} }"
            )


def test_the_kernel_profile_adds_up_per_decode_case(report) -> None:
    """``--kernel-reps 2``: each decode case's kernels as the profiler records them, their
    per-kernel times adding up to the busy time, the replayed step's mode recorded."""
    for name, row in report["cases"].items():
        for where in ("hbm", "pinned"):
            p = row[where].get("kernel_profile")
            if not name.startswith("decode"):
                assert p is None, f"{name} {where}: a prefill chunk is not profiled"
                continue
            assert p is not None and "skipped" not in p, f"{name} {where}: {p}"
            assert p["steps"] == 2 and p["mode"] == row[where]["mode"] and p["step_ms"] > 0, f"{name} {where}"
            total = sum(k["ms"] for k in p["kernels"].values())
            assert p["busy_ms"] > 0 and abs(total - p["busy_ms"]) <= 1e-6 * max(1.0, p["busy_ms"]), (
                f"{name} {where}: kernels {total:.4f} ms against busy {p['busy_ms']:.4f} ms"
            )
            assert p["span_ms"] > 0 and p["kernels"][p["order"][0]]["calls"] >= 1, f"{name} {where}"
