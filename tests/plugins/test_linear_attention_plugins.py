"""The Gated DeltaNet kernels and their plugins (EngramCausalConv1d, EngramGatedDeltaNet) on
a machine without a GPU:

- the C ABI's shape checks and the ctypes binding's argument checks run without a GPU and
  name the bad argument in one line;
- with TensorRT-RTX: both creators are registered with their fields, refuse bad ones in
  one line and accept the edges of each range; an ONNX graph holding each node (with the
  exporter's attributes, its state an aliased network output) builds into an engine;
- through the plugin harness: serialized fields pinned, output shapes / types, refused
  type mixes, the aliased state, the round trip, refused fields
  (tests/gpu/test_linear_attention.check_plugin_cpu, shared with the GPU suite).
The kernels themselves run on the H200 in tests/gpu/test_linear_attention.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engram_trt.errors import EngramError
from engram_trt.native import linear_attention as la
from engram_trt.native import trt_compat

from helpers.plugins import (
    build_plugin_engine,
    create_plugin,
    harness_path,
    harness_scripts,
    serialized_twice,
    write_plugin_graph,
)

NAMESPACE = "engram_trt"
HARNESS = harness_path()


def test_abi_shape_checks_run_without_gpu(plugin_lib: Path) -> None:
    la.check_conv_shape(6144, 4, "silu")
    la.check_conv_shape(1, 1, 0)
    la.check_conv_shape(256 * 65535, la.MAX_KERNEL, 1)
    la.check_delta_shape(16, 32, 128, 128, True, 128**-0.5)
    la.check_delta_shape(1, 1, la.MAX_HEAD_DIM, la.MAX_HEAD_DIM, False, 0.0)
    for call, needle in (
        (lambda: la.check_conv_shape(0, 4, 1), "channels must be in [1, 16776960] (got 0)"),
        (lambda: la.check_conv_shape(64, 0, 1), "kernel must be in [1, 32] (got 0)"),
        (lambda: la.check_conv_shape(64, 33, 1), "kernel must be in [1, 32] (got 33)"),
        (lambda: la.check_conv_shape(64, 4, 2), "activation must be 0 (identity) or 1 (silu) (got 2)"),
        (lambda: la.check_delta_shape(3, 4, 64, 64, True, 0.1), "num_v_heads a multiple of it (got 3, 4)"),
        (lambda: la.check_delta_shape(2, 4, 257, 64, True, 0.1), "must be in [1, 256] (got 257, 64)"),
        (lambda: la.check_delta_shape(2, 4, 64, 0, True, 0.1), "(got 64, 0)"),
        (lambda: la.check_delta_shape(2, 4, 64, 64, True, float("nan")), "scale must be finite"),
    ):
        with pytest.raises(EngramError) as exc:
            call()
        assert needle in str(exc.value) and "\n" not in str(exc.value), str(exc.value)
    with pytest.raises(EngramError, match=r"activation 'gelu' is not one of \['identity', 'silu'\]"):
        la.check_conv_shape(64, 4, "gelu")


def _conv_args(T=5, C=24, K=4, S=2, slots=3, io=torch.bfloat16, wt=torch.float32):
    return dict(
        x=torch.zeros(T, C, dtype=io),
        weight=torch.zeros(C, 1, K, dtype=wt),
        conv_state=torch.zeros(slots, C, K - 1, dtype=io),
        seq_starts=torch.tensor([0, 2, T], dtype=torch.int32),
        past_lens=torch.zeros(S, dtype=torch.int32),
        slots=torch.arange(S, dtype=torch.int32),
    )


def _delta_args(T=5, Hk=2, Hv=4, dk=8, dv=12, S=2, slots=3, io=torch.bfloat16):
    return dict(
        q=torch.zeros(T, Hk, dk, dtype=io),
        k=torch.zeros(T, Hk, dk, dtype=io),
        v=torch.zeros(T, Hv, dv, dtype=io),
        g=torch.zeros(T, Hv),
        beta=torch.zeros(T, Hv),
        state=torch.zeros(slots, Hv, dk, dv),
        seq_starts=torch.tensor([0, 2, T], dtype=torch.int32),
        past_lens=torch.zeros(S, dtype=torch.int32),
        slots=torch.arange(S, dtype=torch.int32),
    )


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"x": torch.zeros(5, 24, dtype=torch.int32)}, "x must have dtype"),
        ({"conv_state": torch.zeros(3, 24, 3)}, "conv_state must have dtype torch.bfloat16"),
        ({"weight": torch.zeros(24, 1, 4, dtype=torch.float16)}, "weight must have dtype"),
        ({"slots": torch.zeros(2, dtype=torch.int64)}, "slots must have dtype torch.int32"),
        ({"weight": torch.zeros(24, 2, 4)}, "weight must be [C, K] or [C, 1, K] with C = 24"),
        ({"weight": torch.zeros(24, 1, 33)}, "kernel must be in [1, 32] (got 33)"),
        ({"conv_state": torch.zeros(3, 24, 4, dtype=torch.bfloat16)}, "conv_state must be [num_slots, C, K-1]"),
        ({"seq_starts": torch.tensor([0, 5], dtype=torch.int32)}, "seq_starts must be [S+1] and slots [S]"),
        ({"x": torch.zeros(24, 5, dtype=torch.bfloat16).t()}, "x must be contiguous"),
        ({}, "x must be a CUDA tensor"),
    ],
)
def test_conv_binding_names_the_bad_argument(plugin_lib: Path, change, needle) -> None:
    with pytest.raises(EngramError) as exc:
        la.causal_conv1d(**{**_conv_args(), **change})
    assert needle in str(exc.value) and "\n" not in str(exc.value), str(exc.value)


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"k": torch.zeros(5, 2, 8, dtype=torch.float16)}, "k must have dtype torch.bfloat16"),
        ({"g": torch.zeros(5, 4, dtype=torch.bfloat16)}, "g must have dtype torch.float32"),
        ({"state": torch.zeros(3, 4, 8, 12, dtype=torch.bfloat16)}, "state must have dtype torch.float32"),
        ({"k": torch.zeros(5, 2, 16, dtype=torch.bfloat16)}, "k must be q's shape (5, 2, 8)"),
        ({"v": torch.zeros(5, 3, 12, dtype=torch.bfloat16)}, "num_v_heads a multiple of it (got 2, 3)"),
        ({"beta": torch.zeros(5, 3)}, "beta must be [T, Hv] = (5, 4)"),
        ({"state": torch.zeros(3, 4, 8, 8)}, "state must be [num_slots, Hv, dk, dv] = [num_slots, 4, 8, 12]"),
        (
            {"past_lens": torch.zeros(3, dtype=torch.int32)},
            "seq_starts must be [S+1] and slots [S] with past_lens' S = 3",
        ),
        ({}, "q must be a CUDA tensor"),
    ],
)
def test_delta_binding_names_the_bad_argument(plugin_lib: Path, change, needle) -> None:
    with pytest.raises(EngramError) as exc:
        la.gated_delta_net(**{**_delta_args(), **change})
    assert needle in str(exc.value) and "\n" not in str(exc.value), str(exc.value)


# --- TensorRT-RTX: the creators ---------------------------------------------------------------

# (the trt fixture: tests/conftest.py)

CONV_VALID = {"kernel": ("int32", 4), "activation": ("int32", 1)}
DELTA_VALID = {"l2norm_qk": ("int32", 1), "scale": ("float32", 0.125)}


def test_creators_are_registered_with_their_fields(trt) -> None:
    registry = trt.module.get_plugin_registry()
    i32, f32 = trt.module.PluginFieldType.INT32, trt.module.PluginFieldType.FLOAT32
    for name, want in (
        ("EngramCausalConv1d", [("kernel", i32, 1), ("activation", i32, 1)]),
        ("EngramGatedDeltaNet", [("l2norm_qk", i32, 1), ("scale", f32, 1)]),
    ):
        creator = registry.get_creator(name, "1", NAMESPACE)
        assert creator is not None and (creator.plugin_version, creator.plugin_namespace) == ("1", NAMESPACE)
        assert [(f.name, f.type, f.size) for f in creator.field_names] == want
        assert registry.get_creator(name, "1", "") is None
        assert (name, "1") in trt_compat.plugin_creator_names()


@pytest.mark.parametrize(
    "name,valid,change,message",
    [
        ("EngramCausalConv1d", CONV_VALID, {"kernel": ("int32", 33)}, "field 'kernel' = 33 is outside [1, 32]"),
        ("EngramCausalConv1d", CONV_VALID, {"kernel": ("int32", 0)}, "field 'kernel' = 0 is outside [1, 32]"),
        ("EngramCausalConv1d", CONV_VALID, {"kernel": ("int64", 2**32 + 4)}, "field 'kernel' = 4294967300 is outside"),
        ("EngramCausalConv1d", CONV_VALID, {"activation": ("int32", 2)}, "field 'activation' = 2 is outside [0, 1]"),
        ("EngramCausalConv1d", CONV_VALID, {"activation": None}, "missing field 'activation'"),
        (
            "EngramCausalConv1d",
            CONV_VALID,
            {"dilation": ("int32", 1)},
            "unknown field(s) dilation for plugin EngramCausalConv1d",
        ),
        ("EngramGatedDeltaNet", DELTA_VALID, {"l2norm_qk": ("int32", -1)}, "field 'l2norm_qk' = -1 is outside [0, 1]"),
        ("EngramGatedDeltaNet", DELTA_VALID, {"scale": ("float32", float("inf"))}, "scale must be finite"),
        ("EngramGatedDeltaNet", DELTA_VALID, {"scale": ("int32", 1)}, "field 'scale' must be a float"),
        ("EngramGatedDeltaNet", DELTA_VALID, {"scale": None}, "missing field 'scale'"),
    ],
)
def test_creators_refuse_bad_fields_in_one_line(trt, capfd, name, valid, change, message) -> None:
    fields = {**valid, **{k: v for k, v in change.items() if v is not None}}
    for field in [k for k, v in change.items() if v is None]:
        del fields[field]
    capfd.readouterr()
    assert create_plugin(trt, name, fields) is None
    err = [line for line in capfd.readouterr().err.splitlines() if message in line]
    assert err and err[0].count(name) >= 1, capfd.readouterr().err


def test_creators_accept_the_edge_of_each_range(trt) -> None:
    for edge in ({"kernel": ("int32", 1)}, {"kernel": ("int64", 32)}, {"activation": ("int32", 0)}):
        assert create_plugin(trt, "EngramCausalConv1d", {**CONV_VALID, **edge}) is not None, edge
    for edge in ({"l2norm_qk": ("int32", 0)}, {"scale": ("float32", 0.0)}, {"scale": ("float32", -3.0)}):
        assert create_plugin(trt, "EngramGatedDeltaNet", {**DELTA_VALID, **edge}) is not None, edge


# --- engines -------------------------------------------------------------------------------------


@pytest.mark.parametrize("io", ["bf16", "fp32"])
def test_onnx_graph_with_a_causal_conv_node_builds_an_engine(trt, tmp_path: Path, io: str) -> None:
    """The node as models/qwen4_exp/onnx_blocks.py writes it (kernel, activation = 1, the
    checkpoint's [C, 1, K] weight in the graph's dtype), its state an aliased output."""
    from onnx import TensorProto

    elem = {"bf16": TensorProto.BFLOAT16, "fp32": TensorProto.FLOAT}[io]
    C, K, slots = 96, 4, 4
    path = tmp_path / "conv.onnx"
    i32 = TensorProto.INT32
    write_plugin_graph(
        path,
        "EngramCausalConv1d",
        [
            ("x", elem, ["T", C]),
            ("weight", elem, [C, 1, K]),
            ("conv_state", elem, [slots, C, K - 1]),
            ("seq_starts", i32, ["S1"]),
            ("past_lens", i32, ["S"]),
            ("slots", i32, ["S"]),
        ],
        [("y", elem, ["T", C]), ("conv_state_out", elem, [slots, C, K - 1])],
        {"kernel": K, "activation": 1},
    )
    network, engine = build_plugin_engine(
        trt,
        path,
        {
            "x": ((1, C), (16, C), (64, C)),
            "seq_starts": ((2,), (3,), (5,)),
            "past_lens": ((1,), (2,), (4,)),
            "slots": ((1,), (2,), (4,)),
        },
        "EngramCausalConv1d",
    )
    want = {"bf16": trt.module.bfloat16, "fp32": trt.module.float32}[io]
    assert [network.get_output(i).dtype for i in range(2)] == [want, want]
    assert engine is not None and engine.nbytes > 1000


@pytest.mark.parametrize("io", ["bf16", "fp32"])
def test_onnx_graph_with_a_gated_delta_net_node_builds_an_engine(trt, tmp_path: Path, io: str) -> None:
    from onnx import TensorProto

    elem = {"bf16": TensorProto.BFLOAT16, "fp32": TensorProto.FLOAT}[io]
    Hk, Hv, dk, dv, slots = 2, 4, 64, 96, 4
    path = tmp_path / "delta.onnx"
    f32, i32 = TensorProto.FLOAT, TensorProto.INT32
    write_plugin_graph(
        path,
        "EngramGatedDeltaNet",
        [
            ("q", elem, ["T", Hk, dk]),
            ("k", elem, ["T", Hk, dk]),
            ("v", elem, ["T", Hv, dv]),
            ("g", f32, ["T", Hv]),
            ("beta", f32, ["T", Hv]),
            ("state", f32, [slots, Hv, dk, dv]),
            ("seq_starts", i32, ["S1"]),
            ("past_lens", i32, ["S"]),
            ("slots", i32, ["S"]),
        ],
        [("o", elem, ["T", Hv, dv]), ("state_out", f32, [slots, Hv, dk, dv])],
        {"l2norm_qk": 1, "scale": float(dk) ** -0.5},
    )
    shapes = {
        "q": ((1, Hk, dk), (16, Hk, dk), (64, Hk, dk)),
        "k": ((1, Hk, dk), (16, Hk, dk), (64, Hk, dk)),
        "v": ((1, Hv, dv), (16, Hv, dv), (64, Hv, dv)),
        "g": ((1, Hv), (16, Hv), (64, Hv)),
        "beta": ((1, Hv), (16, Hv), (64, Hv)),
        "seq_starts": ((2,), (3,), (5,)),
        "past_lens": ((1,), (2,), (4,)),
        "slots": ((1,), (2,), (4,)),
    }
    network, engine = build_plugin_engine(trt, path, shapes, "EngramGatedDeltaNet")
    want = {"bf16": trt.module.bfloat16, "fp32": trt.module.float32}[io]
    assert [network.get_output(i).dtype for i in range(2)] == [want, trt.module.float32]
    assert engine is not None and engine.nbytes > 1000


# --- the plugin harness ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def harness():
    (helpers, check) = harness_scripts(HARNESS, "helpers", "test_linear_attention")
    return helpers, check, check.Harness(HARNESS)


def test_serialized_fields_are_pinned(harness) -> None:
    """Whatever widths the fields came in, the engine stores them as declared, in order."""
    helpers, _, h = harness
    PF_FLOAT64, PF_INT16, PF_INT64 = 2, 4, 10
    i32, f32 = helpers.PF_INT32, helpers.PF_FLOAT32
    for name, given, want in (
        (
            "EngramCausalConv1d",
            [("activation", PF_INT16, np.array([1], np.int16)), ("kernel", PF_INT64, np.array([4], np.int64))],
            [("kernel", i32, 1, np.int32(4).tobytes()), ("activation", i32, 1, np.int32(1).tobytes())],
        ),
        (
            "EngramGatedDeltaNet",
            [("scale", PF_FLOAT64, np.array([0.125], np.float64)), ("l2norm_qk", PF_INT64, np.array([1], np.int64))],
            [("l2norm_qk", i32, 1, np.int32(1).tobytes()), ("scale", f32, 1, np.float32(0.125).tobytes())],
        ),
    ):
        first, again = serialized_twice(h, name, given)
        assert first == want and again == want, name


def test_plugins_through_the_harness(harness) -> None:
    """Output shapes and types, refused type mixes, getAliasedInput (build capability v2),
    the round trip, refused fields, for both plugins."""
    _helpers, check, h = harness
    results = check.check_plugin_cpu(h)
    assert list(results) == check.PLUGIN_CPU_CHECKS and len(results) == 12
    assert not results.failed(), results.failed()
