"""Tensor parallelism inside a model: the TP group a model computes with, its
collectives, the sharded embedding and head, the split of every stored tensor, and the
checkpoint view a rank loads from (docs/distributed.md, "The backbone").

Why here and not in :mod:`engram_trt.distributed`: the models (layer 8) call the
collectives at their all-reduce sites and build their modules at the rank's sizes, and
a model may not import a layer above it. :mod:`engram_trt.distributed` makes the
process groups and hands a :class:`TensorParallel` down through ``LLM``.

The scheme is the one TensorRT-LLM and vLLM use. A column-parallel linear keeps the
rank's rows of the weight (its share of the output features: heads, intermediate
channels), a row-parallel one the matching input columns; its partial output is summed
over the ranks by one all-reduce per block (after the attention's output projection,
after the MLP / MoE). The embedding and the head are split by vocabulary rows: the
lookup is masked to the rank's rows and all-reduced, the head's local logits are
all-gathered. MoE experts are split over the ranks (expert parallel): every rank holds
the same tokens, routes them with the replicated router, runs the pairs routed to its
own experts (:func:`localize_experts`: the others get weight 0) and the MoE block's one
all-reduce combines the experts' contributions with the shared expert's partial sum.

Each architecture declares its :class:`ParallelPlan` (``parallel_plan(config, tp,
rank)``): the rank-local config its modules are built with (local heads, local
intermediate sizes, local experts), and per stored tensor (by a regex on its name, any
spelling) the :class:`Split` it reads. :class:`ShardedCheckpoint` shows a checkpoint to
the family's own loader as the rank's checkpoint: local names (the rank's experts
numbered from 0), local shapes, and ``get`` reading only the rank's slice of the file
(``safetensors`` ``get_slice``), in the stored dtype. A quantized weight's block scales
are cut with it: a split must start and end on a block boundary (FP8: 128 rows / 128
columns; FP4 experts: rows anywhere, columns on the 32-groups), else
:meth:`ParallelPlan.check_checkpoint` refuses the TP size in one line naming the tensor,
before any rank starts.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from engram_trt.errors import EngramError

log = logging.getLogger(__name__)

SPLIT_KINDS = ("column", "row", "vocab", "expert", "head")  # "head": a per-head vector (sinks, A_log, ...)
SCALE_SUFFIXES = (".weight_scale_inv", ".scale")
_EXPERT = re.compile(r"^(?P<head>.*\.experts\.)(?P<e>\d+)(?P<tail>\..+)$")


# -- the group and its collectives ---------------------------------------------------------
@dataclass(eq=False)
class TensorParallel:
    """This rank's place in its replica's tensor-parallel group: ``rank`` of ``size``,
    ``group`` the ``torch.distributed`` process group of the replica's TP ranks (NCCL on
    GPUs, gloo on CPUs). The collectives run on the current CUDA stream with no host
    wait, so a decode CUDA graph records them. (Not frozen: a benchmark's clock wraps
    ``all_reduce`` / ``all_gather`` on the instance, bench/breakdown.RegionClock.)"""

    rank: int
    size: int
    group: Any = None

    def __post_init__(self) -> None:
        if not (isinstance(self.size, int) and self.size >= 1 and 0 <= self.rank < self.size):
            raise EngramError(f"internal: TP rank {self.rank} of {self.size}")

    def all_reduce(self, x: Any) -> Any:
        """``x`` summed over the ranks (in place on a contiguous tensor; returned)."""
        import torch.distributed as dist

        x = x.contiguous()
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: Any, dim: int) -> Any:
        """Every rank's ``x`` (all of one shape) concatenated along ``dim`` in rank order."""
        import torch
        import torch.distributed as dist

        x = x.contiguous()
        out = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        fn(out, x, group=self.group)
        d = dim % x.dim()
        if d == 0:
            return out
        out = out.view(self.size, *x.shape)
        return out.movedim(0, d).reshape(*x.shape[:d], self.size * x.shape[d], *x.shape[d + 1 :])


def is_parallel(tp: TensorParallel | None) -> bool:
    return tp is not None and tp.size > 1


def reduce(x: Any, tp: TensorParallel | None) -> Any:
    """The all-reduce at the end of a row-parallel block (identity on one rank)."""
    return tp.all_reduce(x) if is_parallel(tp) else x


def gather_heads(x: Any, tp: TensorParallel | None, dim: int = 1) -> Any:
    """Every rank's heads of ``x`` (``[T, local heads, ...]``) side by side: all heads."""
    return tp.all_gather(x, dim) if is_parallel(tp) else x


def split_ranges(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges covering ``0..n``, sizes differing by at most one (the
    first ``n % parts`` one larger)."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for p in range(parts):
        size = base + (1 if p < extra else 0)
        out.append((start, start + size))
        start += size
    return out


def gather_vocab(logits: Any, tp: TensorParallel | None, vocab: int) -> Any:
    """The head's local logits ``[S, rows of this rank]`` all-gathered into ``[S, vocab]``
    (each rank's rows padded to the widest, the padding dropped)."""
    if not is_parallel(tp):
        return logits
    import torch

    ranges = split_ranges(vocab, tp.size)
    width = max(b - a for a, b in ranges)
    if logits.shape[-1] < width:
        logits = torch.nn.functional.pad(logits, (0, width - logits.shape[-1]))
    full = tp.all_gather(logits, -1)
    if all(b - a == width for a, b in ranges):
        return full
    return torch.cat([full[..., r * width : r * width + (b - a)] for r, (a, b) in enumerate(ranges)], dim=-1)


def localize_experts(ids: Any, weights: Any, first: int, count: int) -> tuple[Any, Any]:
    """Routing of the rank's experts ``[first, first + count)`` only: each pair's expert id
    made local, pairs routed elsewhere sent to local expert 0 with weight 0 (they add
    nothing; the shapes stay static, no host read)."""
    import torch

    local = ids - first
    mine = (local >= 0) & (local < count)
    return torch.where(mine, local, torch.zeros_like(local)), torch.where(mine, weights, torch.zeros_like(weights))


def _embedding_class() -> Any:
    import torch
    import torch.nn.functional as F
    from torch import nn

    class VocabParallelEmbedding(nn.Module):
        """An embedding holding rows ``[begin, end)`` of the vocabulary (``weight``, named
        as the ``nn.Embedding`` it replaces); ids outside give zero rows, and the
        all-reduce sums each id's one real row into every rank's output."""

        def __init__(self, begin: int, end: int, dim: int, tp: TensorParallel, device: Any = None) -> None:
            super().__init__()
            self.begin, self.end, self.tp = int(begin), int(end), tp
            self.weight = nn.Parameter(torch.empty(end - begin, dim, device=device), requires_grad=False)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            local = ids - self.begin
            mine = (local >= 0) & (local < self.end - self.begin)
            rows = F.embedding(torch.where(mine, local, torch.zeros_like(local)), self.weight)
            return reduce(torch.where(mine.unsqueeze(-1), rows, torch.zeros_like(rows)), self.tp)

        def extra_repr(self) -> str:
            return f"rows {self.begin}..{self.end} of the vocabulary, {self.weight.shape[1]} wide"

    return VocabParallelEmbedding


_EMBEDDING: Any = None


def vocab_parallel_embedding(begin: int, end: int, dim: int, tp: TensorParallel, device: Any = None) -> Any:
    """A :class:`VocabParallelEmbedding` (built lazily: this module imports no torch)."""
    global _EMBEDDING
    if _EMBEDDING is None:
        _EMBEDDING = _embedding_class()
    return _EMBEDDING(begin, end, dim, tp, device)


# -- the plan -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Split:
    """What a rank reads of one stored tensor: along ``dim`` the ``ranges`` (logical
    element indices, concatenated in order). ``kind``: ``column`` (a linear's output
    rows), ``row`` (its input columns), ``vocab``, ``expert`` (dim 0 of a tensor stacked
    over experts), ``head`` (a per-head vector)."""

    kind: str
    dim: int
    ranges: tuple[tuple[int, int], ...]

    @property
    def length(self) -> int:
        return sum(b - a for a, b in self.ranges)


def rows_split(kind: str, ranges: Sequence[tuple[int, int]]) -> Split:
    return Split(kind, 0, tuple((int(a), int(b)) for a, b in ranges))


def cols_split(ranges: Sequence[tuple[int, int]]) -> Split:
    return Split("row", 1, tuple((int(a), int(b)) for a, b in ranges))


@dataclass(frozen=True)
class Rule:
    """Stored tensors whose name matches ``pattern`` (``re.search``) read ``split``."""

    pattern: re.Pattern[str]
    split: Split


@dataclass
class ParallelPlan:
    """One rank's share of a model (module docstring). ``sharded`` False: the family's
    backbone is not split (the default an architecture declares); ``experts``: ``(first,
    count, total)`` of the rank's routed experts (None: no MoE); ``vocab``: the rank's
    rows of the embedding and head; ``tp``: the rank's :class:`TensorParallel` (set by the
    runtime once the group exists; None while the plan is only checked)."""

    family: str
    size: int
    rank: int
    global_config: Any
    local_config: Any
    rules: tuple[Rule, ...] = ()
    experts: tuple[int, int, int] | None = None
    vocab: tuple[int, int] | None = None
    sharded: bool = True
    notes: tuple[str, ...] = ()
    block_of: Callable[[str, str, tuple[int, ...]], tuple[int, int] | None] | None = field(default=None, repr=False)
    tp: TensorParallel | None = None

    # -- names ----------------------------------------------------------------------------
    def owns(self, stored: str) -> bool:
        """Whether this rank reads the stored tensor at all (another rank's expert: no)."""
        if self.experts is None:
            return True
        m = _EXPERT.match(stored)
        if m is None:
            return True
        first, count, _ = self.experts
        return first <= int(m["e"]) < first + count

    def local_name(self, stored: str) -> str:
        """A stored name as the rank's model names it (its experts numbered from 0)."""
        m = _EXPERT.match(stored) if self.experts is not None else None
        if m is None:
            return stored
        return f"{m['head']}{int(m['e']) - self.experts[0]}{m['tail']}"  # type: ignore[index]

    def global_name(self, local: str) -> str:
        m = _EXPERT.match(local) if self.experts is not None else None
        if m is None:
            return local
        return f"{m['head']}{int(m['e']) + self.experts[0]}{m['tail']}"  # type: ignore[index]

    def split_of(self, stored: str) -> Split | None:
        """The split of a stored tensor (a weight's block scale: see :class:`ShardedCheckpoint`);
        None: read whole (replicated, or one of the rank's experts)."""
        for rule in self.rules:
            if rule.pattern.search(stored):
                return rule.split
        return None

    def kind_of(self, stored: str) -> str:
        """``column`` / ``row`` / ``vocab`` / ``head`` / ``expert`` (a routed expert's) or ``replicated``."""
        s = self.split_of(stored)
        if s is not None:
            return s.kind
        if self.experts is not None and _EXPERT.match(stored):
            return "expert"
        return "replicated"

    # -- checks before any rank starts ---------------------------------------------------
    def check_checkpoint(self, ckpt: Any) -> None:
        """Refuse (one line, the tensor and the TP size) a split that cuts a stored
        quantized weight's scale block, or a tensor whose stored size disagrees with the
        plan. Headers only."""
        for name in sorted(ckpt.tensor_names(), key=_natural):
            split = self.split_of(name)
            if split is None or _is_scale(name):
                continue
            shape = tuple(ckpt.shape(name))
            quantized = quantized_weight(ckpt, name)
            packed = quantized and ckpt.st_dtype(name) in ("I8", "U8") and split.dim == len(shape) - 1
            logical = (shape[split.dim] * (2 if packed else 1)) if split.dim < len(shape) else 0
            if max(b for _a, b in split.ranges) > logical:
                raise EngramError(
                    f"--tp {self.size}: tensor {name} has shape {list(shape)}, too small for the "
                    f"{self.family} config's split over {self.size} ranks; the config does not describe "
                    f"this checkpoint"
                )
            if not quantized or self.block_of is None or split.dim < len(shape) - 2:
                continue
            block = self.block_of(name, ckpt.st_dtype(name), shape)
            if block is None:
                continue
            rows = split.dim == len(shape) - 2
            b = block[0] if rows else block[1]
            for a, e in split.ranges:
                if a % b or (e % b and e != logical):
                    kind = "FP4" if ckpt.st_dtype(name) in ("I8", "U8") else "FP8"
                    raise EngramError(
                        f"--tp {self.size}: tensor {name} is stored {kind} in {block[0]}x{block[1]} "
                        f"blocks, and rank {self.rank}'s {'rows' if rows else 'columns'} {a}..{e} of "
                        f"{logical} do not start and end on block boundaries (multiples of {b}); serve "
                        f"it with a --tp whose shards hold whole blocks"
                    )


def quantized_weight(ckpt: Any, name: str) -> bool:
    """Whether ``name`` is a weight stored FP8 / packed FP4 with a block scale beside it."""
    if not name.endswith(".weight") or ckpt.st_dtype(name) not in ("F8_E4M3", "I8", "U8"):
        return False
    base = name[: -len(".weight")]
    return any(base + s in ckpt for s in SCALE_SUFFIXES)


def _is_scale(name: str) -> bool:
    return name.endswith(SCALE_SUFFIXES)


def not_sharded(family: str, config: Any, size: int, rank: int = 0) -> ParallelPlan:
    """The plan of a family whose backbone is not split: every rank holds it whole."""
    return ParallelPlan(family, size, rank, config, config, sharded=False)


# -- rank ranges the plans share ----------------------------------------------------------
def head_range(count: int, tp: int, rank: int, what: str, family: str) -> tuple[int, int]:
    """The rank's heads ``[first, first + count / tp)``; refused unless ``tp`` divides them."""
    if count % tp:
        raise EngramError(
            f"--tp {tp}: {family}'s {what}={count} do not divide over {tp} ranks; use a --tp that "
            f"divides {count} ({', '.join(str(d) for d in divisors(count) if d > 1) or 'none but 1'})"
        )
    n = count // tp
    return rank * n, rank * n + n


def kv_head_range(kv: int, heads: int, tp: int, rank: int, what: str, family: str) -> tuple[int, int]:
    """The key / value heads the rank's query heads read: ``kv / tp`` of them when ``tp``
    divides ``kv``, else the one each rank's heads share when ``kv`` divides ``tp``
    (replicated over ``tp / kv`` ranks); anything else refused."""
    if kv % tp == 0:
        n = kv // tp
        return rank * n, rank * n + n
    if tp % kv == 0 and heads % tp == 0:
        h = rank * kv // tp
        return h, h + 1
    raise EngramError(
        f"--tp {tp}: {family}'s {what}={kv} neither divide over {tp} ranks nor divide {tp} (each rank "
        f"would read key heads another rank also holds in part); use a --tp that divides {kv} or that "
        f"{kv} divides"
    )


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# -- the rank's view of a checkpoint ------------------------------------------------------
class ShardedCheckpoint:
    """A checkpoint as one rank's loader sees it (module docstring): the
    :class:`~engram_trt.checkpoint.checkpoint.Checkpoint` interface the families' loaders
    read (``tensor_names``, ``in``, ``shape``, ``dtype``, ``st_dtype``, ``nbytes``,
    ``locate``, ``get``, ``lazy``), over local names and local shapes; ``get`` reads only
    the rank's slice."""

    def __init__(self, ckpt: Any, plan: ParallelPlan) -> None:
        self.ckpt = ckpt
        self.plan = plan
        self.path = ckpt.path
        self.config = ckpt.config
        self.architecture = ckpt.architecture  # the registry's entry (None: opened without the registry)
        self._global = {plan.local_name(n): n for n in ckpt.tensor_names() if plan.owns(n)}
        self._names = sorted(self._global, key=_natural)

    # -- names ------------------------------------------------------------------------
    def tensor_names(self) -> list[str]:
        return list(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._global

    def stored_name(self, local: str) -> str:
        try:
            return self._global[local]
        except KeyError:
            from engram_trt.errors import CheckpointError

            raise CheckpointError(
                f"checkpoint '{self.path}' has no tensor '{local}' for TP rank {self.plan.rank} "
                f"(the checkpoint does not match its config.json)"
            ) from None

    # -- what is read -------------------------------------------------------------------
    def _weight_of_scale(self, stored: str) -> str | None:
        """The quantized weight whose block scale ``stored`` is (None: not a scale of one)."""
        for s in SCALE_SUFFIXES:
            if stored.endswith(s):
                w = stored[: -len(s)] + ".weight"
                if w in self.ckpt and quantized_weight(self.ckpt, w):
                    return w
        return None

    def read_split(self, stored: str) -> Split | None:
        """The split of ``stored`` in stored units: a packed FP4 weight's columns halved,
        a quantized weight's scale cut by blocks (None: the whole tensor)."""
        plan = self.plan
        weight = self._weight_of_scale(stored)
        if weight is None:
            split = plan.split_of(stored)
            if split is None:
                return None
            shape = self.ckpt.shape(stored)
            if (
                split.dim == len(shape) - 1
                and self.ckpt.st_dtype(stored) in ("I8", "U8")
                and quantized_weight(self.ckpt, stored)
            ):
                return Split(split.kind, split.dim, tuple((a // 2, b // 2) for a, b in split.ranges))
            return split
        split = plan.split_of(weight)
        if split is None:
            return None
        wshape = tuple(self.ckpt.shape(weight))
        block = plan.block_of(weight, self.ckpt.st_dtype(weight), wshape) if plan.block_of is not None else None
        if block is None or split.dim < len(wshape) - 2:
            return None if block is None else split  # one scale for the whole weight / a stacked dim: as the data
        b = block[0] if split.dim == len(wshape) - 2 else block[1]
        return Split(split.kind, split.dim, tuple((a // b, -(-e // b)) for a, e in split.ranges))

    def shape(self, local: str) -> tuple[int, ...]:
        stored = self.stored_name(local)
        shape = list(self.ckpt.shape(stored))
        split = self.read_split(stored)
        if split is not None:
            shape[split.dim] = split.length
        return tuple(shape)

    def dtype(self, local: str) -> Any:
        return self.ckpt.dtype(self.stored_name(local))

    def st_dtype(self, local: str) -> str:
        return self.ckpt.st_dtype(self.stored_name(local))

    def nbytes(self, local: str) -> int:
        stored = self.stored_name(local)
        full = self.ckpt.nbytes(stored)
        split = self.read_split(stored)
        if split is None:
            return int(full)
        shape = self.ckpt.shape(stored)
        return int(full) * split.length // max(int(shape[split.dim]), 1)

    def locate(self, local: str) -> Any:
        return self.ckpt.locate(self.stored_name(local))

    def get(self, local: str) -> Any:
        stored = self.stored_name(local)
        split = self.read_split(stored)
        if split is None:
            return self.ckpt.get(stored)
        return self.ckpt.get_slice(stored, split.dim, split.ranges)

    def lazy(self, names: Iterable[str] | None = None) -> Any:
        from engram_trt.checkpoint.checkpoint import LazyTensors

        return LazyTensors(self, names)  # type: ignore[arg-type]

    def close(self) -> None:
        self.ckpt.close()


def _natural(name: str) -> tuple[Any, ...]:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


# -- what a rank holds ------------------------------------------------------------------------
def held_bytes(module: Any) -> int:
    """Bytes of a model's weights as held: its parameters and persistent buffers, each
    byte once (views of one stack count the stack once; a view into a file map counts
    the bytes it covers, not the whole map)."""
    spans: dict[tuple[Any, int], list[tuple[int, int]]] = {}
    for mod in module.modules():
        tensors = list(mod._parameters.values()) + [
            t for k, t in mod._buffers.items() if k not in mod._non_persistent_buffers_set
        ]
        for t in tensors:
            if t is None or t.is_meta or t.numel() == 0:
                continue
            base = t.untyped_storage().data_ptr()
            start = t.data_ptr() - base
            extent = (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))) * t.element_size()
            spans.setdefault((t.device, base), []).append((start, start + extent))
    total = 0
    for parts in spans.values():
        end = -1
        for a, b in sorted(parts):
            if a >= end:
                total += b - a
            elif b > end:
                total += b - end
            end = max(end, b)
    return total


def rank_bytes(plan: ParallelPlan, formats: dict[str, tuple[str, int, int]], shapes: dict[str, tuple[int, ...]]) -> int:
    """The bytes rank ``plan.rank`` places of a model whose weights take ``formats`` (stored
    name -> ``(kind, stored bytes, bytes placed)``, the architecture's ``weight_formats``),
    ``shapes`` the stored shapes: each tensor's share by its split."""
    total = 0
    for name, (_kind, _stored, placed) in formats.items():
        if not plan.owns(name):
            continue
        split = plan.split_of(name)
        if split is None or name not in shapes:
            total += placed
            continue
        full = int(shapes[name][split.dim]) if split.dim < len(shapes[name]) else 1
        total += placed * split.length // max(full, 1)
    return total


__all__ = [
    "ParallelPlan",
    "Rule",
    "ShardedCheckpoint",
    "Split",
    "TensorParallel",
    "cols_split",
    "divisors",
    "gather_heads",
    "gather_vocab",
    "head_range",
    "held_bytes",
    "is_parallel",
    "kv_head_range",
    "localize_experts",
    "not_sharded",
    "rank_bytes",
    "reduce",
    "rows_split",
    "split_ranges",
    "vocab_parallel_embedding",
]
