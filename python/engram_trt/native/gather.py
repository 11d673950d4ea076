"""ctypes bindings of the GPU row gather (``plugins/kernels/gatherKernels.h``,
``gatherKernel.cu``, ``gatherApi.cpp``): rows by id from device tables or pinned /
registered host tables read through UVA, fp8 rows dequantized to bf16, with the argument
checks the host gather and the hot-row cache share (:func:`table_code`, :func:`ids_view`,
:func:`gather_out`) and the bad-row counter.

Choosing a gather per table: :func:`gather` reads the table on the GPU (device
memory, or pinned / registered host memory through UVA); :func:`engram_trt.native.hostgather.host_gather`
gathers on the CPU's threads and sends contiguous chunks. On the H200 VM, for a pinned host
table, the second was measured 3.3-3.5x faster than the UVA kernel for 196,608 rows and
1.5-2x for 6,144 rows (two runs, ``docs/benchmarks.md``), so it is the path for host
tables.
"""

from __future__ import annotations

import ctypes
from typing import Any

from engram_trt.errors import EngramError
from engram_trt.native.library import (
    EntryPoints,
    check,
    device_guard,
    pointer_kind,
    ptr,
    same_device,
    stream_of,
    torch_module,
)

# enum EngramTableDtype of gatherKernels.h
TABLE_FP8_E4M3 = 0
TABLE_BF16 = 1
TABLE_F16 = 2  # f16 / f32 rows: the GPU gather (gather, EngramGather) only, not the host gather
TABLE_F32 = 3

_i32, _i64, _vp = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
_ENTRY = EntryPoints(
    {
        "engram_gather_check_table": [_i32, _i32, _i32],
        "engram_gather": [_vp, _i64, _i32, _i64, _vp, _vp, _i64, _i32, _i32, _i32, _vp, _vp, _vp],
        "engram_gather_ex": [_vp, _i64, _i32, _i64, _vp, _vp, _i64, _i64, _i32, _i32, _i32, _vp, _vp, _vp],
        "engram_gather_part": [_vp, _i64, _i32, _i64, _vp, _vp, _i64, _i64, _i32, _i32, _i32, _i32, _i32, _vp, _vp],
        "engram_gather_raw": [_vp, _i64, _vp, _vp, _i64, _i64, _i32, _vp, _vp, _i32, _vp],
    }
)
library = _ENTRY.library
call = _ENTRY.call  # one of this family's entry points (the hot-row cache's work-table gather)


def table_code(rows: Any, scales: Any, quant_block: int, float_rows: bool = False) -> tuple[int, int, int]:
    """(table dtype code, num_rows, head_dim) after checking rows / scales. ``float_rows``:
    f16 and f32 tables are taken too (the GPU gather reads them; the host gather and the
    hot-row cache's work table take fp8 / bf16 only)."""
    torch = torch_module()
    fp8_types = (torch.uint8,) + ((torch.float8_e4m3fn,) if hasattr(torch, "float8_e4m3fn") else ())
    floats = {torch.bfloat16: TABLE_BF16}
    if float_rows:
        floats.update({torch.float16: TABLE_F16, torch.float32: TABLE_F32})
    check("rows", rows, fp8_types + tuple(floats), 2, where="any")
    num_rows, head_dim = rows.shape
    if rows.dtype in floats:
        if scales is not None:
            raise EngramError(f"scales must be None for a {rows.dtype} table (only fp8 tables have scales)")
        return floats[rows.dtype], num_rows, head_dim
    scale_types = (torch.uint8,) + ((torch.float8_e8m0fnu,) if hasattr(torch, "float8_e8m0fnu") else ())
    if scales is None:
        raise EngramError("an fp8 table needs scales [rows, head_dim / quant_block] (ue8m0 bytes)")
    check("scales", scales, scale_types, 2, where="any")
    if quant_block <= 0 or head_dim % quant_block or tuple(scales.shape) != (num_rows, head_dim // quant_block):
        raise EngramError(
            f"scales must be [rows, head_dim / quant_block] = {(num_rows, head_dim // max(quant_block, 1))} "
            f"(got {tuple(scales.shape)}, quant_block {quant_block})"
        )
    return TABLE_FP8_E4M3, num_rows, head_dim


def column_range(columns: Any, cols: int) -> int:
    """The first column of a ``columns = (begin, end)`` argument, checked against ``cols``."""
    if not (
        isinstance(columns, (tuple, list))
        and len(columns) == 2
        and all(type(c) is int for c in columns)
        and 0 <= columns[0] < columns[1] <= cols
    ):
        raise EngramError(
            f"columns must be (begin, end) with 0 <= begin < end <= {cols} (the ids' columns); got {columns!r}"
        )
    return columns[0]


def ids_view(ids: Any, layer: int | None, where: str, columns: Any = None) -> tuple[int, int, int, int]:
    """(num_tokens, num_cols, token stride, byte offset of the first id) of [T, cols] or
    [T, L, cols] ids; ``columns = (begin, end)``: only those, read in place (no copy)."""
    torch = torch_module()
    if columns is not None and isinstance(ids, torch.Tensor) and ids.dim() in (2, 3):
        column_range(columns, ids.shape[-1])  # a bad range is named before any device check
    check("ids", ids, (torch.int32,), None, where=where)
    if ids.dim() == 2:
        if layer not in (None, 0):
            raise EngramError(f"layer={layer} given for 2-D ids [T, cols]; pass [T, L, cols] ids to pick a layer")
        T, cols, stride, offset = ids.shape[0], ids.shape[1], ids.shape[1], 0
    elif ids.dim() == 3:
        T, L, cols = ids.shape
        if layer is None or not 0 <= layer < L:
            raise EngramError(f"layer must be in [0, {L}) for ids [T, L, cols] (got {layer})")
        stride, offset = L * cols, layer * cols * 4
    else:
        raise EngramError(f"ids must be [T, cols] or [T, L, cols] (got shape {tuple(ids.shape)})")
    if columns is None:
        return T, cols, stride, offset
    begin = column_range(columns, cols)
    return T, columns[1] - begin, stride, offset + begin * 4


def gather_out(out: Any, T: int, cols: int, head_dim: int, device: Any, dtype: Any = None) -> Any:
    """The gather's output ``[T, cols, head_dim]``: ``out`` checked, or a new tensor;
    ``dtype`` (default bf16) is the rows' type: bf16 for fp8 and bf16 tables, else the table's."""
    torch = torch_module()
    dtype = torch.bfloat16 if dtype is None else dtype
    if out is None:
        return torch.empty((T, cols, head_dim), dtype=dtype, device=device)
    check("out", out, (dtype,), 3)
    if tuple(out.shape) != (T, cols, head_dim) or out.device != device:
        raise EngramError(
            f"out must be {dtype} [T, cols, head_dim] = {(T, cols, head_dim)} on {device} "
            f"(got {tuple(out.shape)} on {out.device})"
        )
    return out


def gather(
    ids: Any,
    rows: Any,
    scales: Any = None,
    *,
    layer: int | None = None,
    quant_block: int = 32,
    out: Any = None,
    bad_rows: Any = None,
    row_offset: int = 0,
    columns: tuple[int, int] | None = None,
    keep_outside: bool = False,
    max_blocks: int = 0,
) -> Any:
    """Rows ``[T, cols, head_dim]`` read on the GPU: bf16 for an fp8 table (dequantized),
    the table's dtype for a bf16 / f16 / f32 table (its rows as they are, any head_dim).

    ``ids``: CUDA int32 ``[T, cols]``, or ``[T, L, cols]`` (hash output) with ``layer``.
    ``rows``: ``[num_rows, head_dim]`` fp8 bytes (uint8 / float8_e4m3fn, with ``scales``
    ``[num_rows, head_dim/quant_block]`` ue8m0 bytes) or bf16 / float16 / float32; a CUDA
    tensor, or a CPU tensor in pinned / registered memory (read through UVA). Ids outside
    the table give zero rows.

    A tensor-parallel rank's share (``distributed/sharding.py``): ``columns = (begin,
    end)`` gathers only those columns of the ids (out ``[T, end - begin, head_dim]``,
    read in place from the ids), and ``rows`` / ``scales`` may be a row slice of the
    table, global rows ``[row_offset, row_offset + num_rows)``, gathered with the global
    ids: an id outside the slice (below ``row_offset`` included) gives a zero row and is
    counted, and nothing outside the slice is read. ``row_offset`` 0 calls
    ``engram_gather`` (as before), another ``engram_gather_ex``.

    ``bad_rows``: None, or a CUDA int64 tensor of one element on ids' device: each output
    row whose id is outside ``[row_offset, row_offset + num_rows)`` adds 1 to it on the
    GPU (atomically; it is never reset here). A runtime zeroes it once, passes it to every
    gather, and reads it every N steps or in a debug mode (one small device-to-host copy,
    no sync per gather), raising on a nonzero count: a zero row from a wrong id or an
    unbound table is otherwise indistinguishable from data.

    ``keep_outside``: an output row whose id is outside the table (slice) is left as it
    is in ``out`` (required) instead of zeroed, so two gathers with disjoint slices fill
    one output (the hot-row cache's hits and misses). ``max_blocks`` > 0 caps the grid
    below one wave: a UVA gather of host rows keeps its reads in flight on a few
    multiprocessors and leaves the rest to other work. Either calls
    ``engram_gather_part``, which counts nothing (``bad_rows`` must be None).
    """
    partial = bool(keep_outside) or max_blocks != 0
    if type(max_blocks) is not int or max_blocks < 0:
        raise EngramError(f"max_blocks must be an integer >= 0 (0: one full wave of blocks); got {max_blocks!r}")
    if partial and bad_rows is not None:
        raise EngramError("keep_outside / max_blocks count no bad rows: pass bad_rows=None")
    if keep_outside and out is None:
        raise EngramError("keep_outside leaves rows of out as they are: pass the out tensor the other gather fills")
    if type(row_offset) is not int or not 0 <= row_offset <= 2**31 - 1:
        raise EngramError(
            f"row_offset must be an integer in [0, 2^31 - 1] (the global row id of the table's first "
            f"row; row ids are int32); got {row_offset!r}"
        )
    T, cols, stride, byte_offset = ids_view(ids, layer, "cuda", columns)
    dtype, num_rows, head_dim = table_code(rows, scales, quant_block, float_rows=True)
    device = ids.device
    for name, t in (("rows", rows), ("scales", scales)):
        if t is None:
            continue
        if t.is_cuda:
            same_device(device, **{name: t})
        elif pointer_kind(t) != "host":
            raise EngramError(
                f"{name} is in plain host memory the GPU cannot read; pin it "
                f"(tensor.pin_memory()) or register it (native.library.register_host_memory)"
            )
    out = gather_out(out, T, cols, head_dim, device, None if dtype == TABLE_FP8_E4M3 else rows.dtype)
    if bad_rows is not None:
        torch = torch_module()
        check("bad_rows", bad_rows, (torch.int64,))
        if bad_rows.numel() != 1:
            raise EngramError(f"bad_rows must hold one int64 (got shape {tuple(bad_rows.shape)})")
        same_device(device, bad_rows=bad_rows)
    ids_ptr = ctypes.c_void_p(ids.data_ptr() + byte_offset)
    with device_guard(device.index):
        if partial:
            call(
                "engram_gather_part",
                ids_ptr,
                T,
                cols,
                stride,
                ptr(rows),
                ptr(scales),
                num_rows,
                row_offset,
                head_dim,
                dtype,
                quant_block,
                int(bool(keep_outside)),
                max_blocks,
                ptr(out),
                stream_of(device),
            )
        elif row_offset == 0:  # the form every library version has
            call(
                "engram_gather",
                ids_ptr,
                T,
                cols,
                stride,
                ptr(rows),
                ptr(scales),
                num_rows,
                head_dim,
                dtype,
                quant_block,
                ptr(out),
                ptr(bad_rows),
                stream_of(device),
            )
        else:
            call(
                "engram_gather_ex",
                ids_ptr,
                T,
                cols,
                stride,
                ptr(rows),
                ptr(scales),
                num_rows,
                row_offset,
                head_dim,
                dtype,
                quant_block,
                ptr(out),
                ptr(bad_rows),
                stream_of(device),
            )
    return out


def new_bad_row_counter(device: Any = None) -> Any:
    """A zeroed int64 ``[1]`` CUDA tensor to pass as :func:`gather`'s ``bad_rows``."""
    torch = torch_module()
    return torch.zeros(1, dtype=torch.int64, device="cuda" if device is None else device)


def check_bad_rows(counter: Any, *, what: str = "Engram gather", reset: bool = True) -> None:
    """Raise EngramError if the bad-row counter is nonzero (else, with ``reset``, keep it
    at 0). Reading it waits for the work queued before it (one 8-byte copy): call it every
    N steps or in a debug mode, not after every gather."""
    n = int(counter.item())
    if n:
        if reset:
            counter.zero_()
        raise EngramError(
            f"{what}: {n} row(s) read no table (ids outside [0, num_rows), or a table address that is "
            f"0 / misaligned / an fp8 table without scales) and came back as zero rows; check the table "
            f"bindings and that the tables match the engine's layout"
        )
