"""The Qwen4-Exp PLE n-gram hash (engram_trt.engram.ple_hash) against transformers 5.25.0.

transformers' ``Qwen4ExpTextNGramEmbedding`` is the reference: its buffers (multipliers,
primes, offsets) and its embedding's row count must equal the layout's, and the row ids
it feeds its embedding (captured by a forward hook on ``ngram_embedding``) must equal
ours bit for bit, for random ids with EOS runs (single, consecutive, at the start, at the
end, at chunk boundaries), whole sequences and the same sequences cut into prefill chunks
and decode steps (our contexts from ``next_context``; transformers' from its own cache
logic, through a cache stand-in that keeps the last N-1 ids as its conv state does).
"""

from __future__ import annotations

import dataclasses
import time
import types

import numpy as np
import pytest

from engram_trt.engram import ple_hash as ph
from engram_trt.engram.layout import is_prime
from engram_trt.errors import ConfigError, EngramError

torch = pytest.importorskip("torch")
qmod = pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")

# (vocab, ngram_size, heads_per_ngram, base, divisor, seed, eos, num_layers)
CONFIGS = [
    (97, 2, 1, 50, 16, 1234, 96, 3),
    (1000, 3, 2, 200, 128, -3, 0, 4),
    (300, 4, 3, 1000, 7, 99, 151, 3),
    (5000, 3, 8, 20_000, 128, 1234, 4321, 2),
]


def make_layout(cfg) -> ph.PLEHashLayout:
    vocab, n, hpn, base, div, seed, eos, L = cfg
    return ph.PLEHashLayout.from_config(
        vocab_size=vocab,
        ngram_size=n,
        heads_per_ngram=hpn,
        ngram_vocab_size_base=base,
        make_ngram_vocab_size_divisible_by=div,
        seed=seed,
        eos_token_id=eos,
        num_layers=L,
    )


def hf_module(cfg, layer: int):
    """transformers' module for PLE layer ``layer`` and the list its hook fills."""
    vocab, n, hpn, base, div, seed, eos, _ = cfg
    config = types.SimpleNamespace(
        ngram_size=n,
        heads_per_ngram=hpn,
        vocab_size=vocab,
        ngram_vocab_size_base=base,
        seed=seed,
        eos_token_id=[eos],
        make_ngram_vocab_size_divisible_by=div,
    )
    H = (n - 1) * hpn
    module = qmod.Qwen4ExpTextNGramEmbedding(config, 2 * H, layer_idx=layer, ple_layer_index=layer)
    captured: list = []
    module.ngram_embedding.register_forward_hook(lambda mod, args, out: captured.append(args[0].clone()))
    return module, captured


class ConvStateCache:
    """The two calls of transformers' cache the n-gram module makes, keeping the last
    ``conv_kernel_size`` ids per layer (what a linear-attention layer's conv state keeps)."""

    def __init__(self) -> None:
        self.states: dict = {}

    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        return self.states.get((layer_idx, state_idx))

    def update_conv_state(self, x, layer_idx: int, state_idx: int = 0, conv_kernel_size: int = 1, **_):
        old = self.states.get((layer_idx, state_idx))
        joined = x if old is None else torch.cat([old, x], dim=-1)
        self.states[(layer_idx, state_idx)] = joined[..., -conv_kernel_size:].clone()
        return joined


def random_ids(rng, vocab: int, eos: int, length: int) -> np.ndarray:
    """Ids with EOS at the start, the end, alone and in runs of 2-4."""
    ids = rng.integers(0, vocab, size=length, dtype=np.int64)
    ids[ids == eos] = (eos + 1) % vocab  # EOS only where placed below
    if length == 0:
        return ids
    ids[0] = eos
    ids[-1] = eos
    for _ in range(max(1, length // 12)):
        at = int(rng.integers(0, length))
        ids[at : at + int(rng.integers(1, 5))] = eos
    return ids


def hf_ids(cfg, layer: int, sequences: list[np.ndarray]) -> list[np.ndarray]:
    """transformers' row ids for each whole sequence (one call per sequence: each its own
    fresh history)."""
    module, captured = hf_module(cfg, layer)
    out = []
    with torch.no_grad():
        for seq in sequences:
            captured.clear()
            module(torch.from_numpy(seq[None, :]), None)
            out.append(captured[0][0].numpy())
    return out


@pytest.mark.parametrize("cfg", CONFIGS, ids=[f"N{c[1]}-h{c[2]}" for c in CONFIGS])
def test_layout_equals_module_buffers(cfg) -> None:
    layout = make_layout(cfg)
    vocab, n, hpn, base, div, seed, eos, L = cfg
    H = (n - 1) * hpn
    assert layout.num_heads == H and layout.multipliers.shape == (L, n) and layout.head_vocab_sizes.shape == (L, H)
    for li in range(L):
        module, _ = hf_module(cfg, li)
        assert module.layer_multipliers.tolist() == layout.multipliers[li].tolist()
        assert module.ngram_heads_vocab_sizes.tolist() == layout.head_vocab_sizes[li].tolist()
        assert module.ngram_heads_offsets.tolist() == layout.head_offsets[li].tolist()
        assert tuple(module.ngram_embedding.weight.shape) == (int(layout.table_rows[li]), 2)
        assert layout.table_rows[li] % div == 0 and layout.table_rows[li] >= layout.head_vocab_sizes[li].sum()
    primes = layout.head_vocab_sizes.reshape(-1)
    assert primes[0] >= base and np.all(np.diff(primes) > 0)
    # successive primes: none skipped between them
    assert all(is_prime(int(p)) for p in primes)
    assert not any(is_prime(v) for v in range(base, int(primes[-1])) if v not in set(primes.tolist()))


@pytest.mark.parametrize("cfg", CONFIGS, ids=[f"N{c[1]}-h{c[2]}" for c in CONFIGS])
def test_whole_sequences_equal_transformers(cfg) -> None:
    rng = np.random.default_rng(abs(hash(cfg)) % 2**32)
    layout = make_layout(cfg)
    vocab, n, *_, eos, L = cfg
    seqs = [random_ids(rng, vocab, eos, length) for length in (1, 2, n, 37, 64)]
    seqs.append(np.full(5, eos, dtype=np.int64))  # only EOS
    ids = np.concatenate(seqs)
    starts = np.concatenate([[0], np.cumsum([s.size for s in seqs])])
    context = ph.fresh_context(len(seqs), layout)
    all_layers = ph.ple_hash_all_layers(ids, starts, context, layout)
    assert all_layers.dtype == np.int64 and all_layers.shape == (ids.size, L, layout.num_heads)
    for li in range(L):
        want = np.concatenate(hf_ids(cfg, li, seqs))
        got = ph.ple_hash_packed(ids, starts, context, layout, li)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(all_layers[:, li], want)
        assert np.all(got < layout.table_rows[li]) and np.all(got >= 0)
        # the torch path: same ids, as a tensor
        got_t = ph.ple_hash_packed(
            torch.from_numpy(ids), torch.from_numpy(starts), torch.from_numpy(context), layout, li
        )
        assert isinstance(got_t, torch.Tensor) and got_t.dtype == torch.int64
        np.testing.assert_array_equal(got_t.numpy(), want)
    # the hash must see the EOS: the same ids without EOS runs hash differently somewhere
    no_eos = ids.copy()
    no_eos[no_eos == eos] = (eos + 1) % vocab
    assert not np.array_equal(
        ph.ple_hash_packed(no_eos, starts, context, layout, 0), ph.ple_hash_packed(ids, starts, context, layout, 0)
    )


@pytest.mark.parametrize("cfg", CONFIGS[:3], ids=[f"N{c[1]}-h{c[2]}" for c in CONFIGS[:3]])
def test_chunks_and_decode_steps_equal_whole(cfg) -> None:
    """Three sequences cut into prefill chunks (one cut right after an EOS, one right
    before) and decode steps, hashed as packed steps that mix the sequences' phases; the
    contexts come from next_context. Equal to the whole sequences, and to transformers
    fed the same chunks through its cache path."""
    rng = np.random.default_rng(7 + cfg[1])
    layout = make_layout(cfg)
    vocab, n, *_, eos, L = cfg
    seqs = [random_ids(rng, vocab, eos, length) for length in (40, 23, 31)]
    seqs[0][9] = eos  # a chunk ends on an EOS (cut at 10)
    seqs[1][5] = eos  # a chunk starts on an EOS (cut at 5)
    cuts = [[0, 1, 10, 25, 40], [0, 5, 6, 7, 23], [0, 2, 31]]
    cuts = [c[:-1] + list(range(c[-2] + 1, c[-1])) + [c[-1]] if i == 2 else c for i, c in enumerate(cuts)]
    chunks = [[s[a:b] for a, b in zip(c[:-1], c[1:])] for s, c in zip(seqs, cuts)]
    layer = L - 1
    whole = [ph.ple_hash_packed(s, [0, s.size], ph.fresh_context(1, layout), layout, layer) for s in seqs]
    got: list[list[np.ndarray]] = [[] for _ in seqs]
    contexts = ph.fresh_context(len(seqs), layout)
    step = 0
    while any(step < len(c) for c in chunks):
        live = [i for i, c in enumerate(chunks) if step < len(c)]
        parts = [chunks[i][step] for i in live]
        starts = np.concatenate([[0], np.cumsum([p.size for p in parts])])
        ids = np.concatenate(parts)
        ctx = contexts[live]
        out = ph.ple_hash_packed(ids, starts, ctx, layout, layer)
        for j, i in enumerate(live):
            got[i].append(out[starts[j] : starts[j + 1]])
        contexts[live] = ph.next_context(ctx, ids, starts)
        step += 1
    for i, s in enumerate(seqs):
        np.testing.assert_array_equal(np.concatenate(got[i]), whole[i])
    np.testing.assert_array_equal(np.concatenate(whole), np.concatenate(hf_ids(cfg, layer, seqs)))
    # transformers, chunk by chunk through its cache path
    module, captured = hf_module(cfg, layer)
    for i, s in enumerate(seqs):
        cache = ConvStateCache()
        pieces = []
        with torch.no_grad():
            for part in chunks[i]:
                captured.clear()
                module(torch.from_numpy(part[None, :]), cache)
                pieces.append(captured[0][0].numpy())
        np.testing.assert_array_equal(np.concatenate(pieces), whole[i])


def test_next_context() -> None:
    layout = make_layout(CONFIGS[2])  # N = 4: contexts of 3 ids
    eos = layout.eos_id
    ctx = ph.fresh_context(3, layout)
    ids = np.array([5, 6, 7, 8, 9], dtype=np.int64)
    starts = np.array([0, 1, 1, 5])  # one token, none, four
    nxt = ph.next_context(ctx, ids, starts)
    np.testing.assert_array_equal(nxt, [[eos, eos, 5], [eos, eos, eos], [7, 8, 9]])
    nxt_t = ph.next_context(torch.from_numpy(ctx), torch.from_numpy(ids), starts)
    np.testing.assert_array_equal(nxt_t.numpy(), nxt)


def test_real_config_layout_is_fast_and_exact() -> None:
    """The default config (base 20,000,000, 8 heads x orders 2..3, vocab 248,320) over
    40 PLE layers: 640 primes in well under 10 s; first and last prime, and every
    layer's multipliers, equal transformers' own functions."""
    t0 = time.perf_counter()
    layout = ph.PLEHashLayout.from_config(
        vocab_size=248_320,
        ngram_size=3,
        heads_per_ngram=8,
        ngram_vocab_size_base=20_000_000,
        make_ngram_vocab_size_divisible_by=128,
        seed=1234,
        eos_token_id=[248_044, 248_046],
        num_layers=40,
    )
    elapsed = time.perf_counter() - t0
    assert elapsed < 10.0, f"from_config took {elapsed:.1f} s"
    primes = layout.head_vocab_sizes.reshape(-1)
    assert primes.size == 640 and layout.eos_id == 248_044
    for k in (0, 1, 639):
        assert int(primes[k]) == qmod._find_nth_prime_after(20_000_000 - 1, k + 1)
    for li in range(40):
        assert layout.multipliers[li].tolist() == qmod._build_layer_multipliers(248_320, 3, li, 1234).tolist()
    assert np.all(layout.table_rows < 2**31) and np.all(layout.table_rows % 128 == 0)


def test_primes_from_matches_miller_rabin() -> None:
    for start, count in ((2, 30), (1, 5), (10_000, 200), (2**31 - 100, 3)):
        got = ph.primes_from(start, count)
        want, v = [], max(start, 2)
        while len(want) < count:
            if is_prime(v):
                want.append(v)
            v += 1
        assert got.tolist() == want


@pytest.mark.parametrize(
    "field, value, needle",
    [
        ("ngram_size", 1, "ngram_size=1"),
        ("ngram_size", 17, "ngram_size=17"),
        ("heads_per_ngram", 0, "heads_per_ngram=0"),
        ("ngram_vocab_size_base", 1, "ngram_vocab_size_base=1"),
        ("make_ngram_vocab_size_divisible_by", 0, "make_ngram_vocab_size_divisible_by=0"),
        ("eos_token_id", 97, "eos_token_id=97"),
        ("eos_token_id", None, "eos_token_id"),
        ("eos_token_id", [], "eos_token_id"),
        ("num_layers", 0, "num_layers"),
        ("vocab_size", 2.5, "vocab_size must be an integer"),
    ],
)
def test_bad_config_fields(field, value, needle) -> None:
    kwargs = dict(
        vocab_size=97,
        ngram_size=2,
        heads_per_ngram=1,
        ngram_vocab_size_base=50,
        make_ngram_vocab_size_divisible_by=16,
        seed=1,
        eos_token_id=96,
        num_layers=2,
    )
    kwargs[field] = value
    with pytest.raises(ConfigError, match=needle) as info:
        ph.PLEHashLayout.from_config(**kwargs)
    assert "\n" not in str(info.value)


def test_bad_step_inputs() -> None:
    layout = make_layout(CONFIGS[1])  # N = 3, vocab 1000
    ctx = ph.fresh_context(2, layout)
    ids = np.arange(10)
    with pytest.raises(EngramError, match="seq_starts"):
        ph.ple_hash_packed(ids, [0, 4, 9], ctx, layout, 0)
    with pytest.raises(EngramError, match="seq_starts"):
        ph.ple_hash_packed(ids, [0, 6, 4, 10], ph.fresh_context(3, layout), layout, 0)
    with pytest.raises(EngramError, match="context must be"):
        ph.ple_hash_packed(ids, [0, 4, 10], ph.fresh_context(3, layout), layout, 0)
    with pytest.raises(EngramError, match="input_ids holds ids"):
        ph.ple_hash_packed(np.array([1, 1000]), [0, 2], ph.fresh_context(1, layout), layout, 0)
    with pytest.raises(EngramError, match="context holds ids"):
        ph.ple_hash_packed(ids, [0, 4, 10], ctx - 1, layout, 0)
    with pytest.raises(EngramError, match="layer=4"):
        ph.ple_hash_packed(ids, [0, 4, 10], ctx, layout, 4)


def test_kernel_layout_checks_on_the_host(plugin_lib) -> None:
    """The library's layout checks (engram_ple_hash_layout_create needs no GPU): every
    layer of the real config prepares; a table too small for its heads, an EOS outside
    the vocabulary and a multiplier that would overflow are refused in one line."""
    from engram_trt.native import ple as native_ple

    layout = ph.PLEHashLayout.from_config(
        vocab_size=248_320,
        ngram_size=3,
        heads_per_ngram=8,
        ngram_vocab_size_base=20_000_000,
        make_ngram_vocab_size_divisible_by=128,
        seed=1234,
        eos_token_id=248_044,
        num_layers=4,
    )
    for li in range(4):
        assert native_ple.prepared_ple_layout(layout, li).num_heads == 16
    assert native_ple.prepared_ple_layout(layout, 1) is native_ple.prepared_ple_layout(layout, 1)
    small = dataclasses.replace(layout, table_rows=layout.table_rows - 200)
    with pytest.raises(EngramError, match="head 15 has prime"):
        native_ple.PreparedPleHashLayout(small, 0)
    with pytest.raises(EngramError, match="eos_id 248320 outside"):
        native_ple.PreparedPleHashLayout(dataclasses.replace(layout, eos_id=248_320), 0)
    big = layout.multipliers.copy()
    big[0, 1] = 2**62
    with pytest.raises(EngramError, match=r"multiplier\[1\]"):
        native_ple.PreparedPleHashLayout(dataclasses.replace(layout, multipliers=big), 0)
