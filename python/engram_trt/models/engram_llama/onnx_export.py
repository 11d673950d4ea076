"""The whole engram-llama model as an ONNX graph: the portable artifact the builder parses.

Why ONNX: both TensorRT flavours parse it (the TensorRT-RTX Python network has no
``add_plugin_v3``, but its ONNX parser turns an unknown op whose ``op_type`` is a
plugin name into that plugin), and it can be *executed* on a CPU with
``onnx.reference.ReferenceEvaluator`` (reference_runner.py), so CI checks the exported
graph numerically against the PyTorch reference model: the engine is built from exactly
what was checked.

The graph is one serving step (docs/engram-spec.md; the serving-step contract of models/step.py): the tokens of S
sequences packed back to back, ``input_ids [T] int32``, with ``seq_starts [S+1]``
(cu_seqlens), ``past_lens [S]`` (tokens of each sequence already cached) and ``slots
[S]`` (each sequence's KV-cache slot), all int32. From them the graph derives, with
standard ops, ``token_seq [T]`` (a ReduceSum of ``seq_starts[1:] <= t``), ``token_pos =
past_lens[token_seq] + t - seq_starts[token_seq]`` and ``token_slot = slots[token_seq]``.
For ``hc_mult`` residual copies ``[T, hc, D]``:

* ``input_ids`` -> Gather(embed) -> ``hc`` copies;
* per layer: at an Engram layer ``EngramHash -> EngramGather -> wkv MatMul -> EngramGate``
  on the copies (the hash takes the real ``seq_starts`` and ``engram_lookback [S, N-1]``);
  then RMSNormalization of the copies' mean -> q/k/v -> RotaryEmbedding at ``token_pos``
  (each token its own batch row, ``[T, heads, 1, hd]``) -> one ``EngramAttention`` plugin
  node, which writes the step's K/V into ``key_cache_i / value_cache_i [num_slots,
  kv_heads, max_seq_len, head_dim]`` in place (its cache outputs ``key_cache_out_i /
  value_cache_out_i`` alias the inputs: no copy of the cache per step) and attends each
  token to its slot's keys ``0 .. token_pos`` (causal, GQA) -> o_proj added to every copy;
  the same for the SwiGLU MLP;
* the copies' mean at each sequence's last token (``seq_starts[1:] - 1``) -> final
  RMSNormalization -> lm_head -> ``logits [S, vocab] float32``.

RMSNormalization and RotaryEmbedding are opset-23 ops with native TensorRT layers. The
attention is a plugin because nothing standard expresses it: ONNX ``Attention`` has no
packed form and no in-place cache, and TensorRT-RTX 1.7's packed IAttention has no
kernel for the RTX targets (plugins/engramAttentionPlugin/README.md). The Engram inputs
are ``engram_ids [T] int32`` (compressed ids, -1 = dead token), ``engram_lookback`` and
the tables' addresses ``engram_table_ptrs`` / ``engram_scale_ptrs [L] int64``: the
tables themselves never enter the graph or the engine.

The export is a pure function of (config, weights, options): node names come from
counters, initializers from the weights in a fixed order, and no time or path is
recorded, so rebuilding gives identical bytes.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Sequence

import ml_dtypes
import numpy as np

from engram_trt.checkpoint.checkpoint import engram_tensor_names
from engram_trt.config.model import ModelConfig
from engram_trt.errors import EngramError
from engram_trt.engram.layout import EngramLayout
from engram_trt.models.export import (
    ATTENTION_PLUGIN,
    DTYPES,
    EXTERNAL_DATA_THRESHOLD,
    GATE_IO_DTYPES,
    GATHER_OUT_DTYPE,
    OPSET,
    PLUGIN_DOMAIN,
    PLUGIN_NAMESPACE,
    PLUGIN_VERSION,
    TABLE_DTYPE_CODES,
    ExportedModel,
    ExportOptions,
    encode_multipliers,
)

log = logging.getLogger(__name__)


def _np(t: Any, np_dtype: Any) -> np.ndarray:
    """A torch tensor or array as a contiguous NumPy array of ``np_dtype`` (bf16 via ml_dtypes)."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        torch = None  # type: ignore[assignment]
    if torch is not None and isinstance(t, torch.Tensor):
        t = t.detach().to("cpu")
        if t.dtype == torch.bfloat16:
            arr = t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        elif t.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu) or (
            t.dtype in (torch.int8, torch.uint8) and not np.issubdtype(np.dtype(np_dtype), np.integer)
        ):
            # a stored FP8 / FP4 weight goes through models/onnx_quant.py, never into a float initializer
            raise EngramError(
                f"internal: a {t.dtype} tensor reached a float initializer (stored-format weights are "
                f"exported by models/onnx_quant.py)"
            )
        else:
            arr = t.numpy()
    else:
        arr = np.asarray(t)
    if arr.dtype != np_dtype:
        arr = arr.astype(np.float32).astype(np_dtype) if arr.dtype == ml_dtypes.bfloat16 else arr.astype(np_dtype)
    return np.ascontiguousarray(arr)


class _Graph:
    """Node/initializer accumulator with deterministic names."""

    def __init__(self) -> None:
        from onnx import helper

        self.h = helper
        self.nodes: list[Any] = []
        self.inits: list[Any] = []
        self._init_names: set[str] = set()
        self._count = 0
        self.init_bytes = 0

    def name(self, hint: str) -> str:
        self._count += 1
        return f"{hint}_{self._count}"

    def const(self, name: str, arr: np.ndarray) -> str:
        from onnx import numpy_helper

        if name in self._init_names:
            return name
        self._init_names.add(name)
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(arr), name))
        self.init_bytes += int(arr.nbytes)
        return name

    def ints(self, values: Sequence[int]) -> str:
        """An int64 1-D constant, shared by value."""
        key = "c_i64_" + "_".join(str(int(v)).replace("-", "m") for v in values)
        return self.const(key, np.asarray(values, dtype=np.int64))

    def scalar(self, value: int) -> str:
        return self.const(f"c_s64_{str(int(value)).replace('-', 'm')}", np.asarray(value, dtype=np.int64))

    def op(
        self,
        op_type: str,
        inputs: Sequence[str],
        hint: str | None = None,
        n_out: int = 1,
        outputs: Sequence[str] | None = None,
        domain: str = "",
        **attrs: Any,
    ) -> Any:
        outs = list(outputs) if outputs is not None else [self.name(hint or op_type.lower()) for _ in range(n_out)]
        node_name = self.name("n_" + (hint or op_type))
        self.nodes.append(self.h.make_node(op_type, list(inputs), outs, name=node_name, domain=domain or None, **attrs))
        return outs[0] if len(outs) == 1 else outs


def plugin_attributes(
    layout: EngramLayout | None,
    config: ModelConfig,
    op: str,
    layer_index: int = 0,
    table_dtype: str = "fp8",
    num_rows: int = 0,
) -> dict[str, Any]:
    """The fields of each Engram plugin, as node attributes (the ONNX parser hands node
    attributes to the plugin creator as fields, converted to the types it declares).
    Names and meanings are the creators' field lists (plugins/engram*Plugin); the
    creators refuse unknown or missing fields, so a drift fails the build loudly."""
    if op == ATTENTION_PLUGIN:  # the one plugin every model has: no layout needed
        return {
            "plugin_version": PLUGIN_VERSION,
            "plugin_namespace": PLUGIN_NAMESPACE,
            "num_heads": int(config.num_attention_heads),
            "num_kv_heads": int(config.num_key_value_heads),
            "head_dim": int(config.head_dim),
            "scale": float(config.head_dim) ** -0.5,
        }
    spec = config.engram
    assert spec is not None and spec.head_dim is not None and layout is not None
    base: dict[str, Any] = {"plugin_version": PLUGIN_VERSION, "plugin_namespace": PLUGIN_NAMESPACE}
    if op == "EngramHash":
        base.update(
            n_layers=layout.num_layers,
            max_ngram_size=layout.max_ngram_size,
            n_heads=layout.n_heads,
            pad_id=int(layout.pad_id),
            compressed_vocab_size=int(layout.compressed_vocab_size),
            primes=[int(v) for v in layout.primes.reshape(-1)],
            offsets=[int(v) for v in layout.offsets.reshape(-1)],
        )
        base.update(encode_multipliers(layout.multipliers))
    elif op == "EngramGather":
        base.update(
            layer_index=int(layer_index),
            n_layers=layout.num_layers,
            n_cols=layout.n_hash_cols,
            head_dim=int(spec.head_dim),
            table_dtype=TABLE_DTYPE_CODES[table_dtype],
            quant_block=int(spec.quant_block),
            num_rows=int(num_rows),
            bad_rows_input=0,  # no bad-row counter input (the plugin's optional last input)
            # The whole table: every column, rows from 0 (a tensor-parallel rank's share would
            # differ). The plugin defaults these, but TensorRT's ONNX parser warns for every
            # field of the creator that a node leaves out, three lines per Engram layer.
            column_begin=0,
            column_end=layout.n_hash_cols,
            row_offset=0,
        )
    elif op == "EngramGate":
        base.update(hc_mult=int(config.hc_mult), hidden_size=int(config.hidden_size), eps=float(config.rms_norm_eps))
    else:
        raise EngramError(f"internal: unknown Engram plugin {op!r}")
    return base


def rotary_tables(config: ModelConfig, max_position: int) -> tuple[np.ndarray, np.ndarray]:
    """``cos, sin [max_position, head_dim/2]`` float32, computed exactly as the
    reference model does (torch float32: positions * inv_freq, cos and sin times the RoPE
    type's attention factor)."""
    import torch

    from engram_trt.models.rope import inv_freq_and_scale

    inv_freq, scale = inv_freq_and_scale(config.rope, config.head_dim)
    pos = torch.arange(max_position, dtype=torch.float32)
    freqs = pos[:, None] * inv_freq[None, :]
    return (freqs.cos() * scale).numpy(), (freqs.sin() * scale).numpy()


def export_model(
    config: ModelConfig,
    weights: Mapping[str, Any] | Callable[[str], Any],
    layout: EngramLayout | None = None,
    options: ExportOptions | None = None,
) -> ExportedModel:
    """Build the ONNX serving graph of an engram-llama model (the module docstring).

    ``weights`` maps checkpoint names to tensors (or is a ``name -> tensor`` callable,
    e.g. ``Checkpoint.get``); only backbone and Engram projection weights are read,
    never a table. ``layout`` is required for a model with Engram layers (its pad id is
    the *compressed* pad id).
    """
    import onnx
    from onnx import TensorProto, helper

    from engram_trt.models.onnx_quant import ExportTensors, fp8_weight, quant_matmul

    opts = options or ExportOptions()
    get = ExportTensors(weights)
    elem, np_dt, _ = DTYPES[opts.dtype]
    quant = config.quant
    spec = config.engram
    table_dtype = "fp8"
    table_rows: list[int] = []
    if spec is not None:
        spec = config.require_model()
        assert spec is not None
        table_dtype = opts.table_dtype or spec.table_dtype
        if table_dtype not in TABLE_DTYPE_CODES:
            raise EngramError(f"table dtype {table_dtype!r} is not one of {', '.join(TABLE_DTYPE_CODES)}")
        if layout is None:
            raise EngramError(
                "exporting a model with Engram layers needs its layout "
                "(EngramLayout.from_spec with the compressed pad id)"
            )
        if tuple(layout.layer_ids) != tuple(spec.layer_ids):
            raise EngramError(f"layout layers {list(layout.layer_ids)} differ from the config's {list(spec.layer_ids)}")
        table_rows = [int(r) for r in (opts.table_rows or layout.table_rows)]
        if len(table_rows) != layout.num_layers or any(r < int(n) for r, n in zip(table_rows, layout.table_rows)):
            raise EngramError(
                f"table rows {table_rows} do not cover the layout's {layout.table_rows.tolist()} (one per Engram layer)"
            )
    hc = config.hc_mult
    qh, kvh, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    max_pos = int(opts.max_position or config.max_position_embeddings)
    g = _Graph()
    cache_dims = ["num_slots", kvh, "max_seq_len", hd]

    inputs: list[Any] = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT32, ["tokens"]),
        helper.make_tensor_value_info("seq_starts", TensorProto.INT32, ["seqs_plus_1"]),
        helper.make_tensor_value_info("past_lens", TensorProto.INT32, ["seqs"]),
        helper.make_tensor_value_info("slots", TensorProto.INT32, ["seqs"]),
    ]
    outputs: list[Any] = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["seqs", config.vocab_size])]

    # --- where each token sits: its sequence, position and KV slot ------------------------
    i32 = TensorProto.INT32
    T = g.op("Squeeze", [g.op("Shape", ["input_ids"], "tokens")], "tokens_s")  # scalar int64
    tok = g.op("Cast", [g.op("Range", [g.scalar(0), T, g.scalar(1)], "token_index64")], "token_index", to=i32)  # [T]
    ends = g.op("Slice", ["seq_starts", g.ints([1]), g.ints([2**62])], "seq_ends")  # [S]: seq_starts[1:]
    after = g.op(
        "LessOrEqual",
        [g.op("Unsqueeze", [ends, g.ints([0])]), g.op("Unsqueeze", [tok, g.ints([1])])],
        "token_after_seq",
    )  # [T, S]: token t lies past the end of sequence s
    token_seq = g.op("ReduceSum", [g.op("Cast", [after], to=i32), g.ints([1])], "token_seq", keepdims=0)  # [T]
    token_pos = g.op(
        "Add",
        [
            g.op("Gather", ["past_lens", token_seq], axis=0),
            g.op("Sub", [tok, g.op("Gather", ["seq_starts", token_seq], axis=0)]),
        ],
        "token_pos",
    )
    token_slot = g.op("Gather", ["slots", token_seq], "token_slot", axis=0)  # [T]
    position_ids = g.op(
        "Unsqueeze", [g.op("Cast", [token_pos], to=TensorProto.INT64), g.ints([1])], "position_ids"
    )  # [T, 1]: each token a batch row of one position
    last = g.op("Sub", [ends, g.const("c_i32_1", np.asarray(1, np.int32))], "last_token")  # [S]

    cos, sin = rotary_tables(config, max_pos)
    cos_n = g.const("rope_cos", cos.astype(np_dt))
    sin_n = g.const("rope_sin", sin.astype(np_dt))

    def w(name: str, transpose: bool = False, dtype: Any = np_dt) -> str:
        arr = _np(get(name), dtype)
        if transpose:
            arr = np.ascontiguousarray(arr.T)
        return g.const(name + (".T" if transpose else ""), arr)

    def linear(x: str, name: str, hint: str) -> str:
        qw = fp8_weight(get.src, name, quant)  # a stored FP8 weight: DequantizeLinear of its bytes
        if qw is not None:
            return quant_matmul(g, x, name, qw, elem, hint)
        return g.op("MatMul", [x, w(name, transpose=True)], hint)

    def mean_copies(h: str) -> str:
        if hc == 1:
            return g.op("Squeeze", [h, g.ints([1])], "copy")
        return g.op("ReduceMean", [h, g.ints([1])], "copies_mean", keepdims=0)

    def rmsnorm(x: str, name: str) -> str:
        # stash_type 1: float32 statistics whatever the compute dtype, as the reference.
        return g.op(
            "RMSNormalization", [x, w(name)], "rmsnorm", axis=-1, epsilon=float(config.rms_norm_eps), stash_type=1
        )

    def add_to_copies(h: str, x: str) -> str:
        return g.op("Add", [h, g.op("Unsqueeze", [x, g.ints([1])])], "residual")

    # --- embeddings and copies -----------------------------------------------------------
    embed = w("model.embed_tokens.weight")
    x = g.op("Gather", [embed, "input_ids"], "embed", axis=0)  # [T, D]
    hs = g.op("Expand", [g.op("Unsqueeze", [x, g.ints([1])]), g.ints([1, hc, 1])], "copies")  # [T, hc, D]

    # --- Engram inputs and hash ---------------------------------------------------------
    engram_index = config.engram_layer_index
    hash_out = live = None
    rows_inputs: list[str] = []
    io: dict[str, Any] = {"placement": opts.placement if spec is not None else None}
    if spec is not None:
        assert layout is not None and spec.head_dim is not None
        N1, L, cols = layout.max_ngram_size - 1, layout.num_layers, layout.n_hash_cols
        inputs.append(helper.make_tensor_value_info("engram_ids", TensorProto.INT32, ["tokens"]))
        live = g.op(
            "Cast",
            [g.op("GreaterOrEqual", ["engram_ids", g.const("c_i32_0", np.asarray(0, np.int32))])],
            "engram_live",
            to=i32,
        )  # [T] 1 = live, 0 = dead
        if opts.placement == "in_engine":
            inputs.append(helper.make_tensor_value_info("engram_lookback", TensorProto.INT32, ["seqs", N1]))
            inputs.append(helper.make_tensor_value_info("engram_table_ptrs", TensorProto.INT64, [L]))
            inputs.append(helper.make_tensor_value_info("engram_scale_ptrs", TensorProto.INT64, [L]))
            hash_out = g.op(
                "EngramHash",
                ["engram_ids", "seq_starts", "engram_lookback"],
                "engram_hash",
                domain=PLUGIN_DOMAIN,
                **plugin_attributes(layout, config, "EngramHash"),
            )  # [T, L, cols] int32
        else:
            for j in range(L):
                name = f"engram_rows_{j}"
                inputs.append(
                    helper.make_tensor_value_info(name, TensorProto.BFLOAT16, ["tokens", cols, spec.head_dim])
                )
                rows_inputs.append(name)
        io.update(
            lookback=N1,
            engram_layers=L,
            cols=cols,
            head_dim=spec.head_dim,
            table_dtype=table_dtype,
            table_rows=list(table_rows),
        )

    if opts.gate_dtype is not None:
        gate_dt = opts.gate_dtype
    else:
        gate_dt = opts.dtype if opts.dtype in GATE_IO_DTYPES else GATE_IO_DTYPES[0]

    def engram_block(h: str, j: int, layer_id: int) -> str:
        assert spec is not None and layout is not None and spec.head_dim is not None
        names = engram_tensor_names(layer_id, spec.prefix)
        cols = layout.n_hash_cols
        if opts.placement == "in_engine":
            assert hash_out is not None
            tptr = g.op("Slice", ["engram_table_ptrs", g.ints([j]), g.ints([j + 1])], f"table_ptr{j}")
            ptrs = [tptr]
            if table_dtype == "fp8":  # a bf16 table has no scales, and the plugin no scale input
                ptrs.append(g.op("Slice", ["engram_scale_ptrs", g.ints([j]), g.ints([j + 1])], f"scale_ptr{j}"))
            rows = g.op(
                "EngramGather",
                [hash_out, *ptrs],
                f"engram_rows{j}",
                domain=PLUGIN_DOMAIN,
                **plugin_attributes(layout, config, "EngramGather", j, table_dtype, table_rows[j]),
            )  # [T, cols, head_dim] bf16
        else:
            rows = rows_inputs[j]
        e = g.op("Reshape", [rows, g.ints([0, cols * spec.head_dim])], f"engram_e{j}")  # [T, cols * head_dim]
        if opts.dtype != GATHER_OUT_DTYPE:
            e = g.op("Cast", [e], f"engram_e{j}_cast", to=elem)
        kv = linear(e, names["wkv"], f"engram_kv{j}")  # [T, (hc+1) D]
        hid = h  # [T, hc, D]: the gate's layout already
        gate_elem = DTYPES[gate_dt][0]
        if gate_dt != opts.dtype:
            hid = g.op("Cast", [hid], to=gate_elem)
            kv = g.op("Cast", [kv], to=gate_elem)
        # q/k weights: bf16 for a bf16 model, else float32 (the gate takes either with any I/O type).
        wt_np = np_dt if opts.dtype == "bf16" else np.float32
        qw, kw = w(names["q_weight"], dtype=wt_np), w(names["k_weight"], dtype=wt_np)
        out = g.op(
            "EngramGate",
            [hid, kv, qw, kw, live],
            f"engram_gate{j}",
            domain=PLUGIN_DOMAIN,
            **plugin_attributes(layout, config, "EngramGate"),
        )  # [T, hc, D]
        if gate_dt != opts.dtype:
            out = g.op("Cast", [out], to=elem)
        return out

    # --- decoder layers -------------------------------------------------------------------
    aliases: dict[str, str] = {}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        for kind in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"{kind}_cache_{i}", elem, cache_dims))
            outputs.append(helper.make_tensor_value_info(f"{kind}_cache_out_{i}", elem, cache_dims))
            aliases[f"{kind}_cache_out_{i}"] = f"{kind}_cache_{i}"
        j = engram_index.get(i)
        if j is not None:
            hs = engram_block(hs, j, i)
        xn = rmsnorm(mean_copies(hs), f"{p}.input_layernorm.weight")

        def heads(name: str, n: int, hint: str, rope: bool) -> str:
            y = linear(xn, name, hint)
            if not rope:
                return g.op("Reshape", [y, g.ints([0, n, hd])], hint + "_thd")  # [T, n, hd]
            y = g.op("Reshape", [y, g.ints([0, n, 1, hd])], hint + "_t1")  # [T, n, 1, hd]: batch = token
            y = g.op("RotaryEmbedding", [y, cos_n, sin_n, position_ids], hint + "_rope", interleaved=0)
            return g.op("Reshape", [y, g.ints([0, n, hd])], hint + "_thd")

        q = heads(f"{p}.self_attn.q_proj.weight", qh, f"q{i}", True)
        k = heads(f"{p}.self_attn.k_proj.weight", kvh, f"k{i}", True)
        v = heads(f"{p}.self_attn.v_proj.weight", kvh, f"v{i}", False)
        att = g.op(
            "EngramAttention",
            [q, k, v, f"key_cache_{i}", f"value_cache_{i}", token_slot, token_pos],
            outputs=[g.name(f"attn{i}"), f"key_cache_out_{i}", f"value_cache_out_{i}"],
            domain=PLUGIN_DOMAIN,
            hint=f"attn{i}",
            **plugin_attributes(layout, config, ATTENTION_PLUGIN),
        )[0]  # [T, qh, hd]
        att = g.op("Reshape", [att, g.ints([0, qh * hd])], f"attn{i}_flat")
        hs = add_to_copies(hs, linear(att, f"{p}.self_attn.o_proj.weight", f"o{i}"))
        xn2 = rmsnorm(mean_copies(hs), f"{p}.post_attention_layernorm.weight")
        gate = linear(xn2, f"{p}.mlp.gate_proj.weight", f"gate{i}")
        up = linear(xn2, f"{p}.mlp.up_proj.weight", f"up{i}")
        act = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])], f"silu{i}"), up], f"swiglu{i}")
        hs = add_to_copies(hs, linear(act, f"{p}.mlp.down_proj.weight", f"down{i}"))

    # Only each sequence's last token goes on (norm and head are per token).
    final = rmsnorm(g.op("Gather", [mean_copies(hs), last], "last_hidden", axis=0), "model.norm.weight")  # [S, D]
    if config.tie_word_embeddings:
        logits = g.op("MatMul", [final, g.op("Transpose", [embed], "lm_head_t", perm=[1, 0])], "lm_head")
    else:
        logits = linear(final, "lm_head.weight", "lm_head")
    g.op("Cast", [logits], outputs=["logits"], to=TensorProto.FLOAT)

    graph = helper.make_graph(g.nodes, "engram_llama", inputs, outputs, g.inits)
    opsets = [helper.make_opsetid("", OPSET), helper.make_opsetid(PLUGIN_DOMAIN, 1)]
    model = helper.make_model(
        graph,
        opset_imports=opsets,
        producer_name="engram-trt",
        doc_string="engram-llama serving step; Engram tables are bound at run time by address",
    )
    model.ir_version = 10
    onnx.checker.check_model(model) if g.init_bytes < EXTERNAL_DATA_THRESHOLD else None
    io.update(
        vocab=config.vocab_size,
        kv_heads=kvh,
        head_dim_attn=hd,
        layers=config.num_hidden_layers,
        max_position=max_pos,
        plugins=sorted({n.op_type for n in g.nodes if n.domain == PLUGIN_DOMAIN}),
        kv_cache={"shape": ["num_slots", kvh, "max_seq_len", hd], "aliases": aliases},
    )
    return ExportedModel(
        model=model,
        input_names=[i.name for i in inputs],
        output_names=[o.name for o in outputs],
        num_layers=config.num_hidden_layers,
        engram_layers=0 if spec is None else len(spec.layer_ids),
        dtype=opts.dtype,
        initializer_bytes=g.init_bytes,
        io=io,
    )


def _get_from(weights: Mapping[str, Any], name: str) -> Any:
    try:
        return weights[name]
    except KeyError:
        raise EngramError(f"weights lack tensor '{name}' (the checkpoint does not match its config.json)") from None


def export_weight_names(config: ModelConfig) -> list[str]:
    """The tensors the exported graph reads (backbone + Engram projections, no tables)."""
    from engram_trt.models.engram_llama.model import model_weight_shapes

    return list(model_weight_shapes(config))
