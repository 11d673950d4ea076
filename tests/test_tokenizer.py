"""Tokenizer compression: keys merge case/accents/space variants; the map is cached by
the tokenizer file's content."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engram_trt.engram.tokenizer import _cached_map, build_compressed_vocab, load_tokenizer


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
    # The second call reads the cache: prove it by planting a recognisable map there.
    planted = np.array([0, 1, 1, 3, 2], dtype=np.int32)
    np.save(cached, planted)
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
