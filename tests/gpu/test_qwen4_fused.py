"""Qwen4Exp's fused decode glue on a GPU (models/qwen4_exp/fused.py over native/decode.py)
against the PyTorch forms each kernel replaces, on the same GPU:

1. ``moe_route`` with the softmax score functions: on the very logits, the picks of
   SparseMoE.route's math (float32 softmax, torch.topk) exactly, and the weights within
   the float32 sums' order: the softmax's sum of E terms and the renormalizing sum of k
   terms in another order give ``(E + k + 4) eps32`` relative (the exp's 2 ulp included),
   then the rounding to the logits' dtype may flip one ulp of it.
2. ``moe_experts`` with Qwen's layout (the experts' down weights side by side ``[D, E * I]``)
   and the sigmoid-gated shared expert: against SparseMoE's per-expert loop (bf16, each
   expert's weighted output added in ascending id) plus ``shared_expert(x) *
   sigmoid(shared_expert_gate(x))``, with the kernel's picks given to both:
   ``|got - ref| <= 4u (|ref| + sum_j |w_j| (|y_j| + t_j) + |y_s| + t_s)``, t the down
   products' float64 term sums (each rounding of the chain may flip one ulp).
3. ``fused.moe`` against ``SparseMoE.forward`` (the per-expert form) on inputs whose router
   logits are exact in float32 (dyadic values: both products give the same bf16 logits,
   so both route alike), within 2.'s bound.
4. ``hc_mix`` on the module's own normed streams and low-rank products against
   GatedResidual.mix's PyTorch form (the bound derived in the test: the up product's sum
   order through the sigmoid's slope, each rounding's one-ulp flip), for hc 2 / 3 / 4, with
   and without injection; the whole fused mix (norm, one GEMV launch, ``hc_mix``) within
   8u relative L2 of the PyTorch form.
5. The tiny Qwen4Exp checkpoint (tests/data/qwen4_exp_tiny) in bf16: decode steps on the
   fused glue against the float32 model, at most 2x the unfused bf16 steps' distance +
   1e-3 (``ENGRAM_TRT_QWEN4_FUSED=0`` gives the unfused one), and every layer's MoE took
   the fused kernels, every Gated DeltaNet layer's gates and output norm too.
6. ``gdn_gates`` against the PyTorch ops it replaces (strided rows, bf16 / float32
   dt_bias, softplus' threshold branch): beta bit for bit, g within 8 eps32 |g| (each side
   2 + 1 ulp of expf / log1pf and the multiply's half ulp, gdnGlueKernel.cu); and
   ``gated_norm`` against GatedRMSNorm.forward (silu / sigmoid gates, bf16 / float32 core):
   the sum of squares' order differs, so each side is within the product of its
   roundings' relative errors of the float64 value (derived in the test) and the two
   within twice that; Hv 32 x dv 128 (the bench shape) and 3 x 37, T 1 / 3 / 8.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from .helpers import REPO, cuda_normal, env, excess, load_checkpoint, note

U = 2.0**-8  # bf16 unit round-off
EPS32 = 2.0**-23


def _fused(on: bool):
    from engram_trt.models.qwen4_exp import fused

    return env(fused.FUSED_ENV, "1" if on else "0")


def _gdn_glue():
    """The Gated DeltaNet glue's switch on (fused.GDN_GLUE_ENV; on by default, set here explicitly)."""
    from engram_trt.models.qwen4_exp import fused

    return env(fused.GDN_GLUE_ENV, "1")


# --- 1. moe_route, softmax ---------------------------------------------------------------------------


def _torch_route(logits, k: int, norm: bool):
    """SparseMoE.route's math on given logits."""
    import torch

    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    w, ids = torch.topk(probs, k, dim=-1)
    if norm:
        w = w / w.sum(dim=-1, keepdim=True)
    return w.to(logits.dtype), ids


@pytest.mark.parametrize("E,k,T", [(6, 2, 1), (8, 2, 3), (64, 4, 8), (128, 8, 2), (60, 6, 5)])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dname", ["bfloat16", "float32"])
def test_softmax_route_equals_the_module(rng, dname, norm, E, k, T) -> None:
    import torch

    from engram_trt.native import decode

    dtype = getattr(torch, dname)
    logits = cuda_normal(rng, (T, E), 2.0, dname)
    want_w, want_ids = _torch_route(logits, k, norm)
    ids, w = decode.moe_route(logits, top_k=k, score_fn="softmax" if norm else "softmax_topk", scaling=1.0)
    torch.cuda.synchronize()
    tag = f"top {k} of {E}, T {T}, norm {norm}, {dname}"
    # bf16 logits tie often (8 bits): equal probabilities, whose order torch.topk leaves open,
    # so the picks are held to the rule: the module's top-k probabilities in order, equal
    # ones by the lower id (a stable sort of the module's own probabilities)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32).cpu()
    oracle = torch.from_numpy(np.argsort(-probs.double().numpy(), axis=-1, kind="stable")[:, :k].copy())
    got_ids = ids.long().cpu()
    assert torch.equal(got_ids, oracle), (
        f"picks = the module's top {k}, ties by the lower id, {tag}: {got_ids.tolist()}"
    )
    assert torch.equal(probs.gather(1, got_ids), probs.gather(1, want_ids.cpu())), f"the same probabilities, {tag}"
    if norm:
        pk = probs.gather(1, got_ids)
        want_w = (pk / pk.sum(dim=-1, keepdim=True)).to(dtype)
    else:
        want_w = probs.gather(1, got_ids).to(dtype)
    note(f"softmax_route_picks_in_torch_order_{E}_{k}_{norm}_{dname}", bool(torch.equal(got_ids, want_ids.cpu())))
    ref = want_w.double().cpu().abs()
    flip = float(torch.finfo(dtype).eps) if dtype != torch.float32 else 0.0
    bound = ((E + k + 4) * EPS32 + flip) * ref
    diff = (w.double().cpu() - want_w.double().cpu()).abs()
    note(f"softmax_route_bit_exact_{E}_{k}_{norm}_{dname}", bool(torch.equal(w.cpu(), want_w.float().cpu())))
    assert bool((diff <= bound).all()), f"weights = the module's within the bound, {tag}: max diff {diff.max():.3g}"


def test_softmax_route_checks() -> None:
    import torch

    from engram_trt.native import decode

    logits = torch.zeros(2, 8, device="cuda")
    ids, w = decode.moe_route(logits, top_k=3, score_fn="softmax", scaling=1.0)
    assert ids.tolist() == [[0, 1, 2]] * 2 and bool((w == 1.0 / 3.0).all()), f"equal logits: {ids.tolist()} {w}"
    ids, w = decode.moe_route(logits, top_k=2, score_fn="softmax_topk", scaling=1.0)
    assert bool((w == 0.125).all()), f"equal logits, no renormalization: {w.tolist()}"


# --- 2. moe_experts, Qwen's layout -------------------------------------------------------------------


def _moe(D: int, I: int, Is: int, E: int, k: int, norm: bool, rng):
    import torch

    from engram_trt.models.qwen4_exp.modules import SparseMoE

    cfg = SimpleNamespace(
        hidden_size=D,
        num_experts=E,
        num_experts_per_tok=k,
        norm_topk_prob=norm,
        moe_intermediate_size=I,
        shared_expert_intermediate_size=Is,
    )
    m = SparseMoE(cfg)
    with torch.no_grad():
        for name, p in m.named_parameters():
            scale = p.shape[-1] ** -0.5 * (3.0 if "gate_proj" in name or "up_proj" in name else 1.0)
            p.copy_(torch.from_numpy(rng.standard_normal(tuple(p.shape)).astype(np.float32) * scale))
    m = m.to("cuda", torch.bfloat16)
    m.stack_experts()
    return m


def _loop_reference(m, x, w, ids):
    """SparseMoE.forward's per-expert form with given picks: bf16, each expert's weighted
    output index_add_-ed in ascending expert id, then the gated shared expert added."""
    import torch

    out = torch.zeros_like(x)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=len(m.experts)).tolist()
    token_of = order // ids.shape[1]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        sel, tok = order[start : start + n], token_of[start : start + n]
        start += n
        y = m.experts[e](x[tok]) * w.reshape(-1)[sel].unsqueeze(-1)
        out.index_add_(0, tok, y.to(out.dtype))
    return out + m.shared_expert(x) * torch.sigmoid(m.shared_expert_gate(x))


def _bound(m, x, w, ids, ref):
    """4u (|ref| + sum_j |w_j| (|y_j| + t_j) + |y_s| + t_s) in float64."""
    import torch.nn.functional as F

    xd = x.double()

    def chain(mlp):
        h = F.silu(xd @ mlp.gate_proj.weight.double().t()) * (xd @ mlp.up_proj.weight.double().t())
        d = mlp.down_proj.weight.double()
        return (h @ d.t()).abs(), h.abs() @ d.abs().t()

    ys, ts = chain(m.shared_expert)
    bound = ref.double().abs() + ys + ts
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            y, tt = chain(m.experts[int(ids[t, j])])
            bound[t] += float(w[t, j]) * (y[t] + tt[t])
    return 4 * U * bound


@pytest.mark.parametrize("T", [1, 3, 8])
@pytest.mark.parametrize("D,I,Is,E,k", [(32, 16, 24, 6, 2), (2048, 512, 1024, 16, 2), (256, 64, 128, 60, 4)])
def test_moe_experts_qwen_layout_equal_the_loop(rng, D, I, Is, E, k, T) -> None:
    import torch

    from engram_trt.native import decode

    m = _moe(D, I, Is, E, k, True, rng)
    gate, up, down, inter = m._stacks()
    assert tuple(down.shape) == (D, E * I), f"the side-by-side down stack: {tuple(down.shape)}"
    x = cuda_normal(rng, (T, D), 1.0, "bfloat16")
    ids = torch.from_numpy(np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32)).cuda()
    w = torch.from_numpy(rng.uniform(0.1, 1.0, (T, k)).astype(np.float32)).cuda().to(torch.bfloat16)
    gl = (x @ m.shared_expert_gate.weight.t()).contiguous()  # [T, 1] bf16, the gate's logits
    with torch.no_grad():
        got = decode.moe_experts(
            x,
            ids,
            w.float(),
            gate.view(E, I, D),
            up.view(E, I, D),
            down,
            shared=(m.shared_expert.gate_proj.weight, m.shared_expert.up_proj.weight, m.shared_expert.down_proj.weight),
            limit=None,
            shared_scale=gl,
        )
        ref = _loop_reference(m, x, w, ids.long())
        bound = _bound(m, x, w.float(), ids, ref)
    torch.cuda.synchronize()
    over = excess(got, ref, bound)
    note(f"experts_bit_exact_{D}_{I}_{E}_{k}_{T}", bool(torch.equal(got, ref)))
    assert over <= 0, f"D {D} I {I} I_s {Is} top {k} of {E}, T {T}: |got - ref| over the bound by {over:.3g}"


# --- 3. fused.moe against the module -----------------------------------------------------------------


@pytest.mark.parametrize("T", [1, 4, 8])
@pytest.mark.parametrize("norm", [True, False])
def test_fused_moe_equals_the_module(rng, norm, T) -> None:
    import torch

    from engram_trt.models.qwen4_exp import fused

    D, I, Is, E, k = 256, 64, 128, 32, 4
    m = _moe(D, I, Is, E, k, norm, rng)
    with torch.no_grad():  # dyadic router weights and inputs: every logit exact in float32 and in bf16
        m.gate.weight.copy_(torch.from_numpy(rng.integers(-4, 5, (E, D)) / 64.0).to(torch.bfloat16))
        m.shared_expert_gate.weight.copy_(torch.from_numpy(rng.integers(-4, 5, (1, D)) / 64.0).to(torch.bfloat16))
    x = torch.from_numpy(rng.integers(-8, 9, (T, D)) / 8.0).to("cuda", torch.bfloat16)
    with torch.no_grad():
        got = fused.moe(m, x)
        assert got is not None, f"the fused MoE serves bf16 on this GPU: {fused.unavailable(x)}"
        ref = m(x, sync_free=False)
        w, ids = m.route(x)
        bound = _bound(m, x, w.float(), ids, ref)
    torch.cuda.synchronize()
    over = excess(got, ref, bound)
    assert over <= 0, f"T {T}, norm {norm}: fused MoE = the module's within the bound; over by {over:.3g}"
    with _fused(False):
        assert fused.moe(m, x) is None, "ENGRAM_TRT_QWEN4_FUSED=0 turns the fused MoE off"


# --- 4. hc_mix: the hyper-connection's mix ----------------------------------------------------------


def _conn(D: int, hc: int, rank: int, inject: bool, rng):
    import torch

    from engram_trt.models.qwen4_exp.modules import GatedResidual

    cfg = SimpleNamespace(hc_count=hc, hidden_size=D, rms_norm_eps=1e-6, hc_lowrank=rank)
    c = GatedResidual(cfg, inject=inject)
    with torch.no_grad():
        for p in c.parameters():
            p.copy_(torch.from_numpy(rng.standard_normal(tuple(p.shape)).astype(np.float32) * p.shape[-1] ** -0.5))
    return c.to("cuda", torch.bfloat16)


@pytest.mark.parametrize("T", [1, 3, 8])
@pytest.mark.parametrize("D,hc,rank,inject", [(32, 2, 8, True), (2048, 4, 320, True), (96, 3, 24, False)])
def test_hc_mix_equals_the_module(rng, D, hc, rank, inject, T) -> None:
    """On the module's own normed streams and low-rank products (so only the up product's
    float32 sum order differs): ``|got - ref| <= 2u |ref| + (1/hc) sum_h (|x_h| dw_h + 2u |w_h
    x_h|)``, dw_h = (2u |u_h| + 2^-20 t_h) / 4 + 2u the sigmoid's input flipping one ulp (its
    slope at most 1/4) and its output one ulp, t_h the up product's term sum; the injection
    weights within one ulp."""
    import torch
    import torch.nn.functional as F

    from engram_trt.native import decode

    c = _conn(D, hc, rank, inject, rng)
    streams = cuda_normal(rng, (T, hc * D), 1.0, "bfloat16")
    with torch.no_grad():
        normed = c.hc_norm(streams)
        z = c.input_mix_weight_down(normed)
        logits = c.block_inject_weight(normed) if inject else None
        a = F.silu(z / hc)
        u = c.input_mix_weight_up(a)
        w = torch.sigmoid(u)
        ref_mixed = (w.unflatten(-1, (hc, D)) * normed.unflatten(-1, (hc, D))).mean(dim=-2)
        ref_inj = 2 * torch.sigmoid(logits / hc) if inject else None
        got_mixed, got_inj = decode.hc_mix(z, c.input_mix_weight_up.weight, normed, logits, hc=hc)
    torch.cuda.synchronize()
    ad, wd = a.double(), c.input_mix_weight_up.weight.double()
    ud = (ad @ wd.t()).view(T, hc, D)
    td = (ad.abs() @ wd.abs().t()).view(T, hc, D)
    xd = normed.double().view(T, hc, D)
    wdd = torch.sigmoid(ud)
    dw = (2 * U * ud.abs() + 2.0**-20 * td) / 4 + 2 * U
    bound = 2 * U * ref_mixed.double().abs() + ((xd.abs() * dw + 2 * U * (wdd * xd).abs()).sum(1)) / hc
    over = excess(got_mixed, ref_mixed, bound)
    note(f"hc_mix_bit_exact_{D}_{hc}_{rank}_{T}", bool(torch.equal(got_mixed, ref_mixed)))
    assert over <= 0, f"D {D} hc {hc} rank {rank} T {T}: mixed over the bound by {over:.3g}"
    if inject:
        diff = (got_inj.double() - ref_inj.double()).abs()
        assert bool((diff <= 2 * U * ref_inj.double().abs()).all()), f"injection weights within one ulp: {diff.max()}"
    else:
        assert got_inj is None


@pytest.mark.parametrize(
    "D,hc,rank,T",
    [(2048, 4, 320, 1), (2048, 4, 320, 8), (96, 3, 24, 16), (64, 8, 760, 16), (40, 5, 16, 3), (33, 1, 8, 2)],
)
def test_hc_mix_split_form_gives_the_same_bits(rng, monkeypatch, D, hc, rank, T) -> None:
    """The split form (a warp per channel and stream, hcMixKernel.cu's default) against the
    warp-per-channel form (ENGRAM_TRT_HC_MIX_SPLIT=0) on the same inputs: the same bits, mixed and injection weights
    (the same sums in the same order); (64, 8, 760, 16) fills the shared memory the split form
    may take, odd hc leave warps of a block idle, D not a multiple of the channels a block serves."""
    import torch

    from engram_trt.native import decode

    c = _conn(D, hc, rank, True, rng)
    streams = cuda_normal(rng, (T, hc * D), 1.0, "bfloat16")
    with torch.no_grad():
        normed = c.hc_norm(streams)
        z = c.input_mix_weight_down(normed)
        logits = c.block_inject_weight(normed)
        monkeypatch.setenv("ENGRAM_TRT_HC_MIX_SPLIT", "0")
        want = decode.hc_mix(z, c.input_mix_weight_up.weight, normed, logits, hc=hc)
        monkeypatch.delenv("ENGRAM_TRT_HC_MIX_SPLIT", raising=False)
        got = decode.hc_mix(z, c.input_mix_weight_up.weight, normed, logits, hc=hc)
    torch.cuda.synchronize()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (
        f"D {D} hc {hc} rank {rank} T {T}: split form's mix differs from the warp-per-channel form's in "
        f"{int((got[0] != want[0]).sum())} of {want[0].numel()} values"
    )


def test_fused_mix_equals_the_module(rng) -> None:
    """The whole fused mix (norm, one GEMV launch, hc_mix) against GatedResidual's PyTorch
    form: within the bf16 round-off of the two products' sum order (8u, 3%, relative L2
    of the mixed input and one ulp-scale of the injection weights: the norm and the
    products each may flip an ulp that the sigmoid gate and the mean pass on)."""
    import torch

    from engram_trt.models.qwen4_exp import fused

    from .cases import rel_err

    c = _conn(2048, 4, 320, True, rng)
    streams = cuda_normal(rng, (4, 4 * 2048), 1.0, "bfloat16")
    with torch.no_grad():
        got = fused.mix(c, streams)
        assert got is not None, f"the fused mix serves bf16 on this GPU: {fused.unavailable(streams)}"
        with _fused(False):
            assert fused.mix(c, streams) is None
            ref = c.mix(streams)
    torch.cuda.synchronize()
    assert rel_err(got[0], ref[0]) <= 8 * U, f"mixed input: rel L2 {rel_err(got[0], ref[0]):.3g}"
    assert rel_err(got[1], ref[1]) <= 4 * U, f"injection weights: rel L2 {rel_err(got[1], ref[1]):.3g}"


# --- 5. the tiny checkpoint, decode in bf16 ----------------------------------------------------------


def test_fused_model_decode_within_round_off(monkeypatch) -> None:
    import torch

    from engram_trt.models.qwen4_exp import fused
    from engram_trt.models.qwen4_exp.ple_tables import PLETables, table_shard_names
    from engram_trt.models.step import PackedStep

    from .cases import rel_err

    data = REPO / "tests" / "data" / "qwen4_exp_tiny"
    ck32, ref = load_checkpoint(data, "cuda", torch.float32)
    ck16, model = load_checkpoint(data, "cuda", torch.bfloat16)
    cfg = model.config
    model.ple_tables = PLETables.from_tensors(
        [
            torch.cat([ck16.get(n) for n in table_shard_names(cfg, li)]).to("cuda", torch.bfloat16)
            for li in range(len(cfg.ple.layers))
        ]
    )
    calls = {"fused": 0, "gdn_gates": 0, "gated_norm": 0}
    real, real_gates, real_norm = fused.moe, fused.gdn_gates, fused.gated_norm

    def counted(mlp, x):
        out = real(mlp, x)
        calls["fused"] += out is not None
        return out

    def counted_gates(*a):
        out = real_gates(*a)
        calls["gdn_gates"] += out is not None
        return out

    def counted_norm(*a):
        out = real_norm(*a)
        calls["gated_norm"] += out is not None
        return out

    fused.moe, fused.gdn_gates, fused.gated_norm = counted, counted_gates, counted_norm
    n_linear = sum(kind == "linear_attention" for kind in cfg.layer_types)
    monkeypatch.delenv(fused.GDN_GLUE_ENV, raising=False)  # the Gated DeltaNet glue: on by default
    try:
        gen = torch.Generator().manual_seed(5)
        prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=gen).tolist() for n in (7, 13, 10)]
        states = {name: (ref if name == "fp32" else model).new_cache(4, 96) for name in ("fp32", "fused", "plain")}
        step = PackedStep(torch.tensor(sum(prompts, [])), [len(p) for p in prompts], [0, 0, 0], [0, 1, 2])
        for name, st in states.items():
            with _fused(name != "plain"):
                (ref if name == "fp32" else model).forward_step(step, st)
        lens = [len(p) for p in prompts]
        toks = [5, 9, 13]
        fes, pes, bad = [], [], []
        for s in range(12):
            slots = [0, 1, 2][: 1 + s % 3]
            ids = torch.tensor([toks[i] for i in slots])
            mk = lambda: PackedStep(ids, [1] * len(slots), [lens[i] for i in slots], slots)  # noqa: E731
            want = ref.forward_step(mk(), states["fp32"]).cpu()
            before = dict(calls)
            with _fused(True):
                f = model.forward_step(mk(), states["fused"]).float().cpu()
            if calls["fused"] - before["fused"] != cfg.num_hidden_layers:
                bad.append(
                    f"step {s}: {calls['fused'] - before['fused']} fused MoE calls, {cfg.num_hidden_layers} layers"
                )
            for key in ("gdn_gates", "gated_norm"):
                if calls[key] - before[key] != n_linear:
                    bad.append(f"step {s}: {calls[key] - before[key]} fused {key} calls, {n_linear} GDN layers")
            with _fused(False):
                p = model.forward_step(mk(), states["plain"]).float().cpu()
            fes.append(rel_err(f, want))
            pes.append(rel_err(p, want))
            if not torch.isfinite(f).all():
                bad.append(f"step {s}: fused logits not finite")
            for i, t in zip(slots, want.argmax(-1).tolist()):
                toks[i] = t
                lens[i] += 1
    finally:
        fused.moe, fused.gdn_gates, fused.gated_norm = real, real_gates, real_norm
        ck32.close()
        ck16.close()
    fm, pm = float(np.median(fes)), float(np.median(pes))
    note("decode_rel_err_fused_median", fm)
    note("decode_rel_err_unfused_median", pm)
    assert not bad and fm <= 2 * pm + 1e-3, (
        f"bf16 fused decode within 2x the unfused bf16 distance from fp32 + 1e-3 (median of 12 steps): fused "
        f"{fm:.2e} vs unfused {pm:.2e}; per step fused {[f'{e:.1e}' for e in fes]} unfused "
        f"{[f'{e:.1e}' for e in pes]}; {'; '.join(bad[:4])}"
    )


# --- 6. the Gated DeltaNet glue: gates and the gated output norm --------------------------------------

U32 = 2.0**-24  # float32 unit round-off


@pytest.mark.parametrize("T", [1, 3, 8])
@pytest.mark.parametrize("H", [32, 3])
@pytest.mark.parametrize("bias_dtype", ["bfloat16", "float32"])
def test_gdn_gates_equal_the_torch_ops(rng, T, H, bias_dtype) -> None:
    """beta = sigmoid(b).float() bit for bit; g = -exp(A_log) * softplus(a.float() +
    dt_bias.float()) within 2 x (2 + 1 + 0.5) eps32 |g| < 8 eps32 |g| (expf's 2 ulp and
    log1pf's 1 ulp on each side, the multiply's rounding; gdnGlueKernel.cu), b and a
    strided column slices of one projection output as fused.project gives them."""
    import torch
    import torch.nn.functional as F

    from engram_trt.native import decode

    proj = cuda_normal(rng, (T, 2 * H + 5), 3.0, "bfloat16")
    b, a = proj[:, 1 : H + 1], proj[:, H + 3 : 2 * H + 3]
    a[0, 0] = 24.0  # softplus' threshold branch (x > 20: x itself)
    dt_bias = cuda_normal(rng, (H,), 1.0, bias_dtype)
    neg_decay = -cuda_normal(rng, (H,), 1.0).exp()
    with torch.no_grad():
        want_beta = torch.sigmoid(b).float()
        want_g = neg_decay * F.softplus(a.float() + dt_bias.float())
        beta, g = decode.gdn_gates(b, a, dt_bias, neg_decay)
    torch.cuda.synchronize()
    note(f"gdn_gates_g_bit_exact_{T}_{H}_{bias_dtype}", bool(torch.equal(g, want_g)))
    assert torch.equal(beta, want_beta), f"beta bit for bit: {(beta - want_beta).abs().max()}"
    over = excess(g, want_g, 8 * EPS32 * want_g.double().abs())
    assert over <= 0, f"g over 8 eps32 |g| by {over:.3g}"
    assert float(g[0, 0]) == float(want_g[0, 0]), "the threshold branch's bits"


def _gated_norm_bound(v, w, z, eps: float, activation: str):
    """The float64 value of GatedRMSNorm on bf16 values ``v [T, H, dim]`` (the core
    rounded), weight ``w`` and gate ``z``, and one side's error bound: its relative errors
    chained, (1 + dy)(1 + U)^3 (1 + 7 u32) - 1, dy = ((dim + 2) / 2 + 5) u32 the float32
    sum of squares in any order ((dim - 1) u32), times 1 / dim and + eps (u32 each), halved
    by the rsqrt, rsqrtf's 2 ulp and the product's rounding; U each of the three bf16
    roundings (y, w * y, the output); 8 u32 the activation's expf (2 ulp), add, divide (and
    a multiply, were silu spelled x * sigmoid(x)) and the float32 product with it."""
    import torch

    dim = v.shape[-1]
    vd, wd, zd = v.double(), w.double(), z.double()
    r = torch.rsqrt((vd * vd).sum(-1, keepdim=True) / dim + eps)
    act = zd * torch.sigmoid(zd) if activation == "silu" else torch.sigmoid(zd)
    exact = wd * vd * r * act
    dy = ((dim + 2) / 2 + 5) * U32
    rel = (1 + dy) * (1 + U) ** 3 * (1 + 8 * U32) - 1
    return exact, rel * exact.abs()


@pytest.mark.parametrize("T", [1, 3, 8])
@pytest.mark.parametrize("H,dim", [(32, 128), (3, 37)])
@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
@pytest.mark.parametrize("x_dtype", ["bfloat16", "float32"])
def test_gated_norm_equals_the_module(rng, T, H, dim, activation, x_dtype) -> None:
    """gated_norm against GatedRMSNorm.forward on the core's output (``core.to(bf16)``) and
    a strided gate: each within _gated_norm_bound of the float64 value, so within twice it
    of each other (the sum of squares' order is the only operation done differently)."""
    import torch

    from engram_trt.models.qwen4_exp.norms import GatedRMSNorm
    from engram_trt.native import decode

    norm = GatedRMSNorm(dim, 1e-6, activation)
    with torch.no_grad():
        norm.weight.copy_(torch.from_numpy((rng.standard_normal(dim) * 0.5 + 1).astype(np.float32)))
    norm = norm.to("cuda", torch.bfloat16)
    core = cuda_normal(rng, (T, H, dim), 1.5, x_dtype)
    z = cuda_normal(rng, (T, H * dim + 6), 2.0, "bfloat16")[:, 3 : 3 + H * dim]
    with torch.no_grad():
        want = norm(core.to(torch.bfloat16).reshape(-1, dim), z.reshape(-1, dim)).reshape(T, H * dim)
        got = decode.gated_norm(core.reshape(T, H * dim), z, norm.weight, heads=H, eps=1e-6, activation=activation)
    torch.cuda.synchronize()
    v = core.to(torch.bfloat16).float().cpu()
    w = norm.weight.detach().float().cpu()
    exact, bound = _gated_norm_bound(v, w, z.float().cpu().view(T, H, dim), 1e-6, activation)
    exact, bound = exact.reshape(T, H * dim), bound.reshape(T, H * dim)
    tag = f"T {T} H {H} dim {dim} {activation} {x_dtype}"
    note(f"gated_norm_bit_exact_{T}_{H}_{dim}_{activation}_{x_dtype}", bool(torch.equal(got, want)))
    assert excess(want, exact, bound) <= 0, f"{tag}: the module itself outside the derived bound"
    over = excess(got, exact, bound)
    assert over <= 0, f"{tag}: the kernel over the float64 bound by {over:.3g}"
    over = excess(got, want, 2 * bound)
    assert over <= 0, f"{tag}: kernel vs module over twice the bound by {over:.3g}"


def test_fused_gdn_glue_serves_bf16_and_steps_aside(rng) -> None:
    """fused.gdn_gates / fused.gated_norm take a bf16 decode step on this GPU (the layer's
    own gates and norm: the values of the two tests above) and give way under
    ENGRAM_TRT_QWEN4_FUSED=0 and above 16 tokens."""
    import torch

    from engram_trt.models.qwen4_exp import fused
    from engram_trt.models.qwen4_exp.norms import GatedRMSNorm

    b, a = cuda_normal(rng, (2, 32), 1.0, "bfloat16"), cuda_normal(rng, (2, 32), 1.0, "bfloat16")
    dt_bias, neg_decay = cuda_normal(rng, (32,), 1.0, "bfloat16"), -cuda_normal(rng, (32,), 1.0).exp()
    norm = GatedRMSNorm(128, 1e-6, "silu").to("cuda", torch.bfloat16)
    core, z = cuda_normal(rng, (2, 32, 128), 1.0, "bfloat16"), cuda_normal(rng, (2, 32 * 128), 1.0, "bfloat16")
    with torch.no_grad(), _gdn_glue():
        assert fused.gdn_gates(b, a, dt_bias, neg_decay) is not None, fused.unavailable(b)
        assert fused.gated_norm(norm, core, z, 32) is not None, fused.unavailable(z)
        big = cuda_normal(rng, (17, 32), 1.0, "bfloat16")
        assert fused.gdn_gates(big, big, dt_bias, neg_decay) is None
        with _fused(False):
            assert fused.gdn_gates(b, a, dt_bias, neg_decay) is None
            assert fused.gated_norm(norm, core, z, 32) is None
