"""Qwen4-Exp's QSA attention kernel (plugins/kernels/qsaAttentionKernel.cu, through
engram_trt.native.qsa) and its plugin (EngramQsaAttention) on a GPU.

- the kernel against the torch layer: GatedAttention (models/qwen4_exp/attention.py, every
  parameter random) runs its real ``forward`` on the CPU over packed steps that write the
  slot caches (prompts, a prefill chunk continuing beside a fresh prompt and a decode, a
  decode of three slots), its core taken before the gate (``torch.sigmoid`` patched to 1
  for the call, so nothing is divided back out); the kernel gets the same projections
  and its own copy of the caches. float32 ``|out - ref| <= 2e-5 max|ref|``, bf16 / fp16
  ``3e-2 max|ref|`` (the torch layer runs in that dtype too); caches bit-equal after every
  step. Each config has queries seeing more blocks than block_topk (the reference's
  selection is asserted to drop some) and the torch comparisons assert no top-k boundary
  tie (torch's top-k breaks ties its own way, the kernel's rule is lower index).
- decode sizes: 16 slots at ~1000 positions of random history, head_dim 256, GQA 8:
  the kernel = the torch layer's decode step (float32), its time noted.
- the float64 reference (models/qwen4_exp/reference_qsa.py) on the same inputs: float32 tight,
  padding tokens (slot / position outside the caches) zero rows and no writes, ties to
  the lower block index (all indexer queries zero).
- the plugin's enqueue (build phase, runtime after a round trip; caches aliased in place
  and in separate outputs) = the binding, bit for bit; check_plugin_cpu is shared with
  the CPU suite (tests/plugins/test_qsa_plugin.py).
"""

from __future__ import annotations

import contextlib
import time
from types import SimpleNamespace

import numpy as np
import pytest

from .helpers import DT, PF_FLOAT32, PF_INT32, PF_INT64, Checks, Harness, note, say  # (Harness: CPU suite)

DTYPES = ["float32", "bfloat16", "float16"]
TOLERANCE = {"float32": 2e-5, "bfloat16": 3e-2, "float16": 1e-2}
NUM_SLOTS = 5
# (hidden, H, KVH, hd, partial_rotary_factor, NI, di, budget, ratio, max_len)
CONFIGS = [(64, 4, 2, 32, 0.5, 4, 32, 8, 4, 64), (96, 8, 1, 64, 1.0, 8, 64, 24, 8, 160)]
STEPS = {  # (slot, past_len, new tokens) per sequence, per step
    64: [[(3, 0, 13), (0, 0, 29)], [(0, 29, 9), (1, 0, 6), (3, 13, 1)], [(0, 38, 1), (1, 6, 1), (3, 14, 1)]],
    160: [[(2, 0, 70), (4, 0, 41)], [(2, 70, 33), (0, 0, 9), (4, 41, 1)], [(2, 103, 1), (0, 9, 1), (4, 42, 1)]],
}


def make_config(hidden, H, KVH, hd, factor, NI, di, budget, ratio):
    return SimpleNamespace(
        hidden_size=hidden,
        num_attention_heads=H,
        num_key_value_heads=KVH,
        head_dim=hd,
        rms_norm_eps=1e-6,
        attention_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": factor},
        indexer_n_heads=NI,
        indexer_kv_heads=1,
        indexer_head_dim=di,
        indexer_budget=budget,
        indexer_compress_ratio=ratio,
    )


def random_layer(torch, cfg, seed: int):
    from engram_trt.models.qwen4_exp.attention import GatedAttention

    gen = torch.Generator().manual_seed(seed)
    layer = GatedAttention(cfg, 0).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return layer


def fields_of(cfg):
    from engram_trt.models.qwen4_exp.attention import rotary_dim
    from engram_trt.native.qsa import QsaFields

    r = cfg.indexer_compress_ratio
    return QsaFields(
        r,
        cfg.indexer_budget // r,
        rotary_dim(cfg),
        cfg.rope_parameters["rope_theta"],
        cfg.rms_norm_eps,
        cfg.head_dim**-0.5,
    )


def projections(torch, layer, x, positions):
    """The op's inputs as GatedAttention.forward makes them."""
    from engram_trt.models.qwen4_exp import attention as att

    t = x.shape[0]
    h, kvh, hd = layer.num_heads, layer.num_kv_heads, layer.head_dim
    cos, sin = att.rope_cos_sin(layer.config, positions)
    query, _ = layer.q_proj(x).reshape(t, h, 2 * hd).chunk(2, dim=-1)
    q = att.apply_partial_rope(layer.q_norm(query), cos, sin)
    k = att.apply_partial_rope(layer.k_norm(layer.k_proj(x).reshape(t, kvh, hd)), cos, sin)
    v = layer.v_proj(x).reshape(t, kvh, hd)
    iq, iraw = layer.indexer.project(x, cos, sin)
    return [q, k, v, iq, iraw]


@contextlib.contextmanager
def ungated(torch, layer):
    """forward's output is its attention core: o_proj the identity, sigmoid(gate) = 1."""
    o_proj, sigmoid = layer.o_proj, torch.sigmoid
    layer.o_proj = torch.nn.Identity()
    torch.sigmoid = torch.ones_like
    try:
        yield
    finally:
        layer.o_proj, torch.sigmoid = o_proj, sigmoid


def packed(step):
    starts, past, slots, tslot, tpos = [0], [], [], [], []
    for slot, p, n in step:
        starts.append(starts[-1] + n)
        past.append(p)
        slots.append(slot)
        tslot += [slot] * n
        tpos += list(range(p, p + n))
    return starts, past, slots, np.asarray(tslot, np.int32), np.asarray(tpos, np.int32)


def boundary_gaps(fields, iq, raw_cache, w, tslot, tpos) -> np.ndarray:
    """Per token, the gap between its block_topk-th and next best block score over its
    best score, from the float64 reference's selection on these inputs (inf: the token
    drops nothing, so it has no boundary)."""
    from engram_trt.models.qwen4_exp import reference_qsa as ref

    f = ref.QsaFields(
        fields.compress_ratio, fields.block_topk, fields.rot_dim, fields.rope_theta, fields.eps, fields.scaling
    )
    gaps = np.full(len(tslot), np.inf)
    for t, (s, p) in enumerate(zip(tslot.tolist(), tpos.tolist())):
        if (p + 1) // f.compress_ratio <= f.block_topk:
            continue
        top = np.sort(ref.block_scores(iq[t], ref.block_keys(raw_cache[s, : p + 1], w, f, None)))[::-1]
        gaps[t] = float(top[f.block_topk - 1] - top[f.block_topk]) / max(float(top[0]), 1e-30)
    return gaps


# The torch layer rounds the block keys in 16-bit types its own way; a query whose top-k
# boundary is closer than this (relative) may then keep another block: its row is left
# out of the 16-bit comparison (counted). float32 compares every row.
NEAR_TIE_16BIT = 2e-2


@pytest.mark.parametrize("dname", DTYPES)
@pytest.mark.parametrize("ci", range(len(CONFIGS)))
def test_kernel_matches_gated_attention(dname, ci) -> None:
    import torch

    from engram_trt.native import qsa

    hidden, H, KVH, hd, factor, NI, di, budget, ratio, L = CONFIGS[ci]
    cfg = make_config(hidden, H, KVH, hd, factor, NI, di, budget, ratio)
    dtype = getattr(torch, dname)
    layer = random_layer(torch, cfg, seed=10 + ci).to(dtype)
    fields = fields_of(cfg)
    gen = torch.Generator().manual_seed(100 + ci)
    shapes = [(NUM_SLOTS, KVH, L, hd), (NUM_SLOTS, KVH, L, hd), (NUM_SLOTS, L, di)]
    caches = [(torch.randn(s, generator=gen) * 0.5).to(dtype) for s in shapes]  # stale contents
    dev_caches = [c.cuda() for c in caches]
    w = layer.indexer.k_layernorm.weight.detach()
    w_dev = w.float().cuda()
    dropped, compared, worst_gap = 0, 0, float("inf")
    for n, step in enumerate(STEPS[L]):
        starts, past, slots, tslot, tpos = packed(step)
        x = torch.randn(starts[-1], hidden, generator=gen).to(dtype)
        positions = torch.from_numpy(tpos.astype(np.int64))
        with torch.no_grad():
            inputs = projections(torch, layer, x, positions)
            with ungated(torch, layer):
                want = layer(x, positions, starts, past, slots, *caches).float()
        gaps = boundary_gaps(
            fields, inputs[3].double().numpy(), caches[2].double().numpy(), w.double().numpy(), tslot, tpos
        )
        rows = torch.from_numpy(gaps > (NEAR_TIE_16BIT if dname != "float32" else 0.0))
        dropped += int(np.isfinite(gaps).sum())
        compared += int((np.isfinite(gaps) & rows.numpy()).sum())
        worst_gap = min(worst_gap, float(gaps.min()))
        got = qsa.qsa_attention(
            *[t.contiguous().cuda() for t in inputs],
            *dev_caches,
            w_dev,
            torch.from_numpy(tslot).cuda(),
            torch.from_numpy(tpos).cuda(),
            fields,
        )
        torch.cuda.synchronize()
        err = (got.float().cpu() - want)[rows].abs().max().item()
        scale = want.abs().max().item()
        same_caches = all(torch.equal(a.cpu(), b) for a, b in zip(dev_caches, caches))
        assert err <= TOLERANCE[dname] * scale and same_caches, (
            f"qsa kernel {dname} config {ci} step {n}: = GatedAttention core, caches bit-equal: "
            f"max error {err:.3e} scale {scale:.3e} caches-equal={same_caches} rows compared "
            f"{int(rows.sum())}/{len(rows)}"
        )
    assert compared > dropped // 2 and compared > 0 and (dname != "float32" or worst_gap > 1e-4), (
        f"qsa kernel {dname} config {ci}: blocks were dropped (rows compared), no float32 top-k boundary tie: "
        f"dropping queries {dropped}, compared {compared}, smallest gap {worst_gap:.3e}"
    )


def test_decode_sizes_match_the_torch_decode() -> None:
    """16 slots decoding at ~1000 positions of random history (hd 256, 16 q heads over 2
    KV heads, 8 indexer heads of 128, blocks of 16, 16 kept): = GatedAttention.forward."""
    import torch

    from engram_trt.native import qsa

    cfg = make_config(256, 16, 2, 256, 0.25, 8, 128, 256, 16)
    layer = random_layer(torch, cfg, seed=3)
    fields = fields_of(cfg)
    G, L = 16, 1280
    gen = torch.Generator().manual_seed(4)
    caches = [torch.randn(s, generator=gen) * 0.5 for s in ((G, 2, L, 256), (G, 2, L, 256), (G, L, 128))]
    dev_caches = [c.cuda() for c in caches]
    past = [int(v) for v in torch.randint(900, 1200, (G,), generator=gen)]
    starts, _, slots, tslot, tpos = packed([(g, past[g], 1) for g in range(G)])
    x = torch.randn(G, 256, generator=gen)
    positions = torch.from_numpy(tpos.astype(np.int64))
    with torch.no_grad():
        inputs = projections(torch, layer, x, positions)
        with ungated(torch, layer):
            want = layer(x, positions, starts, past, slots, *caches)
    w = layer.indexer.k_layernorm.weight.detach()
    gaps = boundary_gaps(
        fields, inputs[3].double().numpy(), caches[2].double().numpy(), w.double().numpy(), tslot, tpos
    )
    dropped, gap = int(np.isfinite(gaps).sum()), float(gaps.min())
    dev_in = [t.contiguous().cuda() for t in inputs]
    meta = [torch.from_numpy(tslot).cuda(), torch.from_numpy(tpos).cuda()]
    got = qsa.qsa_attention(*dev_in, *dev_caches, w.cuda(), *meta, fields)
    torch.cuda.synchronize()
    err = (got.cpu() - want).abs().max().item()
    scale = want.abs().max().item()
    assert err <= 2e-5 * scale and dropped == G and gap > 1e-4, (
        "qsa kernel decode 16 x ~1000 positions: = GatedAttention decode core (float32): "
        f"max error {err:.3e} scale {scale:.3e} dropped={dropped} gap={gap:.3e}"
    )
    for _ in range(3):
        qsa.qsa_attention(*dev_in, *dev_caches, w.cuda(), *meta, fields, out=got)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        qsa.qsa_attention(*dev_in, *dev_caches, w.cuda(), *meta, fields, out=got)
    torch.cuda.synchronize()
    us = (time.perf_counter() - t0) / 20 * 1e6
    note("decode_16x1000_us", us)
    say(f"qsa decode 16 slots x ~1000 positions (hd 256, 16/2 heads, 8 x 128 indexer): {us:.1f} us a call")


def test_reference_agrees_and_edge_contracts() -> None:
    """The kernel = models/qwen4_exp/reference_qsa.py on the same float32 inputs; padding tokens;
    ties to the lower block index (index_q all zero: every score 0, blocks 0..k-1 kept)."""
    import torch

    from engram_trt.models.qwen4_exp.reference_qsa import qsa_attention_reference
    from engram_trt.native import qsa

    rng = np.random.default_rng(7)
    T, H, KVH, hd, NI, di, S, L = 6, 4, 2, 32, 2, 32, 3, 48
    fields = qsa.QsaFields(4, 2, 16, 10000.0, 1e-6, hd**-0.5)
    arrays = [
        rng.standard_normal(s).astype(np.float32) * 0.5
        for s in (
            (T, H, hd),
            (T, KVH, hd),
            (T, KVH, hd),
            (T, NI, di),
            (T, di),
            (S, KVH, L, hd),
            (S, KVH, L, hd),
            (S, L, di),
            (di,),
        )
    ]
    tslot = np.array([0, 0, 1, -1, 2, 5], np.int32)  # token 3: no slot; token 5: slot past the caches
    tpos = np.array([40, 41, 30, 3, 47, 2], np.int32)
    for case in ("random", "ties"):
        if case == "ties":
            arrays[3] = np.zeros_like(arrays[3])
        want, *want_caches = qsa_attention_reference(*arrays, tslot, tpos, **vars(fields))
        dev = [torch.from_numpy(a.copy()).cuda() for a in arrays]
        got = qsa.qsa_attention(*dev, torch.from_numpy(tslot).cuda(), torch.from_numpy(tpos).cuda(), fields)
        torch.cuda.synchronize()
        err = np.abs(got.cpu().numpy() - want).max()
        caches_ok = all(np.array_equal(d.cpu().numpy(), c) for d, c in zip(dev[5:8], want_caches))
        assert (
            err <= 2e-5 * np.abs(want).max() and caches_ok and not got[3:4].any().item() and not got[5:6].any().item()
        ), (
            f"qsa kernel = float64 reference ({case}), padding rows zero, caches as the reference's: "
            f"max error {err:.3e} caches-equal={caches_ok}"
        )
    empty = qsa.qsa_attention(
        *[torch.from_numpy(a[:0] if i < 5 else a).cuda() for i, a in enumerate(arrays)],
        torch.zeros(0, dtype=torch.int32, device="cuda"),
        torch.zeros(0, dtype=torch.int32, device="cuda"),
        fields,
    )
    assert tuple(empty.shape) == (0, H * hd), "qsa kernel: T = 0 is a no-op"


# --- the plugin ---------------------------------------------------------------------------------


def plugin_fields(ratio=4, topk=2, rot=16, theta=10000.0, eps=1e-6, scaling=0.125, drop=(), **override):
    fields = {
        "compress_ratio": (PF_INT32, np.array([ratio], np.int32)),
        "block_topk": (PF_INT32, np.array([topk], np.int32)),
        "rot_dim": (PF_INT32, np.array([rot], np.int32)),
        "rope_theta": (PF_FLOAT32, np.array([theta], np.float32)),
        "eps": (PF_FLOAT32, np.array([eps], np.float32)),
        "scaling": (PF_FLOAT32, np.array([scaling], np.float32)),
    }
    fields.update(override)
    return [(name, ftype, data) for name, (ftype, data) in fields.items() if name not in drop]


def in_types_of(io: str, wt: str) -> list[int]:
    return [DT[io]] * 8 + [DT[wt]] + [DT["int32"]] * 2


PLUGIN_CPU_CHECKS = [
    "plugin EngramQsaAttention getOutputShapes",
    "plugin EngramQsaAttention getOutputDataTypes: every output q's type",
    "plugin EngramQsaAttention getOutputDataTypes refuses mixed types",
    "plugin EngramQsaAttention getAliasedInput: the caches alias inputs 5-7 (build capability v2)",
    "plugin EngramQsaAttention serialize round trip",
    "plugin EngramQsaAttention refuses bad fields in one line",
]


def check_plugin_cpu(harness: Harness) -> Checks:
    """What TensorRT asks of EngramQsaAttention before any enqueue (no GPU needed)."""
    checks = Checks()
    T, H, KVH, hd, NI, di, S, L = 7, 8, 2, 64, 4, 32, 3, 128
    h = harness.create("EngramQsaAttention", plugin_fields())
    in_shapes = [
        (T, H, hd),
        (T, KVH, hd),
        (T, KVH, hd),
        (T, NI, di),
        (T, di),
        (S, KVH, L, hd),
        (S, KVH, L, hd),
        (S, L, di),
        (di,),
        (T,),
        (T,),
    ]
    shapes = harness.outputs_shapes(h, in_shapes, 4)
    checks.add(
        "plugin EngramQsaAttention getOutputShapes",
        shapes == [(T, H * hd), (S, KVH, L, hd), (S, KVH, L, hd), (S, L, di)],
        str(shapes),
    )
    types = {}
    for io in ("bfloat16", "float16", "float32"):
        for wt in dict.fromkeys((io, "float32")):
            types[f"{io}/{wt}"] = harness.outputs_types(h, in_types_of(io, wt), 4) == [DT[io]] * 4
    checks.add("plugin EngramQsaAttention getOutputDataTypes: every output q's type", all(types.values()), str(types))
    refused = {}
    for what, in_types, needle in (
        (
            "index_key_cache of another type",
            [DT["bfloat16"]] * 7 + [DT["float32"]] + [DT["float32"]] + [DT["int32"]] * 2,
            "index_key_cache must be q's type",
        ),
        ("fp16 weight with bf16 q", in_types_of("bfloat16", "float16"), "must be float32 or q's type"),
        ("int64 token_pos", in_types_of("float32", "float32")[:-1] + [DT["int64"]], "token_pos must be int32"),
        ("int32 q", [DT["int32"]] * 8 + [DT["float32"]] + [DT["int32"]] * 2, "q must be bfloat16"),
    ):
        try:
            harness.outputs_types(h, in_types, 4)
            refused[what] = "accepted"
        except RuntimeError as exc:
            refused[what] = needle in str(exc) or str(exc)[:160]
    checks.add(
        "plugin EngramQsaAttention getOutputDataTypes refuses mixed types",
        all(v is True for v in refused.values()),
        str(refused),
    )
    aliases = [harness.aliased_input(h, o) for o in range(4)]
    checks.add(
        "plugin EngramQsaAttention getAliasedInput: the caches alias inputs 5-7 (build capability v2)",
        aliases == [(-1, 2), (5, 2), (6, 2), (7, 2)],
        str(aliases),
    )
    h2 = harness.roundtrip(h)
    checks.add(
        "plugin EngramQsaAttention serialize round trip",
        harness.outputs_shapes(h2, in_shapes, 4) == shapes
        and harness.aliased_input(h2, 3) == (7, 2)
        and harness.serialized_fields(h2) == harness.serialized_fields(h),
    )
    harness.lib.harness_destroy(h2)
    harness.lib.harness_destroy(h)
    refused = {}
    for what, fields, needle in (
        ("compress_ratio 0", plugin_fields(ratio=0), "field 'compress_ratio' = 0 is outside [1, 16384]"),
        ("block_topk 0", plugin_fields(topk=0), "field 'block_topk' = 0 is outside [1, 16384]"),
        ("(topk + 1) * ratio too many", plugin_fields(ratio=64, topk=256), "(block_topk + 1) * compress_ratio"),
        ("rot_dim odd", plugin_fields(rot=15), "rot_dim must be even"),
        ("rot_dim 258", plugin_fields(rot=258), "field 'rot_dim' = 258 is outside [0, 256]"),
        ("rope_theta 0", plugin_fields(theta=0.0), "rope_theta must be finite and > 0"),
        ("eps NaN", plugin_fields(eps=float("nan")), "eps must be finite and >= 0"),
        ("scaling -1", plugin_fields(scaling=-1.0), "scaling must be finite and > 0"),
        ("scaling missing", plugin_fields(drop=("scaling",)), "missing field 'scaling'"),
        (
            "block_topk 2^32 + 2 (int64)",
            plugin_fields(block_topk=(PF_INT64, np.array([2**32 + 2], np.int64))),
            "'block_topk' = 4294967298 is outside",
        ),
        (
            "an unknown field",
            plugin_fields() + [("num_heads", PF_INT32, np.array([8], np.int32))],
            "unknown field(s) num_heads",
        ),
    ):
        try:
            harness.lib.harness_destroy(harness.create("EngramQsaAttention", fields))
            refused[what] = "accepted"
        except RuntimeError as exc:
            refused[what] = (needle in str(exc) and "\n" not in str(exc)) or str(exc)[:200]
    checks.add(
        "plugin EngramQsaAttention refuses bad fields in one line",
        all(v is True for v in refused.values()),
        str(refused),
    )
    return checks


@pytest.fixture(scope="module")
def plugin_cpu(harness) -> Checks:
    return check_plugin_cpu(harness)


@pytest.mark.parametrize("name", PLUGIN_CPU_CHECKS)
def test_plugin_cpu(plugin_cpu, name: str) -> None:
    ok, detail = plugin_cpu[name]
    assert ok, f"{name}: {detail}"


@pytest.mark.parametrize("phase_name", ["build", "runtime (round trip)"])
@pytest.mark.parametrize("dname,wname", [("bfloat16", "bfloat16"), ("bfloat16", "float32"), ("float32", "float32")])
def test_plugin_gpu(harness, dname, wname, phase_name) -> None:
    """The plugin's enqueue (build phase, and runtime after a round trip) = the binding,
    bit for bit: the caches aliased (in place) and in separate outputs (copied over first,
    the inputs left untouched); the workspace the binding's."""
    import torch

    from engram_trt.native import qsa

    dev = torch.device("cuda")
    stream = torch.cuda.current_stream().cuda_stream
    dtype, wdtype = getattr(torch, dname), getattr(torch, wname)
    hidden, H, KVH, hd, factor, NI, di, budget, ratio, L = CONFIGS[0]
    cfg = make_config(hidden, H, KVH, hd, factor, NI, di, budget, ratio)
    f = fields_of(cfg)
    gen = torch.Generator().manual_seed(21)
    starts, past, slots, tslot, tpos = packed([(0, 20, 9), (1, 0, 6), (3, 33, 1)])
    T = starts[-1]
    acts = [
        (torch.randn(s, generator=gen) * 0.5).to(dev, dtype)
        for s in ((T, H, hd), (T, KVH, hd), (T, KVH, hd), (T, NI, di), (T, di))
    ]
    caches0 = [
        (torch.randn(s, generator=gen) * 0.5).to(dev, dtype)
        for s in ((NUM_SLOTS, KVH, L, hd), (NUM_SLOTS, KVH, L, hd), (NUM_SLOTS, L, di))
    ]
    w = (torch.randn(di, generator=gen) * 0.3).to(dev, dtype).to(wdtype)
    meta = [torch.from_numpy(tslot).to(dev), torch.from_numpy(tpos).to(dev)]
    want_caches = [c.clone() for c in caches0]
    want = qsa.qsa_attention(*acts, *want_caches, w, *meta, f)
    want_ws = qsa.workspace_size(T, L, f.compress_ratio, f.block_topk)
    io = DT[dname]
    fields = plugin_fields(f.compress_ratio, f.block_topk, f.rot_dim, f.rope_theta, f.eps, f.scaling)
    make = {"build": lambda h: h, "runtime (round trip)": harness.roundtrip}[phase_name]
    base = harness.create("EngramQsaAttention", fields)
    h = make(base)
    caches = [c.clone() for c in caches0]
    out = torch.full((T, H * hd), float("nan"), dtype=dtype, device=dev)
    ws = harness.run_outputs(h, [*acts, *caches, w, *meta], in_types_of(dname, wname), [out, *caches], [io] * 4, stream)
    torch.cuda.synchronize()
    same = torch.equal(out, want) and all(torch.equal(a, b) for a, b in zip(caches, want_caches))
    assert same and ws == want_ws, (
        f"plugin EngramQsaAttention enqueue {dname}/{wname} {phase_name}, caches aliased (in place): "
        f"equal={same} workspace={ws} (want {want_ws})"
    )
    caches_in = [c.clone() for c in caches0]
    caches_out = [torch.full_like(c, float("nan")) for c in caches0]
    out2 = torch.full((T, H * hd), float("nan"), dtype=dtype, device=dev)
    harness.run_outputs(
        h, [*acts, *caches_in, w, *meta], in_types_of(dname, wname), [out2, *caches_out], [io] * 4, stream
    )
    torch.cuda.synchronize()
    same = (
        torch.equal(out2, want)
        and all(torch.equal(a, b) for a, b in zip(caches_out, want_caches))
        and all(torch.equal(a, b) for a, b in zip(caches_in, caches0))
    )
    assert same, f"plugin EngramQsaAttention enqueue {dname}/{wname} {phase_name}, separate cache outputs (copy)"
    if h != base:
        harness.lib.harness_destroy(h)
    harness.lib.harness_destroy(base)
