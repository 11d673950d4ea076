"""``engram-trt bench serve``: throughput of 1, 8 and 64 concurrent requests, as a ratio
to one request, through ``engram_trt.LLM`` and its scheduler (requests submitted
together from threads, greedy, fixed lengths).

``--host-breakdown`` also times each step's host work by phase (schedule, lookup,
upload, forward, sample, output: :mod:`engram_trt.runtime.phases`) and prints the
microseconds per decode step at each concurrency, as a table and in the JSON. On a GPU
with decode CUDA graphs, ``forward`` is the replay's launches and ``sample`` holds the
wait for the GPU, so for a small model the sum is the host's cost of a token.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from engram_trt.bench.options import opt


@dataclass(kw_only=True)
class ServeOptions:
    """``engram-trt bench serve``'s flags."""

    path: str = opt(positional=True, metavar="PATH", help="engine folder or checkpoint")
    concurrency: str = opt("1,8,64", help="numbers of concurrent requests (default: %(default)s)")
    prompt_tokens: int = opt(32, help="tokens per prompt (default: %(default)s)")
    max_tokens: int = opt(32, help="new tokens per request (default: %(default)s)")
    device: str = opt("auto", help="cpu, cuda, cuda:N or auto (default: %(default)s)")
    backend: str = opt("auto", choices=("auto", "tensorrt", "torch"), help="runtime backend (default: %(default)s)")
    max_num_tokens: int | None = opt(None, help="token budget of one step (default: the engine's)")
    json: str | None = opt(None, metavar="FILE", help="write the figures as JSON to FILE")
    engram_config: str | None = opt(None, metavar="JSON", help="--engram-config for the tables")
    host_breakdown: bool = opt(False, help="time each step's host work by phase and print microseconds per decode step")
    no_cuda_graphs: bool = opt(False, help="run decode steps eagerly (the torch backend on a GPU)")
    null_model: bool = opt(
        False,
        help="the backend returns fixed logits at once and no Engram rows are staged: the "
        "runtime's host path around the model alone",
    )
    repeat: int = opt(1, help="runs per concurrency; the fastest counts (default: %(default)s)")
    tp: int = opt(
        1,
        help="tensor-parallel ranks: this process leads a group of N ranks (one GPU each, GPUs 0..N-1; "
        "gloo processes with --device cpu), the backbone sharded over them (default: %(default)s)",
    )


def run(opts: ServeOptions) -> int:
    from engram_trt.bench.common import dump
    from engram_trt.distributed.llm import LLM
    from engram_trt.errors import EngramError
    from engram_trt.runtime.sampling_params import SamplingParams
    from engram_trt.runtime.phases import StepPhases, format_table

    try:
        levels = [int(x) for x in opts.concurrency.split(",") if x]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise EngramError(f"--concurrency: expected positive integers, e.g. 1,8,64 (got {opts.concurrency!r})")
    repeat = opts.repeat
    if repeat < 1:
        raise EngramError(f"--repeat must be >= 1 (got {repeat})")
    breakdown = opts.host_breakdown
    if opts.tp < 1:
        raise EngramError(f"--tp must be >= 1 (got {opts.tp})")
    if opts.tp > 1 and opts.null_model:
        raise EngramError("--null-model replaces the model of one process; drop it or --tp")
    with LLM(
        opts.path,
        tp=opts.tp,
        backend=opts.backend,
        device=opts.device,
        max_batch_size=max(levels),
        max_seq_len=opts.prompt_tokens + opts.max_tokens + 1,
        max_num_tokens=opts.max_num_tokens,
        engram_config=opts.engram_config,
        progress=False,
        cuda_graphs=not opts.no_cuda_graphs,
    ) as llm:
        vocab = llm.runner.vocab_size
        if opts.null_model:
            null_model(llm.runner)
        params = SamplingParams(max_tokens=opts.max_tokens, ignore_eos=True)
        res: dict[str, Any] = {
            "backend": llm.backend_label + (" (null model)" if opts.null_model else ""),
            "storage": llm.storage,
            "levels": {},
            "tp": opts.tp,
        }

        def batch(n: int) -> float:
            prompts = [[(7 + 13 * i + 31 * j) % (vocab - 2) + 2 for j in range(opts.prompt_tokens)] for i in range(n)]
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
            if any(o is None or o.error or len(o.token_ids) != opts.max_tokens for o in outs):
                raise EngramError("a benchmark request failed or stopped early")
            last_outs[:] = outs
            return n * opts.max_tokens / dt

        last_outs: list[Any] = []  # the latest batch's outputs (their per-request steady decode rates)

        for n in sorted(set(levels)):
            batch(n)  # warm-up: every batch and context bucket a level meets is recorded before it is timed
        one = None
        for n in levels:
            best: tuple[float, Any, Any] | None = None
            for _ in range(repeat):
                phases = StepPhases() if breakdown else None
                llm.scheduler.attach_phases(phases)
                before = llm.stats()
                tps = batch(n)
                after = llm.stats()
                llm.scheduler.attach_phases(None)
                if best is None or tps > best[0]:
                    best = (tps, (before, after), phases, steady_rate(last_outs))
            tps, (before, after), phases, steady = best  # type: ignore[misc]
            steps = after["steps"] - before["steps"]
            one = one or (tps if n == 1 else None)
            res["levels"][n] = {
                "tokens_per_s": tps,
                "steps": steps,
                "mean_seqs_per_step": seqs_per_step(n * opts.max_tokens, steps),
                # decode steps queued before the step before's tokens were read (the overlapped decode;
                # off with ENGRAM_TRT_OVERLAP=0)
                "chained_steps": after["chained_steps"] - before["chained_steps"],
                "steady_decode_tokens_per_s": steady,
            }
            if phases is not None:
                res["levels"][n]["host_breakdown"] = phases.summary()
        base = res["levels"].get(1, {}).get("tokens_per_s")
        tp = f", --tp {opts.tp}" if opts.tp > 1 else ""
        print(f"backend: {res['backend']}, tables: {res['storage'].get('kind')}{tp}")
        print(f"{'concurrent':>10} {'tokens/s':>12} {'x one request':>14} {'new tok/step':>12}")
        for n, r in res["levels"].items():
            r["ratio_to_one"] = r["tokens_per_s"] / base if base else None
            print(
                f"{n:>10} {r['tokens_per_s']:>12.1f} {(r['ratio_to_one'] or 0):>13.2f}x "
                f"{r['mean_seqs_per_step']:>12.1f}"
            )
        if breakdown:
            print_breakdown(res["levels"], format_table)
    dump(res, opts.json)
    return 0


def seqs_per_step(new_tokens: int, steps: int) -> float:
    """The tokens the requests generated per scheduler step: how many sequences a step
    served on average. A step samples one token for each of its sequences whose prompt
    is done (the prefill's step samples the first), so one stream reads 1.0 and N
    streams at most N. (The scheduler's ``tokens`` count every token a step computes,
    the prompt's included: one stream of 32 prompt tokens and 32 new ones, 63 tokens
    over 32 steps, read 2.0.)"""
    return new_tokens / max(steps, 1)


def steady_rate(outs: list[Any]) -> float | None:
    """The median over a batch's requests of each one's steady decode rate, as ``run``
    prints it (one over the median decode step after the warm-up steps:
    :func:`engram_trt.runtime.scheduler.steady_decode`), so ``bench steady`` can set
    ``run``'s figure beside one defined the same way, not only beside tokens/s over a
    whole request (prefill and the threads' start and join included)."""
    import statistics

    rates = [o.timings.get("steady_decode_tokens_per_s") for o in outs if o is not None]
    rates = [r for r in rates if r]
    return statistics.median(rates) if rates else None


def null_model(runner: Any) -> None:
    """Replace the model by one that costs nothing: every step's logits are one fixed
    ``[S, 16]`` device tensor (token 7 wins) and no rows are staged, so what a step
    still costs is the runtime's own host path: scheduling, the sampled-token read,
    detokenization and outputs (what a CUDA graph replay of a tiny model leaves)."""
    import torch

    logits = torch.zeros(runner.max_batch, 16, device=runner.device)
    logits[:, 7] = 1.0
    runner.prefetcher = None

    def execute(step: Any, cache: Any, rows: Any) -> Any:
        for slot, n in zip(step.slots, step.total_lens):
            cache.lengths[slot] = n
        return logits[: step.num_seqs]

    runner.backend.execute = execute


def print_breakdown(levels: dict[int, Any], format_table: Any) -> None:
    """Each level's decode-step table, then one line per level: us per decode step, the
    host's share without the model (``forward``) and the GPU wait, the GPU stream's time,
    and the same per token (a step of S sequences makes S tokens); then one JSON line."""
    import json

    for n, r in levels.items():
        print(f"\n{n} concurrent: " + format_table(r["host_breakdown"], "decode"))
    print(
        f"\n{'concurrent':>10} {'us/decode step':>15} {'host no fwd':>12} {'gpu_us':>8} "
        f"{'us/token':>9} {'host no fwd':>12}"
    )
    for n, r in levels.items():
        d = r["host_breakdown"]["decode"]
        per = max(d["tokens"], 1) / max(d["steps"], 1)
        print(
            f"{n:>10} {d['total_us']:>15.1f} {d['host_us_without_forward']:>12.1f} {d['gpu_us']:>8.1f} "
            f"{d['total_us'] / per:>9.1f} {d['host_us_without_forward'] / per:>12.1f}"
        )
    print(
        json.dumps(
            {
                str(n): {
                    k: {
                        **{p: round(v, 1) for p, v in r["host_breakdown"][k]["us_per_step"].items()},
                        "gpu_us": round(r["host_breakdown"][k]["gpu_us"], 1),
                    }
                    for k in ("decode", "prefill")
                }
                for n, r in levels.items()
            }
        )
    )
