"""The scheduler: requests batched as they arrive.

Requests are admitted from any thread (or an asyncio loop, through
:meth:`Scheduler.submit`'s callback) into a waiting queue. One engine thread runs steps:
each step takes the decode token of every running sequence that has finished its
prompt, then fills the rest of the step's token budget (``max_num_tokens``) with
prefill chunks of sequences still reading their prompts (a long prompt is split into
chunks across steps), so prefill and decode share a step. Each sequence owns a KV-cache
slot from admission until it stops on its own (max tokens, a stop string, a stop id,
EOS) or is cancelled; its slot is freed at once and the next waiting request takes it.

Why per-request generators: a seeded request must give the same tokens alone or in a
crowd, so each sequence samples from its own logits row with its own CPU generator, and
greedy sequences take the argmax on the device (one small copy per step, not the logits).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np
import torch

from engram_trt.errors import EngramError
from engram_trt.runtime.outputs import CompletionOutput, RequestOutput
from engram_trt.runtime.sampling_params import SamplingParams
from engram_trt.models.sampling import sample_next
from engram_trt.runtime.detokenize import IncrementalText, byte_fallback_ids, special_token_ids
from engram_trt.runtime.phases import FORWARD, OUTPUT, SAMPLE, SCHEDULE, StepPhases
from engram_trt.models.step import PackedStep

log = logging.getLogger(__name__)

_ids = itertools.count()
# The first decode steps of a request carry one-off work (a CUDA graph capture for a new
# batch / context shape, lazy kernel and allocator set-up): the steady decode rate is
# taken over the steps after them.
WARMUP_DECODE_STEPS = 2


def steady_decode(token_times: list[float], warmup: int = WARMUP_DECODE_STEPS) -> dict[str, float]:
    """The decode timings of one request from the times its tokens came out: the seconds
    of its first ``warmup`` decode steps, and the steady rate, one token over the median
    step time of the rest (a median, so a later capture for a longer context does not
    weigh on it). Fewer steps than that: all of them count as steady.

    ``steady_decode_first_half_tokens_per_s`` / ``..._second_half_...``: the same rate
    over each half of the steady steps apart. Why: a rate that still climbs from the first half to
    the second (clocks, caches still warming) says the window was too short to be
    steady, which one median over the whole window hides."""
    gaps = np.diff(np.asarray(token_times, dtype=np.float64))
    if gaps.size == 0:
        return {}
    steady = gaps[warmup:] if gaps.size > warmup else gaps
    out = {
        "decode_warmup_s": round(float(gaps[:warmup].sum()) if gaps.size > warmup else 0.0, 6),
        "steady_decode_steps": int(steady.size),
        "steady_decode_tokens_per_s": _rate(steady),
    }
    if steady.size >= 10:  # the step time's spread: a fast p10 with a slow median says the host stalls now and then,
        # a slow p10 too says the whole process ran slower (how bench steady tells drift from a slower code path)
        p10, p90 = np.percentile(steady, [10, 90])
        out["steady_decode_p10_step_us"] = round(float(p10) * 1e6, 1)
        out["steady_decode_p90_step_us"] = round(float(p90) * 1e6, 1)
    if steady.size >= 4:
        half = steady.size // 2
        out["steady_decode_first_half_tokens_per_s"] = _rate(steady[:half])
        out["steady_decode_second_half_tokens_per_s"] = _rate(steady[half:])
    return out


def _picks(logits: torch.Tensor) -> torch.Tensor:
    """``[2, S]`` int64 where the logits lie: each row's argmax, and whether the row is all finite."""
    return torch.stack((torch.argmax(logits, dim=-1), torch.isfinite(logits).all(dim=-1).to(torch.int64)))


def _read_picks(picks: torch.Tensor) -> tuple[list[int], list[bool]]:
    """:func:`_picks`' tokens and finite flags as host lists (one copy)."""
    both = picks.tolist()
    return both[0], [bool(f) for f in both[1]]


def _argmax_and_finite(logits: torch.Tensor) -> tuple[list[int], list[bool]]:
    """Each row's argmax and whether the row is all finite, read in one copy."""
    return _read_picks(_picks(logits))


def nonfinite_message(position: int) -> str:
    """The one-line error of a request whose logits were NaN / Inf."""
    return (
        f"the model's logits are NaN or Inf at output token {position}, so no token can be drawn: a weight "
        f"or table holds non-finite values, or the activations overflowed the compute dtype; check the model with "
        f"`engram-trt inspect` (a float32 --dtype rules out an overflow)"
    )


def _rate(gaps: np.ndarray) -> float:
    """One token over the median gap, tokens/s (2 decimals)."""
    return round(1.0 / max(float(np.median(gaps)), 1e-9), 2)


@dataclass
class Request:
    """One sequence's whole life in the scheduler."""

    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    sink: Callable[[RequestOutput], None] | None
    generator: torch.Generator | None = None
    slot: int | None = None
    processed: int = 0  # tokens of prompt + output already in the KV cache
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    text_stale: bool = False  # output_ids moved on since `text` was made (no one reads it before the end)
    sent_text: int = 0
    sent_ids: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    detok: IncrementalText | None = None
    arrival: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)  # when each output token came out (steady_decode)
    finished_at: float | None = None
    cancelled: bool = False
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefilling(self) -> bool:
        return self.processed < len(self.prompt_ids)

    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def output(self, delta_text: str = "", delta_ids: list[int] | None = None) -> RequestOutput:
        t: dict[str, float] = {}
        if self.first_token is not None:
            t["time_to_first_token_s"] = round(self.first_token - self.arrival, 6)
            t["prefill_s"] = t["time_to_first_token_s"]  # arrival to first token: the prompt's prefill steps
        if self.finished_at is not None:
            total = self.finished_at - self.arrival
            t["total_s"] = round(total, 6)
            t["tokens_per_s"] = round(len(self.output_ids) / max(total, 1e-9), 2)
            if self.first_token is not None and len(self.output_ids) > 1:
                t["decode_tokens_per_s"] = round(
                    (len(self.output_ids) - 1) / max(self.finished_at - self.first_token, 1e-9), 2
                )
                t.update(steady_decode(self.token_times))
        return RequestOutput(
            self.request_id,
            self.prompt,
            list(self.prompt_ids),
            [CompletionOutput(0, self.text, list(self.output_ids), self.finish_reason, self.stop_reason)],
            self.finished,
            delta_text,
            list(delta_ids or []),
            t,
            self.error,
        )


@dataclass
class _Launched:
    """A step queued on the device whose tokens are not read yet (:meth:`Scheduler._launch`).
    ``picks``: the argmax and finite flag of each row ``[2, S]`` on the device when every
    sampled row is greedy (None: sampled on the host when the step completes), with its
    pinned host copy and the event that says the copy is done; ``chained``: queued before
    the step before it was read (:meth:`Scheduler._launch_chained`)."""

    reqs: list[Request]
    seq_lens: list[int]
    slots: list[int]
    slot_idx: np.ndarray
    num_tokens: int
    decode_only: bool
    lookback: np.ndarray
    cids: np.ndarray | None  # None: a chained step whose ids are not read yet
    sample: list[int]
    t0: float
    phases: StepPhases | None = None
    chained: bool = False
    logits: Any = None
    picks: torch.Tensor | None = None
    picks_host: torch.Tensor | None = None
    picks_ready: Any = None  # a torch.cuda.Event
    successor: _Launched | None = None  # the step queued after this one before its tokens were read


def _settle(launched: _Launched) -> None:
    """Wait until a launched step's device work has run (the runner may be released next)."""
    logits = launched.logits
    if isinstance(logits, torch.Tensor) and logits.is_cuda:
        torch.cuda.current_stream(logits.device).synchronize()


class StepRunner(Protocol):
    """What the scheduler asks of its runner (:class:`~engram_trt.runtime.runner.ModelRunner`,
    or a wrapper of one: the distributed leader's): the limits of a step, the model's
    vocabulary and EOS ids, and the per-step calls. ``backend`` and ``phases`` are read
    only by :meth:`Scheduler.attach_phases` (benchmarks), ``device`` only while phases are timed."""

    max_batch: int
    max_num_tokens: int
    max_seq_len: int
    lookback_len: int
    vocab_size: int
    eos_ids: set[int]
    device: torch.device
    backend: Any  # a runtime.backend.Backend
    phases: Any

    def compress(self, ids: np.ndarray) -> np.ndarray: ...

    def compress_on_device(self, ids: torch.Tensor) -> torch.Tensor: ...

    def takes_device_ids(self, step: PackedStep) -> bool: ...

    def reset_slot(self, slot: int) -> None: ...

    def run(self, step: PackedStep, cids: np.ndarray | None, lookback: np.ndarray) -> torch.Tensor: ...


class Scheduler:
    """See the module docstring. ``runner`` runs packed steps (:class:`StepRunner`);
    ``tokenizer`` decodes output text (stop strings are matched on it)."""

    def __init__(self, runner: StepRunner, tokenizer: Any) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.max_slots = runner.max_batch
        self.max_num_tokens = runner.max_num_tokens
        self.max_seq_len = runner.max_seq_len
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._free_slots = list(range(self.max_slots))
        # Each slot's Engram lookback (the last N-1 compressed ids of its sequence): one
        # array for all slots, so a step gathers and advances them in a few NumPy calls.
        self._lookback = np.full((self.max_slots, runner.lookback_len), -1, dtype=np.int64)
        self._cancels = False  # a cancel() since the last reap
        self._cond = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._special_ids = special_token_ids(tokenizer)  # what skip_special_tokens leaves out of the text
        self._byte_ids = byte_fallback_ids(tokenizer)  # byte tokens whose trailing run a stream holds back
        self.phases: StepPhases | None = None  # host time per step by phase (bench serve --host-breakdown)
        # Queue a greedy decode step before the last one's tokens are read (_chainable); off with ENGRAM_TRT_OVERLAP=0
        self.overlap = os.environ.get("ENGRAM_TRT_OVERLAP", "1") != "0"
        self._pick_host: dict[tuple[int, int], torch.Tensor] = {}  # pinned buffers of the tokens' copies
        self._pick_slot = 0
        self.stats = {
            "steps": 0,
            "tokens": 0,
            "prefill_tokens": 0,
            "decode_tokens": 0,
            "requests_finished": 0,
            "max_step_seqs": 0,
            "last_step_seqs": 0,
            "last_step_tokens": 0,
            "step_s": 0.0,
            "chained_steps": 0,
            "chained_stopped_rows": 0,
        }

    # -- admission (any thread) ---------------------------------------------------------
    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        sink: Callable[[RequestOutput], None] | None = None,
        request_id: str | None = None,
    ) -> Request:
        if not prompt_ids:
            raise EngramError("the prompt is empty: give at least one token")
        vocab = self.runner.vocab_size
        bad = [t for t in prompt_ids if not 0 <= int(t) < vocab]
        if bad:
            raise EngramError(f"token id {bad[0]} is outside the model's vocabulary 0..{vocab - 1}")
        need = len(prompt_ids) + params.max_tokens
        if need > self.max_seq_len:
            raise EngramError(
                f"{len(prompt_ids)} prompt tokens + max_tokens {params.max_tokens} = {need} exceed the "
                f"runtime's max_seq_len {self.max_seq_len}; shorten the prompt or lower max_tokens"
            )
        req = Request(request_id or f"req-{next(_ids)}", prompt, [int(t) for t in prompt_ids], params, sink)
        if not params.greedy:
            req.generator = torch.Generator(device="cpu")
            req.generator.manual_seed(0 if params.seed is None else params.seed)
        req.detok = self._detokenizer(req)
        with self._cond:
            if self._stop:
                raise EngramError("the runtime is closed; create a new LLM")
            self._waiting.append(req)
            self._ensure_thread()
            self._cond.notify_all()
        return req

    def cancel(self, req: Request) -> None:
        """Stop a request: it finishes with reason 'cancelled' and frees its slot before the next step."""
        with self._cond:
            req.cancelled = True
            self._cancels = True
            self._cond.notify_all()

    def snapshot(self) -> dict[str, Any]:
        """What a server exposes: running and waiting requests, slots in use, step sizes."""
        with self._cond:
            st = dict(self.stats)
            st.update(
                running=len(self._running),
                waiting=len(self._waiting),
                kv_slots_in_use=self.max_slots - len(self._free_slots),
                kv_slots=self.max_slots,
            )
        st["tokens_per_step"] = round(st["tokens"] / st["steps"], 2) if st["steps"] else 0.0
        return st

    def close(self) -> None:
        with self._cond:
            self._stop = True
            pending = list(self._waiting) + list(self._running)
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        for req in pending:
            if not req.finished:
                self._finish(req, "cancelled", emit=True)

    def attach_phases(self, phases: StepPhases | None) -> None:
        """Time each step's host work by phase (:mod:`engram_trt.runtime.phases`) into
        ``phases`` from the next step on, or stop (None). The runner and its backend mark
        the phases inside them."""
        self.runner.phases = phases
        self.runner.backend.phases = phases
        self.phases = phases

    # -- the engine thread -----------------------------------------------------------------
    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name="engram-scheduler", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        inflight: _Launched | None = None  # a step queued on the device whose tokens are not read yet
        while True:
            ph = self.phases
            if ph is not None and inflight is None:
                ph.begin()
            with self._cond:
                self._reap_cancelled()
                self._admit()
                if self._stop:
                    if inflight is not None:
                        _settle(inflight)  # nothing of the runner is released under a queued step (close() follows)
                    return
                if inflight is None and not self._running and not self._waiting:
                    self._cond.wait()
                    continue  # admit what woke us before planning
                batch = self._plan() if inflight is None else []
                chain = inflight is not None and self._chainable(inflight)
            if inflight is None:
                if not batch:
                    continue
                inflight = self._launch(batch, ph)
                if inflight is None:
                    continue  # the step failed; its requests carry the error
                with self._cond:
                    chain = self._chainable(inflight)
            nxt = self._launch_chained(inflight) if chain else None
            self._complete(inflight)
            inflight = nxt

    def _chainable(self, prev: _Launched) -> bool:
        """Whether the next step can be queued before ``prev``'s tokens are read (called
        under the lock): overlap on, no phases timed, ``prev`` a decode step of greedy
        sequences whose tokens were taken on the device and whose own input ids are known
        here (the next step's Engram lookback ends with them), that step's sequences the
        whole running set (none prefilling, none cancelled, none that would reach its
        ``max_tokens`` with ``prev``'s token), and no request waiting for a free slot.
        (:meth:`_launch_chained` still declines where the runner would compute the
        Engram lookup on the host.)"""
        if not self.overlap or self.phases is not None or prev.picks is None or not prev.decode_only:
            return False
        if prev.cids is None or self._cancels or (self._waiting and self._free_slots):
            return False
        if len(prev.reqs) != len(self._running) or set(map(id, prev.reqs)) != set(map(id, self._running)):
            return False
        return all(not r.finished and len(r.output_ids) + 2 <= r.params.max_tokens for r in prev.reqs)

    def _reap_cancelled(self) -> None:
        if not self._cancels:
            return
        self._cancels = False
        for req in [r for r in self._running if r.cancelled]:
            self._running.remove(req)
            self._finish(req, "cancelled", emit=True)
        for req in [r for r in self._waiting if r.cancelled]:
            self._waiting.remove(req)
            self._finish(req, "cancelled", emit=True)

    def _admit(self) -> None:
        while self._waiting and self._free_slots:
            req = self._waiting.popleft()
            req.slot = self._free_slots.pop(0)
            self.runner.reset_slot(req.slot)
            self._lookback[req.slot] = -1
            self._running.append(req)

    def _plan(self) -> list[tuple[Request, list[int]]]:
        """This step's sequences and the tokens each brings: every decode first, then
        prefill chunks in arrival order under the token budget."""
        budget = self.max_num_tokens
        batch: list[tuple[Request, list[int]]] = []
        for req in self._running:
            if not req.prefilling and budget > 0:
                batch.append((req, [req.output_ids[-1]]))
                budget -= 1
        for req in self._running:
            if req.prefilling and budget > 0:
                n = min(len(req.prompt_ids) - req.processed, budget)
                batch.append((req, req.prompt_ids[req.processed : req.processed + n]))
                budget -= n
        return batch

    def _run(self, batch: list[tuple[Request, list[int]]]) -> None:
        """One step, start to end: launched, then its tokens read and handed out."""
        launched = self._launch(batch, self.phases)
        if launched is not None:
            self._complete(launched)

    def _launch(self, batch: list[tuple[Request, list[int]]], ph: StepPhases | None) -> _Launched | None:
        """Queue ``batch``'s step on the device (and, when every sampled row is greedy and no
        phases are timed, its argmax and an asynchronous copy of the tokens to the host);
        None when the step failed at once (its requests then carry the error)."""
        t0 = time.perf_counter()
        runner = self.runner
        reqs = [req for req, _ in batch]
        chunks = [toks for _, toks in batch]
        seq_lens = [len(c) for c in chunks]
        decode_only = max(seq_lens) == 1
        ids = np.array([c[0] for c in chunks] if decode_only else [t for c in chunks for t in c], dtype=np.int64)
        cids = runner.compress(ids)
        slots = [req.slot for req in reqs]
        slot_idx = np.array(slots, dtype=np.int64)
        lookback = self._lookback[slot_idx]  # a copy: the step (and its prefetch) keeps its own
        step = PackedStep(
            torch.from_numpy(ids),
            seq_lens,
            [req.processed for req in reqs],
            slots,
            lookback=torch.from_numpy(lookback),
            engram_ids=torch.from_numpy(cids),
        )
        sample = [i for i, (req, n) in enumerate(zip(reqs, seq_lens)) if req.processed + n >= len(req.prompt_ids)]
        launched = _Launched(reqs, seq_lens, slots, slot_idx, len(ids), decode_only, lookback, cids, sample, t0, ph)
        return self._queue(launched, step)

    def _launch_chained(self, prev: _Launched) -> _Launched | None:
        """Queue the decode step after ``prev`` (:meth:`_chainable`) before ``prev``'s tokens
        are read: its input ids are ``prev``'s argmax as it lies on the device, their
        compressed ids gathered there (:meth:`ModelRunner.compress_on_device`), each
        sequence one token further on, its Engram lookback ``prev``'s shifted by ``prev``'s
        own compressed ids (known here). The step's host compressed ids are filled in when
        ``prev``'s tokens are read (:meth:`_complete`). None where the runner would read the
        ids on the host for the lookup, or the launch failed: then ``prev`` is read first
        and the next step planned as usual (a failure that lasts fails that step)."""
        runner = self.runner
        S = len(prev.reqs)
        try:
            ids = prev.picks[0]  # type: ignore[index]
            n = prev.lookback.shape[1]
            lookback = (
                np.concatenate([prev.lookback, prev.cids[:, None]], axis=1)[:, 1:]  # type: ignore[index]
                if n
                else prev.lookback
            )
            step = PackedStep(
                ids,
                [1] * S,
                [req.processed + 1 for req in prev.reqs],  # prev's token is in the cache once prev has run
                prev.slots,
                lookback=torch.from_numpy(lookback),
                engram_ids=runner.compress_on_device(ids),
            )
            if not runner.takes_device_ids(step):
                return None
            launched = _Launched(
                prev.reqs,
                prev.seq_lens,
                prev.slots,
                prev.slot_idx,
                S,
                True,
                lookback,
                None,
                prev.sample,
                time.perf_counter(),
                chained=True,
            )
            self._run_step(launched, step)
        except Exception as exc:  # the serial loop runs this step again after prev, and reports what still fails
            log.debug("queueing a decode step ahead failed (%s); it runs after the step before", exc, exc_info=True)
            return None
        prev.successor = launched
        self.stats["chained_steps"] += 1
        return launched

    def _queue(self, launched: _Launched, step: PackedStep) -> _Launched | None:
        try:
            self._run_step(launched, step)
        except Exception as exc:  # a failed step fails its requests, never the server
            self._fail(launched, exc)
            return None
        return launched

    def _run_step(self, launched: _Launched, step: PackedStep) -> None:
        """Run ``step`` on the runner into ``launched``; with the overlap on and no phases
        timed, a step whose every row samples greedily has its argmax taken on the device
        at once (:meth:`_pick_on_device`)."""
        ph = launched.phases
        if ph is not None:
            ph.mark(SCHEDULE)
            ph.gpu_begin(self.runner.device)
        launched.logits = self.runner.run(step, launched.cids, launched.lookback)
        if self.overlap and ph is None and len(launched.sample) == launched.logits.shape[0]:
            if all(launched.reqs[i].params.greedy for i in launched.sample):
                self._pick_on_device(launched)

    def _pick_on_device(self, launched: _Launched) -> None:
        """The argmax and finite flag of every logits row, queued on the device (the next
        step can take the tokens from there), and their copy to the host started."""
        both = launched.picks = _picks(launched.logits)
        if both.is_cuda:
            self._pick_slot ^= 1  # two steps may be in flight: each copies into its own pinned buffer
            key = (self._pick_slot, both.shape[1])
            host = self._pick_host.get(key)
            if host is None:
                host = self._pick_host[key] = torch.empty(both.shape, dtype=torch.int64, pin_memory=True)
            with torch.cuda.device(both.device):  # (the engine thread's current device may be another GPU)
                stream = torch.cuda.current_stream(both.device)
                host.copy_(both, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            launched.picks_host, launched.picks_ready = host, event

    def _fail(self, launched: _Launched, exc: Exception) -> None:
        log.error("step of %d sequences failed: %s", len(launched.reqs), exc, exc_info=log.isEnabledFor(logging.DEBUG))
        with self._cond:
            for req in launched.reqs:
                if req.finished:
                    continue
                req.error = str(exc) if isinstance(exc, EngramError) else f"{type(exc).__name__}: {exc}"
                if req in self._running:
                    self._running.remove(req)
                self._finish(req, "error", emit=True)

    def _complete(self, launched: _Launched) -> None:
        """Read a launched step's tokens (waiting for the device) and hand them out: each
        sequence's progress, lookback, output and stop; the step queued after it (its
        ``successor``) learns its input ids' compressed ids. A chained step's sequence that
        stopped at the step before (EOS, a stop string, cancelled, failed) takes nothing
        of it: its slot's writes are past its end, a new sequence resets the slot, and
        its lookback row is left alone (counted in ``chained_stopped_rows``)."""
        ph = launched.phases
        reqs, seq_lens, sample = launched.reqs, launched.seq_lens, launched.sample
        try:
            if ph is not None:
                ph.mark(FORWARD)
                ph.gpu_wait(launched.logits.device)
            if launched.picks is None:
                tokens, finite = self._sample(launched.logits, [reqs[i] for i in sample], sample)
            else:
                if launched.picks_ready is not None:
                    launched.picks_ready.synchronize()
                tokens, finite = _read_picks(launched.picks_host if launched.picks_host is not None else launched.picks)
            if ph is not None:
                ph.mark(SAMPLE)
            nxt = launched.successor
            if nxt is not None:  # the step queued after this one takes these tokens as its input ids
                nxt.cids = self.runner.compress(np.asarray(tokens, dtype=np.int64))
            live = [not (launched.chained and req.finished) for req in reqs]
            if launched.chained and launched.cids is None and any(live):
                raise EngramError("internal: a queued step's input ids were never read")
        except Exception as exc:  # a failed step fails its requests, never the server
            self._fail(launched, exc)
            return
        decode_tokens = 0
        for req, n, ok in zip(reqs, seq_lens, live):
            if not ok:
                continue
            if n == 1 and req.processed >= len(req.prompt_ids):
                decode_tokens += 1
            req.processed += n
        if all(live):
            self._advance_lookback(
                launched.slots,
                launched.slot_idx,
                seq_lens,
                launched.decode_only,
                launched.lookback,
                launched.cids,  # type: ignore[arg-type]
            )
        elif any(live):
            # a queued decode step: only the sequences still running (a stopped one's slot may be a new request's)
            rows = np.asarray(live)
            self._advance_lookback(
                [],
                launched.slot_idx[rows],
                [1] * int(rows.sum()),
                True,
                launched.lookback[rows],
                launched.cids[rows],  # type: ignore[index]
            )
        now = time.perf_counter()
        with self._cond:
            for i, tok, ok in zip(sample, tokens, finite):
                req = reqs[i]
                if req.finished:
                    continue
                if not ok:  # never a token drawn from garbage: this request ends, the others go on
                    req.error = nonfinite_message(len(req.output_ids))
                    log.info("request %s: %s", req.request_id, req.error)  # the request's output carries it
                    self._running.remove(req)
                    self._finish(req, "error", emit=True)
                    continue
                if req.first_token is None:
                    req.first_token = now
                req.token_times.append(now)
                self._append(req, int(tok))
            ran = launched.num_tokens if not launched.chained else sum(live)  # a stopped row's token is not counted
            st = self.stats
            st["steps"] += 1
            st["tokens"] += ran
            st["decode_tokens"] += decode_tokens
            st["prefill_tokens"] = st["tokens"] - st["decode_tokens"]
            st["chained_stopped_rows"] += len(reqs) - sum(live)
            st["last_step_seqs"], st["last_step_tokens"] = len(reqs), ran
            st["max_step_seqs"] = max(st["max_step_seqs"], len(reqs))
            done = time.perf_counter()
            st["step_s"] += done - launched.t0
            if launched.successor is not None:
                launched.successor.t0 = done  # its host time starts here: step_s sums no interval twice
        if ph is not None:
            ph.mark(OUTPUT)
            ph.end(launched.decode_only, launched.num_tokens)

    def _advance_lookback(
        self,
        slots: list[int],
        slot_idx: np.ndarray,
        seq_lens: list[int],
        decode_only: bool,
        before: np.ndarray,
        cids: np.ndarray,
    ) -> None:
        """Each slot's lookback becomes the last N-1 compressed ids of (its lookback ++
        this step's ids of its sequence); a decode-only step shifts all rows at once."""
        n = self._lookback.shape[1]
        if not n:
            return
        if decode_only:
            if n > 1:
                self._lookback[slot_idx, :-1] = before[:, 1:]
            self._lookback[slot_idx, -1] = cids
            return
        a = 0
        for slot, m in zip(slots, seq_lens):
            self._lookback[slot] = np.concatenate([self._lookback[slot], cids[a : a + m]])[-n:]
            a += m

    def _sample(self, logits: torch.Tensor, reqs: list[Request], rows: list[int]) -> tuple[list[int], list[bool]]:
        """The sampled token of each of ``rows`` (ascending rows of ``logits``), and whether
        that row's logits are all finite (a row that is not samples nothing: its token is
        garbage). Greedy rows take one argmax on the device and one small read, the
        finiteness flags read with the tokens (no extra sync); when every row is greedy
        (a decode step of greedy requests) the argmax runs over the logits as they are,
        with no index to build or send."""
        if not rows:
            return [], []
        greedy = [k for k, r in enumerate(reqs) if r.params.greedy]
        if len(greedy) == len(rows) == logits.shape[0]:  # rows are 0..S-1
            picks, finite = _argmax_and_finite(logits)
            return picks, finite
        out = [0] * len(rows)
        ok = [True] * len(rows)
        if greedy:
            idx = torch.tensor([rows[k] for k in greedy], dtype=torch.int64).to(logits.device, non_blocking=True)
            picks, finite = _argmax_and_finite(logits.index_select(0, idx))
            for k, p, f in zip(greedy, picks, finite):
                out[k], ok[k] = int(p), f
        others = [k for k, r in enumerate(reqs) if not r.params.greedy]
        if others:
            idx = torch.tensor([rows[k] for k in others], dtype=torch.int64).to(logits.device, non_blocking=True)
            host = logits.index_select(0, idx).float().cpu()
            finite = torch.isfinite(host).all(dim=-1).tolist()
            for j, k in enumerate(others):
                if not finite[j]:
                    ok[k] = False  # softmax of NaN: no distribution to draw from
                    continue
                p = reqs[k].params
                out[k] = sample_next(host[j], p.temperature, p.top_p, reqs[k].generator)
        return out, ok

    def _append(self, req: Request, tok: int) -> None:
        """Add a sampled token; stop the request if it should; emit its delta. The text
        is kept incrementally (:mod:`engram_trt.runtime.detokenize`), and stop strings
        are looked for only where they could have newly appeared."""
        req.output_ids.append(tok)
        p = req.params
        reason: str | None = None
        if tok in p.stop_token_ids:
            reason, req.stop_reason = "stop", tok
        elif not p.ignore_eos and tok in self.runner.eos_ids:
            reason, req.stop_reason = "eos", tok
        if req.sink is None and not p.stop:
            # Nobody sees the text before the request ends (no stream, no stop string):
            # it is decoded once, when the request finishes.
            req.text_stale = True
        elif self._update_text(req):
            reason = "stop"
        if reason is None and len(req.output_ids) >= p.max_tokens:
            reason = "length"
        if reason is not None:
            self._running.remove(req)
            self._finish(req, reason, emit=True)
        else:
            self._emit(req)

    def _detokenizer(self, req: Request) -> IncrementalText:
        return IncrementalText(
            self.tokenizer, req.output_ids, req.params.skip_special_tokens, self._special_ids, self._byte_ids
        )

    def _update_text(self, req: Request) -> bool:
        """``req.text`` of all its output ids, cut before the first stop string; True
        when one appeared (its ``stop_reason`` set)."""
        p = req.params
        det = req.detok
        if det is None:  # a request made outside submit()
            det = req.detok = self._detokenizer(req)
        stable = det.stable_len  # text before this cannot change, and held no stop string
        text = det.update()
        if p.stop:
            # A stop string wholly inside the unchangeable text would have stopped an
            # earlier step, so each is looked for from where it could first end anew.
            hits = []
            for s in p.stop:
                pos = text.find(s, max(0, stable - len(s) + 1))
                if pos >= 0:
                    hits.append((pos, s))
            if hits:
                pos, s = min(hits)
                req.text, req.stop_reason = text[:pos], s
                return True
        req.text = text
        return False

    def _emit(self, req: Request) -> None:
        """Send the request's new text and ids. A trailing replacement character may be
        the first half of a multi-byte character split over tokens, and the text of a
        trailing run of byte-fallback tokens may still be rewritten by the next byte
        token: both held back until a later token settles them (or the request ends)."""
        if req.sink is None:
            return  # nobody to send to (generate() reads the whole output at the end)
        text = req.text
        upto = len(text)
        if not req.finished:
            if req.detok is not None:
                upto = min(upto, req.detok.settled_len)
            while upto > req.sent_text and text[upto - 1] == "\ufffd":
                upto -= 1
            # Text that may be the start of a stop string is held back too: if the
            # stop string completes, it is cut from the text and was never sent.
            hold = 0
            for s in req.params.stop:
                for k in range(min(len(s) - 1, len(text)), 0, -1):
                    if text.endswith(s[:k]):
                        hold = max(hold, k)
                        break
            upto = min(upto, len(text) - hold)
        delta_text = text[req.sent_text : upto] if upto >= req.sent_text else ""
        delta_ids = req.output_ids[req.sent_ids :]
        req.sent_text, req.sent_ids = max(upto, req.sent_text), len(req.output_ids)
        if delta_text or delta_ids or req.finished:
            try:
                req.sink(req.output(delta_text, delta_ids))
            except Exception as exc:  # a consumer that broke must not stop the engine
                log.warning("request %s: output consumer failed (%s); cancelling it", req.request_id, exc)
                req.cancelled = True
                self._cancels = True

    def _finish(self, req: Request, reason: str, emit: bool) -> None:
        if req.text_stale:
            req.text = self.tokenizer.decode(req.output_ids, skip_special_tokens=req.params.skip_special_tokens)
            req.text_stale = False
        req.finish_reason = reason
        req.finished_at = time.perf_counter()
        if req.slot is not None:
            self._free_slots.append(req.slot)
            self._free_slots.sort()
            req.slot = None
        self.stats["requests_finished"] += 1
        if emit:
            self._emit(req)
        req.done.set()
