"""``engram-trt layout`` and ``engram-trt hash``: the mechanism's numbers as JSON.

Neither imports torch or onnx: they answer in a fraction of a second.
"""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path
from typing import Any

from engram_trt.cli.argtypes import INT32_MAX
from engram_trt.cli.output import print_json
from engram_trt.errors import EngramError

_INT_RE = re.compile(r"^-?[0-9]+$")


MAX_IDS = 1 << 20  # one sequence; longer belongs in a file, not an argument


def _parse_ids(text: str) -> list[int]:
    """``--ids``: comma-separated ASCII integers, ``-1`` for a dead token, each an int32
    token id (the GPU's id type); one trailing comma is harmless."""
    example = "expected comma-separated integers, e.g. --ids 5,17,-1,3"
    parts = [p.strip() for p in text.split(",")]
    if len(parts) > 1 and parts[-1] == "":
        parts.pop()  # one trailing comma is harmless
    if parts == [""]:
        raise EngramError(f"--ids: no ids given ({example})")
    if len(parts) > MAX_IDS:
        raise EngramError(f"--ids: {len(parts)} ids, more than one sequence of at most {MAX_IDS} takes")
    ids: list[int] = []
    for part in parts:
        if part == "":
            raise EngramError(f"--ids: empty item in '{text[:80]}' ({example})")
        if not _INT_RE.match(part) or len(part) > 20:
            raise EngramError(f"--ids: '{part[:40]}' is not an integer ({example})")
        v = int(part)
        if v < -1:
            raise EngramError(f"--ids: {v} is not a token id (ids are >= 0; -1 marks a dead token)")
        if v > INT32_MAX:
            raise EngramError(f"--ids: {v} is larger than any token id (at most {INT32_MAX})")
        ids.append(v)
    return ids


# ---------------------------------------------------------------- layout / hash
def engram_spec_of(config_arg: str, command: str) -> Any:
    """The Engram spec of a config.json or checkpoint folder. A config naming its model
    (``architectures`` / ``model_type``) is read by that family's reader (the model
    registry); a bare set of ``engram_*`` fields (the golden vectors' form) by the Engram
    reader alone. A model without Engram layers is refused in one line."""
    from engram_trt.config.model import parse_engram_spec, read_config_dict
    from engram_trt.errors import ConfigError

    d, src = read_config_dict(config_arg)
    if "architectures" not in d and "model_type" not in d:
        spec = parse_engram_spec(d, src)
        if spec is None:
            raise ConfigError(f"{src}: no Engram fields (expected 'engram_layer_ids' with the other engram_* fields)")
        return spec
    from engram_trt.models.registry import resolve

    arch = resolve(d, src)
    spec = arch.read_config(d, src, enforce_contract=False).engram
    if spec is None:
        raise ConfigError(
            f"{src}: this {arch.title} model has no Engram layers (no 'engram_layer_ids'), so `engram-trt "
            f"{command}` has nothing to compute; `engram-trt inspect {shlex.quote(config_arg)}` "
            f"describes the model and its tables"
        )
    return spec


def cmd_layout(args: argparse.Namespace) -> int:
    from engram_trt.engram.layout import EngramLayout

    spec = engram_spec_of(args.config, "layout")
    pad = args.pad_id if args.pad_id is not None else _compressed_pad_or_zero(args.config, spec)
    layout = EngramLayout.from_spec(spec, pad)
    d = layout.to_json_dict()
    print_json(
        {k: d[k] for k in ("layer_ids", "primes", "offsets", "multipliers", "n_hash_cols", "table_rows")}
        | {"pad_id": d["pad_id"], "max_ngram_size": d["max_ngram_size"], "n_heads": d["n_heads"]}
    )
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
    import numpy as np

    from engram_trt.engram.hashing import hash_ids
    from engram_trt.engram.layout import EngramLayout

    spec = engram_spec_of(args.config, "hash")
    ids = _parse_ids(args.ids)
    if args.compressed:
        if args.pad_id is None:
            raise EngramError(
                "--compressed needs --pad-id N, the compressed id of the pad token "
                "(engram-trt hash without --compressed derives it from the tokenizer)"
            )
        compressed = np.asarray(ids, dtype=np.int64)
        pad = args.pad_id
    else:
        if args.pad_id is not None:
            raise EngramError("--pad-id only applies with --compressed (raw ids take the pad id from the tokenizer)")
        tok = _tokenizer_beside(args.config)
        if tok is None:
            raise EngramError(
                f"no tokenizer.json beside {args.config}: raw token ids need the checkpoint's tokenizer; "
                "pass a checkpoint folder, or --compressed --pad-id N for compressed ids"
            )
        vocab = _checked_vocab(tok, spec)
        raw = np.asarray(ids, dtype=np.int64)
        dead = raw == -1
        compressed = np.where(dead, -1, vocab.compress(np.where(dead, 0, raw)))
        pad = int(vocab.compress([spec.pad_token_id])[0])
    layout = EngramLayout.from_spec(spec, pad)
    print_json({"hash_ids": hash_ids(compressed, layout).tolist()})
    return 0
