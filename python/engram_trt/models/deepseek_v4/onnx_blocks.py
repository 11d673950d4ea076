"""The blocks of DeepSeek-V4's ONNX serving step (:mod:`.onnx_export` wires them): the
two RMSNorms, the interleaved partial RoPE on the trailing channels, the mHC
hyper-connections (Sinkhorn-Knopp unrolled), the attention around its
EngramDsv4Attention node (low-rank queries, the shared K=V head, the compressors' raw
projections, the indexer's queries, the inverse rotation and the grouped output
projection), the MoE (hash or top-k routing; stored FP4 / FP8 experts in one
EngramRoutedExperts node, float ones computed densely) and V4.1's Engram update
(EngramHash -> EngramGather -> wkv -> EngramGate). Weights stored FP8 enter as
DequantizeLinear of their bytes (models/onnx_quant.py).

Each block emits the op sequence of its PyTorch module (:mod:`.modules`,
:mod:`.attention`, :mod:`.compressors`) with the same roundings: weights in the graph's
dtype except the ones the torch model keeps in float32 (``model.KEEP_FLOAT32``), norms,
RoPE rotations and the hyper-connections' weights in float32 with one rounding back, so
a float32 graph equals the torch model to round-off and a bf16 graph rounds where it
rounds. Names are the checkpoint's (:func:`.weights.checkpoint_name` of the module names).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from onnx import TensorProto

from engram_trt.models.export import PLUGIN_DOMAIN
from engram_trt.models.onnx_blocks import GraphBlocks, plugin_fields

ATTENTION_OP = "EngramDsv4Attention"
LAYER_TYPE_CODES = {"sliding_attention": 0, "compressed_sparse_attention": 1, "heavily_compressed_attention": 2}


@dataclass
class Blocks(GraphBlocks):
    """The graph under construction plus what every block reads: ``g`` (the node
    accumulator of :mod:`engram_trt.models.engram_llama.onnx_export`), ``get``
    (checkpoint name -> tensor), the graph's ONNX element type / NumPy dtype and the
    step's ``token_pos [T]`` (int32)."""

    token_pos: str

    # -- constants and casts ---------------------------------------------------------
    def _np(self, module_name: str, dtype: Any) -> np.ndarray:
        from engram_trt.models.deepseek_v4.weights import checkpoint_name
        from engram_trt.models.engram_llama.onnx_export import _np

        return _np(self.get(checkpoint_name(module_name)), dtype)

    def kept_f32(self, module_name: str) -> bool:
        from engram_trt.models.deepseek_v4.model import KEEP_FLOAT32
        from engram_trt.models.deepseek_v4.weights import checkpoint_name

        return bool(KEEP_FLOAT32.search(checkpoint_name(module_name)))

    def host(self, module_name: str) -> np.ndarray:
        """A parameter as the torch model holds it (float32 where kept so, else rounded
        to the graph's dtype), as float32 on the host."""
        dt = np.float32 if self.kept_f32(module_name) else self.np_dt
        return self._np(module_name, dt).astype(np.float32)

    def weight(self, module_name: str, *, transpose: bool = False, f32: bool | None = None) -> str:
        """A parameter as an initializer in the graph's dtype, or float32 where the torch
        model keeps it so (or as ``f32`` says)."""
        from engram_trt.models.deepseek_v4.weights import checkpoint_name

        wide = self.kept_f32(module_name) if f32 is None else f32
        arr = self._np(module_name, np.float32 if wide else self.np_dt)
        if transpose:
            arr = np.ascontiguousarray(arr.T)
        return self.g.const(checkpoint_name(module_name) + (".T" if transpose else "") + (".f32" if wide else ""), arr)

    def linear(self, x: str, module: str, hint: str) -> str:
        """``x @ W^T`` in the graph's dtype (the torch model's ``nn.Linear``); a weight stored
        FP8 through DequantizeLinear of its bytes (models/onnx_quant.py)."""
        from engram_trt.models.deepseek_v4.weights import checkpoint_name

        y = self.fp8_linear(x, checkpoint_name(f"{module}.weight"), hint)
        if y is not None:
            return y
        return self.g.op("MatMul", [x, self.weight(f"{module}.weight", transpose=True, f32=False)], hint)

    def stored_expert(self, module_name: str) -> Any:
        """A routed expert's weight as stored: FP4 (``expert_dtype`` fp4: packed bytes and
        ue8m0 scales) or FP8, as a QuantWeight; None for a float weight."""
        from engram_trt.models.deepseek_v4.weights import checkpoint_name
        from engram_trt.models.onnx_quant import fp4_weight

        name = checkpoint_name(module_name)
        quant = self.config.quant
        if quant is not None and quant.expert_dtype == "fp4":
            qw = fp4_weight(self.source(), name)
            if qw is not None:
                return qw
        return self.stored_fp8(name)

    # -- norms and RoPE ----------------------------------------------------------------
    def rms_norm(self, x: str, module: str, size: int) -> str:
        """:class:`~.modules.RMSNorm`: float32 statistics times the (float32) weight,
        rounded once to the graph's dtype."""
        w = self.g.const(f"{module}.weight.host", np.ascontiguousarray(self.host(f"{module}.weight")))
        return self.act(self.g.op("Mul", [w, self.rms(self.f32(x), size)], "rms_norm"))

    def unweighted_rms_norm(self, x: str) -> str:
        """:func:`~.compressors.unweighted_rms_norm`: the reciprocal RMS in float32,
        rounded to the graph's dtype, times ``x``."""
        g = self.g
        ms = g.op("ReduceMean", [g.op("Mul", [self.f32(x), self.f32(x)]), g.ints([-1])], "ms", keepdims=1)
        inv = g.op("Reciprocal", [g.op("Sqrt", [g.op("Add", [ms, self.f32_scalar(float(self.config.rms_norm_eps))])])])
        return g.op("Mul", [x, self.act(inv)], "unweighted_rms")

    def rope_tables(self, label: str, table: Any, max_position: int) -> tuple[str, str]:
        """``cos, sin [max_position, rope_dim / 2]`` of a :class:`~.compressors.RopeTable`
        (float32 angles times its attention scaling, as it computes them), rounded to
        the graph's dtype (``apply_rope`` rounds them) and held as float32."""
        import torch

        cos, sin = table(torch.arange(max_position))
        c = cos.numpy().astype(self.np_dt).astype(np.float32)
        s = sin.numpy().astype(self.np_dt).astype(np.float32)
        return self.g.const(f"rope_{label}_cos", c), self.g.const(f"rope_{label}_sin", s)

    def token_angles(self, cos_table: str, sin_table: str, label: str) -> tuple[str, str, str]:
        """Each token's ``(cos, sin, -sin) [T, rope_dim / 2]`` (float32), gathered at its position."""
        g = self.g
        c = g.op("Gather", [cos_table, self.token_pos], f"cos_{label}", axis=0)
        s = g.op("Gather", [sin_table, self.token_pos], f"sin_{label}", axis=0)
        return c, s, g.op("Neg", [s], f"nsin_{label}")

    def rope(self, x: str, width: int, rope_dim: int, cos: str, sin: str) -> str:
        """:func:`~.compressors.apply_rope`: the trailing ``rope_dim`` channels of ``x
        [T, width]`` or ``[T, heads, width]`` rotated in interleaved pairs ``(2i, 2i+1)``
        in float32 (cos / sin ``[T, rope_dim / 2]``), rounded back; the leading channels
        pass. Pass ``-sin`` for the inverse rotation."""
        g = self.g
        half = rope_dim // 2
        rank3 = self._rank3.get(x, False)
        if rope_dim < width:
            keep, rot = g.op("Split", [x, g.ints([width - rope_dim, rope_dim])], "rope_split", n_out=2, axis=-1)
        else:
            keep, rot = None, x
        shape = [0, 0, half, 2] if rank3 else [0, half, 2]
        pairs = g.op("Reshape", [self.f32(rot), g.ints(shape)], "rope_pairs")
        even, odd = g.op("Split", [pairs, g.ints([1, 1])], "rope_eo", n_out=2, axis=-1)
        even = g.op("Squeeze", [even, g.ints([-1])], "rope_even")
        odd = g.op("Squeeze", [odd, g.ints([-1])], "rope_odd")
        if rank3:
            cos = g.op("Unsqueeze", [cos, g.ints([1])], "rope_cos3")
            sin = g.op("Unsqueeze", [sin, g.ints([1])], "rope_sin3")
        new_even = g.op("Sub", [g.op("Mul", [even, cos]), g.op("Mul", [odd, sin])], "rope_e")
        new_odd = g.op("Add", [g.op("Mul", [odd, cos]), g.op("Mul", [even, sin])], "rope_o")
        both = g.op(
            "Concat",
            [g.op("Unsqueeze", [new_even, g.ints([-1])]), g.op("Unsqueeze", [new_odd, g.ints([-1])])],
            "rope_pairs_out",
            axis=-1,
        )
        rotated = self.act(g.op("Reshape", [both, g.ints([0, 0, rope_dim] if rank3 else [0, rope_dim])], "rope_rot"))
        out = rotated if keep is None else g.op("Concat", [keep, rotated], "rope_out", axis=-1)
        self._rank3[out] = rank3
        return out

    def heads(self, x: str, n: int, d: int, hint: str) -> str:
        """``x [T, n * d]`` as ``[T, n, d]`` (marked 3-D for :meth:`rope`)."""
        y = self.g.op("Reshape", [x, self.g.ints([0, n, d])], hint)
        self._rank3[y] = True
        return y

    def __post_init__(self) -> None:
        self._rank3: dict[str, bool] = {}

    # -- mHC hyper-connections ------------------------------------------------------------
    def hc_weights(self, streams: str, prefix: str) -> tuple[str, str, str]:
        """:meth:`~.modules.HyperConnection.weights` of ``streams [N, hc, D]`` in float32:
        ``(pre [N, hc], post [N, hc], comb [N, hc, hc])``, ``comb`` through
        ``hc_sinkhorn_iters`` unrolled Sinkhorn-Knopp normalizations (columns first)."""
        g, cfg = self.g, self.config
        hc, D = cfg.hc_mult, cfg.hidden_size
        eps = self.f32_scalar(float(cfg.hc_eps))
        flat = self.rms(self.f32(g.op("Reshape", [streams, g.ints([0, hc * D])], "hc_flat")), hc * D)
        fn = g.const(f"{prefix}fn.T", np.ascontiguousarray(self.host(f"{prefix}fn").T))
        mixes = g.op("MatMul", [flat, fn], "hc_mixes")
        pre_w, post_w, comb_w = g.op("Split", [mixes, g.ints([hc, hc, hc * hc])], "hc_split", n_out=3, axis=-1)
        base = self.host(f"{prefix}base")
        s = self.host(f"{prefix}scale")
        pre_b = g.const(f"{prefix}base.pre", np.ascontiguousarray(base[:hc]))
        post_b = g.const(f"{prefix}base.post", np.ascontiguousarray(base[hc : 2 * hc]))
        comb_b = g.const(f"{prefix}base.comb", np.ascontiguousarray(base[2 * hc :].reshape(hc, hc)))
        s0, s1, s2 = (g.const(f"{prefix}scale.{k}", np.asarray(s[k], np.float32)) for k in range(3))
        pre = g.op("Add", [g.op("Sigmoid", [g.op("Add", [g.op("Mul", [pre_w, s0]), pre_b])]), eps], "hc_pre")
        post = g.op(
            "Mul",
            [self.f32_scalar(2.0), g.op("Sigmoid", [g.op("Add", [g.op("Mul", [post_w, s1]), post_b])])],
            "hc_post",
        )
        comb = g.op(
            "Add", [g.op("Mul", [g.op("Reshape", [comb_w, g.ints([0, hc, hc])]), s2]), comb_b], "hc_comb_logits"
        )
        comb = g.op("Add", [g.op("Softmax", [comb], axis=-1), eps], "hc_comb")
        comb = self._normalize(comb, -2, eps)
        for _ in range(int(cfg.hc_sinkhorn_iters) - 1):
            comb = self._normalize(self._normalize(comb, -1, eps), -2, eps)
        return pre, post, comb

    def _normalize(self, comb: str, axis: int, eps: str) -> str:
        g = self.g
        total = g.op("ReduceSum", [comb, g.ints([axis])], "sinkhorn_sum", keepdims=1)
        return g.op("Div", [comb, g.op("Add", [total, eps])], "sinkhorn")

    def collapse(self, streams: str, pre: str) -> str:
        """``sum_i pre_i * stream_i`` in float32, rounded to the graph's dtype: ``[N, D]``."""
        g = self.g
        weighted = g.op("Mul", [g.op("Unsqueeze", [pre, g.ints([-1])]), self.f32(streams)], "hc_weighted")
        return self.act(g.op("ReduceSum", [weighted, g.ints([1])], "hc_collapse", keepdims=0))

    def expand(self, streams: str, out: str, post: str, comb: str) -> str:
        """:meth:`~.modules.HyperConnection.expand`: ``post * out + comb^T @ streams`` in
        the graph's dtype."""
        g = self.g
        spread = g.op(
            "Mul",
            [g.op("Unsqueeze", [self.act(post), g.ints([-1])]), g.op("Unsqueeze", [out, g.ints([1])])],
            "hc_spread",
        )
        mixed = g.op("MatMul", [g.op("Transpose", [self.act(comb)], perm=[0, 2, 1]), streams], "hc_mix")
        return g.op("Add", [spread, mixed], "streams")

    def hyper_head(self, streams: str, prefix: str) -> str:
        """:class:`~.modules.HyperHead`: a ``pre``-only collapse of the streams."""
        g, cfg = self.g, self.config
        hc, D = cfg.hc_mult, cfg.hidden_size
        flat = self.rms(self.f32(g.op("Reshape", [streams, g.ints([0, hc * D])], "head_flat")), hc * D)
        fn = g.const(f"{prefix}hc_fn.T", np.ascontiguousarray(self.host(f"{prefix}hc_fn").T))
        scale = g.const(f"{prefix}hc_scale.host", self.host(f"{prefix}hc_scale"))
        base = g.const(f"{prefix}hc_base.host", self.host(f"{prefix}hc_base"))
        mixes = g.op("Add", [g.op("Mul", [g.op("MatMul", [flat, fn]), scale]), base], "head_mixes")
        pre = g.op("Add", [g.op("Sigmoid", [mixes]), self.f32_scalar(float(cfg.hc_eps))], "head_pre")
        return self.collapse(streams, pre)

    # -- MoE ------------------------------------------------------------------------------
    def moe(self, x: str, p: str, hash_routed: bool) -> str:
        """:class:`~.modules.SparseMoE` on ``x [T, D]``: the router's scores
        (``sqrtsoftplus`` / ``sigmoid`` of ``x @ gate^T``, the graph's dtype), the experts
        picked by TopK of ``score + e_score_correction_bias`` (float32) or, hash-routed,
        by the frozen ``tid2eid`` table (a Gather of the step's raw ids), their scores
        renormalized and scaled by ``routed_scaling_factor``; then the routed experts and
        the shared expert, every SwiGLU with its gate clamped from above and its up
        clamped both ways at ``swiglu_limit``.

        Routed experts stored FP4 (DeepSeek-V4.1-Flash's recipe) or FP8 run in one
        EngramRoutedExperts node (models/onnx_quant.py): the picked experts' stored bytes
        only. Float experts (and FP8 ones the plugin cannot take) take the dense form:
        the weights summed into a ``[T, E]`` routing matrix (one-hot per pick, so an
        expert picked twice by a hash row counts twice, as the torch loop's index_add
        does) and EVERY routed expert on every token (one stacked gate/up GEMM ``[D,
        E*I]`` and one down GEMM ``[E*I, D]``, each expert's activations scaled by its
        routing weight, 0 where not picked; FP8 stacks dequantized in the graph):
        ``E / top_k`` times the picked experts' arithmetic and all experts' weights read
        every step, the price of routing with standard ops."""
        from engram_trt.models.onnx_quant import routed_experts, routed_experts_unavailable

        g, cfg = self.g, self.config
        E, I, k = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok
        m = f"{p}.mlp"
        logits = self.linear(x, f"{m}.gate", "router")  # [T, E]
        if cfg.scoring_func == "sigmoid":
            scores = g.op("Sigmoid", [logits], "router_scores")
        else:  # sqrtsoftplus
            scores = g.op("Sqrt", [g.op("Softplus", [logits])], "router_scores")
        if hash_routed:
            table = self._np(f"{m}.gate.tid2eid", np.int64)
            ids = g.op("Gather", [g.const(f"{p}.tid2eid", table), "input_ids"], "hash_ids", axis=0)  # [T, k]
        else:
            bias = g.const(f"{m}.gate.e_score_correction_bias.f32", self.host(f"{m}.gate.e_score_correction_bias"))
            _, ids = g.op(
                "TopK",
                [g.op("Add", [self.f32(scores), bias]), g.ints([k])],
                "router_topk",
                n_out=2,
                axis=-1,
                largest=1,
                sorted=1,
            )
        picked = g.op("GatherElements", [scores, ids], "router_picked", axis=1)  # [T, k]
        total = g.op("Add", [g.op("ReduceSum", [picked, g.ints([-1])], keepdims=1), self.act_scalar(1e-20)])
        weights = g.op(
            "Mul", [g.op("Div", [picked, total]), self.act_scalar(float(cfg.routed_scaling_factor))], "router_weights"
        )
        names = [f"{m}.experts.{e}" for e in range(E)]
        stored = {
            proj: [self.stored_expert(f"{n}.{proj}.weight") for n in names]
            for proj in ("gate_proj", "up_proj", "down_proj")
        }
        if routed_experts_unavailable(stored["gate_proj"], stored["up_proj"], stored["down_proj"]) is None:
            routed = routed_experts(
                g,
                x,
                ids,
                self.f32(weights),
                f"{p}.experts",
                stored["gate_proj"],
                stored["up_proj"],
                stored["down_proj"],
                top_k=k,
                limit=float(cfg.swiglu_limit),
            )
        else:
            experts = g.const(f"c_experts_{E}", np.arange(E, dtype=np.int64))
            onehot = g.op(
                "Cast",
                [g.op("Equal", [g.op("Unsqueeze", [ids, g.ints([-1])]), experts])],
                "router_onehot",
                to=self.elem,
            )  # [T, k, E]
            routing = g.op(
                "ReduceSum",
                [g.op("Mul", [onehot, g.op("Unsqueeze", [weights, g.ints([-1])])]), g.ints([1])],
                "routing",
                keepdims=0,
            )  # [T, E]

            def floats(proj: str, axis: int) -> Any:
                return lambda: np.concatenate([self._np(f"{n}.{proj}.weight", self.np_dt) for n in names], axis=axis).T

            routed = self.dense_experts(
                x,
                routing,
                f"{p}.experts",
                (stored["gate_proj"], floats("gate_proj", 0)),
                (stored["up_proj"], floats("up_proj", 0)),
                (stored["down_proj"], floats("down_proj", 1)),
                self._swiglu_hidden,
                E,
                I,
            )
        s = f"{m}.shared_experts"
        sh = self._swiglu_hidden(
            self.linear(x, f"{s}.gate_proj", "shared_gate"), self.linear(x, f"{s}.up_proj", "shared_up")
        )
        return g.op("Add", [routed, self.linear(sh, f"{s}.down_proj", "shared_down")], "moe")

    def _swiglu_hidden(self, gate: str, up: str) -> str:
        """``silu(min(gate, l)) * clamp(up, -l, l)`` (:class:`~.modules.ClampedSwiGLU`)."""
        g = self.g
        lim = float(self.config.swiglu_limit)
        gate = g.op("Min", [gate, self.act_scalar(lim)], "swiglu_gate")
        up = g.op("Clip", [up, self.act_scalar(-lim), self.act_scalar(lim)], "swiglu_up")
        return g.op("Mul", [self.silu(gate), up], "swiglu")

    # -- attention ------------------------------------------------------------------------
    def attention(
        self,
        x: str,
        p: str,
        index: int,
        angles: tuple[str, str, str],
        table: Any,
        states: list[str],
        state_outs: list[str],
    ) -> str:
        """:class:`~.attention.DeepseekV4Attention` of the normed input ``x [T, D]``:
        the graph computes what the op contract (``EngramDsv4Attention``) leaves
        outside the node: low-rank queries (``q_a_proj``, ``q_a_norm``, ``q_b_proj``, a
        per-head unweighted RMSNorm, RoPE), the shared K=V head (``kv_proj``,
        ``kv_norm``, RoPE), on CSA / HCA layers the compressor's raw projections and,
        on CSA, the indexer's rotated queries, float32 head weights and raw
        projections; then the node (every state of the layer in place), the inverse
        RoPE of its output, the grouped ``o_a_proj`` (one MatMul per group, batched)
        and ``o_b_proj``. ``angles``: the tokens' ``(cos, sin, -sin)`` of the layer's
        RoPE table ``table`` (:class:`~.compressors.RopeTable`)."""
        from engram_trt.models.deepseek_v4.attention import layer_type_of
        from engram_trt.models.deepseek_v4.compressors import compress_rate
        from engram_trt.models.deepseek_v4.weights import checkpoint_name

        g, cfg = self.g, self.config
        a = f"{p}.self_attn"
        H, d, rd = cfg.num_attention_heads, cfg.head_dim, int(table.rope_dim)
        cos, sin, nsin = angles
        layer_type = layer_type_of(cfg, index)
        q_res = self.rms_norm(self.linear(x, f"{a}.q_a_proj", "q_a"), f"{a}.q_a_norm", cfg.q_lora_rank)
        q = self.heads(self.linear(q_res, f"{a}.q_b_proj", "q_b"), H, d, "q_heads")
        q = self.unweighted_rms_norm(q)
        self._rank3[q] = True
        q = self.rope(q, d, rd, cos, sin)
        kv = self.rope(self.rms_norm(self.linear(x, f"{a}.kv_proj", "kv"), f"{a}.kv_norm", d), d, rd, cos, sin)
        sinks = g.const(f"{a}.sinks.host", self.host(f"{a}.sinks"))
        inputs = [q, kv, sinks, "seq_starts", "past_lens", "slots", states[0]]
        rate, topk = 1, max(1, int(cfg.index_topk))
        if layer_type != "sliding_attention":
            rate = compress_rate(cfg, layer_type)
            c = f"{a}.compressor"
            inputs += [
                self.linear(x, f"{c}.kv_proj", "c_kv"),
                self.linear(x, f"{c}.gate_proj", "c_gate"),
                g.const(f"{c}.position_bias.host", self.host(f"{c}.position_bias")),
                g.const(f"{c}.kv_norm.weight.host", self.host(f"{c}.kv_norm.weight")),
                g.const(f"rope_inv_freq_{layer_type}", table.inv_freq.numpy().astype(np.float32)),
                *states[1:4],
            ]
        if layer_type == "compressed_sparse_attention":
            ix = f"{a}.compressor.indexer"
            NI, di = cfg.index_n_heads, cfg.index_head_dim
            iq = self.rope(
                self.heads(self.linear(q_res, f"{ix}.q_b_proj", "index_q"), NI, di, "index_q3"), di, rd, cos, sin
            )
            iw = g.op(
                "Mul",
                [self.f32(self.linear(x, f"{ix}.scorer.weights_proj", "index_w")), self.f32_scalar(float(NI) ** -0.5)],
                "index_w_scaled",
            )
            inputs += [
                iq,
                iw,
                self.linear(x, f"{ix}.kv_proj", "i_kv"),
                self.linear(x, f"{ix}.gate_proj", "i_gate"),
                g.const(f"{ix}.position_bias.host", self.host(f"{ix}.position_bias")),
                g.const(f"{ix}.kv_norm.weight.host", self.host(f"{ix}.kv_norm.weight")),
                *states[4:7],
            ]
        out = g.op(
            ATTENTION_OP,
            inputs,
            outputs=[g.name(f"dsv4_attn{index}"), *state_outs],
            domain=PLUGIN_DOMAIN,
            hint=f"dsv4_attn{index}",
            **plugin_fields(
                layer_type=LAYER_TYPE_CODES[layer_type],
                window=int(cfg.sliding_window),
                compress_rate=int(rate),
                index_topk=topk,
                scaling=float(d) ** -0.5,
                eps=float(cfg.rms_norm_eps),
                rope_scale=float(table.scale),
            ),
        )[0]  # [T, H, d]
        self._rank3[out] = True
        out = self.rope(out, d, rd, cos, nsin)  # the values carried the keys' rotation: undo it at the query's position
        G, R = int(cfg.o_groups), int(cfg.o_lora_rank)
        per = H * d // G
        wo_a = checkpoint_name(f"{a}.o_a_proj.weight")
        qw = self.stored_fp8(wo_a)
        if qw is not None:  # FP8: one DequantizeLinear product per group (its rows of the weight)
            from engram_trt.models.onnx_quant import quant_matmul, row_slice

            pieces = g.op(
                "Split",
                [g.op("Reshape", [out, g.ints([0, G, per])], "o_groups"), g.ints([1] * G)],
                "o_groups_split",
                n_out=G,
                axis=1,
            )
            pieces = [pieces] if G == 1 else pieces
            low = g.op(
                "Concat",
                [
                    quant_matmul(
                        g,
                        g.op("Squeeze", [piece, g.ints([1])], "o_group"),
                        f"{wo_a}.group{i}",
                        row_slice(qw, i * R, (i + 1) * R),
                        self.elem,
                        "o_a",
                    )
                    for i, piece in enumerate(pieces)
                ],
                "o_a_flat",
                axis=1,
            )  # [T, G * R]
            return self.linear(low, f"{a}.o_b_proj", "o_b")
        grouped = g.op(
            "Transpose", [g.op("Reshape", [out, g.ints([0, G, per])], "o_groups")], "o_groups_t", perm=[1, 0, 2]
        )  # [G, T, per]
        w = self._np(f"{a}.o_a_proj.weight", self.np_dt).reshape(G, R, per).transpose(0, 2, 1)  # [G, per, R]
        low = g.op("MatMul", [grouped, g.const(f"{a}.o_a_proj.grouped", np.ascontiguousarray(w))], "o_a")  # [G, T, R]
        low = g.op("Reshape", [g.op("Transpose", [low], perm=[1, 0, 2]), g.ints([0, G * R])], "o_a_flat")
        return self.linear(low, f"{a}.o_b_proj", "o_b")

    # -- Engram (V4.1) ----------------------------------------------------------------------
    def engram(self, streams: str, j: int, layer_id: int, rows: str, live: str, gate_dtype: str, layout: Any) -> str:
        """engram-llama's update on the ``[T, hc, D]`` streams (docs/engram-spec.md
        "Fusion"; :class:`~engram_trt.models.engram_llama.modules.EngramModule`):
        ``kv = rows @ wkv^T``, then EngramGate (each stream gated by its own key, the
        shared value added; its output is the new streams). ``rows [T, cols, head_dim]``
        bf16 (EngramGather's or the staged ones); casts around the gate where the graph's
        dtype is not ``gate_dtype``."""
        from engram_trt.checkpoint.checkpoint import engram_tensor_names
        from engram_trt.models.engram_llama.onnx_export import _np, plugin_attributes
        from engram_trt.models.export import DTYPES, GATHER_OUT_DTYPE

        g, cfg = self.g, self.config
        spec = cfg.engram
        names = engram_tensor_names(layer_id, spec.prefix)
        e = g.op("Reshape", [rows, g.ints([0, -1])], f"engram_e{j}")
        if DTYPES[GATHER_OUT_DTYPE][0] != self.elem:
            e = g.op("Cast", [e], f"engram_e{j}_cast", to=self.elem)
        kv = self.fp8_linear(e, names["wkv"], f"engram_kv{j}")
        if kv is None:
            wkv_t = np.ascontiguousarray(_np(self.get(names["wkv"]), self.np_dt).T)
            kv = g.op("MatMul", [e, g.const(names["wkv"] + ".T", wkv_t)], f"engram_kv{j}")
        gate_elem = DTYPES[gate_dtype][0]
        hid = streams
        if gate_elem != self.elem:
            hid = g.op("Cast", [hid], to=gate_elem)
            kv = g.op("Cast", [kv], to=gate_elem)
        wt = self.np_dt if gate_dtype == "bf16" and self.elem == TensorProto.BFLOAT16 else np.float32
        qw = g.const(names["q_weight"] + f".{np.dtype(wt).name}", _np(self.get(names["q_weight"]), wt))
        kw = g.const(names["k_weight"] + f".{np.dtype(wt).name}", _np(self.get(names["k_weight"]), wt))
        out = g.op(
            "EngramGate",
            [hid, kv, qw, kw, live],
            f"engram_gate{j}",
            domain=PLUGIN_DOMAIN,
            **plugin_attributes(layout, cfg, "EngramGate"),
        )
        if gate_elem != self.elem:
            out = g.op("Cast", [out], to=self.elem)
        return out
