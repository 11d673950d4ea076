"""DeepSeek-V4 checkpoints against transformers 5.25.0 itself.

Each case is a tiny random ``DeepseekV4ForCausalLM`` (every parameter and buffer drawn
at random, the ``tid2eid`` hash-routing tables and the routers' correction biases
included: transformers zero-initializes them) that transformers builds and saves
(``save_pretrained``: the upstream DeepSeek tensor names, experts one tensor each).
engram-trt serves the folder through ``engram_trt.LLM`` and ``engram-trt run``; its
greedy tokens must equal transformers' ``generate``, its fp32 logits agree within 1e-4
relative; chunked prefills and packed steps equal whole sequences. Bad checkpoints are
refused in one line with exit 2 and nothing written.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from helpers.checkpoints import (  # noqa: E402
    assert_fp32_logits_match,
    edit_config,
    llm_greedy,
    packed_greedy,
)
from helpers.cli import assert_run_refused, run_json  # noqa: E402
from helpers.deepseek_v4 import BASE, CASES, CSA, HCA, NEW_TOKENS, PROMPTS, VOCAB, hf_greedy, save_v4, save_v41  # noqa: E402


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request: Any, tmp_path_factory: Any) -> tuple[str, Path, Any]:
    name = request.param
    folder = tmp_path_factory.mktemp(name) / "ck"
    model = save_v4(folder, seed=len(name), **CASES[name])
    return name, folder, model


def _load(folder: Path) -> Any:
    from engram_trt.models.registry import open_checkpoint

    ckpt = open_checkpoint(folder)
    model = ckpt.architecture.load_model(ckpt, device="cpu", dtype=torch.float32)
    ckpt.close()
    return model


def test_checkpoint_names_are_transformers_names_read_back(case: tuple[str, Path, Any]) -> None:
    """Every module tensor of transformers' model has its checkpoint spelling, and the
    names we read are exactly the saved ones."""
    from safetensors import safe_open

    from engram_trt.models.deepseek_v4.weights import checkpoint_name
    from engram_trt.models.registry import open_checkpoint

    _name, folder, model = case
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    theirs = {
        checkpoint_name(k)
        for k in model.state_dict()
        if not re.search(r"\.experts\.(gate_up|down)_proj$", k)
        and not (k == "lm_head.weight" and model.config.tie_word_embeddings)
    }  # a tied head is not saved
    assert theirs <= saved
    ckpt = open_checkpoint(folder)
    assert set(ckpt.architecture.tensor_names(ckpt.config)) == saved
    assert ckpt.architecture.checkpoint_problems(ckpt) == []
    ckpt.close()


def test_llm_greedy_tokens_equal_transformers(case: tuple[str, Path, Any]) -> None:
    _name, folder, model = case
    want = [hf_greedy(model, p) for p in PROMPTS]
    assert llm_greedy(folder, PROMPTS, NEW_TOKENS) == want


def test_fp32_logits_within_1e4_of_transformers(case: tuple[str, Path, Any]) -> None:
    _name, folder, model = case
    assert_fp32_logits_match(model, _load(folder), PROMPTS)


def test_chunked_prefill_and_packed_steps_equal_whole_sequences(case: tuple[str, Path, Any]) -> None:
    _name, folder, model = case
    ours = _load(folder)
    want = [hf_greedy(model, p, 6) for p in PROMPTS]
    assert [ours.generate_greedy(p, 6, chunk=3, ignore_eos=True) for p in PROMPTS] == want
    assert packed_greedy(ours, PROMPTS, 6) == want


def test_run_command_matches_transformers(case: tuple[str, Path, Any], capsys: Any) -> None:
    _name, folder, model = case
    prompt = PROMPTS[0]
    want = hf_greedy(model, prompt)
    assert run_json(folder, prompt, NEW_TOKENS, capsys)["token_ids"] == want


# -- the pieces against transformers' own modules -------------------------------------------


def test_hyper_connection_and_moe_equal_transformers_modules() -> None:
    """mHC (Sinkhorn-Knopp), the hyper head and both MoE routings with the same random
    weights as transformers' modules, on random streams."""
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as ref

    from engram_trt.models.deepseek_v4.config import read_config
    from engram_trt.models.deepseek_v4.modules import HyperConnection, HyperHead, SparseMoE

    kw = dict(BASE, hc_mult=3, hc_sinkhorn_iters=7, hc_eps=1e-4, scoring_func="sqrtsoftplus", swiglu_limit=0.5)
    tcfg = DeepseekV4Config(**kw)
    cfg = read_config(dict(kw, architectures=["DeepseekV4ForCausalLM"]))
    gen = torch.Generator().manual_seed(7)

    def randomize(m: torch.nn.Module) -> None:
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)

    streams = torch.randn(9, 3, 32, generator=gen)
    theirs_hc, ours_hc = ref.DeepseekV4HyperConnection(tcfg), HyperConnection(cfg)
    randomize(theirs_hc)
    ours_hc.load_state_dict(theirs_hc.state_dict())
    post, comb, collapsed = theirs_hc(streams.unsqueeze(0))
    got, p2, c2 = ours_hc.collapse(streams)
    torch.testing.assert_close(got, collapsed[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(p2, post[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(c2, comb[0], rtol=1e-6, atol=1e-6)
    assert torch.allclose(c2.sum(-2), torch.ones(9, 3), atol=1e-3)  # doubly stochastic after Sinkhorn (columns last)

    theirs_head, ours_head = ref.DeepseekV4HyperHead(tcfg), HyperHead(cfg)
    randomize(theirs_head)
    ours_head.load_state_dict(theirs_head.state_dict())
    torch.testing.assert_close(ours_head(streams), theirs_head(streams.unsqueeze(0))[0], rtol=1e-6, atol=1e-6)

    ids = torch.randint(0, VOCAB, (9,), generator=gen)
    x = torch.randn(9, 32, generator=gen)
    for layer in (0, 1):  # hash_moe, moe
        theirs = ref.DeepseekV4SparseMoeBlock(tcfg, layer)
        randomize(theirs)
        with torch.no_grad():
            if layer == 0:
                theirs.gate.tid2eid.copy_(torch.randint(0, 4, theirs.gate.tid2eid.shape, generator=gen))
            else:
                theirs.gate.e_score_correction_bias.copy_(torch.randn(4, generator=gen))
        ours = SparseMoE(cfg, layer)
        sd = {k: v for k, v in theirs.state_dict().items() if not k.startswith("experts.")}
        for e in range(4):
            gate, up = theirs.experts.gate_up_proj[e].chunk(2, dim=0)
            sd[f"experts.{e}.gate_proj.weight"] = gate
            sd[f"experts.{e}.up_proj.weight"] = up
            sd[f"experts.{e}.down_proj.weight"] = theirs.experts.down_proj[e]
        ours.load_state_dict(sd)
        with torch.no_grad():
            want = theirs(x.unsqueeze(0), input_ids=ids.unsqueeze(0))[0]
        torch.testing.assert_close(ours(x, ids), want, rtol=1e-5, atol=1e-6)


# -- bad input: one line, exit 2 ------------------------------------------------------------


def _retensor(folder: Path, name: str, value: Any) -> None:
    from safetensors.torch import load_file, save_file

    f = folder / "model.safetensors"
    tensors = load_file(str(f))
    tensors[name] = value(tensors[name])
    save_file(tensors, str(f), metadata={"format": "pt"})


BAD = {
    "layer-type": (
        lambda f: edit_config(f, layer_types=[HCA, "mamba_attention", HCA]),
        "layer_types holds 'mamba_attention', not a DeepSeek-V4 type",
    ),
    "compress-rate-0": (
        lambda f: edit_config(f, compress_rates={CSA: 0, HCA: 4}),
        r"compress_rates\['compressed_sparse_attention'\]=0",
    ),
    "more-experts-than-weights": (
        lambda f: edit_config(f, n_routed_experts=5),
        "layer 0 holds 4 routed experts .* n_routed_experts=5",
    ),
    "fewer-experts-than-weights": (lambda f: edit_config(f, n_routed_experts=3), r"experts\.3\.w1\.weight"),
    "tid2eid-out-of-range": (
        lambda f: _retensor(f, "model.layers.0.ffn.gate.tid2eid", lambda t: t + 4),
        "routes to expert .* outside 0..3",
    ),
    "mlp-type": (
        lambda f: edit_config(f, mlp_layer_types=["hash_moe", "dense", "moe"]),
        "mlp_layer_types holds 'dense'",
    ),
    "shared-experts": (lambda f: edit_config(f, n_shared_experts=2), "'n_shared_experts'=2 is not implemented"),
    "scoring": (lambda f: edit_config(f, scoring_func="softmax"), "scoring_func='softmax' is not implemented"),
    "engram-on-v4": (
        lambda f: edit_config(f, engram_layer_ids=[1]),
        "names DeepseekV4ForCausalLM, which has no Engram",
    ),
}


@pytest.mark.parametrize("bad", sorted(BAD))
def test_bad_checkpoints_refused_in_one_line(tmp_path: Path, capsys: Any, bad: str) -> None:
    folder = tmp_path / "ck"
    save_v4(folder, seed=1)
    damage, needle = BAD[bad]
    damage(folder)
    assert_run_refused(folder, needle, capsys)


def test_model_larger_than_the_gpu_is_refused_before_loading(monkeypatch: Any) -> None:
    """The check runs on the bytes the config implies against the device's free memory
    (faked here: this machine may have no GPU), before a tensor is read."""
    from engram_trt.errors import EngramError
    from engram_trt.models.deepseek_v4 import weights

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3 << 30, 80 << 30))
    with pytest.raises(
        EngramError, match=r"needs 5.00 GiB of weights on cuda:0 but only 3.00 GiB of 80.00 GiB is free"
    ):
        weights.check_fits(5 << 30, torch.device("cuda:0"), "the model")
    weights.check_fits(5 << 30, torch.device("cpu"), "the model")  # no check on a CPU


# -- V4.1: the V4 backbone with Engram layers on engram_layer_ids ---------------------------


def _llm_tokens(folder: Path, n: int = NEW_TOKENS) -> list[list[int]]:
    return llm_greedy(folder, PROMPTS, n)


def test_v41_with_all_zero_tables_gives_the_v4_tokens(tmp_path: Path) -> None:
    folder = tmp_path / "ck"
    model = save_v41(folder, lambda rows, width: torch.zeros(rows, width))
    assert _llm_tokens(folder) == [hf_greedy(model, p) for p in PROMPTS]


def test_v41_runtime_prefetch_equals_the_models_own_gather(tmp_path: Path) -> None:
    """Real tables: the runtime (tables in its store, rows hashed and staged by its
    prefetcher, lookback kept by the scheduler) gives the tokens of the model gathering
    its rows itself; and the tables do change the model (logits differ from V4's)."""
    from engram_trt.models.registry import open_checkpoint
    from engram_trt.models.step import PackedStep
    from engram_trt.tables.base import TableStore

    folder = tmp_path / "ck"
    gen = torch.Generator().manual_seed(11)
    model = save_v41(folder, lambda rows, width: torch.randn(rows, width, generator=gen))
    ckpt = open_checkpoint(folder)
    ours = ckpt.architecture.load_model(ckpt, device="cpu", dtype=torch.float32)
    ours.set_tables(
        TableStore.from_tensors(
            [ckpt.get(f"model.layers.{lid}.engram.embed.weight") for lid in (0, 2)], [None, None], 32, (0, 2)
        )
    )
    want = [ours.generate_greedy(p, NEW_TOKENS, chunk=4, ignore_eos=True) for p in PROMPTS]
    prompt = PROMPTS[2]
    got = ours.forward_step(
        PackedStep(torch.tensor(prompt), [len(prompt)], [0], [0]), ours.new_cache(1, 64), all_logits=True
    )
    with torch.no_grad():
        v4 = model(torch.tensor([prompt])).logits[0]
    assert (got - v4).abs().max().item() > 1e-2 * v4.abs().max().item()
    ckpt.close()
    assert _llm_tokens(folder) == want
