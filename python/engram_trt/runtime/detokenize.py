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

:attr:`IncrementalText.text` equals ``tokenizer.decode(ids, skip_special_tokens=S)`` of
all ids so far (``S``: the request's ``skip_special_tokens``, True by default as in vLLM, so
a chat answer does not end in ``<|im_end|>``); where a decoder's window text does not extend the text of its context
(a decoder that rewrites earlier text) the whole sequence is decoded once and the window
starts again from there, so the equality never rests on the window alone.

Skipping special tokens: a ``tokenizers`` decode drops the special added tokens before its
decoder runs, so ``decode(ids, skip_special_tokens=True)`` is ``decode`` of the ids with
those removed. The window runs over that filtered list, so the equality above rests on
that property and the window argument alone, and a run of skipped tokens (a chat turn's
end, say) costs no decode at all.

Byte-fallback runs (:attr:`IncrementalText.settled_len`): a ``ByteFallback`` decoder
(SentencePiece-style ``<0xNN>`` tokens) decodes a run of consecutive byte tokens as one
UTF-8 string, or, when the run is not valid UTF-8, as one U+FFFD per byte, the ASCII
ones included: ``<0x41>`` alone is ``A``, ``<0x41><0xFF>`` is two U+FFFD. So the text of
a trailing run can still be rewritten by the next token, and a stream must not send it
until a token that is not a byte ends the run (or the request ends).
"""

from __future__ import annotations

import json
import re
from typing import Any

REPLACEMENT_CHAR = "\ufffd"
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def special_token_ids(tokenizer: Any) -> frozenset[int] | None:
    """The ids ``tokenizer.decode(..., skip_special_tokens=True)`` leaves out: the added
    tokens marked special (a ``tokenizers.Tokenizer``), else ``all_special_ids`` (a
    transformers tokenizer); None when the tokenizer says neither (then the decoder's own
    flag is used and the window may hold skipped tokens)."""
    added = getattr(tokenizer, "get_added_tokens_decoder", None)
    if callable(added):
        return frozenset(int(i) for i, t in added().items() if getattr(t, "special", False))
    ids = getattr(tokenizer, "all_special_ids", None)
    return frozenset(int(i) for i in ids) if ids is not None else None


def _decoder_types(node: Any) -> set[str]:
    """Every ``"type"`` in a tokenizer.json decoder (a Sequence nests others)."""
    out: set[str] = set()
    if isinstance(node, dict):
        if isinstance(node.get("type"), str):
            out.add(node["type"])
        for value in node.values():
            out |= _decoder_types(value)
    elif isinstance(node, list):
        for value in node:
            out |= _decoder_types(value)
    return out


def byte_fallback_ids(tokenizer: Any) -> frozenset[int]:
    """The ids of the ``<0xNN>`` byte tokens when the tokenizer's decoder is (or holds) a
    ``ByteFallback``, whose runs a later byte token can rewrite; empty otherwise (a
    byte-level BPE's text only ever grows, and a tokenizer that is not a ``tokenizers``
    one says nothing about its decoder)."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)  # a transformers fast tokenizer
    to_str = getattr(backend, "to_str", None)
    if not callable(to_str):
        return frozenset()
    try:
        decoder = json.loads(to_str()).get("decoder")
    except (ValueError, TypeError):
        return frozenset()
    if "ByteFallback" not in _decoder_types(decoder):
        return frozenset()
    vocab = backend.get_vocab(with_added_tokens=True)
    return frozenset(int(i) for t, i in vocab.items() if _BYTE_TOKEN.fullmatch(t))


class IncrementalText:
    """The text of ``ids`` (a list the caller appends to), updated by :meth:`update`;
    special tokens left out unless ``skip_special_tokens`` is False. ``special_ids``:
    the ids to leave out, when the caller has them already (one set for all requests);
    by default :func:`special_token_ids` of the tokenizer. ``byte_ids``: the byte tokens
    of a ByteFallback decoder, whose trailing run :attr:`settled_len` leaves out; by
    default :func:`byte_fallback_ids` of the tokenizer (a caller with many requests
    asks once and passes the set, empty for other decoders)."""

    __slots__ = (
        "_tok",
        "ids",
        "text",
        "_stable",
        "_prefix",
        "_read",
        "_prefix_text",
        "_skip",
        "_flag",
        "_vis",
        "_seen",
        "_bytes",
    )

    def __init__(
        self,
        tokenizer: Any,
        ids: list[int],
        skip_special_tokens: bool = True,
        special_ids: frozenset[int] | None = None,
        byte_ids: frozenset[int] | None = None,
    ) -> None:
        self._tok = tokenizer
        self.ids = ids
        skip = (
            (special_ids if special_ids is not None else special_token_ids(tokenizer)) if skip_special_tokens else None
        )
        # Filtered here (skip non-empty): the window sees only visible ids. Unknown
        # (None with skip_special_tokens): the decoder's own flag does the skipping.
        self._skip = skip or None
        self._flag = bool(skip_special_tokens) and skip is None
        self._vis: list[int] = [] if self._skip else ids  # the ids the text is made of
        self._seen = 0  # ids[:_seen] are sorted into _vis
        self.text = ""
        self._stable = ""  # decode(ids[:_read]): text that later tokens cannot change
        self._prefix = 0  # the window starts here, at the complete point before _read ...
        self._read = 0  # ... and the text of ids[_prefix:_read] is _prefix_text
        self._prefix_text = ""
        self._bytes = (
            byte_ids if byte_ids is not None else byte_fallback_ids(tokenizer)
        ) or None  # no commit point inside a byte run (see settled_len)

    @property
    def settled_len(self) -> int:
        """Characters at the start of :attr:`text` that no later token rewrites: all of it
        but the text of a trailing run of ByteFallback byte tokens (see the module's
        docstring); a stream sends no further than this before the request ends. With
        byte tokens the text is committed only where a token that is not a byte ends
        the run, so this is the committed text (and a window never starts inside a run,
        whose context text the next byte could rewrite)."""
        return len(self._stable) if self._bytes else len(self.text)

    @property
    def stable_len(self) -> int:
        """Characters at the start of :attr:`text` that later tokens cannot change (so a
        stop string found later cannot lie wholly inside them)."""
        return len(self._stable)

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._flag)

    def update(self) -> str:
        """Take the ids appended since the last call; returns the whole text."""
        if self._skip:
            new = [i for i in self.ids[self._seen :] if i not in self._skip]
            self._seen = len(self.ids)
            if not new:  # only skipped tokens came: the text is what it was
                return self.text
            self._vis.extend(new)
        ids = self._vis
        n = len(ids)
        window = self._decode(ids[self._prefix :])
        if not window.startswith(self._prefix_text):  # the decoder rewrote its context: decode all, once
            self.text = self._decode(ids)
            self._commit(n, self.text)
            return self.text
        pending = window[len(self._prefix_text) :]
        self.text = self._stable + pending
        if pending and not pending.endswith(REPLACEMENT_CHAR):
            self._commit(n, self.text)
        return self.text

    def _commit(self, n: int, text: str) -> None:
        """ids[:n] decode to ``text``, which ends on a complete character: the next
        window starts at the previous such point (a complete chunk of context)."""
        if text.endswith(REPLACEMENT_CHAR):  # only after a full decode: nothing is complete yet
            return
        if self._bytes and n and self._vis[n - 1] in self._bytes:
            return  # an open byte run: the next byte token may rewrite it, context included
        self._stable = text
        self._prefix, self._read = self._read, n
        self._prefix_text = self._decode(self._vis[self._prefix : n])


class TokenIdsOnly:
    """The tokenizer of an engine built with ``--token-ids-only`` (no tokenizer.json):
    text in is refused in one line, token ids out have no text."""

    def encode(self, text: str, add_special_tokens: bool = True) -> Any:
        from engram_trt.errors import EngramError

        raise EngramError(
            "this engine was built with --token-ids-only (its checkpoint had no tokenizer.json): "
            "send token ids, not text, or rebuild it from a checkpoint holding the model's "
            "tokenizer.json"
        )

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        return ""
