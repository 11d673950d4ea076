"""What a DeepSeek-V4 / V4.1 decode step needs to be recorded as a CUDA graph, and the
choices that keep it free of host reads.

The recording and replay are the runtime's :class:`engram_trt.runtime.cuda_graphs.DecodeGraphs`,
the very runner engram-llama's decode steps go through: V4.1 takes its Engram rows the way
engram-llama does (hashed from the compressed ids and the lookback, gathered from the
runtime's table store, staged by the prefetcher on its side stream into fixed buffers, or
gathered inside the graph when the tables are GPU-readable), so the same runner serves both.
What this family brings is a step that reads nothing of a step from the host:

* the model's :meth:`~.model.DeepseekV4Model.forward_step` in three stages (``step_begin``,
  ``step_layers``, ``step_end``), the captured function being the eager one, cut where an
  Engram layer waits for its rows;
* every length from the device: the attention core's one library call per layer
  (:mod:`.attention_kernel`) reads ``seq_starts / past_lens / slots`` from the step's
  uploaded metadata, the RoPE angles come from the uploaded positions, the per-slot state
  (:mod:`.state`) is sized by ``max_len`` once. So no step shape depends on a context
  length and one graph per batch bucket serves every length
  (``DeepseekV4Model.decode_context_free``); the runner's context bucket is ``max_len``;
* the MoE in a sync-free form (:func:`decode_moe_form`): the ``loop`` form reads the
  expert counts on the host and ``grouped`` counts them with ``torch.bincount``, which
  reads its maximum back; a decode step on CUDA takes ``dense`` (every expert once, while
  ``tokens x experts`` is small) or ``gathered`` instead, in eager decode steps and in
  the recording alike;
* :func:`graphs_unavailable`: why a model cannot be recorded (the attention on its torch
  path, whose loop over sequences takes host lengths, an explicit MoE form that reads the
  host), so the backend runs eager steps and says why instead of recording a wrong graph.

Padding sequences of a bucket run on a scratch slot the scheduler never hands out, with
past length 0 (a fresh sequence: the kernel reads nothing of the slot); several padding
sequences of one step share it, which garbles only that slot and those rows (no module
of this model mixes tokens: the attention, the MoE forms, mHC and the norms are per token
or per sequence).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    from engram_trt.models.deepseek_v4.moe import GroupedSparseMoE

# MoE forms that read a value back on the host (GroupedSparseMoE: ``loop`` takes the
# expert counts with .tolist(); ``grouped`` counts them with torch.bincount, whose CUDA
# form reads the ids' maximum back). Every other form is a fixed launch sequence.
SYNCING_MOE_FORMS = ("loop", "grouped")


def decode_moe_form(chosen: str, tokens: int, experts: int, dense_max: int) -> str | None:
    """The form a decode step's MoE takes on CUDA when ``chosen`` (the module's ``auto``
    pick) would read the host; None keeps ``chosen``. ``dense`` while ``tokens x experts``
    is at most ``dense_max`` (every expert's weights read once), else ``gathered`` (each
    pick's expert weights)."""
    if chosen not in SYNCING_MOE_FORMS:
        return None
    return "dense" if tokens * experts <= dense_max else "gathered"


@contextlib.contextmanager
def sync_free_moe(mlp: GroupedSparseMoE, x: Any) -> Iterator[None]:
    """While open, ``mlp`` (a :class:`~.moe.GroupedSparseMoE` with ``form`` ``auto``) takes a
    sync-free form for activations ``x [T, D]`` on CUDA (:func:`decode_moe_form`); an
    explicitly set form, or a CPU step, is left alone."""
    import torch

    from engram_trt.models.deepseek_v4.moe import DENSE_MAX_TOKEN_EXPERTS

    swap = None
    if x.is_cuda and mlp.form == "auto" and not mlp.quantized_experts:
        probe = torch.empty(
            (x.shape[0], mlp.gate.top_k), dtype=torch.int64, device="meta"
        )  # choose_form reads its size
        swap = decode_moe_form(mlp.choose_form(x, probe), x.shape[0], len(mlp.experts), DENSE_MAX_TOKEN_EXPERTS)
    if swap is None:
        yield
        return
    had = "form" in mlp.__dict__
    before = mlp.__dict__.get("form")
    mlp.form = swap
    try:
        yield
    finally:
        if had:
            mlp.form = before
        else:
            del mlp.form


def graphs_unavailable(model: Any) -> str | None:
    """Why ``model``'s decode steps cannot be recorded as CUDA graphs (None: they can)."""
    import torch

    from engram_trt.models.deepseek_v4.attention_kernel import check_backend, why_not_kernel

    if model.device.type != "cuda":
        return f"the model is on {model.device}, not a CUDA device"
    probe = torch.empty(0, device=model.device, dtype=model.compute_dtype)
    for layer in model.model.layers:
        attn = layer.self_attn
        why = (
            "its attention backend is 'torch'"
            if check_backend(attn.backend) == "torch"
            else why_not_kernel(attn, probe, None)
        )
        if why is not None:
            return (
                f"layer {layer.index}'s attention core is not on the CUDA kernel ({why}), and the torch core's "
                "loop over sequences reads their lengths on the host"
            )
        form = layer.mlp.form  # a GroupedSparseMoE: form and quantized_experts are declared
        if layer.mlp.quantized_experts and form in ("auto", "kernels"):
            why = layer.mlp.kernels_unavailable(
                torch.empty((1, model.config.hidden_size), device=model.device, dtype=model.compute_dtype)
            )
            if why is not None:  # the float forms cannot take stored-format experts: only the loop would
                return (
                    f"layer {layer.index}'s quantized experts are not on the kernel library ({why}), and the "
                    "loop over experts reads their counts on the host"
                )
        elif form in SYNCING_MOE_FORMS:
            return f"layer {layer.index}'s MoE form is {form!r}, which reads expert counts on the host; use 'auto'"
    return None


__all__ = ["SYNCING_MOE_FORMS", "decode_moe_form", "graphs_unavailable", "sync_free_moe"]
