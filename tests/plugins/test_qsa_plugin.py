"""The QSA attention kernel's C ABI and its EngramQsaAttention plugin on a machine without a GPU.

- the C ABI's field / shape checks and workspace size (engram_trt.native.qsa), and the
  binding's argument checks, run without a GPU and name the bad argument in one line;
- through the plugin harness: the serialized fields pinned (declared types whatever the
  input's), the round trip, output shapes / types, the three aliased caches, refused
  types and fields (tests/gpu/test_qsa_attention.check_plugin_cpu, shared with the GPU
  suite);
- with TensorRT-RTX: the creator is registered with its fields and refuses bad ones in
  one line; an ONNX graph of one EngramQsaAttention node (the attributes the Qwen4Exp
  export writes) builds into an engine on the CPU only with the aliasing preview feature.
The kernel and the plugin's enqueue run on the H200 in tests/gpu/test_qsa_attention.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engram_trt.errors import EngramError
from engram_trt.native import qsa

from helpers.plugins import (
    create_plugin,
    harness_path,
    harness_scripts,
    parse_plugin_graph,
    plugin_builder_config,
    serialized_twice,
)

NAME = "EngramQsaAttention"
NAMESPACE = "engram_trt"
FIELDS = ["compress_ratio", "block_topk", "rot_dim", "rope_theta", "eps", "scaling"]
HARNESS = harness_path()


def test_abi_checks_and_workspace_run_without_gpu(plugin_lib: Path) -> None:
    qsa.check_fields(qsa.QsaFields(4, 2, 16, 1e4, 1e-6, 0.125))
    qsa.check_fields(qsa.QsaFields(1, qsa.MAX_VISIBLE - 1, 0, 1.0, 0.0, 1.0))  # the edges
    qsa.check_shape(16, 2, 256, 64, 256, 64)
    for fields, needle in (
        (qsa.QsaFields(0, 2, 16, 1e4, 1e-6, 0.1), "compress_ratio >= 1"),
        (qsa.QsaFields(64, 256, 16, 1e4, 1e-6, 0.1), "(got 64, 256)"),
        (qsa.QsaFields(4, 2, 15, 1e4, 1e-6, 0.1), "rot_dim must be even"),
        (qsa.QsaFields(4, 2, 16, float("inf"), 1e-6, 0.1), "rope_theta must be finite"),
        (qsa.QsaFields(4, 2, 16, 1e4, -1.0, 0.1), "eps must be finite and >= 0"),
        (qsa.QsaFields(4, 2, 16, 1e4, 1e-6, 0.0), "scaling must be finite and > 0"),
    ):
        with pytest.raises(EngramError, match="engram_qsa_attention") as exc:
            qsa.check_fields(fields)
        assert needle in str(exc.value) and "\n" not in str(exc.value), (fields, str(exc.value))
    for args, needle in (
        ((6, 4, 64, 4, 32, 16), "a multiple of num_kv_heads"),
        ((8, 2, 512, 4, 32, 16), "head_dim and index_dim must be in [1, 256] (got 512, 32)"),
        ((8, 2, 64, 65, 32, 16), "index_heads must be in [1, 64] (got 65)"),
        ((8, 2, 64, 4, 32, 64), "rot_dim 64 exceeds head_dim 64 or index_dim 32"),
    ):
        with pytest.raises(EngramError, match="engram_qsa_attention") as exc:
            qsa.check_shape(*args)
        assert needle in str(exc.value) and "\n" not in str(exc.value), (args, str(exc.value))
    # one fp32 score and one flag per (token, block a slot can hold), 256 bytes of slack;
    # none at all when no query can see more than block_topk blocks
    assert qsa.workspace_size(10, 64, 4, 2) == 10 * 16 * 5 + 256
    assert qsa.workspace_size(10, 8, 4, 2) == 0
    assert qsa.workspace_size(0, 64, 4, 2) == 0
    # a long prefill over a long cache is processed in chunks of at most 64 MiB of scores
    assert qsa.workspace_size(1 << 16, 1 << 17, 4, 64) == (64 << 20) // ((1 << 15) * 5) * (1 << 15) * 5 + 256


def _inputs(T=3, H=4, kvh=2, hd=16, ni=2, di=16, S=2, L=12, io=torch.bfloat16, wt=torch.float32):
    return dict(
        q=torch.zeros(T, H, hd, dtype=io),
        k=torch.zeros(T, kvh, hd, dtype=io),
        v=torch.zeros(T, kvh, hd, dtype=io),
        index_q=torch.zeros(T, ni, di, dtype=io),
        index_raw=torch.zeros(T, di, dtype=io),
        key_cache=torch.zeros(S, kvh, L, hd, dtype=io),
        value_cache=torch.zeros(S, kvh, L, hd, dtype=io),
        index_key_cache=torch.zeros(S, L, di, dtype=io),
        index_k_norm_weight=torch.zeros(di, dtype=wt),
        token_slot=torch.zeros(T, dtype=torch.int32),
        token_pos=torch.zeros(T, dtype=torch.int32),
    )


FIELDS_OK = qsa.QsaFields(4, 2, 8, 1e4, 1e-6, 0.25)


@pytest.mark.parametrize(
    "change,needle",
    [
        (dict(q=torch.zeros(3, 4, 16, dtype=torch.int32)), "q must have dtype"),
        (dict(k=torch.zeros(3, 2, 16, dtype=torch.float16)), "k must have dtype torch.bfloat16"),
        (dict(index_k_norm_weight=torch.zeros(16, dtype=torch.float16)), "index_k_norm_weight must have dtype"),
        (dict(token_pos=torch.zeros(3, dtype=torch.int64)), "token_pos must have dtype torch.int32"),
        (dict(v=torch.zeros(3, 2, 8, dtype=torch.bfloat16)), "v must be [3, 2, 16]"),
        (dict(index_key_cache=torch.zeros(2, 11, 16, dtype=torch.bfloat16)), "index_key_cache must be [2, 12, 16]"),
        (dict(index_raw=torch.zeros(3, 8, dtype=torch.bfloat16)), "index_raw must be [3, 16]"),
        (dict(index_k_norm_weight=torch.zeros(8)), "index_k_norm_weight must be [16]"),
        (dict(token_slot=torch.zeros(4, dtype=torch.int32)), "token_slot must be [3]"),
        (
            dict(q=torch.zeros(3, 4, 16, dtype=torch.bfloat16).transpose(0, 1).contiguous().transpose(0, 1)),
            "q must be contiguous",
        ),
        (dict(), "q must be a CUDA tensor"),
    ],
)
def test_binding_names_the_bad_argument(plugin_lib: Path, change, needle) -> None:
    args = {**_inputs(), **change}
    with pytest.raises(EngramError) as exc:
        qsa.qsa_attention(*args.values(), FIELDS_OK)
    assert needle in str(exc.value) and "\n" not in str(exc.value), str(exc.value)


def test_binding_checks_the_fields_and_shapes_before_the_device(plugin_lib: Path) -> None:
    with pytest.raises(EngramError, match="rot_dim 32 exceeds head_dim 16"):
        qsa.qsa_attention(*_inputs().values(), qsa.QsaFields(4, 2, 32, 1e4, 1e-6, 0.25))
    with pytest.raises(EngramError, match="a multiple of num_kv_heads"):
        qsa.qsa_attention(*_inputs(H=3, kvh=2).values(), FIELDS_OK)


# --- the plugin harness --------------------------------------------------------------------


@pytest.fixture(scope="module")
def harness():
    (helpers, check) = harness_scripts(HARNESS, "helpers", "test_qsa_attention")
    return helpers, check, check.Harness(HARNESS)


def test_serialized_fields_are_pinned(harness) -> None:
    """Whatever widths the fields came in, the engine stores them as declared, in order."""
    helpers, _, h = harness
    PF_FLOAT64, PF_INT16, PF_INT64 = 2, 4, 10
    given = [
        ("scaling", PF_FLOAT64, np.array([0.125], np.float64)),
        ("rot_dim", PF_INT16, np.array([16], np.int16)),
        ("eps", helpers.PF_FLOAT32, np.array([1e-6], np.float32)),
        ("block_topk", PF_INT64, np.array([7], np.int64)),
        ("compress_ratio", helpers.PF_INT32, np.array([64], np.int32)),
        ("rope_theta", PF_FLOAT64, np.array([1e7], np.float64)),
    ]
    first, again = serialized_twice(h, NAME, given)
    i32, f32 = helpers.PF_INT32, helpers.PF_FLOAT32
    want = [
        ("compress_ratio", i32, 1, np.int32(64).tobytes()),
        ("block_topk", i32, 1, np.int32(7).tobytes()),
        ("rot_dim", i32, 1, np.int32(16).tobytes()),
        ("rope_theta", f32, 1, np.float32(1e7).tobytes()),
        ("eps", f32, 1, np.float32(1e-6).tobytes()),
        ("scaling", f32, 1, np.float32(0.125).tobytes()),
    ]
    assert first == want and again == want


def test_plugin_through_the_harness(harness) -> None:
    """Output shapes and types, refused type mixes, getAliasedInput (the three caches,
    build capability v2), the round trip, refused fields (one line each)."""
    _helpers, check, h = harness
    results = check.check_plugin_cpu(h)
    assert list(results) == check.PLUGIN_CPU_CHECKS and len(results) == 6
    assert not results.failed(), results.failed()


# --- TensorRT-RTX -------------------------------------------------------------------------------

# (the trt fixture: tests/conftest.py)


def _create(trt, fields: dict[str, tuple[str, object]]):
    return create_plugin(trt, NAME, fields)


VALID = {
    "compress_ratio": ("int32", 4),
    "block_topk": ("int32", 2),
    "rot_dim": ("int32", 16),
    "rope_theta": ("float32", 1e4),
    "eps": ("float32", 1e-6),
    "scaling": ("float32", 0.125),
}


def test_creator_is_registered_with_its_fields(trt) -> None:
    registry = trt.module.get_plugin_registry()
    creator = registry.get_creator(NAME, "1", NAMESPACE)
    assert creator is not None and (creator.plugin_version, creator.plugin_namespace) == ("1", NAMESPACE)
    i32, f32 = trt.module.PluginFieldType.INT32, trt.module.PluginFieldType.FLOAT32
    assert [(f.name, f.type, f.size) for f in creator.field_names] == [(n, i32, 1) for n in FIELDS[:3]] + [
        (n, f32, 1) for n in FIELDS[3:]
    ]
    assert registry.get_creator(NAME, "1", "") is None


@pytest.mark.parametrize(
    "change,message",
    [
        ({"compress_ratio": ("int32", 0)}, "field 'compress_ratio' = 0 is outside [1, 16384]"),
        ({"block_topk": ("int64", 2**32 + 2)}, "field 'block_topk' = 4294967298 is outside [1, 16384]"),
        ({"compress_ratio": ("int32", 64), "block_topk": ("int32", 256)}, "(block_topk + 1) * compress_ratio <= 16384"),
        ({"rot_dim": ("int32", 7)}, "rot_dim must be even"),
        ({"rope_theta": ("float32", 0.0)}, "rope_theta must be finite and > 0"),
        ({"scaling": ("float32", float("nan"))}, "scaling must be finite and > 0"),
        ({"eps": ("int32", 0)}, "field 'eps' must be a float"),
        ({"scaling": None}, "missing field 'scaling'"),
        ({"num_heads": ("int32", 8)}, "unknown field(s) num_heads for plugin EngramQsaAttention"),
    ],
)
def test_creator_refuses_bad_fields_in_one_line(trt, capfd, change, message) -> None:
    fields = {**VALID, **{k: v for k, v in change.items() if v is not None}}
    for name in [k for k, v in change.items() if v is None]:
        del fields[name]
    capfd.readouterr()
    assert _create(trt, fields) is None
    lines = [line for line in capfd.readouterr().err.splitlines() if message in line]
    assert lines and lines[0].count(NAME) >= 1, lines


def test_creator_accepts_the_edge_of_each_range(trt) -> None:
    assert _create(trt, VALID) is not None
    for edge in (
        {"compress_ratio": ("int32", 1)},
        {"rot_dim": ("int32", 0)},
        {"eps": ("float32", 0.0)},
        {"compress_ratio": ("int32", 64), "block_topk": ("int32", 255)},
        {"compress_ratio": ("int32", 1), "block_topk": ("int64", 16383)},
    ):
        assert _create(trt, {**VALID, **edge}) is not None, edge


def _qsa_graph(path: Path, io: str, H: int, kvh: int, hd: int, ni: int, di: int, attributes: dict) -> None:
    """The op's eleven inputs -> EngramQsaAttention -> out [T, H*hd] and the three caches."""
    import onnx
    from onnx import TensorProto, helper

    elem = {"bf16": TensorProto.BFLOAT16, "fp16": TensorProto.FLOAT16, "fp32": TensorProto.FLOAT}[io]
    kv_cache, ix_cache = ["slots", kvh, "max_len", hd], ["slots", "max_len", di]
    names = [
        "q",
        "k",
        "v",
        "index_q",
        "index_raw",
        "key_cache",
        "value_cache",
        "index_key_cache",
        "index_k_norm_weight",
        "token_slot",
        "token_pos",
    ]
    node = helper.make_node(
        NAME,
        names,
        ["out", "key_cache_out", "value_cache_out", "index_key_cache_out"],
        name="qsa",
        domain=NAMESPACE,
        **attributes,
    )
    shapes = [["T", H, hd], ["T", kvh, hd], ["T", kvh, hd], ["T", ni, di], ["T", di], kv_cache, kv_cache, ix_cache]
    inputs = [helper.make_tensor_value_info(n, elem, s) for n, s in zip(names, shapes)]
    inputs += [
        helper.make_tensor_value_info("index_k_norm_weight", TensorProto.FLOAT, [di]),
        helper.make_tensor_value_info("token_slot", TensorProto.INT32, ["T"]),
        helper.make_tensor_value_info("token_pos", TensorProto.INT32, ["T"]),
    ]
    outputs = [
        helper.make_tensor_value_info("out", elem, ["T", H * hd]),
        helper.make_tensor_value_info("key_cache_out", elem, kv_cache),
        helper.make_tensor_value_info("value_cache_out", elem, kv_cache),
        helper.make_tensor_value_info("index_key_cache_out", elem, ix_cache),
    ]
    graph = helper.make_graph([node], "qsa", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(NAMESPACE, 1)])
    onnx.save(model, str(path))


@pytest.mark.parametrize("io", ["bf16", "fp32"])
def test_qsa_graph_builds_an_engine_only_with_aliased_caches(trt, tmp_path: Path, io: str) -> None:
    """One node with the Qwen4Exp export's attributes: the parser hands them to the
    creator, the outputs are [T, H*hd] and the caches' shapes in q's type; with the
    aliasing preview feature the engine builds, without it the builder refuses."""
    from engram_trt.models.export import PLUGIN_NAMESPACE, PLUGIN_VERSION

    path = tmp_path / "qsa.onnx"
    H, kvh, hd, ni, di, slots, max_len = 8, 2, 64, 4, 32, 4, 256
    attributes = {
        "plugin_version": PLUGIN_VERSION,
        "plugin_namespace": PLUGIN_NAMESPACE,
        "compress_ratio": 16,
        "block_topk": 4,
        "rot_dim": 16,
        "rope_theta": 1e7,
        "eps": 1e-6,
        "scaling": hd**-0.5,
    }
    _qsa_graph(path, io, H, kvh, hd, ni, di, attributes)
    want = {"bf16": trt.module.bfloat16, "fp32": trt.module.float32}[io]
    engines = {}
    for aliased in (True, False):
        builder, network, layer = parse_plugin_graph(trt, path)
        layer.__class__ = trt.module.IPluginV3Layer
        core = layer.plugin.get_capability_interface(trt.module.PluginCapabilityType.CORE)
        assert (core.plugin_name, core.plugin_namespace, core.plugin_version) == (NAME, NAMESPACE, "1")
        assert [layer.get_output(k).dtype for k in range(4)] == [want] * 4
        assert tuple(layer.get_output(0).shape) == (-1, H * hd)
        assert tuple(layer.get_output(3).shape) == (-1, -1, di)
        config = plugin_builder_config(trt, builder, aliased)
        profile = builder.create_optimization_profile()
        for name, shape in (
            ("q", (H, hd)),
            ("k", (kvh, hd)),
            ("v", (kvh, hd)),
            ("index_q", (ni, di)),
            ("index_raw", (di,)),
        ):
            profile.set_shape(name, (1, *shape), (16, *shape), (64, *shape))
        for name in ("token_slot", "token_pos"):
            profile.set_shape(name, (1,), (16,), (64,))
        for name in ("key_cache", "value_cache"):
            profile.set_shape(name, *[(slots, kvh, max_len, hd)] * 3)
        profile.set_shape("index_key_cache", *[(slots, max_len, di)] * 3)
        config.add_optimization_profile(profile)
        try:
            engines[aliased] = builder.build_serialized_network(network, config)
        except Exception:  # noqa: BLE001 - a flavour may raise instead of returning None
            engines[aliased] = None
    assert engines[True] is not None and engines[True].nbytes > 5_000
    assert engines[False] is None
