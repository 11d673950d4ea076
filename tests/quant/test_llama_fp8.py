"""Fine-grained FP8 Llama checkpoints (issue 40 items 1 and 5) served as stored, against
transformers 5.25 loading the same folder.

Each case is a tiny random ``LlamaForCausalLM`` that transformers saves, then quantizes
and saves again itself (:func:`helpers.checkpoints.transformers_fp8_save`: its
``FineGrainedFP8Config``, its ``Fp8Quantize``, its ``save_pretrained``): the linears whose
two dims divide by the block stored F8_E4M3 with ``weight_scale_inv`` beside them, the rest
(k / v of one 64-wide head, an MLP of 200, the ``modules_to_not_convert``, the head, the
embeddings) left float, float32 or ue8m0 scales, tied and untied heads. One more case is
laid out exactly as the formats note says with partial blocks (dims 320 and 200, not
multiples of 128: transformers' save never writes those).

The reference is transformers' own CPU load of the folder (it dequantizes at load), with
the stale scales its save writes beside the weights it left in 16 bits removed (its CPU
load would multiply those weights by uninitialized memory); for the partial-block case
transformers loads the folder dequantized exactly per the format (float64, then float32),
and the first test holds that dequantization to transformers' own on every other case.
engram-trt serves the folder through ``LLM`` and ``engram-trt run`` (greedy tokens equal
transformers'), and its fp32 logits on the CPU are within 1e-4 relative. Bad inputs
(scale missing, mis-shaped, of a wrong dtype; methods not served; FP8 without its config
or against ``modules_to_not_convert``; an FP8 embedding; ``build``) are refused in one line,
exit 2, nothing written.
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
    dequantized_folder,
    edit_config,
    folder_tensors,
    llm_greedy,
    save_folder_as,
    transformers_fp8_save,
    transformers_greedy,
    without_stale_scales,
    word_tokenizer,
)
from helpers.cli import assert_run_refused, run_json  # noqa: E402
from engram_trt.cli.main import main  # noqa: E402

from helpers.llama_fp8 import BASE, CASES, PROMPTS, VOCAB, partial_block_folder  # noqa: E402

NEW_TOKENS = 8


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request: Any, tmp_path_factory: Any) -> tuple[str, Path, Any]:
    """(name, the FP8 folder, transformers' reference model of it)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    name = request.param
    overrides, fp8 = CASES[name]
    root = tmp_path_factory.mktemp(name)
    torch.manual_seed(len(name))
    LlamaForCausalLM(LlamaConfig(**dict(BASE, **overrides))).save_pretrained(root / "float")
    word_tokenizer(root / "float" / "tokenizer.json", VOCAB)
    if fp8 is None:
        folder = partial_block_folder(root / "float", root / "fp8")
        ref_folder = dequantized_folder(folder, root / "ref")
    else:
        folder = transformers_fp8_save(LlamaForCausalLM, root / "float", root / "fp8", **fp8)
        ref_folder = without_stale_scales(folder, root / "ref")
    ref = LlamaForCausalLM.from_pretrained(ref_folder, dtype=torch.float32, use_kernels=False).eval()
    return name, folder, ref


def stored(folder: Path) -> dict[str, str]:
    """Tensor name -> its stored safetensors dtype."""
    from safetensors import safe_open

    out = {}
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_slice(k).get_dtype() for k in h.keys()})
    return out


def test_the_folders_and_the_reference_dequantization(case: tuple[str, Path, Any], tmp_path: Path) -> None:
    """The folder holds FP8 and float weights as each case means (partial blocks: scale
    grids of ceil(dim / 128)); for transformers' folders, transformers' own dequantizing CPU
    load gives bit for bit the weights of the folder dequantized per the format (the
    reference of the cases transformers cannot load itself)."""
    from transformers import LlamaForCausalLM

    name, folder, ref = case
    kinds = stored(folder)
    fp8 = sorted(k for k, v in kinds.items() if v == "F8_E4M3")
    assert fp8 and all(k.endswith("_proj.weight") for k in fp8)
    assert kinds["model.embed_tokens.weight"] == "F32" and kinds.get("lm_head.weight", "F32") == "F32"
    want_float = {
        "tied-ue8m0-partly-float": ("k_proj", "v_proj", "mlp."),
        "not-converted-o-proj": ("o_proj",),
        "all-fp8-float-scales": (),
        "partial-blocks": (),
    }[name]
    for k in (k for k in kinds if k.endswith("_proj.weight")):
        assert (kinds[k] == "F32") == any(w in k for w in want_float), k
    if name == "partial-blocks":
        tensors = folder_tensors(folder)
        assert list(tensors[f"{Q}.weight_scale_inv"].shape) == [3, 3]  # 320 x 320 in 128x128 blocks
        assert list(tensors["model.layers.0.mlp.down_proj.weight_scale_inv"].shape) == [3, 2]  # 320 x 200
        return
    ours = LlamaForCausalLM.from_pretrained(
        dequantized_folder(folder, tmp_path / "deq"), dtype=torch.float32, use_kernels=False
    )
    theirs = dict(ref.named_parameters())
    for k, p in ours.named_parameters():
        assert torch.equal(p, theirs[k]), k


def test_llm_greedy_tokens_equal_transformers(case: tuple[str, Path, Any]) -> None:
    _name, folder, ref = case
    want = [transformers_greedy(ref, p, NEW_TOKENS) for p in PROMPTS]
    assert llm_greedy(folder, PROMPTS, NEW_TOKENS) == want


def test_run_command_matches_transformers(case: tuple[str, Path, Any], capsys: Any) -> None:
    _name, folder, ref = case
    want = transformers_greedy(ref, PROMPTS[0], NEW_TOKENS)
    assert run_json(folder, PROMPTS[0], NEW_TOKENS, capsys)["token_ids"] == want


def test_fp32_logits_within_1e4_of_transformers(case: tuple[str, Path, Any]) -> None:
    from engram_trt.models.engram_llama.model import EngramLlama

    _name, folder, ref = case
    ours = EngramLlama.from_checkpoint(folder, device="cpu", dtype=torch.float32)
    for prompt in PROMPTS:
        with torch.no_grad():
            want = ref(torch.tensor([prompt])).logits[0].double()
            got = ours.forward(torch.tensor(prompt)).double()
        assert got.shape == want.shape
        assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()


def test_quantized_modules_hold_the_stored_bytes(case: tuple[str, Path, Any]) -> None:
    """Each FP8 weight is a QuantLinear holding the checkpoint's bytes and scales in their
    stored dtypes (float8_e4m3fn; float32 or float8_e8m0fnu); the weights stored float are
    float parameters; the linears hold no more bytes than the checkpoint stores for them."""
    from torch import nn

    from engram_trt.models.engram_llama.model import EngramLlama
    from engram_trt.quant.weight import QuantLinear

    name, folder, _ref = case
    tensors = folder_tensors(folder)
    ours = EngramLlama.from_checkpoint(folder, device="cpu", dtype=torch.float32)
    stored_bytes = held = 0
    for mname, m in ours.named_modules():
        if not isinstance(m, (nn.Linear, QuantLinear)):
            continue
        w = tensors[f"{mname}.weight"]
        if w.dtype == torch.float8_e4m3fn:
            s = tensors[f"{mname}.weight_scale_inv"]
            assert isinstance(m, QuantLinear) and m.weight.dtype == torch.float8_e4m3fn
            assert torch.equal(m.weight.view(torch.uint8), w.view(torch.uint8))
            assert m.weight_scale_inv.dtype == s.dtype and torch.equal(
                m.weight_scale_inv.view(torch.uint8), s.view(torch.uint8)
            )
            assert s.dtype == (torch.float8_e8m0fnu if "ue8m0" in name else torch.float32)
            stored_bytes += w.numel() + s.numel() * s.element_size()
            held += sum(b.numel() * b.element_size() for b in m.buffers())
            assert not list(m.parameters())
        else:
            assert type(m) is nn.Linear and m.weight.dtype == torch.float32 and torch.equal(m.weight, w.float())
    assert held == stored_bytes > 0


def test_fused_fp8_projections_equal_them_apart(case: tuple[str, Path, Any]) -> None:
    """The fused decoder path (the PyTorch ops the kernels reproduce, on the CPU): FP8
    q / k / v and gate / up stacked as one QuantWeight each where every part ends on a
    block row (their QuantLinears' bytes and scales views of the stacks), mixed groups run
    apart; the logits equal the unfused model's."""
    from engram_trt.models.engram_llama.kernel_ops import TorchBackboneOps
    from engram_trt.models.engram_llama.model import EngramLlama
    from engram_trt.models.registry import open_checkpoint
    from engram_trt.quant.weight import QuantWeight

    name, folder, _ref = case
    ckpt = open_checkpoint(folder)
    from engram_trt.models.engram_llama.weights import lazy_weights

    plain = EngramLlama(ckpt.config, lazy_weights(ckpt))
    fused = EngramLlama(ckpt.config, lazy_weights(ckpt), fuse_projections=True)
    fused.backbone_ops = TorchBackboneOps()
    kinds, tensors = stored(folder), folder_tensors(folder)
    stacks = 0
    for i, layer in enumerate(fused.model.layers):
        for module, parts in (
            (layer.self_attn, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
            (layer.mlp, ("mlp.gate_proj", "mlp.up_proj")),
        ):
            fp8 = [kinds[f"model.layers.{i}.{p}.weight"] == "F8_E4M3" for p in parts]
            aligned = all(tensors[f"model.layers.{i}.{p}.weight"].shape[0] % 128 == 0 for p in parts[:-1])
            stack = module.fused_weight()
            if all(fp8) and aligned:
                stacks += 1
                assert isinstance(stack, QuantWeight)
                first = module.get_submodule(parts[0].split(".", 1)[1])
                assert first.weight.data_ptr() == stack.data.data_ptr()
                assert first.weight_scale_inv.data_ptr() == stack.scale.data_ptr()
            elif any(fp8):
                assert stack is None  # FP8 and float parts, or a part ending inside a block row: run apart
            else:
                assert isinstance(stack, torch.Tensor)
    assert (
        stacks
        == {"all-fp8-float-scales": 4, "tied-ue8m0-partly-float": 0, "not-converted-o-proj": 4, "partial-blocks": 0}[
            name
        ]
    )
    ids = torch.tensor(PROMPTS[2])
    got, want = fused(ids), plain(ids)
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    ckpt.close()


def test_inspect_reports_no_problem_and_build_exports_the_stored_bytes(
    case: tuple[str, Path, Any], capsys: Any, tmp_path: Path
) -> None:
    """build (graph only) writes the FP8 weights as they are stored: each F8_E4M3 tensor a
    FLOAT8E4M3FN initializer under a DequantizeLinear, the FP8 targets recorded, the
    checkpoint untouched (the graph against transformers and the engines:
    tests/quant/test_quant_build.py)."""
    import onnx
    from onnx import TensorProto

    _name, folder, _ref = case
    capsys.readouterr()
    assert main(["inspect", str(folder), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["problems"] == [] and report["unused_tensors"] == []
    before = sorted(p.name for p in folder.iterdir())
    assert main(["build", str(folder), "--output", str(tmp_path / "engine"), "--no-engine"]) == 0
    manifest = json.loads((tmp_path / "engine" / "manifest.json").read_text())
    assert manifest["build_flags"]["targets"] == ["sm89", "sm120", "sm121"]
    graph = onnx.load(str(tmp_path / "engine" / "model.onnx")).graph
    e4m3 = {i.name for i in graph.initializer if i.data_type == TensorProto.FLOAT8E4M3FN}
    fp8 = {k for k, v in stored(folder).items() if v == "F8_E4M3"}
    assert e4m3 == {k + ".e4m3" for k in fp8}
    assert {n.input[0] for n in graph.node if n.op_type == "DequantizeLinear"} == e4m3
    assert sorted(p.name for p in folder.iterdir()) == before


# -- bad input: one line, exit 2, nothing written ------------------------------------------------

Q = "model.layers.0.self_attn.q_proj"


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
    "scale-missing": (
        lambda f: _edit_tensors(f, lambda t: t.pop(f"{Q}.weight_scale_inv")),
        rf"scale of {Q}\.weight is missing",
    ),
    "scale-mis-shaped": (
        lambda f: _edit_tensors(f, lambda t: t.update({f"{Q}.weight_scale_inv": torch.ones(1, 2)})),
        rf"scale of {Q}\.weight has shape \[1, 2\] but a \[256, 256\] FP8 weight in 128x128 blocks "
        rf"needs \[2, 2\]",
    ),
    "scale-wrong-dtype": (
        lambda f: _edit_tensors(f, lambda t: t.update({f"{Q}.weight_scale_inv": torch.ones(2, 2, dtype=torch.int32)})),
        rf"scale {Q}\.weight_scale_inv of {Q}\.weight is I32",
    ),
    "no-quantization-config": (
        lambda f: edit_config(f, quantization_config=None),
        r"tensor \S+_proj\.weight is F8_E4M3 but config\.json declares no quantization_config",
    ),
    "listed-not-to-convert": (
        lambda f: edit_config(
            f,
            quantization_config={
                "quant_method": "fp8",
                "weight_block_size": [128, 128],
                "modules_to_not_convert": ["q_proj"],
            },
        ),
        rf"{Q}\.weight is F8_E4M3 but quantization_config\.modules_to_not_convert lists {Q}",
    ),
    "fp8-embedding": (
        lambda f: _edit_tensors(
            f, lambda t: t.update({"model.embed_tokens.weight": t["model.embed_tokens.weight"].to(torch.float8_e4m3fn)})
        ),
        r"model\.embed_tokens\.weight is F8_E4M3, but only linear weights are served in FP8",
    ),
    "static-activations": (
        lambda f: edit_config(
            f,
            quantization_config={"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
        ),
        r"'quantization_config\.activation_scheme'='static' is not served",
    ),
    **{
        f"method-{m}": (
            (lambda m: lambda f: edit_config(f, quantization_config={"quant_method": m, "bits": 4}))(m),
            rf"'quantization_config\.quant_method'='{m}' is not served .*\"fp8\"",
        )
        for m in ("gptq", "awq", "bitsandbytes", "compressed-tensors", "mxfp4")
    },
}


@pytest.fixture(scope="module")
def good_fp8(tmp_path_factory: Any) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("bad-base")
    torch.manual_seed(9)
    LlamaForCausalLM(LlamaConfig(**BASE)).save_pretrained(root / "float")
    word_tokenizer(root / "float" / "tokenizer.json", VOCAB)
    return transformers_fp8_save(LlamaForCausalLM, root / "float", root / "fp8", weight_block_size=[128, 128])


@pytest.mark.parametrize("bad", sorted(BAD))
def test_bad_fp8_checkpoints_refused_in_one_line(good_fp8: Path, tmp_path: Path, capsys: Any, bad: str) -> None:
    folder = tmp_path / "ck"
    shutil.copytree(good_fp8, folder)
    damage, needle = BAD[bad]
    damage(folder)
    assert_run_refused(folder, needle, capsys)


def test_inspect_lists_a_bad_scale(good_fp8: Path, tmp_path: Path, capsys: Any) -> None:
    folder = tmp_path / "ck"
    shutil.copytree(good_fp8, folder)
    BAD["scale-mis-shaped"][0](folder)
    capsys.readouterr()
    assert main(["inspect", str(folder), "--json"]) == 1
    problems = json.loads(capsys.readouterr().out)["problems"]
    assert problems == [
        f"scale of {Q}.weight has shape [1, 2] but a [256, 256] FP8 weight in 128x128 blocks needs [2, 2]"
    ]
