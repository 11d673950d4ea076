"""``inspect``'s checks of what a folder's bytes hold, beside its structure: NaN / Inf in
any tensor (:mod:`engram_trt.checkpoint.nonfinite`) and the tokenizer the runtime will
need. Kept apart from :mod:`.inspect` (its report of the structure): one call adds them
to the report, one prints them.

* a checkpoint: every tensor (weights and tables) scanned, sampled by default (the cost
  printed), every byte with ``--verify-tables``; tokenizer.json present and readable
  (a missing one is a problem unless ``--token-ids-only``);
* an engine folder: its tables (the files a runtime reads beside the engine; the
  weights inside the engine were scanned by the build that refused NaN) and its
  tokenizer, unless it was built with ``--token-ids-only``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def add_folder_checks(
    report: dict[str, Any], path: str, engine: bool, full: bool, token_ids_only: bool = False
) -> None:
    """Scan the folder's tensors for NaN / Inf and check its tokenizer; the results go
    into ``report["nonfinite"]`` and ``report["problems"]``."""
    from engram_trt.checkpoint.nonfinite import DEFAULT_SCAN_BYTES, Region, scan_regions

    budget = None if full else DEFAULT_SCAN_BYTES
    problems: list[str] = report["problems"]
    if engine:
        from engram_trt.builder.manifest import manifest_table_refs, read_manifest

        folder = Path(path)
        m = read_manifest(folder)
        parts = [p for r in manifest_table_refs(m, folder) for p in r.parts]
        regions = [
            Region(p.tensor, Path(p.file), p.offset, p.nbytes, p.dtype)
            for p in parts
            if _holds(Path(p.file), p.offset + p.nbytes)
        ]
        scan = scan_regions(regions, budget)
        tok = (m.get("tokenizer") or {}).get("file")
        if not m.get("token_ids_only") and tok and not (folder / str(tok)).is_file():
            problems.append(
                f"the engine folder's {tok} is missing: run and serve turn text into tokens with it "
                f"(rebuild the engine folder)"
            )
    else:
        from engram_trt.checkpoint.checkpoint import Checkpoint
        from engram_trt.checkpoint.nonfinite import scan_checkpoint

        with Checkpoint.open(path, config_reader=lambda d, source: None) as ckpt:
            scan = scan_checkpoint(ckpt, budget)
            tok_problem = tokenizer_problem(ckpt, token_ids_only)
        if tok_problem and not report.get("engram"):  # an Engram model's report lists its tokenizer already
            problems.append(tok_problem)
    report["nonfinite"] = scan.to_json() | {"cost": scan.cost()}
    problems.extend(scan.problems())


def _holds(file: Path, end: int) -> bool:
    """The file is there and reaches ``end`` (a short or missing one is listed by the table checks)."""
    try:
        return file.stat().st_size >= end
    except OSError:
        return False


def tokenizer_problem(ckpt: Any, token_ids_only: bool) -> str | None:
    """Why the checkpoint's tokenizer cannot serve text, or None."""
    from engram_trt.engram.tokenizer import load_tokenizer
    from engram_trt.errors import EngramError

    if ckpt.tokenizer_json is None:
        if token_ids_only:
            return None
        return (
            f"checkpoint has no tokenizer.json, which run and serve need to turn text into tokens: copy the "
            f"model's tokenizer.json into '{ckpt.path}' (or build with --token-ids-only for an engine sent "
            f"token ids)"
        )
    try:
        load_tokenizer(ckpt.tokenizer_json)
    except EngramError as exc:
        return f"{exc} (copy the model's tokenizer.json again)"
    return None


def print_folder_checks(report: dict[str, Any]) -> None:
    scan = report.get("nonfinite")
    if scan is not None:
        found = len(scan["findings"])
        print(
            f"NaN / Inf    {'none' if not found else f'in {found} tensor(s)'} ({scan['cost']}"
            f"{'' if scan['full'] else '; --verify-tables reads every byte'})"
        )
