"""The gate kernel's scalar math on the CPU, against the float64 reference.

``plugins/kernels/gateMath.h`` holds the per-token math the CUDA gate calls (sums,
score, gate, update). ``plugins/tests/gateMathTest.cpp`` runs exactly those functions
on the host; this test compiles it with the system C++ compiler and compares its output
with :func:`engram_trt.engram.fusion.engram_gate_reference`, including the cases the
kernel used to get wrong: a NaN score gave gate 0.5 (``fmaxf`` drops NaN) and a finite,
wrong row, where the reference gives NaN. The kernel itself runs on the H200 through
``tests/gpu/test_edge_cases.py`` (the same NaN cases there).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from engram_trt.engram.fusion import GATE_CLAMP, engram_gate_reference

from helpers.files import REPO

EPS = 1e-6


@pytest.fixture(scope="module")
def gate_math(tmp_path_factory) -> Path:
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler (c++ / g++) to build plugins/tests/gateMathTest.cpp")
    exe = tmp_path_factory.mktemp("gate-math") / "gateMathTest"
    subprocess.run(
        [
            compiler,
            "-std=c++17",
            "-O2",
            "-Wall",
            "-Wextra",
            "-Werror",
            f"-I{REPO / 'plugins' / 'kernels'}",
            str(REPO / "plugins" / "tests" / "gateMathTest.cpp"),
            "-o",
            str(exe),
        ],
        check=True,
    )
    return exe


def run_gate(
    exe: Path, hidden: np.ndarray, kv: np.ndarray, qw: np.ndarray, kw: np.ndarray, mask: np.ndarray
) -> np.ndarray:
    T, hc, D = hidden.shape
    parts = [f"{T} {hc} {D} {EPS!r} {GATE_CLAMP!r}"]
    for a in (hidden, kv, qw, kw, mask.astype(np.float32)):
        parts.append(" ".join(repr(float(v)) for v in np.asarray(a, np.float32).reshape(-1)))
    out = subprocess.run([str(exe)], input="\n".join(parts), capture_output=True, text=True, check=True).stdout
    return np.asarray([float(v) for v in out.split()], dtype=np.float64).reshape(T, hc, D)


def inputs(seed: int, T: int = 6, hc: int = 3, D: int = 16):
    rng = np.random.default_rng(seed)
    hidden = rng.standard_normal((T, hc, D)).astype(np.float32)
    kv = rng.standard_normal((T, (hc + 1) * D)).astype(np.float32)
    qw = (1 + 0.1 * rng.standard_normal((hc, D))).astype(np.float32)
    kw = (1 + 0.1 * rng.standard_normal((hc, D))).astype(np.float32)
    return hidden, kv, qw, kw, np.ones(T, dtype=bool)


def reference(hidden, kv, qw, kw, mask) -> np.ndarray:
    with np.errstate(invalid="ignore"):  # the NaN cases are the point
        return engram_gate_reference(hidden, kv, qw, kw, mask, EPS, GATE_CLAMP)


def assert_matches(got: np.ndarray, ref: np.ndarray) -> None:
    """Same NaN positions; finite values within fp32 rounding of the float64 reference."""
    assert np.array_equal(np.isnan(got), np.isnan(ref)), (
        f"NaN at {np.argwhere(np.isnan(got)).tolist()[:8]} vs reference {np.argwhere(np.isnan(ref)).tolist()[:8]}"
    )
    finite = ~np.isnan(ref)
    err = np.abs(got[finite] - ref[finite])
    assert np.all(err <= 1e-5 * np.abs(ref[finite]) + 1e-6), float(err.max())


def test_finite_inputs_match_the_reference(gate_math: Path) -> None:
    args = inputs(0)
    got = run_gate(gate_math, *args)
    assert np.isfinite(got).all()
    assert_matches(got, reference(*args))


def test_nan_key_gives_a_nan_stream_not_gate_one_half(gate_math: Path) -> None:
    """An fp8 byte or scale that decodes to NaN puts a NaN in a key: that stream's score,
    gate and whole output row are NaN, as in the reference; the other streams are not."""
    hidden, kv, qw, kw, mask = inputs(1)
    hc, D = hidden.shape[1:]
    kv[2, 1 * D + 5] = np.nan  # token 2, stream 1's key
    got = run_gate(gate_math, hidden, kv, qw, kw, mask)
    ref = reference(hidden, kv, qw, kw, mask)
    assert np.isnan(ref[2, 1]).all() and np.isnan(got[2, 1]).all()
    assert np.isfinite(np.delete(got.reshape(-1, D), 2 * hc + 1, axis=0)).all()
    assert_matches(got, ref)
    # What the old kernel did (fmaxf(NaN, clamp) = clamp, sign test 0: gate 0.5) is a
    # finite row, and the comparison above would have failed on it.
    old = hidden[2, 1].astype(np.float64) + 0.5 * kv[2, hc * D :].astype(np.float64)
    assert np.isfinite(old).all()


def test_nan_hidden_and_nan_value(gate_math: Path) -> None:
    hidden, kv, qw, kw, mask = inputs(2)
    hc, D = hidden.shape[1:]
    hidden[0, 2, 3] = np.nan  # one stream's score
    kv[4, hc * D + 7] = np.nan  # the shared value of token 4: element 7 of every stream
    got = run_gate(gate_math, hidden, kv, qw, kw, mask)
    ref = reference(hidden, kv, qw, kw, mask)
    assert np.isnan(got[0, 2]).all() and np.isnan(got[4, :, 7]).all()
    assert_matches(got, ref)


def test_zero_score_infinite_key_and_the_clamp(gate_math: Path) -> None:
    """sign(0) = 0 gives gate 0.5 exactly (a zero key); an infinite key gives a NaN score
    (inf * rsqrt(inf) = inf * 0), as in float64; a tiny score is clamped to 1e-6."""
    hidden, kv, qw, kw, mask = inputs(3)
    hc, D = hidden.shape[1:]
    kv[0, 0:D] = 0.0  # token 0, stream 0: dot = 0
    kv[1, D : 2 * D] = 0.0
    kv[1, D + 4] = np.inf  # token 1, stream 1
    kv[3, 2 * D : 3 * D] = 1e-30  # token 3, stream 2: |score| far below the clamp
    got = run_gate(gate_math, hidden, kv, qw, kw, mask)
    ref = reference(hidden, kv, qw, kw, mask)
    value = kv[0, hc * D :].astype(np.float64)
    assert np.allclose(got[0, 0], hidden[0, 0] + 0.5 * value, rtol=1e-6, atol=1e-6)
    assert np.isnan(got[1, 1]).all()
    assert_matches(got, ref)


def test_dead_tokens_copy_hidden_even_with_nan_rows(gate_math: Path) -> None:
    """A dead token's output is hidden bit for bit, whatever its kv row holds (the kernel
    never reads it); the reference's ``hidden + 0 * value`` would be NaN there."""
    hidden, kv, qw, kw, mask = inputs(4)
    hc, D = hidden.shape[1:]
    mask[[1, 5]] = False
    kv[1, :] = np.nan
    kv[5, hc * D :] = np.inf
    got = run_gate(gate_math, hidden, kv, qw, kw, mask)
    assert np.array_equal(got[[1, 5]].astype(np.float32).view(np.int32), hidden[[1, 5]].view(np.int32))
    live = mask
    assert_matches(got[live], reference(hidden, kv, qw, kw, mask)[live])
