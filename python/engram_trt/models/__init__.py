"""Model architectures, one subpackage each, found through the registry
(:mod:`engram_trt.models.registry`) by the ``architectures`` / ``model_type`` of a
checkpoint's config.json, as vLLM's model registry and TensorRT-LLM's ``models/`` do.

Shared by every architecture: the packed step every model's forward takes
(:mod:`.step`), the slot KV cache (:mod:`.kv_cache`), token sampling (:mod:`.sampling`),
an architecture's defaults (:mod:`.base`) and its share of a tensor-parallel group
(:mod:`.parallel`).
"""
