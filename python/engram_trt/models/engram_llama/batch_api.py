"""The uniform-batch API of :class:`~engram_trt.models.engram_llama.model.EngramLlama`: B sequences
of one length in KV slots 0..B-1 (``forward``, ``prefill``, ``decode``, ``prepare_engram``)
and the one-sequence generation loop (``generate``), each a thin layer over the packed
step (:meth:`EngramLlama.forward_step`). The runtime never uses it; tests and scripts
do, and ``generate`` is the oracle the scheduler is checked against: one sequence, one
token per step, its own cache, none of the runtime's packing, batching or prefetch.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from engram_trt.errors import EngramError
from engram_trt.models.kv_cache import KVCache
from engram_trt.models.sampling import sample_next
from engram_trt.models.step import PackedStep


@dataclass
class GenerateResult:
    """Tokens and timings of one :meth:`EngramLlama.generate` call."""

    prompt_ids: list[int]
    new_ids: list[int]
    prefill_s: float
    decode_s: float
    stopped_at_eos: bool
    decode_steps: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.new_ids

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second over the whole call (prefill included)."""
        return len(self.new_ids) / self.total_s if self.total_s > 0 else float("inf")

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_steps / self.decode_s if self.decode_s > 0 else float("inf")


class UniformBatchAPI:
    """Mixed into EngramLlama (which provides forward_step, prepare_step, new_cache...)."""

    def _as_batch(self, input_ids: Any) -> tuple[torch.Tensor, bool]:
        ids = torch.as_tensor(input_ids, dtype=torch.int64)
        squeeze = ids.ndim <= 1
        if ids.ndim == 0:
            ids = ids.reshape(1, 1)
        elif ids.ndim == 1:
            ids = ids[None]
        elif ids.ndim != 2:
            raise EngramError(f"input_ids must be [T] or [B, T] (got shape {tuple(ids.shape)})")
        return ids.cpu(), squeeze

    def _batch_step(self, ids: torch.Tensor, cache: KVCache, engram_ids: Any, lookback: Any) -> PackedStep:
        B, T = ids.shape
        if T == 0:
            raise EngramError("input_ids is empty: give at least one token")
        if cache.num_slots != B:
            raise EngramError(f"the cache holds {cache.num_slots} sequences but input_ids has {B}")
        past = cache.seq_len
        eids = None
        if engram_ids is not None:
            eids = torch.as_tensor(engram_ids, dtype=torch.int64).cpu()
            if eids.numel() != ids.numel():
                raise EngramError(
                    f"engram_ids has {eids.numel()} ids for {ids.numel()} tokens (expected one compressed id per token)"
                )
        return PackedStep(
            ids.reshape(-1),
            [T] * B,
            [past] * B,
            list(range(B)),
            lookback=None if lookback is None else torch.as_tensor(lookback).reshape(B, -1),
            engram_ids=None if eids is None else eids.reshape(-1),
        )

    @torch.no_grad()
    def forward(
        self,
        input_ids: Any,
        cache: KVCache | None = None,
        *,
        engram_ids: Any = None,
        engram_rows: Sequence[torch.Tensor] | None = None,
        lookback: Any = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Logits (float32) ``[B, T, V]`` (``[T, V]`` for 1-D input; ``T`` dropped when
        ``last_only``) of sequences of one length continuing ``cache`` (slots 0..B-1; a
        fresh cache when None, after ``lookback [B, N-1]`` compressed ids).
        ``engram_rows``: per Engram layer ``[B, T, cols, head_dim]``."""
        ids, squeeze = self._as_batch(input_ids)
        B, T = ids.shape
        if cache is None:
            cache = self.new_cache(B, T)
        elif lookback is not None:
            raise EngramError("lookback comes from the cache when one is given; pass one or the other")
        step = self._batch_step(ids, cache, engram_ids, lookback)
        rows = None
        if engram_rows is not None and self.layout is not None:
            want = (B, T, self.layout.n_hash_cols, int(self.config.engram.head_dim))  # type: ignore[union-attr]
            if len(engram_rows) != self.layout.num_layers or any(tuple(r.shape) != want for r in engram_rows):
                raise EngramError(
                    f"engram_rows must hold {self.layout.num_layers} tensors of shape {want} (one per Engram layer)"
                )
            rows = [r.reshape(B * T, *r.shape[2:]) for r in engram_rows]
        logits = self.forward_step(step, cache, engram_rows=rows, all_logits=not last_only)
        logits = logits if last_only else logits.reshape(B, T, -1)
        return logits[0] if squeeze else logits

    def prepare_engram(
        self, input_ids: Any, cache: KVCache | None = None, *, engram_ids: Any = None, lookback: Any = None
    ) -> list[torch.Tensor]:
        """Rows ``[B, T, cols, head_dim]`` per Engram layer that the next :meth:`forward`
        on ``input_ids`` needs (the prefetch placement; pass them as ``engram_rows``)."""
        ids, _ = self._as_batch(input_ids)
        B, T = ids.shape
        if cache is None:
            cache = self.new_cache(B, T)
        step = self._batch_step(ids, cache, engram_ids, lookback)
        return [r.reshape(B, T, *r.shape[1:]) for r in self.prepare_step(step, cache)]

    def prefill(
        self,
        input_ids: Any,
        cache: KVCache,
        *,
        chunk_size: int | None = None,
        engram_ids: Any = None,
        last_only: bool = True,
    ) -> torch.Tensor:
        """Run a prompt into the cache, in chunks of ``chunk_size`` tokens if given.
        Returns the last position's logits (``[B, V]``) or, with ``last_only=False``, all."""
        ids, squeeze = self._as_batch(input_ids)
        T = ids.shape[1]
        step = T if not chunk_size else int(chunk_size)
        if step < 1:
            raise EngramError(f"chunk_size must be >= 1 (got {chunk_size})")
        cids = None if engram_ids is None else torch.as_tensor(engram_ids, dtype=torch.int64).reshape(ids.shape)
        outs = [
            self.forward(
                ids[:, a : a + step],
                cache,
                engram_ids=None if cids is None else cids[:, a : a + step],
                last_only=last_only,
            )
            for a in range(0, T, step)
        ]
        logits = outs[-1] if last_only else torch.cat(outs, dim=1)
        return logits[0] if squeeze else logits

    def decode(self, token_ids: Any, cache: KVCache) -> torch.Tensor:
        """One step: ``token_ids`` (an int, ``[B]`` or ``[B, 1]``) -> logits ``[B, V]``
        (``[V]`` for an int)."""
        ids = torch.as_tensor(token_ids, dtype=torch.int64)
        scalar = ids.ndim == 0
        logits = self.forward(ids.reshape(-1, 1), cache, last_only=True)
        return logits[0] if scalar else logits

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def generate(
        self,
        prompt_ids: Any,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        eos: int | Sequence[int] | None = None,
        prefill_chunk: int | None = None,
    ) -> GenerateResult:
        """Generate for one sequence, one token per step (the reference loop the runtime's
        scheduler is checked against): greedy when ``temperature == 0``, else
        temperature + top-p sampling from a CPU ``torch.Generator`` seeded with ``seed``.
        Stops after ``max_new_tokens`` or at an ``eos`` id (default: the config's
        ``eos_token_id``; pass ``[]`` to never stop early)."""
        prompt = torch.as_tensor(prompt_ids, dtype=torch.int64).reshape(-1)
        if prompt.numel() == 0:
            raise EngramError("the prompt is empty: give at least one token")
        if max_new_tokens < 0:
            raise EngramError(f"max_new_tokens must be >= 0 (got {max_new_tokens})")
        if not (math.isfinite(temperature) and temperature >= 0) or not (0 < top_p <= 1):
            raise EngramError(
                f"need temperature >= 0 and 0 < top_p <= 1 (got temperature={temperature}, top_p={top_p})"
            )
        stops = (
            set(self.config.eos_token_ids)
            if eos is None
            else ({int(eos)} if isinstance(eos, int) else {int(e) for e in eos})
        )
        limit = self.config.max_position_embeddings
        if prompt.numel() + max_new_tokens > limit:
            raise EngramError(
                f"{prompt.numel()} prompt tokens + {max_new_tokens} new tokens exceed the model's "
                f"max_position_embeddings={limit}"
            )
        gen = torch.Generator(device="cpu")
        gen.manual_seed(0 if seed is None else int(seed))
        cache = self.new_cache(1, prompt.numel() + max(1, max_new_tokens))
        new: list[int] = []
        stopped = False
        self._sync()
        t0 = time.perf_counter()
        logits = self.prefill(prompt, cache, chunk_size=prefill_chunk)
        tok = sample_next(logits, temperature, top_p, gen) if max_new_tokens else None
        self._sync()
        t1 = time.perf_counter()
        steps = 0
        while tok is not None:
            new.append(tok)
            if tok in stops:
                stopped = True
                break
            if len(new) >= max_new_tokens:
                break
            logits = self.decode(tok, cache)
            steps += 1
            tok = sample_next(logits, temperature, top_p, gen)
        self._sync()
        t2 = time.perf_counter()
        return GenerateResult(prompt.tolist(), new, t1 - t0, t2 - t1, stopped, steps)
