"""Qwen4Exp's Gated DeltaNet layer over the packed step, against transformers'
``Qwen4ExpTextGatedDeltaNet`` carrying the same (fully randomized) weights, and against
a float64 NumPy recurrence written here; plus the packed step's own contract: chunked
prefill equals one call, a packed step equals its sequences run alone, a reused slot
starting over ignores what it held.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engram_trt.errors import EngramError
from engram_trt.models.qwen4_exp.linear_attention import GatedDeltaNet, chunked_delta_rule, recurrent_delta_step

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache  # noqa: E402
from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig  # noqa: E402

from helpers.qwen4_exp import gdn_config  # noqa: E402
from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextGatedDeltaNet  # noqa: E402

HIDDEN = 32
NUM_SLOTS = 5


def make_config(**overrides) -> Qwen4ExpTextConfig:
    return gdn_config(hidden_size=HIDDEN, **overrides)


def randomized_pair(cfg: Qwen4ExpTextConfig, seed: int = 0) -> tuple[GatedDeltaNet, Qwen4ExpTextGatedDeltaNet]:
    """Ours and transformers' layer with the same random values in every parameter
    (transformers' init leaves norm.weight at ones and dt_bias at ones: not a test)."""
    gen = torch.Generator().manual_seed(seed)
    ref = Qwen4ExpTextGatedDeltaNet(cfg, 0).eval()
    state = {}
    for name, p in ref.state_dict().items():
        value = torch.randn(p.shape, generator=gen) * 0.3
        if name == "A_log":  # a spread of decays, some close to 1 and some strong
            value = torch.linspace(-2.0, 1.0, p.numel())
        if name == "norm.weight":
            value = 1.0 + value
        state[name] = value
    ref.load_state_dict(state)
    ours = GatedDeltaNet(cfg, 0).eval()
    ours.load_state_dict(state)
    return ours, ref


def new_states(cfg, fill: float | None = None, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    shapes = GatedDeltaNet.state_shapes(cfg)
    conv = torch.zeros(NUM_SLOTS, *shapes["conv"])
    rec = torch.zeros(NUM_SLOTS, *shapes["recurrent"])
    if fill is not None:  # stale garbage a previous owner left
        gen = torch.Generator().manual_seed(seed)
        conv.copy_(torch.randn(conv.shape, generator=gen) * fill)
        rec.copy_(torch.randn(rec.shape, generator=gen) * fill)
    return conv, rec


def tokens(n: int, seed: int = 2) -> torch.Tensor:
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed))


def run_alone(layer, x, past, slot, conv, rec):
    return layer(x, [0, x.shape[0]], [past], [slot], conv, rec)


def assert_rel(actual: torch.Tensor, expected: torch.Tensor, rtol: float) -> None:
    err = (actual.double() - expected.double()).abs().max().item()
    scale = expected.double().abs().max().item()
    assert err <= rtol * scale, f"max error {err:.3e} against scale {scale:.3e} (rtol {rtol})"


@torch.no_grad()
def test_matches_transformers_prefill_and_cache_steps():
    cfg = make_config()
    ours, ref = randomized_pair(cfg)
    x = tokens(23)

    # whole prompt, no cache
    assert_rel(run_alone(ours, x, 0, 3, *new_states(cfg)), ref(x[None])[0], 1e-5)

    # prefill 9, a chunk of 6 continuing from the state, then 8 decode tokens
    cache = DynamicCache(config=cfg)
    conv, rec = new_states(cfg, fill=1.0)
    past = 0
    for n in [9, 6] + [1] * 8:
        piece = x[past : past + n]
        expected = ref(piece[None], cache=cache)[0]
        got = run_alone(ours, piece, past, 3, conv, rec)
        assert_rel(got, expected, 1e-5)
        past += n
    assert_rel(rec[3], cache.layers[0].recurrent_states[0][0], 1e-5)
    # transformers keeps the last K pre-conv columns, ours the last K-1
    assert_rel(conv[3], cache.layers[0].conv_states[0][0][:, 1:], 1e-6)


@torch.no_grad()
def test_sigmoid_output_gate_matches_transformers():
    cfg = make_config(output_gate_type="sigmoid")
    ours, ref = randomized_pair(cfg, seed=5)
    x = tokens(11, seed=6)
    assert_rel(run_alone(ours, x, 0, 0, *new_states(cfg)), ref(x[None])[0], 1e-5)


@torch.no_grad()
def test_chunked_prefill_equals_one_call():
    cfg = make_config()
    ours, _ = randomized_pair(cfg, seed=3)
    x = tokens(80, seed=4)  # past one 64-token chunk
    conv1, rec1 = new_states(cfg)
    whole = run_alone(ours, x, 0, 1, conv1, rec1)

    conv2, rec2 = new_states(cfg, fill=1.0)
    outs, past = [], 0
    for n in [3, 5, 1, 66, 2, 1, 2]:
        outs.append(run_alone(ours, x[past : past + n], past, 1, conv2, rec2))
        past += n
    assert past == 80
    assert_rel(torch.cat(outs), whole, 1e-5)
    assert_rel(rec2[1], rec1[1], 1e-5)
    assert_rel(conv2[1], conv1[1], 1e-6)


def _advance(layer, x, past, slot, conv, rec) -> None:
    """Feeds a slot its first ``past`` tokens of ``x``."""
    if past:
        run_alone(layer, x[:past], 0, slot, conv, rec)


@torch.no_grad()
@pytest.mark.parametrize(
    "lens_pasts",
    [
        [(6, 0), (1, 4), (3, 5)],  # a prompt, a decode token, a prefill chunk from a state
        [(1, 7), (1, 2), (1, 9)],  # decode only: the vectorized recurrent step
        [(1, 0), (1, 3), (4, 2)],  # a one-token prompt beside decode and a chunk
    ],
)
def test_packed_step_equals_each_alone(lens_pasts):
    cfg = make_config()
    ours, _ = randomized_pair(cfg, seed=7)
    slots = [3, 0, 2]  # out of order; slots 1 and 4 are bystanders
    xs = [tokens(12, seed=10 + i) for i in range(3)]
    conv, rec = new_states(cfg, fill=0.5)
    for (n, past), x, slot in zip(lens_pasts, xs, slots):
        _advance(ours, x, past, slot, conv, rec)
    conv_alone, rec_alone = conv.clone(), rec.clone()
    bystanders = (conv[[1, 4]].clone(), rec[[1, 4]].clone())

    pieces = [x[past : past + n] for (n, past), x in zip(lens_pasts, xs)]
    starts = np.cumsum([0] + [n for n, _ in lens_pasts]).tolist()
    packed = ours(torch.cat(pieces), starts, [p for _, p in lens_pasts], slots, conv, rec)

    for i, ((n, past), slot) in enumerate(zip(lens_pasts, slots)):
        alone = run_alone(ours, pieces[i], past, slot, conv_alone, rec_alone)
        # the projections' GEMMs round by batch size (~5e-7 at their output), hence 1e-5
        assert_rel(packed[starts[i] : starts[i + 1]], alone, 1e-5)
        assert_rel(rec[slot], rec_alone[slot], 1e-5)
        assert_rel(conv[slot], conv_alone[slot], 1e-6)
    assert torch.equal(conv[[1, 4]], bystanders[0]) and torch.equal(rec[[1, 4]], bystanders[1])


def naive_delta_rule(q, k, v, g, beta, state):
    """The recurrence token by token in float64: q, k [H, L, dk] (normalized, scaled),
    v [H, L, dv], g, beta [H, L], state [H, dk, dv]."""
    S = state.copy()
    out = np.zeros(v.shape)
    for t in range(q.shape[1]):
        for h in range(q.shape[0]):
            S[h] *= np.exp(g[h, t])
            u = beta[h, t] * (v[h, t] - S[h].T @ k[h, t])
            S[h] += np.outer(k[h, t], u)
            out[h, t] = S[h].T @ q[h, t]
    return out, S


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)


@pytest.mark.parametrize("chunk_size", [64, 16])
def test_chunked_form_against_float64_recurrence(chunk_size):
    rng = np.random.default_rng(11)
    H, L, dk, dv = 3, 70, 8, 6
    q = _unit(rng.standard_normal((H, L, dk))) * dk**-0.5
    k = _unit(rng.standard_normal((H, L, dk)))
    v = rng.standard_normal((H, L, dv))
    g = -np.exp(rng.uniform(-3, 1, (H, L)))
    beta = 1 / (1 + np.exp(-rng.standard_normal((H, L))))
    state = rng.standard_normal((H, dk, dv)) * 0.5
    want_o, want_s = naive_delta_rule(q, k, v, g, beta, state)

    args = [torch.from_numpy(a) for a in (q, k, v, g, beta, state)]
    got_o, got_s = chunked_delta_rule(*args, chunk_size=chunk_size)  # float64 in, float64 math
    np.testing.assert_allclose(got_o.numpy(), want_o, rtol=0, atol=1e-6 * np.abs(want_o).max())
    np.testing.assert_allclose(got_s.numpy(), want_s, rtol=0, atol=1e-6 * np.abs(want_s).max())
    got_o32, got_s32 = chunked_delta_rule(*[a.float() for a in args], chunk_size=chunk_size)
    assert got_o32.dtype == torch.float32
    assert_rel(got_o32, torch.from_numpy(want_o), 2e-5)
    assert_rel(got_s32, torch.from_numpy(want_s), 2e-5)


def test_recurrent_step_against_float64_recurrence():
    rng = np.random.default_rng(12)
    B, H, dk, dv = 3, 2, 8, 6
    q = _unit(rng.standard_normal((B, H, 1, dk))) * dk**-0.5
    k = _unit(rng.standard_normal((B, H, 1, dk)))
    v = rng.standard_normal((B, H, 1, dv))
    g = -np.exp(rng.uniform(-3, 1, (B, H, 1)))
    beta = 1 / (1 + np.exp(-rng.standard_normal((B, H, 1))))
    state = rng.standard_normal((B, H, dk, dv))
    got_o, got_s = recurrent_delta_step(
        *[torch.from_numpy(a[:, :, 0]) for a in (q, k, v, g, beta)], torch.from_numpy(state).float()
    )
    for b in range(B):
        want_o, want_s = naive_delta_rule(q[b], k[b], v[b], g[b], beta[b], state[b])
        assert_rel(got_o[b], torch.from_numpy(want_o[:, 0]), 1e-6)
        assert_rel(got_s[b], torch.from_numpy(want_s), 1e-6)


@torch.no_grad()
def test_bf16_matches_transformers_in_bf16():
    cfg = make_config()
    ours, ref = randomized_pair(cfg, seed=21)
    ours, ref = ours.to(torch.bfloat16), ref.to(torch.bfloat16)
    x = tokens(10, seed=22).to(torch.bfloat16)
    shapes = GatedDeltaNet.state_shapes(cfg)
    conv = torch.zeros(NUM_SLOTS, *shapes["conv"], dtype=torch.bfloat16)
    rec = torch.zeros(NUM_SLOTS, *shapes["recurrent"])
    cache = DynamicCache(config=cfg)
    past = 0
    for n in [7, 1, 1, 1]:
        piece = x[past : past + n]
        assert_rel(run_alone(ours, piece, past, 0, conv, rec), ref(piece[None], cache=cache)[0], 2e-2)
        past += n


def naive_layer(layer: GatedDeltaNet, x: np.ndarray) -> np.ndarray:
    """The whole layer for one prompt in float64 NumPy, from the published formulas."""
    p = {n: t.detach().double().numpy() for n, t in layer.state_dict().items()}
    T, K = x.shape[0], layer.kernel_size
    Hk, Hv, dk, dv = layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    cols = x @ p["in_proj_qkv.weight"].T
    padded = np.concatenate([np.zeros((K - 1, cols.shape[1])), cols])
    w = p["conv1d.weight"][:, 0, :]  # [C, K]
    conv = np.stack([(padded[t : t + K] * w.T).sum(0) for t in range(T)])
    conv = conv / (1 + np.exp(-conv))  # silu
    kd = Hk * dk
    q = _unit(conv[:, :kd].reshape(T, Hk, dk)) * dk**-0.5
    k = _unit(conv[:, kd : 2 * kd].reshape(T, Hk, dk))
    v = conv[:, 2 * kd :].reshape(T, Hv, dv)
    rep = Hv // Hk
    q, k = np.repeat(q, rep, axis=1), np.repeat(k, rep, axis=1)  # value head h reads key head h // rep
    beta = 1 / (1 + np.exp(-(x @ p["in_proj_b.weight"].T)))
    a = x @ p["in_proj_a.weight"].T + p["dt_bias"]
    g = -np.exp(p["A_log"]) * np.log1p(np.exp(a))
    o, _ = naive_delta_rule(
        q.transpose(1, 0, 2), k.transpose(1, 0, 2), v.transpose(1, 0, 2), g.T, beta.T, np.zeros((Hv, dk, dv))
    )
    o = o.transpose(1, 0, 2)  # [T, Hv, dv]
    z = (x @ p["in_proj_z.weight"].T).reshape(T, Hv, dv)
    normed = o / np.sqrt((o * o).mean(-1, keepdims=True) + 1e-6) * p["norm.weight"]
    gated = normed * z / (1 + np.exp(-z))
    return gated.reshape(T, Hv * dv) @ p["out_proj.weight"].T


@torch.no_grad()
def test_layer_against_float64_reference():
    cfg = make_config()
    ours, _ = randomized_pair(cfg, seed=13)
    x = tokens(70, seed=14)
    got = run_alone(ours, x, 0, 2, *new_states(cfg))
    assert_rel(got, torch.from_numpy(naive_layer(ours, x.double().numpy())), 1e-5)


@torch.no_grad()
@pytest.mark.parametrize("n", [5, 1])
def test_reused_slot_ignores_stale_state(n):
    cfg = make_config()
    ours, _ = randomized_pair(cfg, seed=17)
    x = tokens(n, seed=18)
    clean_conv, clean_rec = new_states(cfg)
    want = run_alone(ours, x, 0, 4, clean_conv, clean_rec)
    conv, rec = new_states(cfg, fill=3.0)
    got = run_alone(ours, x, 0, 4, conv, rec)
    assert torch.equal(got, want)
    assert torch.equal(conv[4], clean_conv[4]) and torch.equal(rec[4], clean_rec[4])


@torch.no_grad()
def test_bad_steps_are_refused_in_one_line():
    cfg = make_config()
    ours, _ = randomized_pair(cfg)
    conv, rec = new_states(cfg)
    x = tokens(4)
    bad = [
        dict(seq_starts=[0, 3], past_lens=[0], slots=[0]),  # does not cover the tokens
        dict(seq_starts=[0, 2, 2, 4], past_lens=[0, 0, 0], slots=[0, 1, 2]),  # an empty sequence
        dict(seq_starts=[0, 2, 4], past_lens=[0, 0], slots=[1, 1]),  # a shared slot
        dict(seq_starts=[0, 4], past_lens=[0], slots=[NUM_SLOTS]),  # no such slot
        dict(seq_starts=[0, 4], past_lens=[-1], slots=[0]),
    ]
    for kw in bad:
        with pytest.raises(EngramError):
            ours(x, kw["seq_starts"], kw["past_lens"], kw["slots"], conv, rec)
    with pytest.raises(EngramError, match="recurrent_state"):
        ours(x, [0, 4], [0], [0], conv, rec.double())
    with pytest.raises(EngramError, match="conv_state"):
        ours(x, [0, 4], [0], [0], conv[:, :, :2], rec)


@torch.no_grad()
def test_backend_choice_falls_back_or_names_why() -> None:
    """``auto`` on the CPU takes the PyTorch forms (the same output as ``torch``);
    ``kernels`` where they cannot run, a sigmoid convolution or an unknown backend is one
    EngramError naming the reason (tests/gpu/test_linear_attention.py runs the kernels)."""
    cfg = make_config()
    ours, _ = randomized_pair(cfg)
    x = tokens(5)
    outs = {}
    for backend in ("auto", "torch"):
        ours.backend = backend
        conv, rec = new_states(cfg)
        outs[backend] = (ours(x, [0, 3, 5], [0, 0], [0, 1], conv, rec), conv, rec)
    assert all(torch.equal(a, b) for a, b in zip(outs["auto"], outs["torch"]))
    conv, rec = new_states(cfg)
    ours.backend = "kernels"
    with pytest.raises(EngramError, match="backend 'kernels' cannot run: the activations are on cpu"):
        ours(x, [0, 5], [0], [0], conv, rec)
    with pytest.raises(EngramError, match="backend 'kernels' cannot run: the activations are on cpu"):
        ours.forward_decode(x[:1], torch.tensor([0]), conv, rec)
    ours.backend = "fast"
    with pytest.raises(EngramError, match="GatedDeltaNet.backend 'fast' is not one of"):
        ours(x, [0, 5], [0], [0], conv, rec)
    sig, _ = randomized_pair(make_config(hidden_act="sigmoid"))
    assert sig.conv_kernel_activation is None  # the conv kernel applies identity or silu only
