"""``--tp`` / ``--dp`` / ``--prompts-file`` on ``engram-trt run`` (the ranks start, the
replicas split the prompts, rank 0 prints), and ``--tp`` / ``--dp`` on ``serve`` and
``triton-repo`` (:mod:`.serving`: each Triton instance leads its own TP group).

Building the options imports no torch (the CLI's ``--help`` stays instant).
"""

from __future__ import annotations

import argparse
from typing import Any

from engram_trt.errors import EngramError


def add_parallel_arguments(p: argparse.ArgumentParser, serving: bool = False) -> None:
    """``--tp``/``--dp`` (and ``--prompts-file``) of ``run``; ``serving``: the wording of
    ``serve``/``triton-repo``, where the replicas are Triton instances and take requests,
    not a prompt list (no ``--prompts-file``)."""
    if serving:
        _add_serving_arguments(p)
        return
    g = p.add_argument_group(
        "several ranks (the backbone and the Engram heads sharded over TP ranks; tables shared across DP replicas)"
    )
    g.add_argument(
        "--tp",
        type=int,
        default=1,
        metavar="N",
        help="tensor-parallel ranks per replica: each holds 1/N of the backbone (attention heads, MLP "
        "channels, MoE experts, vocabulary rows; one all-reduce per attention and MLP block) and of "
        "every Engram table's columns (rows all-gathered each step); the heads and experts must divide "
        "by N (default: %(default)s)",
    )
    g.add_argument(
        "--dp",
        type=int,
        default=1,
        metavar="M",
        help="data-parallel replicas; they split the prompts. Tables: --engram-config.embedding_across_dp true "
        "shards the columns over all N x M ranks, dp_shared_memory true shares one /dev/shm copy, "
        "otherwise each replica holds its own (default: %(default)s)",
    )
    g.add_argument(
        "--prompts-file",
        default=None,
        metavar="FILE",
        help="prompts to serve, a JSON list of strings or one per line (instead of --prompt)",
    )


def _add_serving_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "several ranks per instance (the backbone and the Engram heads sharded over TP ranks; "
        "tables shared across instances)"
    )
    g.add_argument(
        "--tp",
        type=int,
        default=1,
        metavar="N",
        help="tensor-parallel ranks per model instance: each instance leads a group of N ranks (itself and N-1 "
        "follower processes it starts and stops), each holding 1/N of the backbone (heads, MLP "
        "channels, experts, vocabulary rows) and of every Engram table's columns; rows are "
        "all-gathered each step. On GPUs instance i leads GPUs i*N..i*N+N-1 of --gpus (default: "
        "this machine's 0..N*M-1), and fewer GPUs than N x M are refused; on a CPU the ranks are "
        "gloo processes (default: %(default)s)",
    )
    g.add_argument(
        "--dp",
        type=int,
        default=1,
        metavar="M",
        help="model instances (data-parallel replicas), each serving requests on its own; with M > 1 they "
        "attach one /dev/shm copy of the tables (dp_shared_memory, on by default; a private copy each where "
        "the shared store cannot run, with a warning). embedding_across_dp is refused: it needs every "
        "replica stepping in lockstep, which independent instances do not. Replaces --instances "
        "(default: %(default)s)",
    )


def wants_parallel(args: argparse.Namespace) -> bool:
    return getattr(args, "tp", 1) != 1 or getattr(args, "dp", 1) != 1 or getattr(args, "prompts_file", None) is not None


def run_parallel(args: argparse.Namespace) -> dict[str, Any]:
    """``engram-trt run PATH --tp N --dp M``: the result rank 0 prints."""
    from engram_trt.cli.argtypes import sampling_params_from_args
    from engram_trt.cli.engram_args import engram_config_from_args
    from engram_trt.distributed.launch import ReplicaJob, prompts_from_file, run_replicas

    for name in ("tp", "dp"):
        v = getattr(args, name)
        if v < 1:
            raise EngramError(f"--{name} must be >= 1 (got {v})")
    params = sampling_params_from_args(args)
    prompts = prompts_from_file(args.prompts_file) if args.prompts_file else [args.prompt]
    ecfg = engram_config_from_args(args)
    job = ReplicaJob(
        args.path,
        args.tp,
        args.dp,
        prompts,
        params,
        ecfg if ecfg.given else None,
        {
            "backend": args.backend,
            "dtype": args.dtype,
            "verify_tables": args.verify_tables,
            "progress": not args.json,
            "device": args.device,
        },
    )
    res = run_replicas(job, device=args.device)
    if res is None:  # a torchrun rank other than 0
        return {}
    r0 = res["ranks"][0]
    out = {
        "tp": res["tp"],
        "dp": res["dp"],
        "tables": res["sharing"],
        "backend": r0["backend"],
        "backend_reason": r0["backend_reason"],
        "device": r0["device"],
        "results": [
            {
                "prompt": p,
                "text": o.text,
                "token_ids": o.token_ids,
                "finish_reason": o.finish_reason,
                "error": o.error,
                "timings": o.timings,
            }
            for p, o in zip(prompts, res["outputs"])
        ],
        "ranks": [
            {k: r[k] for k in ("rank", "dp_rank", "tp_rank", "device", "load_s", "weight_bytes")}
            | {"storage": r["storage"]}
            for r in res["ranks"]
        ],
        "weights": res["weights"],
    }
    return out


def print_parallel(res: dict[str, Any]) -> None:
    if not res:
        return
    t = res["tables"]
    print(
        f"ranks:   tp {res['tp']} x dp {res['dp']} on {res['device']}; "
        f"backend: {res['backend']} ({res['backend_reason']})"
    )
    print(f"tables:  {t['dp_mode']} ({t['reason']})")
    for w in t["warnings"]:
        print(f"warning: {w}")
    wts = res["weights"]
    per_rank = ", ".join("-" if b is None else f"{b / 2**20:.1f}" for b in wts["bytes_per_rank"])
    total = "?" if wts["total_bytes"] is None else f"{wts['total_bytes'] / 2**20:.1f}"
    print(f"weights: {total} MiB in all; per rank (MiB): {per_rank}")
    for r in res["ranks"]:
        st = r["storage"]
        if st.get("kind") != "none" or st.get("sharded"):
            print(f"  rank {r['rank']}: {st['kind']}, {st['table_bytes'] / 2**20:.1f} MiB in {st['where']}")
    for i, r in enumerate(res["results"]):
        if r["error"]:
            print(f"[{i}] error: {r['error']}")
        else:
            print(
                f"[{i}] prompt: {r['prompt']!r}\n    output: {r['text']!r} "
                f"({len(r['token_ids'])} tokens, finish: {r['finish_reason']})"
            )
