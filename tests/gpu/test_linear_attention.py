"""Qwen4-Exp's Gated DeltaNet kernels (plugins/kernels/linearAttentionKernel.cu, through
engram_trt.native.linear_attention) and their plugins (EngramCausalConv1d,
EngramGatedDeltaNet) on a GPU.

- pieces: each kernel over a run of packed steps (prompts, prefill chunks continuing from
  the state, decodes, a slot with stale state restarted by past_lens 0, a multi-chunk
  prompt) against the float64 reference (models/qwen4_exp/reference_linear_attention.py) on the
  very same inputs: float32 within ``2e-5 max|ref|``; bf16 / fp16 elementwise
  ``u |ref| + 2e-5 max|ref|`` (the output rounded once; u = 2^-8 / 2^-11). States
  compared after every step. dk / dv from 8 to 256, dv not a multiple of the 32-column tile.
- the layer: GatedDeltaNet (models/qwen4_exp/linear_attention.py, every parameter random)
  on its kernel path (``backend = "kernels"``: the packed step and the decode-only step
  the CUDA graphs record) = the torch layer on the CPU in float32 (its chunked /
  recurrent forms): float32 ``1e-4 max|ref|``; bf16 as close as the torch layer's own bf16
  path on the same GPU (within 1.5x its distance + 0.01; a fixed bf16 bound was too tight
  for some random layers, PyTorch's bf16 path included).
- chunks + decode steps = one whole step, bit for bit (both kernels keep the token order
  and the tap order whatever the chunking); padding tokens / a padding slot; T = 0.
- the plugins' enqueue (build phase and runtime after a round trip; state aliased in place
  and in a separate output) = the binding, bit for bit; and check_plugin_cpu, shared with
  the CPU suite (tests/plugins/test_linear_attention_plugins.py).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest

from .helpers import DT, PF_FLOAT32, PF_INT32, PF_INT64, Checks, Harness  # (Harness: the CPU suite)

DTYPES = ["float32", "bfloat16", "float16"]
UNIT_ROUNDOFF = {"float32": 0.0, "bfloat16": 2.0**-8, "float16": 2.0**-11}
# Half the spacing of the type's subnormals: rounding a value below the normal range errs
# by up to this much, not by u |x| (float16's subnormals start at 6.1e-5, spacing 2^-24).
SUBNORMAL_HALF_SPACING = {"float32": 0.0, "bfloat16": 2.0**-134, "float16": 2.0**-25}
DELTA_CONFIGS = [(2, 4, 8, 40), (2, 4, 128, 128), (1, 2, 256, 256), (2, 6, 64, 96)]  # (Hk, Hv, dk, dv)
NUM_SLOTS = 5
# (seq_starts, past_lens, slots) per step: prompts (one shorter than the conv's history),
# a chunk from a state + a decode + a new prompt, decodes, a restart over a stale slot
# with a multi-chunk prompt beside a decode.
STEPS = [
    ([0, 6, 8], [0, 0], [0, 2]),
    ([0, 5, 6, 9], [6, 2, 0], [0, 2, 3]),
    ([0, 1, 2, 3], [11, 3, 3], [0, 2, 3]),
    ([0, 70, 71], [0, 12], [2, 0]),
]


def _i32(torch, values, dev):
    return torch.tensor(list(values), dtype=torch.int32, device=dev)


def _rel_or_bound(got, want, u: float, rel: float, eta: float = 0.0) -> tuple[bool, float]:
    """(ok, worst): float32 ``|got - want| <= rel max|want|``; 16-bit elementwise
    ``u |want| + eta + rel max|want|`` (``eta``: the output rounding's absolute error
    below the normal range; worst: the excess over the bound, <= 0 passes)."""
    scale = float(np.abs(want).max()) if want.size else 0.0
    excess = np.abs(got - want) - (u * np.abs(want) + eta + rel * max(scale, 1e-30))
    worst = float(excess.max()) if excess.size else 0.0
    return bool(np.isfinite(got).all()) and worst <= 0, worst


@pytest.mark.parametrize("dname", DTYPES)
def test_conv_kernel_matches_reference(rng, dname) -> None:
    import torch

    from engram_trt.models.qwen4_exp.reference_linear_attention import causal_conv1d_reference
    from engram_trt.native import linear_attention as la

    dev, dtype, u = torch.device("cuda"), getattr(torch, dname), UNIT_ROUNDOFF[dname]
    for C, K, act in ((80, 4, 1), (1000, 2, 0), (257, 5, 1)):
        weight = torch.from_numpy(rng.standard_normal((C, 1, K)).astype(np.float32) * 0.5).to(dev, dtype)
        state = torch.from_numpy(rng.standard_normal((NUM_SLOTS, C, K - 1)).astype(np.float32)).to(dev, dtype)
        ref_state = state.double().cpu().numpy()
        ok_all, worst, worst_state = True, 0.0, 0.0
        for starts, past, slots in STEPS:
            x = torch.from_numpy(rng.standard_normal((starts[-1], C)).astype(np.float32)).to(dev, dtype)
            y = la.causal_conv1d(
                x,
                weight,
                state,
                _i32(torch, starts, dev),
                _i32(torch, past, dev),
                _i32(torch, slots, dev),
                activation=act,
            )
            want, ref_state = causal_conv1d_reference(
                x.double().cpu().numpy(), weight.double().cpu().numpy(), ref_state, starts, past, slots, act
            )
            ok, err = _rel_or_bound(y.double().cpu().numpy(), want, u, 2e-5, SUBNORMAL_HALF_SPACING[dname])
            s_err = float(np.abs(state.double().cpu().numpy() - ref_state).max())  # copies of inputs: exact
            ok_all &= ok and s_err == 0.0
            worst, worst_state = max(worst, err), max(worst_state, s_err)
        assert ok_all, (
            f"causal conv {dname} C={C} K={K} act={act} = float64 reference over {len(STEPS)} steps: "
            f"max excess over the bound {worst:.3g}, max state diff {worst_state:.3g}"
        )


def _delta_inputs(torch, rng, T, Hk, Hv, dk, dv, dtype, dev):
    q = torch.from_numpy(rng.standard_normal((T, Hk, dk)).astype(np.float32)).to(dev, dtype)
    k = torch.from_numpy(rng.standard_normal((T, Hk, dk)).astype(np.float32)).to(dev, dtype)
    v = torch.from_numpy(rng.standard_normal((T, Hv, dv)).astype(np.float32)).to(dev, dtype)
    g = torch.from_numpy(-np.exp(rng.uniform(-3.0, 0.5, (T, Hv))).astype(np.float32)).to(dev)
    beta = torch.from_numpy((1.0 / (1.0 + np.exp(-rng.standard_normal((T, Hv))))).astype(np.float32)).to(dev)
    return q, k, v, g, beta


@pytest.mark.parametrize("dname", DTYPES)
@pytest.mark.parametrize("ci", range(len(DELTA_CONFIGS)))
def test_delta_kernel_matches_reference(rng, dname, ci) -> None:
    import torch

    from engram_trt.models.qwen4_exp.reference_linear_attention import gated_delta_net_reference
    from engram_trt.native import linear_attention as la

    dev, dtype, u = torch.device("cuda"), getattr(torch, dname), UNIT_ROUNDOFF[dname]
    Hk, Hv, dk, dv = DELTA_CONFIGS[ci]
    state = torch.from_numpy(rng.standard_normal((NUM_SLOTS, Hv, dk, dv)).astype(np.float32) * 0.5).to(dev)
    ref_state = state.double().cpu().numpy()
    ok_all, worst, worst_state = True, 0.0, 0.0
    for i, (starts, past, slots) in enumerate(STEPS):
        l2norm, scale = (1, dk**-0.5) if i != 2 else (0, 0.3 / dk)  # one step without the norm
        q, k, v, g, beta = _delta_inputs(torch, rng, starts[-1], Hk, Hv, dk, dv, dtype, dev)
        if not l2norm:  # keys of norm about 1, so the unnormalized update stays a contraction
            q, k = (t * dk**-0.5 for t in (q, k))
        o = la.gated_delta_net(
            q,
            k,
            v,
            g,
            beta,
            state,
            _i32(torch, starts, dev),
            _i32(torch, past, dev),
            _i32(torch, slots, dev),
            l2norm_qk=bool(l2norm),
            scale=scale,
        )
        want, ref_state = gated_delta_net_reference(
            *(t.double().cpu().numpy() for t in (q, k, v, g, beta)), ref_state, starts, past, slots, l2norm, scale
        )
        ok, err = _rel_or_bound(o.double().cpu().numpy(), want, u, 2e-5, SUBNORMAL_HALF_SPACING[dname])
        s_ok, s_err = _rel_or_bound(state.double().cpu().numpy(), ref_state, 0.0, 2e-5)
        ok_all &= ok and s_ok
        worst, worst_state = max(worst, err), max(worst_state, s_err)
        ref_state = state.double().cpu().numpy()  # each step judged from the kernel's state
    assert ok_all, (
        f"gated delta rule {dname} Hk={Hk} Hv={Hv} dk={dk} dv={dv} = float64 reference over {len(STEPS)} steps: "
        f"max excess over the bound: output {worst:.3g}, state {worst_state:.3g}"
    )


def _layer(torch, Hk, Hv, dk, dv, seed):
    from engram_trt.models.qwen4_exp.linear_attention import GatedDeltaNet

    cfg = SimpleNamespace(
        hidden_size=32,
        linear_num_key_heads=Hk,
        linear_num_value_heads=Hv,
        linear_key_head_dim=dk,
        linear_value_head_dim=dv,
        linear_conv_kernel_dim=4,
        hidden_act="silu",
        output_gate_type="silu",
        rms_norm_eps=1e-6,
    )
    layer = GatedDeltaNet(cfg, 0).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.4)
            if name == "A_log":
                p.copy_(torch.linspace(-2.0, 1.0, p.numel()))
            if name == "norm.weight":
                p.add_(1.0)
    return cfg, layer


@pytest.mark.parametrize("dname", ["float32", "bfloat16"])
@pytest.mark.parametrize("ci", [0, 1])
def test_layer_on_kernels_matches_torch_layer(rng, dname, ci) -> None:
    """The layer's kernel path against the float32 CPU torch layer. float32: within
    ``1e-4 max|ref|``. bf16: the weights, inputs and states are rounded to bf16 before
    either path runs, which alone moves the output by up to ~25% of max|ref| on some
    random layers (measured: the torch layer in bf16 on the GPU, 0.01-0.26 over eight
    seeds); so the kernels must be as close as PyTorch's own bf16 path on the same rounded
    inputs, run here beside them: within ``1.5 x`` its distance ``+ 0.01``."""
    import torch

    from engram_trt.models.qwen4_exp.linear_attention import GatedDeltaNet

    dev, dtype = torch.device("cuda"), getattr(torch, dname)
    Hk, Hv, dk, dv = DELTA_CONFIGS[ci]
    cfg, ref = _layer(torch, Hk, Hv, dk, dv, seed=int(rng.integers(1 << 30)))
    layers = {}
    for backend in ("kernels", "torch"):  # kernels: an EngramError if they cannot serve
        layers[backend] = copy.deepcopy(ref).to(dev, dtype)
        layers[backend].backend = backend
    shapes = GatedDeltaNet.state_shapes(cfg)
    conv0 = torch.from_numpy(rng.standard_normal((NUM_SLOTS, *shapes["conv"])).astype(np.float32))  # stale garbage
    rec0 = torch.from_numpy(rng.standard_normal((NUM_SLOTS, *shapes["recurrent"])).astype(np.float32))
    states = {b: (conv0.to(dev, dtype), rec0.clone().to(dev)) for b in layers}
    conv_r, rec_r = states["kernels"][0].float().cpu(), rec0.clone()  # the same (rounded) garbage on both sides
    slot_list = [0, 2, 3]
    decode_steps = [None, None]  # then the decode-only step the CUDA graphs record (metadata on the device)
    worst = {(b, phase): {"out": 0.0, "conv": 0.0, "rec": 0.0} for b in layers for phase in ("packed", "decode")}
    finite = True
    for step in STEPS + decode_steps:
        rows = step[0][-1] if step else len(slot_list)
        x = torch.from_numpy(rng.standard_normal((rows, cfg.hidden_size)).astype(np.float32))
        with torch.no_grad():
            want = (
                ref(x, *step, conv_r, rec_r) if step else ref.forward_decode(x, torch.tensor(slot_list), conv_r, rec_r)
            )
            for b, layer in layers.items():
                conv, rec = states[b]
                xd = x.to(dev, dtype)
                got = (
                    layer(xd, *step, conv, rec)
                    if step
                    else layer.forward_decode(xd, torch.tensor(slot_list, device=dev), conv, rec)
                )
                for key, a, r in (("out", got, want), ("conv", conv, conv_r), ("rec", rec, rec_r)):
                    a, r = a.double().cpu(), r.double()
                    err = float((a - r).abs().max()) / max(float(r.abs().max()), 1e-30)
                    w = worst[(b, "packed" if step else "decode")]
                    w[key] = max(w[key], err)
                    finite &= bool(torch.isfinite(a).all())
    for phase, what in (("packed", f"{len(STEPS)} packed steps"), ("decode", "2 decode-only steps")):
        k, t = worst[("kernels", phase)], worst[("torch", phase)]
        if dname == "float32":
            bound = {key: 1e-4 for key in k}
        else:
            bound = {key: 1.5 * t[key] + 0.01 for key in k}
        ok = finite and all(k[key] <= bound[key] for key in k)
        assert ok, (
            f"GatedDeltaNet on the kernels {dname} (Hk={Hk} Hv={Hv} dk={dk} dv={dv}) = torch layer (CPU fp32), "
            f"{what}: "
            f"max rel errors {k}; the torch layer in {dname} on the GPU: {t}; bounds {bound}"
        )


@pytest.mark.parametrize("dname", ["float32", "bfloat16"])
def test_chunks_and_decode_equal_one_step(rng, dname) -> None:
    import torch

    from engram_trt.native import linear_attention as la

    dev, dtype = torch.device("cuda"), getattr(torch, dname)
    Hk, Hv, dk, dv = DELTA_CONFIGS[3]
    C, K = 2 * Hk * dk + Hv * dv, 4
    lengths = [31, 5, 1, 18]
    T = sum(lengths)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    x = torch.from_numpy(rng.standard_normal((T, C)).astype(np.float32)).to(dev, dtype)
    weight = torch.from_numpy(rng.standard_normal((C, K)).astype(np.float32) * 0.5).to(dev)
    q, k, v, g, beta = _delta_inputs(torch, rng, T, Hk, Hv, dk, dv, dtype, dev)
    S = len(lengths)

    def call(rows, seq_starts, past, slots, conv, rec):
        meta = [_i32(torch, vals, dev) for vals in (seq_starts, past, slots)]
        y = la.causal_conv1d(x[rows], weight, conv, *meta)
        o = la.gated_delta_net(q[rows], k[rows], v[rows], g[rows], beta[rows], rec, *meta)
        return y, o

    conv_w, rec_w = torch.zeros(S, C, K - 1, dtype=dtype, device=dev), torch.zeros(S, Hv, dk, dv, device=dev)
    y_whole, o_whole = call(torch.arange(T, device=dev), starts, [0] * S, range(S), conv_w, rec_w)
    conv, rec = torch.full_like(conv_w, 3.0), torch.full_like(rec_w, 3.0)  # a fresh sequence ignores them
    pieces: dict[int, list] = {s: [] for s in range(S)}
    done = [0] * S
    while any(done[s] < lengths[s] for s in range(S)):
        step = [
            (s, min(int(rng.choice([1, 2, 3, 11])), lengths[s] - done[s])) for s in range(S) if done[s] < lengths[s]
        ]
        idx = torch.cat([torch.arange(int(starts[s]) + done[s], int(starts[s]) + done[s] + m) for s, m in step]).to(dev)
        st = np.concatenate([[0], np.cumsum([m for _, m in step])])
        y, o = call(idx, st, [done[s] for s, _ in step], [s for s, _ in step], conv, rec)
        for j, (s, m) in enumerate(step):
            pieces[s].append((y[int(st[j]) : int(st[j + 1])], o[int(st[j]) : int(st[j + 1])]))
            done[s] += m
    y_chunked = torch.cat([torch.cat([p[0] for p in pieces[s]]) for s in range(S)])
    o_chunked = torch.cat([torch.cat([p[1] for p in pieces[s]]) for s in range(S)])
    assert torch.equal(y_chunked, y_whole) and torch.equal(conv, conv_w), (
        f"causal conv {dname}: chunks + decode steps = one whole step, bit for bit"
    )
    assert torch.equal(o_chunked, o_whole) and torch.equal(rec, rec_w), (
        f"gated delta rule {dname}: chunks + decode steps = one whole step, bit for bit: "
        f"max diff {float((o_chunked.float() - o_whole.float()).abs().max()):.3g}"
    )


def test_edge_contracts(rng) -> None:
    """Padding tokens, a padding slot (reads zeros as a fresh sequence, keeps nothing), T = 0."""
    import torch

    from engram_trt.native import linear_attention as la

    dev = torch.device("cuda")
    Hk, Hv, dk, dv = DELTA_CONFIGS[0]
    C, K, T = 48, 4, 12
    x = torch.from_numpy(rng.standard_normal((T, C)).astype(np.float32)).to(dev, torch.bfloat16)
    weight = torch.from_numpy(rng.standard_normal((C, 1, K)).astype(np.float32)).to(dev, torch.bfloat16)
    q, k, v, g, beta = _delta_inputs(torch, rng, T, Hk, Hv, dk, dv, torch.bfloat16, dev)
    conv0 = torch.from_numpy(rng.standard_normal((3, C, K - 1)).astype(np.float32)).to(dev, torch.bfloat16)
    rec0 = torch.from_numpy(rng.standard_normal((3, Hv, dk, dv)).astype(np.float32)).to(dev)

    def run(starts, past, slots, conv, rec, n=T):
        meta = [_i32(torch, vals, dev) for vals in (starts, past, slots)]
        return (
            la.causal_conv1d(x[:n], weight, conv, *meta),
            la.gated_delta_net(q[:n], k[:n], v[:n], g[:n], beta[:n], rec, *meta),
        )

    c1, r1 = conv0.clone(), rec0.clone()
    y, o = run([0, 4, 9], [5, 0], [2, 0], c1, r1)  # tokens 9..11 are padding
    assert bool((y[9:] == 0).all()) and bool((o[9:] == 0).all()) and bool((o[:9] != 0).any()), (
        "linear attention: tokens past seq_starts[S] get zero outputs"
    )
    c2, r2 = conv0.clone(), rec0.clone()
    y_pad, o_pad = run([0, 4, 9], [5, 0], [-1, 0], c2, r2)
    c3, r3 = conv0.clone(), rec0.clone()
    y_fresh, o_fresh = run([0, 4, 9], [0, 0], [2, 0], c3, r3)
    assert (
        torch.equal(y_pad[:4], y_fresh[:4])
        and torch.equal(o_pad[:4], o_fresh[:4])
        and torch.equal(c2[1:], conv0[1:])
        and torch.equal(r2[1:], rec0[1:])
        and torch.equal(c2[0], c1[0])
        and torch.equal(r2[0], r1[0])
    ), "linear attention: a slot outside the state reads zeros and keeps nothing"
    c4, r4 = conv0.clone(), rec0.clone()
    y0, o0 = run([0, 0], [0], [1], c4, r4, n=0)
    torch.cuda.synchronize()
    assert y0.shape == (0, C) and o0.shape == (0, Hv, dv) and torch.equal(c4, conv0) and torch.equal(r4, rec0), (
        "linear attention: T = 0 is a no-op"
    )


# --- the plugins ------------------------------------------------------------------------------


def conv_fields(kernel_size: int, activation: int, **override):
    fields = {
        "kernel": (PF_INT32, np.array([kernel_size], np.int32)),
        "activation": (PF_INT32, np.array([activation], np.int32)),
    }
    fields.update(override)
    return [(name, ftype, data) for name, (ftype, data) in fields.items()]


def delta_fields(l2norm: int, scale_value: float, **override):
    fields = {
        "l2norm_qk": (PF_INT32, np.array([l2norm], np.int32)),
        "scale": (PF_FLOAT32, np.array([scale_value], np.float32)),
    }
    fields.update(override)
    return [(name, ftype, data) for name, (ftype, data) in fields.items()]


def _refusals(harness: Harness, name: str, cases) -> dict:
    refused = {}
    for what, fields, needle in cases:
        try:
            harness.lib.harness_destroy(harness.create(name, fields))
            refused[what] = "accepted"
        except RuntimeError as exc:
            refused[what] = (needle in str(exc) and "\n" not in str(exc)) or str(exc)[:160]
    return refused


def _type_refusals(harness: Harness, h: int, cases) -> dict:
    refused = {}
    for what, in_types, needle in cases:
        try:
            harness.outputs_types(h, in_types, 2)
            refused[what] = "accepted"
        except RuntimeError as exc:
            refused[what] = needle in str(exc) or str(exc)[:160]
    return refused


PLUGIN_CPU_CHECKS = [
    "plugin EngramCausalConv1d getOutputShapes",
    "plugin EngramCausalConv1d getOutputDataTypes: both outputs x's type",
    "plugin EngramCausalConv1d getOutputDataTypes refuses mixed types",
    "plugin EngramCausalConv1d getAliasedInput: the state output aliases conv_state (build capability v2)",
    "plugin EngramCausalConv1d serialize round trip",
    "plugin EngramCausalConv1d refuses bad fields",
    "plugin EngramGatedDeltaNet getOutputShapes",
    "plugin EngramGatedDeltaNet getOutputDataTypes: o q's type, the state float32",
    "plugin EngramGatedDeltaNet getOutputDataTypes refuses mixed types",
    "plugin EngramGatedDeltaNet getAliasedInput: the state output aliases state (build capability v2)",
    "plugin EngramGatedDeltaNet serialize round trip",
    "plugin EngramGatedDeltaNet refuses bad fields",
]


def check_plugin_cpu(harness: Harness) -> Checks:
    """What TensorRT asks of the two plugins before any enqueue (no GPU needed)."""
    checks = Checks()
    i32 = DT["int32"]
    # EngramCausalConv1d
    C, K, S, T = 96, 4, 6, 50
    h = harness.create("EngramCausalConv1d", conv_fields(K, 1))
    in_shapes = [(T, C), (C, 1, K), (S, C, K - 1), (4,), (3,), (3,)]
    shapes = harness.outputs_shapes(h, in_shapes, 2)
    checks.add("plugin EngramCausalConv1d getOutputShapes", shapes == [(T, C), (S, C, K - 1)], str(shapes))
    types = {
        f"{io}/{wt}": harness.outputs_types(h, [DT[io], DT[wt], DT[io], i32, i32, i32], 2) == [DT[io]] * 2
        for io in ("bfloat16", "float16", "float32")
        for wt in dict.fromkeys((io, "float32"))
    }
    checks.add("plugin EngramCausalConv1d getOutputDataTypes: both outputs x's type", all(types.values()), str(types))
    refused = _type_refusals(
        harness,
        h,
        (
            (
                "conv_state of another type",
                [DT["bfloat16"], DT["bfloat16"], DT["float32"], i32, i32, i32],
                "x and conv_state must share one type",
            ),
            (
                "fp16 weight with bf16 x",
                [DT["bfloat16"], DT["float16"], DT["bfloat16"], i32, i32, i32],
                "weight must be float32 or x's type",
            ),
            ("int64 slots", [DT["float32"]] * 3 + [i32, i32, DT["int64"]], "slots must be int32"),
        ),
    )
    checks.add(
        "plugin EngramCausalConv1d getOutputDataTypes refuses mixed types",
        all(v is True for v in refused.values()),
        str(refused),
    )
    aliases = [harness.aliased_input(h, o) for o in range(2)]
    checks.add(
        "plugin EngramCausalConv1d getAliasedInput: the state output aliases conv_state (build capability v2)",
        aliases == [(-1, 2), (2, 2)],
        str(aliases),
    )
    h2 = harness.roundtrip(h)
    checks.add(
        "plugin EngramCausalConv1d serialize round trip",
        harness.outputs_shapes(h2, in_shapes, 2) == shapes
        and harness.aliased_input(h2, 1) == (2, 2)
        and harness.serialized_fields(h2) == harness.serialized_fields(h),
    )
    harness.lib.harness_destroy(h2)
    harness.lib.harness_destroy(h)
    refused = _refusals(
        harness,
        "EngramCausalConv1d",
        (
            ("kernel 0", conv_fields(0, 1), "field 'kernel' = 0 is outside [1, 32]"),
            ("kernel 33", conv_fields(33, 1), "field 'kernel' = 33 is outside [1, 32]"),
            ("activation 2", conv_fields(4, 2), "field 'activation' = 2 is outside [0, 1]"),
            (
                "kernel 2^32 + 4 (int64)",
                conv_fields(4, 1, kernel=(PF_INT64, np.array([2**32 + 4], np.int64))),
                "'kernel' = 4294967300 is outside",
            ),
            ("a missing field", conv_fields(4, 1)[:1], "missing field 'activation'"),
            (
                "an unknown field",
                conv_fields(4, 1) + [("bias", PF_INT32, np.array([1], np.int32))],
                "unknown field(s) bias",
            ),
        ),
    )
    checks.add("plugin EngramCausalConv1d refuses bad fields", all(v is True for v in refused.values()), str(refused))

    # EngramGatedDeltaNet
    Hk, Hv, dk, dv = 2, 4, 64, 96
    h = harness.create("EngramGatedDeltaNet", delta_fields(1, dk**-0.5))
    in_shapes = [(T, Hk, dk), (T, Hk, dk), (T, Hv, dv), (T, Hv), (T, Hv), (S, Hv, dk, dv), (4,), (3,), (3,)]
    shapes = harness.outputs_shapes(h, in_shapes, 2)
    checks.add("plugin EngramGatedDeltaNet getOutputShapes", shapes == [(T, Hv, dv), (S, Hv, dk, dv)], str(shapes))
    f32 = DT["float32"]
    types = {
        io: harness.outputs_types(h, [DT[io]] * 3 + [f32] * 3 + [i32] * 3, 2) == [DT[io], f32]
        for io in ("bfloat16", "float16", "float32")
    }
    checks.add(
        "plugin EngramGatedDeltaNet getOutputDataTypes: o q's type, the state float32", all(types.values()), str(types)
    )
    refused = _type_refusals(
        harness,
        h,
        (
            (
                "v of another type",
                [DT["bfloat16"]] * 2 + [DT["float16"]] + [f32] * 3 + [i32] * 3,
                "q, k and v must share one type",
            ),
            ("a bf16 state", [DT["bfloat16"]] * 3 + [f32] * 2 + [DT["bfloat16"]] + [i32] * 3, "state must be float32"),
            ("bf16 g", [DT["bfloat16"]] * 4 + [f32] * 2 + [i32] * 3, "g must be float32"),
            ("int64 past_lens", [f32] * 6 + [i32, DT["int64"], i32], "past_lens must be int32"),
        ),
    )
    checks.add(
        "plugin EngramGatedDeltaNet getOutputDataTypes refuses mixed types",
        all(v is True for v in refused.values()),
        str(refused),
    )
    aliases = [harness.aliased_input(h, o) for o in range(2)]
    checks.add(
        "plugin EngramGatedDeltaNet getAliasedInput: the state output aliases state (build capability v2)",
        aliases == [(-1, 2), (5, 2)],
        str(aliases),
    )
    h2 = harness.roundtrip(h)
    checks.add(
        "plugin EngramGatedDeltaNet serialize round trip",
        harness.outputs_shapes(h2, in_shapes, 2) == shapes
        and harness.aliased_input(h2, 1) == (5, 2)
        and harness.serialized_fields(h2) == harness.serialized_fields(h),
    )
    harness.lib.harness_destroy(h2)
    harness.lib.harness_destroy(h)
    refused = _refusals(
        harness,
        "EngramGatedDeltaNet",
        (
            ("l2norm_qk 2", delta_fields(2, 0.1), "field 'l2norm_qk' = 2 is outside [0, 1]"),
            ("scale inf", delta_fields(1, float("inf")), "scale must be finite"),
            ("scale NaN", delta_fields(1, float("nan")), "scale must be finite"),
            (
                "scale as int32",
                delta_fields(1, 0.1, scale=(PF_INT32, np.array([1], np.int32))),
                "field 'scale' must be a float",
            ),
            ("a missing field", delta_fields(1, 0.1)[:1], "missing field 'scale'"),
            (
                "an unknown field",
                delta_fields(1, 0.1) + [("eps", PF_FLOAT32, np.array([1e-6], np.float32))],
                "unknown field(s) eps",
            ),
        ),
    )
    checks.add("plugin EngramGatedDeltaNet refuses bad fields", all(v is True for v in refused.values()), str(refused))
    return checks


@pytest.fixture(scope="module")
def plugin_cpu(harness) -> Checks:
    return check_plugin_cpu(harness)


@pytest.mark.parametrize("name", PLUGIN_CPU_CHECKS)
def test_plugin_cpu(plugin_cpu, name: str) -> None:
    ok, detail = plugin_cpu[name]
    assert ok, f"{name}: {detail}"


def _enqueue_both_ways(
    torch,
    harness,
    name,
    fields,
    inputs,
    in_types,
    state_index,
    out_shape,
    out_dtype,
    want_out,
    want_state,
    tag,
    phase_name: str,
) -> None:
    """A build-phase or round-trip plugin (``phase_name``): state aliased (in place) and separate (copied over
    first)."""
    dev = inputs[0].device
    stream = torch.cuda.current_stream().cuda_stream
    io_out, state_type = in_types[0], in_types[state_index]
    make = {"build": lambda h: h, "runtime (round trip)": harness.roundtrip}[phase_name]
    base = harness.create(name, fields)
    h = make(base)
    args = list(inputs)
    state = inputs[state_index].clone()
    args[state_index] = state
    out = torch.full(out_shape, float("nan"), dtype=out_dtype, device=dev)
    ws = harness.run_outputs(h, args, in_types, [out, state], [io_out, state_type], stream)
    torch.cuda.synchronize()
    assert torch.equal(out, want_out) and torch.equal(state, want_state) and ws == 0, (
        f"plugin {name} enqueue {tag} {phase_name}, state aliased (in place): "
        f"out-equal={torch.equal(out, want_out)} state-equal={torch.equal(state, want_state)} workspace={ws}"
    )
    state_in = inputs[state_index].clone()
    state_out = torch.full_like(state_in, float("nan"))
    args[state_index] = state_in
    out2 = torch.full(out_shape, float("nan"), dtype=out_dtype, device=dev)
    harness.run_outputs(h, args, in_types, [out2, state_out], [io_out, state_type], stream)
    torch.cuda.synchronize()
    assert (
        torch.equal(out2, want_out)
        and torch.equal(state_out, want_state)
        and torch.equal(state_in, inputs[state_index])
    ), f"plugin {name} enqueue {tag} {phase_name}, separate state output (copy fallback)"
    if h != base:
        harness.lib.harness_destroy(h)
    harness.lib.harness_destroy(base)


@pytest.mark.parametrize("phase_name", ["build", "runtime (round trip)"])
@pytest.mark.parametrize("dname,wname", [("bfloat16", "bfloat16"), ("bfloat16", "float32"), ("float32", "float32")])
def test_conv_plugin_gpu(rng, harness, dname, wname, phase_name) -> None:
    import torch

    from engram_trt.native import linear_attention as la

    dev, dtype, wdtype = torch.device("cuda"), getattr(torch, dname), getattr(torch, wname)
    C, K = 200, 4
    lengths, past, slots = [7, 1, 12], [0, 9, 3], [4, 0, 2]
    T = sum(lengths)
    x = torch.from_numpy(rng.standard_normal((T, C)).astype(np.float32)).to(dev, dtype)
    weight = torch.from_numpy(rng.standard_normal((C, 1, K)).astype(np.float32)).to(dev, dtype).to(wdtype)
    state0 = torch.from_numpy(rng.standard_normal((NUM_SLOTS, C, K - 1)).astype(np.float32)).to(dev, dtype)
    meta = [_i32(torch, vals, dev) for vals in (np.concatenate([[0], np.cumsum(lengths)]).tolist(), past, slots)]
    want_state = state0.clone()
    want = la.causal_conv1d(x, weight, want_state, *meta, activation=1)
    in_types = [DT[dname], DT[wname], DT[dname]] + [DT["int32"]] * 3
    _enqueue_both_ways(
        torch,
        harness,
        "EngramCausalConv1d",
        conv_fields(K, 1),
        [x, weight, state0, *meta],
        in_types,
        2,
        (T, C),
        dtype,
        want,
        want_state,
        f"{dname}/{wname}",
        phase_name,
    )


@pytest.mark.parametrize("phase_name", ["build", "runtime (round trip)"])
@pytest.mark.parametrize("dname", ["bfloat16", "float32"])
def test_delta_plugin_gpu(rng, harness, dname, phase_name) -> None:
    import torch

    from engram_trt.native import linear_attention as la

    dev, dtype = torch.device("cuda"), getattr(torch, dname)
    Hk, Hv, dk, dv = DELTA_CONFIGS[3]
    lengths, past, slots = [7, 1, 12], [0, 9, 3], [4, 0, 2]
    T = sum(lengths)
    q, k, v, g, beta = _delta_inputs(torch, rng, T, Hk, Hv, dk, dv, dtype, dev)
    state0 = torch.from_numpy(rng.standard_normal((NUM_SLOTS, Hv, dk, dv)).astype(np.float32)).to(dev)
    meta = [_i32(torch, vals, dev) for vals in (np.concatenate([[0], np.cumsum(lengths)]).tolist(), past, slots)]
    want_state = state0.clone()
    want = la.gated_delta_net(q, k, v, g, beta, want_state, *meta, l2norm_qk=True, scale=dk**-0.5)
    f32 = DT["float32"]
    in_types = [DT[dname]] * 3 + [f32] * 3 + [DT["int32"]] * 3
    _enqueue_both_ways(
        torch,
        harness,
        "EngramGatedDeltaNet",
        delta_fields(1, dk**-0.5),
        [q, k, v, g, beta, state0, *meta],
        in_types,
        5,
        (T, Hv, dv),
        dtype,
        want,
        want_state,
        dname,
        phase_name,
    )
