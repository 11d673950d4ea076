"""DeepSeek-V4's mHC kernels (plugins/kernels/mhcKernel.cu) on a machine without a GPU:

- the C ABI's shape checks and workspace size run without a GPU and name the bad value;
- the ctypes binding (native/mhc.py) checks dtypes, shapes and devices before anything
  reaches the library, each refusal one line naming the argument;
- HyperConnection / HyperHead choose their path: PyTorch on the CPU (``auto``), an error
  naming why for ``kernels``, a bad backend name refused.
The kernels themselves run on the H200 in tests/gpu/test_mhc.py.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engram_trt.errors import EngramError
from engram_trt.native import mhc


def _one_line(exc: pytest.ExceptionInfo, needle: str) -> None:
    msg = str(exc.value)
    assert needle in msg and "\n" not in msg, msg


def test_abi_shape_checks_run_without_gpu(plugin_lib: Path) -> None:
    mhc.check_shape(4, 2048, 20, 1e-6, 1e-6)
    mhc.check_shape(1, 8, 1, 0.0, 0.0)
    mhc.check_shape(mhc.MAX_HC, 8, mhc.MAX_SINKHORN_ITERS, 1e-6, 1e-6)
    for args, needle in (
        ((0, 64, 20, 1e-6, 1e-6), "hc_mult must be in [1, 8] (got 0)"),
        ((9, 64, 20, 1e-6, 1e-6), "hc_mult must be in [1, 8] (got 9)"),
        ((4, 60, 20, 1e-6, 1e-6), "hidden must be a positive multiple of 8 (got 60)"),
        ((4, 0, 20, 1e-6, 1e-6), "(got 0)"),
        ((4, 64, 0, 1e-6, 1e-6), "sinkhorn_iters must be in [1, 1000] (got 0)"),
        ((4, 64, 1001, 1e-6, 1e-6), "(got 1001)"),
        ((4, 64, 20, -1e-6, 1e-6), "hc_eps and norm_eps must be finite and >= 0"),
        ((4, 64, 20, 1e-6, float("nan")), "hc_eps and norm_eps must be finite and >= 0"),
        ((8, 1 << 25, 20, 1e-6, 1e-6), "hc_mult * hidden = 268435456 exceeds 2^28 - 1"),
    ):
        with pytest.raises(EngramError, match="engram_mhc") as exc:
            mhc.check_shape(*args)
        _one_line(exc, needle)


def test_workspace_follows_the_token_count_alone(plugin_lib: Path) -> None:
    # hc 4, D 2048: K / 8 = 1024 vectors. One token: 32 splits of 32 vectors (aiming at 256
    # blocks), each (2 + 4) * 4 = 24 dots + 1 sum of squares in fp32.
    assert mhc.workspace_size(1, 4, 2048) == 32 * 1 * 25 * 4
    # 4096 tokens: 4 per block, 1024 blocks already: one split.
    assert mhc.workspace_size(4096, 4, 2048) == 1 * 4096 * 25 * 4
    # 16 tokens: 16 splits (256 / 16) of 64 vectors.
    assert mhc.workspace_size(16, 4, 2048) == 16 * 16 * 25 * 4
    # hc 1: 3 rows for the layer, 1 for the head: the layer's partials are the larger.
    assert mhc.workspace_size(2, 1, 256) == 1 * 2 * 4 * 4  # 32 vectors: one split
    assert mhc.workspace_size(0, 4, 2048) == 0
    with pytest.raises(EngramError) as exc:
        mhc.workspace_size(-1, 4, 2048)
    _one_line(exc, "num_tokens in [0, 2^31 - 1] (got -1)")


def test_fold_workspace_size(plugin_lib: Path) -> None:
    # a decode step (T <= 8): one split per 8 vectors of 8 channels of a stream (D 2048: 32 splits),
    # 25 partials each for hc 4; never less than the collapse's own plan (more tokens take it)
    assert mhc.fold_workspace_size(1, 4, 2048) == 32 * 1 * 25 * 4 == mhc.workspace_size(1, 4, 2048)
    assert mhc.fold_workspace_size(8, 2, 2048) == 32 * 8 * 9 * 4 > mhc.workspace_size(8, 2, 2048)
    assert mhc.fold_workspace_size(3, 3, 200) == 4 * 3 * 16 * 4  # 25 vectors a stream: 4 spans, the last partial
    assert mhc.fold_workspace_size(9, 4, 2048) == mhc.workspace_size(9, 4, 2048)
    assert mhc.fold_workspace_size(300, 4, 256) == mhc.workspace_size(300, 4, 256)
    assert mhc.fold_workspace_size(0, 4, 2048) == 0
    with pytest.raises(EngramError) as exc:
        mhc.fold_workspace_size(-1, 4, 2048)
    _one_line(exc, "engram_mhc_fold_workspace_size: need bytes != NULL and num_tokens in [0, 2^31 - 1] (got -1)")


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"out": torch.zeros(3, 8, dtype=torch.bfloat16)}, "out must be [T, hidden] = (3, 16) (got (3, 8))"),
        ({"post": torch.zeros(3, 3)}, "post must be [T, hc] = (3, 2) (got (3, 3))"),
        (
            {"comb": torch.zeros(3, 2, 2, dtype=torch.bfloat16)},
            "comb must have dtype torch.float32 (got torch.bfloat16)",
        ),
        ({"fn": torch.zeros(2, 32)}, "fn must be [8, 32] (got (2, 32))"),
        ({"scale": torch.ones(1)}, "scale must be [3] (got (1,))"),
        ({"head": True}, "fn must be [2, 32] (got (8, 32))"),
        ({"new_streams": torch.zeros(3, 2, 16)}, "new_streams must have dtype torch.bfloat16 (got torch.float32)"),
        ({"norm_weight": torch.ones(8)}, "norm_weight must be [16] (got (8,))"),
        (
            {"norm_weight": torch.ones(16, dtype=torch.float64)},
            "norm_weight must have dtype torch.float32 (got torch.float64)",
        ),
        ({}, "streams must be a CUDA tensor (got device cpu)"),
    ],
)
def test_fold_names_the_bad_argument(plugin_lib: Path, change, needle) -> None:
    args = dict(
        streams=torch.zeros(3, 2, 16, dtype=torch.bfloat16),
        out=torch.zeros(3, 16, dtype=torch.bfloat16),
        post=torch.zeros(3, 2),
        comb=torch.zeros(3, 2, 2),
        fn=torch.zeros(8, 32),
        base=torch.zeros(8),
        scale=torch.ones(3),
    )
    args.update(change)
    with pytest.raises(EngramError) as exc:
        mhc.mhc_fold(
            args.pop("streams"),
            args.pop("out"),
            args.pop("post"),
            args.pop("comb"),
            args.pop("fn"),
            args.pop("base"),
            args.pop("scale"),
            **args,
            sinkhorn_iters=3,
            hc_eps=1e-6,
            norm_eps=1e-6,
        )
    _one_line(exc, needle)


def _pre_args(T=3, hc=2, D=16, io=torch.bfloat16):
    n = (2 + hc) * hc
    return dict(
        streams=torch.zeros(T, hc, D, dtype=io), fn=torch.zeros(n, hc * D), base=torch.zeros(n), scale=torch.ones(3)
    )


@pytest.mark.parametrize(
    "change,needle",
    [
        (
            {"streams": torch.zeros(3, 2, 16, dtype=torch.int32)},
            "streams must have dtype torch.bfloat16 or torch.float16 or torch.float32 (got torch.int32)",
        ),
        (
            {"streams": torch.zeros(3, 32, dtype=torch.bfloat16)},
            "streams must be [T, hc_mult, hidden] (got shape (3, 32))",
        ),
        ({"fn": torch.zeros(8, 32, dtype=torch.bfloat16)}, "fn must have dtype torch.float32 (got torch.bfloat16)"),
        ({"fn": torch.zeros(8, 31)}, "fn must be [8, 32] (got (8, 31))"),
        ({"base": torch.zeros(7)}, "base must be [8] (got (7,))"),
        ({"scale": torch.ones(1)}, "scale must be [3] (got (1,))"),
        (
            {"streams": torch.zeros(3, 9, 8, dtype=torch.bfloat16), "fn": torch.zeros(99, 72), "base": torch.zeros(99)},
            "hc_mult must be in [1, 8] (got 9)",
        ),
        (
            {"streams": torch.zeros(3, 2, 12, dtype=torch.bfloat16), "fn": torch.zeros(8, 24)},
            "hidden must be a positive multiple of 8 (got 12)",
        ),
        (
            {"collapse_out": torch.zeros(3, 8, dtype=torch.bfloat16)},
            "collapsed must be [T, hidden] = (3, 16) (got (3, 8))",
        ),
        ({"collapse_out": torch.zeros(3, 16)}, "collapsed must have dtype torch.bfloat16 (got torch.float32)"),
        ({}, "streams must be a CUDA tensor (got device cpu)"),
    ],
)
def test_pre_names_the_bad_argument(plugin_lib: Path, change, needle) -> None:
    args, change = _pre_args(), dict(change)
    collapsed = change.pop("collapse_out", None)
    args.update(change)
    with pytest.raises(EngramError) as exc:
        mhc.mhc_pre(**args, sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-6, collapsed=collapsed)
    _one_line(exc, needle)


def test_pre_refuses_zero_iterations(plugin_lib: Path) -> None:
    with pytest.raises(EngramError) as exc:
        mhc.mhc_pre(**_pre_args(), sinkhorn_iters=0, hc_eps=1e-6, norm_eps=1e-6)
    _one_line(exc, "sinkhorn_iters must be in [1, 1000] (got 0)")


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"out": torch.zeros(3, 16)}, "out must have dtype torch.bfloat16 (got torch.float32)"),
        ({"out": torch.zeros(3, 8, dtype=torch.bfloat16)}, "out must be [T, hidden] = (3, 16) (got (3, 8))"),
        ({"post": torch.zeros(3, 2, dtype=torch.bfloat16)}, "post must have dtype torch.float32 (got torch.bfloat16)"),
        ({"post": torch.zeros(3, 3)}, "post must be [T, hc] = (3, 2) (got (3, 3))"),
        ({"comb": torch.zeros(3, 4)}, "comb must be [T, hc, hc] = (3, 2, 2) (got (3, 4))"),
        (
            {"new_streams": torch.zeros(3, 2, 8, dtype=torch.bfloat16)},
            "new_streams must be [T, hc, hidden] = (3, 2, 16) (got (3, 2, 8))",
        ),
        ({}, "streams must be a CUDA tensor (got device cpu)"),
    ],
)
def test_post_names_the_bad_argument(plugin_lib: Path, change, needle) -> None:
    args = dict(
        streams=torch.zeros(3, 2, 16, dtype=torch.bfloat16),
        out=torch.zeros(3, 16, dtype=torch.bfloat16),
        post=torch.zeros(3, 2),
        comb=torch.zeros(3, 2, 2),
        new_streams=None,
    )
    args.update(change)
    with pytest.raises(EngramError) as exc:
        mhc.mhc_post(args.pop("streams"), args.pop("out"), args.pop("post"), args.pop("comb"), **args)
    _one_line(exc, needle)


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"fn": torch.zeros(8, 32)}, "fn must be [2, 32] (got (8, 32))"),
        ({"base": torch.zeros(8)}, "base must be [2] (got (8,))"),
        ({"scale": torch.ones(3)}, "scale must be [1] (got (3,))"),
        ({"base": torch.zeros(2, dtype=torch.float64)}, "base must have dtype torch.float32 (got torch.float64)"),
        ({}, "streams must be a CUDA tensor (got device cpu)"),
    ],
)
def test_head_names_the_bad_argument(plugin_lib: Path, change, needle) -> None:
    args = dict(
        streams=torch.zeros(3, 2, 16, dtype=torch.float16),
        fn=torch.zeros(2, 32),
        base=torch.zeros(2),
        scale=torch.ones(1),
    )
    args.update(change)
    with pytest.raises(EngramError) as exc:
        mhc.mhc_head(**args, hc_eps=1e-6, norm_eps=1e-6)
    _one_line(exc, needle)


# --- the modules' choice of path ----------------------------------------------------------------


def _modules(hc=2, D=16):
    from engram_trt.models.deepseek_v4.modules import HyperConnection, HyperHead

    cfg = SimpleNamespace(hc_mult=hc, hidden_size=D, hc_sinkhorn_iters=5, hc_eps=1e-6, rms_norm_eps=1e-6)
    conn, head = HyperConnection(cfg), HyperHead(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in [*conn.parameters(), *head.parameters()]:
            p.copy_(torch.randn(p.shape, generator=g) * 0.4)
    return conn, head


def test_modules_take_the_torch_path_on_the_cpu() -> None:
    from engram_trt.models.deepseek_v4.modules import HyperConnection

    conn, head = _modules()
    x, y = torch.randn(4, 2, 16), torch.randn(4, 16)
    with torch.no_grad():
        got, want = conn.collapse(x), conn.collapse_torch(x)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert torch.equal(
            HyperConnection.expand(x, y, got[1], got[2]), HyperConnection.expand_torch(x, y, got[1], got[2])
        )
        assert torch.equal(head(x), head.forward_torch(x))
        assert not torch.equal(got[0], x.sum(1))  # the mixing did something


def test_backend_kernels_says_why_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    from engram_trt.models.deepseek_v4.modules import HyperConnection

    conn, head = _modules()
    x = torch.randn(2, 2, 16)
    conn.backend = head.backend = "kernels"
    for call, owner in ((lambda: conn.collapse(x), "HyperConnection"), (lambda: head(x), "HyperHead")):
        with pytest.raises(EngramError) as exc:
            call()
        _one_line(
            exc,
            f"{owner} backend 'kernels' cannot run: the activations are on cpu, not a CUDA device; "
            "use backend 'auto' or 'torch'",
        )
    monkeypatch.setattr(HyperConnection, "backend", "kernels")
    with pytest.raises(EngramError, match="HyperConnection backend 'kernels' cannot run: the activations are on cpu"):
        HyperConnection.expand(x, torch.randn(2, 16), torch.ones(2, 2), torch.ones(2, 2, 2))
    conn.backend = "cuda"
    with pytest.raises(
        EngramError, match=r"HyperConnection.backend 'cuda' is not one of \['auto', 'kernels', 'torch'\]"
    ):
        conn.collapse(x)
