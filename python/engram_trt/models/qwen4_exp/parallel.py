"""Qwen4Exp over tensor-parallel ranks (docs/distributed.md, "The backbone").

The QSA full-attention layers by head: ``q_proj`` (each head's query and output gate)
column-parallel, ``k_proj`` / ``v_proj`` by key head when ``--tp`` divides them (else each
rank holds the one key head its query heads read), ``o_proj`` row-parallel, then the
block's all-reduce; the QSA indexer by head (``index_qk_proj``'s query rows; its one key
head replicated), its queries all-gathered before the block scores (the one-rank
selection, bit for bit). The Gated DeltaNet layers by value head: ``in_proj_qkv`` and the
short convolution keep the rank's key heads' q / k channels and its value heads' v
channels, ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``, ``dt_bias`` and ``A_log`` its value
heads, ``out_proj`` row-parallel; the per-slot conv and recurrent states are the local
heads'. MoE: experts split over the ranks (the router replicated over all of them), the
shared expert split as a dense MLP (its sigmoid gate replicated: a per-token scalar, so
it scales each rank's partial sum). Hyper-connections, norms and PLE (its projections
and tables) replicated; the embedding and the head split by vocabulary rows.
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

FAMILY = "Qwen4Exp"
_LAYER = r"(^|\.)layers\.\d+\."


def _at(tail: str) -> re.Pattern[str]:
    """A decoder layer's tensor ``tail`` (any weight prefix)."""
    return re.compile(_LAYER + tail)


def block_of(config: Any) -> Any:
    """A stored FP8 weight's scale block (None: one scale per tensor)."""

    def block(name: str, st_dtype: str, shape: tuple[int, ...]) -> tuple[int, int] | None:
        q = config.quant
        return None if q is None or q.block is None else tuple(q.block)

    return block


def parallel_plan(config: Any, tp: int, rank: int) -> ParallelPlan:
    """TP rank ``rank`` of ``tp``'s share (module docstring); refused in one line when the
    heads, the linear-attention heads or the experts do not divide."""
    rules: list[Rule] = []
    local: dict[str, Any] = {}
    if config.attention_layers:
        h = config.num_attention_heads
        h0, h1 = head_range(h, tp, rank, "num_attention_heads", FAMILY)
        k0, k1 = kv_head_range(config.num_key_value_heads, h, tp, rank, "num_key_value_heads", FAMILY)
        hd = config.head_dim
        rules += [
            Rule(_at(r"self_attn\.q_proj\.weight$"), rows_split("column", [(2 * h0 * hd, 2 * h1 * hd)])),
            Rule(_at(r"self_attn\.[kv]_proj\.weight$"), rows_split("column", [(k0 * hd, k1 * hd)])),
            Rule(_at(r"self_attn\.o_proj\.weight$"), cols_split([(h0 * hd, h1 * hd)])),
        ]
        local.update(num_attention_heads=h1 - h0, num_key_value_heads=k1 - k0)
        if config.qsa is not None:
            ih, ihd = config.qsa.n_heads, config.qsa.head_dim
            i0, i1 = head_range(ih, tp, rank, "indexer_n_heads", FAMILY)
            rules.append(
                Rule(
                    _at(r"self_attn\.indexer\.index_qk_proj\.weight$"),
                    rows_split("column", [(i0 * ihd, i1 * ihd), (ih * ihd, (ih + 1) * ihd)]),
                )
            )
            local["qsa"] = replace(config.qsa, n_heads=i1 - i0)
    if config.linear_layers:
        hv, hk = config.linear_num_value_heads, config.linear_num_key_heads
        dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
        v0, v1 = head_range(hv, tp, rank, "linear_num_value_heads", FAMILY)
        k0, k1 = kv_head_range(hk, hv, tp, rank, "linear_num_key_heads", FAMILY)
        key_dim = hk * dk
        channels = [
            (k0 * dk, k1 * dk),
            (key_dim + k0 * dk, key_dim + k1 * dk),
            (2 * key_dim + v0 * dv, 2 * key_dim + v1 * dv),
        ]
        rules += [
            Rule(_at(r"linear_attn\.in_proj_qkv\.weight$"), rows_split("column", channels)),
            Rule(_at(r"linear_attn\.conv1d\.weight$"), rows_split("column", channels)),
            Rule(_at(r"linear_attn\.in_proj_z\.weight$"), rows_split("column", [(v0 * dv, v1 * dv)])),
            Rule(_at(r"linear_attn\.in_proj_[ab]\.weight$"), rows_split("column", [(v0, v1)])),
            Rule(_at(r"linear_attn\.(dt_bias|A_log)$"), rows_split("head", [(v0, v1)])),
            Rule(_at(r"linear_attn\.out_proj\.weight$"), cols_split([(v0 * dv, v1 * dv)])),
        ]
        local.update(linear_num_value_heads=v1 - v0, linear_num_key_heads=k1 - k0)
    e0, e1 = head_range(config.num_experts, tp, rank, "num_experts", FAMILY)
    for what, n in (
        ("shared_expert_intermediate_size", config.shared_expert_intermediate_size),
        ("vocab_size", config.vocab_size),
    ):
        if n < tp:
            raise EngramError(f"--tp {tp}: {FAMILY}'s {what}={n} is smaller than the {tp} ranks it would split over")
    s0, s1 = split_ranges(config.shared_expert_intermediate_size, tp)[rank]
    b0, b1 = split_ranges(config.vocab_size, tp)[rank]
    rules += [
        Rule(_at(r"mlp\.experts\.(gate_up|down)_proj_scale_inv$"), rows_split("expert", [(e0, e1)])),
        Rule(_at(r"mlp\.shared_expert\.(gate|up)_proj\.weight$"), rows_split("column", [(s0, s1)])),
        Rule(_at(r"mlp\.shared_expert\.down_proj\.weight$"), cols_split([(s0, s1)])),
        Rule(re.compile(r"(^|\.)embed_tokens\.weight$|^lm_head\.weight$"), rows_split("vocab", [(b0, b1)])),
    ]
    local.update(num_experts=e1 - e0, shared_expert_intermediate_size=s1 - s0)
    return ParallelPlan(
        FAMILY,
        tp,
        rank,
        config,
        replace(config, **local),
        tuple(rules),
        (e0, e1 - e0, config.num_experts),
        (b0, b1),
        block_of=block_of(config),
    )


def shard_modules(model: Any, plan: ParallelPlan) -> None:
    """The modules built on the meta device at the local config made the rank's: the
    routers over every expert, the indexers told to gather their queries, the embedding
    and the head cut to the rank's vocabulary rows."""
    import torch
    from torch import nn

    from engram_trt.models.parallel import vocab_parallel_embedding
    from engram_trt.models.qwen4_exp.attention import QSAIndexer

    cfg, tp = plan.global_config, plan.tp
    first, count, total = plan.experts  # type: ignore[misc]
    b0, b1 = plan.vocab  # type: ignore[misc]
    D = cfg.hidden_size
    with torch.device("meta"):
        model.model.embed_tokens = vocab_parallel_embedding(b0, b1, D, tp)
        if model.lm_head is not None:
            model.lm_head = nn.Linear(D, b1 - b0, bias=False)
        for layer in model.model.layers:
            layer.mlp.gate = nn.Linear(D, total, bias=False)
            layer.mlp.expert_range = (first, count)
    for mod in model.modules():
        if isinstance(mod, QSAIndexer):
            mod.tp = tp
    model.tp = tp
