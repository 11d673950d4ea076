"""The serving graph's contract, shared by every architecture's ONNX export: the plugin
nodes' domain, namespace and names, the dtypes, the export options (compute dtype,
where the Engram lookup runs), the exported model and how plugin fields carry the hash
multipliers. An architecture's ``onnx_export`` builds its graph on these; the builder
and its reference executor read them without knowing the architecture."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from onnx import TensorProto

from engram_trt.errors import EngramError

OPSET = 23
PLUGIN_DOMAIN = "trt.plugins"
PLUGIN_VERSION = "1"
PLUGIN_NAMESPACE = "engram_trt"  # the creators' namespace; the ONNX parser reads it from the node attribute
PLUGIN_NAMES = ("EngramHash", "EngramGather", "EngramGate", "EngramAttention")
ATTENTION_PLUGIN = "EngramAttention"
PLE_HASH_PLUGIN = "EngramPleHash"  # one Qwen4-Exp PLE layer's n-gram hash (plugins/engramPleHashPlugin)
PLACEMENTS = ("in_engine", "prefetch")
EXTERNAL_DATA_THRESHOLD = 1_800_000_000  # protobuf's hard limit is 2 GiB
EXTERNAL_DATA_NAME = "model.onnx.data"

# --dtype spelling -> (ONNX element type, NumPy dtype, torch dtype name)
DTYPES: dict[str, tuple[int, Any, str]] = {
    "bf16": (TensorProto.BFLOAT16, ml_dtypes.bfloat16, "bfloat16"),
    "fp16": (TensorProto.FLOAT16, np.float16, "float16"),
    "fp32": (TensorProto.FLOAT, np.float32, "float32"),
}
DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}

# Element types the Engram plugins accept for their floating-point tensors. The
# gather kernel produces bf16 rows from the Engram tables (fp8 or bf16; float PLE tables
# come out in their own dtype, FLOAT_TABLE_DTYPE_CODES); the gate takes hidden/kv/out in any of
# GATE_IO_DTYPES (one type per node, fp32 math inside), so a graph of one of these
# dtypes feeds it directly, and the exporter casts around it for any other dtype.
GATE_IO_DTYPES = ("bf16", "fp16", "fp32")
GATHER_OUT_DTYPE = "bf16"
# EngramGather field ``table_dtype`` (EngramTableDtype in plugins/kernels/engramKernels.h).
TABLE_DTYPE_CODES = {"fp8": 0, "bf16": 1}
# The float tables EngramGather reads (any row width): its output is the table's dtype
# (fp8 rows come out bf16). An Engram model's tables are TABLE_DTYPE_CODES' (its gate
# reads bf16 rows); a PLE table may be any of these.
FLOAT_TABLE_DTYPE_CODES = {"bf16": 1, "fp16": 2, "fp32": 3}


def normalize_dtype(dtype: str) -> str:
    d = DTYPE_ALIASES.get(str(dtype).lower(), str(dtype).lower())
    if d not in DTYPES:
        raise EngramError(f"--dtype {dtype!r} is not supported (expected one of {', '.join(DTYPES)})")
    return d


@dataclass(frozen=True)
class ExportOptions:
    """What shapes the graph besides the model: the compute dtype, the rotary table's
    length, and where the Engram lookup runs (``in_engine``: hash + gather plugins;
    ``prefetch``: the runtime hands staged rows ``engram_rows_j [T, cols, head_dim]``
    bf16 as inputs and only the gate plugin remains)."""

    dtype: str = "bf16"
    max_position: int | None = None  # rotary cache rows (default: max_position_embeddings)
    placement: str = "in_engine"
    table_dtype: str | None = None  # the tables' storage as bound at run time (default: the config's)
    table_rows: tuple[int, ...] | None = None  # rows of each table (default: the layout's)
    # None: the graph's dtype where the EngramGate plugin takes it (GATE_IO_DTYPES, no
    # casts), else GATE_IO_DTYPES[0] with casts around the gate. A dtype names the gate's
    # I/O type explicitly (e.g. "bf16" in a float32 graph, casts around it); it must be
    # one of GATE_IO_DTYPES.
    gate_dtype: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        if self.gate_dtype is not None:
            object.__setattr__(self, "gate_dtype", normalize_dtype(self.gate_dtype))
            if self.gate_dtype not in GATE_IO_DTYPES:
                raise EngramError(
                    f"gate dtype {self.gate_dtype!r} is not one the EngramGate plugin takes "
                    f"({', '.join(GATE_IO_DTYPES)})"
                )
        if self.placement not in PLACEMENTS:
            raise EngramError(f"Engram placement {self.placement!r} is not one of {', '.join(PLACEMENTS)}")


@dataclass
class ExportedModel:
    """The model proto plus what a runtime needs to feed it."""

    model: Any  # onnx.ModelProto
    input_names: list[str]
    output_names: list[str]
    num_layers: int
    engram_layers: int
    dtype: str
    initializer_bytes: int
    io: dict[str, Any] = field(default_factory=dict)

    def save(self, path: str | Path) -> list[Path]:
        """Write ``model.onnx`` (and ``model.onnx.data`` beside it when the weights pass
        the 2 GiB protobuf limit); returns the files written."""
        import onnx

        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        data = p.parent / EXTERNAL_DATA_NAME
        if data.exists():
            data.unlink()
        if self.initializer_bytes > EXTERNAL_DATA_THRESHOLD:
            onnx.save_model(
                self.model,
                str(p),
                save_as_external_data=True,
                all_tensors_to_one_file=True,
                location=EXTERNAL_DATA_NAME,
                size_threshold=1024,
            )
            return [p, data]
        p.write_bytes(self.model.SerializeToString(deterministic=True))
        return [p]


def encode_multipliers(multipliers: np.ndarray) -> dict[str, str]:
    """The hash multipliers as one node attribute: a STRING of comma-separated decimals.

    They are int64 values up to ~2^62, but the ONNX parser hands an INTS attribute to a
    plugin as int32 whatever type the creator declares (measured with TensorRT-RTX 1.7:
    2^40+5 arrives as 5), and a TENSOR attribute arrives with an unusable field type. A
    STRING attribute arrives as a kCHAR field, byte for byte; the EngramHash creator
    parses int64 fields from decimal text (and refuses int32-narrowed ones). Primes and
    offsets need no such care: the layout keeps every row id below 2^31.
    """
    flat = np.asarray(multipliers, dtype=np.int64).reshape(-1)
    return {"multipliers": ",".join(str(int(v)) for v in flat)}


def decode_multipliers(value: Any) -> np.ndarray:
    """Inverse of :func:`encode_multipliers` (the reference executor's side)."""
    if isinstance(value, bytes):
        value = value.decode("ascii")
    if isinstance(value, str):
        return np.asarray([int(v) for v in value.replace(" ", "").split(",") if v], dtype=np.int64)
    return np.asarray(value, dtype=np.int64)


def ple_hash_plugin_attributes(layout: Any, layer: int) -> dict[str, Any]:
    """The EngramPleHash node's attributes for PLE layer ``layer`` of a
    :class:`~engram_trt.engram.ple_hash.PLEHashLayout`: one node per PLE layer (each
    layer's rows feed its own table). The multipliers travel as decimal text
    (:func:`encode_multipliers`: the parser would narrow INTS to int32); primes and
    offsets as INTS, which int32 holds (the creator bounds every row by ``table_rows``
    < 2^31)."""
    if not 0 <= int(layer) < layout.num_layers:
        raise EngramError(f"PLE layer {layer} is outside [0, {layout.num_layers}): pass an index into ple_layer_ids")
    return {
        "plugin_version": PLUGIN_VERSION,
        "plugin_namespace": PLUGIN_NAMESPACE,
        "ngram_size": int(layout.ngram_size),
        "heads_per_ngram": int(layout.heads_per_ngram),
        "eos_id": int(layout.eos_id),
        "vocab_size": int(layout.vocab_size),
        "table_rows": int(layout.table_rows[layer]),
        **encode_multipliers(layout.multipliers[layer]),
        "primes": [int(v) for v in layout.head_vocab_sizes[layer]],
        "offsets": [int(v) for v in layout.head_offsets[layer]],
    }
