"""One step of ``engram-trt bench step`` looked at closely: its streams under the CUDA
profiler (what each stream ran, and where the main stream sat idle), its host work
under cProfile, the lookup's timeline against the main stream's first read of the rows,
and a Chrome trace. Each takes ``one``, the benchmark's step as a callable, so it
profiles exactly what was timed."""

from __future__ import annotations

import time
from typing import Any

STEP_RANGE = "engram_trt.bench.step"  # the profiled step's CPU range: its wall span on the profiler's clock


def stream_profile(one: Any, device: Any) -> dict[str, Any]:
    """One step under the CUDA profiler, by stream: kernels (count, the union of their
    spans, their summed durations) and copies. The stream with the most kernels is the
    step's main stream; the others are the lookup's (a graph's side stream, the
    prefetcher's, the gather driver's). ``main_idle``: where the main stream sat idle
    within the step's wall span (bench.common.idle_gaps: before its first kernel, between
    kernels, after its last). The CPU side is profiled only for that span, and it slows
    each torch call a little, so ``profiled_step_us`` (the step's wall time under the
    profiler) is given beside it."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from engram_trt.bench.common import idle_gaps, sync, union_us

    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function(STEP_RANGE):
            one()
            sync(device)
    streams: dict[int, dict[str, Any]] = {}
    step_span = None
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            if e.name == STEP_RANGE:
                step_span = (float(e.time_range.start), float(e.time_range.end))
            continue
        s = streams.setdefault(
            int(e.device_resource_id or 0),
            {"kernels": 0, "kernel_spans": [], "copy_us": 0.0, "copies": 0, "activity": []},
        )
        span = (float(e.time_range.start), float(e.time_range.end))
        s["activity"].append((*span, e.name[:80]))
        if e.name.lower().startswith(("memcpy", "memset")):
            s["copies"] += 1
            s["copy_us"] += span[1] - span[0]
        else:
            s["kernels"] += 1
            s["kernel_spans"].append(span)
    out: list[dict[str, Any]] = []
    result: dict[str, Any] = {"by_stream": out}
    for sid, s in sorted(streams.items(), key=lambda kv: -kv[1]["kernels"]):
        spans, activity = s.pop("kernel_spans"), s.pop("activity")
        if not out and step_span is not None:  # the main stream
            result["main_idle"] = idle_gaps(activity, *step_span)
            result["profiled_step_us"] = step_span[1] - step_span[0]
        out.append(
            {"stream": sid, **s, "kernel_busy_us": union_us(spans), "kernel_sum_us": sum(b - a for a, b in spans)}
        )
    return result


def host_profile(one: Any, device: Any, steps: int, top: int = 12) -> dict[str, Any]:
    """Where a step's host time goes: ``steps`` steps under cProfile (which slows each
    Python call by a similar share, so the ranking holds, not the absolute times), the
    ``top`` functions by their own time, in microseconds per step."""
    import cProfile
    import pstats

    from engram_trt.bench.common import sync

    prof = cProfile.Profile()
    sync(device)
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        one()
    prof.disable()
    wall = time.perf_counter() - t0
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    rows = []
    for (path, line, name), (_, calls, own, cum, _) in stats.items():
        where = f"{path.rsplit('/', 1)[-1]}:{line}({name})" if line else name
        rows.append(
            {
                "function": where,
                "calls_per_step": calls / steps,
                "own_us": own / steps * 1e6,
                "cumulative_us": cum / steps * 1e6,
            }
        )
    rows.sort(key=lambda r: -r["own_us"])
    return {"steps": steps, "wall_us_per_step": wall / steps * 1e6, "top": rows[:top]}


def timeline(pf: Any, one: Any, device: Any) -> dict[str, float]:
    """One more step with events: lookup start/end on the side stream, the main
    stream's wait point, all relative to the step's start on the main stream."""
    import torch

    pf.timing = True
    captured: dict[str, Any] = {}
    orig = pf.submit

    def submit(*a: Any, **k: Any) -> Any:
        staged = orig(*a, **k)
        captured.update(staged.info)
        return staged

    pf.submit = submit
    from engram_trt.bench.common import schedstat_summary, thread_schedstats

    before = thread_schedstats()
    start = torch.cuda.Event(enable_timing=True)
    start.record()
    one()
    torch.cuda.synchronize(device)
    pf.submit, pf.timing = orig, False
    sched = schedstat_summary(before, thread_schedstats())
    t = {k: start.elapsed_time(captured[k]) for k in ("start_event", "done_event", "wait_event") if k in captured}
    out = {
        "lookup_start_ms": t.get("start_event"),
        "lookup_end_ms": t.get("done_event"),
        "first_engram_layer_ms": t.get("wait_event"),
    }
    if None not in out.values():
        out["lookup_ms"] = out["lookup_end_ms"] - out["lookup_start_ms"]
        out["exposed_ms"] = max(0.0, out["lookup_end_ms"] - out["first_engram_layer_ms"])
    out["sched"] = sched  # type: ignore[assignment]
    if "submit_us" in captured:
        out["submit_us"] = captured["submit_us"]  # type: ignore[assignment]
    if captured.get("layer_done"):
        # A host gather, layer by layer: when the main stream reached the layer's read,
        # when the layer's rows were ready on the side stream (GPU clock, from the step's
        # start), and when the host thread ran that layer's gather (host clock, from submit).
        # (With the gather driver the host times are the driver thread's, not recorded;
        # "ready" is then when the main stream got past its wait.)
        host = captured.get("layer_host") or [None] * len(captured["layer_done"])
        out["layers"] = [
            {
                "read_ms": start.elapsed_time(w),
                "ready_ms": start.elapsed_time(d),
                "host_gather_ms": None if h is None else [h[0] * 1e3, h[1] * 1e3],
            }
            for w, d, h in zip(captured["layer_waits"], captured["layer_done"], host)
        ]
        # What the main stream waited: each layer's rows past the point where it needed them.
        out["exposed_ms"] = sum(max(0.0, x["ready_ms"] - x["read_ms"]) for x in out["layers"])
    return out


def trace(model: Any, store: Any, layout: Any, device: Any, path: str, rng: Any) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from engram_trt.runtime.prefetch import Prefetcher
    from engram_trt.models.step import PackedStep

    model.set_tables(store)
    model.engram_enabled = True
    S, past = 64, 256
    cache = model.new_cache(S, past + 2)
    ids = rng.integers(2, model.config.vocab_size, size=S)
    lut = model.compress_lookup.cpu().numpy()
    step = PackedStep(
        torch.from_numpy(ids),
        [1] * S,
        [past] * S,
        list(range(S)),
        lookback=torch.from_numpy(lut[rng.integers(2, 1000, size=(S, 3))]),
        engram_ids=torch.from_numpy(lut[ids]),
    )
    pf = Prefetcher(layout, store, device, S)
    for i in range(4):
        for s in range(S):
            cache.lengths[s] = past
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) if i == 3 else _null() as prof:
            model.forward_step(step, cache, engram_rows=pf.submit(step, step.engram_ids.numpy(), step.lookback.numpy()))
            torch.cuda.synchronize(device)
    prof.export_chrome_trace(path)
    pf.close()


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: Any) -> None:
        return None
