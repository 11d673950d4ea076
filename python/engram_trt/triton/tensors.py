"""The model's tensors and the parsing of one request's inputs.

Names and types are the TensorRT-LLM backend's (its ``ensemble`` model), which users
already script against: a ``generate`` call written for TensorRT-LLM works here
unchanged. ``max_batch_size`` is 1 in the written config, so every tensor carries a
leading batch dimension of 1 (``[1, 1]`` for a scalar), as TensorRT-LLM clients send;
the HTTP ``generate`` endpoints add it for JSON scalars.

Parsing is a pure function of the input arrays (no Triton import), so every refusal is
unit-tested here and the model only turns an :class:`EngramError` into an error
response. Each refusal is one line naming the input and what to send instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from engram_trt.errors import EngramError
from engram_trt.runtime.sampling_params import MAX_SEED, SamplingParams


@dataclass(frozen=True)
class TensorSpec:
    name: str
    data_type: str  # Triton's TYPE_* name
    dims: tuple[int, ...]
    optional: bool = False
    doc: str = ""


INPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("text_input", "TYPE_STRING", (1,), doc="the prompt, UTF-8 text"),
    TensorSpec(
        "max_tokens", "TYPE_INT32", (1,), True, "most new tokens (default: the model's default_max_tokens parameter)"
    ),
    TensorSpec("temperature", "TYPE_FP32", (1,), True, "0 or absent: greedy; > 0: sampling"),
    TensorSpec("top_p", "TYPE_FP32", (1,), True, "nucleus mass in (0, 1]; 0 or absent: no cut (as TensorRT-LLM)"),
    TensorSpec("random_seed", "TYPE_UINT64", (1,), True, "sampling seed, 0..2^63-1 (default 0)"),
    TensorSpec(
        "stop_words",
        "TYPE_STRING",
        (-1,),
        True,
        "strings that end generation (excluded from the text); empty strings are ignored",
    ),
    TensorSpec(
        "stream",
        "TYPE_BOOL",
        (1,),
        True,
        "true: one response per new piece of text; false or absent: one response at the end",
    ),
    TensorSpec(
        "bad_words", "TYPE_STRING", (-1,), True, "accepted for TensorRT-LLM clients only when empty (not supported)"
    ),
    TensorSpec("top_k", "TYPE_INT32", (1,), True, "accepted for TensorRT-LLM clients only as 0 (off) or 1 (greedy)"),
    TensorSpec(
        "ignore_eos", "TYPE_BOOL", (1,), True, "engram-trt extension: true keeps generating past end-of-sequence ids"
    ),
    TensorSpec(
        "skip_special_tokens",
        "TYPE_BOOL",
        (1,),
        True,
        "true or absent: special tokens' text (an end token's, say) is left out of text_output; false keeps it",
    ),
)

OUTPUTS: tuple[TensorSpec, ...] = (
    TensorSpec(
        "text_output",
        "TYPE_STRING",
        (-1,),
        doc="streaming: the new text of this response; otherwise: the whole generated text",
    ),
    TensorSpec("output_ids", "TYPE_INT32", (-1,), doc="streaming: the new token ids; otherwise: all generated ids"),
    TensorSpec("finish_reason", "TYPE_STRING", (-1,), doc="in the last response only: length, stop or eos"),
)

INPUT_NAMES = tuple(t.name for t in INPUTS)


@dataclass(frozen=True)
class GenerateRequest:
    """One request, checked: the prompt text, how to generate, and whether to stream."""

    prompt: str
    params: SamplingParams
    stream: bool


def _one(name: str, arr: np.ndarray) -> Any:
    """The single element of a scalar input (any shape holding one value)."""
    if arr.size != 1:
        raise EngramError(
            f"input '{name}' must hold one value per request (got shape {list(arr.shape)}); "
            "send one prompt per request: concurrent requests are batched by the server"
        )
    return arr.reshape(-1)[0]


def _text(name: str, value: Any) -> str:
    """A BYTES element as text: UTF-8, strictly (a stray byte is refused, not replaced)."""
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, bytearray, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise EngramError(
                f"input '{name}' is not valid UTF-8 (byte 0x{bytes(value)[exc.start]:02x} at offset "
                f"{exc.start}); send UTF-8 text"
            ) from None
    raise EngramError(f"input '{name}' must be BYTES (text), got a {type(value).__name__} element")


def _integer(name: str, arr: np.ndarray) -> int:
    if arr.dtype.kind not in "iu":
        raise EngramError(f"input '{name}' must be an integer tensor (got {arr.dtype})")
    return int(_one(name, arr))


def _number(name: str, arr: np.ndarray) -> float:
    if arr.dtype.kind not in "fiu":
        raise EngramError(f"input '{name}' must be a number tensor (got {arr.dtype})")
    v = float(_one(name, arr))
    if not math.isfinite(v):
        raise EngramError(f"input '{name}' must be a finite number (got {v})")
    return v


def _flag(name: str, arr: np.ndarray) -> bool:
    if arr.dtype.kind != "b":
        raise EngramError(f"input '{name}' must be BOOL (got {arr.dtype})")
    return bool(_one(name, arr))


def _words(name: str, arr: np.ndarray) -> tuple[str, ...]:
    words = [_text(name, v) for v in arr.reshape(-1)]
    return tuple(w for w in words if w)


def parse_request(get: Callable[[str], np.ndarray | None], default_max_tokens: int = 16) -> GenerateRequest:
    """Check one request's inputs (``get(name)``: the input's array, or None when the
    request does not carry it) and return what to generate."""
    arr = get("text_input")
    if arr is None:
        raise EngramError("the request has no 'text_input' (the prompt); send it as a BYTES tensor / JSON string")
    prompt = _text("text_input", _one("text_input", arr))
    if not prompt:
        raise EngramError("input 'text_input' is empty; send a prompt")

    max_tokens = default_max_tokens
    if (arr := get("max_tokens")) is not None:
        max_tokens = _integer("max_tokens", arr)
        if max_tokens < 1:
            raise EngramError(f"input 'max_tokens' must be >= 1 (got {max_tokens})")
    temperature = 0.0
    if (arr := get("temperature")) is not None:
        temperature = _number("temperature", arr)
        if temperature < 0:
            raise EngramError(f"input 'temperature' must be >= 0 (got {temperature}); 0 is greedy")
    top_p = 1.0
    if (arr := get("top_p")) is not None:
        top_p = _number("top_p", arr)
        if top_p == 0:
            top_p = 1.0  # TensorRT-LLM's "no top-p cut"
        elif not 0 < top_p <= 1:
            raise EngramError(f"input 'top_p' must be in (0, 1], or 0 for no cut (got {top_p})")
    seed = None
    if (arr := get("random_seed")) is not None:
        seed = _integer("random_seed", arr)
        if not 0 <= seed <= MAX_SEED:
            raise EngramError(f"input 'random_seed' must be in 0..2^63-1 (got {seed})")
    if (arr := get("top_k")) is not None:
        top_k = _integer("top_k", arr)
        if top_k == 1:
            temperature = 0.0
        elif top_k != 0:
            raise EngramError(
                f"input 'top_k' {top_k} is not supported: send 0 (off) or 1 (greedy), "
                "and use top_p for nucleus sampling"
            )
    if (arr := get("bad_words")) is not None and _words("bad_words", arr):
        raise EngramError("input 'bad_words' is not supported; send it empty or leave it out")
    stop = _words("stop_words", arr) if (arr := get("stop_words")) is not None else ()
    stream = _flag("stream", arr) if (arr := get("stream")) is not None else False
    ignore_eos = _flag("ignore_eos", arr) if (arr := get("ignore_eos")) is not None else False
    skip = _flag("skip_special_tokens", arr) if (arr := get("skip_special_tokens")) is not None else True
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        stop=stop,
        ignore_eos=ignore_eos,
        skip_special_tokens=skip,
    )
    return GenerateRequest(prompt, params, stream)
