"""The exported serving graph on the CPU: :func:`reference_ops` binds every plugin node
any registered architecture's export emits to its Python reference (the shared ones of
:mod:`engram_trt.models.reference_ops`, each architecture's
:meth:`~engram_trt.models.base.ArchitectureBase.reference_ops`), for
``onnx.reference.ReferenceEvaluator``. Each family's runner
(``models/<arch>/reference_runner.py``: engram-llama's ``ReferenceRunner``,
``Qwen4ExpReferenceRunner``, ``DeepseekV4ReferenceRunner``) runs one packed step at a
time over it, so CI checks exactly the graph the engine is built from against the
reference model.
"""

from __future__ import annotations

from engram_trt.models.reference_ops import TableRegistry, engram_ops, routed_experts_ops


def reference_ops(registry: TableRegistry) -> list[type]:
    """OpRun classes binding every plugin node to its Python reference, the tables looked
    up in ``registry``."""
    from engram_trt.models.registry import registered

    return [*engram_ops(registry), *routed_experts_ops(), *(op for arch in registered() for op in arch.reference_ops())]
