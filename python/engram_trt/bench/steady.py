"""``engram-trt bench steady``: the steady decode rate that ``engram-trt demo`` and
``engram-trt run`` print, beside ``bench serve``'s one-stream figure on the same engine
folder, and their ratio (issue 32's target: within 1.2x either way).

Why subprocesses: the figures compared are the ones a user sees, so each comes from
the command itself (``demo --json``, ``run --json``, ``bench serve --json``), each in a
fresh process with its own load, warm-up and CUDA-graph capture, on this machine, in
one go. ``--path`` skips the demo and compares ``run PATH`` with ``bench serve PATH``
(a checkpoint or engine folder of any model).

What differs between the two on purpose: ``run`` / ``demo`` report one over the median
decode step after the first two (warm-up, graph capture: ``steady_decode``), while
``bench serve`` counts one request's new tokens over its whole time after a warm-up
batch, prefill included; with ``--max-tokens`` the same for both, the prefill step is
the only extra in the latter. So that the two are also set side by side measured the
same way, ``bench serve`` reports its one-stream request's steady rate too (the same
``steady_decode``), and ``ratios`` holds both quotients.

Why ``run`` runs ``--runs`` times: ``demo`` and ``run`` on one folder take the same
code path (``cli.generate.generate_text``) and decode the same greedy tokens, yet on the
H200 VM their rates differ from process to process (3,333 and 2,194 tokens/s in one go,
docs/benchmarks.md), while ``bench serve`` takes the fastest of ``--repeat`` runs after a
warm-up batch. One ``run`` against the best of three is not one measurement against
another; the median of ``--runs`` fresh ``run`` processes is (each one's figures are
kept, with the decode path its graphs took and its gather calibration, to tell a slower
process's cause).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engram_trt.bench.options import opt

TARGET = 1.2  # issue 32, item 5: steady rate within this factor of bench serve's one stream


@dataclass(kw_only=True)
class SteadyOptions:
    """``engram-trt bench steady``'s flags."""

    path: str | None = opt(None, metavar="PATH", help="compare `run PATH` with `bench serve PATH` and skip the demo "
                                                     "(default: build and run `engram-trt demo`, then use its engine folder)")
    model: str = opt("random", choices=("random", "smollm2"), help="the demo's --model (default: %(default)s)")
    engine_dir: str | None = opt(None, metavar="DIR", help="the demo's --engine-dir (default: the demo's own)")
    max_tokens: int = opt(256, argtype=("int_arg", 4, 4096),
                          help="new tokens per request in all three (default: %(default)s; at least 4, so steady steps exist; "
                               "a few hundred, so the steady window is more than ~0.1 s on a GPU)")
    prompt_tokens: int = opt(32, argtype=("int_arg", 1, 4096), help="bench serve's prompt tokens (default: %(default)s)")
    repeat: int = opt(3, argtype=("int_arg", 1, 100), help="bench serve's runs; the fastest counts (default: %(default)s)")
    runs: int = opt(3, argtype=("int_arg", 1, 20),
                    help="`run` commands, each a fresh process; their median steady rate counts (default: %(default)s)")
    device: str = opt("auto", help="cpu, cuda, cuda:N or auto, for all three (default: %(default)s)")
    backend: str = opt("auto", choices=("auto", "tensorrt", "torch"), help="runtime backend for all three (default: %(default)s)")
    json: str | None = opt(None, metavar="FILE", help="write the figures as JSON to FILE")


def _cli(args: list[str], what: str) -> tuple[str, float]:
    """Run ``engram-trt ARGS`` in a fresh interpreter; its stdout and seconds. A failure
    raises one line with the command's last error line."""
    from engram_trt.errors import EngramError

    cmd = [sys.executable, "-m", "engram_trt", *args]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise EngramError(f"bench steady: `engram-trt {' '.join(args)}` ({what}) exited {proc.returncode}: {last}")
    return proc.stdout, dt


def _generation_figures(res: dict[str, Any], seconds: float) -> dict[str, Any]:
    tm = res.get("timings", {})
    keep = ("steady_decode_tokens_per_s", "steady_decode_steps", "decode_warmup_s", "decode_tokens_per_s", "prefill_s",
            "load_s", "graph_capture_s", "graph_captures", "steady_decode_first_half_tokens_per_s",
            "steady_decode_second_half_tokens_per_s", "graph_shapes", "gather_path_by_rows")
    return {"backend": res.get("backend"), "device": res.get("device"), "dtype": res.get("dtype"),
            "new_tokens": res.get("new_tokens"), "finish_reason": res.get("finish_reason"),
            **{k: tm[k] for k in keep if k in tm}, "command_s": round(seconds, 2)}


def ratio_report(steady: float | None, serve_one: float | None, target: float = TARGET) -> dict[str, Any]:
    """``serve_one / steady`` and whether it is within ``target`` either way."""
    if not steady or not serve_one:
        return {"serve_over_steady": None, "within_target": None}
    r = serve_one / steady
    return {"serve_over_steady": round(r, 4), "within_target": max(r, 1 / r) <= target}


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run whose steady rate is the median of ``runs`` (the lower middle one of an
    even count), with every run's figures under ``runs`` when there are several."""
    ranked = sorted(runs, key=lambda r: r.get("steady_decode_tokens_per_s") or 0.0)
    mid = dict(ranked[(len(ranked) - 1) // 2])
    if len(runs) > 1:
        mid["runs"] = runs
    return mid


def run(opts: SteadyOptions) -> int:
    from engram_trt.bench.common import dump
    from engram_trt.errors import EngramError

    common = ["--device", opts.device, "--backend", opts.backend]
    gen = ["--max-new-tokens", str(opts.max_tokens), "--ignore-eos", "--json", *common]
    res: dict[str, Any] = {"target": TARGET, "max_tokens": opts.max_tokens, "commands": []}
    if opts.path is None:
        args = ["demo", "--model", opts.model, *gen] + (["--engine-dir", opts.engine_dir] if opts.engine_dir else [])
        out, dt = _cli(args, "the demo")
        demo = json.loads(out)
        path = (demo.get("engine") or {}).get("output_dir")
        if not path:
            raise EngramError("bench steady: the demo's JSON names no engine folder (engine.output_dir)")
        res["commands"].append("engram-trt " + " ".join(args))
        res["demo"] = _generation_figures(demo, dt)
    else:
        path = opts.path
    res["path"] = str(path)
    args = ["run", str(path), *gen]
    runs = []
    for _ in range(opts.runs):
        out, dt = _cli(args, "run")
        runs.append(_generation_figures(json.loads(out), dt))
    res["commands"].append("engram-trt " + " ".join(args) + (f"  (x{opts.runs})" if opts.runs > 1 else ""))
    res["run"] = median_run(runs)
    with tempfile.TemporaryDirectory(prefix="engram-steady-") as tmp:
        figures = Path(tmp) / "serve.json"
        args = ["bench", "serve", str(path), "--concurrency", "1", "--max-tokens", str(opts.max_tokens),
                "--prompt-tokens", str(opts.prompt_tokens), "--repeat", str(opts.repeat), "--json", str(figures), *common]
        _out, dt = _cli(args, "bench serve")
        serve = json.loads(figures.read_text())
    res["commands"].append("engram-trt " + " ".join(args))
    one = (serve.get("levels") or {}).get("1") or {}
    res["bench_serve"] = {"backend": serve.get("backend"), "one_stream_tokens_per_s": one.get("tokens_per_s"),
                          "one_stream_steady_decode_tokens_per_s": one.get("steady_decode_tokens_per_s"),
                          "steps": one.get("steps"), "command_s": round(dt, 2)}
    serve_one = one.get("tokens_per_s")
    res["ratios"] = {}
    for name in ("demo", "run"):
        if name in res:
            steady = res[name].get("steady_decode_tokens_per_s")
            res["ratios"][name] = {**ratio_report(steady, serve_one),  # the figure: tokens/s of a whole request
                                   "serve_steady_over_steady": ratio_report(
                                       steady, one.get("steady_decode_tokens_per_s"))["serve_over_steady"]}
    print(f"engine folder: {path}")
    for name in ("demo", "run"):
        if name in res:
            r, q = res[name], res["ratios"][name]
            print(f"{name:>5}: {r.get('steady_decode_tokens_per_s')} tokens/s steady ({r.get('backend')}, {r.get('device')}, "
                  f"{r.get('dtype')}; warm-up {r.get('decode_warmup_s')} s, capture {r.get('graph_capture_s', 0)} s); "
                  f"bench serve / {name} = {q['serve_over_steady']} (within {TARGET}x: {q['within_target']})")
    if len(runs) > 1:
        print(f"  run: {len(runs)} processes, steady {', '.join(str(r.get('steady_decode_tokens_per_s')) for r in runs)} "
              f"tokens/s (the median counts)")
    print(f"bench serve, one stream: {serve_one:.1f} tokens/s, steady {one.get('steady_decode_tokens_per_s')} tokens/s "
          f"({serve.get('backend')})" if serve_one else "bench serve, one stream: no figure")
    dump(res, opts.json)
    return 0
