"""Qwen4Exp checkpoints against transformers 5.25.0 itself.

Each case is a tiny random ``Qwen4ExpForCausalLM`` (every parameter, PLE tables
included, drawn at random: transformers zero-initializes several) that transformers
builds and saves (``save_pretrained``: its config.json and safetensors as a user's
folder holds them, the PLE table in ``split_ngram_parts`` shards). engram-trt serves
the folder through ``engram_trt.LLM`` and ``engram-trt run``; its greedy tokens must
equal transformers' ``generate``, its fp32 logits agree within 1e-4 relative. Prompts
carry EOS runs (the PLE hash restarts after each EOS). Bad checkpoints are refused in
one line with exit 2.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from helpers.checkpoints import (  # noqa: E402
    assert_bf16_logits_match,
    assert_fp32_logits_match,
    edit_config,
    llm_greedy,
    packed_greedy,
    word_tokenizer,
)
from helpers.cli import assert_run_refused, run_json  # noqa: E402
from engram_trt.cli.main import main  # noqa: E402

from helpers.qwen4_exp import BASE, CASES, NEW_TOKENS, PROMPTS, VOCAB, hf_greedy, randomized, save_qwen4  # noqa: E402
from helpers.files import DATA  # noqa: E402


# the cases whose PLE rows do not divide by split_ngram_parts (fewer shards than parts)
UNEVEN = ("hc4-ple2-chunk64", "ngram4-chunk13")


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request: Any, tmp_path_factory: Any) -> tuple[str, Path, Any]:
    name = request.param
    folder = tmp_path_factory.mktemp(name) / "ck"
    model = save_qwen4(folder, seed=len(name), **CASES[name])
    return name, folder, model


def test_llm_greedy_tokens_equal_transformers(case: tuple[str, Path, Any]) -> None:
    _name, folder, model = case
    want = [hf_greedy(model, p) for p in PROMPTS]
    assert llm_greedy(folder, PROMPTS, NEW_TOKENS) == want


def test_fp32_logits_within_1e4_of_transformers(case: tuple[str, Path, Any]) -> None:
    from engram_trt.models.registry import open_checkpoint

    _name, folder, model = case
    ckpt = open_checkpoint(folder)
    ours = ckpt.architecture.load_model(ckpt, device="cpu", dtype=torch.float32)
    assert_fp32_logits_match(model, ours, PROMPTS)
    ckpt.close()


def test_chunked_prefill_and_packed_steps_equal_whole_sequences(case: tuple[str, Path, Any]) -> None:
    """The per-slot state (KV, delta-rule, convolutions, n-gram context) makes chunks
    and mixed steps equal one forward of each sequence."""
    from engram_trt.models.registry import open_checkpoint

    _name, folder, model = case
    ckpt = open_checkpoint(folder)
    ours = ckpt.architecture.load_model(ckpt, device="cpu", dtype=torch.float32)
    want = [hf_greedy(model, p, 6) for p in PROMPTS]
    assert [ours.generate_greedy(p, 6, chunk=3, ignore_eos=True) for p in PROMPTS] == want
    # All three prompts in one packed step (slots out of order), then decode together.
    assert packed_greedy(ours, PROMPTS, 6) == want
    ckpt.close()


def test_run_command_matches_transformers(case: tuple[str, Path, Any], capsys: Any) -> None:
    _name, folder, model = case
    prompt = PROMPTS[0]
    want = hf_greedy(model, prompt)
    assert run_json(folder, prompt, NEW_TOKENS, capsys)["token_ids"] == want


# -- bad input: one line, exit 2 ------------------------------------------------------------


def _resave_without(folder: Path, drop: str | None = None, shorten: str | None = None) -> None:
    from safetensors.torch import load_file, save_file

    f = folder / "model.safetensors"
    tensors = load_file(str(f))
    if drop:
        tensors.pop(drop)
    if shorten:
        tensors[shorten] = tensors[shorten][:-1].clone()
    save_file(tensors, str(f), metadata={"format": "pt"})


BAD = {
    "shard-missing": (
        lambda f: _resave_without(f, drop="model.layers.0.ple.ple_embedding.ngram_embedding.shard_1.weight"),
        "shard_1.weight is missing",
    ),
    "shard-short": (
        lambda f: _resave_without(f, shorten="model.layers.0.ple.ple_embedding.ngram_embedding.shard_0.weight"),
        "rows in its 2 shards but the config's primes",
    ),
    "prime-mismatch": (lambda f: edit_config(f, ngram_vocab_size_base=60), "give|differs from"),
    "ple-on-full-attention": (
        lambda f: edit_config(f, ple_layer_ids=[4]),
        "ple_layer_ids holds 4, a indexed_attention layer",
    ),
    "retired-twins": (
        lambda f: edit_config(f, ple_max_ngram_size=3),
        "not a Qwen4Exp field|not implemented|ple_max_ngram_size",
    ),
    "qsa-partial": (lambda f: edit_config(f, indexer_budget=None), "QSA indexer fields are all or none"),
    "rope-type": (
        lambda f: edit_config(f, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}),
        "rope_type='yarn' is not implemented",
    ),
    "layer-type": (
        lambda f: edit_config(f, layer_types=["linear_attention", "linear_attention", "linear_attention", "mamba"]),
        "'mamba', not a Qwen4Exp layer type",
    ),
}


@pytest.mark.parametrize("bad", sorted(BAD))
def test_bad_checkpoints_refused_in_one_line(tmp_path: Path, capsys: Any, bad: str) -> None:
    folder = tmp_path / "ck"
    save_qwen4(folder, seed=1, **CASES["hc2-ple1-qsa"])
    damage, needle = BAD[bad]
    damage(folder)
    assert_run_refused(folder, needle, capsys)


def _resplit_ple(folder: Path, sizes: list[int]) -> None:
    """The saved PLE table of the one PLE layer re-split into shards of ``sizes`` rows."""
    from safetensors.torch import load_file, save_file

    f = folder / "model.safetensors"
    tensors = load_file(str(f))
    stem = next(k for k in tensors if ".ngram_embedding.shard_0." in k).replace("shard_0.", "shard_{}.")
    n = sum(1 for k in tensors if ".ngram_embedding.shard_" in k)
    table = torch.cat([tensors.pop(stem.format(i)) for i in range(n)])
    assert sum(sizes) == table.shape[0]
    for i, part in enumerate(torch.split(table, sizes)):
        tensors[stem.format(i)] = part.clone()
    save_file(tensors, str(f), metadata={"format": "pt"})


@pytest.mark.parametrize("layout", ["one-shard-more", "other-sizes", "fewer-shards"])
def test_ple_shards_torch_chunk_would_not_write_refused(tmp_path: Path, capsys: Any, layout: str) -> None:
    """132 rows in split_ngram_parts=13: torch.chunk writes 12 shards of 11 rows. The same
    rows in 13 shards, in 12 shards of other sizes, or in 11 shards are refused by name."""
    folder = tmp_path / "ck"
    save_qwen4(folder, seed=6, **CASES["ngram4-chunk13"])
    assert shard_rows_saved(folder) == {1: [11] * 12}
    sizes, needle = {
        "one-shard-more": ([11] * 11 + [6, 5], r"shard torch\.chunk does not write: \S+shard_12\.weight"),
        "other-sizes": (
            [10, 12] + [11] * 10,
            r"shard_0\.weight has 10 rows but torch\.chunk.* writes 12 shard\(s\) of 11 rows",
        ),
        "fewer-shards": ([12] * 11, r"shard_11\.weight is missing \(torch\.chunk.* writes 12 shard"),
    }[layout]
    _resplit_ple(folder, sizes)
    assert_run_refused(folder, needle, capsys)


def test_inspect_lists_ple_tables(case: tuple[str, Path, Any], capsys: Any) -> None:
    name, folder, _model = case
    code = main(["inspect", str(folder), "--json"])
    info = json.loads(capsys.readouterr().out)
    assert code == 0 and info["architecture"] == "qwen4-exp" and info["problems"] == []
    spec = CASES[name]
    if "ple_layer_ids" not in spec:
        assert info["ple"] is None
        return
    layers = info["ple"]["layers"]
    assert [e["ple_layer_id"] for e in layers] == spec["ple_layer_ids"]
    heads = (spec["ngram_size"] - 1) * spec["heads_per_ngram"]
    shards = shard_rows_saved(folder)
    for e in layers:
        # the shards transformers' save wrote (torch.chunk: fewer than split_ngram_parts
        # when the rows do not divide)
        saved = shards[e["ple_layer_id"] - 1]
        chunk = -(-e["table_rows"] // spec["split_ngram_parts"])
        assert e["shards"] == len(saved) == -(-e["table_rows"] // chunk) <= spec["split_ngram_parts"]
        assert e["chunk_rows"] == saved[0] == chunk and e["last_shard_rows"] == saved[-1]
        assert e["width"] == spec["ple_embed_dim"] // heads and e["split_ngram_parts"] == spec["split_ngram_parts"]
        assert e["table_rows"] == e["layout_rows"] and e["table_rows"] % spec["make_ngram_vocab_size_divisible_by"] == 0
        assert e["bytes"] == e["table_rows"] * e["width"] * 4  # float32 rows as transformers saved them
    if name in UNEVEN:
        assert any(e["shards"] < spec["split_ngram_parts"] for e in layers)


def shard_rows_saved(folder: Path) -> dict[int, list[int]]:
    """Per decoder layer, the rows of each PLE shard in the saved file, in shard order."""
    from safetensors import safe_open

    out: dict[int, dict[int, int]] = {}
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        for k in f.keys():
            if ".ngram_embedding.shard_" in k:
                layer = int(k.split("layers.")[1].split(".")[0])
                out.setdefault(layer, {})[int(k.rsplit("shard_", 1)[1].split(".")[0])] = f.get_slice(k).get_shape()[0]
    return {layer: [d[i] for i in range(len(d))] for layer, d in out.items()}


def test_build_takes_the_f32_ple_tables_transformers_saves(tmp_path: Path, capsys: Any) -> None:
    """transformers saves the PLE shards as float32 with rows ``ple_embed_dim /
    heads_per_ngram`` wide (4 here); EngramGather reads such rows, so `build` writes the
    engine folder and records each shard as F32 (tests/builder/test_qwen4_exp_build.py builds and
    serves the engine itself; F64 and mixed shards stay refused there)."""
    folder = tmp_path / "ck"
    save_qwen4(folder, seed=2, **CASES["hc2-ple1-qsa"])
    capsys.readouterr()
    code = main(["build", str(folder), "--output", str(tmp_path / "engine"), "--no-engine"])
    assert code == 0, capsys.readouterr().err
    manifest = json.loads((tmp_path / "engine" / "manifest.json").read_text())
    assert manifest["table_dtype"] == "fp32" and manifest["tables"]
    assert all(t["dtype"] == "F32" and t["sha256"] for t in manifest["tables"])
    assert manifest["graph"]["io"]["ple"]["head_dim"] == 4


def test_committed_tiny_checkpoint_is_transformers_and_ours() -> None:
    """tests/data/qwen4_exp_tiny (saved by transformers 5.25, no tokenizer): its recorded
    greedy tokens are transformers' own today and ours through LLM (token-id prompts).
    The GPU tests (tests/gpu/test_qwen4_exp.py) hold the CUDA model to the same tokens."""
    from transformers import Qwen4ExpForCausalLM

    folder = DATA / "qwen4_exp_tiny"
    want = json.loads((folder / "expected.json").read_text())
    model = Qwen4ExpForCausalLM.from_pretrained(folder, use_kernels=False).eval()
    assert [hf_greedy(model, p, want["new_tokens"]) for p in want["prompts"]] == want["greedy"]
    assert llm_greedy(folder, want["prompts"], want["new_tokens"]) == want["greedy"]
    # bf16: ours within 1e-2 relative L2 of transformers' bf16 logits; transformers' own
    # bf16 distance from its fp32 logits is what the GPU test's bf16 bound scales.
    hf16 = Qwen4ExpForCausalLM.from_pretrained(folder, use_kernels=False, dtype=torch.bfloat16).eval()
    assert_bf16_logits_match(folder, model, hf16, want)


def test_conditional_generation_serves_its_text_model(tmp_path: Path, capsys: Any) -> None:
    """Qwen4ExpForConditionalGeneration: the text model (weights under
    model.language_model.) is served; the vision tower's tensors are refused in one line
    unless --allow-unused-weights, with which the tokens equal transformers' text-only
    generate."""
    from transformers import Qwen4ExpConfig, Qwen4ExpForConditionalGeneration

    vision = dict(
        depth=1,
        hidden_size=16,
        intermediate_size=32,
        num_heads=2,
        out_hidden_size=32,
        patch_size=4,
        temporal_patch_size=1,
        spatial_merge_size=1,
        num_position_embeddings=16,
    )
    torch.manual_seed(4)
    cfg = Qwen4ExpConfig(text_config=dict(BASE, **CASES["hc2-ple1-qsa"]), vision_config=vision)
    model = randomized(Qwen4ExpForConditionalGeneration(cfg).eval(), 4)
    folder = tmp_path / "ck"
    model.save_pretrained(folder)
    word_tokenizer(folder / "tokenizer.json", VOCAB)
    want = hf_greedy(model, PROMPTS[0])
    capsys.readouterr()
    text = " ".join(f"w{i}" for i in PROMPTS[0])
    argv = [
        "run",
        str(folder),
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
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "model.visual." in err and "--allow-unused-weights" in err
    assert main(argv + ["--allow-unused-weights"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == want
