"""The native library (libengram_trt_plugins.so) on a machine without a GPU.

- its exported symbols are exactly the registration entry points and the kernels' C ABI;
- the C ABI's host-side checks (layout, table format) and the ctypes bindings'
  argument checks run without a GPU;
- with TensorRT-RTX: the library loads through the plugin registry, the three creators
  are listed with their fields, refuse out-of-range or malformed fields (createPlugin
  needs no GPU), an ONNX graph holding EngramHash -> EngramGather -> wkv ->
  EngramGate builds into an engine on the CPU, and so do graphs whose gate takes fp16
  or fp32 hidden / kv (the output takes hidden's type).
The kernels themselves run on the H200 through scripts/h200_verify.py (docs/benchmarks.md).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from engram_trt import kernels, trt_compat
from engram_trt.config.model import EngramSpec
from engram_trt.errors import EngramError
from engram_trt.engram.layout import EngramLayout

REPO = Path(__file__).resolve().parents[1]
HEADER = REPO / "plugins" / "kernels" / "engramKernels.h"
PLUGINS = {
    "EngramHash": ["n_layers", "max_ngram_size", "n_heads", "pad_id", "compressed_vocab_size", "primes", "offsets",
                   "multipliers"],
    "EngramGather": ["layer_index", "n_layers", "n_cols", "head_dim", "table_dtype", "quant_block", "num_rows"],
    "EngramGate": ["hc_mult", "hidden_size", "eps"],
}


def _abi_names() -> set[str]:
    """Every ENGRAM_API function the header declares."""
    text = HEADER.read_text()
    return set(re.findall(r"ENGRAM_API\s+[\w\s\*]+?\b(engram_\w+)\s*\(", text))


@pytest.fixture(scope="session")
def layout() -> EngramLayout:
    spec = EngramSpec(layer_ids=(1, 3), max_ngram_size=3, n_heads=4, vocab_size=1000, compressed_vocab_size=900,
                      pad_token_id=0, head_dim=64)
    return EngramLayout.from_spec(spec, pad_id=5)


def test_exported_symbols_are_the_abi_and_nothing_else(plugin_lib: Path) -> None:
    if shutil.which("nm") is None:
        pytest.skip("nm (binutils) is not installed")
    out = subprocess.run(["nm", "-D", "--defined-only", str(plugin_lib)], check=True, capture_output=True, text=True).stdout
    exported = {line.split()[-1] for line in out.splitlines() if line.strip()}
    expected = {"getCreators", "setLoggerFinder"} | _abi_names()
    assert "engram_gather" in expected and "engram_host_gather" in expected  # the header parse found the ABI
    assert exported == expected, f"unexpected: {sorted(exported - expected)}, missing: {sorted(expected - exported)}"
    # no libnvinfer / libcudart dependency: the library must load where only TensorRT-RTX exists
    needed = subprocess.run(["readelf", "-d", str(plugin_lib)], capture_output=True, text=True).stdout if shutil.which("readelf") else ""
    assert "libnvinfer" not in needed and "libcudart" not in needed


def test_version_matches_the_header(plugin_lib: Path) -> None:
    declared = re.search(r'#define ENGRAM_TRT_PLUGIN_VERSION "([^"]+)"', HEADER.read_text()).group(1)
    assert kernels.version() == declared


def test_layout_checks_run_without_gpu(plugin_lib: Path, layout: EngramLayout) -> None:
    kernels.check_layout(layout)  # the real layout passes

    too_big = EngramLayout(**{**layout.__dict__, "multipliers": layout.multipliers.copy()})
    too_big.multipliers[1, 2] = np.iinfo(np.int64).max // (layout.compressed_vocab_size - 1) + 1
    with pytest.raises(EngramError, match=r"multiplier\[5\]"):
        kernels.check_layout(too_big)

    wide = EngramLayout(**{**layout.__dict__, "offsets": layout.offsets.copy()})
    wide.offsets[0, -1] = 2**31 - 2
    with pytest.raises(EngramError, match="fit int32"):
        kernels.check_layout(wide)


def test_bindings_name_the_bad_argument() -> None:
    import torch

    class Lay:  # only the fields hash_packed reads before the device check
        max_ngram_size, num_layers, n_hash_cols = 3, 1, 2

    with pytest.raises(EngramError, match="^ids must be a CUDA tensor"):
        kernels.hash_packed(torch.zeros(4, dtype=torch.int32), torch.zeros(2, dtype=torch.int32), None, Lay())
    with pytest.raises(EngramError, match="^ids must have dtype torch.int32"):
        kernels.hash_packed(torch.zeros(4, dtype=torch.int64), torch.zeros(2, dtype=torch.int32), None, Lay())
    kv, w = torch.zeros(2, 16, dtype=torch.bfloat16), torch.zeros(1, 8)
    with pytest.raises(EngramError, match=r"^hidden must have dtype torch.bfloat16 or torch.float16 or torch.float32 "
                                          r"\(got torch.float64\)$"):
        kernels.gate(torch.zeros(2, 1, 8, dtype=torch.float64), kv, w, w, eps=1e-6)
    with pytest.raises(EngramError, match="^hidden, kv and out must share one dtype .*; got hidden torch.float32, "
                                          "kv torch.bfloat16$"):
        kernels.gate(torch.zeros(2, 1, 8), kv, w, w, eps=1e-6)
    with pytest.raises(EngramError, match="got hidden torch.float16, kv torch.float16, out torch.bfloat16$"):
        kernels.gate(torch.zeros(2, 1, 8, dtype=torch.float16), kv.half(), w, w, eps=1e-6,
                     out=torch.zeros(2, 1, 8, dtype=torch.bfloat16))
    with pytest.raises(EngramError, match=r"^q_weight must have dtype torch.bfloat16 or torch.float32 \(got torch.float16\)"):
        kernels.gate(torch.zeros(2, 1, 8, dtype=torch.bfloat16), kv, w.half(), w.half(), eps=1e-6)
    with pytest.raises(EngramError, match=r"^k_weight must have dtype torch.float16 \(got torch.float32\)"):
        kernels.gate(torch.zeros(2, 1, 8, dtype=torch.float16), kv.half(), w.half(), w, eps=1e-6)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):  # all three I/O types pass the dtype checks
        with pytest.raises(EngramError, match="^hidden must be a CUDA tensor"):
            kernels.gate(torch.zeros(2, 1, 8, dtype=dtype), kv.to(dtype), w.to(dtype), w.to(dtype), eps=1e-6)
    with pytest.raises(EngramError, match=r"^ids must be a CUDA tensor"):
        kernels.gather(torch.zeros(2, 3, dtype=torch.int32), torch.zeros(10, 64, dtype=torch.uint8))


def test_gate_abi_refuses_bad_types_before_any_cuda_call(plugin_lib: Path) -> None:
    """engram_gate_typed's type checks (I/O type, weight type vs I/O type) and the bf16-only
    engram_gate's weight check run on the host: no GPU needed, one-line reasons."""
    import ctypes

    lib = kernels.load_library()
    p = ctypes.c_void_p(16)  # never read: the calls fail on their types first

    def typed(io_type: int, weight_type: int) -> tuple[int, str]:
        status = lib.engram_gate_typed(p, p, io_type, p, p, weight_type, None, kernels.MASK_NONE, 4, 2, 64,
                                       ctypes.c_float(1e-6), ctypes.c_float(1e-6), p, None)
        return status, lib.engram_last_error().decode()

    assert typed(3, kernels.FLOAT_BF16) == (1, "engram_gate: io_type 3 is not bf16 (0), fp32 (1) or fp16 (2)")
    assert typed(kernels.FLOAT_BF16, kernels.FLOAT_F16) == (
        1, "engram_gate: weight_type 2 is neither bf16 (0), fp32 (1) nor the io_type (0, bf16)")
    assert typed(kernels.FLOAT_F32, kernels.FLOAT_F16)[0] == 1
    status = lib.engram_gate(p, p, p, p, kernels.WEIGHT_F16, None, kernels.MASK_NONE, 4, 2, 64,
                             ctypes.c_float(1e-6), ctypes.c_float(1e-6), p, None)
    assert (status, lib.engram_last_error().decode()) == (
        1, "engram_gate: weight_type 2 is neither bf16 (0) nor fp32 (1)")
    # zero tokens: every type combination is valid and nothing is launched
    for io_type, weight_types in ((kernels.FLOAT_BF16, (0, 1)), (kernels.FLOAT_F16, (0, 1, 2)),
                                  (kernels.FLOAT_F32, (0, 1))):
        for wt in weight_types:
            status = lib.engram_gate_typed(p, p, io_type, p, p, wt, None, kernels.MASK_NONE, 0, 2, 64,
                                           ctypes.c_float(1e-6), ctypes.c_float(1e-6), p, None)
            assert status == 0, lib.engram_last_error().decode()


def test_host_gatherer_create_reports_a_missing_device(plugin_lib: Path) -> None:
    """Without a GPU the gatherer's first CUDA call, cudaGetDevice, fails: that is the
    error reported (it used to be ignored, and a later allocation failed instead)."""
    import ctypes

    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the gatherer would be created")
    lib = kernels.load_library()
    handle = ctypes.c_void_p(1)
    status = lib.engram_host_gatherer_create(2, 64, 64, ctypes.byref(handle))
    assert status != 0 and handle.value is None
    assert "engram_host_gatherer_create: cudaGetDevice failed" in lib.engram_last_error().decode()


# --- TensorRT-RTX ------------------------------------------------------------------------

def _require(module: str) -> None:
    if not trt_compat.module_available(module if module != "tensorrt_rtx" else "tensorrt_rtx_bindings") \
            and not trt_compat.module_available(module):
        pytest.skip(trt_compat.NOT_INSTALLED_REASON if module == "tensorrt" else "tensorrt_rtx not installed")


@pytest.fixture(params=["tensorrt_rtx", "tensorrt"])
def trt(request, plugin_lib: Path, monkeypatch: pytest.MonkeyPatch):
    _require(request.param)
    monkeypatch.setenv("ENGRAM_TRT_FLAVOUR", request.param)
    t = trt_compat.load(request.param)
    trt_compat.load_plugin_library(plugin_lib)
    return t


def test_creators_are_registered_with_their_fields(trt) -> None:
    registry = trt.module.get_plugin_registry()
    found = {}
    for creator in registry.all_creators:
        if creator.name in PLUGINS:
            found[creator.name] = (creator.plugin_version, creator.plugin_namespace,
                                   [f.name for f in creator.field_names])
    assert set(found) == set(PLUGINS)
    for name, fields in PLUGINS.items():
        assert found[name] == ("1", "", fields)


def _engram_graph(layout: EngramLayout, path: Path, head_dim: int = 64, hc: int = 2, hidden: int = 128) -> None:
    """ids -> EngramHash -> EngramGather (layer 1, fp8 table by address) -> wkv -> EngramGate."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    cols, n = layout.n_hash_cols, layout.max_ngram_size - 1
    rng = np.random.default_rng(0)

    def bf16_init(name, shape):
        import torch

        t = torch.from_numpy(rng.standard_normal(shape).astype(np.float32) * 0.05).to(torch.bfloat16)
        return helper.make_tensor(name, TensorProto.BFLOAT16, shape, t.view(torch.int16).numpy().tobytes(), raw=True)

    def i64(name, values):
        # int64 arrays travel as decimal text (STRING attribute): the ONNX parser narrows
        # INTS attributes to int32, which would truncate the multipliers.
        return ",".join(str(int(v)) for v in np.asarray(values).reshape(-1))

    nodes = [
        helper.make_node("EngramHash", ["ids", "seq_starts", "lookback"], ["hash_ids"], name="hash",
                         domain="engram_trt", plugin_version="1", n_layers=layout.num_layers,
                         max_ngram_size=layout.max_ngram_size, n_heads=layout.n_heads, pad_id=layout.pad_id,
                         compressed_vocab_size=layout.compressed_vocab_size,
                         primes=i64("primes", layout.primes), offsets=i64("offsets", layout.offsets),
                         multipliers=i64("multipliers", layout.multipliers)),
        helper.make_node("EngramGather", ["hash_ids", "rows_addr", "scales_addr"], ["rows"], name="gather",
                         domain="engram_trt", plugin_version="1", layer_index=1, n_layers=layout.num_layers,
                         n_cols=cols, head_dim=head_dim, table_dtype=0, quant_block=32,
                         num_rows=int(layout.table_rows[1])),
        helper.make_node("Reshape", ["rows", "flat_shape"], ["rows_flat"], name="flatten"),
        helper.make_node("MatMul", ["rows_flat", "wkv"], ["kv"], name="wkv"),
        helper.make_node("EngramGate", ["hidden", "kv", "q_weight", "k_weight", "mask"], ["out"], name="gate",
                         domain="engram_trt", plugin_version="1", hc_mult=hc, hidden_size=hidden, eps=1e-6),
    ]
    inputs = [
        helper.make_tensor_value_info("ids", TensorProto.INT32, ["T"]),
        helper.make_tensor_value_info("seq_starts", TensorProto.INT32, ["S1"]),
        helper.make_tensor_value_info("lookback", TensorProto.INT32, ["S", n]),
        helper.make_tensor_value_info("rows_addr", TensorProto.INT64, [1]),
        helper.make_tensor_value_info("scales_addr", TensorProto.INT64, [1]),
        helper.make_tensor_value_info("hidden", TensorProto.BFLOAT16, ["T", hc, hidden]),
        helper.make_tensor_value_info("mask", TensorProto.BOOL, ["T"]),
    ]
    inits = [numpy_helper.from_array(np.array([-1, cols * head_dim], dtype=np.int64), "flat_shape"),
             bf16_init("wkv", [cols * head_dim, (hc + 1) * hidden]), bf16_init("q_weight", [hc, hidden]),
             bf16_init("k_weight", [hc, hidden])]
    graph = helper.make_graph(nodes, "engram", inputs,
                              [helper.make_tensor_value_info("out", TensorProto.BFLOAT16, ["T", hc, hidden])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("engram_trt", 1)])
    onnx.save(model, str(path))


def test_onnx_graph_with_the_three_plugins_builds_an_engine(trt, layout: EngramLayout, tmp_path: Path) -> None:
    path = tmp_path / "engram.onnx"
    _engram_graph(layout, path)
    builder = trt_compat.create_builder()
    network = trt_compat.create_network(builder)
    parser = trt_compat.onnx_parser(network)
    trt_compat.parse_onnx_file(parser, path)

    plugin_layers = [network.get_layer(i) for i in range(network.num_layers)
                     if network.get_layer(i).type == trt.module.LayerType.PLUGIN_V3]
    assert sorted(layer.name for layer in plugin_layers) == ["gate", "gather", "hash"]
    by_name = {network.get_output(i).name: network.get_output(i) for i in range(network.num_outputs)}
    assert tuple(by_name["out"].shape)[1:] == (2, 128) and by_name["out"].dtype == trt.module.bfloat16

    config = builder.create_builder_config()
    if trt.is_rtx:
        trt_compat.set_targets(config, ("sm80",))
    profile = builder.create_optimization_profile()
    n = layout.max_ngram_size - 1
    for name, lo, opt, hi in (("ids", (1,), (64,), (512,)), ("seq_starts", (2,), (3,), (9,)),
                              ("lookback", (1, n), (2, n), (8, n)), ("hidden", (1, 2, 128), (64, 2, 128), (512, 2, 128)),
                              ("mask", (1,), (64,), (512,))):
        profile.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(profile)
    engine = builder.build_serialized_network(network, config)
    assert engine is not None and engine.nbytes > 10_000


def _gate_graph(path: Path, io: str, weights: str, kv_io: str | None = None, hc: int = 2, hidden: int = 128) -> None:
    """hidden, kv (io, or kv_io) -> EngramGate (q/k weights of `weights`) -> out (io)."""
    import onnx
    from onnx import TensorProto, helper

    elem = {"bf16": TensorProto.BFLOAT16, "fp16": TensorProto.FLOAT16, "fp32": TensorProto.FLOAT}
    rng = np.random.default_rng(1)

    def init(name, shape, dtype):
        import torch

        t = torch.from_numpy((1 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
        t = t.to({"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype])
        raw = t.view(torch.int16).numpy().tobytes() if dtype != "fp32" else t.numpy().tobytes()
        return helper.make_tensor(name, elem[dtype], shape, raw, raw=True)

    node = helper.make_node("EngramGate", ["hidden", "kv", "q_weight", "k_weight", "mask"], ["out"], name="gate",
                            domain="engram_trt", plugin_version="1", hc_mult=hc, hidden_size=hidden, eps=1e-6)
    inputs = [helper.make_tensor_value_info("hidden", elem[io], ["T", hc, hidden]),
              helper.make_tensor_value_info("kv", elem[kv_io or io], ["T", (hc + 1) * hidden]),
              helper.make_tensor_value_info("mask", TensorProto.BOOL, ["T"])]
    graph = helper.make_graph([node], "gate", inputs, [helper.make_tensor_value_info("out", elem[io], ["T", hc, hidden])],
                              [init("q_weight", [hc, hidden], weights), init("k_weight", [hc, hidden], weights)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("engram_trt", 1)])
    onnx.save(model, str(path))


def _build_gate(trt, path: Path, hc: int = 2, hidden: int = 128):
    builder = trt_compat.create_builder()
    network = trt_compat.create_network(builder)
    parser = trt_compat.onnx_parser(network)
    trt_compat.parse_onnx_file(parser, path)
    config = builder.create_builder_config()
    if trt.is_rtx:
        trt_compat.set_targets(config, ("sm80",))
    profile = builder.create_optimization_profile()
    for name, dims in (("hidden", lambda t: (t, hc, hidden)), ("kv", lambda t: (t, (hc + 1) * hidden)),
                       ("mask", lambda t: (t,))):
        profile.set_shape(name, dims(1), dims(64), dims(512))
    config.add_optimization_profile(profile)
    return network, builder.build_serialized_network(network, config)


@pytest.mark.parametrize("io, weights", [("fp16", "fp16"), ("fp16", "fp32"), ("fp16", "bf16"), ("fp32", "fp32"),
                                         ("fp32", "bf16"), ("bf16", "bf16")])
def test_gate_graph_of_each_io_dtype_builds_an_engine(trt, tmp_path: Path, io: str, weights: str) -> None:
    """The gate takes hidden / kv in bf16, fp16 or fp32 (weights bf16, fp32 or hidden's
    type); the output has hidden's type, so an fp16 graph needs no casts around it."""
    path = tmp_path / "gate.onnx"
    _gate_graph(path, io, weights)
    network, engine = _build_gate(trt, path)
    want = {"bf16": trt.module.bfloat16, "fp16": trt.module.float16, "fp32": trt.module.float32}[io]
    (layer,) = [network.get_layer(i) for i in range(network.num_layers)
                if network.get_layer(i).type == trt.module.LayerType.PLUGIN_V3]
    assert layer.get_output(0).dtype == want
    assert engine is not None and engine.nbytes > 5_000


@pytest.mark.parametrize("io, weights, kv_io, reason", [
    ("fp16", "fp16", "fp32", "hidden and kv must be both bfloat16, both float16 or both float32, got float16 and float32"),
    ("fp32", "fp16", None, "q_weight and k_weight must both be bfloat16, both float32 or both hidden's type (float32)"),
    ("bf16", "fp16", None, "q_weight and k_weight must both be bfloat16, both float32 or both hidden's type (bfloat16)")])
def test_gate_graph_with_mixed_types_is_refused(trt, tmp_path: Path, capfd, io: str, weights: str,
                                                kv_io: str | None, reason: str) -> None:
    """hidden and kv of different types, or fp16 weights with non-fp16 hidden: no engine,
    and the plugin's reason reaches the log."""
    path = tmp_path / "gate.onnx"
    _gate_graph(path, io, weights, kv_io=kv_io)
    try:
        _, engine = _build_gate(trt, path)
    except Exception:  # noqa: BLE001 - the parser or builder may raise instead of returning None
        engine = None
    assert engine is None
    err = capfd.readouterr()
    assert f"EngramGate: {reason}" in err.out + err.err


# --- field validation through the registry's creators (createPlugin needs no GPU) -------

def _plugin_fields(trt, fields: dict[str, tuple[str, object]]):
    """A PluginFieldCollection from {name: (kind, value)}; kind int32 / int64 / float32 /
    text (comma-separated decimals, the ONNX form of int64 arrays)."""
    m = trt.module
    out = []
    for name, (kind, value) in fields.items():
        if kind == "text":
            data = np.frombuffer(str(value).encode(), dtype=np.int8).copy()
            out.append(m.PluginField(name, data, m.PluginFieldType.CHAR))
        else:
            ftype = {"int32": m.PluginFieldType.INT32, "int64": m.PluginFieldType.INT64,
                     "float32": m.PluginFieldType.FLOAT32}[kind]
            out.append(m.PluginField(name, np.atleast_1d(np.asarray(value, dtype=kind)), ftype))
    return m.PluginFieldCollection(out)


def _create(trt, name: str, fields: dict[str, tuple[str, object]]):
    creator = trt.module.get_plugin_registry().get_creator(name, "1", "")
    assert creator is not None, f"{name} creator is not registered"
    return creator.create_plugin(name, _plugin_fields(trt, fields), trt.module.TensorRTPhase.BUILD)


def _text(values) -> str:
    return ",".join(str(int(v)) for v in np.asarray(values).reshape(-1))


def _hash_fields(layout: EngramLayout) -> dict[str, tuple[str, object]]:
    return {"n_layers": ("int32", layout.num_layers), "max_ngram_size": ("int32", layout.max_ngram_size),
            "n_heads": ("int32", layout.n_heads), "pad_id": ("int64", layout.pad_id),
            "compressed_vocab_size": ("int64", layout.compressed_vocab_size),
            "primes": ("text", _text(layout.primes)), "offsets": ("text", _text(layout.offsets)),
            "multipliers": ("text", _text(layout.multipliers))}


GATHER_FIELDS = {"layer_index": ("int32", 1), "n_layers": ("int32", 2), "n_cols": ("int32", 8),
                 "head_dim": ("int32", 64), "table_dtype": ("int32", 0), "quant_block": ("int32", 32),
                 "num_rows": ("int64", 1000)}
GATE_FIELDS = {"hc_mult": ("int32", 4), "hidden_size": ("int32", 64), "eps": ("float32", 1e-6)}

# (plugin, fields changed, what the refusal must say). Each value would have been narrowed
# to int32 or accepted before: 2^32 + 4 became 4, "p0+p1" read as [p0, p1], "12-3" as [12, -3].
BAD_FIELDS = [
    ("EngramGate", {"hc_mult": ("int64", 2**32 + 4)}, "field 'hc_mult' = 4294967300 is outside [1, 65535]"),
    ("EngramGate", {"hc_mult": ("int32", 65536)}, "field 'hc_mult' = 65536 is outside [1, 65535]"),
    ("EngramGate", {"hidden_size": ("int64", 2**32 + 64)}, "field 'hidden_size' = 4294967360 is outside"),
    ("EngramGate", {"hc_mult": ("int32", 65535), "hidden_size": ("int32", 32768)},
     "(hc_mult + 1) * hidden_size = 2147483648 exceeds 2^31 - 1"),
    ("EngramHash", {"n_heads": ("int64", 2**32 + 4)}, "field 'n_heads' = 4294967300 is outside [1, 512]"),
    ("EngramHash", {"n_layers": ("int64", 2**32 + 2)}, "field 'n_layers' = 4294967298 is outside"),
    ("EngramHash", {"max_ngram_size": ("int64", 2**32 + 3)}, "field 'max_ngram_size' = 4294967299 is outside [2, 16]"),
    ("EngramHash", {"n_heads": ("int32", 300)}, "n_layers * (max_ngram_size - 1) * n_heads = 1200 exceeds 512"),
    ("EngramHash", "primes:+", "field 'primes' holds text that is not a list of integers"),
    ("EngramHash", "offsets:-", "field 'offsets' holds text that is not a list of integers"),
    ("EngramHash", {"pad_id": ("text", "5x")}, "field 'pad_id' holds text that is not a list of integers"),
    ("EngramGather", {"n_cols": ("int64", 2**32 + 8)}, "field 'n_cols' = 4294967304 is outside"),
    ("EngramGather", {"layer_index": ("int64", 2**32 + 1)}, "field 'layer_index' = 4294967297 is outside"),
    ("EngramGather", {"head_dim": ("int64", 2**32 + 64)}, "field 'head_dim' = 4294967360 is outside"),
    ("EngramGather", {"table_dtype": ("int64", 2**32)}, "field 'table_dtype' = 4294967296 is outside [0, 1]"),
    ("EngramGather", {"num_rows": ("int64", 2**31)}, "num_rows must be in [1, 2^31 - 1]"),
]


@pytest.mark.parametrize("plugin,change,message", BAD_FIELDS, ids=[f"{p}-{m[:40]}" for p, _, m in BAD_FIELDS])
def test_creators_refuse_out_of_range_fields(trt, layout: EngramLayout, capfd, plugin, change, message) -> None:
    base = {"EngramGate": GATE_FIELDS, "EngramGather": GATHER_FIELDS, "EngramHash": _hash_fields(layout)}[plugin]
    fields = dict(base)
    if isinstance(change, str):  # "<field>:<char>": the first separator of a text array replaced
        name, char = change.split(":")
        fields[name] = ("text", fields[name][1].replace(",", char, 1))
    else:
        fields.update(change)
    capfd.readouterr()
    assert _create(trt, plugin, fields) is None
    assert message in capfd.readouterr().err


def test_creators_accept_the_edge_of_each_range(trt, layout: EngramLayout) -> None:
    # the controls of the test above: the same fields, in range, build a plugin
    assert _create(trt, "EngramGate", GATE_FIELDS) is not None
    widest = {"hc_mult": ("int64", 65535), "hidden_size": ("int32", 8)}
    assert _create(trt, "EngramGate", {**GATE_FIELDS, **widest}) is not None
    assert _create(trt, "EngramGate", {**GATE_FIELDS, "hidden_size": ("int32", 429_496_728)}) is not None  # 5 D = 2^31 - 8
    assert _create(trt, "EngramHash", _hash_fields(layout)) is not None
    spaced = {**_hash_fields(layout), "primes": ("text", _text(layout.primes).replace(",", ", "))}
    assert _create(trt, "EngramHash", spaced) is not None
    assert _create(trt, "EngramGather", GATHER_FIELDS) is not None
    assert _create(trt, "EngramGather", {**GATHER_FIELDS, "num_rows": ("int64", 2**31 - 1)}) is not None
    bf16 = {"table_dtype": ("int64", 1), "quant_block": ("int32", 0)}  # quant_block is ignored for bf16
    assert _create(trt, "EngramGather", {**GATHER_FIELDS, **bf16}) is not None
