"""Incremental detokenization: a sequence's text kept up to date one token at a time.

Why: decoding a request's whole output after every token costs O(length) per token,
O(length^2) per request, all of it on the engine thread between two steps. Here each
token decodes only a short window: the tokens since the last point where the text was
complete (no trailing replacement character) plus the token before that point, whose
text is subtracted again. The context is there for decoders whose output for a token
depends on its neighbours (a Metaspace decoder drops the leading space of the first
token it sees, a tokenizer without a decoder joins tokens with spaces); the window
starts where the text was complete for byte-level decoders, which must start on a
character boundary.

:attr:`IncrementalText.text` equals ``tokenizer.decode(ids, skip_special_tokens=False)``
of all ids so far; where a decoder's window text does not extend the text of its context
(a decoder that rewrites earlier text) the whole sequence is decoded once and the window
starts again from there, so the equality never rests on the window alone.
"""

from __future__ import annotations

from typing import Any

REPLACEMENT_CHAR = "\ufffd"


class IncrementalText:
    """The text of ``ids`` (a list the caller appends to), updated by :meth:`update`."""

    __slots__ = ("_tok", "ids", "text", "_stable", "_prefix", "_read", "_prefix_text")

    def __init__(self, tokenizer: Any, ids: list[int]) -> None:
        self._tok = tokenizer
        self.ids = ids
        self.text = ""
        self._stable = ""  # decode(ids[:_read]): text that later tokens cannot change
        self._prefix = 0  # the window starts here, at the complete point before _read ...
        self._read = 0  # ... and the text of ids[_prefix:_read] is _prefix_text
        self._prefix_text = ""

    @property
    def stable_len(self) -> int:
        """Characters at the start of :attr:`text` that later tokens cannot change (so a
        stop string found later cannot lie wholly inside them)."""
        return len(self._stable)

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def update(self) -> str:
        """Take the ids appended since the last call; returns the whole text."""
        ids = self.ids
        n = len(ids)
        window = self._decode(ids[self._prefix:])
        if not window.startswith(self._prefix_text):  # the decoder rewrote its context: decode all, once
            self.text = self._decode(ids)
            self._commit(n, self.text)
            return self.text
        pending = window[len(self._prefix_text):]
        self.text = self._stable + pending
        if pending and not pending.endswith(REPLACEMENT_CHAR):
            self._commit(n, self.text)
        return self.text

    def _commit(self, n: int, text: str) -> None:
        """ids[:n] decode to ``text``, which ends on a complete character: the next
        window starts at the previous such point (a complete chunk of context)."""
        if text.endswith(REPLACEMENT_CHAR):  # only after a full decode: nothing is complete yet
            return
        self._stable = text
        self._prefix, self._read = self._read, n
        self._prefix_text = self._decode(self.ids[self._prefix:n])
