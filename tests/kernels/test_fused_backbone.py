"""The fused decoder-layer path on a machine without a GPU.

- fused weights: q / k / v (and gate / up) stacked into one tensor at load, the
  parameters its row-slice views: checkpoint names, shapes and values unchanged, no byte
  stored twice, logits bit-identical to the unfused load;
- the fused path's plumbing (one GEMM per group split right, the residual carried into
  the next norm, the Engram layer after a pending residual, the final norm) with the
  PyTorch ops the kernels reproduce (TorchBackboneOps): against the float64 NumPy oracle
  of test_model and the reference path, prefill, decode and packed ragged steps;
- dispatch: a CPU or float32 model runs the plain modules (nothing fused, no kernels), a
  weight replaced after load falls back to separate projections, ``kernels`` off a
  bf16 GPU is one clear error;
- the new C ABI entry points' host checks and the bindings' argument checks, without a
  GPU, and tests/gpu/test_backbone.py's CPU stages.
The kernels themselves run on the H200 through tests/gpu/test_backbone.py.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from engram_trt.native import attention as attention_kernels
from engram_trt.native import backbone as backbone_kernels
from engram_trt.errors import EngramError
from engram_trt.models.engram_llama.kernel_ops import TorchBackboneOps
from engram_trt.models.engram_llama.model import EngramLlama, model_weight_shapes
from engram_trt.models.step import PackedStep

from helpers.engram_llama import IDS, MODEL_CONFIG, PLAIN_CONFIG, build, close, np_forward


def fused_twin(model: EngramLlama, weights: dict, lookup, ops=None) -> EngramLlama:
    twin = EngramLlama(model.config, weights, compress_lookup=lookup, fuse_projections=True)
    twin.backbone_ops = ops
    return twin


@pytest.mark.parametrize("cfg_dict", [MODEL_CONFIG, PLAIN_CONFIG], ids=["engram", "plain-hc1"])
def test_fused_weights_are_views_of_one_stack(cfg_dict: dict) -> None:
    ref, cfg, weights, lookup = build(cfg_dict)
    model = fused_twin(ref, weights, lookup)
    assert sorted(n for n, _ in model.named_parameters()) == sorted(model_weight_shapes(cfg))
    D, H, kvh, hd, I = (
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.intermediate_size,
    )
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}"
        attn, mlp = layer.self_attn, layer.mlp
        assert tuple(attn.qkv_weight.shape) == ((H + 2 * kvh) * hd, D)
        assert tuple(mlp.gate_up_weight.shape) == (2 * I, D)
        assert attn.fused_weight() is attn.qkv_weight and mlp.fused_weight() is mlp.gate_up_weight
        row = D * attn.qkv_weight.element_size()
        for w, rows_before in (
            (attn.q_proj.weight, 0),
            (attn.k_proj.weight, H * hd),
            (attn.v_proj.weight, (H + kvh) * hd),
        ):
            assert w.data_ptr() == attn.qkv_weight.data_ptr() + rows_before * row
            assert w.untyped_storage().data_ptr() == attn.qkv_weight.untyped_storage().data_ptr()
        assert mlp.up_proj.weight.data_ptr() == mlp.gate_up_weight.data_ptr() + I * row
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            param = model.get_parameter(f"{p}.{name}.weight")
            assert torch.equal(param, weights[f"{p}.{name}.weight"].to(param.dtype))
        # the stack is its views' rows, in order: writing through a view shows in the stack
        before = float(attn.qkv_weight[H * hd, 0])
        attn.k_proj.weight[0, 0] += 1.0
        assert float(attn.qkv_weight[H * hd, 0]) == before + 1.0
        attn.k_proj.weight[0, 0] -= 1.0
    # no byte stored twice: the distinct allocations hold exactly the parameters
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    assert sum(storages.values()) == sum(p.numel() * p.element_size() for p in model.parameters())
    assert len(storages) == len(list(model.parameters())) - 3 * cfg.num_hidden_layers


def test_fused_weights_alone_change_no_logit() -> None:
    """Fused storage with the modules' own ops (separate GEMMs on the views): bit for bit."""
    ref, cfg, weights, lookup = build(MODEL_CONFIG)
    model = fused_twin(ref, weights, lookup)
    assert model.backbone_ops is None
    assert torch.equal(model(IDS), ref(IDS))


@pytest.mark.parametrize("cfg_dict", [MODEL_CONFIG, PLAIN_CONFIG], ids=["engram", "plain-hc1"])
def test_fused_path_matches_the_oracle_and_the_reference(cfg_dict: dict) -> None:
    """The fused path's plumbing with the PyTorch ops the kernels reproduce: a whole
    forward against the float64 oracle; prefill then decode through the cache, and a
    packed ragged step, against the reference path."""
    ref, cfg, weights, lookup = build(cfg_dict)
    model = fused_twin(ref, weights, lookup, TorchBackboneOps())
    got = model(IDS)
    close(got.double(), torch.from_numpy(np_forward(cfg, weights, lookup, IDS)))
    close(got, ref(IDS), rel=1e-5)
    cache = model.new_cache(1, 32)
    first = model.prefill(IDS[:5], cache, last_only=False)
    steps = torch.stack([model.decode(t, cache) for t in IDS[5:]])
    close(torch.cat([first, steps]), ref(IDS), rel=1e-5)
    # three sequences at different depths in one packed step (one prefill chunk, two decodes)
    caches = {}
    for name, m in (("fused", model), ("ref", ref)):
        c = m.new_cache(4, 32)
        m.forward_step(PackedStep(torch.tensor(IDS[:9] + IDS[:4]), [9, 4], [0, 0], [3, 1]), c)
        caches[name] = (
            m.forward_step(
                PackedStep(torch.tensor(IDS[9:12] + IDS[4:5] + IDS[:2]), [3, 1, 2], [9, 4, 0], [3, 1, 0]),
                c,
                all_logits=True,
            ),
            c,
        )
    close(caches["fused"][0], caches["ref"][0], rel=1e-5)
    for a, b in zip(
        caches["fused"][1].keys + caches["fused"][1].values, caches["ref"][1].keys + caches["ref"][1].values
    ):
        close(a, b, rel=1e-5)


def test_fused_path_reaches_the_ops_once_per_step_piece() -> None:
    """Per layer two norms, one RoPE + KV write, one SiLU, four projections through the
    ops (and an Engram layer's wkv); one final norm; and no separate q / k / v or gate / up GEMM (the stacked
    weights' GEMMs replace them)."""
    ref, cfg, weights, lookup = build(MODEL_CONFIG)

    class Counting(TorchBackboneOps):
        def __init__(self) -> None:
            self.calls: dict[str, int] = {}

        def count(self, name: str) -> None:
            self.calls[name] = self.calls.get(name, 0) + 1

        def norm(self, *a):  # type: ignore[override]
            self.count("norm")
            return super().norm(*a)

        def rope_kv_write(self, *a):  # type: ignore[override]
            self.count("rope")
            return super().rope_kv_write(*a)

        def silu_mul(self, *a):  # type: ignore[override]
            self.count("silu")
            return super().silu_mul(*a)

        def linear(self, *a):  # type: ignore[override]
            self.count("linear")
            return super().linear(*a)

    ops = Counting()
    model = fused_twin(ref, weights, lookup, ops)
    separate = []
    for layer in model.model.layers:
        for proj in (
            layer.self_attn.q_proj,
            layer.self_attn.k_proj,
            layer.self_attn.v_proj,
            layer.mlp.gate_proj,
            layer.mlp.up_proj,
        ):
            proj.register_forward_hook(lambda *a: separate.append(1))
    model(IDS)
    L = cfg.num_hidden_layers
    E = len(cfg.engram.layer_ids) if cfg.engram is not None else 0
    assert ops.calls == {"norm": 2 * L + 1, "rope": L, "silu": L, "linear": 4 * L + E}  # qkv, o, gate_up, down; wkv
    assert not separate


def test_a_replaced_weight_runs_its_projection_apart() -> None:
    """A parameter swapped after load is no longer a view of the stack: that group runs
    the separate projections (with the new weight), the others stay fused."""
    ref, cfg, weights, lookup = build(MODEL_CONFIG)
    model = fused_twin(ref, weights, lookup, TorchBackboneOps())
    new = torch.randn(
        weights["model.layers.1.self_attn.k_proj.weight"].shape, generator=torch.Generator().manual_seed(3)
    )
    for m in (model, ref):
        m.model.layers[1].self_attn.k_proj.weight = torch.nn.Parameter(new.clone(), requires_grad=False)
    assert model.model.layers[1].self_attn.fused_weight() is None
    assert model.model.layers[0].self_attn.fused_weight() is not None
    close(model(IDS), ref(IDS), rel=1e-5)


def test_dispatch_on_a_cpu(caplog) -> None:
    """A CPU model (float32 or bf16) runs the plain modules: nothing stacked, no kernels,
    the choice logged once; ``kernels`` names what it needs; a bad name is refused."""
    _, cfg, weights, lookup = build(MODEL_CONFIG)
    with caplog.at_level(logging.INFO, logger="engram_trt.models.engram_llama.kernel_ops"):
        for dtype in (torch.float32, torch.bfloat16):
            model = EngramLlama(cfg, weights, compress_lookup=lookup, dtype=dtype)
            assert model.backbone_ops is None and model.backend_name == "torch"
            assert all(
                layer.self_attn.qkv_weight is None and layer.mlp.gate_up_weight is None for layer in model.model.layers
            )
    assert [r.getMessage() for r in caplog.records if r.name == "engram_trt.models.engram_llama.kernel_ops"] == [
        "decoder layers: PyTorch ops (cpu, torch.float32)",
        "decoder layers: PyTorch ops (cpu, torch.bfloat16)",
    ]
    with pytest.raises(
        EngramError,
        match=r"^backbone_backend 'kernels' runs on a CUDA device in bfloat16 with fused "
        r"projections \(got cpu, torch.bfloat16, fuse_projections=False\); use "
        r"'torch' or 'auto'$",
    ):
        EngramLlama(cfg, weights, compress_lookup=lookup, dtype=torch.bfloat16, backbone_backend="kernels")
    with pytest.raises(EngramError, match=r"^backbone_backend 'fast' is not one of \['auto', 'torch', 'kernels'\]$"):
        EngramLlama(cfg, weights, compress_lookup=lookup, backbone_backend="fast")


def test_backbone_abi_checks_run_without_gpu(plugin_lib: Path, check) -> None:
    """tests/gpu/test_backbone.py's ABI stage: every bad argument refused on the host
    with its one-line reason, zero tokens launch nothing (it runs the same on the GPU)."""
    assert len(check.ABI_CASES) == 18
    for name, entry, args, want in check.ABI_CASES:
        check.test_abi(name, entry, args, want)


def test_checked_arguments_reach_the_launch(plugin_lib: Path) -> None:
    """With arguments that pass every check, the call gets as far as the launch (which a
    machine without a GPU refuses, named after the entry point)."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: tests/gpu/test_backbone.py launches these for real")
    lib = backbone_kernels.library()
    attention_kernels.library()
    a, b, c = (ctypes.c_void_p(x << 32) for x in (1, 2, 3))  # made-up, disjoint, aligned: never dereferenced
    status = lib.engram_hc_rms_norm(a, b, c, 4, 4, 2048, ctypes.c_float(1e-6), ctypes.c_void_p(4 << 32), None)
    assert status != 0 and "engram_hc_rms_norm launch failed" in lib.engram_last_error().decode()
    status = lib.engram_silu_mul(a, 4, 5632, b, None)
    assert status != 0 and "engram_silu_mul launch failed" in lib.engram_last_error().decode()
    status = lib.engram_rope_kv_cache_write(a, b, b, c, c, 4, 16, 8, 128, c, c, 4, 64, ctypes.c_void_p(4 << 32), None)
    assert status != 0 and "engram_rope_kv_cache_write launch failed" in lib.engram_last_error().decode()


def test_bindings_name_the_bad_argument() -> None:
    hs = torch.zeros(3, 2, 64, dtype=torch.bfloat16)
    w = torch.ones(64, dtype=torch.bfloat16)
    with pytest.raises(EngramError, match=r"^hs must have dtype torch.bfloat16 \(got torch.float32\)$"):
        backbone_kernels.hc_rms_norm(hs.float(), w, 1e-6)
    with pytest.raises(EngramError, match=r"^hs must be \[T, hc_mult, D\] \(got shape \(3, 64\)\)$"):
        backbone_kernels.hc_rms_norm(hs[:, 0], w, 1e-6)
    with pytest.raises(EngramError, match=r"^weight must be \[D\] = \(64,\) \(got \(32,\)\)$"):
        backbone_kernels.hc_rms_norm(hs, w[:32], 1e-6)
    with pytest.raises(EngramError, match=r"^residual must be \[T, D\] = \(3, 64\) \(got \(3, 32\)\)$"):
        backbone_kernels.hc_rms_norm(hs, w, 1e-6, hs[:, 0, :32])
    with pytest.raises(EngramError, match=r"^hidden size 16400 is outside the norm kernel's 1..16384$"):
        backbone_kernels.hc_rms_norm(torch.zeros(1, 1, 16400, dtype=torch.bfloat16), w, 1e-6)
    with pytest.raises(EngramError, match="^hs must be a CUDA tensor"):
        backbone_kernels.hc_rms_norm(hs, w, 1e-6)
    with pytest.raises(EngramError, match=r"^gate_up must be \[T, 2 \* intermediate_size\] \(got shape \(3, 7\)\)$"):
        backbone_kernels.silu_mul(torch.zeros(3, 7, dtype=torch.bfloat16))
    with pytest.raises(EngramError, match="^gate_up must be a CUDA tensor"):
        backbone_kernels.silu_mul(torch.zeros(3, 8, dtype=torch.bfloat16))
    qkv = torch.zeros(3, (8 + 2 * 2) * 64, dtype=torch.bfloat16)
    cs = torch.zeros(3, 64, dtype=torch.bfloat16)
    cache = torch.zeros(4, 2, 32, 64, dtype=torch.bfloat16)
    idx = torch.zeros(3, dtype=torch.int32)
    with pytest.raises(
        EngramError,
        match=r"^qkv must be \[T, \(num_heads \+ 2 \* kv_heads\) \* head_dim\] = \[T, 768\] "
        r"\(got \(3, 640\)\)$",
    ):
        attention_kernels.rope_kv_cache_write(qkv[:, :640], cs, cs, cache, cache, idx, idx, 8)
    with pytest.raises(EngramError, match=r"^sin must be \[T, head_dim\] = \(3, 64\) \(got \(3, 32\)\)$"):
        attention_kernels.rope_kv_cache_write(qkv, cs, cs[:, :32], cache, cache, idx, idx, 8)
    with pytest.raises(EngramError, match=r"^cos must have dtype torch.bfloat16 \(got torch.float32\)$"):
        attention_kernels.rope_kv_cache_write(qkv, cs.float(), cs, cache, cache, idx, idx, 8)
    with pytest.raises(EngramError, match=r"^token_pos must have dtype torch.int32 \(got torch.int64\)$"):
        attention_kernels.rope_kv_cache_write(qkv, cs, cs, cache, cache, idx, idx.long(), 8)
    with pytest.raises(EngramError, match="^qkv must be a CUDA tensor"):
        attention_kernels.rope_kv_cache_write(qkv, cs, cs, cache, cache, idx, idx, 8)


@pytest.fixture
def check():
    """tests/gpu/test_backbone.py as a module."""
    import importlib

    return importlib.import_module("gpu.test_backbone")


def test_gpu_check_cpu_stages(plugin_lib: Path, check) -> None:
    """tests/gpu/test_backbone.py's CPU stages: its ABI stage, and its float64 bounds hold
    for the PyTorch bf16 ops the kernels reproduce (so the GPU stage checks the kernels,
    not the bounds' slack)."""
    assert len(check.ABI_CASES) >= 18
    for name, entry, args, want in check.ABI_CASES:
        check.test_abi(name, entry, args, want)
    assert len(check.REFERENCE_CASES) == 7
    for kind, dims in check.REFERENCE_CASES:
        check.check_reference_cpu(kind, dims)


def test_norm_and_silu_checks_are_not_vacuous(check) -> None:
    """The GPU check's verify functions (what judges the kernels) fail a norm 2^-6 off, a
    residual update one element off, and SiLU applied to the wrong half."""
    gen = torch.Generator().manual_seed(5)
    inputs = check.norm_inputs(gen, torch.device("cpu"), 16, 4, 256, residual=True)
    hs = inputs["hs"].clone()
    out = TorchBackboneOps().norm(hs, inputs["residual"], check.norm_module(inputs["weight"], check.EPS))
    assert check.norm_verify(inputs, out, hs)[0]  # norm as the reference
    nudged = (out.float() * (1 + 2.0**-6)).to(torch.bfloat16)
    assert not check.norm_verify(inputs, nudged, hs)[0]  # norm nudged by 2^-6
    hs[0, 0, 0] += 1  # the in-place residual update must be bit for bit
    assert not check.norm_verify(inputs, out, hs)[0]  # norm with a wrong residual update
    silu = check.silu_inputs(gen, torch.device("cpu"), 8, 64)
    got = TorchBackboneOps().silu_mul(silu["gate_up"])
    assert check.silu_verify(silu, got)[0]  # silu as the reference
    gate, up = silu["gate_up"].chunk(2, dim=-1)
    assert not check.silu_verify(silu, torch.nn.functional.silu(up) * gate)[0]  # silu with gate and up swapped


def test_rope_check_catches_a_wrong_convention(check) -> None:
    """The GPU check's RoPE verify fails rotation by interleaved pairs (the GPT-J
    convention) and a K/V write at the wrong position; its ulp distance is right."""
    gen = torch.Generator().manual_seed(6)
    inputs = check.rope_inputs(gen, torch.device("cpu"), 8, 4, 2, 64, 4, 16, out_of_cache=False)
    from types import SimpleNamespace

    from engram_trt.models.engram_llama.modules import rope_and_write

    H, kvh, hd = 4, 2, 64
    q, k, v = (x.reshape(8, -1, hd) for x in inputs["qkv"].split([H * hd, kvh * hd, kvh * hd], dim=-1))
    plan = SimpleNamespace(token_slots=inputs["slots"].long(), positions=inputs["pos"].long())
    keys, values = inputs["keys"].clone(), inputs["values"].clone()
    q_rot = rope_and_write(q, k, v, inputs["cos"], inputs["sin"], plan, keys, values)
    assert check.rope_verify(inputs, q_rot, keys, values)[0]  # rope as the reference
    pairs = q.reshape(8, H, hd // 2, 2)
    interleaved = torch.stack((-pairs[..., 1], pairs[..., 0]), -1).reshape(8, H, hd)
    q_gptj = q * inputs["cos"][:, None] + interleaved * inputs["sin"][:, None]
    assert not check.rope_verify(inputs, q_gptj, keys, values)[0]  # rope, interleaved pairs
    shifted = SimpleNamespace(token_slots=plan.token_slots, positions=(plan.positions + 1) % 16)
    keys2, values2 = inputs["keys"].clone(), inputs["values"].clone()
    rope_and_write(q, k, v, inputs["cos"], inputs["sin"], shifted, keys2, values2)
    assert not check.rope_verify(inputs, q_rot, keys2, values2)[0]  # rope, K/V at the next position
    np.testing.assert_array_equal(
        check.ulp_distance(
            torch.tensor([1.0, -0.0, 1.0], dtype=torch.bfloat16),
            torch.tensor([1.0078125, 0.0, -1.0], dtype=torch.bfloat16),
        ).numpy(),
        [1, 0, 2 * 0x3F80],
    )


def test_warp_kernel_serves_what_the_library_picks_it_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """attention_kernels.warp_kernel_serves mirrors warpKernel() in attentionWarpKernel.cu
    (16-bit I/O, head_dim 128, groups of up to 4, sm_90+, not forced tiled); the decode
    graphs read small caches in place only where it is true. The GPU attention check ties
    it to the kernel each case launches; here, the rule itself, on stand-in queries."""
    from types import SimpleNamespace

    monkeypatch.delenv("ENGRAM_TRT_ATTENTION_KERNEL", raising=False)
    capability = {"major": 9}
    monkeypatch.setattr(attention_kernels, "capability_major", lambda index: capability["major"])

    def q(dtype: torch.dtype = torch.bfloat16, head_dim: int = 128, cuda: bool = True) -> SimpleNamespace:
        return SimpleNamespace(is_cuda=cuda, dtype=dtype, shape=(1, 16, head_dim), device=SimpleNamespace(index=0))

    serves = attention_kernels.warp_kernel_serves
    assert serves(q(), 16, 8) and serves(q(torch.float16), 32, 8) and serves(q(), 4, 4) and serves(q(), 16, 4)
    assert not serves(q(), 40, 8)  # a group of 5
    assert not serves(q(), 16, 1)  # a group of 16
    assert not serves(q(torch.float32), 16, 8)
    assert not serves(q(head_dim=64), 16, 8) and not serves(q(head_dim=256), 16, 8)
    assert not serves(q(cuda=False), 16, 8)
    assert not serves(q(), 16, 0)
    monkeypatch.setenv("ENGRAM_TRT_ATTENTION_KERNEL", "tiled")
    assert not serves(q(), 16, 8)
    monkeypatch.delenv("ENGRAM_TRT_ATTENTION_KERNEL")
    capability["major"] = 8
    assert not serves(q(), 16, 8)
    # a real CPU tensor: never (the decode graphs keep their SDPA path off a GPU)
    assert not serves(torch.zeros(1, 16, 128, dtype=torch.bfloat16), 16, 8)
