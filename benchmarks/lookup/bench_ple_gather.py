#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""PLE lookups of a Qwen4Exp-sized table: bf16 rows of width ple_embed_dim / heads (128
for the published 2048 / 16), ids from the real PLE hash (the kernel library's
ple_hash_packed over random token streams, published layout: base 20,000,000, 8 heads
per n-gram, n-grams up to 3), gathered for decode steps (one token per sequence) and a
prefill step: the UVA gather kernel over a pinned host table, the host gather (CPU
threads into pinned staging + the copy engine) over the same table, and the gather
kernel over an HBM table; each as GB/s of rows delivered and as a share of the
host-to-device link measured in the same run (itself printed against the PCIe 5.0 x16
figure).

The published layout's table (about 82 GB a layer) is larger than the host table
timed here, so the hash's row ids are taken modulo the table's rows: the spread of the
ids (what a cold lookup pays for) is the hash's; the HBM table is smaller still
(random rows of a table many times the L2 cost the same at any size).

``--pages`` (as ``bench gather`` / ``bench cache`` name it): the host table's pages.
``4k`` (default) is torch's pinned allocator, the table the published figures timed;
``thp`` / ``1g`` / ``auto`` an anonymous mapping in transparent huge pages (madvise),
reserved 1 GiB hugetlbfs pages, or the runtime stores' choice
(lookuputil.HostBuffer), registered with CUDA so the UVA
kernel reads the same table. Why: a random row of a 4 KiB-page table costs the host
gather's threads a page walk and the GPU's UVA reads an IOMMU / ATS translation; huge
pages take most of both away, which is what the comparison wants to see.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# engram_trt from this checkout and this folder's modules:
sys.path[:0] = [p for p in (str(REPO / "python"), str(Path(__file__).resolve().parent)) if p not in sys.path]

import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any  # noqa: E402

from lookuputil import PAGE_CHOICES  # noqa: E402
from engram_trt.bench.options import opt  # noqa: E402
from engram_trt.errors import EngramError  # noqa: E402

GiB = 1 << 30
PCIE5_X16_GBPS = 64.0  # 32 GT/s x 16 lanes, 128b/130b: ~63 GB/s each way


@dataclass(kw_only=True)
class PleGatherOptions:
    table_gib: float = opt(32.0, help="pinned host table size in GiB (default: %(default)s)")
    hbm_gib: float = opt(8.0, help="HBM table size in GiB (default: %(default)s)")
    head_dim: int = opt(128, help="row width in bf16 values (ple_embed_dim / heads; default: %(default)s)")
    decode: list[int] = opt([64, 256, 512], help="decode steps: sequences, one token each (default: 64,256,512)")
    prefill: list[int] = opt([8192], help="prefill steps: tokens of one sequence (default: 8192)")
    reps: int = opt(20, argtype=("int_arg", 1, 10000), help="timed repetitions per case (default: %(default)s)")
    seed: int = opt(0, help="token stream seed (default: %(default)s)")
    pages: str = opt(
        "4k",
        choices=PAGE_CHOICES,
        help="host table pages: 4k (torch's pinned allocator; default), thp (transparent huge pages, "
        "madvise), 1g (reserved 1 GiB hugetlbfs pages: reserve them first in "
        "/sys/kernel/mm/hugepages/hugepages-1048576kB/nr_hugepages) or auto (the runtime stores' "
        "choice); huge-page tables are registered with CUDA for the UVA kernel",
    )
    json: str | None = opt(None, help="write the figures as JSON to this file")


def _layout() -> Any:
    from engram_trt.engram.ple_hash import PLEHashLayout

    return PLEHashLayout.from_config(
        vocab_size=248320,
        ngram_size=3,
        heads_per_ngram=8,
        ngram_vocab_size_base=20_000_000,
        make_ngram_vocab_size_divisible_by=128,
        seed=0,
        eos_token_id=248044,
        num_layers=1,
    )


def _ids(torch: Any, layout: Any, tokens: int, decode: bool, num_rows: int, gen: Any) -> Any:
    """int32 ``[tokens, heads]`` row ids from the hash kernel on the GPU, modulo the table."""
    from engram_trt.native.ple import ple_hash_packed

    dev = torch.device("cuda")
    ids = torch.randint(0, 248000, (tokens,), generator=gen, dtype=torch.int32).to(dev)
    S = tokens if decode else 1
    starts = (torch.arange(S + 1, dtype=torch.int32) * (1 if decode else tokens)).to(dev)
    ctx = torch.randint(0, 248000, (S, 2), generator=gen, dtype=torch.int32).to(dev)
    rows = ple_hash_packed(ids, starts, ctx, layout, 0)
    return (rows.to(torch.int64) % num_rows).to(torch.int32).contiguous()


def _fill(torch: Any, table: Any, dev: Any) -> None:
    """Random bf16 rows (never zeros), written 1 GiB at a time from the GPU."""
    chunk = torch.randn(GiB // 2 // table.shape[1], table.shape[1], device=dev, dtype=torch.bfloat16)
    for a in range(0, table.shape[0], chunk.shape[0]):
        b = min(a + chunk.shape[0], table.shape[0])
        table[a:b].copy_(chunk[: b - a], non_blocking=False)


def run(opts: PleGatherOptions) -> int:
    import torch

    from engram_trt.bench.common import dump, event_seconds, measure_limits
    from engram_trt.native import gather as gather_kernels
    from engram_trt.native import library as kernel_library
    from engram_trt.native.hostgather import HostGatherer

    if not torch.cuda.is_available():
        raise EngramError("bench ple-gather needs a CUDA GPU; none is available here")
    if opts.head_dim % 8 or opts.table_gib <= 0 or opts.hbm_gib <= 0:
        raise EngramError("--head-dim must be a multiple of 8 and --table-gib / --hbm-gib positive")
    dev = torch.device("cuda")
    kernel_library.load_library()
    limits = measure_limits(dev)
    h2d = limits["h2d_GBps"]
    print(
        f"link: H2D {h2d:.1f} GB/s measured (pinned 1 GiB copy) = {h2d / PCIE5_X16_GBPS:.0%} of PCIe 5.0 x16's "
        f"{PCIE5_X16_GBPS:.0f} GB/s; HBM copy {limits['hbm_GBps']:.0f} GB/s",
        flush=True,
    )
    row_bytes = opts.head_dim * 2
    t0 = time.perf_counter()
    host, buffer, pages = _host_table(torch, int(opts.table_gib * GiB) // row_bytes, opts.head_dim, opts.pages)
    _fill(torch, host, dev)
    hbm = torch.empty((int(opts.hbm_gib * GiB) // row_bytes, opts.head_dim), dtype=torch.bfloat16, device=dev)
    _fill(torch, hbm, dev)
    huge_gib = _huge_gib(buffer)
    print(
        f"tables: pinned host {opts.table_gib:g} GiB ({host.shape[0]} rows of {row_bytes} B) in {pages}"
        + (f" ({huge_gib:.1f} GiB of transparent huge pages)" if huge_gib is not None else "")
        + f", HBM {opts.hbm_gib:g} GiB, made in {time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    layout = _layout()
    gen = torch.Generator().manual_seed(opts.seed)
    gatherer = HostGatherer(device=dev, max_head_dim=max(512, opts.head_dim))
    cases = [("decode", n) for n in opts.decode] + [("prefill", n) for n in opts.prefill]
    results = {"limits": limits, "pages": opts.pages, "pages_got": pages, "thp_gib": huge_gib, "cases": []}
    print(
        f"{'step':>8} {'tokens':>6} {'rows':>7} {'MB':>7} | {'UVA GB/s':>8} {'/link':>6} | {'host GB/s':>9} "
        f"{'/link':>6} | {'HBM GB/s':>8} {'/link':>6} | UVA/host",
        flush=True,
    )
    for kind, n in cases:
        ids_host_range = _ids(torch, layout, n, kind == "decode", host.shape[0], gen)
        ids_hbm = (ids_host_range.to(torch.int64) % hbm.shape[0]).to(torch.int32)
        ids_cpu = ids_host_range.cpu()
        flat = ids_host_range.reshape(-1, 1)
        ref = host[ids_cpu.reshape(-1).to(torch.int64)]
        got_uva = gather_kernels.gather(flat, host).reshape(-1, opts.head_dim).cpu()
        got_host = gatherer.gather(ids_cpu.reshape(-1, 1), host)[:, 0].cpu()
        if not (torch.equal(got_uva, ref) and torch.equal(got_host, ref)):
            raise EngramError(f"{kind} {n}: a gather path's rows differ from the table's (indexing reference)")
        nbytes = flat.numel() * row_bytes
        t_uva = event_seconds(lambda: gather_kernels.gather(flat, host), opts.reps)
        t_hbm = event_seconds(lambda: gather_kernels.gather(ids_hbm.reshape(-1, 1), hbm), opts.reps)
        times = []
        for _ in range(opts.reps + 1):  # wall time: the CPU threads' gather + the copies, synchronized
            torch.cuda.synchronize()
            a = time.perf_counter()
            gatherer.gather(ids_cpu.reshape(-1, 1), host)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - a)
        t_host = sorted(times[1:])[len(times[1:]) // 2]
        row = {"step": kind, "tokens": n, "rows": flat.numel(), "bytes": nbytes}
        for name, t in (("uva", t_uva), ("host", t_host), ("hbm", t_hbm)):
            row[f"{name}_s"] = t
            row[f"{name}_GBps"] = nbytes / t / 1e9
            row[f"{name}_of_link"] = nbytes / t / 1e9 / h2d
        results["cases"].append(row)
        print(
            f"{kind:>8} {n:>6} {flat.numel():>7} {nbytes / 1e6:>7.2f} | {row['uva_GBps']:>8.1f} "
            f"{row['uva_of_link']:>6.2f} | {row['host_GBps']:>9.1f} {row['host_of_link']:>6.2f} | "
            f"{row['hbm_GBps']:>8.1f} {row['hbm_of_link']:>6.2f} | {t_host / t_uva:>6.2f}x",
            flush=True,
        )
    gatherer.close()
    if buffer is not None:
        del host
        buffer.close()
    dump(results, opts.json)
    return 0


def _host_table(torch: Any, rows: int, head_dim: int, pages: str) -> tuple[Any, Any, str]:
    """(bf16 ``[rows, head_dim]`` host table the GPU can read, its HostBuffer or None,
    its pages in words) for a ``--pages`` choice (module docstring)."""
    if pages == "4k":
        return (
            torch.empty((rows, head_dim), dtype=torch.bfloat16, pin_memory=True),
            None,
            "4 KiB pages (torch's pinned allocator)",
        )
    from lookuputil import HostBuffer, anon_hugepages_kib, pages_mode

    before = anon_hugepages_kib()
    buffer = HostBuffer(rows * head_dim * 2, huge_pages=pages_mode(pages))
    buffer.thp_before = before
    buffer.register()  # the UVA kernel reads it; the host gather's threads read it as it is
    return buffer.tensor.view(torch.bfloat16).view(rows, head_dim), buffer, buffer.pages


def _huge_gib(buffer: Any) -> float | None:
    """GiB of transparent huge pages the table's mapping gained (None: not measured)."""
    before = getattr(buffer, "thp_before", -1)
    if buffer is None or before < 0 or "transparent" not in buffer.pages:
        return None
    from lookuputil import anon_hugepages_kib

    return (anon_hugepages_kib() - before) / 2**20


OPTIONS = PleGatherOptions  # the script's flags, derived as an `engram-trt bench` command's (engram_trt.cli.bench)


def main(argv: list[str] | None = None) -> int:
    from engram_trt.cli.bench import run_script

    return run_script(OPTIONS, run, __doc__ or "", argv, prog=Path(__file__).name)


if __name__ == "__main__":
    sys.exit(main())
