"""Which gather path serves a host table: the UVA kernel or the host gather, per row count.

Why measured, not fixed: on the H200 VM random GPU reads of pinned host memory reach a
tenth of the PCIe link while the host gather (CPU threads + one copy per chunk) comes
near it, but peers report the opposite ordering on machines whose GPUs translate host
pages cheaply (huge pages, no hypervisor). So the runtime times both paths on uniform
random ids at start-up (:func:`calibrate_gather`, about a second), logs the choice, and
asks :meth:`GatherPathChoice.path_for` per step.

Also here: converting a table between the split layout (rows + scales, what the UVA
kernel reads) and the inline layout (each row's scale bytes after it, what the host
gather reads fastest).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from engram_trt.errors import EngramError

log = logging.getLogger(__name__)

PATH_UVA = "uva"
PATH_HOST = "host"
# Decode steps of 4, 64 and 256 tokens x 24 columns, and an 8k-token prefill chunk: the
# faster path changes with the size (a few rows: the UVA kernel, no CPU work at all; a
# prefill chunk: the host gather), so the small sizes are measured too, not inferred.
DEFAULT_CALIBRATION_SIZES = (96, 1536, 6144, 196608)
# How much faster than the UVA kernel the host gather must be, alone, to be chosen. Alone
# each path is timed from ids in hand to rows on the GPU; in a step the host path also
# waits for the hashed row ids to come back to the host and for the gather driver, and its
# CPU threads share the machine with the engine thread, while the UVA kernel replays
# inside the decode graphs with no host work at all. On the H200 (2026-12-01) a decode
# step of 64 tokens (1,536 rows a layer) timed the two paths alone at 123 / 126 us, yet
# in the step the host path cost 1.077 x the step with HBM tables and the UVA kernel
# 1.002 x; at 6,144 rows the host gather was 2.25 x faster alone and won in the step too.
HOST_MARGIN = 1.25


def faster_path(host_s: float, uva_s: float | None) -> str:
    """The path to serve a size from its calibration times (``uva_s`` None: no UVA path):
    the host gather only when it beats the UVA kernel by :data:`HOST_MARGIN`."""
    if uva_s is None or host_s * HOST_MARGIN < uva_s:
        return PATH_HOST
    return PATH_UVA


def inline_table(rows: Any, scales: Any, *, out: Any = None) -> Any:
    """The inline layout ``[N, head_dim + head_dim / quant_block]`` uint8 of a split fp8
    table (rows ``[N, head_dim]``, scales ``[N, head_dim / quant_block]``)."""
    import torch

    if rows.dim() != 2 or scales.dim() != 2 or rows.shape[0] != scales.shape[0]:
        raise EngramError(
            f"rows [N, head_dim] and scales [N, head_dim / quant_block] must share N "
            f"(got {tuple(rows.shape)} and {tuple(scales.shape)})"
        )
    width = rows.shape[1] + scales.shape[1]
    if out is None:
        out = torch.empty((rows.shape[0], width), dtype=torch.uint8, device=rows.device)
    out[:, : rows.shape[1]].copy_(rows.view(torch.uint8))
    out[:, rows.shape[1] :].copy_(scales.view(torch.uint8))
    return out


def split_table(inline: Any, quant_block: int) -> tuple[Any, Any]:
    """(rows, scales) views of an inline fp8 table (strided: ``.contiguous()`` copies)."""
    width = int(inline.shape[1])
    head_dim = width * quant_block // (quant_block + 1)
    if head_dim + head_dim // quant_block != width or head_dim % quant_block:
        raise EngramError(f"width {width} is no head_dim + head_dim / {quant_block}")
    return inline[:, :head_dim], inline[:, head_dim:]


@dataclass
class GatherPathChoice:
    """Measured seconds per path and row count, and the faster path at each."""

    sizes: tuple[int, ...]
    seconds: dict[str, list[float]] = field(default_factory=dict)  # path -> median seconds per size
    chosen: dict[int, str] = field(default_factory=dict)

    def path_for(self, num_rows: int) -> str:
        """The path measured faster at the calibrated size nearest ``num_rows`` (in log
        scale: 20k rows is nearer 6k than 196k)."""
        if not self.chosen:
            return PATH_HOST
        nearest = min(self.sizes, key=lambda s: abs(math.log(max(num_rows, 1)) - math.log(s)))
        return self.chosen[nearest]

    def to_dict(self) -> dict[str, Any]:
        return {
            "sizes": list(self.sizes),
            "seconds": self.seconds,
            "chosen": {str(k): v for k, v in self.chosen.items()},
        }

    def describe(self) -> str:
        parts = []
        for i, n in enumerate(self.sizes):
            times = ", ".join(f"{p} {s[i] * 1e6:.0f} us" for p, s in self.seconds.items())
            parts.append(f"{n} rows: {self.chosen[n]} ({times})")
        return "; ".join(parts)


def _median_wall(fn: Callable[[int], Any], reps: int, sync: Callable[[], None]) -> float:
    fn(0)
    sync()
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        fn(i)
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def calibrate_gather(
    rows: Any,
    scales: Any = None,
    *,
    gatherer: Any,
    quant_block: int = 32,
    layout: str = "split",
    uva_rows: Any = None,
    uva_scales: Any = None,
    sizes: tuple[int, ...] = DEFAULT_CALIBRATION_SIZES,
    num_cols: int = 24,
    reps: int = 5,
    seed: int = 0,
) -> GatherPathChoice:
    """Time the host gather (``gatherer`` on ``rows`` / ``scales`` in ``layout``) and, if
    the table is GPU-readable, the UVA kernel, on uniform random ids at each size; return
    the path per size (:func:`faster_path`; logged).

    ``uva_rows`` / ``uva_scales``: the split table in pinned or registered memory for the
    UVA kernel; by default ``rows`` / ``scales`` when they are split and GPU-readable;
    None there (an inline or unregistered table) means the host gather is the only path.
    Each measurement is the median wall time from the call to the stream's completion
    over ``reps`` fresh id sets, as a step would see it.
    """
    import torch

    from engram_trt.native import gather as gather_kernels
    from engram_trt.native import library as kernel_library

    device = gatherer.device
    if (
        uva_rows is None
        and layout == "split"
        and kernel_library.pointer_kind(rows) == "host"
        and (scales is None or kernel_library.pointer_kind(scales) == "host")
    ):
        uva_rows, uva_scales = rows, scales
    num_rows = int(rows.shape[0])
    gen = torch.Generator().manual_seed(seed)
    choice = GatherPathChoice(sizes=tuple(int(s) for s in sizes))
    paths = [PATH_HOST] + ([PATH_UVA] if uva_rows is not None else [])
    for p in paths:
        choice.seconds[p] = []

    def sync() -> None:
        torch.cuda.synchronize(device)

    for n in choice.sizes:
        tokens = max(1, n // num_cols)
        ids = [torch.randint(0, num_rows, (tokens, num_cols), generator=gen, dtype=torch.int32) for _ in range(reps)]
        out = torch.empty((tokens, num_cols, _head_dim(rows, quant_block, layout)), dtype=torch.bfloat16, device=device)
        host_ids = [i.pin_memory() for i in ids]
        # On the GPU too: the UVA kernel reads them, and so does the host gather's dequant
        # with the scales in HBM (as a step's hash kernel leaves them there).
        dev_ids = [i.to(device) for i in ids] if uva_rows is not None or layout == "hbm-scales" else None
        choice.seconds[PATH_HOST].append(
            _median_wall(
                lambda i: gatherer.gather(
                    host_ids[i],
                    rows,
                    scales,
                    quant_block=quant_block,
                    out=out,
                    layout=layout,
                    ids_dev=dev_ids[i] if layout == "hbm-scales" else None,
                ),
                reps,
                sync,
            )
        )
        if uva_rows is not None:
            choice.seconds[PATH_UVA].append(
                _median_wall(
                    lambda i: gather_kernels.gather(dev_ids[i], uva_rows, uva_scales, quant_block=quant_block, out=out),
                    reps,
                    sync,
                )
            )
        choice.chosen[n] = faster_path(
            choice.seconds[PATH_HOST][-1], choice.seconds[PATH_UVA][-1] if uva_rows is not None else None
        )
    log.info("gather path calibration (%d-row table): %s", num_rows, choice.describe())
    return choice


def _head_dim(rows: Any, quant_block: int, layout: str) -> int:
    """Elements per row: the width of a split table (fp8 bytes or bf16 values), the value
    part of an inline one."""
    width = int(rows.shape[1])
    return width * quant_block // (quant_block + 1) if layout == "inline" else width
