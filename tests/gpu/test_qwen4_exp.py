"""Qwen4Exp on a GPU through the torch backend: the tiny checkpoint transformers 5.25
saved (tests/data/qwen4_exp_tiny, whose recorded greedy tokens a CPU test ties to
transformers) run on CUDA.

  1. float32 on CUDA: the greedy tokens of each prompt (chunked prefill + decode) equal
     the recorded ones; the PLE hash and the Gated DeltaNet layers ran in the kernel library.
  2. bfloat16 on CUDA: the prefill logits' relative L2 distance from the float32 CPU
     model's at most 3x transformers' own bf16-vs-fp32 distance on the same prompt
     (recorded in expected.json: random weights make this tiny model sensitive, so the
     bound is the published implementation's round-off, not a fixed number).
  3. ``engram_trt.LLM`` on CUDA (the scheduler's packed steps, prompts batched): the
     recorded tokens in float32.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from .helpers import (
    REPO,
    check_bf16_cuda_logits_near_fp32_cpu,
    check_llm_on_cuda_gives_the_recorded_tokens,
    fp32_cpu_and_bf16_cuda,
    llm_on_cuda_tokens,
    load_checkpoint,
    note,
)

DATA = REPO / "tests" / "data" / "qwen4_exp_tiny"
EXPECTED = json.loads((DATA / "expected.json").read_text())
PROMPTS = range(len(EXPECTED["prompts"]))


@pytest.fixture(scope="module")
def expected():
    return EXPECTED


def _load(device, dtype):
    return load_checkpoint(DATA, device, dtype)


@pytest.fixture(scope="module")
def fp32_cuda():
    import torch

    ckpt, model = _load("cuda", torch.float32)
    yield model
    ckpt.close()


def test_fp32_cuda_runs_on_the_kernels(fp32_cuda) -> None:
    """Where the fp32 CUDA model's parts run (consecutive asserts over one model's state)."""
    model = fp32_cuda
    assert model._native_ple_hash() is not None, "PLE hash in the kernel library"
    assert "linear attention cuda-kernels" in model.backend_name, (
        f"Gated DeltaNet layers on the kernel library: {model.backend_name}"
    )
    assert model.ple_tables.kind in ("device", "pinned"), (
        f"PLE tables where GPU kernels read them: {model.ple_tables.kind}"
    )


@pytest.mark.parametrize("i", PROMPTS)
def test_fp32_cuda_greedy_equals_transformers(fp32_cuda, expected, i) -> None:
    got = fp32_cuda.generate_greedy(expected["prompts"][i], expected["new_tokens"], chunk=4, ignore_eos=True)
    assert got == expected["greedy"][i], f"prompt {i}: fp32 CUDA greedy tokens: {got} vs {expected['greedy'][i]}"


@pytest.fixture(scope="module")
def cpu_and_bf16():
    with fp32_cpu_and_bf16_cuda(DATA) as models:
        yield models


@pytest.mark.parametrize("i", PROMPTS)
def test_bf16_cuda_logits_near_fp32_cpu(cpu_and_bf16, expected, i) -> None:
    check_bf16_cuda_logits_near_fp32_cpu(cpu_and_bf16, expected, i)


@pytest.fixture(scope="module")
def llm_run(expected):
    return llm_on_cuda_tokens(DATA, expected)


@pytest.mark.parametrize("i", PROMPTS)
def test_llm_on_cuda_batches_to_the_recorded_tokens(llm_run, expected, i) -> None:
    check_llm_on_cuda_gives_the_recorded_tokens(llm_run, expected, i)


def _decode_both(model, prompts, steps, graphs_cls):
    """Greedy decode of ``prompts`` (one packed prefill, then decode steps of all of them)
    twice: eagerly, and through the decode graphs; returns (eager tokens, graph tokens,
    max |logit difference|, the graphs, eager s/step, replay s/step)."""
    import time

    import torch

    from engram_trt.models.step import PackedStep

    S = len(prompts)
    results = []
    graphs = None
    for use_graphs in (False, True):
        cache = model.new_cache(S + 1, 256)
        slots = list(range(S))[::-1]
        logits = model.forward_step(
            PackedStep(torch.tensor(sum(prompts, [])), [len(p) for p in prompts], [0] * S, slots), cache
        )
        if use_graphs:
            graphs = graphs_cls(model, cache, S, scratch_slot=S)
        lens = [len(p) for p in prompts]
        toks, all_logits = [], []
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            tok = torch.argmax(logits, dim=-1).cpu()
            toks.append(tok.tolist())
            step = PackedStep(tok, [1] * S, lens, slots)
            got = graphs.run(step) if use_graphs else None
            logits = (got if got is not None else model.forward_step(step, cache)).clone()
            all_logits.append(logits)
            lens = [n + 1 for n in lens]
        torch.cuda.synchronize()
        results.append((toks, torch.stack(all_logits), (time.perf_counter() - t0) / steps))
    (te, le, se), (tg, lg, sg) = results
    return te, tg, float((le - lg).abs().max()), graphs, se, sg


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def graph_run(request, expected):
    """One dtype's model (fp32 with the f32 PLE tables, bf16 with bf16 tables in HBM) and
    its greedy decode of the prompts, eagerly and through the decode graphs."""
    import torch

    from engram_trt.models.qwen4_exp.graphs import Qwen4ExpDecodeGraphs
    from engram_trt.models.qwen4_exp.ple_tables import PLETables, table_shard_names

    name = request.param
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
    prompts = [list(p) for p in expected["prompts"]]
    ckpt, model = _load("cuda", dtype)
    if dtype == torch.bfloat16:
        cfg = model.config
        tables = [
            torch.cat([ckpt.get(n) for n in table_shard_names(cfg, li)]).to("cuda", torch.bfloat16)
            for li in range(len(cfg.ple.layers))
        ]
        model.ple_tables = PLETables.from_tensors(tables)
    te, tg, diff, graphs, se, sg = _decode_both(model, prompts, 12, Qwen4ExpDecodeGraphs)
    print(
        f"qwen4 tiny {name} decode of {len(prompts)}: eager {se * 1e3:.2f} ms/step, graphs {sg * 1e3:.2f} ms/step "
        f"({se / sg:.1f}x)"
    )
    yield SimpleNamespace(name=name, dtype=dtype, model=model, te=te, tg=tg, diff=diff, graphs=graphs, se=se, sg=sg)
    ckpt.close()


def test_decode_graphs_equal_eager_steps(graph_run) -> None:
    """Decode steps replayed from the CUDA graphs give the eager steps' tokens (fp32 with
    the f32 PLE tables, bf16 with bf16 tables in HBM; the tiny rows are gathered before
    the replay). (`bench qwen4-step` replays graphs with the hash and the gather kernel in
    them.) Consecutive asserts over the one run: the graphs recorded, then their output."""
    import torch

    r = graph_run
    name, dtype, model, graphs, te, tg, diff = r.name, r.dtype, r.model, r.graphs, r.te, r.tg, r.diff
    note(f"{name}_decode_eager_ms", r.se * 1e3)
    note(f"{name}_decode_graph_ms", r.sg * 1e3)
    assert graphs.failed is None and graphs.replays == 12, (
        f"{name}: decode graphs recorded: failed={graphs.failed}, replays={graphs.replays}, "
        f"lookup in graph={graphs.lookup_in_graph}"
    )
    if dtype == torch.bfloat16:  # rows of 4 values: the reference gather, so the lookup runs before the replay
        assert graphs.lookup_in_graph == all(p == "kernel" for p in model.ple_tables.paths), (
            f"bf16: PLE lookup in the graph exactly when every layer takes the gather kernel: "
            f"paths {model.ple_tables.paths}, in graph {graphs.lookup_in_graph}"
        )
    assert te == tg, f"{name}: graph tokens equal eager tokens: {te} vs {tg}"
    assert diff <= (1e-5 if dtype == torch.float32 else 5e-2), (
        f"{name}: graph logits equal eager logits: max |diff| {diff:.3e}"
    )


@pytest.mark.parametrize("graph_run", ["fp32"], indirect=True)
@pytest.mark.parametrize("i", PROMPTS)
def test_decode_path_tokens_equal_transformers(graph_run, expected, i) -> None:
    """After the graph run, the fp32 model's eager decode path gives the recorded
    transformers tokens."""
    got = graph_run.model.generate_greedy(expected["prompts"][i], expected["new_tokens"], ignore_eos=True)
    assert got == expected["greedy"][i], f"prompt {i}: fp32 CUDA decode path tokens: {got} vs {expected['greedy'][i]}"
