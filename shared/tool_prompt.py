"""How tools and tool-call history reach the model's chat template (used by the API, to count, and the worker).

A template that handles tools itself (its source mentions ``tools``, as Qwen 2.5, Llama 3.1, Hermes and Mistral
templates do) gets the tool list as ``tools=`` and the messages as OpenAI sends them: assistant ``tool_calls``
(arguments parsed back into objects, as those templates expect) and ``tool`` messages.

Otherwise (the fallback; SmolLM2's template, for one) the conversation is rewritten into plain text turns, in the
Hermes format that many models were tuned on:
- the tools are described in the system message (appended to the client's, or a new first one), with the
  format to call them: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per call;
- an assistant turn's ``tool_calls`` become such blocks after its text;
- a ``tool`` message becomes a ``user`` turn ``<tool_response>\\n...\\n</tool_response>``.
The API parses the same blocks out of the output (``api.tool_calls``), whichever way the prompt was written.
"""

from __future__ import annotations

import json
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"


def template_supports_tools(template_source: str | None) -> bool:
    """Whether a chat template renders a ``tools`` list itself."""
    return template_source is not None and "tools" in template_source


def tool_call_block(name: str, arguments: Any) -> str:
    """One call as the model writes it: ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return text


def _system_prompt(tools: list[dict[str, Any]]) -> str:
    described = "\n".join(json.dumps(tool.get("function", tool), ensure_ascii=False) for tool in tools)
    return ("You may call functions to help with the user's request. The available functions:\n"
            f"{described}\n"
            "To call a function, reply with a block like this for each call (and nothing else in the block):\n"
            f'{TOOL_CALL_OPEN}\n{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}\n{TOOL_CALL_CLOSE}')


def template_inputs(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, supports_tools: bool
                    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and ``tools`` argument for the template; ``messages`` are wire dicts (None fields dropped)."""
    if supports_tools:
        out = []
        for message in messages:
            message = {**message, "content": message.get("content") or ""}
            if message.get("tool_calls"):
                message["tool_calls"] = [
                    {**call, "function": {**call["function"], "arguments": _arguments(call["function"]["arguments"])}}
                    for call in message["tool_calls"]]
            out.append(message)
        return out, tools or None
    return _fallback(messages, tools), None


def _fallback(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        elif message.get("tool_calls"):
            blocks = [tool_call_block(c["function"]["name"], _arguments(c["function"]["arguments"]))
                      for c in message["tool_calls"]]
            out.append({"role": role, "content": "\n".join(([content] if content else []) + blocks)})
        else:
            out.append({"role": role, "content": content})
    if tools:
        prompt = _system_prompt(tools)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
