"""Chat templates and prompt tokenization against transformers' tokenizer of the same folder.

``LLM.apply_chat_template`` / ``LLM.chat`` render a checkpoint's chat template as
transformers' ``apply_chat_template`` does (the text, and the token ids it encodes to);
plain-text prompts get the special tokens transformers' ``AutoTokenizer`` gives them (a
BOS where the tokenizer's post-processor adds one, none where it does not). The folders:
the SmolLM2-135M-Instruct GGUF import (its real ChatML template, no BOS), and tiny GGUF
imports with a sentencepiece (Llama 2 style) and a byte-level BPE (Llama 3 style)
vocabulary, both adding their BOS.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("gguf", reason="the 'gguf' package (pip install gguf) reads GGUF files")
pytest.importorskip("transformers", reason="'transformers' is the reference tokenizer")
pytest.importorskip("jinja2", reason="chat templates are Jinja")

from helpers.gguf_files import SMOL, bpe_vocab, spm_vocab, write_tiny_gguf

from engram_trt.checkpoint.gguf_import import import_gguf
from engram_trt.errors import EngramError
from engram_trt.llmapi.chat import read_tokenizer_settings, render_chat

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Capital of Italy?"}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Ünïcödé 日本語 🙂 and a \"quote\" <b>tag</b>"},
    ],
]
TEXTS = ["Hello world", "hello the world", "  leading spaces\n\ttabs", "this is hello"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("chat")
    out = {"smollm2": import_gguf(SMOL, d / "smollm2", progress=False).out}
    write_tiny_gguf(d / "spm.gguf", vocab=spm_vocab(), untied=False)
    out["spm"] = import_gguf(d / "spm.gguf", d / "spm", progress=False).out
    write_tiny_gguf(d / "bpe.gguf", vocab=dict(bpe_vocab(), add_bos=True))
    out["bpe-bos"] = import_gguf(d / "bpe.gguf", d / "bpe-bos", progress=False).out
    return out


@pytest.fixture(scope="module")
def smol_llm(folders):
    from engram_trt.llmapi.llm import LLM

    with LLM(str(folders["smollm2"]), backend="torch", device="cpu", progress=False) as llm:
        yield llm


def test_chat_template_text_and_ids_equal_transformers(folders, smol_llm):
    from transformers import AutoTokenizer

    from engram_trt.runtime.sampling_params import SamplingParams

    ref = AutoTokenizer.from_pretrained(folders["smollm2"])
    assert smol_llm.chat_template and smol_llm.chat_template == ref.chat_template
    for conv in CONVERSATIONS:
        for gen_prompt in (True, False):
            want = ref.apply_chat_template(conv, add_generation_prompt=gen_prompt, tokenize=False)
            assert smol_llm.apply_chat_template(conv, add_generation_prompt=gen_prompt) == want
    outs = smol_llm.chat(CONVERSATIONS, SamplingParams(max_tokens=2, ignore_eos=True))
    for conv, o in zip(CONVERSATIONS, outs):
        ids = ref.apply_chat_template(conv, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        assert o.prompt_token_ids == ids and len(o.token_ids) == 2
        assert o.prompt == ref.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
    one = smol_llm.chat(CONVERSATIONS[0], SamplingParams(max_tokens=2, ignore_eos=True))  # one conversation
    assert len(one) == 1 and one[0].token_ids == outs[0].token_ids


def test_template_semantics_as_transformers(folders):
    """The environment's details: trim/lstrip blocks, loop controls, tojson leaving
    non-ASCII alone, raise_exception, and the special tokens by name."""
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(folders["spm"])
    settings = read_tokenizer_settings([folders["spm"]])
    assert settings.special_tokens["bos_token"] == "<s>" and settings.special_tokens["eos_token"] == "</s>"
    template = (
        "{{ bos_token }}{% for m in messages %}\n  {% if loop.index > 2 %}{% break %}{% endif %}\n"
        "[{{ m['role'] | upper }}] {{ m | tojson }}{{ eos_token }}\n{% endfor %}"
        "{% if add_generation_prompt %}[ASSISTANT]{% endif %}"
    )
    conv = CONVERSATIONS[2]
    want = ref.apply_chat_template(conv, chat_template=template, add_generation_prompt=True, tokenize=False)
    got = render_chat(template, conv, special_tokens=settings.special_tokens, add_generation_prompt=True)
    assert got == want and "Ünïcödé" not in got  # message 3 was cut by {% break %}
    assert render_chat(template, CONVERSATIONS[0], special_tokens=settings.special_tokens) == ref.apply_chat_template(
        CONVERSATIONS[0], chat_template=template, add_generation_prompt=True, tokenize=False
    )
    with pytest.raises(EngramError, match="refused the conversation.*no system messages") as exc:
        render_chat(
            "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system messages') }}{% endif %}",
            CONVERSATIONS[1],
        )
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("name, bos", [("smollm2", None), ("spm", 1), ("bpe-bos", 1)])
def test_plain_prompts_tokenized_as_autotokenizer(folders, name, bos):
    from transformers import AutoTokenizer

    from engram_trt.llmapi.llm import LLM

    ref = AutoTokenizer.from_pretrained(folders[name])
    tcfg = json.loads((folders[name] / "tokenizer_config.json").read_text())
    assert tcfg["add_bos_token"] is (bos is not None)
    with LLM(str(folders[name]), backend="torch", device="cpu", progress=False) as llm:
        for text in TEXTS:
            _, ids = llm.encode(text)
            assert ids == ref(text)["input_ids"], (name, text)
            assert (ids[0] == bos) if bos is not None else (ids[0] != ref.bos_token_id), (name, text)
            _, bare = llm.encode(text, add_special_tokens=False)
            assert bare == ref(text, add_special_tokens=False)["input_ids"]


def test_no_template_and_bad_messages_refused(folders, smol_llm):
    from engram_trt.llmapi.llm import LLM

    with LLM(str(folders["spm"]), backend="torch", device="cpu", progress=False) as llm:
        assert llm.chat_template is not None  # the tiny GGUFs carry a template
    tmpl = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    for bad, match in [
        ([], "non-empty list"),
        ("hi", "non-empty list"),
        ([{"content": "x"}], "message 0 has no 'role'"),
        (["hi"], "message 0 is a str"),
        ([{"role": "user", "content": 3}], "'content' must be text"),
    ]:
        with pytest.raises(EngramError, match=match):
            render_chat(tmpl, bad)
    with pytest.raises(EngramError, match="has no chat template"):
        render_chat(None, CONVERSATIONS[0])
    with pytest.raises(EngramError, match="the prompt is empty"):
        smol_llm.encode("")


def test_demo_tokenizer_unchanged():
    """The demo checkpoint's DeepSeek tokenizer adds no special tokens: a prompt encodes
    to the same ids as before special tokens were added."""
    from engram_trt.engram.tokenizer import default_tokenizer_json, load_tokenizer

    tok = load_tokenizer(default_tokenizer_json())
    for text in TEXTS:
        assert tok.encode(text).ids == tok.encode(text, add_special_tokens=False).ids
