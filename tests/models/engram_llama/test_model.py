"""The engram-llama reference model.

Oracles are independent of the model's torch path: a float64 NumPy forward written
here from the spec (hashing via ``hashing.hash_ids``, rows via ``quant.dequant_fp8_rows``,
fusion via ``fusion.engram_gate_reference``), the model's own full forward for the KV
cache and chunking checks, and argmax over repeated full forwards for greedy decoding.

Tolerances: float32 model vs float64 oracle, 1e-4 of the logits' scale (3 layers of
float32 matmuls over widths <= 256 stay near 1e-6 relative); cached vs uncached
float32, 1e-4 relative.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engram_trt.checkpoint.checkpoint import Checkpoint, engram_tensor_names, write_checkpoint
from engram_trt.config.model import ModelConfig
from engram_trt.errors import EngramError
from engram_trt.engram.hashing import hash_ids
from engram_trt.models.kv_cache import KVCache
from engram_trt.models.engram_llama.model import EngramLlama
from engram_trt.models.sampling import sample_next
from engram_trt.models.step import PackedStep
from engram_trt.tables.source import checkpoint_table_refs
from engram_trt.tables.store import open_tables
from engram_trt.engram.tokenizer import CompressedVocab, load_tokenizer

from helpers.engram_llama import (
    CVOCAB,
    IDS,
    MODEL_CONFIG,
    PLAIN_CONFIG,
    build,
    close,
    f64,
    np_engram,
    np_forward,
    np_table_rows,
)


@pytest.fixture(scope="module")
def small() -> tuple[EngramLlama, ModelConfig, dict[str, torch.Tensor], torch.Tensor]:
    model, cfg, weights, lookup = build(MODEL_CONFIG)
    assert lookup is not None
    return model, cfg, weights, lookup


# --------------------------------------------------------------------------------------
# Forward against the NumPy oracle
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("table_dtype", ["fp8", "bf16"])
def test_forward_matches_numpy_float64(table_dtype: str) -> None:
    model, cfg, weights, lookup = build(MODEL_CONFIG | {"engram_table_dtype": table_dtype})
    got = model(IDS)
    want = np_forward(cfg, weights, lookup, IDS)
    assert got.shape == (len(IDS), cfg.vocab_size)
    close(got.double(), torch.from_numpy(want))


def test_forward_with_dead_tokens_matches_numpy(small: Any) -> None:
    model, cfg, weights, lookup = small
    cids = lookup[torch.tensor(IDS)].clone()
    cids[4] = -1
    cids[9] = -1
    got = model(IDS, engram_ids=cids)
    want = np_forward(cfg, weights, lookup, IDS, engram_ids=cids.numpy())
    close(got.double(), torch.from_numpy(want))
    assert not torch.allclose(got, model(IDS), atol=1e-3)  # the dead tokens mattered


def test_plain_model_matches_numpy() -> None:
    model, cfg, weights, _ = build(PLAIN_CONFIG)
    assert cfg.engram is None and model.layout is None
    close(model(IDS).double(), torch.from_numpy(np_forward(cfg, weights, None, IDS)))
    cache = model.new_cache(1, 32)
    first = model.prefill(IDS[:5], cache, last_only=False)
    steps = torch.stack([model.decode(t, cache) for t in IDS[5:]])
    close(torch.cat([first, steps]), model(IDS))


def test_batch_equals_single_sequences(small: Any) -> None:
    model, *_ = small
    a, b = IDS, list(reversed(IDS))
    batched = model(torch.tensor([a, b]))
    close(batched[0], model(a))
    close(batched[1], model(b))


def test_engram_update_matches_numpy_across_a_chunk(small: Any) -> None:
    """One layer's Engram update inside the model, for a chunk that continues a
    cached sequence (lookback from the cache) and holds a dead token, against the
    float64 oracle fed the same hidden state."""
    model, cfg, weights, lookup = small
    layer = cfg.engram.layer_ids[1]
    cache = model.new_cache(1, 32)
    model.prefill(IDS[:6], cache)
    chunk = IDS[6:11]
    cids = lookup[torch.tensor(chunk)].clone()
    cids[2] = -1
    seen: dict[str, torch.Tensor] = {}

    def hook(mod: Any, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        seen["hidden"], seen["rows"], seen["live"] = args[:3]
        seen["out"] = out

    block = model.model.layers[layer].engram_module
    handle = block.register_forward_hook(hook)
    try:
        model(chunk, cache, engram_ids=cids)
    finally:
        handle.remove()
    lookback = lookup[torch.tensor(IDS[4:6])].numpy()
    hidden = f64(seen["hidden"])  # the packed step's [T, hc, D]
    want = np_engram(cfg, weights, model.layout, 1, hidden, cids.numpy(), lookback)
    got = f64(seen["out"])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # the dead token passes through untouched (gate 0); live ones changed
    np.testing.assert_array_equal(got[2], hidden[2])
    assert np.abs(got[0] - hidden[0]).max() > 1e-2
    # and the rows the model gathered are the oracle's rows
    hid = hash_ids(cids.numpy(), model.layout, lookback)[:, 1, :]
    names = engram_tensor_names(layer)
    np.testing.assert_array_equal(f64(seen["rows"]), np_table_rows(weights, names, hid, 32))


# --------------------------------------------------------------------------------------
# KV cache and chunking
# --------------------------------------------------------------------------------------
def test_prefill_then_decode_equals_full_forward(small: Any) -> None:
    model, *_ = small
    full = model(IDS)
    cache = model.new_cache(1, 32)
    first = model.prefill(IDS[:7], cache, last_only=False)
    close(first, full[:7])
    for t in range(7, len(IDS)):
        close(model.decode(IDS[t], cache), full[t])
    assert cache.seq_len == len(IDS)
    assert cache.lookback.tolist() == [lookup_ids(small, IDS[-2:])]
    # a reset cache starts a new sequence: same logits as a fresh one
    assert isinstance(cache, KVCache) and cache.max_len == 32
    cache.reset()
    assert cache.seq_len == 0 and cache.lookback.tolist() == [[-1, -1]]
    close(model.prefill(IDS[:7], cache, last_only=False), full[:7])


def lookup_ids(small: Any, ids: list[int]) -> list[int]:
    return small[3][torch.tensor(ids)].tolist()


def test_prefill_then_decode_batched(small: Any) -> None:
    model, *_ = small
    seqs = torch.tensor([IDS, list(reversed(IDS))])
    full = model(seqs)
    cache = model.new_cache(2, 32)
    close(model.prefill(seqs[:, :6], cache), full[:, 5])
    for t in range(6, seqs.shape[1]):
        close(model.decode(seqs[:, t], cache), full[:, t])


@pytest.mark.parametrize("chunk", [3, 5])
def test_chunked_prefill_equals_one_shot(small: Any, chunk: int) -> None:
    model, *_ = small
    one_shot = model.prefill(IDS, model.new_cache(1, 32), last_only=False)
    cache = model.new_cache(1, 32)
    chunked = model.prefill(IDS, cache, chunk_size=chunk, last_only=False)
    close(chunked, one_shot)
    assert cache.seq_len == len(IDS)


def test_dropping_the_lookback_changes_the_logits(small: Any) -> None:
    """The chunked test above can fail: without the lookback, the first N-1 tokens
    of a chunk hash as if the sequence started there."""
    model, *_ = small
    one_shot = model(IDS)
    cache = model.new_cache(1, 32)
    model.prefill(IDS[:5], cache)
    cache.lookback.fill_(-1)  # forget the ids before the chunk
    wrong = model(IDS[5:10], cache)
    assert (wrong[:2] - one_shot[5:7]).abs().max() > 1e-2
    # the same chunk with the lookback kept matches the one-shot forward
    cache2 = model.new_cache(1, 32)
    model.prefill(IDS[:5], cache2)
    close(model(IDS[5:10], cache2), one_shot[5:10])


def test_precomputed_rows_equal_internal_gather(small: Any) -> None:
    model, *_ = small
    cache_a, cache_b = model.new_cache(1, 32), model.new_cache(1, 32)
    model.prefill(IDS[:4], cache_a)
    model.prefill(IDS[:4], cache_b)
    rows = model.prepare_engram(IDS[4:9], cache_a)
    assert [tuple(r.shape) for r in rows] == [(1, 5, 4, 32)] * 2
    torch.testing.assert_close(model(IDS[4:9], cache_a, engram_rows=rows), model(IDS[4:9], cache_b), rtol=0, atol=0)
    with pytest.raises(EngramError, match="engram_rows must hold"):
        model(IDS[9:11], cache_a, engram_rows=rows)


def test_a_step_in_segments_cut_at_each_engram_layer_equals_one_call(small: Any) -> None:
    """The decode CUDA graphs (runtime.cuda_graphs) replay a step as segments cut before
    each Engram layer, each segment waiting only for its own layer's rows: cut there, the
    segments compute what one call does, and each layer's rows are first read by the
    segment that starts at that layer (Engram layers 0 and 2 here: the first segment is
    the embedding alone)."""
    model, *_ = small
    assert model.engram_layers == [(0, 0), (2, 1)] and model.first_engram_layer == 0
    seqs = [IDS[:6], IDS[3:8]]
    want = model.forward_step(PackedStep.from_sequences(seqs), model.new_cache(2, 32))
    step = PackedStep.from_sequences(seqs)
    cache = model.new_cache(2, 32)
    state = model.step_begin(step, cache, None, False)
    reads: list[tuple[int, int]] = []  # (segment, Engram layer) of each read of the rows
    segment = [0]

    class Recorder(list):
        def __getitem__(self, i: Any) -> Any:
            reads.append((segment[0], i))
            return list.__getitem__(self, i)

    state.rows = Recorder(state.rows)
    bounds = [0, *(layer for layer, _ in model.engram_layers), len(model.model.layers)]
    for j in range(len(bounds) - 1):
        segment[0] = j
        model.step_layers(state, cache, bounds[j], bounds[j + 1])
    got = model.step_end(state, step, cache, False, False)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert reads == [(1, 0), (2, 1)]
    model.engram_enabled = False
    try:
        assert model.engram_layers == [] and model.first_engram_layer is None
    finally:
        model.engram_enabled = True


def test_bad_inputs_are_refused(small: Any) -> None:
    model, cfg, *_ = small
    with pytest.raises(EngramError, match="outside the model's vocabulary"):
        model([1, cfg.vocab_size])
    cache = model.new_cache(1, 4)
    model.prefill(IDS[:3], cache)
    with pytest.raises(EngramError, match="max_len"):
        model.prefill(IDS[:3], cache)
    with pytest.raises(EngramError, match="holds 0 tokens, but it holds 3"):
        model.forward_step(PackedStep.from_sequences([IDS[:1]], past_lens=[0]), cache)
    with pytest.raises(EngramError, match="compressed"):
        EngramLlama(cfg, small[2], compress_lookup=torch.full((300,), CVOCAB))
    with pytest.raises(EngramError, match=f"compressed id {CVOCAB}, outside -1..{CVOCAB - 1}"):
        model(IDS[:3], engram_ids=[1, 2, CVOCAB])


# --------------------------------------------------------------------------------------
# Generation
# --------------------------------------------------------------------------------------
def test_greedy_generate_equals_argmax_of_full_forwards(small: Any) -> None:
    model, *_ = small
    prompt = IDS[:5]
    result = model.generate(prompt, 8, eos=[])
    seq = list(prompt)
    for _ in range(8):
        seq.append(int(torch.argmax(model(seq)[-1])))
    assert result.new_ids == seq[5:]
    assert result.ids == seq
    assert result.prefill_s > 0 and result.decode_s > 0 and result.decode_steps == 7
    chunked = model.generate(prompt, 8, eos=[], prefill_chunk=2)
    assert chunked.new_ids == result.new_ids


def test_generate_stops_at_eos(small: Any) -> None:
    model, *_ = small
    greedy = model.generate(IDS[:5], 6, eos=[]).new_ids
    stop = greedy[2]
    r = model.generate(IDS[:5], 6, eos=stop)
    assert r.new_ids == greedy[: greedy.index(stop) + 1] and r.stopped_at_eos


def test_top_p_sampling_is_seeded_and_tiny_top_p_is_greedy(small: Any) -> None:
    model, *_ = small
    prompt = IDS[:4]
    a = model.generate(prompt, 10, temperature=1.0, top_p=0.9, seed=7, eos=[])
    b = model.generate(prompt, 10, temperature=1.0, top_p=0.9, seed=7, eos=[])
    c = model.generate(prompt, 10, temperature=1.0, top_p=0.9, seed=8, eos=[])
    assert a.new_ids == b.new_ids
    assert a.new_ids != c.new_ids
    greedy = model.generate(prompt, 10, eos=[])
    tiny = model.generate(prompt, 10, temperature=1.0, top_p=1e-9, seed=7, eos=[])
    assert tiny.new_ids == greedy.new_ids
    assert a.new_ids != greedy.new_ids
    with pytest.raises(EngramError, match="top_p"):
        model.generate(prompt, 2, top_p=0.0)


def test_sample_next_keeps_the_nucleus() -> None:
    logits = torch.log(torch.tensor([0.05, 0.5, 0.3, 0.15]))
    gen = torch.Generator().manual_seed(0)
    picks = {sample_next(logits, 1.0, 0.6, gen) for _ in range(200)}
    assert picks == {1, 2}  # 0.5 < 0.6 needs the second token; 0.8 >= 0.6 stops there
    assert sample_next(logits, 0.0, 1.0, gen) == 1
    picks = {sample_next(logits, 1.0, 1.0, gen) for _ in range(400)}
    assert picks == {0, 1, 2, 3}


def test_bf16_compute_stays_close(small: Any) -> None:
    _, cfg, weights, lookup = small
    model16 = EngramLlama(cfg, weights, compress_lookup=lookup, dtype=torch.bfloat16)
    ref = small[0](IDS)
    got = model16(IDS)
    assert got.dtype == torch.float32
    assert float((got - ref).abs().max()) < 0.1 * float(ref.abs().max())
    cache = model16.new_cache(1, 32)
    model16.prefill(IDS[:6], cache)
    assert cache.keys[0].dtype == torch.bfloat16


# --------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------
def test_from_checkpoint_memory_and_mmap_tables(small: Any, tmp_path: Path) -> None:
    model, cfg, weights, lookup = small
    write_checkpoint(tmp_path / "ck", MODEL_CONFIG, weights, None, max_shard_bytes=64 * 1024)
    ck = Checkpoint.open(tmp_path / "ck")
    vocab = CompressedVocab(lookup=lookup.numpy(), size=CVOCAB)
    ref = model(IDS)
    for storage in ("memory", "file"):
        loaded = EngramLlama.from_checkpoint(ck, table_storage=storage, compressed_vocab=vocab)
        torch.testing.assert_close(loaded(IDS), ref, rtol=0, atol=0)
    assert open_tables(checkpoint_table_refs(ck), "file").nbytes() == 0
    with pytest.raises(EngramError, match="compresses to 119"):
        EngramLlama.from_checkpoint(ck, compressed_vocab=CompressedVocab(lookup=lookup.numpy() % 119, size=119))
    with pytest.raises(EngramError, match="tokenizer.json"):
        EngramLlama.from_checkpoint(ck)


def test_from_checkpoint_refuses_short_tables(small: Any, tmp_path: Path) -> None:
    model, cfg, weights, lookup = small
    short = dict(weights)
    names = engram_tensor_names(0)
    need = int(model.layout.table_rows[0])
    short[names["table"]] = weights[names["table"]][: need - 1].clone()
    short[names["scale"]] = weights[names["scale"]][: need - 1].clone()
    write_checkpoint(tmp_path / "ck", MODEL_CONFIG, short, None)
    vocab = CompressedVocab(lookup=lookup.numpy(), size=CVOCAB)
    with pytest.raises(EngramError, match="does not cover") as err:
        EngramLlama.from_checkpoint(tmp_path / "ck", compressed_vocab=vocab)
    assert names["table"] in str(err.value)


def test_demo_end_to_end(demo_dir: Path) -> None:
    model = EngramLlama.from_checkpoint(demo_dir)
    assert model.layout is not None and model.layout.n_hash_cols == 4
    tok = load_tokenizer(demo_dir)
    prompt = tok.encode("Engram looks up n-grams in large tables.").ids
    result = model.generate(prompt, 8, eos=[])
    assert len(result.new_ids) == 8
    assert all(0 <= t < model.config.vocab_size for t in result.new_ids)
    assert result.tokens_per_s > 0
    assert isinstance(tok.decode(result.new_ids), str)  # meaningless text, but text
    again = model.generate(prompt, 8, eos=[], prefill_chunk=3)
    assert again.new_ids == result.new_ids
    # The demo's Engram layers take part: killing every token's Engram changes logits.
    live = model(prompt[:6])
    dead = model(prompt[:6], engram_ids=[-1] * 6)
    assert (live - dead).abs().max() > 1e-2
