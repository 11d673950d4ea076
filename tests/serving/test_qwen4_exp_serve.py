"""A Qwen4Exp checkpoint folder behind a real ``tritonserver`` started by
``engram-trt serve`` (CPU, torch backend): the HTTP ``generate`` and
``generate_stream`` endpoints give transformers' greedy tokens for prompts with EOS runs.
"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

from helpers.checkpoints import words  # noqa: E402
from helpers.serving import assert_served_tokens, require_tritonserver, start_serve, stop_serve  # noqa: E402
from helpers.qwen4_exp import CASES, EOS, hf_greedy, save_qwen4  # noqa: E402

from engram_trt.triton import client as hc  # noqa: E402

PROMPTS = [[5, 17, 33, EOS, 90, 41, 7], [EOS, EOS, 3, 44, 8], [60, 61, EOS, 62]]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    require_tritonserver()
    root = tmp_path_factory.mktemp("qwen4serve")
    model = save_qwen4(root / "ck", seed=21, **CASES["hc2-ple1-qsa"])
    want = [hf_greedy(model, p, 8) for p in PROMPTS]
    log = root / "tritonserver.log"
    proc, info = start_serve(root / "ck", log, "--device", "cpu", "--max-batch-size", "4", "--max-num-tokens", "64")
    yield info, want
    stop_serve(proc)


def test_http_generate_gives_transformers_tokens(served: tuple[dict, list[list[int]]]) -> None:
    info, want = served
    assert_served_tokens(info["http"], PROMPTS, want, 8)


def test_http_stream_gives_transformers_tokens(served: tuple[dict, list[list[int]]]) -> None:
    info, want = served
    events = hc.generate_stream(info["http"], {"text_input": words(PROMPTS[0]), "max_tokens": 8, "ignore_eos": True})
    _text, ids, _finish, error = hc.collect(events)
    assert error is None and ids == want[0]
