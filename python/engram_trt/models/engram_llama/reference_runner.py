"""CPU execution of engram-llama's exported serving step, one packed step at a time
(:class:`ReferenceRunner`), holding what a runtime holds between steps: the per-layer KV
caches of every slot (updated in place by the EngramAttention nodes) and each slot's
Engram lookback. The plugin nodes run as
:func:`~engram_trt.models.reference_executor.reference_ops` binds them, so CI checks
exactly the graph the engine is built from against the PyTorch reference model.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from engram_trt.config.model import ModelConfig
from engram_trt.errors import EngramError
from engram_trt.models.export import DTYPES, ExportedModel
from engram_trt.models.reference_executor import reference_ops
from engram_trt.models.reference_ops import TableRegistry, int_array, packed_step_feeds, staged_rows_feeds


class ReferenceRunner:
    """Runs the exported serving graph on the CPU, one packed step at a time, holding the
    KV caches ``[num_slots, kv_heads, max_seq_len, head_dim]`` of every layer (updated in
    place by the EngramAttention nodes) and each slot's Engram lookback, as a runtime does.

    ``tables``: per Engram layer ``(rows uint8 [R, hd] or bf16-as-uint16, scales uint8
    [R, hd/block] or None)`` (e.g. :meth:`Checkpoint.raw_rows_view`, no copy).
    """

    def __init__(
        self,
        exported: ExportedModel,
        config: ModelConfig,
        tables: Sequence[tuple[np.ndarray, np.ndarray | None]] = (),
        compress_lookup: np.ndarray | None = None,
        *,
        num_slots: int = 4,
        max_seq_len: int | None = None,
    ) -> None:
        from onnx.reference import ReferenceEvaluator

        self.exported = exported
        self.config = config
        self.registry = TableRegistry()
        self.evaluator = ReferenceEvaluator(exported.model, new_ops=reference_ops(self.registry))
        self.np_dtype = DTYPES[exported.dtype][1]
        self.lookup = None if compress_lookup is None else np.asarray(compress_lookup, dtype=np.int64)
        self.table_ptrs = np.asarray([self.registry.register(t) for t, _ in tables], dtype=np.int64)
        self.scale_ptrs = np.asarray([0 if s is None else self.registry.register(s) for _, s in tables], dtype=np.int64)
        self._tables = list(tables)  # keep the arrays (and their addresses) alive
        self.num_slots = int(num_slots)
        self.max_seq_len = int(max_seq_len or exported.io["max_position"])
        if self.num_slots < 1 or self.max_seq_len < 1:
            raise EngramError(f"a runner needs num_slots >= 1 and max_seq_len >= 1 (got {num_slots}, {max_seq_len})")
        if self.max_seq_len > exported.io["max_position"]:
            raise EngramError(
                f"max_seq_len {self.max_seq_len} exceeds the graph's rotary table "
                f"({exported.io['max_position']} positions)"
            )
        shape = (self.num_slots, config.num_key_value_heads, self.max_seq_len, config.head_dim)
        self.key_cache = [np.zeros(shape, dtype=self.np_dtype) for _ in range(config.num_hidden_layers)]
        self.value_cache = [np.zeros(shape, dtype=self.np_dtype) for _ in range(config.num_hidden_layers)]
        self.lookback = np.full((self.num_slots, exported.io.get("lookback") or 0), -1, dtype=np.int32)

    def run(self, step: Any, *, engram_rows: Sequence[Any] | None = None) -> np.ndarray:
        """:meth:`step` on a :class:`~engram_trt.models.step.PackedStep` (the one step
        object every backend takes)."""
        return self.step(
            step.input_ids,
            step.seq_starts,
            step.past_lens,
            step.slots,
            step.lookback,
            step.engram_ids,
            engram_rows=engram_rows,
        )

    def step(
        self,
        input_ids: Any,
        seq_starts: Any,
        past_lens: Any,
        slots: Any,
        lookback: Any = None,
        engram_ids: Any = None,
        *,
        engram_rows: Sequence[Any] | None = None,
    ) -> np.ndarray:
        """One packed step (the PackedStep fields, NumPy arrays or torch tensors): the tokens
        ``input_ids [T]`` of S sequences back to back (``seq_starts [S+1]``), each after
        ``past_lens[s]`` cached tokens in KV slot ``slots[s]``; ``lookback [S, N-1]`` (None:
        each slot's own, kept from its previous steps; none for a sequence without past, so
        a slot needs no reset between sequences); ``engram_ids [T]`` overrides the
        compressed ids; ``engram_rows`` (prefetch graphs) per Engram layer ``[T, cols,
        head_dim]``. Returns the logits of each sequence's last token, ``[S, vocab]`` float32."""
        feeds, (ids, starts, past, seq_slots) = packed_step_feeds(
            input_ids,
            seq_starts,
            past_lens,
            slots,
            num_slots=self.num_slots,
            max_seq_len=self.max_seq_len,
            vocab_size=self.config.vocab_size,
        )
        T, S = ids.shape[0], starts.shape[0] - 1
        for i in range(self.config.num_hidden_layers):
            feeds[f"key_cache_{i}"] = self.key_cache[i]
            feeds[f"value_cache_{i}"] = self.value_cache[i]
        names = set(self.exported.input_names)
        n = self.lookback.shape[1]
        cids = used_lookback = None
        if "engram_ids" in names:
            if engram_ids is None:
                if self.lookup is None:
                    raise EngramError(
                        "an Engram graph needs compressed ids: pass engram_ids or give the runner the compressed vocab"
                    )
                cids = self.lookup[ids]
            else:
                cids = int_array(engram_ids, "engram_ids", np.int64, 1)
                if cids.shape != (T,):
                    raise EngramError(f"engram_ids must be [T] = ({T},) (got {cids.shape})")
            feeds["engram_ids"] = cids.astype(np.int32)
            if lookback is None:
                used_lookback = self.lookback[seq_slots].astype(np.int64)
                used_lookback[past == 0] = -1  # a sequence without past has nothing before it
            else:
                used_lookback = int_array(lookback, "lookback", np.int64, 2)
                if used_lookback.shape != (S, n):
                    raise EngramError(f"lookback must be [S, N-1] = {(S, n)} (got {used_lookback.shape})")
        if "engram_lookback" in names:
            feeds["engram_lookback"] = used_lookback.astype(np.int32)
            feeds["engram_table_ptrs"] = self.table_ptrs
            feeds["engram_scale_ptrs"] = self.scale_ptrs
        feeds.update(staged_rows_feeds(names, engram_rows))
        results = self.evaluator.run(None, feeds)
        out = dict(zip(self.exported.output_names, results))
        for i in range(self.config.num_hidden_layers):
            # the aliased outputs are the caches themselves; adopt them should an executor copy
            self.key_cache[i] = out[f"key_cache_out_{i}"]
            self.value_cache[i] = out[f"value_cache_out_{i}"]
        if cids is not None and n:
            from engram_trt.engram.hashing import next_lookback

            for s in range(S):
                a, b = int(starts[s]), int(starts[s + 1])
                self.lookback[seq_slots[s]] = next_lookback(used_lookback[s], cids[a:b], n)
        return out["logits"]
