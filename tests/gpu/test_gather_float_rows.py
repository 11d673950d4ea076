"""The GPU gather of float rows (bf16 / f16 / f32 tables of any width: Qwen4Exp's PLE
tables as transformers saves them, F32 rows 4 wide) on a GPU.

1. The kernel by direct call (``kernels.gather``: engram_gather, _ex with a row slice,
   _part) over bf16, f16 and f32 tables of widths 1, 3, 4, 8, 17 and 64, in device memory
   and in pinned host memory read through UVA: every row bit-equal to torch indexing of
   the table (f32 rows whose low halves are bf16 NaN / inf patterns, f16 / bf16 NaN and
   inf: any conversion would show), zero rows for ids outside the table, each one counted;
   the output in the table's dtype. Tables and outputs at addresses that are only
   element-aligned (a view one element into a buffer) take the narrow path and give the
   same bits as the 16-byte path.
2. The EngramGather plugin's enqueue (through the plugin harness, as TensorRT calls it)
   for the same dtypes, widths and placements: the runtime-phase plugin equals torch
   indexing in the table's dtype, its build-phase twin writes zero rows; an element-
   aligned table address is read, an odd one gives zero rows, all counted.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .helpers import DT, PF_INT32, gather_fields, special_float_table

N = 5000
WIDTHS = (1, 3, 4, 8, 17, 64)
DTYPE_CODES = {"bfloat16": 1, "float16": 2, "float32": 3}


def _table(torch: Any, dtype: Any, width: int, seed: int, offset: int = 0) -> Any:
    """[N, width] random rows with special values; ``offset`` > 0: a view ``offset``
    elements into a larger buffer (its address only element-aligned)."""
    t = special_float_table(torch, dtype, N, width, seed, inf_column=-1)
    if offset:
        buf = torch.empty(N * width + offset, dtype=dtype)
        view = buf[offset:].view(N, width)
        view.copy_(t)
        return view
    return t


def _ids(rng: np.random.Generator, T: int, L: int, cols: int, rows: int) -> np.ndarray:
    """[T, L, cols] ids in the table, a few outside it on both sides."""
    ids = rng.integers(0, rows, size=(T, L, cols)).astype(np.int32)
    flat = ids.reshape(-1)
    picks = rng.choice(flat.size, size=max(1, flat.size // 20), replace=False)
    flat[picks] = rng.choice(np.array([-1, rows, rows + 7, -(2**31)], np.int64), size=picks.size)
    return ids


def _plain(torch: Any, table: Any, ids: Any, offset: int = 0) -> Any:
    """torch indexing: table row id - offset, a zero row outside the table."""
    flat = ids.reshape(-1).to(torch.int64) - offset
    ok = (flat >= 0) & (flat < table.shape[0])
    rows = table[flat.clamp(0, table.shape[0] - 1)].clone()
    rows[~ok] = 0
    return rows.reshape(*ids.shape, table.shape[1]), int((~ok).sum())


def _bits(torch: Any, t: Any) -> Any:
    return t.contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.int16).cpu()


def _same(torch: Any, got: Any, want: Any) -> bool:
    return (
        got.dtype == want.dtype
        and tuple(got.shape) == tuple(want.shape)
        and torch.equal(_bits(torch, got), _bits(torch, want))
    )


def _place(table: Any, where: str, dev: Any) -> Any:
    return table.to(dev) if where == "device" else table.pin_memory()


def test_kernel_gathers_float_rows(dev, rng) -> None:
    import torch

    from engram_trt.native import gather as gather_kernels

    T, L, cols, layer = 37, 3, 5, 1
    for name in DTYPE_CODES:
        dtype = getattr(torch, name)
        for width in WIDTHS:
            host = _table(torch, dtype, width, seed=width * 7 + len(name))
            ids = _ids(rng, T, L, cols, N)
            ids_dev = torch.from_numpy(ids).to(dev)
            want, bad = _plain(torch, host, torch.from_numpy(ids[:, layer, :]))
            for where in ("device", "pinned"):
                table = _place(host, where, dev)
                tag = f"{name} width {width} {where}"
                counter = gather_kernels.new_bad_row_counter(dev)
                out = gather_kernels.gather(ids_dev, table, layer=layer, bad_rows=counter)
                torch.cuda.synchronize()
                assert _same(torch, out.cpu(), want) and int(counter.item()) == bad, (
                    f"kernel gather {tag}: rows = torch indexing, {bad} outside ids counted: dtype {out.dtype}, count "
                    f"{int(counter.item())}"
                )
                # element-aligned table and output: the narrow word path, the same bits
                odd = _place(_table(torch, dtype, width, seed=width * 7 + len(name), offset=1), where, dev)
                buf = torch.full((T * cols * width + 1,), float("nan"), dtype=dtype, device=dev)
                out_odd = buf[1:].view(T, cols, width)
                gather_kernels.gather(ids_dev, odd, layer=layer, out=out_odd)
                torch.cuda.synchronize()
                assert _same(torch, out_odd.cpu(), want), (
                    f"kernel gather {tag}: element-aligned table and output (narrow path) = torch indexing: table "
                    f"address % 16 = {odd.data_ptr() % 16}, out % 16 = {out_odd.data_ptr() % 16}"
                )
                # a rank's share: columns [1, 4) from the slice of global rows [off, off + n)
                off, n = 1001, 2500
                part = _place(host[off : off + n].clone(), where, dev)
                counter = gather_kernels.new_bad_row_counter(dev)
                out_s = gather_kernels.gather(
                    ids_dev, part, layer=layer, row_offset=off, columns=(1, 4), bad_rows=counter
                )
                torch.cuda.synchronize()
                want_s, bad_s = _plain(torch, host[off : off + n], torch.from_numpy(ids[:, layer, 1:4]), off)
                assert _same(torch, out_s.cpu(), want_s) and int(counter.item()) == bad_s, (
                    f"kernel gather_ex {tag}: row slice + columns = torch indexing, outside ids counted: "
                    f"count {int(counter.item())} expected {bad_s}"
                )
                # engram_gather_part: two disjoint slices fill one output, a capped grid
                split = N // 3
                lo, hi = _place(host[:split].clone(), where, dev), _place(host[split:].clone(), where, dev)
                out_p = torch.full((T, cols, width), float("nan"), dtype=dtype, device=dev)
                gather_kernels.gather(ids_dev, lo, layer=layer, out=out_p, keep_outside=True, max_blocks=2)
                gather_kernels.gather(ids_dev, hi, layer=layer, out=out_p, row_offset=split, keep_outside=True)
                torch.cuda.synchronize()
                inside = torch.from_numpy((ids[:, layer, :] >= 0) & (ids[:, layer, :] < N))
                got_p = out_p.cpu()
                assert _same(torch, got_p[inside], want[inside]) and bool(torch.isnan(got_p[~inside].float()).all()), (
                    f"kernel gather_part {tag}: two slices write every inside row once, outside rows kept"
                )


def _run_both(harness: Any, fields: list, inputs: list, in_types: list, make_out: Any, out_type: int) -> list:
    """The build-phase plugin and its serialize -> runtime-phase twin on the same inputs."""
    import torch

    stream = torch.cuda.current_stream().cuda_stream
    outs = []
    h = harness.create("EngramGather", fields, phase=0)
    h2 = harness.roundtrip(h)
    try:
        for handle in (h, h2):
            out = make_out()
            harness.run(handle, inputs, in_types, out, out_type, stream)
            torch.cuda.synchronize()
            outs.append(out)
    finally:
        harness.lib.harness_destroy(h2)
        harness.lib.harness_destroy(h)
    return outs


def test_plugin_gathers_float_rows(dev, rng, harness) -> None:
    import torch

    T, L, cols, layer = 29, 2, 6, 1
    for name, code in DTYPE_CODES.items():
        dtype = getattr(torch, name)
        for width in WIDTHS:
            host = _table(torch, dtype, width, seed=width * 13 + code)
            ids = _ids(rng, T, L, cols, N)
            ids_dev = torch.from_numpy(ids).to(dev)
            want, bad = _plain(torch, host, torch.from_numpy(ids[:, layer, :]))
            fields = gather_fields(layer, L, cols, width, code, 32, N)
            h = harness.create("EngramGather", fields)
            types = harness.output_types(h, [DT["int32"], DT["int64"]])
            harness.lib.harness_destroy(h)
            assert types == [DT[name]], f"plugin EngramGather {name} width {width}: output type = the table's: {types}"
            for where in ("device", "pinned"):
                table = _place(host, where, dev)
                addr = torch.tensor([table.data_ptr()], dtype=torch.int64, device=dev)
                build, runtime = _run_both(
                    harness,
                    fields,
                    [ids_dev, addr],
                    [DT["int32"], DT["int64"]],
                    lambda: torch.full((T, cols, width), float("nan"), dtype=dtype, device=dev),
                    DT[name],
                )
                assert _same(torch, runtime.cpu(), want) and int(torch.count_nonzero(_bits(torch, build))) == 0, (
                    f"plugin EngramGather enqueue {name} width {width} {where} (runtime = torch indexing, "
                    "build phase zero rows)"
                )
            # the counter input: an element-aligned address is read, an odd one is not
            odd = _table(torch, dtype, width, seed=width * 13 + code, offset=1).to(dev)
            counted = fields + [("bad_rows_input", PF_INT32, np.array([1], np.int32))]
            for label, address, want_rows, want_count in (
                ("element-aligned table address read", odd.data_ptr(), want, bad),
                ("odd table address: zero rows, all counted", odd.data_ptr() + 1, None, T * cols),
            ):
                counter = torch.zeros(1, dtype=torch.int64, device=dev)
                inputs = [
                    ids_dev,
                    torch.tensor([address], dtype=torch.int64, device=dev),
                    torch.tensor([counter.data_ptr()], dtype=torch.int64, device=dev),
                ]
                _, out = _run_both(
                    harness,
                    counted,
                    inputs,
                    [DT["int32"], DT["int64"], DT["int64"]],
                    lambda: torch.full((T, cols, width), float("nan"), dtype=dtype, device=dev),
                    DT[name],
                )
                rows_ok = (
                    _same(torch, out.cpu(), want_rows)
                    if want_rows is not None
                    else int(torch.count_nonzero(_bits(torch, out))) == 0
                )
                assert rows_ok and int(counter.item()) == want_count, (
                    f"plugin EngramGather {name} width {width}: {label}: count {int(counter.item())} "
                    f"expected {want_count}"
                )
