"""The bf16 CUDA path of a DeepSeek-V4 layer's glue: what the layer does around its
attention kernel and its MoE in a few launches (:mod:`engram_trt.native.decode`, the
fused norms of :mod:`engram_trt.native.mhc`) instead of the PyTorch reference's dozens of
small element-wise kernels, which made a graphed decode step launch bound (issue 41: a
1.63B model's step was 12x its weight-read floor, each module a chain of 2-5 us kernels).

Per layer, with the step's tokens ``x [T, D]`` (bf16 on a GPU of compute capability 9.0+):

* the mHC collapse with the RMSNorm after it (``input_layernorm`` /
  ``post_attention_layernorm``; the final ``norm`` after the hyper head): the norm runs in
  the collapse's last launch (:meth:`~.modules.HyperConnection.collapse_normed`);
* attention (:func:`attention`): ONE product launch for every projection of x (``q_a``,
  ``kv``, on CSA / HCA layers the compressor's and the indexer's), one for ``q_b`` (and the
  indexer's ``q_b``) with ``q_a_norm`` in its prologue, one element-wise launch for the
  per-head norm + RoPE of q, ``kv_norm`` + RoPE (and the indexer queries' RoPE), the
  attention kernel, one for the grouped ``o_a`` (its groups as segments of one launch)
  with the inverse RoPE of the core's output in its prologue, one for ``o_b``: five
  launches around the core (the prologues' norm and rotation are the element-wise
  launches' own arithmetic, so the bits are theirs; ``ENGRAM_TRT_DSV4_PROLOGUE=0`` runs
  them as launches of their own, for A/B); with stored-format (FP8) ``q_b`` / ``o_a``
  weights the stored-format segments' prologues do the same
  (``ENGRAM_TRT_DSV4_QUANT_PROLOGUE=1``, opt-in: its GPU tests pass, but the step with it
  was not faster on an H100 (docs/benchmarks.md); else the norm and the inverse RoPE
  launch first);
* the MoE (:func:`moe`): one launch for the router's logits, one for its picks and
  weights, two for the routed experts with the shared expert (combined in the reference's
  order); a step of more tokens than the GEMV takes, up to ``BATCH_ROUTE_MAX_TOKENS`` (a
  batch of decode streams), keeps the router's picks in one launch and runs the routed
  experts through the library's grouped product, or, with ``ENGRAM_TRT_DSV4_MOE_GROUPED=1``
  (opt-in: not yet run on a GPU) and plain bf16 experts, the routed and the shared experts
  through ONE ``moe_experts_grouped`` call (three launches: each picked expert's weights
  read once a step, the moe_experts contract's roundings).

The products take the GEMV for up to ``native.decode.GEMV_EX_MAX_TOKENS`` rows of bf16
weights; otherwise (a prefill chunk, a stored-format weight) each projection runs as its
module does, and the element-wise launches stay. Every kernel rounds where the reference
rounds (engramKernels.h), so this path differs from the PyTorch one by float32 sums'
order only (tests/gpu/test_dsv4_fused.py holds each kernel to the module it replaces).
float32 and float16 models, CPUs and older GPUs keep the PyTorch glue; so does everything
with ``ENGRAM_TRT_DSV4_FUSED=0`` (an A/B switch for timing).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

FUSED_ENV = "ENGRAM_TRT_DSV4_FUSED"
QUANT_STATIC_ENV = "ENGRAM_TRT_DSV4_QUANT_STATIC"
QUANT_FUSED_ENV = "ENGRAM_TRT_DSV4_QUANT_FUSED"  # 0: stored-format weights one launch each (the A/B switch)
# the router's picks in one launch for steps up to this many tokens (a batch of decode streams)
BATCH_ROUTE_MAX_TOKENS = 64
PROLOGUE_ENV = "ENGRAM_TRT_DSV4_PROLOGUE"  # "0": q_a_norm and the inverse RoPE as their own launches (A/B)
# "1": the stored-format segments take those prologues too (opt-in: not faster where measured); PROLOGUE_ENV=0 wins
QUANT_PROLOGUE_ENV = "ENGRAM_TRT_DSV4_QUANT_PROLOGUE"
# "1": a batch step's (9..BATCH_ROUTE_MAX_TOKENS tokens) plain bf16 experts through moe_experts_grouped (opt-in)
MOE_GROUPED_ENV = "ENGRAM_TRT_DSV4_MOE_GROUPED"


def unavailable(x: Tensor) -> str | None:
    """Why the fused glue does not take activations like ``x`` (None: it does;
    :func:`engram_trt.native.decode.glue_unavailable` with ``ENGRAM_TRT_DSV4_FUSED``)."""
    from engram_trt.native import decode

    return decode.glue_unavailable(x, FUSED_ENV)


def _f32(t: Tensor) -> Tensor:
    return t if t.dtype == torch.float32 else t.float()


def _stored_format(x: Tensor, mod: nn.Module) -> Tensor | None:
    """A bias-free stored-format projection (``QuantLinear``) of ``x`` on the library's
    kernels with ``weight_static`` (a model's weight: nothing in the step writes it, so the
    GEMV loads it while the kernel before it runs), or None where the module's own forward
    must run (its backend, no CUDA kernel for it, ``ENGRAM_TRT_DSV4_QUANT_STATIC=0``)."""
    from engram_trt.quant.weight import QuantLinear

    if (
        not isinstance(mod, QuantLinear)
        or mod.bias is not None
        or mod.backend == "torch"
        or os.environ.get(QUANT_STATIC_ENV, "1") == "0"
    ):
        return None
    from engram_trt.native import quant as native_quant

    qw = mod.qweight
    if native_quant.unavailable_for(x, qw) is not None:
        return None
    return native_quant.linear(x, qw, weight_static=True)


def _quant_fused() -> Any:
    """:mod:`engram_trt.native.quant_decode` when the stored-format decode kernels serve
    (``ENGRAM_TRT_DSV4_QUANT_FUSED`` not 0, the library has them), else None."""
    if os.environ.get(QUANT_FUSED_ENV, "1") == "0":
        return None
    from engram_trt.native import quant_decode

    return quant_decode if quant_decode.unavailable() is None else None


def _quant_prologue() -> Any:
    """:func:`_quant_fused`'s module where its segments take the GEMV prologues
    (``ENGRAM_TRT_DSV4_QUANT_PROLOGUE=1`` and ``ENGRAM_TRT_DSV4_PROLOGUE`` not 0), else None."""
    if os.environ.get(QUANT_PROLOGUE_ENV, "0") != "1" or os.environ.get(PROLOGUE_ENV, "1") == "0":
        return None
    return _quant_fused()


def _out_features(w: Any) -> int:
    """Output width of a segment weight (a QuantWeight's ``out_features``, a tensor's rows)."""
    return int(w.shape[0]) if isinstance(w, Tensor) else int(w.out_features)


def _segment_weight(x: Tensor, mod: nn.Module, qd: Any) -> Any:
    """The weight :func:`engram_trt.native.quant_decode.gemv_segments` takes for ``mod(x)``
    (a bias-free QuantLinear's stored weight, or a bias-free bf16 Linear's), or None."""
    from engram_trt.quant.weight import QuantLinear

    if isinstance(mod, QuantLinear):
        if mod.bias is not None or mod.backend == "torch":
            return None
        w: Any = mod.qweight
    elif isinstance(mod, nn.Linear) and mod.bias is None:
        w = mod.weight
    else:
        return None
    return w if qd.segment_reason(x, w) is None else None


def _project_stored(x: Tensor, mods: list[nn.Module], qd: Any) -> list[Tensor] | None:
    """``project`` with the stored-format projections (and the bf16 ones beside them) in
    one launch of :func:`engram_trt.native.quant_decode.gemv_segments`; None when no
    stored-format projection fits it (the bf16 GEMV's path)."""
    from engram_trt.quant.weight import QuantLinear

    weights = [_segment_weight(x, m, qd) for m in mods]
    if not any(w is not None and isinstance(m, QuantLinear) for m, w in zip(mods, weights)):
        return None
    outs: list[Tensor] = []
    segments = []
    for mod, w in zip(mods, weights):
        if w is None:
            outs.append(mod(x))
            continue
        out = torch.empty((x.shape[0], _out_features(w)), dtype=x.dtype, device=x.device)
        segments.append((x, w, out))
        outs.append(out)
    for first in range(0, len(segments), qd.MAX_SEGMENTS):
        qd.gemv_segments(segments[first : first + qd.MAX_SEGMENTS])
    return outs


def project(x: Tensor, mods: list[nn.Module]) -> list[Tensor]:
    """Each module's output for ``x [T, K]``: where a stored-format projection (QuantLinear)
    is among them and the step is a decode step's few rows, the stored-format and bf16 ones
    in one launch (:func:`_project_stored`); otherwise the plain bias-free bf16
    ``nn.Linear`` ones the GEMV takes in one launch
    (:func:`engram_trt.native.decode.gemv_segments`, a segment each), a stored-format one
    through the library's product with ``weight_static`` (:func:`_stored_format`), the
    others through their own forward (a prefill chunk)."""
    from engram_trt.native import decode

    qd = _quant_fused()
    if qd is not None:
        stored = _project_stored(x, mods, qd)
        if stored is not None:
            return stored
    outs: list[Tensor] = []
    segments = []
    for mod in mods:
        w = mod.weight if isinstance(mod, nn.Linear) and mod.bias is None else None
        if w is not None and decode.gemv_fits(x, w):
            out = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
            segments.append((x, w, out))
        else:
            stored = _stored_format(x, mod)
            out = stored if stored is not None else mod(x)
        outs.append(out)
    for first in range(0, len(segments), decode.MAX_SEGMENTS):
        decode.gemv_segments(segments[first : first + decode.MAX_SEGMENTS])
    return outs


def attention(
    attn: Any, x: Tensor, cos: Tensor, sin: Tensor, n_seqs: int, meta: Tensor, state: dict[str, Tensor]
) -> Tensor:
    """:meth:`~.attention.DeepseekV4Attention.forward` on the kernel core with the fused glue
    (module docstring): ``[T, hidden]``, the state updated in place."""
    from engram_trt.models.deepseek_v4 import attention_kernel
    from engram_trt.native import decode

    T, H, d = x.shape[0], attn.num_heads, attn.head_dim
    pairs = int(cos.shape[-1])
    comp = attn.compressor
    ix = comp.indexer if comp is not None else None
    mods: list[nn.Module] = [attn.q_a_proj, attn.kv_proj]
    if comp is not None:
        mods += [comp.kv_proj, comp.gate_proj]
    if ix is not None:
        mods += [ix.kv_proj, ix.gate_proj, ix.scorer.weights_proj]
    outs = project(x, mods)
    q_a, kv_raw = outs[0], outs[1]
    kv = torch.empty_like(kv_raw)
    Job = decode.NormRopeJob
    kv_job = Job(
        kv_raw,
        kv,
        dim=d,
        norm=decode.NORM_WEIGHTED,
        weight=_f32(attn.kv_norm.weight),
        eps=attn.kv_norm.eps,
        rope_pairs=pairs,
        cos=cos,
        sin=sin,
    )
    q_mods: list[nn.Module] = [attn.q_b_proj] + ([ix.q_b_proj] if ix is not None else [])
    q_residual: Tensor | None = None
    late: list[Any] = []  # jobs for the launch after q_b's
    q_outs = _normed_projection(attn.q_a_norm, q_a, q_mods)
    if q_outs is not None:  # q_a_norm in q_b's product launch; kv's norm + RoPE join the q heads' launch
        late.append(kv_job)
    else:
        q_residual = torch.empty_like(q_a)
        decode.norm_rope(
            Job(
                q_a,
                q_residual,
                dim=q_a.shape[1],
                norm=decode.NORM_WEIGHTED,
                weight=_f32(attn.q_a_norm.weight),
                eps=attn.q_a_norm.eps,
            ),
            kv_job,
        )
        q_outs = project(q_residual, q_mods)
    q = torch.empty_like(q_outs[0])
    jobs = [
        Job(
            q_outs[0], q, dim=d, heads=H, norm=decode.NORM_UNWEIGHTED, eps=attn.eps, rope_pairs=pairs, cos=cos, sin=sin
        ),
        *late,
    ]
    pre: dict[str, Tensor] = {}
    if comp is not None:
        pre["c_kv"], pre["c_gate"] = outs[2], outs[3]
    if ix is not None:
        i_q = torch.empty_like(q_outs[1])
        jobs.append(Job(q_outs[1], i_q, dim=ix.dim, heads=ix.heads, rope_pairs=pairs, cos=cos, sin=sin))
        pre.update(
            i_kv=outs[4], i_gate=outs[5], i_q=i_q.view(T, ix.heads, ix.dim), i_w=outs[6].float() * ix.heads**-0.5
        )
    decode.norm_rope(*jobs)
    # q_residual (None when q_b took the norm in its prologue) is read by the core only for the indexer's
    # queries, which pre always holds here
    out = attention_kernel.core(attn, x, q.view(T, H, d), kv, q_residual, cos, sin, n_seqs, meta, state, pre=pre)
    grouped = _grouped_output(attn, out.view(T, H * d), cos, sin, pairs)
    return project(grouped, [attn.o_b_proj])[0]


def _norm_prologue(norm: nn.Module, x: Tensor) -> Any:
    """The GEMV prologue of ``norm`` (a weighted RMSNorm) over ``x``'s rows, or None where
    none serves: an odd width or one above 2048 (:func:`~engram_trt.native.decode.norm_rope`
    keeps rows of up to 2048 in registers, and the prologue's sum is that form's),
    ``ENGRAM_TRT_DSV4_PROLOGUE=0``."""
    from engram_trt.native import decode

    if os.environ.get(PROLOGUE_ENV, "1") == "0" or x.shape[1] % 2 or x.shape[1] > 2048:
        return None
    return decode.GemvPrologue(decode.PROLOGUE_RMSNORM, int(x.shape[1]), weight=_f32(norm.weight), eps=norm.eps)


def _normed_projection(norm: nn.Module, x: Tensor, mods: list[nn.Module]) -> list[Tensor] | None:
    """Each module's output for ``norm(x)`` (q_a_norm, then q_b and the indexer's q_b) in
    one launch with the norm in its prologue: the bf16 GEMV's for plain bias-free bf16
    ``nn.Linear`` weights it fits, the stored-format segments' (:func:`_stored_prologue`)
    where a stored-format weight is among them; None where neither serves (the norm's
    own launch first)."""
    from engram_trt.native import decode

    prologue = _norm_prologue(norm, x)
    if prologue is None:
        return None
    if all(isinstance(m, nn.Linear) and m.bias is None and decode.gemv_fits(x, m.weight) for m in mods):
        outs = [torch.empty((x.shape[0], m.weight.shape[0]), dtype=x.dtype, device=x.device) for m in mods]
        decode.gemv_segments([(x, m.weight, o) for m, o in zip(mods, outs)], prologue=prologue)
        return outs
    return _stored_prologue(x, mods, prologue)


def _stored_prologue(x: Tensor, mods: list[nn.Module], prologue: Any) -> list[Tensor] | None:
    """:func:`_project_stored` of the prologue's output without its launch: every module a
    segment weight of :func:`engram_trt.native.quant_decode.gemv_segments`, a stored-format
    one among them, one launch taking ``prologue`` (:func:`_quant_prologue`); else None."""
    from engram_trt.quant.weight import QuantLinear

    qd = _quant_prologue()
    if qd is None or len(mods) > qd.MAX_SEGMENTS:
        return None
    weights = [_segment_weight(x, m, qd) for m in mods]
    if any(w is None for w in weights) or not any(isinstance(m, QuantLinear) for m in mods):
        return None
    outs = [torch.empty((x.shape[0], _out_features(w)), dtype=x.dtype, device=x.device) for w in weights]
    qd.gemv_segments([(x, w, o) for w, o in zip(weights, outs)], prologue=prologue)
    return outs


def _rope_prologue(d: int, per_in: int, pairs: int, cos: Tensor, sin: Tensor) -> Any:
    """The inverse RoPE of heads of ``d`` channels as a GEMV prologue for groups of
    ``per_in`` channels, or None where it cannot be one (a group not starting at a head,
    ``d`` not a multiple of 8, ``ENGRAM_TRT_DSV4_PROLOGUE=0``)."""
    from engram_trt.native import decode

    if per_in % d or d % 8 or os.environ.get(PROLOGUE_ENV, "1") == "0":
        return None
    return decode.GemvPrologue(decode.PROLOGUE_ROPE, d, rope_pairs=pairs, cos=cos, sin=sin, rope_sign=-1)


def _grouped_output(attn: Any, flat: Tensor, cos: Tensor, sin: Tensor, pairs: int) -> Tensor:
    """``o_a_proj`` of the attention core's output ``flat [T, H * d]`` after its inverse RoPE:
    for a plain bf16 weight its groups as segments of one GEMV launch, the inverse RoPE in
    the GEMV's prologue where every group starts at a head (else one norm_rope launch first);
    a stored-format weight's groups likewise through :func:`_grouped_stored`; else the
    inverse RoPE launch and the module's own forward."""
    from engram_trt.native import decode

    T = flat.shape[0]
    d = attn.head_dim
    mod = attn.o_a_proj
    groups = attn.config.o_groups
    per_in = flat.shape[1] // groups
    w = None if mod.stored_format else mod.weight  # a QuantGroupedLinear's is stored FP8: not taken here
    inverse = decode.NormRopeJob(
        flat, flat, dim=d, heads=flat.shape[1] // d, rope_pairs=pairs, cos=cos, sin=sin, rope_sign=-1
    )
    rope = _rope_prologue(d, per_in, pairs, cos, sin)
    if isinstance(w, Tensor) and w.dim() == 2 and w.dtype == flat.dtype and per_in % 8 == 0:
        rows = w.shape[0] // groups
        if (rows * per_in) % 8 == 0 and decode.gemv_fits(flat[:, :per_in], w[:rows]):  # bf16 alone
            if rope is None:
                decode.norm_rope(inverse)
            y = torch.empty((T, w.shape[0]), dtype=flat.dtype, device=flat.device)
            segments = [
                (flat[:, g * per_in : (g + 1) * per_in], w[g * rows : (g + 1) * rows], y[:, g * rows : (g + 1) * rows])
                for g in range(groups)
            ]
            for first in range(0, groups, decode.MAX_SEGMENTS):
                decode.gemv_segments(segments[first : first + decode.MAX_SEGMENTS], prologue=rope)
            return y
    stored = _grouped_stored(mod, flat, groups, per_in, inverse, rope)  # a stored-format (FP8) o_a: one launch
    if stored is not None:
        return stored
    decode.norm_rope(inverse)
    return mod(flat.view(T, groups, per_in)).flatten(1)


def _grouped_stored(mod: nn.Module, flat: Tensor, groups: int, per_in: int, inverse: Any, rope: Any) -> Tensor | None:
    """A stored-format grouped ``o_a_proj`` (QuantGroupedLinear) of ``flat [T, groups *
    per_in]`` after the inverse RoPE: its groups as segments of one
    :func:`engram_trt.native.quant_decode.gemv_segments` launch (each group's rows a
    QuantWeight view), the rotation in its prologue (``rope``, where :func:`_quant_prologue`
    serves) or the ``inverse`` launch first; None (nothing launched) where it does not serve."""
    from engram_trt.native import decode

    if not mod.stored_format:  # a GroupedLinear (declared by both grouped kinds)
        return None
    qd = _quant_fused()
    if qd is None or mod.backend == "torch" or groups > qd.MAX_SEGMENTS:
        return None
    parts = mod.group_weights()
    if parts is None:
        return None
    xs = [flat[:, g * per_in : (g + 1) * per_in] for g in range(groups)]
    if any(qd.segment_reason(xg, w) is not None for xg, w in zip(xs, parts)):
        return None
    rows = parts[0].out_features
    y = torch.empty((flat.shape[0], rows * groups), dtype=flat.dtype, device=flat.device)
    prologue = rope if _quant_prologue() is not None else None
    if prologue is None:
        decode.norm_rope(inverse)
    qd.gemv_segments([(xs[g], parts[g], y[:, g * rows : (g + 1) * rows]) for g in range(groups)], prologue=prologue)
    return y


def _moe_stored(
    mlp: Any, x: Tensor, ids: Tensor, weights: Tensor, stacks: Any, projections: list[Any], limit: Any
) -> Tensor | None:
    """The routed experts and the shared expert through
    :func:`engram_trt.native.quant_decode.moe` (two launches), or None where it does not take them."""
    from engram_trt.quant.weight import QuantLinear

    qd = _quant_fused()
    shared = mlp.shared_experts
    if qd is None or shared.limit != limit or limit is None or not limit > 0:  # (limit 0: experts() clamps not)
        return None
    sw = []
    for m in projections:
        if isinstance(m, QuantLinear) and m.bias is None and m.backend != "torch":
            sw.append(m.qweight)
        elif type(m) is nn.Linear and m.bias is None and m.weight.dtype == torch.bfloat16:
            sw.append(m.weight)
        else:
            return None
    if qd.moe_reason(x, int(ids.shape[1]), *stacks, tuple(sw)) is not None:
        return None
    return qd.moe(x, ids, weights, *stacks, shared=(sw[0], sw[1], sw[2]), limit=limit)


def _route(router: Any, logits: Tensor, input_ids: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """The router's picks and weights of ``logits`` through ``moe_route`` (one launch)."""
    from engram_trt.native import decode

    if bias is not None:
        return decode.moe_route(logits, top_k=router.top_k, score_fn=router.scoring, scaling=router.scaling, bias=bias)
    tokens = input_ids if input_ids.dtype == torch.int64 else input_ids.long()
    return decode.moe_route(
        logits,
        top_k=router.top_k,
        score_fn=router.scoring,
        scaling=router.scaling,
        tid2eid=router.tid2eid,
        input_ids=tokens,
    )


def _plain_experts(mlp: Any, x: Tensor, stacks: Any) -> tuple[Tensor, Tensor, Tensor] | None:
    """The shared expert's ``(gate, up, down)`` weights where the routed ``stacks`` and the
    shared expert are what ``moe_experts`` / ``moe_experts_grouped`` take (plain contiguous
    weights of x's dtype, bias-free ``nn.Linear`` shared projections, one SwiGLU limit, D, I
    and I_s multiples of 8, x and the weights 16-byte aligned: the kernels read 16-byte
    vectors of them), else None."""
    from engram_trt.quant.weight import QuantWeight

    if any(isinstance(st, QuantWeight) for st in stacks):
        return None
    shared = mlp.shared_experts
    projections: list[nn.Module] = [shared.gate_proj, shared.up_proj, shared.down_proj]
    plain = (
        all(isinstance(m, nn.Linear) and m.bias is None for m in projections)
        and all(w.dtype == x.dtype and w.is_contiguous() for w in (*stacks, *(m.weight for m in projections)))
        and x.is_contiguous()
        and all(t.data_ptr() % 16 == 0 for t in (x, *stacks, *(m.weight for m in projections)))
        and x.shape[1] % 8 == 0
        and shared.limit == mlp.experts[0].limit
        and stacks[0].shape[1] % 8 == 0
        and projections[0].weight.shape[0] % 8 == 0
    )
    return (projections[0].weight, projections[1].weight, projections[2].weight) if plain else None


def _grouped_experts(mlp: Any, x: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
    """:func:`_plain_experts` for a batch step where ``ENGRAM_TRT_DSV4_MOE_GROUPED=1`` and
    ``moe_experts_grouped`` takes its tokens, else None."""
    from engram_trt.native import decode

    if os.environ.get(MOE_GROUPED_ENV, "0") != "1" or x.shape[0] > decode.MOE_GROUPED_MAX_TOKENS:
        return None
    return _plain_experts(mlp, x, mlp.stack_experts())


def _moe_batch(mlp: Any, x: Tensor, input_ids: Tensor, bias: Tensor | None) -> Tensor | None:
    """A step of ``GEMV_EX_MAX_TOKENS < T <= BATCH_ROUTE_MAX_TOKENS`` tokens (a batch of
    decode streams; a short prefill chunk): the router's logits as the module takes them
    (``F.linear``: the same bits), its picks and weights in one ``moe_route`` launch where
    the module spends about ten element-wise launches (score, bias, top-k, gather,
    normalization), the routed experts through the library's product as the module's
    ``kernels`` form runs them, the shared expert as its module; None (the module's forms)
    where that product does not serve.

    With ``ENGRAM_TRT_DSV4_MOE_GROUPED=1`` and plain bf16 experts (:func:`_plain_experts`,
    as :func:`moe` takes them for a few tokens) the routed and the shared experts run in ONE
    ``moe_experts_grouped`` call instead (each picked expert's weights read once a step).
    Its bits are the ``moe_experts`` contract's (the reference's bf16 roundings: each
    expert's output rounded, the picks added in ascending expert id, then the shared
    expert's), not ``native.quant.experts``' (which the default path's bits follow)."""
    grouped = _grouped_experts(mlp, x)
    if grouped is None and mlp.kernels_unavailable(x) is not None:
        return None
    ids, weights = _route(mlp.gate, F.linear(x, mlp.gate.weight), input_ids, bias)
    if grouped is not None:
        from engram_trt.native import decode

        return decode.moe_experts_grouped(
            x, ids, weights, *mlp.stack_experts(), shared=grouped, limit=mlp.experts[0].limit
        )
    from engram_trt.native import quant as native_quant

    routed = native_quant.experts(x, ids, weights, *mlp.stack_experts(), limit=mlp.experts[0].limit)
    return routed + mlp.shared_experts(x)


def moe(mlp: Any, x: Tensor, input_ids: Tensor) -> Tensor | None:
    """A decode step's MoE (:class:`~.moe.GroupedSparseMoE`, form ``auto``) on the fused
    kernels, or None where they do not serve it (the caller takes its forms): the router's
    logits through the GEMV, its picks through ``moe_route``; bf16 expert stacks and a
    bf16 shared expert through ``moe_experts`` (two launches), stored-format experts through
    :func:`engram_trt.native.quant.experts` with the shared expert as its module."""
    from engram_trt.native import decode

    router = mlp.gate
    T = x.shape[0]
    if x.dim() != 2 or not 1 <= T <= BATCH_ROUTE_MAX_TOKENS:
        return None
    scoring = router.scoring
    if scoring not in decode.SCORE_FNS:
        return None
    bias = router.correction_bias()  # a TopKRouter's; None: a HashRouter picks by its tid2eid table
    if bias is not None and bias.dtype != torch.float32:
        return None  # a bf16 bias rounds the keys: the module's path
    if router.top_k > decode.MOE_MAX_TOP_K or router.num_experts > decode.MOE_MAX_EXPERTS:
        return None
    if T > decode.GEMV_EX_MAX_TOKENS:
        return _moe_batch(mlp, x, input_ids, bias)
    if not decode.gemv_fits(x, router.weight):
        return None
    stacks = mlp.stack_experts()
    limit = mlp.experts[0].limit
    shared = mlp.shared_experts
    projections: list[nn.Module] = [shared.gate_proj, shared.up_proj, shared.down_proj]
    plain = _plain_experts(mlp, x, stacks)
    if plain is None and mlp.kernels_unavailable(x) is not None:
        return None  # neither the fused experts nor the library's stored-format product: the module's forms
    logits = torch.empty((T, router.num_experts), dtype=x.dtype, device=x.device)
    decode.gemv_segments([(x, router.weight, logits)])
    ids, weights = _route(router, logits, input_ids, bias)
    if plain is not None:
        return decode.moe_experts(x, ids, weights, *stacks, shared=plain, limit=limit)
    fused = _moe_stored(mlp, x, ids, weights, stacks, projections, limit)
    if fused is not None:
        return fused
    from engram_trt.native import quant as native_quant

    routed = native_quant.experts(x, ids, weights, *stacks, limit=limit)
    # the shared expert as ClampedSwiGLU.forward, its products through project (stored-format
    # weights with weight_static; gate and up of bf16 ones in one launch)
    gate, up = project(x, projections[:2])
    h = F.silu(gate.clamp(max=shared.limit)) * up.clamp(min=-shared.limit, max=shared.limit)
    return routed + project(h, projections[2:])[0]


__all__ = [
    "BATCH_ROUTE_MAX_TOKENS",
    "FUSED_ENV",
    "MOE_GROUPED_ENV",
    "PROLOGUE_ENV",
    "QUANT_FUSED_ENV",
    "QUANT_PROLOGUE_ENV",
    "QUANT_STATIC_ENV",
    "attention",
    "moe",
    "project",
    "unavailable",
]
