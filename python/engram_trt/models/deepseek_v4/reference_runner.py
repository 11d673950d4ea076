"""CPU execution of DeepSeek-V4's exported serving step, one packed step at a time,
holding what a runtime holds between steps: every per-slot state the graph takes (each
layer's sliding window, compressor entries and rings, the CSA indexer's keys and rings)
and, for V4.1, each slot's Engram lookback (the last N-1 compressed ids). The plugin
nodes run as :func:`~engram_trt.models.reference_executor.reference_ops` binds them
(EngramDsv4Attention through models/deepseek_v4/reference_attention.py), the Engram tables
bound by address through a :class:`~engram_trt.models.reference_ops.TableRegistry`,
so CI checks exactly the graph the engine is built from against transformers.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from engram_trt.errors import EngramError
from engram_trt.models.export import DTYPES, ExportedModel
from engram_trt.models.reference_executor import reference_ops
from engram_trt.models.reference_ops import TableRegistry, packed_step_feeds, staged_rows_feeds


class DeepseekV4ReferenceRunner:
    """See the module docstring. ``tables``: per Engram layer ``(rows, scales or None)``
    as :class:`~engram_trt.models.engram_llama.reference_runner.ReferenceRunner` takes them (bf16
    rows as ml_dtypes or uint16, FP8 rows as uint8 with their ue8m0 scales);
    ``compress_lookup``: raw id -> compressed id (V4.1)."""

    def __init__(
        self,
        exported: ExportedModel,
        config: Any,
        tables: Sequence[tuple[np.ndarray, np.ndarray | None]] = (),
        compress_lookup: Any = None,
        *,
        num_slots: int = 4,
        max_seq_len: int | None = None,
    ) -> None:
        from onnx.reference import ReferenceEvaluator

        from engram_trt.models.deepseek_v4.onnx_export import resolve_dim

        self.exported = exported
        self.config = config
        self.registry = TableRegistry()
        self.evaluator = ReferenceEvaluator(exported.model, new_ops=reference_ops(self.registry))
        self.np_dtype = DTYPES[exported.dtype][1]
        self.num_slots = int(num_slots)
        limit = int(exported.io["max_position"])
        self.max_seq_len = int(max_seq_len or limit)
        if self.num_slots < 1 or not 1 <= self.max_seq_len <= limit:
            raise EngramError(
                f"a runner needs num_slots >= 1 and max_seq_len in [1, {limit}] (got {num_slots}, {max_seq_len})"
            )
        self._tables = [(np.ascontiguousarray(t), None if s is None else np.ascontiguousarray(s)) for t, s in tables]
        n_engram = int(exported.io.get("engram_layers") or 0)
        if len(self._tables) != n_engram and "engram_table_ptrs" in exported.input_names:
            raise EngramError(f"the graph has {n_engram} Engram layers but {len(self._tables)} tables were given")
        self.table_ptrs = np.asarray([self.registry.register(t) for t, _ in self._tables], dtype=np.int64)
        self.scale_ptrs = np.asarray(
            [0 if s is None else self.registry.register(s) for _, s in self._tables], dtype=np.int64
        )
        self.lookup = None if compress_lookup is None else np.asarray(compress_lookup, dtype=np.int64).reshape(-1)
        if n_engram and self.lookup is None:
            raise EngramError("a DeepSeek-V4.1 graph needs the compressed vocab's lookup (compress_lookup)")
        self.states: dict[str, np.ndarray] = {}
        for name, spec in exported.io["states"].items():
            shape = [resolve_dim(d, self.num_slots, self.max_seq_len) for d in spec["shape"]]
            self.states[name] = np.zeros(shape, dtype=self.np_dtype)
        self.lookback = np.full((self.num_slots, int(exported.io.get("lookback") or 0)), -1, dtype=np.int64)

    def run(self, step: Any, *, engram_rows: Sequence[Any] | None = None) -> np.ndarray:
        """:meth:`step` on a :class:`~engram_trt.models.step.PackedStep`."""
        return self.step(step.input_ids, step.seq_starts, step.past_lens, step.slots, engram_rows=engram_rows)

    def step(
        self, input_ids: Any, seq_starts: Any, past_lens: Any, slots: Any, *, engram_rows: Sequence[Any] | None = None
    ) -> np.ndarray:
        """One packed step: ``input_ids [T]`` of S sequences back to back (``seq_starts
        [S+1]``), each after ``past_lens[s]`` tokens held in slot ``slots[s]`` (a sequence
        with no past ignores what its slot holds); ``engram_rows`` only for a prefetch
        graph (per Engram layer ``[T, cols, head_dim]``). Returns the logits of each
        sequence's last token, ``[S, vocab]`` float32; the slots' states and lookbacks
        advance past the step."""
        from engram_trt.engram.hashing import next_lookback

        feeds, (ids, starts, past, seq_slots) = packed_step_feeds(
            input_ids,
            seq_starts,
            past_lens,
            slots,
            num_slots=self.num_slots,
            max_seq_len=self.max_seq_len,
            vocab_size=self.config.vocab_size,
        )
        feeds.update(self.states)
        names = set(self.exported.input_names)
        cids = lookback = None
        if "engram_ids" in names:
            cids = self.lookup[ids]
            feeds["engram_ids"] = cids.astype(np.int32)
            lookback = self.lookback[seq_slots].copy()
            lookback[past == 0] = -1  # a fresh sequence has nothing before it
        if "engram_lookback" in names:
            feeds["engram_lookback"] = lookback.astype(np.int32)
            feeds["engram_table_ptrs"] = self.table_ptrs
            feeds["engram_scale_ptrs"] = self.scale_ptrs
        feeds.update(staged_rows_feeds(names, engram_rows))
        out = dict(zip(self.exported.output_names, self.evaluator.run(None, feeds)))
        for name, spec in self.exported.io["states"].items():
            self.states[name] = out[spec["alias"]]  # the state itself (aliased); adopted should an executor copy
        n = self.lookback.shape[1]
        if cids is not None and n:
            for s in range(seq_slots.shape[0]):
                self.lookback[seq_slots[s]] = next_lookback(lookback[s], cids[starts[s] : starts[s + 1]], n)
        return out["logits"]
