"""Probes the GPU tests run in a child process each, where a CUDA fault cannot end the test
session (formerly ``scripts/h200_verify.py --probe NAME``):

  stale-error(-unmapped)          a call that fails in a CUDA runtime call leaves no stale
                                  error for the next gather / gate (test_verify.py);
  destroy-during-gather           destroying a host gatherer from another thread waits for
                                  its gather (test_verify.py);
  build-phase-garbage             a kBUILD EngramGather enqueued with unmapped table and
                                  counter addresses writes zero rows (test_edge_cases.py);
  runtime-phase-garbage-control   the same addresses in a kRUNTIME plugin fault, which
                                  shows they are unreadable (test_edge_cases.py).

    python -m gpu.probes NAME BUILD_DIR    (tests/ on PYTHONPATH; prints ``PROBE {json}``)
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from gpu.helpers import DT, Harness, counted_gather_fields, harness_path

# 16-byte aligned addresses no allocation of this process uses (unmapped for the GPU):
# a read through them faults, as the runtime-phase control probe shows.
GARBAGE_ROWS = 0x5EAD_BEE0_0000
GARBAGE_SCALES = 0x5EAD_BEF0_0000
GARBAGE_COUNTER = 0x5EAD_BF00_0000


def probe(name: str, build_dir: Path) -> dict:
    """One probe (its result: name, ok, detail; a stale-error probe whose provocation did
    not fail also says ``provoked: False``)."""
    import threading

    import torch

    from engram_trt.native import gate as gate_kernels
    from engram_trt.native import gather as gather_kernels
    from engram_trt.native import hostgather
    from engram_trt.errors import EngramError

    dev = torch.device("cuda")
    lib = hostgather.library()
    rng = np.random.default_rng(0)

    if name in ("build-phase-garbage", "runtime-phase-garbage-control"):
        return probe_build_phase(name, Harness(harness_path(build_dir)))

    if name.startswith("stale-error"):
        # A call that fails in a CUDA runtime call (the host gather's copy into memory that is
        # no device memory), then calls that must succeed: before the fix, the first one's
        # non-sticky error stayed in the runtime and the next launch check reported it.
        g = hostgather.HostGatherer(num_threads=2, chunk_rows=64, max_head_dim=64)
        ids = np.arange(32, dtype=np.int32).reshape(8, 4)
        table = torch.randn(100, 64, dtype=torch.bfloat16)
        if name == "stale-error":
            host_out = np.zeros(8 * 4 * 64 * 2 + 16, np.uint8)  # pageable host memory
            dst = host_out.ctypes.data + (-host_out.ctypes.data) % 16
        else:
            dst = 1 << 12  # an unmapped address
        status = lib.engram_host_gather(
            g._handle,
            ids.ctypes.data_as(ctypes.c_void_p),
            8,
            4,
            4,
            ctypes.c_void_p(table.data_ptr()),
            None,
            100,
            64,
            gather_kernels.TABLE_BF16,
            32,
            ctypes.c_void_p(dst),
            ctypes.c_void_p(torch.cuda.current_stream().cuda_stream),
        )
        first = lib.engram_last_error().decode()
        if status == 0:  # not provoked: the caller tries the other destination
            return {
                "name": f"probe {name}",
                "provoked": False,
                "ok": False,
                "detail": "the host gather into "
                f"{'pageable host memory' if name == 'stale-error' else 'address 0x1000'} "
                "reported success",
            }
        try:
            table_dev = table.to(dev)
            out = gather_kernels.gather(torch.from_numpy(ids).to(dev), table_dev)
            hidden = torch.randn(4, 2, 64, dtype=torch.bfloat16, device=dev)
            kv = torch.randn(4, 3 * 64, dtype=torch.bfloat16, device=dev)
            w = torch.ones(2, 64, dtype=torch.bfloat16, device=dev)
            gate_kernels.gate(hidden, kv, w, w, eps=1e-6)
            torch.cuda.synchronize()
            ok = torch.equal(out.cpu(), table[torch.from_numpy(ids).long()])
            detail = f"first call failed ({status}: {first[:90]}); gather and gate after it succeeded"
        except EngramError as exc:
            ok, detail = False, f"first call failed ({status}: {first[:90]}); then: {exc}"[:300]
        return {
            "name": "kernel a failed call leaves no stale CUDA error (next gather / gate succeed)",
            "ok": ok,
            "detail": detail,
        }

    if name == "destroy-during-gather":
        # destroy from a second thread while the gather runs: it must wait for the gather
        # (before the fix it freed the staging under it). ctypes releases the GIL in calls.
        # The destroy starts 10 ms into the gather; a gather that ends sooner (a fast host)
        # proves nothing, so the gather doubles, up to 3 attempts: one that never overlaps
        # is a failure saying so, not a skip.
        rows, width, cols = 1 << 20, 128, 32
        table = torch.randn(rows, width, dtype=torch.bfloat16)
        attempts = []
        for attempt in range(3):
            T = (1 << 16) << attempt
            ids = torch.from_numpy(rng.integers(0, rows, size=(T, cols)).astype(np.int32))
            g = hostgather.HostGatherer(num_threads=4, chunk_rows=16384, max_head_dim=width)
            g.gather(ids[:64], table)  # warm-up
            torch.cuda.synchronize()
            times = {}

            def destroy(g=g, times=times):
                time.sleep(0.01)
                times["destroy_start"] = time.perf_counter()
                g.close()
                times["destroy_end"] = time.perf_counter()

            thread = threading.Thread(target=destroy)
            times["gather_start"] = time.perf_counter()
            thread.start()
            out = g.gather(ids, table)
            times["gather_end"] = time.perf_counter()
            thread.join()
            torch.cuda.synchronize()
            same = torch.equal(out.cpu(), table[ids.long()])
            ms = {k: round((v - times["gather_start"]) * 1e3, 1) for k, v in times.items()}
            attempts.append(f"{T} x {cols} rows: {ms} ms")
            del out
            if times["gather_start"] < times["destroy_start"] < times["gather_end"]:
                return {
                    "name": "kernel host gatherer destroy during a gather waits for it",
                    "ok": same,
                    "detail": f"rows exact={same}; ms since gather start: {ms} (attempt {attempt + 1})",
                }
        return {
            "name": "kernel host gatherer destroy during a gather waits for it",
            "ok": False,
            "detail": "the destroy never started during the gather, so the wait was not tested: " + "; ".join(attempts),
        }
    raise SystemExit(f"unknown probe {name}")


def probe_build_phase(name: str, harness) -> dict:
    """``build-phase-garbage``: a kBUILD EngramGather enqueued with unmapped table and
    counter addresses writes zero rows and leaves the context healthy.
    ``runtime-phase-garbage-control``: the same addresses in a kRUNTIME plugin fault,
    which shows they are unreadable (so the first probe would have failed had it read)."""
    import torch

    from engram_trt.native import gather as gather_kernels

    dev = torch.device("cuda")
    stream = torch.cuda.current_stream().cuda_stream
    rng = np.random.default_rng(1)
    T, L, cols, head_dim, rows_n = 64, 2, 24, 256, 1000
    ids = torch.from_numpy(rng.integers(0, rows_n, size=(T, L, cols)).astype(np.int32)).to(dev)
    phase = 0 if name == "build-phase-garbage" else 1
    h = harness.create("EngramGather", counted_gather_fields(0, L, cols, head_dim, 0, 32, rows_n), phase=phase)
    out = torch.full((T, cols, head_dim), float("nan"), dtype=torch.bfloat16, device=dev)
    inputs = [ids] + [
        torch.tensor([a], dtype=torch.int64, device=dev) for a in (GARBAGE_ROWS, GARBAGE_SCALES, GARBAGE_COUNTER)
    ]
    try:
        harness.run(h, inputs, [DT["int32"]] + [DT["int64"]] * 3, out, DT["bfloat16"], stream)
        torch.cuda.synchronize()
        error = None
    except Exception as exc:  # noqa: BLE001 - a fault is the control's expected outcome
        error = f"{type(exc).__name__}: {str(exc)[:160]}"
    if name == "build-phase-garbage":
        if error is not None:
            return {
                "name": "plugin EngramGather build phase, unmapped addresses: no read, zero rows",
                "ok": False,
                "detail": error,
            }
        zero = int(torch.count_nonzero(out.view(torch.int16))) == 0
        # the context is healthy: a real gather afterwards is exact
        table = torch.randn(rows_n, 64, dtype=torch.bfloat16, device=dev)
        flat = ids[:, 0, :].contiguous()
        exact = torch.equal(gather_kernels.gather(flat, table).cpu(), table.cpu()[flat.cpu().long()])
        return {
            "name": "plugin EngramGather build phase, unmapped table / counter addresses: no read, zero rows",
            "ok": zero and exact,
            "detail": f"zero rows={zero}; next gather in the context exact={exact}",
        }
    return {
        "name": "control: the same unmapped addresses in the runtime phase fault (the build-phase probe "
        "would have seen a read)",
        "ok": error is not None,
        "detail": error or "no fault: the addresses were readable, the build-phase probe proves nothing",
    }


def main(argv: list[str]) -> int:
    name, build_dir = argv[0], Path(argv[1])
    os.environ["ENGRAM_TRT_PLUGIN_LIB"] = str(build_dir / "libengram_trt_plugins.so")
    print("PROBE " + json.dumps(probe(name, build_dir)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
