"""DeepSeek-V4's attention layer (models/deepseek_v4/attention.py, compressors.py).

Oracle 1 is transformers' own model: a tiny ``DeepseekV4Model`` (a CSA, an HCA and a
sliding layer) runs a prompt longer than the window and several compress windows, then
decode steps (and, separately, a chunked prefill) with its cache; hooks record what each
attention layer received and returned, and our layer, loaded strictly with that layer's
state_dict, must return the same over the packed step. Oracle 2 is the whole layer
written again from the formulas in float64, a loop per query (pooling, indexer top-k,
window, sinks, inverse rotation, grouped projection). Every parameter is random.
"""

from __future__ import annotations

import math

import pytest
import torch

from engram_trt.errors import ConfigError, EngramError
from engram_trt.models.deepseek_v4.attention import DeepseekV4Attention, rope_tables

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf  # noqa: E402
from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config  # noqa: E402

CSA, HCA, SWA = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
LAYERS = [CSA, HCA, SWA]
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 8, "beta_slow": 1}
CONFIGS = {  # 8 indexer heads by default: a score of exactly 0 (every head's relu 0) ties, see assert_no_tie_at_cut
    "csa4_hca8_w6": dict(),
    "csa2_hca4_w4_yarn": dict(
        hidden=48, heads=4, head_dim=16, factor=0.5, csa=2, hca=4, window=4, topk=3, index_heads=8, rope=YARN
    ),
}


def make_config(
    hidden=32,
    heads=2,
    head_dim=32,
    factor=0.25,
    csa=4,
    hca=8,
    window=6,
    topk=2,
    index_heads=8,
    rope=None,
    layer_types=LAYERS,
) -> DeepseekV4Config:
    return DeepseekV4Config(
        vocab_size=64,
        hidden_size=hidden,
        moe_intermediate_size=8,
        num_hidden_layers=len(layer_types),
        num_attention_heads=heads,
        head_dim=head_dim,
        q_lora_rank=16,
        num_experts_per_tok=1,
        n_routed_experts=2,
        layer_types=list(layer_types),
        mlp_layer_types=["moe"] * len(layer_types),
        compress_rates={CSA: csa, HCA: hca},
        hc_mult=2,
        sliding_window=window,
        o_groups=2,
        o_lora_rank=16,
        index_n_heads=index_heads,
        index_head_dim=16,
        index_topk=topk,
        partial_rotary_factor=factor,
        rope_parameters=rope,
        max_position_embeddings=256,
        attn_implementation="eager",
    )


def randomize(module: torch.nn.Module, gen: torch.Generator, scale: float = 0.3) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * scale)


def new_state(
    config, layer_idx: int, n_slots: int, max_len: int, fill: float = float("nan"), dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    shapes = DeepseekV4Attention.state_shapes(config, layer_idx, max_len)
    return {k: torch.full((n_slots, *shape), fill, dtype=dtype) for k, (shape, _) in shapes.items()}


def run(layer, state, chunks):
    """One packed step: chunks = [(x [n, D], past_len, slot)] -> output [T, D]."""
    xs = torch.cat([c[0] for c in chunks])
    starts, positions = [0], []
    for x, past, _ in chunks:
        starts.append(starts[-1] + x.shape[0])
        positions.append(torch.arange(past, past + x.shape[0]))
    with torch.no_grad():
        return layer(xs, torch.cat(positions), starts, [c[1] for c in chunks], [c[2] for c in chunks], state)


def assert_rel(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-5) -> None:
    err = (actual.double() - expected.double()).abs().max().item()
    scale = expected.double().abs().max().item()
    assert scale > 0 and err <= rel * scale, f"max error {err:.3e} against scale {scale:.3e}"


def hf_trace(config, gen, calls: list[int]):
    """transformers' model over successive calls of ``calls[i]`` tokens with one cache;
    returns the model, each attention layer's (input, output) per call, and the final
    hidden states of the cached run and of one no-cache forward over all tokens."""
    model = hf.DeepseekV4Model(config).eval()
    randomize(model, gen)
    records: dict[int, list] = {i: [] for i in range(config.num_hidden_layers)}

    def hook_for(i):
        def hook(_module, args, kwargs, out):
            hidden = args[0] if args else kwargs["hidden_states"]
            records[i].append((hidden[0].clone(), out[0][0].clone()))

        return hook

    handles = [model.layers[i].self_attn.register_forward_hook(hook_for(i), with_kwargs=True) for i in records]
    scores: list[torch.Tensor] = []  # the CSA indexer's raw scores [n, entries] per call
    for i, layer in enumerate(model.layers):
        if config.layer_types[i] == CSA:
            handles.append(
                layer.self_attn.compressor.indexer.scorer.register_forward_hook(
                    lambda _m, _a, out: scores.append(out[0].clone())
                )
            )
    ids = torch.randint(0, config.vocab_size, (1, sum(calls)), generator=gen)
    cached, cache, start = [], None, 0
    with torch.no_grad():
        for n in calls:
            out = model(input_ids=ids[:, start : start + n], cache=cache, use_cache=True)
            cache, start = out.cache, start + n
            cached.append(out.last_hidden_state)
        for h in handles:
            h.remove()
        whole = model(input_ids=ids, use_cache=False).last_hidden_state
    assert_no_tie_at_cut(config, scores, calls)
    return model, records, torch.cat(cached, dim=1), whole


def assert_no_tie_at_cut(config, scores, calls):
    """A comparison across different chunkings is well defined only where the indexer's
    top-k has no tie at its cut (ties are left to ``topk``, whose choice depends on the
    row length, in transformers as in ours): check that this data has none."""
    rate, k = config.compress_rates[CSA], config.index_topk
    start = 0
    for n, row in zip(calls, scores):
        for i in range(n):
            visible = (start + i + 1) // rate
            if visible > k:
                top = row[i, :visible].sort(descending=True).values
                assert top[k - 1] != top[k], f"tied index scores at the top-{k} cut for position {start + i}"
        start += n


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("calls", [[30] + [1] * 6, [13, 17, 1, 1]], ids=["prefill_decode", "chunked"])
def test_matches_transformers(name, calls):
    gen = torch.Generator().manual_seed(7 + len(name) + len(calls))
    config = make_config(**CONFIGS[name])
    model, records, cached, whole = hf_trace(config, gen, calls)
    # the published cache is exact: cached decode / chunked prefill == one full forward
    assert_rel(cached, whole, 1e-5)
    for i in range(config.num_hidden_layers):
        layer = DeepseekV4Attention(config, i).eval()
        layer.load_state_dict(model.layers[i].self_attn.state_dict(), strict=True)
        state = new_state(config, i, n_slots=3, max_len=40)
        past = 0
        for x, expected in records[i]:
            assert_rel(run(layer, state, [(x, past, 2)]), expected)
            past += x.shape[0]


def test_indexer_drops_entries():
    """The first config's CSA selection really drops entries (top-2 of up to 9)."""
    config = make_config()
    gen = torch.Generator().manual_seed(3)
    layer = DeepseekV4Attention(config, 0).eval()
    randomize(layer, gen)
    state = new_state(config, 0, 1, 40)
    x = torch.randn(36, config.hidden_size, generator=gen)
    base = run(layer, state, [(x, 0, 0)])
    layer.compressor.indexer.topk = 9  # keep every visible entry instead
    wide = run(layer, new_state(config, 0, 1, 40), [(x, 0, 0)])
    assert torch.equal(base[:8], wide[:8])  # positions < 8 see at most 2 entries
    assert (base[8:] - wide[8:]).abs().max() > 1e-3


def test_rope_tables_match_transformers():
    for rope in (None, YARN):
        config = make_config(head_dim=16, factor=0.5, rope=rope)
        rotary = hf.DeepseekV4RotaryEmbedding(config)
        positions = torch.randint(0, 4000, (9,))
        for layer_type, label in ((SWA, "main"), (CSA, "compress"), (HCA, "compress")):
            cos, sin = rope_tables(config, positions, layer_type)
            ref_cos, ref_sin = rotary(torch.zeros(1), positions.view(1, -1), layer_type=label)
            assert cos.shape == (9, 4) and cos.dtype == torch.float32
            torch.testing.assert_close(cos, ref_cos[0], rtol=0, atol=0)
            torch.testing.assert_close(sin, ref_sin[0], rtol=0, atol=0)


# ---- packed steps --------------------------------------------------------------


def assert_untied(layer, x, state, slot):
    """For a CSA layer that just ran x [L, D] from position 0 in ``slot``: no tie at
    any query's top-k cut (see assert_no_tie_at_cut), so any chunking selects alike."""
    if layer.layer_type != CSA:
        return
    ix, rate = layer.compressor.indexer, layer.compressor.rate
    with torch.no_grad():
        cos, sin = layer.rope(torch.arange(x.shape[0]))
        q, w = ix.queries(layer.q_a_norm(layer.q_a_proj(x)), x, cos, sin)
        keys = state["index_keys"][slot, : x.shape[0] // rate]
        scores = (torch.relu(torch.matmul(q, keys.t())) * ix.dim**-0.5 * w.unsqueeze(-1)).sum(1)
    assert_no_tie_at_cut(layer.config, [scores], [x.shape[0]])


def _layer(config, idx, seed):
    gen = torch.Generator().manual_seed(seed)
    layer = DeepseekV4Attention(config, idx).eval()
    randomize(layer, gen)
    return layer, gen


@pytest.mark.parametrize("idx", [0, 1, 2], ids=LAYERS)
def test_chunked_prefill_equals_whole(idx):
    config = make_config()
    layer, gen = _layer(config, idx, 11 + idx)
    x = torch.randn(37, config.hidden_size, generator=gen)
    whole_state = new_state(config, idx, 2, 40)
    whole = run(layer, whole_state, [(x, 0, 1)])
    assert_untied(layer, x, whole_state, 1)
    state = new_state(config, idx, 2, 40)
    outs, past = [], 0
    for n in (5, 1, 3, 11, 1, 1, 8, 7):  # chunks cross windows and compress blocks anywhere
        outs.append(run(layer, state, [(x[past : past + n], past, 1)]))
        past += n
    assert_rel(torch.cat(outs), whole, 1e-5)


@pytest.mark.parametrize("idx", [0, 1, 2], ids=LAYERS)
def test_packed_step_equals_each_alone(idx):
    config = make_config()
    layer, gen = _layer(config, idx, 21 + idx)
    d = config.hidden_size
    prompts = {slot: torch.randn(n, d, generator=gen) for slot, n in ((4, 17), (0, 9))}
    # alone: each sequence in its own state
    alone = {}
    for slot, p in prompts.items():
        st = new_state(config, idx, 5, 48)
        run(layer, st, [(p, 0, slot)])
        alone[slot] = st
    # packed: the same two prompts in one state, then a step mixing decode, a prefill
    # chunk and a fresh sequence whose slot holds garbage
    packed = new_state(config, idx, 5, 48)
    run(layer, packed, [(prompts[4], 0, 4), (prompts[0], 0, 0)])
    for t in packed.values():
        t[2] = torch.randn(t[2].shape, generator=gen) * 5  # stale content of a reused slot
    dec, chunk, fresh = (torch.randn(n, d, generator=gen) for n in (1, 6, 10))
    out = run(layer, packed, [(chunk, 9, 0), (fresh, 0, 2), (dec, 17, 4)])
    want_chunk = run(layer, alone[0], [(chunk, 9, 0)])
    want_dec = run(layer, alone[4], [(dec, 17, 4)])
    fresh_state = new_state(config, idx, 1, 48)
    want_fresh = run(layer, fresh_state, [(fresh, 0, 0)])
    for slot, p in prompts.items():
        assert_untied(layer, p, alone[slot], slot)
    assert_rel(out[:6], want_chunk)
    assert_rel(out[6:16], want_fresh)
    assert_rel(out[16:], want_dec)
    # and the state each sequence left behind continues the same way
    nxt = torch.randn(2, d, generator=gen)
    assert_rel(run(layer, packed, [(nxt[:1], 15, 0)]), run(layer, alone[0], [(nxt[:1], 15, 0)]))


def test_bad_input_is_refused():
    config = make_config()
    layer, gen = _layer(config, 0, 5)
    x = torch.randn(12, config.hidden_size, generator=gen)
    with pytest.raises(EngramError, match="max_len"):
        run(layer, new_state(config, 0, 1, 8), [(x, 0, 0)])  # 12 tokens emit 3 entries; max_len 8 holds 2
    with pytest.raises(EngramError, match="state_shapes"):
        layer(x, torch.arange(12), [0, 12], [0], [0], {"window_kv": torch.zeros(1, 6, 32)})
    with pytest.raises(EngramError, match="repeat"):
        run(layer, new_state(config, 0, 2, 40), [(x[:4], 0, 1), (x[4:], 0, 1)])
    bad = make_config()
    bad.o_groups = 3
    with pytest.raises(ConfigError, match="o_groups"):
        DeepseekV4Attention(bad, 0)
    bad = make_config()
    bad.layer_types = ["full_attention", HCA, SWA]
    with pytest.raises(ConfigError, match="layer_types"):
        DeepseekV4Attention(bad, 0)


# ---- float64 reference, from the formulas ------------------------------------------


def _rms(v, w=None, eps=1e-6):
    out = v / math.sqrt(float((v * v).mean()) + eps)
    return out if w is None else out * w


def _rot(v, cos, sin):
    """Interleaved rotation of the trailing 2 * len(cos) channels of v [d]: pair i by
    the angle whose cosine / sine are cos[i] / sin[i]."""
    v = v.clone()
    off = v.shape[-1] - 2 * cos.shape[-1]
    for i in range(cos.shape[-1]):
        c, s = float(cos[i]), float(sin[i])
        a, b = v[off + 2 * i].item(), v[off + 2 * i + 1].item()
        v[off + 2 * i], v[off + 2 * i + 1] = a * c - b * s, b * c + a * s
    return v


def _pool(kv, gate, bias, r, d, overlap, norm_w, cos, sin, eps):
    """Every complete window's entry from per-token projections kv, gate [L, width]."""
    entries = []
    for w in range(kv.shape[0] // r):
        vals, logits = [], []
        if overlap and w >= 1:
            for j in range((w - 1) * r, w * r):
                vals.append(kv[j, :d])
                logits.append(gate[j, :d] + bias[j - (w - 1) * r, :d])
        for j in range(w * r, (w + 1) * r):
            vals.append(kv[j, -d:])
            logits.append(gate[j, -d:] + bias[j - w * r, -d:])
        vals, logits = torch.stack(vals), torch.stack(logits)
        weights = torch.exp(logits - logits.max(0).values)
        weights = weights / weights.sum(0)
        entries.append(_rot(_rms((weights * vals).sum(0), norm_w, eps), cos[w * r], sin[w * r]))
    return torch.stack(entries) if entries else kv.new_zeros(0, d)


def reference_layer(layer, x):
    """The whole layer over one sequence x [L, hidden] at positions 0.., float64. The
    angles are the float32 table's (checked against transformers bit for bit above),
    so the comparison can be held at 1e-10."""
    cfg = layer.config
    sd = {k: v.double() for k, v in layer.state_dict().items()}
    h, d, W, eps = cfg.num_attention_heads, cfg.head_dim, cfg.sliding_window, cfg.rms_norm_eps
    x = x.double()
    L = x.shape[0]
    cos, sin = (t.double() for t in rope_tables(cfg, torch.arange(L), layer.layer_type))
    q_res = [_rms(x[t] @ sd["q_a_proj.weight"].T, sd["q_a_norm.weight"], eps) for t in range(L)]
    kv = torch.stack(
        [_rot(_rms(x[t] @ sd["kv_proj.weight"].T, sd["kv_norm.weight"], eps), cos[t], sin[t]) for t in range(L)]
    )
    entries, selected = None, None
    if layer.layer_type != SWA:
        r = cfg.compress_rates[layer.layer_type]
        ov = layer.layer_type == CSA
        entries = _pool(
            x @ sd["compressor.kv_proj.weight"].T,
            x @ sd["compressor.gate_proj.weight"].T,
            sd["compressor.position_bias"],
            r,
            d,
            ov,
            sd["compressor.kv_norm.weight"],
            cos,
            sin,
            eps,
        )
        if ov:
            p = "compressor.indexer."
            di, hi = cfg.index_head_dim, cfg.index_n_heads
            keys = _pool(
                x @ sd[p + "kv_proj.weight"].T,
                x @ sd[p + "gate_proj.weight"].T,
                sd[p + "position_bias"],
                r,
                di,
                True,
                sd[p + "kv_norm.weight"],
                cos,
                sin,
                eps,
            )
            selected = []
            for t in range(L):
                qi = (q_res[t] @ sd[p + "q_b_proj.weight"].T).reshape(hi, di)
                qi = torch.stack([_rot(qi[j], cos[t], sin[t]) for j in range(hi)])
                wts = (x[t] @ sd[p + "scorer.weights_proj.weight"].T) / math.sqrt(hi)
                visible = (t + 1) // r
                score = [
                    sum(wts[j] * max(float(qi[j] @ keys[e]), 0.0) / math.sqrt(di) for j in range(hi))
                    for e in range(visible)
                ]
                order = sorted(range(visible), key=lambda e: -score[e])
                k = min(cfg.index_topk, visible)
                if k < visible:  # ties are left to topk: the reference needs data without one at the cut
                    assert score[order[k - 1]] - score[order[k]] > 1e-9, f"tied index scores at position {t}"
                selected.append(sorted(order[:k]))
    outs = []
    for t in range(L):
        q = (q_res[t] @ sd["q_b_proj.weight"].T).reshape(h, d)
        rows = [kv[j] for j in range(max(0, t - W + 1), t + 1)]
        if entries is not None:
            r = cfg.compress_rates[layer.layer_type]
            chosen = selected[t] if selected is not None else range((t + 1) // r)
            rows += [entries[e] for e in chosen]
        rows = torch.stack(rows)
        heads = []
        for j in range(h):
            qj = _rot(_rms(q[j], None, eps), cos[t], sin[t])
            logits = rows @ qj / math.sqrt(d)
            m = max(float(logits.max()), float(sd["sinks"][j]))
            e = torch.exp(logits - m)
            prob = e / (e.sum() + math.exp(float(sd["sinks"][j]) - m))
            heads.append(_rot(prob @ rows, cos[t], -sin[t]))
        o = torch.cat(heads).reshape(cfg.o_groups, -1)
        wa = sd["o_a_proj.weight"].reshape(cfg.o_groups, cfg.o_lora_rank, -1)
        mid = torch.cat([wa[g] @ o[g] for g in range(cfg.o_groups)])
        outs.append(sd["o_b_proj.weight"] @ mid)
    return torch.stack(outs)


@pytest.mark.parametrize("idx", [0, 1, 2], ids=LAYERS)
def test_matches_float64_formulas(idx):
    config = make_config(hca=4, topk=2)
    layer, gen = _layer(config, idx, 31 + idx)
    layer = layer.double()
    x = torch.randn(26, config.hidden_size, generator=gen, dtype=torch.float64)
    want = reference_layer(layer, x)
    state = new_state(config, idx, 2, 32, dtype=torch.float64)
    outs, past = [], 0
    for n in (11, 1, 9, 1, 1, 3):
        outs.append(run(layer, state, [(x[past : past + n], past, 1)]))
        past += n
    assert_rel(torch.cat(outs), want, 1e-10)


def test_bfloat16_with_float32_parameters():
    """Served in bfloat16 with the published float32 parameters kept (FP32_PARAMETERS) and
    a bfloat16 state, over a chunked prefill, the layer stays within bfloat16 rounding of
    the float32 one. The indexer keeps every entry here (index_topk 16): a near tie that
    bfloat16 rounding flips would change the selection, legitimately."""
    from engram_trt.models.deepseek_v4.attention import FP32_PARAMETERS

    config = make_config(topk=16)
    for idx in range(3):
        layer, gen = _layer(config, idx, 41 + idx)
        x = torch.randn(30, config.hidden_size, generator=gen)
        want = run(layer, new_state(config, idx, 1, 40), [(x, 0, 0)])
        low = DeepseekV4Attention(config, idx).eval().to(torch.bfloat16)
        low.load_state_dict(layer.state_dict())
        with torch.no_grad():
            for name, p in low.named_parameters():
                if name in FP32_PARAMETERS:
                    p.data = layer.state_dict()[name].clone()
        assert all(p.dtype == torch.float32 for n, p in low.named_parameters() if n in FP32_PARAMETERS)
        state = new_state(config, idx, 1, 40, dtype=torch.bfloat16)
        got = torch.cat([run(low, state, [(x[:19].bfloat16(), 0, 0)]), run(low, state, [(x[19:].bfloat16(), 19, 0)])])
        assert got.dtype == torch.bfloat16
        assert_rel(got.float(), want, 3e-2)
