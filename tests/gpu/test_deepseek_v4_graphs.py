"""DeepSeek-V4 / V4.1 decode steps as CUDA graphs (runtime/cuda_graphs.DecodeGraphs over
models/deepseek_v4's staged step) against the eager step, on a GPU.

  1. graphed vs eager, float32, three layer mixes (sliding / CSA / HCA; hash and top-k
     MoE, an uneven expert count and top-k, hc 2 and 4, sqrtsoftplus and sigmoid): decode
     steps of 3, 5 and 1 sequences (buckets 4, 8, 1: padding on the scratch slot), the
     sequences' lengths apart and crossing compression windows and the sliding window;
     every step's logits within 1e-4 relative and the same greedy token for every
     sequence; ONE graph per batch bucket whatever the lengths (context bucket = max_len);
  2. the same in bfloat16: the graphed logits' distance from a float32 model's (same
     weights, same tokens) at most 2x the eager bf16 step's own distance + 1e-3;
  3. a replayed step and an eager bf16 decode step of 8 sequences (where the MoE's auto
     form would be grouped, whose bincount reads the host) under torch's sync debug mode
     ``error``;
  4. the attention kernel on a state with fewer entries than ``index_topk`` (it attends
     every entry, as the torch core) equals the torch core, float32;
  5. V4.1 through ``engram_trt.LLM`` (a V4.1 folder made from tests/data/deepseek_v4_tiny
     without transformers: Engram fields, random bf16 tables): graphs on vs off, the same
     greedy tokens, with the rows gathered inside the graph (HBM tables: ``lookup``)
     and staged by the prefetcher's host gather (``host_file_gather``: ``staged``);
     the tiny V4 checkpoint's recorded transformers tokens with graphs on, one graph per
     bucket;
  6. a state larger than the free GPU memory is refused in one line, nothing allocated;
  7. the ~1.6B DeepSeek-V4 shape (``bench e2e``'s ``dsv4``, random weights made by
     transformers 5.25) in float32: transformers' 128 greedy tokens through ``LLM`` with
     decode graphs (needs the transformers package).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from .cases import rel_err

from .helpers import REPO, note, say

DATA = REPO / "tests" / "data" / "deepseek_v4_tiny"
S_, C_, H_ = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
BASE: dict[str, Any] = dict(
    architectures=["DeepseekV4ForCausalLM"],
    model_type="deepseek_v4",
    vocab_size=128,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=32,
    q_lora_rank=32,
    o_groups=2,
    o_lora_rank=16,
    moe_intermediate_size=32,
    n_shared_experts=1,
    index_n_heads=4,
    index_head_dim=16,
    index_topk=4,
    sliding_window=8,
    compress_rates={C_: 4, H_: 8},
    hc_mult=2,
    hc_sinkhorn_iters=3,
    partial_rotary_factor=0.5,
    num_nextn_predict_layers=0,
    max_position_embeddings=512,
    eos_token_id=2,
    bos_token_id=1,
    tie_word_embeddings=False,
)
MIXES: dict[str, dict[str, Any]] = {
    "SCHS-hash1-e8k2": dict(
        num_hidden_layers=4,
        layer_types=[S_, C_, H_, S_],
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        n_routed_experts=8,
        num_experts_per_tok=2,
    ),
    "CC-topk-e6k3": dict(
        num_hidden_layers=2,
        layer_types=[C_, C_],
        mlp_layer_types=["moe", "moe"],
        n_routed_experts=6,
        num_experts_per_tok=3,
        index_topk=2,
    ),
    "HSH-hash2-hc4-sigmoid": dict(
        num_hidden_layers=3,
        layer_types=[H_, S_, H_],
        mlp_layer_types=["hash_moe", "hash_moe", "moe"],
        n_routed_experts=4,
        num_experts_per_tok=2,
        hc_mult=4,
        scoring_func="sigmoid",
    ),
}
MAX_LEN, SLOTS = 128, 8
PROMPT_LENS = [3, 9, 17, 30, 6, 1, 12, 22]  # one per slot: the decode lengths stay apart
PHASES = [(3, 8), (5, 6), (1, 4)]  # (sequences, steps): buckets 4, 8, 1


def _config(mix: str, **overrides: Any) -> Any:
    from engram_trt.models.deepseek_v4.config import read_config

    d = dict(BASE)
    d.update(MIXES[mix])
    d.update(overrides)
    return read_config(d, f"graph test {mix}")


def _model(cfg: Any, weights: dict, dtype: Any) -> Any:
    from engram_trt.models.deepseek_v4.architecture import ARCHITECTURE

    return ARCHITECTURE.build_model(cfg, weights, device="cuda", dtype=dtype)  # cast as the loader casts


def _weights(cfg: Any, seed: int) -> dict:
    import torch

    from engram_trt.bench.dsv4model import random_weights

    return random_weights(cfg, "cuda", torch.float32, seed)  # float32 masters: each model casts as it loads


def _graphs(model: Any, state: Any) -> Any:
    from engram_trt.runtime.cuda_graphs import DecodeGraphs

    return DecodeGraphs(model, state, SLOTS, scratch_slot=SLOTS)


def _prefill(model: Any, states: list, gen: Any) -> list[int]:
    import torch

    from engram_trt.models.step import PackedStep

    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    step = PackedStep(torch.tensor(sum(prompts, [])), PROMPT_LENS, [0] * SLOTS, list(range(SLOTS)))
    for st in states:
        model.forward_step(step, st)
    return list(PROMPT_LENS)


def _schedule(lens: list[int]):
    """Yield (slots, past lens) of each decode step of PHASES (lens advanced in place)."""
    for seqs, steps in PHASES:
        slots = [0, 1, 2] if seqs == 3 else ([3] if seqs == 1 else [4, 5, 6, 7, 0])
        for _ in range(steps):
            yield slots, [lens[s] for s in slots]
            for s in slots:
                lens[s] += 1


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_graphed_decode_equals_eager_fp32(mix: str) -> None:
    import torch

    from engram_trt.models.step import PackedStep

    cfg = _config(mix)
    model = _model(cfg, _weights(cfg, 5), torch.float32)
    eager, graphed = model.new_cache(SLOTS + 1, MAX_LEN), model.new_cache(SLOTS + 1, MAX_LEN)
    gen = torch.Generator().manual_seed(7)
    lens = _prefill(model, [eager, graphed], gen)
    graphs = _graphs(model, graphed)
    toks = {s: int(torch.randint(3, cfg.vocab_size, (1,), generator=gen)) for s in range(SLOTS)}
    worst, same, n = 0.0, True, 0
    for slots, past in _schedule(lens):
        ids = torch.tensor([toks[s] for s in slots])
        want = model.forward_step(PackedStep(ids, [1] * len(slots), past, slots), eager)
        got = graphs.run(PackedStep(ids, [1] * len(slots), past, slots), None)
        assert got is not None, f"{mix}: decode step of {len(slots)} replayed: graphs off: {graphs.failed}"
        err = rel_err(got.float().cpu(), want.float().cpu())
        worst = max(worst, err)
        picks = want.argmax(-1).tolist()
        same = same and got.argmax(-1).tolist() == picks
        for s, t in zip(slots, picks):
            toks[s] = t
        n += 1
    note(f"graph_vs_eager_fp32_{mix}", worst)
    assert worst <= 1e-4, (
        f"{mix}: fp32 graphed logits within 1e-4 of eager over {n} decode steps: worst rel L2 {worst:.2e}"
    )
    assert same, f"{mix}: fp32 graphed greedy tokens equal eager's, every step"
    keys = sorted(graphs.graphs)
    assert keys == [(1, MAX_LEN, "none"), (4, MAX_LEN, "none"), (8, MAX_LEN, "none")], (
        f"{mix}: one graph per batch bucket whatever the lengths: graphs {keys}, replays {graphs.replays}, captures "
        f"{graphs.captures}"
    )
    assert graphs.replays == n and graphs.failed is None, (
        f"{mix}: every decode step replayed: {graphs.replays} / {n}; failed: {graphs.failed}"
    )
    assert graphed.lengths == eager.lengths, (
        f"{mix}: graphed and eager slots hold the same lengths: {graphed.lengths} vs {eager.lengths}"
    )


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_graphed_decode_bf16_within_round_off(mix: str) -> None:
    import torch

    from engram_trt.models.step import PackedStep

    cfg = _config(mix)
    weights = _weights(cfg, 9)
    ref = _model(cfg, weights, torch.float32)
    model = _model(cfg, weights, torch.bfloat16)
    ref_state = ref.new_cache(SLOTS + 1, MAX_LEN)
    eager, graphed = model.new_cache(SLOTS + 1, MAX_LEN), model.new_cache(SLOTS + 1, MAX_LEN)
    gen = torch.Generator().manual_seed(8)
    lens = _prefill(ref, [ref_state], gen)
    _prefill(model, [eager, graphed], torch.Generator().manual_seed(8))
    graphs = _graphs(model, graphed)
    toks = {s: int(torch.randint(3, cfg.vocab_size, (1,), generator=gen)) for s in range(SLOTS)}
    bad: list[str] = []
    agree = total = 0
    for k, (slots, past) in enumerate(_schedule(lens)):
        ids = torch.tensor([toks[s] for s in slots])
        mk = lambda: PackedStep(ids, [1] * len(slots), past, slots)  # noqa: E731
        want = ref.forward_step(mk(), ref_state).cpu()
        e = model.forward_step(mk(), eager).float().cpu()
        g = graphs.run(mk(), None)
        assert g is not None, f"{mix}: bf16 decode step replayed: graphs off: {graphs.failed}"
        g = g.float().cpu()
        e_err, g_err = rel_err(e, want), rel_err(g, want)
        if not (torch.isfinite(g).all() and g_err <= 2 * e_err + 1e-3):
            bad.append(f"step {k}: graphed {g_err:.2e} vs eager {e_err:.2e}")
        agree += int((g.argmax(-1) == e.argmax(-1)).sum())
        total += len(slots)
        picks = want.argmax(-1).tolist()
        for s, t in zip(slots, picks):
            toks[s] = t
    note(f"bf16_greedy_agreement_{mix}", agree / max(total, 1))
    assert not bad, (
        f"{mix}: bf16 graphed logits' distance from fp32 at most 2x eager bf16's + 1e-3, every step: "
        + "; ".join(bad[:4])
    )


def test_replay_and_bf16_eager_decode_under_sync_debug_error() -> None:
    import torch

    from engram_trt.models.step import PackedStep

    cfg = _config("SCHS-hash1-e8k2")
    model = _model(cfg, _weights(cfg, 11), torch.bfloat16)
    eager, graphed = model.new_cache(SLOTS + 1, MAX_LEN), model.new_cache(SLOTS + 1, MAX_LEN)
    gen = torch.Generator().manual_seed(3)
    lens = _prefill(model, [eager, graphed], gen)
    graphs = _graphs(model, graphed)
    slots = list(range(8))
    step = lambda ids, past: PackedStep(ids, [1] * 8, past, slots)  # noqa: E731
    ids = torch.randint(3, cfg.vocab_size, (8,), generator=gen)
    first = graphs.run(step(ids, lens), None)  # records bucket 8, outside the debug mode
    model.forward_step(step(ids, lens), eager)  # the eager twin's first step, same tokens
    torch.cuda.synchronize()
    lens = [n + 1 for n in lens]
    ids = torch.randint(3, cfg.vocab_size, (8,), generator=gen)
    errs = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for what, fn in (
            ("replay", lambda: graphs.run(step(ids, lens), None)),
            ("eager", lambda: model.forward_step(step(ids, lens), eager)),
        ):
            try:
                fn()
            except RuntimeError as exc:
                errs.append(f"{what}: {str(exc).splitlines()[0]}")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    forms = sorted({layer.mlp.last_form for layer in model.model.layers})
    auto = model.model.layers[1].mlp.choose_form(
        torch.empty(8, cfg.hidden_size, device="cuda", dtype=torch.bfloat16),
        torch.empty(8, 2, dtype=torch.int64, device="cuda"),
    )
    assert first is not None and not errs and graphs.replays == 2, (
        "a replayed decode step and an eager bf16 decode step of 8 run under sync debug mode 'error': "
        f"{'; '.join(errs) or 'no synchronizing call'}; MoE forms taken {forms}, the module's auto alone: {auto}; "
        f"replays {graphs.replays}; graphs failed: {graphs.failed}"
    )


def test_kernel_takes_a_state_shorter_than_index_topk() -> None:
    import torch

    from engram_trt.models.step import PackedStep

    cfg = _config("CC-topk-e6k3", index_topk=6)
    model = _model(cfg, _weights(cfg, 13), torch.float32)
    max_len = 20  # 5 entries of rate 4 < index_topk 6
    outs = {}
    for backend in ("torch", "kernels"):
        model.attention_backend = backend
        state = model.new_cache(2, max_len)
        got = [model.forward_step(PackedStep(torch.arange(3, 17), [9, 5], [0, 0], [1, 0]), state, all_logits=True)]
        for k in range(5):
            got.append(
                model.forward_step(PackedStep(torch.tensor([20 + k, 40 + k]), [1, 1], [9 + k, 5 + k], [1, 0]), state)
            )
        outs[backend] = [g.float().cpu() for g in got]
    model.attention_backend = "auto"
    errs = [rel_err(a, b) for a, b in zip(outs["kernels"], outs["torch"])]
    assert max(errs) <= 1e-4, (
        f"attention kernel with fewer state entries than index_topk equals the torch core (fp32, 1e-4): rel L2 per "
        f"step {[f'{e:.1e}' for e in errs]}"
    )


# -- 5. through the runtime ------------------------------------------------------------------


def _v41_folder(root: Path) -> Path:
    """tests/data/deepseek_v4_tiny turned V4.1 (as tests/helpers/deepseek_v4.save_v41 does,
    without transformers): Engram on layers 0 and 2, random bf16 tables, wkv, q / k weights."""
    import torch
    from safetensors.torch import load_file, save_file

    from engram_trt.engram.layout import EngramLayout
    from engram_trt.models.deepseek_v4.config import read_config

    folder = root / "v41"
    shutil.copytree(DATA, folder)
    (folder / "expected.json").unlink()
    d = json.loads((folder / "config.json").read_text())
    d.update(
        architectures=["DeepseekV41ForCausalLM"],
        model_type="deepseek_v41",
        engram_layer_ids=[0, 2],
        engram_max_ngram_size=3,
        engram_n_heads=2,
        engram_head_dim=8,
        engram_vocab_size=37,
        engram_compressed_vocab_size=96,
        engram_pad_token_id=0,
        engram_table_dtype="bf16",
    )
    (folder / "config.json").write_text(json.dumps(d))
    cfg = read_config(d)
    layout = EngramLayout.from_spec(cfg.engram, pad_id=0)
    tensors = load_file(str(folder / "model.safetensors"))
    gen = torch.Generator().manual_seed(41)
    for li, lid in enumerate(cfg.engram.layer_ids):
        base = f"model.layers.{lid}.engram"
        tensors[f"{base}.embed.weight"] = torch.randn(int(layout.table_rows[li]), 8, generator=gen).to(torch.bfloat16)
        tensors[f"{base}.wkv.weight"] = torch.randn(3 * 32, layout.n_hash_cols * 8, generator=gen) * 0.3
        tensors[f"{base}.q_weight"] = torch.randn(2, 32, generator=gen)
        tensors[f"{base}.k_weight"] = torch.randn(2, 32, generator=gen)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def _llm_tokens(folder: Path, prompts: list, n: int, graphs: bool, engram_config: Any = None) -> tuple[list, dict, str]:
    from engram_trt import LLM, SamplingParams

    with LLM(
        str(folder),
        backend="torch",
        device="cuda",
        dtype="fp32",
        cuda_graphs=graphs,
        max_batch_size=4,
        engram_config=engram_config,
    ) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        info = {**llm.runner.graph_capture(), "chained_steps": llm.stats()["chained_steps"]}
        label = llm.runner.backend.label
    return [list(o.outputs[0].token_ids) for o in outs], info, label


V41_PROMPTS = [[5, 17, 33, 2, 90, 0, 7], [2, 2, 3, 44, 8], [60, 61, 2, 62, 0, 0, 9, 10, 11]]


@pytest.mark.parametrize("tables,mode", [("device", "lookup"), ("file", "staged")])
def test_v41_llm_graphs_equal_eager(tmp_path: Path, tables: str, mode: str) -> None:
    folder = _v41_folder(tmp_path)
    # HBM tables: the hash and gather kernels inside the graph; file tables: the prefetcher's host gather
    ecfg = {"host_file_gather": True} if tables == "file" else {"cpu_offload": False}
    want, _, _ = _llm_tokens(folder, V41_PROMPTS, 12, False, ecfg)
    got, info, label = _llm_tokens(folder, V41_PROMPTS, 12, True, ecfg)
    shapes = info.get("graph_shapes", [])
    assert got == want, f"V4.1 ({tables} tables): graphed greedy tokens equal eager's: {got} vs {want}"
    assert "decode in CUDA graphs" in label and shapes and all(s.endswith(f":{mode}") for s in shapes), (
        f"V4.1 ({tables} tables): decode steps replayed with the rows {mode}: label {label!r}; graph shapes {shapes}"
    )


@pytest.mark.parametrize("tables,queued", [("device", True), ("file", False)])
def test_v41_llm_overlapped_graph_steps_equal_the_serial_loop(
    tmp_path: Path, monkeypatch: Any, tables: str, queued: bool
) -> None:
    """The scheduler's overlap with Engram rows: HBM tables (hashed and gathered inside the
    graph) take the queued step, the token's compressed id gathered on the device and the
    lookback made on the host; file tables (the prefetcher hashes on the host) do not.
    Both give the serial loop's tokens."""
    folder = _v41_folder(tmp_path)
    ecfg = {"host_file_gather": True} if tables == "file" else {"cpu_offload": False}
    runs = {}
    for overlap in ("1", "0"):
        monkeypatch.setenv("ENGRAM_TRT_OVERLAP", overlap)
        tokens, info, _ = _llm_tokens(folder, V41_PROMPTS, 12, True, ecfg)
        runs[overlap] = tokens, info["chained_steps"]
    (got, chained), (want, _) = runs["1"], runs["0"]
    assert got == want, f"V4.1 ({tables} tables): overlapped greedy tokens equal the serial loop's: {got} vs {want}"
    assert (chained >= 8) if queued else (chained == 0), (
        f"V4.1 ({tables} tables): {chained} decode steps queued ahead (want {'>= 8' if queued else 'none'})"
    )


def test_v4_llm_graphs_give_the_recorded_tokens() -> None:
    expected = json.loads((DATA / "expected.json").read_text())
    got, info, label = _llm_tokens(DATA, expected["prompts"], expected["new_tokens"], True)
    assert got == expected["greedy"], (
        f"V4 tiny through LLM with decode graphs: transformers' recorded greedy tokens: {got}"
    )
    shapes = info.get("graph_shapes", [])
    assert "decode in CUDA graphs" in label and shapes and len({s.split("x")[0] for s in shapes}) == len(shapes), (
        f"V4 tiny: graphs recorded, one per batch bucket (context = max_seq_len): label {label!r}; graph shapes "
        f"{shapes}"
    )


def test_v4_llm_overlapped_graph_steps_give_the_recorded_tokens(monkeypatch: Any) -> None:
    """The scheduler's overlap on the GPU (runtime/scheduler.py: a greedy decode step queued
    before the last one's tokens are read, its ids copied from the last argmax into the
    graph's buffer on the device): transformers' recorded tokens, most decode steps queued
    ahead; a sequence stopped by a stop id under a queued step ends there, and a waiting
    request that takes its slot (max_batch_size 2) gives the tokens it gives with the overlap off."""
    from engram_trt import LLM, SamplingParams

    expected = json.loads((DATA / "expected.json").read_text())
    prompts, n, want = expected["prompts"], expected["new_tokens"], expected["greedy"]
    greedy = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    k = next(k for k in range(2, n - 2) if want[1][k] not in want[1][:k])  # a stop id first produced at k
    stop = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, stop_token_ids=(want[1][k],))
    runs = {}
    for overlap in ("1", "0"):
        monkeypatch.setenv("ENGRAM_TRT_OVERLAP", overlap)
        with LLM(str(DATA), backend="torch", device="cuda", dtype="fp32", max_batch_size=len(prompts)) as llm:
            plain = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy)]
            chained = llm.stats()["chained_steps"]
        with LLM(str(DATA), backend="torch", device="cuda", dtype="fp32", max_batch_size=2) as llm:
            outs = llm.generate([prompts[1], prompts[0], prompts[1]], [stop, greedy, greedy])
            st = llm.stats()
            handover = [list(o.outputs[0].token_ids) for o in outs], (st["chained_steps"], st["chained_stopped_rows"])
        runs[overlap] = plain, chained, handover
    (plain, chained, (handed, chained2)), (_, off_chained, (handed_off, _)) = runs["1"], runs["0"]
    assert plain == want, f"V4 tiny, overlapped graph steps: transformers' recorded greedy tokens: {plain}"
    assert chained >= n - 4 and off_chained == 0, (
        f"decode steps queued before the last one's tokens were read: {chained} of {n - 1} (overlap off: {off_chained})"
    )
    assert handed == handed_off == [want[1][: k + 1], want[0], want[1]] and chained2[0] > 0 and chained2[1] == 1, (
        f"a stop under a queued step and its slot handed over: {handed} (overlap off {handed_off}, want "
        f"{[want[1][: k + 1], want[0], want[1]]}); (steps queued ahead, stopped rows in them) {chained2}"
    )


def test_state_larger_than_free_memory_is_refused() -> None:
    import torch

    from engram_trt.errors import EngramError
    from engram_trt.models.deepseek_v4.state import DeepseekV4State, state_bytes

    cfg = _config("SCHS-hash1-e8k2")
    free, _ = torch.cuda.mem_get_info()
    per_slot = state_bytes(cfg, 1, 4096, torch.bfloat16)
    slots = free // per_slot + 16
    before = torch.cuda.memory_allocated()
    try:
        DeepseekV4State.allocate(cfg, int(slots), 4096, "cuda", torch.bfloat16)
        msg = ""
    except EngramError as exc:
        msg = str(exc)
    assert "bytes" in msg and "\n" not in msg and torch.cuda.memory_allocated() == before, (
        "a state larger than the free GPU memory is refused in one line, nothing allocated: " + (msg or "not refused")
    )


# -- the breakdown of a graphed decode step (bench e2e --breakdown) ---------------------------


@pytest.mark.parametrize("which", ["deepseek_v4_tiny", "qwen4_exp_tiny"])
def test_breakdown_times_every_module_kind_inside_the_graph(which: str) -> None:
    from engram_trt.bench.breakdown import decode_breakdown

    folder = REPO / "tests" / "data" / which
    cfg = json.loads((folder / "config.json").read_text())
    n = cfg["num_hidden_layers"]
    b = decode_breakdown(folder, device="cuda", dtype="bf16", prompt_tokens=8, reps=3)
    if which == "deepseek_v4_tiny":
        import os

        from engram_trt.models.deepseek_v4.modules import MHC_FOLD_ENV

        types = cfg["layer_types"]
        # the mHC fold (default): each sublayer's expansion runs with the next collapse
        # (mhc.post+pre+norm), the last one with the head's; without it 2n expansions
        # and 2n collapses of their own
        fold = os.environ.get(MHC_FOLD_ENV, "1") != "0"
        mhc = {"mhc.pre+norm": 1, "mhc.post+pre+norm": 2 * n - 1}
        if not fold:
            mhc = {"mhc.pre+norm": 2 * n, "mhc.post": 2 * n}
        want = {
            "embed": 1,
            "head": 1,
            **mhc,
            "moe": n,
            "attention.csa": types.count(C_),
            "attention.hca": types.count(H_),
        }
    else:
        types = cfg["layer_types"]
        want = {
            "meta": 1,
            "embed": 1,
            "hc.mix": 2 * n,
            "hc.inject": 2 * n,
            "moe": n,
            "head.mix": 1,
            "attention.gdn": types.count("linear_attention"),
            "ple": len(cfg["ple_layer_ids"]),
            "attention.qsa": n - types.count("linear_attention"),
        }
    kinds = b.get("kinds", {})
    calls = {k: v["calls"] for k, v in kinds.items() if k != "other" and k != "ple.lookup"}
    named = sum(v["ms"] for k, v in kinds.items() if k != "other")
    assert b.get("mode") == "graph" and calls == want, (
        f"{which}: breakdown recorded inside the decode graph, every module kind's calls: mode {b.get('mode')}; calls "
        f"{calls}; want {want}"
    )
    assert b.get("span_ms", 0) > 0 and named <= 1.01 * b["span_ms"] and b["span_ms"] <= 1.01 * b["step_ms"], (
        f"{which}: the kinds add up to the step's span, which the replay's own span holds: kinds {named:.4f} ms, span "
        f"{b.get('span_ms')}, replay {b.get('step_ms')}"
    )


@pytest.mark.parametrize("which", ["deepseek_v4_tiny", "qwen4_exp_tiny"])
def test_kernel_profile_records_the_graphs_kernels(which: str) -> None:
    """bench e2e --breakdown-kernels: CUPTI's records of the replayed step's kernels, each
    step's work inside the CUDA-event span around its call."""
    from engram_trt.bench.breakdown import decode_kernel_profile, format_kernel_profile

    folder = REPO / "tests" / "data" / which
    n = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    p = decode_kernel_profile(folder, device="cuda", dtype="bf16", prompt_tokens=8, reps=3)
    say("\n".join(format_kernel_profile(p)))
    calls = sum(k["calls"] for k in p.get("kernels", {}).values())
    assert p.get("mode") == "graph" and p.get("steps") == 3 and calls >= n, (
        f"{which}: the profile of 3 replayed steps records each step's kernels (at least one a layer, {n}): mode "
        f"{p.get('mode')}, {calls} records a step; {p.get('skipped', '')}"
    )
    assert 0 < p["busy_ms"] and 0 < p["span_ms"] <= 1.02 * p["step_ms"] + 0.005, (
        f"{which}: the kernels run inside the step's CUDA-event span: busy {p['busy_ms']:.4f} ms, span "
        f"{p['span_ms']:.4f} ms, step {p['step_ms']:.4f} ms"
    )
    many = decode_kernel_profile(folder, device="cuda", dtype="bf16", prompt_tokens=8, reps=3, seqs=12)
    say("\n".join(format_kernel_profile(many)))
    assert many.get("mode") == "graph" and many.get("sequences") == 12 and many["busy_ms"] > 0, (
        f"{which}: a step of 12 sequences (bench e2e --breakdown-streams 12) replayed and profiled: mode "
        f"{many.get('mode')}; {many.get('skipped', '')}"
    )


# -- 7. the ~1.6B shape against transformers, float32 ------------------------------------------


def test_dsv4_1p6b_fp32_greedy_128_equals_transformers(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="transformers is not installed (the test extra)")
    import torch

    from engram_trt import LLM, SamplingParams
    from engram_trt.bench.e2e import make_checkpoint

    folder = tmp_path / "dsv4"
    hf = make_checkpoint("dsv4", folder, device="cuda", dtype="fp32", keep_model=True)  # random weights, saved
    prompt = [(17 * i + 5) % 1000 + 3 for i in range(32)]
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt], device="cuda"),
            max_new_tokens=128,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            use_cache=True,
        )
    want = out[0, len(prompt) :].tolist()
    del hf, out
    torch.cuda.empty_cache()
    with LLM(str(folder), backend="torch", device="cuda", dtype="fp32") as llm:
        got = list(
            llm.generate([prompt], SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True))[0]
            .outputs[0]
            .token_ids
        )
        label = llm.runner.backend.label
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    say(f"1.6B fp32: backend {label}; first difference at {first}")
    assert got == want, (
        "~1.6B DeepSeek-V4 fp32 on CUDA: transformers' 128 greedy tokens (decode graphs): "
        f"first difference at token {first}: ours {got[first : first + 4] if first is not None else ''} vs "
        f"{want[first : first + 4] if first is not None else ''}; backend {label}"
    )
