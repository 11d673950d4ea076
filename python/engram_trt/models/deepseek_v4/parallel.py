"""DeepSeek-V4 / V4.1 over tensor-parallel ranks (docs/distributed.md, "The backbone").

Attention: the low-rank query ``wq_a`` (and its norm) replicated, ``wq_b`` split by heads
(column-parallel) with the heads' ``attn_sink``; the one shared K = V head (``wkv``, its
norm) and the compressors replicated (every rank keeps the same per-slot state); the
grouped output projection ``wo_a`` split by group (``o_groups`` divided by ``--tp``: a
rank's groups read exactly its heads) and ``wo_b`` row-parallel, then the block's one
all-reduce. The CSA lightning indexer is split by head (its ``wq_b`` and
``weights_proj``); its per-head queries and weights are all-gathered before the score
(the score sums over every head, and the kernel takes them so), so each rank's top-k is
the one-rank top-k bit for bit.

MoE: the routed experts split over the ranks (rank ``r`` holds experts ``[r E / N, (r + 1)
E / N)``); every rank routes the step's tokens with the replicated router (hash routing
the same), runs its experts' pairs and adds the shared expert's share (split as a dense
MLP: ``w1`` / ``w3`` column-, ``w2`` row-parallel), and the block's all-reduce combines
them. mHC, the norms, the routers and V4.1's Engram modules are replicated; the
embedding and the head are split by vocabulary rows.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from engram_trt.errors import EngramError
from engram_trt.models.parallel import ParallelPlan, Rule, cols_split, head_range, rows_split, split_ranges

FAMILY = "DeepSeek-V4"
_LAYER = r"^(model\.)?layers\.\d+\."


def block_of(config: Any) -> Any:
    """A stored weight's scale block: FP8 linears in the config's block, FP4 experts in
    rows of 32-groups (None: one scale per tensor)."""
    from engram_trt.quant.spec import FP4_GROUP

    def block(name: str, st_dtype: str, shape: tuple[int, ...]) -> tuple[int, int] | None:
        q = config.quant
        if st_dtype in ("I8", "U8"):
            return (1, FP4_GROUP)
        return None if q is None or q.block is None else tuple(q.block)

    return block


def parallel_plan(config: Any, tp: int, rank: int) -> ParallelPlan:
    """TP rank ``rank`` of ``tp``'s share (module docstring); refused in one line when the
    heads, the output groups, the indexer heads or the experts do not divide."""
    h0, h1 = head_range(config.num_attention_heads, tp, rank, "num_attention_heads", FAMILY)
    g0, g1 = head_range(config.o_groups, tp, rank, "o_groups", FAMILY)
    e0, e1 = head_range(config.n_routed_experts, tp, rank, "n_routed_experts", FAMILY)
    has_csa = "compressed_sparse_attention" in config.layer_types
    i0, i1 = head_range(config.index_n_heads, tp, rank, "index_n_heads", FAMILY) if has_csa else (0, 0)
    for what, n in (("moe_intermediate_size", config.moe_intermediate_size), ("vocab_size", config.vocab_size)):
        if n < tp:
            raise EngramError(f"--tp {tp}: {FAMILY}'s {what}={n} is smaller than the {tp} ranks it would split over")
    d, olr, idim = config.head_dim, config.o_lora_rank, config.index_head_dim
    s0, s1 = split_ranges(config.moe_intermediate_size, tp)[rank]
    v0, v1 = split_ranges(config.vocab_size, tp)[rank]
    local = replace(
        config,
        num_attention_heads=h1 - h0,
        o_groups=g1 - g0,
        index_n_heads=(i1 - i0) if has_csa else config.index_n_heads,
    )
    rules = [
        Rule(re.compile(_LAYER + r"attn\.wq_b\.weight$"), rows_split("column", [(h0 * d, h1 * d)])),
        Rule(re.compile(_LAYER + r"attn\.attn_sink$"), rows_split("head", [(h0, h1)])),
        Rule(re.compile(_LAYER + r"attn\.wo_a\.weight$"), rows_split("column", [(g0 * olr, g1 * olr)])),
        Rule(re.compile(_LAYER + r"attn\.wo_b\.weight$"), cols_split([(g0 * olr, g1 * olr)])),
        Rule(re.compile(_LAYER + r"ffn\.shared_experts\.w[13]\.weight$"), rows_split("column", [(s0, s1)])),
        Rule(re.compile(_LAYER + r"ffn\.shared_experts\.w2\.weight$"), cols_split([(s0, s1)])),
        Rule(re.compile(r"^(model\.embed_tokens|embed|head)\.weight$"), rows_split("vocab", [(v0, v1)])),
    ]
    if has_csa:
        rules += [
            Rule(re.compile(_LAYER + r"attn\.indexer\.wq_b\.weight$"), rows_split("column", [(i0 * idim, i1 * idim)])),
            Rule(re.compile(_LAYER + r"attn\.indexer\.weights_proj\.weight$"), rows_split("column", [(i0, i1)])),
        ]
    return ParallelPlan(
        FAMILY,
        tp,
        rank,
        config,
        local,
        tuple(rules),
        (e0, e1 - e0, config.n_routed_experts),
        (v0, v1),
        block_of=block_of(config),
    )


def shard_modules(model: Any, plan: ParallelPlan) -> None:
    """The modules built on the meta device at the local config (local heads and groups)
    made the rank's: its routed experts only (numbered from 0, the router still over all
    of them), the shared expert at its channels, the indexers told the whole head count,
    the embedding and the head cut to its vocabulary rows."""
    import torch
    from torch import nn

    from engram_trt.models.deepseek_v4.compressors import LightningIndexer
    from engram_trt.models.deepseek_v4.modules import ClampedSwiGLU
    from engram_trt.models.parallel import vocab_parallel_embedding

    cfg, tp = plan.global_config, plan.tp
    first, count, _total = plan.experts  # type: ignore[misc]
    s0, s1 = split_ranges(cfg.moe_intermediate_size, plan.size)[plan.rank]
    v0, v1 = plan.vocab  # type: ignore[misc]
    D = cfg.hidden_size
    with torch.device("meta"):
        model.model.embed_tokens = vocab_parallel_embedding(v0, v1, D, tp)
        if model.lm_head is not None:
            model.lm_head = nn.Linear(D, v1 - v0, bias=False)
        for layer in model.model.layers:
            mlp = layer.mlp
            mlp.experts = nn.ModuleList(list(mlp.experts)[first : first + count])
            mlp.expert_range = (first, count)
            mlp.shared_experts = ClampedSwiGLU(D, s1 - s0, mlp.shared_experts.limit)
    from engram_trt.models.deepseek_v4.attention import DeepseekV4Attention

    for mod in model.modules():
        if isinstance(mod, LightningIndexer):
            mod.tp = tp
            mod.score_heads = cfg.index_n_heads
        elif isinstance(mod, DeepseekV4Attention):
            mod.fused_decode = False  # the module path gathers the indexer's heads across the ranks
    model.tp = tp
