"""DeepSeek-V4 / V4.1 checkpoints as they are published: FP8 E4M3 linears with ue8m0
128x128 block scales, FP4 (e2m1) routed experts, DeepSeek's upstream tensor names at the
root, served in their stored formats by ``run`` and ``LLM``.

The folders are laid out exactly as ../shared/notes/checkpoint-formats.md says the hub
ships them: a random transformers ``DeepseekV4ForCausalLM`` is built and saved, its float
weights quantized by :func:`engram_trt.quant.formats.quantize_fp8` /
:func:`~engram_trt.quant.formats.quantize_fp4` (attention ``wq_a wq_b wkv wo_a wo_b``,
the indexer's ``wq_b`` and the shared experts FP8 with ``<name>.scale`` ``F8_E8M0``
[ceil(out/128), ceil(in/128)]; every routed expert's ``w1 w2 w3`` FP4 as ``I8 [out, in/2]``
(low nibble first) with ``F8_E8M0 [out, in/32]`` scales), the compressors', the indexer's
``weights_proj``, the routers, embedding and head BF16, norms / mHC / ``ape`` /
``attn_sink`` / ``gate.bias`` F32, ``tid2eid`` I32, names at the root (``embed.weight``,
``layers.N.attn.wq_a.weight``, ``hc_head_fn``), a few ``mtp.*`` tensors beside them;
config.json with transformers' fields plus ``quantization_config`` {fp8, dynamic, e4m3,
ue8m0, [128, 128]} and ``expert_dtype: "fp4"`` at the top level.

References, all on the CPU in float32:

* Configs whose FP8 dims are multiples of 128 (or a single block below it): transformers
  5.25 ``from_pretrained`` on the very same folder (on a CPU it dequantizes every weight
  on load, exactly: W = e4m3 * 2^scale, e2m1 * 2^scale). Greedy tokens equal through
  ``LLM`` and ``engram-trt run``; fp32 logits within 1e-4 of the largest.
* Configs with partial blocks (dims above 128 that are not multiples of it: hidden 160,
  q_lora_rank 200, ...): transformers' CPU dequant derives the block from the scale grid
  (``rows // scale_rows``: 160 rows in 2 scale rows read as blocks of 80), which is not
  the format (blocks of 128, the last one partial), and transformers' own FP8 save
  leaves such weights in 16 bits. There the reference is transformers loading the float
  folder our float64 dequant of the same bytes writes (per the format), the same
  comparisons; :func:`test_transformers_cpu_dequant_diverges_on_partial_blocks` shows
  the divergence.
* V4.1 (Engram layers; transformers has no V4.1): our float path on that float folder
  (tests/models/deepseek_v4/test_deepseek_v4_parity.py and
  tests/models/deepseek_v4/test_deepseek_v41_engram.py hold it to transformers and to float64),
  tokens equal and logits within 1e-4.

Memory: every quantized module holds its stored dtypes (no float copy), the routed
experts' per-expert tensors are views of one stack per projection, the model's weight
bytes equal the stored bytes of those tensors; the loop MoE dequantizes one expert at a
time. Bad input (missing / mis-shaped / wrong-dtype scales, an odd FP4 inner size, FP8
without quantization_config or listed in modules_to_not_convert, unserved quant methods)
is refused by ``run`` in one line, exit 2, nothing loaded or written.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import types
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from helpers.checkpoints import (  # noqa: E402
    assert_fp32_logits_match,
    edit_config,
    llm_greedy,
    transformers_greedy,
)
from helpers.cli import assert_run_refused, run_json  # noqa: E402

from engram_trt.quant.formats import dequantize_fp8, quantize_fp8  # noqa: E402

from helpers.deepseek_v4_quant import (  # noqa: E402
    CASES,
    FP8_LINEAR,
    PROMPTS,
    ROUTED,
    add_engram,
    dequantized_folder,
    hf_load,
    quantize_folder,
    save_float_v4,
)

NEW_TOKENS = 8


def _load(folder: Path, dtype: torch.dtype = torch.float32) -> Any:
    from engram_trt.models.registry import open_checkpoint

    ckpt = open_checkpoint(folder)
    model = ckpt.architecture.load_model(ckpt, device="cpu", dtype=dtype)
    ckpt.close()
    return model


def _logits(model: Any, prompt: list[int]) -> torch.Tensor:
    from engram_trt.models.step import PackedStep

    return model.forward_step(
        PackedStep(torch.tensor(prompt), [len(prompt)], [0], [0]), model.new_cache(1, 64), all_logits=True
    ).double()


class Case:
    """One config's folders: ``q`` (as the hub ships it), ``deq`` (its float64 dequant,
    transformers' names) and the reference's tokens / logits source."""

    def __init__(self, name: str, root: Path) -> None:
        overrides, self.v41, self.partial = CASES[name]
        self.name = name
        src, self.q, self.deq = root / "float", root / "q", root / "deq"
        save_float_v4(src, seed=len(name) + 3, **overrides)
        if self.v41:
            add_engram(src, seed=len(name))
        quantize_folder(src, self.q)
        dequantized_folder(self.q, self.deq)
        # transformers reads the very folder where its CPU dequant is the format's; else the float folder
        self.hf = None if self.v41 else hf_load(self.deq if self.partial else self.q)

    def greedy(self) -> list[list[int]]:
        if self.hf is not None:
            return [transformers_greedy(self.hf, p, NEW_TOKENS) for p in PROMPTS]
        return llm_greedy(self.deq, PROMPTS, NEW_TOKENS)  # V4.1: our float path (module docstring)


_MADE: dict[str, Case] = {}


def made(name: str, tmp_path_factory: Any) -> Case:
    """Each case's folders and reference, made once per test session."""
    if name not in _MADE:
        _MADE[name] = Case(name, tmp_path_factory.mktemp(name))
    return _MADE[name]


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request: Any, tmp_path_factory: Any) -> Case:
    return made(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def small(tmp_path_factory: Any) -> Case:
    return made("v4-128-hash1", tmp_path_factory)


# ------------------------------------------------------------------------------ tests
def test_config_carries_the_quant_spec_and_the_formats_are_the_stored_ones(case: Case) -> None:
    """config.quant from quantization_config + the top-level expert_dtype; every weight
    resolved to its root name, FP8 / FP4 where stored so, no problem, no unused tensor
    (mtp.* accepted)."""
    from engram_trt.models.registry import open_checkpoint

    ckpt = open_checkpoint(case.q)
    q = ckpt.config.quant
    assert (q.method, q.block, q.scale_fmt, q.expert_dtype) == ("fp8", (128, 128), "ue8m0", "fp4")
    assert ckpt.architecture.checkpoint_problems(ckpt) == []
    formats = ckpt.architecture.weight_formats(ckpt)
    stored = set(ckpt.tensor_names())
    scales = {n for n in stored if n.endswith(".scale") and not n.startswith("mtp.")}
    tables = {n for n in stored if n.endswith(".engram.embed.weight")}  # V4.1's tables: the runtime's, not weights
    assert set(formats) | scales | tables == {n for n in stored if not n.startswith("mtp.")}
    for name, (kind, nbytes, gpu) in formats.items():
        want = (
            "fp8"
            if FP8_LINEAR.search(name)
            else "fp4"
            if ROUTED.search(name)
            else "int"
            if name.endswith("tid2eid")
            else "float"
        )
        assert kind == want, name
        if kind in ("fp8", "fp4"):
            scale = name[: -len(".weight")] + ".scale"
            assert nbytes == gpu == ckpt.nbytes(name) + ckpt.nbytes(scale)
    ckpt.close()


def test_llm_greedy_tokens_equal_the_reference(case: Case) -> None:
    assert llm_greedy(case.q, PROMPTS, NEW_TOKENS) == case.greedy()


def test_run_command_equals_the_reference(case: Case, capsys: Any) -> None:
    assert run_json(case.q, PROMPTS[0], NEW_TOKENS, capsys)["token_ids"] == case.greedy()[0]


def test_fp32_logits_within_1e4_of_the_reference(case: Case) -> None:
    ours = _load(case.q)
    if case.hf is not None:
        assert_fp32_logits_match(case.hf, ours, PROMPTS)
        return
    from engram_trt.tables.base import TableStore

    ref = _load(case.deq)
    for m, folder in ((ours, case.q), (ref, case.deq)):  # V4.1: both gather their rows from the same tables
        from engram_trt.models.registry import open_checkpoint

        ckpt = open_checkpoint(folder)
        ids = m.config.engram.layer_ids
        m.set_tables(
            TableStore.from_tensors(
                [ckpt.get(f"model.layers.{i}.engram.embed.weight") for i in ids], [None] * len(ids), 32, ids
            )
        )
        ckpt.close()
    for p in PROMPTS:
        want, got = _logits(ref, p), _logits(ours, p)
        assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()


def test_quantized_modules_hold_the_stored_bytes(case: Case) -> None:
    """No float copy of a quantized weight: each QuantLinear / QuantGroupedLinear holds
    the stored dtypes with the checkpoint's very bytes; a layer's routed experts are
    views of one stack per projection; the model's weight bytes are the checkpoint's
    stored bytes of its quantized tensors plus its float tensors in float32."""
    from engram_trt.models.deepseek_v4.modules import QuantGroupedLinear
    from engram_trt.models.deepseek_v4.moe import GroupedSparseMoE
    from engram_trt.models.deepseek_v4.weights import checkpoint_name, checkpoint_names, module_bytes
    from engram_trt.models.registry import open_checkpoint
    from engram_trt.quant.weight import QuantLinear

    ckpt = open_checkpoint(case.q)
    model = ckpt.architecture.load_model(ckpt, device="cpu", dtype=torch.float32)
    stored = set(ckpt.tensor_names())
    quant_bytes, seen = 0, 0
    for mod_name, mod in model.named_modules():
        if isinstance(mod, (QuantLinear, QuantGroupedLinear)):
            seen += 1
            name = next(n for n in checkpoint_names(checkpoint_name(f"{mod_name}.weight")) if n in stored)
            data, scale = ckpt.get(name), ckpt.get(name[: -len(".weight")] + ".scale")
            assert mod.weight.dtype == (torch.int8 if mod.kind == "fp4" else torch.float8_e4m3fn)
            assert mod.weight_scale_inv.dtype == torch.float8_e8m0fnu
            assert torch.equal(mod.weight.view(torch.uint8), data.view(torch.uint8))
            assert torch.equal(mod.weight_scale_inv.view(torch.uint8), scale.view(torch.uint8))
            quant_bytes += ckpt.nbytes(name) + ckpt.nbytes(name[: -len(".weight")] + ".scale")
        elif isinstance(mod, torch.nn.Linear):
            assert mod.weight.dtype == torch.float32 and not FP8_LINEAR.search(checkpoint_name(f"{mod_name}.weight"))
    n_fp8 = sum(1 for n in stored if FP8_LINEAR.search(n) and not n.startswith("mtp."))
    n_fp4 = sum(1 for n in stored if ROUTED.search(n))
    assert seen == n_fp8 + n_fp4
    for layer in model.model.layers:
        moe = layer.mlp
        assert isinstance(moe, GroupedSparseMoE) and moe.quantized_experts
        gate, up, down = moe.stack_experts()
        for i, e in enumerate(moe.experts):
            assert e.gate_proj.weight.data_ptr() == gate.data[i].data_ptr()
            assert e.down_proj.weight_scale_inv.data_ptr() == down.scale[i].data_ptr()
    float_bytes = sum(
        t.numel() * 4 for n, t in model.state_dict().items() if t.is_floating_point() and t.dtype == torch.float32
    )
    assert module_bytes(model) == quant_bytes + float_bytes + sum(
        t.numel() * 8 for n, t in model.state_dict().items() if t.dtype == torch.int64
    )
    ckpt.close()


def test_the_loop_moe_dequantizes_one_expert_at_a_time(monkeypatch: Any, small: Case) -> None:
    """The CPU form of the MoE over FP4 experts: each dequantization is one expert's one
    weight (never a stack), and the whole forward runs."""
    from engram_trt.quant.weight import QuantWeight

    model = _load(small.q)
    seen: list[tuple[int, ...]] = []
    real = QuantWeight.dequantize
    monkeypatch.setattr(
        QuantWeight,
        "dequantize",
        lambda self, dtype=torch.float32: seen.append(tuple(self.data.shape)) or real(self, dtype),
    )
    model.model.layers[1].mlp(torch.randn(5, 128), torch.tensor([5, 6, 7, 8, 9]))
    assert seen and all(len(s) == 2 for s in seen)  # [N, K(/2)] of one expert, never [E, ...]


def test_transformers_spelling_loads_the_same_model(small: Case, tmp_path: Path) -> None:
    """The same bytes under transformers' names (``model.`` prefix, scales as
    ``.weight_scale_inv``) load into the same model: logits equal bit for bit."""
    tf = tmp_path / "tf-names"
    quantize_folder(small.q.parent / "float", tf, hub=False, scale_suffix=".weight_scale_inv", mtp=False)
    a, b = _load(small.q), _load(tf)
    assert torch.equal(_logits(a, PROMPTS[0]), _logits(b, PROMPTS[0]))


def test_transformers_own_fp8_save_of_this_family_loads(small: Case, tmp_path: Path, monkeypatch: Any) -> None:
    """What transformers' own FP8 save of DeepSeek-V4 writes, and that it loads. transformers
    keeps the FP8 / FP4 modules only where it finds a GPU; with that environment check
    stubbed (the modules are built and filled, nothing is computed) ``save_pretrained``
    of the hub folder writes transformers' names (``model.`` prefix) with one ``.scale``
    per weight, per expert included: no merged ``experts.gate_up_proj_scale_inv``. Our
    loader reads that folder into the model the hub folder gives, logits equal."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM
    from transformers.quantizers import quantizer_finegrained_fp8

    monkeypatch.setattr(
        quantizer_finegrained_fp8.FineGrainedFP8HfQuantizer, "validate_environment", lambda self, *a, **k: None
    )
    model = AutoModelForCausalLM.from_pretrained(str(small.q), use_kernels=False)
    saved = tmp_path / "saved"
    model.save_pretrained(saved)
    shutil.copy(small.q / "tokenizer.json", saved / "tokenizer.json")
    with safe_open(str(saved / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.1.ffn.experts.2.w1.scale" in names and "model.layers.0.attn.wq_a.scale" in names
    assert not any(n.endswith("_scale_inv") for n in names)
    assert all(n.startswith("model.") or n == "head.weight" for n in names)
    assert torch.equal(_logits(_load(saved), PROMPTS[0]), _logits(_load(small.q), PROMPTS[0]))


def test_transformers_cpu_dequant_diverges_on_partial_blocks() -> None:
    """Why the partial-block cases' reference is the float folder: transformers'
    ``Fp8Dequantize`` reads a [160, 160] weight's 2x2 scale grid as 80x80 blocks, the
    format (and our loader) as 128x128 blocks with a partial last one."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(160, 160, generator=gen) * torch.linspace(0.01, 4, 160)
    q, s = quantize_fp8(w, (128, 128), "ue8m0")
    ours = dequantize_fp8(q, s, (128, 128), torch.float64)
    assert (ours - w.double()).abs().max() <= 2**-4 * w.abs().max()  # the format round-trips within e4m3's step
    theirs = Fp8Dequantize(None)._dequantize_one(q, s, output_dtype=torch.float32).double()
    assert not torch.equal(theirs, ours)
    assert torch.equal(theirs[:80, :80], ours[:80, :80])  # the first 80x80 agree: both read scale [0, 0] there


# ------------------------------------------------------------------------------ the MoE's kernels form
@pytest.fixture
def fake_native_quant(monkeypatch: Any) -> list[dict[str, Any]]:
    """A stand-in ``engram_trt.native.quant`` (the kernels engineer's module, absent on
    this branch): records each experts() call and computes it from the dequantized
    stacks, the documented contract."""
    calls: list[dict[str, Any]] = []

    def unavailable_for(x: torch.Tensor, qw: Any) -> str | None:
        return None

    def unavailable_for_experts(x: torch.Tensor, ids: Any, gate: Any, up: Any, down: Any) -> str | None:
        return None

    def experts(
        x: torch.Tensor,
        ids: torch.Tensor,
        route_w: torch.Tensor,
        gate: Any,
        up: Any,
        down: Any,
        *,
        limit: float | None,
        plan: Any = None,
    ) -> torch.Tensor:
        calls.append(dict(gate=gate, up=up, down=down, route_w=route_w, ids=ids, limit=limit, plan=plan))
        deq = [w.double() if isinstance(w, torch.Tensor) else w.dequantize(torch.float64) for w in (gate, up, down)]
        out = torch.zeros(x.shape, dtype=torch.float64)
        for t in range(x.shape[0]):
            for j in range(ids.shape[1]):
                e = int(ids[t, j])
                g, u = deq[0][e] @ x[t].double(), deq[1][e] @ x[t].double()
                h = torch.nn.functional.silu(g.clamp(max=limit)) * u.clamp(-limit, limit)
                out[t] += float(route_w[t, j]) * (deq[2][e] @ h)
        return out.to(x.dtype)

    fake = types.ModuleType("engram_trt.native.quant")
    fake.unavailable_for, fake.experts = unavailable_for, experts  # type: ignore[attr-defined]
    fake.unavailable_for_experts = unavailable_for_experts  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "engram_trt.native.quant", fake)
    import engram_trt.native as native

    monkeypatch.setattr(native, "quant", fake, raising=False)
    return calls


@pytest.mark.parametrize("which", ["fp4", "float"])
def test_kernels_form_hands_the_stored_stacks_to_native_experts(
    which: str, small: Case, fake_native_quant: list[dict[str, Any]]
) -> None:
    """Form ``kernels`` calls native.quant.experts with the layer's stacks as stored
    (QuantWeights whose bytes are the experts' own, or the float stacks), float32 routing
    weights and the SwiGLU limit, and equals the loop; auto keeps the loop on a CPU."""
    from engram_trt.quant.weight import QuantWeight

    model = _load(small.q if which == "fp4" else small.deq)
    moe = model.model.layers[1].mlp
    x, ids = torch.randn(6, 128, generator=torch.Generator().manual_seed(3)), torch.arange(6) + 5
    moe.form = "auto"
    want = moe(x, ids)
    assert moe.last_form == "loop" and not fake_native_quant
    moe.form = "kernels"
    got = moe(x, ids)
    assert moe.last_form == "kernels" and len(fake_native_quant) == 1
    call = fake_native_quant[0]
    assert call["route_w"].dtype == torch.float32 and call["limit"] == model.config.swiglu_limit
    for proj, stack in zip(("gate_proj", "up_proj", "down_proj"), (call["gate"], call["up"], call["down"])):
        assert isinstance(stack, QuantWeight) == (which == "fp4")
        data = stack.data if isinstance(stack, QuantWeight) else stack
        assert data.shape[0] == len(moe.experts)
        assert data[2].data_ptr() == getattr(moe.experts[2], proj).weight.data_ptr()  # the very bytes, no copy
    # the fake sums in float64, the loop in float32 (128-wide products): within float32 round-off of the largest
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def test_float_forms_refuse_quantized_experts(small: Case) -> None:
    from engram_trt.errors import EngramError

    moe = _load(small.q).model.layers[1].mlp
    moe.form = "dense"
    with pytest.raises(
        EngramError, match="form 'dense' reads float expert weights, but layer 1's experts are stored fp4"
    ):
        moe(torch.randn(2, 128), torch.tensor([5, 6]))


# ------------------------------------------------------------------------------ bad input
@pytest.fixture(scope="module")
def good_q(small: Case) -> Path:
    return small.q


def _retensor(folder: Path, change: Any) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _set(name: str, value: Any) -> Any:
    def change(t: dict[str, torch.Tensor]) -> None:
        if value is None:
            del t[name]
        else:
            t[name] = value(t[name])

    return change


def _quant(**changes: Any) -> Any:
    def edit(folder: Path) -> None:
        d = json.loads((folder / "config.json").read_text())
        d["quantization_config"].update(changes)
        (folder / "config.json").write_text(json.dumps(d))

    return edit


WQA = "layers.0.attn.wq_a"
W1 = "layers.1.ffn.experts.2.w1"
BAD: dict[str, tuple[Any, str]] = {
    "missing-scale": (
        lambda f: _retensor(f, _set(f"{WQA}.scale", None)),
        rf"scale of {WQA}\.weight is missing: an FP8 weight needs its block scales",
    ),
    "fp8-scale-shape": (
        lambda f: _retensor(f, _set(f"{WQA}.scale", lambda s: s.repeat(2, 1))),
        rf"scale of {WQA}\.weight has shape \[2, 1\] but a \[128, 128\] FP8 weight in 128x128 blocks "
        r"needs \[1, 1\]",
    ),
    "fp4-scale-shape": (
        lambda f: _retensor(f, _set(f"{W1}.scale", lambda s: s[:, :2].contiguous())),
        rf"scale of {W1}\.weight has shape \[128, 2\] but a \[128, 128\] FP4 weight in 1x32 blocks "
        r"needs \[128, 4\]",
    ),
    "scale-dtype": (
        lambda f: _retensor(f, _set(f"{WQA}.scale", lambda s: s.float())),
        rf"scale {WQA}\.scale is F32 but quantization_config\.scale_fmt is 'ue8m0': expected F8_E8M0 "
        r"or U8",
    ),
    "fp8-without-quantization-config": (
        lambda f: edit_config(f, quantization_config=None, expert_dtype=None),
        rf"tensor {WQA}\.weight is F8_E4M3 but config.json declares no quantization_config",
    ),
    "fp8-in-modules-to-not-convert": (
        _quant(modules_to_not_convert=["wq_a"]),
        rf"tensor {WQA}\.weight is F8_E4M3 but quantization_config\."
        r"modules_to_not_convert lists its module",
    ),
    "fp8-embedding": (
        lambda f: _retensor(f, _set("embed.weight", lambda t: t.to(torch.float8_e4m3fn))),
        r"tensor embed\.weight is F8_E4M3 but engram-trt serves FP8 / FP4 only for the linear "
        r"projections",
    ),
    "fp4-without-expert-dtype": (
        lambda f: edit_config(f, expert_dtype=None),
        r"tensor layers\.0\.ffn\.experts\.0\.w1\.weight is I8 \(packed FP4\) but the config's "
        r"expert_dtype is 'fp8'",
    ),
    "expert-dtype-contradiction": (
        lambda f: (edit_config(f, expert_dtype="fp8"), _quant(expert_dtype="fp4")(f)),
        r"'expert_dtype'='fp8' at the top level contradicts "
        r"'quantization_config\.expert_dtype'",
    ),
    **{
        f"quant-method-{m}": (
            _quant(quant_method=m),
            rf"field 'quantization_config\.quant_method'='{m}' is not served by engram-trt",
        )
        for m in ("awq", "gptq", "bitsandbytes", "compressed-tensors", "mxfp4")
    },
}


@pytest.mark.parametrize("bad", sorted(BAD))
def test_bad_quantized_checkpoints_refused_in_one_line(
    bad: str, good_q: Path, tmp_path: Path, capsys: Any, monkeypatch: Any
) -> None:
    """``engram-trt run``: exit 2, one line naming the tensor or field, nothing written
    into the folder and nothing loaded (the loader is never reached)."""
    import engram_trt.models.deepseek_v4.model as dsv4_model

    folder = tmp_path / "ck"
    shutil.copytree(good_q, folder)
    damage, needle = BAD[bad]
    damage(folder)
    loaded: list[Any] = []
    monkeypatch.setattr(dsv4_model, "load_into", lambda *a, **k: loaded.append(a))
    assert_run_refused(folder, needle, capsys)
    assert not loaded


def test_fp4_weight_with_an_odd_inner_size_is_refused(tmp_path: Path, capsys: Any) -> None:
    """moe_intermediate_size 33: the experts' w2 would hold 33 e2m1 values a row, which do
    not pack into bytes: refused naming the tensor (its stored bytes hold 16 a row)."""
    from safetensors.torch import load_file, save_file

    save_float_v4(tmp_path / "float", seed=9, **dict(CASES["v4-128-hash1"][0], moe_intermediate_size=33))
    src = load_file(str(tmp_path / "float" / "model.safetensors"))
    routed_w2 = re.compile(r"\.experts\.\d+\.w2\.weight$")
    fixed = {
        n: (t[..., :32].contiguous() if routed_w2.search(n) else t) for n, t in src.items()
    }  # quantize_fp4 packs whole groups of 32
    save_file(fixed, str(tmp_path / "float" / "model.safetensors"), metadata={"format": "pt"})
    quantize_folder(tmp_path / "float", tmp_path / "q")
    folder = tmp_path / "q"
    assert_run_refused(
        folder, r"tensor layers\.0\.ffn\.experts\.0\.w2\.weight is FP4 with an odd inner size 33", capsys
    )


# ------------------------------------------------------------------------------ inspect
def _header_bytes(folder: Path) -> dict[str, int]:
    """Bytes per stored dtype read from the safetensors header with the library itself."""
    from safetensors import safe_open

    out: dict[str, int] = {}
    size = {"F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "BF16": 2, "F16": 2, "F32": 4, "I32": 4, "I64": 8}
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        for k in f.keys():
            sl = f.get_slice(k)
            n = 1
            for d in sl.get_shape():
                n *= d
            out[sl.get_dtype()] = out.get(sl.get_dtype(), 0) + n * size[sl.get_dtype()]
    return out


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_inspect_reports_stored_bytes_quantization_and_the_load(small: Case, dtype: str, capsys: Any) -> None:
    """``engram-trt inspect --json``: bytes per stored dtype as the header says, the
    declared quantization, and the GPU bytes of a load at --dtype equal to what our
    loader then holds (loaded here on the CPU in that dtype); the text names them too."""
    from engram_trt.cli.main import main
    from engram_trt.models.deepseek_v4.weights import module_bytes

    capsys.readouterr()
    assert main(["inspect", str(small.q), "--json", "--dtype", dtype]) == 0
    rep = json.loads(capsys.readouterr().out)
    w = rep["weights"]
    assert w["stored_bytes"] == _header_bytes(small.q)
    assert w["quantization"] == "fp8 e4m3 (128x128 blocks, ue8m0 scales, dynamic activations), experts fp4"
    load = w["load"]
    model = _load(small.q, torch.float32 if dtype == "fp32" else torch.bfloat16)
    assert load["dtype"] == dtype and load["gpu_bytes"] == module_bytes(model)
    stored = _header_bytes(small.q)
    mtp = sum(
        t.numel() * t.element_size()
        for n, t in _mtp_tensors(small.q).items()
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int8)
    )
    assert (
        load["by_kind"]["fp8"]["gpu_bytes"] + load["by_kind"]["fp4"]["gpu_bytes"]
        == stored["F8_E4M3"] + stored["I8"] + stored["F8_E8M0"] - mtp
    )
    assert main(["inspect", str(small.q), "--dtype", dtype]) == 0
    text = capsys.readouterr().out
    assert "quantization fp8 e4m3 (128x128 blocks, ue8m0 scales, dynamic activations), experts fp4" in text
    assert re.search(rf"GPU weights .* at --dtype {dtype} \(.*fp4 .* as stored, fp8 .* as stored", text), text
    assert re.search(r"stored +F8_E4M3 .*\(FP8\).*I8 .*\(FP4 experts\)", text), text


def _mtp_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {n: t for n, t in load_file(str(folder / "model.safetensors")).items() if n.startswith("mtp.")}


def test_inspect_float_folder_counts_the_serving_dtype(small: Case, capsys: Any) -> None:
    """The dequantized (float32) folder: no quantization, and at bf16 its quantized
    weights take 2 bytes a value where the FP8 / FP4 folder takes its stored bytes."""
    from engram_trt.cli.main import main

    capsys.readouterr()
    assert main(["inspect", str(small.deq), "--json", "--dtype", "bf16"]) == 0
    rep = json.loads(capsys.readouterr().out)["weights"]
    assert rep["quantization"] is None and set(rep["load"]["by_kind"]) == {"float", "int"}
    assert main(["inspect", str(small.q), "--json", "--dtype", "bf16"]) == 0
    q = json.loads(capsys.readouterr().out)["weights"]["load"]
    quant_values = 0
    from safetensors import safe_open

    with safe_open(str(small.deq / "model.safetensors"), "pt") as f:
        for k in f.keys():
            if FP8_LINEAR.search(k) or ROUTED.search(k):
                n = 1
                for d in f.get_slice(k).get_shape():
                    n *= d
                quant_values += n
    assert (
        rep["load"]["gpu_bytes"] - q["gpu_bytes"]
        == 2 * quant_values - q["by_kind"]["fp8"]["gpu_bytes"] - q["by_kind"]["fp4"]["gpu_bytes"]
    )
