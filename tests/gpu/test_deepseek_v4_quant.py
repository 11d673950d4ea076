"""DeepSeek-V4 in its stored formats on a GPU (issue 40): a tiny folder in DeepSeek's
published recipe (FP8 E4M3 linears with ue8m0 128x128 scales, FP4 routed experts, BF16 /
F32 elsewhere), written here from random weights through the package's own quantizers
(no transformers on the GPU machine; tests/quant/test_deepseek_v4_quant.py ties the same
layout to transformers 5.25 on the CPU).

  1. Loading onto CUDA (bf16): the bytes the allocator holds afterwards are the bytes
     ``inspect`` says the load takes (stored bytes for the FP8 / FP4 weights: no float
     copy on the GPU, beyond each block's rounding to the allocator's 512 bytes), and the
     peak during the load stays within one tensor of the end (tensor by tensor).
  2. The stored-format modules on CUDA through their dequantizing path (``QuantLinear``
     backend ``torch``, the MoE's ``loop``), float64: logits equal to the same model with
     its stored weights dequantized into float modules, on the same GPU; greedy tokens
     over chunked prefill and decode equal the CPU's.
  3. With the kernel library's quantized products (``engram_trt.native.quant``, the
     kernels branch): ``auto`` takes the MoE's ``kernels`` form on CUDA (FP4 stacks and a
     BF16 model's stacks), and its routed-expert output against a float64 reference over
     the dequantized stacks that quantizes each product's activations as documented
     (``quant.formats.act_quant`` with ACT_QUANT's groups), within a bound derived from
     the float32 sums (``_moe_reference``: each sum within ``K 2^-24`` of its magnitudes,
     carried through the clamped SwiGLU; an activation code may then differ only where a
     rounding midpoint, or a ue8m0 scale boundary, lies within that reach; bf16 values
     half a bf16 step; a 1.05 margin for second-order terms).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from .cases import rel_err

from .helpers import note

CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"
CONFIG: dict[str, Any] = dict(
    architectures=["DeepseekV4ForCausalLM"],
    model_type="deepseek_v4",
    vocab_size=96,
    hidden_size=256,
    moe_intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=128,
    q_lora_rank=256,
    num_experts_per_tok=2,
    n_routed_experts=4,
    n_shared_experts=1,
    layer_types=[HCA, CSA, HCA],
    compress_rates={CSA: 2, HCA: 4},
    hc_mult=2,
    hc_sinkhorn_iters=5,
    mlp_layer_types=["hash_moe", "moe", "moe"],
    sliding_window=6,
    o_groups=2,
    o_lora_rank=128,
    index_n_heads=2,
    index_head_dim=64,
    index_topk=3,
    num_nextn_predict_layers=0,
    partial_rotary_factor=0.5,
    max_position_embeddings=256,
    eos_token_id=2,
    bos_token_id=1,
    tie_word_embeddings=False,
)
QUANT = {
    "quantization_config": {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
    },
    "expert_dtype": "fp4",
}
PROMPTS = [[5, 17, 33, 2, 90, 41, 7, 7, 60, 12, 13, 14, 15], [3, 44, 45, 9], [11 + i for i in range(19)]]
NATIVE_QUANT = importlib.util.find_spec("engram_trt.native.quant") is not None


def _write(folder: Path, quantized: bool) -> None:
    import torch
    from safetensors.torch import save_file

    from engram_trt.bench.dsv4model import quantize_weights
    from engram_trt.models.deepseek_v4.config import read_config
    from engram_trt.models.deepseek_v4.model import model_tensor_shapes

    cfg = read_config(CONFIG)
    gen = torch.Generator().manual_seed(17)
    weights: dict[str, Any] = {}
    for name, shape in model_tensor_shapes(cfg).items():
        if name.endswith("tid2eid"):
            weights[name] = torch.randint(0, cfg.n_routed_experts, shape, generator=gen).to(torch.int32)
        else:
            weights[name] = torch.randn(shape, generator=gen) * (1.0 if "embed" in name else 0.3)
    if quantized:
        weights = quantize_weights(weights)
        weights = {
            n: (
                t.to(torch.bfloat16)
                if t.dtype == torch.float32 and t.dim() == 2 and "hc_" not in n and not n.endswith(".ape")
                else t
            )
            for n, t in weights.items()
        }
    folder.mkdir(parents=True)
    save_file(
        {n: t.contiguous() for n, t in weights.items()}, str(folder / "model.safetensors"), metadata={"format": "pt"}
    )
    (folder / "config.json").write_text(json.dumps(dict(CONFIG, **(QUANT if quantized else {}))))


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dsv4q")
    _write(root / "q", True)
    _write(root / "f", False)
    return {"q": root / "q", "f": root / "f"}


def _load(folder: Path, device: str, dtype: Any) -> Any:
    from engram_trt.models.registry import open_checkpoint

    ckpt = open_checkpoint(folder)
    model = ckpt.architecture.load_model(ckpt, device=device, dtype=dtype)
    ckpt.close()
    return model


def test_load_on_cuda_holds_the_stored_bytes(folders: dict[str, Path]) -> None:
    import torch

    from engram_trt.cli.inspect import inspect_checkpoint
    from engram_trt.models.deepseek_v4.weights import named_tensors

    want = inspect_checkpoint(str(folders["q"]), "bf16")["weights"]["load"]
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model = _load(folders["q"], "cuda", torch.bfloat16)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated() - before
    peak = torch.cuda.max_memory_allocated() - before
    tensors = {id(t): t for _m, _a, t in named_tensors(model).values()}
    # the weights' own bytes: each storage once (expert tensors are views of their stacks); the
    # allocator's count also holds the model's step buffers (the metadata uploader), noted below
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors.values()}
    held = sum(storages.values())
    on_gpu = all(t.is_cuda for t in tensors.values())
    slack = 512 * len(tensors)  # the caching allocator rounds each block up to 512 bytes
    biggest = max(t.numel() * t.element_size() for t in tensors.values())
    assert on_gpu, "every weight and scale on the GPU"
    assert want["gpu_bytes"] <= held <= want["gpu_bytes"] + slack, (
        f"bytes held after the load = inspect's GPU bytes of the load (stored bytes for FP8 / FP4): held {held}, "
        f"inspect {want['gpu_bytes']} (+ at most {slack} of rounding); fp8 {want['by_kind']['fp8']['gpu_bytes']}, fp4 "
        f"{want['by_kind']['fp4']['gpu_bytes']}"
    )
    assert peak <= allocated + biggest + slack, (
        f"the load's peak is within one tensor of its end (tensor by tensor, stacks filled in place): peak {peak}, end "
        f"{allocated}, largest tensor {biggest}"
    )
    note("load_bytes", {"held": held, "allocated": allocated, "peak": peak, "inspect": want["gpu_bytes"]})


def _dequantize_modules(model: Any) -> Any:
    """``model`` with every stored-format projection swapped, in place, for an
    ``nn.Linear`` (or a float ``GroupedLinear``) holding its weight dequantized in the
    model's dtype, exactly (``QuantWeight.dequantize``): the float model the stored bytes
    stand for."""
    from torch import nn

    from engram_trt.models.deepseek_v4.attention import GroupedLinear
    from engram_trt.models.deepseek_v4.modules import QuantGroupedLinear
    from engram_trt.quant.weight import QuantLinear

    dtype = model.compute_dtype
    for name, mod in list(model.named_modules()):
        if isinstance(mod, QuantGroupedLinear):
            new = GroupedLinear(mod.in_per_group, mod.out_features, mod.groups)
        elif isinstance(mod, QuantLinear):
            new = nn.Linear(mod.in_features, mod.out_features, bias=False)
        else:
            continue
        new.weight = nn.Parameter(mod.qweight.dequantize(dtype), requires_grad=False)
        model.set_submodule(name, new)
    return model


@pytest.mark.parametrize("i", range(len(PROMPTS)))
def test_dequantizing_path_on_cuda_equals_the_float_model(folders: dict[str, Path], i: int) -> None:
    """The stored-format modules' dequantizing path on CUDA (``QuantLinear`` backend
    ``torch``, the MoE's ``loop``) against the same model with every stored weight
    dequantized once into a float module, on the same GPU, float64: the same products on
    the same device, so equal to the last bits (1e-12 relative to the largest logit).
    (Against the CPU the model's float64 logits differ by ~5e-8 on this config at every
    position, whatever the weight format: the GPU path's own float32 steps; the CPU-vs-GPU
    check is the greedy tokens, and transformers' on the GPU is tests/gpu/test_deepseek_v4_graphs.py.)"""
    import torch

    from engram_trt.models.deepseek_v4.modules import QuantGroupedLinear
    from engram_trt.models.step import PackedStep
    from engram_trt.quant.weight import QuantLinear

    QuantLinear.backend, QuantGroupedLinear.backend = "torch", "torch"
    try:
        gpu = _load(folders["q"], "cuda", torch.float64)
        cpu = _load(folders["q"], "cpu", torch.float64)
        for layer in gpu.model.layers:
            layer.mlp.form = "loop"
        ref = _dequantize_modules(_load(folders["q"], "cuda", torch.float64))
        for layer in ref.model.layers:
            layer.mlp.form = "loop"
        p = PROMPTS[i]
        step = PackedStep(torch.tensor(p), [len(p)], [0], [0])
        got = gpu.forward_step(step, gpu.new_cache(1, 64), all_logits=True)
        want = ref.forward_step(step, ref.new_cache(1, 64), all_logits=True)
        err = float((got - want).abs().max() / want.abs().max())
        assert err <= 1e-12, (
            f"prompt {i}: float64 CUDA logits, stored formats (dequantizing path) vs their float model: {err:.2e}"
        )
        a = cpu.generate_greedy(p, 6, chunk=4, ignore_eos=True)
        b = gpu.generate_greedy(p, 6, chunk=4, ignore_eos=True)
        assert a == b, f"prompt {i}: greedy tokens over chunked prefill + decode equal the CPU's: {b} vs {a}"
    finally:
        QuantLinear.backend, QuantGroupedLinear.backend = "auto", "auto"


_E4M3: Any = None


def _e4m3_grid() -> Any:
    """Every finite e4m3 value, sorted (float64)."""
    global _E4M3
    if _E4M3 is None:
        import torch

        v = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).double()
        _E4M3 = torch.unique(v[torch.isfinite(v)])
    return _E4M3


def _flip_room(v: Any, slack: Any) -> Any:
    """How far an e4m3 rounding of ``v`` (scaled values, float64) can move when ``v`` may
    be off by up to ``slack``: 0 where no rounding midpoint lies within ``slack`` of
    ``v``, else the distance to the farther neighbour's value (one step each way)."""
    import torch

    grid = _e4m3_grid()
    vc = v.clamp(-448.0, 448.0)
    i = torch.searchsorted(grid, vc).clamp(1, len(grid) - 1)
    lo, hi = grid[i - 1], grid[i]
    mid = (lo + hi) / 2
    near = (vc - mid).abs() <= slack
    return torch.where(near, hi - lo, torch.zeros_like(v))


def _moe_reference(moe: Any, x: Any, ids: Any, w: Any) -> tuple[Any, Any]:
    """``(reference [T, D], bound [T, D])`` of the routed experts (module docstring): the
    reference in float64 over the dequantized stacks with each product's activations
    quantized as ACT_QUANT says for its weight kind (``quant.formats.act_quant``, the
    documented reference of the kernels' quantization; float stacks: none), the bound
    what the GPU's float32 sums can move it by: each product's float32 accumulation
    (``K 2^-24`` of the sum of magnitudes), carried through the clamped SwiGLU to the
    second product's inputs, and there one e4m3 step for each input whose perturbed
    value can round the other way (a midpoint within reach) or for a whole group whose
    ue8m0 scale can change; bf16 activations / outputs half a bf16 step (2^-9)."""
    import torch

    from engram_trt.quant.formats import FP8_MAX, act_quant
    from engram_trt.quant.weight import ACT_QUANT

    stacks = moe.stack_experts()
    deq = [s.double().cpu() if isinstance(s, torch.Tensor) else s.dequantize(torch.float64).cpu() for s in stacks]
    kinds = [getattr(s, "kind", None) for s in stacks]
    lim = float(moe.experts[0].limit)
    bf16 = x.dtype == torch.bfloat16

    def quantized(v: Any, kind: str | None) -> tuple[Any, Any]:  # (deq, scale per element)
        if kind is None:
            return v, None
        group, ue8m0 = ACT_QUANT[kind]
        _q, sc, d = act_quant(v.float()[None], group, ue8m0)
        return d[0].double(), sc[0].double().repeat_interleave(group)[: v.shape[-1]]

    xs = x.double().cpu()
    ref, bound = torch.zeros_like(xs), torch.zeros_like(xs)
    for t in range(xs.shape[0]):
        xq, _ = quantized(xs[t], kinds[0])
        for j in range(ids.shape[1]):
            e, r = int(ids[t, j]), float(w[t, j])
            K = xq.shape[0]
            g, u = deq[0][e] @ xq, deq[1][e] @ xq
            dg = K * 2.0**-24 * (deq[0][e].abs() @ xq.abs())
            du = K * 2.0**-24 * (deq[1][e].abs() @ xq.abs())
            gc, uc = g.clamp(max=lim), u.clamp(-lim, lim)
            sg = torch.sigmoid(gc)
            silu = gc * sg
            h = silu * uc
            dh = 1.1 * dg * uc.abs() + silu.abs() * du + 2.0**-24 * h.abs()  # |silu'| <= 1.1
            if bf16 and kinds[2] is None:
                dh = dh + 2.0**-9 * h.abs()
            hq, sh = quantized(h, kinds[2])
            room = torch.zeros_like(h)
            if sh is not None:
                group = ACT_QUANT[kinds[2]][0]
                room = _flip_room(h / sh, dh / sh) * sh
                amax = h.abs().reshape(-1, group).amax(-1)
                edge = (
                    torch.log2(torch.clamp(amax, min=1e-4) / FP8_MAX)
                    - torch.round(torch.log2(torch.clamp(amax, min=1e-4) / FP8_MAX))
                ).abs() < 2.0**-20 + (dh.reshape(-1, group).amax(-1) / amax)
                room = torch.where(edge.repeat_interleave(group), 2.0**-3 * h.abs() + sh, room)  # the scale may differ
            I = hq.shape[0]
            ref[t] += r * (deq[2][e] @ hq)
            bound[t] += abs(r) * (deq[2][e].abs() @ (room + dh) + I * 2.0**-24 * (deq[2][e].abs() @ hq.abs()))
    if bf16:
        bound = bound + 2.0**-9 * ref.abs()
    return ref, 1.05 * bound


@pytest.mark.skipif(
    not NATIVE_QUANT,
    reason="no engram_trt.native.quant in this tree (the kernel library's quantized products, issue 40 item 2)",
)
@pytest.mark.parametrize("T", [1, 3, 40])
@pytest.mark.parametrize("which", ["q", "f"])
def test_moe_kernels_form_on_cuda(folders: dict[str, Path], which: str, T: int) -> None:
    import torch

    model = _load(folders[which], "cuda", torch.bfloat16 if which == "f" else torch.float32)
    moe = model.model.layers[1].mlp
    gen = torch.Generator().manual_seed(5 + T)
    dtype = torch.bfloat16 if which == "f" else torch.float32
    x = (torch.randn(T, CONFIG["hidden_size"], generator=gen) * 0.5).to("cuda", dtype)
    ids = torch.randint(3, 90, (T,), generator=gen).cuda()
    w, picks = moe.gate(x, ids)
    moe.form = "auto"
    form = moe.choose_form(x, picks)
    assert form == "kernels", f"{which} T={T}: auto takes the kernels form on CUDA: {form}"
    got = moe.experts_kernels(x, w, picks)
    ref, bound = _moe_reference(moe, x, picks, w)
    diff = (got.double().cpu() - ref).abs()
    worst = float((diff - bound).max())
    note(f"moe_kernels_{which}_T{T}_rel", rel_err(got, ref))
    assert bool(torch.isfinite(got).all()) and worst <= 0, (
        f"{which} T={T}: routed experts within the float32-sum bound of the activation-quantized float64 "
        f"reference: max excess {worst:.3e}, rel L2 {rel_err(got, ref):.2e}"
    )
