"""Reading JSON a user handed us (config.json, the safetensors index, ``--engram-config``,
manifests, cache stamps) so that every way it can be wrong is one line naming the file.

``json.loads`` alone lets through, or fails with a traceback on: bytes that are not
UTF-8 (``UnicodeDecodeError``), nesting deep enough to exhaust the recursion limit
(``RecursionError``), integers past Python's digit limit (``ValueError``), files of
gigabytes (memory), duplicate keys (silently the last one wins), and ``NaN`` /
``Infinity`` (not JSON). Each is refused here, with the file and the fix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engram_trt.errors import ConfigError

MAX_JSON_BYTES = 64 * 1024 * 1024  # config.json / an index are kilobytes to a few MB
MAX_DEPTH = 64  # real configs nest 3-4 levels


def _no_duplicates(where: str) -> Any:
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in pairs:
            if k in out:
                raise ConfigError(f"{where}: key '{k}' appears twice in one object (keep one)")
            out[k] = v
        return out

    return hook


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _depth(obj: Any, limit: int) -> int:
    """Nesting depth of parsed JSON, iteratively (never recursing into a deep value)."""
    deepest = 0
    stack = [(obj, 1)]
    while stack:
        value, d = stack.pop()
        if isinstance(value, (dict, list)):
            deepest = max(deepest, d)
            if deepest > limit:
                return deepest
            stack.extend((v, d + 1) for v in (value.values() if isinstance(value, dict) else value))
    return deepest


def parse_json_text(text: str | bytes, where: str, *, max_depth: int = MAX_DEPTH) -> Any:
    """Parse JSON text; any defect is a :class:`ConfigError` naming ``where``."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"{where}: not UTF-8 text (byte {exc.start} is 0x{text[exc.start]:02x}); save the file as UTF-8"
            ) from None
    else:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            # A str holding lone surrogates: bytes that were not UTF-8 (a file name or argv).
            raise ConfigError(
                f"{where}: not UTF-8 text (character {exc.start} is an undecodable byte); pass UTF-8 text"
            ) from None
        text = text.removeprefix("\ufeff")
    try:
        value = json.loads(text, object_pairs_hook=_no_duplicates(where), parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except RecursionError:
        raise ConfigError(
            f"{where}: JSON nested too deeply (more than {max_depth} levels); this is not a config file"
        ) from None
    except ValueError as exc:  # NaN/Infinity, an integer of thousands of digits
        reason = "an integer of thousands of digits" if "digits" in str(exc) else str(exc).splitlines()[0]
        raise ConfigError(f"{where}: not valid JSON ({reason})") from None
    if _depth(value, max_depth) > max_depth:
        raise ConfigError(f"{where}: JSON nested too deeply (more than {max_depth} levels); this is not a config file")
    return value


def read_json_file(
    path: str | Path, what: str = "JSON file", *, max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_DEPTH
) -> Any:
    """Read and parse a JSON file of at most ``max_bytes``; errors name the file."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            data = f.read(max_bytes + 1)
    except IsADirectoryError:
        raise ConfigError(f"{p}: is a folder, not a {what}") from None
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read the {what} ({exc.strerror}); check the path and its permissions") from None
    if len(data) > max_bytes:
        raise ConfigError(f"{p}: larger than {max_bytes // (1024 * 1024)} MiB, which no {what} is; check the path")
    return parse_json_text(data, str(p), max_depth=max_depth)


def read_json_object(path: str | Path, what: str = "JSON file", **kw: Any) -> dict[str, Any]:
    """:func:`read_json_file`, refusing anything but an object at the top."""
    value = read_json_file(path, what, **kw)
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: expected a JSON object at the top level of the {what} (got {type(value).__name__})")
    return value
