"""The runtime on a CPU: the packed step, engram_trt.LLM and its scheduler.

Oracles: the reference model's own one-sequence loop (``EngramLlama.generate``: one
sequence, one token per step, its own cache), which shares no code with the scheduler,
the packer or the prefetcher; and each sequence run alone through the uniform-batch
API for the packed step.
"""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from engram_trt import LLM, SamplingParams
from engram_trt.errors import EngramError
from engram_trt.models.engram_llama.model import EngramLlama
from engram_trt.models.step import PackedStep

from helpers.files import REPO

PROMPTS = [
    "Engram",
    "Engram layers look up n-grams in huge tables.",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 2,
    "Hello, world",
    "The quick brown fox jumps over the lazy dog",
    "1 2 3 4 5 6 7 8 9 10",
    "def f(x): return x",
    "∑ ∫ √ π",
]


@pytest.fixture(scope="module")
def ref(small_ckpt: Path) -> EngramLlama:
    return EngramLlama.from_checkpoint(small_ckpt, table_storage="file")


@pytest.fixture(scope="module")
def llm(small_engine: Path):
    # A small step budget (16 tokens) so long prompts are prefilled in chunks that
    # share steps with other sequences' decode tokens.
    with LLM(str(small_engine), max_batch_size=8, max_num_tokens=16, progress=False) as m:
        yield m


def ids_of(llm: LLM, prompt: str) -> list[int]:
    return llm.tokenizer.encode(prompt, add_special_tokens=False).ids


def ref_tokens(ref: EngramLlama, ids: list[int], n: int, **kw: Any) -> list[int]:
    return ref.generate(ids, n, eos=[], **kw).new_ids


# ---------------------------------------------------------------- the packed step
def test_packed_mixed_step_equals_each_sequence_alone(ref: EngramLlama) -> None:
    """One step holding a prefill chunk of one sequence, the first chunk of another and
    decode tokens of two more, in non-contiguous slots with different past lengths,
    equals each sequence run alone through its own cache."""
    torch.manual_seed(0)
    seqs = [torch.randint(2, 129280, (n,)).tolist() for n in (9, 4, 6, 3)]
    past = [5, 0, 5, 2]  # tokens already in each sequence's cache
    new = [4, 4, 1, 1]  # tokens each brings to the step
    slots = [3, 0, 5, 1]
    cache = ref.new_cache(6, 32)
    for s, slot in enumerate(slots):  # fill each slot with its sequence's past, alone
        if past[s]:
            ref.forward_step(PackedStep.from_sequences([seqs[s][: past[s]]], slots=[slot]), cache)
    step = PackedStep.from_sequences(
        [seqs[s][past[s] : past[s] + new[s]] for s in range(4)], past_lens=past, slots=slots
    )
    got = ref.forward_step(step, cache, all_logits=True)
    a = 0
    for s in range(4):
        alone = ref.forward(seqs[s][: past[s] + new[s]])  # a fresh full forward: [T, V]
        torch.testing.assert_close(got[a : a + new[s]], alone[past[s] :], rtol=1e-4, atol=1e-4)
        a += new[s]
        assert cache.lengths[slots[s]] == past[s] + new[s]


def test_sdpa_attention_equals_the_loop_reference(small_ckpt: Path) -> None:
    """The fused path (decode tokens batched, lower-right causal prefill) computes the
    same function as the explicit float32 loop."""
    loop = EngramLlama.from_checkpoint(small_ckpt, table_storage="file", attention="loop")
    fused = EngramLlama.from_checkpoint(small_ckpt, table_storage="file", attention="sdpa")
    torch.manual_seed(1)
    seqs = [torch.randint(2, 129280, (n,)).tolist() for n in (7, 5, 8)]
    outs = []
    for m in (loop, fused):
        cache = m.new_cache(3, 32)
        m.forward_step(PackedStep.from_sequences([seqs[0][:4], seqs[1][:5], seqs[2][:6]]), cache)
        outs.append(
            m.forward_step(
                PackedStep.from_sequences([seqs[0][4:], [seqs[1][4]], seqs[2][6:7]], past_lens=[4, 5, 6]),
                cache,
                all_logits=True,
            )
        )
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)


def test_step_checks_its_slots(ref: EngramLlama) -> None:
    cache = ref.new_cache(2, 8)
    with pytest.raises(EngramError, match="slot 2, but the cache has slots 0..1"):
        ref.forward_step(PackedStep.from_sequences([[5]], slots=[2]), cache)
    with pytest.raises(EngramError, match="share a KV-cache slot"):
        PackedStep.from_sequences([[5], [6]], slots=[1, 1])
    with pytest.raises(EngramError, match="max_len=8"):
        ref.forward_step(PackedStep.from_sequences([list(range(2, 11))]), cache)


# ---------------------------------------------------------------- LLM: greedy, streaming
def test_generate_equals_reference_greedy_from_engine_folder(llm: LLM, ref: EngramLlama) -> None:
    assert llm.source.kind == "engine" and llm.backend == "torch"
    outs = llm.generate(PROMPTS[:4], SamplingParams(max_tokens=10, ignore_eos=True))
    for p, o in zip(PROMPTS[:4], outs):
        assert o.finished and o.finish_reason == "length" and len(o.token_ids) == 10
        assert o.token_ids == ref_tokens(ref, ids_of(llm, p), 10), p
        assert o.text == llm.tokenizer.decode(o.token_ids, skip_special_tokens=True)


def test_generate_from_a_checkpoint(small_ckpt: Path, ref: EngramLlama) -> None:
    with LLM(str(small_ckpt), progress=False) as m:
        assert m.source.kind == "checkpoint" and m.storage["kind"] == "file"
        (o,) = m.generate(PROMPTS[1], SamplingParams(max_tokens=6, ignore_eos=True))
        assert o.token_ids == ref_tokens(ref, ids_of(m, PROMPTS[1]), 6)
        (o2,) = m.generate(ids_of(m, PROMPTS[1]), SamplingParams(max_tokens=6, ignore_eos=True))  # token ids in
        assert o2.token_ids == o.token_ids and o2.prompt is None


def test_stream_gives_the_tokens_generate_gives(llm: LLM) -> None:
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    want = {o.prompt: o for o in llm.generate(PROMPTS[:3], params)}
    ids: dict[str, list[int]] = {}
    text: dict[str, str] = {}
    finished = 0
    for ev in llm.generate_stream(PROMPTS[:3], params):
        ids.setdefault(ev.prompt, []).extend(ev.delta_token_ids)
        text[ev.prompt] = text.get(ev.prompt, "") + ev.delta_text
        finished += ev.finished
    assert finished == 3
    for p, o in want.items():
        assert ids[p] == o.token_ids and text[p] == o.text


def test_generate_async_equals_generate(llm: LLM) -> None:
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    (want,) = llm.generate(PROMPTS[4], params)

    async def main() -> list[int]:
        got: list[int] = []
        async for ev in llm.generate_async(PROMPTS[4], params):
            got.extend(ev.delta_token_ids)
        return got

    assert asyncio.run(main()) == want.token_ids


# ---------------------------------------------------------------- batching as requests arrive
def test_eight_threads_batched_equal_alone_and_reference(llm: LLM, ref: EngramLlama) -> None:
    """8 prompts of different lengths submitted together from 8 threads: each gets the
    greedy tokens it gets alone and the reference gets, and they shared steps."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    alone = {p: llm.generate(p, params)[0].token_ids for p in PROMPTS}
    got: dict[str, list[int]] = {}
    barrier = threading.Barrier(8)

    def worker(p: str) -> None:
        barrier.wait()
        got[p] = llm.generate(p, params)[0].token_ids

    threads = [threading.Thread(target=worker, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for p in PROMPTS:
        assert got[p] == alone[p] == ref_tokens(ref, ids_of(llm, p), 12), p
    st = llm.stats()
    assert st["max_step_seqs"] >= 4  # the threads' sequences shared steps
    assert st["running"] == 0 and st["kv_slots_in_use"] == 0


def test_seeded_sampling_alone_in_a_crowd_and_reference(llm: LLM, ref: EngramLlama) -> None:
    params = [
        SamplingParams(max_tokens=10, temperature=0.9, top_p=0.8, seed=100 + i, ignore_eos=True) for i in range(6)
    ]
    crowd = llm.generate(PROMPTS[:6], params)
    for i, (p, o) in enumerate(zip(PROMPTS[:6], crowd)):
        assert o.token_ids == llm.generate(p, params[i])[0].token_ids
        assert o.token_ids == ref_tokens(ref, ids_of(llm, p), 10, temperature=0.9, top_p=0.8, seed=100 + i)
    other_seed = llm.generate(
        PROMPTS[0], SamplingParams(max_tokens=10, temperature=0.9, top_p=0.8, seed=7, ignore_eos=True)
    )
    assert other_seed[0].token_ids != crowd[0].token_ids  # the seed matters (this pair differs)


def test_cancel_frees_the_slot_and_the_others_finish_unchanged(llm: LLM) -> None:
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    want = [o.token_ids for o in llm.generate(PROMPTS[1:4], params)]
    seen = threading.Event()
    count = [0]

    def sink(out: Any) -> None:
        count[0] += len(out.delta_token_ids)
        if count[0] >= 3:
            seen.set()

    long = llm.submit(PROMPTS[0], SamplingParams(max_tokens=400, ignore_eos=True), sink=sink)
    others = [llm.submit(p, params) for p in PROMPTS[1:4]]
    assert seen.wait(60)
    llm.cancel(long)
    out = llm.wait(long, 60)
    assert out.finish_reason == "cancelled" and 3 <= len(out.token_ids) < 400
    assert [llm.wait(h, 60).token_ids for h in others] == want
    assert llm.stats()["kv_slots_in_use"] == 0


def test_stop_ids_strings_and_eos(llm: LLM) -> None:
    base = llm.generate(PROMPTS[1], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    stop_id = base.token_ids[3]
    first = base.token_ids.index(stop_id)
    o = llm.generate(PROMPTS[1], SamplingParams(max_tokens=10, stop_token_ids=[stop_id], ignore_eos=True))[0]
    assert o.finish_reason == "stop" and o.stop_reason == stop_id and o.token_ids == base.token_ids[: first + 1]
    o = llm.generate(PROMPTS[1], SamplingParams(max_tokens=10, stop_token_ids=[stop_id]))[0]
    assert o.token_ids == base.token_ids[: first + 1]
    piece = llm.tokenizer.decode(base.token_ids[4:6], skip_special_tokens=True)
    if piece.strip():
        o = llm.generate(PROMPTS[1], SamplingParams(max_tokens=10, stop=[piece], ignore_eos=True))[0]
        assert o.finish_reason == "stop" and o.stop_reason == piece and piece not in o.text
        assert base.text.startswith(o.text)
        streamed = "".join(
            ev.delta_text
            for ev in llm.generate_stream(PROMPTS[1], SamplingParams(max_tokens=10, stop=[piece], ignore_eos=True))
        )
        assert streamed == o.text  # nothing of the stop string was streamed
    # EOS: the model's end-of-sequence ids stop a request unless ignore_eos (here the
    # stop id above plays the model's EOS for a moment).
    saved = llm.runner.eos_ids
    llm.runner.eos_ids = {stop_id}
    try:
        o = llm.generate(PROMPTS[1], SamplingParams(max_tokens=10))[0]
        assert o.finish_reason == "eos" and o.token_ids == base.token_ids[: first + 1]
        assert llm.generate(PROMPTS[1], SamplingParams(max_tokens=10, ignore_eos=True))[0].token_ids == base.token_ids
    finally:
        llm.runner.eos_ids = saved


def test_bad_requests_are_refused_in_one_line(llm: LLM) -> None:
    cases = [
        (lambda: llm.generate("", SamplingParams()), "empty"),
        (lambda: llm.generate([[]], SamplingParams()), "non-empty list"),
        (lambda: llm.generate([5, 129280], SamplingParams()), "outside the model's vocabulary"),
        (lambda: llm.generate("x " * 600, SamplingParams()), "exceed the runtime's max_seq_len"),
        (lambda: SamplingParams(max_tokens=0), "max_tokens must be an integer >= 1"),
        (lambda: SamplingParams(temperature=float("nan")), "temperature must be a finite number"),
        (lambda: SamplingParams(top_p=0), "top_p must be in"),
        (lambda: SamplingParams(seed=-1), "seed must be an integer"),
        (lambda: llm.generate("\udcff", SamplingParams()), "not valid UTF-8"),
        (lambda: llm.generate(["a", "b"], [SamplingParams()] * 3), "3 sampling params for 2 prompts"),
    ]
    for fn, needle in cases:
        with pytest.raises(EngramError, match=needle) as err:
            fn()
        assert "\n" not in str(err.value)
    assert llm.generate([], SamplingParams()) == []  # no prompts, no outputs
    assert llm.generate("still serving", SamplingParams(max_tokens=2))[0].finished


# ---------------------------------------------------------------- the CLI on the runtime
def test_light_commands_import_neither_torch_nor_onnx(small_ckpt: Path) -> None:
    """--help, layout and hash answer without importing torch or onnx (about 2.5 s saved
    on every call)."""
    import subprocess
    import sys

    repo = REPO
    code = (
        "import runpy, sys; sys.argv = ['engram-trt'] + sys.argv[1:]\n"
        "try:\n    runpy.run_module('engram_trt', run_name='__main__')\nexcept SystemExit:\n    pass\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'onnx'))\n"
        "print('HEAVY', bad[:3])"
    )
    for argv in (["--help"], ["layout", str(small_ckpt)], ["hash", str(small_ckpt), "--ids", "5,17,3"]):
        proc = subprocess.run(
            [sys.executable, "-c", code, *argv],
            capture_output=True,
            text=True,
            timeout=120,
            env={"PYTHONPATH": str(repo / "python"), "PATH": "/usr/bin:/bin"},
        )
        assert "HEAVY []" in proc.stdout, (argv, proc.stdout[-300:], proc.stderr[-300:])


def test_run_json_names_backend_storage_and_timings(small_engine: Path, ref: EngramLlama) -> None:
    import json
    import subprocess
    import sys

    repo = REPO
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "engram_trt",
            "run",
            str(small_engine),
            "--prompt",
            PROMPTS[1],
            "--max-new-tokens",
            "5",
            "--ignore-eos",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(repo / "python")},
    )
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    assert res["backend"] == "torch" and "torch backend" in res["backend_reason"] and res["source"] == "engine"
    assert res["storage"]["kind"] == "file" and res["finish_reason"] == "length"
    assert set(res["timings"]) >= {"load_s", "time_to_first_token_s", "total_s"}
    from engram_trt.engram.tokenizer import load_tokenizer

    ids = (
        load_tokenizer(
            small_engine / "tokenizer.json" if (small_engine / "tokenizer.json").is_file() else res_ckpt(small_engine)
        )
        .encode(PROMPTS[1], add_special_tokens=False)
        .ids
    )
    assert res["token_ids"] == ref_tokens(ref, ids, 5)


def res_ckpt(engine: Path) -> Path:
    import json

    return Path(json.loads((engine / "manifest.json").read_text())["checkpoint"])
