#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""``python benchmarks/kernels/bench_attention.py``: the packed-attention kernel (engram_attention_step /
_packed) against torch's scaled_dot_product_attention on the same data and against its
floor (the K/V read at the HBM rate, or the math at the bf16 matrix rate), both measured
in the same run (the shapes are ``ATTENTION_CASES`` of tests/gpu/cases.py;
tests/gpu/test_attention.py checks the kernel's outputs on them).

Decode steps of 1, 64 and 256 sequences at a 4k context (and 64 at 256), and one 8k
prefill chunk; bf16, 32 query / 8 KV heads of 128. SDPA runs on padded [B, H, S, hd]
with enable_gqa; the library's tiled kernel (ENGRAM_TRT_ATTENTION_KERNEL=tiled) on the
same data too. CUDA-event medians. A decode step reads each slot's K/V once, so its
floor is those bytes at the HBM copy rate; a prefill chunk's is its FLOPs at the bf16
matrix rate ("x floor": the longer of the two).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# engram_trt from this checkout and this folder's modules, then tests/gpu/cases.py (the GPU cases tests/gpu checks):
sys.path[:0] = [p for p in (str(REPO / "python"), str(Path(__file__).resolve().parent)) if p not in sys.path]
if str(REPO / "tests" / "gpu") not in sys.path:
    sys.path.append(str(REPO / "tests" / "gpu"))

import os  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any  # noqa: E402

from cases import ATTENTION_CASES  # noqa: E402
from engram_trt.bench.options import opt  # noqa: E402


@dataclass(kw_only=True)
class AttentionOptions:
    """``python benchmarks/kernels/bench_attention.py``'s flags."""

    reps: int = opt(20, help="timed calls per case (median; default: %(default)s)")
    cases: list[str] = opt(
        list(ATTENTION_CASES),
        choices=list(ATTENTION_CASES),
        help=f"cases to time, of {', '.join(ATTENTION_CASES)} (default: all)",
    )
    json: str | None = opt(None, metavar="FILE", help="write all figures as JSON to FILE")


def say(msg: str) -> None:
    print(msg, flush=True)


def tiled_kernel() -> Any:
    """While open, the library runs the tiled attention kernel (ENGRAM_TRT_ATTENTION_KERNEL=
    tiled, read at each launch) instead of the warp kernel it picks for 16-bit I/O and head
    dims 64 / 128 / 256."""
    from unittest import mock

    return mock.patch.dict(os.environ, {"ENGRAM_TRT_ATTENTION_KERNEL": "tiled"})


def time_case(label: str, device: Any, reps: int, limits: dict[str, float]) -> dict[str, Any]:
    """One timed case (its buffers are freed on return)."""
    from engram_trt.bench.common import event_seconds
    from cases import attention_case, rel_err
    from engram_trt.native import attention as attention_kernels

    c = attention_case(*ATTENTION_CASES[label], device)
    out = c.q.new_empty(c.q.shape)
    ours = event_seconds(
        lambda: attention_kernels.attention_step(c.q, c.k, c.v, c.kc, c.vc, c.slots, c.pos, scale=c.scale, out=out),
        reps,
    )

    def packed() -> Any:
        return attention_kernels.attention_packed(c.q, c.kc, c.vc, c.slots, c.pos, scale=c.scale, out=out)

    ours_attn = event_seconds(packed, reps)
    with tiled_kernel():  # the library's other kernel on the same data
        tiled = event_seconds(packed, reps)
    theirs = event_seconds(c.sdpa, reps)
    # agreement on the timed data (the reference here is SDPA itself)
    rel = rel_err(
        attention_kernels.attention_packed(c.q, c.kc, c.vc, c.slots, c.pos, scale=c.scale).float(), c.sdpa().float()
    )
    # the floor: the K/V read once at the HBM rate, or the math at the bf16 matrix rate
    # (a prefill chunk's bound), whichever is longer
    floor = max(c.kv_bytes / (limits["hbm_GBps"] * 1e9), c.flops / (limits["bf16_TFLOPs"] * 1e12))
    row = {
        "engram_step_s": ours,
        "engram_attention_s": ours_attn,
        "sdpa_s": theirs,
        "tiled_attention_s": tiled,
        "kv_floor_s": floor,
        "ratio_to_floor": ours_attn / floor,
        "ratio_to_tiled": ours_attn / tiled,
        "tiled_GBps": c.kv_bytes / tiled / 1e9,
        "ratio_to_sdpa": ours_attn / theirs,
        "engram_GBps": c.kv_bytes / ours_attn / 1e9,
        "engram_TFLOPs": c.flops / ours_attn / 1e12,
        "sdpa_TFLOPs": c.flops / theirs / 1e12,
        "rel_diff_vs_sdpa": rel,
        "agree_with_sdpa": rel < 1e-2,
    }
    say(
        f"  {label:<22} step {ours * 1e6:9.1f} us  attention {ours_attn * 1e6:9.1f} us  SDPA {theirs * 1e6:9.1f} us"
        f"  ({ours_attn / theirs:.2f} x SDPA, {ours_attn / floor:.2f} x floor, {row['engram_TFLOPs']:.1f} TFLOP/s)"
        f"  tiled kernel {tiled * 1e6:9.1f} us"
    )
    return row


def run(opts: AttentionOptions) -> int:
    """Times each case; prints the table, writes the figures (``cases``: label -> figures,
    ``agree_with_sdpa``: relative norm difference on the timed data < 1e-2) as JSON when
    ``opts.json`` is set; 1 when a case's outputs differ from SDPA's."""
    import torch

    from engram_trt.bench.common import dump, measure_limits
    from cases import require_cuda
    from engram_trt.errors import EngramError

    if opts.reps < 1 or not opts.cases:
        raise EngramError(f"--reps must be >= 1 and --cases name at least one case (got {opts.reps}, {opts.cases})")
    device = require_cuda("attention")
    limits = measure_limits(device)
    say(
        "timing: bf16, 32 query / 8 KV heads of 128; SDPA on padded [B, H, S, hd] with enable_gqa; HBM copy "
        f"{limits['hbm_GBps']:.0f} GB/s, bf16 matrix rate {limits['bf16_TFLOPs']:.0f} TFLOP/s (the floor's rates)"
    )
    rows = {label: time_case(label, device, opts.reps, limits) for label in opts.cases}
    print_timing(rows)
    dump({"device": torch.cuda.get_device_name(device), "reps": opts.reps, "limits": limits, "cases": rows}, opts.json)
    return 0 if all(r["agree_with_sdpa"] for r in rows.values()) else 1


def print_timing(rows: dict[str, Any]) -> None:
    say(
        f"{'case':<22} | {'step us':>9} | {'attn us':>9} | {'SDPA us':>9} | x SDPA | x floor | TFLOP/s | "
        f"{'tiled us':>9} | x tiled"
    )
    for label, r in rows.items():
        say(
            f"{label:<22} | {r['engram_step_s'] * 1e6:9.1f} | {r['engram_attention_s'] * 1e6:9.1f} | "
            f"{r['sdpa_s'] * 1e6:9.1f} | {r['ratio_to_sdpa']:6.2f} | {r['ratio_to_floor']:7.2f} | "
            f"{r['engram_TFLOPs']:.1f} (SDPA {r['sdpa_TFLOPs']:.1f}) | {r['tiled_attention_s'] * 1e6:9.1f} | "
            f"{r['ratio_to_tiled']:.2f}"
        )
    say(
        "floor: the K/V bytes the step reads once at the HBM copy rate, or its FLOPs at the bf16 matrix rate, "
        "whichever is longer, both measured in this run (x floor = time / floor)"
    )


OPTIONS = AttentionOptions  # the script's flags, derived as an `engram-trt bench` command's (engram_trt.cli.bench)


def main(argv: list[str] | None = None) -> int:
    from engram_trt.cli.bench import run_script

    return run_script(OPTIONS, run, __doc__ or "", argv, prog=Path(__file__).name)


if __name__ == "__main__":
    sys.exit(main())
