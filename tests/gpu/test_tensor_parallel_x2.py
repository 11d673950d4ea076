"""Two GPUs of one node (issues 42 / 45): every family's backbone at ``--tp 2`` over NCCL
against one GPU. Skipped with "needs 2 CUDA devices" on a machine of fewer (marker
``gpus2``); the ranks are spawned once per world size (module fixture), each numbered
part is a test. One command runs it (on a kind with 2 GPUs, e.g. nvidia-h100-x2)::

    ENGRAM_TRT_GPU_OUT=gpu-out python -m pytest -q tests/gpu/test_tensor_parallel_x2.py

1. Tiny random checkpoints transformers makes (engram-llama as a Llama, DeepSeek-V4.1
   with Engram tables, Qwen4Exp with PLE and QSA; heads and experts divide by 2), served
   in float32 with decode CUDA graphs: the greedy tokens at ``--tp 2`` (NCCL, the
   collectives inside the recorded graphs) equal one GPU's, and every rank recorded its
   decode graphs.
2. The ~1.6B DeepSeek-V4 and ~1.15B Qwen4Exp shapes of ``bench e2e`` in bf16: the first
   greedy token of each prompt equals one GPU's (the rest is reported: bf16 sums taken
   in another order may flip a later near-tie), each rank holds less than the whole
   model (its bytes and the whole model's are reported).
3. Throughput at 1 / 8 / 32 streams, ``--tp 2`` against one GPU, in the same run
   (figures: tokens/s and the ratio).
4. The collectives per decode step, timed by CUDA events around each all-reduce /
   all-gather on eager steps (no graphs: a graph's replay runs no Python): calls per
   step (one all-reduce per attention and MLP block plus the embedding's, checked),
   milliseconds per step and their share of the step (figures).

NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1, set here and in every rank).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from .helpers import note

os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"})

pytestmark = pytest.mark.gpus2

TIMEOUT_S = 600.0
NEW = 16  # greedy tokens per prompt (parts 1 and 2)
STREAMS = (1, 8, 32)
BENCH_PROMPT, BENCH_NEW = 32, 32  # tokens per throughput request


def _tiny(root: Path) -> dict[str, tuple[Path, list[list[int]]]]:
    """The tiny folders (part 1) and their prompts."""
    import torch

    import helpers.deepseek_v4 as dp
    import helpers.llama as lp
    import helpers.qwen4_exp as qp
    from helpers.qwen4_exp import QWEN_TP4

    lp.save_llama(root / "llama", seed=21)
    gen = torch.Generator().manual_seed(22)
    dp.save_v41(root / "dsv41", lambda rows, width: torch.randn(rows, width, generator=gen), seed=22)
    qp.save_qwen4(root / "qwen", seed=23, **dict(qp.CASES["hc2-ple1-qsa"], **QWEN_TP4))
    return {
        "engram-llama": (root / "llama", lp.PROMPTS[:2]),
        "deepseek-v4.1": (root / "dsv41", dp.PROMPTS[:2]),
        "qwen4-exp": (root / "qwen", qp.PROMPTS[:2]),
    }


def _jobs(folders: dict[str, tuple[Path, list[list[int]]]], bench: dict[str, Path], tp: int) -> list[Any]:
    from engram_trt.distributed.launch import ReplicaJob
    from engram_trt.runtime.sampling_params import SamplingParams

    greedy = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    jobs = [
        ReplicaJob(str(p), tp, 1, prompts, greedy, None, {"backend": "torch", "dtype": "fp32", "progress": False})
        for p, prompts in folders.values()
    ]
    long = SamplingParams(max_tokens=BENCH_NEW, temperature=0.0, ignore_eos=True)
    kw = {
        "backend": "torch",
        "dtype": "bf16",
        "progress": False,
        "max_batch_size": max(STREAMS),
        "max_seq_len": BENCH_PROMPT + BENCH_NEW + 8,
    }
    for path in bench.values():
        prompts = [[(7 + 13 * i + 31 * j) % 1000 + 2 for j in range(BENCH_PROMPT)] for i in range(max(STREAMS))]
        jobs.append(ReplicaJob(str(path), tp, 1, prompts[:2], greedy, None, dict(kw)))
        jobs += [ReplicaJob(str(path), tp, 1, prompts[:n], long, None, dict(kw), repeat=2) for n in STREAMS]
        jobs.append(
            ReplicaJob(str(path), tp, 1, prompts[:8], long, None, dict(kw, cuda_graphs=False), time_collectives=True)
        )
    return jobs


@pytest.fixture(scope="module")
def x2(tmp_path_factory: Any) -> dict[str, Any]:
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    pytest.importorskip("transformers")
    from engram_trt.bench.e2e import make_checkpoint
    from engram_trt.distributed.checks import replica_jobs
    from engram_trt.distributed.launch import spawn

    root = tmp_path_factory.mktemp("tp-x2")
    t0 = time.perf_counter()
    folders = _tiny(root)
    bench = {}
    for shape in ("dsv4", "qwen4"):
        make_checkpoint(shape, root / shape, device="cuda", dtype="bf16")
        bench[shape] = root / shape
    setup_s = time.perf_counter() - t0
    one = spawn(1, replica_jobs, _jobs(folders, bench, 1), device_kind="cuda", timeout_s=TIMEOUT_S)
    two = spawn(2, replica_jobs, _jobs(folders, bench, 2), device_kind="cuda", timeout_s=TIMEOUT_S)
    note("gpus", [torch.cuda.get_device_name(i) for i in range(2)])
    note("setup_s", round(setup_s, 1))
    names = list(folders)
    per_shape = 2 + len(STREAMS)
    out = {"tiny": {n: (one[i], two[i]) for i, n in enumerate(names)}, "bench": {}}
    for k, shape in enumerate(bench):
        at = len(names) + k * per_shape
        out["bench"][shape] = {
            "tokens": (one[at], two[at]),
            "streams": {n: (one[at + 1 + j], two[at + 1 + j]) for j, n in enumerate(STREAMS)},
            "collectives": (one[at + 1 + len(STREAMS)], two[at + 1 + len(STREAMS)]),
            "config": json.loads((bench[shape] / "config.json").read_text()),
        }
    return out


def _tokens(run: dict) -> list[list[int]]:
    return [o.token_ids for o in run["outputs"]]


def test_tiny_tokens_equal_one_gpu_with_graphs(x2) -> None:
    """1. float32, decode CUDA graphs: --tp 2 gives one GPU's tokens."""
    for name, (one, two) in x2["tiny"].items():
        assert _tokens(two) == _tokens(one), (
            f"{name}: greedy tokens at --tp 2 equal one GPU's (fp32): {_tokens(two)} vs {_tokens(one)}"
        )
        graphs = [r["graphs"] for r in two["ranks"]]
        recorded = all(g["graph_captures"] > 0 for g in graphs) and "CUDA graphs" in two["ranks"][0]["backend"]
        assert recorded, f"{name}: every rank recorded decode CUDA graphs (collectives inside): {graphs}"


def test_bench_shapes_tokens_and_bytes(x2) -> None:
    """2. bf16 at the bench shapes: first tokens equal, each rank less than the whole."""
    figures = {}
    for shape, d in x2["bench"].items():
        one, two = d["tokens"]
        a, b = _tokens(one), _tokens(two)
        assert [t[:1] for t in a] == [t[:1] for t in b], (
            f"{shape} bf16: the first greedy token of each prompt at --tp 2 equals one GPU's: {b} vs {a}"
        )
        same = sum(x == y for p, q in zip(a, b) for x, y in zip(p, q)) / max(sum(len(p) for p in a), 1)
        whole = one["weights"]["bytes_per_rank"][0]
        per_rank = two["weights"]["bytes_per_rank"]
        assert max(per_rank) < whole, (
            f"{shape} bf16 --tp 2: each rank holds less than the whole model: {per_rank} vs {whole}"
        )
        figures[shape] = {
            "tokens_equal_fraction": round(same, 4),
            "one_gpu_weight_bytes": whole,
            "tp2_weight_bytes_per_rank": per_rank,
            "tp2_share": round(max(per_rank) / whole, 4),
        }
    note("bench_shapes", figures)


def _tokens_per_s(run: dict) -> float:
    leader = run["ranks"][0]
    return sum(len(o.token_ids) for o in run["outputs"]) / max(leader["generate_s"], 1e-9)


def test_throughput_against_one_gpu(x2) -> None:
    """3. tokens/s at 1 / 8 / 32 streams, --tp 2 against one GPU (figures)."""
    figures, failed = {}, []
    for shape, d in x2["bench"].items():
        rows = {}
        for n, (one, two) in d["streams"].items():
            ok = all(o.error is None and len(o.token_ids) == BENCH_NEW for o in one["outputs"] + two["outputs"])
            if not ok:
                failed.append(f"{shape} {n} streams: every request finished on one GPU and at --tp 2")
            rows[n] = {
                "one_gpu_tokens_per_s": round(_tokens_per_s(one), 1),
                "tp2_tokens_per_s": round(_tokens_per_s(two), 1),
                "ratio": round(_tokens_per_s(two) / _tokens_per_s(one), 3),
            }
        figures[shape] = rows
    note("throughput", figures)
    assert not failed, "; ".join(failed)  # after the figures: they are noted either way


def test_collectives_per_step(x2) -> None:
    """4. The all-reduces / all-gathers per decode step, timed by CUDA events (eager)."""
    figures, failed = {}, []
    for shape, d in x2["bench"].items():
        one, two = d["collectives"]
        cfg = d["config"]
        leader = two["ranks"][0]
        steps = leader["stats"]["steps"]
        reduces = leader["collectives"]["all_reduce"]
        gathers = leader["collectives"]["all_gather"]
        if reduces["calls"] != (2 * cfg["num_hidden_layers"] + 1) * steps:
            failed.append(
                f"{shape}: one all-reduce per attention and MLP block plus the embedding's, per step: "
                f"{reduces['calls']} in {steps} steps"
            )
        step_ms = 1000.0 * leader["generate_s"] / max(steps, 1)
        one_ms = 1000.0 * one["ranks"][0]["generate_s"] / max(one["ranks"][0]["stats"]["steps"], 1)
        figures[shape] = {
            "steps": steps,
            "all_reduce_ms_per_step": round(reduces["ms"] / steps, 4),
            "all_gather_ms_per_step": round(gathers["ms"] / steps, 4),
            "all_reduce_calls_per_step": reduces["calls"] / steps,
            "all_gather_calls_per_step": gathers["calls"] / steps,
            "tp2_eager_step_ms": round(step_ms, 3),
            "one_gpu_eager_step_ms": round(one_ms, 3),
            "collective_share_of_step": round((reduces["ms"] + gathers["ms"]) / steps / step_ms, 4),
        }
    note("collectives", figures)
    assert not failed, "; ".join(failed)  # after the figures: they are noted either way
