"""The model registry: which architecture serves a checkpoint, found by its
config.json's ``architectures`` and ``model_type`` (as vLLM's registry and
TensorRT-LLM's ``models/`` key theirs). Runtime, builder and CLI ask the registry and
never branch on an architecture's name; an architecture declares its config fields, its
torch module, its weight names, its per-sequence state and its ONNX export
(:class:`~engram_trt.models.base.ArchitectureBase`, every method the callers use).

A config whose ``architectures`` names none of ours, or whose ``model_type`` belongs to
another family, is refused in one line naming what was found and what is supported.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

from engram_trt.errors import ConfigError
from engram_trt.models.base import ArchitectureBase

# What the registry hands out: an architecture (every method and attribute declared,
# documented and defaulted by :class:`~engram_trt.models.base.ArchitectureBase`).
ModelArchitecture = ArchitectureBase

log = logging.getLogger(__name__)


def _registered() -> tuple[ModelArchitecture, ...]:
    from engram_trt.models.deepseek_v4.architecture import ARCHITECTURE as deepseek_v4
    from engram_trt.models.engram_llama.architecture import ARCHITECTURE as engram_llama
    from engram_trt.models.qwen4_exp.architecture import ARCHITECTURE as qwen4_exp

    return (engram_llama, qwen4_exp, deepseek_v4)


def registered() -> tuple[ModelArchitecture, ...]:
    """Every registered architecture, in the registry's order."""
    return _registered()


def supported_architectures() -> list[str]:
    return sorted(a for arch in _registered() for a in arch.architectures)


def _where(source: str | None) -> str:
    return f"{source}: " if source else "config: "


def resolve(d: Mapping[str, Any], source: str | None = None) -> ModelArchitecture:
    """The architecture that serves the config ``d`` (see the module docstring)."""
    archs = d.get("architectures")
    model_type = d.get("model_type")
    supported = ", ".join(supported_architectures())
    if archs is not None and (
        not isinstance(archs, Sequence) or isinstance(archs, str) or not all(isinstance(a, str) for a in archs)
    ):
        raise ConfigError(
            f"{_where(source)}field 'architectures' must be a list of class names such as "
            f"[\"LlamaForCausalLM\"] (got {archs!r:.80})"
        )
    if model_type is not None and not isinstance(model_type, str):
        raise ConfigError(
            f"{_where(source)}field 'model_type' must be a string such as \"llama\" (got {model_type!r:.80})"
        )
    found: ModelArchitecture | None = None
    if archs:
        found = next((arch for a in archs for arch in _registered() if a in arch.architectures), None)
        if found is None:
            raise ConfigError(
                f"{_where(source)}architectures {list(archs)} is not a model engram-trt serves "
                f"(supported architectures: {supported})"
            )
    elif model_type is not None:
        found = next((arch for arch in _registered() if model_type in arch.model_types), None)
        if found is None:
            types = ", ".join(sorted(t for arch in _registered() for t in arch.model_types))
            raise ConfigError(
                f"{_where(source)}model_type '{model_type}' is not a model engram-trt serves "
                f"(supported model types: {types})"
            )
    else:
        raise ConfigError(
            f"{_where(source)}config.json names neither 'architectures' nor 'model_type', so engram-trt cannot "
            f"tell which model it is (supported architectures: {supported}); add the field the model was saved with"
        )
    if model_type is not None and model_type not in found.model_types:
        raise ConfigError(
            f"{_where(source)}model_type '{model_type}' does not belong to architectures {list(archs or [])} "
            f"(engram-trt's {found.name} expects model_type {' or '.join(repr(t) for t in found.model_types)}); "
            f"the config describes another model family"
        )
    return found


def read_model_config(d: Mapping[str, Any], source: str | None = None) -> tuple[ModelArchitecture, Any]:
    """``(architecture, typed config)`` of a config dict, every field honoured or refused."""
    arch = resolve(d, source)
    return arch, arch.read_config(d, source)


def open_checkpoint(path: Any, allow_unused: bool = False) -> Any:
    """A :class:`~engram_trt.checkpoint.checkpoint.Checkpoint` whose config went through
    its architecture's contract (``ckpt.architecture`` set). Its tensors the model does
    not read are refused in one line that lists them, unless ``allow_unused``."""
    from engram_trt.checkpoint.checkpoint import Checkpoint
    from engram_trt.errors import CheckpointError

    holder: dict[str, ModelArchitecture] = {}

    def reader(d: Mapping[str, Any], source: str) -> Any:
        holder["arch"], config = read_model_config(d, source)
        return config

    ckpt = Checkpoint.open(path, config_reader=reader)
    ckpt.architecture = holder["arch"]
    unused = ckpt.architecture.unused_tensors(ckpt.config, ckpt.tensor_names())
    if unused and not allow_unused:
        shown = ", ".join(unused[:8]) + (f" and {len(unused) - 8} more" if len(unused) > 8 else "")
        ckpt.close()
        raise CheckpointError(
            f"checkpoint '{ckpt.path}' holds {len(unused)} tensor(s) the {ckpt.architecture.name} model does not "
            f"read: {shown}; a model that ignored them might not be the one the checkpoint declares "
            f"(pass --allow-unused-weights to serve it without them)"
        )
    if unused:
        log.warning(
            "checkpoint %s: %d tensor(s) the model does not read, accepted: %s",
            ckpt.path,
            len(unused),
            ", ".join(unused[:8]),
        )
    return ckpt
