"""Qwen4Exp's PLE tables, kept out of the module's parameters: each PLE layer's
``ngram_embedding`` is stored as checkpoint shards (``...ngram_embedding.shard_{i}.weight``,
split along the rows), bound here as one table without concatenating them in RAM.

The shards are what transformers' save writes: ``torch.chunk(table, split_ngram_parts)``,
chunks of ``ceil(rows / parts)`` rows, the last one shorter, so ``ceil(rows / chunk)``
shards, which can be fewer than ``split_ngram_parts`` (4064 rows in 512 parts: 508 shards
of 8 rows). :func:`chunk_rows` gives them; exactly those are accepted, and a shard count or
shard size ``torch.chunk`` would not write is refused with the shard's name.

Where the rows live is the Engram tables' machinery (:mod:`engram_trt.tables`): the
shards are :class:`~engram_trt.tables.source.TableRef` regions (``part`` 0..n-1 of the
layer's table, each with its own sha256 / block hashes once recorded), opened in any of
the five stores (:func:`~engram_trt.tables.store.open_tables`; ``--engram-config``
picks the kind through :func:`~engram_trt.tables.store.table_kind_for`, as for an
Engram model): ``file`` maps the shards in place (only the pages of the rows asked for
are read), ``memory`` / ``pinned`` / ``shared`` / ``device`` fill one buffer per layer
shard by shard (never a second copy in RAM). Rows are gathered by
:class:`~engram_trt.tables.rowgather.StoreGather` (the reference gather on a CPU; on a
GPU the UVA gather kernel or the host gather for bf16 rows), or, with
``--engram-config.hot_cache_fraction`` above 0, by the hot-row cache in front of them
(:class:`~engram_trt.cache.storecache.CachedStoreGather`: that share of each host
table's rows in HBM, only a step's misses fetched; the same rows, any of the three
dtypes).

FP8 tables: a checkpoint whose ``quantization_config.modules_to_convert`` names the
``ngram_embedding`` (transformers' ``FP8Embedding``) stores each layer's shards as
``F8_E4M3`` with one float32 ``...ngram_embedding.weight_scale`` for the whole table
(``W = e4m3 * scale``). The stores hold the FP8 bytes (:attr:`TableRef.table_scale
<engram_trt.tables.source.TableRef.table_scale>` marks them); the gathered rows are
dequantized on their device, row by row, after the gather (:meth:`PLETables.gather`):
the rows travel as one byte per value. The gather kernel's FP8 path takes per-row
ue8m0 block scales (Engram's layout), not one float per table, so these rows take the
reference gather (torch indexing on the device or the host, then the copy) on a GPU too.

The checks at open name the first problem: a shard missing or short, a width other
than ``ple_embed_dim / heads``, a row count other than the one the config's primes
give, or checkpoint buffers (multipliers, head sizes, offsets) that disagree with the
config.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Sequence

import numpy as np
import torch

from engram_trt.errors import CheckpointError, EngramError

log = logging.getLogger(__name__)

PLE_TABLE_KINDS = ("memory", "device", "pinned", "shared", "file")  # = tables.base.TABLE_KINDS
_ROW_DTYPES = ("BF16", "F16", "F32")
ONE = ((1,), ())  # the shapes of one per-table scale


def ple_layout(config: Any) -> Any:
    """The PLE hash layout of a config (:class:`~engram_trt.engram.ple_hash.PLEHashLayout`:
    the table rows its primes give), its primes searched once per PLE spec."""
    return _ple_layout(config.vocab_size, config.ple, config.first_eos)


@functools.lru_cache(maxsize=8)
def _ple_layout(vocab_size: int, p: Any, eos: int) -> Any:
    from engram_trt.engram.ple_hash import PLEHashLayout

    return PLEHashLayout.from_config(
        vocab_size=vocab_size,
        ngram_size=p.ngram_size,
        heads_per_ngram=p.heads_per_ngram,
        ngram_vocab_size_base=p.vocab_size_base,
        make_ngram_vocab_size_divisible_by=p.divisible_by,
        seed=p.seed,
        eos_token_id=eos,
        num_layers=len(p.layers),
    )


def chunk_rows(rows: int, parts: int) -> list[int]:
    """The rows of each shard ``torch.chunk`` writes of a ``rows``-row table split into
    ``parts``: ``ceil(rows / parts)`` each, the last what is left; ``ceil(rows / chunk)``
    shards, possibly fewer than ``parts``."""
    if rows <= 0 or parts <= 0:
        return []
    chunk = -(-rows // parts)
    n = -(-rows // chunk)
    return [chunk] * (n - 1) + [rows - chunk * (n - 1)]


def shard_names(prefix: str, layer: int, parts: int, rows: int | None = None) -> list[str]:
    """The shard names of PLE layer ``layer`` (0-based decoder layer): as many as
    ``torch.chunk`` writes of a ``rows``-row table in ``parts`` (:func:`chunk_rows`), or
    ``parts`` names without ``rows`` (every name a save may hold)."""
    n = parts if rows is None else len(chunk_rows(rows, parts))
    return [f"{prefix}layers.{layer}.ple.ple_embedding.ngram_embedding.shard_{i}.weight" for i in range(n)]


def table_shard_names(config: Any, li: int, layout: Any = None) -> list[str]:
    """PLE layer index ``li``'s shard names, as many as the save writes of the table the
    config's primes give (``layout``: the config's PLE hash layout, made if not given)."""
    if layout is None:
        layout = ple_layout(config)
    ple = config.ple
    return shard_names(config.weight_prefix, ple.layers[li], ple.split_parts, int(layout.table_rows[li]))


def table_scale_name(prefix: str, layer: int) -> str:
    """The float32 scale of an FP8 PLE table (transformers' ``FP8Embedding.weight_scale``)."""
    return f"{prefix}layers.{layer}.ple.ple_embedding.ngram_embedding.weight_scale"


def fp8_declared(config: Any, layer: int) -> bool:
    """Whether the config declares PLE layer ``layer``'s table FP8: transformers swaps an
    ``nn.Embedding`` whose name ends with an entry of ``quantization_config.modules_to_convert``
    (and that ``modules_to_not_convert`` does not keep) for an ``FP8Embedding``."""
    from engram_trt.checkpoint.checkpoint import listed_not_to_convert

    quant = config.quant
    if quant is None:
        return False
    module = f"{config.weight_prefix}layers.{layer}.ple.ple_embedding.ngram_embedding"
    return any(module.endswith(p) for p in quant.modules_to_convert) and listed_not_to_convert(module, quant) is None


def table_scales(ckpt: Any, config: Any) -> list[float | None]:
    """Per PLE layer, its FP8 table's scale (None: float rows); checked by :func:`table_problems`."""
    out: list[float | None] = []
    for layer in config.ple.layers:
        name = table_scale_name(config.weight_prefix, layer)
        out.append(float(ckpt.get(name).reshape(-1)[0]) if fp8_declared(config, layer) and name in ckpt else None)
    return out


def buffer_names(prefix: str, layer: int) -> dict[str, str]:
    base = f"{prefix}layers.{layer}.ple.ple_embedding."
    return {
        "multipliers": base + "layer_multipliers",
        "vocab_sizes": base + "ngram_heads_vocab_sizes",
        "offsets": base + "ngram_heads_offsets",
    }


def table_problems(ckpt: Any, config: Any, layout: Any) -> list[str]:
    """One line per problem of the checkpoint's PLE tables and buffers (empty = fine): a
    shard missing, of another width, dtype or row count than ``torch.chunk`` writes of the
    table the config's primes give, or one more than it writes."""
    ple = config.ple
    out: list[str] = []
    for li, layer in enumerate(ple.layers):
        want_rows = int(layout.table_rows[li])
        sizes = chunk_rows(want_rows, ple.split_parts)
        names = shard_names(config.weight_prefix, layer, ple.split_parts, want_rows)
        how = (
            f"torch.chunk(table, split_ngram_parts={ple.split_parts}) writes {len(sizes)} shard(s) of "
            f"{sizes[0]} rows{f' (the last {sizes[-1]})' if sizes[-1] != sizes[0] else ''}"
        )
        stem = names[0].rsplit(".shard_", 1)[0] + ".shard_"
        extra = sorted(
            (n for n in ckpt.tensor_names() if n.startswith(stem) and n not in names), key=lambda n: (len(n), n)
        )
        rows = 0
        fp8 = fp8_declared(config, layer)
        if fp8:
            scale_name = table_scale_name(config.weight_prefix, layer)
            if scale_name not in ckpt:
                out.append(
                    f"scale {scale_name} of layer {layer + 1}'s FP8 PLE table is missing (an FP8Embedding "
                    f"stores one float32 weight_scale per table)"
                )
            elif ckpt.st_dtype(scale_name) not in ("F32", "BF16", "F16") or tuple(ckpt.shape(scale_name)) not in ONE:
                out.append(
                    f"scale {scale_name} is {ckpt.st_dtype(scale_name)} {list(ckpt.shape(scale_name))} "
                    f"(expected one float32 for the table, shape [1])"
                )
            else:
                v = float(ckpt.get(scale_name).reshape(-1)[0])
                if not 0 < v < float("inf"):
                    out.append(f"scale {scale_name} is {v} (expected a positive finite float)")
        if extra:
            out.append(
                f"PLE table of layer {layer + 1} has a shard torch.chunk does not write: {extra[0]} ({how} of "
                f"its {want_rows}-row table: shards 0..{len(names) - 1})"
            )
            names, rows = [], -1
        for name in names:
            if name not in ckpt:
                out.append(
                    f"PLE table shard {name} is missing ({how} of layer {layer + 1}'s {want_rows}-row table, "
                    f"rows of width {ple.head_dim})"
                )
                rows = -1
                break
            shape = ckpt.shape(name)
            if len(shape) != 2 or shape[1] != ple.head_dim:
                out.append(
                    f"PLE table shard {name} has shape {list(shape)} but rows of width ple_embed_dim / heads = "
                    f"{ple.head_dim}"
                )
                rows = -1
                break
            st = ckpt.st_dtype(name)
            if fp8 and st != "F8_E4M3":
                out.append(
                    f"PLE table shard {name} is {st} but quantization_config.modules_to_convert declares layer "
                    f"{layer + 1}'s ngram_embedding FP8 (expected F8_E4M3 rows, one weight_scale per table)"
                )
            elif not fp8 and st not in _ROW_DTYPES:
                hint = (
                    " (an FP8 table is declared by quantization_config.modules_to_convert naming ngram_embedding, "
                    "as transformers' FP8Embedding)"
                    if st == "F8_E4M3"
                    else ""
                )
                out.append(f"PLE table shard {name} is {st} (expected BF16, F16 or F32 rows){hint}")
            rows += shape[0]
        if rows >= 0 and rows != want_rows:
            out.append(
                f"PLE table of layer {layer + 1} has {rows} rows in its {len(names)} shards but the config's primes "
                f"(ngram_vocab_size_base={ple.vocab_size_base}, heads_per_ngram={ple.heads_per_ngram}, "
                f"make_ngram_vocab_size_divisible_by={ple.divisible_by}) give {want_rows}: "
                "the table and the config disagree"
            )
        elif rows >= 0:
            for name, size in zip(names, sizes):
                got = ckpt.shape(name)[0]
                if got != size:
                    out.append(
                        f"PLE table shard {name} has {got} rows but {how} of the {want_rows}-row table: "
                        f"shard {names.index(name)} holds {size}; re-save the table as transformers does"
                    )
                    break
        for key, name in buffer_names(config.weight_prefix, layer).items():
            if name not in ckpt:
                continue
            got = ckpt.get(name).to(torch.int64).numpy()
            want = {
                "multipliers": layout.multipliers[li],
                "vocab_sizes": layout.head_vocab_sizes[li],
                "offsets": layout.head_offsets[li],
            }[key]
            if got.shape != np.shape(want) or not np.array_equal(got, want):
                out.append(
                    f"checkpoint buffer {name} = {got.tolist()[:6]} differs from the {key.replace('_', ' ')} the "
                    f"config gives ({np.asarray(want).tolist()[:6]}): the table was hashed with other settings"
                )
    return out


def ple_table_refs(ckpt: Any, config: Any, layout: Any = None) -> list[Any]:
    """Per PLE layer, one :class:`~engram_trt.tables.source.TableRef` per shard (``part``
    in row order; ``layer_id`` the 0-based decoder layer, ``layer_index`` the PLE layer's
    position; an FP8 table's scale as ``table_scale``): where each shard's bytes are in the
    checkpoint's files. No hashes: a checkpoint records none
    (:func:`~engram_trt.tables.source.hash_tables` adds them)."""
    from engram_trt.tables.source import TableRef

    ple = config.ple
    refs = []
    if layout is None:
        layout = ple_layout(config)
    scales = table_scales(ckpt, config)
    for li, layer in enumerate(ple.layers):
        for part, name in enumerate(table_shard_names(config, li, layout)):
            info = ckpt.info(name)
            refs.append(
                TableRef(
                    layer,
                    li,
                    "rows",
                    name,
                    info.file.resolve(),
                    info.data_offset,
                    info.nbytes,
                    tuple(info.shape),
                    info.st_dtype,
                    part=part,
                    table_scale=scales[li],
                )
            )
    return refs


class PLETables:
    """Per PLE layer, its shards bound as one table in a table store (module docstring).

    ``owns_store``: :meth:`close` closes the store too (False when the runtime opened
    it and closes it itself). ``hot_cache_fraction`` > 0: the host tables' rows go
    through a hot-row cache holding that share of each table in HBM (``cache_options``:
    :class:`~engram_trt.cache.storecache.CachedStoreGather`'s)."""

    def __init__(
        self,
        store: Any,
        device: Any = "cpu",
        owns_store: bool = True,
        hot_cache_fraction: float = 0.0,
        cache_options: dict[str, Any] | None = None,
        table_scales: Sequence[float | None] | None = None,
    ) -> None:
        from engram_trt.tables.rowgather import StoreGather

        self.store = store
        self.head_dim = store.head_dim(0) if store.num_layers else 0
        # Per layer, an FP8 table's scale (its rows dequantized after the gather); None: float rows.
        self.table_scales = list(table_scales) if table_scales is not None else [None] * store.num_layers
        if len(self.table_scales) != store.num_layers:
            raise EngramError(f"{len(self.table_scales)} table scales for {store.num_layers} PLE tables")
        for li, scale in enumerate(self.table_scales):
            fp8 = store.row_dtype(li) == torch.float8_e4m3fn
            if fp8 != (scale is not None):
                raise EngramError(
                    f"PLE table {li} is {store.row_dtype(li)} but its table scale is {scale}: FP8 rows "
                    f"come with their table's scale, float rows without one"
                )
        if hot_cache_fraction and any(s is not None for s in self.table_scales):
            raise EngramError(
                "the hot-row cache does not hold FP8 PLE rows yet: serve this checkpoint with "
                "--engram-config.hot_cache_fraction 0"
            )
        if hot_cache_fraction:
            from engram_trt.cache.storecache import CachedStoreGather

            self._gather: StoreGather | CachedStoreGather = CachedStoreGather(
                store, device, capacity_fraction=hot_cache_fraction, **(cache_options or {})
            )
        else:
            if cache_options:
                raise EngramError("cache_options need a hot-row cache: pass hot_cache_fraction > 0 too")
            self._gather = StoreGather(store, device)
        self._owns_store = owns_store

    @classmethod
    def from_checkpoint(
        cls,
        ckpt: Any,
        config: Any,
        layout: Any,
        kind: str = "file",
        device: Any = "cpu",
        progress: bool = False,
        hot_cache_fraction: float = 0.0,
        **options: Any,
    ) -> "PLETables":
        """Check the checkpoint's PLE tables, then open them in a ``kind`` store
        (``options``: the pinned / shared stores'; ``hot_cache_fraction``: see the class)."""
        from engram_trt.tables.store import open_tables

        problems = table_problems(ckpt, config, layout)
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise CheckpointError(f"checkpoint '{ckpt.path}': {problems[0]}{more}")
        if kind not in PLE_TABLE_KINDS:
            raise EngramError(f"PLE table kind {kind!r} is not one of {list(PLE_TABLE_KINDS)}")
        refs = ple_table_refs(ckpt, config, layout)
        store = open_tables(refs, kind, device=device, progress=progress, **options)
        log.info("PLE tables: %d layer(s) in %s", store.num_layers, store.where())
        return cls(store, device, hot_cache_fraction=hot_cache_fraction, table_scales=table_scales(ckpt, config))

    @classmethod
    def from_tensors(cls, tables: Sequence[torch.Tensor], kind: str = "memory", **options: Any) -> "PLETables":
        """Tables from tensors (``options``: the class's, e.g. ``hot_cache_fraction``)."""
        from engram_trt.tables.base import TableStore

        store = TableStore.from_tensors(list(tables), [None] * len(tables))
        return cls(store, tables[0].device if tables else "cpu", **options)

    @property
    def kind(self) -> str:
        return self.store.kind

    @property
    def paths(self) -> list[str]:
        """The gather path of each layer (:mod:`engram_trt.tables.rowgather`)."""
        return list(self._gather.paths)

    @property
    def num_layers(self) -> int:
        return self.store.num_layers

    def num_rows(self, layer_idx: int) -> int:
        return self.store.num_rows(layer_idx)

    def nbytes(self) -> int:
        return self.store.table_bytes()

    def gather(
        self, layer_idx: int, ids: torch.Tensor, checked: bool = True, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Rows ``ids`` (int64, any shape) of one layer's table: ``[*ids.shape, head_dim]``
        on ``ids``' device, in the table's dtype (an FP8 table's: float32, the rows times
        its scale, as transformers' FP8Embedding computes them). ``checked`` / ``out``: see
        :meth:`~engram_trt.tables.rowgather.StoreGather.gather` (the model passes
        ``checked=False`` for the hash's ids on a GPU: no host sync per layer)."""
        try:
            rows = self._gather.gather(layer_idx, ids, checked=checked, out=out)
        except EngramError as exc:
            raise EngramError(f"PLE layer {layer_idx}: {exc}") from None
        scale = self.table_scales[layer_idx]
        if scale is not None:  # FP8 rows: moved as bytes, dequantized row by row where they land
            return rows.to(ids.device).to(torch.float32) * scale
        return rows.to(ids.device)

    def cache_stats(self) -> list[dict[str, Any] | None] | None:
        """Per layer, the hot-row cache's counters (None: no cache)."""
        return self._gather.stats()

    def check_bad_rows(self) -> None:
        """Raise when an unchecked gather met an id outside its table (a device sync)."""
        self._gather.check_bad_rows()

    def close(self) -> None:
        self._gather.close()
        if self._owns_store:
            self.store.close()
