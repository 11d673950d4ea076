"""``engram-trt bench``: the benchmarks' subcommands, each a row of :data:`BENCH_COMMANDS`.

A bench subcommand is a module under :mod:`engram_trt.bench` with an options dataclass
(every flag a typed field, its help and spelling in the field's metadata:
:func:`engram_trt.bench.options.opt`) and ``run(opts) -> int``. Its argparse flags are
derived here from the dataclass's fields (:func:`add_option_arguments`), and the parsed
namespace becomes the dataclass (:func:`options_from`) before ``run`` sees it, so no
argparse reaches ``bench/``. Adding a subcommand: its module, and one row in the table.

Importing the bench modules pulls no torch (each ``run`` imports it), so ``--help``
stays light.

The kernel microbenchmarks and probes are scripts under the repository's ``benchmarks/``
(benchmarks/README.md says which measurements are commands and which are scripts): each
script is a module of the same form, and :func:`run_script` is its command line (the
flags derived here the same way, bad input one ``<script>: error: ...`` line, exit 2).
"""

from __future__ import annotations

import argparse
import logging
import sys
import types
import typing
from dataclasses import MISSING, Field, dataclass, fields
from pathlib import Path
from typing import Any, Callable, Sequence

from engram_trt.bench import dsv4step, e2e, qwen4step, serve, steady, step
from engram_trt.cli.argtypes import int_arg
from engram_trt.cli.output import EXIT_USAGE
from engram_trt.errors import EngramError


def _paragraph(index: int, plain: bool = True) -> Callable[[str], str]:
    """A subcommand's description from its module's docstring: paragraph ``index``,
    with the reST quotes (````x````, ```x```) taken out when ``plain``."""

    def describe(doc: str) -> str:
        text = doc.split("\n\n")[index]
        return text.replace("``", "").replace("`", "") if plain else text

    return describe


def _whole(doc: str) -> str:
    return doc


@dataclass(frozen=True)
class BenchCommand:
    """One ``engram-trt bench`` subcommand: its module (with ``run(opts) -> int``), its
    options dataclass, the one-line help, and its description made from the module's
    docstring (default: the first paragraph, plain)."""

    name: str
    module: types.ModuleType
    options: type
    help: str
    description: Callable[[str], str] = _paragraph(0)


BENCH_COMMANDS: tuple[BenchCommand, ...] = (
    BenchCommand(
        "step",
        step,
        step.StepOptions,
        "step time with Engram tables in GPU / pinned host memory vs the Engram layers removed",
        _paragraph(1, plain=False),
    ),
    BenchCommand(
        "serve",
        serve,
        serve.ServeOptions,
        "throughput of N concurrent requests through LLM, as a ratio to one request",
        _whole,
    ),
    BenchCommand(
        "steady",
        steady,
        steady.SteadyOptions,
        "the steady decode rate demo / run print vs bench serve's one stream, and their ratio",
    ),
    BenchCommand(
        "qwen4-step",
        qwen4step,
        qwen4step.Qwen4StepOptions,
        "~1.3B Qwen4Exp decode steps, PLE tables pinned vs HBM, vs the step's floor",
    ),
    BenchCommand(
        "dsv4-step",
        dsv4step,
        dsv4step.Dsv4StepOptions,
        "~1.8B DeepSeek-V4.1 steps, Engram tables pinned vs HBM, vs floors; time per module class",
    ),
    BenchCommand(
        "e2e",
        e2e,
        e2e.E2eOptions,
        "transformers-made checkpoints: generate vs run vs bench serve, vs the weight-read floor",
    ),
)


# ---------------------------------------------------------------- value types
def _number_list(text: str, cast: Callable[[str], Any], what: str, example: str) -> list[Any]:
    """Comma-separated values of ``cast``; an error becomes one argparse usage line."""
    try:
        values = [cast(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated {what}, e.g. {example} (got {text!r})")
    return values


def int_list(text: str) -> list[int]:
    """argparse type: comma-separated integers."""
    return _number_list(text, int, "integers", "4,8,16")


def float_list(text: str) -> list[float]:
    """argparse type: comma-separated numbers."""
    return _number_list(text, float, "numbers", "0.1,0.2")


def str_list(choices: Sequence[str] | None) -> Callable[[str], list[str]]:
    """argparse type: a comma-separated subset of ``choices`` (any strings if None)."""

    def parse(text: str) -> list[str]:
        values = [v.strip() for v in text.split(",") if v.strip()]
        if not values or (choices is not None and any(v not in choices for v in values)):
            what = f"of {', '.join(choices)}" if choices is not None else "of values"
            raise argparse.ArgumentTypeError(f"expected a comma-separated list {what} (got {text!r})")
        return values

    return parse


# ``argtype=`` names of the options' metadata: a validator other than the field type's.
ARGTYPES: dict[str, Callable[..., Callable[[str], Any]]] = {
    "int_arg": int_arg,  # ("int_arg", lo, hi): a strict integer in lo..hi (cli/argtypes.py)
    "int_list": lambda: int_list,
    "float_list": lambda: float_list,
    "str_list": str_list,  # ("str_list", choices)
}
_SCALARS: dict[Any, Any] = {int: int, float: float, str: None, Path: Path}


def _unoptional(tp: Any) -> Any:
    """X of ``X | None`` (and of ``Optional[X]``); any other type as it is."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _argtype(f: Field, tp: Any, owner: str) -> Any:
    """The argparse ``type=`` of a field: its ``argtype`` if named, else its type's."""
    md = f.metadata
    spec = md.get("argtype")
    if spec is not None:
        name, *params = (spec,) if isinstance(spec, str) else spec
        return ARGTYPES[name](*params)
    if tp in _SCALARS:
        return _SCALARS[tp]
    if typing.get_origin(tp) is list:
        (item,) = typing.get_args(tp)
        if item is int:
            return int_list
        if item is float:
            return float_list
        if item is str:
            return str_list(md.get("choices"))
    raise TypeError(f"{owner}.{f.name}: no command-line form for the type {tp!r} (give argtype=)")


def _default(f: Field) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING


def add_option_arguments(parser: argparse.ArgumentParser, options: type) -> None:
    """Add one argument per field of the dataclass ``options``, in field order (see
    :mod:`engram_trt.bench.options` for how a field's type and metadata spell it)."""
    hints = typing.get_type_hints(options)
    groups: dict[str, Any] = {}
    for f in fields(options):
        md = f.metadata
        tp = _unoptional(hints[f.name])
        default = _default(f)
        kw: dict[str, Any] = {}
        if md.get("positional"):
            names: list[str] = [f.name]
        else:
            names = list(md.get("flags") or [f"--{f.name.replace('_', '-')}"])
            if md.get("flags"):
                kw["dest"] = f.name
        if tp is bool and md.get("argtype") is None:
            if default is not False:
                raise TypeError(f"{options.__name__}.{f.name}: a flag is off by default (name the field no_...)")
            kw["action"] = "store_true"
        else:
            argtype = _argtype(f, tp, options.__name__)
            if argtype is not None:
                kw["type"] = argtype
            if md.get("choices") is not None and typing.get_origin(tp) is not list:
                kw["choices"] = md["choices"]
            if default is not MISSING:
                kw["default"] = default
            elif not md.get("positional"):
                kw["required"] = True
            for key in ("nargs", "const", "metavar"):
                if md.get(key) is not None:
                    kw[key] = md[key]
        if md.get("help") is not None:
            kw["help"] = md["help"]
        target: Any = parser
        if md.get("exclusive"):
            if md["exclusive"] not in groups:
                groups[md["exclusive"]] = parser.add_mutually_exclusive_group()
            target = groups[md["exclusive"]]
        target.add_argument(*names, **kw)


def options_from(ns: argparse.Namespace, options: type) -> Any:
    """The dataclass ``options`` of a parsed namespace (its fields' values, no others)."""
    return options(**{f.name: getattr(ns, f.name) for f in fields(options)})


def _runner(cmd: BenchCommand) -> Callable[[argparse.Namespace], int]:
    def run(ns: argparse.Namespace) -> int:
        return cmd.module.run(options_from(ns, cmd.options))

    return run


def add_bench_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``bench`` and the subcommands of :data:`BENCH_COMMANDS` on the CLI's subparsers."""
    p = sub.add_parser(
        "bench",
        help="benchmarks on this machine (ratios against limits measured in the same run)",
        description="Benchmarks. Each prints ratios against a limit or a baseline measured in the same "
        "run, and how far that baseline is from its own bound.",
    )
    bsub = p.add_subparsers(dest="bench", metavar="BENCH", parser_class=type(p))
    for cmd in BENCH_COMMANDS:
        sp = bsub.add_parser(cmd.name, help=cmd.help, description=cmd.description(cmd.module.__doc__ or ""))
        add_option_arguments(sp, cmd.options)
        sp.set_defaults(func=_runner(cmd))
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])
    return p


# ---------------------------------------------------------------- benchmarks/ scripts
class _ScriptParser(argparse.ArgumentParser):
    """argparse, with a script's usage errors in one line, as the CLI's."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def script_parser(options: type, doc: str, prog: str) -> argparse.ArgumentParser:
    """The parser of a script under ``benchmarks/``: ``-v`` and the flags of ``options``
    (:func:`add_option_arguments`), its description the first paragraph of ``doc``."""
    parser = _ScriptParser(prog=prog, description=_paragraph(0)(doc))
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more diagnostics on stderr (-vv for debug)")
    add_option_arguments(parser, options)
    return parser


def run_script(
    options: type, run: Callable[[Any], int], doc: str, argv: Sequence[str] | None = None, prog: str | None = None
) -> int:
    """A ``benchmarks/`` script's ``main``: parse ``argv`` into ``options``, ``run`` it; a bad
    input (:class:`EngramError`) or a failed file operation is one line on stderr and exit 2."""
    prog = prog or Path(sys.argv[0]).name
    ns = script_parser(options, doc, prog).parse_args(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(
        level=[logging.WARNING, logging.INFO, logging.DEBUG][min(ns.verbose, 2)],
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        return run(options_from(ns, options))
    except EngramError as exc:
        print(f"{prog}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:
        print(
            f"{prog}: error: {exc.filename or ''}{': ' if exc.filename else ''}{exc.strerror or exc}", file=sys.stderr
        )
        return EXIT_USAGE
