"""The decode step's latency-bound kernels in their fast forms against their general
forms (the forms before them, kept behind an environment switch) on the same inputs,
with the kernel times of both noted (CUDA graphs of 50 launches, events around the
replay):

1. ``engram_norm_rope`` with the row in registers (``ENGRAM_TRT_NORM_ROPE_REGS``, default)
   against the general form (``=0``), at the 1.63B bench's widths (q_a 768, kv 256, q 16
   heads of 256, the inverse RoPE) and at the form's edges (rows of 2048, 2050 and odd
   widths, which take the general form in both): without a norm bit for bit (the same
   float32 ops on the same values); with one, the two sum the squares in other orders, so
   ``|a - b| <= (2u + 1e-5) (|b| + t)`` (one ulp of the normed value may flip, then the
   rotation's rounding; t the rotation's terms ``(|y0| + |y1|)(|c| + |s|)``; 4u on t for
   the unweighted norm, whose reciprocal RMS is rounded first; u = 2^-8 bf16, 2^-11 fp16).
2. ``engram_dsv4_attention``'s attend with 16-byte key vectors in batches
   (``ENGRAM_TRT_DSV4_ATTEND_VEC``, default for bf16 / fp16 and head_dim % 8 == 0) against
   the scalar attend (``=0``) at the bench's widths (head_dim 256 and 512, a 128-key window,
   a CSA layer that drops entries, an HCA layer): the states bit for bit (the same kernels
   write them); the outputs within ``2u |b| + (2u + 1e-4)(1 + u) max|k|``: each
   probability is rounded to the I/O type after float32 sums taken in another order, so
   it may flip one ulp (2u p) beside the float32 differences (1e-4 p covers them, the dot
   products' order at these widths moves a score by ~1e-6), the probabilities sum to at
   most (1 + u), and the output's own rounding may flip one ulp.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest

from .helpers import cuda_normal, env, excess, note

UNIT = {"bfloat16": 2.0**-8, "float16": 2.0**-11, "float32": 0.0}


def _graph_us(fn: Callable[[], Any], reps: int = 50) -> float:
    """Microseconds a call of ``fn`` takes inside a CUDA graph of ``reps`` calls."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(reps):
                fn()
    graph.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(5):
        graph.replay()
    b.record()
    torch.cuda.synchronize()
    return float(a.elapsed_time(b)) * 1000.0 / (5 * reps)


# --- 1. norm_rope ----------------------------------------------------------------------------------------


def _norm_jobs(rng, dname: str, T: int, H: int, d: int, pairs: int, lora: int):
    """The attention's three norm_rope launches at one width: (name, jobs, outs, unit-bound kinds)."""
    import torch

    from engram_trt.native import decode

    Job = decode.NormRopeJob
    dtype = getattr(torch, dname)
    cos, sin = cuda_normal(rng, (T, pairs)).cos() * 1.1, cuda_normal(rng, (T, pairs)).sin() * 1.1
    x = cuda_normal(rng, (T, lora), 2.0, dname)
    kv = cuda_normal(rng, (T, d), 1.5, dname)
    q = cuda_normal(rng, (T, H * d), 3.0, dname)
    o = cuda_normal(rng, (T, H * d), 1.0, dname)
    w1, w2 = cuda_normal(rng, (lora,), 0.3) + 1.0, cuda_normal(rng, (d,), 0.3) + 1.0
    outs = [
        torch.empty(T, lora, dtype=dtype, device="cuda"),
        torch.empty(T, d, dtype=dtype, device="cuda"),
        torch.empty_like(q),
        torch.empty_like(o),
    ]
    launches = [
        (
            "q_a + kv",
            [
                Job(x, outs[0], dim=lora, norm=decode.NORM_WEIGHTED, weight=w1, eps=1e-6),
                Job(
                    kv,
                    outs[1],
                    dim=d,
                    norm=decode.NORM_WEIGHTED,
                    weight=w2,
                    eps=1e-6,
                    rope_pairs=pairs,
                    cos=cos,
                    sin=sin,
                ),
            ],
        ),
        (
            "q heads",
            [
                Job(
                    q,
                    outs[2],
                    dim=d,
                    heads=H,
                    norm=decode.NORM_UNWEIGHTED,
                    eps=1e-6,
                    rope_pairs=pairs,
                    cos=cos,
                    sin=sin,
                )
            ],
        ),
        ("inverse rope", [Job(o, outs[3], dim=d, heads=H, rope_pairs=pairs, cos=cos, sin=sin, rope_sign=-1)]),
    ]
    return launches, outs, cos, sin


def _rope_terms(y, d: int, pairs: int, cos, sin, heads: int):
    """The rotation's terms (|y0| + |y1|)(|c| + |s|) per channel of y [T, heads * d] (|y| elsewhere)."""
    T = y.shape[0]
    v = y.double().abs().view(T, heads, d).clone()
    if pairs:
        cs = (cos.to(y.dtype).double().abs() + sin.to(y.dtype).double().abs()).unsqueeze(1)
        rot = v[..., d - 2 * pairs :]
        pair = (rot[..., 0::2] + rot[..., 1::2]) * cs
        v[..., d - 2 * pairs :] = pair.repeat_interleave(2, dim=-1)
    return v.view(T, heads * d)


@pytest.mark.parametrize("dname", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize(
    "T,H,d,pairs,lora", [(1, 16, 256, 32, 768), (3, 3, 130, 5, 2048), (2, 2, 66, 4, 2050), (2, 5, 27, 6, 31)]
)
def test_norm_rope_register_form_equals_the_general_form(rng, dname, T, H, d, pairs, lora) -> None:
    import torch

    from engram_trt.native import decode

    u = UNIT[dname]
    tag = f"T {T} H {H} d {d} pairs {pairs} q_a {lora} {dname}"
    launches, outs, cos, sin = _norm_jobs(rng, dname, T, H, d, pairs, lora)
    got: dict[str, list[Any]] = {}
    times: dict[str, dict[str, float]] = {}
    for form, value in (("registers", "1"), ("general", "0")):
        with env("ENGRAM_TRT_NORM_ROPE_REGS", value), torch.no_grad():
            for _name, jobs in launches:
                decode.norm_rope(*jobs)
            torch.cuda.synchronize()
            got[form] = [o.clone() for o in outs]
            times[form] = {name: _graph_us(lambda jobs=jobs: decode.norm_rope(*jobs)) for name, jobs in launches}
    a, b = got["registers"], got["general"]
    for i, (name, dim, heads, kind) in enumerate(
        (("q_a", lora, 1, "w"), ("kv", d, 1, "w"), ("q", d, H, "u"), ("inverse rope", d, H, "none"))
    ):
        if kind == "none":
            assert torch.equal(a[i], b[i]), f"{name}: register form = general form bit for bit, {tag}"
            continue
        rp = 0 if name == "q_a" else pairs
        terms = _rope_terms(b[i], dim, rp, cos, sin, heads)
        tu = (4 * u if kind == "u" else 2 * u) + 1e-5
        err = excess(a[i], b[i], (2 * u + 1e-5) * b[i].double().abs() + tu * terms + 1e-30)
        assert err <= 0 and bool(torch.isfinite(a[i]).all()), (
            f"{name}: register form within one flip of the general form, {tag}: max excess {err:.3g}"
        )
    note(f"norm_rope us ({tag})", times)


# --- 3. the attention's attend ---------------------------------------------------------------------------


def _attention_inputs(
    torch, rng, layer_type: int, dname: str, d: int, H: int, W: int, r: int, topk: int, pasts: list[int]
) -> tuple[list[Any], dict[str, Any]]:
    """Random inputs of a decode step (one token a sequence, past lengths ``pasts``) in op order."""
    from engram_trt.native.dsv4_attention import CSA, SLIDING

    S = len(pasts)
    T = S
    N = S + 1
    slots = list(range(1, S + 1))
    E = max(pasts) // max(r, 1) + 8
    cuda = lambda a: a.to("cuda")  # noqa: E731
    io = lambda shape, s=1.0: cuda_normal(rng, shape, s, dname)  # noqa: E731
    f32 = lambda shape, s=1.0: cuda_normal(rng, shape, s)  # noqa: E731
    i32 = lambda v: cuda(torch.tensor(v, dtype=torch.int32))  # noqa: E731
    inputs = [io((T, H, d)), io((T, d)), f32((H,)), i32(list(range(S + 1))), i32(pasts), i32(slots), io((N, W, d))]
    if layer_type != SLIDING:
        csa = layer_type == CSA
        w, R = (2 * d, 2 * r) if csa else (d, r)
        P = 16
        inv = cuda(torch.from_numpy((10000.0 ** (-np.arange(P) / P)).astype(np.float32)))
        inputs += [
            io((T, w)),
            io((T, w)),
            f32((r, w), 0.1),
            f32((d,), 0.3) + 1.0,
            inv,
            io((N, E, d)),
            io((N, R, w)),
            io((N, R, w)),
        ]
        if csa:
            NI, di = 8, 64
            inputs += [
                io((T, NI, di)),
                f32((T, NI), 0.2),
                io((T, 2 * di)),
                io((T, 2 * di)),
                f32((r, 2 * di), 0.1),
                f32((di,), 0.3) + 1.0,
                io((N, E, di)),
                io((N, 2 * r, 2 * di)),
                io((N, 2 * r, 2 * di)),
            ]
    fields = dict(
        layer_type=layer_type,
        window=W,
        compress_rate=r if layer_type != SLIDING else 0,
        index_topk=topk if layer_type == CSA else 0,
        scaling=d**-0.5,
        eps=1e-6,
        rope_scale=1.0,
    )
    return inputs, fields


@pytest.mark.parametrize("dname", ["bfloat16", "float16"])
@pytest.mark.parametrize("kind,d", [("sliding", 256), ("sliding", 512), ("csa", 256), ("hca", 512)])
def test_attend_vectors_equal_the_scalar_attend(rng, dname, kind, d) -> None:
    import torch

    from engram_trt.native.dsv4_attention import CSA, HCA, SLIDING, STATE_INPUTS, dsv4_attention

    layer_type = {"sliding": SLIDING, "csa": CSA, "hca": HCA}[kind]
    H, W = 16, 128
    r = {"sliding": 0, "csa": 4, "hca": 128}[kind]
    pasts = [700, 5, 130] if kind != "hca" else [2000, 300]
    inputs, fields = _attention_inputs(torch, rng, layer_type, dname, d, H, W, r, 64, pasts)
    u = UNIT[dname]
    tag = f"{kind} head_dim {d} {dname}"
    outs: dict[str, Any] = {}
    states: dict[str, list[Any]] = {}
    times: dict[str, float] = {}
    for form, value in (("vectors", "1"), ("scalar", "0")):
        with env("ENGRAM_TRT_DSV4_ATTEND_VEC", value), torch.no_grad():
            mine = [t.clone() for t in inputs]
            outs[form] = dsv4_attention(*mine, **fields)
            torch.cuda.synchronize()
            states[form] = [mine[i] for i in STATE_INPUTS if i < len(mine)]
            # the step repeated in a graph rewrites the same rows (the window ring: the step's own key)
            timed = [t.clone() for t in inputs]
            times[form] = _graph_us(lambda timed=timed: dsv4_attention(*timed, **fields), reps=20)
    a, b = outs["vectors"], outs["scalar"]
    same_states = all(torch.equal(x, y) for x, y in zip(states["vectors"], states["scalar"]))
    assert same_states, f"states: vectors = scalar bit for bit, {tag}"
    keys = [inputs[1], inputs[6]] + ([states["scalar"][1]] if layer_type != SLIDING else [])
    kmax = max(float(k.double().abs().max()) for k in keys)
    err = excess(a, b, 2 * u * b.double().abs() + (2 * u + 1e-4) * (1 + u) * kmax)
    assert err <= 0 and bool(torch.isfinite(a).all()), (
        f"out: vectors within one probability flip of scalar, {tag}: max excess {err:.3g} (max|k| {kmax:.3g})"
    )
    note(f"attention us ({tag})", times)


# --- 4. stored-format projections of the fused glue ------------------------------------------------------


def _quant_linear(torch, rng, K: int, N: int, kind: str):
    from engram_trt.quant.formats import quantize_fp4, quantize_fp8
    from engram_trt.quant.weight import QuantLinear

    w = torch.from_numpy((rng.standard_normal((N, K)) / np.sqrt(K)).astype(np.float32))
    q, s = quantize_fp8(w, (128, 128), "ue8m0") if kind == "fp8" else quantize_fp4(w)
    block = (128, 128) if kind == "fp8" else (1, 32)
    mod = QuantLinear(K, N, kind, block, "ue8m0")
    mod.weight = q
    mod.weight_scale_inv = s
    return mod.cuda()


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("kind", ["fp8", "fp4"])
def test_stored_format_projections_equal_the_modules(rng, kind, T) -> None:
    """fused.project's stored-format path (native.quant.linear with weight_static) against
    each QuantLinear's own forward (the same kernels, the same activation quantization:
    bit for bit), and the quantized MoE branch's shared expert (gate / up / down through
    project, the clamped SwiGLU between) against ClampedSwiGLU.forward on the same
    QuantLinears, bit for bit; D 2048, I 1024 (the bench's widths) and 1 / 3 rows."""
    import torch
    import torch.nn.functional as F

    from engram_trt.models.deepseek_v4 import fused
    from engram_trt.models.deepseek_v4.modules import ClampedSwiGLU

    D, I, limit = 2048, 1024, 7.0
    shared = ClampedSwiGLU(D, I, limit)
    shared.gate_proj = _quant_linear(torch, rng, D, I, kind)
    shared.up_proj = _quant_linear(torch, rng, D, I, kind)
    shared.down_proj = _quant_linear(torch, rng, I, D, kind)
    x = cuda_normal(rng, (T, D), 1.0, "bfloat16")
    with torch.no_grad():
        gate, up = fused.project(x, [shared.gate_proj, shared.up_proj])
        same = torch.equal(gate, shared.gate_proj(x)) and torch.equal(up, shared.up_proj(x))
        h = F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)
        got = fused.project(h, [shared.down_proj])[0]
        want = shared(x)
    torch.cuda.synchronize()
    assert same, f"{kind} T {T}: project's stored-format outputs = QuantLinear.forward bit for bit"
    assert torch.equal(got, want) and bool(torch.isfinite(got).all()), (
        f"{kind} T {T}: the shared expert through project = ClampedSwiGLU.forward bit for bit"
    )
