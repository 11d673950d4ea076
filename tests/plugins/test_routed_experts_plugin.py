"""EngramRoutedExperts (plugins/engramRoutedExpertsPlugin: a MoE layer's routed experts in
their stored FP4 / FP8 format) on a machine without a GPU:

- with TensorRT-RTX: the creator is registered with its nine fields and refuses bad ones
  in one line; an ONNX graph holding the node, its stored weights and scales INT8
  initializers (FP4 bytes and ue8m0 scales; FP8 bytes and float32 scales), builds into
  an engine on the CPU that holds the stored bytes (its size the weights' bytes plus a
  fixed few KiB: never 2-4x); the same weights as UINT8 initializers are refused by name
  (the parser widens UINT8 to int32, four bytes a byte: why the export writes INT8);
- through the plugin harness: output shapes / types, the serialized fields, the round
  trip, refused fields and input types (tests/gpu/test_routed_experts_plugin.check_plugin_cpu,
  shared with the GPU suite, where the enqueue is held to native.quant.experts);
- the exported graph's reference for the node (models/reference_ops.py's
  routed_experts_reference over dequantize_stored_experts) against a float64 loop over
  the experts' QuantWeights dequantized by quant/formats.py, one token and pick at a time.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from helpers.plugins import create_plugin, harness_path, harness_scripts, parse_plugin_graph

HARNESS = harness_path()
NAMESPACE = "engram_trt"
FIELDS = [
    "num_experts",
    "top_k",
    "hidden",
    "intermediate",
    "w_type",
    "scale_type",
    "block_n",
    "block_k",
    "swiglu_limit",
]


def test_creator_is_registered_and_refuses_bad_fields(trt, capfd) -> None:
    m = trt.module
    creator = m.get_plugin_registry().get_creator("EngramRoutedExperts", "1", NAMESPACE)
    assert creator is not None
    i32, f32 = m.PluginFieldType.INT32, m.PluginFieldType.FLOAT32
    assert [(f.name, f.type) for f in creator.field_names] == [(n, f32 if n == "swiglu_limit" else i32) for n in FIELDS]
    good = {
        "num_experts": ("int32", 8),
        "top_k": ("int32", 2),
        "hidden": ("int32", 256),
        "intermediate": ("int32", 128),
        "w_type": ("int32", 1),
        "scale_type": ("int32", 1),
        "block_n": ("int32", 1),
        "block_k": ("int32", 32),
        "swiglu_limit": ("float32", 7.0),
    }
    assert create_plugin(trt, "EngramRoutedExperts", good) is not None
    for change, message in (
        ({"w_type": ("int32", 3)}, "field 'w_type' = 3 is outside [0, 1]"),
        ({"hidden": ("int32", 200)}, "hidden 200 and intermediate 128 must be multiples of 32"),
        ({"scale_type": ("int32", 0)}, "scale_type must be 1 (ue8m0) for fp4 weights"),
    ):
        capfd.readouterr()
        assert create_plugin(trt, "EngramRoutedExperts", {**good, **change}) is None
        assert any(message in line for line in capfd.readouterr().err.splitlines())


def _graph(path: Path, kind: str, weight_type: int, E: int = 8, k: int = 2, D: int = 256, I: int = 128) -> int:
    """A one-node graph: x [T, D] bf16, ids [T, k] int32, route_w [T, k] float32 inputs and
    the experts' stored weights / scales as initializers of ``weight_type`` (INT8 / UINT8);
    returns the initializers' bytes."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(3)
    fp4 = kind == "fp4"
    bn, bk = (1, 32) if fp4 else (128, 128)
    npw = np.int8 if weight_type == TensorProto.INT8 else np.uint8
    inits, names = [], []
    for proj, (N, K) in (("gate", (I, D)), ("up", (I, D)), ("down", (D, I))):
        w = rng.integers(0, 256, size=(E, N, K // (2 if fp4 else 1)), dtype=np.uint8).view(npw)
        grid = (E, -(-N // bn), -(-K // bk))
        s = (
            rng.integers(118, 136, size=grid, dtype=np.uint8).view(npw)
            if fp4
            else (2.0 ** rng.integers(-8, 0, size=grid)).astype(np.float32)
        )
        inits += [numpy_helper.from_array(w, f"{proj}_w"), numpy_helper.from_array(s, f"{proj}_s")]
        names += [f"{proj}_w", f"{proj}_s"]
    node = helper.make_node(
        "EngramRoutedExperts",
        ["x", "ids", "route_w", *names],
        ["y"],
        name="experts",
        domain=NAMESPACE,
        plugin_version="1",
        plugin_namespace=NAMESPACE,
        num_experts=E,
        top_k=k,
        hidden=D,
        intermediate=I,
        w_type=1 if fp4 else 0,
        scale_type=1 if fp4 else 0,
        block_n=bn,
        block_k=bk,
        swiglu_limit=7.0 if fp4 else 0.0,
    )
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.BFLOAT16, ["T", D]),
        helper.make_tensor_value_info("ids", TensorProto.INT32, ["T", k]),
        helper.make_tensor_value_info("route_w", TensorProto.FLOAT, ["T", k]),
    ]
    graph = helper.make_graph(
        [node], "experts", inputs, [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, ["T", D])], inits
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid(NAMESPACE, 1)])
    model.ir_version = 10
    onnx.save(model, str(path))
    return sum(len(i.raw_data) for i in inits)


@pytest.mark.parametrize("kind", ["fp4", "fp8"])
def test_onnx_graph_with_the_node_builds_an_engine_holding_the_stored_bytes(trt, tmp_path: Path, kind: str) -> None:
    from onnx import TensorProto

    from engram_trt.native import trt_compat

    if not trt.is_rtx:
        pytest.skip("the engine is built for RTX targets (full TensorRT builds for the GPU it runs on)")
    path = tmp_path / "experts.onnx"
    stored = _graph(path, kind, TensorProto.INT8)
    builder, network, layer = parse_plugin_graph(trt, path)
    layer.__class__ = trt.module.IPluginV3Layer
    core = layer.plugin.get_capability_interface(trt.module.PluginCapabilityType.CORE)
    assert (core.plugin_name, core.plugin_namespace, core.plugin_version) == ("EngramRoutedExperts", NAMESPACE, "1")
    config = builder.create_builder_config()
    trt_compat.set_targets(config, ("sm89",))
    profile = builder.create_optimization_profile()
    for name, width in (("x", 256), ("ids", 2), ("route_w", 2)):
        profile.set_shape(name, (1, width), (8, width), (64, width))
    config.add_optimization_profile(profile)
    engine = builder.build_serialized_network(network, config)
    assert engine is not None
    # the weights' bytes as stored (not widened, not dequantized) plus a few KiB of engine
    assert stored <= engine.nbytes <= stored + 64 * 1024, (stored, engine.nbytes)


def test_uint8_initializers_are_widened_by_the_parser_and_refused_by_name(trt, tmp_path: Path, capfd, caplog) -> None:
    from onnx import TensorProto

    from engram_trt.errors import EngramError

    if not trt.is_rtx:
        pytest.skip("the widening is TensorRT-RTX's ONNX parser's")
    path = tmp_path / "experts_u8.onnx"
    _graph(path, "fp4", TensorProto.UINT8)
    capfd.readouterr()
    with caplog.at_level("INFO"), pytest.raises(EngramError):
        parse_plugin_graph(trt, path)
    err = capfd.readouterr().err + caplog.text  # TensorRT's log (the plugins log through it)
    assert "UINT8 data gate_w is being converted to INT32" in err
    assert "gate_w must be int8 or uint8 bytes (the stored weight), as gate_w, got int32" in err


@pytest.fixture(scope="module")
def harness():
    (helpers, check) = harness_scripts(HARNESS, "helpers", "test_routed_experts_plugin")
    return helpers, check, helpers.Harness(HARNESS)


def test_plugin_through_the_harness(harness) -> None:
    _helpers, check, h = harness
    results = check.check_plugin_cpu(h)
    assert list(results) == check.PLUGIN_CPU_CHECKS and len(results) == 7
    assert all(ok for ok, _ in results.values()), {n: r for n, r in results.items() if not r[0]}


@pytest.mark.parametrize("kind,limit", [("fp4", 7.0), ("fp8", 0.0)])
def test_the_graph_reference_is_the_stored_formats_product(kind: str, limit: float) -> None:
    """routed_experts_reference over the node's own inputs (the stacked bytes and scales
    as the export writes them) = a float64 loop over each expert's QuantWeight dequantized
    by quant/formats.py: ids outside [0, E) add nothing, an expert picked twice counts twice."""
    import torch

    from engram_trt.models.reference_ops import dequantize_stored_experts, routed_experts_reference
    from engram_trt.quant import formats
    from engram_trt.quant.weight import QuantWeight

    gen = torch.Generator().manual_seed(5)
    E, D, I = 4, 64, 96
    block = (1, 32) if kind == "fp4" else (128, 128)

    def stack(N: int, K: int) -> QuantWeight:
        w = torch.randn(E, N, K, generator=gen)
        q, s = formats.quantize_fp4(w) if kind == "fp4" else formats.quantize_fp8(w, block, "ue8m0")
        return QuantWeight(q, s, kind, block)

    gate, up, down = stack(I, D), stack(I, D), stack(D, I)
    fields = {"w_type": 1 if kind == "fp4" else 0, "block_n": block[0], "block_k": block[1]}
    deq = [
        dequantize_stored_experts(w.data.view(torch.int8).numpy(), w.scale.view(torch.int8).numpy(), fields)
        for w in (gate, up, down)
    ]
    x = torch.randn(5, D, generator=gen).numpy()
    ids = np.array([[0, 3], [2, 2], [4, 1], [-1, 0], [3, 1]])
    route_w = torch.rand(5, 2, generator=gen).numpy().astype(np.float32)
    got = routed_experts_reference(x, ids, route_w, *deq, limit)
    want = np.zeros((5, D))
    g64, u64, d64 = (w.dequantize(torch.float64).numpy() for w in (gate, up, down))
    for t in range(5):
        for j in range(2):
            e = ids[t, j]
            if 0 <= e < E:
                g, u = g64[e] @ x[t].astype(np.float64), u64[e] @ x[t].astype(np.float64)
                if limit:
                    g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
                want[t] += float(route_w[t, j]) * (d64[e] @ (g / (1 + np.exp(-g)) * u))
    assert np.array_equal(got, want)


@pytest.mark.parametrize("case", ["fp4", "fp8-ue8m0-row-blocks-differ", "fp8-float"])
def test_the_exported_node_is_the_experts_product(case: str) -> None:
    """models/onnx_quant.routed_experts writes a node whose inputs (the stacked stored
    bytes and scales as INT8 / float32 initializers; FP8 experts whose gate / up scales are
    per row while down's are 128 x 128 blocks spread over the rows) the reference
    evaluator turns back into the experts' product: equal to a float64 loop over the
    QuantWeights dequantized by quant/formats.py."""
    import torch
    from onnx import TensorProto, helper
    from onnx.reference import ReferenceEvaluator

    from engram_trt.models.reference_executor import reference_ops as _reference_ops
    from engram_trt.models.reference_ops import TableRegistry
    from engram_trt.models.engram_llama.onnx_export import _Graph
    from engram_trt.models.export import OPSET, PLUGIN_DOMAIN
    from engram_trt.models.onnx_quant import routed_experts, routed_experts_unavailable
    from engram_trt.quant import formats
    from engram_trt.quant.weight import QuantWeight

    gen = torch.Generator().manual_seed(9)
    E, D, I, T, k = 3, 256, 64, 4, 2
    kind = "fp4" if case == "fp4" else "fp8"
    fmt = "float" if case == "fp8-float" else "ue8m0"

    def expert(N: int, K: int, block: tuple[int, int]) -> QuantWeight:
        w = torch.randn(N, K, generator=gen)
        if kind == "fp4":
            return QuantWeight(*formats.quantize_fp4(w), "fp4", (1, 32))
        return QuantWeight(*formats.quantize_fp8(w, block, fmt), "fp8", block)

    gu_block = (1, 128) if case.endswith("differ") else (128, 128)
    gate = [expert(I, D, gu_block) for _ in range(E)]
    up = [expert(I, D, gu_block) for _ in range(E)]
    down = [expert(D, I, (128, 128)) for _ in range(E)]
    assert routed_experts_unavailable(gate, up, down) is None
    g = _Graph()
    routed_experts(
        g, "x", "ids", "route_w", "experts", gate, up, down, top_k=k, limit=0.5 if kind == "fp4" else 0.0, hint="y"
    )
    node = g.nodes[-1]
    node.output[0] = "y"
    graph = helper.make_graph(
        g.nodes,
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [T, D]),
            helper.make_tensor_value_info("ids", TensorProto.INT64, [T, k]),
            helper.make_tensor_value_info("route_w", TensorProto.FLOAT, [T, k]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [T, D])],
        g.inits,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(PLUGIN_DOMAIN, 1)]
    )
    inits = {i.name: i for i in graph.initializer}
    assert [inits[n].data_type for n in node.input[3::2]] == [TensorProto.INT8] * 3
    scale_type = TensorProto.FLOAT if fmt == "float" else TensorProto.INT8
    assert [inits[n].data_type for n in node.input[4::2]] == [scale_type] * 3
    fields = {a.name: a for a in node.attribute}
    assert (fields["block_n"].i, fields["block_k"].i) == (
        (1, 32) if kind == "fp4" else ((1, 128) if case.endswith("differ") else (128, 128))
    )
    x = torch.randn(T, D, generator=gen).numpy()
    ids = np.array([[0, 2], [1, 1], [2, 0], [1, -1]])
    route_w = torch.rand(T, k, generator=gen).numpy()
    (got,) = ReferenceEvaluator(model, new_ops=_reference_ops(TableRegistry())).run(
        None, {"x": x, "ids": ids, "route_w": route_w}
    )
    limit = 0.5 if kind == "fp4" else 0.0
    want = np.zeros((T, D))
    for t in range(T):
        for j in range(k):
            e = ids[t, j]
            if e < 0:
                continue
            gw, uw, dw = (w[e].dequantize(torch.float64).numpy() for w in (gate, up, down))
            gv, uv = gw @ x[t].astype(np.float64), uw @ x[t].astype(np.float64)
            if limit:
                gv, uv = np.minimum(gv, limit), np.clip(uv, -limit, limit)
            want[t] += float(route_w[t, j]) * (dw @ (gv / (1 + np.exp(-gv)) * uv))
    assert got.dtype == np.float32
    assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()
