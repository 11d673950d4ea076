"""The whole Qwen4Exp text model as ONE ONNX serving step: the artifact ``engram-trt
build`` parses into an engine (the why of ONNX: models/engram_llama/onnx_export.py).

The step is the packed one of every engram-trt graph: ``input_ids [T]``, ``seq_starts
[S+1]``, ``past_lens [S]``, ``slots [S]`` (int32), from which standard ops derive each
token's sequence, position and slot. Then, for ``hc_count`` residual streams ``[T, hc,
D]`` (:mod:`.onnx_blocks` has each block's ops):

* ``input_ids`` -> Gather(embed) -> ``hc`` copies;
* per decoder layer: on a PLE layer EngramPleHash (raw ids + ``ple_context [S, N-1]``)
  -> EngramGather (the layer's table at ``ple_table_ptrs[j]``) -> key / value GEMMs ->
  EngramPleFusion, added to the streams; the attention hyper-connection's mix; the token
  mixer, either Gated DeltaNet (projections, gating math, EngramCausalConv1d,
  EngramGatedDeltaNet, gated RMSNorm, out_proj) or gated attention (offset norms,
  partial RoPE, the QSA indexer's queries / raw keys, EngramQsaAttention, the sigmoid
  output gate, o_proj); injection; the MLP hyper-connection around the sparse MoE
  (TopK routing, every expert computed densely and weighted: see ``Blocks.moe``);
* at each sequence's last token the final hyper-connection mixer (no injection; the
  model has no other final norm) -> the head (tied or not) -> ``logits [S, vocab]``
  float32.

Every per-slot state is a graph input updated in place by the plugin that owns it, its
output aliasing the input (``*_out_i``), as the KV caches of engram-llama's graph:

=============================  =================================================  ==========
input                          shape                                              dtype
=============================  =================================================  ==========
``key_cache_i / value_cache_i``  ``[num_slots, kv_heads, max_seq_len, head_dim]``   graph's
``index_key_cache_i``          ``[num_slots, max_seq_len, indexer_head_dim]``     graph's
``conv_state_i``               ``[num_slots, conv_dim, K-1]``                     graph's
``recurrent_state_i``          ``[num_slots, Hv, dk, dv]``                        float32
``ple_conv_state_i``           ``[num_slots, hc*D, (K_ple-1) * ngram_size]``      graph's
=============================  =================================================  ==========

``ple_context [S, N-1]`` int32 (the raw ids before each sequence's first token of the
step, EOS for a fresh sequence; the runtime carries it between steps as
``next_context``) and ``ple_table_ptrs [L_ple]`` int64 (each PLE layer's table address:
the tables never enter the graph or the engine) are per-step inputs.

The export is a pure function of (config, weights, options): rebuilding gives the same bytes.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from engram_trt.errors import EngramError
from engram_trt.models.export import DTYPES, EXTERNAL_DATA_THRESHOLD, OPSET, PLUGIN_DOMAIN, ExportedModel, ExportOptions

# The PLE rows the EngramGather plugin reads, of any width (models/export.FLOAT_TABLE_DTYPE_CODES;
# its output is the table's dtype, cast to the graph's); fp8 needs scales that a PLE
# checkpoint does not have.
PLE_TABLE_DTYPES = ("bf16", "fp16", "fp32")
STATE_KINDS = ("key_cache", "value_cache", "index_key_cache", "conv_state", "recurrent_state", "ple_conv_state")


def state_shapes(config: Any) -> dict[str, tuple[list[Any], str]]:
    """Every per-slot state input: name -> (shape with the symbolic ``num_slots`` /
    ``max_seq_len``, ``"act"`` or ``"fp32"``). The aliased output is ``name`` with
    ``_out`` before the layer index (``key_cache_3`` -> ``key_cache_out_3``)."""
    from engram_trt.models.qwen4_exp.linear_attention import GatedDeltaNet
    from engram_trt.models.qwen4_exp.modules import PLEFusion

    out: dict[str, tuple[list[Any], str]] = {}
    for i in range(config.num_hidden_layers):
        if config.ple is not None and i in config.ple.layers:
            out[f"ple_conv_state_{i}"] = (["num_slots", *PLEFusion.state_shape(config)], "act")
        if config.layer_types[i] == "linear_attention":
            s = GatedDeltaNet.state_shapes(config)
            out[f"conv_state_{i}"] = (["num_slots", *s["conv"]], "act")
            out[f"recurrent_state_{i}"] = (["num_slots", *s["recurrent"]], "fp32")
        else:
            kv = ["num_slots", config.num_key_value_heads, "max_seq_len", config.head_dim]
            out[f"key_cache_{i}"] = (kv, "act")
            out[f"value_cache_{i}"] = (list(kv), "act")
            out[f"index_key_cache_{i}"] = (["num_slots", "max_seq_len", config.qsa.head_dim], "act")
    return out


def alias_name(state: str) -> str:
    base, i = state.rsplit("_", 1)
    return f"{base}_out_{i}"


def rope_tables(config: Any, max_position: int) -> tuple[np.ndarray, np.ndarray]:
    """``cos, sin [max_position, rotary_dim / 2]`` float32, as :func:`.attention.rope_cos_sin`
    computes them (torch float32: positions times the default inverse frequencies)."""
    import torch

    from engram_trt.models.qwen4_exp.attention import rope_cos_sin

    cos, sin = rope_cos_sin(config, torch.arange(max_position))
    half = int(config.rotary_dim) // 2
    return cos[:, :half].numpy(), sin[:, :half].numpy()


def export_model(
    config: Any,
    weights: Mapping[str, Any] | Callable[[str], Any],
    layout: Any = None,
    options: ExportOptions | None = None,
) -> ExportedModel:
    """The ONNX serving step of a Qwen4Exp text model (the module docstring).

    ``weights``: checkpoint name -> tensor, or a callable (``Checkpoint.get``); only
    weights are read, never a PLE table. ``layout``: the model's
    :class:`~engram_trt.engram.ple_hash.PLEHashLayout` (``architecture.ple_layout(config)``).
    ``options.table_rows``: each PLE table's rows as bound at run time (default: the
    layout's); ``options.table_dtype``: their storage, one of :data:`PLE_TABLE_DTYPES`
    (default bf16): the gather reads that type and the graph casts its rows."""
    import onnx
    from onnx import TensorProto, helper

    from engram_trt.models.engram_llama.onnx_export import _Graph
    from engram_trt.models.qwen4_exp.onnx_blocks import Blocks

    from engram_trt.models.onnx_quant import ExportTensors

    opts = options or ExportOptions()
    get = ExportTensors(weights)
    elem, np_dt, _ = DTYPES[opts.dtype]
    cfg = config
    ple = cfg.ple
    if ple is not None and layout is None:
        raise EngramError(
            "exporting a Qwen4Exp model with PLE layers needs its PLEHashLayout (architecture.ple_layout(config))"
        )
    table_rows: list[int] = []
    tdt = opts.table_dtype or "bf16"
    if ple is not None:
        if tdt not in PLE_TABLE_DTYPES:
            raise EngramError(
                f"PLE tables stored as {tdt}: the EngramGather plugin reads {', '.join(PLE_TABLE_DTYPES)} "
                f"rows; save the PLE shards as BF16, F16 or F32 to build an engine (or serve the "
                f"checkpoint with the torch backend)"
            )
        table_rows = [int(r) for r in (opts.table_rows or layout.table_rows)]
        if len(table_rows) != len(ple.layers):
            raise EngramError(f"table rows {table_rows} are not one per PLE layer ({len(ple.layers)})")
    max_pos = int(opts.max_position or cfg.max_position_embeddings)
    g = _Graph()
    i32 = TensorProto.INT32
    inputs: list[Any] = [
        helper.make_tensor_value_info("input_ids", i32, ["tokens"]),
        helper.make_tensor_value_info("seq_starts", i32, ["seqs_plus_1"]),
        helper.make_tensor_value_info("past_lens", i32, ["seqs"]),
        helper.make_tensor_value_info("slots", i32, ["seqs"]),
    ]
    outputs: list[Any] = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["seqs", cfg.vocab_size])]
    if ple is not None:
        inputs.append(helper.make_tensor_value_info("ple_context", i32, ["seqs", ple.ngram_size - 1]))
        inputs.append(helper.make_tensor_value_info("ple_table_ptrs", TensorProto.INT64, [len(ple.layers)]))

    # --- where each token sits (as engram-llama's graph) --------------------------------
    T = g.op("Squeeze", [g.op("Shape", ["input_ids"], "tokens")], "tokens_s")
    tok = g.op("Cast", [g.op("Range", [g.scalar(0), T, g.scalar(1)], "token_index64")], "token_index", to=i32)
    ends = g.op("Slice", ["seq_starts", g.ints([1]), g.ints([2**62])], "seq_ends")
    after = g.op(
        "LessOrEqual",
        [g.op("Unsqueeze", [ends, g.ints([0])]), g.op("Unsqueeze", [tok, g.ints([1])])],
        "token_after_seq",
    )
    token_seq = g.op("ReduceSum", [g.op("Cast", [after], to=i32), g.ints([1])], "token_seq", keepdims=0)
    token_pos = g.op(
        "Add",
        [
            g.op("Gather", ["past_lens", token_seq], axis=0),
            g.op("Sub", [tok, g.op("Gather", ["seq_starts", token_seq], axis=0)]),
        ],
        "token_pos",
    )
    token_slot = g.op("Gather", ["slots", token_seq], "token_slot", axis=0)
    position_ids = g.op("Unsqueeze", [g.op("Cast", [token_pos], to=TensorProto.INT64), g.ints([1])], "position_ids")
    last = g.op("Sub", [ends, g.const("c_i32_1", np.asarray(1, np.int32))], "last_token")

    cos, sin = rope_tables(cfg, max_pos)
    b = Blocks(
        g,
        cfg,
        get,
        elem,
        np_dt,
        g.const("rope_cos", cos.astype(np_dt)),
        g.const("rope_sin", sin.astype(np_dt)),
        position_ids,
        token_slot,
        token_pos,
    )

    # --- states ---------------------------------------------------------------------------
    states = state_shapes(cfg)
    for name, (shape, kind) in states.items():
        t = elem if kind == "act" else TensorProto.FLOAT
        inputs.append(helper.make_tensor_value_info(name, t, shape))
        outputs.append(helper.make_tensor_value_info(alias_name(name), t, shape))

    # --- the layers -----------------------------------------------------------------------
    prefix = cfg.weight_prefix
    hc = cfg.hc_count
    embed = b.weight(f"{prefix}embed_tokens.weight")
    x = g.op("Gather", [embed, "input_ids"], "embed", axis=0)
    streams = g.op("Expand", [g.op("Unsqueeze", [x, g.ints([1])]), g.ints([1, hc, 1])], "streams")  # [T, hc, D]
    ple_index = {layer: j for j, layer in enumerate(ple.layers)} if ple is not None else {}
    for i in range(cfg.num_hidden_layers):
        p = f"{prefix}layers.{i}"
        if i in ple_index:
            j = ple_index[i]
            streams = b.ple(
                streams, p, j, layout, table_rows[j], f"ple_conv_state_{i}", f"ple_conv_state_out_{i}", table_dtype=tdt
            )
        x, w = b.mix(streams, f"{p}.attn_hyper_connection")
        if cfg.layer_types[i] == "linear_attention":
            y = b.gated_delta_net(
                x, p, f"conv_state_{i}", f"conv_state_out_{i}", f"recurrent_state_{i}", f"recurrent_state_out_{i}"
            )
        else:
            y = b.attention(
                x,
                p,
                (f"key_cache_{i}", f"value_cache_{i}", f"index_key_cache_{i}"),
                (f"key_cache_out_{i}", f"value_cache_out_{i}", f"index_key_cache_out_{i}"),
            )
        streams = b.inject(streams, y, w)
        x, w = b.mix(streams, f"{p}.mlp_hyper_connection")
        streams = b.inject(streams, b.moe(x, p), w)

    # Only each sequence's last token goes on (the mixer and head are per token).
    hidden, _ = b.mix(
        g.op("Gather", [streams, last], "last_streams", axis=0), f"{prefix}hyper_connection_mixer", inject=False
    )
    if cfg.tie_word_embeddings:
        logits = g.op("MatMul", [hidden, g.op("Transpose", [embed], "lm_head_t", perm=[1, 0])], "lm_head")
    else:
        logits = b.linear(hidden, "lm_head.weight", "lm_head")
    g.op("Cast", [logits], outputs=["logits"], to=TensorProto.FLOAT)

    graph = helper.make_graph(g.nodes, "qwen4_exp", inputs, outputs, g.inits)
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(PLUGIN_DOMAIN, 1)],
        producer_name="engram-trt",
        doc_string="Qwen4Exp serving step; PLE tables are bound at run time by address",
    )
    model.ir_version = 10
    if g.init_bytes < EXTERNAL_DATA_THRESHOLD:
        onnx.checker.check_model(model)
    io: dict[str, Any] = {
        "architecture": "qwen4-exp",
        "vocab": cfg.vocab_size,
        "layers": cfg.num_hidden_layers,
        "max_position": max_pos,
        "plugins": sorted({n.op_type for n in g.nodes if n.domain == PLUGIN_DOMAIN}),
        "states": {
            name: {"shape": shape, "dtype": kind, "alias": alias_name(name)} for name, (shape, kind) in states.items()
        },
        "ple": None
        if ple is None
        else {
            "layers": len(ple.layers),
            "context": ple.ngram_size - 1,
            "table_rows": table_rows,
            "head_dim": ple.head_dim,
            "heads": ple.n_heads,
            "table_dtype": tdt,
            "eos_id": int(layout.eos_id),
        },
    }
    return ExportedModel(
        model=model,
        input_names=[v.name for v in inputs],
        output_names=[v.name for v in outputs],
        num_layers=cfg.num_hidden_layers,
        engram_layers=0 if ple is None else len(ple.layers),
        dtype=opts.dtype,
        initializer_bytes=g.init_bytes,
        io=io,
    )
