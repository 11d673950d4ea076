"""The model runner: one model on one device, ready to run packed steps.

It owns what a step needs besides the tokens: the table store (where the tables live,
chosen by ``--engram-config``), the backend (``tensorrt`` or ``torch``), the KV cache
(one slot per running sequence, allocated once), and the prefetcher that stages each
step's Engram rows on a side stream. The scheduler above it decides what goes into a
step; this module only runs it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

from engram_trt.config.engram import EngramConfig
from engram_trt.errors import EngramError
from engram_trt.runtime.backend import Backend
from engram_trt.runtime.engine_folder import ModelSource
from engram_trt.runtime.gatherpath import GatherPathChoice
from engram_trt.runtime.phases import LOOKUP
from engram_trt.runtime.prefetch import Prefetcher
from engram_trt.models.step import PackedStep

log = logging.getLogger(__name__)

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
BACKENDS = ("auto", "tensorrt", "torch")


def resolve_device(device: Any) -> torch.device:
    """``auto`` (CUDA when available), ``cpu``, ``cuda`` or ``cuda:N``, checked."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise EngramError(f"device {device!r} is not a device (expected auto, cpu, cuda or cuda:N)") from None
    if dev.type not in ("cpu", "cuda"):
        raise EngramError(f"device {device!r}: only cpu and cuda devices are supported")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise EngramError(f"device {device!r}: no CUDA device is available here; use cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise EngramError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def resolve_dtype(dtype: Any, device: torch.device) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    d = DTYPES.get(str(dtype).lower())
    if d is None:
        raise EngramError(f"dtype {dtype!r} is not one of float32 (fp32), bfloat16 (bf16), float16 (fp16)")
    return d


def select_backend(
    requested: str,
    source: Any,
    tables: Any,
    device: torch.device,
    dtype: torch.dtype,
    cuda_graphs: bool = True,
    engram_config: Any = None,
    tensor_parallel: Any = None,
) -> tuple[Backend, str]:
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
            f"--tp {tp.size} shards the backbone's weights over the ranks, and a TensorRT engine holds the whole model"
        )
        if requested == "tensorrt":
            raise EngramError(
                f"backend 'tensorrt' cannot run here: {why}; use --backend torch (or auto), which "
                f"reads each rank's slices from the checkpoint"
            )
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

    return TorchBackend(
        source, tables, device, dtype, cuda_graphs=cuda_graphs, engram_config=engram_config, tensor_parallel=tp
    ), reason


class ModelRunner:
    """See the module docstring. ``max_batch`` KV slots of ``max_seq_len`` tokens;
    a step holds at most ``max_num_tokens`` tokens."""

    def __init__(
        self,
        source: ModelSource,
        *,
        backend: str = "auto",
        device: Any = "auto",
        dtype: Any = None,
        engram_config: EngramConfig | None = None,
        max_batch: int | None = None,
        max_seq_len: int | None = None,
        max_num_tokens: int | None = None,
        progress: bool = True,
        table_options: dict[str, Any] | None = None,
        engram_lookup: Any = None,
        cuda_graphs: bool = True,
        tensor_parallel: Any = None,
    ) -> None:
        from engram_trt.tables.store import open_tables, table_kind_for

        self.source = source
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        cfg = source.config
        self.max_batch = _positive("max_batch_size", max_batch, source.max_batch)
        self.max_seq_len = _positive("max_seq_len", max_seq_len, source.max_seq_len)
        self.max_num_tokens = _positive("max_num_tokens", max_num_tokens, source.max_num_tokens)
        if self.max_seq_len > cfg.max_position_embeddings:
            raise EngramError(
                f"max_seq_len {self.max_seq_len} exceeds the model's "
                f"max_position_embeddings={cfg.max_position_embeddings}"
            )
        self.engram_config = engram_config or source.engram_config
        self.engram_config.validate_for(cfg)
        self.vocab_size = cfg.vocab_size
        self.eos_ids = set(cfg.eos_token_ids)
        self.lookback_len = cfg.engram.max_ngram_size - 1 if cfg.engram is not None else 0
        self._lookup = source.compress_lookup
        self._lookup_dev: torch.Tensor | None = None  # its device copy (compress_on_device)
        if self._lookup is not None and self._lookup.shape[0] < cfg.vocab_size:
            pad = np.full(cfg.vocab_size - self._lookup.shape[0], -1, dtype=np.int64)
            self._lookup = np.concatenate([self._lookup, pad])
        t0 = time.perf_counter()
        self.tables = None
        self.table_kind = "none"
        # Hook (engram_trt.distributed): a factory of the step's Engram lookup used in
        # place of the table store and the Prefetcher (same submit contract), e.g. one
        # that holds only this rank's column slice and all-gathers the rows.
        self.engram_lookup = None
        if source.table_refs and engram_lookup is not None:
            self.engram_lookup = engram_lookup(
                source=source,
                device=self.device,
                max_num_tokens=self.max_num_tokens,
                engram_config=self.engram_config,
                progress=progress,
                table_options=table_options,
            )
            self.table_kind = self.engram_lookup.table_kind
        elif source.table_refs:
            self.table_kind = table_kind_for(self.engram_config, self.device)
            # Engram tables, or an architecture's own (Qwen4Exp's PLE: bf16 rows, no quant block)
            quant_block = cfg.engram.quant_block if cfg.engram is not None else 32
            self.tables = open_tables(
                source.table_refs,
                self.table_kind,
                quant_block=quant_block,
                device=self.device,
                progress=progress,
                **(table_options or {}),
            )
            self.table_kind = self.tables.kind  # a shared store may fall back to private memory
        # Hook (engram_trt.distributed): this rank's TensorParallel, the backbone sharded over the replica's TP ranks
        self.tensor_parallel = tensor_parallel
        self.backend, self.backend_reason = select_backend(
            backend,
            source,
            self.tables,
            self.device,
            self.dtype,
            cuda_graphs=cuda_graphs,
            engram_config=self.engram_config,
            tensor_parallel=tensor_parallel,
        )
        log.info("backend: %s (%s)", self.backend.label, self.backend_reason)
        self.cache = self.backend.allocate_cache(self.max_batch, self.max_seq_len)
        self.prefetcher = None
        self.gather_calibration: GatherPathChoice | None = None  # the start-up calibration (host tables on a GPU)
        if self.engram_lookup is not None:
            if not self.backend.wants_staged_rows:
                raise EngramError(
                    f"the {self.backend.name} backend gathers Engram rows inside the engine, "
                    "so a sharded lookup cannot feed it; build the engine with --engram-config.table_placement "
                    "prefetch or use --backend torch"
                )
            self.prefetcher = self.engram_lookup  # hook (engram_trt.distributed)
        elif self.tables is not None and self.backend.wants_staged_rows and source.layout is not None:
            # (no Engram layout: the model gathers its own rows from the store in the step)
            self.prefetcher = Prefetcher(source.layout, self.tables, self.device, self.max_num_tokens)
            self.gather_calibration = self.prefetcher.calibrate()
            self.backend.lookup_policy = self.prefetcher.path_for  # the decode graphs' lookup path (torch backend)
        self.phases: Any = None  # a runtime.phases.StepPhases while a benchmark times the steps
        self.load_s = time.perf_counter() - t0

    # -- per step ---------------------------------------------------------------------
    def compress(self, ids: np.ndarray) -> np.ndarray:
        """Compressed ids (int64, -1 = none) of raw ids, on the host."""
        if self._lookup is None:
            return np.zeros_like(ids)
        return self._lookup[ids]

    def compress_on_device(self, ids: torch.Tensor) -> torch.Tensor:
        """Compressed ids (int64, -1 = none) of raw ids that lie on the device, gathered
        there (no host read): a step queued before its ids were read (the scheduler's overlap)."""
        if self._lookup is None:
            return torch.zeros_like(ids)
        if self._lookup_dev is None or self._lookup_dev.device != ids.device:
            self._lookup_dev = torch.from_numpy(self._lookup).to(ids.device)
        return self._lookup_dev.index_select(0, ids)

    def takes_device_ids(self, step: PackedStep) -> bool:
        """Whether ``step`` may carry input and compressed ids that lie on the device,
        unread: nothing of the step's Engram lookup is computed on the host (no Engram
        tables, or the decode graphs hash and gather the rows themselves), or the ids are
        in host memory anyway (a CPU run). Other paths read device ids back (correct,
        with a wait)."""
        if step.input_ids.device.type == "cpu" or self.prefetcher is None:
            return True
        return self.backend.handles_lookup(step)

    def reset_slot(self, slot: int) -> None:
        self.cache.reset(slot)

    def run(self, step: PackedStep, cids: np.ndarray | None, lookback: np.ndarray) -> torch.Tensor:
        """Logits ``[S, V]`` (float32, on the device) of each sequence's last token.
        The Engram rows are staged first (side stream), then the backend runs. ``cids``:
        the compressed ids on the host, for the prefetcher (None for a step queued before its
        ids were read: made from the step's own, which :meth:`takes_device_ids` admits only
        where the prefetcher does not run or they are in host memory)."""
        if step.num_tokens > self.max_num_tokens:
            raise EngramError(f"a step of {step.num_tokens} tokens exceeds max_num_tokens={self.max_num_tokens}")
        rows = None
        if self.prefetcher is not None and not self.backend.handles_lookup(step):
            if cids is None:  # a queued step's compressed ids, made where its ids lie (a CPU's: read at once)
                cids = (
                    step.engram_ids.cpu().numpy()
                    if step.engram_ids is not None
                    else self.compress(step.input_ids.cpu().numpy())
                )
            rows = self.prefetcher.submit(step, cids, lookback)
        if self.phases is not None:
            self.phases.mark(LOOKUP)
        logits = self.backend.execute(step, self.cache, rows)
        if rows is not None:
            rows.finish()  # the lookup's host work has run; its failure is raised before the logits are used
        return logits

    # -- what it is -----------------------------------------------------------------------
    @property
    def backend_label(self) -> str:
        return self.backend.label

    def graph_capture(self) -> dict[str, Any]:
        """CUDA graphs recorded so far for decode steps and the seconds they took
        (captures happen inside the first decode step of each new batch / context shape,
        which is why the steady decode rate leaves those steps out)."""
        graphs = self.backend.graphs
        out = {
            "graph_captures": graphs.captures if graphs is not None else 0,
            "graph_capture_s": round(float(graphs.capture_s), 6) if graphs is not None else 0.0,
        }
        shapes = graphs.graphs if graphs is not None else {}
        if shapes and all(len(k) == 3 for k in shapes):  # DecodeGraphs' (sequences, context, mode) keys
            # which decode path each recorded shape took (sequences x context : lookup / staged / none):
            # two processes on one folder that decode at different rates show here whether they
            # took different paths (the gather calibration is timed per process)
            out["graph_shapes"] = [f"{g}x{ctx}:{mode}" for g, ctx, mode in sorted(shapes)]
        chosen = self.gather_calibration.chosen if self.gather_calibration is not None else {}  # start-up pick
        if chosen:
            out["gather_path_by_rows"] = {str(k): v for k, v in sorted(chosen.items())}
        return out

    def weight_bytes(self) -> int | None:
        """Bytes of the model's weights this process holds (None: inside a TensorRT engine)."""
        return self.backend.weight_bytes

    def storage(self) -> dict[str, Any]:
        if self.engram_lookup is not None:  # hook (engram_trt.distributed)
            return self.engram_lookup.describe()
        if self.tables is None:
            return {"kind": "none"}
        d = self.tables.describe()
        d.pop("layers", None)
        return d

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
            self.prefetcher = None
        if self.backend is not None:
            self.backend.close()
        if self.tables is not None:
            self.tables.close()
            self.tables = None


def _positive(name: str, value: Any, default: int) -> int:
    if value is None:
        return int(default)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1 << 24:
        raise EngramError(f"{name} must be an integer in 1..16777216 (got {value!r})")
    return value
