"""The stored-format kernels (plugins/kernels/quantKernels.h) on a machine without a GPU:

- the ctypes declarations (native/quant_kernels.py) are the header's prototypes, and the
  Python constants its enums and limits; the activation groups native/quant.py uses are
  quant/weight.py's ACT_QUANT;
- the C ABI refuses bad arguments before any CUDA call, one line naming the argument;
- the Python layer (native/quant.py, native/quant_kernels.py) refuses in one line and says
  why the kernels cannot take a call, and routes rows to the GEMV or the GEMM as documented;
- the float references the GPU tests hold the kernels to (quant/formats.py) against
  independent decodings: ml_dtypes for every e4m3 / e2m1 / e8m0 code, hand-written float64
  loops for block dequantization with partial blocks, and a NumPy / ml_dtypes re-statement of
  the activation quantization (float32 steps as the header states them).
The kernels themselves run in tests/gpu/test_quant_kernels.py.
"""

from __future__ import annotations

import ctypes
import math
import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

from engram_trt.errors import EngramError
from engram_trt.native import quant as nq
from engram_trt.native import quant_kernels as qk
from engram_trt.quant import formats
from engram_trt.quant.weight import ACT_QUANT, QuantWeight, quant_linear

from helpers.files import REPO

HEADER = REPO / "plugins" / "kernels" / "quantKernels.h"


def _one_line(exc: pytest.ExceptionInfo | str, needle: str) -> None:
    msg = exc if isinstance(exc, str) else str(exc.value)
    assert needle in msg and "\n" not in msg, msg


# --- the ABI as declared ------------------------------------------------------------------


def _prototypes() -> dict[str, list[str]]:
    text = re.sub(r"/\*.*?\*/", "", HEADER.read_text(), flags=re.S)
    protos = {}
    for name, args in re.findall(r"ENGRAM_API\s+int\s+(engram_\w+)\s*\(([^)]*)\)\s*;", text):
        protos[name] = [" ".join(a.split()) for a in args.split(",")]
    return protos


def _ctype_of(arg: str):
    if "*" in arg or arg.startswith("cudaStream_t"):
        return ctypes.c_void_p
    kind = arg.split()[0]
    return {"int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64, "uint32_t": ctypes.c_uint32, "float": ctypes.c_float}[
        kind
    ]


def test_declarations_are_the_header_prototypes() -> None:
    from engram_trt.native import quant_decode as qd

    protos = _prototypes()
    assert len(protos) == 13, sorted(protos)  # the parse found the ABI
    signatures = {**qk.SIGNATURES, **qd.SIGNATURES}
    assert len(signatures) == len(qk.SIGNATURES) + len(qd.SIGNATURES)  # no entry point bound twice
    assert set(protos) == set(signatures)
    for name, args in protos.items():
        assert [_ctype_of(a) for a in args] == signatures[name], name


def test_constants_are_the_headers() -> None:
    text = HEADER.read_text()
    enum = dict(re.findall(r"(ENGRAM_Q(?:WEIGHT|SCALE)_\w+)\s*=\s*(\d+)", text))
    assert (
        int(enum["ENGRAM_QWEIGHT_FP8_E4M3"]),
        int(enum["ENGRAM_QWEIGHT_FP4_E2M1"]),
        int(enum["ENGRAM_QWEIGHT_BF16"]),
    ) == (qk.QWEIGHT_FP8, qk.QWEIGHT_FP4, qk.QWEIGHT_BF16)
    assert (int(enum["ENGRAM_QSCALE_F32"]), int(enum["ENGRAM_QSCALE_UE8M0"])) == (qk.QSCALE_F32, qk.QSCALE_UE8M0)
    assert int(re.search(r"#define ENGRAM_QGEMV_MAX_ROWS (\d+)", text).group(1)) == qk.GEMV_MAX_ROWS
    assert nq.ACT_QUANT == ACT_QUANT  # native/ cannot import quant/: the two tables must agree


# --- the C ABI's refusals (no CUDA call reached) ------------------------------------------


def _refused(fn: str, *args) -> str:
    lib = qk.library()
    status = getattr(lib, fn)(*args)
    assert status == 1, (fn, status)  # cudaErrorInvalidValue
    return lib.engram_last_error().decode()


P16 = ctypes.c_void_p(256)  # an aligned stand-in pointer: the checks never dereference it


def test_act_quant_abi_refusals(plugin_lib: Path) -> None:
    cases = [
        ((P16, 7, 4, 64, 64, 128, 0, P16, None, None, 0, None), "x_type must be an EngramFloatType"),
        ((P16, 1, 4, 64, 64, 0, 0, P16, None, None, 0, None), "group must be >= 1 (got 0)"),
        ((P16, 1, 4, 64, 64, 128, 2, P16, None, None, 0, None), "ue8m0 must be 0 or 1 (got 2)"),
        ((P16, 1, 4, 64, 64, 128, 0, None, None, None, 0, None), "q, scale and deq are all NULL"),
        ((P16, 1, 4, 64, 64, 128, 0, None, None, P16, 9, None), "deq_type must be an EngramFloatType"),
        ((P16, 1, 4, 64, 32, 128, 0, P16, None, None, 0, None), "ldx must be >= cols (got 32 < 64)"),
        ((P16, 1, -1, 64, 64, 128, 0, P16, None, None, 0, None), "0 <= num_rows"),
        ((ctypes.c_void_p(258), 1, 4, 64, 64, 128, 0, P16, None, None, 0, None), "x must be a device pointer aligned"),
    ]
    for args, needle in cases:
        _one_line(_refused("engram_act_quant", *args), needle)
    assert qk.library().engram_act_quant(P16, 1, 0, 64, 64, 128, 0, P16, None, None, 0, None) == 0  # 0 rows: nothing


def test_swiglu_act_quant_abi_refusals(plugin_lib: Path) -> None:
    f = ctypes.c_float
    cases = [
        ((P16, 4, 64, 128, f(0.0), -1, 0, P16, None, None, 0, None), "group must be >= 0"),
        ((P16, 4, 64, 128, f(0.0), 0, 0, P16, None, P16, 1, None), "group 0 (no quantization) writes deq alone"),
        ((P16, 4, 64, 100, f(0.0), 32, 0, P16, None, None, 0, None), "ld must be >= 2 * intermediate = 128 (got 100)"),
        ((P16, 4, 64, 128, f(-1.0), 32, 0, P16, None, None, 0, None), "limit must be finite and >= 0"),
        ((P16, 4, 64, 128, f(float("nan")), 32, 0, P16, None, None, 0, None), "limit must be finite and >= 0"),
    ]
    for args, needle in cases:
        _one_line(_refused("engram_swiglu_act_quant", *args), needle)


def test_moe_plan_abi_refusals(plugin_lib: Path) -> None:
    cases = [
        ((P16, 2, 4, 2, 8, P16, P16, P16, None, P16, 8, None, None), "ids_is_int64 must be 0 or 1 (got 2)"),
        ((P16, 0, 4, 2, 0, P16, P16, P16, None, P16, 8, None, None), "num_experts must be in [1, 4096] (got 0)"),
        ((P16, 0, 4, 2, 4097, P16, P16, P16, None, P16, 8, None, None), "(got 4097)"),
        ((P16, 0, 4, 0, 8, P16, P16, P16, None, P16, 8, None, None), "top_k >= 1"),
        ((P16, 0, 1 << 20, 2, 8, P16, P16, P16, None, P16, 8, None, None), "num_tokens * top_k <= 2^20"),
        ((P16, 0, 4, 2, 8, P16, P16, P16, None, P16, 7, None, None), "num_slots must be in [max(1, min(T * k, E)) = 8"),
        ((P16, 0, 4, 2, 8, None, P16, P16, None, P16, 8, None, None), "must be device pointers"),
        ((ctypes.c_void_p(260), 1, 4, 2, 8, P16, P16, P16, None, P16, 8, None, None), "aligned to their element size"),
    ]
    for args, needle in cases:
        _one_line(_refused("engram_moe_plan", *args), needle)


def _gemv_args(**change):
    args = dict(
        a=P16,
        a_type=1,
        lda=256,
        row_index=None,
        rows=2,
        w=P16,
        w_type=0,
        w_scale=P16,
        scale_type=0,
        bn=128,
        bk=128,
        n=100,
        k=256,
        experts=1,
        offsets=None,
        slot_expert=None,
        slots=1,
        out=P16,
        out_type=1,
        ldo=100,
        o_col0=0,
        stream=None,
    )
    args.update(change)
    return tuple(args.values())


def test_gemv_abi_refusals(plugin_lib: Path) -> None:
    cases = [
        ({"w_type": 3}, "w_type must be 0 (fp8 e4m3), 1 (fp4 e2m1) or 2 (bf16) (got 3)"),
        ({"n": 0}, "out_features and in_features must be in [1, 2^31 - 1] (got 0, 256)"),
        ({"w": ctypes.c_void_p(264)}, "w must be a 16-byte aligned device pointer"),
        ({"w_type": 2}, "a bf16 weight has no scales: pass w_scale NULL"),
        ({"scale_type": 4}, "scale_type must be 0 (float32) or 1 (ue8m0) (got 4)"),
        ({"bn": 0}, "block sizes bn, bk must be >= 1 (got 0, 128)"),
        ({"w_scale": None}, "w_scale must be a device pointer"),
        ({"k": 264, "lda": 264}, "in_features must be a multiple of 16 for fp8 weights"),
        ({"w_type": 1, "k": 272, "lda": 272}, "in_features must be a multiple of 32 for fp4 weights"),
        ({"bk": 24}, "bk must be a multiple of 16 for fp8 weights"),
        ({"w_type": 1, "bk": 48}, "bk must be a multiple of 32 for fp4 weights"),
        ({"a_type": 2}, "a_type must be 1 (float32) or 0 (bf16) (got 2)"),
        ({"lda": 258}, "lda must be >= in_features and a multiple of 4"),
        ({"a_type": 0, "lda": 260}, "a multiple of 8"),
        ({"rows": -1}, "num_rows must be in [0, 2^31 - 1] (got -1)"),
        ({"offsets": P16}, "one weight (num_experts 1) takes offsets NULL"),
        ({"slots": 2}, "one weight (num_experts 1) takes slot_expert NULL and num_slots 1"),
        ({"experts": 4}, "num_experts 4 > 1 needs offsets [E + 1]"),
        ({"experts": 4, "offsets": P16, "slot_expert": None, "slots": 4}, "needs slot_expert [num_slots]"),
        ({"experts": 4, "offsets": P16, "slot_expert": P16, "slots": 70000}, "1 <= num_slots <= 65535 (got 70000)"),
        ({"o_col0": -1}, "o_col0 must be >= 0"),
        ({"ldo": 120, "o_col0": 30}, "ldo must be >= 130, the columns written (got 120)"),
        ({"out_type": 5}, "out_type must be an EngramFloatType"),
        ({"out": None}, "out must be a device pointer"),
        ({"a": ctypes.c_void_p(264)}, "a must be a 16-byte aligned device pointer"),
    ]
    for change, needle in cases:
        _one_line(_refused("engram_quant_gemv", *_gemv_args(**change)), needle)
    assert qk.library().engram_quant_gemv(*_gemv_args(rows=0, a=None)) == 0  # 0 rows launch nothing


def test_gemv_ex_flags(plugin_lib: Path) -> None:
    """engram_quant_gemv_ex: engram_quant_gemv's checks, and its flags: an unknown bit and
    both activation quantizations refused by name; the known flags pass the checks."""
    base = _gemv_args()
    with_flags = lambda flags, **change: _gemv_args(**change)[:-1] + (flags, None)  # noqa: E731
    _one_line(
        _refused("engram_quant_gemv_ex", *with_flags(8)),
        "unknown flags 0x8 (known: ENGRAM_QGEMV_WEIGHT_STATIC 0x1, ENGRAM_QGEMV_ACT_Q128_F32 0x2, "
        "ENGRAM_QGEMV_ACT_Q32_UE8M0 0x4)",
    )
    _one_line(
        _refused("engram_quant_gemv_ex", *with_flags(6)),
        "flags ENGRAM_QGEMV_ACT_Q128_F32 and ENGRAM_QGEMV_ACT_Q32_UE8M0 exclude each other",
    )
    _one_line(_refused("engram_quant_gemv_ex", *with_flags(1, w_type=3)), "w_type must be 0 (fp8 e4m3)")
    for flags in (1, 2, 4, 3, 5):
        assert qk.library().engram_quant_gemv_ex(*with_flags(flags, rows=0, a=None)) == 0  # 0 rows launch nothing
    assert len(base) + 1 == len(qk.SIGNATURES["engram_quant_gemv_ex"])
    assert qk.QGEMV_ACT_QUANT == {(128, False): 2, (32, True): 4}
    text = HEADER.read_text()
    for name, value in (
        ("ENGRAM_QGEMV_WEIGHT_STATIC", qk.QGEMV_WEIGHT_STATIC),
        ("ENGRAM_QGEMV_ACT_Q128_F32", 2),
        ("ENGRAM_QGEMV_ACT_Q32_UE8M0", 4),
    ):
        assert re.search(rf"#define {name} {value}u", text), name


def test_gemv_act_quant_groups_are_native_quants(plugin_lib: Path) -> None:
    """native.quant's ACT_QUANT (what linear / experts quantize with) maps onto the GEMV's
    own quantization flags, so decode steps take the fused launch; others are refused."""
    from engram_trt.native import quant as nq

    for kind, key in nq.ACT_QUANT.items():
        assert key in qk.QGEMV_ACT_QUANT, kind
    with pytest.raises(EngramError, match="the GEMV quantizes per"):
        w = qk.make_weight(
            "w",
            torch.zeros((4, 32), dtype=torch.float8_e4m3fn),
            torch.ones((1, 1), dtype=torch.float32),
            "fp8",
            (128, 128),
            False,
        )
        qk.gemv(torch.zeros((1, 32)), w, torch.zeros((1, 4)), act_quant=(64, False))


def _gemm_args(**change):
    args = dict(
        aq=P16,
        a_scale=P16,
        row_index=None,
        rows=300,
        w=P16,
        w_scale=P16,
        scale_type=1,
        bn=128,
        n=200,
        k=256,
        experts=1,
        offsets=None,
        out=P16,
        out_type=0,
        ldo=200,
        stream=None,
    )
    args.update(change)
    return tuple(args.values())


def test_fp8_gemm_abi_refusals(plugin_lib: Path) -> None:
    cases = [
        ({"k": 200}, "in_features must be a multiple of 16 (got 200)"),
        ({"bn": 0}, "block sizes bn, bk must be >= 1"),
        ({"rows": -2}, "num_rows must be in [0, 2^31 - 257] (got -2)"),
        ({"experts": 0}, "num_experts must be >= 1 (got 0)"),
        ({"experts": 3}, "num_experts 3 > 1 needs offsets"),
        ({"ldo": 100}, "ldo must be >= 200"),
        ({"aq": ctypes.c_void_p(264)}, "aq must be a 16-byte aligned device pointer and a_scale a float32 one"),
        ({"a_scale": None}, "a_scale a float32 one"),
        ({"w_scale": ctypes.c_void_p(258), "scale_type": 0}, "w_scale must be a device pointer (4-byte aligned"),
    ]
    for change, needle in cases:
        _one_line(_refused("engram_fp8_gemm", *_gemm_args(**change)), needle)


def _grouped_args(**change):
    args = dict(
        a=P16,
        lda=256,
        row_index=None,
        rows=300,
        w=P16,
        w_type=1,
        w_scale=P16,
        scale_type=1,
        bn=1,
        bk=32,
        n=200,
        k=256,
        experts=1,
        offsets=None,
        out=P16,
        out_type=0,
        ldo=200,
        stream=None,
    )
    args.update(change)
    return tuple(args.values())


def test_grouped_gemm_abi_refusals(plugin_lib: Path) -> None:
    cases = [
        ({"w_type": 0}, "fp8 weights take engram_fp8_gemm"),
        ({"k": 240, "lda": 240}, "in_features must be a multiple of 32 for fp4 weights (got 240)"),
        ({"w_type": 2, "w_scale": None, "k": 252, "lda": 256}, "in_features must be a multiple of 8 for bf16 weights"),
        ({"bk": 48}, "bk must be a multiple of 32 for fp4 weights (got 48)"),
        ({"lda": 250}, "lda must be >= in_features and a multiple of 8"),
        ({"experts": 2}, "num_experts 2 > 1 needs offsets"),
        ({"a": ctypes.c_void_p(264)}, "a must be a 16-byte aligned device pointer"),
    ]
    for change, needle in cases:
        _one_line(_refused("engram_quant_grouped_gemm", *_grouped_args(**change)), needle)


def test_dequantize_abi_refusals(plugin_lib: Path) -> None:
    base = dict(
        w=P16, w_type=1, w_scale=P16, scale_type=1, bn=1, bk=32, n=4, k=64, experts=1, out=P16, out_type=1, stream=None
    )
    cases = [
        ({"w_type": 5}, "w_type must be 0 (fp8 e4m3), 1 (fp4 e2m1) or 2 (bf16) (got 5)"),
        ({"k": 63}, "an FP4 weight needs an even in_features (got 63)"),
        ({"out_type": 3}, "out_type must be an EngramFloatType"),
        ({"bk": 0}, "block sizes bn, bk must be >= 1"),
        ({"w_scale": None}, "w_scale for fp8 / fp4"),
        ({"experts": 0}, "num_experts >= 1"),
    ]
    for change, needle in cases:
        args = dict(base, **change)
        _one_line(_refused("engram_quant_dequantize", *args.values()), needle)


# --- the Python layer --------------------------------------------------------------------


def _fp8_weight(N=200, K=256, block=(128, 128), fmt="float") -> QuantWeight:
    q, s = formats.quantize_fp8(torch.randn(N, K, generator=torch.Generator().manual_seed(0)), block, fmt)
    return QuantWeight(q, s, "fp8", block)


def _fp4_weight(N=64, K=128, lead=()) -> QuantWeight:
    q, s = formats.quantize_fp4(torch.randn(*lead, N, K, generator=torch.Generator().manual_seed(1)))
    return QuantWeight(q, s, "fp4", (1, 32))


def test_make_weight_names_the_bad_tensor() -> None:
    qw = _fp8_weight()
    cases = [
        (
            lambda: qk.make_weight("gate", qw.data, qw.scale, "fp6", (128, 128), False),
            "weight kind 'fp6' is not one of",
        ),
        (
            lambda: qk.make_weight("gate", qw.data.view(torch.int8), qw.scale, "fp8", (128, 128), False),
            "gate data must have dtype torch.float8_e4m3fn or torch.uint8 (got torch.int8)",
        ),
        (lambda: qk.make_weight("gate", qw.data, qw.scale, "fp8", (128, 128), True), "gate must be [E, N, K]"),
        (
            lambda: qk.make_weight("gate", qw.data, qw.scale[:, :1], "fp8", (128, 128), False),
            "gate scale has shape [2, 1] but a [200, 256] fp8 weight in 128x128 blocks needs [2, 2]",
        ),
        (
            lambda: qk.make_weight("gate", qw.data, qw.scale.double(), "fp8", (128, 128), False),
            "gate scale must have dtype torch.float32 or torch.float8_e8m0fnu or torch.uint8",
        ),
        (lambda: qk.make_weight("gate", qw.data, qw.scale, "fp8", (0, 128), False), "must be two positive sizes"),
    ]
    for make, needle in cases:
        with pytest.raises(EngramError) as exc:
            make()
        _one_line(exc, needle)
    w = qk.make_weight("w", qw.data, qw.scale, "fp8", (128, 128), False)
    assert (w.experts, w.out_features, w.in_features, w.scale_type, w.w_type) == (1, 200, 256, qk.QSCALE_F32, 0)
    f4 = _fp4_weight(lead=(3,))
    w4 = qk.make_weight("w", f4.data, f4.scale, "fp4", f4.block, True)
    assert (w4.experts, w4.out_features, w4.in_features, w4.scale_type) == (3, 64, 128, qk.QSCALE_UE8M0)


def test_unavailable_for_says_why_in_one_line() -> None:
    qw = _fp8_weight()
    x = torch.randn(3, 256)
    assert nq.unavailable_for(x, qw) == "x is on cpu, not a CUDA device"
    _one_line(nq.unavailable_for(x.to(torch.int32), qw), "x has dtype torch.int32; the kernels take bfloat16")
    _one_line(nq.unavailable_for(torch.randn(3, 255), qw), "x has shape (3, 255) but the weight takes 256 features")
    _one_line(nq.unavailable_for([1.0], qw), "x must be a torch.Tensor (got list)")
    _one_line(nq.unavailable_for(x, torch.zeros(200, 256)), "weight must be a QuantWeight (got a tensor")
    with pytest.raises(EngramError) as exc:
        nq.linear(x, qw)
    _one_line(exc, "quantized linear cannot run on the kernels: x is on cpu, not a CUDA device")
    with pytest.raises(EngramError) as exc:
        quant_linear(x, qw, backend="kernels")
    _one_line(exc, "needs a CUDA device")
    # the CPU path: the one weight dequantized, F.linear
    want = x.double() @ qw.dequantize(torch.float64).t()
    assert torch.allclose(quant_linear(x.double(), qw), want, rtol=0, atol=0)


def test_experts_refusals_name_the_tensor() -> None:
    E, I, D = 4, 64, 96
    gate, up = _fp4_weight(I, D, (E,)), _fp4_weight(I, D, (E,))
    down = _fp4_weight(D, I, (E,))
    x = torch.randn(2, D)
    ids = torch.zeros(2, 2, dtype=torch.int32)
    assert nq.unavailable_for_experts(x, ids, gate, up, down) == "x is on cpu, not a CUDA device"
    _one_line(nq.unavailable_for_experts(torch.randn(2, D + 1), ids, gate, up, down), "x must be [T, 96]")
    _one_line(
        nq.unavailable_for_experts(x, ids, gate, up, _fp4_weight(D, 2 * I, (E,))),
        "down must be [E, D, I] = [4, 96, 64] (got [4, 96, 128])",
    )
    _one_line(nq.unavailable_for_experts(x, ids, gate, _fp4_weight(I + 1, D, (E,)), down), "up is [4, 65, 96]")
    fp8_up = QuantWeight(*formats.quantize_fp8(torch.randn(E, I, D), (128, 128)), "fp8", (128, 128))
    _one_line(nq.unavailable_for_experts(x, ids, gate, fp8_up, down), "gate and up must share a kind and block")
    _one_line(
        nq.unavailable_for_experts(x, ids, gate.dequantize(), gate.dequantize(), down.dequantize()),
        "gate is a torch.float32 tensor stack; the expert kernels take bfloat16 stacks",
    )
    with pytest.raises(EngramError) as exc:
        nq.experts(x, ids, torch.ones(2, 2), gate, up, down, limit=None)
    _one_line(exc, "experts cannot run on the kernels: x is on cpu")


def test_plan_binding_refusals() -> None:
    for ids, E, needle in (
        (torch.zeros(4, 2, dtype=torch.int16), 8, "ids must have dtype torch.int32 or torch.int64"),
        (torch.zeros(8, dtype=torch.int32), 8, "ids must be [T, k] (got shape (8,))"),
        (torch.zeros(4, 2, dtype=torch.int32), 5000, "num_experts must be in [1, 4096] (got 5000)"),
        (torch.zeros(4, 0, dtype=torch.int32), 8, "needs k >= 1"),
        (torch.zeros(4, 2, dtype=torch.int32), 8, "ids must be a CUDA tensor (got device cpu)"),
    ):
        with pytest.raises(EngramError) as exc:
            nq.moe_plan(ids, E)
        _one_line(exc, needle)


@pytest.mark.parametrize(
    "capability,kind,block,rows,want",
    [
        ((9, 0), "fp8", (128, 128), 1, "gemv"),
        ((9, 0), "fp8", (128, 128), 8, "gemv"),
        ((9, 0), "fp8", (128, 128), 9, "gemm"),
        ((9, 0), "fp8", (128, 64), 9, "gemv"),  # bk != 128: the GEMV in passes
        ((9, 0), "fp8", (128, 64), 65, "the FP8 GEMM needs weight blocks of bk = 128 (got 128x64)"),
        ((8, 0), "fp8", (128, 128), 64, "gemv"),  # no FP8 tensor cores before sm_89
        ((8, 0), "fp8", (128, 128), 65, "the FP8 tensor cores need compute capability 8.9+ (this GPU is 8.0)"),
        ((8, 9), "fp8", (128, 128), 4096, "gemm"),
        ((9, 0), "fp8", (128, 8), 1, "the GEMV needs the block's bk a multiple of 16"),
        ((9, 0), "fp4", (1, 32), 2, "gemv"),
        ((9, 0), "fp4", (1, 32), 100, "gemm"),
        ((7, 5), "fp4", (1, 32), 100, "the bf16 tensor cores need compute capability 8.0+"),
    ],
)
def test_rows_go_to_the_gemv_or_the_gemm(monkeypatch, capability, kind, block, rows, want) -> None:
    monkeypatch.setattr(nq, "_capability", lambda index: capability)
    monkeypatch.setattr(nq, "_device_index", lambda device: 0)
    if kind == "fp8":
        qw = QuantWeight(*formats.quantize_fp8(torch.randn(64, 256), block), "fp8", block)
    else:
        qw = _fp4_weight(64, 256)
    w = nq._weight("w", qw, stacked=False)
    if want in ("gemv", "gemm"):
        assert nq._route(rows, w, "cuda", nq.LINEAR_GEMV_MAX_ROWS) == want
    else:
        with pytest.raises(EngramError) as exc:
            nq._route(rows, w, "cuda", nq.LINEAR_GEMV_MAX_ROWS)
        _one_line(exc, want)


def test_fp4_gemm_wants_ue8m0_scales(monkeypatch) -> None:
    monkeypatch.setattr(nq, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(nq, "_device_index", lambda device: 0)
    qw = _fp4_weight(64, 256)
    w = nq._weight("w", QuantWeight(qw.data, formats.e8m0_to_float(qw.scale), "fp4", (1, 32)), stacked=False)
    assert nq._route(64, w, "cuda", 8) == "gemv"
    with pytest.raises(EngramError) as exc:
        nq._route(65, w, "cuda", 8)
    _one_line(exc, "the FP4 GEMM needs ue8m0 scales")


# --- the references themselves -----------------------------------------------------------


def test_e4m3_decode_of_every_code_is_ml_dtypes() -> None:
    codes = np.arange(256, dtype=np.uint8)
    want = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    got = formats.e4m3_to_float(torch.from_numpy(codes), torch.float64).numpy()
    assert np.array_equal(np.isnan(got), np.isnan(want)) and int(np.isnan(want).sum()) == 2  # 0x7F, 0xFF
    assert np.array_equal(got[~np.isnan(want)], want[~np.isnan(want)])
    assert float(np.nanmax(want)) == formats.FP8_MAX


def test_e2m1_table_and_packing_are_ml_dtypes() -> None:
    table = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    assert np.array_equal(np.asarray(formats.E2M1_VALUES), table)
    assert np.array_equal(np.signbit(np.asarray(formats.E2M1_VALUES)), np.signbit(table))  # -0.0 at code 8
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, size=(5, 38))
    packed = formats.pack_fp4(torch.from_numpy(codes))
    hand = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    assert np.array_equal(packed.numpy(), hand)
    assert np.array_equal(formats.unpack_fp4(packed, torch.float64).numpy(), table[codes])
    with pytest.raises(EngramError):
        formats.pack_fp4(torch.zeros(3, 5, dtype=torch.int64))


def test_e8m0_decode_of_every_code_is_ml_dtypes() -> None:
    codes = np.arange(256, dtype=np.uint8)
    want = codes.view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
    got = formats.e8m0_to_float(torch.from_numpy(codes), torch.float64).numpy()
    assert np.isnan(got[255]) and np.isnan(want[255])
    assert np.array_equal(got[:255], want[:255]) and got[127] == 1.0 and got[0] == 2.0**-127


def _finite_e4m3(rng, shape) -> np.ndarray:
    codes = rng.integers(0, 256, size=shape).astype(np.uint8)
    return np.where((codes & 0x7F) == 0x7F, codes - 1, codes).astype(np.uint8)  # no NaN codes


@pytest.mark.parametrize(
    "N,K,block,fmt",
    [
        (200, 300, (128, 128), "float"),
        (129, 257, (128, 128), "ue8m0"),
        (7, 40, (3, 16), "float"),
        (64, 128, (128, 128), "ue8m0"),
    ],
)
def test_fp8_dequantize_with_partial_blocks_is_the_float64_loop(N, K, block, fmt) -> None:
    rng = np.random.default_rng(N * K)
    codes = _finite_e4m3(rng, (N, K))
    gn, gk = -(-N // block[0]), -(-K // block[1])
    if fmt == "float":
        scale = torch.from_numpy(rng.uniform(1e-3, 2.0, size=(gn, gk)).astype(np.float32))
        svals = scale.double().numpy()
    else:
        sbytes = rng.integers(110, 140, size=(gn, gk)).astype(np.uint8)
        scale = torch.from_numpy(sbytes).view(torch.float8_e8m0fnu)
        svals = np.array([[math.ldexp(1.0, int(b) - 127) for b in row] for row in sbytes])
    vals = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    want = np.empty((N, K))
    for n in range(N):
        for k in range(K):
            want[n, k] = vals[n, k] * svals[n // block[0], k // block[1]]
    got = formats.dequantize_fp8(torch.from_numpy(codes).view(torch.float8_e4m3fn), scale, block, torch.float64)
    assert np.array_equal(got.numpy(), want)


@pytest.mark.parametrize("N,K,block", [(5, 64, (1, 32)), (9, 96, (4, 64)), (3, 34, (2, 32))])
def test_fp4_dequantize_with_partial_blocks_is_the_float64_loop(N, K, block) -> None:
    rng = np.random.default_rng(K)
    codes = rng.integers(0, 16, size=(N, K))
    packed = formats.pack_fp4(torch.from_numpy(codes)).view(torch.int8)
    gn, gk = -(-N // block[0]), -(-K // block[1])
    sbytes = rng.integers(100, 150, size=(gn, gk)).astype(np.uint8)
    table = np.asarray(formats.E2M1_VALUES)
    want = np.empty((N, K))
    for n in range(N):
        for k in range(K):
            want[n, k] = table[codes[n, k]] * math.ldexp(1.0, int(sbytes[n // block[0], k // block[1]]) - 127)
    got = formats.dequantize_fp4(packed, torch.from_numpy(sbytes).view(torch.float8_e8m0fnu), block, torch.float64)
    assert np.array_equal(got.numpy(), want)


def _act_quant_restated(x: np.ndarray, group: int, ue8m0: bool):
    """quantKernels.h's engram_act_quant in NumPy float32 steps and ml_dtypes' e4m3 cast."""
    M, K = x.shape
    G = -(-K // group)
    q = np.empty((M, K), dtype=np.uint8)
    s = np.empty((M, G), dtype=np.float32)
    deq = np.empty((M, K), dtype=np.float32)
    f32 = np.float32
    for m in range(M):
        for g in range(G):
            cols = slice(g * group, min(K, (g + 1) * group))
            amax = np.abs(x[m, cols]).max()
            sv = f32(max(amax, f32(1e-4)) / f32(448.0))
            if ue8m0:
                mant, e = math.frexp(float(sv))
                sv = sv if mant == 0.5 else f32(math.ldexp(1.0, e))
            inv = f32(f32(1.0) / sv)
            scaled = np.clip((x[m, cols] * inv).astype(np.float32), -448.0, 448.0)
            qv = scaled.astype(ml_dtypes.float8_e4m3fn)
            q[m, cols] = qv.view(np.uint8)
            deq[m, cols] = (qv.astype(np.float32) * sv).astype(np.float32)
            s[m, g] = sv
    return q, s, deq


@pytest.mark.parametrize(
    "M,K,group,ue8m0",
    [(3, 300, 128, False), (4, 300, 128, True), (2, 96, 32, True), (5, 20, 8, False), (1, 7, 16, True)],
)
def test_act_quant_reference_is_its_restatement(M, K, group, ue8m0) -> None:
    rng = np.random.default_rng(M * K + group)
    x = (rng.standard_normal((M, K)) * np.exp(rng.uniform(-8, 8, size=(M, 1)))).astype(np.float32)
    x[0, : min(K, 3)] = [0.0, -0.0, 1e-7][: min(K, 3)]  # tiny values: the amax floor
    if M > 1:
        x[1, :] = 0.0  # an all-zero row: s = 1e-4 / 448
    q, s, deq = formats.act_quant(torch.from_numpy(x), group, ue8m0)
    q2, s2, deq2 = _act_quant_restated(x, group, ue8m0)
    assert np.array_equal(q.view(torch.uint8).numpy(), q2)
    assert np.array_equal(s.numpy(), s2)
    assert np.array_equal(deq.numpy(), deq2)
    # and what they mean: the scale covers the group's amax, the codes are the nearest e4m3 values
    xs = x.astype(np.float64)
    sf = np.repeat(s2.astype(np.float64), group, axis=1)[:, :K]
    assert np.all(np.abs(xs) <= 448.0 * sf * (1 + 2.0**-22))
    if ue8m0:
        assert all(math.frexp(float(v))[0] == 0.5 for v in s2.ravel())
    grid = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    grid = np.unique(grid[np.isfinite(grid)])
    t = np.clip(x * (np.float32(1.0) / np.repeat(s2, group, axis=1)[:, :K]), -448, 448).astype(np.float64)
    nearest = np.abs(grid[None, None, :] - t[..., None]).min(axis=-1)
    qvals = q2.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    assert np.array_equal(np.abs(qvals - t), nearest)


def test_pow2_ceil_is_exact_just_above_a_power_of_two() -> None:
    # float32 log2 rounds 2^-9 (1 + 2^-23) to -9: exp2(ceil(log2)) gave 2^-9, below the value
    x = torch.tensor([2.0**-9 * (1 + 2.0**-23), 2.0**-9, 3.0, 0.75, 2.0**100 * 1.5], dtype=torch.float32)
    assert formats._pow2_ceil(x).tolist() == [2.0**-8, 2.0**-9, 4.0, 1.0, 2.0**101]
