#!/usr/bin/env python3
"""Several GPUs (2 H200s, one node): TP=2 and DP=2 against one GPU (formerly
scripts/h200x2_distributed_check.py). Skipped with "needs 2 CUDA devices" on a machine of
one GPU; the ranks are spawned once (module fixture) and each numbered part is a test.

1. The sharded lookup under NCCL (one rank per GPU): TP=2 (columns over the 2 ranks,
   rows all-gathered) and DP=2 with ``embedding_across_dp`` (row ids all-gathered, rows
   all-to-all, an idle replica padded) give rows bit for bit equal to the unsharded
   store's (CPU reference).
2. Greedy tokens of the demo through ``LLM`` (torch backend, bf16): TP=2 equals one GPU
   serving the same prompts; DP=2 with ``embedding_across_dp``, with
   ``dp_shared_memory`` and with private copies equals one GPU serving each replica's
   share (a replica batches only its share; comparing against the same batch keeps
   bf16 batch-shape effects out of the check; the all-prompts comparison is reported).
3. Host memory of the tables, per mode, measured in every rank while it serves: PSS
   from /proc/PID/smaps_rollup, the PSS of /dev/shm and table-file mappings from
   /proc/PID/smaps, the private store bytes, and /dev/shm use. ``embedding_across_dp``
   and ``dp_shared_memory`` must hold one copy (within 10%); private copies hold two.
4. Step time (mean over the timed repeat) and decode throughput as a ratio to one GPU.
5. The serving group of ``engram-trt serve --tp 2`` (``start_serving_group``): this
   process leads on GPU 0, one follower process on GPU 1 (NCCL); the leader's greedy
   tokens equal one GPU's, and the follower exits 0 after ``stop()``.

NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1, set here and in every rank).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import time
from pathlib import Path

import pytest

from .helpers import note

os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"})

NEW_TOKENS = 32  # greedy tokens per prompt
TIMEOUT_S = 600.0  # collective timeout of the ranks

PROMPTS = [
    "Engram layers look up n-grams in huge static tables,",
    "The quick brown fox jumps over the lazy dog while",
    "Data-parallel replicas share one copy of the tables when",
    "Tensor parallelism splits the hash heads so that",
    "A prefill chunk and a decode token can share one step because",
    "Host memory registered for UVA is read by the GPU through",
    "The gate mixes the looked-up rows into the hidden state, and",
    "One table copy per node is enough if every process attaches",
]


def table_host_bytes(rank_report: dict) -> int:
    """Host bytes of a rank's tables: its share of mapped segments and table files
    (PSS) plus the private bytes of a pinned / memory store."""
    mem = rank_report["memory"]
    st = rank_report["storage"]
    private = st.get("resident_bytes", 0) if st.get("kind") in ("pinned", "memory") else 0
    return mem["shm_pss_bytes"] + mem["table_file_pss_bytes"] + private


@pytest.fixture(scope="module")
def x2():
    """Every rank's run, spawned once: the one-GPU references, the sharded lookups and the
    four serving modes (a namespace of what the tests compare)."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    from types import SimpleNamespace

    import numpy as np

    from engram_trt.builder.build import build
    from engram_trt.models.engram_llama.demo import ensure_demo_checkpoint
    from engram_trt.config.engram import EngramConfig
    from engram_trt.distributed.checks import LookupCase, lookup_check, replica_jobs, run_sequence
    from engram_trt.distributed.launch import ReplicaJob, spawn
    from engram_trt.distributed.memory import shm_used
    from engram_trt.distributed.sharding import Topology
    from engram_trt.runtime.sampling_params import SamplingParams
    from engram_trt.paths import cache_root
    from engram_trt.runtime.engine_folder import open_model_source

    res: dict = {"gpus": [torch.cuda.get_device_name(i) for i in range(2)], "torch": torch.__version__, "notes": []}
    pinned_there = importlib.util.find_spec("engram_trt.tables.pinned") is not None
    shared_there = importlib.util.find_spec("engram_trt.tables.shared") is not None
    base_cfg = None if pinned_there else EngramConfig(cpu_offload=False)
    if not pinned_there:
        res["notes"].append("the pinned store is not installed: one-GPU and private runs keep the tables in GPU memory")
    if not shared_there:
        res["notes"].append(
            "the shared store is not installed: dp_shared_memory falls back (its one-copy check is not run)"
        )

    t0 = time.perf_counter()
    ckpt = ensure_demo_checkpoint()
    engine = cache_root() / "demo-engine"
    build(ckpt, engine, progress=False)
    res["setup_s"] = round(time.perf_counter() - t0, 1)
    src = open_model_source(engine, progress=False)
    one_copy = sum(r.nbytes for r in src.table_refs)
    res["table_bytes_one_copy"] = one_copy

    sp = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    kw = {"backend": "torch", "progress": False}
    shares = Topology(1, 2).split_prompts(len(PROMPTS))
    shm_dir = Path("/dev/shm") / f"engram-trt-dist-check-{os.getpid()}"
    shm_dir.mkdir(mode=0o700)
    try:
        # 1 GPU: all prompts, and each DP replica's share alone (same batch as the replica).
        single = [ReplicaJob(str(engine), 1, 1, PROMPTS, sp, base_cfg, dict(kw), measure_memory=True, repeat=2)]
        single += [ReplicaJob(str(engine), 1, 1, PROMPTS[b:e], sp, base_cfg, dict(kw), repeat=2) for b, e in shares]
        one = spawn(1, replica_jobs, single, device_kind="cuda", timeout_s=TIMEOUT_S)

        rng = np.random.default_rng(0)

        def steps(dp: int, shapes: list) -> tuple:
            return tuple(
                tuple(
                    tuple(tuple(int(x) for x in rng.integers(0, 120000, size=n)) for n in shapes[k][d])
                    for d in range(dp)
                )
                for k in range(len(shapes))
            )

        cases = [
            LookupCase(2, 1, "tp", steps(1, [[[7, 1]], [[1] * 16], [[512]]]), 11),
            LookupCase(1, 2, "world", steps(2, [[[9, 1], [1]], [[1] * 8, []], [[], [300]], [[64], [1]]]), 12),
        ]
        dist_jobs = [
            ReplicaJob(str(engine), 2, 1, PROMPTS, sp, base_cfg, dict(kw), measure_memory=True, repeat=2),
            ReplicaJob(
                str(engine),
                1,
                2,
                PROMPTS,
                sp,
                EngramConfig(embedding_across_dp=True),
                dict(kw),
                measure_memory=True,
                repeat=2,
            ),
            ReplicaJob(
                str(engine),
                1,
                2,
                PROMPTS,
                sp,
                EngramConfig(dp_shared_memory=True),
                dict(kw, table_options={"directory": str(shm_dir)}),
                measure_memory=True,
                repeat=2,
            ),
            ReplicaJob(str(engine), 1, 2, PROMPTS, sp, base_cfg, dict(kw), measure_memory=True, repeat=2),
        ]
        shm_before = shm_used()
        lookups, served = spawn(
            2,
            run_sequence,
            [(lookup_check, (str(engine), cases, 512)), (replica_jobs, (dist_jobs,))],
            device_kind="cuda",
            timeout_s=TIMEOUT_S,
        )
        res["shm_used_before_bytes"] = shm_before
    finally:
        shm_files = sorted(shm_dir.iterdir()) if shm_dir.is_dir() else []
        res["shm_segment_bytes"] = sum(f.stat().st_size for f in shm_files if f.is_file())
        shutil.rmtree(shm_dir, ignore_errors=True)  # this run's own segment folder
    names = ["TP=2", "DP=2 embedding_across_dp", "DP=2 dp_shared_memory", "DP=2 private copies"]
    return SimpleNamespace(
        res=res,
        one=one,
        lookups=lookups,
        served=served,
        cases=cases,
        src=src,
        engine=engine,
        one_copy=one_copy,
        pinned_there=pinned_there,
        shared_there=shared_there,
        base_cfg=base_cfg,
        sp=sp,
        names=names,
        np=np,
        torch=torch,
    )


def test_lookup_rows(x2) -> None:
    """1. The lookup rows vs the unsharded store (CPU reference), bit for bit."""
    from engram_trt.distributed.checks import case_lookback
    from engram_trt.distributed.sharding import Topology
    from engram_trt.engram.hashing import hash_batch_packed
    from engram_trt.models.step import PackedStep
    from engram_trt.tables.store import open_tables

    np, torch, src, cases, lookups = x2.np, x2.torch, x2.src, x2.cases, x2.lookups
    note("setup", dict(x2.res))
    full = open_tables(src.table_refs, "memory", quant_block=src.config.engram.quant_block, progress=False)
    n = src.layout.max_ngram_size - 1
    failed = []
    for case, per_rank in zip(cases, lookups):
        topo = Topology(case.tp, case.dp)
        ok = True
        for rank, got in enumerate(per_rank):
            rep = topo.replica_of(rank)
            ok &= got["env"]["NCCL_NVLS_ENABLE"] == "0"
            for k, step_seqs in enumerate(case.steps):
                seqs = step_seqs[rep]
                if not seqs:
                    ok &= got["steps"][k] is None
                    continue
                step = PackedStep.from_sequences([list(s) for s in seqs])
                cids = src.compress_lookup[step.input_ids.numpy()]
                lb = case_lookback(case, k, rep, len(seqs), n, src.layout.compressed_vocab_size)
                ids = torch.from_numpy(hash_batch_packed(cids, step.seq_starts, lb, src.layout))
                want = torch.stack([full.rows(li, ids[:, li, :]) for li in range(src.layout.num_layers)])
                ok &= bool(np.array_equal(got["steps"][k], want.view(torch.int16).numpy().view(np.uint16)))
        if not ok:
            failed.append(f"lookup rows bit-exact, {case.scope} scope tp{case.tp} x dp{case.dp} (NCCL)")
    assert not failed, "; ".join(failed)  # every case's verdict, not the first alone


def tokens(run: dict) -> list:
    return [o.token_ids for o in run["outputs"]]


@pytest.fixture(scope="module")
def modes(x2) -> dict:
    """Each serving mode's summary from the ranks' runs (its sharing, whether it gave one
    GPU's tokens for all prompts, each rank's figures), built here so that every test that
    reports on the modes has it whichever tests run; test_host_memory adds its figures."""
    ref_all = tokens(x2.one[0])
    return {
        name: {
            "sharing": r["sharing"],
            "equals_one_gpu_all_prompts": tokens(r) == ref_all,
            "ranks": [
                {k: x[k] for k in ("rank", "device", "backend", "load_s", "generate_s", "memory")}
                | {
                    "storage": {k: x["storage"].get(k) for k in ("kind", "where", "table_bytes", "resident_bytes")},
                    "stats": {k: x["stats"].get(k) for k in ("steps", "idle_steps", "follower_steps", "step_s")},
                    "engram": x["stats"].get("engram"),
                }
                for x in r["ranks"]
            ],
        }
        for name, r in zip(x2.names, x2.served)
    }


def test_greedy_tokens(x2, modes) -> None:
    """2. Greedy tokens of each mode against one GPU's."""
    ref_all = tokens(x2.one[0])
    ref_shares = tokens(x2.one[1]) + tokens(x2.one[2])
    note("modes", modes)
    failed = [
        f"{name} ({r['sharing']['dp_mode']}): greedy tokens of one GPU"
        for name, r in zip(x2.names, x2.served)
        if tokens(r) != (ref_all if name == "TP=2" else ref_shares)
    ]
    assert not failed, "; ".join(failed)


def test_host_memory(x2, modes) -> None:
    """3. Host memory of the tables, per mode; 4. step time and throughput as a ratio to
    one GPU (figures)."""
    np, one, served, names, res, one_copy = x2.np, x2.one, x2.served, x2.names, x2.res, x2.one_copy
    shared_there, pinned_there = x2.shared_there, x2.pinned_there
    checks: dict[str, bool] = {}
    one_mem = table_host_bytes(one[0]["ranks"][0])
    res["one_gpu_table_host_bytes"] = one_mem
    res["one_gpu_pss_bytes"] = one[0]["ranks"][0]["memory"]["pss_bytes"]
    nontable = res["one_gpu_pss_bytes"] - one_mem
    for name, r in zip(names, served):
        tb = [table_host_bytes(x) for x in r["ranks"]]
        pss = [x["memory"]["pss_bytes"] for x in r["ranks"]]
        m = modes[name]
        m["table_host_bytes_per_rank"] = tb
        m["table_host_copies"] = round(sum(tb) / one_copy, 3)
        m["pss_bytes_per_rank"] = pss
        m["pss_minus_nontable_copies"] = round((sum(pss) - len(pss) * nontable) / one_copy, 3)
        m["shm_used_bytes"] = max(x["memory"]["shm_used_bytes"] for x in r["ranks"]) - res["shm_used_before_bytes"]
    checks["DP=2 embedding_across_dp: tables take one host copy (PSS)"] = (
        abs(modes[names[1]]["table_host_copies"] - 1) < 0.1
    )
    if shared_there and served[2]["sharing"]["dp_mode"] == "dp_shared_memory":
        m = modes[names[2]]
        checks["DP=2 dp_shared_memory: tables take one host copy (PSS of the segment)"] = (
            abs(m["table_host_copies"] - 1) < 0.1
        )
        checks["DP=2 dp_shared_memory: /dev/shm holds one copy"] = abs(res["shm_segment_bytes"] / one_copy - 1) < 0.1
    if pinned_there:
        checks["DP=2 private copies: two host copies (the contrast)"] = (
            abs(modes[names[3]]["table_host_copies"] - 2) < 0.2
        )

    # 4. step time and throughput as a ratio to one GPU
    def step_time(r: dict) -> float:
        leaders = [x for x in r["ranks"] if x["stats"].get("steps") and not x["stats"].get("follower_steps")]
        return float(np.mean([x["stats"]["step_s"] / x["stats"]["steps"] for x in leaders]))

    def tokens_per_s(r: dict) -> float:
        return sum(len(o.token_ids) for o in r["outputs"]) / max(x["generate_s"] for x in r["ranks"])

    base_step, base_tps = step_time(one[0]), tokens_per_s(one[0])
    res["one_gpu"] = {"step_s": base_step, "tokens_per_s": base_tps}
    for name, r in zip(names, served):
        modes[name]["step_time_ratio"] = round(step_time(r) / base_step, 3)
        modes[name]["throughput_ratio"] = round(tokens_per_s(r) / base_tps, 3)
    note("modes", modes)
    note("one_gpu", res["one_gpu"])
    failed = [name for name, ok in checks.items() if not ok]
    assert not failed, (
        f"{'; '.join(failed)} (table host copies per mode: "
        f"{ {name: m['table_host_copies'] for name, m in modes.items()} })"
    )


def test_serving_group(x2) -> None:
    """5. The serving group of `serve --tp 2`: this process is the leader."""
    engine, base_cfg, sp, one, res = x2.engine, x2.base_cfg, x2.sp, x2.one, x2.res
    ref_all = tokens(one[0])
    checks: dict[str, bool] = {}
    from engram_trt.distributed.serving import GroupSpec, start_serving_group

    t1 = time.perf_counter()
    group = start_serving_group(
        GroupSpec(
            str(engine),
            2,
            ("cuda:0", "cuda:1"),
            engram_config=None if base_cfg is None else {"cpu_offload": False},
            llm_kwargs={"backend": "torch"},
            name="check/tp2",
            timeout_s=TIMEOUT_S,
            start_timeout_s=TIMEOUT_S,
        )
    )
    start_s = time.perf_counter() - t1
    try:
        t1 = time.perf_counter()
        outs = group.llm.generate(PROMPTS, sp)
        gen_s = time.perf_counter() - t1
        res["serving_group"] = {
            "start_s": round(start_s, 2),
            "generate_s": round(gen_s, 3),
            "tokens_per_s": sum(len(o.token_ids) for o in outs) / gen_s,
            "sharing": group.sharing.to_json(),
            "storage": {k: group.llm.storage.get(k) for k in ("kind", "where", "table_bytes")},
            "stats": group.stats(),
        }
    finally:
        group.stop()
    checks["serve --tp 2: the group's leader gives the greedy tokens of one GPU"] = [
        o.token_ids for o in outs
    ] == ref_all
    checks["serve --tp 2: the follower exited 0 after stop()"] = group.followers[0].returncode == 0
    note("serving_group", res["serving_group"])
    failed = [name for name, ok in checks.items() if not ok]
    assert not failed, "; ".join(failed)
