"""Argument types of the command line: strict integers with bounds, and the checks of
the generation options, all made before any expensive work.

argparse's ``type=int`` takes ``1_000``, ``+5`` and non-ASCII digits (``٣``), and any
magnitude (``--seed 10**30`` later overflows inside torch with a traceback). These
types take ASCII decimal integers only and refuse a value outside the field's range
in the one-line form, naming the flag.
"""

from __future__ import annotations

import argparse
import math
import re
from typing import Any, Callable

from engram_trt.errors import EngramError

INT32_MAX = 2**31 - 1
SEED_MAX = 2**63 - 1
_INT_RE = re.compile(r"^-?[0-9]+$")
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:[0-9]{1,4})?)$")
# Below this a temperature is greedy decoding (as vLLM's sampler treats it): dividing
# logits by a subnormal temperature overflows them to inf, and sampling from inf is NaN.
GREEDY_BELOW = 1e-5
MAX_TEMPERATURE = 1e4


def parse_int(text: str, lo: int, hi: int, what: str) -> int:
    """A strict decimal integer in ``lo..hi``; :class:`EngramError` naming ``what``."""
    t = str(text).strip()
    if not _INT_RE.match(t) or len(t) > 40:
        shown = str(text)[:40]
        raise EngramError(f"{what}: '{shown}' is not an integer (ASCII digits, e.g. {max(lo, 0)})")
    v = int(t)
    if not lo <= v <= hi:
        raise EngramError(f"{what}: {v} is outside {lo}..{hi}")
    return v


def int_arg(lo: int, hi: int) -> Callable[[str], int]:
    """argparse ``type=``: a strict integer in ``lo..hi``."""

    def parse(text: str) -> int:
        try:
            return parse_int(text, lo, hi, "value")
        except EngramError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix("value: ")) from None

    parse.__name__ = f"integer in {lo}..{hi}"
    return parse


# Flags whose value may start with '-' (argparse takes "--ids -1,5" for two options, as
# "-1,5" is not a plain negative number): main() hands such a value over as "--ids=-1,5".
DASH_VALUE_FLAGS = ("--ids",)
_DASH_VALUE_RE = re.compile(r"^-[0-9]")


def attach_dash_values(argv: list[str], flags: tuple[str, ...] = DASH_VALUE_FLAGS) -> list[str]:
    """``[..., "--ids", "-1,5", ...]`` -> ``[..., "--ids=-1,5", ...]`` for the ``flags``
    whose values are id lists: a list that starts with a dead token (-1) is typed as
    ``--help`` shows it. Only a value that starts with ``-`` and a digit is attached, so
    a forgotten value (``--ids --compressed``) is still argparse's "expected one argument"."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":  # everything after is positional
            out.extend(argv[i:])
            break
        if a in flags and i + 1 < len(argv) and _DASH_VALUE_RE.match(argv[i + 1]):
            out.append(f"{a}={argv[i + 1]}")
            i += 2
            continue
        out.append(a)
        i += 1
    return out


def target_list_arg(text: str) -> str:
    """argparse ``type=`` of ``build --target``: a comma-separated list that names at
    least one compute capability (an empty list would silently mean the default set).
    The names themselves are checked by the builder (native.trt_compat.parse_targets)."""
    if not any(t.strip() for t in str(text).split(",")):
        raise argparse.ArgumentTypeError(
            f"{text!r} names no compute capability; give a list such as sm80,sm86, or "
            f"leave --target out for the portable set"
        )
    return text


def check_text(value: str, flag: str) -> str:
    """Text from argv that must be UTF-8 (Python hands undecodable bytes over as lone
    surrogates, which the tokenizer would choke on)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise EngramError(
            f"{flag}: not UTF-8 text (character {exc.start} stands for an undecodable byte); pass UTF-8 text"
        ) from None
    return value


def check_device_name(name: str) -> str:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N``: anything else (``meta``, ``mps``,
    ``cuda:-1``, `` cpu``) is refused before torch sees it."""
    if not isinstance(name, str) or not _DEVICE_RE.match(name):
        shown = str(name)[:40]
        raise EngramError(f"--device: '{shown}' is not a device (expected cpu, cuda, cuda:N or auto)")
    return name


def check_generation_args(args: argparse.Namespace) -> None:
    """Every sampling and generation option of ``run`` / ``demo``, checked (and
    normalized: ``-0.0`` and temperatures below :data:`GREEDY_BELOW` become 0, greedy)
    before any checkpoint is read or engine built."""
    if not 1 <= args.max_new_tokens <= INT32_MAX:
        raise EngramError(f"--max-new-tokens must be >= 1 (got {args.max_new_tokens})")
    t = args.temperature
    if not (isinstance(t, float) and math.isfinite(t) and t >= 0):
        raise EngramError(f"--temperature must be a number >= 0 (got {t})")
    if t > MAX_TEMPERATURE:
        raise EngramError(
            f"--temperature {t} is larger than any useful value "
            f"(at most {MAX_TEMPERATURE:g}; 1 samples the model's distribution)"
        )
    if t < GREEDY_BELOW:
        args.temperature = 0.0  # -0.0 and subnormals: greedy
    p = args.top_p
    if not (isinstance(p, float) and math.isfinite(p) and 0 < p <= 1):
        raise EngramError(f"--top-p must be in (0, 1] (got {p})")
    if not 0 <= args.seed <= SEED_MAX:
        raise EngramError(f"--seed must be in 0..{SEED_MAX} (got {args.seed})")
    check_text(args.prompt, "--prompt")
    if not args.prompt:
        raise EngramError("--prompt is empty; give some text")
    for stop in getattr(args, "stop", None) or ():
        check_text(stop, "--stop")  # as --prompt: text the output is matched against
        if not stop:
            raise EngramError(
                "--stop is empty (every output would stop before its first token); give the text to stop at"
            )
    check_device_name(args.device)
    from engram_trt.config.dtypes import REFERENCE_DTYPES, require_dtype

    if args.dtype is not None:
        args.dtype = require_dtype(args.dtype, REFERENCE_DTYPES, "the reference model")


def resolve_device(name: str) -> Any:
    """The torch device for a checked ``--device`` (CUDA must exist for ``cuda``)."""
    import torch

    check_device_name(name)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise EngramError(f"--device {name}: no CUDA device is available here; use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise EngramError(
                f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s) "
                f"(cuda:0..cuda:{torch.cuda.device_count() - 1})"
            )
    return dev


def sampling_params_from_args(args: argparse.Namespace) -> Any:
    """The request's SamplingParams, every option checked (check_generation_args) before anything
    is loaded or built."""
    from engram_trt.runtime.sampling_params import SamplingParams

    check_generation_args(args)
    return SamplingParams(
        max_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        stop=tuple(args.stop or ()),
        ignore_eos=args.ignore_eos,
        skip_special_tokens=not getattr(args, "keep_special_tokens", False),
    )
