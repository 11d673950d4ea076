"""Process groups: the world every rank joins, and per replica its TP group.

Why two groups per set of ranks: the lookup's rows are big and live where the model
runs (NCCL on GPUs), but the per-step control (who has work, token counts, row ids)
is a few bytes the host already holds, so it goes through a gloo group on CPU tensors
and never waits on a GPU stream. On CPU both are the same gloo group.

NVLink multicast (NVLS) stays off in every rank: :func:`disable_multicast` sets the
variables before NCCL initializes, and the launcher sets them in the parent so
spawned ranks inherit them.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch

from engram_trt.distributed.sharding import LOOKUP_SCOPES, Topology
from engram_trt.errors import EngramError

log = logging.getLogger(__name__)

NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
DEFAULT_TIMEOUT_S = 600.0


def disable_multicast(env: Any = None) -> None:
    """Force NVLink multicast off (NCCL, PyTorch symmetric memory, NVSHMEM): it is never
    needed for these collectives, and a program using it can take a shared host's GPUs
    out of service. Overrides any value already set."""
    target = os.environ if env is None else env
    for k, v in NO_MULTICAST_ENV.items():
        target[k] = v


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the rendezvous of spawned ranks)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class WorldContext:
    """This process's place in the world: its rank, device, and the world's groups."""

    rank: int
    world: int
    local_rank: int
    device: torch.device
    backend: str  # 'nccl' | 'gloo'
    cpu_group: Any  # gloo over every rank: the step loop's control
    data_group: Any  # the default group (nccl on GPUs)
    side_group: Any = None  # gloo over every rank for the main thread (results, barriers), never the step loop's

    @property
    def is_distributed(self) -> bool:
        return self.world > 1 or self.cpu_group is not None


def init_world(
    rank: int,
    world: int,
    local_rank: int,
    device_kind: str,
    init_method: str | None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    store: Any = None,
) -> WorldContext:
    """Join the process group: NCCL on ``cuda`` (one GPU per local rank), gloo on ``cpu``.
    ``store``: a ``torch.distributed`` store to rendezvous through instead of
    ``init_method`` (a serving group's leader watches its followers' start through it)."""
    import torch.distributed as dist

    disable_multicast()
    if device_kind == "cuda":
        if not torch.cuda.is_available():
            raise EngramError(
                "the ranks were asked to run on CUDA but no CUDA device is available here; use --device cpu"
            )
        if local_rank >= torch.cuda.device_count():
            raise EngramError(
                f"rank {rank} needs GPU {local_rank} but this machine has {torch.cuda.device_count()} CUDA device(s); "
                f"lower --tp x --dp to {torch.cuda.device_count()} or use --device cpu"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    elif device_kind == "cpu":
        device, backend = torch.device("cpu"), "gloo"
    else:
        raise EngramError(f"internal: device kind {device_kind!r} is not cuda or cpu")
    timeout = datetime.timedelta(seconds=timeout_s)
    kw: dict[str, Any] = {"device_id": device} if backend == "nccl" else {}
    kw.update({"store": store} if store is not None else {"init_method": init_method})
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout, **kw)
    cpu_group = (
        dist.group.WORLD if backend == "gloo" else dist.new_group(list(range(world)), backend="gloo", timeout=timeout)
    )
    # A second CPU group, so that the main thread's collectives (a barrier, the results'
    # gather) never interleave with the step loop's on the scheduler thread.
    side_group = dist.new_group(list(range(world)), backend="gloo", timeout=timeout)
    log.info("rank %d of %d joined (%s on %s)", rank, world, backend, device)
    return WorldContext(rank, world, local_rank, device, backend, cpu_group, dist.group.WORLD, side_group)


def close_world() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


@dataclass
class RankContext:
    """A rank within ``tp x dp``: its coordinates and the groups its collectives use.
    Made collectively (every rank creates every TP group, in the same order)."""

    world_ctx: WorldContext
    topology: Topology
    tp_cpu_group: Any
    tp_data_group: Any

    @classmethod
    def create(cls, world_ctx: WorldContext, topology: Topology) -> "RankContext":
        import torch.distributed as dist

        if topology.world != world_ctx.world:
            raise EngramError(
                f"--tp {topology.tp} x --dp {topology.dp} = {topology.world} ranks, but {world_ctx.world} were started"
            )
        me = topology.replica_of(world_ctx.rank)
        tp_cpu = tp_data = None
        if topology.tp == topology.world:
            tp_cpu, tp_data = world_ctx.cpu_group, world_ctx.data_group
        elif topology.tp > 1:
            for d, ranks in enumerate(topology.tp_groups()):  # every rank creates every group
                data = dist.new_group(ranks)
                cpu = data if world_ctx.backend == "gloo" else dist.new_group(ranks, backend="gloo")
                if d == me:
                    tp_cpu, tp_data = cpu, data
        return cls(world_ctx, topology, tp_cpu, tp_data)

    @classmethod
    def single(cls, device: torch.device) -> "RankContext":
        """One process, no process group (``--tp 1 --dp 1``)."""
        return cls(WorldContext(0, 1, 0, device, "none", None, None), Topology(1, 1), None, None)

    # -- coordinates -----------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.world_ctx.rank

    @property
    def world(self) -> int:
        return self.topology.world

    @property
    def device(self) -> torch.device:
        return self.world_ctx.device

    @property
    def dp_rank(self) -> int:
        return self.topology.coords(self.rank)[0]

    @property
    def tp_rank(self) -> int:
        return self.topology.coords(self.rank)[1]

    @property
    def is_leader(self) -> bool:
        """TP rank 0 of its replica: it takes the requests, schedules and samples."""
        return self.tp_rank == 0

    def tensor_parallel(self) -> Any:
        """This rank's :class:`~engram_trt.models.parallel.TensorParallel` (the replica's TP
        ranks on the data group: NCCL on GPUs, gloo on CPUs), None with one TP rank: the
        model's all-reduces and all-gathers run on it."""
        if self.topology.tp == 1:
            return None
        from engram_trt.models.parallel import TensorParallel

        return TensorParallel(self.tp_rank, self.topology.tp, self.tp_data_group)

    def groups(self, scope: str) -> tuple[Any, Any]:
        """``(control, data)`` groups of a lookup scope: the replica's TP ranks or every rank."""
        if scope not in LOOKUP_SCOPES:
            raise EngramError(f"internal: lookup scope {scope!r} is not one of {LOOKUP_SCOPES}")
        if scope == "tp":
            return self.tp_cpu_group, self.tp_data_group
        return self.world_ctx.cpu_group, self.world_ctx.data_group


# -- collectives on flat tensors ------------------------------------------------------
def all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group: Any) -> None:
    """``out`` (``[size * n]``, contiguous) <- every member's ``inp`` (``[n]``), in
    group-rank order. One call across torch versions (``all_gather_single`` where it
    exists, ``all_gather_into_tensor`` before)."""
    import torch.distributed as dist

    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def all_to_all_flat(out: torch.Tensor, inp: torch.Tensor, group: Any) -> None:
    """Equal splits: chunk ``d`` of ``inp`` goes to member ``d``; chunk ``s`` of ``out``
    comes from member ``s``."""
    import torch.distributed as dist

    dist.all_to_all_single(out, inp, group=group)
