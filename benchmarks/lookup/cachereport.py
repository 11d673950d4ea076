"""The report of `bench_cache.py`: the printed
table, the target lines and the plot, for both warmings of the cache and every host
layout run (each row and line names its layout)."""

from __future__ import annotations

from typing import Any

from cacheprofile import describe, describe_costs, describe_timeline
from cachetrace import describe_trace
from lookuputil import ROW_BYTES, print_table, require_matplotlib, save_plot

TARGET_LINK_RATIO = 2.0
# A cache's twin in the report (bench.cacherun.TWIN_KEY): what it runs, and the ratio printed.
TWINS = {
    "phases_step": ("phase by phase from Python", "whole step / phases"),
    "serial_step": ("the whole delivery after the fetch", "overlapped / serial"),
    "no_uva_step": ("every miss by the host gather", "with UVA share / without"),
}


def _warmings(L: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(name, part) of a layer's report: the history warming, then the offline one."""
    return [("history", L)] + ([("offline", L["offline"])] if L.get("offline") else [])


def _layout_of(L: dict[str, Any], report: dict[str, Any]) -> str:
    return L.get("layout", report.get("layout", "-"))


def _pages_line(report: dict[str, Any]) -> str:
    used = ", ".join(report.get("pages_used") or ["-"])
    line = f"host table pages: {used} (--pages {report.get('pages', '-')})"
    grown = report.get("huge_pages_gib", -1.0)
    if grown is not None and grown >= 0:
        line += f"; AnonHugePages grew by {grown:.1f} GiB while the tables were filled"
    return line


def print_report(report: dict[str, Any]) -> None:
    link = report.get("link_GBps")
    tok = report["tokens"]
    layouts = report.get("layouts") or [report["layout"]]
    print(
        f"ids: {tok['num_tokens']:,} tokens from {tok['text_bytes'] / 1e6:.1f} MB of text (Python {tok['python']}); "
        f"spec 2 layers x 24 columns of ~{report['column_rows']:,} rows = {report['table_gib']:.2f} GiB of "
        f"{ROW_BYTES}-byte rows (host layout{'s' if len(layouts) > 1 else ''} {', '.join(layouts)})"
    )
    hbm = "; hbm-scales: the scale bytes on the cache's device" if "hbm-scales" in layouts else ""
    print(_pages_line(report) + hbm)
    st = report["stream_stats"]
    print(
        "distinct rows per lookup in a chunk: "
        + ", ".join(f"order {o} {v:.1%}" for o, v in st["distinct_per_order"].items())
        + f"; a layer's 24 columns {st['distinct_per_layer_step']:.1%}"
    )
    a, b = report["measured_range"]
    print(
        f"cache: {report['capacity_fraction']:.0%} of each layer's rows; measured chunks {a}..{b - 1} "
        f"({report['measured_chunks']} of 8k tokens)"
    )
    print(f"  warming 'history': the online LFU trained on the {report['warm_chunks']} chunks before them")
    if report.get("offline_counts"):
        print(
            f"  warming 'offline': the most frequent rows loaded at start-up from {report['offline_counts']}; "
            f"no history run"
        )
    if report["dry_run"]:
        print("DRY RUN (no GPU): the cache logic on CPU tensors; the times say nothing about the target machine")
    else:
        print(
            f"{report['device']}, torch {report['torch']}; link (sequential 2 GiB pinned H2D copy): {link:.1f} GB/s; "
            f"cache plan and admission: fused kernels; host gather spin {report.get('spin_us', '-')} us; the "
            f"caches' row ids on the {report.get('ids_on', 'host')}"
        )
    headers = [
        "layout",
        "layer",
        "warming",
        "hit rate",
        "distinct",
        "fetched / lookups",
        "cache us",
        "GB/s",
        "x link",
        "dedup only us",
        "cold gather us",
        "x cold",
        "exact",
    ]
    rows = []
    for L in report["layers"]:
        cold = L.get("cold_seconds")
        for name, part in _warmings(L):
            s = part["stats"]
            n = s["lookups"] / max(1, s["steps"])
            cache_s = part["cache_seconds"]
            gb = n * ROW_BYTES / cache_s / 1e9
            rows.append(
                [
                    _layout_of(L, report),
                    L["layer"],
                    name,
                    f"{s['hit_rate']:.1%}",
                    f"{s['unique_fraction']:.1%}",
                    f"{s['fetch_fraction']:.1%}",
                    f"{cache_s * 1e6:.0f}",
                    f"{gb:.1f}",
                    f"{gb / link:.2f}" if link else "-",
                    f"{L['dedup_seconds'] * 1e6:.0f}" if cold else "-",
                    f"{cold * 1e6:.0f}" if cold else "-",
                    f"{cold / cache_s:.2f}" if cold else "-",
                    "yes" if part["exact"] else "NO",
                ]
            )
    print_table(headers, rows)
    if link:
        for L in report["layers"]:
            n = L["lookups_per_chunk"]
            cold_gb = n * ROW_BYTES / L["cold_seconds"] / 1e9
            print(
                f"{_layout_of(L, report)}, layer {L['layer']}: cold gather baseline {cold_gb:.1f} GB/s = "
                f"{cold_gb / link:.2f} x link (its bound: 1.00)"
            )
            for name, part in _warmings(L):
                gb = n * ROW_BYTES / part["cache_seconds"] / 1e9
                ok = gb >= TARGET_LINK_RATIO * link
                print(
                    f"  {name}: cache {gb:.1f} GB/s = {gb / link:.2f} x link; target 2 (>= "
                    f"{TARGET_LINK_RATIO:.0f}x link): "
                    + ("MET" if ok else f"MISSED by {TARGET_LINK_RATIO * link / gb:.2f}x")
                    + f"; cache device memory {part['device_bytes'] / 2**30:.2f} GiB"
                    + (
                        f"; misses through UVA: {part['uva_share']:.0%} of large steps'"
                        if part.get("uva_share")
                        else ""
                    )
                )
                for key, (what, ratio) in TWINS.items():
                    if part.get(key):
                        ph = part[key]
                        print(
                            f"    {what} (a twin, same chunks, turns alternating): "
                            f"{ph['cache_seconds'] * 1e6:.0f} us = "
                            f"{n * ROW_BYTES / ph['cache_seconds'] / 1e9 / link:.2f} x link, hit rate "
                            f"{ph['stats']['hit_rate']:.1%}; {ratio} {part['cache_seconds'] / ph['cache_seconds']:.2f}"
                        )
                if part.get("phases_seconds"):
                    print(
                        "    phases (synced, medians; these steps run phase by phase): "
                        + ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in part["phases_seconds"].items())
                    )
                if part.get("timeline"):
                    print("    timeline (phase by phase), " + describe_timeline(part["timeline"]))
                if part.get("call_costs"):
                    print("    " + describe_costs(part["call_costs"]))
                if part.get("host_profile"):
                    hp = part["host_profile"]
                    print(
                        f"    host profile, {hp['wall_us_per_step']:.0f} us a step under cProfile; own time per step: "
                        + "; ".join(
                            f"{r['function']} {r['own_us']:.0f} us ({r['calls_per_step']:g}x)" for r in hp["top"]
                        )
                    )
                if part.get("host_trace"):
                    for line in describe_trace(part["host_trace"]):
                        print("    " + line)
                if part.get("kernel_profile"):
                    for line in describe(part["kernel_profile"]):
                        print("    " + line)
    _print_layout_ratios(report, layouts)
    if any(not part["exact"] for L in report["layers"] for _, part in _warmings(L)):
        print("cache output NOT bit-exact against the plain gather")
    if "cold_equal_across_layouts" in report:
        print(
            "the layouts' cold gathers gave "
            + ("the same bits on every measured chunk" if report["cold_equal_across_layouts"] else "DIFFERENT bits")
        )
    if report.get("simulation"):
        print_simulation(report["simulation"])


def _print_layout_ratios(report: dict[str, Any], layouts: list[str]) -> None:
    """Each later layout's times over the first one's, in the same process."""
    if len(layouts) < 2:
        return
    by = {(L["layer"], _layout_of(L, report)): L for L in report["layers"]}
    base = layouts[0]
    for other in layouts[1:]:
        for (li, name), L in by.items():
            B = by.get((li, base))
            if name != other or B is None:
                continue
            parts = []
            for (warming, part), (_, bpart) in zip(_warmings(L), _warmings(B)):
                text = f"{warming} cache {part['cache_seconds'] / bpart['cache_seconds']:.2f}"
                fetch, bfetch = (
                    (part.get("phases_seconds") or {}).get("fetch"),
                    (bpart.get("phases_seconds") or {}).get("fetch"),
                )
                if fetch and bfetch:
                    text += f" (fetch {fetch / bfetch:.2f})"
                parts.append(text)
            if L.get("cold_seconds") and B.get("cold_seconds"):
                parts.append(f"cold gather {L['cold_seconds'] / B['cold_seconds']:.2f}")
            print(f"{other} / {base}, layer {li}, time ratios (same process): " + ", ".join(parts))


def print_simulation(sim: dict[str, Any]) -> None:
    """The policy simulation's lines (printed after the main report: it runs last)."""
    if sim:
        print(
            f"policy simulation with columns of ~{sim['column_rows']:,} rows ({sim['table_gib']:.0f} GiB of "
            f"tables; no data moved; offline counts over the warm-up chunks):"
        )
        for L in sim["layers"]:
            for name, part in _warmings(L):
                print(
                    f"  layer {L['layer']} {name}: cache of {part['capacity_rows']:,} rows: hit rate "
                    f"{part['hit_rate']:.1%}, distinct {part['unique_fraction']:.1%}, fetched / lookups "
                    f"{part['fetch_fraction']:.1%}"
                )


def plot_report(report: dict[str, Any], path: str) -> None:
    plt = require_matplotlib()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    link = report.get("link_GBps")
    for L in report["layers"]:
        n = L.get("lookups_per_chunk") or L["stats"]["lookups"] / max(1, L["stats"]["steps"])
        for name, part in _warmings(L):
            times = part.get("per_chunk_cache_seconds") or part.get("per_chunk_seconds")
            tag = f"{_layout_of(L, report)}, layer {L['layer']}"
            (line,) = a1.plot([n * ROW_BYTES / t / 1e9 for t in times], marker=".", label=f"{tag} cache ({name})")
            for key, (what, _) in TWINS.items():
                if part.get(key):
                    a1.plot(
                        [n * ROW_BYTES / t / 1e9 for t in part[key]["per_chunk_cache_seconds"]],
                        marker=".",
                        linestyle="--",
                        color=line.get_color(),
                        label=f"{tag} cache ({name}), {what}",
                    )
            if part.get("per_chunk_hit_rate"):
                a2.plot(part["per_chunk_hit_rate"], marker=".", label=f"{tag} ({name})")
        if "cold_seconds" in L:
            a1.axhline(
                n * ROW_BYTES / L["cold_seconds"] / 1e9,
                linestyle=":",
                label=f"{_layout_of(L, report)}, layer {L['layer']} cold gather",
            )
    if link:
        a1.axhline(link, color="k", linestyle="--", label=f"link {link:.1f} GB/s")
        a1.axhline(TARGET_LINK_RATIO * link, color="r", linestyle="-.", label="target 2x link")
    a1.set_xlabel("measured chunk")
    a1.set_ylabel("GB/s of row bytes delivered")
    a1.legend(fontsize=7)
    a2.set_xlabel("measured chunk")
    a2.set_ylabel("hit rate (distinct rows)")
    a2.legend(fontsize=7)
    save_plot(fig, path)
