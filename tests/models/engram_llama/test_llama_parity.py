"""Plain HF Llama checkpoints against transformers itself, and the engram-llama
contract: every config field honoured or refused.

Each case is a tiny random ``LlamaForCausalLM`` that transformers 5.25 builds and saves
(``save_pretrained``: its config.json and safetensors exactly as a user's folder holds
them). engram-trt serves the folder through ``engram_trt.LLM`` and ``engram-trt run``;
its greedy tokens must equal transformers' ``generate``, its fp32 logits agree within
1e-4 relative. The table of refused fields holds every value the model does not
implement: each is refused in one line naming the field, and nothing is written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from engram_trt.cli.main import main  # noqa: E402

from helpers.llama import NEW_TOKENS, PROMPTS, SUPPORTED, hf_greedy, save_llama  # noqa: E402


def edit_config(folder: Path, **changes: Any) -> None:
    p = folder / "config.json"
    d = json.loads(p.read_text())
    for k, v in changes.items():
        if v is ...:
            d.pop(k, None)
        else:
            d[k] = v
    p.write_text(json.dumps(d, indent=2))


@pytest.mark.parametrize("name", sorted(SUPPORTED))
def test_llm_greedy_tokens_equal_transformers(tmp_path: Path, name: str) -> None:
    from engram_trt import LLM, SamplingParams

    model = save_llama(tmp_path / "ck", seed=len(name), **SUPPORTED[name])
    want = [hf_greedy(model, p) for p in PROMPTS]
    with LLM(str(tmp_path / "ck"), backend="torch", device="cpu", dtype="fp32") as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    assert [list(o.outputs[0].token_ids) for o in outs] == want


@pytest.mark.parametrize("name", ["default", "llama3", "yarn-attention-factor", "tied-head"])
def test_fp32_logits_within_1e4_of_transformers(tmp_path: Path, name: str) -> None:
    from engram_trt.models.engram_llama.model import EngramLlama

    model = save_llama(tmp_path / "ck", seed=3, **SUPPORTED[name])
    ours = EngramLlama.from_checkpoint(tmp_path / "ck", device="cpu", dtype=torch.float32)
    for prompt in PROMPTS:
        with torch.no_grad():
            ref = model(torch.tensor([prompt])).logits[0].double()
            got = ours.forward(torch.tensor(prompt)).double()
        assert got.shape == ref.shape
        assert (got - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()


def test_transformers4_rope_spelling_serves_the_same_model(tmp_path: Path) -> None:
    """rope_theta + rope_scaling (transformers 4) read as the rope_parameters they mean."""
    from transformers import LlamaForCausalLM

    from engram_trt import LLM, SamplingParams

    save_llama(tmp_path / "ck", seed=5)
    edit_config(
        tmp_path / "ck",
        rope_parameters=...,
        rope_theta=50000.0,
        rope_scaling={
            "type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    )
    model = LlamaForCausalLM.from_pretrained(tmp_path / "ck", use_kernels=False).eval()  # no hub kernels offline
    assert model.config.rope_parameters["rope_type"] == "llama3"
    assert model.config.rope_parameters["rope_theta"] == 50000.0
    want = [hf_greedy(model, p) for p in PROMPTS]
    with LLM(str(tmp_path / "ck"), backend="torch", device="cpu", dtype="fp32") as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    assert [list(o.outputs[0].token_ids) for o in outs] == want


def test_run_command_matches_transformers(tmp_path: Path, capsys: Any) -> None:
    model = save_llama(tmp_path / "ck", seed=7, **SUPPORTED["llama3"])
    prompt = PROMPTS[0]
    want = hf_greedy(model, prompt)
    text = " ".join(f"w{i}" for i in prompt)
    code = main(
        [
            "run",
            str(tmp_path / "ck"),
            "--prompt",
            text,
            "--max-new-tokens",
            str(NEW_TOKENS),
            "--ignore-eos",
            "--device",
            "cpu",
            "--dtype",
            "fp32",
            "--json",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert json.loads(out)["token_ids"] == want


# field -> (value, the words the refusal must contain). None of these values is
# implemented; serving any of them as the default would be a different model.
REFUSED: dict[str, tuple[Any, tuple[str, ...]]] = {
    "hidden_act": ("gelu", ("'hidden_act'", "gelu", "silu")),
    "attention_bias": (True, ("'attention_bias'", "true", "false")),
    "mlp_bias": (True, ("'mlp_bias'", "true", "false")),
    "quantization_config": (
        {"quant_method": "gptq", "bits": 4},
        ("'quantization_config.quant_method'='gptq'", "is not served", '"fp8"'),
    ),
    "model_type": ("mistral", ("model_type 'mistral'", "LlamaForCausalLM")),
    "architectures": (["MistralForCausalLM"], ("MistralForCausalLM", "supported architectures", "LlamaForCausalLM")),
    "rope_parameters": (
        {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0] * 8,
            "long_factor": [2.0] * 8,
            "original_max_position_embeddings": 32,
        },
        ("longrope",),
    ),
}


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory: Any) -> Path:
    folder = tmp_path_factory.mktemp("llama") / "ck"
    save_llama(folder)
    return folder


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_unimplemented_field_values_are_refused(tmp_path: Path, capsys: Any, saved_llama: Path, field: str) -> None:
    import shutil

    value, words = REFUSED[field]
    ck = tmp_path / "ck"
    shutil.copytree(saved_llama, ck)
    edit_config(ck, **{field: value})
    before = sorted(p.name for p in tmp_path.rglob("*"))
    for argv in (
        ["run", str(ck), "--prompt", "w1 w2", "--max-new-tokens", "2", "--device", "cpu"],
        ["build", str(ck), "--output", str(tmp_path / "engine"), "--no-engine"],
    ):
        code = main(argv)
        err = capsys.readouterr().err
        assert code == 2, (argv, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("engram-trt: error: "), err
        for w in words:
            assert w in lines[0], (w, lines[0])
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing written


@pytest.mark.parametrize("field", ["hidden_act", "attention_bias", "mlp_bias"])
def test_inspect_lists_unimplemented_fields_as_problems(
    tmp_path: Path, capsys: Any, saved_llama: Path, field: str
) -> None:
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(saved_llama, ck)
    edit_config(ck, **{field: REFUSED[field][0]})
    code = main(["inspect", str(ck), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1
    assert any(f"'{field}'" in p for p in report["problems"])


def test_model_without_engram_inspects_clean_and_its_engine_folder_runs(
    tmp_path: Path, capsys: Any, saved_llama: Path
) -> None:
    code = main(["inspect", str(saved_llama)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "no Engram layers" in out and "problems     none" in out
    assert main(["build", str(saved_llama), "--output", str(tmp_path / "engine"), "--no-engine", "--json"]) == 0
    capsys.readouterr()
    code = main(
        [
            "run",
            str(tmp_path / "engine"),
            "--prompt",
            "w5 w6 w7",
            "--max-new-tokens",
            "3",
            "--device",
            "cpu",
            "--backend",
            "torch",
            "--json",
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert len(json.loads(captured.out)["token_ids"]) == 3


def test_tensors_the_model_does_not_read_are_listed_and_refused(tmp_path: Path, capsys: Any) -> None:
    """A tensor no part of the model reads (a multi-token-prediction layer's): refused by
    name, served with --allow-unused-weights (the model is the same without it)."""
    from safetensors.torch import load_file, save_file

    model = save_llama(tmp_path / "ck", seed=9, tie_word_embeddings=True)
    st = tmp_path / "ck" / "model.safetensors"
    tensors = load_file(st)
    tensors["model.mtp.0.proj.weight"] = torch.zeros(4, 4)
    save_file(tensors, st, metadata={"format": "pt"})
    argv = [
        "run",
        str(tmp_path / "ck"),
        "--prompt",
        "w5 w17 w33",
        "--max-new-tokens",
        "4",
        "--ignore-eos",
        "--device",
        "cpu",
        "--dtype",
        "fp32",
        "--json",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "model.mtp.0.proj.weight" in err and "--allow-unused-weights" in err
    assert main(["inspect", str(tmp_path / "ck"), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["unused_tensors"] == ["model.mtp.0.proj.weight"]
    assert main(argv + ["--allow-unused-weights"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == hf_greedy(model, [5, 17, 33])[:4]
