"""DeepSeek-V4's TensorRT-RTX engine on a GPU: the tiny checkpoint transformers 5.25 saved
(tests/data/deepseek_v4_tiny: HCA / CSA layers, hash and top-k MoE, hc 2) built by
``engram-trt build`` for this GPU and run with TensorRT directly (the runtime's tensorrt
backend does not bind DeepSeek's per-slot states yet: it refuses them at load, and
``auto`` serves the folder with torch). Each layer's EngramDsv4Attention node runs the
project's kernel with every state aliased in place.

  1. float16 engine: a packed prefill of three prompts (slots out of order, the CSA
     indexer dropping entries) and two decode steps; logits against the same exported
     float16 graph run by the ONNX ReferenceEvaluator on the CPU (EngramDsv4Attention
     bound to its float64 reference with the float16 roundings, which breaks indexer
     ties as the kernel does): relative error at most 2e-2 (the GEMMs' accumulation
     order differs), recorded.
  2. bfloat16 engine, same steps: relative L2 distance from the float32 graph's logits
     at most 5e-2, recorded.
  3. The runtime refuses the engine under ``--backend tensorrt`` in one line naming a
     state input, and ``auto`` falls back to torch.

Run: bash tests/gpu/run_h200.sh tests/gpu/test_deepseek_v4_engine.py
"""

from __future__ import annotations

import numpy as np
import pytest

from .helpers import REPO, note

DATA = REPO / "tests" / "data" / "deepseek_v4_tiny"
PROMPTS = [[5, 17, 33, 2, 90, 41, 7, 7, 60, 12, 13, 14, 15], [3, 44, 45, 9], [11 + i for i in range(21)]]
EXTRA = [[7, 8], [9, 2], [2, 12]]
SLOTS = [3, 0, 2]
MAX_LEN = 64


def _schedule():
    lens = [len(p) for p in PROMPTS]
    steps = [(sum(PROMPTS, []), [int(v) for v in np.cumsum([0, *lens])], [0, 0, 0])]
    for d in range(2):
        steps.append(([e[d] for e in EXTRA], [0, 1, 2, 3], list(lens)))
        lens = [n + 1 for n in lens]
    return steps


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    import importlib.util

    from engram_trt.builder.build import build

    if importlib.util.find_spec("tensorrt") is None:
        # TensorRT-RTX builds this graph on a CPU (tests/builder/test_deepseek_v4_build.py) but has
        # no sm_90 target, so only full TensorRT can build and run an engine on an H200.
        pytest.skip(
            "needs the tensorrt module (full TensorRT) to build and run an engine on this GPU; "
            "it is not installed here, and TensorRT-RTX has no sm_90 target"
        )
    root = tmp_path_factory.mktemp("dsv4engine")
    out = {}
    for dtype in ("fp16", "bf16"):
        res = build(
            DATA, root / dtype, dtype=dtype, max_batch=4, max_seq_len=MAX_LEN, max_num_tokens=MAX_LEN, progress=False
        )
        assert res.engine_path is not None, res.engine_skipped
        out[dtype] = root / dtype
    return out


def _reference_logits(dtype):
    from engram_trt.models.deepseek_v4.reference_runner import DeepseekV4ReferenceRunner
    from engram_trt.models.export import ExportOptions
    from engram_trt.models.registry import open_checkpoint

    ckpt = open_checkpoint(DATA)
    exported = ckpt.architecture.export_onnx(
        ckpt.config, ckpt.get, None, ExportOptions(dtype=dtype, max_position=MAX_LEN)
    )
    runner = DeepseekV4ReferenceRunner(exported, ckpt.config, num_slots=4, max_seq_len=MAX_LEN)
    got = [runner.step(np.array(ids), starts, past, SLOTS).astype(np.float64) for ids, starts, past in _schedule()]
    ckpt.close()
    return got


def _engine_logits(folder):
    """The schedule's logits from the engine, run with TensorRT on cuda:0 (states zeroed
    once, then carried in place by the aliased outputs)."""
    import json

    import torch

    from engram_trt.native import trt_compat as tc
    from engram_trt.models.deepseek_v4.onnx_export import resolve_dim

    manifest = json.loads((folder / "manifest.json").read_text())
    io = manifest["graph"]["io"]
    trt = tc.load((manifest.get("tensorrt") or {}).get("flavour"))
    t = trt.module
    assert manifest["plugins"]["embedded"]  # the build embeds the plugin library (as the tensorrt backend expects)
    runtime = tc.create_runtime()
    runtime.engine_host_code_allowed = True
    engine = runtime.deserialize_cuda_engine((folder / "model.engine").read_bytes())
    assert engine is not None
    ctx = engine.create_execution_context()
    dev = torch.device("cuda:0")
    dtypes = {t.DataType.BFLOAT16: torch.bfloat16, t.DataType.HALF: torch.float16, t.DataType.FLOAT: torch.float32}
    states = {}
    for name, spec in io["states"].items():
        shape = [resolve_dim(d, 4, MAX_LEN) for d in spec["shape"]]
        states[name] = torch.zeros(shape, dtype=dtypes[engine.get_tensor_dtype(name)], device=dev)
    alias = {spec["alias"]: name for name, spec in io["states"].items()}
    out = []
    stream = torch.cuda.current_stream(dev)
    for ids, starts, past in _schedule():
        feeds = {"input_ids": ids, "seq_starts": starts, "past_lens": past, "slots": SLOTS}
        feeds = {k: torch.tensor(v, dtype=torch.int32, device=dev) for k, v in feeds.items()}
        feeds.update(states)
        logits = torch.empty((3, manifest["model"]["vocab_size"]), dtype=torch.float32, device=dev)
        for i in range(engine.num_io_tensors):
            name = engine.get_tensor_name(i)
            if engine.get_tensor_mode(name) == t.TensorIOMode.INPUT:
                ctx.set_input_shape(name, tuple(feeds[name].shape))
                ctx.set_tensor_address(name, feeds[name].data_ptr())
            else:
                ctx.set_tensor_address(name, logits.data_ptr() if name == "logits" else states[alias[name]].data_ptr())
        assert ctx.execute_async_v3(stream.cuda_stream)
        stream.synchronize()
        out.append(logits.cpu().numpy())
    return out


def _errors(got, ref):
    errs = [float(np.abs(g - r).max() / np.abs(r).max()) for g, r in zip(got, ref)]
    l2s = [float(np.linalg.norm(g - r) / np.linalg.norm(r)) for g, r in zip(got, ref)]
    same = all(bool((g.argmax(-1) == r.argmax(-1)).all()) for g, r in zip(got, ref))
    return errs, l2s, same


def test_engine_logits_equal_the_reference_graph(folders) -> None:
    errs, l2s, same = _errors(_engine_logits(folders["fp16"]), _reference_logits("fp16"))
    note("fp16_vs_fp16_graph", {"max_rel_err": errs, "rel_l2": l2s, "same_greedy": same})
    assert max(errs) <= 2e-2, f"fp16 engine logits within 2e-2 of the fp16 reference graph (each step): {errs}"
    errs, l2s, same = _errors(_engine_logits(folders["bf16"]), _reference_logits("fp32"))
    note("bf16_vs_fp32_graph", {"max_rel_err": errs, "rel_l2": l2s, "same_greedy": same})
    assert max(l2s) <= 5e-2, f"bf16 engine logits within 5e-2 relative L2 of the fp32 reference graph: {l2s}"


def test_runtime_refuses_the_states_under_tensorrt_and_auto_serves_torch(folders) -> None:
    from engram_trt import LLM
    from engram_trt.errors import EngramError

    try:
        LLM(str(folders["fp16"]), device="cuda", backend="tensorrt", progress=False)
        assert False, "--backend tensorrt refuses a DeepSeek engine: it loaded"
    except EngramError as exc:
        msg = str(exc)
        assert "state inputs" in msg and "window_kv" in msg and len(msg.splitlines()) == 1, (
            f"--backend tensorrt refuses a DeepSeek engine in one line naming a state input: {msg}"
        )
    with LLM(str(folders["fp16"]), device="cuda", progress=False) as llm:
        assert "torch" in llm.backend_label, f"auto serves the engine folder with torch: {llm.backend_label}"
