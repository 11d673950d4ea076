"""The model's weights: which tensors it needs (checkpoint names and shapes), and their
load into its parameters, with the projections that share an input fused.

Fusing: on a GPU each decoder layer's q / k / v weights are copied into one
``[(H + 2 kvh) * hd, D]`` tensor and its gate / up weights into one ``[2I, D]``, and the
five parameters become row-slice views of those (``Attention.qkv_weight``,
``MLP.gate_up_weight``). Names, shapes and memory stay those of the checkpoint (no
second copy, not even during the load: each tensor is copied straight into its rows),
while the fused path runs one GEMM per group instead of three and two.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from engram_trt.checkpoint.checkpoint import backbone_tensor_shapes, engram_tensor_names
from engram_trt.config.model import ModelConfig
from engram_trt.errors import CheckpointError, EngramError


def model_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter :class:`~engram_trt.models.engram_llama.model.EngramLlama` needs (checkpoint
    names and shapes), tables excluded: the backbone plus each Engram layer's ``wkv``,
    ``q_weight``, ``k_weight``."""
    out = dict(backbone_tensor_shapes(config))
    spec = config.require_model()
    if spec is not None:
        assert spec.head_dim is not None
        D, hc = config.hidden_size, config.hc_mult
        for lid in spec.layer_ids:
            names = engram_tensor_names(lid, spec.prefix)
            out[names["wkv"]] = ((hc + 1) * D, spec.n_hash_cols * spec.head_dim)
            out[names["q_weight"]] = (hc, D)
            out[names["k_weight"]] = (hc, D)
    return out


def fused_groups(model: nn.Module) -> list[tuple[nn.Module, str, list[str]]]:
    """(module, attribute of its stacked weight, the stacked parameters in row order) of
    every decoder layer of ``model`` (an EngramLlama)."""
    groups: list[tuple[nn.Module, str, list[str]]] = []
    for i, layer in enumerate(model.model.layers):  # type: ignore[union-attr]
        p = f"model.layers.{i}"
        groups.append((layer.self_attn, "qkv_weight", [f"{p}.self_attn.{x}_proj.weight" for x in "qkv"]))
        groups.append((layer.mlp, "gate_up_weight", [f"{p}.mlp.gate_proj.weight", f"{p}.mlp.up_proj.weight"]))
    return groups


def load_weights(model: nn.Module, weights: Mapping[str, torch.Tensor], device: torch.device, dtype: torch.dtype,
                 fuse: bool) -> None:
    """Checks ``weights`` against the config and makes them ``model``'s parameters (on
    ``device`` in ``dtype``), the projections of each layer fused when ``fuse``."""
    expected = model_weight_shapes(model.config)  # type: ignore[arg-type]
    params = dict(model.named_parameters())
    groups = fused_groups(model) if fuse else []
    stacked = {name for _, _, names in groups for name in names}
    for name, want in expected.items():
        if name not in weights:
            raise CheckpointError(f"weights lack tensor '{name}' (expected shape {list(want)})")
        t = weights[name]
        if tuple(t.shape) != want:
            raise CheckpointError(f"tensor '{name}' has shape {list(t.shape)} but the config needs {list(want)}")
        if name not in params:
            raise EngramError(f"internal: parameter '{name}' is not part of the module")
        if name in stacked:
            continue
        owner_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner_name), leaf, nn.Parameter(t.to(device=device, dtype=dtype), requires_grad=False))
    for module, attr, names in groups:
        buf = torch.empty((sum(expected[n][0] for n in names), expected[names[0]][1]), device=device, dtype=dtype)
        at = 0
        for name in names:
            n = expected[name][0]
            buf[at:at + n].copy_(weights[name])
            owner_name, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner_name), leaf, nn.Parameter(buf[at:at + n], requires_grad=False))
            at += n
        setattr(module, attr, buf)
    leftover = [n for n, p in model.named_parameters() if p.is_meta]
    if leftover:
        raise EngramError(f"internal: parameters {leftover[:3]} were not loaded")
