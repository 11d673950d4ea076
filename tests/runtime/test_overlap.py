"""The scheduler's overlapped decode: a greedy decode step queued before the last step's
tokens are read, its input ids the last step's argmax where it lies (runtime/scheduler.py,
``_chainable`` / ``_launch_chained`` / ``_complete``).

Reference: transformers 5.25's greedy ``generate`` of a tiny random DeepSeek-V4 it built
and saved, and the same runtime with the overlap off (``ENGRAM_TRT_OVERLAP=0``). On a CPU
the queued step takes the same path as on a GPU up to the device itself: its compressed
ids are gathered from the argmax tensor (``compress_on_device``) and its host compressed ids
filled in only when the step before is read; but the CPU's tensors are readable at once
and its steps run in order, so the copies into the decode graphs' buffers, the pinned
copies and their events are the GPU tests' (tests/gpu/test_deepseek_v4_graphs.py). The
tokens, the stops and the slot hand-overs must be those of the serial loop, and the
counters say the overlap did run (``chained_steps``) and a sequence did stop under a
queued step (``chained_stopped_rows``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

from helpers.deepseek_v4 import PROMPTS, hf_greedy, save_v4  # noqa: E402

N = 9


@pytest.fixture(scope="module")
def dsv4(tmp_path_factory: Any) -> tuple[Path, list[list[int]]]:
    folder = tmp_path_factory.mktemp("overlap") / "ck"
    model = save_v4(folder, seed=11)
    return folder, [hf_greedy(model, p, N) for p in PROMPTS]


def _serve(
    folder: Path, prompts: list, params: list, monkeypatch: Any, overlap: bool, **kw: Any
) -> tuple[list[list[int]], list[str], dict]:
    """(token ids, finish reasons, stats) of ``prompts`` through ``LLM`` on the CPU, the overlap on or off."""
    from engram_trt import LLM

    monkeypatch.setenv("ENGRAM_TRT_OVERLAP", "1" if overlap else "0")
    with LLM(str(folder), backend="torch", device="cpu", dtype="fp32", progress=False, **kw) as llm:
        outs = [o.outputs[0] for o in llm.generate(prompts, params)]
        return [list(o.token_ids) for o in outs], [o.finish_reason for o in outs], llm.stats()


def _both(folder: Path, prompts: list, params: list, monkeypatch: Any, **kw: Any) -> dict[bool, tuple]:
    """:func:`_serve` with the overlap on (True) and off (False)."""
    return {overlap: _serve(folder, prompts, params, monkeypatch, overlap, **kw) for overlap in (True, False)}


def _greedy(n: int = N, **kw: Any) -> Any:
    from engram_trt import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def test_overlapped_decode_gives_transformers_tokens_with_no_extra_step(
    dsv4: tuple[Path, list[list[int]]], monkeypatch: Any
) -> None:
    folder, want = dsv4
    got = _both(folder, PROMPTS, [_greedy()] * 3, monkeypatch)
    (on, on_reasons, st_on), (off, _, st_off) = got[True], got[False]
    assert on == want
    assert off == want
    # no row computed in vain (the overlap stops one step before max_tokens): the same tokens run as
    # the serial loop's, the prompts and N - 1 decode tokens a sequence (how the engine thread grouped
    # the prompts that arrived one by one may differ, so the step counts are not compared)
    tokens = sum(map(len, PROMPTS)) + 3 * (N - 1)
    assert st_on["tokens"] == st_off["tokens"] == tokens
    assert st_on["decode_tokens"] == st_off["decode_tokens"] == 3 * (N - 1)
    assert st_off["chained_steps"] == 0 and st_on["chained_steps"] >= N - 4  # most decode steps queued ahead
    assert on_reasons == ["length"] * 3


def test_a_sequence_that_stops_under_a_queued_step_takes_nothing_of_it(
    dsv4: tuple[Path, list[list[int]]], monkeypatch: Any
) -> None:
    """Sequence 0 stops on a stop id while the next step (it in it) is already queued; the
    others go on in that step and after it, and a waiting fourth request takes the freed
    slot (``max_batch_size`` 3) while the queued step still writes into it."""
    folder, want = dsv4
    k = next(k for k in range(2, N - 2) if want[0][k] not in want[0][:k])  # a stop id that first comes at k
    params = [_greedy(stop_token_ids=(want[0][k],)), _greedy(), _greedy(), _greedy()]
    got = _both(folder, [*PROMPTS, PROMPTS[1]], params, monkeypatch, max_batch_size=3)
    ids, reasons, st = got[True]
    assert ids == [want[0][: k + 1], want[1], want[2], want[1]]
    assert reasons == ["stop", "length", "length", "length"]
    assert (ids, reasons) == got[False][:2]
    assert st["chained_steps"] > 0 and got[False][2]["chained_steps"] == 0
    assert st["chained_stopped_rows"] == 1  # sequence 0 stopped with a step queued after it
    assert st["tokens"] == got[False][2]["tokens"]  # its row of that step is not counted


def test_sampled_requests_are_not_queued_ahead(dsv4: tuple[Path, list[list[int]]], monkeypatch: Any) -> None:
    """A sampled request draws on the host from its own generator: nothing to queue ahead."""
    from engram_trt import SamplingParams

    folder, _ = dsv4
    hot = SamplingParams(max_tokens=N, temperature=0.8, seed=5, ignore_eos=True)
    got = _both(folder, PROMPTS, [hot, _greedy(), _greedy()], monkeypatch)
    assert got[True][:2] == got[False][:2]
    assert got[True][2]["chained_steps"] == 0


def _v41(root: Path) -> Path:
    import torch

    from helpers.deepseek_v4 import save_v41

    folder = root / "v41"
    save_v41(folder, lambda rows, width: torch.randn(rows, width, generator=torch.Generator().manual_seed(rows)))
    return folder


@pytest.mark.parametrize("family", ["engram-llama", "deepseek-v41"])
def test_engram_models_queue_ahead_with_their_lookback(
    family: str, small_ckpt: Path, tmp_path: Path, monkeypatch: Any
) -> None:
    """An Engram model's queued step carries the N-1 compressed ids before its token (the
    last of them the step before's own input) and its token's compressed id, made where
    the token lies: the serial loop's tokens, alone and through a stop id that hands a
    slot to a waiting request (``max_batch_size`` 2: the stopped sequence's lookback row is
    the new request's by then)."""
    folder = small_ckpt if family == "engram-llama" else _v41(tmp_path)  # Engram on two of three layers each
    prompts = [[5, 17, 33, 2, 9, 41, 7], [3, 44, 45, 9], [11, 12, 13, 14, 15, 16]]
    plain = _both(folder, prompts, [_greedy(12)] * 3, monkeypatch)
    assert plain[True][:2] == plain[False][:2]
    assert plain[True][2]["chained_steps"] >= 6 and plain[False][2]["chained_steps"] == 0
    first = plain[False][0][0]
    k = next(k for k in range(2, 8) if first[k] not in first[:k])  # a stop id first produced at k
    params = [_greedy(12, stop_token_ids=(first[k],)), _greedy(12), _greedy(12)]
    handed = _both(folder, prompts, params, monkeypatch, max_batch_size=2)
    assert handed[True][:2] == handed[False][:2]
    assert handed[True][0][0] == first[: k + 1] and handed[True][0][1:] == plain[False][0][1:]
    assert handed[True][2]["chained_steps"] > 0 and handed[True][2]["chained_stopped_rows"] == 1


def test_a_queued_step_that_fails_to_launch_runs_after_the_step_before(
    dsv4: tuple[Path, list[list[int]]], monkeypatch: Any
) -> None:
    """A step that could not be queued ahead (here: the runner's check raises twice) runs as
    the serial loop's next step: no request fails, the step before's tokens are all
    delivered, the tokens are transformers'."""
    from engram_trt.runtime.runner import ModelRunner

    folder, want = dsv4
    fails = {"left": 2}
    takes = ModelRunner.takes_device_ids

    def flaky(self: Any, step: Any) -> bool:
        if fails["left"]:
            fails["left"] -= 1
            raise RuntimeError("launch failed")
        return takes(self, step)

    monkeypatch.setattr(ModelRunner, "takes_device_ids", flaky)
    on, reasons, st = _serve(folder, PROMPTS, [_greedy()] * 3, monkeypatch, overlap=True)
    assert on == want and reasons == ["length"] * 3
    assert fails["left"] == 0 and st["chained_steps"] >= N - 6
