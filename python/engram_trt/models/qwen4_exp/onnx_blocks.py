"""The blocks of Qwen4Exp's ONNX serving step (:mod:`.onnx_export` wires them): offset
RMSNorms, partial RoPE, the hyper-connections' mix and injection, the sparse MoE, the
Gated DeltaNet and the gated attention with the QSA indexer, the PLE lookup and fusion.

Each block emits the op sequence of its PyTorch module (:mod:`.modules`,
:mod:`.linear_attention`, :mod:`.attention`, :mod:`.norms`) with the same roundings:
weights in the graph's dtype (the torch model casts every parameter to its compute
dtype), norms and routing in float32 with one rounding back, so a float32 graph equals
the torch model to round-off and a bf16 graph rounds where it rounds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from engram_trt.errors import EngramError
from engram_trt.models.export import PLUGIN_DOMAIN, ple_hash_plugin_attributes
from engram_trt.models.onnx_blocks import GraphBlocks, plugin_fields


@dataclass
class Blocks(GraphBlocks):
    """The graph under construction plus what every block reads: ``g`` (the node
    accumulator of :mod:`engram_trt.models.engram_llama.onnx_export`), ``get`` (checkpoint
    name -> tensor), the graph's ONNX element type / NumPy dtype, and the step's derived
    tensors (``position_ids [T, 1]``, ``token_slot``, ``token_pos``)."""

    cos: str
    sin: str
    position_ids: str
    token_slot: str
    token_pos: str

    # -- constants and casts ---------------------------------------------------------
    def weight(self, name: str, *, transpose: bool = False, dtype: Any = None) -> str:
        """A checkpoint tensor as an initializer in the graph's dtype (or ``dtype``)."""
        from engram_trt.models.engram_llama.onnx_export import _np

        arr = _np(self.get(name), dtype or self.np_dt)
        if transpose:
            arr = np.ascontiguousarray(arr.T)
        return self.g.const(name + (".T" if transpose else ""), arr)

    def host(self, name: str, dtype: Any = np.float32) -> np.ndarray:
        """A checkpoint tensor rounded to the graph's dtype, then as ``dtype`` on the
        host (what the torch model's ``param.float()`` reads)."""
        from engram_trt.models.engram_llama.onnx_export import _np

        return _np(self.get(name), self.np_dt).astype(np.float32).astype(dtype)

    def linear(self, x: str, name: str, hint: str) -> str:
        """``x @ W^T`` in the graph's dtype; a weight stored FP8 through DequantizeLinear of its bytes."""
        y = self.fp8_linear(x, name, hint)
        return y if y is not None else self.g.op("MatMul", [x, self.weight(name, transpose=True)], hint)

    # -- norms and RoPE ----------------------------------------------------------------
    def offset_norm(self, x: str, name: str, size: int, groups: int | None = None) -> str:
        """:func:`~.norms.offset_rms_norm`: float32 statistics, scale ``1 + w``, rounded
        once to the graph's dtype. ``x`` ends in ``[..., size]``; with ``groups`` it ends
        in ``[..., groups, size]`` and the weight spans all groups."""
        w = 1.0 + self.host(name)
        if groups is not None:
            w = w.reshape(groups, size)
        scale = self.g.const(name + ".plus1", np.ascontiguousarray(w.astype(np.float32)))
        return self.act(self.g.op("Mul", [self.rms(self.f32(x), size), scale], "offset_norm"))

    def rope(self, x: str, heads: int, dim: int) -> str:
        """Rotate-half RoPE of the first ``rotary_dim`` features of ``x [T, heads, dim]``
        at each token's position (each token its own batch row)."""
        g = self.g
        y = g.op("Reshape", [x, g.ints([0, heads, 1, dim])], "rope_in")
        y = g.op(
            "RotaryEmbedding",
            [y, self.cos, self.sin, self.position_ids],
            "rope",
            interleaved=0,
            rotary_embedding_dim=int(self.config.rotary_dim),
        )
        return g.op("Reshape", [y, g.ints([0, heads, dim])], "rope_out")

    # -- hyper-connections ---------------------------------------------------------------
    def mix(self, streams: str, prefix: str, inject: bool = True) -> tuple[str, str | None]:
        """:meth:`~.modules.GatedResidual.mix` of ``streams [N, hc, D]``: ``(the sublayer
        input [N, D], injection weights [N, hc] or None)``."""
        g, cfg = self.g, self.config
        hc, D = cfg.hc_count, cfg.hidden_size
        normed = self.offset_norm(streams, f"{prefix}.hc_norm.weight", D, groups=hc)  # [N, hc, D]
        flat = g.op("Reshape", [normed, g.ints([0, hc * D])], "hc_flat")
        down = self.linear(flat, f"{prefix}.input_mix_weight_down.weight", "hc_down")
        up = self.linear(
            self.silu(g.op("Div", [down, self.act_scalar(float(hc))])), f"{prefix}.input_mix_weight_up.weight", "hc_up"
        )
        w = g.op("Reshape", [g.op("Sigmoid", [up]), g.ints([0, hc, D])], "hc_w")
        mixed = g.op("ReduceMean", [g.op("Mul", [w, normed]), g.ints([1])], "hc_mixed", keepdims=0)
        if not inject:
            return mixed, None
        inj = self.linear(flat, f"{prefix}.block_inject_weight.weight", "hc_inject")
        inj = g.op(
            "Mul",
            [self.act_scalar(2.0), g.op("Sigmoid", [g.op("Div", [inj, self.act_scalar(float(hc))])])],
            "hc_inject_w",
        )
        return mixed, inj

    def inject(self, streams: str, out: str, weights: str) -> str:
        """:meth:`~.modules.GatedResidual.inject`: ``streams + out[:, None] * weights[..., None]``."""
        g = self.g
        upd = g.op("Mul", [g.op("Unsqueeze", [out, g.ints([1])]), g.op("Unsqueeze", [weights, g.ints([2])])], "inject")
        return g.op("Add", [streams, upd], "streams")

    # -- sparse MoE -------------------------------------------------------------------------
    def moe(self, x: str, p: str) -> str:
        """:class:`~.modules.SparseMoE`: the router's softmax and top-k in float32 (TopK,
        renormalized when ``norm_topk_prob``), then the routed experts, plus the shared
        expert scaled by ``sigmoid(shared_expert_gate(x))``.

        Experts stored FP8 (an FP8 release: transformers' merged scales) run in one
        EngramRoutedExperts node (models/onnx_quant.py): only the picked experts' bytes are
        read. Float experts, and FP8 ones the plugin cannot take (a projection left float,
        dims not multiples of 16), take the dense form: the weights scattered into a
        ``[T, E]`` routing matrix (ScatterElements; 0 where a token did not pick an
        expert) and EVERY expert computed on every token (one stacked gate/up GEMM ``[D,
        E*I]``, each expert's activations scaled by its routing weight, one down GEMM
        ``[E*I, D]``; FP8 stacks dequantized in the graph): correct, with ``E / top_k``
        times the picked experts' arithmetic and every expert's weights read each step
        (the torch model's ``experts_dense`` form)."""
        from engram_trt.models.onnx_quant import routed_experts, routed_experts_unavailable

        g, cfg = self.g, self.config
        E, I, k = cfg.num_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok
        D = cfg.hidden_size
        logits = self.linear(x, f"{p}.mlp.gate.weight", "router")  # [T, E]
        probs = g.op("Softmax", [self.f32(logits)], "router_probs", axis=-1)
        vals, ids = g.op("TopK", [probs, g.ints([k])], "router_topk", n_out=2, axis=-1, largest=1, sorted=1)
        if cfg.norm_topk_prob:
            vals = g.op("Div", [vals, g.op("ReduceSum", [vals, g.ints([-1])], keepdims=1)], "router_norm")
        names = [f"{p}.mlp.experts.{e}" for e in range(E)]
        stored = {
            proj: [self._expert_fp8(f"{n}.{proj}.weight", shape) for n in names]
            for proj, shape in (("gate_proj", (I, D)), ("up_proj", (I, D)), ("down_proj", (D, I)))
        }
        if routed_experts_unavailable(stored["gate_proj"], stored["up_proj"], stored["down_proj"]) is None:
            routed = routed_experts(
                g,
                x,
                ids,
                self.f32(self.act(vals)),
                f"{p}.mlp.experts",
                stored["gate_proj"],
                stored["up_proj"],
                stored["down_proj"],
                top_k=k,
                limit=0.0,
            )
        else:
            zeros = g.op(
                "ConstantOfShape",
                [g.op("Shape", [logits])],
                "router_zeros",
                value=g.h.make_tensor("value", self.elem, [1], [0]),
            )
            routing = g.op("ScatterElements", [zeros, ids, self.act(vals)], "routing", axis=1)  # [T, E]

            def floats(proj: str, axis: int) -> Any:
                return lambda: np.concatenate([self._np(f"{n}.{proj}.weight") for n in names], axis=axis).T

            routed = self.dense_experts(
                x,
                routing,
                f"{p}.mlp.experts",
                (stored["gate_proj"], floats("gate_proj", 0)),
                (stored["up_proj"], floats("up_proj", 0)),
                (stored["down_proj"], floats("down_proj", 1)),
                lambda gate, up: g.op("Mul", [self.silu(gate), up]),
                E,
                I,
            )
        s = f"{p}.mlp.shared_expert"
        sh = g.op(
            "Mul",
            [
                self.silu(self.linear(x, f"{s}.gate_proj.weight", "shared_gate")),
                self.linear(x, f"{s}.up_proj.weight", "shared_up"),
            ],
        )
        sh = self.linear(sh, f"{s}.down_proj.weight", "shared_down")
        sgate = g.op("Sigmoid", [self.linear(x, f"{p}.mlp.shared_expert_gate.weight", "shared_expert_gate")])
        return g.op("Add", [routed, g.op("Mul", [sh, sgate])], "moe")

    def _expert_fp8(self, name: str, shape: tuple[int, int]) -> Any:
        """A routed expert's weight stored FP8 (its own scale, or its expert's rows of
        transformers' merged ``gate_up_proj_scale_inv`` / ``down_proj_scale_inv``), else None."""
        import torch

        from engram_trt.models.onnx_quant import stored_dtype
        from engram_trt.models.qwen4_exp.weights import ExpertScales, expert_weight_scale

        src = self.source()
        if stored_dtype(src, name) != torch.float8_e4m3fn:
            return None
        if not hasattr(self, "_merged_scales"):
            self._merged_scales = ExpertScales(src)
        found = expert_weight_scale(src, name, shape, self.config.quant, self.config, self._merged_scales)
        if found is None:
            return self.stored_fp8(name)
        scale, block = found
        return self.stored_fp8(name, scale=scale, block=block)

    def _np(self, name: str) -> np.ndarray:
        from engram_trt.models.engram_llama.onnx_export import _np

        return _np(self.get(name), self.np_dt)

    # -- Gated DeltaNet ----------------------------------------------------------------------
    def gated_delta_net(self, x: str, p: str, conv_state: str, conv_out: str, rec_state: str, rec_out: str) -> str:
        """:class:`~.linear_attention.GatedDeltaNet` over the packed step: projections,
        ``beta = sigmoid(b)`` and ``g = -exp(A_log) * softplus(a + dt_bias)`` in float32
        (softplus as ``relu(x) + log(1 + exp(-|x|))``, finite everywhere), the short conv
        (EngramCausalConv1d, SiLU) and the recurrence (EngramGatedDeltaNet) over the slots'
        states in place, then the gated RMSNorm and ``out_proj``."""
        g, cfg = self.g, self.config
        a = f"{p}.linear_attn"
        Hk, Hv, dk, dv = (
            cfg.linear_num_key_heads,
            cfg.linear_num_value_heads,
            cfg.linear_key_head_dim,
            cfg.linear_value_head_dim,
        )
        key_dim, value_dim = Hk * dk, Hv * dv
        cols = self.linear(x, f"{a}.in_proj_qkv.weight", "gdn_qkv")
        z = self.linear(x, f"{a}.in_proj_z.weight", "gdn_z")
        beta = self.f32(g.op("Sigmoid", [self.linear(x, f"{a}.in_proj_b.weight", "gdn_b")], "gdn_beta"))
        pre = g.op(
            "Add",
            [
                self.f32(self.linear(x, f"{a}.in_proj_a.weight", "gdn_a")),
                g.const(f"{a}.dt_bias.f32", self.host(f"{a}.dt_bias")),
            ],
            "gdn_pre",
        )
        soft = g.op(
            "Add",
            [
                g.op("Relu", [pre]),
                g.op("Log", [g.op("Add", [self.f32_scalar(1.0), g.op("Exp", [g.op("Neg", [g.op("Abs", [pre])])])])]),
            ],
            "gdn_softplus",
        )
        neg_a = -np.exp(self.host(f"{a}.A_log"))  # float32, as -A_log.float().exp()
        gate = g.op("Mul", [g.const(f"{a}.neg_exp_A", neg_a.astype(np.float32)), soft], "gdn_g")
        conv_w = self.weight(f"{a}.conv1d.weight")
        mixed = g.op(
            "EngramCausalConv1d",
            [cols, conv_w, conv_state, "seq_starts", "past_lens", "slots"],
            outputs=[g.name("gdn_conv"), conv_out],
            domain=PLUGIN_DOMAIN,
            hint="gdn_conv",
            **plugin_fields(kernel=int(cfg.linear_conv_kernel_dim), activation=1),
        )[0]
        q, k, v = g.op("Split", [mixed, g.ints([key_dim, key_dim, value_dim])], "gdn_split", n_out=3, axis=1)
        q = g.op("Reshape", [q, g.ints([0, Hk, dk])], "gdn_q")
        k = g.op("Reshape", [k, g.ints([0, Hk, dk])], "gdn_k")
        v = g.op("Reshape", [v, g.ints([0, Hv, dv])], "gdn_v")
        core = g.op(
            "EngramGatedDeltaNet",
            [q, k, v, gate, beta, rec_state, "seq_starts", "past_lens", "slots"],
            outputs=[g.name("gdn_core"), rec_out],
            domain=PLUGIN_DOMAIN,
            hint="gdn_core",
            **plugin_fields(l2norm_qk=1, scale=float(dk) ** -0.5),
        )[0]  # [T, Hv, dv]
        # GatedRMSNorm: normalized in float32, rounded, times the weight in the graph's
        # dtype, times act(gate) in float32, rounded once more.
        normed = g.op("Mul", [self.act(self.rms(self.f32(core), dv)), self.weight(f"{a}.norm.weight")], "gdn_norm")
        zf = self.f32(g.op("Reshape", [z, g.ints([0, Hv, dv])]))
        gact = self.silu(zf) if cfg.output_gate_type == "silu" else g.op("Sigmoid", [zf])
        out = self.act(g.op("Mul", [self.f32(normed), gact], "gdn_gated"))
        return self.linear(g.op("Reshape", [out, g.ints([0, value_dim])]), f"{a}.out_proj.weight", "gdn_out")

    # -- gated attention with the QSA indexer ---------------------------------------------
    def attention(self, x: str, p: str, caches: tuple[str, str, str], cache_outs: tuple[str, str, str]) -> str:
        """:class:`~.attention.GatedAttention`: q (with its output gate), k, v, the
        per-head offset norms and partial RoPE, the indexer's queries (normed, rotated)
        and raw keys, then EngramQsaAttention over the slot caches (in place) and
        ``o_proj(out * sigmoid(gate))``."""
        g, cfg = self.g, self.config
        s = f"{p}.self_attn"
        h, kvh, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        ni, di = cfg.qsa.n_heads, cfg.qsa.head_dim
        qg = g.op("Reshape", [self.linear(x, f"{s}.q_proj.weight", "attn_qg"), g.ints([0, h, 2 * hd])], "attn_qg3")
        query, gate = g.op("Split", [qg, g.ints([hd, hd])], "attn_qsplit", n_out=2, axis=2)
        gate = g.op("Reshape", [gate, g.ints([0, h * hd])], "attn_gate")
        query = self.rope(self.offset_norm(query, f"{s}.q_norm.weight", hd), h, hd)
        key = g.op("Reshape", [self.linear(x, f"{s}.k_proj.weight", "attn_k"), g.ints([0, kvh, hd])])
        key = self.rope(self.offset_norm(key, f"{s}.k_norm.weight", hd), kvh, hd)
        value = g.op("Reshape", [self.linear(x, f"{s}.v_proj.weight", "attn_v"), g.ints([0, kvh, hd])], "attn_v3")
        iqk = self.linear(x, f"{s}.indexer.index_qk_proj.weight", "index_qk")
        iq, iraw = g.op("Split", [iqk, g.ints([ni * di, di])], "index_split", n_out=2, axis=1)
        iq = g.op("Reshape", [iq, g.ints([0, ni, di])], "index_q")
        iq = self.rope(self.offset_norm(iq, f"{s}.indexer.q_layernorm.weight", di), ni, di)
        knorm = g.const(f"{s}.indexer.k_layernorm.weight.f32", self.host(f"{s}.indexer.k_layernorm.weight"))
        q = cfg.qsa
        att = g.op(
            "EngramQsaAttention",
            [query, key, value, iq, iraw, *caches, knorm, self.token_slot, self.token_pos],
            outputs=[g.name("qsa"), *cache_outs],
            domain=PLUGIN_DOMAIN,
            hint="qsa",
            **plugin_fields(
                compress_ratio=int(q.compress_ratio),
                block_topk=int(q.budget // q.compress_ratio),
                rot_dim=int(cfg.rotary_dim),
                rope_theta=float(cfg.rope_theta),
                eps=float(cfg.rms_norm_eps),
                scaling=float(hd) ** -0.5,
            ),
        )[0]  # [T, h*hd]
        return self.linear(g.op("Mul", [att, g.op("Sigmoid", [gate])], "attn_gated"), f"{s}.o_proj.weight", "attn_out")

    # -- PLE -----------------------------------------------------------------------------------
    def ple(
        self,
        streams: str,
        p: str,
        j: int,
        layout: Any,
        table_rows: int,
        conv_state: str,
        conv_out: str,
        table_dtype: str = "bf16",
    ) -> str:
        """PLE layer ``j`` (decoder layer prefix ``p``): EngramPleHash over the step's raw
        ids and each sequence's ``ple_context``, EngramGather of the rows from the table
        at ``ple_table_ptrs[j]`` (outside the engine, stored as ``table_dtype``: bf16, fp16
        or fp32; the gather gives rows of that type, cast to the graph's dtype where they
        differ), the key / value projections, then EngramPleFusion (its dilated conv
        history in place); returns the streams plus the update."""
        from engram_trt.models.export import DTYPES, FLOAT_TABLE_DTYPE_CODES

        g, cfg = self.g, self.config
        hc, D = cfg.hc_count, cfg.hidden_size
        ple = cfg.ple
        H, hd = ple.n_heads, ple.head_dim
        ids = g.op(
            "EngramPleHash",
            ["input_ids", "seq_starts", "ple_context"],
            f"ple_hash{j}",
            domain=PLUGIN_DOMAIN,
            **ple_hash_plugin_attributes(layout, j),
        )  # [T, H] int32
        if table_rows < int(layout.table_rows[j]):
            raise EngramError(
                f"PLE table {j} has {table_rows} rows but the hash layout needs {int(layout.table_rows[j])}"
            )
        ptr = g.op("Slice", ["ple_table_ptrs", g.ints([j]), g.ints([j + 1])], f"ple_table_ptr{j}")
        rows = g.op(
            "EngramGather",
            [g.op("Unsqueeze", [ids, g.ints([1])], f"ple_ids{j}"), ptr],
            f"ple_rows{j}",
            domain=PLUGIN_DOMAIN,
            **plugin_fields(
                layer_index=0,
                n_layers=1,
                n_cols=H,
                head_dim=hd,
                table_dtype=FLOAT_TABLE_DTYPE_CODES[table_dtype],
                quant_block=32,
                num_rows=int(table_rows),
                bad_rows_input=0,
                column_begin=0,
                column_end=H,
                row_offset=0,
            ),
        )
        rows = g.op("Reshape", [rows, g.ints([0, H * hd])], f"ple_e{j}")  # [T, ple_embed_dim] in the table's dtype
        if self.elem != DTYPES[table_dtype][0]:
            rows = g.op("Cast", [rows], f"ple_e{j}_cast", to=self.elem)
        f = f"{p}.ple"
        key = self.linear(rows, f"{f}.key_proj.weight", "ple_key")
        value = self.linear(rows, f"{f}.value_proj.weight", "ple_value")
        flat = g.op("Reshape", [streams, g.ints([0, hc * D])], "ple_streams")
        upd = g.op(
            "EngramPleFusion",
            [
                flat,
                key,
                value,
                self.weight(f"{f}.norm_key.weight"),
                self.weight(f"{f}.norm_query.weight"),
                self.weight(f"{f}.norm_conv.weight"),
                self.weight(f"{f}.conv1d.weight"),
                conv_state,
                "seq_starts",
                "past_lens",
                "slots",
            ],
            outputs=[g.name("ple_update"), conv_out],
            domain=PLUGIN_DOMAIN,
            hint="ple_fusion",
            **plugin_fields(
                hc_count=int(hc),
                hidden=int(D),
                kernel=int(ple.conv_kernel_size),
                dilation=int(ple.ngram_size),
                eps=float(cfg.rms_norm_eps),
            ),
        )[0]
        return g.op("Add", [streams, g.op("Reshape", [upd, g.ints([0, hc, D])])], "streams")
