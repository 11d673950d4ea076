"""Decode steps of a ~1.3B Qwen4Exp-shaped model (random bf16 weights: hidden 2048, 16
layers, 3 linear-attention layers to each full-attention one with QSA, 8 experts top-2
plus the shared expert, 4 hyper-connection streams, PLE on 2 linear layers with rows of
128) with its PLE tables in pinned host memory (the UVA gather kernel) vs in HBM: the
step time per batch size through the decode CUDA graphs and eagerly, the ratio host /
HBM, and the step's floor (the bytes a decode step must read, weights + the slots'
states + the attended K/V + the PLE rows, at the HBM copy rate measured in the run).

The PLE hash layout uses a smaller ``--ple-base`` than the published 20,000,000 so both
layers' tables fit the host (each about ``16 * base * 256`` bytes).

``--linear-attention both`` asks another question on the HBM tables: the Gated DeltaNet
layers' core on the PyTorch forms vs on the kernel library (``GatedDeltaNet.backend``),
for the decode step (graphs, and eager with ``--eager``) and for a prefill step of
``--prefill-tokens`` tokens per sequence (eager: a prefill is not recorded).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engram_trt.bench.options import opt
from engram_trt.errors import EngramError

TINY = Path(__file__).resolve().parents[3] / "tests" / "data" / "qwen4_exp_tiny" / "config.json"


@dataclass(kw_only=True)
class Qwen4StepOptions:
    batches: list[int] = opt([1, 8, 32, 64, 128], help="decode batch sizes (default: 1,8,32,64,128)")
    context: int = opt(1024, help="each sequence's cached length before the step (default: %(default)s)")
    layers: int = opt(16, help="decoder layers (default: %(default)s)")
    experts: int = opt(8, help="routed experts (default: %(default)s)")
    ple_base: int = opt(2_000_000, help="ngram_vocab_size_base of the PLE hash (default: %(default)s)")
    reps: int = opt(20, argtype=("int_arg", 1, 10000), help="timed steps per case (default: %(default)s)")
    eager: bool = opt(False, help="also time eager decode steps (no graphs)")
    linear_attention: str = opt(
        "auto",
        choices=("auto", "kernels", "torch", "both"),
        help="the Gated DeltaNet core's backend; 'both' times torch and kernels side by "
        "side on the HBM tables (default: %(default)s)",
    )
    prefill_tokens: int = opt(
        256,
        argtype=("int_arg", 0, 65536),
        help="with --linear-attention both: also time a prefill step of this many tokens per "
        "sequence, 0 to skip (default: %(default)s)",
    )
    json: str | None = opt(None, help="write the figures as JSON to this file")


def bench_config(opts: Qwen4StepOptions) -> dict[str, Any]:
    """The model's config.json fields (the tiny checkpoint's, resized)."""
    d = json.loads(TINY.read_text())
    n = opts.layers
    types = ["indexed_attention" if i % 4 == 3 else "linear_attention" for i in range(n)]
    d.update(
        vocab_size=32000,
        hidden_size=2048,
        num_hidden_layers=n,
        layer_types=types,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=128,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        num_experts=opts.experts,
        num_experts_per_tok=2,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=1024,
        hc_count=4,
        hc_lowrank=320,
        ple_layer_ids=[1, 5],
        ple_embed_dim=2048,
        heads_per_ngram=8,
        ngram_vocab_size_base=opts.ple_base,
        make_ngram_vocab_size_divisible_by=128,
        split_ngram_parts=1,
        indexer_n_heads=8,
        indexer_head_dim=128,
        indexer_budget=512,
        indexer_compress_ratio=16,
        max_position_embeddings=32768,
        dtype="bfloat16",
    )
    return d


def _pinned_store(tables: list[Any]) -> Any:
    """A table store over pinned host tensors that GPU kernels read in place (UVA)."""
    from engram_trt.tables.base import TableStore

    store = TableStore.from_tensors(tables, [None] * len(tables))
    store.kind, store.gpu_readable = "pinned", True  # type: ignore[misc]  # page-locked: the UVA gather reads it
    return store


def run(opts: Qwen4StepOptions) -> int:
    import torch

    from engram_trt.bench.common import dump, measure_limits
    from engram_trt.models.qwen4_exp.config import read_config
    from engram_trt.models.qwen4_exp.graphs import Qwen4ExpDecodeGraphs
    from engram_trt.models.qwen4_exp.model import Qwen4ExpModel, decode_context, model_weight_shapes
    from engram_trt.models.qwen4_exp.ple_tables import PLETables
    from engram_trt.models.step import PackedStep

    if not torch.cuda.is_available():
        raise EngramError("bench qwen4-step needs a CUDA GPU; none is available here")
    if opts.context < 1 or min(opts.batches) < 1:
        raise EngramError("--context and --batches must be >= 1")
    dev = torch.device("cuda")
    limits = measure_limits(dev)
    cfg = read_config(bench_config(opts))
    gen = torch.Generator(device=dev).manual_seed(0)
    weights = {}
    for name, shape in model_weight_shapes(cfg).items():
        weights[name] = (torch.randn(shape, generator=gen, device=dev) * (0.5 / max(1, shape[-1]) ** 0.5)).to(
            torch.bfloat16
        )
    n_params = sum(t.numel() for t in weights.values())
    t0 = time.perf_counter()
    layout = None
    results: dict[str, Any] = {
        "limits": limits,
        "params": n_params,
        "cases": [],
        "linear_attention": opts.linear_attention,
    }
    both = opts.linear_attention == "both"
    runs = (
        [("hbm", "torch"), ("hbm", "kernels")]
        if both
        else [("hbm", opts.linear_attention), ("pinned", opts.linear_attention)]
    )
    for where, backend in runs:
        if layout is None:
            from engram_trt.engram.ple_hash import PLEHashLayout

            p = cfg.ple
            layout = PLEHashLayout.from_config(
                vocab_size=cfg.vocab_size,
                ngram_size=p.ngram_size,
                heads_per_ngram=p.heads_per_ngram,
                ngram_vocab_size_base=p.vocab_size_base,
                make_ngram_vocab_size_divisible_by=p.divisible_by,
                seed=p.seed,
                eos_token_id=cfg.first_eos,
                num_layers=len(p.layers),
            )
        tables = []
        for li in range(len(cfg.ple.layers)):
            rows = int(layout.table_rows[li])
            t = torch.empty(
                (rows, cfg.ple.head_dim),
                dtype=torch.bfloat16,
                **({"device": dev} if where == "hbm" else {"pin_memory": True}),
            )
            chunk = torch.randn(1 << 22, cfg.ple.head_dim, device=dev, dtype=torch.bfloat16)
            for a in range(0, rows, chunk.shape[0]):
                b = min(rows, a + chunk.shape[0])
                t[a:b].copy_(chunk[: b - a])
            tables.append(t)
        store = TableStoreFor(tables, where)
        model = Qwen4ExpModel(cfg, weights, ple_tables=PLETables(store, dev), device=dev, dtype=torch.bfloat16)
        _set_linear_attention(model, backend)
        table_gib = sum(t.numel() * 2 for t in tables) / (1 << 30)
        print(
            f"{where}: {n_params / 1e9:.2f}B parameters, PLE tables {table_gib:.1f} GiB ({model.ple_tables.paths}), "
            f"ready in {time.perf_counter() - t0:.0f} s; backend {model.backend_name}",
            flush=True,
        )
        for B in opts.batches:
            case = _time_batch(
                torch, model, cfg, B, opts, where, limits, Qwen4ExpDecodeGraphs, decode_context, PackedStep
            )
            case["linear_attention"] = backend
            if both and opts.prefill_tokens:
                case["prefill_ms"] = _time_prefill(torch, model, cfg, B, opts.prefill_tokens, opts.reps, PackedStep)
                print(
                    f"  {backend} batch {B}: prefill of {opts.prefill_tokens} tokens each {case['prefill_ms']:.3f} ms",
                    flush=True,
                )
            results["cases"].append(case)
        model.ple_tables.close()
        del model, tables, store
        torch.cuda.empty_cache()
    if both:
        _print_backends(results["cases"], opts)
        dump(results, opts.json)
        return 0
    by = {(c["tables"], c["batch"]): c for c in results["cases"]}
    print(
        f"\n{'batch':>5} | {'HBM ms':>7} {'pinned ms':>9} {'pinned/HBM':>10} | {'floor ms':>8} {'HBM/floor':>9}"
        + (f" | {'eager HBM ms':>12} {'eager/graph':>11}" if opts.eager else "")
    )
    for B in opts.batches:
        h, p = by[("hbm", B)], by[("pinned", B)]
        line = (
            f"{B:>5} | {h['graph_ms']:>7.3f} {p['graph_ms']:>9.3f} {p['graph_ms'] / h['graph_ms']:>10.3f} | "
            f"{h['floor_ms']:>8.3f} {h['graph_ms'] / h['floor_ms']:>9.2f}"
        )
        if opts.eager:
            line += f" | {h['eager_ms']:>12.3f} {h['eager_ms'] / h['graph_ms']:>11.1f}"
        print(line)
    dump(results, opts.json)
    return 0


def _set_linear_attention(model: Any, backend: str) -> None:
    from engram_trt.models.qwen4_exp.linear_attention import GatedDeltaNet

    for m in model.modules():
        if isinstance(m, GatedDeltaNet):
            m.backend = backend


def _time_prefill(torch: Any, model: Any, cfg: Any, B: int, P: int, reps: int, PackedStep: Any) -> float:  # noqa: N803
    """Median ms of one eager packed step of B fresh prompts of P tokens each."""
    cache = model.new_cache(B, P + 64)
    gen = torch.Generator().manual_seed(P)

    def once() -> float:
        for s in range(B):
            cache.lengths[s] = 0
        st = PackedStep(torch.randint(3, cfg.vocab_size, (B * P,), generator=gen), [P] * B, [0] * B, list(range(B)))
        torch.cuda.synchronize()
        a = time.perf_counter()
        model.forward_step(st, cache)
        torch.cuda.synchronize()
        return time.perf_counter() - a

    once()
    times = sorted(once() for _ in range(max(3, reps // 4)))
    return times[len(times) // 2] * 1e3


def _print_backends(cases: list[dict[str, Any]], opts: Qwen4StepOptions) -> None:
    by = {(c["linear_attention"], c["batch"]): c for c in cases}
    pre = bool(opts.prefill_tokens)
    print(
        f"\nGated DeltaNet core, torch vs kernels (HBM tables; ratio = torch / kernels)\n{'batch':>5} | "
        f"{'graph torch':>11} {'kernels':>8} {'ratio':>6} | {'floor ms':>8}"
        + (f" | {'eager torch':>11} {'kernels':>8} {'ratio':>6}" if opts.eager else "")
        + (f" | {'prefill torch':>13} {'kernels':>8} {'ratio':>6}" if pre else "")
    )
    for B in opts.batches:
        t, k = by[("torch", B)], by[("kernels", B)]
        line = (
            f"{B:>5} | {t['graph_ms']:>11.3f} {k['graph_ms']:>8.3f} {t['graph_ms'] / k['graph_ms']:>6.2f} | "
            f"{k['floor_ms']:>8.3f}"
        )
        if opts.eager:
            line += f" | {t['eager_ms']:>11.3f} {k['eager_ms']:>8.3f} {t['eager_ms'] / k['eager_ms']:>6.2f}"
        if pre:
            line += f" | {t['prefill_ms']:>13.3f} {k['prefill_ms']:>8.3f} {t['prefill_ms'] / k['prefill_ms']:>6.2f}"
        print(line)


def TableStoreFor(tables: list[Any], where: str) -> Any:  # noqa: N802 - a factory
    from engram_trt.tables.base import TableStore

    return TableStore.from_tensors(tables, [None] * len(tables)) if where == "hbm" else _pinned_store(tables)


def _floor_bytes(model: Any, cfg: Any, B: int, L: int) -> int:
    """Bytes a decode step of B sequences must read: every weight but the embedding table
    (B rows of it) with only the experts the batch can touch (all of them past E / top_k
    tokens), the slots' recurrent / conv states read and written, the K/V and indexer
    keys attended (L positions), the PLE rows."""
    total = 0
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    touched = min(1.0, 1 - (1 - k / E) ** B)
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if name.endswith("embed_tokens.weight") and model.lm_head is not None:
            nbytes = B * p.shape[1] * p.element_size()
        elif ".experts." in name:
            nbytes = nbytes * touched
        total += nbytes
    hd, kvh = cfg.head_dim, cfg.num_key_value_heads
    for _ in cfg.attention_layers:
        total += B * L * (2 * kvh * hd + cfg.indexer_head_dim) * 2
    from engram_trt.models.qwen4_exp.linear_attention import GatedDeltaNet

    shapes = GatedDeltaNet.state_shapes(cfg)
    conv = shapes["conv"][0] * shapes["conv"][1] * 2
    rec = shapes["recurrent"][0] * shapes["recurrent"][1] * shapes["recurrent"][2] * 4
    total += len(cfg.linear_layers) * B * 2 * (conv + rec)
    total += len(cfg.ple.layers) * B * cfg.ple.embed_dim * 2
    return int(total)


def _time_batch(
    torch: Any,
    model: Any,
    cfg: Any,
    B: int,
    opts: Qwen4StepOptions,
    where: str,
    limits: dict[str, float],
    graphs_cls: Any,
    decode_context: Any,
    PackedStep: Any,
) -> dict[str, Any]:  # noqa: N803
    ctx = opts.context
    cache = model.new_cache(B + 1, ctx + 64)
    graphs = graphs_cls(model, cache, B, scratch_slot=B)
    gen = torch.Generator().manual_seed(B)
    cache.context[:B] = torch.randint(3, cfg.vocab_size, (B, cache.context.shape[1]), generator=gen)

    def step() -> PackedStep:
        for s in range(B):
            cache.lengths[s] = ctx
        return PackedStep(torch.randint(3, cfg.vocab_size, (B,), generator=gen), [1] * B, [ctx] * B, list(range(B)))

    def timed(fn: Any) -> float:
        fn(step())
        torch.cuda.synchronize()
        times = []
        for _ in range(opts.reps):
            s = step()
            a = time.perf_counter()
            fn(s)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - a)
        return sorted(times)[len(times) // 2]

    out: dict[str, Any] = {"tables": where, "batch": B, "context": ctx}
    t_graph = timed(lambda s: graphs.run(s))
    if graphs.failed is not None or graphs.replays == 0:
        raise EngramError(f"the decode graphs did not replay ({graphs.failed})")
    out["graph_ms"] = t_graph * 1e3
    if opts.eager:
        out["eager_ms"] = timed(lambda s: model.forward_step(s, cache)) * 1e3
    L = decode_context(ctx + 1, cache.max_len)
    out["floor_bytes"] = _floor_bytes(model, cfg, B, L)
    out["floor_ms"] = out["floor_bytes"] / (limits["hbm_GBps"] * 1e9) * 1e3
    print(
        f"  {where} batch {B}: graph {out['graph_ms']:.3f} ms"
        + (f", eager {out['eager_ms']:.3f} ms" if opts.eager else "")
        + f", floor {out['floor_ms']:.3f} ms ({out['floor_bytes'] / 1e9:.2f} GB at {limits['hbm_GBps']:.0f} GB/s)",
        flush=True,
    )
    return out
