"""Every Engram formula against the independent golden vectors (tests/data, copied from the independent set)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engram_trt.config.model import parse_engram_spec
from engram_trt.engram.fusion import engram_gate, engram_gate_reference
from engram_trt.engram.hashing import hash_batch_packed, hash_ids, hash_ids_torch, next_lookback
from engram_trt.engram.layout import EngramLayout
from engram_trt.engram.quant import dequant_fp8_rows, dequant_fp8_rows_torch, quantize_fp8_rows


def _layout(case: dict) -> EngramLayout:
    return EngramLayout.from_spec(parse_engram_spec(case["config"]), case["pad_compressed_id"])


def test_layout_matches_golden(golden_hash):
    assert len(golden_hash["cases"]) >= 2
    for case in golden_hash["cases"]:
        lay = _layout(case)
        assert lay.primes.tolist() == case["primes"]
        assert lay.offsets.tolist() == case["offsets"]
        assert lay.multipliers.tolist() == case["multipliers"]
        # every prime is distinct across layers, orders and heads
        assert len(set(lay.primes.ravel().tolist())) == lay.primes.size
        np.testing.assert_array_equal(lay.table_rows, np.asarray(case["primes"]).reshape(len(lay.layer_ids), -1).sum(1))


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_hash_ids_match_golden(golden_hash, backend):
    checked = 0
    for case in golden_hash["cases"]:
        lay = _layout(case)
        for seq, expected in zip(case["sequences"], case["hash_ids"]):
            if backend == "numpy":
                got = hash_ids(seq, lay)
            else:
                got = hash_ids_torch(torch.tensor(seq), lay).numpy()
            assert got.tolist() == expected
            checked += len(seq)
    assert checked > 40


def test_chunked_and_decode_hashing_equal_whole_sequence(golden_hash):
    """A chunk given its N-1 lookback ids hashes like the whole sequence."""
    for case in golden_hash["cases"]:
        lay = _layout(case)
        seq, expected = case["sequences"][-1], np.asarray(case["hash_ids"][-1])
        n = lay.max_ngram_size - 1
        for cut in (1, 2, 5, len(seq) - 1):
            lb = next_lookback(None, seq[:cut], n)
            np.testing.assert_array_equal(hash_ids(seq[cut:], lay, lookback=lb), expected[cut:])
            tl = hash_ids_torch(torch.tensor(seq[cut:]), lay, lookback=torch.tensor(lb)).numpy()
            np.testing.assert_array_equal(tl, expected[cut:])
        # one decode step at a time
        lb = None
        for p, tok in enumerate(seq):
            step = hash_ids([tok], lay, lookback=next_lookback(None, [], n) if lb is None else lb)
            np.testing.assert_array_equal(step[0], expected[p])
            lb = next_lookback(lb, [tok], n)
        # without the lookback the chunk's first positions differ: the test can fail
        assert not np.array_equal(hash_ids(seq[5:], lay), expected[5:])


def test_packed_batch_equals_per_sequence(golden_hash):
    case = golden_hash["cases"][0]
    lay = _layout(case)
    seqs = case["sequences"]
    ids = np.concatenate([np.asarray(s) for s in seqs])
    starts = np.cumsum([0] + [len(s) for s in seqs])
    got = hash_batch_packed(ids, starts, None, lay)
    np.testing.assert_array_equal(got, np.concatenate([np.asarray(h) for h in case["hash_ids"]]))


def test_tokenizer_compression_matches_golden(golden_hash, deepseek_vocab):
    tok = golden_hash["tokenizer"]
    assert deepseek_vocab.vocab_size == tok["vocab_size"] == 129280
    assert deepseek_vocab.size == tok["compressed_vocab_size"] == 99092
    assert len(tok["sample"]) >= 32
    for raw, comp in tok["sample"]:
        assert int(deepseek_vocab.lookup[raw]) == comp, raw


def test_fp8_dequant_matches_golden(golden_fusion):
    d = golden_fusion["dequant"]
    q = np.asarray(d["fp8_e4m3_bytes"], dtype=np.uint8)
    s = np.asarray(d["ue8m0_scale_bytes"], dtype=np.uint8)
    want = np.asarray(d["values"], dtype=np.float64)
    # FP8 * 2^k is exact in float32: equality, not tolerance
    np.testing.assert_array_equal(dequant_fp8_rows(q, s, d["block_size"]).astype(np.float64), want)
    t = dequant_fp8_rows_torch(torch.from_numpy(q), torch.from_numpy(s), d["block_size"], dtype=torch.float32)
    np.testing.assert_array_equal(t.numpy().astype(np.float64), want)
    # bf16 output rounds the exact value once
    tb = dequant_fp8_rows_torch(torch.from_numpy(q), torch.from_numpy(s), d["block_size"])
    assert tb.dtype == torch.bfloat16
    np.testing.assert_array_equal(tb.float().numpy(), torch.from_numpy(want).to(torch.bfloat16).float().numpy())


def test_fp8_quantize_roundtrip_error_is_fp8_sized():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 64, generator=g) * torch.logspace(-3, 3, 64)
    q, s = quantize_fp8_rows(x)
    y = dequant_fp8_rows(q.numpy(), s.numpy())
    rel = np.abs(y - x.numpy()) / np.maximum(np.abs(x.numpy()), 1e-30)
    # e4m3 has 3 mantissa bits: half an ulp is 1/16 relative, except subnormals of each block
    blocks_max = np.abs(x.numpy()).reshape(256, 2, 32).max(-1).repeat(32, -1)
    normal = np.abs(x.numpy()) > blocks_max / 2**7
    assert rel[normal].max() <= 1 / 16 + 1e-7


def test_gate_reference_matches_golden(golden_fusion):
    g = golden_fusion["gate"]
    out = engram_gate_reference(
        g["hidden"], g["kv"], g["q_weight"], g["k_weight"], g["token_mask"], g["eps"], g["clamp"]
    )
    np.testing.assert_allclose(out, np.asarray(g["output"]), rtol=1e-12, atol=1e-12)
    # masked tokens pass through unchanged
    for t, m in enumerate(g["token_mask"]):
        if not m:
            np.testing.assert_array_equal(out[t], np.asarray(g["hidden"])[t])


def test_gate_torch_matches_golden(golden_fusion):
    g = golden_fusion["gate"]
    want = np.asarray(g["output"])
    args = [torch.tensor(g[k], dtype=torch.float64) for k in ("hidden", "kv", "q_weight", "k_weight")]
    mask = torch.tensor(g["token_mask"])
    # float32 math from float32 inputs: tolerance 1e-5 relative to the output's scale
    out32 = engram_gate(*[a.float() for a in args], mask, g["eps"], g["clamp"])
    assert np.abs(out32.double().numpy() - want).max() <= 1e-5 * np.abs(want).max()
    # bf16 inputs and output: 2^-8 relative (bf16's half ulp) plus input rounding
    outbf = engram_gate(*[a.bfloat16() for a in args], mask, g["eps"], g["clamp"])
    assert outbf.dtype == torch.bfloat16
    assert np.abs(outbf.double().numpy() - want).max() <= 2e-2 * np.abs(want).max()
