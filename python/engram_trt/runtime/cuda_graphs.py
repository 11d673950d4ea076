"""CUDA graphs of the torch backend's decode step: no Python, no host work per layer.

A decode step of a small model is nearly all host time (on the H200 the demo, hidden
32, spends ~6 ms of Python and launches per token against microseconds of GPU work; a
1.1B model's decode step is host-bound at ~20 ms against ~3 ms of GPU work), so the
torch backend records each decode step shape once and replays it. A step is recorded
per (batch bucket, context bucket): the batch rounded up to a power of two (padding
sequences write into a scratch KV slot the scheduler never hands out), the longest
context rounded up to a power of two (the attention mask hides the rest). A model whose
decode step reads every length on the device (``decode_context_free``: DeepSeek-V4,
whose attention kernel takes the lengths from the step's metadata) gets one graph per
batch bucket whatever the context (its context bucket is the cache's ``max_len``). Everything
that changes between steps — token ids, compressed ids, positions, slots, lengths, the
Engram lookback — lives in static device buffers the graphs read; one pinned copy per
step fills them.

Each Engram layer waits for its own rows where it does in the eager step: the layers
before the first Engram layer run, then the main stream waits for the first Engram
layer's rows, then the layers up to the next Engram layer, and so on. One wait for all
layers would make the first Engram layer wait for every layer's rows: with host tables
a decode step's second gather (100-150 us on the H200 at 64-256 tokens) would sit on the
critical path instead of behind the first Engram layer. The rows come from either
- the GPU gathers (``lookup`` mode), when the tables are GPU-readable and the gather
  policy picks a GPU gather for this many rows: a graph per Engram layer's lookup (the
  first also hashes) replayed on a high-priority side stream, and the step cut into a
  graph per segment between the Engram layers, the main stream waiting on each lookup's
  event. By default (``fork_lookup=True``) the hash and the gathers are captured on
  that side stream forked from one graph of the whole step, each Engram layer joining
  its gather inside the graph: one launch a step. ``fork_lookup=False`` replays them in
  a graph per Engram layer's lookup beside a graph per segment instead (five graph
  launches and four event calls a step at two Engram layers). On the H200 the one graph
  took 1.5-4.4% off a decode step of 1 sequence and 0.3-2.9% off one of 64 in every one
  of eight interleaved rounds (two runs), 0.7-3.1% off one of 256 with HBM tables, and
  tied there with UVA tables (``bench step --rounds``, the ``-separate`` modes;
  docs/benchmarks.md); or
- the prefetcher (the host gather), staged into its fixed buffers; the step is cut
  into a graph per segment, and each layer's wait (``rows[i]``, on the GPU where the
  gather driver runs) is enqueued before its segment. (The driver's wait is on a value
  that changes every step, which a recorded graph cannot hold.)
``wait_each_layer=False`` keeps the older form (one wait at the first Engram layer, for
every layer's rows), for benchmarks that compare the forms in one process.

Recording can fail where a kernel or library call is not capturable; then the backend
logs why once and runs decode steps eagerly (the same function, only slower).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import numpy as np
import torch

from engram_trt.runtime.phases import UPLOAD
from engram_trt.models.step import EngramRows, PackedStep

log = logging.getLogger(__name__)

MIN_CONTEXT_BUCKET = 64
GPU_GATHERS = ("device", "uva")


def _bucket(n: int, floor: int = 1) -> int:
    b = max(floor, 1)
    while b < n:
        b *= 2
    return b


def context_bucket(longest: int, max_len: int, context_free: bool = False) -> int:
    """The context a decode step of ``longest`` tokens (after the step) is recorded for:
    ``max_len`` for a context-free model (one graph per batch bucket), else the longest
    rounded up to a power of two (at least :data:`MIN_CONTEXT_BUCKET`), at most ``max_len``."""
    if context_free:
        return max_len
    return min(_bucket(longest, MIN_CONTEXT_BUCKET), max_len)


def fill_columns(
    h: np.ndarray, step: PackedStep, S: int, G: int, scratch: int, lookup: np.ndarray | None, pad: bool = True
) -> None:
    """A decode step's values into a bucket's host buffer ``h [5 + N-1, >= G]`` (the
    layout :meth:`DecodeGraphs._buffers` names), one column per sequence: token id,
    compressed id, position (its past length), slot, length after the step, the N-1
    lookback ids; with ``pad``, columns S..G-1 as padding sequences on the ``scratch``
    slot (position 0, length 1, compressed id 0, no lookback). Token and compressed ids
    on a device (a step queued before the last one's tokens were read) are not read here
    unless the compressed ids must be made from the token ids: the caller copies them into
    the device buffer."""
    if pad:
        h[:, S:G] = 0
        h[3, S:G] = scratch
        h[4, S:G] = 1
        h[5:, S:G] = -1
    on_host = step.input_ids.device.type == "cpu"
    if on_host or (step.engram_ids is None and lookup is not None):  # (device ids: the caller copies them in)
        ids = step.input_ids.numpy() if on_host else step.input_ids.cpu().numpy()
        h[0, :S] = ids
    if step.engram_ids is not None:
        if step.engram_ids.device.type == "cpu":
            h[1, :S] = step.engram_ids.numpy()
    elif lookup is not None:
        h[1, :S] = lookup[ids]
    h[2, :S] = step.past_lens
    h[3, :S] = step.slots
    h[4, :S] = step.total_lens
    if h.shape[0] > 5 and step.lookback is not None:
        lb = step.lookback
        h[5:, :S] = (lb.cpu().numpy() if isinstance(lb, torch.Tensor) else np.asarray(lb, dtype=np.int64)).T


def static_arrays(d: torch.Tensor, arange: torch.Tensor, G: int, engram: bool) -> dict[str, torch.Tensor]:
    """A recorded step's device arrays (the names of :meth:`PackedStep.device_arrays`) as
    views of the bucket's static buffer ``d`` (:func:`fill_columns`' layout) and of
    ``arange`` (0, 1, 2, ...): what the graphs read at every replay."""
    arrays = {
        "input_ids": d[0, :G],
        "positions": d[2, :G],
        "token_slots": d[3, :G],
        "last": arange[:G],
        "decode_rows": arange[:G],
        "decode_slots": d[3, :G],
        "decode_lens": d[4, :G],
        "seq_starts": arange[: G + 1],
        "past_lens": d[2, :G],
        "slots": d[3, :G],
    }
    if engram:
        arrays["engram_ids"] = d[1, :G]
    return arrays


def capture_mode(model: Any) -> str:
    """``thread_local`` for a tensor-parallel model (models.parallel: its collectives' NCCL
    watchdog runs on another thread during a capture), else ``global``."""
    from engram_trt.models.parallel import is_parallel

    return "thread_local" if is_parallel(model.tp) else "global"


class DecodeGraphs:
    """Recorded decode steps of one model and cache (see the module docstring).
    ``scratch_slot``: a KV slot outside the scheduler's range, for padding sequences.
    ``tables`` + ``lookup_policy(num_rows) -> path``: the lookup goes into a graph when
    the tables are GPU-readable and the policy picks a GPU gather. ``wait_each_layer``:
    a wait per Engram layer (default), else one at the first. ``fork_lookup``: GPU
    lookups forked inside one graph of the step (default), else in graphs of their own."""

    def __init__(
        self,
        model: Any,
        cache: Any,
        max_batch: int,
        scratch_slot: int,
        tables: Any = None,
        lookup_policy: Callable[[int], str] | None = None,
        wait_each_layer: bool = True,
        fork_lookup: bool = True,
    ) -> None:
        self.model = model
        self.cache = cache
        self.device = model.device
        self.max_batch = max_batch
        self.max_len = cache.max_len
        self.scratch = scratch_slot
        self.tables = tables
        self.lookup_policy = lookup_policy
        self.wait_each_layer = wait_each_layer
        self.fork_lookup = fork_lookup
        self.context_free = bool(model.decode_context_free)
        # A tensor-parallel model's steps hold NCCL collectives: the process group's watchdog
        # thread queries its events while this thread captures, which the global mode refuses.
        self.capture_mode = capture_mode(model)
        layout = model.layout
        self.n_lookback = layout.max_ngram_size - 1 if layout is not None else 0
        G = _bucket(max_batch)
        self._rows = 5 + self.n_lookback
        self._bufs: dict[int, tuple[torch.Tensor, torch.Tensor, np.ndarray]] = {}
        self._padded: dict[int, int] = {}  # bucket -> the S whose padding columns its host buffer holds
        self._arange = torch.arange(G + 1, dtype=torch.int64, device=self.device)
        self._starts32 = torch.arange(G + 1, dtype=torch.int32, device=self.device)  # decode: one token each
        self.staging: list[torch.Tensor] | None = None
        if layout is not None and tables is not None:
            self.staging = [
                torch.zeros((G, layout.n_hash_cols, tables.head_dim(i)), dtype=torch.bfloat16, device=self.device)
                for i in range(layout.num_layers)
            ]
        self._lookup_np = None if model.compress_lookup is None else model.compress_lookup.cpu().numpy()
        self._lookup_by_seqs: dict[int, bool] = {}
        self._event = torch.cuda.Event()  # the last copy out of a pinned buffer (one event, re-recorded)
        self._side = torch.cuda.Stream(self.device, priority=-1)  # the lookup graphs: ahead of the layers' blocks
        self._lookup_done = [torch.cuda.Event() for _ in range(layout.num_layers if layout is not None else 0)]
        self._filled = torch.cuda.Event()
        self.graphs: dict[tuple[int, int, str], dict[str, Any]] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.lookup_pool = torch.cuda.graph_pool_handle()  # replays beside `pre`: its own memory
        self.failed: str | None = None
        self.captures = 0  # graph sets recorded (one per step shape), and the seconds spent on them:
        self.capture_s = 0.0  # what `run` reports as graph capture, apart from the steady decode rate
        self.replays = 0
        from engram_trt.runtime.prefetch import bad_row_checker

        self._bad_rows, self._check_bad_rows = bad_row_checker(self.device)

    def _buffers(self, G: int) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        """Bucket G's static buffers ``[rows, G]`` int64 (device, pinned host, and the host
        one as NumPy), one column per padded sequence: token id, compressed id, position
        (= its slot's length before the step), slot, length after the step, then the N-1
        lookback ids. One pair per bucket so each step's copy is one dense block."""
        b = self._bufs.get(G)
        if b is None:
            host = torch.zeros((self._rows, G), dtype=torch.int64, pin_memory=True)
            b = (torch.zeros((self._rows, G), dtype=torch.int64, device=self.device), host, host.numpy())
            self._bufs[G] = b
        return b

    # -- which steps -----------------------------------------------------------------------
    def _fits(self, step: PackedStep) -> bool:
        return self.failed is None and step.is_decode_only and step.num_seqs <= self.max_batch

    def handles_lookup(self, step: PackedStep) -> bool:
        """True when this step's Engram rows will be looked up inside a graph (the caller
        then stages none). The answer depends only on the sequence count (the gather
        policy is a fixed function of the row count), so it is worked out once per count."""
        if not self._fits(step) or self.staging is None or not self.model.engram_enabled:
            return False
        got = self._lookup_by_seqs.get(step.num_seqs)
        if got is None:
            if not self.tables.gpu_readable:
                got = False
            else:
                path = (
                    "device"
                    if self.tables.on_device
                    else (
                        self.lookup_policy(step.num_seqs * self.model.layout.n_hash_cols)
                        if self.lookup_policy is not None
                        else "host"
                    )
                )
                got = path in GPU_GATHERS
            self._lookup_by_seqs[step.num_seqs] = got
        return got

    # -- the step -------------------------------------------------------------------------
    def run(self, step: PackedStep, rows: EngramRows | None, phases: Any = None) -> torch.Tensor | None:
        """Logits ``[S, V]`` of a decode-only step by graph replay, or None when this step
        cannot be replayed (the caller then runs it eagerly). ``rows``: None (the graphs
        look the rows up, or Engram is off) or the prefetcher's staged rows."""
        if not self._fits(step):
            return None
        engram = self.model.layout is not None and self.model.engram_enabled
        if not engram:
            mode = "none"
        elif rows is None:
            if not self.handles_lookup(step):
                return None
            mode = "lookup"
        else:
            if rows.staging is None:
                return None
            mode = "staged"
        S = step.num_seqs
        G = _bucket(S)
        total = step.total_lens
        L = context_bucket(max(total), self.max_len, self.context_free)
        entry = self.graphs.get((G, L, mode))
        if entry is None:
            entry = self._record(G, L, mode, None if mode != "staged" else [s[:G] for s in rows.staging])
            if entry is None:
                return None
        self.model._check_step(step, self.cache)  # the host-side checks an eager step makes
        self._fill(step, S, G)
        if phases is not None:
            phases.mark(UPLOAD)
        main = torch.cuda.current_stream(self.device)
        if mode == "lookup":
            self._check_bad_rows()  # every N steps: did a gather read no table?
        if entry["forked"] or mode == "none":  # one graph: the whole step
            entry["segments"][0].replay()
        elif mode == "staged":
            segments = entry["segments"]
            segments[0].replay()
            for j, (_, group) in enumerate(entry["waits"]):
                for li in group:  # the prefetch of these rows, waited on where their layer reads them
                    rows.wait_layer(li)
                segments[j + 1].replay()
        else:
            self._filled.record(
                main
            )  # the static buffers are filled (one event, re-recorded: wait_stream makes one per call)
            self._side.wait_event(self._filled)
            with torch.cuda.stream(self._side):
                for graph, done in zip(entry["lookup"], self._lookup_done):  # one event per Engram layer
                    graph.replay()
                    done.record(self._side)
            segments = entry["segments"]
            segments[0].replay()
            for j in range(len(entry["waits"])):
                main.wait_event(self._lookup_done[j])
                segments[j + 1].replay()
        self.replays += 1
        lengths = self.cache.lengths
        for slot, n in zip(step.slots, total):
            lengths[slot] = n
        return entry["logits"] if S == G else entry["logits"][:S]

    def _fill(self, step: PackedStep, S: int, G: int) -> None:
        """This step's values into the static buffers: NumPy writes into the pinned
        buffer (no torch op per row), then one asynchronous copy. The padding columns
        S..G-1 (they run on the scratch slot) are rewritten only when S or G changed."""
        dev, host, h = self._buffers(G)
        self._event.synchronize()  # the last copy out of a pinned buffer has run (no-op before the first)
        pad = self._padded.get(G) != S
        fill_columns(h, step, S, G, self.scratch, self._lookup_np, pad)
        if pad:
            self._padded[G] = S
        dev.copy_(host, non_blocking=True)
        self._event.record(torch.cuda.current_stream(self.device))  # the stream the copy went on (this device's)
        if step.input_ids.device.type != "cpu":  # the last step's argmax, where it lies: no host read
            dev[0, :S].copy_(step.input_ids)
        if step.engram_ids is not None and step.engram_ids.device.type != "cpu":  # and their compressed ids
            dev[1, :S].copy_(step.engram_ids)

    # -- recording ------------------------------------------------------------------------
    def _static_step(self, G: int, L: int) -> PackedStep:
        """A step of G one-token sequences at context L whose device arrays are views
        of the static buffers (the host lists only give the shapes)."""
        d = self._buffers(G)[0]
        step = PackedStep(torch.zeros(G, dtype=torch.int64), [1] * G, [L - 1] * G, list(range(G)))
        arrays = static_arrays(d, self._arange, G, self.model.layout is not None)
        if self.model.layout is not None:
            step.engram_ids = torch.zeros(G, dtype=torch.int64)
        step._derived[f"arrays@{self.device}"] = arrays
        return step

    def _hash(self, G: int) -> torch.Tensor:
        """Row ids of the static step, every Engram layer's (kernels only)."""
        from engram_trt.native import hash as hash_kernels

        d = self._buffers(G)[0]
        cids = d[1, :G].to(torch.int32)
        lookback = d[5 : 5 + self.n_lookback, :G].t().contiguous().to(torch.int32)
        return hash_kernels.hash_packed(cids, self._starts32[: G + 1], lookback, self.model.layout)

    def _gather(self, ids: torch.Tensor, li: int, G: int) -> None:
        """Engram layer ``li``'s rows of the static step into the graphs' own staging."""
        from engram_trt.native import gather as gather_kernels

        rows, scales = self.tables.tensors(li)
        gather_kernels.gather(
            ids,
            rows,
            scales,
            layer=li,
            quant_block=self.tables.quant_block,
            out=self.staging[li][:G],
            bad_rows=self._bad_rows,
        )  # type: ignore[index]

    def _lookup(self, G: int) -> None:
        ids = self._hash(G)
        for _, li in self.model.engram_layers:
            self._gather(ids, li, G)

    def _record_forked(
        self, entry: dict[str, Any], step: PackedStep, rows: list[torch.Tensor], G: int, bounds: list[int]
    ) -> torch.cuda.CUDAGraph:
        """One graph of the whole step with its GPU lookup forked onto the side stream:
        the hash and the gathers in the order of ``entry["waits"]``, each group's last
        gather followed by an event that the main stream waits on before the decoder
        layer that reads those rows. The side stream's last event is waited on before the
        last segment, so every forked node joins the graph's origin stream (as capture
        requires)."""
        model, cache = self.model, self.cache
        joins = [torch.cuda.Event() for _ in entry["waits"]]
        fork = torch.cuda.Event()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool, capture_error_mode=self.capture_mode):
            origin = torch.cuda.current_stream(self.device)
            fork.record(origin)
            self._side.wait_event(fork)
            with torch.cuda.stream(self._side):
                entry["ids"] = self._hash(G)
                for (_, group), done in zip(entry["waits"], joins):
                    for li in group:
                        self._gather(entry["ids"], li, G)
                    done.record(self._side)
            state = model.step_begin(step, cache, rows, True)
            for j in range(len(bounds) - 1):
                if j > 0:
                    origin.wait_event(joins[j - 1])
                model.step_layers(state, cache, bounds[j], bounds[j + 1])
            entry["logits"] = model.step_end(state, step, cache, False, True)
        entry["state"] = state  # keeps the tensors the graph reads alive
        return g

    def _record(self, G: int, L: int, mode: str, staged: list[torch.Tensor] | None) -> dict[str, Any] | None:
        t0 = time.perf_counter()
        try:
            return self._record_timed(G, L, mode, staged)
        finally:
            self.captures += 1
            self.capture_s += time.perf_counter() - t0

    def _record_timed(self, G: int, L: int, mode: str, staged: list[torch.Tensor] | None) -> dict[str, Any] | None:
        d = self._buffers(G)[0]
        self._event.synchronize()  # no step's copy into d is in flight
        d[:, :G].zero_()
        d[3, :G].fill_(self.scratch)  # warm-up and capture write only the scratch slot
        d[4, :G].fill_(1)
        d[5:, :G].fill_(-1)
        step = self._static_step(G, L)
        rows = None if mode == "none" else (staged if mode == "staged" else [s[:G] for s in self.staging])  # type: ignore[union-attr]
        model, cache = self.model, self.cache
        # [(decoder layer, Engram layer indices)]: a segment ends before each decoder layer,
        # and the main stream waits there for those Engram layers' rows
        layers = model.engram_layers if mode != "none" else []
        waits = [(layer, [li]) for layer, li in layers]
        if layers and not self.wait_each_layer:
            waits = [(layers[0][0], [li for _, li in layers])]
        forked = mode == "lookup" and self.fork_lookup
        entry: dict[str, Any] = {"waits": waits, "forked": forked}
        cuts = [layer for layer, _ in waits]
        bounds = [0, *cuts, len(model.model.layers)]
        try:
            main = torch.cuda.current_stream(self.device)
            warm = torch.cuda.Stream(self.device)
            warm.wait_stream(main)
            with torch.cuda.stream(warm):
                for _ in range(2):  # lazy inits (cuBLAS handles, kernels) before capture
                    if mode == "lookup":
                        self._lookup(G)
                    model.forward_step(step, cache, engram_rows=rows, capture=True)
            main.wait_stream(warm)
            torch.cuda.synchronize(self.device)
            if forked:
                entry["segments"] = [self._record_forked(entry, step, rows, G, bounds)]
            elif mode == "lookup":
                lookups = []
                for j, (_, group) in enumerate(waits):
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=self.lookup_pool, stream=self._side):
                        if j == 0:
                            entry["ids"] = self._hash(G)  # read by every layer's graph: kept alive
                        for li in group:
                            self._gather(entry["ids"], li, G)
                    lookups.append(g)
                entry["lookup"] = lookups
            if "segments" not in entry:
                segments = []
                state = None
                for j in range(len(bounds) - 1):
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=self.pool, capture_error_mode=self.capture_mode):
                        if j == 0:
                            state = model.step_begin(step, cache, rows, True)
                        model.step_layers(state, cache, bounds[j], bounds[j + 1])
                        if j == len(bounds) - 2:
                            entry["logits"] = model.step_end(state, step, cache, False, True)
                    segments.append(g)
                entry["segments"] = segments
                entry["state"] = state  # keeps the tensors the graphs share alive
        except Exception as exc:  # not capturable here: run eagerly from now on
            self.failed = f"{type(exc).__name__}: {exc}"
            log.warning("CUDA graphs disabled for decode steps (%s); decode steps run eagerly", self.failed)
            torch.cuda.synchronize(self.device)
            return None
        self.graphs[(G, L, mode)] = entry
        log.info(
            "recorded decode CUDA graphs for %d sequences, context %d (%s rows, %s at layers %s)",
            G,
            L,
            mode,
            "joined" if forked else "cut",
            cuts,
        )
        return entry
