"""The kernel library and the plugins on a GPU (formerly scripts/h200_verify.py; its NaN,
bad-row and build-phase cases are test_edge_cases.py, a rank's column range
test_column_range.py, its timing ``benchmarks/kernels/bench_kernels.py``):

  kernels    hash / gather (device, pinned-UVA, registered-UVA, host gather; fp8 and
             bf16 tables) / gate through engram_trt.native (hash, gather, gate), against the Python
             references on fresh random inputs, outputs poisoned first.
  plugins    EngramHash / EngramGather / EngramGate (namespace "engram_trt") through
             their creators, output types and shapes (a harness IExprBuilder),
             configurePlugin, getWorkspaceSize, enqueue, and a serialize ->
             createPlugin(kRUNTIME) round trip; same references. A build-phase
             (kBUILD) EngramGather writes zero rows and reads no table; its kRUNTIME
             twin reads the rows exactly.
  hardening  inputs an engine cannot validate on the host: table addresses of 0 or
             misaligned give zero rows without a fault, a negative seq_starts[0] is
             never read before ids[0]; and, each in a child process (a fault there
             cannot end this run): a failed call leaves no stale CUDA error for the
             next one, destroying a host gatherer waits for its gather.
  timed data the outputs of the timed cases of ``benchmarks/kernels/bench_kernels.py`` (hash of 8,192
             tokens x 2 layers x 24 columns; the host gather against the device gather of
             6,144 and 196,608 rows of a >= 24 GiB table, ``$ENGRAM_TRT_GPU_TABLE_GIB``).

Tolerances: hash ids and gathered rows must be bit-exact (rows: the fp8 * ue8m0 product
in float32 rounded once to bf16); the gate, elementwise against the float64 reference
on the same (rounded) inputs: bf16 I/O |out - ref| <= 2^-8 |ref| + 1e-5 (one bf16 ulp),
fp16 I/O <= 2^-10 |ref| + 1e-4 (about one fp16 ulp), fp32 I/O <= 1e-5 max|ref|; masked
tokens must equal hidden bit for bit, and the in-place update (out = hidden) must equal
the out-of-place one bit for bit, through the kernel and through the plugin's enqueue.
"""

from __future__ import annotations

import json
import os
import zlib
from types import SimpleNamespace

import numpy as np
import pytest

from .cases import GATHER_ROWS, HASH_SEQUENCES

from .helpers import (
    DT,
    PF_CHAR,
    PF_INT32,
    PF_INT64,
    Checks,
    bits,
    dtype_name,
    gate_fields,
    gate_inputs,
    gate_ok,
    gather_fields,
    hash_fields,
    hash_fields_text,
    random_fp8_table,
    run_child,
    say,
)


# --- layouts ---------------------------------------------------------------------------


def make_layouts():
    from engram_trt.config.model import EngramSpec
    from engram_trt.engram.layout import EngramLayout

    # Three shapes: 2 layers of orders 2..3 x 8 heads (DeepSeek-V4 vocabulary sizes),
    # 3 layers of orders 2..4 x 4 heads, and 4 layers of orders 2..3 x 20 heads (160
    # slots: the hash kernel's large parameter, over 4 KiB).
    a = EngramSpec(
        layer_ids=(2, 15),
        max_ngram_size=3,
        n_heads=8,
        vocab_size=129280,
        compressed_vocab_size=99092,
        pad_token_id=0,
        head_dim=256,
    )
    b = EngramSpec(
        layer_ids=(1, 6, 11),
        max_ngram_size=4,
        n_heads=4,
        vocab_size=50000,
        compressed_vocab_size=41234,
        pad_token_id=0,
        head_dim=128,
    )
    c = EngramSpec(
        layer_ids=(0, 1, 4, 9),
        max_ngram_size=3,
        n_heads=20,
        vocab_size=20000,
        compressed_vocab_size=17000,
        pad_token_id=0,
        head_dim=64,
    )
    return [
        EngramLayout.from_spec(a, pad_id=17),
        EngramLayout.from_spec(b, pad_id=3),
        EngramLayout.from_spec(c, pad_id=9),
    ]


def random_packed(rng, layout, num_seqs: int, max_len: int, dead_frac: float = 0.05):
    """Packed ids with dead tokens, empty sequences and partial / absent lookback."""
    lengths = rng.integers(0, max_len + 1, size=num_seqs)
    lengths[rng.random(num_seqs) < 0.1] = 0
    T = int(lengths.sum())
    ids = rng.integers(0, layout.compressed_vocab_size, size=T, dtype=np.int64)
    ids[rng.random(T) < dead_frac] = -1
    starts = np.zeros(num_seqs + 1, dtype=np.int64)
    starts[1:] = np.cumsum(lengths)
    n = layout.max_ngram_size - 1
    lookback = rng.integers(0, layout.compressed_vocab_size, size=(num_seqs, n), dtype=np.int64)
    fresh = rng.random(num_seqs) < 0.3
    lookback[fresh] = -1
    partial = rng.random(num_seqs) < 0.2
    for s in np.nonzero(partial)[0]:  # a chunk close to the sequence start: oldest ids missing
        lookback[s, : rng.integers(1, n + 1)] = -1
    lookback[rng.random((num_seqs, n)) < dead_frac] = -1
    return ids, starts, lookback


@pytest.fixture(scope="module")
def layouts():
    return make_layouts()


# --- kernels ---------------------------------------------------------------------------


@pytest.mark.parametrize("num_seqs,max_len", [(1, 1), (7, 40), (300, 400)])
@pytest.mark.parametrize("li", range(3))
def test_kernel_hash(rng, layouts, li, num_seqs, max_len) -> None:
    import torch

    from engram_trt.native import hash as hash_kernels
    from engram_trt.native import library as kernel_library
    from engram_trt.engram.hashing import hash_batch_packed

    dev = torch.device("cuda")
    say(f"library {kernel_library.library_path()} version {kernel_library.version()}")
    layout = layouts[li]
    ids, starts, lookback = random_packed(rng, layout, num_seqs, max_len)
    ref = hash_batch_packed(ids, starts, lookback, layout)
    out = torch.full((ids.shape[0], layout.num_layers, layout.n_hash_cols), -12345, dtype=torch.int32, device=dev)
    hash_kernels.hash_packed(
        torch.from_numpy(ids.astype(np.int32)).to(dev),
        torch.from_numpy(starts.astype(np.int32)).to(dev),
        torch.from_numpy(lookback.astype(np.int32)).to(dev),
        layout,
        out=out,
    )
    got = out.cpu().numpy().astype(np.int64)
    assert np.array_equal(got, ref), (
        f"kernel hash layout{li} S={num_seqs} T={ids.shape[0]}: {int((got != ref).sum())} of {ref.size} ids differ"
    )


@pytest.mark.parametrize("li", range(3))
def test_kernel_hash_no_lookback(rng, layouts, li) -> None:
    """lookback=None: every sequence fresh."""
    import torch

    from engram_trt.native import hash as hash_kernels
    from engram_trt.engram.hashing import hash_batch_packed

    dev = torch.device("cuda")
    layout = layouts[li]
    ids, starts, _ = random_packed(rng, layout, 5, 30)
    ref = hash_batch_packed(ids, starts, None, layout)
    got = hash_kernels.hash_packed(
        torch.from_numpy(ids.astype(np.int32)).to(dev), torch.from_numpy(starts.astype(np.int32)).to(dev), None, layout
    )
    assert np.array_equal(got.cpu().numpy(), ref), f"kernel hash layout{li} no lookback"


@pytest.fixture(scope="module")
def gather_case(gpu_seed):
    """The kernel gather tests' tables and ids (fresh random per run): an fp8 table of
    50,000 rows (ids with -1 and past-the-end among them, layer 1 of 2) and its float32
    dequant rounded once to bf16; a bf16 table of 128 columns and its ids / rows."""
    import torch

    from engram_trt.engram.quant import dequant_fp8_rows

    rng = np.random.default_rng([gpu_seed, zlib.crc32(b"test_verify gather_case")])
    rows_n, head_dim, T, L, cols = 50_000, 256, 333, 2, 24
    fp8, scales = random_fp8_table(rng, rows_n, head_dim)
    ids = rng.integers(0, rows_n, size=(T, L, cols)).astype(np.int32)
    ids.reshape(-1)[rng.choice(ids.size, 20, replace=False)] = -1
    ids.reshape(-1)[rng.choice(ids.size, 20, replace=False)] = rows_n + 7
    layer = 1
    sel = ids[:, layer, :].reshape(-1)
    valid = (sel >= 0) & (sel < rows_n)
    ref32 = np.zeros((sel.size, head_dim), dtype=np.float32)
    ref32[valid] = dequant_fp8_rows(fp8[sel[valid]], scales[sel[valid]], 32)
    ref_bits = torch.from_numpy(ref32).to(torch.bfloat16).view(torch.int16).reshape(T, cols, head_dim)
    # bf16 table through both paths
    table_bf16 = torch.randn(rows_n, 128, dtype=torch.bfloat16)
    ids2 = torch.from_numpy(rng.integers(-2, rows_n + 2, size=(T, cols)).astype(np.int32))
    ref2 = torch.zeros(T * cols, 128, dtype=torch.bfloat16)
    flat = ids2.reshape(-1).long()
    ok = (flat >= 0) & (flat < rows_n)
    ref2[ok] = table_bf16[flat[ok]]
    ref2 = ref2.reshape(T, cols, 128)
    return SimpleNamespace(
        T=T,
        cols=cols,
        head_dim=head_dim,
        layer=layer,
        ids=ids,
        fp8_cpu=torch.from_numpy(fp8),
        scales_cpu=torch.from_numpy(scales),
        ref_bits=ref_bits,
        table_bf16=table_bf16,
        ids2=ids2,
        ref2=ref2,
    )


def poisoned(c, width: int):
    """A NaN-filled bf16 output [T, cols, width] on the GPU (every row must be written)."""
    import torch

    return torch.full((c.T, c.cols, width), float("nan"), dtype=torch.bfloat16, device=torch.device("cuda"))


@pytest.mark.parametrize("name", ["device", "pinned host (UVA)", "registered host (UVA)"])
def test_kernel_gather_fp8(gather_case, name) -> None:
    """The fp8 table in every placement."""
    import torch

    from engram_trt.native import gather as gather_kernels
    from engram_trt.native import library as kernel_library

    c, dev = gather_case, torch.device("cuda")
    ids_dev = torch.from_numpy(c.ids).to(dev)
    if name == "device":
        r, s = c.fp8_cpu.to(dev), c.scales_cpu.to(dev)
    elif name == "pinned host (UVA)":
        r, s = c.fp8_cpu.pin_memory(), c.scales_cpu.pin_memory()
    else:
        r, s = c.fp8_cpu.clone(), c.scales_cpu.clone()
        kernel_library.register_host_memory(r)
        kernel_library.register_host_memory(s)
    try:
        out = gather_kernels.gather(ids_dev, r, s, layer=c.layer, out=poisoned(c, c.head_dim))
        torch.cuda.synchronize()
        same = torch.equal(out.view(torch.int16).cpu(), c.ref_bits)
        assert same, f"kernel gather fp8 {name}: kind={kernel_library.pointer_kind(r)}"
    finally:
        if name == "registered host (UVA)":
            kernel_library.unregister_host_memory(r)
            kernel_library.unregister_host_memory(s)


def test_host_gather_fp8(gather_case) -> None:
    import torch

    from engram_trt.native import hostgather

    c = gather_case
    with hostgather.HostGatherer(num_threads=8, chunk_rows=1000, max_head_dim=256) as g:  # several chunks
        out = g.gather(torch.from_numpy(c.ids), c.fp8_cpu, c.scales_cpu, layer=c.layer, out=poisoned(c, c.head_dim))
        torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16).cpu(), c.ref_bits), "kernel host gather fp8 (heap table, 5 chunks)"


def test_kernel_gather_bf16_device(gather_case) -> None:
    import torch

    from engram_trt.native import gather as gather_kernels

    c, dev = gather_case, torch.device("cuda")
    out = gather_kernels.gather(c.ids2.to(dev), c.table_bf16.to(dev), out=poisoned(c, 128))
    assert torch.equal(out.cpu().view(torch.int16), c.ref2.view(torch.int16)), "kernel gather bf16 device"


def test_host_gather_bf16(gather_case) -> None:
    import torch

    from engram_trt.native import hostgather

    c = gather_case
    with hostgather.HostGatherer(num_threads=8, chunk_rows=1000, max_head_dim=256) as g:
        out = g.gather(c.ids2, c.table_bf16, out=poisoned(c, 128))
        torch.cuda.synchronize()
    assert torch.equal(out.cpu().view(torch.int16), c.ref2.view(torch.int16)), "kernel host gather bf16"


# bf16, fp16 and fp32 I/O, weights bf16 / fp32 / the I/O type: (T, hc, D, io, weights, mask)
GATE_CASES = [
    (257, 4, 1024, "bfloat16", "bfloat16", "bool"),
    (64, 1, 64, "bfloat16", "float32", "int32"),
    (9, 2, 4096, "bfloat16", "bfloat16", "uint8"),
    (257, 4, 1024, "float16", "float16", "bool"),
    (64, 2, 256, "float16", "float32", "int32"),
    (9, 2, 4096, "float16", "bfloat16", "uint8"),
    (257, 4, 1024, "float32", "float32", "bool"),
    (33, 3, 512, "float32", "bfloat16", "int32"),
    (9, 2, 4096, "float32", "float32", "uint8"),
]


@pytest.mark.parametrize("mode", ["out of place", "in place"])
@pytest.mark.parametrize("T,hc,D,io_name,w_name,m_name", GATE_CASES)
def test_kernel_gate(rng, T, hc, D, io_name, w_name, m_name, mode) -> None:
    """Out of place: against the float64 reference; in place (out aliases hidden): bit for
    bit the out-of-place output (computed again here)."""
    import torch

    from engram_trt.native import gate as gate_kernels
    from engram_trt.engram.fusion import engram_gate_reference

    io, wdtype, mdtype = (getattr(torch, n) for n in (io_name, w_name, m_name))
    dev = torch.device("cuda")
    hidden, kv, qw, kw, mask, mask_np = gate_inputs(rng, T, hc, D, wdtype, mdtype, io)
    eps = 1e-6
    out = torch.full((T, hc, D), float("nan"), dtype=hidden.dtype, device=dev)
    gate_kernels.gate(hidden.to(dev), kv.to(dev), qw.to(dev), kw.to(dev), mask.to(dev), eps=eps, out=out)
    io_name, w_name = dtype_name(hidden.dtype), dtype_name(wdtype)
    if mode == "out of place":
        ok, detail = gate_ok(out, hidden, kv, qw, kw, mask_np, eps, engram_gate_reference)
        assert ok, f"kernel gate io={io_name} T={T} hc={hc} D={D} w={w_name} mask={dtype_name(mdtype)}: {detail}"
    else:
        h_dev = hidden.to(dev)
        gate_kernels.gate(h_dev, kv.to(dev), qw.to(dev), kw.to(dev), mask.to(dev), eps=eps, out=h_dev)
        assert torch.equal(bits(h_dev), bits(out)), f"kernel gate io={io_name} in place T={T} hc={hc} D={D}"


# --- plugins through the harness -----------------------------------------------------

PLUGIN_CPU_CHECKS = [
    "plugin EngramHash getOutputShapes",
    "plugin EngramHash getOutputDataTypes",
    "plugin EngramHash serialize round trip",
    "plugin EngramHash rejects overflowing multipliers",
    "plugin EngramHash refuses int32 multipliers (truncation)",
    "plugin EngramHash accepts decimal-text int64 fields",
    "plugin EngramHash rejects unknown fields",
    "plugin EngramGate refuses hc_mult = 2^32 + 4",
    "plugin EngramGather refuses num_rows = 2^31",
    "plugin EngramHash refuses text '12-3' (no separator)",
    "plugin EngramGather bad_rows_input = 1: 4 inputs, kept through serialization, 3 refused (message names file:line)",
    "plugin EngramGather getOutputShapes",
    "plugin EngramGather getOutputDataTypes",
    "plugin EngramGather serialize round trip",
    "plugin EngramGate getOutputShapes",
    "plugin EngramGate getOutputDataTypes: output = hidden's type (bf16 / fp16 / fp32 I/O)",
    "plugin EngramGate getOutputDataTypes refuses mixed types",
    "plugin EngramGate serialize round trip",
]


def check_plugins_cpu(harness, layout) -> Checks:
    """Creation, types, shapes, round trip and field validation (no GPU needed): each check
    of PLUGIN_CPU_CHECKS by name, (ok, detail)."""
    checks = Checks()
    h = harness.create("EngramHash", hash_fields(layout))
    shape, const = harness.output_shapes(h, [(100,), (4,), (3, layout.max_ngram_size - 1)])
    want = (100, layout.num_layers, layout.n_hash_cols)
    checks.add(
        "plugin EngramHash getOutputShapes", shape == want and const == (False, True, True), f"{shape} const={const}"
    )
    checks.add("plugin EngramHash getOutputDataTypes", harness.output_types(h, [DT["int32"]] * 3) == [DT["int32"]])
    h2 = harness.roundtrip(h)
    checks.add(
        "plugin EngramHash serialize round trip", harness.output_shapes(h2, [(7,), (2,), (1, 2)])[0][1:] == want[1:]
    )
    harness.lib.harness_destroy(h2)
    harness.lib.harness_destroy(h)
    bad = hash_fields(layout)
    bad[7] = ("multipliers", PF_INT64, np.full(layout.multipliers.size, 2**62, np.int64))
    try:
        harness.create("EngramHash", bad)
        checks.add("plugin EngramHash rejects overflowing multipliers", False)
    except RuntimeError as exc:
        checks.add("plugin EngramHash rejects overflowing multipliers", "multiplier" in str(exc), str(exc)[:120])
    narrow = hash_fields(layout)
    narrow[7] = ("multipliers", PF_INT32, layout.multipliers.reshape(-1).astype(np.int32))
    try:
        harness.create("EngramHash", narrow)
        checks.add("plugin EngramHash refuses int32 multipliers (truncation)", False)
    except RuntimeError as exc:
        checks.add("plugin EngramHash refuses int32 multipliers (truncation)", "64-bit" in str(exc), str(exc)[:120])
    h3 = harness.create("EngramHash", hash_fields_text(layout))
    checks.add(
        "plugin EngramHash accepts decimal-text int64 fields",
        harness.output_shapes(h3, [(9,), (2,), (1, layout.max_ngram_size - 1)])[0] == (9,) + want[1:],
    )
    harness.lib.harness_destroy(h3)
    try:
        harness.create("EngramHash", hash_fields(layout) + [("bogus", PF_INT32, np.array([1], np.int32))])
        checks.add("plugin EngramHash rejects unknown fields", False)
    except RuntimeError as exc:
        checks.add("plugin EngramHash rejects unknown fields", "bogus" in str(exc), str(exc)[:120])
    # Values that used to be narrowed to int32 or misparsed (2^32 + 4 read as 4, "12-3" as [12, -3]).
    gate_wide = gate_fields(4, 64, 1e-6)
    gate_wide[0] = ("hc_mult", PF_INT64, np.array([2**32 + 4], np.int64))
    gather_wide = gather_fields(0, 1, 8, 64, 1, 32, 1000)
    gather_wide[6] = ("num_rows", PF_INT64, np.array([2**31], np.int64))
    text = hash_fields_text(layout)
    primes_text = bytes(text[5][2]).decode().replace(",", "-", 1)
    text[5] = ("primes", PF_CHAR, np.frombuffer(primes_text.encode(), dtype=np.uint8))
    for name, fields, what, needle in (
        ("EngramGate", gate_wide, "hc_mult = 2^32 + 4", "'hc_mult' = 4294967300"),
        ("EngramGather", gather_wide, "num_rows = 2^31", "num_rows must be in"),
        ("EngramHash", text, "text '12-3' (no separator)", "not a list of integers"),
    ):
        try:
            harness.lib.harness_destroy(harness.create(name, fields))
            checks.add(f"plugin {name} refuses {what}", False, "accepted")
        except RuntimeError as exc:
            checks.add(f"plugin {name} refuses {what}", needle in str(exc), str(exc)[:120])

    # the optional bad-row counter input: bad_rows_input = 1 makes it the 4th input, and
    # the field survives serialization (the runtime plugin expects the same inputs)
    counted = harness.create(
        "EngramGather",
        gather_fields(1, 2, 24, 256, 0, 32, 1000) + [("bad_rows_input", PF_INT32, np.array([1], np.int32))],
    )
    counted2 = harness.roundtrip(counted)
    four = [DT["int32"], DT["int64"], DT["int64"], DT["int64"]]
    accepted = all(harness.output_types(h, four) == [DT["bfloat16"]] for h in (counted, counted2))
    try:
        harness.output_types(counted2, four[:3])
        refused = False
    except RuntimeError as exc:
        refused = "expects 4 inputs" in str(exc) and "engramGatherPlugin.cpp:" in str(exc)
    checks.add(
        "plugin EngramGather bad_rows_input = 1: 4 inputs, kept through serialization, 3 refused "
        "(message names file:line)",
        accepted and refused,
    )
    harness.lib.harness_destroy(counted2)
    harness.lib.harness_destroy(counted)

    g = harness.create("EngramGather", gather_fields(1, 2, 24, 256, 0, 32, 1000))
    shape, const = harness.output_shapes(g, [(50, 2, 24), (1,), (1,)])
    checks.add(
        "plugin EngramGather getOutputShapes", shape == (50, 24, 256) and const == (False, True, True), str(shape)
    )
    checks.add(
        "plugin EngramGather getOutputDataTypes",
        harness.output_types(g, [DT["int32"], DT["int64"], DT["int64"]]) == [DT["bfloat16"]],
    )
    g2 = harness.roundtrip(g)
    checks.add(
        "plugin EngramGather serialize round trip",
        harness.output_shapes(g2, [(5, 2, 24), (1,), (1,)])[0] == (5, 24, 256),
    )
    harness.lib.harness_destroy(g2)
    harness.lib.harness_destroy(g)

    t = harness.create("EngramGate", gate_fields(4, 1024, 1e-6))
    shape, const = harness.output_shapes(t, [(33, 4, 1024), (33, 5 * 1024), (4, 1024), (4, 1024), (33,)])
    checks.add("plugin EngramGate getOutputShapes", shape == (33, 4, 1024) and not const[0], str(shape))
    gate_types = {}
    for io, w in (
        ("bfloat16", "bfloat16"),
        ("bfloat16", "float32"),
        ("float16", "float16"),
        ("float16", "float32"),
        ("float16", "bfloat16"),
        ("float32", "float32"),
        ("float32", "bfloat16"),
    ):
        gate_types[f"{io}/{w}"] = harness.output_types(t, [DT[io], DT[io], DT[w], DT[w], DT["bool"]]) == [DT[io]]
    checks.add(
        "plugin EngramGate getOutputDataTypes: output = hidden's type (bf16 / fp16 / fp32 I/O)",
        all(gate_types.values()),
        str(gate_types),
    )
    refused = {}
    for what, types, needle in (
        ("kv fp32 with hidden fp16", ("float16", "float32", "float16", "float16"), "hidden and kv"),
        ("fp16 weights with bf16 hidden", ("bfloat16", "bfloat16", "float16", "float16"), "q_weight"),
        ("fp16 weights with fp32 hidden", ("float32", "float32", "float16", "float16"), "q_weight"),
        ("q fp32 with k bf16", ("float16", "float16", "float32", "bfloat16"), "q_weight"),
    ):
        try:
            harness.output_types(t, [DT[x] for x in types] + [DT["bool"]])
            refused[what] = False
        except RuntimeError as exc:
            refused[what] = needle in str(exc)
    checks.add("plugin EngramGate getOutputDataTypes refuses mixed types", all(refused.values()), str(refused))
    t2 = harness.roundtrip(t)
    checks.add(
        "plugin EngramGate serialize round trip",
        harness.output_shapes(t2, [(3, 4, 1024), (3, 5120), (4, 1024), (4, 1024), (3,)])[0] == (3, 4, 1024),
    )
    harness.lib.harness_destroy(t2)
    harness.lib.harness_destroy(t)
    return checks


@pytest.fixture(scope="module")
def plugins_cpu(harness, layouts) -> Checks:
    return check_plugins_cpu(harness, layouts[0])


@pytest.mark.parametrize("name", PLUGIN_CPU_CHECKS)
def test_plugins_cpu(plugins_cpu, name: str) -> None:
    ok, detail = plugins_cpu[name]
    assert ok, f"{name}: {detail}"


def run_both(harness, name, fields, inputs, in_types, make_out, out_type):
    """Build-phase plugin and its serialize -> runtime-phase twin on the same inputs."""
    import torch

    stream = torch.cuda.current_stream().cuda_stream
    outs = []
    h = harness.create(name, fields, phase=0)
    h2 = harness.roundtrip(h)
    for handle in (h, h2):
        out = make_out()
        ws = harness.run(handle, inputs, in_types, out, out_type, stream)
        torch.cuda.synchronize()
        outs.append(out)
    harness.lib.harness_destroy(h2)
    harness.lib.harness_destroy(h)
    return outs, ws


# int64 fields as the plugin serializes them, and as decimal text (the ONNX form)
@pytest.mark.parametrize("form", ["int64 fields", "text fields"])
@pytest.mark.parametrize("li", range(3))
def test_plugin_hash_enqueue(rng, harness, layouts, li, form) -> None:
    import torch

    from engram_trt.engram.hashing import hash_batch_packed

    dev = torch.device("cuda")
    layout = layouts[li]
    ids, starts, lookback = random_packed(rng, layout, 40, 200)
    ref = hash_batch_packed(ids, starts, lookback, layout)
    inputs = [torch.from_numpy(a.astype(np.int32)).to(dev) for a in (ids, starts, lookback)]
    fields = {"int64 fields": hash_fields, "text fields": hash_fields_text}[form](layout)
    (o1, o2), ws = run_both(
        harness,
        "EngramHash",
        fields,
        inputs,
        [DT["int32"]] * 3,
        lambda: torch.full(ref.shape, -777, dtype=torch.int32, device=dev),
        DT["int32"],
    )
    assert np.array_equal(o1.cpu().numpy(), ref) and np.array_equal(o2.cpu().numpy(), ref), (
        f"plugin EngramHash enqueue layout{li} T={ids.shape[0]} ({form}): workspace={ws}"
    )


@pytest.mark.parametrize("where", ["device", "pinned host"])
def test_plugin_gather_enqueue_fp8(rng, harness, where) -> None:
    import torch

    from engram_trt.engram.quant import dequant_fp8_rows

    dev = torch.device("cuda")

    rows_n, head_dim, T, L, cols, layer = 20_000, 256, 150, 2, 24, 1
    fp8, scales = random_fp8_table(rng, rows_n, head_dim)
    ids = rng.integers(0, rows_n, size=(T, L, cols)).astype(np.int32)
    sel = ids[:, layer, :].reshape(-1)
    ref = torch.from_numpy(dequant_fp8_rows(fp8[sel], scales[sel], 32)).to(torch.bfloat16).reshape(T, cols, head_dim)
    r, s = {
        "device": lambda: (torch.from_numpy(fp8).to(dev), torch.from_numpy(scales).to(dev)),
        "pinned host": lambda: (torch.from_numpy(fp8).pin_memory(), torch.from_numpy(scales).pin_memory()),
    }[where]()
    addr_r = torch.tensor([r.data_ptr()], dtype=torch.int64, device=dev)
    addr_s = torch.tensor([s.data_ptr()], dtype=torch.int64, device=dev)
    (o1, o2), ws = run_both(
        harness,
        "EngramGather",
        gather_fields(layer, L, cols, head_dim, 0, 32, rows_n),
        [torch.from_numpy(ids).to(dev), addr_r, addr_s],
        [DT["int32"], DT["int64"], DT["int64"]],
        lambda: torch.full((T, cols, head_dim), float("nan"), dtype=torch.bfloat16, device=dev),
        DT["bfloat16"],
    )
    # o1: the build-phase plugin (TensorRT's timing enqueue): zero rows, the table
    # untouched; o2: its serialize -> kRUNTIME twin reads the table.
    same = torch.equal(o2.cpu().view(torch.int16), ref.view(torch.int16))
    build_zero = int(torch.count_nonzero(o1.view(torch.int16))) == 0
    assert same and build_zero, (
        f"plugin EngramGather enqueue fp8 {where} table (runtime phase exact, build phase zero rows): "
        f"runtime-exact={same} build-phase-zero={build_zero} workspace={ws}"
    )


def test_plugin_gather_enqueue_bf16(rng, harness) -> None:
    import torch

    dev = torch.device("cuda")
    rows_n, T = 20_000, 150
    table = torch.randn(rows_n, 64, dtype=torch.bfloat16)
    ids1 = rng.integers(0, rows_n, size=(T, 1, 8)).astype(np.int32)
    ref1 = table[torch.from_numpy(ids1[:, 0, :].reshape(-1)).long()].reshape(T, 8, 64)
    tdev = table.to(dev)
    (o1, o2), _ = run_both(
        harness,
        "EngramGather",
        gather_fields(0, 1, 8, 64, 1, 32, rows_n),
        [torch.from_numpy(ids1).to(dev), torch.tensor([tdev.data_ptr()], dtype=torch.int64, device=dev)],
        [DT["int32"], DT["int64"]],
        lambda: torch.full((T, 8, 64), float("nan"), dtype=torch.bfloat16, device=dev),
        DT["bfloat16"],
    )
    assert (
        torch.equal(o2.cpu().view(torch.int16), ref1.view(torch.int16))
        and int(torch.count_nonzero(o1.view(torch.int16))) == 0
    ), "plugin EngramGather enqueue bf16 device table (runtime phase exact, build phase zero rows)"


# (T, hc, D, io, weights, mask)
PLUGIN_GATE_CASES = [
    (200, 4, 1024, "bfloat16", "bfloat16", "bool"),
    (31, 2, 256, "bfloat16", "float32", "int32"),
    (200, 4, 1024, "float16", "float16", "bool"),
    (31, 2, 256, "float16", "float32", "int32"),
    (200, 4, 1024, "float32", "float32", "bool"),
    (31, 2, 256, "float32", "bfloat16", "int32"),
]


@pytest.mark.parametrize("T_,hc,D,io_name,w_name,mname", PLUGIN_GATE_CASES)
def test_plugin_gate_enqueue(rng, harness, T_, hc, D, io_name, w_name, mname) -> None:
    import torch

    from engram_trt.engram.fusion import engram_gate_reference

    dev = torch.device("cuda")
    stream = torch.cuda.current_stream().cuda_stream
    io, wdtype, mdtype = (getattr(torch, n) for n in (io_name, w_name, mname))
    hidden, kv, qw, kw, mask, mask_np = gate_inputs(rng, T_, hc, D, wdtype, mdtype, io)
    eps = 1e-5
    io_t, wt = DT[dtype_name(io)], DT[dtype_name(wdtype)]
    in_types = [io_t, io_t, wt, wt, DT[mname]]
    dev_inputs = [t.to(dev) for t in (hidden, kv, qw, kw, mask)]
    (o1, o2), ws = run_both(
        harness,
        "EngramGate",
        gate_fields(hc, D, eps),
        dev_inputs,
        in_types,
        lambda: torch.full((T_, hc, D), float("nan"), dtype=io, device=dev),
        io_t,
    )
    ok1, detail = gate_ok(o1, hidden, kv, qw, kw, mask_np, eps, engram_gate_reference)
    same = torch.equal(bits(o1), bits(o2))
    # in place through enqueue: the output buffer is hidden's
    h = harness.create("EngramGate", gate_fields(hc, D, eps))
    in_place = dev_inputs[0].clone()
    harness.run(h, [in_place] + dev_inputs[1:], in_types, in_place, io_t, stream)
    torch.cuda.synchronize()
    harness.lib.harness_destroy(h)
    inplace_same = torch.equal(bits(in_place), bits(o1))
    assert ok1 and same and inplace_same, (
        f"plugin EngramGate enqueue io={dtype_name(io)} T={T_} hc={hc} D={D} w={dtype_name(wdtype)} mask={mname}: "
        f"{detail} roundtrip-identical={same} in-place-identical={inplace_same} workspace={ws}"
    )


# --- hardening ----------------------------------------------------------------------


def test_hardening_hash_negative_start(rng, layouts) -> None:
    """seq_starts[0] < 0: tokens before ids[0] are no token (blocked), never read. The ids
    sit in a buffer whose preceding elements are a valid id (7), so a read of ids[-1]
    would change the hash; the result must equal a fresh start (seq_starts[0] = 0, no
    lookback for sequence 0)."""
    import torch

    from engram_trt.native import hash as hash_kernels
    from engram_trt.engram.hashing import hash_batch_packed

    dev = torch.device("cuda")
    layout = layouts[1]
    n = layout.max_ngram_size - 1
    lengths = np.array([9, 0, 14, 5])
    T = int(lengths.sum())
    ids = rng.integers(0, layout.compressed_vocab_size, size=T, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    lookback = rng.integers(0, layout.compressed_vocab_size, size=(lengths.size, n), dtype=np.int64)
    bad_starts = starts.copy()
    bad_starts[0] = -5
    fresh = lookback.copy()
    fresh[0] = -1
    ref = hash_batch_packed(ids, starts, fresh, layout)
    buf = torch.full((64 + T,), 7, dtype=torch.int32, device=dev)
    buf[64:] = torch.from_numpy(ids.astype(np.int32)).to(dev)
    got = hash_kernels.hash_packed(
        buf[64:],
        torch.from_numpy(bad_starts.astype(np.int32)).to(dev),
        torch.from_numpy(lookback.astype(np.int32)).to(dev),
        layout,
    )
    torch.cuda.synchronize()
    got = got.cpu().numpy()
    assert np.array_equal(got, ref), (
        "kernel hash seq_starts[0] = -5: no read before ids[0], hashes as a fresh start: "
        f"{int((got != ref).sum())} of {ref.size} ids differ"
    )


# EngramGather with table addresses that cannot be read: (name, dtype, which addresses)
BAD_ADDRESS_CASES = [
    ("fp8, rows_addr 0", "fp8", "rows 0"),
    ("fp8, rows_addr misaligned (+8)", "fp8", "rows +8"),
    ("fp8, scales_addr 0", "fp8", "scales 0"),
    ("bf16, rows_addr 0", "bf16", "rows 0"),
]


def bad_address_case(rng, harness) -> SimpleNamespace:
    """A 5,000-row fp8 table on the device, ids of layer 0 of 2, the rows' reference and
    ``gather_plugin(fields, addresses, width)`` (a runtime-phase EngramGather over them)."""
    import torch

    from engram_trt.engram.quant import dequant_fp8_rows

    dev = torch.device("cuda")
    stream = torch.cuda.current_stream().cuda_stream
    rows_n, head_dim, T, L, cols, layer = 5_000, 256, 40, 2, 24, 0
    fp8, scales = random_fp8_table(rng, rows_n, head_dim)
    fp8_dev, scales_dev = torch.from_numpy(fp8).to(dev), torch.from_numpy(scales).to(dev)
    ids_dev = torch.from_numpy(rng.integers(0, rows_n, size=(T, L, cols)).astype(np.int32)).to(dev)

    def gather_plugin(fields, addresses, width):
        h = harness.create("EngramGather", fields, phase=1)  # runtime phase: the kernel reads the addresses
        out = torch.full((T, cols, width), float("nan"), dtype=torch.bfloat16, device=dev)
        inputs = [ids_dev] + [torch.tensor([a], dtype=torch.int64, device=dev) for a in addresses]
        harness.run(h, inputs, [DT["int32"]] + [DT["int64"]] * len(addresses), out, DT["bfloat16"], stream)
        torch.cuda.synchronize()  # raises if the kernel faulted
        harness.lib.harness_destroy(h)
        return out

    fields = {
        "fp8": gather_fields(layer, L, cols, head_dim, 0, 32, rows_n),
        "bf16": gather_fields(layer, L, cols, 64, 1, 32, rows_n),
    }
    addresses = {
        ("fp8", "rows 0"): (0, scales_dev.data_ptr()),
        ("fp8", "rows +8"): (fp8_dev.data_ptr() + 8, scales_dev.data_ptr()),
        ("fp8", "scales 0"): (fp8_dev.data_ptr(), 0),
        ("bf16", "rows 0"): (0,),
        ("fp8", "good"): (fp8_dev.data_ptr(), scales_dev.data_ptr()),
    }
    sel = ids_dev[:, layer, :].reshape(-1).cpu().numpy()
    ref = torch.from_numpy(dequant_fp8_rows(fp8[sel], scales[sel], 32)).to(torch.bfloat16).reshape(T, cols, head_dim)
    return SimpleNamespace(
        gather_plugin=gather_plugin,
        fields=fields,
        addresses=addresses,
        head_dim=head_dim,
        ref=ref,
        keep=(fp8_dev, scales_dev),
    )


@pytest.mark.parametrize("name, kind, which", BAD_ADDRESS_CASES, ids=[c[0] for c in BAD_ADDRESS_CASES])
def test_hardening_gather_bad_address(rng, harness, name, kind, which) -> None:
    """Engine inputs nothing validates on the host must not fault or misread (device side):
    zero rows, no fault."""
    import torch

    c = bad_address_case(rng, harness)
    out = c.gather_plugin(c.fields[kind], c.addresses[(kind, which)], c.head_dim if kind == "fp8" else 64)
    nonzero = int(torch.count_nonzero(out.view(torch.int16)))
    assert nonzero == 0, f"plugin EngramGather {name}: zero rows, no fault: {nonzero} nonzero elements"


def test_hardening_gather_after_bad_addresses(rng, harness) -> None:
    """The bad addresses of BAD_ADDRESS_CASES (each asserted in its own test) gathered in
    turn, then the good table: the context is still usable and the rows exact (dependent
    steps: only the last one is this test's check)."""
    import torch

    c = bad_address_case(rng, harness)
    for _name, kind, which in BAD_ADDRESS_CASES:
        c.gather_plugin(c.fields[kind], c.addresses[(kind, which)], c.head_dim if kind == "fp8" else 64)
    out = c.gather_plugin(c.fields["fp8"], c.addresses[("fp8", "good")], c.head_dim)
    assert torch.equal(out.cpu().view(torch.int16), c.ref.view(torch.int16)), (
        "plugin EngramGather after the bad addresses: context usable, rows exact"
    )


@pytest.mark.parametrize("probe", ["stale-error", "destroy-during-gather"])
def test_probe(probe, build_dir) -> None:
    """One probe in a child process (tests/gpu/probes.py): a CUDA fault there cannot end
    this run. The stale-error probe needs a host gather call that fails: a destination in
    pageable host memory first, else an unmapped address; if neither fails, the library
    reported success for a copy into an address that maps nothing, which fails the check."""
    result = run_probe(probe, build_dir)
    if probe == "stale-error" and result.get("provoked") is False:
        say(f"note: {result['detail']}; trying an unmapped destination")
        second = run_probe("stale-error-unmapped", build_dir)
        if second.get("provoked") is False:
            second = {
                "name": "kernel a failed call leaves no stale CUDA error (next gather / gate succeed)",
                "ok": False,
                "detail": f"no provocation failed: {result['detail']}; {second['detail']}",
            }
        result = second
    assert result["ok"], f"{result['name']}: {result['detail']}"


def run_probe(name: str, build_dir) -> dict:
    """Runs one probe of tests/gpu/probes.py in a child process."""
    proc = run_child("probes", name, str(build_dir), timeout=120)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("PROBE "):
            return json.loads(line[6:])
    return {
        "name": f"probe {name}",
        "ok": False,
        "detail": f"exit {proc.returncode}: {(proc.stdout + proc.stderr)[-600:]}",
    }


# --- the timed cases' outputs (their timing: benchmarks/kernels/bench_kernels.py) ------------------------


@pytest.mark.parametrize("S", HASH_SEQUENCES)  # one prefill sequence; 32 packed sequences
def test_timed_hash_agrees(rng, S) -> None:
    """The hash ``benchmarks/kernels/bench_kernels.py`` times (tests/gpu/cases.py: 8,192 tokens x
    2 layers x 24 columns, orders 2..3 x 12 heads) equals hash_batch_packed."""
    import torch

    from .cases import hash_case, hash_layout
    from engram_trt.native import hash as hash_kernels

    layout = hash_layout()
    case = hash_case(rng, layout, S, torch.device("cuda"))
    hash_kernels.hash_packed(case.ids, case.starts, case.lookback, layout, out=case.out)
    ok = np.array_equal(case.out.cpu().numpy().astype(np.int64), case.reference(layout))
    assert ok, (
        f"timing outputs agree (hash {case.ids.numel()} tokens x {layout.num_layers} layers x "
        f"{layout.n_hash_cols} columns, S={S})"
    )


@pytest.fixture(scope="module")
def big_table():
    """The timed gathers' table (tests/gpu/cases.py: fp8_tables, as ``bench_kernels.py``
    builds it): ``$ENGRAM_TRT_GPU_TABLE_GIB`` (default 24) GiB of 256-byte fp8 rows + 8
    scale bytes, in HBM and in pinned host memory (the same bytes)."""
    import time

    import torch

    from .cases import fp8_tables, gather_bytes

    t0 = time.time()
    tables = fp8_tables(float(os.environ.get("ENGRAM_TRT_GPU_TABLE_GIB", "24")), torch.device("cuda"))
    say(
        f"table {tables.rows_n:,} rows x 256 B fp8 + 8 B scales = {gather_bytes(tables.rows_n) / 2**30:.2f} GiB, "
        f"in HBM and pinned, ready in {time.time() - t0:.1f} s"
    )
    yield tables.rows_n, tables.dev_rows, tables.dev_scales, tables.host_rows, tables.host_scales
    del tables
    torch.cuda.empty_cache()


@pytest.mark.parametrize("n_rows", GATHER_ROWS)
def test_timed_gathers_agree(rng, big_table, n_rows) -> None:
    """The host gather (the runtime's default pool, woken as the prefetcher does) of
    uniform rows of the big pinned table equals the HBM gather kernel's, bit for bit."""
    import torch

    from engram_trt.native import gather as gather_kernels
    from engram_trt.native import hostgather

    dev = torch.device("cuda")
    rows_n, dev_rows, dev_scales, host_rows, host_scales = big_table
    cols = 24
    ids = torch.from_numpy(rng.integers(0, rows_n, size=(n_rows // cols, cols)).astype(np.int32))
    with hostgather.HostGatherer(max_head_dim=512) as gatherer:
        gatherer.wake()
        got = gatherer.gather(ids, host_rows, host_scales)
        ref = gather_kernels.gather(ids.to(dev), dev_rows, dev_scales)
        torch.cuda.synchronize()
    assert torch.equal(ref.view(torch.int16), got.view(torch.int16)), (
        f"timing outputs agree ({n_rows} rows: host gather == device gather)"
    )
