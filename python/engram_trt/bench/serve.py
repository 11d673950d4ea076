"""``engram-trt bench serve``: throughput of 1, 8 and 64 concurrent requests, as a ratio
to one request, through ``engram_trt.LLM`` and its scheduler (requests submitted
together from threads, greedy, fixed lengths)."""

from __future__ import annotations

import argparse
import threading
import time
from typing import Any


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="throughput of N concurrent requests through LLM, as a ratio to one request",
                       description=__doc__)
    p.add_argument("path", metavar="PATH", help="engine folder or checkpoint")
    p.add_argument("--concurrency", default="1,8,64", help="numbers of concurrent requests (default: %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=32, help="tokens per prompt (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=32, help="new tokens per request (default: %(default)s)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: %(default)s)")
    p.add_argument("--backend", default="auto", choices=("auto", "tensorrt", "torch"), help="runtime backend (default: %(default)s)")
    p.add_argument("--max-num-tokens", type=int, default=None, help="token budget of one step (default: the engine's)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the figures as JSON to FILE")
    p.add_argument("--engram-config", default=None, metavar="JSON", help="--engram-config for the tables")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from engram_trt.bench.common import dump
    from engram_trt.errors import EngramError
    from engram_trt.llmapi.llm import LLM
    from engram_trt.llmapi.params import SamplingParams

    levels = [int(x) for x in args.concurrency.split(",") if x]
    if not levels or min(levels) < 1:
        raise EngramError(f"--concurrency: expected positive integers, e.g. 1,8,64 (got {args.concurrency!r})")
    with LLM(args.path, backend=args.backend, device=args.device, max_batch_size=max(levels),
             max_seq_len=args.prompt_tokens + args.max_tokens + 1, max_num_tokens=args.max_num_tokens,
             engram_config=args.engram_config, progress=False) as llm:
        vocab = llm.runner.vocab_size
        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
        res: dict[str, Any] = {"backend": llm.backend_label, "storage": llm.storage, "levels": {}}

        def batch(n: int) -> float:
            prompts = [[(7 + 13 * i + 31 * j) % (vocab - 2) + 2 for j in range(args.prompt_tokens)] for i in range(n)]
            barrier = threading.Barrier(n + 1)
            outs: list[Any] = [None] * n

            def worker(i: int) -> None:
                barrier.wait()
                outs[i] = llm.generate(prompts[i], params)[0]

            threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
            for t in threads:
                t.start()
            barrier.wait()
            t0 = time.perf_counter()
            for t in threads:
                t.join()
            dt = time.perf_counter() - t0
            if any(o is None or o.error or len(o.token_ids) != args.max_tokens for o in outs):
                raise EngramError("a benchmark request failed or stopped early")
            return n * args.max_tokens / dt

        batch(1)  # warm-up
        one = None
        for n in levels:
            before = llm.stats()
            tps = batch(n)
            after = llm.stats()
            steps = after["steps"] - before["steps"]
            one = one or (tps if n == 1 else None)
            res["levels"][n] = {"tokens_per_s": tps, "steps": steps,
                                "mean_seqs_per_step": (after["tokens"] - before["tokens"]) / max(steps, 1)}
        base = res["levels"].get(1, {}).get("tokens_per_s")
        print(f"backend: {res['backend']}, tables: {res['storage'].get('kind')}")
        print(f"{'concurrent':>10} {'tokens/s':>12} {'x one request':>14} {'tokens/step':>12}")
        for n, r in res["levels"].items():
            r["ratio_to_one"] = r["tokens_per_s"] / base if base else None
            print(f"{n:>10} {r['tokens_per_s']:>12.1f} {(r['ratio_to_one'] or 0):>13.2f}x {r['mean_seqs_per_step']:>12.1f}")
    dump(res, args.json)
    return 0
