"""Host time of each scheduler step, split into phases.

Why: a small model's decode step is nearly all host work (the demo's GPU work per step
is microseconds, and a replayed CUDA graph leaves only the host's part), so the figure
that matters is where the host's time per step goes. The scheduler, the runner and the
backend call :meth:`StepPhases.mark` at phase boundaries when a :class:`StepPhases` is
attached (``Scheduler.phases``; None when serving: one attribute test per boundary);
each mark charges the time since the previous mark to one phase. Decode-only steps and
steps that carry prefill chunks are summed apart, since the question is the cost of one
decode step.

Phases, in step order:

- ``schedule``: admission, the step's plan, compressed ids, lookback, the PackedStep;
- ``lookup``: staging the Engram rows (the prefetcher's submit; on a CPU the whole
  reference hash and gather; on a GPU with the rows gathered inside a decode graph: 0);
- ``upload``: the step's metadata to the device (a decode graph's static buffers, or
  the eager step's one pinned copy) with the host-side step checks;
- ``forward``: the model (eager) or the graph replays (launches only: the GPU runs on);
- ``gpu_wait``: on a GPU, the host waiting for the step's GPU work to end (timed apart:
  while attached, the scheduler synchronizes the stream here, before sampling; the
  sampled-token read then finds the work done); beside it, ``gpu_us`` is the main
  stream's time from the step's first launch to its last (CUDA events), so a step
  whose ``gpu_us`` is near its total is bound by the GPU, not by the host;
- ``sample``: picking the tokens, including the one device-to-host read of them;
- ``output``: lookback bookkeeping, detokenization, stop checks, the outputs handed to
  the requests' consumers, counters.
"""

from __future__ import annotations

import time
from typing import Any

PHASES = ("schedule", "lookup", "upload", "forward", "gpu_wait", "sample", "output")
SCHEDULE, LOOKUP, UPLOAD, FORWARD, GPU_WAIT, SAMPLE, OUTPUT = range(len(PHASES))
KINDS = ("decode", "prefill")  # decode-only steps; steps with a prefill chunk


class StepPhases:
    """Per-phase host seconds of the steps run while attached (see the module docstring)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.sums = {k: [0.0] * len(PHASES) for k in KINDS}
        self.steps = dict.fromkeys(KINDS, 0)
        self.tokens = dict.fromkeys(KINDS, 0)
        self.gpu_s = dict.fromkeys(KINDS, 0.0)
        self._cur = [0.0] * len(PHASES)
        self._gpu = 0.0
        self._events: Any = None
        self._t = time.perf_counter()

    def begin(self) -> None:
        """A step starts now (time before it, e.g. waiting for requests, is nobody's)."""
        self._cur = [0.0] * len(PHASES)
        self._gpu = 0.0
        self._t = time.perf_counter()

    def gpu_begin(self, device: Any) -> None:
        """The step's GPU work starts being enqueued now (on ``device``'s current stream)."""
        if getattr(device, "type", None) != "cuda":
            return
        import torch

        if self._events is None:
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        self._events[0].record(torch.cuda.current_stream(device))

    def gpu_wait(self, device: Any) -> None:
        """Everything of the step is enqueued: wait for it (charged to ``gpu_wait``) and
        take the stream's time over the step."""
        if getattr(device, "type", None) == "cuda" and self._events is not None:
            import torch

            start, end = self._events
            end.record(torch.cuda.current_stream(device))
            end.synchronize()
            self._gpu = start.elapsed_time(end) / 1e3
        self.mark(GPU_WAIT)

    def mark(self, phase: int) -> None:
        """The time since the last mark (or :meth:`begin`) was spent in ``phase``."""
        now = time.perf_counter()
        self._cur[phase] += now - self._t
        self._t = now

    def end(self, decode_only: bool, tokens: int) -> None:
        """The step is over: add it to its kind."""
        kind = KINDS[0] if decode_only else KINDS[1]
        acc = self.sums[kind]
        for i, v in enumerate(self._cur):
            acc[i] += v
        self.steps[kind] += 1
        self.tokens[kind] += tokens
        self.gpu_s[kind] += self._gpu

    def summary(self) -> dict[str, Any]:
        """Per kind: steps, tokens, and microseconds per step by phase, their total and
        the total without ``forward`` (what a replayed step still pays on the host)."""
        out: dict[str, Any] = {}
        for kind in KINDS:
            n = self.steps[kind]
            us = {p: (s / n * 1e6 if n else 0.0) for p, s in zip(PHASES, self.sums[kind])}
            total = sum(us.values())
            out[kind] = {
                "steps": n,
                "tokens": self.tokens[kind],
                "us_per_step": us,
                "total_us": total,
                "host_us_without_forward": total - us["forward"] - us["gpu_wait"],
                "gpu_us": self.gpu_s[kind] / n * 1e6 if n else 0.0,
            }
        return out


def format_table(summary: dict[str, Any], kind: str = "decode") -> str:
    """The summary of one kind as a text table: microseconds per step and share."""
    s = summary[kind]
    total = s["total_us"] or 1.0
    lines = [
        f"{kind} steps: {s['steps']} ({s['tokens']} tokens); host time per step by phase",
        f"  {'phase':<10} {'us/step':>10} {'share':>7}",
    ]
    for p, v in s["us_per_step"].items():
        lines.append(f"  {p:<10} {v:>10.1f} {v / total:>6.1%}")
    lines.append(f"  {'total':<10} {s['total_us']:>10.1f}")
    lines.append(f"  {'no fwd':<10} {s['host_us_without_forward']:>10.1f}  (all but forward and gpu_wait)")
    lines.append(f"  {'gpu_us':<10} {s['gpu_us']:>10.1f}  (main stream, first launch to last; 0 on a CPU)")
    return "\n".join(lines)
