"""The model's weights: which tensors it needs (checkpoint names and shapes), and their
load into its parameters, with the projections that share an input fused.

Loading reads one tensor at a time from ``weights`` (a dict, or a checkpoint's
:class:`~engram_trt.checkpoint.checkpoint.LazyTensors`, which reads each tensor from its
shard when taken): each goes straight where it lives (cast to the compute dtype on the
device) and is dropped, so a load never holds the checkpoint twice.

FP8 weights: a linear weight stored ``float8_e4m3fn`` (a fine-grained FP8 checkpoint,
``config.quant`` set) becomes a :class:`~engram_trt.quant.weight.QuantLinear` holding the
stored bytes and its block scales (``<module>.weight_scale_inv`` or ``<module>.scale``)
as stored: no float copy in host or GPU memory. Weights the checkpoint keeps in 16 bits
(transformers' FP8 save leaves those whose dims do not divide by the block, the
``modules_to_not_convert``, the head and the embeddings) stay float; a scale stored beside
such a weight (transformers' save writes a stale one) is not read.

Fusing: on a GPU each decoder layer's q / k / v weights are copied into one
``[(H + 2 kvh) * hd, D]`` tensor and its gate / up weights into one ``[2I, D]``, and the
five parameters become row-slice views of those (``Attention.qkv_weight``,
``MLP.gate_up_weight``). Names, shapes and memory stay those of the checkpoint (no
second copy, not even during the load: each tensor is copied straight into its rows),
while the fused path runs one GEMM per group instead of three and two. FP8 projections
fuse the same way (their bytes and their scales each stacked by rows, the stack one
:class:`~engram_trt.quant.weight.QuantWeight`) when every part is FP8 with one scale dtype
and each part but the last ends on a block row; otherwise the group runs apart.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from engram_trt.checkpoint.checkpoint import engram_tensor_names, stored_dtype
from engram_trt.config.model import ModelConfig
from engram_trt.models.engram_llama.checks import backbone_tensor_shapes
from engram_trt.errors import CheckpointError, EngramError
from engram_trt.quant.names import find_scale
from engram_trt.quant.weight import QuantLinear, QuantWeight, check_quant_tensors


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


def lazy_weights(ckpt: Any) -> Mapping[str, torch.Tensor]:
    """A checkpoint's weights (Engram tables left out: they go to a table store) as a
    mapping that reads each tensor from its shard when the loader takes it, FP8 scales
    included."""
    tables: set[str] = set()
    spec = ckpt.config.engram
    if spec is not None:
        for lid in spec.layer_ids:
            names = engram_tensor_names(lid, spec.prefix)
            tables.update((names["table"], names["scale"]))
    return ckpt.lazy(n for n in ckpt.tensor_names() if n not in tables)


def fused_groups(model: nn.Module) -> list[tuple[nn.Module, str, list[str]]]:
    """(module, attribute of its stacked weight, the stacked parameters in row order) of
    every decoder layer of ``model`` (an EngramLlama)."""
    groups: list[tuple[nn.Module, str, list[str]]] = []
    for i, layer in enumerate(model.model.layers):  # type: ignore[union-attr]
        p = f"model.layers.{i}"
        groups.append((layer.self_attn, "qkv_weight", [f"{p}.self_attn.{x}_proj.weight" for x in "qkv"]))
        groups.append((layer.mlp, "gate_up_weight", [f"{p}.mlp.gate_proj.weight", f"{p}.mlp.up_proj.weight"]))
    return groups


def is_fp8(weights: Mapping[str, torch.Tensor], name: str) -> bool:
    """Whether ``weights[name]`` is stored FP8 (from the header for a lazy mapping)."""
    return stored_dtype(weights, name) == torch.float8_e4m3fn


def stored_scale(weights: Mapping[str, torch.Tensor], scale_name: str) -> torch.Tensor:
    """A stored block scale in the dtype a QuantLinear holds: float32 (F32, or BF16 / F16
    widened exactly), or ``float8_e8m0fnu`` (F8_E8M0, or U8 bytes read as ue8m0)."""
    s = weights[scale_name]
    if s.dtype == torch.uint8:
        return s.view(torch.float8_e8m0fnu)
    if s.dtype == torch.float8_e8m0fnu:
        return s
    if s.dtype.is_floating_point and s.element_size() >= 2:
        return s.to(torch.float32)
    raise CheckpointError(f"scale {scale_name} is {s.dtype} (expected F32 float scales, or F8_E8M0 ue8m0 bytes)")


def read_fp8_weight(
    weights: Mapping[str, torch.Tensor],
    name: str,
    shape: tuple[int, ...],
    quant: Any,
    scale: tuple[str, torch.Tensor] | None = None,
    block: tuple[int, int] | None = None,
) -> QuantWeight:
    """The stored FP8 weight ``name`` of logical ``shape`` with its block scales (read from
    beside it, or ``scale`` = (its name, the tensor) in ``block`` where an architecture keeps
    them elsewhere), checked; one line naming the tensor when it cannot be served."""
    from engram_trt.checkpoint.checkpoint import listed_not_to_convert, module_of

    if quant is None:
        raise CheckpointError(
            f"tensor {name} is F8_E4M3 but the config declares no quantization_config (an FP8 "
            f"checkpoint's config carries quantization_config with quant_method \"fp8\"); restore it"
        )
    if listed_not_to_convert(module_of(name), quant) is not None:
        raise CheckpointError(
            f"tensor {name} is F8_E4M3 but quantization_config.modules_to_not_convert lists "
            f"{module_of(name)} (kept in 16 bits): the checkpoint and its config disagree"
        )
    block = block or quant.block_for(shape)
    if scale is None:
        scale_name = find_scale(name, weights)
        scale_t = None if scale_name is None else stored_scale(weights, scale_name)
    else:
        scale_name, scale_t = scale
    data = weights[name]
    scale_shape = None if scale_t is None else tuple(scale_t.shape)
    problem = check_quant_tensors(name, "fp8", shape, tuple(data.shape), scale_shape, block)
    if problem is not None:
        raise CheckpointError(problem)
    return QuantWeight(data, scale_t, "fp8", block)  # type: ignore[arg-type]


def quant_linear_of(linear: nn.Module, qw: QuantWeight, device: torch.device) -> QuantLinear:
    """A QuantLinear of ``linear``'s shape holding ``qw``'s bytes and scales on ``device``."""
    scale_fmt = "ue8m0" if qw.scale.dtype == torch.float8_e8m0fnu else "float"
    with torch.device("meta"):
        q = QuantLinear.like(linear, "fp8", qw.block, scale_fmt)  # type: ignore[arg-type]
    q.weight = qw.data.to(device)
    q.weight_scale_inv = qw.scale.to(device)
    return q


def set_linear(
    model: nn.Module,
    module_name: str,
    weights: Mapping[str, torch.Tensor],
    name: str,
    shape: tuple[int, ...],
    device: torch.device,
    dtype: torch.dtype,
    quant: Any,
    scale: Any = None,
) -> None:
    """Load the linear ``module_name`` of ``model`` from checkpoint tensor ``name``: a
    QuantLinear over the stored bytes when FP8 (``scale``: a callable giving ``((scale
    name, tensor), block)`` or None where an architecture keeps its scales elsewhere),
    else a float parameter in ``dtype``."""
    owner_name, _, leaf = module_name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    linear = getattr(owner, leaf)
    if is_fp8(weights, name):
        found = scale() if scale is not None else None
        qw = read_fp8_weight(weights, name, shape, quant, *(found if found is not None else (None, None)))
        setattr(owner, leaf, quant_linear_of(linear, qw, device))
        return
    t = weights[name]
    if tuple(t.shape) != shape:
        raise CheckpointError(f"tensor '{name}' has shape {list(t.shape)} but the config needs {list(shape)}")
    linear.weight = nn.Parameter(t.to(device=device, dtype=dtype), requires_grad=False)


def _linear_names(model: nn.Module) -> set[str]:
    return {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def _fusable(
    weights: Mapping[str, torch.Tensor], names: list[str], expected: dict[str, tuple[int, ...]], quant: Any
) -> str | None:
    """``"float"`` / ``"fp8"`` when the group ``names`` fuses (module docstring), else None."""
    kinds = {is_fp8(weights, n) for n in names}
    if kinds == {False}:
        return "float"
    if kinds != {True} or quant is None:
        return None
    block = quant.block_for(expected[names[0]])
    if any(expected[n][0] % block[0] for n in names[:-1]):
        return None
    scale_dtypes = set()
    for n in names:
        s = find_scale(n, weights)
        if s is None:
            return None  # refused with the tensor's name when loaded apart
        scale_dtypes.add(stored_scale(weights, s).dtype)
    return "fp8" if len(scale_dtypes) == 1 else None


def _fuse_fp8(
    model: nn.Module,
    module: nn.Module,
    attr: str,
    names: list[str],
    weights: Mapping[str, torch.Tensor],
    expected: dict[str, tuple[int, ...]],
    device: torch.device,
    quant: Any,
) -> None:
    """One FP8 group stacked: bytes and scales each one tensor by rows, the projections'
    QuantLinear buffers views of them."""
    parts = [read_fp8_weight(weights, n, expected[n], quant) for n in names]
    data = torch.empty(
        (sum(p.data.shape[0] for p in parts), parts[0].data.shape[1]), dtype=torch.float8_e4m3fn, device=device
    )
    scale = torch.empty(
        (sum(p.scale.shape[0] for p in parts), parts[0].scale.shape[1]), dtype=parts[0].scale.dtype, device=device
    )
    at = sat = 0
    for name, qw in zip(names, parts):
        n, sn = qw.data.shape[0], qw.scale.shape[0]
        data[at : at + n].copy_(qw.data)
        scale[sat : sat + sn].copy_(qw.scale)
        owner_name, _, leaf = name[: -len(".weight")].rpartition(".")
        owner = model.get_submodule(owner_name)
        setattr(
            owner,
            leaf,
            quant_linear_of(
                getattr(owner, leaf), QuantWeight(data[at : at + n], scale[sat : sat + sn], "fp8", qw.block), device
            ),
        )
        at, sat = at + n, sat + sn
    setattr(module, attr, QuantWeight(data, scale, "fp8", parts[0].block))


def load_weights(
    model: nn.Module,
    weights: Mapping[str, torch.Tensor],
    device: torch.device,
    dtype: torch.dtype,
    fuse: bool,
    shapes: Mapping[str, tuple[int, ...]] | None = None,
) -> None:
    """Checks ``weights`` against the config and makes them ``model``'s parameters (on
    ``device`` in ``dtype``; FP8 linears as QuantLinear in their stored form), the
    projections of each layer fused when ``fuse`` (module docstring). Each tensor is read
    once, when its turn comes. ``shapes``: the expected shapes where they are not the
    config's (a tensor-parallel rank's, :func:`.parallel.local_weight_shapes`)."""
    cfg = model.config  # type: ignore[attr-defined]
    quant = cfg.quant
    expected = dict(shapes) if shapes is not None else model_weight_shapes(cfg)
    for name, want in expected.items():
        if name not in weights:
            raise CheckpointError(f"weights lack tensor '{name}' (expected shape {list(want)})")
    params = dict(model.named_parameters())
    linears = _linear_names(model)
    groups = []
    for module, attr, names in fused_groups(model) if fuse else []:
        kind = _fusable(weights, names, expected, quant)
        if kind is not None:
            groups.append((module, attr, names, kind))
    stacked = {name for _, _, names, _ in groups for name in names}
    for name, want in expected.items():
        if name not in params:
            raise EngramError(f"internal: parameter '{name}' is not part of the module")
        if name in stacked:
            continue
        if name in linears:
            set_linear(model, name[: -len(".weight")], weights, name, want, device, dtype, quant)
            continue
        if is_fp8(weights, name):
            raise CheckpointError(
                f"tensor {name} is F8_E4M3, but only linear weights are served in FP8 (embeddings "
                f"and norms are read as floats)"
            )
        t = weights[name]
        if tuple(t.shape) != want:
            raise CheckpointError(f"tensor '{name}' has shape {list(t.shape)} but the config needs {list(want)}")
        owner_name, _, leaf = name.rpartition(".")
        setattr(
            model.get_submodule(owner_name), leaf, nn.Parameter(t.to(device=device, dtype=dtype), requires_grad=False)
        )
    for module, attr, names, kind in groups:
        if kind == "fp8":
            _fuse_fp8(model, module, attr, names, weights, expected, device, quant)
            continue
        buf = torch.empty((sum(expected[n][0] for n in names), expected[names[0]][1]), device=device, dtype=dtype)
        at = 0
        for name in names:
            n = expected[name][0]
            t = weights[name]
            if tuple(t.shape) != expected[name]:
                raise CheckpointError(
                    f"tensor '{name}' has shape {list(t.shape)} but the config needs {list(expected[name])}"
                )
            buf[at : at + n].copy_(t)
            owner_name, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner_name), leaf, nn.Parameter(buf[at : at + n], requires_grad=False))
            at += n
        setattr(module, attr, buf)
    leftover = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if leftover:
        raise EngramError(f"internal: parameters {leftover[:3]} were not loaded")
