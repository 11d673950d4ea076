"""engram-llama's checkpoint checks: the backbone's tensor names and shapes
(:func:`backbone_tensor_shapes`, HF Llama's), and every tensor the model reads held to
its config (:func:`validate_checkpoint`: the backbone's presence, shapes and dtypes, FP8
linear weights with valid block scales where the config declares FP8, and per Engram
layer its table, scale, ``wkv`` and gate weights against the Engram layout).
:meth:`~engram_trt.models.engram_llama.architecture.EngramLlamaArchitecture.checkpoint_problems`
is :func:`validate_checkpoint`; :func:`require_valid` refuses the first problem.

The FP8 checks every architecture shares (:func:`~engram_trt.checkpoint.checkpoint.fp8_weight_problem`,
``checkpoint_quant``) stay with the checkpoint.
"""

from __future__ import annotations

import shlex
from typing import Any

from engram_trt.checkpoint.checkpoint import (
    FP8_WEIGHT_DTYPE,
    Checkpoint,
    checkpoint_quant,
    engram_tensor_names,
    fp8_weight_problem,
)
from engram_trt.checkpoint.files import BF16_TABLE_DTYPES, FP8_SCALE_DTYPES, FP8_TABLE_DTYPES
from engram_trt.config.model import EngramSpec, ModelConfig
from engram_trt.errors import CheckpointError, ConfigError, EngramError


def is_linear_weight(name: str) -> bool:
    """Whether a backbone / Engram tensor name is a linear layer's weight (the ones a
    fine-grained FP8 checkpoint may store as F8_E4M3): the projections, the head, wkv."""
    return name.endswith(("_proj.weight", ".wkv.weight")) or name == "lm_head.weight"


def backbone_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF Llama names and shapes of the engram-llama backbone (no Engram tensors).

    ``lm_head.weight`` is absent when the embeddings are tied: the checkpoint then
    stores the matrix once, as ``model.embed_tokens.weight``.
    """
    D, I = config.hidden_size, config.intermediate_size
    hd, nh, kvh = config.head_dim, config.num_attention_heads, config.num_key_value_heads
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, D)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        out[f"{p}.input_layernorm.weight"] = (D,)
        out[f"{p}.self_attn.q_proj.weight"] = (nh * hd, D)
        out[f"{p}.self_attn.k_proj.weight"] = (kvh * hd, D)
        out[f"{p}.self_attn.v_proj.weight"] = (kvh * hd, D)
        out[f"{p}.self_attn.o_proj.weight"] = (D, nh * hd)
        out[f"{p}.post_attention_layernorm.weight"] = (D,)
        out[f"{p}.mlp.gate_proj.weight"] = (I, D)
        out[f"{p}.mlp.up_proj.weight"] = (I, D)
        out[f"{p}.mlp.down_proj.weight"] = (D, I)
    out["model.norm.weight"] = (D,)
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = (config.vocab_size, D)
    return out


def _engram_layout_for(ckpt: Checkpoint) -> Any:
    """The layout of a checkpoint's config, for shape checks only.

    Table shapes do not depend on the pad id, so a placeholder compressed pad id (0)
    is used rather than building the compressed vocab (seconds of tokenizer work).
    """
    from engram_trt.engram.layout import EngramLayout

    spec = ckpt.config.engram
    assert spec is not None
    return EngramLayout.from_spec(spec, pad_id=0)


# The stored dtypes a backbone weight may have: read as floats and cast to the compute
# dtype. Beside them, a linear weight may be FP8 (F8_E4M3 with block scales) where the
# config declares a fine-grained FP8 quantization_config (fp8_weight_problem); integer
# weights (GPTQ, AWQ, ...) are refused.
BACKBONE_DTYPES = ("F32", "BF16", "F16", "F64")


def float_or_fp8_problem(ckpt: Any, name: str, shape: tuple[int, ...], quant: Any, linear: bool) -> str | None:
    """The dtype problem of a weight whose shape is right (None: none): float weights
    read; a linear weight may be F8_E4M3 with its scales (:func:`fp8_weight_problem`)."""
    st = ckpt.st_dtype(name)
    if st in BACKBONE_DTYPES:
        return None
    if st == FP8_WEIGHT_DTYPE and linear:
        return fp8_weight_problem(ckpt, name, shape, quant)
    if st == FP8_WEIGHT_DTYPE and quant is not None:
        return (
            f"tensor {name} is {st}, but only linear weights are served in FP8 (embeddings, norms and gates are "
            f"read as floats: expected one of {', '.join(BACKBONE_DTYPES)})"
        )
    return (
        f"tensor {name} is {st}, not a float weight (expected one of {', '.join(BACKBONE_DTYPES)}); "
        f"dequantize the checkpoint first"
    )


def validate_checkpoint(ckpt: Checkpoint, layout: Any = None) -> list[str]:
    """Problems that would make the checkpoint unusable, one line each (empty = fine).

    Checks the backbone tensors' presence, shapes and dtypes (FP8 linear weights with
    valid block scales where the config declares FP8), and per Engram layer: the table
    exists, has ``engram_head_dim`` columns and at least the layout's rows, its dtype
    matches ``table_dtype`` and (FP8) its scale has shape ``[rows, head_dim/quant_block]``;
    ``wkv`` is ``[(hc+1)*hidden, n_hash_cols*head_dim]``; ``q_weight``/``k_weight`` are
    ``[hc, hidden]``.
    """
    cfg = ckpt.config
    problems: list[str] = []
    try:
        quant = checkpoint_quant(ckpt)
    except ConfigError as exc:
        return [str(exc)]

    def shape_of(name: str) -> tuple[int, ...] | None:
        return ckpt.shape(name) if name in ckpt else None

    for name, want in backbone_tensor_shapes(cfg).items():
        got = shape_of(name)
        if got is None:
            problems.append(f"tensor {name} is missing (expected shape {list(want)})")
        elif got != want:
            problems.append(f"tensor {name} has shape {list(got)} but the config needs {list(want)}")
        else:
            bad = float_or_fp8_problem(ckpt, name, want, quant, is_linear_weight(name))
            if bad is not None:
                problems.append(bad)
    spec: EngramSpec | None = cfg.engram
    if spec is None:
        return problems
    if spec.head_dim is None:
        problems.append(
            f"config has no {spec.field_name('head_dim')} (the table row width), so the tables cannot be checked"
        )
        return problems
    if layout is None:
        try:
            layout = _engram_layout_for(ckpt)
        except EngramError as exc:
            problems.append(str(exc))
            return problems
    D, hc, hd = cfg.hidden_size, cfg.hc_mult, spec.head_dim
    for li, layer_id in enumerate(layout.layer_ids):
        names = engram_tensor_names(layer_id, spec.prefix)
        need = int(layout.table_rows[li])
        tshape = shape_of(names["table"])
        if tshape is None:
            problems.append(f"table {names['table']} is missing (Engram layer {layer_id} needs [{need}, {hd}])")
        else:
            st = ckpt.st_dtype(names["table"])
            if len(tshape) != 2:
                problems.append(f"table {names['table']} has shape {list(tshape)} (expected 2-D [rows, {hd}])")
            else:
                rows, width = tshape
                if width != hd:
                    problems.append(
                        f"table {names['table']} has rows of width {width} but {spec.field_name('head_dim')}={hd}"
                    )
                declared = None if spec.num_embeddings is None else spec.num_embeddings[li]
                if declared is not None and rows != declared:
                    problems.append(
                        f"table {names['table']} has {rows} rows but "
                        f"{spec.field_name('num_embeddings')}[{li}]={declared} (fix the config or the table)"
                    )
                if rows < need:
                    problems.append(
                        f"table {names['table']} has {rows} rows but the layout needs at least {need}: "
                        f"the checkpoint does not cover {spec.field_name('num_embeddings')}/primes "
                        f"(rebuild the tables or fix {spec.field_name('vocab_size')})"
                    )
                if spec.table_dtype == "fp8":
                    if st not in FP8_TABLE_DTYPES:
                        problems.append(
                            f"table {names['table']} is {st} but {spec.field_name('table_dtype')}='fp8' "
                            "(expected F8_E4M3 with ue8m0 scales)"
                        )
                    sshape = shape_of(names["scale"])
                    want_s = (rows, width // spec.quant_block)
                    if sshape is None:
                        problems.append(
                            f"scale {names['scale']} is missing (an FP8 table needs [rows, "
                            f"width/{spec.quant_block}] = {list(want_s)})"
                        )
                    else:
                        if sshape != want_s:
                            problems.append(
                                f"scale {names['scale']} has shape {list(sshape)} but its table needs {list(want_s)}"
                            )
                        if ckpt.st_dtype(names["scale"]) not in FP8_SCALE_DTYPES:
                            problems.append(
                                f"scale {names['scale']} is {ckpt.st_dtype(names['scale'])} "
                                "(expected F8_E8M0 ue8m0 bytes)"
                            )
                elif st not in BF16_TABLE_DTYPES:
                    problems.append(
                        f"table {names['table']} is {st} but {spec.field_name('table_dtype')}='bf16' (expected BF16)"
                    )
        want_wkv = ((hc + 1) * D, layout.n_hash_cols * hd)
        got = shape_of(names["wkv"])
        if got is None:
            problems.append(f"tensor {names['wkv']} is missing (expected {list(want_wkv)})")
        elif got != want_wkv:
            problems.append(
                f"tensor {names['wkv']} has shape {list(got)} but needs "
                f"[(hc_mult+1)*hidden, n_hash_cols*head_dim] = {list(want_wkv)}"
            )
        else:
            bad = float_or_fp8_problem(ckpt, names["wkv"], want_wkv, quant, linear=True)
            if bad is not None:
                problems.append(bad)
        for key in ("q_weight", "k_weight"):
            got = shape_of(names[key])
            if got is None:
                problems.append(f"tensor {names[key]} is missing (expected [{hc}, {D}])")
            elif got != (hc, D):
                problems.append(f"tensor {names[key]} has shape {list(got)} but needs [hc_mult, hidden] = [{hc}, {D}]")
    return problems


def require_valid(ckpt: Checkpoint, layout: Any = None) -> None:
    """Raise :class:`CheckpointError` with the first problem (and how many) if any."""
    problems = validate_checkpoint(ckpt, layout)
    if problems:
        more = (
            f" (and {len(problems) - 1} more problem(s); `engram-trt inspect {shlex.quote(str(ckpt.path))}` lists them)"
            if len(problems) > 1
            else ""
        )
        raise CheckpointError(f"checkpoint '{ckpt.path}': {problems[0]}{more}")
