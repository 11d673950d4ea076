"""What the runtime asks of a served model (:class:`ServedModel`): the torch module an
architecture's ``load_model`` returns (engram-llama's ``EngramLlama``, ``Qwen4ExpModel``,
``DeepseekV4Model``). The torch backend, the decode-graph recorder
(``runtime/cuda_graphs.DecodeGraphs``) and the benchmarks read these attributes and call
these methods directly; a model inherits the documented defaults and overrides what it
has. Nothing probes a model with ``hasattr`` / ``getattr``.
"""

from __future__ import annotations

from typing import Any


class ServedModel:
    """The served model's interface (module docstring). A mixin of the model's
    ``torch.nn.Module`` class.

    Every model implements :attr:`device`, :attr:`backend_name`, :meth:`new_cache`,
    :meth:`forward_step` and :meth:`set_tables`. A model the runtime's
    ``DecodeGraphs`` records (:meth:`decode_graphs` returning None) also implements the
    staged step: :attr:`engram_layers`, ``step_begin`` / ``step_layers`` / ``step_end``
    and ``_check_step`` (the host-side checks of an eager step), over :attr:`layout`,
    :attr:`compress_lookup` and :attr:`engram_enabled`."""

    # Set by every model (annotations only: a model may hold one as a registered buffer).
    config: Any
    tables: Any  # the Engram row store bound by set_tables (None: the runtime stages the rows)
    tp: Any  # the tensor-parallel group the modules are split over (models.parallel); None: one rank
    uploader: Any  # a models.step.StepUploader on CUDA (the step's metadata in one pinned copy), else None
    # Set by a model the runtime's DecodeGraphs records (the staged step):
    layout: Any  # the Engram layout (engram.layout.EngramLayout), None without Engram layers
    compress_lookup: Any  # raw id -> compressed id on the device, None without Engram layers
    engram_enabled: bool  # False: the Engram layers skipped (a benchmark's backbone alone)
    # Whether the torch backend may record decode steps as CUDA graphs on a GPU.
    supports_decode_graphs: bool = True
    # Whether a decode step reads no padded context (every length from the device), so
    # one recorded graph per batch bucket serves every context length.
    decode_context_free: bool = False

    @property
    def device(self) -> Any:
        """The device the weights are on."""
        raise NotImplementedError(f"{type(self).__name__} declares no device")

    @property
    def backend_name(self) -> str:
        """What ``run`` / ``serve`` report as the backend (the torch path and its kernels)."""
        raise NotImplementedError(f"{type(self).__name__} declares no backend_name")

    @property
    def engram_layers(self) -> list[tuple[int, int]]:
        """``(decoder layer id, Engram layer index)`` of each Engram layer the step runs
        (empty without Engram or with ``engram_enabled`` False)."""
        return []

    def new_cache(self, num_slots: int = 1, max_len: int | None = None) -> Any:
        """The per-sequence state of ``num_slots`` slots of up to ``max_len`` tokens."""
        raise NotImplementedError(f"{type(self).__name__} declares no new_cache")

    def forward_step(self, step: Any, cache: Any, *, engram_rows: Any = None, all_logits: bool = False) -> Any:
        """Logits of one packed step (:class:`~engram_trt.models.step.PackedStep`), the
        state updated in place; ``engram_rows``: rows the runtime staged (None: gathered
        here or none)."""
        raise NotImplementedError(f"{type(self).__name__} declares no forward_step")

    def set_tables(self, tables: Any) -> None:
        """Bind (or swap) the Engram row store, checked against the layout; a model with
        no Engram tables refuses one in one line."""
        raise NotImplementedError(f"{type(self).__name__} declares no set_tables")

    def decode_graphs(self, cache: Any, max_batch: int, scratch_slot: int) -> Any:
        """The model's own recorder of decode steps as CUDA graphs over ``cache``
        (``scratch_slot``: the padding sequences' slot), or None (default): the runtime's
        ``DecodeGraphs`` records the staged step."""
        return None
