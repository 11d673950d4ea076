#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Microbenchmark of the stored-format kernels (plugins/kernels/quantKernels.h) on one GPU,
each figure against a floor measured in the same process:

  copy     the HBM copy rate: a device-to-device copy of 2 GiB (bytes read + written per
           second), the floor of every memory-bound figure;
  gemv     engram_quant_gemv for decode shapes (N x K = 7168x2048, 2048x7168, 1536x7168,
           4096x1024, 4096x4096) with BF16, FP8 and FP4 weights of the same logical shape,
           1 / 2 / 4 / 8 rows: GB/s of weight bytes and time / (bytes / copy rate), ordinary
           and with weight_static (its first weight loads issued before it waits for the
           call before it); for BF16 torch's F.linear and engram_gemv_bf16 (plain / static)
           beside it; the weights rotate over copies larger than the L2, so every call reads
           HBM;
  variants the GEMV's tuning knobs on the first shape (ENGRAM_TRT_QGEMV_WAVES 1 / 2 / 0,
           ENGRAM_TRT_QGEMV_STAGE=0 for one row), so one run picks the defaults;
  linear   native.quant.linear on decode rows (1 / 2 / 4) for FP8 / FP4 weights of the first
           shape, weight_static: the GEMV quantizing the activations itself (one launch)
           against act_quant + the GEMV (two), both from the bf16 activations;
  experts  the grouped GEMV, 6 of 256 experts (one token) and 4 / 8 / 32 tokens x 6 (batch
           decode: most experts one row, some two or three), expert 2048 x 7168
           (DeepSeek-V3's routed expert shape), FP8 and FP4 (and BF16);
  gemm     engram_fp8_gemm for prefill shapes (M = 512 .. 8192; N x K = 7168x2048,
           2048x7168, 4096x4096) in TFLOP/s, against torch.matmul in bf16 on the same
           shapes (its measured rate the bf16 floor; twice it the FP8 dense floor) and
           torch._scaled_mm (per-tensor FP8, and block-wise 1x128 / 128x128 where this torch
           takes it); native.quant.linear (act quant + the route it picks: torch's block-wise
           _scaled_mm where scaled_mm_reason allows, else ours) with the route named and its
           output against engram_fp8_gemm's; engram_quant_grouped_gemm with FP4 and BF16
           weights beside.

Timings are CUDA-graph replays of many calls (the launch cost of a ctypes call would hide
a 5 us kernel), medians of several replays. One process, one command:

    python benchmarks/kernels/bench_quant.py --json $OUT/bench_quant.json [--quick]

The kernel library is the one engram_trt finds ($ENGRAM_TRT_PLUGIN_LIB, the package's
lib/, build/); if none, it is built for this GPU into build-bench/ first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "python"))

import torch  # noqa: E402

GIB = 1 << 30
L2_ROTATE_BYTES = 256 << 20  # weight copies per shape: at least this many bytes (several L2s)


def ensure_library() -> str:
    from engram_trt.errors import EngramError
    from engram_trt.native import library as kernel_library

    try:
        return str(kernel_library.library_path())
    except EngramError:
        pass
    major, minor = torch.cuda.get_device_capability()
    build = REPO / "build-bench"
    t0 = time.time()
    for cmd in (
        [
            "cmake",
            "-S",
            str(REPO),
            "-B",
            str(build),
            f"-DCMAKE_CUDA_ARCHITECTURES={major}{minor}",
            "-DCMAKE_BUILD_TYPE=Release",
            "-DENGRAM_TRT_BUILD_HARNESS=OFF",
        ]
        + (
            [f"-DTENSORRT_INCLUDE_DIR={REPO / '.device' / 'trt_include'}"]
            if (REPO / ".device" / "trt_include" / "NvInferRuntime.h").is_file()
            else []
        ),
        ["cmake", "--build", str(build), f"-j{os.cpu_count() or 2}"],
    ):
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    lib = build / "libengram_trt_plugins.so"
    os.environ["ENGRAM_TRT_PLUGIN_LIB"] = str(lib)
    print(f"built {lib} in {time.time() - t0:.0f} s", file=sys.stderr)
    return str(lib)


def graph_time_us(call: Callable[[int], Any], calls: int, replays: int = 7) -> float:
    """Median time of one ``call(i)`` (i = 0 .. calls - 1, captured once in a CUDA graph)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(min(calls, 3)):
            call(i)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            call(i)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return statistics.median(times)


def event_time_us(call: Callable[[], Any], iters: int = 10) -> float:
    call()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def copy_rate() -> float:
    """Bytes read + written per second of a 2 GiB device-to-device copy."""
    us = copy_time_us(2 * GIB)
    torch.cuda.empty_cache()  # the buffers of copy_time_us, freed on its return
    return 2 * 2 * GIB / (us * 1e-6)


def copy_time_us(nbytes: int) -> float:
    """Median time of one device-to-device copy of ``nbytes`` (buffers freed on return)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    src.fill_(1)
    return event_time_us(lambda: dst.copy_(src), iters=7)


# --- weights -----------------------------------------------------------------------------------


def make_weight(kind: str, lead: tuple, N: int, K: int) -> Any:
    """Random stored bytes of a ``kind`` weight (FP8: 128x128 float scales; FP4: 1x32 ue8m0;
    BF16) as a QuantWeight or a bf16 tensor; values need no meaning for timing."""
    from engram_trt.quant.weight import QuantWeight

    dev = "cuda"
    if kind == "bf16":
        return (torch.randn(*lead, N, K, device=dev) * 0.02).to(torch.bfloat16)
    if kind == "fp8":
        q = torch.randint(0, 0x7E, (*lead, N, K), dtype=torch.uint8, device=dev)
        q = (q | (torch.randint(0, 2, q.shape, dtype=torch.uint8, device=dev) << 7)).view(torch.float8_e4m3fn)
        s = torch.rand(*lead, -(-N // 128), -(-K // 128), device=dev) * 1e-2 + 1e-3
        return QuantWeight(q, s, "fp8", (128, 128))
    q = torch.randint(-128, 128, (*lead, N, K // 2), dtype=torch.int8, device=dev)
    s = torch.randint(118, 126, (*lead, N, K // 32), dtype=torch.uint8, device=dev).view(torch.float8_e8m0fnu)
    return QuantWeight(q, s, "fp4", (1, 32))


def weight_bytes(w: Any) -> int:
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    return w.nbytes


def kernel_weight(w: Any, stacked: bool):
    from engram_trt.native import quant_kernels as qk

    if isinstance(w, torch.Tensor):
        return qk.make_weight("w", w, None, "bf16", (1, 1), stacked)
    return qk.make_weight("w", w.data, w.scale, w.kind, w.block, stacked)


# --- GEMV --------------------------------------------------------------------------------------


def bench_gemv(rate: float, shapes, rows_list, kinds) -> list[dict]:
    out = []
    for N, K in shapes:
        for kind in kinds:
            out += bench_gemv_weight(rate, N, K, kind, rows_list)
            torch.cuda.empty_cache()  # the weight copies of bench_gemv_weight, freed on its return
    return out


def bench_gemv_weight(rate: float, N: int, K: int, kind: str, rows_list) -> list[dict]:
    """bench_gemv's entries of one N x K ``kind`` weight (its copies freed on return)."""
    from engram_trt.native import backbone
    from engram_trt.native import quant_kernels as qk

    out = []
    one = make_weight(kind, (), N, K)
    nbytes = weight_bytes(one)
    copies = [one] + [make_weight(kind, (), N, K) for _ in range(max(0, L2_ROTATE_BYTES // nbytes))]
    ws = [kernel_weight(w, False) for w in copies]
    for rows in rows_list:
        adt = torch.float32 if kind == "fp8" else torch.bfloat16
        a = torch.randn(rows, K, device="cuda").to(adt)
        y = torch.empty(rows, N, device="cuda", dtype=torch.bfloat16)
        us = graph_time_us(lambda i: qk.gemv(a, ws[i % len(ws)], y), calls=2 * len(ws))
        us_static = graph_time_us(lambda i: qk.gemv(a, ws[i % len(ws)], y, weight_static=True), calls=2 * len(ws))
        floor = nbytes / rate * 1e6
        entry = {
            "kind": kind,
            "N": N,
            "K": K,
            "rows": rows,
            "bytes": nbytes,
            "us": round(us, 2),
            "GBps": round(nbytes / us / 1e3, 1),
            "floor_us": round(floor, 2),
            "x_floor": round(us / floor, 3),
            "static_us": round(us_static, 2),
            "static_GBps": round(nbytes / us_static / 1e3, 1),
            "static_x_floor": round(us_static / floor, 3),
        }
        if kind == "bf16":
            xs = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16)
            t_us = graph_time_us(
                lambda i: torch.nn.functional.linear(xs, copies[i % len(copies)]), calls=2 * len(copies)
            )
            entry["torch_linear_us"] = round(t_us, 2)
            if rows <= backbone.GEMV_MAX_TOKENS:
                for name, static in (("gemv_bf16_us", False), ("gemv_bf16_static_us", True)):
                    entry[name] = round(
                        graph_time_us(
                            lambda i: backbone.gemv(xs, copies[i % len(copies)], out=y, weight_static=static),
                            calls=2 * len(copies),
                        ),
                        2,
                    )
        out.append(entry)
        print(json.dumps(entry), flush=True)
    return out


VARIANTS = [  # (name, environment) of the GEMV's knobs (quantGemvKernel.cu)
    ("waves1", {"ENGRAM_TRT_QGEMV_WAVES": "1"}),
    ("waves2", {"ENGRAM_TRT_QGEMV_WAVES": "2"}),
    ("uncapped", {"ENGRAM_TRT_QGEMV_WAVES": "0"}),
    ("unstaged", {"ENGRAM_TRT_QGEMV_STAGE": "0"}),
]


def bench_variants(rate: float, N: int, K: int, rows_list, kinds) -> list[dict]:
    """The GEMV (weight_static) under each tuning knob of VARIANTS, the environment set
    while the graph is captured (the library reads it at each launch)."""
    out = []
    for kind in kinds:
        out += bench_variants_weight(rate, N, K, kind, rows_list)
        torch.cuda.empty_cache()  # the weight copies of bench_variants_weight, freed on its return
    return out


def bench_variants_weight(rate: float, N: int, K: int, kind: str, rows_list) -> list[dict]:
    """bench_variants' entries of one ``kind`` weight (its copies freed on return)."""
    from engram_trt.native import quant_kernels as qk

    out = []
    one = make_weight(kind, (), N, K)
    nbytes = weight_bytes(one)
    copies = [one] + [make_weight(kind, (), N, K) for _ in range(max(0, L2_ROTATE_BYTES // nbytes))]
    ws = [kernel_weight(w, False) for w in copies]
    floor = nbytes / rate * 1e6
    for rows in rows_list:
        adt = torch.float32 if kind == "fp8" else torch.bfloat16
        a = torch.randn(rows, K, device="cuda").to(adt)
        y = torch.empty(rows, N, device="cuda", dtype=torch.bfloat16)
        entry = {"kind": kind, "N": N, "K": K, "rows": rows, "floor_us": round(floor, 2)}
        for name, env in VARIANTS:
            if name == "unstaged" and rows != 1:
                continue
            saved = {k_: os.environ.get(k_) for k_ in env}
            os.environ.update(env)
            try:
                us = graph_time_us(lambda i: qk.gemv(a, ws[i % len(ws)], y, weight_static=True), calls=2 * len(ws))
            finally:
                for k_, v_ in saved.items():
                    if v_ is None:
                        os.environ.pop(k_, None)
                    else:
                        os.environ[k_] = v_
            entry[name] = {"us": round(us, 2), "x_floor": round(us / floor, 3)}
        out.append(entry)
        print(json.dumps(entry), flush=True)
    return out


def bench_linear_decode(rate: float, N: int, K: int, rows_list, kinds) -> list[dict]:
    """native.quant.linear (the GEMV quantizing x itself) against act_quant + the GEMV."""
    out = []
    for kind in kinds:
        out += bench_linear_decode_weight(rate, N, K, kind, rows_list)
        torch.cuda.empty_cache()  # the weight copies of bench_linear_decode_weight, freed on its return
    return out


def bench_linear_decode_weight(rate: float, N: int, K: int, kind: str, rows_list) -> list[dict]:
    """bench_linear_decode's entries of one ``kind`` weight (its copies freed on return)."""
    from engram_trt.native import quant as nq
    from engram_trt.native import quant_kernels as qk

    out = []
    copies = [make_weight(kind, (), N, K)]
    nbytes = weight_bytes(copies[0])
    copies += [make_weight(kind, (), N, K) for _ in range(max(0, L2_ROTATE_BYTES // nbytes))]
    ws = [kernel_weight(w, False) for w in copies]
    group, ue8m0 = nq.ACT_QUANT[kind]
    floor = nbytes / rate * 1e6
    for rows in rows_list:
        x = torch.randn(rows, K, device="cuda").to(torch.bfloat16)
        y = torch.empty(rows, N, device="cuda", dtype=torch.bfloat16)
        fused = graph_time_us(
            lambda i: nq.linear(x, copies[i % len(copies)], weight_static=True), calls=2 * len(copies)
        )

        def two(i):
            deq = qk.act_quant(x, group, ue8m0, q=False, scale=False, deq_dtype=torch.float32)[2]
            qk.gemv(deq, ws[i % len(ws)], y, weight_static=True)

        two_us = graph_time_us(two, calls=2 * len(copies))
        entry = {
            "kind": kind,
            "N": N,
            "K": K,
            "rows": rows,
            "floor_us": round(floor, 2),
            "linear_us": round(fused, 2),
            "linear_x_floor": round(fused / floor, 3),
            "act_quant_then_gemv_us": round(two_us, 2),
            "two_launch_x_floor": round(two_us / floor, 3),
        }
        out.append(entry)
        print(json.dumps(entry), flush=True)
    return out


def bench_experts(rate: float, kinds, E: int = 256, N: int = 2048, K: int = 7168, k: int = 6) -> list[dict]:
    out = []
    for kind in kinds:
        out += bench_experts_weight(rate, kind, E, N, K, k)
        torch.cuda.empty_cache()  # the expert stack of bench_experts_weight, freed on its return
    return out


def bench_experts_weight(rate: float, kind: str, E: int, N: int, K: int, k: int) -> list[dict]:
    """bench_experts' entries of one ``kind`` expert stack (freed on return)."""
    from engram_trt.native import quant as nq
    from engram_trt.native import quant_kernels as qk

    out = []
    stack = make_weight(kind, (E,), N, K)
    w = kernel_weight(stack, True)
    per_expert = weight_bytes(stack) // E
    for tokens in (1, 4, 8, 32):
        plans, distinct = [], []
        for seed in range(16):
            g = torch.Generator(device="cuda").manual_seed(seed)
            ids = torch.stack([torch.randperm(E, generator=g, device="cuda")[:k] for _ in range(tokens)])
            plans.append(nq.moe_plan(ids.to(torch.int32), E))
            distinct.append(len(set(ids.reshape(-1).tolist())))
        adt = torch.float32 if kind == "fp8" else torch.bfloat16
        a = torch.randn(tokens, K, device="cuda").to(adt)
        y = torch.empty(tokens * k, N, device="cuda", dtype=torch.float32)

        def call(i):
            p = plans[i % len(plans)]
            qk.gemv(a, w, y, row_index=p.row_token, offsets=p.offsets, slot_expert=p.slot_expert)

        us = graph_time_us(call, calls=len(plans) * 2)
        rows_per_expert = tokens * k / statistics.mean(distinct)
        nbytes = statistics.mean(distinct) * per_expert
        floor = nbytes / rate * 1e6
        entry = {
            "kind": kind,
            "experts": E,
            "N": N,
            "K": K,
            "tokens": tokens,
            "top_k": k,
            "active_experts": statistics.mean(distinct),
            "rows_per_expert": round(rows_per_expert, 2),
            "bytes": int(nbytes),
            "us": round(us, 2),
            "GBps": round(nbytes / us / 1e3, 1),
            "floor_us": round(floor, 2),
            "x_floor": round(us / floor, 3),
        }
        out.append(entry)
        print(json.dumps(entry), flush=True)
    return out


# --- GEMM --------------------------------------------------------------------------------------


def scaled_mm_variants(M: int, N: int, K: int) -> dict[str, Callable[[], Any] | str]:
    """torch._scaled_mm forms this torch takes on these shapes (or why not)."""
    fp8 = torch.float8_e4m3fn
    a = torch.randn(M, K, device="cuda").to(fp8)
    b = torch.randn(N, K, device="cuda").to(fp8).t()  # column-major K x N
    out: dict[str, Any] = {}
    one = torch.ones((), device="cuda")
    try:
        torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)
        out["scaled_mm_tensorwise"] = lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)
    except Exception as exc:  # noqa: BLE001 - a torch without the form
        out["scaled_mm_tensorwise"] = f"unsupported: {str(exc).splitlines()[0][:160]}"
    sa = torch.rand(M, -(-K // 128), device="cuda")
    sb = torch.rand(-(-K // 128), -(-N // 128), device="cuda")
    tried = []
    for name, sa_, sb_ in (("outer-major", sa.t().contiguous().t(), sb.t().contiguous().t()), ("row-major", sa, sb)):
        try:
            torch._scaled_mm(a, b, sa_, sb_, out_dtype=torch.bfloat16)
            out["scaled_mm_blockwise"] = lambda s1=sa_, s2=sb_: torch._scaled_mm(a, b, s1, s2, out_dtype=torch.bfloat16)
            break
        except Exception as exc:  # noqa: BLE001
            tried.append(f"{name}: {str(exc).splitlines()[0][:120]}")
    else:
        out["scaled_mm_blockwise"] = "unsupported: " + "; ".join(tried)
    return out


def bench_gemm(Ms, shapes, quick: bool) -> list[dict]:
    out = []
    for N, K in shapes:
        out += bench_gemm_shape(Ms, N, K, quick)
        torch.cuda.empty_cache()  # the weights of bench_gemm_shape, freed on its return
    return out


def bench_gemm_shape(Ms, N: int, K: int, quick: bool) -> list[dict]:
    """bench_gemm's entries of one N x K weight shape (its weights freed on return)."""
    from engram_trt.native import quant_kernels as qk

    out = []
    fp8_qw = make_weight("fp8", (), N, K)
    fp8w = kernel_weight(fp8_qw, False)
    fp4w = kernel_weight(make_weight("fp4", (), N, K), False)
    bfw = make_weight("bf16", (), N, K)
    bfk = kernel_weight(bfw, False)
    for M in Ms:
        flops = 2.0 * M * N * K
        x = torch.randn(M, K, device="cuda")
        q, s, _ = qk.act_quant(x, 128, False)
        xb = x.to(torch.bfloat16)
        y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        iters = 5 if quick else 10
        t = {
            "fp8_gemm": event_time_us(lambda: qk.fp8_gemm(q, s, fp8w, y), iters),
            "fp4_grouped_gemm": event_time_us(lambda: qk.grouped_gemm(xb, fp4w, y), iters),
            "bf16_grouped_gemm": event_time_us(lambda: qk.grouped_gemm(xb, bfk, y), iters),
            "torch_bf16_matmul": event_time_us(lambda: torch.matmul(xb, bfw.t()), iters),
        }
        extra = {}
        for name, fn in scaled_mm_variants(M, N, K).items():
            if callable(fn):
                t[name] = event_time_us(fn, iters)
            else:
                extra[name] = fn
        bf16_rate = flops / (t["torch_bf16_matmul"] * 1e-6)
        entry = {
            "M": M,
            "N": N,
            "K": K,
            "GFLOP": round(flops / 1e9, 2),
            "us": {k_: round(v, 1) for k_, v in t.items()},
            "TFLOPs": {k_: round(flops / (v * 1e-6) / 1e12, 1) for k_, v in t.items()},
            # time / floor: the bf16 floor is torch's bf16 matmul here; the FP8 floor twice its rate
            "x_bf16_floor": {k_: round(v / t["torch_bf16_matmul"], 3) for k_, v in t.items()},
            "x_fp8_floor": {k_: round(v / (flops / (2 * bf16_rate) * 1e6), 3) for k_, v in t.items()},
            **extra,
        }
        # a sanity check of the FP8 GEMM against torch on the dequantized operands
        ref = (q.float() * s.repeat_interleave(128, 1)[:, :K]) @ qk.dequantize(fp8w)[0].t()
        qk.fp8_gemm(q, s, fp8w, y)
        entry["fp8_gemm_rel_err"] = float((y.float() - ref).norm() / ref.norm())
        # native.quant.linear: act quant + the route it picks (torch's block-wise _scaled_mm or ours)
        from engram_trt.native import quant as nq

        qw = fp8_qw
        reason = nq.scaled_mm_reason(fp8w, x.device, torch.bfloat16)
        entry["linear_route"] = "torch._scaled_mm" if reason is None else f"engram_fp8_gemm ({reason})"
        t_lin = event_time_us(lambda: nq.linear(xb, qw), iters)
        entry["us"]["linear_fp8"] = round(t_lin, 1)
        entry["TFLOPs"]["linear_fp8"] = round(flops / (t_lin * 1e-6) / 1e12, 1)
        yl = nq.linear(xb, qw)
        reason = nq.scaled_mm_reason(fp8w, x.device, torch.bfloat16)  # a refusal seen in the call is recorded
        entry["linear_route_after"] = "torch._scaled_mm" if reason is None else f"engram_fp8_gemm ({reason})"
        qb, sb, _ = qk.act_quant(xb, 128, False)  # linear's own activations, through our GEMM
        qk.fp8_gemm(qb, sb, fp8w, y)
        entry["linear_vs_fp8_gemm_rel_err"] = float((yl.float() - y.float()).norm() / y.float().norm())
        out.append(entry)
        print(json.dumps(entry), flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(
        description="Microbenchmark of the FP8 / FP4 / BF16 stored-format kernels (quantKernels.h)."
    )
    ap.add_argument("--json", type=Path, help="write the summary here")
    ap.add_argument("--quick", action="store_true", help="fewer shapes (about a minute)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_quant: error: no CUDA device", file=sys.stderr)
        return 2
    lib = ensure_library()
    t0 = time.time()
    rate = copy_rate()
    print(json.dumps({"copy_GBps": round(rate / 1e9, 1)}), flush=True)
    cap = torch.cuda.get_device_capability()
    shapes = [(7168, 2048), (2048, 7168), (1536, 7168), (4096, 1024), (4096, 4096)]
    gemm_shapes = [(7168, 2048), (2048, 7168), (4096, 4096)]
    Ms = [512, 1024, 2048, 4096, 8192]
    if args.quick:
        shapes, gemm_shapes, Ms = shapes[:2], gemm_shapes[:1], [512, 4096]
    summary: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "capability": f"{cap[0]}.{cap[1]}",
        "torch": torch.__version__,
        "library": lib,
        "copy_GBps": round(rate / 1e9, 1),
        "gemv": bench_gemv(rate, shapes, [1, 2, 4, 8], ["bf16", "fp8", "fp4"]),
        "variants": bench_variants(rate, *shapes[0], [1, 4], ["bf16", "fp8", "fp4"]),
        "linear_decode": bench_linear_decode(rate, *shapes[0], [1, 2, 4], ["fp8", "fp4"]),
        "experts_gemv": bench_experts(rate, ["fp8", "fp4"] if args.quick else ["bf16", "fp8", "fp4"]),
    }
    if cap >= (8, 9):
        summary["gemm"] = bench_gemm(Ms, gemm_shapes, args.quick)
    else:
        summary["gemm"] = f"skipped: the FP8 tensor cores need compute capability 8.9+ (this GPU is {cap[0]}.{cap[1]})"
    summary["seconds"] = round(time.time() - t0, 1)
    text = json.dumps(summary, indent=1)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.json.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
