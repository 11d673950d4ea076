"""CPU execution of the exported serving graph, the plugin nodes bound to Python references.

``onnx.reference.ReferenceEvaluator`` runs every standard op of the graph; the Engram
plugin nodes run as :func:`_reference_ops` binds them: EngramHash / EngramGather /
EngramGate to the hashing, quant and fusion modules, EngramAttention to
:func:`engram_attention_reference` (float64 NumPy, the caches written in place, as the
plugin does with its aliased cache outputs). :class:`ReferenceRunner` holds what a
runtime holds between steps (the per-layer KV caches of every slot and each slot's
Engram lookback) and runs one packed step at a time, so CI checks exactly the graph the
engine is built from against the PyTorch reference model.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import ml_dtypes
import numpy as np

from engram_trt.models.export import (DTYPES, FLOAT_TABLE_DTYPE_CODES, PLUGIN_DOMAIN, TABLE_DTYPE_CODES, ExportedModel,
                                      decode_multipliers)
from engram_trt.config.model import ModelConfig
from engram_trt.engram.layout import EngramLayout
from engram_trt.errors import EngramError

log = logging.getLogger(__name__)


# EngramGather's float table_dtype codes (models/export.FLOAT_TABLE_DTYPE_CODES) -> NumPy dtype.
_FLOAT_TABLE_NP = {FLOAT_TABLE_DTYPE_CODES["bf16"]: ml_dtypes.bfloat16, FLOAT_TABLE_DTYPE_CODES["fp16"]: np.float16,
                   FLOAT_TABLE_DTYPE_CODES["fp32"]: np.float32}


class TableRegistry:
    """Maps the addresses fed as ``engram_table_ptrs``/``engram_scale_ptrs`` to arrays.

    The addresses are the arrays' real data pointers (``arr.ctypes.data``), so the
    graph is fed exactly as a GPU runtime feeds the engine; the reference gather looks
    the address up here instead of dereferencing it.
    """

    def __init__(self) -> None:
        self._by_addr: dict[int, np.ndarray] = {}

    def register(self, arr: np.ndarray) -> int:
        addr = int(arr.ctypes.data)
        if addr == 0:
            raise EngramError("cannot register an empty table")
        self._by_addr[addr] = arr
        return addr

    def lookup(self, addr: int) -> np.ndarray:
        try:
            return self._by_addr[int(addr)]
        except KeyError:
            raise EngramError(f"table address {int(addr):#x} was never registered (feed the addresses TableRegistry.register returned)") from None


def engram_attention_reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, key_cache: np.ndarray,
                               value_cache: np.ndarray, token_slot: np.ndarray, token_pos: np.ndarray,
                               scale: float) -> np.ndarray:
    """The EngramAttention plugin's contract in float64: token t's ``k / v [T, kvh, hd]``
    rows go into ``key_cache / value_cache [slots, kvh, max_seq_len, hd]`` at
    ``(token_slot[t], :, token_pos[t])`` (in place, in the caches' dtype), then every token
    attends to its slot's keys ``0 .. token_pos[t]`` (causal, inclusive; query head h reads
    KV head ``h // (H / kvh)``). A token outside the cache writes nothing and gets a zero
    row. Returns ``[T, H, hd]`` float64."""
    T, H, hd = q.shape
    num_slots, kvh, max_len, _ = key_cache.shape
    group = H // kvh
    slots = np.asarray(token_slot, dtype=np.int64)
    pos = np.asarray(token_pos, dtype=np.int64)
    valid = (slots >= 0) & (slots < num_slots) & (pos >= 0) & (pos < max_len)
    live = np.nonzero(valid)[0]
    key_cache[slots[live], :, pos[live]] = k[live]
    value_cache[slots[live], :, pos[live]] = v[live]
    out = np.zeros((T, H, hd), dtype=np.float64)
    qf = np.asarray(q, dtype=np.float64).reshape(T, kvh, group, hd)
    for t in live:
        keys = key_cache[slots[t], :, : pos[t] + 1].astype(np.float64)  # [kvh, P, hd]
        values = value_cache[slots[t], :, : pos[t] + 1].astype(np.float64)
        scores = np.einsum("kgd,kpd->kgp", qf[t], keys) * float(scale)
        scores -= scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        out[t] = np.einsum("kgp,kpd->kgd", probs, values).reshape(H, hd)
    return out


def _reference_ops(registry: TableRegistry) -> list[type]:
    """OpRun classes binding the plugin nodes to their Python references."""
    from onnx.reference.op_run import OpRun

    from engram_trt.engram.fusion import engram_gate_reference
    from engram_trt.engram.hashing import hash_batch_packed
    from engram_trt.engram.quant import dequant_fp8_rows

    class EngramHash(OpRun):
        op_domain = PLUGIN_DOMAIN

        def _run(self, ids, seq_starts, lookback, plugin_version=None, plugin_namespace=None, n_layers=None,  # noqa: ANN001
                 max_ngram_size=None,
                 n_heads=None, pad_id=None, compressed_vocab_size=None, primes=None, offsets=None, multipliers=None):
            L, N, H = int(n_layers), int(max_ngram_size), int(n_heads)
            primes_a = np.asarray(primes, dtype=np.int64).reshape(L, N - 1, H)
            lay = EngramLayout(layer_ids=tuple(range(L)), max_ngram_size=N, n_heads=H,
                               compressed_vocab_size=int(compressed_vocab_size), pad_id=int(pad_id), primes=primes_a,
                               offsets=np.asarray(offsets, dtype=np.int64).reshape(L, -1),
                               multipliers=decode_multipliers(multipliers).reshape(L, N),
                               table_rows=primes_a.reshape(L, -1).sum(axis=1))
            out = hash_batch_packed(ids, seq_starts, lookback, lay)
            return (out.astype(np.int32),)

    class EngramGather(OpRun):
        op_domain = PLUGIN_DOMAIN

        def _run(self, row_ids, table_ptr, scale_ptr=None, plugin_version=None, plugin_namespace=None,  # noqa: ANN001
                 layer_index=None, n_layers=None, n_cols=None, head_dim=None, table_dtype=None, quant_block=None,
                 num_rows=None, bad_rows_input=None, column_begin=None, column_end=None, row_offset=None):
            # The plugin's share fields (defaults: every column, the table from row 0): columns
            # [column_begin, column_end) of the ids, global row ids read from the table's rows
            # [row_offset, row_offset + num_rows); an id outside them gives a zero row.
            begin = 0 if column_begin is None else int(column_begin)
            end = int(n_cols) if column_end is None else int(column_end)
            offset = 0 if row_offset is None else int(row_offset)
            ids = np.asarray(row_ids)[:, int(layer_index), begin:end].astype(np.int64) - offset  # [T, cols]
            table = registry.lookup(int(np.asarray(table_ptr).reshape(-1)[0]))
            if table.shape[0] != int(num_rows):
                raise EngramError(f"table at the given address has {table.shape[0]} rows, the graph expects {int(num_rows)}")
            inside = (ids >= 0) & (ids < int(num_rows))
            ids = np.where(inside, ids, 0)
            if int(table_dtype) == TABLE_DTYPE_CODES["fp8"]:
                scale = registry.lookup(int(np.asarray(scale_ptr).reshape(-1)[0]))
                rows = dequant_fp8_rows(table[ids], scale[ids], int(quant_block))
                rows = np.where(inside[..., None], rows, np.float32(0.0))
                return (rows.astype(ml_dtypes.bfloat16),)  # FP8 * 2^k is exact in bf16
            # A float table: its rows as they are, in its own dtype (the plugin's output).
            np_dt = _FLOAT_TABLE_NP.get(int(table_dtype))
            if np_dt is None:
                raise EngramError(f"EngramGather table_dtype {int(table_dtype)} is not one of the plugin's "
                                  f"(fp8 0, bf16 1, fp16 2, fp32 3)")
            if table.dtype.itemsize != np.dtype(np_dt).itemsize:
                raise EngramError(f"table at the given address is {table.dtype}, the graph's gather reads "
                                  f"{np.dtype(np_dt).name} rows (table_dtype {int(table_dtype)})")
            rows = table.view(np_dt)[ids]
            if rows.shape[-1] != int(head_dim):
                raise EngramError(f"table at the given address has rows of {rows.shape[-1]}, the graph expects "
                                  f"{int(head_dim)}")
            return (np.where(inside[..., None], rows, np.zeros((), np_dt)),)

    class EngramGate(OpRun):
        op_domain = PLUGIN_DOMAIN

        def _run(self, hidden, kv, q_weight, k_weight, live, plugin_version=None, plugin_namespace=None,  # noqa: ANN001
                 hc_mult=None, hidden_size=None, eps=None):
            out = engram_gate_reference(np.asarray(hidden, np.float32), np.asarray(kv, np.float32),
                                        np.asarray(q_weight, np.float32), np.asarray(k_weight, np.float32),
                                        np.asarray(live) != 0, float(eps))
            return (out.astype(hidden.dtype),)

    class EngramAttention(OpRun):
        op_domain = PLUGIN_DOMAIN

        def _run(self, q, k, v, key_cache, value_cache, token_slot, token_pos, plugin_version=None,  # noqa: ANN001
                 plugin_namespace=None, num_heads=None, num_kv_heads=None, head_dim=None, scale=None):
            if q.shape[1:] != (int(num_heads), int(head_dim)) or key_cache.shape[1] != int(num_kv_heads):
                raise EngramError(f"EngramAttention fields (num_heads {num_heads}, num_kv_heads {num_kv_heads}, head_dim "
                                  f"{head_dim}) do not match q {q.shape} and key_cache {key_cache.shape}")
            out = engram_attention_reference(q, k, v, key_cache, value_cache, token_slot, token_pos, float(scale))
            return (out.astype(q.dtype), key_cache, value_cache)  # the caches themselves: aliased, in place

    return [EngramHash, EngramGather, EngramGate, EngramAttention, *_qwen4_exp_ops(), *_dsv4_ops(),
            *_routed_experts_ops()]


def _in_place(state: np.ndarray, new: Any) -> np.ndarray:
    """Write a reference's new state into the state input itself (what the plugin's
    aliased output means) and return it."""
    np.copyto(state, np.asarray(new).astype(state.dtype, copy=False))
    return state


def _qwen4_exp_ops() -> list[type]:
    """OpRuns of the Qwen4Exp plugins: EngramPleHash (engram/ple_hash.py), EngramPleFusion
    (models/qwen4_exp/modules.PLEFusion.forward_torch in float64), and the three ops of
    /builder/reference_linear_attention.py and reference_qsa.py (float64 NumPy). States
    are updated in place and returned as the aliased outputs."""
    from onnx.reference.op_run import OpRun

    class EngramPleHash(OpRun):
        op_domain = PLUGIN_DOMAIN

        def _run(self, ids, seq_starts, context, **kw):  # noqa: ANN001
            from engram_trt.engram.ple_hash import PLEHashLayout, ple_hash_packed

            n, hpn = int(kw["ngram_size"]), int(kw["heads_per_ngram"])
            primes = np.asarray(kw["primes"], dtype=np.int64).reshape(1, -1)
            lay = PLEHashLayout(num_layers=1, ngram_size=n, heads_per_ngram=hpn, eos_id=int(kw["eos_id"]),
                                vocab_size=int(kw["vocab_size"]), multipliers=decode_multipliers(kw["multipliers"]).reshape(1, n),
                                head_vocab_sizes=primes, head_offsets=np.asarray(kw["offsets"], dtype=np.int64).reshape(1, -1),
                                table_rows=np.asarray([int(kw["table_rows"])], dtype=np.int64))
            rows = ple_hash_packed(np.asarray(ids, np.int64), np.asarray(seq_starts, np.int64),
                                   np.asarray(context, np.int64), lay, 0)
            return (np.asarray(rows).astype(np.int32),)

    class EngramPleFusion(OpRun):
        op_domain = PLUGIN_DOMAIN

        def _run(self, streams, key, value, norm_key_w, norm_query_w, norm_conv_w, conv_w, conv_state,  # noqa: ANN001
                 seq_starts, past_lens, slots, **kw):
            out, new_state = ple_fusion_reference(streams, key, value, norm_key_w, norm_query_w, norm_conv_w, conv_w,
                                                  conv_state, seq_starts, past_lens, slots, hc_count=int(kw["hc_count"]),
                                                  hidden=int(kw["hidden"]), dilation=int(kw["dilation"]),
                                                  eps=float(kw["eps"]))
            return (out.astype(streams.dtype), _in_place(conv_state, new_state))

    class EngramCausalConv1d(OpRun):
        op_domain = PLUGIN_DOMAIN

        def _run(self, x, weight, conv_state, seq_starts, past_lens, slots, **kw):  # noqa: ANN001
            from engram_trt.builder.reference_linear_attention import causal_conv1d_reference

            w = np.asarray(weight)
            if w.shape[-1] != int(kw["kernel"]):
                raise EngramError(f"EngramCausalConv1d kernel {kw['kernel']} does not match its weight {w.shape}")
            y, new_state = causal_conv1d_reference(x, w, conv_state, seq_starts, past_lens, slots, int(kw["activation"]))
            return (np.asarray(y).astype(x.dtype), _in_place(conv_state, new_state))

    class EngramGatedDeltaNet(OpRun):
        op_domain = PLUGIN_DOMAIN

        def _run(self, q, k, v, g, beta, state, seq_starts, past_lens, slots, **kw):  # noqa: ANN001
            from engram_trt.builder.reference_linear_attention import gated_delta_net_reference

            o, new_state = gated_delta_net_reference(q, k, v, g, beta, state, seq_starts, past_lens, slots,
                                                     int(kw["l2norm_qk"]), float(kw["scale"]))
            return (np.asarray(o).astype(q.dtype), _in_place(state, new_state))

    class EngramQsaAttention(OpRun):
        op_domain = PLUGIN_DOMAIN

        def _run(self, q, k, v, index_q, index_raw, key_cache, value_cache, index_key_cache, index_k_norm_weight,  # noqa: ANN001
                 token_slot, token_pos, **kw):
            from engram_trt.builder.reference_qsa import qsa_attention_reference

            out, kc, vc, ikc = qsa_attention_reference(
                q, k, v, index_q, index_raw, key_cache, value_cache, index_key_cache, index_k_norm_weight, token_slot,
                token_pos, compress_ratio=int(kw["compress_ratio"]), block_topk=int(kw["block_topk"]),
                rot_dim=int(kw["rot_dim"]), rope_theta=float(kw["rope_theta"]), eps=float(kw["eps"]),
                scaling=float(kw["scaling"]))
            return (np.asarray(out).astype(q.dtype), _in_place(key_cache, kc), _in_place(value_cache, vc),
                    _in_place(index_key_cache, ikc))

    return [EngramPleHash, EngramPleFusion, EngramCausalConv1d, EngramGatedDeltaNet, EngramQsaAttention]


def _dsv4_ops() -> list[type]:
    """The OpRun of DeepSeek-V4's EngramDsv4Attention: builder/reference_dsv4_attention.py
    (float64 NumPy) over the node's 7 / 15 / 24 inputs; each state input is updated in
    place and returned as its aliased output."""
    from onnx.reference.op_run import OpRun

    class EngramDsv4Attention(OpRun):
        op_domain = PLUGIN_DOMAIN

        def _run(self, *inputs, **kw):  # noqa: ANN002, ANN003
            from engram_trt.builder.reference_dsv4_attention import dsv4_attention_reference_flat

            fields = {k: kw[k] for k in ("layer_type", "window", "compress_rate", "index_topk", "scaling", "eps",
                                         "rope_scale") if kw.get(k) is not None}
            out, *new_states = dsv4_attention_reference_flat(*inputs, **fields)  # checks the input count
            where = (6, 12, 13, 14, 21, 22, 23)[: len(new_states)]  # the state inputs, in output order
            return (np.asarray(out).astype(inputs[0].dtype),
                    *(_in_place(inputs[k], st) for k, st in zip(where, new_states)))

    return [EngramDsv4Attention]


def _routed_experts_ops() -> list[type]:
    """The OpRun of EngramRoutedExperts: :func:`routed_experts_reference` (float64)."""
    from onnx.reference.op_run import OpRun

    class EngramRoutedExperts(OpRun):
        op_domain = PLUGIN_DOMAIN

        def _run(self, x, ids, route_w, gate_w, gate_s, up_w, up_s, down_w, down_s, **kw):  # noqa: ANN001
            cache = self.__dict__.setdefault("_dequantized", {})  # the weights are the graph's constants
            key = tuple(id(a) for a in (gate_w, gate_s, up_w, up_s, down_w, down_s))
            if key not in cache:
                cache.clear()
                cache[key] = [dequantize_stored_experts(w, s_, kw) for w, s_ in ((gate_w, gate_s), (up_w, up_s),
                                                                                (down_w, down_s))]
            gate, up, down = cache[key]
            out = routed_experts_reference(x, ids, route_w, gate, up, down, float(kw["swiglu_limit"]))
            return (out.astype(x.dtype),)

    return [EngramRoutedExperts]


def dequantize_stored_experts(w: np.ndarray, scale: np.ndarray, fields: dict[str, Any]) -> np.ndarray:
    """One projection's stacked stored weights as EngramRoutedExperts takes them (int8
    bytes ``[E, N, K]`` e4m3 or ``[E, N, K/2]`` packed e2m1; scales ue8m0 bytes as int8,
    or float32, in ``block_n x block_k`` blocks) -> float64 ``[E, N, K]``, exactly
    (:mod:`engram_trt.quant.formats`)."""
    import torch

    from engram_trt.quant.formats import dequantize_fp4, dequantize_fp8

    data = torch.from_numpy(np.array(w, copy=True)).view(torch.uint8)
    s = np.ascontiguousarray(scale)
    st = torch.from_numpy(s.view(np.uint8).copy()).view(torch.float8_e8m0fnu) if s.dtype.itemsize == 1 \
        else torch.from_numpy(s.astype(np.float32))
    block = (int(fields["block_n"]), int(fields["block_k"]))
    if int(fields["w_type"]) == 1:
        return dequantize_fp4(data, st, block, torch.float64).numpy()
    return dequantize_fp8(data.view(torch.float8_e4m3fn), st, block, torch.float64).numpy()


def routed_experts_reference(x: np.ndarray, ids: np.ndarray, route_w: np.ndarray, gate: np.ndarray, up: np.ndarray,
                             down: np.ndarray, limit: float) -> np.ndarray:
    """The EngramRoutedExperts plugin's contract in float64 on dequantized weights (``gate`` /
    ``up [E, I, D]``, ``down [E, D, I]``): ``out[t] = sum_j route_w[t, j] * down_e(silu(min(g,
    l)) * clamp(u, -l, l))`` with ``g, u = gate_e x[t], up_e x[t]``, ``e = ids[t, j]``; a pick
    outside ``[0, E)`` adds nothing; ``limit`` 0: no clamp. The activations are not
    quantized: this is the stored format's product as transformers computes it on a CPU
    (the GPU kernels quantize them, docs/quantization.md)."""
    xf = np.asarray(x, dtype=np.float64)
    ids = np.asarray(ids, dtype=np.int64)
    w = np.asarray(route_w, dtype=np.float64)
    E = gate.shape[0]
    out = np.zeros_like(xf)
    for t in range(xf.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if not 0 <= e < E:
                continue
            g, u = gate[e] @ xf[t], up[e] @ xf[t]
            if limit > 0:
                g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
            out[t] += w[t, j] * (down[e] @ (g / (1.0 + np.exp(-g)) * u))
    return out


def ple_fusion_reference(streams: np.ndarray, key: np.ndarray, value: np.ndarray, norm_key_w: np.ndarray,
                         norm_query_w: np.ndarray, norm_conv_w: np.ndarray, conv_w: np.ndarray, conv_state: np.ndarray,
                         seq_starts: Any, past_lens: Any, slots: Any, *, hc_count: int, hidden: int, dilation: int,
                         eps: float) -> tuple[np.ndarray, np.ndarray]:
    """The EngramPleFusion plugin's contract in float64: :meth:`PLEFusion.forward_torch`
    (the module the plugin is tied to) run on the plugin's inputs, its two projections
    replaced by the slices of ``[key | value]``. Returns ``(update [T, W], new state)``."""
    from types import SimpleNamespace

    import torch

    from engram_trt.models.qwen4_exp.modules import PLEFusion

    W = hc_count * hidden
    cw = np.asarray(conv_w, dtype=np.float64).reshape(W, 1, -1)
    kernel = cw.shape[-1]
    cfg = SimpleNamespace(hc_count=hc_count, hidden_size=hidden, rms_norm_eps=eps,
                          ple=SimpleNamespace(ngram_size=dilation, conv_kernel_size=kernel, embed_dim=1))
    with torch.no_grad():
        m = PLEFusion(cfg).double()
        m.key_proj = _Columns(0, W)
        m.value_proj = _Columns(W, W + hidden)
        for mod, w in ((m.norm_key, norm_key_w), (m.norm_query, norm_query_w), (m.norm_conv, norm_conv_w)):
            mod.weight.copy_(torch.from_numpy(np.asarray(w, dtype=np.float64)))
        m.conv1d.weight.copy_(torch.from_numpy(cw))
        rows = torch.from_numpy(np.concatenate([np.asarray(key, np.float64), np.asarray(value, np.float64)], axis=1))
        state = torch.from_numpy(np.asarray(conv_state, dtype=np.float64).copy())
        out = m.forward_torch(torch.from_numpy(np.asarray(streams, np.float64)), rows,
                              [int(s) for s in np.asarray(seq_starts)], [int(p) for p in np.asarray(past_lens)],
                              [int(s) for s in np.asarray(slots)], state)
    return out.numpy(), state.numpy()


def _columns_module() -> type:
    import torch

    class Columns(torch.nn.Module):
        """Stands in for a projection: the columns ``[a, b)`` of its input."""

        def __init__(self, a: int, b: int) -> None:
            super().__init__()
            self.a, self.b = a, b

        def forward(self, x: "torch.Tensor") -> "torch.Tensor":
            return x[:, self.a:self.b]

    return Columns


def _Columns(a: int, b: int) -> Any:  # noqa: N802 - a class built on first use (torch imported lazily)
    return _columns_module()(a, b)


def _array(x: Any, name: str, dtype: Any, ndim: int) -> np.ndarray:
    """A NumPy array of ``dtype`` from a NumPy array, torch tensor or sequence."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        torch = None  # type: ignore[assignment]
    if torch is not None and isinstance(x, torch.Tensor):
        x = x.detach().to("cpu").numpy()
    arr = np.asarray(x)
    if arr.ndim != ndim:
        raise EngramError(f"{name} must be {ndim}-D (got shape {arr.shape})")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise EngramError(f"{name} must hold integers (got dtype {arr.dtype})")
    return np.ascontiguousarray(arr.astype(dtype))


def packed_step_feeds(input_ids: Any, seq_starts: Any, past_lens: Any, slots: Any, *, num_slots: int,
                      max_seq_len: int, vocab_size: int) -> tuple[dict[str, Any], tuple[np.ndarray, ...]]:
    """The four step inputs every exported serving step takes (int32), checked once for all
    the reference runners: ``(feeds, (ids, seq_starts, past_lens, slots))`` with the
    arrays as int64. Raises one line naming the bad input."""
    ids = _array(input_ids, "input_ids", np.int64, 1)
    starts = _array(seq_starts, "seq_starts", np.int64, 1)
    past = _array(past_lens, "past_lens", np.int64, 1)
    seq_slots = _array(slots, "slots", np.int64, 1)
    T, S = ids.shape[0], starts.shape[0] - 1
    if T < 1 or S < 1:
        raise EngramError(f"a step needs at least one token and one sequence (got {T} tokens, seq_starts {starts.tolist()})")
    lengths = np.diff(starts)
    if starts[0] != 0 or starts[-1] != T or np.any(lengths < 1):
        raise EngramError(f"seq_starts must rise from 0 to the step's {T} tokens, each sequence >= 1 token (got {starts.tolist()})")
    if past.shape != (S,) or seq_slots.shape != (S,):
        raise EngramError(f"past_lens and slots must be [S] = ({S},) (got {past.shape} and {seq_slots.shape})")
    if np.any(past < 0) or np.any(past + lengths > max_seq_len):
        raise EngramError(f"past_lens {past.tolist()} + new tokens {lengths.tolist()} must stay within max_seq_len {max_seq_len}")
    if np.any(seq_slots < 0) or np.any(seq_slots >= num_slots) or np.unique(seq_slots).size != S:
        raise EngramError(f"slots {seq_slots.tolist()} must be distinct and in [0, {num_slots})")
    if np.any(ids < 0) or np.any(ids >= vocab_size):
        raise EngramError(f"input_ids must be token ids in [0, {vocab_size}) (got {int(ids.min())}..{int(ids.max())})")
    feeds: dict[str, Any] = {"input_ids": ids.astype(np.int32), "seq_starts": starts.astype(np.int32),
                             "past_lens": past.astype(np.int32), "slots": seq_slots.astype(np.int32)}
    return feeds, (ids, starts, past, seq_slots)


def staged_rows_feeds(input_names: Any, engram_rows: Sequence[Any] | None) -> dict[str, np.ndarray]:
    """``engram_rows_{j}`` (bf16) for a prefetch graph, whose Engram layers take the
    staged rows as inputs; nothing for a graph that gathers them itself."""
    if not any(name.startswith("engram_rows_") for name in input_names):
        return {}
    if engram_rows is None:
        raise EngramError("a prefetch graph takes the staged rows: pass engram_rows (one [T, cols, head_dim] per Engram layer)")
    feeds = {}
    for j, rows in enumerate(engram_rows):
        if hasattr(rows, "detach"):
            rows = rows.detach().to("cpu").float().numpy()
        feeds[f"engram_rows_{j}"] = np.asarray(rows).astype(ml_dtypes.bfloat16)
    return feeds


class ReferenceRunner:
    """Runs the exported serving graph on the CPU, one packed step at a time, holding the
    KV caches ``[num_slots, kv_heads, max_seq_len, head_dim]`` of every layer (updated in
    place by the EngramAttention nodes) and each slot's Engram lookback, as a runtime does.

    ``tables``: per Engram layer ``(rows uint8 [R, hd] or bf16-as-uint16, scales uint8
    [R, hd/block] or None)`` (e.g. :meth:`Checkpoint.raw_rows_view`, no copy).
    """

    def __init__(self, exported: ExportedModel, config: ModelConfig, tables: Sequence[tuple[np.ndarray, np.ndarray | None]] = (),
                 compress_lookup: np.ndarray | None = None, *, num_slots: int = 4, max_seq_len: int | None = None) -> None:
        from onnx.reference import ReferenceEvaluator

        self.exported = exported
        self.config = config
        self.registry = TableRegistry()
        self.evaluator = ReferenceEvaluator(exported.model, new_ops=_reference_ops(self.registry))
        self.np_dtype = DTYPES[exported.dtype][1]
        self.lookup = None if compress_lookup is None else np.asarray(compress_lookup, dtype=np.int64)
        self.table_ptrs = np.asarray([self.registry.register(t) for t, _ in tables], dtype=np.int64)
        self.scale_ptrs = np.asarray([0 if s is None else self.registry.register(s) for _, s in tables], dtype=np.int64)
        self._tables = list(tables)  # keep the arrays (and their addresses) alive
        self.num_slots = int(num_slots)
        self.max_seq_len = int(max_seq_len or exported.io["max_position"])
        if self.num_slots < 1 or self.max_seq_len < 1:
            raise EngramError(f"a runner needs num_slots >= 1 and max_seq_len >= 1 (got {num_slots}, {max_seq_len})")
        if self.max_seq_len > exported.io["max_position"]:
            raise EngramError(f"max_seq_len {self.max_seq_len} exceeds the graph's rotary table ({exported.io['max_position']} positions)")
        shape = (self.num_slots, config.num_key_value_heads, self.max_seq_len, config.head_dim)
        self.key_cache = [np.zeros(shape, dtype=self.np_dtype) for _ in range(config.num_hidden_layers)]
        self.value_cache = [np.zeros(shape, dtype=self.np_dtype) for _ in range(config.num_hidden_layers)]
        self.lookback = np.full((self.num_slots, exported.io.get("lookback") or 0), -1, dtype=np.int32)

    def run(self, step: Any, *, engram_rows: Sequence[Any] | None = None) -> np.ndarray:
        """:meth:`step` on a :class:`~engram_trt.models.step.PackedStep` (the one step
        object every backend takes)."""
        return self.step(step.input_ids, step.seq_starts, step.past_lens, step.slots, step.lookback, step.engram_ids,
                         engram_rows=engram_rows)

    def step(self, input_ids: Any, seq_starts: Any, past_lens: Any, slots: Any, lookback: Any = None,
             engram_ids: Any = None, *, engram_rows: Sequence[Any] | None = None) -> np.ndarray:
        """One packed step (the PackedStep fields, NumPy arrays or torch tensors): the tokens
        ``input_ids [T]`` of S sequences back to back (``seq_starts [S+1]``), each after
        ``past_lens[s]`` cached tokens in KV slot ``slots[s]``; ``lookback [S, N-1]`` (None:
        each slot's own, kept from its previous steps; none for a sequence without past, so
        a slot needs no reset between sequences); ``engram_ids [T]`` overrides the
        compressed ids; ``engram_rows`` (prefetch graphs) per Engram layer ``[T, cols,
        head_dim]``. Returns the logits of each sequence's last token, ``[S, vocab]`` float32."""
        feeds, (ids, starts, past, seq_slots) = packed_step_feeds(
            input_ids, seq_starts, past_lens, slots, num_slots=self.num_slots, max_seq_len=self.max_seq_len,
            vocab_size=self.config.vocab_size)
        T, S = ids.shape[0], starts.shape[0] - 1
        for i in range(self.config.num_hidden_layers):
            feeds[f"key_cache_{i}"] = self.key_cache[i]
            feeds[f"value_cache_{i}"] = self.value_cache[i]
        names = set(self.exported.input_names)
        n = self.lookback.shape[1]
        cids = used_lookback = None
        if "engram_ids" in names:
            if engram_ids is None:
                if self.lookup is None:
                    raise EngramError("an Engram graph needs compressed ids: pass engram_ids or give the runner the compressed vocab")
                cids = self.lookup[ids]
            else:
                cids = _array(engram_ids, "engram_ids", np.int64, 1)
                if cids.shape != (T,):
                    raise EngramError(f"engram_ids must be [T] = ({T},) (got {cids.shape})")
            feeds["engram_ids"] = cids.astype(np.int32)
            if lookback is None:
                used_lookback = self.lookback[seq_slots].astype(np.int64)
                used_lookback[past == 0] = -1  # a sequence without past has nothing before it
            else:
                used_lookback = _array(lookback, "lookback", np.int64, 2)
                if used_lookback.shape != (S, n):
                    raise EngramError(f"lookback must be [S, N-1] = {(S, n)} (got {used_lookback.shape})")
        if "engram_lookback" in names:
            feeds["engram_lookback"] = used_lookback.astype(np.int32)
            feeds["engram_table_ptrs"] = self.table_ptrs
            feeds["engram_scale_ptrs"] = self.scale_ptrs
        feeds.update(staged_rows_feeds(names, engram_rows))
        results = self.evaluator.run(None, feeds)
        out = dict(zip(self.exported.output_names, results))
        for i in range(self.config.num_hidden_layers):
            # the aliased outputs are the caches themselves; adopt them should an executor copy
            self.key_cache[i] = out[f"key_cache_out_{i}"]
            self.value_cache[i] = out[f"value_cache_out_{i}"]
        if cids is not None and n:
            from engram_trt.engram.hashing import next_lookback

            for s in range(S):
                a, b = int(starts[s]), int(starts[s + 1])
                self.lookback[seq_slots[s]] = next_lookback(used_lookback[s], cids[a:b], n)
        return out["logits"]
