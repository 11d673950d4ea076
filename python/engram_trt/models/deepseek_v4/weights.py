"""DeepSeek-V4's tensor names and how its weights are loaded.

The modules carry transformers' module names (``model.layers.0.self_attn.q_a_proj``,
``...mlp.experts.3.gate_proj``); a checkpoint stores the upstream DeepSeek names that
transformers' ``save_pretrained`` writes back (``model.layers.0.attn.wq_a``,
``...ffn.experts.3.w1``, ``head.weight``). :func:`checkpoint_name` is the one map between
them: transformers' load-time renaming (``conversion_mapping.py``, ``deepseek_v4``) read
backwards, names that are already checkpoint spellings passing through unchanged.

Why the loader places tensor by tensor (:func:`load_into`): a real checkpoint's experts
are most of its bytes (hundreds of GiB), so the model is built on the meta device and
each tensor is read from its shard, converted to the serving dtype on its device,
placed into its module and dropped before the next is read; shards are walked in file
order so each is read once. A model that cannot fit the GPU is refused before the first
byte is read (:func:`check_fits`), naming the bytes needed and free.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Iterable

import torch
from torch import nn

from engram_trt.errors import EngramError

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


def checkpoint_name(module_name: str) -> str:
    """The checkpoint's name of a module parameter / buffer name (module docstring)."""
    name = module_name
    for pattern, repl in _COMPILED:
        name = pattern.sub(repl, name)
    return name


def named_tensors(module: nn.Module) -> dict[str, tuple[nn.Module, str, torch.Tensor]]:
    """Checkpoint name -> (owning module, attribute, tensor) of every parameter and
    persistent buffer of ``module`` (the tiny ``tid2eid`` buffers included)."""
    out: dict[str, tuple[nn.Module, str, torch.Tensor]] = {}
    for mod_name, mod in module.named_modules():
        for attr, t in list(mod._parameters.items()) + [(k, v) for k, v in mod._buffers.items()
                                                         if k not in mod._non_persistent_buffers_set]:
            if t is None:
                continue
            full = f"{mod_name}.{attr}" if mod_name else attr
            out[checkpoint_name(full)] = (mod, attr, t)
    return out


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
        raise EngramError(f"{what} needs {needed / 2**30:.2f} GiB of weights on {device} but only {free / 2**30:.2f} GiB of "
                          f"{total / 2**30:.2f} GiB is free; serve it on a larger GPU (or several), in a smaller dtype, or "
                          f"on the CPU")


def load_into(module: nn.Module, ckpt: Any, device: torch.device, dtype: torch.dtype,
              keep_float32: re.Pattern[str] | None = None) -> None:
    """Fill ``module`` (built on the meta device) from ``ckpt`` tensor by tensor, shard by
    shard (module docstring). Float weights become ``dtype`` (those matching
    ``keep_float32`` stay float32, as transformers keeps them); integer tables keep their
    dtype. Shapes are checked before anything is read."""
    targets = named_tensors(module)
    missing = [n for n in targets if n not in ckpt]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise EngramError(f"checkpoint '{ckpt.path}' lacks tensor {missing[0]}{more}")
    for name, (_mod, _attr, t) in targets.items():
        if tuple(ckpt.shape(name)) != tuple(t.shape):
            raise EngramError(f"tensor {name} has shape {list(ckpt.shape(name))} but the config needs {list(t.shape)}")

    def file_order(name: str) -> tuple[str, int]:
        path, offset, _n = ckpt.locate(name)
        return str(path), int(offset)

    for name in sorted(targets, key=file_order):
        mod, attr, meta = targets[name]
        src = ckpt.get(name)
        if INTEGER_TENSORS.search(name):
            value = src.to(device=device, dtype=torch.int64)
        else:
            want = torch.float32 if keep_float32 is not None and keep_float32.search(name) else dtype
            value = src.to(device=device, dtype=want)
        del src
        if attr in mod._parameters:
            mod._parameters[attr] = nn.Parameter(value, requires_grad=False)
        else:
            mod._buffers[attr] = value
        del value
    # Non-persistent buffers the modules made on the meta device are recomputed by them.
    leftover = [f"{m}.{b}" for m, mod in module.named_modules() for b, t in mod._buffers.items()
                if t is not None and t.is_meta]
    if leftover:
        raise EngramError(f"the model's buffer {leftover[0]} has no value after loading (a module must compute it)")
