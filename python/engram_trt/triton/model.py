"""The ``engram_llm`` model as it runs inside Triton's Python backend.

One :class:`EngramTritonModel` per model instance (one stub process each) owns one
:class:`engram_trt.LLM`. With the ``tp`` parameter above 1 the instance is the leader
(TP rank 0) of a tensor-parallel group: :func:`engram_trt.distributed.serving.start_serving_group`
starts the ``tp - 1`` followers at ``initialize`` (on the GPUs of the instance's
``tp_gpus`` entry, or as CPU processes) and hands back the leader's LLM, which the
model uses as any other; ``finalize`` stops the group. Requests to a group that lost a
rank get one error naming it. Its metrics carry a ``tp_group`` label. The flow of a
request:

1. ``execute`` (Triton's thread) parses the inputs (:func:`.tensors.parse_request`),
   submits the prompt to the LLM with a sink, and returns at once: the model is
   decoupled, so Triton's next ``execute`` call (the next client's request) does not
   wait for this one to finish, and the scheduler batches them all.
2. The LLM's engine thread calls the sink with each delta; the sink only puts it on a
   queue, so the engine thread never waits on Triton's IPC.
3. The sender thread takes deltas off the queue and sends responses through the
   request's response sender: one per delta when streaming (``text_output`` the new
   text, ``output_ids`` the new ids), or one at the end otherwise (the whole text and
   ids). The last response carries the final flag and ``finish_reason``.

A request the client gave up on (``is_cancelled``, polled at most every
``CANCEL_POLL_S`` per request, or a send that fails) is cancelled in the scheduler, so
its KV slot goes to the next request. A bad request gets one error response naming the
problem and never disturbs the others. Never call the sender after its final flag:
Triton frees the response factory then (calling ``is_cancelled`` on it crashes the
server).
"""

from __future__ import annotations

import json
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engram_trt.errors import EngramError
from engram_trt.triton.metrics import MetricsExporter
from engram_trt.triton.tensors import parse_request


CANCEL_POLL_S = 0.25


@dataclass(frozen=True)
class ModelParams:
    """The ``parameters`` of config.pbtxt that :mod:`.repo` writes (all strings there)."""

    engine_dir: str
    backend: str = "auto"
    device: str = "auto"
    dtype: str | None = None
    engram_config: dict[str, Any] | None = None
    max_batch_size: int | None = None
    max_seq_len: int | None = None
    max_num_tokens: int | None = None
    default_max_tokens: int = 16
    metrics_interval_s: float = 1.0
    tp: int = 1  # ranks per instance: the instance leads a TP group of tp ranks
    dp: int = 1  # instances (replicas) in the deployment, for the table-sharing choice
    tp_gpus: tuple[tuple[int, ...], ...] = ()  # per KIND_GPU instance, its group's GPUs (the first is the instance's)
    group_timeout_s: float = 600.0  # the TP group's collectives and start-up
    allow_unused_weights: bool = False  # serve a checkpoint holding tensors the model does not read

    @classmethod
    def from_model_config(cls, config: dict[str, Any]) -> "ModelParams":
        raw = {k: (v or {}).get("string_value", "") for k, v in (config.get("parameters") or {}).items()}

        def text(name: str) -> str | None:
            v = raw.get(name, "").strip()
            return v or None

        def integer(name: str) -> int | None:
            v = text(name)
            if v is None:
                return None
            try:
                return int(v)
            except ValueError:
                raise EngramError(f"config.pbtxt parameter '{name}' must be an integer (got {v!r})") from None

        engine_dir = text("engine_dir")
        if engine_dir is None:
            raise EngramError(
                "config.pbtxt has no 'engine_dir' parameter; write the repository with `engram-trt triton-repo`"
            )
        ecfg = None
        if (v := text("engram_config")) is not None:
            try:
                ecfg = json.loads(v)
            except json.JSONDecodeError as exc:
                raise EngramError(f"config.pbtxt parameter 'engram_config' is not JSON ({exc.msg})") from None
        interval = text("metrics_interval_s")
        tp, dp = integer("tp") or 1, integer("dp") or 1
        if tp < 1 or dp < 1:
            raise EngramError(f"config.pbtxt parameters 'tp' and 'dp' must be >= 1 (got tp {tp}, dp {dp})")
        timeout = text("group_timeout_s")
        unused = (text("allow_unused_weights") or "false").lower()
        if unused not in ("true", "false"):
            raise EngramError(f"config.pbtxt parameter 'allow_unused_weights' must be true or false (got {unused!r})")
        return cls(
            engine_dir=engine_dir,
            backend=text("backend") or "auto",
            device=text("device") or "auto",
            dtype=text("dtype"),
            engram_config=ecfg or None,
            max_batch_size=integer("max_batch_size"),
            max_seq_len=integer("max_seq_len"),
            max_num_tokens=integer("max_num_tokens"),
            default_max_tokens=integer("default_max_tokens") or 16,
            metrics_interval_s=float(interval) if interval else 1.0,
            tp=tp,
            dp=dp,
            tp_gpus=parse_tp_gpus(text("tp_gpus") or "", tp),
            group_timeout_s=float(timeout) if timeout else 600.0,
            allow_unused_weights=unused == "true",
        )

    def llm_kwargs(self) -> dict[str, Any]:
        """The :class:`engram_trt.LLM` options besides the path, device and tables."""
        return {
            "backend": self.backend,
            "dtype": self.dtype,
            "max_batch_size": self.max_batch_size,
            "max_seq_len": self.max_seq_len,
            "max_num_tokens": self.max_num_tokens,
            "progress": False,
            "allow_unused_weights": self.allow_unused_weights,
        }


def parse_tp_gpus(text: str, tp: int) -> tuple[tuple[int, ...], ...]:
    """``'0,1;2,3'`` (the ``tp_gpus`` parameter: per instance, its group's GPUs) -> ((0, 1), (2, 3))."""
    if not text.strip():
        return ()
    try:
        groups = tuple(tuple(int(g) for g in part.split(",")) for part in text.split(";"))
    except ValueError:
        raise EngramError(
            f"config.pbtxt parameter 'tp_gpus' must be GPU ids such as '0,1;2,3' (got {text!r})"
        ) from None
    if any(len(g) != tp for g in groups):
        raise EngramError(f"config.pbtxt parameter 'tp_gpus' {text!r} must list {tp} GPUs (tp) per instance")
    return groups


@dataclass(eq=False)
class _Stream:
    """One request's sending state (touched by the sender thread only, after submit)."""

    sender: Any
    stream: bool
    handle: Any = None
    final_sent: bool = False
    client_gone: bool = False
    next_cancel_poll: float = field(default_factory=lambda: time.monotonic() + CANCEL_POLL_S)


class EngramTritonModel:
    """See the module docstring. ``pb_utils`` is Triton's ``triton_python_backend_utils``;
    ``args`` the dict Triton passes to ``initialize``."""

    def __init__(self, pb_utils: Any, args: dict[str, Any]) -> None:
        self.pb = pb_utils
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise EngramError(
                "engram_llm must be decoupled (model_transaction_policy { decoupled: true }) "
                "so tokens stream as they are generated"
            )
        self.params = p = ModelParams.from_model_config(config)
        self.instance = args.get("model_instance_name", "engram_llm_0")
        self.group: Any = None  # the TP group this instance leads (tp > 1)
        gpu = args.get("model_instance_kind") == "GPU"
        self.llm, warnings = self._open(p, f"cuda:{int(args['model_instance_device_id'])}" if gpu else None)
        try:
            self._start(args, warnings)
        except BaseException:
            self._close_llm()  # a load that fails leaves no follower behind
            raise

    def _open(self, p: ModelParams, instance_gpu: str | None) -> tuple[Any, tuple[str, ...]]:
        """The instance's LLM (the leader's, with tp > 1) and the table-sharing fallbacks to log."""
        device = instance_gpu or p.device
        if p.tp > 1:
            from engram_trt.distributed.serving import GroupSpec, start_serving_group

            self.group = start_serving_group(
                GroupSpec(
                    p.engine_dir,
                    p.tp,
                    group_devices(p, instance_gpu),
                    dp=p.dp,
                    engram_config=p.engram_config,
                    llm_kwargs=p.llm_kwargs(),
                    name=f"{self.instance}/tp{p.tp}",
                    timeout_s=p.group_timeout_s,
                    start_timeout_s=p.group_timeout_s,
                )
            )
            return self.group.llm, self.group.sharing.warnings
        from engram_trt.llmapi.llm import LLM

        ecfg: Any = p.engram_config
        warnings: tuple[str, ...] = ()
        if p.dp > 1:  # replicas step independently: a serving replica's sharing choice (and its fallbacks)
            from engram_trt.distributed.serving import serving_sharing

            sharing = serving_sharing(p.engine_dir, p.engram_config, 1, p.dp, backend=p.backend, device=device)
            ecfg, warnings = sharing.engram_config, sharing.warnings
        return LLM(p.engine_dir, engram_config=ecfg, device=device, **p.llm_kwargs()), warnings

    def _start(self, args: dict[str, Any], warnings: tuple[str, ...]) -> None:
        pb_utils, p = self.pb, self.params
        for w in warnings:
            pb_utils.Logger.log_warn(f"engram_llm instance {self.instance}: {w}")
        group = (
            (
                f"; leads TP group {self.group.name} of {p.tp} ranks ({', '.join(self.group.spec.devices)}; "
                f"follower pids {self.group.follower_pids()}), tables {self.group.sharing.dp_mode}"
            )
            if self.group
            else ""
        )
        pb_utils.Logger.log_info(
            f"engram_llm instance {self.instance}: {p.engine_dir} on {self.llm.device}, "
            f"backend {self.llm.backend_label} ({self.llm.backend_reason}); tables {self.llm.storage.get('kind')}; "
            f"{self.llm.runner.max_batch} KV slots of {self.llm.runner.max_seq_len} tokens{group}"
        )
        self._queue: queue.SimpleQueue[tuple[_Stream, Any] | None] = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_loop, name="engram-triton-sender", daemon=True)
        self._sender.start()
        labels = {
            "model": args.get("model_name", "engram_llm"),
            "version": str(args.get("model_version", "1")),
            "instance": self.instance,
        }
        if self.group is not None:
            labels["tp_group"] = self.group.name
        self._storage = self.llm.storage  # fixed for the instance's life
        self.metrics = MetricsExporter(pb_utils, self._stats, labels, interval=p.metrics_interval_s)
        self.metrics.update()
        self.metrics.start()

    def _close_llm(self) -> None:
        if self.group is not None:
            self.group.stop()  # closes the LLM, then waits for the followers to exit
        else:
            self.llm.close()  # emits a 'cancelled' event for every unfinished request

    def _stats(self) -> dict[str, Any]:
        st = {**self.llm.stats(), "storage": self._storage}
        if self.group is not None:
            st["tp_group"] = self.group.stats()
        return st

    # -- Triton's thread ----------------------------------------------------------------
    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                self._submit(request, sender)
            except Exception as exc:
                msg = str(exc) if isinstance(exc, EngramError) else f"{type(exc).__name__}: {exc}"
                self._send_error(sender, msg)
        return None

    def _submit(self, request: Any, sender: Any) -> None:
        def get(name: str) -> np.ndarray | None:
            t = self.pb.get_input_tensor_by_name(request, name)
            return None if t is None else t.as_numpy()

        req = parse_request(get, self.params.default_max_tokens)
        if self.group is not None and (problem := self.group.problem()) is not None:
            raise EngramError(problem)
        st = _Stream(sender, req.stream)
        st.handle = self.llm.submit(req.prompt, req.params, sink=lambda out, st=st: self._queue.put((st, out)))

    # -- the sender thread --------------------------------------------------------------
    def _send_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            st, out = item
            try:
                self._deliver(st, out)
            except Exception as exc:  # one request's failure never stops the others
                self.pb.Logger.log_warn(f"engram_llm: sending request {out.request_id} failed ({exc}); cancelling it")
                self._give_up(st)
            if out.finished:
                self.metrics.poke()

    def _deliver(self, st: _Stream, out: Any) -> None:
        pb = self.pb
        if st.final_sent:
            return
        if not out.finished:
            if st.client_gone:
                return
            now = time.monotonic()
            if now >= st.next_cancel_poll:
                st.next_cancel_poll = now + CANCEL_POLL_S
                if st.sender.is_cancelled():
                    self._give_up(st)
                    return
            if st.stream:
                st.sender.send(pb.InferenceResponse(output_tensors=self._tensors(out.delta_text, out.delta_token_ids)))
            return
        # The last event of the request.
        st.final_sent = True
        if st.client_gone:
            st.sender.send(flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        elif out.finish_reason == "error":
            self._send_error(st.sender, out.error or "generation failed")
        elif out.finish_reason == "cancelled":
            self._send_error(st.sender, "the request was cancelled: the server is shutting down")
        else:
            text, ids = (out.delta_text, out.delta_token_ids) if st.stream else (out.text, out.token_ids)
            st.sender.send(
                pb.InferenceResponse(output_tensors=self._tensors(text, ids, out.finish_reason)),
                flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
            )

    def _give_up(self, st: _Stream) -> None:
        """The client is gone: stop generating; the 'cancelled' event sends the final flag."""
        st.client_gone = True
        if st.handle is not None:
            self.llm.cancel(st.handle)

    def _tensors(self, text: str, ids: list[int], finish_reason: str | None = None) -> list[Any]:
        pb = self.pb
        out = [
            pb.Tensor("text_output", np.array([[text.encode("utf-8")]], dtype=np.object_)),
            pb.Tensor("output_ids", np.asarray(ids, dtype=np.int32).reshape(1, -1)),
        ]
        if finish_reason is not None:
            out.append(pb.Tensor("finish_reason", np.array([[finish_reason.encode()]], dtype=np.object_)))
        return out

    def _send_error(self, sender: Any, message: str) -> None:
        pb = self.pb
        sender.send(pb.InferenceResponse(error=pb.TritonError(message)), flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    # -- lifetime ---------------------------------------------------------------------------
    def finalize(self) -> None:
        """Unload: unfinished requests end with an error response, then the LLM closes."""
        self.metrics.stop()
        self._close_llm()  # unfinished requests get a 'cancelled' event; a TP group's followers exit
        self._queue.put(None)
        self._sender.join(timeout=30)


def group_devices(p: ModelParams, instance_gpu: str | None) -> tuple[str, ...]:
    """The devices of the TP group an instance leads: on a KIND_GPU instance, the GPUs
    of its ``tp_gpus`` entry (the one whose first GPU is the instance's); on KIND_CPU,
    ``tp`` CPU ranks (gloo)."""
    if instance_gpu is None:
        if p.device != "cpu":
            raise EngramError(
                f"a KIND_CPU instance with tp {p.tp} runs its group on CPU, but the 'device' parameter is "
                f"{p.device!r}; write the repository with `engram-trt triton-repo --tp {p.tp} --gpus ...` to "
                "place the groups on GPUs, or --device cpu"
            )
        return ("cpu",) * p.tp
    first = int(instance_gpu.split(":")[1])
    for g in p.tp_gpus:
        if g[0] == first:
            return tuple(f"cuda:{i}" for i in g)
    raise EngramError(
        f"this instance runs on GPU {first}, which leads no group of the 'tp_gpus' parameter "
        f"({';'.join(','.join(map(str, g)) for g in p.tp_gpus) or 'empty'}); rewrite the repository with "
        "`engram-trt triton-repo --tp N --dp M`"
    )


__all__ = ["EngramTritonModel", "ModelParams"]
