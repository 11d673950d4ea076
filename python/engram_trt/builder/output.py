"""The engine folder's rules: where a build may write, and which files in the folder
are the build's to replace (docs/reliability.md).

The folder is the build's when it is new, empty or holds an earlier build's manifest;
then the files that build wrote are replaced and every other file is carried over. A
folder without our manifest, or a file the build would write that no earlier build
wrote there (a user's ``model.onnx.data``), needs ``--force``; even then only
:data:`OUTPUT_NAMES` are replaced. The folder may be neither inside the checkpoint nor
hold it, and ``--repack-tables`` may be inside neither.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from engram_trt.storage import atomic
from engram_trt.builder.manifest import MANIFEST_NAME, is_engine_folder
from engram_trt.models.export import EXTERNAL_DATA_NAME
from engram_trt.checkpoint.checkpoint import Checkpoint, checkpoint_boundary
from engram_trt.errors import EngramError

log = logging.getLogger(__name__)

ONNX_NAME = "model.onnx"
ENGINE_NAME = "model.engine"
VOCAB_NAME = "compressed_vocab.npy"
REPORT_NAME = "build_report.json"
# Everything a build writes into its output folder: these names are replaced by a
# rebuild; any other file there is the user's and is carried over.
TOKENIZER_FILE = "tokenizer.json"  # a copy of the checkpoint's: the engine folder is all the runtime needs
OUTPUT_NAMES = (ONNX_NAME, EXTERNAL_DATA_NAME, ENGINE_NAME, VOCAB_NAME, TOKENIZER_FILE, MANIFEST_NAME, REPORT_NAME)


def output_paths(
    output_dir: str | Path, ckpt: Checkpoint, repack_tables_dir: str | Path | None
) -> tuple[Path, Path | None]:
    """The output folder and the re-pack folder as absolute paths, refused where a build
    would mix its files with the model's or replace the checkpoint itself."""
    atomic.check_parents(Path(os.path.abspath(Path(output_dir).expanduser())), "--output")
    out = atomic.writable_output(output_dir, "--output")  # a link written through (it stays); a mount point refused
    if out.exists() and not out.is_dir():
        raise EngramError(f"--output '{out}' exists and is not a folder; choose a folder path")
    home = checkpoint_boundary(ckpt.path)
    if atomic.is_within(out, home):
        raise EngramError(
            f"--output '{out}' is inside the checkpoint folder '{home}': "
            "the build's files would mix with the model's; choose a folder outside it"
        )
    if atomic.is_within(home, out):
        raise EngramError(
            f"the checkpoint '{home}' lies inside --output '{out}': "
            "rebuilding the output folder would move it; choose another --output"
        )
    repack: Path | None = None
    if repack_tables_dir is not None:
        atomic.check_parents(Path(os.path.abspath(Path(repack_tables_dir).expanduser())), "--repack-tables")
        repack = atomic.writable_output(repack_tables_dir, "--repack-tables")
        if repack.exists() and not repack.is_dir():
            raise EngramError(
                f"--repack-tables '{repack}' exists and is not a folder; pass a folder for the re-packed tables"
            )
        if atomic.is_within(repack, home):
            raise EngramError(
                f"--repack-tables '{repack}' is inside the checkpoint folder '{home}'; choose a folder outside it"
            )
        if atomic.is_within(repack, out):
            raise EngramError(
                f"--repack-tables '{repack}' is inside --output '{out}', "
                "which a rebuild replaces whole; choose a folder beside it"
            )
    return out, repack


def previous_outputs(out: Path) -> set[str] | None:
    """The files an earlier build wrote into ``out`` (from its manifest), or None when
    ``out`` holds no manifest of ours."""
    from engram_trt.builder.manifest import read_manifest

    if not is_engine_folder(out):
        return None
    try:
        m = read_manifest(out)
    except EngramError:
        return None
    names = {MANIFEST_NAME, REPORT_NAME}
    for key in ("graph", "engine", "compressed_vocab", "tokenizer"):
        entry = m.get(key)
        if isinstance(entry, dict) and isinstance(entry.get("file"), str):
            names.add(entry["file"])
    graph = m.get("graph")
    if isinstance(graph, dict) and isinstance(graph.get("external_data"), list):
        names.update(n for n in graph["external_data"] if isinstance(n, str))
    return names


def check_output_is_ours(out: Path, force: bool, warn: bool = True) -> set[str]:
    """The names in ``out`` that the new build may replace. The folder is ours when new,
    empty or holding an earlier build's manifest: then the files that build wrote are
    replaced. A file the new build would write that no earlier build wrote there (a
    user's model.onnx.data), or any file in a folder that is not ours, needs ``--force``.
    Every other file is carried over."""
    if not out.is_dir():
        return set()
    names = sorted(p.name for p in out.iterdir())
    if not names:
        return set()
    before = previous_outputs(out)
    fix = (
        f"choose a new or empty folder, or pass --force (then {', '.join(OUTPUT_NAMES)} there are replaced "
        f"and every other file is kept)"
    )
    if before is None:
        if not force:
            raise EngramError(
                f"--output '{out}' holds files engram-trt did not write (e.g. {names[0]}) "
                f"and no manifest of an earlier build; {fix}"
            )
    else:
        clash = [n for n in names if n in OUTPUT_NAMES and n not in before]
        if clash and not force:
            raise EngramError(
                f"--output '{out}': {clash[0]} there was not written by the earlier build, "
                f"and this build writes that name; move it away, or {fix}"
            )
    replaced = [n for n in names if n in OUTPUT_NAMES]
    if force and replaced and warn:
        log.warning("--force: replacing %s in %s", ", ".join(replaced), out)
    return set(replaced)
