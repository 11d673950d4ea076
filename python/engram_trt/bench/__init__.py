"""``engram-trt bench``: benchmarks that print ratios against a limit or a baseline
measured in the same run (never a bare time), with ``--json`` for scripts. No torch at
parser build: each command imports what it needs when it runs.

- ``bench gather``: cold lookups from a >= 24 GiB host table (UVA kernel, host gather in
  split / inline layouts, torch.index_select + copy) against the link (gather.py);
- ``bench cache``: real row-id streams through per-step de-duplication and the HBM
  hot-row cache against the cold host gather, host layouts side by side in one process
  (cache.py, its runs cacherun.py, its report cachereport.py);
- ``bench idstream``: the token file of real text those streams come from (idstreams.py);
- ``bench rowcounts``: per-row lookup counts of a range of that text, a cache's warm start (rowcounts.py);
- ``bench step``: step time with Engram (GPU / pinned tables) over the step without it (step.py);
- ``bench serve``: throughput of N concurrent requests through LLM over one request (serve.py);
- ``bench gemv``: a decode step's projections, the kernel library's GEMV vs the GEMM library, over HBM (gemv.py).
"""

from __future__ import annotations

import argparse


def add_bench_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``bench`` and its sub-commands on the CLI's subparsers (no heavy imports)."""
    from engram_trt.bench import cache, gather, gemv, idstreams, rowcounts, serve, step

    p = sub.add_parser("bench", help="benchmarks on this machine (ratios against limits measured in the same run)",
                       description="Benchmarks. Each prints ratios against a limit or a baseline measured in the same "
                                   "run, and how far that baseline is from its own bound.")
    bsub = p.add_subparsers(dest="bench", metavar="BENCH", parser_class=type(p))
    gather.add_parser(bsub)
    cache.add_parser(bsub)
    idstreams.add_parser(bsub)
    rowcounts.add_parser(bsub)
    step.add_parser(bsub)
    serve.add_parser(bsub)
    gemv.add_parser(bsub)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])
    return p
