#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""`python benchmarks/lookup/rowcounts.py`: per-row lookup counts over a range of chunks of the token
stream, the offline frequencies a hot-row cache warms from (``HotRowCache(initial_counts=)``).

Why: an LFU can only serve rows it has seen, and a bounded admission learns slowly, so a
cache warmed from counts over a corpus serves rows the online policy has not met yet.
The benchmark must not count the text it then measures, so every counts file records
the token stream it came from (its fingerprint) and its chunk range, and ``bench cache``
refuses counts whose range overlaps the chunks it measures.

File (``.npz``, written via a temp name): per layer ``rows_<l>`` (int32, the rows looked
up at least once, by count descending) and ``counts_<l>`` (int32, saturated at 2^31 - 1),
and ``meta`` (JSON: format, token-stream fingerprint, column rows, table rows per layer,
first chunk, chunks, chunk tokens).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# engram_trt from this checkout and this folder's modules:
sys.path[:0] = [p for p in (str(REPO / "python"), str(Path(__file__).resolve().parent)) if p not in sys.path]

import hashlib  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Iterable  # noqa: E402

import numpy as np  # noqa: E402

from idstreams import DEFAULT_COLUMN_ROWS  # noqa: E402
from engram_trt.bench.options import opt  # noqa: E402
from engram_trt.errors import EngramError  # noqa: E402

log = logging.getLogger(__name__)

COUNTS_FORMAT = 1
_BATCH_IDS = 1 << 25  # ids per bincount: ~128 MB of ids, one accumulator add each


@dataclass
class RowCounts:
    """Dense per-layer lookup counts (int32 ``[table_rows]``) and where they came from."""

    counts: dict[int, np.ndarray]
    column_rows: int
    table_rows: list[int]
    first_chunk: int
    num_chunks: int
    chunk_tokens: int
    stream: str  # stream_fingerprint of the token stream
    path: str | None = field(default=None)

    @property
    def chunk_range(self) -> tuple[int, int]:
        return self.first_chunk, self.first_chunk + self.num_chunks

    def describe(self) -> str:
        a, b = self.chunk_range
        where = f" ({self.path})" if self.path else ""
        return f"counts over chunks {a}..{b - 1} of the token stream{where}"


def stream_fingerprint(stream: Any) -> str:
    """What identifies a token stream: its tokenizer, its files and its length."""
    text = f"{stream.tokenizer_sha256}:{stream.files_sha256}:{int(stream.ids.shape[0])}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def count_rows(chunks: Iterable[np.ndarray], table_rows: list[int], layers: list[int]) -> dict[int, np.ndarray]:
    """Lookups per row of each layer over ``chunks`` (``[tokens, L, cols]`` row ids):
    int32 ``[table_rows[l]]``, saturated. Batched bincounts into int64 accumulators."""
    acc = {li: np.zeros(int(table_rows[li]), dtype=np.int64) for li in layers}
    pending: dict[int, list[np.ndarray]] = {li: [] for li in layers}
    held = 0

    def flush() -> None:
        for li in layers:
            if pending[li]:
                ids = np.concatenate(pending[li])
                acc[li] += np.bincount(ids, minlength=acc[li].size)[: acc[li].size]
                pending[li].clear()

    for chunk in chunks:
        for li in layers:
            ids = chunk[:, li, :].reshape(-1)
            if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= acc[li].size):
                raise EngramError(
                    f"row ids of layer {li} fall outside its {acc[li].size} rows: the chunks are not of this layout"
                )
            pending[li].append(ids)
        held += int(chunk.shape[0] * chunk.shape[2])
        if held >= _BATCH_IDS:
            flush()
            held = 0
    flush()
    return {li: np.minimum(a, 2**31 - 1).astype(np.int32) for li, a in acc.items()}


def save_row_counts(rc: RowCounts, path: str | Path) -> Path:
    """Write ``rc`` sparse (rows with a nonzero count) to ``path`` via a temp name."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, np.ndarray] = {}
    for li, c in rc.counts.items():
        rows = np.flatnonzero(c)
        rows = rows[np.lexsort((rows, -c[rows].astype(np.int64)))]
        arrays[f"rows_{li}"] = rows.astype(np.int32)
        arrays[f"counts_{li}"] = c[rows].astype(np.int32)
    meta = {
        "format": COUNTS_FORMAT,
        "stream": rc.stream,
        "column_rows": rc.column_rows,
        "table_rows": rc.table_rows,
        "first_chunk": rc.first_chunk,
        "num_chunks": rc.num_chunks,
        "chunk_tokens": rc.chunk_tokens,
        "layers": sorted(rc.counts),
    }
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.npz")
    np.savez_compressed(tmp, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **arrays)
    os.replace(tmp, path)
    return path


def load_row_counts(path: str | Path) -> RowCounts:
    """Read a counts file (dense int32 per layer)."""
    path = Path(path)
    if not path.is_file():
        raise EngramError(f"{path}: no counts file; make one with `python benchmarks/lookup/rowcounts.py --out {path}`")
    with np.load(path) as z:
        meta = json.loads(bytes(z["meta"]).decode())
        if meta.get("format") != COUNTS_FORMAT:
            raise EngramError(f"{path}: counts file format {meta.get('format')} is not {COUNTS_FORMAT}; remake it")
        counts = {}
        for li in meta["layers"]:
            dense = np.zeros(int(meta["table_rows"][li]), dtype=np.int32)
            dense[z[f"rows_{li}"]] = z[f"counts_{li}"]
            counts[int(li)] = dense
    return RowCounts(
        counts=counts,
        column_rows=int(meta["column_rows"]),
        table_rows=[int(r) for r in meta["table_rows"]],
        first_chunk=int(meta["first_chunk"]),
        num_chunks=int(meta["num_chunks"]),
        chunk_tokens=int(meta["chunk_tokens"]),
        stream=str(meta["stream"]),
        path=str(path),
    )


def check_disjoint(rc: RowCounts, stream: Any, measured: tuple[int, int], layout: Any, layers: list[int]) -> str:
    """Refuse counts that cannot warm a cache measured on chunks ``measured`` = [a, b) of
    ``stream`` (another layout, or overlapping chunks); returns how they relate."""
    if rc.table_rows != [int(r) for r in layout.table_rows]:
        raise EngramError(
            f"{rc.path}: counts for tables of {rc.table_rows} rows, not this run's "
            f"{[int(r) for r in layout.table_rows]}; make them with the same --column-rows"
        )
    missing = [li for li in layers if li not in rc.counts]
    if missing:
        raise EngramError(f"{rc.path}: no counts for layer(s) {missing}; make them with --layers covering them")
    a, b = measured
    if rc.stream != stream_fingerprint(stream):
        return f"{rc.describe()}: another token stream than the measured one"
    lo, hi = rc.chunk_range
    if lo < b and a < hi:
        raise EngramError(
            f"{rc.path}: counts over chunks {lo}..{hi - 1} overlap the measured chunks {a}..{b - 1}; "
            f"count a disjoint range (bench rowcounts --first-chunk / --chunks)"
        )
    return f"{rc.describe()}, disjoint from the measured chunks {a}..{b - 1}"


@dataclass(kw_only=True)
class RowcountsOptions:
    """``python benchmarks/lookup/rowcounts.py``'s flags."""

    tokens: Path | None = opt(None, help="token file from `idstreams.py` (default: the cache's)")
    column_rows: int = opt(
        DEFAULT_COLUMN_ROWS, help="rows per column of the spec (default: %(default)s, as bench cache)"
    )
    first_chunk: int = opt(0, help="first 8k-token chunk to count (default 0)")
    chunks: int = opt(448, help="chunks to count (default 448, bench cache's warm-up)")
    layers: str = opt("0,1", help="layers to count, comma-separated (default 0,1)")
    out: Path = opt(help="counts file (.npz) to write")


def run(opts: RowcountsOptions) -> int:
    from idstreams import layer_list
    from idstreams import CHUNK_TOKENS, chunk_row_ids, default_tokens_path, load_tokens, make_layout

    if opts.chunks < 1 or opts.first_chunk < 0:
        raise EngramError("--chunks must be >= 1 and --first-chunk >= 0")
    stream = load_tokens(opts.tokens or default_tokens_path())
    layout = make_layout(opts.column_rows, stream.compressed_vocab_size, stream.pad_id)
    layers = layer_list(opts.layers, layout.num_layers)
    chunks = chunk_row_ids(stream, layout, first_chunk=opts.first_chunk, num_chunks=opts.chunks)
    seen = [0]

    def counted() -> Iterable[np.ndarray]:
        for c in chunks:
            seen[0] += 1
            yield c

    table_rows = [int(r) for r in layout.table_rows]
    counts = count_rows(counted(), table_rows, layers)
    if seen[0] < opts.chunks:
        raise EngramError(
            f"the token stream holds {seen[0]} chunks from --first-chunk {opts.first_chunk}, fewer "
            f"than --chunks {opts.chunks}"
        )
    rc = RowCounts(
        counts=counts,
        column_rows=opts.column_rows,
        table_rows=table_rows,
        first_chunk=opts.first_chunk,
        num_chunks=opts.chunks,
        chunk_tokens=CHUNK_TOKENS,
        stream=stream_fingerprint(stream),
    )
    path = save_row_counts(rc, opts.out)
    for li in layers:
        c = counts[li]
        nz = int(np.count_nonzero(c))
        print(
            f"layer {li}: {int(c.sum(dtype=np.int64)):,} lookups, {nz:,} distinct rows of {c.size:,} "
            f"({nz / c.size:.1%})"
        )
    print(f"wrote {path}: {rc.describe()}")
    return 0


OPTIONS = RowcountsOptions  # the script's flags, derived as an `engram-trt bench` command's (engram_trt.cli.bench)


def main(argv: list[str] | None = None) -> int:
    from engram_trt.cli.bench import run_script

    return run_script(OPTIONS, run, __doc__ or "", argv, prog=Path(__file__).name)


if __name__ == "__main__":
    sys.exit(main())
