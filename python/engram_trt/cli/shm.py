"""``engram-trt shm list`` / ``engram-trt shm clean``: the shared-table segments in
``/dev/shm`` (or ``--dir``), shown and removed.

Segments outlive the processes that made them (a restart re-attaches in seconds), so
someone has to see them and free the memory: ``list`` names each segment, its size and
state, its creator and which processes map it now; ``clean`` removes segments and the
leftovers of killed creators, refusing a segment a live process maps (unless
``--force``) and never touching a file without the engram-trt header.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

from engram_trt.cli.output import EXIT_USAGE, print_json
from engram_trt.errors import human_bytes

SHM_DIR_HELP = "directory holding the segments (default: /dev/shm, where the shared store puts them)"


def add_shm_command(add: Callable[..., argparse.ArgumentParser]) -> None:
    """Register ``shm`` and its actions on the top-level parser (``add`` is main's)."""
    p = add(
        "shm",
        cmd_shm,
        "list or remove the shared-memory table segments (dp_shared_memory)",
        "The shared table store (--engram-config dp_shared_memory) keeps one copy of the Engram tables per node "
        "in /dev/shm, in files named engram-trt-<layout hash>.tables that outlive the processes using them. "
        "`shm list` shows them; `shm clean` removes them.",
    )
    actions = p.add_subparsers(dest="shm_action", metavar="ACTION", parser_class=type(p))

    lp = actions.add_parser(
        "list",
        help="show each segment: size, ready or half-written, layout hash, creator, mappers",
        description="Show every engram-trt segment file in the directory: its size, whether it is "
        "ready or half-written (a creator died or is still writing), its layout hash, the pid "
        "that created it and whether that process is alive, and the processes that map it now "
        "(from /proc/*/maps; other users' processes are not visible).",
    )
    lp.add_argument(
        "--json", action="store_true", help="print one JSON object {\"dir\", \"segments\": [...]} instead of a table"
    )
    lp.add_argument("--dir", default=None, metavar="DIR", help=SHM_DIR_HELP)
    lp.set_defaults(shm_func=_cmd_list)

    cp = actions.add_parser(
        "clean",
        help="remove segments (named, --all, or by default only half-written leftovers)",
        description="Remove engram-trt segments and their temp and lock files. With NAMEs, those "
        "segments; with --all, every one; with neither, only leftovers of creators that died "
        "(half-written segments and temp files). A segment mapped by a live process is refused, "
        "naming the pids, unless --force. Files without the engram-trt header are never touched.",
    )
    cp.add_argument(
        "names",
        nargs="*",
        metavar="NAME",
        help="segment file names as `shm list` prints them (engram-trt-<16 hex>.tables)",
    )
    cp.add_argument("--all", action="store_true", help="remove every engram-trt segment in the directory")
    cp.add_argument(
        "--force",
        action="store_true",
        help="remove segments even while live processes map them or a creator "
        "is writing them (mappers keep their memory until they exit; a creator then fails)",
    )
    cp.add_argument("--dir", default=None, metavar="DIR", help=SHM_DIR_HELP)
    cp.set_defaults(shm_func=_cmd_clean)


def cmd_shm(args: argparse.Namespace) -> int:
    fn = getattr(args, "shm_func", None)
    if fn is None:
        import sys

        print("engram-trt: error: shm needs an action: list or clean (see engram-trt shm --help)", file=sys.stderr)
        return EXIT_USAGE
    return fn(args)


def _directory(args: argparse.Namespace) -> Any:
    from engram_trt.tables.segment import DEFAULT_DIR

    from pathlib import Path

    return Path(args.dir) if args.dir else DEFAULT_DIR


def _cmd_list(args: argparse.Namespace) -> int:
    from engram_trt.tables.segment import scan

    d = _directory(args)
    files = scan(d)
    if args.json:
        print_json({"dir": str(d), "segments": [f.to_json() for f in files]})
        return 0
    shown = [f for f in files if f.role != "lock"]
    if not shown:
        print(f"no engram-trt segments in {d}")
        return 0
    rows = [("NAME", "SIZE", "STATE", "LAYOUT", "CREATOR", "MAPPED BY")]
    for f in shown:
        creator = "-" if f.creator_pid is None else f"{f.creator_pid} ({'alive' if f.creator_alive else 'gone'})"
        rows.append(
            (
                f.name,
                human_bytes(f.size),
                f.state,
                (f.layout_hash or "-")[:16],
                creator,
                ", ".join(map(str, f.mapped_by)) or "-",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return 0


def _cmd_clean(args: argparse.Namespace) -> int:
    from engram_trt.errors import EngramError
    from engram_trt.tables.segment import clean

    if args.names and args.all:
        raise EngramError("shm clean takes segment NAMEs or --all, not both")
    d = _directory(args)
    result = clean(d, args.names, all_=args.all, force=args.force)
    for name in result.removed:
        print(f"removed {d / name}")
    for why in result.kept:
        print(f"kept {why}")
    if not result.removed and not result.kept:
        print(
            f"nothing to remove in {d}"
            + ("" if args.names or args.all else " (no half-written leftovers; name segments or pass --all)")
        )
    return 0
