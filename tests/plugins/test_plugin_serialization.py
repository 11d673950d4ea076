"""The plugins' fields through the plugin harness (createPlugin and getFieldsToSerialize
need no GPU, so these run on any machine the harness builds on).

- what each plugin serializes (what TensorRT writes into an engine) is pinned field by
  field: name, PluginFieldType, length and bytes, whatever integer or float width or
  decimal text the fields came in, defaults included, unchanged through a round trip;
- a field that is missing, of the wrong type or length, given twice, empty, unknown or
  out of range is refused with one line naming the field, and the file:line that raised it.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np
import pytest

from helpers.plugins import (
    PF_CHAR,
    PF_FLOAT32,
    PF_FLOAT64,
    PF_INT16,
    PF_INT32,
    PF_INT64,
    PF_INT8,
    add_field,
    drop_field,
    harness_path,
    harness_scripts,
    pf_scalar,
    pf_text,
    pf_written,
    serialized_twice,
    set_field,
)

HARNESS = harness_path()


Fields = list[tuple[str, int, np.ndarray]]


@pytest.fixture(scope="module")
def harness():
    (common,) = harness_scripts(HARNESS, "helpers")
    return common.Harness(HARNESS)


def _hash_fields(layout) -> Fields:
    return [
        ("n_layers", PF_INT32, pf_scalar(PF_INT32, layout.num_layers)),
        ("max_ngram_size", PF_INT32, pf_scalar(PF_INT32, layout.max_ngram_size)),
        ("n_heads", PF_INT32, pf_scalar(PF_INT32, layout.n_heads)),
        ("pad_id", PF_INT64, pf_scalar(PF_INT64, layout.pad_id)),
        ("compressed_vocab_size", PF_INT64, pf_scalar(PF_INT64, layout.compressed_vocab_size)),
        ("primes", PF_INT64, layout.primes.reshape(-1).astype(np.int64)),
        ("offsets", PF_INT64, layout.offsets.reshape(-1).astype(np.int64)),
        ("multipliers", PF_INT64, layout.multipliers.reshape(-1).astype(np.int64)),
    ]


GATHER = [
    ("layer_index", PF_INT32, pf_scalar(PF_INT32, 1)),
    ("n_layers", PF_INT32, pf_scalar(PF_INT32, 2)),
    ("n_cols", PF_INT32, pf_scalar(PF_INT32, 8)),
    ("head_dim", PF_INT32, pf_scalar(PF_INT32, 64)),
    ("table_dtype", PF_INT32, pf_scalar(PF_INT32, 0)),
    ("quant_block", PF_INT32, pf_scalar(PF_INT32, 32)),
    ("num_rows", PF_INT64, pf_scalar(PF_INT64, 1000)),
]
GATE = [
    ("hc_mult", PF_INT32, pf_scalar(PF_INT32, 4)),
    ("hidden_size", PF_INT32, pf_scalar(PF_INT32, 64)),
    ("eps", PF_FLOAT32, pf_scalar(PF_FLOAT32, 1e-6)),
]
ATTENTION = [
    ("num_heads", PF_INT32, pf_scalar(PF_INT32, 32)),
    ("num_kv_heads", PF_INT32, pf_scalar(PF_INT32, 8)),
    ("head_dim", PF_INT32, pf_scalar(PF_INT32, 128)),
    ("scale", PF_FLOAT32, pf_scalar(PF_FLOAT32, 128**-0.5)),
]


def _base(plugin: str, layout) -> Fields:
    return {
        "EngramHash": _hash_fields(layout),
        "EngramGather": GATHER,
        "EngramGate": GATE,
        "EngramAttention": ATTENTION,
    }[plugin]


def _serialized(harness, plugin: str, fields: Fields) -> list[tuple[str, int, int, bytes]]:
    """getFieldsToSerialize of a plugin made from ``fields``, and the same of the plugin
    rebuilt from them (createPlugin in the runtime phase, as an engine is deserialized)."""
    first, again = serialized_twice(harness, plugin, fields)
    assert again == first, f"{plugin}: the round trip changed the fields"
    return first


def test_serialized_fields_are_pinned(harness, layout) -> None:
    """Each plugin writes every field it declares, in declaration order, in the declared
    type, whatever form the creator was given: int32 fields given as int64 / int16 / int8
    or text, float32 fields given as float64, int64 arrays as decimal text (the ONNX
    form); EngramGather's optional fields with their defaults when left out."""
    hash_want = [
        pf_written("n_layers", PF_INT32, 2),
        pf_written("max_ngram_size", PF_INT32, 3),
        pf_written("n_heads", PF_INT32, 4),
        pf_written("pad_id", PF_INT64, 5),
        pf_written("compressed_vocab_size", PF_INT64, 900),
        pf_written("primes", PF_INT64, layout.primes.reshape(-1)),
        pf_written("offsets", PF_INT64, layout.offsets.reshape(-1)),
        pf_written("multipliers", PF_INT64, layout.multipliers.reshape(-1)),
    ]
    assert _serialized(harness, "EngramHash", _hash_fields(layout)) == hash_want
    as_text = [
        (n, PF_CHAR, pf_text(a)) if n in ("primes", "offsets", "multipliers") else (n, PF_INT64, a.astype(np.int64))
        for n, _, a in _hash_fields(layout)
    ]
    assert _serialized(harness, "EngramHash", as_text) == hash_want

    gather_want = [
        pf_written("layer_index", PF_INT32, 1),
        pf_written("n_layers", PF_INT32, 2),
        pf_written("n_cols", PF_INT32, 8),
        pf_written("head_dim", PF_INT32, 64),
        pf_written("table_dtype", PF_INT32, 0),
        pf_written("quant_block", PF_INT32, 32),
        pf_written("num_rows", PF_INT64, 1000),
    ]
    defaults = [
        pf_written("bad_rows_input", PF_INT32, 0),
        pf_written("column_begin", PF_INT32, 0),
        pf_written("column_end", PF_INT32, 8),
        pf_written("row_offset", PF_INT64, 0),
    ]
    assert _serialized(harness, "EngramGather", GATHER) == gather_want + defaults
    share = [
        ("row_offset", PF_INT32, pf_scalar(PF_INT32, 700)),
        ("column_end", PF_INT64, pf_scalar(PF_INT64, 5)),
        ("bad_rows_input", PF_INT8, pf_scalar(PF_INT8, 1)),
        ("column_begin", PF_CHAR, pf_text([2])),
    ]
    assert _serialized(harness, "EngramGather", GATHER + share) == gather_want + [
        pf_written("bad_rows_input", PF_INT32, 1),
        pf_written("column_begin", PF_INT32, 2),
        pf_written("column_end", PF_INT32, 5),
        pf_written("row_offset", PF_INT64, 700),
    ]

    gate = [
        ("eps", PF_FLOAT64, pf_scalar(PF_FLOAT64, 1e-5)),
        ("hidden_size", PF_INT16, pf_scalar(PF_INT16, 64)),
        ("hc_mult", PF_INT64, pf_scalar(PF_INT64, 4)),
    ]
    assert _serialized(harness, "EngramGate", gate) == [
        pf_written("hc_mult", PF_INT32, 4),
        pf_written("hidden_size", PF_INT32, 64),
        pf_written("eps", PF_FLOAT32, 1e-5),
    ]
    attention = [
        ("num_heads", PF_CHAR, pf_text([32])),
        ("num_kv_heads", PF_INT8, pf_scalar(PF_INT8, 8)),
        ("head_dim", PF_INT64, pf_scalar(PF_INT64, 128)),
        ("scale", PF_FLOAT64, pf_scalar(PF_FLOAT64, 0.088)),
    ]
    assert _serialized(harness, "EngramAttention", attention) == [
        pf_written("num_heads", PF_INT32, 32),
        pf_written("num_kv_heads", PF_INT32, 8),
        pf_written("head_dim", PF_INT32, 128),
        pf_written("scale", PF_FLOAT32, 0.088),
    ]


def _put(name: str, ftype: int, data: np.ndarray) -> Callable[[Fields], Fields]:
    """The field replaced, or added when the valid fields leave it out (an optional one)."""
    return lambda fields: (
        set_field(name, ftype, data)(fields)
        if any(f[0] == name for f in fields)
        else add_field(name, ftype, data)(fields)
    )


REQUIRED = {
    "EngramHash": [
        "n_layers",
        "max_ngram_size",
        "n_heads",
        "pad_id",
        "compressed_vocab_size",
        "primes",
        "offsets",
        "multipliers",
    ],
    "EngramGather": ["layer_index", "n_layers", "n_cols", "head_dim", "table_dtype", "quant_block", "num_rows"],
    "EngramGate": ["hc_mult", "hidden_size", "eps"],
    "EngramAttention": ["num_heads", "num_kv_heads", "head_dim", "scale"],
}

I32_RANGE = "[-2147483648, 2147483647]"
# Every bounded field at the first value past each end of its range: (plugin, field,
# type given, value, the range the refusal names).
OUT_OF_RANGE = [
    ("EngramHash", "n_layers", PF_INT32, 0, "[1, 512]"),
    ("EngramHash", "max_ngram_size", PF_INT32, 1, "[2, 16]"),
    ("EngramHash", "max_ngram_size", PF_INT32, 17, "[2, 16]"),
    ("EngramHash", "n_heads", PF_INT64, 513, "[1, 512]"),
    ("EngramGather", "layer_index", PF_INT32, -1, "[0, 2147483647]"),
    ("EngramGather", "n_layers", PF_INT32, 0, "[1, 2147483647]"),
    ("EngramGather", "head_dim", PF_INT32, 0, "[1, 2147483647]"),
    ("EngramGather", "table_dtype", PF_INT32, -1, "[0, 3]"),
    ("EngramGather", "table_dtype", PF_INT32, 4, "[0, 3]"),
    ("EngramGather", "quant_block", PF_INT64, 2**31, I32_RANGE),
    ("EngramGather", "bad_rows_input", PF_INT32, -1, "[0, 1]"),
    ("EngramGather", "column_end", PF_INT64, -(2**31) - 1, I32_RANGE),
    ("EngramGate", "hc_mult", PF_INT32, 0, "[1, 65535]"),
    ("EngramGate", "hidden_size", PF_INT32, 7, "[8, 2147483647]"),
    ("EngramAttention", "num_heads", PF_INT32, 0, "[1, 2147483647]"),
    ("EngramAttention", "head_dim", PF_INT32, 7, "[8, 256]"),
    ("EngramAttention", "head_dim", PF_INT32, 257, "[8, 256]"),
]

# (plugin, change of the valid fields, the refusal's message, the file that raises it)
MALFORMED = (
    [
        (plugin, drop_field(name), f"missing field '{name}'", "pluginFields.cpp")
        for plugin, names in REQUIRED.items()
        for name in names
    ]
    + [
        (
            plugin,
            _put(name, ftype, pf_scalar(ftype, value)),
            f"field '{name}' = {value} is outside {bounds}",
            "pluginFields.cpp",
        )
        for plugin, name, ftype, value, bounds in OUT_OF_RANGE
    ]
    + [
        # the wrong type
        (
            "EngramGate",
            set_field("hc_mult", PF_FLOAT32, pf_scalar(PF_FLOAT32, 4.0)),
            "field 'hc_mult' must be an integer",
            "pluginFields.cpp",
        ),
        (
            "EngramGate",
            set_field("eps", PF_INT32, pf_scalar(PF_INT32, 0)),
            "field 'eps' must be a float",
            "pluginFields.cpp",
        ),
        (
            "EngramAttention",
            set_field("scale", PF_INT64, pf_scalar(PF_INT64, 1)),
            "field 'scale' must be a float",
            "pluginFields.cpp",
        ),
        (
            "EngramGather",
            set_field("num_rows", PF_FLOAT64, pf_scalar(PF_FLOAT64, 1000.0)),
            "field 'num_rows' must be an integer",
            "pluginFields.cpp",
        ),
        (
            "EngramGather",
            add_field("bad_rows_input", PF_FLOAT32, pf_scalar(PF_FLOAT32, 1.0)),
            "field 'bad_rows_input' must be an integer",
            "pluginFields.cpp",
        ),
        (
            "EngramHash",
            set_field("primes", PF_FLOAT64, np.full(16, 3.0)),
            "field 'primes' must be integers (got PluginFieldType 2, length 16)",
            "pluginFields.cpp",
        ),
        (
            "EngramHash",
            set_field("multipliers", PF_INT32, np.ones(6, np.int32)),
            "field 'multipliers' needs 64-bit integers but came as a narrower type",
            "pluginFields.cpp",
        ),
        # the wrong length, given twice, empty, unknown
        (
            "EngramGather",
            set_field("n_cols", PF_INT32, np.array([8, 8], np.int32)),
            "field 'n_cols' must hold 1 value, not 2",
            "pluginFields.cpp",
        ),
        (
            "EngramGate",
            set_field("eps", PF_FLOAT32, np.array([1e-6, 1e-6], np.float32)),
            "field 'eps' must hold 1 value, not 2",
            "pluginFields.cpp",
        ),
        (
            "EngramHash",
            set_field("pad_id", PF_CHAR, pf_text([5, 6])),
            "field 'pad_id' must hold 1 integer",
            "pluginFields.cpp",
        ),
        (
            "EngramHash",
            set_field("offsets", PF_INT64, np.zeros(15, np.int64)),
            "field 'offsets' must hold 16 values, not 15",
            "pluginFields.cpp",
        ),
        (
            "EngramHash",
            set_field("multipliers", PF_CHAR, pf_text([1, 3, 5, 7, 9])),
            "field 'multipliers' must hold 6 values, not 5",
            "pluginFields.cpp",
        ),
        (
            "EngramGate",
            add_field("hc_mult", PF_INT32, pf_scalar(PF_INT32, 4)),
            "field 'hc_mult' given twice",
            "pluginFields.cpp",
        ),
        (
            "EngramAttention",
            set_field("head_dim", PF_INT32, np.zeros(0, np.int32)),
            "field 'head_dim' is empty",
            "pluginFields.cpp",
        ),
        (
            "EngramGather",
            add_field("colum_end", PF_INT32, pf_scalar(PF_INT32, 4)),
            "unknown field(s) colum_end for plugin EngramGather",
            "pluginFields.cpp",
        ),
        # the hash layout's slot bound comes before its arrays are read: a missing array is
        # not what is reported when the counts are already too large
        (
            "EngramHash",
            lambda f: drop_field("primes")(set_field("n_heads", PF_INT32, pf_scalar(PF_INT32, 300))(f)),
            "n_layers * (max_ngram_size - 1) * n_heads = 1200 exceeds 512",
            "engramHashPlugin.cpp",
        ),
        # checks across fields, after parsing (the plugin's own)
        (
            "EngramGather",
            add_field("column_end", PF_INT32, pf_scalar(PF_INT32, 9)),
            "column_end must be in [column_begin + 1, n_cols] = [1, 8], got 9",
            "engramGatherPlugin.cpp",
        ),
        (
            "EngramGate",
            set_field("eps", PF_FLOAT64, pf_scalar(PF_FLOAT64, float("nan"))),
            "eps must be finite and >= 0",
            "engramGatePlugin.cpp",
        ),
    ]
)


@pytest.mark.parametrize(
    "plugin, change, message, source", MALFORMED, ids=[f"{p}-{m[:48]}" for p, _, m, _ in MALFORMED]
)
def test_malformed_fields_are_refused_naming_the_field(
    harness, layout, plugin: str, change, message: str, source: str
) -> None:
    fields = change(list(_base(plugin, layout)))
    with pytest.raises(RuntimeError) as failure:
        harness.lib.harness_destroy(harness.create(plugin, fields))
    text = str(failure.value)
    assert f"createPlugin({plugin}) returned null: {plugin}: {message}" in text, text
    assert re.search(re.escape(message) + r".* \(" + re.escape(source) + r":\d+\)$", text), text


def test_the_valid_fields_and_range_edges_are_accepted(harness, layout) -> None:
    """The controls of the refusals above: the unchanged fields, and each bound itself."""
    edges = [
        ("EngramHash", []),
        ("EngramGather", []),
        ("EngramGate", []),
        ("EngramAttention", []),
        ("EngramHash", [set_field("primes", PF_INT32, layout.primes.reshape(-1).astype(np.int32))]),  # narrow is fine
        (
            "EngramGather",
            [
                set_field("table_dtype", PF_INT32, pf_scalar(PF_INT32, 1)),
                set_field("quant_block", PF_INT64, pf_scalar(PF_INT64, -(2**31))),
            ],
        ),
        (
            "EngramGather",
            [
                add_field("bad_rows_input", PF_INT32, pf_scalar(PF_INT32, 1)),
                add_field("column_begin", PF_INT32, pf_scalar(PF_INT32, 7)),
            ],
        ),
        (
            "EngramGate",
            [
                set_field("hc_mult", PF_INT32, pf_scalar(PF_INT32, 65535)),
                set_field("hidden_size", PF_INT32, pf_scalar(PF_INT32, 8)),
            ],
        ),
        ("EngramAttention", [set_field("head_dim", PF_INT32, pf_scalar(PF_INT32, 256))]),
        ("EngramAttention", [set_field("head_dim", PF_INT32, pf_scalar(PF_INT32, 8))]),
    ]
    for plugin, changes in edges:
        fields = list(_base(plugin, layout))
        for change in changes:
            fields = change(fields)
        harness.lib.harness_destroy(harness.create(plugin, fields))
