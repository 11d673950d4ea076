"""``engram-trt import-gguf FILE.gguf OUT/``: a llama.cpp GGUF becomes a checkpoint folder
(:mod:`engram_trt.checkpoint.gguf_import` does the work; this module is its flags)."""

from __future__ import annotations

import argparse
import os
import re
import shlex

from engram_trt.cli.output import print_json
from engram_trt.errors import human_bytes

_SIZE_RE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?i?B?)$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "B": 1,
    "K": 10**3,
    "KB": 10**3,
    "KIB": 2**10,
    "M": 10**6,
    "MB": 10**6,
    "MIB": 2**20,
    "G": 10**9,
    "GB": 10**9,
    "GIB": 2**30,
    "T": 10**12,
    "TB": 10**12,
    "TIB": 2**40,
}
MIN_SHARD_BYTES = 1 << 20


def size_arg(text: str) -> int:
    """argparse ``type=``: a byte count, ``5GB`` / ``500MiB`` / ``2000000000`` (at least 1 MiB)."""
    m = _SIZE_RE.match(str(text).strip())
    unit = m.group(2).upper() if m else ""
    if not m or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{str(text)[:40]!r} is not a size (e.g. 5GB, 500MiB or a byte count)")
    n = int(float(m.group(1)) * _UNITS[unit])
    if n < MIN_SHARD_BYTES:
        raise argparse.ArgumentTypeError(f"{text!r} is below 1 MiB; shards that small only multiply files")
    return n


def add_import_gguf_arguments(p: argparse.ArgumentParser) -> None:
    from engram_trt.checkpoint.gguf_import import DEFAULT_MAX_SHARD_BYTES, OUT_DTYPES, SUPPORTED_TYPES

    p.add_argument(
        "gguf",
        metavar="FILE.gguf",
        help="a llama.cpp GGUF file of a Llama-family model (general.architecture "
        "llama; tensors " + ", ".join(SUPPORTED_TYPES) + ")",
    )
    p.add_argument(
        "out",
        metavar="OUT",
        help="the checkpoint folder to write: new or empty (a folder holding files needs "
        "--force). It is written beside as a temporary folder and put in place "
        "whole, so OUT never holds half an import",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="write into an OUT that holds files: the files an import writes (config.json, "
        "generation_config.json, tokenizer.json, tokenizer_config.json, model*.safetensors and the "
        "index) are replaced, every other file is kept",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=tuple(OUT_DTYPES),
        help="dtype of the written weights: float32 keeps the dequantized values exactly (default); bfloat16 "
        "or float16 round them to nearest even and halve the folder (default: %(default)s)",
    )
    p.add_argument(
        "--max-shard-size",
        dest="max_shard_bytes",
        type=size_arg,
        default=DEFAULT_MAX_SHARD_BYTES,
        metavar="SIZE",
        help="weights larger than SIZE are split into model-NNNNN-of-NNNNN.safetensors shards "
        "with an index, e.g. 2GB or 500MiB (default: "
        f"{human_bytes(DEFAULT_MAX_SHARD_BYTES)})",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr (also off with --json)")
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object: out, architecture, tensors by GGML type, dtype, files and bytes written",
    )


def cmd_import_gguf(args: argparse.Namespace) -> int:
    from engram_trt.checkpoint.gguf_import import import_gguf

    quiet = args.no_progress or args.json or os.environ.get("ENGRAM_TRT_NO_PROGRESS") is not None
    r = import_gguf(
        args.gguf,
        args.out,
        force=args.force,
        progress=not quiet,
        dtype=args.dtype,
        max_shard_bytes=args.max_shard_bytes,
    )
    info = {
        "out": str(r.out),
        "architecture": r.architecture,
        "tensors": r.n_tensors,
        "tensor_types": r.tensor_types,
        "dtype": r.dtype,
        "files": list(r.files),
        "bytes_written": r.bytes_written,
    }
    if args.json:
        print_json(info)
    else:
        types = ", ".join(f"{n} {k}" for k, n in r.tensor_types.items())
        print(
            f"imported {args.gguf} -> {r.out}: {r.architecture}, {r.n_tensors} tensors ({types}) as {r.dtype}, "
            f"{human_bytes(r.bytes_written)} in {len(r.files)} files"
        )
        q = shlex.quote(str(r.out))
        print(f"serve it: engram-trt run {q} --chat --prompt 'Hello'   (or: engram-trt build {q} --output ENGINE_DIR)")
    return 0
