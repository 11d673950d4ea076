"""What the benchmarks share: timing with device events, the machine's own limits
(HBM copy bandwidth, bf16 matrix rate, host-to-device link) measured in the run, and
the random engram-llama configurations they build in memory."""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any, Callable

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], Any], device: torch.device, warmup: int = 3, iters: int = 10) -> dict[str, float]:
    """Median / min wall time of ``fn`` (the device synchronized around each call)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "min_s": min(times), "iters": iters, "times_s": times}


def union_us(spans: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) spans: the time some kernel ran. With
    programmatic dependent launches kernels overlap (a kernel's span then includes its
    wait for the one before), so their summed times exceed it."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return float(total)


def idle_gaps(activity: list[tuple[float, float, str]], start: float, end: float, top: int = 5) -> dict[str, Any]:
    """Where a stream sat idle within a step: ``activity`` is its (start, end, name) spans
    (kernels and copies, any order, overlaps allowed), ``start`` / ``end`` the step's wall
    span on the same clock (us). Returns ``lead_us`` (from the step's start to the first
    activity: the host's work before the GPU can begin), ``gaps_us`` (idle time between
    activities), ``tail_us`` (from the last activity to the step's end: the result's trip
    back to the host), ``busy_us`` (the union of the spans) and the ``top`` largest gaps
    with the names of the activity before and after each. Why: a step's time minus its
    kernels' is not one number to attack; a gap before the first kernel is host work, a
    gap between two kernels of one graph is a dependency or a launch, and they call for
    different fixes."""
    merged: list[list[Any]] = []  # [start, end, first name, last name]
    for a, b, name in sorted(activity):
        if merged and a <= merged[-1][1]:
            if b > merged[-1][1]:
                merged[-1][1], merged[-1][3] = b, name
        else:
            merged.append([a, b, name, name])
    if not merged:
        return {"lead_us": float(end - start), "gaps_us": 0.0, "tail_us": 0.0, "busy_us": 0.0, "largest": []}
    gaps = [{"us": float(nxt[0] - cur[1]), "after": cur[3], "before": nxt[2]} for cur, nxt in zip(merged, merged[1:])]
    return {
        "lead_us": float(max(0.0, merged[0][0] - start)),
        "gaps_us": float(sum(g["us"] for g in gaps)),
        "tail_us": float(max(0.0, end - merged[-1][1])),
        "busy_us": float(sum(b - a for a, b, _, _ in merged)),
        "largest": sorted(gaps, key=lambda g: -g["us"])[:top],
    }


def event_seconds(fn: Callable[[], Any], reps: int) -> float:
    """Median GPU seconds of one call of ``fn`` on the current stream, between CUDA events
    (after one warm-up call): the GPU's span, launch latency included."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def graph_seconds(fn: Callable[[], Any], launches: int = 20, reps: int = 7) -> float | None:
    """Median GPU seconds per call of ``fn`` (kernel launches on the current stream) from
    a CUDA graph of ``launches`` back-to-back calls, so the Python cost of a call
    (argument checks, ctypes) is not counted; None when ``fn`` cannot be captured (the
    caller then times it eagerly and says so)."""
    fn()  # warm-up (and any lazy initialization) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(launches):
                fn()
    except Exception as exc:  # noqa: BLE001 - capture is an optimization of the measurement
        print(f"note: CUDA graph capture failed ({type(exc).__name__}: {exc}); timing eagerly", flush=True)
        torch.cuda.synchronize()
        return None
    graph.replay()
    torch.cuda.synchronize()
    return event_seconds(graph.replay, reps) / launches


def eager_seconds(fn: Callable[[], Any], reps: int = 20) -> float:
    """Median wall seconds of one call followed by a device synchronize (Python included)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def capture_graph(body: Callable[[], Any], device: torch.device | None = None) -> tuple[Any, Any]:
    """``body()`` run once on a side stream (its warm-up: lazy initialisation and GEMM
    workspaces stay out of the graph), then captured into a CUDA graph on ``device`` (the
    current one by default). Returns the graph and what the captured call returned: its
    static outputs, which each replay refreshes."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        body()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = body()
    return graph, outputs


def measure_limits(device: torch.device) -> dict[str, float]:
    """The ceilings every ratio is taken against, measured now: HBM (a device-to-device
    copy, bytes read + written), bf16 matrix rate (8192^3 on random data), and the
    host-to-device link (a pinned 1 GiB copy)."""
    if device.type != "cuda":
        return {}
    out = _timed_limits(device)
    torch.cuda.empty_cache()  # the buffers of _timed_limits, freed on its return
    return out


def _timed_limits(device: torch.device) -> dict[str, float]:
    """measure_limits' timings; the buffers they use are freed when it returns."""
    out: dict[str, float] = {}
    a = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    t = time_fn(lambda: b.copy_(a), device, 2, 10)["median_s"]
    out["hbm_GBps"] = 2 * a.numel() / t / 1e9
    m = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    t = time_fn(lambda: m @ m, device, 2, 10)["median_s"]
    out["bf16_TFLOPs"] = 2 * 8192**3 / t / 1e12
    h = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    t = time_fn(lambda: a.copy_(h, non_blocking=True), device, 2, 10)["median_s"]
    out["h2d_GBps"] = h.numel() / t / 1e9
    return out


def dump(obj: Any, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=True, default=str)


def thread_schedstats() -> dict[tuple[int, int, str], tuple[int, ...]]:
    """(pid, tid, name) -> (ns on a CPU, ns waiting on a run queue, time slices) of every
    thread of the machine (Linux /proc/*/task/*/schedstat; empty elsewhere). Two
    snapshots around a timed step say which threads took the CPUs and how long this
    process's threads waited for one (a preempted host-gather worker stalls its round)."""
    out: dict[tuple[int, int, str], tuple[int, ...]] = {}
    if not os.path.isdir("/proc"):
        return out
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    stat = tuple(int(x) for x in f.read().split())
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    name = f.read().strip()
            except (OSError, ValueError):
                continue
            out[(int(pid), int(tid), name)] = stat
    return out


def schedstat_summary(before: dict, after: dict, top: int = 6) -> dict[str, Any]:
    """What :func:`thread_schedstats` snapshots say happened between them: this process's
    threads' run-queue wait (total and the most of one thread) and the busiest threads."""
    me = os.getpid()
    delta = {k: tuple(y - x for x, y in zip(before.get(k, (0, 0, 0)), v)) for k, v in after.items()}
    ours = [v for k, v in delta.items() if k[0] == me]
    busiest = sorted(delta.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "our_wait_ms": sum(v[1] for v in ours) / 1e6,
        "our_max_wait_ms": max((v[1] for v in ours), default=0) / 1e6,
        "busiest": [
            {"name": k[2], "ours": k[0] == me, "run_ms": v[0] / 1e6, "wait_ms": v[1] / 1e6} for k, v in busiest
        ],
    }
