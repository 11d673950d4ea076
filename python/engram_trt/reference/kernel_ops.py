"""The Engram steps through the CUDA kernel library the TensorRT plugins call
(``libengram_trt_plugins.so``, via :mod:`engram_trt.kernels`): one kernel library, two
callers, so the GPU path without TensorRT runs the plugins' very kernels.

Tables the GPU can read in place (device memory, pinned / registered host memory) go
through the gather kernel; any other host memory (a file map, plain RAM) through the
host gather (CPU threads into pinned staging, then one copy per chunk).
"""

from __future__ import annotations

from typing import Any

import torch

from engram_trt.engram.layout import EngramLayout


class KernelEngramOps:
    """Hash, gather and gate of one model's layout on one CUDA device."""

    name = "cuda-kernels"

    def __init__(self, layout: EngramLayout, device: torch.device) -> None:
        from engram_trt import kernels

        kernels.load_library()
        kernels.check_layout(layout)
        self.kernels = kernels
        self.layout = layout
        self.device = device

    def hash(self, cids: torch.Tensor, seq_starts: torch.Tensor, lookback: torch.Tensor | None) -> torch.Tensor:
        """int32 ``[T, L, cols]`` row ids of packed compressed ids ``[T]`` (one launch)."""
        lb = None if lookback is None else lookback.to(device=self.device, dtype=torch.int32).contiguous()
        return self.kernels.hash_packed(cids.to(device=self.device, dtype=torch.int32).contiguous(),
                                        seq_starts.to(device=self.device, dtype=torch.int32).contiguous(), lb, self.layout)

    def rows(self, tables: Any, layer_idx: int, hash_ids: torch.Tensor) -> torch.Tensor:
        """bf16 ``[T, cols, head_dim]`` rows of one layer from ``hash_ids [T, L, cols]``."""
        T, L, cols = hash_ids.shape
        flat = hash_ids.to(torch.int32).contiguous()
        rows, scales = tables.tensors(layer_idx)
        if tables.gpu_readable:
            out = self.kernels.gather(flat.to(self.device), rows, scales, layer=layer_idx, quant_block=tables.quant_block)
        else:
            out = self.kernels.host_gather(flat.cpu(), rows, scales, layer=layer_idx, quant_block=tables.quant_block,
                                           device=self.device)
        return out.reshape(T, cols, rows.shape[1])

    def gate(self, hidden: torch.Tensor, kv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
             live: torch.Tensor, eps: float) -> torch.Tensor:
        return self.kernels.gate(hidden.contiguous(), kv.contiguous(), q_weight, k_weight, live.contiguous(), eps=eps)
