"""What the runtime loads: an engine folder (the main case) or a checkpoint.

The engine folder is all the runtime needs. Its ``manifest.json`` names the tokenizer,
the compressed token map, each table (file, offset, bytes, sha256), the plugin library,
the build options and the source checkpoint (whose weights the ``torch`` backend runs).
:class:`ModelSource` reads either kind of folder into one description, so the rest of
the runtime never asks which it was given.

Checks made here, before anything heavy runs: every table file exists and holds its
byte range (always, a ``stat`` per file); a few random blocks of the tables re-hashed
against the manifest's block hashes (always, a fraction of a second); with
``verify_tables=True`` every table's sha256 too (streams every byte; a progress bar on
multi-GiB tables).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engram_trt.config.engram import EngramConfig
from engram_trt.config.model import ModelConfig
from engram_trt.engram.layout import EngramLayout
from engram_trt.errors import EngramError
from engram_trt.tables.source import TableRef, check_table_files, verify_table_hashes

log = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
DEFAULT_MAX_BATCH = 8
DEFAULT_MAX_NUM_TOKENS = 2048


@dataclass
class ModelSource:
    """One model as the runtime sees it, from an engine folder or a checkpoint."""

    path: Path
    kind: str  # 'engine' | 'checkpoint'
    config: ModelConfig
    checkpoint: Path  # the weights' folder (the torch backend's source)
    tokenizer_json: Path | None
    compress_lookup: np.ndarray | None  # raw id -> compressed id (int64, -1 = none)
    layout: EngramLayout | None
    table_refs: list[TableRef]
    engram_config: EngramConfig
    max_batch: int
    max_seq_len: int
    max_num_tokens: int
    engine_file: Path | None = None
    placement: str = "in_engine"
    plugin_library: Path | None = None
    plugin_embedded: bool = False
    trt: dict[str, Any] | None = None
    manifest: dict[str, Any] = field(default_factory=dict)
    architecture: Any = None  # the model registry's entry (models.registry): module, weights, state

    @property
    def has_engram(self) -> bool:
        return self.config.engram is not None

    def describe(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "kind": self.kind,
            "checkpoint": str(self.checkpoint),
            "engine": None if self.engine_file is None else str(self.engine_file),
            "tensorrt": self.trt,
            "placement": self.placement,
            "max_batch": self.max_batch,
            "max_seq_len": self.max_seq_len,
            "max_num_tokens": self.max_num_tokens,
        }


def is_engine_folder(path: Path) -> bool:
    return (path / MANIFEST_NAME).is_file()


@dataclass(frozen=True)
class ModelPeek:
    """What a folder's config says, read through the model registry without weights or
    tables: its ``architecture`` (the registry's entry), typed ``config``, ``kind``
    ('engine' | 'checkpoint') and the manifest of an engine folder."""

    path: Path
    kind: str
    architecture: Any
    config: Any
    manifest: dict[str, Any] = field(default_factory=dict)

    @property
    def family(self) -> str:
        """The model family in messages (``DeepSeek-V4``, ``Qwen4Exp``, ``engram-llama``)."""
        return self.architecture.title

    @property
    def has_tables(self) -> bool:
        """The model reads tables beside its weights (Engram tables, Qwen4Exp's PLE shards)."""
        return self.config.engram is not None or self.architecture.has_own_tables(self.config)


def peek_model(path: str | Path) -> ModelPeek:
    """The architecture and config of an engine folder (its manifest's ``model``) or a
    checkpoint folder (its config.json), through the registry's reader of that family;
    nothing else is read. Refused in one line like :func:`open_model_source`."""
    from engram_trt.config.model import read_config_dict
    from engram_trt.models.registry import read_model_config

    p = Path(path).expanduser()
    if not p.exists():
        raise EngramError(
            f"'{p}' does not exist: pass an engine folder (from `engram-trt build`) or a checkpoint folder "
            f"(make one with `engram-trt demo-checkpoint OUT`)"
        )
    if not p.is_dir():
        raise EngramError(
            f"'{p}' is not a folder: pass an engine folder (from `engram-trt build`) or a checkpoint folder"
        )
    if is_engine_folder(p):
        m = _read_manifest(p)
        if not isinstance(m.get("model"), dict):
            raise EngramError(f"{p / MANIFEST_NAME} lacks or garbles 'model'; rebuild the engine folder")
        arch, config = read_model_config(m["model"], source=str(p / MANIFEST_NAME))
        return ModelPeek(p, "engine", arch, config, m)
    if not (p / "config.json").is_file():
        raise EngramError(
            f"'{p}' is neither an engine folder nor a checkpoint folder (no manifest.json or config.json)"
        )
    arch, config = read_model_config(*read_config_dict(p))
    return ModelPeek(p, "checkpoint", arch, config)


def checkpoint_of(path: str | Path) -> Path:
    """The checkpoint folder behind ``path``: itself, or the one an engine folder's
    manifest names (where the torch backend reads the weights)."""
    p = Path(path).expanduser()
    if not is_engine_folder(p):
        return p
    m = _read_manifest(p)
    if not isinstance(m.get("checkpoint"), str):
        raise EngramError(f"{p / MANIFEST_NAME} lacks or garbles 'checkpoint'; rebuild the engine folder")
    return Path(m["checkpoint"])


def open_model_source(
    path: str | Path,
    *,
    engram_config: EngramConfig | None = None,
    verify_tables: bool = False,
    progress: bool = True,
    allow_unused_weights: bool = False,
) -> ModelSource:
    """Read an engine folder or a checkpoint folder (see the module docstring). The
    model's architecture comes from the registry, which honours or refuses every field
    of its config; a checkpoint's tensors the model does not read are refused unless
    ``allow_unused_weights``."""
    p = Path(path).expanduser()
    if not p.exists():
        raise EngramError(
            f"'{p}' does not exist: pass an engine folder (from `engram-trt build`) or a checkpoint folder "
            f"(make one with `engram-trt demo-checkpoint OUT`)"
        )
    if not p.is_dir():
        raise EngramError(
            f"'{p}' is not a folder: pass an engine folder (from `engram-trt build`) or a checkpoint folder"
        )
    src = (
        _from_engine_folder(p, engram_config)
        if is_engine_folder(p)
        else _from_checkpoint(p, engram_config, allow_unused_weights)
    )
    if src.table_refs:
        check_table_files(src.table_refs)
        if not verify_tables:
            # The cheap default: re-hash a few random recorded blocks (a fraction of a
            # second); every load draws afresh, so damage is found ever more surely.
            from engram_trt.tables.source import sampled_check

            problems = sampled_check(src.table_refs)
            if problems:
                raise EngramError(
                    "Engram tables damaged: " + "; ".join(problems) + " (restore the table files, or rebuild "
                    "the engine folder; engram-trt inspect ENGINE_DIR --verify-tables checks every byte)"
                )
        if verify_tables:
            problems = verify_table_hashes(src.table_refs, progress=progress)
            if problems:
                raise EngramError(
                    "--verify-tables: "
                    + "; ".join(problems)
                    + " (restore the table files, or rebuild the engine folder)"
                )
            log.info("verified the sha256 of %d table tensors", len(src.table_refs))
    return src


def _read_manifest(folder: Path) -> dict[str, Any]:
    p = folder / MANIFEST_NAME
    try:
        data = json.loads(p.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise EngramError(f"{p} is not UTF-8 text; rebuild the engine folder") from None
    except json.JSONDecodeError as exc:
        raise EngramError(
            f"{p} is not valid JSON ({exc.msg} at line {exc.lineno}); rebuild the engine folder"
        ) from None
    if not isinstance(data, dict):
        raise EngramError(f"{p} does not hold a JSON object; rebuild the engine folder")
    from engram_trt.builder.manifest import MANIFEST_VERSION

    if data.get("manifest_version") != MANIFEST_VERSION:
        raise EngramError(
            f"{p}: manifest version {data.get('manifest_version')} is not {MANIFEST_VERSION}; "
            "rebuild the engine folder with this engram-trt"
        )
    return data


def _in_folder(folder: Path, name: Any, what: str) -> Path:
    """A file the manifest names, which must lie inside the engine folder."""
    if not isinstance(name, str) or not name or Path(name).is_absolute() or ".." in Path(name).parts:
        raise EngramError(
            f"{folder / MANIFEST_NAME}: {what} {name!r} is not a file name inside the engine folder; rebuild it"
        )
    return folder / name


def _from_engine_folder(folder: Path, override: EngramConfig | None) -> ModelSource:
    from engram_trt.models.registry import read_model_config

    m = _read_manifest(folder)
    try:
        architecture, config = read_model_config(m["model"], source=str(folder / MANIFEST_NAME))
        shapes = m["shapes"]
        max_batch, max_seq_len, max_num_tokens = (
            int(shapes["max_batch"]),
            int(shapes["max_seq_len"]),
            int(shapes["max_num_tokens"]),
        )
        checkpoint = Path(m["checkpoint"])
    except (KeyError, TypeError, ValueError) as exc:
        raise EngramError(f"{folder / MANIFEST_NAME} lacks or garbles {exc}; rebuild the engine folder") from None
    lookup = layout = None
    tokenizer = None
    tok_entry = m.get("tokenizer")
    if tok_entry:
        tokenizer = _in_folder(folder, tok_entry.get("file"), "tokenizer")
    elif (checkpoint / "tokenizer.json").is_file():
        tokenizer = checkpoint / "tokenizer.json"
    if tokenizer is not None and not tokenizer.is_file():
        raise EngramError(f"the engine folder's tokenizer {tokenizer} is missing; rebuild the engine folder")
    if config.engram is not None:
        cv = m.get("compressed_vocab") or {}
        vocab_file = _in_folder(folder, cv.get("file"), "compressed vocab")
        if not vocab_file.is_file():
            raise EngramError(f"{vocab_file} is missing; rebuild the engine folder")
        from engram_trt.engram.tokenizer import CompressedVocab, check_compressed_size

        vocab = CompressedVocab.load(vocab_file)
        spec = config.engram
        check_compressed_size(vocab, spec.compressed_vocab_size, spec.field_name("compressed_vocab_size"))
        lookup = np.asarray(vocab.lookup, dtype=np.int64)
        layout = EngramLayout.from_spec(spec, pad_id=int(lookup[spec.pad_token_id]))
        if m.get("layout") and m["layout"] != layout.to_json_dict():
            raise EngramError(
                f"{folder / MANIFEST_NAME}: the recorded layout differs from the one the config "
                "gives; rebuild the engine folder"
            )
    refs = [TableRef.from_json(t, folder) for t in m.get("tables") or []]
    built = EngramConfig.from_dict(m.get("engram_config") or {}, source=f"{folder / MANIFEST_NAME} engram_config")
    if override is not None:
        ecfg = override
    elif config.engram is None:
        ecfg = EngramConfig()  # nothing to place: the build's defaults are not the user's choice
    else:
        ecfg = EngramConfig.from_dict({k: v for k, v in built.to_dict().items() if k != "table_placement"})
    engine = m.get("engine")
    engine_file = None if not engine else _in_folder(folder, engine.get("file"), "engine")
    plugins = m.get("plugins") or {}
    lib = (plugins.get("library") or {}).get("path")
    placement = built.placement
    return ModelSource(
        folder,
        "engine",
        config,
        checkpoint,
        tokenizer,
        lookup,
        layout,
        refs,
        ecfg,
        max_batch,
        max_seq_len,
        max_num_tokens,
        engine_file,
        placement,
        None if lib is None else Path(lib),
        bool(plugins.get("embedded")),
        m.get("tensorrt"),
        m,
        architecture,
    )


def _from_checkpoint(folder: Path, override: EngramConfig | None, allow_unused_weights: bool) -> ModelSource:
    from engram_trt.checkpoint.vocab import engram_lookup_and_layout
    from engram_trt.tables.source import checkpoint_table_refs

    from engram_trt.models.registry import open_checkpoint

    ckpt = open_checkpoint(folder, allow_unused=allow_unused_weights)
    config = ckpt.config
    lookup, layout = engram_lookup_and_layout(ckpt)
    refs: list[TableRef] = checkpoint_table_refs(ckpt) if layout is not None else []
    # every tensor the model reads (and the Engram tables against the layout); refused in one line
    ckpt.architecture.validate(ckpt, layout)
    if layout is None:
        # An architecture with tables of its own (Qwen4Exp's PLE shards) lists them: the
        # runner opens them in the store --engram-config picks, as Engram tables.
        refs = list(ckpt.architecture.table_refs(ckpt))
    ecfg = override if override is not None else EngramConfig()
    ecfg.validate_for(config)
    max_seq_len = min(config.max_position_embeddings, 4096)
    return ModelSource(
        folder,
        "checkpoint",
        config,
        folder,
        ckpt.tokenizer_json,
        lookup,
        layout,
        refs,
        ecfg,
        DEFAULT_MAX_BATCH,
        max_seq_len,
        min(DEFAULT_MAX_NUM_TOKENS, max_seq_len),
        placement="prefetch",
        architecture=ckpt.architecture,
    )
