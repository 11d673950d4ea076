"""One hot-row cache step under the CUDA profiler (``bench_cache.py
--kernel-profile``): when each phase ran on the host and what the GPU ran meanwhile.

Why: the synced phase times (``--breakdown``) say that a prefill chunk's plan, delivery
and admission take hundreds of microseconds, but not whether that is the GPU's kernels
or the host's calls and waits around them, and the two call for different fixes. The
profile gives each phase's span on the host clock and every kernel and copy on the GPU
(all streams: the cache's, the host gather's copies), on the profiler's one clock.
"""

from __future__ import annotations

from typing import Any

STEP_RANGE = "engram_trt.bench.cache.step"
PHASES = ("plan", "fetch", "deliver", "admit")  # the order HotRowCache.gather marks them


def profile_step(cache: Any, ids: Any, out: Any, device: Any) -> dict[str, Any]:
    """One ``cache.gather(ids, out)`` under the profiler (phase by phase: the marks are
    Python callbacks between the phases, so a CUDA cache does not take its whole step). Returns ``step_us`` (the call
    to the stream's completion), ``phases`` (each phase's host span, us from the step's
    start), ``activities`` (every kernel and copy: name, stream, start, duration),
    ``by_name`` (count, summed us, first start and last end per name), ``gpu_busy_us``
    (the union of all GPU spans) and ``idle`` (:func:`bench.common.idle_gaps` over all
    streams: where no GPU work ran within the step)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from engram_trt.bench.common import sync

    opened: list[Any] = []

    def enter(name: str) -> None:
        rf = record_function(f"{STEP_RANGE}.{name}")
        rf.__enter__()
        opened.append(rf)

    def mark(phase: str) -> None:
        opened.pop().__exit__(None, None, None)
        at = PHASES.index(phase)
        if at + 1 < len(PHASES):
            enter(PHASES[at + 1])

    sync(device)
    kinds = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=kinds) as prof:
        with record_function(STEP_RANGE):
            enter(PHASES[0])
            try:
                cache.gather(ids, out, phase=mark)
            finally:
                while opened:
                    opened.pop().__exit__(None, None, None)
            sync(device)
    return summarize(prof.events(), torch.autograd.DeviceType.CUDA)


def summarize(events: Any, cuda_type: Any) -> dict[str, Any]:
    """The profile's figures from its events (separate from the profiling so a test can
    feed it made-up events)."""
    from engram_trt.bench.common import idle_gaps, union_us

    step = None
    spans: dict[str, tuple[float, float]] = {}
    gpu: list[tuple[float, float, str, int]] = []
    for e in events:
        a, b = float(e.time_range.start), float(e.time_range.end)
        if e.device_type == cuda_type:
            if not e.name.startswith(STEP_RANGE):  # the profiler's GPU copy of a host range, not GPU work
                gpu.append((a, b, e.name, int(e.device_resource_id or 0)))
        elif e.name == STEP_RANGE:
            step = (a, b)
        elif e.name.startswith(STEP_RANGE + "."):
            spans[e.name[len(STEP_RANGE) + 1 :]] = (a, b)
    if step is None:
        raise RuntimeError(f"the profile holds no '{STEP_RANGE}' range")
    t0 = step[0]
    acts = sorted(gpu)
    by_name: dict[str, dict[str, Any]] = {}
    for a, b, name, _ in acts:
        s = by_name.setdefault(name[:60], {"count": 0, "us": 0.0, "first_us": a - t0, "last_us": b - t0})
        s["count"] += 1
        s["us"] += b - a
        s["last_us"] = max(s["last_us"], b - t0)
    return {
        "step_us": step[1] - step[0],
        "phases": {p: (spans[p][0] - t0, spans[p][1] - t0) for p in PHASES if p in spans},
        "activities": [{"name": n[:80], "stream": s, "start_us": a - t0, "us": b - a} for a, b, n, s in acts],
        "by_name": by_name,
        "gpu_busy_us": union_us([(a, b) for a, b, _, _ in acts]),
        "idle": idle_gaps([(a, b, n) for a, b, n, _ in acts], *step),
    }


def describe(p: dict[str, Any]) -> list[str]:
    """The profile in a few lines: the phases' host spans, then the GPU's work by name."""
    lines = [
        f"profiled step {p['step_us']:.0f} us, GPU busy {p['gpu_busy_us']:.0f} us (any stream); host spans: "
        + ", ".join(f"{k} {a:.0f}-{b:.0f}" for k, (a, b) in p["phases"].items())
    ]
    idle = p["idle"]
    lines.append(
        f"GPU idle {idle['lead_us']:.0f} us before its first work, {idle['gaps_us']:.0f} us between, "
        f"{idle['tail_us']:.0f} us after its last; largest gaps: "
        + "; ".join(f"{g['us']:.0f} us before {g['before'][:32]}" for g in idle["largest"][:3])
    )
    parts = sorted(p["by_name"].items(), key=lambda kv: kv[1]["first_us"])
    lines.append(
        "GPU work: "
        + "; ".join(
            f"{name[:40]} x{s['count']} {s['us']:.0f} us ({s['first_us']:.0f}-{s['last_us']:.0f})" for name, s in parts
        )
    )
    return lines


def phase_timeline(cache: Any, ids: list[Any], out: Any, device: Any) -> dict[str, Any]:
    """Steps of ``cache`` on each of ``ids``, unsynced: at each phase's mark the host's
    time and a CUDA event, so one step shows when the host had issued each phase and
    when the GPU got there, with no wait between phases (unlike ``--breakdown``'s synced
    times) and no profiler. Returns per phase the medians over the steps of ``host_us``
    and ``gpu_us`` (from the step's start, the GPU's by events on the current stream),
    and ``end_us``, the step's end (the stream's completion, as the timed loop)."""
    import statistics
    import time

    import torch

    from engram_trt.bench.common import sync

    host: dict[str, list[float]] = {p: [] for p in PHASES}
    gpu: dict[str, list[float]] = {p: [] for p in PHASES}
    ends: list[float] = []
    # made once: creating an event is a CUDA call, which the marks would otherwise time
    start, *events = (torch.cuda.Event(enable_timing=True) for _ in range(1 + len(PHASES)))
    for x in ids:
        marks: list[tuple[str, float, Any]] = []

        def mark(phase: str) -> None:
            ev = events[len(marks)]
            ev.record()
            marks.append((phase, time.perf_counter(), ev))

        sync(device)
        t0 = time.perf_counter()
        start.record()
        cache.gather(x, out, phase=mark)
        sync(device)
        ends.append((time.perf_counter() - t0) * 1e6)
        for phase, t, ev in marks:
            host[phase].append((t - t0) * 1e6)
            gpu[phase].append(start.elapsed_time(ev) * 1e3)
    return {
        "host_us": {p: statistics.median(v) for p, v in host.items() if v},
        "gpu_us": {p: statistics.median(v) for p, v in gpu.items() if v},
        "end_us": statistics.median(ends),
        "steps": len(ids),
    }


def describe_timeline(t: dict[str, Any]) -> str:
    return (
        f"unsynced, medians of {t['steps']} steps (us from the call): host issued "
        + ", ".join(f"{p} {v:.0f}" for p, v in t["host_us"].items())
        + "; GPU reached "
        + ", ".join(f"{p} {v:.0f}" for p, v in t["gpu_us"].items())
        + f"; done {t['end_us']:.0f}"
    )


def call_costs(cache: Any, ids: Any, out: Any, device: Any, reps: int = 50) -> dict[str, float]:
    """What single host calls cost on this machine (medians of ``reps``, us, each timed
    on the host from an idle GPU): the cache's delivery call (``deliver_us``: its host
    part, without waiting for the kernel), a CUDA event's record (``event_record_us``),
    a wait on an idle stream (``idle_sync_us``) and a host-to-device copy of the step's
    ids from pinned memory (``ids_upload_us``). Why: a cache step makes a few dozen such
    calls, and on a VM they can cost several times what they cost on bare metal; these
    figures say how much of a phase's host time is the calls themselves."""
    import statistics
    import time

    import torch

    from engram_trt.bench.common import sync
    from engram_trt.cache.hotcache import delivery_shape

    plan = cache.policy.plan(ids, cache.miss_base)
    positions = plan.positions.clone()  # valid positions (a plan's own are views of buffers the next plan reuses)
    cache.policy.abort(plan)  # nothing is admitted (this plan's lookup counts stay)
    shape = delivery_shape(ids)
    positions = positions.view(shape)
    out_view = out.view(*shape, cache.head_dim)
    staged = torch.empty(ids.numel(), dtype=torch.int32, device=device)
    pinned = ids.reshape(-1).pin_memory() if not ids.is_pinned() else ids.reshape(-1)
    ev = torch.cuda.Event()
    stream = torch.cuda.current_stream(device)
    calls = {
        "deliver_us": lambda: cache.transfer.deliver(positions, cache.work_rows, cache.work_scales, out_view),
        "event_record_us": ev.record,
        "idle_sync_us": stream.synchronize,
        "ids_upload_us": lambda: staged.copy_(pinned, non_blocking=True),
    }
    got: dict[str, float] = {}
    for name, fn in calls.items():
        times = []
        for _ in range(reps):
            sync(device)
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        got[name] = statistics.median(times)
    sync(device)
    return got


def describe_costs(c: dict[str, float]) -> str:
    return "host call costs here (us, medians, GPU idle): " + ", ".join(
        f"{k[:-3].replace('_', ' ')} {v:.1f}" for k, v in c.items()
    )
