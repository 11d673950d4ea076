"""The GPU cases that a benchmark script times and a GPU test (tests/gpu) checks, built
in one place: the timed hash of ``benchmarks/kernels/bench_kernels.py`` (test_verify.py), the
fp8 tables its gathers read (test_verify.py) and those of ``benchmarks/lookup/bench_gathersweep.py``
/ ``bench_contention.py``, the attention shapes of ``benchmarks/kernels/bench_attention.py``
(test_attention.py), and the 1.15B model's decode variants of
``benchmarks/kernels/bench_backbone.py`` (test_backbone.py); ``rel_err``, which the GPU tests
share.

Why one module: a benchmark's figure is worth something only for the case the test
checked; two copies of a case drift apart. The tests import it as ``tests/gpu``'s own
module (``from .cases import ...``); a benchmark script puts tests/gpu on its path and
imports ``cases`` (the package imports neither). Torch is imported inside each function, so
importing this module (as a script's ``--help`` does) stays light.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from engram_trt.bench.step import StepOptions
from engram_trt.errors import EngramError


def require_cuda(command: str) -> Any:
    """The current CUDA device, or one line saying that ``bench <command>`` needs one."""
    import torch

    if not torch.cuda.is_available():
        raise EngramError(
            f"bench {command} needs a CUDA GPU (it times GPU kernels against bounds measured on it); "
            f"none is available here: run it on a GPU machine"
        )
    return torch.device("cuda", torch.cuda.current_device())


def rel_err(a: Any, ref: Any) -> float:
    """Relative L2 difference of two tensors, in float64 on the host (they may live on
    different devices: a GPU result against a CPU reference)."""
    a, ref = a.double().cpu(), ref.double().cpu()
    return float((a - ref).norm() / ref.norm())


# --- the hash of bench kernels: 8,192 tokens x 2 layers x 24 columns --------------------------------

HASH_TOKENS = 8192
HASH_SEQUENCES = (1, 32)  # one prefill sequence; 32 packed sequences


def hash_layout() -> Any:
    """The timed hash's layout: Engram on 2 layers, orders 2..3 x 12 heads (24 columns)."""
    from engram_trt.config.model import EngramSpec
    from engram_trt.engram.layout import EngramLayout

    spec = EngramSpec(
        layer_ids=(2, 15),
        max_ngram_size=3,
        n_heads=12,
        vocab_size=129280,
        compressed_vocab_size=99092,
        pad_token_id=0,
        head_dim=256,
    )
    layout = EngramLayout.from_spec(spec, pad_id=17)
    assert layout.num_layers * layout.n_hash_cols == 48
    return layout


@dataclass
class HashCase:
    """One timed hash call's inputs (NumPy for the reference, device tensors for the
    kernel) and its output buffer."""

    ids_np: Any
    starts_np: Any
    lookback_np: Any
    ids: Any
    starts: Any
    lookback: Any
    out: Any

    def reference(self, layout: Any) -> Any:
        from engram_trt.engram.hashing import hash_batch_packed

        return hash_batch_packed(self.ids_np, self.starts_np, self.lookback_np, layout)


def hash_case(rng: Any, layout: Any, sequences: int, device: Any, tokens: int = HASH_TOKENS) -> HashCase:
    """``tokens`` random compressed ids packed as ``sequences`` equal sequences, each with
    random lookback ids."""
    import numpy as np
    import torch

    ids_np = rng.integers(0, layout.compressed_vocab_size, size=tokens).astype(np.int64)
    starts_np = np.linspace(0, tokens, sequences + 1).astype(np.int64)
    lookback_np = rng.integers(0, layout.compressed_vocab_size, size=(sequences, layout.max_ngram_size - 1)).astype(
        np.int64
    )

    def dev(a: Any) -> Any:
        return torch.from_numpy(a.astype(np.int32)).to(device)

    out = torch.empty((tokens, layout.num_layers, layout.n_hash_cols), dtype=torch.int32, device=device)
    return HashCase(ids_np, starts_np, lookback_np, dev(ids_np), dev(starts_np), dev(lookback_np), out)


# --- fp8 tables --------------------------------------------------------------------------------------

HEAD_DIM, QUANT_BLOCK, COLS = 256, 32, 24
GATHER_ROWS = (6144, 196608)  # a decode step's and a prefill chunk's lookups (24 columns)


@dataclass
class Fp8Tables:
    """One random fp8 table (256-byte rows + 8 scale bytes) in HBM and, the same bytes, in
    pinned host memory: the gathers of ``bench kernels`` and their check."""

    rows_n: int
    dev_rows: Any
    dev_scales: Any
    host_rows: Any
    host_scales: Any


def fp8_tables(table_gib: float, device: Any) -> Fp8Tables:
    """``table_gib`` GiB of rows (no NaN codes; scales 2^-17..2^12), drawn on the GPU and
    copied to pinned memory."""
    import torch

    rows_n = int(table_gib * 2**30) // HEAD_DIM
    dev_rows = torch.randint(0, 256, (rows_n, HEAD_DIM), dtype=torch.uint8, device=device)
    dev_rows[(dev_rows & 0x7F) == 0x7F] = 0x3C
    dev_scales = torch.randint(110, 140, (rows_n, HEAD_DIM // QUANT_BLOCK), dtype=torch.uint8, device=device)
    host_rows = torch.empty((rows_n, HEAD_DIM), dtype=torch.uint8, pin_memory=True)
    host_scales = torch.empty((rows_n, HEAD_DIM // QUANT_BLOCK), dtype=torch.uint8, pin_memory=True)
    host_rows.copy_(dev_rows)
    host_scales.copy_(dev_scales)
    torch.cuda.synchronize(device)
    return Fp8Tables(rows_n, dev_rows, dev_scales, host_rows, host_scales)


def pinned_fp8_table(num_rows: int) -> tuple[Any, Any]:
    """A split fp8 table in pinned (cudaHostAlloc) memory only, fast to fill: a random
    64 MiB block tiled over the rows (no NaN codes: bytes < 120), every scale 2^0 (the
    host gather's timings of ``bench gathersweep`` and ``bench contention``)."""
    import torch

    rows = torch.empty((num_rows, HEAD_DIM), dtype=torch.uint8, pin_memory=True)
    scales = torch.empty((num_rows, HEAD_DIM // QUANT_BLOCK), dtype=torch.uint8, pin_memory=True)
    block = torch.randint(0, 120, (1 << 26,), dtype=torch.uint8)
    flat = rows.view(-1)
    for a in range(0, flat.numel(), block.numel()):
        n = min(block.numel(), flat.numel() - a)
        flat[a : a + n].copy_(block[:n])
    scales.fill_(127)
    return rows, scales


def gather_bytes(n_rows: int) -> int:
    """Bytes a gather of ``n_rows`` fp8 rows moves over the link (rows + scales)."""
    return n_rows * (HEAD_DIM + HEAD_DIM // QUANT_BLOCK)


# --- attention: bench attention's shapes -------------------------------------------------------------

# label -> (sequences, context, new tokens per sequence); bf16, 32 query / 8 KV heads of 128
ATTENTION_CASES: dict[str, tuple[int, int, int]] = {
    "decode 1 x 4k": (1, 4096, 1),
    "decode 64 x 256": (64, 256, 1),
    "decode 64 x 4k": (64, 4096, 1),
    "decode 256 x 4k": (256, 4096, 1),
    "prefill 1 x 8k chunk": (1, 8192, 8192),
}
ATTENTION_HEADS, ATTENTION_KV_HEADS, ATTENTION_HEAD_DIM = 32, 8, 128


@dataclass
class AttentionCase:
    """``batch`` sequences, each bringing ``new`` tokens at the end of a ``context``-long
    history in its own cache slot (slot = batch row, the new K/V already in the cache)."""

    batch: int
    context: int
    new: int
    q: Any
    k: Any
    v: Any
    kc: Any
    vc: Any
    slots: Any
    pos: Any
    scale: float

    @property
    def kv_bytes(self) -> int:
        """Bytes of K/V the step reads once: every slot's whole history at decode, one
        sequence's at prefill."""
        per = 2 * ATTENTION_KV_HEADS * self.context * ATTENTION_HEAD_DIM * 2
        return per * (self.batch if self.new == 1 else 1)

    @property
    def flops(self) -> float:
        H, hd = ATTENTION_HEADS, ATTENTION_HEAD_DIM
        return 4 * H * hd * (self.batch * self.context if self.new == 1 else self.context * (self.context + 1) / 2)

    def sdpa(self) -> Any:
        """torch's scaled_dot_product_attention on the same cache (padded [B, H, S, hd],
        enable_gqa), as [T, H, hd]: the reference and the baseline."""
        import torch.nn.functional as F

        H, hd = ATTENTION_HEADS, ATTENTION_HEAD_DIM
        qs = self.q.view(self.batch, self.new, H, hd).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            qs, self.kc, self.vc, scale=self.scale, is_causal=self.new > 1, enable_gqa=True
        )
        return out.transpose(1, 2).reshape(self.batch * self.new, H, hd)


def attention_case(batch: int, context: int, new: int, device: Any) -> AttentionCase:
    import torch

    H, kvh, hd = ATTENTION_HEADS, ATTENTION_KV_HEADS, ATTENTION_HEAD_DIM
    bf16 = torch.bfloat16
    T = batch * new
    kc = torch.randn(batch, kvh, context, hd, dtype=bf16, device=device)
    vc = torch.randn(batch, kvh, context, hd, dtype=bf16, device=device)
    q = torch.randn(T, H, hd, dtype=bf16, device=device)
    k = torch.randn(T, kvh, hd, dtype=bf16, device=device)
    v = torch.randn(T, kvh, hd, dtype=bf16, device=device)
    slots = torch.arange(batch, dtype=torch.int32, device=device).repeat_interleave(new)
    pos = (context - new + torch.arange(new, dtype=torch.int32, device=device)).repeat(batch)
    return AttentionCase(batch, context, new, q, k, v, kc, vc, slots, pos, hd**-0.5)


# --- the 1.15B model's decode variants: bench backbone ------------------------------------------------

MODEL_OPTIONS = StepOptions(model="1b", table_gib=0.25, prefill=0, context=256)  # engram-trt bench step's 1B shape


def build_model(device: Any) -> tuple[Any, Any, dict]:
    """The bench's 1.15B model (random bf16 weights, fused at load on the GPU) with its
    tables in GPU memory: (model, layout, info)."""
    from engram_trt.bench.step import build
    from engram_trt.tables.base import DeviceTables

    model, layout, tables, info = build(MODEL_OPTIONS, device)
    model.set_tables(DeviceTables([(r.to(device), s.to(device)) for r, s in tables], model.config.engram.quant_block))
    return model, layout, info


def variant_settings(name: str) -> contextlib.AbstractContextManager:
    """What a decode variant changes while its graph is recorded (at its first run),
    undone after: "... over copies": the graphs' attention reads the KV cache in place
    only past IN_PLACE_DECODE_BYTES, not wherever the warp kernel serves (SDPA over copies
    of the slots' K/V below it); "fused, GEMM library": the projections run in the GEMM
    library at every step size (the GEMV off); "fused, no PDL": the kernel library
    launches the ordinary way (ENGRAM_TRT_PDL=0, read at each launch); "fused, tiled
    attention": the tiled attention kernel (ENGRAM_TRT_ATTENTION_KERNEL=tiled) where the
    graphs read the cache in place. Any other name changes nothing."""
    import os
    from unittest import mock

    from engram_trt.models.engram_llama import modules
    from engram_trt.models.engram_llama.kernel_ops import KernelBackboneOps

    if name.endswith("over copies"):
        return mock.patch.object(modules, "IN_PLACE_WITH_WARP_KERNEL", False)
    if name == "fused, GEMM library":
        return mock.patch.object(KernelBackboneOps, "gemv_max_tokens", 0)
    if name == "fused, no PDL":
        return mock.patch.dict(os.environ, {"ENGRAM_TRT_PDL": "0"})
    if name == "fused, tiled attention":
        return mock.patch.dict(os.environ, {"ENGRAM_TRT_ATTENTION_KERNEL": "tiled"})
    return contextlib.nullcontext()


def decode_variants(model: Any, batch: int, past: int) -> list[tuple[str, Any]]:
    """(name, backbone ops) of each decode variant at this batch: unfused, fused, the GEMM
    library's projections (where the GEMV serves this batch), no dependent launches, and
    SDPA over copies of the cache (where the graphs read it in place because the warp
    kernel serves) or else the tiled attention kernel."""
    from engram_trt.models.engram_llama import modules

    cfg, kernels = model.config, model.backbone_ops
    variants: list[tuple[str, Any]] = [("unfused", None), ("fused", kernels)]
    if kernels is not None and batch <= kernels.gemv_max_tokens:
        variants.append(("fused, GEMM library", kernels))
    variants.append(("fused, no PDL", kernels))
    kv_layer_bytes = batch * cfg.num_key_value_heads * (past + 1) * cfg.head_dim * 2
    if kv_layer_bytes <= modules.IN_PLACE_DECODE_BYTES:
        variants.append(("fused, SDPA over copies", kernels))
    else:
        variants.append(("fused, tiled attention", kernels))
    return variants


def decode_case(model: Any, batch: int, past: int, rng: Any) -> tuple[Any, Any]:
    """A KV cache of ``batch`` sequences (+ the graphs' scratch slot) holding ``past``
    random tokens each, and one decode step of a random token per sequence."""
    import torch

    from engram_trt.models.step import PackedStep

    cache = model.new_cache(batch + 1, past + 2)
    for k, v in zip(cache.keys, cache.values):
        k.normal_(0, 1), v.normal_(0, 1)
    ids = rng.integers(2, model.config.vocab_size, size=batch)
    return cache, PackedStep(torch.from_numpy(ids), [1] * batch, [past] * batch, list(range(batch)))


def decode_step(model: Any, graphs: Any, cache: Any, step: Any, batch: int, past: int) -> Any:
    """One decode step as the runtime runs it: replayed from ``graphs`` (a DecodeGraphs;
    eager where it declines), every slot reset to ``past`` first, the sampler's one read
    of the argmax; returns the logits (a graph's output buffer: the next replay overwrites
    it)."""
    import torch

    def one() -> Any:
        for s in range(batch):
            cache.lengths[s] = past
        logits = graphs.run(step, None)
        if logits is None:
            logits = model.forward_step(step, cache)
        torch.argmax(logits, dim=-1).tolist()
        return logits

    return one
