"""The fast paths of the stored-format products on a GPU, against the same float64
references and bounds as tests/gpu/test_quant_kernels.py (whose helpers this module uses):

  gemv knobs     engram_quant_gemv under each tuning knob the library reads at a launch
                 (ENGRAM_TRT_QGEMV_WAVES 1 / 2 / 0: the grid capped at that many waves of
                 resident blocks, warps looping over weight-row groups; ENGRAM_TRT_QGEMV_STAGE=0:
                 one-row passes read the activations from global memory) and with
                 weight_static (engram_quant_gemv_ex, ENGRAM_QGEMV_WEIGHT_STATIC): FP8 with
                 float / ue8m0 scales and blocks whose divisors are not powers of two (bk 48,
                 bn 96), FP4, BF16; rows 1 .. 13 (passes); K long enough for several steps a
                 group and for K that the shared memory cannot stage (K = 65,536: the unstaged
                 path; K = 16,384 with 8 rows: passes of fewer rows);
  experts        the grouped GEMV with many slots (batch decode: 32 tokens x 6 of 64 experts,
                 most experts one row, some several) under the same knobs;
  fused quant    ENGRAM_QGEMV_ACT_Q128_F32 / _Q32_UE8M0 (gemv(act_quant=...)): the GEMV quantizing
                 the raw activations itself = act_quant's float32 deq then the GEMV, bit for bit
                 (FP8 with partial groups, FP4; float32 / bf16 x; row_index; experts); a K
                 whose row does not fit the shared memory refused in one line; linear and
                 experts (which take it on decode rows) = the two-launch path bit for bit;
  the GEMV's bound is gemv_bound (every product passes VPV + ceil(K / (32 VPV)) + 7 float32
                 roundings, then the output's): the kernel's sums have that depth whatever
                 the grid (a lane's chain, the block scale's FMA, its vectors, 5 levels over
                 the warp);
  FP8 GEMM route native.quant.linear's GEMM rows with N, K multiples of 128 go to
                 torch._scaled_mm with block-wise scales where scaled_mm_reason allows:
                 against float64 of the quantized activations with the FP8 GEMM's bound
                 (fp8_gemm_bound: per 128-column block the tensor cores' accumulation model,
                 12 kept bits per 32-product step, then the float32 promotion's (KB + 2) u S
                 and the output rounding) -- torch's kernel computes the same block-wise sum;
                 ENGRAM_TRT_FP8_GEMM=ours takes engram_fp8_gemm; ue8m0 and float32 scales;
  graphs         a CUDA graph of weight_static GEMVs replayed = eager, bit for bit.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from .helpers import note
from .test_quant_kernels import (
    U32,
    _assert_within,
    _expert_of_rows,
    _grouped_rows,
    _qweight,
    _weight64,
    _weight_case,
    fp8_gemm_bound,
    fp8_tensor_core_error,
    gemv_bound,
    linear_activations,
    linear_reference,
)

KNOBS = [  # (name, environment) the library reads at each launch
    ("default", {}),
    ("waves2", {"ENGRAM_TRT_QGEMV_WAVES": "2"}),
    ("uncapped", {"ENGRAM_TRT_QGEMV_WAVES": "0"}),
    ("unstaged", {"ENGRAM_TRT_QGEMV_STAGE": "0"}),
]


def _t():
    import torch

    return torch


class _env:
    """Environment variables set for a block (restored after)."""

    def __init__(self, values: dict[str, str]) -> None:
        self.values = values
        self.saved: dict[str, str | None] = {}

    def __enter__(self) -> None:
        for k, v in self.values.items():
            self.saved[k] = os.environ.get(k)
            os.environ[k] = v

    def __exit__(self, *exc) -> None:
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


FAST_GEMV_WEIGHTS = [  # (kind, N, K, block, scale fmt, rows)
    ("fp8", 300, 2048, (128, 128), "float", (1, 2, 3, 5, 8, 13)),
    ("fp8", 77, 4800, (96, 48), "ue8m0", (1, 4)),  # divisors not powers of two, several steps
    ("fp8", 40, 65536, (128, 128), "ue8m0", (1, 3)),  # one row does not fit the shared memory
    ("fp8", 24, 16384, (128, 128), "float", (8,)),  # 8 rows do not: passes of fewer
    ("fp4", 257, 7168, (1, 32), "ue8m0", (1, 2, 4, 8)),
    ("fp4", 33, 1024, (64, 64), "ue8m0", (1, 6)),
    ("bf16", 129, 2056, None, None, (1, 2, 4, 8)),
]


@pytest.mark.parametrize("wi", range(len(FAST_GEMV_WEIGHTS)))
def test_gemv_knobs_and_weight_static(gen, dev, wi) -> None:
    from engram_trt.native import quant_kernels as qk

    torch = _t()
    kind, N, K, block, fmt, rows_list = FAST_GEMV_WEIGHTS[wi]
    qw = _weight_case(gen, dev, kind, (), N, K, block, fmt)
    w = _qweight(qw, False) if kind != "bf16" else qk.make_weight("w", qw, None, "bf16", (1, 1), False)
    W = _weight64(qw)[0]
    for rows in rows_list:
        for ai, adt in enumerate(("float32", "bfloat16")):
            a = (torch.randn(rows + 2, K, generator=gen, device=dev) * 2).to(getattr(torch, adt))
            row_index = torch.randperm(rows + 2, generator=gen, device=dev)[:rows].to(torch.int32)
            ad = a.double()[row_index.long()]
            ref, mag = ad @ W.t(), ad.abs() @ W.abs().t()
            odt = (torch.float32, torch.bfloat16)[(rows + ai) % 2]
            bound = gemv_bound(kind, K, ref, mag, odt)
            outs = {}
            for name, env in KNOBS:
                if name == "unstaged" and rows != 1:
                    continue
                for static in (False, True):
                    out = torch.full((rows, N + 8), float("nan"), device=dev, dtype=odt)
                    with _env(env):
                        qk.gemv(a, w, out, row_index=row_index, o_col0=5, weight_static=static)
                    tag = f"{kind} [{N}, {K}] block {block} {fmt}, {rows} rows, a {adt}, {name}, static {static}"
                    _assert_within(f"gemv = float64, {tag}", out[:, 5 : 5 + N], ref, bound)
                    outside = torch.cat([out[:, :5], out[:, 5 + N :]], dim=1)
                    assert bool(torch.isnan(outside.float()).all()), f"gemv leaves the other columns, {tag}"
                    outs[(name, static)] = out[:, 5 : 5 + N]
            base = outs[("default", False)]
            same = all(torch.equal(o, base) for o in outs.values())
            assert same, (
                f"gemv: every knob and weight_static give the same bits, {kind} [{N}, {K}] {rows} rows {adt}: "
                "the knobs change the grid, not the sums: outputs must be equal"
            )


@pytest.mark.parametrize("kind,fmt", [("fp8", "ue8m0"), ("fp4", "ue8m0"), ("bf16", None)])
def test_gemv_experts_batch_decode(gen, dev, kind, fmt) -> None:
    from engram_trt.native import quant as nq
    from engram_trt.native import quant_kernels as qk

    torch = _t()
    rng = np.random.default_rng(23)
    E, T, k = 64, 32, 6
    N, K = (160, 1024) if kind != "bf16" else (96, 512)
    qw = _weight_case(gen, dev, kind, (E,), N, K, None, fmt)
    w = _qweight(qw, True) if kind != "bf16" else qk.make_weight("w", qw, None, "bf16", (1, 1), True)
    W = _weight64(qw)
    ids = torch.from_numpy(np.stack([rng.choice(E, size=k, replace=False) for _ in range(T)])).to(dev, torch.int32)
    plan = nq.moe_plan(ids, E)
    offsets = plan.offsets.cpu().numpy()
    row_index = plan.row_token
    a = torch.randn(T, K, generator=gen, device=dev) * 3
    experts = torch.from_numpy(_expert_of_rows(offsets)).to(dev)
    ad = a.double()[row_index.long()]
    Wr = W[experts]
    ref = torch.einsum("pk,pnk->pn", ad, Wr)
    mag = torch.einsum("pk,pnk->pn", ad.abs(), Wr.abs())
    counts = np.diff(offsets)
    note(
        f"batch decode {kind}: experts with 1 / 2 / 3+ rows",
        [int((counts == 1).sum()), int((counts == 2).sum()), int((counts >= 3).sum())],
    )
    outs = []
    for name, env in KNOBS[:3]:
        out = torch.full((T * k, N), float("nan"), device=dev)
        with _env(env):
            qk.gemv(a, w, out, row_index=row_index, offsets=plan.offsets, slot_expert=plan.slot_expert)
        _assert_within(
            f"grouped gemv = float64, {kind} {fmt}, {T} tokens x {k} of {E} experts, {name}",
            out,
            ref,
            gemv_bound(kind, K, ref, mag, out.dtype),
        )
        outs.append(out)
    assert all(torch.equal(o, outs[0]) for o in outs), f"grouped gemv: the knobs give the same bits, {kind}"
    # the uneven loads of the kernel tests, with many slots and a slot list longer than the active experts
    counts = [3, 0, 1, 1, 0, 7, 2, 1, 1, 9, 0, 1]
    offs, ri, slot_expert = _grouped_rows(rng, 12, counts)
    slot_expert = np.concatenate([slot_expert, np.full(5, -1, dtype=np.int32)])
    qw2 = _weight_case(gen, dev, kind, (len(counts),), N, K, None, fmt)
    w2 = _qweight(qw2, True) if kind != "bf16" else qk.make_weight("w", qw2, None, "bf16", (1, 1), True)
    a2 = torch.randn(12, K, generator=gen, device=dev) * 3
    P = int(offs[-1])
    ad2 = a2.double()[torch.from_numpy(ri).long().to(dev)]
    Wr2 = _weight64(qw2)[torch.from_numpy(_expert_of_rows(offs)).to(dev)]
    ref2 = torch.einsum("pk,pnk->pn", ad2, Wr2)
    mag2 = torch.einsum("pk,pnk->pn", ad2.abs(), Wr2.abs())
    for name, env in KNOBS[:3]:
        out = torch.full((P, N), float("nan"), device=dev)
        with _env(env):
            qk.gemv(
                a2,
                w2,
                out,
                row_index=torch.from_numpy(ri).to(dev),
                offsets=torch.from_numpy(offs).to(dev),
                slot_expert=torch.from_numpy(slot_expert).to(dev),
            )
        _assert_within(
            f"grouped gemv = float64, {kind}, uneven rows {counts}, {name}",
            out,
            ref2,
            gemv_bound(kind, K, ref2, mag2, out.dtype),
        )


FUSED_CASES = [  # (kind, N, K, block, scale fmt, rows)
    ("fp8", 200, 336, (128, 128), "float", (1, 3, 8)),  # a partial last group of 80 columns
    ("fp8", 300, 7168, (128, 128), "ue8m0", (1, 2, 5)),
    ("fp4", 257, 2048, (1, 32), "ue8m0", (1, 4, 8)),
    ("fp4", 64, 16384, (1, 32), "ue8m0", (1, 3)),  # the largest K the fused path promises
]


@pytest.mark.parametrize("ci", range(len(FUSED_CASES)))
def test_gemv_fused_act_quant(gen, dev, ci) -> None:
    from engram_trt.native import quant as nq
    from engram_trt.native import quant_kernels as qk

    torch = _t()
    kind, N, K, block, fmt, rows_list = FUSED_CASES[ci]
    qw = _weight_case(gen, dev, kind, (), N, K, block, fmt)
    w = _qweight(qw, False)
    group, ue8m0 = nq.ACT_QUANT[kind]
    for rows in rows_list:
        for xdt in ("float32", "bfloat16"):
            base = torch.randn(rows + 3, K, generator=gen, device=dev) * torch.exp(
                2 * torch.randn(rows + 3, 1, generator=gen, device=dev)
            )
            if rows > 2:
                base[1] = 0.0  # the amax floor
            x = base.to(getattr(torch, xdt))
            row_index = torch.randperm(rows + 3, generator=gen, device=dev)[:rows].to(torch.int32)
            deq = qk.act_quant(x, group, ue8m0, q=False, scale=False, deq_dtype=torch.float32)[2]
            want = torch.full((rows, N + 6), float("nan"), device=dev)
            qk.gemv(deq, w, want, row_index=row_index, o_col0=3)
            for static in (False, True):
                got = torch.full((rows, N + 6), float("nan"), device=dev)
                qk.gemv(x, w, got, row_index=row_index, o_col0=3, act_quant=(group, ue8m0), weight_static=static)
                tag = f"{kind} [{N}, {K}] {fmt}, {rows} rows, x {xdt}, static {static}"
                same = torch.equal(got[:, 3 : 3 + N], want[:, 3 : 3 + N])
                assert same, (
                    f"gemv quantizing x itself = act_quant then gemv, bit for bit, {tag}: "
                    f"{int((got[:, 3 : 3 + N] != want[:, 3 : 3 + N]).sum())} differ"
                )
                outside = torch.cat([got[:, :3], got[:, 3 + N :]], dim=1)
                assert bool(torch.isnan(outside).all()), f"gemv quantizing x leaves the other columns, {tag}"


def test_gemv_fused_act_quant_experts_and_refusal(gen, dev) -> None:
    from engram_trt.errors import EngramError
    from engram_trt.native import quant as nq
    from engram_trt.native import quant_kernels as qk

    torch = _t()
    rng = np.random.default_rng(31)
    for kind in ("fp8", "fp4"):
        E, T, k, N, K = 32, 8, 6, 96, 1024
        qw = _weight_case(gen, dev, kind, (E,), N, K, None, "ue8m0")
        w = _qweight(qw, True)
        ids = torch.from_numpy(np.stack([rng.choice(E, size=k, replace=False) for _ in range(T)])).to(dev, torch.int32)
        plan = nq.moe_plan(ids, E)
        x = (torch.randn(T, K, generator=gen, device=dev) * 3).to(torch.bfloat16)
        group, ue8m0 = nq.ACT_QUANT[kind]
        deq = qk.act_quant(x, group, ue8m0, q=False, scale=False, deq_dtype=torch.float32)[2]
        rows = {"row_index": plan.row_token, "offsets": plan.offsets, "slot_expert": plan.slot_expert}
        want = torch.zeros((T * k, N), device=dev)
        got = torch.zeros((T * k, N), device=dev)
        qk.gemv(deq, w, want, **rows)
        qk.gemv(x, w, got, act_quant=(group, ue8m0), **rows)
        assert torch.equal(got, want), f"grouped gemv quantizing x itself = act_quant then gemv, bit for bit, {kind}"
    # a row the shared memory cannot stage: refused in one line, nothing launched
    qw = _weight_case(gen, dev, "fp8", (), 16, 65536, (128, 128), "float")
    out = torch.full((1, 16), float("nan"), device=dev)
    try:
        qk.gemv(torch.randn(1, 65536, generator=gen, device=dev), _qweight(qw, False), out, act_quant=(128, False))
        ok, detail = False, "no error"
    except EngramError as exc:
        ok, detail = "quantize them first" in str(exc) and "\n" not in str(exc), str(exc)
    assert ok and bool(torch.isnan(out).all()), (
        f"gemv quantizing x refuses K = 65536 (one line) and leaves out: {detail}"
    )
    # linear on a K that large still runs (act_quant first, then the GEMV)
    x = torch.randn(2, 65536, generator=gen, device=dev)
    y = nq.linear(x, qw)
    ref, mag = linear_reference(x, qw)
    _assert_within(
        "linear with K = 65536 (two launches) = float64",
        y.cpu(),
        ref,
        (gemv_bound("fp8", 65536, ref, mag, y.dtype) + U32 * mag).cpu(),
    )


def test_linear_and_experts_fused_equal_two_launches(gen, dev) -> None:
    """linear / experts on decode rows take the fused quantization: their outputs equal the
    two-launch computation (act_quant, then the GEMV) bit for bit."""
    from engram_trt.native import quant as nq
    from engram_trt.native import quant_kernels as qk

    torch = _t()
    for kind, N, K in (("fp8", 384, 1024), ("fp4", 256, 512)):
        qw = _weight_case(gen, dev, kind, (), N, K, (128, 128) if kind == "fp8" else (1, 32), "float")
        w = _qweight(qw, False)
        group, ue8m0 = nq.ACT_QUANT[kind]
        for M in (1, 3, 8):
            for xdt in (torch.bfloat16, torch.float32):
                x = (torch.randn(M, K, generator=gen, device=dev) * 2).to(xdt)
                y = nq.linear(x, qw)
                deq = qk.act_quant(x, group, ue8m0, q=False, scale=False, deq_dtype=torch.float32)[2]
                want = torch.empty((M, N), device=dev, dtype=xdt)
                qk.gemv(deq, w, want)
                assert torch.equal(y, want), (
                    f"linear (fused quantization) = act_quant + gemv, bit for bit, {kind} {M} rows {xdt}: "
                )
    E, D, I, k, T = 8, 256, 128, 4, 3
    for kind in ("fp8", "fp4"):
        block = (128, 128) if kind == "fp8" else (1, 32)
        gate, up = (_weight_case(gen, dev, kind, (E,), I, D, block, "float") for _ in range(2))
        down = _weight_case(gen, dev, kind, (E,), D, I, block, "float")
        x = torch.randn(T, D, generator=gen, device=dev).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(E, generator=gen, device=dev)[:k] for _ in range(T)]).to(torch.int32)
        route_w = torch.rand(T, k, generator=gen, device=dev)
        y = nq.experts(x, ids, route_w, gate, up, down, limit=7.0)
        # the two-launch path: quantize x first (a view the GEMV cannot quantize itself would take it too)
        plan = nq.moe_plan(ids, E)
        g, u = _qweight(gate, True), _qweight(up, True)
        group, ue8m0 = nq.ACT_QUANT[kind]
        deq = qk.act_quant(
            x, group, ue8m0, q=False, scale=False, deq_dtype=torch.float32 if kind == "fp8" else torch.bfloat16
        )[2]
        gu = torch.empty((T * k, 2 * I), device=dev)
        rows = {"row_index": plan.row_token, "offsets": plan.offsets, "slot_expert": plan.slot_expert}
        qk.gemv(deq, g, gu[:, :I], **rows)
        qk.gemv(deq, u, gu[:, I:], **rows)
        dg, dug = (
            qk.gemv(x, wq, torch.empty((T * k, I), device=dev), act_quant=(group, ue8m0), **rows) for wq in (g, u)
        )
        assert torch.equal(dg, gu[:, :I]) and torch.equal(dug, gu[:, I:]), (
            f"experts gate / up (fused quantization) = act_quant + gemv, bit for bit, {kind}: "
        )
        again = nq.experts(x, ids, route_w, gate, up, down, limit=7.0)
        assert torch.equal(y, again), f"experts deterministic with the fused quantization, {kind}"


@pytest.mark.parametrize("fmt", ["float", "ue8m0"])
def test_linear_fp8_gemm_route(gen, dev, fmt) -> None:
    """linear()'s FP8 GEMM rows: torch._scaled_mm where scaled_mm_reason allows, ours with
    ENGRAM_TRT_FP8_GEMM=ours; both within the FP8 GEMM's bound of float64."""
    from engram_trt.native import quant as nq

    torch = _t()
    for N, K, M, dt in ((256, 512, 64, "bfloat16"), (384, 1024, 300, "bfloat16"), (128, 2048, 17, "float32")):
        qw = _weight_case(gen, dev, "fp8", (), N, K, (128, 128), fmt)
        x = (torch.randn(M, K, generator=gen, device=dev) * 2).to(getattr(torch, dt))
        ref, mag = linear_reference(x, qw)
        a64 = linear_activations(x, qw)
        bound = fp8_gemm_bound(K, ref, mag, x.dtype, fp8_tensor_core_error(a64, _weight64(qw)[0].cpu()))
        w = _qweight(qw, False)
        for choice in ("auto", "ours"):
            with _env({nq.FP8_GEMM_ENV: choice}):
                y = nq.linear(x, qw)
                reason = nq.scaled_mm_reason(w, x.device, x.dtype)
            route = "torch._scaled_mm" if reason is None else "engram_fp8_gemm"
            tag = f"[{M}, {K}] x [{N}, {K}]^T {fmt} scales, {dt}, {nq.FP8_GEMM_ENV}={choice} ({route})"
            note(f"linear fp8 gemm route, {tag}", reason or "torch._scaled_mm")
            if choice == "ours":
                assert reason is not None, f"linear: {nq.FP8_GEMM_ENV}=ours takes engram_fp8_gemm, {tag}"
            assert tuple(y.shape) == (M, N) and y.dtype == x.dtype, f"linear shape and dtype, {tag}"
            _assert_within(f"linear fp8 gemm = float64 of the quantized activations, {tag}", y.cpu(), ref, bound.cpu())
        note(
            f"linear fp8 gemm worst relative error, [{M}, {K}] x [{N}, {K}] {fmt}",
            float(((y.double().cpu() - ref).abs() / (mag + 1e-30)).max()),
        )


def test_linear_gemv_weight_static_and_graph(gen, dev) -> None:
    """linear(weight_static=True) on GEMV rows = the same bits as without; a CUDA graph of
    weight_static GEMVs (each reading the activations the kernel before it wrote) replayed
    on new inputs = eager."""
    from engram_trt.native import quant as nq

    torch = _t()
    qw8 = _weight_case(gen, dev, "fp8", (), 512, 1024, (128, 128), "ue8m0")
    qw4 = _weight_case(gen, dev, "fp4", (), 1024, 512, (1, 32), "ue8m0")
    x = torch.randn(2, 1024, generator=gen, device=dev).to(torch.bfloat16)
    plain = nq.linear(x, qw8)
    static = nq.linear(x, qw8, weight_static=True)
    assert bool(torch.equal(plain, static)), "linear weight_static = plain, bit for bit"
    ref, mag = linear_reference(x, qw8)
    _assert_within(
        "linear weight_static = float64",
        static.cpu(),
        ref,
        (gemv_bound("fp8", 1024, ref, mag, static.dtype) + U32 * mag).cpu(),
    )

    def step(inp):
        h = nq.linear(inp, qw8, weight_static=True)  # [2, 512]: the next call's activations
        return nq.linear(h, qw4, weight_static=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(x)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    static_x = x.clone()
    with torch.cuda.graph(graph):
        static_y = step(static_x)
    new = torch.randn(2, 1024, generator=gen, device=dev).to(torch.bfloat16)
    static_x.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    assert bool(torch.equal(static_y, step(new))), "CUDA graph of weight_static GEMVs (a chain) = eager"
