"""engram-llama over tensor-parallel ranks (docs/distributed.md, "The backbone"): q / k / v
and gate / up column-parallel, o and down row-parallel (one all-reduce after each), the
embedding and the head split by vocabulary rows; the norms and the Engram modules
(``wkv``, the gate weights) replicated, the Engram columns sharded by the runtime's
lookup as before. Key / value heads split when ``--tp`` divides them, else each rank
holds the one its query heads read (``kv`` dividing ``tp``).
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from engram_trt.errors import EngramError
from engram_trt.models.parallel import (
    ParallelPlan,
    Rule,
    cols_split,
    head_range,
    kv_head_range,
    rows_split,
    split_ranges,
)

FAMILY = "engram-llama"


def block_of(config: Any) -> Any:
    """A stored FP8 weight's scale block (None: one scale per tensor)."""

    def block(name: str, st_dtype: str, shape: tuple[int, ...]) -> tuple[int, int] | None:
        q = config.quant
        return None if q is None or q.block is None else tuple(q.block)

    return block


def parallel_plan(config: Any, tp: int, rank: int) -> ParallelPlan:
    """TP rank ``rank`` of ``tp``'s share (module docstring); refused in one line when the
    heads do not divide."""
    h = config.num_attention_heads
    h0, h1 = head_range(h, tp, rank, "num_attention_heads", FAMILY)
    k0, k1 = kv_head_range(config.num_key_value_heads, h, tp, rank, "num_key_value_heads", FAMILY)
    for what, n in (("intermediate_size", config.intermediate_size), ("vocab_size", config.vocab_size)):
        if n < tp:
            raise EngramError(f"--tp {tp}: {FAMILY}'s {what}={n} is smaller than the {tp} ranks it would split over")
    hd = config.head_dim
    i0, i1 = split_ranges(config.intermediate_size, tp)[rank]
    v0, v1 = split_ranges(config.vocab_size, tp)[rank]
    local = replace(config, num_attention_heads=h1 - h0, num_key_value_heads=k1 - k0, intermediate_size=i1 - i0)
    layer = r"^model\.layers\.\d+\."
    rules = (
        Rule(re.compile(layer + r"self_attn\.q_proj\.weight$"), rows_split("column", [(h0 * hd, h1 * hd)])),
        Rule(re.compile(layer + r"self_attn\.[kv]_proj\.weight$"), rows_split("column", [(k0 * hd, k1 * hd)])),
        Rule(re.compile(layer + r"self_attn\.o_proj\.weight$"), cols_split([(h0 * hd, h1 * hd)])),
        Rule(re.compile(layer + r"mlp\.(gate|up)_proj\.weight$"), rows_split("column", [(i0, i1)])),
        Rule(re.compile(layer + r"mlp\.down_proj\.weight$"), cols_split([(i0, i1)])),
        Rule(re.compile(r"^(model\.embed_tokens|lm_head)\.weight$"), rows_split("vocab", [(v0, v1)])),
    )
    return ParallelPlan(FAMILY, tp, rank, config, local, rules, None, (v0, v1), block_of=block_of(config))


def local_weight_shapes(plan: ParallelPlan) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> the rank's shape of every weight the model reads."""
    from engram_trt.models.engram_llama.weights import model_weight_shapes

    v0, v1 = plan.vocab  # type: ignore[misc]
    out = model_weight_shapes(plan.local_config)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in out:
            out[name] = (v1 - v0, out[name][1])
    return out


def shard_modules(model: Any, plan: ParallelPlan) -> None:
    """The modules built on the meta device at the local config, made the rank's: the
    embedding and the head cut to the rank's vocabulary rows."""
    from torch import nn

    from engram_trt.models.parallel import vocab_parallel_embedding

    v0, v1 = plan.vocab  # type: ignore[misc]
    D = plan.local_config.hidden_size
    model.model.embed_tokens = vocab_parallel_embedding(v0, v1, D, plan.tp, device="meta")
    if model.lm_head is not None:
        model.lm_head = nn.Linear(D, v1 - v0, bias=False, device="meta")
