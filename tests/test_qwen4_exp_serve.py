"""A Qwen4Exp checkpoint folder behind a real ``tritonserver`` started by
``engram-trt serve`` (CPU, torch backend): the HTTP ``generate`` and
``generate_stream`` endpoints give transformers' greedy tokens for prompts with EOS runs.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

from test_qwen4_exp_parity import CASES, EOS, hf_greedy, save_qwen4  # noqa: E402

from engram_trt.errors import EngramError  # noqa: E402
from engram_trt.triton import client as hc  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[5, 17, 33, EOS, 90, 41, 7], [EOS, EOS, 3, 44, 8], [60, 61, EOS, 62]]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    pytest.importorskip("tritonclient.grpc", reason="tritonclient is not installed (pip install 'tritonclient[http,grpc]')")
    from engram_trt.triton.server import find_tritonserver

    try:
        find_tritonserver()
    except EngramError as exc:
        pytest.skip(f"nvidia-pytriton is not installed and no tritonserver is on PATH: {exc}")
    root = tmp_path_factory.mktemp("qwen4serve")
    model = save_qwen4(root / "ck", seed=21, **CASES["hc2-ple1-qsa"])
    want = [hf_greedy(model, p, 8) for p in PROMPTS]
    log = root / "tritonserver.log"
    cmd = [sys.executable, "-m", "engram_trt", "serve", str(root / "ck"), "--address", "127.0.0.1", "--http-port", "0",
           "--grpc-port", "0", "--metrics-port", "0", "--json", "--log-file", str(log), "--exit-timeout", "10",
           "--device", "cpu", "--max-batch-size", "4", "--max-num-tokens", "64"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT / "python")})
    ready, _, _ = select.select([proc.stdout], [], [], 240)
    line = proc.stdout.readline() if ready else ""
    if not line:
        proc.kill()
        _out, err = proc.communicate()
        tail = log.read_text()[-3000:] if log.exists() else ""
        pytest.fail(f"engram-trt serve did not get ready: {err[-2000:]}\n{tail}")
    info = json.loads(line)
    yield info, want
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(90) == 0, proc.stderr.read()[-2000:]


def test_http_generate_gives_transformers_tokens(served: tuple[dict, list[list[int]]]) -> None:
    info, want = served
    for prompt, ids in zip(PROMPTS, want):
        text = " ".join(f"w{i}" for i in prompt)
        status, body = hc.generate(info["http"], {"text_input": text, "max_tokens": 8, "ignore_eos": True})
        assert status == 200, body
        assert hc.ids(body["output_ids"]) == ids


def test_http_stream_gives_transformers_tokens(served: tuple[dict, list[list[int]]]) -> None:
    info, want = served
    text = " ".join(f"w{i}" for i in PROMPTS[0])
    events = hc.generate_stream(info["http"], {"text_input": text, "max_tokens": 8, "ignore_eos": True})
    _text, ids, _finish, error = hc.collect(events)
    assert error is None and ids == want[0]
