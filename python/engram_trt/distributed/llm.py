"""``engram_trt.LLM(path, tp=N)``: the LLM of :mod:`engram_trt.llmapi`, leading a
tensor-parallel group of ``N`` ranks when asked.

With ``tp`` 1 it is exactly :class:`engram_trt.llmapi.llm.LLM`. With ``tp`` above 1 this
process is the group's leader (TP rank 0: it takes the requests, schedules and samples)
and starts the ``N - 1`` followers as :mod:`.serving` starts a Triton instance's
(:func:`~.serving.start_serving_group`: ``python -c ...follower_main`` processes meeting
the leader through a loopback store, NVLink multicast off); every rank holds its share of
the backbone (:mod:`engram_trt.models.parallel`) and of the Engram columns, and steps in
lockstep. ``close()`` (or leaving the ``with`` block) ends the followers. Ranks: ``cpu``
(gloo processes), or one GPU each (``cuda`` / ``auto`` with CUDA: GPUs ``0..N-1``, or
``gpus=[...]``).
"""

from __future__ import annotations

from typing import Any, Sequence

from engram_trt.errors import EngramError
from engram_trt.llmapi.llm import LLM as _LLM

_HOOKS = ("engram_lookup", "scheduler_factory", "tensor_parallel")


class LLM(_LLM):
    """See the module docstring. ``tp``: tensor-parallel ranks (1: one process);
    ``gpus``: the ranks' GPUs (default ``0..tp-1``); ``group_timeout_s``: the collectives'
    timeout (a rank that died ends the others within it). Every other keyword is
    :class:`engram_trt.llmapi.llm.LLM`'s."""

    def __init__(
        self,
        path: str,
        *,
        tp: int = 1,
        device: Any = "auto",
        gpus: Sequence[int] | None = None,
        group_timeout_s: float = 600.0,
        **kw: Any,
    ) -> None:
        self._group: Any = None
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise EngramError(f"tp must be an integer >= 1 (got {tp!r})")
        if tp == 1:
            super().__init__(path, device=device, **kw)
            return
        given = [k for k in _HOOKS if kw.get(k) is not None]
        if given:
            raise EngramError(
                f"LLM(tp={tp}) starts its own group; drop {', '.join(given)} (the hooks of a rank "
                f"engram_trt.distributed builds)"
            )
        from engram_trt.config.engram import EngramConfig
        from engram_trt.distributed.serving import GroupSpec, start_serving_group
        from engram_trt.distributed.support import check_parallel_support

        ecfg = kw.pop("engram_config", None)
        if ecfg is not None and not isinstance(ecfg, EngramConfig):
            ecfg = EngramConfig.parse(ecfg)
        check_parallel_support(path, tp, 1, ecfg)
        devices = group_devices(device, tp, gpus)
        if devices[0].startswith("cuda"):
            from engram_trt.distributed.support import check_gpu_fit, gpu_memory_bytes

            first = int(devices[0].split(":")[1])
            check_gpu_fit(path, tp, kw.get("dtype"), gpu_memory_bytes(first), f"GPU {first}")
        spec = GroupSpec(
            str(path),
            tp,
            devices,
            1,
            engram_config=None if ecfg is None else ecfg.to_dict(),
            llm_kwargs=_json_kwargs(kw),
            name=f"llm-tp{tp}",
            timeout_s=group_timeout_s,
            start_timeout_s=group_timeout_s,
        )
        self._group = start_serving_group(spec, build=self._init_leader)

    def _init_leader(self, spec: Any, ctx: Any) -> tuple[Any, Any]:
        """Initialize this object as the group's rank 0 (start_serving_group's ``build``)."""
        from engram_trt.distributed.serving import rank_llm_kwargs

        kw, sharing = rank_llm_kwargs(spec, ctx)
        super().__init__(spec.path, **kw)
        return self, sharing

    @property
    def group(self) -> Any:
        """The :class:`~.serving.ServingGroup` this LLM leads (None with one rank)."""
        return self._group

    def close(self) -> None:
        """Close the LLM; with ``tp`` above 1, the whole group (its followers exit)."""
        group, self._group = self._group, None
        if group is not None:
            group.stop()  # closes this LLM (back here, with no group), waits for the followers
            return
        super().close()


def group_devices(device: Any, tp: int, gpus: Sequence[int] | None) -> tuple[str, ...]:
    """Per TP rank its device: ``cpu`` (gloo), else one GPU each (``gpus`` or ``0..tp-1``)."""
    import torch

    d = str(device or "auto").lower()
    if gpus is not None:
        ids = [int(g) for g in gpus]
        if len(ids) != tp or len(set(ids)) != tp:
            raise EngramError(f"gpus {list(gpus)} must name {tp} distinct GPUs, one per TP rank")
        return tuple(f"cuda:{g}" for g in ids)
    if d == "cpu" or (d == "auto" and not torch.cuda.is_available()):
        return ("cpu",) * tp
    if d not in ("cuda", "auto"):
        raise EngramError(
            f"device {device!r}: with tp={tp} each rank takes its own GPU; pass device='cuda' (GPUs "
            f"0..{tp - 1}), gpus=[...], or device='cpu'"
        )
    n = torch.cuda.device_count()
    if n < tp:
        raise EngramError(
            f"tp={tp} needs {tp} GPUs, one per rank, but this machine has {n}; lower tp or pass device='cpu'"
        )
    return tuple(f"cuda:{i}" for i in range(tp))


def _json_kwargs(kw: dict[str, Any]) -> dict[str, Any]:
    """The LLM keywords the followers get on their command line (JSON); a torch dtype by name."""
    import json

    out = dict(kw)
    dtype = out.get("dtype")
    if dtype is not None and not isinstance(dtype, str):
        out["dtype"] = str(dtype).replace("torch.", "")
    try:
        json.dumps(out)
    except TypeError as exc:
        raise EngramError(
            f"LLM(tp=...): the options reach the follower ranks as JSON, and one is not ({exc}); pass plain values"
        ) from None
    return out


__all__ = ["LLM", "group_devices"]
