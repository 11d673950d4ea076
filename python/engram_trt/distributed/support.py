"""What a model can run over several ranks, asked before any rank starts.

``--tp N`` shards the backbone of every family whose registry entry declares it
(``tensor_parallel``; :meth:`parallel_plan` gives each rank's share): the plan of every
rank is made here first, so a size the model cannot split (``--tp`` above or not
dividing the heads, the experts) is refused in one line naming the field, and the
checkpoint's headers are held to the plans (a stored FP8 / FP4 weight whose shard would
cut a scale block is refused naming the tensor and the TP size). A family that does not
shard is refused naming it. ``embedding_across_dp`` shards Engram tables over every rank,
so it is refused for a family whose tables are its own (Qwen4Exp's PLE). ``--dp M``
(whole replicas) runs every family.

:func:`check_gpu_fit`: before loading on GPUs, the bytes each rank would hold at this
TP (from the checkpoint's headers: stored bytes for quantized weights), against the
GPU's memory; a model that does not fit is refused saying how many GPUs of this size
it needs.

The checks read the folder's config through the model registry
(:func:`~engram_trt.runtime.engine_folder.peek_model`) and the checkpoint's headers:
no weights, no tables, no process started.
"""

from __future__ import annotations

import logging
from typing import Any

from engram_trt.config.engram import EngramConfig
from engram_trt.errors import EngramError

log = logging.getLogger(__name__)

GPU_FILL = 0.9  # the share of a GPU's memory the weights may take (the rest: state, activations, graphs)


def check_parallel_support(
    path: Any, tp: int, dp: int, engram_config: EngramConfig | None = None, *, serving: bool = False
) -> Any:
    """Refuse (one :class:`EngramError` line) a ``--tp`` / ``embedding_across_dp`` the
    model of ``path`` cannot run; returns the folder's
    :class:`~engram_trt.runtime.engine_folder.ModelPeek` (None for one rank, where
    nothing is read)."""
    from engram_trt.runtime.engine_folder import peek_model

    for name, v in (("tp", tp), ("dp", dp)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise EngramError(f"--{name} must be >= 1 (got {v})")
    if tp == 1 and dp == 1:
        return None
    peek = peek_model(path)
    arch = peek.architecture
    family = peek.family
    if tp > 1 and not arch.tensor_parallel:
        then = (
            "serve --tp 1 (--dp M serves M whole instances)"
            if serving
            else "run with --tp 1 (--dp M runs M whole replicas)"
        )
        raise EngramError(f"--tp {tp}: {family} backbones are not sharded over tensor-parallel ranks; {then}")
    if tp > 1:
        check_plans(path, peek, tp)
    across = engram_config is not None and engram_config.embedding_across_dp
    if dp > 1 and across and peek.has_tables and peek.config.engram is None:
        raise EngramError(
            f"--engram-config.embedding_across_dp: {family}'s own tables (not Engram tables) are not "
            f"sharded across ranks; drop it (--engram-config.dp_shared_memory true keeps one /dev/shm "
            f"copy per node for the {dp} replicas)"
        )
    if engram_config is not None and engram_config.given:
        engram_config.validate_for(peek.config)  # what each rank would refuse, said once before they start
    return peek


def check_plans(path: Any, peek: Any, tp: int) -> list[Any]:
    """Every rank's :class:`~engram_trt.models.parallel.ParallelPlan` (a size the model
    cannot split refused), held to the checkpoint's headers; returns the plans."""
    plans = [peek.architecture.parallel_plan(peek.config, tp, r) for r in range(tp)]
    if not plans[0].sharded:
        return plans
    ckpt = _open(path)
    try:
        for plan in plans:
            plan.check_checkpoint(ckpt)
    finally:
        ckpt.close()
    return plans


def _open(path: Any) -> Any:
    from engram_trt.models.registry import open_checkpoint
    from engram_trt.runtime.engine_folder import checkpoint_of

    return open_checkpoint(checkpoint_of(path), allow_unused=True)


def rank_weight_bytes(
    arch: Any, config: Any, formats: dict[str, tuple[str, int, int]], shapes: dict[str, tuple[int, ...]], tp: int
) -> int | None:
    """The most bytes one rank places at ``--tp tp`` (None: the model cannot split so)."""
    from engram_trt.models.parallel import rank_bytes

    if tp == 1:
        return sum(p for _k, _s, p in formats.values())
    try:
        plans = [arch.parallel_plan(config, tp, r) for r in range(tp)]
    except EngramError:
        return None
    if not plans[0].sharded:
        return sum(p for _k, _s, p in formats.values())
    return max(rank_bytes(p, formats, shapes) for p in plans)


def gpus_needed(
    arch: Any,
    config: Any,
    formats: dict[str, tuple[str, int, int]],
    shapes: dict[str, tuple[int, ...]],
    tp: int,
    gpu_bytes: int,
    largest: int = 64,
) -> tuple[int, int | None]:
    """``(bytes per rank at --tp tp, the smallest --tp >= tp at which every rank's share
    fits GPU_FILL of gpu_bytes)``, None when no --tp up to ``largest`` fits."""
    now = rank_weight_bytes(arch, config, formats, shapes, tp)
    if now is None:
        raise EngramError(f"internal: --tp {tp} was not checked against the model before its fit")
    budget = GPU_FILL * gpu_bytes
    for t in range(tp, largest + 1):
        need = now if t == tp else rank_weight_bytes(arch, config, formats, shapes, t)
        if need is not None and need <= budget:
            return now, t
    return now, None


def check_gpu_fit(path: Any, tp: int, dtype: Any, gpu_bytes: int | None, what: str = "a GPU here") -> None:
    """Refuse, before loading, a model whose per-rank weights at ``--tp tp`` exceed what a
    GPU of ``gpu_bytes`` holds, saying how many GPUs of this size it needs (module
    docstring). ``gpu_bytes`` None (no such GPU on this machine): nothing to check."""
    import torch

    from engram_trt.config.dtypes import TORCH_NAMES, normalize_dtype

    if gpu_bytes is None:
        return

    if isinstance(dtype, str):
        dtype = getattr(torch, TORCH_NAMES[normalize_dtype(dtype)])
    try:
        ckpt = _open(path)
    except EngramError as exc:  # no checkpoint to read the bytes from (an engine folder's moved): the load says
        log.debug("no weight-size check before loading: %s", exc)
        return
    try:
        arch = ckpt.architecture
        formats = arch.weight_formats(ckpt, dtype or torch.bfloat16)
        shapes = {n: tuple(ckpt.shape(n)) for n in formats}
        config = ckpt.config
    finally:
        ckpt.close()
    total = sum(p for _k, _s, p in formats.values())
    now, fits = gpus_needed(arch, config, formats, shapes, tp, gpu_bytes)
    if fits == tp:
        return
    gib = 2**30
    head = (
        f"{path}: the weights take {total / gib:.2f} GiB; at --tp {tp} a rank holds {now / gib:.2f} GiB, more than "
        f"{GPU_FILL:.0%} of {what} ({gpu_bytes / gib:.2f} GiB)"
    )
    if fits is None:
        raise EngramError(
            f"{head}, and no --tp this model splits into fits such GPUs; use larger GPUs (or quantized weights)"
        )
    raise EngramError(f"{head}: it needs {fits} GPUs of this size; pass --tp {fits}")


def gpu_memory_bytes(index: int = 0) -> int | None:
    """Total memory of this machine's CUDA device ``index`` (None: no such device here)."""
    import torch

    if not torch.cuda.is_available() or index >= torch.cuda.device_count():
        return None
    return int(torch.cuda.get_device_properties(index).total_memory)
