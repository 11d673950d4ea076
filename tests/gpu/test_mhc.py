"""DeepSeek-V4's mHC kernels (plugins/kernels/mhcKernel.cu through native/mhc.py) on a GPU
against the PyTorch modules they replace (models/deepseek_v4/modules.HyperConnection /
HyperHead, backend 'torch', on the same GPU) and the float64 NumPy reference
(models/deepseek_v4/reference_mhc.py, tied to the modules on the CPU by tests/models/deepseek_v4/test_mhc_reference.py).

Every parameter random (fn, base, scale: transformers' base 0 / scale 1 would let a
swapped scale or bias pass), float32 as the model keeps them; streams / sublayer outputs
random in float32, bf16, fp16. Shapes cover hc 2, 3, 4, 8, Sinkhorn 1 / 3 / 7 / 20
iterations, a decode token at the 1.76B bench's width (hc 4, D 2048: K split 32 ways),
a prefill of 300 tokens (4 tokens per mix block) and widths needing several collapse loops.

Bounds. post / comb come out in float32 from the same widened inputs on both paths:
``|kernel - torch| <= 2e-5 max|.|`` (float32 sums in another order). collapsed is one
float32 sum rounded once on both paths: ``2 u |ref| + 2e-5 max|ref|`` (u = 2^-8 bf16,
2^-11 fp16, 0 float32; 2 u: the two sums may round apart by one ulp). new streams: against the
float64 reference fed the kernel's own post / comb rounded to the dtype (what the kernel
documents), ``u |ref| + 1e-5 sum|terms|``; against
the torch module (which rounds the product, the matmul and their sum apart) ``4 u
sum|terms| + 1e-5 max``. Beside: post in place = out of place bit for bit, two calls bit-identical, zero
tokens, the tiny DeepSeek-V4 checkpoint's logits with the mHC kernels vs the PyTorch mHC,
and decode / prefill timings (kernel pre + post faster than the torch path). The fold
(engram_mhc_fold: a sublayer boundary) against mhc_post then mhc_pre / mhc_pre_norm /
mhc_head_norm over hc 2 / 3 / 4 / 8, partial spans, T 1..300, each dtype.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from .helpers import REPO, excess, note, say

DTYPES = ["float32", "bfloat16", "float16"]
UNIT_ROUNDOFF = {"float32": 0.0, "bfloat16": 2.0**-8, "float16": 2.0**-11}
CASES = [  # (hc, hidden, sinkhorn iters, tokens)
    (2, 64, 1, 5),
    (2, 128, 20, 17),
    (3, 64, 3, 33),
    (4, 256, 20, 7),
    (4, 2048, 20, 1),
    (4, 256, 7, 300),
    (4, 4096, 20, 3),
    (8, 64, 5, 9),
]
EPS = 1e-6


def _config(hc: int, D: int, iters: int) -> SimpleNamespace:
    return SimpleNamespace(hc_mult=hc, hidden_size=D, hc_sinkhorn_iters=iters, hc_eps=EPS, rms_norm_eps=EPS)


def _randomize(torch, module, rng):
    """Every parameter random, float32 on the GPU (fn scaled so the mixes are O(1))."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            a = rng.standard_normal(tuple(p.shape))
            if name.endswith("fn"):
                a *= 2.0 / np.sqrt(p.shape[1])
            elif name.endswith("scale"):
                a = 0.5 + 0.5 * a
            else:
                a *= 0.5
            p.copy_(torch.from_numpy(a.astype(np.float32)))
            p.requires_grad_(False)
    return module.to("cuda")


def _rel(a, b) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-30)


@pytest.mark.parametrize("dname", DTYPES)
@pytest.mark.parametrize("ci", range(len(CASES)))
def test_pre_and_post_match_the_torch_module(rng, dname, ci) -> None:
    import torch

    from engram_trt.models.deepseek_v4 import reference_mhc as ref
    from engram_trt.models.deepseek_v4.modules import HyperConnection
    from engram_trt.native import mhc

    hc, D, iters, T = CASES[ci]
    dtype, u = getattr(torch, dname), UNIT_ROUNDOFF[dname]
    m = _randomize(torch, HyperConnection(_config(hc, D, iters)), rng)
    x = torch.from_numpy((rng.standard_normal((T, hc, D)) * 1.5).astype(np.float32)).to("cuda", dtype)
    y = torch.from_numpy(rng.standard_normal((T, D)).astype(np.float32)).to("cuda", dtype)
    tag = f"hc {hc} D {D} iters {iters} T {T} {dname}"
    with torch.no_grad():
        h_k, post_k, comb_k = mhc.mhc_pre(x, m.fn, m.base, m.scale, sinkhorn_iters=iters, hc_eps=EPS, norm_eps=EPS)
        h_t, post_t, comb_t = m.collapse_torch(x)
        new_k = mhc.mhc_post(x, y, post_k, comb_k)
        new_t = HyperConnection.expand_torch(x, y, post_t, comb_t)
    torch.cuda.synchronize()
    assert _rel(post_k, post_t) <= 2e-5, f"post = torch, {tag}: max rel {_rel(post_k, post_t):.3g}"
    assert _rel(comb_k, comb_t) <= 2e-5, f"comb = torch, {tag}: max rel {_rel(comb_k, comb_t):.3g}"
    ht = h_t.double().cpu()
    err = excess(h_k, ht, 2 * u * ht.abs() + 2e-5 * float(ht.abs().max()))  # one rounding flip: 1 ulp <= 2u|x|
    assert err <= 0 and bool(torch.isfinite(h_k).all()), f"collapsed = torch, {tag}: max excess {err:.3g}"

    # the float64 reference on the same inputs: coefficients, and the post step fed the kernel's own post / comb
    params = ref.MhcParams.of(m.fn.cpu(), m.base.cpu(), m.scale.cpu())
    xs, ys = x.double().cpu().numpy(), y.double().cpu().numpy()
    _h64, post64, comb64 = ref.mhc_pre(xs, params, iters=iters, hc_eps=EPS, norm_eps=EPS)
    e64 = max(_rel(post_k, torch.from_numpy(post64)), _rel(comb_k, torch.from_numpy(comb64)))
    assert e64 <= 2e-5, f"post / comb = float64 reference, {tag}: max rel {e64:.3g}"
    rounder = None if dname == "float32" else (lambda a: torch.from_numpy(a).to(dtype).double().numpy())
    pk, ck = post_k.double().cpu().numpy(), comb_k.double().cpu().numpy()
    want = torch.from_numpy(ref.mhc_post(xs, ys, pk, ck, round_to=rounder))
    terms = torch.from_numpy(ref.mhc_post(np.abs(xs), np.abs(ys), np.abs(pk), np.abs(ck), round_to=rounder))
    err = excess(new_k, want, u * want.abs() + 1e-5 * terms)
    assert err <= 0, f"new streams = float64 reference (kernel's post / comb), {tag}: max excess {err:.3g}"
    err = excess(new_k, new_t, 4 * u * terms + 1e-5 * float(terms.max()))
    assert err <= 0 and bool(torch.isfinite(new_k).all()), f"new streams = torch expand, {tag}: max excess {err:.3g}"
    nontrivial = float((post_k - 1).abs().max()) > 0.05 and float((comb_k - 1.0 / hc).abs().max()) > 1e-3
    assert nontrivial or hc == 1, (
        f"coefficients far from the trivial ones, {tag}: max |post - 1| {float((post_k - 1).abs().max()):.3g}"
    )


@pytest.mark.parametrize("dname", DTYPES)
@pytest.mark.parametrize("ci", range(len(CASES)))
def test_split_finalize_gives_the_same_bits(rng, monkeypatch, dname, ci) -> None:
    """ENGRAM_TRT_MHC_SPLIT_FINALIZE=1 (a layer's finalize in two blocks a token: the pre
    weights, the collapse and its norm in one, post and comb with their Sinkhorn rounds in the
    other) against one block a token, on the same inputs: mhc_pre, mhc_pre_norm and the fold
    give the same bits (both blocks sum the same partials in the same order)."""
    import torch

    from engram_trt.models.deepseek_v4.modules import HyperConnection
    from engram_trt.native import mhc

    hc, D, iters, T = CASES[ci]
    dtype = getattr(torch, dname)
    m = _randomize(torch, HyperConnection(_config(hc, D, iters)), rng)
    x = torch.from_numpy((rng.standard_normal((T, hc, D)) * 1.5).astype(np.float32)).to("cuda", dtype)
    y = torch.from_numpy(rng.standard_normal((T, D)).astype(np.float32)).to("cuda", dtype)
    w = torch.from_numpy((1 + 0.3 * rng.standard_normal(D)).astype(np.float32)).to("cuda")
    kw = dict(sinkhorn_iters=iters, hc_eps=EPS, norm_eps=EPS)
    got = {}
    for split in ("0", "1"):
        monkeypatch.setenv("ENGRAM_TRT_MHC_SPLIT_FINALIZE", split)
        with torch.no_grad():
            pre = mhc.mhc_pre(x, m.fn, m.base, m.scale, **kw)
            normed = mhc.mhc_pre_norm(x, m.fn, m.base, m.scale, w, rms_eps=EPS, **kw)
            post, comb = pre[1], pre[2]
            fold = mhc.mhc_fold(x.clone(), y, post, comb, m.fn, m.base, m.scale, norm_weight=w, rms_eps=EPS, **kw)
        torch.cuda.synchronize()
        got[split] = [*pre, *normed, *fold]
    same = [bool(torch.equal(a, b)) for a, b in zip(got["0"], got["1"])]
    assert all(same), f"hc {hc} D {D} iters {iters} T {T} {dname}: the split finalize's outputs, bit for bit: {same}"


@pytest.mark.parametrize("dname", DTYPES)
@pytest.mark.parametrize("hc,D,T", [(2, 64, 5), (4, 2048, 1), (4, 512, 300), (8, 128, 4)])
def test_head_matches_the_torch_module(rng, dname, hc, D, T) -> None:
    import torch

    from engram_trt.models.deepseek_v4 import reference_mhc as ref
    from engram_trt.models.deepseek_v4.modules import HyperHead
    from engram_trt.native import mhc

    dtype, u = getattr(torch, dname), UNIT_ROUNDOFF[dname]
    m = _randomize(torch, HyperHead(_config(hc, D, 1)), rng)
    x = torch.from_numpy((rng.standard_normal((T, hc, D)) * 1.5).astype(np.float32)).to("cuda", dtype)
    with torch.no_grad():
        got = mhc.mhc_head(x, m.hc_fn, m.hc_base, m.hc_scale, hc_eps=EPS, norm_eps=EPS)
        want = m.forward_torch(x).double().cpu()
    want64 = torch.from_numpy(
        ref.mhc_head(
            x.double().cpu().numpy(),
            ref.MhcParams.of(m.hc_fn.cpu(), m.hc_base.cpu(), m.hc_scale.cpu()),
            hc_eps=EPS,
            norm_eps=EPS,
        )
    )
    tag = f"hc {hc} D {D} T {T} {dname}"
    err = excess(got, want, 2 * u * want.abs() + 2e-5 * float(want.abs().max()))
    assert err <= 0 and bool(torch.isfinite(got).all()), f"head = torch HyperHead, {tag}: max excess {err:.3g}"
    err = excess(got, want64, u * want64.abs() + 2e-5 * float(want64.abs().max()))
    assert err <= 0, f"head = float64 reference, {tag}: max excess {err:.3g}"


FOLD_CASES = [  # (hc, hidden, sinkhorn iters, tokens): decode fold (T <= 8) and the three-launch form
    (2, 64, 1, 5),
    (3, 64, 3, 8),
    (3, 200, 3, 2),  # 25 vectors a stream: a partial last span
    (4, 64, 20, 1),  # one or two warps' worth of channels: the rows every warp must cover (the reverted NaN)
    (4, 256, 20, 7),
    (4, 2048, 20, 1),
    (4, 2048, 20, 4),
    (4, 256, 7, 300),
    (8, 64, 5, 3),
    (8, 128, 5, 9),
]


@pytest.mark.parametrize("dname", DTYPES)
@pytest.mark.parametrize("ci", range(len(FOLD_CASES)))
def test_fold_equals_post_then_collapse(rng, dname, ci) -> None:
    """engram_mhc_fold (a sublayer boundary: the expansion, then the next collapse with or
    without its norm, or the head's): new streams = mhc_post's bit for bit (the same sum in
    the same order), in place = out of place; the next collapse's post / comb = mhc_pre's
    of those streams within float32 sums' order (2e-5) and the float64 reference's; the
    collapse / its norm as mhc_pre / mhc_pre_norm's bounds (test_dsv4_fused); the head's
    likewise; everything finite."""
    import torch

    from engram_trt.models.deepseek_v4 import reference_mhc as ref
    from engram_trt.models.deepseek_v4.modules import HyperConnection, HyperHead, RMSNorm
    from engram_trt.native import mhc

    hc, D, iters, T = FOLD_CASES[ci]
    dtype, u = getattr(torch, dname), UNIT_ROUNDOFF[dname]
    first = _randomize(torch, HyperConnection(_config(hc, D, iters)), rng)
    nxt = _randomize(torch, HyperConnection(_config(hc, D, iters)), rng)
    head = _randomize(torch, HyperHead(_config(hc, D, 1)), rng)
    norm = RMSNorm(D, EPS)
    with torch.no_grad():
        norm.weight.copy_(torch.from_numpy((1 + 0.3 * rng.standard_normal(D)).astype(np.float32)))
    norm = norm.cuda()
    x = torch.from_numpy((rng.standard_normal((T, hc, D)) * 1.5).astype(np.float32)).to("cuda", dtype)
    y = torch.from_numpy(rng.standard_normal((T, D)).astype(np.float32)).to("cuda", dtype)
    tag = f"hc {hc} D {D} iters {iters} T {T} {dname}"
    kw = dict(sinkhorn_iters=iters, hc_eps=EPS, norm_eps=EPS)
    with torch.no_grad():
        _h, post0, comb0 = mhc.mhc_pre(x, first.fn, first.base, first.scale, **kw)
        want_new = mhc.mhc_post(x, y, post0, comb0)
        new, h, post, comb = mhc.mhc_fold(x, y, post0, comb0, nxt.fn, nxt.base, nxt.scale, **kw)
        new_n, hn, post_n, comb_n = mhc.mhc_fold(
            x, y, post0, comb0, nxt.fn, nxt.base, nxt.scale, norm.weight, rms_eps=EPS, **kw
        )
        inplace = x.clone()
        got_in = mhc.mhc_fold(
            inplace, y, post0, comb0, nxt.fn, nxt.base, nxt.scale, norm.weight, rms_eps=EPS, new_streams=inplace, **kw
        )
        h_ref, post_ref, comb_ref = mhc.mhc_pre(want_new, nxt.fn, nxt.base, nxt.scale, **kw)
        hn_tight = norm(h)  # the norm of the fold's own collapse
        hn_loose = norm(nxt.collapse_torch(want_new)[0])
        new_h, head_got, p_none, c_none = mhc.mhc_fold(
            x,
            y,
            post0,
            comb0,
            head.hc_fn,
            head.hc_base,
            head.hc_scale,
            norm.weight,
            head=True,
            hc_eps=EPS,
            norm_eps=EPS,
            rms_eps=EPS,
        )
        head_tight = norm(mhc.mhc_head(want_new, head.hc_fn, head.hc_base, head.hc_scale, hc_eps=EPS, norm_eps=EPS))
        head_loose = norm(head.forward_torch(want_new))
    torch.cuda.synchronize()
    assert torch.equal(new, want_new) and torch.equal(new_n, want_new) and torch.equal(new_h, want_new), (
        f"fold: new streams = mhc_post bit for bit, {tag}"
    )
    assert torch.equal(inplace, want_new) and torch.equal(got_in[1], hn) and torch.equal(got_in[2], post_n), (
        f"fold: in place = out of place bit for bit, {tag}"
    )
    assert torch.equal(post, post_n) and torch.equal(comb, comb_n), f"fold: the norm changes only the collapse, {tag}"
    e = max(_rel(post, post_ref), _rel(comb, comb_ref))
    assert e <= 2e-5, f"fold: next post / comb = mhc_pre of the new streams, {tag}: max rel {e:.3g}"
    params = ref.MhcParams.of(nxt.fn.cpu(), nxt.base.cpu(), nxt.scale.cpu())
    _h64, post64, comb64 = ref.mhc_pre(want_new.double().cpu().numpy(), params, iters=iters, hc_eps=EPS, norm_eps=EPS)
    e64 = max(_rel(post, torch.from_numpy(post64)), _rel(comb, torch.from_numpy(comb64)))
    assert e64 <= 2e-5, f"fold: next post / comb = float64 reference, {tag}: max rel {e64:.3g}"
    hr = h_ref.double().cpu()
    err = excess(h, hr, 2 * u * hr.abs() + 2e-5 * float(hr.abs().max()))
    assert err <= 0, f"fold: collapse = mhc_pre's, {tag}: max excess {err:.3g}"
    for name, a, t, lo in (("pre_norm", hn, hn_tight, hn_loose), ("head_norm", head_got, head_tight, head_loose)):
        err = excess(a, t, 2 * u * t.double().abs() + 1e-5 * float(t.double().abs().max()))
        assert err <= 0, f"fold {name} = RMSNorm of the kernel's own collapse, {tag}: max excess {err:.3g}"
        err = excess(a, lo, 6 * u * lo.double().abs() + 2e-5 * float(lo.double().abs().max()))
        assert err <= 0, f"fold {name} = torch collapse + RMSNorm, {tag}: max excess {err:.3g}"
    finite = all(bool(torch.isfinite(t).all()) for t in (new, h, post, comb, hn, head_got))
    assert finite and p_none is None and c_none is None, f"fold: every output finite, {tag}"


def test_contracts(rng) -> None:
    """In place = out of place bit for bit; repeated calls bit-identical (no atomics);
    zero tokens; the modules' kernel path = the binding."""
    import torch

    from engram_trt.models.deepseek_v4.modules import HyperConnection, HyperHead
    from engram_trt.native import mhc

    hc, D, iters, T = 4, 1024, 20, 6
    m = _randomize(torch, HyperConnection(_config(hc, D, iters)), rng)
    x = torch.from_numpy(rng.standard_normal((T, hc, D)).astype(np.float32)).to("cuda", torch.bfloat16)
    y = torch.from_numpy(rng.standard_normal((T, D)).astype(np.float32)).to("cuda", torch.bfloat16)
    with torch.no_grad():
        a = mhc.mhc_pre(x, m.fn, m.base, m.scale, sinkhorn_iters=iters, hc_eps=EPS, norm_eps=EPS)
        b = mhc.mhc_pre(x, m.fn, m.base, m.scale, sinkhorn_iters=iters, hc_eps=EPS, norm_eps=EPS)
        assert all(torch.equal(p, q) for p, q in zip(a, b)), "pre: two calls bit-identical"
        out_of_place = mhc.mhc_post(x, y, a[1], a[2])
        inplace = x.clone()
        mhc.mhc_post(inplace, y, a[1], a[2], new_streams=inplace)
        assert torch.equal(inplace, out_of_place), "post in place = out of place, bit for bit"
        m.backend = "kernels"
        saved = HyperConnection.backend
        HyperConnection.backend = "kernels"
        try:
            c = m.collapse(x)
            assert all(torch.equal(p, q) for p, q in zip(a, c)), "HyperConnection.collapse (kernels) = mhc_pre"
            assert torch.equal(HyperConnection.expand(x, y, a[1], a[2]), out_of_place), (
                "HyperConnection.expand (kernels) = mhc_post"
            )
        finally:
            HyperConnection.backend = saved
        empty = torch.empty(0, hc, D, dtype=torch.bfloat16, device="cuda")
        h0, p0, c0 = mhc.mhc_pre(empty, m.fn, m.base, m.scale, sinkhorn_iters=iters, hc_eps=EPS, norm_eps=EPS)
        n0 = mhc.mhc_post(empty, torch.empty(0, D, dtype=torch.bfloat16, device="cuda"), p0, c0)
        head = _randomize(torch, HyperHead(_config(hc, D, 1)), rng)
        head.backend = "kernels"
        z0 = head(empty)
    torch.cuda.synchronize()
    assert (
        tuple(h0.shape) == (0, D)
        and tuple(c0.shape) == (0, hc, hc)
        and tuple(n0.shape) == (0, hc, D)
        and tuple(z0.shape) == (0, D)
    ), "zero tokens: empty results"


@pytest.mark.parametrize("dname", ["float32", "bfloat16"])
def test_tiny_model_with_mhc_kernels(dname) -> None:
    """The tiny DeepSeek-V4 checkpoint on CUDA: logits of a prefill + decode with the mHC
    kernels vs the PyTorch mHC (everything else the same): float32 within 1e-4 relative
    L2, bf16 within 3x transformers' own bf16-vs-fp32 distance (expected.json): each path
    is within bf16 round-off of the float32 one, so of each other."""
    import torch

    from engram_trt.models.deepseek_v4.modules import HyperConnection, HyperHead
    from engram_trt.models.registry import open_checkpoint
    from engram_trt.models.step import PackedStep

    from .cases import rel_err

    ckpt = open_checkpoint(REPO / "tests" / "data" / "deepseek_v4_tiny")
    model = ckpt.architecture.load_model(ckpt, device="cuda", dtype=getattr(torch, dname))
    expected = json.loads((REPO / "tests" / "data" / "deepseek_v4_tiny" / "expected.json").read_text())
    prompt = expected["prompts"][0]
    logits = {}
    saved = HyperConnection.backend, HyperHead.backend
    try:
        for backend in ("kernels", "torch"):
            HyperConnection.backend = HyperHead.backend = backend
            state = model.new_cache(1, 64)
            a = model.forward_step(PackedStep(torch.tensor(prompt), [len(prompt)], [0], [0]), state, all_logits=True)
            b = model.forward_step(PackedStep(torch.tensor([5]), [1], [len(prompt)], [0]), state)
            logits[backend] = torch.cat([a, b])
    finally:
        HyperConnection.backend, HyperHead.backend = saved
        ckpt.close()
    err = rel_err(logits["kernels"], logits["torch"])
    bound = 1e-4 if dname == "float32" else 3 * max(expected["transformers_bf16_rel_l2"])
    note(f"tiny_model_{dname}_rel_l2", err)
    assert err <= bound, (
        f"tiny DeepSeek-V4 {dname}: logits with mHC kernels = PyTorch mHC: rel L2 {err:.2e} (bound {bound:g})"
    )


@pytest.mark.parametrize("T", [1, 8, 2048])
def test_timing_against_the_torch_path(rng, T) -> None:
    """pre + post of one sublayer at the 1.76B bench's shape (hc 4, D 2048, 20 iterations,
    bf16) by CUDA events, kernels vs the PyTorch path: the kernels must be faster."""
    import torch

    from engram_trt.models.deepseek_v4.modules import HyperConnection
    from engram_trt.native import mhc

    hc, D, iters = 4, 2048, 20
    m = _randomize(torch, HyperConnection(_config(hc, D, iters)), rng)
    x = torch.from_numpy(rng.standard_normal((T, hc, D)).astype(np.float32)).to("cuda", torch.bfloat16)
    y = torch.from_numpy(rng.standard_normal((T, D)).astype(np.float32)).to("cuda", torch.bfloat16)

    def kernels():
        _h, p, c = mhc.mhc_pre(x, m.fn, m.base, m.scale, sinkhorn_iters=iters, hc_eps=EPS, norm_eps=EPS)
        return mhc.mhc_post(x, y, p, c)

    def torch_path():
        _h, p, c = m.collapse_torch(x)
        return HyperConnection.expand_torch(x, y, p, c)

    def per_call_us(fn, n=50) -> float:
        with torch.no_grad():
            for _ in range(5):
                fn()
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(n):
                fn()
            stop.record()
            stop.synchronize()
        return start.elapsed_time(stop) * 1e3 / n

    k_us, t_us = per_call_us(kernels), per_call_us(torch_path)
    note(f"pre_post_T{T}_kernels_us", k_us)
    note(f"pre_post_T{T}_torch_us", t_us)
    say(f"mHC pre + post, T={T}: kernels {k_us:.1f} us, torch {t_us:.1f} us ({t_us / k_us:.1f}x)")
    assert k_us < t_us, (
        f"mHC pre + post T={T}: kernels faster than the PyTorch path: kernels {k_us:.1f} us vs torch {t_us:.1f} us"
    )
