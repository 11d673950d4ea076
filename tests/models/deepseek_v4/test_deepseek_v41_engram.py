"""DeepSeek-V4.1 with real (random bf16) Engram tables against the project's float64 math.

The model under test is a transformers-saved V4 checkpoint turned V4.1 by
``test_deepseek_v4_parity.save_v41``. Each Engram layer's update is captured with a forward
hook (its input streams, the rows it was handed, its output) over a packed prefill (two
sequences, EOS and pad ids in the prompts, one prefill chunked), then decode steps; the
oracle is written here from the spec's pieces, none of them the model's torch path:

* compressed ids from the tokenizer (``build_compressed_vocab``), each sequence's
  lookback kept by this test (the N-1 compressed ids before the step, -1 at the start);
* row ids from ``hashing.hash_batch_packed`` (NumPy) over the packed step;
* rows read from the checkpoint's bf16 table tensors in float64;
* ``kv = rows @ wkv^T`` and the gate from ``fusion.engram_gate_reference`` (NumPy
  float64) on the hooked input streams.

Tolerances: the float32 model's Engram contribution within 1e-5 of the largest
contribution's magnitude (one float32 GEMM of width <= 48 and the gate); the whole model
in float64 against float32, logits within 1e-4 relative (the issue's bound).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from helpers.deepseek_v4 import save_v41  # noqa: E402

from engram_trt.engram.fusion import engram_gate_reference  # noqa: E402
from engram_trt.engram.hashing import DEAD, hash_batch_packed  # noqa: E402
from engram_trt.models.step import PackedStep  # noqa: E402

EOS, PAD = 2, 0
PROMPTS = [[5, 17, EOS, 33, PAD, PAD, 41, 7, 7, 60, EOS, 12], [PAD, EOS, 44, 45, 9, PAD, 3, 3, 81]]
LAYERS = (0, 2)  # save_v41's engram_layer_ids
DECODE_STEPS = 4


@pytest.fixture(scope="module")
def v41(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from engram_trt.engram.tokenizer import build_compressed_vocab
    from engram_trt.models.registry import open_checkpoint

    folder = tmp_path_factory.mktemp("v41ref") / "ck"
    gen = torch.Generator().manual_seed(23)
    save_v41(folder, lambda rows, width: torch.randn(rows, width, generator=gen), seed=5)
    ckpt = open_checkpoint(folder)
    lookup = np.asarray(build_compressed_vocab(ckpt.tokenizer_json).lookup, dtype=np.int64)
    yield ckpt, lookup
    ckpt.close()


def _model(ckpt: Any, dtype: torch.dtype) -> Any:
    from engram_trt.tables.base import TableStore

    model = ckpt.architecture.load_model(ckpt, device="cpu", dtype=dtype)
    model.set_tables(
        TableStore.from_tensors(
            [ckpt.get(f"model.layers.{lid}.engram.embed.weight") for lid in LAYERS], [None] * len(LAYERS), 32, LAYERS
        )
    )
    return model


def _schedule(model: Any, state: Any) -> Any:
    """Yield ``(step, logits)`` over a packed prefill (sequence 1 in two chunks: slots 1
    and 0, the second chunk packed with sequence 0's first decode token), then decode
    steps of both; the next tokens are the model's own greedy ones."""
    a, b = PROMPTS
    cut = 4
    step = PackedStep(torch.tensor(a + b[:cut]), [len(a), cut], [0, 0], [1, 0])
    logits = model.forward_step(step, state)
    yield step, logits
    tok_a = int(torch.argmax(logits[0]))
    step = PackedStep(torch.tensor([tok_a] + b[cut:]), [1, len(b) - cut], [len(a), cut], [1, 0])
    logits = model.forward_step(step, state)
    yield step, logits
    lens = [len(a) + 1, len(b)]
    for _ in range(DECODE_STEPS):
        toks = [int(t) for t in torch.argmax(logits, dim=-1)]
        step = PackedStep(torch.tensor(toks), [1, 1], lens, [1, 0])
        logits = model.forward_step(step, state)
        yield step, logits
        lens = [n + 1 for n in lens]


def test_each_engram_layer_equals_the_float64_reference(v41: Any) -> None:
    from engram_trt.engram.layout import EngramLayout

    ckpt, lookup = v41
    model = _model(ckpt, torch.float32)
    spec = ckpt.config.engram
    layout = EngramLayout.from_spec(spec, pad_id=int(lookup[spec.pad_token_id]))
    assert np.array_equal(model.compress_lookup.numpy()[: lookup.shape[0]], lookup)
    f64 = lambda name: ckpt.get(name).to(torch.float64).numpy()  # noqa: E731
    tables = [f64(f"model.layers.{lid}.engram.embed.weight") for lid in LAYERS]
    wkv = [f64(f"model.layers.{lid}.engram.wkv.weight") for lid in LAYERS]
    qw = [f64(f"model.layers.{lid}.engram.q_weight") for lid in LAYERS]
    kw = [f64(f"model.layers.{lid}.engram.k_weight") for lid in LAYERS]

    seen: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]] = [[] for _ in LAYERS]
    hooks = [
        model.model.layers[lid].engram.register_forward_hook(
            lambda _m, args, out, li=li: seen[li].append(
                (args[0].clone(), args[1].clone(), args[2].clone(), out.clone())
            )
        )
        for li, lid in enumerate(LAYERS)
    ]
    history: dict[int, list[int]] = {0: [], 1: []}  # compressed ids per slot, kept here
    n = layout.max_ngram_size - 1
    state = model.new_cache(2, 64)
    steps = 0
    saw_pad = saw_eos = False
    try:
        for step, _logits in _schedule(model, state):
            ids = step.input_ids.numpy()
            saw_pad |= bool((ids == PAD).any())
            saw_eos |= bool((ids == EOS).any())
            cids = lookup[ids]
            lookback = np.array([([DEAD] * n + history[slot])[-n:] for slot in step.slots], dtype=np.int64)
            hid = hash_batch_packed(cids, step.seq_starts, lookback, layout)  # [T, L, cols]
            for s, slot in enumerate(step.slots):
                history[slot] += cids[step.seq_starts[s] : step.seq_starts[s + 1]].tolist()
            for li in range(len(LAYERS)):
                h_in, rows, live, out = seen[li][steps]
                want_rows = tables[li][hid[:, li, :]]  # [T, cols, head_dim]
                assert np.array_equal(rows.double().numpy(), want_rows), f"step {steps} layer {LAYERS[li]}: rows"
                assert np.array_equal(live.numpy(), cids >= 0)
                kv = want_rows.reshape(want_rows.shape[0], -1) @ wkv[li].T
                hin = h_in.double().numpy()
                want = engram_gate_reference(hin, kv, qw[li], kw[li], cids >= 0, ckpt.config.rms_norm_eps)
                got_delta, want_delta = out.double().numpy() - hin, want - hin
                scale = np.abs(want_delta).max()
                assert scale > 1e-2  # the tables do move the streams
                err = np.abs(got_delta - want_delta).max()
                assert err <= 1e-5 * scale, f"step {steps} layer {LAYERS[li]}: {err:.3e} vs scale {scale:.3e}"
            steps += 1
    finally:
        for h in hooks:
            h.remove()
    assert steps == 2 + DECODE_STEPS and all(len(s) == steps for s in seen)
    assert saw_pad and saw_eos
    # The lookback mattered: the decode steps' row ids differ from those of the same
    # tokens hashed with no lookback.
    assert not np.array_equal(
        hash_batch_packed(cids, step.seq_starts, lookback, layout),
        hash_batch_packed(cids, step.seq_starts, None, layout),
    )
    assert state.lookback.tolist() == [history[slot][-n:] for slot in (0, 1)]


def test_float64_model_agrees_with_float32_within_1e4(v41: Any) -> None:
    ckpt, _lookup = v41
    m32, m64 = _model(ckpt, torch.float32), _model(ckpt, torch.float64)
    assert {p.dtype for n, p in m64.named_parameters() if "embed_tokens" in n or "wkv" in n} == {torch.float64}
    s32, s64 = m32.new_cache(2, 64), m64.new_cache(2, 64)
    assert all(t.dtype == torch.float64 for layer in s64.layers for t in layer.values())
    steps = 0
    for (step32, l32), (step64, l64) in zip(_schedule(m32, s32), _schedule(m64, s64)):
        assert step32.input_ids.tolist() == step64.input_ids.tolist()  # same greedy tokens
        ref = l64.double()
        err = (l32.double() - ref).abs().max().item()
        assert err <= 1e-4 * ref.abs().max().item(), f"step {steps}: {err:.3e}"
        steps += 1
    assert steps == 2 + DECODE_STEPS
