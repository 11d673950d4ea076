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

* ``kernels``: the kernel library's routed-expert product
  (:func:`engram_trt.native.quant.experts`: the plan of the step's pairs made on the
  device, grouped GEMV / GEMM over the stacked experts in their stored format, FP8, FP4
  or BF16, the clamped SwiGLU between; no host read, CUDA-graph capturable). The form
  for a checkpoint whose experts are stored FP8 / FP4, and the decode step's grouped GEMV
  for a BF16 one.

``form = "auto"`` takes the fused decode MoE on a bf16 GPU step of up to four tokens
(:func:`.fused.moe`: the router's picks in one kernel, bf16 experts with the shared expert
in two, stored-format ones through ``kernels``; ``last_form`` says ``fused``), else
``loop`` on a CPU and on CUDA ``kernels`` where the library
serves the call (:meth:`GroupedSparseMoE.kernels_unavailable`); otherwise, for float
experts, the sync-free one that fits: ``gathered`` when the pairs are fewer than half the
experts, else ``grouped`` where ``torch._grouped_mm`` serves (bf16, sm90+, widths
multiples of 8), else ``dense`` for a small step, else ``loop`` (the only other form
that takes quantized experts: each expert's QuantLinear dequantizes its one weight on a
CPU). Every form equals ``loop`` within the dtype's round-off (the sums over a token's
experts are taken in another order; ``kernels`` also quantizes the activations as the
published FP8 inference does, docs/quantization.md).

The forms read the experts' weights stacked (``gate`` / ``up [E, I, D]``, ``down
[E, D, I]``: float tensors, or QuantWeights of the stored bytes and scales);
:meth:`GroupedSparseMoE.allocate_stacks` makes the stacks before a checkpoint is loaded,
each expert's tensors views of them, so the loader fills them in place (no second copy;
the loop reads the very same values). :meth:`GroupedSparseMoE.stack_experts` returns
them, stacking (and re-viewing) a model built another way on the first forward that
needs it, and again if the parameters were replaced since.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engram_trt.errors import EngramError
from engram_trt.models.deepseek_v4.modules import SparseMoE
from engram_trt.quant.weight import QuantLinear, QuantWeight

MOE_FORMS = ("auto", "loop", "gathered", "dense", "grouped", "kernels")
FLOAT_FORMS = ("gathered", "dense", "grouped")  # forms that read float stacks
_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
DENSE_MAX_TOKEN_EXPERTS = 8192  # auto's dense form up to T * E of this (a few times the picked arithmetic)


def _clamped_swiglu(g: torch.Tensor, u: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(g.clamp(max=limit)) * u.clamp(min=-limit, max=limit)


class GroupedSparseMoE(SparseMoE):
    """See the module docstring. ``form``: a class default, settable per module."""

    form: str = "auto"
    # A tensor-parallel rank's routed experts: (first global id, count) of the experts it
    # holds (.parallel.shard_modules); None: all of them.
    expert_range: tuple[int, int] | None = None

    def __init__(self, config: Any, layer: int) -> None:
        super().__init__(config, layer)
        self.layer_index = layer
        self._stacked: tuple[Any, Any, Any] | None = None
        self._kernels_why: dict[tuple[Any, ...], str | None] = {}
        self.last_form: str | None = None  # the form the last forward took (for labels and tests)

    # -- the stacked weights ------------------------------------------------------------
    @property
    def quantized_experts(self) -> bool:
        """Whether the routed experts are stored FP8 / FP4 (QuantLinear projections)."""
        return isinstance(self.experts[0].gate_proj, QuantLinear)

    @staticmethod
    def _data(stack: Any) -> torch.Tensor:
        return stack.data if isinstance(stack, QuantWeight) else stack

    def _stack_current(self) -> bool:
        if self._stacked is None:
            return False
        for proj, stack in zip(_PROJECTIONS, self._stacked):
            data = self._data(stack)
            for i in (0, len(self.experts) - 1):
                w = getattr(self.experts[i], proj).weight
                if w.is_meta or w.data_ptr() != data[i].data_ptr():
                    return False
        return True

    def _view(self, proj: str, stack: Any) -> None:
        """Each expert's ``proj`` tensors become views of ``stack`` (row ``i``: expert ``i``)."""
        for i, e in enumerate(self.experts):
            mod = getattr(e, proj)
            if isinstance(stack, QuantWeight):
                mod._buffers["weight"] = stack.data[i]
                mod._buffers["weight_scale_inv"] = stack.scale[i]
            else:
                mod.weight = nn.Parameter(stack[i], requires_grad=False)

    def allocate_stacks(self, device: Any, dtype: torch.dtype) -> None:
        """Before loading (the experts built on the meta device, their quantized ones
        swapped in): allocate each projection's stack on ``device`` (a float one in
        ``dtype``, a quantized one in its stored dtypes) and make the experts' tensors
        views of it, for :func:`.weights.load_into` to fill in place. A projection whose
        experts differ in kind is left to :meth:`stack_experts`."""
        stacks = []
        E = len(self.experts)
        for proj in _PROJECTIONS:
            mods = [getattr(e, proj) for e in self.experts]
            first = mods[0]
            if isinstance(first, QuantLinear):
                if any(
                    not isinstance(m, QuantLinear)
                    or m.kind != first.kind
                    or m.weight.dtype != first.weight.dtype
                    or m.weight_scale_inv.dtype != first.weight_scale_inv.dtype
                    for m in mods
                ):
                    return
                stack: Any = QuantWeight(
                    torch.empty((E, *first.weight.shape), dtype=first.weight.dtype, device=device),
                    torch.empty((E, *first.weight_scale_inv.shape), dtype=first.weight_scale_inv.dtype, device=device),
                    first.kind,
                    first.block,
                )
            else:
                if any(isinstance(m, QuantLinear) for m in mods):
                    return
                stack = torch.empty((E, *first.weight.shape), dtype=dtype, device=device)
            stacks.append(stack)
        for proj, stack in zip(_PROJECTIONS, stacks):
            self._view(proj, stack)
        self._stacked = (stacks[0], stacks[1], stacks[2])

    def stack_experts(self) -> tuple[Any, Any, Any]:
        """``(gate [E, I, D], up [E, I, D], down [E, D, I])`` (float tensors or QuantWeights);
        each expert's tensors become views of them (see the module docstring)."""
        if self._stack_current():
            return self._stacked  # type: ignore[return-value]
        stacks = []
        with torch.no_grad():
            for proj in _PROJECTIONS:
                mods = [getattr(e, proj) for e in self.experts]
                if isinstance(mods[0], QuantLinear):
                    first = mods[0]
                    if any(
                        not isinstance(m, QuantLinear)
                        or m.kind != first.kind
                        or m.block != first.block
                        or m.weight_scale_inv.dtype != first.weight_scale_inv.dtype
                        for m in mods
                    ):
                        raise EngramError(
                            f"layer {self.layer_index}'s routed experts' {proj} are stored in mixed "
                            f"formats; engram-trt stacks one layer's experts in one format"
                        )
                    stack: Any = QuantWeight(
                        torch.stack([m.weight for m in mods]),
                        torch.stack([m.weight_scale_inv for m in mods]),
                        first.kind,
                        first.block,
                    )
                else:
                    stack = torch.stack([m.weight.detach() for m in mods])
                stacks.append(stack)
        for proj, stack in zip(_PROJECTIONS, stacks):
            self._view(proj, stack)
        self._stacked = (stacks[0], stacks[1], stacks[2])
        self._kernels_why.clear()
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
            sel, tok = order[start : start + n], token_of[start : start + n]
            start += n
            y = self.experts[e](x[tok]) * w[sel].unsqueeze(-1).to(x.dtype)
            out.index_add_(0, tok, y.to(out.dtype))
        return out

    def experts_gathered(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each pair's expert weights gathered, batched matrix-vector products."""
        gate, up, down = self._float_stacks("gathered")
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
        gate, up, down = self._float_stacks("dense")
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
        gate, up, down = self._float_stacks("grouped")
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

    def _float_stacks(self, form: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        stacks = self.stack_experts()
        if any(isinstance(st, QuantWeight) for st in stacks):
            kinds = "/".join(sorted({st.kind for st in stacks if isinstance(st, QuantWeight)}))
            raise EngramError(
                f"MoE form {form!r} reads float expert weights, but layer {self.layer_index}'s experts "
                f"are stored {kinds}; use form 'auto', 'loop' or 'kernels'"
            )
        return stacks  # type: ignore[return-value]

    def kernels_unavailable(self, x: torch.Tensor) -> str | None:
        """Why :func:`engram_trt.native.quant.experts` cannot take this layer's experts for
        activations like ``x [T, D]`` (None: it can), asked of the library once per dtype,
        device and product kind (the few-row GEMV of a decode step, the GEMMs of a prefill)."""
        try:
            from engram_trt.native import quant as native_quant
        except ImportError as exc:
            return f"the kernel library's quantized products are not in this build ({exc})"
        stacks = self.stack_experts()
        T = int(x.shape[0]) if x.dim() == 2 else 1
        key = (x.dtype, x.device, T <= 8, tuple(id(self._data(st)) for st in stacks))
        if key not in self._kernels_why:
            probe_ids = torch.empty((T, self.gate.top_k), dtype=torch.int64, device="meta")  # only its size is read
            why = native_quant.unavailable_for_experts(x, probe_ids, *stacks)
            self._kernels_why[key] = why
        return self._kernels_why[key]

    def experts_kernels(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The kernel library's routed-expert product over the stacks (module docstring)."""
        why = self.kernels_unavailable(x)
        if why is not None:
            raise EngramError(
                f"MoE form 'kernels' cannot run layer {self.layer_index}: {why}; use form 'auto' or 'loop'"
            )
        from engram_trt.native import quant as native_quant

        gate, up, down = self.stack_experts()
        return native_quant.experts(x, ids, weights.float(), gate, up, down, limit=self.experts[0].limit)

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
        if self.kernels_unavailable(x) is None:
            return "kernels"
        if self.quantized_experts:
            return "loop"
        if 2 * ids.numel() < len(self.experts):
            return "gathered"
        if self.grouped_serves(x):
            return "grouped"
        if x.shape[0] * len(self.experts) <= DENSE_MAX_TOKEN_EXPERTS:
            return "dense"
        return "loop"

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """The routed experts' and the shared expert's sum (a TP rank: its experts' and its
        shared-expert channels' share; the model all-reduces it)."""
        if self.form == "auto" and self.expert_range is None:  # the fused kernels take the whole expert set
            from engram_trt.models.deepseek_v4 import fused

            if fused.unavailable(x) is None:
                out = fused.moe(self, x, input_ids)
                if out is not None:
                    self.last_form = "fused"
                    return out
        weights, ids = self.gate(x, input_ids)
        if self.expert_range is not None:
            from engram_trt.models.parallel import localize_experts

            ids, weights = localize_experts(ids, weights, *self.expert_range)
        form = self.last_form = self.choose_form(x, ids)
        routed = getattr(self, f"experts_{form}")(x, weights, ids)
        return routed + self.shared_experts(x)


__all__ = ["DENSE_MAX_TOKEN_EXPERTS", "FLOAT_FORMS", "GroupedSparseMoE", "MOE_FORMS"]
