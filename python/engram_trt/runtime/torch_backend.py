"""The ``torch`` backend: the checkpoint's model (its registry architecture's PyTorch module) run on the
packed step, with the Engram steps in the project's CUDA kernel library on a GPU (the
plugins' very kernels) and the reference path on a CPU. Its weights come from the
source checkpoint the engine folder names; its Engram rows are staged by the runtime's
prefetcher."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from engram_trt.errors import EngramError
from engram_trt.models.kv_cache import KVCache
from engram_trt.runtime.backend import Backend, DecodeGraphRecorder
from engram_trt.runtime.phases import UPLOAD

log = logging.getLogger(__name__)


class TorchBackend(Backend):
    name = "torch"
    wants_staged_rows = True

    def __init__(
        self,
        source: Any,
        tables: Any,
        device: torch.device,
        dtype: torch.dtype,
        cuda_graphs: bool = True,
        engram_config: Any = None,
        tensor_parallel: Any = None,
    ) -> None:
        from engram_trt.checkpoint.checkpoint import Checkpoint

        self.device = device
        t0 = time.perf_counter()
        if not (source.checkpoint / "config.json").is_file():
            raise EngramError(
                f"the torch backend reads its weights from the source checkpoint {source.checkpoint}, which is "
                f"not there; restore it, or rebuild the engine folder from where the checkpoint now lives"
            )
        arch = source.architecture
        ckpt = Checkpoint.open(source.checkpoint, config_reader=lambda d, src: arch.read_config(d, src))
        if ckpt.config.to_dict() != source.config.to_dict():
            raise EngramError(
                f"the checkpoint {source.checkpoint} no longer matches the engine folder's config "
                f"(config.json changed since the build); rebuild the engine folder"
            )
        parallel = None
        if tensor_parallel is not None and tensor_parallel.size > 1:
            # this rank's share of the backbone (models.parallel): the modules at its sizes, its slices read
            parallel = arch.parallel_plan(ckpt.config, tensor_parallel.size, tensor_parallel.rank)
            parallel.check_checkpoint(ckpt)
            parallel.tp = tensor_parallel
        # ``tables``: the store the runner opened (the Engram tables, or the architecture's
        # own: Qwen4Exp's PLE shards), bound to the model; ``engram_config``: the runner's
        # (its hot_cache_fraction caches the PLE rows)
        self.model = arch.load_model(
            ckpt,
            device=device,
            dtype=dtype,
            parallel=parallel,
            engram_config=engram_config or source.engram_config,
            compress_lookup=source.compress_lookup,
            layout=source.layout,
            tables=tables,
        )
        self._ckpt = ckpt  # PLE rows may be read in place from its file maps
        self.use_graphs = cuda_graphs and device.type == "cuda" and self.model.supports_decode_graphs
        self.graphs: DecodeGraphRecorder | None = None
        self.lookup_policy = None  # the prefetcher's gather choice by row count (set by the runner)
        self.phases = None  # a runtime.phases.StepPhases while a benchmark times the steps
        log.info(
            "torch backend: weights of %s on %s (%s) in %.1f s",
            source.checkpoint,
            device,
            dtype,
            time.perf_counter() - t0,
        )

    def allocate_cache(self, num_slots: int, max_len: int) -> KVCache:
        if not self.use_graphs:
            return self.model.new_cache(num_slots, max_len)
        from engram_trt.runtime.cuda_graphs import DecodeGraphs

        cache = self.model.new_cache(num_slots + 1, max_len)  # + a scratch slot for graph padding
        self.graphs = self.model.decode_graphs(cache, num_slots, scratch_slot=num_slots)  # its own recorder (Qwen4Exp)
        if self.graphs is not None:
            return cache
        self.graphs = DecodeGraphs(
            self.model,
            cache,
            num_slots,
            scratch_slot=num_slots,
            tables=self.model.tables,
            lookup_policy=lambda n: self.lookup_policy(n) if self.lookup_policy else "host",
        )
        return cache

    def handles_lookup(self, step: Any) -> bool:
        """True when this step's Engram rows are looked up inside the decode graphs (the
        runtime then stages none)."""
        return self.graphs is not None and self.graphs.handles_lookup(step)

    def execute(self, step: Any, cache: KVCache, rows: Any) -> torch.Tensor:
        if self.graphs is not None:
            logits = self.graphs.run(step, rows, self.phases)
            if logits is not None:
                return logits
        if self.phases is not None:  # the eager step's upload (cached on the step: forward_step reuses it)
            step.device_arrays(self.device, self.model.uploader)
            self.phases.mark(UPLOAD)
        return self.model.forward_step(step, cache, engram_rows=rows)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the model's weights this process holds (a TP rank: its share)."""
        from engram_trt.models.parallel import held_bytes

        return held_bytes(self.model)

    @property
    def label(self) -> str:
        graphs = " (decode in CUDA graphs)" if self.graphs is not None and self.graphs.failed is None else ""
        return self.model.backend_name + graphs

    def close(self) -> None:
        self.model = None  # type: ignore[assignment]
        if self._ckpt is not None:
            self._ckpt.close()
            self._ckpt = None
