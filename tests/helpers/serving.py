"""``engram-trt serve`` behind a real tritonserver: what the serve tests need, starting and
stopping a server, its generated tokens over HTTP, and the processes and /dev/shm segments
it holds."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from helpers.checkpoints import words
from helpers.files import REPO


def require_tritonserver() -> None:
    """Skip unless what the serve tests need is here: tritonclient and a tritonserver
    (nvidia-pytriton's or one on PATH); the skip names the missing one."""
    pytest.importorskip(
        "tritonclient.grpc", reason="tritonclient is not installed (pip install 'tritonclient[http,grpc]')"
    )
    from engram_trt.errors import EngramError
    from engram_trt.triton.server import find_tritonserver

    try:
        find_tritonserver()
    except EngramError as exc:
        pytest.skip(f"nvidia-pytriton is not installed and no tritonserver is on PATH: {exc}")


def start_serve(folder: Path, log: Path, *flags: str):
    """``engram-trt serve folder`` on loopback (free ports, ``--json``, the log in
    ``log``, the working tree's package) with ``flags``: (the process, its ready line's
    dict). Fails with the server's stderr and log tail if it is not ready in 240 s."""
    import json
    import select
    import subprocess

    cmd = [
        sys.executable,
        "-m",
        "engram_trt",
        "serve",
        str(folder),
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
        "--exit-timeout",
        "10",
        *flags,
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO / "python")},
    )
    ready, _, _ = select.select([proc.stdout], [], [], 240)
    line = proc.stdout.readline() if ready else ""
    if not line:
        proc.kill()
        _out, err = proc.communicate()
        tail = log.read_text()[-3000:] if log.exists() else ""
        pytest.fail(f"engram-trt serve did not get ready: {err[-2000:]}\n{tail}")
    return proc, json.loads(line)


def stop_serve(proc) -> None:
    """SIGTERM to a server start_serve started: it must exit 0 within 90 s."""
    import signal

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(90) == 0, proc.stderr.read()[-2000:]


def assert_served_tokens(http: str, prompts: list[list[int]], want: list[list[int]], max_tokens: int) -> None:
    """HTTP ``generate`` of each word-tokenizer prompt (EOS ignored) gives ``want``'s tokens."""
    from engram_trt.triton import client as hc

    for prompt, ids in zip(prompts, want):
        status, body = hc.generate(http, {"text_input": words(prompt), "max_tokens": max_tokens, "ignore_eos": True})
        assert status == 200, body
        assert hc.ids(body["output_ids"]) == ids


def descendants(root: int) -> list[int]:
    """Live processes below ``root``."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out = []
    for pid in parent:
        p = pid
        while p in parent and p not in (0, 1, root):
            p = parent[p]
        if p == root and pid != root:
            out.append(pid)
    return out


def segments_mapped_by(root: int) -> set[str]:
    """The engram-trt /dev/shm segments that ``root`` or a process below it maps: this
    server's, not those of another test or server running beside it."""
    names: set[str] = set()
    for pid in [root, *descendants(root)]:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            fields = line.split(maxsplit=5)
            path = fields[5] if len(fields) == 6 else ""
            if path.startswith("/dev/shm/engram-trt-") and path.endswith(".tables"):
                names.add(Path(path).name)
    return names
