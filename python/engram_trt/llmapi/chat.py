"""Chat templates: a conversation rendered into the prompt text the model was trained on.

A checkpoint's ``tokenizer_config.json`` names its special tokens (``bos_token``,
``eos_token`` ...) and its ``chat_template``, a Jinja template (transformers 5 may save
it beside as ``chat_template.jinja``, which then wins). :func:`render_chat` renders it
the way transformers' ``apply_chat_template`` does, so the same conversation gives the
same text, and the same token ids once encoded without special tokens (the template
writes the BOS itself where the model wants one):

* a sandboxed Jinja environment with ``trim_blocks`` and ``lstrip_blocks`` and the loop
  controls extension (``{% break %}`` / ``{% continue %}``);
* a ``tojson`` filter that leaves non-ASCII text and HTML characters as they are;
* the globals ``raise_exception(message)`` and ``strftime_now(format)``;
* the variables ``messages``, ``add_generation_prompt`` and every special token of the
  tokenizer config by name (``bos_token`` ...), plus any extra keyword given.

jinja2 comes with torch (one of its dependencies); it is imported only when a chat is
rendered.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from engram_trt.errors import EngramError

TOKENIZER_CONFIG_NAME = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# The special-token attributes transformers hands a chat template (its special_tokens_map).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
MIN_JINJA = (3, 1, 6)  # older versions have known sandbox escapes; chat templates are untrusted code


@dataclass(frozen=True)
class TokenizerSettings:
    """What ``tokenizer_config.json`` (and ``chat_template.jinja``) of a folder say."""

    special_tokens: dict[str, str] = field(default_factory=dict)  # bos_token -> its text ...
    chat_template: str | None = None
    source: Path | None = None  # the folder they were read from (None: no tokenizer_config.json found)


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: text, or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _pick_template(raw: Any, where: Path) -> str | None:
    """``chat_template``: one template, or a list of ``{"name", "template"}`` (the one
    named ``default`` is the chat template, as transformers picks it)."""
    if raw is None or isinstance(raw, str):
        return raw
    if isinstance(raw, list):
        named = {e.get("name"): e.get("template") for e in raw if isinstance(e, Mapping)}
        t = named.get("default")
        return t if isinstance(t, str) else None
    raise EngramError(
        f"{where}: 'chat_template' must be text or a list of {{name, template}} (got "
        f"{type(raw).__name__}); fix the tokenizer config"
    )


def read_tokenizer_settings(folders: Iterable[str | Path | None]) -> TokenizerSettings:
    """The settings of the first of ``folders`` holding a ``tokenizer_config.json`` (a
    ``chat_template.jinja`` there replaces its ``chat_template``). None found: no
    special tokens and no template."""
    seen: set[Path] = set()
    for folder in folders:
        if folder is None:
            continue
        d = Path(folder)
        if d in seen or not (d / TOKENIZER_CONFIG_NAME).is_file():
            seen.add(d)
            continue
        path = d / TOKENIZER_CONFIG_NAME
        try:
            cfg = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise EngramError(
                f"{path}: not a readable JSON tokenizer config ({type(exc).__name__}: "
                f"{' '.join(str(exc).split())[:120]}); fix or remove it"
            ) from None
        if not isinstance(cfg, dict):
            raise EngramError(f"{path}: a tokenizer config is a JSON object (got {type(cfg).__name__})")
        specials = {n: t for n in SPECIAL_TOKEN_NAMES if (t := _token_text(cfg.get(n))) is not None}
        template = _pick_template(cfg.get("chat_template"), path)
        jinja_file = d / CHAT_TEMPLATE_FILE
        if jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        return TokenizerSettings(specials, template, d)
    return TokenizerSettings()


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """One conversation: a non-empty list of ``{"role": str, "content": str, ...}``."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise EngramError("a chat is a non-empty list of messages such as [{'role': 'user', 'content': 'Hi'}]")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise EngramError(f"chat message {i} is a {type(m).__name__}, not a dict with 'role' and 'content'")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise EngramError(f"chat message {i} has no 'role' (text such as 'user', 'assistant' or 'system')")
        if "content" in m and not isinstance(m["content"], (str, list)) and m["content"] is not None:
            raise EngramError(f"chat message {i}: 'content' must be text (got {type(m['content']).__name__})")
        out.append(dict(m))
    return out


def _environment() -> Any:
    try:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise EngramError(
            "chat templates need the package 'jinja2' (>= 3.1.6); run: pip install 'jinja2>=3.1.6'"
        ) from None
    version = tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit())
    if version < MIN_JINJA:
        raise EngramError(
            f"jinja2 {jinja2.__version__} has known sandbox escapes and chat templates are untrusted code; "
            f"run: pip install -U 'jinja2>=3.1.6'"
        )

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
    ) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def render_chat(
    template: str | None,
    messages: Any,
    *,
    special_tokens: Mapping[str, str] | None = None,
    add_generation_prompt: bool = True,
    **extra: Any,
) -> str:
    """The prompt text of one conversation (see the module docstring). ``template``
    None: refused, naming the fix (the model has no chat template)."""
    if not template:
        raise EngramError(
            "the model's tokenizer has no chat template (no 'chat_template' in tokenizer_config.json, no "
            "chat_template.jinja); pass plain prompts, or add the model's template to its tokenizer_config.json"
        )
    msgs = check_messages(messages)
    env = _environment()
    import jinja2

    try:
        compiled = env.from_string(template)
        return compiled.render(
            messages=msgs, add_generation_prompt=bool(add_generation_prompt), **{**dict(special_tokens or {}), **extra}
        )
    except jinja2.exceptions.TemplateError as exc:
        raise EngramError(
            f"the chat template refused the conversation or failed ({type(exc).__name__}: "
            f"{' '.join(str(exc).split())[:200]})"
        ) from None
