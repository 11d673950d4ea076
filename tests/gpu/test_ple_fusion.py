"""Qwen4-Exp's PLE fusion kernel (plugins/kernels/pleFusionKernel.cu) and its plugin
(EngramPleFusion) on a GPU against the PyTorch path, PLEFusion.forward_torch (itself tied
to transformers' Qwen4ExpTextPLELayer by tests/models/qwen4_exp/test_qwen4_exp_parity.py).

The reference runs on the CPU in float32 on the very key / value rows the GPU module's
projections produced (a reference module whose projections are exact identities, so its
input is the kernel's input), with the same norm and conv weights; every parameter is
random (the checkpoint's zero offsets and conv would let a wrong formula pass). Steps
pack several sequences: chunked prefill (chunks shorter and longer than the history),
decode steps continuing the conv history, sequences left out of a step, a slot reused by
a new sequence without a reset. Bounds: float32 ``|out - ref| <= 1e-5 max|ref|``;
bf16 / fp16 (unit roundoff u = 2^-8 / 2^-11) elementwise ``u (|ref| + 1.5 sum_j |w_j|
max|normed|) + 1e-5 max|ref|``: the kernel rounds the normalized values (as the
reference module does in those dtypes, so the history holds them exactly) and the
output, once each. Beside: chunks + decode bit-identical to one whole step, the edge
contracts (padding tokens, a padding slot, add_streams in place, float32 weights with
16-bit activations), and the plugin's enqueue (build and runtime phase; history aliased
in place and in a separate buffer) bit-identical to the binding.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from .helpers import DT, PF_FLOAT32, PF_INT32, PF_INT64, Checks, Harness, say  # noqa: F401 (Harness: the CPU suite)

DTYPES = ["float32", "bfloat16", "float16"]
UNIT_ROUNDOFF = {"float32": 0.0, "bfloat16": 2.0**-8, "float16": 2.0**-11}
CONFIGS = [  # (hc, hidden, embed_dim, kernel, dilation = ngram_size)
    (2, 64, 16, 4, 3),
    (4, 128, 24, 3, 2),
    (3, 256, 12, 2, 4),
]
EPS = 1e-6


def make_config(hc: int, D: int, E: int, K: int, n: int):
    return SimpleNamespace(
        hc_count=hc, hidden_size=D, rms_norm_eps=EPS, ple=SimpleNamespace(ngram_size=n, conv_kernel_size=K, embed_dim=E)
    )


def random_module(torch, config, seed: int):
    """A PLEFusion with every parameter random (norm offsets and conv included)."""
    from engram_trt.models.qwen4_exp.modules import PLEFusion

    m = PLEFusion(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        m.key_proj.weight.copy_(torch.randn(m.key_proj.weight.shape, generator=g) * config.ple.embed_dim**-0.5)
        m.value_proj.weight.copy_(torch.randn(m.value_proj.weight.shape, generator=g) * config.ple.embed_dim**-0.5)
        for norm in (m.norm_key, m.norm_query, m.norm_conv):
            norm.weight.copy_(torch.randn(norm.weight.shape, generator=g) * 0.3)
        m.conv1d.weight.copy_(torch.randn(m.conv1d.weight.shape, generator=g) * 0.4)
    return m


def identity_reference(torch, kernel_module, config):
    """A CPU float32 PLEFusion taking rows = [key | value] through exact identity
    projections, with the kernel module's norm and conv weights."""
    from engram_trt.models.qwen4_exp.modules import PLEFusion

    W, D = config.hc_count * config.hidden_size, config.hidden_size
    ref_cfg = make_config(config.hc_count, D, W + D, config.ple.conv_kernel_size, config.ple.ngram_size)
    ref = PLEFusion(ref_cfg)
    ref.backend = "torch"
    with torch.no_grad():
        ref.key_proj.weight.copy_(torch.cat([torch.eye(W), torch.zeros(W, D)], dim=1))
        ref.value_proj.weight.copy_(torch.cat([torch.zeros(D, W), torch.eye(D)], dim=1))
        for name in ("norm_key", "norm_query", "norm_conv"):
            getattr(ref, name).weight.copy_(getattr(kernel_module, name).weight.detach().float().cpu())
        ref.conv1d.weight.copy_(kernel_module.conv1d.weight.detach().float().cpu())
    return ref


def schedule(rng, lengths: list[int], num_slots: int, history: int):
    """Steps of ``[(sequence, slot, past, n)]``: at most num_slots sequences at once, a
    finished sequence's slot handed to the next without a reset; chunks of 1 (decode) up
    to longer than the history; a running sequence sometimes sits a step out."""
    pending = list(range(len(lengths)))
    free = list(range(num_slots))
    running: dict[int, tuple[int, int]] = {}  # sequence -> (slot, done)
    steps = []
    choices = sorted({1, 2, 3, max(1, history - 1), max(1, history), history + 1, 2 * history + 3, 17})
    while pending or running:
        while pending and free:
            running[pending.pop(0)] = (free.pop(int(rng.integers(0, len(free)))), 0)
        step = []
        for s, (slot, done) in list(running.items()):
            if done > 0 and rng.random() < 0.15:
                continue  # sits this step out
            n = min(int(rng.choice(choices)), lengths[s] - done)
            step.append((s, slot, done, n))
            running[s] = (slot, done + n)
        rng.shuffle(step)
        if step:  # every running sequence may sit a step out: a step needs one sequence
            steps.append(step)
        for s, (slot, done) in list(running.items()):
            if done == lengths[s]:
                del running[s]
                free.append(slot)
    return steps


def pack(step, per_seq):
    """(tensor [T, ...] of the step's tokens, seq_starts, past_lens, slots)."""
    import torch

    parts, starts = [], [0]
    for s, _, done, n in step:
        parts.append(per_seq[s][done : done + n])
        starts.append(starts[-1] + n)
    return torch.cat(parts), starts, [e[2] for e in step], [e[1] for e in step]


def bound_16bit(u, ref, conv_abs_w, normed_max):
    return u * (ref.abs() + 1.5 * (conv_abs_w * normed_max)) + 1e-5 * float(ref.abs().max())


@pytest.mark.parametrize("dname", DTYPES)
@pytest.mark.parametrize("ci", range(len(CONFIGS)))
def test_kernel_matches_torch_reference(rng, dname, ci) -> None:
    """PLEFusion.forward (backend 'kernels') over a run of packed steps = forward_torch."""
    import torch

    dev = torch.device("cuda")
    dtype = getattr(torch, dname)
    hc, D, E, K, n = CONFIGS[ci]
    cfg = make_config(hc, D, E, K, n)
    W, H = hc * D, (K - 1) * n
    km = random_module(torch, cfg, seed=int(rng.integers(1 << 30))).to(dev, dtype)
    km.backend = "kernels"
    ref = identity_reference(torch, km, cfg)
    captured = {}
    km.key_proj.register_forward_hook(lambda m, i, o: captured.__setitem__("key", o))
    km.value_proj.register_forward_hook(lambda m, i, o: captured.__setitem__("value", o))

    lengths = [int(x) for x in rng.integers(1, 40, size=7)] + [1, 2 * H + 5]
    num_slots = 4
    streams = [torch.from_numpy(rng.standard_normal((L, W)).astype(np.float32)).to(dtype) for L in lengths]
    rows = [torch.from_numpy(rng.standard_normal((L, E)).astype(np.float32)).to(dtype) for L in lengths]
    state_k = torch.from_numpy(rng.standard_normal((num_slots, W, H)).astype(np.float32)).to(dev, dtype)  # garbage
    state_r = state_k.float().cpu().clone()  # its own copy (float32 on the CPU would alias)
    u = UNIT_ROUNDOFF[dname]
    conv_abs_w = km.conv1d.weight.detach().float().cpu().abs().sum(dim=(1, 2))  # [W]
    wc = ref.norm_conv.weight.detach().float()
    worst, worst_state, steps = 0.0, 0.0, schedule(rng, lengths, num_slots, H)
    ok_all, ok_state = True, True
    for step in steps:
        x, starts, past, slots = pack(step, streams)
        r, _, _, _ = pack(step, rows)
        with torch.no_grad():
            out = km(x.to(dev), r.to(dev), starts, past, slots, state_k)
            rows_ref = torch.cat([captured["key"], captured["value"]], dim=1).float().cpu()
            want = ref(x.float(), rows_ref, starts, past, slots, state_r)
        got = out.float().cpu()
        if dname == "float32":
            err = float((got - want).abs().max()) / max(float(want.abs().max()), 1e-30)
            ok = err <= 1e-5
            s_err = float((state_k.float().cpu() - state_r).abs().max()) / max(float(state_r.abs().max()), 1e-30)
            s_ok = s_err <= 1e-5
        else:
            v = rows_ref[:, W:]
            normed_max = (v.abs() / v.pow(2).mean(-1, keepdim=True).sqrt()).max(dim=0).values  # [D] per token bound
            normed_max = (normed_max.repeat(hc) * (1.0 + wc).abs()).max()  # a bound over the step's |normed|
            normed_max = torch.maximum(normed_max, state_r.abs().max())
            excess = (got - want).abs() - bound_16bit(u, want, conv_abs_w, normed_max)
            err = float(excess.max())
            ok = err <= 0
            s_excess = (state_k.float().cpu() - state_r).abs() - (u * state_r.abs() + 1e-5 * float(state_r.abs().max()))
            s_err = float(s_excess.max())
            s_ok = s_err <= 0
        ok_all &= ok and bool(torch.isfinite(got).all())
        ok_state &= s_ok
        worst, worst_state = max(worst, err), max(worst_state, s_err)
    tag = f"config{ci} {dname} ({len(steps)} steps, {sum(lengths)} tokens)"
    what = "max rel error" if dname == "float32" else "max excess over the bound"
    assert ok_all, f"ple fusion kernel = torch reference, {tag}: {what} {worst:.3g}"
    assert ok_state, f"ple fusion conv history = torch reference, {tag}: {what} {worst_state:.3g}"


@pytest.mark.parametrize("dname", DTYPES)
def test_chunks_and_decode_equal_one_step(rng, dname) -> None:
    """The history holds the normalized values exactly as a step computes them, so a
    chunked prefill and its decode steps give the whole step's bits."""
    import torch

    from engram_trt.native import ple

    dev = torch.device("cuda")
    dtype = getattr(torch, dname)
    hc, D, E, K, n = CONFIGS[0]
    cfg = make_config(hc, D, E, K, n)
    W, H = hc * D, (K - 1) * n
    km = random_module(torch, cfg, seed=7).to(dev, dtype)
    lengths = [31, 5, 1, 18]
    T = sum(lengths)
    x = torch.from_numpy(rng.standard_normal((T, W)).astype(np.float32)).to(dev, dtype)
    key = torch.from_numpy(rng.standard_normal((T, W)).astype(np.float32)).to(dev, dtype)
    value = torch.from_numpy(rng.standard_normal((T, D)).astype(np.float32)).to(dev, dtype)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    weights = (km.norm_key.weight, km.norm_query.weight, km.norm_conv.weight, km.conv1d.weight)

    def i32(values):
        return torch.tensor(list(values), dtype=torch.int32, device=dev)

    def call(rows, seq_starts, past, slots, state):
        return ple.ple_fusion(
            x[rows],
            key[rows],
            value[rows],
            *weights,
            state,
            i32(seq_starts),
            i32(past),
            i32(slots),
            hc_count=hc,
            dilation=n,
            eps=EPS,
        )

    state_whole = torch.zeros(len(lengths), W, H, dtype=dtype, device=dev)
    whole = call(torch.arange(T, device=dev), starts, [0] * len(lengths), range(len(lengths)), state_whole)
    state = torch.full((len(lengths), W, H), 3.0, dtype=dtype, device=dev)  # a fresh sequence ignores it
    pieces = {s: [] for s in range(len(lengths))}
    done = [0] * len(lengths)
    while any(done[s] < lengths[s] for s in range(len(lengths))):
        step = [
            (s, min(int(rng.choice([1, 2, H, H + 2, 11])), lengths[s] - done[s]))
            for s in range(len(lengths))
            if done[s] < lengths[s]
        ]
        idx = torch.cat([torch.arange(int(starts[s]) + done[s], int(starts[s]) + done[s] + m) for s, m in step]).to(dev)
        st = np.concatenate([[0], np.cumsum([m for _, m in step])])
        out = call(idx, st, [done[s] for s, _ in step], [s for s, _ in step], state)
        for j, (s, m) in enumerate(step):
            pieces[s].append(out[int(st[j]) : int(st[j + 1])])
            done[s] += m
    chunked = torch.cat([torch.cat(pieces[s]) for s in range(len(lengths))])
    same = torch.equal(chunked, whole)
    assert same and torch.equal(state, state_whole), (
        f"ple fusion {dname}: chunks + decode steps = one whole step, bit for bit: "
        f"max diff {float((chunked.float() - whole.float()).abs().max()):.3g}"
    )


def test_edge_contracts(rng) -> None:
    """Padding tokens, a padding slot, add_streams in place, float32 weights, T = 0."""
    import torch

    from engram_trt.native import ple

    dev = torch.device("cuda")
    hc, D, E, K, n = CONFIGS[1]
    cfg = make_config(hc, D, E, K, n)
    W, H = hc * D, (K - 1) * n
    km = random_module(torch, cfg, seed=11).to(dev, torch.bfloat16)
    w16 = (km.norm_key.weight, km.norm_query.weight, km.norm_conv.weight, km.conv1d.weight)
    w32 = tuple(w.float() for w in w16)
    T = 12
    x = torch.from_numpy(rng.standard_normal((T, W)).astype(np.float32)).to(dev, torch.bfloat16)
    key = torch.from_numpy(rng.standard_normal((T, W)).astype(np.float32)).to(dev, torch.bfloat16)
    value = torch.from_numpy(rng.standard_normal((T, D)).astype(np.float32)).to(dev, torch.bfloat16)
    state0 = torch.from_numpy(rng.standard_normal((3, W, H)).astype(np.float32)).to(dev, torch.bfloat16)

    def i32(values):
        return torch.tensor(list(values), dtype=torch.int32, device=dev)

    meta = (i32([0, 4, 9]), i32([5, 0]), i32([2, 0]))  # tokens 9..11 are padding
    s1 = state0.clone()
    base = ple.ple_fusion(x, key, value, *w16, s1, *meta, hc_count=hc, dilation=n, eps=EPS)
    assert bool((base[9:] == 0).all()), "ple fusion: tokens past seq_starts[S] get a zero update"
    s2 = state0.clone()
    f32 = ple.ple_fusion(x, key, value, *w32, s2, *meta, hc_count=hc, dilation=n, eps=EPS)
    assert torch.equal(f32, base) and torch.equal(s1, s2), (
        "ple fusion: float32 weights holding bf16 values = bf16 weights, bit for bit"
    )
    inplace = x.clone()
    s3 = state0.clone()
    ple.ple_fusion(
        inplace, key, value, *w16, s3, *meta, hc_count=hc, dilation=n, eps=EPS, add_streams=True, out=inplace
    )
    want = x.float() + base.float()  # base: the update rounded once; inplace: streams + update rounded once
    err = float(((inplace.float() - want).abs() / (want.abs() + base.float().abs() + 1e-6)).max())
    assert err <= 2.0**-7 and torch.equal(inplace[9:], x[9:]) and torch.equal(s3, s1), (
        f"ple fusion: add_streams in place = streams + update (one rounding): max |diff| / (|ref| + |update|) {err:.3g}"
    )
    # a padding slot (-1): reads zeros as a fresh sequence would, keeps nothing
    s4 = state0.clone()
    pad = ple.ple_fusion(
        x, key, value, *w16, s4, i32([0, 4, 9]), i32([5, 0]), i32([-1, 0]), hc_count=hc, dilation=n, eps=EPS
    )
    s5 = state0.clone()
    fresh = ple.ple_fusion(
        x, key, value, *w16, s5, i32([0, 4, 9]), i32([0, 0]), i32([2, 0]), hc_count=hc, dilation=n, eps=EPS
    )
    assert torch.equal(pad[:4], fresh[:4]) and torch.equal(s4[0], s1[0]) and torch.equal(s4[1:], state0[1:]), (
        "ple fusion: a slot outside the state reads zeros and writes nothing"
    )
    s6 = state0.clone()
    empty = ple.ple_fusion(
        x[:0], key[:0], value[:0], *w16, s6, i32([0]), i32([]), i32([]), hc_count=hc, dilation=n, eps=EPS
    )
    torch.cuda.synchronize()
    assert empty.shape == (0, W) and torch.equal(s6, state0), "ple fusion: T = 0 is a no-op"


def plugin_fields(hc, D, K, n, eps, **override):
    fields = {
        "hc_count": (PF_INT32, np.array([hc], np.int32)),
        "hidden": (PF_INT32, np.array([D], np.int32)),
        "kernel": (PF_INT32, np.array([K], np.int32)),
        "dilation": (PF_INT32, np.array([n], np.int32)),
        "eps": (PF_FLOAT32, np.array([eps], np.float32)),
    }
    fields.update(override)
    return [(name, ftype, data) for name, (ftype, data) in fields.items()]


PLUGIN_CPU_CHECKS = [
    "plugin EngramPleFusion getOutputShapes",
    "plugin EngramPleFusion getOutputDataTypes: both outputs streams' type",
    "plugin EngramPleFusion getOutputDataTypes refuses mixed types",
    "plugin EngramPleFusion getAliasedInput: the history output aliases conv_state (build capability v2)",
    "plugin EngramPleFusion serialize round trip",
    "plugin EngramPleFusion refuses bad fields",
]


def check_plugin_cpu(harness: Harness) -> Checks:
    """What TensorRT asks of EngramPleFusion before any enqueue (no GPU needed)."""
    checks = Checks()
    hc, D, K, n, S, T = 4, 128, 4, 3, 6, 50
    W, H = hc * D, (K - 1) * n
    h = harness.create("EngramPleFusion", plugin_fields(hc, D, K, n, 1e-6))
    in_shapes = [(T, W), (T, W), (T, D), (W,), (W,), (W,), (W, 1, K), (S, W, H), (4,), (3,), (3,)]
    shapes = harness.outputs_shapes(h, in_shapes, 2)
    checks.add("plugin EngramPleFusion getOutputShapes", shapes == [(T, W), (S, W, H)], str(shapes))
    types = {}
    for io in ("bfloat16", "float16", "float32"):
        for wt in dict.fromkeys((io, "float32")):
            types[f"{io}/{wt}"] = (
                harness.outputs_types(h, [DT[io]] * 3 + [DT[wt]] * 4 + [DT[io]] + [DT["int32"]] * 3, 2) == [DT[io]] * 2
            )
    checks.add("plugin EngramPleFusion getOutputDataTypes: both outputs streams' type", all(types.values()), str(types))
    refused = {}
    for what, in_types, needle in (
        (
            "conv_state of another type",
            [DT["bfloat16"]] * 3 + [DT["bfloat16"]] * 4 + [DT["float32"]] + [DT["int32"]] * 3,
            "must share one type",
        ),
        (
            "fp16 weights with bf16 streams",
            [DT["bfloat16"]] * 3 + [DT["float16"]] * 4 + [DT["bfloat16"]] + [DT["int32"]] * 3,
            "must all be float32 or all streams' type",
        ),
        ("int64 slots", [DT["float32"]] * 8 + [DT["int32"]] * 2 + [DT["int64"]], "slots must be int32"),
    ):
        try:
            harness.outputs_types(h, in_types, 2)
            refused[what] = "accepted"
        except RuntimeError as exc:
            refused[what] = needle in str(exc) or str(exc)[:160]
    checks.add(
        "plugin EngramPleFusion getOutputDataTypes refuses mixed types",
        all(v is True for v in refused.values()),
        str(refused),
    )
    aliases = [harness.aliased_input(h, o) for o in range(2)]
    checks.add(
        "plugin EngramPleFusion getAliasedInput: the history output aliases conv_state (build capability v2)",
        aliases == [(-1, 2), (7, 2)],
        str(aliases),
    )
    h2 = harness.roundtrip(h)
    checks.add(
        "plugin EngramPleFusion serialize round trip",
        harness.outputs_shapes(h2, in_shapes, 2) == shapes
        and harness.aliased_input(h2, 1) == (7, 2)
        and harness.serialized_fields(h2) == harness.serialized_fields(h),
    )
    harness.lib.harness_destroy(h2)
    harness.lib.harness_destroy(h)
    refused = {}
    for what, fields, needle in (
        ("hidden 60", plugin_fields(2, 60, 4, 3, 1e-6), "hidden a positive multiple of 8"),
        ("kernel 0", plugin_fields(2, 64, 0, 3, 1e-6), "'kernel' = 0 is outside [1, 32]"),
        ("kernel 33", plugin_fields(2, 64, 33, 3, 1e-6), "'kernel' = 33 is outside [1, 32]"),
        ("dilation 0", plugin_fields(2, 64, 4, 0, 1e-6), "'dilation' = 0 is outside [1, 256]"),
        ("eps -1", plugin_fields(2, 64, 4, 3, -1.0), "eps must be finite and >= 0"),
        ("eps NaN", plugin_fields(2, 64, 4, 3, float("nan")), "eps must be finite and >= 0"),
        (
            "hc_count 2^32 + 2 (int64)",
            plugin_fields(2, 64, 4, 3, 1e-6, hc_count=(PF_INT64, np.array([2**32 + 2], np.int64))),
            "'hc_count' = 4294967298 is outside",
        ),
        ("hc_count * hidden >= 2^31", plugin_fields(65536, 32768, 4, 3, 1e-6), "exceeds 2^31 - 1"),
        (
            "an unknown field",
            plugin_fields(2, 64, 4, 3, 1e-6) + [("bias", PF_INT32, np.array([1], np.int32))],
            "unknown field(s) bias",
        ),
    ):
        try:
            harness.lib.harness_destroy(harness.create("EngramPleFusion", fields))
            refused[what] = "accepted"
        except RuntimeError as exc:
            refused[what] = needle in str(exc) or str(exc)[:160]
    checks.add("plugin EngramPleFusion refuses bad fields", all(v is True for v in refused.values()), str(refused))
    return checks


@pytest.fixture(scope="module")
def plugin_cpu(harness) -> Checks:
    return check_plugin_cpu(harness)


@pytest.mark.parametrize("name", PLUGIN_CPU_CHECKS)
def test_plugin_cpu(plugin_cpu, name: str) -> None:
    ok, detail = plugin_cpu[name]
    assert ok, f"{name}: {detail}"


@pytest.mark.parametrize("phase_name", ["build", "runtime (round trip)"])
@pytest.mark.parametrize("dname,wname", [("bfloat16", "bfloat16"), ("bfloat16", "float32"), ("float32", "float32")])
def test_plugin_gpu(rng, harness, dname, wname, phase_name) -> None:
    """The plugin's enqueue (build phase, and runtime after a round trip) = the binding,
    bit for bit: the history aliased (in place) and in a separate output (copied over
    first, the input left untouched)."""
    import torch

    from engram_trt.native import ple

    dev = torch.device("cuda")
    stream = torch.cuda.current_stream().cuda_stream
    dtype, wdtype = getattr(torch, dname), getattr(torch, wname)
    hc, D, E, K, n = CONFIGS[0]
    W, H, slots_n = hc * D, (K - 1) * n, 5
    km = random_module(torch, make_config(hc, D, E, K, n), seed=5)
    weights = [
        w.detach().to(dev, dtype).to(wdtype).contiguous()
        for w in (km.norm_key.weight, km.norm_query.weight, km.norm_conv.weight, km.conv1d.weight.reshape(W, K))
    ]
    lengths, past, slots = [7, 1, 12], [0, 9, 3], [4, 0, 2]
    T = sum(lengths)
    x = torch.from_numpy(rng.standard_normal((T, W)).astype(np.float32)).to(dev, dtype)
    key = torch.from_numpy(rng.standard_normal((T, W)).astype(np.float32)).to(dev, dtype)
    value = torch.from_numpy(rng.standard_normal((T, D)).astype(np.float32)).to(dev, dtype)
    state0 = torch.from_numpy(rng.standard_normal((slots_n, W, H)).astype(np.float32)).to(dev, dtype)
    meta = [
        torch.tensor(v, dtype=torch.int32, device=dev)
        for v in (np.concatenate([[0], np.cumsum(lengths)]).tolist(), past, slots)
    ]
    want_state = state0.clone()
    want = ple.ple_fusion(x, key, value, *weights, want_state, *meta, hc_count=hc, dilation=n, eps=EPS)
    io, wt = DT[dname], DT[wname]
    in_types = [io] * 3 + [wt] * 4 + [io] + [DT["int32"]] * 3
    want_ws = ple.workspace_size(T, hc, D, dtype)
    make = {"build": lambda h: h, "runtime (round trip)": harness.roundtrip}[phase_name]
    base = harness.create("EngramPleFusion", plugin_fields(hc, D, K, n, EPS))
    h = make(base)
    state = state0.clone()
    out = torch.full((T, W), float("nan"), dtype=dtype, device=dev)
    ws = harness.run_outputs(h, [x, key, value, *weights, state, *meta], in_types, [out, state], [io, io], stream)
    torch.cuda.synchronize()
    assert torch.equal(out, want) and torch.equal(state, want_state) and ws == want_ws, (
        f"plugin EngramPleFusion enqueue {dname}/{wname} {phase_name}, history aliased (in place): "
        f"out-equal={torch.equal(out, want)} history-equal={torch.equal(state, want_state)} workspace={ws} "
        f"(want {want_ws})"
    )
    state_in = state0.clone()
    state_out = torch.full_like(state_in, float("nan"))
    out2 = torch.full((T, W), float("nan"), dtype=dtype, device=dev)
    harness.run_outputs(h, [x, key, value, *weights, state_in, *meta], in_types, [out2, state_out], [io, io], stream)
    torch.cuda.synchronize()
    assert torch.equal(out2, want) and torch.equal(state_out, want_state) and torch.equal(state_in, state0), (
        f"plugin EngramPleFusion enqueue {dname}/{wname} {phase_name}, separate history output (copy fallback)"
    )
    if h != base:
        harness.lib.harness_destroy(h)
    harness.lib.harness_destroy(base)
