"""The float64 NumPy reference of DeepSeek-V4's mHC (models/deepseek_v4/reference_mhc.py, what
plugins/kernels/mhcKernel.cu computes) against the torch modules it describes
(models/deepseek_v4/modules.HyperConnection / HyperHead) on the CPU, with every parameter
random (transformers initializes base to 0 and scale to 1, which would let a swapped
scale or bias pass): float64 modules within 1e-12, float32 ones within float32 round-off;
hc 1, 2, 4 and 8, Sinkhorn 1, 3 and 20 iterations; the Sinkhorn matrix nearly doubly
stochastic after many iterations and its transpose used by the post step (a symmetric
stand-in fails); the reference refuses mis-shaped parameters in one line.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engram_trt.models.deepseek_v4 import reference_mhc as ref
from engram_trt.errors import EngramError
from engram_trt.models.deepseek_v4.modules import HyperConnection, HyperHead

CASES = [(1, 8, 1), (2, 16, 3), (4, 24, 20), (8, 8, 7)]  # (hc, hidden, sinkhorn iters)


def _config(hc: int, D: int, iters: int) -> SimpleNamespace:
    return SimpleNamespace(hc_mult=hc, hidden_size=D, hc_sinkhorn_iters=iters, hc_eps=1e-6, rms_norm_eps=1e-6)


def _random(module: torch.nn.Module, seed: int, dtype: torch.dtype) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    module = module.to(dtype)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5 + (0.5 if p.numel() <= 3 else 0.0))
            p.requires_grad_(False)
    return module


def _streams(T: int, hc: int, D: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, hc, D, generator=g, dtype=torch.float64) * 1.5).to(dtype)


def _params(m: HyperConnection | HyperHead) -> ref.MhcParams:
    if isinstance(m, HyperHead):
        return ref.MhcParams.of(m.hc_fn.detach().double(), m.hc_base.detach().double(), m.hc_scale.detach().double())
    return ref.MhcParams.of(m.fn.detach().double(), m.base.detach().double(), m.scale.detach().double())


@pytest.mark.parametrize("hc,D,iters", CASES)
def test_pre_and_post_equal_the_float64_module(hc: int, D: int, iters: int) -> None:
    m = _random(HyperConnection(_config(hc, D, iters)), hc * 7 + iters, torch.float64)
    x = _streams(5, hc, D, 1, torch.float64)
    out = _streams(5, 1, D, 2, torch.float64)[:, 0]
    h, post, comb = m.collapse(x)
    want_h, want_post, want_comb = ref.mhc_pre(x.numpy(), _params(m), iters=iters, hc_eps=1e-6, norm_eps=1e-6)
    np.testing.assert_allclose(h.numpy(), want_h, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(post.numpy(), want_post, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(comb.numpy(), want_comb, rtol=1e-12, atol=1e-12)
    new = HyperConnection.expand(x, out, post, comb)
    np.testing.assert_allclose(
        new.numpy(), ref.mhc_post(x.numpy(), out.numpy(), want_post, want_comb), rtol=1e-12, atol=1e-12
    )
    assert float(np.abs(want_h).max()) > 0.1 and float(np.abs(want_post - 1.0).max()) > 0.05  # not a trivial case


@pytest.mark.parametrize("hc,D,iters", CASES)
def test_float32_module_within_its_round_off(hc: int, D: int, iters: int) -> None:
    m = _random(HyperConnection(_config(hc, D, iters)), 100 + hc, torch.float32)
    x = _streams(6, hc, D, 3, torch.float32)
    out = _streams(6, 1, D, 4, torch.float32)[:, 0]
    h, post, comb = m.collapse(x)
    want_h, want_post, want_comb = ref.mhc_pre(x.double().numpy(), _params(m), iters=iters, hc_eps=1e-6, norm_eps=1e-6)
    np.testing.assert_allclose(h.numpy(), want_h, rtol=2e-5, atol=2e-5 * np.abs(want_h).max())
    np.testing.assert_allclose(comb.numpy(), want_comb, rtol=2e-5, atol=1e-6)
    new = HyperConnection.expand(x, out, post, comb)
    want = ref.mhc_post(x.double().numpy(), out.double().numpy(), want_post, want_comb)
    np.testing.assert_allclose(new.numpy(), want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("hc,D", [(1, 8), (2, 16), (4, 24), (8, 8)])
def test_head_equals_the_module(hc: int, D: int) -> None:
    m = _random(HyperHead(_config(hc, D, 1)), 7 + hc, torch.float64)
    x = _streams(4, hc, D, 5, torch.float64)
    want = ref.mhc_head(x.numpy(), _params(m), hc_eps=1e-6, norm_eps=1e-6)
    np.testing.assert_allclose(m(x).numpy(), want, rtol=1e-12, atol=1e-12)
    assert float(np.abs(want).max()) > 0.1


def test_bf16_module_rounds_post_and_comb_as_the_reference_can() -> None:
    """The bf16 module casts post / comb to bf16 before mixing: the reference's
    ``round_to`` reproduces that (the kernels' documented rounding), within bf16 round-off."""
    hc, D = 4, 32
    m = _random(HyperConnection(_config(hc, D, 20)), 9, torch.float32)
    x = _streams(8, hc, D, 6, torch.bfloat16)
    out = _streams(8, 1, D, 7, torch.bfloat16)[:, 0]
    h, post, comb = m.collapse(x)
    want_h, want_post, want_comb = ref.mhc_pre(x.double().numpy(), _params(m), iters=20, hc_eps=1e-6, norm_eps=1e-6)
    np.testing.assert_allclose(h.double().numpy(), want_h, rtol=2**-8, atol=2**-8 * np.abs(want_h).max())
    bf16 = lambda a: torch.from_numpy(a).to(torch.bfloat16).double().numpy()  # noqa: E731
    want = ref.mhc_post(x.double().numpy(), out.double().numpy(), want_post, want_comb, round_to=bf16)
    got = HyperConnection.expand(x, out, post, comb).double().numpy()
    scale = np.abs(x.double().numpy()).max() + np.abs(out.double().numpy()).max() * 2
    assert np.abs(got - want).max() <= 3 * 2**-8 * scale


def test_sinkhorn_is_nearly_doubly_stochastic_and_its_transpose_is_used() -> None:
    hc, D = 4, 16
    m = _random(HyperConnection(_config(hc, D, 50)), 11, torch.float64)
    x = _streams(3, hc, D, 8, torch.float64).numpy()
    _pre, post, comb = ref.mhc_coefficients(x, _params(m), iters=50, hc_eps=1e-6, norm_eps=1e-6)
    np.testing.assert_allclose(comb.sum(axis=-1), 1.0, atol=1e-4)
    np.testing.assert_allclose(comb.sum(axis=-2), 1.0, atol=1e-4)
    assert np.abs(comb - comb.transpose(0, 2, 1)).max() > 1e-3  # not symmetric: the direction matters
    out = np.zeros((3, D))
    assert np.abs(ref.mhc_post(x, out, post, comb) - ref.mhc_post(x, out, post, comb.transpose(0, 2, 1))).max() > 1e-3


def test_reference_refuses_mis_shaped_parameters() -> None:
    x = np.zeros((2, 2, 8))
    bad = ref.MhcParams.of(np.zeros((7, 16)), np.zeros(7), np.zeros(3))
    with pytest.raises(EngramError, match=r"an hc=2 hyper-connection needs fn \[8, hc\*hidden\]") as exc:
        ref.mhc_pre(x, bad, iters=1, hc_eps=1e-6, norm_eps=1e-6)
    assert "\n" not in str(exc.value)
    with pytest.raises(EngramError, match="fn must have hc\\*hidden = 16 columns"):
        ref.mhc_pre(x, ref.MhcParams.of(np.zeros((8, 15)), np.zeros(8), np.zeros(3)), iters=1, hc_eps=0, norm_eps=0)
    with pytest.raises(EngramError, match=r"an hc=2 hyper head needs fn \[2, hc\*hidden\], base \[2\], scale \[1\]"):
        ref.mhc_head(x, ref.MhcParams.of(np.zeros((2, 16)), np.zeros(2), np.zeros(3)), hc_eps=0, norm_eps=0)
