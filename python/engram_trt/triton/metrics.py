"""Engram and scheduler counters as Triton custom metrics.

Why Triton's own metric API (``pb_utils.MetricFamily``) and not a second HTTP port:
the values then appear on Triton's ``/metrics`` endpoint beside ``nv_inference_*``, so
one Prometheus scrape sees both, labelled by model, version and instance.

:func:`flatten_stats` turns :meth:`engram_trt.LLM.stats` into ``(metric, labels) ->
value`` (pure, unit-tested); :class:`MetricsExporter` creates the families and pushes
the values: counters by their increase since the last push (Triton counters only go
up), gauges as they are. It refreshes on a timer and when :meth:`MetricsExporter.poke`
is called (the model pokes it when a request finishes), at most every ``min_interval``.
Fields the stats gain later (a ``hot_cache`` entry, new lookup paths) are exported as
they appear, without a change here.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping

log = logging.getLogger(__name__)

COUNTER, GAUGE = "counter", "gauge"


@dataclass(frozen=True)
class MetricDef:
    name: str
    kind: str
    help: str


# (stats key, metric, labels) of the scheduler's counters (engram_trt.runtime.scheduler).
_SCHEDULER: tuple[tuple[str, MetricDef, tuple[tuple[str, str], ...]], ...] = (
    ("running", MetricDef("engram_requests_running", GAUGE, "requests generating now (holding a KV slot)"), ()),
    ("waiting", MetricDef("engram_requests_waiting", GAUGE, "requests queued for a KV slot"), ()),
    ("kv_slots_in_use", MetricDef("engram_kv_slots_in_use", GAUGE, "KV-cache slots held by running requests"), ()),
    ("kv_slots", MetricDef("engram_kv_slots", GAUGE, "KV-cache slots in all (the runtime's max batch)"), ()),
    ("requests_finished", MetricDef("engram_requests_finished_total", COUNTER, "requests finished (any reason)"), ()),
    ("steps", MetricDef("engram_steps_total", COUNTER, "scheduler steps run"), ()),
    (
        "prefill_tokens",
        MetricDef("engram_tokens_total", COUNTER, "tokens run through the model, by phase"),
        (("phase", "prefill"),),
    ),
    (
        "decode_tokens",
        MetricDef("engram_tokens_total", COUNTER, "tokens run through the model, by phase"),
        (("phase", "decode"),),
    ),
    ("step_s", MetricDef("engram_step_seconds_total", COUNTER, "seconds spent running steps"), ()),
    (
        "tokens_per_step",
        MetricDef("engram_step_tokens_mean", GAUGE, "mean tokens per step since start (batch size in tokens)"),
        (),
    ),
    ("last_step_tokens", MetricDef("engram_step_tokens_last", GAUGE, "tokens in the last step"), ()),
    ("last_step_seqs", MetricDef("engram_step_sequences_last", GAUGE, "sequences in the last step (batch size)"), ()),
    (
        "max_step_seqs",
        MetricDef("engram_step_sequences_max", GAUGE, "most sequences one step has held since start"),
        (),
    ),
)

# (stats["engram"] key, metric) of the lookup counters (engram_trt.runtime.prefetch).
_LOOKUP: tuple[tuple[str, MetricDef], ...] = (
    ("rows", MetricDef("engram_lookup_rows_total", COUNTER, "Engram table rows looked up")),
    (
        "bytes_from_host",
        MetricDef(
            "engram_lookup_bytes_from_host_total", COUNTER, "bytes of Engram rows moved from host memory to the device"
        ),
    ),
    ("lookup_s", MetricDef("engram_lookup_seconds_total", COUNTER, "seconds spent hashing and gathering Engram rows")),
    ("steps", MetricDef("engram_lookup_steps_total", COUNTER, "steps whose Engram rows were looked up")),
)
_PATHS = MetricDef("engram_lookup_path_steps_total", COUNTER, "steps by gather path (device, uva, host, reference)")
_TABLE_BYTES = MetricDef(
    "engram_table_bytes", GAUGE, "bytes of the Engram tables this instance serves, by storage kind"
)
_RESIDENT_BYTES = MetricDef(
    "engram_table_resident_bytes",
    GAUGE,
    "bytes of table memory this instance holds or maps (a shared segment counts in every instance attached to it)",
)
_TP_RANKS = MetricDef(
    "engram_tp_ranks", GAUGE, "ranks of the tensor-parallel group this instance leads (itself included)"
)
_TP_RANKS_ALIVE = MetricDef(
    "engram_tp_ranks_alive",
    GAUGE,
    "ranks of this instance's tensor-parallel group still running (below engram_tp_ranks: the group is broken)",
)
_HOT_COUNTER_KEYS = {"hits", "misses", "lookups", "rows", "admissions", "evictions", "inserts"}

Key = tuple[str, tuple[tuple[str, str], ...]]


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


def flatten_stats(stats: Mapping[str, Any]) -> dict[Key, tuple[MetricDef, float]]:
    """``(metric name, labels) -> (definition, value)`` of one :meth:`LLM.stats` snapshot
    (plus ``storage``: :attr:`LLM.storage`, where the model adds it)."""
    out: dict[Key, tuple[MetricDef, float]] = {}
    for key, mdef, labels in _SCHEDULER:
        v = _number(stats.get(key))
        if v is not None:
            out[(mdef.name, labels)] = (mdef, v)
    eng = stats.get("engram")
    if isinstance(eng, Mapping):
        for key, mdef in _LOOKUP:
            v = _number(eng.get(key))
            if v is not None:
                out[(mdef.name, ())] = (mdef, v)
        for path, n in (eng.get("paths") or {}).items():
            v = _number(n)
            if v is not None:
                out[(_PATHS.name, (("path", str(path)),))] = (_PATHS, v)
    storage = stats.get("storage")
    if isinstance(storage, Mapping) and storage.get("kind") not in (None, "none"):
        labels = (("storage", str(storage["kind"])),)
        for mdef, key in ((_TABLE_BYTES, "table_bytes"), (_RESIDENT_BYTES, "resident_bytes")):
            v = _number(storage.get(key))
            if v is not None:
                out[(mdef.name, labels)] = (mdef, v)
    group = stats.get("tp_group")  # an instance leading a TP group (engram_trt.distributed.serving)
    if isinstance(group, Mapping):
        for mdef, key in ((_TP_RANKS, "ranks"), (_TP_RANKS_ALIVE, "ranks_alive")):
            v = _number(group.get(key))
            if v is not None:
                out[(mdef.name, ())] = (mdef, v)
    # A hot-row cache, where the runtime has one, reports under either place.
    hot = stats.get("hot_cache")
    if not isinstance(hot, Mapping) and isinstance(eng, Mapping):
        hot = eng.get("hot_cache")
    if isinstance(hot, Mapping):
        for key, raw in hot.items():
            v = _number(raw)
            if v is None:
                continue
            safe = "".join(c if c.isalnum() else "_" for c in str(key)).lower()
            if safe in _HOT_COUNTER_KEYS:
                mdef = MetricDef(f"engram_hot_cache_{safe}_total", COUNTER, f"hot-row cache: {key}")
            else:
                mdef = MetricDef(f"engram_hot_cache_{safe}", GAUGE, f"hot-row cache: {key}")
            out[(mdef.name, ())] = (mdef, v)
    return out


class MetricsExporter:
    """Pushes :func:`flatten_stats` of ``stats()`` into Triton metric families (see the
    module docstring). ``pb_utils`` is Triton's ``triton_python_backend_utils`` (or a
    stand-in with the same ``MetricFamily`` shape in tests); ``labels`` go on every
    metric (model, version, instance)."""

    def __init__(
        self,
        pb_utils: Any,
        stats: Callable[[], Mapping[str, Any]],
        labels: Mapping[str, str],
        *,
        interval: float = 1.0,
        min_interval: float = 0.05,
    ) -> None:
        self.pb = pb_utils
        self.stats = stats
        self.labels = dict(labels)
        self.interval = float(interval)
        self.min_interval = float(min_interval)
        self._families: dict[str, Any] = {}
        self._metrics: dict[Key, Any] = {}
        self._last: dict[Key, float] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _metric(self, key: Key, mdef: MetricDef) -> Any:
        m = self._metrics.get(key)
        if m is None:
            fam = self._families.get(mdef.name)
            if fam is None:
                kind = self.pb.MetricFamily.COUNTER if mdef.kind == COUNTER else self.pb.MetricFamily.GAUGE
                fam = self._families[mdef.name] = self.pb.MetricFamily(name=mdef.name, description=mdef.help, kind=kind)
            m = self._metrics[key] = fam.Metric(labels={**self.labels, **dict(key[1])})
        return m

    def update(self) -> None:
        """Push one snapshot now."""
        values = flatten_stats(self.stats())
        # requests_finished last: a scrape that sees a request finished sees its other
        # counters too (each push is a separate call into Triton).
        order = sorted(values, key=lambda k: k[0] == "engram_requests_finished_total")
        with self._lock:
            for key in order:
                mdef, v = values[key]
                m = self._metric(key, mdef)
                if mdef.kind == COUNTER:
                    delta = v - self._last.get(key, 0.0)
                    if delta > 0:
                        m.increment(delta)
                        self._last[key] = v
                else:
                    m.set(v)

    def poke(self) -> None:
        """Ask for a refresh soon (a request finished)."""
        self._wake.set()

    def start(self) -> "MetricsExporter":
        self._thread = threading.Thread(target=self._loop, name="engram-metrics", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.update()
            except Exception as exc:  # metrics must never take the model down
                log.warning("engram metrics update failed: %s", exc)
            self._stop.wait(self.min_interval)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
