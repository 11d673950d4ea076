"""Steps of a ~1.8B DeepSeek-V4.1-shaped model (random bf16 weights made on the GPU:
hidden 2048, 16 layers of sliding-window attention but one CSA layer (7) and one HCA
layer (14), 8 experts top-2 plus the shared expert, hash routing on the first 3 layers,
4 hyper-connection streams, Engram on layers 1 and 2 with DeepSeek-V4.1's 256-byte FP8
rows) with its Engram tables in pinned host memory vs in HBM: decode steps at each
batch and one prefill chunk, each the runtime's own step (the Prefetcher stages the
rows on its side stream, calibrated for host tables as the runner does, then
``DeepseekV4Model.forward_step`` and the sampler's read), the ratio pinned / HBM, and
each step against its floor (weights + attended state + Engram rows at the HBM rate
measured now; a prefill's FLOPs at the bf16 rate; host tables' rows over the link at the
pinned host-to-device rate measured in the same run, beside the lookup timed alone).

Per case and placement it also records where the step's time goes by module class
(attention sliding / CSA / HCA, MoE, mHC, Engram, the wait for the prefetched rows,
norms: :mod:`engram_trt.bench.dsv4profile`), to pick the next CUDA kernel. On a GPU the
decode cases replay the step through the runtime's decode CUDA graphs
(:class:`engram_trt.runtime.cuda_graphs.DecodeGraphs`, as the torch backend does: a
scratch slot for padding, the Engram rows gathered inside the graph where the tables are
GPU-readable and the calibrated choice is a GPU gather, else staged by the prefetcher),
and report the eager step beside it (``eager_step_ms``); the prefill chunk, and the
module-class breakdown, run eagerly (the breakdown wraps the modules' Python calls;
``bench e2e --breakdown`` times a recorded step by module kind).

``--weights bf16,fp8`` builds the model in each weight format in turn in the one process
(``fp8``: DeepSeek-V4.1-Flash's FP8 linears + FP4 routed experts,
:func:`engram_trt.bench.dsv4model.quantize_weights`) and times the same cases; each
step's byte floor (the bytes it reads in that format) is printed beside it, and with
both formats the FP8 step's speed-up over the BF16 one beside the ratio of their floors.
``--kernel-reps N`` profiles N of each decode case's steps kernel by kernel
(:func:`engram_trt.bench.breakdown.step_kernel_profile`: the step as timed, replayed graph
included; off a GPU it says it skipped). ``--device cpu --model tiny`` runs the whole path
on a CPU in seconds (tables in plain memory, no limits, no floors' times).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from engram_trt.bench.dsv4model import PRESETS, WEIGHT_FORMATS
from engram_trt.bench.dsv4profile import CLASSES
from engram_trt.bench.options import opt
from engram_trt.errors import EngramError

PLACEMENTS = ("hbm", "pinned")
_SHORT = {
    "attention.sliding": "slide",
    "attention.csa": "csa",
    "attention.hca": "hca",
    "moe": "moe",
    "mhc": "mhc",
    "engram": "engram",
    "engram.wait": "wait",
    "norm": "norm",
    "embed": "embed",
    "other": "other",
}


@dataclass(kw_only=True)
class Dsv4StepOptions:
    """``engram-trt bench dsv4-step``'s flags."""

    model: str = opt(
        "1b",
        choices=sorted(PRESETS),
        help="model shape: 1b (~1.8B parameters, hidden 2048, 16 layers) or tiny (hidden 64, 4 layers: the "
        "CPU smoke test's) (default: %(default)s)",
    )
    device: str = opt(
        "cuda",
        choices=("cuda", "cpu"),
        help="where the model runs: cuda (bf16, the benchmark) or cpu (fp32, a smoke run of the whole "
        "path; tables in plain memory) (default: %(default)s)",
    )
    batches: list[int] = opt([1, 8], help="decode batch sizes, comma-separated (default: 1,8)")
    context: int = opt(4096, help="tokens already cached per decode sequence (default: %(default)s)")
    prefill: int = opt(
        2048, help="tokens of the prefill chunk (one sequence from position 0); 0 skips it (default: %(default)s)"
    )
    table_gib: float = opt(
        16.0, help="Engram table size in GiB over both Engram layers, FP8 rows + scales (default: %(default)s)"
    )
    placements: list[str] = opt(
        list(PLACEMENTS),
        choices=PLACEMENTS,
        help="where the tables live: hbm (GPU memory, the gather kernel), pinned (page-locked "
        "host memory, the calibrated host gather or UVA kernel) (default: hbm,pinned)",
    )
    reps: int = opt(
        10, argtype=("int_arg", 1, 10000), help="timed steps per case (median reported; default: %(default)s)"
    )
    profile_reps: int = opt(
        3,
        argtype=("int_arg", 0, 1000),
        help="steps of the per-module-class breakdown per case and placement; 0 skips it (default: %(default)s)",
    )
    kernel_reps: int = opt(
        0,
        argtype=("int_arg", 0, 1000),
        help="steps whose GPU kernels are profiled per decode case and placement (torch.profiler: calls, ms and "
        "share of the busy time per kernel, as bench e2e --breakdown-kernels; ENGRAM_TRT_PDL=0 for each kernel's "
        "own time); 0 skips it (default: %(default)s)",
    )
    weights: list[str] = opt(
        ["bf16"],
        choices=WEIGHT_FORMATS,
        help="weight formats, comma-separated, each built and timed in turn: bf16 (every "
        "weight in the compute dtype) or fp8 (FP8 E4M3 linears with ue8m0 128x128 scales + "
        "FP4 routed experts, DeepSeek-V4.1-Flash's recipe) (default: bf16)",
    )
    attention: str = opt(
        "auto",
        choices=("auto", "kernels", "torch"),
        help="the attention core: auto (the CUDA kernel where it serves, else torch), kernels (the "
        "kernel or an error), torch (the per-sequence PyTorch path) (default: %(default)s)",
    )
    json: str | None = opt(None, metavar="FILE", help="write every figure as JSON to FILE")


def _check(opts: Dsv4StepOptions) -> None:
    import torch

    if opts.device == "cuda" and not torch.cuda.is_available():
        raise EngramError(
            "bench dsv4-step needs a CUDA GPU; none is available here (--device cpu --model tiny runs "
            "the path on the CPU)"
        )
    if opts.context < 1 or not opts.batches or min(opts.batches) < 1:
        raise EngramError(f"--context and --batches must be >= 1 (got {opts.context}, {opts.batches})")
    if opts.prefill < 0:
        raise EngramError(f"--prefill must be >= 0 tokens (got {opts.prefill}; 0 skips the prefill chunk)")
    if not opts.table_gib > 0:
        raise EngramError(f"--table-gib must be > 0 (got {opts.table_gib})")
    if not opts.weights or len(set(opts.weights)) != len(opts.weights):
        raise EngramError(
            f"--weights must name each format once (got {opts.weights}; choose from {', '.join(WEIGHT_FORMATS)})"
        )


def cases(opts: Dsv4StepOptions) -> list[tuple[str, list[int], int]]:
    """``(name, seq_lens, past)``: each decode batch at --context, then the prefill chunk."""
    out = [(f"decode {b}", [1] * b, opts.context) for b in opts.batches]
    if opts.prefill:
        out.append((f"prefill {opts.prefill}", [opts.prefill], 0))
    return out


def run(opts: Dsv4StepOptions) -> int:
    import torch

    from engram_trt.bench.common import dump, measure_limits

    _check(opts)
    dev = torch.device("cuda", torch.cuda.current_device()) if opts.device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    t0 = time.perf_counter()
    limits = measure_limits(dev)
    results: dict[str, Any] = {
        "limits": limits,
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "runs": {},
    }
    for weights in opts.weights:
        results["runs"][weights] = _run_weights(opts, weights, dev, dtype, limits)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    first = results["runs"][opts.weights[0]]  # the first format's figures also at the top (one-format readers)
    results.update({k: first[k] for k in ("model", "cases", "tables", "calibration") if k in first})
    _compare_weights(results, opts)
    for weights, one in results["runs"].items():
        _print(one, opts, limits, weights if len(opts.weights) > 1 else None)
    _print_weights(results)
    results["wall_s"] = time.perf_counter() - t0
    dump(results, opts.json)
    return 0


def _run_weights(opts: Dsv4StepOptions, weights: str, dev: Any, dtype: Any, limits: dict[str, float]) -> dict[str, Any]:
    """The model built in the ``weights`` format, every placement and case timed."""
    import torch

    from engram_trt.bench.dsv4model import bench_config, build_model, build_tables, table_store

    t0 = time.perf_counter()
    max_len = max(opts.context + 2, opts.prefill + 2)
    bm = build_model(bench_config(opts.model, table_gib=opts.table_gib, max_len=max_len, weights=weights), dev, dtype)
    bm.model.attention_backend = opts.attention
    cfg = bm.config
    out: dict[str, Any] = {
        "model": {
            "preset": opts.model,
            "weights": weights,
            "params": bm.params,
            "weight_bytes": bm.weight_bytes,
            "dtype": str(dtype),
            "quantization": None if cfg.quant is None else cfg.quant.describe(),
            "layer_types": list(cfg.layer_types),
            "mlp_layer_types": list(cfg.mlp_layer_types),
            "experts": cfg.n_routed_experts,
            "top_k": cfg.num_experts_per_tok,
            "hc_mult": cfg.hc_mult,
            "engram_layers": list(cfg.engram.layer_ids),
            "engram_cols": bm.layout.n_hash_cols,
            "table_rows": [int(r) for r in bm.layout.table_rows],
            "backend": bm.model.backend_name,
        },
        "cases": {},
    }
    fmt = "" if cfg.quant is None else f", {cfg.quant.describe()}"
    print(
        f"model ({weights} weights{fmt}): {bm.params / 1e9:.2f}B parameters ({bm.weight_bytes / 2**30:.2f} GiB "
        f"held, compute {dtype}), layers {_layer_line(cfg)}, Engram on {list(cfg.engram.layer_ids)}; built on "
        f"{dev.type} in {time.perf_counter() - t0:.0f} s\nbackend: {bm.model.backend_name}",
        flush=True,
    )
    logits: dict[str, Any] = {}
    for where in opts.placements:
        t1 = time.perf_counter()
        tables = build_tables(bm.layout, cfg.engram.head_dim, where, dev)
        store = table_store(tables, where, list(cfg.engram.layer_ids))
        bm.model.set_tables(store)
        gib = sum(r.numel() + s.numel() for r, s in tables) / 2**30
        out.setdefault("tables", {})[where] = {"gib": gib, "kind": store.kind, "where": store.where()}
        print(
            f"{where}: tables {gib:.2f} GiB in {store.where()} ({store.kind}), "
            f"made in {time.perf_counter() - t1:.0f} s",
            flush=True,
        )
        calibrated: dict[str, Any] = {}
        for name, lens, past in cases(opts):
            entry = _time_case(opts, bm, store, where, lens, past, dev, limits, calibrated, logits, name)
            out["cases"].setdefault(name, {"tokens": sum(lens), "seqs": len(lens), "past": past})[where] = entry
        if calibrated.get("choice") is not None:
            out.setdefault("calibration", {})[where] = calibrated["choice"].describe()
        bm.model.tables = None
        store.close()
        del tables, store
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    _ratios(out)
    return out


def _compare_weights(results: dict[str, Any], opts: Dsv4StepOptions) -> None:
    """With bf16 and fp8 both run: per case (HBM tables where run, else the first
    placement), the fp8 step's speed-up over bf16 beside the ratio of their byte floors
    (the bytes each reads), and their quotient (1.0: the fewer bytes show in full)."""
    runs = results["runs"]
    if not {"bf16", "fp8"} <= set(runs):
        return
    where = "hbm" if "hbm" in opts.placements else opts.placements[0]
    table: dict[str, Any] = {}
    for name, row in runs["bf16"]["cases"].items():
        b, f = row[where], runs["fp8"]["cases"][name][where]
        entry = {
            "placement": where,
            "bf16_mode": b.get("mode", "eager"),
            "fp8_mode": f.get("mode", "eager"),
            "bf16_step_ms": b["step_ms"],
            "fp8_step_ms": f["step_ms"],
            "speedup": b["step_ms"] / f["step_ms"],
            "bf16_floor_bytes": b["floor"]["hbm_bytes"],
            "fp8_floor_bytes": f["floor"]["hbm_bytes"],
            "floor_ratio": b["floor"]["hbm_bytes"] / f["floor"]["hbm_bytes"],
        }
        entry["speedup_over_floor_ratio"] = entry["speedup"] / entry["floor_ratio"]
        table[name] = entry
    results["weights_comparison"] = table


def _layer_line(cfg: Any) -> str:
    short = {"sliding_attention": "S", "compressed_sparse_attention": "C", "heavily_compressed_attention": "H"}
    return "".join(short[t] for t in cfg.layer_types) + " (S sliding, C CSA, H HCA)"


def _make_step(bm: Any, lens: list[int], past: int, seed: int) -> tuple[Any, Any, Any]:
    """The packed step (raw ids, their compressed ids, each sequence's lookback) and
    the host arrays the prefetcher takes."""
    import numpy as np
    import torch

    from engram_trt.engram.hashing import DEAD
    from engram_trt.models.step import PackedStep

    rng = np.random.default_rng(seed)
    ids = rng.integers(3, bm.config.vocab_size, size=sum(lens))
    n = bm.layout.max_ngram_size - 1
    lb = (
        bm.compress_lookup[rng.integers(3, bm.config.vocab_size, size=(len(lens), n))]
        if past
        else np.full((len(lens), n), DEAD, dtype=np.int64)
    )
    cids = bm.compress_lookup[ids]
    step = PackedStep(
        torch.from_numpy(ids),
        lens,
        [past] * len(lens),
        list(range(len(lens))),
        lookback=torch.from_numpy(lb),
        engram_ids=torch.from_numpy(cids),
    )
    return step, cids, lb


def _time_case(
    opts: Dsv4StepOptions,
    bm: Any,
    store: Any,
    where: str,
    lens: list[int],
    past: int,
    dev: Any,
    limits: dict[str, float],
    calibrated: dict[str, Any],
    logits: dict[str, Any],
    name: str,
) -> dict[str, Any]:
    import torch

    from engram_trt.bench.common import time_fn
    from engram_trt.bench.dsv4model import floor
    from engram_trt.bench.dsv4profile import ModuleClock
    from engram_trt.runtime.prefetch import Prefetcher

    model, S, T = bm.model, len(lens), sum(lens)
    decode = all(n == 1 for n in lens)
    graphed = decode and dev.type == "cuda" and model.supports_decode_graphs
    cache = model.new_cache(S + 1 if graphed else S, past + max(lens) + 1)  # + the graphs' scratch slot
    gen = torch.Generator(device=dev).manual_seed(S)
    for layer in cache.layers:  # random, not zeros: attention over realistic entries
        for t in layer.values():
            t.normal_(generator=gen)
    step, cids, lb = _make_step(bm, lens, past, seed=T)
    pf = Prefetcher(bm.layout, store, dev, T)
    if where == "pinned" and dev.type == "cuda":  # as the runner does at start-up, once per store
        if "choice" not in calibrated:
            calibrated["choice"] = pf.calibrate()
        if calibrated["choice"] is not None:
            pf.gather_policy = calibrated["choice"].path_for
    out: dict[str, Any] = {"lookup_path": pf.path_for(T * bm.layout.n_hash_cols)}
    graphs = None
    if graphed:  # the runtime's decode graphs (torch_backend: a scratch slot, the prefetcher's gather choice)
        from engram_trt.runtime.cuda_graphs import DecodeGraphs

        graphs = DecodeGraphs(model, cache, S, scratch_slot=S, tables=store, lookup_policy=pf.path_for)

    def one(wrap: Any = None, eager: bool = False) -> Any:
        for s in range(S):
            cache.lengths[s] = past
        replay = graphs is not None and not eager and wrap is None
        rows = None if replay and graphs.handles_lookup(step) else pf.submit(step, cids, lb)
        got = graphs.run(step, rows) if replay else None
        if got is None:
            got = model.forward_step(step, cache, engram_rows=rows if wrap is None else wrap(rows))
        if rows is not None:
            rows.finish()  # as the runtime does after launching a step
        torch.argmax(got, dim=-1).tolist()  # the sampler's one read per step
        return got

    def lookup() -> None:
        rows = pf.submit(step, cids, lb)
        rows.wait()
        rows.finish()

    try:
        out["step_ms"] = time_fn(one, dev, 2, opts.reps)["median_s"] * 1e3
        out["mode"] = "graph" if graphs is not None and graphs.replays and graphs.failed is None else "eager"
        if graphs is not None:
            out["graphs"] = {
                "replays": graphs.replays,
                "captures": graphs.captures,
                "failed": graphs.failed,
                "shapes": [f"{g}x{ctx}:{mode}" for g, ctx, mode in sorted(graphs.graphs)],
            }
            out["eager_step_ms"] = time_fn(lambda: one(eager=True), dev, 2, opts.reps)["median_s"] * 1e3
        out["lookup_ms"] = time_fn(lookup, dev, 2, opts.reps)["median_s"] * 1e3
        mine = one().float()
        for s in range(S):
            cache.lengths[s] = past
        own = model.forward_step(step, cache).float()  # eager, the model's own gather, no prefetch
        scale = float(mine.abs().max()) or 1.0
        out["check"] = {
            "finite": bool(torch.isfinite(mine).all()),
            "vs_own_gather_rel": float((mine - own).abs().max()) / scale,
        }
        if name in logits:
            out["check"]["vs_first_placement_rel"] = float((mine - logits[name]).abs().max()) / scale
        else:
            logits[name] = mine
        if opts.profile_reps:
            with ModuleClock(model) as clock:
                for _ in range(opts.profile_reps):
                    clock.step(lambda: one(clock.rows))
            out["breakdown"] = clock.summary()
        if opts.kernel_reps and decode:
            from engram_trt.bench.breakdown import step_kernel_profile

            out["kernel_profile"] = step_kernel_profile(one, opts.kernel_reps, dev, out["mode"])
    finally:
        pf.close()
    out["moe_forms"] = sorted({f for f in (getattr(layer.mlp, "last_form", None) for layer in model.model.layers) if f})
    out["floor"] = floor(bm, lens, past, where, limits)
    fl = out["floor"]
    if "floor_ms" in fl:
        out["step_over_floor"] = out["step_ms"] / fl["floor_ms"]
        if where == "pinned" and fl["link_ms"] > 0:
            out["lookup_over_link"] = out["lookup_ms"] / fl["link_ms"]
    graph_note = f" ({out['mode']}; eager {out['eager_step_ms']:.3f} ms)" if "eager_step_ms" in out else ""
    print(
        f"  {where} {name}: step {out['step_ms']:.3f} ms{graph_note}, lookup alone {out['lookup_ms']:.3f} ms "
        f"({out['lookup_path']}), floor reads {fl['hbm_bytes'] / 2**20:.1f} MiB"
        + (f" = {fl['floor_ms']:.4f} ms" if "floor_ms" in fl else "")
        + f", MoE {'/'.join(out['moe_forms'])}",
        flush=True,
    )
    return out


def _ratios(results: dict[str, Any]) -> None:
    """Per case: pinned / HBM step time, and what the host tables add over the link's floor."""
    for row in results["cases"].values():
        h, p = row.get("hbm"), row.get("pinned")
        if h and p:
            row["pinned_over_hbm"] = p["step_ms"] / h["step_ms"]
            row["pinned_extra_ms"] = p["step_ms"] - h["step_ms"]
            link = p["floor"].get("link_ms")
            if link:
                row["pinned_extra_over_link"] = row["pinned_extra_ms"] / link


def _print(results: dict[str, Any], opts: Dsv4StepOptions, lim: dict[str, float], weights: str | None) -> None:
    """One weight format's tables (``weights`` names it when several ran)."""
    if lim and weights in (None, opts.weights[0]):
        print(
            f"\nlimits measured now: HBM copy {lim['hbm_GBps']:.0f} GB/s, "
            f"bf16 matmul {lim['bf16_TFLOPs']:.0f} TFLOP/s, pinned H2D {lim['h2d_GBps']:.1f} GB/s"
        )
    if weights is not None:
        what = results["model"]["quantization"] or "every weight " + results["model"]["dtype"]
        print(f"\n== {weights} weights ({what})")
    for where, c in results.get("calibration", {}).items():
        print(f"{where}: start-up calibration {c}")
    print(
        f"\n{'case':<14} {'place':<7} {'mode':<5} {'step ms':>9} {'eager ms':>9} {'floor MiB':>9} {'floor ms':>9} "
        f"{'step/floor':>10} {'lookup ms':>9} {'link ms':>8} {'lookup/link':>11} {'pinned/HBM':>10}"
    )
    for name, row in results["cases"].items():
        for where in opts.placements:
            e = row[where]
            fl = e["floor"]
            ratio = (
                f"{row['pinned_over_hbm']:>10.3f}" if where == "pinned" and "pinned_over_hbm" in row else f"{'':>10}"
            )
            print(
                f"{name:<14} {where:<7} {e.get('mode', 'eager'):<5} {e['step_ms']:>9.3f} "
                f"{e.get('eager_step_ms', e['step_ms']):>9.3f} {fl['hbm_bytes'] / 2**20:>9.1f} "
                f"{fl.get('floor_ms', float('nan')):>9.4f} {e.get('step_over_floor', float('nan')):>10.1f} "
                f"{e['lookup_ms']:>9.3f} {fl.get('link_ms', 0.0):>8.5f} "
                f"{e.get('lookup_over_link', float('nan')):>11.1f} {ratio}"
            )
    shown = [*CLASSES, "other"]
    if any(row[w].get("breakdown") for row in results["cases"].values() for w in opts.placements):
        clock = next(
            row[w]["breakdown"]["clock"]
            for row in results["cases"].values()
            for w in opts.placements
            if row[w].get("breakdown")
        )
        print(f"\nwhere a step's time goes, ms per module class ({clock}; median of the profiled steps):")
        print(f"{'case':<14} {'place':<7} {'step':>8} " + " ".join(f"{_SHORT[c]:>8}" for c in shown))
        for name, row in results["cases"].items():
            for where in opts.placements:
                b = row[where].get("breakdown")
                if b:
                    print(
                        f"{name:<14} {where:<7} {b['total_gpu_ms']:>8.3f} "
                        + " ".join(f"{b['classes'][c]['gpu_ms']:>8.3f}" for c in shown)
                    )
        print("(" + ", ".join(f"{_SHORT[c]}: {c}" for c in shown) + "; host-side times and call counts in the JSON)")
    _print_kernels(results, opts)


def _print_kernels(results: dict[str, Any], opts: Dsv4StepOptions) -> None:
    """Each decode case's kernel profile (``--kernel-reps``), as bench e2e prints one."""
    from engram_trt.bench.breakdown import format_kernel_profile

    for name, row in results["cases"].items():
        for where in opts.placements:
            p = row[where].get("kernel_profile")
            if p:
                print(f"\n{name}, {where} tables: " + "\n  ".join(format_kernel_profile(p)))


def _print_weights(results: dict[str, Any]) -> None:
    table = results.get("weights_comparison")
    if not table:
        return
    where = next(iter(table.values()))["placement"]
    print(
        f"\nfp8 (FP8 linears + FP4 experts) vs bf16 weights, {where} tables: the step's speed-up against the "
        f"ratio of the bytes each step reads (decode steps replayed as CUDA graphs where the mode says graph)"
    )
    print(
        f"{'case':<14} {'bf16 ms':>9} {'fp8 ms':>9} {'speed-up':>9} {'bf16 MiB':>9} {'fp8 MiB':>9} "
        f"{'bytes ratio':>11} {'speed-up/ratio':>14}"
    )
    for name, e in table.items():
        print(
            f"{name:<14} {e['bf16_step_ms']:>9.3f} {e['fp8_step_ms']:>9.3f} {e['speedup']:>9.2f} "
            f"{e['bf16_floor_bytes'] / 2**20:>9.1f} {e['fp8_floor_bytes'] / 2**20:>9.1f} {e['floor_ratio']:>11.2f} "
            f"{e['speedup_over_floor_ratio']:>14.2f}"
        )
