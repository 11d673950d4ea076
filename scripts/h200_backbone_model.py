"""The whole-model stages of scripts/h200_backbone_check.py (its docstring says what and
why): the 1.15B engram-llama's fused decoder-layer path against the unfused path and a
float32 twin, and decode-step timing of both against the weight-read bound."""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

from h200_common import RESULTS, record, say

MODEL_ARGS = argparse.Namespace(model="1b", table_gib=0.25, prefill=0, context=256)  # engram-trt bench step's shape


def rel_err(a: Any, ref: Any) -> float:
    a, ref = a.double(), ref.double()
    return float((a - ref).norm() / ref.norm())


def build_model(device: Any) -> tuple[Any, Any, dict]:
    """The bench's 1.15B model (random bf16 weights, fused at load on the GPU) with its
    tables in GPU memory."""
    from engram_trt.bench.step import build
    from engram_trt.tables.base import DeviceTables

    model, layout, tables, info = build(MODEL_ARGS, device)
    model.set_tables(DeviceTables([(r.to(device), s.to(device)) for r, s in tables], model.config.engram.quant_block))
    return model, layout, info


def backbone_weight_bytes(model: Any) -> int:
    """Bytes of every parameter but the Engram layers' (wkv, q / k weights): what a decode
    step of the backbone reads once."""
    engram = {id(p) for layer in model.model.layers if layer.engram_module is not None
              for p in layer.engram_module.parameters()}
    return sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in engram)


def check_model(model: Any, layout: Any, info: dict, seed: int) -> Any:
    """The 1.15B model's paths against its float32 twin; returns the twin (the timing
    checks its steps against it too)."""
    import torch

    from engram_trt.models.engram_llama.model import EngramLlama, model_weight_shapes
    from engram_trt.runtime.cuda_graphs import DecodeGraphs
    from engram_trt.models.step import PackedStep

    dev = model.device
    cfg = model.config
    kernels = model.backbone_ops
    fused = all(layer.self_attn.fused_weight() is not None and layer.mlp.fused_weight() is not None
                for layer in model.model.layers)
    record("1.15B model: fused projections and the kernel library selected", kernels is not None and fused,
           model.backend_name)
    names = [n for n, _ in model.named_parameters()]
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    record("1.15B model: parameter names are the checkpoint's, no weight stored twice",
           sorted(names) == sorted(model_weight_shapes(cfg)) and sum(storages.values()) == info["weight_bytes"],
           f"{len(names)} parameters in {len(storages)} allocations of {sum(storages.values()) / 2**30:.3f} GiB, "
           f"the parameters {info['weight_bytes'] / 2**30:.3f} GiB")
    twin = EngramLlama(cfg, {n: p.detach().float() for n, p in model.named_parameters()},
                       compress_lookup=model.compress_lookup, layout=layout, device=dev, dtype=torch.float32,
                       fuse_projections=False)
    twin.set_tables(model.tables)

    gen = torch.Generator().manual_seed(seed)
    lens = [37, 64, 5, 100]
    S, steps = len(lens), 3
    history = [torch.randint(2, cfg.vocab_size, (n + steps,), generator=gen) for n in lens]
    max_len = max(lens) + steps + 8
    # "fused graphs over copies": the graphs' decode attention runs SDPA on copies of the
    # slots' K/V at this small context, where by default the warp kernel reads them in place.
    # "fused graphs, lookup apart": the GPU lookup replayed in graphs of its own beside the
    # step's segments, where by default it is forked onto the side stream inside one graph of
    # the step (the same kernels).
    paths = {"unfused eager": (None, False), "fused eager": (kernels, False), "fused graphs": (kernels, True),
             "unfused graphs": (None, True), "fused graphs over copies": (kernels, True),
             "fused graphs, lookup apart": (kernels, True)}
    caches = {name: model.new_cache(S + 1, max_len) for name in paths}  # + the graphs' scratch slot
    graphs = {name: DecodeGraphs(model, caches[name], S, scratch_slot=S, tables=model.tables,
                                 fork_lookup=name != "fused graphs, lookup apart")
              for name, (_, g) in paths.items() if g}
    twin_cache = twin.new_cache(S + 1, max_len)
    lut = model.compress_lookup.cpu()
    n_back = layout.max_ngram_size - 1
    worst: dict[str, float] = {}
    for k in range(steps + 1):
        if k == 0:
            step = PackedStep(torch.cat([h[:n] for h, n in zip(history, lens)]), lens, [0] * S, list(range(S)))
            label = f"packed prefill {'+'.join(map(str, lens))}"
        else:
            past = [n + k - 1 for n in lens]
            ids = torch.stack([h[p] for h, p in zip(history, past)])
            lookback = torch.stack([lut[h[p - n_back:p]] for h, p in zip(history, past)])
            step = PackedStep(ids, [1] * S, past, list(range(S)), lookback=lookback)
            label = f"decode step {k} of {S} sequences"
        ref = twin.forward_step(step, twin_cache).float()
        logits = {}
        for name, (ops, in_graph) in paths.items():
            model.backbone_ops = ops
            with variant_settings(name):
                out = graphs[name].run(step, None) if in_graph and k > 0 else None
            if in_graph and k > 0 and out is None:
                record(f"{name}: {label} replayed from a graph", False, graphs[name].failed or "not replayed")
            logits[name] = (out if out is not None else model.forward_step(step, caches[name])).float().clone()
        model.backbone_ops = kernels
        base = rel_err(logits["unfused eager"], ref)
        if k > 0:
            same = torch.equal(logits["fused graphs"], logits["fused graphs, lookup apart"])
            record(f"1.15B {label}: the lookup forked in one graph of the step gives the separate lookup graphs' logits",
                   same and graphs["fused graphs"].handles_lookup(step),
                   f"bit-identical={same}; GPU lookup in the graphs={graphs['fused graphs'].handles_lookup(step)}")
        for name in ("fused eager", "fused graphs", "unfused graphs", "fused graphs over copies",
                     "fused graphs, lookup apart"):
            err = rel_err(logits[name], ref)
            worst[name] = max(worst.get(name, 0.0), err)
            ok = err <= 1.5 * base + 2e-3 and bool(torch.isfinite(logits[name]).all())
            record(f"1.15B {label}: {name} vs float32 twin", ok,
                   f"rel L2 {err:.3e} (unfused eager {base:.3e}; vs unfused eager "
                   f"{rel_err(logits[name], logits['unfused eager']):.3e}); argmax agrees with the twin on "
                   f"{int((logits[name].argmax(-1) == ref.argmax(-1)).sum())}/{S}")
    for name, g in graphs.items():
        record(f"1.15B decode graphs recorded and replayed ({name})", g.failed is None and g.replays == steps,
               g.failed or f"{g.replays} replays")
    RESULTS["model"] = {"worst_rel_l2_vs_float32": worst, "backend": model.backend_name}
    model.backbone_ops = kernels
    del twin_cache, graphs, caches
    torch.cuda.empty_cache()
    return twin


def count_kernels(fn: Any, breakdown: dict | None = None) -> int | None:
    """Kernels one call of ``fn`` launches (graph replays included), by the profiler.
    ``breakdown``: filled with ``{kernel name: [launches, GPU us]}`` of that call, so a
    report can say where a step's time goes (the kernels' own durations: the gaps between
    them are the rest of the step)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from engram_trt.bench.common import union_us

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                  and not e.name.lower().startswith(("memcpy", "memset"))]
        if breakdown is not None:
            for e in events:
                entry = breakdown.setdefault(e.name, [0, 0.0])
                entry[0] += 1
                entry[1] += float(e.time_range.end - e.time_range.start)
            breakdown[UNION] = [0, union_us([(e.time_range.start, e.time_range.end) for e in events])]
        return len(events) or None
    except Exception as exc:  # the count is a figure, not a check
        say(f"  (kernel count unavailable: {type(exc).__name__}: {exc})")
        return None


UNION = "(any kernel running)"  # the breakdown's entry for the union of the kernels' spans


def say_breakdown(label: str, step_ms: float, breakdown: dict, top: int = 10) -> None:
    """The kernels taking most of one step's GPU time, and what the gaps take."""
    kernels = {k: v for k, v in breakdown.items() if k != UNION}
    summed = sum(v[1] for v in kernels.values())
    busy = breakdown.get(UNION, [0, summed])[1]
    say(f"  {label}: some kernel running {busy / 1e3:.3f} ms of the {step_ms:.3f} ms step (gaps and launch latency: "
        f"{max(0.0, step_ms - busy / 1e3):.3f} ms; kernel spans summed {summed / 1e3:.3f} ms, more when they overlap); "
        "top kernels by GPU time:")
    for name, (n, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]:
        say(f"    {us:8.1f} us  {n:4d} x {us / n:6.1f} us  {name[:110]}")


# How the summary line names each variant beside the default fused step, in its order.
VARIANT_WORDS = {"fused, SDPA over copies": "with SDPA over copies of the cache",
                 "fused, GEMM library": "with the GEMM library's projections",
                 "fused, no PDL": "without dependent launches",
                 "fused, tiled attention": "with the tiled attention kernel"}


def variant_settings(name: str) -> contextlib.AbstractContextManager:
    """What a timed variant changes while its decode graph is recorded (at its first
    run), undone after: "... over copies": the graphs' attention reads the KV cache in place
    only past IN_PLACE_DECODE_BYTES, not wherever the warp kernel serves (SDPA over copies
    of the slots' K/V below it); "fused, GEMM library": the projections run
    in the GEMM library at every step size (the GEMV off); "fused, no PDL": the kernel
    library launches the ordinary way (ENGRAM_TRT_PDL=0, read at each launch); "fused,
    tiled attention": the attention kernel is the tiled one (ENGRAM_TRT_ATTENTION_KERNEL=
    tiled) where the graphs read the cache in place. The default variants change nothing."""
    import os
    from unittest import mock

    from engram_trt.models.engram_llama import modules
    from engram_trt.models.engram_llama.kernel_ops import KernelBackboneOps

    if name.endswith("over copies"):
        return mock.patch.object(modules, "IN_PLACE_WITH_WARP_KERNEL", False)
    if name == "fused, GEMM library":
        return mock.patch.object(KernelBackboneOps, "gemv_max_tokens", 0)
    if name == "fused, no PDL":
        return mock.patch.dict(os.environ, {"ENGRAM_TRT_PDL": "0"})
    if name == "fused, tiled attention":
        return mock.patch.dict(os.environ, {"ENGRAM_TRT_ATTENTION_KERNEL": "tiled"})
    return contextlib.nullcontext()


def time_variant(model: Any, cache: Any, step: Any, B: int, past: int, name: str, iters: int, bound_ms: float,
                 row: dict, last: dict) -> None:
    """One variant of a decode step from a CUDA graph: its time, kernels and logits."""
    import torch

    from engram_trt.bench.common import time_fn
    from engram_trt.runtime.cuda_graphs import DecodeGraphs

    graphs = DecodeGraphs(model, cache, B, scratch_slot=B, tables=None)

    def one() -> Any:
        for s in range(B):
            cache.lengths[s] = past
        logits = graphs.run(step, None)
        if logits is None:
            logits = model.forward_step(step, cache)
        torch.argmax(logits, dim=-1).tolist()  # the sampler's one read per step
        return logits

    t = time_fn(one, model.device, 3, iters)
    last[name] = one().float().clone()  # a graph's output buffer: the next replay overwrites it
    record(f"decode {B}: {name} step replayed from a CUDA graph", graphs.failed is None and graphs.replays > 0,
           graphs.failed or f"{graphs.replays} replays")
    breakdown: dict = {}
    row[name] = {"step_ms": t["median_s"] * 1e3, "ratio_to_bound": t["median_s"] * 1e3 / bound_ms,
                 "kernels": count_kernels(one, breakdown), "kernel_us": breakdown}
    if name.startswith("fused"):
        say_breakdown(f"decode {B} {name}", row[name]["step_ms"], breakdown)


def twin_logits(twin: Any, cache: Any, step: Any, B: int, past: int) -> Any:
    """The float32 twin's logits of ``step`` on a float32 copy of ``cache``'s keys and values
    (its Engram layers removed, as the timed model's are)."""
    twin.engram_enabled = False
    twin_cache = twin.new_cache(B + 1, cache.keys[0].shape[2])
    for dst, src in zip(twin_cache.keys + twin_cache.values, cache.keys + cache.values):
        dst.copy_(src.float())
    for s in range(B):
        twin_cache.lengths[s] = past
    return twin.forward_step(step, twin_cache).float()


def time_decode(model: Any, iters: int, batches: tuple[int, ...] = (1, 64, 256), twin: Any = None) -> None:
    import numpy as np
    import torch

    from engram_trt.bench.common import measure_limits
    from engram_trt.models.engram_llama import modules
    from engram_trt.models.step import PackedStep

    dev = model.device
    limits = measure_limits(dev)
    cfg = model.config
    kernels = model.backbone_ops
    model.engram_enabled = False  # the backbone alone: the target's denominator
    weight_bytes = backbone_weight_bytes(model)
    past = MODEL_ARGS.context
    rng = np.random.default_rng(1)
    say(f"timing: decode at context {past}, Engram layers removed; backbone weights {weight_bytes / 2**30:.2f} GiB, "
        f"HBM copy {limits['hbm_GBps']:.0f} GB/s")
    for B in batches:
        cache = model.new_cache(B + 1, past + 2)  # + the graphs' scratch slot
        for k, v in zip(cache.keys, cache.values):
            k.normal_(0, 1), v.normal_(0, 1)
        ids = rng.integers(2, cfg.vocab_size, size=B)
        step = PackedStep(torch.from_numpy(ids), [1] * B, [past] * B, list(range(B)))
        kv_bytes = 2 * cfg.num_hidden_layers * B * (past + 1) * cfg.num_key_value_heads * cfg.head_dim * 2
        bound_ms = (weight_bytes + kv_bytes) / (limits["hbm_GBps"] * 1e9) * 1e3
        row: dict[str, Any] = {"bound_ms": bound_ms}
        last = {}
        variants = [("unfused", None), ("fused", kernels)]
        if kernels is not None and B <= kernels.gemv_max_tokens:
            variants.append(("fused, GEMM library", kernels))  # the projections without the GEMV
        variants.append(("fused, no PDL", kernels))  # ordinary launches: what the dependent launches save
        kv_layer_bytes = B * cfg.num_key_value_heads * (past + 1) * cfg.head_dim * 2
        if kv_layer_bytes <= modules.IN_PLACE_DECODE_BYTES:
            # Below the threshold the graphs read the cache in place because the warp kernel
            # serves; the same fused step with SDPA over copies is what that rule decides.
            variants.append(("fused, SDPA over copies", kernels))
        else:
            variants.append(("fused, tiled attention", kernels))  # the attention kernel before the warp kernel
        for name, ops in variants:
            model.backbone_ops = ops
            with variant_settings(name):
                time_variant(model, cache, step, B, past, name, iters, bound_ms, row, last)
        rel = rel_err(last["fused"], last["unfused"])
        record(f"decode {B}: fused vs unfused logits on the timed step", rel < 3e-2, f"rel L2 {rel:.3e}")
        if twin is not None:  # every variant against the float32 twin, with section 1's bound
            ref = twin_logits(twin, cache, step, B, past)
            base = rel_err(last["unfused"], ref)
            for name in last:
                if name != "unfused":
                    err = rel_err(last[name], ref)
                    record(f"decode {B}: {name} vs the float32 twin on the timed step", err <= 1.5 * base + 2e-3,
                           f"rel L2 {err:.3e} (unfused {base:.3e}); vs unfused {rel_err(last[name], last['unfused']):.3e}")
        row["speedup"] = row["unfused"]["step_ms"] / row["fused"]["step_ms"]
        RESULTS["timing"][f"decode {B}"] = row
        say(f"  decode {B}: unfused {row['unfused']['step_ms']:.3f} ms ({row['unfused']['ratio_to_bound']:.2f}x bound), "
            f"fused {row['fused']['step_ms']:.3f} ms ({row['fused']['ratio_to_bound']:.2f}x), bound {bound_ms:.3f} ms"
            + "".join(f"; fused {what} {row[name]['step_ms']:.3f} ms ({row[name]['ratio_to_bound']:.2f}x)"
                      for name, what in VARIANT_WORDS.items() if name in row))
        cache = None
        torch.cuda.empty_cache()
    model.backbone_ops = kernels
    model.engram_enabled = True
    RESULTS["limits"] = limits


def print_table(timing: dict) -> None:
    say(f"{'case':<11} | {'bound ms':>8} | {'unfused ms':>10} | {'x bound':>7} | {'fused ms':>8} | {'x bound':>7} | "
        f"{'speedup':>7} | kernels unfused -> fused")
    for label, r in timing.items():
        u, f = r["unfused"], r["fused"]
        say(f"{label:<11} | {r['bound_ms']:8.3f} | {u['step_ms']:10.3f} | {u['ratio_to_bound']:7.2f} | "
            f"{f['step_ms']:8.3f} | {f['ratio_to_bound']:7.2f} | {r['speedup']:7.2f} | {u['kernels']} -> {f['kernels']}")
    say("bound: backbone weights + K/V read once at the HBM copy rate measured in this run; target <= 3x at batch 1")
