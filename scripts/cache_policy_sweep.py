"""Hit rates of the hot-row cache's admission settings on real id streams, on the CPU.

The policy's torch reference (`CachePolicy(fused=False)`, what the GPU checks hold the
kernels to) runs the chunks of `benchmarks/lookup/bench_cache.py` (8k tokens of the bench's token
file, hashed for one layer, 196,608 lookups a chunk) through a cache of 5% of the
layer's rows. It reports the hit rate on distinct rows over the measured chunks, for each
replacement cadence and budget given: after `--warm` chunks of history (the online LFU),
and from offline counts over those same chunks (`--offline`). No row data moves, so
this says which settings keep more rows in the cache, not what they cost on the GPU:
`bench_cache.py --admit-every N --admit-budget B` measures that.

    PYTHONPATH=python python3 scripts/cache_policy_sweep.py --settings 4:8192,1:8192,1:32768 --offline
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "python"), str(REPO / "benchmarks" / "lookup")]  # engram_trt; bench_cache.py and its modules


def main() -> int:
    import idstreams
    from bench_cache import policy_hit_rates
    from engram_trt.cache.policy import CachePolicy
    from engram_trt.errors import EngramError
    from rowcounts import count_rows

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=Path, default=None, help="token file (default: the bench's)")
    p.add_argument("--layer", type=int, default=0, help="Engram layer whose ids to run (default 0)")
    p.add_argument("--warm", type=int, default=448, help="chunks of history before the measured ones (default 448)")
    p.add_argument("--measure", type=int, default=24, help="measured chunks (default 24, as bench cache)")
    p.add_argument(
        "--settings",
        default="4:8192,1:8192,1:32768",
        metavar="EVERY:BUDGET,...",
        help="replacement cadences and budgets to compare (default 4:8192,1:8192,1:32768)",
    )
    p.add_argument("--capacity-fraction", type=float, default=0.05)
    p.add_argument("--sample-factor", type=int, default=4)
    p.add_argument("--offline", action="store_true", help="also a cache warmed from offline counts of the warm chunks")
    args = p.parse_args()
    try:
        settings = [tuple(int(v) for v in item.split(":")) for item in args.settings.split(",")]
        if any(len(s) != 2 or s[0] < 1 or s[1] < 0 for s in settings):
            raise ValueError
    except ValueError:
        raise SystemExit(f"--settings must be EVERY:BUDGET pairs with EVERY >= 1 (got {args.settings!r})") from None
    path = args.tokens or idstreams.default_tokens_path()
    try:
        stream = idstreams.load_tokens(path)
    except EngramError as e:
        raise SystemExit(str(e)) from None
    layout = idstreams.make_layout(idstreams.DEFAULT_COLUMN_ROWS, stream.compressed_vocab_size, stream.pad_id)
    chunks = list(idstreams.chunk_row_ids(stream, layout, num_chunks=args.warm + args.measure))
    if len(chunks) < args.warm + args.measure:
        raise SystemExit(f"the token file holds {len(chunks)} chunks, fewer than --warm + --measure")
    rows = int(layout.table_rows[args.layer])
    counts = (
        count_rows(chunks[: args.warm], [int(r) for r in layout.table_rows], [args.layer])[args.layer]
        if args.offline
        else None
    )
    print(
        f"{path}: layer {args.layer}, {rows:,} rows, a cache of {args.capacity_fraction:.0%}; {args.warm} chunks of "
        f"history, {args.measure} measured"
    )
    print("| warming | replace every | budget | hit rate (distinct rows) | fetched / lookups | seconds |")
    print("| --- | --- | --- | --- | --- | --- |")
    for every, budget in settings:
        for warming in ("history", "offline") if args.offline else ("history",):
            t0 = time.perf_counter()
            policy = CachePolicy(
                rows,
                int(args.capacity_fraction * rows),
                device="cpu",
                admit_budget=budget,
                sample_factor=args.sample_factor,
                max_step_rows=chunks[0][:, 0, :].size,
                initial_counts=counts if warming == "offline" else None,
            )
            got = policy_hit_rates(policy, chunks, args.layer, args.warm, every, history=warming == "history")
            print(
                f"| {warming} | {every} | {budget} | {got['hit_rate']:.1%} | {got['fetch_fraction']:.1%} | "
                f"{time.perf_counter() - t0:.0f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
