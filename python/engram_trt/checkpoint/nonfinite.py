"""NaN and Inf in a checkpoint's tensors (weights and tables), found from the stored bytes.

A NaN in one weight turns every logit into NaN, and a sampler fed NaN picks token 0
forever: the model "runs" and says nothing. So ``inspect`` and ``build`` look for
non-finite values before anything else is done with the checkpoint.

The check reads the stored bytes and tests the exponent bits of each element in its
stored format (no dequantization, no torch): F64 / F32 / F16 / BF16 / F8_E5M2 hold NaN
and Inf (all exponent bits set), F8_E4M3 (``e4m3fn``) only NaN (``S.1111.111``), the
E8M0 scales only NaN (``0xFF``). Integer and packed FP4 tensors hold no non-finite
value and are skipped.

Two depths, one result type (:class:`ScanResult`, with its cost):

* full (``budget_bytes=None``): every byte of every tensor;
* sampled (the default, :data:`DEFAULT_SCAN_BYTES`): the smallest tensors whole while
  they fit half the budget (norms, biases, scales: the ones a conversion most often
  breaks), then :data:`SAMPLE_BLOCK` blocks drawn uniformly over the remaining bytes,
  so a damaged region of ``f`` of those bytes is met with probability about
  ``1 - (1 - f) ** blocks``.
"""

from __future__ import annotations

import os
import random
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np

DEFAULT_SCAN_BYTES = 256 * 1024 * 1024  # the sampled scan's budget (as tables.source's sampled check)
SAMPLE_BLOCK = 64 * 1024  # bytes per sampled block
READ_CHUNK = 16 * 1024 * 1024  # bytes per read of a full scan

# safetensors dtype -> (unsigned view, mask of the exponent (and for e4m3fn mantissa) bits,
# value of those bits for non-finite, mask of the mantissa: zero there = Inf, else NaN;
# None where the format has no Inf).
_FORMATS: dict[str, tuple[Any, int, int, int | None]] = {
    "F64": (np.uint64, 0x7FF0000000000000, 0x7FF0000000000000, 0x000FFFFFFFFFFFFF),
    "F32": (np.uint32, 0x7F800000, 0x7F800000, 0x007FFFFF),
    "F16": (np.uint16, 0x7C00, 0x7C00, 0x03FF),
    "BF16": (np.uint16, 0x7F80, 0x7F80, 0x007F),
    "F8_E5M2": (np.uint8, 0x7C, 0x7C, 0x03),
    "F8_E4M3": (np.uint8, 0x7F, 0x7F, None),  # e4m3fn: no Inf, NaN is S.1111.111
    "F8_E8M0": (np.uint8, 0xFF, 0xFF, None),  # scales: 0xFF is NaN
}


def can_hold_nonfinite(st_dtype: str) -> bool:
    return st_dtype in _FORMATS


@dataclass(frozen=True)
class Region:
    """One tensor's bytes: ``nbytes`` at ``offset`` of ``file``, stored as ``st_dtype``."""

    name: str
    file: Path
    offset: int
    nbytes: int
    st_dtype: str


@dataclass
class Finding:
    """Non-finite elements seen in one tensor (of the bytes read)."""

    name: str
    nan: int = 0
    inf: int = 0
    first: int = -1  # flat element index of the first one seen

    def line(self, sampled: bool) -> str:
        what = " and ".join(f"{n} {k}" for n, k in ((self.nan, "NaN"), (self.inf, "Inf")) if n)
        seen = " in the bytes the sampled scan read" if sampled else ""
        return (
            f"tensor {self.name} holds {what}{seen} (first at element {self.first}): the model would compute "
            f"NaN from it; re-convert or re-download the checkpoint (or fix that tensor)"
        )


@dataclass
class ScanResult:
    """What a scan found and what it cost."""

    findings: list[Finding] = field(default_factory=list)
    bytes_read: int = 0
    bytes_total: int = 0
    tensors: int = 0
    seconds: float = 0.0
    full: bool = True

    def problems(self) -> list[str]:
        return [f.line(not self.full) for f in self.findings]

    def cost(self) -> str:
        """One line: how much was read, of what, in how long."""
        from engram_trt.errors import human_bytes

        pct = 100.0 * self.bytes_read / self.bytes_total if self.bytes_total else 100.0
        how = (
            "every byte"
            if self.full
            else f"sampled {human_bytes(self.bytes_read)} of {human_bytes(self.bytes_total)} ({pct:.1f}%)"
        )
        return f"{how} of {self.tensors} float tensor(s) read in {self.seconds:.2f} s"

    def to_json(self) -> dict[str, Any]:
        return {
            "full": self.full,
            "bytes_read": self.bytes_read,
            "bytes_total": self.bytes_total,
            "tensors": self.tensors,
            "seconds": round(self.seconds, 3),
            "findings": [{"tensor": f.name, "nan": f.nan, "inf": f.inf, "first": f.first} for f in self.findings],
        }


def _check(buf: bytes | memoryview, region: Region, element0: int, finding: Finding) -> None:
    """Count the non-finite elements of ``buf`` (whole elements of ``region``, starting at
    element ``element0``) into ``finding``."""
    view, mask, bad, mantissa = _FORMATS[region.st_dtype]
    a = np.frombuffer(buf, dtype=view)
    hit = (a & view(mask)) == view(bad)
    if not hit.any():
        return
    idx = np.flatnonzero(hit)
    if mantissa is None:
        nan = int(idx.size)
    else:
        nan = int(np.count_nonzero(a[idx] & view(mantissa)))
    finding.nan += nan
    finding.inf += int(idx.size) - nan
    first = element0 + int(idx[0])
    finding.first = first if finding.first < 0 else min(finding.first, first)


def count_nonfinite(data: Any, st_dtype: str, name: str = "") -> Finding:
    """The non-finite elements of ``data`` (an array or bytes holding whole elements
    stored as ``st_dtype``), as a :class:`Finding` (zero counts: none)."""
    finding = Finding(name)
    buf = np.ascontiguousarray(data).view(np.uint8) if isinstance(data, np.ndarray) else data
    _check(buf, Region(name, Path(), 0, len(buf), st_dtype), 0, finding)
    return finding


def _read(f: Any, offset: int, n: int) -> bytes:
    data = os.pread(f.fileno(), n, offset)
    if len(data) != n:
        from engram_trt.errors import CheckpointError

        raise CheckpointError(f"{f.name}: ends before byte {offset + n} (the file is cut short; re-copy it)")
    return data


def scan_regions(
    regions: Iterable[Region], budget_bytes: int | None = DEFAULT_SCAN_BYTES, seed: int | None = None
) -> ScanResult:
    """Look for NaN / Inf in ``regions`` (see the module docstring): every byte when
    ``budget_bytes`` is None, else a sampled scan reading at most about that much."""
    t0 = time.perf_counter()
    todo = [r for r in regions if can_hold_nonfinite(r.st_dtype) and r.nbytes > 0]
    res = ScanResult(bytes_total=sum(r.nbytes for r in todo), tensors=len(todo), full=True)
    plan: list[tuple[Region, int, int]] = []  # (region, start byte in it, bytes)
    if budget_bytes is None or res.bytes_total <= budget_bytes:
        plan = [(r, 0, r.nbytes) for r in todo]
    else:
        res.full = False
        whole_budget = budget_bytes // 2
        rest: list[Region] = []
        for r in sorted(todo, key=lambda r: (r.nbytes, r.name)):
            if r.nbytes <= whole_budget:
                plan.append((r, 0, r.nbytes))
                whole_budget -= r.nbytes
            else:
                rest.append(r)
        left = budget_bytes - sum(n for _, _, n in plan)
        blocks = [(r, b) for r in rest for b in range(-(-r.nbytes // SAMPLE_BLOCK))]
        rng = random.Random(seed)
        for r, b in rng.sample(blocks, min(len(blocks), max(1, left // SAMPLE_BLOCK))):
            start = b * SAMPLE_BLOCK
            plan.append((r, start, min(SAMPLE_BLOCK, r.nbytes - start)))
    findings: dict[str, Finding] = {}
    files: dict[Path, Any] = {}
    try:
        for r, start, n in sorted(plan, key=lambda p: (str(p[0].file), p[0].offset + p[1])):
            f = files.get(r.file)
            if f is None:
                f = files[r.file] = open(r.file, "rb")
            item = np.dtype(_FORMATS[r.st_dtype][0]).itemsize
            finding = findings.setdefault(r.name, Finding(r.name))
            pos = start
            while pos < start + n:
                k = min(READ_CHUNK, start + n - pos)
                k -= k % item
                if k <= 0:
                    break
                _check(_read(f, r.offset + pos, k), r, pos // item, finding)
                res.bytes_read += k
                pos += k
    finally:
        for f in files.values():
            f.close()
    res.findings = [f for f in findings.values() if f.nan or f.inf]
    res.findings.sort(key=lambda f: f.name)
    res.seconds = time.perf_counter() - t0
    return res


# A weight's block-scale tensor names (engram_trt.quant.names.SCALE_SUFFIXES; kept here
# as strings: checkpoint/ sits below nothing that needs quant/ for this).
_SCALE_SUFFIXES = (".weight_scale_inv", ".scale")
_QUANT_WEIGHT_DTYPES = ("F8_E4M3", "I8", "U8")


# transformers' merged scale of a MoE layer's experts per projection kind -> the projections it scales
_MERGED_EXPERT_SCALES = {
    "gate_up_proj_scale_inv": ("gate_proj", "up_proj", "gate_up_proj"),
    "down_proj_scale_inv": ("down_proj",),
}


def unread_scale(ckpt: Any, name: str) -> bool:
    """A scale tensor beside a weight the checkpoint stores in floats: no loader reads it
    (transformers' FP8 save writes one, never initialized, beside every weight it left in
    16 bits, the experts' merged ``...experts.down_proj_scale_inv`` included), so garbage
    in it is no problem of the model's."""
    for suffix in _SCALE_SUFFIXES:
        if name.endswith(suffix):
            weight = name[: -len(suffix)] + ".weight"
            return weight in ckpt and ckpt.st_dtype(weight) not in _QUANT_WEIGHT_DTYPES
    prefix, sep, leaf = name.rpartition(".experts.")
    if not sep or leaf not in _MERGED_EXPERT_SCALES:
        return False
    # the experts' weights per expert (expert 0's stand for the layer's) or merged
    scaled = [
        w
        for proj in _MERGED_EXPERT_SCALES[leaf]
        for w in (f"{prefix}.experts.0.{proj}.weight", f"{prefix}.experts.{proj}")
        if w in ckpt
    ]
    return bool(scaled) and all(ckpt.st_dtype(w) not in _QUANT_WEIGHT_DTYPES for w in scaled)


def checkpoint_regions(ckpt: Any) -> list[Region]:
    """Every tensor of an open :class:`~engram_trt.checkpoint.checkpoint.Checkpoint` that a
    model can read (:func:`unread_scale`'s stale scales left out)."""
    out = []
    for name in ckpt.tensor_names():
        if unread_scale(ckpt, name):
            continue
        file, offset, nbytes = ckpt.locate(name)
        out.append(Region(name, Path(file), int(offset), int(nbytes), ckpt.st_dtype(name)))
    return out


def scan_checkpoint(ckpt: Any, budget_bytes: int | None = DEFAULT_SCAN_BYTES, seed: int | None = None) -> ScanResult:
    """:func:`scan_regions` over every tensor of a checkpoint (weights and tables)."""
    return scan_regions(checkpoint_regions(ckpt), budget_bytes, seed)


def require_finite(ckpt: Any, budget_bytes: int | None = DEFAULT_SCAN_BYTES) -> ScanResult:
    """:func:`scan_checkpoint`, refusing (one :class:`CheckpointError` line naming the
    first tensor) a checkpoint holding NaN or Inf; returns the scan (its cost) otherwise."""
    from engram_trt.errors import CheckpointError

    res = scan_checkpoint(ckpt, budget_bytes)
    if res.findings:
        more = (
            f" (and {len(res.findings) - 1} more tensor(s); `engram-trt inspect "
            f"{shlex.quote(str(ckpt.path))}` lists them)"
            if len(res.findings) > 1
            else ""
        )
        raise CheckpointError(f"checkpoint '{ckpt.path}': {res.problems()[0]}{more}")
    return res
