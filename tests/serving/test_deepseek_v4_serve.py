"""DeepSeek-V4 and V4.1 checkpoint folders behind a real ``tritonserver`` started by
``engram-trt serve`` (CPU, torch backend): HTTP ``generate`` gives transformers' greedy
tokens (V4) and the model's own greedy tokens with its Engram tables (V4.1, the tables
served from the runtime's store and prefetched by its scheduler), for prompts with EOS
runs (and, for V4.1, pad ids); ``generate_stream`` gives the same tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from helpers.checkpoints import words  # noqa: E402
from helpers.serving import assert_served_tokens, require_tritonserver, start_serve, stop_serve  # noqa: E402
from helpers.deepseek_v4 import hf_greedy, save_v4, save_v41  # noqa: E402

from engram_trt.triton import client as hc  # noqa: E402

EOS = 2
PAD = 0  # V4.1's engram_pad_token_id (save_v41)
PROMPTS = [[5, 17, 33, EOS, 90, 41, 7], [EOS, EOS, 3, 44, 8], [60, 61, EOS, 62, 63, 9, 10, 11, 12]]
# V4.1's prompts also hold pad ids (their own compressed id in the hash). Not V4's: with
# pad_token_id=0 transformers' generate would mask those tokens out of its attention.
PROMPTS_V41 = [[5, 17, 33, EOS, 90, PAD, 7], [EOS, EOS, 3, 44, 8], [60, 61, EOS, 62, PAD, PAD, 9, 10, 11]]
NEW = 8


def _v41_greedy(folder: Path, prompts: list[list[int]]) -> list[list[int]]:
    """The V4.1 model's own greedy tokens, gathering its rows itself (chunked prefill)."""
    from engram_trt.models.registry import open_checkpoint
    from engram_trt.tables.base import TableStore

    ckpt = open_checkpoint(folder)
    ours = ckpt.architecture.load_model(ckpt, device="cpu", dtype=torch.float32)
    ours.set_tables(
        TableStore.from_tensors(
            [ckpt.get(f"model.layers.{lid}.engram.embed.weight") for lid in (0, 2)], [None, None], 32, (0, 2)
        )
    )
    want = [ours.generate_greedy(p, NEW, chunk=3, ignore_eos=True) for p in prompts]
    ckpt.close()
    return want


@pytest.fixture(scope="module", params=["v4", "v41"])
def served(
    request: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[dict, list[list[int]], list[list[int]]]]:
    require_tritonserver()
    root = tmp_path_factory.mktemp(f"dsv4serve-{request.param}")
    folder = root / "ck"
    if request.param == "v4":
        prompts = PROMPTS
        model = save_v4(folder, seed=31)
        want = [hf_greedy(model, p, NEW) for p in prompts]
    else:
        gen = torch.Generator().manual_seed(32)
        save_v41(folder, lambda rows, width: torch.randn(rows, width, generator=gen), seed=33)
        prompts = PROMPTS_V41
        want = _v41_greedy(folder, prompts)
    log = root / "tritonserver.log"
    proc, info = start_serve(
        folder, log, "--device", "cpu", "--dtype", "fp32", "--max-batch-size", "4", "--max-num-tokens", "64"
    )
    yield info, prompts, want
    stop_serve(proc)


def test_http_generate_gives_the_reference_tokens(served: tuple[dict, list[list[int]], list[list[int]]]) -> None:
    info, prompts, want = served
    assert_served_tokens(info["http"], prompts, want, NEW)


def test_http_stream_gives_the_reference_tokens(served: tuple[dict, list[list[int]], list[list[int]]]) -> None:
    info, prompts, want = served
    events = hc.generate_stream(info["http"], {"text_input": words(prompts[2]), "max_tokens": NEW, "ignore_eos": True})
    _text, ids, _finish, error = hc.collect(events)
    assert error is None and ids == want[2]
