"""Qwen4Exp's full-attention layer over a packed step with a per-slot KV cache.

The layer (transformers' ``Qwen4ExpTextAttention``) is gated attention: ``q_proj`` yields
a query and an output gate per head, q and k pass a per-head offset RMSNorm, the first
``rot_dim = int(head_dim * partial_rotary_factor)`` features of each head are rotated
(rotate-half RoPE), and the attention output is multiplied by ``sigmoid(gate)`` before
``o_proj``.

Every full-attention layer of the published model carries the QSA token indexer, which
restricts each query to a few key blocks: the positions a query sees (``0..pos``) split
into complete groups of ``compress_ratio`` tokens; each group's key is the float32 mean
of its raw indexer keys, normalized and rotated at the group's first position; a query
(indexer heads, normalized and rotated at its own position) scores a group by the sum
over heads of ``relu(q . k)`` / sqrt(indexer_head_dim) and keeps the top
``budget // compress_ratio`` groups. The incomplete tail after the last complete group is
always kept. The raw indexer keys live in the slot cache beside K and V, because a
group's key changes with nothing but the tokens in it and is cheap to pool again.

Sequences of a step are handled one at a time (their caches and visible lengths differ);
within one sequence all queries are scored against all complete groups at once, and only
queries that see more groups than they may keep run a top-k (grouped by how many groups
they see, so each top-k is over exactly the groups its queries see, as the reference's).

A decode-only step on CUDA (:meth:`GatedAttention.forward_decode`) runs the core, from the
normed and rotated q / k and the indexer's queries and raw keys to the gated output's
input, as ONE call of the kernel library's QSA attention (``engram_qsa_attention``, the
EngramQsaAttention plugin's math, :mod:`engram_trt.native.qsa`) when ``backend`` allows
and the kernel takes the shapes: it writes the step's k / v / raw keys at each token's
position, pools each query's visible blocks, selects and attends, reading every position
and slot from the step's device metadata. So the step reads the slots' caches up to each
query's own position (not a padded context) and a decode graph serves every length.
The torch decode path (every block of a padded context pooled again each step, about
forty launches a layer) serves the rest and is the kernel's reference; ties at the
top-k cut go to the lower block in the kernel (models/qwen4_exp/reference_qsa.py), where torch's
``topk`` has no rule.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engram_trt.errors import ConfigError, EngramError
from engram_trt.models.qwen4_exp.norms import OffsetRMSNorm

_INDEXER_FIELDS = (
    "indexer_n_heads",
    "indexer_kv_heads",
    "indexer_head_dim",
    "indexer_budget",
    "indexer_compress_ratio",
)


def _rope_fields(config: Any) -> tuple[float, float]:
    """``(theta, partial_rotary_factor)`` of the config's default RoPE; any other type is
    refused, since only the plain frequencies are implemented here."""
    params = getattr(config, "rope_parameters", None) or {}
    if not isinstance(params, dict):
        params = dict(params)
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        raise ConfigError(
            f"rope_parameters.rope_type is {rope_type!r}; Qwen4Exp attention supports only 'default' RoPE"
        )
    if "rope_theta" not in params:
        raise ConfigError("rope_parameters.rope_theta is missing; set the RoPE base of the checkpoint")
    return float(params["rope_theta"]), float(params.get("partial_rotary_factor", 1.0))


def rotary_dim(config: Any) -> int:
    """How many leading features of each head RoPE rotates."""
    _, factor = _rope_fields(config)
    return int(config.head_dim * factor)


def rope_cos_sin(config: Any, positions: Tensor) -> tuple[Tensor, Tensor]:
    """cos and sin ``[n, rot_dim]`` (float32) of the text RoPE at ``positions``.

    Text tokens carry three equal mrope position components, so the model's per-section
    recomposition picks every frequency from an identical table and is the identity:
    the table is plain RoPE over ``rot_dim`` features, each frequency written twice
    (rotate-half layout). The attention scaling of default RoPE is 1."""
    theta, _ = _rope_fields(config)
    dim = rotary_dim(config)
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device) / dim))
    freqs = positions.reshape(-1, 1).to(torch.float32) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_partial_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the first ``cos.shape[-1]`` features of ``x [n, heads, d]`` (rotate-half
    pairs) and leave the rest; cos / sin are ``[n, rot_dim]``. Computed in x's dtype
    after casting the tables to it, as the reference does."""
    rot = cos.shape[-1]
    cos = cos.to(x.dtype).unsqueeze(-2)
    sin = sin.to(x.dtype).unsqueeze(-2)
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)


def _require_int(config: Any, name: str) -> int:
    value = getattr(config, name, None)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{name} is {value!r}; an indexed_attention layer needs a positive integer there")
    return value


class QSAIndexer(nn.Module):
    """The QSA token indexer's weights (``self_attn.indexer.*``) and its selection."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        for name in _INDEXER_FIELDS:
            _require_int(config, name)
        if config.indexer_kv_heads != 1:
            raise ConfigError(
                f"indexer_kv_heads is {config.indexer_kv_heads}; Qwen4Exp's QSA indexer has exactly one key head"
            )
        if config.indexer_budget % config.indexer_compress_ratio:
            raise ConfigError(
                f"indexer_budget {config.indexer_budget} is not a multiple of indexer_compress_ratio "
                f"{config.indexer_compress_ratio}; the budget is counted in whole blocks"
            )
        rot = rotary_dim(config)
        if rot > config.indexer_head_dim:
            raise ConfigError(
                f"indexer_head_dim {config.indexer_head_dim} is smaller than the rotary dims {rot}; "
                "the indexer rotates its heads with the attention's RoPE table"
            )
        self.n_heads = config.indexer_n_heads
        self.head_dim = config.indexer_head_dim
        self.compress_ratio = config.indexer_compress_ratio
        self.block_topk = config.indexer_budget // config.indexer_compress_ratio
        self.index_qk_proj = nn.Linear(config.hidden_size, (self.n_heads + 1) * self.head_dim, bias=False)
        self.q_layernorm = OffsetRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_layernorm = OffsetRMSNorm(self.head_dim, config.rms_norm_eps)
        # A tensor-parallel rank projects its share of the query heads (models.parallel):
        # the queries are all-gathered, so the blocks are scored over every head.
        self.tp: Any = None

    @property
    def query_heads(self) -> int:
        """The query heads a block score sums over (every rank's)."""
        return self.n_heads * (self.tp.size if self.tp is not None else 1)

    def project(self, x: Tensor, cos: Tensor, sin: Tensor, qk: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Queries ``[T, query_heads, d]`` (normalized, rotated; a tensor-parallel rank's
        gathered from the others) and raw keys ``[T, d]`` (what the cache keeps: pooling
        comes before the key norm). ``qk``: ``index_qk_proj(x)`` when the caller made it."""
        from engram_trt.models.parallel import gather_heads

        if qk is None:
            qk = self.index_qk_proj(x)
        q, raw_keys = qk.split([self.n_heads * self.head_dim, self.head_dim], dim=-1)
        q = self.q_layernorm(q.reshape(x.shape[0], self.n_heads, self.head_dim))
        return gather_heads(apply_partial_rope(q, cos, sin), self.tp, 1), raw_keys

    def block_keys(self, config: Any, raw_keys: Tensor) -> Tensor:
        """The pooled key ``[n_blocks, d]`` of every complete block of ``raw_keys [L, d]``:
        the float32 mean of its raw keys (rounded back to their dtype), normalized, then
        rotated at the block's first position."""
        r = self.compress_ratio
        n_blocks = raw_keys.shape[0] // r
        groups = raw_keys[: n_blocks * r].reshape(n_blocks, r, self.head_dim)
        pooled = self.k_layernorm(groups.float().mean(dim=1).to(raw_keys.dtype))
        starts = torch.arange(n_blocks, device=raw_keys.device) * r
        cos, sin = rope_cos_sin(config, starts)
        return apply_partial_rope(pooled.unsqueeze(1), cos, sin).squeeze(1)

    def selection_mask(self, q: Tensor, block_keys: Tensor, past_len: int, kv_len: int) -> Tensor:
        """``[n, kv_len]`` bool: which cached positions each of the ``n`` new queries
        (at positions ``past_len..``) attends to, the causal limit included."""
        n = q.shape[0]
        r = self.compress_ratio
        device = q.device
        query_pos = torch.arange(past_len, past_len + n, device=device)
        key_pos = torch.arange(kv_len, device=device)
        causal = key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)
        # A query at position p sees p + 1 tokens, hence (p + 1) // r complete blocks.
        seen_blocks = [(past_len + i + 1) // r for i in range(n)]
        if max(seen_blocks, default=0) <= self.block_topk:
            return causal  # every block it sees fits the budget: nothing dropped
        scores = torch.einsum("qhd,bd->qbh", q.float(), block_keys.float())
        scores = scores.relu().sum(dim=-1) / math.sqrt(self.head_dim)  # [n, n_blocks]
        mask = causal.clone()
        i = 0
        while i < n:
            nb = seen_blocks[i]
            j = i
            while j < n and seen_blocks[j] == nb:
                j += 1
            if nb > self.block_topk:
                chosen = scores[i:j, :nb].topk(self.block_topk, dim=-1).indices  # [g, k]
                keep = torch.zeros(j - i, nb, dtype=torch.bool, device=device)
                keep.scatter_(1, chosen, True)
                # Positions in complete blocks follow `keep`; the tail after them stays.
                mask[i:j, : nb * r] &= keep.repeat_interleave(r, dim=1)
            i = j
        return mask

    def decode_mask(
        self, config: Any, q: Tensor, raw_keys: Tensor, positions: Tensor, seen_host: list[int] | None = None
    ) -> Tensor:
        """``[G, L]`` bool for a decode-only step: which of the first ``L`` cached
        positions of each of the ``G`` slots its one query (at ``positions[g]``, whose key
        is already in ``raw_keys [G, L, d]``) attends to, the causal limit included.

        The blocks are pooled over all ``L // r`` complete blocks of ``L`` for every slot
        (fixed shapes: what a CUDA graph records); a slot scores only the blocks it sees.
        ``seen_host``: each query's complete-block count known on the host, then the top-k
        runs per query over exactly its blocks as :meth:`selection_mask` does (the same
        tie-breaking as the per-sequence path, which the CPU's parity with transformers
        relies on: relu scores tie at 0); None: one top-k over the padded scores
        (:meth:`select_blocks`, no host values), equal whenever no two scores tie."""
        r = self.compress_ratio
        G, L, _ = raw_keys.shape
        key_pos = torch.arange(L, device=raw_keys.device)
        causal = key_pos.unsqueeze(0) <= positions.unsqueeze(1)
        n_blocks = L // r
        if n_blocks <= self.block_topk:
            return causal  # no query sees more blocks than it may keep
        groups = raw_keys[:, : n_blocks * r].reshape(G, n_blocks, r, self.head_dim)
        pooled = self.k_layernorm(groups.float().mean(dim=2).to(raw_keys.dtype))  # [G, nb, d]
        cos, sin = rope_cos_sin(config, torch.arange(n_blocks, device=raw_keys.device) * r)
        blocks = apply_partial_rope(pooled.transpose(0, 1), cos, sin).transpose(0, 1)  # [G, nb, d]
        scores = torch.einsum("ghd,gbd->gbh", q.float(), blocks.float())
        scores = scores.relu().sum(dim=-1) / math.sqrt(self.head_dim)  # [G, nb]
        seen = torch.div(positions + 1, r, rounding_mode="floor")
        if seen_host is None:
            allowed = self.select_blocks(scores, seen)
        else:
            allowed = torch.ones(G, n_blocks, dtype=torch.bool, device=raw_keys.device)
            for g, nb in enumerate(seen_host):
                if nb > self.block_topk:
                    chosen = scores[g : g + 1, :nb].topk(self.block_topk, dim=-1).indices  # [1, k], as selection_mask
                    allowed[g, :nb] = torch.zeros(1, nb, dtype=torch.bool, device=raw_keys.device).scatter_(
                        1, chosen, True
                    )[0]
        tail = torch.ones(G, L - n_blocks * r, dtype=torch.bool, device=raw_keys.device)
        return causal & torch.cat([allowed.repeat_interleave(r, dim=1), tail], dim=1)

    def select_blocks(self, scores: Tensor, seen: Tensor) -> Tensor:
        """``[G, nb]`` bool: the blocks each row may read. Row g sees its first
        ``seen[g]`` blocks; past the budget it keeps the ``block_topk`` best scored of
        them, and every block it does not see yet is left to the causal mask (the tail
        after its last complete block is always kept)."""
        G, nb = scores.shape
        idx = torch.arange(nb, device=scores.device).unsqueeze(0)
        unseen = idx >= seen.unsqueeze(1)
        chosen = scores.masked_fill(unseen, float("-inf")).topk(self.block_topk, dim=-1).indices
        keep = torch.zeros(G, nb, dtype=torch.bool, device=scores.device).scatter_(1, chosen, True)
        return keep | unseen | (seen <= self.block_topk).unsqueeze(1)


QSA_BACKENDS = ("auto", "kernels", "torch")


class GatedAttention(nn.Module):
    """One full-attention layer (``model.layers.{i}.self_attn``) over a packed step.

    ``backend``: the decode step's core on ``auto`` (the QSA kernel where it serves, else
    torch), ``kernels`` (the kernel or an EngramError naming why not) or ``torch``; a
    class default, settable per layer (see the module docstring)."""

    backend: str = "auto"

    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        for name in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
            _require_int(config, name)
        if config.num_attention_heads % config.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads {config.num_attention_heads} is not a multiple of num_key_value_heads "
                f"{config.num_key_value_heads}; each key head must serve a whole group of query heads"
            )
        rot = rotary_dim(config)
        if rot % 2 or rot > config.head_dim:
            raise ConfigError(
                f"head_dim {config.head_dim} x partial_rotary_factor gives {rot} rotary dims; "
                "it must be even and at most head_dim"
            )
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scaling = self.head_dim**-0.5
        bias = bool(getattr(config, "attention_bias", False))
        hidden, hd = config.hidden_size, self.head_dim
        self.q_proj = nn.Linear(hidden, self.num_heads * hd * 2, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * hd, hidden, bias=bias)
        self.q_norm = OffsetRMSNorm(hd, config.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(hd, config.rms_norm_eps)
        self.indexer = QSAIndexer(config)

    def qsa_fields(self) -> Any:
        """The QSA kernel's fields of this layer (``native.qsa.QsaFields``)."""
        from engram_trt.native.qsa import QsaFields

        theta, _ = _rope_fields(self.config)
        ix = self.indexer
        return QsaFields(
            compress_ratio=ix.compress_ratio,
            block_topk=ix.block_topk,
            rot_dim=rotary_dim(self.config),
            rope_theta=theta,
            eps=float(self.config.rms_norm_eps),
            scaling=float(self.scaling),
        )

    def why_not_kernel(self, x: Tensor, key_cache: Tensor | None = None) -> str | None:
        """Why the decode core cannot run on the QSA kernel for activations like ``x``
        (and caches like ``key_cache``); None: it can."""
        if self.backend not in QSA_BACKENDS:
            raise EngramError(f"GatedAttention.backend {self.backend!r} is not one of {list(QSA_BACKENDS)}")
        if self.backend == "torch":
            return "backend torch"
        if not x.is_cuda:
            return f"the activations are on {x.device}, not a CUDA device"
        if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return f"the activations are {x.dtype}, not bfloat16, float16 or float32"
        if key_cache is not None and (key_cache.dtype != x.dtype or not key_cache.is_cuda):
            return f"the caches are {key_cache.dtype} on {key_cache.device}; the kernel wants them in {x.dtype} on CUDA"
        from engram_trt.native import qsa

        why = qsa.unavailable("QSA attention CUDA kernel")
        if why is not None:
            return why
        try:
            qsa.check_fields(self.qsa_fields())
            qsa.check_shape(
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                self.indexer.query_heads,
                self.indexer.head_dim,
                rotary_dim(self.config),
            )
        except EngramError as exc:
            return str(exc)
        return None

    def kernel_serves(self, x: Tensor, key_cache: Tensor | None = None) -> bool:
        """Whether :meth:`forward_decode` takes the QSA kernel (``kernels``: or raises why not)."""
        why = self.why_not_kernel(x, key_cache)
        if why is not None and self.backend == "kernels":
            raise EngramError(
                f"attention backend 'kernels' cannot run layer {self.layer_idx}: {why}; use backend 'auto' or 'torch'"
            )
        return why is None

    @staticmethod
    def cache_shapes(config: Any, max_len: int) -> dict[str, tuple[int, ...]]:
        """Each slot's cache tensors for this layer; the caller stacks slots in front."""
        kv = (config.num_key_value_heads, max_len, config.head_dim)
        return {"key": kv, "value": kv, "index_key": (max_len, config.indexer_head_dim)}

    def _check_step(
        self,
        x: Tensor,
        positions: Tensor,
        seq_starts: list[int],
        past_lens: list[int],
        slots: list[int],
        key_cache: Tensor,
        value_cache: Tensor,
        index_key_cache: Tensor,
    ) -> None:
        t = x.shape[0]
        n_seq = len(seq_starts) - 1
        if x.dim() != 2 or x.shape[1] != self.config.hidden_size:
            raise EngramError(f"x has shape {tuple(x.shape)}; pass [tokens, {self.config.hidden_size}]")
        if positions.shape != (t,):
            raise EngramError(f"positions has shape {tuple(positions.shape)}; pass one position per token ({t})")
        if n_seq < 0 or seq_starts[0] != 0 or seq_starts[-1] != t:
            raise EngramError(f"seq_starts {seq_starts} must run from 0 to the token count {t}")
        if any(b < a for a, b in zip(seq_starts, seq_starts[1:])):
            raise EngramError(f"seq_starts {seq_starts} must not decrease")
        if len(past_lens) != n_seq or len(slots) != n_seq:
            raise EngramError(
                f"{n_seq} sequences but {len(past_lens)} past_lens and {len(slots)} slots; "
                "pass one of each per sequence"
            )
        if len(set(slots)) != n_seq:
            raise EngramError(f"slots {slots} repeat; each sequence of a step owns its own slot")
        n_slots, _, max_len, _ = key_cache.shape
        want = self.cache_shapes(self.config, max_len)
        for name, cache in (("key", key_cache), ("value", value_cache), ("index_key", index_key_cache)):
            if tuple(cache.shape[1:]) != want[name] or cache.shape[0] != n_slots:
                raise EngramError(
                    f"{name}_cache has shape {tuple(cache.shape)}; allocate [{n_slots}, *{want[name]}] "
                    "(GatedAttention.cache_shapes)"
                )
        for s in range(n_seq):
            if not 0 <= slots[s] < n_slots:
                raise EngramError(f"slot {slots[s]} is outside the cache's {n_slots} slots")
            end = past_lens[s] + seq_starts[s + 1] - seq_starts[s]
            if past_lens[s] < 0 or end > max_len:
                raise EngramError(
                    f"sequence {s} would reach length {end} (past_len {past_lens[s]}); the cache holds {max_len} "
                    "positions: allocate a longer cache"
                )

    def forward(
        self,
        x: Tensor,
        positions: Tensor,
        seq_starts: list[int],
        past_lens: list[int],
        slots: list[int],
        key_cache: Tensor,
        value_cache: Tensor,
        index_key_cache: Tensor,
    ) -> Tensor:
        """Attend the step's tokens ``x [T, hidden]`` over their slots' caches.

        ``positions[j]`` must be ``past_len + i`` for the i-th new token of its sequence
        (cache index and RoPE position are the same thing here). The new tokens' K
        (normalized, rotated), V and raw indexer keys are written into the caches at
        ``past_len..`` first, then each query attends causally over its slot, limited to
        the blocks its indexer keeps."""
        self._check_step(x, positions, seq_starts, past_lens, slots, key_cache, value_cache, index_key_cache)
        t = x.shape[0]
        h, kvh, hd = self.num_heads, self.num_kv_heads, self.head_dim
        cos, sin = rope_cos_sin(self.config, positions)

        query, gate = self.q_proj(x).reshape(t, h, 2 * hd).chunk(2, dim=-1)
        gate = gate.reshape(t, h * hd)
        query = apply_partial_rope(self.q_norm(query), cos, sin)
        key = apply_partial_rope(self.k_norm(self.k_proj(x).reshape(t, kvh, hd)), cos, sin)
        value = self.v_proj(x).reshape(t, kvh, hd)
        index_q, index_raw = self.indexer.project(x, cos, sin)

        out = x.new_empty(t, h * hd)
        for s, slot in enumerate(slots):
            a, b = seq_starts[s], seq_starts[s + 1]
            n, past = b - a, past_lens[s]
            if n == 0:
                continue
            kv_len = past + n
            key_cache[slot, :, past:kv_len] = key[a:b].transpose(0, 1).to(key_cache.dtype)
            value_cache[slot, :, past:kv_len] = value[a:b].transpose(0, 1).to(value_cache.dtype)
            index_key_cache[slot, past:kv_len] = index_raw[a:b].to(index_key_cache.dtype)

            raw = index_key_cache[slot, :kv_len].to(index_raw.dtype)
            blocks = self.indexer.block_keys(self.config, raw)
            mask = self.indexer.selection_mask(index_q[a:b], blocks, past, kv_len)  # [n, kv_len]

            k = key_cache[slot, :, :kv_len].to(torch.float32).repeat_interleave(h // kvh, dim=0)  # [h, L, hd]
            v = value_cache[slot, :, :kv_len].to(query.dtype).repeat_interleave(h // kvh, dim=0)
            q = query[a:b].transpose(0, 1).to(torch.float32)  # [h, n, hd]
            scores = torch.matmul(q, k.transpose(1, 2)) * self.scaling
            scores = scores.masked_fill(~mask, float("-inf"))
            probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
            out[a:b] = torch.matmul(probs, v).transpose(0, 1).reshape(n, h * hd)

        return self.o_proj(out * torch.sigmoid(gate))

    def forward_decode(
        self,
        x: Tensor,
        positions: Tensor,
        slots: Tensor,
        context: int,
        key_cache: Tensor,
        value_cache: Tensor,
        index_key_cache: Tensor,
        seen_host: list[int] | None = None,
        *,
        meta: Tensor | None = None,
    ) -> Tensor:
        """A decode-only step: token ``j`` of ``x [G, hidden]`` sits at ``positions[j]``
        of slot ``slots[j]`` (device tensors; distinct slots). All slots at once over
        their first ``context`` cache positions (>= every ``positions + 1``; later ones
        are masked), no host values beyond ``context``: what the decode CUDA graphs
        record. The math of :meth:`forward` (K in float32, probabilities rounded to the
        activations' dtype before V); ``seen_host``: see :meth:`QSAIndexer.decode_mask`.
        ``meta``: the step's int32 ``[seq_starts (G+1), positions (G), slots (G)]`` on the
        device (``Qwen4ExpModel.decode_views``); with it the core runs on the QSA kernel
        where it serves (module docstring), ``context`` and ``seen_host`` unused."""
        G = x.shape[0]
        h, kvh, hd = self.num_heads, self.num_kv_heads, self.head_dim
        if context > key_cache.shape[2]:
            raise EngramError(f"decode context {context} is longer than the cache's {key_cache.shape[2]} positions")
        cos, sin = rope_cos_sin(self.config, positions)
        from engram_trt.models.qwen4_exp import fused

        # a bf16 step on a GPU: the four projections of x in one GEMV launch (fused.project)
        projected = fused.project(x, [self.q_proj, self.k_proj, self.v_proj, self.indexer.index_qk_proj])
        q_out, k_out, v_out, qk = projected or (self.q_proj(x), self.k_proj(x), self.v_proj(x), None)
        query, gate = q_out.reshape(G, h, 2 * hd).chunk(2, dim=-1)
        gate = gate.reshape(G, h * hd)
        query = apply_partial_rope(self.q_norm(query), cos, sin)
        key = apply_partial_rope(self.k_norm(k_out.reshape(G, kvh, hd)), cos, sin)
        value = v_out.reshape(G, kvh, hd)
        index_q, index_raw = self.indexer.project(x, cos, sin, qk=qk)
        if meta is not None and self.kernel_serves(x, key_cache):
            from engram_trt.native.qsa import qsa_attention

            out = qsa_attention(
                query.contiguous(),
                key.contiguous(),
                value.contiguous(),
                index_q.contiguous(),
                index_raw.contiguous(),
                key_cache,
                value_cache,
                index_key_cache,
                self.indexer.k_layernorm.weight,
                meta[2 * G + 1 : 3 * G + 1],
                meta[G + 1 : 2 * G + 1],
                self.qsa_fields(),
            )
            return self._output(out * torch.sigmoid(gate))
        key_cache[slots, :, positions] = key.to(key_cache.dtype)
        value_cache[slots, :, positions] = value.to(value_cache.dtype)
        index_key_cache[slots, positions] = index_raw.to(index_key_cache.dtype)

        raw = index_key_cache[slots, :context].to(index_raw.dtype)  # [G, L, d]
        mask = self.indexer.decode_mask(self.config, index_q, raw, positions, seen_host)  # [G, L]
        k = key_cache[slots, :, :context].to(torch.float32)  # [G, kvh, L, hd]
        v = value_cache[slots, :, :context].to(query.dtype)
        q = query.to(torch.float32).reshape(G, kvh, h // kvh, hd)  # query head j reads kv head j // (h / kvh)
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scaling  # [G, kvh, h / kvh, L]
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        out = torch.matmul(probs, v).reshape(G, h * hd)
        return self._output(out * torch.sigmoid(gate))

    def _output(self, gated: Tensor) -> Tensor:
        """``o_proj(gated)``: a bf16 decode step's through the GEMV (fused.project)."""
        from engram_trt.models.qwen4_exp import fused

        out = fused.project(gated, [self.o_proj])
        return self.o_proj(gated) if out is None else out[0]
