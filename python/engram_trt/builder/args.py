"""``engram-trt build``'s arguments and defaults, importable without torch or onnx (the
CLI builds every subcommand's parser before it knows which one runs)."""

from __future__ import annotations

import argparse

from engram_trt.config.engram import add_engram_config_arguments

PLUGIN_MODES = ("embed", "reference")
BUILD_DTYPES = ("bf16", "fp16")
DEFAULT_MAX_BATCH = 4
DEFAULT_MAX_SEQ_LEN = 4096
DEFAULT_MAX_NUM_TOKENS = 2048


def add_build_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``engram-trt build`` (registered on its subparser by the CLI)."""
    parser.add_argument("checkpoint", metavar="CHECKPOINT", help="checkpoint folder (config.json, tokenizer.json, *.safetensors)")
    parser.add_argument("--output", "-o", required=True, metavar="ENGINE_DIR",
                        help="engine folder to write (model.onnx, model.engine, manifest.json, compressed_vocab.npy, build_report.json)")
    add_engram_config_arguments(parser)
    parser.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH, metavar="N", help=f"most sequences the engine serves at once: its KV-cache slots (default {DEFAULT_MAX_BATCH})")
    parser.add_argument("--max-seq-len", type=int, default=None, metavar="N",
                        help=f"longest sequence, cached plus new tokens (default: min(max_position_embeddings, {DEFAULT_MAX_SEQ_LEN}))")
    parser.add_argument("--max-num-tokens", type=int, default=None, metavar="N",
                        help=f"most tokens of one step, all its sequences together (prefill chunks and decode tokens; "
                             f"default: min({DEFAULT_MAX_NUM_TOKENS}, max-seq-len), at least max-batch)")
    parser.add_argument("--dtype", choices=BUILD_DTYPES, default="bf16", help="weights and activations (norms and softmax use float32; default bf16)")
    parser.add_argument("--target", default=None, metavar="sm80,sm86,...",
                        help="TensorRT-RTX compute capabilities to compile for (" + ", ".join(tc_targets()) + "); default: the RTX portable set")
    parser.add_argument("--plugin-library", choices=PLUGIN_MODES, default="embed",
                        help="embed the Engram plugin library in the engine (default) or only record it in the manifest (the runtime loads it)")
    parser.add_argument("--plugin-lib", default=None, metavar="PATH",
                        help="path of libengram_trt_plugins.so (default: $ENGRAM_TRT_PLUGIN_LIB, the package, then build/)")
    parser.add_argument("--repack-tables", default=None, metavar="DIR",
                        help="write the tables to DIR as FP8 safetensors (quantizing bf16 tables) and point the manifest there")
    parser.add_argument("--no-engine", action="store_true", help="stop after the exported graph even if TensorRT is installed")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def tc_targets() -> tuple[str, ...]:
    from engram_trt.trt_compat import RTX_TARGETS

    return RTX_TARGETS


