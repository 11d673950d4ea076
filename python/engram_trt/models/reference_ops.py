"""The CPU execution of an exported serving step, the pieces every architecture's shares:
``onnx.reference`` OpRuns of the plugin nodes more than one family's export emits (the
Engram mechanism's EngramHash / EngramGather / EngramGate, the routed experts'
EngramRoutedExperts), the :class:`TableRegistry` the tables are bound through by address,
:func:`in_place` (a state input updated in place, as the plugins alias it), and the step
inputs every runner feeds (:func:`packed_step_feeds`, :func:`staged_rows_feeds`).

An architecture's own plugin ops are in ``models/<arch>/reference_ops.py`` (its
:meth:`~engram_trt.models.base.ArchitectureBase.reference_ops`); all of them are bound
together by :func:`engram_trt.models.reference_executor.reference_ops`, and each family's
runner (``models/<arch>/reference_runner.py``) holds what a runtime holds between steps.
"""

from __future__ import annotations

from typing import Any, Sequence

import ml_dtypes
import numpy as np

from engram_trt.engram.layout import EngramLayout
from engram_trt.errors import EngramError
from engram_trt.models.export import FLOAT_TABLE_DTYPE_CODES, PLUGIN_DOMAIN, TABLE_DTYPE_CODES, decode_multipliers

# EngramGather's float table_dtype codes (models/export.FLOAT_TABLE_DTYPE_CODES) -> NumPy dtype.
_FLOAT_TABLE_NP = {
    FLOAT_TABLE_DTYPE_CODES["bf16"]: ml_dtypes.bfloat16,
    FLOAT_TABLE_DTYPE_CODES["fp16"]: np.float16,
    FLOAT_TABLE_DTYPE_CODES["fp32"]: np.float32,
}


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
            raise EngramError(
                f"table address {int(addr):#x} was never registered "
                "(feed the addresses TableRegistry.register returned)"
            ) from None


def engram_ops(registry: TableRegistry) -> list[type]:
    """OpRuns of the Engram mechanism's plugin nodes (EngramHash / EngramGather / EngramGate:
    the hashing, quant and fusion modules), the tables looked up in ``registry``."""
    from onnx.reference.op_run import OpRun

    from engram_trt.engram.fusion import engram_gate_reference
    from engram_trt.engram.hashing import hash_batch_packed
    from engram_trt.engram.quant import dequant_fp8_rows

    class EngramHash(OpRun):
        op_domain = PLUGIN_DOMAIN

        def _run(
            self,
            ids,
            seq_starts,
            lookback,
            plugin_version=None,
            plugin_namespace=None,
            n_layers=None,  # noqa: ANN001
            max_ngram_size=None,
            n_heads=None,
            pad_id=None,
            compressed_vocab_size=None,
            primes=None,
            offsets=None,
            multipliers=None,
        ):
            L, N, H = int(n_layers), int(max_ngram_size), int(n_heads)
            primes_a = np.asarray(primes, dtype=np.int64).reshape(L, N - 1, H)
            lay = EngramLayout(
                layer_ids=tuple(range(L)),
                max_ngram_size=N,
                n_heads=H,
                compressed_vocab_size=int(compressed_vocab_size),
                pad_id=int(pad_id),
                primes=primes_a,
                offsets=np.asarray(offsets, dtype=np.int64).reshape(L, -1),
                multipliers=decode_multipliers(multipliers).reshape(L, N),
                table_rows=primes_a.reshape(L, -1).sum(axis=1),
            )
            out = hash_batch_packed(ids, seq_starts, lookback, lay)
            return (out.astype(np.int32),)

    class EngramGather(OpRun):
        op_domain = PLUGIN_DOMAIN

        def _run(
            self,
            row_ids,
            table_ptr,
            scale_ptr=None,
            plugin_version=None,
            plugin_namespace=None,  # noqa: ANN001
            layer_index=None,
            n_layers=None,
            n_cols=None,
            head_dim=None,
            table_dtype=None,
            quant_block=None,
            num_rows=None,
            bad_rows_input=None,
            column_begin=None,
            column_end=None,
            row_offset=None,
        ):
            # The plugin's share fields (defaults: every column, the table from row 0): columns
            # [column_begin, column_end) of the ids, global row ids read from the table's rows
            # [row_offset, row_offset + num_rows); an id outside them gives a zero row.
            begin = 0 if column_begin is None else int(column_begin)
            end = int(n_cols) if column_end is None else int(column_end)
            offset = 0 if row_offset is None else int(row_offset)
            ids = np.asarray(row_ids)[:, int(layer_index), begin:end].astype(np.int64) - offset  # [T, cols]
            table = registry.lookup(int(np.asarray(table_ptr).reshape(-1)[0]))
            if table.shape[0] != int(num_rows):
                raise EngramError(
                    f"table at the given address has {table.shape[0]} rows, the graph expects {int(num_rows)}"
                )
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
                raise EngramError(
                    f"EngramGather table_dtype {int(table_dtype)} is not one of the plugin's "
                    f"(fp8 0, bf16 1, fp16 2, fp32 3)"
                )
            if table.dtype.itemsize != np.dtype(np_dt).itemsize:
                raise EngramError(
                    f"table at the given address is {table.dtype}, the graph's gather reads "
                    f"{np.dtype(np_dt).name} rows (table_dtype {int(table_dtype)})"
                )
            rows = table.view(np_dt)[ids]
            if rows.shape[-1] != int(head_dim):
                raise EngramError(
                    f"table at the given address has rows of {rows.shape[-1]}, the graph expects {int(head_dim)}"
                )
            return (np.where(inside[..., None], rows, np.zeros((), np_dt)),)

    class EngramGate(OpRun):
        op_domain = PLUGIN_DOMAIN

        def _run(
            self,
            hidden,
            kv,
            q_weight,
            k_weight,
            live,
            plugin_version=None,
            plugin_namespace=None,  # noqa: ANN001
            hc_mult=None,
            hidden_size=None,
            eps=None,
        ):
            out = engram_gate_reference(
                np.asarray(hidden, np.float32),
                np.asarray(kv, np.float32),
                np.asarray(q_weight, np.float32),
                np.asarray(k_weight, np.float32),
                np.asarray(live) != 0,
                float(eps),
            )
            return (out.astype(hidden.dtype),)

    return [EngramHash, EngramGather, EngramGate]


def in_place(state: np.ndarray, new: Any) -> np.ndarray:
    """Write a reference's new state into the state input itself (what the plugin's
    aliased output means) and return it."""
    np.copyto(state, np.asarray(new).astype(state.dtype, copy=False))
    return state


def routed_experts_ops() -> list[type]:
    """The OpRun of EngramRoutedExperts: :func:`routed_experts_reference` (float64)."""
    from onnx.reference.op_run import OpRun

    class EngramRoutedExperts(OpRun):
        op_domain = PLUGIN_DOMAIN

        def _run(self, x, ids, route_w, gate_w, gate_s, up_w, up_s, down_w, down_s, **kw):  # noqa: ANN001
            cache = self.__dict__.setdefault("_dequantized", {})  # the weights are the graph's constants
            key = tuple(id(a) for a in (gate_w, gate_s, up_w, up_s, down_w, down_s))
            if key not in cache:
                cache.clear()
                cache[key] = [
                    dequantize_stored_experts(w, s_, kw) for w, s_ in ((gate_w, gate_s), (up_w, up_s), (down_w, down_s))
                ]
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
    st = (
        torch.from_numpy(s.view(np.uint8).copy()).view(torch.float8_e8m0fnu)
        if s.dtype.itemsize == 1
        else torch.from_numpy(s.astype(np.float32))
    )
    block = (int(fields["block_n"]), int(fields["block_k"]))
    if int(fields["w_type"]) == 1:
        return dequantize_fp4(data, st, block, torch.float64).numpy()
    return dequantize_fp8(data.view(torch.float8_e4m3fn), st, block, torch.float64).numpy()


def routed_experts_reference(
    x: np.ndarray,
    ids: np.ndarray,
    route_w: np.ndarray,
    gate: np.ndarray,
    up: np.ndarray,
    down: np.ndarray,
    limit: float,
) -> np.ndarray:
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


def int_array(x: Any, name: str, dtype: Any, ndim: int) -> np.ndarray:
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


def packed_step_feeds(
    input_ids: Any, seq_starts: Any, past_lens: Any, slots: Any, *, num_slots: int, max_seq_len: int, vocab_size: int
) -> tuple[dict[str, Any], tuple[np.ndarray, ...]]:
    """The four step inputs every exported serving step takes (int32), checked once for all
    the reference runners: ``(feeds, (ids, seq_starts, past_lens, slots))`` with the
    arrays as int64. Raises one line naming the bad input."""
    ids = int_array(input_ids, "input_ids", np.int64, 1)
    starts = int_array(seq_starts, "seq_starts", np.int64, 1)
    past = int_array(past_lens, "past_lens", np.int64, 1)
    seq_slots = int_array(slots, "slots", np.int64, 1)
    T, S = ids.shape[0], starts.shape[0] - 1
    if T < 1 or S < 1:
        raise EngramError(
            f"a step needs at least one token and one sequence (got {T} tokens, seq_starts {starts.tolist()})"
        )
    lengths = np.diff(starts)
    if starts[0] != 0 or starts[-1] != T or np.any(lengths < 1):
        raise EngramError(
            f"seq_starts must rise from 0 to the step's {T} tokens, each sequence >= 1 token (got {starts.tolist()})"
        )
    if past.shape != (S,) or seq_slots.shape != (S,):
        raise EngramError(f"past_lens and slots must be [S] = ({S},) (got {past.shape} and {seq_slots.shape})")
    if np.any(past < 0) or np.any(past + lengths > max_seq_len):
        raise EngramError(
            f"past_lens {past.tolist()} + new tokens {lengths.tolist()} must stay within max_seq_len {max_seq_len}"
        )
    if np.any(seq_slots < 0) or np.any(seq_slots >= num_slots) or np.unique(seq_slots).size != S:
        raise EngramError(f"slots {seq_slots.tolist()} must be distinct and in [0, {num_slots})")
    if np.any(ids < 0) or np.any(ids >= vocab_size):
        raise EngramError(f"input_ids must be token ids in [0, {vocab_size}) (got {int(ids.min())}..{int(ids.max())})")
    feeds: dict[str, Any] = {
        "input_ids": ids.astype(np.int32),
        "seq_starts": starts.astype(np.int32),
        "past_lens": past.astype(np.int32),
        "slots": seq_slots.astype(np.int32),
    }
    return feeds, (ids, starts, past, seq_slots)


def staged_rows_feeds(input_names: Any, engram_rows: Sequence[Any] | None) -> dict[str, np.ndarray]:
    """``engram_rows_{j}`` (bf16) for a prefetch graph, whose Engram layers take the
    staged rows as inputs; nothing for a graph that gathers them itself."""
    if not any(name.startswith("engram_rows_") for name in input_names):
        return {}
    if engram_rows is None:
        raise EngramError(
            "a prefetch graph takes the staged rows: pass engram_rows (one [T, cols, head_dim] per Engram layer)"
        )
    feeds = {}
    for j, rows in enumerate(engram_rows):
        if hasattr(rows, "detach"):
            rows = rows.detach().to("cpu").float().numpy()
        feeds[f"engram_rows_{j}"] = np.asarray(rows).astype(ml_dtypes.bfloat16)
    return feeds
