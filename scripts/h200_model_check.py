#!/usr/bin/env python3
"""The whole model on a GPU without TensorRT: the PyTorch path calling the kernel library.

One device call (after ``cmake`` has built the library for the GPU):
  1. The demo checkpoint (random weights) is made on the device.
  2. The same model runs three ways on the GPU in bfloat16: the PyTorch Engram path,
     the kernel-library Engram path with tables in GPU memory, in pinned host memory
     (UVA gather) and read from the checkpoint's file mapping (host gather). All are
     compared with the float32 CPU reference on a prefill of fresh random tokens
     (relative L2 error of the logits) and with each other (the three kernel paths
     must give bit-identical logits: the gathers are exact).
  3. Greedy generation: the kernel path's tokens vs the PyTorch path's tokens, and
     decode tokens/s of both, measured in the same run.
  4. ``engram-trt demo --device cuda`` end to end, printing its backend.
Writes $OUT/h200_model_check.json; prints a summary last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python"))

import torch  # noqa: E402

from engram_trt.checkpoint.checkpoint import Checkpoint  # noqa: E402
from engram_trt.models.engram_llama.demo import ensure_demo_checkpoint  # noqa: E402
from engram_trt.models.engram_llama.model import EngramLlama  # noqa: E402
from engram_trt.engram.tokenizer import build_compressed_vocab  # noqa: E402


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double().cpu(), ref.double().cpu()
    return float((a - ref).norm() / ref.norm())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"), help="folder for the JSON result")
    ap.add_argument("--tokens", type=int, default=512, help="prefill length of the comparison (default 512)")
    ap.add_argument("--new-tokens", type=int, default=64, help="greedy tokens generated per path (default 64)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "checks": {}}
    ok = True

    t0 = time.perf_counter()
    ckpt = Checkpoint.open(ensure_demo_checkpoint())
    vocab = build_compressed_vocab(ckpt.tokenizer_json)
    res["demo_checkpoint_s"] = round(time.perf_counter() - t0, 2)
    cuda = torch.device("cuda")

    def load(device: str | torch.device, dtype: torch.dtype, backend: str, storage: str = "memory") -> EngramLlama:
        return EngramLlama.from_checkpoint(ckpt, device=device, dtype=dtype, table_storage=storage,
                                           compressed_vocab=vocab, engram_backend=backend)

    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    ids = torch.randint(0, ckpt.config.vocab_size, (args.tokens,), generator=gen)
    ref = load("cpu", torch.float32, "torch")(ids)
    paths = {
        "torch (cuda, bf16)": load(cuda, torch.bfloat16, "torch"),
        "kernels, tables in HBM": load(cuda, torch.bfloat16, "kernels", "memory"),
        "kernels, tables pinned host (UVA)": load(cuda, torch.bfloat16, "kernels", "pinned"),
        "kernels, tables file-mapped (host gather)": load(cuda, torch.bfloat16, "kernels", "mmap"),
    }
    logits = {}
    for name, model in paths.items():
        logits[name] = model(ids.to(cuda)).float()
        err = rel_err(logits[name], ref)
        # bf16 weights and activations against the float32 reference: 1e-2 relative L2
        passed = err < 1e-2 and torch.isfinite(logits[name]).all().item()
        res["checks"][f"prefill {args.tokens} tokens vs fp32 CPU reference: {name} ({model.backend_name})"] = {
            "rel_l2": err, "ok": passed}
        ok &= passed
    kernel_names = [n for n in paths if n.startswith("kernels")]
    for n in kernel_names[1:]:
        same = torch.equal(logits[n], logits[kernel_names[0]])
        res["checks"][f"bit-identical logits: {n} == {kernel_names[0]}"] = {"ok": same}
        ok &= same

    timing = {}
    tokens = {}
    prompt = ids[:32].tolist()
    for name in ("torch (cuda, bf16)", "kernels, tables in HBM", "kernels, tables pinned host (UVA)"):
        model = paths[name]
        model.generate(prompt, max_new_tokens=4, eos=[])  # warm-up
        r = model.generate(prompt, max_new_tokens=args.new_tokens, eos=[])
        tokens[name] = r.new_ids
        timing[name] = {"decode_tokens_per_s": round(r.decode_tokens_per_s, 1), "prefill_s": round(r.prefill_s, 4)}
    agree = sum(a == b for a, b in zip(tokens["torch (cuda, bf16)"], tokens["kernels, tables in HBM"]))
    res["greedy_tokens_agreeing"] = f"{agree}/{args.new_tokens}"
    res["timing"] = timing

    env = dict(os.environ, PYTHONPATH=str(REPO / "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    demo = subprocess.run([sys.executable, "-m", "engram_trt", "demo", "--device", "cuda", "--max-new-tokens", "16"],
                          capture_output=True, text=True, env=env, timeout=600)
    res["demo_rc"] = demo.returncode
    res["demo_output"] = demo.stdout[-3000:] + demo.stderr[-2000:]
    ok &= demo.returncode == 0 and "engram cuda-kernels" in demo.stdout
    res["ok"] = bool(ok)
    (out / "h200_model_check.json").write_text(json.dumps(res, indent=1))
    print(res["demo_output"])
    for k, v in res["checks"].items():
        print(f"[{'PASS' if v['ok'] else 'FAIL'}] {k}" + (f": rel_l2={v['rel_l2']:.2e}" if "rel_l2" in v else ""))
    print(f"greedy tokens agreeing (torch vs kernels, bf16): {res['greedy_tokens_agreeing']}")
    for k, v in timing.items():
        print(f"{k:45s} decode {v['decode_tokens_per_s']:8.1f} tokens/s  prefill(32) {v['prefill_s'] * 1e3:7.1f} ms")
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
