"""Qwen4Exp's weights as a fine-grained FP8 checkpoint stores them, checked and loaded.

What transformers' FP8 save of Qwen4Exp writes (read from transformers 5.25's own save;
docs/quantization.md): every ``nn.Linear`` whose two dims divide by the block (the
attention q / k / v / o, the QSA ``index_qk_proj``, the Gated DeltaNet ``in_proj_qkv`` /
``in_proj_z`` / ``out_proj``, the hyper-connections' mixes, the PLE key / value
projections, the shared expert) as ``F8_E4M3`` with ``<module>.weight_scale_inv`` beside
it; the routed experts one ``F8_E4M3`` tensor per expert and projection
(``mlp.experts.E.gate_proj.weight``...) but one merged scale per projection kind for the
layer: ``mlp.experts.gate_up_proj_scale_inv [E, ceil(2I/bn), ceil(H/bk)]`` (the gate
rows first, then the up rows, as its fused ``gate_up_proj``) and
``mlp.experts.down_proj_scale_inv [E, ceil(H/bn), ceil(I/bk)]``. The rest stays float:
the router, the norms, the convolutions, the embeddings, the head, and the linears whose
dims do not divide by the block (beside which the save writes a stale scale: not read).

The gate / up halves of the merged scale: with ``I`` a multiple of the block rows, the
first ``I/bn`` scale rows are the gate's blocks and the next ``I/bn`` the up's; otherwise
a block row straddles the two halves, and each half takes, row by row, the scale its row
had in the fused weight (blocks of one row: ``(1, bk)``), exactly the values transformers
dequantizes with.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import torch
from torch import nn

from engram_trt.errors import CheckpointError
from engram_trt.quant.formats import scale_grid

_EXPERT_RE = re.compile(r"^(?P<base>.+\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
MERGED_SCALES = {
    "gate_proj": "gate_up_proj_scale_inv",
    "up_proj": "gate_up_proj_scale_inv",
    "down_proj": "down_proj_scale_inv",
}


def linear_weight_names(model: nn.Module, prefix: str) -> dict[str, str]:
    """Checkpoint weight name -> module path of every ``nn.Linear`` of ``model`` (a
    Qwen4Exp module tree whose ``model.`` maps to the checkpoint's ``prefix``) that an FP8
    checkpoint may store FP8: the router (``mlp.gate``, a plain parameter in transformers,
    never quantized) is not one."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and not name.endswith(".mlp.gate"):
            ck = prefix + name[len("model.") :] if name.startswith("model.") else name
            out[ck + ".weight"] = name
    return out


def expert_of(name: str) -> tuple[str, int, str] | None:
    """``(experts module name, expert index, projection)`` of a routed expert's weight."""
    m = _EXPERT_RE.match(name)
    return None if m is None else (m["base"], int(m["e"]), m["proj"])


def merged_scale_name(name: str) -> str | None:
    """The layer's merged scale of a routed expert's weight (None: not an expert weight)."""
    ex = expert_of(name)
    return None if ex is None else f"{ex[0]}.{MERGED_SCALES[ex[2]]}"


def merged_scale_shape(config: Any, proj: str, block: tuple[int, int]) -> tuple[int, int, int]:
    """The merged scale's shape transformers writes for ``proj``'s kind."""
    E, H, I = config.num_experts, config.hidden_size, config.moe_intermediate_size
    if proj == "down_proj":
        return (E, *scale_grid(H, I, *block))
    return (E, *scale_grid(2 * I, H, *block))


def expert_scale(
    merged: torch.Tensor, proj: str, e: int, rows: int, block: tuple[int, int]
) -> tuple[torch.Tensor, tuple[int, int]]:
    """Expert ``e``'s scales of ``proj`` (``rows`` output rows) from its layer's merged
    scale, and the block they are in (module docstring)."""
    bn, bk = block
    m = merged[e]
    if proj == "down_proj":
        return m, block
    lo = 0 if proj == "gate_proj" else rows
    if rows % bn == 0:
        return m[lo // bn : (lo + rows) // bn], block
    return m.index_select(0, (torch.arange(rows) + lo) // bn), (1, bk)


class ExpertScales:
    """The merged expert scales of a checkpoint read once per layer (a loader's cache)."""

    def __init__(self, weights: Mapping[str, torch.Tensor]) -> None:
        self.weights = weights
        self._cache: dict[str, torch.Tensor] = {}

    def get(self, name: str) -> torch.Tensor:
        t = self._cache.get(name)
        if t is None:
            from engram_trt.models.engram_llama.weights import stored_scale

            self._cache = {name: stored_scale(self.weights, name)}  # one layer at a time
            t = self._cache[name]
        return t


def expert_weight_scale(
    weights: Mapping[str, torch.Tensor], name: str, shape: tuple[int, ...], quant: Any, config: Any, cache: ExpertScales
) -> tuple[tuple[str, torch.Tensor], tuple[int, int]] | None:
    """``((scale name, expert e's scales), block)`` of a routed expert's FP8 weight stored
    with transformers' merged scales (None: it has its own scale beside it, or none)."""
    from engram_trt.quant.names import find_scale

    if find_scale(name, weights) is not None:
        return None
    merged = merged_scale_name(name)
    if merged is None or merged not in weights:
        return None
    _, e, proj = expert_of(name)  # type: ignore[misc]
    block = quant.block_for(shape)
    scales = cache.get(merged)
    want = merged_scale_shape(config, proj, block)
    if tuple(scales.shape) != want:
        raise CheckpointError(
            f"scale {merged} has shape {list(scales.shape)} but {config.num_experts} experts in "
            f"{block[0]}x{block[1]} blocks need {list(want)}"
        )
    part, part_block = expert_scale(scales, proj, e, shape[0], block)
    return (merged, part), part_block


def fp8_problems(
    ckpt: Any, config: Any, linear_names: Mapping[str, str], shapes: Mapping[str, tuple[int, ...]], quant: Any
) -> dict[str, str]:
    """Per FP8 weight with a problem, its one line (the weights stored F8_E4M3: a linear's,
    with its scales valid; one projection of a layer's experts all FP8 or all float)."""
    from engram_trt.checkpoint.checkpoint import fp8_weight_problem, listed_not_to_convert, module_of
    from engram_trt.quant.names import SCALE_DTYPES, find_scale

    out: dict[str, str] = {}
    kinds: dict[str, set[bool]] = {}
    for name in linear_names:
        if name not in ckpt or tuple(ckpt.shape(name)) != shapes[name]:
            continue
        fp8 = ckpt.st_dtype(name) == "F8_E4M3"
        ex = expert_of(name)
        if ex is not None:
            kinds.setdefault(f"{ex[0]}.*.{ex[2]}", set()).add(fp8)
        if not fp8:
            continue
        merged = merged_scale_name(name)
        if (
            merged is not None
            and find_scale(name, ckpt) is None
            and merged in ckpt
            and quant is not None
            and listed_not_to_convert(module_of(name), quant) is None
        ):
            block = quant.block_for(shapes[name])
            want = merged_scale_shape(config, ex[2], block)  # type: ignore[index]
            got = tuple(ckpt.shape(merged))
            if ckpt.st_dtype(merged) not in SCALE_DTYPES:
                out[name] = (
                    f"scale {merged} of {name} is {ckpt.st_dtype(merged)} (expected F32 float scales, or "
                    f"F8_E8M0 ue8m0 bytes)"
                )
            elif got != want:
                out[name] = (
                    f"scale {merged} has shape {list(got)} but {config.num_experts} experts in "
                    f"{block[0]}x{block[1]} blocks need {list(want)}"
                )
            continue
        problem = fp8_weight_problem(ckpt, name, shapes[name], quant)
        if problem is not None:
            out[name] = problem
    for pattern, seen in kinds.items():
        if len(seen) > 1:
            first = next(
                n
                for n in linear_names
                if n.startswith(pattern.split("*")[0])
                and n.endswith(pattern.split("*")[1] + ".weight")
                and n in ckpt
                and ckpt.st_dtype(n) != "F8_E4M3"
            )
            out[first] = (
                f"the routed experts' weights {pattern}.weight are stored partly F8_E4M3 and partly in 16 "
                f"bits ({first} is {ckpt.st_dtype(first)}): one projection of a layer's experts is FP8 "
                f"for all of them or for none, as transformers' save writes it"
            )
    return out
