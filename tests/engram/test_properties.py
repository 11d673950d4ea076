"""Property tests on random inputs: config parsing, the safetensors header reader
(against the safetensors library itself), --ids parsing, and the hash (against an
independent loop written from docs/engram-spec.md)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from engram_trt.checkpoint.checkpoint import ST_DTYPES, _tensor_infos
from engram_trt.cli.mechanism import _parse_ids
from engram_trt.config.jsonfile import parse_json_text
from engram_trt.config.model import INT32_MAX, LIMITS, ModelConfig, parse_engram_spec
from engram_trt.engram.hashing import hash_ids
from engram_trt.engram.layout import EngramLayout
from engram_trt.errors import CheckpointError, ConfigError, EngramError

SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)

# ---------------------------------------------------------------- config parsing
BASE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1000,
    "hc_mult": 2,
    "engram_layer_ids": [1, 2],
    "engram_max_ngram_size": 3,
    "engram_n_heads": 2,
    "engram_head_dim": 32,
    "engram_vocab_size": 500,
    "engram_compressed_vocab_size": 700,
    "engram_pad_token_id": 1,
}

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)
interesting_ints = st.one_of(
    st.integers(-3, 40), st.sampled_from([0, 1, 2, 15, 16, 17, 511, 512, 513, 2**31 - 1, 2**31, 2**63, 10**30])
)


@SETTINGS
@given(
    patch=st.dictionaries(
        st.sampled_from(
            sorted(BASE)
            + [
                "engram_num_embeddings",
                "engram_quant_block",
                "engram_table_dtype",
                "rope_theta",
                "rms_norm_eps",
                "eos_token_id",
                "head_dim",
                "max_position_embeddings",
                "tie_word_embeddings",
            ]
        ),
        st.one_of(interesting_ints, json_values, st.lists(interesting_ints, min_size=1, max_size=5)),
        max_size=4,
    )
)
@example(patch={"engram_layer_ids": None})  # the other Engram fields stray: refused naming the source file
def test_config_parsing_accepts_only_bounded_values(patch: dict[str, Any]) -> None:
    """Any mutation of a good config either parses into values within every bound (and
    round-trips), or is refused with one ConfigError line naming a field; nothing else
    escapes, and the layout of an accepted config is quick to compute."""
    d = BASE | patch
    try:
        cfg = ModelConfig.from_dict(d, source="config.json")
    except ConfigError as exc:
        assert "\n" not in str(exc) and str(exc).startswith("config.json: ") and len(str(exc)) < 600
        return
    for name in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "max_position_embeddings",
        "hc_mult",
    ):
        assert 1 <= getattr(cfg, name) <= LIMITS[name], name
    spec = cfg.engram
    assert spec is not None
    assert (
        2 <= spec.max_ngram_size <= 16
        and 1 <= spec.n_heads
        and len(spec.layer_ids) * (spec.max_ngram_size - 1) * spec.n_heads <= 512
    )
    assert all(0 <= lid < cfg.num_hidden_layers for lid in spec.layer_ids)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    try:
        layout = EngramLayout.from_spec(spec, 0)
    except ConfigError:
        return  # e.g. engram_num_embeddings too small for the primes: refused, in one line
    assert int(layout.table_rows.max()) <= INT32_MAX


@SETTINGS
@given(raw=st.binary(max_size=200) | st.text(max_size=200).map(lambda s: s.encode("utf-8", "surrogatepass")))
def test_json_reader_refuses_in_one_line(raw: bytes) -> None:
    try:
        value = parse_json_text(raw, "f.json")
    except ConfigError as exc:
        assert "\n" not in str(exc) and str(exc).startswith("f.json: ")
        return
    assert json.loads(raw.decode("utf-8-sig")) == value  # what we accept is what JSON says (NaN never is)


@SETTINGS
@given(depth=st.integers(60, 5000), kind=st.sampled_from(["[", '{"a":']))
def test_deep_json_is_refused_not_a_crash(depth: int, kind: str) -> None:
    text = kind * depth + "1" + ("]" if kind == "[" else "}") * depth
    if depth <= 64:
        return
    with pytest.raises(ConfigError, match="nested too deeply"):
        parse_json_text(text, "f.json")


# ---------------------------------------------------------------- safetensors headers
OUR_DTYPES = sorted(ST_DTYPES)


@st.composite
def headers(draw: Any) -> tuple[bytes, bytes, bool]:
    """(header bytes, data bytes, structured): mostly well-formed headers with random
    dtypes, shapes and orders, then a random defect (a gap, an overlap, extra bytes, a
    wrong span, an unknown dtype, bad metadata, a float in a shape, ...) or none."""
    n = draw(st.integers(0, 4))
    names = draw(
        st.lists(
            st.text(st.characters(codec="utf-8", exclude_characters='"\\'), min_size=1, max_size=6),
            min_size=n,
            max_size=n,
            unique=True,
        )
    )
    names = [x for x in names if x != "__metadata__"]
    tensors = []
    off = 0
    for name in names:
        dtype = draw(st.sampled_from(OUR_DTYPES))
        shape = draw(st.lists(st.integers(0, 5), max_size=3))
        nb = ST_DTYPES[dtype][1] * int(np.prod(shape, dtype=np.int64)) if shape else ST_DTYPES[dtype][1]
        tensors.append([name, {"dtype": dtype, "shape": shape, "data_offsets": [off, off + nb]}])
        off += nb
    data_len = off
    order = draw(st.permutations(list(range(len(tensors)))))
    header: dict[str, Any] = {}
    if draw(st.booleans()):
        header["__metadata__"] = {"format": "pt"}
    for i in order:
        header[tensors[i][0]] = tensors[i][1]
    defect = draw(
        st.sampled_from(
            [
                "none",
                "none",
                "none",
                "gap",
                "overlap",
                "tail",
                "short",
                "span",
                "dtype",
                "meta",
                "float-shape",
                "neg",
                "not-object",
                "bad-utf8",
                "lead-space",
                "huge-dim",
            ]
        )
    )
    entries = [v for k, v in header.items() if k != "__metadata__"]
    if defect == "gap" and entries:
        entries[-1]["data_offsets"] = [x + 8 for x in entries[-1]["data_offsets"]]
        data_len += 8
    elif defect == "overlap" and len(entries) > 1 and entries[1]["data_offsets"][0] > 0:
        entries[1]["data_offsets"] = [x - 1 for x in entries[1]["data_offsets"]]
    elif defect == "tail":
        data_len += draw(st.integers(1, 9))
    elif defect == "short" and data_len:
        data_len -= 1
    elif defect == "span" and entries:
        entries[0]["data_offsets"][1] += 1
        data_len += 1
    elif defect == "dtype" and entries:
        entries[0]["dtype"] = draw(st.sampled_from(["F4", "C64", "Q8", "u8", ""]))
    elif defect == "meta":
        header["__metadata__"] = draw(st.sampled_from([{"x": 1}, [1], "s", {"x": None}]))
    elif defect == "float-shape" and entries and entries[0]["shape"]:
        entries[0]["shape"][0] = float(entries[0]["shape"][0])
    elif defect == "neg" and entries:
        entries[0]["data_offsets"][0] = -1
    elif defect == "huge-dim" and entries:
        entries[0]["shape"] = [2**62, 2**62, 0]
    text = json.dumps(header, ensure_ascii=draw(st.booleans()))
    if defect == "not-object":
        text = json.dumps(entries)
    raw = text.encode()
    if defect == "bad-utf8":
        raw = raw[:-1] + b"\xff}"
    if defect == "lead-space":
        raw = b" " + raw
    raw += b" " * draw(st.integers(0, 7))  # padding, as writers align the data
    return raw, bytes(data_len), defect == "none"


@settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(case=headers())
def test_header_reader_agrees_with_the_safetensors_library(
    case: tuple[bytes, bytes, bool], tmp_path_factory: Any
) -> None:
    """What our reader accepts, the library opens with the same names, dtypes, shapes and
    bytes; on well-formed headers of dtypes we read, the two accept the same files."""
    from safetensors import safe_open

    raw, data, structured = case
    path = Path(tmp_path_factory.mktemp("st")) / "x.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    try:
        ours = _tensor_infos(path)
    except CheckpointError as exc:
        assert "\n" not in str(exc)
        ours = None
    try:
        with safe_open(str(path), framework="np") as f:
            lib = {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}
    except Exception:  # the library's refusal
        lib = None
    if ours is not None:
        assert lib is not None, f"we accept a header the library refuses: {raw[:200]!r}"
        assert set(lib) == set(ours)
        for name, info in ours.items():
            assert lib[name][1] == info.shape
            assert lib[name][0] == info.st_dtype
            assert info.data_offset + info.nbytes <= path.stat().st_size
    if structured:
        assert (ours is None) == (lib is None), (raw[:200], ours, lib)


# ---------------------------------------------------------------- --ids
@SETTINGS
@given(
    ids=st.lists(st.integers(-1, INT32_MAX), min_size=1, max_size=30),
    spaces=st.lists(st.sampled_from(["", " ", "  ", "\t"]), min_size=2, max_size=2),
    trailing=st.booleans(),
)
def test_ids_round_trip(ids: list[int], spaces: list[str], trailing: bool) -> None:
    text = ",".join(f"{spaces[0]}{i}{spaces[1]}" for i in ids) + ("," if trailing else "")
    assert _parse_ids(text) == ids


@SETTINGS
@given(text=st.text(max_size=40))
def test_ids_parse_or_refuse_in_one_line(text: str) -> None:
    try:
        ids = _parse_ids(text)
    except EngramError as exc:
        assert str(exc).startswith("--ids: ") and "\n" not in str(exc)
        return
    assert ids and all(-1 <= i <= INT32_MAX for i in ids)
    assert all(
        part.strip().lstrip("-").isascii() and part.strip().lstrip("-").isdigit()
        for part in text.split(",")
        if part.strip()
    )


# ---------------------------------------------------------------- the hash
def hash_loop(ids: list[int], layout: EngramLayout, lookback: list[int] | None) -> list:
    """docs/engram-spec.md, "Hash of position p", one position, layer, shift and head at
    a time in Python integers (no arrays, no shared code with engram/hashing.py)."""
    n = layout.max_ngram_size
    ext = (lookback if lookback is not None else [-1] * (n - 1)) + list(ids)
    lead = n - 1
    out = []
    for p in range(len(ids)):
        per_layer = []
        for li in range(layout.num_layers):
            m = [int(x) for x in layout.multipliers[li]]
            row = [0] * layout.n_hash_cols
            rolling, blocked = 0, False
            for s in range(n):
                tok = ext[lead + p - s]
                blocked = blocked or tok < 0
                v = layout.pad_id if blocked else tok
                rolling ^= v * m[s]
                if s >= 1:
                    for h in range(layout.n_heads):
                        col = (s - 1) * layout.n_heads + h
                        row[col] = rolling % int(layout.primes[li][s - 1][h]) + int(layout.offsets[li][col])
            per_layer.append(row)
        out.append(per_layer)
    return out


@st.composite
def hash_cases(draw: Any) -> tuple[EngramLayout, list[int], list[int] | None]:
    n = draw(st.integers(2, 6))
    heads = draw(st.integers(1, 4))
    layers = draw(st.lists(st.integers(0, 60), min_size=1, max_size=3, unique=True))
    cvocab = draw(st.sampled_from([2, 3, 97, 1000, 99092, 2**31 - 1]))
    vocab: Any = draw(st.one_of(st.integers(2, 5000), st.lists(st.integers(2, 5000), min_size=n - 1, max_size=n - 1)))
    spec = parse_engram_spec(
        {
            "engram_layer_ids": layers,
            "engram_max_ngram_size": n,
            "engram_n_heads": heads,
            "engram_vocab_size": vocab,
            "engram_compressed_vocab_size": cvocab,
            "engram_pad_token_id": 0,
        }
    )
    assert spec is not None
    layout = EngramLayout.from_spec(spec, draw(st.integers(0, cvocab - 1)))
    tok = st.one_of(st.just(-1), st.integers(0, cvocab - 1))
    ids = draw(st.lists(tok, min_size=1, max_size=12))
    lookback = draw(st.none() | st.lists(tok, min_size=n - 1, max_size=n - 1))
    return layout, ids, lookback


@SETTINGS
@given(case=hash_cases())
def test_hash_equals_an_independent_loop(case: tuple[EngramLayout, list[int], list[int] | None]) -> None:
    layout, ids, lookback = case
    got = hash_ids(ids, layout, lookback)
    assert got.tolist() == hash_loop(ids, layout, lookback)
    assert (got >= 0).all() and (got < layout.table_rows[None, :, None]).all()


@SETTINGS
@given(case=hash_cases(), cut=st.integers(0, 12))
def test_hash_of_a_chunk_with_its_lookback_equals_the_whole(
    case: tuple[EngramLayout, list[int], list[int] | None], cut: int
) -> None:
    """Chunked prefill: hashing ids[cut:] with the N-1 ids before it gives the rows of
    hashing the whole sequence (what the runtime relies on between chunks)."""
    layout, ids, lookback = case
    assume(cut < len(ids))
    n = layout.max_ngram_size
    whole = hash_ids(ids, layout, lookback)
    prev = (lookback if lookback is not None else [-1] * (n - 1)) + ids[:cut]
    assert hash_ids(ids[cut:], layout, prev[len(prev) - (n - 1) :]).tolist() == whole[cut:].tolist()
