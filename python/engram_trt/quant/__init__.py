"""Weights computed in the format a checkpoint stores them: fine-grained FP8 (E4M3 with
block scales) and FP4 E2M1 experts (docs/quantization.md).

* :mod:`.spec`: ``quantization_config`` read into a :class:`QuantSpec` (one reader for
  every architecture; unserved methods refused in one line). No torch: config readers
  and the light commands (``layout``, ``hash``) import it.
* :mod:`.formats`: the number formats, decoded and encoded (the CPU path and references).
* :mod:`.weight`: :class:`QuantWeight` (stored bytes + block scales) and
  :class:`QuantLinear` (an ``nn.Linear`` over one).
* :mod:`.names`: where a weight's scale lives in a checkpoint.
"""

from typing import Any

from engram_trt.quant.spec import QuantSpec, read_quant_spec

_LAZY = {"QuantLinear", "QuantWeight", "quant_linear"}  # torch: imported on first use


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from engram_trt.quant import weight

        return getattr(weight, name)
    raise AttributeError(f"module 'engram_trt.quant' has no attribute {name!r}")


__all__ = ["QuantLinear", "QuantSpec", "QuantWeight", "quant_linear", "read_quant_spec"]
