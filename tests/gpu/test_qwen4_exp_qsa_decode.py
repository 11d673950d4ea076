"""Qwen4Exp's decode step with its QSA layers' core on the QSA kernel
(``GatedAttention.forward_decode`` -> native/qsa.qsa_attention), on a GPU, against the torch
decode path (the kernel's reference) on the tiny checkpoint transformers saved
(tests/data/qwen4_exp_tiny):

  1. float32: the decode steps' logits with the kernel within 1e-4 relative of the torch
     path's and the same greedy tokens, eager and replayed; the label names the core;
  2. the decode graphs with the kernel: one graph per batch bucket whatever the lengths
     (context = max_len), replays equal to eager kernel steps, a replay under torch's
     sync debug mode ``error``;
  3. bfloat16: the kernel path's logits' distance from the float32 torch path's at most
     2x the bf16 torch path's own + 1e-3.
"""

from __future__ import annotations

import json

from .cases import rel_err

from .helpers import REPO, load_checkpoint, say

DATA = REPO / "tests" / "data" / "qwen4_exp_tiny"


def _set(model, backend: str) -> None:
    for attn in model._qsa_layers():
        attn.backend = backend


def _decode(model, prompts, steps, graphs_cls=None, max_len=256):
    """(tokens per step, logits per step, graphs) of a packed prefill then ``steps`` decode
    steps of all prompts; the next tokens are fixed ids, so every path sees the same inputs."""
    import torch

    from engram_trt.models.step import PackedStep

    S = len(prompts)
    cache = model.new_cache(S + 1, max_len)
    slots = list(range(S))[::-1]
    logits = model.forward_step(
        PackedStep(torch.tensor(sum(prompts, [])), [len(p) for p in prompts], [0] * S, slots), cache
    )
    graphs = graphs_cls(model, cache, S, scratch_slot=S) if graphs_cls is not None else None
    lens = [len(p) for p in prompts]
    out = []
    for k in range(steps):
        tok = torch.tensor([(11 * k + 7 * s) % 90 + 3 for s in range(S)])
        step = PackedStep(tok, [1] * S, lens, slots)
        got = graphs.run(step) if graphs is not None else None
        logits = (got if got is not None else model.forward_step(step, cache)).float().cpu().clone()
        out.append(logits)
        lens = [n + 1 for n in lens]
    return out, graphs


def _prompts():
    return [list(p) for p in json.loads((DATA / "expected.json").read_text())["prompts"]]


def test_qsa_kernel_decode_equals_the_torch_decode_fp32() -> None:
    import torch

    from engram_trt.models.qwen4_exp.graphs import Qwen4ExpDecodeGraphs

    ckpt, model = load_checkpoint(DATA, "cuda", torch.float32)
    prompts = _prompts()
    _set(model, "torch")
    want, _ = _decode(model, prompts, 14)
    _set(model, "kernels")
    assert "QSA decode cuda-kernel" in model.backend_name, f"the label names the QSA decode core: {model.backend_name}"
    got, _ = _decode(model, prompts, 14)
    errs = [rel_err(g, w) for g, w in zip(got, want)]
    same = all(torch.equal(g.argmax(-1), w.argmax(-1)) for g, w in zip(got, want))
    assert max(errs) <= 1e-4, (
        f"fp32 QSA kernel decode within 1e-4 of the torch decode, every step: "
        f"rel L2 per step {[f'{e:.1e}' for e in errs]}"
    )
    assert same, "fp32 QSA kernel decode: the torch decode's greedy picks, every step"
    replay, graphs = _decode(model, prompts, 14, Qwen4ExpDecodeGraphs)
    diff = max(rel_err(r, g) for r, g in zip(replay, got))
    keys = sorted(graphs.graphs)
    assert graphs.failed is None and keys == [(4, 256)] and diff <= 1e-5, (
        "decode graphs with the QSA kernel: one graph per bucket (context = max_len), replays = eager kernel steps: "
        f"graphs {keys}, failed {graphs.failed}, replay vs eager rel L2 {diff:.1e}"
    )
    # a replay under sync debug mode 'error'
    from engram_trt.models.step import PackedStep

    cache = graphs.cache
    S = len(prompts)
    slots = list(range(S))[::-1]
    lens = [cache.lengths[s] for s in slots]
    err = ""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        graphs.run(PackedStep(torch.tensor([5] * S), [1] * S, lens, slots))
    except RuntimeError as exc:
        err = str(exc).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    if graphs.lookup_in_graph:  # else the PLE rows come from the host gather before the replay (a copy back)
        assert not err, f"a Qwen4Exp decode replay with the QSA kernel runs under sync debug mode 'error': {err}"
    else:
        say(
            f"sync debug check not made: the PLE rows are gathered before the replay (paths "
            f"{model.ple_tables.paths}); {err or 'no synchronizing call'}"
        )
    _set(model, "auto")
    ckpt.close()


def test_qsa_kernel_decode_bf16_within_round_off() -> None:
    import torch

    ckpt, ref_model = load_checkpoint(DATA, "cuda", torch.float32)
    prompts = _prompts()
    _set(ref_model, "torch")
    want, _ = _decode(ref_model, prompts, 10)
    ckpt.close()
    ckpt, model = load_checkpoint(DATA, "cuda", torch.bfloat16)
    _set(model, "torch")
    eager, _ = _decode(model, prompts, 10)
    _set(model, "kernels")
    got, _ = _decode(model, prompts, 10)
    bad = [
        f"step {k}: kernel {rel_err(g, w):.2e} vs torch bf16 {rel_err(e, w):.2e}"
        for k, (g, e, w) in enumerate(zip(got, eager, want))
        if not rel_err(g, w) <= 2 * rel_err(e, w) + 1e-3
    ]
    assert not bad, (
        "bf16 QSA kernel decode: distance from fp32 at most 2x the torch bf16 path's + 1e-3, every step: "
        + "; ".join(bad[:4])
    )
    _set(model, "auto")
    ckpt.close()
