"""Chat templates rendered the way ``transformers`` renders them, without importing transformers.

Hugging Face chat templates are Jinja2 run in an ``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and
``lstrip_blocks``, the loop-controls extension, a ``tojson`` filter that keeps non-ASCII text, and the globals
``raise_exception`` and ``strftime_now``. Templates written for transformers rely on exactly these, so we
provide the same set (transformers' ``utils/chat_template_utils.py``).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from jinja2 import Template, TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from shared.tool_prompt import template_inputs, template_supports_tools


class ChatTemplateError(ValueError):
    """The template refused the conversation (``raise_exception``) or failed to render."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # transformers' version: unlike jinja2's built-in, it does not HTML-escape and keeps non-ASCII text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class ChatTemplate:
    """One compiled chat template. Compiling costs milliseconds, so the model catalog keeps one per model."""

    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self._template: Template | None = None
        self._compile_error: str | None = None
        try:
            self._template = env.from_string(source)
        except TemplateError as exc:
            # Kept, not raised: a broken template must fail chat requests, not the model's plain completions.
            self._compile_error = f"the model's chat template does not compile: {exc}"
        self._special_tokens = dict(special_tokens)
        self.supports_tools = template_supports_tools(source)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt text for ``messages`` (and ``tools``: ``shared.tool_prompt``), ending with the assistant
        turn's opening when asked to."""
        if self._template is None:
            raise ChatTemplateError(self._compile_error or "no chat template")
        messages, tools = template_inputs(messages, tools, self.supports_tools)
        extra = {"tools": tools} if tools else {}
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **extra, **self._special_tokens
            )
        except TemplateError as exc:
            raise ChatTemplateError(str(exc)) from exc
        except (TypeError, ValueError, AttributeError, KeyError, IndexError) as exc:
            # A template written for other message shapes; the conversation is what the client controls.
            raise ChatTemplateError(f"the chat template cannot render these messages: {exc}") from exc
