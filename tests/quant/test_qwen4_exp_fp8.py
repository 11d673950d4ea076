"""Fine-grained FP8 Qwen4Exp checkpoints (issue 40 items 1 and 5) served as stored,
against transformers 5.25.

Each case is a tiny random ``Qwen4ExpForCausalLM`` (every parameter drawn at random) that
transformers saves, quantizes and saves again itself (:func:`helpers.checkpoints.transformers_fp8_save`):
every linear whose dims divide by 128 stored F8_E4M3 with ``weight_scale_inv`` (attention
q / o, the Gated DeltaNet in_proj_qkv / in_proj_z / out_proj, the hyper-connection mixes,
the PLE key / value projections, the shared expert), the routed experts one F8_E4M3 tensor
per expert with one merged scale per projection kind for the layer
(``mlp.experts.gate_up_proj_scale_inv [E, 2I/128, H/128]``), the rest float (k / v of one
64-wide head, the QSA ``index_qk_proj`` of 192 rows, in_proj_a / in_proj_b, the injection
weights, the router, the head, the embeddings). Cases: PLE with its rows in fewer shards
than split_ngram_parts; a tied head with ue8m0 scales and the shared expert kept in 16
bits by ``modules_to_not_convert``; experts of I = 64, whose gate_up block rows straddle
the gate and up halves (their down_proj left float).

The reference: transformers 5.25 cannot load its own FP8 Qwen4Exp save on a CPU (it
reports the merged expert scales as unexpected and leaves the experts as FP8 bytes, which
its grouped matmul refuses), so transformers loads the folder dequantized exactly per the
format (:func:`helpers.checkpoints.dequantized_folder`); every weight transformers' own dequantizing
load does read equals that dequantization bit for bit (the first test). engram-trt serves
the FP8 folder through ``LLM`` and ``engram-trt run`` (greedy tokens equal), fp32 logits
within 1e-4 relative on the CPU.

FP8 PLE tables (transformers' ``FP8Embedding``, declared by ``modules_to_convert``): one
float32 scale per table, the shards F8_E4M3 as ``torch.chunk`` splits them. transformers
5.25 loads that layout on a CPU (the reference where the linears stay float) but cannot
write it, so it is laid out under its names (:func:`helpers.checkpoints.fp8_ple_folder`); the stores
hold the FP8 bytes and the rows are dequantized after the gather.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from helpers.checkpoints import (  # noqa: E402
    assert_fp32_logits_match,
    dequantized_folder,
    edit_config,
    folder_tensors,
    fp8_ple_folder,
    llm_greedy,
    packed_greedy,
    save_folder_as,
    transformers_fp8_save,
    transformers_greedy,
    without_stale_scales,
    word_tokenizer,
)
from helpers.cli import assert_run_refused, run_json  # noqa: E402
from helpers.qwen4_exp import randomized  # noqa: E402

from engram_trt.cli.main import main  # noqa: E402

from helpers.qwen4_exp_fp8 import BASE, CASES, PROMPTS, VOCAB  # noqa: E402

NEW_TOKENS = 8


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request: Any, tmp_path_factory: Any) -> tuple[str, Path, Any]:
    """(name, the FP8 folder transformers wrote, transformers' reference model of it)."""
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    name = request.param
    overrides, fp8 = CASES[name]
    kw = dict(BASE, **overrides)
    root = tmp_path_factory.mktemp(name)
    torch.manual_seed(len(name))
    randomized(Qwen4ExpForCausalLM(Qwen4ExpTextConfig(**kw)).eval(), len(name)).save_pretrained(root / "float")
    word_tokenizer(root / "float" / "tokenizer.json", VOCAB)
    folder = transformers_fp8_save(Qwen4ExpForCausalLM, root / "float", root / "fp8", **fp8)
    ref_folder = dequantized_folder(folder, root / "ref", moe_intermediate=kw["moe_intermediate_size"])
    ref = Qwen4ExpForCausalLM.from_pretrained(ref_folder, dtype=torch.float32, use_kernels=False).eval()
    return name, folder, ref


def stored(folder: Path) -> dict[str, str]:
    from safetensors import safe_open

    out = {}
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_slice(k).get_dtype() for k in h.keys()})
    return out


def test_folder_layout_and_the_reference_dequantization(case: tuple[str, Path, Any], tmp_path: Path) -> None:
    """What transformers wrote, and the reference: transformers' own dequantizing CPU
    load reads every FP8 weight but the routed experts' exactly as the format dequantizes
    them (its experts it cannot read: their merged scales are unexpected to it)."""
    from transformers import Qwen4ExpForCausalLM

    name, folder, ref = case
    kinds = stored(folder)
    fp8 = {k for k, v in kinds.items() if v == "F8_E4M3"}
    for must in (
        "layers.0.linear_attn.in_proj_qkv.weight",
        "layers.0.linear_attn.out_proj.weight",
        "layers.3.self_attn.q_proj.weight",
        "layers.3.self_attn.o_proj.weight",
        "layers.0.attn_hyper_connection.input_mix_weight_down.weight",
        "layers.0.mlp.experts.0.gate_proj.weight",
        "layers.0.mlp.experts.0.up_proj.weight",
    ):
        assert f"model.{must}" in fp8, must
    for never in (
        "layers.3.self_attn.k_proj.weight",
        "layers.3.self_attn.indexer.index_qk_proj.weight",
        "layers.0.linear_attn.in_proj_a.weight",
        "layers.0.mlp.gate.weight",
        "embed_tokens.weight",
    ):
        assert f"model.{never}" not in fp8, never
    assert ("model.layers.0.mlp.experts.0.down_proj.weight" in fp8) == (name != "experts-i64-straddle")
    assert ("model.layers.0.mlp.shared_expert.gate_proj.weight" in fp8) == (name == "ple-fp8-float-scales")
    if name == "ple-fp8-float-scales":
        assert {"model.layers.0.ple.key_proj.weight", "model.layers.0.ple.value_proj.weight"} <= fp8
    tensors = folder_tensors(folder)
    I, E = (64, 6) if name == "experts-i64-straddle" else (128, 4)
    assert list(tensors["model.layers.0.mlp.experts.gate_up_proj_scale_inv"].shape) == [E, 2 * I // 128, 1]
    stripped = without_stale_scales(folder, tmp_path / "stripped")
    theirs = Qwen4ExpForCausalLM.from_pretrained(stripped, dtype=torch.float32, use_kernels=False)
    want = dict(ref.named_parameters())
    compared = 0
    for k, p in theirs.named_parameters():
        if ".mlp.experts." not in k:
            assert torch.equal(p, want[k]), k
            compared += 1
    assert compared > 50


def test_llm_greedy_tokens_equal_transformers(case: tuple[str, Path, Any]) -> None:
    _name, folder, ref = case
    want = [transformers_greedy(ref, p, NEW_TOKENS) for p in PROMPTS]
    assert llm_greedy(folder, PROMPTS, NEW_TOKENS) == want


def test_run_command_matches_transformers(case: tuple[str, Path, Any], capsys: Any) -> None:
    _name, folder, ref = case
    want = transformers_greedy(ref, PROMPTS[0], NEW_TOKENS)
    assert run_json(folder, PROMPTS[0], NEW_TOKENS, capsys)["token_ids"] == want


def test_fp32_logits_and_packed_steps(case: tuple[str, Path, Any]) -> None:
    from engram_trt.models.registry import open_checkpoint

    _name, folder, ref = case
    ckpt = open_checkpoint(folder)
    ours = ckpt.architecture.load_model(ckpt, device="cpu", dtype=torch.float32)
    assert_fp32_logits_match(ref, ours, PROMPTS)
    assert packed_greedy(ours, PROMPTS, 4) == [transformers_greedy(ref, p, 4) for p in PROMPTS]
    ckpt.close()


def test_quantized_modules_hold_the_stored_bytes(case: tuple[str, Path, Any]) -> None:
    """Every F8_E4M3 tensor is a QuantLinear's bytes as stored, its scales the stored ones
    (an expert's: its half of the layer's merged scale); nothing else is quantized."""
    from torch import nn

    from engram_trt.models.registry import open_checkpoint
    from engram_trt.quant.weight import QuantLinear

    name, folder, _ref = case
    tensors = folder_tensors(folder)
    ckpt = open_checkpoint(folder)
    ours = ckpt.architecture.load_model(ckpt, device="cpu", dtype=torch.float32)
    I = ours.config.moe_intermediate_size
    quantized = 0
    for mname, m in ours.named_modules():
        if not isinstance(m, (nn.Linear, QuantLinear)):
            continue
        w = tensors[f"{mname}.weight"]
        if w.dtype != torch.float8_e4m3fn:
            assert type(m) is nn.Linear and m.weight.dtype == torch.float32, mname
            continue
        quantized += 1
        assert isinstance(m, QuantLinear) and torch.equal(m.weight.view(torch.uint8), w.view(torch.uint8)), mname
        scale = tensors.get(f"{mname}.weight_scale_inv")
        if scale is None:  # a routed expert: its part of the merged scale
            base, e, proj = mname.rsplit(".", 2)
            merged = tensors[f"{base}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}_scale_inv"][int(e)]
            lo = 0 if proj != "up_proj" else I
            scale = (
                merged
                if proj == "down_proj"
                else merged[(torch.arange(I) + lo) // 128]
                if I % 128
                else merged[lo // 128 : (lo + I) // 128]
            )
        assert m.weight_scale_inv.dtype == scale.dtype == (torch.float8_e8m0fnu if "ue8m0" in name else torch.float32)
        assert torch.equal(m.weight_scale_inv.view(torch.uint8), scale.contiguous().view(torch.uint8)), mname
    assert quantized == sum(1 for t in tensors.values() if t.dtype == torch.float8_e4m3fn)
    ckpt.close()


def test_fp8_experts_stacked_forms_equal_the_per_expert_path(case: tuple[str, Path, Any]) -> None:
    """The sync-free forms a CUDA decode step records (the experts stacked as QuantWeights,
    each expert's buffers views of the stacks) give the per-expert path's output; on the
    CPU they run dequantized, on the GPU through native.quant.experts (tests/gpu)."""
    from engram_trt.models.registry import open_checkpoint
    from engram_trt.quant.weight import QuantWeight

    _name, folder, _ref = case
    ckpt = open_checkpoint(folder)
    ours = ckpt.architecture.load_model(ckpt, device="cpu", dtype=torch.float32)
    moe = ours.model.layers[0].mlp
    x = torch.randn(5, ours.config.hidden_size, generator=torch.Generator().manual_seed(3))
    per_expert = moe(x)
    moe.stack_experts()
    gate, _up, down, _inter = moe._stacked
    assert isinstance(gate, QuantWeight) and gate.data.shape[0] == ours.config.num_experts
    assert moe.experts[1].gate_proj.weight.data_ptr() == gate.data[1].data_ptr()
    assert isinstance(down, QuantWeight) == (ours.config.moe_intermediate_size % 128 == 0)
    shared = moe.shared_expert(x) * torch.sigmoid(moe.shared_expert_gate(x))
    w, ids = moe.route(x)
    for form in (moe.experts_dense, moe.experts_gathered):
        got = form(x, w, ids) + shared
        assert (got - per_expert).abs().max().item() <= 1e-5 * per_expert.abs().max().item()
    again = moe(x)  # the per-expert path reads the stacks' views: the same values
    assert (again - per_expert).abs().max().item() <= 1e-6 * per_expert.abs().max().item()
    ckpt.close()


def test_inspect_reports_no_problem_and_build_exports_the_stored_bytes(
    case: tuple[str, Path, Any], capsys: Any, tmp_path: Path
) -> None:
    """build (graph only) writes the FP8 weights as they are stored: each F8_E4M3 linear a
    FLOAT8E4M3FN initializer under a DequantizeLinear, the routed experts the stored bytes
    of one EngramRoutedExperts node per layer (where a projection was left float:
    dequantized stacks of the dense form), the FP8 targets recorded (the graph against
    transformers and the engines: tests/quant/test_quant_build.py)."""
    import onnx
    from onnx import TensorProto

    name, folder, _ref = case
    capsys.readouterr()
    assert main(["inspect", str(folder), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["problems"] == [] and report["unused_tensors"] == []
    assert main(["build", str(folder), "--output", str(tmp_path / "engine"), "--no-engine"]) == 0
    manifest = json.loads((tmp_path / "engine" / "manifest.json").read_text())
    assert manifest["build_flags"]["targets"] == ["sm89", "sm120", "sm121"]
    graph = onnx.load(str(tmp_path / "engine" / "model.onnx")).graph
    e4m3 = {i.name for i in graph.initializer if i.data_type == TensorProto.FLOAT8E4M3FN}
    fp8 = {k for k, v in stored(folder).items() if v == "F8_E4M3"}
    linears = {k for k in fp8 if ".mlp.experts." not in k}
    assert {k + ".e4m3" for k in linears} <= e4m3
    routed = [n for n in graph.node if n.op_type == "EngramRoutedExperts"]
    if name == "experts-i64-straddle":  # down_proj left float: the dense form, gate / up stacks dequantized
        assert (
            not routed
            and {f"model.layers.{i}.mlp.experts.{p}_stack.e4m3" for i in range(4) for p in ("gate", "up")} <= e4m3
        )
    else:
        assert len(routed) == 4 and e4m3 == {k + ".e4m3" for k in linears}


# -- bad input: one line, exit 2, nothing written ------------------------------------------------

L0 = "model.layers.0.mlp.experts"


def _edit_tensors(folder: Path, change: Any) -> None:
    tensors = folder_tensors(folder)
    change(tensors)
    for f in folder.glob("*.safetensors"):
        f.unlink()
    idx = folder / "model.safetensors.index.json"
    if idx.exists():
        idx.unlink()
    save_folder_as(folder, folder, tensors)


BAD: dict[str, tuple[Any, str]] = {
    "merged-scale-mis-shaped": (
        lambda f: _edit_tensors(f, lambda t: t.update({f"{L0}.gate_up_proj_scale_inv": torch.ones(4, 1, 1)})),
        rf"scale {L0}\.gate_up_proj_scale_inv has shape \[4, 1, 1\] but 4 experts in 128x128 blocks need \[4, 2, 1\]",
    ),
    "merged-scale-missing": (
        lambda f: _edit_tensors(f, lambda t: t.pop(f"{L0}.down_proj_scale_inv")),
        rf"scale of {L0}\.0\.down_proj\.weight is missing",
    ),
    "merged-scale-wrong-dtype": (
        lambda f: _edit_tensors(
            f, lambda t: t.update({f"{L0}.gate_up_proj_scale_inv": torch.ones(4, 2, 1, dtype=torch.int64)})
        ),
        rf"scale {L0}\.gate_up_proj_scale_inv of {L0}\.0\.gate_proj\.weight is I64",
    ),
    "one-expert-float": (
        lambda f: _edit_tensors(f, lambda t: t.update({f"{L0}.2.up_proj.weight": t[f"{L0}.2.up_proj.weight"].float()})),
        rf"{L0}\.2\.up_proj\.weight is F32\): one projection of a layer's experts is FP8 for all of them or for none",
    ),
    "linear-scale-mis-shaped": (
        lambda f: _edit_tensors(
            f, lambda t: t.update({"model.layers.0.linear_attn.in_proj_qkv.weight_scale_inv": torch.ones(1, 1)})
        ),
        r"scale of model\.layers\.0\.linear_attn\.in_proj_qkv\.weight has shape \[1, 1\] but a \[256, 128\] FP8 weight "
        r"in 128x128 blocks needs \[2, 1\]",
    ),
    "fp8-router": (
        lambda f: _edit_tensors(
            f,
            lambda t: t.update(
                {"model.layers.0.mlp.gate.weight": t["model.layers.0.mlp.gate.weight"].to(torch.float8_e4m3fn)}
            ),
        ),
        r"model\.layers\.0\.mlp\.gate\.weight is F8_E4M3, but only linear weights are served in FP8",
    ),
    "fp4-experts": (
        lambda f: edit_config(
            f, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128], "expert_dtype": "fp4"}
        ),
        r"'quantization_config\.expert_dtype'='fp4' is not served for qwen4-exp",
    ),
    "no-quantization-config": (
        lambda f: edit_config(f, quantization_config=None),
        r"is F8_E4M3 but config\.json declares no quantization_config",
    ),
    "method-compressed-tensors": (
        lambda f: edit_config(f, quantization_config={"quant_method": "compressed-tensors"}),
        r"'quantization_config\.quant_method'='compressed-tensors' is not served",
    ),
}


@pytest.fixture(scope="module")
def good_fp8(tmp_path_factory: Any) -> Path:
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    root = tmp_path_factory.mktemp("bad-base")
    torch.manual_seed(9)
    randomized(Qwen4ExpForCausalLM(Qwen4ExpTextConfig(**BASE)).eval(), 9).save_pretrained(root / "float")
    word_tokenizer(root / "float" / "tokenizer.json", VOCAB)
    return transformers_fp8_save(Qwen4ExpForCausalLM, root / "float", root / "fp8", weight_block_size=[128, 128])


@pytest.mark.parametrize("bad", sorted(BAD))
def test_bad_fp8_checkpoints_refused_in_one_line(good_fp8: Path, tmp_path: Path, capsys: Any, bad: str) -> None:
    folder = tmp_path / "ck"
    shutil.copytree(good_fp8, folder)
    damage, needle = BAD[bad]
    damage(folder)
    assert_run_refused(folder, needle, capsys)


# -- FP8 PLE tables (FP8Embedding) ------------------------------------------------------------

PLE_CASE = dict(
    ple_layer_ids=[1, 3],
    ple_embed_dim=128,
    ngram_size=3,
    heads_per_ngram=2,
    ngram_vocab_size_base=50,
    make_ngram_vocab_size_divisible_by=8,
    split_ngram_parts=100,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
)


@pytest.fixture(scope="module", params=["linears-float", "linears-fp8"])
def fp8_ple(request: Any, tmp_path_factory: Any) -> tuple[str, Path, Any]:
    """(variant, the folder with FP8 PLE tables, transformers' reference model): with float
    linears transformers loads the folder itself (its FP8Embedding); with FP8 linears it
    loads the folder dequantized per the format."""
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    variant = request.param
    root = tmp_path_factory.mktemp(variant)
    torch.manual_seed(5)
    model = Qwen4ExpForCausalLM(Qwen4ExpTextConfig(**dict(BASE, **PLE_CASE))).eval()
    randomized(model, 5).save_pretrained(root / "float")
    word_tokenizer(root / "float" / "tokenizer.json", VOCAB)
    src = root / "float"
    if variant == "linears-fp8":
        src = transformers_fp8_save(Qwen4ExpForCausalLM, src, root / "fp8", weight_block_size=[128, 128])
    folder = fp8_ple_folder(src, root / "ple8")
    ref_folder = (
        folder if variant == "linears-float" else dequantized_folder(folder, root / "ref", moe_intermediate=128)
    )
    ref = Qwen4ExpForCausalLM.from_pretrained(ref_folder, dtype=torch.float32, use_kernels=False).eval()
    return variant, folder, ref


def test_fp8_ple_tables_greedy_tokens_and_logits_equal_transformers(
    fp8_ple: tuple[str, Path, Any], capsys: Any
) -> None:
    from engram_trt.models.registry import open_checkpoint

    variant, folder, ref = fp8_ple
    if variant == "linears-float":  # transformers reads the table as its FP8Embedding
        emb = ref.model.layers[0].ple.ple_embedding.ngram_embedding
        assert type(emb).__name__ == "FP8Embedding" and emb.weight.dtype == torch.float8_e4m3fn
    want = [transformers_greedy(ref, p, NEW_TOKENS) for p in PROMPTS]
    assert llm_greedy(folder, PROMPTS, NEW_TOKENS) == want
    assert run_json(folder, PROMPTS[2], NEW_TOKENS, capsys)["token_ids"] == want[2]
    ckpt = open_checkpoint(folder)
    ours = ckpt.architecture.load_model(ckpt, device="cpu", dtype=torch.float32)
    assert_fp32_logits_match(ref, ours, PROMPTS)
    ckpt.close()


@pytest.mark.parametrize("kind", ["memory", "file", "shared", "pinned"])
def test_fp8_ple_stores_hold_the_bytes_and_dequantize_gathered_rows(
    fp8_ple: tuple[str, Path, Any], tmp_path: Path, kind: str
) -> None:
    """Each store holds the FP8 bytes (one per value, float8_e4m3fn); the gather gives
    the rows times the table's scale, as transformers' FP8Embedding does."""
    from helpers.tables import FakeRegistrar

    from engram_trt.models.qwen4_exp.ple_tables import PLETables, table_scales
    from engram_trt.models.registry import open_checkpoint
    from engram_trt.tables.store import open_tables

    _variant, folder, _ref = fp8_ple
    tensors = folder_tensors(folder)
    ckpt = open_checkpoint(folder)
    refs = ckpt.architecture.table_refs(ckpt)
    assert all(r.dtype == "F8_E4M3" and r.table_scale is not None for r in refs)
    assert [r.to_json()["table_scale"] for r in refs[:1]] == [refs[0].table_scale]
    if kind == "pinned":
        from engram_trt.tables.pinned import PinnedTables

        store = PinnedTables.load(refs, registrar=FakeRegistrar(), huge_pages="none", progress=False)
    else:
        store = open_tables(refs, kind, progress=False, **({"directory": tmp_path} if kind == "shared" else {}))
    try:
        tables = PLETables(store, "cpu", owns_store=False, table_scales=table_scales(ckpt, ckpt.config))
        for li, layer in enumerate(PLE_CASE["ple_layer_ids"]):
            stem = f"model.layers.{layer - 1}.ple.ple_embedding.ngram_embedding"
            n = sum(1 for k in tensors if k.startswith(stem + ".shard_"))
            whole = torch.cat([tensors[f"{stem}.shard_{i}.weight"] for i in range(n)])
            scale = tensors[f"{stem}.weight_scale"]
            assert store.row_dtype(li) == torch.float8_e4m3fn and store.table_bytes() >= whole.numel()
            ids = torch.randint(0, whole.shape[0], (6, 4), generator=torch.Generator().manual_seed(li))
            got = tables.gather(li, ids)
            assert got.dtype == torch.float32 and torch.equal(got, whole[ids].float() * scale)
        assert store.describe()["layers"][0]["dtype"] == "fp8-table-scaled"
    finally:
        store.close()
        ckpt.close()


def test_fp8_ple_inspect_and_build(fp8_ple: tuple[str, Path, Any], capsys: Any, tmp_path: Path) -> None:
    _variant, folder, _ref = fp8_ple
    capsys.readouterr()
    assert main(["inspect", str(folder), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["problems"] == []
    tensors = folder_tensors(folder)
    for e in report["ple"]["layers"]:
        stem = f"model.layers.{e['ple_layer_id'] - 1}.ple.ple_embedding.ngram_embedding"
        assert e["dtype"] == "F8_E4M3" and e["bytes"] == e["table_rows"] * e["width"]
        assert e["table_scale"] == float(tensors[f"{stem}.weight_scale"][0])
    assert main(["build", str(folder), "--output", str(tmp_path / "engine"), "--no-engine"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "FP8 PLE tables are not built into engines yet" in err
    assert "is F8_E4M3" in err and "serve the checkpoint folder with the torch backend" in err
    assert not (tmp_path / "engine").exists()


PLE_STEM = "model.layers.0.ple.ple_embedding.ngram_embedding"
BAD_PLE: dict[str, tuple[Any, str]] = {
    "undeclared": (
        lambda f: edit_config(f, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}),
        rf"{PLE_STEM}\.shard_0\.weight is F8_E4M3 \(expected BF16, F16 or F32 rows\) "
        rf"\(an FP8 table is declared",
    ),
    "scale-missing": (
        lambda f: _edit_tensors(f, lambda t: t.pop(f"{PLE_STEM}.weight_scale")),
        rf"scale {PLE_STEM}\.weight_scale of layer 1's FP8 PLE table is missing",
    ),
    "scale-per-row": (
        lambda f: _edit_tensors(f, lambda t: t.update({f"{PLE_STEM}.weight_scale": torch.ones(3, 1)})),
        rf"scale {PLE_STEM}\.weight_scale is F32 \[3, 1\] \(expected one float32 for the table",
    ),
    "float-shard": (
        lambda f: _edit_tensors(
            f, lambda t: t.update({f"{PLE_STEM}.shard_1.weight": t[f"{PLE_STEM}.shard_1.weight"].float()})
        ),
        rf"{PLE_STEM}\.shard_1\.weight is F32 but quantization_config\.modules_to_convert declares",
    ),
}


@pytest.mark.parametrize("fp8_ple", ["linears-float"], indirect=True)  # the refusals concern the table alone
@pytest.mark.parametrize("bad", sorted(BAD_PLE))
def test_bad_fp8_ple_tables_refused_in_one_line(
    fp8_ple: tuple[str, Path, Any], tmp_path: Path, capsys: Any, bad: str
) -> None:
    _variant, src, _ref = fp8_ple
    folder = tmp_path / "ck"
    shutil.copytree(src, folder)
    damage, needle = BAD_PLE[bad]
    damage(folder)
    assert_run_refused(folder, needle, capsys)
