"""Qwen4Exp's plugin ops on the CPU, the architecture's ``onnx.reference`` OpRuns
(:func:`reference_ops`): EngramPleHash (engram/ple_hash.py), EngramPleFusion
(:func:`ple_fusion_reference`: models/qwen4_exp/modules.PLEFusion.forward_torch in float64),
EngramCausalConv1d / EngramGatedDeltaNet (:mod:`.reference_linear_attention`) and
EngramQsaAttention (:mod:`.reference_qsa`), float64. States are updated in place and
returned as the aliased outputs."""

from __future__ import annotations

from typing import Any

import numpy as np

from engram_trt.errors import EngramError
from engram_trt.models.export import PLUGIN_DOMAIN, decode_multipliers
from engram_trt.models.reference_ops import in_place


def reference_ops() -> list[type]:
    """OpRuns of the Qwen4Exp plugins (module docstring)."""
    from onnx.reference.op_run import OpRun

    class EngramPleHash(OpRun):
        op_domain = PLUGIN_DOMAIN

        def _run(self, ids, seq_starts, context, **kw):  # noqa: ANN001
            from engram_trt.engram.ple_hash import PLEHashLayout, ple_hash_packed

            n, hpn = int(kw["ngram_size"]), int(kw["heads_per_ngram"])
            primes = np.asarray(kw["primes"], dtype=np.int64).reshape(1, -1)
            lay = PLEHashLayout(
                num_layers=1,
                ngram_size=n,
                heads_per_ngram=hpn,
                eos_id=int(kw["eos_id"]),
                vocab_size=int(kw["vocab_size"]),
                multipliers=decode_multipliers(kw["multipliers"]).reshape(1, n),
                head_vocab_sizes=primes,
                head_offsets=np.asarray(kw["offsets"], dtype=np.int64).reshape(1, -1),
                table_rows=np.asarray([int(kw["table_rows"])], dtype=np.int64),
            )
            rows = ple_hash_packed(
                np.asarray(ids, np.int64), np.asarray(seq_starts, np.int64), np.asarray(context, np.int64), lay, 0
            )
            return (np.asarray(rows).astype(np.int32),)

    class EngramPleFusion(OpRun):
        op_domain = PLUGIN_DOMAIN

        def _run(
            self,
            streams,
            key,
            value,
            norm_key_w,
            norm_query_w,
            norm_conv_w,
            conv_w,
            conv_state,  # noqa: ANN001
            seq_starts,
            past_lens,
            slots,
            **kw,
        ):
            out, new_state = ple_fusion_reference(
                streams,
                key,
                value,
                norm_key_w,
                norm_query_w,
                norm_conv_w,
                conv_w,
                conv_state,
                seq_starts,
                past_lens,
                slots,
                hc_count=int(kw["hc_count"]),
                hidden=int(kw["hidden"]),
                dilation=int(kw["dilation"]),
                eps=float(kw["eps"]),
            )
            return (out.astype(streams.dtype), in_place(conv_state, new_state))

    class EngramCausalConv1d(OpRun):
        op_domain = PLUGIN_DOMAIN

        def _run(self, x, weight, conv_state, seq_starts, past_lens, slots, **kw):  # noqa: ANN001
            from engram_trt.models.qwen4_exp.reference_linear_attention import causal_conv1d_reference

            w = np.asarray(weight)
            if w.shape[-1] != int(kw["kernel"]):
                raise EngramError(f"EngramCausalConv1d kernel {kw['kernel']} does not match its weight {w.shape}")
            y, new_state = causal_conv1d_reference(
                x, w, conv_state, seq_starts, past_lens, slots, int(kw["activation"])
            )
            return (np.asarray(y).astype(x.dtype), in_place(conv_state, new_state))

    class EngramGatedDeltaNet(OpRun):
        op_domain = PLUGIN_DOMAIN

        def _run(self, q, k, v, g, beta, state, seq_starts, past_lens, slots, **kw):  # noqa: ANN001
            from engram_trt.models.qwen4_exp.reference_linear_attention import gated_delta_net_reference

            o, new_state = gated_delta_net_reference(
                q, k, v, g, beta, state, seq_starts, past_lens, slots, int(kw["l2norm_qk"]), float(kw["scale"])
            )
            return (np.asarray(o).astype(q.dtype), in_place(state, new_state))

    class EngramQsaAttention(OpRun):
        op_domain = PLUGIN_DOMAIN

        def _run(
            self,
            q,
            k,
            v,
            index_q,
            index_raw,
            key_cache,
            value_cache,
            index_key_cache,
            index_k_norm_weight,  # noqa: ANN001
            token_slot,
            token_pos,
            **kw,
        ):
            from engram_trt.models.qwen4_exp.reference_qsa import qsa_attention_reference

            out, kc, vc, ikc = qsa_attention_reference(
                q,
                k,
                v,
                index_q,
                index_raw,
                key_cache,
                value_cache,
                index_key_cache,
                index_k_norm_weight,
                token_slot,
                token_pos,
                compress_ratio=int(kw["compress_ratio"]),
                block_topk=int(kw["block_topk"]),
                rot_dim=int(kw["rot_dim"]),
                rope_theta=float(kw["rope_theta"]),
                eps=float(kw["eps"]),
                scaling=float(kw["scaling"]),
            )
            return (
                np.asarray(out).astype(q.dtype),
                in_place(key_cache, kc),
                in_place(value_cache, vc),
                in_place(index_key_cache, ikc),
            )

    return [EngramPleHash, EngramPleFusion, EngramCausalConv1d, EngramGatedDeltaNet, EngramQsaAttention]


def ple_fusion_reference(
    streams: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    norm_key_w: np.ndarray,
    norm_query_w: np.ndarray,
    norm_conv_w: np.ndarray,
    conv_w: np.ndarray,
    conv_state: np.ndarray,
    seq_starts: Any,
    past_lens: Any,
    slots: Any,
    *,
    hc_count: int,
    hidden: int,
    dilation: int,
    eps: float,
) -> tuple[np.ndarray, np.ndarray]:
    """The EngramPleFusion plugin's contract in float64: :meth:`PLEFusion.forward_torch`
    (the module the plugin is tied to) run on the plugin's inputs, its two projections
    replaced by the slices of ``[key | value]``. Returns ``(update [T, W], new state)``."""
    from types import SimpleNamespace

    import torch

    from engram_trt.models.qwen4_exp.modules import PLEFusion

    W = hc_count * hidden
    cw = np.asarray(conv_w, dtype=np.float64).reshape(W, 1, -1)
    kernel = cw.shape[-1]
    cfg = SimpleNamespace(
        hc_count=hc_count,
        hidden_size=hidden,
        rms_norm_eps=eps,
        ple=SimpleNamespace(ngram_size=dilation, conv_kernel_size=kernel, embed_dim=1),
    )
    with torch.no_grad():
        m = PLEFusion(cfg).double()
        m.key_proj = _Columns(0, W)
        m.value_proj = _Columns(W, W + hidden)
        for mod, w in ((m.norm_key, norm_key_w), (m.norm_query, norm_query_w), (m.norm_conv, norm_conv_w)):
            mod.weight.copy_(torch.from_numpy(np.asarray(w, dtype=np.float64)))
        m.conv1d.weight.copy_(torch.from_numpy(cw))
        rows = torch.from_numpy(np.concatenate([np.asarray(key, np.float64), np.asarray(value, np.float64)], axis=1))
        state = torch.from_numpy(np.asarray(conv_state, dtype=np.float64).copy())
        out = m.forward_torch(
            torch.from_numpy(np.asarray(streams, np.float64)),
            rows,
            [int(s) for s in np.asarray(seq_starts)],
            [int(p) for p in np.asarray(past_lens)],
            [int(s) for s in np.asarray(slots)],
            state,
        )
    return out.numpy(), state.numpy()


def _columns_module() -> type:
    import torch

    class Columns(torch.nn.Module):
        """Stands in for a projection: the columns ``[a, b)`` of its input."""

        def __init__(self, a: int, b: int) -> None:
            super().__init__()
            self.a, self.b = a, b

        def forward(self, x: "torch.Tensor") -> "torch.Tensor":
            return x[:, self.a : self.b]

    return Columns


def _Columns(a: int, b: int) -> Any:  # noqa: N802 - a class built on first use (torch imported lazily)
    return _columns_module()(a, b)


def _columns_module() -> type:
    import torch

    class Columns(torch.nn.Module):
        """Stands in for a projection: the columns ``[a, b)`` of its input."""

        def __init__(self, a: int, b: int) -> None:
            super().__init__()
            self.a, self.b = a, b

        def forward(self, x: "torch.Tensor") -> "torch.Tensor":
            return x[:, self.a : self.b]

    return Columns


def _Columns(a: int, b: int) -> Any:  # noqa: N802 - a class built on first use (torch imported lazily)
    return _columns_module()(a, b)
