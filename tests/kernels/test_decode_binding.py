"""The decode glue kernels (plugins/kernels/decode*Kernel.cu, the fused mHC norms) on a
machine without a GPU:

- the C ABI's argument checks run before any CUDA call and name the bad field with the
  value the library read, which also ties each ctypes structure of native/decode.py to
  the C layout of engramKernels.h field by field (a shifted field would read another's
  value);
- the workspace size of the experts' launches;
- the ctypes bindings refuse wrong dtypes, shapes and devices in one line naming the
  argument;
- the model's fused path says why it does not serve a CPU or float32 step, and the
  modules' normed collapses equal the collapse followed by the norm there.
The kernels themselves run on a GPU in tests/gpu/test_dsv4_fused.py.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engram_trt.errors import EngramError
from engram_trt.native import decode

from helpers.kernel_args import gemv_prologue


def _one_line(exc: pytest.ExceptionInfo, needle: str) -> None:
    msg = str(exc.value)
    assert needle in msg and "\n" not in msg, msg


_FAKE = 1 << 20  # a 16-byte aligned address the checks accept (nothing is launched)


def _job(**change) -> decode._NormRopeJob:
    base = dict(
        x=_FAKE,
        out=_FAKE * 2,
        weight=_FAKE * 3,
        cos=_FAKE * 4,
        sin=_FAKE * 5,
        rows=4,
        x_stride=64,
        out_stride=64,
        cos_stride=8,
        weight_stride=0,
        dim=32,
        heads=2,
        norm=decode.NORM_WEIGHTED,
        rope_pairs=8,
        rope_sign=1,
        eps=1e-6,
    )
    base.update(change)
    return decode._NormRopeJob(**base)


def _norm_rope(*jobs, io=0):
    packed = (decode._NormRopeJob * len(jobs))(*jobs)
    decode._call("engram_norm_rope", packed, len(jobs), io, None)


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"rows": -1}, "job 1: rows must be in [0, 2^31 - 1] (got -1)"),
        (
            {"dim": 0},
            "job 1: need dim >= 1, heads >= 1 and 0 <= 2 * rope_pairs <= dim (got dim 0, heads 2, rope_pairs 8)",
        ),
        ({"heads": 0}, "(got dim 32, heads 0, rope_pairs 8)"),
        ({"rope_pairs": 17}, "(got dim 32, heads 2, rope_pairs 17)"),
        ({"norm": 3}, "job 1: norm 3 is not NONE (0), WEIGHTED (1) or UNWEIGHTED (2)"),
        ({"eps": -1.0}, "job 1: eps must be finite and >= 0 (got -1)"),
        ({"x_stride": 63}, "job 1: x_stride and out_stride must be at least heads * dim = 64 elements (got 63, 64)"),
        ({"out_stride": 40}, "(got 64, 40)"),
        ({"weight_stride": -32}, "job 1: weight_stride must be >= 0 (got -32)"),
        ({"weight": None}, "job 1: weight must be given for the WEIGHTED norm and only then"),
        ({"norm": decode.NORM_NONE}, "job 1: weight must be given for the WEIGHTED norm and only then"),
        (
            {"cos_stride": 7},
            "job 1: a RoPE job needs cos and sin [tokens, cos_stride >= rope_pairs] (got cos_stride 7)",
        ),
        ({"sin": None}, "a RoPE job needs cos and sin"),
        ({"rope_sign": 2}, "job 1: rope_sign must be 1 or -1 (got 2)"),
        ({"out": _FAKE + 64}, "job 1: out must be x itself (same stride) or apart from it"),
        ({"x": _FAKE + 1}, "job 1: x and out must be device pointers aligned to an element"),
    ],
)
def test_norm_rope_checks_name_the_field(plugin_lib: Path, change, needle) -> None:
    with pytest.raises(EngramError) as exc:
        _norm_rope(_job(x=_FAKE * 8, out=_FAKE * 9), _job(**change))
    _one_line(exc, needle)


def test_norm_rope_job_count_and_io_type(plugin_lib: Path) -> None:
    with pytest.raises(EngramError) as exc:
        _norm_rope(*[_job()] * 5)
    _one_line(exc, "need 1 <= num_jobs <= 4 jobs (got 5)")
    with pytest.raises(EngramError) as exc:
        _norm_rope(_job(), io=7)
    _one_line(exc, "io_type 7 is not bf16 (0), fp32 (1) or fp16 (2)")
    _norm_rope(_job(rows=0))  # nothing to do: no launch, no error
    _norm_rope(_job(x=_FAKE, out=_FAKE, rows=0))


def _segment(**change) -> decode._GemvSegment:
    base = dict(x=_FAKE, weight=_FAKE * 2, out=_FAKE * 3, x_stride=64, out_stride=48, out_features=40, in_features=64)
    base.update(change)
    return decode._GemvSegment(**base)


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"out_features": 0}, "segment 1: need out_features >= 1 and in_features a positive multiple of 8 (got 0, 64)"),
        ({"in_features": 12}, "(got 40, 12)"),
        (
            {"x_stride": 60},
            "segment 1: x_stride must be a multiple of 8 and >= in_features, out_stride >= out_features (got 60, 48)",
        ),
        ({"out_stride": 39}, "(got 64, 39)"),
        ({"x": _FAKE + 8}, "segment 1: x and weight must be 16-byte aligned device pointers, out a bf16 one"),
        ({"out": _FAKE + 2}, "segment 1: out must not overlap x or weight"),
    ],
)
def test_gemv_segments_checks_name_the_field(plugin_lib: Path, change, needle) -> None:
    segs = (decode._GemvSegment * 2)(_segment(x=_FAKE * 8, weight=_FAKE * 9, out=_FAKE * 10), _segment(**change))
    with pytest.raises(EngramError) as exc:
        decode._call("engram_gemv_segments_bf16", segs, 2, 2, 1, None)
    _one_line(exc, needle)


def test_gemv_segments_limits(plugin_lib: Path) -> None:
    seg = (decode._GemvSegment * 9)(*[_segment()] * 9)
    for count, tokens, flags, needle in (
        (9, 1, 1, "need 1 <= num_segments <= 8 (got 9)"),
        (0, 1, 1, "need 1 <= num_segments <= 8 (got 0)"),
        (1, 5, 1, "num_tokens must be in [0, 4] (got 5)"),
        (1, 1, 2, "unknown flags 0x2"),
    ):
        with pytest.raises(EngramError) as exc:
            decode._call("engram_gemv_segments_bf16", seg, count, tokens, flags, None)
        _one_line(exc, needle)
    decode._call("engram_gemv_segments_bf16", seg, 1, 0, 1, None)  # no tokens: nothing launched


def _prologue(**change) -> decode._GemvPrologue:
    return gemv_prologue(**{"dim": 64, "weight": _FAKE * 4, **change})


def test_gemv_prologue_struct_is_the_c_layout() -> None:
    # EngramGemvPrologue: six 4-byte fields, then three pointers and an int64
    assert ctypes.sizeof(decode._GemvPrologue) == 56
    assert decode._GemvPrologue.weight.offset == 24 and decode._GemvPrologue.cos_stride.offset == 48


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"kind": 3}, "prologue kind 3 is not NONE (0), RMSNORM (1) or ROPE (2)"),
        (
            {"weight": None},
            "the RMSNorm prologue needs a 16-byte aligned fp32 weight, a finite eps >= 0 and an even dim "
            "(got eps 1e-06, dim 64)",
        ),
        ({"eps": float("nan")}, "(got eps nan, dim 64)"),
        ({"dim": 32}, "segment 0: the RMSNorm prologue normalizes whole rows: in_features must be dim 32 (got 64)"),
        (
            {"dim": 4096},
            "the RMSNorm prologue sums rows of at most 2048 values (engram_norm_rope's register form; got dim 4096)",
        ),
        (
            {"kind": decode.PROLOGUE_ROPE, "dim": 12},
            "the RoPE prologue needs dim a positive multiple of 8, 0 <= 2 * "
            "rope_pairs <= dim and rope_sign +-1 (got dim 12, rope_pairs 0, "
            "rope_sign 1)",
        ),
        ({"kind": decode.PROLOGUE_ROPE, "dim": 16, "rope_pairs": 9}, "(got dim 16, rope_pairs 9, rope_sign 1)"),
        (
            {"kind": decode.PROLOGUE_ROPE, "dim": 16, "rope_pairs": 4, "rope_sign": 0},
            "(got dim 16, rope_pairs 4, rope_sign 0)",
        ),
        (
            {
                "kind": decode.PROLOGUE_ROPE,
                "dim": 16,
                "rope_pairs": 4,
                "cos": _FAKE * 5,
                "sin": _FAKE * 6,
                "cos_stride": 3,
            },
            "the RoPE prologue needs cos / sin [tokens, >= rope_pairs] fp32 (got cos_stride 3)",
        ),
        (
            {"kind": decode.PROLOGUE_ROPE, "dim": 48},
            "segment 0: the RoPE prologue rotates whole heads: in_features must be a multiple of dim 48 (got 64)",
        ),
    ],
)
def test_gemv_segments_ex_checks_the_prologue(plugin_lib: Path, change, needle) -> None:
    seg = (decode._GemvSegment * 1)(_segment())
    with pytest.raises(EngramError) as exc:
        decode._call("engram_gemv_segments_bf16_ex", seg, 1, 2, 1, ctypes.byref(_prologue(**change)), None)
    _one_line(exc, needle)


def test_gemv_segments_ex_limits(plugin_lib: Path) -> None:
    seg = (decode._GemvSegment * 1)(_segment())
    for tokens, needle in (
        (9, "engram_gemv_segments_bf16_ex: num_tokens must be in [0, 8] (got 9)"),
        (-1, "num_tokens must be in [0, 8] (got -1)"),
    ):
        with pytest.raises(EngramError) as exc:
            decode._call("engram_gemv_segments_bf16_ex", seg, 1, tokens, 1, None, None)
        _one_line(exc, needle)
    decode._call("engram_gemv_segments_bf16_ex", seg, 1, 0, 1, None, None)  # no tokens, no prologue: nothing launched
    # a prologue is checked even with no tokens (its fields do not depend on them)
    with pytest.raises(EngramError) as exc:
        decode._call("engram_gemv_segments_bf16_ex", seg, 1, 0, 1, ctypes.byref(_prologue(kind=7)), None)
    _one_line(exc, "prologue kind 7")


def test_gemv_prologue_binding_names_the_argument() -> None:
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    w = torch.zeros(40, 64, dtype=torch.bfloat16)
    out = torch.zeros(2, 40, dtype=torch.bfloat16)
    for pro, needle in (
        (
            decode.GemvPrologue(decode.PROLOGUE_RMSNORM, 64, weight=torch.ones(64, dtype=torch.float64)),
            "prologue.weight must have dtype torch.float32 (got torch.float64)",
        ),
        (
            decode.GemvPrologue(decode.PROLOGUE_RMSNORM, 64, weight=torch.ones(32)),
            "prologue.weight must be a contiguous [64] (got (32,))",
        ),
        (
            decode.GemvPrologue(decode.PROLOGUE_ROPE, 16, rope_pairs=4, cos=torch.ones(3, 4), sin=torch.ones(3, 4)),
            "prologue.cos / sin must be [2, >= 4]",
        ),
        (decode.GemvPrologue(5, 16), "prologue.kind 5 is not PROLOGUE_NONE"),
    ):
        with pytest.raises(EngramError) as exc:
            decode.gemv_segments([(x, w, out)], prologue=pro)
        _one_line(exc, needle)


def _route(**change):
    args = dict(
        logits=_FAKE,
        io=0,
        stride=8,
        bias=_FAKE * 2,
        tid2eid=None,
        ids_in=None,
        vocab=0,
        T=2,
        E=8,
        k=2,
        score=0,
        scaling=1.5,
        ids=_FAKE * 3,
        weights=_FAKE * 4,
    )
    args.update(change)
    decode._call(
        "engram_moe_route",
        *[args[k] for k in ("logits", "io", "stride", "bias", "tid2eid", "ids_in", "vocab", "T", "E", "k", "score")],
        ctypes.c_float(args["scaling"]),
        args["ids"],
        args["weights"],
        None,
    )


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"io": 5}, "io_type 5 is not bf16 (0), fp32 (1) or fp16 (2)"),
        ({"E": 1025}, "need 1 <= num_experts <= 1024 and 1 <= top_k <= min(num_experts, 16) (got 1025, 2)"),
        ({"k": 9}, "(got 8, 9)"),
        ({"k": 17, "E": 32, "stride": 32}, "(got 32, 17)"),
        ({"score": 4}, "score_fn 4 is not sqrtsoftplus (0), sigmoid (1), softmax (2) or softmax_topk (3)"),
        ({"score": 2, "tid2eid": _FAKE * 5}, "give exactly one of bias"),
        (
            {"bias": None},
            "give exactly one of bias (top-k routing) and tid2eid (hash routing, with input_ids and vocab_size)",
        ),
        ({"tid2eid": _FAKE * 5}, "give exactly one of bias"),
        ({"bias": None, "tid2eid": _FAKE * 5, "ids_in": _FAKE * 6}, "give exactly one of bias"),
        ({"stride": 7}, "need num_tokens in [0, 2^31 - 1] and logits_stride >= num_experts (got 2, 7)"),
        ({"T": -3}, "(got -3, 8)"),
        ({"scaling": float("inf")}, "scaling must be finite (got inf)"),
        ({"ids": None}, "logits, ids and weights must be device pointers"),
    ],
)
def test_moe_route_checks_name_the_argument(plugin_lib: Path, change, needle) -> None:
    with pytest.raises(EngramError) as exc:
        _route(**change)
    _one_line(exc, needle)
    _route(T=0)
    _route(bias=None, tid2eid=_FAKE * 5, ids_in=_FAKE * 6, vocab=100, T=0)


def test_experts_workspace_size(plugin_lib: Path) -> None:
    # h [T, k + 1, max(I, I_s)] bf16
    assert decode.experts_workspace_size(1, 2, 1024, 1024) == 1 * 3 * 1024 * 2
    assert decode.experts_workspace_size(4, 6, 256, 512) == 4 * 7 * 512 * 2
    assert decode.experts_workspace_size(3, 2, 64, 0) == 3 * 3 * 64 * 2
    assert decode.experts_workspace_size(0, 2, 64, 0) == 0
    for args, needle in (
        ((17, 2, 64, 64), "0 <= num_tokens <= 16"),
        ((1, 0, 64, 64), "1 <= top_k <= 16"),
        ((1, 2, 4, 64), "intermediate >= 8"),
        ((1, 2, 64, -8), "(got 1, 2, 64, -8)"),
    ):
        with pytest.raises(EngramError) as exc:
            decode.experts_workspace_size(*args)
        _one_line(exc, needle)


def _experts(**change) -> decode._MoeExperts:
    base = dict(
        x=_FAKE,
        ids=_FAKE * 2,
        weights=_FAKE * 3,
        gate=_FAKE * 4,
        up=_FAKE * 5,
        down=_FAKE * 6,
        shared_gate=_FAKE * 7,
        shared_up=_FAKE * 8,
        shared_down=_FAKE * 9,
        workspace=_FAKE * 10,
        out=_FAKE * 11,
        num_tokens=2,
        workspace_bytes=2 * 3 * 64 * 2,
        hidden=32,
        top_k=2,
        num_experts=4,
        intermediate=64,
        shared_intermediate=64,
        clamp=1,
        limit=7.0,
        reserved=0,
    )
    base.update(change)
    return decode._MoeExperts(**base)


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"num_tokens": 17}, "num_tokens must be in [0, 16] (a decode step; got 17)"),
        (
            {"hidden": 30},
            "hidden and intermediate must be positive multiples of 8, shared_intermediate a multiple of 8 "
            "(got 30, 64, 64)",
        ),
        ({"intermediate": 60}, "(got 32, 60, 64)"),
        ({"shared_intermediate": 12}, "(got 32, 64, 12)"),
        ({"num_experts": 0}, "need 1 <= num_experts <= 1024 and 1 <= top_k <= 16 (got 0, 2)"),
        ({"top_k": 17}, "(got 4, 17)"),
        ({"limit": -1.0}, "limit must be >= 0 when clamp is set (got -1)"),
        ({"workspace_bytes": 767}, "workspace holds 767 bytes, 768 needed"),
        ({"down": _FAKE * 6 + 4}, "x, gate, up, down and workspace must be 16-byte aligned device pointers"),
        (
            {"shared_up": None},
            "shared_gate, shared_up and shared_down must be 16-byte aligned device pointers when "
            "shared_intermediate > 0",
        ),
        ({"weights": None}, "ids, weights and out must be device pointers"),
        (
            {"down_expert_stride": 64},
            "down_expert_stride and down_row_stride must both be 0 (a packed [E, D, I]) or both multiples of 8, "
            "down_row_stride >= intermediate (got 64, 0)",
        ),
        ({"down_expert_stride": 64, "down_row_stride": 56}, "down_row_stride >= intermediate (got 64, 56)"),
        ({"down_expert_stride": 60, "down_row_stride": 256}, "(got 60, 256)"),
        (
            {"shared_scale": _FAKE * 12, "shared_scale_stride": 1, "shared_intermediate": 0},
            "shared_scale needs a shared expert (shared_intermediate > 0), shared_scale_stride >= 1 and a 2-byte "
            "aligned device pointer (got stride 1)",
        ),
        ({"shared_scale": _FAKE * 12, "shared_scale_stride": 0}, "(got stride 0)"),
        ({"shared_scale": _FAKE * 12 + 1, "shared_scale_stride": 1}, "2-byte aligned device pointer (got stride 1)"),
        ({"out": _FAKE + 64}, "out, x and workspace must not overlap"),
    ],
)
def test_moe_experts_checks_name_the_field(plugin_lib: Path, change, needle) -> None:
    with pytest.raises(EngramError) as exc:
        decode._call("engram_moe_experts_bf16", ctypes.byref(_experts(**change)), None)
    _one_line(exc, needle)
    decode._call("engram_moe_experts_bf16", ctypes.byref(_experts(num_tokens=0)), None)


# the grouped experts share engram_moe_experts_bf16's checks (decodeMoeCommon.cuh): each field's
# refusal, with the grouped entry point's name, token limit and workspace size
_GROUPED_WORKSPACE = 2 * 3 * (64 + 32) * 2  # h [T, k + 1, max(I, I_s)] and y [T, k + 1, D] bf16


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"num_tokens": 65}, "engram_moe_experts_grouped_bf16: num_tokens must be in [0, 64] (a decode step; got 65)"),
        ({"num_tokens": -1}, "num_tokens must be in [0, 64] (a decode step; got -1)"),
        ({"hidden": 30}, "hidden and intermediate must be positive multiples of 8"),
        ({"shared_intermediate": 12}, "(got 32, 64, 12)"),
        ({"num_experts": 1025}, "need 1 <= num_experts <= 1024 and 1 <= top_k <= 16 (got 1025, 2)"),
        ({"top_k": 17}, "(got 4, 17)"),
        ({"limit": float("nan")}, "limit must be >= 0 when clamp is set (got nan)"),
        ({"workspace_bytes": _GROUPED_WORKSPACE - 1}, f"workspace holds {_GROUPED_WORKSPACE - 1} bytes, "),
        ({"workspace_bytes": 768}, f"workspace holds 768 bytes, {_GROUPED_WORKSPACE} needed"),
        ({"x": _FAKE + 8}, "x, gate, up, down and workspace must be 16-byte aligned device pointers"),
        ({"shared_down": None}, "shared_gate, shared_up and shared_down must be 16-byte aligned"),
        ({"ids": None}, "ids, weights and out must be device pointers"),
        ({"down_expert_stride": 64}, "down_expert_stride and down_row_stride must both be 0"),
        ({"shared_scale": _FAKE * 12, "shared_scale_stride": 0}, "shared_scale needs a shared expert"),
        ({"workspace": _FAKE * 11 - 64}, "out, x and workspace must not overlap"),
    ],
)
def test_moe_experts_grouped_checks_name_the_field(plugin_lib: Path, change, needle) -> None:
    base = {"workspace_bytes": _GROUPED_WORKSPACE, **change}
    with pytest.raises(EngramError) as exc:
        decode._call("engram_moe_experts_grouped_bf16", ctypes.byref(_experts(**base)), None)
    _one_line(exc, needle)
    assert str(exc.value).count("engram_moe_experts_grouped_bf16: ") == 1
    decode._call("engram_moe_experts_grouped_bf16", ctypes.byref(_experts(num_tokens=0)), None)
    with pytest.raises(EngramError) as exc:
        decode._call("engram_moe_experts_grouped_bf16", None, None)
    _one_line(exc, "engram_moe_experts_grouped_bf16: args must not be NULL")


def test_experts_grouped_workspace_size(plugin_lib: Path) -> None:
    # h [T, k + 1, max(I, I_s)] then y [T, k + 1, D], bf16
    assert decode.experts_grouped_workspace_size(1, 2, 2048, 1024, 1024) == 1 * 3 * (1024 + 2048) * 2
    assert decode.experts_grouped_workspace_size(64, 2, 2048, 1024, 1024) == 64 * 3 * (1024 + 2048) * 2
    assert decode.experts_grouped_workspace_size(5, 3, 200, 40, 0) == 5 * 4 * (40 + 200) * 2
    assert decode.experts_grouped_workspace_size(4, 6, 64, 256, 512) == 4 * 7 * (512 + 64) * 2
    assert decode.experts_grouped_workspace_size(0, 2, 64, 64, 0) == 0
    for args, needle in (
        ((65, 2, 64, 64, 64), "0 <= num_tokens <= 64"),
        ((1, 17, 64, 64, 64), "1 <= top_k <= 16"),
        ((1, 2, 4, 64, 64), "hidden >= 8"),
        ((1, 2, 64, 0, 64), "(got 1, 2, 64, 0, 64)"),
        ((1, 2, 64, 64, -8), "(got 1, 2, 64, 64, -8)"),
    ):
        with pytest.raises(EngramError) as exc:
            decode.experts_grouped_workspace_size(*args)
        _one_line(exc, "engram_moe_experts_grouped_workspace_size: need bytes != NULL")
        _one_line(exc, needle)


def test_moe_experts_bindings_refuse_in_one_line() -> None:
    """moe_experts / moe_experts_grouped share their checks (native/decode.py _moe_args): too
    many tokens for the entry point, a bad stack shape, a wrong dtype, a host tensor; each
    refused before the library is asked (tensors that report CUDA reach the shape checks)."""
    bf = torch.bfloat16
    D, I, E, k = 32, 16, 4, 2

    def args(T: int, **change):
        a = dict(
            x=torch.zeros(T, D, dtype=bf),
            ids=torch.zeros(T, k, dtype=torch.int32),
            weights=torch.zeros(T, k),
            gate=torch.zeros(E, I, D, dtype=bf),
            up=torch.zeros(E, I, D, dtype=bf),
            down=torch.zeros(E, D, I, dtype=bf),
        )
        a.update(change)
        return {name: _cudaish(t) for name, t in a.items()}

    for fn, T, limit in ((decode.moe_experts, 17, 16), (decode.moe_experts_grouped, 65, 64)):
        name = fn.__name__
        with pytest.raises(EngramError) as exc:
            fn(**args(T), shared=None, limit=None)
        _one_line(exc, f"{name} takes at most {limit} tokens (x has {T} rows)")
        with pytest.raises(EngramError) as exc:
            fn(**args(3, down=torch.zeros(E, I, D, dtype=bf)), shared=None, limit=None)
        _one_line(exc, "gate / up must be [E, I, D] and down [E, D, I] or [D, E * I]")
        with pytest.raises(EngramError) as exc:
            fn(**args(3, ids=torch.zeros(2, k, dtype=torch.int32)), shared=None, limit=None)
        _one_line(exc, "ids and weights must be [T, k] = [3, 2] (got (2, 2), (3, 2))")
        with pytest.raises(EngramError) as exc:
            fn(**args(3, weights=torch.zeros(3, k, dtype=bf)), shared=None, limit=None)
        _one_line(exc, "weights must have dtype torch.float32 (got torch.bfloat16)")
        shared = tuple(_cudaish(t) for t in (torch.zeros(8, D, dtype=bf), torch.zeros(8, D, dtype=bf)))
        with pytest.raises(EngramError) as exc:
            fn(**args(3), shared=(*shared, _cudaish(torch.zeros(8, D, dtype=bf))), limit=None)
        _one_line(exc, f"the shared expert must be gate / up [I_s, {D}] and down [{D}, I_s]")
        with pytest.raises(EngramError) as exc:
            fn(**args(3), shared=None, limit=None, shared_scale=_cudaish(torch.zeros(3, 1, dtype=bf)))
        _one_line(exc, "shared_scale scales the shared expert: give shared as well")
        with pytest.raises(EngramError) as exc:
            fn(torch.zeros(3, D, dtype=bf), *list(args(3).values())[1:], shared=None, limit=None)
        _one_line(exc, "x must be a CUDA tensor (got device cpu)")


def test_decode_constants_and_prototypes_are_the_header() -> None:
    """native/decode.py mirrors decodeKernels.h: each limit's value, and each entry point's
    ctypes argument count its prototype's (a new field or argument on one side only fails)."""
    import re

    header = Path(__file__).resolve().parents[2] / "plugins" / "kernels" / "decodeKernels.h"
    text = header.read_text()
    for macro, value in (
        ("ENGRAM_NORM_ROPE_MAX_JOBS", decode.MAX_JOBS),
        ("ENGRAM_GEMV_MAX_SEGMENTS", decode.MAX_SEGMENTS),
        ("ENGRAM_GEMV_EX_MAX_TOKENS", decode.GEMV_EX_MAX_TOKENS),
        ("ENGRAM_MOE_MAX_EXPERTS", decode.MOE_MAX_EXPERTS),
        ("ENGRAM_MOE_MAX_TOP_K", decode.MOE_MAX_TOP_K),
        ("ENGRAM_MOE_DECODE_MAX_TOKENS", decode.MOE_MAX_TOKENS),
        ("ENGRAM_MOE_GROUPED_MAX_TOKENS", decode.MOE_GROUPED_MAX_TOKENS),
        ("ENGRAM_HC_MIX_MAX_TOKENS", decode.HC_MIX_MAX_TOKENS),
        ("ENGRAM_HC_MIX_MAX_ELEMENTS", decode.HC_MIX_MAX_ELEMENTS),
        ("ENGRAM_GDN_GLUE_MAX_TOKENS", decode.GDN_GLUE_MAX_TOKENS),
        ("ENGRAM_GDN_GLUE_MAX_HEADS", decode.GDN_GLUE_MAX_HEADS),
    ):
        found = re.search(rf"#define {macro} (\d+)", text)
        assert found is not None and int(found.group(1)) == value, macro
    protos = {
        name: [a for a in args.split(",") if a.strip()]
        for name, args in re.findall(r"ENGRAM_API\s+int\s+(engram_\w+)\s*\(([^)]*)\)\s*;", text)
    }
    assert protos.keys() == decode._ENTRY.signatures.keys()
    for name, argtypes in decode._ENTRY.signatures.items():
        assert len(argtypes) == len(protos[name]), name
    fields = re.search(r"typedef struct EngramMoeExperts\s*\{(.*?)\}", text, re.S).group(1)
    names = re.findall(r"(\w+)\s*;", re.sub(r"/\*.*?\*/", "", fields, flags=re.S))
    assert names == [f for f, _t in decode._MoeExperts._fields_]


class _ReportsCuda(torch.Tensor):
    """A host tensor that says it is on a CUDA device: the predicates' CUDA branches run on
    a CPU (the GPU tests alone reached them before, and a typo there raised on every GPU)."""

    @property
    def is_cuda(self) -> bool:
        return True


def _cudaish(t: torch.Tensor) -> torch.Tensor:
    return torch.Tensor._make_subclass(_ReportsCuda, t)


def test_gemv_fits_predicate_on_tensors_that_report_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """gemv_fits' whole predicate: bf16, 1-8 rows, K a multiple of 8, unit stride in a row,
    rows 16-byte aligned, a contiguous aligned weight, a capable GPU."""
    monkeypatch.setattr(decode, "gemv_capable", lambda device: True)
    bf = torch.bfloat16
    w = torch.zeros(16, 64, dtype=bf)
    assert decode.gemv_fits(_cudaish(torch.zeros(2, 64, dtype=bf)), w)
    assert decode.gemv_fits(_cudaish(torch.zeros(8, 64, dtype=bf)), w)
    assert not decode.gemv_fits(_cudaish(torch.zeros(9, 64, dtype=bf)), w), "more rows than the GEMV's 8"
    assert not decode.gemv_fits(_cudaish(torch.zeros(2, 64)), w.float()), "float32"
    assert not decode.gemv_fits(torch.zeros(2, 64, dtype=bf), w), "a host tensor"
    wide = _cudaish(torch.zeros(2, 68, dtype=bf))
    assert not decode.gemv_fits(wide[:, :64], w), "rows 136 bytes apart: not 16-byte aligned"
    assert not decode.gemv_fits(_cudaish(torch.zeros(2, 72, dtype=bf))[:, 1:65], w), "a row start off 16 bytes"
    assert not decode.gemv_fits(_cudaish(torch.zeros(2, 60, dtype=bf)), torch.zeros(16, 60, dtype=bf)), "K 60"
    assert not decode.gemv_fits(_cudaish(torch.zeros(2, 64, dtype=bf)), torch.zeros(64, 16, dtype=bf).t()), (
        "a transposed weight"
    )
    monkeypatch.setattr(decode, "gemv_capable", lambda device: False)
    assert not decode.gemv_fits(_cudaish(torch.zeros(2, 64, dtype=bf)), w), "a GPU below compute capability 9.0"


def _hc_mix(**change) -> decode._HcMix:
    base = dict(
        down_out=_FAKE,
        up=_FAKE * 2,
        normed=_FAKE * 3,
        inject_logits=_FAKE * 4,
        mixed=_FAKE * 5,
        inject=_FAKE * 6,
        num_tokens=2,
        down_out_stride=320,
        normed_stride=4 * 64,
        inject_stride=4,
        hidden=64,
        hc=4,
        rank=320,
        reserved=0,
    )
    base.update(change)
    return decode._HcMix(**base)


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"num_tokens": 17}, "engram_hc_mix_bf16: num_tokens must be in [0, 16] (a decode step; got 17)"),
        (
            {"rank": 12, "down_out_stride": 16},
            "need hidden >= 1, 1 <= hc <= 16, rank a positive multiple of 8 and num_tokens * rank <= 12288 "
            "(got 64, 4, 12, 2 tokens)",
        ),
        ({"hc": 17, "normed_stride": 17 * 64, "inject_stride": 17}, "(got 64, 17, 320, 2 tokens)"),
        ({"num_tokens": 16, "rank": 1024, "down_out_stride": 1024}, "(got 64, 4, 1024, 16 tokens)"),
        ({"inject": None}, "give both inject_logits and inject, or neither"),
        (
            {"down_out_stride": 300},
            "need down_out_stride >= rank and a multiple of 8, normed_stride >= hc * hidden, inject_stride >= hc "
            "(got 300, 256, 4)",
        ),
        ({"normed_stride": 255}, "(got 320, 255, 4)"),
        ({"inject_stride": 3}, "(got 320, 256, 3)"),
        ({"up": _FAKE * 2 + 8}, "down_out and up must be 16-byte aligned device pointers"),
        ({"mixed": None}, "normed, mixed, inject_logits and inject must be device pointers"),
        ({"mixed": _FAKE * 3 + 64}, "mixed and inject must not overlap each other or the inputs"),
        ({"inject": _FAKE * 5 + 2}, "mixed and inject must not overlap each other or the inputs"),
    ],
)
def test_hc_mix_checks_name_the_field(plugin_lib: Path, change, needle) -> None:
    with pytest.raises(EngramError) as exc:
        decode._call("engram_hc_mix_bf16", ctypes.byref(_hc_mix(**change)), None)
    _one_line(exc, needle)
    decode._call("engram_hc_mix_bf16", ctypes.byref(_hc_mix(num_tokens=0)), None)


def test_hc_mix_binding_checks_shapes(plugin_lib: Path) -> None:
    bf = torch.bfloat16
    up = torch.zeros(4 * 16, 8, dtype=bf)
    with pytest.raises(EngramError) as exc:
        decode.hc_mix(torch.zeros(2, 8, dtype=bf), up, torch.zeros(2, 64, dtype=bf), None, hc=3)
    _one_line(exc, "up's 64 rows are not hc = 3 streams of one width")
    with pytest.raises(EngramError) as exc:
        decode.hc_mix(torch.zeros(2, 8, dtype=bf), up, torch.zeros(3, 64, dtype=bf), None, hc=4)
    _one_line(exc, "normed must have 2 rows like down_out (got 3)")
    with pytest.raises(EngramError) as exc:
        decode.hc_mix(torch.zeros(2, 8, dtype=bf), up.float(), torch.zeros(2, 64, dtype=bf), None, hc=4)
    _one_line(exc, "up must have dtype torch.bfloat16 (got torch.float32)")
    with pytest.raises(EngramError) as exc:
        decode.hc_mix(torch.zeros(2, 8, dtype=bf), up, torch.zeros(2, 64, dtype=bf), None, hc=4)
    _one_line(exc, "up must be a CUDA tensor (got device cpu)")


def _gdn_gates(**change) -> decode._GdnGates:
    base = dict(
        b=_FAKE,
        a=_FAKE * 2,
        dt_bias=_FAKE * 3,
        neg_decay=_FAKE * 4,
        beta=_FAKE * 5,
        g=_FAKE * 6,
        num_tokens=2,
        b_stride=72,
        a_stride=72,
        heads=32,
        dt_bias_float=0,
    )
    base.update(change)
    return decode._GdnGates(**base)


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"num_tokens": 17}, "engram_gdn_gates_bf16: num_tokens must be in [0, 16] (a decode step; got 17)"),
        ({"num_tokens": -1}, "num_tokens must be in [0, 16] (a decode step; got -1)"),
        ({"heads": 0}, "need 1 <= heads <= 4096 and b_stride, a_stride >= heads (got 0, 72, 72)"),
        ({"heads": 4097, "b_stride": 5000, "a_stride": 5000}, "(got 4097, 5000, 5000)"),
        ({"b_stride": 31}, "(got 32, 31, 72)"),
        ({"a_stride": 30}, "(got 32, 72, 30)"),
        ({"dt_bias_float": 2}, "dt_bias_float must be 0 (bf16) or 1 (float32) (got 2)"),
        ({"a": None}, "b, a, dt_bias and neg_decay must be device pointers"),
        ({"neg_decay": _FAKE * 4 + 2}, "b, a, dt_bias and neg_decay must be device pointers"),
        ({"dt_bias": _FAKE * 3 + 2, "dt_bias_float": 1}, "b, a, dt_bias and neg_decay must be device pointers"),
        ({"g": _FAKE * 6 + 2}, "beta and g must be float32 device pointers"),
        ({"g": _FAKE * 5 + 128}, "beta and g must not overlap each other or b and a"),
        ({"beta": _FAKE + 64}, "beta and g must not overlap each other or b and a"),
    ],
)
def test_gdn_gates_checks_name_the_field(plugin_lib: Path, change, needle) -> None:
    with pytest.raises(EngramError) as exc:
        decode._call("engram_gdn_gates_bf16", ctypes.byref(_gdn_gates(**change)), None)
    _one_line(exc, needle)
    decode._call("engram_gdn_gates_bf16", ctypes.byref(_gdn_gates(num_tokens=0)), None)


def _gated_norm(**change) -> decode._GatedNorm:
    base = dict(
        x=_FAKE,
        gate=_FAKE * 2,
        weight=_FAKE * 3,
        out=_FAKE * 4,
        num_tokens=2,
        x_stride=4 * 128,
        gate_stride=4 * 128 + 8,
        heads=4,
        dim=128,
        activation=decode.GATE_ACTIVATIONS["silu"],
        x_float=0,
        eps=1e-6,
        reserved=0,
    )
    base.update(change)
    return decode._GatedNorm(**base)


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"num_tokens": 17}, "engram_gated_rms_norm_bf16: num_tokens must be in [0, 16] (a decode step; got 17)"),
        (
            {"heads": 0},
            "need 1 <= heads <= 4096, dim >= 1 and x_stride, gate_stride >= heads * dim (got 0, 128, 512, 520)",
        ),
        ({"dim": 0}, "(got 4, 0, 512, 520)"),
        ({"x_stride": 511}, "(got 4, 128, 511, 520)"),
        ({"gate_stride": 500}, "(got 4, 128, 512, 500)"),
        (
            {"activation": 2},
            "need activation 0 (silu) or 1 (sigmoid), x_float 0 (bf16) or 1 (float32), eps >= 0 (got 2, 0,",
        ),
        ({"x_float": 3}, "(got 0, 3, 1e-06)"),
        ({"eps": -1.0}, "(got 0, 0, -1)"),
        ({"weight": None}, "x, gate, weight and out must be device pointers"),
        ({"x": _FAKE + 2, "x_float": 1}, "x, gate, weight and out must be device pointers"),
        ({"out": _FAKE * 2 + 1024}, "out must not overlap x, gate or weight"),
        ({"out": _FAKE * 3 - 64}, "out must not overlap x, gate or weight"),
    ],
)
def test_gated_norm_checks_name_the_field(plugin_lib: Path, change, needle) -> None:
    with pytest.raises(EngramError) as exc:
        decode._call("engram_gated_rms_norm_bf16", ctypes.byref(_gated_norm(**change)), None)
    _one_line(exc, needle)
    decode._call("engram_gated_rms_norm_bf16", ctypes.byref(_gated_norm(num_tokens=0)), None)


def test_gdn_glue_bindings_check_shapes(plugin_lib: Path) -> None:
    bf, f32 = torch.bfloat16, torch.float32
    b, nd, dt = torch.zeros(2, 4, dtype=bf), torch.zeros(4, dtype=f32), torch.zeros(4, dtype=bf)
    for args, needle in (
        ((b, b, dt, nd.to(bf)), "neg_decay must have dtype torch.float32"),
        ((b, b, dt[:3], nd), "dt_bias must be [4] like neg_decay (got (3,))"),
        ((b, b, dt.half(), nd), "dt_bias must have dtype"),
        ((b.float(), b, dt, nd), "b must have dtype torch.bfloat16"),
        ((b[:, :3], b, dt, nd), "b must be [tokens, >= 4] (got shape (2, 3))"),
        ((b, torch.zeros(3, 4, dtype=bf), dt, nd), "a must have 2 rows like b (got 3)"),
        ((torch.zeros(17, 4, dtype=bf), torch.zeros(17, 4, dtype=bf), dt, nd), "b must have 1 to 16 rows"),
        ((torch.zeros(2, 8, dtype=bf)[:, ::2], b, dt, nd), "b must have unit stride inside a row"),
        ((b, b, dt, nd), "b must be a CUDA tensor (got device cpu)"),
    ):
        with pytest.raises(EngramError) as exc:
            decode.gdn_gates(*args)
        _one_line(exc, needle)
    w, x, z = torch.zeros(8, dtype=bf), torch.zeros(2, 24, dtype=f32), torch.zeros(2, 24, dtype=bf)
    for args, kw, needle in (
        ((x, z, w), {"activation": "gelu"}, "activation must be one of ['sigmoid', 'silu'] (got 'gelu')"),
        ((x, z, w.float()), {}, "weight must have dtype torch.bfloat16"),
        ((x, z, w), {"heads": 0}, "heads must be in [1, 4096] (got 0)"),
        ((x[:, :16], z, w), {}, "x must be [tokens, >= 24] (got shape (2, 16))"),
        ((x.double(), z, w), {}, "x must have dtype"),
        ((x, z.float(), w), {}, "gate must have dtype torch.bfloat16"),
        ((x, torch.zeros(1, 24, dtype=bf), w), {}, "gate must have 2 rows like x (got 1)"),
        ((x, z, w), {}, "x must be a CUDA tensor (got device cpu)"),
    ):
        with pytest.raises(EngramError) as exc:
            decode.gated_norm(*args, **{"heads": 3, "eps": 1e-6, "activation": "silu", **kw})
        _one_line(exc, needle)


def test_mhc_norm_entry_points_check_the_norm_arguments(plugin_lib: Path) -> None:
    from engram_trt.native import mhc

    T, hc, D = 1, 2, 16
    need = mhc.workspace_size(T, hc, D)
    common = [_FAKE, 0, _FAKE * 2, _FAKE * 3, _FAKE * 4, T, hc, D]
    for weight, eps, needle in (
        (None, 1e-6, "norm_weight must be a 16-byte aligned device pointer (fp32 [hidden])"),
        (_FAKE * 5 + 4, 1e-6, "norm_weight must be a 16-byte aligned device pointer"),
        (_FAKE * 5, float("nan"), "rms_eps must be finite and >= 0 (got nan)"),
    ):
        with pytest.raises(EngramError) as exc:
            mhc._call(
                "engram_mhc_pre_norm",
                *common,
                20,
                ctypes.c_float(1e-6),
                ctypes.c_float(1e-6),
                weight,
                ctypes.c_float(eps),
                _FAKE * 6,
                need,
                _FAKE * 7,
                _FAKE * 8,
                _FAKE * 9,
                None,
            )
        _one_line(exc, "engram_mhc_pre_norm: " + needle)
        with pytest.raises(EngramError) as exc:
            mhc._call(
                "engram_mhc_head_norm",
                *common,
                ctypes.c_float(1e-6),
                ctypes.c_float(1e-6),
                weight,
                ctypes.c_float(eps),
                _FAKE * 6,
                need,
                _FAKE * 7,
                None,
            )
        _one_line(exc, "engram_mhc_head_norm: " + needle)


def test_mhc_decode_workspace_is_the_general_plan_for_a_few_tokens(plugin_lib: Path) -> None:
    from engram_trt.native import mhc

    # the decode mix (up to 8 tokens) splits K in spans of 32 vectors, as the general plan
    # did there (aiming at 256 blocks, at most one split a 32-vector span)
    for T in (1, 2, 5, 8):
        assert mhc.workspace_size(T, 4, 2048) == 32 * T * 25 * 4
    # 7168 wide (the published model): 28672 / 8 = 3584 vectors, 112 spans of 32
    assert mhc.workspace_size(4, 4, 7168) == 112 * 4 * 25 * 4


# --- the bindings' own checks ----------------------------------------------------------------------


def test_bindings_name_the_bad_argument(plugin_lib: Path) -> None:
    bf = torch.bfloat16
    x = torch.zeros(2, 64, dtype=bf)
    with pytest.raises(EngramError) as exc:
        decode.norm_rope(decode.NormRopeJob(x, x, dim=32, heads=2))
    _one_line(exc, "jobs[0].x must be a CUDA tensor (got device cpu)")
    with pytest.raises(EngramError) as exc:
        decode.norm_rope(decode.NormRopeJob(x, torch.zeros(2, 64), dim=32, heads=2))
    _one_line(exc, "jobs[0].out must have dtype torch.bfloat16 (got torch.float32)")
    with pytest.raises(EngramError) as exc:
        decode.norm_rope(decode.NormRopeJob(x, x, dim=40, heads=2))
    _one_line(exc, "jobs[0].x must be [tokens, >= 80] (got shape (2, 64))")
    with pytest.raises(EngramError) as exc:
        decode.norm_rope()
    _one_line(exc, "norm_rope takes 1..4 jobs (got 0)")
    w = torch.zeros(16, 64, dtype=bf)
    with pytest.raises(EngramError) as exc:
        decode.gemv_segments([(x, w.float(), torch.zeros(2, 16, dtype=bf))])
    _one_line(exc, "segments[0].weight must have dtype torch.bfloat16 (got torch.float32)")
    with pytest.raises(EngramError) as exc:
        decode.gemv_segments([(x, w, torch.zeros(3, 16, dtype=bf))])
    _one_line(exc, "segments[0]: x and out must have 2 rows (got 2, 3)")
    with pytest.raises(EngramError) as exc:
        decode.moe_route(torch.zeros(2, 8), top_k=2, score_fn="argmax", scaling=1.0, bias=torch.zeros(8))
    _one_line(exc, "score_fn 'argmax' is not one of ['sigmoid', 'softmax', 'softmax_topk', 'sqrtsoftplus']")
    with pytest.raises(EngramError) as exc:
        decode.moe_route(torch.zeros(2, 8), top_k=2, score_fn="sigmoid", scaling=1.0)
    _one_line(exc, "give exactly one of bias (top-k routing) and tid2eid (hash routing)")
    with pytest.raises(EngramError) as exc:
        decode.moe_route(torch.zeros(2, 8), top_k=2, score_fn="sigmoid", scaling=1.0, bias=torch.zeros(7))
    _one_line(exc, "bias must be a contiguous [8] (got (7,))")
    with pytest.raises(EngramError) as exc:
        decode.moe_route(
            torch.zeros(2, 8),
            top_k=2,
            score_fn="sigmoid",
            scaling=1.0,
            tid2eid=torch.zeros(9, 3, dtype=torch.int64),
            input_ids=torch.zeros(2, dtype=torch.int64),
        )
    _one_line(exc, "tid2eid must be a contiguous [vocab, 2] and input_ids [2] (got (9, 3), (2,))")
    with pytest.raises(EngramError) as exc:
        decode.moe_route(torch.zeros(2, 8), top_k=2, score_fn="sigmoid", scaling=1.0, bias=torch.zeros(8))
    _one_line(exc, "logits must be a CUDA tensor (got device cpu)")
    assert not decode.gemv_fits(x, w)  # a CPU tensor


# --- the model's choice of path ---------------------------------------------------------------------


def test_fused_path_says_why_not_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from engram_trt.models.deepseek_v4 import fused

    assert fused.unavailable(torch.zeros(1, 8, dtype=torch.bfloat16)) == "the activations are on cpu, not a CUDA device"
    monkeypatch.setenv(fused.FUSED_ENV, "0")
    assert fused.unavailable(torch.zeros(1, 8)) == "ENGRAM_TRT_DSV4_FUSED=0"


def test_normed_collapses_are_the_collapse_then_the_norm_on_the_cpu() -> None:
    from engram_trt.models.deepseek_v4.modules import HyperConnection, HyperHead, RMSNorm

    cfg = SimpleNamespace(hc_mult=3, hidden_size=24, hc_sinkhorn_iters=4, hc_eps=1e-6, rms_norm_eps=1e-6)
    conn, head, norm = HyperConnection(cfg), HyperHead(cfg), RMSNorm(24, 1e-5)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in [*conn.parameters(), *head.parameters(), *norm.parameters()]:
            p.copy_(torch.randn(p.shape, generator=g) * 0.5 + (1.0 if p is norm.weight else 0.0))
        x = torch.randn(5, 3, 24, generator=g, dtype=torch.float64).to(torch.bfloat16)
        got, want = conn.collapse_normed(x, norm), conn.collapse(x)
        assert torch.equal(got[0], norm(want[0])) and torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
        assert torch.equal(head.forward_normed(x, norm), norm(head(x)))
