"""DeepSeek-V4 / V4.1 decode CUDA graphs: what can be checked without a GPU
(tests/gpu/test_deepseek_v4_graphs.py replays the graphs).

- the step in stages (``step_begin`` / ``step_layers`` cut anywhere / ``step_end``) gives
  ``forward_step``'s logits and state exactly, V4 and V4.1 (the stages DecodeGraphs records);
- a bucket's host buffer (``fill_columns``) and the recorded step's device arrays
  (``static_arrays``) give, for the real sequences, the very values
  ``PackedStep.device_arrays`` gives the eager step, and padding on the scratch slot;
- one graph per batch bucket for a context-free model (``context_bucket``), powers of two;
- the sync-free MoE choice for decode steps and its restore; why graphs are off on a CPU;
  a recorded (static) attention step refuses the torch core;
- the state's bytes from the config equal the allocated state's, and a state larger than
  the free GPU memory is refused in one line before anything is allocated.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from engram_trt.errors import EngramError  # noqa: E402
from engram_trt.models.step import PackedStep  # noqa: E402

from helpers.files import DATA  # noqa: E402

DATA = DATA / "deepseek_v4_tiny"


def _v4() -> Any:
    from engram_trt.models.registry import open_checkpoint

    ckpt = open_checkpoint(DATA)
    model = ckpt.architecture.load_model(ckpt, device="cpu", dtype=torch.float32)
    ckpt.close()
    return model


def _v41() -> Any:
    from engram_trt.bench.dsv4model import bench_config, build_model, build_tables, table_store

    bm = build_model(bench_config("tiny", table_gib=0.002, max_len=64), "cpu", torch.float32, seed=3)
    store = table_store(
        build_tables(bm.layout, bm.config.engram.head_dim, "pinned", "cpu"), "pinned", list(bm.layout.layer_ids)
    )
    bm.model.set_tables(store)
    return bm.model


def _prefill(model: Any, state: Any) -> list[int]:
    prompts = [[5, 17, 33, 2, 90, 41, 7, 7, 60, 12, 13], [3, 44, 45, 9, 9], [11 + i for i in range(14)]]
    model.forward_step(
        PackedStep(torch.tensor(sum(prompts, [])), [len(p) for p in prompts], [0, 0, 0], [2, 0, 1]), state
    )
    return [len(p) for p in prompts]


@pytest.mark.parametrize("which", ["v4", "v41"])
def test_the_steps_stages_equal_forward_step(which: str) -> None:
    model = _v4() if which == "v4" else _v41()
    n_layers = len(model.model.layers)
    a, b = model.new_cache(3, 64), model.new_cache(3, 64)
    lens = _prefill(model, a)
    _prefill(model, b)
    for k in range(4):  # decode steps: the whole forward vs the stages cut at every layer boundary in turn
        toks = [(7 + 5 * k + s) % 90 + 3 for s in range(3)]
        step = lambda: PackedStep(torch.tensor(toks), [1, 1, 1], [lens[1], lens[2], lens[0]], [0, 1, 2])  # noqa: E731
        want = model.forward_step(step(), a)
        s = step()
        model._check_step(s, b)
        st = model.step_begin(s, b, None, False)
        cut = 1 + k % (n_layers - 1)
        model.step_layers(st, b, 0, cut)
        model.step_layers(st, b, cut, n_layers)
        got = model.step_end(st, s, b, False, False)
        assert torch.equal(got, want)
        lens = [n + 1 for n in lens]
    for la, lb in zip(a.layers, b.layers):
        assert all(torch.equal(la[k], lb[k]) for k in la)
    assert a.lengths == b.lengths and torch.equal(a.lookback, b.lookback)


def test_a_buckets_buffer_gives_the_eager_steps_device_arrays() -> None:
    from engram_trt.runtime.cuda_graphs import fill_columns, static_arrays

    S, G, scratch, n_lb = 3, 4, 9, 2
    lookup = np.arange(100, dtype=np.int64) * 3 - 1
    lookback = torch.tensor([[4, 5], [-1, 6], [7, 8]])
    step = PackedStep(torch.tensor([11, 12, 13]), [1, 1, 1], [5, 0, 17], [2, 0, 7], lookback=lookback)
    h = np.full((5 + n_lb, G), 77, dtype=np.int64)
    fill_columns(h, step, S, G, scratch, lookup)
    assert h[:, :S].tolist() == [[11, 12, 13], [32, 35, 38], [5, 0, 17], [2, 0, 7], [6, 1, 18], [4, -1, 7], [5, 6, 8]]
    assert h[:, S:].reshape(-1).tolist() == [0, 0, 0, scratch, 1, -1, -1]  # the padding sequence
    got = static_arrays(torch.from_numpy(h), torch.arange(G + 1), G, True)
    want = step.device_arrays("cpu")
    for name in (
        "input_ids",
        "positions",
        "token_slots",
        "last",
        "decode_rows",
        "decode_slots",
        "decode_lens",
        "past_lens",
        "slots",
    ):
        assert got[name][:S].tolist() == want[name].tolist(), name
    assert got["seq_starts"][: S + 1].tolist() == want["seq_starts"].tolist()
    assert got["engram_ids"][:S].tolist() == lookup[[11, 12, 13]].tolist()
    assert got["seq_starts"].tolist() == list(range(G + 1)) and got["last"].numel() == G
    # a padded column set once is kept when S is unchanged (pad=False), the real columns rewritten
    h[:, S:] = 55
    fill_columns(h, step, S, G, scratch, lookup, pad=False)
    assert (h[:, S:] == 55).all() and h[0, :S].tolist() == [11, 12, 13]
    # an explicit engram_ids override wins over the lookup
    step2 = PackedStep(
        torch.tensor([11, 12, 13]), [1, 1, 1], [5, 0, 17], [2, 0, 7], engram_ids=torch.tensor([-1, 4, 2])
    )
    fill_columns(h, step2, S, G, scratch, lookup)
    assert h[1, :S].tolist() == [-1, 4, 2]


def test_context_buckets() -> None:
    from engram_trt.runtime.cuda_graphs import MIN_CONTEXT_BUCKET, context_bucket

    assert [context_bucket(n, 4096, True) for n in (1, 65, 4000)] == [4096] * 3
    assert [context_bucket(n, 4096) for n in (1, MIN_CONTEXT_BUCKET, 65, 129, 4000)] == [64, 64, 128, 256, 4096]
    assert context_bucket(300, 200) == 200


def test_deepseek_is_context_free_and_graphs_are_off_on_a_cpu() -> None:
    from engram_trt.models.deepseek_v4.graphs import graphs_unavailable

    model = _v4()
    assert model.decode_context_free is True
    assert graphs_unavailable(model) == "the model is on cpu, not a CUDA device"
    assert model.supports_decode_graphs is False


def test_a_recorded_attention_step_refuses_the_torch_core() -> None:
    model = _v4()
    attn = model.model.layers[0].self_attn
    state = model.new_cache(2, 32).layers[0]
    x = torch.randn(2, model.config.hidden_size)
    with pytest.raises(
        EngramError, match="layer 0's attention core is not on the CUDA kernel .* a recorded decode step"
    ):
        attn(x, torch.tensor([3, 4]), [0, 1, 2], [3, 4], [0, 1], state, static=True)


def test_decode_moe_form() -> None:
    from engram_trt.models.deepseek_v4.graphs import decode_moe_form

    assert decode_moe_form("gathered", 4, 8, 8192) is None and decode_moe_form("dense", 4, 8, 8192) is None
    assert decode_moe_form("grouped", 64, 8, 8192) == "dense"
    assert decode_moe_form("loop", 1024, 8, 8192) == "dense"
    assert decode_moe_form("grouped", 1025, 8, 8192) == "gathered"
    assert decode_moe_form("kernels", 64, 256, 8192) is None  # a form not known to read the host is kept


def test_sync_free_moe_swaps_and_restores_the_form() -> None:
    from engram_trt.models.deepseek_v4.graphs import sync_free_moe

    model = _v4()
    mlp = model.model.layers[1].mlp
    x_cpu = torch.randn(4, model.config.hidden_size)
    with sync_free_moe(mlp, x_cpu):
        assert "form" not in mlp.__dict__ and mlp.form == "auto"  # a CPU step keeps the loop
    fake_cuda = SimpleNamespace(is_cuda=True, shape=(64, model.config.hidden_size))
    seen = []
    mlp.choose_form = lambda x, ids: seen.append(tuple(ids.shape)) or "grouped"
    with sync_free_moe(mlp, fake_cuda):
        assert mlp.form == "dense"
    assert seen == [(64, model.config.num_experts_per_tok)] and "form" not in mlp.__dict__
    mlp.form = "gathered"  # set explicitly: left alone
    with sync_free_moe(mlp, fake_cuda):
        assert mlp.form == "gathered"
    assert mlp.form == "gathered"


@pytest.mark.parametrize("which,dtype", [("v4", torch.float32), ("v4", torch.bfloat16), ("v41", torch.float32)])
def test_state_bytes_equal_the_allocated_state(which: str, dtype: torch.dtype) -> None:
    from engram_trt.models.deepseek_v4.state import DeepseekV4State, state_bytes

    cfg = _v4().config if which == "v4" else _v41().config
    state = DeepseekV4State.allocate(cfg, 5, 48, "cpu", dtype)
    allocated = state.nbytes() + state.lookback.numel() * state.lookback.element_size()
    assert state_bytes(cfg, 5, 48, dtype) == allocated
    assert (state.lookback.shape[1] > 0) == (which == "v41")


def test_a_state_larger_than_the_free_gpu_memory_is_refused_before_allocating(monkeypatch: Any) -> None:
    from engram_trt.models.deepseek_v4.state import DeepseekV4State, state_bytes

    cfg = _v4().config
    need = state_bytes(cfg, 9, 256, torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (need - 1, 80 << 30))
    # no CUDA here: a tensor allocated on cuda:0 would fail otherwise, so the refusal comes first
    with pytest.raises(EngramError) as err:
        DeepseekV4State.allocate(cfg, 9, 256, "cuda:0", torch.bfloat16)
    msg = str(err.value)
    assert "\n" not in msg
    assert f"9 slots x 256 tokens needs {need} bytes" in msg and f"only {need - 1} bytes" in msg
    assert "lower --max-batch-size or --max-seq-len" in msg
