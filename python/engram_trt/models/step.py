"""The packed step: what every backend takes, so the scheduler, the prefetcher and the
Triton model are written once (design card: "one runtime, one scheduler, two backends").

A step carries the new tokens of S sequences back to back (T tokens in all): some bring
a prefill chunk, others one decode token. Each sequence names its KV-cache slot and how
many of its tokens the cache already holds; the backend writes the new K/V into the
slots in place and returns logits of each sequence's last token.

Why the metadata also lives on the host: the scheduler knows every length before the
step, and a backend that read them back from the GPU (``int(t.max())``) would put a
host synchronization inside the step. So :class:`PackedStep` keeps plain Python lists
beside the tensors, and the device copies are made once per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from engram_trt.errors import EngramError


class EngramRows:
    """A step's Engram rows as the runtime stages them (subclassed by
    :class:`engram_trt.runtime.staged_rows.StagedRows`, which waits for each layer's rows
    where that layer first reads them): per Engram layer ``[T, cols, head_dim]``, their
    ``shapes`` known without waiting, ``staging`` the whole fixed buffers a recorded
    CUDA graph binds (None: no fixed buffers). A model's ``forward_step`` takes these or
    a plain sequence of tensors (:func:`row_shapes` reads either)."""

    staging: list[torch.Tensor] | None = None

    def __init__(self, views: Sequence[torch.Tensor]) -> None:
        self._views = list(views)

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        """Each layer's rows' shape, without waiting for the rows."""
        return [tuple(v.shape) for v in self._views]

    def __len__(self) -> int:
        return len(self._views)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self._views[i]

    def __iter__(self) -> Any:
        return (self[i] for i in range(len(self)))

    def finish(self) -> None:
        """On the host, after the step's layers were launched: the lookup's host work
        done and its failure raised. Default: nothing to wait for."""

    def wait_layer(self, i: int) -> None:
        """Make the caller's current stream wait for layer ``i``'s rows. Default: they are there."""


def row_shapes(rows: EngramRows | Sequence[torch.Tensor]) -> list[tuple[int, ...]]:
    """Each Engram layer's rows' shape: staged rows' without waiting for them, a plain
    sequence's from its tensors."""
    return rows.shapes if isinstance(rows, EngramRows) else [tuple(r.shape) for r in rows]


@dataclass
class PackedStep:
    """One step's tokens and per-sequence metadata (see the module docstring).

    ``input_ids [T]`` raw token ids; ``seq_lens[s]`` tokens of sequence s in this step
    (>= 1, their sum is T); ``past_lens[s]`` tokens of s already in the KV cache;
    ``slots[s]`` its KV-cache slot (distinct within a step); ``lookback [S, N-1]`` the
    compressed ids of the N-1 tokens before s's first new token (oldest first, -1 =
    none), or None to take them from the cache's per-slot lookback;
    ``engram_ids [T]`` optional compressed-id override (-1 marks a dead token).
    """

    input_ids: torch.Tensor
    seq_lens: list[int]
    past_lens: list[int]
    slots: list[int]
    lookback: torch.Tensor | None = None
    engram_ids: torch.Tensor | None = None
    _derived: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.input_ids = torch.as_tensor(self.input_ids, dtype=torch.int64).reshape(-1)
        self.seq_lens = [int(n) for n in self.seq_lens]
        self.past_lens = [int(p) for p in self.past_lens]
        self.slots = [int(s) for s in self.slots]
        S = len(self.seq_lens)
        if S == 0:
            raise EngramError("a step needs at least one sequence")
        if len(self.past_lens) != S or len(self.slots) != S:
            raise EngramError(
                f"a step of {S} sequences needs {S} past lengths and {S} slots "
                f"(got {len(self.past_lens)} and {len(self.slots)})"
            )
        if min(self.seq_lens) < 1:
            raise EngramError(f"every sequence in a step brings at least one token (seq_lens {self.seq_lens})")
        if min(self.past_lens) < 0:
            raise EngramError(f"past lengths must be >= 0 (got {self.past_lens})")
        if sum(self.seq_lens) != self.input_ids.numel():
            raise EngramError(
                f"seq_lens sum to {sum(self.seq_lens)} but the step holds {self.input_ids.numel()} tokens"
            )
        if len(set(self.slots)) != S:
            raise EngramError(f"two sequences of one step share a KV-cache slot (slots {self.slots})")
        if self.engram_ids is not None:
            self.engram_ids = torch.as_tensor(self.engram_ids, dtype=torch.int64).reshape(-1)
            if self.engram_ids.numel() != self.input_ids.numel():
                raise EngramError(f"engram_ids has {self.engram_ids.numel()} ids for {self.input_ids.numel()} tokens")

    # -- sizes -------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def seq_starts(self) -> list[int]:
        """cu_seqlens ``[S+1]``: sequence s owns tokens ``[seq_starts[s], seq_starts[s+1])``."""
        out = self._derived.get("seq_starts")
        if out is None:
            out = [0]
            for n in self.seq_lens:
                out.append(out[-1] + n)
            self._derived["seq_starts"] = out
        return out

    @property
    def total_lens(self) -> list[int]:
        """Tokens of each sequence in the cache after this step (computed once: callers
        index it per sequence)."""
        out = self._derived.get("total_lens")
        if out is None:
            out = [p + n for p, n in zip(self.past_lens, self.seq_lens)]
            self._derived["total_lens"] = out
        return out

    @property
    def is_decode_only(self) -> bool:
        return max(self.seq_lens) == 1

    # -- everything a backend reads on the device, in one copy ---------------------------
    def host_arrays(self) -> tuple[np.ndarray, list[tuple[str, int, tuple[int, ...]]]]:
        """The step's metadata as ONE host int64 array and its parts ``(name, size,
        shape)`` in order (see :meth:`device_arrays` for the names), built once with vectorized
        NumPy: a step of 64 decode sequences costs the same handful of array operations
        as a step of one."""
        got = self._derived.get("host_arrays")
        if got is not None:
            return got
        S = len(self.seq_lens)
        lens = np.asarray(self.seq_lens, dtype=np.int64)
        past = np.asarray(self.past_lens, dtype=np.int64)
        slots = np.asarray(self.slots, dtype=np.int64)
        starts = np.asarray(self.seq_starts, dtype=np.int64)
        ids = self.input_ids if self.input_ids.device.type == "cpu" else self.input_ids.cpu()
        T = int(starts[-1])
        if T == S:  # decode only: every sequence brings one token
            positions, token_slots, decode = past, slots, None
        else:
            positions = np.arange(T, dtype=np.int64) + np.repeat(past - starts[:-1], lens)
            token_slots = np.repeat(slots, lens)
            decode = lens == 1
        parts: list[tuple[str, np.ndarray]] = [("input_ids", ids.numpy())]
        if self.engram_ids is not None:
            parts.append(("engram_ids", self.engram_ids.cpu().numpy()))
        parts += [("positions", positions), ("token_slots", token_slots), ("last", starts[1:] - 1)]
        if decode is None:
            parts += [("decode_rows", starts[:-1]), ("decode_slots", slots), ("decode_lens", past + 1)]
        else:
            parts += [
                ("decode_rows", starts[:-1][decode]),
                ("decode_slots", slots[decode]),
                ("decode_lens", (past + lens)[decode]),
            ]
        parts += [("seq_starts", starts), ("past_lens", past), ("slots", slots)]
        if self.lookback is not None:
            lb = self.lookback if isinstance(self.lookback, torch.Tensor) else torch.as_tensor(self.lookback)
            parts.append(("lookback", lb.cpu().numpy()))
        spans = [(name, a.size, a.shape) for name, a in parts]
        flat = np.concatenate([a.reshape(-1) for _, a in parts]).astype(np.int64, copy=False)
        got = (flat, spans)
        self._derived["host_arrays"] = got
        return got

    def device_arrays(self, device: Any, uploader: "StepUploader | None" = None) -> dict[str, torch.Tensor]:
        """The step's metadata on ``device``: ``input_ids``, ``engram_ids`` (if given),
        ``positions``, ``token_slots``, ``last`` (pack index of each sequence's last
        token), of the one-token sequences ``decode_rows`` / ``decode_slots`` /
        ``decode_lens``, and ``seq_starts``, ``past_lens``, ``slots``, ``lookback``.
        Built on the host in one int64 array (:meth:`host_arrays`) and sent in ONE copy;
        with an ``uploader`` an asynchronous one from pinned memory: a copy from pageable
        memory would make the host wait for the stream (a synchronization inside the step)."""
        dev = torch.device(device)
        key = f"arrays@{dev}"
        got = self._derived.get(key)
        if got is not None:
            return got
        flat, spans = self.host_arrays()
        if dev.type == "cpu":
            base = torch.from_numpy(flat)
        elif uploader is not None:
            base = uploader.upload_flat(flat)
        else:
            base = torch.from_numpy(flat).to(dev)
        got = {
            name: (t if len(shape) == 1 else t.view(shape))
            for (name, _, shape), t in zip(spans, base.split([n for _, n, _ in spans]))
        }
        self._derived[key] = got
        return got

    # -- per-token tensors (built once, on the device asked for) ------------------------
    def positions(self, device: Any = "cpu") -> torch.Tensor:
        """``[T]`` int64: each token's position in its sequence (past length + offset)."""
        return self._cached("positions", device)

    def token_slots(self, device: Any = "cpu") -> torch.Tensor:
        """``[T]`` int64: each token's KV-cache slot."""
        return self._cached("token_slots", device)

    def last_token_index(self, device: Any = "cpu") -> torch.Tensor:
        """``[S]`` int64: the index in the pack of each sequence's last token."""
        return self._cached("last", device)

    def _cached(self, name: str, device: Any) -> torch.Tensor:
        dev = torch.device(device)
        key = f"{name}@{dev}"
        t = self._derived.get(key)
        if t is None:
            t = self.device_arrays("cpu")[name]
            if dev.type != "cpu":
                t = t.to(dev, non_blocking=True)
            self._derived[key] = t
        return t

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def from_sequences(
        cls,
        chunks: Sequence[Sequence[int]],
        past_lens: Sequence[int] | None = None,
        slots: Sequence[int] | None = None,
        **kw: Any,
    ) -> "PackedStep":
        """A step from per-sequence token lists (slots 0..S-1 and empty caches by default)."""
        S = len(chunks)
        ids = torch.tensor([int(t) for c in chunks for t in c], dtype=torch.int64)
        return cls(
            ids,
            [len(c) for c in chunks],
            list(past_lens) if past_lens is not None else [0] * S,
            list(slots) if slots is not None else list(range(S)),
            **kw,
        )


class StepUploader:
    """One pinned host buffer and one device buffer, reused every step, so a step's
    metadata goes to the GPU in a single asynchronous copy (see
    :meth:`PackedStep.device_arrays`). Fixed addresses: a captured graph may bind them.
    The pinned buffer is refilled only after the previous copy out of it has run."""

    def __init__(self, device: Any, capacity: int = 1 << 16) -> None:
        self.device = torch.device(device)
        self.capacity = int(capacity)
        self._host = torch.empty(self.capacity, dtype=torch.int64, pin_memory=True)
        self._host_np = self._host.numpy()  # the same memory: filled by NumPy, not by torch ops
        self._dev = torch.empty(self.capacity, dtype=torch.int64, device=self.device)
        self._event: Any = None

    def upload_flat(self, flat: np.ndarray) -> torch.Tensor:
        """``flat`` (host int64) on the device: one memcpy into the pinned buffer, one
        asynchronous copy out of it. Returns a view of the device buffer."""
        n = int(flat.size)
        if n > self.capacity:  # grow (rare: a larger step than any before)
            self.__init__(self.device, max(n, 2 * self.capacity))  # type: ignore[misc]
        if self._event is not None:
            self._event.synchronize()  # the last copy out of the pinned buffer has run
        else:
            self._event = torch.cuda.Event()
        self._host_np[:n] = flat
        self._dev[:n].copy_(self._host[:n], non_blocking=True)
        self._event.record(torch.cuda.current_stream(self.device))
        return self._dev[:n]

    def upload(self, arrays: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Several host tensors in one copy (views of the device buffer, same shapes)."""
        flat = (
            np.concatenate([a.reshape(-1).cpu().numpy().astype(np.int64, copy=False) for a in arrays.values()])
            if arrays
            else np.zeros(0, np.int64)
        )
        dev = self.upload_flat(flat)
        out: dict[str, torch.Tensor] = {}
        pos = 0
        for k, a in arrays.items():
            m = int(a.numel())
            out[k] = dev[pos : pos + m].view(a.shape)
            pos += m
        return out


def greedy_tokens(
    model: Any,
    prompt: Sequence[int],
    max_new_tokens: int,
    *,
    chunk: int | None = None,
    max_len: int | None = None,
    ignore_eos: bool = False,
) -> list[int]:
    """Greedy tokens of one sequence through ``model.forward_step`` in slot 0 of a fresh
    ``model.new_cache``: the prompt in chunks of ``chunk`` tokens (default: whole), then
    one token per step, stopping at the config's EOS ids unless ``ignore_eos``. The
    scheduler's oracle for every architecture that serves a packed step."""
    import torch

    state = model.new_cache(1, max_len or len(prompt) + max_new_tokens + 1)
    ids = list(prompt)
    done = 0
    logits = None
    step_len = chunk or len(ids)
    while done < len(ids):
        part = ids[done : done + step_len]
        logits = model.forward_step(PackedStep(torch.tensor(part), [len(part)], [done], [0]), state)
        done += len(part)
    out: list[int] = []
    for _ in range(max_new_tokens):
        tok = int(torch.argmax(logits[0]))
        out.append(tok)
        if tok in model.config.eos_token_ids and not ignore_eos:
            break
        logits = model.forward_step(PackedStep(torch.tensor([tok]), [1], [done], [0]), state)
        done += 1
    return out
