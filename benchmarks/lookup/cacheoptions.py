"""``bench_cache.py``'s options (:class:`CacheOptions`), in a module of their own
so that both the command (bench_cache.py) and its measured part
(cacherun.py) take them typed, and the command line reads them
without torch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from idstreams import DEFAULT_COLUMN_ROWS, V41_COLUMN_ROWS
from lookuputil import PAGE_CHOICES
from engram_trt.bench.options import opt

LAYOUTS = ("inline", "split", "hbm-scales")
# The runtime's host layout for fp8 tables (runtime/prefetch.py: the scales copied to the
# GPU unless ENGRAM_TRT_HBM_SCALES=0 or they would not fit): what the cache is measured in.
DEFAULT_LAYOUT = "hbm-scales"
DEFAULT_SPIN_US = 300  # above a prefill chunk's plan (~150-180 us on the H200), from the wake to the fetch


@dataclass(kw_only=True)
class CacheOptions:
    """``bench_cache.py``'s flags."""

    tokens: Path | None = opt(
        None,
        help="token file from `idstreams.py` (default: the cache's; made if missing and the tokenizer is installed)",
    )
    text_mb: float = opt(16.0, help="MB of text when the token file is made here")
    column_rows: int | None = opt(
        None, help=f"rows per column (default {DEFAULT_COLUMN_ROWS}: 24.75 GiB of tables; --dry-run: 4096)"
    )
    layers: str = opt("0,1", help="Engram layers to run, comma-separated (default 0,1)")
    capacity_fraction: float = opt(0.05, help="cache rows / table rows (default 0.05)")
    admit_budget: int | None = opt(
        None, help="replacements tried per step at most (default: the cache's, min(capacity, 8192))"
    )
    sample_factor: int = opt(4, help="eviction sample window / budget (default 4)")
    admit_every: int = opt(
        4,
        help="try replacements every N steps once full (default 4; "
        "scripts/cache_policy_sweep.py gives the hit rates of cadences and budgets)",
    )
    warm: int | None = opt(
        None, help="warm-up chunks: the history the cache's counts learn from (default 448 = 3.7M tokens; --dry-run 6)"
    )
    measure: int | None = opt(None, help="timed chunks after the warm-up (default 64; --dry-run 3)")
    first_chunk: int = opt(0, help="first chunk of the token stream (default 0)")
    layout: str | None = opt(
        None,
        choices=LAYOUTS,
        help=f"host table layout (default {DEFAULT_LAYOUT}, the runtime's for fp8 tables); one of --layouts",
    )
    layouts: list[str] | None = opt(
        None,
        choices=LAYOUTS,
        metavar="LIST",
        help="host table layouts to compare in this one process, comma-separated, e.g. "
        "inline,hbm-scales (they take turns on every measured chunk)",
    )
    pages: str = opt(
        "auto",
        choices=PAGE_CHOICES,
        help="host table pages: auto (the runtime's choice: free reserved 1 GiB pages, else reserved "
        "hugetlbfs pages, else transparent huge pages; default), 4k, thp (madvise) or 1g (reserved "
        "1 GiB pages)",
    )
    spin_us: int = opt(
        DEFAULT_SPIN_US,
        help=f"host gather: pool spin before its threads sleep (default "
        f"{DEFAULT_SPIN_US}: a step's wake at its plan lasts until its fetch)",
    )
    threads: int = opt(0, help="host gather threads (default: the affinity count)")
    chunk_rows: int = opt(2048, help="host gather rows per copy (default 2048)")
    slots: int = opt(8, help="host gather staging slots (default 8)")
    min_chunks: int = opt(4, help="host gather min chunks per call")
    prefetch: int = opt(16, help="host gather prefetch distance (rows)")
    stores: str = opt("plain", choices=("streaming", "plain"), help="host gather stores")
    simulate_column_rows: int = opt(
        V41_COLUMN_ROWS,
        help=f"also simulate the policy with columns of this many rows (default {V41_COLUMN_ROWS}; 0: off)",
    )
    offline_counts: str = opt(
        "history",
        metavar="SOURCE",
        help="the offline-warmed cache's counts: 'history' (counted over the --warm chunks, "
        "default), a counts file of `rowcounts.py` (its chunks must not "
        "overlap the measured ones), or 'none' (history warming only)",
    )
    breakdown: bool = opt(
        False,
        help="also time the cache's phases: synced (a wait after each) and unsynced (when the "
        "host had issued each phase and when the GPU got there, by events); these steps "
        "run phase by phase from Python, not as one library call",
    )
    host_profile: int = opt(
        0,
        metavar="N",
        help="also profile N steps of each cache's host work (cProfile) and print "
        "the functions that take most of it, per step (default: 0, off)",
    )
    host_trace: int = opt(
        0,
        metavar="N",
        help="also trace N steps of each cache call by call (two clock reads around "
        "each of the step's seams: plan, kernel calls, host gather, C entry "
        "points, syncs) and print when each ran and what it took (default: 0, "
        "off; bench.cachetrace)",
    )
    ab_phases: bool = opt(
        False,
        help="also run a twin of each cache that takes its steps phase by phase from Python "
        "(HotRowCache(whole_step=False)) on the same chunks, the two in alternating "
        "order, and print the whole step's time over the twin's",
    )
    ab_serial: bool = opt(
        False,
        help="also run a twin of each cache whose whole step delivers every lookup after the "
        "fetch (HotRowCache(overlap=False)) on the same chunks, the two in alternating "
        "order, and print the overlapped step's time over the twin's (not with "
        "--ab-phases)",
    )
    ab_uva: bool = opt(
        False,
        help="also run a twin of each cache whose host gather fetches every miss (uva_share 0) "
        "on the same chunks, the two in alternating order, and print the time with the UVA "
        "share over the twin's",
    )
    uva_share: float | None = opt(
        None,
        help="the share of a step's misses (from 8192 of them) the GPU reads through "
        "UVA beside the host gather, in [0, 1] (default: the cache's, "
        "cache_kernels.DEFAULT_UVA_SHARE; the host tables are registered with "
        "CUDA for it); 0: the host gather fetches every miss",
    )
    uva_blocks: int | None = opt(
        None,
        help="the grid of that UVA read in blocks of 256 threads, 0 = one full wave "
        "(default: the cache's, cache_kernels.DEFAULT_UVA_BLOCKS)",
    )
    ids_on: str = opt(
        "host",
        choices=("host", "device"),
        help="where the caches get each chunk's row ids: 'host' (pinned host memory, uploaded by the "
        "plan; default) or 'device' (already on the GPU, as a step's hash kernel leaves them); the "
        "cold gather always reads the host copy",
    )
    kernel_profile: bool = opt(
        False,
        help="also run one step of each cache under the CUDA profiler: each phase's host "
        "span and every kernel and copy the GPU ran (bench.cacheprofile)",
    )
    seed: int = opt(0)
    json: str | None = opt(None, nargs="?", const="-", metavar="PATH", help="write the results as JSON")
    plot: str | None = opt(None, metavar="PNG", help="write a plot of per-chunk time and hit rate")
    dry_run: bool = opt(False, help="no GPU: run the logic on CPU tensors, small, and check it")

    def twin(self) -> str | None:
        """Which twin the A/B flags ask for (bench cache refuses more than one)."""
        return next(
            (k for k, on in (("phases", self.ab_phases), ("serial", self.ab_serial), ("uva", self.ab_uva)) if on), None
        )
