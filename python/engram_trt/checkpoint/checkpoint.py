"""HF-style checkpoint folders: read lazily, write deterministically. What a model needs
of a checkpoint is its architecture's check (``models/<arch>/``: engram-llama's is
``models/engram_llama/checks.py``); the FP8 weight checks they share are here.

A folder holds ``config.json``, ``tokenizer.json`` and the weights as safetensors:
either sharded ``model-0000i-of-0000n.safetensors`` with a
``model.safetensors.index.json`` ``weight_map``, or one ``model.safetensors``.

Engram tables are large (hundreds of GB for a production model), so nothing here
loads a tensor to learn about it: shapes and dtypes come from the safetensors
headers, :meth:`Checkpoint.get_rows` reads only the requested rows through a
read-only file-backed memory map, and :meth:`Checkpoint.locate` hands out the
absolute byte range of a tensor so a runtime can map or register the file itself.

FP8 tables are stored as ``F8_E4M3`` (``torch.float8_e4m3fn``) and their ue8m0 scales
as ``F8_E8M0`` (``torch.float8_e8m0fnu``); safetensors >= 0.6 reads and writes both.
Consumers that feed kernels view both as ``uint8`` (one byte per value).

Fine-grained FP8 checkpoints (``quantization_config`` with ``quant_method: "fp8"``) store
linear weights as ``F8_E4M3`` with their block scales beside them
(``<module>.weight_scale_inv`` or ``<module>.scale``): :func:`fp8_weight_problem` holds one
such weight to its config, and :meth:`Checkpoint.lazy` hands a model loader the tensors
one at a time (read when taken, never all held at once).

Every file is confined to the folder: an index entry that is absolute or climbs out
(``../``) is refused, and so is a file that is a link leading out of the folder (a
Hugging Face hub snapshot, whose files link to ``../../blobs``, is confined to its
repository folder instead). Shard headers are held to the rules of the safetensors
library itself (:func:`read_safetensors_header`), so a header that passes here never
fails later inside the library.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import numpy as np
import torch

# Re-exported: callers import the file-level pieces from here too.
from engram_trt.checkpoint.files import (  # noqa: F401
    BF16_TABLE_DTYPES,
    FP8_SCALE_DTYPES,
    FP8_TABLE_DTYPES,
    MAX_HEADER_BYTES,
    ST_DTYPES,
    TensorInfo,
    _tensor_infos,
    checkpoint_boundary,
    confined_file,
    read_safetensors_header,
)
from engram_trt.config.jsonfile import read_json_object
from engram_trt.config.model import ArchitectureConfig, ModelConfig, read_config_dict
from engram_trt.errors import CheckpointError, ConfigError, EngramError

log = logging.getLogger(__name__)

CONFIG_NAME = "config.json"
TOKENIZER_NAME = "tokenizer.json"
TOKENIZER_CONFIG_NAME = "tokenizer_config.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
SHARD_RE = re.compile(r"^model-(\d{5})-of-(\d{5})\.safetensors$")
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3


def shard_name(i: int, n: int) -> str:
    """The HF shard file name (1-based ``i``)."""
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def natural_key(name: str) -> tuple[Any, ...]:
    """Sort key that orders ``layers.10`` after ``layers.9``: shards then group a
    layer's tensors together, in the order a model walks them."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def engram_tensor_names(layer_id: int, prefix: str = "engram") -> dict[str, str]:
    """Checkpoint names of one Engram layer's tensors (docs/engram-spec.md)."""
    base = f"model.layers.{layer_id}.{prefix}"
    return {
        "table": f"{base}.embed.weight",
        "scale": f"{base}.embed.weight_scale_inv",
        "wkv": f"{base}.wkv.weight",
        "q_weight": f"{base}.q_weight",
        "k_weight": f"{base}.k_weight",
    }


class Checkpoint:
    """A read-only view of a checkpoint folder.

    Opening reads ``config.json``, the index and each shard's header, nothing else.
    Tensors are read on demand: :meth:`get` through ``safetensors.safe_open``,
    :meth:`get_rows` through a read-only ``mmap`` of the shard file.
    """

    def __init__(
        self,
        path: Path,
        config: ArchitectureConfig,
        config_dict: dict[str, Any],
        infos: dict[str, TensorInfo],
        tokenizer_json: Path | None,
    ) -> None:
        self.path = path
        self.config = config
        self.architecture: Any = None  # the registry's entry, set by models.registry.open_checkpoint
        self.config_dict = config_dict
        self.tokenizer_json = tokenizer_json
        self._infos = infos
        self._handles: dict[Path, Any] = {}
        self._maps: dict[Path, tuple[Any, mmap.mmap, np.ndarray]] = {}

    # -- opening -----------------------------------------------------------------
    @classmethod
    def open(
        cls, path: str | Path, config_reader: Callable[[dict[str, Any], str], ArchitectureConfig] | None = None
    ) -> "Checkpoint":
        """Open a checkpoint folder; refuse an incomplete one with the file and the fix.

        ``config_reader`` turns config.json into the typed config; the model registry
        (:func:`engram_trt.models.registry.open_checkpoint`) passes its architecture's
        reader, which honours or refuses every field. Without one the fields are read as
        engram-llama's, unchecked against an architecture: for tools below the registry."""
        root = Path(path).expanduser()
        if root.exists() and not root.is_dir():
            raise CheckpointError(
                f"'{root}' is a file, not a checkpoint folder (pass the folder holding config.json and *.safetensors)"
            )
        if not root.is_dir():
            raise CheckpointError(
                f"checkpoint folder '{root}' does not exist (pass a folder holding config.json and *.safetensors, or make one with `engram-trt demo-checkpoint OUT`)"
            )
        cfg_file = root / CONFIG_NAME
        if not cfg_file.is_file():
            raise CheckpointError(
                f"checkpoint '{root}' has no {CONFIG_NAME} (copy the model's config.json into the folder)"
            )
        confined_file(root, CONFIG_NAME, CONFIG_NAME)
        config_dict, src = read_config_dict(cfg_file)
        config = (config_reader or ModelConfig.from_dict)(config_dict, src)
        files = cls._weight_files(root)
        infos: dict[str, TensorInfo] = {}
        for shard, expected in files.items():
            found = _tensor_infos(shard)
            if expected is not None:
                missing = sorted(set(expected) - set(found), key=natural_key)
                if missing:
                    raise CheckpointError(
                        f"shard '{shard}' lacks tensor '{missing[0]}' that {INDEX_NAME} assigns to it ({len(missing)} missing): the shard is stale or the index is wrong; re-copy the checkpoint"
                    )
                found = {k: v for k, v in found.items() if k in expected}
            for name, info in found.items():
                if name in infos:
                    raise CheckpointError(
                        f"tensor '{name}' appears in both '{infos[name].file.name}' and '{shard.name}' (keep one copy; fix {INDEX_NAME})"
                    )
                infos[name] = info
        tok = root / TOKENIZER_NAME
        if tok.is_file():
            confined_file(root, TOKENIZER_NAME, TOKENIZER_NAME)
        log.debug("opened checkpoint %s: %d tensors in %d files", root, len(infos), len(files))
        return cls(root, config, config_dict, infos, tok if tok.is_file() else None)

    @staticmethod
    def _weight_files(root: Path) -> dict[Path, set[str] | None]:
        """Shard path -> the tensor names the index assigns to it (None: no index)."""
        index = root / INDEX_NAME
        if index.is_file():
            confined_file(root, INDEX_NAME, INDEX_NAME)
            try:
                data = read_json_object(index, "safetensors index")
            except ConfigError as exc:
                raise CheckpointError(f"{exc} (re-copy {INDEX_NAME})") from None
            weight_map = data.get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(
                    f"{index}: not a valid safetensors index (expected JSON with a 'weight_map' object); re-copy it"
                )
            if not weight_map:
                raise CheckpointError(f"{index}: 'weight_map' is empty (expected tensor name -> shard file)")
            by_file: dict[Path, set[str]] = {}
            for name, fname in weight_map.items():
                by_file.setdefault(confined_file(root, fname, f"{index.name} entry for '{name[:80]}'"), set()).add(name)
            for f in sorted(by_file, key=lambda p: natural_key(p.name)):
                if not f.is_file():
                    raise CheckpointError(
                        f"checkpoint '{root}' is missing shard '{f.name}' named in {INDEX_NAME} ({len(by_file[f])} tensors live there): copy the missing file into the folder or re-download the checkpoint"
                    )
            return dict(by_file)
        single = root / SINGLE_NAME
        if single.is_file():
            return {confined_file(root, SINGLE_NAME, SINGLE_NAME): None}
        stray = sorted(root.glob("*.safetensors"))
        if stray:
            raise CheckpointError(
                f"checkpoint '{root}' has {stray[0].name} but no {INDEX_NAME} (add the index that maps tensor names to shards)"
            )
        raise CheckpointError(
            f"checkpoint '{root}' holds no weights (expected {INDEX_NAME} with its shards, or {SINGLE_NAME})"
        )

    # -- metadata (lazy) ---------------------------------------------------------
    def tensor_names(self) -> list[str]:
        return sorted(self._infos, key=natural_key)

    def __contains__(self, name: object) -> bool:
        return name in self._infos

    def info(self, name: str) -> TensorInfo:
        try:
            return self._infos[name]
        except KeyError:
            raise CheckpointError(
                f"checkpoint '{self.path}' has no tensor '{name}' (the checkpoint does not match its config.json)"
            ) from None

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape from the shard header (``safe_open(...).get_slice``): no data is read."""
        info = self.info(name)
        return tuple(int(s) for s in self._handle(info.file).get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        return self.info(name).torch_dtype

    def st_dtype(self, name: str) -> str:
        """The safetensors dtype string (``F8_E4M3``, ``BF16``...)."""
        return self.info(name).st_dtype

    def nbytes(self, name: str) -> int:
        return self.info(name).nbytes

    def locate(self, name: str) -> tuple[Path, int, int]:
        """``(file, data_offset, nbytes)``: the absolute byte range of a tensor, for a
        runtime that maps or registers the file itself (row r starts at
        ``data_offset + r * row_bytes``)."""
        info = self.info(name)
        return info.file, info.data_offset, info.nbytes

    # -- data --------------------------------------------------------------------
    def _handle(self, file: Path) -> Any:
        from safetensors import safe_open

        h = self._handles.get(file)
        if h is None:
            try:
                h = safe_open(str(file), framework="pt", device="cpu")
            except Exception as exc:  # the library's own refusal (SafetensorError, OSError)
                raise CheckpointError(
                    f"{file}: the safetensors library cannot open it ({str(exc).splitlines()[0][:200]}); the file is damaged, re-copy it"
                ) from None
            self._handles[file] = h
        return h

    def get(self, name: str) -> torch.Tensor:
        """The whole tensor on the CPU, in its stored dtype."""
        info = self.info(name)
        return self._handle(info.file).get_tensor(name)

    def get_slice(self, name: str, dim: int, ranges: Any) -> torch.Tensor:
        """Ranges ``[(a, b), ...]`` of dimension ``dim`` of a tensor, concatenated, on the
        CPU in its stored dtype; only those bytes are read (``safe_open(...).get_slice``:
        a row range is one read, a column range one read per row). A tensor-parallel
        rank's share of a weight."""
        info = self.info(name)
        shape = info.shape
        if not 0 <= dim < len(shape) or any(not 0 <= a <= b <= shape[dim] for a, b in ranges):
            raise EngramError(f"internal: slice {list(ranges)} of dim {dim} is outside tensor '{name}' {list(shape)}")
        sl = self._handle(info.file).get_slice(name)
        parts = [sl[tuple([slice(None)] * dim + [slice(int(a), int(b))])] for a, b in ranges]
        # a row range is a view of the file map (only its pages are read); columns are copied out
        return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim=dim)

    def lazy(self, names: Any = None) -> "LazyTensors":
        """The tensors ``names`` (default: all) as a mapping that reads one when a loader
        takes it: a model loads shard by shard, never holding the checkpoint in a dict."""
        return LazyTensors(self, names)

    def _file_bytes(self, file: Path) -> np.ndarray:
        entry = self._maps.get(file)
        if entry is None:
            fh = open(file, "rb")
            mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            entry = (fh, mm, np.frombuffer(mm, dtype=np.uint8))
            self._maps[file] = entry
        return entry[2]

    def raw_rows_view(self, name: str) -> np.ndarray:
        """A read-only ``uint8 [rows, row_bytes]`` view of a tensor's bytes in its
        file-backed map (the page cache serves it; nothing is copied)."""
        info = self.info(name)
        if len(info.shape) < 1 or info.shape[0] == 0:
            raise CheckpointError(
                f"tensor '{name}' has shape {list(info.shape)}: rows can only be read from a tensor with a leading row dimension"
            )
        rows = info.shape[0]
        row_bytes = info.nbytes // rows
        buf = self._file_bytes(info.file)
        return buf[info.data_offset : info.data_offset + info.nbytes].reshape(rows, row_bytes)

    def get_rows(self, name: str, row_ids: Any) -> torch.Tensor:
        """Rows ``row_ids`` (any int shape) of a tensor: ``[*row_ids.shape, *shape[1:]]``
        in the stored dtype; only those rows' pages are read."""
        info = self.info(name)
        view = self.raw_rows_view(name)
        ids = row_ids.detach().cpu().numpy() if isinstance(row_ids, torch.Tensor) else np.asarray(row_ids)
        ids = ids.astype(np.int64, copy=False)
        if ids.size:
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= view.shape[0]:
                raise EngramError(
                    f"row id {lo if lo < 0 else hi} is outside tensor '{name}' (rows 0..{view.shape[0] - 1})"
                )
        picked = np.take(view, ids.reshape(-1), axis=0)  # copies only the rows asked for
        t = torch.from_numpy(picked)
        if info.torch_dtype != torch.uint8:
            t = t.view(info.torch_dtype)
        return t.reshape(*ids.shape, *info.shape[1:])

    def close(self) -> None:
        """Release file maps and handles (views from :meth:`raw_rows_view` must be gone)."""
        self._handles.clear()
        for fh, mm, _ in self._maps.values():
            try:
                mm.close()
            except BufferError:
                log.debug("map of %s still referenced; left to the garbage collector", fh.name)
            fh.close()
        self._maps.clear()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.path)!r}, tensors={len(self._infos)})"


class LazyTensors(Mapping[str, torch.Tensor]):
    """A checkpoint's tensors by name, each read from its shard when asked for and not
    kept (the loader copies it where it goes and drops it): the weights mapping the
    model loaders take (:meth:`Checkpoint.lazy`). :meth:`stored_dtype` answers from the
    shard header, without reading the tensor."""

    def __init__(self, ckpt: "Checkpoint", names: Any = None) -> None:
        self._ckpt = ckpt
        self._names = ckpt.tensor_names() if names is None else [n for n in names if n in ckpt]
        self._set = frozenset(self._names)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._set:
            raise KeyError(name)
        return self._ckpt.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._set

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def stored_dtype(self, name: str) -> torch.dtype:
        """The tensor's dtype as stored (from its shard's header; no data read)."""
        return self._ckpt.dtype(name)

    def shape_of(self, name: str) -> tuple[int, ...]:
        return self._ckpt.shape(name)


def stored_dtype(weights: Mapping[str, torch.Tensor], name: str) -> torch.dtype:
    """``weights[name]``'s dtype, from the header when ``weights`` is lazy (no read)."""
    if isinstance(weights, LazyTensors):
        return weights.stored_dtype(name)
    return weights[name].dtype


def _tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


CHECKPOINT_FILE_NAMES = (CONFIG_NAME, TOKENIZER_NAME, TOKENIZER_CONFIG_NAME, INDEX_NAME, SINGLE_NAME)


def is_checkpoint_file_name(name: str) -> bool:
    """A name that :func:`write_checkpoint` writes (or a reader reads as weights)."""
    return name in CHECKPOINT_FILE_NAMES or bool(SHARD_RE.match(name))


def write_checkpoint(
    out_dir: str | Path,
    config_dict: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
    tokenizer_json: str | Path | None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> Path:
    """Write an HF-style checkpoint folder; the same inputs give byte-identical files.

    Tensors are ordered by :func:`natural_key` and packed greedily into shards of at
    most ``max_shard_bytes`` (a single larger tensor gets a shard of its own); the
    index lists every tensor. ``tokenizer_config.json`` beside the tokenizer is copied
    too (it names the pad/eos tokens).

    A folder that already holds checkpoint files is refused unless ``overwrite``: then
    its files are replaced and older ``model-*-of-*.safetensors`` that the new index
    does not name are removed, so a re-write leaves no stale shard for a reader to trip
    on. Callers that must never expose a half-written folder (the demo) write into a
    fresh temporary folder and rename it into place (engram_trt.storage.atomic).
    """
    from safetensors.torch import save_file

    if max_shard_bytes < 1:
        raise EngramError(f"max_shard_bytes must be positive (got {max_shard_bytes})")
    out = Path(out_dir)
    if out.is_dir() and not overwrite:
        present = sorted(p.name for p in out.iterdir() if is_checkpoint_file_name(p.name))
        if present:
            raise CheckpointError(
                f"'{out}' already holds a checkpoint ({present[0]}, ...): writing into it would replace its files; choose an empty folder (or pass overwrite=True)"
            )
    out.mkdir(parents=True, exist_ok=True)
    ModelConfig.from_dict(dict(config_dict), source="config to write")  # refuse a bad config before writing
    names = sorted(tensors, key=natural_key)
    groups: list[list[str]] = []
    size = 0
    for name in names:
        nb = _tensor_nbytes(tensors[name])
        if not groups or (size + nb > max_shard_bytes and groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nb
    n = max(1, len(groups))
    weight_map: dict[str, str] = {}
    written: set[str] = set()
    for i, group in enumerate(groups, start=1):
        fname = shard_name(i, n)
        shard = {name: tensors[name].detach().to("cpu").contiguous() for name in group}
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        # safetensors creates files owner-only; a checkpoint is data others read.
        os.chmod(out / fname, 0o644)
        written.add(fname)
        for name in group:
            weight_map[name] = fname
    for stale in out.glob("model-*-of-*.safetensors"):
        if SHARD_RE.match(stale.name) and stale.name not in written:
            stale.unlink()
    total = sum(_tensor_nbytes(tensors[k]) for k in names)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    (out / CONFIG_NAME).write_text(json.dumps(dict(config_dict), indent=2) + "\n")
    if tokenizer_json is not None:
        src = Path(tokenizer_json)
        if not src.is_file():
            raise EngramError(f"tokenizer file '{src}' does not exist (pass a tokenizer.json path)")
        shutil.copyfile(src, out / TOKENIZER_NAME)
        tok_cfg = src.parent / TOKENIZER_CONFIG_NAME
        if tok_cfg.is_file():
            shutil.copyfile(tok_cfg, out / TOKENIZER_CONFIG_NAME)
    log.info("wrote checkpoint %s: %d tensors, %d shard(s), %.1f MB", out, len(names), n, total / 1e6)
    return out


# A linear weight stored FP8 (with block scales beside it: fp8_weight_problem).
FP8_WEIGHT_DTYPE = "F8_E4M3"


def checkpoint_quant(ckpt: "Checkpoint") -> Any:
    """The checkpoint's :class:`~engram_trt.quant.spec.QuantSpec` (None: float weights):
    its typed config's, or read from config.json when the config was read without an
    architecture's reader (an unserved method: ConfigError)."""
    quant = ckpt.config.quant
    if quant is not None:
        return quant
    from engram_trt.quant.spec import read_quant_spec

    return read_quant_spec(ckpt.config_dict, str(ckpt.path / CONFIG_NAME))


def listed_not_to_convert(module: str, quant: Any) -> str | None:
    """The ``modules_to_not_convert`` entry that keeps ``module`` in 16 bits (None: none):
    :meth:`engram_trt.quant.spec.QuantSpec.listed`, transformers' rule."""
    return quant.listed(module) if quant is not None else None


def module_of(weight_name: str) -> str:
    """``model.layers.0.mlp.up_proj`` of ``model.layers.0.mlp.up_proj.weight``."""
    return weight_name[: -len(".weight")] if weight_name.endswith(".weight") else weight_name


def fp8_weight_problem(
    ckpt: Any,
    name: str,
    shape: tuple[int, ...],
    quant: Any,
    scale_name: str | None = None,
    scale_shape: tuple[int, ...] | None = None,
) -> str | None:
    """The problem (one line naming the tensor; None if none) of a linear weight ``name``
    stored F8_E4M3 whose logical shape is ``shape`` ``[..., N, K]``: the config must declare
    FP8 (``quant``), must not list the module in ``modules_to_not_convert``, and its block
    scales must be stored beside it (``<module>.weight_scale_inv`` or ``<module>.scale``,
    or ``scale_name`` where an architecture keeps them elsewhere: transformers' merged expert
    scales, whose per-expert shape is ``scale_shape``) as F32 (or BF16 / F16) floats or
    F8_E8M0 / U8 ue8m0 bytes, one per block."""
    from engram_trt.quant.names import SCALE_DTYPES, find_scale
    from engram_trt.quant.weight import check_quant_tensors

    st = ckpt.st_dtype(name)
    if quant is None:
        return (
            f"tensor {name} is {st} but config.json declares no quantization_config (an FP8 checkpoint's config "
            f"carries quantization_config with quant_method \"fp8\" and its weight_block_size); restore it, or "
            f"serve the 16-bit weights"
        )
    module = module_of(name)
    listed = listed_not_to_convert(module, quant)
    if listed is not None:
        return (
            f"tensor {name} is {st} but quantization_config.modules_to_not_convert lists {module} (as "
            f"{listed!r}: kept in 16 bits): the checkpoint and its config disagree; fix the list or the tensor"
        )
    if scale_name is None:
        scale_name = find_scale(name, ckpt)
    if scale_name is None or scale_name not in ckpt:
        return check_quant_tensors(name, "fp8", shape, ckpt.shape(name), None, quant.block_for(shape))
    sst = ckpt.st_dtype(scale_name)
    if sst not in SCALE_DTYPES:
        return (
            f"scale {scale_name} of {name} is {sst} (expected F32 float scales, or F8_E8M0 ue8m0 bytes, one "
            f"per {'x'.join(map(str, quant.block_for(shape)))} block)"
        )
    got_scale = ckpt.shape(scale_name) if scale_shape is None else scale_shape
    return check_quant_tensors(name, "fp8", shape, ckpt.shape(name), tuple(got_scale), quant.block_for(shape))
