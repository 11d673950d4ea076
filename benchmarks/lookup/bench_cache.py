#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""`python benchmarks/lookup/bench_cache.py`: prefill chunks of real row ids through de-duplication and the
HBM hot-row cache, against the cold host gather of the same ids (issue 11, target 2).

Ids: 8k-token chunks of text hashed by the DeepSeek-V4.1-like spec of
idstreams.py (2 layers x 24 columns; 196,608 lookups per layer and
chunk); tables: each layer's host table (random bytes; 24.75 GiB for both layers at the
default column size). Per layer a :class:`~engram_trt.cache.hotcache.HotRowCache` of
``--capacity-fraction`` of the layer's rows (5%) is warmed on ``--warm`` chunks, then
``--measure`` further chunks are timed, each as the wall time from the call to the
stream's completion, through three paths: the cache; de-duplication alone (a cache of 0
rows); the cold host gather of all lookups (the baseline). Every cache output is checked
bit for bit against the cold gather's. Delivered GB/s counts lookups x 264 bytes, so
>= 2x the link (the sequential pinned host-to-device copy measured in the same run) is
target 2. ``--simulate-column-rows`` also runs the cache's policy alone (no table, no
data) on ids hashed for DeepSeek-V4.1-sized columns (~16M rows, 198 GiB of tables a
128 GiB host cannot hold) to report the hit rate such a table's 5% cache would have.

Two warmings of the cache, reported side by side: "history", the online LFU trained by
running the ``--warm`` chunks through it; and "offline", a cache that starts from
per-row counts (``--offline-counts``: by default counted over those same warm-up
chunks, or a file of ``rowcounts.py``), which loads its most frequent rows
before the first measured chunk and runs no history. Either way the counts come from
chunks disjoint from the measured ones (checked, and said in the output). On CUDA the
cache's plan and admission are the fused kernels (``cacheKernel.cu``) and each step is
one library call (``engram_cache_step``); ``--ab-phases`` runs a twin of each cache that
makes the same calls phase by phase from Python, on the same chunks in alternating turns;
``--breakdown`` times each phase of a step (those steps run phase by phase); ``--ids-on
device`` hands the caches each chunk's ids on the GPU, where a step's hash kernel leaves
them (default: pinned host memory, which the step uploads).

Host tables: ``--layouts`` (default: hbm-scales, the runtime's host layout for fp8
tables: the values in host memory, the scale bytes on the GPU) and ``--pages`` (default
auto: the runtime's choice of huge pages). Several layouts run in one process, taking
turns on every measured chunk (cacherun.py), so they are compared
on the same machine start; every row of the report names its layout. The host gather's
threads spin ``--spin-us`` (300 us) before they sleep: a step wakes them when its plan
is enqueued, and the spin covers the plan's wait, so the fetch does not pay their
wake-up.

``--dry-run`` runs the same logic on the CPU (the torch transfer path, a small spec, few
chunks) and checks exactness; its figures are no measurement of the target machine.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# engram_trt from this checkout and this folder's modules:
sys.path[:0] = [p for p in (str(REPO / "python"), str(Path(__file__).resolve().parent)) if p not in sys.path]

import logging  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from cacheoptions import DEFAULT_LAYOUT, DEFAULT_SPIN_US, LAYOUTS, CacheOptions  # noqa: E402
from cachereport import plot_report, print_report, print_simulation  # noqa: E402
from cacherun import run_cpu, run_gpu  # noqa: E402
from lookuputil import GiB, ROW_BYTES, write_json  # noqa: E402
from idstreams import (  # noqa: E402
    CHUNK_TOKENS,
    DEFAULT_COLUMN_ROWS,
    layer_list,
    chunk_row_ids,
    chunk_stats,
    default_tokens_path,
    load_tokens,
    make_layout,
    prepare_tokens,
    save_tokens,
)
from engram_trt.errors import EngramError  # noqa: E402

log = logging.getLogger(__name__)

__all__ = ["CacheOptions", "DEFAULT_LAYOUT", "DEFAULT_SPIN_US", "LAYOUTS", "policy_hit_rates", "run"]


def _token_stream(opts: CacheOptions) -> Any:
    path = opts.tokens or default_tokens_path()
    if Path(path).is_file():
        return load_tokens(path)
    if opts.tokens is not None:
        return load_tokens(path)  # names the missing file and how to make it
    log.info("no token file at %s: tokenizing %.1f MB of text", path, opts.text_mb)
    stream = prepare_tokens(opts.text_mb)
    save_tokens(stream, path)
    return stream


def _host_layouts(opts: CacheOptions) -> list[str]:
    """The layouts to run: ``--layouts``, else ``--layout``, else the runtime's."""
    if opts.layouts is not None and opts.layout is not None and opts.layouts != [opts.layout]:
        raise EngramError(f"--layout {opts.layout} and --layouts {','.join(opts.layouts)} disagree: give one of them")
    layouts = opts.layouts or [opts.layout or DEFAULT_LAYOUT]
    if len(set(layouts)) != len(layouts):
        raise EngramError(f"--layouts names a layout twice ({','.join(layouts)})")
    return layouts


def run(opts: CacheOptions) -> int:
    import torch

    if not opts.dry_run and not torch.cuda.is_available():
        raise EngramError("bench cache needs a CUDA GPU; run with --dry-run to exercise the logic on the CPU")
    if not 0.0 <= opts.capacity_fraction <= 1.0:
        raise EngramError(f"--capacity-fraction must be in [0, 1] (got {opts.capacity_fraction})")
    column_rows = opts.column_rows or (4096 if opts.dry_run else DEFAULT_COLUMN_ROWS)
    warm = opts.warm if opts.warm is not None else (6 if opts.dry_run else 448)
    measure = opts.measure if opts.measure is not None else (3 if opts.dry_run else 64)
    if measure < 1 or warm < 0:
        raise EngramError("--measure must be >= 1 and --warm >= 0")
    layouts = _host_layouts(opts)
    if opts.dry_run and (opts.ab_phases or opts.ab_serial or opts.ab_uva or opts.ids_on == "device"):
        raise EngramError(
            "--ab-phases, --ab-serial, --ab-uva and --ids-on device compare the GPU's whole step and its "
            "device ids: the dry run has neither (it runs the torch path on the CPU); drop them or run "
            "on a GPU"
        )
    if opts.ab_phases + opts.ab_serial + opts.ab_uva > 1:
        raise EngramError("--ab-phases, --ab-serial and --ab-uva each run one twin per cache: pick one (or run twice)")
    if opts.uva_share is not None and not 0.0 <= opts.uva_share <= 1.0 or (opts.uva_blocks or 0) < 0:
        raise EngramError(
            f"--uva-share must be in [0, 1] and --uva-blocks >= 0 (got {opts.uva_share}, {opts.uva_blocks})"
        )
    if opts.spin_us < 0:
        raise EngramError(f"--spin-us must be >= 0 (got {opts.spin_us})")
    stream = _token_stream(opts)
    layout = make_layout(column_rows, stream.compressed_vocab_size, stream.pad_id)
    layers = layer_list(opts.layers, layout.num_layers)
    t0 = time.perf_counter()
    chunks = list(chunk_row_ids(stream, layout, first_chunk=opts.first_chunk, num_chunks=warm + measure))
    if len(chunks) < warm + measure:
        raise EngramError(
            f"the token stream holds {len(chunks)} chunks from --first-chunk {opts.first_chunk}, "
            f"fewer than --warm + --measure = {warm + measure}; use more text (--text-mb)"
        )
    log.info("hashed %d chunks of %d tokens in %.1f s", len(chunks), CHUNK_TOKENS, time.perf_counter() - t0)
    measured = (opts.first_chunk + warm, opts.first_chunk + warm + measure)
    offline, offline_text = _offline_counts(opts, stream, layout, layers, chunks[:warm], measured)
    report: dict[str, Any] = {
        "tokens": stream.meta(),
        "column_rows": column_rows,
        "table_rows": [int(r) for r in layout.table_rows],
        "table_gib": float(layout.table_rows.sum()) * ROW_BYTES / GiB,
        "layout": ",".join(layouts),
        "layouts": layouts,
        "pages": opts.pages,
        "spin_us": opts.spin_us,
        "capacity_fraction": opts.capacity_fraction,
        "warm_chunks": warm,
        "measured_chunks": measure,
        "measured_range": list(measured),
        "offline_counts": offline_text,
        "stream_stats": chunk_stats(chunks[warm:], layout),
        "dry_run": opts.dry_run,
    }
    if opts.dry_run:
        report.update(run_cpu(opts, layout, layers, chunks, warm, offline, layouts))
        report["link_GBps"] = None
    else:
        report.update(run_gpu(opts, layout, layers, chunks, warm, offline, layouts))
    # The measured part is printed and written before the simulation, which runs last
    # (minutes at V4.1 column sizes): a run cut short keeps it.
    print_report(report)
    if opts.plot:
        plot_report(report, opts.plot)
    if opts.simulate_column_rows and not opts.dry_run:
        if opts.json not in (None, "-"):
            write_json(report, opts.json)
        report["simulation"] = _simulate(opts, stream, layers, warm, measure)
        print_simulation(report["simulation"])
    if opts.json is not None:
        write_json(report, opts.json)
    return 0


def _offline_counts(
    opts: CacheOptions, stream: Any, layout: Any, layers: list[int], history: list[Any], measured: tuple[int, int]
) -> tuple[dict[int, Any] | None, str | None]:
    """The offline-warmed cache's counts per layer, and what they are (None: no such cache)."""
    from rowcounts import check_disjoint, count_rows, load_row_counts

    source = str(opts.offline_counts)
    if source == "none":
        return None, None
    table_rows = [int(r) for r in layout.table_rows]
    a, b = measured
    if source == "history":
        if not history:
            return None, None
        t0 = time.perf_counter()
        counts = count_rows(history, table_rows, layers)
        log.info("counted the warm-up chunks' rows in %.1f s", time.perf_counter() - t0)
        first = opts.first_chunk
        return counts, (
            f"counts over the warm-up chunks {first}..{first + len(history) - 1} of the token stream, "
            f"disjoint from the measured chunks {a}..{b - 1}"
        )
    rc = load_row_counts(source)
    text = check_disjoint(rc, stream, measured, layout, layers)
    return {li: rc.counts[li] for li in layers}, text


def _simulate(opts: CacheOptions, stream: Any, layers: list[int], warm: int, measure: int) -> dict[str, Any]:
    """The cache's policy alone on ids for larger columns, both warmings (offline counts
    over the warm-up chunks): hit rates, no data."""
    import torch

    from rowcounts import count_rows
    from engram_trt.cache.hotcache import CachePolicy

    layout = make_layout(opts.simulate_column_rows, stream.compressed_vocab_size, stream.pad_id)
    dev = torch.device("cuda", torch.cuda.current_device())
    chunks = list(chunk_row_ids(stream, layout, first_chunk=opts.first_chunk, num_chunks=warm + measure))
    offline = None
    if opts.offline_counts != "none" and warm:  # a counts file is for the benchmark's own layout, not this one
        offline = count_rows(chunks[:warm], [int(r) for r in layout.table_rows], layers)
    step_rows = CHUNK_TOKENS * layout.n_hash_cols
    out = []
    for li in layers:
        rows = int(layout.table_rows[li])
        entry: dict[str, Any] = {"layer": li, "table_rows": rows}
        for name in ("history", "offline"):
            if name == "offline" and offline is None:
                continue
            policy = CachePolicy(
                rows,
                int(opts.capacity_fraction * rows),
                device=dev,
                admit_budget=opts.admit_budget,
                sample_factor=opts.sample_factor,
                seed=opts.seed,
                max_step_rows=step_rows,
                initial_counts=offline[li] if name == "offline" else None,
            )
            part = {
                "capacity_rows": policy.capacity,
                **policy_hit_rates(policy, chunks, li, warm, opts.admit_every, history=name == "history"),
            }
            if name == "history":
                entry.update(part)
            else:
                entry["offline"] = part
            del policy
            torch.cuda.empty_cache()
        out.append(entry)
    return {
        "column_rows": opts.simulate_column_rows,
        "table_gib": float(layout.table_rows.sum()) * ROW_BYTES / GiB,
        "layers": out,
    }


def policy_hit_rates(
    policy: Any, chunks: list[Any], layer: int, warm: int, admit_every: int, *, history: bool
) -> dict[str, float]:
    """A cache policy alone (no data) through ``chunks`` of one layer's ids, replacing
    every ``admit_every`` steps as HotRowCache does: its ``hit_rate`` (distinct rows),
    ``unique_fraction`` and ``fetch_fraction`` (per lookup) over the chunks after the
    first ``warm``. ``history``: the warm chunks run through it first; else they are
    skipped (a policy warmed from offline counts of them)."""
    import torch

    unique = hits = lookups = 0
    for k, chunk in enumerate(chunks):
        if not history and k < warm:
            continue
        plan = policy.plan(torch.from_numpy(chunk[:, layer, :].copy()))
        policy.finish(plan, replace=(policy.steps + 1) % admit_every == 0)  # HotRowCache's cadence
        if k >= warm:
            unique += plan.num_unique
            hits += plan.num_unique - plan.num_miss
            lookups += plan.num_lookups
    return {
        "hit_rate": hits / max(1, unique),
        "unique_fraction": unique / max(1, lookups),
        "fetch_fraction": (unique - hits) / max(1, lookups),
    }


OPTIONS = CacheOptions  # the script's flags, derived as an `engram-trt bench` command's (engram_trt.cli.bench)


def main(argv: list[str] | None = None) -> int:
    from engram_trt.cli.bench import run_script

    return run_script(OPTIONS, run, __doc__ or "", argv, prog=Path(__file__).name)


if __name__ == "__main__":
    sys.exit(main())
