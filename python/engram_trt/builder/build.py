"""``engram-trt build``: a checkpoint becomes an engine folder, with the tables left outside.

Phases (each with a progress bar, each timed in ``build_report.json``):

1. **check**: ``--engram-config`` against the model (before any work), the checkpoint's
   tensors against its config and layout, the tokenizer's compressed size against
   ``engram_compressed_vocab_size``;
2. **vocab**: the compressed token map, saved as ``compressed_vocab.npy`` (the runtime
   compresses ids and keeps the lookback with it);
3. **tables**: each table located (file, offset, length) and hashed, or re-packed to
   FP8 first with ``--repack-tables DIR``;
4. **export**: ``model.onnx``, the portable artifact (the architecture's onnx_export, through the model registry);
5. **engine**: built when a TensorRT builder imports (``tensorrt``, else TensorRT-RTX),
   the plugin library embedded (``--plugin-library embed``) or recorded
   (``reference``); otherwise the build stops after the graph and says so.

``manifest.json`` ties it together and is deterministic; timings and sizes go to
``build_report.json``.

What the build does to the files around it (docs/reliability.md):

* every argument is checked before any work, and ``--output`` may be neither inside
  the checkpoint nor hold it;
* the output folder is locked (``.NAME.lock`` beside it): a second build into it waits
  for the first, then runs;
* the build writes a new folder under a temporary sibling name and swaps it in whole
  only when everything (engine, manifest, report) is written, so a failed or killed
  build leaves the previous engine folder as it was;
* the output folder is ours when it is new, empty, or holds a manifest of an earlier
  build; anything else is refused without ``--force``. Files in it that the build does
  not write (anything but the names in :data:`OUTPUT_NAMES`) are carried into the new
  folder, never deleted;
* ``--repack-tables DIR`` files are written under temporary names and renamed into
  place just before the swap; a file there that no re-pack wrote needs ``--force``;
* temporaries left by a killed build are removed at the next build's start.
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence


from engram_trt import __version__
from engram_trt.storage import atomic
from engram_trt.checkpoint.checkpoint import Checkpoint
from engram_trt.checkpoint.nonfinite import DEFAULT_SCAN_BYTES, require_finite
from engram_trt.builder.defaults import BUILD_DTYPES, DEFAULT_MAX_BATCH, DEFAULT_MAX_NUM_TOKENS, DEFAULT_MAX_SEQ_LEN
from engram_trt.config.dtypes import require_dtype
from engram_trt.config.engram import EngramConfig
from engram_trt.errors import EngramError
from engram_trt.engram.layout import EngramLayout
from engram_trt.builder.manifest import (
    MANIFEST_NAME,
    MANIFEST_VERSION,
    RepackedTables,
    TableRef,
    checkpoint_table_refs,
    foreign_repack_files,
    hash_tables,
    repack_tables,
    sha256_file,
    write_manifest,
)
from engram_trt.models.export import PLUGIN_NAMES, ExportOptions
from engram_trt.builder.output import (
    ENGINE_NAME,
    ONNX_NAME,
    OUTPUT_NAMES,
    REPORT_NAME,
    TOKENIZER_FILE,
    VOCAB_NAME,
    check_output_is_ours,
    output_paths,
)
from engram_trt.tables.source import BLOCK_BYTES, check_table_files

log = logging.getLogger(__name__)

# What the engine's dimensions may reach: int32 token counts inside the plugins.
MAX_BATCH_LIMIT = 1 << 16
MAX_TOKENS_PER_STEP = 2**31 - 1


@dataclass
class BuildResult:
    """What a build produced (paths, sizes, timings); ``engine_path`` is None when no
    TensorRT builder was importable, with the reason in ``engine_skipped``."""

    output_dir: Path
    manifest_path: Path
    onnx_path: Path
    engine_path: Path | None
    engine_bytes: int
    tables_bytes: int
    onnx_bytes: int
    build_seconds: float
    phase_seconds: dict[str, float]
    trt: dict[str, str] | None
    plugin_layers: list[str] = field(default_factory=list)
    engine_skipped: str | None = None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("output_dir", "manifest_path", "onnx_path", "engine_path"):
            d[k] = None if d[k] is None else str(d[k])
        d["tables_to_engine_ratio"] = (self.tables_bytes / self.engine_bytes) if self.engine_bytes else None
        return d

    def summary(self) -> str:
        mb = 1024 * 1024
        lines = [f"engine folder: {self.output_dir}"]
        if self.engine_path is not None:
            lines.append(
                f"engine: {self.engine_path.name} {self.engine_bytes / mb:.1f} MiB "
                f"({self.trt['flavour'] if self.trt else '?'} {self.trt['version'] if self.trt else ''}), "
                f"plugin layers: {len(self.plugin_layers)}"
            )
        else:
            lines.append(f"engine: not built ({self.engine_skipped})")
        lines.append(f"graph: {self.onnx_path.name} {self.onnx_bytes / mb:.1f} MiB")
        ratio = f", {self.tables_bytes / self.engine_bytes:.0f}x the engine" if self.engine_bytes else ""
        lines.append(f"tables (outside the engine): {self.tables_bytes / mb:.1f} MiB{ratio}")
        lines.append(
            f"build time: {self.build_seconds:.1f} s ("
            + ", ".join(f"{k} {v:.1f} s" for k, v in self.phase_seconds.items())
            + ")"
        )
        return "\n".join(lines)


class _Phases:
    """Times phases and shows one progress bar over them."""

    def __init__(self, names: Sequence[str], progress: bool) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=len(names), desc="build", unit="phase", disable=not progress)
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.bar.set_postfix_str(name)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = round(time.perf_counter() - t0, 3)
            self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def find_plugin_library(explicit: str | Path | None = None) -> Path:
    """The plugin library: ``explicit``, else kernels.library_path()'s search."""
    if explicit is not None:
        p = Path(explicit).expanduser()
        if not p.is_file():
            raise EngramError(f"--plugin-lib '{p}' is not a file (point it at libengram_trt_plugins.so)")
        return p.resolve()
    from engram_trt.native.library import library_path

    return library_path()


def plugin_library_info(path: Path) -> dict[str, Any]:
    """Version (from the library's C ABI) and sha256 of the plugin library."""
    version = "unknown"
    try:
        import ctypes

        lib = ctypes.CDLL(str(path))
        fn = lib.engram_trt_plugin_version
        fn.restype = ctypes.c_char_p
        version = fn().decode()
    except (OSError, AttributeError) as exc:
        log.warning("cannot read the plugin library's version from %s (%s)", path, exc)
    return {"file": path.name, "path": str(path), "version": version, "sha256": sha256_file(path)}


def require_valid(ckpt: Checkpoint, layout: Any = None) -> None:
    """The check phase's validation: the checkpoint's architecture's
    :meth:`~engram_trt.models.base.ArchitectureBase.validate` (every tensor the model
    reads, the first problem refused in one line)."""
    ckpt.architecture.validate(ckpt, layout)


def _check_sizes(max_batch: int, max_seq_len: int, max_num_tokens: int, config: Any) -> None:
    for name, v in (("--max-batch", max_batch), ("--max-seq-len", max_seq_len), ("--max-num-tokens", max_num_tokens)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise EngramError(f"{name} must be a positive integer (got {str(v)[:40]})")
    if max_batch > MAX_BATCH_LIMIT:
        raise EngramError(f"--max-batch {max_batch} is larger than an engine serves (at most {MAX_BATCH_LIMIT})")
    if max_num_tokens > MAX_TOKENS_PER_STEP:
        raise EngramError(
            f"--max-num-tokens {max_num_tokens} exceeds 2^31-1 tokens per step (token counts are int32 in the plugins)"
        )
    if max_seq_len > config.max_position_embeddings:
        raise EngramError(
            f"--max-seq-len {max_seq_len} exceeds the model's max_position_embeddings={config.max_position_embeddings}"
        )


def optimization_profile_shapes(
    exported: Any, config: Any, max_batch: int, max_seq_len: int, max_num_tokens: int
) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """(min, opt, max) per input of the serving graph: a step packs T in 1..max_num_tokens
    tokens of S in 1..max_batch sequences; the KV caches are fixed, one slot per sequence
    the engine serves at once: [max_batch, kv_heads, max_seq_len, head_dim]. opt is a
    mid-size decode batch with a prefill chunk beside it."""
    kvh, hd = config.num_key_value_heads, config.head_dim
    opt_s = max(1, (max_batch + 1) // 2)
    opt_t = max(1, min(max_num_tokens, opt_s + 128))
    io = exported.io
    cache = (max_batch, kvh, max_seq_len, hd)
    shapes: dict[str, Any] = {}
    for name in exported.input_names:
        if name in ("input_ids", "engram_ids"):
            shapes[name] = ((1,), (opt_t,), (max_num_tokens,))
        elif name == "seq_starts":
            shapes[name] = ((2,), (opt_s + 1,), (max_batch + 1,))
        elif name in ("past_lens", "slots"):
            shapes[name] = ((1,), (opt_s,), (max_batch,))
        elif name == "engram_lookback":
            n = io["lookback"]
            shapes[name] = ((1, n), (opt_s, n), (max_batch, n))
        elif name.startswith(("key_cache_", "value_cache_")):
            shapes[name] = (cache, cache, cache)
        elif name.startswith("engram_rows_"):
            c, d = io["cols"], io["head_dim"]
            shapes[name] = ((1, c, d), (opt_t, c, d), (max_num_tokens, c, d))
        elif name in (io.get("states") or {}):  # a per-slot state (Qwen4Exp, DeepSeek-V4): fixed, one slot per sequence
            dims = tuple(_state_dim(d, max_batch, max_seq_len) for d in io["states"][name]["shape"])
            shapes[name] = (dims, dims, dims)
        elif name == "ple_context":
            n = io["ple"]["context"]
            shapes[name] = ((1, n), (opt_s, n), (max_batch, n))
    return shapes


def _state_dim(d: Any, max_batch: int, max_seq_len: int) -> int:
    """A state dimension of the graph's io: ``num_slots``, ``max_seq_len``, ``max_seq_len//r``
    (DeepSeek-V4's compressed entries) or a number."""
    if d == "num_slots":
        return max_batch
    if d == "max_seq_len":
        return max_seq_len
    if isinstance(d, str) and d.startswith("max_seq_len//"):
        return max_seq_len // int(d.split("//", 1)[1])
    return int(d)


def _plugin_name(t: Any, layer: Any) -> str:
    """The plugin name of an IPluginV3 layer (through its core capability). The network
    hands out plain ILayer objects; the Python bindings expose ``.plugin`` only once the
    object is viewed as IPluginV3Layer (both flavours)."""
    layer.__class__ = t.IPluginV3Layer
    core = layer.plugin.get_capability_interface(t.PluginCapabilityType.CORE)
    return f"{core.plugin_name}/{core.plugin_version}"


def build_engine(
    onnx_path: Path,
    exported: Any,
    config: Any,
    *,
    engine_path: Path,
    max_batch: int,
    max_seq_len: int,
    max_num_tokens: int,
    targets: Sequence[str],
    plugin_library: Path | None,
    embed_plugin_library: bool,
) -> tuple[int, list[str]]:
    """Parse ``model.onnx`` into a strongly typed network and build the serialized engine.
    Returns (engine bytes, plugin names of the network's plugin layers)."""
    from engram_trt.native import trt_compat as tc

    t = tc.load().module
    builder = tc.create_builder()
    if plugin_library is not None:
        tc.load_plugin_library(plugin_library)
        registered = {name for name, _ in tc.plugin_creator_names()}
        missing = [n for n in exported.io.get("plugins", PLUGIN_NAMES) if n not in registered]
        if missing:
            raise EngramError(
                f"the plugin library '{plugin_library}' registers no creator for {', '.join(missing)}; "
                "rebuild it from this source tree (cmake --build build)"
            )
    network = tc.create_network(builder)
    parser = tc.onnx_parser(network)
    tc.parse_onnx_file(parser, onnx_path)
    plugin_layers: list[str] = []
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        if layer.type == t.LayerType.PLUGIN_V3:
            plugin_layers.append(_plugin_name(t, layer))
    cfg = builder.create_builder_config()
    tc.enable_aliased_plugin_io(cfg)  # EngramAttention updates the KV caches in place
    profile = builder.create_optimization_profile()
    for name, (lo, opt, hi) in optimization_profile_shapes(
        exported, config, max_batch, max_seq_len, max_num_tokens
    ).items():
        profile.set_shape(name, lo, opt, hi)
    cfg.add_optimization_profile(profile)
    tc.set_targets(cfg, targets)
    if plugin_library is not None and embed_plugin_library:
        tc.set_plugins_to_serialize(cfg, [plugin_library])
    serialized = builder.build_serialized_network(network, cfg)
    if serialized is None:
        raise EngramError(f"TensorRT could not build an engine from '{onnx_path}' (see the TensorRT log above)")
    data = memoryview(serialized).cast("B")
    tmp = engine_path.with_name(engine_path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    tmp.replace(engine_path)
    return len(data), plugin_layers


def build(
    checkpoint: str | Path | Checkpoint,
    output_dir: str | Path,
    engram_config: EngramConfig | str | dict | None = None,
    *,
    max_batch: int = DEFAULT_MAX_BATCH,
    max_seq_len: int | None = None,
    max_num_tokens: int | None = None,
    dtype: str = "bf16",
    targets: str | Sequence[str] | None = None,
    embed_plugin_library: bool = True,
    plugin_library: str | Path | None = None,
    repack_tables_dir: str | Path | None = None,
    build_engine_if_possible: bool = True,
    progress: bool = True,
    force: bool = False,
    table_block_bytes: int = BLOCK_BYTES,
    allow_unused_weights: bool = False,
    token_ids_only: bool = False,
    nonfinite_scan_bytes: int | None = DEFAULT_SCAN_BYTES,
) -> BuildResult:
    """Build an engine folder from a checkpoint (see the module docstring for the phases
    and for what happens to the files around it).

    ``engram_config``: an :class:`EngramConfig`, JSON text/path or dict. ``targets``:
    TensorRT-RTX compute capabilities (``"sm80,sm86"``). ``build_engine_if_possible``
    False stops after the graph even when TensorRT is importable. ``force``: build into
    a folder that holds files engram-trt did not write. ``table_block_bytes``: the
    block size of the tables' recorded hashes (the sampled check's unit).
    ``token_ids_only``: the checkpoint may lack tokenizer.json (a model without Engram
    layers): the engine is served token ids, never text. ``nonfinite_scan_bytes``: the
    NaN / Inf scan's budget before any work (None: every byte; ``checkpoint.nonfinite``).
    """
    from engram_trt.native import trt_compat as tc

    t_start = time.perf_counter()
    # -- every argument, before any work ------------------------------------------------
    dtype = require_dtype(dtype, BUILD_DTYPES, "an engine", "--dtype")
    from engram_trt.models.registry import open_checkpoint

    if isinstance(checkpoint, Checkpoint):
        checkpoint = checkpoint.path
    ckpt = open_checkpoint(checkpoint, allow_unused=allow_unused_weights)
    config = ckpt.config
    refused = ckpt.architecture.engine_problems(ckpt)  # what the engine cannot take (Qwen4Exp's FP8 PLE rows)
    if refused:
        ckpt.close()
        raise EngramError(f"checkpoint '{checkpoint}': {refused[0]}")
    ecfg = engram_config if isinstance(engram_config, EngramConfig) else EngramConfig.parse(engram_config)
    ecfg.validate_for(config)
    # Defaults fit the model; values the user passed are checked as given, never clamped.
    if max_seq_len is None:
        max_seq_len = min(config.max_position_embeddings, DEFAULT_MAX_SEQ_LEN)
    if max_num_tokens is None:
        max_num_tokens = max(min(DEFAULT_MAX_NUM_TOKENS, max_seq_len), int(max_batch))
    _check_sizes(max_batch, max_seq_len, max_num_tokens, config)
    target_list = tc.parse_targets(targets)
    fp8 = ckpt.architecture.engine_fp8_weights(ckpt)
    if fp8:  # FP8 types compile for sm89 and later: those targets, or a --target list without older GPUs
        older = [t for t in target_list if t not in tc.FP8_TARGETS]
        if older:
            ckpt.close()
            raise EngramError(
                f"--target {','.join(older)}: tensor {fp8[0]} (and {len(fp8) - 1} more) is stored FP8 "
                f"(F8_E4M3), which TensorRT-RTX compiles for {', '.join(tc.FP8_TARGETS)} only; pass "
                f"--target {','.join(tc.FP8_TARGETS)} (or leave --target out), or build from the "
                f"checkpoint's 16-bit weights for those GPUs"
            )
        if not target_list and (not tc.available() or tc.load().is_rtx):
            target_list = tc.FP8_TARGETS
            log.info("the checkpoint stores FP8 weights: building for %s", ", ".join(target_list))
    if plugin_library is not None and build_engine_if_possible:
        find_plugin_library(plugin_library)  # a wrong --plugin-lib fails before any work
    spec = config.require_model()
    if repack_tables_dir is not None and spec is None:
        raise EngramError("--repack-tables: the model has no Engram layers, so there are no tables to re-pack")
    out, repack_dir = output_paths(output_dir, ckpt, repack_tables_dir)
    if table_block_bytes < 1:
        raise EngramError(f"table_block_bytes must be positive (got {table_block_bytes})")
    check_output_is_ours(out, force, warn=False)  # refused before anything is created (checked again under the lock)
    try:  # what the checkpoint holds, read before anything is written: its tokenizer, then NaN / Inf
        _check_tokenizer(ckpt, token_ids_only)
        scan = require_finite(ckpt, nonfinite_scan_bytes)
    except BaseException:
        ckpt.close()
        raise
    log.info("non-finite scan: none found (%s)", scan.cost())

    with ExitStack() as stack:
        for target in sorted({out} | ({repack_dir} if repack_dir else set())):
            stack.enter_context(atomic.locked(target, "another build"))
        atomic.clean_dead_temps(out)
        replaced = check_output_is_ours(out, force)
        if repack_dir is not None:
            foreign = foreign_repack_files(ckpt, repack_dir)
            if foreign and not force:
                raise EngramError(
                    f"--repack-tables: '{foreign[0]}' exists and was not written by a re-pack; "
                    "move it away, choose another folder, or pass --force to replace it"
                )
        tmp = atomic.temp_sibling(out, "build")
        repacked: list[RepackedTables] = []  # filled by _build_into, committed or discarded here
        phases = _Phases(["check", "vocab", "tables", "export", "engine"], progress)
        try:
            result = _build_into(
                tmp,
                out,
                ckpt,
                ecfg,
                phases,
                t_start,
                repacked,
                dtype=dtype,
                max_batch=max_batch,
                max_seq_len=max_seq_len,
                max_num_tokens=max_num_tokens,
                target_list=target_list,
                embed_plugin_library=embed_plugin_library,
                plugin_library=plugin_library,
                repack_dir=repack_dir,
                build_engine_if_possible=build_engine_if_possible,
                progress=progress,
                table_block_bytes=table_block_bytes,
            )
            carried = atomic.carry_over(out, tmp, lambda n: n not in replaced and n not in OUTPUT_NAMES)
            if carried:
                log.info(
                    "kept %d file(s) of %s that the build does not write: %s", len(carried), out, ", ".join(carried)
                )
            atomic.pause_point("build:commit")
            for r in repacked:
                r.commit()
            atomic.replace_dir(tmp, out)
        except BaseException:
            atomic.remove_temp(tmp)
            for r in repacked:
                r.discard()
            raise
        finally:
            phases.close()
    log.info(
        "built %s: engine %s bytes, tables %s bytes outside it, %.1f s",
        out,
        result.engine_bytes,
        result.tables_bytes,
        result.build_seconds,
    )
    return result


def _build_into(
    tmp: Path,
    out: Path,
    ckpt: Checkpoint,
    ecfg: EngramConfig,
    phases: _Phases,
    t_start: float,
    repacked: list[RepackedTables],
    *,
    dtype: str,
    max_batch: int,
    max_seq_len: int,
    max_num_tokens: int,
    target_list: Sequence[str],
    embed_plugin_library: bool,
    plugin_library: str | Path | None,
    repack_dir: Path | None,
    build_engine_if_possible: bool,
    progress: bool,
    table_block_bytes: int,
) -> BuildResult:
    """The phases, writing every file into ``tmp``; paths in the results name ``out``,
    where ``tmp`` will be swapped in. Re-packed tables (still under temporary names) are
    appended to ``repacked`` for the caller to commit or discard."""
    from engram_trt.native import trt_compat as tc

    config = ckpt.config
    spec = config.engram
    layout: EngramLayout | None = None
    vocab = None
    with phases.phase("check"):
        atomic.pause_point("build:check")
        if spec is not None and ckpt.tokenizer_json is None:
            raise EngramError(
                f"checkpoint '{ckpt.path}' has no tokenizer.json, "
                "which Engram needs for the compressed vocab (copy the model's tokenizer.json into it)"
            )
        arch = ckpt.architecture
        require_valid(ckpt)  # the tensors against the config (table shapes do not depend on the pad id)
        # the tables an architecture holds of its own (Qwen4Exp's PLE), else the Engram tables
        own_refs: list[TableRef] = list(arch.table_refs(ckpt)) if spec is None else []
        check_table_files(own_refs if spec is None else checkpoint_table_refs(ckpt))
    with phases.phase("vocab"):
        if spec is not None:
            from engram_trt.engram.tokenizer import build_compressed_vocab, check_compressed_size

            vocab = build_compressed_vocab(ckpt.tokenizer_json)
            check_compressed_size(vocab, spec.compressed_vocab_size, spec.field_name("compressed_vocab_size"))
            if spec.pad_token_id >= vocab.vocab_size:
                raise EngramError(
                    f"{spec.field_name('pad_token_id')}={spec.pad_token_id} is not a token of the "
                    f"tokenizer (vocab {vocab.vocab_size})"
                )
            layout = EngramLayout.from_spec(spec, pad_id=int(vocab.lookup[spec.pad_token_id]))
            arch.validate(ckpt, layout)  # the tables against the layout (DeepSeek-V4.1's are checked only here)
            vocab.save(tmp / VOCAB_NAME)
        if ckpt.tokenizer_json is not None:
            import shutil

            shutil.copyfile(ckpt.tokenizer_json, tmp / TOKENIZER_FILE)
    refs: list[TableRef] = []
    with phases.phase("tables"):
        atomic.pause_point("build:tables")
        if spec is not None:
            if repack_dir is not None:
                repacked.append(repack_tables(ckpt, repack_dir, progress=progress))
                refs = repacked[-1].final(hash_tables(repacked[-1].refs, progress, table_block_bytes))
            else:
                refs = hash_tables(checkpoint_table_refs(ckpt), progress, table_block_bytes)
        elif own_refs:  # each shard's sha256 and block hashes: the manifest's checksums
            refs = hash_tables(own_refs, progress, table_block_bytes)
    tables_bytes = sum(r.nbytes for r in refs)
    table_dtype = None
    table_rows: tuple[int, ...] | None = None
    if spec is not None:
        table_dtype = "fp8" if any(r.role == "scales" for r in refs) else "bf16"
        table_rows = tuple(int(r.shape[0]) for r in refs if r.role == "rows")
    elif refs:  # one table per layer of shards (parts)
        table_dtype = ckpt.architecture.table_dtype(refs)
        per_layer: dict[int, int] = {}
        for r in refs:
            per_layer[r.layer_index] = per_layer.get(r.layer_index, 0) + int(r.shape[0])
        table_rows = tuple(per_layer[i] for i in sorted(per_layer))
    with phases.phase("export"):
        atomic.pause_point("build:export")
        opts = ExportOptions(
            dtype=dtype,
            max_position=max_seq_len,
            placement=ecfg.placement,
            table_dtype=table_dtype,
            table_rows=table_rows,
        )
        # the weights read tensor by tensor as the graph takes them (stored FP8 / FP4 bytes as they are)
        exported = ckpt.architecture.export_onnx(config, ckpt.lazy(), layout, opts)
        _check_no_tables_in_graph(exported, refs)
        files = exported.save(tmp / ONNX_NAME)
    onnx_bytes = sum(f.stat().st_size for f in files)
    # Every graph needs the plugin library: EngramAttention in each layer (and the
    # hash, gather and gate in an Engram model).
    try:
        plugin_info: dict[str, Any] | None = plugin_library_info(find_plugin_library(plugin_library))
    except EngramError:
        if plugin_library is not None:
            raise
        plugin_info = None
    trt_info = None
    engine_path: Path | None = None
    engine_bytes = 0
    engine_sha = None
    plugin_layers: list[str] = []
    skipped: str | None = None
    with phases.phase("engine"):
        atomic.pause_point("build:engine")
        if not build_engine_if_possible:
            skipped = "engine build not requested"
        elif not tc.available():
            skipped = (
                f"no TensorRT builder is importable ({tc.NOT_INSTALLED_REASON.split(' (')[0]} and neither is "
                f"tensorrt_rtx); the exported graph {ONNX_NAME} is the artifact: build it where TensorRT is installed"
            )
            log.warning("%s", skipped)
        elif plugin_info is None:
            skipped = (
                "the plugin library libengram_trt_plugins.so was not found "
                "(build it with `cmake -S . -B build && cmake --build build -j2`, or pass --plugin-lib)"
            )
            log.warning("%s", skipped)
        else:
            trt_info = tc.describe()
            lib = Path(plugin_info["path"])
            engine_bytes, plugin_layers = build_engine(
                tmp / ONNX_NAME,
                exported,
                config,
                engine_path=tmp / ENGINE_NAME,
                max_batch=int(max_batch),
                max_seq_len=max_seq_len,
                max_num_tokens=max_num_tokens,
                targets=target_list,
                plugin_library=lib,
                embed_plugin_library=embed_plugin_library,
            )
            _check_engine_size(engine_bytes, tables_bytes, exported, plugin_info if embed_plugin_library else None)
            engine_path = out / ENGINE_NAME
            engine_sha = sha256_file(tmp / ENGINE_NAME)
    manifest = {
        "manifest_version": MANIFEST_VERSION,
        "engram_trt_version": __version__,
        "checkpoint": str(ckpt.path.resolve()),
        "model": config.to_dict(),
        "dtype": dtype,
        "graph": {
            "file": ONNX_NAME,
            "sha256": sha256_file(tmp / ONNX_NAME),
            "inputs": exported.input_names,
            "outputs": exported.output_names,
            "io": exported.io,
            "external_data": [f.name for f in files[1:]],
        },
        "engine": None if engine_path is None else {"file": ENGINE_NAME},
        "shapes": {"max_batch": int(max_batch), "max_seq_len": max_seq_len, "max_num_tokens": max_num_tokens},
        "layout": None if layout is None else layout.to_json_dict(),
        "tokenizer": None
        if ckpt.tokenizer_json is None
        else {"file": TOKENIZER_FILE, "sha256": sha256_file(tmp / TOKENIZER_FILE)},
        "compressed_vocab": None
        if vocab is None
        else {
            "file": VOCAB_NAME,
            "size": vocab.size,
            "tokenizer_sha256": vocab.source_sha256,
            "sha256": sha256_file(tmp / VOCAB_NAME),
        },
        "token_ids_only": ckpt.tokenizer_json is None,
        "tables": [r.to_json() for r in refs],
        "tables_bytes": tables_bytes,
        "table_dtype": table_dtype,
        "repacked": repack_dir is not None,
        "plugins": None
        if plugin_info is None
        else {
            "names": list(exported.io["plugins"]),
            "plugin_version": "1",
            "library": {
                "file": plugin_info["file"],
                "version": plugin_info["version"],
                "sha256": plugin_info["sha256"],
                "path": None if embed_plugin_library else plugin_info["path"],
            },
            "embedded": bool(embed_plugin_library and engine_path is not None),
        },
        "tensorrt": trt_info,
        "build_flags": {
            "dtype": dtype,
            "max_batch": int(max_batch),
            "max_seq_len": max_seq_len,
            "max_num_tokens": max_num_tokens,
            "targets": list(target_list),
            "plugin_library": "embed" if embed_plugin_library else "reference",
            "repack_tables": str(repack_dir.resolve()) if repack_dir is not None else None,
        },
        "engram_config": ecfg.to_dict(),
    }
    write_manifest(tmp / MANIFEST_NAME, manifest)
    result = BuildResult(
        output_dir=out,
        manifest_path=out / MANIFEST_NAME,
        onnx_path=out / ONNX_NAME,
        engine_path=engine_path,
        engine_bytes=engine_bytes,
        tables_bytes=tables_bytes,
        onnx_bytes=onnx_bytes,
        build_seconds=round(time.perf_counter() - t_start, 3),
        phase_seconds=dict(phases.seconds),
        trt=trt_info,
        plugin_layers=plugin_layers,
        engine_skipped=skipped,
    )
    report = result.to_json()
    if engine_sha is not None:
        report["engine_sha256"] = engine_sha
    (tmp / REPORT_NAME).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    return result


def _check_tokenizer(ckpt: Checkpoint, token_ids_only: bool) -> None:
    """A checkpoint's tokenizer.json must be there and readable (the engine turns text into
    tokens with it), unless ``token_ids_only`` says the engine is served token ids only;
    an Engram model needs it either way (its compressed token map is built from it)."""
    from engram_trt.engram.tokenizer import load_tokenizer

    if ckpt.tokenizer_json is not None:
        load_tokenizer(ckpt.tokenizer_json)  # one line naming it when it cannot be read
        return
    if ckpt.config.engram is not None:
        raise EngramError(
            f"checkpoint '{ckpt.path}' has no tokenizer.json, which Engram needs for the compressed vocab "
            f"(copy the model's tokenizer.json into it)"
        )
    if not token_ids_only:
        raise EngramError(
            f"checkpoint '{ckpt.path}' has no tokenizer.json, which turns text into tokens: copy "
            f"the model's tokenizer.json into it, or pass --token-ids-only to build an engine that is "
            f"sent token ids only"
        )


def _check_no_tables_in_graph(exported: Any, refs: Sequence[TableRef]) -> None:
    """The structural guarantee behind "tables never enter an engine": no graph
    initializer is a table tensor (by name or by size)."""
    table_names = {r.tensor for r in refs}
    table_sizes = {r.nbytes for r in refs}
    from onnx import numpy_helper  # noqa: F401 - the proto fields suffice

    for init in exported.model.graph.initializer:
        if init.name in table_names:
            raise EngramError(f"internal: table {init.name} entered the exported graph")
        n = len(init.raw_data)
        if n and n in table_sizes and n > (1 << 20):
            raise EngramError(f"internal: initializer {init.name} has the size of a table ({n} bytes)")


def _check_engine_size(engine_bytes: int, tables_bytes: int, exported: Any, plugin_info: dict | None) -> None:
    """An engine holds the backbone (graph initializers), kernels and, if embedded, the
    plugin library; table bytes would show as an engine larger than all of that plus
    the tables. Refuse such an engine rather than ship it."""
    lib = Path(plugin_info["path"]).stat().st_size if plugin_info else 0
    allowance = 2 * exported.initializer_bytes + lib + 64 * 1024 * 1024
    if tables_bytes and engine_bytes > allowance + tables_bytes // 2:
        raise EngramError(
            f"internal: the engine ({engine_bytes} bytes) is larger than its backbone, "
            f"kernels and plugins allow ({allowance} bytes): table bytes may have entered it"
        )
