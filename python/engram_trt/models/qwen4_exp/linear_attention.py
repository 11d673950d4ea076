"""Qwen4Exp's Gated DeltaNet linear-attention layer over a packed step.

A packed step carries the new tokens of several sequences back to back; each sequence
owns a slot of two per-slot states that persist between steps:

* ``conv`` ``[conv_dim, K-1]``: the last K-1 *pre-convolution* q/k/v projections, so the
  depthwise causal convolution (kernel K) continues across steps as if the sequence had
  been fed whole;
* ``recurrent`` ``[Hv, dk, dv]`` (float32): the delta-rule memory ``S``.

The recurrence, per value head, with ``q`` and ``k`` L2-normalized and ``q`` scaled by
``dk ** -0.5``::

    S_t = exp(g_t) * S_{t-1} + k_t u_t^T,   u_t = beta_t * (v_t - exp(g_t) * S_{t-1}^T k_t)
    o_t = S_t^T q_t

with ``beta = sigmoid(b)`` (how strongly token t overwrites what S predicts for k_t) and
``g = -exp(A_log) * softplus(a + dt_bias)`` (log decay, <= 0). Key heads are shared by
``Hv // Hk`` consecutive value heads.

Two forms of one recurrence, chosen as the published layer chooses them (so float32
results agree with it to round-off): a sequence continuing from a state with a single
token takes the token-by-token step; every other sequence (a prompt, a prefill chunk
continuing from a state, a one-token prompt) takes the chunked form. The chunked form
(:func:`chunked_delta_rule`) turns the recurrence inside a chunk into one
unit-lower-triangular solve and a few matmuls, then scans chunk to chunk. A step whose
sequences are all decode tokens is one vectorized recurrent step over their slots.

On CUDA the layer's core (the causal conv, then the gated delta rule with the q / k
normalization inside) runs as two calls of the kernel library for the whole packed step
(``engram_causal_conv1d`` and ``engram_gated_delta_net``: the EngramCausalConv1d and
EngramGatedDeltaNet plugins' math, :mod:`engram_trt.native.linear_attention`) instead of
a Python loop over the step's sequences; :attr:`GatedDeltaNet.backend` chooses, and the
PyTorch forms above stay the CPU's path and the kernels' reference.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from engram_trt.errors import ConfigError, EngramError
from engram_trt.models.qwen4_exp.norms import GatedRMSNorm

# The convolution's activation (config.hidden_act) and the output gate's
# (config.output_gate_type, else hidden_act); the published model uses silu for both.
_CONV_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "sigmoid": torch.sigmoid,
}
_GATE_ACTIVATIONS = ("silu", "sigmoid")
# The activations the conv kernel applies itself (native.linear_attention.ACTIVATIONS).
_CONV_KERNEL_ACTIVATIONS = {"silu": "silu", "swish": "silu"}
LINEAR_ATTENTION_BACKENDS = ("auto", "kernels", "torch")


def _kernels_unavailable() -> str | None:
    """Why the kernel library cannot serve the linear attention (None: it can), asked once."""
    from engram_trt.native import linear_attention as native_linear

    return native_linear.unavailable("Gated DeltaNet CUDA kernels")


# Tokens per chunk of the chunked form; the published layer's default, which keeps the
# round-off of a prompt the same as its.
CHUNK_SIZE = 64
# The epsilon of the q / k L2 normalization (the published layer's, matching FLA).
L2_EPS = 1e-6


def l2_normalize(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    """``x / sqrt(|x|^2 + eps)`` over the last dim (eps inside the root, as the FLA
    kernels the checkpoint was trained with)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def chunked_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over one sequence, chunk by chunk.

    ``q, k [H, L, dk]`` (normalized, q scaled), ``v [H, L, dv]``, ``g, beta [H, L]``,
    ``state [H, dk, dv]`` or None (zeros). Computes in float32, or float64 if given it
    (the tests' exact check). Returns ``(o [H, L, dv], final state [H, dk, dv])``.

    Inside a chunk starting from ``S0``, with ``G_t`` the cumulative log decay from the
    chunk start, unrolling the recurrence gives

        u_t + sum_{j<t} beta_t e^{G_t-G_j} (k_t.k_j) u_j = beta_t v_t - beta_t e^{G_t} S0^T k_t

    i.e. ``(I + A) U = beta V - (beta e^G K) S0`` with A strictly lower triangular: one
    triangular solve for the two right-hand sides gives U for any S0. Then
    ``o_t = e^{G_t} S0^T q_t + sum_{j<=t} e^{G_t-G_j} (q_t.k_j) u_j`` and the chunk's
    final state ``e^{G_L} S0 + sum_j e^{G_L-G_j} k_j u_j^T``. Positions past the end are
    zero-padded: with beta = 0 and g = 0 they write nothing and decay nothing.
    """
    dtype = torch.promote_types(q.dtype, torch.float32)
    q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, g, beta))
    H, L, dk = k.shape
    dv = v.shape[-1]
    n = -(-L // chunk_size)
    pad = n * chunk_size - L
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    # [H, n, C, d] and [H, n, C]
    q, k, v = (t.reshape(H, n, chunk_size, t.shape[-1]) for t in (q, k, v))
    g, beta = (t.reshape(H, n, chunk_size) for t in (g, beta))

    G = g.cumsum(-1)
    # e^{G_t - G_j} for j <= t; the upper triangle would overflow, so it is -inf first.
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    decay_tj = (G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    kb = k * beta.unsqueeze(-1)
    # The solve reads only the strict lower triangle (unitriangular): A's diagonal is I.
    system = (kb @ k.transpose(-1, -2)) * decay_tj
    rhs = torch.cat([v * beta.unsqueeze(-1), kb * G.exp().unsqueeze(-1)], dim=-1)
    sol = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u_free, u_per_state = sol[..., :dv], sol[..., dv:]  # U = u_free - u_per_state @ S0
    attn = (q @ k.transpose(-1, -2)) * decay_tj
    q_read = q * G.exp().unsqueeze(-1)  # reads S0 decayed to t
    k_write = k * (G[..., -1:] - G).exp().unsqueeze(-1)  # written, decayed to chunk end
    chunk_decay = G[..., -1].exp()[..., None, None]  # [H, n, 1, 1]

    S = torch.zeros(H, dk, dv, dtype=dtype, device=q.device) if state is None else state.to(dtype)
    out = torch.empty(H, n, chunk_size, dv, dtype=dtype, device=q.device)
    for c in range(n):
        u = u_free[:, c] - u_per_state[:, c] @ S
        out[:, c] = q_read[:, c] @ S + attn[:, c] @ u
        S = S * chunk_decay[:, c] + k_write[:, c].transpose(-1, -2) @ u
    return out.reshape(H, n * chunk_size, dv)[:, :L], S


def recurrent_delta_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule for B sequences at once (a decode step).

    ``q, k [B, H, dk]`` (normalized, q scaled), ``v [B, H, dv]``, ``g, beta [B, H]``,
    ``state [B, H, dk, dv]``. Returns ``(o [B, H, dv], new state)`` in float32.
    """
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    S = state.float() * g.exp()[..., None, None]
    predicted = (S * k.unsqueeze(-1)).sum(-2)  # S^T k  [B, H, dv]
    u = (v - predicted) * beta.unsqueeze(-1)
    S = S + k.unsqueeze(-1) * u.unsqueeze(-2)
    return (S * q.unsqueeze(-1)).sum(-2), S


def _config_int(config: Any, name: str) -> int:
    value = getattr(config, name, None)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"config field {name} = {value!r}: the linear attention needs a positive integer")
    return value


class GatedDeltaNet(nn.Module):
    """The linear-attention layer; parameters named as the checkpoint's
    ``model.layers.{i}.linear_attn.*`` so its state dict loads as is.

    ``backend``: ``auto`` (the kernel library on CUDA activations it takes: bf16 / fp16 /
    float32, a silu convolution; else PyTorch), ``kernels`` (the kernel library or an
    EngramError saying why not) or ``torch``. A class default, settable per module."""

    backend: str = "auto"

    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        layer_types = getattr(config, "layer_types", None)
        if layer_types is not None and layer_idx < len(layer_types) and layer_types[layer_idx] != "linear_attention":
            raise ConfigError(
                f"layer_types[{layer_idx}] is {layer_types[layer_idx]!r}, not 'linear_attention': "
                "build this layer only where the config places linear attention"
            )
        self.hidden_size = _config_int(config, "hidden_size")
        self.num_k_heads = _config_int(config, "linear_num_key_heads")
        self.num_v_heads = _config_int(config, "linear_num_value_heads")
        self.head_k_dim = _config_int(config, "linear_key_head_dim")
        self.head_v_dim = _config_int(config, "linear_value_head_dim")
        self.kernel_size = _config_int(config, "linear_conv_kernel_dim")
        if self.num_v_heads % self.num_k_heads:
            raise ConfigError(
                f"linear_num_value_heads = {self.num_v_heads} is not a multiple of linear_num_key_heads "
                f"= {self.num_k_heads}: each key head must serve a whole group of value heads"
            )
        act = getattr(config, "hidden_act", None)
        if act not in _CONV_ACTIVATIONS:
            raise ConfigError(
                f"config field hidden_act = {act!r}: the linear attention's convolution supports "
                f"{sorted(_CONV_ACTIVATIONS)}"
            )
        gate_act = getattr(config, "output_gate_type", None) or act
        if gate_act not in _GATE_ACTIVATIONS:
            raise ConfigError(
                f"config field output_gate_type = {gate_act!r}: the output gate supports {list(_GATE_ACTIVATIONS)}"
            )
        self.conv_activation = _CONV_ACTIVATIONS[act]
        self.conv_kernel_activation = _CONV_KERNEL_ACTIVATIONS.get(act)
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim

        self.in_proj_qkv = nn.Linear(self.hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(self.hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(self.hidden_size, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(self.hidden_size, self.num_v_heads, bias=False)
        # Only the weight [conv_dim, 1, K] is used; forward does its own causal padding
        # from the slot's conv state.
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel_size, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, float(getattr(config, "rms_norm_eps", 1e-6)), gate_act)
        self.out_proj = nn.Linear(self.value_dim, self.hidden_size, bias=False)

    @staticmethod
    def state_shapes(config: Any) -> dict[str, tuple[int, ...]]:
        """Per-slot state shapes: ``conv`` holds the last K-1 pre-convolution q/k/v
        columns (in the activations' dtype), ``recurrent`` the delta-rule memory (float32)."""
        key_dim = _config_int(config, "linear_num_key_heads") * _config_int(config, "linear_key_head_dim")
        hv, dv = _config_int(config, "linear_num_value_heads"), _config_int(config, "linear_value_head_dim")
        conv_dim = 2 * key_dim + hv * dv
        return {
            "conv": (conv_dim, _config_int(config, "linear_conv_kernel_dim") - 1),
            "recurrent": (hv, _config_int(config, "linear_key_head_dim"), dv),
        }

    # -- checks ---------------------------------------------------------------------------
    def _check_step(
        self,
        x: torch.Tensor,
        seq_starts: list[int],
        past_lens: list[int],
        slots: list[int],
        conv_state: torch.Tensor,
        recurrent_state: torch.Tensor,
    ) -> None:
        if x.dim() != 2 or x.shape[1] != self.hidden_size:
            raise EngramError(f"linear attention input has shape {tuple(x.shape)}; pass [tokens, {self.hidden_size}]")
        S = len(seq_starts) - 1
        if S < 1 or seq_starts[0] != 0 or seq_starts[-1] != x.shape[0]:
            raise EngramError(f"seq_starts {list(seq_starts)} must run from 0 to the step's {x.shape[0]} tokens")
        if any(b <= a for a, b in zip(seq_starts, seq_starts[1:])):
            raise EngramError(f"seq_starts {list(seq_starts)} must increase: every sequence brings at least one token")
        if len(past_lens) != S or len(slots) != S:
            raise EngramError(
                f"a step of {S} sequences needs {S} past lengths and {S} slots (got {len(past_lens)} and {len(slots)})"
            )
        if min(past_lens) < 0:
            raise EngramError(f"past lengths must be >= 0 (got {list(past_lens)})")
        num_slots = recurrent_state.shape[0]
        if len(set(slots)) != S or min(slots) < 0 or max(slots) >= num_slots:
            raise EngramError(f"slots {list(slots)} must be distinct and in [0, {num_slots})")
        conv_shape = (num_slots, self.conv_dim, self.kernel_size - 1)
        rec_shape = (num_slots, self.num_v_heads, self.head_k_dim, self.head_v_dim)
        if tuple(conv_state.shape) != conv_shape or conv_state.dtype != x.dtype:
            raise EngramError(
                f"conv_state is {tuple(conv_state.shape)} {conv_state.dtype}; allocate {conv_shape} {x.dtype}"
            )
        if tuple(recurrent_state.shape) != rec_shape or recurrent_state.dtype != torch.float32:
            raise EngramError(
                f"recurrent_state is {tuple(recurrent_state.shape)} {recurrent_state.dtype}; "
                f"allocate {rec_shape} torch.float32"
            )

    # -- the kernel library ---------------------------------------------------------------
    def _neg_decay(self) -> torch.Tensor:
        """``-exp(A_log)`` in float32: the same value every step, so made once (outside a CUDA
        graph's capture, whose launches would fill it only at replay) and reused."""
        key = (self.A_log.data_ptr(), self.A_log._version, self.A_log.device)
        cached = getattr(self, "_neg_decay_cache", None)
        if cached is not None and cached[0] == key:
            return cached[1]
        value = -self.A_log.float().exp()
        if not (value.is_cuda and torch.cuda.is_current_stream_capturing()):
            self._neg_decay_cache = (key, value)
        return value

    def _kernel_serves(self, x: torch.Tensor, conv_state: torch.Tensor, recurrent_state: torch.Tensor) -> bool:
        """Whether the step's core takes the kernel library (see ``backend``)."""
        if self.backend not in LINEAR_ATTENTION_BACKENDS:
            raise EngramError(f"GatedDeltaNet.backend {self.backend!r} is not one of {list(LINEAR_ATTENTION_BACKENDS)}")
        if self.backend == "torch":
            return False
        why = None
        if not x.is_cuda:
            why = f"the activations are on {x.device}, not a CUDA device"
        elif x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            why = f"the activations are {x.dtype}, not bfloat16, float16 or float32"
        elif conv_state.dtype != x.dtype or recurrent_state.dtype != torch.float32:
            why = (
                f"the states are {conv_state.dtype} / {recurrent_state.dtype}; allocate the conv state in "
                f"{x.dtype} and the recurrent state in float32"
            )
        elif self.conv1d.weight.dtype not in (torch.float32, x.dtype):
            why = f"the conv weight is {self.conv1d.weight.dtype}, not float32 or {x.dtype}"
        elif self.conv_kernel_activation is None:
            why = "the convolution's activation (hidden_act) is not silu"
        else:
            why = _kernels_unavailable()
        if why is None:
            return True
        if self.backend == "kernels":
            raise EngramError(f"GatedDeltaNet backend 'kernels' cannot run: {why}; use backend 'auto' or 'torch'")
        return False

    def _core_kernels(
        self,
        cols: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        meta: torch.Tensor,
        S: int,
        conv_state: torch.Tensor,
        recurrent_state: torch.Tensor,
    ) -> torch.Tensor:
        """Conv then delta rule for every sequence of the step in two library calls, the
        states updated in place. ``meta``: int32 ``[seq_starts (S+1), past_lens (S),
        slots (S)]`` on the device. Returns ``o [T, Hv, dv]`` in the activations' dtype
        (the PyTorch path's float32 core rounded once, as it rounds it)."""
        from engram_trt.native import linear_attention as native_linear

        starts, past, slots = meta[: S + 1], meta[S + 1 : 2 * S + 1], meta[2 * S + 1 :]
        mixed = native_linear.causal_conv1d(
            cols, self.conv1d.weight, conv_state, starts, past, slots, activation=self.conv_kernel_activation
        )
        T = cols.shape[0]
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        # contiguous copies: the binding takes contiguous q, k, v only (native.library.check)
        q, k = (t.reshape(T, self.num_k_heads, self.head_k_dim).contiguous() for t in (q, k))
        v = v.reshape(T, self.num_v_heads, self.head_v_dim).contiguous()
        return native_linear.gated_delta_net(
            q,
            k,
            v,
            g.contiguous(),
            beta.contiguous(),
            recurrent_state,
            starts,
            past,
            slots,
            l2norm_qk=True,
            scale=self.head_k_dim**-0.5,
        )

    # -- pieces ---------------------------------------------------------------------------
    def _conv(self, cols: torch.Tensor, past: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal depthwise conv of ``cols [B, C, L]`` after ``past [B, C, K-1]``:
        returns ``(activated output [B, C, L], the new past [B, C, K-1])``."""
        full = torch.cat([past.to(cols.dtype), cols], dim=-1)
        weight = self.conv1d.weight
        out = self.conv_activation(F.conv1d(full.to(weight.dtype), weight, groups=self.conv_dim))
        return out.to(cols.dtype), full[..., full.shape[-1] - (self.kernel_size - 1) :]

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Convolved ``[N, conv_dim]`` -> float32 q, k ``[N, Hv, dk]`` (normalized, key
        heads repeated to their value heads, q scaled) and v ``[N, Hv, dv]``."""
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        rep = self.num_v_heads // self.num_k_heads
        q, k = (
            l2_normalize(t.reshape(-1, self.num_k_heads, self.head_k_dim).float()).repeat_interleave(rep, dim=1)
            for t in (q, k)
        )
        return q * self.head_k_dim**-0.5, k, v.reshape(-1, self.num_v_heads, self.head_v_dim).float()

    def _recurrent(
        self,
        cols: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        slot_ids: torch.Tensor,
        conv_state: torch.Tensor,
        recurrent_state: torch.Tensor,
    ) -> torch.Tensor:
        """One token per slot ``slot_ids`` (a device tensor): the token-by-token form,
        states updated in place; returns ``o [B, Hv, dv]`` float32."""
        mixed, new_past = self._conv(cols.unsqueeze(-1), conv_state[slot_ids])
        conv_state[slot_ids] = new_past
        q, k, v = self._heads(mixed.squeeze(-1))
        o, new_state = recurrent_delta_step(q, k, v, g, beta, recurrent_state[slot_ids])
        recurrent_state[slot_ids] = new_state
        return o

    def forward_decode(
        self,
        x: torch.Tensor,
        slot_ids: torch.Tensor,
        conv_state: torch.Tensor,
        recurrent_state: torch.Tensor,
        meta: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """A decode-only step: token ``j`` of ``x [B, hidden]`` continues the sequence in
        slot ``slot_ids[j]`` (a device tensor, distinct slots, each with a past). No host
        lists, no host syncs: the step the decode CUDA graphs record. Equal to
        :meth:`forward` on such a step (its decode branch is this very code). A bf16 step on a
        GPU takes the four input projections in one GEMV launch and the output projection in
        another (:func:`.fused.project`), the gates in one (:func:`.fused.gdn_gates`) and the
        gated output norm in one (:func:`.fused.gated_norm`; these two off with
        ``ENGRAM_TRT_QWEN4_GDN_GLUE=0``) where the kernel library serves them. ``meta``: the
        step's int32 ``[seq_starts (B+1) = 0..B, past_lens (B), slots (B)]`` on the device when
        the caller has it (``Qwen4ExpModel.decode_views``: one for every layer of the step; the
        kernels read a past length only as > 0), else it is made here."""
        from engram_trt.models.qwen4_exp import fused

        projected = fused.project(x, [self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a])
        if projected is None:
            projected = [self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)]
        cols, z, b, a = projected
        neg_decay = self._neg_decay()
        gates = fused.gdn_gates(b, a, self.dt_bias, neg_decay)
        if gates is None:
            gates = torch.sigmoid(b).float(), neg_decay * F.softplus(a.float() + self.dt_bias.float())
        beta, g = gates
        if self._kernel_serves(x, conv_state, recurrent_state):
            # Sequence j is token j with a past (its length only needs to be > 0), in slot
            # slot_ids[j]: the step's metadata built on the device, so the graphs record it.
            B = x.shape[0]
            if meta is None:
                ones = torch.ones(B, dtype=torch.int32, device=x.device)
                meta = torch.cat(
                    [torch.arange(B + 1, dtype=torch.int32, device=x.device), ones, slot_ids.to(torch.int32)]
                )
            core = self._core_kernels(cols, g, beta, meta, B, conv_state, recurrent_state)
        else:
            core = self._recurrent(cols, g, beta, slot_ids, conv_state, recurrent_state)
        normed = fused.gated_norm(self.norm, core, z, self.num_v_heads)
        if normed is None:
            normed = self.norm(core.to(x.dtype).reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
            normed = normed.reshape(x.shape[0], self.value_dim)
        out = fused.project(normed, [self.out_proj])
        return self.out_proj(normed) if out is None else out[0]

    # -- the step -------------------------------------------------------------------------
    def forward(
        self,
        x: torch.Tensor,
        seq_starts: list[int],
        past_lens: list[int],
        slots: list[int],
        conv_state: torch.Tensor,
        recurrent_state: torch.Tensor,
    ) -> torch.Tensor:
        """One packed step (module docstring); ``conv_state`` / ``recurrent_state`` of the
        step's slots are overwritten in place with the states after its tokens."""
        seq_starts, past_lens, slots = (
            [int(s) for s in seq_starts],
            [int(p) for p in past_lens],
            [int(s) for s in slots],
        )
        self._check_step(x, seq_starts, past_lens, slots, conv_state, recurrent_state)
        T = x.shape[0]
        cols = self.in_proj_qkv(x)  # [T, conv_dim]
        z = self.in_proj_z(x)
        beta = torch.sigmoid(self.in_proj_b(x)).float()  # [T, Hv]
        g = self._neg_decay() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())
        if self._kernel_serves(x, conv_state, recurrent_state):
            meta = torch.tensor([*seq_starts, *past_lens, *slots], dtype=torch.int32).to(x.device)
            core = self._core_kernels(cols, g, beta, meta, len(slots), conv_state, recurrent_state)
            normed = self.norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
            return self.out_proj(normed.reshape(T, self.value_dim))
        core = torch.empty(T, self.num_v_heads, self.head_v_dim, dtype=torch.float32, device=x.device)

        lens = [b - a for a, b in zip(seq_starts, seq_starts[1:])]
        decode = [s for s in range(len(lens)) if lens[s] == 1 and past_lens[s] > 0]
        others = [s for s in range(len(lens)) if not (lens[s] == 1 and past_lens[s] > 0)]

        if decode:
            # One token of each: their tokens, slots and states gathered into a batch.
            tok = torch.tensor([seq_starts[s] for s in decode], device=x.device)
            slot_ids = torch.tensor([slots[s] for s in decode], device=x.device)
            core[tok] = self._recurrent(cols[tok], g[tok], beta[tok], slot_ids, conv_state, recurrent_state)

        for s in others:
            a, b, slot = seq_starts[s], seq_starts[s + 1], slots[s]
            fresh = past_lens[s] == 0
            past = torch.zeros_like(conv_state[slot]) if fresh else conv_state[slot]
            mixed, new_past = self._conv(cols[a:b].T.unsqueeze(0), past.unsqueeze(0))
            conv_state[slot] = new_past[0]
            q, k, v = self._heads(mixed[0].T)
            o, new_state = chunked_delta_rule(
                q.transpose(0, 1),
                k.transpose(0, 1),
                v.transpose(0, 1),
                g[a:b].T,
                beta[a:b].T,
                None if fresh else recurrent_state[slot],
            )
            recurrent_state[slot] = new_state
            core[a:b] = o.transpose(0, 1)

        normed = self.norm(core.to(x.dtype).reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(normed.reshape(T, self.value_dim))
