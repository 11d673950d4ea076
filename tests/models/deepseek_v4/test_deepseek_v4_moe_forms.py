"""DeepSeek-V4's MoE forms (models/deepseek_v4/moe.py) and the attention backend choice
on the CPU.

- every routed-expert form (gathered, dense, grouped through torch._grouped_mm's CPU
  implementation) equals the published per-expert loop and a float64 per-token sum
  written here, for the hash and the top-k router, with random weights everywhere;
- stacking the experts makes each expert's weights views of the stacks (no copy) and is
  redone after the parameters are replaced; auto takes the loop on a CPU; a bad form
  is refused in one line;
- the attention backend: ``torch`` and ``auto`` on a CPU run the torch core, ``kernels``
  is refused in one line naming why; the model's label says which core runs.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from engram_trt.errors import EngramError  # noqa: E402

CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"
BASE: dict[str, Any] = dict(
    architectures=["DeepseekV4ForCausalLM"],
    vocab_size=64,
    hidden_size=32,
    moe_intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=16,
    q_lora_rank=24,
    num_experts_per_tok=2,
    n_routed_experts=6,
    n_shared_experts=1,
    layer_types=[CSA, HCA],
    compress_rates={CSA: 2, HCA: 4},
    hc_mult=2,
    hc_sinkhorn_iters=3,
    mlp_layer_types=["hash_moe", "moe"],
    sliding_window=6,
    o_groups=2,
    o_lora_rank=8,
    index_n_heads=2,
    index_head_dim=8,
    index_topk=3,
    num_nextn_predict_layers=0,
    partial_rotary_factor=0.5,
    max_position_embeddings=256,
    eos_token_id=2,
    bos_token_id=1,
    swiglu_limit=0.8,
    routed_scaling_factor=1.7,
)


def _config():
    from engram_trt.models.deepseek_v4.config import read_config

    return read_config(dict(BASE))


def _moe(layer: int, seed: int):
    from engram_trt.models.deepseek_v4.moe import GroupedSparseMoE

    gen = torch.Generator().manual_seed(seed)
    moe = GroupedSparseMoE(_config(), layer).eval()
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.4)
        if moe.is_hash:
            moe.gate.tid2eid.copy_(torch.randint(0, 6, moe.gate.tid2eid.shape, generator=gen))
    return moe, gen


def _float64_routed(moe, x, ids_in) -> Any:
    """sum over a token's picks of weight * clamped-SwiGLU expert, token by token, float64."""
    weights, ids = moe.gate(x, ids_in)
    out = torch.zeros(x.shape, dtype=torch.float64)
    lim = moe.experts[0].limit
    for t in range(x.shape[0]):
        xt = x[t].double()
        for j in range(ids.shape[1]):
            e = moe.experts[int(ids[t, j])]
            g = (e.gate_proj.weight.double() @ xt).clamp(max=lim)
            u = (e.up_proj.weight.double() @ xt).clamp(min=-lim, max=lim)
            out[t] += float(weights[t, j]) * (e.down_proj.weight.double() @ (torch.nn.functional.silu(g) * u))
    return out


@pytest.mark.parametrize("layer", [0, 1], ids=["hash_moe", "topk_moe"])
@pytest.mark.parametrize("tokens", [1, 2, 13])
def test_every_form_equals_the_loop_and_a_float64_sum(layer: int, tokens: int) -> None:
    moe, gen = _moe(layer, 10 + layer)
    x = torch.randn(tokens, 32, generator=gen)
    ids = torch.randint(0, 64, (tokens,), generator=gen)
    with torch.no_grad():
        weights, picks = moe.gate(x, ids)
        loop = moe.experts_loop(x, weights, picks)
        want = _float64_routed(moe, x, ids)
        assert float((loop.double() - want).abs().max()) <= 1e-5 * float(want.abs().max())
        assert float(want.abs().max()) > 0.1  # the experts are not trivially zero
        for form in ("gathered", "dense", "grouped"):
            got = getattr(moe, f"experts_{form}")(x, weights, picks)
            torch.testing.assert_close(got, loop, rtol=1e-5, atol=1e-6, msg=lambda m: f"{form}: {m}")
            moe.form = form
            full = moe(x, ids)
            assert moe.last_form == form
            torch.testing.assert_close(full, loop + moe.shared_experts(x), rtol=1e-5, atol=1e-6)


def test_stacks_are_views_refreshed_after_replacement_and_auto_is_the_loop_on_cpu() -> None:
    moe, gen = _moe(1, 3)
    gate, up, down = moe.stack_experts()
    assert gate.shape == (6, 24, 32) and up.shape == (6, 24, 32) and down.shape == (6, 32, 24)
    for i, e in enumerate(moe.experts):
        assert e.gate_proj.weight.data_ptr() == gate[i].data_ptr()
        assert e.down_proj.weight.data_ptr() == down[i].data_ptr()
    x = torch.randn(5, 32, generator=gen)
    ids = torch.zeros(5, dtype=torch.int64)
    with torch.no_grad():
        moe.form = "auto"
        base = moe(x, ids)
        assert moe.last_form == "loop"
        moe.to(torch.float64)  # new parameter tensors: the old stacks are stale
        moe.form = "dense"
        got = moe(x.double(), ids)
        assert moe._stacked[0].dtype == torch.float64
        torch.testing.assert_close(got.float(), base, rtol=1e-5, atol=1e-6)
    moe.form = "fast"
    with pytest.raises(EngramError, match="form 'fast' is not one of"):
        moe(x.double(), ids)


def test_attention_backend_choice_on_cpu() -> None:
    from engram_trt.models.deepseek_v4.model import DeepseekV4Model

    from engram_trt.models.step import PackedStep

    cfg = _config()
    model = DeepseekV4Model(cfg).to_empty(device="cpu").eval()  # built on the meta device
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        for m in model.modules():
            if hasattr(m, "tid2eid"):
                m.tid2eid.copy_(torch.randint(0, 6, m.tid2eid.shape, generator=gen))
    assert model.attention_backend == "auto"
    assert "attention torch: the activations are on cpu, not a CUDA device" in model.backend_name
    step = lambda: PackedStep(torch.tensor([3, 4, 5, 6, 7]), [5], [0], [0])  # noqa: E731
    want = model.forward_step(step(), model.new_cache(1, 16))
    model.attention_backend = "torch"
    assert model.attention_label() == "torch: backend torch"
    torch.testing.assert_close(model.forward_step(step(), model.new_cache(1, 16)), want, rtol=0, atol=0)
    model.attention_backend = "kernels"
    with pytest.raises(
        EngramError,
        match=r"^attention backend 'kernels' cannot run layer 0: the activations are on "
        r"cpu, not a CUDA device; use backend 'auto' or 'torch'$",
    ):
        model.forward_step(step(), model.new_cache(1, 16))
    with pytest.raises(EngramError, match="attention backend 'fast' is not one of"):
        model.attention_backend = "fast"
