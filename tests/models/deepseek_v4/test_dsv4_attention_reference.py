"""models/deepseek_v4/reference_attention.py (the EngramDsv4Attention op's float64 reference)
tied to our torch DeepSeek-V4 attention layer (models/deepseek_v4/attention.py, itself
tied to transformers 5.25 in tests/models/deepseek_v4/test_deepseek_v4_attention.py).

Each layer type (CSA with the indexer dropping entries, HCA, sliding) runs three packed
steps over several slots: two prefills, then a chunked prefill continuing + a decode + a
fresh sequence on a slot full of garbage, then a decode of all three. The torch layer
runs the whole layer with its state; the graph's side of the node (projections, norms,
RoPE) is computed from the same layer's modules, the reference runs the node's core over
its own copy of the state, and the graph's tail (inverse RoPE, grouped output projection)
turns its output back into the layer's. Outputs and every state tensor must agree within
float32 round-off; every parameter is random.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engram_trt.models.deepseek_v4.reference_attention import (
    CSA as CSA_ID,
    HCA as HCA_ID,
    SLIDING as SLIDING_ID,
    dsv4_attention_reference_flat,
    select_entries,
)
from engram_trt.errors import EngramError
from engram_trt.models.deepseek_v4.attention import FP32_PARAMETERS, DeepseekV4Attention
from engram_trt.models.deepseek_v4.compressors import apply_rope, unweighted_rms_norm

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config  # noqa: E402

CSA, HCA, SWA = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
LAYERS = [CSA, HCA, SWA]
TYPE_ID = {CSA: CSA_ID, HCA: HCA_ID, SWA: SLIDING_ID}
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


def make_config(topk: int = 2, rope=None) -> DeepseekV4Config:
    return DeepseekV4Config(
        vocab_size=64,
        hidden_size=32,
        moe_intermediate_size=8,
        num_hidden_layers=3,
        num_attention_heads=4,
        head_dim=16,
        q_lora_rank=16,
        num_experts_per_tok=1,
        n_routed_experts=2,
        layer_types=list(LAYERS),
        mlp_layer_types=["moe"] * 3,
        compress_rates={CSA: 4, HCA: 8},
        hc_mult=2,
        sliding_window=6,
        o_groups=2,
        o_lora_rank=16,
        index_n_heads=8,
        index_head_dim=16,
        index_topk=topk,
        partial_rotary_factor=0.5,
        rope_parameters=rope,
        max_position_embeddings=256,
        attn_implementation="eager",
    )


def make_layer(config, idx: int, seed: int) -> tuple[DeepseekV4Attention, torch.Generator]:
    gen = torch.Generator().manual_seed(seed)
    layer = DeepseekV4Attention(config, idx).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return layer, gen


def new_state(config, idx: int, n_slots: int, max_len: int, dtype=torch.float32) -> dict[str, torch.Tensor]:
    shapes = DeepseekV4Attention.state_shapes(config, idx, max_len)
    return {k: torch.full((n_slots, *s), float("nan"), dtype=dtype) for k, (s, _) in shapes.items()}


def node_inputs(
    layer: DeepseekV4Attention,
    x: torch.Tensor,
    positions: torch.Tensor,
    starts,
    pasts,
    slots,
    state: dict[str, torch.Tensor],
) -> list:
    """What the graph feeds the node, from the layer's own modules (op input order)."""
    t, h, d = x.shape[0], layer.num_heads, layer.head_dim
    cos, sin = layer.rope(positions)
    q_res = layer.q_a_norm(layer.q_a_proj(x))
    q = apply_rope(
        unweighted_rms_norm(layer.q_b_proj(q_res).reshape(t, h, d), layer.eps), cos.unsqueeze(1), sin.unsqueeze(1)
    )
    kv = apply_rope(layer.kv_norm(layer.kv_proj(x)), cos, sin)
    i32 = lambda v: np.asarray(v, dtype=np.int32)  # noqa: E731
    inputs = [q, kv, layer.sinks, i32(starts), i32(pasts), i32(slots), state["window_kv"]]
    comp = layer.compressor
    if comp is not None:
        inputs += [
            comp.kv_proj(x),
            comp.gate_proj(x),
            comp.position_bias,
            comp.kv_norm.weight,
            layer.rope.inv_freq,
            state["compressed_kv"],
            state["compressor_kv"],
            state["compressor_gate"],
        ]
    if layer.layer_type == CSA:
        ix = comp.indexer
        iq, iw = ix.queries(q_res, x, cos, sin)
        inputs += [
            iq,
            iw,
            ix.kv_proj(x),
            ix.gate_proj(x),
            ix.position_bias,
            ix.kv_norm.weight,
            state["index_keys"],
            state["indexer_kv"],
            state["indexer_gate"],
        ]
    return inputs


def graph_tail(layer: DeepseekV4Attention, out: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    cos, sin = layer.rope(positions)
    out = apply_rope(out, cos.unsqueeze(1), -sin.unsqueeze(1))
    grouped = layer.o_a_proj(out.reshape(out.shape[0], layer.config.o_groups, -1)).flatten(1)
    return layer.o_b_proj(grouped)


def fields_of(layer: DeepseekV4Attention) -> dict:
    comp = layer.compressor
    return dict(
        layer_type=TYPE_ID[layer.layer_type],
        window=layer.window,
        compress_rate=comp.rate if comp is not None else 0,
        index_topk=layer.config.index_topk if layer.layer_type == CSA else 0,
        scaling=layer.scaling,
        eps=layer.eps,
        rope_scale=float(layer.rope.scale),
    )


def assert_no_tie_at_cut(layer, inputs, positions, starts) -> None:
    """The reference breaks ties low-index-first, torch's topk by its own rule: the data
    must have none at the cut for the comparison to be defined."""
    if layer.layer_type != CSA:
        return
    rate, k = layer.compressor.rate, layer.config.index_topk
    iq, iw = inputs[15].double(), inputs[16].double()
    keys = inputs[21]
    slots = inputs[5]
    for s in range(len(starts) - 1):
        for t in range(starts[s], starts[s + 1]):
            visible = (int(positions[t]) + 1) // rate
            if visible > k:
                sc = (torch.relu(iq[t] @ keys[int(slots[s]), :visible].double().t()) * iw[t, :, None]).sum(0)
                top = sc.sort(descending=True).values
                assert top[k - 1] != top[k], f"tied index scores at the top-{k} cut (token {t})"


def step(layer, ref_state, torch_state, chunks, dtype=torch.float32, rel=2e-5):
    """Run one packed step both ways; compare outputs and states."""
    xs = torch.cat([c[0] for c in chunks]).to(dtype)
    starts, positions = [0], []
    for x, past, _ in chunks:
        starts.append(starts[-1] + x.shape[0])
        positions.append(torch.arange(past, past + x.shape[0]))
    positions = torch.cat(positions)
    pasts, slots = [c[1] for c in chunks], [c[2] for c in chunks]
    with torch.no_grad():
        want = layer(xs, positions, starts, pasts, slots, torch_state)
        inputs = node_inputs(layer, xs, positions, starts, pasts, slots, ref_state)
        results = dsv4_attention_reference_flat(*inputs, **fields_of(layer))
        got = graph_tail(layer, torch.from_numpy(results[0].astype(np.float32)).to(dtype), positions)
    assert_no_tie_at_cut(layer, inputs, positions, starts)
    assert_rel(got, want, rel)
    names = [n for n in STATE_ORDER if n in ref_state]
    assert len(results) == 1 + len(names)
    for name, new in zip(names, results[1:]):
        new_t = torch.from_numpy(np.asarray(new, dtype=np.float32)).to(dtype)
        live = ~torch.isnan(torch_state[name].float())
        assert torch.equal(live, ~torch.isnan(new_t.float())), f"{name}: different rows written"
        assert_rel(new_t[live], torch_state[name][live], rel)
        ref_state[name] = new_t
    return got


def assert_rel(actual: torch.Tensor, expected: torch.Tensor, rel: float) -> None:
    err = (actual.double() - expected.double()).abs().max().item()
    scale = expected.double().abs().max().item()
    assert scale > 0 and err <= rel * scale, f"max error {err:.3e} against scale {scale:.3e}"


def three_steps(layer, gen, config, idx, dtype=torch.float32, rel=2e-5):
    d = config.hidden_size
    x = {slot: torch.randn(n, d, generator=gen) for slot, n in ((2, 30), (0, 7), (1, 12))}
    torch_state = new_state(config, idx, 4, 40, dtype)
    ref_state = {k: v.clone() for k, v in torch_state.items()}
    step(layer, ref_state, torch_state, [(x[2][:13], 0, 2), (x[0][:5], 0, 0)], dtype, rel)
    for st in (torch_state, ref_state):  # slot 1 holds a finished sequence's leftovers
        for t in st.values():
            t[1] = torch.randn(t[1].shape, generator=torch.Generator().manual_seed(5)) * 3
    step(layer, ref_state, torch_state, [(x[2][13:29], 13, 2), (x[0][5:6], 5, 0), (x[1][:11], 0, 1)], dtype, rel)
    step(layer, ref_state, torch_state, [(x[0][6:7], 6, 0), (x[1][11:12], 11, 1), (x[2][29:30], 29, 2)], dtype, rel)
    return torch_state


@pytest.mark.parametrize("rope", [None, YARN], ids=["default_rope", "yarn"])
@pytest.mark.parametrize("idx", [0, 1, 2], ids=LAYERS)
def test_reference_matches_torch_layer(idx, rope):
    config = make_config(rope=rope)
    layer, gen = make_layer(config, idx, 100 + idx)
    state = three_steps(layer, gen, config, idx)
    if idx == 0:  # the indexer did drop entries: slot 2 reached 30 tokens = 7 entries, top-2 kept
        assert state["compressed_kv"].shape[1] >= 7 and config.index_topk < 7


def test_bfloat16_state_and_activations():
    """bf16 activations and state, float32 parameters as published: the reference's
    roundings follow the torch layer's (loose: float32 vs float64 sums inside)."""
    config = make_config(topk=16)  # no drops: a near tie flipped by rounding order is legitimate
    for idx in range(3):
        layer, gen = make_layer(config, idx, 200 + idx)
        low = DeepseekV4Attention(config, idx).eval().to(torch.bfloat16)
        low.load_state_dict(layer.state_dict())
        for name, p in low.named_parameters():
            if name in FP32_PARAMETERS:
                p.data = layer.state_dict()[name].clone()
        three_steps(low, gen, config, idx, torch.bfloat16, 2e-2)


def test_select_entries_lower_index_wins_ties():
    keep = select_entries(np.array([0.0, 3.0, 0.0, 0.0, 3.0, 1.0]), 3)
    assert keep.tolist() == [False, True, False, False, True, True]
    keep = select_entries(np.array([0.0, 3.0, 0.0, 0.0, 3.0]), 3)
    assert keep.tolist() == [True, True, False, False, True]
    assert select_entries(np.array([-1.0, -2.0]), 5).all()


def test_bad_fields_and_shapes_are_refused():
    config = make_config()
    layer, gen = make_layer(config, 1, 7)
    x = torch.randn(3, config.hidden_size, generator=gen)
    state = new_state(config, 1, 2, 16)
    with torch.no_grad():
        inputs = node_inputs(layer, x, torch.arange(3), [0, 3], [0], [1], state)
    fields = fields_of(layer)
    cases = [
        (dict(fields, layer_type=3), "layer_type 3"),
        (dict(fields, compress_rate=0), "compress_rate 0"),
        (dict(fields, window=0), "window 0"),
        (dict(fields, scaling=0.0), "scaling 0.0"),
    ]
    for bad, text in cases:
        with pytest.raises(EngramError, match=text):
            dsv4_attention_reference_flat(*inputs, **bad)
    with pytest.raises(EngramError, match="takes 24 inputs"):
        dsv4_attention_reference_flat(*inputs, **dict(fields, layer_type=CSA_ID))
    long = [torch.randn(24, 4, 16), torch.randn(24, 16)] + inputs[2:]  # 24 // 8 = 3 entries, room for 2
    long[3], long[4], long[5] = np.array([0, 24], np.int32), np.array([0], np.int32), np.array([1], np.int32)
    long[7:9] = [torch.randn(24, 16), torch.randn(24, 16)]
    with pytest.raises(EngramError, match="reaches length 24"):
        dsv4_attention_reference_flat(*long, **fields)
    bad_slot = list(inputs)
    bad_slot[5] = np.array([2], np.int32)
    with pytest.raises(EngramError, match="slot 2 is outside"):
        dsv4_attention_reference_flat(*bad_slot, **fields)
