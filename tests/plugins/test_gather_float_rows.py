"""EngramGather over float tables (bf16 / f16 / f32 rows of any width) on a machine
without a GPU; the kernel and the plugin's enqueue run on the H200 in
tests/gpu/test_gather_float_rows.py.

- through the plugin harness: each table_dtype (0 fp8, 1 bf16, 2 f16, 3 f32) is
  serialized as given and survives the round trip; the output type is bf16 for fp8 and
  bf16 tables and the table's own for f16 / f32, the shape ``[T, cols, head_dim]`` for
  widths 1, 3, 4, 17; float rows of any width are accepted, fp8 keeps its limits (a
  head_dim not a multiple of 16 is refused in one line naming the rule);
- with TensorRT-RTX: an ONNX graph of one EngramGather node per float dtype and width
  builds into an engine on the CPU, its output of the table's dtype;
- the ONNX reference runtime's EngramGather gives torch indexing of the table in its own
  dtype (zero rows outside), and refuses a table whose dtype is not the node's;
- the binding (``gather.table_code``) takes f16 / f32 tables for the GPU gather only.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engram_trt.errors import EngramError
from engram_trt.native import trt_compat

from helpers.plugins import harness_path, harness_scripts

HARNESS = harness_path()
PF_INT32, PF_INT64 = 5, 10
DT_FLOAT, DT_HALF, DT_INT32, DT_BF16, DT_INT64 = 0, 1, 3, 7, 8
# table_dtype -> the plugin's output type
OUT_TYPE = {0: DT_BF16, 1: DT_BF16, 2: DT_HALF, 3: DT_FLOAT}
WIDTHS = (1, 3, 4, 17)


def _fields(dtype_code: int, head_dim: int, rows: int = 1000) -> list:
    return [
        ("layer_index", PF_INT32, np.array([0], np.int32)),
        ("n_layers", PF_INT32, np.array([1], np.int32)),
        ("n_cols", PF_INT32, np.array([4], np.int32)),
        ("head_dim", PF_INT32, np.array([head_dim], np.int32)),
        ("table_dtype", PF_INT32, np.array([dtype_code], np.int32)),
        ("quant_block", PF_INT32, np.array([32], np.int32)),
        ("num_rows", PF_INT64, np.array([rows], np.int64)),
    ]


@pytest.fixture(scope="module")
def harness():
    (common,) = harness_scripts(HARNESS, "helpers")
    return common.Harness(HARNESS)


@pytest.mark.parametrize("code", [1, 2, 3])
def test_float_tables_of_any_width_serialize_and_type_their_output(harness, code: int) -> None:
    for width in WIDTHS:
        h = harness.create("EngramGather", _fields(code, width))
        try:
            assert harness.serialized_int(h, "table_dtype") == code
            assert harness.serialized_int(h, "head_dim") == width
            h2 = harness.roundtrip(h)
            try:
                assert harness.serialized_fields(h2) == harness.serialized_fields(h)
                assert harness.output_types(h2, [DT_INT32, DT_INT64]) == [OUT_TYPE[code]]
            finally:
                harness.lib.harness_destroy(h2)
            assert harness.output_types(h, [DT_INT32, DT_INT64]) == [OUT_TYPE[code]]
            dims, const = harness.output_shapes(h, [(-1, 1, 4), (1,)])
            assert dims[1:] == (4, width) and const == (False, True, True)
        finally:
            harness.lib.harness_destroy(h)


def test_fp8_output_stays_bf16_and_keeps_its_limits(harness) -> None:
    h = harness.create("EngramGather", _fields(0, 64))
    try:
        assert harness.output_types(h, [DT_INT32, DT_INT64, DT_INT64]) == [DT_BF16]
    finally:
        harness.lib.harness_destroy(h)
    with pytest.raises(RuntimeError) as failure:
        harness.create("EngramGather", _fields(0, 24))
    assert "EngramGather: engram_gather: fp8 tables need head_dim % 16 == 0" in str(failure.value)
    assert "(got head_dim 24, quant_block 32)" in str(failure.value)
    with pytest.raises(RuntimeError, match=r"field 'table_dtype' = 4 is outside \[0, 3\]"):
        harness.create("EngramGather", _fields(4, 8))


# --- TensorRT-RTX ------------------------------------------------------------------------


@pytest.fixture
def trt(plugin_lib: Path, monkeypatch: pytest.MonkeyPatch):
    if not trt_compat.module_available("tensorrt_rtx_bindings") and not trt_compat.module_available("tensorrt_rtx"):
        pytest.skip("tensorrt_rtx not installed")
    monkeypatch.setenv("ENGRAM_TRT_FLAVOUR", "tensorrt_rtx")
    t = trt_compat.load("tensorrt_rtx")
    trt_compat.load_plugin_library(plugin_lib)
    return t


def _gather_graph(path: Path, code: int, width: int, out_elem: int) -> None:
    """ids [T, 1, 4], rows_addr [1] -> EngramGather -> rows [T, 4, width]."""
    import onnx
    from onnx import TensorProto, helper

    from engram_trt.models import export

    attrs = dict(
        plugin_version="1",
        plugin_namespace=export.PLUGIN_NAMESPACE,
        layer_index=0,
        n_layers=1,
        n_cols=4,
        head_dim=width,
        table_dtype=code,
        quant_block=32,
        num_rows=1000,
        bad_rows_input=0,
        column_begin=0,
        column_end=4,
        row_offset=0,
    )
    node = helper.make_node(
        "EngramGather", ["ids", "rows_addr"], ["rows"], name="gather", domain=export.PLUGIN_DOMAIN, **attrs
    )
    inputs = [
        helper.make_tensor_value_info("ids", TensorProto.INT32, ["T", 1, 4]),
        helper.make_tensor_value_info("rows_addr", TensorProto.INT64, [1]),
    ]
    outputs = [helper.make_tensor_value_info("rows", out_elem, ["T", 4, width])]
    graph = helper.make_graph([node], "gather", inputs, outputs)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(export.PLUGIN_DOMAIN, 1)]
    )
    onnx.save(model, str(path))


@pytest.mark.parametrize("code, width", [(1, 4), (2, 3), (3, 4), (3, 17)])
def test_onnx_graph_with_one_float_gather_builds_an_engine(trt, tmp_path: Path, code: int, width: int) -> None:
    from onnx import TensorProto

    elem = {1: TensorProto.BFLOAT16, 2: TensorProto.FLOAT16, 3: TensorProto.FLOAT}[code]
    path = tmp_path / "gather.onnx"
    _gather_graph(path, code, width, elem)
    builder = trt_compat.create_builder()
    network = trt_compat.create_network(builder)
    parser = trt_compat.onnx_parser(network)
    trt_compat.parse_onnx_file(parser, path)
    m = trt.module
    out = network.get_output(0)
    assert out.name == "rows" and tuple(out.shape) == (-1, 4, width)
    assert out.dtype == {1: m.bfloat16, 2: m.float16, 3: m.float32}[code]
    config = builder.create_builder_config()
    trt_compat.set_targets(config, ("sm80",))
    profile = builder.create_optimization_profile()
    profile.set_shape("ids", (1, 1, 4), (16, 1, 4), (64, 1, 4))
    config.add_optimization_profile(profile)
    engine = builder.build_serialized_network(network, config)
    assert engine is not None and engine.nbytes > 1000


# --- the reference runtime and the binding ---------------------------------------------------


def _reference_gather(table: np.ndarray, code: int, ids: np.ndarray) -> np.ndarray:
    """One EngramGather node of ``table_dtype`` ``code`` run by ONNX's ReferenceEvaluator
    with the builder's OpRuns, the table bound by address."""
    from onnx import TensorProto, helper
    from onnx.reference import ReferenceEvaluator

    from engram_trt.models.reference_executor import reference_ops as _reference_ops
    from engram_trt.models.reference_ops import TableRegistry
    from engram_trt.models import export

    path_elem = {1: TensorProto.BFLOAT16, 2: TensorProto.FLOAT16, 3: TensorProto.FLOAT}[code]

    node = helper.make_node(
        "EngramGather",
        ["ids", "rows_addr"],
        ["rows"],
        domain=export.PLUGIN_DOMAIN,
        layer_index=0,
        n_layers=1,
        n_cols=ids.shape[2],
        head_dim=table.shape[1],
        table_dtype=code,
        quant_block=32,
        num_rows=table.shape[0],
    )
    graph = helper.make_graph(
        [node],
        "g",
        [
            helper.make_tensor_value_info("ids", TensorProto.INT32, None),
            helper.make_tensor_value_info("rows_addr", TensorProto.INT64, None),
        ],
        [helper.make_tensor_value_info("rows", path_elem, None)],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(export.PLUGIN_DOMAIN, 1)]
    )
    registry = TableRegistry()
    addr = registry.register(table)
    sess = ReferenceEvaluator(model, new_ops=_reference_ops(registry))
    return sess.run(None, {"ids": ids, "rows_addr": np.array([addr], np.int64)})[0]


@pytest.mark.parametrize("code, width", [(1, 3), (2, 1), (3, 4), (3, 17)])
def test_reference_gather_reads_float_rows_in_their_dtype(code: int, width: int) -> None:
    import ml_dtypes

    np_dt = {1: ml_dtypes.bfloat16, 2: np.float16, 3: np.float32}[code]
    rng = np.random.default_rng(code * 10 + width)
    table = (rng.standard_normal((300, width)) * 3).astype(np_dt)
    ids = rng.integers(0, 300, size=(9, 1, 5)).astype(np.int32)
    ids[0, 0, :2] = [-1, 300]
    got = _reference_gather(table, code, ids)
    want = table[np.clip(ids[:, 0, :], 0, 299)].copy()
    want[0, :2] = 0
    assert got.dtype == np.dtype(np_dt) and got.shape == (9, 5, width)
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8))
    other = {1: np.float32, 2: np.float32, 3: np.float16}[code]
    with pytest.raises(EngramError, match="the graph's gather reads"):
        _reference_gather(table.astype(other), code, ids)


def test_binding_takes_float16_and_float32_tables_for_the_gpu_gather_only() -> None:
    torch = pytest.importorskip("torch")
    from engram_trt.native import gather as gather_kernels

    for dt, code in (
        (torch.bfloat16, gather_kernels.TABLE_BF16),
        (torch.float16, gather_kernels.TABLE_F16),
        (torch.float32, gather_kernels.TABLE_F32),
    ):
        assert gather_kernels.table_code(torch.zeros(7, 3, dtype=dt), None, 32, float_rows=True) == (code, 7, 3)
    with pytest.raises(EngramError, match="rows must have dtype"):
        gather_kernels.table_code(torch.zeros(7, 3, dtype=torch.float32), None, 32)  # the host gather's tables
    with pytest.raises(EngramError, match="scales must be None for a torch.float32 table"):
        gather_kernels.table_code(
            torch.zeros(7, 3, dtype=torch.float32), torch.zeros(7, 1, dtype=torch.uint8), 32, float_rows=True
        )
