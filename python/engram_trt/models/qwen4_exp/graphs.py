"""CUDA graphs of Qwen4Exp's decode steps: the torch backend records each decode step
shape once and replays it (a decode step of this family is dozens of small launches per
layer, mostly host time in eager mode).

Why a runner of its own and not :class:`engram_trt.runtime.cuda_graphs.DecodeGraphs`:
that one is built around engram-llama's staged Engram rows and its per-layer waits;
Qwen4Exp gathers its PLE rows inside the step and keeps per-slot state of four kinds.
What is shared is the shape of the idea: a graph per (batch bucket, context bucket),
the batch rounded up to a power of two (padding sequences run on a scratch slot the
scheduler never hands out), the attention context the step's
:func:`~.model.decode_context` (eager decode steps use the same, so replay and eager run
the same kernels on the same shapes), or one graph per batch bucket when every QSA layer's
decode core runs on the QSA kernel (``Qwen4ExpModel.decode_context_free``: the kernel reads
each query's positions from the step's metadata, so no shape depends on the context);
token ids, positions, slots and the PLE hash's n-gram context live in static device
buffers, filled by one copy from a pinned buffer.

The PLE lookup is recorded in the graph when every PLE layer's rows come from the GPU
gather kernel (HBM or pinned / registered host tables: the hash kernel, then the UVA or
HBM gather); otherwise (tables the GPU cannot read: the host gather) it runs before the
replay, into the graph's static row buffers. The n-gram context advances on the host.
A step shape that cannot be recorded turns the graphs off (logged once): eager steps.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

from engram_trt.engram.ple_hash import next_context
from engram_trt.models.parallel import is_parallel
from engram_trt.models.qwen4_exp.state import decode_context
from engram_trt.models.step import PackedStep

log = logging.getLogger(__name__)


def fill_host(
    h: np.ndarray, ids: np.ndarray, past_lens: list[int], slots: list[int], context: np.ndarray, scratch: int, eos: int
) -> np.ndarray:
    """A decode step of ``S = len(ids)`` sequences into a bucket's host buffer ``h [3 + N-1, G]``
    (:meth:`Qwen4ExpDecodeGraphs._buffers`' layout): token id, position (the past length),
    slot, then the n-gram context ``context[slot]`` (``[slots, N-1]``, the state's host
    array); columns S..G-1 a padding sequence each (position 0, the scratch slot, EOS
    context). NumPy writes into the pinned buffer's memory: a handful of array stores where
    the torch form took some twenty CPU tensor ops a step. Returns the step's contexts
    ``[S, N-1]`` (a copy) for their advance (``engram.ple_hash.next_context``)."""
    S = ids.shape[0]
    h[:, S:] = 0
    h[2, S:] = scratch
    h[3:, S:] = eos
    h[0, :S] = ids
    h[1, :S] = past_lens
    h[2, :S] = slots
    ctx = context[np.asarray(slots, dtype=np.int64)]
    if h.shape[0] > 3:
        h[3:, :S] = ctx.T
    return ctx


def _bucket(n: int) -> int:
    b = 1
    while b < n:
        b *= 2
    return b


class Qwen4ExpDecodeGraphs:
    """Recorded decode steps of one :class:`~.model.Qwen4ExpModel` over one cache
    (module docstring). The interface the torch backend uses: ``run``,
    ``handles_lookup``, ``failed``, ``replays``, ``captures``, ``capture_s``."""

    def __init__(self, model: Any, cache: Any, max_batch: int, scratch_slot: int) -> None:
        self.model = model
        self.cache = cache
        self.device = model.device
        self.max_batch = max_batch
        self.scratch = scratch_slot
        cfg = model.config
        self.n_ctx = cfg.ple.ngram_size - 1 if cfg.ple is not None else 0
        kernel = model._ple_kernel_layers()
        self.lookup_in_graph = cfg.ple is None or (all(kernel) and model._native_ple_hash() is not None)
        # every QSA layer's decode core on the kernel: one graph per batch bucket (context = max_len)
        self.context = cache.max_len if model.decode_context_free else 0
        self.graphs: dict[tuple[int, int], dict[str, Any]] = {}
        self._host: dict[int, torch.Tensor] = {}
        self._host_np: dict[int, np.ndarray] = {}
        self._dev: dict[int, torch.Tensor] = {}
        self._copied = torch.cuda.Event()
        self.pool = torch.cuda.graph_pool_handle()
        self.failed: str | None = None
        self.captures = 0
        self.capture_s = 0.0
        self.replays = 0

    def handles_lookup(self, step: PackedStep) -> bool:
        return False  # no runtime-staged rows for this family

    def _fits(self, step: PackedStep) -> bool:
        return (
            self.failed is None
            and step.is_decode_only
            and step.input_ids.numel() == step.num_seqs
            and step.num_seqs <= self.max_batch
            and min(step.past_lens) > 0
        )

    def _buffers(self, G: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[3 + n_ctx, G]`` int64: token id, position, slot, then the n-gram context."""
        if G not in self._host:
            self._host[G] = torch.zeros((3 + self.n_ctx, G), dtype=torch.int64, pin_memory=True)
            self._host_np[G] = self._host[G].numpy()  # the same memory: NumPy writes, no torch op per field
            self._dev[G] = torch.zeros((3 + self.n_ctx, G), dtype=torch.int64, device=self.device)
        return self._host[G], self._dev[G]

    def run(self, step: PackedStep, rows: Any = None, phases: Any = None) -> torch.Tensor | None:
        """Logits ``[S, vocab]`` of a decode-only step by replay, or None (run it eagerly).
        The logits are the graph's static output: read them before the next step."""
        if rows is not None or not self._fits(step):
            return None
        model, cache = self.model, self.cache
        S, G = step.num_seqs, _bucket(step.num_seqs)
        L = self.context if self.context else decode_context(max(step.total_lens), cache.max_len)
        entry = self.graphs.get((G, L)) or self._record(G, L)
        if entry is None:
            return None
        model._check_step(step, cache)
        if model.config.ple is not None:
            model._maybe_check_bad_rows()
        host, dev = self._buffers(G)
        self._copied.synchronize()  # the last copy out of the pinned buffer has run
        ids = step.input_ids.reshape(-1)
        ids_np = ids.numpy() if ids.device.type == "cpu" else ids.cpu().numpy()
        context = cache.context.numpy()  # the state's host array itself
        ctx = fill_host(self._host_np[G], ids_np, step.past_lens, step.slots, context, self.scratch, cache.eos_id)
        dev.copy_(host, non_blocking=True)
        self._copied.record(torch.cuda.current_stream(self.device))  # the stream the copy went on (this device's)
        if model.config.ple is not None:
            if self.lookup_in_graph:
                context[np.asarray(step.slots, dtype=np.int64)] = next_context(ctx, ids_np, np.arange(S + 1))
            else:  # the host gather before the replay, into the graph's row buffers
                for buf, got in zip(entry["rows"], model.ple_rows(step, cache)):
                    buf[:S].copy_(got)
        entry["graph"].replay()
        self.replays += 1
        for slot, n in zip(step.slots, step.total_lens):
            cache.lengths[slot] = n
        return entry["logits"][:S]

    def _lookup(self, d: torch.Tensor, G: int) -> list[torch.Tensor]:
        """The PLE rows of the static step (hash kernel + gather kernel: recordable)."""
        model = self.model
        ids32 = d[0].to(torch.int32)
        starts = torch.arange(G + 1, dtype=torch.int32, device=self.device)
        ctx32 = d[3:].t().contiguous().to(torch.int32)
        hash_fn = model._native_ple_hash()
        out = []
        for li in range(len(model.config.ple.layers)):
            got = model.ple_tables.gather(li, hash_fn(ids32, starts, ctx32, model.ple_layout, li), checked=False)
            out.append(got.reshape(G, -1).to(model.compute_dtype))
        return out

    def _record(self, G: int, L: int) -> dict[str, Any] | None:
        t0 = time.perf_counter()
        model, cache = self.model, self.cache
        host, d = self._buffers(G)
        self._copied.synchronize()
        d.zero_()
        d[1].fill_(1)  # every padding sequence at position 1 of the scratch slot
        d[2].fill_(self.scratch)
        d[3:].fill_(cache.eos_id)
        entry: dict[str, Any] = {}
        ple = model.config.ple is not None
        if ple and not self.lookup_in_graph:
            width = model.config.ple.embed_dim
            entry["rows"] = [
                torch.zeros((G, width), dtype=model.compute_dtype, device=self.device) for _ in model.config.ple.layers
            ]
        try:

            def body() -> torch.Tensor:
                views = model.decode_views(d[0], d[1], d[2])  # in the graph: the PLE kernel's meta from this step's d
                rows = (self._lookup(d, G) if self.lookup_in_graph else entry["rows"]) if ple else []
                return model.decode_core(views, cache, L, rows)

            main = torch.cuda.current_stream(self.device)
            warm = torch.cuda.Stream(self.device)
            warm.wait_stream(main)
            with torch.cuda.stream(warm):
                for _ in range(2):  # lazy inits (cuBLAS handles, kernel loads) before capture
                    body()
            main.wait_stream(warm)
            torch.cuda.synchronize(self.device)
            g = torch.cuda.CUDAGraph()
            # a tensor-parallel model's NCCL watchdog queries events from its own thread meanwhile
            mode = "thread_local" if is_parallel(model.tp) else "global"
            with torch.cuda.graph(g, pool=self.pool, capture_error_mode=mode):
                entry["logits"] = body()
            entry["graph"] = g
        except Exception as exc:  # noqa: BLE001 - not recordable here: eager decode steps from now on
            self.failed = f"{type(exc).__name__}: {exc}"
            log.warning("Qwen4Exp decode CUDA graphs off (%s); decode steps run eagerly", self.failed)
            torch.cuda.synchronize(self.device)
            return None
        finally:
            self.captures += 1
            self.capture_s += time.perf_counter() - t0
        self.graphs[(G, L)] = entry
        log.info(
            "recorded a Qwen4Exp decode CUDA graph: %d sequences, context %d (PLE lookup %s)",
            G,
            L,
            "in the graph" if self.lookup_in_graph else "before the replay",
        )
        return entry
