"""What ``LLM.generate`` returns: one :class:`RequestOutput` per prompt (the shape users
know from vLLM and TensorRT-LLM's LLM API), and the streamed deltas."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

FINISH_REASONS = ("length", "stop", "eos", "cancelled", "error")


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # one of FINISH_REASONS once finished
    stop_reason: str | int | None = None  # the stop string or stop id that ended it


@dataclass
class RequestOutput:
    """A request's state: the whole output so far, and for a streamed event the part
    new since the last one (``delta_text`` / ``delta_token_ids``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    error: str | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> str | int | None:
        return self.outputs[0].stop_reason

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
