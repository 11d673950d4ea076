"""The decode step's stored-format kernels (quantDecodeKernel.cu through native/quant_decode.py)
on a GPU, and the DeepSeek-V4 fused glue that calls them:

  segments   engram_quant_gemv_segments: FP8 (float and ue8m0 scales), FP4 and BF16 segments
             mixed in one launch, N and K not multiples of 128 (partial blocks), segments of
             one shared input and slices of one buffer (a grouped projection), 1-8 rows:
             each output within the GEMV bound (test_quant_kernels.gemv_bound: a lane's
             VPV-product chain, the scale FMA over ceil(K / 32 VPV) vectors, the 5-level
             butterfly, the bf16 output) of float64 over the activations quantized as
             formats.act_quant (the kernels' staging is bit for bit that deq); and equal to
             native.quant.linear (one launch each) within the two bounds added;
  moe        engram_quant_moe without a shared expert: within the float64 interval of
             test_quant_kernels.experts_reference (the intervals carried through the clamped
             SwiGLU and the intermediate's quantization), then the bf16 output rounding; with
             the shared expert: equal to native.quant.experts + the shared expert's products
             (the old path) within that interval's width plus the shared expert's reach
             (module docstring of _shared_reach);
  prologues  engram_quant_gemv_segments_ex: the RMSNorm prologue (q_a_norm before q_b) and
             the inverse-RoPE prologue (before the grouped o_a) on FP8 (float and ue8m0
             scales), FP4 and BF16 segments, 1-8 rows, K / N not multiples of 128: equal bit
             for bit to norm_rope into a bf16 buffer then engram_quant_gemv_segments (the two
             launches they replace), x left as it was;
  model      a tiny FP8 / FP4 DeepSeek-V4 (test_deepseek_v4_quant's folder): the fused
             stored-format glue taken (its launches counted), graphed decode tokens equal the
             eager ones, and the greedy tokens equal ENGRAM_TRT_DSV4_QUANT_FUSED=0's; with
             ENGRAM_TRT_DSV4_QUANT_PROLOGUE=1 its eager decode logits equal =0's bit for bit,
             with two norm_rope launches fewer per layer and step (q_a_norm, the inverse RoPE).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from .helpers import env
from .test_deepseek_v4_quant import (
    _load,
    folders,  # noqa: F401  (the module-scoped fixture)
)
from .test_quant_kernels import _out_u, _weight64, experts_reference, gemv_bound

pytestmark = pytest.mark.gpu


def _t():
    import torch

    return torch


@pytest.fixture(scope="module")
def dev():
    torch = _t()
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from engram_trt.native import quant_decode as qd

    why = qd.unavailable()
    if why is not None:
        pytest.fail(f"the stored-format decode kernels are unavailable: {why}")
    return torch.device("cuda", 0)


def _qweight(gen, dev, kind: str, N: int, K: int, fmt: str = "ue8m0", lead: tuple = ()):
    from engram_trt.quant.formats import quantize_fp4, quantize_fp8
    from engram_trt.quant.weight import QuantWeight

    torch = _t()
    w = torch.randn(*lead, N, K, generator=gen, device=dev) / K**0.5
    if kind == "bf16":
        return w.to(torch.bfloat16)
    if kind == "fp8":
        q, s = quantize_fp8(w, (128, 128), fmt)
        return QuantWeight(q.contiguous(), s.contiguous(), "fp8", (128, 128))
    q, s = quantize_fp4(w)
    return QuantWeight(q.contiguous(), s.contiguous(), "fp4", (1, 32))


def _kind(w) -> str:
    return "bf16" if isinstance(w, _t().Tensor) else w.kind


def _reference(x, w):
    """(float64 product, float64 magnitude) of x @ W^T with x quantized as the kernel stages it."""
    from engram_trt.native.quant_decode import ACT_QUANT
    from engram_trt.quant.formats import act_quant

    kind = _kind(w)
    a = x.float()
    if kind in ACT_QUANT:
        a = act_quant(a.cpu(), *ACT_QUANT[kind])[2].to(x.device)
    W = _weight64(w)[0]
    a = a.double()
    return a @ W.T, a.abs() @ W.abs().T


@pytest.mark.parametrize("T", [1, 2, 3, 4, 5, 8])
def test_segments_against_float64(dev, T: int) -> None:
    from engram_trt.native import quant as nq
    from engram_trt.native import quant_decode as qd

    torch = _t()
    gen = torch.Generator(device=dev).manual_seed(100 + T)
    x1 = torch.randn(T, 320, generator=gen, device=dev).to(torch.bfloat16)  # K = 320: a partial 128-block
    x2 = torch.randn(T, 224, generator=gen, device=dev).to(torch.bfloat16)
    grouped = torch.randn(T, 2 * 272, generator=gen, device=dev).to(torch.bfloat16)  # two groups of K = 272
    x1[0, :128] *= 50.0  # a group far larger than its neighbours: per-group scales matter
    weights = [
        (x1, _qweight(gen, dev, "fp8", 200, 320, "float")),
        (x1, _qweight(gen, dev, "fp8", 130, 320, "ue8m0")),
        (x2, _qweight(gen, dev, "fp4", 96, 224)),
        (x1, _qweight(gen, dev, "bf16", 72, 320)),
        (grouped[:, :272], _qweight(gen, dev, "fp8", 136, 272, "ue8m0")),
        (grouped[:, 272:], _qweight(gen, dev, "fp8", 136, 272, "ue8m0")),
    ]
    big = torch.zeros(T, 2 * 136 + 8, dtype=torch.bfloat16, device=dev)  # the grouped outputs: slices of one buffer
    outs = [
        torch.full(
            (T, w.shape[0] if _kind(w) == "bf16" else w.out_features), float("nan"), dtype=torch.bfloat16, device=dev
        )
        for _x, w in weights[:4]
    ] + [big[:, :136], big[:, 136:272]]
    for (x, w), out in zip(weights, outs):
        assert qd.segment_reason(x, w) is None, qd.segment_reason(x, w)
    qd.gemv_segments([(x, w, out) for (x, w), out in zip(weights, outs)])
    torch.cuda.synchronize()
    for i, ((x, w), out) in enumerate(zip(weights, outs)):
        kind = _kind(w)
        ref, mag = _reference(x, w)
        bound = gemv_bound(kind, int(x.shape[1]), ref, mag, torch.bfloat16)
        err = (out.double() - ref).abs()
        ok = bool(torch.isfinite(out).all()) and bool((err <= bound).all())
        assert ok, (
            f"segments T {T}: segment {i} ({kind} {list(ref.shape)}) within the float64 GEMV bound: worst err / bound "
            f"{float((err / bound).max()):.3f}"
        )
        if kind != "bf16":
            one = nq.linear(x.contiguous(), w)
            gap = (out.double() - one.double()).abs()
            assert bool((gap <= 2 * bound).all()), (
                f"segments T {T}: segment {i} equals native.quant.linear within both bounds: worst gap / 2 bound "
                f"{float((gap / (2 * bound)).max()):.3f}"
            )
    assert bool((big[:, 272:] == 0).all()), f"segments T {T}: the padding column after the grouped outputs untouched"


SEGMENT_KINDS = [("fp8", "float"), ("fp8", "ue8m0"), ("fp4", "ue8m0"), ("bf16", "ue8m0")]


def _fill(T: int, N: int, dev) -> Any:
    torch = _t()
    return torch.full((T, N), float("nan"), dtype=torch.bfloat16, device=dev)


@pytest.mark.parametrize("T", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("K", [320, 1536])
def test_norm_prologue_equals_norm_rope_then_segments(dev, T: int, K: int) -> None:
    """q_a_norm folded into the stored-format q_b: every kind of segment sharing one strided
    x, the prologue's output = norm_rope's NORM_WEIGHTED job (launched beside a wider job, as
    the layer's kv job rides with it) into a bf16 buffer, then the segments, bit for bit."""
    from engram_trt.native import decode
    from engram_trt.native import quant_decode as qd

    torch = _t()
    gen = torch.Generator(device=dev).manual_seed(31 * T + K)
    x = (1.5 * torch.randn(T, K + 24, generator=gen, device=dev)).to(torch.bfloat16)[:, :K]  # row stride K + 24
    x[0, 128:256] *= 40.0  # a group far larger than its neighbours: per-group scales matter
    norm_w = (1 + 0.3 * torch.randn(K, generator=gen, device=dev)).contiguous()
    weights = [_qweight(gen, dev, kind, n, K, fmt) for (kind, fmt), n in zip(SEGMENT_KINDS, (200, 130, 96, 72))]
    untouched = x.clone()
    got = [_fill(T, _out(w), dev) for w in weights]
    qd.gemv_segments(
        [(x, w, o) for w, o in zip(weights, got)],
        prologue=decode.GemvPrologue(decode.PROLOGUE_RMSNORM, K, weight=norm_w, eps=1e-6),
    )
    normed = torch.empty(T, K, dtype=torch.bfloat16, device=dev)
    wide = torch.randn(T, 2048, generator=gen, device=dev).to(torch.bfloat16)
    ones = torch.ones(2048, device=dev)
    decode.norm_rope(
        decode.NormRopeJob(x, normed, dim=K, norm=decode.NORM_WEIGHTED, weight=norm_w, eps=1e-6),
        decode.NormRopeJob(wide, torch.empty_like(wide), dim=2048, norm=decode.NORM_WEIGHTED, weight=ones, eps=1e-6),
    )
    want = [_fill(T, _out(w), dev) for w in weights]
    qd.gemv_segments([(normed, w, o) for w, o in zip(weights, want)])
    torch.cuda.synchronize()
    tag = f"T {T} K {K}"
    for i, (a, b) in enumerate(zip(got, want)):
        assert bool(torch.isfinite(a).all()) and torch.equal(a, b), (
            f"RMSNorm prologue = norm_rope then the segments, bit for bit, {tag}: segment {i} ({SEGMENT_KINDS[i]}) "
            f"differs at {int((a != b).sum())} of {a.numel()} outputs"
        )
    assert torch.equal(x, untouched), f"RMSNorm prologue leaves x as it was, {tag}"


@pytest.mark.parametrize("T", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("heads,d,pairs,groups", [(2, 128, 32, 2), (8, 48, 12, 2), (16, 128, 32, 4)])
def test_rope_prologue_equals_inverse_rope_then_segments(dev, T: int, heads: int, d: int, pairs: int, groups: int):
    """The inverse RoPE folded into the stored-format grouped o_a: each group a segment (a
    slice of the core's output starting at a head, its outputs a slice of one buffer), the
    groups' weights of every kind, per_in 192 (not a multiple of 128) among them: = the
    inverse rotation's norm_rope launch in place then the segments, bit for bit."""
    from engram_trt.native import decode
    from engram_trt.native import quant_decode as qd

    torch = _t()
    gen = torch.Generator(device=dev).manual_seed(7 * T + heads + d)
    per_in, R = heads * d // groups, 136
    flat = torch.randn(T, heads * d, generator=gen, device=dev).to(torch.bfloat16)
    ang = torch.rand(T, 1, generator=gen, device=dev) * 1000.0 * 10000.0 ** -(torch.arange(pairs, device=dev) / pairs)
    cos, sin = torch.cos(ang), torch.sin(ang)
    kinds = [SEGMENT_KINDS[g % len(SEGMENT_KINDS)] for g in range(groups)]
    weights = [_qweight(gen, dev, kind, R, per_in, fmt) for kind, fmt in kinds]
    untouched = flat.clone()

    def run(x, prologue):
        y = torch.zeros(T, groups * R + 8, dtype=torch.bfloat16, device=dev)
        qd.gemv_segments(
            [(x[:, g * per_in : (g + 1) * per_in], weights[g], y[:, g * R : (g + 1) * R]) for g in range(groups)],
            prologue=prologue,
        )
        return y

    y = run(flat, decode.GemvPrologue(decode.PROLOGUE_ROPE, d, rope_pairs=pairs, cos=cos, sin=sin, rope_sign=-1))
    rotated = flat.clone()
    decode.norm_rope(
        decode.NormRopeJob(rotated, rotated, dim=d, heads=heads, rope_pairs=pairs, cos=cos, sin=sin, rope_sign=-1)
    )
    y2 = run(rotated, None)
    torch.cuda.synchronize()
    tag = f"T {T} heads {heads}x{d} pairs {pairs} groups {groups}"
    assert bool(torch.isfinite(y[:, : groups * R]).all()) and torch.equal(y, y2), (
        f"RoPE prologue = the inverse RoPE launch then the segments, bit for bit, {tag}: "
        f"{int((y != y2).sum())} of {y.numel()} outputs differ"
    )
    assert not torch.equal(rotated, flat), f"the rotation changed the core's output (the test exercises it), {tag}"
    assert torch.equal(flat, untouched), f"RoPE prologue leaves x as it was, {tag}"
    assert bool((y[:, groups * R :] == 0).all()), f"the padding after the grouped outputs untouched, {tag}"


def _out(w) -> int:
    return int(w.shape[0]) if _kind(w) == "bf16" else int(w.out_features)


def _shared_reach(h, Wd) -> Any:
    """How far two evaluations of the shared expert may lie apart when their float32 sums
    differ only in order: gate / up may then round to neighbouring bf16 values, so h (bf16)
    by up to 3 bf16 steps relative (2^-8 each: gate, silu, the product; up's is inside the
    product's), and its fp8 quantization by one e4m3 step (2^-3 relative, the code or the
    group scale moving) on top: |delta h_q| <= (3 2^-8 + 2^-3 + 2^-3 2^-8 3) |h| elementwise;
    the down product of that, plus both sums' GEMV bounds, plus two bf16 roundings of the
    output (the shared value's and the sum's) of the result."""
    rel = 3 * 2.0**-8 + 2.0**-3 + 3 * 2.0**-11
    return rel * (h.abs() @ Wd.abs().T)


@pytest.mark.parametrize("T,k,E,limit", [(1, 2, 4, 7.0), (3, 2, 8, 10.0), (4, 6, 8, 7.0), (8, 2, 4, 7.0)])
def test_moe_against_float64_and_the_old_path(dev, T: int, k: int, E: int, limit: float) -> None:
    import torch.nn.functional as F
    from engram_trt.native import quant as nq
    from engram_trt.native import quant_decode as qd

    torch = _t()
    D, I, Is = 160, 96, 80  # none a multiple of 128: partial FP8 blocks
    gen = torch.Generator(device=dev).manual_seed(7 * T + k)
    gate = _qweight(gen, dev, "fp4", I, D, lead=(E,))
    up = _qweight(gen, dev, "fp4", I, D, lead=(E,))
    down = _qweight(gen, dev, "fp4", D, I, lead=(E,))
    sg, su = _qweight(gen, dev, "fp8", Is, D, "ue8m0"), _qweight(gen, dev, "fp8", Is, D, "ue8m0")
    sd = _qweight(gen, dev, "fp8", D, Is, "ue8m0")
    x = (2 * torch.randn(T, D, generator=gen, device=dev)).to(torch.bfloat16)
    rng = np.random.default_rng(T * 31 + k)
    ids = torch.from_numpy(np.stack([rng.choice(E, size=k, replace=False) for _ in range(T)])).to(dev, torch.int32)
    route_w = torch.rand(T, k, generator=gen, device=dev)
    assert qd.moe_reason(x, k, gate, up, down, (sg, su, sd)) is None
    routed = qd.moe(x, ids, route_w, gate, up, down, shared=None, limit=limit)
    lo, hi = experts_reference(x, ids, route_w, gate, up, down, limit, "gemv", "gemv")
    u = _out_u(torch.bfloat16)
    lo_t = torch.from_numpy(lo - u * np.abs(lo))
    hi_t = torch.from_numpy(hi + u * np.abs(hi))
    got = routed.double().cpu()
    inside = (got >= lo_t) & (got <= hi_t)
    tag = f"T {T} k {k} E {E} limit {limit}"
    assert bool(inside.all()) and bool(torch.isfinite(got).all()), (
        f"fused MoE (routed) within the float64 interval, {tag}: {int((~inside).sum())} outside"
    )
    fused = qd.moe(x, ids, route_w, gate, up, down, shared=(sg, su, sd), limit=limit)
    # the old path: native.quant.experts + the shared expert as fused.moe's fallback computes it
    old_routed = nq.experts(x, ids, route_w, gate, up, down, limit=limit)
    g, uu = nq.linear(x, sg), nq.linear(x, su)
    h = F.silu(g.clamp(max=limit)) * uu.clamp(min=-limit, max=limit)
    old = old_routed + nq.linear(h, sd)
    Wd = _weight64(sd)[0].to(dev)
    reach = _shared_reach(h.double(), Wd)
    ref, mag = _reference(h, sd)
    sbound = 2 * gemv_bound("fp8", Is, ref, mag, torch.bfloat16)
    width = torch.from_numpy(hi - lo).to(dev) + u * torch.from_numpy(np.abs(lo) + np.abs(hi)).to(dev)
    out_round = 2 * u * (old.double().abs() + fused.double().abs())
    gap = (fused.double() - old.double()).abs()
    bound = width + reach + sbound + out_round
    assert bool(torch.isfinite(fused).all()) and bool((gap <= bound).all()), (
        f"fused MoE (routed + shared) equals the old path within its reach, {tag}: "
        f"worst gap / bound {float((gap / bound).max()):.3f}; identical {float((gap == 0).double().mean()):.3f}"
    )
    again = qd.moe(x, ids, route_w, gate, up, down, shared=(sg, su, sd), limit=limit)
    assert bool(torch.equal(fused, again)), f"fused MoE deterministic, {tag}"
    # a pick of no expert (id E) adds nothing: the same bits as that pick at weight 0
    bad_ids, zero_w = ids.clone(), route_w.clone()
    bad_ids[0, 0], zero_w[0, 0] = E, 0.0
    no_pick = qd.moe(x, bad_ids, route_w, gate, up, down, shared=(sg, su, sd), limit=limit)
    zero_pick = qd.moe(x, ids, zero_w, gate, up, down, shared=(sg, su, sd), limit=limit)
    assert bool(torch.equal(no_pick, zero_pick)), f"fused MoE: a pick outside [0, E) adds nothing, {tag}"


def test_tiny_quantized_model_graphed_decode_equals_eager(
    dev,
    folders: dict[str, Path],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from engram_trt.models.deepseek_v4 import fused
    from engram_trt.models.step import PackedStep
    from engram_trt.native import quant_decode as qd
    from engram_trt.runtime.cuda_graphs import DecodeGraphs

    torch = _t()
    model = _load(folders["q"], "cuda", torch.bfloat16)
    slots, max_len, steps = 3, 64, 10
    gen = torch.Generator().manual_seed(3)
    lens = [5, 9, 13]
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=gen).tolist() for n in lens]
    calls = {"gemv_segments": 0, "moe": 0}
    for name in calls:
        real = getattr(qd, name)

        def counted(*args: Any, _real: Any = real, _name: str = name, **kw: Any) -> Any:
            calls[_name] += 1
            return _real(*args, **kw)

        monkeypatch.setattr(qd, name, counted)
    for label, switch in (("fused", "1"), ("old", "0")):
        with env(fused.QUANT_FUSED_ENV, switch):
            eager, graphed = model.new_cache(slots + 1, max_len), model.new_cache(slots + 1, max_len)
            step = PackedStep(torch.tensor([t for p in prompts for t in p]), lens, [0] * slots, list(range(slots)))
            first = None
            for st in (eager, graphed):
                first = model.forward_step(step, st)
            graphs = DecodeGraphs(model, graphed, slots, scratch_slot=slots)
            toks = first.argmax(-1).tolist()
            past = list(lens)
            eager_toks, graph_toks = [], []
            gt = list(toks)
            for _ in range(steps):
                ids = torch.tensor(toks)
                want = model.forward_step(PackedStep(ids, [1] * slots, past, list(range(slots))), eager)
                got = graphs.run(PackedStep(torch.tensor(gt), [1] * slots, past, list(range(slots))), None)
                assert got is not None, f"{label}: the quantized model's decode step replayed: failed: {graphs.failed}"
                toks = want.argmax(-1).tolist()
                gt = got.argmax(-1).tolist()
                eager_toks.append(toks)
                graph_toks.append(gt)
                past = [p + 1 for p in past]
            assert graph_toks == eager_toks, (
                f"{label}: FP8 / FP4 tiny model graphed greedy tokens equal eager's over {steps} steps: eager "
                f"{eager_toks[:3]} graphed {graph_toks[:3]}"
            )
            if label == "fused":
                # per eager decode step: 2 MoE layers (a hash_moe and a moe, both stored FP4 / FP8), and
                # the attention's q_a + kv, q_b, o_a and o_b of 3 layers at least
                assert calls["moe"] >= 2 * steps and calls["gemv_segments"] >= 4 * 3 * steps, (
                    f"fused: the stored-format kernels served the MoE and the projections: calls {calls}"
                )
                calls.update(gemv_segments=0, moe=0)
    assert calls["moe"] == 0 and calls["gemv_segments"] == 0, (
        f"old: ENGRAM_TRT_DSV4_QUANT_FUSED=0 keeps the stored-format decode kernels out: calls {calls}"
    )


def test_tiny_quantized_model_prologues_same_bits_fewer_launches(
    dev,
    folders: dict[str, Path],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The FP8 tiny model's eager decode steps with ENGRAM_TRT_DSV4_QUANT_PROLOGUE=1 (q_a_norm
    in the stored-format q_b's launch, the inverse RoPE in the grouped o_a's) against =0 (each
    its own norm_rope launch first): the logits equal bit for bit, the stored-format segment
    launches as many, and per layer and step two norm_rope launches fewer, the two prologues
    taken once each."""
    from engram_trt.models.deepseek_v4 import fused
    from engram_trt.models.step import PackedStep
    from engram_trt.native import decode
    from engram_trt.native import quant_decode as qd

    torch = _t()
    model = _load(folders["q"], "cuda", torch.bfloat16)
    layers = model.config.num_hidden_layers
    calls: dict[str, int] = {}
    for mod, name in ((qd, "gemv_segments"), (decode, "norm_rope")):
        real = getattr(mod, name)

        def counted(*args: Any, _real: Any = real, _name: str = name, **kw: Any) -> Any:
            calls[_name] = calls.get(_name, 0) + 1
            if kw.get("prologue") is not None:
                calls["prologue"] = calls.get("prologue", 0) + 1
            return _real(*args, **kw)

        monkeypatch.setattr(mod, name, counted)
    slots, steps = 3, 6
    gen = torch.Generator().manual_seed(5)
    lens = [6, 11, 4]
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=gen).tolist() for n in lens]
    runs = {}
    for switch in ("0", "1"):
        with env(fused.PROLOGUE_ENV, "1"), env(fused.QUANT_PROLOGUE_ENV, switch):
            cache = model.new_cache(slots + 1, 64)
            step = PackedStep(torch.tensor([t for p in prompts for t in p]), lens, [0] * slots, list(range(slots)))
            toks = model.forward_step(step, cache).argmax(-1).tolist()
            calls.clear()
            past, logits = list(lens), []
            for _ in range(steps):
                out = model.forward_step(PackedStep(torch.tensor(toks), [1] * slots, past, list(range(slots))), cache)
                logits.append(out)
                toks = out.argmax(-1).tolist()
                past = [p + 1 for p in past]
            torch.cuda.synchronize()
            runs[switch] = (logits, dict(calls))
    (off, off_calls), (on, on_calls) = runs["0"], runs["1"]
    same = [bool(torch.equal(a, b)) for a, b in zip(off, on)]
    assert all(same), f"QUANT_PROLOGUE=1 decode logits equal =0's bit for bit, per step: {same}"
    assert on_calls.get("gemv_segments") == off_calls.get("gemv_segments") and on_calls.get("gemv_segments", 0) > 0, (
        f"the same stored-format segment launches with and without the prologues: on {on_calls}, off {off_calls}"
    )
    fewer = off_calls.get("norm_rope", 0) - on_calls.get("norm_rope", 0)
    assert fewer == 2 * layers * steps, (
        f"two norm_rope launches fewer per layer and step ({layers} layers, {steps} steps): on {on_calls}, "
        f"off {off_calls}"
    )
    took = on_calls.get("prologue", 0) - off_calls.get("prologue", 0)
    assert took == 2 * layers * steps, f"q_b and o_a took the stored-format prologues: on {on_calls}, off {off_calls}"
