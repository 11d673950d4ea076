"""Weights in the format the checkpoint stores them, in the exported serving graph (issue 40
item 3): what the three architectures' exports share for FP8 linears and FP4 / FP8 routed
experts. Nothing here materializes a dequantized weight as a float initializer.

* **FP8 linears** become ``DequantizeLinear`` of a ``FLOAT8E4M3FN`` initializer (the
  stored e4m3 bytes, ``[N, Kp]``) with a float32 scale ``[N, Kp / bk]`` (``axis=1``,
  ``block_size=bk``: each 128 x 128 block scale repeated over its block's rows, exact for
  ue8m0 powers of two and for float scales alike), then a Cast to the graph's dtype, a
  Transpose and the MatMul. TensorRT-RTX 1.7's ONNX parser takes exactly this form: a
  scale blocked on both axes (``[N/128, K/128]``) is refused ("only the quantization axis
  may differ"), and a quantization axis that does not divide into whole blocks of the
  scale's count is refused or, worse, read as blocks of ``K / count`` columns. A weight
  whose ``K`` is not a multiple of ``bk`` (a partial last block) is therefore stored with
  ``Kp = ceil(K / bk) * bk`` columns, the added ones zero bytes, and its activation is
  padded with as many zero columns (``Pad``): every product is the format's, exactly. The
  float32 scales add ``4 / bk`` bytes a value (3% at 128); the engine holds the e4m3
  bytes (TensorRT-RTX keeps the DQ's input constant and fuses the dequantization into
  the product). FP8 types compile for sm89 and later only (``engram-trt build`` picks
  those targets).
* **Routed experts stored FP4 (or FP8)** become one ``EngramRoutedExperts`` plugin node
  per MoE layer (plugins/engramRoutedExpertsPlugin): the step's activations, the routing
  ids and float32 weights the graph's router computes, and per projection the stacked
  stored bytes ``[E, N, K(/2)]`` and scales as INT8 initializers (TensorRT-RTX's parser
  widens a UINT8 initializer to INT32, four times its bytes; INT8 stays one byte), float32
  for float FP8 scales. FP8 experts the plugin cannot take (dims not multiples of 16, or
  blocks that differ in ``bk``) take the dense form with dequantized stacks instead.

:func:`export_source` turns what an export is handed (a Checkpoint's ``get``, a lazy
mapping, a dict) into the source the stored-format readers need (:class:`StoredTensors`:
``in``, item access and each tensor's stored dtype);
:func:`fp8_weight` / :func:`fp4_weight` read one stored weight with its scale as a
:class:`~engram_trt.quant.weight.QuantWeight`.
"""

from __future__ import annotations

from types import BuiltinMethodType, MethodType
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence, runtime_checkable

import ml_dtypes
import numpy as np

from engram_trt.errors import CheckpointError, EngramError
from engram_trt.models.export import PLUGIN_DOMAIN, PLUGIN_NAMESPACE, PLUGIN_VERSION

ROUTED_EXPERTS_PLUGIN = "EngramRoutedExperts"
# EngramRoutedExperts' w_type / scale_type fields (quantKernels.h EngramQuantWeightType / ScaleType).
W_TYPE_CODES = {"fp8": 0, "fp4": 1}
SCALE_TYPE_F32, SCALE_TYPE_UE8M0 = 0, 1
PLUGIN_MAX_EXPERTS = 4096  # engram_moe_plan's E
# Values per 16-byte vector of the kernels' rows: hidden, intermediate and bk must be multiples.
PLUGIN_MULTIPLE = {"fp8": 16, "fp4": 32}


# ------------------------------------------------------------------------------ sources
@runtime_checkable
class StoredTensors(Protocol):
    """What the stored-format readers read: ``name in src``, ``src[name]`` and
    ``src.stored_dtype(name)`` (from the shard header where the source knows it, no read).
    A checkpoint's lazy mapping (:class:`~engram_trt.checkpoint.checkpoint.LazyTensors`)
    implements it, as do :class:`ResolvedTensors` and the wrappers :func:`export_source`
    puts around a dict or a callable."""

    def __contains__(self, name: object) -> bool: ...

    def __getitem__(self, name: str) -> Any: ...

    def stored_dtype(self, name: str) -> Any: ...


@runtime_checkable
class LazySource(Protocol):
    """A checkpoint that hands its tensors out as a lazy :class:`StoredTensors` mapping
    (``Checkpoint``, ``ShardedCheckpoint``): an export handed its bound ``get`` reads that."""

    def lazy(self, names: Any = None) -> StoredTensors: ...


class _MappingTensors(Mapping[str, Any]):
    """A plain ``name -> tensor`` mapping (a dict) as :class:`StoredTensors`: a tensor's
    stored dtype is its own."""

    def __init__(self, src: Mapping[str, Any]) -> None:
        self._src = src

    def __getitem__(self, name: str) -> Any:
        return self._src[name]

    def __contains__(self, name: object) -> bool:
        return name in self._src

    def __iter__(self) -> Iterator[str]:
        return iter(self._src)

    def __len__(self) -> int:
        return len(self._src)

    def stored_dtype(self, name: str) -> Any:
        return self._src[name].dtype


class _CallableTensors(Mapping[str, Any]):
    """A ``name -> tensor`` callable seen as a mapping (``in`` tries the call)."""

    def __init__(self, get: Callable[[str], Any]) -> None:
        self._get = get

    def __getitem__(self, name: str) -> Any:
        try:
            return self._get(name)
        except (KeyError, EngramError):
            raise KeyError(name) from None

    def __contains__(self, name: object) -> bool:
        try:
            self._get(name)  # type: ignore[arg-type]
        except (KeyError, EngramError):
            return False
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0

    def stored_dtype(self, name: str) -> Any:
        return self[name].dtype


def export_source(weights: Any) -> StoredTensors:
    """The tensors an export reads, as :class:`StoredTensors`: ``weights`` itself when it
    is one (``Checkpoint.lazy()``), the source of an :class:`ExportTensors`, the
    checkpoint's lazy mapping for a bound ``Checkpoint.get`` (a :class:`LazySource`'s), a
    mapping (a dict, or the dict of a bound ``dict.get``) wrapped, else the callable wrapped."""
    if isinstance(weights, StoredTensors):
        return weights
    if isinstance(weights, Mapping):
        return _MappingTensors(weights)
    if isinstance(weights, ExportTensors):
        return weights.src
    owner = weights.__self__ if isinstance(weights, (MethodType, BuiltinMethodType)) else None
    if isinstance(owner, LazySource):
        return owner.lazy()
    if isinstance(owner, Mapping):
        return _MappingTensors(owner)
    if callable(weights):
        return _CallableTensors(weights)
    raise EngramError(f"weights must be a mapping or a name -> tensor callable (got {type(weights).__name__})")


class ExportTensors:
    """``name -> tensor`` for an export (a missing name: one line saying the checkpoint
    does not match its config), over :func:`export_source`'s mapping (``.src``), which the
    stored-format readers take."""

    def __init__(self, weights: Any) -> None:
        self.src = export_source(weights)

    def __call__(self, name: str) -> Any:
        try:
            return self.src[name]
        except KeyError:
            raise EngramError(f"weights lack tensor '{name}' (the checkpoint does not match its config.json)") from None

    def __contains__(self, name: object) -> bool:
        return name in self.src


def stored_dtype(src: StoredTensors, name: str) -> Any:
    """``src[name]``'s dtype, from the shard header where ``src`` knows it (no read)."""
    return src.stored_dtype(name)


class ResolvedTensors(Mapping[str, Any]):
    """``src`` read under canonical names: ``names`` maps each canonical name (a weight's
    scale under its canonical ``.weight_scale_inv``) to the name the checkpoint stores
    it under (DeepSeek's root spelling or ``.scale``); other names pass through."""

    def __init__(self, src: StoredTensors, names: Mapping[str, str]) -> None:
        self._src = src
        self._names = dict(names)

    def _stored(self, name: str) -> str:
        return self._names.get(name, name)

    def __getitem__(self, name: str) -> Any:
        return self._src[self._stored(name)]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._stored(name) in self._src

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def stored_dtype(self, name: str) -> Any:
        return self._src.stored_dtype(self._stored(name))


# ------------------------------------------------------------------------------ readers
def _scale_of(src: Mapping[str, Any], name: str) -> tuple[str, Any] | None:
    from engram_trt.models.engram_llama.weights import stored_scale
    from engram_trt.quant.names import find_scale

    scale_name = find_scale(name, src)
    return None if scale_name is None else (scale_name, stored_scale(src, scale_name))


def fp8_weight(
    src: Mapping[str, Any],
    name: str,
    quant: Any,
    *,
    scale: tuple[str, Any] | None = None,
    block: tuple[int, int] | None = None,
) -> Any:
    """The stored FP8 weight ``name`` with its block scales as a QuantWeight (its own
    ``.weight_scale_inv`` / ``.scale``, or ``scale`` = (name, tensor) in ``block`` where an
    architecture keeps them elsewhere), None when ``name`` is stored in a float dtype.
    The build's check phase has held every weight to its config; a scale that still does
    not fit is one line naming the tensor."""
    import torch

    from engram_trt.quant.weight import QuantWeight, check_quant_tensors

    if stored_dtype(src, name) != torch.float8_e4m3fn:
        return None
    if quant is None:
        raise CheckpointError(f"tensor {name} is F8_E4M3 but the config declares no quantization_config")
    data = src[name]
    shape = tuple(int(d) for d in data.shape)
    block = block or quant.block_for(shape)
    found = scale if scale is not None else _scale_of(src, name)
    problem = check_quant_tensors(name, "fp8", shape, shape, None if found is None else tuple(found[1].shape), block)
    if problem is not None:
        raise CheckpointError(problem)
    return QuantWeight(data, found[1], "fp8", (int(block[0]), int(block[1])))  # type: ignore[index]


def fp4_weight(src: Mapping[str, Any], name: str) -> Any:
    """The stored FP4 weight ``name`` (packed int8 / uint8 bytes ``[N, K/2]``, ue8m0 scales
    ``[N, K/32]`` beside it) as a QuantWeight, None when it is stored in a float dtype."""
    import torch

    from engram_trt.quant.spec import FP4_GROUP
    from engram_trt.quant.weight import QuantWeight, check_quant_tensors

    if stored_dtype(src, name) not in (torch.int8, torch.uint8):
        return None
    data = src[name]
    found = _scale_of(src, name)
    if found is not None and found[1].dtype == torch.uint8:
        found = (found[0], found[1].view(torch.float8_e8m0fnu))
    shape = (int(data.shape[0]), 2 * int(data.shape[1]))
    scale_shape = None if found is None else tuple(found[1].shape)
    problem = check_quant_tensors(name, "fp4", shape, tuple(data.shape), scale_shape, (1, FP4_GROUP))
    if problem is not None:
        raise CheckpointError(problem)
    return QuantWeight(data.view(torch.int8), found[1], "fp4", (1, FP4_GROUP))  # type: ignore[index]


# ------------------------------------------------------------------------------ FP8 in the graph
def _e4m3_bytes(qw: Any) -> np.ndarray:
    import torch

    return qw.data.detach().to("cpu").contiguous().view(torch.uint8).numpy()


def _row_scales(qw: Any) -> np.ndarray:
    """``qw``'s block scales as float32 ``[N, ceil(K / bk)]``: each block row's repeated
    over its rows (ue8m0 decoded exactly)."""
    from engram_trt.quant.formats import scale_to_float

    import torch

    s = scale_to_float(qw.scale.detach().to("cpu"), torch.float32)
    s = s.repeat_interleave(int(qw.block[0]), dim=-2)[..., : qw.out_features, :]
    return np.ascontiguousarray(s.numpy().astype(np.float32))


def padded_k(k: int, bk: int) -> int:
    """``k`` rounded up to whole blocks of ``bk``."""
    return -(-int(k) // int(bk)) * int(bk)


def fp8_matrix(parts: Sequence[Any], along: str = "rows") -> tuple[np.ndarray, np.ndarray, int]:
    """FP8 weights ``[N_i, K_i]`` (one ``bk``) as one e4m3 byte matrix and its per-row
    float32 scales, ``(bytes uint8 [N, Kp], scales [N, Kp / bk], bk)``: stacked along
    ``rows`` (one K, padded to whole blocks) or ``cols`` (one N; each part's K padded to
    whole blocks, so each keeps its own blocks)."""
    bks = {int(p.block[1]) for p in parts}
    if len(bks) != 1:
        raise EngramError(f"internal: FP8 weights of one stack have blocks of {sorted(bks)} columns")
    bk = bks.pop()
    blocks, scales = [], []
    for p in parts:
        data = _e4m3_bytes(p)
        n, k = data.shape
        kp = padded_k(k, bk)
        if kp > k:
            data = np.concatenate([data, np.zeros((n, kp - k), np.uint8)], axis=1)  # e4m3 byte 0 is +0
        blocks.append(data)
        scales.append(_row_scales(p))
    if along == "rows":
        if len({b.shape[1] for b in blocks}) != 1:
            raise EngramError("internal: FP8 weights stacked by rows differ in their columns")
        return np.ascontiguousarray(np.concatenate(blocks, 0)), np.ascontiguousarray(np.concatenate(scales, 0)), bk
    if len({b.shape[0] for b in blocks}) != 1:
        raise EngramError("internal: FP8 weights stacked by columns differ in their rows")
    return np.ascontiguousarray(np.concatenate(blocks, 1)), np.ascontiguousarray(np.concatenate(scales, 1)), bk


def dequantized_t(g: Any, key: str, data: np.ndarray, scale: np.ndarray, bk: int, elem: int) -> str:
    """``DequantizeLinear(e4m3 [N, Kp], scale [N, Kp/bk], axis=1, block_size=bk)`` cast to
    ``elem`` and transposed: the ``[Kp, N]`` right operand of a MatMul."""
    from onnx import TensorProto

    w = g.const(f"{key}.e4m3", data.view(ml_dtypes.float8_e4m3fn))
    s = g.const(f"{key}.e4m3_scale", scale)
    deq = g.op("DequantizeLinear", [w, s], "fp8_deq", axis=1, block_size=int(bk))
    if elem != TensorProto.FLOAT:
        deq = g.op("Cast", [deq], "fp8_deq_cast", to=elem)
    return g.op("Transpose", [deq], "fp8_deq_t", perm=[1, 0])


def pad_columns(g: Any, x: str, pad: int, hint: str = "pad_k", rank: int = 2) -> str:
    """``x [..., K]`` (``rank`` dims) with ``pad`` zero columns appended to its last axis."""
    if pad <= 0:
        return x
    pads = [0] * (2 * rank)
    pads[-1] = int(pad)
    return g.op("Pad", [x, g.ints(pads)], hint, mode="constant")


def row_slice(qw: Any, r0: int, r1: int) -> Any:
    """Rows ``[r0, r1)`` of an FP8 weight, its scales spread over the rows (block ``(1, bk)``,
    float32): a slice that need not start on a block row."""
    import torch

    from engram_trt.quant.weight import QuantWeight

    scale = torch.from_numpy(_row_scales(qw)[r0:r1].copy())
    return QuantWeight(qw.data[r0:r1], scale, "fp8", (1, int(qw.block[1])))


def quant_matmul(g: Any, x: str, key: str, qw: Any, elem: int, hint: str) -> str:
    """``x [M, K] @ W^T`` of a stored FP8 weight (module docstring): the graph's dtype out."""
    if qw.kind != "fp8":
        raise EngramError(f"internal: a {qw.kind} weight ({key}) reached a linear; FP4 is served for routed experts")
    data, scale, bk = fp8_matrix([qw])
    wt = dequantized_t(g, key, data, scale, bk, elem)
    return g.op("MatMul", [pad_columns(g, x, data.shape[1] - qw.in_features), wt], hint)


# ------------------------------------------------------------------------------ routed experts
def routed_experts_unavailable(gate: Sequence[Any], up: Sequence[Any], down: Sequence[Any]) -> str | None:
    """Why the EngramRoutedExperts plugin cannot take these per-expert weights (None: it
    can): one kind (fp4 / fp8) for all, hidden / intermediate / bk multiples of the
    kernels' 16-byte vectors, one bk and one scale dtype."""
    import torch

    every = [*gate, *up, *down]
    if any(w is None for w in every):
        return "not every routed expert weight is stored FP8 / FP4"
    kinds = {w.kind for w in every}
    if len(kinds) != 1:
        return f"the routed experts mix {sorted(kinds)} weights"
    kind = kinds.pop()
    if len(gate) > PLUGIN_MAX_EXPERTS:
        return f"{len(gate)} experts (the plugin's plan takes at most {PLUGIN_MAX_EXPERTS})"
    D, I = gate[0].in_features, gate[0].out_features
    m = PLUGIN_MULTIPLE[kind]
    if D % m or I % m:
        return f"hidden {D} and intermediate {I} must be multiples of {m} for {kind} experts"
    bks = {int(w.block[1]) for w in every}
    if len(bks) != 1 or next(iter(bks)) % m:
        return f"the experts' scale blocks ({sorted(bks)} columns) must be one multiple of {m}"
    fmts = {w.scale.dtype in (torch.float8_e8m0fnu, torch.uint8) for w in every}
    if len(fmts) != 1:
        return "the experts' scales mix float32 and ue8m0"
    return None


def _stack_int8(parts: Sequence[Any]) -> np.ndarray:
    import torch

    return np.ascontiguousarray(
        np.stack([p.data.detach().to("cpu").contiguous().view(torch.int8).numpy() for p in parts])
    )


def _stack_scales(parts: Sequence[Any], per_row: bool) -> np.ndarray:
    """The experts' scales stacked ``[E, ...]``: ue8m0 bytes as int8, float32 as float32;
    ``per_row``: spread over the rows (``bn`` 1)."""
    import torch

    out = []
    for p in parts:
        s = p.scale.detach().to("cpu").contiguous()
        s = s.view(torch.int8) if s.dtype in (torch.float8_e8m0fnu, torch.uint8) else s.to(torch.float32)
        if per_row:
            s = s.repeat_interleave(int(p.block[0]), dim=-2)[: p.out_features]
        out.append(s.numpy())
    return np.ascontiguousarray(np.stack(out))


def routed_experts(
    g: Any,
    x: str,
    ids: str,
    route_w: str,
    key: str,
    gate: Sequence[Any],
    up: Sequence[Any],
    down: Sequence[Any],
    *,
    top_k: int,
    limit: float,
    hint: str = "routed_experts",
) -> str:
    """One EngramRoutedExperts node: ``x [T, D]`` (the graph's dtype), ``ids [T, k]`` int32 /
    int64, ``route_w [T, k]`` float32, and the experts' stored weights
    (:func:`routed_experts_unavailable` says None) -> ``[T, D]`` in x's dtype:
    ``sum_j route_w[t, j] * down_e(silu(min(g, l)) * clamp(u, -l, l))``, ``l = limit`` (0:
    no clamp)."""
    import torch

    why = routed_experts_unavailable(gate, up, down)
    if why is not None:
        raise EngramError(f"internal: EngramRoutedExperts cannot take {key}: {why}")
    first = gate[0]
    blocks = {tuple(int(b) for b in w.block) for w in (*gate, *up, *down)}
    per_row = len(blocks) != 1  # differing row blocks: every scale spread over its rows (bn 1)
    bn, bk = (1, int(first.block[1])) if per_row else blocks.pop()
    ue8m0 = first.scale.dtype in (torch.float8_e8m0fnu, torch.uint8)
    inputs = [x, ids, route_w]
    for proj, parts in (("gate", gate), ("up", up), ("down", down)):
        inputs.append(g.const(f"{key}.{proj}.stored", _stack_int8(parts)))
        inputs.append(g.const(f"{key}.{proj}.stored_scale", _stack_scales(parts, per_row)))
    fields = {
        "plugin_version": PLUGIN_VERSION,
        "plugin_namespace": PLUGIN_NAMESPACE,
        "num_experts": len(gate),
        "top_k": int(top_k),
        "hidden": int(first.in_features),
        "intermediate": int(first.out_features),
        "w_type": W_TYPE_CODES[first.kind],
        "scale_type": SCALE_TYPE_UE8M0 if ue8m0 else SCALE_TYPE_F32,
        "block_n": int(bn),
        "block_k": int(bk),
        "swiglu_limit": float(limit),
    }
    return g.op(ROUTED_EXPERTS_PLUGIN, inputs, hint, domain=PLUGIN_DOMAIN, **fields)
