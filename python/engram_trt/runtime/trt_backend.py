"""The ``tensorrt`` backend: the engine of an engine folder, run by a TensorRT runtime.

It deserializes ``model.engine`` (loading the plugin library first when the engine does
not embed it), binds every input and output by address, and runs ``execute_async_v3``
on the runtime's CUDA stream. The KV caches are allocated here once (fixed addresses)
and bound both as the cache inputs and as their aliased in-place outputs; the tables
are bound by address (``engram_table_ptrs`` / ``engram_scale_ptrs``, in-engine
placement: the gather plugin reads them through UVA or from HBM) or replaced by the
runtime's staged rows (``engram_rows_j``, prefetch placement).

Where the prefetch wait sits with TensorRT: an engine is one launch sequence that
cannot wait on an outside event halfway, so with the prefetch placement the stream
waits for the staged rows just before ``execute_async_v3``; the lookup then overlaps
the previous step's sampling and the host work of this one, not the engine's own first
layers (the torch backend waits at the first Engram layer). The in-engine placement
needs no wait at all. docs/runtime.md gives the measured cost.

:func:`tensorrt_unusable_reason` says, before anything is loaded, why this machine
cannot run the engine (no engine built, no TensorRT runtime, no GPU, an RTX engine
without this GPU's compute capability among its targets), so ``auto`` can fall back
to the torch backend and say why.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from engram_trt.errors import EngramError
from engram_trt.models.kv_cache import KVCache
from engram_trt.runtime.backend import Backend

log = logging.getLogger(__name__)


def _gpu_sm(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm{major}{minor}"


def tensorrt_unusable_reason(source: Any, device: torch.device) -> str | None:
    """Why the engine of ``source`` cannot run here, or None when it can be tried."""
    from engram_trt.native import trt_compat as tc

    if source.kind != "engine":
        return f"{source.path} is a checkpoint, not an engine folder (build one with `engram-trt build`)"
    if source.engine_file is None:
        return "the engine folder holds no engine (it was built where no TensorRT was installed)"
    if not source.engine_file.is_file():
        return f"the engine file {source.engine_file} is missing"
    built = source.trt or {}
    flavour = built.get("flavour")
    if not tc.available(flavour):
        return f"no {flavour or 'TensorRT'} runtime is installed here"
    if device.type != "cuda" or not torch.cuda.is_available():
        return "no CUDA device is available"
    sm = _gpu_sm(device)
    if flavour == "tensorrt_rtx":
        targets = list((source.manifest.get("build_flags") or {}).get("targets") or [])
        if not targets:
            targets = [t for t in tc.RTX_TARGETS if not t.startswith(("sm9", "sm10"))]
        if sm not in targets:
            return (
                f"engine built for {','.join(targets)}, this GPU is {sm} (TensorRT-RTX compiles ahead of time and "
                f"has no {sm} target)"
            )
    return None


class TensorRTBackend(Backend):
    name = "tensorrt"
    weight_bytes = None  # the engine holds the weights (not counted per tensor)

    def __init__(self, source: Any, tables: Any, device: torch.device) -> None:
        from engram_trt.native import trt_compat as tc

        self.device = device
        self.source = source
        self.tables = tables
        self.trt = tc.load((source.trt or {}).get("flavour"))
        t = self.trt.module
        if source.plugin_library is not None and not source.plugin_embedded:
            tc.load_plugin_library(source.plugin_library)
        elif not source.plugin_embedded and source.has_engram:
            from engram_trt.native import library as kernel_library

            tc.load_plugin_library(kernel_library.library_path())
        runtime = tc.create_runtime()
        if source.plugin_embedded:
            runtime.engine_host_code_allowed = True  # the engine carries the plugin library
        with torch.cuda.device(device):
            engine = runtime.deserialize_cuda_engine(source.engine_file.read_bytes())
        if engine is None:
            raise EngramError(
                f"TensorRT could not deserialize {source.engine_file} "
                "(see the TensorRT log above); rebuild it on this machine"
            )
        self._runtime, self.engine = runtime, engine
        self.context = engine.create_execution_context()
        self.inputs, self.outputs = [], []
        for i in range(engine.num_io_tensors):
            name = engine.get_tensor_name(i)
            (self.inputs if engine.get_tensor_mode(name) == t.TensorIOMode.INPUT else self.outputs).append(name)
        io = ((source.manifest or {}).get("graph") or {}).get("io", {})
        # the manifest's states, and those the architecture names (a manifest without io.states)
        own = set(io.get("states") or {}) | source.architecture.engine_state_inputs(source.config)
        states = [n for n in self.inputs if n in own]
        if states:  # a Qwen4Exp / DeepSeek-V4 engine: its per-slot states and PLE inputs are not bound here yet
            arch = io.get("architecture") or source.architecture.title
            raise EngramError(
                f"the tensorrt backend does not bind a {arch} engine's state inputs yet ({states[0]} and "
                f"{len(states) - 1} more); serve the engine folder with --backend torch"
            )
        self.wants_staged_rows = any(n.startswith("engram_rows_") for n in self.inputs)
        self._dtype = {
            t.DataType.BFLOAT16: torch.bfloat16,
            t.DataType.HALF: torch.float16,
            t.DataType.FLOAT: torch.float32,
        }
        self._table_ptrs = self._scale_ptrs = None
        if "engram_table_ptrs" in self.inputs:
            if tables is None or not tables.gpu_readable:
                raise EngramError(
                    "the engine gathers Engram rows in place (table_placement in_engine), which needs tables "
                    "the GPU can read (pinned, shared or device memory); this store is "
                    f"{'missing' if tables is None else tables.kind}"
                )
            rows = [tables.tensors(i)[0].data_ptr() for i in range(tables.num_layers)]
            scales = [
                0 if tables.tensors(i)[1] is None else tables.tensors(i)[1].data_ptr() for i in range(tables.num_layers)
            ]
            self._table_ptrs = torch.tensor(rows, dtype=torch.int64, device=device)
            self._scale_ptrs = torch.tensor(scales, dtype=torch.int64, device=device)
        from engram_trt.models.step import StepUploader

        self._uploader = StepUploader(device)
        vocab = source.config.vocab_size
        self._logits = torch.empty((source.max_batch, vocab), dtype=torch.float32, device=device)
        log.info("tensorrt backend: %s %s, engine %s", self.trt.flavour, self.trt.version, source.engine_file)

    @property
    def label(self) -> str:
        return f"tensorrt ({self.trt.flavour} {self.trt.version}, {_gpu_sm(self.device)})"

    def allocate_cache(self, num_slots: int, max_len: int) -> KVCache:
        cfg = self.source.config
        if num_slots > self.source.max_batch or max_len > self.source.max_seq_len:
            raise EngramError(
                f"the engine serves at most {self.source.max_batch} sequences of {self.source.max_seq_len} "
                f"tokens (got {num_slots} x {max_len}); rebuild it with larger --max-batch / --max-seq-len"
            )
        name = "key_cache_0"
        dtype = (
            self._dtype.get(self.engine.get_tensor_dtype(name), torch.bfloat16)
            if name in self.inputs
            else torch.bfloat16
        )
        # The engine's cache inputs are fixed at [max_batch, kvh, max_seq_len, hd].
        return self.source.architecture.allocate_state(
            cfg, self.source.max_batch, self.source.max_seq_len, self.device, dtype
        )

    def execute(self, step: Any, cache: KVCache, rows: Any) -> torch.Tensor:
        ctx = self.context
        dev = self.device
        i32 = torch.int32
        S = step.num_seqs
        arrays = step.device_arrays(dev, self._uploader)  # one copy of all step metadata
        feeds: dict[str, torch.Tensor] = {
            k: arrays[k].to(i32) for k in ("input_ids", "seq_starts", "past_lens", "slots")
        }
        if "engram_ids" in arrays:
            feeds["engram_ids"] = arrays["engram_ids"].to(i32)
        if "lookback" in arrays:
            feeds["engram_lookback"] = arrays["lookback"].to(i32).contiguous()
        if self._table_ptrs is not None:
            feeds["engram_table_ptrs"], feeds["engram_scale_ptrs"] = self._table_ptrs, self._scale_ptrs
        if self.wants_staged_rows:
            if rows is None:
                raise EngramError("internal: the engine takes staged Engram rows but none were given")
            for j in range(len(rows)):
                feeds[f"engram_rows_{j}"] = rows[j]  # waits for the prefetch here, before the engine
        for i in range(len(cache.keys)):
            feeds[f"key_cache_{i}"], feeds[f"value_cache_{i}"] = cache.keys[i], cache.values[i]
        missing = [n for n in self.inputs if n not in feeds]
        if missing:
            raise EngramError(
                f"the engine asks for inputs {missing} this runtime does not know; "
                "rebuild the engine folder with this engram-trt"
            )
        for name in self.inputs:
            t = feeds[name]
            ctx.set_input_shape(name, tuple(t.shape))
            ctx.set_tensor_address(name, t.data_ptr())
        logits = self._logits[:S]
        for name in self.outputs:
            if name == "logits":
                ctx.set_tensor_address(name, logits.data_ptr())
            elif name.startswith(("key_cache_out_", "value_cache_out_")):
                i = int(name.rsplit("_", 1)[1])
                ctx.set_tensor_address(name, (cache.keys if name.startswith("key") else cache.values)[i].data_ptr())
            else:
                raise EngramError(
                    f"the engine has an output {name!r} this runtime does not know; rebuild the engine folder"
                )
        stream = torch.cuda.current_stream(dev)
        if not ctx.execute_async_v3(stream.cuda_stream):
            raise EngramError("TensorRT failed to run the step (see the TensorRT log above)")
        for s, slot in enumerate(step.slots):
            cache.lengths[slot] = step.past_lens[s] + step.seq_lens[s]
        self._keep = feeds  # the inputs must outlive the enqueued work
        return logits

    def close(self) -> None:
        self.context = self.engine = self._runtime = None
