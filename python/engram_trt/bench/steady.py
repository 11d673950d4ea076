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

Why rounds: ``demo`` and ``run`` on one folder take the same code path
(``cli.generate.generate_text``) and decode the same greedy tokens, yet on the H200 VM
their rates differ from process to process (``run`` 2,194 to 3,382 tokens/s on one
machine, docs/benchmarks.md), and one process's two halves by up to 1.4x: the host's
speed drifts. One ``demo`` against a ``bench serve`` started a minute later compares
two moments of that drift, not two commands. So each of ``--rounds`` rounds runs the
demo, ``run`` and ``bench serve`` back to back (fresh processes, that order); a round's
ratios compare neighbours in time, every round is kept (with the decode path its graphs
took and its gather calibration, to tell a slower process's cause), and the verdict is
on the median figures over the rounds (the lower middle one of an even count).
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

    path: str | None = opt(
        None,
        metavar="PATH",
        help="compare `run PATH` with `bench serve PATH` and skip the demo "
        "(default: build and run `engram-trt demo`, then use its engine folder)",
    )
    model: str = opt("random", choices=("random", "smollm2"), help="the demo's --model (default: %(default)s)")
    engine_dir: str | None = opt(None, metavar="DIR", help="the demo's --engine-dir (default: the demo's own)")
    max_tokens: int = opt(
        256,
        argtype=("int_arg", 4, 4096),
        help="new tokens per request in all three (default: %(default)s; at least 4, so steady steps exist; "
        "a few hundred, so the steady window is more than ~0.1 s on a GPU)",
    )
    prompt_tokens: int = opt(
        32, argtype=("int_arg", 1, 4096), help="bench serve's prompt tokens (default: %(default)s)"
    )
    repeat: int = opt(
        3, argtype=("int_arg", 1, 100), help="bench serve's runs; the fastest counts (default: %(default)s)"
    )
    rounds: int = opt(
        3,
        argtype=("int_arg", 1, 20),
        flags=("--rounds", "--runs"),
        help="rounds of demo, run and bench serve, each command a fresh process, back to back; the "
        "median figures over the rounds count, every round's ratios are kept (default: %(default)s; "
        "--runs is the old spelling)",
    )
    device: str = opt("auto", help="cpu, cuda, cuda:N or auto, for all three (default: %(default)s)")
    backend: str = opt(
        "auto", choices=("auto", "tensorrt", "torch"), help="runtime backend for all three (default: %(default)s)"
    )
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
    keep = (
        "steady_decode_tokens_per_s",
        "steady_decode_steps",
        "decode_warmup_s",
        "decode_tokens_per_s",
        "prefill_s",
        "load_s",
        "graph_capture_s",
        "graph_captures",
        "steady_decode_first_half_tokens_per_s",
        "steady_decode_second_half_tokens_per_s",
        "steady_decode_p10_step_us",
        "steady_decode_p90_step_us",
        "graph_shapes",
        "gather_path_by_rows",
    )
    return {
        "backend": res.get("backend"),
        "device": res.get("device"),
        "dtype": res.get("dtype"),
        "new_tokens": res.get("new_tokens"),
        "finish_reason": res.get("finish_reason"),
        **{k: tm[k] for k in keep if k in tm},
        "command_s": round(seconds, 2),
    }


def ratio_report(steady: float | None, serve_one: float | None, target: float = TARGET) -> dict[str, Any]:
    """``serve_one / steady`` and whether it is within ``target`` either way."""
    if not steady or not serve_one:
        return {"serve_over_steady": None, "within_target": None}
    r = serve_one / steady
    return {"serve_over_steady": round(r, 4), "within_target": max(r, 1 / r) <= target}


def median_of(figures: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """The figures whose ``key`` is the median of ``figures`` (the lower middle one of an
    even count; a missing figure ranks lowest)."""
    ranked = sorted(figures, key=lambda r: r.get(key) or 0.0)
    return dict(ranked[(len(ranked) - 1) // 2])


def _ratios(res: dict[str, Any]) -> dict[str, Any]:
    """``bench serve``'s one-stream figures over each generation command's steady rate:
    the issue's figure (tokens/s of a whole request) and the one measured alike (the
    request's own steady rate)."""
    serve = res["bench_serve"]
    out = {}
    for name in ("demo", "run"):
        if name in res:
            steady = res[name].get("steady_decode_tokens_per_s")
            out[name] = {
                **ratio_report(steady, serve.get("one_stream_tokens_per_s")),
                "serve_steady_over_steady": ratio_report(steady, serve.get("one_stream_steady_decode_tokens_per_s"))[
                    "serve_over_steady"
                ],
            }
    return out


def _bench_serve(path: str, opts: SteadyOptions, common: list[str]) -> tuple[list[str], dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="engram-steady-") as tmp:
        figures = Path(tmp) / "serve.json"
        args = [
            "bench",
            "serve",
            path,
            "--concurrency",
            "1",
            "--max-tokens",
            str(opts.max_tokens),
            "--prompt-tokens",
            str(opts.prompt_tokens),
            "--repeat",
            str(opts.repeat),
            "--json",
            str(figures),
            *common,
        ]
        _out, dt = _cli(args, "bench serve")
        serve = json.loads(figures.read_text())
    one = (serve.get("levels") or {}).get("1") or {}
    return args, {
        "backend": serve.get("backend"),
        "one_stream_tokens_per_s": one.get("tokens_per_s"),
        "one_stream_steady_decode_tokens_per_s": one.get("steady_decode_tokens_per_s"),
        "steps": one.get("steps"),
        "command_s": round(dt, 2),
    }


def run(opts: SteadyOptions) -> int:
    from engram_trt.bench.common import dump
    from engram_trt.errors import EngramError

    common = ["--device", opts.device, "--backend", opts.backend]
    gen = ["--max-new-tokens", str(opts.max_tokens), "--ignore-eos", "--json", *common]
    res: dict[str, Any] = {"target": TARGET, "max_tokens": opts.max_tokens, "commands": []}
    path = opts.path
    rounds: list[dict[str, Any]] = []
    for _ in range(opts.rounds):
        rnd: dict[str, Any] = {}
        if opts.path is None:
            args = ["demo", "--model", opts.model, *gen] + (
                ["--engine-dir", opts.engine_dir] if opts.engine_dir else []
            )
            out, dt = _cli(args, "the demo")
            demo = json.loads(out)
            built = (demo.get("engine") or {}).get("output_dir")
            if not built:
                raise EngramError("bench steady: the demo's JSON names no engine folder (engine.output_dir)")
            if path is not None and str(built) != str(path):
                raise EngramError(f"bench steady: the demo built {built} after {path}; give --engine-dir")
            path = str(built)
            demo_args = args
            rnd["demo"] = {**_generation_figures(demo, dt), "engine_note": demo.get("engine_note")}
        run_args = ["run", str(path), *gen]
        out, dt = _cli(run_args, "run")
        rnd["run"] = _generation_figures(json.loads(out), dt)
        serve_args, rnd["bench_serve"] = _bench_serve(str(path), opts, common)
        rnd["ratios"] = _ratios(rnd)
        rounds.append(rnd)
    if opts.path is None:
        res["commands"].append("engram-trt " + " ".join(demo_args))
    res["commands"] += ["engram-trt " + " ".join(run_args), "engram-trt " + " ".join(serve_args)]
    res["path"] = str(path)
    res["rounds"] = rounds
    for name in ("demo", "run"):
        if name in rounds[0]:
            res[name] = median_of([r[name] for r in rounds], "steady_decode_tokens_per_s")
    res["bench_serve"] = median_of([r["bench_serve"] for r in rounds], "one_stream_tokens_per_s")
    res["ratios"] = _ratios(res)  # the medians over the rounds: the verdict
    res["rounds_within_target"] = {
        name: sum(bool(r["ratios"][name]["within_target"]) for r in rounds) for name in res["ratios"]
    }
    serve_one = res["bench_serve"].get("one_stream_tokens_per_s")
    print(f"engine folder: {path}")
    for name in ("demo", "run"):
        if name in res:
            r, q = res[name], res["ratios"][name]
            print(
                f"{name:>5}: {r.get('steady_decode_tokens_per_s')} tokens/s steady "
                f"({r.get('backend')}, {r.get('device')}, {r.get('dtype')}; "
                f"warm-up {r.get('decode_warmup_s')} s, capture {r.get('graph_capture_s', 0)} s); "
                f"bench serve / {name} = {q['serve_over_steady']} (within {TARGET}x: {q['within_target']})"
            )
    print(
        f"bench serve, one stream: {serve_one:.1f} tokens/s, "
        f"steady {res['bench_serve'].get('one_stream_steady_decode_tokens_per_s')} tokens/s "
        f"({res['bench_serve'].get('backend')})"
        if serve_one
        else "bench serve, one stream: no figure"
    )
    if len(rounds) > 1:
        print(f"{len(rounds)} rounds (demo, run, bench serve back to back in each; the medians above count):")
        for i, rnd in enumerate(rounds):
            cells = [
                f"{name} {rnd[name].get('steady_decode_tokens_per_s')} (x{rnd['ratios'][name]['serve_over_steady']})"
                for name in ("demo", "run")
                if name in rnd
            ]
            print(
                f"  round {i + 1}: "
                + ", ".join(cells)
                + f"; bench serve {(rnd['bench_serve'].get('one_stream_tokens_per_s') or 0):.1f}"
            )
        print(
            "  rounds within target: "
            + ", ".join(f"{k} {v}/{len(rounds)}" for k, v in res["rounds_within_target"].items())
        )
    dump(res, opts.json)
    return 0
