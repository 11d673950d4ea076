"""``--engram-config`` on the command line: the JSON flag and one dotted flag per field
(``--engram-config.cpu_offload false``), turned into the typed
:class:`~engram_trt.config.engram.EngramConfig` that everything below the CLI takes."""

from __future__ import annotations

import argparse
from typing import Sequence

from engram_trt.config.engram import FLAG, EngramConfig
from engram_trt.errors import EngramError


def add_engram_config_arguments(parser: argparse.ArgumentParser) -> None:
    """``--engram-config JSON`` plus one ``--engram-config.FIELD VALUE`` per field.

    Each dotted flag is a real argparse option (so ``--help`` lists it and argparse
    refuses a misspelled one); values stay strings until :func:`engram_config_from_args`
    parses them as JSON scalars.
    """
    group = parser.add_argument_group("Engram table storage (the peers' --engram-config)")
    group.add_argument(
        FLAG,
        dest="engram_config",
        metavar="JSON",
        default=None,
        help="JSON object or path to a JSON file with the fields: "
        + ", ".join(EngramConfig.field_names())
        + " (defaults: "
        + EngramConfig().to_json()
        + ")",
    )
    helps = {
        "cpu_offload": "true: tables in pinned host memory read through UVA (default); false: tables in GPU memory",
        "host_file_gather": "true: read rows straight from the checkpoint files through the page cache (no table copy)",
        "dp_shared_memory": "true: co-located processes share one table copy in /dev/shm",
        "embedding_across_dp": "true: shard hash heads across ranks (one table copy in total)",
        "table_placement": (
            "auto (default), in_engine (gather plugin reads tables through UVA) "
            "or prefetch (runtime gathers rows before the step)"
        ),
    }
    for name in EngramConfig.field_names():
        group.add_argument(
            f"{FLAG}.{name}",
            dest=f"engram_config__{name}",
            metavar="VALUE",
            default=None,
            help=helps.get(name, f"override field {name}"),
        )


def engram_config_from_args(args: argparse.Namespace) -> EngramConfig:
    """The :class:`EngramConfig` of parsed arguments (JSON first, dotted flags override)."""
    overrides = [
        (name, getattr(args, f"engram_config__{name}"))
        for name in EngramConfig.field_names()
        if getattr(args, f"engram_config__{name}", None) is not None
    ]
    return EngramConfig.parse(getattr(args, "engram_config", None), overrides)


def split_dotted(argv: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """Pull ``--engram-config.FIELD VALUE`` / ``--engram-config.FIELD=VALUE`` pairs out of
    an argv (for callers that do not use :func:`add_engram_config_arguments`), refusing
    unknown fields with the valid ones listed."""
    rest: list[str] = []
    found: dict[str, str] = {}
    i = 0
    valid = EngramConfig.field_names()
    while i < len(argv):
        a = argv[i]
        if a.startswith(FLAG + "."):
            key, eq, val = a[len(FLAG) + 1 :].partition("=")
            if key not in valid:
                raise EngramError(f"{FLAG}: unknown field '{key}' (valid fields: {', '.join(valid)})")
            if not eq:
                if i + 1 >= len(argv):
                    raise EngramError(f"{a} needs a value (e.g. {a} false)")
                val = argv[i + 1]
                i += 1
            found[key] = val
        else:
            rest.append(a)
        i += 1
    return rest, found


def reject_unknown_args(extra: Sequence[str]) -> None:
    """For a CLI that uses ``parse_known_args``: turn leftover arguments into one clear
    error. A misspelled ``--engram-config.FIELD`` names the field and lists the valid
    ones (argparse alone would only say "unrecognized arguments")."""
    if not extra:
        return
    for a in extra:
        if a.startswith(FLAG + "."):
            key = a[len(FLAG) + 1 :].partition("=")[0]
            raise EngramError(f"{FLAG}: unknown field '{key}' (valid fields: {', '.join(EngramConfig.field_names())})")
    raise EngramError(f"unrecognized arguments: {' '.join(extra)} (see --help)")
