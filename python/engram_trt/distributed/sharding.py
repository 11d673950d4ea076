"""The sharding arithmetic: which rank owns which hash columns and rows, how a global
row id becomes a row of a rank's slice, and in which order the exchange sends and
assembles rows. Pure functions of the layout and the topology, so every rank computes
the same answer with no communication, and the tests check each against the
single-rank reference.

Why columns: a layer's columns are ordered order-major, head-minor, and column ``c``
owns rows ``[offset_c, offset_c + prime_c)`` of the layer's table (engram/layout.py).
A contiguous column range therefore owns one contiguous row range per layer, so a rank
holds exactly that byte range of each table file and nothing else.

Why balanced by column count: every column costs one row per token to gather and to
send, so equal column counts give equal lookup and exchange work per rank (the first
``cols % world`` ranks take one column more). Row counts follow the primes, which are
close to each other within an n-gram order; :meth:`ColumnShard.num_rows` reports them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Sequence

import numpy as np

from engram_trt.engram.layout import EngramLayout
from engram_trt.errors import EngramError

if TYPE_CHECKING:
    from engram_trt.tables.source import TableRef


def balanced_ranges(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges covering ``0..n`` whose sizes differ by at most one
    (the first ``n % parts`` one larger); a part may be empty when ``parts > n``."""
    if parts < 1:
        raise EngramError(f"cannot split {n} items over {parts} parts (need at least one part)")
    if n < 0:
        raise EngramError(f"cannot split a negative count ({n})")
    base, extra = divmod(n, parts)
    out, start = [], 0
    for p in range(parts):
        size = base + (1 if p < extra else 0)
        out.append((start, start + size))
        start += size
    return out


def column_ranges(num_cols: int, world: int) -> list[tuple[int, int]]:
    """Per rank of a lookup group of ``world`` ranks, its column range ``[begin, end)``."""
    return balanced_ranges(num_cols, world)


def column_owners(num_cols: int, world: int) -> np.ndarray:
    """``int64 [cols]``: the rank owning each column."""
    out = np.empty(num_cols, dtype=np.int64)
    for r, (b, e) in enumerate(column_ranges(num_cols, world)):
        out[b:e] = r
    return out


def max_shard_cols(num_cols: int, world: int) -> int:
    """The widest rank's column count: every rank sends chunks this wide (narrower
    ranks pad), so the exchange's splits are equal and its shapes static."""
    return max(e - b for b, e in column_ranges(num_cols, world))


@dataclass(frozen=True)
class ColumnShard:
    """The columns ``[col_begin, col_end)`` rank ``rank`` of ``world`` owns in every
    Engram layer, and per layer the rows they own: ``[row_begin[l], row_end[l])``."""

    rank: int
    world: int
    col_begin: int
    col_end: int
    row_begin: tuple[int, ...]
    row_end: tuple[int, ...]

    @property
    def num_cols(self) -> int:
        return self.col_end - self.col_begin

    @property
    def num_layers(self) -> int:
        return len(self.row_begin)

    def num_rows(self, layer: int) -> int:
        return self.row_end[layer] - self.row_begin[layer]

    @property
    def is_empty(self) -> bool:
        return self.num_cols == 0

    def to_json(self) -> dict[str, object]:
        return {
            "rank": self.rank,
            "world": self.world,
            "columns": [self.col_begin, self.col_end],
            "rows": [[b, e] for b, e in zip(self.row_begin, self.row_end)],
        }


def shard_columns(layout: EngramLayout, rank: int, world: int) -> ColumnShard:
    """Rank ``rank``'s shard of ``layout`` in a lookup group of ``world`` ranks."""
    if not 0 <= rank < world:
        raise EngramError(f"rank {rank} is outside a lookup group of {world} ranks")
    b, e = column_ranges(layout.n_hash_cols, world)[rank]
    ends = layout.offsets + layout.col_primes  # [L, cols]: one past each column's last row
    row_b, row_e = [], []
    for li in range(layout.num_layers):
        if b == e:  # no columns: an empty range at the table's end
            row_b.append(int(layout.table_rows[li]))
            row_e.append(int(layout.table_rows[li]))
        else:
            row_b.append(int(layout.offsets[li, b]))
            row_e.append(int(ends[li, e - 1]))
    return ColumnShard(rank, world, b, e, tuple(row_b), tuple(row_e))


def all_shards(layout: EngramLayout, world: int) -> list[ColumnShard]:
    return [shard_columns(layout, r, world) for r in range(world)]


def local_row_ids(global_ids: np.ndarray, shard: ColumnShard) -> np.ndarray:
    """Row ids ``[..., L, cols]`` (the hash's output, global row ids of each layer's
    table) -> ``[..., L, shard cols]``: the shard's columns, as rows of its slice
    (``global - row_begin[l]``). Same dtype as the input."""
    ids = np.asarray(global_ids)
    if ids.ndim < 2 or ids.shape[-2] != shard.num_layers:
        raise EngramError(f"row ids must be [..., L={shard.num_layers}, cols] (got {ids.shape})")
    begin = np.asarray(shard.row_begin, dtype=ids.dtype).reshape(shard.num_layers, 1)
    return ids[..., shard.col_begin : shard.col_end] - begin


def global_row_ids(local_ids: np.ndarray, shard: ColumnShard) -> np.ndarray:
    """The inverse of :func:`local_row_ids` (for checks and messages)."""
    ids = np.asarray(local_ids)
    begin = np.asarray(shard.row_begin, dtype=ids.dtype).reshape(shard.num_layers, 1)
    return ids + begin


def pad_token_count(n: int, max_tokens: int) -> int:
    """The common token count every replica pads its step to: the next power of two
    at or above the largest replica's ``n``, capped at ``max_tokens``, so the
    exchange's shapes take a handful of values (one CUDA graph per bucket). 0 when
    no replica has a token."""
    if n < 0 or n > max_tokens:
        raise EngramError(f"a step of {n} tokens is outside 0..max_num_tokens={max_tokens}")
    if n == 0:
        return 0
    return min(1 << (n - 1).bit_length(), max_tokens)


def pad_row_ids(ids: np.ndarray | None, num_tokens: int, layout: EngramLayout) -> np.ndarray:
    """``[T, L, cols]`` row ids padded to ``[num_tokens, L, cols]`` int32. A pad
    token reads each column's first row (``offset_c``): a valid row of whichever
    rank owns the column, gathered and then dropped."""
    L, cols = layout.num_layers, layout.n_hash_cols
    out = np.empty((num_tokens, L, cols), dtype=np.int32)
    T = 0 if ids is None else ids.shape[0]
    if T > num_tokens:
        raise EngramError(f"internal: {T} tokens do not fit a padded step of {num_tokens}")
    if T:
        out[:T] = ids
    out[T:] = layout.offsets.astype(np.int32)[None]
    return out


# -- topology ------------------------------------------------------------------------
@dataclass(frozen=True)
class Topology:
    """``tp`` tensor-parallel ranks per replica times ``dp`` data-parallel replicas.
    Ranks are numbered replica-major: ``rank = dp_rank * tp + tp_rank``, so a
    replica's TP ranks are neighbours (one node, NVLink)."""

    tp: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        for name, v in (("tp", self.tp), ("dp", self.dp)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise EngramError(f"--{name} must be an integer >= 1 (got {v!r})")

    @property
    def world(self) -> int:
        return self.tp * self.dp

    def rank(self, dp_rank: int, tp_rank: int) -> int:
        return dp_rank * self.tp + tp_rank

    def coords(self, rank: int) -> tuple[int, int]:
        """``(dp_rank, tp_rank)`` of a global rank."""
        if not 0 <= rank < self.world:
            raise EngramError(f"rank {rank} is outside a world of {self.world} ranks")
        return divmod(rank, self.tp)

    def replica_of(self, rank: int) -> int:
        return self.coords(rank)[0]

    def leader_of(self, rank: int) -> int:
        """The replica's TP rank 0: it schedules and samples; its TP peers follow."""
        return self.rank(self.replica_of(rank), 0)

    def tp_group(self, dp_rank: int) -> list[int]:
        return [self.rank(dp_rank, t) for t in range(self.tp)]

    def tp_groups(self) -> list[list[int]]:
        return [self.tp_group(d) for d in range(self.dp)]

    def split_prompts(self, n: int) -> list[tuple[int, int]]:
        """Per replica, its contiguous share ``[begin, end)`` of ``n`` prompts."""
        return balanced_ranges(n, self.dp)


# -- the exchange --------------------------------------------------------------------
LOOKUP_SCOPES = ("tp", "world")


@dataclass(frozen=True)
class ExchangePlan:
    """How one lookup group moves rows (see :func:`exchange_plan`).

    ``members``: the group's global ranks, in group-rank order. ``me``: this rank's
    index in it. ``replica_of``: per member, the index of the replica whose tokens it
    needs. ``requesters``: per replica, the member whose row ids stand for it (its TP
    rank 0; TP peers hold the same tokens). ``col_ranges``: per member, the columns
    it owns. ``exchanges_ids``: replicas differ (row ids are all-gathered, rows go
    back all-to-all); False: every member has the same tokens (rows are all-gathered).
    """

    members: tuple[int, ...]
    me: int
    replica_of: tuple[int, ...]
    requesters: tuple[int, ...]
    col_ranges: tuple[tuple[int, int], ...]
    exchanges_ids: bool

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def num_replicas(self) -> int:
        return len(self.requesters)

    @property
    def chunk_cols(self) -> int:
        return max(e - b for b, e in self.col_ranges)

    def send_order(self) -> list[int]:
        """Chunk ``d`` of the all-to-all's input (sent to member ``d``) holds this
        rank's columns for the tokens of replica ``send_order()[d]``."""
        return list(self.replica_of)

    def assemble_order(self) -> list[tuple[int, int, int]]:
        """Chunk ``s`` of the received rows (from member ``s``) fills columns
        ``[b, e)``: ``(s, b, e)`` per member, empty ranges left out."""
        return [(s, b, e) for s, (b, e) in enumerate(self.col_ranges) if e > b]


def exchange_plan(topology: Topology, rank: int, scope: str, num_cols: int) -> ExchangePlan:
    """The lookup group of global ``rank``: its replica's TP ranks (``scope='tp'``,
    columns sharded over TP) or every rank (``'world'``: ``embedding_across_dp``,
    columns sharded over TP x DP, one table copy in total)."""
    if scope not in LOOKUP_SCOPES:
        raise EngramError(f"internal: lookup scope {scope!r} is not one of {LOOKUP_SCOPES}")
    if scope == "tp":
        members = tuple(topology.tp_group(topology.replica_of(rank)))
        replica_of = tuple(0 for _ in members)
        requesters: tuple[int, ...] = (0,)
    else:
        members = tuple(range(topology.world))
        replica_of = tuple(topology.replica_of(r) for r in members)
        requesters = tuple(members.index(topology.rank(d, 0)) for d in range(topology.dp))
    return ExchangePlan(
        members,
        members.index(rank),
        replica_of,
        requesters,
        tuple(column_ranges(num_cols, len(members))),
        len(requesters) > 1,
    )


# -- the table slice -----------------------------------------------------------------
def slice_table_refs(refs: Sequence["TableRef"], shard: ColumnShard) -> list["TableRef"]:
    """The shard's byte range of each table (rows and scales alike: both are row-major
    with one row per table row), as :class:`~engram_trt.tables.source.TableRef`s any
    store opens, so a rank loads, maps or registers only its slice. The slice carries
    no sha256 (the manifest hashes whole tables) and names its rows in ``tensor``, so
    stores keyed by tensor names (the shared segment) keep slices apart."""
    out = []
    for r in refs:
        b, e = shard.row_begin[r.layer_index], shard.row_end[r.layer_index]
        if e > r.shape[0]:
            raise EngramError(
                f"table {r.tensor} has {r.shape[0]} rows, fewer than the layout's {e}: "
                "the table does not cover the layout"
            )
        if e == b:
            raise EngramError(f"internal: rank {shard.rank} owns no rows of {r.tensor}; an empty shard opens no tables")
        rb = r.row_bytes
        out.append(
            replace(
                r,
                offset=r.offset + b * rb,
                nbytes=(e - b) * rb,
                shape=(e - b, r.shape[1]),
                sha256=None,
                tensor=f"{r.tensor}[rows {b}:{e}]",
            )
        )
    return out
