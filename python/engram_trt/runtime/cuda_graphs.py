"""CUDA graphs of the torch backend's decode step: no Python, no host work per layer.

A decode step of a small model is nearly all host time (the demo, hidden 32: ~6 ms of
Python and launches per token on the H200 against microseconds of GPU work), so the
torch backend records each decode step shape once and replays it. A graph is recorded
per (batch bucket, context bucket): the batch rounded up to a power of two (padding
sequences write into a scratch KV slot the scheduler never hands out), the longest
context rounded up to a power of two (the attention mask hides the rest). Everything
that changes between steps — token ids, compressed ids, positions, slots, lengths — lives
in static device buffers the graph reads (one pinned copy per step fills them); the
staged Engram rows are read from the prefetcher's fixed staging buffers. The one thing
lost: the main stream waits for the prefetch before the replay instead of at the first
Engram layer (an event recorded outside a capture cannot be waited on inside it).

Recording can fail where a kernel or library call is not capturable; then the backend
logs why once and runs the step eagerly (the same function, only slower).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from engram_trt.runtime.step import PackedStep

log = logging.getLogger(__name__)

MIN_CONTEXT_BUCKET = 64


def _bucket(n: int, floor: int = 1) -> int:
    b = max(floor, 1)
    while b < n:
        b *= 2
    return b


class DecodeGraphs:
    """Recorded decode steps of one model and cache (see the module docstring).
    ``scratch_slot``: a KV slot outside the scheduler's range, for padding sequences."""

    def __init__(self, model: Any, cache: Any, max_batch: int, scratch_slot: int) -> None:
        self.model = model
        self.cache = cache
        self.device = model.device
        self.max_batch = max_batch
        self.max_len = cache.max_len
        self.scratch = scratch_slot
        G = _bucket(max_batch)
        # Static buffers the graphs read (fixed addresses), one column per padded
        # sequence: rows = token id, compressed id, position (= its slot's length before
        # the step), slot, length after the step. One pinned copy fills them per step.
        self._dev = torch.zeros((5, G), dtype=torch.int64, device=self.device)
        self._host = torch.zeros((5, G), dtype=torch.int64, pin_memory=True)
        self._arange = torch.arange(G, dtype=torch.int64, device=self.device)
        self._event: Any = None
        self.graphs: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.failed: str | None = None
        self.replays = 0

    def _static_step(self, G: int, L: int) -> PackedStep:
        """A step of G one-token sequences at context L whose device arrays are views
        of the static buffers (the host lists only give the shapes)."""
        d = self._dev
        step = PackedStep(torch.zeros(G, dtype=torch.int64), [1] * G, [L - 1] * G, list(range(G)))
        arrays = {"input_ids": d[0, :G], "positions": d[2, :G], "token_slots": d[3, :G], "last": self._arange[:G],
                  "decode_rows": self._arange[:G], "decode_slots": d[3, :G], "decode_lens": d[4, :G]}
        if self.model.layout is not None:
            arrays["engram_ids"] = d[1, :G]
            step.engram_ids = torch.zeros(G, dtype=torch.int64)
        step._derived[f"arrays@{self.device}"] = arrays
        return step

    def _fill(self, step: PackedStep, G: int) -> None:
        """This step's values into the static buffers (one copy; padding -> scratch slot)."""
        S = step.num_seqs
        h = self._host
        if self._event is not None:
            self._event.synchronize()  # the last copy out of the pinned buffer has run
        h[:, S:G] = 0
        h[3, S:G] = self.scratch
        h[4, S:G] = 1
        h[0, :S] = step.input_ids
        if step.engram_ids is not None:
            h[1, :S] = step.engram_ids
        h[2, :S] = torch.tensor(step.past_lens)
        h[3, :S] = torch.tensor(step.slots)
        h[4, :S] = torch.tensor(step.total_lens)
        self._dev[:, :G].copy_(h[:, :G], non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    def run(self, step: PackedStep, rows: Any) -> torch.Tensor | None:
        """Logits ``[S, V]`` of a decode-only step by graph replay, or None when this step
        cannot be replayed (the caller then runs it eagerly)."""
        if self.failed is not None or not step.is_decode_only or step.num_seqs > self.max_batch:
            return None
        G = _bucket(step.num_seqs)
        L = min(_bucket(max(step.total_lens), MIN_CONTEXT_BUCKET), self.max_len)
        staging = None
        if self.model.layout is not None:
            if rows is None or getattr(rows, "staging", None) is None:
                return None
            staging = [s[:G] for s in rows.staging]
        entry = self.graphs.get((G, L))
        if entry is None:
            entry = self._record(G, L, staging)
            if entry is None:
                return None
        self.model._check_step(step, self.cache)  # the host-side checks an eager step makes
        self._fill(step, G)
        if rows is not None:
            rows.wait()  # the main stream waits for the staged rows before the replay
        graph, logits = entry
        graph.replay()
        self.replays += 1
        for s, slot in enumerate(step.slots):
            self.cache.lengths[slot] = step.total_lens[s]
        return logits[:step.num_seqs]

    def _record(self, G: int, L: int, staging: list[torch.Tensor] | None) -> tuple[Any, torch.Tensor] | None:
        d = self._dev
        d[:, :G].zero_()
        d[3, :G].fill_(self.scratch)  # warm-up and capture write only the scratch slot
        d[4, :G].fill_(1)
        step = self._static_step(G, L)
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up: lazy inits (cuBLAS handles, kernels) before capture
                    self.model.forward_step(step, self.cache, engram_rows=staging, capture=True)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                logits = self.model.forward_step(step, self.cache, engram_rows=staging, capture=True)
        except Exception as exc:  # not capturable here: run eagerly from now on
            self.failed = f"{type(exc).__name__}: {exc}"
            log.warning("CUDA graphs disabled for decode steps (%s); decode steps run eagerly", self.failed)
            torch.cuda.synchronize(self.device)
            return None
        self.graphs[(G, L)] = (graph, logits)
        log.info("recorded a decode CUDA graph for %d sequences, context %d", G, L)
        return graph, logits
