"""A tensor-parallel rank's gather on a GPU (formerly scripts/h200_column_range.py, run by
scripts/h200_verify.py): only the rank's columns
``[column_begin, column_end)`` of a layer, from its row slice of the layer's table
(global rows ``[row_offset, row_offset + num_rows)``, the slice tensor's first row at its
address), with the global row ids of the hash.

- CPU (``check_column_range_cpu``, also run by the CPU suite: tests/plugins/test_plugin_library.py):
  EngramGather's fields ``column_begin`` / ``column_end`` / ``row_offset`` set the output
  shape ``[T, column_end - column_begin, head_dim]``, are serialized (the values read
  back from getFieldsToSerialize, before and after a round trip), default to every column
  of the whole table (today's plugin), and out-of-range values are refused with one
  line naming the field and file:line.
- GPU (``test_rank_share``, ``test_rank_share_top_of_int32``, ``test_explicit_defaults``): through
  ``native.gather.gather(columns=, row_offset=)`` (engram_gather_ex) and the plugin's enqueue
  (engram_gather_indirect_ex), fp8 and bf16:
  the rows equal, bit for bit, the Python reference and the full-table gather's
  corresponding columns; ids below ``row_offset`` (negative ones, INT32_MIN included) and
  past the slice give zero rows and are counted exactly, while ids outside the column
  range are neither read nor counted. The slice is a view into the full table in one
  placement, so a read before or after the slice would show as real rows where zero rows
  are due; a copy (device, pinned host through UVA) in the others. A slice at the top of
  the int32 id space (``row_offset = 2^31 - 1 - num_rows``) checks the kernel's 32-bit
  bound. The plugin's build-phase twin writes zero rows and counts nothing.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from .helpers import DT, PF_INT32, PF_INT64, column_range_fields, gather_fields, random_fp8_table, Checks

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
FILE_LINE = re.compile(r"\((engramGatherPlugin|pluginFields)\.cpp:\d+\)")


def _counted(fields):
    return fields + [("bad_rows_input", PF_INT32, np.array([1], np.int32))]


# --- CPU: fields, shapes, serialization, refusals -----------------------------------------

PLUGIN_CPU_CHECKS = [
    "plugin EngramGather column range: output [T, column_end - column_begin, head_dim], fields serialized and kept "
    "through the round trip",
    "plugin EngramGather column-range defaults: all columns, row_offset 0 (absent or explicit)",
    "plugin EngramGather column range accepts its edges (last column; row_offset + num_rows = 2^31 - 1)",
] + [
    f"plugin EngramGather refuses {what}"
    for what in (
        "column_begin -1",
        "column_begin = n_cols",
        "column_end past n_cols",
        "empty range",
        "column_end 0",
        "row_offset -3",
        "slice past int32 ids",
        "column_begin 2^32 + 5 (int64)",
    )
]


def check_column_range_cpu(harness) -> Checks:
    """EngramGather's column range as TensorRT drives it (no GPU needed): the checks of
    PLUGIN_CPU_CHECKS by name."""
    checks = Checks()
    L, cols, head_dim, rows = 2, 24, 256, 5000
    base = gather_fields(1, L, cols, head_dim, 0, 32, rows)
    in_shapes = [(50, L, cols), (1,), (1,)]
    names = ("column_begin", "column_end", "row_offset", "num_rows")

    def serialized(h):
        return tuple(harness.serialized_int(h, n) for n in names)

    # the rank's share: 12 columns of a 5000-row slice starting at global row 12345
    g = harness.create("EngramGather", base + column_range_fields(5, 17, 12345))
    shape, const = harness.output_shapes(g, in_shapes)
    types_ok = harness.output_types(g, [DT["int32"], DT["int64"], DT["int64"]]) == [DT["bfloat16"]]
    g2 = harness.roundtrip(g)
    shape2 = harness.output_shapes(g2, [(7, L, cols), (1,), (1,)])[0]
    want = (5, 17, 12345, rows)
    checks.add(
        "plugin EngramGather column range: output [T, column_end - column_begin, head_dim], fields serialized "
        "and kept through the round trip",
        shape == (50, 12, head_dim)
        and const == (False, True, True)
        and types_ok
        and serialized(g) == want
        and serialized(g2) == want
        and shape2 == (7, 12, head_dim),
        f"shape {shape} const={const}, after round trip {shape2}; serialized {serialized(g)} -> {serialized(g2)}",
    )
    harness.lib.harness_destroy(g2)
    harness.lib.harness_destroy(g)

    # defaults: no fields = every column of the whole table (today's plugin), and the
    # explicit defaults are the same plugin
    results = []
    for extra in ([], column_range_fields(0, cols, 0)):
        h = harness.create("EngramGather", base + extra)
        h2 = harness.roundtrip(h)
        results.append((harness.output_shapes(h, in_shapes)[0], serialized(h), serialized(h2)))
        harness.lib.harness_destroy(h2)
        harness.lib.harness_destroy(h)
    default = ((50, cols, head_dim), (0, cols, 0, rows), (0, cols, 0, rows))
    checks.add(
        "plugin EngramGather column-range defaults: all columns, row_offset 0 (absent or explicit)",
        results == [default, default],
        str(results),
    )

    # the edges of the ranges are accepted
    edges = {
        "last column": column_range_fields(cols - 1, cols, 0),
        "highest slice": column_range_fields(0, cols, INT32_MAX - rows),
    }
    accepted = {}
    for what, extra in edges.items():
        try:
            harness.lib.harness_destroy(harness.create("EngramGather", base + extra))
            accepted[what] = True
        except RuntimeError as exc:
            accepted[what] = str(exc)[:160]
    checks.add(
        "plugin EngramGather column range accepts its edges (last column; row_offset + num_rows = 2^31 - 1)",
        all(v is True for v in accepted.values()),
        str(accepted),
    )

    # out of range: refused at creation, one line naming the field, with file:line
    def field(name, value, kind=PF_INT32):
        return [(name, kind, np.array([value], np.int32 if kind == PF_INT32 else np.int64))]

    bad = [
        ("column_begin -1", field("column_begin", -1), "column_begin must be in [0, n_cols 24), got -1"),
        ("column_begin = n_cols", field("column_begin", cols), "column_begin must be in [0, n_cols 24), got 24"),
        (
            "column_end past n_cols",
            column_range_fields(5, cols + 1, 0),
            "column_end must be in [column_begin + 1, n_cols] = [6, 24], got 25",
        ),
        (
            "empty range",
            column_range_fields(5, 5, 0),
            "column_end must be in [column_begin + 1, n_cols] = [6, 24], got 5",
        ),
        ("column_end 0", field("column_end", 0), "column_end must be in [column_begin + 1, n_cols] = [1, 24], got 0"),
        ("row_offset -3", field("row_offset", -3, PF_INT64), "row_offset must be >= 0, got -3"),
        (
            "slice past int32 ids",
            field("row_offset", INT32_MAX - rows + 1, PF_INT64),
            f"row_offset {INT32_MAX - rows + 1} + num_rows {rows} exceeds 2^31 - 1 (row ids are int32)",
        ),
        (
            "column_begin 2^32 + 5 (int64)",
            field("column_begin", 2**32 + 5, PF_INT64),
            "field 'column_begin' = 4294967301 is outside",
        ),
    ]
    for what, extra, needle in bad:
        try:
            harness.lib.harness_destroy(harness.create("EngramGather", base + extra))
            checks.add(f"plugin EngramGather refuses {what}", False, "accepted")
        except RuntimeError as exc:
            msg = str(exc)
            checks.add(
                f"plugin EngramGather refuses {what}",
                needle in msg and bool(FILE_LINE.search(msg)) and "\n" not in msg,
                msg[-200:],
            )
    return checks


@pytest.fixture(scope="module")
def plugin_cpu(harness) -> Checks:
    return check_column_range_cpu(harness)


@pytest.mark.parametrize("name", PLUGIN_CPU_CHECKS)
def test_column_range_cpu(plugin_cpu, name: str) -> None:
    ok, detail = plugin_cpu[name]
    assert ok, f"{name}: {detail}"


# --- GPU: rows and counts, kernel and plugin ----------------------------------------------


def _bad_ids(off: int, n: int, rows_full: int) -> list[int]:
    """Global ids outside the slice [off, off + n): below it (negative ones too), past it."""
    cands = [off - 1, 0, -1, -7, INT32_MIN, off + n, off + n + 3, rows_full, rows_full + 5, INT32_MAX]
    return [v for v in cands if INT32_MIN <= v <= INT32_MAX and not off <= v < off + n]


def _reference(ids_sel: np.ndarray, off: int, slice_rows, slice_scales, fp8: bool):
    """bf16 bits [T, ncols, head_dim] (torch int16): slice row id - off, zero outside."""
    import torch

    from engram_trt.engram.quant import dequant_fp8_rows

    local = ids_sel.astype(np.int64) - off
    valid = (local >= 0) & (local < slice_rows.shape[0])
    head_dim = slice_rows.shape[1]
    ref = torch.zeros(ids_sel.shape + (head_dim,), dtype=torch.bfloat16)
    if fp8:
        ref[torch.from_numpy(valid)] = torch.from_numpy(
            dequant_fp8_rows(slice_rows[local[valid]], slice_scales[local[valid]], 32)
        ).to(torch.bfloat16)
    else:
        ref[torch.from_numpy(valid)] = slice_rows[torch.from_numpy(local[valid])]
    return ref.view(torch.int16), int((~valid).sum())


def _run_case(
    harness,
    stream,
    name,
    ids,
    layer,
    b,
    e,
    off,
    n,
    rows,
    scales,
    want_bits,
    want_count,
    full_cols=None,
    full_valid=None,
) -> None:
    """The rank's gather through the kernel and the plugin; rows / scales: the slice
    tensors (on the device or pinned), want_bits / want_count: the reference. Asserts
    both (the message holds each one that failed)."""
    import torch

    from engram_trt.native import gather as gather_kernels

    dev = torch.device("cuda")
    T, L, cols = ids.shape
    head_dim = rows.shape[1]
    fp8 = scales is not None
    ids_dev = torch.from_numpy(ids).to(dev)

    def matches(out):
        got = out.cpu().view(torch.int16)
        exact = torch.equal(got, want_bits)
        # the full-table gather's columns, where the id is in the slice
        full = True if full_cols is None else torch.equal(got[full_valid], full_cols[full_valid])
        return exact, full

    counter = torch.zeros(1, dtype=torch.int64, device=dev)
    out = torch.full((T, e - b, head_dim), float("nan"), dtype=torch.bfloat16, device=dev)
    gather_kernels.gather(ids_dev, rows, scales, layer=layer, columns=(b, e), row_offset=off, bad_rows=counter, out=out)
    torch.cuda.synchronize()
    exact, full = matches(out)
    got = int(counter.item())
    kernel = (
        exact and full and got == want_count,
        f"kernel gather rank share {name}: "
        f"rows exact={exact}, = full-table gather's columns={full}; bad rows {got}, expected {want_count}",
    )

    fields = _counted(gather_fields(layer, L, cols, head_dim, 0 if fp8 else 1, 32, n) + column_range_fields(b, e, off))
    addresses = [rows.data_ptr()] + ([scales.data_ptr()] if fp8 else [])
    h = harness.create("EngramGather", fields, phase=0)  # build phase: zero rows, no read, no count
    h2 = harness.roundtrip(h)  # its serialized twin, runtime phase
    outs, counts = [], []
    for handle in (h, h2):
        counter = torch.zeros(1, dtype=torch.int64, device=dev)
        inputs = [ids_dev] + [
            torch.tensor([a], dtype=torch.int64, device=dev) for a in addresses + [counter.data_ptr()]
        ]
        out = torch.full((T, e - b, head_dim), float("nan"), dtype=torch.bfloat16, device=dev)
        harness.run(handle, inputs, [DT["int32"]] + [DT["int64"]] * (len(inputs) - 1), out, DT["bfloat16"], stream)
        torch.cuda.synchronize()
        outs.append(out)
        counts.append(int(counter.item()))
    harness.lib.harness_destroy(h2)
    harness.lib.harness_destroy(h)
    build_zero = int(torch.count_nonzero(outs[0].view(torch.int16))) == 0 and counts[0] == 0
    exact, full = matches(outs[1])
    plugin = (
        exact and full and counts[1] == want_count and build_zero,
        f"plugin EngramGather rank share {name}: "
        f"runtime rows exact={exact}, = full-table gather's columns={full}; bad rows {counts[1]}, expected "
        f"{want_count}; build phase zero rows, no count={build_zero}",
    )
    assert kernel[0] and plugin[0], "; ".join(detail for ok, detail in (kernel, plugin) if not ok)


RANK_SHARE_CASES = [
    ("columns [5, 17), whole table", 5, 17, 0, 30_000),
    ("all columns, rows [7000, 19000)", 0, 24, 7000, 12_000),
    ("columns [9, 24), rows [12345, 20000)", 9, 24, 12_345, 7_655),
    ("columns [0, 1), rows [29000, 30000)", 0, 1, 29_000, 1_000),
]
PLACES = ["slice view of the device table", "slice copy on the device", "slice copy pinned (UVA)"]
# (dtype, case, place): the pinned slice copy for fp8 tables
RANK_SHARE_PARAMS = [
    (dtype, ci, place)
    for dtype in ("fp8", "bf16")
    for ci in range(len(RANK_SHARE_CASES))
    for place in (PLACES if dtype == "fp8" else PLACES[:2])
]


@pytest.mark.parametrize("dtype, ci, place", RANK_SHARE_PARAMS)
def test_rank_share(rng, harness, dtype, ci, place) -> None:
    import torch

    from engram_trt.native import gather as gather_kernels

    dev = torch.device("cuda")
    stream = torch.cuda.current_stream().cuda_stream
    T, L, cols, layer, rows_full = 150, 2, 24, 1, 30_000
    fp8 = dtype == "fp8"
    head_dim = 256 if fp8 else 128
    if fp8:
        full_rows, full_scales = random_fp8_table(rng, rows_full, head_dim)
        full_dev = (torch.from_numpy(full_rows).to(dev), torch.from_numpy(full_scales).to(dev))
    else:
        full_rows, full_scales = torch.randn(rows_full, head_dim, dtype=torch.bfloat16), None
        full_dev = (full_rows.to(dev), None)
    case, b, e, off, n = RANK_SHARE_CASES[ci]
    ids = rng.integers(off, off + n, size=(T, L, cols)).astype(np.int32)  # a rank's ids lie in its slice
    share = ids[:, layer, b:e].reshape(-1)
    bad = _bad_ids(off, n, rows_full)
    where = rng.choice(share.size, min(share.size // 3, 6 * len(bad)), replace=False)
    share[where] = np.resize(np.array(bad, dtype=np.int32), where.size)
    ids[:, layer, b:e] = share.reshape(T, e - b)
    # columns outside the range hold ids no rank may read: never read, never counted
    ids[:, layer, :b] = -5
    ids[:, layer, e:] = INT32_MAX
    ids[:, 1 - layer] = INT32_MIN
    sel = ids[:, layer, b:e]
    slice_np = (full_rows[off : off + n], None if full_scales is None else full_scales[off : off + n])
    want_bits, want_count = _reference(sel, off, *slice_np, fp8)
    # the full-table gather (offset-free, checked against the reference above) of the same ids
    full = gather_kernels.gather(torch.from_numpy(np.ascontiguousarray(sel)).to(dev), *full_dev)
    torch.cuda.synchronize()
    full_cols = full.cpu().view(torch.int16)
    in_slice = torch.from_numpy((sel >= off) & (sel < off + n))
    placements = {
        "slice view of the device table": tuple(None if t is None else t[off : off + n] for t in full_dev),
        "slice copy on the device": tuple(None if t is None else t[off : off + n].clone() for t in full_dev),
    }
    if fp8:
        placements["slice copy pinned (UVA)"] = tuple(
            torch.from_numpy(np.ascontiguousarray(a)).pin_memory() for a in slice_np
        )
    r, s = placements[place]
    _run_case(
        harness,
        stream,
        f"{dtype} {case}, {place}",
        ids,
        layer,
        b,
        e,
        off,
        n,
        r,
        s,
        want_bits,
        want_count,
        full_cols,
        in_slice,
    )


def test_rank_share_top_of_int32(rng, harness) -> None:
    """The top of the int32 id space: INT32_MIN and every id below the slice must wrap past it."""
    import torch

    dev = torch.device("cuda")
    stream = torch.cuda.current_stream().cuda_stream
    T, L, cols = 150, 2, 24
    n, head_dim = 1000, 256
    off = INT32_MAX - n
    rows_np, scales_np = random_fp8_table(rng, n, head_dim)
    ids = (off + rng.integers(0, n, size=(T, L, cols))).astype(np.int32)
    bad = np.array([INT32_MIN, INT32_MIN + 1, -1, 0, 1, off - 1, off - n, INT32_MAX], dtype=np.int32)
    share = ids[:, 0, 3:11].reshape(-1)
    share[rng.choice(share.size, 64, replace=False)] = np.resize(bad, 64)
    ids[:, 0, 3:11] = share.reshape(T, 8)
    want_bits, want_count = _reference(ids[:, 0, 3:11], off, rows_np, scales_np, True)
    _run_case(
        harness,
        stream,
        f"fp8 columns [3, 11), rows [2^31 - 1 - {n}, 2^31 - 1): ids INT32_MIN .. INT32_MAX",
        ids,
        0,
        3,
        11,
        off,
        n,
        torch.from_numpy(rows_np).to(dev),
        torch.from_numpy(scales_np).to(dev),
        want_bits,
        want_count,
    )


def test_explicit_defaults(rng, harness) -> None:
    """The defaults, explicit: the plugin is today's full-table gather, bit for bit."""
    import torch

    from engram_trt.native import gather as gather_kernels

    dev = torch.device("cuda")
    stream = torch.cuda.current_stream().cuda_stream
    T, L, cols, layer, rows_full = 150, 2, 24, 1, 30_000
    fp8_np, scales_np = random_fp8_table(rng, rows_full, 256)
    r, s = torch.from_numpy(fp8_np).to(dev), torch.from_numpy(scales_np).to(dev)
    ids = rng.integers(0, rows_full, size=(T, L, cols)).astype(np.int32)
    ids_dev = torch.from_numpy(ids).to(dev)
    ref = gather_kernels.gather(ids_dev, r, s, layer=layer).cpu().view(torch.int16)
    outs = []
    for extra in ([], column_range_fields(0, cols, 0)):
        h = harness.create("EngramGather", gather_fields(layer, L, cols, 256, 0, 32, rows_full) + extra, phase=1)
        out = torch.full((T, cols, 256), float("nan"), dtype=torch.bfloat16, device=dev)
        inputs = [ids_dev] + [torch.tensor([a], dtype=torch.int64, device=dev) for a in (r.data_ptr(), s.data_ptr())]
        harness.run(h, inputs, [DT["int32"], DT["int64"], DT["int64"]], out, DT["bfloat16"], stream)
        torch.cuda.synchronize()
        harness.lib.harness_destroy(h)
        outs.append(out.cpu().view(torch.int16))
    assert all(torch.equal(o, ref) for o in outs), (
        "plugin EngramGather explicit defaults (columns [0, n_cols), row_offset 0) = no fields = gather_kernels.gather"
    )
