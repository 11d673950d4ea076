"""Where a DeepSeek-V4 step's time goes, per module class: ``engram-trt bench
dsv4-step``'s breakdown, for choosing the next CUDA kernel (issue 31, item 2).

:class:`ModuleClock` wraps, for the steps run inside it, each region of
:meth:`DeepseekV4Model.forward_step` that one kind of work owns: the attention by its
layer type (``attention.sliding`` / ``attention.csa`` / ``attention.hca``), the MoE
(``moe``: router, routed and shared experts), the hyper-connections (``mhc``: each
layer's two collapses and two expansions, and the final hyper head), the Engram update
(``engram``), the main stream's wait for the prefetched rows (``engram.wait``), the
RMSNorms around the sublayers and the final one (``norm``; on the fused bf16 GPU path,
:mod:`engram_trt.models.deepseek_v4.fused`, each runs inside its collapse and counts as
``mhc``) and the embedding (``embed``). ``other`` is the rest of the step (the head's GEMM, the step's checks and
uploads, the sampler's read).

Each region is timed two ways at once, without any synchronization inside the step: a
pair of CUDA events on the current stream (``gpu_ms``: the stream's span from the
region's first launch to its last kernel's end: kernel time, plus any time the GPU sat
waiting for the host to launch the region's kernels) and the host's wall clock around
the call (``host_ms``: the Python and launch cost; a region that reads a value back,
such as the MoE's expert counts, also waits there for the GPU). On a CPU both are the
wall clock. The per-class figures of one step add up to the step's own span.

Why instance wrappers and not a profiler: the classes are the model's own calls
(methods of the layer instances, wrapped for the steps inside the ``with`` and put
back after), so a class's time is exactly its calls' whatever kernels they launch; the
class-level call ``HyperConnection.expand`` (a static method) and the mHC fold's binding
(``native.mhc.mhc_fold``: a sublayer boundary of the bf16 CUDA decode step, one ``mhc``
call) are wrapped the same way and restored.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

CLASSES = (
    "attention.sliding",
    "attention.csa",
    "attention.hca",
    "moe",
    "mhc",
    "engram",
    "engram.wait",
    "norm",
    "embed",
)
_ATTENTION = {
    "sliding_attention": "attention.sliding",
    "compressed_sparse_attention": "attention.csa",
    "heavily_compressed_attention": "attention.hca",
}


class ModuleClock:
    """See the module docstring. ``with ModuleClock(model) as clock:`` then, per step,
    ``clock.step(fn)`` (``fn`` runs one step; it may pass its Engram rows through
    :meth:`rows`); :meth:`summary` gives the medians over the steps."""

    def __init__(self, model: Any) -> None:
        import torch

        self.model = model
        self.cuda = model.device.type == "cuda"
        self._torch = torch
        self._undo: list[Callable[[], None]] = []
        self._marks: list[tuple[str, Any, Any, float]] = []  # (class, start, end, host seconds) of this step
        self._steps: list[dict[str, Any]] = []

    # -- installing the wrappers ---------------------------------------------------------
    def __enter__(self) -> "ModuleClock":
        from engram_trt.models.deepseek_v4 import modules

        bb = self.model.model
        for layer in bb.layers:
            self._wrap(layer.self_attn, "forward", _ATTENTION[layer.self_attn.layer_type])
            self._wrap(layer.mlp, "forward", "moe")
            self._wrap(layer.attn_hc, "collapse", "mhc")
            self._wrap(layer.ffn_hc, "collapse", "mhc")
            self._wrap(layer.attn_hc, "collapse_fused", "mhc")  # the bf16 GPU path: collapse + its norm in one
            self._wrap(layer.ffn_hc, "collapse_fused", "mhc")
            self._wrap(layer.input_layernorm, "forward", "norm")
            self._wrap(layer.post_attention_layernorm, "forward", "norm")
            if layer.engram is not None:
                self._wrap(layer.engram, "forward", "engram")
        self._wrap(bb.hc_head, "forward", "mhc")
        self._wrap(bb.hc_head, "forward_fused", "mhc")
        self._wrap(bb.norm, "forward", "norm")
        self._wrap(bb.embed_tokens, "forward", "embed")
        expand = modules.HyperConnection.__dict__["expand"]
        timed = self._timed(expand.__func__, "mhc")
        modules.HyperConnection.expand = staticmethod(timed)  # type: ignore[method-assign]
        self._undo.append(lambda: setattr(modules.HyperConnection, "expand", expand))
        # the bf16 CUDA decode path's sublayer boundary (an expansion, the next collapse and its
        # norm in one engram_mhc_fold chain): one mhc call, looked up on the module at each call
        from engram_trt.native import mhc as native_mhc

        fold = native_mhc.mhc_fold
        native_mhc.mhc_fold = self._timed(fold, "mhc")  # type: ignore[assignment]
        self._undo.append(lambda: setattr(native_mhc, "mhc_fold", fold))
        return self

    def __exit__(self, *exc: Any) -> None:
        while self._undo:
            self._undo.pop()()

    def _wrap(self, obj: Any, attr: str, cls: str) -> None:
        had, before = attr in obj.__dict__, obj.__dict__.get(attr)
        setattr(obj, attr, self._timed(getattr(obj, attr), cls))
        self._undo.append(lambda: setattr(obj, attr, before) if had else obj.__dict__.pop(attr, None))

    def _event(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        ev = self._torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def _timed(self, fn: Callable[..., Any], cls: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            h0 = time.perf_counter()
            start = self._event()
            out = fn(*args, **kwargs)
            end = self._event()
            self._marks.append((cls, start, end, time.perf_counter() - h0))
            return out

        return call

    def rows(self, staged: Any) -> Any:
        """The step's staged Engram rows, their first read per layer timed as ``engram.wait``
        (where the main stream waits for the prefetch)."""
        from engram_trt.models.step import EngramRows, row_shapes

        clock = self

        class _TimedRows(EngramRows):  # the models read its shapes without reading (waiting for) the rows
            staging = getattr(staged, "staging", None)

            def __init__(self) -> None:
                super().__init__(())

            @property
            def shapes(self) -> list[tuple[int, ...]]:
                return row_shapes(staged)

            def __len__(self) -> int:
                return len(staged)

            def __getitem__(self, i: int) -> Any:
                return clock._timed(staged.__getitem__, "engram.wait")(i)

        return _TimedRows()

    # -- one step --------------------------------------------------------------------------
    def step(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` (one step) and record its regions (synchronizes after it)."""
        self._marks = []
        h0 = time.perf_counter()
        start = self._event()
        fn()
        end = self._event()
        host = time.perf_counter() - h0
        if self.cuda:
            self._torch.cuda.synchronize()
        total = self._span(start, end)
        by: dict[str, dict[str, float]] = {c: {"gpu_ms": 0.0, "host_ms": 0.0, "calls": 0} for c in CLASSES}
        for cls, a, b, h in self._marks:
            by[cls]["gpu_ms"] += self._span(a, b)
            by[cls]["host_ms"] += h * 1e3
            by[cls]["calls"] += 1
        by["other"] = {
            "gpu_ms": total - sum(v["gpu_ms"] for v in by.values()),
            "host_ms": host * 1e3 - sum(v["host_ms"] for v in by.values()),
            "calls": 0,
        }
        self._steps.append({"total_gpu_ms": total, "total_host_ms": host * 1e3, "classes": by})

    def _span(self, a: Any, b: Any) -> float:
        return float(a.elapsed_time(b)) if self.cuda else (b - a) * 1e3

    def summary(self) -> dict[str, Any]:
        """Medians over the recorded steps: per class ``gpu_ms``, ``host_ms``, ``calls``
        and ``share`` (of the step's GPU span), the step's totals, and the classes in
        order of their GPU time."""
        if not self._steps:
            return {}
        med = statistics.median
        total = med(s["total_gpu_ms"] for s in self._steps)
        classes = {}
        for c in self._steps[0]["classes"]:
            g = med(s["classes"][c]["gpu_ms"] for s in self._steps)
            classes[c] = {
                "gpu_ms": g,
                "host_ms": med(s["classes"][c]["host_ms"] for s in self._steps),
                "calls": self._steps[0]["classes"][c]["calls"],
                "share": g / total if total > 0 else 0.0,
            }
        return {
            "steps": len(self._steps),
            "total_gpu_ms": total,
            "total_host_ms": med(s["total_host_ms"] for s in self._steps),
            "classes": classes,
            "order": sorted(classes, key=lambda c: -classes[c]["gpu_ms"]),
            "clock": "cuda events" if self.cuda else "wall clock (CPU)",
        }
