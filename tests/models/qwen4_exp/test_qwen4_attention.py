"""Qwen4Exp's gated attention with the QSA indexer (models/qwen4_exp/attention.py).

The reference is transformers' own model: a tiny ``Qwen4ExpTextModel`` (a linear layer,
then an indexed one) runs a prompt and decode steps with its cache, and a hook records
what its attention layer received and returned; our layer, loaded with that layer's
state_dict, must return the same over the packed step. Plain causal attention in
float64 (written here from the formulas) is the second oracle. Every parameter is random.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from engram_trt.errors import ConfigError, EngramError
from engram_trt.models.qwen4_exp.attention import GatedAttention, rope_cos_sin

transformers = pytest.importorskip("transformers")
from transformers.models.qwen4_exp import modeling_qwen4_exp as hf  # noqa: E402
from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig  # noqa: E402

BASE = dict(heads=2, kv_heads=1, factor=0.5, budget=4, ratio=2, bias=False)
CONFIGS = {
    "budget4_ratio2": BASE,
    "budget8_ratio4": dict(BASE, budget=8, ratio=4),
    "full_rope": dict(BASE, factor=1.0),
    "gqa2_bias": dict(BASE, heads=4, kv_heads=2, bias=True),
}


def make_config(heads=2, kv_heads=1, factor=0.5, budget=4, ratio=2, bias=False, theta=10000.0):
    return Qwen4ExpTextConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        layer_types=["linear_attention", "indexed_attention"],
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=16,
        attention_bias=bias,
        rope_parameters={"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": factor},
        indexer_n_heads=2,
        indexer_kv_heads=1,
        indexer_head_dim=16,
        indexer_budget=budget,
        indexer_compress_ratio=ratio,
        moe_intermediate_size=8,
        shared_expert_intermediate_size=8,
        num_experts=2,
        num_experts_per_tok=1,
        hc_count=2,
        hc_lowrank=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        attn_implementation="eager",
    )


def randomize(module: torch.nn.Module, gen: torch.Generator, scale: float = 0.3) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * scale)


def new_layer(config, gen) -> GatedAttention:
    layer = GatedAttention(config, 1).eval()
    randomize(layer, gen)
    return layer


def new_caches(config, n_slots: int, max_len: int, fill: float = float("nan")):
    shapes = GatedAttention.cache_shapes(config, max_len)
    return tuple(torch.full((n_slots, *shapes[k]), fill) for k in ("key", "value", "index_key"))


def run(layer, caches, chunks):
    """One packed step: chunks = [(x [n, D], past_len, slot)] -> output [T, D]."""
    xs = torch.cat([c[0] for c in chunks])
    starts, positions = [0], []
    for x, past, _ in chunks:
        starts.append(starts[-1] + x.shape[0])
        positions.append(torch.arange(past, past + x.shape[0]))
    with torch.no_grad():
        return layer(xs, torch.cat(positions), starts, [c[1] for c in chunks], [c[2] for c in chunks], *caches)


def assert_rel(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-5) -> None:
    err = (actual.double() - expected.double()).abs().max().item()
    scale = expected.double().abs().max().item()
    assert err <= rel * scale, f"max error {err:.3e} against scale {scale:.3e}"


def hf_trace(config, gen, prompt_len: int = 20, decode_steps: int = 5):
    """transformers' model over a prompt then decode steps with its cache; returns its
    attention layer's state_dict and the (input, output) [n, D] of each call."""
    model = hf.Qwen4ExpTextModel(config).eval()
    randomize(model, gen)
    records = []

    def hook(_module, args, kwargs, out):
        hidden = args[0] if args else kwargs["hidden_states"]
        records.append((hidden[0].clone(), out[0][0].clone()))

    attn = model.layers[1].self_attn
    handle = attn.register_forward_hook(hook, with_kwargs=True)
    with torch.no_grad():
        ids = torch.randint(0, config.vocab_size, (1, prompt_len), generator=gen)
        cache = model(input_ids=ids, use_cache=True).cache
        for _ in range(decode_steps):
            step = torch.randint(0, config.vocab_size, (1, 1), generator=gen)
            cache = model(input_ids=step, cache=cache, use_cache=True).cache
    handle.remove()
    return attn.state_dict(), records


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matches_transformers_prefill_then_decode(name):
    gen = torch.Generator().manual_seed(1234 + len(name))
    config = make_config(**CONFIGS[name])
    state, records = hf_trace(config, gen)
    layer = GatedAttention(config, 1).eval()
    layer.load_state_dict(state)
    caches = new_caches(config, n_slots=3, max_len=32)
    past = 0
    for x, expected in records:
        out = run(layer, caches, [(x, past, 2)])
        assert_rel(out, expected)
        past += x.shape[0]


def test_rope_cos_sin_matches_transformers():
    config = make_config(factor=0.5, theta=500.0)
    positions = torch.randint(0, 4000, (7,))
    cos, sin = rope_cos_sin(config, positions)
    rotary = hf.Qwen4ExpTextRotaryEmbedding(config)
    ref_cos, ref_sin = rotary(torch.zeros(1, dtype=torch.float32), positions.view(1, 1, -1).expand(3, 1, -1))
    assert cos.shape == (7, 8) and cos.dtype == torch.float32
    torch.testing.assert_close(cos, ref_cos[0], rtol=0, atol=0)
    torch.testing.assert_close(sin, ref_sin[0], rtol=0, atol=0)


# ---- plain causal attention in float64, from the formulas ----


def _norm64(x, w, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


def _rope64(x, positions, config):
    theta = config.rope_parameters["rope_theta"]
    rot = int(config.head_dim * config.rope_parameters["partial_rotary_factor"])
    half = rot // 2
    inv = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / rot)
    ang = positions.double()[:, None, None] * inv  # [n, 1, half]
    c, s = ang.cos(), ang.sin()
    x1, x2, rest = x[..., :half], x[..., half:rot], x[..., rot:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, rest), dim=-1)


def plain_causal_f64(layer: GatedAttention, x: torch.Tensor) -> torch.Tensor:
    cfg = layer.config
    p = {k: v.double() for k, v in layer.state_dict().items()}
    x = x.double()
    n, h, kvh, hd = x.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

    def lin(name):
        y = x @ p[f"{name}.weight"].T
        return y + p[f"{name}.bias"] if f"{name}.bias" in p else y

    qg = lin("q_proj").reshape(n, h, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(n, h * hd)
    pos = torch.arange(n)
    q = _rope64(_norm64(q, p["q_norm.weight"], cfg.rms_norm_eps), pos, cfg)
    k = _rope64(_norm64(lin("k_proj").reshape(n, kvh, hd), p["k_norm.weight"], cfg.rms_norm_eps), pos, cfg)
    v = lin("v_proj").reshape(n, kvh, hd)
    out = torch.empty(n, h, hd, dtype=torch.float64)
    for head in range(h):
        g = head // (h // kvh)
        s = q[:, head] @ k[:, g].T / math.sqrt(hd)
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out[:, head] = torch.softmax(s, dim=-1) @ v[:, g]
    y = out.reshape(n, h * hd) * torch.sigmoid(gate)
    out = y @ p["o_proj.weight"].T
    return out + p["o_proj.bias"] if "o_proj.bias" in p else out


@pytest.mark.parametrize("budget,ratio", [(4, 2), (8, 4)])
def test_dropped_blocks_change_the_output(budget, ratio):
    gen = torch.Generator().manual_seed(7 + budget)
    config = make_config(budget=budget, ratio=ratio)
    layer = new_layer(config, gen)
    x = torch.randn(20, 32, generator=gen)
    out = run(layer, new_caches(config, 1, 20), [(x, 0, 0)])
    plain = plain_causal_f64(layer, x)
    # A query at position p sees (p + 1) // ratio blocks; up to budget // ratio nothing is dropped.
    full = (budget // ratio + 1) * ratio - 1  # the first position that sees one block too many
    assert_rel(out[:full], plain[:full])
    diff = (out[full:].double() - plain[full:]).abs().amax(dim=-1)
    assert (diff > 1e-3 * plain.abs().max()).sum() >= (20 - full) // 2, diff


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_budget_covering_the_sequence_is_plain_causal(name):
    gen = torch.Generator().manual_seed(99 + len(name))
    spec = dict(CONFIGS[name], budget=12 * CONFIGS[name]["ratio"])  # 12 blocks: more than 21 tokens hold
    config = make_config(**spec)
    layer = new_layer(config, gen)
    x = torch.randn(21, 32, generator=gen)
    out = run(layer, new_caches(config, 2, 24), [(x, 0, 1)])
    assert_rel(out, plain_causal_f64(layer, x))


# ---- the packed step ----


@pytest.mark.parametrize("name", ["budget4_ratio2", "budget8_ratio4"])
def test_chunked_prefill_equals_one_call(name):
    gen = torch.Generator().manual_seed(5)
    config = make_config(**CONFIGS[name])
    layer = new_layer(config, gen)
    x = torch.randn(23, 32, generator=gen)
    whole = run(layer, new_caches(config, 1, 32), [(x, 0, 0)])
    caches = new_caches(config, 1, 32)
    pieces, past = [], 0
    for size in (5, 1, 9, 3, 5):
        pieces.append(run(layer, caches, [(x[past : past + size], past, 0)]))
        past += size
    assert_rel(torch.cat(pieces), whole)


def test_packed_step_equals_each_sequence_alone():
    gen = torch.Generator().manual_seed(11)
    config = make_config(**CONFIGS["gqa2_bias"])
    layer = new_layer(config, gen)
    prompts = [torch.randn(n, 32, generator=gen) for n in (17, 9, 12)]
    news = [torch.randn(n, 32, generator=gen) for n in (1, 6, 1)]
    pasts = [17, 9, 0]  # sequence 2 is a fresh prefill: its new tokens are its prompt
    slots = [3, 0, 2]

    packed_caches = new_caches(config, 4, 32)
    run(layer, packed_caches, [(prompts[0], 0, 3), (prompts[1], 0, 0)])
    step = [(news[0], pasts[0], slots[0]), (news[1], pasts[1], slots[1]), (prompts[2], 0, slots[2])]
    packed = run(layer, packed_caches, step)

    alone = []
    for s in range(3):
        caches = new_caches(config, 4, 32)
        if pasts[s]:
            run(layer, caches, [(prompts[s], 0, slots[s])])
        alone.append(run(layer, caches, [step[s]]))
        n = pasts[s] + step[s][0].shape[0]
        for mine, theirs in zip(caches[:2], packed_caches[:2]):  # key, value: [slot, kv_heads, pos, d]
            assert_rel(mine[slots[s], :, :n], theirs[slots[s], :, :n], rel=1e-6)
        assert_rel(caches[2][slots[s], :n], packed_caches[2][slots[s], :n], rel=1e-6)
    assert_rel(packed, torch.cat(alone))


def whole_sequence_last(layer, x, y):
    """The decode token's output when the whole sequence x + y runs as one fresh call."""
    return run(layer, new_caches(layer.config, 1, 32), [(torch.cat((x, y)), 0, 0)])[-1:]


def test_reused_slot_ignores_stale_cache():
    gen = torch.Generator().manual_seed(13)
    config = make_config()
    layer = new_layer(config, gen)
    caches = new_caches(config, 2, 32, fill=0.0)
    run(layer, caches, [(torch.randn(25, 32, generator=gen), 0, 1)])  # an earlier sequence's 25 tokens
    x = torch.randn(8, 32, generator=gen)
    reused = run(layer, caches, [(x, 0, 1)])
    fresh = run(layer, new_caches(config, 2, 32), [(x, 0, 1)])
    assert_rel(reused, fresh, rel=0)
    # and its decode step after it: positions beyond the new length are still stale
    y = torch.randn(1, 32, generator=gen)
    assert_rel(run(layer, caches, [(y, 8, 1)]), whole_sequence_last(layer, x, y))


# ---- bad input ----


def loose_config(**changes) -> SimpleNamespace:
    """The fields the layer reads, outside transformers' own validation, with changes."""
    config = make_config()
    names = (
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "rope_parameters",
        "attention_bias",
        "indexer_n_heads",
        "indexer_kv_heads",
        "indexer_head_dim",
        "indexer_budget",
        "indexer_compress_ratio",
    )
    return SimpleNamespace(**{**{n: getattr(config, n) for n in names}, **changes})


def test_bad_config_and_step_are_refused():
    with pytest.raises(ConfigError, match="indexer_budget"):
        GatedAttention(loose_config(indexer_budget=None), 0)
    with pytest.raises(ConfigError, match="multiple"):
        GatedAttention(loose_config(indexer_budget=6, indexer_compress_ratio=4), 0)
    with pytest.raises(ConfigError, match="indexer_kv_heads"):
        GatedAttention(loose_config(indexer_kv_heads=2), 0)
    with pytest.raises(ConfigError, match="rope_type"):
        GatedAttention(loose_config(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}), 0)
    config = make_config()
    layer = new_layer(config, torch.Generator().manual_seed(0))
    caches = new_caches(config, 1, 8)
    with pytest.raises(EngramError, match="longer cache"):
        run(layer, caches, [(torch.randn(5, 32), 4, 0)])
    with pytest.raises(EngramError, match="slot"):
        run(layer, caches, [(torch.randn(2, 32), 0, 1)])
