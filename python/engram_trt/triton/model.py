"""The ``engram_llm`` model as it runs inside Triton's Python backend.

One :class:`EngramTritonModel` per model instance (one stub process each) owns one
:class:`engram_trt.LLM`. The flow of a request:

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
            raise EngramError("config.pbtxt has no 'engine_dir' parameter; write the repository with `engram-trt triton-repo`")
        ecfg = None
        if (v := text("engram_config")) is not None:
            try:
                ecfg = json.loads(v)
            except json.JSONDecodeError as exc:
                raise EngramError(f"config.pbtxt parameter 'engram_config' is not JSON ({exc.msg})") from None
        interval = text("metrics_interval_s")
        return cls(engine_dir=engine_dir, backend=text("backend") or "auto", device=text("device") or "auto",
                   dtype=text("dtype"), engram_config=ecfg or None, max_batch_size=integer("max_batch_size"),
                   max_seq_len=integer("max_seq_len"), max_num_tokens=integer("max_num_tokens"),
                   default_max_tokens=integer("default_max_tokens") or 16,
                   metrics_interval_s=float(interval) if interval else 1.0)


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
        from engram_trt.llmapi.llm import LLM

        self.pb = pb_utils
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise EngramError("engram_llm must be decoupled (model_transaction_policy { decoupled: true }) so tokens stream as they are generated")
        self.params = p = ModelParams.from_model_config(config)
        device = p.device
        if args.get("model_instance_kind") == "GPU":
            device = f"cuda:{int(args['model_instance_device_id'])}"
        self.instance = args.get("model_instance_name", "engram_llm_0")
        self.llm = LLM(p.engine_dir, backend=p.backend, engram_config=p.engram_config, device=device, dtype=p.dtype,
                       max_batch_size=p.max_batch_size, max_seq_len=p.max_seq_len, max_num_tokens=p.max_num_tokens,
                       progress=False)
        pb_utils.Logger.log_info(
            f"engram_llm instance {self.instance}: {p.engine_dir} on {self.llm.device}, backend {self.llm.backend_label} "
            f"({self.llm.backend_reason}); tables {self.llm.storage.get('kind')}; "
            f"{self.llm.runner.max_batch} KV slots of {self.llm.runner.max_seq_len} tokens")
        self._queue: queue.SimpleQueue[tuple[_Stream, Any] | None] = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_loop, name="engram-triton-sender", daemon=True)
        self._sender.start()
        labels = {"model": args.get("model_name", "engram_llm"), "version": str(args.get("model_version", "1")),
                  "instance": self.instance}
        storage = self.llm.storage  # fixed for the instance's life
        self.metrics = MetricsExporter(pb_utils, lambda: {**self.llm.stats(), "storage": storage}, labels,
                                       interval=p.metrics_interval_s)
        self.metrics.update()
        self.metrics.start()

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
            st.sender.send(pb.InferenceResponse(output_tensors=self._tensors(text, ids, out.finish_reason)),
                           flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _give_up(self, st: _Stream) -> None:
        """The client is gone: stop generating; the 'cancelled' event sends the final flag."""
        st.client_gone = True
        if st.handle is not None:
            self.llm.cancel(st.handle)

    def _tensors(self, text: str, ids: list[int], finish_reason: str | None = None) -> list[Any]:
        pb = self.pb
        out = [pb.Tensor("text_output", np.array([[text.encode("utf-8")]], dtype=np.object_)),
               pb.Tensor("output_ids", np.asarray(ids, dtype=np.int32).reshape(1, -1))]
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
        self.llm.close()  # emits a 'cancelled' event for every unfinished request
        self._queue.put(None)
        self._sender.join(timeout=30)


__all__ = ["EngramTritonModel", "ModelParams"]
