"""`bench_gather.py --paths split`: one lookup shared by the host gather and the
UVA kernel at once.

Why: on the H200 VM the host gather of a prefill chunk is bound by the CPU threads' random
reads (the cores' misses in flight), and the UVA kernel by the host's address
translations of the GPU's reads (about 5 GB/s whatever the page size): two different
limits, and the link has room for both (55 GB/s against ~34 for the host gather). So a
share of the rows (``--uva-share``) goes to the UVA kernel on a stream of its own while
the host gather takes the rest on the caller's stream; the call ends when both have. The
UVA kernel's grid is capped (``--uva-blocks``, ``kernels.gather(max_blocks=)``): a full
wave would hold every multiprocessor for the whole call and the host gather's per-chunk
dequant kernels would wait behind it (their staging slots with them).
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Sequence

from lookuputil import HEAD_DIM, QUANT_BLOCK, gbps, median_wall


def time_split(
    tables: Any,
    sets: list[Any],
    sets_dev: list[Any],
    out: Any,
    scales_dev: Any,
    link: float,
    sync: Callable[[], None],
    exact_out: Callable[[], bool],
    result: Callable[..., Any],
    *,
    layouts: Sequence[str],
    threads: int,
    chunk_rows: int,
    slots: int,
    spin_us: int,
    uva_shares: Sequence[float],
    uva_blocks: Sequence[int],
    reps: int,
) -> list[Any]:
    """The split path's results for one lookup size: every share of ``uva_shares`` x
    grid cap of ``uva_blocks`` (``--uva-share`` x ``--uva-blocks``), the host part in
    hbm-scales if ``layouts`` has it, else split, on a host gatherer of ``threads``
    threads, ``chunk_rows`` rows per copy and ``slots`` staging slots (the first
    ``--threads``, ``--chunk-rows`` and ``--slots``), each the median of ``reps`` calls."""
    import torch

    from engram_trt.native import hostgather
    from engram_trt.native import gather as gather_kernels

    layout = "hbm-scales" if "hbm-scales" in layouts else "split"
    scales = scales_dev if layout == "hbm-scales" else tables.split_scales
    dev = out.device
    side = torch.cuda.Stream(dev)
    main = torch.cuda.current_stream(dev)
    tokens = int(sets[0].shape[0])
    results = []
    g = hostgather.HostGatherer(
        num_threads=threads, chunk_rows=chunk_rows, max_head_dim=HEAD_DIM, device=dev, num_slots=slots
    )
    g.set_options(spin_us=spin_us)
    try:
        bound = g.bind(tables.split_rows, scales, quant_block=QUANT_BLOCK, layout=layout)
        for share, blocks in itertools.product(uva_shares, uva_blocks):
            k = min(tokens, max(0, round(tokens * share)))  # tokens of the UVA kernel's part

            def one(i: int) -> None:
                if k:
                    side.wait_stream(main)  # out's earlier readers are done
                    with torch.cuda.stream(side):
                        gather_kernels.gather(
                            sets_dev[i][:k],
                            tables.split_rows,
                            scales,
                            quant_block=QUANT_BLOCK,
                            out=out[:k],
                            max_blocks=blocks,
                        )
                if k < tokens:
                    bound(sets[i][k:], out[k:], sets_dev[i][k:] if layout == "hbm-scales" else None)
                if k:
                    main.wait_stream(side)

            sec, _ = median_wall(one, reps, sync)
            out.zero_()
            one(0)
            sync()
            n = tokens * int(sets[0].shape[1])
            results.append(
                result(
                    rows=n,
                    path="split",
                    layout=layout,
                    threads=threads,
                    seconds=sec,
                    gbps=gbps(n, sec),
                    x_link=gbps(n, sec) / link,
                    exact=exact_out(),
                    uva_share=k / tokens,
                    uva_blocks=blocks,
                )
            )
    finally:
        g.close()
    return results


def plot_split(report: dict[str, Any], path: str, target_gbps: dict[int, float]) -> None:
    """GB/s against the UVA share, a line per grid cap, per lookup size; the host gather
    alone (share 0) and the link as horizontal lines."""
    from lookuputil import require_matplotlib, save_plot

    plt = require_matplotlib()
    sizes = sorted({r["rows"] for r in report["results"] if r["path"] == "split"})
    fig, axes = plt.subplots(1, len(sizes), figsize=(6 * len(sizes), 4.5), squeeze=False)
    link = report.get("link_GBps")
    for ax, n in zip(axes[0], sizes):
        rows = [r for r in report["results"] if r["rows"] == n]
        for r in (r for r in rows if r["path"] == "host"):
            ax.axhline(r["gbps"], linestyle=":", color="tab:gray", label=f"host gather alone ({r['knobs']})")
        by_blocks: dict[int, list[tuple[float, float]]] = {}
        for r in (r for r in rows if r["path"] == "split"):
            by_blocks.setdefault(r["uva_blocks"], []).append((r["uva_share"], r["gbps"]))
        for blocks, pts in sorted(by_blocks.items()):
            pts.sort()
            ax.plot(
                [100 * p[0] for p in pts],
                [p[1] for p in pts],
                marker="o",
                label=f"UVA kernel on {blocks or 'all'} blocks + host gather",
            )
        if link:
            ax.axhline(link, color="k", linestyle="--", label=f"link {link:.1f} GB/s")
        if n in target_gbps:
            ax.axhline(target_gbps[n], color="r", linestyle="-.", label=f"target {target_gbps[n]:.0f} GB/s")
        ax.set_title(f"{n:,} rows x 264 B: UVA kernel + host gather")
        ax.set_xlabel("UVA kernel's share of the tokens (%)")
        ax.set_ylabel("GB/s of row bytes delivered")
        ax.legend(fontsize=6)
    save_plot(fig, path)
