"""The exported serving graph, run on the CPU with the plugin nodes bound to the Python
references (models/*/reference_ops.py), against the PyTorch reference model (EngramLlama).

Every check runs MIXED packed steps (models.step.PackedStep): sequences prefilling
chunks while others decode, at different past lengths, in non-contiguous KV slots (one
reused after its sequence ended), sequences continuing across steps. Two references:
each sequence alone through ``EngramLlama.forward`` with a fresh KVCache (a prefill of all
its tokens so far, whose last-token logits the step's logits for that sequence must
equal: independent of any packing), and the reference model's own packed step,
``EngramLlama.forward_step``, on the same PackedStep.

Tolerances (stated, and why):
* float32 graph exactly as built (the EngramGate plugin takes float32 hidden/kv, so no
  casts around it): 1e-4 absolute on logits of magnitude ~4: the two are the same
  float32 computation up to operation order (the attention reference is float64).
* float32 graph with the gate forced to bf16 (``gate_dtype='bf16'``, casts around it):
  5e-2 absolute: one bf16 rounding (2^-9 relative) of the residual stream per Engram
  layer, carried through the rest of the network.
* bf16 graph: it must run and stay within 0.25 absolute of the float32 reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch

from engram_trt.models.engram_llama.onnx_export import export_model
from engram_trt.models.export import GATE_IO_DTYPES, PLUGIN_NAMES, ExportOptions
from engram_trt.models.engram_llama.reference_ops import engram_attention_reference
from engram_trt.models.engram_llama.reference_runner import ReferenceRunner
from engram_trt.checkpoint.checkpoint import Checkpoint, engram_tensor_names
from engram_trt.models.engram_llama.demo import random_weights
from engram_trt.config.model import ModelConfig
from engram_trt.engram.layout import EngramLayout
from engram_trt.errors import EngramError
from engram_trt.models.engram_llama.model import EngramLlama
from engram_trt.models.step import PackedStep

SMALL = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=500,
    hc_mult=2,
    tie_word_embeddings=False,
    max_position_embeddings=128,
    engram_layer_ids=[0, 2],
    engram_max_ngram_size=3,
    engram_n_heads=2,
    engram_head_dim=32,
    engram_vocab_size=300,
    engram_compressed_vocab_size=400,
    engram_pad_token_id=3,
)
DEAD_TOKEN = 7  # a raw id with no compressed id: dead for Engram


def _small(table_dtype: str = "fp8", hc: int = 2):
    cfg = ModelConfig.from_dict({**SMALL, "engram_table_dtype": table_dtype, "hc_mult": hc})
    lookup = np.arange(cfg.vocab_size) % cfg.engram.compressed_vocab_size
    lookup[DEAD_TOKEN] = -1
    layout = EngramLayout.from_spec(cfg.engram, pad_id=int(lookup[cfg.engram.pad_token_id]))
    weights = random_weights(cfg, torch.Generator().manual_seed(0), table_rows=[int(r) for r in layout.table_rows])
    return cfg, lookup, layout, weights


def _tables(cfg: ModelConfig, weights) -> list:
    out = []
    for lid in cfg.engram.layer_ids:
        names = engram_tensor_names(lid)
        t = weights[names["table"]]
        if t.dtype == torch.bfloat16:
            out.append((t.view(torch.uint16).numpy(), None))
        else:
            out.append((t.view(torch.uint8).numpy(), weights[names["scale"]].view(torch.uint8).numpy()))
    return out


@dataclass
class Sequence:
    slot: int
    ids: list[int] = field(default_factory=list)  # every token so far


# A schedule of mixed steps: per step, (sequence name, slot, new tokens), in pack order.
# A and B prefill in chunks while C and D decode; E takes A's slot after A ends.
SCHEDULE = [
    [("A", 4, 9), ("B", 1, 3), ("C", 3, 1)],
    [("C", 3, 1), ("B", 1, 5), ("A", 4, 1), ("D", 0, 6)],
    [("D", 0, 1), ("A", 4, 1), ("C", 3, 2), ("B", 1, 1)],
    [("B", 1, 1), ("E", 4, 4), ("D", 0, 1)],  # A is gone: E reuses slot 4 (stale K/V, stale lookback)
]


def _run_schedule(
    runner: ReferenceRunner,
    ref: EngramLlama,
    seed: int,
    schedule=SCHEDULE,
    prefetch: bool = False,
    lookup: np.ndarray | None = None,
) -> float:
    """Runs the schedule through the graph, one PackedStep per step. After every step each
    sequence's logits must equal (a) that sequence alone through the reference model (a
    prefill of all its tokens so far) and (b) the reference model's own packed step
    (``EngramLlama.forward_step`` on the same PackedStep, its own slot cache). Returns the
    worst absolute difference."""
    rng = np.random.default_rng(seed)
    seqs: dict[str, Sequence] = {}
    worst = 0.0
    n1 = runner.lookback.shape[1]
    cache = ref.new_cache(runner.num_slots, runner.max_seq_len)
    for step in schedule:
        chunks, past, slots, rows = [], [], [], []
        for name, slot, n in step:
            if name not in seqs:
                seqs[name] = Sequence(slot)  # no reset of the runner's slot: a sequence without past has no lookback
                cache.reset(slot)
            seq = seqs[name]
            new = rng.integers(0, ref.config.vocab_size, size=n).tolist()
            if name == "A" and not seq.ids:
                new[3] = DEAD_TOKEN  # a dead token inside a prompt
            past.append(len(seq.ids))
            slots.append(seq.slot)
            if prefetch:
                assert lookup is not None
                before = [-1] * n1 + [int(lookup[t]) for t in seq.ids]
                lb = torch.as_tensor([before[len(before) - n1 :]], dtype=torch.int64)
                rows.append([r[0] for r in ref.prepare_engram(torch.as_tensor([new]), lookback=lb)])
            seq.ids += new
            chunks.append(new)
        packed = PackedStep.from_sequences(chunks, past_lens=past, slots=slots)
        engram_rows = [torch.cat([r[j] for r in rows]) for j in range(len(rows[0]))] if prefetch else None
        got = runner.run(packed, engram_rows=engram_rows)
        assert got.shape == (len(step), ref.config.vocab_size) and got.dtype == np.float32
        direct = ref.forward_step(packed, cache, engram_rows=engram_rows).numpy()
        worst = max(worst, float(np.abs(got - direct).max()))
        for s, (name, _, _) in enumerate(step):
            history = torch.as_tensor([seqs[name].ids])
            want = ref.forward(history, ref.new_cache(1, history.shape[1]), last_only=True)[0].numpy()
            worst = max(worst, float(np.abs(got[s] - want).max()))
    return worst


def _runner(cfg, lookup, layout, weights, opts: ExportOptions, tables=None, num_slots: int = 6, max_seq_len: int = 40):
    ex = export_model(cfg, weights, layout, opts)
    return ex, ReferenceRunner(
        ex,
        cfg,
        _tables(cfg, weights) if tables is None else tables,
        lookup,
        num_slots=num_slots,
        max_seq_len=max_seq_len,
    )


@pytest.mark.parametrize("table_dtype, hc", [("fp8", 2), ("bf16", 1), ("fp8", 4)])
def test_mixed_steps_float32_tight(table_dtype: str, hc: int) -> None:
    cfg, lookup, layout, weights = _small(table_dtype, hc)
    ref = EngramLlama(cfg, weights, compress_lookup=lookup, layout=layout, dtype=torch.float32)
    _, runner = _runner(cfg, lookup, layout, weights, ExportOptions(dtype="fp32"))
    worst = _run_schedule(runner, ref, seed=1)
    assert np.isfinite(worst) and worst <= 1e-4, f"max |logit difference| {worst}"


def test_caches_are_updated_in_place() -> None:
    """The EngramAttention node writes the step's K/V into the very cache arrays the runner
    fed (aliased outputs, no copy), at (slot, position) of each token and nowhere else."""
    cfg, lookup, layout, weights = _small()
    ex, runner = _runner(cfg, lookup, layout, weights, ExportOptions(dtype="fp32"))
    assert ex.io["kv_cache"]["aliases"] == {
        f"{kind}_cache_out_{i}": f"{kind}_cache_{i}" for i in range(cfg.num_hidden_layers) for kind in ("key", "value")
    }
    before = [(k, v) for k, v in zip(runner.key_cache, runner.value_cache)]
    runner.step(np.arange(12) + 20, [0, 9, 12], [0, 0], [4, 1])
    runner.step(np.arange(3) + 40, [0, 2, 3], [9, 3], [4, 1])
    for (k0, v0), k1, v1 in zip(before, runner.key_cache, runner.value_cache):
        assert k1 is k0 and v1 is v0
        written = np.zeros(k1.shape[:3], dtype=bool)  # [slot, head, position]
        written[4, :, :11] = True
        written[1, :, :4] = True
        for cache in (k1, v1):
            assert np.all(np.any(cache != 0, axis=-1) == written)


def test_engram_attention_reference_against_sdpa() -> None:
    """The reference op alone, against torch's scaled_dot_product_attention on each token's
    keys (written first): GQA, a prefill chunk seeing its own keys, out-of-cache tokens
    (zero rows, nothing written)."""
    rng = np.random.default_rng(3)
    H, kvh, hd, num_slots, max_len = 6, 2, 8, 3, 20
    slots = np.array([2, 2, 2, 0, 5, 1, -1, 1], np.int32)
    pos = np.array([4, 5, 6, 0, 3, 19, 2, 20], np.int32)
    bad = np.array([False, False, False, False, True, False, True, True])
    q, k, v = (rng.standard_normal((8, n, hd)) for n in (H, kvh, kvh))
    kc, vc = rng.standard_normal((2, num_slots, kvh, max_len, hd))
    want_k, want_v = kc.copy(), vc.copy()
    for t in np.nonzero(~bad)[0]:
        want_k[slots[t], :, pos[t]], want_v[slots[t], :, pos[t]] = k[t], v[t]
    out = engram_attention_reference(q, k, v, kc, vc, slots, pos, hd**-0.5)
    assert np.array_equal(kc, want_k) and np.array_equal(vc, want_v)
    assert np.all(out[bad] == 0)
    for t in np.nonzero(~bad)[0]:
        keys = torch.from_numpy(want_k[slots[t], :, : pos[t] + 1]).repeat_interleave(H // kvh, dim=0)
        vals = torch.from_numpy(want_v[slots[t], :, : pos[t] + 1]).repeat_interleave(H // kvh, dim=0)
        sdpa = torch.nn.functional.scaled_dot_product_attention(torch.from_numpy(q[t])[:, None], keys, vals)
        assert np.allclose(out[t], sdpa[:, 0].numpy(), atol=1e-12, rtol=0)


def _gate_neighbours(model) -> list[tuple[str, str, str]]:
    """Per EngramGate node: (op producing hidden, op producing kv, op consuming the output)."""
    producers = {o: n for n in model.graph.node for o in n.output}
    consumers: dict[str, object] = {}
    for n in model.graph.node:
        for i in n.input:
            consumers.setdefault(i, n)
    return [
        (producers[n.input[0]].op_type, producers[n.input[1]].op_type, consumers[n.output[0]].op_type)
        for n in model.graph.node
        if n.op_type == "EngramGate"
    ]


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_gate_takes_the_graph_dtype_without_casts(dtype: str) -> None:
    """Every dtype the plugin takes (GATE_IO_DTYPES) feeds the gate directly: no Cast
    before hidden / kv or after the output (hidden is the residual stream [T, hc, D] as
    it is, kv the wkv MatMul)."""
    assert dtype in GATE_IO_DTYPES
    cfg, lookup, layout, weights = _small()
    model = export_model(cfg, weights, layout, ExportOptions(dtype=dtype)).model
    neighbours = _gate_neighbours(model)
    assert len(neighbours) == len(cfg.engram.layer_ids)
    assert all("Cast" not in n and n[1] == "MatMul" for n in neighbours), neighbours
    # an explicit bf16 gate in a float32 graph still casts around it
    forced = export_model(cfg, weights, layout, ExportOptions(dtype="fp32", gate_dtype="bf16")).model
    assert all(n == ("Cast", "Cast", "Cast") for n in _gate_neighbours(forced))
    with pytest.raises(EngramError, match="--dtype 'fp64' is not supported"):
        ExportOptions(dtype="fp32", gate_dtype="fp64")


def test_mixed_steps_float32_with_a_bf16_gate() -> None:
    cfg, lookup, layout, weights = _small()
    ref = EngramLlama(cfg, weights, compress_lookup=lookup, layout=layout, dtype=torch.float32)
    _, runner = _runner(cfg, lookup, layout, weights, ExportOptions(dtype="fp32", gate_dtype="bf16"))
    assert _run_schedule(runner, ref, seed=2) <= 5e-2


def test_mixed_steps_bf16_runs() -> None:
    cfg, lookup, layout, weights = _small()
    ref = EngramLlama(cfg, weights, compress_lookup=lookup, layout=layout, dtype=torch.float32)
    _, runner = _runner(cfg, lookup, layout, weights, ExportOptions(dtype="bf16"))
    assert runner.key_cache[0].dtype.name == "bfloat16"
    worst = _run_schedule(runner, ref, seed=3, schedule=SCHEDULE[:3])
    assert np.isfinite(worst) and worst <= 0.25


def test_prefetch_placement_takes_rows() -> None:
    """The prefetch graph has no hash/gather; fed each sequence's rows (hashed after its
    own lookback by the reference) for a mixed pack, it matches."""
    cfg, lookup, layout, weights = _small()
    ref = EngramLlama(cfg, weights, compress_lookup=lookup, layout=layout, dtype=torch.float32)
    ex, runner = _runner(cfg, lookup, layout, weights, ExportOptions(dtype="fp32", placement="prefetch"), tables=())
    ops = {n.op_type for n in ex.model.graph.node}
    assert "EngramGate" in ops and "EngramHash" not in ops and "EngramGather" not in ops
    assert "engram_lookback" not in ex.input_names
    assert _run_schedule(runner, ref, seed=4, prefetch=True, lookup=lookup) <= 1e-4


def test_no_engram_model_exports_and_matches() -> None:
    cfg = ModelConfig.from_dict({k: v for k, v in SMALL.items() if not k.startswith("engram")})
    weights = random_weights(cfg, torch.Generator().manual_seed(3))
    ref = EngramLlama(cfg, weights, dtype=torch.float32)
    ex = export_model(cfg, weights, None, ExportOptions(dtype="fp32"))
    plugins = [n.op_type for n in ex.model.graph.node if n.domain]
    assert plugins == ["EngramAttention"] * cfg.num_hidden_layers and ex.io["plugins"] == ["EngramAttention"]
    runner = ReferenceRunner(ex, cfg, num_slots=6, max_seq_len=40)
    assert _run_schedule(runner, ref, seed=5) <= 1e-4


def test_serving_graph_io() -> None:
    """The engine's I/O as the serving contract names them, with their dtypes and dims."""
    from onnx import TensorProto

    cfg, lookup, layout, weights = _small()
    ex = export_model(cfg, weights, layout, ExportOptions(dtype="bf16"))
    L, n1 = cfg.num_hidden_layers, layout.max_ngram_size - 1
    caches = [f"{kind}_cache_{i}" for i in range(L) for kind in ("key", "value")]
    assert ex.input_names == [
        "input_ids",
        "seq_starts",
        "past_lens",
        "slots",
        "engram_ids",
        "engram_lookback",
        "engram_table_ptrs",
        "engram_scale_ptrs",
        *caches,
    ]
    assert ex.output_names == ["logits", *[c.replace("_cache_", "_cache_out_") for c in caches]]

    def info(values):
        return {
            v.name: (v.type.tensor_type.elem_type, [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim])
            for v in values
        }

    ins, outs = info(ex.model.graph.input), info(ex.model.graph.output)
    i32, bf16 = TensorProto.INT32, TensorProto.BFLOAT16
    assert ins["input_ids"] == ins["engram_ids"] == (i32, ["tokens"])
    assert ins["seq_starts"] == (i32, ["seqs_plus_1"]) and ins["past_lens"] == ins["slots"] == (i32, ["seqs"])
    assert ins["engram_lookback"] == (i32, ["seqs", n1])
    cache = (bf16, ["num_slots", cfg.num_key_value_heads, "max_seq_len", cfg.head_dim])
    assert all(ins[c] == cache for c in caches) and all(
        outs[c.replace("_cache_", "_cache_out_")] == cache for c in caches
    )
    assert outs["logits"] == (TensorProto.FLOAT, ["seqs", cfg.vocab_size])
    attn = [nd for nd in ex.model.graph.node if nd.op_type == "EngramAttention"]
    assert len(attn) == L
    for i, nd in enumerate(attn):
        assert list(nd.input[3:5]) == [f"key_cache_{i}", f"value_cache_{i}"]
        assert list(nd.output[1:]) == [f"key_cache_out_{i}", f"value_cache_out_{i}"]
        attrs = {a.name: a for a in nd.attribute}
        assert (attrs["num_heads"].i, attrs["num_kv_heads"].i, attrs["head_dim"].i) == (4, 2, 16)
        assert math.isclose(attrs["scale"].f, 0.25, rel_tol=1e-7)
    (hash_node,) = [nd for nd in ex.model.graph.node if nd.op_type == "EngramHash"]
    assert list(hash_node.input) == ["engram_ids", "seq_starts", "engram_lookback"]  # the real starts


def test_runner_refuses_bad_steps() -> None:
    cfg, lookup, layout, weights = _small()
    _, runner = _runner(cfg, lookup, layout, weights, ExportOptions(dtype="fp32"), num_slots=4, max_seq_len=16)
    ids = np.arange(5) + 10
    for args, needle in (
        ((ids, [0, 3, 4], [0, 0], [1, 2]), "seq_starts must rise from 0 to the step's 5 tokens"),
        ((ids, [0, 3, 3, 5], [0, 0, 0], [1, 2, 3]), "each sequence >= 1 token"),
        ((ids, [0, 3, 5], [0, 0], [1, 1]), "must be distinct"),
        ((ids, [0, 3, 5], [0, 0], [1, 4]), "in [0, 4)"),
        ((ids, [0, 3, 5], [14, 0], [1, 2]), "must stay within max_seq_len 16"),
        ((ids, [0, 3, 5], [0], [1, 2]), "past_lens and slots must be [S] = (2,)"),
        ((ids + 1000, [0, 3, 5], [0, 0], [1, 2]), "token ids in [0, 500)"),
        ((ids.astype(float), [0, 3, 5], [0, 0], [1, 2]), "input_ids must hold integers"),
    ):
        with pytest.raises(EngramError, match=needle.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            runner.step(*args)
    with pytest.raises(EngramError, match=r"lookback must be \[S, N-1\] = \(2, 2\)"):
        runner.step(ids, [0, 3, 5], [0, 0], [1, 2], lookback=np.zeros((2, 3), np.int64))


def test_export_is_deterministic_and_holds_no_tables() -> None:
    cfg, lookup, layout, weights = _small()
    a = export_model(cfg, weights, layout, ExportOptions(dtype="bf16")).model.SerializeToString(deterministic=True)
    ex = export_model(cfg, weights, layout, ExportOptions(dtype="bf16"))
    assert a == ex.model.SerializeToString(deterministic=True)
    inits = {i.name for i in ex.model.graph.initializer}
    for lid in cfg.engram.layer_ids:
        names = engram_tensor_names(lid)
        assert names["table"] not in inits and names["scale"] not in inits
    ops = [n for n in ex.model.graph.node if n.op_type in PLUGIN_NAMES]
    assert sorted({n.op_type for n in ops}) == sorted(PLUGIN_NAMES) == ex.io["plugins"]
    for n in ops:
        attrs = {a.name: a for a in n.attribute}
        assert attrs["plugin_version"].s == b"1"
        assert attrs["plugin_namespace"].s == b"engram_trt"  # the creators' namespace, read by the ONNX parser
    assert not any(n.op_type in ("Attention", "Concat") for n in ex.model.graph.node)  # no whole-cache copy


@pytest.fixture(scope="module")
def demo_ckpt(demo_dir: Path) -> Checkpoint:
    return Checkpoint.open(demo_dir)


def test_demo_checkpoint_float32(demo_ckpt: Checkpoint) -> None:
    """The demo checkpoint (real tokenizer, FP8 tables read in place from the shards)."""
    from engram_trt.engram.tokenizer import build_compressed_vocab
    from engram_trt.models.engram_llama.model import model_weight_shapes

    cfg = demo_ckpt.config
    vocab = build_compressed_vocab(demo_ckpt.tokenizer_json)
    layout = EngramLayout.from_spec(cfg.engram, pad_id=int(vocab.lookup[cfg.engram.pad_token_id]))
    weights = {n: demo_ckpt.get(n) for n in model_weight_shapes(cfg)}
    tables = []
    for lid in cfg.engram.layer_ids:
        names = engram_tensor_names(lid)
        tables.append((demo_ckpt.raw_rows_view(names["table"]), demo_ckpt.raw_rows_view(names["scale"])))
        weights[names["table"]] = demo_ckpt.get(names["table"])
        weights[names["scale"]] = demo_ckpt.get(names["scale"])
    ref = EngramLlama(cfg, weights, compress_lookup=vocab.lookup, layout=layout, dtype=torch.float32)
    for opts, tol in ((ExportOptions(dtype="fp32"), 1e-4), (ExportOptions(dtype="fp32", gate_dtype="bf16"), 5e-2)):
        ex = export_model(cfg, weights, layout, opts)
        runner = ReferenceRunner(ex, cfg, tables, vocab.lookup, num_slots=6, max_seq_len=32)
        assert _run_schedule(runner, ref, seed=6, schedule=SCHEDULE[:3]) <= tol


def test_multipliers_travel_as_exact_decimal_text() -> None:
    """The hash multipliers (up to ~2^62) travel as one STRING attribute, which the
    ONNX parser hands to the plugin byte for byte (INTS would be narrowed to int32);
    the text round-trips exactly and the graph's EngramHash node carries it."""
    import onnx

    import engram_trt.models.engram_llama.onnx_export as ox
    from engram_trt.models import export as mx

    cfg, lookup, layout, weights = _small()
    enc = mx.encode_multipliers(layout.multipliers)
    assert isinstance(enc["multipliers"], str)
    assert np.array_equal(mx.decode_multipliers(enc["multipliers"]), layout.multipliers.reshape(-1))
    assert layout.multipliers.max() > 2**40  # the values int32 could not carry
    exported = ox.export_model(cfg, weights, layout, ExportOptions(dtype="fp32"))
    (node,) = [n for n in exported.model.graph.node if n.op_type == "EngramHash"]
    (attr,) = [a for a in node.attribute if a.name == "multipliers"]
    assert attr.type == onnx.AttributeProto.STRING
    assert np.array_equal(mx.decode_multipliers(attr.s), layout.multipliers.reshape(-1))


def test_fp16_graph_builds_an_rtx_engine_with_an_fp16_gate(
    tmp_path: Path, plugin_lib: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An fp16 export (no casts around the gate) parses and builds into a TensorRT-RTX
    engine: the EngramGate layers take and return float16, and every EngramAttention
    layer takes and returns float16 caches."""
    from engram_trt.native import trt_compat
    from engram_trt.builder.build import build_engine

    if not (trt_compat.module_available("tensorrt_rtx_bindings") or trt_compat.module_available("tensorrt_rtx")):
        pytest.skip("TensorRT-RTX is not installed")
    lib = plugin_lib
    monkeypatch.setenv("ENGRAM_TRT_FLAVOUR", "tensorrt_rtx")
    t = trt_compat.load("tensorrt_rtx").module
    cfg, lookup, layout, weights = _small()
    ex = export_model(cfg, weights, layout, ExportOptions(dtype="fp16", max_position=32))
    assert all("Cast" not in n for n in _gate_neighbours(ex.model))
    path = tmp_path / "model.onnx"
    ex.save(path)
    nbytes, plugins = build_engine(
        path,
        ex,
        cfg,
        engine_path=tmp_path / "model.engine",
        max_batch=2,
        max_seq_len=32,
        max_num_tokens=64,
        targets=("sm80",),
        plugin_library=lib,
        embed_plugin_library=False,
    )
    assert nbytes > 10_000 and plugins.count("EngramGate/1") == len(cfg.engram.layer_ids)
    assert plugins.count("EngramAttention/1") == cfg.num_hidden_layers
    # the plugins' types in the parsed network
    network = trt_compat.create_network(trt_compat.create_builder())
    trt_compat.parse_onnx_file(trt_compat.onnx_parser(network), path)
    layers = [
        network.get_layer(i) for i in range(network.num_layers) if network.get_layer(i).type == t.LayerType.PLUGIN_V3
    ]
    gates = [layer for layer in layers if layer.num_inputs == 5]
    attention = [layer for layer in layers if layer.num_inputs == 7]
    assert len(gates) == len(cfg.engram.layer_ids) and len(attention) == cfg.num_hidden_layers
    for layer in gates:
        assert [layer.get_input(k).dtype for k in (0, 1)] == [t.float16, t.float16]
        assert layer.get_output(0).dtype == t.float16
    for layer in attention:
        assert [layer.get_input(k).dtype for k in range(5)] == [t.float16] * 5
        assert [layer.get_output(k).dtype for k in range(3)] == [t.float16] * 3
        assert layer.get_output(1).is_network_output and layer.get_output(2).is_network_output


@pytest.mark.parametrize(
    "share",
    [{}, {"column_begin": 0, "column_end": 6, "row_offset": 0}, {"column_begin": 2, "column_end": 5, "row_offset": 40}],
    ids=["fields left out", "the whole table named", "a rank's share"],
)
def test_reference_gather_honours_the_plugins_share_fields(share: dict) -> None:
    """The reference executor's EngramGather reads what the plugin reads: columns
    [column_begin, column_end) of the layer's ids, global row ids looked up in a table
    slice starting at row_offset, zero rows for ids outside it (ids 0..199 against a
    table of 100 rows, from row 0 or, for the share, rows 40..139), checked against a
    float64 NumPy dequant of the fp8 rows."""
    import ml_dtypes
    from onnx import TensorProto, helper
    from onnx.reference import ReferenceEvaluator

    from engram_trt.models.export import PLUGIN_DOMAIN
    from engram_trt.models.reference_executor import reference_ops as _reference_ops
    from engram_trt.models.reference_ops import TableRegistry

    rng = np.random.default_rng(5)
    T, L, cols, hd, qb, num_rows = 7, 2, 6, 64, 32, 100
    offset, begin, end = share.get("row_offset", 0), share.get("column_begin", 0), share.get("column_end", cols)
    codes = rng.integers(0, 256, size=(num_rows, hd), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x38  # no NaN codes
    scales = rng.integers(120, 134, size=(num_rows, hd // qb), dtype=np.uint8)
    ids = rng.integers(0, 200, size=(T, L, cols)).astype(np.int32)
    registry = TableRegistry()
    node = helper.make_node(
        "EngramGather",
        ["ids", "rows", "scales"],
        ["out"],
        domain=PLUGIN_DOMAIN,
        layer_index=1,
        n_layers=L,
        n_cols=cols,
        head_dim=hd,
        table_dtype=0,
        quant_block=qb,
        num_rows=num_rows,
        **share,
    )
    graph = helper.make_graph(
        [node],
        "g",
        [
            helper.make_tensor_value_info("ids", TensorProto.INT32, [T, L, cols]),
            helper.make_tensor_value_info("rows", TensorProto.INT64, [1]),
            helper.make_tensor_value_info("scales", TensorProto.INT64, [1]),
        ],
        [helper.make_tensor_value_info("out", TensorProto.BFLOAT16, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(PLUGIN_DOMAIN, 1)])
    ev = ReferenceEvaluator(model, new_ops=_reference_ops(registry))
    (got,) = ev.run(
        None,
        {
            "ids": ids,
            "rows": np.array([registry.register(codes)], dtype=np.int64),
            "scales": np.array([registry.register(scales)], dtype=np.int64),
        },
    )
    values = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    want = np.zeros((T, end - begin, hd))
    for t in range(T):
        for c in range(begin, end):
            r = int(ids[t, 1, c]) - offset
            if 0 <= r < num_rows:
                want[t, c - begin] = values[r] * 2.0 ** (np.repeat(scales[r].astype(np.float64), qb) - 127)
    assert got.shape == want.shape and got.dtype == ml_dtypes.bfloat16
    assert np.array_equal(got.astype(np.float64), want)  # FP8 x 2^k is exact in bf16
    local = ids[:, 1, begin:end].astype(np.int64) - offset
    outside = (local < 0) | (local >= num_rows)
    assert outside.any() and (~outside).any()  # zero rows and read rows both checked
