"""EngramRoutedExperts (plugins/engramRoutedExpertsPlugin) through the plugin harness.

- check_plugin_cpu: what TensorRT asks of the plugin before any enqueue (output shapes and
  types, the serialized fields, a round trip, refused fields and input types), no GPU
  needed; shared with tests/plugins/test_routed_experts_plugin.py.
- the enqueue (the build-phase plugin and its round trip) against
  ``engram_trt.native.quant.experts`` on the same inputs: the same kernels in the same
  order but the combine's float32 sum over a token's picks (the plugin adds them in pick
  order, torch's ``sum(dim=1)`` in its own). With one or two picks a token that sum is
  order-free, so the outputs are equal bit for bit; with six, within (k - 1) u32 times the
  sum of the picks' magnitudes (each pick's product taken from the plugin run with that
  pick alone, float32), plus the output's rounding. FP4 (ue8m0) and FP8 (float32 and ue8m0
  scales) experts, a decode step (the grouped GEMV) and a prefill (the grouped GEMMs),
  bf16 and float32 activations, int32 and int64 ids, an id outside [0, E) (adds nothing),
  one expert (E = 1), the clamp on and off.
"""

from __future__ import annotations

import numpy as np
import pytest

from .helpers import DT, PF_FLOAT32, PF_INT32

NAME = "EngramRoutedExperts"
DT_INT8, DT_UINT8 = 2, 5  # nvinfer1::DataType kINT8, kUINT8
U32 = 2.0**-24
FIELD_NAMES = [
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


def routed_fields(
    E: int, k: int, D: int, I: int, w_type: int, scale_type: int, block: tuple[int, int], limit: float
) -> list[tuple[str, int, np.ndarray]]:
    ints = dict(
        num_experts=E,
        top_k=k,
        hidden=D,
        intermediate=I,
        w_type=w_type,
        scale_type=scale_type,
        block_n=block[0],
        block_k=block[1],
    )
    return [(n, PF_INT32, np.array([v], np.int32)) for n, v in ints.items()] + [
        ("swiglu_limit", PF_FLOAT32, np.array([limit], np.float32))
    ]


def shapes_of(T: int, k: int, E: int, D: int, I: int, fp4: bool, block: tuple[int, int]) -> list[tuple]:
    div = 2 if fp4 else 1
    bn, bk = block
    cd = lambda a, b: -(-a // b)  # noqa: E731
    return [
        (T, D),
        (T, k),
        (T, k),
        (E, I, D // div),
        (E, cd(I, bn), cd(D, bk)),
        (E, I, D // div),
        (E, cd(I, bn), cd(D, bk)),
        (E, D, I // div),
        (E, cd(D, bn), cd(I, bk)),
    ]


def types_of(io: int, scale: int, ids: int = DT["int32"]) -> list[int]:
    return [io, ids, DT["float32"], DT_INT8, scale, DT_INT8, scale, DT_INT8, scale]


PLUGIN_CPU_CHECKS = [
    "plugin EngramRoutedExperts getOutputShapes: x's [T, hidden]",
    "plugin EngramRoutedExperts getOutputDataTypes: x's type",
    "plugin EngramRoutedExperts serializes its nine fields in order",
    "plugin EngramRoutedExperts serialize round trip",
    "plugin EngramRoutedExperts refuses input types by name",
    "plugin EngramRoutedExperts fp8 with float32 scales takes float32 scale inputs",
    "plugin EngramRoutedExperts refuses bad fields in one line",
]


def check_plugin_cpu(harness) -> dict[str, tuple[bool, str]]:
    """What TensorRT asks of EngramRoutedExperts before any enqueue (no GPU needed): each
    check of PLUGIN_CPU_CHECKS by name, (ok, detail)."""
    checks: dict[str, tuple[bool, str]] = {}
    E, k, D, I = 8, 6, 256, 96
    fp4 = routed_fields(E, k, D, I, 1, 1, (1, 32), 7.0)
    h = harness.create(NAME, fp4)
    shapes = harness.outputs_shapes(h, shapes_of(5, k, E, D, I, True, (1, 32)), 1)
    checks["plugin EngramRoutedExperts getOutputShapes: x's [T, hidden]"] = (shapes == [(5, D)], str(shapes))
    types = {
        io: harness.outputs_types(h, types_of(DT[io], DT_INT8), 1) == [DT[io]]
        for io in ("bfloat16", "float16", "float32")
    }
    types["int64 ids"] = harness.outputs_types(h, types_of(DT["bfloat16"], DT_INT8, DT["int64"]), 1) == [DT["bfloat16"]]
    checks["plugin EngramRoutedExperts getOutputDataTypes: x's type"] = (all(types.values()), str(types))
    written = harness.serialized_fields(h)
    checks["plugin EngramRoutedExperts serializes its nine fields in order"] = (
        [(f[0], f[1]) for f in written] == [(n, PF_FLOAT32 if n == "swiglu_limit" else PF_INT32) for n in FIELD_NAMES]
        and [int(np.frombuffer(f[3], np.int32)[0]) for f in written[:8]] == [E, k, D, I, 1, 1, 1, 32]
        and float(np.frombuffer(written[8][3], np.float32)[0]) == 7.0,
        str(written),
    )
    h2 = harness.roundtrip(h)
    checks["plugin EngramRoutedExperts serialize round trip"] = (
        harness.outputs_shapes(h2, shapes_of(5, k, E, D, I, True, (1, 32)), 1) == shapes
        and harness.serialized_fields(h2) == written,
        "",
    )
    harness.lib.harness_destroy(h2)
    refused = {}
    for tag, types, needle in (
        ("float32 scales for ue8m0", types_of(DT["bfloat16"], DT["float32"]), "gate_scale must be int8 or uint8"),
        (
            "int32 weights",
            [
                DT["bfloat16"],
                DT["int32"],
                DT["float32"],
                DT["int32"],
                DT_INT8,
                DT["int32"],
                DT_INT8,
                DT["int32"],
                DT_INT8,
            ],
            "gate_w must be int8 or uint8 bytes",
        ),
        (
            "up_w of another type",
            [DT["bfloat16"], DT["int32"], DT["float32"], DT_INT8, DT_INT8, DT_UINT8, DT_INT8, DT_INT8, DT_INT8],
            "up_w must be int8 or uint8 bytes (the stored weight), as gate_w",
        ),
        ("bf16 route_w", [DT["bfloat16"], DT["int32"], DT["bfloat16"]] + [DT_INT8] * 6, "route_w must be float32"),
    ):
        try:
            harness.outputs_types(h, types, 1)
            refused[tag] = "accepted"
        except RuntimeError as exc:
            refused[tag] = needle in str(exc) or str(exc)
    checks["plugin EngramRoutedExperts refuses input types by name"] = (
        all(v is True for v in refused.values()),
        str(refused),
    )
    harness.lib.harness_destroy(h)
    fp8 = routed_fields(E, k, D, I, 0, 0, (128, 128), 0.0)
    h = harness.create(NAME, fp8)
    ok = harness.outputs_types(h, types_of(DT["float32"], DT["float32"]), 1) == [DT["float32"]]
    checks["plugin EngramRoutedExperts fp8 with float32 scales takes float32 scale inputs"] = (ok, "")
    harness.lib.harness_destroy(h)

    def without(name: str) -> list:
        return [f for f in fp4 if f[0] != name]

    def with_value(name: str, value) -> list:
        return [(n, t, np.array([value], a.dtype)) if n == name else (n, t, a) for n, t, a in fp4]

    refusals = {}
    for tag, fields, needle in (
        ("w_type 2", with_value("w_type", 2), "field 'w_type' = 2 is outside [0, 1]"),
        ("fp4 with float32 scales", with_value("scale_type", 0), "scale_type must be 1 (ue8m0) for fp4 weights"),
        ("fp4 hidden 240", with_value("hidden", 240), "hidden 240 and intermediate 96 must be multiples of 32"),
        ("fp4 block_k 48", with_value("block_k", 48), "block_k 48 must be a multiple of 32"),
        (
            "fp8 intermediate 40",
            routed_fields(E, k, D, 40, 0, 0, (128, 128), 0.0),
            "hidden 256 and intermediate 40 must be multiples of 16",
        ),
        ("num_experts 5000", with_value("num_experts", 5000), "field 'num_experts' = 5000 is outside [1, 4096]"),
        ("negative limit", with_value("swiglu_limit", -1.0), "swiglu_limit -1 must be a finite number >= 0"),
        ("missing top_k", without("top_k"), "missing field 'top_k'"),
        ("unknown field", fp4 + [("experts", PF_INT32, np.array([4], np.int32))], "unknown field(s) experts"),
    ):
        try:
            harness.lib.harness_destroy(harness.create(NAME, fields))
            refusals[tag] = "accepted"
        except RuntimeError as exc:
            refusals[tag] = (needle in str(exc) and "\n" not in str(exc)) or str(exc)
    checks["plugin EngramRoutedExperts refuses bad fields in one line"] = (
        all(v is True for v in refusals.values()),
        str(refusals),
    )
    return checks


@pytest.fixture(scope="module")
def plugin_cpu(harness) -> dict[str, tuple[bool, str]]:
    return check_plugin_cpu(harness)


@pytest.mark.parametrize("name", PLUGIN_CPU_CHECKS)
def test_plugin_cpu(plugin_cpu, name: str) -> None:
    ok, detail = plugin_cpu[name]
    assert ok, f"{name}: {detail}"


# --- the enqueue against native.quant.experts --------------------------------------------------


def _stack(gen, kind: str, E: int, N: int, K: int, fmt: str, dev):
    """Random experts [E, N, K] quantized by the formats' own quantizers."""
    import torch

    from engram_trt.quant import formats
    from engram_trt.quant.weight import QuantWeight

    w = torch.randn(E, N, K, generator=gen, device=gen.device) * torch.exp(
        0.5 * torch.randn(E, N, 1, generator=gen, device=gen.device)
    )
    if kind == "fp4":
        q, s = formats.quantize_fp4(w, 32)
        return QuantWeight(q.to(dev), s.to(dev), "fp4", (1, 32))
    q, s = formats.quantize_fp8(w, (128, 128), fmt)
    return QuantWeight(q.to(dev), s.to(dev), "fp8", (128, 128))


def _plugin_inputs(x, ids, route_w, stacks):
    import torch

    out = [x, ids, route_w]
    for w in stacks:
        out.append(w.data.view(torch.int8))
        out.append(w.scale if w.scale.dtype == torch.float32 else w.scale.view(torch.int8))
    return out


# (kind, scale fmt, T, k, E, D, I, io, ids dtype, limit)
CASES = [
    ("fp4", "ue8m0", 3, 2, 8, 256, 128, "bfloat16", "int32", 7.0),  # decode: grouped GEMV
    ("fp4", "ue8m0", 40, 2, 8, 256, 128, "bfloat16", "int64", 7.0),  # prefill: grouped GEMM
    ("fp4", "ue8m0", 5, 1, 1, 128, 64, "float32", "int32", 0.0),  # one expert
    ("fp8", "float", 4, 2, 6, 256, 192, "bfloat16", "int64", 0.0),  # FP8 GEMV
    ("fp8", "ue8m0", 33, 2, 6, 384, 256, "float32", "int32", 5.0),  # FP8 tensor-core GEMM
    ("fp4", "ue8m0", 7, 6, 16, 256, 128, "float32", "int32", 7.0),  # six picks: order-dependent sums
    ("fp8", "float", 24, 6, 16, 256, 128, "bfloat16", "int64", 0.0),
]


@pytest.mark.parametrize("phase", ["build", "runtime (round trip)"])
@pytest.mark.parametrize("ci", range(len(CASES)))
def test_plugin_enqueue_equals_native_experts(harness, gen, dev, ci, phase) -> None:
    import torch

    from engram_trt.native import quant as nq

    kind, fmt, T, k, E, D, I, io, ids_dtype, limit = CASES[ci]
    if kind == "fp8" and T > nq.EXPERTS_GEMV_MAX_TOKENS and torch.cuda.get_device_capability(dev) < (8, 9):
        pytest.skip("the FP8 tensor cores need compute capability 8.9+")
    dtype = getattr(torch, io)
    gate, up = _stack(gen, kind, E, I, D, fmt, dev), _stack(gen, kind, E, I, D, fmt, dev)
    down = _stack(gen, kind, E, D, I, fmt, dev)
    x = torch.randn(T, D, generator=gen, device=dev).to(dtype)
    rng = np.random.default_rng(ci)
    picks = np.stack([rng.choice(E, size=k, replace=E < k) for _ in range(T)])
    if T > 2:
        picks[1, 0] = E if ci % 2 else -1  # an id outside [0, E): adds nothing
    ids = torch.from_numpy(picks).to(dev, getattr(torch, ids_dtype))
    route_w = torch.rand(T, k, generator=gen, device=dev) + 0.1
    want = nq.experts(x, ids, route_w, gate, up, down, limit=limit)
    block = gate.block
    scale_type = 0 if gate.scale.dtype == torch.float32 else 1
    fields = routed_fields(E, k, D, I, 1 if kind == "fp4" else 0, scale_type, block, limit)
    scale_dt = DT["float32"] if scale_type == 0 else DT_INT8
    in_types = types_of(DT[io], scale_dt, DT[ids_dtype])
    stream = torch.cuda.current_stream().cuda_stream
    tag = f"{kind}/{fmt} T {T} k {k} E {E} D {D} I {I} {io} ids {ids_dtype} limit {limit}"

    def run(h, ids_, w_):
        out = torch.full((T, D), float("nan"), dtype=dtype, device=dev)
        harness.run(h, _plugin_inputs(x, ids_, w_, (gate, up, down)), in_types, out, DT[io], stream)
        torch.cuda.synchronize()
        return out

    make = {"build": lambda h: h, "runtime (round trip)": harness.roundtrip}[phase]
    base = harness.create(NAME, fields)
    h = make(base)
    got = run(h, ids, route_w)
    if h != base:
        harness.lib.harness_destroy(h)
    harness.lib.harness_destroy(base)
    if k <= 2:  # one or two float32 products a token: the combine's sum is order-free
        same = bool(torch.equal(got, want))
        diff = float((got.double() - want.double()).abs().max())
        assert same, (
            f"plugin EngramRoutedExperts enqueue {phase} = native experts bit for bit, {tag}: max |diff| {diff:.3g}"
        )
    else:
        single = []
        for j in range(k):  # each pick's float32 product, alone
            hj = harness.create(NAME, routed_fields(E, 1, D, I, 1 if kind == "fp4" else 0, scale_type, block, limit))
            xj = run(hj, ids[:, j : j + 1].contiguous(), route_w[:, j : j + 1].contiguous())
            single.append(xj.double().abs())
            harness.lib.harness_destroy(hj)
        total = torch.stack(single).sum(0)
        u_out = {"float32": 0.0, "bfloat16": 2.0**-8}[io]
        bound = (k - 1) * U32 * total * 1.01 + u_out * want.double().abs() + 1e-30
        err = (got.double() - want.double()).abs()
        ok = bool(torch.isfinite(got).all()) and bool((err <= bound).all())
        assert ok, (
            f"plugin EngramRoutedExperts enqueue {phase} = native experts up to the combine's order, "
            f"{tag}: max |diff| {float(err.max()):.3g}, worst diff/bound {float((err / bound).max()):.3f}"
        )
