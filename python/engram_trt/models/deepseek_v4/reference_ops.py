"""DeepSeek-V4's plugin op on the CPU: the ``onnx.reference`` OpRun of
EngramDsv4Attention (:func:`reference_ops`, the architecture's) over
:mod:`.reference_attention` (float64 NumPy)."""

from __future__ import annotations

import numpy as np

from engram_trt.models.export import PLUGIN_DOMAIN
from engram_trt.models.reference_ops import in_place


def reference_ops() -> list[type]:
    """The OpRun of DeepSeek-V4's EngramDsv4Attention: models/deepseek_v4/reference_attention.py
    (float64 NumPy) over the node's 7 / 15 / 24 inputs; each state input is updated in
    place and returned as its aliased output."""
    from onnx.reference.op_run import OpRun

    class EngramDsv4Attention(OpRun):
        op_domain = PLUGIN_DOMAIN

        def _run(self, *inputs, **kw):  # noqa: ANN002, ANN003
            from engram_trt.models.deepseek_v4.reference_attention import dsv4_attention_reference_flat

            fields = {
                k: kw[k]
                for k in ("layer_type", "window", "compress_rate", "index_topk", "scaling", "eps", "rope_scale")
                if kw.get(k) is not None
            }
            out, *new_states = dsv4_attention_reference_flat(*inputs, **fields)  # checks the input count
            where = (6, 12, 13, 14, 21, 22, 23)[: len(new_states)]  # the state inputs, in output order
            return (
                np.asarray(out).astype(inputs[0].dtype),
                *(in_place(inputs[k], st) for k, st in zip(where, new_states)),
            )

    return [EngramDsv4Attention]
