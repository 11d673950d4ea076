"""DeepSeek-V4's tensor names, the formats a checkpoint stores them in, and how its
weights are loaded.

Names. The modules carry transformers' module names (``model.layers.0.self_attn.q_a_proj``,
``...mlp.experts.3.gate_proj``). :func:`checkpoint_name` maps them to the model's
*canonical* checkpoint names, the upstream DeepSeek names that transformers'
``save_pretrained`` writes back (``model.layers.0.attn.wq_a``, ``...ffn.experts.3.w1``,
``head.weight``): transformers' load-time renaming (``conversion_mapping.py``,
``deepseek_v4``) read backwards. A checkpoint may store a canonical name under another
spelling (:func:`checkpoint_names`): DeepSeek's published layout puts the backbone at the
root (``embed.weight``, ``norm.weight``, ``hc_head_fn``, ``layers.N...``), and an FP8 /
FP4 weight's block scales sit beside it as ``<module>.scale`` (DeepSeek, and transformers'
own FP8 save of this family, which writes per-expert scales) or ``<module>.weight_scale_inv``
(transformers' in-memory name). :func:`resolve_names` is the one resolver: the registry's
unused-tensor check, the architecture's checkpoint checks and the loader all ask it.
V4.1's Engram tensors keep their ``model.layers.N.engram.*`` names in either layout (the
table store reads them so).

Formats (:func:`stored_formats`): a linear projection's weight stored ``F8_E4M3`` with a
scale is an FP8 weight (``quantization_config`` required); a routed expert's ``w1/w2/w3``
stored as packed ``I8`` / ``U8`` where the config says ``expert_dtype: "fp4"`` is FP4 (two
e2m1 values a byte, one ue8m0 scale per 32 inputs); everything else is read as a float
(or, ``tid2eid``, integer) tensor. Every contradiction (a missing or mis-shaped scale, an
FP8 weight without ``quantization_config`` or listed in ``modules_to_not_convert``, an
FP4 weight with an odd inner size, a scale of another dtype than ``scale_fmt`` says) is
one line of :func:`format_problems`, refused before a byte is loaded.

Why the loader places tensor by tensor (:func:`load_into`): a real checkpoint's experts
are most of its bytes (hundreds of GiB), so the model is built on the meta device, the
modules whose weights are stored FP8 / FP4 are swapped for :class:`~engram_trt.quant.weight.QuantLinear`
(:func:`quantize_modules`), each layer's routed experts get their stacks allocated on the
device (each expert's tensors views of them: no copy when the MoE stacks them), and each
tensor is read from its shard, placed into its module (a float weight converted to the
serving dtype on its device, a quantized one copied as stored: no float copy of it is ever
made, in host or GPU memory) and dropped before the next is read; shards are walked in
file order so each is read once. A model that cannot fit the GPU is refused before the
first byte is read (:func:`check_fits`, on the bytes :func:`stored_formats` says a load
takes), naming the bytes needed and free.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch
from torch import nn

from engram_trt.errors import EngramError
from engram_trt.quant.names import FP4_WEIGHT_DTYPES, FP8_WEIGHT_DTYPES, scale_candidates
from engram_trt.quant.spec import FP4_GROUP, QuantSpec

log = logging.getLogger(__name__)

# (module-name pattern, checkpoint spelling), applied in order to the full module name.
_TO_CHECKPOINT: tuple[tuple[str, str], ...] = (
    (r"^lm_head\.weight$", "head.weight"),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.", ".ffn."),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.attn_hc\.(fn|base|scale)$", r".hc_attn_\1"),
    (r"\.ffn_hc\.(fn|base|scale)$", r".hc_ffn_\1"),
    (r"\.sinks$", ".attn_sink"),
    (r"\.compressor\.indexer\.scorer\.weights_proj\.", ".indexer.weights_proj."),
    (r"\.compressor\.indexer\.q_b_proj\.", ".indexer.wq_b."),
    (r"\.compressor\.indexer\.", ".indexer.compressor."),
    (r"\.kv_norm\.", ".norm."),
    (r"\.position_bias$", ".ape"),
    (r"\.(experts\.\d+|shared_experts)\.gate_proj\.", r".\1.w1."),
    (r"\.(experts\.\d+|shared_experts)\.down_proj\.", r".\1.w2."),
    (r"\.(experts\.\d+|shared_experts)\.up_proj\.", r".\1.w3."),
    (r"\.q_a_proj\.", ".wq_a."),
    (r"\.q_b_proj\.", ".wq_b."),
    (r"\.kv_proj\.", ".wkv."),
    (r"\.gate_proj\.", ".wgate."),
    (r"\.o_a_proj\.", ".wo_a."),
    (r"\.o_b_proj\.", ".wo_b."),
    (r"\.q_a_norm\.", ".q_norm."),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
)
_COMPILED = tuple((re.compile(p), r) for p, r in _TO_CHECKPOINT)

# Tensors that are integer tables, not float weights (read as stored).
INTEGER_TENSORS = re.compile(r"\.gate\.tid2eid$")
# The upstream multi-token-prediction layers: not served (transformers does not build them).
MTP_TENSOR = re.compile(r"(^|\.)mtp\.")
# A routed expert's projection (canonical or upstream spelling): layer, expert.
ROUTED_EXPERT = re.compile(r"^(?:model\.)?layers\.(\d+)\.ffn\.experts\.(\d+)\.w[123]\.weight$")
# V4.1's Engram tensors: this project's names, the same in either layout.
ENGRAM_TENSOR = re.compile(r"\.engram\.")
SCALE_NAME = ".weight_scale_inv"  # the canonical name of a weight's block scales
# The canonical names DeepSeek's published checkpoints store at the root under another spelling.
_UPSTREAM_ROOT = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "model.hc_head.hc_fn": "hc_head_fn",
    "model.hc_head.hc_base": "hc_head_base",
    "model.hc_head.hc_scale": "hc_head_scale",
}
UPSTREAM, TRANSFORMERS = "upstream", "transformers"
# Stored dtypes a weight's block scales may have, by scale_fmt (no conversion on load).
SCALE_ST_DTYPES = {"ue8m0": ("F8_E8M0", "U8"), "float": ("F32",)}
FLOAT_ST_DTYPES = ("F32", "BF16", "F16", "F64")
_ST_OF_TORCH = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e8m0fnu: "F8_E8M0",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def checkpoint_name(module_name: str) -> str:
    """The canonical checkpoint name of a module parameter / buffer name (module docstring)."""
    name = module_name
    for pattern, repl in _COMPILED:
        name = pattern.sub(repl, name)
    return name


def upstream_name(canonical: str) -> str:
    """DeepSeek's published spelling of a canonical name: the backbone at the root."""
    if canonical in _UPSTREAM_ROOT:
        return _UPSTREAM_ROOT[canonical]
    return canonical[len("model.") :] if canonical.startswith("model.") else canonical


def checkpoint_names(canonical: str) -> tuple[str, ...]:
    """Every name a checkpoint may store the canonical tensor under, in order of
    preference: transformers' save spelling, then DeepSeek's root spelling; a block scale
    (``X.weight_scale_inv``) under ``.weight_scale_inv`` or ``.scale`` of either."""
    if canonical.endswith(SCALE_NAME):
        weight = canonical[: -len("_scale_inv")]
        return tuple(c for w in checkpoint_names(weight) for c in scale_candidates(w))
    if ENGRAM_TENSOR.search(canonical):
        return (canonical,)
    up = upstream_name(canonical)
    return (canonical,) if up == canonical else (canonical, up)


def scale_name(weight: str) -> str:
    """The canonical name of a weight's block scales."""
    return weight[: -len(".weight")] + SCALE_NAME if weight.endswith(".weight") else weight + "_scale_inv"


@dataclass
class StoredNames:
    """Canonical name -> the name a checkpoint stores it under (present ones only), and
    the checkpoint's layout (:data:`UPSTREAM`: DeepSeek's root names; else transformers')."""

    stored: dict[str, str]
    layout: str

    def shown(self, canonical: str) -> str:
        """The name to print for ``canonical``: its stored name, or the checkpoint's spelling of it."""
        if canonical in self.stored:
            return self.stored[canonical]
        names = checkpoint_names(canonical)
        return names[-1] if self.layout == UPSTREAM else names[0]


def layout_of(present: Iterable[str]) -> str:
    """:data:`UPSTREAM` when the backbone is stored at the root (DeepSeek's published
    layout), else :data:`TRANSFORMERS`."""
    for n in present:
        if n.startswith("layers.") or n in ("embed.weight", "norm.weight"):
            return UPSTREAM
    return TRANSFORMERS


def resolve_names(canonical: Iterable[str], present: Iterable[str], *, scales: bool = True) -> StoredNames:
    """Each canonical name's stored name where the checkpoint holds one (``present``: the
    names it stores, ``ckpt.tensor_names()``); with ``scales``, each weight's block scale
    too where one is stored (under the weight's canonical scale name)."""
    names = set(present)
    out: dict[str, str] = {}
    for c in canonical:
        for cand in checkpoint_names(c):
            if cand in names:
                out[c] = cand
                break
        if scales and c.endswith(".weight") and not INTEGER_TENSORS.search(c):
            s = scale_name(c)
            for cand in checkpoint_names(s):
                if cand in names:
                    out[s] = cand
                    break
    return StoredNames(out, layout_of(names))


# ------------------------------------------------------------------------------ formats
@dataclass(frozen=True)
class StoredFormat:
    """How one model weight is stored: ``kind`` ``fp8`` / ``fp4`` (quantized, with its
    scale), ``float`` or ``int``; ``shape`` the logical ``[..., N, K]``; ``stored_bytes``
    the checkpoint's bytes of it (its scale's included)."""

    canonical: str
    name: str
    kind: str
    st_dtype: str
    shape: tuple[int, ...]
    stored_bytes: int
    scale: str | None = None
    scale_st_dtype: str | None = None
    block: tuple[int, int] | None = None

    @property
    def quantized(self) -> bool:
        return self.kind in ("fp8", "fp4")

    @property
    def scale_fmt(self) -> str:
        return "float" if self.scale_st_dtype in ("F32", "BF16", "F16") else "ue8m0"

    def gpu_bytes(self, dtype: torch.dtype, keep_float32: re.Pattern[str] | None = None) -> int:
        """The bytes a load places on the device: a quantized weight as stored; a float
        one in ``dtype`` (float32 where ``keep_float32`` matches); an integer table as int64."""
        if self.quantized:
            return self.stored_bytes
        n = 1
        for d in self.shape:
            n *= int(d)
        if self.kind == "int":
            return n * 8
        keep = keep_float32 is not None and keep_float32.search(self.canonical)
        return n * (4 if keep else torch.empty((), dtype=dtype).element_size())


class TensorDict:
    """A name -> tensor dict seen as a checkpoint (tests, the benchmark's random weights)."""

    path = "<weights>"

    def __init__(self, weights: Mapping[str, Any]) -> None:
        self.weights = weights

    def __contains__(self, n: object) -> bool:
        return n in self.weights

    def tensor_names(self) -> list[str]:
        return list(self.weights)

    def shape(self, n: str) -> tuple[int, ...]:
        return tuple(self.weights[n].shape)

    def st_dtype(self, n: str) -> str:
        return _ST_OF_TORCH.get(self.weights[n].dtype, str(self.weights[n].dtype))

    def nbytes(self, n: str) -> int:
        t = self.weights[n]
        return t.numel() * t.element_size()

    def locate(self, n: str) -> tuple[str, int, int]:
        return ("", 0, 0)

    def get(self, n: str) -> Any:
        return self.weights[n]


def _module_of(canonical: str) -> str:
    return canonical[: -len(".weight")] if canonical.endswith(".weight") else canonical


def stored_formats(
    shapes: Mapping[str, tuple[int, ...]], spec: QuantSpec | None, ckpt: Any, linears: Mapping[str, str]
) -> tuple[dict[str, StoredFormat], list[str], StoredNames]:
    """``(canonical name -> StoredFormat of each weight the checkpoint holds, one line per
    problem, the resolved names)``. ``shapes``: every tensor the model reads (canonical,
    logical shapes); ``linears``: canonical weight name -> the model's module name of each
    projection that may be stored quantized (module docstring)."""
    names = resolve_names(shapes, ckpt.tensor_names())
    formats: dict[str, StoredFormat] = {}
    problems: list[str] = []
    expert_formats: dict[int, dict[tuple[str, str | None], str]] = {}
    for c, want in shapes.items():
        n = names.stored.get(c)
        if n is None:
            problems.append(f"tensor {names.shown(c)} is missing (expected shape {list(want)})")
            continue
        st, got = ckpt.st_dtype(n), tuple(ckpt.shape(n))
        s_canon = scale_name(c)
        s = names.stored.get(s_canon)
        s_st = None if s is None else ckpt.st_dtype(s)
        nbytes = int(ckpt.nbytes(n)) + (0 if s is None else int(ckpt.nbytes(s)))
        expert = ROUTED_EXPERT.match(c)
        if INTEGER_TENSORS.search(c):
            if got != tuple(want):
                problems.append(f"tensor {n} has shape {list(got)} but the config needs {list(want)}")
            elif st in FLOAT_ST_DTYPES or st.startswith("F8"):
                problems.append(f"tensor {n} is {st}, not the integer token -> expert table")
            else:
                formats[c] = StoredFormat(c, n, "int", st, tuple(want), nbytes)
            continue
        kind = None
        if st in FP8_WEIGHT_DTYPES:
            kind = "fp8"
        elif st in FP4_WEIGHT_DTYPES and expert is not None:
            kind = "fp4"
        if kind is None:
            if st not in FLOAT_ST_DTYPES:
                extra = (
                    " (packed FP4 is served for the routed experts' w1 / w2 / w3 only)"
                    if st in FP4_WEIGHT_DTYPES
                    else ""
                )
                problems.append(f"tensor {n} is {st}, not a float weight{extra}")
            elif got != tuple(want):
                problems.append(f"tensor {n} has shape {list(got)} but the config needs {list(want)}")
            elif s is not None:
                problems.append(
                    f"tensor {s} is a block scale beside {n}, which is stored {st}, not FP8 or FP4: "
                    f"the checkpoint's formats are inconsistent"
                )
            else:
                formats[c] = StoredFormat(c, n, "float", st, tuple(want), nbytes)
            if expert is not None and st in FLOAT_ST_DTYPES:
                expert_formats.setdefault(int(expert.group(1)), {})[(st, None)] = n
            continue
        why = _quant_contradiction(c, n, st, kind, spec, linears)
        if why is not None:
            problems.append(why)
            continue
        assert spec is not None
        block = (1, FP4_GROUP) if kind == "fp4" else spec.block_for(tuple(want))
        from engram_trt.quant.weight import check_quant_tensors

        bad = check_quant_tensors(n, kind, tuple(want), got, None if s is None else tuple(ckpt.shape(s)), block)
        if bad is None:
            fmt = "ue8m0" if kind == "fp4" else spec.scale_fmt
            if s_st not in SCALE_ST_DTYPES[fmt]:
                what = (
                    "an FP4 weight's scales are ue8m0" if kind == "fp4" else f"quantization_config.scale_fmt is {fmt!r}"
                )
                bad = (
                    f"scale {s} is {s_st} but {what}: expected {' or '.join(SCALE_ST_DTYPES[fmt])} (one "
                    f"{'power-of-two byte' if fmt == 'ue8m0' else 'float32'} per block)"
                )
        if bad is not None:
            problems.append(bad)
            continue
        formats[c] = StoredFormat(c, n, kind, st, tuple(want), nbytes, s, s_st, block)
        if expert is not None:
            expert_formats.setdefault(int(expert.group(1)), {})[(st, s_st)] = n
    for layer, kinds in sorted(expert_formats.items()):
        if len(kinds) > 1:
            shown = ", ".join(
                f"{st}{'' if sc is None else ' + ' + sc + ' scales'} ({n})" for (st, sc), n in kinds.items()
            )
            problems.append(
                f"layer {layer}'s routed experts are stored in mixed formats: {shown}; engram-trt stacks "
                f"one layer's experts in one format (store them all alike)"
            )
    return formats, problems, names


def _quant_contradiction(
    canonical: str, name: str, st: str, kind: str, spec: QuantSpec | None, linears: Mapping[str, str]
) -> str | None:
    """Why a weight stored quantized cannot be served as such (None: it can)."""
    if spec is None:
        if kind == "fp4":
            return (
                f"tensor {name} is {st} (packed FP4 expert weights) but config.json declares no "
                f"quantization_config with expert_dtype \"fp4\"; add the checkpoint's quantization_config "
                f"(quant_method \"fp8\") and expert_dtype \"fp4\""
            )
        return (
            f"tensor {name} is {st} but config.json declares no quantization_config; add the checkpoint's "
            f"quantization_config (quant_method \"fp8\", weight_block_size, scale_fmt) to config.json"
        )
    if kind == "fp4" and spec.expert_dtype != "fp4":
        return (
            f"tensor {name} is {st} (packed FP4) but the config's expert_dtype is {spec.expert_dtype!r}; set "
            f"expert_dtype \"fp4\" if the routed experts are stored FP4"
        )
    if kind == "fp8" and ROUTED_EXPERT.match(canonical) and spec.expert_dtype == "fp4":
        return (
            f"tensor {name} is F8_E4M3 but the config's expert_dtype is \"fp4\"; set expert_dtype \"fp8\" or store FP4"
        )
    module = linears.get(canonical)
    if module is None:
        return (
            f"tensor {name} is {st} but engram-trt serves FP8 / FP4 only for the linear projections (this tensor "
            f"is read as a float weight); store it in 16 or 32 bits"
        )
    for spelling in (module, _module_of(canonical), _module_of(name)):
        if spec.not_converted(spelling):
            return (
                f"tensor {name} is {st} but quantization_config.modules_to_not_convert lists its module "
                f"({spelling}) as kept in 16 bits: the config contradicts the weights; remove it from the list "
                f"or store the module in 16 bits"
            )
    return None


# ------------------------------------------------------------------------------ loading
def named_tensors(module: nn.Module) -> dict[str, tuple[nn.Module, str, torch.Tensor]]:
    """Canonical checkpoint name -> (owning module, attribute, tensor) of every parameter
    and persistent buffer of ``module`` (the tiny ``tid2eid`` buffers and a
    QuantLinear's ``weight_scale_inv`` included)."""
    out: dict[str, tuple[nn.Module, str, torch.Tensor]] = {}
    for mod_name, mod in module.named_modules():
        for attr, t in list(mod._parameters.items()) + [
            (k, v) for k, v in mod._buffers.items() if k not in mod._non_persistent_buffers_set
        ]:
            if t is None:
                continue
            full = f"{mod_name}.{attr}" if mod_name else attr
            out[checkpoint_name(full)] = (mod, attr, t)
    return out


def quantizable_linears(module: nn.Module) -> dict[str, str]:
    """Canonical weight name -> module name of every projection that may be stored FP8 /
    FP4: each ``nn.Linear`` and ``GroupedLinear`` but the head (read as a matrix by the
    step) and V4.1's Engram ``wkv`` (read so by the Engram update)."""
    from engram_trt.models.deepseek_v4.attention import GroupedLinear

    out = {}
    for name, mod in module.named_modules():
        if isinstance(mod, (nn.Linear, GroupedLinear)) and name != "lm_head" and ".engram" not in f".{name}":
            out[checkpoint_name(f"{name}.weight")] = name
    return out


def quantize_modules(module: nn.Module, formats: Mapping[str, StoredFormat]) -> int:
    """Swap each projection whose weight is stored FP8 / FP4 for its quantized twin of the
    same shape on the same (meta) device: ``nn.Linear`` -> QuantLinear, ``GroupedLinear``
    -> :class:`~.modules.QuantGroupedLinear`. Returns how many were swapped."""
    from engram_trt.models.deepseek_v4.attention import GroupedLinear
    from engram_trt.models.deepseek_v4.modules import QuantGroupedLinear
    from engram_trt.quant.weight import QuantLinear

    swapped = 0
    for name, canonical in ((n, c) for c, n in quantizable_linears(module).items()):
        f = formats.get(canonical)
        if f is None or not f.quantized:
            continue
        mod = module.get_submodule(name)
        assert f.block is not None
        if isinstance(mod, GroupedLinear):
            new: nn.Module = QuantGroupedLinear.like(mod, f.kind, f.block, f.scale_fmt)
        else:
            new = QuantLinear.like(mod, f.kind, f.block, f.scale_fmt)
        module.set_submodule(name, new)
        swapped += 1
    return swapped


def model_formats(
    module: nn.Module, spec: QuantSpec | None, ckpt: Any
) -> tuple[dict[str, StoredFormat], list[str], StoredNames]:
    """:func:`stored_formats` of a model built on the meta device (before
    :func:`quantize_modules`: its tensors' shapes are the logical ones)."""
    shapes = {c: tuple(t.shape) for c, (_m, _a, t) in named_tensors(module).items()}
    return stored_formats(shapes, spec, ckpt, quantizable_linears(module))


def prepare_model(
    module: nn.Module, formats: Mapping[str, StoredFormat], device: torch.device, dtype: torch.dtype
) -> None:
    """Before :func:`load_into`: the quantized projections swapped in, each MoE's expert
    stacks allocated on ``device`` (``allocate_stacks``; the experts' tensors views)."""
    from engram_trt.models.deepseek_v4.moe import GroupedSparseMoE

    quantize_modules(module, formats)
    for mod in module.modules():
        if isinstance(mod, GroupedSparseMoE):
            mod.allocate_stacks(device, dtype)


def module_bytes(module: nn.Module) -> int:
    """Bytes of the module's weights as held (each parameter and persistent buffer once;
    the expert views of a stack add up to the stack)."""
    return sum(t.numel() * t.element_size() for _m, _a, t in named_tensors(module).values() if not t.is_meta)


def tensor_bytes(shapes: Iterable[tuple[int, ...]], itemsize: int) -> int:
    total = 0
    for shape in shapes:
        n = 1
        for d in shape:
            n *= int(d)
        total += n * itemsize
    return total


def check_fits(needed: int, device: torch.device, what: str) -> None:
    """Refuse (one line) a model whose weights need more than the device has free.
    CPU: no check (the OS pages a checkpoint's maps in and out)."""
    if device.type != "cuda":
        return
    free, total = torch.cuda.mem_get_info(device)
    if needed > free:
        raise EngramError(
            f"{what} needs {needed / 2**30:.2f} GiB of weights on {device} but only {free / 2**30:.2f} GiB of "
            f"{total / 2**30:.2f} GiB is free; serve it on a larger GPU (or several), in a smaller dtype, or "
            f"on the CPU"
        )


_STORED_AS_IS = (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int8, torch.uint8)


def load_into(
    module: nn.Module,
    ckpt: Any,
    device: torch.device,
    dtype: torch.dtype,
    keep_float32: re.Pattern[str] | None = None,
    names: StoredNames | None = None,
) -> None:
    """Fill ``module`` (built on the meta device, its quantized projections swapped in and
    its expert stacks allocated) from ``ckpt`` tensor by tensor, shard by shard (module
    docstring). ``names`` maps the canonical names to the stored ones (default:
    :func:`resolve_names`). Float weights become ``dtype`` (those matching
    ``keep_float32`` stay float32, as transformers keeps them); integer tables become
    int64; quantized weights and their scales keep their stored bytes (a same-size
    reinterpretation at most: ``U8`` scales as ue8m0, ``U8`` FP4 bytes as int8). A
    tensor already allocated (a view of an expert stack) is filled in place. Shapes are
    checked before anything is read."""
    targets = named_tensors(module)
    names = names if names is not None else resolve_names(targets, ckpt.tensor_names())
    missing = [c for c in targets if c not in names.stored]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise EngramError(f"checkpoint '{ckpt.path}' lacks tensor {names.shown(missing[0])}{more}")
    for c, (_mod, _attr, t) in targets.items():
        n = names.stored[c]
        if tuple(ckpt.shape(n)) != tuple(t.shape):
            raise EngramError(f"tensor {n} has shape {list(ckpt.shape(n))} but the config needs {list(t.shape)}")

    def file_order(c: str) -> tuple[str, int]:
        path, offset, _n = ckpt.locate(names.stored[c])
        return str(path), int(offset)

    for c in sorted(targets, key=file_order):
        mod, attr, meta = targets[c]
        src = ckpt.get(names.stored[c])
        if meta.dtype in _STORED_AS_IS:
            if src.dtype not in _STORED_AS_IS or src.element_size() != meta.element_size():
                raise EngramError(
                    f"tensor {names.stored[c]} is {src.dtype}, not the {meta.dtype} bytes its module holds"
                )
            value = (src if src.dtype == meta.dtype else src.view(meta.dtype)).to(device)
        elif INTEGER_TENSORS.search(c):
            value = src.to(device=device, dtype=torch.int64)
        else:
            want = torch.float32 if keep_float32 is not None and keep_float32.search(c) else dtype
            value = src.to(device=device, dtype=want)
        del src
        if not meta.is_meta:  # pre-allocated (a view of a stack): filled in place
            with torch.no_grad():
                meta.copy_(value)
        elif attr in mod._parameters:
            mod._parameters[attr] = nn.Parameter(value, requires_grad=False)
        else:
            mod._buffers[attr] = value
        del value
    # Non-persistent buffers the modules made on the meta device are recomputed by them.
    leftover = [
        f"{m}.{b}" for m, mod in module.named_modules() for b, t in mod._buffers.items() if t is not None and t.is_meta
    ]
    if leftover:
        raise EngramError(f"the model's buffer {leftover[0]} has no value after loading (a module must compute it)")
