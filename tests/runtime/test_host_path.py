"""The host side of a step, made cheap, checked against its plain forms.

Oracles: ``tokenizer.decode`` of every whole prefix (for the incremental text), the
per-field lists of a packed step written out by hand (for its vectorized metadata),
and a naive scheduler of a few lines (decode everything after every token, search the
whole text for every stop string) for the outputs of scripted requests.
"""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engram_trt.runtime.sampling_params import SamplingParams
from engram_trt.runtime.detokenize import IncrementalText
from engram_trt.runtime.phases import PHASES, StepPhases
from engram_trt.runtime.scheduler import Scheduler
from engram_trt.models.step import PackedStep

from helpers.checkpoints import word_tokenizer


@pytest.fixture(scope="module")
def ds_tok() -> Any:
    from engram_trt.engram.tokenizer import default_tokenizer_json, load_tokenizer

    return load_tokenizer(default_tokenizer_json())


def _multibyte_ids(tok: Any, rng: random.Random, n: int) -> list[int]:
    """Ids of random non-ASCII text, shuffled: byte-level pieces of multi-byte
    characters end up apart and out of order (invalid and incomplete UTF-8)."""
    chars = [c for c in (rng.randrange(0x80, 0x2FFFF) for _ in range(n)) if not 0xD800 <= c < 0xE000]
    ids = tok.encode("".join(map(chr, chars)), add_special_tokens=False).ids
    rng.shuffle(ids)
    return ids


def _check_incremental(tok: Any, seqs: list[list[int]]) -> None:
    """Every prefix's text equals the whole decode, special tokens skipped (the default)
    and kept."""
    for skip in (True, False):
        for seq in seqs:
            ids: list[int] = []
            inc = IncrementalText(tok, ids) if skip else IncrementalText(tok, ids, skip_special_tokens=False)
            for t in seq:
                ids.append(t)
                want = tok.decode(ids, skip_special_tokens=skip)
                assert inc.update() == want, (skip, ids)
                assert inc.text[: inc.stable_len] == want[: inc.stable_len]


def test_incremental_text_equals_whole_decode_byte_level(ds_tok: Any) -> None:
    rng = random.Random(0)
    V = ds_tok.get_vocab_size()
    texts = ["∑ ∫ √ π Engram 日本語のテキスト 🙂🙃 émoji", "def f(x):\n    return x  # ok", "<｜begin▁of▁sentence｜>a"]
    seqs = [ds_tok.encode(t, add_special_tokens=False).ids for t in texts]
    seqs += [[rng.randrange(V) for _ in range(rng.randrange(1, 40))] for _ in range(150)]
    seqs += [_multibyte_ids(ds_tok, rng, 12) for _ in range(60)]
    seqs += [[rng.randrange(V - 1300, V) for _ in range(10)] for _ in range(10)]  # added / special tokens
    _check_incremental(ds_tok, seqs)


def test_incremental_text_equals_whole_decode_context_decoders(tmp_path: Path) -> None:
    """A tokenizer without a decoder joins tokens with spaces; a Metaspace decoder drops
    the leading space of the first token: both depend on the token before."""
    from tokenizers import Tokenizer, decoders, models

    plain = Tokenizer.from_file(str(word_tokenizer(tmp_path / "w.json", 64)))
    meta = Tokenizer(models.WordLevel({"▁a": 0, "a": 1, "▁b": 2, "b": 3, "▁": 4, "c": 5}, unk_token="c"))
    meta.decoder = decoders.Metaspace()
    rng = random.Random(1)
    _check_incremental(plain, [[rng.randrange(64) for _ in range(rng.randrange(1, 20))] for _ in range(40)])
    _check_incremental(meta, [[rng.randrange(6) for _ in range(rng.randrange(1, 20))] for _ in range(80)])
    # Special tokens among them (ids 6, 7), and a non-special added token (8, kept either
    # way); the text around a skipped token is as the whole decode makes it.
    for t in (plain, meta):
        t.add_special_tokens(["<|im_end|>", "<s>"])
        t.add_tokens(["<plain>"])
    assert sorted(i for i, a in meta.get_added_tokens_decoder().items() if a.special) == [6, 7]
    assert meta.decode([6, 2, 7, 0], skip_special_tokens=True) == "b a"  # skipped first: the next leads
    _check_incremental(
        plain, [[rng.choice([*range(64), 64, 65, 66]) for _ in range(rng.randrange(1, 20))] for _ in range(60)]
    )
    _check_incremental(meta, [[rng.randrange(9) for _ in range(rng.randrange(1, 20))] for _ in range(150)])


# ---------------------------------------------------------------- the packed step's metadata
def _by_hand(seq_lens: list[int], past: list[int], slots: list[int]) -> dict[str, list[int]]:
    starts = [0]
    for n in seq_lens:
        starts.append(starts[-1] + n)
    positions, token_slots = [], []
    for n, p, s in zip(seq_lens, past, slots):
        positions += list(range(p, p + n))
        token_slots += [s] * n
    dec = [i for i, n in enumerate(seq_lens) if n == 1]
    return {
        "positions": positions,
        "token_slots": token_slots,
        "last": [b - 1 for b in starts[1:]],
        "decode_rows": [starts[i] for i in dec],
        "decode_slots": [slots[i] for i in dec],
        "decode_lens": [past[i] + 1 for i in dec],
        "seq_starts": starts,
        "past_lens": past,
        "slots": slots,
    }


@pytest.mark.parametrize(
    "seq_lens,past,slots",
    [
        ([3, 1, 2], [0, 7, 2], [2, 0, 1]),
        ([1] * 5, [4, 0, 9, 1, 3], [4, 3, 2, 1, 0]),
        ([6], [0], [3]),
        ([1, 4, 1, 1], [10, 0, 3, 5], [0, 1, 2, 5]),
    ],
)
def test_step_metadata_equals_the_lists_by_hand(seq_lens: list[int], past: list[int], slots: list[int]) -> None:
    rng = np.random.default_rng(sum(seq_lens))
    T, S = sum(seq_lens), len(seq_lens)
    ids = rng.integers(0, 1000, T)
    cids = rng.integers(-1, 500, T)
    lb = rng.integers(-1, 500, (S, 2))
    step = PackedStep(
        torch.from_numpy(ids), seq_lens, past, slots, lookback=torch.from_numpy(lb), engram_ids=torch.from_numpy(cids)
    )
    got = step.device_arrays("cpu")
    want = _by_hand(seq_lens, past, slots)
    assert got["input_ids"].tolist() == ids.tolist() and got["engram_ids"].tolist() == cids.tolist()
    assert got["lookback"].tolist() == lb.tolist()
    for k, v in want.items():
        assert got[k].dtype == torch.int64 and got[k].tolist() == v, k
    assert step.positions().tolist() == want["positions"] and step.token_slots().tolist() == want["token_slots"]
    assert step.last_token_index().tolist() == want["last"]
    assert step.total_lens == [p + n for p, n in zip(past, seq_lens)]


# ---------------------------------------------------------------- the scheduler against a naive one
class ScriptedRunner:
    """A runner whose logits pick each request's scripted tokens (one per step), keyed
    by the request's first prompt token; it checks the lookback the scheduler hands it
    against the compressed ids it has seen per slot."""

    def __init__(self, vocab: int, scripts: dict[int, tuple[int, list[int]]], max_batch: int = 4) -> None:
        self.vocab_size = vocab
        self.max_batch, self.max_num_tokens, self.max_seq_len = max_batch, 16, 512
        self.lookback_len = 2
        self.eos_ids: set[int] = set()
        self.scripts = scripts  # first prompt token -> (prompt length, tokens)
        self.by_slot: dict[int, tuple[int, list[int]]] = {}
        self.seen: dict[int, list[int]] = {}
        self.lookback_errors = 0

    def compress(self, ids: np.ndarray) -> np.ndarray:
        return ids % 97

    def reset_slot(self, slot: int) -> None:
        self.by_slot.pop(slot, None)
        self.seen[slot] = []

    def run(self, step: PackedStep, cids: np.ndarray, lookback: np.ndarray) -> torch.Tensor:
        logits = torch.zeros(step.num_seqs, self.vocab_size)
        ids = step.input_ids.tolist()
        for s, (a, b) in enumerate(zip(step.seq_starts, step.seq_starts[1:])):
            slot = step.slots[s]
            if step.past_lens[s] == 0:
                self.by_slot[slot] = self.scripts[ids[a]]
            want = ([-1, -1] + self.seen[slot])[-2:]
            self.lookback_errors += lookback[s].tolist() != want
            self.seen[slot] += cids[a:b].tolist()
            plen, toks = self.by_slot[slot]
            k = step.past_lens[s] + step.seq_lens[s] - plen
            logits[s, toks[min(max(k, 0), len(toks) - 1)]] = 1.0
        return logits


def _naive(tok: Any, script: list[int], p: SamplingParams) -> tuple[list[int], str, str, Any]:
    ids: list[int] = []
    for t in script[: p.max_tokens]:
        ids.append(t)
        text = tok.decode(ids, skip_special_tokens=p.skip_special_tokens)
        if t in p.stop_token_ids:
            reason, why = "stop", t
        else:
            reason, why = None, None
        hits = [(text.find(s), s) for s in p.stop if s in text]
        if hits:
            pos, s = min(hits)
            return ids, text[:pos], "stop", s
        if reason:
            return ids, text, reason, why
    return ids, tok.decode(ids, skip_special_tokens=p.skip_special_tokens), "length", None


def test_scheduler_outputs_equal_a_naive_scheduler(ds_tok: Any) -> None:
    rng = random.Random(3)
    V = ds_tok.get_vocab_size()
    specials = sorted(i for i, a in ds_tok.get_added_tokens_decoder().items() if a.special)[:50]
    assert specials
    cases = []
    for i in range(24):
        script = (
            _multibyte_ids(ds_tok, rng, 20)
            if i % 3 == 0
            else ds_tok.encode(
                " ".join(rng.choice(["alpha", "beta", "γάμμα", "δ", "end", "stop", "日本"]) for _ in range(30)),
                add_special_tokens=False,
            ).ids
        )
        script = script[:40]
        if i % 4 == 1:  # special tokens in the output: skipped from the text (or kept, every 8th case)
            for _ in range(3):
                script.insert(rng.randrange(len(script) + 1), rng.choice(specials))
        skip = i % 8 != 1
        text = ds_tok.decode(script, skip_special_tokens=skip)
        stop: tuple[str, ...] = ()
        if i % 2 and len(text) > 8:  # a stop string taken from somewhere in the text, plus one that never comes
            a = rng.randrange(1, len(text) - 3)
            stop = (text[a : a + rng.randrange(1, 4)], "never-in-this-text")
        stop_ids = (script[rng.randrange(len(script))],) if i % 5 == 4 else ()
        cases.append(
            (
                1000 + i,
                rng.randrange(1, 20),
                script,
                SamplingParams(
                    max_tokens=rng.randrange(5, 40),
                    stop=stop,
                    stop_token_ids=stop_ids,
                    ignore_eos=True,
                    skip_special_tokens=skip,
                ),
            )
        )
    runner = ScriptedRunner(V, {first: (plen, script) for first, plen, script, _ in cases})
    sched = Scheduler(runner, ds_tok)
    streams: dict[int, list[Any]] = {}
    lock = threading.Lock()
    handles = []
    try:
        for i, (first, plen, script, p) in enumerate(cases):
            prompt = [first] + [5 + (first * 7 + j) % 900 for j in range(plen - 1)]
            if i % 2 == 0:  # half streamed (text kept per token), half not (text decoded at the end)
                streams[i] = []

                def sink(out, i=i):
                    lock.acquire()
                    streams[i].append(out)
                    lock.release()

            else:
                sink = None
            handles.append(sched.submit(prompt, p, sink=sink))
        for h in handles:
            assert h.done.wait(60)
    finally:
        sched.close()
    assert runner.lookback_errors == 0
    for i, ((first, plen, script, p), h) in enumerate(zip(cases, handles)):
        ids, text, reason, why = _naive(ds_tok, script, p)
        out = h.output()
        assert (out.token_ids, out.text, out.finish_reason, out.stop_reason) == (ids, text, reason, why), i
        if i in streams:
            evs = streams[i]
            assert [t for e in evs for t in e.delta_token_ids] == ids
            assert "".join(e.delta_text for e in evs) == text and evs[-1].finished


# ---------------------------------------------------------------- the host-time breakdown
def test_step_phases_sum_and_kinds() -> None:
    ph = StepPhases()
    for decode in (True, True, False):
        ph.begin()
        for i in range(len(PHASES)):
            ph.mark(i)
        ph.end(decode, 1 if decode else 7)
    s = ph.summary()
    assert s["decode"]["steps"] == 2 and s["decode"]["tokens"] == 2 and s["prefill"]["tokens"] == 7
    for kind in ("decode", "prefill"):
        us = s[kind]["us_per_step"]
        assert set(us) == set(PHASES) and all(v >= 0 for v in us.values())
        assert s[kind]["total_us"] == pytest.approx(sum(us.values()))
        assert s[kind]["host_us_without_forward"] == pytest.approx(s[kind]["total_us"] - us["forward"] - us["gpu_wait"])


def test_bench_serve_host_breakdown(small_engine: Path, tmp_path: Path, capsys: Any) -> None:
    from engram_trt.bench import serve

    out = tmp_path / "serve.json"
    opts = serve.ServeOptions(
        path=str(small_engine),
        concurrency="1,3",
        prompt_tokens=5,
        max_tokens=6,
        device="cpu",
        backend="torch",
        json=str(out),
        host_breakdown=True,
    )
    assert serve.run(opts) == 0
    res = json.loads(out.read_text())
    printed = capsys.readouterr().out
    one = res["levels"]["1"]["host_breakdown"]
    # Alone: one prefill step gives the first token, then 5 decode-only steps.
    assert one["decode"]["steps"] == 5 and one["decode"]["tokens"] == 5 and one["prefill"]["steps"] == 1
    assert "1 concurrent: decode steps: 5 (5 tokens)" in printed
    for n in (1, 3):
        b = res["levels"][str(n)]["host_breakdown"]
        # Every prompt token and every token fed back lands in one step of one kind.
        assert b["decode"]["tokens"] + b["prefill"]["tokens"] == n * (5 + 5)
        assert b["decode"]["steps"] >= 1 and b["decode"]["us_per_step"]["forward"] > 0
        assert b["decode"]["us_per_step"]["schedule"] > 0 and b["decode"]["gpu_us"] == 0.0


def test_bench_serve_null_model_leaves_the_host_path(small_engine: Path, tmp_path: Path) -> None:
    """--null-model: every token is the stub's (7) and no Engram rows are staged."""
    from engram_trt import LLM
    from engram_trt.bench import serve

    with LLM(str(small_engine), backend="torch", device="cpu", progress=False) as llm:
        serve.null_model(llm.runner)
        (o,) = llm.generate([11, 12, 13], SamplingParams(max_tokens=6, ignore_eos=True))
        assert o.token_ids == [7] * 6 and llm.runner.prefetcher is None
    out = tmp_path / "null.json"
    opts = serve.ServeOptions(
        path=str(small_engine),
        concurrency="1,4",
        prompt_tokens=5,
        max_tokens=8,
        device="cpu",
        backend="torch",
        json=str(out),
        host_breakdown=True,
        null_model=True,
    )
    assert serve.run(opts) == 0
    res = json.loads(out.read_text())
    assert res["backend"].endswith("(null model)") and res["levels"]["1"]["host_breakdown"]["decode"]["steps"] == 7
