"""Output conventions shared by the subcommands: JSON on stdout, exit codes, sizes."""

from __future__ import annotations

import json
import sys
from typing import Any

EXIT_USAGE = 2
EXIT_PROBLEMS = 1


def print_json(obj: Any) -> None:
    """One JSON object on one line of stdout (what a script reads)."""
    json.dump(obj, sys.stdout, indent=None, separators=(", ", ": "))
    sys.stdout.write("\n")


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"
