"""The model ``engram-trt bench dsv4-step`` times: a DeepSeek-V4.1-shaped config (few
experts, sliding-window layers with one CSA and one HCA layer, Engram on two layers with
DeepSeek-V4.1's FP8 rows), its random weights made on the device (no checkpoint is
written or read), its Engram tables in pinned host memory or in HBM, and the floors a
step's time is held against.

Why random weights straight on the device: a 1.8B checkpoint written and loaded back
costs minutes of the benchmark's device time and measures nothing the step depends on.
The weights go through the model's own loader (:meth:`DeepseekV4Architecture.build_model`,
tensor by tensor, the float32 ones kept float32), so the model is the one served.

Two weight formats (:data:`WEIGHT_FORMATS`): ``bf16`` (every weight in the compute
dtype) and ``fp8``, DeepSeek-V4.1-Flash's recipe: the attention's ``wq_a wq_b wkv wo_a
wo_b``, the indexer's ``wq_b`` and the shared experts FP8 E4M3 with ue8m0 128x128 block
scales, the routed experts FP4 e2m1 (ue8m0 scale per 32 inputs), the rest as ``bf16``
(:func:`quantize_weights`: the random float weights quantized on the device, the config
given the published ``quantization_config``). A step's floor counts the bytes its
weights take in that format.

The floors (:func:`floor`): a step must read its weights once (all but the embedding
table, of which only the step's rows, and only the routed experts its tokens can reach),
the per-sequence attention state it attends (the sliding window, the CSA indexer's keys
and its top-k entries, the HCA entries) and each Engram layer's rows (the table rows
gathered, the bf16 staged rows read by the layer): those bytes at the HBM copy rate
measured in the run. Host tables move their rows over the link instead: those bytes at
the pinned host-to-device rate measured in the same run are the Engram rows' own floor.
A prefill chunk is also held against its matrix FLOPs at the measured bf16 rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from engram_trt.errors import EngramError

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"

# Shape of each preset; "1b" (~1.76B parameters) is the benchmark, "tiny" the CPU smoke test's.
PRESETS: dict[str, dict[str, Any]] = {
    "1b": {
        "vocab_size": 129280,
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 16,
        "head_dim": 256,
        "q_lora_rank": 768,
        "o_groups": 4,
        "o_lora_rank": 512,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 1024,
        "index_n_heads": 16,
        "index_head_dim": 128,
        "index_topk": 512,
        "sliding_window": 128,
        "compress_rates": {CSA: 4, HCA: 128},
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "engram_layer_ids": [1, 2],
        "engram_max_ngram_size": 4,
        "engram_n_heads": 8,
        "engram_head_dim": 256,
        "engram_compressed_vocab_size": 99092,
        "csa_layer": 7,
        "hca_layer": 14,
        "hash_layers": 3,
    },
    "tiny": {
        "vocab_size": 512,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "head_dim": 32,
        "q_lora_rank": 32,
        "o_groups": 2,
        "o_lora_rank": 16,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "index_n_heads": 4,
        "index_head_dim": 16,
        "index_topk": 4,
        "sliding_window": 8,
        "compress_rates": {CSA: 4, HCA: 16},
        "hc_mult": 2,
        "hc_sinkhorn_iters": 3,
        "engram_layer_ids": [1, 2],
        "engram_max_ngram_size": 3,
        "engram_n_heads": 2,
        "engram_head_dim": 32,
        "engram_compressed_vocab_size": 400,
        "csa_layer": 1,
        "hca_layer": 2,
        "hash_layers": 1,
    },
}
PAD = 1  # the pad token's raw and compressed id
WEIGHT_FORMATS = ("bf16", "fp8")
# DeepSeek-V4.1-Flash's recipe (canonical names): FP8 projections, FP4 routed experts.
FP8_WEIGHTS = r"\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b)\.weight$|\.indexer\.wq_b\.weight$|\.shared_experts\.w[123]\.weight$"
FP4_WEIGHTS = r"\.ffn\.experts\.\d+\.w[123]\.weight$"
QUANT_CONFIG = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "scale_fmt": "ue8m0",
    "weight_block_size": [128, 128],
}
ROTARY_DIMS = 64  # DeepSeek-V4's rope dims (head_dim x partial_rotary_factor), fewer when the head is narrower
NAN_CODE = 0x7F  # FP8 E4M3's NaN code (low seven bits all set): never stored in a table


def bench_config(preset: str, *, table_gib: float, max_len: int, weights: str = "bf16") -> dict[str, Any]:
    """The config.json dict of ``preset``, its Engram tables sized to ``table_gib`` GiB
    over both layers (FP8 rows + one scale byte per 32 values); ``weights`` ``fp8``
    declares the published quantization_config (FP8 linears, FP4 experts)."""
    if preset not in PRESETS:
        raise EngramError(f"--model {preset!r} is not a preset (choose one of {', '.join(sorted(PRESETS))})")
    if weights not in WEIGHT_FORMATS:
        raise EngramError(f"--weights {weights!r} is not a weight format (choose from {', '.join(WEIGHT_FORMATS)})")
    p = dict(PRESETS[preset])
    n = p.pop("num_hidden_layers")
    csa, hca, n_hash = p.pop("csa_layer"), p.pop("hca_layer"), p.pop("hash_layers")
    types = [SLIDING] * n
    types[csa], types[hca] = CSA, HCA
    cols = (p["engram_max_ngram_size"] - 1) * p["engram_n_heads"]
    row_bytes = p["engram_head_dim"] + p["engram_head_dim"] // 32
    rows_per_col = max(64, int(table_gib * 2**30 / (row_bytes * len(p["engram_layer_ids"]) * cols)))
    p.update(
        architectures=["DeepseekV41ForCausalLM"],
        model_type="deepseek_v41",
        num_hidden_layers=n,
        layer_types=types,
        mlp_layer_types=["hash_moe"] * n_hash + ["moe"] * (n - n_hash),
        partial_rotary_factor=min(ROTARY_DIMS, p["head_dim"] // 4) / p["head_dim"],
        num_nextn_predict_layers=0,
        max_position_embeddings=max(65536, max_len),
        eos_token_id=2,
        bos_token_id=0,
        tie_word_embeddings=False,
        engram_vocab_size=rows_per_col,
        engram_pad_token_id=PAD,
        engram_table_dtype="fp8",
    )
    if weights == "fp8":
        p.update(quantization_config=dict(QUANT_CONFIG), expert_dtype="fp4")
    return p


@dataclass
class BenchModel:
    """The built model and what the floors and the report read of it."""

    model: Any
    config: Any
    layout: Any
    compress_lookup: Any  # numpy int64 [vocab]: raw -> compressed id
    weight_bytes: int
    params: int
    weights: str = "bf16"  # the weight format (WEIGHT_FORMATS)


def _random(name: str, shape: tuple[int, ...], dtype: Any, device: Any, gen: Any, experts: int) -> Any:
    """A weight for ``name``: norms near 1, the hash routing a token's distinct experts,
    the rest N(0, 1 / fan_in) (activations stay O(1) through the layers)."""
    import torch

    if name.endswith(".gate.tid2eid"):
        vocab, k = shape
        first = torch.randint(0, experts, (vocab, 1), generator=gen, device=device)
        return (first + torch.arange(k, device=device)) % experts
    if ("norm" in name and len(shape) == 1) or name.endswith((".q_weight", ".k_weight")):
        return 1 + 0.05 * torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
    fan_in = shape[-1] if len(shape) > 1 else 1
    return (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * (0.5 / math.sqrt(fan_in))).to(dtype)


def quantize_weights(weights: dict[str, Any]) -> dict[str, Any]:
    """The recipe's weights quantized in place of the float ones (module docstring):
    ``<name>`` the stored bytes, ``<name>_scale_inv`` (``.weight_scale_inv``) the scales."""
    import re

    from engram_trt.quant.formats import quantize_fp4, quantize_fp8

    fp8, fp4 = re.compile(FP8_WEIGHTS), re.compile(FP4_WEIGHTS)
    for name in list(weights):
        if fp8.search(name) or fp4.search(name):
            w = weights.pop(name)
            q, s = quantize_fp8(w, (128, 128), "ue8m0") if fp8.search(name) else quantize_fp4(w)
            del w
            weights[name] = q
            weights[name[: -len(".weight")] + ".weight_scale_inv"] = s
    return weights


def weight_tensors(model: Any) -> list[tuple[str, int, int]]:
    """``(name, bytes held, values)`` of every weight of the model: each float parameter,
    and each stored-format projection's bytes with its scales (its values: N x K)."""
    out: list[tuple[str, int, int]] = []
    for mod_name, mod in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        for attr, p in mod.named_parameters(recurse=False):
            out.append((prefix + attr, p.numel() * p.element_size(), p.numel()))
        qw = getattr(mod, "qweight", None)
        if qw is not None:
            out.append((prefix + "weight", qw.nbytes, qw.out_features * qw.in_features))
    return out


def random_weights(cfg: Any, device: Any, dtype: Any, seed: int = 0) -> dict[str, Any]:
    """Checkpoint name -> a random tensor for every weight a DeepSeek-V4 / V4.1 model of
    ``cfg`` reads (no Engram tables), made on ``device`` in ``dtype`` (the float32-kept
    ones in float32): norms near 1, hash routing to distinct experts, the rest
    N(0, 1 / fan_in) scaled so activations stay O(1) through the layers; quantized per the
    recipe (one float weight at a time on the device) where ``cfg`` declares quantization."""
    import torch

    from engram_trt.models.deepseek_v4.model import KEEP_FLOAT32, model_tensor_shapes

    gen = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for name, shape in model_tensor_shapes(cfg).items():
        want = torch.float32 if KEEP_FLOAT32.search(name) else dtype
        weights[name] = _random(name, shape, want, device, gen, cfg.n_routed_experts)
        if cfg.quant is not None:
            weights.update(quantize_weights({name: weights.pop(name)}))
    return weights


def build_model(cfg_dict: dict[str, Any], device: Any, dtype: Any, seed: int = 0) -> BenchModel:
    """The V4.1 model of ``cfg_dict`` with random weights made on ``device`` (module
    docstring), quantized per the recipe where ``cfg_dict`` declares quantization_config."""
    import numpy as np

    from engram_trt.engram.layout import EngramLayout
    from engram_trt.models.deepseek_v4.architecture import ARCHITECTURE
    from engram_trt.models.deepseek_v4.config import read_config

    cfg = read_config(cfg_dict, "bench dsv4-step")
    weights = random_weights(cfg, device, dtype, seed)
    spec = cfg.engram
    lookup = np.random.default_rng(seed).integers(3, spec.compressed_vocab_size, size=cfg.vocab_size, dtype=np.int64)
    lookup[PAD] = PAD
    layout = EngramLayout.from_spec(spec, pad_id=PAD)
    model = ARCHITECTURE.build_model(cfg, weights, device=device, dtype=dtype, compress_lookup=lookup, layout=layout)
    del weights
    held = weight_tensors(model)
    return BenchModel(
        model,
        cfg,
        layout,
        lookup,
        sum(b for _n, b, _v in held),
        sum(v for _n, _b, v in held),
        "bf16" if cfg.quant is None else "fp8",
    )


def build_tables(layout: Any, head_dim: int, where: str, device: Any, seed: int = 1) -> list[tuple[Any, Any]]:
    """Per Engram layer ``(fp8 rows [R, head_dim] uint8, ue8m0 scales [R, head_dim / 32])``
    in pinned host memory (``where='pinned'``, plain host memory without CUDA) or on the
    device (``'hbm'``). A random 16 MiB block is tiled over the rows: fast to fill, and
    random row ids still land on random pages; no FP8 NaN code, scales near 2^0."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    block = torch.randint(0, 256, (16 << 20,), dtype=torch.uint8, generator=gen)
    block[(block & 0x7F) == NAN_CODE] = 0x3C
    cuda = torch.device(device).type == "cuda"
    out = []
    for li in range(layout.num_layers):
        R = int(layout.table_rows[li])
        if where == "hbm":
            rows = torch.empty((R, head_dim), dtype=torch.uint8, device=device)
            src = block.to(device)
        else:
            rows = torch.empty((R, head_dim), dtype=torch.uint8, pin_memory=cuda)
            src = block
        flat = rows.view(-1)
        for a in range(0, flat.numel(), src.numel()):
            n = min(src.numel(), flat.numel() - a)
            flat[a : a + n].copy_(src[:n])
        scales = torch.randint(124, 130, (R, head_dim // 32), dtype=torch.uint8, generator=gen)
        scales = scales.to(device) if where == "hbm" else (scales.pin_memory() if cuda else scales)
        out.append((rows, scales))
    return out


def table_store(tables: list[tuple[Any, Any]], where: str, layer_ids: list[int]) -> Any:
    """The runtime's store over the tables: DeviceTables in HBM; pinned host tensors that
    the GPU may read in place (UVA) otherwise (plain memory on a CPU run)."""
    import torch

    from engram_trt.tables.base import DeviceTables, TableStore

    class PinnedTensors(TableStore):  # cudaHostAlloc'd by torch: readable through UVA
        kind = "pinned"
        gpu_readable = True

    if tables[0][0].is_cuda:
        return DeviceTables(tables, 32, layer_ids)
    if torch.cuda.is_available() and tables[0][0].is_pinned():
        return PinnedTensors(tables, 32, layer_ids)
    return TableStore(tables, 32, layer_ids)  # a CPU run: both placements are plain memory


# ------------------------------------------------------------------------------ floors
def _entries(cfg: Any, kind: str, length: int) -> int:
    return length // cfg.compress_rates[kind]


def state_bytes(cfg: Any, length: int, itemsize: int) -> int:
    """Attention state one sequence of ``length`` tokens reads in a decode step, over
    the layers: the window's K=V, CSA's indexer keys (all scored) and its top-k entries,
    HCA's entries."""
    total = 0
    for kind in cfg.layer_types:
        n = min(length, cfg.sliding_window) * cfg.head_dim
        if kind == CSA:
            e = _entries(cfg, CSA, length)
            n += e * cfg.index_head_dim + min(cfg.index_topk, e) * cfg.head_dim
        elif kind == HCA:
            n += _entries(cfg, HCA, length) * cfg.head_dim
        total += n * itemsize
    return total


def engram_row_bytes(cfg: Any, layout: Any, tokens: int) -> tuple[int, int]:
    """``(table bytes gathered, bf16 staged bytes)`` of a step of ``tokens`` over the
    Engram layers (an FP8 row: head_dim values + one scale byte per 32)."""
    hd = cfg.engram.head_dim
    rows = tokens * layout.n_hash_cols * layout.num_layers
    return rows * (hd + hd // 32), rows * hd * 2


def floor(bm: BenchModel, seq_lens: list[int], past: int, placement: str, limits: dict[str, float]) -> dict[str, Any]:
    """The step's floors (module docstring): bytes, their time at the HBM rate, the
    Engram rows over the link for host tables, FLOPs at the bf16 rate for a prefill."""
    cfg, model = bm.config, bm.model
    T, S = sum(seq_lens), len(seq_lens)
    decode = max(seq_lens) == 1
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    touched = min(1.0, 1 - (1 - k / E) ** T)  # expected share of a layer's experts T tokens reach
    weights = active = 0
    for name, nbytes, n in weight_tensors(model):
        if name.endswith("embed_tokens.weight"):
            p = model.model.embed_tokens.weight
            nbytes, n = T * p.shape[1] * p.element_size(), 0
        elif name.startswith("lm_head."):
            n *= S / T  # the head meets each sequence's last token only
        elif ".experts." in name:
            nbytes, n = nbytes * touched, n * k / E
        weights += nbytes
        active += n
    itemsize = model.compute_dtype.itemsize
    states = sum(state_bytes(cfg, past + n, itemsize) for n in seq_lens) if decode else 0
    table, staged = engram_row_bytes(cfg, bm.layout, T)
    hbm_bytes = weights + states + staged + (table if placement == "hbm" else 0)
    out: dict[str, Any] = {
        "weight_bytes": int(weights),
        "state_bytes": int(states),
        "engram_table_bytes": table,
        "engram_staged_bytes": staged,
        "hbm_bytes": int(hbm_bytes),
        "flops": int(2 * active * T + _attention_flops(cfg, seq_lens, past)),
    }
    if limits:
        out["hbm_ms"] = hbm_bytes / (limits["hbm_GBps"] * 1e9) * 1e3
        out["link_ms"] = table / (limits["h2d_GBps"] * 1e9) * 1e3 if placement == "pinned" else 0.0
        out["flop_ms"] = out["flops"] / (limits["bf16_TFLOPs"] * 1e12) * 1e3
        out["floor_ms"] = max(out["hbm_ms"], out["link_ms"], 0.0 if decode else out["flop_ms"])
    return out


def _attention_flops(cfg: Any, seq_lens: list[int], past: int) -> float:
    """QK^T and PV of every query against the keys it attends (window, entries), and the
    CSA indexer's scores over every entry; at most 64 positions of a sequence are
    summed, each standing for its share of the queries."""
    total = 0.0
    for n in seq_lens:
        stride = max(1, n // 64)
        for q in range(past, past + n, stride):
            for kind in cfg.layer_types:
                keys = min(q + 1, cfg.sliding_window)
                if kind == CSA:
                    e = _entries(cfg, CSA, q + 1)
                    keys += min(cfg.index_topk, e)
                    total += stride * 2 * cfg.index_n_heads * cfg.index_head_dim * e
                elif kind == HCA:
                    keys += _entries(cfg, HCA, q + 1)
                total += stride * 4 * cfg.num_attention_heads * cfg.head_dim * keys
    return total
