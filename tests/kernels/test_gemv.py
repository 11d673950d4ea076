"""The decode projections' GEMV (engram_gemv_bf16) on a machine without a GPU: its C ABI's
host checks, the binding's argument checks, the fused path's dispatch, and
tests/gpu/test_gemv.py's CPU stages and verify function. The kernel itself runs on the
H200 through that module (``pytest -m gpu tests/gpu``); its timing is `benchmarks/kernels/bench_gemv.py`."""

from __future__ import annotations

import ctypes
import importlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engram_trt.native import backbone as backbone_kernels
from engram_trt.errors import EngramError
from engram_trt.models.engram_llama.kernel_ops import KernelBackboneOps, TorchBackboneOps


@pytest.fixture
def check():
    """tests/gpu/test_gemv.py as a module."""
    return importlib.import_module("gpu.test_gemv")


def test_gemv_check_cpu_stages(plugin_lib: Path, check) -> None:
    """The GPU tests' CPU stages: ten ABI refusals with their one-line reasons, and the
    float64 bound holds for the GEMM library's own F.linear (any summation order) on the CPU."""
    assert len(check.ABI_CASES) == 10
    for name, args, want in check.ABI_CASES:
        check.test_abi(name, args, want)
    assert len(check.REFERENCE_CASES) == 3
    for T, N, K in check.REFERENCE_CASES:
        check.check_reference_cpu(T, N, K)


def test_gemv_verify_is_not_vacuous(check) -> None:
    """The GPU check's verify (float64 bound and F.linear) passes the exactly rounded
    product and fails a result nudged by 2^-6, one with x's rows swapped, and one missing a
    weight row's last element."""
    gen = torch.Generator().manual_seed(3)
    inputs = check.gemv_inputs(gen, torch.device("cpu"), 4, 96, 2048)
    x, w = inputs["x"], inputs["w"]
    exact = (x.double() @ w.double().t()).to(torch.bfloat16)
    assert check.gemv_verify(inputs, exact)[0]  # exactly rounded
    assert not check.gemv_verify(inputs, (exact.double() * (1 + 2.0**-6)).to(torch.bfloat16))[0]  # nudged by 2^-6
    assert not check.gemv_verify(inputs, exact[[1, 0, 2, 3]])[0]  # rows of x swapped
    short = w.clone()
    short[:, -1] = 0
    assert not check.gemv_verify(inputs, F.linear(x, short))[0]  # a weight element dropped


def test_gemv_abi_reaches_the_launch(plugin_lib: Path) -> None:
    """Arguments that pass every check get as far as the launch, which a machine
    without a GPU refuses, named after the entry point."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: tests/gpu/test_gemv.py launches the kernel for real")
    lib = backbone_kernels.library()
    a, b, c = (ctypes.c_void_p(x << 32) for x in (1, 2, 3))  # made-up, disjoint, aligned: never dereferenced
    for tokens in (1, 4):
        for flags in (0, backbone_kernels.GEMV_WEIGHT_STATIC):
            status = lib.engram_gemv_bf16(a, b, tokens, 2048, 2048, flags, c, None)
            assert status != 0 and "engram_gemv_bf16 launch failed" in lib.engram_last_error().decode()


def test_gemv_binding_names_the_bad_argument() -> None:
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    w = torch.zeros(32, 64, dtype=torch.bfloat16)
    with pytest.raises(EngramError, match=r"^x must have dtype torch.bfloat16 \(got torch.float32\)$"):
        backbone_kernels.gemv(x.float(), w)
    with pytest.raises(
        EngramError,
        match=r"^x must be \[T, K\] and weight \[N, K\] \(got shapes \(2, 64\) and "
        r"\(32, 48\)\)$",
    ):
        backbone_kernels.gemv(x, w[:, :48])
    with pytest.raises(EngramError, match=r"^gemv takes at most 4 tokens \(got 5\); use F.linear$"):
        backbone_kernels.gemv(torch.zeros(5, 64, dtype=torch.bfloat16), w)
    with pytest.raises(EngramError, match=r"^in_features must be a positive multiple of 8 \(got 12\); use F.linear$"):
        backbone_kernels.gemv(x[:, :12], w[:, :12])
    with pytest.raises(EngramError, match="^x must be a CUDA tensor"):
        backbone_kernels.gemv(x, w)


def test_fused_path_linear_dispatch_off_a_gpu(plugin_lib: Path) -> None:
    """Both backbone ops compute a projection as F.linear; the kernel ops hand the GEMV
    only bf16 CUDA steps of at most gemv_max_tokens tokens (here, CPU tensors: never)."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    w = torch.randn(32, 64, generator=gen).to(torch.bfloat16)
    want = F.linear(x, w)
    assert torch.equal(TorchBackboneOps().linear(x, w), want)
    assert not backbone_kernels.gemv_fits(x, w)
    assert torch.equal(KernelBackboneOps().linear(x, w), want)
    assert 1 <= KernelBackboneOps.gemv_max_tokens <= backbone_kernels.GEMV_MAX_TOKENS
