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

import torch

from engram_trt.errors import EngramError


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
            raise EngramError(f"a step of {S} sequences needs {S} past lengths and {S} slots (got {len(self.past_lens)} and {len(self.slots)})")
        if min(self.seq_lens) < 1:
            raise EngramError(f"every sequence in a step brings at least one token (seq_lens {self.seq_lens})")
        if min(self.past_lens) < 0:
            raise EngramError(f"past lengths must be >= 0 (got {self.past_lens})")
        if sum(self.seq_lens) != self.input_ids.numel():
            raise EngramError(f"seq_lens sum to {sum(self.seq_lens)} but the step holds {self.input_ids.numel()} tokens")
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
        """Tokens of each sequence in the cache after this step."""
        return [p + n for p, n in zip(self.past_lens, self.seq_lens)]

    @property
    def is_decode_only(self) -> bool:
        return max(self.seq_lens) == 1

    # -- everything a backend reads on the device, in one copy ---------------------------
    def device_arrays(self, device: Any, uploader: "StepUploader | None" = None) -> dict[str, torch.Tensor]:
        """The step's metadata on ``device``: ``input_ids``, ``engram_ids`` (if given),
        ``positions``, ``token_slots``, ``last`` (pack index of each sequence's last
        token), of the one-token sequences ``decode_rows`` / ``decode_slots`` /
        ``decode_lens``, and ``seq_starts``, ``past_lens``, ``slots``, ``lookback``. Built on the host in one int64 array and, with an ``uploader``,
        sent in ONE asynchronous copy from pinned memory: a copy from pageable memory
        would make the host wait for the stream (a synchronization inside the step)."""
        dev = torch.device(device)
        key = f"arrays@{dev}"
        got = self._derived.get(key)
        if got is not None:
            return got
        host: dict[str, torch.Tensor] = {"input_ids": self.input_ids}
        if self.engram_ids is not None:
            host["engram_ids"] = self.engram_ids
        host["positions"] = self.positions()
        host["token_slots"] = self.token_slots()
        host["last"] = self.last_token_index()
        decode = [s for s, n in enumerate(self.seq_lens) if n == 1]
        host["decode_rows"] = torch.tensor([self.seq_starts[s] for s in decode], dtype=torch.int64)
        host["decode_slots"] = torch.tensor([self.slots[s] for s in decode], dtype=torch.int64)
        host["decode_lens"] = torch.tensor([self.total_lens[s] for s in decode], dtype=torch.int64)
        host["seq_starts"] = torch.tensor(self.seq_starts, dtype=torch.int64)
        host["past_lens"] = torch.tensor(self.past_lens, dtype=torch.int64)
        host["slots"] = torch.tensor(self.slots, dtype=torch.int64)
        if self.lookback is not None:
            host["lookback"] = torch.as_tensor(self.lookback, dtype=torch.int64)
        if dev.type == "cpu":
            got = host
        elif uploader is not None:
            got = uploader.upload(host)
        else:
            got = {k: v.to(dev) for k, v in host.items()}
        self._derived[key] = got
        return got

    # -- per-token tensors (built once, on the device asked for) ------------------------
    def positions(self, device: Any = "cpu") -> torch.Tensor:
        """``[T]`` int64: each token's position in its sequence (past length + offset)."""
        def make() -> torch.Tensor:
            parts = [torch.arange(p, p + n, dtype=torch.int64) for p, n in zip(self.past_lens, self.seq_lens)]
            return torch.cat(parts)
        return self._cached("positions", device, make)

    def token_slots(self, device: Any = "cpu") -> torch.Tensor:
        """``[T]`` int64: each token's KV-cache slot."""
        return self._cached("token_slots", device, lambda: torch.repeat_interleave(
            torch.tensor(self.slots, dtype=torch.int64), torch.tensor(self.seq_lens, dtype=torch.int64)))

    def last_token_index(self, device: Any = "cpu") -> torch.Tensor:
        """``[S]`` int64: the index in the pack of each sequence's last token."""
        return self._cached("last", device, lambda: torch.tensor(self.seq_starts[1:], dtype=torch.int64) - 1)

    def _cached(self, name: str, device: Any, make: Any) -> torch.Tensor:
        dev = torch.device(device)
        key = f"{name}@{dev}"
        t = self._derived.get(key)
        if t is None:
            base = self._derived.get(f"{name}@cpu")
            if base is None:
                base = make()
                self._derived[f"{name}@cpu"] = base
            t = base if dev.type == "cpu" else base.to(dev, non_blocking=True)
            self._derived[key] = t
        return t

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def from_sequences(cls, chunks: Sequence[Sequence[int]], past_lens: Sequence[int] | None = None,
                       slots: Sequence[int] | None = None, **kw: Any) -> "PackedStep":
        """A step from per-sequence token lists (slots 0..S-1 and empty caches by default)."""
        S = len(chunks)
        ids = torch.tensor([int(t) for c in chunks for t in c], dtype=torch.int64)
        return cls(ids, [len(c) for c in chunks], list(past_lens) if past_lens is not None else [0] * S,
                   list(slots) if slots is not None else list(range(S)), **kw)


class StepUploader:
    """One pinned host buffer and one device buffer, reused every step, so a step's
    metadata goes to the GPU in a single asynchronous copy (see
    :meth:`PackedStep.device_arrays`). Fixed addresses: a captured graph may bind them.
    The pinned buffer is refilled only after the previous copy out of it has run."""

    def __init__(self, device: Any, capacity: int = 1 << 16) -> None:
        self.device = torch.device(device)
        self.capacity = int(capacity)
        self._host = torch.empty(self.capacity, dtype=torch.int64, pin_memory=True)
        self._dev = torch.empty(self.capacity, dtype=torch.int64, device=self.device)
        self._event: Any = None

    def upload(self, arrays: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        n = sum(int(a.numel()) for a in arrays.values())
        if n > self.capacity:  # grow (rare: a larger step than any before)
            self.__init__(self.device, max(n, 2 * self.capacity))  # type: ignore[misc]
        if self._event is not None:
            self._event.synchronize()
        out: dict[str, torch.Tensor] = {}
        spans = []
        pos = 0
        for k, a in arrays.items():
            m = int(a.numel())
            self._host[pos:pos + m].copy_(a.reshape(-1))
            spans.append((k, pos, m))
            pos += m
        self._dev[:pos].copy_(self._host[:pos], non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record(torch.cuda.current_stream(self.device))
        for k, a, m in spans:
            out[k] = self._dev[a:a + m].view(arrays[k].shape)
        return out
