"""Non-finite logits on a GPU: the scheduler's per-row finite flags read with the tokens
(one copy from the device), and a request whose logits turn NaN ending with an error
while the rest of its batch decodes as the clean folder does (decode CUDA graphs on).

1. ``Scheduler._sample`` over CUDA logits with NaN / +-Inf rows, greedy and seeded rows
   mixed: each flag equals ``torch.isfinite`` of its row; finite greedy rows take the
   argmax, finite seeded rows the token their own CPU generator draws; the all-greedy
   path makes one device-to-host copy (no extra sync for the flags).
2. ``engram_trt.LLM`` on CUDA over tests/data/deepseek_v4_tiny with token 17's embedding
   row set to NaN: the prompts holding 17 end ``finish_reason == "error"`` with no token,
   the others give the tokens of the clean folder on the same device and dtype, and a
   later request too (the engine keeps serving).
"""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
import torch

from .helpers import REPO

DATA = REPO / "tests" / "data" / "deepseek_v4_tiny"


MIXED_ROWS = [0, 2, 3, 5, 7]  # the mixed batch's rows of the logits (odd positions seeded)


@pytest.fixture(scope="module")
def sampled() -> SimpleNamespace:
    """``Scheduler._sample`` over CUDA logits with NaN / +-Inf rows: all greedy (with the
    device-to-host reads counted) and a mixed greedy / seeded batch of MIXED_ROWS."""
    from engram_trt.runtime.sampling_params import SamplingParams
    from engram_trt.runtime.scheduler import Request, Scheduler

    g = torch.Generator().manual_seed(1)
    host = torch.randn(8, 1000, generator=g)
    host[2, 5] = float("nan")
    host[5, 0] = float("inf")
    host[6, 999] = float("-inf")
    logits = host.cuda()
    want = torch.isfinite(host).all(dim=-1).tolist()

    def req(greedy: bool, seed: int) -> Request:
        p = SamplingParams(max_tokens=2, temperature=0.0 if greedy else 0.9, top_p=0.95, seed=seed)
        r = Request(f"r{seed}", None, [1], p, None)
        if not greedy:
            r.generator = torch.Generator().manual_seed(seed)
        return r

    copies = []
    real = torch.Tensor.tolist

    def counting(self):  # type: ignore[no-untyped-def]
        copies.append(self.device.type)
        return real(self)

    torch.Tensor.tolist = counting  # type: ignore[method-assign]
    try:
        greedy = [req(True, i) for i in range(8)]
        picks, finite = Scheduler._sample(None, logits, greedy, list(range(8)))  # type: ignore[arg-type]
    finally:
        torch.Tensor.tolist = real  # type: ignore[method-assign]
    reqs = [req(k % 2 == 1, 20 + k) for k in range(len(MIXED_ROWS))]
    mixed_picks, mixed_finite = Scheduler._sample(None, logits, reqs, MIXED_ROWS)  # type: ignore[arg-type]
    return SimpleNamespace(
        host=host,
        want=want,
        picks=picks,
        finite=finite,
        copies=copies,
        reqs=reqs,
        mixed_picks=mixed_picks,
        mixed_finite=mixed_finite,
    )


def test_sample_all_greedy_on_cuda(sampled) -> None:
    """One all-greedy call: its flags, its tokens and its device-to-host reads (consecutive
    asserts over the one call's results)."""
    host, want, picks, finite = sampled.host, sampled.want, sampled.picks, sampled.finite
    assert finite == want, f"all greedy: the flags equal torch.isfinite of each row: {finite} vs {want}"
    assert all(p == int(torch.argmax(host[i])) for i, (p, f) in enumerate(zip(picks, finite)) if f), (
        f"all greedy: finite rows take the argmax: {picks}"
    )
    assert sampled.copies == ["cuda"], f"all greedy: one device-to-host read for tokens and flags: {sampled.copies}"


def test_sample_mixed_flags_on_cuda(sampled) -> None:
    finite = sampled.mixed_finite
    assert finite == [sampled.want[r] for r in MIXED_ROWS], f"mixed rows: the flags equal torch.isfinite: {finite}"


@pytest.mark.parametrize("k", range(len(MIXED_ROWS)))
def test_sample_mixed_row_token_on_cuda(sampled, k) -> None:
    from engram_trt.models.sampling import sample_next

    r, host, reqs = MIXED_ROWS[k], sampled.host, sampled.reqs
    if not sampled.mixed_finite[k]:
        return  # a row flagged non-finite takes no token (the flags: test_sample_mixed_flags_on_cuda)
    ref = (
        int(torch.argmax(host[r]))
        if reqs[k].params.greedy
        else sample_next(host[r], 0.9, 0.95, torch.Generator().manual_seed(20 + k))
    )
    assert sampled.mixed_picks[k] == ref, f"mixed rows: row {r}'s token: {sampled.mixed_picks[k]} vs {ref}"


PROMPTS = [[5, 6, 7], [5, 17, 7], [9, 10], [17], [11, 12, 13, 14]]


@pytest.fixture(scope="module")
def nan_run(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """The clean folder's tokens and the NaN folder's outputs (token 17's embedding row
    NaN) of PROMPTS, then a later request to the NaN folder's engine."""
    from safetensors.torch import load_file, save_file

    from engram_trt import LLM, SamplingParams

    ck = tmp_path_factory.mktemp("nan") / "ck"
    shutil.copytree(DATA, ck)
    d = load_file(str(ck / "model.safetensors"))
    d["model.embed_tokens.weight"][17] = float("nan")
    save_file(d, str(ck / "model.safetensors"), metadata={"format": "pt"})
    params = [
        SamplingParams(max_tokens=8, temperature=0.0 if i % 2 == 0 else 0.8, seed=i, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    with LLM(str(DATA), backend="torch", device="cuda", dtype="fp32") as clean:
        want = [o.token_ids for o in clean.generate(PROMPTS, params)]
    with LLM(str(ck), backend="torch", device="cuda", dtype="fp32") as llm:
        got = llm.generate(PROMPTS, params)
        again = llm.generate([PROMPTS[0]], params[0])[0]
    return SimpleNamespace(want=want, got=got, again=again)


@pytest.mark.parametrize("i", range(len(PROMPTS)))
def test_nan_request_ends_with_an_error_on_cuda(nan_run, i) -> None:
    o, want = nan_run.got[i], nan_run.want
    if 17 in PROMPTS[i]:
        assert (
            o.finish_reason == "error"
            and o.token_ids == []
            and o.error is not None
            and "\n" not in o.error
            and "logits are NaN or Inf" in o.error
        ), f"prompt {i} (token 17): finish_reason error, no token, one line: {o.finish_reason} {o.token_ids} {o.error}"
    else:
        assert o.error is None and o.token_ids == want[i], (
            f"prompt {i}: the clean folder's tokens: {o.token_ids} vs {want[i]} ({o.error})"
        )


def test_nan_folder_keeps_serving_on_cuda(nan_run) -> None:
    again, want = nan_run.again, nan_run.want
    assert again.token_ids == want[0], f"a later request: the clean folder's tokens: {again.token_ids} vs {want[0]}"
