"""CPU execution of Qwen4Exp's exported serving step, one packed step at a time, holding
what a runtime holds between steps: every per-slot state the graph takes (KV and index
key caches, the Gated DeltaNet conv and recurrent states, the PLE conv histories) and
each slot's PLE n-gram context (the last ``ngram_size - 1`` raw ids). The plugin nodes
run as :func:`~engram_trt.models.reference_executor.reference_ops` binds them, the PLE
tables bound by address through a :class:`~engram_trt.models.reference_ops.TableRegistry`,
so CI checks exactly the graph the engine is built from against transformers.
"""

from __future__ import annotations

from typing import Any, Sequence

import ml_dtypes
import numpy as np

from engram_trt.errors import EngramError
from engram_trt.models.export import DTYPES, ExportedModel
from engram_trt.models.reference_executor import reference_ops
from engram_trt.models.reference_ops import TableRegistry, packed_step_feeds


def ple_tables_of(ckpt: Any) -> list[np.ndarray]:
    """Each PLE layer's table ``[rows, head_dim]`` in its shards' dtype (bf16, float16 or
    float32, what the graph's gather reads), its shards joined in row order (what a
    memory store holds); the tests' and scripts' binding for the runner."""
    import torch

    from engram_trt.models.qwen4_exp.ple_tables import table_shard_names

    cfg = ckpt.config
    if cfg.ple is None:
        return []
    out = []
    for li, layer in enumerate(cfg.ple.layers):
        parts = [ckpt.get(n) for n in table_shard_names(cfg, li)]  # the shards torch.chunk wrote
        kinds = {p.dtype for p in parts}
        if len(kinds) != 1 or not kinds <= {torch.bfloat16, torch.float16, torch.float32}:
            raise EngramError(
                f"PLE shards of layer {layer + 1} are {sorted(map(str, kinds))}: the graph's gather reads "
                f"one of bfloat16 / float16 / float32 per table"
            )
        joined = torch.cat(parts, dim=0).contiguous()
        if joined.dtype == torch.bfloat16:
            out.append(joined.view(torch.int16).numpy().view(ml_dtypes.bfloat16).copy())
        else:
            out.append(joined.numpy().copy())
    return out


class Qwen4ExpReferenceRunner:
    """See the module docstring. ``tables``: per PLE layer its rows in the dtype the graph's gather reads
    (:func:`ple_tables_of`)."""

    def __init__(
        self,
        exported: ExportedModel,
        config: Any,
        tables: Sequence[np.ndarray] = (),
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
        self.num_slots = int(num_slots)
        self.max_seq_len = int(max_seq_len or exported.io["max_position"])
        if self.num_slots < 1 or not 1 <= self.max_seq_len <= exported.io["max_position"]:
            raise EngramError(
                f"a runner needs num_slots >= 1 and max_seq_len in [1, {exported.io['max_position']}] "
                f"(got {num_slots}, {max_seq_len})"
            )
        ple = exported.io.get("ple")
        self._tables = [np.ascontiguousarray(t) for t in tables]  # keep the arrays (and their addresses) alive
        if ple is not None and len(self._tables) != ple["layers"]:
            raise EngramError(f"the graph has {ple['layers']} PLE layers but {len(self._tables)} tables were given")
        self.table_ptrs = np.asarray([self.registry.register(t) for t in self._tables], dtype=np.int64)
        self.states: dict[str, np.ndarray] = {}
        for name, spec in exported.io["states"].items():
            shape = [
                self.num_slots if d == "num_slots" else self.max_seq_len if d == "max_seq_len" else int(d)
                for d in spec["shape"]
            ]
            self.states[name] = np.zeros(shape, dtype=self.np_dtype if spec["dtype"] == "act" else np.float32)
        n = 0 if ple is None else int(ple["context"])
        self.eos_id = 0 if ple is None else int(ple["eos_id"])
        self.context = np.full((self.num_slots, n), self.eos_id, dtype=np.int64)

    def run(self, step: Any) -> np.ndarray:
        """:meth:`step` on a :class:`~engram_trt.models.step.PackedStep`."""
        return self.step(step.input_ids, step.seq_starts, step.past_lens, step.slots)

    def step(self, input_ids: Any, seq_starts: Any, past_lens: Any, slots: Any) -> np.ndarray:
        """One packed step: ``input_ids [T]`` of S sequences back to back (``seq_starts
        [S+1]``), each after ``past_lens[s]`` tokens held in slot ``slots[s]`` (a
        sequence with no past ignores what its slot holds). Returns the logits of each
        sequence's last token, ``[S, vocab]`` float32; the slots' states and contexts
        advance past the step."""
        from engram_trt.engram.ple_hash import next_context

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
        ctx = self.context[seq_slots].copy()
        ctx[past == 0] = self.eos_id  # a fresh sequence has no ids before it
        if "ple_context" in self.exported.input_names:
            feeds["ple_context"] = ctx.astype(np.int32)
            feeds["ple_table_ptrs"] = self.table_ptrs
        out = dict(zip(self.exported.output_names, self.evaluator.run(None, feeds)))
        for name, spec in self.exported.io["states"].items():
            self.states[name] = out[spec["alias"]]  # the state itself (aliased); adopted should an executor copy
        if ctx.shape[1]:
            self.context[seq_slots] = next_context(ctx, ids, starts)
        return out["logits"]
