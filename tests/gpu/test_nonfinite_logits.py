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
from pathlib import Path

import torch

from .helpers import REPO

DATA = REPO / "tests" / "data" / "deepseek_v4_tiny"


def test_sample_flags_non_finite_rows_on_cuda() -> None:
    from engram_trt.models.sampling import sample_next
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
    assert finite == want, f"all greedy: the flags equal torch.isfinite of each row: {finite} vs {want}"
    assert all(p == int(torch.argmax(host[i])) for i, (p, f) in enumerate(zip(picks, finite)) if f), (
        f"all greedy: finite rows take the argmax: {picks}")
    assert copies == ["cuda"], f"all greedy: one device-to-host read for tokens and flags: {copies}"
    rows = [0, 2, 3, 5, 7]
    reqs = [req(k % 2 == 1, 20 + k) for k in range(len(rows))]
    picks, finite = Scheduler._sample(None, logits, reqs, rows)  # type: ignore[arg-type]
    assert finite == [want[r] for r in rows], f"mixed rows: the flags equal torch.isfinite: {finite}"
    for k, r in enumerate(rows):
        if not finite[k]:
            continue
        ref = (int(torch.argmax(host[r])) if reqs[k].params.greedy else
               sample_next(host[r], 0.9, 0.95, torch.Generator().manual_seed(20 + k)))
        assert picks[k] == ref, f"mixed rows: row {r}'s token: {picks[k]} vs {ref}"


def test_nan_request_ends_with_an_error_on_cuda(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from engram_trt import LLM, SamplingParams

    ck = tmp_path / "ck"
    shutil.copytree(DATA, ck)
    d = load_file(str(ck / "model.safetensors"))
    d["model.embed_tokens.weight"][17] = float("nan")
    save_file(d, str(ck / "model.safetensors"), metadata={"format": "pt"})
    prompts = [[5, 6, 7], [5, 17, 7], [9, 10], [17], [11, 12, 13, 14]]
    params = [SamplingParams(max_tokens=8, temperature=0.0 if i % 2 == 0 else 0.8, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    with LLM(str(DATA), backend="torch", device="cuda", dtype="fp32") as clean:
        want = [o.token_ids for o in clean.generate(prompts, params)]
    with LLM(str(ck), backend="torch", device="cuda", dtype="fp32") as llm:
        got = llm.generate(prompts, params)
        again = llm.generate([prompts[0]], params[0])[0]
    for i, o in enumerate(got):
        if 17 in prompts[i]:
            assert (o.finish_reason == "error" and o.token_ids == [] and o.error is not None and "\n" not in o.error
                    and "logits are NaN or Inf" in o.error), (
                f"prompt {i} (token 17): finish_reason error, no token, one line: {o.finish_reason} {o.token_ids} "
                f"{o.error}")
        else:
            assert o.error is None and o.token_ids == want[i], (
                f"prompt {i}: the clean folder's tokens: {o.token_ids} vs {want[i]} ({o.error})")
    assert again.token_ids == want[0], f"a later request: the clean folder's tokens: {again.token_ids} vs {want[0]}"
