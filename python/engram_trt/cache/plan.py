"""What one cache step decides, as plain records: the step's plan (its lookups
de-duplicated and resolved against the cache), the row copies it orders and the
admission's draws. The policy (``policy.py``) makes them; both of its implementations,
the fused kernels and the torch reference (``reference.py``), carry them out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class StepPlan:
    """One step's lookups, de-duplicated and resolved against the cache. The tensors of
    the fused path are views of the policy's buffers: valid until the next plan."""

    positions: Any  # [n] int32 on the policy's device: the work-table row of every lookup
    miss_rows: Any  # [M] int32 on the policy's device: the distinct uncached rows, miss j at miss_base + j
    miss_rows_host: Any  # [M] int32 on the CPU: the same (what the host gather fetches)
    miss_base: int
    num_lookups: int
    num_unique: int  # distinct rows (out-of-range ids count as one sentinel row)
    num_miss: int


@dataclass
class RowCopy:
    """Copy work-table rows ``src`` to cache slots ``dst`` (where ``mask``, if given)."""

    dst: Any
    src: Any
    mask: Any = None


@dataclass
class Admission:
    """A step's admission as far as the host decides it (the RNG draws): what both
    implementations carry out, so that they consume the generator identically."""

    num_free: int  # misses [0, num_free) take slots filled, filled + 1, ...
    num_candidates: int = 0  # replacement tries
    candidate_start: int = 0
    candidate_stride: int = 1
    sample_first: int = 0
    sample_factor: int = 1
