"""The stored-format kernels (plugins/kernels/quantKernels.h through native/quant_kernels.py
and native/quant.py) on a GPU against the float64 references of quant/formats.py
(tied to ml_dtypes and float64 loops on the CPU by tests/kernels/test_quant_binding.py).

  act quant      engram_act_quant bit for bit formats.act_quant (q bytes, scales, deq),
                 x float32 / bf16 / fp16, groups 128 / 32 / 16, float and ue8m0 scales,
                 partial groups, strided rows, zero rows, values near the e4m3 edges;
  swiglu         group 0 against float64 silu(min(g, l)) * clamp(u) (float32 evaluation:
                 |err| <= 8 u32 |h| + 8 u32 |g u|); quantized = act_quant of its own h, bit for bit;
  plan           engram_moe_plan exactly a NumPy stable sort (pairs of no expert last),
                 slot list, pair_row = the inverse of order, the error flag; int32 / int64
                 ids, 1 / 256 / 4096 experts, up to 40,000 pairs, zero tokens;
  gemv           FP8 (float / ue8m0 scales, blocks 128x128, 64x32, bn 1), FP4, BF16; one
                 weight (1, 2, 3, 5, 8, 13 rows: passes), experts with uneven loads, empty
                 experts, an expert of more rows than a pass, row_index, ldo / o_col0 (the
                 columns outside untouched); N, K not multiples of the blocks;
  fp8 gemm       M, N, K partial tiles, bn 128 / 256 (one scale per tile) and 64 / 200
                 (per column), experts whose rows cross tile boundaries and an empty one,
                 bf16 / f16 / f32 out with ldo > N; small-integer inputs: bit for bit;
  grouped gemm   FP4 (ue8m0) and BF16 weights likewise; small integers bit for bit;
  dequantize     formats.dequantize_* exactly;
  end to end     native.quant.linear (GEMV and GEMM rows, fp8 / fp4) and experts (decode:
                 the grouped GEMV, prefill: the grouped GEMMs; fp8, fp4, bf16 stacks; clamp
                 on / off) against float64 with the activations quantized as the kernels do;
                 a CUDA graph of linear + experts replayed with new inputs = eager, bit for
                 bit; linear and experts under torch.cuda.set_sync_debug_mode("error").

Bounds (u = 2^-24, float32; u_out the output's unit roundoff: 0, 2^-8 bf16, 2^-11 fp16;
S = sum_k |a_k W_nk| of the float64 product):
  GEMV: a lane sums each 16-byte vector's VPV products (VPV = 16 fp8, 32 fp4, 8 bf16) in a
    float32 chain, adds it times its block scale (one fma), over ceil(K / (32 VPV)) vectors,
    then a 5-level butterfly: every product passes n = VPV + ceil(K / (32 VPV)) + 7
    roundings, |err| <= n u S (1 + 1e-3), then the output rounding u_out |ref|.
  FP8 GEMM: products are exact (e4m3 x e4m3); within a 128-column block the tensor core adds
    them and its accumulator with fewer bits than float32 (DeepSeek-V3's report: about 14
    bits kept on Hopper). Model: an mma step adds 33 addends (32 products and the
    accumulator), each truncated below 2^-12 of the largest of them (12 bits, a bit under the
    report): per step 33 2^-12 max(|C| + e, max |p|), C the exact partial sum and e the error
    so far, summed over the 4 steps of each block (fp8_tensor_core_error); the float32
    promotion adds (KB + 2) u S (KB = ceil(K / 128) blocks). Exact on the small-integer cases,
    where every partial sum needs <= 11 bits.
  BF16 GEMM (FP4 / BF16 weights): products exact, additions truncated to >= 24 bits of the
    largest operand (NVIDIA tensor cores, Fasi et al. 2021): (K + K/16) 2^-23 S.
  experts: the reference carries intervals: gate / up within their product's bound, the
    clamped SwiGLU of the interval (silu's minimum inside included; 8 u relative for its
    float32 evaluation), the intermediate's quantization over every scale and code the
    interval allows (codes are monotone in h / s), the down product of the interval
    (center +- radius) within its bound, the float32 combine (2k u), the output rounding.
"""

from __future__ import annotations


import numpy as np
import pytest

from .helpers import note, say

U32 = 2.0**-24


def _t():
    import torch

    return torch


def _out_u(dtype) -> float:
    torch = _t()
    return {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]


def _assert_within(name: str, got, ref, bound) -> None:
    """|got - ref| <= bound everywhere (float64 tensors on any device), finite: an assert
    named ``name``."""
    torch = _t()
    g = got.double()
    err = (g - ref).abs()
    ok = bool(torch.isfinite(g).all()) and bool((err <= bound).all())
    ratio = float((err / bound.clamp_min(1e-300)).max()) if err.numel() else 0.0
    assert ok, f"{name}: max|err| {float(err.max()) if err.numel() else 0:.3g}, worst err/bound {ratio:.3f}"


def _assert_equal(name: str, got, want) -> None:
    """got = want bit for bit (same shape): an assert named ``name``."""
    torch = _t()
    same = got.shape == want.shape and bool(torch.equal(got.cpu(), want.cpu()))
    bad = "" if same else f"{int((got.cpu() != want.cpu()).sum()) if got.shape == want.shape else 'shape'} differ"
    assert same, f"{name}: {bad}"


# --- weights ----------------------------------------------------------------------------------


def _fp8(gen, lead, N, K, block, fmt, device):
    from engram_trt.quant import formats
    from engram_trt.quant.weight import QuantWeight

    torch = _t()
    w = torch.randn(*lead, N, K, generator=gen, device=gen.device) * torch.exp(
        torch.randn(*lead, N, 1, generator=gen, device=gen.device)
    )
    q, s = formats.quantize_fp8(w, block, fmt)
    return QuantWeight(q.to(device), s.to(device), "fp8", block)


def _fp4(gen, lead, N, K, device, block=(1, 32)):
    from engram_trt.quant import formats
    from engram_trt.quant.weight import QuantWeight

    torch = _t()
    w = torch.randn(*lead, N, K, generator=gen, device=gen.device) * torch.exp(
        0.5 * torch.randn(*lead, N, 1, generator=gen, device=gen.device)
    )
    q, s = formats.quantize_fp4(w, block[1])
    if block[0] > 1:  # a coarser row block: one scale per bn rows (the largest of the rows')
        gn = -(-N // block[0])
        s8 = s.view(torch.uint8)
        pad = torch.nn.functional.pad(s8, (0, 0, 0, gn * block[0] - N)).view(*lead, gn, block[0], -1)
        s8 = pad.amax(dim=-2)
        s = s8.view(torch.float8_e8m0fnu)
    return QuantWeight(q.to(device), s.to(device), "fp4", block)


def _weight64(w):
    """The float64 weight [E, N, K] (a QuantWeight or a bf16 stack)."""
    torch = _t()
    if isinstance(w, torch.Tensor):
        d = w.double()
    else:
        d = w.dequantize(torch.float64)
    return d if d.dim() == 3 else d.unsqueeze(0)


def _qweight(w, stacked):
    from engram_trt.native import quant as nq

    return nq._weight("w", w, stacked)


# --- 1. activation quantization ------------------------------------------------------------

ACT_CASES = [  # (M, K, ldx extra, group, ue8m0, x dtype, deq dtype)
    (1, 7168, 0, 128, False, "float32", "float32"),
    (37, 1000, 24, 128, False, "bfloat16", "float32"),
    (5, 300, 0, 128, True, "float16", "bfloat16"),
    (64, 2048, 0, 32, True, "bfloat16", "bfloat16"),
    (9, 100, 4, 16, False, "float32", "float16"),
    (3, 33, 0, 8, True, "float32", "float32"),
]


@pytest.mark.parametrize("ci", range(len(ACT_CASES)))
def test_act_quant_is_formats_bit_for_bit(gen, dev, ci) -> None:
    from engram_trt.native import quant_kernels as qk
    from engram_trt.quant import formats

    torch = _t()
    M, K, extra, group, ue8m0, xd, dd = ACT_CASES[ci]
    xdt, ddt = getattr(torch, xd), getattr(torch, dd)
    base = torch.randn(M, K + extra, generator=gen, device=dev) * torch.exp(
        3 * torch.randn(M, 1, generator=gen, device=dev)
    )
    if M > 2:
        base[1] = 0.0  # the amax floor
        base[2, :8] = torch.tensor([448.0, -448.0, 464.0, 1e-30, -0.0, 240.0, 0.001, -3.0e4], device=dev)
    x = base.to(xdt)[:, :K]  # rows of stride K + extra
    q, s, deq = qk.act_quant(x, group, ue8m0, deq_dtype=ddt)
    rq, rs, rdeq = formats.act_quant(x.cpu(), group, ue8m0)
    tag = f"[{M}, {K}] ldx {K + extra} group {group} ue8m0 {ue8m0} {xd} -> deq {dd}"
    _assert_equal(f"act quant q bytes, {tag}", q.view(torch.uint8), rq.view(torch.uint8))
    _assert_equal(f"act quant scales, {tag}", s, rs)
    _assert_equal(f"act quant deq, {tag}", deq, rdeq.to(ddt))
    only_deq = qk.act_quant(x, group, ue8m0, q=False, scale=False, deq_dtype=ddt)[2]
    _assert_equal(f"act quant deq alone = with q and scales, {tag}", only_deq, deq)


def test_swiglu_act_quant(gen, dev) -> None:
    from engram_trt.native import quant_kernels as qk
    from engram_trt.quant import formats

    torch = _t()
    for P, I, limit in ((7, 512, 0.0), (33, 1000, 7.0), (1, 96, 2.5)):
        gu = torch.randn(P, 2 * I, generator=gen, device=dev) * 4
        h = qk.swiglu_act_quant(gu, limit, 0, False, deq_dtype=torch.float32)[2]
        g, u = gu[:, :I].double(), gu[:, I:].double()
        if limit > 0:
            g, u = g.clamp(max=limit), u.clamp(-limit, limit)
        ref = g / (1 + torch.exp(-g)) * u
        bound = 8 * U32 * ref.abs() + 8 * U32 * (g * u).abs() + 1e-30
        _assert_within(f"swiglu (group 0) = float64, P {P} I {I} limit {limit}", h, ref, bound)
        for group, ue8m0 in ((128, False), (32, True)):
            q, s, deq = qk.swiglu_act_quant(gu, limit, group, ue8m0, deq_dtype=torch.float32)
            rq, rs, rdeq = formats.act_quant(h.cpu(), group, ue8m0)
            tag = f"P {P} I {I} limit {limit} group {group} ue8m0 {ue8m0}"
            _assert_equal(f"swiglu act quant q = act_quant(own h), {tag}", q.view(torch.uint8), rq.view(torch.uint8))
            _assert_equal(f"swiglu act quant scale, {tag}", s, rs)
            _assert_equal(f"swiglu act quant deq, {tag}", deq, rdeq)


# --- 2. the routed step's plan ----------------------------------------------------------------


def plan_reference(ids: np.ndarray, E: int, slots: int) -> dict[str, np.ndarray]:
    """engram_moe_plan restated: a stable sort of the pairs by expert, pairs of no expert last."""
    T, k = ids.shape
    flat = ids.reshape(-1).astype(np.int64)
    valid = (flat >= 0) & (flat < E)
    key = np.where(valid, flat, E)
    order = np.argsort(key, kind="stable").astype(np.int32)
    counts = np.bincount(key, minlength=E + 1)
    offsets = np.concatenate([[0], np.cumsum(counts[:E])]).astype(np.int32)
    active = np.nonzero(counts[:E])[0].astype(np.int32)
    slot = np.full(slots, -1, dtype=np.int32)
    slot[: len(active)] = active
    pair_row = np.empty_like(order)
    pair_row[order] = np.arange(len(order), dtype=np.int32)
    return {
        "offsets": offsets,
        "order": order,
        "row_token": (order // k).astype(np.int32),
        "pair_row": pair_row,
        "slot_expert": slot,
        "error": np.array([0 if valid.all() else 1], dtype=np.int32),
    }


def test_moe_plan_is_the_stable_sort(dev) -> None:
    from engram_trt.native import quant_kernels as qk

    torch = _t()
    rng = np.random.default_rng(5)
    cases = [
        (1, 6, 256, "int32", 0.0),
        (37, 8, 256, "int64", 0.02),
        (5000, 8, 256, "int32", 0.0),
        (300, 4, 4096, "int64", 0.01),
        (50, 2, 1, "int32", 0.1),
        (0, 6, 64, "int32", 0.0),
        (2000, 6, 700, "int32", 0.0),
    ]
    for T, k, E, dt, bad in cases:
        probs = rng.dirichlet(np.full(E, 0.3))  # uneven loads, some experts empty
        ids = rng.choice(E, size=(T, k), p=probs)
        if bad:
            mask = rng.random((T, k)) < bad
            ids = np.where(mask, rng.choice([-1, E, E + 7], size=(T, k)), ids)
        ids_t = torch.from_numpy(ids.astype(np.int64)).to(dev, getattr(torch, dt))
        got = qk.plan(ids_t, E)
        slots = int(got["slot_expert"].shape[0])
        want = plan_reference(ids, E, slots)
        for key in ("offsets", "order", "row_token", "pair_row", "slot_expert", "error"):
            _assert_equal(f"plan {key}, T {T} k {k} E {E} {dt} bad {bad}", got[key].cpu(), torch.from_numpy(want[key]))
        again = qk.plan(ids_t, E)
        assert all(torch.equal(got[n], again[n]) for n in got), f"plan is the same twice, T {T} k {k} E {E}"


# --- 3. the GEMV ---------------------------------------------------------------------------


def gemv_bound(kind: str, K: int, ref, mag, out_dtype):
    vpv = {"fp8": 16, "fp4": 32, "bf16": 8}[kind]
    n = vpv + -(-K // (32 * vpv)) + 7
    acc = n * U32 * mag * (1 + 1e-3)
    return _out_u(out_dtype) * (ref.abs() + acc) + acc + 1e-30


def _grouped_rows(rng, T, counts):
    """offsets, row_index (each row a random token), slot_expert of per-expert row counts."""
    E = len(counts)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    row_index = rng.integers(0, T, size=int(offsets[-1])).astype(np.int32)
    active = [e for e in range(E) if counts[e]]
    slots = max(1, min(int(offsets[-1]), E))
    slot_expert = np.full(slots, -1, dtype=np.int32)
    slot_expert[: len(active)] = active
    return offsets, row_index, slot_expert


def _expert_of_rows(offsets: np.ndarray) -> np.ndarray:
    return np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))


def _weight_case(gen, dev, kind, lead, N, K, block=None, fmt="float"):
    torch = _t()
    if kind == "fp8":
        return _fp8(gen, lead, N, K, block or (128, 128), fmt, dev)
    if kind == "fp4":
        return _fp4(gen, lead, N, K, dev, block or (1, 32))
    return (torch.randn(*lead, N, K, generator=gen, device=gen.device) * 0.1).to(dev, torch.bfloat16)


GEMV_WEIGHTS = [  # (kind, N, K, block, scale fmt)
    ("fp8", 200, 336, (128, 128), "float"),
    ("fp8", 131, 512, (128, 128), "ue8m0"),
    ("fp8", 97, 160, (64, 32), "float"),
    ("fp8", 2048, 7168, (128, 128), "ue8m0"),
    ("fp4", 70, 96, (1, 32), "ue8m0"),
    ("fp4", 130, 2048, (64, 64), "ue8m0"),
    ("bf16", 50, 72, None, None),
]


@pytest.mark.parametrize("wi", range(len(GEMV_WEIGHTS)))
def test_gemv_one_weight(gen, dev, wi) -> None:
    from engram_trt.native import quant_kernels as qk

    torch = _t()
    kind, N, K, block, fmt = GEMV_WEIGHTS[wi]
    qw = _weight_case(gen, dev, kind, (), N, K, block, fmt)
    w = _qweight(qw, False) if kind != "bf16" else qk.make_weight("w", qw, None, "bf16", (1, 1), False)
    W = _weight64(qw)[0]
    for rows, adt, odt in (
        (1, "float32", "float32"),
        (2, "bfloat16", "bfloat16"),
        (3, "float32", "float16"),
        (5, "float32", "float32"),
        (8, "bfloat16", "float32"),
        (13, "float32", "bfloat16"),
    ):
        if K >= 4096 and rows not in (1, 8):
            continue
        a = (torch.randn(rows + 4, K, generator=gen, device=dev) * 2).to(getattr(torch, adt))
        row_index = torch.randperm(rows + 4, generator=gen, device=dev)[:rows].to(torch.int32)
        out = torch.full((rows, N + 37), float("nan"), device=dev, dtype=getattr(torch, odt))
        qk.gemv(a, w, out, row_index=row_index, o_col0=20)
        ad = a.double()[row_index.long()]
        ref, mag = ad @ W.t(), ad.abs() @ W.abs().t()
        tag = f"{kind} [{N}, {K}] block {block} {fmt}, {rows} rows, a {adt}, out {odt}"
        _assert_within(f"gemv = float64, {tag}", out[:, 20 : 20 + N], ref, gemv_bound(kind, K, ref, mag, out.dtype))
        outside = torch.cat([out[:, :20], out[:, 20 + N :]], dim=1)
        assert bool(torch.isnan(outside.float()).all()), f"gemv leaves the other columns, {tag}"


@pytest.mark.parametrize("kind,fmt", [("fp8", "float"), ("fp8", "ue8m0"), ("fp4", "ue8m0"), ("bf16", None)])
def test_gemv_experts(gen, dev, kind, fmt) -> None:
    from engram_trt.native import quant_kernels as qk

    torch = _t()
    rng = np.random.default_rng(17)
    N, K = (192, 256) if kind != "bf16" else (96, 136)
    for T, counts in (
        (6, [1, 0, 2, 0, 0, 1, 1, 0]),  # decode: one or two rows an expert
        (20, [13, 0, 9, 2, 0, 16, 1, 0]),  # more rows than a pass, empty experts
        (4, [0, 0, 0, 0, 0, 0, 0, 3]),
    ):  # one active expert, the last
        E = len(counts)
        qw = _weight_case(gen, dev, kind, (E,), N, K, None, fmt)
        w = _qweight(qw, True) if kind != "bf16" else qk.make_weight("w", qw, None, "bf16", (1, 1), True)
        W = _weight64(qw)
        offsets, row_index, slot_expert = _grouped_rows(rng, T, counts)
        P = int(offsets[-1])
        a = torch.randn(T, K, generator=gen, device=dev) * 3
        out = torch.full((P, 2 * N), float("nan"), device=dev)
        qk.gemv(
            a,
            w,
            out,
            row_index=torch.from_numpy(row_index).to(dev),
            offsets=torch.from_numpy(offsets).to(dev),
            slot_expert=torch.from_numpy(slot_expert).to(dev),
            o_col0=N,
        )
        experts = torch.from_numpy(_expert_of_rows(offsets)).to(dev)
        ad = a.double()[torch.from_numpy(row_index).long().to(dev)]
        Wr = W[experts]
        ref = torch.einsum("pk,pnk->pn", ad, Wr)
        mag = torch.einsum("pk,pnk->pn", ad.abs(), Wr.abs())
        tag = f"{kind} {fmt} experts {E} rows {counts}"
        _assert_within(f"grouped gemv = float64, {tag}", out[:, N:], ref, gemv_bound(kind, K, ref, mag, out.dtype))
        assert bool(torch.isnan(out[:, :N]).all()), f"grouped gemv leaves columns 0..N-1, {tag}"


# --- 4. the GEMMs ----------------------------------------------------------------------------

TC_FP8_BITS = 12  # bits of its largest addend an FP8 mma step keeps, at least (DeepSeek-V3: about 14 on Hopper)


def fp8_tensor_core_error(ad, W, ad_radius=None):
    """Bound ``[P, N]`` of the FP8 tensor cores' accumulation error (module docstring):
    ``ad [P, K]`` the activations (float64, scaled), ``W [N, K]`` or ``[P, N, K]`` the
    weights; with ``ad_radius`` the activations are intervals ``ad +- ad_radius``. Per
    128-column block, per mma step of 32 columns: 33 addends (the step's products and the
    accumulator) each truncated below 2^-TC_FP8_BITS of the largest of them."""
    torch = _t()
    P, K = ad.shape
    Wb = W if W.dim() == 3 else W.unsqueeze(0)
    N = Wb.shape[1]
    zeros = lambda: torch.zeros((P, N), dtype=torch.float64, device=ad.device)  # noqa: E731
    total = zeros()
    for k0 in range(0, K, 128):
        c, cr, e = zeros(), zeros(), zeros()
        for s0 in range(k0, min(k0 + 128, K), 32):
            s1 = min(s0 + 32, K)
            prod = ad[:, None, s0:s1] * Wb[:, :, s0:s1]
            pmax = prod.abs()
            if ad_radius is not None:
                pr = ad_radius[:, None, s0:s1] * Wb[:, :, s0:s1].abs()
                pmax = pmax + pr
                cr = cr + pr.sum(-1)
            top = torch.maximum(c.abs() + cr + e, pmax.amax(-1))
            e = e + 33 * 2.0**-TC_FP8_BITS * top
            c = c + prod.sum(-1)
        total += e
    return total


def fp8_gemm_bound(K: int, ref, mag, out_dtype, tc_error):
    """The FP8 GEMM's bound: the tensor cores' (fp8_tensor_core_error), the float32
    promotion's (KB + 2) u S, the output rounding."""
    kb = -(-K // 128)
    acc = tc_error + (kb + 2) * U32 * mag
    return _out_u(out_dtype) * (ref.abs() + acc) + acc + 1e-30


def bf16_gemm_bound(K: int, ref, mag, out_dtype):
    acc = (K + -(-K // 16)) * 2.0**-23 * mag
    return _out_u(out_dtype) * (ref.abs() + acc) + acc + 1e-30


def _a_fp8(gen, dev, T, K):
    """Activations quantized by the kernel (group 128): q, scale and their float64 product."""
    from engram_trt.native import quant_kernels as qk
    from engram_trt.quant import formats

    torch = _t()
    x = torch.randn(T, K, generator=gen, device=dev) * torch.exp(torch.randn(T, 1, generator=gen, device=dev))
    q, s, _ = qk.act_quant(x, 128, False)
    a64 = formats.e4m3_to_float(q, torch.float64) * formats.expand_blocks(s.double(), T, K, 1, 128)
    return q, s, a64


FP8_GEMM_CASES = [  # (rows, N, K, bn, experts counts or None, out dtype)
    (1, 200, 256, 128, None, "float32"),
    (300, 200, 336, 128, None, "bfloat16"),
    (129, 384, 2048, 256, None, "float32"),
    (200, 130, 512, 64, None, "float16"),
    (77, 300, 160, 200, None, "float32"),
    (None, 256, 384, 128, [0, 130, 1, 250, 19], "bfloat16"),
    (None, 200, 256, 96, [129, 0, 0, 128, 3, 0], "float32"),
]


@pytest.mark.parametrize("ci", range(len(FP8_GEMM_CASES)))
def test_fp8_gemm(gen, dev, ci) -> None:
    from engram_trt.native import quant_kernels as qk

    torch = _t()
    if torch.cuda.get_device_capability(dev) < (8, 9):
        pytest.skip("the FP8 tensor cores need compute capability 8.9+")
    rows, N, K, bn, counts, odt = FP8_GEMM_CASES[ci]
    rng = np.random.default_rng(ci)
    E = 1 if counts is None else len(counts)
    qw = _fp8(gen, (E,) if counts else (), N, K, (bn, 128), "ue8m0" if ci % 2 else "float", dev)
    w = _qweight(qw, counts is not None)
    W = _weight64(qw)
    T = rows if counts is None else 97
    q, s, a64 = _a_fp8(gen, dev, T, K)
    if counts is None:
        P, row_index, offsets, experts = rows, None, None, torch.zeros(rows, dtype=torch.long, device=dev)
        ad = a64
    else:
        offs, ri, _ = _grouped_rows(rng, T, counts)
        P = int(offs[-1])
        row_index = torch.from_numpy(ri).to(dev)
        offsets = torch.from_numpy(offs).to(dev)
        experts = torch.from_numpy(_expert_of_rows(offs)).to(dev)
        ad = a64[row_index.long()]
    out = torch.full((P, N + 9), float("nan"), device=dev, dtype=getattr(torch, odt))
    qk.fp8_gemm(q, s, w, out, row_index=row_index, offsets=offsets)
    Wr = W[experts] if counts else W[0]
    ref = torch.einsum("pk,pnk->pn", ad, Wr) if counts else ad @ Wr.t()
    mag = torch.einsum("pk,pnk->pn", ad.abs(), Wr.abs()) if counts else ad.abs() @ Wr.abs().t()
    tag = f"P {P} N {N} K {K} bn {bn} experts {counts} out {odt}"
    bound = fp8_gemm_bound(K, ref, mag, out.dtype, fp8_tensor_core_error(ad, Wr))
    _assert_within(f"fp8 gemm = float64, {tag}", out[:, :N], ref, bound)
    assert bool(torch.isnan(out[:, N:].float()).all()), f"fp8 gemm leaves columns N.., {tag}"
    note(f"fp8 gemm worst relative error, {tag}", float(((out[:, :N].double() - ref).abs() / (mag + 1e-30)).max()))


def _small_e4m3(rng, shape):
    """e4m3 bytes of 0, +-0.5, +-1, +-2 (codes 0x00, 0x30, 0x38, 0x40 and their negatives)."""
    codes = rng.choice(np.array([0x00, 0x30, 0x38, 0x40, 0xB0, 0xB8, 0xC0], dtype=np.uint8), size=shape)
    return codes


def test_gemms_are_exact_on_small_integers(dev) -> None:
    """Every partial sum fits 11 bits and every scale is a power of two: the products must
    equal the float64 product bit for bit, whatever the accumulation order or width."""
    from engram_trt.native import quant_kernels as qk
    from engram_trt.quant import formats
    from engram_trt.quant.weight import QuantWeight

    torch = _t()
    rng = np.random.default_rng(3)
    if torch.cuda.get_device_capability(dev) >= (8, 9):
        for P, N, K, bn, counts in ((200, 160, 1024, 128, None), (None, 136, 384, 64, [40, 0, 200, 7])):
            E = 1 if counts is None else len(counts)
            lead = (E,) if counts else ()
            wq = torch.from_numpy(_small_e4m3(rng, (*lead, N, K))).to(dev).view(torch.float8_e4m3fn)
            ws = torch.from_numpy(rng.integers(125, 130, size=(*lead, -(-N // bn), K // 128)).astype(np.uint8))
            qw = QuantWeight(wq, ws.to(dev).view(torch.float8_e8m0fnu), "fp8", (bn, 128))
            T = P if counts is None else 60
            aq = torch.from_numpy(_small_e4m3(rng, (T, K))).to(dev).view(torch.float8_e4m3fn)
            a_s = torch.from_numpy(np.ldexp(1.0, rng.integers(-2, 3, size=(T, K // 128))).astype(np.float32)).to(dev)
            a64 = formats.e4m3_to_float(aq, torch.float64) * formats.expand_blocks(a_s.double(), T, K, 1, 128)
            if counts is None:
                row_index = offsets = None
                experts, ad, Prows = torch.zeros(P, dtype=torch.long, device=dev), a64, P
            else:
                offs, ri, _ = _grouped_rows(rng, T, counts)
                Prows = int(offs[-1])
                row_index, offsets = torch.from_numpy(ri).to(dev), torch.from_numpy(offs).to(dev)
                experts = torch.from_numpy(_expert_of_rows(offs)).to(dev)
                ad = a64[row_index.long()]
            out = torch.empty((Prows, N), device=dev)
            qk.fp8_gemm(aq, a_s, _qweight(qw, counts is not None), out, row_index=row_index, offsets=offsets)
            ref = torch.einsum("pk,pnk->pn", ad, _weight64(qw)[experts])
            _assert_equal(
                f"fp8 gemm exact on small integers, P {Prows} N {N} K {K} bn {bn} experts {counts}", out, ref.float()
            )
    for kind, counts in (("fp4", None), ("fp4", [50, 0, 90]), ("bf16", [33, 140])):
        E = 1 if counts is None else len(counts)
        lead = (E,) if counts else ()
        N, K = 150, 512
        if kind == "fp4":
            codes = torch.from_numpy(rng.integers(0, 16, size=(*lead, N, K)))
            sb = torch.from_numpy(rng.integers(124, 129, size=(*lead, N, K // 32)).astype(np.uint8))
            qw = QuantWeight(
                formats.pack_fp4(codes).view(torch.int8).to(dev), sb.to(dev).view(torch.float8_e8m0fnu), "fp4", (1, 32)
            )
            w = _qweight(qw, counts is not None)
        else:
            qw = torch.from_numpy(rng.integers(-4, 5, size=(*lead, N, K)).astype(np.float32)).to(dev, torch.bfloat16)
            w = qk.make_weight("w", qw, None, "bf16", (1, 1), counts is not None)
        T = 120
        a = torch.from_numpy(rng.integers(-3, 4, size=(T, K)).astype(np.float32)).to(dev, torch.bfloat16)
        if counts is None:
            row_index = offsets = None
            experts, ad, Prows = torch.zeros(T, dtype=torch.long, device=dev), a.double(), T
        else:
            offs, ri, _ = _grouped_rows(rng, T, counts)
            Prows = int(offs[-1])
            row_index, offsets = torch.from_numpy(ri).to(dev), torch.from_numpy(offs).to(dev)
            experts = torch.from_numpy(_expert_of_rows(offs)).to(dev)
            ad = a.double()[row_index.long()]
        out = torch.empty((Prows, N), device=dev)
        qk.grouped_gemm(a, w, out, row_index=row_index, offsets=offsets)
        ref = torch.einsum("pk,pnk->pn", ad, _weight64(qw)[experts])
        _assert_equal(f"{kind} grouped gemm exact on small integers, experts {counts}", out, ref.float())


GROUPED_CASES = [  # (kind, rows, N, K, block, counts, out dtype)
    ("fp4", 1, 200, 256, (1, 32), None, "float32"),
    ("fp4", 300, 264, 2048, (1, 32), None, "bfloat16"),
    ("fp4", None, 192, 352, (1, 32), [0, 140, 1, 300, 5, 0, 60], "float32"),
    ("fp4", 100, 130, 192, (64, 64), None, "float16"),
    ("bf16", 250, 136, 200, None, None, "float32"),
    ("bf16", None, 128, 264, None, [129, 0, 256], "bfloat16"),
]


@pytest.mark.parametrize("ci", range(len(GROUPED_CASES)))
def test_grouped_gemm(gen, dev, ci) -> None:
    from engram_trt.native import quant_kernels as qk

    torch = _t()
    kind, rows, N, K, block, counts, odt = GROUPED_CASES[ci]
    rng = np.random.default_rng(100 + ci)
    E = 1 if counts is None else len(counts)
    lead = (E,) if counts else ()
    qw = _weight_case(gen, dev, kind, lead, N, K, block, "ue8m0")
    w = (
        _qweight(qw, counts is not None)
        if kind != "bf16"
        else qk.make_weight("w", qw, None, "bf16", (1, 1), counts is not None)
    )
    W = _weight64(qw)
    T = rows if counts is None else 150
    a = (torch.randn(T, K, generator=gen, device=dev) * 2).to(torch.bfloat16)
    if counts is None:
        P, row_index, offsets, experts, ad = (
            rows,
            None,
            None,
            torch.zeros(rows, dtype=torch.long, device=dev),
            a.double(),
        )
    else:
        offs, ri, _ = _grouped_rows(rng, T, counts)
        P = int(offs[-1])
        row_index, offsets = torch.from_numpy(ri).to(dev), torch.from_numpy(offs).to(dev)
        experts = torch.from_numpy(_expert_of_rows(offs)).to(dev)
        ad = a.double()[row_index.long()]
    out = torch.full((P, N + 5), float("nan"), device=dev, dtype=getattr(torch, odt))
    qk.grouped_gemm(a, w, out, row_index=row_index, offsets=offsets)
    Wr = W[experts]
    ref, mag = torch.einsum("pk,pnk->pn", ad, Wr), torch.einsum("pk,pnk->pn", ad.abs(), Wr.abs())
    tag = f"{kind} P {P} N {N} K {K} block {block} experts {counts} out {odt}"
    _assert_within(f"grouped gemm = float64, {tag}", out[:, :N], ref, bf16_gemm_bound(K, ref, mag, out.dtype))
    assert bool(torch.isnan(out[:, N:].float()).all()), f"grouped gemm leaves columns N.., {tag}"


def test_dequantize_is_formats(gen, dev) -> None:
    from engram_trt.native import quant_kernels as qk

    torch = _t()
    for qw, stacked in (
        (_fp8(gen, (), 200, 336, (128, 128), "float", dev), False),
        (_fp8(gen, (3,), 70, 160, (64, 32), "ue8m0", dev), True),
        (_fp4(gen, (2,), 33, 96, dev), True),
    ):
        w = _qweight(qw, stacked)
        want = _weight64(qw)
        _assert_equal(f"dequantize float32 = formats, {qw.kind} {list(want.shape)}", qk.dequantize(w), want.float())
        # the header's rounding: the float32 product, rounded once more to bf16
        _assert_equal(
            f"dequantize bf16 = formats, {qw.kind}", qk.dequantize(w, torch.bfloat16), want.float().to(torch.bfloat16)
        )


# --- 5. end to end: native.quant.linear / experts ------------------------------------------


def linear_activations(x, qw):
    """x ``[M, K]`` quantized as linear() does (formats.act_quant on the CPU: the kernel's
    bit for bit), as float64 q * s."""
    from engram_trt.native import quant as nq
    from engram_trt.quant import formats

    torch = _t()
    group, ue8m0 = nq.ACT_QUANT[qw.kind]
    x2 = x.reshape(-1, x.shape[-1]).float().cpu()
    q, s, _ = formats.act_quant(x2, group, ue8m0)
    return formats.e4m3_to_float(q, torch.float64) * formats.expand_blocks(
        s.double(), x2.shape[0], x2.shape[1], 1, group
    )


def linear_reference(x, qw):
    """float64 x W^T with x quantized as linear() does, and sum |a W|."""
    a64 = linear_activations(x, qw)
    W = _weight64(qw)[0].cpu()
    return a64 @ W.t(), a64.abs() @ W.abs().t()


@pytest.mark.parametrize("kind", ["fp8", "fp4"])
def test_linear_end_to_end(gen, dev, kind) -> None:
    from engram_trt.native import quant as nq

    torch = _t()
    N, K = (300, 512) if kind == "fp8" else (256, 640)
    qw = _weight_case(gen, dev, kind, (), N, K, (128, 128) if kind == "fp8" else (1, 32), "float")
    for shape, dt in (
        ((1, K), "bfloat16"),
        ((2, 2, K), "float32"),
        ((8, K), "bfloat16"),
        ((9, K), "float32"),
        ((3, 100, K), "bfloat16"),
    ):
        x = (torch.randn(*shape, generator=gen, device=dev) * 2).to(getattr(torch, dt))
        rows = x.numel() // K
        route = nq._route(rows, _qweight(qw, False), x.device, nq.LINEAR_GEMV_MAX_ROWS)
        y = nq.linear(x, qw)
        ref, mag = linear_reference(x, qw)
        if route == "gemv":
            bound = gemv_bound(kind, K, ref, mag, y.dtype) + U32 * mag  # + the float32 deq's rounding
        elif kind == "fp8":
            a64 = linear_activations(x, qw)
            bound = fp8_gemm_bound(K, ref, mag, y.dtype, fp8_tensor_core_error(a64, _weight64(qw)[0].cpu()))
        else:
            bound = bf16_gemm_bound(K, ref, mag, y.dtype)
        assert tuple(y.shape) == (*shape[:-1], N) and y.dtype == x.dtype, (
            f"linear shape and dtype, {kind} {list(shape)} {dt}: {tuple(y.shape)} {y.dtype}"
        )
        _assert_within(
            f"linear = float64 of the quantized activations, {kind} {list(shape)} {dt} ({route})",
            y.reshape(rows, N).cpu(),
            ref,
            bound.cpu(),
        )


def _silu64(g):
    with np.errstate(over="ignore"):  # exp(-g) = inf for g << 0: silu -> -0, as in float32
        return g / (1 + np.exp(-g))


def _interval_silu(lo, hi):
    """silu over [lo, hi] (elementwise): its values at the ends, and its minimum where inside."""
    gmin = -1.2784645427610738  # silu's minimum, silu'(g) = 0
    a, b = _silu64(lo), _silu64(hi)
    low = np.minimum(a, b)
    inside = (lo <= gmin) & (gmin <= hi)
    low = np.where(inside, np.minimum(low, _silu64(np.float64(gmin))), low)
    return low, np.maximum(a, b)


def _e4m3_round(v):
    import ml_dtypes

    return np.clip(v, -448, 448).astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


def _pow2_ceil(v):
    m, e = np.frexp(v)
    return np.where(m == 0.5, v, np.ldexp(1.0, e))


def _quant_interval(lo, hi, group, ue8m0):
    """The dequantized values the kernel's act quant can give for h anywhere in [lo, hi]
    (per element), over every scale its group's amax allows: [qlo, qhi]."""
    P, I = lo.shape
    G = -(-I // group)
    pad = G * group - I
    lo_p = np.pad(lo, ((0, 0), (0, pad)))
    hi_p = np.pad(hi, ((0, 0), (0, pad)))
    absmax = np.maximum(np.abs(lo_p), np.abs(hi_p)).reshape(P, G, group).max(-1)
    absmin = (
        np.where((lo_p <= 0) & (hi_p >= 0), 0.0, np.minimum(np.abs(lo_p), np.abs(hi_p))).reshape(P, G, group).max(-1)
    )
    s_lo = np.maximum(absmin, 1e-4) / 448 * (1 - 2 * U32)
    s_hi = np.maximum(absmax, 1e-4) / 448 * (1 + 2 * U32)
    cands = [(s_lo, s_hi)] if not ue8m0 else [(_pow2_ceil(s_lo),) * 2, (_pow2_ceil(s_hi),) * 2]
    qlo = np.full((P, I), np.inf)
    qhi = np.full((P, I), -np.inf)
    for sa, sb in cands:
        sa_e = np.repeat(sa, group, axis=1)[:, :I]
        sb_e = np.repeat(sb, group, axis=1)[:, :I]
        corners = [lo / sa_e, lo / sb_e, hi / sa_e, hi / sb_e]
        tmin, tmax = np.minimum.reduce(corners), np.maximum.reduce(corners)
        # the kernel's x * fl(1/s) is within 2 u of h / s; 2 u more for the float32 cast here
        cmin, cmax = _e4m3_round(tmin - 4 * U32 * np.abs(tmin)), _e4m3_round(tmax + 4 * U32 * np.abs(tmax))
        vals = [cmin * sa_e, cmin * sb_e, cmax * sa_e, cmax * sb_e]
        qlo = np.minimum(qlo, np.minimum.reduce(vals))
        qhi = np.maximum(qhi, np.maximum.reduce(vals))
    return qlo - U32 * np.abs(qlo) - 1e-300, qhi + U32 * np.abs(qhi) + 1e-300  # deq's float32 rounding


def experts_reference(x, ids, route_w, gate, up, down, limit, gu_route, d_route):
    """[lo, hi] per output element (float64 NumPy) of what experts() may return (module docstring)."""
    from engram_trt.native import quant as nq
    from engram_trt.quant import formats

    torch = _t()
    Wg, Wu, Wd = (_weight64(w).cpu().numpy() for w in (gate, up, down))
    E, I, D = Wg.shape
    T, k = ids.shape
    idn = ids.cpu().numpy().reshape(-1)
    tok = np.repeat(np.arange(T), k)
    kind = "bf16" if isinstance(gate, torch.Tensor) else gate.kind
    if kind == "bf16":
        xa = x.float() if gu_route == "gemv" else x.to(torch.bfloat16)
        a = xa.double().cpu().numpy()
    else:
        group, ue8m0 = nq.ACT_QUANT[kind]
        q, s, _ = formats.act_quant(x.float().cpu(), group, ue8m0)
        a = (formats.e4m3_to_float(q, torch.float64) * formats.expand_blocks(s.double(), T, D, 1, group)).numpy()
    ap = a[tok]
    g = np.einsum("pd,pid->pi", ap, Wg[idn])
    u = np.einsum("pd,pid->pi", ap, Wu[idn])
    gm = np.einsum("pd,pid->pi", np.abs(ap), np.abs(Wg[idn]))
    um = np.einsum("pd,pid->pi", np.abs(ap), np.abs(Wu[idn]))

    def gamma(route, w_kind, K):
        if route == "gemv":
            vpv = {"fp8": 16, "fp4": 32, "bf16": 8}[w_kind]
            return (vpv + -(-K // (32 * vpv)) + 8) * U32 * (1 + 1e-3)
        if w_kind == "fp8":
            return (-(-K // 128) + 2) * U32  # + the tensor cores' own, added apart
        return (K + -(-K // 16)) * 2.0**-23

    def tensor_cores(a, a_radius, W):
        t = lambda v: None if v is None else torch.from_numpy(np.ascontiguousarray(v))  # noqa: E731
        return fp8_tensor_core_error(t(a), t(W), t(a_radius)).numpy()

    eg, eu = gamma(gu_route, kind, D) * gm, gamma(gu_route, kind, D) * um
    if kind == "fp8" and gu_route == "gemm":
        eg = eg + tensor_cores(ap, None, Wg[idn])
        eu = eu + tensor_cores(ap, None, Wu[idn])
    L = limit or 0.0
    glo, ghi, ulo, uhi = g - eg, g + eg, u - eu, u + eu
    if L > 0:
        glo, ghi = np.minimum(glo, L), np.minimum(ghi, L)
        ulo, uhi = np.clip(ulo, -L, L), np.clip(uhi, -L, L)
    slo, shi = _interval_silu(glo, ghi)
    corners = [slo * ulo, slo * uhi, shi * ulo, shi * uhi]
    hlo, hhi = np.minimum.reduce(corners), np.maximum.reduce(corners)
    widen = 8 * U32 * np.maximum(np.abs(hlo), np.abs(hhi))
    hlo, hhi = hlo - widen, hhi + widen
    dkind = "bf16" if isinstance(down, torch.Tensor) else down.kind
    if dkind == "bf16":
        if d_route == "gemm":  # the float32 h rounded to bf16: monotone, so the ends' roundings bound it
            bf16 = lambda v: torch.from_numpy(v).float().to(torch.bfloat16).double().numpy()  # noqa: E731
            hlo, hhi = bf16(hlo), bf16(hhi)
    else:
        group, ue8m0 = nq.ACT_QUANT[dkind]
        hlo, hhi = _quant_interval(hlo, hhi, group, ue8m0)
    c, r = (hlo + hhi) / 2, (hhi - hlo) / 2
    Wdp = Wd[idn]
    yc = np.einsum("pi,pdi->pd", c, Wdp)
    yr = np.einsum("pi,pdi->pd", r, np.abs(Wdp))
    ym = np.einsum("pi,pdi->pd", np.maximum(np.abs(hlo), np.abs(hhi)), np.abs(Wdp))
    yr = yr + gamma(d_route, dkind, I) * ym
    if dkind == "fp8" and d_route == "gemm":
        yr = yr + tensor_cores(c, r, Wdp)
    valid = ((idn >= 0) & (idn < E)).astype(np.float64)
    w = route_w.double().cpu().numpy().reshape(-1) * valid
    center = (w[:, None] * yc).reshape(T, k, D).sum(1)
    radius = (np.abs(w)[:, None] * (yr + 2 * k * U32 * (np.abs(yc) + yr))).reshape(T, k, D).sum(1)
    return center - radius, center + radius


EXPERT_CASES = [  # (kind of gate / up, kind of down, T, k, E, D, I, limit)
    ("fp4", "fp4", 3, 6, 16, 256, 128, 7.0),
    ("fp4", "fp4", 40, 4, 8, 256, 192, None),
    ("fp8", "fp8", 5, 4, 8, 384, 256, None),
    ("fp8", "fp8", 40, 2, 6, 256, 256, 10.0),
    ("bf16", "bf16", 4, 2, 4, 128, 96, None),
    ("bf16", "bf16", 33, 2, 4, 128, 96, 5.0),
]


@pytest.mark.parametrize("ci", range(len(EXPERT_CASES)))
def test_experts_end_to_end(gen, dev, ci) -> None:
    from engram_trt.native import quant as nq

    torch = _t()
    gk, dk, T, k, E, D, I, limit = EXPERT_CASES[ci]
    if gk == "fp8" and T > nq.EXPERTS_GEMV_MAX_TOKENS and torch.cuda.get_device_capability(dev) < (8, 9):
        pytest.skip("the FP8 tensor cores need compute capability 8.9+")
    block = (128, 128) if gk == "fp8" else (1, 32)
    gate = _weight_case(gen, dev, gk, (E,), I, D, block, "float")
    up = _weight_case(gen, dev, gk, (E,), I, D, block, "float")
    down = _weight_case(gen, dev, dk, (E,), D, I, block, "float")
    x = (torch.randn(T, D, generator=gen, device=dev)).to(torch.bfloat16)
    rng = np.random.default_rng(ci)
    ids = torch.from_numpy(np.stack([rng.choice(E, size=k, replace=False) for _ in range(T)])).to(dev, torch.int32)
    route_w = torch.rand(T, k, generator=gen, device=dev)
    y = nq.experts(x, ids, route_w, gate, up, down, limit=limit)
    gu_route = nq._route(T * k, _qweight(gate, True), x.device, nq._experts_gemv_rows(T, T * k))
    d_route = nq._route(T * k, _qweight(down, True), x.device, nq._experts_gemv_rows(T, T * k))
    lo, hi = experts_reference(x, ids, route_w, gate, up, down, limit, gu_route, d_route)
    u = _out_u(y.dtype)
    lo_t = torch.from_numpy(lo - u * np.abs(lo))
    hi_t = torch.from_numpy(hi + u * np.abs(hi))
    got = y.double().cpu()
    inside = (got >= lo_t) & (got <= hi_t)
    width = float(np.median((hi - lo) / (np.abs(hi + lo) / 2 + 1e-30)))
    tag = f"{gk}/{dk} T {T} k {k} E {E} D {D} I {I} limit {limit} ({gu_route}, {d_route})"
    assert bool(inside.all()) and bool(torch.isfinite(got).all()), (
        f"experts within the float64 interval, {tag}: {int((~inside).sum())} outside; median relative interval width "
        f"{width:.2e}"
    )
    note(f"experts median interval width, {tag}", width)
    again = nq.experts(x, ids, route_w, gate, up, down, limit=limit)
    assert bool(torch.equal(y, again)), f"experts deterministic, {tag}"


def test_graph_capture_and_no_host_sync(gen, dev) -> None:
    """linear (GEMV and GEMM rows) and experts (decode and prefill) captured in one CUDA
    graph, replayed on new inputs: equal to eager bit for bit; and run eagerly under
    set_sync_debug_mode('error')."""
    from engram_trt.native import quant as nq

    torch = _t()
    fp8_ok = torch.cuda.get_device_capability(dev) >= (8, 9)
    qw = _fp8(gen, (), 256, 512, (128, 128), "ue8m0", dev)
    E, D, I, k = 8, 256, 128, 4
    gate, up = _fp4(gen, (E,), I, D, dev), _fp4(gen, (E,), I, D, dev)
    down = _fp4(gen, (E,), D, I, dev)

    def inputs(T, seed):
        g = torch.Generator(device=dev).manual_seed(seed)
        ids = torch.stack([torch.randperm(E, generator=g, device=dev)[:k] for _ in range(T)]).to(torch.int32)
        return (
            torch.randn(T, D, generator=g, device=dev).to(torch.bfloat16),
            ids,
            torch.rand(T, k, generator=g, device=dev),
        )

    rows_cases = [2, 64] if fp8_ok else [2]
    tokens_cases = [3, 24]

    def step(xs, es):
        outs = [nq.linear(x, qw) for x in xs]
        outs += [nq.experts(x, ids, w, gate, up, down, limit=7.0) for x, ids, w in es]
        return outs

    xs = [torch.randn(m, 512, generator=gen, device=dev).to(torch.bfloat16) for m in rows_cases]
    es = [inputs(T, 10 + T) for T in tokens_cases]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(xs, es)  # warm-up: the library loads, the kernels' attributes are set
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step(xs, es)
    new_xs = [torch.randn(m, 512, generator=gen, device=dev).to(torch.bfloat16) for m in rows_cases]
    new_es = [inputs(T, 99 + T) for T in tokens_cases]
    for dst, src in zip(xs, new_xs):
        dst.copy_(src)
    for dst, src in zip(es, new_es):
        for d, s in zip(dst, src):
            d.copy_(s)
    graph.replay()
    torch.cuda.synchronize()
    eager = step(new_xs, new_es)
    names = [f"linear {m} rows" for m in rows_cases] + [f"experts {T} tokens" for T in tokens_cases]
    for name, got, want in zip(names, static, eager):
        assert bool(torch.equal(got, want)), f"CUDA graph replay = eager, {name}"
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(new_xs, new_es)
        ok, detail = True, ""
    except RuntimeError as exc:  # a synchronizing call raised
        ok, detail = False, str(exc).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert ok, f"linear and experts never synchronize (sync debug mode 'error'): {detail}"
    say("graph / sync checks done")
