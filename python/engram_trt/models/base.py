"""What an architecture is (:class:`ArchitectureBase`): every attribute and method the
runtime, builder, CLI, distributed and Triton code ask of a registered architecture,
each either abstract (every architecture implements it) or with the documented default
an architecture inherits. Callers call them directly; nothing probes an architecture
for a method (no ``hasattr`` / ``getattr``).

An architecture lives in ``models/<arch>/architecture.py`` (its config reader and field
contract in ``config.py``, its checks, reference ops and export beside them) and is
found through :mod:`engram_trt.models.registry`.
"""

from __future__ import annotations

import shlex
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Iterable, Mapping

from engram_trt.models.contract import FieldContract

# The float row dtypes a table an architecture holds beside its weights (Qwen4Exp's PLE
# shards) may be stored in, safetensors spelling -> the export's ``table_dtype``.
FLOAT_TABLE_DTYPES = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}


class ArchitectureBase(ABC):
    """One model family as engram-trt serves it (module docstring).

    Declared by every architecture: ``name`` (the registry's spelling, ``deepseek-v4``),
    ``title`` (the family in messages, ``DeepSeek-V4``), ``architectures`` /
    ``model_types`` (the config.json values it serves), ``contract`` (its fields,
    :mod:`engram_trt.models.contract`). Defaults: the backbone not sharded over
    tensor-parallel ranks (``tensor_parallel`` False, :meth:`parallel_plan`), no tables
    of its own beside the Engram tables (:meth:`table_refs`), nothing an engine refuses
    beyond the checkpoint's problems (:meth:`engine_problems`)."""

    name: ClassVar[str]
    title: ClassVar[str]
    architectures: ClassVar[tuple[str, ...]]
    model_types: ClassVar[tuple[str, ...]]
    contract: ClassVar[FieldContract]
    tensor_parallel: ClassVar[bool] = False  # `--tp N` shards the backbone (parallel_plan) and the Engram columns

    # -- the config ---------------------------------------------------------------------
    @abstractmethod
    def read_config(self, d: Mapping[str, Any], source: str | None = None, *, enforce_contract: bool = True) -> Any:
        """The typed config of a config.json dict, every field honoured or refused (the
        first refusal left to the caller with ``enforce_contract=False``: inspect lists them)."""

    def residual_streams(self, config: Any) -> int:
        """How many copies of the hidden state the backbone carries (hyper-connections;
        ``engram-trt inspect`` reports it as ``hc_mult``). Default: the config's
        ``hc_mult`` (engram-llama, DeepSeek-V4)."""
        return int(config.hc_mult)

    # -- the checkpoint's tensors -------------------------------------------------------
    @abstractmethod
    def weight_shapes(self, config: Any) -> dict[str, tuple[int, ...]]:
        """Checkpoint tensor name -> shape of every weight the model reads (no tables)."""

    @abstractmethod
    def tensor_names(self, config: Any) -> set[str]:
        """Every tensor name the model reads from a checkpoint: its weights, their scales,
        its tables."""

    def unused_tensors(self, config: Any, present: Iterable[str]) -> list[str]:
        """Checkpoint tensors the model does not read, in natural order (the registry
        refuses them unless ``--allow-unused-weights``). Default: those
        :meth:`tensor_names` does not name."""
        from engram_trt.checkpoint.checkpoint import natural_key

        used = self.tensor_names(config)
        return sorted((n for n in present if n not in used), key=natural_key)

    @abstractmethod
    def checkpoint_problems(self, ckpt: Any, layout: Any = None) -> list[str]:
        """One line per tensor the model needs that is missing, misshapen or of the wrong
        dtype, and per table that does not fit ``layout`` (the Engram layout the
        compressed vocabulary gives; None: the config's own, or no table check where it
        needs the real one). ``inspect`` lists them; :meth:`validate` refuses the first."""

    def validate(self, ckpt: Any, layout: Any = None) -> None:
        """Refuse a checkpoint with any of :meth:`checkpoint_problems` in one line (the
        first, with the count of the others and the command that lists them)."""
        from engram_trt.errors import CheckpointError

        problems = self.checkpoint_problems(ckpt, layout)
        if problems:
            more = (
                (
                    f" (and {len(problems) - 1} more problem(s); `engram-trt inspect {shlex.quote(str(ckpt.path))}` "
                    f"lists them)"
                )
                if len(problems) > 1
                else ""
            )
            raise CheckpointError(f"checkpoint '{ckpt.path}': {problems[0]}{more}")

    def weight_formats(self, ckpt: Any, dtype: Any = None) -> dict[str, tuple[str, int, int]]:
        """Stored name -> ``(kind, stored bytes, GPU bytes a load takes at dtype)`` of each
        weight the model reads (``fp8`` / ``fp4`` / ``float`` / ``int``; scales counted
        with their weight): what ``engram-trt inspect`` and the GPU-fit check sum.
        Default: :func:`engram_trt.models.weight_formats.generic_weight_formats` (float
        weights loaded in the serving dtype, FP8 ones as stored)."""
        from engram_trt.models.weight_formats import generic_weight_formats

        return generic_weight_formats(self, ckpt, dtype)

    # -- tables of its own (beside the Engram tables) ------------------------------------
    def has_own_tables(self, config: Any) -> bool:
        """Whether ``config`` declares tables of the architecture's own beside its weights
        (:meth:`table_refs`: Qwen4Exp's PLE layers). Default: none."""
        return False

    def table_refs(self, ckpt: Any) -> list[Any]:
        """Where the bytes of the tables the architecture holds outside its weights are
        (Qwen4Exp's PLE shards): :class:`~engram_trt.tables.source.TableRef` s the runtime
        opens in the store ``--engram-config`` picks and the build hashes into its
        manifest. Default: none (the Engram tables are the runtime's:
        :func:`engram_trt.tables.source.checkpoint_table_refs`)."""
        return []

    def table_dtype(self, refs: Any) -> str:
        """The storage of the :meth:`table_refs` tables an engine binds, in the export's
        spelling (``bf16`` / ``fp16`` / ``fp32``: their one float dtype), ``"unsupported"``
        for another dtype or a mix. Asked only where :meth:`table_refs` lists some."""
        kinds = {FLOAT_TABLE_DTYPES.get(r.dtype, "unsupported") for r in refs}
        return kinds.pop() if len(kinds) == 1 else "unsupported"

    def describe_tables(self, ckpt: Any) -> dict[str, Any]:
        """What ``engram-trt inspect`` reports of the :meth:`table_refs` tables (merged
        into its report). Default: nothing."""
        return {}

    def table_report_lines(self, report: Mapping[str, Any]) -> list[str]:
        """The lines ``engram-trt inspect`` prints of what :meth:`describe_tables` put in
        ``report`` (its text form; none: inspect prints the Engram tables' lines instead).
        Default: none."""
        return []

    # -- the torch model ---------------------------------------------------------------
    @abstractmethod
    def build_model(self, config: Any, weights: Mapping[str, Any], **options: Any) -> Any:
        """The torch module of a ``name -> tensor`` mapping (tests, benchmarks)."""

    @abstractmethod
    def load_model(
        self,
        ckpt: Any,
        *,
        device: Any = "cpu",
        dtype: Any = None,
        tables: Any = None,
        engram_config: Any = None,
        compress_lookup: Any = None,
        layout: Any = None,
        parallel: Any = None,
        **options: Any,
    ) -> Any:
        """The torch backend's model (a :class:`~engram_trt.models.served.ServedModel`) of an
        open checkpoint, read tensor by tensor. ``tables``: the store the runtime opened
        (the Engram tables, or :meth:`table_refs`' own ones), bound to the model; None: the
        runtime stages the rows (or the architecture opens its own). ``engram_config``: the
        runtime's (its hot-row cache). ``compress_lookup`` / ``layout``: the Engram
        vocabulary and layout the runtime built (None: the checkpoint's, where needed).
        ``parallel``: a tensor-parallel rank's :class:`~engram_trt.models.parallel.ParallelPlan`
        (the modules at the rank's sizes, only its slices read)."""

    @abstractmethod
    def allocate_state(self, config: Any, num_slots: int, max_len: int, device: Any, dtype: Any) -> Any:
        """The per-sequence state of ``num_slots`` sequences (KV cache; recurrent / conv
        state where the architecture has it): what an engine's state inputs are bound to."""

    def parallel_plan(self, config: Any, tp: int, rank: int = 0) -> Any:
        """TP rank ``rank`` of ``tp``'s :class:`~engram_trt.models.parallel.ParallelPlan`: the
        rank-local config and the split of each stored tensor; a size the model cannot
        split refused in one line. Default: not sharded (each rank holds the whole backbone)."""
        from engram_trt.models.parallel import not_sharded

        return not_sharded(self.title, config, tp, rank)

    # -- the engine ---------------------------------------------------------------------
    @abstractmethod
    def export_onnx(self, config: Any, weights: Any, layout: Any, options: Any) -> Any:
        """The ONNX graph of one packed serving step (:class:`~engram_trt.models.export.ExportedModel`)."""

    def engine_state_inputs(self, config: Any) -> set[str]:
        """The engine inputs of ``config``'s exported step that carry the architecture's
        per-sequence state or its own tables (Qwen4Exp's conv / recurrent / QSA states and
        PLE inputs, DeepSeek-V4's attention states): what the tensorrt backend does not
        bind yet and refuses at load (it also reads the manifest's ``io.states``). Default:
        none (engram-llama's KV caches and Engram tables are bound)."""
        return set()

    def engine_problems(self, ckpt: Any) -> list[str]:
        """What ``engram-trt build`` refuses before any work beyond :meth:`checkpoint_problems`
        (shapes or stored formats its plugins cannot take), one line each. Default: nothing."""
        return []

    def engine_fp8_weights(self, ckpt: Any) -> list[str]:
        """The weights an engine takes as FP8 (the build then compiles for the FP8 targets).
        Default: those of :meth:`weight_shapes` the checkpoint stores F8_E4M3."""
        return [n for n in self.weight_shapes(ckpt.config) if n in ckpt and ckpt.st_dtype(n) == "F8_E4M3"]

    def reference_ops(self) -> list[type]:
        """The ``onnx.reference`` OpRuns of the plugin nodes only this architecture's export
        emits (``models/<arch>/reference_ops.py``), bound beside the shared Engram and
        routed-expert ones by :func:`engram_trt.models.reference_executor.reference_ops`.
        Default: none."""
        return []
