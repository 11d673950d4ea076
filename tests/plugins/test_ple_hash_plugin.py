"""The EngramPleHash plugin (plugins/engramPleHashPlugin) on a machine without a GPU.

- through the plugin harness (createPlugin and getFieldsToSerialize need no GPU): what
  the plugin serializes is pinned field by field (name, PluginFieldType, length, bytes)
  against the tests' own encoding of a PLE layer's constants from the Python reference
  (engram_trt.engram.ple_hash.PLEHashLayout), whatever integer width or decimal text the
  fields came in, unchanged through a round trip; output shape and type inference; a
  missing, out-of-range, mistyped, mis-sized or unknown field, and a layout the kernel
  cannot serve (EOS outside the vocabulary, a head past the table, an overflowing
  multiplier), is refused in one line naming it and the file:line that raised it;
- with TensorRT-RTX: the creator is registered (version "1", namespace "engram_trt")
  with its declared fields, refuses bad fields, and an ONNX graph of one EngramPleHash
  node builds into an engine on the CPU, its output [T, H] int32.
The plugin's enqueue runs on the H200 in tests/gpu/test_ple_hash.py.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from engram_trt.engram import ple_hash as ph
from engram_trt.errors import EngramError
from engram_trt.models import export
from engram_trt.native import trt_compat

from helpers.plugins import (
    PF_CHAR,
    PF_FLOAT32,
    PF_INT16,
    PF_INT32,
    PF_INT64,
    PF_INT8,
    add_field,
    drop_field,
    harness_path,
    harness_scripts,
    parse_plugin_graph,
    pf_scalar,
    pf_text,
    pf_written,
    plugin_builder_config,
    serialized_twice,
    set_field,
)

NAME = "EngramPleHash"
NAMESPACE = "engram_trt"
HARNESS = harness_path()
FIELD_NAMES = [
    "ngram_size",
    "heads_per_ngram",
    "eos_id",
    "vocab_size",
    "table_rows",
    "multipliers",
    "primes",
    "offsets",
]

Fields = list[tuple[str, int, np.ndarray]]


def make_layout(
    vocab: int = 300,
    n: int = 4,
    hpn: int = 3,
    base: int = 1000,
    divisor: int = 7,
    seed: int = 99,
    eos: int = 151,
    layers: int = 3,
) -> ph.PLEHashLayout:
    return ph.PLEHashLayout.from_config(
        vocab_size=vocab,
        ngram_size=n,
        heads_per_ngram=hpn,
        ngram_vocab_size_base=base,
        make_ngram_vocab_size_divisible_by=divisor,
        seed=seed,
        eos_token_id=eos,
        num_layers=layers,
    )


LAYOUT = make_layout()
LAYER = 1  # not the first: its primes and offsets are not layer 0's


def ple_fields(layout: ph.PLEHashLayout, layer: int) -> Fields:
    """One PLE layer's plugin fields, as an exporter writes them (int64 arrays)."""
    return [
        ("ngram_size", PF_INT32, pf_scalar(PF_INT32, layout.ngram_size)),
        ("heads_per_ngram", PF_INT32, pf_scalar(PF_INT32, layout.heads_per_ngram)),
        ("eos_id", PF_INT64, pf_scalar(PF_INT64, layout.eos_id)),
        ("vocab_size", PF_INT64, pf_scalar(PF_INT64, layout.vocab_size)),
        ("table_rows", PF_INT64, pf_scalar(PF_INT64, layout.table_rows[layer])),
        ("multipliers", PF_INT64, np.ascontiguousarray(layout.multipliers[layer], np.int64)),
        ("primes", PF_INT64, np.ascontiguousarray(layout.head_vocab_sizes[layer], np.int64)),
        ("offsets", PF_INT64, np.ascontiguousarray(layout.head_offsets[layer], np.int64)),
    ]


@pytest.fixture(scope="module")
def harness():
    (common,) = harness_scripts(HARNESS, "helpers")
    return common.Harness(HARNESS)


def _serialized(harness, fields: Fields) -> list[tuple[str, int, int, bytes]]:
    """getFieldsToSerialize of a plugin made from ``fields``, and the same of the plugin
    rebuilt from them (createPlugin in the runtime phase, as an engine is deserialized)."""
    first, again = serialized_twice(harness, NAME, fields)
    assert again == first, "the round trip changed the fields"
    return first


def test_serialized_fields_are_pinned(harness) -> None:
    """Every field in declaration order and declared type (int32 scalars, int64 scalars
    and arrays), from the exporter's int64 arrays, from decimal text (the ONNX form),
    and from narrower / wider integer scalars; layers 0 and 2 write their own arrays."""
    for layer in (0, LAYER, 2):
        want = [
            pf_written("ngram_size", PF_INT32, 4),
            pf_written("heads_per_ngram", PF_INT32, 3),
            pf_written("eos_id", PF_INT64, 151),
            pf_written("vocab_size", PF_INT64, 300),
            pf_written("table_rows", PF_INT64, LAYOUT.table_rows[layer]),
            pf_written("multipliers", PF_INT64, LAYOUT.multipliers[layer]),
            pf_written("primes", PF_INT64, LAYOUT.head_vocab_sizes[layer]),
            pf_written("offsets", PF_INT64, LAYOUT.head_offsets[layer]),
        ]
        assert [w[2] for w in want[5:]] == [4, 9, 9]  # N multipliers, H = (N-1) * heads_per_ngram heads
        assert _serialized(harness, ple_fields(LAYOUT, layer)) == want
        as_text = [
            (n, PF_CHAR, pf_text(a)) if n in ("multipliers", "primes", "offsets") else (n, t, a)
            for n, t, a in ple_fields(LAYOUT, layer)
        ]
        assert _serialized(harness, as_text) == want
    widths = [
        ("ngram_size", PF_INT64, pf_scalar(PF_INT64, 4)),
        ("heads_per_ngram", PF_INT8, pf_scalar(PF_INT8, 3)),
        ("eos_id", PF_INT32, pf_scalar(PF_INT32, 151)),
        ("vocab_size", PF_INT16, pf_scalar(PF_INT16, 300)),
        ("table_rows", PF_CHAR, pf_text([LAYOUT.table_rows[LAYER]])),
    ]
    fields = widths + ple_fields(LAYOUT, LAYER)[5:]
    assert _serialized(harness, fields) == _serialized(harness, ple_fields(LAYOUT, LAYER))


def test_output_shape_and_type(harness) -> None:
    """[T] ids -> [T, H] int32 rows, H a build-time constant; int32 in, int32 out."""
    common = harness_scripts(HARNESS, "helpers")[0]
    h = harness.create(NAME, ple_fields(LAYOUT, LAYER))
    try:
        shape, const = harness.output_shapes(h, [(37,), (4,), (3, 3)])
        assert shape == (37, 9) and const == (False, True)
        assert harness.output_types(h, [common.DT["int32"]] * 3) == [common.DT["int32"]]
        with pytest.raises(RuntimeError, match="input 2 must be int32, got"):
            harness.output_types(h, [common.DT["int32"]] * 2 + [common.DT["int64"]])
        h2 = harness.roundtrip(h)
        try:
            assert harness.output_shapes(h2, [(5,), (2,), (1, 3)])[0] == (5, 9)
        finally:
            harness.lib.harness_destroy(h2)
    finally:
        harness.lib.harness_destroy(h)


def _array(name: str, index: int, value: int) -> Callable[[Fields], Fields]:
    """One entry of an int64 array field changed."""

    def change(fields: Fields) -> Fields:
        out = []
        for n, t, d in fields:
            if n == name:
                d = d.copy()
                d[index] = value
            out.append((n, t, d))
        return out

    return change


PRIME0, OFFSET_LAST = int(LAYOUT.head_vocab_sizes[LAYER][0]), int(LAYOUT.head_offsets[LAYER][-1])
ROWS = int(LAYOUT.table_rows[LAYER])
# (change of the valid fields, the refusal's message, the file that raises it)
MALFORMED = (
    [(drop_field(name), f"missing field '{name}'", "pluginFields.cpp") for name in FIELD_NAMES]
    + [
        (
            set_field("ngram_size", PF_INT32, pf_scalar(PF_INT32, 1)),
            "field 'ngram_size' = 1 is outside [2, 16]",
            "pluginFields.cpp",
        ),
        (
            set_field("ngram_size", PF_INT64, pf_scalar(PF_INT64, 17)),
            "field 'ngram_size' = 17 is outside [2, 16]",
            "pluginFields.cpp",
        ),
        (
            set_field("ngram_size", PF_INT64, pf_scalar(PF_INT64, 2**32 + 4)),  # not narrowed to 4
            "field 'ngram_size' = 4294967300 is outside [2, 16]",
            "pluginFields.cpp",
        ),
        (
            set_field("heads_per_ngram", PF_INT32, pf_scalar(PF_INT32, 0)),
            "field 'heads_per_ngram' = 0 is outside [1, 128]",
            "pluginFields.cpp",
        ),
        (
            set_field("eos_id", PF_INT64, pf_scalar(PF_INT64, -1)),
            "field 'eos_id' = -1 is outside [0, 2147483647]",
            "pluginFields.cpp",
        ),
        (
            set_field("vocab_size", PF_INT64, pf_scalar(PF_INT64, 0)),
            "field 'vocab_size' = 0 is outside [1, 2147483648]",
            "pluginFields.cpp",
        ),
        (
            set_field("table_rows", PF_INT64, pf_scalar(PF_INT64, 2**31)),
            "field 'table_rows' = 2147483648 is outside [1, 2147483647]",
            "pluginFields.cpp",
        ),
        (
            set_field("heads_per_ngram", PF_FLOAT32, pf_scalar(PF_FLOAT32, 3.0)),
            "field 'heads_per_ngram' must be an integer",
            "pluginFields.cpp",
        ),
        (
            set_field("multipliers", PF_INT32, LAYOUT.multipliers[LAYER].astype(np.int32)),
            "field 'multipliers' needs 64-bit integers but came as a narrower type",
            "pluginFields.cpp",
        ),
        (
            set_field("primes", PF_INT64, np.zeros(8, np.int64)),
            "field 'primes' must hold 9 values, not 8",
            "pluginFields.cpp",
        ),
        (
            set_field("offsets", PF_CHAR, pf_text(LAYOUT.head_offsets[LAYER][:-1])),
            "field 'offsets' must hold 9 values, not 8",
            "pluginFields.cpp",
        ),
        (
            set_field("multipliers", PF_CHAR, pf_text([1, 3, 5, 7, 9])),
            "field 'multipliers' must hold 4 values, not 5",
            "pluginFields.cpp",
        ),
        (
            set_field("primes", PF_CHAR, np.frombuffer(b"1009+1013", np.uint8)),
            "field 'primes' holds text that is not a list of integers",
            "pluginFields.cpp",
        ),
        (add_field("eos_id", PF_INT64, pf_scalar(PF_INT64, 151)), "field 'eos_id' given twice", "pluginFields.cpp"),
        (
            add_field("pad_id", PF_INT64, pf_scalar(PF_INT64, 0)),
            "unknown field(s) pad_id for plugin EngramPleHash",
            "pluginFields.cpp",
        ),
        # the head bound comes before primes / offsets are read: a missing array is not what
        # is reported when the counts are already too large
        (
            lambda f: drop_field("primes")(set_field("heads_per_ngram", PF_INT32, pf_scalar(PF_INT32, 43))(f)),
            "(ngram_size - 1) * heads_per_ngram = 129 exceeds 128",
            "engramPleHashPlugin.cpp",
        ),
        # the layout checks across fields (engram_ple_hash_layout_create, at creation)
        (
            set_field("eos_id", PF_INT64, pf_scalar(PF_INT64, 300)),
            "eos_id 300 outside [0, vocab_size 300)",
            "engramPleHashPlugin.cpp",
        ),
        (
            set_field(
                "table_rows", PF_INT64, pf_scalar(PF_INT64, OFFSET_LAST + int(LAYOUT.head_vocab_sizes[LAYER][-1]) - 1)
            ),
            f"head 8 has prime {int(LAYOUT.head_vocab_sizes[LAYER][-1])}, offset {OFFSET_LAST}: "
            "its rows must lie in the "
            f"table's {OFFSET_LAST + int(LAYOUT.head_vocab_sizes[LAYER][-1]) - 1}",
            "engramPleHashPlugin.cpp",
        ),
        (
            _array("offsets", 0, -1),
            f"head 0 has prime {PRIME0}, offset -1: its rows must lie in the table's {ROWS}",
            "engramPleHashPlugin.cpp",
        ),
        (
            _array("primes", 0, 1),
            f"head 0 has prime 1, offset 0: its rows must lie in the table's {ROWS}",
            "engramPleHashPlugin.cpp",
        ),
        (
            _array("multipliers", 2, np.iinfo(np.int64).max // 299 + 1),
            f"multiplier[2] = {np.iinfo(np.int64).max // 299 + 1} is not in (0, INT64_MAX / (vocab_size - 1)]",
            "engramPleHashPlugin.cpp",
        ),
        (_array("multipliers", 0, 0), "multiplier[0] = 0 is not in", "engramPleHashPlugin.cpp"),
    ]
)


@pytest.mark.parametrize("change, message, source", MALFORMED, ids=[m[:48] for _, m, _ in MALFORMED])
def test_malformed_fields_are_refused_naming_the_field(harness, change, message: str, source: str) -> None:
    fields = change(ple_fields(LAYOUT, LAYER))
    with pytest.raises(RuntimeError) as failure:
        harness.lib.harness_destroy(harness.create(NAME, fields))
    text = str(failure.value)
    assert f"createPlugin({NAME}) returned null: {NAME}: " in text and message in text, text
    assert re.search(re.escape(message) + r".* \(" + re.escape(source) + r":\d+\)$", text), text


def test_the_valid_fields_and_range_edges_are_accepted(harness) -> None:
    """The controls of the refusals above: the unchanged fields, the kernel's limits
    (N = 16 with 8 heads per order: H = 120; N = 2 with 128 heads: H = 128), the last
    table row used exactly, EOS at the vocabulary's ends, the largest multiplier."""
    cases = [
        ple_fields(LAYOUT, LAYER),
        ple_fields(make_layout(vocab=50_000, n=16, hpn=8, base=100_000, eos=7), 0),
        ple_fields(make_layout(n=2, hpn=128, base=1000, divisor=1), 0),
        set_field("table_rows", PF_INT64, pf_scalar(PF_INT64, OFFSET_LAST + int(LAYOUT.head_vocab_sizes[LAYER][-1])))(
            ple_fields(LAYOUT, LAYER)
        ),
        set_field("eos_id", PF_INT64, pf_scalar(PF_INT64, 0))(ple_fields(LAYOUT, LAYER)),
        set_field("eos_id", PF_INT64, pf_scalar(PF_INT64, 299))(ple_fields(LAYOUT, LAYER)),
        _array("multipliers", 2, np.iinfo(np.int64).max // 299)(ple_fields(LAYOUT, LAYER)),
    ]
    for fields in cases:
        h = harness.create(NAME, fields)
        harness.lib.harness_destroy(h)


# --- TensorRT-RTX ------------------------------------------------------------------------

# (the trt fixture: tests/conftest.py)


def test_creator_is_registered_with_its_fields(trt) -> None:
    registry = trt.module.get_plugin_registry()
    creator = registry.get_creator(NAME, "1", NAMESPACE)
    assert creator is not None
    assert (creator.name, creator.plugin_version, creator.plugin_namespace) == (NAME, "1", NAMESPACE)
    i32, i64 = trt.module.PluginFieldType.INT32, trt.module.PluginFieldType.INT64
    # the type and length each field is declared with (what the ONNX parser converts an
    # attribute to; 0: an array whose length follows from other fields)
    assert [(f.name, f.type, f.size) for f in creator.field_names] == list(
        zip(FIELD_NAMES, [i32, i32, i64, i64, i64, i64, i64, i64], [1, 1, 1, 1, 1, 0, 0, 0])
    )
    assert (NAME, "1") in trt_compat.plugin_creator_names()
    assert registry.get_creator(NAME, "1", "") is None  # nothing of ours in the empty namespace


def _registry_fields(trt, fields: Fields):
    """A PluginFieldCollection of ``fields`` and what it points into (held by the caller
    until createPlugin has read them)."""
    m = trt.module
    kinds = {PF_INT32: m.PluginFieldType.INT32, PF_INT64: m.PluginFieldType.INT64, PF_CHAR: m.PluginFieldType.CHAR}
    arrays = [np.ascontiguousarray(d if t != PF_CHAR else d.view(np.int8)) for _, t, d in fields]
    out = [m.PluginField(n, a, kinds[t]) for (n, t, _), a in zip(fields, arrays)]
    return m.PluginFieldCollection(out), (out, arrays)


def _text_form(fields: Fields) -> Fields:
    return [(n, PF_CHAR, pf_text(d)) if n in ("multipliers", "primes", "offsets") else (n, t, d) for n, t, d in fields]


def test_registry_creator_builds_and_refuses(trt, capfd) -> None:
    creator = trt.module.get_plugin_registry().get_creator(NAME, "1", NAMESPACE)
    collection, keep = _registry_fields(trt, _text_form(ple_fields(LAYOUT, LAYER)))
    assert creator.create_plugin(NAME, collection, trt.module.TensorRTPhase.BUILD) is not None
    bad = set_field("eos_id", PF_INT64, pf_scalar(PF_INT64, 300))(ple_fields(LAYOUT, LAYER))
    collection, keep = _registry_fields(trt, _text_form(bad))
    capfd.readouterr()
    assert creator.create_plugin(NAME, collection, trt.module.TensorRTPhase.BUILD) is None
    assert (
        "EngramPleHash: engram_ple_hash_layout_create: eos_id 300 outside [0, vocab_size 300)" in capfd.readouterr().err
    )
    del keep


def _text_attributes(layout: ph.PLEHashLayout, layer: int) -> dict:
    """The node's attributes as the tests write them: every int64 array as decimal text."""

    def text(values) -> str:
        return ",".join(str(int(v)) for v in np.asarray(values).reshape(-1))

    return {
        "plugin_version": "1",
        "plugin_namespace": NAMESPACE,
        "ngram_size": layout.ngram_size,
        "heads_per_ngram": layout.heads_per_ngram,
        "eos_id": layout.eos_id,
        "vocab_size": layout.vocab_size,
        "table_rows": int(layout.table_rows[layer]),
        "multipliers": text(layout.multipliers[layer]),
        "primes": text(layout.head_vocab_sizes[layer]),
        "offsets": text(layout.head_offsets[layer]),
    }


def _ple_graph(path: Path, layout: ph.PLEHashLayout, attributes: dict) -> None:
    """ids, seq_starts, context -> EngramPleHash -> rows [T, H]."""
    import onnx
    from onnx import TensorProto, helper

    n = layout.ngram_size - 1
    node = helper.make_node(
        NAME, ["ids", "seq_starts", "context"], ["rows"], name="ple_hash", domain="engram_trt", **attributes
    )
    inputs = [
        helper.make_tensor_value_info("ids", TensorProto.INT32, ["T"]),
        helper.make_tensor_value_info("seq_starts", TensorProto.INT32, ["S1"]),
        helper.make_tensor_value_info("context", TensorProto.INT32, ["S", n]),
    ]
    outputs = [helper.make_tensor_value_info("rows", TensorProto.INT32, ["T", layout.num_heads])]
    graph = helper.make_graph([node], "ple_hash", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("engram_trt", 1)])
    onnx.save(model, str(path))


def test_exporter_attributes_name_the_creator_fields() -> None:
    """models.export's attributes for a PLE layer: the creator's field names, the
    layer's own arrays (multipliers as text), and a layer outside the layout refused."""
    attributes = export.ple_hash_plugin_attributes(LAYOUT, LAYER)
    assert export.PLE_HASH_PLUGIN == NAME
    assert sorted(attributes) == sorted(FIELD_NAMES + ["plugin_version", "plugin_namespace"])
    assert attributes["multipliers"] == _text_attributes(LAYOUT, LAYER)["multipliers"]
    assert (
        attributes["primes"]
        == [int(v) for v in LAYOUT.head_vocab_sizes[LAYER]]
        != [int(v) for v in LAYOUT.head_vocab_sizes[0]]
    )
    with pytest.raises(EngramError, match=r"^PLE layer 3 is outside \[0, 3\)"):
        export.ple_hash_plugin_attributes(LAYOUT, 3)


@pytest.mark.parametrize("form", ["exporter", "text"])
def test_onnx_graph_with_one_ple_hash_node_builds_an_engine(trt, tmp_path: Path, form: str) -> None:
    """One node, from models.export's attributes (INTS primes / offsets) or all-text
    arrays: the parser hands them to the creator, the output is [T, H] int32."""
    path = tmp_path / "ple_hash.onnx"
    attributes = (
        export.ple_hash_plugin_attributes(LAYOUT, LAYER) if form == "exporter" else _text_attributes(LAYOUT, LAYER)
    )
    _ple_graph(path, LAYOUT, attributes)
    builder, network, layer = parse_plugin_graph(trt, path)
    layer.__class__ = trt.module.IPluginV3Layer
    core = layer.plugin.get_capability_interface(trt.module.PluginCapabilityType.CORE)
    assert (core.plugin_name, core.plugin_namespace, core.plugin_version) == (NAME, NAMESPACE, "1")
    out = network.get_output(0)
    assert out.name == "rows" and tuple(out.shape) == (-1, LAYOUT.num_heads) and out.dtype == trt.module.int32

    config = plugin_builder_config(trt, builder, aliased=False)
    profile = builder.create_optimization_profile()
    n = LAYOUT.ngram_size - 1
    for name, lo, opt, hi in (
        ("ids", (1,), (64,), (512,)),
        ("seq_starts", (2,), (3,), (9,)),
        ("context", (1, n), (2, n), (8, n)),
    ):
        profile.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(profile)
    engine = builder.build_serialized_network(network, config)
    assert engine is not None and engine.nbytes > 1000
