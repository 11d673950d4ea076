"""models/qwen4_exp/reference_qsa.py (the float64 NumPy reference of EngramQsaAttention) against the
torch layer models/qwen4_exp/attention.GatedAttention with every parameter random.

The layer's core (its output before ``* sigmoid(gate)`` and ``o_proj``) is recovered from
the real ``forward`` (o_proj swapped for the identity, the gate divided out) over packed
steps that write into the same slot caches: two prompts, a chunked prefill continuing one
of them beside a fresh short prompt and a decode, then a decode of three slots. Configs
where queries see more blocks than ``block_topk`` (the test asserts blocks are really
dropped) and where they never do. The per-query selection itself is compared to
``QSAIndexer.selection_mask``; every torch comparison asserts its inputs have no score tie
at the top-k boundary (torch's CPU top-k breaks ties its own way; the op's rule, lower
block index wins, is tested on the reference alone).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from engram_trt.models.qwen4_exp import reference_qsa as ref
from engram_trt.errors import EngramError
from engram_trt.models.qwen4_exp import attention as att

NUM_SLOTS = 5
MAX_LEN = 48


def make_config(**overrides) -> SimpleNamespace:
    fields = dict(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        indexer_n_heads=4,
        indexer_kv_heads=1,
        indexer_head_dim=16,
        indexer_budget=8,
        indexer_compress_ratio=4,
        attention_bias=False,
    )
    fields.update(overrides)
    return SimpleNamespace(**fields)


def random_layer(cfg: SimpleNamespace, seed: int) -> att.GatedAttention:
    gen = torch.Generator().manual_seed(seed)
    layer = att.GatedAttention(cfg, 0).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return layer


def fields_of(cfg: SimpleNamespace) -> dict:
    return dict(
        compress_ratio=cfg.indexer_compress_ratio,
        block_topk=cfg.indexer_budget // cfg.indexer_compress_ratio,
        rot_dim=att.rotary_dim(cfg),
        rope_theta=cfg.rope_parameters["rope_theta"],
        eps=cfg.rms_norm_eps,
        scaling=cfg.head_dim**-0.5,
    )


@torch.no_grad()
def projections(layer: att.GatedAttention, x: torch.Tensor, positions: torch.Tensor) -> dict[str, torch.Tensor]:
    """The op's inputs as GatedAttention.forward makes them (q / k normed and rotated,
    the indexer's rotated queries and raw keys) and the output gate."""
    t = x.shape[0]
    h, kvh, hd = layer.num_heads, layer.num_kv_heads, layer.head_dim
    cos, sin = att.rope_cos_sin(layer.config, positions)
    query, gate = layer.q_proj(x).reshape(t, h, 2 * hd).chunk(2, dim=-1)
    q = att.apply_partial_rope(layer.q_norm(query), cos, sin)
    k = att.apply_partial_rope(layer.k_norm(layer.k_proj(x).reshape(t, kvh, hd)), cos, sin)
    v = layer.v_proj(x).reshape(t, kvh, hd)
    iq, iraw = layer.indexer.project(x, cos, sin)
    return dict(q=q, k=k, v=v, index_q=iq, index_raw=iraw, gate=gate.reshape(t, h * hd))


@torch.no_grad()
def torch_core(layer: att.GatedAttention, x, positions, seq_starts, past_lens, slots, caches) -> torch.Tensor:
    """GatedAttention.forward's attention output before the gate (o_proj as identity)."""
    o_proj = layer.o_proj
    layer.o_proj = nn.Identity()
    try:
        gated = layer.forward(x, positions, seq_starts, past_lens, slots, *caches)
    finally:
        layer.o_proj = o_proj
    return gated / torch.sigmoid(projections(layer, x, positions)["gate"])


def packed(steps: list[tuple[int, int, int]]) -> tuple[list[int], list[int], list[int], np.ndarray, np.ndarray]:
    """(slot, past_len, n_new) per sequence -> seq_starts, past_lens, slots, token_slot, token_pos."""
    starts, past, slots, tslot, tpos = [0], [], [], [], []
    for slot, p, n in steps:
        starts.append(starts[-1] + n)
        past.append(p)
        slots.append(slot)
        tslot += [slot] * n
        tpos += list(range(p, p + n))
    return starts, past, slots, np.asarray(tslot, np.int32), np.asarray(tpos, np.int32)


STEPS = [
    [(3, 0, 13), (0, 0, 21)],  # two prompts; slot 0 sees up to 5 blocks
    [(0, 21, 9), (1, 0, 6), (3, 13, 1)],  # a chunk continuing, a fresh short prompt, a decode
    [(0, 30, 1), (1, 6, 1), (3, 14, 1)],  # decode of three slots
]


def boundary_margin(fields: dict, raw: np.ndarray, iq: np.ndarray, w: np.ndarray, pos: int) -> float:
    """The gap between the k-th and (k+1)-th best block scores of a query (inf: no top-k)."""
    f = ref.QsaFields(**fields)
    nb = (pos + 1) // f.compress_ratio
    if nb <= f.block_topk:
        return float("inf")
    scores = np.sort(ref.block_scores(iq, ref.block_keys(raw[: pos + 1], w, f, np.dtype(np.float32))))[::-1]
    return float(scores[f.block_topk - 1] - scores[f.block_topk])


@pytest.mark.parametrize("budget,expect_drop", [(8, True), (4, True), (64, False)])
def test_reference_matches_gated_attention_core(budget, expect_drop):
    cfg = make_config(indexer_budget=budget)
    layer = random_layer(cfg, seed=budget)
    fields = fields_of(cfg)
    gen = torch.Generator().manual_seed(100 + budget)
    kvh, hd, di = cfg.num_key_value_heads, cfg.head_dim, cfg.indexer_head_dim
    caches = (
        torch.zeros(NUM_SLOTS, kvh, MAX_LEN, hd),
        torch.zeros(NUM_SLOTS, kvh, MAX_LEN, hd),
        torch.zeros(NUM_SLOTS, MAX_LEN, di),
    )
    # The reference carries its own caches: stale random contents a fresh sequence must ignore.
    np_caches = tuple(np.random.default_rng(7).standard_normal(c.shape).astype(np.float32) for c in caches)
    with torch.no_grad():
        for c, n in zip(caches, np_caches):
            c.copy_(torch.from_numpy(n))
    w = layer.indexer.k_layernorm.weight.detach().numpy()
    dropped = 0
    for step in STEPS:
        seq_starts, past_lens, slots, tslot, tpos = packed(step)
        x = torch.randn(seq_starts[-1], cfg.hidden_size, generator=gen)
        positions = torch.from_numpy(tpos.astype(np.int64))
        pr = projections(layer, x, positions)
        expected = torch_core(layer, x, positions, seq_starts, past_lens, slots, caches).numpy()
        out, *np_caches = ref.qsa_attention_reference(
            pr["q"].numpy(),
            pr["k"].numpy(),
            pr["v"].numpy(),
            pr["index_q"].numpy(),
            pr["index_raw"].numpy(),
            *np_caches,
            w,
            tslot,
            tpos,
            **fields,
        )
        for got, want in zip(np_caches, caches):  # every written position equals the layer's cache
            for s, p in zip(tslot, tpos):
                np.testing.assert_array_equal(
                    got[s, ..., p, :] if got.ndim == 4 else got[s, p],
                    (want[s, :, p] if want.dim() == 4 else want[s, p]).numpy(),
                )
        for t, (s, p) in enumerate(zip(tslot, tpos)):
            raw = np_caches[2][s].astype(np.float64)
            iq = pr["index_q"][t].double().numpy()
            assert boundary_margin(fields, raw, iq, w, int(p)) > 1e-4, "a top-k boundary tie: pick another seed"
            dropped += int(
                not ref.visible_positions(int(p), raw, iq, w, ref.QsaFields(**fields), np.dtype(np.float32)).all()
            )
        scale = np.abs(expected).max()
        assert scale > 0.05
        np.testing.assert_allclose(out, expected, rtol=0, atol=2e-5 * scale)
    assert (dropped > 0) == expect_drop, dropped


@pytest.mark.parametrize("budget", [4, 8])
@torch.no_grad()
def test_selection_equals_selection_mask(budget):
    """Per query, the reference's visible positions = QSAIndexer.selection_mask's row."""
    cfg = make_config(indexer_budget=budget)
    layer = random_layer(cfg, seed=11 + budget)
    fields = fields_of(cfg)
    w = layer.indexer.k_layernorm.weight.numpy()
    gen = torch.Generator().manual_seed(5)
    L, past = 37, 20
    x = torch.randn(L, cfg.hidden_size, generator=gen)
    iq, raw = layer.indexer.project(x, *att.rope_cos_sin(cfg, torch.arange(L)))
    blocks = layer.indexer.block_keys(cfg, raw)
    mask = layer.indexer.selection_mask(iq[past:], blocks, past, L).numpy()
    f = ref.QsaFields(**fields)
    n_dropped = 0
    for i in range(L - past):
        p = past + i
        assert boundary_margin(fields, raw.double().numpy(), iq[p].double().numpy(), w, p) > 1e-4
        vis = ref.visible_positions(p, raw.double().numpy(), iq[p].double().numpy(), w, f, np.dtype(np.float32))
        np.testing.assert_array_equal(vis, mask[i, : p + 1])
        assert not mask[i, p + 1 :].any()
        n_dropped += int((~vis).sum())
    assert n_dropped > 0


def test_ties_go_to_the_lower_block():
    np.testing.assert_array_equal(
        ref.select_blocks(np.array([1.0, 3.0, 3.0, 0.0, 3.0]), 2), [False, True, True, False, False]
    )
    np.testing.assert_array_equal(ref.select_blocks(np.array([0.0, 0.0, 0.5, 0.0]), 2), [True, False, True, False])
    np.testing.assert_array_equal(ref.select_blocks(np.array([2.0, 1.0]), 1), [True, False])
    # All indexer queries zero: every score ties at 0, the first block_topk blocks are kept.
    cfg = make_config()
    f = ref.QsaFields(**fields_of(cfg))
    raw = np.random.default_rng(0).standard_normal((30, 16))
    vis = ref.visible_positions(29, raw, np.zeros((4, 16)), np.zeros(16), f, None)
    want = np.zeros(30, bool)
    want[:8] = True  # blocks 0 and 1
    want[28:] = True  # the tail after block 6
    np.testing.assert_array_equal(vis, want)


def test_out_of_range_tokens_write_nothing_and_get_zeros():
    rng = np.random.default_rng(1)
    T, H, kvh, hd, di = 3, 2, 1, 8, 8
    kc = rng.standard_normal((2, kvh, 6, hd)).astype(np.float32)
    vc, ikc = kc.copy(), rng.standard_normal((2, 6, di)).astype(np.float32)
    args = [
        rng.standard_normal(s).astype(np.float32) for s in ((T, H, hd), (T, kvh, hd), (T, kvh, hd), (T, 2, di), (T, di))
    ]
    out, kc2, vc2, ikc2 = ref.qsa_attention_reference(
        *args,
        kc,
        vc,
        ikc,
        np.zeros(di, np.float32),
        np.array([0, 2, 1], np.int32),
        np.array([0, 0, 6], np.int32),
        compress_ratio=2,
        block_topk=1,
        rot_dim=4,
        rope_theta=1e4,
        eps=1e-6,
        scaling=hd**-0.5,
    )
    assert np.abs(out[1:]).max() == 0 and np.abs(out[0]).max() > 0
    np.testing.assert_array_equal(kc2[1], kc[1])
    np.testing.assert_array_equal(kc2[0, :, 1:], kc[0, :, 1:])
    np.testing.assert_array_equal(kc2[0, :, 0], args[1][0])
    assert kc is not kc2 and not np.shares_memory(kc, kc2)


@pytest.mark.parametrize(
    "change,needle",
    [
        (dict(compress_ratio=0), "compress_ratio"),
        (dict(block_topk=0), "block_topk"),
        (dict(rot_dim=3), "rot_dim"),
        (dict(rot_dim=10), "rot_dim"),
        (dict(scaling=0.0), "scaling"),
        (dict(rope_theta=-1.0), "rope_theta"),
        (dict(index_raw_dim=4), "index_raw"),
        (dict(kv_heads=3), "key heads"),
    ],
)
def test_bad_inputs_refused_in_one_line(change, needle):
    rng = np.random.default_rng(2)
    T, H, hd, di = 2, 4, 8, 8
    kvh = change.pop("kv_heads", 2)
    raw_dim = change.pop("index_raw_dim", di)
    f = dict(compress_ratio=2, block_topk=1, rot_dim=4, rope_theta=1e4, eps=1e-6, scaling=0.3)
    f.update(change)
    with pytest.raises(EngramError) as err:
        ref.qsa_attention_reference(
            rng.standard_normal((T, H, hd)),
            rng.standard_normal((T, kvh, hd)),
            rng.standard_normal((T, kvh, hd)),
            rng.standard_normal((T, 2, di)),
            rng.standard_normal((T, raw_dim)),
            np.zeros((2, kvh, 4, hd)),
            np.zeros((2, kvh, 4, hd)),
            np.zeros((2, 4, di)),
            np.zeros(di),
            [0, 1],
            [0, 0],
            **f,
        )
    assert needle in str(err.value) and "\n" not in str(err.value)
