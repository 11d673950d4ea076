#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
"""Load check of `engram-trt serve`: N concurrent streaming clients for S seconds.

Starts `engram-trt serve` on loopback (free ports) with the small test engine (built in a
temp folder unless --engine), takes each prompt's greedy output from a lone request
first, then runs --clients threads that stream requests back to back until --seconds
pass: even-numbered clients over HTTP generate_stream (SSE), odd-numbered over one gRPC
stream each (tritonclient). It checks, and exits 1 unless all hold:
  - no request failed (an error response, a dropped stream, a time-out);
  - every output equals the lone request's output for that prompt (token ids);
  - the server's memory is flat: RSS (tritonserver + its Python-backend stubs) at the
    end within --rss-tolerance (10%) of RSS after --warmup seconds of load.
Prints a table and one JSON line (requests, tokens/s, latencies, RSS start/end, the
scheduler's batch sizes from the engram_* metrics).

    python3 scripts/triton_load.py --seconds 120 --clients 32
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python"))

from engram_trt.triton import client as hc  # noqa: E402

PROMPTS = [
    f"{w} number {i}: Engram layers look up n-grams in huge tables"
    for i, w in enumerate(
        "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau upsilon "
        "phi chi psi omega one two three four five six seven eight".split()
    )
]


def build_small_engine(where: Path) -> Path:
    """The test suite's small engine (tests/helpers/checkpoints.py): 3 layers, 2 Engram layers."""
    sys.path.insert(0, str(REPO / "tests"))
    from helpers.checkpoints import write_small_checkpoint  # noqa: E402

    from engram_trt.builder.build import build

    ckpt = write_small_checkpoint(where / "ckpt")
    out = where / "engine"
    build(ckpt, out, build_engine_if_possible=False, progress=False, max_batch=8, max_seq_len=512, max_num_tokens=64)
    return out


def process_tree_rss(pid: int) -> int:
    """RSS in bytes of ``pid`` and all its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def metrics(url: str) -> dict[str, float]:
    """The engram_* samples (tokens by phase as name[phase])."""
    out: dict[str, float] = {}
    for line in urllib.request.urlopen(url, timeout=10).read().decode().splitlines():
        m = re.match(r"^(engram_\w+)(\{[^}]*\})? ([-+0-9.eE]+)$", line)
        if m:
            phase = re.search(r'phase="(\w+)"', m.group(2) or "")
            key, v = m.group(1) + (f"[{phase.group(1)}]" if phase else ""), float(m.group(3))
            out[key] = (
                max(out.get(key, v), v) if key.endswith("_max") else out.get(key, 0.0) + v
            )  # summed over instances
    return out


class Stats:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests = 0
        self.tokens = 0
        self.failures: list[str] = []
        self.mismatches: list[str] = []
        self.ttft: list[float] = []
        self.latency: list[float] = []
        self.by_transport = {"http": 0, "grpc": 0}

    def record(
        self,
        transport: str,
        prompt: str,
        ids: list[int] | None,
        error: str | None,
        want: list[int],
        ttft: float,
        total: float,
    ) -> None:
        with self.lock:
            self.requests += 1
            self.by_transport[transport] += 1
            if error is not None or ids is None:
                self.failures.append(f"{transport}: {error}")
                return
            self.tokens += len(ids)
            self.ttft.append(ttft)
            self.latency.append(total)
            if ids != want:
                self.mismatches.append(f"{transport} {prompt!r}: {ids[:8]}... != {want[:8]}...")


def http_client(idx: int, base: str, lone: dict[str, list[int]], params: dict, deadline: float, st: Stats) -> None:
    k = idx
    while time.monotonic() < deadline:
        prompt = PROMPTS[k % len(PROMPTS)]
        k += 1
        t0 = time.perf_counter()
        ttft = 0.0
        ids: list[int] = []
        error = None
        try:
            with hc.EventStream(base, {"text_input": prompt, "stream": True, **params}, timeout=120) as s:
                for ev in s:
                    if "error" in ev:
                        error = ev["error"]
                        break
                    if not ids:
                        ttft = time.perf_counter() - t0
                    ids += hc.ids(ev.get("output_ids"))
        except Exception as exc:  # a dropped connection is a failure, counted
            error = f"{type(exc).__name__}: {exc}"
        st.record("http", prompt, ids, error, lone[prompt], ttft, time.perf_counter() - t0)


def grpc_client(idx: int, url: str, lone: dict[str, list[int]], params: dict, deadline: float, st: Stats) -> None:
    import numpy as np
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    def tensor(name: str, arr: Any) -> Any:
        t = grpcclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
        t.set_data_from_numpy(arr)
        return t

    q: queue.Queue = queue.Queue()
    c = grpcclient.InferenceServerClient(url)
    c.start_stream(callback=lambda result, error: q.put((result, error)))
    k = idx
    try:
        while time.monotonic() < deadline:
            prompt = PROMPTS[k % len(PROMPTS)]
            k += 1
            ins = [
                tensor("text_input", np.array([[prompt.encode()]], dtype=np.object_)),
                tensor("stream", np.array([[True]])),
                tensor("max_tokens", np.array([[params["max_tokens"]]], np.int32)),
                tensor("ignore_eos", np.array([[params["ignore_eos"]]])),
            ]
            t0 = time.perf_counter()
            ttft = 0.0
            ids: list[int] = []
            error = None
            c.async_stream_infer("engram_llm", ins, request_id=f"c{idx}-{k}", enable_empty_final_response=True)
            while True:
                try:
                    result, err = q.get(timeout=120)
                except queue.Empty:
                    error = "no response within 120 s"
                    break
                if err is not None:
                    error = str(err)
                    break
                out = result.as_numpy("output_ids")
                if out is not None and out.size:
                    if not ids:
                        ttft = time.perf_counter() - t0
                    ids += [int(i) for i in out.reshape(-1)]
                if result.get_response().parameters["triton_final_response"].bool_param:
                    break
            st.record("grpc", prompt, ids, error, lone[prompt], ttft, time.perf_counter() - t0)
            if error is not None:  # the stream may be broken: start a new one
                c.stop_stream()
                q = queue.Queue()
                c.start_stream(callback=lambda result, error, q=q: q.put((result, error)))
    finally:
        c.stop_stream()
        c.close()


def start_server(engine: Path, clients: int, log: Path) -> tuple[subprocess.Popen, dict]:
    cmd = [
        sys.executable,
        "-m",
        "engram_trt",
        "serve",
        str(engine),
        "--address",
        "127.0.0.1",
        "--http-port",
        "0",
        "--grpc-port",
        "0",
        "--metrics-port",
        "0",
        "--json",
        "--log-file",
        str(log),
        "--max-batch-size",
        str(clients),
        "--max-num-tokens",
        "128",
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO / "python")},
    )
    ready, _, _ = select.select([proc.stdout], [], [], 300)
    line = proc.stdout.readline() if ready else ""
    if not line:
        proc.kill()
        raise SystemExit(f"engram-trt serve did not get ready: {proc.stderr.read()[-2000:]}")
    return proc, json.loads(line)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=120.0, help="length of the load phase (default: %(default)s)")
    ap.add_argument("--clients", type=int, default=32, help="concurrent streaming clients (default: %(default)s)")
    ap.add_argument(
        "--warmup",
        type=float,
        default=15.0,
        help="seconds of load before the reference RSS is taken (default: %(default)s)",
    )
    ap.add_argument(
        "--max-tokens", type=int, default=32, help="tokens per request (greedy, ignore_eos) (default: %(default)s)"
    )
    ap.add_argument("--engine", default=None, help="engine folder to serve (default: the small test engine, built now)")
    ap.add_argument(
        "--rss-tolerance", type=float, default=0.10, help="allowed RSS growth after warm-up (default: %(default)s)"
    )
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="engram-trt-load-"))
    engine = Path(args.engine) if args.engine else build_small_engine(work)
    proc, info = start_server(engine, args.clients, work / "tritonserver.log")
    server_pid = int(info["pid"])
    params = {"max_tokens": args.max_tokens, "ignore_eos": True}
    try:
        lone: dict[str, list[int]] = {}
        for p in PROMPTS:  # each prompt alone: the reference
            status, body = hc.generate(info["http"], {"text_input": p, **params})
            if status != 200:
                raise SystemExit(f"lone request failed: {body}")
            lone[p] = hc.ids(body["output_ids"])
        m0 = metrics(info["metrics"])
        st = Stats()
        rss: list[tuple[float, int]] = []
        t_start = time.monotonic()
        deadline = t_start + args.seconds
        stop_sampling = threading.Event()

        def sample() -> None:
            while not stop_sampling.wait(1.0):
                rss.append((time.monotonic() - t_start, process_tree_rss(server_pid)))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        rss_before = process_tree_rss(server_pid)
        threads = [
            threading.Thread(
                target=(http_client if i % 2 == 0 else grpc_client),
                args=(i, info["http"] if i % 2 == 0 else info["grpc"], lone, params, deadline, st),
            )
            for i in range(args.clients)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - t_start
        stop_sampling.set()
        sampler.join()
        m1 = metrics(info["metrics"])
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(120)
        shutil.rmtree(work, ignore_errors=True)  # the engine built here and the server log
    # Medians of three samples, so one sample taken while a process was being listed
    # does not decide the check.
    warm = [r for t, r in rss if t >= args.warmup][:3]
    rss_warm = int(statistics.median(warm)) if warm else rss_before
    rss_end = int(statistics.median([r for _, r in rss[-3:]])) if rss else rss_before
    growth = (rss_end - rss_warm) / rss_warm
    steps = m1.get("engram_steps_total", 0) - m0.get("engram_steps_total", 0)
    toks = sum(
        m1.get(f"engram_tokens_total[{ph}]", 0) - m0.get(f"engram_tokens_total[{ph}]", 0)
        for ph in ("prefill", "decode")
    )
    res = {
        "clients": args.clients,
        "seconds": round(elapsed, 1),
        "requests": st.requests,
        "by_transport": st.by_transport,
        "failed": len(st.failures),
        "mismatched": len(st.mismatches),
        "generated_tokens": st.tokens,
        "tokens_per_s": round(st.tokens / elapsed, 1),
        "requests_per_s": round(st.requests / elapsed, 2),
        "ttft_s_p50": round(statistics.median(st.ttft), 3) if st.ttft else None,
        "latency_s_p50": round(statistics.median(st.latency), 3) if st.latency else None,
        "latency_s_p99": round(sorted(st.latency)[int(0.99 * (len(st.latency) - 1))], 3) if st.latency else None,
        "rss_before_load_mib": round(rss_before / 2**20, 1),
        "rss_after_warmup_mib": round(rss_warm / 2**20, 1),
        "rss_end_mib": round(rss_end / 2**20, 1),
        "rss_max_mib": round(max(r for _, r in rss) / 2**20, 1) if rss else None,
        "rss_growth_after_warmup": round(growth, 4),
        "rss_timeline_mib": {f"{t:.0f}s": round(r / 2**20, 1) for t, r in rss[9::10]},
        "scheduler_steps": int(steps),
        "tokens_per_step": round(toks / steps, 2) if steps else None,
        "max_sequences_per_step": m1.get("engram_step_sequences_max"),
        "server_exit_code": rc,
    }
    checks = [
        ("no failed request", not st.failures),
        ("every output equals the lone request's", not st.mismatches),
        (f"RSS end within {args.rss_tolerance:.0%} of after warm-up", growth <= args.rss_tolerance),
        ("server stopped cleanly", rc == 0),
    ]
    print(f"\n{'figure':<34} value")
    for k, v in res.items():
        print(f"{k:<34} {v}")
    print()
    for name, ok in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    for f in (st.failures + st.mismatches)[:10]:
        print("   ", f)
    print(json.dumps(res))
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
