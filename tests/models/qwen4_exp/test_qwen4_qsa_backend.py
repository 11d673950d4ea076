"""Qwen4Exp's QSA decode core backend on the CPU (tests/gpu/test_qwen4_exp_qsa_decode.py
runs the kernel): ``auto`` takes the torch decode path on a CPU (the same logits as the
path without the step's metadata), ``kernels`` is refused in one line naming why, a bad
backend is refused; the model's label and its context-free flag follow; the kernel's
fields are the layer's (the ONNX export's EngramQsaAttention fields)."""

from __future__ import annotations


import pytest

torch = pytest.importorskip("torch")

from engram_trt.errors import EngramError  # noqa: E402

from helpers.files import DATA  # noqa: E402

DATA = DATA / "qwen4_exp_tiny"


def _model():
    from engram_trt.models.registry import open_checkpoint

    ckpt = open_checkpoint(DATA)
    return ckpt, ckpt.architecture.load_model(ckpt, device="cpu", dtype=torch.float32)


def test_backends_on_a_cpu() -> None:
    ckpt, model = _model()
    attn = model._qsa_layers()[0]
    x = torch.zeros(1, model.config.hidden_size)
    assert attn.why_not_kernel(x) == "the activations are on cpu, not a CUDA device"
    assert model.decode_context_free is False and model.backend_name.endswith(", QSA decode torch)")
    attn.backend = "kernels"
    with pytest.raises(
        EngramError, match=r"attention backend 'kernels' cannot run layer \d+: the activations are on cpu"
    ):
        attn.kernel_serves(x)
    attn.backend = "torch"
    assert attn.why_not_kernel(x) == "backend torch"
    attn.backend = "fast"
    with pytest.raises(EngramError, match=r"GatedAttention.backend 'fast' is not one of"):
        attn.why_not_kernel(x)
    del attn.backend
    ckpt.close()


def test_the_decode_with_metadata_takes_the_torch_path_on_a_cpu() -> None:
    from engram_trt.models.qwen4_exp.attention import rotary_dim

    ckpt, model = _model()
    cfg = model.config
    attn = model._qsa_layers()[0]
    i = attn.layer_idx
    cache_a, cache_b = model.new_cache(3, 32), model.new_cache(3, 32)
    gen = torch.Generator().manual_seed(3)
    for c in (cache_a, cache_b):  # the same random history in both
        for t in (c.keys[i], c.values[i], c.index_keys[i]):
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(t.numel())))
    x = torch.randn(2, cfg.hidden_size, generator=gen)
    pos, slots = torch.tensor([9, 20]), torch.tensor([2, 0])
    meta = torch.cat([torch.arange(3), pos, slots]).to(torch.int32)
    with torch.no_grad():
        want = attn.forward_decode(x, pos, slots, 32, cache_a.keys[i], cache_a.values[i], cache_a.index_keys[i])
        got = attn.forward_decode(
            x, pos, slots, 32, cache_b.keys[i], cache_b.values[i], cache_b.index_keys[i], meta=meta
        )
    assert torch.equal(got, want)
    f = attn.qsa_fields()
    assert (f.compress_ratio, f.block_topk, f.rot_dim) == (
        cfg.indexer_compress_ratio,
        cfg.indexer_budget // cfg.indexer_compress_ratio,
        rotary_dim(cfg),
    )
    assert f.scaling == pytest.approx(cfg.head_dim**-0.5) and f.eps == pytest.approx(cfg.rms_norm_eps)
    ckpt.close()
