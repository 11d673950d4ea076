#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
"""The tiled attention kernel's fp32 value sums, emulated in float32 NumPy (no GPU).

Why: the attention check bounds an fp32 output by 2e-6 (max|ref| + |ref|) against a
float64 reference. Over a long context the kernel's running output is one sum of a
term per key, and its rounding grows with the keys summed. This script runs the online
softmax of packedAttentionKernel (base-2 scores, 32-key tiles, a running max and sum,
the output rescaled by each tile's correction) in float32, summing the value terms in
the two orders the kernel has had: "running" (every key's term added to the running
output, library 0.8.0) and "per tile" (each tile's terms summed apart, the tile then
added to the rescaled running output, library 0.9.0). It prints each order's worst
err / bound over random heads. It emulates the order of the sums, not the GPU's exp2f
or its fused multiply-adds, so it compares the orders; it does not stand in for the
attention check on the GPU.

    python3 scripts/attention_fp32_sum_order.py [--heads 8] [--keys 4096] [--seed 1]
"""

from __future__ import annotations

import argparse

import numpy as np

TILE = 32  # kAttnTile


def emulate(q: np.ndarray, keys: np.ndarray, values: np.ndarray, per_tile: bool) -> np.ndarray:
    """One head's output [hd] in float32, the kernel's tile loop in the given order."""
    hd = q.shape[0]
    scores = keys @ (q * np.float32(np.log2(np.e) / np.sqrt(hd)))  # the scale folded into q, log2 units
    acc = np.zeros(hd, np.float32)
    run_max, run_sum = np.float32(-np.inf), np.float32(0.0)
    for k0 in range(0, keys.shape[0], TILE):
        s = scores[k0 : k0 + TILE]
        new_max = np.float32(max(run_max, s.max()))
        corr = np.float32(0.0) if run_max == -np.inf else np.float32(np.exp2(run_max - new_max))
        prob = np.exp2(s - new_max).astype(np.float32)
        run_sum = np.float32(run_sum * corr + prob.sum(dtype=np.float32))
        run_max = new_max
        if per_tile:
            tile = np.zeros(hd, np.float32)
            for j, p in enumerate(prob):
                tile = tile + p * values[k0 + j]
            acc = acc * corr + tile
        else:
            acc = acc * corr
            for j, p in enumerate(prob):
                acc = acc + p * values[k0 + j]
    return acc / run_sum


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, default=8, help="random heads to emulate (default: %(default)s)")
    ap.add_argument("--keys", type=int, default=4096, help="keys per head (default: %(default)s)")
    ap.add_argument("--head-dim", type=int, default=128, help="head dimension (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    worst = {"running": 0.0, "per tile": 0.0}
    for _ in range(args.heads):
        q = rng.standard_normal(args.head_dim).astype(np.float32)
        keys = rng.standard_normal((args.keys, args.head_dim)).astype(np.float32)
        values = rng.standard_normal((args.keys, args.head_dim)).astype(np.float32)
        s64 = keys.astype(np.float64) @ q.astype(np.float64) / np.sqrt(args.head_dim)
        p64 = np.exp(s64 - s64.max())
        ref = p64 @ values.astype(np.float64) / p64.sum()
        bound = 2e-6 * np.abs(ref).max() + 2e-6 * np.abs(ref)  # the attention check's fp32 bound
        for name, per_tile in (("running", False), ("per tile", True)):
            err = np.abs(emulate(q, keys, values, per_tile).astype(np.float64) - ref)
            worst[name] = max(worst[name], float((err / bound).max()))
    for name, w in worst.items():
        print(f"{name:>9}: worst err / bound {w:.3f} over {args.heads} heads of {args.keys} keys")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
