"""DeepSeek-V4's fused decode glue on a GPU (models/deepseek_v4/fused.py over
native/decode.py and the fused mHC norms of native/mhc.py) against the PyTorch modules
each kernel replaces, on the same GPU:

1. ``norm_rope``: the weighted RMSNorm (compressors.RMSNorm), the per-head unweighted
   norm (unweighted_rms_norm), the interleaved RoPE (apply_rope) and its inverse, in
   float32 / bf16 / fp16, on strided inputs and in place. A job without a norm is the
   reference bit for bit (the same float32 ops, each rounded alone); with a norm the two
   differ by the sum of squares' order: ``|got - ref| <= (2u + 1e-5) (|ref| + t)``, t the
   rotation's terms ``(|y0| + |y1|)(|c| + |s|)`` (one ulp of the normed value may flip, then
   the rotation's own rounding; 4u on t for the unweighted norm, whose reciprocal RMS is
   rounded first; u = 2^-8 bf16, 2^-11 fp16, 0 float32). Four jobs in one
   launch equal each job alone, bit for bit. Qwen4Exp's OffsetRMSNorm on the kernel (a
   weight per group) against its PyTorch form within one rounding flip.
2. ``gemv_segments``: each segment equals ``engram_gemv_bf16`` on the same operands bit for
   bit (the same per-warp product), strided x / out slices and the grouped output
   projection's groups included; against float64: ``u |ref| + K 2^-23 sum|x w|``.
3. ``moe_route``: on the very logits torch's router sees, the picks of TopKRouter /
   HashRouter (modules.py) exactly and their weights within (k + 1) eps (the same formulas;
   the sum over top 6 / 8 picks may add in another order; whether each case came out bit
   for bit is noted); all-equal keys pick the lowest ids (the documented rule, a NumPy
   oracle).
4. ``moe_experts``: with the kernel's picks given to both, the routed experts (the
   module's reference loop form) plus the shared expert, bf16, at the tiny and the bench
   width: ``|got - ref| <= 4u (|ref| + sum_j |w_j| (|y_j| + t_j) + |y_s| + t_s)`` with t the
   down products' float64 term sums (each rounding of the chain may flip one ulp).
5. ``mhc_pre_norm`` / ``mhc_head_norm``: post / comb equal ``mhc_pre``'s bit for bit; the
   normed output within ``2u |ref| + 1e-5 max`` of RMSNorm applied to ``mhc_pre``'s own
   collapse, and within ``6u |ref| + 2e-5 max`` of the PyTorch collapse + RMSNorm.
6. Whole models (three layer mixes of tests/gpu/test_deepseek_v4_graphs.py): bf16
   decode steps with the fused glue against a float32 model: at most 2x the unfused bf16
   step's distance + 1e-3 (``ENGRAM_TRT_DSV4_FUSED=0`` gives the unfused one), the MoE of
   a decode step on the ``fused`` form; GPU work items (kernels, memsets, copies) per
   module kind of one eager decode step at the bench's 1.63B width, fused and unfused
   (torch.profiler's device events between marker kernels; noted in the JSON).
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from .helpers import cuda_normal, env, excess, note, say

UNIT = {"float32": 0.0, "bfloat16": 2.0**-8, "float16": 2.0**-11}
DTYPES = ["float32", "bfloat16", "float16"]


def _fused(on: bool):
    from engram_trt.models.deepseek_v4 import fused

    return env(fused.FUSED_ENV, "1" if on else "0")


# --- 1. norm_rope ------------------------------------------------------------------------------------


def _rope_ref(y, cos, sin):
    """(rotated, terms) of the PyTorch apply_rope over y [T, H, d] and its bound's terms."""
    from engram_trt.models.deepseek_v4.compressors import apply_rope

    half = cos.shape[-1]
    out = apply_rope(y, cos.unsqueeze(1), sin.unsqueeze(1))
    d = y.shape[-1]
    yr = y[..., d - 2 * half :].double().abs()
    cs = (cos.to(y.dtype).double().abs() + sin.to(y.dtype).double().abs()).unsqueeze(1)
    pair = (yr[..., 0::2] + yr[..., 1::2]) * cs
    terms = y.double().abs().clone()
    terms[..., d - 2 * half :] = pair.repeat_interleave(2, dim=-1)
    return out, terms


NORM_ROPE_SHAPES = [(1, 16, 256, 32, 768), (3, 4, 32, 8, 40), (5, 2, 24, 3, 96)]  # (T, heads, head_dim, pairs, q_lora)


@pytest.mark.parametrize("T,H,d,pairs,lora", NORM_ROPE_SHAPES)
@pytest.mark.parametrize("dname", DTYPES)
def test_norm_rope_matches_the_torch_modules(rng, dname, T, H, d, pairs, lora) -> None:
    import torch

    from engram_trt.models.deepseek_v4.compressors import RMSNorm, apply_rope, unweighted_rms_norm
    from engram_trt.native import decode

    dtype, u = getattr(torch, dname), UNIT[dname]
    Job = decode.NormRopeJob
    tag = f"T {T} H {H} d {d} pairs {pairs} {dname}"
    cos, sin = cuda_normal(rng, (T, pairs)).cos() * 1.1, cuda_normal(rng, (T, pairs)).sin() * 1.1
    with torch.no_grad():
        # weighted norm of a strided slice (q_a), no rope
        wide = cuda_normal(rng, (T, lora + 24), 2.0, dname)
        x = wide[:, 8 : 8 + lora]
        norm = RMSNorm(lora, 1e-6).to("cuda")
        norm.weight.copy_(cuda_normal(rng, (lora,), 0.3) + 1.0)
        got = torch.empty(T, lora, dtype=dtype, device="cuda")
        decode.norm_rope(Job(x, got, dim=lora, norm=decode.NORM_WEIGHTED, weight=norm.weight, eps=1e-6))
        ref = norm(x)
        err = excess(got, ref, (2 * u + 1e-5) * ref.double().abs() + 1e-30)
        assert err <= 0, f"weighted RMSNorm = RMSNorm, {tag}: max excess {err:.3g}"
        # weighted norm + rope (kv), in place
        kv = cuda_normal(rng, (T, d), 1.5, dname)
        knorm = RMSNorm(d, 1e-6).to("cuda")
        knorm.weight.copy_(cuda_normal(rng, (d,), 0.3) + 1.0)
        y = knorm(kv)
        ref, terms = _rope_ref(y.view(T, 1, d), cos, sin)
        got = kv.clone()
        decode.norm_rope(
            Job(
                got,
                got,
                dim=d,
                norm=decode.NORM_WEIGHTED,
                weight=knorm.weight,
                eps=1e-6,
                rope_pairs=pairs,
                cos=cos,
                sin=sin,
            )
        )
        err = excess(got.view(T, 1, d), ref, (2 * u + 1e-5) * (ref.double().abs() + terms) + 1e-30)
        assert err <= 0, f"kv norm + RoPE in place = kv_norm + apply_rope, {tag}: max excess {err:.3g}"
        # per-head unweighted norm + rope (q)
        q = cuda_normal(rng, (T, H * d), 3.0, dname)
        y = unweighted_rms_norm(q.view(T, H, d), 1e-6)
        ref, terms = _rope_ref(y, cos, sin)
        got = torch.empty_like(q)
        decode.norm_rope(
            Job(q, got, dim=d, heads=H, norm=decode.NORM_UNWEIGHTED, eps=1e-6, rope_pairs=pairs, cos=cos, sin=sin)
        )
        # the reciprocal RMS is rounded to the dtype first: a flip of it moves every value of the head
        err = excess(got.view(T, H, d), ref, (2 * u + 1e-5) * ref.double().abs() + (4 * u + 1e-5) * terms + 1e-30)
        assert err <= 0, f"q per-head norm + RoPE = unweighted_rms_norm + apply_rope, {tag}: max excess {err:.3g}"
        # rope alone and its inverse in place: bit for bit
        o = cuda_normal(rng, (T, H * d), 1.0, dname)
        fwd = torch.empty_like(o)
        decode.norm_rope(Job(o, fwd, dim=d, heads=H, rope_pairs=pairs, cos=cos, sin=sin))
        same = torch.equal(fwd.view(T, H, d), apply_rope(o.view(T, H, d), cos.unsqueeze(1), sin.unsqueeze(1)))
        inv = o.clone()
        decode.norm_rope(Job(inv, inv, dim=d, heads=H, rope_pairs=pairs, cos=cos, sin=sin, rope_sign=-1))
        same_inv = torch.equal(inv.view(T, H, d), apply_rope(o.view(T, H, d), cos.unsqueeze(1), -sin.unsqueeze(1)))
        assert same and same_inv, f"RoPE and its inverse (in place) = apply_rope bit for bit, {tag}"
        # the four jobs in one launch = each alone
        outs = [
            torch.empty(T, lora, dtype=dtype, device="cuda"),
            torch.empty(T, d, dtype=dtype, device="cuda"),
            torch.empty_like(q),
            torch.empty_like(o),
        ]
        jobs = [
            Job(x, outs[0], dim=lora, norm=decode.NORM_WEIGHTED, weight=norm.weight, eps=1e-6),
            Job(
                kv,
                outs[1],
                dim=d,
                norm=decode.NORM_WEIGHTED,
                weight=knorm.weight,
                eps=1e-6,
                rope_pairs=pairs,
                cos=cos,
                sin=sin,
            ),
            Job(q, outs[2], dim=d, heads=H, norm=decode.NORM_UNWEIGHTED, eps=1e-6, rope_pairs=pairs, cos=cos, sin=sin),
            Job(o, outs[3], dim=d, heads=H, rope_pairs=pairs, cos=cos, sin=sin, rope_sign=-1),
        ]
        decode.norm_rope(*jobs)
        alone = []
        for j in jobs:
            one = torch.empty_like(j.out)
            decode.norm_rope(
                Job(j.x, one, j.dim, j.heads, j.norm, j.weight, j.eps, j.rope_pairs, j.cos, j.sin, j.rope_sign)
            )
            alone.append(one)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(outs, alone)), (
        f"four jobs in one launch = each alone, bit for bit, {tag}: "
    )


def _offset_norm(rng, group):
    """(OffsetRMSNorm on the GPU with a random weight, its size) for weight group ``group``."""
    import torch

    from engram_trt.models.qwen4_exp.norms import OffsetRMSNorm

    size = 4 * 2048 if group == 2048 else (4 * 64 if group == 64 else 768)
    norm = OffsetRMSNorm(size, 1e-6, group_size=group).cuda()
    with torch.no_grad():
        norm.weight.copy_(cuda_normal(rng, (size,), 0.3))
    return norm, size


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("group", [None, 64, 2048])
def test_offset_norm_kernel_matches_offset_rms_norm(rng, group, T) -> None:
    """Qwen4Exp's OffsetRMSNorm on the kernel (a weight per group through weight_stride, 1 + w
    made once) against its PyTorch form, bf16: one rounding flip at most (the sum of squares'
    order), ``(2u + 1e-5) |ref|``; a second call reuses the made weight and gives the same
    bits (a changed weight: the next test)."""
    import torch

    from engram_trt.models.qwen4_exp.norms import offset_rms_norm

    u = UNIT["bfloat16"]
    norm, size = _offset_norm(rng, group)
    with torch.no_grad():
        x = cuda_normal(rng, (T, size), 2.0, "bfloat16")
        got = norm.forward_kernel(x)
        ref = offset_rms_norm(x, norm.weight, 1e-6, group)
        err = excess(got, ref, (2 * u + 1e-5) * ref.double().abs() + 1e-30)
        again = norm(x)
    assert err <= 0 and torch.equal(got, again), (
        f"OffsetRMSNorm kernel = offset_rms_norm, size {size} group {group} T {T}: max excess {err:.3g}"
    )


@pytest.mark.parametrize("group", [None, 64, 2048])
def test_offset_norm_kernel_follows_a_changed_weight(rng, group) -> None:
    """After the kernel has made 1 + w once, a changed weight is seen (bound as above)."""
    import torch

    from engram_trt.models.qwen4_exp.norms import offset_rms_norm

    u = UNIT["bfloat16"]
    norm, size = _offset_norm(rng, group)
    with torch.no_grad():
        norm.forward_kernel(cuda_normal(rng, (1, size), 2.0, "bfloat16"))  # the made weight, as a first call leaves it
        norm.weight.add_(0.5)
        x = cuda_normal(rng, (2, size), 1.0, "bfloat16")
        err = excess(
            norm(x),
            offset_rms_norm(x, norm.weight, 1e-6, group),
            (2 * u + 1e-5) * offset_rms_norm(x, norm.weight, 1e-6, group).double().abs() + 1e-30,
        )
        assert err <= 0, (
            f"OffsetRMSNorm kernel follows a changed weight, size {size} group {group}: max excess {err:.3g}"
        )


# --- 2. gemv_segments --------------------------------------------------------------------------------


@pytest.mark.parametrize("T", [1, 2, 3, 4])
def test_gemv_segments_equal_the_gemv(rng, T) -> None:
    import torch

    from engram_trt.native import backbone, decode

    u = UNIT["bfloat16"]
    tag = f"T {T}"
    wide = cuda_normal(rng, (T, 2048 + 64), 1.0, "bfloat16")
    x = wide[:, :2048]  # rows 2112 apart: a strided x
    ws = [cuda_normal(rng, (n, 2048), 2048**-0.5, "bfloat16") for n in (768, 256, 61, 512)]
    outs = [torch.empty(T, w.shape[0], dtype=torch.bfloat16, device="cuda") for w in ws]
    with torch.no_grad():
        decode.gemv_segments([(x, w, o) for w, o in zip(ws, outs)])
        xc = x.contiguous()
        alone = [backbone.gemv(xc, w) for w in ws]
    same = all(torch.equal(a, b) for a, b in zip(outs, alone))
    worst = 0.0
    for w, o in zip(ws, outs):
        ref = xc.double() @ w.double().t()
        bound = u * ref.abs() + 2048 * 2.0**-23 * (xc.double().abs() @ w.double().abs().t())
        worst = max(worst, excess(o, ref, bound))
    assert same, f"segments (q_a, kv, N 61, N 512 of one strided x) = engram_gemv_bf16 bit for bit, {tag}"
    assert worst <= 0, f"segments within float32 sums of float64, {tag}: max excess {worst:.3g}"
    # the grouped output projection: group g of x against rows g * R ..
    G, per_in, R = 4, 1024, 512
    flat = cuda_normal(rng, (T, G * per_in), 1.0, "bfloat16")
    w = cuda_normal(rng, (G * R, per_in), per_in**-0.5, "bfloat16")
    y = torch.empty(T, G * R, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        decode.gemv_segments(
            [
                (flat[:, g * per_in : (g + 1) * per_in], w[g * R : (g + 1) * R], y[:, g * R : (g + 1) * R])
                for g in range(G)
            ]
        )
        alone = torch.cat(
            [
                backbone.gemv(flat[:, g * per_in : (g + 1) * per_in].contiguous(), w[g * R : (g + 1) * R])
                for g in range(G)
            ],
            dim=1,
        )
    assert torch.equal(y, alone), f"grouped o_a as segments = each group's engram_gemv_bf16, {tag}"


@pytest.mark.parametrize("T", [1, 3, 4, 5, 8])
@pytest.mark.parametrize("q_lora,heads,d,pairs,groups", [(768, 16, 256, 32, 4), (200, 4, 40, 8, 2)])
def test_gemv_prologues_equal_the_launches_they_replace(rng, T, q_lora, heads, d, pairs, groups) -> None:
    """engram_gemv_segments_bf16_ex: the RMSNorm prologue (q_a_norm before q_b and the
    indexer's q_b) = norm_rope's NORM_WEIGHTED launch then the GEMV, bit for bit; the RoPE
    prologue (the inverse RoPE before the grouped o_a) = norm_rope's inverse rotation then
    the GEMV, bit for bit; 5-8 rows (the _ex entry alone) = each row's own product bit for
    bit and within float32 sums of float64. The bench's widths and partial ones (q_lora
    200, head_dim 40: neither a multiple of 128)."""
    import torch

    from engram_trt.native import decode

    u = UNIT["bfloat16"]
    tag = f"T {T} q_lora {q_lora} heads {heads}x{d} pairs {pairs} groups {groups}"
    # a strided row set, as project's outputs are not
    q_a = cuda_normal(rng, (T, q_lora + 24), 1.3, "bfloat16")[:, :q_lora]
    norm_w = (1 + 0.3 * cuda_normal(rng, (q_lora,))).contiguous()
    ws = [cuda_normal(rng, (n, q_lora), q_lora**-0.5, "bfloat16") for n in (heads * d, 61)]
    with torch.no_grad():
        got = [torch.empty(T, w.shape[0], dtype=torch.bfloat16, device="cuda") for w in ws]
        decode.gemv_segments(
            [(q_a, w, o) for w, o in zip(ws, got)],
            prologue=decode.GemvPrologue(decode.PROLOGUE_RMSNORM, q_lora, weight=norm_w, eps=1e-6),
        )
        normed = torch.empty(T, q_lora, dtype=torch.bfloat16, device="cuda")
        decode.norm_rope(
            decode.NormRopeJob(q_a, normed, dim=q_lora, norm=decode.NORM_WEIGHTED, weight=norm_w, eps=1e-6)
        )
        want = [torch.empty_like(o) for o in got]
        decode.gemv_segments([(normed, w, o) for w, o in zip(ws, want)])
    assert all(torch.equal(a, b) for a, b in zip(got, want)), (
        f"RMSNorm prologue = norm_rope then the GEMV, bit for bit, {tag}: "
    )
    ref = normed.double() @ ws[0].double().t()
    bound = u * ref.abs() + q_lora * 2.0**-23 * (normed.double().abs() @ ws[0].double().abs().t())
    err = excess(got[0], ref, bound)
    assert err <= 0, f"RMSNorm prologue within float32 sums of float64 (the normed input), {tag}: max excess {err:.3g}"

    # the grouped o_a of the core's output after its inverse RoPE
    per_in = heads * d // groups
    R = 96
    flat = cuda_normal(rng, (T, heads * d), 1.0, "bfloat16")
    w = cuda_normal(rng, (groups * R, per_in), per_in**-0.5, "bfloat16")
    ang = torch.from_numpy(rng.uniform(0, 100, (T, 1)) * 10000.0 ** -(np.arange(pairs) / pairs)).float().cuda()
    cos, sin = torch.cos(ang), torch.sin(ang)
    untouched = flat.clone()
    with torch.no_grad():
        y = torch.empty(T, groups * R, dtype=torch.bfloat16, device="cuda")
        decode.gemv_segments(
            [
                (flat[:, g * per_in : (g + 1) * per_in], w[g * R : (g + 1) * R], y[:, g * R : (g + 1) * R])
                for g in range(groups)
            ],
            prologue=decode.GemvPrologue(decode.PROLOGUE_ROPE, d, rope_pairs=pairs, cos=cos, sin=sin, rope_sign=-1),
        )
        rotated = flat.clone()
        decode.norm_rope(
            decode.NormRopeJob(rotated, rotated, dim=d, heads=heads, rope_pairs=pairs, cos=cos, sin=sin, rope_sign=-1)
        )
        y2 = torch.empty_like(y)
        decode.gemv_segments(
            [
                (rotated[:, g * per_in : (g + 1) * per_in], w[g * R : (g + 1) * R], y2[:, g * R : (g + 1) * R])
                for g in range(groups)
            ]
        )
    assert torch.equal(y, y2), f"RoPE prologue = the inverse RoPE launch then the GEMV, bit for bit, {tag}"
    assert torch.equal(flat, untouched), f"RoPE prologue leaves x as it was, {tag}"

    if T > decode.GEMV_MAX_TOKENS:  # the _ex entry without a prologue: each row's own product
        x = cuda_normal(rng, (T, 2048), 1.0, "bfloat16")
        wb = cuda_normal(rng, (512, 2048), 2048**-0.5, "bfloat16")
        with torch.no_grad():
            out = torch.empty(T, 512, dtype=torch.bfloat16, device="cuda")
            decode.gemv_segments([(x, wb, out)])
            rows = []
            for m in range(T):
                o = torch.empty(1, 512, dtype=torch.bfloat16, device="cuda")
                decode.gemv_segments([(x[m : m + 1], wb, o)])
                rows.append(o)
        assert torch.equal(out, torch.cat(rows)), f"{T} rows = each row's own GEMV bit for bit"
        ref = x.double() @ wb.double().t()
        err = excess(out, ref, u * ref.abs() + 2048 * 2.0**-23 * (x.double().abs() @ wb.double().abs().t()))
        assert err <= 0, f"{T} rows within float32 sums of float64: max excess {err:.3g}"


# --- 3. moe_route ------------------------------------------------------------------------------------


def _router(kind: str, E: int, k: int, score: str, D: int, dtype, rng):
    import torch

    from engram_trt.models.deepseek_v4.modules import HashRouter, TopKRouter

    cfg = SimpleNamespace(
        num_experts_per_tok=k,
        n_routed_experts=E,
        routed_scaling_factor=1.5,
        scoring_func=score,
        hidden_size=D,
        vocab_size=97,
    )
    r = (TopKRouter if kind == "topk" else HashRouter)(cfg)
    with torch.no_grad():
        r.weight.copy_(torch.from_numpy(rng.standard_normal((E, D)).astype(np.float32) * D**-0.5))
        if kind == "topk":
            r.e_score_correction_bias.copy_(torch.from_numpy(rng.standard_normal(E).astype(np.float32) * 0.1))
        else:
            first = rng.integers(0, E, (97, 1))
            r.tid2eid.copy_(torch.from_numpy((first + np.arange(k)) % E))
    r = r.to("cuda")
    r.weight.data = r.weight.data.to(dtype)
    return r


ROUTE_CASES = [
    ("topk", 8, 2, "sqrtsoftplus", 1),
    ("topk", 8, 2, "sigmoid", 4),
    ("hash", 8, 2, "sqrtsoftplus", 3),
    ("topk", 64, 6, "sqrtsoftplus", 16),
    ("topk", 256, 8, "sigmoid", 2),
    ("hash", 16, 4, "sigmoid", 5),
]


@pytest.mark.parametrize("kind,E,k,score,T", ROUTE_CASES)
@pytest.mark.parametrize("dname", ["bfloat16", "float32"])
def test_moe_route_equals_the_routers(rng, dname, kind, E, k, score, T) -> None:
    import torch
    import torch.nn.functional as F

    from engram_trt.native import decode

    dtype = getattr(torch, dname)
    tag = f"{kind} top {k} of {E}, {score}, T {T}, {dname}"
    r = _router(kind, E, k, score, 256, dtype, rng)
    x = cuda_normal(rng, (T, 256), 1.0, dname)
    ids_in = torch.from_numpy(rng.integers(0, 97, T)).to("cuda")
    with torch.no_grad():
        want_w, want_ids = r(x, ids_in)
        logits = F.linear(x, r.weight)
        if kind == "topk":
            ids, w = decode.moe_route(
                logits, top_k=k, score_fn=score, scaling=r.scaling, bias=r.e_score_correction_bias
            )
        else:
            ids, w = decode.moe_route(
                logits, top_k=k, score_fn=score, scaling=r.scaling, tid2eid=r.tid2eid, input_ids=ids_in
            )
    torch.cuda.synchronize()
    same_ids = torch.equal(ids.long().cpu(), want_ids.long().cpu())
    assert same_ids, f"picks = the module's, {tag}: {ids.tolist()[:2]} vs {want_ids.tolist()[:2]}"
    # w = score / sum(picked scores) * scaling: the sum of k positive terms taken in
    # another order differs by up to (k - 1) roundings of the sum, then the division and
    # the product round once each: (k + 1) eps relative (measured: 2 eps at k = 6 and 4)
    ulp = float(torch.finfo(dtype).eps)
    diff = (w.double().cpu() - want_w.double().cpu()).abs()
    ok = bool((diff <= (k + 1) * ulp * want_w.double().cpu().abs()).all())
    exact = bool(torch.equal(w.cpu(), want_w.float().cpu()))
    note(f"route_weights_bit_exact_{kind}_{E}_{k}_{score}_{dname}", exact)
    assert ok, (
        f"weights = the module's within (k + 1) eps (bit for bit: {exact}), {tag}: max diff {float(diff.max()):.3g}"
    )


@pytest.mark.parametrize("dname", ["bfloat16", "float32"])
def test_moe_route_equal_keys_pick_the_lowest_ids(dname) -> None:
    """All keys equal: the lowest ids, in order (the documented tie rule; a NumPy oracle)."""
    import torch

    from engram_trt.native import decode

    dtype = getattr(torch, dname)
    logits = torch.zeros(3, 16, dtype=dtype, device="cuda")
    ids, w = decode.moe_route(logits, top_k=4, score_fn="sigmoid", scaling=1.0, bias=torch.zeros(16, device="cuda"))
    oracle = np.tile(np.argsort(np.zeros(16), kind="stable")[:4], (3, 1))
    assert np.array_equal(ids.cpu().numpy(), oracle) and bool((w.cpu() == 0.25).all()), (
        f"equal keys pick the lowest ids, {dname}: {ids.tolist()}"
    )


# --- 4. moe_experts ----------------------------------------------------------------------------------


def _moe_module(D: int, I: int, E: int, k: int, rng):
    import torch

    from engram_trt.models.deepseek_v4.moe import GroupedSparseMoE

    cfg = SimpleNamespace(
        num_experts_per_tok=k,
        n_routed_experts=E,
        routed_scaling_factor=1.5,
        scoring_func="sqrtsoftplus",
        hidden_size=D,
        vocab_size=97,
        moe_intermediate_size=I,
        swiglu_limit=3.0,
        mlp_layer_types=["moe"],
    )
    m = GroupedSparseMoE(cfg, 0)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(
                torch.from_numpy(
                    rng.standard_normal(tuple(p.shape)).astype(np.float32)
                    * p.shape[-1] ** -0.5
                    * (3.0 if "gate_proj" in name or "up_proj" in name else 1.0)
                )
            )
    return m.to("cuda", torch.bfloat16)


@pytest.mark.parametrize("T", [1, 2, 4])
@pytest.mark.parametrize("D,I,E,k", [(64, 32, 8, 2), (2048, 1024, 8, 2), (256, 128, 16, 6)])
def test_moe_experts_equal_the_loop_and_the_shared_expert(rng, D, I, E, k, T) -> None:
    import torch

    from engram_trt.native import decode

    u = UNIT["bfloat16"]
    m = _moe_module(D, I, E, k, rng)
    gate, up, down = m.stack_experts()
    sh = m.shared_experts
    tag = f"D {D} I {I} top {k} of {E}, T {T}"
    x = cuda_normal(rng, (T, D), 1.0, "bfloat16")
    ids = torch.from_numpy(np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32)).cuda()
    w = torch.from_numpy(rng.uniform(0.1, 1.0, (T, k)).astype(np.float32)).cuda().to(torch.bfloat16).float()
    with torch.no_grad():
        got = decode.moe_experts(
            x, ids, w, gate, up, down, shared=(sh.gate_proj.weight, sh.up_proj.weight, sh.down_proj.weight), limit=3.0
        )
        ref = m.experts_loop(x, w, ids.long()) + sh(x)
    # float64 magnitudes of the chain for the bound
    xd = x.double()

    def chain(g_w, u_w, d_w):
        g = (xd @ g_w.double().t()).clamp(max=3.0)
        uu = (xd @ u_w.double().t()).clamp(-3.0, 3.0)
        h = torch.nn.functional.silu(g) * uu
        y = h @ d_w.double().t()
        t = h.abs() @ d_w.double().abs().t()
        return y.abs(), t

    bound = torch.zeros(T, D, dtype=torch.float64, device="cuda")
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            y, tt = chain(gate[e], up[e], down[e])
            bound[t] += float(w[t, j]) * (y[t] + tt[t])
    ys, ts = chain(sh.gate_proj.weight, sh.up_proj.weight, sh.down_proj.weight)
    bound += ys + ts + ref.double().abs()
    err = excess(got, ref, 4 * u * bound + 1e-6)
    assert err <= 0 and bool(torch.isfinite(got).all()), (
        f"routed + shared experts = the loop form + shared expert, {tag}: max excess {err:.3g}"
    )


# --- 5. the fused mHC norms ----------------------------------------------------------------------------


@pytest.mark.parametrize("dname", DTYPES)
@pytest.mark.parametrize(
    "hc,D,iters,T", [(4, 2048, 20, 1), (4, 2048, 20, 8), (2, 64, 3, 3), (8, 128, 5, 2), (4, 256, 7, 300)]
)
def test_mhc_norms_match_collapse_then_norm(rng, dname, hc, D, iters, T) -> None:
    import torch

    from engram_trt.models.deepseek_v4.modules import HyperConnection, HyperHead, RMSNorm
    from engram_trt.native import mhc

    u = UNIT[dname]
    cfg = SimpleNamespace(hc_mult=hc, hidden_size=D, hc_sinkhorn_iters=iters, hc_eps=1e-6, rms_norm_eps=1e-6)
    conn, head, norm = HyperConnection(cfg), HyperHead(cfg), RMSNorm(D, 1e-6)
    with torch.no_grad():
        for name, p in [*conn.named_parameters(), *head.named_parameters()]:
            a = rng.standard_normal(tuple(p.shape)) * (2.0 / np.sqrt(p.shape[1]) if p.dim() == 2 else 0.5)
            p.copy_(torch.from_numpy(a.astype(np.float32)))
        norm.weight.copy_(torch.from_numpy((1 + 0.3 * rng.standard_normal(D)).astype(np.float32)))
    conn, head, norm = conn.cuda(), head.cuda(), norm.cuda()
    x = cuda_normal(rng, (T, hc, D), 1.5, dname)
    tag = f"hc {hc} D {D} iters {iters} T {T} {dname}"
    with torch.no_grad():
        got, post, comb = mhc.mhc_pre_norm(
            x,
            conn.fn,
            conn.base,
            conn.scale,
            norm.weight,
            sinkhorn_iters=iters,
            hc_eps=1e-6,
            norm_eps=1e-6,
            rms_eps=1e-6,
        )
        h, post0, comb0 = mhc.mhc_pre(
            x, conn.fn, conn.base, conn.scale, sinkhorn_iters=iters, hc_eps=1e-6, norm_eps=1e-6
        )
        tight = norm(h)
        loose = norm(conn.collapse_torch(x)[0])
        hgot = mhc.mhc_head_norm(
            x, head.hc_fn, head.hc_base, head.hc_scale, norm.weight, hc_eps=1e-6, norm_eps=1e-6, rms_eps=1e-6
        )
        htight = norm(mhc.mhc_head(x, head.hc_fn, head.hc_base, head.hc_scale, hc_eps=1e-6, norm_eps=1e-6))
        hloose = norm(head.forward_torch(x))
    torch.cuda.synchronize()
    assert torch.equal(post, post0) and torch.equal(comb, comb0), (
        f"pre_norm's post / comb = mhc_pre's bit for bit, {tag}"
    )
    for name, a, t, lo in (("pre", got, tight, loose), ("head", hgot, htight, hloose)):
        err = excess(a, t, 2 * u * t.double().abs() + 1e-5 * float(t.double().abs().max()))
        assert err <= 0, f"{name}_norm = RMSNorm of the kernel's own collapse, {tag}: max excess {err:.3g}"
        err = excess(a, lo, 6 * u * lo.double().abs() + 2e-5 * float(lo.double().abs().max()))
        assert err <= 0 and bool(torch.isfinite(a).all()), (
            f"{name}_norm = torch collapse + RMSNorm, {tag}: max excess {err:.3g}"
        )


# --- 6. whole models -----------------------------------------------------------------------------------


@pytest.mark.parametrize("mix", ["SCHS-hash1-e8k2", "CC-topk-e6k3", "HSH-hash2-hc4-sigmoid"])
def test_fused_model_decode_within_round_off(mix: str) -> None:
    import torch

    from .cases import rel_err
    from engram_trt.models.step import PackedStep

    from .test_deepseek_v4_graphs import _config, _model, _weights

    cfg = _config(mix)
    weights = _weights(cfg, 11)
    ref = _model(cfg, weights, torch.float32)
    model = _model(cfg, weights, torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=gen).tolist() for n in (7, 19, 11)]
    states = {name: (ref if name == "fp32" else model).new_cache(4, 96) for name in ("fp32", "fused", "plain")}
    step = PackedStep(torch.tensor(sum(prompts, [])), [len(p) for p in prompts], [0, 0, 0], [0, 1, 2])
    for name, st in states.items():
        with _fused(name != "plain"):
            (ref if name == "fp32" else model).forward_step(step, st)
    lens = [len(p) for p in prompts]
    toks = [5, 9, 13]
    bad, forms, fes, pes = [], set(), [], []
    for k in range(12):
        slots = [0, 1, 2][: 1 + k % 3]
        ids = torch.tensor([toks[s] for s in slots])
        mk = lambda: PackedStep(ids, [1] * len(slots), [lens[s] for s in slots], slots)  # noqa: E731
        want = ref.forward_step(mk(), states["fp32"]).cpu()
        with _fused(True):
            f = model.forward_step(mk(), states["fused"]).float().cpu()
            forms |= {layer.mlp.last_form for layer in model.model.layers}
        with _fused(False):
            p = model.forward_step(mk(), states["plain"]).float().cpu()
        fe, pe = rel_err(f, want), rel_err(p, want)
        fes.append(fe)
        pes.append(pe)
        if not torch.isfinite(f).all():
            bad.append(f"step {k}: fused logits not finite")
        for s, t in zip(slots, want.argmax(-1).tolist()):
            toks[s] = t
            lens[s] += 1
    # The median over the steps: a single step's distance jumps where a top-k (the CSA
    # indexer's, the router's) picks otherwise on these random weights in either bf16 path
    # (measured on the H100: one step of 12 at 6.5e-2 fused vs 1.3e-2 unfused, the others alike)
    fm, pm = float(np.median(fes)), float(np.median(pes))
    assert not bad and fm <= 2 * pm + 1e-3, (
        f"{mix}: bf16 fused decode within 2x the unfused bf16 distance from fp32 + 1e-3 (median of 12 steps): median "
        f"fused {fm:.2e} vs unfused {pm:.2e}; per step fused {[f'{e:.1e}' for e in fes]} unfused "
        f"{[f'{e:.1e}' for e in pes]}; {'; '.join(bad[:4])}"
    )
    assert forms == {"fused"}, f"{mix}: the decode MoE took the fused form: forms {sorted(forms)}"


def _count_launches(model: Any, run) -> dict[str, int]:
    """GPU work items (kernels, memsets, copies) per module kind of ``run()`` (one eager
    decode step): every wrapped call of bench/breakdown's kinds is bracketed by two
    ``torch.cuda._sleep(0)`` marker kernels (``spin_kernel``), and the device-side events
    torch.profiler records (every kernel, whatever API launched it) are counted between
    the markers, in the stream's order; the rest is ``other``."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from engram_trt.bench.breakdown import RegionClock, deepseek_regions

    labels: list[str] = []

    class Marks(RegionClock):
        def _timed(self, fn, label, layer):  # a marker kernel on each side instead of a pair of events
            def call(*a, **kw):
                labels.append(label)
                torch.cuda._sleep(0)
                out = fn(*a, **kw)
                torch.cuda._sleep(0)
                return out

            return call

    with Marks() as clock:
        deepseek_regions(clock, model)
        run()
        torch.cuda.synchronize()
        labels.clear()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
    work = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    counts: dict[str, int] = {}
    inside, marks = None, 0
    for e in work:
        if "spin_kernel" in e.name:
            inside = labels[marks // 2] if marks % 2 == 0 else None
            marks += 1
            continue
        key = inside or "other"
        counts[key] = counts.get(key, 0) + 1
    counts["markers"] = marks
    counts["expected_markers"] = 2 * len(labels)
    return counts


def test_launches_per_module_kind_at_the_bench_width() -> None:
    """One eager bf16 decode step of the bench's 1.63B shape (``bench e2e``'s dsv4, 16
    layers): launches per module kind with the fused glue and without (noted); the fused
    step launches fewer than half."""
    import torch

    from engram_trt.bench.dsv4model import bench_config, random_weights
    from engram_trt.models.deepseek_v4.architecture import ARCHITECTURE
    from engram_trt.models.deepseek_v4.config import read_config
    from engram_trt.models.step import PackedStep

    d = bench_config("1b", table_gib=0.01, max_len=256)
    d = {k: v for k, v in d.items() if not k.startswith("engram_")}
    d.update(architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4")
    cfg = read_config(d, "bench dsv4 width")
    model = ARCHITECTURE.build_model(
        cfg, random_weights(cfg, "cuda", torch.bfloat16, 1), device="cuda", dtype=torch.bfloat16
    )
    state = model.new_cache(1, 256)
    prompt = list(range(3, 40))
    model.forward_step(PackedStep(torch.tensor(prompt), [len(prompt)], [0], [0]), state)
    past = [len(prompt)]

    def one_step():
        model.forward_step(PackedStep(torch.tensor([7]), [1], [past[0]], [0]), state)
        past[0] += 1

    counts = {}
    for on in (True, False):
        with _fused(on):
            counts["fused" if on else "unfused"] = _count_launches(model, one_step)
    totals = {}
    for k, v in counts.items():
        marks, want = v.pop("markers"), v.pop("expected_markers")
        totals[k] = sum(v.values())
        note(f"launches_{k}", v)
        say(f"GPU work items per kind, {k}: {dict(sorted(v.items()))} (total {totals[k]}; markers {marks} / {want})")
        assert marks == want, f"bench width, {k}: every marker kernel seen in the profile: {marks} / {want}"
    assert 0 < totals["fused"] < totals["unfused"] / 2, (
        f"bench width: the fused decode step launches fewer than half the unfused step's kernels: fused "
        f"{totals['fused']}, unfused {totals['unfused']}"
    )


def test_breakdown_detail_names_the_fused_launches_inside_the_graph() -> None:
    """The tiny DeepSeek-V4 checkpoint's recorded bf16 decode step with ``detail``: every
    fused launch happened inside the graph (GEMV launches: x's projections, q_b, o_a, o_b
    and the router, per layer; one norm / RoPE launch per layer with the GEMV prologues
    (q_a_norm in q_b's GEMV, the inverse RoPE in o_a's; the kv and q heads' norm + RoPE one
    launch), three without them (``ENGRAM_TRT_DSV4_PROLOGUE=0``); one core, one route, one
    experts call per layer), the kinds as without detail."""
    import json

    from engram_trt.bench.breakdown import decode_breakdown
    from engram_trt.models.deepseek_v4.fused import PROLOGUE_ENV
    from engram_trt.models.deepseek_v4.modules import MHC_FOLD_ENV

    from .helpers import REPO

    folder = REPO / "tests" / "data" / "deepseek_v4_tiny"
    n = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    b = decode_breakdown(folder, device="cuda", dtype="bf16", prompt_tokens=8, reps=3, detail=True)
    detail = {k: v["calls"] for k, v in b.get("detail", {}).items()}
    norm_ropes = 3 if os.environ.get(PROLOGUE_ENV, "1") == "0" else 1
    want = {"gemv": 5 * n, "norm_rope": norm_ropes * n, "attention.core": n, "moe.route": n, "moe.experts": n}
    assert b.get("mode") == "graph" and detail == want, (
        f"tiny DeepSeek-V4: the recorded decode step's fused launches, per layer: mode {b.get('mode')}; detail "
        f"{detail}; want {want}"
    )
    kinds = {k: v["calls"] for k, v in b.get("kinds", {}).items() if k != "other"}
    collapses = kinds.get("mhc.pre+norm", 0) + kinds.get("mhc.post+pre+norm", 0)  # the fold runs the later ones
    fold = os.environ.get(MHC_FOLD_ENV, "1") != "0"
    assert collapses == 2 * n and (kinds.get("mhc.pre+norm") == (1 if fold else 2 * n)), (
        f"tiny DeepSeek-V4: with detail, every collapse timed once, the fold's with their expansions: {kinds}"
    )
    assert kinds.get("moe") == n and "detail:gemv" not in kinds, (
        f"tiny DeepSeek-V4: with detail, the kinds' calls unchanged: {kinds}"
    )
