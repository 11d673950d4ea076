"""The packed-attention kernel and the EngramAttention plugin on a GPU (formerly
scripts/h200_attention_check.py; its timing against torch SDPA is ``engram-trt bench
attention``):

  kernel     engram_attention_step / _packed / engram_kv_cache_write through
             engram_trt.native.attention, bf16 / fp16 / fp32, against a float64 NumPy
             reference on random data: mixed packs (prefill chunks after a past, decode
             tokens, a token at position 0, non-contiguous slots, padding tokens), MHA /
             GQA / MQA, head dims 8..256, a group of 20 query heads (three head blocks);
             each case also through the tiled kernel (ENGRAM_TRT_ATTENTION_KERNEL=tiled;
             the warp kernel serves bf16 / fp16 at head_dim 128 with groups of up to 4 on
             sm_90; attention_kernels.warp_kernel_serves, its Python mirror, must name the
             kernel each case launched), small steps whose keys are split
             (flash-decoding) against the unsplit kernel, a sequence that continues over
             three steps; the in-place KV write bit for bit (the rest of the cache
             untouched); out-of-cache slots and positions (zero rows, nothing written, no
             fault); repeat runs bit-identical.
  plugin     EngramAttention through its creator and the plugin harness: output types and
             shapes, getAliasedInput (caches aliased, build capability version 2), a
             serialize -> createPlugin(kRUNTIME) round trip, enqueue with the cache outputs
             aliased to the inputs (in place) and with separate output buffers (the copy
             fallback: the inputs stay untouched), workspace size, refused fields.
  timed data the timed shapes of ``benchmarks/kernels/bench_attention.py`` (decode 1 x 4k, 64 x 256,
             64 x 4k, 256 x 4k; one 8k prefill chunk; bf16, 32 query / 8 KV heads of 128):
             this kernel against torch SDPA on the same data, relative norm < 1e-2.

Tolerances against the float64 reference on the same (rounded) inputs, elementwise:
bf16 |out - ref| <= 2^-8 |ref| + 2^-12 max|ref| (one bf16 ulp), fp16 <= 2^-10 |ref| +
2^-14 max|ref|, fp32 <= 2e-6 max|ref| + 2e-6 |ref| (fp32 sums over up to 8k keys).
"""

from __future__ import annotations

import ctypes
import math
import os

import numpy as np
import pytest

from .cases import ATTENTION_CASES

from .helpers import Checks, Harness, say  # (Harness: the CPU suite binds the harness through this module)

DTYPES = ["bfloat16", "float16", "float32"]


# --- float64 reference -------------------------------------------------------------------


def reference_step(q, k, v, key_cache, value_cache, slots, positions, scale):
    """(out [T, H, hd] float64, new key cache, new value cache) of one step, in float64 on
    the given (already rounded) values; out-of-cache tokens write nothing, output zero."""
    T, H, hd = q.shape
    num_slots, kvh, max_len, _ = key_cache.shape
    group = H // kvh
    kc, vc = key_cache.copy(), value_cache.copy()
    valid = (slots >= 0) & (slots < num_slots) & (positions >= 0) & (positions < max_len)
    for t in np.nonzero(valid)[0]:
        kc[slots[t], :, positions[t]] = k[t]
        vc[slots[t], :, positions[t]] = v[t]
    out = np.zeros((T, H, hd))
    for t in np.nonzero(valid)[0]:
        keys = kc[slots[t], :, : positions[t] + 1].astype(np.float64)  # [kvh, P, hd]
        vals = vc[slots[t], :, : positions[t] + 1].astype(np.float64)
        qt = q[t].astype(np.float64).reshape(kvh, group, hd)
        scores = np.einsum("kgd,kpd->kgp", qt, keys) * scale
        scores -= scores.max(axis=-1, keepdims=True)
        p = np.exp(scores)
        p /= p.sum(axis=-1, keepdims=True)
        out[t] = np.einsum("kgp,kpd->kgd", p, vals).reshape(H, hd)
    return out, kc, vc


def bound(dtype_name: str, ref: np.ndarray) -> np.ndarray:
    scale = float(np.abs(ref).max()) if ref.size else 0.0
    if dtype_name == "bfloat16":
        return 2.0**-8 * np.abs(ref) + 2.0**-12 * scale
    if dtype_name == "float16":
        return 2.0**-10 * np.abs(ref) + 2.0**-14 * scale
    return 2e-6 * scale + 2e-6 * np.abs(ref)


def compare(name: str, out, ref: np.ndarray, dtype_name: str) -> tuple[bool, str]:
    got = out.float().cpu().numpy().astype(np.float64)
    if got.shape != ref.shape:
        return False, f"shape {got.shape} != {ref.shape}"
    err = np.abs(got - ref)
    b = bound(dtype_name, ref)
    finite = bool(np.isfinite(got).all())
    ok = finite and bool(np.all(err <= b))
    return (
        ok,
        f"max|err|={err.max():.3g} worst err/bound={float((err / np.maximum(b, 1e-30)).max()):.3f} finite={finite}",
    )


# --- random packs ------------------------------------------------------------------------


def random_pack(rng, num_slots: int, max_len: int, chunks: list[tuple[int, int]], slots=None):
    """Token slots / positions of sequences given as (past, new tokens), back to back, in
    distinct random slots (not in order); returns (slots, positions, seq_starts, seq_slots)."""
    seq_slots = rng.permutation(num_slots)[: len(chunks)] if slots is None else np.asarray(slots)
    tok_slots, tok_pos, starts = [], [], [0]
    for (past, n), s in zip(chunks, seq_slots):
        assert past + n <= max_len
        tok_slots += [int(s)] * n
        tok_pos += list(range(past, past + n))
        starts.append(starts[-1] + n)
    return np.asarray(tok_slots, np.int32), np.asarray(tok_pos, np.int32), np.asarray(starts), seq_slots


def tensors(rng, torch, dtype, T, H, kvh, hd, num_slots, max_len, dev):
    def rand(*shape):
        return torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(dtype)

    q, k, v = rand(T, H, hd), rand(T, kvh, hd), rand(T, kvh, hd)
    kc, vc = rand(num_slots, kvh, max_len, hd), rand(num_slots, kvh, max_len, hd)  # stale contents everywhere
    return q, k, v, kc, vc


def as64(t) -> np.ndarray:
    return t.float().cpu().numpy().astype(np.float64)


def bits(t):
    import torch

    return t.cpu().contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


# --- 2. kernel ------------------------------------------------------------------------------


def launched_kernels(fn) -> list[str]:
    """Names of the GPU kernels one call of ``fn`` launched (the profiler)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.key for e in prof.key_averages()]


def tiled_kernel():
    """While open, the library runs the tiled attention kernel (ENGRAM_TRT_ATTENTION_KERNEL=tiled,
    read at each launch) instead of the warp kernel it picks for 16-bit I/O and head dims
    64 / 128 / 256."""
    from unittest import mock

    return mock.patch.dict(os.environ, {"ENGRAM_TRT_ATTENTION_KERNEL": "tiled"})


# (label, H, kvh, hd, slots, max_len, [(past, new tokens) per sequence])
MIXED = [(0, 37), (120, 1), (0, 1), (511, 1), (64, 90), (300, 1), (1, 1), (200, 55)]
KERNEL_CASES = [
    ("GQA 32/8 hd128 mixed", 32, 8, 128, 12, 640, MIXED),
    ("GQA 16/8 hd128 mixed (groups of 2)", 16, 8, 128, 12, 640, MIXED),
    ("MHA 4/4 hd128", 4, 4, 128, 6, 300, [(0, 40), (250, 1), (31, 33), (0, 1)]),
    ("MHA 8/8 hd64 mixed", 8, 8, 64, 10, 512, [(0, 20), (33, 1), (100, 7), (0, 1)]),
    ("MQA 16/1 hd128", 16, 1, 128, 6, 700, [(0, 64), (650, 1), (10, 30)]),
    ("GQA 12/4 hd256", 12, 4, 256, 5, 400, [(0, 33), (399, 1), (150, 40)]),
    ("GQA 40/2 hd64 (groups of 20: 3 head blocks)", 40, 2, 64, 4, 300, [(0, 17), (250, 1), (100, 3)]),
    ("hd8 4/2", 4, 2, 8, 3, 64, [(0, 5), (40, 1)]),
    ("hd96 6/3", 6, 3, 96, 4, 200, [(0, 70), (150, 1), (77, 12)]),
]


@pytest.mark.parametrize("case", KERNEL_CASES, ids=[c[0] for c in KERNEL_CASES])
@pytest.mark.parametrize("dname", DTYPES)
def test_kernel(rng, dname, case) -> None:
    import torch

    from engram_trt.native import attention as attention_kernels
    from engram_trt.native import library as kernel_library

    dev = torch.device("cuda")
    say(f"library {kernel_library.library_path()} version {kernel_library.version()}")
    dtype = getattr(torch, dname)
    label, H, kvh, hd, num_slots, max_len, chunks = case
    slots, pos, _, _ = random_pack(rng, num_slots, max_len, chunks)
    T = slots.shape[0]
    q, k, v, kc, vc = tensors(rng, torch, dtype, T, H, kvh, hd, num_slots, max_len, dev)
    scale = 1.0 / math.sqrt(hd)
    ref, ref_k, ref_v = reference_step(as64(q), as64(k), as64(v), as64(kc), as64(vc), slots, pos, scale)
    kc_d, vc_d = kc.to(dev), vc.to(dev)
    out = torch.full((T, H, hd), float("nan"), dtype=dtype, device=dev)
    attention_kernels.attention_step(
        q.to(dev),
        k.to(dev),
        v.to(dev),
        kc_d,
        vc_d,
        torch.from_numpy(slots).to(dev),
        torch.from_numpy(pos).to(dev),
        scale=scale,
        out=out,
    )
    torch.cuda.synchronize()
    ok, detail = compare(label, out, ref, dname)
    assert ok, f"kernel step {dname} {label} T={T}: {detail}"
    # the write: exactly the rounded k / v rows at (slot, pos), nothing else touched
    want_k = kc.clone()
    want_v = vc.clone()
    for t in range(T):
        want_k[slots[t], :, pos[t]] = k[t]
        want_v[slots[t], :, pos[t]] = v[t]
    same = torch.equal(bits(kc_d), bits(want_k)) and torch.equal(bits(vc_d), bits(want_v))
    assert same, f"kernel KV write {dname} {label}: rows bit-exact, the rest untouched"
    # the two halves alone give the same bits as the step
    kc2, vc2 = kc.to(dev), vc.to(dev)
    ts, tp = torch.from_numpy(slots).to(dev), torch.from_numpy(pos).to(dev)
    attention_kernels.kv_cache_write(k.to(dev), v.to(dev), kc2, vc2, ts, tp)
    out2 = attention_kernels.attention_packed(q.to(dev), kc2, vc2, ts, tp, scale=scale)
    out3 = attention_kernels.attention_packed(q.to(dev), kc2, vc2, ts, tp, scale=scale)
    torch.cuda.synchronize()
    # The Python mirror of the library's kernel choice (the decode graphs pick their
    # attention path by it) names the kernel that ran.
    qd = q.to(dev)
    ran = launched_kernels(lambda: attention_kernels.attention_packed(qd, kc2, vc2, ts, tp, scale=scale))
    warp = any("warpAttentionKernel" in n for n in ran)
    predicted = attention_kernels.warp_kernel_serves(qd, H, kvh)
    assert predicted == warp, (
        f"kernel choice {dname} {label}: warp_kernel_serves() == the kernel launched: "
        f"predicted {'warp' if predicted else 'tiled'}, ran {'warp' if warp else 'tiled'}"
    )
    with tiled_kernel():
        tiled = attention_kernels.attention_packed(q.to(dev), kc2, vc2, ts, tp, scale=scale)
    torch.cuda.synchronize()
    ok, detail = compare(label, tiled, ref, dname)
    assert ok, f"kernel tiled (ENGRAM_TRT_ATTENTION_KERNEL=tiled) {dname} {label} T={T}: {detail}"
    assert (
        torch.equal(bits(out2), bits(out))
        and torch.equal(bits(out3), bits(out2))
        and torch.equal(bits(kc2), bits(kc_d))
    ), f"kernel write + packed == step, repeat bit-identical {dname} {label}"


@pytest.mark.parametrize("dname", DTYPES)
def test_boundaries(rng, dname) -> None:
    """Out-of-cache slots / positions: zero rows, nothing written, no fault; position 0 and
    the last position of the cache; a token alone at position 0 returns its own value."""
    import torch

    from engram_trt.native import attention as attention_kernels

    dev = torch.device("cuda")
    H, kvh, hd, num_slots, max_len = 8, 2, 128, 4, 96
    slots = np.array([0, 3, -1, 4, 2, 1, 2, 2**31 - 1, 1], np.int32)
    pos = np.array([0, max_len - 1, 5, 5, -1, max_len, 7, 0, 3], np.int32)
    bad = np.array([False, False, True, True, True, True, False, True, False])
    dtype = getattr(torch, dname)
    T = slots.shape[0]
    q, k, v, kc, vc = tensors(rng, torch, dtype, T, H, kvh, hd, num_slots, max_len, dev)
    ref, _, _ = reference_step(as64(q), as64(k), as64(v), as64(kc), as64(vc), slots, pos, 1 / math.sqrt(hd))
    kc_d, vc_d = kc.to(dev), vc.to(dev)
    out = torch.full((T, H, hd), float("nan"), dtype=dtype, device=dev)
    attention_kernels.attention_step(
        q.to(dev),
        k.to(dev),
        v.to(dev),
        kc_d,
        vc_d,
        torch.from_numpy(slots).to(dev),
        torch.from_numpy(pos).to(dev),
        out=out,
    )
    torch.cuda.synchronize()  # raises on a fault
    zero = int(torch.count_nonzero(out[torch.from_numpy(bad).to(dev)]).item()) == 0
    ok, detail = compare("bounds", out, ref, dname)
    want_k, want_v = kc.clone(), vc.clone()
    for t in np.nonzero(~bad)[0]:
        want_k[slots[t], :, pos[t]] = k[t]
        want_v[slots[t], :, pos[t]] = v[t]
    untouched = torch.equal(bits(kc_d), bits(want_k)) and torch.equal(bits(vc_d), bits(want_v))
    # token 0 sits at position 0: its output is its own value row (softmax of one key)
    own = torch.equal(bits(out[0]), bits(v[0].repeat_interleave(H // kvh, dim=0)))
    assert zero and ok and untouched and own, (
        f"kernel bounds {dname}: out-of-cache slots/positions give zero rows and write nothing: "
        f"{detail} zero-rows={zero} cache-as-expected={untouched} "
        f"pos0-is-own-value={own}"
    )


@pytest.mark.parametrize("dname", DTYPES)
def test_splits(rng, dname) -> None:
    """Steps of few tokens at long contexts split their keys (flash-decoding): they must
    match the reference and the unsplit kernel (ABI call with no workspace)."""
    import torch

    from engram_trt.native import attention as attention_kernels
    from engram_trt.native import library as kernel_library

    dev = torch.device("cuda")
    lib = attention_kernels.library()
    H, kvh, hd, num_slots, max_len = 32, 8, 128, 6, 4096
    dtype = getattr(torch, dname)
    for chunks in ([(4095, 1)], [(3000, 1), (17, 1), (4000, 1)], [(2500, 3), (0, 1)]):
        slots, pos, _, _ = random_pack(rng, num_slots, max_len, chunks)
        T = slots.shape[0]
        ws = attention_kernels.attention_workspace_size(T, H, kvh, hd, max_len)
        q, k, v, kc, vc = tensors(rng, torch, dtype, T, H, kvh, hd, num_slots, max_len, dev)
        ref, _, _ = reference_step(as64(q), as64(k), as64(v), as64(kc), as64(vc), slots, pos, 1 / math.sqrt(hd))
        ts, tp = torch.from_numpy(slots).to(dev), torch.from_numpy(pos).to(dev)
        kc_d, vc_d, q_d = kc.to(dev), vc.to(dev), q.to(dev)
        out = attention_kernels.attention_step(q_d, k.to(dev), v.to(dev), kc_d, vc_d, ts, tp)
        unsplit = torch.full_like(out, float("nan"))
        status = lib.engram_attention_packed(
            ctypes.c_void_p(q_d.data_ptr()),
            kernel_library.float_code(dtype),
            ctypes.c_void_p(kc_d.data_ptr()),
            ctypes.c_void_p(vc_d.data_ptr()),
            ctypes.c_void_p(ts.data_ptr()),
            ctypes.c_void_p(tp.data_ptr()),
            T,
            H,
            kvh,
            hd,
            num_slots,
            max_len,
            ctypes.c_float(1 / math.sqrt(hd)),
            None,
            0,
            ctypes.c_void_p(unsplit.data_ptr()),
            ctypes.c_void_p(torch.cuda.current_stream().cuda_stream),
        )
        torch.cuda.synchronize()
        ok, detail = compare("split", out, ref, dname)
        ok2, detail2 = compare("unsplit", unsplit, ref, dname)
        assert status == 0 and ws > 0 and ok and ok2, (
            f"kernel key splits {dname} {chunks}: split (workspace {ws} B) and unsplit both match: "
            f"split {detail}; unsplit {detail2}"
        )


def test_continuation(rng) -> None:
    """One sequence over three steps (a prefill chunk, a second chunk, a decode token),
    sharing each step with other sequences, equals the reference of its whole history."""
    import torch

    from engram_trt.native import attention as attention_kernels

    dev = torch.device("cuda")
    H, kvh, hd, num_slots, max_len = 16, 8, 128, 8, 256
    dtype = torch.float32
    kc = torch.from_numpy(rng.standard_normal((num_slots, kvh, max_len, hd)).astype(np.float32))
    vc = torch.from_numpy(rng.standard_normal((num_slots, kvh, max_len, hd)).astype(np.float32))
    kc_ref, vc_ref = as64(kc), as64(vc)
    kc_d, vc_d = kc.to(dev), vc.to(dev)
    steps = [[(0, 40), (10, 1)], [(40, 25), (11, 1), (0, 3)], [(65, 1), (12, 1), (3, 1)]]
    slot_sets = [[5, 2], [5, 2, 0], [5, 2, 0]]
    ok_all, details = True, []
    for chunks, seq_slots in zip(steps, slot_sets):
        slots, pos, _, _ = random_pack(rng, num_slots, max_len, chunks, slots=seq_slots)
        T = slots.shape[0]
        q, k, v, _, _ = tensors(rng, torch, dtype, T, H, kvh, hd, 1, 1, dev)
        ref, kc_ref, vc_ref = reference_step(as64(q), as64(k), as64(v), kc_ref, vc_ref, slots, pos, 1 / math.sqrt(hd))
        out = attention_kernels.attention_step(
            q.to(dev), k.to(dev), v.to(dev), kc_d, vc_d, torch.from_numpy(slots).to(dev), torch.from_numpy(pos).to(dev)
        )
        torch.cuda.synchronize()
        ok, detail = compare("continuation", out, ref, "float32")
        ok_all &= ok
        details.append(detail)
    assert ok_all, "kernel a sequence continuing over three mixed steps: " + " | ".join(details)


# --- plugin through the harness -----------------------------------------------------------

PF_FLOAT32, PF_INT32, PF_INT64 = 1, 5, 10
DT = {"float32": 0, "float16": 1, "int32": 3, "bool": 4, "bfloat16": 7, "int64": 8}


def attention_fields(H, kvh, hd, scale, **override):
    fields = {
        "num_heads": (PF_INT32, np.array([H], np.int32)),
        "num_kv_heads": (PF_INT32, np.array([kvh], np.int32)),
        "head_dim": (PF_INT32, np.array([hd], np.int32)),
        "scale": (PF_FLOAT32, np.array([scale], np.float32)),
    }
    fields.update(override)
    return [(name, ftype, data) for name, (ftype, data) in fields.items()]


PLUGIN_CPU_CHECKS = [
    "plugin EngramAttention getOutputShapes",
    "plugin EngramAttention getOutputDataTypes: every output q's type",
    "plugin EngramAttention refuses caches of another type than q",
    "plugin EngramAttention getAliasedInput: cache outputs alias the cache inputs (build capability v2)",
    "plugin EngramAttention serialize round trip",
    "plugin EngramAttention refuses bad fields",
]


def check_plugin_cpu(harness: Harness) -> Checks:
    """What TensorRT asks of EngramAttention before any enqueue (no GPU needed)."""
    checks = Checks()
    H, kvh, hd, S, L = 32, 8, 128, 6, 1024
    h = harness.create("EngramAttention", attention_fields(H, kvh, hd, hd**-0.5))
    in_shapes = [(50, H, hd), (50, kvh, hd), (50, kvh, hd), (S, kvh, L, hd), (S, kvh, L, hd), (50,), (50,)]
    shapes = harness.outputs_shapes(h, in_shapes, 3)
    checks.add(
        "plugin EngramAttention getOutputShapes", shapes == [(50, H, hd), (S, kvh, L, hd), (S, kvh, L, hd)], str(shapes)
    )
    types = {}
    for io in ("bfloat16", "float16", "float32"):
        types[io] = harness.outputs_types(h, [DT[io]] * 5 + [DT["int32"]] * 2, 3) == [DT[io]] * 3
    checks.add("plugin EngramAttention getOutputDataTypes: every output q's type", all(types.values()), str(types))
    try:
        harness.outputs_types(h, [DT["bfloat16"]] * 3 + [DT["float16"]] * 2 + [DT["int32"]] * 2, 3)
        checks.add("plugin EngramAttention refuses caches of another type than q", False, "accepted")
    except RuntimeError as exc:
        checks.add(
            "plugin EngramAttention refuses caches of another type than q", "share one type" in str(exc), str(exc)[:160]
        )
    aliases = [harness.aliased_input(h, o) for o in range(3)]
    checks.add(
        "plugin EngramAttention getAliasedInput: cache outputs alias the cache inputs (build capability v2)",
        aliases == [(-1, 2), (3, 2), (4, 2)],
        str(aliases),
    )
    h2 = harness.roundtrip(h)
    checks.add(
        "plugin EngramAttention serialize round trip",
        harness.outputs_shapes(h2, in_shapes, 3) == shapes and harness.aliased_input(h2, 1) == (3, 2),
    )
    harness.lib.harness_destroy(h2)
    harness.lib.harness_destroy(h)
    refused = {}
    for what, fields, needle in (
        ("num_heads % num_kv_heads != 0", attention_fields(6, 4, 64, 0.1), "positive multiple of num_kv_heads"),
        ("head_dim 12", attention_fields(8, 4, 12, 0.1), "multiple of 8"),
        ("head_dim 512", attention_fields(8, 4, 512, 0.1), "'head_dim' = 512 is outside [8, 256]"),
        ("scale 0", attention_fields(8, 4, 64, 0.0), "scale must be finite and > 0"),
        ("scale NaN", attention_fields(8, 4, 64, float("nan")), "scale must be finite and > 0"),
        (
            "num_heads 2^32 + 8 (int64)",
            attention_fields(8, 4, 64, 0.1, num_heads=(PF_INT64, np.array([2**32 + 8], np.int64))),
            "'num_heads' = 4294967304 is outside",
        ),
        (
            "an unknown field",
            attention_fields(8, 4, 64, 0.1) + [("window", PF_INT32, np.array([4], np.int32))],
            "unknown field(s) window",
        ),
    ):
        try:
            harness.lib.harness_destroy(harness.create("EngramAttention", fields))
            refused[what] = "accepted"
        except RuntimeError as exc:
            refused[what] = needle in str(exc) or str(exc)[:120]
    checks.add("plugin EngramAttention refuses bad fields", all(v is True for v in refused.values()), str(refused))
    return checks


@pytest.fixture(scope="module")
def plugin_cpu(harness) -> Checks:
    return check_plugin_cpu(harness)


@pytest.mark.parametrize("name", PLUGIN_CPU_CHECKS)
def test_plugin_cpu(plugin_cpu, name: str) -> None:
    ok, detail = plugin_cpu[name]
    assert ok, f"{name}: {detail}"


@pytest.mark.parametrize("phase_name", ["build", "runtime (round trip)"])
@pytest.mark.parametrize("dname", DTYPES)
def test_plugin_gpu(rng, harness, dname, phase_name) -> None:
    import torch

    from engram_trt.native import attention as attention_kernels

    dev = torch.device("cuda")
    stream = torch.cuda.current_stream().cuda_stream
    H, kvh, hd, S, L = 16, 4, 128, 7, 1200
    chunks = [(0, 50), (700, 1), (1199, 1), (64, 33), (3, 1)]
    dtype = getattr(torch, dname)
    slots, pos, _, _ = random_pack(rng, S, L, chunks)
    T = slots.shape[0]
    q, k, v, kc, vc = tensors(rng, torch, dtype, T, H, kvh, hd, S, L, dev)
    scale = hd**-0.5
    ref, ref_k, ref_v = reference_step(as64(q), as64(k), as64(v), as64(kc), as64(vc), slots, pos, scale)
    io = DT[dname]
    in_types = [io] * 5 + [DT["int32"]] * 2
    ts, tp = torch.from_numpy(slots).to(dev), torch.from_numpy(pos).to(dev)
    want_ws = attention_kernels.attention_workspace_size(T, H, kvh, hd, L)
    make = {"build": lambda h: h, "runtime (round trip)": harness.roundtrip}[phase_name]
    base = harness.create("EngramAttention", attention_fields(H, kvh, hd, scale))
    h = make(base)
    # in place: the cache outputs are the cache inputs (what the aliasing gives)
    kc_d, vc_d = kc.to(dev), vc.to(dev)
    out = torch.full((T, H, hd), float("nan"), dtype=dtype, device=dev)
    ws = harness.run_outputs(
        h, [q.to(dev), k.to(dev), v.to(dev), kc_d, vc_d, ts, tp], in_types, [out, kc_d, vc_d], [io] * 3, stream
    )
    torch.cuda.synchronize()
    ok, detail = compare("plugin", out, ref, dname)
    cache_ok = np.array_equal(as64(kc_d), ref_k) and np.array_equal(as64(vc_d), ref_v)
    assert ok and cache_ok and ws == want_ws, (
        f"plugin EngramAttention enqueue {dname} {phase_name}, caches aliased (in place): "
        f"{detail} caches-exact={cache_ok} workspace={ws} (want {want_ws})"
    )
    # separate output buffers: the plugin copies the cache over, the inputs stay untouched
    kc_in, vc_in = kc.to(dev), vc.to(dev)
    kc_out = torch.full_like(kc_in, float("nan"))
    vc_out = torch.full_like(vc_in, float("nan"))
    out2 = torch.full((T, H, hd), float("nan"), dtype=dtype, device=dev)
    harness.run_outputs(
        h, [q.to(dev), k.to(dev), v.to(dev), kc_in, vc_in, ts, tp], in_types, [out2, kc_out, vc_out], [io] * 3, stream
    )
    torch.cuda.synchronize()
    inputs_same = torch.equal(bits(kc_in), bits(kc)) and torch.equal(bits(vc_in), bits(vc))
    outputs_same = torch.equal(bits(kc_out), bits(kc_d)) and torch.equal(bits(vc_out), bits(vc_d))
    assert torch.equal(bits(out2), bits(out)) and inputs_same and outputs_same, (
        f"plugin EngramAttention enqueue {dname} {phase_name}, separate cache outputs (copy fallback): "
        f"inputs-untouched={inputs_same} outputs==in-place={outputs_same}"
    )
    if h != base:
        harness.lib.harness_destroy(h)
    harness.lib.harness_destroy(base)


# --- the timed shapes (their timing: benchmarks/kernels/bench_attention.py) -----------------------------


@pytest.mark.parametrize("label", list(ATTENTION_CASES))
def test_timed_shape_agrees_with_sdpa(label) -> None:
    """A case ``benchmarks/kernels/bench_attention.py`` times (tests/gpu/cases.py: ``batch``
    sequences, each bringing ``new`` tokens at the end of a ``context``-long history in
    its own slot): this kernel against SDPA on the same cache (slot = batch row, the new
    K/V already in it; padded [B, H, S, hd] with enable_gqa)."""
    import torch

    from .cases import attention_case
    from engram_trt.native import attention as attention_kernels

    c = attention_case(*ATTENTION_CASES[label], torch.device("cuda"))
    got = attention_kernels.attention_packed(c.q, c.kc, c.vc, c.slots, c.pos, scale=c.scale)
    want = c.sdpa()
    torch.cuda.synchronize()
    rel = float((got.float() - want.float()).norm() / want.float().norm())
    assert rel < 1e-2, f"timing outputs agree with SDPA ({label}): relative norm difference {rel:.2e}"
