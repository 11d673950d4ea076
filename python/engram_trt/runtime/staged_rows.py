"""A step's staged Engram rows: what :meth:`Prefetcher.submit
<engram_trt.runtime.prefetch.Prefetcher.submit>` returns. Per Engram layer, views into
the persistent staging buffers, each waited for lazily where its layer first reads it.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from engram_trt.models.step import EngramRows


class StagedRows(EngramRows):
    """Per Engram layer, the step's rows ``[T, cols, head_dim]`` bf16: views into the
    staging buffers. Reading ``rows[i]`` the first time makes the caller's current CUDA
    stream wait for the prefetch (the host part first, then an event on the side
    stream): the wait sits where the first Engram layer needs the rows.

    ``deferred(i) -> event``: the host gather of layer ``i``, run by the first reader of
    ``rows[i]`` (see engram_trt.runtime.prefetch); each layer's rows are gathered where that
    layer needs them, so the gather of the second Engram layer's rows overlaps the
    first Engram layer on the GPU. :meth:`wait` runs and waits for every layer."""

    def __init__(
        self,
        views: Sequence[torch.Tensor],
        event: Any = None,
        info: dict[str, Any] | None = None,
        staging: Sequence[torch.Tensor] | None = None,
        deferred: Callable[[int], Any] | None = None,
        waiter: Callable[[int, Any], None] | None = None,
        finish: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(views)
        self.staging = list(staging) if staging is not None else None  # the whole fixed buffers (CUDA graphs bind them)
        if waiter is not None:  # a layer's wait is enqueued on the reader's stream: the same lazy protocol
            deferred = None
        self._deferred = deferred
        self._waiter = waiter
        self._finish = finish
        self._layer_ready = [deferred is None and waiter is None] * len(self._views)
        self._event = event
        self._ready = event is None and deferred is None and waiter is None
        self.info = info or {}

    def _mark_wait(self) -> None:
        if "wait_event" in self.info and self._views and not self.info.get("_wait_marked"):
            # timing: where the main stream stood when it first needed rows
            self.info["wait_event"].record(torch.cuda.current_stream(self._views[0].device))
            self.info["_wait_marked"] = True

    def _layer(self, i: int) -> None:
        if self._layer_ready[i]:
            return
        self._mark_wait()
        stream = torch.cuda.current_stream(self._views[i].device)
        if "layer_waits" in self.info:  # timing: where the main stream stood at this layer's read
            mark = torch.cuda.Event(enable_timing=True)
            mark.record(stream)
            self.info["layer_waits"].append(mark)
        if self._waiter is not None:
            self._waiter(i, stream)  # a wait on the GPU for this layer's rows (the gather driver's)
            if "layer_done" in self.info:  # timing: when the reader got past it
                done = self.info["done_event"] if i == len(self._views) - 1 else torch.cuda.Event(enable_timing=True)
                done.record(stream)
                self.info["layer_done"].append(done)
        else:
            assert self._deferred is not None
            ev = self._deferred(i)  # raises a failure of the lookup here
            stream.wait_event(ev)
        self._layer_ready[i] = True

    def finish(self) -> None:
        """On the host, after the step's layers were launched: wait until the lookup's host
        work has run and raise its failure, if any (before the step's output is used)."""
        if self._finish is not None:
            self._finish()

    def wait(self) -> None:
        if self._ready:
            return
        self._mark_wait()
        for i in range(len(self._views)):
            self._layer(i)
        if self._event is not None:
            torch.cuda.current_stream(self._views[0].device).wait_event(self._event)
        self._ready = True

    def wait_layer(self, i: int) -> None:
        """Make the caller's current stream wait for Engram layer ``i``'s rows (every
        layer's, when the rows come as one), as reading ``rows[i]`` does: what a replayed
        CUDA graph segment, which reads the staging buffers directly, calls before it."""
        self[i]

    def __getitem__(self, i: int) -> torch.Tensor:
        if (self._deferred is not None or self._waiter is not None) and not self._ready:
            self._layer(i)
            if all(self._layer_ready):
                self._ready = True
            return self._views[i]
        self.wait()
        return self._views[i]
