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
