"""Minimal clients of Triton's HTTP ``generate`` endpoints, standard library only.

For scripts and checks that should not need ``tritonclient``: ``POST
/v2/models/engram_llm/generate`` (one JSON object back) and ``generate_stream``
(server-sent events, one ``data: {...}`` per response). Triton writes a one-element
tensor as a JSON scalar and longer ones as lists; :func:`ids` reads either.
"""

from __future__ import annotations

import http.client
import json
import urllib.parse
from typing import Any, Iterator

from engram_trt.triton import MODEL_NAME


def _conn(base_url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    u = urllib.parse.urlsplit(base_url)
    return http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout), u.path.rstrip("/")


def _body(inputs: dict[str, Any] | bytes) -> bytes:
    return inputs if isinstance(inputs, bytes) else json.dumps(inputs).encode()


def generate(
    base_url: str, inputs: dict[str, Any] | bytes, *, timeout: float = 120.0, model: str = MODEL_NAME
) -> tuple[int, dict[str, Any]]:
    """(HTTP status, the JSON object) of one ``generate`` call; ``inputs`` is the JSON
    body (a dict, or raw bytes to send as is)."""
    conn, root = _conn(base_url, timeout)
    try:
        conn.request(
            "POST",
            f"{root}/v2/models/{model}/generate",
            body=_body(inputs),
            headers={"Content-Type": "application/json"},
        )
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"{}")
    finally:
        conn.close()


class EventStream:
    """The events of one ``generate_stream`` call, as JSON objects, read as they arrive.
    ``close()`` drops the connection (the server then cancels the request)."""

    def __init__(
        self, base_url: str, inputs: dict[str, Any] | bytes, *, timeout: float = 120.0, model: str = MODEL_NAME
    ) -> None:
        self._conn, root = _conn(base_url, timeout)
        self._conn.request(
            "POST",
            f"{root}/v2/models/{model}/generate_stream",
            body=_body(inputs),
            headers={"Content-Type": "application/json", "Accept": "text/event-stream"},
        )
        self._resp = self._conn.getresponse()
        self.status = self._resp.status

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self.status != 200:
            # A refused request: Triton answers with one JSON object, or one error event.
            body = self._resp.read().strip()
            if not body.startswith(b"data:"):
                yield json.loads(body or b"{}")
                return
            lines = iter(body.splitlines(keepends=True) + [b"\n"])
            readline = lambda: next(lines, b"")  # noqa: E731
        else:
            readline = self._resp.readline
        data: list[str] = []
        while True:
            raw = readline()
            if not raw:
                break
            line = raw.decode("utf-8").rstrip("\r\n")
            if line.startswith("data:"):
                data.append(line[5:].lstrip())
            elif not line and data:
                yield json.loads("\n".join(data))
                data = []
        if data:
            yield json.loads("\n".join(data))

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> "EventStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def generate_stream(
    base_url: str, inputs: dict[str, Any] | bytes, *, timeout: float = 120.0, model: str = MODEL_NAME
) -> list[dict[str, Any]]:
    """Every event of one ``generate_stream`` call (waits for the last)."""
    with EventStream(base_url, inputs, timeout=timeout, model=model) as s:
        return list(s)


def ids(value: Any) -> list[int]:
    """``output_ids`` of a response as a list (a JSON scalar when it holds one id)."""
    if value is None:
        return []
    if isinstance(value, list):
        return [int(v) for v in value]
    return [int(value)]


def collect(events: list[dict[str, Any]]) -> tuple[str, list[int], str | None, str | None]:
    """(text, ids, finish_reason, error) of a streamed request's events joined."""
    text, out, reason, error = "", [], None, None
    for ev in events:
        if "error" in ev:
            error = ev["error"]
            continue
        text += ev.get("text_output", "")
        out += ids(ev.get("output_ids"))
        reason = ev.get("finish_reason", reason)
    return text, out, reason, error
