"""Qwen4Exp's decode-only step forms (the vectorized, host-sync-free code the decode CUDA
graphs record) against the general per-sequence path, on the CPU in float64 / float32:

* the sparse MoE's dense and gathered expert forms equal the per-expert grouped loop;
* the padded QSA block selection equals a per-row top-k over exactly the blocks each
  query sees (distinct scores: ties are implementation-defined in any top-k);
* the PLE fusion's decode form equals its PyTorch path (conv history included);
* the tiny checkpoint's decode steps (three slots out of order, QSA dropping blocks)
  through the decode path equal the general path's logits, and its caches after them.
"""

from __future__ import annotations


import torch

from engram_trt.models.step import PackedStep

from helpers.files import DATA

DATA = DATA / "qwen4_exp_tiny"


def _model(dtype=torch.float32):
    from engram_trt.models.registry import open_checkpoint

    ckpt = open_checkpoint(DATA)
    return ckpt, ckpt.architecture.load_model(ckpt, device="cpu", dtype=dtype)


def _randomize(module: torch.nn.Module, gen: torch.Generator, scale: float = 0.3) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale)


def test_moe_dense_and_gathered_equal_the_grouped_loop() -> None:
    ckpt, model = _model(torch.float64)
    gen = torch.Generator().manual_seed(1)
    moe = model.model.layers[0].mlp
    _randomize(moe, gen)
    for T in (1, 2, 7, 40):
        x = torch.randn(T, model.config.hidden_size, generator=gen, dtype=torch.float64)
        ref = moe(x)
        moe.stack_experts()  # views: the grouped loop reads the same values
        assert torch.equal(moe(x), ref)
        w, ids = moe.route(x)
        shared = moe.shared_expert(x) * torch.sigmoid(moe.shared_expert_gate(x))
        for form in (moe.experts_dense, moe.experts_gathered):
            got = form(x, w, ids) + shared
            assert torch.allclose(got, ref, rtol=1e-12, atol=1e-12), (form.__name__, T, float((got - ref).abs().max()))
        assert torch.allclose(moe(x, sync_free=True), ref, rtol=1e-12, atol=1e-12)
    ckpt.close()


def test_padded_block_selection_equals_per_row_topk() -> None:
    ckpt, model = _model()
    indexer = next(l.self_attn.indexer for l in model.model.layers if l.kind != "linear_attention")
    gen = torch.Generator().manual_seed(2)
    k = indexer.block_topk
    for nb in (k + 1, 9, 33):
        G = 12
        scores = torch.rand(G, nb, generator=gen) + 0.01  # distinct, positive: no ties
        seen = torch.randint(0, nb + 1, (G,), generator=gen)
        got = indexer.select_blocks(scores, seen)
        for g in range(G):
            s = int(seen[g])
            want = torch.ones(nb, dtype=torch.bool)
            if s > k:
                want[:s] = False
                want[scores[g, :s].topk(k).indices] = True
            assert torch.equal(got[g], want), (nb, g, s)
    ckpt.close()


def test_ple_decode_form_equals_the_torch_path() -> None:
    ckpt, model = _model(torch.float64)
    layer = next(l for l in model.model.layers if l.has_ple)
    gen = torch.Generator().manual_seed(3)
    _randomize(layer.ple, gen)
    cfg = model.config
    width, hist = layer.ple.state_shape(cfg)
    state_a = torch.randn(5, width, hist, generator=gen, dtype=torch.float64)
    state_b = state_a.clone()
    slots = [3, 0, 4]
    streams = torch.randn(3, width, generator=gen, dtype=torch.float64)
    rows = torch.randn(3, cfg.ple.embed_dim, generator=gen, dtype=torch.float64)
    ref = layer.ple.forward_torch(streams, rows, [0, 1, 2, 3], [5, 2, 9], slots, state_a)
    got = layer.ple.forward_decode(streams, rows, torch.tensor(slots), torch.zeros(10, dtype=torch.int32), state_b)
    assert torch.allclose(got, ref, rtol=1e-12, atol=1e-12)
    assert torch.equal(state_a, state_b)
    ckpt.close()


def _decode_run(model, decode_path: bool, steps: int = 24) -> tuple[torch.Tensor, object]:
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 96, (n,), generator=gen) for n in (13, 7, 21)]
    slots = [2, 0, 1]
    state = model.new_cache(4, 128)
    model.forward_step(PackedStep(torch.cat(prompts), [len(p) for p in prompts], [0, 0, 0], slots), state)
    lens = [len(p) for p in prompts]
    out = []
    for t in range(steps):
        ids = torch.randint(3, 96, (3,), generator=gen)
        logits = model.forward_step(PackedStep(ids, [1, 1, 1], lens, slots), state, all_logits=not decode_path)
        out.append(logits)
        lens = [n + 1 for n in lens]
    return torch.stack(out), state


def test_tiny_decode_path_equals_the_general_path() -> None:
    ckpt, model = _model()
    fast, sa = _decode_run(model, True)
    slow, sb = _decode_run(model, False)  # all_logits: the general per-sequence path
    assert fast.shape == slow.shape
    assert float((fast - slow).abs().max()) < 1e-5
    for name in ("keys", "values", "index_keys", "conv", "recurrent", "ple_conv"):
        for i, t in getattr(sa, name).items():
            assert torch.allclose(t, getattr(sb, name)[i], rtol=1e-5, atol=1e-6), (name, i)
    assert torch.equal(sa.context, sb.context) and sa.lengths == sb.lengths
    ckpt.close()


def test_decode_context_buckets() -> None:
    from engram_trt.models.qwen4_exp.model import decode_context

    assert [decode_context(n, 4096) for n in (1, 64, 65, 1000)] == [64, 64, 128, 1024]
    assert decode_context(3000, 2048) == 2048
