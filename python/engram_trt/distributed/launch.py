"""Starting the ranks and serving prompts over ``tp x dp`` of them.

:func:`spawn` starts ``world`` processes with ``torch.multiprocessing`` (spawn), or,
under ``torchrun``, joins the processes it started (:func:`under_torchrun`); each rank
runs one job function with its :class:`~.groups.WorldContext`, and rank 0's return
value comes back. :func:`generate_replicas` is the job of ``engram-trt run --tp N
--dp M``: the table sharing is chosen (:mod:`.modes`), each rank builds its
:class:`~engram_trt.llmapi.llm.LLM` with the hooks that need it (the sharded lookup,
the lockstep scheduler), the DP replicas split the prompts (contiguous shares), and
rank 0 collects every replica's outputs and every rank's report.

NCCL's NVLink multicast is off in every rank (the parent sets the variables before it
spawns; each rank sets them again before the process group starts).
"""

from __future__ import annotations

import logging
import os
import pickle
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from engram_trt.distributed.groups import (
    DEFAULT_TIMEOUT_S,
    RankContext,
    WorldContext,
    close_world,
    disable_multicast,
    free_port,
    init_world,
)
from engram_trt.distributed.sharding import Topology
from engram_trt.errors import EngramError

log = logging.getLogger(__name__)

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def resolve_device_kind(device: str | None, world: int) -> str:
    """``cuda`` or ``cpu`` for the ranks: ``auto`` is CUDA when this machine has a GPU
    per local rank... and refuses to put two ranks on one GPU (NCCL cannot)."""
    import torch

    d = (device or "auto").lower()
    if d.startswith("cuda"):
        if d not in ("cuda",):
            raise EngramError(
                f"--device {device}: with several ranks each rank takes its own GPU "
                "(cuda:LOCAL_RANK); pass --device cuda or auto"
            )
        kind = "cuda"
    elif d == "cpu":
        kind = "cpu"
    elif d == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    else:
        raise EngramError(f"--device {device!r} is not auto, cpu or cuda")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise EngramError("--device cuda: no CUDA device is available here; use --device cpu")
        n = torch.cuda.device_count()
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if local > n:
            raise EngramError(
                f"{local} ranks on this machine need {local} GPUs (one each) but it has {n}; lower --tp x --dp to {n}, "
                "or use --device cpu"
            )
    return kind


# -- starting ranks ---------------------------------------------------------------------
def _rank_entry(
    local_rank: int,
    world: int,
    port: int,
    device_kind: str,
    fn: Callable[..., Any],
    args: tuple,
    result_path: str,
    timeout_s: float,
    log_level: int,
) -> None:
    logging.basicConfig(level=log_level, format=f"%(levelname)s rank{local_rank} %(name)s: %(message)s")
    ctx = init_world(local_rank, world, local_rank, device_kind, f"tcp://127.0.0.1:{port}", timeout_s)
    try:
        out = fn(ctx, *args)
        if local_rank == 0:
            tmp = result_path + ".tmp"
            with open(tmp, "wb") as f:
                pickle.dump(out, f)
            os.replace(tmp, result_path)
    except EngramError as exc:  # a bad input found by a rank: the parent says it in one line
        with open(f"{result_path}.rank{local_rank}.error", "w", encoding="utf-8") as f:
            f.write(str(exc))
        raise
    finally:
        close_world()


def spawn(
    world: int, fn: Callable[..., Any], *args: Any, device_kind: str = "cpu", timeout_s: float = DEFAULT_TIMEOUT_S
) -> Any:
    """Run ``fn(world_ctx, *args)`` on ``world`` new processes (rank = local rank, one
    node); returns rank 0's result. ``fn`` must be a module-level function (spawned
    processes import it). A rank that refuses its input fails the call with its one
    line; a rank that dies (a signal, an exit) stops the others at once (SIGTERM: the
    collectives they wait in cannot complete) and fails the call with one line naming
    it (:func:`rank_failure`)."""
    import torch.multiprocessing as mp

    disable_multicast()  # inherited by the ranks
    spawn_log = logging.getLogger("torch.multiprocessing.spawn")  # its "Terminating process ..." lines
    level = spawn_log.level
    with tempfile.TemporaryDirectory(prefix="engram-trt-ranks-") as d:
        result = os.path.join(d, "rank0.pkl")
        context = None
        try:
            if log.getEffectiveLevel() > logging.DEBUG:
                spawn_log.setLevel(logging.ERROR)
            entry_args = (
                world,
                free_port(),
                device_kind,
                fn,
                args,
                result,
                timeout_s,
                logging.getLogger().getEffectiveLevel(),
            )
            context = mp.start_processes(_rank_entry, args=entry_args, nprocs=world, join=False, start_method="spawn")
            while not context.join():
                pass
        except Exception as exc:
            errors = [Path(f"{result}.rank{r}.error") for r in range(world)]
            found = [e.read_text(encoding="utf-8") for e in errors if e.is_file()]
            if found:  # the first rank's one line, not the spawn machinery's traceback
                log.debug("a rank refused its input", exc_info=True)
                raise EngramError(found[0]) from None
            if context is not None:
                log.debug("a rank failed", exc_info=True)
                raise EngramError(rank_failure(exc, [(p.pid, p.exitcode) for p in context.processes])) from None
            raise
        finally:
            spawn_log.setLevel(level)
        with open(result, "rb") as f:
            return pickle.load(f)


def rank_failure(exc: BaseException, exits: list[tuple[int | None, int | None]]) -> str:
    """The one line of a run whose rank failed: the rank that died of a signal other than
    the SIGTERM the launcher stops the others with (a crash, an OOM kill), else the rank
    the launcher saw fail first, with the last line of its error."""
    import signal

    first = getattr(exc, "error_index", None)

    def died(rank: int) -> str:
        pid, code = exits[rank]
        if code is not None and code < 0:
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
        else:
            how = f"exited with status {code}"
        return f"rank {rank} (pid {pid}) {how}"

    killed = [r for r, (_pid, code) in enumerate(exits) if code is not None and code < 0 and -code != signal.SIGTERM]
    if killed:
        rank = first if first in killed else killed[0]
        return (
            f"{died(rank)} while the ranks were running; the other ranks were stopped (a rank cannot be replaced "
            f"mid-run: rerun the command)"
        )
    if first is not None:
        text = str(exc).strip().splitlines()
        cause = next((line.strip() for line in reversed(text) if line.strip()), "")
        return (
            f"{died(first)} while the ranks were running: {cause[:300]}; the other ranks were stopped (rerun with "
            f"-vv for its traceback)"
        )
    return f"the ranks failed: {str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__}"


def in_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def under_torchrun(
    fn: Callable[..., Any], *args: Any, device_kind: str = "cpu", timeout_s: float = DEFAULT_TIMEOUT_S
) -> Any:
    """Join the ranks ``torchrun`` started (its ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/
    ``MASTER_*`` variables); returns ``fn``'s result on rank 0, None elsewhere."""
    rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    ctx = init_world(rank, world, local, device_kind, "env://", timeout_s)
    try:
        out = fn(ctx, *args)
    finally:
        close_world()
    return out if rank == 0 else None


# -- serving prompts over the ranks ---------------------------------------------------------
@dataclass
class ReplicaJob:
    """What every rank needs to serve ``prompts`` over ``tp x dp`` (picklable)."""

    path: str
    tp: int
    dp: int
    prompts: list[Any]
    params: Any  # SamplingParams or a list of them
    engram_config: Any = None  # EngramConfig or None (the source's)
    llm_kwargs: dict[str, Any] = field(default_factory=dict)
    measure_memory: bool = False
    repeat: int = 1  # generate the replica's share this many times (timing runs)
    time_collectives: bool = False  # each rank's model collectives timed (clock.CollectiveClock; eager steps)


@dataclass(frozen=True)
class SourceFacts:
    """What the table-sharing choice needs to know about a model before it loads."""

    engram_config: Any  # the EngramConfig the runtime will use (the user's, else the folder's)
    has_tables: bool
    staged_rows_ok: bool  # the backend takes rows staged by the runtime
    engram_columns: bool = True  # the tables are Engram tables, whose hash columns a lookup shards (not PLE's)

    def adjust(self, sharing: Any, tp: int) -> Any:
        """``sharing`` as this model can run it: no Engram tables, no lookup to shard (a
        family's own tables, Qwen4Exp's PLE, stay whole on each rank; its TP ranks still
        step in lockstep for the backbone's collectives)."""
        if self.has_tables and self.engram_columns:
            return sharing
        if not self.has_tables:
            return replace(sharing, scope=None, reason="the model has no tables")
        across = sharing.reason.split("; ", 1)[1] if sharing.reason.startswith("hash columns") else sharing.reason
        return replace(
            sharing, scope=None, reason=f"the model's own tables (not Engram tables) whole on each rank; {across}"
        )


def peek_source(path: str, engram_config: Any, backend: str, device: Any) -> SourceFacts:
    """Read what :class:`SourceFacts` holds without loading weights or tables. A sharded
    lookup feeds staged rows, which the torch backend always takes and an engine only
    when built for prefetch placement (or when TensorRT cannot run here and auto falls
    back to torch)."""
    from engram_trt.config.engram import EngramConfig
    from engram_trt.runtime.engine_folder import is_engine_folder, open_model_source, peek_model

    p = Path(path).expanduser()
    if not is_engine_folder(p):
        peek = peek_model(p)
        return SourceFacts(engram_config or EngramConfig(), peek.has_tables, True, peek.config.engram is not None)
    src = open_model_source(p, engram_config=engram_config, progress=False)
    ok = backend == "torch" or src.placement == "prefetch" or src.engine_file is None
    if not ok and backend == "auto":
        from engram_trt.runtime.trt_backend import tensorrt_unusable_reason

        ok = tensorrt_unusable_reason(src, device) is not None
    return SourceFacts(src.engram_config, bool(src.table_refs), ok, src.layout is not None)


def generate_replicas(world_ctx: WorldContext | None, job: ReplicaJob) -> dict[str, Any] | None:
    """The job of one rank (see the module docstring); rank 0 returns
    ``{"outputs": [per prompt, in order], "sharing": ..., "ranks": [per rank]}``."""
    from engram_trt.config.engram import EngramConfig
    from engram_trt.distributed.memory import process_memory
    from engram_trt.distributed.modes import choose_table_sharing, log_choice, shared_store_problem
    from engram_trt.llmapi.llm import LLM
    from engram_trt.runtime.sampling_params import as_param_list

    topo = Topology(job.tp, job.dp)
    if world_ctx is None:
        from engram_trt.runtime.runner import resolve_device

        ctx = RankContext.single(resolve_device(job.llm_kwargs.get("device")))
    else:
        ctx = RankContext.create(world_ctx, topo)
    kw = dict(job.llm_kwargs)
    kw["device"] = ctx.device
    user_cfg = job.engram_config
    if user_cfg is not None and not isinstance(user_cfg, EngramConfig):
        user_cfg = EngramConfig.parse(user_cfg)
    facts = peek_source(job.path, user_cfg, kw.get("backend", "auto"), ctx.device)
    shm_dir = (kw.get("table_options") or {}).get("directory")
    cfg = facts.engram_config
    sharing = choose_table_sharing(
        cfg,
        topo,
        staged_rows_ok=facts.staged_rows_ok or topo.tp > 1,
        shared_problem=shared_store_problem(shm_dir) if cfg.dp_shared_memory else None,
    )
    sharing = facts.adjust(sharing, topo.tp)  # no Engram tables: nothing to shard or exchange
    log_choice(sharing, topo, ctx.rank)
    hooks = lockstep_hooks(ctx, sharing)
    share = topo.split_prompts(len(job.prompts))[ctx.dp_rank]
    params = as_param_list(job.params, len(job.prompts)) if job.prompts else []
    t0 = time.perf_counter()
    llm = LLM(job.path, engram_config=sharing.engram_config, **kw, **hooks)
    load_s = time.perf_counter() - t0
    clock = None
    if job.time_collectives and llm.runner.tensor_parallel is not None:
        from engram_trt.distributed.clock import CollectiveClock

        clock = CollectiveClock(llm.runner.tensor_parallel, ctx.device)
    outs: list[tuple[int, Any]] = []
    gen_s = 0.0
    try:
        if ctx.is_leader and share[1] > share[0]:
            idx = list(range(*share))
            for _ in range(max(1, job.repeat)):
                t1 = time.perf_counter()
                got = llm.generate([job.prompts[i] for i in idx], [params[i] for i in idx])
                gen_s = time.perf_counter() - t1
            outs = list(zip(idx, got))
        storage = llm.storage
        weight_bytes = llm.runner.weight_bytes()
        graphs = llm.runner.graph_capture()  # decode CUDA graphs recorded (the collectives inside them)
        label, reason = llm.backend_label, llm.backend_reason
        table_files = sorted({str(r.file) for r in llm.source.table_refs})
        memory = None
        if job.measure_memory:  # every rank measures while every rank still maps its tables
            _barrier(ctx)
            memory = process_memory(table_files, shm_dir or "/dev/shm")
            _barrier(ctx)
        lookup = llm.runner.prefetcher
    finally:
        llm.close()  # waits until every rank of the group has stopped stepping
    stats = llm.scheduler.snapshot()  # after close: a follower's steps are all counted
    if lookup is not None:
        stats["engram"] = dict(lookup.stats)
    report = {
        "rank": ctx.rank,
        "dp_rank": ctx.dp_rank,
        "tp_rank": ctx.tp_rank,
        "device": str(ctx.device),
        "backend": label,
        "backend_reason": reason,
        "storage": storage,
        "stats": stats,
        "load_s": round(load_s, 3),
        "generate_s": round(gen_s, 4),
        "weight_bytes": weight_bytes,
        "graphs": graphs,
    }
    if memory is not None:
        report["memory"] = memory
    if clock is not None:
        report["collectives"] = clock.summary()
    gathered = _gather_to_rank0(ctx, {"outputs": outs, "report": report})
    if ctx.rank != 0:
        return None
    ordered: list[Any] = [None] * len(job.prompts)
    for g in gathered:
        for i, out in g["outputs"]:
            ordered[i] = out
    return {
        "outputs": ordered,
        "sharing": {**sharing.to_json(), "copies": sharing.copies(topo)},
        "tp": topo.tp,
        "dp": topo.dp,
        "ranks": [g["report"] for g in gathered],
        "weights": weights_report(
            job.path, kw.get("dtype"), ctx.device, [g["report"]["weight_bytes"] for g in gathered]
        ),
    }


def weights_report(path: str, dtype: Any, device: Any, per_rank: list[Any]) -> dict[str, Any]:
    """``{"total_bytes": the whole model's weights at the serving dtype (the checkpoint's
    figures, as one device would hold them), "bytes_per_rank": [what each rank holds]}``
    (``total_bytes`` None where a TensorRT engine holds the weights)."""
    import torch

    from engram_trt.runtime.runner import resolve_dtype

    total = None
    if all(b is not None for b in per_rank):
        try:
            total = model_weight_bytes(path, dtype if isinstance(dtype, torch.dtype) else resolve_dtype(dtype, device))
        except EngramError as exc:  # an engine folder whose checkpoint moved: the ranks' figures stand alone
            log.debug("whole-model weight bytes unknown: %s", exc)
    return {"total_bytes": total, "bytes_per_rank": list(per_rank)}


def model_weight_bytes(path: str, dtype: Any) -> int:
    """The weights' bytes of the model behind ``path`` (a checkpoint, or the one an engine
    folder names) at ``dtype``, from its headers (``weight_formats``; quantized weights as
    stored)."""
    from engram_trt.models.registry import open_checkpoint
    from engram_trt.runtime.engine_folder import checkpoint_of

    ckpt = open_checkpoint(checkpoint_of(path), allow_unused=True)
    try:
        return sum(gpu for _k, _s, gpu in ckpt.architecture.weight_formats(ckpt, dtype).values())
    finally:
        ckpt.close()


def lockstep_hooks(ctx: RankContext, sharing: Any) -> dict[str, Any]:
    """The :class:`~engram_trt.llmapi.llm.LLM` hooks of one rank: its TP group (the
    backbone's share), the sharded lookup over ``sharing.scope`` and the lockstep
    scheduler, or only the scheduler where the tables are whole (TP followers run the
    leader's steps)."""
    from engram_trt.distributed.lockstep import LockstepScheduler
    from engram_trt.distributed.lookup import ShardedLookup

    hooks: dict[str, Any] = {}
    if ctx.topology.tp > 1:
        hooks["tensor_parallel"] = ctx.tensor_parallel()  # the backbone sharded over the replica's TP ranks
    if sharing.scope is not None:
        hooks["engram_lookup"] = ShardedLookup.factory(ctx, sharing.scope)
        hooks["scheduler_factory"] = LockstepScheduler.factory(ctx, sharing.scope)
    elif ctx.topology.tp > 1:
        hooks["scheduler_factory"] = LockstepScheduler.factory(ctx, "tp")
    return hooks


def _gather_to_rank0(ctx: RankContext, obj: Any) -> list[Any]:
    if ctx.world_ctx.side_group is None:
        return [obj]
    import torch.distributed as dist

    box: list[Any] = [None] * ctx.world if ctx.rank == 0 else []
    dist.gather_object(obj, box if ctx.rank == 0 else None, dst=0, group=ctx.world_ctx.side_group)
    return box


def _barrier(ctx: RankContext) -> None:
    if ctx.world_ctx.side_group is not None:
        import torch.distributed as dist

        dist.barrier(group=ctx.world_ctx.side_group)


def run_replicas(job: ReplicaJob, *, device: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
    """Serve ``job`` over ``tp x dp`` ranks: in this process for one rank, else under
    torchrun when started by it, else on spawned processes. Returns rank 0's result
    (None on other torchrun ranks)."""
    from engram_trt.distributed.support import check_parallel_support

    world = job.tp * job.dp
    Topology(job.tp, job.dp)  # refuse bad sizes before anything starts
    check_parallel_support(job.path, job.tp, job.dp, job.engram_config)  # what the model cannot run, in one line
    if world == 1 and not in_torchrun():
        return generate_replicas(None, job)  # type: ignore[return-value]
    kind = resolve_device_kind(device, world)
    if kind == "cuda":  # a model larger than this TP's GPUs: said before any rank loads
        from engram_trt.distributed.support import check_gpu_fit, gpu_memory_bytes

        check_gpu_fit(job.path, job.tp, job.llm_kwargs.get("dtype"), gpu_memory_bytes(0))
    job.llm_kwargs.pop("device", None)
    if in_torchrun():
        if int(os.environ["WORLD_SIZE"]) != world:
            raise EngramError(
                f"torchrun started {os.environ['WORLD_SIZE']} ranks but --tp {job.tp} x --dp {job.dp} = {world}; "
                f"pass --nproc-per-node {world}"
            )
        return under_torchrun(generate_replicas, job, device_kind=kind, timeout_s=timeout_s)
    return spawn(world, generate_replicas, job, device_kind=kind, timeout_s=timeout_s)


def prompts_from_file(path: str) -> list[str]:
    """Prompts of ``--prompts-file``: a JSON list of strings, or one prompt per line."""
    import json

    p = Path(path).expanduser()
    if p.is_dir():
        raise EngramError(
            f"--prompts-file {path}: is a folder, not a file; pass a file of prompts (a JSON list of strings "
            f"or one per line)"
        )
    if not p.exists():
        raise EngramError(f"--prompts-file {path}: no such file")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise EngramError(f"--prompts-file {path}: not UTF-8 text") from None
    except OSError as exc:
        raise EngramError(f"--prompts-file {path}: cannot be read ({exc.strerror})") from None
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as exc:
            raise EngramError(f"--prompts-file {path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        if not isinstance(items, list) or not all(isinstance(x, str) and x for x in items):
            raise EngramError(f"--prompts-file {path}: a JSON file must hold a list of non-empty strings")
        out = list(items)
    else:
        out = [line for line in text.splitlines() if line.strip()]
    if not out:
        raise EngramError(f"--prompts-file {path} holds no prompt")
    return out
