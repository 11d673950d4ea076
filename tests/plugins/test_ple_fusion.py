"""Qwen4-Exp's PLE fusion kernel and its EngramPleFusion plugin on a machine without a GPU.

- the C ABI's shape checks and workspace size, and the ctypes binding's argument checks,
  run without a GPU and name the bad argument;
- PLEFusion chooses its path: the PyTorch one on the CPU (``auto``), an error naming why
  for ``kernels``;
- with TensorRT-RTX: the creator is registered with its fields, refuses bad ones and
  accepts the edges of each range;
- through the plugin harness: the serialized fields are pinned (declared types whatever
  the input's), the round trip keeps them, output shapes / types, the aliased history
  (tests/gpu/test_ple_fusion.check_plugin_cpu, shared with the GPU suite).
The kernel itself runs on the H200 in tests/gpu/test_ple_fusion.py.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engram_trt.errors import EngramError
from engram_trt.native import ple

from helpers.plugins import create_plugin, harness_path, harness_scripts, serialized_twice

NAMESPACE = "engram_trt"
FIELDS = ["hc_count", "hidden", "kernel", "dilation", "eps"]
HARNESS = harness_path()


def test_abi_shape_checks_and_workspace_run_without_gpu(plugin_lib: Path) -> None:
    ple.check_shape(4, 2048, 4, 3, 1e-6)
    ple.check_shape(1, 8, 1, 1, 0.0)
    ple.check_shape(1, 8, ple.MAX_KERNEL, ple.MAX_DILATION, 1e-6)
    for args, needle in (
        ((2, 60, 4, 3, 1e-6), "hidden a positive multiple of 8 (got 2, 60)"),
        ((0, 64, 4, 3, 1e-6), "hc_count >= 1"),
        ((2, 64, 0, 3, 1e-6), "kernel must be in [1, 32] and dilation in [1, 256] (got 0, 3)"),
        ((2, 64, 33, 3, 1e-6), "(got 33, 3)"),
        ((2, 64, 4, 257, 1e-6), "(got 4, 257)"),
        ((2, 64, 4, 3, -1e-6), "eps must be finite and >= 0"),
        ((2, 64, 4, 3, float("inf")), "eps must be finite and >= 0"),
        ((65536, 32768, 4, 3, 1e-6), "hc_count * hidden = 2147483648 exceeds 2^31 - 1"),
    ):
        with pytest.raises(EngramError, match="engram_ple_fusion") as exc:
            ple.check_shape(*args)
        assert needle in str(exc.value) and "\n" not in str(exc.value), (args, str(exc.value))
    # normed [T, W] in the activation dtype, 16-byte aligned, then one fp32 gate per (token, stream)
    assert ple.workspace_size(10, 2, 64, torch.bfloat16) == 10 * 128 * 2 + 80
    assert ple.workspace_size(3, 3, 8, torch.float32) == 3 * 24 * 4 + 48  # 36 gate bytes padded to 48
    assert ple.workspace_size(0, 4, 2048, torch.float16) == 0


def _inputs(T=5, hc=2, D=16, K=4, n=3, S=2, slots=3, io=torch.bfloat16, wt=torch.float32):
    W, H = hc * D, (K - 1) * n
    return dict(
        streams=torch.zeros(T, W, dtype=io),
        key=torch.zeros(T, W, dtype=io),
        value=torch.zeros(T, D, dtype=io),
        norm_key_weight=torch.zeros(W, dtype=wt),
        norm_query_weight=torch.zeros(W, dtype=wt),
        norm_conv_weight=torch.zeros(W, dtype=wt),
        conv_weight=torch.zeros(W, 1, K, dtype=wt),
        conv_state=torch.zeros(slots, W, H, dtype=io),
        seq_starts=torch.tensor([0, 2, T], dtype=torch.int32),
        past_lens=torch.zeros(S, dtype=torch.int32),
        slots=torch.arange(S, dtype=torch.int32),
    )


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"key": torch.zeros(5, 32, dtype=torch.float16)}, "key must have dtype torch.bfloat16"),
        ({"streams": torch.zeros(5, 32, dtype=torch.int32)}, "streams must have dtype"),
        ({"conv_state": torch.zeros(3, 32, 9, dtype=torch.float32)}, "conv_state must have dtype torch.bfloat16"),
        ({"norm_conv_weight": torch.zeros(32, dtype=torch.bfloat16)}, "norm_conv_weight must have dtype torch.float32"),
        ({"slots": torch.zeros(2, dtype=torch.int64)}, "slots must have dtype torch.int32"),
        ({"value": torch.zeros(5, 32, dtype=torch.bfloat16)}, "value must be [T, hidden] = (5, 16)"),
        ({"key": torch.zeros(4, 32, dtype=torch.bfloat16)}, "key must be [T, W] = (5, 32)"),
        ({"norm_key_weight": torch.zeros(16, dtype=torch.float32)}, "norm_key_weight must be [W] = (32,)"),
        ({"conv_weight": torch.zeros(32, 2, 4, dtype=torch.float32)}, "conv_weight must be [W, K] or [W, 1, K]"),
        (
            {"conv_state": torch.zeros(3, 32, 8, dtype=torch.bfloat16)},
            "conv_state must be [num_slots, W, (K-1)*dilation]",
        ),
        ({"seq_starts": torch.tensor([0, 5], dtype=torch.int32)}, "seq_starts must be [S+1] and slots [S]"),
        ({"streams": torch.zeros(5, 32, dtype=torch.bfloat16).t().contiguous().t()}, "streams must be contiguous"),
        ({}, "streams must be a CUDA tensor"),
    ],
)
def test_binding_names_the_bad_argument(plugin_lib: Path, change, needle) -> None:
    args = {**_inputs(), **change}
    with pytest.raises(EngramError) as exc:
        ple.ple_fusion(**args, hc_count=2, dilation=3, eps=1e-6)
    assert needle in str(exc.value) and "\n" not in str(exc.value), str(exc.value)


def test_binding_refuses_a_width_hc_count_does_not_divide(plugin_lib: Path) -> None:
    with pytest.raises(EngramError, match="hc_count=3 must divide streams' width 32"):
        ple.ple_fusion(**_inputs(), hc_count=3, dilation=3, eps=1e-6)


def _module(seed: int = 0):
    from engram_trt.models.qwen4_exp.modules import PLEFusion

    cfg = SimpleNamespace(
        hc_count=2,
        hidden_size=16,
        rms_norm_eps=1e-6,
        ple=SimpleNamespace(ngram_size=3, conv_kernel_size=4, embed_dim=8),
    )
    m = PLEFusion(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.4)
    return m


def test_plefusion_takes_the_torch_path_on_the_cpu() -> None:
    m = _module()
    x, rows = torch.randn(6, 32), torch.randn(6, 8)
    state_a, state_b = torch.randn(3, 32, 9), None
    state_b = state_a.clone()
    with torch.no_grad():
        got = m(x, rows, [0, 4, 6], [2, 0], [1, 2], state_a)
        want = m.forward_torch(x, rows, [0, 4, 6], [2, 0], [1, 2], state_b)
    assert torch.equal(got, want) and torch.equal(state_a, state_b)
    assert not torch.equal(state_a[1], torch.zeros(32, 9))  # the step wrote the history


def test_plefusion_backend_kernels_says_why_it_cannot_run() -> None:
    m = _module()
    m.backend = "kernels"
    with pytest.raises(EngramError) as exc:
        m(torch.randn(2, 32), torch.randn(2, 8), [0, 2], [0], [0], torch.zeros(1, 32, 9))
    msg = str(exc.value)
    assert "PLEFusion backend 'kernels' cannot run: the activations are on cpu" in msg and "\n" not in msg
    m.backend = "cuda"
    with pytest.raises(EngramError, match=r"PLEFusion.backend 'cuda' is not one of \['auto', 'kernels', 'torch'\]"):
        m(torch.randn(2, 32), torch.randn(2, 8), [0, 2], [0], [0], torch.zeros(1, 32, 9))


# --- TensorRT-RTX: the creator ------------------------------------------------------------

# (the trt fixture: tests/conftest.py)


def _create(trt, fields: dict[str, tuple[str, object]]):
    return create_plugin(trt, "EngramPleFusion", fields)


VALID = {
    "hc_count": ("int32", 4),
    "hidden": ("int32", 2048),
    "kernel": ("int32", 4),
    "dilation": ("int32", 3),
    "eps": ("float32", 1e-6),
}


def test_creator_is_registered_with_its_fields(trt) -> None:
    registry = trt.module.get_plugin_registry()
    creator = registry.get_creator("EngramPleFusion", "1", NAMESPACE)
    assert creator is not None and (creator.plugin_version, creator.plugin_namespace) == ("1", NAMESPACE)
    i32, f32 = trt.module.PluginFieldType.INT32, trt.module.PluginFieldType.FLOAT32
    assert [(f.name, f.type, f.size) for f in creator.field_names] == [(n, i32, 1) for n in FIELDS[:4]] + [
        ("eps", f32, 1)
    ]
    assert registry.get_creator("EngramPleFusion", "1", "") is None


@pytest.mark.parametrize(
    "change,message",
    [
        ({"hidden": ("int32", 100)}, "hidden a positive multiple of 8 (got 4, 100)"),
        ({"hidden": ("int32", 0)}, "field 'hidden' = 0 is outside [8, 2147483647]"),
        ({"kernel": ("int32", 33)}, "field 'kernel' = 33 is outside [1, 32]"),
        ({"kernel": ("int64", 2**32 + 4)}, "field 'kernel' = 4294967300 is outside [1, 32]"),
        ({"dilation": ("int32", 0)}, "field 'dilation' = 0 is outside [1, 256]"),
        ({"hc_count": ("int64", 2**32 + 4)}, "field 'hc_count' = 4294967300 is outside"),
        ({"hc_count": ("int32", 65536), "hidden": ("int32", 32768)}, "hc_count * hidden = 2147483648 exceeds 2^31 - 1"),
        ({"eps": ("float32", -1.0)}, "eps must be finite and >= 0"),
        ({"eps": ("int32", 0)}, "field 'eps' must be a float"),
        ({"eps": None}, "missing field 'eps'"),
        ({"bias": ("int32", 1)}, "unknown field(s) bias for plugin EngramPleFusion"),
    ],
)
def test_creator_refuses_bad_fields(trt, capfd, change, message) -> None:
    fields = {**VALID, **{k: v for k, v in change.items() if v is not None}}
    for name in [k for k, v in change.items() if v is None]:
        del fields[name]
    capfd.readouterr()
    assert _create(trt, fields) is None
    assert message in capfd.readouterr().err


def test_creator_accepts_the_edge_of_each_range(trt) -> None:
    assert _create(trt, VALID) is not None
    for edge in (
        {"kernel": ("int32", 1)},
        {"kernel": ("int64", 32)},
        {"dilation": ("int32", 256)},
        {"hidden": ("int32", 8), "hc_count": ("int32", 1)},
        {"eps": ("float32", 0.0)},
        {"hc_count": ("int32", 65535), "hidden": ("int32", 32768)},
    ):  # W = 2^31 - 32768
        assert _create(trt, {**VALID, **edge}) is not None, edge


# --- the plugin harness ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def harness():
    (helpers, check) = harness_scripts(HARNESS, "helpers", "test_ple_fusion")
    return helpers, check, check.Harness(HARNESS)


def test_serialized_fields_are_pinned(harness) -> None:
    """Whatever widths the fields came in, the engine stores them as declared, in order."""
    helpers, _, h = harness
    PF_FLOAT64, PF_INT16, PF_INT64 = 2, 4, 10
    given = [
        ("eps", PF_FLOAT64, np.array([1e-5], np.float64)),
        ("dilation", PF_INT16, np.array([3], np.int16)),
        ("kernel", PF_INT64, np.array([4], np.int64)),
        ("hidden", helpers.PF_INT32, np.array([64], np.int32)),
        ("hc_count", PF_INT64, np.array([2], np.int64)),
    ]
    first, again = serialized_twice(h, "EngramPleFusion", given)
    i32 = helpers.PF_INT32
    want = [
        ("hc_count", i32, 1, np.int32(2).tobytes()),
        ("hidden", i32, 1, np.int32(64).tobytes()),
        ("kernel", i32, 1, np.int32(4).tobytes()),
        ("dilation", i32, 1, np.int32(3).tobytes()),
        ("eps", helpers.PF_FLOAT32, 1, np.float32(1e-5).tobytes()),
    ]
    assert first == want and again == want


def test_plugin_through_the_harness(harness) -> None:
    """Output shapes and types, refused type mixes, getAliasedInput (the history output is
    conv_state's memory, build capability v2), the round trip, refused fields."""
    _helpers, check, h = harness
    results = check.check_plugin_cpu(h)
    assert list(results) == check.PLUGIN_CPU_CHECKS and len(results) == 6
    assert not results.failed(), results.failed()
