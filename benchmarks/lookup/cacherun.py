"""The measured part of `bench_cache.py`: each
host layout's caches through the same chunks, on the GPU or (``--dry-run``) the CPU.

Why several layouts in one process: machine starts differ by 10-20% on the H200 VM, more
than the layouts do, so inline and hbm-scales are compared chunk by chunk in one run: the
layouts take turns on every measured chunk (their order alternates from chunk to chunk),
each with its own caches (history, offline), its de-duplication-only cache and its cold
host gather, over tables of the same content. Every cache output is checked bit for bit
against its layout's cold gather, and the cold gathers of the layouts against each other.
"""

from __future__ import annotations

import itertools
import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from cacheoptions import CacheOptions
from idstreams import CHUNK_TOKENS
from lookuputil import GiB, QUANT_BLOCK, anon_hugepages_kib, make_tables, measure_h2d, pages_mode

log = logging.getLogger(__name__)
# Where a cache's twin reports in the JSON: phase by phase (--ab-phases), the whole
# delivery after the fetch (--ab-serial), every miss by the host gather (--ab-uva).
TWIN_KEY = {"phases": "phases_step", "serial": "serial_step", "uva": "no_uva_step"}


def make_layer_tables(
    num_rows: int, layouts: list[str], seed: int, *, pages: str, cpu_reference: bool = False, register: bool = False
) -> Any:
    """One layer's host table in what ``layouts`` read (inline; split rows and scales for
    split and hbm-scales), on ``pages`` (a ``--pages`` choice); ``cpu_reference``: the split form
    too (the dry run's reference reads it); ``register``: the split form registered with
    CUDA (the caches' whole step then reads a share of its misses through UVA)."""
    split = cpu_reference or any(name in ("split", "hbm-scales") for name in layouts)
    return make_tables(
        num_rows,
        split=split,
        inline="inline" in layouts,
        huge_pages=pages_mode(pages),
        register_split=register,
        seed=seed,
    )


def host_table(tables: Any, layout: str, device: Any) -> tuple[Any, Any]:
    """(rows, scales) of ``layout``: hbm-scales keeps the split rows in host memory and
    copies the scale bytes to ``device`` once, as the runtime does at load."""
    if layout == "inline":
        return tables.inline, None
    if layout == "split":
        return tables.split_rows, tables.split_scales
    return tables.split_rows, tables.split_scales.to(device)


@dataclass
class LayoutRun:
    """One host layout's caches and measurements in a layer."""

    layout: str
    table: tuple[Any, Any]
    caches: dict[str, Any]
    dedup: Any = None
    outs: dict[str, Any] = field(default_factory=dict)
    out_cold: Any = None
    t_cache: dict[str, list[float]] = field(default_factory=dict)
    hits: dict[str, list[float]] = field(default_factory=dict)
    exact: dict[str, bool] = field(default_factory=dict)
    t_dedup: list[float] = field(default_factory=list)
    t_cold: list[float] = field(default_factory=list)
    # --ab-phases / --ab-serial / --ab-uva: a twin of each cache (TWIN_KEY)
    twins: dict[str, Any] = field(default_factory=dict)
    t_twin: dict[str, list[float]] = field(default_factory=dict)
    twin_outs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in self.caches:
            self.t_cache[name], self.hits[name], self.exact[name] = [], [], True


def _ids_of(chunk: Any, layer: int) -> Any:
    import torch

    return torch.from_numpy(chunk[:, layer, :].copy())


def _pages_used(tables: dict[int, Any], huge_before: int) -> dict[str, Any]:
    pages = sorted({p for t in tables.values() for p in t.pages()})
    grown = (anon_hugepages_kib() - huge_before) / 2**20 if huge_before >= 0 else -1.0
    return {"pages_used": pages, "huge_pages_gib": grown}


def run_cpu(
    opts: CacheOptions,
    layout: Any,
    layers: list[int],
    chunks: list[Any],
    warm: int,
    offline: dict[int, Any] | None,
    layouts: list[str],
) -> dict[str, Any]:
    """The dry run: the torch transfer path on CPU tensors, each output against the
    float32 dequant of the split table."""
    import torch

    from engram_trt.engram.quant import dequant_fp8_rows_torch
    from engram_trt.cache.hotcache import HotRowCache

    out = []
    huge_before = anon_hugepages_kib()
    made: dict[int, Any] = {}
    for li in layers:
        rows = int(layout.table_rows[li])
        tables = made[li] = make_layer_tables(rows, layouts, opts.seed + li, pages=opts.pages, cpu_reference=True)
        common = dict(
            device="cpu",
            capacity_fraction=opts.capacity_fraction,
            quant_block=QUANT_BLOCK,
            max_step_rows=CHUNK_TOKENS * layout.n_hash_cols,
            admit_budget=opts.admit_budget,
            sample_factor=opts.sample_factor,
            admit_every=opts.admit_every,
            seed=opts.seed,
        )
        runs = []
        for name in layouts:
            table = host_table(tables, name, "cpu")
            caches = {"history": HotRowCache(*table, layout=name, **common)}
            if offline is not None:
                caches["offline"] = HotRowCache(*table, layout=name, initial_counts=offline[li], **common)
            runs.append(LayoutRun(name, table, caches))
        for k, chunk in enumerate(chunks):
            ids = _ids_of(chunk, li)
            idx = ids.reshape(-1).long()
            ref = dequant_fp8_rows_torch(tables.split_rows[idx], tables.split_scales[idx], QUANT_BLOCK)
            for run in runs:
                if k == warm:
                    run.caches["history"].reset_stats()
                for name, cache in run.caches.items():
                    if k < warm and name != "history":
                        continue  # the offline-warmed cache starts at the measured chunks
                    t0 = time.perf_counter()
                    got = cache.gather(ids)
                    run.t_cache[name].append(time.perf_counter() - t0)
                    if k >= warm:
                        run.exact[name] = run.exact[name] and torch.equal(
                            got.reshape(-1, got.shape[-1]).view(torch.int16), ref.view(torch.int16)
                        )
        for run in runs:
            entry: dict[str, Any] = {"layer": li, "layout": run.layout}
            for name, cache in run.caches.items():
                cache.policy.check_invariants()
                t = run.t_cache[name][-(len(chunks) - warm) :]
                part = {
                    "stats": cache.stats().to_dict(),
                    "exact": run.exact[name],
                    "cache_seconds": statistics.median(t),
                    "per_chunk_seconds": t,
                }
                if name == "history":
                    entry.update(part)
                else:
                    entry["offline"] = part
            out.append(entry)
    report = {"layers": out, **_pages_used(made, huge_before)}
    for tables in made.values():
        tables.close()
    return report


def run_gpu(
    opts: CacheOptions,
    layout: Any,
    layers: list[int],
    chunks: list[Any],
    warm: int,
    offline: dict[int, Any] | None,
    layouts: list[str],
) -> dict[str, Any]:
    import torch

    from cacheprofile import call_costs, phase_timeline, profile_step
    from cachetrace import host_trace
    from engram_trt.bench.stepprofile import host_profile
    from engram_trt.native.hostgather import HostGatherer
    from engram_trt.cache.hotcache import HotRowCache

    dev = torch.device("cuda", torch.cuda.current_device())
    sync = lambda: torch.cuda.synchronize(dev)  # noqa: E731
    pinned = torch.empty(2 * GiB, dtype=torch.uint8, pin_memory=True)
    link = measure_h2d(pinned, dev, 2 * GiB)
    del pinned
    t0 = time.perf_counter()
    huge_before = anon_hugepages_kib()
    uva = opts.uva_share is None or opts.uva_share > 0 or opts.ab_uva
    all_tables = {
        li: make_layer_tables(int(layout.table_rows[li]), layouts, opts.seed + li, pages=opts.pages, register=uva)
        for li in layers
    }
    setup = time.perf_counter() - t0
    pages = _pages_used(all_tables, huge_before)
    step_rows = CHUNK_TOKENS * layout.n_hash_cols
    gatherer = HostGatherer(
        num_threads=opts.threads, chunk_rows=opts.chunk_rows, max_head_dim=256, device=dev, num_slots=opts.slots
    )
    gatherer.set_options(
        min_chunks=opts.min_chunks,
        prefetch_rows=opts.prefetch,
        streaming_stores=int(opts.stores == "streaming"),
        spin_us=opts.spin_us,
    )
    out_layers = []
    cold_equal = True
    hbm_bytes = 0
    try:
        for li in layers:
            tables = all_tables[li]
            ids = [_ids_of(c, li).pin_memory() for c in chunks]
            # The ids of the measured chunks on the GPU too, as a step's hash kernel leaves
            # them: the cold hbm-scales gather's dequant reads the scale bytes by them.
            on_device = opts.ids_on == "device"
            ids_dev = (
                {k: ids[k].to(dev) for k in range(warm, len(chunks))} if "hbm-scales" in layouts or on_device else {}
            )
            runs = []
            for name in layouts:
                table = host_table(tables, name, dev)
                if name == "hbm-scales":
                    hbm_bytes = max(hbm_bytes, table[1].numel())
                common = dict(
                    device=dev,
                    quant_block=QUANT_BLOCK,
                    gatherer=gatherer,
                    layout=name,
                    max_step_rows=step_rows,
                    sample_factor=opts.sample_factor,
                    seed=opts.seed,
                )
                uva_kw = ({} if opts.uva_blocks is None else {"uva_blocks": opts.uva_blocks}) | (
                    {} if opts.uva_share is None or name == "inline" else {"uva_share": opts.uva_share}
                )
                sized = dict(
                    capacity_fraction=opts.capacity_fraction,
                    admit_budget=opts.admit_budget,
                    admit_every=opts.admit_every,
                )
                caches = {"history": HotRowCache(*table, **sized, **common, **uva_kw)}
                if offline is not None:
                    t1 = time.perf_counter()
                    caches["offline"] = HotRowCache(*table, initial_counts=offline[li], **sized, **common, **uva_kw)
                    sync()
                    log.info(
                        "layer %d, %s: warm start of %d rows in %.2f s",
                        li,
                        name,
                        caches["offline"].stats().preloaded,
                        time.perf_counter() - t1,
                    )
                twins = {}
                if opts.twin():
                    twin_kind = {
                        "phases": {"whole_step": False},
                        "serial": {"overlap": False},
                        "uva": {"uva_share": 0.0},
                    }[opts.twin()]
                    twins = {
                        n: HotRowCache(
                            *table,
                            **twin_kind,
                            **sized,
                            **common,
                            **({"initial_counts": offline[li]} if n == "offline" else {}),
                        )
                        for n in caches
                    }
                run = LayoutRun(name, table, caches, dedup=HotRowCache(*table, capacity_rows=0, **common), twins=twins)
                run.t_twin = {n: [] for n in twins}
                run.outs = {
                    n: torch.empty((CHUNK_TOKENS, layout.n_hash_cols, 256), dtype=torch.bfloat16, device=dev)
                    for n in caches
                }
                run.out_cold = torch.empty_like(run.outs["history"])
                run.twin_outs = {n: torch.empty_like(run.out_cold) for n in twins}
                for warming in [c for c in (caches["history"], twins.get("history")) if c is not None]:
                    for k in range(warm):
                        warming.gather(ids[k], run.outs["history"])
                    sync()
                    warming.reset_stats()
                runs.append(run)
            for k in range(warm, len(chunks)):
                for run in runs if (k - warm) % 2 == 0 else runs[::-1]:
                    _measure_chunk(
                        run,
                        ids[k],
                        ids_dev.get(k),
                        gatherer,
                        sync,
                        cache_ids=ids_dev[k] if on_device else None,
                        twin_first=k % 2 == 1,
                    )
                if len(runs) > 1:
                    first = runs[0].out_cold.view(torch.int16)
                    cold_equal = cold_equal and all(torch.equal(first, r.out_cold.view(torch.int16)) for r in runs[1:])
            # The counters of the timed loop alone: the diagnostics below run the measured
            # chunks again through the caches (they keep learning, so their hits run higher).
            cells = [((r.layout, n), c, r.outs[n]) for r in runs for n, c in r.caches.items()]  # (layout, warming)
            timed_stats = {key: c.stats() for key, c, _ in cells}
            phases = _breakdown([(*key, c, out) for key, c, out in cells], ids[warm:], sync) if opts.breakdown else {}
            profiles = (
                {key: profile_step(c, ids[warm], out, dev) for key, c, out in cells} if opts.kernel_profile else {}
            )
            timelines = (
                {key: phase_timeline(c, ids[warm:], out, dev) for key, c, out in cells} if opts.breakdown else {}
            )
            costs = {key: call_costs(c, ids[warm], out, dev) for key, c, out in cells} if opts.breakdown else {}
            hostprof = (
                {key: host_profile(_cycling(c, ids[warm:], out), dev, opts.host_profile) for key, c, out in cells}
                if opts.host_profile
                else {}
            )
            step_ids = [ids_dev[k] for k in range(warm, len(chunks))] if on_device else ids[warm:]
            traces = (
                {key: host_trace(c, step_ids, out, dev, opts.host_trace) for key, c, out in cells}
                if opts.host_trace
                else {}
            )
            for run in runs:
                entry: dict[str, Any] = {
                    "layer": li,
                    "layout": run.layout,
                    "dedup_seconds": statistics.median(run.t_dedup),
                    "cold_seconds": statistics.median(run.t_cold),
                    "lookups_per_chunk": step_rows,
                    "per_chunk_cold_seconds": run.t_cold,
                }
                for name, cache in run.caches.items():
                    cache.policy.check_invariants()
                    step_call = cache._whole_step
                    part = {
                        "stats": timed_stats[(run.layout, name)].to_dict(),
                        "exact": run.exact[name],
                        "uva_share": step_call.uva_share if step_call is not None else 0.0,
                        "overlap": step_call is not None and step_call.overlaps,
                        "device_bytes": cache.device_bytes(),
                        "cache_seconds": statistics.median(run.t_cache[name]),
                        "per_chunk_cache_seconds": run.t_cache[name],
                        "per_chunk_hit_rate": run.hits[name],
                        "phases_seconds": phases.get((run.layout, name)),
                        "kernel_profile": profiles.get((run.layout, name)),
                        "timeline": timelines.get((run.layout, name)),
                        "call_costs": costs.get((run.layout, name)),
                        "host_profile": hostprof.get((run.layout, name)),
                        "host_trace": traces.get((run.layout, name)),
                    }
                    if name in run.twins:
                        run.twins[name].policy.check_invariants()
                        part[TWIN_KEY[opts.twin()]] = {
                            "cache_seconds": statistics.median(run.t_twin[name]),
                            "per_chunk_cache_seconds": run.t_twin[name],
                            "stats": run.twins[name].stats().to_dict(),
                        }
                    if name == "history":
                        entry.update(part)
                    else:
                        entry["offline"] = part
                out_layers.append(entry)
            del runs, ids_dev
            torch.cuda.empty_cache()
    finally:
        gatherer.close()
        for t in all_tables.values():
            t.close()
    report = {
        "layers": out_layers,
        "link_GBps": link,
        "setup_seconds": setup,
        "device": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "hbm_scales_gib": hbm_bytes / GiB,
        "ids_on": opts.ids_on,
        **pages,
    }
    if len(layouts) > 1:
        report["cold_equal_across_layouts"] = cold_equal
    return report


def _cycling(cache: Any, ids: list[Any], out: Any) -> Any:
    """A step of ``cache`` on the next chunk of ``ids`` at each call (round and round)."""
    chunks = itertools.cycle(ids)
    return lambda: cache.gather(next(chunks), out)


def _measure_chunk(
    run: LayoutRun, ids: Any, ids_dev: Any, gatherer: Any, sync: Any, *, cache_ids: Any = None, twin_first: bool = False
) -> None:
    """One measured chunk through a layout's caches, its de-duplication alone and its
    cold gather (each timed from the call to the stream's completion), then the check.
    ``cache_ids``: the ids the caches and the de-duplication get (``--ids-on device``:
    on the GPU, as a step's hash kernel leaves them; default: ``ids``, pinned host
    memory). The cold gather takes the host ids (its CPU threads read them). A cache's
    twin (``--ab-phases``) runs the chunk right before or after it (``twin_first``)."""
    import torch

    cache_ids = ids if cache_ids is None else cache_ids
    for name, cache in run.caches.items():
        pair = [(cache, run.t_cache[name], run.outs[name])]
        twin = run.twins.get(name)
        if twin is not None:
            pair.insert(0 if twin_first else 1, (twin, run.t_twin[name], run.twin_outs[name]))
        for c, times, out in pair:
            before = c.stats()
            t = time.perf_counter()
            c.gather(cache_ids, out)
            sync()
            times.append(time.perf_counter() - t)
            if c is cache:
                after = c.stats()
                run.hits[name].append((after.hits - before.hits) / max(1, after.unique - before.unique))
    t = time.perf_counter()
    run.dedup.gather(cache_ids, run.out_cold)
    sync()
    run.t_dedup.append(time.perf_counter() - t)
    extra = {"ids_dev": ids_dev} if run.layout == "hbm-scales" else {}
    t = time.perf_counter()
    gatherer.gather(ids, *run.table, quant_block=QUANT_BLOCK, out=run.out_cold, layout=run.layout, **extra)
    sync()
    run.t_cold.append(time.perf_counter() - t)
    cold = run.out_cold.view(torch.int16)
    for name in run.caches:
        outs = [run.outs[name]] + ([run.twin_outs[name]] if name in run.twins else [])
        run.exact[name] = run.exact[name] and all(torch.equal(o.view(torch.int16), cold) for o in outs)


def _breakdown(parts: list[tuple[str, str, Any, Any]], ids: list[Any], sync: Any) -> dict[tuple[str, str], Any]:
    """Median seconds of each phase of a step per (layout, warming) (syncing between
    phases, so the sum is above the step's own time); the caches take turns on each
    chunk, as in the timed loop. The steps run through the caches (they keep learning)."""
    phases: dict[tuple[str, str], dict[str, list[float]]] = {(p[0], p[1]): {} for p in parts}
    for x in ids:
        for layout_name, name, cache, out in parts:
            got = phases[(layout_name, name)]
            sync()
            last = [time.perf_counter()]

            def mark(phase: str, got: dict[str, list[float]] = got, last: list[float] = last) -> None:
                sync()
                now = time.perf_counter()
                got.setdefault(phase, []).append(now - last[0])
                last[0] = now

            cache.gather(x, out, phase=mark)
    return {key: {k: statistics.median(v) for k, v in got.items()} for key, got in phases.items()}
