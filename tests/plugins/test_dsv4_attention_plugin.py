"""EngramDsv4Attention (DeepSeek-V4's attention core) on a machine without a GPU:

- the C ABI's field checks and the ctypes binding's argument checks run without a GPU and
  name the bad argument in one line;
- with TensorRT-RTX: the creator is registered with its fields and refuses bad ones in one
  line; an ONNX graph holding a CSA node (every state an aliased output) and a sliding node
  builds into an engine;
- through the plugin harness: output shapes / types, the aliased states, the round trip,
  refused fields (tests/gpu/test_dsv4_attention.check_plugin_cpu, shared with the GPU suite).
The kernel itself runs on the H200 in tests/gpu/test_dsv4_attention.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engram_trt.errors import EngramError
from engram_trt.native import dsv4_attention as dsv4

from helpers.plugins import build_plugin_engine, create_plugin, harness_path, harness_scripts, write_plugin_graph

HARNESS = harness_path()
FIELDS = dict(layer_type=1, window=6, compress_rate=4, index_topk=2, scaling=0.125, eps=1e-6, rope_scale=1.0)


def test_field_checks_run_without_gpu(plugin_lib: Path) -> None:
    dsv4.check_fields(**FIELDS)
    dsv4.check_fields(layer_type=0, window=128, scaling=0.05)
    dsv4.check_fields(layer_type=2, window=1, compress_rate=128, scaling=0.05)
    for change, needle in (
        ({"layer_type": 3}, "layer_type 3 must be 0 (sliding), 1 (CSA) or 2 (HCA)"),
        ({"window": 0}, "window 0 must be >= 1"),
        ({"compress_rate": 0}, "compress_rate 0 must be >= 1 on a CSA / HCA layer"),
        ({"index_topk": 0}, "index_topk 0 must be >= 1 on a CSA layer"),
        ({"scaling": float("nan")}, "scaling nan must be a positive finite number"),
        ({"eps": -1.0}, "eps -1 must be a finite number >= 0"),
        ({"rope_scale": 0.0}, "rope_scale 0 must be a positive finite number"),
    ):
        with pytest.raises(EngramError) as exc:
            dsv4.check_fields(**{**FIELDS, **change})
        assert needle in str(exc.value) and "\n" not in str(exc.value), str(exc.value)


def _inputs(T=5, H=2, d=16, N=3, W=6, r=4, E=4, NI=2, di=8, io=torch.bfloat16):
    f32, i32 = torch.float32, torch.int32
    z = lambda *s, dt=io: torch.zeros(*s, dtype=dt)  # noqa: E731
    return [
        z(T, H, d),
        z(T, d),
        z(H, dt=f32),
        torch.tensor([0, 2, T], dtype=i32),
        z(2, dt=i32),
        z(2, dt=i32),
        z(N, W, d),
        z(T, 2 * d),
        z(T, 2 * d),
        z(r, 2 * d, dt=f32),
        z(d, dt=f32),
        z(2, dt=f32),
        z(N, E, d),
        z(N, 2 * r, 2 * d),
        z(N, 2 * r, 2 * d),
        z(T, NI, di),
        z(T, NI, dt=f32),
        z(T, 2 * di),
        z(T, 2 * di),
        z(r, 2 * di, dt=f32),
        z(di, dt=f32),
        z(N, E, di),
        z(N, 2 * r, 2 * di),
        z(N, 2 * r, 2 * di),
    ]


@pytest.mark.parametrize(
    "index,value,needle",
    [
        (2, torch.zeros(2, dtype=torch.bfloat16), "sinks must have dtype torch.float32"),
        (6, torch.zeros(3, 6, 16), "window_kv must have dtype torch.bfloat16"),
        (4, torch.zeros(2, dtype=torch.int64), "past_lens must have dtype torch.int32"),
        (0, torch.zeros(5, 2, 16, dtype=torch.int32), "q must have dtype"),
        (None, None, "q must be a CUDA tensor"),
    ],
)
def test_binding_names_the_bad_argument(plugin_lib: Path, index, value, needle) -> None:
    inputs = _inputs()
    if index is not None:
        inputs[index] = value
    with pytest.raises(EngramError) as exc:
        dsv4.dsv4_attention(*inputs, **FIELDS)
    assert needle in str(exc.value) and "\n" not in str(exc.value), str(exc.value)
    with pytest.raises(EngramError, match="layer_type 1 takes 24 inputs"):
        dsv4.dsv4_attention(*inputs[:15], **FIELDS)


def test_creator_is_registered_and_refuses_bad_fields(trt, capfd) -> None:
    m = trt.module
    creator = m.get_plugin_registry().get_creator("EngramDsv4Attention", "1", "engram_trt")
    assert creator is not None
    i32, f32 = m.PluginFieldType.INT32, m.PluginFieldType.FLOAT32
    assert [(f.name, f.type) for f in creator.field_names] == [
        ("layer_type", i32),
        ("window", i32),
        ("compress_rate", i32),
        ("index_topk", i32),
        ("scaling", f32),
        ("eps", f32),
        ("rope_scale", f32),
    ]
    good = {
        "layer_type": ("int32", 1),
        "window": ("int32", 6),
        "compress_rate": ("int32", 4),
        "index_topk": ("int32", 2),
        "scaling": ("float32", 0.125),
        "eps": ("float32", 1e-6),
    }
    assert create_plugin(trt, "EngramDsv4Attention", good) is not None
    sliding = {"layer_type": ("int32", 0), "window": ("int32", 4), "scaling": ("float32", 0.1)}
    assert create_plugin(trt, "EngramDsv4Attention", sliding) is not None  # sliding: rate / top-k optional
    for change, message in (
        ({"layer_type": ("int32", 5)}, "field 'layer_type' = 5 is outside [0, 2]"),
        ({"compress_rate": ("int32", 0)}, "compress_rate 0 must be >= 1"),
        ({"window": ("int32", 0)}, "field 'window' = 0 is outside"),
    ):
        capfd.readouterr()
        assert create_plugin(trt, "EngramDsv4Attention", {**good, **change}) is None
        assert any(message in line for line in capfd.readouterr().err.splitlines())


@pytest.mark.parametrize("layer_type", [1, 0], ids=["csa", "sliding"])
def test_onnx_graph_with_the_node_builds_an_engine(trt, tmp_path: Path, layer_type: int) -> None:
    from onnx import TensorProto

    bf, f32, i32 = TensorProto.BFLOAT16, TensorProto.FLOAT, TensorProto.INT32
    H, d, N, W, r, E, NI, di = 4, 64, 4, 6, 4, 16, 4, 32
    names = [
        "q",
        "kv",
        "sinks",
        "seq_starts",
        "past_lens",
        "slots",
        "window_kv",
        "c_kv",
        "c_gate",
        "c_bias",
        "c_norm",
        "inv_freq",
        "compressed_kv",
        "compressor_kv",
        "compressor_gate",
        "index_q",
        "index_w",
        "i_kv",
        "i_gate",
        "i_bias",
        "i_norm",
        "index_keys",
        "indexer_kv",
        "indexer_gate",
    ]
    specs = [
        (bf, ["T", H, d]),
        (bf, ["T", d]),
        (f32, [H]),
        (i32, ["S1"]),
        (i32, ["S"]),
        (i32, ["S"]),
        (bf, [N, W, d]),
        (bf, ["T", 2 * d]),
        (bf, ["T", 2 * d]),
        (f32, [r, 2 * d]),
        (f32, [d]),
        (f32, [8]),
        (bf, [N, E, d]),
        (bf, [N, 2 * r, 2 * d]),
        (bf, [N, 2 * r, 2 * d]),
        (bf, ["T", NI, di]),
        (f32, ["T", NI]),
        (bf, ["T", 2 * di]),
        (bf, ["T", 2 * di]),
        (f32, [r, 2 * di]),
        (f32, [di]),
        (bf, [N, E, di]),
        (bf, [N, 2 * r, 2 * di]),
        (bf, [N, 2 * r, 2 * di]),
    ]
    n = 24 if layer_type == 1 else 7
    states = [6, 12, 13, 14, 21, 22, 23] if layer_type == 1 else [6]
    inputs = [(names[i], *specs[i]) for i in range(n)]
    outputs = [("out", bf, ["T", H, d])] + [(names[i] + "_out", *specs[i]) for i in states]
    attrs = {
        "layer_type": layer_type,
        "window": W,
        "compress_rate": r,
        "index_topk": 2,
        "scaling": d**-0.5,
        "eps": 1e-6,
        "rope_scale": 1.0,
    }
    path = tmp_path / "dsv4.onnx"
    write_plugin_graph(path, "EngramDsv4Attention", inputs, outputs, attrs)
    shapes = {}
    for name, _, dims in inputs:
        if "T" in dims or "S" in dims or "S1" in dims:

            def at(v, dims=dims):
                return tuple(v if x in ("T", "S") else v + 1 if x == "S1" else x for x in dims)

            shapes[name] = (at(1), at(4), at(16)) if "T" in dims else (at(1), at(2), at(4))
    network, engine = build_plugin_engine(trt, path, shapes, "EngramDsv4Attention")
    assert network.num_outputs == 1 + len(states)
    assert engine is not None and engine.nbytes > 1000


@pytest.fixture(scope="module")
def harness():
    (helpers, check) = harness_scripts(HARNESS, "helpers", "test_dsv4_attention")
    return helpers, check, helpers.Harness(HARNESS)


def test_plugin_through_the_harness(harness) -> None:
    _helpers, check, h = harness
    results = check.check_plugin_cpu(h)
    assert list(results) == check.PLUGIN_CPU_CHECKS and len(results) == 14
    assert not results.failed(), results.failed()
