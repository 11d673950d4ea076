"""`engram-trt bench cache`: prefill chunks of real row ids through de-duplication and the
HBM hot-row cache, against the cold host gather of the same ids (issue 11, target 2).

Ids: 8k-token chunks of text hashed by the DeepSeek-V4.1-like spec of
:mod:`engram_trt.bench.idstreams` (2 layers x 24 columns; 196,608 lookups per layer and
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
chunks, or a file of ``engram-trt bench rowcounts``), which loads its most frequent rows
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
turns on every measured chunk (:mod:`engram_trt.bench.cacherun`), so they are compared
on the same machine start; every row of the report names its layout. The host gather's
threads spin ``--spin-us`` (300 us) before they sleep: a step wakes them when its plan
is enqueued, and the spin covers the plan's wait, so the fetch does not pay their
wake-up.

``--dry-run`` runs the same logic on the CPU (the torch transfer path, a small spec, few
chunks) and checks exactness; its figures are no measurement of the target machine.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from engram_trt.bench.cachereport import plot_report, print_report, print_simulation
from engram_trt.bench.cacherun import run_cpu, run_gpu
from engram_trt.bench.lookuputil import GiB, PAGE_CHOICES, ROW_BYTES, str_list, write_json
from engram_trt.bench.idstreams import (
    CHUNK_TOKENS,
    DEFAULT_COLUMN_ROWS,
    V41_COLUMN_ROWS,
    layer_list,
    chunk_row_ids,
    chunk_stats,
    default_tokens_path,
    load_tokens,
    make_layout,
    prepare_tokens,
    save_tokens,
)
from engram_trt.errors import EngramError

log = logging.getLogger(__name__)

LAYOUTS = ("inline", "split", "hbm-scales")
# The runtime's host layout for fp8 tables (runtime/prefetch.py: the scales copied to the
# GPU unless ENGRAM_TRT_HBM_SCALES=0 or they would not fit): what the cache is measured in.
DEFAULT_LAYOUT = "hbm-scales"
DEFAULT_SPIN_US = 300  # above a prefill chunk's plan (~150-180 us on the H200), from the wake to the fetch


def add_cache_arguments(p: Any) -> None:
    p.add_argument("--tokens", type=Path, default=None,
                   help="token file from `engram-trt bench idstream` (default: the cache's; made if missing and the "
                        "tokenizer is installed)")
    p.add_argument("--text-mb", type=float, default=16.0, help="MB of text when the token file is made here")
    p.add_argument("--column-rows", type=int, default=None,
                   help=f"rows per column (default {DEFAULT_COLUMN_ROWS}: 24.75 GiB of tables; --dry-run: 4096)")
    p.add_argument("--layers", default="0,1", help="Engram layers to run, comma-separated (default 0,1)")
    p.add_argument("--capacity-fraction", type=float, default=0.05, help="cache rows / table rows (default 0.05)")
    p.add_argument("--admit-budget", type=int, default=None,
                   help="replacements tried per step at most (default: the cache's, min(capacity, 8192))")
    p.add_argument("--sample-factor", type=int, default=4, help="eviction sample window / budget (default 4)")
    p.add_argument("--admit-every", type=int, default=4,
                   help="try replacements every N steps once full (default 4; scripts/cache_policy_sweep.py gives the "
                        "hit rates of cadences and budgets)")
    p.add_argument("--warm", type=int, default=None,
                   help="warm-up chunks: the history the cache's counts learn from (default 448 = 3.7M tokens; "
                        "--dry-run 6)")
    p.add_argument("--measure", type=int, default=None, help="timed chunks after the warm-up (default 64; --dry-run 3)")
    p.add_argument("--first-chunk", type=int, default=0, help="first chunk of the token stream (default 0)")
    p.add_argument("--layout", choices=LAYOUTS, default=None,
                   help=f"host table layout (default {DEFAULT_LAYOUT}, the runtime's for fp8 tables); one of --layouts")
    p.add_argument("--layouts", type=str_list(LAYOUTS), default=None, metavar="LIST",
                   help="host table layouts to compare in this one process, comma-separated, e.g. inline,hbm-scales "
                        "(they take turns on every measured chunk)")
    p.add_argument("--pages", choices=PAGE_CHOICES, default="auto",
                   help="host table pages: auto (the runtime's choice: free reserved 1 GiB pages, else reserved "
                        "hugetlbfs pages, else transparent huge pages; default), 4k, thp (madvise) or 1g (reserved "
                        "1 GiB pages)")
    p.add_argument("--spin-us", type=int, default=DEFAULT_SPIN_US,
                   help=f"host gather: pool spin before its threads sleep (default {DEFAULT_SPIN_US}: a step's wake at "
                        "its plan lasts until its fetch)")
    p.add_argument("--threads", type=int, default=0, help="host gather threads (default: the affinity count)")
    p.add_argument("--chunk-rows", type=int, default=2048, help="host gather rows per copy (default 2048)")
    p.add_argument("--slots", type=int, default=8, help="host gather staging slots (default 8)")
    p.add_argument("--min-chunks", type=int, default=4, help="host gather min chunks per call")
    p.add_argument("--prefetch", type=int, default=16, help="host gather prefetch distance (rows)")
    p.add_argument("--stores", choices=("streaming", "plain"), default="plain", help="host gather stores")
    p.add_argument("--simulate-column-rows", type=int, default=V41_COLUMN_ROWS,
                   help=f"also simulate the policy with columns of this many rows (default {V41_COLUMN_ROWS}; 0: off)")
    p.add_argument("--offline-counts", default="history", metavar="SOURCE",
                   help="the offline-warmed cache's counts: 'history' (counted over the --warm chunks, default), a "
                        "counts file of `engram-trt bench rowcounts` (its chunks must not overlap the measured ones), "
                        "or 'none' (history warming only)")
    p.add_argument("--breakdown", action="store_true",
                   help="also time the cache's phases: synced (a wait after each) and unsynced (when the host had "
                        "issued each phase and when the GPU got there, by events); these steps run phase by phase from "
                        "Python, not as one library call")
    p.add_argument("--host-profile", type=int, default=0, metavar="N",
                   help="also profile N steps of each cache's host work (cProfile) and print the functions that take "
                        "most of it, per step (default: 0, off)")
    p.add_argument("--host-trace", type=int, default=0, metavar="N",
                   help="also trace N steps of each cache call by call (two clock reads around each of the step's "
                        "seams: plan, kernel calls, host gather, C entry points, syncs) and print when each ran and "
                        "what it took (default: 0, off; bench.cachetrace)")
    p.add_argument("--ab-phases", action="store_true",
                   help="also run a twin of each cache that takes its steps phase by phase from Python "
                        "(HotRowCache(whole_step=False)) on the same chunks, the two in alternating order, and print "
                        "the whole step's time over the twin's")
    p.add_argument("--ab-serial", action="store_true",
                   help="also run a twin of each cache whose whole step delivers every lookup after the fetch "
                        "(HotRowCache(overlap=False)) on the same chunks, the two in alternating order, and print the "
                        "overlapped step's time over the twin's (not with --ab-phases)")
    p.add_argument("--ab-uva", action="store_true",
                   help="also run a twin of each cache whose host gather fetches every miss (uva_share 0) on the same "
                        "chunks, the two in alternating order, and print the time with the UVA share over the twin's")
    p.add_argument("--uva-share", type=float, default=None,
                   help="the share of a step's misses (from 8192 of them) the GPU reads through UVA beside the host "
                        "gather, in [0, 1] (default: the cache's, cache_kernels.DEFAULT_UVA_SHARE; the host tables "
                        "are registered with CUDA for it); 0: the host gather fetches every miss")
    p.add_argument("--uva-blocks", type=int, default=None,
                   help="the grid of that UVA read in blocks of 256 threads, 0 = one full wave (default: the cache's, "
                        "cache_kernels.DEFAULT_UVA_BLOCKS)")
    p.add_argument("--ids-on", choices=("host", "device"), default="host",
                   help="where the caches get each chunk's row ids: 'host' (pinned host memory, uploaded by the plan; "
                        "default) or 'device' (already on the GPU, as a step's hash kernel leaves them); the cold "
                        "gather always reads the host copy")
    p.add_argument("--kernel-profile", action="store_true",
                   help="also run one step of each cache under the CUDA profiler: each phase's host span and every "
                        "kernel and copy the GPU ran (bench.cacheprofile)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH", help="write the results as JSON")
    p.add_argument("--plot", default=None, metavar="PNG", help="write a plot of per-chunk time and hit rate")
    p.add_argument("--dry-run", action="store_true", help="no GPU: run the logic on CPU tensors, small, and check it")


def _token_stream(args: Any) -> Any:
    path = args.tokens or default_tokens_path()
    if Path(path).is_file():
        return load_tokens(path)
    if args.tokens is not None:
        return load_tokens(path)  # names the missing file and how to make it
    log.info("no token file at %s: tokenizing %.1f MB of text", path, args.text_mb)
    stream = prepare_tokens(args.text_mb)
    save_tokens(stream, path)
    return stream


def _host_layouts(args: Any) -> list[str]:
    """The layouts to run: ``--layouts``, else ``--layout``, else the runtime's."""
    if args.layouts is not None and args.layout is not None and args.layouts != [args.layout]:
        raise EngramError(f"--layout {args.layout} and --layouts {','.join(args.layouts)} disagree: give one of them")
    layouts = args.layouts or [args.layout or DEFAULT_LAYOUT]
    if len(set(layouts)) != len(layouts):
        raise EngramError(f"--layouts names a layout twice ({','.join(layouts)})")
    return layouts


def cmd_cache(args: Any) -> int:
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        raise EngramError("bench cache needs a CUDA GPU; run with --dry-run to exercise the logic on the CPU")
    if not 0.0 <= args.capacity_fraction <= 1.0:
        raise EngramError(f"--capacity-fraction must be in [0, 1] (got {args.capacity_fraction})")
    column_rows = args.column_rows or (4096 if args.dry_run else DEFAULT_COLUMN_ROWS)
    warm = args.warm if args.warm is not None else (6 if args.dry_run else 448)
    measure = args.measure if args.measure is not None else (3 if args.dry_run else 64)
    if measure < 1 or warm < 0:
        raise EngramError("--measure must be >= 1 and --warm >= 0")
    layouts = _host_layouts(args)
    if args.dry_run and (args.ab_phases or args.ab_serial or args.ab_uva or args.ids_on == "device"):
        raise EngramError("--ab-phases, --ab-serial, --ab-uva and --ids-on device compare the GPU's whole step and its "
                          "device ids: the dry run has neither (it runs the torch path on the CPU); drop them or run "
                          "on a GPU")
    if args.ab_phases + args.ab_serial + args.ab_uva > 1:
        raise EngramError("--ab-phases, --ab-serial and --ab-uva each run one twin per cache: pick one (or run twice)")
    if args.uva_share is not None and not 0.0 <= args.uva_share <= 1.0 or (args.uva_blocks or 0) < 0:
        raise EngramError(f"--uva-share must be in [0, 1] and --uva-blocks >= 0 (got {args.uva_share}, "
                          f"{args.uva_blocks})")
    if args.spin_us < 0:
        raise EngramError(f"--spin-us must be >= 0 (got {args.spin_us})")
    stream = _token_stream(args)
    layout = make_layout(column_rows, stream.compressed_vocab_size, stream.pad_id)
    layers = layer_list(args.layers, layout.num_layers)
    t0 = time.perf_counter()
    chunks = list(chunk_row_ids(stream, layout, first_chunk=args.first_chunk, num_chunks=warm + measure))
    if len(chunks) < warm + measure:
        raise EngramError(f"the token stream holds {len(chunks)} chunks from --first-chunk {args.first_chunk}, "
                          f"fewer than --warm + --measure = {warm + measure}; use more text (--text-mb)")
    log.info("hashed %d chunks of %d tokens in %.1f s", len(chunks), CHUNK_TOKENS, time.perf_counter() - t0)
    measured = (args.first_chunk + warm, args.first_chunk + warm + measure)
    offline, offline_text = _offline_counts(args, stream, layout, layers, chunks[:warm], measured)
    report: dict[str, Any] = {
        "tokens": stream.meta(), "column_rows": column_rows, "table_rows": [int(r) for r in layout.table_rows],
        "table_gib": float(layout.table_rows.sum()) * ROW_BYTES / GiB, "layout": ",".join(layouts),
        "layouts": layouts, "pages": args.pages, "spin_us": args.spin_us,
        "capacity_fraction": args.capacity_fraction, "warm_chunks": warm, "measured_chunks": measure,
        "measured_range": list(measured), "offline_counts": offline_text,
        "stream_stats": chunk_stats(chunks[warm:], layout), "dry_run": args.dry_run}
    if args.dry_run:
        report.update(run_cpu(args, layout, layers, chunks, warm, offline, layouts))
        report["link_GBps"] = None
    else:
        report.update(run_gpu(args, layout, layers, chunks, warm, offline, layouts))
    # The measured part is printed and written before the simulation, which runs last
    # (minutes at V4.1 column sizes): a run cut short keeps it.
    print_report(report)
    if args.plot:
        plot_report(report, args.plot)
    if args.simulate_column_rows and not args.dry_run:
        if args.json not in (None, "-"):
            write_json(report, args.json)
        report["simulation"] = _simulate(args, stream, layers, warm, measure)
        print_simulation(report["simulation"])
    if args.json is not None:
        write_json(report, args.json)
    return 0


def _offline_counts(args: Any, stream: Any, layout: Any, layers: list[int], history: list[Any],
                    measured: tuple[int, int]) -> tuple[dict[int, Any] | None, str | None]:
    """The offline-warmed cache's counts per layer, and what they are (None: no such cache)."""
    from engram_trt.bench.rowcounts import check_disjoint, count_rows, load_row_counts

    source = str(args.offline_counts)
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
        first = args.first_chunk
        return counts, (f"counts over the warm-up chunks {first}..{first + len(history) - 1} of the token stream, "
                        f"disjoint from the measured chunks {a}..{b - 1}")
    rc = load_row_counts(source)
    text = check_disjoint(rc, stream, measured, layout, layers)
    return {li: rc.counts[li] for li in layers}, text


def _simulate(args: Any, stream: Any, layers: list[int], warm: int, measure: int) -> dict[str, Any]:
    """The cache's policy alone on ids for larger columns, both warmings (offline counts
    over the warm-up chunks): hit rates, no data."""
    import torch

    from engram_trt.bench.rowcounts import count_rows
    from engram_trt.cache.hotcache import CachePolicy

    layout = make_layout(args.simulate_column_rows, stream.compressed_vocab_size, stream.pad_id)
    dev = torch.device("cuda", torch.cuda.current_device())
    chunks = list(chunk_row_ids(stream, layout, first_chunk=args.first_chunk, num_chunks=warm + measure))
    offline = None
    if args.offline_counts != "none" and warm:  # a counts file is for the benchmark's own layout, not this one
        offline = count_rows(chunks[:warm], [int(r) for r in layout.table_rows], layers)
    step_rows = CHUNK_TOKENS * layout.n_hash_cols
    out = []
    for li in layers:
        rows = int(layout.table_rows[li])
        entry: dict[str, Any] = {"layer": li, "table_rows": rows}
        for name in ("history", "offline"):
            if name == "offline" and offline is None:
                continue
            policy = CachePolicy(rows, int(args.capacity_fraction * rows), device=dev, admit_budget=args.admit_budget,
                                 sample_factor=args.sample_factor, seed=args.seed, max_step_rows=step_rows,
                                 initial_counts=offline[li] if name == "offline" else None)
            part = {"capacity_rows": policy.capacity,
                    **policy_hit_rates(policy, chunks, li, warm, args.admit_every, history=name == "history")}
            if name == "history":
                entry.update(part)
            else:
                entry["offline"] = part
            del policy
            torch.cuda.empty_cache()
        out.append(entry)
    return {"column_rows": args.simulate_column_rows, "table_gib": float(layout.table_rows.sum()) * ROW_BYTES / GiB,
            "layers": out}


def policy_hit_rates(policy: Any, chunks: list[Any], layer: int, warm: int, admit_every: int, *,
                     history: bool) -> dict[str, float]:
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
    return {"hit_rate": hits / max(1, unique), "unique_fraction": unique / max(1, lookups),
            "fetch_fraction": (unique - hits) / max(1, lookups)}


def add_parser(sub: Any) -> Any:
    """Register ``bench cache`` (no heavy imports)."""
    p = sub.add_parser("cache", help="real id streams through de-duplication and the HBM hot-row cache",
                       description=__doc__.split("\n\n")[0].replace("``", "").replace("`", ""))
    add_cache_arguments(p)
    p.set_defaults(func=cmd_cache)
    return p
