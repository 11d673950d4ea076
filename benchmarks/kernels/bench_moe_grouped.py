#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""``python benchmarks/kernels/bench_moe_grouped.py``: one MoE layer of a batch decode step
(the DeepSeek-V4 bench shape by default: hidden 2048, 8 routed experts, top 2, intermediate
1024, a shared expert of 1024) at 8-64 tokens, three ways, each after ``moe_route`` on the
same logits:

* ``grouped``: ``native.decode.moe_experts_grouped`` (the routed and shared experts, each
  picked expert's weights read once a step; ``ENGRAM_TRT_DSV4_MOE_GROUPED=1``'s path);
* ``current``: the 9-64-token path before it, ``native.quant.experts`` (a plan, the tile
  GEMMs, a reduce) plus the shared expert as its module (three ``F.linear``);
* ``slices``: ``native.decode.moe_experts`` on 16-token slices (each expert read once per
  (token, pick)).

Each as microseconds (CUDA events around graph replays; a replay runs ``--calls`` layers, the
weights rotated over ``--copies`` copies so no call finds its experts in the L2) and as a
ratio to the floor: the bytes of the step's active experts' weights (and the shared expert's)
read once, at the HBM copy rate measured in the same run. Also whether ``grouped`` gave
``slices``' outputs bit for bit (the kernels' contract).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# engram_trt from this checkout and this folder's modules:
sys.path[:0] = [p for p in (str(REPO / "python"), str(Path(__file__).resolve().parent)) if p not in sys.path]

from dataclasses import dataclass  # noqa: E402
from typing import Any  # noqa: E402

from engram_trt.bench.options import opt  # noqa: E402

WAYS = ("grouped", "current", "slices")


@dataclass(kw_only=True)
class MoeGroupedOptions:
    """``python benchmarks/kernels/bench_moe_grouped.py``'s flags."""

    tokens: list[int] = opt([8, 16, 32, 64], help="tokens per step, each in 1..64 (default: 8,16,32,64)")
    hidden: int = opt(2048, help="hidden size D (default: %(default)s)")
    experts: int = opt(8, help="routed experts E (default: %(default)s)")
    top_k: int = opt(2, help="picks per token (default: %(default)s)")
    intermediate: int = opt(1024, help="a routed expert's intermediate size I (default: %(default)s)")
    shared_intermediate: int = opt(1024, help="the shared expert's intermediate size (0: none; default: %(default)s)")
    limit: float = opt(10.0, help="the SwiGLU clamp (default: %(default)s)")
    ways: list[str] = opt(list(WAYS), choices=list(WAYS), help=f"what to time, of {','.join(WAYS)} (default: all)")
    copies: int = opt(2, help="weight copies the calls rotate over (default: %(default)s; > L2 each)")
    calls: int = opt(8, help="layers per graph replay (default: %(default)s)")
    iters: int = opt(20, help="timed replays per case (median; default: %(default)s)")
    seed: int = opt(0, help="the weights', inputs' and router logits' seed (default: %(default)s)")
    json: str | None = opt(None, metavar="FILE", help="write all figures as JSON to FILE")


def _check(opts: MoeGroupedOptions) -> None:
    from engram_trt.errors import EngramError
    from engram_trt.native import decode

    if not all(1 <= t <= decode.MOE_GROUPED_MAX_TOKENS for t in opts.tokens):
        raise EngramError(f"--tokens: each must be in 1..{decode.MOE_GROUPED_MAX_TOKENS} (got {opts.tokens})")
    if min(opts.hidden, opts.intermediate) < 8 or (opts.hidden | opts.intermediate | opts.shared_intermediate) % 8:
        raise EngramError(
            "--hidden and --intermediate must be positive multiples of 8, --shared-intermediate a multiple of 8 "
            f"(got {opts.hidden}, {opts.intermediate}, {opts.shared_intermediate})"
        )
    if not 1 <= opts.top_k <= min(opts.experts, decode.MOE_MAX_TOP_K):
        raise EngramError(f"--top-k must be in 1..min(--experts, {decode.MOE_MAX_TOP_K}) (got {opts.top_k})")
    if min(opts.copies, opts.calls, opts.iters) < 1 or not opts.limit > 0:
        raise EngramError("--copies, --calls and --iters must be >= 1 and --limit > 0")


def _replay_us(body: Any, calls: int, iters: int, device: Any) -> float:
    """Median microseconds per call of ``body(i)`` for i in 0..calls-1, replayed from one CUDA
    graph and timed with CUDA events."""
    from engram_trt.bench.common import capture_graph, event_seconds

    graph, _ = capture_graph(lambda: [body(i) for i in range(calls)], device)
    for _ in range(2):  # warm-up replays (event_seconds replays once more before timing)
        graph.replay()
    return event_seconds(graph.replay, iters) * 1e6 / calls


def run(opts: MoeGroupedOptions) -> int:
    import torch
    import torch.nn.functional as F

    from engram_trt.bench.common import dump, measure_limits
    from engram_trt.errors import EngramError
    from engram_trt.native import decode
    from engram_trt.native import quant as native_quant

    _check(opts)  # bad values before any GPU work
    if not torch.cuda.is_available():
        raise EngramError("bench moe-grouped needs a CUDA GPU (it times GPU kernels); none is available here")
    device = torch.device("cuda", torch.cuda.current_device())
    major, minor = torch.cuda.get_device_capability(device)
    if major < decode.MIN_CAPABILITY:
        raise EngramError(
            f"the decode MoE kernels are built for compute capability 9.0 and later; this GPU is {major}.{minor}"
        )
    why = decode.unavailable("the decode MoE kernels")
    if why is not None:
        raise EngramError(f"the kernel library cannot serve the decode MoE kernels: {why}")
    D, E, k, I, Is, lim = (
        opts.hidden,
        opts.experts,
        opts.top_k,
        opts.intermediate,
        opts.shared_intermediate,
        opts.limit,
    )
    limits = measure_limits(device)
    hbm = limits["hbm_GBps"]
    gen = torch.Generator(device=device).manual_seed(opts.seed)

    def randn(*shape: int, scale: float) -> Any:
        return (torch.randn(*shape, device=device, generator=gen) * scale).to(torch.bfloat16)

    layers = []
    for _ in range(opts.copies):
        layer = {
            "gate": randn(E, I, D, scale=3 * D**-0.5),
            "up": randn(E, I, D, scale=3 * D**-0.5),
            "down": randn(E, D, I, scale=I**-0.5),
            "shared": (randn(Is, D, scale=3 * D**-0.5), randn(Is, D, scale=3 * D**-0.5), randn(D, Is, scale=Is**-0.5))
            if Is
            else None,
        }
        layers.append(layer)
    expert_bytes, shared_bytes = 3 * I * D * 2, 3 * Is * D * 2
    print(
        f"device {torch.cuda.get_device_name(device)}; HBM copy {hbm:.0f} GB/s (read + written; the floor's rate); "
        f"layer D {D}, {E} experts top {k}, I {I}, shared {Is}: {expert_bytes / 1e6:.1f} MB an expert; "
        f"{opts.calls} layers a replay over {opts.copies} weight copies"
    )
    print(
        f"{'T':>3} {'active':>6} | {'floor us':>8} | "
        + " | ".join(f"{w + ' us':>11} {'x floor':>7}" for w in opts.ways)
    )
    rows: list[dict[str, Any]] = []
    bias = torch.zeros(E, device=device)
    for T in opts.tokens:
        x = randn(T, D, scale=1.0)
        logits = randn(T, E, scale=1.0)
        ids, weights = decode.moe_route(logits, top_k=k, score_fn="sqrtsoftplus", scaling=1.5, bias=bias)
        active = int(torch.unique(ids[(ids >= 0) & (ids < E)]).numel())
        floor_us = (active * expert_bytes + shared_bytes) / (hbm * 1e9) * 1e6

        def route() -> tuple[Any, Any]:
            return decode.moe_route(logits, top_k=k, score_fn="sqrtsoftplus", scaling=1.5, bias=bias)

        def grouped(i: int) -> Any:
            L = layers[i % opts.copies]
            r_ids, r_w = route()
            return decode.moe_experts_grouped(
                x, r_ids, r_w, L["gate"], L["up"], L["down"], shared=L["shared"], limit=lim
            )

        def current(i: int) -> Any:
            L = layers[i % opts.copies]
            r_ids, r_w = route()
            out = native_quant.experts(x, r_ids, r_w, L["gate"], L["up"], L["down"], limit=lim)
            if L["shared"] is not None:  # the shared expert as its module (ClampedSwiGLU.forward)
                sg, su, sd = L["shared"]
                h = F.silu(F.linear(x, sg).clamp(max=lim)) * F.linear(x, su).clamp(min=-lim, max=lim)
                out = out + F.linear(h, sd)
            return out

        def slices(i: int) -> Any:
            L = layers[i % opts.copies]
            r_ids, r_w = route()
            step = decode.MOE_MAX_TOKENS
            return torch.cat(
                [
                    decode.moe_experts(
                        x[s : s + step],
                        r_ids[s : s + step],
                        r_w[s : s + step],
                        L["gate"],
                        L["up"],
                        L["down"],
                        shared=L["shared"],
                        limit=lim,
                    )
                    for s in range(0, T, step)
                ]
            )

        bodies = {"grouped": grouped, "current": current, "slices": slices}
        row: dict[str, Any] = {"tokens": T, "active_experts": active, "floor_us": floor_us}
        for way in opts.ways:
            row[f"{way}_us"] = _replay_us(bodies[way], opts.calls, opts.iters, device)
            row[f"{way}_x_floor"] = row[f"{way}_us"] / floor_us
        row["route_us"] = _replay_us(lambda i: route(), opts.calls, opts.iters, device)
        with torch.no_grad():
            row["grouped_bit_equal_slices"] = bool(torch.equal(grouped(0), slices(0)))
        torch.cuda.synchronize()
        rows.append(row)
        print(
            f"{T:>3} {active:>6} | {floor_us:8.1f} | "
            + " | ".join(f"{row[f'{w}_us']:11.1f} {row[f'{w}_x_floor']:7.2f}" for w in opts.ways)
            + f"   (route {row['route_us']:.1f} us; grouped = slices bit for bit: {row['grouped_bit_equal_slices']})"
        )
    print(
        "floor: the step's active experts' weights (gate, up, down) and the shared expert's read once at the HBM copy "
        "rate above; x floor = time / floor; each way's time includes moe_route's launch"
    )
    dump(
        {"limits": limits, "rows": rows, "options": {k_: getattr(opts, k_) for k_ in opts.__dataclass_fields__}},
        opts.json,
    )
    return 0


OPTIONS = MoeGroupedOptions  # the script's flags, derived as an `engram-trt bench` command's (engram_trt.cli.bench)


def main(argv: list[str] | None = None) -> int:
    from engram_trt.cli.bench import run_script

    return run_script(OPTIONS, run, __doc__ or "", argv, prog=Path(__file__).name)


if __name__ == "__main__":
    sys.exit(main())
