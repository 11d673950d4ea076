"""Fine-grained FP8 checkpoints of engram-llama and Qwen4Exp on a GPU through the torch
backend (issue 40 items 1, 2 and 5). The CPU suite holds the same folders to
transformers (tests/quant/test_llama_fp8.py, tests/quant/test_qwen4_exp_fp8.py); here the CUDA
model is held to the CPU model. The folders are written here (no transformers on the
GPU host needed): random float weights with dims multiples of 128 (the FP8 kernels' full
blocks), every linear quantized per the formats note (quant.formats.quantize_fp8: E4M3,
one float32 scale per 128x128 block, ``weight_scale_inv``), the Qwen4Exp routed experts
with transformers' merged ``gate_up_proj_scale_inv`` / ``down_proj_scale_inv``, its PLE
table an FP8Embedding (one float32 scale per table).

Per model:
  1. memory: the CUDA model's FP8 linears hold the stored bytes and scales on the device
     (float8_e4m3fn; float32), exactly the checkpoint's FP8 bytes.
  2. ``QuantLinear.backend = "torch"`` (each weight dequantized for its product): float32
     CUDA logits within 1e-5 relative of the CPU model's (the same math) and its greedy
     tokens equal.
  3. the kernel library (``auto``: engram_trt.native.quant, activations quantized per
     token and 128 columns as the reference FP8 inference does): bf16 logits against the
     CPU model computing the same formats in float32 (activations through
     quant.formats.act_quant before each FP8 product) within 3x the bf16 round-off of the
     same model on the dequantizing path (measured in this run, not a fixed number).
  4. decode: the recorded decode graphs' tokens equal the eager decode steps' (Qwen4Exp:
     the FP8 experts through native.quant.experts on the sync-free path); FP8 PLE rows
     gathered on the GPU equal the CPU's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from .helpers import load_checkpoint, note

PROMPTS = [[5, 17, 33, 2, 90, 41, 7, 7, 60], [2, 2, 3, 44], [11, 12, 13, 14, 2, 16, 17, 18, 19, 20, 21, 22, 23]]
EOS = 2


def _quantize_linears(tensors: dict, names: list[str]) -> dict:
    from engram_trt.quant.formats import quantize_fp8

    for k in names:
        q, s = quantize_fp8(tensors[k], (128, 128), "float")
        tensors[k] = q
        tensors[k[: -len(".weight")] + ".weight_scale_inv"] = s
    return tensors


def _write(folder: Path, cfg: dict, tensors: dict) -> Path:
    """config.json, one safetensors file and a word-level tokenizer (``w<i>`` is id i)."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(cfg["vocab_size"])}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"), metadata={"format": "pt"}
    )
    return folder


QC = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128], "scale_fmt": "float"}


def llama_fp8_folder(root: Path) -> Path:
    """A plain Llama (hidden 256, 4 heads of 64, 2 KV heads, MLP 384, untied head) with every
    projection FP8."""
    import torch

    from engram_trt.config.model import ModelConfig
    from engram_trt.models.engram_llama.weights import model_weight_shapes

    cfg = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=256,
        hidden_size=256,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=EOS,
        tie_word_embeddings=False,
        quantization_config=QC,
    )
    gen = torch.Generator().manual_seed(11)
    tensors = {
        n: (torch.randn(s, generator=gen) * (0.08 if len(s) == 2 else 0.1) + (1.0 if len(s) == 1 else 0.0))
        for n, s in model_weight_shapes(ModelConfig.from_dict(cfg)).items()
    }
    tensors = _quantize_linears(tensors, [n for n in tensors if n.endswith("_proj.weight")])
    return _write(root / "llama-fp8", cfg, tensors)


def qwen4_fp8_folder(root: Path) -> Path:
    """A Qwen4Exp of hidden 128 (experts of I = 128 with merged scales, PLE on layer 1 as an
    FP8Embedding whose 240 rows are 80 shards of 3), its linears FP8 where the dims divide
    by 128 (as transformers' save leaves them)."""
    import torch

    from engram_trt.models.qwen4_exp.config import read_config
    from engram_trt.models.qwen4_exp.model import model_weight_shapes
    from engram_trt.models.qwen4_exp.ple_tables import chunk_rows, ple_layout
    from engram_trt.models.registry import resolve

    cfg = dict(
        architectures=["Qwen4ExpForCausalLM"],
        model_type="qwen4_exp_text",
        vocab_size=96,
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_conv_kernel_dim=4,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        num_experts=4,
        num_experts_per_tok=2,
        hc_count=2,
        hc_lowrank=128,
        max_position_embeddings=256,
        eos_token_id=EOS,
        bos_token_id=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        indexer_n_heads=2,
        indexer_kv_heads=1,
        indexer_head_dim=64,
        indexer_budget=4,
        indexer_compress_ratio=2,
        ple_layer_ids=[1],
        ple_embed_dim=128,
        ngram_size=3,
        heads_per_ngram=2,
        ngram_vocab_size_base=50,
        make_ngram_vocab_size_divisible_by=8,
        split_ngram_parts=100,
        quantization_config=dict(QC, modules_to_convert=["ngram_embedding"]),
    )
    config = read_config(cfg)
    gen = torch.Generator().manual_seed(12)
    tensors = {}
    for n, s in model_weight_shapes(config).items():
        # small weights: a random model this deep is otherwise chaotic (bf16 round-off alone
        # would move its logits by tens of percent, hiding what the check measures)
        scale = 1.0 if "embed" in n else 0.08 if len(s) >= 2 else 0.02
        t = torch.randn(s, generator=gen) * scale
        tensors[n] = torch.rand(s, generator=gen) * 2 - 1 if n.endswith("A_log") else t
    linears = [n for n in resolve(cfg).linear_names(config) if all(d % 128 == 0 for d in tensors[n].shape)]
    experts = [n for n in linears if ".mlp.experts." in n]
    tensors = _quantize_linears(tensors, [n for n in linears if n not in experts])
    from engram_trt.quant.formats import quantize_fp8

    for layer in range(config.num_hidden_layers):  # transformers' merged expert scales
        base = f"model.layers.{layer}.mlp.experts"
        gate_up, down = [], []
        for e in range(config.num_experts):
            fused = torch.cat([tensors[f"{base}.{e}.gate_proj.weight"], tensors[f"{base}.{e}.up_proj.weight"]])
            q, s = quantize_fp8(fused, (128, 128))
            tensors[f"{base}.{e}.gate_proj.weight"], tensors[f"{base}.{e}.up_proj.weight"] = q.chunk(2)
            gate_up.append(s)
            q, s = quantize_fp8(tensors[f"{base}.{e}.down_proj.weight"], (128, 128))
            tensors[f"{base}.{e}.down_proj.weight"] = q
            down.append(s)
        tensors[f"{base}.gate_up_proj_scale_inv"] = torch.stack(gate_up)
        tensors[f"{base}.down_proj_scale_inv"] = torch.stack(down)
    rows = int(ple_layout(config).table_rows[0])
    table = torch.randn(rows, config.ple.head_dim, generator=gen)
    tscale = (table.abs().max() / 448).reshape(1)
    stem = "model.layers.0.ple.ple_embedding.ngram_embedding"
    for i, part in enumerate(torch.split((table / tscale).to(torch.float8_e4m3fn), chunk_rows(rows, 100))):
        tensors[f"{stem}.shard_{i}.weight"] = part
    tensors[f"{stem}.weight_scale"] = tscale
    return _write(root / "qwen4-fp8", cfg, tensors)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: Any) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8")
    return {"engram-llama": llama_fp8_folder(root), "qwen4-exp": qwen4_fp8_folder(root)}


def _prefill_logits(model: Any, prompt: list[int]) -> Any:
    import torch

    from engram_trt.models.step import PackedStep

    return model.forward_step(
        PackedStep(torch.tensor(prompt), [len(prompt)], [0], [0]), model.new_cache(1, 64), all_logits=True
    )


class _ActQuantCPU:
    """While open, the CPU QuantLinear products quantize their activations as the GPU's
    FP8 inference does (quant.formats.act_quant: per token and 128 columns, float32
    scales): the CPU reference of the kernel path's formats."""

    def __enter__(self) -> "_ActQuantCPU":
        import torch.nn.functional as F

        from engram_trt.quant import weight as qweight
        from engram_trt.quant.formats import act_quant

        self._saved = qweight.QuantLinear.forward

        def forward(module: Any, x: Any) -> Any:
            q = act_quant(x.reshape(-1, x.shape[-1]), 128)[2].reshape(x.shape).to(x.dtype)
            return F.linear(q, module.qweight.dequantize().to(x.dtype))

        qweight.QuantLinear.forward = forward
        return self

    def __exit__(self, *exc: Any) -> None:
        from engram_trt.quant import weight as qweight

        qweight.QuantLinear.forward = self._saved


@pytest.mark.parametrize("arch", ["engram-llama", "qwen4-exp"])
def test_fp8_model_on_cuda(folders: dict[str, Path], arch: str) -> None:
    import torch

    from .cases import rel_err
    from engram_trt.models.step import greedy_tokens
    from engram_trt.quant.weight import QuantLinear

    folder = folders[arch]
    from safetensors.torch import load_file

    stored = load_file(str(folder / "model.safetensors"))
    ckpt_c, cpu = load_checkpoint(folder, "cpu", torch.float32)
    # 1. the stored bytes on the device
    ckpt_g, gpu32 = load_checkpoint(folder, "cuda", torch.float32)
    quant = [m for m in gpu32.modules() if isinstance(m, QuantLinear)]
    on_dev = all(
        m.weight.is_cuda and m.weight.dtype == torch.float8_e4m3fn and m.weight_scale_inv.is_cuda for m in quant
    )
    held = sum(m.weight.numel() for m in quant)
    want = sum(t.numel() for k, t in stored.items() if t.dtype == torch.float8_e4m3fn and ".ngram_embedding." not in k)
    assert on_dev and held == want > 0, (
        f"{arch}: FP8 linears hold the stored bytes on the GPU: {len(quant)} QuantLinear, {held} bytes held, {want} "
        "stored"
    )
    # 2. the dequantizing path on CUDA: the CPU model's math
    QuantLinear.backend = "torch"
    try:
        for i, p in enumerate(PROMPTS):
            err = rel_err(_prefill_logits(gpu32, p), _prefill_logits(cpu, p))
            assert err <= 1e-5, (
                f"{arch} prompt {i}: fp32 CUDA (dequantizing) logits within 1e-5 of the CPU's: rel L2 {err:.2e}"
            )
        got = greedy_tokens(gpu32, PROMPTS[0], 8, ignore_eos=True)
        want_tokens = greedy_tokens(cpu, PROMPTS[0], 8, ignore_eos=True)
        assert got == want_tokens, (
            f"{arch}: fp32 CUDA (dequantizing) greedy tokens equal the CPU's: {got} vs {want_tokens}"
        )
        ckpt_b, gpu16 = load_checkpoint(folder, "cuda", torch.bfloat16)
        round_off = [rel_err(_prefill_logits(gpu16, p), _prefill_logits(cpu, p)) for p in PROMPTS]
    finally:
        QuantLinear.backend = "auto"
    # 3. the kernel library, against the CPU computing the same formats
    try:
        from engram_trt.native import quant as native_quant  # noqa: F401
    except ImportError as exc:
        assert False, f"{arch}: engram_trt.native.quant importable: {exc}"
        return
    with _ActQuantCPU():
        refs = [_prefill_logits(cpu, p) for p in PROMPTS]
    for i, p in enumerate(PROMPTS):
        err = rel_err(_prefill_logits(gpu16, p), refs[i])
        bound = 3 * round_off[i]
        note(f"{arch}_kernels_rel_l2_prompt{i}", err)
        assert err <= bound, (
            f"{arch} prompt {i}: bf16 FP8 kernels within 3x the bf16 round-off of the CPU's FP8 formats: "
            f"rel L2 {err:.2e}, bound {bound:.2e}"
        )
    # 4. decode steps: graphs against eager
    from engram_trt import LLM, SamplingParams

    outs = {}
    for graphs in (False, True):
        with LLM(str(folder), backend="torch", device="cuda", dtype="bf16", cuda_graphs=graphs) as llm:
            res = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
            outs[graphs] = [list(o.outputs[0].token_ids) for o in res]
    assert outs[True] == outs[False], (
        f"{arch}: LLM bf16 decode graphs' tokens equal eager decode's: {outs[True]} vs {outs[False]}"
    )
    if arch == "qwen4-exp":
        ids = torch.randint(0, cpu.ple_tables.num_rows(0), (64,))
        got = gpu16.ple_tables.gather(0, ids.cuda()).cpu()
        want_rows = cpu.ple_tables.gather(0, ids)
        assert torch.equal(got, want_rows), (
            f"qwen4-exp: FP8 PLE rows dequantized on the GPU equal the CPU's: paths {gpu16.ple_tables.paths}"
        )
    for c in (ckpt_c, ckpt_g, ckpt_b):
        c.close()
