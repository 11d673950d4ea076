"""RoPE (engram_trt.models.rope) against transformers' own rotary embeddings: every
supported type's inverse frequencies, attention scaling and cos/sin, in both config
spellings (transformers 5 ``rope_parameters``, transformers 4 ``rope_theta`` +
``rope_scaling``), and every refusal naming its field."""

from __future__ import annotations

import copy
import math

import pytest

pytest.importorskip("transformers", reason="the RoPE tests compare against the transformers package")

import torch
from transformers import LlamaConfig, Phi3Config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from engram_trt.errors import ConfigError
from engram_trt.config.rope import SUPPORTED_ROPE_TYPES, RopeSetting, parse_rope
from engram_trt.models.rope import cos_sin, dynamic_inv_freq, inv_freq_and_scale


def _longrope_factors(pairs: int, top: float) -> list[float]:
    """Phi-3-like factor lists: 1.0 for the fast pairs rising to ``top`` for the slowest."""
    return [round(1.0 + (top - 1.0) * (i / (pairs - 1)) ** 2, 6) for i in range(pairs)]


# name -> (rope_parameters as transformers 5 writes them, max_position_embeddings, head_dim)
CASES: dict[str, tuple[dict, int, int]] = {
    "default-llama2": ({"rope_type": "default", "rope_theta": 10000.0}, 4096, 128),
    "default-qwen-theta": ({"rope_type": "default", "rope_theta": 1000000.0}, 32768, 64),
    "linear-2": ({"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}, 8192, 128),
    "dynamic-2": ({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}, 4096, 128),
    "llama3.1": (
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        131072,
        128,
    ),
    "llama3.2-factor32": (
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        131072,
        64,
    ),
    "yarn-qwen-4": (
        {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 32768},
        131072,
        128,
    ),
    "yarn-4-attn-beta": (
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 4096,
            "attention_factor": 0.8,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
        },
        16384,
        128,
    ),
    "yarn-4-no-truncate": (
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 4096,
            "truncate": False,
        },
        16384,
        128,
    ),
    "yarn-deepseek-mscale": (
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
        },
        163840,
        64,
    ),
    "yarn-lone-mscale": (
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 4096,
            "mscale": 0.707,
        },
        16384,
        64,
    ),
    "yarn-factor-null": (
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": None, "original_max_position_embeddings": 4096},
        32768,
        64,
    ),
    "longrope-phi3-128k": (
        {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "original_max_position_embeddings": 4096,
            "short_factor": _longrope_factors(48, 1.2),
            "long_factor": _longrope_factors(48, 60.0),
        },
        131072,
        96,
    ),
    "longrope-attn-factor": (
        {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "original_max_position_embeddings": 4096,
            "factor": 8.0,
            "attention_factor": 1.1,
            "short_factor": _longrope_factors(32, 1.05),
            "long_factor": _longrope_factors(32, 8.0),
        },
        32768,
        64,
    ),
}

POSITIONS = torch.tensor([[0, 1, 2, 3, 17, 255, 1000, 4095, 4096, 4097, 8191, 8192, 8193, 20000, 32767, 65535, 131071]])


def hf_config(rope_parameters: dict | None, max_pos: int, head_dim: int, **extra) -> LlamaConfig:
    heads = 4
    kw = dict(
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        **extra,
    )
    if rope_parameters is not None:
        kw["rope_parameters"] = copy.deepcopy(rope_parameters)
    return LlamaConfig(**kw)


def ours(rope_parameters: dict, max_pos: int, head_dim: int, **kw) -> RopeSetting:
    return parse_rope(
        {"rope_parameters": copy.deepcopy(rope_parameters)},
        source="config.json",
        max_position_embeddings=max_pos,
        head_dim=head_dim,
        **kw,
    )


def hf_call(rot, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return rot(torch.zeros(1, dtype=torch.float32), positions)


def assert_same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
    diff = (a - b).abs().max().item() if a.numel() else 0.0
    assert diff <= 1e-6, f"{what}: max abs diff {diff}"


@pytest.mark.parametrize("name", list(CASES))
def test_static_values_match_transformers(name):
    params, max_pos, head_dim = CASES[name]
    setting = ours(params, max_pos, head_dim)
    rot = LlamaRotaryEmbedding(hf_config(params, max_pos, head_dim))
    inv, scale = inv_freq_and_scale(setting, head_dim)
    assert torch.equal(inv, rot.inv_freq), name  # bit for bit
    assert scale == rot.attention_scaling, name
    assert inv.shape == (head_dim // 2,)
    # positions inside the static regime of every type
    limit = setting.original_max_position_embeddings if setting.rope_type == "longrope" else max_pos
    pos = POSITIONS[POSITIONS < limit][None]
    cos, sin = cos_sin(setting, head_dim, pos)
    hcos, hsin = hf_call(rot, pos)
    assert cos.shape == pos.shape + (head_dim,)
    assert torch.equal(cos, hcos) and torch.equal(sin, hsin), name
    if setting.rope_type not in ("dynamic", "longrope"):  # length-independent: every position
        cos, sin = cos_sin(setting, head_dim, POSITIONS)
        hcos, hsin = hf_call(LlamaRotaryEmbedding(hf_config(params, max_pos, head_dim)), POSITIONS)
        assert_same(cos, hcos, f"{name} cos")
        assert_same(sin, hsin, f"{name} sin")


@pytest.mark.parametrize("name", list(CASES))
def test_v4_and_v5_spellings_agree(name):
    params, max_pos, head_dim = CASES[name]
    v5 = ours(params, max_pos, head_dim)
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    v4 = {"rope_theta": params["rope_theta"], "rope_scaling": None if params["rope_type"] == "default" else scaling}
    assert parse_rope(v4, source="config.json", max_position_embeddings=max_pos, head_dim=head_dim) == v5
    # the oldest spelling: "type" instead of "rope_type"
    if v4["rope_scaling"] is not None:
        legacy = dict(v4, rope_scaling={("type" if k == "rope_type" else k): v for k, v in scaling.items()})
        assert parse_rope(legacy, max_position_embeddings=max_pos, head_dim=head_dim) == v5
        # transformers reads the v4 spelling to the same frequencies
        rot = LlamaRotaryEmbedding(hf_config(None, max_pos, head_dim, **copy.deepcopy(legacy)))
        assert torch.equal(inv_freq_and_scale(v5, head_dim)[0], rot.inv_freq)
    # both spellings at once, agreeing: accepted
    both = dict(v4, rope_parameters=copy.deepcopy(params))
    assert parse_rope(both, max_position_embeddings=max_pos, head_dim=head_dim) == v5
    # the manifest form reads back to the same setting
    assert ours(v5.to_dict(), max_pos, head_dim) == v5


def test_absent_rope_is_default_theta_10000():
    s = parse_rope({}, max_position_embeddings=2048, head_dim=64)
    assert s == parse_rope({"rope_scaling": None}, max_position_embeddings=2048, head_dim=64)
    assert (s.rope_type, s.theta) == ("default", 10000.0)
    rot = LlamaRotaryEmbedding(hf_config(None, 2048, 64))
    assert torch.equal(inv_freq_and_scale(s, 64)[0], rot.inv_freq)
    assert s.to_dict() == {"rope_type": "default", "rope_theta": 10000.0}


def test_dynamic_beyond_max_positions_matches_a_fresh_transformers_module():
    params, max_pos, head_dim = CASES["dynamic-2"]
    s = ours(params, max_pos, head_dim)
    assert s.length_dependent
    for n in (max_pos, max_pos + 1, 6000, 3 * max_pos + 17):
        rot = LlamaRotaryEmbedding(hf_config(params, max_pos, head_dim))
        pos = torch.arange(n)[None]
        hcos, hsin = hf_call(rot, pos)
        assert torch.equal(dynamic_inv_freq(s, head_dim, n), rot.inv_freq), n
        cos, sin = cos_sin(s, head_dim, pos)
        assert_same(cos, hcos, f"dynamic cos n={n}")
        assert_same(sin, hsin, f"dynamic sin n={n}")
    # within max_position_embeddings the frequencies are plain RoPE's
    assert torch.equal(dynamic_inv_freq(s, head_dim, max_pos), inv_freq_and_scale(s, head_dim)[0])
    assert not torch.equal(dynamic_inv_freq(s, head_dim, max_pos + 1), inv_freq_and_scale(s, head_dim)[0])


def test_dynamic_transformers_state_keeps_the_longest_until_a_short_call():
    """What the module docstring says: transformers keeps the frequencies of the longest
    call until a call with seq_len < max_position_embeddings (strictly) resets them."""
    params, max_pos, head_dim = CASES["dynamic-2"]
    s = ours(params, max_pos, head_dim)
    rot = LlamaRotaryEmbedding(hf_config(params, max_pos, head_dim))
    hf_call(rot, torch.arange(6000)[None])
    hf_call(rot, torch.arange(5000)[None])  # shorter, still beyond: kept
    assert torch.equal(rot.inv_freq, dynamic_inv_freq(s, head_dim, 6000))
    hf_call(rot, torch.arange(max_pos)[None])  # seq_len == max_pos: still kept
    assert torch.equal(rot.inv_freq, dynamic_inv_freq(s, head_dim, 6000))
    hf_call(rot, torch.arange(max_pos - 1)[None])  # seq_len < max_pos: reset
    assert torch.equal(rot.inv_freq, inv_freq_and_scale(s, head_dim)[0])


@pytest.mark.parametrize("name", ["longrope-phi3-128k", "longrope-attn-factor"])
def test_longrope_factor_follows_the_call_length(name):
    params, max_pos, head_dim = CASES[name]
    s = ours(params, max_pos, head_dim)
    orig = s.original_max_position_embeddings
    assert s.length_dependent
    rot = LlamaRotaryEmbedding(hf_config(params, max_pos, head_dim))
    for n in (orig, orig + 1, 2 * orig, orig - 5, max_pos):  # stateless: any order
        pos = torch.arange(0, n, 7)
        pos = torch.cat([pos, torch.tensor([n - 1])])[None]
        hcos, hsin = hf_call(rot, pos)
        cos, sin = cos_sin(s, head_dim, pos)
        assert torch.equal(cos, hcos) and torch.equal(sin, hsin), (name, n)
        assert torch.equal(inv_freq_and_scale(s, head_dim, seq_len=n)[0], rot.inv_freq), (name, n)
    # short factors up to orig, long beyond, same attention factor for both
    short, a = inv_freq_and_scale(s, head_dim, seq_len=orig)
    long, b = inv_freq_and_scale(s, head_dim, seq_len=orig + 1)
    assert torch.equal(short, inv_freq_and_scale(s, head_dim)[0]) and not torch.equal(short, long) and a == b
    # a table for positions of a longer sequence: seq_len says which regime
    early = torch.arange(10)[None]
    assert not torch.equal(cos_sin(s, head_dim, early)[0], cos_sin(s, head_dim, early, seq_len=orig + 1)[0])


def test_longrope_attention_factor_inferred_from_max_over_original():
    params, max_pos, head_dim = CASES["longrope-phi3-128k"]
    s = ours(params, max_pos, head_dim)
    assert s.factor == 32.0
    assert s.attention_factor == math.sqrt(1 + math.log(32.0) / math.log(4096))


def test_yarn_attention_factor_semantics():
    assert ours(*CASES["yarn-qwen-4"]).attention_factor == 0.1 * math.log(4.0) + 1
    # a lone mscale is ignored by transformers; both mscales: their ratio
    assert ours(*CASES["yarn-lone-mscale"]).attention_factor == 0.1 * math.log(4.0) + 1
    ds = ours(*CASES["yarn-deepseek-mscale"])
    assert ds.attention_factor == pytest.approx((0.0707 * math.log(40) + 1) / (0.1 * math.log(40) + 1))
    # factor null: max_position_embeddings / original_max_position_embeddings
    assert ours(*CASES["yarn-factor-null"]).factor == 8.0


@pytest.mark.parametrize(
    "params",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "original_max_position_embeddings": 4096,
            "short_factor": _longrope_factors(48, 1.1),
            "long_factor": _longrope_factors(48, 30.0),
        },
    ],
    ids=lambda p: p["rope_type"],
)
def test_partial_rotary_factor_matches_phi3(params):
    """Phi-4-mini style: head_dim 128, three quarters rotated (96 channels, 48 pairs)."""
    head_dim, max_pos, orig = 128, 131072, 4096
    p = dict(params, partial_rotary_factor=0.75)
    s = ours(p, max_pos, head_dim, partial_rotary=True)
    assert s.rotary_dim(head_dim) == 96
    cfg = Phi3Config(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        max_position_embeddings=max_pos,
        original_max_position_embeddings=orig,
        rope_parameters=copy.deepcopy(p),
    )
    rot = Phi3RotaryEmbedding(cfg)
    inv, scale = inv_freq_and_scale(s, head_dim)
    assert inv.shape == (48,) and torch.equal(inv, rot.inv_freq) and scale == rot.attention_scaling
    pos = POSITIONS[POSITIONS < orig][None]
    cos, sin = cos_sin(s, head_dim, pos)
    hcos, hsin = hf_call(rot, pos)
    assert cos.shape[-1] == 96 and torch.equal(cos, hcos) and torch.equal(sin, hsin)
    # the v4 spelling: a top-level partial_rotary_factor
    v4 = {
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.75,
        "rope_scaling": None if p["rope_type"] == "default" else {k: v for k, v in params.items() if k != "rope_theta"},
    }
    assert parse_rope(v4, max_position_embeddings=max_pos, head_dim=head_dim, partial_rotary=True) == s


@pytest.mark.parametrize(
    "params",
    [
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 4096},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ],
    ids=lambda p: p["rope_type"],
)
def test_partial_rotary_factor_in_scaled_types_matches_transformers(params):
    """modeling_rope_utils' scaled types honour partial_rotary_factor (Phi-3 takes only
    default and longrope, so these go through Llama's rotary embedding, whose
    frequencies and cos/sin do not depend on the head being fully rotated)."""
    p = dict(params, partial_rotary_factor=0.5)
    s = ours(p, 16384, 128, partial_rotary=True)
    rot = LlamaRotaryEmbedding(hf_config(p, 16384, 128))
    inv, scale = inv_freq_and_scale(s, 128)
    assert s.rotary_dim(128) == 64 and inv.shape == (32,) and torch.equal(inv, rot.inv_freq)
    assert scale == rot.attention_scaling
    pos = POSITIONS[POSITIONS < 16384][None]
    cos, sin = cos_sin(s, 128, pos)
    hcos, hsin = hf_call(rot, pos)
    assert cos.shape[-1] == 64 and torch.equal(cos, hcos) and torch.equal(sin, hsin)


def test_llama_plain_rope_ignores_partial_rotary_factor():
    """The surprise behind partial_rotary=False: Llama's plain-RoPE init rotates the
    whole head whatever partial_rotary_factor says (and its attention cannot rotate part)."""
    rot = LlamaRotaryEmbedding(
        hf_config({"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}, 4096, 128)
    )
    assert rot.inv_freq.shape == (64,)


def test_top_level_original_max_position_embeddings():
    """Phi-3 writes original_max_position_embeddings beside rope_scaling, not in it."""
    params = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    cfg = {"rope_theta": 500000.0, "original_max_position_embeddings": 8192, "rope_scaling": params}
    s = parse_rope(cfg, max_position_embeddings=131072, head_dim=128)
    assert s == ours(CASES["llama3.1"][0], 131072, 128)


def test_identical_per_layer_rope_parameters_collapse():
    params, max_pos, head_dim = CASES["llama3.1"]
    nested = {"full_attention": params, "sliding_attention": params}
    assert ours(nested, max_pos, head_dim) == ours(params, max_pos, head_dim)


def test_supported_names_are_the_six():
    assert SUPPORTED_ROPE_TYPES == ("default", "linear", "dynamic", "yarn", "llama3", "longrope")


LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# (config.json mapping, keyword overrides, substrings the one-line message must hold)
REFUSALS = [
    (
        {"rope_parameters": {"rope_type": "ntk-by-parts"}},
        {},
        ["config.json: ", "'rope_parameters.rope_type'='ntk-by-parts'", "not a RoPE type", "default, linear"],
    ),
    ({"rope_scaling": {"type": "su", "short_factor": [1.0]}}, {}, ["'rope_scaling.rope_type'='su'", "longrope"]),
    ({"rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}}, {}, ["'mrope'", "multimodal"]),
    (
        {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}},
        {"supported": ("default", "llama3")},
        ["'rope_parameters.rope_type'='yarn'", "not supported by this architecture", "supported: default, llama3"],
    ),
    ({"rope_scaling": {"rope_type": "linear"}}, {}, ["missing field 'rope_scaling.factor'", "'linear'"]),
    (
        {"rope_scaling": {"rope_type": "linear", "factor": "2"}},
        {},
        ["field 'rope_scaling.factor' must be a number", "'2'"],
    ),
    ({"rope_scaling": {"rope_type": "linear", "factor": 0.5}}, {}, ["'rope_scaling.factor'", ">= 1", "0.5"]),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": True}}, {}, ["'rope_scaling.factor'", "True"]),
    (
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0, "finetuned": True}},
        {},
        ["'rope_scaling.finetuned' is not a RoPE parameter", "takes: factor"],
    ),
    (
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0, "low_freq_factor": 1.0}},
        {},
        ["'rope_scaling.low_freq_factor' does not apply to rope_type 'linear'"],
    ),
    (
        {"rope_scaling": {k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"}},
        {},
        ["missing field 'rope_scaling.original_max_position_embeddings'", "'llama3'"],
    ),
    (
        {"rope_scaling": dict(LLAMA3, original_max_position_embeddings=8192.5)},
        {},
        ["'rope_scaling.original_max_position_embeddings' must be an integer", "8192.5"],
    ),
    (
        {"rope_scaling": dict(LLAMA3, high_freq_factor=1.0)},
        {},
        ["'rope_scaling.high_freq_factor'=1 must be greater than"],
    ),
    (
        {"rope_scaling": {k: v for k, v in LLAMA3.items() if k != "low_freq_factor"}},
        {},
        ["missing field 'rope_scaling.low_freq_factor'"],
    ),
    (
        {"rope_scaling": {"rope_type": "yarn", "original_max_position_embeddings": 4096}},
        {},
        ["missing field 'rope_scaling.factor'", "'yarn'"],
    ),
    (
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 4096,
                "beta_fast": 1.0,
                "beta_slow": 32.0,
            }
        },
        {},
        ["'rope_scaling.beta_fast'=1 must be >="],
    ),
    (
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 4096,
                "truncate": "no",
            }
        },
        {},
        ["'rope_scaling.truncate' must be true or false"],
    ),
    (
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 4096,
                "attention_factor": 0,
            }
        },
        {},
        ["'rope_scaling.attention_factor'", "> 0"],
    ),
    (
        {
            "rope_scaling": {
                "rope_type": "longrope",
                "original_max_position_embeddings": 4096,
                "short_factor": [1.0] * 63,
                "long_factor": [2.0] * 64,
            }
        },
        {},
        ["'rope_scaling.short_factor' lists 63 values", "needs 64"],
    ),
    (
        {
            "rope_scaling": {
                "rope_type": "longrope",
                "original_max_position_embeddings": 4096,
                "short_factor": [1.0] * 64,
                "long_factor": [2.0] * 63 + ["x"],
            }
        },
        {},
        ["'rope_scaling.long_factor' must be a list of positive numbers"],
    ),
    (
        {
            "rope_scaling": {
                "rope_type": "longrope",
                "original_max_position_embeddings": 4096,
                "short_factor": [1.0] * 64,
            }
        },
        {},
        ["missing field 'rope_scaling.long_factor'"],
    ),
    (
        {"rope_scaling": {"rope_type": "linear", "type": "dynamic", "factor": 2.0}},
        {},
        ["'rope_scaling.rope_type'='linear' and 'rope_scaling.type'='dynamic' disagree"],
    ),
    ({"rope_theta": "1e4"}, {}, ["field 'rope_theta' must be a number", "'1e4'"]),
    ({"rope_theta": -1.0}, {}, ["field 'rope_theta'"]),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": float("inf")}}, {}, ["'rope_parameters.rope_theta'"]),
    (
        {"rope_theta": 10000.0, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
        {},
        ["'rope_parameters.rope_theta'=500000.0 and 'rope_theta'=10000.0 disagree"],
    ),
    (
        {
            "rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0},
            "rope_scaling": {"rope_type": "linear", "factor": 4.0},
        },
        {},
        ["fields 'rope_parameters' (linear) and 'rope_scaling' (linear) describe different RoPE"],
    ),
    (
        {
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
            "rope_scaling": {"rope_type": "dynamic", "factor": 4.0},
        },
        {},
        ["'rope_parameters' (default) and 'rope_scaling' (dynamic)"],
    ),
    (
        {"original_max_position_embeddings": 4096, "rope_scaling": LLAMA3},
        {},
        ["'rope_scaling.original_max_position_embeddings'=8192 and 'original_max_position_embeddings'=4096 disagree"],
    ),
    (
        {
            "rope_parameters": {
                "full_attention": dict(LLAMA3, rope_theta=5e5),
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            }
        },
        {},
        ["'rope_parameters' is keyed per layer type (full_attention, sliding_attention)", "one RoPE for every layer"],
    ),
    (
        {"rope_parameters": {"full_attention": {"rope_type": "default"}, "sliding_attention": None}},
        {},
        ["keyed per layer type"],
    ),
    ({"rope_parameters": "llama3"}, {}, ["field 'rope_parameters' must be a JSON object"]),
    ({"rope_scaling": {"rope_type": 3}}, {}, ["'rope_scaling.rope_type' must be a string"]),
    ({"partial_rotary_factor": 0.5}, {}, ["field 'partial_rotary_factor'=0.5", "rotates the whole head"]),
    (
        {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 1.5}},
        {"partial_rotary": True},
        ["'rope_parameters.partial_rotary_factor' must be a number > 0"],
    ),
    (
        {"partial_rotary_factor": 0.3},
        {"partial_rotary": True, "head_dim": 64},
        ["'partial_rotary_factor'=0.3 gives a rotary width of 19 channels of head_dim=64"],
    ),
    (
        {"partial_rotary_factor": 0.75, "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
        {"partial_rotary": True},
        ["'rope_parameters.partial_rotary_factor'=0.5 and 'partial_rotary_factor'=0.75 disagree"],
    ),
]


@pytest.mark.parametrize("config,kw,needles", REFUSALS, ids=[str(i) for i in range(len(REFUSALS))])
def test_refusals_name_the_field(config, kw, needles):
    kw = dict(dict(max_position_embeddings=131072, head_dim=128, source="config.json"), **kw)
    kw.setdefault("supported", SUPPORTED_ROPE_TYPES)
    with pytest.raises(ConfigError) as e:
        parse_rope(copy.deepcopy(config), **kw)
    msg = str(e.value)
    assert "\n" not in msg
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"


def test_default_source_prefix():
    with pytest.raises(ConfigError, match=r"^config: field 'rope_theta'"):
        parse_rope({"rope_theta": "x"}, max_position_embeddings=2048, head_dim=64)
