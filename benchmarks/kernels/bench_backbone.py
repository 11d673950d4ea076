#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""``python benchmarks/kernels/bench_backbone.py``: decode steps of the 1.15B engram-llama's backbone (the
model of ``bench step --model 1b``, its Engram layers removed) replayed as the runtime's
DecodeGraphs, the fused decoder-layer path against the unfused one and its variants, each
as a ratio to the step's weight-read bound (backbone weights + the K/V read once, at the
HBM copy rate measured in the same run), with the kernels one replay launches and where
the step's GPU time goes (the model and its variants are built by
tests/gpu/cases.py; tests/gpu/test_backbone.py checks the variants' logits).

Variants beside the default fused step: the GEMM library's projections (the GEMV off, at
batches the GEMV serves), no programmatic dependent launches (ENGRAM_TRT_PDL=0), and SDPA
over copies of the cache (below IN_PLACE_DECODE_BYTES) or the tiled attention kernel.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# engram_trt from this checkout and this folder's modules, then tests/gpu/cases.py (the GPU cases tests/gpu checks):
sys.path[:0] = [p for p in (str(REPO / "python"), str(Path(__file__).resolve().parent)) if p not in sys.path]
if str(REPO / "tests" / "gpu") not in sys.path:
    sys.path.append(str(REPO / "tests" / "gpu"))

from dataclasses import dataclass  # noqa: E402
from typing import Any  # noqa: E402

from engram_trt.bench.options import opt  # noqa: E402


@dataclass(kw_only=True)
class BackboneOptions:
    """``python benchmarks/kernels/bench_backbone.py``'s flags."""

    iters: int = opt(20, help="timed decode steps per case (median; default: %(default)s)")
    batches: list[int] = opt([1, 64, 256], help="decode batch sizes (sequences per step; default: 1,64,256)")
    context: int = opt(256, help="each sequence's past tokens (default: %(default)s)")
    json: str | None = opt(None, metavar="FILE", help="write all figures as JSON to FILE")


def say(msg: str) -> None:
    print(msg, flush=True)


def backbone_weight_bytes(model: Any) -> int:
    """Bytes of every parameter but the Engram layers' (wkv, q / k weights): what a decode
    step of the backbone reads once."""
    engram = {
        id(p)
        for layer in model.model.layers
        if layer.engram_module is not None
        for p in layer.engram_module.parameters()
    }
    return sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in engram)


def count_kernels(fn: Any, breakdown: dict | None = None) -> int | None:
    """Kernels one call of ``fn`` launches (graph replays included), by the profiler.
    ``breakdown``: filled with ``{kernel name: [launches, GPU us]}`` of that call, so a
    report can say where a step's time goes (the kernels' own durations: the gaps between
    them are the rest of the step)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from engram_trt.bench.common import union_us

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        events = [
            e
            for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.lower().startswith(("memcpy", "memset"))
        ]
        if breakdown is not None:
            for e in events:
                entry = breakdown.setdefault(e.name, [0, 0.0])
                entry[0] += 1
                entry[1] += float(e.time_range.end - e.time_range.start)
            breakdown[UNION] = [0, union_us([(e.time_range.start, e.time_range.end) for e in events])]
        return len(events) or None
    except Exception as exc:  # the count is a figure, not a check
        say(f"  (kernel count unavailable: {type(exc).__name__}: {exc})")
        return None


UNION = "(any kernel running)"  # the breakdown's entry for the union of the kernels' spans


def say_breakdown(label: str, step_ms: float, breakdown: dict, top: int = 10) -> None:
    """The kernels taking most of one step's GPU time, and what the gaps take."""
    kernels = {k: v for k, v in breakdown.items() if k != UNION}
    summed = sum(v[1] for v in kernels.values())
    busy = breakdown.get(UNION, [0, summed])[1]
    say(
        f"  {label}: some kernel running {busy / 1e3:.3f} ms of the {step_ms:.3f} ms step (gaps and launch latency: "
        f"{max(0.0, step_ms - busy / 1e3):.3f} ms; kernel spans summed {summed / 1e3:.3f} ms, more when they overlap); "
        "top kernels by GPU time:"
    )
    for name, (n, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]:
        say(f"    {us:8.1f} us  {n:4d} x {us / n:6.1f} us  {name[:110]}")


# How the summary line names each variant beside the default fused step, in its order.
VARIANT_WORDS = {
    "fused, SDPA over copies": "with SDPA over copies of the cache",
    "fused, GEMM library": "with the GEMM library's projections",
    "fused, no PDL": "without dependent launches",
    "fused, tiled attention": "with the tiled attention kernel",
}


def time_variant(
    model: Any,
    cache: Any,
    step: Any,
    B: int,
    past: int,
    name: str,
    iters: int,
    bound_ms: float,
    row: dict,
    last: dict,
    result: dict,
) -> None:
    """One variant of a decode step from a CUDA graph: its time, kernels and logits."""
    from engram_trt.bench.common import time_fn
    from cases import decode_step
    from engram_trt.runtime.cuda_graphs import DecodeGraphs

    graphs = DecodeGraphs(model, cache, B, scratch_slot=B, tables=None)
    one = decode_step(model, graphs, cache, step, B, past)
    t = time_fn(one, model.device, 3, iters)
    last[name] = one().float().clone()  # a graph's output buffer: the next replay overwrites it
    result["replayed"][f"decode {B}: {name}"] = graphs.failed or graphs.replays > 0
    breakdown: dict = {}
    row[name] = {
        "step_ms": t["median_s"] * 1e3,
        "ratio_to_bound": t["median_s"] * 1e3 / bound_ms,
        "kernels": count_kernels(one, breakdown),
        "kernel_us": breakdown,
    }
    if name.startswith("fused"):
        say_breakdown(f"decode {B} {name}", row[name]["step_ms"], breakdown)


def time_decode(model: Any, iters: int, batches: tuple[int, ...], result: dict, context: int = 256) -> None:
    import numpy as np
    import torch

    from engram_trt.bench.common import measure_limits
    from cases import decode_case, decode_variants, rel_err, variant_settings

    dev = model.device
    limits = measure_limits(dev)
    cfg = model.config
    kernels = model.backbone_ops
    model.engram_enabled = False  # the backbone alone: the target's denominator
    weight_bytes = backbone_weight_bytes(model)
    past = context
    rng = np.random.default_rng(1)
    say(
        f"timing: decode at context {past}, Engram layers removed; backbone weights {weight_bytes / 2**30:.2f} GiB, "
        f"HBM copy {limits['hbm_GBps']:.0f} GB/s"
    )
    try:
        for B in batches:
            cache, step = decode_case(model, B, past, rng)
            kv_bytes = 2 * cfg.num_hidden_layers * B * (past + 1) * cfg.num_key_value_heads * cfg.head_dim * 2
            bound_ms = (weight_bytes + kv_bytes) / (limits["hbm_GBps"] * 1e9) * 1e3
            row: dict[str, Any] = {"bound_ms": bound_ms}
            last: dict[str, Any] = {}
            for name, ops in decode_variants(model, B, past):
                model.backbone_ops = ops
                with variant_settings(name):
                    time_variant(model, cache, step, B, past, name, iters, bound_ms, row, last, result)
            model.backbone_ops = kernels
            row["fused_vs_unfused_rel_l2"] = rel_err(last["fused"], last["unfused"])
            row["speedup"] = row["unfused"]["step_ms"] / row["fused"]["step_ms"]
            result["timing"][f"decode {B}"] = row
            say(
                f"  decode {B}: unfused {row['unfused']['step_ms']:.3f} ms ({row['unfused']['ratio_to_bound']:.2f}x "
                f"bound), fused {row['fused']['step_ms']:.3f} ms ({row['fused']['ratio_to_bound']:.2f}x), bound "
                f"{bound_ms:.3f} ms"
                + "".join(
                    f"; fused {what} {row[name]['step_ms']:.3f} ms ({row[name]['ratio_to_bound']:.2f}x)"
                    for name, what in VARIANT_WORDS.items()
                    if name in row
                )
            )
            cache = None
            torch.cuda.empty_cache()
    finally:
        model.backbone_ops = kernels
        model.engram_enabled = True
    result["limits"] = limits


def print_table(timing: dict) -> None:
    say(
        f"{'case':<11} | {'bound ms':>8} | {'unfused ms':>10} | {'x bound':>7} | {'fused ms':>8} | {'x bound':>7} | "
        f"{'speedup':>7} | kernels unfused -> fused"
    )
    for label, r in timing.items():
        u, f = r["unfused"], r["fused"]
        say(
            f"{label:<11} | {r['bound_ms']:8.3f} | {u['step_ms']:10.3f} | {u['ratio_to_bound']:7.2f} | "
            f"{f['step_ms']:8.3f} | {f['ratio_to_bound']:7.2f} | {r['speedup']:7.2f} | {u['kernels']} -> {f['kernels']}"
        )
    say("bound: backbone weights + K/V read once at the HBM copy rate measured in this run; target <= 3x at batch 1")


def run(opts: BackboneOptions) -> int:
    """Builds the model, times each batch's variants; prints the table and writes
    ``timing`` (per batch: each variant's step_ms, ratio_to_bound, kernels, kernel_us;
    bound_ms, speedup, fused_vs_unfused_rel_l2), ``replayed`` (variant -> replayed from a
    graph) and ``limits`` as JSON when ``opts.json`` is set; 1 when a variant was not
    replayed from a graph (its time would be the eager step's)."""
    from engram_trt.bench.common import dump
    from cases import build_model, require_cuda
    from engram_trt.errors import EngramError

    if opts.iters < 1 or not opts.batches or min(opts.batches) < 1 or opts.context < 1:
        raise EngramError(
            f"--iters, --batches and --context must be >= 1 (got {opts.iters}, {opts.batches}, {opts.context})"
        )
    device = require_cuda("backbone")
    result: dict[str, Any] = {"timing": {}, "replayed": {}}
    model, _, _ = build_model(device)
    result["backend"] = model.backend_name
    time_decode(model, opts.iters, tuple(opts.batches), result, opts.context)
    print_table(result["timing"])
    dump(result, opts.json)
    return 0 if all(v is True for v in result["replayed"].values()) else 1


OPTIONS = BackboneOptions  # the script's flags, derived as an `engram-trt bench` command's (engram_trt.cli.bench)


def main(argv: list[str] | None = None) -> int:
    from engram_trt.cli.bench import run_script

    return run_script(OPTIONS, run, __doc__ or "", argv, prog=Path(__file__).name)


if __name__ == "__main__":
    sys.exit(main())
