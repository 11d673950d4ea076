"""Edge cases of the kernels and the plugins on a GPU (formerly scripts/h200_edge_cases.py,
run by scripts/h200_verify.py): NaN propagation, the bad-row count, and the gather
plugin under TensorRT's build phase.

- NaN: an FP8 byte (0x7F / 0xFF) or a ue8m0 scale byte (255) that decodes to NaN gives
  NaN in the gathered row exactly where the reference has it; a NaN in a live token's
  key, hidden or value makes its output NaN as the float64 reference and the torch path
  do (the gate used to turn a NaN score into gate 0.5 and a finite, wrong row); a dead
  token stays a bit copy of hidden. Through the kernel and the EngramGate plugin, and end
  to end: a NaN row through gather -> wkv -> gate.
- bad rows: ids outside the table, an unbound / misaligned table address or a missing
  scale table write zero rows, and each such row adds 1 to the caller's device counter
  (gather_kernels.gather(bad_rows=...), the EngramGather plugin's optional counter input).
- build phase: an EngramGather made with TensorRTPhase::kBUILD (and its clones) writes
  zero rows without reading any address; the garbage addresses used are shown to fault
  when a runtime-phase plugin does read them (a control in its own child process,
  tests/gpu/probes.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from .helpers import DT, bits, counted_gather_fields, dtype_name, gate_bound, gate_fields, random_fp8_table
from .test_verify import run_probe


def nan_equal(got: np.ndarray, ref: np.ndarray, bound: np.ndarray | None = None) -> tuple[bool, str]:
    """NaN exactly where the reference has NaN; elsewhere within ``bound`` (or equal)."""
    same_nan = np.array_equal(np.isnan(got), np.isnan(ref))
    finite = ~np.isnan(ref)
    err = np.abs(got[finite] - ref[finite])
    within = bool(np.all(err <= (bound[finite] if bound is not None else 0.0)))
    return same_nan and within, (
        f"NaN positions equal={same_nan} ({int(np.isnan(got).sum())} NaN), finite within bound={within}"
    )


# --- NaN -------------------------------------------------------------------------------


def test_gather_nan(rng) -> None:
    import torch

    from engram_trt.native import gather as gather_kernels
    from engram_trt.engram.quant import dequant_fp8_rows

    dev = torch.device("cuda")
    # gather: NaN encodings in the table
    rows_n, head_dim, T, cols = 4_000, 256, 64, 24
    fp8, scales = random_fp8_table(rng, rows_n, head_dim)
    nan_rows = rng.choice(rows_n, 30, replace=False)
    fp8[nan_rows[:10], 17] = 0x7F  # +NaN e4m3
    fp8[nan_rows[10:20], 200] = 0xFF  # -NaN e4m3
    scales[nan_rows[20:], 3] = 255  # NaN ue8m0: the whole quant block
    ids = rng.integers(0, rows_n, size=(T, cols)).astype(np.int32)
    ids.reshape(-1)[: nan_rows.size] = nan_rows  # every NaN row is read
    with np.errstate(invalid="ignore"):
        ref = dequant_fp8_rows(fp8[ids.reshape(-1)], scales[ids.reshape(-1)], 32).reshape(T, cols, head_dim)
    out = gather_kernels.gather(
        torch.from_numpy(ids).to(dev), torch.from_numpy(fp8).to(dev), torch.from_numpy(scales).to(dev)
    )
    got = out.float().cpu().numpy()
    ref_bf16 = torch.from_numpy(ref).to(torch.bfloat16).float().numpy()
    ok, detail = nan_equal(got, ref_bf16)
    assert ok, f"kernel gather NaN fp8 bytes / scale 255 give NaN exactly where the reference does: {detail}"


@pytest.mark.parametrize("io_name", ["bfloat16", "float16", "float32"])
def test_gate_nan(rng, harness, io_name) -> None:
    """NaN in a live key, hidden, value; a dead token with an all-NaN kv row (bf16: also
    through the plugin's enqueue)."""
    import torch

    from engram_trt.native import gate as gate_kernels
    from engram_trt.engram.fusion import engram_gate, engram_gate_reference

    dev = torch.device("cuda")
    stream = torch.cuda.current_stream().cuda_stream
    io = getattr(torch, io_name)
    T, hc, D = 48, 4, 512
    hidden = torch.from_numpy(rng.standard_normal((T, hc, D)).astype(np.float32)).to(io)
    kv = torch.from_numpy(rng.standard_normal((T, (hc + 1) * D)).astype(np.float32)).to(io)
    qw = torch.from_numpy((1 + 0.1 * rng.standard_normal((hc, D))).astype(np.float32)).to(io)
    kw = qw.clone()
    mask_np = np.ones(T, dtype=bool)
    kv[3, 1 * D + 11] = float("nan")  # token 3, stream 1's key
    hidden[7, 2, 5] = float("nan")  # token 7, stream 2
    kv[9, hc * D + 100] = float("nan")  # token 9's value, element 100
    kv[12, :] = float("nan")  # token 12: a NaN row through wkv
    kv[20, :] = float("nan")
    mask_np[20] = False  # ... on a dead token
    mask = torch.from_numpy(mask_np)
    with np.errstate(invalid="ignore"):
        ref = engram_gate_reference(
            hidden.float().numpy(), kv.float().numpy(), qw.float().numpy(), kw.float().numpy(), mask_np, 1e-6
        )
    torch_path = engram_gate(hidden, kv, qw, kw, mask, 1e-6).float().numpy()
    out = gate_kernels.gate(hidden.to(dev), kv.to(dev), qw.to(dev), kw.to(dev), mask.to(dev), eps=1e-6)
    got = out.float().cpu().numpy().astype(np.float64)
    live = mask_np
    ok_ref, detail = nan_equal(got[live], ref[live], gate_bound(io, ref)[live])
    ok_torch = np.array_equal(np.isnan(got[live]), np.isnan(torch_path[live]))
    dead_exact = torch.equal(bits(out)[20], bits(hidden)[20])
    expected_nan = (
        np.isnan(got[3, 1]).all()
        and np.isnan(got[7, 2]).all()
        and np.isnan(got[9, :, 100]).all()
        and np.isnan(got[12]).all()
    )
    assert ok_ref and ok_torch and dead_exact and expected_nan, (
        f"kernel gate io={dtype_name(io)} NaN key / hidden / value / row -> NaN output (not gate 0.5): "
        f"{detail}; NaN as torch path={ok_torch}; dead token == hidden={dead_exact}"
    )
    if io == torch.bfloat16:
        # the plugin's enqueue on the same inputs (runtime phase)
        h = harness.create("EngramGate", gate_fields(hc, D, 1e-6), phase=1)
        plugin_out = torch.full((T, hc, D), 7.0, dtype=io, device=dev)
        io_t = DT["bfloat16"]
        harness.run(
            h,
            [hidden.to(dev), kv.to(dev), qw.to(dev), kw.to(dev), mask.to(dev)],
            [io_t, io_t, io_t, io_t, DT["bool"]],
            plugin_out,
            io_t,
            stream,
        )
        torch.cuda.synchronize()
        harness.lib.harness_destroy(h)
        assert torch.equal(bits(plugin_out), bits(out)), (
            "plugin EngramGate NaN inputs: output bitwise equal to the kernel's"
        )


def test_nan_end_to_end(rng) -> None:
    """A row with a NaN scale -> gather -> wkv -> gate."""
    import torch

    from engram_trt.native import gate as gate_kernels
    from engram_trt.native import gather as gather_kernels

    dev = torch.device("cuda")
    T, hc, D = 32, 2, 256
    fp8, scales = random_fp8_table(rng, 1000, 128)
    ids = rng.integers(0, 1000, size=(T, 4)).astype(np.int32)
    poisoned_token = 5
    # The poisoned row must be read by that token alone: a random id can repeat elsewhere
    # (about one run in eight with 128 ids from 1000 rows), which would poison that token too.
    elsewhere = set(np.delete(ids.reshape(-1), poisoned_token * 4 + 2).tolist())
    ids[poisoned_token, 2] = next(r for r in range(1000) if r not in elsewhere)
    scales[ids[poisoned_token, 2], 1] = 255
    e = gather_kernels.gather(
        torch.from_numpy(ids).to(dev), torch.from_numpy(fp8).to(dev), torch.from_numpy(scales).to(dev)
    )
    wkv = (0.02 * torch.randn(4 * 128, (hc + 1) * D, device=dev)).to(torch.bfloat16)
    kv = (e.reshape(T, -1) @ wkv).contiguous()
    hidden = torch.randn(T, hc, D, dtype=torch.bfloat16, device=dev)
    w = torch.ones(hc, D, dtype=torch.bfloat16, device=dev)
    out = gate_kernels.gate(hidden, kv, w, w, torch.ones(T, dtype=torch.bool, device=dev), eps=1e-6).float().cpu()
    other = torch.cat([out[:poisoned_token], out[poisoned_token + 1 :]])
    assert bool(torch.isnan(out[poisoned_token]).all()) and bool(torch.isfinite(other).all()), (
        "end to end: a NaN scale byte -> gathered row -> wkv -> gate gives NaN for that token only: "
        f"token {poisoned_token} all NaN={bool(torch.isnan(out[poisoned_token]).all())}, "
        f"others finite={bool(torch.isfinite(other).all())}"
    )


# --- bad-row count ---------------------------------------------------------------------


def bad_rows_case(rng) -> SimpleNamespace:
    """The bad-row tests' table (fp8, 10,000 rows) and ids (-1 and past-the-end ids among
    them), the expected count and the reference rows' bits of layer 1."""
    import torch

    from engram_trt.engram.quant import dequant_fp8_rows

    dev = torch.device("cuda")
    rows_n, head_dim, T, L, cols, layer = 10_000, 256, 200, 2, 24, 1
    fp8, scales = random_fp8_table(rng, rows_n, head_dim)
    ids = rng.integers(0, rows_n, size=(T, L, cols)).astype(np.int32)
    flat = ids.reshape(-1)
    flat[rng.choice(flat.size, 37, replace=False)] = -1
    flat[rng.choice(flat.size, 41, replace=False)] = rows_n + rng.integers(0, 1000)
    sel = ids[:, layer, :]
    expected = int(((sel < 0) | (sel >= rows_n)).sum())
    valid = (sel >= 0) & (sel < rows_n)
    ref32 = np.zeros((T, cols, head_dim), dtype=np.float32)
    ref32[valid] = dequant_fp8_rows(fp8[sel[valid]], scales[sel[valid]], 32)
    ref_bits = torch.from_numpy(ref32).to(torch.bfloat16).view(torch.int16)
    ids_dev = torch.from_numpy(ids).to(dev)
    return SimpleNamespace(
        rows_n=rows_n,
        head_dim=head_dim,
        T=T,
        L=L,
        cols=cols,
        layer=layer,
        fp8=fp8,
        scales=scales,
        ids_dev=ids_dev,
        expected=expected,
        ref_bits=ref_bits,
    )


@pytest.mark.parametrize("where", ["device", "pinned host (UVA)"])
def test_bad_rows_kernel(rng, where) -> None:
    import torch

    from engram_trt.native import gather as gather_kernels

    c = bad_rows_case(rng)
    dev = torch.device("cuda")
    fp8, scales, ids_dev, layer, expected, ref_bits = c.fp8, c.scales, c.ids_dev, c.layer, c.expected, c.ref_bits
    r, s = {
        "device": lambda: (torch.from_numpy(fp8).to(dev), torch.from_numpy(scales).to(dev)),
        "pinned host (UVA)": lambda: (torch.from_numpy(fp8).pin_memory(), torch.from_numpy(scales).pin_memory()),
    }[where]()
    counter = torch.zeros(1, dtype=torch.int64, device=dev)
    out = gather_kernels.gather(ids_dev, r, s, layer=layer, bad_rows=counter)
    first = int(counter.item())
    out2 = gather_kernels.gather(ids_dev, r, s, layer=layer, bad_rows=counter)
    exact = torch.equal(out.cpu().view(torch.int16), ref_bits) and torch.equal(out2.cpu().view(torch.int16), ref_bits)
    assert first == expected and int(counter.item()) == 2 * expected and exact, (
        f"kernel gather bad_rows counts ids outside the table ({where}): "
        f"count {first} then {int(counter.item())}, expected {expected} then {2 * expected}; rows exact={exact}"
    )


def test_bad_rows_bf16_and_check(rng) -> None:
    import torch

    from engram_trt.native import gather as gather_kernels

    dev = torch.device("cuda")
    rows_n, T, cols = 10_000, 200, 24
    counter = torch.zeros(1, dtype=torch.int64, device=dev)
    table = torch.randn(rows_n, 64, dtype=torch.bfloat16, device=dev)
    good = torch.from_numpy(rng.integers(0, rows_n, size=(T, cols)).astype(np.int32)).to(dev)
    gather_kernels.gather(good, table, bad_rows=counter)
    bf16_ids = good.clone()
    bf16_ids[0, :5] = rows_n
    gather_kernels.gather(bf16_ids, table, bad_rows=counter)
    assert int(counter.item()) == 5, (
        f"kernel gather bad_rows: 0 for in-range ids, 5 for 5 bad bf16 ids: count {int(counter.item())}"
    )
    from engram_trt.errors import EngramError

    try:
        gather_kernels.check_bad_rows(counter, what="bf16 gather")
        raised = ""
    except EngramError as exc:
        raised = str(exc)
    assert raised.startswith("bf16 gather: 5 row(s) read no table") and int(counter.item()) == 0, (
        f"gather_kernels.check_bad_rows raises on the device counter and resets it: {raised[:120]}"
    )


# (name, which addresses, the count wanted (None: expected), exact rows (else zero rows))
PLUGIN_BAD_ROW_CASES = [
    ("valid table", "good", None, True),
    ("rows_addr 0", "rows 0", "all", False),
    ("rows_addr misaligned (+8)", "rows +8", "all", False),
    ("scales_addr 0", "scales 0", "all", False),
]


def plugin_gather(harness, c: SimpleNamespace):
    """The EngramGather plugin over the case's ids, counter address as its last input:
    (run(addresses, counter_address) -> out, the good addresses by kind)."""
    import torch

    dev = torch.device("cuda")
    stream = torch.cuda.current_stream().cuda_stream
    T, cols, head_dim, ids_dev = c.T, c.cols, c.head_dim, c.ids_dev
    fp8_dev, scales_dev = torch.from_numpy(c.fp8).to(dev), torch.from_numpy(c.scales).to(dev)
    fields = counted_gather_fields(c.layer, c.L, cols, head_dim, 0, 32, c.rows_n)

    def run(addresses, counter_address):
        h = harness.create("EngramGather", fields, phase=1)
        out = torch.full((T, cols, head_dim), float("nan"), dtype=torch.bfloat16, device=dev)
        inputs = [ids_dev] + [torch.tensor([a], dtype=torch.int64, device=dev) for a in (*addresses, counter_address)]
        harness.run(h, inputs, [DT["int32"]] + [DT["int64"]] * 3, out, DT["bfloat16"], stream)
        torch.cuda.synchronize()
        harness.lib.harness_destroy(h)
        return out

    addresses = {
        "good": (fp8_dev.data_ptr(), scales_dev.data_ptr()),
        "rows 0": (0, scales_dev.data_ptr()),
        "rows +8": (fp8_dev.data_ptr() + 8, scales_dev.data_ptr()),
        "scales 0": (fp8_dev.data_ptr(), 0),
    }
    return run, addresses, (fp8_dev, scales_dev)


@pytest.mark.parametrize(
    "name, which, want, exact_rows", PLUGIN_BAD_ROW_CASES, ids=[c[0] for c in PLUGIN_BAD_ROW_CASES]
)
def test_bad_rows_plugin(rng, harness, name, which, want, exact_rows) -> None:
    import torch

    c = bad_rows_case(rng)
    dev = torch.device("cuda")
    run, addresses, _keep = plugin_gather(harness, c)
    want = c.expected if want is None else c.T * c.cols
    counter = torch.zeros(1, dtype=torch.int64, device=dev)
    out = run(addresses[which], counter.data_ptr())
    got = int(counter.item())
    rows_ok = (
        torch.equal(out.cpu().view(torch.int16), c.ref_bits)
        if exact_rows
        else int(torch.count_nonzero(out.view(torch.int16))) == 0
    )
    assert got == want and rows_ok, (
        f"plugin EngramGather bad-row counter input: {name}: "
        f"count {got}, expected {want}; rows {'exact' if exact_rows else 'zero'}={rows_ok}"
    )


def test_bad_rows_plugin_counter_address_0(rng, harness) -> None:
    import torch

    c = bad_rows_case(rng)
    run, addresses, _keep = plugin_gather(harness, c)
    out = run(addresses["good"], 0)
    assert torch.equal(out.cpu().view(torch.int16), c.ref_bits), (
        "plugin EngramGather bad-row counter address 0: no count, no fault, rows exact"
    )


# --- build phase (child processes: tests/gpu/probes.py) --------------------------------


@pytest.mark.parametrize("probe", ["build-phase-garbage", "runtime-phase-garbage-control"])
def test_build_phase_probe(probe, build_dir) -> None:
    """A probe in a child process (tests/gpu/probes.py); each one decides: the build-phase
    probe passes only with zero rows and a healthy context, its control only with a fault."""
    result = run_probe(probe, build_dir)
    assert result["ok"], f"{result['name']}: {result['detail']}"
