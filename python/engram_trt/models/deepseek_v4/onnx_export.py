"""The whole DeepSeek-V4 (and V4.1) model as ONE ONNX serving step: the artifact
``engram-trt build`` parses into an engine (the why of ONNX: models/engram_llama/onnx_export.py).

The step is the packed one of every engram-trt graph: ``input_ids [T]``, ``seq_starts
[S+1]``, ``past_lens [S]``, ``slots [S]`` (int32), from which standard ops derive each
token's sequence and position. Then, for ``hc_mult`` residual streams ``[T, hc, D]``
(:mod:`.onnx_blocks` has each block's ops):

* ``input_ids`` -> Gather(embed) -> ``hc`` copies;
* per decoder layer: (V4.1, on an ``engram_layer_ids`` layer) EngramHash (compressed
  ``engram_ids`` + ``engram_lookback``) -> EngramGather (the table at
  ``engram_table_ptrs[j]``) -> wkv -> EngramGate on the streams, exactly engram-llama's
  nodes (with ``table_placement prefetch`` the staged rows ``engram_rows_j`` come in
  instead of the hash and gather); the attention's mHC (RMS-normalized flat streams ->
  pre / post / comb, Sinkhorn-Knopp unrolled) collapsing the streams; ``attn_norm``; the
  attention (projections, norms and RoPE as standard ops, one EngramDsv4Attention node
  per layer holding the sliding window, the compressors and the CSA indexer's top-k over
  the slots' state in place, then the inverse RoPE and the grouped output projection);
  the streams re-spread; the same around the MoE (hash routing a Gather of the raw ids
  through the frozen ``tid2eid``, top-k routing a TopK; routed experts stored FP4 / FP8
  in one EngramRoutedExperts node, float ones computed densely: see ``Blocks.moe``) with
  its shared expert;
* at each sequence's last token the hyper head, the final norm and the head (tied or
  not) -> ``logits [S, vocab]`` float32.

Weights are read under the model's canonical names from either layout (transformers'
save spelling or DeepSeek's root names, scales under ``.scale`` or ``.weight_scale_inv``:
:func:`.weights.resolve_names`); the ones stored FP8 enter as DequantizeLinear of their
bytes (models/onnx_quant.py).

The multi-token-prediction layers (``mtp.*``, ``num_nextn_predict_layers``) are not in
the graph: the torch model and transformers do not build them either (the registry
accepts their tensors with a note).

Every per-slot state of a layer is a graph input updated in place by its attention node,
its output aliasing the input (``window_kv_3`` -> ``window_kv_out_3``): exactly
:meth:`~.attention.DeepseekV4Attention.state_shapes` with ``num_slots`` stacked in front,
all in the graph's dtype; the compressed entries' length is ``max_seq_len // rate``, a
dimension written ``"max_seq_len//<rate>"`` (the builder's profile and the runners resolve it).

The export is a pure function of (config, weights, layout, options): rebuilding gives the same bytes.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from engram_trt.errors import EngramError
from engram_trt.models.export import (
    DTYPES,
    EXTERNAL_DATA_THRESHOLD,
    GATE_IO_DTYPES,
    OPSET,
    PLUGIN_DOMAIN,
    TABLE_DTYPE_CODES,
    ExportedModel,
    ExportOptions,
)

# The attention kernel's limits (the op contract): the shared head and the indexer's keys.
MAX_HEAD_DIM = 512
MAX_INDEX_HEAD_DIM = 256
_ENTRY_STATES = ("compressed_kv", "index_keys")  # [max_len // rate, ...]: the one length-dependent dimension


def entries_dim(rate: int) -> str:
    """The symbolic length of a layer's compressed entries (``max_len // rate``)."""
    return f"max_seq_len//{int(rate)}"


def resolve_dim(d: Any, num_slots: int, max_seq_len: int) -> int:
    """A state dimension as allocated: ``num_slots``, ``max_seq_len``, ``max_seq_len//r`` or a number."""
    if d == "num_slots":
        return int(num_slots)
    if d == "max_seq_len":
        return int(max_seq_len)
    if isinstance(d, str) and d.startswith("max_seq_len//"):
        return int(max_seq_len) // int(d.split("//", 1)[1])
    return int(d)


def state_shapes(config: Any) -> dict[str, tuple[list[Any], str]]:
    """Every per-slot state input: name (``<state>_<layer>``) -> (shape with the symbolic
    ``num_slots`` / ``max_seq_len//rate``, ``"act"``). The aliased output is
    :func:`alias_name`'s."""
    from engram_trt.models.deepseek_v4.attention import DeepseekV4Attention, layer_type_of
    from engram_trt.models.deepseek_v4.compressors import compress_rate

    out: dict[str, tuple[list[Any], str]] = {}
    for i in range(config.num_hidden_layers):
        layer_type = layer_type_of(config, i)
        rate = 1 if layer_type == "sliding_attention" else compress_rate(config, layer_type)
        for name, (shape, _kind) in DeepseekV4Attention.state_shapes(config, i, rate).items():
            dims: list[Any] = list(shape)
            if name in _ENTRY_STATES:
                dims[0] = entries_dim(rate)
            out[f"{name}_{i}"] = (["num_slots", *dims], "act")
    return out


def alias_name(state: str) -> str:
    base, i = state.rsplit("_", 1)
    return f"{base}_out_{i}"


def layer_states(config: Any, i: int) -> list[str]:
    """Layer ``i``'s state inputs in the attention node's order (window, compressor, indexer)."""
    from engram_trt.models.deepseek_v4.attention import DeepseekV4Attention

    return [f"{n}_{i}" for n in DeepseekV4Attention.state_shapes(config, i, 1 << 20)]


def engine_limits(config: Any, max_position: int) -> list[str]:
    """What the attention kernel cannot take, one line each (empty: it fits)."""
    from engram_trt.models.deepseek_v4.attention import layer_type_of
    from engram_trt.models.deepseek_v4.compressors import compress_rate

    out = []
    if config.head_dim > MAX_HEAD_DIM:
        out.append(
            f"head_dim={config.head_dim}: the EngramDsv4Attention kernel takes head_dim <= {MAX_HEAD_DIM}; serve "
            f"the checkpoint with the torch backend (engram-trt run / serve)"
        )
    types = {layer_type_of(config, i) for i in range(config.num_hidden_layers)}
    if "compressed_sparse_attention" in types and config.index_head_dim > MAX_INDEX_HEAD_DIM:
        out.append(
            f"index_head_dim={config.index_head_dim}: the EngramDsv4Attention kernel takes index_head_dim <= "
            f"{MAX_INDEX_HEAD_DIM}; serve the checkpoint with the torch backend (engram-trt run / serve)"
        )
    for t in sorted(types - {"sliding_attention"}):
        rate = compress_rate(config, t)
        if max_position // rate < 1:
            out.append(
                f"--max-seq-len {max_position} holds no {t} entry (compress rate {rate}); build with "
                f"--max-seq-len >= {rate}"
            )
        elif t == "compressed_sparse_attention" and config.index_topk > max_position // rate:
            out.append(
                f"index_topk={config.index_topk} exceeds the {max_position // rate} compressed entries "
                f"--max-seq-len {max_position} holds (rate {rate}); build with --max-seq-len >= "
                f"{config.index_topk * rate}"
            )
    return out


def export_model(
    config: Any,
    weights: Mapping[str, Any] | Callable[[str], Any],
    layout: Any = None,
    options: ExportOptions | None = None,
) -> ExportedModel:
    """The ONNX serving step of a DeepSeek-V4 / V4.1 model (the module docstring).

    ``weights``: checkpoint name -> tensor, or a callable (``Checkpoint.get``); only
    weights are read, never an Engram table. ``layout``: V4.1's
    :class:`~engram_trt.engram.layout.EngramLayout` (the compressed pad id's).
    ``options.max_position``: the longest sequence a slot holds (the RoPE tables' rows
    and the compressed entries' capacity); ``options.table_dtype`` / ``table_rows``: the
    Engram tables as bound at run time (default: the config's / the layout's)."""
    import onnx
    from onnx import TensorProto, helper

    from engram_trt.models.deepseek_v4.attention import layer_type_of
    from engram_trt.models.deepseek_v4.compressors import RopeTable
    from engram_trt.models.deepseek_v4.onnx_blocks import Blocks
    from engram_trt.models.deepseek_v4.model import model_tensor_shapes
    from engram_trt.models.deepseek_v4.weights import checkpoint_name, resolve_names
    from engram_trt.models.engram_llama.onnx_export import _Graph, plugin_attributes
    from engram_trt.models.onnx_quant import ExportTensors, ResolvedTensors, export_source

    opts = options or ExportOptions()
    src = export_source(weights)
    # canonical names -> the checkpoint's (DeepSeek's root spelling, scales under .scale)
    get = ExportTensors(ResolvedTensors(src, resolve_names(model_tensor_shapes(config), set(src)).stored))
    elem, np_dt, _ = DTYPES[opts.dtype]
    cfg = config
    max_pos = int(opts.max_position or cfg.max_position_embeddings)
    limits = engine_limits(cfg, max_pos)
    if limits:
        raise EngramError(limits[0])
    spec = cfg.engram
    table_dtype, table_rows = "bf16", []
    if spec is not None:
        if layout is None:
            raise EngramError(
                "exporting a DeepSeek-V4.1 model needs its EngramLayout (EngramLayout.from_spec with the "
                "compressed pad id)"
            )
        if tuple(layout.layer_ids) != tuple(spec.layer_ids):
            raise EngramError(f"layout layers {list(layout.layer_ids)} differ from the config's {list(spec.layer_ids)}")
        table_dtype = opts.table_dtype or spec.table_dtype
        if table_dtype not in TABLE_DTYPE_CODES:
            raise EngramError(f"Engram table dtype {table_dtype!r} is not one of {', '.join(TABLE_DTYPE_CODES)}")
        table_rows = [int(r) for r in (opts.table_rows or layout.table_rows)]
        if len(table_rows) != layout.num_layers or any(r < int(n) for r, n in zip(table_rows, layout.table_rows)):
            raise EngramError(
                f"table rows {table_rows} do not cover the layout's {layout.table_rows.tolist()} (one per Engram layer)"
            )
    g = _Graph()
    i32 = TensorProto.INT32
    inputs: list[Any] = [
        helper.make_tensor_value_info("input_ids", i32, ["tokens"]),
        helper.make_tensor_value_info("seq_starts", i32, ["seqs_plus_1"]),
        helper.make_tensor_value_info("past_lens", i32, ["seqs"]),
        helper.make_tensor_value_info("slots", i32, ["seqs"]),
    ]
    outputs: list[Any] = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["seqs", cfg.vocab_size])]

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
    last = g.op("Sub", [ends, g.const("c_i32_1", np.asarray(1, np.int32))], "last_token")
    b = Blocks(g, cfg, get, elem, np_dt, token_pos)

    # --- states ---------------------------------------------------------------------------
    states = state_shapes(cfg)
    for name, (shape, _kind) in states.items():
        inputs.append(helper.make_tensor_value_info(name, elem, shape))
        outputs.append(helper.make_tensor_value_info(alias_name(name), elem, shape))

    # --- V4.1's Engram inputs (engram-llama's) --------------------------------------------
    io: dict[str, Any] = {"placement": opts.placement if spec is not None else None}
    hash_out = live = None
    if spec is not None:
        N1, L, cols = layout.max_ngram_size - 1, layout.num_layers, layout.n_hash_cols
        inputs.append(helper.make_tensor_value_info("engram_ids", i32, ["tokens"]))
        live = g.op(
            "Cast",
            [g.op("GreaterOrEqual", ["engram_ids", g.const("c_i32_0", np.asarray(0, np.int32))])],
            "engram_live",
            to=i32,
        )
        if opts.placement == "in_engine":
            inputs.append(helper.make_tensor_value_info("engram_lookback", i32, ["seqs", N1]))
            inputs.append(helper.make_tensor_value_info("engram_table_ptrs", TensorProto.INT64, [L]))
            inputs.append(helper.make_tensor_value_info("engram_scale_ptrs", TensorProto.INT64, [L]))
            hash_out = g.op(
                "EngramHash",
                ["engram_ids", "seq_starts", "engram_lookback"],
                "engram_hash",
                domain=PLUGIN_DOMAIN,
                **plugin_attributes(layout, cfg, "EngramHash"),
            )  # [T, L, cols]
        else:
            for j in range(L):
                inputs.append(
                    helper.make_tensor_value_info(
                        f"engram_rows_{j}", TensorProto.BFLOAT16, ["tokens", cols, spec.head_dim]
                    )
                )
        io.update(
            lookback=N1,
            engram_layers=L,
            cols=cols,
            head_dim=spec.head_dim,
            table_dtype=table_dtype,
            table_rows=list(table_rows),
        )
    gate_dt = opts.gate_dtype or (opts.dtype if opts.dtype in GATE_IO_DTYPES else GATE_IO_DTYPES[0])

    def engram_rows(j: int) -> str:
        if opts.placement != "in_engine":
            return f"engram_rows_{j}"
        tptr = g.op("Slice", ["engram_table_ptrs", g.ints([j]), g.ints([j + 1])], f"table_ptr{j}")
        ptrs = [tptr]
        if table_dtype == "fp8":  # a bf16 table has no scales, and the plugin no scale input
            ptrs.append(g.op("Slice", ["engram_scale_ptrs", g.ints([j]), g.ints([j + 1])], f"scale_ptr{j}"))
        return g.op(
            "EngramGather",
            [hash_out, *ptrs],
            f"engram_rows{j}",
            domain=PLUGIN_DOMAIN,
            **plugin_attributes(layout, cfg, "EngramGather", j, table_dtype, table_rows[j]),
        )

    # --- RoPE: one table per label (main: sliding layers, compress: CSA / HCA) -------------
    tables: dict[str, Any] = {}
    angles: dict[str, tuple[str, str, str]] = {}
    for i in range(cfg.num_hidden_layers):
        lt = layer_type_of(cfg, i)
        label = "main" if lt == "sliding_attention" else "compress"
        if label not in tables:
            tables[label] = RopeTable(cfg, lt)
            c, s = b.rope_tables(label, tables[label], max_pos)
            angles[label] = b.token_angles(c, s, label)

    # --- the layers -----------------------------------------------------------------------
    hc = cfg.hc_mult
    embed_name = checkpoint_name("model.embed_tokens.weight")
    embed = b.weight("model.embed_tokens.weight", f32=False)
    x = g.op("Gather", [embed, "input_ids"], "embed", axis=0)
    streams = g.op("Expand", [g.op("Unsqueeze", [x, g.ints([1])]), g.ints([1, hc, 1])], "streams")  # [T, hc, D]
    engram_index = cfg.engram_layer_index
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        if i in engram_index:
            j = engram_index[i]
            streams = b.engram(streams, j, i, engram_rows(j), live, gate_dt, layout)
        pre, post, comb = b.hc_weights(streams, f"{p}.attn_hc.")
        h = b.rms_norm(b.collapse(streams, pre), f"{p}.input_layernorm", cfg.hidden_size)
        lt = layer_type_of(cfg, i)
        label = "main" if lt == "sliding_attention" else "compress"
        st = layer_states(cfg, i)
        y = b.attention(h, p, i, angles[label], tables[label], st, [alias_name(n) for n in st])
        streams = b.expand(streams, y, post, comb)
        pre, post, comb = b.hc_weights(streams, f"{p}.ffn_hc.")
        h = b.rms_norm(b.collapse(streams, pre), f"{p}.post_attention_layernorm", cfg.hidden_size)
        streams = b.expand(streams, b.moe(h, p, cfg.mlp_layer_types[i] == "hash_moe"), post, comb)

    # Only each sequence's last token goes on (the head and norm are per token).
    last_streams = g.op("Gather", [streams, last], "last_streams", axis=0)
    hidden = b.rms_norm(b.hyper_head(last_streams, "model.hc_head."), "model.norm", cfg.hidden_size)
    if cfg.tie_word_embeddings:
        logits = g.op("MatMul", [hidden, g.op("Transpose", [embed], "lm_head_t", perm=[1, 0])], "lm_head")
    else:
        logits = b.linear(hidden, "lm_head", "lm_head")
    g.op("Cast", [logits], outputs=["logits"], to=TensorProto.FLOAT)

    graph = helper.make_graph(g.nodes, "deepseek_v4", inputs, outputs, g.inits)
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(PLUGIN_DOMAIN, 1)],
        producer_name="engram-trt",
        doc_string="DeepSeek-V4 serving step; Engram tables are bound at run time by address",
    )
    model.ir_version = 10
    if g.init_bytes < EXTERNAL_DATA_THRESHOLD:
        onnx.checker.check_model(model)
    io.update(
        {
            "architecture": "deepseek-v4",
            "vocab": cfg.vocab_size,
            "layers": cfg.num_hidden_layers,
            "max_position": max_pos,
            "embed": embed_name,
            "plugins": sorted({n.op_type for n in g.nodes if n.domain == PLUGIN_DOMAIN}),
            "states": {
                name: {"shape": shape, "dtype": kind, "alias": alias_name(name)}
                for name, (shape, kind) in states.items()
            },
        }
    )
    return ExportedModel(
        model=model,
        input_names=[v.name for v in inputs],
        output_names=[v.name for v in outputs],
        num_layers=cfg.num_hidden_layers,
        engram_layers=0 if spec is None else len(spec.layer_ids),
        dtype=opts.dtype,
        initializer_bytes=g.init_bytes,
        io=io,
    )
