"""The exported graph, run on the CPU with the Engram ops bound to the Python reference,
against the PyTorch reference model (EngramLlama): prefill and decode logits.

Tolerances (stated, and why):
* float32 graph exactly as built (the EngramGate plugin takes float32 hidden/kv, so no
  casts around it): 1e-4 absolute on logits of magnitude ~4: the two are the same
  float32 computation up to operation order.
* float32 graph with the gate forced to bf16 (``gate_dtype='bf16'``, casts around it):
  5e-2 absolute: one bf16 rounding (2^-9 relative) of the residual stream per Engram
  layer, carried through the rest of the network.
* bf16 graph: it must run and stay within 0.25 absolute of the float32 reference.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engram_trt.checkpoint.checkpoint import Checkpoint, engram_tensor_names
from engram_trt.config.model import ModelConfig
from engram_trt.checkpoint.demo import random_weights
from engram_trt.engram.layout import EngramLayout
from engram_trt.reference.model import EngramLlama
from engram_trt.errors import EngramError
from engram_trt.builder.onnx_export import GATE_IO_DTYPES, PLUGIN_NAMES, ExportOptions, ReferenceRunner, export_model

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=500, hc_mult=2, tie_word_embeddings=False, max_position_embeddings=128,
             engram_layer_ids=[0, 2], engram_max_ngram_size=3, engram_n_heads=2, engram_head_dim=32,
             engram_vocab_size=300, engram_compressed_vocab_size=400, engram_pad_token_id=3)


def _small(table_dtype: str = "fp8", hc: int = 2):
    cfg = ModelConfig.from_dict({**SMALL, "engram_table_dtype": table_dtype, "hc_mult": hc})
    lookup = np.arange(cfg.vocab_size) % cfg.engram.compressed_vocab_size
    lookup[7] = -1  # a token with no compressed id: dead for Engram
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


def _compare(cfg, lookup, layout, weights, tables, opts: ExportOptions, tol: float, batch: int = 2, prompt: int = 7,
             steps: int = 3, seed: int = 1) -> float:
    ref = EngramLlama(cfg, weights, compress_lookup=lookup, layout=layout, dtype=torch.float32)
    ex = export_model(cfg, weights, layout, opts)
    runner = ReferenceRunner(ex, cfg, tables, lookup)
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, cfg.vocab_size, size=(batch, prompt))
    ids[0, min(3, prompt - 1)] = 7  # dead token inside the prompt
    runner.reset(batch)
    cache = ref.new_cache(batch, prompt + steps + 1)
    worst = 0.0
    got, want = runner.step(ids), ref.forward(torch.as_tensor(ids), cache).numpy()
    assert got.shape == want.shape == (batch, prompt, cfg.vocab_size) and got.dtype == np.float32
    worst = max(worst, float(np.abs(got - want).max()))
    for _ in range(steps):
        nxt = rng.integers(0, cfg.vocab_size, size=(batch, 1))
        got, want = runner.step(nxt), ref.forward(torch.as_tensor(nxt), cache).numpy()
        worst = max(worst, float(np.abs(got - want).max()))
    assert np.isfinite(worst) and worst <= tol, f"max |logit difference| {worst} > {tol}"
    return worst


@pytest.mark.parametrize("table_dtype, hc", [("fp8", 2), ("bf16", 1), ("fp8", 4)])
def test_small_model_float32_tight(table_dtype: str, hc: int) -> None:
    cfg, lookup, layout, weights = _small(table_dtype, hc)
    _compare(cfg, lookup, layout, weights, _tables(cfg, weights), ExportOptions(dtype="fp32"), 1e-4)


def _gate_neighbours(model) -> list[tuple[str, str, str]]:
    """Per EngramGate node: (op producing hidden, op producing kv, op consuming the output)."""
    producers = {o: n for n in model.graph.node for o in n.output}
    consumers = {i: n for n in model.graph.node for i in n.input}
    return [(producers[n.input[0]].op_type, producers[n.input[1]].op_type, consumers[n.output[0]].op_type)
            for n in model.graph.node if n.op_type == "EngramGate"]


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_gate_takes_the_graph_dtype_without_casts(dtype: str) -> None:
    """Every dtype the plugin takes (GATE_IO_DTYPES) feeds the gate directly: no Cast
    before hidden / kv or after the output (hidden and kv are Reshapes of the graph's
    residual stream and wkv output)."""
    assert dtype in GATE_IO_DTYPES
    cfg, lookup, layout, weights = _small()
    model = export_model(cfg, weights, layout, ExportOptions(dtype=dtype)).model
    neighbours = _gate_neighbours(model)
    assert len(neighbours) == len(cfg.engram.layer_ids)
    assert all(n == ("Reshape", "Reshape", "Reshape") for n in neighbours), neighbours
    # an explicit bf16 gate in a float32 graph still casts around it
    forced = export_model(cfg, weights, layout, ExportOptions(dtype="fp32", gate_dtype="bf16")).model
    assert all(n == ("Cast", "Cast", "Cast") for n in _gate_neighbours(forced))
    with pytest.raises(EngramError, match="--dtype 'fp64' is not supported"):
        ExportOptions(dtype="fp32", gate_dtype="fp64")


def test_chunked_prefill_through_the_graph() -> None:
    """Chunks of several tokens after a cached past (P > 0 and S > 1: the causal mask
    over [S, P+S] and the hash lookback across chunks) equal one full reference forward."""
    cfg, lookup, layout, weights = _small()
    ref = EngramLlama(cfg, weights, compress_lookup=lookup, layout=layout, dtype=torch.float32)
    runner = ReferenceRunner(export_model(cfg, weights, layout, ExportOptions(dtype="fp32")),
                             cfg, _tables(cfg, weights), lookup)
    ids = np.random.default_rng(5).integers(0, cfg.vocab_size, size=(2, 9))
    want = ref.forward(torch.as_tensor(ids)).numpy()
    runner.reset(2)
    got = np.concatenate([runner.step(ids[:, a:b]) for a, b in ((0, 3), (3, 7), (7, 9))], axis=1)
    assert np.abs(got - want).max() <= 1e-4


def test_small_model_float32_with_a_bf16_gate() -> None:
    cfg, lookup, layout, weights = _small()
    _compare(cfg, lookup, layout, weights, _tables(cfg, weights), ExportOptions(dtype="fp32", gate_dtype="bf16"), 5e-2)


def test_small_model_bf16_runs() -> None:
    cfg, lookup, layout, weights = _small()
    _compare(cfg, lookup, layout, weights, _tables(cfg, weights), ExportOptions(dtype="bf16"), 0.25, steps=2)


def test_prefetch_placement_takes_rows() -> None:
    """The prefetch graph has no hash/gather; fed the reference's rows it matches."""
    cfg, lookup, layout, weights = _small()
    ref = EngramLlama(cfg, weights, compress_lookup=lookup, layout=layout, dtype=torch.float32)
    ex = export_model(cfg, weights, layout, ExportOptions(dtype="fp32", placement="prefetch"))
    ops = {n.op_type for n in ex.model.graph.node}
    assert "EngramGate" in ops and "EngramHash" not in ops and "EngramGather" not in ops
    runner = ReferenceRunner(ex, cfg, (), lookup)
    ids = np.random.default_rng(2).integers(0, cfg.vocab_size, size=(1, 5))
    runner.reset(1)
    cache = ref.new_cache(1, 8)
    rows = [r.float().numpy() for r in ref.prepare_engram(torch.as_tensor(ids), cache)]
    got = runner.step(ids, engram_rows=rows)
    want = ref.forward(torch.as_tensor(ids), cache).numpy()
    assert np.abs(got - want).max() <= 1e-4


def test_no_engram_model_exports_and_matches() -> None:
    cfg = ModelConfig.from_dict({k: v for k, v in SMALL.items() if not k.startswith("engram")})
    weights = random_weights(cfg, torch.Generator().manual_seed(3))
    ref = EngramLlama(cfg, weights, dtype=torch.float32)
    ex = export_model(cfg, weights, None, ExportOptions(dtype="fp32"))
    assert not any(n.domain for n in ex.model.graph.node)
    runner = ReferenceRunner(ex, cfg)
    ids = np.random.default_rng(4).integers(0, cfg.vocab_size, size=(2, 6))
    runner.reset(2)
    cache = ref.new_cache(2, 8)
    assert np.abs(runner.step(ids) - ref.forward(torch.as_tensor(ids), cache).numpy()).max() <= 1e-4
    nxt = np.array([[5], [9]])
    assert np.abs(runner.step(nxt) - ref.forward(torch.as_tensor(nxt), cache).numpy()).max() <= 1e-4


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
    assert sorted({n.op_type for n in ops}) == sorted(PLUGIN_NAMES)
    for n in ops:
        attrs = {a.name: a for a in n.attribute}
        assert attrs["plugin_version"].s == b"1"
    names = [i.name for i in ex.model.graph.input]
    assert {"engram_ids", "engram_lookback", "engram_table_ptrs", "engram_scale_ptrs"} <= set(names)


@pytest.fixture(scope="module")
def demo_ckpt(demo_dir: Path) -> Checkpoint:
    return Checkpoint.open(demo_dir)


def test_demo_checkpoint_float32(demo_ckpt: Checkpoint) -> None:
    """The demo checkpoint (real tokenizer, FP8 tables read in place from the shards)."""
    from engram_trt.reference.model import model_weight_shapes
    from engram_trt.engram.tokenizer import build_compressed_vocab

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
    _compare(cfg, vocab.lookup, layout, weights, tables, ExportOptions(dtype="fp32"), 1e-4,
             batch=1, prompt=6, steps=2)
    _compare(cfg, vocab.lookup, layout, weights, tables, ExportOptions(dtype="fp32", gate_dtype="bf16"), 5e-2,
             batch=1, prompt=6, steps=2)


def test_multipliers_travel_as_exact_decimal_text() -> None:
    """The hash multipliers (up to ~2^62) travel as one STRING attribute, which the
    ONNX parser hands to the plugin byte for byte (INTS would be narrowed to int32);
    the text round-trips exactly and the graph's EngramHash node carries it."""
    import onnx

    import engram_trt.builder.onnx_export as ox

    cfg, lookup, layout, weights = _small()
    enc = ox.encode_multipliers(layout.multipliers)
    assert isinstance(enc["multipliers"], str)
    assert np.array_equal(ox.decode_multipliers(enc["multipliers"]), layout.multipliers.reshape(-1))
    assert layout.multipliers.max() > 2**40  # the values int32 could not carry
    exported = ox.export_model(cfg, weights, layout, ExportOptions(dtype="fp32"))
    (node,) = [n for n in exported.model.graph.node if n.op_type == "EngramHash"]
    (attr,) = [a for a in node.attribute if a.name == "multipliers"]
    assert attr.type == onnx.AttributeProto.STRING
    assert np.array_equal(ox.decode_multipliers(attr.s), layout.multipliers.reshape(-1))


def test_fp16_graph_builds_an_rtx_engine_with_an_fp16_gate(tmp_path: Path, plugin_lib: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """An fp16 export (no casts around the gate) parses and builds into a TensorRT-RTX
    engine: the EngramGate layers take and return float16."""
    from engram_trt import trt_compat
    from engram_trt.builder.build import build_engine

    if not (trt_compat.module_available("tensorrt_rtx_bindings") or trt_compat.module_available("tensorrt_rtx")):
        pytest.skip("TensorRT-RTX is not installed")
    lib = plugin_lib
    monkeypatch.setenv("ENGRAM_TRT_FLAVOUR", "tensorrt_rtx")
    t = trt_compat.load("tensorrt_rtx").module
    cfg, lookup, layout, weights = _small()
    ex = export_model(cfg, weights, layout, ExportOptions(dtype="fp16"))
    assert all("Cast" not in n for n in _gate_neighbours(ex.model))
    path = tmp_path / "model.onnx"
    ex.save(path)
    nbytes, plugins = build_engine(path, ex, cfg, engine_path=tmp_path / "model.engine", max_batch=2, max_seq_len=64,
                                   max_num_tokens=32, targets=("sm80",), plugin_library=lib,
                                   embed_plugin_library=False)
    assert nbytes > 10_000 and plugins.count("EngramGate/1") == len(cfg.engram.layer_ids)
    # the gate's types in the parsed network: hidden, kv and output float16
    network = trt_compat.create_network(trt_compat.create_builder())
    trt_compat.parse_onnx_file(trt_compat.onnx_parser(network), path)
    gates = [network.get_layer(i) for i in range(network.num_layers)
             if network.get_layer(i).type == t.LayerType.PLUGIN_V3 and network.get_layer(i).num_inputs == 5]
    assert len(gates) == len(cfg.engram.layer_ids)
    for layer in gates:
        assert [layer.get_input(k).dtype for k in (0, 1)] == [t.float16, t.float16]
        assert layer.get_output(0).dtype == t.float16
