"""``engram_trt.LLM``: the Python API, in the shape users know from vLLM's and
TensorRT-LLM's ``LLM``.

    from engram_trt import LLM, SamplingParams
    with LLM("engine_dir") as llm:
        out = llm.generate(["Engram layers look up"], SamplingParams(max_tokens=32))
        print(out[0].text)

``path`` is an engine folder (the main case: everything the runtime needs is in it) or
a checkpoint folder. Requests from any thread go to one scheduler, which batches them
as they arrive (:mod:`engram_trt.runtime.scheduler`); ``generate`` waits for all of its
prompts, ``generate_stream`` yields each request's new tokens as they come, and
``generate_async`` is the asyncio form for servers. ``close()`` (or leaving the ``with``
block) stops the engine thread and frees pinned and shared memory.
"""

from __future__ import annotations

import asyncio
import logging
import queue
from typing import Any, AsyncIterator, Iterator, Sequence

from engram_trt.config.engram import EngramConfig
from engram_trt.errors import EngramError
from engram_trt.runtime.outputs import RequestOutput
from engram_trt.runtime.sampling_params import SamplingParams, as_param_list

log = logging.getLogger(__name__)

PromptLike = "str | Sequence[int]"


class LLM:
    """A model loaded for serving (see the module docstring).

    ``backend``: ``auto`` (TensorRT where it can run the engine, else torch, with the
    reason logged and in :attr:`backend_reason`), ``tensorrt`` or ``torch``.
    ``engram_config``: the ``--engram-config`` fields (an :class:`EngramConfig`, JSON
    text, a path or a dict) choosing where the tables live; default: the engine
    folder's. ``device``: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``. ``dtype``: compute
    dtype of the torch backend (default bfloat16 on a GPU, float32 on a CPU).
    ``max_batch_size`` / ``max_seq_len`` / ``max_num_tokens``: KV slots, their length,
    and the token budget of one step (default: the engine's). ``verify_tables``: check
    every table's sha256 before serving (reads every byte). ``allow_unused_weights``:
    serve a checkpoint that holds tensors the model does not read (refused otherwise,
    with their names).
    ``engram_lookup`` / ``scheduler_factory`` / ``tensor_parallel``: hooks for
    :mod:`engram_trt.distributed` (a sharded Engram lookup in place of the table store, a
    scheduler stepping in lockstep with the other ranks, this rank's
    :class:`~engram_trt.models.parallel.TensorParallel` group the backbone is sharded
    over); leave them None on one device. ``engram_trt.LLM(path, tp=N)`` starts the group
    itself (:class:`engram_trt.distributed.llm.LLM`).
    """

    def __init__(
        self,
        path: str,
        *,
        backend: str = "auto",
        engram_config: Any = None,
        device: Any = "auto",
        dtype: Any = None,
        max_batch_size: int | None = None,
        max_seq_len: int | None = None,
        max_num_tokens: int | None = None,
        verify_tables: bool = False,
        progress: bool = True,
        table_options: dict[str, Any] | None = None,
        engram_lookup: Any = None,
        scheduler_factory: Any = None,
        cuda_graphs: bool = True,
        allow_unused_weights: bool = False,
        tensor_parallel: Any = None,
    ) -> None:
        from engram_trt.engram.tokenizer import load_tokenizer
        from engram_trt.llmapi.chat import read_tokenizer_settings
        from engram_trt.runtime.engine_folder import open_model_source
        from engram_trt.runtime.runner import ModelRunner
        from engram_trt.runtime.scheduler import Scheduler

        ecfg = (
            engram_config
            if isinstance(engram_config, EngramConfig) or engram_config is None
            else EngramConfig.parse(engram_config)
        )
        self.source = open_model_source(
            path,
            engram_config=ecfg,
            verify_tables=verify_tables,
            progress=progress,
            allow_unused_weights=allow_unused_weights,
        )
        if self.source.tokenizer_json is None and not self.source.manifest.get("token_ids_only"):
            raise EngramError(
                f"'{path}' names no tokenizer.json; the runtime needs it to turn text into tokens "
                f"(copy the model's tokenizer.json into the checkpoint, or build an engine with "
                f"--token-ids-only and send token ids)"
            )
        if self.source.tokenizer_json is None:  # an engine built with --token-ids-only
            from engram_trt.runtime.detokenize import TokenIdsOnly

            self.tokenizer: Any = TokenIdsOnly()
            self.tokenizer_settings = read_tokenizer_settings([])
        else:
            self.tokenizer = load_tokenizer(self.source.tokenizer_json)
            # tokenizer_config.json: beside the tokenizer, else in the checkpoint an engine was built from
            self.tokenizer_settings = read_tokenizer_settings(
                [self.source.tokenizer_json.parent, self.source.checkpoint]
            )
        self.runner = ModelRunner(
            self.source,
            backend=backend,
            device=device,
            dtype=dtype,
            engram_config=ecfg,
            max_batch=max_batch_size,
            max_seq_len=max_seq_len,
            max_num_tokens=max_num_tokens,
            progress=progress,
            table_options=table_options,
            cuda_graphs=cuda_graphs,
            engram_lookup=engram_lookup,
            tensor_parallel=tensor_parallel,
        )
        self.scheduler = (scheduler_factory or Scheduler)(self.runner, self.tokenizer)  # hook: engram_trt.distributed
        self._closed = False

    # -- what it is ------------------------------------------------------------------------
    @property
    def backend(self) -> str:
        """``torch`` or ``tensorrt``."""
        return self.runner.backend.name

    @property
    def backend_label(self) -> str:
        """The backend in words, as the CLI prints it (e.g. ``torch + engram cuda-kernels``)."""
        return self.runner.backend_label

    @property
    def backend_reason(self) -> str:
        return self.runner.backend_reason

    @property
    def storage(self) -> dict[str, Any]:
        """Where the tables live (kind, place, bytes)."""
        return self.runner.storage()

    @property
    def device(self) -> Any:
        return self.runner.device

    def stats(self) -> dict[str, Any]:
        """Scheduler and lookup counters (running / waiting requests, slots in use,
        tokens per step, rows looked up, bytes from host)."""
        st = self.scheduler.snapshot()
        if self.runner.prefetcher is not None:
            st["engram"] = dict(self.runner.prefetcher.stats)
        return st

    # -- prompts ---------------------------------------------------------------------------
    def encode(self, prompt: Any, *, add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of one prompt: text, or a list of token ids.

        Text is tokenized as transformers' ``AutoTokenizer`` does for the folder: with the
        special tokens of tokenizer.json's post-processor (a Llama tokenizer's BOS, say;
        transformers 5 takes them from there, not from tokenizer_config's ``add_bos_token``).
        ``add_special_tokens=False``: the text alone (a rendered chat template, which writes
        its own BOS)."""
        if isinstance(prompt, str):
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError:
                raise EngramError(
                    "the prompt is not valid UTF-8 text (it holds undecodable bytes); pass UTF-8 text or token ids"
                ) from None
            if not prompt:
                raise EngramError("the prompt is empty; give some text")
            ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens).ids
            if not ids:
                raise EngramError("the prompt is empty after tokenization; give some text")
            return prompt, list(ids)
        if isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)):
            ids = list(prompt)
            if not ids or any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
                raise EngramError("a token-id prompt must be a non-empty list of integers")
            return None, ids
        raise EngramError(f"a prompt is text or a list of token ids (got {type(prompt).__name__})")

    # -- chat --------------------------------------------------------------------------------
    @property
    def chat_template(self) -> str | None:
        """The tokenizer's chat template (tokenizer_config.json / chat_template.jinja), or None."""
        return self.tokenizer_settings.chat_template

    def apply_chat_template(
        self,
        messages: Any,
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text of one conversation, rendered as transformers'
        ``apply_chat_template(..., tokenize=False)`` renders it
        (:mod:`engram_trt.llmapi.chat`). ``chat_template``: another template than the
        tokenizer's."""
        from engram_trt.llmapi.chat import render_chat

        return render_chat(
            chat_template or self.chat_template,
            messages,
            special_tokens=self.tokenizer_settings.special_tokens,
            add_generation_prompt=add_generation_prompt,
            **template_kwargs,
        )

    def chat(
        self,
        messages: Any,
        sampling_params: Any = None,
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> list[RequestOutput]:
        """Generate the reply to a conversation, as vLLM's ``LLM.chat``: ``messages`` is
        one conversation (a list of ``{"role", "content"}``) or a list of them; each is
        rendered with the chat template and tokenized without adding special tokens (the
        template writes them), as transformers' ``apply_chat_template(tokenize=True)``.
        One finished :class:`RequestOutput` per conversation; its ``prompt`` is the
        rendered text."""
        self._check_open()
        if (
            isinstance(messages, Sequence)
            and messages
            and all(isinstance(m, Sequence) and not isinstance(m, (str, bytes)) for m in messages)
        ):
            convs = list(messages)
        else:
            convs = [messages]
        params = as_param_list(sampling_params, len(convs))
        texts = [
            self.apply_chat_template(
                c, add_generation_prompt=add_generation_prompt, chat_template=chat_template, **template_kwargs
            )
            for c in convs
        ]
        handles = []
        for text, sp in zip(texts, params):
            _, ids = self.encode(text, add_special_tokens=False)
            handles.append(
                self.scheduler.submit(ids, SamplingParams.coerce(sp), prompt=text, sink=None, request_id=None)
            )
        return [self.wait(h) for h in handles]

    @staticmethod
    def _prompt_list(prompts: Any) -> list[Any]:
        if isinstance(prompts, str):
            return [prompts]
        if (
            isinstance(prompts, Sequence)
            and prompts
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts)
        ):
            return [list(prompts)]  # one prompt of token ids
        if isinstance(prompts, Sequence):
            return list(prompts)
        raise EngramError(
            f"prompts must be text, a list of token ids, or a list of either (got {type(prompts).__name__})"
        )

    # -- submission (thread-safe) ------------------------------------------------------------
    def submit(
        self, prompt: Any, sampling_params: Any = None, *, sink: Any = None, request_id: str | None = None
    ) -> Any:
        """Queue one request; ``sink(RequestOutput)`` is called from the engine thread with
        each delta (the last one has ``finished``). Returns a handle for :meth:`cancel`
        and :meth:`wait`."""
        self._check_open()
        text, ids = self.encode(prompt)
        return self.scheduler.submit(
            ids, SamplingParams.coerce(sampling_params), prompt=text, sink=sink, request_id=request_id
        )

    def cancel(self, handle: Any) -> None:
        self.scheduler.cancel(handle)

    @staticmethod
    def wait(handle: Any, timeout: float | None = None) -> RequestOutput:
        if not handle.done.wait(timeout):
            raise EngramError(f"request {handle.request_id} did not finish within {timeout} s")
        return handle.output()

    def generate(self, prompts: Any, sampling_params: Any = None) -> list[RequestOutput]:
        """One finished :class:`RequestOutput` per prompt (in order), all batched together."""
        items = self._prompt_list(prompts)
        params = as_param_list(sampling_params, len(items))
        handles = [self.submit(p, sp) for p, sp in zip(items, params)]
        return [self.wait(h) for h in handles]

    def generate_stream(self, prompts: Any, sampling_params: Any = None) -> Iterator[RequestOutput]:
        """Each request's deltas as they come (interleaved across prompts; ``request_id``
        tells them apart, ``finished`` marks each one's last). Breaking out of the loop
        cancels what is still running."""
        items = self._prompt_list(prompts)
        params = as_param_list(sampling_params, len(items))
        q: queue.Queue[RequestOutput] = queue.Queue()
        handles = [self.submit(p, sp, sink=q.put) for p, sp in zip(items, params)]
        left = len(handles)
        try:
            while left:
                out = q.get()
                if out.finished:
                    left -= 1
                yield out
        finally:
            for h in handles:
                if not h.finished:
                    self.cancel(h)

    async def generate_async(
        self, prompt: Any, sampling_params: Any = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """asyncio form for servers: one request's deltas, awaited without blocking the
        event loop (the engine thread hands them over with ``call_soon_threadsafe``).
        Cancelling the consuming task cancels the request."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        handle = self.submit(
            prompt, sampling_params, sink=lambda o: loop.call_soon_threadsafe(q.put_nowait, o), request_id=request_id
        )
        try:
            while True:
                out = await q.get()
                yield out
                if out.finished:
                    return
        finally:
            if not handle.finished:
                self.cancel(handle)

    # -- lifetime -------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise EngramError("this LLM is closed; create a new one")

    def close(self) -> None:
        """Stop the engine thread (unfinished requests end 'cancelled') and free the KV
        cache, the staging buffers and the tables (pinned memory unregistered, shared
        segments detached: they stay in /dev/shm for the next process)."""
        if self._closed:
            return
        self._closed = True
        self.scheduler.close()
        self.runner.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
