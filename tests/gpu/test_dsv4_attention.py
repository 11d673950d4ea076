"""EngramDsv4Attention on the GPU (plugins/kernels/dsv4AttentionKernel.cu through
native/dsv4_attention.py, and the plugin's enqueue through the harness):

- the kernel vs the float64 reference (models/deepseek_v4/reference_attention.py) and vs our
  torch DeepseekV4Attention layer (the node's inputs made by the layer's own modules, its
  output turned back into the layer's by the graph's tail), over three packed steps with
  state: two prefills, a chunked prefill continuing + a decode + a fresh sequence on a
  stale slot, a decode of all; each layer type (CSA with the indexer dropping entries,
  HCA, sliding); float32 tight, bf16 loose; every state tensor compared after each step;
- the plugin's enqueue (build phase and after a round trip; states aliased in place and
  as separate outputs) equal to the binding bit for bit;
- check_plugin_cpu: what TensorRT asks before any enqueue (shapes, types, aliasing, round
  trip, refused fields), shared with tests/plugins/test_dsv4_attention_plugin.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from .helpers import DT, PF_FLOAT32, PF_INT32, Checks

CSA_T, HCA_T, SWA_T = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
LAYERS = [CSA_T, HCA_T, SWA_T]
TYPE_ID = {CSA_T: 1, HCA_T: 2, SWA_T: 0}
STATE_ORDER = [
    "window_kv",
    "compressed_kv",
    "compressor_kv",
    "compressor_gate",
    "index_keys",
    "indexer_kv",
    "indexer_gate",
]
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 8, "beta_slow": 1}


def make_config(topk: int = 2, head_dim: int = 64, yarn: bool = False) -> SimpleNamespace:
    return SimpleNamespace(
        hidden_size=48,
        num_attention_heads=4,
        head_dim=head_dim,
        q_lora_rank=24,
        sliding_window=6,
        o_groups=2,
        o_lora_rank=16,
        index_n_heads=8,
        index_head_dim=32,
        index_topk=topk,
        rms_norm_eps=1e-6,
        layer_types=LAYERS,
        compress_rates={CSA_T: 4, HCA_T: 8},
        partial_rotary_factor=0.25,
        rope_theta=10000.0,
        compress_rope_theta=160000.0,
        max_position_embeddings=256,
        rope_parameters={
            "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
            "compress": dict(YARN, rope_theta=160000.0, partial_rotary_factor=0.25, attention_factor=1.3),
        }
        if yarn
        else None,
    )


def make_layer(torch, config, idx: int, seed: int):
    from engram_trt.models.deepseek_v4.attention import DeepseekV4Attention

    gen = torch.Generator().manual_seed(seed)
    layer = DeepseekV4Attention(config, idx).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return layer, gen


def new_state(torch, config, idx, n_slots, max_len, dtype):
    from engram_trt.models.deepseek_v4.attention import DeepseekV4Attention

    shapes = DeepseekV4Attention.state_shapes(config, idx, max_len)
    gen = torch.Generator().manual_seed(99)
    return {k: (torch.randn((n_slots, *s), generator=gen) * 4).to(dtype) for k, (s, _) in shapes.items()}


def node_inputs(torch, layer, x, positions, starts, pasts, slots, state) -> list:
    from engram_trt.models.deepseek_v4.compressors import apply_rope, unweighted_rms_norm

    t, h, d = x.shape[0], layer.num_heads, layer.head_dim
    cos, sin = layer.rope(positions)
    q_res = layer.q_a_norm(layer.q_a_proj(x))
    q = apply_rope(
        unweighted_rms_norm(layer.q_b_proj(q_res).reshape(t, h, d), layer.eps), cos.unsqueeze(1), sin.unsqueeze(1)
    )
    kv = apply_rope(layer.kv_norm(layer.kv_proj(x)), cos, sin)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    inputs = [q, kv, layer.sinks.float(), i32(starts), i32(pasts), i32(slots), state["window_kv"]]
    comp = layer.compressor
    if comp is not None:
        inputs += [
            comp.kv_proj(x),
            comp.gate_proj(x),
            comp.position_bias.float(),
            comp.kv_norm.weight.float(),
            layer.rope.inv_freq.float(),
            state["compressed_kv"],
            state["compressor_kv"],
            state["compressor_gate"],
        ]
    if layer.layer_type == CSA_T:
        ix = comp.indexer
        iq, iw = ix.queries(q_res, x, cos, sin)
        inputs += [
            iq,
            iw.float(),
            ix.kv_proj(x),
            ix.gate_proj(x),
            ix.position_bias.float(),
            ix.kv_norm.weight.float(),
            state["index_keys"],
            state["indexer_kv"],
            state["indexer_gate"],
        ]
    return [v.detach().contiguous() for v in inputs]


def graph_tail(layer, out, positions):
    from engram_trt.models.deepseek_v4.compressors import apply_rope

    cos, sin = layer.rope(positions)
    out = apply_rope(out, cos.unsqueeze(1), -sin.unsqueeze(1))
    return layer.o_b_proj(layer.o_a_proj(out.reshape(out.shape[0], layer.config.o_groups, -1)).flatten(1))


def fields_of(layer) -> dict:
    comp = layer.compressor
    return dict(
        layer_type=TYPE_ID[layer.layer_type],
        window=layer.window,
        compress_rate=comp.rate if comp is not None else 0,
        index_topk=layer.config.index_topk if layer.layer_type == CSA_T else 0,
        scaling=layer.scaling,
        eps=layer.eps,
        rope_scale=float(layer.rope.scale),
    )


def rel(got, want) -> float:
    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(g - w).max() / max(np.abs(w).max(), 1e-30))


def _np(t):
    return t.detach().float().cpu().numpy()


def _steps(torch, gen, hidden):
    x = {slot: torch.randn(n, hidden, generator=gen) for slot, n in ((2, 30), (0, 7), (1, 12))}
    return [
        [(x[2][:13], 0, 2), (x[0][:5], 0, 0)],
        [(x[2][13:29], 13, 2), (x[0][5:6], 5, 0), (x[1][:11], 0, 1)],
        [(x[0][6:7], 6, 0), (x[1][11:12], 11, 1), (x[2][29:30], 29, 2)],
    ]


def run_steps(torch, layer, config, idx, dtype, bound_ref, bound_layer, tag):
    """The three steps through the torch layer (CPU), the reference and the kernel (CUDA)."""
    from engram_trt.models.deepseek_v4.reference_attention import dsv4_attention_reference_flat
    from engram_trt.native.dsv4_attention import STATE_INPUTS, dsv4_attention

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(3)
    torch_state = new_state(torch, config, idx, 4, 40, dtype)
    gpu_state = {k: v.clone().to(dev) for k, v in torch_state.items()}
    ref_state = {k: v.clone() for k, v in torch_state.items()}
    for n, chunks in enumerate(_steps(torch, gen, config.hidden_size)):
        xs = torch.cat([c[0] for c in chunks]).to(dtype)
        starts, positions = [0], []
        for x, past, _ in chunks:
            starts.append(starts[-1] + x.shape[0])
            positions.append(torch.arange(past, past + x.shape[0]))
        positions = torch.cat(positions)
        pasts, slots = [c[1] for c in chunks], [c[2] for c in chunks]
        with torch.no_grad():
            want = layer(xs, positions, starts, pasts, slots, torch_state)
            cpu_inputs = node_inputs(torch, layer, xs, positions, starts, pasts, slots, ref_state)
            ref = dsv4_attention_reference_flat(*cpu_inputs, **fields_of(layer))
            gpu_inputs = [t.to(dev) for t in cpu_inputs]
            names = [nm for nm in STATE_ORDER if nm in gpu_state]
            for nm, i in zip(names, STATE_INPUTS):
                gpu_inputs[i] = gpu_state[nm]
            out = dsv4_attention(*gpu_inputs, **fields_of(layer))
            torch.cuda.synchronize()
            got_layer = graph_tail(layer, out.cpu(), positions)
        e_ref = rel(_np(out), ref[0])
        e_layer = rel(_np(got_layer), _np(want))
        state_errs = {nm: rel(_np(gpu_state[nm]), ref[1 + k]) for k, nm in enumerate(names)}
        assert e_ref <= bound_ref and e_layer <= bound_layer and max(state_errs.values()) <= bound_ref, (
            f"dsv4 kernel {tag} step {n}: out vs float64 reference, layer output vs torch layer, states: "
            f"ref {e_ref:.2e} layer {e_layer:.2e} states {state_errs} (bounds {bound_ref:g} / {bound_layer:g})"
        )
        for k, nm in enumerate(names):
            ref_state[nm] = torch.from_numpy(np.asarray(ref[1 + k], np.float32)).to(dtype)


@pytest.mark.parametrize("yarn", [False, True], ids=["default_rope", "yarn"])
@pytest.mark.parametrize("idx", [0, 1, 2], ids=LAYERS)
def test_kernel_float32_matches_reference_and_torch_layer(idx, yarn) -> None:
    import torch

    config = make_config(yarn=yarn)
    layer, _ = make_layer(torch, config, idx, 300 + idx)
    run_steps(torch, layer, config, idx, torch.float32, 2e-5, 2e-5, f"{LAYERS[idx]} fp32 yarn={yarn}")


@pytest.mark.parametrize("idx", [0, 1, 2], ids=LAYERS)
def test_kernel_bfloat16_near_reference_and_torch_layer(idx) -> None:
    """bf16 activations and state, float32 parameters (FP32_PARAMETERS); no drops (a near
    tie flipped by a rounding order is legitimate)."""
    import torch

    from engram_trt.models.deepseek_v4.attention import FP32_PARAMETERS, DeepseekV4Attention

    config = make_config(topk=16)
    layer, _ = make_layer(torch, config, idx, 400 + idx)
    low = DeepseekV4Attention(config, idx).eval().to(torch.bfloat16)
    low.load_state_dict(layer.state_dict())
    for name, p in low.named_parameters():
        if name in FP32_PARAMETERS:
            p.data = layer.state_dict()[name].clone()
    run_steps(torch, low, config, idx, torch.bfloat16, 2e-2, 3e-2, f"{LAYERS[idx]} bf16")


# --- the plugin --------------------------------------------------------------------------------


def dsv4_fields(layer_type=1, window=6, rate=4, topk=2, scaling=0.125, eps=1e-6, rope_scale=1.0, **replace):
    fields = {
        "layer_type": (PF_INT32, np.array([layer_type], np.int32)),
        "window": (PF_INT32, np.array([window], np.int32)),
        "compress_rate": (PF_INT32, np.array([rate], np.int32)),
        "index_topk": (PF_INT32, np.array([topk], np.int32)),
        "scaling": (PF_FLOAT32, np.array([scaling], np.float32)),
        "eps": (PF_FLOAT32, np.array([eps], np.float32)),
        "rope_scale": (PF_FLOAT32, np.array([rope_scale], np.float32)),
    }
    fields.update(replace)
    return [(k, v[0], v[1]) for k, v in fields.items() if v is not None]


def shapes_of(layer_type: int, T=10, S=3, N=4, H=4, d=64, W=6, r=4, E=10, P=8, NI=8, di=32) -> list[tuple]:
    shapes = [(T, H, d), (T, d), (H,), (S + 1,), (S,), (S,), (N, W, d)]
    if layer_type != 0:
        w, R = (2 * d, 2 * r) if layer_type == 1 else (d, r)
        shapes += [(T, w), (T, w), (r, w), (d,), (P,), (N, E, d), (N, R, w), (N, R, w)]
    if layer_type == 1:
        shapes += [
            (T, NI, di),
            (T, NI),
            (T, 2 * di),
            (T, 2 * di),
            (r, 2 * di),
            (di,),
            (N, E, di),
            (N, 2 * r, 2 * di),
            (N, 2 * r, 2 * di),
        ]
    return shapes


F32_INPUTS = {2, 9, 10, 11, 16, 19, 20}
I32_INPUTS = {3, 4, 5}


def types_of(n_inputs: int, io: int) -> list[int]:
    return [DT["float32"] if i in F32_INPUTS else DT["int32"] if i in I32_INPUTS else io for i in range(n_inputs)]


PLUGIN_CPU_CHECKS = [
    f"plugin EngramDsv4Attention layer_type {lt} {what}"
    for lt in (0, 2, 1)
    for what in (
        "getOutputShapes: out q's, states their inputs'",
        "getOutputDataTypes",
        "getAliasedInput: each state output its input",
        "serialize round trip",
    )
] + ["plugin EngramDsv4Attention refuses a bf16 c_bias", "plugin EngramDsv4Attention refuses bad fields in one line"]


def check_plugin_cpu(harness) -> Checks:
    """What TensorRT asks of EngramDsv4Attention before any enqueue (no GPU needed): the
    checks of PLUGIN_CPU_CHECKS by name."""
    checks = Checks()
    n_in, n_out = {0: 7, 2: 15, 1: 24}, {0: 2, 2: 5, 1: 8}
    states = [6, 12, 13, 14, 21, 22, 23]
    for lt in (0, 2, 1):
        h = harness.create("EngramDsv4Attention", dsv4_fields(layer_type=lt, rate=8 if lt == 2 else 4))
        r = 8 if lt == 2 else 4
        in_shapes = shapes_of(lt, r=r)
        shapes = harness.outputs_shapes(h, in_shapes, n_out[lt])
        want = [in_shapes[0]] + [in_shapes[i] for i in states[: n_out[lt] - 1]]
        checks.add(
            f"plugin EngramDsv4Attention layer_type {lt} getOutputShapes: out q's, states their inputs'",
            shapes == want,
            str(shapes),
        )
        types = {
            io: harness.outputs_types(h, types_of(n_in[lt], DT[io]), n_out[lt]) == [DT[io]] * n_out[lt]
            for io in ("bfloat16", "float16", "float32")
        }
        checks.add(f"plugin EngramDsv4Attention layer_type {lt} getOutputDataTypes", all(types.values()), str(types))
        aliases = [harness.aliased_input(h, o) for o in range(n_out[lt])]
        checks.add(
            f"plugin EngramDsv4Attention layer_type {lt} getAliasedInput: each state output its input",
            aliases == [(-1, 2)] + [(i, 2) for i in states[: n_out[lt] - 1]],
            str(aliases),
        )
        h2 = harness.roundtrip(h)
        checks.add(
            f"plugin EngramDsv4Attention layer_type {lt} serialize round trip",
            harness.outputs_shapes(h2, in_shapes, n_out[lt]) == shapes
            and harness.serialized_fields(h2) == harness.serialized_fields(h),
        )
        harness.lib.harness_destroy(h2)
        harness.lib.harness_destroy(h)
    h = harness.create("EngramDsv4Attention", dsv4_fields(layer_type=1))
    bad_types = types_of(24, DT["bfloat16"])
    bad_types[9] = DT["bfloat16"]
    refused = False
    try:
        harness.outputs_types(h, bad_types, 8)
    except RuntimeError as exc:
        refused = "c_bias must be float32" in str(exc)
    checks.add("plugin EngramDsv4Attention refuses a bf16 c_bias", refused)
    harness.lib.harness_destroy(h)
    refusals = {}
    for tag, fields, needle in (
        ("layer_type 3", dsv4_fields(layer_type=3), "field 'layer_type' = 3 is outside [0, 2]"),
        ("window 0", dsv4_fields(window=0), "field 'window' = 0 is outside [1, 65535]"),
        ("CSA with compress_rate 0", dsv4_fields(rate=0), "compress_rate 0 must be >= 1"),
        ("CSA with index_topk 0", dsv4_fields(topk=0), "index_topk 0 must be >= 1"),
        ("scaling 0", dsv4_fields(scaling=0.0), "scaling 0 must be a positive finite number"),
        ("missing scaling", [f for f in dsv4_fields() if f[0] != "scaling"], "missing field 'scaling'"),
        ("unknown field", dsv4_fields() + [("heads", PF_INT32, np.array([4], np.int32))], "unknown field(s) heads"),
    ):
        try:
            harness.lib.harness_destroy(harness.create("EngramDsv4Attention", fields))
            refusals[tag] = "accepted"
        except RuntimeError as exc:
            refusals[tag] = needle in str(exc) and "\n" not in str(exc) or str(exc)
    checks.add(
        "plugin EngramDsv4Attention refuses bad fields in one line",
        all(v is True for v in refusals.values()),
        str(refusals),
    )
    return checks


@pytest.fixture(scope="module")
def plugin_cpu(harness) -> Checks:
    return check_plugin_cpu(harness)


@pytest.mark.parametrize("name", PLUGIN_CPU_CHECKS)
def test_plugin_cpu(plugin_cpu, name: str) -> None:
    ok, detail = plugin_cpu[name]
    assert ok, f"{name}: {detail}"


@pytest.mark.parametrize("aliased", [True, False], ids=["aliased", "separate"])
@pytest.mark.parametrize("phase", ["build", "runtime (round trip)"])
@pytest.mark.parametrize("dname", ["float32", "bfloat16"])
@pytest.mark.parametrize("idx", [0, 1, 2], ids=LAYERS)
def test_plugin_enqueue_equals_binding(harness, dname, idx, phase, aliased) -> None:
    import torch

    from engram_trt.native.dsv4_attention import STATE_INPUTS, dsv4_attention

    dtype, dev = getattr(torch, dname), torch.device("cuda")
    config = make_config()
    layer, gen = make_layer(torch, config, idx, 500 + idx)
    if dtype != torch.float32:
        layer = layer.to(dtype)
    chunks = [
        (torch.randn(13, config.hidden_size, generator=gen), 9, 2),
        (torch.randn(1, 48, generator=gen), 20, 0),
        (torch.randn(7, 48, generator=gen), 0, 1),
    ]
    xs = torch.cat([c[0] for c in chunks]).to(dtype)
    starts = [0, 13, 14, 21]
    positions = torch.cat([torch.arange(p, p + c[0].shape[0]) for c, p in zip(chunks, (9, 20, 0))])
    state = new_state(torch, config, idx, 4, 40, dtype)
    with torch.no_grad():
        inputs = [t.to(dev) for t in node_inputs(torch, layer, xs, positions, starts, [9, 20, 0], [2, 0, 1], state)]
    fields = fields_of(layer)
    n_states = {0: 1, 2: 4, 1: 7}[fields["layer_type"]]
    want_inputs = [t.clone() for t in inputs]
    want = dsv4_attention(*want_inputs, **fields)
    pf = dsv4_fields(
        layer_type=fields["layer_type"],
        window=fields["window"],
        rate=fields["compress_rate"],
        topk=fields["index_topk"],
        scaling=fields["scaling"],
        eps=fields["eps"],
        rope_scale=fields["rope_scale"],
    )
    in_types = types_of(len(inputs), DT[dname])
    stream = torch.cuda.current_stream().cuda_stream
    make = {"build": lambda h: h, "runtime (round trip)": harness.roundtrip}[phase]
    base = harness.create("EngramDsv4Attention", pf)
    h = make(base)
    args = [t.clone() for t in inputs]
    out = torch.full_like(want, float("nan"))
    state_outs = [args[i] if aliased else torch.full_like(args[i], float("nan")) for i in STATE_INPUTS[:n_states]]
    harness.run_outputs(h, args, in_types, [out] + state_outs, [DT[dname]] * (1 + n_states), stream)
    torch.cuda.synchronize()
    if h != base:
        harness.lib.harness_destroy(h)
    harness.lib.harness_destroy(base)
    ok = torch.equal(out, want) and all(torch.equal(s, want_inputs[i]) for s, i in zip(state_outs, STATE_INPUTS))
    untouched = aliased or all(torch.equal(args[i], inputs[i]) for i in STATE_INPUTS[:n_states])
    assert ok and untouched, (
        f"plugin EngramDsv4Attention {LAYERS[idx]} {dname} enqueue {phase}, "
        f"{'aliased' if aliased else 'separate'} states = binding: "
        f"out-equal={torch.equal(out, want)}, separate inputs untouched={untouched}"
    )
