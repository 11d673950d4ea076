"""User-facing errors.

Every bad input a user can hand us (a config field, a checkpoint file, a CLI flag) is
reported as an :class:`EngramError` whose message is one line that names the input and
the fix. The CLI turns it into ``engram-trt: error: <message>`` and exit status 2, with
no traceback: a traceback tells a user where *our* code was, not what *they* must change.
"""

from __future__ import annotations


class EngramError(Exception):
    """A bad input, reported as one line naming the input and the fix."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


class ConfigError(EngramError):
    """A config.json field is missing, has the wrong type or an impossible value."""


class CheckpointError(EngramError):
    """A checkpoint folder is incomplete or its tensors do not match its config."""


def human_bytes(n: float) -> str:
    """A size as messages and logs print it (``1.5 GiB``): every layer names sizes in
    its errors, so the one formatter lives beside the errors."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"
