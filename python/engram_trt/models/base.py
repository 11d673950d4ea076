"""The defaults every registered architecture inherits (:class:`ArchitectureBase`): the
optional parts of :class:`~engram_trt.models.registry.ModelArchitecture`, so the runtime
asks every architecture the same questions and never probes for a method."""

from __future__ import annotations

from typing import Any


class ArchitectureBase:
    """An architecture's defaults: its backbone not sharded over tensor-parallel ranks
    (``tensor_parallel`` False; :meth:`parallel_plan` gives every rank the whole model)."""

    tensor_parallel = False

    def parallel_plan(self, config: Any, tp: int, rank: int = 0) -> Any:
        """Not sharded: each TP rank holds the whole backbone."""
        from engram_trt.models.parallel import not_sharded

        return not_sharded(getattr(self, "title", type(self).__name__), config, tp, rank)
