#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""``python benchmarks/kernels/bench_gemv.py``: a decode step's projections, the kernel library's GEMV
against the GEMM library (``F.linear``), each as the rate it reads the weights at over
the HBM copy rate measured in the same run.

A decode step of a few sequences is bound by reading each layer's weights once, so a
projection's floor is its weight bytes at the copy rate. Each timed call reads a weight
that no call shortly before it read (copies rotated past the L2's size, as a model's
layers are), and the calls are replayed from a CUDA graph, as the runtime's decode
steps are, so the time is the GPU's and not the launch's.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# engram_trt from this checkout and this folder's modules:
sys.path[:0] = [p for p in (str(REPO / "python"), str(Path(__file__).resolve().parent)) if p not in sys.path]

import logging  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any  # noqa: E402

from engram_trt.bench.options import opt  # noqa: E402

log = logging.getLogger(__name__)

# The 1B model's decode projections (bench step --model 1b): [N, K] of nn.Linear.
SHAPES: dict[str, tuple[int, int]] = {
    "qkv": (4096, 2048),
    "o": (2048, 2048),
    "gate_up": (11264, 2048),
    "down": (2048, 5632),
    "wkv": (10240, 6144),
    "lm_head": (129280, 2048),
}
ROTATE_BYTES = 256 << 20  # weights cycled per graph: > 5x the H200's 50 MB L2


@dataclass(kw_only=True)
class GemvOptions:
    """``python benchmarks/kernels/bench_gemv.py``'s flags."""

    shapes: list[str] = opt(
        list(SHAPES),
        choices=list(SHAPES),
        help=f"projections to time, of {','.join(SHAPES)} (default: all; the 1B model's)",
    )
    tokens: list[int] = opt([1, 2, 4], help="tokens per step (x's rows), each <= 4 (default: 1,2,4)")
    calls: int = opt(32, help="calls per graph replay (default: %(default)s)")
    iters: int = opt(20, help="timed replays per case (median; default: %(default)s)")
    json: str | None = opt(None, metavar="FILE", help="write all figures as JSON to FILE")


def time_graph(fn: Any, calls: int, iters: int, device: Any) -> float:
    """Median seconds per call of ``fn(i)`` for i in 0..calls-1, replayed from one graph."""
    from engram_trt.bench.common import capture_graph, time_fn

    graph, _ = capture_graph(lambda: [fn(i) for i in range(calls)], device)
    return time_fn(graph.replay, device, 3, iters)["median_s"] / calls


def run(opts: GemvOptions) -> int:
    import torch
    import torch.nn.functional as F

    from engram_trt.native import backbone as backbone_kernels
    from engram_trt.bench.common import dump, measure_limits
    from engram_trt.errors import EngramError

    if not torch.cuda.is_available():
        raise EngramError("bench gemv needs a CUDA GPU (it times GPU kernels); none is available here")
    shapes, tokens = opts.shapes, opts.tokens
    if not all(1 <= t <= backbone_kernels.GEMV_MAX_TOKENS for t in tokens):
        raise EngramError(f"--tokens: each must be in 1..{backbone_kernels.GEMV_MAX_TOKENS} (got {tokens})")
    if opts.calls < 1 or opts.iters < 1:
        raise EngramError("--calls and --iters must be >= 1")
    device = torch.device("cuda", torch.cuda.current_device())
    major, minor = torch.cuda.get_device_capability(device)
    if major < backbone_kernels.GEMV_MIN_CAPABILITY:
        raise EngramError(
            f"bench gemv times the kernel library's GEMV, built for compute capability "
            f"{backbone_kernels.GEMV_MIN_CAPABILITY}.0 and later; this GPU is {major}.{minor}"
        )
    backbone_kernels.load()
    limits = measure_limits(device)
    hbm = limits["hbm_GBps"]
    print(
        f"device {torch.cuda.get_device_name(device)}; HBM copy {hbm:.0f} GB/s (read + written; the floor below); "
        f"{opts.calls} calls per graph, weights rotated over >= {ROTATE_BYTES >> 20} MiB"
    )
    gen = torch.Generator(device=device).manual_seed(0)
    rows: list[dict[str, Any]] = []
    print(
        f"{'shape':<8} {'N x K':>13} {'T':>2} | {'floor us':>8} | {'GEMM lib us':>11} {'x floor':>7} | "
        f"{'GEMV us':>9} {'x floor':>7} | {'static us':>9} {'x floor':>7} | GEMV / GEMM lib | static / GEMM lib"
    )
    for name in shapes:
        N, K = SHAPES[name]
        copies = max(1, min(opts.calls, -(-ROTATE_BYTES // (N * K * 2))))
        weights = [torch.randn(N, K, device=device, dtype=torch.bfloat16, generator=gen) * 0.02 for _ in range(copies)]
        floor_us = N * K * 2 / (hbm * 1e9) * 1e6
        for T in tokens:
            x = torch.randn(T, K, device=device, dtype=torch.bfloat16, generator=gen)
            out = torch.empty(T, N, device=device, dtype=torch.bfloat16)
            row: dict[str, Any] = {
                "shape": name,
                "N": N,
                "K": K,
                "tokens": T,
                "floor_us": floor_us,
                "weight_copies": copies,
            }
            row["gemm_library_us"] = (
                time_graph(lambda i: torch.matmul(x, weights[i % copies].t(), out=out), opts.calls, opts.iters, device)
                * 1e6
            )
            row["gemv_us"] = (
                time_graph(
                    lambda i: backbone_kernels.gemv(x, weights[i % copies], out=out), opts.calls, opts.iters, device
                )
                * 1e6
            )
            # With weight_static each call may load its weight while the call before it
            # still runs (programmatic dependent launch).
            row["gemv_weight_static_us"] = (
                time_graph(
                    lambda i: backbone_kernels.gemv(x, weights[i % copies], out=out, weight_static=True),
                    opts.calls,
                    opts.iters,
                    device,
                )
                * 1e6
            )
            want = F.linear(x, weights[0])
            got = backbone_kernels.gemv(x, weights[0])
            row["max_abs_diff_vs_gemm_library"] = float((got.float() - want.float()).abs().max())
            rows.append(row)
            lib, gv, st = row["gemm_library_us"], row["gemv_us"], row["gemv_weight_static_us"]
            print(
                f"{name:<8} {N:>6} x {K:<5} {T:>2} | {floor_us:8.2f} | {lib:11.2f} {lib / floor_us:7.2f} | "
                f"{gv:9.2f} {gv / floor_us:7.2f} | {st:9.2f} {st / floor_us:7.2f} | {gv / lib:15.2f} | {st / lib:17.2f}"
            )
        weights = []
        torch.cuda.empty_cache()
    print(
        "floor: the weight's bytes read once at the HBM copy rate measured above; x floor = time / floor; "
        "static: the GEMV told its weight is static (it may load it while the call before it runs)"
    )
    dump({"limits": limits, "rows": rows, "calls": opts.calls, "iters": opts.iters}, opts.json)
    return 0


OPTIONS = GemvOptions  # the script's flags, derived as an `engram-trt bench` command's (engram_trt.cli.bench)


def main(argv: list[str] | None = None) -> int:
    from engram_trt.cli.bench import run_script

    return run_script(OPTIONS, run, __doc__ or "", argv, prog=Path(__file__).name)


if __name__ == "__main__":
    sys.exit(main())
