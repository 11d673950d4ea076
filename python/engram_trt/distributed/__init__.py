"""Several ranks: the backbone and the Engram heads sharded over tensor-parallel ranks,
and one table copy across data-parallel replicas (docs/distributed.md).

| module | what |
| --- | --- |
| :mod:`.sharding` | the arithmetic: column ranges, row slices, the row remap, pad counts, the exchange order (pure) |
| :mod:`.groups` | process groups (NCCL data + gloo control per set of ranks), NVLink multicast off |
| :mod:`.lookup` | :class:`ShardedLookup`: the Prefetcher's contract over a rank's column slice |
| :mod:`.lockstep` | :class:`LockstepScheduler`: every rank of a lookup group steps together |
| :mod:`.modes` | which table sharing runs (embedding_across_dp, dp_shared_memory, private), with fallbacks |
| :mod:`.launch` | starting ranks (spawn or torchrun) and serving prompts over ``tp x dp`` |
| :mod:`.serving` | a serving replica's TP group: the leader starts its followers, :meth:`ServingGroup.stop` ends them |
| :mod:`.memory` | PSS and ``/dev/shm`` use, for the one-copy checks |
| :mod:`.support` | what a model can run over several ranks (plans, scale blocks, GPUs needed), asked first |
| :mod:`.llm` | ``engram_trt.LLM``: llmapi's LLM, leading a tensor-parallel group with ``tp=N`` |
| :mod:`.checks` | jobs that check a deployment's ranks (the lookup's rows, several jobs on one world) |
| :mod:`.clock` | :class:`CollectiveClock`: the time a rank's model spends in its collectives |

The model's own share of a TP group (its plan, its collectives) is
:mod:`engram_trt.models.parallel`: the models call it, and they sit below this package.

Importing this package imports no torch until a function needs it, except
:mod:`.lookup`, :mod:`.lockstep` and :mod:`.groups`.
"""

from engram_trt.distributed.sharding import (  # noqa: F401
    ColumnShard,
    ExchangePlan,
    Topology,
    balanced_ranges,
    column_ranges,
    exchange_plan,
    local_row_ids,
    pad_token_count,
    shard_columns,
    slice_table_refs,
)
