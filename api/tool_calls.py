"""OpenAI function calling over plain generation: the request's tool plan, the grammar that guarantees a call,
and the calls parsed out of the generated text (whole responses and streams).

The model writes calls as ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks
(``shared.tool_prompt``, which also puts the tools into the prompt). ``tool_choice``:
- ``none``: the tools are in the prompt, the output is plain content (never parsed);
- ``auto`` (the default with tools): the model chooses; blocks naming a given tool with JSON arguments become
  ``tool_calls`` (finish reason ``tool_calls``), any other text stays content;
- ``required`` / ``{"type": "function", "function": {"name": ...}}``: a grammar makes the output one call (or,
  with ``parallel_tool_calls``, one or more) to any tool / the named one, its arguments valid against the tool's
  ``parameters`` schema. The grammar cannot combine with ``response_format``.
Streams send content as it comes until a ``<tool_call>`` opens; each call is then sent whole, in one delta.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError

from api.errors import invalid_request
from api.openai_models import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessageOut,
    FunctionCallOut,
    ToolCallDelta,
    ToolCallOut,
)
from api.openai_stream import ChatChunks
from shared.grammar import close_objects, json_schema_text
from shared.schemas import Grammar, TokenLogprob, ToolSpec, Usage
from shared.tool_prompt import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request asked of its tools: ``choice`` is none, auto, required or a tool's name."""

    tools: list[ToolSpec]
    choice: str
    parallel: bool

    @property
    def names(self) -> set[str]:
        return {t.function.name for t in self.tools}

    @property
    def parses_calls(self) -> bool:
        return self.choice != "none"

    def grammar(self) -> Grammar | None:
        """The grammar that guarantees a call (required / named), else None."""
        if self.choice in ("none", "auto"):
            return None
        tools = [t for t in self.tools if self.choice == "required" or t.function.name == self.choice]
        schema = {"anyOf": [_call_schema(t) for t in tools]} if len(tools) > 1 else _call_schema(tools[0])
        schema = {**schema, "x-guidance": {"whitespace_flexible": False}}  # compact JSON, as shared.grammar's schemas
        block = json.dumps(TOOL_CALL_OPEN + "\n") + f" %json {json_schema_text(schema)} " + json.dumps(
            "\n" + TOOL_CALL_CLOSE)
        start = 'start: call ("\\n" call)*' if self.parallel else "start: call"
        return Grammar(kind="lark", value=f"{start}\ncall: {block}")


def _call_schema(tool: ToolSpec) -> dict[str, object]:
    parameters = close_objects(tool.function.parameters or {"type": "object"})
    return {"type": "object", "properties": {"name": {"const": tool.function.name}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def plan_tools(body: ChatCompletionRequest) -> ToolPlan | None:
    """The request's tool plan (None without tools); 400 naming the field for anything malformed."""
    if not body.tools:
        for name in ("tool_choice", "parallel_tool_calls"):
            if getattr(body, name) is not None:
                raise invalid_request(f"{name} requires tools", param=name)
        return None
    tools = []
    for i, tool in enumerate(body.tools):
        try:
            tools.append(ToolSpec.model_validate(tool))
        except ValidationError as exc:
            raise invalid_request(f"tools[{i}] must be a function tool: {exc.errors()[0]['msg']}",
                                  param=f"tools.{i}") from None
    choice = _choice(body.tool_choice, {t.function.name for t in tools})
    if body.parallel_tool_calls is not None and not isinstance(body.parallel_tool_calls, bool):
        raise invalid_request("parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    return ToolPlan(tools, choice, body.parallel_tool_calls is not False)


def _choice(tool_choice: Any, names: set[str]) -> str:
    if tool_choice is None:
        return "auto"
    if tool_choice in ("none", "auto", "required"):
        return str(tool_choice)
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if name in names:
            return str(name)
        raise invalid_request(f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
    raise invalid_request('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                          '{"name": ...}}', param="tool_choice")


def parse_tool_calls(text: str, names: set[str]) -> tuple[str | None, list[ToolCallOut]]:
    """``(content, calls)`` of a generated text: complete blocks calling a known tool with JSON arguments become
    calls and leave the content; with no such block the text is all content."""
    calls: list[ToolCallOut] = []
    kept: list[str] = []
    last = 0
    for match in _BLOCK.finditer(text):
        call = _call(match.group(1), names)
        if call is None:
            continue
        calls.append(call)
        kept.append(text[last:match.start()])
        last = match.end()
    if not calls:
        return text, []
    content = "".join([*kept, text[last:]]).strip()
    return content or None, calls


def _call(body: str, names: set[str]) -> ToolCallOut | None:
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or data.get("name") not in names:
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCallOut(id=f"call_{secrets.token_hex(12)}", function=FunctionCallOut(name=data["name"],
                                                                                     arguments=text))


def apply_tool_calls(response: ChatCompletionResponse, plan: ToolPlan) -> ChatCompletionResponse:
    """The response with each choice's calls parsed out (finish reason ``tool_calls`` where there are some)."""
    if not plan.parses_calls:
        return response
    for choice in response.choices:
        content, calls = parse_tool_calls(choice.message.content or "", plan.names)
        if calls:
            choice.message = ChatMessageOut(content=content, tool_calls=calls)
            if choice.finish_reason == "stop":
                choice.finish_reason = "tool_calls"
    return response


@dataclass
class _StreamedChoice:
    text: str = ""
    num_sent: int = 0  # characters of ``text`` sent as content
    in_calls: bool = False  # a ``<tool_call>`` opened: the rest is held until the end


@dataclass
class ToolCallChunks:
    """A ``ChunkFormat`` for chat streams with tools: content streams until a call opens; calls go out whole."""

    chat: ChatChunks
    plan: ToolPlan
    choices: dict[int, _StreamedChoice] = field(default_factory=dict)

    def opening(self, index: int) -> BaseModel | None:
        return self.chat.opening(index)

    def delta(self, index: int, text: str, logprobs: list[TokenLogprob] | None) -> BaseModel | None:
        if not self.plan.parses_calls:
            return self.chat.delta(index, text, logprobs)
        state = self.choices.setdefault(index, _StreamedChoice())
        state.text += text
        if state.in_calls:
            return None
        opened = state.text.find(TOOL_CALL_OPEN, state.num_sent)
        state.in_calls = opened >= 0
        end = opened if state.in_calls else len(state.text) - _held_back(state.text)
        new = state.text[state.num_sent:end]
        state.num_sent = max(state.num_sent, end)
        return self.chat.delta(index, new, logprobs) if new or logprobs else None

    def finish(self, index: int, text: str, finish_reason: str) -> BaseModel:
        if not self.plan.parses_calls:
            return self.chat.finish(index, text, finish_reason)
        state = self.choices.setdefault(index, _StreamedChoice())
        state.text += text
        unsent = state.text[state.num_sent:]
        content, calls = parse_tool_calls(unsent, self.plan.names)
        if not calls:
            return self.chat.finish(index, unsent, finish_reason)
        delta = ChatDelta(content=content, tool_calls=[ToolCallDelta(index=i, **c.model_dump())
                                                       for i, c in enumerate(calls)])
        reason = "tool_calls" if finish_reason == "stop" else finish_reason
        return ChatCompletionChunk(id=self.chat.completion_id, created=self.chat.created, model=self.chat.model,
                                   choices=[ChatChunkChoice(index=index, delta=delta, finish_reason=reason)])

    def usage(self, usage: Usage) -> BaseModel:
        return self.chat.usage(usage)


def _held_back(text: str) -> int:
    """Length of the longest end of ``text`` that may be the start of a ``<tool_call>`` (not sent yet)."""
    for size in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-size:]):
            return size
    return 0

