"""The tokenizer half of ``engram-trt import-gguf`` (:mod:`engram_trt.checkpoint.gguf_import`):
a GGUF file's ``tokenizer.ggml.*`` metadata rebuilt with ``tokenizers`` as the
``tokenizer.json`` / ``tokenizer_config.json`` pair transformers loads.

* ``tokenizer.ggml.model == "gpt2"``: a byte-level BPE, the pre-tokenizer split chosen by
  ``tokenizer.ggml.pre`` (llama.cpp's regexes for the values in
  :data:`SUPPORTED_PRE_TOKENIZERS`; another value is refused rather than guessed).
* ``"llama"`` (sentencepiece): a byte-fallback BPE with a ``▁`` metaspace, merges taken
  from the file or rebuilt from the token scores.

Control tokens become special added tokens, user-defined ones plain added tokens.
``tokenizer_config.json`` carries the special tokens, ``add_bos_token`` /
``add_eos_token`` (and the post-processor that adds them) and the chat template(s),
named ones included. Every refusal is a :class:`~engram_trt.errors.CheckpointError`
naming the file and the metadata key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Protocol

import numpy as np

from engram_trt.errors import CheckpointError, EngramError

# GGML token types (llama.cpp's llama_token_type).
_TT_NORMAL, _TT_UNKNOWN, _TT_CONTROL, _TT_USER_DEFINED, _TT_UNUSED, _TT_BYTE = 1, 2, 3, 4, 5, 6

# The pre-tokenizer splits of tokenizer.ggml.pre (llama.cpp's llm_tokenizer_bpe regexes) this
# importer rebuilds; another value is refused rather than guessed.
_GPT2_PRES = ("default", "gpt-2", "gpt2")
_LLAMA3_PRES = ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx")
_SMOLLM_PRES = ("smollm",)
_TEKKEN_PRES = ("tekken",)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SUPPORTED_PRE_TOKENIZERS = _GPT2_PRES + _LLAMA3_PRES + _SMOLLM_PRES + _TEKKEN_PRES


class GGUFMetadata(Protocol):
    """What the tokenizer reads of a GGUF file: its key/value metadata (``get`` / ``keys``)
    and its path, for the messages (``gguf_import._Meta`` is one)."""

    path: Path

    def get(self, key: str, default: Any = None) -> Any: ...

    def keys(self) -> list[str]: ...


def where(path: Path) -> str:
    """How a message names the file (the importer's and the tokenizer's alike)."""
    return f"GGUF '{path}'"


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map: bytes that print stand for themselves,
    the others take the characters from U+0100 on, in byte order."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    out: dict[int, str] = {}
    extra = 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def _special_token(meta: GGUFMetadata, tokens: list[str], name: str) -> str | None:
    tid = meta.get(f"tokenizer.ggml.{name}_token_id")
    if tid is None:
        return None
    if isinstance(tid, bool) or not isinstance(tid, (int, np.integer)) or not 0 <= int(tid) < len(tokens):
        raise CheckpointError(
            f"{where(meta.path)}: metadata 'tokenizer.ggml.{name}_token_id' = {tid!r:.40} is not an "
            f"id of its {len(tokens)} tokens"
        )
    return tokens[int(tid)]


def _merges(meta: GGUFMetadata, byte_level: bool) -> list[tuple[str, str]] | None:
    raw = meta.get("tokenizer.ggml.merges")
    if raw is None:
        return None
    out = []
    for m in raw:
        parts = m.split(" ")
        if len(parts) != 2 or not all(parts):
            if byte_level:
                raise CheckpointError(
                    f"{where(meta.path)}: merge {m!r:.40} in 'tokenizer.ggml.merges' is not two tokens "
                    f"separated by one space; the file is damaged"
                )
            parts = m.split(" ", 1)
        out.append((parts[0], parts[1]))
    return out


def _merges_from_scores(tokens: list[str], scores: list[float], vocab: Mapping[str, int]) -> list[tuple[str, str]]:
    """Sentencepiece-style merges a vocabulary implies: each token splits into every pair
    of tokens that spell it; a merge ranks by the score of the token it makes (best
    first), then by the lengths of its parts (longer first); the splits of one token by
    their ids."""
    cands: list[tuple[float, int, int, str, str]] = []
    seen: set[str] = set()
    for tok, score in zip(tokens, scores):
        if tok in seen:
            continue
        seen.add(tok)
        local = []
        for i in range(1, len(tok)):
            left, right = tok[:i], tok[i:]
            if left in vocab and right in vocab:
                local.append((vocab[left], vocab[right], left, right))
        local.sort(key=lambda x: (x[0], x[1]))
        cands.extend((float(score), len(lf), len(rt), lf, rt) for _, _, lf, rt in local)
    cands.sort(key=lambda c: (c[0], c[1], c[2]), reverse=True)
    return [(c[3], c[4]) for c in cands]


def build_tokenizer(meta: GGUFMetadata, vocab_size: int, max_length: int) -> tuple[str, dict[str, Any]]:
    """``(tokenizer.json text, tokenizer_config.json dict)`` from the ``tokenizer.ggml.*``
    metadata of a model whose vocabulary has ``vocab_size`` rows (the tokenizer must list
    exactly that many tokens); ``max_length`` becomes ``model_max_length``."""
    try:
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    except ImportError:
        raise EngramError("the package 'tokenizers' is not installed; run: pip install tokenizers") from None
    path = meta.path
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if kind is None or tokens is None:
        raise CheckpointError(
            f"{where(path)} has no tokenizer ('tokenizer.ggml.model' / 'tokenizer.ggml.tokens' missing); "
            f"use a GGUF converted with its vocabulary"
        )
    tokens = [str(t) for t in tokens]
    if len(tokens) != vocab_size:
        raise CheckpointError(
            f"{where(path)}: the tokenizer lists {len(tokens)} tokens but the model's vocabulary has "
            f"{vocab_size} rows; the file is inconsistent"
        )
    types = meta.get("tokenizer.ggml.token_type") or [_TT_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise CheckpointError(
            f"{where(path)}: 'tokenizer.ggml.token_type' has {len(types)} entries for {len(tokens)} tokens"
        )
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    add_eos = meta.get("tokenizer.ggml.add_eos_token")
    specials = {
        name: _special_token(meta, tokens, key)
        for name, key in (
            ("bos_token", "bos"),
            ("eos_token", "eos"),
            ("unk_token", "unknown"),
            ("pad_token", "padding"),
        )
    }

    added: list[Any] = []
    if kind == "gpt2":
        pre = meta.get("tokenizer.ggml.pre") or "default"
        if pre not in SUPPORTED_PRE_TOKENIZERS:
            raise CheckpointError(
                f"{where(path)}: pre-tokenizer 'tokenizer.ggml.pre' = '{pre}' is not one this importer "
                f"rebuilds (supported: {', '.join(SUPPORTED_PRE_TOKENIZERS)})"
            )
        alphabet = _byte_alphabet()
        chars = set(alphabet.values())
        spelled = [t if set(t) <= chars else "".join(alphabet[b] for b in t.encode("utf-8")) for t in tokens]
        vocab = {t: i for i, t in enumerate(spelled)}
        merges = _merges(meta, byte_level=True)
        if merges is None:
            raise CheckpointError(
                f"{where(path)}: a byte-level BPE vocabulary ('gpt2') without 'tokenizer.ggml.merges'; "
                f"the file is incomplete"
            )
        tok = Tokenizer(
            models.BPE(
                vocab=vocab,
                merges=merges,
                dropout=None,
                continuing_subword_prefix="",
                end_of_word_suffix="",
                fuse_unk=False,
                byte_fallback=False,
            )
        )
        if pre in _GPT2_PRES:
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        elif pre in _SMOLLM_PRES:  # llama.cpp: every digit alone, then GPT-2's split
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Digits(individual_digits=True),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
                ]
            )
        else:
            split = _LLAMA3_SPLIT if pre in _LLAMA3_PRES else _TEKKEN_SPLIT
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(split), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        tok.decoder = decoders.ByteLevel()
        for t, tt in zip(tokens, types):
            # A control token spelled outside the byte alphabet is a mislabelled normal token:
            # adding it would give it a second id, so it stays a vocabulary entry.
            if tt == _TT_CONTROL and set(t) <= chars:
                added.append(AddedToken(t, normalized=False, special=True))
            elif tt == _TT_USER_DEFINED and t in vocab:
                added.append(AddedToken(t, normalized=False, special=False))
        add_bos = bool(add_bos) if add_bos is not None else False
    elif kind == "llama":
        scores = meta.get("tokenizer.ggml.scores")
        vocab = {t: i for i, t in enumerate(tokens)}
        merges = _merges(meta, byte_level=False)
        if merges is None:
            if scores is None or len(scores) != len(tokens):
                raise CheckpointError(
                    f"{where(path)}: a sentencepiece vocabulary ('llama') needs 'tokenizer.ggml.scores' "
                    f"(one per token) or 'tokenizer.ggml.merges'; the file is incomplete"
                )
            merges = _merges_from_scores(tokens, [float(s) for s in scores], vocab)
        prefix = meta.get("tokenizer.ggml.add_space_prefix")
        prefix = True if prefix is None else bool(prefix)
        tok = Tokenizer(
            models.BPE(
                vocab=vocab,
                merges=merges,
                dropout=None,
                unk_token=specials["unk_token"],
                fuse_unk=True,
                byte_fallback=True,
            )
        )
        tok.normalizer = None
        tok.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="\u2581", prepend_scheme="first" if prefix else "never", split=False
        )
        steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        if prefix:
            steps.append(decoders.Strip(content=" ", left=1, right=0))
        tok.decoder = decoders.Sequence(steps)
        for t, tt in zip(tokens, types):
            if tt in (_TT_CONTROL, _TT_UNKNOWN):
                added.append(AddedToken(t, normalized=False, special=True))
            elif tt == _TT_USER_DEFINED:
                added.append(AddedToken(t, normalized=False, special=False))
        add_bos = True if add_bos is None else bool(add_bos)  # llama.cpp's default for sentencepiece vocabularies
    else:
        raise CheckpointError(
            f"{where(path)}: tokenizer 'tokenizer.ggml.model' = '{kind}' is not translated (supported: "
            f"gpt2 (byte-level BPE), llama (sentencepiece))"
        )
    special_added = [a for a in added if a.special]
    plain_added = [a for a in added if not a.special]
    if special_added:
        tok.add_special_tokens(special_added)
    if plain_added:
        tok.add_tokens(plain_added)
    if tok.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise CheckpointError(
            f"{where(path)}: the rebuilt tokenizer has {tok.get_vocab_size(with_added_tokens=True)} "
            f"tokens, not the file's {len(tokens)} (duplicate token spellings); the file is damaged"
        )
    add_eos = bool(add_eos) if add_eos is not None else False
    bos, eos = specials["bos_token"], specials["eos_token"]
    add_bos = add_bos and bos is not None
    add_eos = add_eos and eos is not None
    single = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
    pair = single + ([f"{bos}:1"] if add_bos else []) + ["$B:1"] + ([f"{eos}:1"] if add_eos else [])
    special_ids: dict[str, int] = {}
    if add_bos:
        special_ids[bos] = int(meta.get("tokenizer.ggml.bos_token_id"))
    if add_eos:
        special_ids[eos] = int(meta.get("tokenizer.ggml.eos_token_id"))
    tok.post_processor = processors.TemplateProcessing(
        single=" ".join(single), pair=" ".join(pair), special_tokens=list(special_ids.items())
    )

    tcfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
    }
    tcfg.update({k: v for k, v in specials.items() if v is not None})
    template = meta.get("tokenizer.chat_template")
    named = sorted(
        k[len("tokenizer.chat_template.") :] for k in meta.keys() if k.startswith("tokenizer.chat_template.")
    )
    if named:
        entries = ([{"name": "default", "template": str(template)}] if template is not None else []) + [
            {"name": n, "template": str(meta.get(f"tokenizer.chat_template.{n}"))} for n in named
        ]
        tcfg["chat_template"] = entries
    elif template is not None:
        tcfg["chat_template"] = str(template)
    return tok.to_str(pretty=True), tcfg
