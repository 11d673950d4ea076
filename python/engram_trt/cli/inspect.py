"""``engram-trt inspect``: what a checkpoint (or an engine folder) holds and what is
wrong with it.

Its contract: every problem found is *listed* (exit 1), not raised; only a folder that
cannot be read at all (no config.json, a damaged shard header) ends in the one-line
error. A checkpoint's report also says what its weights are and take (every
architecture alike, :func:`weights_report`): the bytes per stored dtype (``F8_E4M3``,
``I8`` packed FP4, ``F8_E8M0`` scales, ``BF16``, ``F32`` ...), the quantization its
config declares (``QuantSpec.describe()``), and the GPU bytes a load takes at ``--dtype``
(stored bytes for FP8 / FP4 weights, the serving dtype for float ones; each
architecture's ``weight_formats`` says which is which). For an engine folder the tables
are checked against what the build recorded: sizes always, random blocks against their
recorded hashes by default, every byte with ``--verify-tables``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from engram_trt.cli.output import EXIT_PROBLEMS, print_json
from engram_trt.errors import human_bytes
from engram_trt.errors import EngramError


def weights_report(ckpt: Any, arch: Any, dtype: str) -> dict[str, Any]:
    """Bytes per stored dtype, the declared quantization and what a load takes at
    ``dtype`` (module docstring); a problem with the quantization fields is listed under
    ``problems``."""
    from engram_trt.errors import ConfigError
    from engram_trt.quant.spec import read_quant_spec

    by_dtype: dict[str, int] = {}
    for name in ckpt.tensor_names():
        st = ckpt.st_dtype(name)
        by_dtype[st] = by_dtype.get(st, 0) + int(ckpt.nbytes(name))
    out: dict[str, Any] = {
        "stored_bytes": dict(sorted(by_dtype.items(), key=lambda kv: -kv[1])),
        "quantization": None,
        "load": None,
        "problems": [],
    }
    try:
        spec = read_quant_spec(ckpt.config_dict, str(ckpt.path / "config.json"))
    except ConfigError as exc:
        out["problems"].append(str(exc))
        spec = None
    if spec is not None:
        out["quantization"] = spec.describe()
        out["expert_dtype"] = spec.expert_dtype
    try:
        formats = arch.weight_formats(ckpt, dtype)
    except EngramError:  # a config the weights cannot be named for: its problems are listed by the checks
        return out
    kinds: dict[str, dict[str, int]] = {}
    for kind, stored, gpu in formats.values():
        k = kinds.setdefault(kind, {"tensors": 0, "stored_bytes": 0, "gpu_bytes": 0})
        k["tensors"] += 1
        k["stored_bytes"] += stored
        k["gpu_bytes"] += gpu
    out["load"] = {
        "dtype": dtype,
        "tensors": len(formats),
        "stored_bytes": sum(k["stored_bytes"] for k in kinds.values()),
        "gpu_bytes": sum(k["gpu_bytes"] for k in kinds.values()),
        "by_kind": kinds,
    }
    return out


def inspect_checkpoint(path: str, dtype: str = "bf16") -> dict[str, Any]:
    """The facts ``engram-trt inspect CHECKPOINT`` reports, as a dict (``dtype``: the
    serving dtype the GPU bytes of a load are counted in)."""
    from engram_trt.checkpoint.checkpoint import Checkpoint, engram_tensor_names
    from engram_trt.engram.layout import EngramLayout
    from engram_trt.engram.tokenizer import build_compressed_vocab
    from engram_trt.tables.source import checkpoint_table_refs, table_file_problems

    from engram_trt.models.registry import resolve

    seen: dict[str, Any] = {}

    def reader(d: dict[str, Any], source: str) -> Any:
        # The architecture's contract lists its problems here instead of refusing the
        # first: inspect reports every one.
        arch = seen["arch"] = resolve(d, source)
        seen["field_problems"] = arch.contract.problems(d, source)
        seen["ignored"] = arch.contract.ignored(d)
        return arch.read_config(d, source, enforce_contract=False)

    ckpt = Checkpoint.open(path, config_reader=reader)
    arch = seen["arch"]
    cfg = ckpt.config
    spec = cfg.engram
    try:
        unused = arch.unused_tensors(cfg, ckpt.tensor_names())
    except EngramError:  # the weight names need a field the config lacks: listed below
        unused = []
    report: dict[str, Any] = {
        "checkpoint": str(Path(path).resolve()),
        "architecture": arch.name,
        "ignored_fields": seen["ignored"],
        "unused_tensors": unused,
        "num_hidden_layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "hc_mult": arch.residual_streams(cfg),
        "engram": spec is not None,
        "layers": [],
        "problems": [],
    }
    problems: list[str] = report["problems"]
    problems.extend(seen["field_problems"])
    weights = weights_report(ckpt, arch, dtype)
    problems.extend(weights.pop("problems"))
    report["weights"] = weights
    if unused:
        problems.append(
            f"{len(unused)} tensor(s) the {arch.name} model does not read: {', '.join(unused[:8])}"
            f"{' ...' if len(unused) > 8 else ''} (run / build / serve refuse them without --allow-unused-weights)"
        )
    if spec is None:
        problems.extend(arch.checkpoint_problems(ckpt))
        report.update(arch.describe_tables(ckpt))  # an architecture's own tables (Qwen4Exp's PLE)
        return report
    pad = 0
    if ckpt.tokenizer_json is None:
        problems.append(
            "checkpoint has no tokenizer.json, which Engram needs to compress token ids "
            f"(copy the model's tokenizer.json into '{ckpt.path}')"
        )
        report["compressed_vocab"] = {"built": None, "declared": spec.compressed_vocab_size}
    else:
        try:
            vocab = build_compressed_vocab(ckpt.tokenizer_json)
        except EngramError as exc:
            problems.append(str(exc))
            report["compressed_vocab"] = {"built": None, "declared": spec.compressed_vocab_size}
        else:
            report["compressed_vocab"] = {"built": vocab.size, "declared": spec.compressed_vocab_size}
            if vocab.size != spec.compressed_vocab_size:
                problems.append(
                    f"tokenizer compresses to {vocab.size} ids but "
                    f"{spec.field_name('compressed_vocab_size')}={spec.compressed_vocab_size}"
                )
            if spec.pad_token_id < vocab.vocab_size:
                pad = int(vocab.compress([spec.pad_token_id])[0]) % spec.compressed_vocab_size
            else:
                problems.append(
                    f"{spec.field_name('pad_token_id')}={spec.pad_token_id} is not a token of the "
                    f"tokenizer (vocab {vocab.vocab_size})"
                )
    try:
        layout = EngramLayout.from_spec(spec, pad)
    except EngramError as exc:
        problems.append(str(exc))
        return report
    total = 0
    for li, lid in enumerate(spec.layer_ids):
        entry: dict[str, Any] = {"layer_id": lid, "layout_rows": int(layout.table_rows[li]), "tensors": {}}
        layer_bytes = 0
        names = engram_tensor_names(lid, spec.prefix)
        for role in ("table", "scale"):
            name = names[role]
            if name in ckpt:
                nbytes = int(ckpt.nbytes(name))
                entry["tensors"][role] = {
                    "name": name,
                    "shape": list(ckpt.shape(name)),
                    "dtype": ckpt.st_dtype(name),
                    "bytes": nbytes,
                }
                layer_bytes += nbytes
        if "table" in entry["tensors"]:
            entry["table_rows"] = entry["tensors"]["table"]["shape"][0]
        entry["bytes"] = layer_bytes
        total += layer_bytes
        report["layers"].append(entry)
    report["total_engram_bytes"] = total
    found = arch.checkpoint_problems(ckpt, layout)  # the weights, and the tables against the layout
    problems.extend(found)
    if not found:  # every table is present: check its files hold it (sizes, as every load does)
        problems.extend(table_file_problems(checkpoint_table_refs(ckpt)))
    return report


def inspect_engine_folder(path: str, verify_tables: bool = False, sample_bytes: int | None = None) -> dict[str, Any]:
    """The facts ``engram-trt inspect ENGINE_DIR`` reports: the build's shapes and
    files, and the tables checked against the manifest."""
    from engram_trt.builder.manifest import manifest_table_refs, read_manifest
    from engram_trt.tables.source import DEFAULT_SAMPLE_BYTES, sampled_check, table_file_problems, verify_table_hashes

    folder = Path(path)
    m = read_manifest(folder)
    refs = manifest_table_refs(m, folder)
    report: dict[str, Any] = {
        "engine_folder": str(folder.resolve()),
        "checkpoint": m.get("checkpoint"),
        "engine": (m.get("engine") or {}).get("file"),
        "dtype": m.get("dtype"),
        "shapes": m.get("shapes"),
        "tables": [
            {"tensor": r.tensor, "file": str(r.file), "bytes": r.nbytes, "blocks": len(r.block_hashes or ())}
            for r in refs
        ],
        "total_engram_bytes": sum(r.nbytes for r in refs),
        "table_check": "full" if verify_tables else "sampled",
        "problems": [],
    }
    problems: list[str] = report["problems"]
    for name in ([m["engine"]["file"]] if isinstance(m.get("engine"), dict) else []) + [
        m.get("graph", {}).get("file", "model.onnx")
    ]:
        if not (folder / str(name)).is_file():
            problems.append(f"{name} is missing from the engine folder (rebuild it)")
    problems.extend(table_file_problems(refs))
    if not problems:
        if verify_tables:
            problems.extend(verify_table_hashes(refs))
        else:
            budget = DEFAULT_SAMPLE_BYTES if sample_bytes is None else sample_bytes
            problems.extend(sampled_check(refs, budget))
            if any(r.block_hashes is None for r in refs):
                report["table_check"] = "sampled (some tables have no block hashes: use --verify-tables)"
    return report


_DTYPE_NOTE = {"F8_E4M3": "FP8", "F8_E8M0": "scales", "I8": "packed FP4", "U8": "bytes"}


def _print_weights(w: dict[str, Any]) -> None:
    def note(st: str) -> str:
        if st in ("I8", "U8") and w.get("expert_dtype") == "fp4":
            return " (FP4 experts)"
        return f" ({_DTYPE_NOTE[st]})" if st in _DTYPE_NOTE and st not in ("I8", "U8") else ""

    print("stored       " + ", ".join(f"{st} {human_bytes(n)}{note(st)}" for st, n in w["stored_bytes"].items()))
    print(f"quantization {w['quantization'] or 'none (float weights)'}")
    load = w.get("load")
    if load:
        how = {"fp8": " as stored", "fp4": " as stored", "float": f" in {load['dtype']}"}
        parts = ", ".join(
            f"{kind} {human_bytes(k['gpu_bytes'])}{how.get(kind, '')}" for kind, k in sorted(load["by_kind"].items())
        )
        print(
            f"GPU weights  {human_bytes(load['gpu_bytes'])} at --dtype {load['dtype']} ({parts}; "
            f"{human_bytes(load['stored_bytes'])} stored)"
        )


def _print_checkpoint(report: dict[str, Any]) -> None:
    from engram_trt.models.registry import registered

    arch = next(a for a in registered() if a.name == report["architecture"])
    print(f"checkpoint   {report['checkpoint']}")
    print(f"architecture {report['architecture']}")
    print(
        f"backbone     {report['num_hidden_layers']} layers, "
        f"hidden {report['hidden_size']}, hc_mult {report['hc_mult']}"
    )
    if report.get("weights"):
        _print_weights(report["weights"])
    if report["ignored_fields"]:
        print(
            "ignored      config fields the model does not read (nor does transformers'): "
            f"{', '.join(report['ignored_fields'])}"
        )
    own = arch.table_report_lines(report)  # an architecture's own tables (Qwen4Exp's PLE)
    if own:
        for line in own:
            print(line)
    elif not report["engram"]:
        print("engram       no Engram layers")
    else:
        cv = report.get("compressed_vocab", {})
        print(f"compressed vocab  built {cv.get('built')}, declared {cv.get('declared')}")
        for e in report["layers"]:
            rows = e.get("table_rows", "missing")
            print(
                f"engram layer {e['layer_id']:>3}: table rows {rows} "
                f"(layout needs {e['layout_rows']}), {human_bytes(e['bytes'])}"
            )
        if "total_engram_bytes" in report:
            print(f"total Engram bytes  {report['total_engram_bytes']} ({human_bytes(report['total_engram_bytes'])})")


def _print_engine(report: dict[str, Any]) -> None:
    print(f"engine folder  {report['engine_folder']}")
    print(f"checkpoint     {report['checkpoint']}")
    print(
        f"engine         {report['engine'] or 'none (graph only)'}, dtype {report['dtype']}, shapes {report['shapes']}"
    )
    for t in report["tables"]:
        print(f"table {t['tensor']}: {human_bytes(t['bytes'])} in {t['file']}")
    print(f"tables checked  {report['table_check']}")


def cmd_inspect(args: argparse.Namespace) -> int:
    from engram_trt.builder.manifest import MANIFEST_NAME

    from engram_trt.cli.folder_checks import add_folder_checks, print_folder_checks

    engine = (Path(args.checkpoint) / MANIFEST_NAME).is_file()
    report = (
        inspect_engine_folder(args.checkpoint, args.verify_tables)
        if engine
        else inspect_checkpoint(args.checkpoint, getattr(args, "dtype", None) or "bf16")
    )
    add_folder_checks(report, args.checkpoint, engine, args.verify_tables, args.token_ids_only)  # NaN / Inf, tokenizer
    if args.json:
        print_json(report)
    else:
        (_print_engine if engine else _print_checkpoint)(report)
        print_folder_checks(report)
        if report["problems"]:
            print(f"problems ({len(report['problems'])}):")
            for p in report["problems"]:
                print(f"  - {p}")
        else:
            print("problems     none")
    return EXIT_PROBLEMS if report["problems"] else 0
