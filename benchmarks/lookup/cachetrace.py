"""Where a hot-row cache step's host time goes, call by call (``bench_cache.py
--host-trace N``).

Why: on the H200 VM a prefill chunk's cache step holds ~100 us of GPU work beside the
fetch, yet the rest of the step takes ~400 us, and the GPU waits for the host's calls
(``--breakdown``'s unsynced timeline). cProfile (``--host-profile``) names the Python
functions but inflates every call several times over, and its own time per function
hides when in the step a call ran. This tracer wraps the step's calls at their seams
(the policy's plan and finish, the bound kernel calls, the host gather, the library's
C entry points, the stream's sync, the ids' upload) with two clock reads each, runs
``N`` steps as the timed loop does (each to the stream's completion), and reports per
call its median start in the step, its median duration and its own time (less the
traced calls inside it). The wrappers' own cost is measured and printed beside it.
Nothing in the package is changed: the wrappers are set on the cache's objects and
the modules' names for the duration of the trace, and restored after.
"""

from __future__ import annotations

import itertools
import statistics
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator


class _Tracer:
    def __init__(self) -> None:
        self.spans: list[tuple[str, int, int, int]] = []  # (name, depth, start ns, end ns)
        self.depth = 0

    def wrap(self, name: str | Callable[..., str], fn: Callable[..., Any]) -> Callable[..., Any]:
        clock = time.perf_counter_ns

        def traced(*args: Any, **kwargs: Any) -> Any:
            label = name(*args) if callable(name) else name
            t0 = clock()
            self.depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1
                self.spans.append((label, self.depth, t0, clock()))

        return traced


def _c_entry(fn_name: str, *_: Any) -> str:
    return f"C {fn_name}"


@contextmanager
def _patched(tracer: _Tracer, cache: Any) -> Iterator[None]:
    """Wrap the step's seams; restore every one afterwards, also on an error."""
    import torch

    import engram_trt.native.cache as ck
    import engram_trt.native.hostgather as hg

    policy, transfer = cache.policy, cache.transfer
    undo: list[tuple[Any, str, Any, bool]] = []

    def patch(owner: Any, attr: str, name: Any) -> None:
        had_own = attr in vars(owner)  # else a class's (or base class's) attribute: shadowed, then deleted
        original = getattr(owner, attr)
        undo.append((owner, attr, original, had_own))
        setattr(owner, attr, tracer.wrap(name, original))

    try:
        if getattr(cache, "_whole_step", None) is not None:
            patch(cache, "_whole_step", "whole step (C)")
        patch(policy, "plan", "policy.plan")
        if getattr(policy, "_plan_call", None) is not None:
            patch(policy, "_plan_call", "PlanCall")
        patch(policy, "finish", "policy.finish")
        patch(policy, "_admission", "admission draws")
        if hasattr(policy, "_finish_fused"):
            patch(policy, "_finish_fused", "admit call")
        for attr in ("prepare", "fetch", "deliver"):
            if hasattr(transfer, attr):
                patch(transfer, attr, f"transfer.{attr}")
        gatherer = getattr(transfer, "gatherer", None)
        if gatherer is not None:
            patch(gatherer, "gather_raw", "gather_raw")
        for module in (ck, hg):
            for attr in ("_call", "gather_call"):
                if hasattr(module, attr):
                    patch(module, attr, _c_entry)
            for attr, label in (("device_guard", "device_guard"), ("stream_of", "stream")):
                if hasattr(module, attr):
                    patch(module, attr, label)
        patch(torch.cuda, "current_stream", "current_stream")
        patch(torch.cuda.Stream, "synchronize", "stream sync")
        patch(torch.Tensor, "copy_", "tensor copy_")
        yield
    finally:
        for owner, attr, original, had_own in reversed(undo):
            if had_own:
                setattr(owner, attr, original)
            else:
                delattr(owner, attr)


def _wrapper_cost_ns(reps: int = 2000) -> float:
    """Median cost of one traced call around a no-op (ns): what each span adds."""
    tracer = _Tracer()
    noop = tracer.wrap("noop", lambda: None)
    clock = time.perf_counter_ns
    times = []
    for _ in range(reps):
        t0 = clock()
        noop()
        times.append(clock() - t0)
    return float(statistics.median(times))


def host_trace(cache: Any, ids: list[Any], out: Any, device: Any, steps: int) -> dict[str, Any]:
    """``steps`` steps of ``cache`` (cycling over ``ids``), each timed from the call to
    the stream's completion with every seam traced. Returns ``step_us`` (median),
    ``calls``: per traced name (in order of its median start) ``count`` per step,
    ``start_us`` (median first start in the step), ``us`` (median summed duration per
    step), ``own_us`` (less the traced calls inside it) and ``in_steps`` (how many steps
    made the call: the medians are over those), and ``wrapper_ns``."""
    from engram_trt.bench.common import sync

    tracer = _Tracer()
    per_step: list[dict[str, list[float]]] = []
    step_us: list[float] = []
    chunks = itertools.cycle(ids)
    with _patched(tracer, cache):
        for _ in range(steps):
            x = next(chunks)
            sync(device)
            tracer.spans.clear()
            t0 = time.perf_counter_ns()
            cache.gather(x, out)
            sync(device)  # outside the patch's reach: bench.common's sync is torch.cuda.synchronize
            step_us.append((time.perf_counter_ns() - t0) / 1e3)
            per_step.append(_step_calls(tracer.spans, t0))
    names: dict[str, dict[str, list[float]]] = {}
    for calls in per_step:
        for name, (count, start, total, own) in calls.items():
            d = names.setdefault(name, {"count": [], "start": [], "us": [], "own": []})
            d["count"].append(count)
            d["start"].append(start)
            d["us"].append(total)
            d["own"].append(own)
    rows = [
        {
            "name": n,
            "count": statistics.median(d["count"]),
            "start_us": statistics.median(d["start"]),
            "us": statistics.median(d["us"]),
            "own_us": statistics.median(d["own"]),
            "in_steps": len(d["count"]),
        }
        for n, d in names.items()
    ]
    rows.sort(key=lambda r: r["start_us"])
    return {"steps": steps, "step_us": statistics.median(step_us), "calls": rows, "wrapper_ns": _wrapper_cost_ns()}


def _step_calls(spans: list[tuple[str, int, int, int]], t0: int) -> dict[str, tuple[int, float, float, float]]:
    """Per name: (count, first start us, summed us, summed own us) of one step's spans."""
    inner = [0] * len(spans)
    # A span's children end before it and start after it, one level deeper: spans are
    # appended as they end, so each child precedes its parent in the list.
    for i, (_, depth, a, b) in enumerate(spans):
        for j in range(i - 1, -1, -1):
            _, d2, a2, b2 = spans[j]
            if d2 == depth + 1 and a <= a2 and b2 <= b:
                inner[i] += b2 - a2
            elif b2 < a:
                break
    out: dict[str, tuple[int, float, float, float]] = {}
    for (name, _, a, b), kids in zip(spans, inner):
        count, start, total, own = out.get(name, (0, float("inf"), 0.0, 0.0))
        out[name] = (count + 1, min(start, (a - t0) / 1e3), total + (b - a) / 1e3, own + (b - a - kids) / 1e3)
    return out


def describe_trace(t: dict[str, Any]) -> list[str]:
    """The trace in a few lines: the step, then each call (start, duration, own time)."""
    lines = [
        f"host trace, {t['steps']} steps, step {t['step_us']:.0f} us (each traced call adds "
        f"~{t['wrapper_ns'] / 1e3:.1f} us); calls by first start (us from the call: start +duration [own]):"
    ]
    parts = [
        f"{r['name']}{'' if r['count'] == 1 else ' x%g' % r['count']} @{r['start_us']:.0f} "
        f"+{r['us']:.0f} [{r['own_us']:.0f}]"
        + ("" if r.get("in_steps", t["steps"]) == t["steps"] else f" (in {r['in_steps']} of {t['steps']} steps)")
        for r in t["calls"]
    ]
    for k in range(0, len(parts), 4):
        lines.append("  " + "; ".join(parts[k : k + 4]))
    return lines
