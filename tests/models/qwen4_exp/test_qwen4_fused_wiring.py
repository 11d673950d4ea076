"""The wiring of Qwen4Exp's fused decode MoE (models/qwen4_exp/fused.py) on a CPU: which
tensor goes into which kernel with which arguments. The kernels need a GPU
(tests/gpu/test_qwen4_fused.py holds each to the module it replaces); here each is
replaced by a PyTorch emulation of its contract (decodeKernels.h: the GEMV segments, the
softmax router, the experts over the ``[D, E * I]`` down stack with the sigmoid-gated
shared expert) and the fused path, forced on for a float32 CPU module, must give
``SparseMoE``'s per-expert form (float32 round-off), with and without ``norm_topk_prob``,
for several widths and token counts; and it must step aside where the kernels do not
serve (a tensor-parallel rank's experts, FP8 experts, more tokens than a decode step).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F


def _gemv_segments(segments, *, weight_static=True, prologue=None):
    assert prologue is None
    for x, w, out in segments:
        out.copy_(F.linear(x, w))


def _moe_route(logits, *, top_k, score_fn, scaling, bias=None, tid2eid=None, input_ids=None):
    assert bias is None and tid2eid is None and score_fn in ("softmax", "softmax_topk")
    probs = torch.softmax(logits.float(), dim=-1)
    w, ids = torch.topk(probs, top_k, dim=-1)
    if score_fn == "softmax":
        w = w / w.sum(dim=-1, keepdim=True)
    return ids.to(torch.int32), (w * scaling).to(logits.dtype).float()


def _moe_experts(x, ids, weights, gate, up, down, *, shared, limit, shared_scale=None):
    E, I, D = gate.shape
    assert limit is None and tuple(down.shape) == (D, E * I), "Qwen's side-by-side down stack"
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in sorted(range(ids.shape[1]), key=lambda j: (int(ids[t, j]), j)):
            e = int(ids[t, j])
            h = F.silu(F.linear(x[t], gate[e])) * F.linear(x[t], up[e])
            out[t] += F.linear(h, down[:, e * I : (e + 1) * I]) * weights[t, j].to(x.dtype)
    sg, su, sd = shared
    y = F.linear(F.silu(F.linear(x, sg)) * F.linear(x, su), sd)
    return out + y * torch.sigmoid(shared_scale)


def _gdn_gates(b, a, dt_bias, neg_decay):
    """engram_gdn_gates_bf16's contract: beta = bf(sigmoid(b)) as float32 (bf: the
    activations' dtype), g = neg_decay * softplus(float(a) + float(dt_bias)) with torch's
    threshold-20 rule spelled out."""
    beta = torch.sigmoid(b.float()).to(b.dtype).float()
    x = a.float() + dt_bias.float()
    return beta, neg_decay * torch.where(x > 20, x, torch.log1p(torch.exp(x)))


def _gated_norm(x, gate, weight, *, heads, eps, activation):
    """engram_gated_rms_norm_bf16's contract: per (token, head) row v = float(bf(x)),
    y = bf(v * rsqrt(sum(v^2) * (1 / dim) + eps)), out = bf(bf(w * y) * act(float(gate)))."""
    T, dim, dt = gate.shape[0], weight.shape[0], gate.dtype
    v = x.to(dt).float().reshape(T, heads, dim)
    y = (v * torch.rsqrt((v * v).sum(-1, keepdim=True) * (1.0 / dim) + eps)).to(dt)
    o = (weight.float() * y.float()).to(dt)
    z = gate.float().reshape(T, heads, dim)
    act = z / (1 + torch.exp(-z)) if activation == "silu" else 1 / (1 + torch.exp(-z))
    return (o.float() * act).to(dt).reshape(T, heads * dim)


@pytest.fixture
def emulated(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    from engram_trt.models.qwen4_exp import fused
    from engram_trt.native import decode

    calls: dict[str, int] = {}

    def counted(name, fn):
        def call(*a, **kw):
            calls[name] = calls.get(name, 0) + 1
            return fn(*a, **kw)

        return call

    monkeypatch.setattr(fused, "unavailable", lambda x: None)
    monkeypatch.delenv(fused.GDN_GLUE_ENV, raising=False)  # the Gated DeltaNet glue: on by default
    monkeypatch.setattr(decode, "gemv_fits", lambda x, w: x.dim() == 2 and x.shape[1] == w.shape[1])
    monkeypatch.setattr(decode, "gemv_segments", counted("gemv_segments", _gemv_segments))
    monkeypatch.setattr(decode, "moe_route", counted("moe_route", _moe_route))
    monkeypatch.setattr(decode, "moe_experts", counted("moe_experts", _moe_experts))
    monkeypatch.setattr(decode, "gdn_gates", counted("gdn_gates", _gdn_gates))
    monkeypatch.setattr(decode, "gated_norm", counted("gated_norm", _gated_norm))
    return calls


def _moe(D, I, Is, E, k, norm, seed=0):
    from engram_trt.models.qwen4_exp.modules import SparseMoE

    torch.manual_seed(seed)
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
        for p in m.parameters():
            p.normal_(0.0, p.shape[-1] ** -0.5)
    m.stack_experts()
    return m


@pytest.mark.parametrize("T", [1, 3, 8])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("D,I,Is,E,k", [(32, 16, 24, 6, 2), (64, 40, 48, 10, 3)])
def test_fused_moe_equals_the_module(emulated, D, I, Is, E, k, norm, T) -> None:
    m = _moe(D, I, Is, E, k, norm)
    x = torch.randn(T, D)
    with torch.no_grad():
        got = m(x, sync_free=True)
        want = m(x, sync_free=False)
    assert emulated == {"gemv_segments": 1, "moe_route": 1, "moe_experts": 1}, emulated
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fused_moe_steps_aside_where_the_kernels_do_not_serve(emulated) -> None:
    from engram_trt.models.qwen4_exp import fused

    m = _moe(32, 16, 24, 6, 2, True)
    assert fused.moe(m, torch.randn(9, 32)) is None, "more tokens than a decode step's GEMV"
    assert fused.moe(m, torch.randn(4, 64)[:, :32]) is None, "strided activations"
    m.expert_range = (0, 3)
    assert fused.moe(m, torch.randn(2, 32)) is None, "a tensor-parallel rank's experts"
    m.expert_range = None
    m5 = _moe(32, 12, 24, 6, 2, True)
    assert fused.moe(m5, torch.randn(2, 32)) is None, "I not a multiple of 8"
    assert emulated == {}, f"no kernel called where the fused path steps aside: {emulated}"
    with torch.no_grad():
        assert fused.moe(m, torch.randn(2, 32)) is not None


def _hc_mix(down_out, up, normed, inject_logits, *, hc):
    T, D = normed.shape[0], up.shape[0] // hc
    w = torch.sigmoid(F.linear(F.silu(down_out / hc), up))
    mixed = (w.view(T, hc, D) * normed.view(T, hc, D)).sum(1) * (1.0 / hc)
    return mixed, None if inject_logits is None else 2 * torch.sigmoid(inject_logits / hc)


@pytest.mark.parametrize("inject", [True, False])
@pytest.mark.parametrize("T", [1, 5])
def test_fused_mix_equals_the_module(monkeypatch, emulated, inject, T) -> None:
    from engram_trt.models.qwen4_exp import fused
    from engram_trt.models.qwen4_exp.modules import GatedResidual
    from engram_trt.native import decode

    monkeypatch.setattr(decode, "hc_mix", _hc_mix)
    torch.manual_seed(1)
    c = GatedResidual(SimpleNamespace(hc_count=3, hidden_size=40, rms_norm_eps=1e-6, hc_lowrank=16), inject=inject)
    with torch.no_grad():
        for p in c.parameters():
            p.normal_(0.0, p.shape[-1] ** -0.5)
        streams = torch.randn(T, 120)
        got = fused.mix(c, streams)
        want = c.mix(streams)  # a CPU tensor: the PyTorch form
    assert emulated == {"gemv_segments": 1}, emulated
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    if inject:
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    else:
        assert got[1] is None and want[1] is None
    assert fused.mix(c, torch.randn(9, 120)) is None, "more tokens than a decode step's GEMV"


def test_gated_delta_net_decode_projects_in_two_launches(emulated) -> None:
    """GatedDeltaNet.forward_decode with the fused projections (four input projections in
    one launch, the output projection in another), gates (one launch) and output norm (one
    launch) equals its module path on the same states, and leaves the same states."""
    from engram_trt.models.qwen4_exp import fused
    from engram_trt.models.qwen4_exp.linear_attention import GatedDeltaNet

    from helpers.qwen4_exp import gdn_config

    cfg = gdn_config()
    torch.manual_seed(2)
    ours = GatedDeltaNet(cfg, 0).eval()
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(torch.randn(p.shape) * 0.3 + (1.0 if p is ours.norm.weight else 0.0))
    shapes = GatedDeltaNet.state_shapes(cfg)
    x = torch.randn(3, cfg.hidden_size)
    slots = torch.tensor([4, 0, 2])
    conv_a, rec_a = torch.randn(5, *shapes["conv"]) * 0.5, torch.randn(5, *shapes["recurrent"]) * 0.5
    conv_b, rec_b = conv_a.clone(), rec_a.clone()
    with torch.no_grad():
        got = ours.forward_decode(x, slots, conv_a, rec_a)
    assert emulated == {"gemv_segments": 2, "gdn_gates": 1, "gated_norm": 1}, emulated
    real = fused.unavailable
    try:
        fused.unavailable = lambda x: "off"
        with torch.no_grad():
            want = ours.forward_decode(x, slots, conv_b, rec_b)
    finally:
        fused.unavailable = real
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(conv_a, conv_b)
    torch.testing.assert_close(rec_a, rec_b, rtol=1e-5, atol=1e-6)
    assert isinstance(ours, GatedDeltaNet)


@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
@pytest.mark.parametrize("T,H,dim", [(1, 4, 128), (3, 3, 37), (8, 2, 16)])
def test_gdn_glue_contracts_equal_the_modules_in_bf16(activation, T, H, dim) -> None:
    """The two kernels' contracts (the emulations above) on bf16 operands give the module
    forms they replace: beta's bits, g within the exp / log1p codes' ulps, the norm's bits where
    1 / dim is exact and torch's mean is that same sum, else within one bf16 ulp of the
    mean's sum / dim against sum * (1 / dim); strided rows as the projections give them."""
    from engram_trt.models.qwen4_exp.norms import GatedRMSNorm

    torch.manual_seed(T * 100 + dim)
    bf = torch.bfloat16
    proj = (torch.randn(T, 2 * H + 3) * 4).to(bf)  # b and a as slices of one wider output
    b, a = proj[:, 1 : H + 1], proj[:, H + 2 : 2 * H + 2]
    a[0, 0] = 22.0  # softplus' threshold branch
    dt_bias, neg_decay = torch.randn(H).to(bf), -torch.rand(H).exp()
    beta, g = _gdn_gates(b, a, dt_bias, neg_decay)
    assert torch.equal(beta, torch.sigmoid(b).float())
    x = a.float() + dt_bias.float()
    ref = neg_decay * F.softplus(x)
    assert float(g[0, 0]) == float(ref[0, 0]) == float(neg_decay[0] * x[0, 0]), "x > 20: x itself"
    # the CPU's softplus kernel and torch.exp / torch.log1p are other exp / log1p codes:
    # each within 2 + 1 ulp of the exact softplus, then the multiply (gdnGlueKernel.cu)
    assert bool(((g - ref).abs() <= 8 * 2.0**-23 * ref.abs()).all()), (g - ref).abs().max()
    norm = GatedRMSNorm(dim, 1e-6, activation)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim) * 0.5 + 1)
    norm = norm.to(bf)
    core = torch.randn(T, H, dim) * 2  # float32, as the PyTorch core returns it
    z = (torch.randn(T, H * dim + 8) * 2).to(bf)[:, 4 : 4 + H * dim]
    with torch.no_grad():
        want = norm(core.to(bf).reshape(-1, dim), z.reshape(-1, dim)).reshape(T, H * dim)
    got = _gated_norm(core.reshape(T, H * dim), z, norm.weight.detach(), heads=H, eps=1e-6, activation=activation)
    if dim & (dim - 1) == 0:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-6)


def test_gdn_glue_steps_aside_where_the_kernels_do_not_serve(emulated) -> None:
    from engram_trt.models.qwen4_exp import fused
    from engram_trt.models.qwen4_exp.norms import GatedRMSNorm

    H, dim = 4, 16
    dt_bias, neg_decay = torch.randn(H), -torch.rand(H).exp()
    assert fused.gdn_gates(torch.randn(17, H), torch.randn(17, H), dt_bias, neg_decay) is None, "17 tokens"
    assert fused.gdn_gates(torch.randn(2, H), torch.randn(2, H).double(), dt_bias, neg_decay) is None, "dtypes"
    assert fused.gdn_gates(torch.randn(H, 2).t(), torch.randn(2, H), dt_bias, neg_decay) is None, "column stride"
    assert fused.gdn_gates(torch.randn(2, H), torch.randn(2, H), dt_bias[:3], neg_decay[:3]) is None, "3 biases"
    norm = GatedRMSNorm(dim, 1e-6, "silu")
    core, z = torch.randn(2, H, dim), torch.randn(2, H * dim)
    assert fused.gated_norm(norm, torch.randn(17, H, dim), torch.randn(17, H * dim), H) is None, "17 tokens"
    assert fused.gated_norm(norm.to(torch.float64), core, z, H) is None, "a weight of another dtype"
    assert fused.gated_norm(norm.float(), core, z, H + 1) is None, "the gate's width is not heads * dim"
    assert emulated == {}, f"no kernel called where the glue steps aside: {emulated}"
    assert fused.gated_norm(norm.float(), core, z, H) is not None
    assert fused.gdn_gates(torch.randn(2, H), torch.randn(2, H), dt_bias, neg_decay) is not None
    assert emulated == {"gated_norm": 1, "gdn_gates": 1}, emulated


def test_qsa_decode_projects_in_two_launches(emulated) -> None:
    """GatedAttention.forward_decode (the tiny checkpoint's QSA layer, the PyTorch core)
    with the fused projections (q, k, v and the indexer's in one launch, o_proj in another)
    equals its module path, caches included."""
    import json
    from pathlib import Path

    from engram_trt.models.qwen4_exp import fused
    from engram_trt.models.qwen4_exp.attention import GatedAttention
    from engram_trt.models.qwen4_exp.config import read_config

    data = Path(__file__).resolve().parents[2] / "data" / "qwen4_exp_tiny" / "config.json"
    cfg = read_config(json.loads(data.read_text()))
    layer = cfg.layer_types.index("indexed_attention")
    torch.manual_seed(3)
    attn = GatedAttention(cfg, layer).eval()
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape) * p.shape[-1] ** -0.5)
    shapes = GatedAttention.cache_shapes(cfg, 64)
    caches = [torch.randn(3, *shapes[k]) for k in ("key", "value", "index_key")]
    x = torch.randn(2, cfg.hidden_size)
    positions, slots = torch.tensor([17, 40]), torch.tensor([2, 0])
    got_caches = [c.clone() for c in caches]
    with torch.no_grad():
        got = attn.forward_decode(x, positions, slots, 48, *got_caches)
    assert emulated == {"gemv_segments": 2}, emulated
    real = fused.unavailable
    try:
        fused.unavailable = lambda x: "off"
        with torch.no_grad():
            want = attn.forward_decode(x, positions, slots, 48, *caches)
    finally:
        fused.unavailable = real
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(got_caches, caches):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_gated_delta_net_decode_takes_the_steps_meta(monkeypatch) -> None:
    """The step's int32 meta the model passes (``[0..B, past lengths, slots]``) reaches the
    core as the layer would build it (past lengths only as > 0: each position >= 1), and
    ``-exp(A_log)`` is made once and reused while A_log is unchanged."""
    from helpers.qwen4_exp import gdn_config

    from engram_trt.models.qwen4_exp.linear_attention import GatedDeltaNet

    cfg = gdn_config()
    torch.manual_seed(4)
    layer = GatedDeltaNet(cfg, 0).eval()
    seen: list[torch.Tensor] = []

    def core(cols, g, beta, meta, S, conv, rec):
        seen.append(meta.clone())
        return torch.zeros(cols.shape[0], layer.num_v_heads, layer.head_v_dim)

    monkeypatch.setattr(layer, "_kernel_serves", lambda *a: True)
    monkeypatch.setattr(layer, "_core_kernels", core)
    shapes = GatedDeltaNet.state_shapes(cfg)
    conv, rec = torch.zeros(4, *shapes["conv"]), torch.zeros(4, *shapes["recurrent"])
    x, slots = torch.randn(3, 32), torch.tensor([2, 0, 3])
    step_meta = torch.tensor([0, 1, 2, 3, 7, 1, 30, 2, 0, 3], dtype=torch.int32)
    with torch.no_grad():
        layer.forward_decode(x, slots, conv, rec)
        layer.forward_decode(x, slots, conv, rec, meta=step_meta)
    built, given = seen
    assert torch.equal(given, step_meta)
    assert torch.equal(built[:4], given[:4]) and torch.equal(built[7:], given[7:]), (built, given)
    assert bool((built[4:7] > 0).all() and (given[4:7] > 0).all())
    first = layer._neg_decay()
    assert layer._neg_decay() is first and torch.equal(first, -layer.A_log.float().exp())
    with torch.no_grad():
        layer.A_log.add_(1.0)
    assert torch.equal(layer._neg_decay(), -layer.A_log.float().exp()), "a changed A_log is read again"


def test_gdn_glue_steps_aside_when_switched_off(monkeypatch: pytest.MonkeyPatch, emulated) -> None:
    """ENGRAM_TRT_QWEN4_GDN_GLUE=0 (the A/B switch) makes the Gated DeltaNet glue step aside
    where it would serve: the decode step runs the PyTorch ops; unset or any other value, it serves."""
    from engram_trt.models.qwen4_exp import fused
    from engram_trt.models.qwen4_exp.norms import GatedRMSNorm

    H, dim = 4, 16
    dt_bias, neg_decay = torch.randn(H), -torch.rand(H).exp()
    norm = GatedRMSNorm(dim, 1e-6, "silu")
    core, z = torch.randn(2, H, dim), torch.randn(2, H * dim)
    monkeypatch.setenv(fused.GDN_GLUE_ENV, "0")
    assert not fused.gdn_glue_on()
    assert fused.gdn_gates(torch.randn(2, H), torch.randn(2, H), dt_bias, neg_decay) is None
    assert fused.gated_norm(norm, core, z, H) is None
    assert emulated == {}, emulated
    for n, value in enumerate((None, "1", "yes"), start=1):
        if value is None:
            monkeypatch.delenv(fused.GDN_GLUE_ENV, raising=False)
        else:
            monkeypatch.setenv(fused.GDN_GLUE_ENV, value)
        assert fused.gdn_glue_on(), value
        assert fused.gdn_gates(torch.randn(2, H), torch.randn(2, H), dt_bias, neg_decay) is not None, value
        assert emulated == {"gdn_gates": n}, emulated
