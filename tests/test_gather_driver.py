"""The gather driver's C ABI on a machine without a GPU: it says the device cannot run
it, refuses to start, and names each missing argument (the GPU behaviour is checked by
scripts/h200_driver_check.py on the H200)."""

from __future__ import annotations

import ctypes

import pytest

torch = pytest.importorskip("torch")

from engram_trt import gatherdriver, kernels  # noqa: E402
from engram_trt.errors import EngramError  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="these cases need a machine without a CUDA device")


def _library_or_skip() -> None:
    try:
        kernels.load_library()
    except EngramError as exc:
        pytest.skip(f"the kernel library is not built here: {exc}")


def test_no_gpu_means_unsupported() -> None:
    _library_or_skip()
    value = ctypes.c_int32(7)
    gatherdriver._ENTRY.call("engram_gather_driver_supported", 0, ctypes.byref(value))
    assert value.value == 0
    assert gatherdriver.driver_supported("cuda") is False
    assert gatherdriver.driver_supported("cpu") is False


def test_create_without_a_device_fails_naming_why() -> None:
    _library_or_skip()
    handle = ctypes.c_void_p()
    with pytest.raises(EngramError, match=r"engram_gather_driver_create failed: engram_gather_driver_create: "
                                          r"(cudaGetDevice failed|device 0 (does not support|cannot be asked about))"):
        gatherdriver._ENTRY.call("engram_gather_driver_create", ctypes.c_void_p(1), ctypes.byref(handle))
    with pytest.raises(EngramError, match="gatherer and driver are required"):
        gatherdriver._ENTRY.call("engram_gather_driver_create", None, ctypes.byref(handle))


def test_missing_arguments_are_named() -> None:
    _library_or_skip()
    ticket = ctypes.c_uint64(0)
    with pytest.raises(EngramError, match="driver and ticket are required"):
        gatherdriver._ENTRY.call("engram_gather_driver_submit", None, None, 0, 1, 1, None, None, 0, 256, 0, 32, 0,
                                 None, None, None, ctypes.byref(ticket))
    first = ctypes.c_uint64(0)
    with pytest.raises(EngramError, match="driver and first_ticket are required"):
        gatherdriver._ENTRY.call("engram_gather_driver_submit_step", None, None, None, 0, None, 0, None, 2, 8, None,
                                 None, None, None, None, 2, None, None, None, ctypes.byref(first))
    with pytest.raises(EngramError, match="engram_gather_driver_wait_stream: driver is NULL"):
        gatherdriver._ENTRY.call("engram_gather_driver_wait_stream", None, 1, None)
    with pytest.raises(EngramError, match="engram_gather_driver_finish: driver is NULL"):
        gatherdriver._ENTRY.call("engram_gather_driver_finish", None, 1)
    gatherdriver._ENTRY.call("engram_gather_driver_destroy", None)  # NULL: nothing to do, no error
