"""``engram-trt bench step``: what Engram costs a step, and how well the lookup hides.

It builds an engram-llama with random weights in GPU memory (``--model 1b``: 16
layers, hidden 2048, bf16, ~1.1B parameters, Engram on layers 1 and 2 with DeepSeek-
V4.1-shaped tables, 256-byte FP8 rows + 8 scale bytes, ``--table-gib`` of them;
``--model 8b``: Llama-3-8B's backbone, 32 layers, hidden 4096, the same Engram layers), and
times the runtime's own step (the prefetcher staging rows on its side stream, then
``EngramLlama.forward_step``, the torch backend's call) for decode batches and a
prefill chunk, with the tables in GPU memory, in pinned host memory (host gather, and
the UVA kernel), and with the Engram layers removed. Every time is printed as a ratio to
the step without Engram measured in the same run, beside that step's own efficiency
(its time over the weight-read time for decode, over the FLOP-bound time for prefill,
from the copy bandwidth and matrix rate measured now) so a slow baseline cannot make
the lookup look cheap. With ``--timeline`` it records, per step, when the lookup ran
on the side stream and when the main stream first needed the rows.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engram_trt.bench import stepprofile
from engram_trt.bench.options import opt

log = logging.getLogger(__name__)

PRESETS: dict[str, dict[str, Any]] = {
    "1b": {
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 5632,
        "hc_mult": 4,
        "engram_layer_ids": [1, 2],
        "engram_max_ngram_size": 4,
        "engram_n_heads": 8,
        "engram_head_dim": 256,
    },
    # Llama-3-8B's backbone with the same Engram layers: the size of the Engram paper's
    # dense baselines, where the two layers' wkv (126M parameters each) is ~3% of the weights.
    "8b": {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 14336,
        "hc_mult": 4,
        "engram_layer_ids": [1, 2],
        "engram_max_ngram_size": 4,
        "engram_n_heads": 8,
        "engram_head_dim": 256,
    },
    "small": {
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "intermediate_size": 512,
        "hc_mult": 2,
        "engram_layer_ids": [1, 2],
        "engram_max_ngram_size": 3,
        "engram_n_heads": 2,
        "engram_head_dim": 256,
    },
}
# pinned-auto is the runtime as served (the start-up calibration's path per size, host
# gathers on the gather driver, the scale bytes read on the GPU); pinned-auto-nodriver runs
# those gathers on the engine thread; pinned-auto-hostscales keeps the scales in host memory;
# the -ring modes stage the host gather's fp8 chunks in its ring of device slots alone (no
# job buffers: the library before 0.12.0), for A/B runs;
# the -onecut modes replay decode graphs cut only at the first Engram layer, which waits
# for every layer's rows (the runtime's graphs wait for each layer's rows at that layer);
# the -separate modes replay the GPU lookup in graphs of its own beside the step's
# segments (the runtime captures it on a side stream forked inside one graph of the step).
MODES = (
    "none",
    "device",
    "pinned-host",
    "pinned-uva",
    "pinned-auto",
    "pinned-auto-nodriver",
    "pinned-auto-hostscales",
    "pinned-auto-ring",
    "pinned-host-ring",
    "pinned-host-onecut",
    "pinned-uva-onecut",
    "device-separate",
    "pinned-uva-separate",
)
AB_SUFFIXES = ("-onecut", "-separate", "-ring")  # the older forms of the graphs, for A/B runs; left out by default
DEFAULT_MODES = tuple(m for m in MODES if not m.endswith(AB_SUFFIXES))


@dataclass(kw_only=True)
class StepOptions:
    """``engram-trt bench step``'s flags."""

    model: str = opt(
        "1b",
        choices=sorted(PRESETS),
        help="model shape: 1b (16 layers, hidden 2048), 8b (32 layers, hidden 4096), small (4 layers, "
        "hidden 256, for a quick look); all with Engram on layers 1 and 2 (default: %(default)s)",
    )
    table_gib: float = opt(24.0, help="host table size in GiB over all Engram layers (default: %(default)s)")
    decode_batches: str = opt("1,64,256", help="decode batch sizes (default: %(default)s)")
    context: int = opt(256, help="tokens already in each decode sequence's cache (default: %(default)s)")
    prefill: int = opt(8192, help="prefill chunk tokens, 0 to skip (default: %(default)s)")
    modes: str = opt(
        ",".join(DEFAULT_MODES),
        help=f"table placements to time, of {','.join(MODES)} (default: all but the -onecut and -separate ones)",
    )
    iters: int = opt(10, help="timed steps per case and round (median reported; default: %(default)s)")
    rounds: int = opt(
        1,
        help="rounds of timing: every mode of a case is prepared first, then the modes take turns, "
        "--iters steps each, in an order reversed every other round; each round's median is "
        "reported beside the median of all steps, and an A/B pair's ratio per round (default: "
        "%(default)s)",
    )
    timeline: bool = opt(False, help="record when the lookup ran vs when the first Engram layer needed it")
    no_graphs: bool = opt(
        False, help="run decode steps eagerly (default: replayed CUDA graphs, as the torch backend serves them)"
    )
    trace: str | None = opt(None, metavar="FILE", help="write a torch-profiler Chrome trace of one pinned decode step")
    stream_profile: bool = opt(
        False,
        help="after timing each case and mode, profile one more step on the GPU and "
        "report each stream's kernel and copy time: with host tables, whether the "
        "side streams' work slows the main stream's kernels (their time against "
        "the same kernels with HBM tables); and where the main stream sat idle "
        "within the step: before its first kernel (host work), between kernels, "
        "after its last, with the largest gaps named by the kernels around them",
    )
    host_profile: int = opt(
        0,
        metavar="N",
        help="after timing each case and mode, profile N more steps' host work "
        "(cProfile) and print the functions that take most of it, per step "
        "(default: 0, off)",
    )
    json: str | None = opt(None, metavar="FILE", help="write all figures as JSON to FILE")


def _config(opts: StepOptions, rows_per_col: int) -> dict[str, Any]:
    d = dict(PRESETS[opts.model])
    d.update(
        {
            "architectures": ["EngramLlamaForCausalLM"],
            "vocab_size": 129280,
            "tie_word_embeddings": True,
            "max_position_embeddings": max(16384, opts.prefill + 16, opts.context + 16),
            "eos_token_id": 1,
            "engram_vocab_size": rows_per_col,
            "engram_compressed_vocab_size": 99092,
            "engram_pad_token_id": 1,
        }
    )
    return d


def build(opts: StepOptions, device: Any) -> tuple[Any, Any, Any, dict[str, Any]]:
    """The model (random bf16 weights on the GPU), its layout and host tables."""
    import numpy as np
    import torch

    from engram_trt.config.model import ModelConfig
    from engram_trt.engram.layout import EngramLayout
    from engram_trt.models.engram_llama.model import EngramLlama, model_weight_shapes

    pre = PRESETS[opts.model]
    cols = (pre["engram_max_ngram_size"] - 1) * pre["engram_n_heads"]
    row_bytes = pre["engram_head_dim"] + pre["engram_head_dim"] // 32
    n_layers = len(pre["engram_layer_ids"])
    rows_per_col = max(1000, int(opts.table_gib * 2**30 / (row_bytes * n_layers * cols)))
    cfg = ModelConfig.from_dict(_config(opts, rows_per_col))
    gen = torch.Generator(device=device).manual_seed(0)
    weights = {}
    for name, shape in model_weight_shapes(cfg).items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape, device=device, dtype=torch.bfloat16)
        else:
            weights[name] = torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen) * 0.02
    lookup = np.random.default_rng(0).integers(0, 99092, size=cfg.vocab_size, dtype=np.int64)
    lookup[1] = 1
    layout = EngramLayout.from_spec(cfg.engram, pad_id=1)
    model = EngramLlama(cfg, weights, compress_lookup=lookup, layout=layout, device=device, dtype=torch.bfloat16)
    del weights
    # Host tables: a random 64 MiB block tiled over pinned memory (fast to fill; random
    # ids still land on random pages), scales drawn from normal exponents (no NaN).
    block = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8)
    block[(block & 0x7F) == 0x7F] = 0x3C  # no FP8 NaN codes
    tables = []
    for li in range(layout.num_layers):
        R = int(layout.table_rows[li])
        rows = torch.empty((R, cfg.engram.head_dim), dtype=torch.uint8, pin_memory=True)
        flat = rows.view(-1)
        for a in range(0, flat.numel(), block.numel()):
            n = min(block.numel(), flat.numel() - a)
            flat[a : a + n].copy_(block[:n])
        scales = torch.randint(118, 130, (R, cfg.engram.head_dim // 32), dtype=torch.uint8).pin_memory()
        tables.append((rows, scales))
    engram_params = [p for n, p in model.named_parameters() if f".{cfg.engram.prefix}." in n]
    info = {
        "params": sum(p.numel() for p in model.parameters()),
        "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        # The Engram layers' own weights (wkv, the gate's norms): the no-Engram step
        # reads none of them, so its floor must not count them.
        "engram_params": sum(p.numel() for p in engram_params),
        "engram_weight_bytes": sum(p.numel() * p.element_size() for p in engram_params),
        "table_bytes": sum(r.numel() + s.numel() for r, s in tables),
        "table_rows": [int(r) for r in layout.table_rows],
        "row_bytes": row_bytes,
        "cols": cols,
    }
    return model, layout, tables, info


def _stores(tables: list, modes: list[str], device: Any, quant_block: int) -> dict[str, Any]:
    from engram_trt.tables.base import DeviceTables, TableStore

    class PinnedTensors(TableStore):  # pinned by torch (cudaHostAlloc): readable through UVA
        kind = "pinned"
        gpu_readable = True

    out: dict[str, Any] = {}
    if any(m.startswith("pinned") for m in modes):
        out["pinned"] = PinnedTensors(tables, quant_block)
    if any(m.startswith("device") for m in modes):
        out["device"] = DeviceTables([(r.to(device), s.to(device)) for r, s in tables], quant_block)
    return out


def _steps(opts: StepOptions) -> list[tuple[str, list[int], int]]:
    """(name, seq_lens, past) of each case: decode batches at --context, one prefill chunk."""
    cases = [(f"decode {b}", [1] * b, opts.context) for b in (int(x) for x in opts.decode_batches.split(",") if x)]
    if opts.prefill:
        cases.append((f"prefill {opts.prefill}", [opts.prefill], 0))
    return cases


def run(opts: StepOptions) -> int:
    import numpy as np
    import torch

    from engram_trt.bench.common import dump, measure_limits, time_fn
    from engram_trt.errors import EngramError
    from engram_trt.models.step import PackedStep

    if not torch.cuda.is_available():
        raise EngramError("bench step needs a CUDA GPU (it times the GPU runtime); none is available here")
    if opts.rounds < 1 or opts.iters < 1:
        raise EngramError(f"--rounds and --iters must be >= 1 (got {opts.rounds}, {opts.iters})")
    modes = [m for m in opts.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise EngramError(f"--modes: {bad} not among {', '.join(MODES)}")
    device = torch.device("cuda", torch.cuda.current_device())
    limits = measure_limits(device)
    model, layout, tables, info = build(opts, device)
    cfg = model.config
    stores = _stores(tables, modes, device, cfg.engram.quant_block)
    rng = np.random.default_rng(1)
    results: dict[str, Any] = {"limits": limits, "model": info, "cases": {}}
    calibrated: dict[str, Any] = {}
    for name, lens, past in _steps(opts):
        S, T = len(lens), sum(lens)
        cache = model.new_cache(S + 1, past + max(lens) + 1)  # + the graphs' scratch slot
        for k, v in zip(cache.keys, cache.values):  # random, not zeros: realistic attention inputs
            k.normal_(0, 1), v.normal_(0, 1)
        ids = rng.integers(2, cfg.vocab_size, size=T)
        step = PackedStep(
            torch.from_numpy(ids),
            lens,
            [past] * S,
            list(range(S)),
            lookback=torch.from_numpy(model.compress_lookup.cpu().numpy()[rng.integers(2, 1000, size=(S, 3))]),
            engram_ids=torch.from_numpy(model.compress_lookup.cpu().numpy()[ids]),
        )
        cids = step.engram_ids.numpy()
        lb = step.lookback.numpy()
        row: dict[str, Any] = {"tokens": T, "seqs": S}
        prepared = {
            mode: _prepare(
                mode, opts, model, layout, stores, device, cache, step, cids, lb, past, calibrated, results, row
            )
            for mode in modes
        }
        times: dict[str, list[list[float]]] = {mode: [] for mode in modes}
        for r in range(opts.rounds):
            # The modes take turns, their order reversed every other round, so a drift of
            # the machine (clocks, the host's other work) falls on all of them alike.
            for mode in modes if r % 2 == 0 else modes[::-1]:
                prepared[mode].activate()
                times[mode].append(time_fn(prepared[mode].one, device, 3 if r == 0 else 1, opts.iters)["times_s"])
        for mode in modes:
            m = prepared[mode]
            m.activate()
            flat = [x for rt in times[mode] for x in rt]
            entry = {
                "step_ms": statistics.median(flat) * 1e3,
                "times_ms": [x * 1e3 for x in flat],
                "round_ms": [statistics.median(rt) * 1e3 for rt in times[mode]],
                "graphs": None if m.graphs is None else (m.graphs.failed or f"{m.graphs.replays} replays"),
            }
            if m.pf is not None and opts.timeline and not (m.graphs is not None and m.graphs.handles_lookup(step)):
                entry["timeline"] = stepprofile.timeline(m.pf, m.one, device)
            if opts.host_profile:
                entry["host_profile"] = stepprofile.host_profile(m.one, device, opts.host_profile)
            if opts.stream_profile:
                entry["streams"] = stepprofile.stream_profile(m.one, device)
            row[mode] = entry
        for m in prepared.values():
            m.close()
        prepared.clear()  # frees the recorded graphs before the next case
        pair_ab(row, modes)
        base = row.get("none", {}).get("step_ms")
        if base:
            for mode in modes:
                row[mode]["ratio_to_none"] = row[mode]["step_ms"] / base
        hbm = row.get("device", {}).get("step_ms")
        if hbm:
            # The host tables' own cost: the same Engram step with its tables in HBM as
            # the denominator (the wkv GEMM and the gate cancel out; the lookup remains).
            for mode in modes:
                if mode.startswith("pinned"):
                    row[mode]["ratio_to_device"] = row[mode]["step_ms"] / hbm
        if base:
            row["bound_ms"] = _bound_ms(info, limits, cfg, lens, past)
            row["baseline_efficiency"] = row["bound_ms"] / base if row["bound_ms"] else None
            engram_bound = _bound_ms(info, limits, cfg, lens, past, engram=True)
            # What Engram costs at the floor: both steps at their bounds. A measured
            # ratio below this means the baseline is slow, not that Engram is cheap.
            row["engram_floor_ratio"] = engram_bound / row["bound_ms"] if row["bound_ms"] else None
        results["cases"][name] = row
        cache = None  # the next case allocates its own
        torch.cuda.empty_cache()
    if opts.trace and "pinned" in stores:
        stepprofile.trace(model, stores["pinned"], layout, device, opts.trace, rng)
    _print(results, modes)
    dump(results, opts.json)
    return 0


def graph_form(mode: str) -> tuple[bool, bool]:
    """(wait_each_layer, fork_lookup) of a mode's decode graphs: the runtime's form (a wait
    at each Engram layer, the GPU lookup forked inside one graph) but for the older forms
    the A/B modes keep: ``-onecut`` (one wait, at the first Engram layer, with the lookup
    in graphs of its own, as it was then) and ``-separate`` (the lookup's graphs apart).
    ``-ring`` changes the host gather's staging only: its graphs are the runtime's."""
    return not mode.endswith("-onecut"), not mode.endswith(("-onecut", "-separate"))


def pair_ab(row: dict[str, Any], modes: list[str]) -> None:
    """Mark each A/B variant (``device-separate``, ``pinned-uva-onecut``) whose base mode
    ran in the same case: ``ab_base``, and ``ab_round_ratios``, its median over the
    base's in each round. Why per round: both were timed in every round, next to each
    other, so a round's ratio is free of the drift between rounds."""
    for mode in modes:
        plain = next((mode[: -len(x)] for x in AB_SUFFIXES if mode.endswith(x)), None)
        if plain in row:
            row[mode]["ab_base"] = plain
            row[mode]["ab_round_ratios"] = [a / b for a, b in zip(row[mode]["round_ms"], row[plain]["round_ms"])]


@dataclass
class _Mode:
    """One mode of a case, ready to time: its step (``one``), prefetcher and graphs."""

    one: Callable[[], None]
    activate: Callable[[], None]
    pf: Any = None
    graphs: Any = None

    def close(self) -> None:
        if self.pf is not None:
            self.pf.close()
        self.pf = self.graphs = None


def _prepare(
    mode: str,
    opts: StepOptions,
    model: Any,
    layout: Any,
    stores: dict[str, Any],
    device: Any,
    cache: Any,
    step: Any,
    cids: Any,
    lb: Any,
    past: int,
    calibrated: dict[str, Any],
    results: dict[str, Any],
    row: dict[str, Any],
) -> _Mode:
    """A mode's prefetcher and decode graphs for one case, and its step as a callable.
    ``activate`` puts the model in the mode's state (its tables, Engram on or off): the
    modes of a case are all prepared first and then timed in turns, and the eager path
    (prefill) reads that state at every call."""
    import torch

    from engram_trt.runtime.prefetch import Prefetcher

    S, T = len(step.seq_lens), int(step.input_ids.numel())
    decode = max(step.seq_lens) == 1
    on_device = mode.startswith("device")
    store = None if mode == "none" else stores["device" if on_device else "pinned"]

    def activate() -> None:
        if store is not None:
            model.set_tables(store)
        model.engram_enabled = store is not None

    activate()
    pf = None
    if store is not None:
        auto = mode.startswith("pinned-auto")
        policy = None if on_device or auto else (lambda n, m=mode: "host" if m.startswith("pinned-host") else "uva")
        pf = Prefetcher(
            layout,
            store,
            device,
            T,
            gather_policy=policy,
            gather_driver=False if mode.endswith("-nodriver") else None,
            hbm_scales=False if mode.endswith("-hostscales") else None,
            job_staging=False if mode.endswith("-ring") else None,
        )
        results.setdefault("host_layouts", {})[mode] = pf.host_layout
        if auto:  # what a served runtime does: the start-up calibration's choice per size
            if "choice" not in calibrated:
                calibrated["choice"] = pf.calibrate()
                results["calibration"] = calibrated["choice"].describe() if calibrated["choice"] else None
            if calibrated["choice"] is not None:
                pf.gather_policy = calibrated["choice"].path_for
            row.setdefault("auto_path", pf.path_for(T * layout.n_hash_cols))
    graphs = None
    if decode and not opts.no_graphs:
        from engram_trt.runtime.cuda_graphs import DecodeGraphs

        wait_each_layer, fork_lookup = graph_form(mode)
        graphs = DecodeGraphs(
            model,
            cache,
            S,
            scratch_slot=S,
            tables=model.tables if store is not None else None,
            lookup_policy=pf.path_for if pf is not None else None,
            wait_each_layer=wait_each_layer,
            fork_lookup=fork_lookup,
        )

    def one() -> None:
        for s in range(S):
            cache.lengths[s] = past
        in_graph = graphs is not None and graphs.handles_lookup(step)
        rows = pf.submit(step, cids, lb) if pf is not None and not in_graph else None
        logits = graphs.run(step, rows) if graphs is not None else None
        if logits is None:
            logits = model.forward_step(step, cache, engram_rows=rows)
        if rows is not None:
            rows.finish()  # as the runtime does after launching a step
        torch.argmax(logits, dim=-1).tolist()  # the sampler's one read per step

    return _Mode(one=one, activate=activate, pf=pf, graphs=graphs)


def _bound_ms(
    info: dict[str, Any], limits: dict[str, float], cfg: Any, lens: list[int], past: int, engram: bool = False
) -> float | None:
    """The step's floor: decode reads every weight once (plus the KV cache it attends
    over); prefill does 2 x params x tokens FLOPs plus causal attention. Without
    ``engram`` the Engram layers' weights are left out (the step that removes them);
    with it they count, and decode also reads each token's staged bf16 rows once."""
    if not limits:
        return None
    T = sum(lens)
    weight_bytes, params = info["weight_bytes"], info["params"]
    rows = 0
    if engram:
        rows = T * len(cfg.engram.layer_ids) * info["cols"] * cfg.engram.head_dim * 2
    else:
        weight_bytes -= info.get("engram_weight_bytes", 0)
        params -= info.get("engram_params", 0)
    if max(lens) == 1:
        kv = 2 * cfg.num_hidden_layers * len(lens) * (past + 1) * cfg.num_key_value_heads * cfg.head_dim * 2
        return (weight_bytes + kv + rows) / (limits["hbm_GBps"] * 1e9) * 1e3
    attn = 2 * 2 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * (T * T / 2)
    return (2 * params * T + attn) / (limits["bf16_TFLOPs"] * 1e12) * 1e3


def _print(results: dict[str, Any], modes: list[str]) -> None:
    lim, info = results["limits"], results["model"]
    print(
        f"limits measured now: HBM copy {lim.get('hbm_GBps', 0):.0f} GB/s, "
        f"bf16 matmul {lim.get('bf16_TFLOPs', 0):.0f} TFLOP/s, pinned H2D {lim.get('h2d_GBps', 0):.1f} GB/s"
    )
    if results.get("calibration"):
        print(f"pinned-auto: start-up calibration {results['calibration']}")
    if results.get("host_layouts"):
        print(
            "host gather's table layout (hbm-scales: the scale bytes read on the GPU): "
            + ", ".join(f"{m} {v}" for m, v in results["host_layouts"].items() if not m.startswith("device"))
        )
    print(
        f"model: {info['params'] / 1e9:.2f}B params ({info['weight_bytes'] / 2**30:.2f} GiB bf16), tables "
        f"{info['table_bytes'] / 2**30:.2f} GiB ({info['cols']} cols x {info['row_bytes']} B rows per Engram layer)"
    )
    head = f"{'case':<14}" + "".join(f"{m:>22}" for m in modes) + f"{'baseline/bound':>16}{'floor ratio':>13}"
    print(head)
    for name, row in results["cases"].items():
        cells = []
        for m in modes:
            e = row[m]
            r = e.get("ratio_to_none")
            cells.append(f"{e['step_ms']:9.3f} ms" + (f" ({r:5.3f}x)" if r is not None else "        "))
        eff = row.get("baseline_efficiency")
        floor = row.get("engram_floor_ratio")
        print(
            f"{name:<14}"
            + "".join(f"{c:>22}" for c in cells)
            + (f"{1 / eff:>14.2f}x" if eff else f"{'':>16}")
            + (f"{floor:>12.3f}x" if floor else "")
        )
        if len(row[modes[0]]["round_ms"]) > 1:
            print(
                "  medians of each round (ms): "
                + "; ".join(f"{m} " + " ".join(f"{x:.3f}" for x in row[m]["round_ms"]) for m in modes)
            )
        for m in modes:
            if row[m].get("ab_round_ratios"):
                rr = row[m]["ab_round_ratios"]
                print(
                    f"  A/B {m} / {row[m]['ab_base']} by round: "
                    + " ".join(f"{x:.3f}" for x in rr)
                    + (
                        f" (better in {sum(x < 1 for x in rr)} of {len(rr)}; "
                        f"all steps {row[m]['step_ms'] / row[row[m]['ab_base']]['step_ms']:.3f})"
                    )
                )
        host = [f"{m} {row[m]['ratio_to_device']:.3f}x" for m in modes if row[m].get("ratio_to_device")]
        if host:
            print(
                "  host tables over HBM tables: "
                + ", ".join(host)
                + (f" (pinned-auto took the {row['auto_path']} path)" if row.get("auto_path") else "")
            )
        for m in modes:
            tl = row[m].get("timeline")
            if tl and tl.get("lookup_ms") is not None:
                print(
                    f"  {m}: lookup {tl['lookup_ms']:.3f} ms on the side stream, first Engram layer at "
                    f"{tl['first_engram_layer_ms']:.3f} ms, exposed {tl['exposed_ms']:.3f} ms"
                )
            if tl and tl.get("submit_us"):
                su = tl["submit_us"]
                print(
                    f"    submit on the engine thread: {sum(su.values()):.0f} us ("
                    + ", ".join(f"{k} {v:.0f}" for k, v in su.items())
                    + ")"
                )
            if tl and tl.get("sched"):
                sc = tl["sched"]
                print(
                    f"    the step's threads waited {sc['our_wait_ms']:.2f} ms on run queues (one thread at most "
                    f"{sc['our_max_wait_ms']:.2f} ms); busiest: "
                    + ", ".join(
                        f"{x['name']}{'*' if x['ours'] else ''} {x['run_ms']:.1f} ms" for x in sc["busiest"][:4]
                    )
                )
            for li, layer in enumerate((tl or {}).get("layers", [])):
                host = layer["host_gather_ms"]
                print(
                    f"    layer {li}: main stream at its read {layer['read_ms']:.3f} ms, "
                    f"rows ready {layer['ready_ms']:.3f} ms (GPU clock)"
                    + ("" if host is None else f"; host gather call {host[0]:.3f}-{host[1]:.3f} ms after submit")
                )
            sp = row[m].get("streams")
            if sp and sp["by_stream"]:
                main, *side = sp["by_stream"]
                print(
                    f"  {m}: main stream {main['kernels']} kernels, {main['kernel_busy_us'] / 1e3:.3f} ms busy "
                    f"({main['kernel_sum_us'] / 1e3:.3f} ms summed), {main['copies']} copies {main['copy_us']:.0f} us"
                    + "".join(
                        f"; stream {x['stream']}: {x['kernels']} kernels {x['kernel_busy_us']:.0f} us, "
                        f"{x['copies']} copies {x['copy_us']:.0f} us"
                        for x in side
                    )
                )
                idle = sp.get("main_idle")
                if idle:
                    print(
                        f"  {m}: main stream idle within the step ({sp['profiled_step_us']:.0f} us under the "
                        f"profiler): {idle['lead_us']:.0f} us before its first kernel, {idle['gaps_us']:.0f} us "
                        f"between kernels, {idle['tail_us']:.0f} us after its last; largest gaps: "
                        + "; ".join(
                            f"{g['us']:.0f} us after {g['after'][:40]} before {g['before'][:40]}"
                            for g in idle["largest"][:3]
                        )
                    )
            hp = row[m].get("host_profile")
            if hp:
                print(
                    f"  {m}: host profile, {hp['wall_us_per_step']:.0f} us a step under cProfile; own time per step: "
                    + "; ".join(f"{r['function']} {r['own_us']:.0f} us ({r['calls_per_step']:g}x)" for r in hp["top"])
                )
    print(
        "ratios: step time / step time with the Engram layers removed; "
        "baseline/bound: the no-Engram step over its floor "
        "(backbone weights + KV read for decode, FLOPs for prefill); floor ratio: the Engram step's floor (its wkv "
        "and gate weights and staged rows read, or their FLOPs) over the backbone's, the least Engram can cost"
    )
