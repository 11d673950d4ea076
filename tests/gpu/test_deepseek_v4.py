"""DeepSeek-V4 on a GPU through the torch backend: the tiny checkpoint transformers 5.25
saved (tests/data/deepseek_v4_tiny, whose recorded greedy tokens a CPU test,
tests/models/deepseek_v4/test_deepseek_v4_folder.py, ties to transformers) run on CUDA.

  1. float32 on CUDA: every weight, buffer and state tensor on the GPU; the greedy tokens
     of each prompt (chunked prefill + decode, so the window rings, compressed entries
     and the indexer's top-k run across steps) equal the recorded ones.
  2. bfloat16 on CUDA: the prefill logits' relative L2 distance from the float32 CPU
     model's at most 3x transformers' own bf16-vs-fp32 distance on the same prompt
     (recorded in expected.json: the bound is the published implementation's round-off,
     not a fixed number).
  3. ``engram_trt.LLM`` on CUDA (the scheduler's packed steps, prompts batched): the
     recorded tokens in float32.
  4. the attention's ``kernels`` backend (one engram_dsv4_attention call per layer) vs
     its ``torch`` backend on the same weights and state over packed prefill + chunk +
     decode steps (float32 logits within 1e-4 relative, bf16 within 3x transformers'
     bf16 round-off; the greedy token of every step equal in float32), the recorded
     tokens through the kernel, the label naming the core, and a decode step with the
     kernel and the sync-free MoE run under torch's sync debug mode ``error``;
  5. the MoE's sync-free forms (gathered, dense, grouped through torch._grouped_mm) on
     CUDA vs the per-expert loop, float32 tight and bf16 loose.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from .cases import rel_err

from .helpers import (
    REPO,
    check_bf16_cuda_logits_near_fp32_cpu,
    check_llm_on_cuda_gives_the_recorded_tokens,
    fp32_cpu_and_bf16_cuda,
    llm_on_cuda_tokens,
    load_checkpoint,
    note,
)

DATA = REPO / "tests" / "data" / "deepseek_v4_tiny"
EXPECTED = json.loads((DATA / "expected.json").read_text())
PROMPTS = range(len(EXPECTED["prompts"]))


@pytest.fixture(scope="module")
def expected():
    return EXPECTED


def _load(device, dtype):
    return load_checkpoint(DATA, device, dtype)


@pytest.fixture(scope="module")
def fp32_cuda():
    import torch

    ckpt, model = _load("cuda", torch.float32)
    yield model
    ckpt.close()


def test_fp32_cuda_everything_on_the_gpu(fp32_cuda) -> None:
    model = fp32_cuda
    off = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type != "cuda"]
    assert not off, "every weight and buffer on CUDA: " + ", ".join(off[:5])


def test_fp32_cuda_state_on_the_gpu(fp32_cuda) -> None:
    state = fp32_cuda.new_cache(2, 64)
    off = [
        f"layer {i} {k}" for i, layer in enumerate(state.layers) for k, t in layer.items() if t.device.type != "cuda"
    ]
    assert not off and state.lookback.device.type == "cuda", "every state tensor on CUDA: " + ", ".join(off[:5])


@pytest.mark.parametrize("i", PROMPTS)
def test_fp32_cuda_greedy_equals_transformers(fp32_cuda, expected, i) -> None:
    got = fp32_cuda.generate_greedy(expected["prompts"][i], expected["new_tokens"], chunk=4, ignore_eos=True)
    assert got == expected["greedy"][i], f"prompt {i}: fp32 CUDA greedy tokens: {got} vs {expected['greedy'][i]}"


@pytest.fixture(scope="module")
def cpu_and_bf16():
    with fp32_cpu_and_bf16_cuda(DATA) as models:
        yield models


@pytest.mark.parametrize("i", PROMPTS)
def test_bf16_cuda_logits_near_fp32_cpu(cpu_and_bf16, expected, i) -> None:
    check_bf16_cuda_logits_near_fp32_cpu(cpu_and_bf16, expected, i)


@pytest.fixture(scope="module")
def llm_run(expected):
    return llm_on_cuda_tokens(DATA, expected)


@pytest.mark.parametrize("i", PROMPTS)
def test_llm_on_cuda_batches_to_the_recorded_tokens(llm_run, expected, i) -> None:
    check_llm_on_cuda_gives_the_recorded_tokens(llm_run, expected, i)


# -- 4. the attention kernel backend vs the torch backend -------------------------------------


def _packed_steps(torch, prompts):
    """Three packed steps over three slots: two prefills; a chunk continuing slot 2 + a
    decode of slot 0 + a fresh prefill of slot 1; then decodes of all three (the decode
    tokens are fixed ids, so both backends see the same inputs)."""
    from engram_trt.models.step import PackedStep

    a, b, c = prompts[0], prompts[1], prompts[2]
    cut = len(c) // 2
    steps = [
        ([c[:cut], a], [0, 0], [2, 0]),
        ([c[cut:], [7], b], [cut, len(a), 0], [2, 0, 1]),
        ([[9], [11], [13]], [len(a) + 1, len(b), len(c)], [0, 1, 2]),
    ]
    for parts, past, slots in steps:
        yield PackedStep(torch.tensor([t for p in parts for t in p]), [len(p) for p in parts], past, slots)


def _run_backend(torch, model, backend, prompts, all_logits=True):
    model.attention_backend = backend
    state = model.new_cache(3, 64)
    return [
        model.forward_step(step, state, all_logits=all_logits).float().cpu() for step in _packed_steps(torch, prompts)
    ], model.attention_label()


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def backends(request, expected):
    """One dtype's model over the three packed steps with the torch backend, then the
    kernels backend: (dtype name, dtype, the torch backend's logits and label, the kernels
    backend's logits and label)."""
    import torch

    dtype_name = request.param
    dtype = getattr(torch, dtype_name)
    ckpt, model = _load("cuda", dtype)
    want, torch_label = _run_backend(torch, model, "torch", expected["prompts"])
    got, label = _run_backend(torch, model, "kernels", expected["prompts"])
    model.attention_backend = "auto"
    ckpt.close()
    return SimpleNamespace(dtype_name=dtype_name, dtype=dtype, want=want, torch_label=torch_label, got=got, label=label)


def test_kernel_attention_backend_label(backends) -> None:
    label, torch_label = backends.label, backends.torch_label
    assert label == "kernels", (
        f"{backends.dtype_name}: the kernels backend's label names the kernel on every layer: {label!r} "
        f"(torch backend: {torch_label!r})"
    )


@pytest.mark.parametrize("n", range(3))  # the packed steps of _packed_steps
def test_kernel_attention_backend_equals_torch_backend(backends, expected, n) -> None:
    """One step's logits (consecutive asserts: its logits, then in float32 its greedy picks)."""
    import torch

    dtype_name, dtype = backends.dtype_name, backends.dtype
    g, w = backends.got[n], backends.want[n]
    bound = 1e-4 if dtype is torch.float32 else 3 * max(expected["transformers_bf16_rel_l2"])
    err = rel_err(g, w)
    note(f"kernel_vs_torch_{dtype_name}_step{n}", err)
    assert bool(torch.isfinite(g).all()) and err <= bound, (
        f"{dtype_name} step {n}: kernel-backend logits vs torch-backend logits (all tokens): rel L2 {err:.2e}, "
        f"bound {bound:.2e}"
    )
    if dtype is torch.float32:
        same = torch.equal(g.argmax(-1), w.argmax(-1))
        assert same, (
            f"float32 step {n}: every token's greedy pick equal across the backends: {g.argmax(-1).tolist()} vs "
            f"{w.argmax(-1).tolist()}"
        )


@pytest.fixture(scope="module")
def kernel_model(expected):
    """The fp32 model on the attention kernel and its greedy tokens of every prompt (made
    here, before the sync-free decode step runs on the same model, as one run)."""
    import torch

    ckpt, model = _load("cuda", torch.float32)
    model.attention_backend = "kernels"
    model.label_before = model.backend_name
    model.greedy = [
        model.generate_greedy(prompt, expected["new_tokens"], chunk=4, ignore_eos=True)
        for prompt in expected["prompts"]
    ]
    yield model
    model.attention_backend = "auto"
    ckpt.close()


def test_kernel_backend_label(kernel_model) -> None:
    assert "attention kernels" in kernel_model.label_before, (
        f"backend_name labels the attention core: {kernel_model.label_before}"
    )


@pytest.mark.parametrize("i", PROMPTS)
def test_kernel_backend_recorded_tokens(kernel_model, expected, i) -> None:
    got = kernel_model.greedy[i]
    assert got == expected["greedy"][i], (
        f"prompt {i}: fp32 CUDA greedy tokens through the attention kernel: {got} vs {expected['greedy'][i]}"
    )


def test_kernel_backend_sync_free_decode(kernel_model, expected) -> None:
    import torch

    from engram_trt.models.step import PackedStep

    model = kernel_model
    # a decode step of three slots: no host synchronization inside forward_step
    state = model.new_cache(3, 64)
    prompts = expected["prompts"]
    model.forward_step(
        PackedStep(torch.tensor([t for p in prompts for t in p]), [len(p) for p in prompts], [0, 0, 0], [0, 1, 2]),
        state,
    )
    torch.cuda.synchronize()
    decode = PackedStep(torch.tensor([5, 6, 7]), [1, 1, 1], [len(p) for p in prompts], [0, 1, 2])
    err = ""
    torch.cuda.set_sync_debug_mode("error")
    try:
        model.forward_step(decode, state)
    except RuntimeError as exc:
        err = str(exc).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    forms = sorted({layer.mlp.last_form for layer in model.model.layers})
    assert not err, (
        f"a decode step (kernel attention, sync-free MoE) runs under sync debug mode 'error': "
        f"{err or 'no synchronizing call'}; MoE forms {forms}"
    )


# -- 5. the MoE forms on CUDA ----------------------------------------------------------------

MOE_LAYERS = range(json.loads((DATA / "config.json").read_text())["num_hidden_layers"])


def _moe_config():
    from engram_trt.models.deepseek_v4.config import read_config

    return read_config(
        json.loads((DATA / "config.json").read_text()) | {"moe_intermediate_size": 64, "n_routed_experts": 8}
    )


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def moes(request):
    """Each layer's GroupedSparseMoE with random weights (8 experts of 64) on CUDA in one
    dtype: (dtype name, dtype, config, [moe per layer])."""
    import torch

    from engram_trt.models.deepseek_v4.moe import GroupedSparseMoE

    dtype_name = request.param
    dtype = getattr(torch, dtype_name)
    cfg = _moe_config()
    gen = torch.Generator().manual_seed(21)
    layers = []
    for layer in MOE_LAYERS:
        moe = GroupedSparseMoE(cfg, layer).eval()
        with torch.no_grad():
            for p in moe.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            if moe.is_hash:
                moe.gate.tid2eid.copy_(
                    torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(cfg.vocab_size)])
                )
        layers.append(moe.to("cuda", dtype))
    return dtype_name, dtype, cfg, layers


@pytest.mark.parametrize("tokens", [1, 3, 40])
@pytest.mark.parametrize("layer", MOE_LAYERS)
def test_moe_forms_on_cuda_equal_the_loop(moes, layer, tokens) -> None:
    import torch

    dtype_name, dtype, cfg, layers = moes
    moe = layers[layer]
    gen = torch.Generator().manual_seed(21 + 100 * layer + tokens)
    forms = ["gathered", "dense"] + (
        ["grouped"] if moe.grouped_serves(torch.empty(1, cfg.hidden_size, device="cuda", dtype=dtype)) else []
    )
    x = (torch.randn(tokens, cfg.hidden_size, generator=gen)).to("cuda", dtype)
    ids = torch.randint(0, cfg.vocab_size, (tokens,), generator=gen).cuda()
    with torch.no_grad():
        w, picks = moe.gate(x, ids)
        loop = moe.experts_loop(x, w, picks)
        errs = {f: rel_err(getattr(moe, f"experts_{f}")(x, w, picks).float(), loop.float()) for f in forms}
        moe.form = "auto"
        moe(x, ids)
    bound = 1e-5 if dtype is torch.float32 else 2e-2
    assert max(errs.values()) <= bound, (
        f"{dtype_name} MoE layer {layer} ({'hash' if moe.is_hash else 'top-k'}), {tokens} tokens: "
        f"sync-free forms vs the loop: { {k: f'{v:.1e}' for k, v in errs.items()} }, "
        f"auto took {moe.last_form}, bound {bound:.0e}"
    )
