"""The step loop when ranks must step together: every rank of a lookup group calls
the lookup's collectives once per step, in the same order, whether it has work or not.

Each iteration, on every rank of the group (the replica's TP ranks, or every rank
with ``embedding_across_dp``):

1. A replica's TP rank 0 (the leader) reaps, admits and plans its batch as the plain
   scheduler does; TP followers never take requests.
2. Flags ``[has_step, tokens, stop]`` are all-gathered on the CPU group: every rank
   knows who steps.
3. Nobody steps: all stopped -> the loop ends on every rank at once; otherwise wait a
   little (backing off to ``max_poll_s``) and go again.
4. The leader runs its batch (:meth:`Scheduler._run`: sampling and outputs unchanged);
   its runner first broadcasts the packed step (and the KV slots it reset) to its TP
   followers, which run the same step and drop the logits. A replica with no batch
   while others step calls :meth:`ShardedLookup.idle` (zero tokens, padded): the
   exchange's collectives match on every rank.

Closing: :meth:`Scheduler.close` sets the stop flag and waits; the loop goes on
serving the other ranks' steps until every rank of the group has stopped, so one
replica finishing early never leaves the others without its columns.

A failure inside a collective (a rank died) cannot be recovered in step: the loop
fails every request it holds with the error and refuses new ones.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

import numpy as np
import torch

from engram_trt.distributed.groups import all_gather_flat
from engram_trt.errors import EngramError
from engram_trt.runtime.scheduler import Scheduler
from engram_trt.storage import atomic
from engram_trt.models.step import PackedStep

log = logging.getLogger(__name__)


class _LeaderRunner:
    """The leader's runner as its scheduler sees it: before each step runs here, the
    step and the slots reset since the last one go to the TP followers."""

    def __init__(self, runner: Any, tp_group: Any, leader_rank: int, has_followers: bool) -> None:
        self._runner = runner
        self._tp_group = tp_group
        self._leader_rank = leader_rank
        self._has_followers = has_followers
        self.resets: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)

    def reset_slot(self, slot: int) -> None:
        self.resets.append(int(slot))
        self._runner.reset_slot(slot)

    def run(self, step: PackedStep, cids: np.ndarray, lookback: np.ndarray) -> torch.Tensor:
        if self._has_followers:
            payload = (
                self.resets,
                step.input_ids.numpy(),
                step.seq_lens,
                step.past_lens,
                step.slots,
                np.asarray(lookback),
                np.asarray(cids),
            )
            broadcast_step(payload, self._leader_rank, self._tp_group)
            self.resets = []
        return self._runner.run(step, cids, lookback)


def broadcast_step(payload: Any, src: int, group: Any) -> Any:
    import torch.distributed as dist

    box = [payload]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


class LockstepScheduler(Scheduler):
    """See the module docstring. ``control_group``: the CPU group of the ranks that step
    together (``members`` global ranks); ``tp_group`` / ``leader_rank``: this
    replica's TP group (CPU) and its leader's global rank; ``lookup``: this rank's
    :class:`~engram_trt.distributed.lookup.ShardedLookup` (for idle steps)."""

    def __init__(
        self,
        runner: Any,
        tokenizer: Any,
        *,
        control_group: Any,
        members: list[int],
        rank: int,
        leader_rank: int,
        tp_group: Any,
        tp_size: int,
        lookup: Any,
        poll_s: float = 0.001,
        max_poll_s: float = 0.02,
    ) -> None:
        self.is_leader = rank == leader_rank
        self.members = list(members)
        self.me = self.members.index(rank)
        self.leader_index = self.members.index(leader_rank)
        self.control_group = control_group
        self.tp_group = tp_group
        self.tp_size = tp_size
        self.leader_rank = leader_rank
        self.lookup = lookup
        self.poll_s, self.max_poll_s = poll_s, max_poll_s
        self.broken: str | None = None
        self._base_runner = runner
        if self.is_leader:
            runner = _LeaderRunner(runner, tp_group, leader_rank, tp_size > 1)
        super().__init__(runner, tokenizer)
        self.stats.update(idle_steps=0, follower_steps=0)
        with self._cond:
            self._ensure_thread()  # every rank steps from the start, requests or not

    @classmethod
    def factory(cls, ctx: Any, scope: str, **kw: Any) -> Callable[[Any, Any], "LockstepScheduler"]:
        """What :class:`~engram_trt.llmapi.llm.LLM` takes as ``scheduler_factory``."""
        control, _ = ctx.groups(scope)
        members = list(ctx.topology.tp_group(ctx.dp_rank)) if scope == "tp" else list(range(ctx.world))
        leader = ctx.topology.leader_of(ctx.rank)

        def make(runner: Any, tokenizer: Any) -> "LockstepScheduler":
            return cls(
                runner,
                tokenizer,
                control_group=control,
                members=members,
                rank=ctx.rank,
                leader_rank=leader,
                tp_group=ctx.tp_cpu_group,
                tp_size=ctx.topology.tp,
                lookup=runner.engram_lookup,
                **kw,
            )

        return make

    # -- admission --------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: Any, **kw: Any) -> Any:
        if not self.is_leader:
            raise EngramError(f"this rank is a TP follower (its replica's requests go to rank {self.leader_rank})")
        if self.broken:
            raise EngramError(f"the distributed step loop stopped: {self.broken}")
        return super().submit(prompt_ids, params, **kw)

    def _ensure_thread(self) -> None:
        if self._thread is None:  # never restarted: a second loop would be out of step
            self._thread = threading.Thread(target=self._guarded_loop, name="engram-lockstep", daemon=True)
            self._thread.start()

    # -- the loop ----------------------------------------------------------------------------
    def _guarded_loop(self) -> None:
        device = getattr(self._base_runner, "device", None)
        if device is not None and device.type == "cuda":
            torch.cuda.set_device(device)  # the current device is per thread
        try:
            self._loop()
        except Exception as exc:  # a collective failed: the group cannot step on
            self.broken = f"{type(exc).__name__}: {exc}"
            log.error("rank loop stopped: %s", self.broken, exc_info=log.isEnabledFor(logging.DEBUG))
            with self._cond:
                pending = list(self._waiting) + list(self._running)
                self._waiting.clear()
                self._running.clear()
                for req in pending:
                    if not req.finished:
                        req.error = f"the distributed step loop stopped: {self.broken}"
                        self._finish(req, "error", emit=True)

    def _loop(self) -> None:
        poll = self.poll_s
        n = len(self.members)
        flags_all = torch.empty(3 * n, dtype=torch.int64)
        while True:
            with self._cond:
                self._reap_cancelled()
                self._admit()
                stop = self._stop
                batch = self._plan() if self.is_leader and not stop else []
            mine = torch.tensor([1 if batch else 0, sum(len(t) for _, t in batch), 1 if stop else 0], dtype=torch.int64)
            all_gather_flat(flags_all, mine, self.control_group)
            flags = flags_all.view(n, 3)
            if not bool(flags[:, 0].any()):
                if bool(flags[:, 2].all()):
                    return
                with self._cond:
                    if not self._stop and not self._waiting:
                        self._cond.wait(poll)
                poll = min(poll * 2, self.max_poll_s)
                continue
            poll = self.poll_s
            leader_steps = bool(flags[self.leader_index, 0])
            if self.is_leader and batch:
                self._run(batch)
            elif not self.is_leader and leader_steps:
                self._follow()
            else:
                if self.lookup is None:
                    raise EngramError("internal: a rank with no lookup has no reason to step in lockstep")
                self.lookup.idle()
                self.stats["idle_steps"] += 1

    def _follow(self) -> None:
        """Run the leader's step (same tokens, same slots): this rank's share of the
        lookup, and its copy of the backbone, whose KV cache stays in step."""
        resets, ids, seq_lens, past_lens, slots, lookback, cids = broadcast_step(None, self.leader_rank, self.tp_group)
        atomic.pause_point("lockstep:follow")  # tests: a follower frozen mid-step (then killed)
        for slot in resets:
            self._base_runner.reset_slot(slot)
        step = PackedStep(
            torch.from_numpy(ids),
            seq_lens,
            past_lens,
            slots,
            lookback=torch.from_numpy(lookback),
            engram_ids=torch.from_numpy(cids),
        )
        try:
            self._base_runner.run(step, cids, lookback)
        except Exception as exc:  # as the leader's _run: its step fails the same way and its requests carry the error
            log.error(
                "follower step of %d sequences failed: %s", step.num_seqs, exc, exc_info=log.isEnabledFor(logging.DEBUG)
            )
        self.stats["follower_steps"] += 1
        self.stats["steps"] += 1
