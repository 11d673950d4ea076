"""Files and folders as the tests see them: the repository root, sha256 of a file or a whole
tree (the tests' own, independent of the package's manifest hashing), the golden vectors."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the repository root
TESTS = REPO / "tests"  # the tests' root (on sys.path: tests/conftest.py puts it there)
DATA = TESTS / "data"  # the test data: golden vectors, tiny checkpoints (tests/data/README.md)


def file_sha256(path: str | Path, offset: int = 0, nbytes: int | None = None) -> str:
    """sha256 of ``nbytes`` bytes of a file from ``offset`` (default: to its end), read
    in 16 MiB pieces (demo shards are over a GiB). The tests' own, independent of the
    package's manifest hashing."""
    p = Path(path)
    left = p.stat().st_size - offset if nbytes is None else nbytes
    h = hashlib.sha256()
    with open(p, "rb") as f:
        f.seek(offset)
        while left > 0:
            chunk = f.read(min(left, 1 << 24))
            assert chunk, f"{p} ends before offset {offset} + {nbytes} bytes"
            h.update(chunk)
            left -= len(chunk)
    return h.hexdigest()


def golden_dir() -> Path:
    """The golden vectors: the repository's own copy (``tests/data``, so a clone anywhere
    passes), or ``$ENGRAM_TRT_GOLDEN`` to test against another set."""
    env = os.environ.get("ENGRAM_TRT_GOLDEN")
    candidates = [Path(env)] if env else [DATA]
    for c in candidates:
        if (c / "engram_hash_public.json").is_file():
            return c
    raise FileNotFoundError(
        f"golden vectors not found in {[str(c) for c in candidates]}; "
        "set ENGRAM_TRT_GOLDEN to the folder holding engram_hash_public.json"
    )


def tree_digest(folder: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under ``folder`` (links as their target text)."""
    out: dict[str, str] = {}
    for p in sorted(Path(folder).rglob("*")):
        rel = str(p.relative_to(folder))
        if p.is_symlink():
            out[rel] = "link:" + os.readlink(p)
        elif p.is_file():
            out[rel] = file_sha256(p)
    return out
