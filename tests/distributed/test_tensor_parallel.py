"""``--tp N`` shards every family's backbone (issue 42), on CPU ranks over gloo, through
the launcher (``run_replicas`` / ``spawn``: real processes).

Folders: tiny random checkpoints transformers 5.25 builds and saves (engram-llama as a
plain Llama, DeepSeek-V4, Qwen4Exp with PLE and QSA), transformers' own FP8 save of a
Llama, DeepSeek-V4 as the hub ships it (FP8 linears with ue8m0 128x128 scales, FP4
routed experts), and a DeepSeek-V4.1 (Engram tables, our float path as its reference:
transformers has no V4.1). Oracles:

* greedy tokens of every folder at ``--tp 2`` (and ``--tp 4`` where the heads and
  experts divide by 4) equal transformers' ``generate`` on two prompts (V4.1: one
  process's ``LLM``);
* the weight bytes each rank holds (its model's parameters and buffers, measured in the
  rank) are at most ``1/N`` of the sharded tensors plus the replicated ones, and equal to
  it where every split is exact; the test classifies the checkpoint's tensors itself
  (attention / MLP / expert / vocabulary tensors sharded, norms, routers, mHC, PLE and
  the like replicated) and sizes them as the rank holds them (float weights in float32,
  quantized ones as stored with their scales, integer tables as int64);
* a rank's slice as :class:`~engram_trt.models.parallel.ShardedCheckpoint` reads it equals
  the slice of the whole tensor, scales cut at the block boundaries, experts renumbered;
* refusals in one line, exit 2, before any rank starts: ``--tp`` not dividing the heads
  or the experts, an FP8 shard that would cut a scale block; a rank that dies mid-step
  ends the run within a timeout with one line naming it;
* ``engram_trt.LLM(path, tp=2)`` leads its own group (follower processes) and gives the
  same tokens; the GPU-size check says how many GPUs a model needs at a TP.

Each world size is spawned once (torch's import is most of a rank's start on two cores)
and runs every job of its size.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from helpers.checkpoints import transformers_fp8_save, transformers_greedy, without_stale_scales, word_tokenizer  # noqa: E402
from helpers.qwen4_exp import QWEN_TP4  # noqa: E402

NEW = 6  # greedy tokens per prompt
TIMEOUT_S = 180.0


# ------------------------------------------------------------------------------ the folders
class Folder:
    """One checkpoint, its prompts and its reference tokens; ``family`` selects the
    test's own classification of its tensors (:func:`expected_bytes`)."""

    def __init__(
        self, name: str, family: str, path: Path, prompts: list[list[int]], want: list[list[int]], sizes: dict[str, int]
    ) -> None:
        self.name, self.family, self.path, self.prompts = name, family, path, prompts
        self.want, self.sizes = want, sizes


def _llama(root: Path) -> Folder:
    import helpers.llama as lp

    model = lp.save_llama(root / "llama", seed=11)
    prompts = lp.PROMPTS[:2]
    return Folder(
        "llama",
        "llama",
        root / "llama",
        prompts,
        [transformers_greedy(model, p, NEW) for p in prompts],
        {"kv": lp.BASE["num_key_value_heads"]},
    )


DS_TP4 = dict(o_groups=4, index_n_heads=4, n_routed_experts=8)  # heads 4, groups 4, indexer heads 4, experts 8


def _deepseek(root: Path) -> Folder:
    import helpers.deepseek_v4 as dp

    model = dp.save_v4(root / "dsv4", seed=12, **DS_TP4)
    prompts = dp.PROMPTS[:2]
    return Folder(
        "deepseek-v4", "deepseek", root / "dsv4", prompts, [transformers_greedy(model, p, NEW) for p in prompts], {}
    )


def _qwen(root: Path) -> Folder:
    import helpers.qwen4_exp as qp

    kw = dict(qp.CASES["hc2-ple1-qsa"], **QWEN_TP4)
    model = qp.save_qwen4(root / "qwen", seed=13, **kw)
    prompts = qp.PROMPTS[:2]
    return Folder(
        "qwen4-exp",
        "qwen",
        root / "qwen",
        prompts,
        [transformers_greedy(model, p, NEW) for p in prompts],
        {"kv": qp.BASE["num_key_value_heads"], "linear_k": qp.BASE["linear_num_key_heads"]},
    )


def _llama_fp8(root: Path) -> Folder:
    """transformers' own FP8 save; 4 key heads of 64 and an MLP of 512: at --tp 2 every
    shard holds whole 128-row / 128-column blocks."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import helpers.llama_fp8 as lf

    torch.manual_seed(14)
    cfg = dict(lf.BASE, num_key_value_heads=4, intermediate_size=512)
    LlamaForCausalLM(LlamaConfig(**cfg)).save_pretrained(root / "fp8-float")
    word_tokenizer(root / "fp8-float" / "tokenizer.json", lf.VOCAB)
    folder = transformers_fp8_save(LlamaForCausalLM, root / "fp8-float", root / "fp8", weight_block_size=[128, 128])
    ref = LlamaForCausalLM.from_pretrained(
        without_stale_scales(folder, root / "fp8-ref"), dtype=torch.float32, use_kernels=False
    ).eval()
    prompts = lf.PROMPTS[:2]
    return Folder("llama-fp8", "llama", folder, prompts, [transformers_greedy(ref, p, NEW) for p in prompts], {"kv": 4})


def _deepseek_quant(root: Path) -> Folder:
    """The hub layout (FP8 linears, FP4 experts, root names): 2 heads of 128, indexer
    heads 4 x 64, output groups of 128, a shared expert of 256: whole blocks at --tp 2."""
    import helpers.deepseek_v4_quant as dq

    over, _v41, _partial = dq.CASES["v4-256-hc4-hash2"]
    dq.save_float_v4(root / "dsq-float", seed=15, **dict(over, moe_intermediate_size=256))
    dq.quantize_folder(root / "dsq-float", root / "dsq")
    hf = dq.hf_load(root / "dsq")
    prompts = dq.PROMPTS[:2]
    return Folder(
        "deepseek-v4-fp8-fp4", "deepseek", root / "dsq", prompts, [transformers_greedy(hf, p, NEW) for p in prompts], {}
    )


def _deepseek_v41(root: Path) -> Folder:
    import helpers.deepseek_v4 as dp

    from helpers.checkpoints import llm_greedy

    gen = torch.Generator().manual_seed(16)
    dp.save_v41(root / "dsv41", lambda rows, width: torch.randn(rows, width, generator=gen), seed=16)
    prompts = dp.PROMPTS[:2]
    return Folder("deepseek-v4.1", "deepseek", root / "dsv41", prompts, llm_greedy(root / "dsv41", prompts, NEW), {})


@pytest.fixture(scope="module")
def folders(tmp_path_factory: Any) -> dict[str, Folder]:
    root = tmp_path_factory.mktemp("tp")
    made = [_llama(root), _deepseek(root), _qwen(root), _llama_fp8(root), _deepseek_quant(root), _deepseek_v41(root)]
    return {f.name: f for f in made}


def _job(f: Folder, tp: int, dp: int = 1) -> Any:
    from engram_trt.distributed.launch import ReplicaJob
    from engram_trt.runtime.sampling_params import SamplingParams

    return ReplicaJob(
        str(f.path),
        tp,
        dp,
        f.prompts,
        SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True),
        None,
        {"backend": "torch", "dtype": "fp32", "progress": False},
        time_collectives=True,
    )


TP2 = ["llama", "deepseek-v4", "qwen4-exp", "llama-fp8", "deepseek-v4-fp8-fp4", "deepseek-v4.1"]
TP4 = ["llama", "deepseek-v4", "qwen4-exp"]


@pytest.fixture(scope="module")
def served(folders: dict[str, Folder]) -> dict[tuple[str, int], Any]:
    """Every job, each world size spawned once."""
    from engram_trt.distributed.checks import replica_jobs
    from engram_trt.distributed.launch import spawn

    out = {}
    for tp, names in ((2, TP2), (4, TP4)):
        jobs = [_job(folders[n], tp) for n in names]
        if tp == 4:  # and two replicas of --tp 2 on the same four ranks (a prompt each)
            jobs.append(_job(folders["qwen4-exp"], 2, 2))
        results = spawn(tp, replica_jobs, jobs, device_kind="cpu", timeout_s=TIMEOUT_S)
        out.update({(n, tp): r for n, r in zip(names, results)})
        if tp == 4:
            out[("qwen4-exp", "2x2")] = results[-1]
    return out


# ------------------------------------------------------------------------------ the bytes
def _held(st: str, shape: list[int]) -> int:
    """Bytes a rank holds of a whole stored tensor at fp32: quantized weights and scales as
    stored, integer tables as int64, float tensors in float32."""
    n = math.prod(shape)
    if st in ("F8_E4M3", "F8_E8M0", "I8", "U8"):
        return n
    if st in ("I32", "I64"):
        return 8 * n
    return 4 * n


SHARDED = {
    "llama": re.compile(r"self_attn\.(q|o)_proj\.|mlp\.(gate|up|down)_proj\.|^(model\.embed_tokens|lm_head)\."),
    "deepseek": re.compile(
        r"attn\.(wq_b|wo_a|wo_b)\.|attn\.attn_sink$|indexer\.(wq_b|weights_proj)\.|"
        r"ffn\.(experts\.\d+|shared_experts)\.|(^|\.)(embed|embed_tokens|head)\.weight$"
    ),
    "qwen": re.compile(
        r"self_attn\.(q|o)_proj\.|linear_attn\.(in_proj_[zab]|out_proj)\.|linear_attn\.(dt_bias|A_log)$|"
        r"mlp\.(experts\.|shared_expert\.)|embed_tokens\.|^lm_head\."
    ),
}
# key heads: sharded when --tp divides them, else held by several ranks (counted replicated)
KEY_HEADS = {
    "llama": re.compile(r"self_attn\.[kv]_proj\."),
    "qwen": re.compile(r"self_attn\.[kv]_proj\.|linear_attn\.(in_proj_qkv|conv1d)\."),
}
# held in part (the indexer's query heads split, its key head whole): counted replicated
PARTIAL = {"qwen": re.compile(r"indexer\.index_qk_proj\.")}


def expected_bytes(f: Folder, tp: int) -> tuple[int, int, bool]:
    """``(sharded bytes, replicated bytes, exact)`` of the weights the folder's model reads
    (module docstring); ``exact``: no tensor counted replicated that a rank holds only part of."""
    from safetensors import safe_open

    from engram_trt.models.registry import open_checkpoint

    ckpt = open_checkpoint(f.path, allow_unused=True)
    weights = set(ckpt.architecture.weight_formats(ckpt))
    ckpt.close()
    headers: dict[str, tuple[str, list[int]]] = {}
    for file in sorted(f.path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as h:
            headers.update({k: (h.get_slice(k).get_dtype(), h.get_slice(k).get_shape()) for k in h.keys()})
    sharded = replicated = 0
    exact = True
    for name, (st, shape) in headers.items():
        base = re.sub(r"\.(weight_scale_inv|scale)$", ".weight", name)
        if base not in weights or (base != name and headers[base][0] not in ("F8_E4M3", "I8", "U8")):
            continue  # not a weight the model reads (tables, mtp.*, a stale scale beside a float weight)
        held = _held(st, shape)
        key, partial = KEY_HEADS.get(f.family), PARTIAL.get(f.family)
        if SHARDED[f.family].search(base):
            sharded += held
        elif key is not None and key.search(base):
            heads = f.sizes["kv"] if "self_attn" in base else f.sizes["linear_k"]
            if heads % tp == 0:
                sharded += held
            else:
                replicated += held
                exact = False
        else:
            replicated += held
            exact = exact and not (partial is not None and partial.search(base))
    return sharded, replicated, exact


# ------------------------------------------------------------------------------ the tests
@pytest.mark.parametrize("name,tp", [(n, 2) for n in TP2] + [(n, 4) for n in TP4])
def test_tokens_equal_transformers_and_each_rank_holds_its_share(folders, served, name: str, tp: int) -> None:
    f, res = folders[name], served[(name, tp)]
    assert [o.error for o in res["outputs"]] == [None] * len(f.prompts)
    assert [o.token_ids for o in res["outputs"]] == f.want, f"{name} at --tp {tp}"
    ranks = res["ranks"]
    assert [r["tp_rank"] for r in ranks] == list(range(tp)) and all("torch" in r["backend"] for r in ranks)
    assert ranks[1]["stats"]["follower_steps"] == ranks[0]["stats"]["steps"] > 0
    per_rank = res["weights"]["bytes_per_rank"]
    assert per_rank == [r["weight_bytes"] for r in ranks]
    sharded, replicated, exact = expected_bytes(f, tp)
    assert sharded > 0 and replicated > 0
    bound = sharded // tp + replicated
    for rank, got in enumerate(per_rank):
        if exact:
            assert got == bound, f"rank {rank} holds {got} bytes, not 1/{tp} of {sharded} sharded + {replicated}"
        else:
            assert sharded // tp < got <= bound, f"rank {rank}: {got} bytes, above 1/{tp} of {sharded} + {replicated}"
    assert max(per_rank) < sharded + replicated == res["weights"]["total_bytes"]


def test_two_replicas_of_two_ranks(folders, served) -> None:
    """--tp 2 --dp 2: each replica's TP group on its own process group, a prompt each."""
    f, res = folders["qwen4-exp"], served[("qwen4-exp", "2x2")]
    assert [o.error for o in res["outputs"]] == [None, None]
    assert [o.token_ids for o in res["outputs"]] == f.want
    assert [(r["dp_rank"], r["tp_rank"]) for r in res["ranks"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert res["weights"]["bytes_per_rank"][:2] == res["weights"]["bytes_per_rank"][2:]


# per step: one all-reduce after each attention block and each MLP / MoE block, one for the
# vocab-parallel embedding; one all-gather of the head's logits, and per indexed layer its
# indexer's queries (DeepSeek's CSA layers: queries and head weights)
COLLECTIVES = {
    "llama": lambda c: (2 * c["num_hidden_layers"] + 1, 1),
    "deepseek-v4": lambda c: (
        2 * c["num_hidden_layers"] + 1,
        1 + 2 * c["layer_types"].count("compressed_sparse_attention"),
    ),
    "qwen4-exp": lambda c: (2 * c["num_hidden_layers"] + 1, 1 + sum(t != "linear_attention" for t in c["layer_types"])),
}


@pytest.mark.parametrize("name", sorted(COLLECTIVES))
def test_one_all_reduce_per_block(folders, served, name: str) -> None:
    """The collectives each rank's model ran, counted as they ran, per step: what the
    config's layers give (the launcher's CollectiveClock around the rank's group)."""
    res = served[(name, 2)]
    config = json.loads((folders[name].path / "config.json").read_text())
    reduces, gathers = COLLECTIVES[name](config)
    for r in res["ranks"]:
        steps = r["stats"]["steps"]
        assert steps > NEW - 1
        assert r["collectives"]["all_reduce"]["calls"] == reduces * steps, (name, r["rank"])
        assert r["collectives"]["all_gather"]["calls"] == gathers * steps, (name, r["rank"])


def test_rank_slices_as_the_checkpoint_stores_them(folders) -> None:
    """The view a rank loads from: row and column slices of the whole tensors, FP8 block
    scales cut with them, FP4 experts renumbered from the rank's first."""
    from safetensors import safe_open

    from engram_trt.models.parallel import ShardedCheckpoint
    from engram_trt.models.registry import open_checkpoint

    def whole(path: Path, name: str) -> torch.Tensor:
        with safe_open(str(next(path.glob("*.safetensors"))), "pt") as h:
            return h.get_tensor(name)

    f = folders["llama-fp8"]
    ckpt = open_checkpoint(f.path)
    view = ShardedCheckpoint(ckpt, ckpt.architecture.parallel_plan(ckpt.config, 2, 1))
    q, o = "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.o_proj"
    assert ckpt.st_dtype(q + ".weight") == "F8_E4M3" and view.shape(q + ".weight") == (128, 256)
    assert torch.equal(view.get(q + ".weight").view(torch.uint8), whole(f.path, q + ".weight")[128:].view(torch.uint8))
    assert torch.equal(view.get(q + ".weight_scale_inv"), whole(f.path, q + ".weight_scale_inv")[1:])
    u8 = torch.uint8
    assert torch.equal(view.get(o + ".weight").view(u8), whole(f.path, o + ".weight")[:, 128:].view(u8))
    assert torch.equal(view.get(o + ".weight_scale_inv"), whole(f.path, o + ".weight_scale_inv")[:, 1:])
    assert torch.equal(view.get("model.embed_tokens.weight"), whole(f.path, "model.embed_tokens.weight")[128:])
    ckpt.close()

    f = folders["deepseek-v4-fp8-fp4"]
    ckpt = open_checkpoint(f.path)
    view = ShardedCheckpoint(ckpt, ckpt.architecture.parallel_plan(ckpt.config, 2, 1))
    experts = ckpt.config.n_routed_experts
    found = (re.search(r"layers\.0\.ffn\.experts\.(\d+)\.", n) for n in view.tensor_names())
    local = sorted({int(m.group(1)) for m in found if m})
    assert local == list(range(experts // 2))
    w1 = "layers.0.ffn.experts.0.w1"
    src = f"layers.0.ffn.experts.{experts // 2}.w1"
    assert view.st_dtype(w1 + ".weight") == "I8"
    assert torch.equal(view.get(w1 + ".weight"), whole(f.path, src + ".weight"))
    assert torch.equal(view.get(w1 + ".scale").view(torch.uint8), whole(f.path, src + ".scale").view(torch.uint8))
    wo_b = "layers.1.attn.wo_b"
    assert torch.equal(view.get(wo_b + ".scale").view(u8), whole(f.path, wo_b + ".scale")[:, 1:].view(u8))
    ckpt.close()


def _refused(capsys: Any, monkeypatch: Any, argv: list[str]) -> str:
    from engram_trt.cli.main import main
    from engram_trt.distributed import launch

    monkeypatch.setattr(launch, "spawn", lambda *a, **k: (_ for _ in ()).throw(AssertionError("a rank started")))
    code = main(["run", *argv, "--device", "cpu", "--backend", "torch", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    return err.strip()


@pytest.mark.parametrize(
    "name,tp,needle",
    [
        (
            "llama",
            8,
            "--tp 8: engram-llama's num_attention_heads=4 do not divide over 8 ranks; use a --tp that divides 4",
        ),
        ("llama", 3, "--tp 3: engram-llama's num_attention_heads=4 do not divide over 3 ranks"),
        ("deepseek-v4", 3, "--tp 3: DeepSeek-V4's num_attention_heads=4 do not divide over 3 ranks"),
        ("qwen4-exp", 8, "--tp 8: Qwen4Exp's num_attention_heads=4 do not divide over 8 ranks"),
        (
            "llama-fp8",
            4,
            "--tp 4: tensor model.layers.0.self_attn.k_proj.weight is stored FP8 in 128x128 blocks, and "
            "rank 0's rows 0..64 of 256 do not start and end on block boundaries (multiples of 128)",
        ),
    ],
    ids=["llama-tp8", "llama-tp3", "deepseek-tp3", "qwen-tp8", "llama-fp8-tp4"],
)
def test_sizes_the_model_cannot_split_are_refused_before_any_rank(
    folders, capsys, monkeypatch, name: str, tp: int, needle: str
) -> None:
    err = _refused(capsys, monkeypatch, [str(folders[name].path), "--prompt", "a b", "--tp", str(tp)])
    assert err.startswith("engram-trt: error: ") and needle in err


def test_experts_that_do_not_divide_are_refused(folders, tmp_path, capsys, monkeypatch) -> None:
    src = folders["deepseek-v4"].path
    shutil.copytree(src, tmp_path / "ck")
    d = json.loads((tmp_path / "ck" / "config.json").read_text())
    d["n_routed_experts"] = 6  # 4 heads, 4 groups, 4 indexer heads divide by 4; 6 experts do not
    (tmp_path / "ck" / "config.json").write_text(json.dumps(d))
    err = _refused(capsys, monkeypatch, [str(tmp_path / "ck"), "--prompt", "a", "--tp", "4"])
    assert (
        "--tp 4: DeepSeek-V4's n_routed_experts=6 do not divide over 4 ranks; use a --tp that divides 6 (2, 3, 6)"
        in err
    )


def test_a_rank_that_dies_mid_step_ends_the_run_in_one_line(folders, tmp_path, capsys, monkeypatch) -> None:
    """The follower freezes at its first step (a test pause point) and is killed; the run
    ends within the timeout, exit 2, one line naming rank 1."""
    from engram_trt.cli.main import main
    from engram_trt.storage import atomic

    flag = tmp_path / "follower.pid"
    monkeypatch.setenv(atomic.PAUSE_ENV, "lockstep:follow")
    monkeypatch.setenv(atomic.PAUSE_FLAG_ENV, str(flag))
    killed: list[int] = []

    def killer() -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 120:
            if flag.is_file() and flag.read_text().strip():
                pid = int(flag.read_text())
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return
            time.sleep(0.05)

    th = threading.Thread(target=killer, daemon=True)
    th.start()
    t0 = time.monotonic()
    code = main(
        [
            "run",
            str(folders["llama"].path),
            "--prompt",
            "a b c",
            "--tp",
            "2",
            "--device",
            "cpu",
            "--backend",
            "torch",
            "--max-new-tokens",
            "3",
        ]
    )
    took = time.monotonic() - t0
    th.join(1)
    err = capsys.readouterr().err
    assert killed and code == 2 and took < 120
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith(
        f"engram-trt: error: rank 1 (pid {killed[0]}) was killed by SIGKILL while the ranks were "
        f"running; the other ranks were stopped"
    )


def test_rank_failure_names_the_dead_rank() -> None:
    from engram_trt.distributed.launch import rank_failure

    class Failed(Exception):
        error_index = 0

    # rank 0 failed first in a collective its dead peer left; rank 1 was killed: rank 1 is named
    line = rank_failure(Failed("RuntimeError: Connection closed by peer"), [(10, 1), (11, -9)])
    assert line.startswith("rank 1 (pid 11) was killed by SIGKILL")
    line = rank_failure(Failed("Traceback...\nValueError: bad thing"), [(10, 1), (11, -15)])
    assert line.startswith("rank 0 (pid 10) exited with status 1 while the ranks were running: ValueError: bad thing")


def test_llm_tp2_leads_its_group_and_gives_the_tokens(folders) -> None:
    import engram_trt

    f = folders["llama"]
    with engram_trt.LLM(str(f.path), tp=2, device="cpu", backend="torch", dtype="fp32", progress=False) as llm:
        group = llm.group
        assert llm.runner.tensor_parallel.size == 2 and len(group.follower_pids()) == 1
        outs = llm.generate(f.prompts, engram_trt.SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True))
        assert [o.token_ids for o in outs] == f.want
    assert llm.group is None and [p.poll() for p in group.followers] == [0]  # the follower exited with the group


def test_a_model_larger_than_the_gpus_says_how_many_it_needs(folders, served) -> None:
    """On GPUs the launcher checks the per-rank bytes against a GPU's memory before
    loading; with a GPU between the --tp 2 share and the whole model (the bytes the ranks
    measured above), --tp 1 is refused naming 2 GPUs, --tp 2 passes."""
    from engram_trt.distributed.support import GPU_FILL, check_gpu_fit
    from engram_trt.errors import EngramError

    f = folders["llama"]
    res = served[("llama", 2)]
    whole, share = res["weights"]["total_bytes"], max(res["weights"]["bytes_per_rank"])
    gpu = int((share + whole) / 2 / GPU_FILL)  # holds a --tp 2 share, not the whole model
    with pytest.raises(
        EngramError,
        match=r"at --tp 1 a rank holds .* GiB, more than 90% of a GPU here .*: it needs 2 "
        r"GPUs of this size; pass --tp 2$",
    ):
        check_gpu_fit(f.path, 1, "fp32", gpu)
    check_gpu_fit(f.path, 2, "fp32", gpu)
    with pytest.raises(EngramError, match="no --tp this model splits into fits such GPUs"):
        check_gpu_fit(f.path, 1, "fp32", share // 8)


def test_the_two_gpu_check_imports() -> None:
    """tests/gpu/test_tensor_parallel_x2.py (issue 45's run) imports here, without a GPU."""
    import importlib

    mod = importlib.import_module("gpu.test_tensor_parallel_x2")
    assert callable(mod.test_tiny_tokens_equal_one_gpu_with_graphs) and callable(mod.test_collectives_per_step)


# ------------------------------------------------------------------ the pieces, in one process
@pytest.mark.parametrize("vocab,size", [(10, 4), (96, 2), (7, 3)])
def test_vocab_parallel_embedding_and_head_with_uneven_rows(vocab: int, size: int) -> None:
    """Rows split unevenly (the first ranks one more): the ranks' masked lookups sum to the
    whole table's rows; the ranks' padded logits, gathered, are the whole head's."""
    import torch.nn.functional as F

    from engram_trt.models.parallel import gather_vocab, split_ranges, vocab_parallel_embedding

    gen = torch.Generator().manual_seed(vocab)
    table = torch.randn(vocab, 5, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, vocab, (17,), generator=gen)
    ranges = split_ranges(vocab, size)
    assert ranges[0][1] - ranges[0][0] >= ranges[-1][1] - ranges[-1][0] and ranges[-1][1] == vocab
    parts = []
    for a, b in ranges:
        emb = vocab_parallel_embedding(a, b, 5, None)  # no group: the sum is taken below
        emb.weight = torch.nn.Parameter(table[a:b].clone(), requires_grad=False)
        parts.append(emb(ids))
    assert torch.equal(sum(parts), F.embedding(ids, table))
    hidden = torch.randn(3, 5, generator=gen, dtype=torch.float64)
    local = [F.linear(hidden, table[a:b]) for a, b in ranges]
    width = max(b - a for a, b in ranges)

    class Gathering:  # every rank's padded logits side by side, as all_gather_into_tensor lays them
        def __init__(self) -> None:
            self.rank, self.size = 0, size

        def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
            padded = [F.pad(t, (0, width - t.shape[-1])) for t in local]
            assert torch.equal(padded[0], x)
            return torch.cat(padded, dim=dim)

    got = gather_vocab(local[0], Gathering(), vocab)  # type: ignore[arg-type]
    assert torch.equal(got, torch.cat(local, dim=-1))  # the padding dropped, every rank's rows in order
    assert torch.allclose(got, F.linear(hidden, table), rtol=1e-12, atol=1e-12)


def test_expert_parallel_moe_sums_to_the_whole(folders) -> None:
    """DeepSeek-V4's MoE (top-k and hash routed) and Qwen4Exp's, split over 2 ranks as the
    plans split them (experts by rank, the shared expert's channels by rank): the ranks'
    outputs, summed (what the block's all-reduce does), equal the whole MoE's in float64."""
    from engram_trt.models.registry import open_checkpoint

    for name in ("deepseek-v4", "qwen4-exp"):
        ckpt = open_checkpoint(folders[name].path)
        arch = ckpt.architecture
        whole = arch.load_model(ckpt, device="cpu", dtype=torch.float64)
        ranks = []
        for r in range(2):
            plan = arch.parallel_plan(ckpt.config, 2, r)
            ranks.append(arch.load_model(ckpt, device="cpu", dtype=torch.float64, parallel=plan))
        ckpt.close()
        gen = torch.Generator().manual_seed(5)
        x = torch.randn(9, ckpt.config.hidden_size, generator=gen, dtype=torch.float64)
        ids = torch.randint(0, ckpt.config.vocab_size, (9,), generator=gen)
        for li, layer in enumerate(whole.model.layers):
            if name == "deepseek-v4":
                want = layer.mlp(x, ids)
                got = sum(m.model.layers[li].mlp(x, ids) for m in ranks)
            else:
                want = layer.mlp(x)
                got = sum(m.model.layers[li].mlp(x) for m in ranks)
            assert len(ranks[0].model.layers[li].mlp.experts) == len(layer.mlp.experts) // 2
            assert torch.allclose(got, want, rtol=1e-12, atol=1e-12), (name, li, (got - want).abs().max())
