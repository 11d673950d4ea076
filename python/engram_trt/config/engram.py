"""``--engram-config``: where the Engram tables live and how ranks share them.

The fields are the serving peers' (vLLM / SGLang) ``--engram-config`` JSON, so a user
moving between them writes the same thing. This dataclass is the one place they are
parsed, defaulted and validated; the builder, the runtime, the CLI and the Triton model
all take an :class:`EngramConfig` and none re-parses JSON itself.

A value comes from, in order: the defaults, a JSON object (inline text or a file
path), then dotted overrides (``--engram-config.cpu_offload false``) whose values are
JSON scalars. Every mistake is refused before any work, in one line naming the field:
an unknown field (with the valid ones listed), a wrong type, Engram options for a model
with neither Engram layers nor PLE tables (Qwen4Exp's PLE tables are placed by the same
options), and combinations that contradict each other.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Iterable, Mapping

from engram_trt.config.model import ArchitectureConfig
from engram_trt.errors import EngramError

log = logging.getLogger(__name__)

FLAG = "--engram-config"
TABLE_PLACEMENTS = ("auto", "in_engine", "prefetch")


@dataclass(frozen=True)
class EngramConfig:
    """Storage and topology of the Engram tables (see docs/engram-spec.md).

    ``cpu_offload``: tables in pinned host memory read through UVA (True), or copied
    to GPU memory (False).
    ``host_file_gather``: no table copy at all; rows are read from the checkpoint's
    safetensors files through the page cache (the peers offer it for PLE checkpoints;
    here any checkpoint's tables qualify: safetensors store every table row-major).
    ``dp_shared_memory``: co-located processes share one table copy in /dev/shm.
    ``embedding_across_dp``: hash heads sharded across ranks, one copy in total.
    ``table_placement``: where the lookup runs: ``auto`` (default: ``prefetch`` with
    ``host_file_gather``, else ``in_engine``), ``in_engine`` (EngramHash ->
    EngramGather inside the engine, reading the tables through UVA; one launch
    sequence, no host sync) or ``prefetch`` (the engine takes staged rows as inputs; the
    runtime hashes and gathers them on a side stream, the faster path for host tables
    per docs/platform.md).
    ``hot_cache_fraction`` (default 0: off): a hot-row cache in GPU memory in front of
    the host tables, holding this share (0..1] of each table's rows, so a step fetches
    only its distinct uncached rows over the link (:mod:`engram_trt.cache.storecache`).
    For tables a model gathers in its step (Qwen4Exp's PLE tables); not with
    ``cpu_offload: false`` (the tables are in GPU memory already).
    """

    cpu_offload: bool = True
    host_file_gather: bool = False
    dp_shared_memory: bool = False
    embedding_across_dp: bool = False
    table_placement: str = "auto"
    hot_cache_fraction: float = 0.0
    # Fields the user set (to their default or not): a model without Engram layers
    # refuses any of them, even `cpu_offload: true`.
    given: tuple[str, ...] = field(default=(), compare=False, repr=False)

    # -- construction --------------------------------------------------------------
    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.name != "given"]

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = FLAG) -> "EngramConfig":
        """Build from a mapping; unknown fields and wrong types are refused."""
        if not isinstance(d, Mapping):
            raise EngramError(
                f"{source}: expected a JSON object of fields (got {type(d).__name__}); "
                f"valid fields: {', '.join(cls.field_names())}"
            )
        return cls().with_overrides(d, source)

    @classmethod
    def parse(
        cls,
        text: str | Path | Mapping[str, Any] | None,
        overrides: Mapping[str, Any] | Iterable[tuple[str, Any]] | None = None,
    ) -> "EngramConfig":
        """From inline JSON, a JSON file path, a mapping or None (defaults), then dotted
        overrides (``{"cpu_offload": "false"}``: string values are read as JSON scalars)."""
        if text is None or (isinstance(text, str) and not text.strip()):
            cfg = cls()
        elif isinstance(text, Mapping):
            cfg = cls.from_dict(text)
        else:
            cfg = cls.from_dict(_load_json_object(text))
        if overrides:
            items = overrides.items() if isinstance(overrides, Mapping) else overrides
            parsed = {}
            for key, value in items:
                parsed[key] = parse_scalar(value, f"{FLAG}.{key}") if isinstance(value, str) else value
            cfg = cfg.with_overrides(parsed, FLAG)
        return cfg

    def with_overrides(self, d: Mapping[str, Any], source: str = FLAG) -> "EngramConfig":
        valid = self.field_names()
        changes: dict[str, Any] = {}
        for key, value in d.items():
            if key not in valid:
                raise EngramError(f"{source}: unknown field '{str(key)[:80]}' (valid fields: {', '.join(valid)})")
            changes[key] = _check_type(key, value, source)
        given = tuple(sorted(set(self.given) | set(changes)))
        return replace(self, **changes, given=given)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("given")
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @property
    def placement(self) -> str:
        """The resolved placement: ``in_engine`` or ``prefetch``."""
        if self.table_placement != "auto":
            return self.table_placement
        return "prefetch" if self.host_file_gather else "in_engine"

    # -- validation ---------------------------------------------------------------
    def is_default(self) -> bool:
        return self == EngramConfig()

    def validate(self) -> None:
        """Refuse combinations that contradict each other (model-independent)."""
        if self.host_file_gather and not self.cpu_offload:
            raise EngramError(
                f"{FLAG}: host_file_gather reads rows from the checkpoint files on the host, which contradicts "
                "cpu_offload=false (tables in GPU memory); set cpu_offload true or drop host_file_gather"
            )
        if self.host_file_gather and self.dp_shared_memory:
            raise EngramError(
                f"{FLAG}: host_file_gather and dp_shared_memory both choose where the one host copy lives "
                "(the page cache of the checkpoint files vs /dev/shm); pick one"
            )
        if self.host_file_gather and self.table_placement == "in_engine":
            raise EngramError(
                f"{FLAG}: host_file_gather gathers rows on the host, so the lookup cannot run in the engine; "
                "use table_placement 'prefetch'"
            )
        if self.dp_shared_memory and not self.cpu_offload:
            raise EngramError(
                f"{FLAG}: dp_shared_memory shares a host copy of the tables in /dev/shm, "
                "which contradicts cpu_offload=false (tables in GPU memory); set cpu_offload true"
            )
        if self.hot_cache_fraction and not self.cpu_offload:
            raise EngramError(
                f"{FLAG}: hot_cache_fraction caches host-table rows in GPU memory, but cpu_offload=false puts the "
                "whole tables there already; drop hot_cache_fraction or set cpu_offload true"
            )
        if self.dp_shared_memory and self.embedding_across_dp:
            raise EngramError(
                f"{FLAG}: dp_shared_memory (every rank reads one shared full copy) "
                "and embedding_across_dp (heads sharded across ranks) are two answers to the same question; pick one"
            )

    def validate_for(self, model_config: ArchitectureConfig) -> None:
        """Check against the model before any work: a model with neither Engram layers
        nor PLE tables (Qwen4Exp's ``ple_layer_ids``, placed by the same stores) takes no
        Engram options; PLE tables are not sharded across ranks."""
        self.validate()
        spec = model_config.engram
        if spec is None:
            changed = sorted(
                set(self.given) | {k for k, v in self.to_dict().items() if v != getattr(EngramConfig(), k)}
            )
            if model_config.ple is not None:
                if self.embedding_across_dp:
                    raise EngramError(
                        f"{FLAG}: embedding_across_dp shards Engram hash heads across ranks, which this "
                        f"model's PLE tables do not support; use dp_shared_memory to share one copy, or drop it"
                    )
                return
            if self.given or not self.is_default():
                raise EngramError(
                    f"{FLAG} sets {', '.join(changed)} but the model has no Engram layers (no 'engram_layer_ids' "
                    f"in config.json) and no PLE tables (no 'ple_layer_ids'); drop {FLAG}"
                )
            return
        if self.hot_cache_fraction:
            raise EngramError(
                f"{FLAG}: hot_cache_fraction serves tables a model gathers in its step (Qwen4Exp's PLE "
                f"tables); this model's Engram rows are gathered by the engine or the prefetcher; drop it"
            )


def _load_json_object(text: str | Path) -> Any:
    """Inline JSON (text starting with '{') or a path to a JSON file."""
    from engram_trt.config.jsonfile import parse_json_text, read_json_file

    s = str(text).strip()
    if s.startswith(("{", "[")):
        return parse_json_text(s, FLAG)
    p = Path(s).expanduser()
    try:
        is_file = p.is_file()
    except (OSError, ValueError):  # a name too long or with a NUL byte
        is_file = False
    if not is_file:
        shown = s if len(s) <= 80 else s[:77] + "..."
        raise EngramError(
            f"{FLAG}: '{shown}' is neither a JSON object nor an existing file "
            "(pass '{\"cpu_offload\": false}' or a path to a .json file)"
        )
    return read_json_file(p, f"{FLAG} file", max_bytes=1024 * 1024)


def parse_scalar(text: str, source: str) -> Any:
    """A dotted override's value as a JSON scalar (``true``, ``3``, ``"x"``); a bare word
    that is not JSON is taken as a string (``in_engine``)."""
    from engram_trt.config.jsonfile import parse_json_text

    try:
        value = parse_json_text(text, source)
    except EngramError:
        if text.lstrip().startswith(("{", "[")):
            raise
        return text
    if isinstance(value, (dict, list)):
        raise EngramError(f"{source}: expected a scalar value (true/false, a number or a string), got {text[:80]!r}")
    return value


def _shown(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_type(key: str, value: Any, source: str) -> Any:
    default = getattr(EngramConfig(), key)
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise EngramError(f"{source}: field '{key}' must be true or false (got {_shown(value)})")
        return value
    if key == "hot_cache_fraction":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
            raise EngramError(
                f"{source}: field 'hot_cache_fraction' must be a number in [0, 1] "
                f"(the share of each table's rows cached in GPU memory; 0 = off), got {_shown(value)}"
            )
        return float(value)
    if key == "table_placement":
        if value not in TABLE_PLACEMENTS:
            raise EngramError(
                f"{source}: field 'table_placement' must be one of {', '.join(TABLE_PLACEMENTS)} (got {_shown(value)})"
            )
        return value
    return value  # pragma: no cover - every field is covered above
