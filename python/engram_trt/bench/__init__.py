"""``engram-trt bench``: benchmarks that print ratios against a limit or a baseline
measured in the same run (never a bare time), with ``--json`` for scripts."""

from __future__ import annotations

import argparse


def add_bench_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``bench`` and its sub-commands on the CLI's subparsers (no heavy imports)."""
    from engram_trt.bench import serve, step

    p = sub.add_parser("bench", help="benchmarks on this machine (ratios against limits measured in the same run)",
                       description="Benchmarks of the runtime. Each prints ratios against a limit or a baseline measured "
                                   "in the same run, and how far that baseline is from its own bound.")
    bsub = p.add_subparsers(dest="bench", metavar="BENCH", parser_class=type(p))
    step.add_parser(bsub)
    serve.add_parser(bsub)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])
    return p
