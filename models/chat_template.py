"""A checkpoint's chat template, rendered with Jinja2 the way transformers renders it.

Where it comes from (as transformers reads it): ``tokenizer_config.json``'s ``chat_template``
(a string, or a list of ``{"name", "template"}`` of which "default" is used), else a
``chat_template.jinja`` file beside it, else the tokenizer's own ``chat_template`` string (a
GGUF file's metadata). A checkpoint with none has no template (:func:`load_chat_template`
returns None).

Rendering: a sandboxed Jinja2 environment (``trim_blocks``, ``lstrip_blocks``, loop controls),
the variables ``messages``, ``add_generation_prompt``, ``tools`` (the request's functions as
``{"type": "function", "function": {...}}``, or None), ``documents`` (None)
and the special token strings (``bos_token``, ``eos_token``, ``unk_token``, ``pad_token``),
the helpers ``raise_exception`` (its message becomes a ``ValueError``, e.g. "roles must
alternate"), ``strftime_now`` and a ``tojson`` filter that keeps non-ASCII text. The rendered
text already holds the template's special tokens, so it is tokenized without adding more.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


class ChatTemplateError(ValueError):
    """The template refused the conversation (``raise_exception``) or failed to render."""


def _raise(message: str):
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators=None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def read_chat_template(model_dir: str | Path, tokenizer_config: dict) -> str | None:
    """The checkpoint's template source, or None (see the module docstring)."""
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if isinstance(template, str) and template:
        return template
    path = Path(model_dir) / TEMPLATE_FILE
    return path.read_text(encoding="utf-8") if path.is_file() else None


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def load_chat_template(model_dir: str | Path, tokenizer=None) -> ChatTemplate | None:
    """The checkpoint's template ready to render, or None; ``tokenizer`` (a
    ``pdserve.models.Tokenizer``) fills what the folder lacks: its template string and the
    special tokens' text from their ids."""
    config: dict = {}
    config_path = Path(model_dir) / "tokenizer_config.json"
    if Path(model_dir).is_dir() and config_path.is_file():
        config = json.loads(config_path.read_text(encoding="utf-8"))
    source = read_chat_template(model_dir, config) if Path(model_dir).is_dir() else None
    if source is None and isinstance(getattr(tokenizer, "chat_template", None), str):
        source = tokenizer.chat_template
    if source is None:
        return None
    special = {name: _token_content(config.get(name)) for name in SPECIAL_TOKENS}
    if tokenizer is not None:
        if special["bos_token"] is None and tokenizer.bos_token_id is not None:
            special["bos_token"] = tokenizer.id_to_token(tokenizer.bos_token_id)
        if special["eos_token"] is None and tokenizer.eos_token_ids:
            special["eos_token"] = tokenizer.id_to_token(tokenizer.eos_token_ids[0])
    return ChatTemplate(source, special)


class ChatTemplate:
    """``ChatTemplate(source, {"bos_token": "<s>", ...}).render(messages)`` -> prompt text."""

    def __init__(self, source: str, special_tokens: dict[str, str | None]) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
        try:
            self._template = env.from_string(source)
            self.source = source  # what it was compiled from (tool_calling reads its syntax)
        except jinja2.TemplateError as exc:
            raise ValueError(f"the chat template does not compile: {exc}") from None
        self._special = {name: special_tokens.get(name) or "" for name in SPECIAL_TOKENS}

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               tools: list[dict] | None = None) -> str:
        try:
            return self._template.render(messages=messages,
                                         add_generation_prompt=add_generation_prompt,
                                         tools=tools, documents=None, **self._special)
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, KeyError, AttributeError) as exc:
            raise ChatTemplateError(f"rendering failed: {exc}") from None
