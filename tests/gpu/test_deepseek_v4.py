"""DeepSeek-V4 on a GPU through the torch backend: the tiny checkpoint transformers 5.25
saved (tests/data/deepseek_v4_tiny, whose recorded greedy tokens a CPU test,
tests/test_deepseek_v4_folder.py, ties to transformers) run on CUDA.

  1. float32 on CUDA: every weight, buffer and state tensor on the GPU; the greedy tokens
     of each prompt (chunked prefill + decode, so the window rings, compressed entries
     and the indexer's top-k run across steps) equal the recorded ones.
  2. bfloat16 on CUDA: the prefill logits' relative L2 distance from the float32 CPU
     model's at most 3x transformers' own bf16-vs-fp32 distance on the same prompt
     (recorded in expected.json: the bound is the published implementation's round-off,
     not a fixed number).
  3. ``engram_trt.LLM`` on CUDA (the scheduler's packed steps, prompts batched): the
     recorded tokens in float32.
"""

from __future__ import annotations

import json

import pytest

from engram_trt.bench.gpucases import rel_err

from .helpers import REPO, note, record

DATA = REPO / "tests" / "data" / "deepseek_v4_tiny"


@pytest.fixture(scope="module")
def expected():
    return json.loads((DATA / "expected.json").read_text())


def _load(device, dtype):
    from engram_trt.models.registry import open_checkpoint

    ckpt = open_checkpoint(DATA)
    return ckpt, ckpt.architecture.load_model(ckpt, device=device, dtype=dtype)


def test_fp32_cuda_greedy_equals_transformers(expected) -> None:
    import torch

    ckpt, model = _load("cuda", torch.float32)
    off = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type != "cuda"]
    record("every weight and buffer on CUDA", not off, ", ".join(off[:5]))
    state = model.new_cache(2, 64)
    off = [f"layer {i} {k}" for i, layer in enumerate(state.layers) for k, t in layer.items() if t.device.type != "cuda"]
    record("every state tensor on CUDA", not off and state.lookback.device.type == "cuda", ", ".join(off[:5]))
    for i, prompt in enumerate(expected["prompts"]):
        got = model.generate_greedy(prompt, expected["new_tokens"], chunk=4, ignore_eos=True)
        record(f"prompt {i}: fp32 CUDA greedy tokens", got == expected["greedy"][i], f"{got} vs {expected['greedy'][i]}")
    ckpt.close()


def test_bf16_cuda_logits_near_fp32_cpu(expected) -> None:
    import torch

    from engram_trt.models.step import PackedStep

    ckpt_c, cpu = _load("cpu", torch.float32)
    ckpt_g, gpu = _load("cuda", torch.bfloat16)
    for i, prompt in enumerate(expected["prompts"]):
        step = lambda: PackedStep(torch.tensor(prompt), [len(prompt)], [0], [0])  # noqa: E731
        ref = cpu.forward_step(step(), cpu.new_cache(1, 64), all_logits=True)
        got = gpu.forward_step(step(), gpu.new_cache(1, 64), all_logits=True)
        err = rel_err(got, ref)
        bound = 3 * expected["transformers_bf16_rel_l2"][i]
        note(f"bf16_rel_l2_prompt{i}", err)
        record(f"prompt {i}: bf16 CUDA logits within 3x transformers' bf16 round-off of fp32 CPU", err <= bound,
               f"rel L2 {err:.2e}, bound {bound:.2e}")
    ckpt_c.close()
    ckpt_g.close()


def test_llm_on_cuda_batches_to_the_recorded_tokens(expected) -> None:
    from engram_trt import LLM, SamplingParams

    with LLM(str(DATA), backend="torch", device="cuda", dtype="fp32") as llm:
        outs = llm.generate(expected["prompts"], SamplingParams(max_tokens=expected["new_tokens"], temperature=0.0,
                                                                  ignore_eos=True))
        label = llm.runner.backend.label
    got = [list(o.outputs[0].token_ids) for o in outs]
    record("LLM on CUDA: recorded greedy tokens", got == expected["greedy"], f"{got}; backend {label}")
