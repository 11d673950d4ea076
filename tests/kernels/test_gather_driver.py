"""The gather driver's C ABI on a machine without a GPU: it says the device cannot run
it, refuses to start, and names each missing argument (the GPU behaviour is checked by
tests/gpu/test_driver.py on the H200)."""

from __future__ import annotations

import ctypes

import pytest

torch = pytest.importorskip("torch")

from engram_trt.native import gatherdriver  # noqa: E402
from engram_trt.errors import EngramError  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="these cases need a machine without a CUDA device")


def test_no_gpu_means_unsupported(plugin_lib) -> None:  # noqa: ANN001
    value = ctypes.c_int32(7)
    gatherdriver._ENTRY.call("engram_gather_driver_supported", 0, ctypes.byref(value))
    assert value.value == 0
    assert gatherdriver.driver_supported("cuda") is False
    assert gatherdriver.driver_supported("cpu") is False


def test_create_without_a_device_fails_naming_why(plugin_lib) -> None:  # noqa: ANN001
    handle = ctypes.c_void_p()
    with pytest.raises(
        EngramError,
        match=r"engram_gather_driver_create failed: engram_gather_driver_create: "
        r"(cudaGetDevice failed|device 0 (does not support|cannot be asked about))",
    ):
        gatherdriver._ENTRY.call("engram_gather_driver_create", ctypes.c_void_p(1), ctypes.byref(handle))
    with pytest.raises(EngramError, match="gatherer and driver are required"):
        gatherdriver._ENTRY.call("engram_gather_driver_create", None, ctypes.byref(handle))


def test_missing_arguments_are_named(plugin_lib) -> None:  # noqa: ANN001
    ticket = ctypes.c_uint64(0)
    with pytest.raises(EngramError, match="driver and ticket are required"):
        gatherdriver._ENTRY.call(
            "engram_gather_driver_submit",
            None,
            None,
            0,
            1,
            1,
            None,
            None,
            0,
            256,
            0,
            32,
            0,
            None,
            None,
            None,
            ctypes.byref(ticket),
        )
    first = ctypes.c_uint64(0)
    with pytest.raises(EngramError, match="driver and first_ticket are required"):
        gatherdriver._ENTRY.call(
            "engram_gather_driver_submit_step",
            None,
            None,
            None,
            0,
            None,
            0,
            None,
            2,
            8,
            None,
            None,
            None,
            None,
            None,
            2,
            None,
            None,
            None,
            ctypes.byref(first),
        )
    with pytest.raises(EngramError, match="engram_gather_driver_wait_stream: driver is NULL"):
        gatherdriver._ENTRY.call("engram_gather_driver_wait_stream", None, 1, None)
    with pytest.raises(EngramError, match="engram_gather_driver_finish: driver is NULL"):
        gatherdriver._ENTRY.call("engram_gather_driver_finish", None, 1)
    gatherdriver._ENTRY.call("engram_gather_driver_destroy", None)  # NULL: nothing to do, no error


class _Gatherer:
    """A stand-in for HostGatherer's table check (the real one needs no GPU either, but a
    HostGatherer does): counts its calls."""

    max_head_dim = 512

    def __init__(self) -> None:
        self.checks = 0

    def _check_host_table(self, rows, scales, quant_block, layout):  # noqa: ANN001, ANN202
        self.checks += 1
        return 0, int(rows.shape[0]), int(rows.shape[1]), 0


def _step_buffers(max_tokens: int, layers: int, cols: int, width: int):  # noqa: ANN202
    """StepBuffers' fields in plain CPU memory (pinned memory needs a CUDA device)."""
    from types import SimpleNamespace

    i32 = torch.int32
    b = SimpleNamespace(
        lookback_width=width,
        cids_host=torch.zeros(max_tokens, dtype=i32),
        starts_host=torch.zeros(max_tokens + 1, dtype=i32),
        lookback_host=torch.zeros((max_tokens, max(1, width)), dtype=i32),
        row_ids_host=torch.zeros((max_tokens, layers, cols), dtype=i32),
    )
    b.cids_dev, b.starts_dev = torch.zeros_like(b.cids_host), torch.zeros_like(b.starts_host)
    b.lookback_dev, b.row_ids_dev = torch.zeros_like(b.lookback_host), torch.zeros_like(b.row_ids_host)
    b.cids_np, b.starts_np, b.lookback_np = b.cids_host.numpy(), b.starts_host.numpy(), b.lookback_host.numpy()
    return b


def test_step_job_checks_its_tables_once_and_each_step_against_its_capacity(
    plugin_lib,
    layout,  # noqa: ANN001
    monkeypatch,
) -> None:
    """StepJob checks the tables and outputs when made, not per step; a step beyond the
    buffers or with a misshapen lookback is refused before anything is queued; a step's
    ids are in the step buffers when the C call is made (here it fails: no driver). The
    output check is gather.gather_out's (CUDA outputs only): counted here on CPU ones."""
    import numpy as np
    from types import SimpleNamespace

    out_checks = []
    monkeypatch.setattr(
        gatherdriver,
        "gather_out",
        lambda out, T, cols, head_dim, dev: out_checks.append((tuple(out.shape), T, cols, head_dim)) or out,
    )
    L, cols, n = layout.num_layers, layout.n_hash_cols, layout.max_ngram_size - 1
    gatherer = _Gatherer()
    drv = SimpleNamespace(gatherer=gatherer, device=torch.device("cpu"), last_ticket=0, _require_open=lambda: None)
    tables = [(torch.zeros((100, 64), dtype=torch.uint8), torch.zeros((100, 2), dtype=torch.uint8), 32, "split")] * L
    outs = [torch.zeros((16, cols, 64), dtype=torch.bfloat16) for _ in range(L)]
    buffers = _step_buffers(32, L, cols, n)
    with pytest.raises(EngramError, match=f"one table and one output per Engram layer \\({L}\\)"):
        gatherdriver.StepJob(drv, layout, buffers, tables[:1], outs)
    job = gatherdriver.StepJob(drv, layout, buffers, tables, outs)
    assert gatherer.checks == L and job.max_tokens == 16  # the outputs hold fewer tokens than the buffers
    assert out_checks == [((16, cols, 64), 16, cols, 64)] * L
    stream = SimpleNamespace(cuda_stream=0)
    with pytest.raises(EngramError, match="a step of 17 tokens / 1 sequences exceeds the step job's 16 tokens"):
        job.submit(np.zeros(17, dtype=np.int64), np.array([0, 17]), None, stream=stream)
    with pytest.raises(EngramError, match=rf"lookback must be \[num_sequences=2, N-1={n}\]"):
        job.submit(np.zeros(5, dtype=np.int64), np.array([0, 2, 5]), np.zeros((1, n), dtype=np.int64), stream=stream)
    cids, starts, lookback = np.arange(7, 12), np.array([0, 3, 5]), np.arange(2 * n).reshape(2, n) + 40
    with pytest.raises(EngramError, match="driver and first_ticket are required"):
        job.submit(cids, starts, lookback, stream=stream)
    assert gatherer.checks == L and len(out_checks) == L  # no check per step
    assert buffers.cids_np[:5].tolist() == cids.tolist() and buffers.starts_np[:3].tolist() == starts.tolist()
    assert buffers.lookback_np[:2, :n].tolist() == lookback.tolist()
