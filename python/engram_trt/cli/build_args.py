"""``engram-trt build``'s arguments and defaults, importable without torch or onnx (the
CLI builds every subcommand's parser before it knows which one runs)."""

from __future__ import annotations

import argparse

from engram_trt.cli.argtypes import int_arg, target_list_arg
from engram_trt.cli.engram_args import add_engram_config_arguments, engram_config_from_args
from engram_trt.native.trt_compat import RTX_TARGETS
from engram_trt.config.dtypes import CANONICAL, dtype_arg, metavar, spellings
from engram_trt.builder.defaults import (
    BUILD_DTYPES,
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_NUM_TOKENS,
    DEFAULT_MAX_SEQ_LEN,
    PLUGIN_MODES,
)


def add_build_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``engram-trt build`` (registered on its subparser by the CLI)."""
    parser.add_argument(
        "checkpoint", metavar="CHECKPOINT", help="checkpoint folder (config.json, tokenizer.json, *.safetensors)"
    )
    parser.add_argument(
        "--output",
        "-o",
        required=True,
        metavar="ENGINE_DIR",
        help=(
            "engine folder to write (model.onnx, model.engine, manifest.json, compressed_vocab.npy, build_report.json)"
        ),
    )
    add_engram_config_arguments(parser)
    parser.add_argument(
        "--max-batch",
        type=int_arg(1, 1 << 16),
        default=DEFAULT_MAX_BATCH,
        metavar="N",
        help=f"most sequences the engine serves at once: its KV-cache slots (default {DEFAULT_MAX_BATCH})",
    )
    parser.add_argument(
        "--max-seq-len",
        type=int_arg(1, 1 << 24),
        default=None,
        metavar="N",
        help=f"longest sequence, cached plus new tokens (default: min(max_position_embeddings, {DEFAULT_MAX_SEQ_LEN}))",
    )
    parser.add_argument(
        "--max-num-tokens",
        type=int_arg(1, 1 << 24),
        default=None,
        metavar="N",
        help=f"most tokens of one step, all its sequences together (prefill chunks and decode tokens; "
        f"default: min({DEFAULT_MAX_NUM_TOKENS}, max-seq-len), at least max-batch)",
    )
    # every spelling parses (so fp32 is refused by build in its one line naming the fix); --help offers what builds
    parser.add_argument(
        "--dtype",
        type=dtype_arg,
        choices=CANONICAL,
        metavar=metavar(BUILD_DTYPES),
        default="bf16",
        help=f"weights and activations of the engine: bf16 (default) or fp16 (norms and softmax use float32); "
        f"spellings {spellings(BUILD_DTYPES)}",
    )
    parser.add_argument(
        "--target",
        default=None,
        metavar="sm80,sm86,...",
        type=target_list_arg,
        help="TensorRT-RTX compute capabilities to compile for ("
        + ", ".join(RTX_TARGETS)
        + "); default: the RTX portable set",
    )
    parser.add_argument(
        "--plugin-library",
        choices=PLUGIN_MODES,
        default="embed",
        help=(
            "embed the Engram plugin library in the engine (default) "
            "or only record it in the manifest (the runtime loads it)"
        ),
    )
    parser.add_argument(
        "--plugin-lib",
        default=None,
        metavar="PATH",
        help="path of libengram_trt_plugins.so (default: $ENGRAM_TRT_PLUGIN_LIB, the package, then build/)",
    )
    parser.add_argument(
        "--repack-tables",
        default=None,
        metavar="DIR",
        help="write the tables to DIR as FP8 safetensors (quantizing bf16 tables) and point the manifest there",
    )
    parser.add_argument(
        "--no-engine", action="store_true", help="stop after the exported graph even if TensorRT is installed"
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="build into an ENGINE_DIR that holds files engram-trt did not write (the build's own file names "
        "there are replaced, every other file is kept) and replace --repack-tables files no re-pack wrote",
    )
    parser.add_argument(
        "--allow-unused-weights",
        action="store_true",
        help="build from a checkpoint that holds tensors the model does not read (refused by default, naming them)",
    )
    parser.add_argument(
        "--token-ids-only",
        action="store_true",
        help="build from a checkpoint without tokenizer.json: the engine is sent token ids, never text "
        "(refused by default, since run and serve turn text into tokens with it; an Engram model "
        "needs it either way)",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def cmd_build(args: argparse.Namespace) -> int:
    """Run ``engram-trt build`` from parsed arguments; prints the result, returns 0."""
    import json
    import os

    from engram_trt.builder.build import build

    result = build(
        args.checkpoint,
        args.output,
        engram_config_from_args(args),
        max_batch=args.max_batch,
        max_seq_len=args.max_seq_len,
        max_num_tokens=args.max_num_tokens,
        dtype=args.dtype,
        targets=args.target,
        embed_plugin_library=args.plugin_library == "embed",
        plugin_library=args.plugin_lib,
        repack_tables_dir=args.repack_tables,
        force=args.force,
        build_engine_if_possible=not args.no_engine,
        allow_unused_weights=args.allow_unused_weights,
        token_ids_only=args.token_ids_only,
        progress=not args.json and os.environ.get("ENGRAM_TRT_NO_PROGRESS") is None,
    )
    if args.json:
        print(json.dumps(result.to_json(), indent=2, sort_keys=True))
    else:
        print(result.summary())
    return 0
