"""The gather driver (runtime/gatherDriver.cpp, engram_trt.native.gatherdriver) on a GPU
(formerly scripts/h200_driver_check.py, run by h200_hostgather_check.py), in one test:

  - a whole step as one job (the driver uploads and hashes the ids, copies the row ids
    back, gathers each layer): row ids equal hash_batch_packed, rows the dequant reference,
    from split tables and from tables whose scales are in HBM (their dequant reads the
    device row ids); a plain job with scales in HBM is refused (it has no device ids);
  - jobs queued at once (three layers of [T, L, cols] ids, split and inline fp8 tables)
    equal the NumPy dequant reference, read on another stream after its GPU wait, with
    the wait enqueued before the job ran (a slow first job keeps the driver busy; without
    a working wait the reader copies the NaN the outputs were filled with);
  - ids that arrive by a copy back from the GPU behind a slow kernel (ids_ready): the
    driver waits for the event (without it, it reads the -1s the buffer held: zero rows);
  - a job that fails on the driver thread (a table dtype the library refuses): finish()
    raises its message, the reader's stream is released (it does not hang), and the next
    job runs;
  - close() with jobs still queued runs them first (their outputs exact);
  - the driver against the engine-thread gather on a 24-column prefill-sized call: the
    time until the engine thread is free again, and until the rows are ready.
"""

from __future__ import annotations

import ctypes
import itertools
import time
from typing import Any

import numpy as np

from .helpers import fatal, note, say


def check_driver(dev: Any, timings: dict[str, float], table: Any) -> None:
    """``table``: the caller's fp8 test table (``values``, ``scales`` as NumPy, ``rows_t``,
    ``scales_t``, ``inline_t`` as CPU tensors, ``N``, ``D``, ``QB``) with its ``ref_fp8(ids)``
    (the NumPy dequant reference, zero rows for ids off the table) and ``same(a, b)``
    (bit equality)."""
    import torch

    from engram_trt.native import gatherdriver
    from engram_trt.native import hostgather
    from engram_trt.errors import EngramError

    ok = gatherdriver.driver_supported(dev)
    assert ok, "gather driver: the device has 64-bit stream memory operations"
    if not ok:
        return
    rng = np.random.default_rng(5)
    N, D, QB = table.N, table.D, table.QB
    rows_t, scales_t, inline_t = table.rows_t, table.scales_t, table.inline_t
    ref_fp8, same = table.ref_fp8, table.same

    def done_or_exit(stream: Any, what: str, seconds: float = 30.0) -> None:
        """Wait for ``stream`` at most ``seconds``: a stream that waits forever on a
        driver ticket fails the check and ends the process (it could not exit otherwise)."""
        ev = torch.cuda.Event()
        ev.record(stream)
        t0 = time.perf_counter()
        while not ev.query():
            if time.perf_counter() - t0 > seconds:
                say(
                    f"[FAIL] gather driver: {what} completes: not done after {seconds:.0f} s: a stream waits "
                    "forever (a hang)"
                )
                fatal("ending the process, a CUDA stream cannot be released")
            time.sleep(0.0005)

    side = torch.cuda.Stream(dev, priority=-1)
    reader = torch.cuda.Stream(dev)
    g = hostgather.HostGatherer(device=dev, max_head_dim=512)
    drv = gatherdriver.GatherDriver(g)

    # 1. three layers queued at once behind a slow job; the reader waits on the GPU
    T, L, cols = 4096, 3, 24
    ids3 = torch.from_numpy(rng.integers(-20, N + 20, size=(T, L, cols)).astype(np.int32)).pin_memory()
    slow_ids = torch.from_numpy(rng.integers(0, N, size=(60_000, cols)).astype(np.int32)).pin_memory()
    for layout, table in (("split", (rows_t, scales_t)), ("inline", (inline_t, None))):
        outs = [torch.full((T, cols, D), float("nan"), dtype=torch.bfloat16, device=dev) for _ in range(L)]
        slow_out = torch.empty((60_000, cols, D), dtype=torch.bfloat16, device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))  # the NaN fills come first
        t0 = time.perf_counter()
        slow = drv.submit(slow_ids, *table, quant_block=QB, out=slow_out, stream=side, layout=layout)
        tickets = [
            drv.submit(ids3, *table, layer=li, quant_block=QB, out=outs[li], stream=side, layout=layout)
            for li in range(L)
        ]
        copies = []
        with torch.cuda.stream(reader):
            for li in range(L):
                drv.wait_stream(tickets[li], reader)
                copies.append(outs[li].clone())
        enqueued = time.perf_counter() - t0
        done_or_exit(reader, f"{layout} reads")
        ready = time.perf_counter() - t0
        drv.finish()
        good = all(same(copies[li].reshape(-1, D), ref_fp8(ids3[:, li, :].numpy().reshape(-1))) for li in range(L))
        # the reads were enqueued long before the rows existed: the GPU wait held them
        assert good and enqueued < 0.3 * ready, (
            f"gather driver, {layout}: 3 layers queued behind a 1.4M-row job, read on another stream after its "
            f"GPU wait: tickets {slow}, {tickets}; reads enqueued after {enqueued * 1e3:.2f} ms, "
            f"ready after {ready * 1e3:.2f} ms"
        )

    # 1b. a whole step as one job: ids hashed on the GPU by the driver, both layers gathered
    def check_step_jobs() -> None:
        """Its own scope: the cases rebind T and layout, which the later checks use."""
        from engram_trt.config.model import EngramSpec
        from engram_trt.engram.hashing import hash_batch_packed
        from engram_trt.engram.layout import EngramLayout

        spec = EngramSpec(
            layer_ids=(1, 2),
            max_ngram_size=3,
            n_heads=4,
            vocab_size=18000,
            compressed_vocab_size=17000,
            pad_token_id=0,
            head_dim=D,
        )
        layout = EngramLayout.from_spec(spec, pad_id=3)
        Ls, cols_s, n = layout.num_layers, layout.n_hash_cols, layout.max_ngram_size - 1
        buffers = gatherdriver.StepBuffers(4096, Ls, cols_s, n, dev)
        cases = []
        scales_dev = scales_t.to(dev)
        for (S, max_len, fresh), form in itertools.product(
            ((1, 1, False), (64, 1, False), (5, 700, False), (9, 300, True), (3, 0, False)), ("split", "hbm-scales")
        ):
            lens = rng.integers(0 if max_len == 0 else 1, max_len + 1, size=S)
            T = int(lens.sum())
            starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
            cids = rng.integers(0, 17000, size=T)
            cids[rng.random(T) < 0.05] = -1
            lookback = None if fresh else rng.integers(-1, 17000, size=(S, n))
            want = hash_batch_packed(cids, starts, lookback, layout)
            outs = [torch.full((T, cols_s, D), float("nan"), dtype=torch.bfloat16, device=dev) for _ in range(Ls)]
            side.wait_stream(torch.cuda.current_stream(dev))  # the NaN fills come first
            tables = [(rows_t, scales_dev if form == "hbm-scales" else scales_t, QB, form)] * Ls
            tickets = drv.submit_step(layout, cids, starts, lookback, buffers, tables, outs, stream=side)
            with torch.cuda.stream(reader):
                copies = []
                for li in range(Ls):
                    drv.wait_stream(tickets[li], reader)
                    copies.append(outs[li].clone())
            done_or_exit(reader, f"step job of {S} sequences")
            drv.finish()
            ids_ok = np.array_equal(buffers.row_ids_host[:T].numpy(), want.astype(np.int32))
            rows_ok = all(same(copies[li].reshape(-1, D), ref_fp8(want[:, li, :].reshape(-1))) for li in range(Ls))
            cases.append((S, T, fresh, ids_ok, rows_ok, form))
        assert all(c[3] and c[4] for c in cases), (
            "gather driver, step jobs: the driver's hash == hash_batch_packed and both layers' rows == the dequant "
            "reference (1 / 64 decode sequences, chunks of up to 700 tokens, fresh sequences, an empty step; "
            "split tables and scales in HBM): "
            + "; ".join(
                f"S={c[0]} T={c[1]}{' fresh' if c[2] else ''} {c[5]}: ids {'ok' if c[3] else 'DIFFER'}, "
                f"rows {'ok' if c[4] else 'DIFFER'}"
                for c in cases
            )
        )
        try:
            drv.submit(
                torch.zeros((4, 24), dtype=torch.int32).pin_memory(),
                rows_t,
                scales_dev,
                quant_block=QB,
                out=torch.empty((4, 24, D), dtype=torch.bfloat16, device=dev),
                stream=side,
                layout="hbm-scales",
            )
            refused = "ACCEPTED"
        except EngramError as e:
            refused = str(e)
        assert refused != "ACCEPTED", (
            f"gather driver: a plain job with scales in HBM is refused (it has no device ids): {refused}"
        )

    check_step_jobs()

    # 2. ids copied back from the GPU behind a slow kernel: the driver waits for ids_ready
    dev_ids = torch.from_numpy(rng.integers(0, N, size=(2048, cols)).astype(np.int32)).to(dev)
    host_ids = torch.full((2048, cols), -1, dtype=torch.int32).pin_memory()
    busy = torch.empty(1 << 26, device=dev)
    out = torch.empty((2048, cols, D), dtype=torch.bfloat16, device=dev)
    with torch.cuda.stream(side):
        for _ in range(40):
            busy.mul_(1.0001)  # ~10 ms of work before the ids arrive
        host_ids.copy_(dev_ids, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(side)
    t = drv.submit(host_ids, rows_t, scales_t, quant_block=QB, out=out, stream=side, ids_ready=ready)
    drv.wait_stream(t, reader)
    with torch.cuda.stream(reader):
        got = out.clone()
    done_or_exit(reader, "late-ids read")
    drv.finish()
    assert same(got.reshape(-1, D), ref_fp8(dev_ids.cpu().numpy().reshape(-1))), (
        "gather driver: ids copied back behind ~10 ms of GPU work, the driver waits for their event"
    )

    # 3. a job that fails on the driver thread releases its reader and reports its message
    bad_ids = torch.zeros((16, cols), dtype=torch.int32).pin_memory()
    out = torch.empty((16, cols, D), dtype=torch.bfloat16, device=dev)
    ticket = ctypes.c_uint64(0)
    gatherdriver._ENTRY.call(
        "engram_gather_driver_submit",
        drv._handle,
        ctypes.c_void_p(bad_ids.data_ptr()),
        16,
        cols,
        cols,
        ctypes.c_void_p(rows_t.data_ptr()),
        ctypes.c_void_p(scales_t.data_ptr()),
        N,
        D,
        7,
        QB,
        0,
        ctypes.c_void_p(out.data_ptr()),
        ctypes.c_void_p(side.cuda_stream),
        None,
        ctypes.byref(ticket),
    )
    drv.last_ticket = int(ticket.value)
    drv.wait_stream(int(ticket.value), reader)
    done = torch.cuda.Event()
    done.record(reader)
    t0 = time.perf_counter()
    while not done.query() and time.perf_counter() - t0 < 10:
        time.sleep(0.001)
    released = done.query()
    try:
        drv.finish()
        message = "no error raised"
    except EngramError as exc:
        message = str(exc)
    after = torch.from_numpy(rng.integers(0, N, size=(64, cols)).astype(np.int32)).pin_memory()
    out_after = torch.empty((64, cols, D), dtype=torch.bfloat16, device=dev)
    drv.wait_stream(drv.submit(after, rows_t, scales_t, quant_block=QB, out=out_after, stream=side))
    done_or_exit(torch.cuda.current_stream(dev), "the job after a failed one")
    drv.finish()
    torch.cuda.synchronize(dev)
    assert (
        released
        and "table_dtype 7" in message
        and "failed" in message
        and same(out_after.reshape(-1, D), ref_fp8(after.numpy().reshape(-1)))
    ), (
        "gather driver: a job failing on its thread releases the reader, finish() raises its message, the next "
        f"job runs: {message[:160]}"
    )

    # 4. close() with queued jobs runs them first
    outs = [torch.empty((T, cols, D), dtype=torch.bfloat16, device=dev) for _ in range(L)]
    for li in range(L):
        drv.submit(ids3, rows_t, scales_t, layer=li, quant_block=QB, out=outs[li], stream=side)
    drv.close()
    torch.cuda.synchronize(dev)
    assert all(same(outs[li].reshape(-1, D), ref_fp8(ids3[:, li, :].numpy().reshape(-1))) for li in range(L)), (
        "gather driver: close() runs the queued jobs first"
    )

    # 5. engine thread free again: the driver vs the engine-thread gather (196,608 rows)
    big = torch.from_numpy(rng.integers(0, N, size=(8192, cols)).astype(np.int32)).pin_memory()
    out = torch.empty((8192, cols, D), dtype=torch.bfloat16, device=dev)
    drv = gatherdriver.GatherDriver(g)
    free_d, ready_d, free_s, ready_s = [], [], [], []
    for i in range(7):
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        tk = drv.submit(big, rows_t, scales_t, quant_block=QB, out=out, stream=side)
        drv.wait_stream(tk, reader)
        free_d.append(time.perf_counter() - t0)
        done_or_exit(reader, "timed read")
        ready_d.append(time.perf_counter() - t0)
        drv.finish()
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        with torch.cuda.stream(side):
            g.gather(big, rows_t, scales_t, quant_block=QB, out=out)
        free_s.append(time.perf_counter() - t0)
        side.synchronize()
        ready_s.append(time.perf_counter() - t0)
    drv.close()
    g.close()
    med = lambda xs: float(np.median(xs[2:])) * 1e6  # noqa: E731
    timings.update(
        {
            "driver: engine thread free after (us)": med(free_d),
            "driver: rows ready after (us)": med(ready_d),
            "engine-thread gather: free after (us)": med(free_s),
            "engine-thread gather: rows ready after (us)": med(ready_s),
        }
    )
    assert med(free_d) < 0.25 * med(ready_d), (
        f"gather driver: the engine thread is free before the rows are ready (196,608 rows): "
        f"free {med(free_d):.0f} us, "
        f"ready {med(ready_d):.0f} us; engine-thread gather {med(free_s):.0f} / {med(ready_s):.0f} us"
    )


def test_driver(dev, tab) -> None:
    timings: dict[str, float] = {}
    try:
        check_driver(dev, timings, tab)
    finally:
        note("timings", timings)
