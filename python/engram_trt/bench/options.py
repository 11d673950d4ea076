"""The options of a bench subcommand: one dataclass, every flag a typed field with its
default, its help text and how it is spelled on the command line in the field's
metadata (:func:`opt`). The command line (:mod:`engram_trt.cli.bench`) derives the
subcommand's argparse flags from those fields and hands ``run`` the dataclass; nothing
under ``bench/`` sees argparse.

How a field becomes a flag (``--`` + its name with ``_`` as ``-``, unless ``flags``):
``bool`` is a ``store_true`` flag (its default False); ``int``, ``float``, ``Path`` take
one value of that type, ``str`` one string (``choices``: one of them); ``list[int]``,
``list[float]`` take one comma-separated value, ``list[str]`` a comma-separated subset of
``choices``; ``X | None`` is X whose default is None. A field without a default is a
required flag (or a positional argument: ``positional=True``). ``argtype`` names a
validator of the command line instead of the one the type implies (``"int_arg", lo, hi``:
a strict integer in lo..hi); fields with the same ``exclusive`` name form one mutually
exclusive group.
"""

from __future__ import annotations

from dataclasses import MISSING, field
from typing import Any, Sequence


def opt(
    default: Any = MISSING,
    *,
    help: str | None = None,
    metavar: str | None = None,
    choices: Sequence[str] | None = None,
    nargs: str | int | None = None,
    const: Any = None,
    positional: bool = False,
    flags: Sequence[str] | None = None,
    argtype: str | tuple[Any, ...] | None = None,
    exclusive: str | None = None,
) -> Any:
    """A dataclass field of a bench subcommand's options (see the module's text); a list
    default is copied for each instance."""
    metadata = {
        "help": help,
        "metavar": metavar,
        "choices": choices,
        "nargs": nargs,
        "const": const,
        "positional": positional,
        "flags": tuple(flags) if flags else None,
        "argtype": argtype,
        "exclusive": exclusive,
    }
    if isinstance(default, list):
        frozen = tuple(default)
        return field(default_factory=lambda: list(frozen), metadata=metadata)
    return field(default=default, metadata=metadata)
