"""Tokenizer compression: keys merge case/accents/space variants; the map is cached by
the tokenizer file's content."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import logging
import zipfile

from engram_trt.engram.tokenizer import _cached_map, build_compressed_vocab, load_tokenizer, write_cached_map


def _tokenizer(path: Path, words: list[str]) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


def test_variants_share_a_key(tmp_path):
    path = _tokenizer(tmp_path / "tokenizer.json", ["<unk>", "Cat", "cat", "CAT", "café", "cafe", "dog", "ﬁ", "fi"])
    v = build_compressed_vocab(path)
    lk = v.lookup.tolist()
    assert lk[1] == lk[2] == lk[3]  # case
    assert lk[4] == lk[5]  # accents
    assert lk[7] == lk[8]  # NFKC ligature
    assert len({lk[0], lk[1], lk[4], lk[6], lk[7]}) == 5
    assert v.size == 5
    seen: list[int] = []
    for c in lk:  # new keys take ids in order of first appearance: 0, 1, 2, ...
        if c not in seen:
            assert c == len(seen)
            seen.append(c)


def test_map_is_cached_by_content(tmp_path, monkeypatch):
    monkeypatch.setenv("ENGRAM_TRT_CACHE", str(tmp_path / "cache"))
    path = _tokenizer(tmp_path / "tokenizer.json", ["<unk>", "A", "a", "b"])
    first = build_compressed_vocab(path)
    cached = _cached_map(first.source_sha256)
    assert cached.is_file()
    # The second call reads the cache: prove it by planting a recognisable (well-formed,
    # checksummed) map there.
    planted = np.array([0, 1, 1, 2, 2], dtype=np.int32)
    write_cached_map(cached, planted)
    assert build_compressed_vocab(path).lookup.tolist() == planted.tolist()
    # A changed tokenizer file is a new key, built afresh.
    path2 = _tokenizer(tmp_path / "tokenizer2.json", ["<unk>", "A", "a", "b", "B"])
    second = build_compressed_vocab(path2)
    assert second.source_sha256 != first.source_sha256
    assert second.lookup.tolist() == build_compressed_vocab(load_tokenizer(path2)).lookup.tolist()
    # A damaged cache file is ignored and rebuilt.
    cached.write_bytes(b"not an npy file")
    assert build_compressed_vocab(path).lookup.tolist() == first.lookup.tolist()


def test_uncached_object_path_matches(tmp_path):
    path = _tokenizer(tmp_path / "tokenizer.json", ["x", "X", "y"])
    assert build_compressed_vocab(load_tokenizer(path)).lookup.tolist() == build_compressed_vocab(path).lookup.tolist()


def _rewrite_entry(path: Path, lookup: np.ndarray, recorded_sha: str) -> None:
    """A cache entry with a map that its recorded checksum does not describe."""
    with open(path, "wb") as f:
        np.savez(f, lookup=lookup.astype("<i4"), lookup_sha256=np.array(recorded_sha))


def test_damaged_cache_entries_are_rebuilt_with_a_warning(tmp_path, monkeypatch, caplog):
    """Two swapped entries (which would silently change the hash rows), an all-zero
    file, a truncated file and a map in the wrong order: each is noticed, warned
    about, rebuilt from the tokenizer, and the rebuilt entry is trusted again."""
    monkeypatch.setenv("ENGRAM_TRT_CACHE", str(tmp_path / "cache"))
    path = _tokenizer(tmp_path / "tokenizer.json", ["<unk>", "A", "a", "b", "c", "C"])
    good = build_compressed_vocab(path)
    assert good.lookup.tolist() == [0, 1, 1, 2, 3, 3]
    cached = _cached_map(good.source_sha256)
    with np.load(cached) as z:
        recorded = str(z["lookup_sha256"])
    swapped = good.lookup.copy()
    swapped[[3, 4]] = swapped[[4, 3]]  # "b" <-> "c": still a well-formed map, other ids
    damages = {
        "swapped entries": lambda: _rewrite_entry(cached, swapped, recorded),
        "all-zero file": lambda: cached.write_bytes(bytes(cached.stat().st_size)),
        "truncated file": lambda: cached.write_bytes(cached.read_bytes()[: cached.stat().st_size // 2]),
        "out of order": lambda: _rewrite_entry(
            cached,
            np.array([1, 0, 0, 2, 3, 3]),
            __import__("hashlib").sha256(np.array([1, 0, 0, 2, 3, 3], "<i4").tobytes()).hexdigest(),
        ),
    }
    for what, damage in damages.items():
        damage()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="engram_trt"):
            got = build_compressed_vocab(path)
        assert got.lookup.tolist() == good.lookup.tolist(), what
        assert any("is damaged" in r.getMessage() and "rebuilding" in r.getMessage() for r in caplog.records), what
        # The rebuilt entry is whole again: the next read uses it without a warning.
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="engram_trt"):
            assert build_compressed_vocab(path).lookup.tolist() == good.lookup.tolist()
        assert not caplog.records, what
        assert zipfile.is_zipfile(cached)
