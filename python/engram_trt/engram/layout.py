"""Table layout: primes, column offsets, table rows and hash multipliers.

Every (layer, order, head) hashes into its own prime-sized slice of the layer's
table. Primes are never reused, across heads, orders *and* layers: two columns with
the same prime and correlated inputs would collide on the same rows, so distinct
primes keep the heads' collisions independent (the point of multi-head hashing).
The search for each order restarts from ``vocab_size - 1`` and skips every prime
already taken, which is why it is one global sequence here rather than a per-layer
function.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from engram_trt.config.model import EngramSpec
from engram_trt.errors import ConfigError

INT64_MAX = np.iinfo(np.int64).max


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for 64-bit integers."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    for p in small:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d //= 2
        r += 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def find_primes(spec: EngramSpec) -> np.ndarray:
    """Primes ``[layer, order-2, head]`` in the spec's global search order."""
    taken: set[int] = set()
    starts = spec.prime_search_starts()
    out = np.zeros((spec.num_layers, spec.max_ngram_size - 1, spec.n_heads), dtype=np.int64)
    for li in range(spec.num_layers):
        for oi in range(spec.max_ngram_size - 1):
            current = starts[oi] - 1
            for h in range(spec.n_heads):
                current += 1
                while not is_prime(current) or current in taken:
                    current += 1
                taken.add(current)
                out[li, oi, h] = current
    return out


def layer_multipliers(layer_id: int, compressed_vocab_size: int, max_ngram_size: int) -> np.ndarray:
    """Odd int64 multipliers ``[N]`` for one layer.

    The bound keeps ``id * multiplier`` below int64 max for every compressed id, so
    the hash never relies on overflow behaviour (the same value in NumPy, PyTorch and
    CUDA). Seeding with ``10007 * layer_id`` makes the multipliers a function of the
    layer alone, not of which other layers carry Engram.
    """
    rng = np.random.default_rng(10007 * layer_id)
    bound = max(1, (INT64_MAX // compressed_vocab_size) // 2)
    return rng.integers(0, bound, size=max_ngram_size, dtype=np.int64) * 2 + 1


@dataclass(frozen=True, eq=False)
class EngramLayout:
    """Everything the hash and the tables' shapes derive from."""

    layer_ids: tuple[int, ...]
    max_ngram_size: int
    n_heads: int
    compressed_vocab_size: int
    pad_id: int
    primes: np.ndarray  # int64 [L, N-1, H]
    offsets: np.ndarray  # int64 [L, cols]
    multipliers: np.ndarray  # int64 [L, N]
    table_rows: np.ndarray  # int64 [L]
    head_dim: int | None = None

    @property
    def n_hash_cols(self) -> int:
        return (self.max_ngram_size - 1) * self.n_heads

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def col_primes(self) -> np.ndarray:
        """Primes flattened per column ``[L, cols]`` (order-major, head-minor)."""
        return self.primes.reshape(self.num_layers, self.n_hash_cols)

    @classmethod
    def from_spec(cls, spec: EngramSpec, pad_id: int) -> "EngramLayout":
        """``pad_id`` is the *compressed* id of the pad token."""
        if not 0 <= pad_id < spec.compressed_vocab_size:
            raise ConfigError(
                f"compressed pad id {pad_id} is outside 0..{spec.compressed_vocab_size - 1} "
                f"({spec.field_name('compressed_vocab_size')}={spec.compressed_vocab_size})"
            )
        primes = find_primes(spec)
        col_primes = primes.reshape(spec.num_layers, -1)
        offsets = np.zeros_like(col_primes)
        offsets[:, 1:] = np.cumsum(col_primes, axis=1)[:, :-1]
        table_rows = col_primes.sum(axis=1)
        if table_rows.max() >= 2**31:
            raise ConfigError(
                f"a layer's table needs {int(table_rows.max())} rows, over 2^31-1: row ids are int32 on the GPU; "
                f"lower {spec.field_name('vocab_size')} or {spec.field_name('n_heads')}"
            )
        if spec.num_embeddings is not None:
            for li, (need, have) in enumerate(zip(table_rows, spec.num_embeddings)):
                if have < need:
                    raise ConfigError(
                        f"{spec.field_name('num_embeddings')}[{li}]={have} does not cover the layout of layer "
                        f"{spec.layer_ids[li]}: its primes need {int(need)} rows (expected >= {int(need)})"
                    )
        mult = np.stack(
            [layer_multipliers(lid, spec.compressed_vocab_size, spec.max_ngram_size) for lid in spec.layer_ids]
        )
        return cls(
            layer_ids=spec.layer_ids,
            max_ngram_size=spec.max_ngram_size,
            n_heads=spec.n_heads,
            compressed_vocab_size=spec.compressed_vocab_size,
            pad_id=int(pad_id),
            primes=primes,
            offsets=offsets,
            multipliers=mult,
            table_rows=table_rows,
            head_dim=spec.head_dim,
        )

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "layer_ids": list(self.layer_ids),
            "max_ngram_size": self.max_ngram_size,
            "n_heads": self.n_heads,
            "n_hash_cols": self.n_hash_cols,
            "compressed_vocab_size": self.compressed_vocab_size,
            "pad_id": self.pad_id,
            "primes": self.primes.tolist(),
            "offsets": self.offsets.tolist(),
            "multipliers": self.multipliers.tolist(),
            "table_rows": self.table_rows.tolist(),
            "head_dim": self.head_dim,
        }
