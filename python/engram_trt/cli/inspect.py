"""``engram-trt inspect``: what a checkpoint holds and what is wrong with it."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from engram_trt.cli.output import EXIT_PROBLEMS, human_bytes, print_json
from engram_trt.errors import EngramError


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


def cmd_inspect(args: argparse.Namespace) -> int:
    report = inspect_checkpoint(args.checkpoint)
    if args.json:
        print_json(report)
    else:
        print(f"checkpoint   {report['checkpoint']}")
        print(f"backbone     {report['num_hidden_layers']} layers, hidden {report['hidden_size']}, hc_mult {report['hc_mult']}")
        if report["engram"]:
            cv = report["compressed_vocab"]
            print(f"compressed vocab  built {cv['built']}, declared {cv['declared']}")
            for e in report["layers"]:
                rows = e.get("table_rows", "missing")
                print(f"engram layer {e['layer_id']:>3}: table rows {rows} (layout needs {e['layout_rows']}), {human_bytes(e['bytes'])}")
            print(f"total Engram bytes  {report['total_engram_bytes']} ({human_bytes(report['total_engram_bytes'])})")
        if report["problems"]:
            print(f"problems ({len(report['problems'])}):")
            for p in report["problems"]:
                print(f"  - {p}")
        else:
            print("problems     none")
    return EXIT_PROBLEMS if report["problems"] else 0


