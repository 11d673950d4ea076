"""A checkpoint's compressed vocabulary and Engram layout, built and checked once for
every caller (the reference model, the runtime's checkpoint source): the tokenizer
compressed, its size checked against ``engram_compressed_vocab_size``, the pad token's
compressed id found, the layout derived from them."""

from __future__ import annotations

from typing import Any

import numpy as np

from engram_trt.engram.layout import EngramLayout
from engram_trt.errors import CheckpointError


def engram_lookup_and_layout(ckpt: Any, compressed_vocab: Any = None) -> tuple[np.ndarray | None, EngramLayout | None]:
    """``(lookup int64 [vocab] raw -> compressed id, layout)`` of a checkpoint, or
    ``(None, None)`` for a model without Engram layers. ``compressed_vocab``: one built
    already (tests pass a small one), else the checkpoint's tokenizer.json's."""
    from engram_trt.engram.tokenizer import build_compressed_vocab, check_compressed_size

    spec = ckpt.config.require_model()
    if spec is None:
        return None, None
    if compressed_vocab is None:
        if ckpt.tokenizer_json is None:
            raise CheckpointError(
                f"checkpoint '{ckpt.path}' has no tokenizer.json, "
                "which Engram needs to compress token ids (copy the model's tokenizer.json into the folder)"
            )
        compressed_vocab = build_compressed_vocab(ckpt.tokenizer_json)
    check_compressed_size(compressed_vocab, spec.compressed_vocab_size, spec.field_name("compressed_vocab_size"))
    lookup = np.asarray(compressed_vocab.lookup, dtype=np.int64)
    if spec.pad_token_id >= lookup.shape[0]:
        raise CheckpointError(
            f"{spec.field_name('pad_token_id')}={spec.pad_token_id} is not in the tokenizer (vocab {lookup.shape[0]})"
        )
    return lookup, EngramLayout.from_spec(spec, pad_id=int(lookup[spec.pad_token_id]))
