"""The host gather's CUDA-free parts, on a machine without a GPU.

- runtime/tests/hostGatherTest.cpp (the thread pool and the row copy loop), compiled here
  with ThreadSanitizer where the compiler has it;
- the C ABI's CPU entry point engram_host_gather_rows_cpu (the same row copy the
  pipelined gather runs) against a NumPy reference: split, inline and hbm-scales layouts
  (hbm-scales: the values alone), fp8 and bf16, prefetch distances, plain and streaming
  stores, out-of-range ids;
- the pool's size from the CPU affinity mask, in a child process pinned to one CPU;
- the argument checks of the new entry points (one-line reasons, no GPU needed), the raw
  sink's with the scales in HBM among them.
The pipelined GPU path (copies, dequant) runs on the H200 through `benchmarks/lookup/bench_gather.py`.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engram_trt.native import hostgather
from engram_trt.native import gather as gather_kernels
from engram_trt.errors import EngramError

from helpers.files import REPO


def _compiler() -> str | None:
    return shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def test_pool_and_row_copy_unit_test_passes_under_thread_sanitizer(tmp_path: Path) -> None:
    cxx = _compiler()
    if cxx is None:
        pytest.skip("no C++ compiler (c++ / g++ / clang++) to build runtime/tests/hostGatherTest.cpp")
    src = REPO / "runtime" / "tests" / "hostGatherTest.cpp"
    exe = tmp_path / "hostGatherTest"
    base = [cxx, "-std=c++17", "-O1", "-g", "-pthread", f"-I{REPO / 'runtime'}", str(src), "-o", str(exe)]
    built = subprocess.run(base[:1] + ["-fsanitize=thread"] + base[1:], capture_output=True, text=True)
    sanitized = built.returncode == 0
    if not sanitized:  # a toolchain without libtsan still runs the test, unsanitized
        built = subprocess.run(base, capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-2000:]
    env = dict(os.environ, TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1")
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    assert "0 failed" in run.stdout and "[FAIL]" not in run.stdout
    assert "WARNING: ThreadSanitizer" not in run.stderr
    assert run.stdout.count("[PASS]") >= 12


def _fp8_table(rows: int, head_dim: int, quant_block: int, seed: int):
    import torch

    rng = np.random.default_rng(seed)
    values = rng.integers(0, 256, size=(rows, head_dim), dtype=np.uint8)
    scales = rng.integers(100, 150, size=(rows, head_dim // quant_block), dtype=np.uint8)
    inline = np.concatenate([values, scales], axis=1)
    return torch.from_numpy(values), torch.from_numpy(scales), torch.from_numpy(np.ascontiguousarray(inline))


def _reference(values: np.ndarray, scales: np.ndarray | None, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    ok = (ids >= 0) & (ids < values.shape[0])
    safe = np.where(ok, ids, 0)
    rows = np.where(ok[:, None], values[safe], 0).astype(values.dtype)
    if scales is None:
        return rows, None
    return rows, np.where(ok[:, None], scales[safe], 127).astype(np.uint8)


@pytest.mark.parametrize("layout", ["split", "inline", "hbm-scales"])
@pytest.mark.parametrize("threads,prefetch,streaming", [(1, 0, 0), (3, 16, 0), (2, 64, 1), (4, 5, 1)])
def test_rows_cpu_matches_reference_fp8(
    plugin_lib: Path, layout: str, threads: int, prefetch: int, streaming: int
) -> None:
    import torch

    values, scales, inline = _fp8_table(3000, 64, 32, seed=threads * 10 + prefetch)
    rng = np.random.default_rng(prefetch)
    ids = rng.integers(-30, 3030, size=5001).astype(np.int32)  # ~2% out of range, both sides
    table = (inline, None) if layout == "inline" else (values, scales)
    got_rows, got_scales = hostgather.gather_rows_cpu(
        torch.from_numpy(ids),
        *table,
        quant_block=32,
        layout=layout,
        num_threads=threads,
        prefetch_rows=prefetch,
        streaming_stores=streaming,
    )
    ref_rows, ref_scales = _reference(values.numpy(), scales.numpy(), ids)
    np.testing.assert_array_equal(got_rows.numpy(), ref_rows)
    if layout == "hbm-scales":  # its CPU threads copy the values alone; the GPU reads the scales
        assert got_scales is None
    else:
        np.testing.assert_array_equal(got_scales.numpy(), ref_scales)


def test_rows_cpu_bf16_and_given_outputs(plugin_lib: Path) -> None:
    import torch

    table = torch.randn(777, 40, dtype=torch.bfloat16)
    ids = torch.tensor([5, 0, 776, 777, -1, 5, 300], dtype=torch.int32)
    out = torch.full((10, 40), 7.0, dtype=torch.bfloat16)
    rows, scales = hostgather.gather_rows_cpu(ids, table, num_threads=2, out_rows=out)
    assert scales is None and rows.data_ptr() == out.data_ptr() and rows.shape == (7, 40)
    ref = table[ids.clamp(0, 776).long()].clone()
    ref[(ids < 0) | (ids >= 777)] = 0
    assert torch.equal(rows.view(torch.int16), ref.view(torch.int16))
    assert torch.equal(out[7:], torch.full((3, 40), 7.0, dtype=torch.bfloat16))  # rows past n untouched


def test_rows_cpu_argument_checks(plugin_lib: Path) -> None:
    import torch

    values, scales, inline = _fp8_table(10, 64, 32, seed=0)
    ids = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(EngramError, match="^an inline table keeps its scale bytes in its rows"):
        hostgather.gather_rows_cpu(ids, inline, scales, layout="inline")
    with pytest.raises(
        EngramError,
        match=r"^an inline fp8 table is \[rows, head_dim \+ head_dim / quant_block\] "
        r"bytes; width 65 fits no head_dim",
    ):
        hostgather.gather_rows_cpu(ids, torch.zeros(10, 65, dtype=torch.uint8), layout="inline")
    with pytest.raises(
        EngramError,
        match="^layout must be one of 'split', 'inline', 'hbm-scales' "
        r"\(got 'packed'\)$",
    ):
        hostgather.gather_rows_cpu(ids, values, scales, layout="packed")
    with pytest.raises(
        EngramError,
        match=r"^layout 'hbm-scales' is for fp8 tables \(a bf16 table has no scales\): "
        "use 'split'$",
    ):
        hostgather.gather_rows_cpu(ids, torch.zeros(10, 64, dtype=torch.bfloat16), layout="hbm-scales")
    with pytest.raises(EngramError, match=r"^out_rows must be \[>= 4, 64\]"):
        hostgather.gather_rows_cpu(ids, values, scales, out_rows=torch.zeros(3, 64, dtype=torch.uint8))
    with pytest.raises(EngramError, match=r"^ids must have dtype torch.int32 \(got torch.int64\)$"):
        hostgather.gather_rows_cpu(ids.long(), values, scales)

    lib = hostgather.library()
    vp = ctypes.c_void_p
    ptr = vp(values.data_ptr())
    status = lib.engram_host_gather_rows_cpu(
        None, 1, vp(ids.data_ptr()), 4, ptr, None, 10, 64, gather_kernels.TABLE_FP8_E4M3, 32, 7, ptr, ptr, -1, -1
    )
    assert status == 1
    assert lib.engram_last_error().decode() == (
        "engram_host_gather_rows_cpu: table_layout 7 is not split (0), inline (1) or hbm_scales (2)"
    )
    bf = torch.zeros(10, 64, dtype=torch.bfloat16)
    status = lib.engram_host_gather_rows_cpu(
        None,
        1,
        vp(ids.data_ptr()),
        4,
        vp(bf.data_ptr()),
        None,
        10,
        64,
        gather_kernels.TABLE_BF16,
        32,
        2,
        vp(bf.data_ptr()),
        None,
        -1,
        -1,
    )
    assert status == 1
    assert lib.engram_last_error().decode() == (
        "engram_host_gather_rows_cpu: hbm_scales (2) is a layout of fp8 tables only"
    )
    status = lib.engram_host_gather_rows_cpu(
        None, 1, vp(ids.data_ptr()), 4, ptr, None, 10, 64, gather_kernels.TABLE_FP8_E4M3, 32, 0, ptr, ptr, -1, -1
    )
    assert status == 1 and "split fp8 table, its scales" in lib.engram_last_error().decode()
    status = lib.engram_host_gather_rows_cpu(
        None, 1, vp(ids.data_ptr()), 4, ptr, ptr, 10, 64, gather_kernels.TABLE_FP8_E4M3, 32, 0, ptr, ptr, 65, -1
    )
    assert status == 1 and "prefetch_rows must be <= 64" in lib.engram_last_error().decode()


def test_default_thread_count_follows_the_affinity_mask(plugin_lib: Path) -> None:
    # one CPU left to the thread that launches the model, at least one thread
    assert hostgather.default_gather_threads() == max(1, len(os.sched_getaffinity(0)) - 1)
    count = ctypes.c_int32(0)
    assert hostgather.library().engram_cpu_affinity_count(ctypes.byref(count)) == 0
    assert count.value == len(os.sched_getaffinity(0))
    cpu = sorted(os.sched_getaffinity(0))[0]
    code = (
        "import os, sys; os.sched_setaffinity(0, {%d}); sys.path.insert(0, %r); "
        "from engram_trt.native import hostgather; print(hostgather.default_gather_threads())"
    ) % (cpu, str(REPO / "python"))
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, ENGRAM_TRT_PLUGIN_LIB=str(plugin_lib)),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "1"


def test_new_entry_points_refuse_null_gatherers(plugin_lib: Path) -> None:
    lib = hostgather.library()
    value = ctypes.c_int64(0)
    assert lib.engram_host_gatherer_set_option(None, 0, 1) == 1
    assert lib.engram_last_error().decode() == "engram_host_gatherer_set_option: gatherer is NULL"
    assert lib.engram_host_gatherer_get_option(None, 0, ctypes.byref(value)) == 1
    assert lib.engram_host_gatherer_wake(None) == 1
    assert lib.engram_last_error().decode() == "engram_host_gatherer_wake: gatherer is NULL"
    ids = np.zeros(4, np.int32)
    status = lib.engram_host_gather_raw(
        None,
        ids.ctypes.data_as(ctypes.c_void_p),
        4,
        None,
        None,
        0,
        64,
        gather_kernels.TABLE_FP8_E4M3,
        32,
        0,
        None,
        None,
        None,
    )
    assert status == 1 and lib.engram_last_error().decode() == "engram_host_gather_raw: gatherer is NULL"
    status = lib.engram_host_gather_dev(
        None,
        ids.ctypes.data_as(ctypes.c_void_p),
        None,
        4,
        1,
        1,
        None,
        None,
        0,
        64,
        gather_kernels.TABLE_FP8_E4M3,
        32,
        2,
        None,
        None,
    )
    assert status == 1 and lib.engram_last_error().decode() == "engram_host_gather: gatherer is NULL"
    handle = ctypes.c_void_p(1)
    status = lib.engram_host_gatherer_create_ex(2, 64, 64, 1, ctypes.byref(handle))
    assert status == 1 and handle.value is None
    assert lib.engram_last_error().decode() == "engram_host_gatherer_create: num_slots must be in [2, 64] (got 1)"


def test_raw_gather_with_scales_in_hbm_names_its_missing_arguments(plugin_lib: Path) -> None:
    """The raw sink's hbm_scales arguments are checked before the gatherer (no GPU needed):
    the device ids, the device scales, dst_scales, an fp8 table; the entry point without
    device ids names the one that has them. Valid hbm_scales arguments reach the gatherer."""
    lib = hostgather.library()
    vp = ctypes.c_void_p
    ids = np.zeros(4, np.int32)
    buf = np.zeros((10, 64), np.uint8)
    ip, bp = vp(ids.ctypes.data), vp(buf.ctypes.data)
    fp8, hbm = gather_kernels.TABLE_FP8_E4M3, hostgather.TABLE_LAYOUTS["hbm-scales"]

    def raw_dev(ids_dev, scales, dst_scales, dtype=fp8, num_ids=4):
        status = lib.engram_host_gather_raw_dev(
            None, ip, ids_dev, num_ids, bp, scales, 10, 64, dtype, 32, hbm, bp, dst_scales, None
        )
        return status, lib.engram_last_error().decode()

    fn = "engram_host_gather_raw_dev"
    assert raw_dev(None, bp, bp) == (
        1,
        f"{fn}: hbm_scales (2) needs the ids in device memory too (engram_host_gather_raw_dev's ids_dev)",
    )
    assert raw_dev(ip, None, bp) == (
        1,
        f"{fn}: hbm_scales (2) needs the table's scales in device memory (scales is NULL)",
    )
    assert raw_dev(ip, bp, None) == (
        1,
        f"{fn}: hbm_scales (2) gathers the rows' scale bytes into dst_scales (device memory): it is NULL",
    )
    assert raw_dev(ip, bp, bp, dtype=gather_kernels.TABLE_BF16) == (
        1,
        f"{fn}: hbm_scales (2) is a layout of fp8 tables only",
    )
    assert raw_dev(ip, bp, bp, num_ids=-2) == (1, f"{fn}: num_ids must be >= 0 (got -2)")
    assert raw_dev(ip, bp, bp) == (1, f"{fn}: gatherer is NULL")  # the arguments pass: the gatherer is next
    assert raw_dev(None, bp, None, num_ids=0) == (1, f"{fn}: gatherer is NULL")  # no ids: none needed
    status = lib.engram_host_gather_raw(None, ip, 4, bp, bp, 10, 64, fp8, 32, hbm, bp, bp, None)
    assert status == 1
    assert lib.engram_last_error().decode() == (
        "engram_host_gather_raw: hbm_scales (2) needs the ids in device "
        "memory too (engram_host_gather_raw_dev's ids_dev)"
    )
    status = lib.engram_host_gather_raw_dev(None, ip, None, 4, bp, bp, 10, 64, fp8, 32, 0, bp, bp, None)
    assert status == 1 and lib.engram_last_error().decode() == f"{fn}: gatherer is NULL"  # split: ids_dev unused


def test_gather_raw_with_scales_in_hbm_wants_them_on_the_gatherers_device() -> None:
    import torch

    g = hostgather.HostGatherer.__new__(hostgather.HostGatherer)  # no device needed: refused before any CUDA call
    g._handle, g.device, g.max_head_dim = ctypes.c_void_p(1), torch.device("cuda", 0), 512
    values, scales, _ = _fp8_table(10, 64, 32, seed=1)
    try:
        with pytest.raises(
            EngramError,
            match=r"^layout 'hbm-scales' reads the scales on the gatherer's device cuda:0 "
            r"\(got them on cpu\)",
        ):
            g.gather_raw(
                torch.zeros(3, dtype=torch.int32),
                values,
                scales,
                layout="hbm-scales",
                dst_rows=torch.zeros(3, 64, dtype=torch.uint8),
                dst_scales=torch.zeros(3, 2, dtype=torch.uint8),
            )
    finally:
        g._handle = None


def test_a_bound_gather_checks_its_table_once_and_each_calls_ids_and_out() -> None:
    """HostGatherer.bind refuses a bad table when bound (as gather does), and each call
    refuses bad ids and an out off the device before any library call (no GPU needed)."""
    import torch

    g = hostgather.HostGatherer.__new__(hostgather.HostGatherer)  # no device needed: refused before any CUDA call
    g._handle, g.device, g.max_head_dim = ctypes.c_void_p(1), torch.device("cuda", 0), 512
    values, scales, _ = _fp8_table(10, 64, 32, seed=1)
    try:
        with pytest.raises(EngramError, match=r"^scales must be \[rows, head_dim / quant_block\]"):
            g.bind(values, scales[:, :1].contiguous(), quant_block=32)
        with pytest.raises(EngramError, match="^head_dim 1024 exceeds this gatherer's max_head_dim 512"):
            g.bind(torch.zeros(4, 1024, dtype=torch.uint8), torch.zeros(4, 32, dtype=torch.uint8), quant_block=32)
        bound = g.bind(values, scales, quant_block=32)
        assert (bound.head_dim, bound.layout) == (64, "split")
        out = torch.zeros(3, 2, 64, dtype=torch.bfloat16)
        with pytest.raises(EngramError, match="^ids must have dtype torch.int32 \\(got torch.int64\\)"):
            bound(torch.zeros(3, 2, dtype=torch.int64), out)
        with pytest.raises(EngramError, match=r"^ids must be 2-D"):
            bound(torch.zeros(6, dtype=torch.int32), out)
        with pytest.raises(EngramError, match="^out must be a CUDA tensor"):
            bound(torch.zeros(3, 2, dtype=torch.int32), out)
    finally:
        g._handle = None


def test_host_gatherer_names_unknown_options() -> None:
    g = hostgather.HostGatherer.__new__(hostgather.HostGatherer)  # no device needed for the name check
    g._handle = ctypes.c_void_p(1)  # never reaches the library: the name is refused first
    try:
        with pytest.raises(
            EngramError,
            match="^unknown or read-only host gather option 'num_threads'; settable: "
            "chunk_rows, min_chunks, task_rows, prefetch_rows, streaming_stores, "
            "spin_us, prefetch_far_rows, prefetch_locality, job_staging_bytes$",
        ):
            g.set_options(num_threads=4)
    finally:
        g._handle = None


def test_option_names_match_the_header_enum() -> None:
    """HOST_GATHER_OPTIONS mirrors EngramHostGatherOption: each name's code is the enum
    value of ENGRAM_HOST_GATHER_<NAME>, and every enum member has a name."""
    from engram_trt.native.hostgather import HOST_GATHER_OPTIONS, HOST_GATHER_READ_ONLY

    header = (REPO / "plugins" / "kernels" / "hostGatherKernels.h").read_text()
    body = header[header.index("enum EngramHostGatherOption") :]
    body = body[: body.index("};")]
    enum = {m.group(1).lower(): int(m.group(2)) for m in re.finditer(r"ENGRAM_HOST_GATHER_(\w+) = (\d+)", body)}
    assert enum == HOST_GATHER_OPTIONS
    assert enum["job_staging_bytes"] == 11 and "job_staging_bytes" not in HOST_GATHER_READ_ONLY
