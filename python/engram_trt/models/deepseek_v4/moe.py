"""DeepSeek-V4's MoE without the per-expert Python loop: :class:`GroupedSparseMoE` is
:class:`~.modules.SparseMoE` (same routers, experts, parameter names and shared expert)
whose routed experts run in one of four forms.

* ``loop``: the published grouping, one GEMM chain per expert some token picked; its
  token counts are read on the host (a synchronization per layer). The CPU's form and
  the reference of the others.
* ``gathered``: each (token, pick) pair's expert weights gathered, batched
  matrix-vector products: only the picked experts' weights are read (a decode step of
  a few tokens against many experts).
* ``dense``: every expert on every token, the outputs scaled by the routing weight (0
  where not picked): every expert's weights read once, ``E / top_k`` times the picked
  arithmetic; good while a step is small.
* ``grouped``: the pairs sorted by expert and run through ``torch._grouped_mm`` with
  the per-expert offsets computed on the device: the picked arithmetic only, no host
  read (a prefill chunk).

``form = "auto"`` takes ``loop`` on a CPU and on CUDA the sync-free one that fits:
``gathered`` when the pairs are fewer than half the experts, else ``grouped`` where
``torch._grouped_mm`` serves (bf16, sm90+, widths multiples of 8), else ``dense`` for a
small step, else ``loop``. Every form equals ``loop`` within the dtype's round-off (the
sums over a token's experts are taken in another order).

The forms read the experts' weights stacked (``gate`` / ``up [E, I, D]``, ``down
[E, D, I]``); :meth:`GroupedSparseMoE.stack_experts` makes each expert's parameters views
of the stacks (no second copy; the loop reads the very same values). It runs on the
first forward that needs it, and again if the parameters were replaced since.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engram_trt.errors import EngramError
from engram_trt.models.deepseek_v4.modules import SparseMoE

MOE_FORMS = ("auto", "loop", "gathered", "dense", "grouped")
DENSE_MAX_TOKEN_EXPERTS = 8192  # auto's dense form up to T * E of this (a few times the picked arithmetic)


def _clamped_swiglu(g: torch.Tensor, u: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(g.clamp(max=limit)) * u.clamp(min=-limit, max=limit)


class GroupedSparseMoE(SparseMoE):
    """See the module docstring. ``form``: a class default, settable per module."""

    form: str = "auto"

    def __init__(self, config: Any, layer: int) -> None:
        super().__init__(config, layer)
        self._stacked: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.last_form: str | None = None  # the form the last forward took (for labels and tests)

    # -- the stacked weights ------------------------------------------------------------
    def _stack_current(self) -> bool:
        if self._stacked is None:
            return False
        gate, up, down = self._stacked
        for i in (0, len(self.experts) - 1):
            e = self.experts[i]
            if (e.gate_proj.weight.data_ptr() != gate[i].data_ptr() or e.up_proj.weight.data_ptr() != up[i].data_ptr()
                    or e.down_proj.weight.data_ptr() != down[i].data_ptr()):
                return False
        return True

    def stack_experts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(gate [E, I, D], up [E, I, D], down [E, D, I])``; each expert's weights become
        views of them (see the module docstring)."""
        if self._stack_current():
            return self._stacked  # type: ignore[return-value]
        with torch.no_grad():
            gate = torch.stack([e.gate_proj.weight.detach() for e in self.experts])
            up = torch.stack([e.up_proj.weight.detach() for e in self.experts])
            down = torch.stack([e.down_proj.weight.detach() for e in self.experts])
        for i, e in enumerate(self.experts):
            e.gate_proj.weight = nn.Parameter(gate[i], requires_grad=False)
            e.up_proj.weight = nn.Parameter(up[i], requires_grad=False)
            e.down_proj.weight = nn.Parameter(down[i], requires_grad=False)
        self._stacked = (gate, up, down)
        return self._stacked

    # -- the forms ----------------------------------------------------------------------
    def experts_loop(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The published grouping (one host read of the expert counts)."""
        k = ids.shape[1]
        out = torch.zeros_like(x)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        token_of = order // k
        w = weights.reshape(-1)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            sel, tok = order[start:start + n], token_of[start:start + n]
            start += n
            y = self.experts[e](x[tok]) * w[sel].unsqueeze(-1).to(x.dtype)
            out.index_add_(0, tok, y.to(out.dtype))
        return out

    def experts_gathered(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each pair's expert weights gathered, batched matrix-vector products."""
        gate, up, down = self.stack_experts()
        T, k = ids.shape
        flat = ids.reshape(-1)
        xs = x.repeat_interleave(k, dim=0).unsqueeze(-1)  # [P, D, 1]
        g = torch.bmm(gate.index_select(0, flat), xs)  # [P, I, 1]
        u = torch.bmm(up.index_select(0, flat), xs)
        h = _clamped_swiglu(g, u, self.experts[0].limit)
        y = torch.bmm(down.index_select(0, flat), h).squeeze(-1)  # [P, D]
        y = y * weights.reshape(-1, 1).to(x.dtype)
        return y.reshape(T, k, -1).sum(dim=1)

    def experts_dense(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Every expert on every token, weighted by the routing matrix (0 where not picked)."""
        gate, up, down = self.stack_experts()
        E, inter, D = gate.shape
        T = x.shape[0]
        g = F.linear(x, gate.reshape(E * inter, D)).reshape(T, E, inter)
        u = F.linear(x, up.reshape(E * inter, D)).reshape(T, E, inter)
        # scatter_add_: a repeated pick (a hash table may name one expert twice) adds, as in the loop
        route = torch.zeros(T, E, dtype=weights.dtype, device=weights.device).scatter_add_(1, ids, weights)
        h = _clamped_swiglu(g, u, self.experts[0].limit) * route.unsqueeze(-1).to(x.dtype)
        return torch.bmm(h.transpose(0, 1), down.transpose(1, 2)).sum(dim=0)  # [E, T, D] -> [T, D]

    def experts_grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The pairs sorted by expert through ``torch._grouped_mm`` (device offsets)."""
        gate, up, down = self.stack_experts()
        k = ids.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tok = order // k
        offs = torch.cumsum(torch.bincount(flat, minlength=len(self.experts)), 0).to(torch.int32)
        xs = x.index_select(0, tok)
        g = torch._grouped_mm(xs, gate.transpose(1, 2), offs=offs)  # [P, I]
        u = torch._grouped_mm(xs, up.transpose(1, 2), offs=offs)
        h = _clamped_swiglu(g, u, self.experts[0].limit)
        y = torch._grouped_mm(h, down.transpose(1, 2), offs=offs)  # [P, D]
        y = y * weights.reshape(-1)[order].unsqueeze(-1).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, tok, y.to(x.dtype))

    def grouped_serves(self, x: torch.Tensor) -> bool:
        """Whether ``torch._grouped_mm`` takes these activations (CUDA: bf16 on sm90+)."""
        if not hasattr(torch, "_grouped_mm"):
            return False
        gate = self.experts[0].gate_proj.weight
        if x.shape[1] % 8 or gate.shape[0] % 8 or gate.dtype != x.dtype:
            return False
        if not x.is_cuda:
            return True  # the CPU's reference implementation takes any float dtype
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] >= 9

    def choose_form(self, x: torch.Tensor, ids: torch.Tensor) -> str:
        """The form ``forward`` takes for activations ``x`` routed to ``ids`` (see the module docstring)."""
        form = self.form
        if form not in MOE_FORMS:
            raise EngramError(f"GroupedSparseMoE.form {form!r} is not one of {list(MOE_FORMS)}")
        if form != "auto":
            return form
        if not x.is_cuda:
            return "loop"
        if 2 * ids.numel() < len(self.experts):
            return "gathered"
        if self.grouped_serves(x):
            return "grouped"
        if x.shape[0] * len(self.experts) <= DENSE_MAX_TOKEN_EXPERTS:
            return "dense"
        return "loop"

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x, input_ids)
        form = self.last_form = self.choose_form(x, ids)
        routed = getattr(self, f"experts_{form}")(x, weights, ids)
        return routed + self.shared_experts(x)


__all__ = ["DENSE_MAX_TOKEN_EXPERTS", "GroupedSparseMoE", "MOE_FORMS"]
