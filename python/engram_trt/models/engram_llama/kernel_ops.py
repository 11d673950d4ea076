"""The Engram steps, and the decoder layers' elementwise steps, through the CUDA kernel
library the TensorRT plugins call (``libengram_trt_plugins.so``, via
:mod:`engram_trt.native.hash`, :mod:`~engram_trt.native.gather`, :mod:`~engram_trt.native.gate`):
one kernel library, two callers, so the GPU path without
TensorRT runs the plugins' very kernels.

Tables the GPU can read in place (device memory, pinned / registered host memory) go
through the gather kernel; any other host memory (a file map, plain RAM) through the
host gather (CPU threads into pinned staging, then one copy per chunk).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F

from engram_trt.engram.layout import EngramLayout
from engram_trt.errors import EngramError

log = logging.getLogger(__name__)


class KernelEngramOps:
    """Hash, gather and gate of one model's layout on one CUDA device."""

    name = "cuda-kernels"

    def __init__(self, layout: EngramLayout, device: torch.device) -> None:
        from engram_trt.native import gate as gate_kernels
        from engram_trt.native import gather as gather_kernels
        from engram_trt.native import hash as hash_kernels
        from engram_trt.native import hostgather

        hash_kernels.library()
        hash_kernels.check_layout(layout)
        self.hash_kernels, self.gather_kernels, self.gate_kernels = hash_kernels, gather_kernels, gate_kernels
        self.hostgather = hostgather
        self.layout = layout
        self.device = device

    def hash(self, cids: torch.Tensor, seq_starts: torch.Tensor, lookback: torch.Tensor | None) -> torch.Tensor:
        """int32 ``[T, L, cols]`` row ids of packed compressed ids ``[T]`` (one launch)."""
        lb = None if lookback is None else lookback.to(device=self.device, dtype=torch.int32).contiguous()
        return self.hash_kernels.hash_packed(
            cids.to(device=self.device, dtype=torch.int32).contiguous(),
            seq_starts.to(device=self.device, dtype=torch.int32).contiguous(),
            lb,
            self.layout,
        )

    def rows(self, tables: Any, layer_idx: int, hash_ids: torch.Tensor) -> torch.Tensor:
        """bf16 ``[T, cols, head_dim]`` rows of one layer from ``hash_ids [T, L, cols]``."""
        T, L, cols = hash_ids.shape
        flat = hash_ids.to(torch.int32).contiguous()
        rows, scales = tables.tensors(layer_idx)
        if tables.gpu_readable:
            out = self.gather_kernels.gather(
                flat.to(self.device), rows, scales, layer=layer_idx, quant_block=tables.quant_block
            )
        else:
            out = self.hostgather.host_gather(
                flat.cpu(), rows, scales, layer=layer_idx, quant_block=tables.quant_block, device=self.device
            )
        return out.reshape(T, cols, rows.shape[1])

    def gate(
        self,
        hidden: torch.Tensor,
        kv: torch.Tensor,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        live: torch.Tensor,
        eps: float,
    ) -> torch.Tensor:
        return self.gate_kernels.gate(
            hidden.contiguous(), kv.contiguous(), q_weight, k_weight, live.contiguous(), eps=eps
        )


class TorchBackboneOps:
    """The fused decoder path's elementwise steps in PyTorch ops: what
    :class:`KernelBackboneOps` computes, op for op (its kernels round where these bf16 ops
    round). The model's fused path (``EngramLlama.step_layers`` with ``backbone_ops``)
    runs on either; this one lets a CPU check that path's plumbing (stacked GEMMs split
    right, the residual carried into the next norm) and is the GPU checks' reference."""

    name = "torch"

    def norm(self, hs: torch.Tensor, residual: torch.Tensor | None, norm: Any) -> torch.Tensor:
        """``norm(hs.mean(dim=1))`` after ``hs += residual.unsqueeze(1)`` (in place)."""
        if residual is not None:
            hs.add_(residual.unsqueeze(1))
        return norm(hs.mean(dim=1))

    def rope_kv_write(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        plan: Any,
        keys: torch.Tensor,
        values: torch.Tensor,
        n_heads: int,
        n_kv: int,
        head_dim: int,
    ) -> torch.Tensor:
        """Rotated q ``[T, H, hd]`` of a fused projection; its K/V into the cache."""
        from engram_trt.models.engram_llama.modules import rope_and_write

        T = qkv.shape[0]
        q, k, v = qkv.split([n_heads * head_dim, n_kv * head_dim, n_kv * head_dim], dim=-1)
        return rope_and_write(
            q.reshape(T, n_heads, head_dim),
            k.reshape(T, n_kv, head_dim),
            v.reshape(T, n_kv, head_dim),
            cos,
            sin,
            plan,
            keys,
            values,
        )

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def linear(self, x: torch.Tensor, weight: Any) -> torch.Tensor:
        """A layer's projection (no bias); an FP8 weight (a QuantWeight) in its stored
        form through :func:`engram_trt.quant.weight.quant_linear`."""
        from engram_trt.quant.weight import QuantWeight, quant_linear

        if isinstance(weight, QuantWeight):
            return quant_linear(x, weight)
        return F.linear(x, weight)


class KernelBackboneOps:
    """The fused decoder path's elementwise steps through the kernel library, one launch
    each: hc-mean RMSNorm with the residual update, RoPE + KV write, SiLU * up (bf16); and
    a layer's projections for steps of up to ``gemv_max_tokens`` tokens (a decode step of
    a few sequences), where the GEMM library's small-M kernels read the weights well
    below the HBM rate; larger steps keep the GEMM library."""

    name = "cuda-kernels"
    #: Steps of at most this many tokens run their projections in the library's GEMV
    #: (0: never; at most backbone_kernels.GEMV_MAX_TOKENS). A class attribute so that a
    #: benchmark can time the same model with the GEMM library alone.
    gemv_max_tokens = 2

    def __init__(self) -> None:
        from engram_trt.native import attention as attention_kernels
        from engram_trt.native import backbone as backbone_kernels

        backbone_kernels.load()
        attention_kernels.library()
        self.attention = attention_kernels
        self.backbone = backbone_kernels

    def norm(self, hs: torch.Tensor, residual: torch.Tensor | None, norm: Any) -> torch.Tensor:
        return self.backbone.hc_rms_norm(hs, norm.weight, norm.eps, residual)

    def rope_kv_write(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        plan: Any,
        keys: torch.Tensor,
        values: torch.Tensor,
        n_heads: int,
        n_kv: int,
        head_dim: int,
    ) -> torch.Tensor:
        slots, positions = plan.index32()
        return self.attention.rope_kv_cache_write(qkv, cos, sin, keys, values, slots, positions, n_heads)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.backbone.silu_mul(gate_up)

    def linear(self, x: torch.Tensor, weight: Any) -> torch.Tensor:
        """A layer's projection: an FP8 weight (a QuantWeight) through the kernel library's
        FP8 products (:func:`engram_trt.quant.weight.quant_linear`); a bf16 one through the
        library's GEMV for a few tokens, else the GEMM library."""
        from engram_trt.quant.weight import QuantWeight, quant_linear

        if isinstance(weight, QuantWeight):
            return quant_linear(x, weight)
        if x.dim() == 2 and x.shape[0] <= self.gemv_max_tokens and self.backbone.gemv_fits(x, weight):
            return self.backbone.gemv(x, weight, weight_static=True)  # a layer's weight: never written in a step
        return F.linear(x, weight)


BACKBONE_BACKENDS = ("auto", "torch", "kernels")


def select_backbone_ops(
    backend: str, device: torch.device, dtype: torch.dtype, fused: bool
) -> KernelBackboneOps | None:
    """The decoder layers' ops: ``auto``: the kernel library on a CUDA device in bf16 with
    fused projections when it loads, else None (the modules' PyTorch ops); ``kernels``:
    the kernel library or a clear error; ``torch``: None. Logs the choice (once per model)."""
    if backend not in BACKBONE_BACKENDS:
        raise EngramError(f"backbone_backend {backend!r} is not one of {list(BACKBONE_BACKENDS)}")
    ops = None
    usable = device.type == "cuda" and dtype == torch.bfloat16 and fused
    if backend == "kernels" and not usable:
        raise EngramError(
            f"backbone_backend 'kernels' runs on a CUDA device in bfloat16 with fused projections "
            f"(got {device}, {dtype}, fuse_projections={fused}); use 'torch' or 'auto'"
        )
    if backend != "torch" and usable:
        try:
            ops = KernelBackboneOps()
        except EngramError as exc:
            if backend == "kernels":
                raise
            log.warning("decoder-layer CUDA kernels unavailable (%s); using the PyTorch ops", exc)
    if ops is not None:
        log.info(
            "decoder layers: fused q/k/v and gate/up GEMMs (the kernel library's GEMV up to %d tokens); "
            "norms, RoPE + KV write and SiLU in the kernel library (%s, %s)",
            ops.gemv_max_tokens,
            device,
            dtype,
        )
    else:
        log.info("decoder layers: PyTorch ops (%s, %s%s)", device, dtype, ", fused projections" if fused else "")
    return ops
