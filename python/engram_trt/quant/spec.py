"""A checkpoint's ``quantization_config`` (and DeepSeek-V4's top-level ``expert_dtype``),
read into :class:`QuantSpec`: the one reader of those fields for every architecture.

Served: ``quant_method: "fp8"`` -- fine-grained FP8 (E4M3 weights with one scale per
``weight_block_size`` block, scales ``float`` or ``ue8m0``, under ``<name>.scale`` or
``<name>.weight_scale_inv``), dynamic activations, ``modules_to_not_convert`` (alias
``ignored_layers``) kept in 16 bits, and routed experts in FP8 or FP4 E2M1
(``expert_dtype``, inside the config or at its top level as DeepSeek-V4 ships it). Every
other method or value is refused in one line naming the field and what is served
(docs/quantization.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from engram_trt.errors import ConfigError

SERVED_METHODS = ("fp8",)
SCALE_FMTS = ("float", "ue8m0")
EXPERT_DTYPES = ("fp8", "fp4")
# Keys of a fine-grained FP8 quantization_config that change nothing at inference here
# (transformers' bookkeeping: ``dequantize`` is a load switch of its own).
_NEUTRAL_KEYS = frozenset(
    {
        "quant_method",
        "fmt",
        "activation_scheme",
        "weight_block_size",
        "scale_fmt",
        "modules_to_not_convert",
        "ignored_layers",
        "expert_dtype",
        "dequantize",
        "modules_to_convert",
        "_load_in_8bit",
        "_load_in_4bit",
    }
)
FP4_GROUP = 32  # one scale per 32 inputs of a row (checkpoint-formats note)


@dataclass(frozen=True)
class QuantSpec:
    """What a checkpoint declares of its stored weight formats (module docstring)."""

    method: str = "fp8"
    fmt: str = "e4m3"
    block: tuple[int, int] | None = (128, 128)  # (rows, cols) of a scale block; None: one scale per tensor
    scale_fmt: str = "float"
    activation_scheme: str = "dynamic"
    modules_to_not_convert: tuple[str, ...] = ()
    modules_to_convert: tuple[str, ...] = ()
    expert_dtype: str = "fp8"

    def block_for(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """The (rows, cols) block of an FP8 weight of ``shape`` ``[..., N, K]``."""
        if self.block is None:
            return int(shape[-2]), int(shape[-1])
        return self.block

    def listed(self, module_name: str) -> str | None:
        """The ``modules_to_not_convert`` entry that keeps ``module_name`` in 16 bits (None:
        none), by transformers' rule (``should_convert_module``): an entry matches as a regex
        from the start of the name up to a module boundary (``layers.1`` matches
        ``layers.1.mlp``, not ``layers.11``; ``mlp.gate`` not ``mlp.gate_proj``), or as a
        suffix of the name."""
        import re

        for key in self.modules_to_not_convert:
            try:
                if re.match(rf"(?:{key})(?:(?<=\.)|(?=\.|$))", module_name):
                    return key
            except re.error:
                pass
            if module_name.endswith(key):
                return key
        return None

    def not_converted(self, module_name: str) -> bool:
        """Whether ``module_name`` is listed to stay in 16 bits (:meth:`listed`)."""
        return self.listed(module_name) is not None

    def describe(self) -> str:
        block = "per tensor" if self.block is None else f"{self.block[0]}x{self.block[1]} blocks"
        return f"fp8 e4m3 ({block}, {self.scale_fmt} scales, dynamic activations), experts {self.expert_dtype}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "quant_method": self.method,
            "fmt": self.fmt,
            "activation_scheme": self.activation_scheme,
            "weight_block_size": None if self.block is None else list(self.block),
            "scale_fmt": self.scale_fmt,
            "modules_to_not_convert": list(self.modules_to_not_convert) or None,
            "expert_dtype": self.expert_dtype,
        }


def _where(source: str | None) -> str:
    return f"{source}: " if source else "config: "


def _str_list(value: Any, field: str, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ConfigError(
            f"{where}field 'quantization_config.{field}' must be a list of module names (got {value!r:.80})"
        )
    return tuple(value)


def read_quant_spec(d: Mapping[str, Any], source: str | None = None) -> QuantSpec | None:
    """The :class:`QuantSpec` of a config.json dict, None when it declares no quantization;
    an unserved method or value is refused in one line (:class:`ConfigError`)."""
    where = _where(source)
    qc = d.get("quantization_config")
    top_expert = d.get("expert_dtype")
    if qc is None:
        if top_expert is None:
            return None
        raise ConfigError(
            f"{where}field 'expert_dtype'={top_expert!r} is set but 'quantization_config' is absent: "
            f"FP4 / FP8 experts come with an FP8 quantization_config (quant_method \"fp8\"); add it, "
            f"or remove expert_dtype if the experts are stored in 16 bits"
        )
    if not isinstance(qc, Mapping):
        raise ConfigError(f"{where}field 'quantization_config' must be an object (got {qc!r:.80})")
    method = qc.get("quant_method")
    if not isinstance(method, str):
        raise ConfigError(
            f"{where}field 'quantization_config.quant_method' is missing or not a string (got "
            f"{method!r:.40}); engram-trt serves quant_method \"fp8\" (fine-grained FP8, FP4 experts)"
        )
    if method.lower() not in SERVED_METHODS:
        raise ConfigError(
            f"{where}field 'quantization_config.quant_method'={method!r} is not served by engram-trt "
            f"(served: \"fp8\": fine-grained FP8 E4M3 with block scales, routed experts FP8 or FP4 "
            f"E2M1); serve an FP8 release of the model, or its 16-bit weights"
        )
    fmt = qc.get("fmt", "e4m3")
    if fmt not in ("e4m3", "float8_e4m3fn"):
        raise ConfigError(f"{where}field 'quantization_config.fmt'={fmt!r} is not served (supported: \"e4m3\")")
    scheme = str(qc.get("activation_scheme", "dynamic")).lower()
    if scheme != "dynamic":
        raise ConfigError(
            f"{where}field 'quantization_config.activation_scheme'={qc.get('activation_scheme')!r} is "
            f"not served (supported: \"dynamic\": activations quantized per token and 128 columns at run "
            f"time; static activation scales are not read)"
        )
    raw_block = qc.get("weight_block_size", [128, 128])
    block: tuple[int, int] | None
    if raw_block is None:
        block = None
    else:
        if (
            not isinstance(raw_block, (list, tuple))
            or len(raw_block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in raw_block)
        ):
            raise ConfigError(
                f"{where}field 'quantization_config.weight_block_size' must be two positive ints such as "
                f"[128, 128] (got {raw_block!r:.80})"
            )
        block = (int(raw_block[0]), int(raw_block[1]))
    scale_fmt = qc.get("scale_fmt", "float")
    if scale_fmt not in SCALE_FMTS:
        raise ConfigError(
            f"{where}field 'quantization_config.scale_fmt'={scale_fmt!r} is not served (supported: "
            f"\"float\" (float32 scales) or \"ue8m0\" (one power-of-two byte per block))"
        )
    inner_expert = qc.get("expert_dtype")
    if inner_expert is not None and top_expert is not None and inner_expert != top_expert:
        raise ConfigError(
            f"{where}'expert_dtype'={top_expert!r} at the top level contradicts "
            f"'quantization_config.expert_dtype'={inner_expert!r}; keep one"
        )
    expert = inner_expert if inner_expert is not None else (top_expert if top_expert is not None else "fp8")
    if expert not in EXPERT_DTYPES:
        raise ConfigError(
            f"{where}field 'expert_dtype'={expert!r} is not served (supported: \"fp8\" or \"fp4\" "
            f"(e2m1, two values a byte, one ue8m0 scale per 32 inputs))"
        )
    not_convert = qc.get("modules_to_not_convert")
    if not_convert is None:
        not_convert = qc.get("ignored_layers")
    return QuantSpec(
        method="fp8",
        fmt="e4m3",
        block=block,
        scale_fmt=scale_fmt,
        activation_scheme="dynamic",
        modules_to_not_convert=_str_list(not_convert, "modules_to_not_convert", where),
        modules_to_convert=_str_list(qc.get("modules_to_convert"), "modules_to_convert", where),
        expert_dtype=expert,
    )


__all__ = ["EXPERT_DTYPES", "FP4_GROUP", "QuantSpec", "SCALE_FMTS", "SERVED_METHODS", "read_quant_spec"]
