"""Structured outputs and tools at the API: what is accepted, what is a 400 naming the field, and how calls are
parsed out of generated text (whole and streamed). Generation itself is the scripted engine's; the real model's
outputs are checked in tests/compat and the grammar's in tests/engine/test_grammar.py."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import redis
from conftest import ApiServer

from api.openai_models import ChatCompletionChunk, ChatCompletionRequest
from api.openai_stream import ChatChunks
from api.tool_calls import ToolCallChunks, parse_tool_calls, plan_tools
from shared import keys
from shared.schemas import JobSubmission
from shared.tool_prompt import template_inputs, tool_call_block
from tests.worker.scripted_engine import MODEL, InProcessWorker

KS = keys.Keyspace()  # the key layout of one queue shard, what these tests run with

CHAT: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"x"}'}}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(("extra", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "not json"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, "response_format"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_grammar": "start: nowhere"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {"xml": "<a/>"}}, "structured_outputs.xml"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools.0"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
])
def test_bad_structured_requests_are_a_400_naming_the_field(api: ApiServer, extra: dict[str, Any], param: str
                                                             ) -> None:
    response = httpx.post(f"{api.base_url}/v1/chat/completions", json={**CHAT, **extra}, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def _submitted(api: ApiServer) -> JobSubmission:
    client = redis.Redis.from_url(api.settings.redis_url or "")
    try:
        (job_key,) = [k for k in client.scan_iter(KS.job("*")) if client.type(k) == b"hash"]
        return JobSubmission.model_validate_json(client.hget(job_key, "submission") or b"")
    finally:
        client.close()


@pytest.mark.parametrize(("endpoint", "extra", "kind"), [
    ("chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA,
                                                                                      "strict": True}}},
     "json_schema"),
    ("chat/completions", {"structured_outputs": {"choice": ["yes", "no"]}}, "lark"),
    ("completions", {"response_format": {"type": "json_object"}}, "json_object"),
    ("completions", {"guided_regex": r"\d+"}, "regex"),
    ("chat/completions", {"tools": [TOOL], "tool_choice": "required"}, "lark"),
])
def test_structured_requests_run_with_their_grammar(api: ApiServer, worker: InProcessWorker, endpoint: str,
                                                    extra: dict[str, Any], kind: str) -> None:
    body = {**CHAT, **extra} if endpoint.startswith("chat") else {"model": MODEL, "prompt": "hello", "max_tokens": 2,
                                                                  **extra}
    response = httpx.post(f"{api.base_url}/v1/{endpoint}", json=body, timeout=30)
    assert response.status_code == 200, response.text
    grammar = _submitted(api).params.grammar
    assert grammar is not None and grammar.kind == kind


def test_tool_history_with_null_content_is_accepted(api: ApiServer, worker: InProcessWorker) -> None:
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    response = httpx.post(f"{api.base_url}/v1/chat/completions",
                          json={**CHAT, "messages": messages, "tools": [TOOL]}, timeout=30)
    assert response.status_code == 200, response.text
    submitted = _submitted(api)
    assert submitted.tools and submitted.tools[0].function.name == "get_weather"
    assert submitted.messages and submitted.messages[1].tool_calls and submitted.messages[2].tool_call_id == "c1"


def test_jobs_api_takes_a_grammar_and_refuses_a_broken_one(api: ApiServer, worker: InProcessWorker) -> None:
    ok = httpx.post(f"{api.base_url}/v1/jobs", json={"prompt": "hi", "max_tokens": 2,
                                                     "grammar": {"kind": "regex", "value": "[ab]+"}}, timeout=30)
    assert ok.status_code in (200, 201, 202), ok.text
    bad = httpx.post(f"{api.base_url}/v1/jobs", json={"prompt": "hi", "grammar": {"kind": "lark", "value": "x"}},
                     timeout=30)
    assert bad.status_code in (400, 422) and "grammar" in bad.text


def test_calls_are_parsed_out_of_text() -> None:
    names = {"get_weather"}
    text = "Let me check.\n" + tool_call_block("get_weather", {"city": "Paris"}) + "\n" + tool_call_block(
        "get_weather", {"city": "Rome"})
    content, calls = parse_tool_calls(text, names)
    assert content == "Let me check."
    assert [json.loads(c.function.arguments) for c in calls] == [{"city": "Paris"}, {"city": "Rome"}]
    assert len({c.id for c in calls}) == 2
    unknown = tool_call_block("launch_rockets", {})
    assert parse_tool_calls(unknown, names) == (unknown, [])
    assert parse_tool_calls("<tool_call>\n{not json\n</tool_call>", names)[1] == []


def test_streamed_content_stops_at_a_call_which_goes_out_whole() -> None:
    plan = plan_tools(ChatCompletionRequest.model_validate({**CHAT, "tools": [TOOL]}))
    assert plan is not None and plan.choice == "auto" and plan.grammar() is None
    fmt = ToolCallChunks(ChatChunks("chatcmpl-x", 0, MODEL, False), plan)
    text = "Sure. " + tool_call_block("get_weather", {"city": "Oslo"})
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    streamed = ""
    for piece in pieces[:-1]:
        chunk = fmt.delta(0, piece, None)
        if chunk is not None:
            assert isinstance(chunk, ChatCompletionChunk)
            streamed += chunk.choices[0].delta.content or ""
    assert streamed == "Sure. "
    final = fmt.finish(0, pieces[-1], "stop")
    assert isinstance(final, ChatCompletionChunk)
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.delta.tool_calls
    assert choice.delta.tool_calls[0].index == 0 and choice.delta.tool_calls[0].function.name == "get_weather"


def test_required_grammar_admits_only_calls() -> None:
    plan = plan_tools(ChatCompletionRequest.model_validate({**CHAT, "tools": [TOOL], "tool_choice": "required",
                                                            "parallel_tool_calls": False}))
    assert plan is not None
    grammar = plan.grammar()
    assert grammar is not None and grammar.kind == "lark" and "get_weather" in grammar.value
    assert 'start: call\n' in grammar.value  # one call only


def test_fallback_prompt_writes_tools_calls_and_results_as_text() -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": "", "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    out, tools = template_inputs(messages, [TOOL], supports_tools=False)
    assert tools is None
    assert out[0]["content"].startswith("Be brief.") and "get_weather" in out[0]["content"]
    assert out[2] == {"role": "assistant", "content": tool_call_block("get_weather", {"city": "x"})}
    assert out[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    native, native_tools = template_inputs(messages, [TOOL], supports_tools=True)
    assert native_tools == [TOOL] and native[2]["tool_calls"][0]["function"]["arguments"] == {"city": "x"}
