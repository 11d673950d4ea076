"""``serve`` / ``triton-repo`` with ``--tp N --dp M``: the serving group's start and
stop (:mod:`engram_trt.distributed.serving`) on real gloo processes, the repository's
layout and refusals, the table-sharing choice of independent replicas, and a real
``tritonserver`` whose instances each lead a TP group of 2 CPU ranks.

Oracle: one process's :meth:`engram_trt.LLM.generate` on the same engine folder,
greedy; process liveness from ``/proc`` (a zombie counts as gone).
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from helpers.serving import descendants, segments_mapped_by
from helpers.files import REPO
from engram_trt.config.engram import EngramConfig
from engram_trt.errors import EngramError

PROMPTS = [
    "Engram layers look up n-grams in",
    "The quick brown fox jumps over the lazy dog",
    " ".join(["Tables of hashed n-grams sit outside the engine, sharded by columns over the ranks."] * 4),
]
LENGTHS = (6, 3, 9)  # different lengths: requests finish at different steps while the group steps on


def _params():
    from engram_trt.runtime.sampling_params import SamplingParams

    return [SamplingParams(max_tokens=n, ignore_eos=True) for n in LENGTHS]


@pytest.fixture(scope="module")
def reference_tokens(small_engine: Path) -> list[list[int]]:
    from engram_trt import LLM

    with LLM(str(small_engine), backend="torch", device="cpu", progress=False) as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, _params())]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


def _followers_of(root: int) -> list[int]:
    """Live descendants of ``root`` that run a serving group's follower."""
    from engram_trt.distributed.serving import FOLLOWER_MARK

    out = []
    for pid in descendants(root):
        if _alive(pid):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if FOLLOWER_MARK in cmd:
                out.append(pid)
    return sorted(out)


def _wait_gone(pids: list[int], timeout: float) -> float:
    t0 = time.monotonic()
    while any(_alive(p) for p in pids):
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"pids {[p for p in pids if _alive(p)]} still alive {timeout} s on")
        time.sleep(0.05)
    return time.monotonic() - t0


# ---------------------------------------------------------------- the serving group (gloo, real processes)
def test_tp2_group_leader_gives_one_process_tokens_and_stops_clean(small_engine: Path, reference_tokens) -> None:
    """The leader's LLM of a TP=2 group, driven directly: each rank holds half the
    columns, the greedy tokens equal one process's, and after stop the follower has
    exited 0 and this process holds no process group."""
    import torch.distributed as dist

    from engram_trt.distributed.serving import GroupSpec, start_serving_group
    from engram_trt.distributed.sharding import shard_columns, slice_table_refs
    from engram_trt.runtime.engine_folder import open_model_source

    g = start_serving_group(
        GroupSpec(
            str(small_engine),
            2,
            ("cpu", "cpu"),
            llm_kwargs={"backend": "torch"},
            name="test/tp2",
            timeout_s=120,
            start_timeout_s=120,
        )
    )
    try:
        (pid,) = g.follower_pids()
        assert _alive(pid) and _followers_of(os.getpid()) == [pid]
        got = g.llm.generate(PROMPTS, _params())
        assert [o.token_ids for o in got] == reference_tokens and all(o.error is None for o in got)
        assert [len(o.token_ids) for o in got] == list(LENGTHS)
        st = g.llm.storage
        src = open_model_source(small_engine, progress=False)
        assert st["sharded"] and st["shard"]["columns"] == [0, src.layout.n_hash_cols // 2]
        assert st["table_bytes"] == sum(
            r.nbytes for r in slice_table_refs(src.table_refs, shard_columns(src.layout, 0, 2))
        )
        assert g.stats() == {"name": "test/tp2", "ranks": 2, "ranks_alive": 2, "broken": None} and g.problem() is None
        assert (g.sharing.dp_mode, g.sharing.scope) == ("single", "tp")
    finally:
        g.stop()
    assert g.followers[0].returncode == 0
    assert not _alive(pid) and not dist.is_initialized()
    g.stop()  # idempotent


LEADER_SCRIPT = """
import sys, time
from engram_trt.distributed.serving import GroupSpec, start_serving_group
g = start_serving_group(GroupSpec(sys.argv[1], 2, ("cpu", "cpu"), llm_kwargs={"backend": "torch"}, name="killed/tp2",
                                  timeout_s=120, start_timeout_s=120))
print(*g.follower_pids(), flush=True)
time.sleep(600)
"""


def test_a_killed_leaders_followers_exit(small_engine: Path) -> None:
    """SIGKILL on a leader (no finalize, no close): its follower is gone within 5 s."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "python")}
    leader = subprocess.Popen(
        [sys.executable, "-c", LEADER_SCRIPT, str(small_engine)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        ready, _, _ = select.select([leader.stdout], [], [], 120)
        line = leader.stdout.readline() if ready else ""
        pids = [int(x) for x in line.split()]
        assert len(pids) == 1 and all(_alive(p) for p in pids), line
        assert _followers_of(leader.pid) == pids
    finally:
        leader.kill()
        leader.wait()
    assert _wait_gone(pids, 5.0) < 5.0


WATCHED_SCRIPT = r"""
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c",
                          "import sys, time; from engram_trt.distributed.serving import _watch_parent; "
                          "_watch_parent(int(sys.argv[1]), 'watched'); print('watching', flush=True); time.sleep(600)",
                          str(os.getpid())], stdout=subprocess.PIPE, text=True)
assert child.stdout.readline() == "watching\n"
print(child.pid, flush=True)
time.sleep(600)
"""


def test_the_parent_watch_ends_a_follower_that_waits_on_nothing_else() -> None:
    """The watch alone (no collective to fail, unlike a follower's): a process sleeping
    under it is gone within 1.5 s of its parent's SIGKILL."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "python")}
    parent = subprocess.Popen(
        [sys.executable, "-c", WATCHED_SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
    )
    try:
        ready, _, _ = select.select([parent.stdout], [], [], 60)
        child = int(parent.stdout.readline()) if ready else 0
        assert child and _alive(child)
        time.sleep(0.3)
        assert _alive(child)  # the watch leaves a follower with a live parent alone
    finally:
        parent.kill()
        parent.wait()
    assert _wait_gone([child], 1.5) < 1.5


def test_a_group_that_cannot_load_leaves_no_follower(small_engine: Path) -> None:
    import torch.distributed as dist

    from engram_trt.distributed.serving import GroupSpec, start_serving_group

    with pytest.raises(EngramError, match="max_batch_size"):
        start_serving_group(
            GroupSpec(
                str(small_engine),
                2,
                ("cpu", "cpu"),
                llm_kwargs={"backend": "torch", "max_batch_size": 0},
                name="bad/tp2",
                timeout_s=60,
                start_timeout_s=60,
            )
        )
    assert _followers_of(os.getpid()) == [] and not dist.is_initialized()


def test_group_spec_refuses_mixed_devices() -> None:
    from engram_trt.distributed.serving import GroupSpec

    assert GroupSpec("x", 2, ("cuda:2", "cuda:3")).device_kind == "cuda"
    assert GroupSpec("x", 2, ("cuda:2", "cuda:3")).local_rank(1) == 3
    for devices in (("cpu", "cuda:1"), ("cuda:1", "cuda:1"), ("cuda", "cuda")):
        with pytest.raises(EngramError, match="must be all 'cpu' or one distinct 'cuda:G' each"):
            GroupSpec("x", 2, devices, name="g").device_kind
    spec = GroupSpec(
        "x", 2, ("cpu", "cpu"), dp=3, engram_config={"dp_shared_memory": True}, llm_kwargs={"max_batch_size": 4}
    )
    assert GroupSpec.from_json(spec.to_json()) == spec


# ---------------------------------------------------------------- table sharing of independent replicas
def test_serving_sharing_choices_and_fallbacks() -> None:
    from engram_trt.distributed.serving import choose_serving_sharing

    s = choose_serving_sharing(EngramConfig(), 2, 1)
    assert (s.scope, s.dp_mode, s.warnings) == ("tp", "single", ())
    s = choose_serving_sharing(EngramConfig(dp_shared_memory=True), 2, 2)
    assert (s.scope, s.dp_mode, s.engram_config.dp_shared_memory, s.warnings) == ("tp", "dp_shared_memory", True, ())
    assert "one segment per TP slice, 2 slices" in s.reason
    s = choose_serving_sharing(EngramConfig(dp_shared_memory=True), 1, 3)
    assert (s.scope, s.dp_mode) == (None, "dp_shared_memory")
    # embedding_across_dp across independent instances -> dp_shared_memory, with the warning.
    s = choose_serving_sharing(EngramConfig(embedding_across_dp=True), 2, 2)
    assert (s.scope, s.dp_mode) == ("tp", "dp_shared_memory")
    assert not s.engram_config.embedding_across_dp and s.engram_config.dp_shared_memory
    assert s.warnings == (
        "embedding_across_dp: it shards the columns over replicas that step in lockstep, but the 2 serving "
        "instances step independently; using dp_shared_memory instead (one /dev/shm copy per node)",
    )
    # ... and on to private copies where the shared store cannot run.
    s = choose_serving_sharing(EngramConfig(embedding_across_dp=True), 2, 2, shared_problem="/x does not exist")
    assert s.dp_mode == "private" and not s.engram_config.dp_shared_memory and len(s.warnings) == 2
    assert s.warnings[1] == "dp_shared_memory: /x does not exist; each of the 2 instances holds its own copy instead"
    s = choose_serving_sharing(EngramConfig(embedding_across_dp=True, cpu_offload=False), 1, 2)
    assert s.dp_mode == "private" and "using private copies instead" in s.warnings[0]
    # One instance: embedding_across_dp is the TP sharding itself (one copy in total).
    s = choose_serving_sharing(EngramConfig(embedding_across_dp=True), 2, 1)
    assert (s.scope, s.dp_mode, s.warnings) == ("tp", "single", ())
    with pytest.raises(EngramError, match="table_placement prefetch"):
        choose_serving_sharing(EngramConfig(), 2, 1, staged_rows_ok=False)


def test_group_metrics() -> None:
    from engram_trt.triton.metrics import flatten_stats

    flat = flatten_stats({"tp_group": {"name": "g", "ranks": 2, "ranks_alive": 1, "broken": "x"}})
    assert {k[0]: v[1] for k, v in flat.items()} == {"engram_tp_ranks": 2.0, "engram_tp_ranks_alive": 1.0}


# ---------------------------------------------------------------- the repository
def _repo(capsys, tmp_path: Path, engine: Path, *argv: str) -> tuple[int, str, str]:
    from engram_trt.cli.main import main

    code = main(["triton-repo", str(engine), "--out", str(tmp_path / "repo"), *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _groups_and_params(text: str) -> tuple[list[str], dict[str, str]]:
    block = re.search(r"^instance_group \[\n(.*?)\n\]$", text, re.S | re.M)
    assert block, text
    params = dict(
        re.findall(r'^parameters \{ key: "(\w+)" value: \{ string_value: "((?:[^"\\]|\\.)*)" \} \}$', text, re.M)
    )
    return block.group(1).split(",\n"), params


def test_triton_repo_tp2_dp2_on_gpus(small_engine: Path, tmp_path: Path, capsys) -> None:
    code, out, err = _repo(capsys, tmp_path, small_engine, "--tp", "2", "--dp", "2", "--gpus", "4,5,6,7", "--json")
    assert code == 0, err
    info = json.loads(out)
    assert (info["instances"], info["tp"], info["dp"], info["tp_groups"], info["instance_kind"]) == (
        2,
        2,
        2,
        [[4, 5], [6, 7]],
        "KIND_GPU",
    )
    groups, params = _groups_and_params((tmp_path / "repo/engram_llm/config.pbtxt").read_text())
    assert groups == ["  { count: 1 kind: KIND_GPU gpus: [ 4 ] }", "  { count: 1 kind: KIND_GPU gpus: [ 6 ] }"]
    assert (params["tp"], params["dp"], params["tp_gpus"]) == ("2", "2", "4,5;6,7")
    assert params["engram_config"] == '{\\"dp_shared_memory\\": true}'  # the serving default for dp > 1


def test_triton_repo_tp2_dp2_on_cpu_and_the_model_reads_it_back(small_engine: Path, tmp_path: Path, capsys) -> None:
    from engram_trt.triton.model import ModelParams, group_devices

    code, out, err = _repo(capsys, tmp_path, small_engine, "--tp", "2", "--dp", "2", "--device", "cpu")
    assert code == 0, err
    assert "2 instance(s) each leading a TP group of 2 ranks on KIND_CPU (gloo ranks)" in out
    text = (tmp_path / "repo/engram_llm/config.pbtxt").read_text()
    groups, params = _groups_and_params(text)
    assert groups == ["  { count: 2 kind: KIND_CPU }"]
    assert (params["tp"], params["dp"], params["tp_gpus"], params["device"]) == ("2", "2", "", "cpu")
    mp = ModelParams.from_model_config(
        {"parameters": {k: {"string_value": json.loads(f'"{v}"')} for k, v in params.items()}}
    )
    assert (mp.tp, mp.dp, mp.tp_gpus, mp.engram_config) == (2, 2, (), {"dp_shared_memory": True})
    assert group_devices(mp, None) == ("cpu", "cpu")
    gpu = ModelParams("e", tp=2, dp=2, tp_gpus=((0, 1), (2, 3)))
    assert group_devices(gpu, "cuda:2") == ("cuda:2", "cuda:3")
    with pytest.raises(
        EngramError, match="runs on GPU 1, which leads no group of the 'tp_gpus' parameter \\(0,1;2,3\\)"
    ):
        group_devices(gpu, "cuda:1")
    with pytest.raises(
        EngramError, match="KIND_CPU instance with tp 2 runs its group on CPU, but the 'device' parameter is 'auto'"
    ):
        group_devices(ModelParams("e", tp=2), None)
    with pytest.raises(EngramError, match="'tp_gpus' '0,1;2' must list 2 GPUs"):
        ModelParams.from_model_config(
            {
                "parameters": {
                    "engine_dir": {"string_value": "e"},
                    "tp": {"string_value": "2"},
                    "tp_gpus": {"string_value": "0,1;2"},
                }
            }
        )


def test_triton_repo_places_groups_on_this_machines_gpus(
    small_engine: Path, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without --gpus, the machine's GPUs 0..N*M-1 (a machine of 4 GPUs stood in for)."""
    from engram_trt.triton import repo

    monkeypatch.setattr(repo, "cuda_device_count", lambda: 4)
    code, out, err = _repo(capsys, tmp_path, small_engine, "--tp", "2", "--dp", "2")
    assert code == 0, err
    groups, params = _groups_and_params((tmp_path / "repo/engram_llm/config.pbtxt").read_text())
    assert groups == ["  { count: 1 kind: KIND_GPU gpus: [ 0 ] }", "  { count: 1 kind: KIND_GPU gpus: [ 2 ] }"]
    assert params["tp_gpus"] == "0,1;2,3" and "on GPUs [0,1] [2,3]" in out
    monkeypatch.setattr(repo, "cuda_device_count", lambda: 3)
    code, out, err = _repo(capsys, tmp_path, small_engine, "--tp", "2", "--dp", "2", "--force")
    assert code == 2 and err == (
        "engram-trt: error: --tp 2 x --dp 2 needs 4 GPU(s), one per rank, but this machine has 3 "
        "CUDA device(s); lower --tp/--dp, pass --gpus to write a repository for another machine, "
        "or --device cpu\n"
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tp", "0"], "--tp must be >= 1 (got 0)"),
        (["--dp", "0", "--device", "cpu"], "--dp must be >= 1 (got 0)"),
        (
            ["--tp", "2", "--dp", "2", "--gpus", "0,1,2"],
            "--tp 2 x --dp 2 needs 4 GPU(s), one per rank, but --gpus lists 3 (0,1,2); "
            "list 4 GPU ids or lower --tp/--dp",
        ),
        (
            ["--tp", "2", "--dp", "2", "--device", "cpu", "--engram-config.embedding_across_dp", "true"],
            "--engram-config embedding_across_dp shards the tables over replicas that step in lockstep, "
            "but the --dp 2 Triton instances step independently; drop it (dp_shared_memory, "
            "the default with --dp > 1, keeps one /dev/shm copy per node) or serve --dp 1",
        ),
        (
            ["--tp", "2", "--instances", "2", "--device", "cpu"],
            "--instances 2 cannot be combined with --tp/--dp: there --dp M sets the instances "
            "(each leading --tp N ranks); pass --dp 2 instead",
        ),
        (
            ["--dp", "2", "--device", "cuda:1"],
            "--device cuda:1: with --tp/--dp every rank takes its own GPU; "
            "pass --device cuda (or auto), or --gpus to choose them",
        ),
    ],
    ids=["tp-0", "dp-0", "too-few-gpus", "embedding-across-dp", "instances-and-dp", "one-cuda-device"],
)
def test_triton_repo_refuses_bad_layouts(
    small_engine: Path, tmp_path: Path, capsys, argv: list[str], message: str
) -> None:
    code, out, err = _repo(capsys, tmp_path, small_engine, *argv)
    assert code == 2 and err == f"engram-trt: error: {message}\n" and not (tmp_path / "repo").exists()


def test_serve_help_explains_tp_and_dp() -> None:
    from engram_trt.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for name in ("serve", "triton-repo"):
        acts = {o: a for a in sub.choices[name]._actions for o in a.option_strings}
        assert "--prompts-file" not in acts
        assert "instance i leads GPUs i*N..i*N+N-1" in acts["--tp"].help and "follower" in acts["--tp"].help
        assert "dp_shared_memory" in acts["--dp"].help and "embedding_across_dp is refused" in acts["--dp"].help


# ---------------------------------------------------------------- a real tritonserver, two TP groups on CPU
def _burst(http: str) -> dict[tuple[int, int], Any]:
    """Every prompt twice, all at once, streamed: ``(prompt, copy) -> token ids``."""
    from engram_trt.triton import client as hc

    got: dict[tuple[int, int], Any] = {}
    jobs = [(i, k) for i in range(len(PROMPTS)) for k in range(2)]
    barrier = threading.Barrier(len(jobs))

    def client(i: int, k: int) -> None:
        barrier.wait()
        got[(i, k)] = hc.collect(
            hc.generate_stream(
                http, {"text_input": PROMPTS[i], "max_tokens": LENGTHS[i], "ignore_eos": True, "stream": True}
            )
        )[1]

    threads = [threading.Thread(target=client, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return got


def test_serve_tp2_dp2_gives_the_tokens_of_llm_generate(small_engine: Path, reference_tokens, tmp_path: Path) -> None:
    """`serve --tp 2 --dp 2 --device cpu`: two instances, each the leader of 2 gloo
    ranks, TP slice t of both in one shared segment; concurrent requests over both get
    one process's tokens; the metrics name each group; SIGTERM stops the server (exit
    0) and every follower."""
    pytest.importorskip(
        "tritonclient.grpc", reason="tritonclient is not installed (pip install 'tritonclient[http,grpc]')"
    )
    from engram_trt.triton.server import find_tritonserver

    try:
        find_tritonserver()
    except EngramError as exc:
        pytest.skip(f"nvidia-pytriton is not installed and no tritonserver is on PATH: {exc}")
    log = tmp_path / "tritonserver.log"
    cmd = [
        sys.executable,
        "-m",
        "engram_trt",
        "serve",
        str(small_engine),
        "--tp",
        "2",
        "--dp",
        "2",
        "--device",
        "cpu",
        "--backend",
        "torch",
        "--address",
        "127.0.0.1",
        "--http-port",
        "0",
        "--grpc-port",
        "0",
        "--metrics-port",
        "0",
        "--json",
        "--exit-timeout",
        "10",
        "--log-file",
        str(log),
    ]
    segments_before = {p.name for p in Path("/dev/shm").glob("engram-trt-*.tables")}
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO / "python")},
    )
    made: set[str] = set()
    followers: list[int] = []
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 240)
        line = proc.stdout.readline() if ready else ""
        assert line, log.read_text()[-3000:] if log.exists() else proc.stderr.read()
        info = json.loads(line)
        assert (info["instances"], info["tp"], info["dp"]) == (2, 2, 2)
        # New segments this server maps (another process may make its own meanwhile;
        # only ours are counted and, at the end, cleaned).
        made = ({p.name for p in Path("/dev/shm").glob("engram-trt-*.tables")} - segments_before) & segments_mapped_by(
            proc.pid
        )
        followers = _followers_of(proc.pid)
        assert len(followers) == 2
        finished_re = re.compile(
            r'^engram_requests_finished_total\{instance="(\w+)",model="engram_llm",tp_group="[\w/]+",'
            r'version="1"\} (\S+)$',
            re.M,
        )
        sent = 0
        for _ in range(3):  # bursts of concurrent requests until both instances (groups) have served some
            got = _burst(info["http"])
            assert got == {(i, k): reference_tokens[i] for i in range(len(PROMPTS)) for k in range(2)}
            sent += len(got)
            deadline = time.monotonic() + 10  # the model refreshes its metrics right after a request finishes
            while True:
                text = urllib.request.urlopen(info["metrics"], timeout=10).read().decode()
                finished = {i: float(v) for i, v in finished_re.findall(text)}
                if sum(finished.values()) == sent or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            assert sum(finished.values()) == sent, finished
            if len(finished) == 2 and min(finished.values()) > 0:
                break
        assert sorted(finished) == ["engram_llm_0_0", "engram_llm_0_1"] and min(finished.values()) > 0, finished
        alive = re.findall(
            r'^engram_tp_ranks_alive\{instance="(\w+)",model="engram_llm",tp_group="([\w/]+)",version="1"\} (\S+)$',
            text,
            re.M,
        )
        assert sorted(alive) == [
            ("engram_llm_0_0", "engram_llm_0_0/tp2", "2"),
            ("engram_llm_0_1", "engram_llm_0_1/tp2", "2"),
        ]
        storage = re.findall(
            r'^engram_table_bytes\{instance="(\w+)",model="engram_llm",storage="(\w+)",tp_group="[\w/]+",'
            r'version="1"\} \S+$',
            text,
            re.M,
        )
        assert sorted(storage) == [("engram_llm_0_0", "shared"), ("engram_llm_0_1", "shared")]
        assert len(made) == 2  # one segment per TP slice, shared by both instances
        logged = log.read_text()
        assert "leads TP group engram_llm_0_0/tp2 of 2 ranks (cpu, cpu" in logged
        assert "leads TP group engram_llm_0_1/tp2 of 2 ranks (cpu, cpu" in logged
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(90)
        _wait_gone(followers, 10.0)
        if made:  # this test made them; freed with the project's own tool
            r = subprocess.run(
                [sys.executable, "-m", "engram_trt", "shm", "clean", *sorted(made)],
                capture_output=True,
                text=True,
                env={**os.environ, "PYTHONPATH": str(REPO / "python")},
            )
            assert r.returncode == 0, r.stderr
    assert rc == 0, proc.stderr.read()[-2000:]
    assert "the leader closed the group; exiting" in log.read_text()
    assert not Path(info["repo"]).exists()
