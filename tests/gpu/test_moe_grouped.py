"""The grouped decode MoE (native/decode.py ``moe_experts_grouped`` over
plugins/kernels/decodeMoeGroupedKernel.cu) on a GPU:

1. Bit for bit ``moe_experts`` (engram_moe_experts_bf16, the same contract): for 1, 5 and 16
   tokens on the same inputs; for 17, 32 and 64 tokens (past moe_experts' 16) against
   moe_experts run on 16-token slices, concatenated (tokens are independent). Layouts: the
   DeepSeek-V4 bench shape (D 2048, I 1024, 8 experts, top 2, a shared expert), an uneven one
   (D 200, I 40, 5 experts, top 3), Qwen's (down stacked side by side ``[D, E * I]``, the
   shared expert scaled by its gate's sigmoid), no shared expert; picks random, all tokens on
   one expert (the largest group: the chunked re-reads), a token picking one expert twice,
   picks outside ``[0, E)`` (-1 and E: they add nothing); the SwiGLU clamp on and off.
   Recorded in a CUDA graph and replayed: the eager outputs.
2. The fused DeepSeek-V4 decode step of a tiny bf16 model with 12, 40 and 64 streams
   (``_moe_batch``'s 9..64-token steps) with ``ENGRAM_TRT_DSV4_MOE_GROUPED=1``: every MoE
   layer through ONE moe_experts_grouped call, the logits against a float32 model within
   test_dsv4_fused.py's bound (2x the unfused bf16 step's distance + 1e-3, median of the steps).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from .helpers import cuda_normal, env, note

# name: (D, I, I_s (0: no shared expert), E, top_k, down side by side, shared_scale)
LAYOUTS: dict[str, tuple[int, int, int, int, int, bool, bool]] = {
    "bench-d2048-e8k2": (2048, 1024, 1024, 8, 2, False, False),
    "uneven-d200-e5k3": (200, 40, 16, 5, 3, False, False),
    "qwen-d256-e16k4": (256, 64, 128, 16, 4, True, True),
    "noshared-d128-e8k2": (128, 64, 0, 8, 2, False, False),
}
PICKS = ["random", "one-expert", "twice", "outside"]


_WEIGHTS: dict[str, tuple[Any, ...]] = {}


def _weights_of(layout: str) -> tuple[Any, ...]:
    """``(gate, up, down, shared)`` of ``layout``, drawn once per session (the bench shape's
    are 100 MB): the cases differ in their tokens and picks."""
    if layout not in _WEIGHTS:
        D, I, Is, E, _k, side, _scaled = LAYOUTS[layout]
        w = np.random.default_rng(sorted(LAYOUTS).index(layout))
        gate = cuda_normal(w, (E, I, D), 3.0 * D**-0.5, "bfloat16")
        up = cuda_normal(w, (E, I, D), 3.0 * D**-0.5, "bfloat16")
        down = cuda_normal(w, (E, D, I), I**-0.5, "bfloat16")
        if side:  # Qwen4Exp's stack: row d holds every expert's down row d side by side
            down = down.permute(1, 0, 2).reshape(D, E * I).contiguous()
        shared = None
        if Is:
            shared = (
                cuda_normal(w, (Is, D), 3.0 * D**-0.5, "bfloat16"),
                cuda_normal(w, (Is, D), 3.0 * D**-0.5, "bfloat16"),
                cuda_normal(w, (D, Is), Is**-0.5, "bfloat16"),
            )
        _WEIGHTS[layout] = (gate, up, down, shared)
    return _WEIGHTS[layout]


def _inputs(rng, layout: str, T: int, picks: str) -> dict[str, Any]:
    import torch

    D, _I, _Is, E, k, _side, scaled = LAYOUTS[layout]
    gate, up, down, shared = _weights_of(layout)
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32)
    if picks == "one-expert":
        ids[:, 0] = E // 2  # every token's first pick: one group of T pairs
    elif picks == "twice":
        ids[::2, -1] = ids[::2, 0]  # a hash table may name one expert twice
    elif picks == "outside":
        ids[::3, 0] = -1
        ids[1::4, -1] = E
    weights = torch.from_numpy(rng.uniform(0.1, 1.0, (T, k)).astype(np.float32)).cuda().to(torch.bfloat16).float()
    return dict(
        x=cuda_normal(rng, (T, D), 1.0, "bfloat16"),
        ids=torch.from_numpy(ids).cuda(),
        weights=weights,
        gate=gate,
        up=up,
        down=down,
        shared=shared,
        shared_scale=cuda_normal(rng, (T, 1), 1.0, "bfloat16") if scaled else None,
    )


def _per_token(a: dict[str, Any], limit: float | None) -> Any:
    """moe_experts on slices of at most MOE_MAX_TOKENS tokens, concatenated."""
    import torch

    from engram_trt.native import decode

    T, step = int(a["x"].shape[0]), decode.MOE_MAX_TOKENS
    outs = []
    for s in range(0, T, step):
        sl = slice(s, min(T, s + step))
        scale = a["shared_scale"]
        outs.append(
            decode.moe_experts(
                a["x"][sl],
                a["ids"][sl],
                a["weights"][sl],
                a["gate"],
                a["up"],
                a["down"],
                shared=a["shared"],
                limit=limit,
                shared_scale=None if scale is None else scale[sl],
            )
        )
    return torch.cat(outs)


def _grouped(a: dict[str, Any], limit: float | None) -> Any:
    from engram_trt.native import decode

    return decode.moe_experts_grouped(
        a["x"],
        a["ids"],
        a["weights"],
        a["gate"],
        a["up"],
        a["down"],
        shared=a["shared"],
        limit=limit,
        shared_scale=a["shared_scale"],
    )


@pytest.mark.parametrize("limit", [None, 1.5])
@pytest.mark.parametrize("picks", PICKS)
@pytest.mark.parametrize("T", [1, 5, 16, 17, 32, 64])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_grouped_experts_equal_moe_experts_bit_for_bit(rng, layout, T, picks, limit) -> None:
    import torch

    a = _inputs(rng, layout, T, picks)
    with torch.no_grad():
        want = _per_token(a, limit)
        got = _grouped(a, limit)
    torch.cuda.synchronize()
    tag = f"{layout}, T {T}, picks {picks}, limit {limit}"
    assert bool(torch.isfinite(want).all()), f"the reference itself is not finite: {tag}"
    differ = int((got.view(torch.int16) != want.view(torch.int16)).sum())
    assert differ == 0, (
        f"moe_experts_grouped = moe_experts bit for bit, {tag}: {differ} of {want.numel()} outputs differ, max "
        f"|diff| {float((got.float() - want.float()).abs().max()):.3g}"
    )


def test_grouped_experts_in_a_cuda_graph_equal_eager(rng) -> None:
    import torch

    a = _inputs(rng, "bench-d2048-e8k2", 32, "random")
    with torch.no_grad():
        eager = _grouped(a, 1.5)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            _grouped(a, 1.5)  # warm-up off the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _grouped(a, 1.5)
        x0 = a["x"].clone()
        a["x"].copy_(cuda_normal(rng, tuple(a["x"].shape), 1.0, "bfloat16"))
        graph.replay()
        moved = _grouped(a, 1.5)
        torch.cuda.synchronize()
        assert torch.equal(out, moved), "a replay reads the step's inputs: the eager call on them"
        a["x"].copy_(x0)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager), "replayed on the first inputs: the first eager outputs"


# --- 2. the fused decode step ----------------------------------------------------------------------------


@pytest.mark.parametrize("streams", [12, 40, 64])
def test_fused_batch_decode_with_grouped_experts_within_round_off(monkeypatch, streams: int) -> None:
    import torch

    from engram_trt.models.deepseek_v4 import fused
    from engram_trt.models.step import PackedStep
    from engram_trt.native import decode

    from .cases import rel_err
    from .test_deepseek_v4_graphs import _config, _model, _weights

    mix = "SCHS-hash1-e8k2"
    cfg = _config(mix)
    weights = _weights(cfg, 13)
    ref = _model(cfg, weights, torch.float32)
    model = _model(cfg, weights, torch.bfloat16)
    calls = {"grouped": 0}
    real = decode.moe_experts_grouped

    def counted(*a, **kw):
        calls["grouped"] += 1
        return real(*a, **kw)

    monkeypatch.setattr(decode, "moe_experts_grouped", counted)
    gen = torch.Generator().manual_seed(streams)
    lens = [int(n) for n in torch.randint(2, 9, (streams,), generator=gen)]
    prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=gen).tolist() for n in lens]
    slots = list(range(streams))
    states = {name: (ref if name == "fp32" else model).new_cache(streams, 64) for name in ("fp32", "grouped", "plain")}
    step = PackedStep(torch.tensor(sum(prompts, [])), lens, [0] * streams, slots)
    for name, st in states.items():
        with env(fused.FUSED_ENV, "0" if name == "plain" else "1"):
            (ref if name == "fp32" else model).forward_step(step, st)
    toks = [p[-1] for p in prompts]
    n_moe = sum(1 for layer in model.model.layers if hasattr(layer.mlp, "last_form"))
    ges, pes, bad, forms = [], [], [], set()
    for k in range(4):
        mk = lambda: PackedStep(torch.tensor(toks), [1] * streams, list(lens), slots)  # noqa: E731
        want = ref.forward_step(mk(), states["fp32"]).cpu()
        before = calls["grouped"]
        with env(fused.FUSED_ENV, "1"), env(fused.MOE_GROUPED_ENV, "1"):
            g = model.forward_step(mk(), states["grouped"]).float().cpu()
        forms |= {layer.mlp.last_form for layer in model.model.layers}
        if calls["grouped"] - before != n_moe:
            bad.append(f"step {k}: {calls['grouped'] - before} grouped calls for {n_moe} MoE layers")
        with env(fused.FUSED_ENV, "0"):
            p = model.forward_step(mk(), states["plain"]).float().cpu()
        ges.append(rel_err(g, want))
        pes.append(rel_err(p, want))
        if not torch.isfinite(g).all():
            bad.append(f"step {k}: logits not finite")
        toks = want.argmax(-1).tolist()
        lens = [n + 1 for n in lens]
    gm, pm = float(np.median(ges)), float(np.median(pes))
    note(f"grouped_decode_{streams}_median_rel_err", {"grouped": gm, "unfused": pm})
    assert not bad and gm <= 2 * pm + 1e-3, (
        f"{mix}, {streams} streams: bf16 decode with the grouped experts within 2x the unfused bf16 distance from "
        f"fp32 + 1e-3 (median of 4 steps): grouped {gm:.2e} vs unfused {pm:.2e}; per step grouped "
        f"{[f'{e:.1e}' for e in ges]} unfused {[f'{e:.1e}' for e in pes]}; {'; '.join(bad[:4])}"
    )
    assert forms == {"fused"}, f"the batch step's MoE took the fused form: forms {sorted(forms)}"
