"""The backends' common contract and the choice between them.

A backend runs one :class:`~engram_trt.models.step.PackedStep` against a KV cache it
allocated, with the step's Engram rows staged by the runtime (prefetch placement) or
gathered inside (the engine's in-engine placement), and returns logits of each
sequence's last token. Two backends implement it: ``tensorrt`` (the engine) and
``torch`` (the reference model with the project's CUDA kernels on a GPU, the reference
path on a CPU). ``auto`` takes the first that can run here and says which and why.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch

from engram_trt.errors import EngramError

log = logging.getLogger(__name__)

BACKENDS = ("auto", "tensorrt", "torch")


class Backend(Protocol):
    name: str  # 'torch' | 'tensorrt'
    device: torch.device
    wants_staged_rows: bool  # True: the runtime prefetches rows; False: the engine gathers in place
    weight_bytes: int | None  # the model's weights this process holds (None: inside an engine)

    @property
    def label(self) -> str:
        """What the CLI prints, e.g. 'torch + engram cuda-kernels' or 'tensorrt 10.14 (sm_90)'."""

    def allocate_cache(self, num_slots: int, max_len: int) -> Any: ...

    def execute(self, step: Any, cache: Any, rows: Any) -> torch.Tensor: ...

    def close(self) -> None: ...


def select_backend(requested: str, source: Any, tables: Any, device: torch.device, dtype: torch.dtype,
                   cuda_graphs: bool = True, engram_config: Any = None,
                   tensor_parallel: Any = None) -> tuple[Backend, str]:
    """The backend to run and a one-line reason. ``requested`` 'tensorrt' fails with
    the reason TensorRT cannot run here; 'auto' falls back to torch with it.
    ``tensor_parallel``: this rank's :class:`~engram_trt.models.parallel.TensorParallel`
    (the backbone sharded: the torch backend, an engine holds the whole model)."""
    if requested not in BACKENDS:
        raise EngramError(f"backend {requested!r} is not one of {', '.join(BACKENDS)}")
    tp = tensor_parallel if tensor_parallel is not None and tensor_parallel.size > 1 else None
    reason = "torch backend requested"
    if tp is not None and requested in ("auto", "tensorrt"):
        from engram_trt.runtime.trt_backend import tensorrt_unusable_reason

        why = tensorrt_unusable_reason(source, device) or (
            f"--tp {tp.size} shards the backbone's weights over the ranks, and a TensorRT engine holds the whole model")
        if requested == "tensorrt":
            raise EngramError(f"backend 'tensorrt' cannot run here: {why}; use --backend torch (or auto), which "
                              f"reads each rank's slices from the checkpoint")
        requested, reason = "torch", f"{why}: torch backend"
    if requested in ("auto", "tensorrt"):
        from engram_trt.runtime.trt_backend import TensorRTBackend, tensorrt_unusable_reason

        why = tensorrt_unusable_reason(source, device)
        if why is None:
            try:
                return TensorRTBackend(source, tables, device), "the engine runs under TensorRT on this GPU"
            except EngramError as exc:
                why = str(exc)
        if requested == "tensorrt":
            raise EngramError(f"backend 'tensorrt' cannot run here: {why}; use --backend torch (or auto)")
        reason = f"{why}: torch backend"
    from engram_trt.runtime.torch_backend import TorchBackend

    return TorchBackend(source, tables, device, dtype, cuda_graphs=cuda_graphs, engram_config=engram_config,
                        tensor_parallel=tp), reason
