"""``engram-trt run``, ``demo`` and ``demo-checkpoint``: generate text end to end."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from engram_trt.cli.argtypes import INT32_MAX, SEED_MAX, check_generation_args, int_arg, resolve_device
from engram_trt.cli.output import print_json
from engram_trt.config.dtypes import CANONICAL, METAVAR, SPELLINGS, dtype_arg
from engram_trt.errors import EngramError


def _add_generation_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", default="Engram layers look up n-grams in", help="text to continue (default: %(default)r)")
    p.add_argument("--max-new-tokens", type=int_arg(1, INT32_MAX), default=32, metavar="N",
                   help="tokens to generate (default: %(default)s; prompt plus new tokens stay within max_position_embeddings)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature, finite, 0..1e4; 0 (or below 1e-5) = greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default: %(default)s)")
    p.add_argument("--seed", type=int_arg(0, SEED_MAX), default=0, metavar="N", help="sampling seed, 0..2^63-1 (default: %(default)s)")
    p.add_argument("--device", default="auto", help="'cpu', 'cuda', 'cuda:N' or 'auto' (CUDA when available) (default: %(default)s)")
    p.add_argument("--dtype", type=dtype_arg, choices=CANONICAL, metavar=METAVAR, default=None,
                   help=f"compute dtype of the reference model: fp32 or bf16 (default: fp32 on CPU, bf16 on CUDA); "
                        f"every subcommand takes the spellings {SPELLINGS}")
    p.add_argument("--table-storage", choices=("memory", "device", "pinned", "shared", "file"), default="memory",
                   help="where the Engram tables live: 'memory' (host RAM), 'device' (GPU memory), 'pinned' (host memory the "
                        "GPU reads through UVA), 'shared' (one /dev/shm copy for every process), 'file' (rows read from the "
                        "checkpoint files through the page cache) (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")


def _check_generation_args(args: argparse.Namespace) -> None:
    check_generation_args(args)


def _resolve_device(name: str) -> Any:
    return resolve_device(name)


def generate_text(checkpoint: str, args: argparse.Namespace) -> dict[str, Any]:
    """Load the reference model, generate, and return text, timing and the backend used."""
    import torch

    from engram_trt.checkpoint.checkpoint import Checkpoint
    from engram_trt.reference.model import EngramLlama
    from engram_trt.engram.tokenizer import load_tokenizer

    _check_generation_args(args)
    device = _resolve_device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(args.dtype or "", None)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    t0 = time.perf_counter()
    ckpt = Checkpoint.open(checkpoint)
    model = EngramLlama.from_checkpoint(ckpt, device=device, dtype=dtype, table_storage=args.table_storage)
    load_s = time.perf_counter() - t0
    tok = load_tokenizer(ckpt.tokenizer_json)
    prompt_ids = tok.encode(args.prompt, add_special_tokens=False).ids
    if not prompt_ids:
        raise EngramError("--prompt is empty after tokenization; give some text")
    result = model.generate(prompt_ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.seed)
    new_ids = list(result.new_ids)
    return {
        "backend": model.backend_name,
        "device": str(device),
        "dtype": str(dtype).replace("torch.", ""),
        "table_storage": args.table_storage,
        "prompt": args.prompt,
        "prompt_tokens": len(prompt_ids),
        "new_tokens": len(new_ids),
        "token_ids": new_ids,
        "text": tok.decode(new_ids, skip_special_tokens=False),
        "prefill_s": round(result.prefill_s, 4),
        "decode_s": round(result.decode_s, 4),
        "tokens_per_s": round(len(new_ids) / max(result.prefill_s + result.decode_s, 1e-9), 2),
        "decode_tokens_per_s": round(max(len(new_ids) - 1, 0) / max(result.decode_s, 1e-9), 2),
        "load_s": round(load_s, 3),
    }


def _print_generation(res: dict[str, Any]) -> None:
    print(f"backend: {res['backend']} ({res['device']}, {res['dtype']})")
    print(f"prompt:  {res['prompt']!r} ({res['prompt_tokens']} tokens)")
    print(f"output:  {res['text']!r}")
    print(f"{res['new_tokens']} tokens, {res['tokens_per_s']} tokens/s overall, {res['decode_tokens_per_s']} tokens/s decode "
          f"(prefill {res['prefill_s']} s, load {res['load_s']} s)")


def _check_against_config(checkpoint: str, args: argparse.Namespace) -> None:
    """What the options must fit in the model, from config.json alone (no weights read)."""
    from engram_trt.config.model import load_config

    check_generation_args(args)
    cfg = load_config(Path(checkpoint).expanduser()) if (Path(checkpoint).expanduser() / "config.json").is_file() else None
    if cfg is not None and args.max_new_tokens >= cfg.max_position_embeddings:
        raise EngramError(f"--max-new-tokens {args.max_new_tokens} does not fit the model's max_position_embeddings="
                          f"{cfg.max_position_embeddings} (with at least one prompt token); ask for fewer tokens")


def cmd_run(args: argparse.Namespace) -> int:
    _check_against_config(args.checkpoint, args)  # before the weights are loaded
    res = generate_text(args.checkpoint, args)
    print_json(res) if args.json else _print_generation(res)
    return 0


def cmd_demo_checkpoint(args: argparse.Namespace) -> int:
    from engram_trt.checkpoint.demo import write_demo_checkpoint

    out = write_demo_checkpoint(Path(args.out), seed=args.seed, force=args.force)
    print(f"wrote the demo checkpoint to {out} (random weights: generated text is meaningless)")
    return 0


def cmd_build(args: argparse.Namespace) -> int:
    from engram_trt.builder.build import build_from_args

    return build_from_args(args)


def cmd_demo(args: argparse.Namespace) -> int:
    from engram_trt.builder.build import build
    from engram_trt.checkpoint.demo import ensure_demo_checkpoint
    from engram_trt.paths import cache_root

    check_generation_args(args)  # before the checkpoint is made or the engine built
    resolve_device(args.device)
    say = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    say("engram-trt demo: a small engram-llama checkpoint with random weights (the text it generates is meaningless)")
    ckpt_dir = ensure_demo_checkpoint(seed=args.weights_seed)
    say(f"checkpoint: {ckpt_dir}")
    engine_dir = Path(args.engine_dir) if args.engine_dir else cache_root() / "demo-engine"
    built = build(ckpt_dir, engine_dir, progress=not args.json, force=args.force)
    say(built.summary())
    res = generate_text(str(ckpt_dir), args)
    res["engine"] = built.to_json()
    if built.engine_skipped:
        res["engine_note"] = built.engine_skipped
    else:
        # No TensorRT runtime here can execute the engine (TensorRT-RTX builds ahead of
        # time for other GPUs; full TensorRT is absent), so the same model runs on the
        # PyTorch path, which calls the same kernels on a GPU.
        res["engine_note"] = "engine built; it runs under TensorRT on a supported GPU. This run used the backend named below."
    if args.json:
        print_json(res)
    else:
        say(res["engine_note"])
        _print_generation(res)
    return 0


