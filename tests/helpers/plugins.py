"""The TensorRT plugin tests' helpers: the plugin harness and the GPU modules bound through
it, the flavours' createPlugin with a field collection, one-plugin ONNX graphs and their
builder configs, plugin fields as the harness takes them (name, nvinfer1 type code,
array) and changes of a field list, and why no engine can be built here."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.files import REPO


HARNESS_NAME = "libengram_plugin_harness.so"


def harness_path() -> Path:
    """The plugin harness beside the library the tests use (installed package or source
    build), else the source tree's own build."""
    from engram_trt.native import library as kernel_library
    from engram_trt.errors import EngramError

    try:
        lib = kernel_library.library_path()
        for cand in (lib.parent / HARNESS_NAME, lib.parent / "plugins" / "tests" / HARNESS_NAME):
            if cand.is_file():
                return cand
    except EngramError:
        pass
    return REPO / "build" / "plugins" / "tests" / HARNESS_NAME


def harness_scripts(harness: Path, *modules: str) -> list:
    """The GPU tests' modules (tests/gpu: ``helpers``, ``test_attention``, ...), imported for
    their harness bindings and CPU checks, once the harness library is known to exist."""
    import importlib

    if not harness.is_file():
        pytest.skip(f"no CUDA compiler built the plugin harness ({harness}): nvcc / the CUDA toolkit is missing")
    return [importlib.import_module(f"gpu.{m}") for m in modules]


PLUGIN_NAMESPACE = "engram_trt"  # the creators' plugin namespace (plugins/common/engramPluginBase.h)


def require_trt_module(module: str) -> None:
    """Skip unless the TensorRT flavour ``module`` (``tensorrt_rtx`` or ``tensorrt``) is
    installed; the skip names which one is missing."""
    from engram_trt.native import trt_compat

    if not trt_compat.module_available(
        module if module != "tensorrt_rtx" else "tensorrt_rtx_bindings"
    ) and not trt_compat.module_available(module):
        pytest.skip(trt_compat.NOT_INSTALLED_REASON if module == "tensorrt" else "tensorrt_rtx not installed")


def plugin_fields(trt, fields: dict[str, tuple[str, object]]):
    """A PluginFieldCollection from {name: (kind, value)}; kind int32 / int64 / float32 /
    text (comma-separated decimals, the ONNX form of int64 arrays). Also returns the
    PluginFields and their arrays: the collection points into them without owning them,
    so the caller holds them until createPlugin has read the fields."""
    import numpy as np

    m = trt.module
    out, arrays = [], []
    for name, (kind, value) in fields.items():
        if kind == "text":
            data = np.frombuffer(str(value).encode(), dtype=np.int8).copy()
            ftype = m.PluginFieldType.CHAR
        else:
            ftype = {
                "int32": m.PluginFieldType.INT32,
                "int64": m.PluginFieldType.INT64,
                "float32": m.PluginFieldType.FLOAT32,
            }[kind]
            data = np.atleast_1d(np.asarray(value, dtype=kind))
        arrays.append(data)
        out.append(m.PluginField(name, data, ftype))
    return m.PluginFieldCollection(out), (out, arrays)


def create_plugin(trt, name: str, fields: dict[str, tuple[str, object]]):
    """The registry creator of plugin ``name`` (version 1, our namespace) called in the
    build phase with ``fields`` (see plugin_fields): the plugin, or None if refused."""
    creator = trt.module.get_plugin_registry().get_creator(name, "1", PLUGIN_NAMESPACE)
    assert creator is not None, f"{name} creator is not registered"
    collection, keep = plugin_fields(trt, fields)
    plugin = creator.create_plugin(name, collection, trt.module.TensorRTPhase.BUILD)
    del keep  # read: the plugin holds its own copy of every field
    return plugin


def parse_plugin_graph(trt, path: Path):
    """A builder and the network parsed from the ONNX file ``path``, and the network's one
    IPluginV3 layer: (builder, network, layer)."""
    from engram_trt.native import trt_compat

    builder = trt_compat.create_builder()
    network = trt_compat.create_network(builder)
    trt_compat.parse_onnx_file(trt_compat.onnx_parser(network), path)
    (layer,) = [
        network.get_layer(i)
        for i in range(network.num_layers)
        if network.get_layer(i).type == trt.module.LayerType.PLUGIN_V3
    ]
    return builder, network, layer


def plugin_builder_config(trt, builder, aliased: bool):
    """A builder config for the plugin tests' engines: the aliased plugin I/O preview
    feature when ``aliased`` (what build_engine enables), sm80 targets on TensorRT-RTX."""
    from engram_trt.native import trt_compat

    config = builder.create_builder_config()
    if aliased:
        trt_compat.enable_aliased_plugin_io(config)
    if trt.is_rtx:
        trt_compat.set_targets(config, ("sm80",))
    return config


def write_plugin_graph(
    path: Path, op: str, inputs: list[tuple[str, int, list]], outputs: list[tuple[str, int, list]], attributes: dict
) -> None:
    """An ONNX graph of one plugin node ``op`` (the engram_trt domain, version 1) written to ``path``."""
    import onnx
    from onnx import helper

    node = helper.make_node(
        op,
        [n for n, _, _ in inputs],
        [n for n, _, _ in outputs],
        name=op.lower(),
        domain=PLUGIN_NAMESPACE,
        plugin_version="1",
        plugin_namespace=PLUGIN_NAMESPACE,
        **attributes,
    )
    graph = helper.make_graph(
        [node],
        op,
        [helper.make_tensor_value_info(*i) for i in inputs],
        [helper.make_tensor_value_info(*o) for o in outputs],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(PLUGIN_NAMESPACE, 1)]
    )
    onnx.save(model, str(path))


def build_plugin_engine(trt, path: Path, shapes: dict[str, tuple[tuple, tuple, tuple]], name: str):
    """The one-plugin graph at ``path`` (plugin ``name``) built with aliased I/O and the
    ``shapes`` profile: (the network, the serialized engine or None)."""
    builder, network, layer = parse_plugin_graph(trt, path)
    layer.__class__ = trt.module.IPluginV3Layer
    core = layer.plugin.get_capability_interface(trt.module.PluginCapabilityType.CORE)
    assert (core.plugin_name, core.plugin_namespace, core.plugin_version) == (name, PLUGIN_NAMESPACE, "1")
    config = plugin_builder_config(trt, builder, aliased=True)
    profile = builder.create_optimization_profile()
    for tensor, (lo, opt, hi) in shapes.items():
        profile.set_shape(tensor, lo, opt, hi)
    config.add_optimization_profile(profile)
    return network, builder.build_serialized_network(network, config)


def serialized_twice(harness, name: str, fields: list) -> tuple[list, list]:
    """Through the plugin harness: getFieldsToSerialize of plugin ``name`` made from
    ``fields``, and the same of the plugin rebuilt from those (the round trip an engine's
    deserialization takes); both plugins destroyed."""
    p = harness.create(name, fields)
    try:
        first = harness.serialized_fields(p)
        p2 = harness.roundtrip(p)
        try:
            again = harness.serialized_fields(p2)
        finally:
            harness.lib.harness_destroy(p2)
    finally:
        harness.lib.harness_destroy(p)
    return first, again


def engine_skip_reason(plugins: tuple[str, ...]) -> str | None:
    """Why no TensorRT-RTX engine holding ``plugins`` can be built here (None: it can)."""
    from engram_trt.errors import EngramError
    from engram_trt.native import library as kernel_library
    from engram_trt.native import trt_compat as tc

    if not tc.available():
        return "no TensorRT builder is installed (tensorrt_rtx / tensorrt_rtx_bindings, or tensorrt)"
    try:
        lib = kernel_library.library_path()
    except EngramError as exc:
        return f"the plugin library is missing: {exc}"
    tc.load_plugin_library(lib)
    have = {n for n, _ in tc.plugin_creator_names()}
    missing = [n for n in plugins if n not in have]
    if missing:
        return (
            f"the plugin library {lib} lacks {', '.join(missing)} "
            "(rebuild it from this tree; ENGRAM_TRT_PLUGIN_LIB points at one)"
        )
    return None


# --- plugin fields as the plugin harness takes them: (name, nvinfer1 type code, array) ---


# nvinfer1::PluginFieldType values
PF_FLOAT32, PF_FLOAT64, PF_INT8, PF_INT16, PF_INT32, PF_CHAR, PF_INT64 = 1, 2, 3, 4, 5, 6, 10


def pf_scalar(ftype: int, value):
    """``value`` as a one-element array of field type ``ftype``'s numpy type."""
    import numpy as np

    dtype = {
        PF_FLOAT32: np.float32,
        PF_FLOAT64: np.float64,
        PF_INT8: np.int8,
        PF_INT16: np.int16,
        PF_INT32: np.int32,
        PF_INT64: np.int64,
    }[ftype]
    return np.array([value], dtype)


def pf_text(values):
    """Integers as comma-separated decimal text (the ONNX form of an int64 array), in bytes."""
    import numpy as np

    return np.frombuffer(",".join(str(int(v)) for v in np.asarray(values).reshape(-1)).encode(), np.uint8)


def pf_written(name: str, ftype: int, values) -> tuple[str, int, int, bytes]:
    """A field as getFieldsToSerialize must write it: the declared type, its bytes."""
    import numpy as np

    dtype = {PF_INT32: np.int32, PF_INT64: np.int64, PF_FLOAT32: np.float32}[ftype]
    data = np.atleast_1d(np.asarray(values, dtype))
    return name, ftype, int(data.size), data.tobytes()


def drop_field(name: str):
    """A change of a field list: field ``name`` left out."""
    return lambda fields: [f for f in fields if f[0] != name]


def set_field(name: str, ftype: int, data):
    """A change of a field list: field ``name`` given as ``ftype`` / ``data`` instead."""
    return lambda fields: [(n, ftype, data) if n == name else (n, t, d) for n, t, d in fields]


def add_field(name: str, ftype: int, data):
    """A change of a field list: field ``name`` appended."""
    return lambda fields: fields + [(name, ftype, data)]
