"""The whole model on a GPU without TensorRT: the PyTorch path calling the kernel library
(formerly scripts/h200_model_check.py).

  1. The demo checkpoint (random weights) is made (``ENGRAM_TRT_CACHE``).
  2. The same model runs four ways on the GPU in bfloat16: the PyTorch Engram path, and
     the kernel-library Engram path with tables in GPU memory, in pinned host memory
     (UVA gather) and read from the checkpoint's file mapping (host gather). Each is
     compared with the float32 CPU reference on a prefill of 512 fresh random tokens
     (relative L2 error of the logits < 1e-2), and the three kernel paths must give
     bit-identical logits (the gathers are exact).
  3. Greedy generation: the kernel path's tokens vs the PyTorch path's tokens, and decode
     tokens/s of three paths (figures in the JSON, not checks).
  4. ``engram-trt demo --device cuda`` end to end, naming its backend.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from .helpers import REPO, note

TOKENS = 512  # prefill length of the comparison
NEW_TOKENS = 64  # greedy tokens generated per path
PATHS = [
    "torch (cuda, bf16)",
    "kernels, tables in HBM",
    "kernels, tables pinned host (UVA)",
    "kernels, tables file-mapped (host gather)",
]


def rel_err(a, ref) -> float:
    a, ref = a.double().cpu(), ref.double().cpu()
    return float((a - ref).norm() / ref.norm())


@pytest.fixture(scope="module")
def models(test_seed_module):
    """(ids, float32 CPU reference logits, {path: model}, {path: logits})."""
    import torch

    from engram_trt.checkpoint.checkpoint import Checkpoint
    from engram_trt.engram.tokenizer import build_compressed_vocab
    from engram_trt.models.engram_llama.demo import ensure_demo_checkpoint
    from engram_trt.models.engram_llama.model import EngramLlama

    ckpt = Checkpoint.open(ensure_demo_checkpoint())
    vocab = build_compressed_vocab(ckpt.tokenizer_json)
    cuda = torch.device("cuda")

    def load(device, dtype, backend: str, storage: str = "memory") -> EngramLlama:
        return EngramLlama.from_checkpoint(
            ckpt, device=device, dtype=dtype, table_storage=storage, compressed_vocab=vocab, engram_backend=backend
        )

    gen = torch.Generator().manual_seed(test_seed_module)
    ids = torch.randint(0, ckpt.config.vocab_size, (TOKENS,), generator=gen)
    ref = load("cpu", torch.float32, "torch")(ids)
    paths = {
        "torch (cuda, bf16)": load(cuda, torch.bfloat16, "torch"),
        "kernels, tables in HBM": load(cuda, torch.bfloat16, "kernels", "memory"),
        "kernels, tables pinned host (UVA)": load(cuda, torch.bfloat16, "kernels", "pinned"),
        "kernels, tables file-mapped (host gather)": load(cuda, torch.bfloat16, "kernels", "file"),
    }
    logits = {name: model(ids.to(cuda)).float() for name, model in paths.items()}
    yield ids, ref, paths, logits
    del paths, logits
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def test_seed_module(gpu_seed: int) -> int:
    return (gpu_seed * 2654435761 + 5) & 0x7FFF_FFFF


@pytest.mark.parametrize("name", PATHS)
def test_prefill_vs_fp32_reference(models, name) -> None:
    """bf16 weights and activations against the float32 reference: 1e-2 relative L2."""
    import torch

    _, ref, paths, logits = models
    err = rel_err(logits[name], ref)
    passed = err < 1e-2 and torch.isfinite(logits[name]).all().item()
    assert passed, (
        f"prefill {TOKENS} tokens vs fp32 CPU reference: {name} ({paths[name].backend_name}): rel_l2={err:.2e}"
    )


KERNEL_PATHS = [n for n in PATHS if n.startswith("kernels")]


@pytest.mark.parametrize("n", KERNEL_PATHS[1:])
def test_kernel_paths_bit_identical(models, n) -> None:
    import torch

    _, _, _, logits = models
    assert torch.equal(logits[n], logits[KERNEL_PATHS[0]]), f"bit-identical logits: {n} == {KERNEL_PATHS[0]}"


def test_greedy_figures(models) -> None:
    """Greedy tokens (torch vs kernels agreement) and decode tokens/s of three paths: figures
    for the JSON, not checks."""
    ids, _, paths, _ = models
    timing, tokens = {}, {}
    prompt = ids[:32].tolist()
    for name in ("torch (cuda, bf16)", "kernels, tables in HBM", "kernels, tables pinned host (UVA)"):
        model = paths[name]
        model.generate(prompt, max_new_tokens=4, eos=[])  # warm-up
        r = model.generate(prompt, max_new_tokens=NEW_TOKENS, eos=[])
        tokens[name] = r.new_ids
        timing[name] = {"decode_tokens_per_s": round(r.decode_tokens_per_s, 1), "prefill_s": round(r.prefill_s, 4)}
    agree = sum(a == b for a, b in zip(tokens["torch (cuda, bf16)"], tokens["kernels, tables in HBM"]))
    note("greedy_tokens_agreeing", f"{agree}/{NEW_TOKENS}")
    note("timing", timing)


def test_demo_cli() -> None:
    """``engram-trt demo --device cuda`` end to end: exit 0, the kernel library's backend named."""
    env = dict(os.environ, PYTHONPATH=str(REPO / "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    demo = subprocess.run(
        [sys.executable, "-m", "engram_trt", "demo", "--device", "cuda", "--max-new-tokens", "16"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    output = demo.stdout[-3000:] + demo.stderr[-2000:]
    note("demo_output", output)
    assert demo.returncode == 0 and "engram cuda-kernels" in demo.stdout, (
        f"engram-trt demo --device cuda: exit 0, backend 'engram cuda-kernels': rc {demo.returncode}: {output[-300:]}"
    )
