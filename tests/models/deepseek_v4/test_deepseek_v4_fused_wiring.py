"""The wiring of DeepSeek-V4's fused decode glue (models/deepseek_v4/fused.py) on a CPU:
which tensor goes into which kernel, in which order, with which norm / RoPE / group
arguments. The kernels themselves need a GPU (tests/gpu/test_dsv4_fused.py holds each
to the module it replaces); here each is replaced by a PyTorch emulation of its contract
(engramKernels.h) and the fused path, forced on for a float32 CPU model, must give the
module path's logits (float32 round-off) over a prefill and decode steps of 1-3
sequences, for three layer mixes (sliding / CSA / HCA, hash and top-k routing, hc 2 and 4,
sqrtsoftplus and sigmoid). The emulated attention core also checks that the compressor's
and indexer's inputs the fused path made equal the ones the core would make itself.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

S_, C_, H_ = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
BASE: dict[str, Any] = dict(
    architectures=["DeepseekV4ForCausalLM"],
    model_type="deepseek_v4",
    vocab_size=96,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=32,
    q_lora_rank=40,
    o_groups=2,
    o_lora_rank=16,
    moe_intermediate_size=24,
    n_shared_experts=1,
    index_n_heads=4,
    index_head_dim=16,
    index_topk=3,
    sliding_window=8,
    compress_rates={C_: 4, H_: 8},
    hc_mult=2,
    hc_sinkhorn_iters=3,
    partial_rotary_factor=0.5,
    num_nextn_predict_layers=0,
    max_position_embeddings=512,
    eos_token_id=2,
    bos_token_id=1,
    tie_word_embeddings=False,
)
MIXES: dict[str, dict[str, Any]] = {
    "SCHS-hash1-e8k2": dict(
        num_hidden_layers=4,
        layer_types=[S_, C_, H_, S_],
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        n_routed_experts=8,
        num_experts_per_tok=2,
    ),
    "CC-topk-e6k3": dict(
        num_hidden_layers=2,
        layer_types=[C_, C_],
        mlp_layer_types=["moe", "moe"],
        n_routed_experts=6,
        num_experts_per_tok=3,
        index_topk=2,
    ),
    "HSH-hash2-hc4-sigmoid": dict(
        num_hidden_layers=3,
        layer_types=[H_, S_, H_],
        mlp_layer_types=["hash_moe", "hash_moe", "moe"],
        n_routed_experts=4,
        num_experts_per_tok=2,
        hc_mult=4,
        scoring_func="sigmoid",
    ),
}


# --- PyTorch emulations of the kernels' contracts ------------------------------------------------------


def _norm_rope(*jobs: Any) -> None:
    from engram_trt.models.deepseek_v4.compressors import apply_rope, unweighted_rms_norm, wide
    from engram_trt.native import decode

    for j in jobs:
        T = j.x.shape[0]
        y = j.x[:, : j.heads * j.dim].reshape(T, j.heads, j.dim)
        if j.norm == decode.NORM_WEIGHTED:
            xf = wide(y)
            y = (j.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + j.eps))).to(y.dtype)
        elif j.norm == decode.NORM_UNWEIGHTED:
            y = unweighted_rms_norm(y, j.eps)
        if j.rope_pairs:
            c, s = j.cos[:, : j.rope_pairs].unsqueeze(1), j.sin[:, : j.rope_pairs].unsqueeze(1)
            y = apply_rope(y, c, s * j.rope_sign)
        j.out[:, : j.heads * j.dim].copy_(y.reshape(T, -1))


def _gemv_segments(segments, *, weight_static: bool = True, prologue: Any = None) -> None:
    from engram_trt.models.deepseek_v4.compressors import apply_rope, wide
    from engram_trt.native import decode

    for x, w, out in segments:
        xin = x[:, : w.shape[1]]
        if prologue is not None and prologue.kind == decode.PROLOGUE_RMSNORM:  # norm_rope's NORM_WEIGHTED job
            assert prologue.dim == xin.shape[1]
            xf = wide(xin)
            xin = (prologue.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + prologue.eps))).to(x.dtype)
        elif prologue is not None and prologue.kind == decode.PROLOGUE_ROPE:  # its NORM_NONE job, on whole heads
            T, p = xin.shape[0], prologue.rope_pairs
            heads = xin.reshape(T, -1, prologue.dim)
            c, s = prologue.cos[:, :p].unsqueeze(1), prologue.sin[:, :p].unsqueeze(1)
            xin = apply_rope(heads, c, s * prologue.rope_sign).reshape(T, -1)
        out[:, : w.shape[0]].copy_(F.linear(xin, w))


def _moe_route(logits, *, top_k, score_fn, scaling, bias=None, tid2eid=None, input_ids=None):
    from engram_trt.models.deepseek_v4.modules import _SCORES

    scores = _SCORES[score_fn](logits)
    ids = tid2eid[input_ids] if bias is None else torch.topk(scores + bias, top_k, dim=-1).indices
    w = scores.gather(1, ids)
    w = w / (w.sum(dim=-1, keepdim=True) + 1e-20) * scaling
    return ids.to(torch.int32), w.float()


def _routed_sum(x, ids, weights, gate, up, down, limit, by_expert: bool):
    """Each token's picked experts' clamped SwiGLU, weighted and summed in pick order (or by
    expert id, ``by_expert``)."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        picks = range(ids.shape[1])
        for j in sorted(picks, key=lambda j: (int(ids[t, j]), j)) if by_expert else picks:
            e = int(ids[t, j])
            g = F.linear(x[t], gate[e]).clamp(max=limit)
            u = F.linear(x[t], up[e]).clamp(min=-limit, max=limit)
            out[t] += F.linear(F.silu(g) * u, down[e]) * weights[t, j].to(x.dtype)
    return out


def _moe_experts(x, ids, weights, gate, up, down, *, shared, limit):
    out = _routed_sum(x, ids, weights, gate, up, down, limit, by_expert=True)
    sg, su, sd = shared
    g = F.linear(x, sg).clamp(max=limit)
    u = F.linear(x, su).clamp(min=-limit, max=limit)
    return out + F.linear(F.silu(g) * u, sd)


def _emulate(monkeypatch: pytest.MonkeyPatch, calls: dict[str, int]) -> None:
    from engram_trt.models.deepseek_v4 import attention_kernel, fused, modules
    from engram_trt.native import decode, mhc

    def counted(name, fn):
        def call(*a, **kw):
            calls[name] = calls.get(name, 0) + 1
            return fn(*a, **kw)

        return call

    monkeypatch.setattr(fused, "unavailable", lambda x: None)
    monkeypatch.setattr(
        decode,
        "gemv_fits",
        lambda x, w: (
            x.dim() == 2 and 1 <= x.shape[0] <= 4 and w.dim() == 2 and x.shape[1] == w.shape[1] and x.dtype == w.dtype
        ),
    )
    monkeypatch.setattr(decode, "norm_rope", counted("norm_rope", _norm_rope))

    def gemv_segments(segments, *, weight_static=True, prologue=None):
        if prologue is not None:
            key = {decode.PROLOGUE_RMSNORM: "prologue_norm", decode.PROLOGUE_ROPE: "prologue_rope"}[prologue.kind]
            calls[key] = calls.get(key, 0) + 1
        return _gemv_segments(segments, weight_static=weight_static, prologue=prologue)

    monkeypatch.setattr(decode, "gemv_segments", counted("gemv_segments", gemv_segments))
    monkeypatch.setattr(decode, "moe_route", counted("moe_route", _moe_route))
    monkeypatch.setattr(decode, "moe_experts", counted("moe_experts", _moe_experts))
    monkeypatch.setattr(modules, "mhc_kernel_serves", lambda *a, **kw: True)

    def pre_norm(streams, fn, base, scale, norm_weight, *, sinkhorn_iters, hc_eps, norm_eps, rms_eps):
        conn = _conn_of[fn.data_ptr()]
        h, post, comb = conn.collapse_torch(streams)
        xf = h.float()
        return (norm_weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + rms_eps))).to(h.dtype), post, comb

    def head_norm(streams, fn, base, scale, norm_weight, *, hc_eps, norm_eps, rms_eps):
        h = _head_of[fn.data_ptr()].forward_torch(streams)
        xf = h.float()
        return (norm_weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + rms_eps))).to(h.dtype)

    monkeypatch.setattr(mhc, "mhc_pre_norm", counted("mhc_pre_norm", pre_norm))
    monkeypatch.setattr(mhc, "mhc_head_norm", counted("mhc_head_norm", head_norm))
    monkeypatch.setattr(
        mhc, "mhc_post", lambda streams, out, post, comb: modules.HyperConnection.expand_torch(streams, out, post, comb)
    )

    def fold(
        streams,
        out,
        post,
        comb,
        fn,
        base,
        scale,
        norm_weight=None,
        *,
        head=False,
        sinkhorn_iters=1,
        hc_eps,
        norm_eps,
        rms_eps=0.0,
        new_streams=None,
        workspace=None,
    ):
        new = modules.HyperConnection.expand_torch(streams, out, post, comb)
        if head:
            normed = head_norm(new, fn, base, scale, norm_weight, hc_eps=hc_eps, norm_eps=norm_eps, rms_eps=rms_eps)
            return new, normed, None, None
        return (
            new,
            *pre_norm(
                new,
                fn,
                base,
                scale,
                norm_weight,
                sinkhorn_iters=sinkhorn_iters,
                hc_eps=hc_eps,
                norm_eps=norm_eps,
                rms_eps=rms_eps,
            ),
        )

    monkeypatch.setattr(mhc, "mhc_fold", counted("mhc_fold", fold))

    def core(layer, x, q, kv, q_residual, cos, sin, n_seqs, meta, state, *, pre=None):
        calls["core"] = calls.get("core", 0) + 1
        S = n_seqs
        m = meta.tolist()
        starts, past, slots = m[: S + 1], m[S + 1 : 2 * S + 1], m[2 * S + 1 : 3 * S + 1]
        comp = layer.compressor
        pre = pre or {}
        want = {}
        if comp is not None:
            want.update(c_kv=comp.kv_proj(x), c_gate=comp.gate_proj(x))
            ix = getattr(comp, "indexer", None)
            if ix is not None:
                if q_residual is None:  # q_b took q_a_norm in its GEMV prologue: the module's own q_residual
                    q_residual = layer.q_a_norm(layer.q_a_proj(x))
                i_q, i_w = ix.queries(q_residual, x, cos, sin)
                want.update(i_q=i_q, i_w=i_w, i_kv=ix.kv_proj(x), i_gate=ix.gate_proj(x))
        assert sorted(pre) == sorted(want), (sorted(pre), sorted(want))
        for k, v in want.items():
            torch.testing.assert_close(pre[k], v, rtol=1e-5, atol=1e-6, msg=k)
        return layer._core_torch(x, q, kv, q_residual, cos, sin, starts, past, slots, state)

    monkeypatch.setattr(attention_kernel, "kernel_serves", lambda layer, x, state: True)
    monkeypatch.setattr(attention_kernel, "core", core)


_conn_of: dict[int, Any] = {}
_head_of: dict[int, Any] = {}


def _wiring_model(mix: str, seed: int) -> Any:
    """The float32 CPU model of ``mix`` (random weights of ``seed``), its hyper-connections
    registered for the emulated mHC kernels (which find a connection by its fn's address)."""
    from engram_trt.bench.dsv4model import random_weights
    from engram_trt.models.deepseek_v4.architecture import ARCHITECTURE
    from engram_trt.models.deepseek_v4.config import read_config

    d = dict(BASE)
    d.update(MIXES[mix])
    cfg = read_config(d, f"wiring {mix}")
    model = ARCHITECTURE.build_model(
        cfg, random_weights(cfg, "cpu", torch.float32, seed), device="cpu", dtype=torch.float32
    )
    for layer in model.model.layers:
        _conn_of[layer.attn_hc.fn.data_ptr()] = layer.attn_hc
        _conn_of[layer.ffn_hc.fn.data_ptr()] = layer.ffn_hc
    _head_of[model.model.hc_head.hc_fn.data_ptr()] = model.model.hc_head
    return model


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_fused_wiring_gives_the_module_path(monkeypatch: pytest.MonkeyPatch, mix: str) -> None:
    from engram_trt.models.step import PackedStep

    model = _wiring_model(mix, 3)
    cfg = model.config
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=gen).tolist() for n in (9, 3, 14)]
    states = {"plain": model.new_cache(3, 64), "fused": model.new_cache(3, 64)}
    calls: dict[str, int] = {}
    lens = [len(p) for p in prompts]
    toks = [5, 9, 13]
    worst = 0.0
    with monkeypatch.context() as mp:
        steps = [("prefill", PackedStep(torch.tensor(sum(prompts, [])), lens, [0, 0, 0], [0, 1, 2]))]
        for k in range(7):
            slots = [0, 1, 2][: 1 + k % 3]
            steps.append(
                (
                    "decode",
                    PackedStep(
                        torch.tensor([toks[s] for s in slots]), [1] * len(slots), [lens[s] for s in slots], slots
                    ),
                )
            )
            for s in slots:
                lens[s] += 1
        for kind, step in steps:
            want = model.forward_step(step, states["plain"], all_logits=kind == "prefill")
            _emulate(mp, calls)
            got = model.forward_step(step, states["fused"], all_logits=kind == "prefill")
            mp.undo()
            worst = max(worst, float((got - want).abs().max() / want.abs().max()))
            if kind == "decode":
                assert {layer.mlp.last_form for layer in model.model.layers} == {"fused"}
    assert worst <= 1e-5, worst
    assert states["plain"].lengths == states["fused"].lengths
    n = cfg.num_hidden_layers
    # per step: the first collapse alone, every later sublayer boundary (expansion + collapse) and the
    # last expansion with the head folded
    assert calls["mhc_pre_norm"] == 8 and "mhc_head_norm" not in calls and calls["mhc_fold"] == 8 * 2 * n
    # attention: a prefill chunk (26 tokens: no GEMV) 3 norm_rope launches a layer (q_a / kv norms, q heads, the
    # inverse RoPE); a decode step 1 (q_a_norm in q_b's GEMV prologue, the inverse RoPE in o_a's)
    assert calls["norm_rope"] == (3 + 7) * n and calls["core"] == 8 * n
    assert calls["prologue_norm"] == 7 * n and calls["prologue_rope"] == 7 * n
    assert calls["moe_route"] == 7 * n and calls["moe_experts"] == 7 * n  # decode steps only (1-3 tokens)


def _routed_experts(x, ids, weights, gate, up, down, *, limit, plan=None):
    """native.quant.experts' contract over bf16 / float stacks: each token's picks in order."""
    return _routed_sum(x, ids, weights, gate, up, down, limit, by_expert=False)


def _batch_steps(cfg: Any, seed: int, id_step: int, past: int) -> tuple[int, list[tuple[str, Any]]]:
    """``(S, steps)``: S = 12 streams' batch steps of ``cfg``'s model (a 26-token chunk, the
    other 11 streams' 2-token chunks together, a 12-stream decode step of ids ``(id_step * s)
    % 90 + 3``, one chunk ``past`` tokens beyond ``BATCH_ROUTE_MAX_TOKENS``), random prompts of
    ``seed``."""
    from engram_trt.models.deepseek_v4 import fused
    from engram_trt.models.step import PackedStep

    gen = torch.Generator().manual_seed(seed)
    S = 12
    prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=gen).tolist() for n in [26] + [2] * (S - 1)]
    lens = [len(p) for p in prompts]
    big = fused.BATCH_ROUTE_MAX_TOKENS + past  # one chunk past the batch path
    decode_ids = torch.tensor([(id_step * s) % 90 + 3 for s in range(S)])
    return S, [
        ("chunk 26", PackedStep(torch.tensor(prompts[0]), [26], [0], [0])),
        ("chunks 22", PackedStep(torch.tensor(sum(prompts[1:], [])), lens[1:], [0] * (S - 1), list(range(1, S)))),
        ("decode 12", PackedStep(decode_ids, [1] * S, lens, list(range(S)))),
        ("chunk past", PackedStep(torch.randint(3, cfg.vocab_size, (big,), generator=gen), [big], [0], [S])),
    ]


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_batch_steps_route_in_one_launch(monkeypatch: pytest.MonkeyPatch, mix: str) -> None:
    """Steps of more tokens than the GEMV takes (a 26-token chunk; a 12-stream decode step):
    the router's picks through ``moe_route`` on the module's own logits, the routed experts
    through the library's product, the shared expert as its module: the module path's
    logits; past ``BATCH_ROUTE_MAX_TOKENS`` tokens the module's forms again."""
    from engram_trt.models.deepseek_v4 import fused, moe
    from engram_trt.native import quant as native_quant

    model = _wiring_model(mix, 5)
    cfg = model.config
    S, steps = _batch_steps(cfg, seed=6, id_step=7, past=5)
    states = {"plain": model.new_cache(S + 1, 128), "fused": model.new_cache(S + 1, 128)}
    calls: dict[str, int] = {}
    n = cfg.num_hidden_layers
    with monkeypatch.context() as mp:
        for name, step in steps:
            want = model.forward_step(step, states["plain"])
            _emulate(mp, calls)
            mp.setattr(moe.GroupedSparseMoE, "kernels_unavailable", lambda self, x: None)
            mp.setattr(native_quant, "experts", _routed_experts)
            before = calls.get("moe_route", 0)
            got = model.forward_step(step, states["fused"])
            mp.undo()
            rel = float((got - want).abs().max() / want.abs().max())
            assert rel <= 1e-5, f"{mix}, {name}: {rel:.3g}"
            T = step.num_tokens
            inside = T <= fused.BATCH_ROUTE_MAX_TOKENS
            assert calls.get("moe_route", 0) - before == (n if inside else 0), name
            forms = {layer.mlp.last_form for layer in model.model.layers}
            assert (forms == {"fused"}) == inside, (name, forms)  # past it: the module's forms (a CPU's: loop)


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_batch_steps_take_the_grouped_experts_when_asked(monkeypatch: pytest.MonkeyPatch, mix: str) -> None:
    """``ENGRAM_TRT_DSV4_MOE_GROUPED=1``: a batch step (chunks of 26 and 22 tokens, a 12-stream
    decode step) runs each MoE layer's routed AND shared experts in ONE ``moe_experts_grouped``
    call (emulated by its contract, moe_experts'), on ``moe_route``'s picks, without
    ``native.quant.experts`` (whose availability it does not ask): the module path's logits.
    Without the switch the library's product serves as before; past ``BATCH_ROUTE_MAX_TOKENS``
    neither. A grouped emulation that drops the shared expert moves the logits: the comparison
    sees the call's output."""
    from engram_trt.models.deepseek_v4 import fused, moe
    from engram_trt.native import decode
    from engram_trt.native import quant as native_quant

    model = _wiring_model(mix, 7)
    cfg = model.config
    S, steps = _batch_steps(cfg, seed=8, id_step=5, past=3)
    states = {"plain": model.new_cache(S + 1, 128), "fused": model.new_cache(S + 1, 128)}
    n = cfg.num_hidden_layers
    for name, step in steps:
        calls: dict[str, int] = {}
        want = model.forward_step(step, states["plain"])
        with monkeypatch.context() as mp:
            _emulate(mp, calls)
            mp.setenv(fused.MOE_GROUPED_ENV, "1")
            mp.setattr(moe.GroupedSparseMoE, "kernels_unavailable", lambda self, x: "asked: not served here")
            mp.setattr(decode, "moe_experts_grouped", _counted(calls, "grouped", _moe_experts))
            mp.setattr(native_quant, "experts", _counted(calls, "quant", _routed_experts))
            got = model.forward_step(step, states["fused"])
        rel = float((got - want).abs().max() / want.abs().max())
        assert rel <= 1e-5, f"{mix}, {name}: {rel:.3g}"
        T = step.num_tokens
        inside = T <= fused.BATCH_ROUTE_MAX_TOKENS
        assert calls.get("grouped", 0) == (n if inside else 0) and "quant" not in calls, (name, calls)
        assert calls.get("moe_route", 0) == (n if inside else 0), (name, calls)
        forms = {layer.mlp.last_form for layer in model.model.layers}
        assert (forms == {"fused"}) == inside, (name, forms)

    # the switch off: the library's product and the shared module, as before
    with monkeypatch.context() as mp:
        calls = {}
        _emulate(mp, calls)
        mp.delenv(fused.MOE_GROUPED_ENV, raising=False)
        mp.setattr(moe.GroupedSparseMoE, "kernels_unavailable", lambda self, x: None)
        mp.setattr(decode, "moe_experts_grouped", _counted(calls, "grouped", _moe_experts))
        mp.setattr(native_quant, "experts", _counted(calls, "quant", _routed_experts))
        fresh = {k: model.new_cache(S + 1, 128) for k in ("plain", "fused")}
        model.forward_step(steps[1][1], fresh["fused"])
        assert calls.get("quant", 0) == n and "grouped" not in calls, calls

    # the comparison can fail: a grouped call without the shared expert moves the logits
    def no_shared(x, ids, weights, gate, up, down, *, shared, limit):
        return _routed_sum(x, ids, weights, gate, up, down, limit, by_expert=True)

    fresh = {k: model.new_cache(S + 1, 128) for k in ("plain", "fused")}
    want = model.forward_step(steps[1][1], fresh["plain"])
    with monkeypatch.context() as mp:
        _emulate(mp, {})
        mp.setenv(fused.MOE_GROUPED_ENV, "1")
        mp.setattr(decode, "moe_experts_grouped", no_shared)
        got = model.forward_step(steps[1][1], fresh["fused"])
    assert float((got - want).abs().max() / want.abs().max()) > 1e-3, "dropping the shared expert went unseen"


def _counted(calls: dict[str, int], name: str, fn: Any) -> Any:
    def call(*a: Any, **kw: Any) -> Any:
        calls[name] = calls.get(name, 0) + 1
        return fn(*a, **kw)

    return call


def _stored_emulation(monkeypatch: pytest.MonkeyPatch, calls: dict[str, int]) -> None:
    """native.quant_decode's segments emulated over the dequantized weights (its contract:
    the prologue's output, then each product), every stored weight taken, norm_rope emulated;
    the launches counted (``prologue`` the segment launches given one)."""
    from types import SimpleNamespace

    from engram_trt.models.deepseek_v4 import fused
    from engram_trt.native import decode

    def segments(segs, *, weight_static=True, prologue=None):
        calls["segments"] = calls.get("segments", 0) + 1
        calls["prologue"] = calls.get("prologue", 0) + (prologue is not None)
        plain = [(x, w if isinstance(w, torch.Tensor) else w.dequantize(torch.float32), o) for x, w, o in segs]
        _gemv_segments(plain, prologue=prologue)

    def norm_rope(*jobs):
        calls["norm_rope"] = calls.get("norm_rope", 0) + 1
        _norm_rope(*jobs)

    qd = SimpleNamespace(MAX_SEGMENTS=8, segment_reason=lambda x, w: None, gemv_segments=segments)
    monkeypatch.setattr(fused, "_quant_fused", lambda: qd)
    monkeypatch.setattr(decode, "norm_rope", norm_rope)
    monkeypatch.setattr(decode, "gemv_fits", lambda x, w: False)


def _fp8(module: Any, gen: torch.Generator) -> Any:
    """``module`` (a QuantLinear / QuantGroupedLinear of FP8 128x128 ue8m0) filled with a random weight."""
    from engram_trt.quant.formats import quantize_fp8

    rows, cols = module.weight.shape
    module.weight, module.weight_scale_inv = quantize_fp8(torch.randn(rows, cols, generator=gen), (128, 128), "ue8m0")
    return module


def test_plain_experts_needs_16_byte_aligned_activations() -> None:
    """The experts' kernels read 16-byte vectors: an x one element off a 16-byte boundary
    (a contiguous view into a larger buffer) is not taken (the module's forms run), the
    same values aligned are."""
    from engram_trt.models.deepseek_v4 import fused

    model = _wiring_model(next(iter(MIXES)), 3)
    mlp = next(layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "stack_experts"))
    stacks = mlp.stack_experts()
    D = model.config.hidden_size
    buf = torch.randn(4 * D + 1, dtype=stacks[0].dtype)
    shifted = buf[1:].view(4, D)
    assert shifted.is_contiguous() and shifted.data_ptr() % 16 != 0
    assert fused._plain_experts(mlp, shifted, stacks) is None
    got = fused._plain_experts(mlp, shifted.clone(), stacks)
    assert got is not None and got[0] is mlp.shared_experts.gate_proj.weight


def test_stored_prologues_take_the_norm_and_rope_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stored-format branches of the fused glue with ENGRAM_TRT_DSV4_QUANT_PROLOGUE (the
    segments emulated on the CPU): q_a_norm before an FP8 q_b and a bf16 indexer q_b, and the
    inverse RoPE before an FP8 grouped o_a, in the segments' prologues with the switch at 1
    (no norm_rope launch), as their own norm_rope launches first at 0 (the default) or with
    ENGRAM_TRT_DSV4_PROLOGUE=0; the same outputs either way."""
    from types import SimpleNamespace

    from engram_trt.models.deepseek_v4 import fused
    from engram_trt.models.deepseek_v4.modules import QuantGroupedLinear
    from engram_trt.native import decode
    from engram_trt.quant.weight import QuantLinear

    gen = torch.Generator().manual_seed(9)
    T, q_lora, H, d, pairs, groups = 3, 192, 4, 64, 16, 2
    norm = SimpleNamespace(weight=1 + 0.2 * torch.randn(q_lora, generator=gen), eps=1e-6)
    q_mods = [_fp8(QuantLinear(q_lora, H * d, "fp8", (128, 128), "ue8m0"), gen), torch.nn.Linear(q_lora, 96, False)]
    o_a = _fp8(QuantGroupedLinear(H * d // groups, 128 * groups, groups, "fp8", (128, 128), "ue8m0"), gen)
    attn = SimpleNamespace(head_dim=d, o_a_proj=o_a, config=SimpleNamespace(o_groups=groups))
    q_a = torch.randn(T, q_lora, generator=gen)
    core = torch.randn(T, H * d, generator=gen)
    ang = torch.rand(T, pairs, generator=gen) * 6.0
    cos, sin = torch.cos(ang), torch.sin(ang)
    runs = {}
    for switches in (("0", "1"), ("1", "1"), ("1", "0")):  # (QUANT_PROLOGUE, PROLOGUE)
        calls: dict[str, int] = {}
        with monkeypatch.context() as mp:
            _stored_emulation(mp, calls)
            mp.setenv(fused.QUANT_PROLOGUE_ENV, switches[0])
            mp.setenv(fused.PROLOGUE_ENV, switches[1])
            q_outs = fused._normed_projection(norm, q_a, q_mods)
            if q_outs is None:  # attention's own path: the norm launch, then the projections
                normed = torch.empty_like(q_a)
                decode.norm_rope(
                    decode.NormRopeJob(q_a, normed, dim=q_lora, norm=decode.NORM_WEIGHTED, weight=norm.weight, eps=1e-6)
                )
                q_outs = fused._project_stored(normed, q_mods, fused._quant_fused())
            flat = core.clone()
            y = fused._grouped_output(attn, flat, cos, sin, pairs)
        runs[switches] = (q_outs, y, calls, flat)
    off, on, all_off = runs[("0", "1")], runs[("1", "1")], runs[("1", "0")]
    for name, run in (("on", on), ("PROLOGUE=0", all_off)):
        assert all(torch.equal(a, b) for a, b in zip(run[0], off[0])), f"{name}: q_b outputs equal the two launches'"
        assert torch.equal(run[1], off[1]), f"{name}: grouped o_a output equals the two launches'"
    assert off[2] == {"norm_rope": 2, "segments": 2, "prologue": 0}, off[2]
    assert all_off[2] == off[2], all_off[2]
    assert on[2] == {"segments": 2, "prologue": 2}, on[2]
    assert torch.equal(on[3], core) and not torch.equal(off[3], core), "the prologue leaves the core's output as it was"
