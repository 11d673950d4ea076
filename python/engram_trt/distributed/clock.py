"""The time a rank spends in its model's collectives (:class:`CollectiveClock`), for the
runs that report it (``ReplicaJob(time_collectives=True)``: the CPU tests count the calls,
the two-GPU check times them per decode step)."""

from __future__ import annotations

from typing import Any


class CollectiveClock:
    """The time a rank spends in its model's collectives (``all_reduce`` / ``all_gather`` of
    its :class:`~engram_trt.models.parallel.TensorParallel`, wrapped on the instance the
    model calls): CUDA events
    around each call on a GPU (none inside a CUDA graph's capture: time eager steps), wall
    time on a CPU. :meth:`summary` per kind: calls and milliseconds."""

    KINDS = ("all_reduce", "all_gather")

    def __init__(self, tp: Any, device: Any) -> None:
        import torch

        self._torch = torch
        self.cuda = getattr(device, "type", str(device)) == "cuda"
        self.marks: dict[str, list[Any]] = {k: [] for k in self.KINDS}
        for kind in self.KINDS:
            setattr(tp, kind, self._timed(kind, getattr(tp, kind)))

    def _timed(self, kind: str, fn: Any) -> Any:
        import time

        torch = self._torch

        def call(*args: Any, **kwargs: Any) -> Any:
            if self.cuda:
                if torch.cuda.is_current_stream_capturing():
                    return fn(*args, **kwargs)
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                out = fn(*args, **kwargs)
                b.record()
                self.marks[kind].append((a, b))
                return out
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.marks[kind].append(time.perf_counter() - t0)
            return out

        return call

    def summary(self) -> dict[str, dict[str, float]]:
        if self.cuda:
            self._torch.cuda.synchronize()
        out = {}
        for kind, marks in self.marks.items():
            ms = sum(float(a.elapsed_time(b)) for a, b in marks) if self.cuda else 1000.0 * sum(marks)
            out[kind] = {"calls": len(marks), "ms": round(ms, 4)}
        return out
