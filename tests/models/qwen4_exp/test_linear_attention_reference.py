"""models/qwen4_exp/reference_linear_attention.py (the float64 NumPy references of EngramCausalConv1d
and EngramGatedDeltaNet) against the torch layer of models/qwen4_exp/linear_attention.py
with every parameter random: its pieces (``_conv``, ``chunked_delta_rule`` in float64,
``recurrent_delta_step``) tightly, and the whole ``GatedDeltaNet.forward`` rebuilt from
the two references over several packed steps (prompts, a prefill chunk continuing from
a state, decodes, a slot with stale state restarted by past_lens 0) within fp32 round-off.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engram_trt.models.qwen4_exp import reference_linear_attention as ref
from engram_trt.errors import EngramError
from engram_trt.models.qwen4_exp import linear_attention as la

NUM_SLOTS = 5


def make_config(**overrides) -> SimpleNamespace:
    fields = dict(
        hidden_size=24,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=12,
        linear_conv_kernel_dim=4,
        hidden_act="silu",
        output_gate_type="silu",
        rms_norm_eps=1e-6,
    )
    fields.update(overrides)
    return SimpleNamespace(**fields)


def random_layer(cfg: SimpleNamespace, seed: int = 0) -> la.GatedDeltaNet:
    """The layer with every parameter random (dt_bias / A_log / norm weight included)."""
    gen = torch.Generator().manual_seed(seed)
    layer = la.GatedDeltaNet(cfg, 0).eval()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.4)
            if name == "A_log":
                p.copy_(torch.linspace(-2.0, 1.0, p.numel()))
            if name == "norm.weight":
                p.add_(1.0)
    return layer


def assert_rel(actual, expected, rtol: float) -> None:
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert a.shape == e.shape, (a.shape, e.shape)
    err, scale = np.abs(a - e).max(), np.abs(e).max()
    assert scale > 0 and err <= rtol * scale, f"max error {err:.3e} against scale {scale:.3e} (rtol {rtol})"


def test_l2_eps_is_the_layers():
    assert ref.L2_EPS == la.L2_EPS


@pytest.mark.parametrize("kernel", [2, 4])
@torch.no_grad()
def test_conv_matches_layer_conv_per_sequence(kernel):
    cfg = make_config(linear_conv_kernel_dim=kernel)
    layer = random_layer(cfg).double()
    gen = np.random.default_rng(1)
    C = layer.conv_dim
    x = gen.standard_normal((9, C))
    state = gen.standard_normal((NUM_SLOTS, C, kernel - 1))
    seq_starts, past_lens, slots = [0, 4, 5, 9], [3, 0, 1], [2, 0, 4]
    w = layer.conv1d.weight.detach().numpy()  # [C, 1, K]
    for act, fn in ((1, F.silu), (0, lambda t: t)):
        y, new = ref.causal_conv1d_reference(x, w, state, seq_starts, past_lens, slots, act)
        layer.conv_activation = fn
        want_state = state.copy()
        for s in range(3):
            a, b, slot = seq_starts[s], seq_starts[s + 1], slots[s]
            past = torch.from_numpy(state[slot] if past_lens[s] else np.zeros_like(state[slot]))
            out, new_past = layer._conv(torch.from_numpy(x[a:b]).T.unsqueeze(0), past.unsqueeze(0))
            np.testing.assert_allclose(y[a:b], out[0].T.numpy(), rtol=1e-12, atol=1e-12)
            want_state[slot] = new_past[0].numpy()
        np.testing.assert_array_equal(new, want_state)  # pure copies of inputs
    # the [C, K] weight layout is the same op
    y2, _ = ref.causal_conv1d_reference(x, w[:, 0], state, seq_starts, past_lens, slots, 0)
    np.testing.assert_array_equal(y2, y)


def _gdn_inputs(T: int, Hk: int, Hv: int, dk: int, dv: int, seed: int = 3):
    gen = np.random.default_rng(seed)
    q, k = gen.standard_normal((T, Hk, dk)), gen.standard_normal((T, Hk, dk))
    v = gen.standard_normal((T, Hv, dv))
    g = -np.exp(gen.uniform(-3.0, 0.5, (T, Hv)))
    beta = 1.0 / (1.0 + np.exp(-gen.standard_normal((T, Hv))))
    state = gen.standard_normal((NUM_SLOTS, Hv, dk, dv)) * 0.5
    return q, k, v, g, beta, state


def test_delta_rule_matches_chunked_form_float64():
    """Multi-chunk prompts (> CHUNK_SIZE tokens), one from a state, one fresh over a
    stale slot, a decode token: the chunked form in float64 agrees to 1e-10."""
    Hk, Hv, dk, dv = 2, 4, 8, 6
    seq_starts, past_lens, slots = [0, 70, 71, 151], [5, 2, 0], [1, 3, 4]
    q, k, v, g, beta, state = _gdn_inputs(151, Hk, Hv, dk, dv)
    scale = dk**-0.5
    o, new = ref.gated_delta_net_reference(q, k, v, g, beta, state, seq_starts, past_lens, slots, 1, scale)
    rep = Hv // Hk
    for s in range(3):
        a, b, slot = seq_starts[s], seq_starts[s + 1], slots[s]
        qn = la.l2_normalize(torch.from_numpy(q[a:b])).repeat_interleave(rep, 1) * scale
        kn = la.l2_normalize(torch.from_numpy(k[a:b])).repeat_interleave(rep, 1)
        s0 = torch.from_numpy(state[slot]) if past_lens[s] else None
        want_o, want_s = la.chunked_delta_rule(
            qn.transpose(0, 1),
            kn.transpose(0, 1),
            torch.from_numpy(v[a:b]).transpose(0, 1),
            torch.from_numpy(g[a:b]).T,
            torch.from_numpy(beta[a:b]).T,
            s0,
        )
        assert want_o.dtype == torch.float64
        assert_rel(o[a:b], want_o.transpose(0, 1).numpy(), 1e-10)
        assert_rel(new[slot], want_s.numpy(), 1e-10)
    untouched = [i for i in range(NUM_SLOTS) if i not in slots]
    np.testing.assert_array_equal(new[untouched], state[untouched])


def test_delta_rule_without_norm_matches_recurrent_step():
    """l2norm_qk = 0 and an arbitrary scale: a decode-only step is recurrent_delta_step."""
    Hk, Hv, dk, dv = 1, 2, 16, 8
    q, k, v, g, beta, state = _gdn_inputs(3, Hk, Hv, dk, dv, seed=5)
    q, k = q * 0.3, k * 0.3
    slots = [4, 0, 2]
    o, new = ref.gated_delta_net_reference(q, k, v, g, beta, state, [0, 1, 2, 3], [7, 1, 9], slots, 0, 0.7)
    t = lambda a: torch.from_numpy(a).float()  # noqa: E731
    want_o, want_s = la.recurrent_delta_step(
        t(q).repeat_interleave(2, 1) * 0.7, t(k).repeat_interleave(2, 1), t(v), t(g), t(beta), t(state[slots])
    )
    assert_rel(o, want_o.numpy(), 2e-6)
    assert_rel(new[slots], want_s.numpy(), 2e-6)


def _layer_from_references(
    layer: la.GatedDeltaNet,
    x: torch.Tensor,
    seq_starts,
    past_lens,
    slots,
    conv_state: np.ndarray,
    rec_state: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GatedDeltaNet.forward with its conv and recurrence replaced by the two references
    (what the exported graph does around the two plugin nodes)."""
    with torch.no_grad():
        cols = layer.in_proj_qkv(x).double().numpy()
        z = layer.in_proj_z(x)
        beta = torch.sigmoid(layer.in_proj_b(x)).double().numpy()
        g = (
            (-layer.A_log.float().exp() * F.softplus(layer.in_proj_a(x).float() + layer.dt_bias.float()))
            .double()
            .numpy()
        )
        mixed, conv_new = ref.causal_conv1d_reference(
            cols, layer.conv1d.weight.detach().numpy(), conv_state, seq_starts, past_lens, slots, ref.ACTIVATION_SILU
        )
        T = x.shape[0]
        kd, Hk, Hv, dk, dv = layer.key_dim, layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
        q = mixed[:, :kd].reshape(T, Hk, dk)
        k = mixed[:, kd : 2 * kd].reshape(T, Hk, dk)
        v = mixed[:, 2 * kd :].reshape(T, Hv, dv)
        core, rec_new = ref.gated_delta_net_reference(
            q, k, v, g, beta, rec_state, seq_starts, past_lens, slots, 1, dk**-0.5
        )
        core_t = torch.from_numpy(core).float().reshape(-1, dv)
        out = layer.out_proj(layer.norm(core_t, z.reshape(-1, dv)).reshape(T, -1))
    return out.double().numpy(), conv_new, rec_new


def test_layer_rebuilt_from_references_over_packed_steps():
    cfg = make_config()
    layer = random_layer(cfg, seed=7)
    shapes = la.GatedDeltaNet.state_shapes(cfg)
    gen = torch.Generator().manual_seed(8)
    # stale garbage in every slot: a fresh sequence must ignore it
    conv = torch.randn(NUM_SLOTS, *shapes["conv"], generator=gen)
    rec = torch.randn(NUM_SLOTS, *shapes["recurrent"], generator=gen)
    conv_np, rec_np = conv.double().numpy().copy(), rec.double().numpy().copy()
    steps = [
        ([0, 6, 8], [0, 0], [0, 2]),  # two prompts (one of 2 tokens < K-1 + 1)
        ([0, 5, 6, 9], [6, 2, 0], [0, 2, 3]),  # prefill chunk from a state, a decode, a new prompt
        ([0, 1, 2, 3], [11, 3, 3], [0, 2, 3]),  # decodes only
        ([0, 70, 71], [0, 12], [2, 0]),  # slot 2 restarted (past 0) with a multi-chunk prompt
    ]
    for i, (seq_starts, past_lens, slots) in enumerate(steps):
        x = torch.randn(seq_starts[-1], cfg.hidden_size, generator=gen)
        with torch.no_grad():
            want = layer(x, seq_starts, past_lens, slots, conv, rec)
        got, conv_np, rec_np = _layer_from_references(layer, x, seq_starts, past_lens, slots, conv_np, rec_np)
        assert_rel(got, want.numpy(), 2e-4)
        assert_rel(conv_np, conv.numpy(), 1e-6)
        assert_rel(rec_np, rec.numpy(), 1e-4)
        # carry the torch layer's fp32 states forward: each step is judged alone
        conv_np, rec_np = conv.double().numpy().copy(), rec.double().numpy().copy()


def test_padding_conventions():
    """A token outside every sequence outputs zeros; a slot outside the state reads zeros
    and keeps nothing (the kernels' conventions, specified here)."""
    q, k, v, g, beta, state = _gdn_inputs(4, 1, 1, 4, 4)
    o, new = ref.gated_delta_net_reference(q, k, v, g, beta, state, [0, 2, 3], [1, 1], [NUM_SLOTS, 1], 1, 0.5)
    assert np.all(o[3] == 0) and np.any(o[:3] != 0)
    o_fresh, _ = ref.gated_delta_net_reference(q, k, v, g, beta, state, [0, 2], [0], [1], 1, 0.5)
    np.testing.assert_allclose(o[:2], o_fresh[:2], rtol=1e-12)
    np.testing.assert_array_equal(np.delete(new, 1, axis=0), np.delete(state, 1, axis=0))
    x = np.ones((3, 2))
    y, cnew = ref.causal_conv1d_reference(x, np.ones((2, 3)), np.ones((2, 2, 2)), [0, 2], [4], [7], 0)
    np.testing.assert_array_equal(y[:2], [[1, 1], [2, 2]])
    np.testing.assert_array_equal(y[2], [0, 0])
    np.testing.assert_array_equal(cnew, np.ones((2, 2, 2)))


@pytest.mark.parametrize(
    "call,needle",
    [
        (
            lambda: ref.causal_conv1d_reference(
                np.ones((3, 4)), np.ones((5, 2)), np.ones((1, 4, 1)), [0, 3], [0], [0], 1
            ),
            "weight",
        ),
        (
            lambda: ref.causal_conv1d_reference(
                np.ones((3, 4)), np.ones((4, 2)), np.ones((1, 4, 2)), [0, 3], [0], [0], 1
            ),
            "conv_state",
        ),
        (
            lambda: ref.causal_conv1d_reference(
                np.ones((3, 4)), np.ones((4, 2)), np.ones((1, 4, 1)), [0, 3], [0], [0], 2
            ),
            "activation",
        ),
        (
            lambda: ref.causal_conv1d_reference(
                np.ones((3, 4)), np.ones((4, 2)), np.ones((1, 4, 1)), [0, 4], [0], [0], 1
            ),
            "seq_starts",
        ),
        (
            lambda: ref.gated_delta_net_reference(
                *_gdn_inputs(2, 2, 3, 4, 4)[:5], np.ones((1, 3, 4, 4)), [0, 2], [0], [0], 1, 1.0
            ),
            "multiple",
        ),
        (
            lambda: ref.gated_delta_net_reference(
                *_gdn_inputs(2, 1, 2, 4, 4)[:5], np.ones((1, 2, 4, 5)), [0, 2], [0], [0], 1, 1.0
            ),
            "state",
        ),
        (
            lambda: ref.gated_delta_net_reference(*_gdn_inputs(2, 1, 2, 4, 4)[:6], [0, 2], [0, 0], [0], 1, 1.0),
            "past_lens",
        ),
    ],
)
def test_bad_inputs_one_line(call, needle):
    with pytest.raises(EngramError) as info:
        call()
    assert needle in str(info.value) and "\n" not in str(info.value)
