"""A tensor-parallel group behind one serving replica: the replica's process is TP rank
0 (the leader: it takes the requests, schedules and samples), and starts the ``N - 1``
followers that hold the other column slices of the Engram tables and run the leader's
steps (:mod:`.lockstep`, :mod:`.lookup`).

Why here and not in the Triton model: the model only asks for an LLM and a way to
stop it; how ranks start, meet and end is this package's business, and the same
:func:`start_serving_group` serves any front end that owns one process per replica.

Start-up (:func:`start_serving_group`, in the leader):

1. The leader opens a ``TCPStore`` on loopback (it is the store's server) and starts
   each follower as ``python -c ...follower_main`` with the group's spec (JSON), the
   store's port and its own pid; the followers inherit the environment with NVLink
   multicast forced off (``NCCL_NVLS_ENABLE=0`` and the others of
   :data:`~.groups.NO_MULTICAST_ENV`) and this package first on ``PYTHONPATH``.
2. Each follower posts ``joined/t`` and joins the process group; the leader waits for
   every ``joined`` key while watching the processes, so a follower that dies before
   the rendezvous is reported at once (its ``error/t`` line, or its exit code) instead
   of after the collective timeout.
3. Every rank chooses the table sharing the same way (:func:`serving_sharing`: one
   decision, no communication) and builds its :class:`~engram_trt.llmapi.llm.LLM` with
   the lockstep hooks; the followers post ``ready/t``, the leader waits for them.

Shutdown: :meth:`ServingGroup.stop` closes the leader's LLM (the lockstep loop ends on
every rank together), waits for the followers to exit (killing one that does not
within the timeout) and leaves the process group. No orphans: a follower watches its
parent and exits within :data:`PARENT_POLL_S` of the leader dying, however it died
(the collectives' timeout is the second line: a follower blocked in one fails it).

Table sharing across replicas: independent front-end replicas (Triton instances) do
not step in lockstep, so ``embedding_across_dp`` (one copy sharded over every rank of
every replica) cannot run; :func:`choose_serving_sharing` falls back to
``dp_shared_memory`` (TP rank t of every replica attaches the one ``/dev/shm`` segment
of slice t) with a warning, and from there to private copies where the shared store
cannot be used.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from engram_trt.config.engram import EngramConfig
from engram_trt.distributed.groups import DEFAULT_TIMEOUT_S, NO_MULTICAST_ENV
from engram_trt.distributed.modes import TableSharing, choose_table_sharing
from engram_trt.distributed.sharding import Topology
from engram_trt.errors import EngramError

log = logging.getLogger(__name__)

PARENT_POLL_S = 0.25  # how often a follower checks that its leader is alive
START_POLL_S = 0.05
STOP_TIMEOUT_S = 30.0
FOLLOWER_MARK = "engram_trt.distributed.serving import follower_main"  # in every follower's command line


@dataclass(frozen=True)
class GroupSpec:
    """What every rank of one replica's TP group needs (JSON-able: it is a follower's
    command line). ``devices``: per TP rank, ``'cpu'`` or ``'cuda:G'`` (rank 0 is the
    leader's); ``dp``: replicas in the whole deployment (for the table-sharing choice
    only: replicas never talk to each other); ``engram_config``: the user's
    ``--engram-config`` fields; ``llm_kwargs``: the rest of :class:`LLM`'s options
    (backend, dtype, runtime limits, table_options); ``name``: the group in logs and
    metrics; ``timeout_s``: the collectives' timeout; ``start_timeout_s``: how long
    the leader waits for its followers to load."""

    path: str
    tp: int
    devices: tuple[str, ...]
    dp: int = 1
    engram_config: dict[str, Any] | None = None
    llm_kwargs: dict[str, Any] = field(default_factory=dict)
    name: str = "tp-group"
    timeout_s: float = DEFAULT_TIMEOUT_S
    start_timeout_s: float = 600.0

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "GroupSpec":
        d = json.loads(text)
        d["devices"] = tuple(d["devices"])
        return cls(**d)

    @property
    def device_kind(self) -> str:
        """``cpu`` (gloo) or ``cuda`` (NCCL, one GPU per rank); refused when mixed."""
        if len(self.devices) != self.tp:
            raise EngramError(
                f"internal: a TP group of {self.tp} ranks got {len(self.devices)} devices {list(self.devices)}"
            )
        kinds = {d.split(":")[0] for d in self.devices}
        if kinds == {"cpu"}:
            return "cpu"
        if kinds == {"cuda"} and all(":" in d for d in self.devices) and len(set(self.devices)) == self.tp:
            return "cuda"
        raise EngramError(
            f"{self.name}: the TP ranks' devices {', '.join(self.devices)} must be all 'cpu' or one distinct "
            "'cuda:G' each"
        )

    def local_rank(self, rank: int) -> int:
        """The GPU index of ``rank`` on CUDA (what :func:`~.groups.init_world` binds), else the rank."""
        d = self.devices[rank]
        return int(d.split(":")[1]) if d.startswith("cuda") else rank


# -- the table sharing of a serving replica --------------------------------------------
def choose_serving_sharing(
    cfg: EngramConfig, tp: int, dp: int, *, staged_rows_ok: bool = True, shared_problem: str | None = None
) -> TableSharing:
    """The table sharing of one of ``dp`` independent replicas of ``tp`` ranks each.
    Within the replica, :func:`~.modes.choose_table_sharing` over ``tp x 1``; across
    replicas, ``dp_shared_memory`` or private copies (see the module docstring for why
    ``embedding_across_dp`` falls back). ``dp_mode`` and ``reason`` describe the whole
    deployment; ``warnings`` list every fallback."""
    if tp < 1 or dp < 1:
        raise EngramError(f"--tp and --dp must be >= 1 (got --tp {tp} --dp {dp})")
    warns: list[str] = []
    if dp > 1 and cfg.embedding_across_dp:
        shareable = cfg.cpu_offload and not cfg.host_file_gather  # what dp_shared_memory needs
        alt = "dp_shared_memory" if shareable else "private copies"
        warns.append(
            f"embedding_across_dp: it shards the columns over replicas that step in lockstep, but the {dp} serving "
            f"instances step independently; using {alt} instead"
            + (
                " (one /dev/shm copy per node)"
                if shareable
                else " (cpu_offload false or host_file_gather rule out a shared copy)"
            )
        )
        cfg = replace(cfg, embedding_across_dp=False, dp_shared_memory=shareable)
    if cfg.dp_shared_memory and shared_problem is not None:
        warns.append(f"dp_shared_memory: {shared_problem}; each of the {dp} instances holds its own copy instead")
        cfg = replace(cfg, dp_shared_memory=False)
    inner = choose_table_sharing(cfg, Topology(tp, 1), staged_rows_ok=staged_rows_ok)
    warns.extend(inner.warnings)
    within = (
        f"hash columns sharded over the {tp} TP ranks of each instance"
        if tp > 1
        else "each instance holds whole tables"
    )
    if dp == 1:
        mode, across = "single", "one instance"
    elif inner.engram_config.dp_shared_memory:
        mode = "dp_shared_memory"
        across = f"the {dp} instances attach one /dev/shm copy per node" + (
            f" (one segment per TP slice, {tp} slices)" if tp > 1 else ""
        )
    else:
        mode, across = "private", f"each of the {dp} instances holds a private copy ({dp} copies)"
    return replace(inner, dp_mode=mode, reason=f"{within}; {across}", warnings=tuple(warns))


def serving_sharing(
    path: str,
    engram_config: Any,
    tp: int,
    dp: int,
    *,
    backend: str = "auto",
    device: Any = "auto",
    table_options: dict[str, Any] | None = None,
) -> TableSharing:
    """:func:`choose_serving_sharing` for a model folder and the user's
    ``engram_config`` (an :class:`EngramConfig`, a dict of fields or None), reading what
    the choice needs without loading weights or tables."""
    from engram_trt.distributed.launch import peek_source
    from engram_trt.distributed.modes import shared_store_problem
    from engram_trt.distributed.support import check_parallel_support
    from engram_trt.runtime.runner import resolve_device

    user = (
        engram_config
        if isinstance(engram_config, EngramConfig) or engram_config is None
        else EngramConfig.parse(engram_config)
    )
    check_parallel_support(path, tp, dp, user, serving=True)  # what the family cannot run, in one line
    dev = resolve_device(device)
    facts = peek_source(path, user, backend, dev)
    cfg = facts.engram_config
    wants_shared = cfg.dp_shared_memory or (dp > 1 and cfg.embedding_across_dp)
    problem = shared_store_problem((table_options or {}).get("directory")) if wants_shared else None
    # with --tp the backbone is sharded: the torch backend, which takes staged rows, serves every rank
    sharing = choose_serving_sharing(cfg, tp, dp, staged_rows_ok=facts.staged_rows_ok or tp > 1, shared_problem=problem)
    return facts.adjust(sharing, tp)  # no Engram tables: nothing to shard or exchange


# -- the leader ------------------------------------------------------------------------------
@dataclass
class ServingGroup:
    """A started group: the leader's :attr:`llm` (submit requests to it as to any LLM)
    and the follower processes. :meth:`stop` ends it."""

    spec: GroupSpec
    llm: Any
    sharing: TableSharing
    followers: list[subprocess.Popen]
    store: Any = None
    _stopped: bool = False

    @property
    def name(self) -> str:
        return self.spec.name

    def follower_pids(self) -> list[int]:
        return [p.pid for p in self.followers]

    def ranks_alive(self) -> int:
        """The leader plus the followers still running."""
        return 1 + sum(p.poll() is None for p in self.followers)

    def problem(self) -> str | None:
        """Why the group can no longer serve (a follower exited, or the step loop
        stopped), or None. A front end refuses new requests with it."""
        for rank, p in enumerate(self.followers, start=1):
            rc = p.poll()
            if rc is not None:
                return (
                    f"{self.name}: TP rank {rank} (pid {p.pid}) exited ({rc}), so the group cannot step on; reload the "
                    "model or restart the server"
                )
        broken = getattr(self.llm.scheduler, "broken", None)
        return (
            f"{self.name}: the group's step loop stopped ({broken}); reload the model or restart the server"
            if broken
            else None
        )

    def stats(self) -> dict[str, Any]:
        """What a front end exports about the group (the ``tp_group`` entry of the
        Triton model's stats)."""
        broken = getattr(self.llm.scheduler, "broken", None)
        return {"name": self.name, "ranks": self.spec.tp, "ranks_alive": self.ranks_alive(), "broken": broken}

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Close the leader's LLM (unfinished requests end 'cancelled'; the followers'
        loops end with it), wait for every follower to exit, leave the process group.
        Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        try:
            if any(p.poll() is not None for p in self.followers):
                # A rank is gone: the group cannot step on; make the others' sockets close
                # now, so the leader's pending collective fails at once instead of timing out.
                _kill(self.followers)
            self.llm.close()
        finally:
            for p in self.followers:
                try:
                    rc = p.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    log.warning(
                        "%s: follower pid %d did not exit within %.0f s of the leader's close; killing it",
                        self.name,
                        p.pid,
                        timeout_s,
                    )
                    p.kill()
                    rc = p.wait()
                if rc != 0:
                    log.warning("%s: follower pid %d exited with %s", self.name, p.pid, rc)
            _close_world()
            self.store = None
        log.info("%s: stopped (%d followers exited)", self.name, len(self.followers))


def follower_python() -> str:
    """The interpreter to start followers with: this one. Inside an embedding host
    (Triton's Python-backend stub) ``sys.executable`` may name the host instead; then
    the ``python3.X`` of this installation, else the first ``python3`` on PATH."""
    exe = Path(sys.executable) if sys.executable else None
    if exe is not None and exe.name.startswith("python") and os.access(exe, os.X_OK):
        return str(exe)
    ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for cand in (Path(sys.base_exec_prefix) / "bin" / ver, Path(sys.exec_prefix) / "bin" / ver):
        if os.access(cand, os.X_OK):
            return str(cand)
    found = shutil.which(ver) or shutil.which("python3")
    if found is None:
        raise EngramError(
            f"cannot find a {ver} interpreter to start the TP followers with (sys.executable is "
            f"{sys.executable!r}); put {ver} on PATH"
        )
    return found


def _follower_env() -> dict[str, str]:
    import engram_trt

    env = dict(os.environ)
    env.update(NO_MULTICAST_ENV)
    pkg_root = str(Path(engram_trt.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([pkg_root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def start_serving_group(spec: GroupSpec, build: Any = None) -> ServingGroup:
    """Start the followers and build the leader's LLM in this process (see the module
    docstring). Refused in one line when a follower fails to start (its error), and
    then nothing of the group is left running. ``build(spec, ctx) -> (llm, sharing)``:
    how the leader's LLM is made (default: :func:`_build_llm`; ``engram_trt.LLM(path,
    tp=N)`` initializes itself as it)."""
    import datetime

    import torch.distributed as dist

    from engram_trt.distributed.groups import RankContext, disable_multicast, init_world

    if spec.tp < 2:
        raise EngramError(f"internal: a serving group needs --tp >= 2 (got {spec.tp}); one rank serves alone")
    kind = spec.device_kind
    disable_multicast()
    store = dist.TCPStore(
        "127.0.0.1", 0, spec.tp, True, timeout=datetime.timedelta(seconds=spec.timeout_s), wait_for_workers=False
    )
    cmd = [
        follower_python(),
        "-c",
        f"import sys; from {FOLLOWER_MARK}; sys.exit(follower_main(sys.argv[1:]))",
        spec.to_json(),
        str(store.port),
        str(os.getpid()),
    ]
    env = _follower_env()
    followers: list[subprocess.Popen] = []
    llm = None
    joined = False
    deadline = time.monotonic() + spec.start_timeout_s
    try:
        for rank in range(1, spec.tp):
            followers.append(subprocess.Popen(cmd + [str(rank)], env=env, stdin=subprocess.DEVNULL))
        log.info(
            "%s: started %d follower(s), pids %s (%s)",
            spec.name,
            len(followers),
            [p.pid for p in followers],
            ", ".join(spec.devices),
        )
        _await(store, followers, "joined", deadline, spec)
        ctx = RankContext.create(
            init_world(0, spec.tp, spec.local_rank(0), kind, None, spec.timeout_s, store=store), Topology(spec.tp, 1)
        )
        joined = True
        llm, sharing = (build or _build_llm)(spec, ctx)
        _await(store, followers, "ready", deadline, spec)
    except BaseException:
        _kill(followers)
        if llm is not None:
            llm.close()
        if joined:
            _close_world()
        raise
    for w in sharing.warnings:
        log.warning("%s: %s", spec.name, w)
    log.info(
        "%s: %d ranks ready on %s; tables: %s (%s)",
        spec.name,
        spec.tp,
        ", ".join(spec.devices),
        sharing.dp_mode,
        sharing.reason,
    )
    return ServingGroup(spec, llm, sharing, followers, store)


def rank_llm_kwargs(spec: GroupSpec, ctx: Any) -> tuple[dict[str, Any], TableSharing]:
    """The keywords of one rank's :class:`~engram_trt.llmapi.llm.LLM` (the group's options,
    its device, the table sharing's Engram config, the lockstep hooks and its TP group)
    and the sharing; every rank makes the same choice."""
    from engram_trt.distributed.launch import lockstep_hooks

    kw = dict(spec.llm_kwargs)
    kw.pop("device", None)
    kw.setdefault("progress", False)
    sharing = serving_sharing(
        spec.path,
        spec.engram_config,
        spec.tp,
        spec.dp,
        backend=kw.get("backend", "auto"),
        device=ctx.device,
        table_options=kw.get("table_options"),
    )
    kw.update(engram_config=sharing.engram_config, device=ctx.device, **lockstep_hooks(ctx, sharing))
    return kw, sharing


def _build_llm(spec: GroupSpec, ctx: Any) -> tuple[Any, TableSharing]:
    """This rank's LLM with the lockstep hooks; every rank makes the same choice."""
    from engram_trt.llmapi.llm import LLM

    kw, sharing = rank_llm_kwargs(spec, ctx)
    return LLM(spec.path, **kw), sharing


def _await(store: Any, followers: list[subprocess.Popen], what: str, deadline: float, spec: GroupSpec) -> None:
    """Until every follower posted ``what/t``; refused as soon as one posts an error or exits."""
    left = set(range(1, spec.tp))
    while left:
        for rank in sorted(left):
            if store.check([f"error/{rank}"]):
                raise EngramError(
                    f"{spec.name}: TP rank {rank} on {spec.devices[rank]} failed to start: "
                    f"{store.get(f'error/{rank}').decode(errors='replace')}"
                )
            if store.check([f"{what}/{rank}"]):
                left.discard(rank)
                continue
            rc = followers[rank - 1].poll()
            if rc is not None:
                raise EngramError(
                    f"{spec.name}: TP rank {rank} (pid {followers[rank - 1].pid}) exited ({rc}) before it was "
                    f"{what}; its log is in the server's output"
                )
        if left and time.monotonic() > deadline:
            raise EngramError(f"{spec.name}: TP rank(s) {sorted(left)} not {what} within {spec.start_timeout_s:.0f} s")
        if left:
            time.sleep(START_POLL_S)


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            log.warning("pid %d survived SIGKILL for 10 s", p.pid)


def _close_world() -> None:
    from engram_trt.distributed.groups import close_world

    try:
        close_world()
    except Exception as exc:  # a group whose peers died may not tear down cleanly; nothing is left to save
        log.debug("leaving the process group: %s", exc)


# -- a follower -----------------------------------------------------------------------------------
def _watch_parent(leader_pid: int, name: str) -> None:
    """Exit this process as soon as the leader is gone (reparented: the parent pid
    changes), whatever this rank is doing (a collective it waits in included)."""

    def watch() -> None:
        while True:
            if os.getppid() != leader_pid:
                log.error("%s: the leader (pid %d) is gone; this follower exits", name, leader_pid)
                logging.shutdown()
                os._exit(3)
            time.sleep(PARENT_POLL_S)

    threading.Thread(target=watch, name="engram-leader-watch", daemon=True).start()


def follower_main(argv: list[str]) -> int:
    """A follower's process: ``SPEC_JSON STORE_PORT LEADER_PID RANK`` (see the module
    docstring). Returns the exit status: 0 after the leader closed the group."""
    import datetime

    import torch.distributed as dist

    from engram_trt.distributed.groups import RankContext, init_world

    spec_json, port, leader_pid, rank_s = argv
    spec = GroupSpec.from_json(spec_json)
    rank = int(rank_s)
    logging.basicConfig(
        level=logging.INFO, format=f"%(levelname)s {spec.name} rank {rank}/{spec.tp} %(name)s: %(message)s"
    )
    _watch_parent(int(leader_pid), spec.name)
    store = dist.TCPStore("127.0.0.1", int(port), spec.tp, False, timeout=datetime.timedelta(seconds=spec.timeout_s))
    try:
        store.set(f"joined/{rank}", str(os.getpid()))
        ctx = RankContext.create(
            init_world(rank, spec.tp, spec.local_rank(rank), spec.device_kind, None, spec.timeout_s, store=store),
            Topology(spec.tp, 1),
        )
        llm, _ = _build_llm(spec, ctx)
    except BaseException as exc:
        msg = str(exc) if isinstance(exc, EngramError) else f"{type(exc).__name__}: {exc}"
        log.error("failed to start: %s", msg, exc_info=not isinstance(exc, EngramError))
        try:
            store.set(f"error/{rank}", msg[:2000])
        except Exception:
            pass
        return 1
    store.set(f"ready/{rank}", "1")
    log.info("ready on %s; following the leader (pid %s)", ctx.device, leader_pid)
    llm.close()  # runs the leader's steps until every rank of the group has closed
    broken = getattr(llm.scheduler, "broken", None)
    _close_world()
    if broken:
        log.error("the group's step loop stopped: %s", broken)
        return 1
    log.info("the leader closed the group; exiting")
    return 0
