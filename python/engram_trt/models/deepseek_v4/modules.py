"""DeepSeek-V4's hyper-connections, norms and MoE over a packed step (``[T, ...]``: the
tokens of several sequences back to back; none of these modules mixes tokens, so a
packed step needs nothing per sequence here).

Parameter names are transformers' module names (``attn_hc.fn``, ``mlp.experts.3.gate_proj``,
``mlp.gate.e_score_correction_bias``); :func:`.weights.checkpoint_name` maps them to the
names the checkpoint stores (``hc_attn_fn``, ``ffn.experts.3.w1``, ``ffn.gate.bias``).

* mHC (:class:`HyperConnection`): the residual is ``hc_mult`` streams ``[T, hc, D]``. From
  the flattened, RMS-normalized streams one linear map gives three sets of weights:
  ``pre`` (sigmoid + eps) collapses the streams into the sublayer's input, ``post``
  (2 sigmoid) spreads its output back over the streams, ``comb`` (softmax + eps, then
  ``hc_sinkhorn_iters`` Sinkhorn-Knopp steps towards a doubly-stochastic matrix) mixes
  the streams themselves: ``streams' = post * out + comb^T @ streams``. The matrix is not
  symmetric, so the transpose matters. All of it in float32, as transformers keeps it (float64 in a
  float64 model: the float64 oracle tests run the whole model so).
* :class:`HyperHead`: the final collapse (a ``pre``-only connection) before the norm.
* On CUDA both run as the kernel library's mHC kernels (``engram_mhc_pre`` / ``_post`` /
  ``_head``, :mod:`engram_trt.native.mhc`: two launches for the collapse, one for the
  expand, whatever ``hc_sinkhorn_iters``) when ``backend`` allows and the kernels take the
  tensors (bf16 / fp16 / float32 activations, float32 mHC parameters, ``hc_mult <= 8``,
  ``hidden % 8 == 0``); the PyTorch path (``*_torch``) serves the rest and is their reference.
* MoE (:class:`SparseMoE`): routed experts plus one shared expert, every SwiGLU with its
  pre-activations clamped to ``swiglu_limit`` (gate from above only, up both ways).
  Top-k routing (:class:`TopKRouter`) picks experts by ``score + e_score_correction_bias``
  and weights them by the score alone; hash routing (:class:`HashRouter`) picks them by
  the frozen ``tid2eid[token id]`` table. Both renormalize the picked scores and scale
  them by ``routed_scaling_factor``. An expert's projections are ``QuantLinear`` where the
  checkpoint stores them FP8 / FP4 (:func:`.weights.quantize_modules`).
* :class:`QuantGroupedLinear`: the attention's grouped output projection (``wo_a``) over a
  weight stored FP8, the block-diagonal contract of ``GroupedLinear`` kept.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from engram_trt.errors import EngramError
from engram_trt.models.deepseek_v4.compressors import wide

MHC_BACKENDS = ("auto", "kernels", "torch")
MHC_MAX_HC = 8  # engramKernels.h ENGRAM_MHC_MAX_HC


def _mhc_library_unavailable() -> str | None:
    """Why the kernel library cannot serve the mHC kernels (None: it can), asked once."""
    from engram_trt.native import mhc as native_mhc

    return native_mhc.unavailable("mHC CUDA kernels")


def mhc_kernel_serves(
    owner: str, backend: str, streams: torch.Tensor, *tensors: torch.Tensor, floats: tuple[torch.Tensor, ...] = ()
) -> bool:
    """Whether the mHC kernels take this call: ``backend`` ``auto`` (when they can),
    ``kernels`` (or an EngramError naming why not, ``owner`` the class) or ``torch``.
    ``tensors`` must share streams' dtype, ``floats`` (parameters, post / comb) be float32."""
    if backend not in MHC_BACKENDS:
        raise EngramError(f"{owner}.backend {backend!r} is not one of {list(MHC_BACKENDS)}")
    if backend == "torch":
        return False
    io = streams.dtype
    why = None
    if not streams.is_cuda:
        why = f"the activations are on {streams.device}, not a CUDA device"
    elif io not in (torch.bfloat16, torch.float16, torch.float32):
        why = f"the activations are {io}, not bfloat16, float16 or float32"
    elif streams.dim() != 3 or not 1 <= streams.shape[1] <= MHC_MAX_HC:
        why = f"the streams are {tuple(streams.shape)}, not [T, hc <= {MHC_MAX_HC}, hidden]"
    elif streams.shape[2] % 8:
        why = f"hidden_size {streams.shape[2]} is not a multiple of 8"
    elif any(t.dtype != io for t in tensors):
        why = f"the sublayer output is {[str(t.dtype) for t in tensors if t.dtype != io][0]}, not {io}"
    elif any(t.dtype != torch.float32 for t in floats):
        why = f"the mHC parameters are {[str(t.dtype) for t in floats if t.dtype != torch.float32][0]}, not float32"
    else:
        why = _mhc_library_unavailable()
    if why is None:
        return True
    if backend == "kernels":
        raise EngramError(f"{owner} backend 'kernels' cannot run: {why}; use backend 'auto' or 'torch'")
    return False


MHC_FOLD_ENV = "ENGRAM_TRT_MHC_FOLD"  # "0": a sublayer boundary as expand + collapse (an A/B switch)


def fold_serves(
    backend: str, streams: torch.Tensor, out: torch.Tensor, norm: Any, floats: tuple[torch.Tensor, ...]
) -> bool:
    """Whether a sublayer boundary (the expansion, then the next collapse with its norm)
    takes ``engram_mhc_fold``: the fused bf16 CUDA decode path (:mod:`.fused`), a float32
    RMSNorm weight, the mHC kernels serving ``backend`` (``kernels`` refuses with the
    reason, as :func:`mhc_kernel_serves`), ``ENGRAM_TRT_MHC_FOLD`` not ``0``."""
    import os

    from engram_trt.models.deepseek_v4 import fused

    if (
        os.environ.get(MHC_FOLD_ENV, "1") == "0"
        or not isinstance(norm, RMSNorm)
        or norm.weight.dtype != torch.float32
        or fused.unavailable(streams) is not None
    ):
        return False
    return mhc_kernel_serves("HyperConnection", backend, streams, out, floats=floats)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(wide(x).square().mean(-1, keepdim=True) + eps).to(x.dtype)


class RMSNorm(nn.Module):
    """``weight * x / rms(x)`` in float32 (the weight is kept in float32), cast back to x's dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = wide(x)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (wide(self.weight) * xf).to(x.dtype)


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """``comb [..., hc, hc]`` (positive) towards doubly stochastic: columns first, then
    ``iters - 1`` rounds of rows and columns (each sum offset by ``eps``)."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


class HyperConnection(nn.Module):
    """See the module docstring; ``fn [(2 + hc) * hc, hc * D]``, ``base``, ``scale [3]``.

    ``backend``: ``auto`` (the mHC kernels where they take the tensors, else PyTorch),
    ``kernels`` (the kernels or an EngramError saying why not) or ``torch``; a class
    default, settable per module for :meth:`collapse`; :meth:`expand` (static: it needs
    no parameters) follows the class attribute."""

    backend: str = "auto"

    def __init__(self, config: Any) -> None:
        super().__init__()
        hc = config.hc_mult
        self.hc = hc
        self.iters = config.hc_sinkhorn_iters
        self.hc_eps = config.hc_eps
        self.norm_eps = config.rms_norm_eps
        n = (2 + hc) * hc
        self.fn = nn.Parameter(torch.zeros(n, hc * config.hidden_size))
        self.base = nn.Parameter(torch.zeros(n))
        self.scale = nn.Parameter(torch.ones(3))

    def weights(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(pre [T, hc], post [T, hc], comb [T, hc, hc])`` in float32 of ``streams [T, hc, D]``."""
        hc = self.hc
        flat = unweighted_rms_norm(wide(streams.reshape(streams.shape[0], -1)), self.norm_eps)
        mixes = F.linear(flat, self.fn.to(flat.dtype))
        pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
        base = self.base.to(flat.dtype)
        pre_b, post_b, comb_b = base.split([hc, hc, hc * hc])
        s = self.scale.to(flat.dtype)
        pre = torch.sigmoid(pre_w * s[0] + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * s[1] + post_b)
        comb = torch.softmax(comb_w.unflatten(-1, (hc, hc)) * s[2] + comb_b.view(hc, hc), dim=-1) + self.hc_eps
        return pre, post, sinkhorn(comb, self.iters, self.hc_eps)

    def collapse(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(sublayer input [T, D], post, comb)``."""
        if mhc_kernel_serves("HyperConnection", self.backend, streams, floats=(self.fn, self.base, self.scale)):
            from engram_trt.native import mhc as native_mhc

            return native_mhc.mhc_pre(
                streams.contiguous(),
                self.fn,
                self.base,
                self.scale,
                sinkhorn_iters=self.iters,
                hc_eps=self.hc_eps,
                norm_eps=self.norm_eps,
            )
        return self.collapse_torch(streams)

    def collapse_normed(
        self, streams: torch.Tensor, norm: "RMSNorm"
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(norm(sublayer input), post, comb)``: :meth:`collapse` and the RMSNorm after it
        (the layer's ``input_layernorm`` / ``post_attention_layernorm``). On the bf16 CUDA
        decode path (:mod:`.fused`) the norm runs in the collapse kernel's last launch
        (``engram_mhc_pre_norm``); elsewhere the two run as they are."""
        from engram_trt.models.deepseek_v4 import fused

        if (
            isinstance(norm, RMSNorm)
            and norm.weight.dtype == torch.float32
            and fused.unavailable(streams) is None
            and mhc_kernel_serves("HyperConnection", self.backend, streams, floats=(self.fn, self.base, self.scale))
        ):
            return self.collapse_fused(streams, norm)
        h, post, comb = self.collapse(streams)
        return norm(h), post, comb

    def collapse_fused(self, streams: torch.Tensor, norm: "RMSNorm") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`collapse_normed`'s kernel form (``engram_mhc_pre_norm``; a method of its
        own so a profiler can time it apart from :meth:`collapse` and the norm)."""
        from engram_trt.native import mhc as native_mhc

        return native_mhc.mhc_pre_norm(
            streams.contiguous(),
            self.fn,
            self.base,
            self.scale,
            norm.weight,
            sinkhorn_iters=self.iters,
            hc_eps=self.hc_eps,
            norm_eps=self.norm_eps,
            rms_eps=norm.eps,
        )

    def expand_collapse_normed(
        self, streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, norm: "RMSNorm"
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(new streams, norm(collapse input), post, comb)``: :meth:`expand` of the sublayer
        before (``out``, its ``post`` / ``comb``) then this connection's
        :meth:`collapse_normed` of the new streams. On the bf16 CUDA decode path the two are
        one kernel chain (``engram_mhc_fold``: two launches where they took three; off with
        ``ENGRAM_TRT_MHC_FOLD=0``); elsewhere they run as they are."""
        if fold_serves(self.backend, streams, out, norm, (self.fn, self.base, self.scale, post, comb)):
            from engram_trt.native import mhc as native_mhc

            new, x, p, c = native_mhc.mhc_fold(
                streams.contiguous(),
                out.contiguous(),
                post.contiguous(),
                comb.contiguous(),
                self.fn,
                self.base,
                self.scale,
                norm.weight,
                sinkhorn_iters=self.iters,
                hc_eps=self.hc_eps,
                norm_eps=self.norm_eps,
                rms_eps=norm.eps,
            )
            return new, x, p, c
        # the class's static expand (a profiler's wrapper times it, bench/dsv4profile.py), then the collapse
        new = HyperConnection.expand(streams, out, post, comb)
        return (new, *HyperConnection.collapse_normed(self, new, norm))

    def collapse_torch(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The PyTorch :meth:`collapse` (the CPU's, and the kernel's reference)."""
        pre, post, comb = self.weights(streams)
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype), post, comb

    @staticmethod
    def expand(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """The streams after a sublayer: ``post * out + comb^T @ streams`` (a new tensor).
        A static method (bench/dsv4profile times it as one), so the class's ``backend`` decides."""
        return _expand(streams, out, post, comb)

    @staticmethod
    def expand_torch(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """The PyTorch :meth:`expand` (the CPU's, and the kernel's reference)."""
        dtype = streams.dtype
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(
            comb.to(dtype).transpose(-1, -2), streams
        )


def _expand(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """:meth:`HyperConnection.expand`'s body (the mHC post kernel, else the PyTorch form)."""
    if mhc_kernel_serves("HyperConnection", HyperConnection.backend, streams, out, floats=(post, comb)):
        from engram_trt.native import mhc as native_mhc

        return native_mhc.mhc_post(streams.contiguous(), out.contiguous(), post.contiguous(), comb.contiguous())
    return HyperConnection.expand_torch(streams, out, post, comb)


class HyperHead(nn.Module):
    """The last collapse of the streams: ``hc_fn [hc, hc * D]``, ``hc_base [hc]``, ``hc_scale [1]``.
    ``backend`` as :class:`HyperConnection`'s (``engram_mhc_head`` on CUDA)."""

    backend: str = "auto"

    def __init__(self, config: Any) -> None:
        super().__init__()
        hc = config.hc_mult
        self.eps = config.hc_eps
        self.norm_eps = config.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(hc, hc * config.hidden_size))
        self.hc_base = nn.Parameter(torch.zeros(hc))
        self.hc_scale = nn.Parameter(torch.ones(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        if mhc_kernel_serves("HyperHead", self.backend, streams, floats=(self.hc_fn, self.hc_base, self.hc_scale)):
            from engram_trt.native import mhc as native_mhc

            return native_mhc.mhc_head(
                streams.contiguous(), self.hc_fn, self.hc_base, self.hc_scale, hc_eps=self.eps, norm_eps=self.norm_eps
            )
        return self.forward_torch(streams)

    def forward_normed(self, streams: torch.Tensor, norm: "RMSNorm") -> torch.Tensor:
        """``norm(self(streams))``: the final norm fused into the head's last launch on the
        bf16 CUDA decode path (``engram_mhc_head_norm``, as :meth:`HyperConnection.collapse_normed`)."""
        from engram_trt.models.deepseek_v4 import fused

        if (
            isinstance(norm, RMSNorm)
            and norm.weight.dtype == torch.float32
            and fused.unavailable(streams) is None
            and mhc_kernel_serves("HyperHead", self.backend, streams, floats=(self.hc_fn, self.hc_base, self.hc_scale))
        ):
            return self.forward_fused(streams, norm)
        return norm(self(streams))

    def expand_forward_normed(
        self,
        streams: torch.Tensor,
        out: torch.Tensor,
        post: torch.Tensor,
        comb: torch.Tensor,
        norm: "RMSNorm",
        last: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``norm(self(expanded[last]))`` with ``expanded`` = :meth:`HyperConnection.expand`
        of the last sublayer (``last`` None: every token): the last expansion folded into
        the head on the bf16 CUDA decode path (``engram_mhc_fold`` with ``head``, over
        every token, the rows of ``last`` taken after: the head is per token); elsewhere
        the expansion, the rows, then :meth:`forward_normed`."""
        if fold_serves(HyperConnection.backend, streams, out, norm, (post, comb)) and mhc_kernel_serves(
            "HyperHead", self.backend, streams, floats=(self.hc_fn, self.hc_base, self.hc_scale)
        ):
            from engram_trt.native import mhc as native_mhc

            _new, hidden, _p, _c = native_mhc.mhc_fold(
                streams.contiguous(),
                out.contiguous(),
                post.contiguous(),
                comb.contiguous(),
                self.hc_fn,
                self.hc_base,
                self.hc_scale,
                norm.weight,
                head=True,
                hc_eps=self.eps,
                norm_eps=self.norm_eps,
                rms_eps=norm.eps,
            )
            return hidden if last is None else hidden[last]
        new = HyperConnection.expand(streams, out, post, comb)
        return HyperHead.forward_normed(self, new if last is None else new[last], norm)

    def forward_fused(self, streams: torch.Tensor, norm: "RMSNorm") -> torch.Tensor:
        """:meth:`forward_normed`'s kernel form (``engram_mhc_head_norm``)."""
        from engram_trt.native import mhc as native_mhc

        return native_mhc.mhc_head_norm(
            streams.contiguous(),
            self.hc_fn,
            self.hc_base,
            self.hc_scale,
            norm.weight,
            hc_eps=self.eps,
            norm_eps=self.norm_eps,
            rms_eps=norm.eps,
        )

    def forward_torch(self, streams: torch.Tensor) -> torch.Tensor:
        """The PyTorch path (the CPU's, and the kernel's reference)."""
        flat = unweighted_rms_norm(wide(streams.reshape(streams.shape[0], -1)), self.norm_eps)
        mixes = F.linear(flat, self.hc_fn.to(flat.dtype))
        pre = torch.sigmoid(mixes * self.hc_scale.to(flat.dtype) + self.hc_base.to(flat.dtype)) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


class QuantGroupedLinear(nn.Module):
    """``GroupedLinear`` (``attention.py``: a block-diagonal linear, group ``g`` of the
    input meets rows ``g * out_per_group ..`` of the weight only) whose weight
    ``[out_features, in_per_group]`` is stored FP8 with block scales over that matrix, as
    the published ``wo_a`` is. Buffers ``weight`` / ``weight_scale_inv`` as QuantLinear's.

    Each group's rows are one QuantWeight view when its rows fill whole scale blocks
    (``out_per_group % bn == 0``), so on CUDA each group runs the stored-format product
    (:func:`engram_trt.quant.weight.quant_linear`); elsewhere (the CPU path, or groups
    cutting a block) the weight is dequantized for the call, as transformers' CPU path does."""

    backend: str = "auto"
    stored_format: ClassVar[bool] = True  # GroupedLinear's is False: the fused glue tells the two kinds apart

    def __init__(
        self,
        in_per_group: int,
        out_features: int,
        groups: int,
        kind: str,
        block: tuple[int, int],
        scale_fmt: str = "float",
        device: Any = None,
    ) -> None:
        super().__init__()
        from engram_trt.quant.formats import scale_grid

        if out_features % groups:
            raise EngramError(f"QuantGroupedLinear: {groups} groups do not divide {out_features} output rows")
        self.groups, self.in_per_group, self.out_features = groups, int(in_per_group), int(out_features)
        self.kind, self.block = kind, (int(block[0]), int(block[1]))
        data_shape = (out_features, in_per_group // 2) if kind == "fp4" else (out_features, in_per_group)
        self.register_buffer(
            "weight", torch.empty(data_shape, device=device, dtype=torch.int8 if kind == "fp4" else torch.float8_e4m3fn)
        )
        self.register_buffer(
            "weight_scale_inv",
            torch.empty(
                scale_grid(out_features, in_per_group, *self.block),
                device=device,
                dtype=torch.float8_e8m0fnu if scale_fmt == "ue8m0" else torch.float32,
            ),
        )

    @classmethod
    def like(cls, grouped: nn.Module, kind: str, block: tuple[int, int], scale_fmt: str) -> "QuantGroupedLinear":
        out_features, in_per_group = grouped.weight.shape
        return cls(in_per_group, out_features, grouped.groups, kind, block, scale_fmt, device=grouped.weight.device)

    @property
    def qweight(self) -> Any:
        from engram_trt.quant.weight import QuantWeight

        return QuantWeight(self.weight, self.weight_scale_inv, self.kind, self.block)

    def group_weights(self) -> list[Any] | None:
        """One QuantWeight view per group (None when a group's rows cut a scale block)."""
        from engram_trt.quant.weight import QuantWeight

        rows, bn = self.out_features // self.groups, self.block[0]
        if rows % bn:
            return None
        srows = rows // bn
        return [
            QuantWeight(
                self.weight[g * rows : (g + 1) * rows],
                self.weight_scale_inv[g * srows : (g + 1) * srows],
                self.kind,
                self.block,
            )
            for g in range(self.groups)
        ]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [n, groups, in_per_group]`` -> ``[n, groups, out_per_group]``."""
        from engram_trt.quant.weight import quant_linear

        parts = self.group_weights() if x.is_cuda and self.backend != "torch" else None
        if parts is not None:
            return torch.stack(
                [quant_linear(x[:, g].contiguous(), parts[g], backend=self.backend) for g in range(self.groups)], dim=1
            )
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        w = self.qweight.dequantize(work).to(x.dtype)
        return torch.einsum("ngi,goi->ngo", x, w.reshape(self.groups, -1, w.shape[-1]))

    def extra_repr(self) -> str:
        return (
            f"in_per_group={self.in_per_group}, out_features={self.out_features}, groups={self.groups}, "
            f"{self.kind}, block={self.block[0]}x{self.block[1]}"
        )


class ClampedSwiGLU(nn.Module):
    """One expert (routed or shared): ``down(silu(min(gate, l)) * clamp(up, -l, l))``."""

    def __init__(self, hidden: int, intermediate: int, limit: float) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x).clamp(max=self.limit)
        up = self.up_proj(x).clamp(min=-self.limit, max=self.limit)
        return self.down_proj(F.silu(gate) * up)


_SCORES = {"sqrtsoftplus": lambda z: F.softplus(z).sqrt(), "sigmoid": torch.sigmoid}


class _Router(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.n_routed_experts
        self.scaling = config.routed_scaling_factor
        self.scoring = config.scoring_func  # the score function's name (the fused decode router takes it)
        self.score_fn = _SCORES[config.scoring_func]
        self.weight = nn.Parameter(torch.zeros(self.num_experts, config.hidden_size))

    def correction_bias(self) -> torch.Tensor | None:
        """The bias the picks add to the scores (:class:`TopKRouter`'s
        ``e_score_correction_bias``); None: the picks come from ``tid2eid`` (:class:`HashRouter`)."""
        return None

    def _weights(self, scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        w = scores.gather(1, ids)
        return w / (w.sum(dim=-1, keepdim=True) + 1e-20) * self.scaling


class TopKRouter(_Router):
    """Experts by ``score + e_score_correction_bias`` (the load-balancing bias picks, never weighs)."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(self.num_experts))

    def correction_bias(self) -> torch.Tensor | None:
        return self.e_score_correction_bias

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.score_fn(F.linear(x, self.weight))
        # The float32 bias promotes the sum (as published): rounding it to bf16 scores flips near ties.
        ids = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1).indices
        return self._weights(scores, ids), ids


class HashRouter(_Router):
    """Experts by the frozen ``tid2eid [vocab, top_k]`` table (an int64 buffer of the
    checkpoint): the token id alone decides which experts run; the learned gate still
    weighs them."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.register_buffer("tid2eid", torch.zeros(config.vocab_size, self.top_k, dtype=torch.int64))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.score_fn(F.linear(x, self.weight))
        ids = self.tid2eid[input_ids].long()
        return self._weights(scores, ids), ids


class SparseMoE(nn.Module):
    """Routed experts (one GEMM chain per expert any token picked) plus the shared expert."""

    def __init__(self, config: Any, layer: int) -> None:
        super().__init__()
        self.is_hash = config.mlp_layer_types[layer] == "hash_moe"
        self.gate = HashRouter(config) if self.is_hash else TopKRouter(config)
        D, I, lim = config.hidden_size, config.moe_intermediate_size, config.swiglu_limit
        self.experts = nn.ModuleList(ClampedSwiGLU(D, I, lim) for _ in range(config.n_routed_experts))
        self.shared_experts = ClampedSwiGLU(D, I, lim)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x, input_ids)
        k = ids.shape[1]
        out = torch.zeros_like(x)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        token_of = order // k
        start = 0
        w = weights.reshape(-1)
        for e, n in enumerate(counts):
            if n == 0:
                continue
            sel = order[start : start + n]
            tok = token_of[start : start + n]
            start += n
            y = self.experts[e](x[tok]) * w[sel].unsqueeze(-1).to(x.dtype)
            out.index_add_(0, tok, y.to(out.dtype))
        return out + self.shared_experts(x)
