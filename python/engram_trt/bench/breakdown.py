"""Where one decode step's GPU time goes, by module kind: ``engram-trt bench e2e
--breakdown`` (issue 41: a per-module breakdown by CUDA events wherever a target is missed).

The step is the runtime's own recorded decode step (DeepSeek-V4 / V4.1 through
``runtime.cuda_graphs.DecodeGraphs``, Qwen4Exp through its ``decode_graphs``), with a pair
of CUDA events around every call of the model's module kinds. The events are created
``external`` while the step is being captured, so each is an event-record node of the
graph: every replay re-records them, and the spans between them are the replayed step's
GPU time per kind, without the host (an eager step's spans would hold the host's launch
time). Where a model has no decode graphs (a CPU, or a model that cannot be recorded)
the same events time eager decode steps, and the report says so.

Kinds (summed over the layers; per layer in the JSON):

* DeepSeek-V4: ``embed`` (``step_begin``: the embedding, the step's metadata, the Engram
  inputs), ``engram``, ``mhc.pre+norm`` (each collapse with the RMSNorm after it: one
  kernel chain on the fused bf16 path, :mod:`engram_trt.models.deepseek_v4.fused`),
  ``mhc.post`` (each expansion), ``mhc.post+pre+norm`` (a sublayer boundary: the expansion
  folded into the next collapse, ``engram_mhc_fold`` on the fused bf16 path),
  ``attention.sliding`` / ``.csa`` / ``.hca``, ``moe`` (router, routed and shared experts),
  ``head`` (``step_end``: the last expansion folded into the hyper head, the final norm, the
  LM head);
* Qwen4Exp: ``ple.lookup`` (the PLE hash and gather inside the graph), ``meta``, ``embed``,
  ``ple``, ``hc.mix``, ``hc.inject``, ``attention.gdn``, ``attention.qsa``, ``moe``,
  ``head.mix`` (the final mixer; the LM head's GEMM is in ``other``).

``other`` is the step (the replay's span on the stream) less the kinds: the glue between
modules (RoPE angles, casts), Qwen4Exp's LM head GEMM, the graph's launch.

``detail`` (``bench e2e --breakdown-detail``, DeepSeek-V4): spans inside the kinds, reported
apart (:func:`deepseek_details`: the fused glue's GEMV / norm-RoPE / router / experts
launches and the attention kernel's core), for choosing what to fuse next.
"""

from __future__ import annotations

import statistics
from typing import Any, Callable

_ATTN = {
    "sliding_attention": "attention.sliding",
    "compressed_sparse_attention": "attention.csa",
    "heavily_compressed_attention": "attention.hca",
}


class RegionClock:
    """CUDA-event spans of named calls (see the module docstring). ``wrap(obj, attr,
    label, layer)`` times ``obj.attr`` (an instance attribute, put back on exit);
    ``wrap_static(cls, name, label)`` a static method. Marks made while a stream is
    being captured go to :attr:`captured` (external events: graph nodes), the others to
    :attr:`eager`."""

    def __init__(self) -> None:
        import torch

        self._torch = torch
        self._undo: list[Callable[[], None]] = []
        self.captured: list[tuple[str, Any, Any, Any]] = []
        self.eager: list[tuple[str, Any, Any, Any]] = []

    def __enter__(self) -> "RegionClock":
        return self

    def __exit__(self, *exc: Any) -> None:
        while self._undo:
            self._undo.pop()()

    def _timed(self, fn: Callable[..., Any], label: str, layer: Any) -> Callable[..., Any]:
        torch = self._torch

        def call(*args: Any, **kwargs: Any) -> Any:
            capturing = torch.cuda.is_current_stream_capturing()
            a = torch.cuda.Event(enable_timing=True, external=capturing)
            b = torch.cuda.Event(enable_timing=True, external=capturing)
            a.record()
            out = fn(*args, **kwargs)
            b.record()
            (self.captured if capturing else self.eager).append((label, layer, a, b))
            return out

        return call

    def wrap(self, obj: Any, attr: str, label: str, layer: Any = None) -> None:
        had, before = attr in obj.__dict__, obj.__dict__.get(attr)
        setattr(obj, attr, self._timed(getattr(obj, attr), label, layer))
        self._undo.append(lambda: setattr(obj, attr, before) if had else obj.__dict__.pop(attr, None))

    def wrap_static(self, cls: type, name: str, label: str) -> None:
        original = cls.__dict__[name]
        setattr(cls, name, staticmethod(self._timed(original.__func__, label, None)))
        self._undo.append(lambda: setattr(cls, name, original))

    @staticmethod
    def spans(marks: list[tuple[str, Any, Any, Any]]) -> dict[str, Any]:
        """Per kind ``(ms, calls, per-layer ms)`` and the span from the first mark's start
        to the last mark's end (the events must have completed)."""
        kinds: dict[str, dict[str, Any]] = {}
        for label, layer, a, b in marks:
            k = kinds.setdefault(label, {"ms": 0.0, "calls": 0, "layers": {}})
            ms = float(a.elapsed_time(b))
            k["ms"] += ms
            k["calls"] += 1
            if layer is not None:
                k["layers"][layer] = k["layers"].get(layer, 0.0) + ms
        span = float(marks[0][2].elapsed_time(marks[-1][3])) if marks else 0.0
        return {"kinds": kinds, "span_ms": span}


def deepseek_regions(clock: RegionClock, model: Any) -> None:
    from engram_trt.models.deepseek_v4.modules import HyperConnection

    clock.wrap(model, "step_begin", "embed")
    clock.wrap(model, "step_end", "head")
    for layer in model.model.layers:
        i = layer.index
        if layer.engram is not None:
            clock.wrap(layer.engram, "forward", "engram", i)
        clock.wrap(layer.attn_hc, "collapse_normed", "mhc.pre+norm", i)
        clock.wrap(layer.ffn_hc, "collapse_normed", "mhc.pre+norm", i)
        clock.wrap(layer.attn_hc, "expand_collapse_normed", "mhc.post+pre+norm", i)
        clock.wrap(layer.ffn_hc, "expand_collapse_normed", "mhc.post+pre+norm", i)
        clock.wrap(layer.self_attn, "forward", _ATTN[layer.self_attn.layer_type], i)
        clock.wrap(layer.mlp, "forward", "moe", i)
    clock.wrap_static(HyperConnection, "expand", "mhc.post")


def deepseek_details(clock: RegionClock) -> None:
    """Spans inside the kinds (``detail:`` labels, reported apart, never summed with the
    kinds): the fused glue's launches by kernel (:mod:`engram_trt.models.deepseek_v4.fused`:
    every GEMV launch, the norm / RoPE launches, the router's picks, the experts) and the
    attention kernel's core, so a breakdown names which part of a kind took its time."""
    from engram_trt.models.deepseek_v4 import attention_kernel
    from engram_trt.native import decode

    clock.wrap(attention_kernel, "core", "detail:attention.core")
    clock.wrap(decode, "gemv_segments", "detail:gemv")
    clock.wrap(decode, "norm_rope", "detail:norm_rope")
    clock.wrap(decode, "moe_route", "detail:moe.route")
    clock.wrap(decode, "moe_experts", "detail:moe.experts")


def qwen4_regions(clock: RegionClock, model: Any, graphs: Any) -> None:
    from engram_trt.models.qwen4_exp.modules import GatedResidual

    if graphs is not None and hasattr(graphs, "_lookup"):
        clock.wrap(graphs, "_lookup", "ple.lookup")
    clock.wrap(model, "decode_views", "meta")
    clock.wrap(model.model.embed_tokens, "forward", "embed")
    for layer in model.model.layers:
        i = layer.index
        if layer.has_ple:
            clock.wrap(layer.ple, "forward_decode", "ple", i)
        clock.wrap(layer.attn_hyper_connection, "mix", "hc.mix", i)
        clock.wrap(layer.mlp_hyper_connection, "mix", "hc.mix", i)
        if layer.kind == "linear_attention":
            clock.wrap(layer.linear_attn, "forward_decode", "attention.gdn", i)
        else:
            clock.wrap(layer.self_attn, "forward_decode", "attention.qsa", i)
        clock.wrap(layer.mlp, "forward", "moe", i)
    clock.wrap(model.model.hyper_connection_mixer, "mix", "head.mix")
    clock.wrap_static(GatedResidual, "inject", "hc.inject")


def _family(model: Any) -> str:
    name = type(model).__name__
    return "deepseek-v4" if name.startswith("Deepseek") else ("qwen4-exp" if name.startswith("Qwen4") else name)


def _graphs_for(model: Any, cache: Any, backend: Any) -> Any:
    """A recorder of one-sequence decode steps over ``cache`` (slot 1 the scratch), as the
    torch backend makes them; None where the model has none."""
    if getattr(cache, "num_slots", 0) < 2 or not model.supports_decode_graphs:
        return None
    own = model.decode_graphs(cache, 1, scratch_slot=1)  # the model's own recorder (Qwen4Exp), else the runtime's
    if own is not None:
        return own
    from engram_trt.runtime.cuda_graphs import DecodeGraphs

    policy = backend.lookup_policy
    return DecodeGraphs(
        model, cache, 1, scratch_slot=1, tables=model.tables, lookup_policy=(lambda n: policy(n)) if policy else None
    )


def decode_breakdown(
    folder: Any,
    *,
    device: str,
    dtype: str,
    prompt_tokens: int,
    reps: int,
    max_seq_len: int | None = None,
    detail: bool = False,
) -> dict[str, Any]:
    """The breakdown of ``reps`` decode steps of one sequence after a prompt of
    ``prompt_tokens`` (module docstring): medians per kind, ``mode`` graph or eager.
    ``detail`` (DeepSeek-V4): also the spans of :func:`deepseek_details` (more event nodes
    in the graph: the kinds' own times grow by their cost)."""
    import torch

    from engram_trt import LLM
    from engram_trt.models.step import PackedStep

    if torch.device(device).type != "cuda":
        return {"skipped": "no CUDA device (the breakdown times CUDA events)"}
    max_len = max_seq_len or prompt_tokens + reps + 8
    with LLM(
        str(folder), backend="torch", device=device, dtype=dtype, max_batch_size=1, max_seq_len=max_len, progress=False
    ) as llm:
        backend = llm.runner.backend
        model = backend.model
        family = _family(model)
        if family not in ("deepseek-v4", "qwen4-exp"):
            return {"skipped": f"no breakdown for {family} (DeepSeek-V4 and Qwen4Exp only)"}
        if model.config.engram is not None:
            return {"skipped": "V4.1's staged rows need the runtime's prefetcher: time a V4 folder"}
        cache = model.new_cache(2, max_len)
        graphs = _graphs_for(model, cache, backend) if model.device.type == "cuda" else None
        vocab = int(model.config.vocab_size)
        prompt = [(17 * i + 5) % max(vocab - 3, 1) + 3 for i in range(prompt_tokens)]
        clock = RegionClock()
        samples: list[dict[str, Any]] = []
        totals: list[float] = []
        mode = "graph" if graphs is not None else "eager"
        with clock:
            (deepseek_regions(clock, model) if family == "deepseek-v4" else qwen4_regions(clock, model, graphs))
            if detail and family == "deepseek-v4":
                deepseek_details(clock)
            model.forward_step(PackedStep(torch.tensor(prompt), [prompt_tokens], [0], [0]), cache)
            past = prompt_tokens
            tok = 7
            for _ in range(reps + 1):  # the first step records the graph (or warms the eager path)
                step = PackedStep(torch.tensor([tok]), [1], [past], [0])
                clock.eager.clear()
                captures, n0 = getattr(graphs, "captures", 0), len(clock.captured)
                cuda = model.device.type == "cuda"
                if cuda:
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                logits = graphs.run(step, None) if graphs is not None else None
                if logits is None:
                    if graphs is not None:
                        mode = f"eager (graphs off: {graphs.failed})"
                        graphs = None
                    logits = model.forward_step(step, cache)
                if cuda:
                    b.record()
                    torch.cuda.synchronize()
                    totals.append(float(a.elapsed_time(b)))
                if graphs is not None and graphs.captures != captures:
                    del clock.captured[:n0]  # a new graph was recorded (a new context bucket): its marks count
                tok = int(logits[0].argmax())
                past += 1
                marks = clock.captured if graphs is not None else list(clock.eager)
                if marks and cuda:
                    samples.append(RegionClock.spans(marks))
        samples, totals = samples[1:], totals[1:]  # the first: capture / warm-up
    if not samples:
        return {"skipped": "no decode step was timed", "family": family}
    med = statistics.median
    labels = list(dict.fromkeys(k for s in samples for k in s["kinds"]))
    kinds = {
        k: {
            "ms": med(s["kinds"].get(k, {"ms": 0.0})["ms"] for s in samples),
            "calls": samples[0]["kinds"].get(k, {"calls": 0})["calls"],
            "per_layer_ms": {
                str(i): med(s["kinds"][k]["layers"].get(i, 0.0) for s in samples)
                for i in samples[0]["kinds"].get(k, {"layers": {}})["layers"]
            },
        }
        for k in labels
    }
    details = {
        k[len("detail:") :]: {"ms": v["ms"], "calls": v["calls"]} for k, v in kinds.items() if k.startswith("detail:")
    }
    kinds = {k: v for k, v in kinds.items() if not k.startswith("detail:")}
    span = med(s["span_ms"] for s in samples)
    step = med(totals) if totals else span
    whole = max(step, span)
    kinds["other"] = {"ms": max(whole - sum(v["ms"] for v in kinds.values()), 0.0), "calls": 0, "per_layer_ms": {}}
    for v in kinds.values():
        v["share"] = v["ms"] / whole if whole > 0 else 0.0
    out = {
        "family": family,
        "mode": mode,
        "steps": len(samples),
        "step_ms": step,
        "span_ms": span,
        "kinds": kinds,
        "order": sorted(kinds, key=lambda k: -kinds[k]["ms"]),
    }
    if details:
        out["detail"] = details
    return out


def format_breakdown(b: dict[str, Any]) -> list[str]:
    if "skipped" in b:
        return [f"breakdown: skipped ({b['skipped']})"]
    lines = [
        f"breakdown of one decode step ({b['mode']}, median of {b['steps']}): step {b['step_ms']:.3f} ms on the "
        f"GPU, {b['span_ms']:.3f} ms from the first module to the last"
    ]
    for k in b["order"]:
        v = b["kinds"][k]
        lines.append(f"  {k:18} {v['ms']:8.3f} ms {100 * v['share']:5.1f}%  ({v['calls']} calls)")
    if b.get("detail"):
        lines.append("  inside the kinds (spans of the fused kernels and the attention core; not added above):")
        for k, v in sorted(b["detail"].items(), key=lambda kv: -kv[1]["ms"]):
            lines.append(f"    {k:18} {v['ms']:8.3f} ms  ({v['calls']} calls)")
    return lines


__all__ = [
    "RegionClock",
    "decode_breakdown",
    "deepseek_details",
    "deepseek_regions",
    "format_breakdown",
    "qwen4_regions",
]
