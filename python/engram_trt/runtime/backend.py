"""The backends' common contract.

A backend runs one :class:`~engram_trt.models.step.PackedStep` against a KV cache it
allocated, with the step's Engram rows staged by the runtime (prefetch placement) or
gathered inside (the engine's in-engine placement), and returns logits of each
sequence's last token. Two backends implement it: ``tensorrt`` (the engine) and
``torch`` (the reference model with the project's CUDA kernels on a GPU, the reference
path on a CPU). The runner picks one (:func:`engram_trt.runtime.runner.select_backend`).
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch


class DecodeGraphRecorder(Protocol):
    """What the runtime reads of a backend's recorded decode steps (the torch backend's
    :class:`~engram_trt.runtime.cuda_graphs.DecodeGraphs`, or an architecture's own recorder
    from :meth:`~engram_trt.models.served.ServedModel.decode_graphs`: Qwen4Exp's)."""

    failed: str | None  # why recording stopped (None: it did not)
    captures: int  # graph sets recorded (one per step shape)
    capture_s: float  # the seconds they took
    replays: int
    graphs: dict[tuple[Any, ...], Any]  # the recorded sets by shape (DecodeGraphs: (sequences, context, mode))

    def handles_lookup(self, step: Any) -> bool:
        """Whether this step's Engram rows are looked up inside the graphs (none staged)."""

    def run(self, step: Any, rows: Any = None, phases: Any = None) -> torch.Tensor | None:
        """The step's logits by replay, or None (run it eagerly)."""


class Backend(Protocol):
    """What the runner and the scheduler ask of a backend (module docstring). The two
    backends subclass it and inherit the defaults of what only one of them has: no
    decode graphs (``graphs`` None), no lookup inside them (:meth:`handles_lookup`),
    ``lookup_policy`` and ``phases`` plain attributes the runtime sets."""

    name: str  # 'torch' | 'tensorrt'
    device: torch.device
    wants_staged_rows: bool  # True: the runtime prefetches rows; False: the engine gathers in place
    weight_bytes: int | None  # the model's weights this process holds (None: inside an engine)
    graphs: DecodeGraphRecorder | None = None  # the recorded decode steps (torch backend on a GPU)
    # the prefetcher's gather path by row count (runtime.prefetch.Prefetcher.path_for), set by the runner
    lookup_policy: Callable[[int], str] | None = None
    phases: Any = None  # a runtime.phases.StepPhases while a benchmark times the steps (set by the scheduler)

    @property
    def label(self) -> str:
        """What the CLI prints, e.g. 'torch + engram cuda-kernels' or 'tensorrt 10.14 (sm_90)'."""
        raise NotImplementedError

    def allocate_cache(self, num_slots: int, max_len: int) -> Any: ...

    def execute(self, step: Any, cache: Any, rows: Any) -> torch.Tensor: ...

    def handles_lookup(self, step: Any) -> bool:
        """True when this step's Engram rows are looked up inside the backend (the runtime
        then stages none). Default: never."""
        return False

    def close(self) -> None: ...
