"""The decode step's stored-format kernels (quantDecodeKernel.cu, declared in
plugins/kernels/quantKernels.h) on a machine without a GPU: the ctypes structures are the
header's (field order, types, size), ACT_QUANT is native/quant.py's, the C ABI refuses bad
arguments in one line naming them before any CUDA call, and the Python bindings name the
bad tensor before anything reaches the library (the GPU results: tests/gpu/test_quant_decode.py).
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest
import torch
from engram_trt.errors import EngramError
from engram_trt.native import decode
from engram_trt.native import quant as nq
from engram_trt.native import quant_decode as qd
from engram_trt.quant.formats import quantize_fp4, quantize_fp8
from engram_trt.quant.weight import QuantWeight

from helpers.files import REPO
from helpers.kernel_args import gemv_prologue

HEADER = REPO / "plugins" / "kernels" / "quantKernels.h"
_C_TYPES = {
    "const void*": ctypes.c_void_p,
    "void*": ctypes.c_void_p,
    "const int32_t*": ctypes.c_void_p,
    "const float*": ctypes.c_void_p,
    "float*": ctypes.c_void_p,
    "int64_t": ctypes.c_int64,
    "int32_t": ctypes.c_int32,
    "float": ctypes.c_float,
}


def _header_struct(name: str) -> list[tuple[str, str]]:
    text = re.sub(r"/\*.*?\*/", "", HEADER.read_text(), flags=re.DOTALL)
    body = re.search(r"typedef struct " + name + r"\s*\{(.*?)\}\s*" + name + ";", text, flags=re.DOTALL)
    assert body is not None, name
    fields = []
    for line in body.group(1).split(";"):
        line = " ".join(line.split())
        if line:
            ctype, field = line.rsplit(" ", 1)
            fields.append((field, ctype))
    return fields


def test_structures_are_the_headers() -> None:
    for name, struct in qd.STRUCTS.items():
        fields = _header_struct(name)
        assert [f for f, _ in fields] == [f for f, _t in struct._fields_], name
        for (field, ctype), (_f, pytype) in zip(fields, struct._fields_):
            want = qd.STRUCTS.get(ctype, _C_TYPES.get(ctype))
            assert want is pytype, (name, field, ctype)
    assert ctypes.sizeof(qd._Segment) == 4 * 8 + 2 * 8 + 10 * 4
    assert ctypes.sizeof(qd._MoeWeight) == 2 * 8 + 6 * 4


def test_constants_are_the_headers() -> None:
    text = HEADER.read_text()
    assert int(re.search(r"#define ENGRAM_QSEG_MAX_SEGMENTS (\d+)", text).group(1)) == qd.MAX_SEGMENTS
    assert int(re.search(r"#define ENGRAM_QSEG_MAX_TOKENS (\d+)", text).group(1)) == qd.MAX_TOKENS
    assert qd.ACT_QUANT == nq.ACT_QUANT


# --- the C ABI's refusals (no CUDA call reached) ------------------------------------------

P16 = 256  # an aligned stand-in device pointer: the checks never dereference it


def _segment(**change) -> qd._Segment:
    f = dict(
        x=P16,
        w=P16,
        w_scale=P16,
        out=P16,
        x_stride=256,
        out_stride=256,
        x_type=0,
        out_type=0,
        w_type=0,
        scale_type=1,
        bn=128,
        bk=128,
        out_features=200,
        in_features=256,
        act_group=128,
        act_ue8m0=0,
    )
    f.update(change)
    return qd._Segment(*[f[name] for name, _t in qd._Segment._fields_])


def _refused(fn: str, *args) -> str:
    lib = qd.library()
    status = getattr(lib, fn)(*args)
    assert status == 1, (fn, status)  # cudaErrorInvalidValue
    return lib.engram_last_error().decode()


def _one_line(msg: str, needle: str) -> None:
    assert needle in msg and "\n" not in msg, msg


def test_segments_abi_refusals(plugin_lib: Path) -> None:
    cases = [
        ({"w_type": 3}, "segment 0: w_type 3 is not FP8 (0), FP4 (1) or BF16 (2)"),
        ({"in_features": 264, "x_stride": 264}, "in_features a positive multiple of 16"),
        ({"w_type": 1, "in_features": 272, "x_stride": 272}, "in_features a positive multiple of 32"),
        ({"out_features": 0}, "need out_features >= 1"),
        ({"x_type": 2}, "x_type must be bf16 (0) or float32 (1)"),
        ({"out_type": 7}, "out_type 7 is not bf16, float32 or float16"),
        ({"x_stride": 260}, "x_stride must be >= in_features and a multiple of 8"),
        ({"out_stride": 100}, "out_stride >= out_features"),
        ({"act_group": 64}, "act_group must be 0, 32 or 128 (got 64)"),
        ({"bk": 24}, "bk a multiple of 16"),
        ({"w_scale": None}, "needs scales"),
        ({"w": 264}, "segment 0.w must be a 16-byte aligned device pointer"),
        ({"x": 264}, "x must be a 16-byte aligned device pointer"),
    ]
    for change, needle in cases:
        segs = (qd._Segment * 2)(_segment(), _segment(**change))
        msg = _refused("engram_quant_gemv_segments", ctypes.addressof(segs), 2, 1, 1, None)
        _one_line(msg.replace("segment 1", "segment 0"), needle)
    one = (qd._Segment * 1)(_segment())
    _one_line(
        _refused("engram_quant_gemv_segments", ctypes.addressof(one), 9, 1, 1, None),
        "need 1 <= num_segments <= 8 (got 9)",
    )
    _one_line(
        _refused("engram_quant_gemv_segments", ctypes.addressof(one), 1, 9, 1, None),
        "num_tokens must be in [0, 8] (got 9)",
    )
    _one_line(_refused("engram_quant_gemv_segments", ctypes.addressof(one), 1, 1, 8, None), "unknown flags 0x8")
    assert qd.library().engram_quant_gemv_segments(ctypes.addressof(one), 1, 0, 1, None) == 0  # 0 rows: nothing


def _prologue(**change) -> decode._GemvPrologue:
    return gemv_prologue(**{"dim": 256, "weight": P16 * 4, **change})


ROPE = dict(kind=decode.PROLOGUE_ROPE, dim=128, rope_pairs=32, rope_sign=-1, cos=P16 * 5, sin=P16 * 6, cos_stride=32)


@pytest.mark.parametrize(
    "change,seg,needle",
    [
        ({"kind": 3}, {}, "prologue kind 3 is not NONE (0), RMSNORM (1) or ROPE (2)"),
        (
            {"weight": None},
            {},
            "the RMSNorm prologue needs a 16-byte aligned fp32 weight, a finite eps >= 0 and an even dim "
            "(got eps 1e-06, dim 256)",
        ),
        ({"weight": P16 * 4 + 4}, {}, "needs a 16-byte aligned fp32 weight"),
        ({"eps": float("inf")}, {}, "(got eps inf, dim 256)"),
        ({"dim": 255}, {}, "(got eps 1e-06, dim 255)"),
        (
            {"dim": 4096},
            {},
            "the RMSNorm prologue sums rows of at most 2048 values (engram_norm_rope's register form; got dim 4096)",
        ),
        (
            {"dim": 128},
            {},
            "segment 0: the RMSNorm prologue normalizes whole rows: in_features must be dim 128 (got 256)",
        ),
        ({}, {"x_type": 1}, "segment 1: a prologue takes bf16 x (x_type 0; got 1)"),
        (
            {},
            {"in_features": 128, "x_stride": 128},
            "segment 1: the RMSNorm prologue normalizes whole rows: in_features must be dim 256 (got 128)",
        ),
        (
            dict(ROPE, dim=12),
            {},
            "the RoPE prologue needs dim a positive multiple of 8, 0 <= 2 * rope_pairs <= dim and rope_sign +-1 "
            "(got dim 12, rope_pairs 32, rope_sign -1)",
        ),
        (dict(ROPE, rope_pairs=65), {}, "(got dim 128, rope_pairs 65, rope_sign -1)"),
        (dict(ROPE, rope_sign=0), {}, "(got dim 128, rope_pairs 32, rope_sign 0)"),
        (
            dict(ROPE, cos_stride=31),
            {},
            "the RoPE prologue needs cos / sin [tokens, >= rope_pairs] fp32 (got cos_stride 31)",
        ),
        (dict(ROPE, sin=None), {}, "the RoPE prologue needs cos / sin"),
        (
            dict(ROPE, dim=96),
            {},
            "segment 0: the RoPE prologue rotates whole heads: in_features must be a multiple of dim 96 (got 256)",
        ),
        (dict(ROPE), {"x_type": 1}, "segment 1: a prologue takes bf16 x (x_type 0; got 1)"),
    ],
)
def test_segments_ex_prologue_refusals(plugin_lib: Path, change, seg, needle) -> None:
    """engram_quant_gemv_segments_ex checks its prologue as engram_gemv_segments_bf16_ex does
    (one shared check, the same words), and its own rule: a prologue reads bf16 x. ``seg``
    changes the second segment alone."""
    segs = (qd._Segment * 2)(_segment(), _segment(**seg))
    msg = _ex(segs, 1, _prologue(**change))
    assert isinstance(msg, str) and msg.startswith("engram_quant_gemv_segments_ex: "), msg
    _one_line(msg, needle)


def _ex(segs: ctypes.Array, tokens: int, pro: decode._GemvPrologue | None) -> str | int:
    """engram_quant_gemv_segments_ex over ``segs`` (flags WEIGHT_STATIC): 0, or the library's
    message (the structures stay referenced here for the call)."""
    lib = qd.library()
    status = lib.engram_quant_gemv_segments_ex(
        ctypes.addressof(segs), len(segs), tokens, 1, None if pro is None else ctypes.addressof(pro), None
    )
    return status if status == 0 else lib.engram_last_error().decode()


def test_segments_ex_limits_and_no_prologue(plugin_lib: Path) -> None:
    one = (qd._Segment * 1)(_segment())
    bad = (qd._Segment * 1)(_segment(w_type=3))
    # the segments' own checks first, named by the _ex entry
    _one_line(_ex(bad, 1, _prologue()), "engram_quant_gemv_segments_ex: segment 0: w_type 3 is not FP8")
    _one_line(_ex(one, 9, None), "engram_quant_gemv_segments_ex: num_tokens must be in [0, 8] (got 9)")
    # the old entry is the _ex one without a prologue: its errors still name it
    _one_line(
        _refused("engram_quant_gemv_segments", ctypes.addressof(bad), 1, 1, 1, None),
        "engram_quant_gemv_segments: segment 0: w_type 3",
    )
    # no tokens: nothing launched, with no prologue, kind NONE or a valid one
    for pro in (None, _prologue(kind=decode.PROLOGUE_NONE, weight=None), _prologue(), _prologue(**ROPE)):
        assert _ex(one, 0, pro) == 0, pro
    # a prologue is checked even with no tokens (its fields do not depend on them)
    _one_line(_ex(one, 0, _prologue(kind=7)), "engram_quant_gemv_segments_ex: prologue kind 7")


def _moe_args(**change) -> qd._Moe:
    w = dict(w=P16, scale=P16, w_type=1, scale_type=1, bn=1, bk=32, act_group=32, act_ue8m0=1)
    s = dict(w=P16, scale=P16, w_type=0, scale_type=1, bn=128, bk=128, act_group=128, act_ue8m0=0)
    weights = {name: dict(w) for name in ("gate", "up", "down")}
    weights.update({name: dict(s) for name in ("shared_gate", "shared_up", "shared_down")})
    for key, value in list(change.items()):
        if "." in key:
            name, field = key.split(".")
            weights[name][field] = value
            del change[key]
    f = dict(
        x=P16,
        ids=P16,
        route_w=P16,
        workspace=P16,
        out=P16,
        num_tokens=2,
        workspace_bytes=1 << 20,
        hidden=256,
        top_k=2,
        num_experts=4,
        intermediate=128,
        shared_intermediate=128,
        clamp=1,
        limit=7.0,
        reserved=0,
    )
    f.update(change)
    for name, fields in weights.items():
        f[name] = qd._MoeWeight(*[fields[n] for n, _t in qd._MoeWeight._fields_])
    return qd._Moe(*[f[name] for name, _t in qd._Moe._fields_])


def test_moe_abi_refusals(plugin_lib: Path) -> None:
    cases = [
        ({"num_tokens": 9}, "0 <= num_tokens <= 8"),
        ({"top_k": 17}, "1 <= top_k <= 16"),
        ({"num_experts": 0}, "1 <= num_experts <= 4096"),
        ({"clamp": 1, "limit": -1.0}, "limit must be >= 0 when clamp is set"),
        ({"down.w_type": 5}, "down.w_type 5 is not FP8"),
        ({"gate.w": 264}, "gate.w must be a 16-byte aligned device pointer"),
        ({"hidden": 272}, "gate's in_features 272 must be a multiple of 32"),
        ({"shared_down.bk": 24}, "shared_down needs scales"),
        ({"up.act_group": 64}, "up.act_group must be 0, 32 or 128"),
        ({"up.bk": 64}, "gate and up (and shared_gate and shared_up) must share"),
        ({"workspace_bytes": 16}, "workspace holds 16 bytes"),
        ({"x": 264}, "x and workspace must be 16-byte aligned"),
    ]
    for change, needle in cases:
        args = _moe_args(**change)
        _one_line(_refused("engram_quant_moe", ctypes.addressof(args), None), needle)
    size = ctypes.c_size_t(0)
    assert qd.library().engram_quant_moe_workspace_size(3, 2, 100, 130, ctypes.addressof(size)) == 0
    assert size.value == 3 * 3 * 132 * 4  # T (k + 1) rows of the wider width rounded up to 4 floats
    assert qd.library().engram_quant_moe(ctypes.addressof(_moe_args(num_tokens=0)), None) == 0


# --- the Python bindings' refusals --------------------------------------------------------


def _qw(kind: str, N: int, K: int) -> QuantWeight:
    w = torch.randn(N, K)
    if kind == "fp8":
        q, s = quantize_fp8(w, (128, 128), "ue8m0")
        return QuantWeight(q, s, "fp8", (128, 128))
    q, s = quantize_fp4(w)
    return QuantWeight(q, s, "fp4", (1, 32))


def test_bindings_name_the_bad_argument() -> None:
    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    w = _qw("fp8", 200, 256)
    out = torch.zeros(2, 200, dtype=torch.bfloat16)
    with pytest.raises(EngramError, match=r"segments\[0\]\.x must have dtype torch.bfloat16"):
        qd.gemv_segments([(x.float(), w, out)])
    with pytest.raises(EngramError, match=r"segments\[0\]\.out must be \[tokens, >= 200\]"):
        qd.gemv_segments([(x, w, out[:, :100])])
    with pytest.raises(EngramError, match=r"segments\[1\]: x and out must have 2 rows \(got 2, 1\)"):
        qd.gemv_segments([(x, w, out), (x, w, out[:1])])
    with pytest.raises(EngramError, match=r"segments\[0\]\.weight scale has shape"):
        qd.gemv_segments([(x, QuantWeight(w.data, w.scale[:1], "fp8", (128, 128)), out)])
    with pytest.raises(EngramError, match=r"segments\[0\]\.weight is a torch.float32 tensor"):
        qd.gemv_segments([(x, torch.zeros(200, 256), out)])
    with pytest.raises(EngramError, match=r"takes 1\.\.8 segments \(got 9\)"):
        qd.gemv_segments([(x, w, out)] * 9)
    with pytest.raises(EngramError, match=r"1 <= T <= 8"):
        qd.gemv_segments([(torch.zeros(9, 256, dtype=torch.bfloat16), w, out)])
    assert "CUDA" in qd.segment_reason(x, w)  # a CPU tensor: the fused glue keeps its path
    g = _qw("fp4", 4 * 64, 256)
    stack = QuantWeight(g.data.view(4, 64, 128), g.scale.view(4, 64, 8), "fp4", (1, 32))
    down = _qw("fp4", 4 * 256, 64)
    dstack = QuantWeight(down.data.view(4, 256, 32), down.scale.view(4, 256, 2), "fp4", (1, 32))
    ids = torch.zeros(2, 2, dtype=torch.int32)
    rw = torch.zeros(2, 2)
    with pytest.raises(EngramError, match=r"down must be \[E, D, I\]|gate / up must be \[E, I, D\] and down"):
        qd.moe(x, ids, rw, stack, stack, stack, shared=None, limit=None)
    with pytest.raises(EngramError, match=r"ids must have dtype"):
        qd.moe(x, ids.long(), rw, stack, stack, dstack, shared=None, limit=None)
    with pytest.raises(EngramError, match=r"x \[T, D\], ids \[T, k\] and route_w \[T, k\] disagree"):
        qd.moe(x, ids, rw[:1], stack, stack, dstack, shared=None, limit=None)
    bad_shared = (_qw("fp8", 128, 256), _qw("fp8", 128, 256), _qw("fp8", 256, 256))
    with pytest.raises(EngramError, match=r"the shared expert must be gate / up \[I_s, 256\] and down \[256, I_s\]"):
        qd.moe(x, ids, rw, stack, stack, dstack, shared=bad_shared, limit=None)
    assert "CUDA" in qd.moe_reason(x, 2, stack, stack, dstack, None)


def test_prologue_binding_names_the_bad_argument() -> None:
    """gemv_segments(prologue=...) refuses a prologue the library would refuse, in one line
    naming the field, before any device check (on CPU tensors a valid prologue reaches the
    devices' check: x must be a CUDA tensor)."""
    T, K = 2, 256
    x = torch.zeros(T, K, dtype=torch.bfloat16)
    w = _qw("fp8", 200, K)
    out = torch.zeros(T, 200, dtype=torch.bfloat16)
    cos, sin = torch.ones(T, 32), torch.ones(T, 32)
    norm_w = torch.ones(K)
    G = decode.GemvPrologue
    R, N = decode.PROLOGUE_ROPE, decode.PROLOGUE_RMSNORM
    for pro, needle in (
        (G(5, K), "prologue.kind 5 is not PROLOGUE_NONE, PROLOGUE_RMSNORM or PROLOGUE_ROPE"),
        (G(N, K), "prologue.weight must be given for the RMSNorm prologue"),
        (G(N, K, weight=norm_w, eps=float("nan")), "prologue.eps must be finite and >= 0 (got nan)"),
        (G(N, K, weight=norm_w, eps=-1.0), "prologue.eps must be finite and >= 0 (got -1.0)"),
        (G(N, 4096, weight=norm_w), "prologue.dim must be even and in [2, 2048] for the RMSNorm prologue (got 4096)"),
        (G(N, 255, weight=norm_w), "(got 255)"),
        (G(N, 128, weight=norm_w[:128]), "segments[0].x has 256 features; the RMSNorm prologue normalizes whole rows"),
        (G(N, K, weight=norm_w.double()), "prologue.weight must have dtype torch.float32 (got torch.float64)"),
        (G(N, K, weight=norm_w[:128]), "prologue.weight must be a contiguous [256] (got (128,))"),
        (G(N, K, weight=torch.ones(K + 1)[1:]), "prologue.weight must be 16-byte aligned"),
        (G(R, 12, rope_pairs=4, cos=cos, sin=sin), "the RoPE prologue needs prologue.dim a positive multiple of 8"),
        (G(R, 128, rope_pairs=65, cos=cos, sin=sin), "(got dim 128, rope_pairs 65, rope_sign 1)"),
        (G(R, 128, rope_pairs=32, cos=cos, sin=sin, rope_sign=2), "(got dim 128, rope_pairs 32, rope_sign 2)"),
        (G(R, 128, rope_pairs=32), "prologue.cos and prologue.sin must be given"),
        (G(R, 96, rope_pairs=32, cos=cos, sin=sin), "segments[0].x has 256 features; the RoPE prologue rotates whole"),
        (G(R, 128, rope_pairs=32, cos=cos[:1], sin=sin[:1]), "prologue.cos / sin must be [2, >= 32]"),
        (G(R, 128, rope_pairs=32, cos=cos.double(), sin=sin), "prologue.cos must have dtype torch.float32"),
    ):
        with pytest.raises(EngramError) as exc:
            qd.gemv_segments([(x, w, out)], prologue=pro)
        _one_line(str(exc.value), needle)
    for pro in (G(N, K, weight=norm_w, eps=1e-6), G(R, 128, rope_pairs=32, cos=cos, sin=sin, rope_sign=-1)):
        with pytest.raises(EngramError, match=r"segments\[0\]\.x must be a CUDA tensor"):
            qd.gemv_segments([(x, w, out)], prologue=pro)
