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

The kernel profile (``bench e2e --breakdown-kernels``, :func:`decode_kernel_profile`): the
same step with no events in it (each event pair costs GPU time of its own: a step measures
more with the breakdown's events than without), its kernels', copies' and memsets' own GPU
durations as the CUDA profiler (CUPTI, through ``torch.profiler``) records them; CUPTI
records each kernel a graph replays. Per step: the kernels by name
(:func:`kernel_short_name`), their busy time, the span from the first kernel's start to
the last one's end, and the idle time between them (:func:`summarize_kernels`).
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

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


def _graphs_for(model: Any, cache: Any, backend: Any, seqs: int = 1) -> Any:
    """A recorder of ``seqs``-sequence decode steps over ``cache`` (slot ``seqs`` the
    scratch), as the torch backend makes them; None where the model has none."""
    if getattr(cache, "num_slots", 0) < seqs + 1 or not model.supports_decode_graphs:
        return None
    own = model.decode_graphs(cache, seqs, scratch_slot=seqs)  # the model's own recorder (Qwen4Exp), else the runtime's
    if own is not None:
        return own
    from engram_trt.runtime.cuda_graphs import DecodeGraphs

    policy = backend.lookup_policy
    return DecodeGraphs(
        model,
        cache,
        seqs,
        scratch_slot=seqs,
        tables=model.tables,
        lookup_policy=(lambda n: policy(n)) if policy else None,
    )


def _prompt_token(i: int, vocab: int) -> int:
    """The made prompt's ``i``-th token id (and the kernel profile's decode tokens after it)."""
    return (17 * i + 5) % max(vocab - 3, 1) + 3


@contextmanager
def _sequences(
    folder: Any, *, device: str, dtype: str, max_len: int, what: str, seqs: int = 1
) -> Iterator[tuple[Any, Any, Any, str] | dict[str, Any]]:
    """``(model, cache, graphs, family)`` of ``folder`` on the torch backend for ``seqs``
    sequences (one by default) of at most ``max_len`` tokens in slots 0..seqs-1 (``graphs``:
    :func:`_graphs_for`, None off CUDA), or the ``{"skipped": ...}`` of a model ``what``
    (the breakdown, the kernel profile) does not time."""
    from engram_trt import LLM

    with LLM(
        str(folder),
        backend="torch",
        device=device,
        dtype=dtype,
        max_batch_size=seqs,
        max_seq_len=max_len,
        progress=False,
    ) as llm:
        backend = llm.runner.backend
        model = backend.model
        family = _family(model)
        if family not in ("deepseek-v4", "qwen4-exp"):
            yield {"skipped": f"no {what} for {family} (DeepSeek-V4 and Qwen4Exp only)"}
        elif model.config.engram is not None:
            yield {"skipped": "V4.1's staged rows need the runtime's prefetcher: time a V4 folder"}
        else:
            cache = model.new_cache(seqs + 1, max_len)
            graphs = _graphs_for(model, cache, backend, seqs) if model.device.type == "cuda" else None
            yield model, cache, graphs, family


def _prefill(model: Any, cache: Any, prompt_tokens: int, seqs: int = 1) -> int:
    """The made prompt of ``prompt_tokens`` tokens (:func:`_prompt_token`) prefilled into slots
    0..seqs-1 of ``cache`` (one packed step); returns the model's vocabulary size."""
    import torch

    from engram_trt.models.step import PackedStep

    vocab = int(model.config.vocab_size)
    prompt = [_prompt_token(i, vocab) for i in range(prompt_tokens)]
    model.forward_step(
        PackedStep(torch.tensor(prompt * seqs), [prompt_tokens] * seqs, [0] * seqs, list(range(seqs))), cache
    )
    return vocab


def _timed_step(model: Any, cache: Any, graphs: Any, step: Any) -> tuple[Any, float, str | None]:
    """``(logits, ms, off)`` of one decode ``step``: replayed by ``graphs`` (None: eager; a
    step they cannot replay runs eagerly too), ``ms`` between CUDA events around the whole
    call; ``off`` why the graphs turned off at this step (then the caller drops them), else None."""
    import torch

    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    off = None
    logits = graphs.run(step, None) if graphs is not None else None
    if logits is None:
        if graphs is not None:
            off = f"eager (graphs off: {graphs.failed})"
        logits = model.forward_step(step, cache)
    b.record()
    torch.cuda.synchronize()
    return logits, float(a.elapsed_time(b)), off


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

    from engram_trt.models.step import PackedStep

    if torch.device(device).type != "cuda":
        return {"skipped": "no CUDA device (the breakdown times CUDA events)"}
    max_len = max_seq_len or prompt_tokens + reps + 8
    with _sequences(folder, device=device, dtype=dtype, max_len=max_len, what="breakdown") as got:
        if isinstance(got, dict):
            return got
        model, cache, graphs, family = got
        clock = RegionClock()
        samples: list[dict[str, Any]] = []
        totals: list[float] = []
        mode = "graph" if graphs is not None else "eager"
        with clock:
            (deepseek_regions(clock, model) if family == "deepseek-v4" else qwen4_regions(clock, model, graphs))
            if detail and family == "deepseek-v4":
                deepseek_details(clock)
            _prefill(model, cache, prompt_tokens)
            past = prompt_tokens
            tok = 7
            for _ in range(reps + 1):  # the first step records the graph (or warms the eager path)
                step = PackedStep(torch.tensor([tok]), [1], [past], [0])
                clock.eager.clear()
                captures, n0 = getattr(graphs, "captures", 0), len(clock.captured)
                logits, ms, off = _timed_step(model, cache, graphs, step)
                totals.append(ms)
                if off is not None:
                    mode, graphs = off, None
                if graphs is not None and graphs.captures != captures:
                    del clock.captured[:n0]  # a new graph was recorded (a new context bucket): its marks count
                tok = int(logits[0].argmax())
                past += 1
                marks = clock.captured if graphs is not None else list(clock.eager)
                if marks:
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


# ---------------------------------------------------------------------------- the kernel profile
DEVICE_ACTIVITIES = ("kernel", "gpu_memcpy", "gpu_memset")  # the profiler's activity types of GPU work
NOT_WORK = ("gpu_user_annotation", "cuda_sync", "cuda_profiler_range")  # device-side records that are not work
SHORT_NAME_CHARS = 60
_GENERIC = {"Kernel", "Kernel2", "device_kernel", "kernel", "global_kernel"}  # cutlass' wrappers: name the argument


def _split_top(name: str) -> tuple[str, str | None, str]:
    """``(head, template, rest)`` of a demangled name: ``head`` the text before the first
    ``<`` or ``(`` outside brackets, ``template`` the bracketed arguments after it (None
    without), ``rest`` what follows them."""
    for i, c in enumerate(name):
        if c in "<(":
            if c == "(":
                return name[:i], None, name[i:]
            depth = 0
            for j in range(i, len(name)):
                depth += name[j] in "<(["
                depth -= name[j] in ">)]"
                if depth == 0:
                    return name[:i], name[i + 1 : j], name[j + 1 :]
            return name[:i], name[i + 1 :], ""
    return name, None, ""


def _first_argument(args: str) -> str:
    depth = 0
    for i, c in enumerate(args):
        depth += c in "<(["
        depth -= c in ">)]"
        if c == "," and depth == 0:
            return args[:i]
    return args


def kernel_short_name(name: str) -> str:
    """The function name of a demangled kernel name, without its return type, namespaces,
    template arguments and argument list: ``void ns::(anonymous namespace)::fooKernel<float,
    3>(float*, int)`` -> ``fooKernel``; a cutlass wrapper (``cutlass::Kernel2<G>(...)``,
    ``cutlass::device_kernel<G>``) by its first template argument ``G``'s short name; at most
    :data:`SHORT_NAME_CHARS` characters (cuBLAS' long names without arguments are cut).
    Copies and memsets (``Memcpy HtoD (Pinned -> Device)``, ``Memset (Device)``) keep their
    names."""
    n = name.strip()
    if n.startswith(("Memcpy", "Memset")):
        return n
    n = n.replace("(anonymous namespace)", "{anonymous}")
    # the qualified name: the last word of the text outside brackets before the argument list
    outside, rest, last_args = "", n, None
    while rest:
        head, args, rest = _split_top(rest)
        outside += head
        if args is None:
            break
        outside += "<>"
        last_args = args
    words = outside.split()
    qualified = words[-1] if words else n
    short = qualified.split("::")[-1]
    template = short.endswith("<>")
    short = short.removesuffix("<>")
    if short in _GENERIC and template and last_args:
        inner = kernel_short_name(_first_argument(last_args))
        short = inner or short
    return (short or n)[:SHORT_NAME_CHARS]


def device_records(events: Iterable[Any]) -> tuple[list[tuple[str, float, float]], list[str]]:
    """``[(name, start_us, duration_us)]`` of the GPU work among a profile's events
    (``torch.profiler.profile.events()``: ``FunctionEvent`` with ``activity_type`` one of
    :data:`DEVICE_ACTIVITIES`, or any other on a CUDA ``device_type`` but
    :data:`NOT_WORK`'s; ``time_range`` in microseconds), and every activity type seen (for
    a report when none is GPU work)."""
    from torch.autograd import DeviceType

    out: list[tuple[str, float, float]] = []
    seen: dict[str, None] = {}
    for e in events:
        kind = str(getattr(e, "activity_type", None))
        seen[kind] = None
        if kind in DEVICE_ACTIVITIES or (e.device_type == DeviceType.CUDA and kind not in NOT_WORK):
            out.append((str(e.name), float(e.time_range.start), float(e.time_range.elapsed_us())))
    return out, list(seen)


def summarize_kernels(records: list[tuple[str, float, float]], reps: int) -> dict[str, Any]:
    """Per-step figures of the GPU work of ``reps`` decode steps, ``records`` ``(name,
    start_us, duration_us)`` in any order. The steps are told apart by the ``reps - 1``
    widest gaps between one record's start and the end of all before it (the steps are
    run apart: the profile sleeps between them). Returns ``busy_ms`` (the durations' sum
    per step), ``span_ms`` (the first start to the last end, the mean over the steps),
    ``idle_ms`` (span - busy: the launch gaps; below 0 where work overlapped),
    ``kernels`` ``{short name: {"calls", "ms", "us_each", "full"}}`` (per step: calls and
    ms over ``reps``; ``us_each`` the mean of one; ``full`` the distinct full names) and
    ``order`` (the names by ms, most first)."""
    if reps < 1:
        raise ValueError(f"reps {reps}: at least 1")
    if len(records) < reps:
        raise ValueError(f"{len(records)} GPU records for {reps} steps: at least one a step")
    rows = sorted(records, key=lambda r: (r[1], r[1] + r[2]))
    gaps = []
    end = rows[0][1] + rows[0][2]
    for i in range(1, len(rows)):
        gaps.append((rows[i][1] - end, i))
        end = max(end, rows[i][1] + rows[i][2])
    cuts = sorted(i for _, i in sorted(gaps, key=lambda g: (-g[0], g[1]))[: reps - 1])
    bounds = [0, *cuts, len(rows)]
    spans = []
    for a, b in zip(bounds, bounds[1:]):
        step = rows[a:b]
        spans.append(max(r[1] + r[2] for r in step) - step[0][1])
    kernels: dict[str, dict[str, Any]] = {}
    full: dict[str, dict[str, None]] = {}
    busy = 0.0
    for name, _, dur in rows:
        short = kernel_short_name(name)
        k = kernels.setdefault(short, {"calls": 0, "us": 0.0})
        k["calls"] += 1
        k["us"] += dur
        full.setdefault(short, {})[name] = None
        busy += dur
    out_kernels = {
        short: {
            "calls": k["calls"] / reps,
            "ms": k["us"] / reps / 1e3,
            "us_each": k["us"] / k["calls"],
            "full": list(full[short]),
        }
        for short, k in kernels.items()
    }
    span_ms = sum(spans) / reps / 1e3
    busy_ms = busy / reps / 1e3
    return {
        "busy_ms": busy_ms,
        "span_ms": span_ms,
        "idle_ms": span_ms - busy_ms,
        "kernels": out_kernels,
        "order": sorted(out_kernels, key=lambda k: (-out_kernels[k]["ms"], k)),
    }


def _profile_window(step: Callable[[], float], reps: int) -> tuple[list[float], Any]:
    """``reps`` calls of ``step`` (each returns its CUDA-event milliseconds) inside one CUDA
    profile, 2 ms apart so that :func:`summarize_kernels` tells the steps apart: (the
    calls' figures, the profile)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    totals = []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(reps):
            if i:
                time.sleep(0.002)  # the steps apart on the GPU's timeline
            totals.append(step())
        torch.cuda.synchronize()
    return totals, prof


def step_kernel_profile(step: Callable[[], Any], reps: int, device: Any, mode: str) -> dict[str, Any]:
    """The GPU work of ``reps`` calls of ``step`` (one decode step each, whatever it runs:
    ``bench dsv4-step``'s replay) as :func:`decode_kernel_profile` reports a folder's, after
    one warm-up call; ``step_ms`` the median of the calls' CUDA-event spans, ``mode`` as
    given. A skip (``{"skipped": why}``) off CUDA or when the profile holds no GPU record."""
    import torch

    if torch.device(device).type != "cuda":
        return {"skipped": "no CUDA device (the kernel profile reads the GPU's kernel records)"}

    def timed() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end))

    timed()
    totals, prof = _profile_window(timed, reps)
    records, seen = device_records(prof.events())
    if len(records) < reps:
        why = f"{len(records)} GPU records in {reps} steps (the profile's activity types: {', '.join(seen)})"
        return {"skipped": why}
    return {"mode": mode, "steps": reps, "step_ms": statistics.median(totals), **summarize_kernels(records, reps)}


def decode_kernel_profile(
    folder: Any,
    *,
    device: str,
    dtype: str,
    prompt_tokens: int,
    reps: int,
    max_seq_len: int | None = None,
    seqs: int = 1,
) -> dict[str, Any]:
    """The GPU work of ``reps`` decode steps of ``seqs`` sequences (one by default; ``bench
    e2e --breakdown-streams``) after a prompt of ``prompt_tokens`` each, as the CUDA profiler
    records it (module docstring): the steps of :func:`decode_breakdown` (the model's
    recorded step, eager where it has none) with no events inside, after two warm-up
    steps (the first records the graph). The decode tokens are the made prompt's sequence
    continued (no argmax between the steps: its kernels would count), and the steps sleep
    2 ms apart so that :func:`summarize_kernels` tells them apart. ``step_ms``: the median
    of the profiled steps' CUDA-event spans around the whole call (the input copies and
    the replay)."""
    import torch

    from engram_trt.models.step import PackedStep

    if torch.device(device).type != "cuda":
        return {"skipped": "no CUDA device (the kernel profile reads the GPU's kernel records)"}

    tries = 3  # a window in which a new graph was recorded (a new context bucket) is run again
    max_len = max_seq_len or prompt_tokens + 2 + tries * reps + 8
    with _sequences(folder, device=device, dtype=dtype, max_len=max_len, what="kernel profile", seqs=seqs) as got:
        if isinstance(got, dict):
            return got
        model, cache, graphs, family = got
        vocab = _prefill(model, cache, prompt_tokens, seqs)
        state: dict[str, Any] = {"past": prompt_tokens, "graphs": graphs, "mode": "graph" if graphs else "eager"}

        def step() -> float:
            past = state["past"]
            s = PackedStep(
                torch.tensor([_prompt_token(past, vocab)] * seqs), [1] * seqs, [past] * seqs, list(range(seqs))
            )
            _, ms, off = _timed_step(model, cache, state["graphs"], s)
            if off is not None:
                state["mode"], state["graphs"] = off, None
            state["past"] = past + 1
            return ms

        step()  # records the graph (or warms the eager path)
        step()
        for _ in range(tries):
            captures = getattr(state["graphs"], "captures", 0)
            totals, prof = _profile_window(step, reps)
            if getattr(state["graphs"], "captures", 0) == captures:
                break
        else:
            return {"skipped": f"a new decode graph was recorded in each of {tries} profiled windows", "family": family}
        records, seen = device_records(prof.events())
    if len(records) < reps:
        why = f"{len(records)} GPU records in {reps} steps (the profile's activity types: {', '.join(seen)})"
        return {"skipped": why, "family": family}
    return {
        "family": family,
        "mode": state["mode"],
        "sequences": seqs,
        "steps": reps,
        "step_ms": statistics.median(totals),
        **summarize_kernels(records, reps),
    }


def format_kernel_profile(p: dict[str, Any], top: int = 25) -> list[str]:
    """The printed table of :func:`decode_kernel_profile`: the step's figures, then the
    ``top`` kernels by GPU time a step (calls a step, ms a step, us each, share of busy)."""
    if "skipped" in p:
        return [f"kernel profile: skipped ({p['skipped']})"]
    busy = p["busy_ms"]
    seqs = f" of {p['sequences']} sequences" if p.get("sequences", 1) > 1 else ""
    lines = [
        f"kernels of one decode step{seqs} ({p['mode']}, mean of {p['steps']}): "
        f"step {p['step_ms']:.3f} ms (CUDA events), "
        f"kernels busy {busy:.3f} ms, first start to last end {p['span_ms']:.3f} ms, idle {p['idle_ms']:.3f} ms",
        f"  {'kernel':{SHORT_NAME_CHARS}} {'calls':>7} {'ms':>8} {'us each':>8} {'busy':>6}",
    ]
    for name in p["order"][:top]:
        k = p["kernels"][name]
        share = 100 * k["ms"] / busy if busy > 0 else 0.0
        lines.append(f"  {name:{SHORT_NAME_CHARS}} {k['calls']:7.2f} {k['ms']:8.3f} {k['us_each']:8.2f} {share:5.1f}%")
    rest = p["order"][top:]
    if rest:
        ms = sum(p["kernels"][n]["ms"] for n in rest)
        lines.append(f"  ({len(rest)} more kernels: {ms:.3f} ms)")
    return lines


__all__ = [
    "DEVICE_ACTIVITIES",
    "NOT_WORK",
    "RegionClock",
    "decode_breakdown",
    "decode_kernel_profile",
    "deepseek_details",
    "deepseek_regions",
    "device_records",
    "format_breakdown",
    "format_kernel_profile",
    "kernel_short_name",
    "qwen4_regions",
    "step_kernel_profile",
    "summarize_kernels",
]
