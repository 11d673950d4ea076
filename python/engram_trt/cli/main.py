"""The ``engram-trt`` command line.

Each subcommand prints its result on stdout (JSON where a script would read it)
and diagnostics through ``logging`` on stderr. Bad input ends in one line,
``engram-trt: error: ...``, and exit status 2; never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from engram_trt import __version__
from engram_trt.errors import EngramError

log = logging.getLogger("engram_trt")

EXIT_USAGE = 2
EXIT_PROBLEMS = 1


def _print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=None, separators=(", ", ": "))
    sys.stdout.write("\n")


def _parse_ids(text: str) -> list[int]:
    example = "expected comma-separated integers, e.g. --ids 5,17,-1,3"
    parts = [p.strip() for p in text.split(",")]
    if len(parts) > 1 and parts[-1] == "":
        parts.pop()  # one trailing comma is harmless
    if parts == [""]:
        raise EngramError(f"--ids: no ids given ({example})")
    ids: list[int] = []
    for part in parts:
        if part == "":
            raise EngramError(f"--ids: empty item in '{text}' ({example})")
        try:
            ids.append(int(part))
        except ValueError:
            raise EngramError(f"--ids: '{part}' is not an integer ({example})") from None
    return ids


# ---------------------------------------------------------------- layout / hash
def cmd_layout(args: argparse.Namespace) -> int:
    from engram_trt.config.model import load_engram_spec
    from engram_trt.engram.layout import EngramLayout

    spec = load_engram_spec(args.config)
    pad = args.pad_id if args.pad_id is not None else _compressed_pad_or_zero(args.config, spec)
    layout = EngramLayout.from_spec(spec, pad)
    d = layout.to_json_dict()
    _print_json({k: d[k] for k in ("layer_ids", "primes", "offsets", "multipliers", "n_hash_cols", "table_rows")}
                | {"pad_id": d["pad_id"], "max_ngram_size": d["max_ngram_size"], "n_heads": d["n_heads"]})
    return 0


def _tokenizer_beside(config_arg: str) -> Path | None:
    p = Path(config_arg)
    folder = p if p.is_dir() else p.parent
    tok = folder / "tokenizer.json"
    return tok if tok.is_file() else None


def _compressed_pad_or_zero(config_arg: str, spec: Any) -> int:
    """The layout does not depend on the pad id; report it when a tokenizer is at hand."""
    tok = _tokenizer_beside(config_arg)
    if tok is None:
        return 0
    vocab = _checked_vocab(tok, spec)
    return int(vocab.compress([spec.pad_token_id])[0])


def _checked_vocab(tokenizer_json: Path, spec: Any) -> Any:
    from engram_trt.engram.tokenizer import build_compressed_vocab, check_compressed_size

    vocab = build_compressed_vocab(tokenizer_json)
    check_compressed_size(vocab, spec.compressed_vocab_size, spec.field_name("compressed_vocab_size"))
    return vocab


def cmd_hash(args: argparse.Namespace) -> int:
    from engram_trt.config.model import load_engram_spec
    from engram_trt.engram.hashing import hash_ids
    from engram_trt.engram.layout import EngramLayout

    spec = load_engram_spec(args.config)
    ids = _parse_ids(args.ids)
    if args.compressed:
        if args.pad_id is None:
            raise EngramError("--compressed needs --pad-id N, the compressed id of the pad token (engram-trt hash without --compressed derives it from the tokenizer)")
        compressed = np.asarray(ids, dtype=np.int64)
        pad = args.pad_id
    else:
        if args.pad_id is not None:
            raise EngramError("--pad-id only applies with --compressed (raw ids take the pad id from the tokenizer)")
        tok = _tokenizer_beside(args.config)
        if tok is None:
            raise EngramError(f"no tokenizer.json beside {args.config}: raw token ids need the checkpoint's tokenizer; pass a checkpoint folder, or --compressed --pad-id N for compressed ids")
        vocab = _checked_vocab(tok, spec)
        raw = np.asarray(ids, dtype=np.int64)
        dead = raw == -1
        compressed = np.where(dead, -1, vocab.compress(np.where(dead, 0, raw)))
        pad = int(vocab.compress([spec.pad_token_id])[0])
    layout = EngramLayout.from_spec(spec, pad)
    _print_json({"hash_ids": hash_ids(compressed, layout).tolist()})
    return 0


# ---------------------------------------------------------------- inspect
def inspect_checkpoint(path: str) -> dict[str, Any]:
    """The facts ``engram-trt inspect`` reports, as a dict (also used by tests and the builder)."""
    from engram_trt.checkpoint.checkpoint import Checkpoint, engram_tensor_names, validate_checkpoint
    from engram_trt.engram.layout import EngramLayout
    from engram_trt.engram.tokenizer import build_compressed_vocab

    ckpt = Checkpoint.open(path)
    cfg = ckpt.config
    spec = cfg.engram
    report: dict[str, Any] = {
        "checkpoint": str(Path(path).resolve()),
        "num_hidden_layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "hc_mult": cfg.hc_mult,
        "engram": spec is not None,
        "layers": [],
        "problems": [],
    }
    if spec is None:
        report["problems"].append("config has no Engram layers (no engram_layer_ids or ple_layer_ids)")
        report["problems"].extend(validate_checkpoint(ckpt, None))
        return report
    cfg.require_model()
    if ckpt.tokenizer_json is None:
        raise EngramError(f"checkpoint '{ckpt.path}' has no tokenizer.json, which Engram needs to compress token ids (copy the model's tokenizer.json into the folder)")
    vocab = build_compressed_vocab(ckpt.tokenizer_json)
    report["compressed_vocab"] = {"built": vocab.size, "declared": spec.compressed_vocab_size}
    if vocab.size != spec.compressed_vocab_size:
        report["problems"].append(
            f"tokenizer compresses to {vocab.size} ids but {spec.field_name('compressed_vocab_size')}={spec.compressed_vocab_size}")
    pad = int(vocab.compress([spec.pad_token_id])[0]) if spec.pad_token_id < vocab.vocab_size else 0
    layout = EngramLayout.from_spec(spec, pad % spec.compressed_vocab_size)
    total = 0
    for li, lid in enumerate(spec.layer_ids):
        entry: dict[str, Any] = {"layer_id": lid, "layout_rows": int(layout.table_rows[li]), "tensors": {}}
        layer_bytes = 0
        names = engram_tensor_names(lid, spec.prefix)
        for role in ("table", "scale"):
            name = names[role]
            if name in ckpt:
                nbytes = int(ckpt.nbytes(name))
                entry["tensors"][role] = {"name": name, "shape": list(ckpt.shape(name)),
                                          "dtype": ckpt.st_dtype(name), "bytes": nbytes}
                layer_bytes += nbytes
        if "table" in entry["tensors"]:
            entry["table_rows"] = entry["tensors"]["table"]["shape"][0]
        entry["bytes"] = layer_bytes
        total += layer_bytes
        report["layers"].append(entry)
    report["total_engram_bytes"] = total
    report["problems"].extend(validate_checkpoint(ckpt, layout))
    return report


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"


def cmd_inspect(args: argparse.Namespace) -> int:
    report = inspect_checkpoint(args.checkpoint)
    if args.json:
        _print_json(report)
    else:
        print(f"checkpoint   {report['checkpoint']}")
        print(f"backbone     {report['num_hidden_layers']} layers, hidden {report['hidden_size']}, hc_mult {report['hc_mult']}")
        if report["engram"]:
            cv = report["compressed_vocab"]
            print(f"compressed vocab  built {cv['built']}, declared {cv['declared']}")
            for e in report["layers"]:
                rows = e.get("table_rows", "missing")
                print(f"engram layer {e['layer_id']:>3}: table rows {rows} (layout needs {e['layout_rows']}), {_human_bytes(e['bytes'])}")
            print(f"total Engram bytes  {report['total_engram_bytes']} ({_human_bytes(report['total_engram_bytes'])})")
        if report["problems"]:
            print(f"problems ({len(report['problems'])}):")
            for p in report["problems"]:
                print(f"  - {p}")
        else:
            print("problems     none")
    return EXIT_PROBLEMS if report["problems"] else 0


# ---------------------------------------------------------------- run / demo
def _add_generation_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", default="Engram layers look up n-grams in", help="text to continue (default: %(default)r)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")
    p.add_argument("--device", default="auto", help="'cpu', 'cuda', 'cuda:N' or 'auto' (CUDA when available) (default: %(default)s)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="compute dtype of the reference model (default: float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--table-storage", choices=("memory", "pinned", "mmap"), default="memory",
                   help="where the Engram tables live: 'memory' (on the device), 'pinned' (host memory the GPU reads "
                        "through UVA), 'mmap' (rows read from the checkpoint files through the page cache) (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")


def _check_generation_args(args: argparse.Namespace) -> None:
    if args.max_new_tokens < 1:
        raise EngramError(f"--max-new-tokens must be >= 1 (got {args.max_new_tokens})")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise EngramError(f"--temperature must be a number >= 0 (got {args.temperature})")
    if not 0 < args.top_p <= 1:
        raise EngramError(f"--top-p must be in (0, 1] (got {args.top_p})")


def _resolve_device(name: str) -> Any:
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise EngramError(f"--device: '{name}' is not a device (expected cpu, cuda, cuda:N or auto)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise EngramError(f"--device {name}: no CUDA device is available here; use --device cpu")
    return dev


def generate_text(checkpoint: str, args: argparse.Namespace) -> dict[str, Any]:
    """Load the reference model, generate, and return text, timing and the backend used."""
    import torch

    from engram_trt.checkpoint.checkpoint import Checkpoint
    from engram_trt.reference.model import EngramLlama
    from engram_trt.engram.tokenizer import load_tokenizer

    _check_generation_args(args)
    device = _resolve_device(args.device)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(args.dtype or "", None)
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


def cmd_run(args: argparse.Namespace) -> int:
    res = generate_text(args.checkpoint, args)
    _print_json(res) if args.json else _print_generation(res)
    return 0


def cmd_demo_checkpoint(args: argparse.Namespace) -> int:
    from engram_trt.checkpoint.demo import make_demo_checkpoint

    out = make_demo_checkpoint(Path(args.out), seed=args.seed)
    print(f"wrote the demo checkpoint to {out} (random weights: generated text is meaningless)")
    return 0


def cmd_build(args: argparse.Namespace) -> int:
    from engram_trt.builder.build import build_from_args

    return build_from_args(args)


def cmd_demo(args: argparse.Namespace) -> int:
    from engram_trt.builder.build import build
    from engram_trt.checkpoint.demo import ensure_demo_checkpoint
    from engram_trt.paths import cache_root

    say = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    say("engram-trt demo: a small engram-llama checkpoint with random weights (the text it generates is meaningless)")
    ckpt_dir = ensure_demo_checkpoint(seed=args.weights_seed)
    say(f"checkpoint: {ckpt_dir}")
    engine_dir = Path(args.engine_dir) if args.engine_dir else cache_root() / "demo-engine"
    built = build(ckpt_dir, engine_dir, progress=not args.json)
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
        _print_json(res)
    else:
        say(res["engine_note"])
        _print_generation(res)
    return 0


# ---------------------------------------------------------------- parser
class _Parser(argparse.ArgumentParser):
    """argparse, with its usage errors in the CLI's one-line form."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"engram-trt: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="engram-trt",
        description="Serve LLMs with Engram layers through TensorRT, the Engram tables kept outside the engine.",
    )
    parser.add_argument("--version", action="version", version=f"engram-trt {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more diagnostics on stderr (-vv for debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    def add(name: str, fn: Callable[[argparse.Namespace], int], help_: str, desc: str | None = None) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=desc or help_)
        p.set_defaults(func=fn)
        return p

    p = add("layout", cmd_layout, "print the Engram layout (primes, offsets, multipliers, table rows) as JSON")
    p.add_argument("config", metavar="CONFIG", help="a config.json path or a checkpoint folder")
    p.add_argument("--pad-id", type=int, default=None, help="compressed pad id to report (default: from the tokenizer beside CONFIG, else 0; the layout does not depend on it)")

    p = add("hash", cmd_hash, "hash token ids to table row ids; prints JSON {\"hash_ids\": [position][layer][col]}")
    p.add_argument("config", metavar="CONFIG", help="a config.json path or a checkpoint folder (its tokenizer.json maps raw ids)")
    p.add_argument("--ids", required=True, help="comma-separated token ids of one sequence from position 0; -1 marks a dead token")
    p.add_argument("--compressed", action="store_true", help="the ids are already compressed ids (no tokenizer needed)")
    p.add_argument("--pad-id", type=int, default=None, help="with --compressed: the compressed id of the pad token")

    p = add("inspect", cmd_inspect, "summarize a checkpoint's Engram tables and list the problems found (exit 1 if any)")
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="checkpoint folder (config.json, tokenizer.json, *.safetensors)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")

    p = add("run", cmd_run, "generate text from a checkpoint and print it with tokens/s and the backend used")
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="checkpoint folder")
    _add_generation_args(p)

    p = add("demo-checkpoint", cmd_demo_checkpoint, "write the built-in engram-llama checkpoint (random weights; a tiny backbone and 2.4 GiB of FP8 tables)")
    p.add_argument("out", metavar="OUT", help="output folder")
    p.add_argument("--seed", type=int, default=0, help="weights seed (default: %(default)s)")

    p = add("build", cmd_build, "turn a checkpoint into a TensorRT engine folder, the Engram tables kept outside the engine",
            "Validate CHECKPOINT, save its compressed token map, export the whole model as ONNX (Engram layers as "
            "EngramHash/EngramGather/EngramGate plugin nodes), describe the tables in manifest.json, and build the "
            "engine with TensorRT or TensorRT-RTX when one is importable.")
    from engram_trt.builder.build import add_build_arguments

    add_build_arguments(p)

    p = add("demo", cmd_demo, "the main job: make (or reuse) the demo checkpoint, build its engine, generate from it",
            "Make (or reuse, under $ENGRAM_TRT_CACHE or ~/.cache/engram-trt) the demo checkpoint, build its engine "
            "(TensorRT or TensorRT-RTX when installed; else the exported graph only), and generate from it.")
    _add_generation_args(p)
    p.add_argument("--engine-dir", default=None, help="where to build the demo engine (default: demo-engine beside the demo checkpoint)")
    p.add_argument("--weights-seed", type=int, default=0, help="seed of the demo checkpoint's random weights (default: %(default)s)")
    p.set_defaults(max_new_tokens=16)
    from engram_trt.bench import add_bench_parser; add_bench_parser(sub)  # noqa: E702
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from engram_trt.config.engram import reject_unknown_args

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    logging.basicConfig(level=[logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)],
                        format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        reject_unknown_args(extra)
        return args.func(args)
    except EngramError as exc:
        print(f"engram-trt: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("engram-trt: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader (e.g. `| head`) closed the pipe: not an error of ours.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as exc:
        # A path the user gave that the system refuses (a file where a folder must go,
        # no permission, a full disk): name it, no traceback.
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"engram-trt: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
